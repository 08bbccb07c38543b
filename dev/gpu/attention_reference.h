/*
 * attention_reference.h: causal attention forward and backward in double precision from bf16
 * inputs, with a tolerance per element from the sum of |terms| of its contraction, and the
 * comparisons against it. The tolerances and why they hold are stated in
 * dev/gpu/test_attention.cu's header (cuDNN and the flash kernels on a GPU); the emulated
 * GPU's test of the flash kernels (dev/test/test_fast_emu.cpp) uses the same.
 * Needs floatX and __bfloat162float (cuda_common.cuh) and fatal (llmc/utils.h).
 */
#ifndef LLMC_DEV_GPU_ATTENTION_REFERENCE_H
#define LLMC_DEV_GPU_ATTENTION_REFERENCE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static const double U_BF16 = 1.0 / 256.0;          // 2^-8: bf16's unit roundoff
static const double TOL_BF16 = 4.0 * U_BF16;        // 2^-6
static const double TOL_FP32_SUM = 1.0 / 131072.0; // 2^-17
static const double TOL_STATS = 1.0 / 8192.0;      // 2^-13

// --- inputs -----------------------------------------------------------------------------------

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double rnd_uniform(void) {   // [0, 1)
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

// a bf16 value and its exact float
static void fill_bf16(floatX* h, float* f, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) {
        h[i] = __float2bfloat16_rn((float)(lo + (hi - lo) * rnd_uniform()));
        f[i] = __bfloat162float(h[i]);
    }
}

// --- the reference ----------------------------------------------------------------------------

typedef struct {
    int B, T, NH, HS;
    float *qkv, *dout;                      // exact values of the bf16 inputs
    double *out, *lse, *tol_out;            // (B,T,C), (B,NH,T), (B,T,C)
    double *dqkv, *tol_dqkv;                // (B,T,3C)
} Ref;

// causal attention forward and backward in double for one (b, h), with the tolerances above
static void reference_head(Ref* r, int b, int h, double* P, double* dS) {
    const int T = r->T, HS = r->HS, C = r->NH * HS, C3 = 3 * C;
    const double scale = 1.0 / sqrt((double)HS);
    const float* q = r->qkv + (size_t)b * T * C3 + h * HS;
    const float* k = q + C;
    const float* v = q + 2 * C;
    const float* dO = r->dout + (size_t)b * T * C + h * HS;
    double* out = r->out + (size_t)b * T * C + h * HS;
    double* tol_out = r->tol_out + (size_t)b * T * C + h * HS;
    double* lse = r->lse + ((size_t)b * r->NH + h) * T;
    double* dq = r->dqkv + (size_t)b * T * C3 + h * HS;
    double* dk = dq + C;
    double* dv = dq + 2 * C;
    double* tdq = r->tol_dqkv + (size_t)b * T * C3 + h * HS;
    double* tdk = tdq + C;
    double* tdv = tdq + 2 * C;
    // forward: P (T x T, lower triangle), out, lse, tol_out
    for (int t = 0; t < T; t++) {
        double* p = P + (size_t)t * T;
        double m = -INFINITY;
        for (int j = 0; j <= t; j++) {
            double s = 0.0;
            for (int d = 0; d < HS; d++) { s += (double)q[(size_t)t * C3 + d] * (double)k[(size_t)j * C3 + d]; }
            p[j] = s * scale;
            m = p[j] > m ? p[j] : m;
        }
        double z = 0.0;
        for (int j = 0; j <= t; j++) {
            p[j] = exp(p[j] - m);
            z += p[j];
        }
        for (int j = 0; j <= t; j++) { p[j] /= z; }
        lse[t] = m + log(z);
        for (int d = 0; d < HS; d++) {
            double o = 0.0, a = 0.0;
            for (int j = 0; j <= t; j++) {
                double vv = (double)v[(size_t)j * C3 + d];
                o += p[j] * vv;
                a += p[j] * fabs(vv);
            }
            out[(size_t)t * C + d] = o;
            tol_out[(size_t)t * C + d] = TOL_BF16 * a;
        }
    }
    // backward
    for (size_t i = 0; i < (size_t)T; i++) {
        for (int d = 0; d < HS; d++) {
            dq[i * C3 + d] = dk[i * C3 + d] = dv[i * C3 + d] = 0.0;
            tdq[i * C3 + d] = tdk[i * C3 + d] = tdv[i * C3 + d] = 0.0;
        }
    }
    double* E = (double*)malloc(sizeof(double) * (size_t)T);   // per key, for the current row
    for (int t = 0; t < T; t++) {
        const double* p = P + (size_t)t * T;
        double* ds = dS + (size_t)t * T;
        double D = 0.0, eD = 0.0;
        for (int d = 0; d < HS; d++) {
            double g = (double)dO[(size_t)t * C + d];
            D += g * out[(size_t)t * C + d];
            eD += fabs(g) * tol_out[(size_t)t * C + d];
        }
        for (int j = 0; j <= t; j++) {
            double dp = 0.0, a = 0.0;
            for (int d = 0; d < HS; d++) {
                double g = (double)dO[(size_t)t * C + d], vv = (double)v[(size_t)j * C3 + d];
                dp += g * vv;
                a += fabs(g) * fabs(vv);
            }
            ds[j] = p[j] * (dp - D);
            E[j] = eD + TOL_FP32_SUM * a + U_BF16 * fabs(dp);
        }
        for (int j = 0; j <= t; j++) {
            double w = TOL_BF16 * fabs(ds[j]) + p[j] * E[j];   // error weight of this (t, j)
            for (int d = 0; d < HS; d++) {
                double g = (double)dO[(size_t)t * C + d];
                double qq = (double)q[(size_t)t * C3 + d], kk = (double)k[(size_t)j * C3 + d];
                dv[(size_t)j * C3 + d] += p[j] * g;
                tdv[(size_t)j * C3 + d] += TOL_BF16 * p[j] * fabs(g);
                dq[(size_t)t * C3 + d] += scale * ds[j] * kk;
                tdq[(size_t)t * C3 + d] += scale * w * fabs(kk);
                dk[(size_t)j * C3 + d] += scale * ds[j] * qq;
                tdk[(size_t)j * C3 + d] += scale * w * fabs(qq);
            }
        }
    }
    free(E);
}

static void reference(Ref* r) {
    const int T = r->T;
    #pragma omp parallel
    {
        double* P = (double*)calloc((size_t)T * T, sizeof(double));
        double* dS = (double*)calloc((size_t)T * T, sizeof(double));
        if (!P || !dS) { fatal("out of memory in the CPU reference"); }
        #pragma omp for schedule(dynamic, 1)
        for (int bh = 0; bh < r->B * r->NH; bh++) { reference_head(r, bh / r->NH, bh % r->NH, P, dS); }
        free(P);
        free(dS);
    }
}

// A case: the reference's arrays allocated, random bf16 inputs (q and k uniform in [-2, 2], v
// and dout in [-1, 1]) in h_qkv (B,T,3C) and h_dout (B,T,C) and their exact floats in r.
static void reference_case(Ref* r, int B, int T, int NH, int HS, floatX* h_qkv, floatX* h_dout) {
    const int C = NH * HS, C3 = 3 * C;
    const size_t n_qkv = (size_t)B * T * C3, n_out = (size_t)B * T * C, n_st = (size_t)B * NH * T;
    r->B = B; r->T = T; r->NH = NH; r->HS = HS;
    r->qkv = (float*)malloc_or_die(n_qkv * sizeof(float), "qkv ref");
    r->dout = (float*)malloc_or_die(n_out * sizeof(float), "dout ref");
    r->out = (double*)malloc_or_die(n_out * sizeof(double), "out ref");
    r->tol_out = (double*)malloc_or_die(n_out * sizeof(double), "out tol");
    r->lse = (double*)malloc_or_die(n_st * sizeof(double), "lse ref");
    r->dqkv = (double*)malloc_or_die(n_qkv * sizeof(double), "dqkv ref");
    r->tol_dqkv = (double*)malloc_or_die(n_qkv * sizeof(double), "dqkv tol");
    for (long bt = 0; bt < (long)B * T; bt++) {
        fill_bf16(h_qkv + bt * C3, r->qkv + bt * C3, (size_t)2 * C, -2.0, 2.0);             // q, k
        fill_bf16(h_qkv + bt * C3 + 2 * C, r->qkv + bt * C3 + 2 * C, (size_t)C, -1.0, 1.0);   // v
    }
    fill_bf16(h_dout, r->dout, n_out, -1.0, 1.0);
}

static void reference_free(Ref* r) {
    free(r->qkv); free(r->dout); free(r->out); free(r->tol_out); free(r->lse); free(r->dqkv); free(r->tol_dqkv);
}

// --- comparisons ------------------------------------------------------------------------------

typedef struct {
    double ratio, err, tol;   // worst |gpu - ref| / tol, and |gpu - ref|, tol at that element
    long bad;                 // elements over tolerance or not finite
} Cmp;

static void cmp_add(Cmp* c, double gpu, double ref, double tol) {
    double err = fabs(gpu - ref);
    if (!isfinite(gpu)) {
        c->bad++;
        c->ratio = INFINITY;
        c->err = INFINITY;
        c->tol = tol;
        return;
    }
    double ratio = err / (tol + 1e-30);
    if (err > tol) { c->bad++; }
    if (ratio > c->ratio) {
        c->ratio = ratio;
        c->err = err;
        c->tol = tol;
    }
}

// part: 0 q, 1 k, 2 v of dqkv (B,T,3C); or the whole of out (B,T,C) with part = -1
static Cmp compare_bf16(const floatX* gpu, const double* ref, const double* tol, int B, int T, int C, int part) {
    Cmp c = {0, 0, 0, 0};
    int W = part < 0 ? C : 3 * C, off = part < 0 ? 0 : part * C;
    for (long bt = 0; bt < (long)B * T; bt++) {
        for (int i = 0; i < C; i++) {
            size_t idx = (size_t)bt * W + off + i;
            cmp_add(&c, (double)__bfloat162float(gpu[idx]), ref[idx], tol[idx]);
        }
    }
    return c;
}

static Cmp compare_stats(const float* gpu, const double* lse, long n, double mult) {
    Cmp c = {0, 0, 0, 0};
    for (long i = 0; i < n; i++) { cmp_add(&c, (double)gpu[i] * mult, lse[i], TOL_STATS * (1.0 + fabs(lse[i]))); }
    return c;
}

static Cmp cmp_max(Cmp a, Cmp b) {
    Cmp m = a.ratio >= b.ratio ? a : b;
    m.bad = a.bad + b.bad;
    return m;
}

#endif // LLMC_DEV_GPU_ATTENTION_REFERENCE_H
