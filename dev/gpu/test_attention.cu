/*
 * dev/gpu/test_attention.cu: cuDNN's fused causal attention (llmc/attention_cudnn.cuh), forward
 * and backward, on a GPU, against a plain CPU reference in double precision computed from the
 * same bf16 inputs, and against the project's flash kernels (llmc/attention_flash.cuh, head
 * sizes 16/32/64) where they apply. Built by mk/cudnn.mk as build/test_attention_gpu:
 *
 *   build/test_attention_gpu        every case; one table line per case; exit 0 if all pass
 *   no GPU: one line saying so, exit 77 (skip)
 *
 * Cases: B = 2, T in {64, 256, 1024}, NH in {4, 12}, HS in {64, 128}; q and k uniform in
 * [-2, 2] (scores of standard deviation ~1.3 after the 1/sqrt(HS) scale: peaked softmax rows),
 * v and dout uniform in [-1, 1], all rounded to bf16. Per case:
 *   fwd    out (B,T,C) and stats (B,NH,T, natural-log log-sum-exp) against the reference
 *   bwd    dq, dk, dv (parts of dqkv) against the reference; the deterministic backward (the
 *          default) is run twice and must give the same bits (reported in "rep")
 *   flash  (HS = 64) attention_forward_fast / attention_backward_fast against the same
 *          reference and tolerances (their base-2 stats converted), and their repeatability
 *   extra  T = 256: the inference forward (training = 0, statistics not written) against the
 *          reference; NH = 12 and T in {64, 1024}: the nondeterministic backward
 *          (cudnn_attention_deterministic = 0) against the reference, repeatability reported only
 * Every output buffer is filled with NaN before each call, so an element left unwritten fails.
 *
 * Tolerances, from bf16 precision. bf16 keeps 8 significant bits: rounding to nearest has a
 * relative error of at most u = 2^-8. The GPU computes products of bf16 values exactly and
 * accumulates in fp32 (relative error about HS * 2^-24 <= 2^-17 for the q.k and dout.v sums,
 * negligible next to u except where noted), but rounds to bf16 (a) the probabilities P before
 * P.V and P^T.dout, (b) dS before dS.K and dS^T.Q, and (c) every output. Along each path at
 * most three such roundings meet (out: P, the normalizer's mismatch with the rounded P, the
 * output), each bounded by u times the sum of the absolute values of the terms, so every
 * element gets the tolerance 4u = 2^-6 times its "magnitude", the sum of |terms| of its
 * contraction, computed by the reference:
 *   out[t,d]  2^-6 * sum_j P[t,j] |v[j,d]|                       (>= |out|)
 *   dv[j,d]   2^-6 * sum_t P[t,j] |dout[t,d]|
 *   dk[j,d]   scale * sum_t (2^-6 |dS[t,j]| + P[t,j] E[t,j]) |q[t,d]|
 *   dq[t,d]   scale * sum_j (2^-6 |dS[t,j]| + P[t,j] E[t,j]) |k[j,d]|
 * where dS = P (dP - D), dP = dout.v, D = rowsum(dout * out), and E bounds the error of dP - D,
 * which cancels (so absolute errors count): E[t,j] = sum_d |dout[t,d]| tol_out[t,d] (the GPU's
 * D uses its own bf16 out) + 2^-17 sum_d |dout[t,d]| |v[j,d]| (dP in fp32) + u |dP[t,j]| (in
 * case an engine rounds dP to bf16 before subtracting D). stats: 2^-13 (1 + |lse|) (fp32
 * throughout; a wrong log base or a missing scale is off by tens of percent). A CPU emulation
 * of exactly these roundings stays below 0.45 of every tolerance, while a missing or shifted
 * mask, a wrong scale or base-2 statistics exceed them 20 to 10^6 times. The table prints,
 * per quantity, the worst ratio |gpu - ref| / tol (pass: <= 1) and next to it the max
 * |gpu - ref| and the tolerance at that element.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <omp.h>
#include "llmc/cuda_common.cuh"
#include "llmc/attention_flash.cuh"
#include "llmc/attention_cudnn.cuh"
#include "dev/gpu/attention_reference.h"

static int failures = 0;
static char fail_notes[64][256];
static int nfail_notes = 0;

static void note_fail(const char* fmt, ...) {
    failures++;
    if (nfail_notes < 64) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(fail_notes[nfail_notes++], 256, fmt, ap);
        va_end(ap);
    }
}

// "0.12" or "BAD" style cell for a worst ratio
static const char* ratio_cell(const Cmp* c, char* buf, size_t len) {
    if (c->bad) {
        snprintf(buf, len, "%.2g!", c->ratio);
    } else {
        snprintf(buf, len, "%.3f", c->ratio);
    }
    return buf;
}

// --- GPU helpers ------------------------------------------------------------------------------

static void fill_nan_bf16(floatX* d, size_t n) { cudaCheck(cudaMemset(d, 0xFF, n * sizeof(floatX))); }   // 0xFFFF: NaN
static void fill_nan_f32(float* d, size_t n) { cudaCheck(cudaMemset(d, 0xFF, n * sizeof(float))); }       // NaN

static double ms_since(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0.0f;
    cudaCheck(cudaEventElapsedTime(&ms, a, b));
    return (double)ms;
}

// --- one case ---------------------------------------------------------------------------------

static void run_case(int B, int T, int NH, int HS) {
    const int C = NH * HS, C3 = 3 * C;
    const size_t n_qkv = (size_t)B * T * C3, n_out = (size_t)B * T * C, n_st = (size_t)B * NH * T;
    char label[64];
    snprintf(label, sizeof(label), "B=%d T=%4d NH=%2d HS=%3d", B, T, NH, HS);

    floatX* h_qkv = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "qkv");
    floatX* h_dout = (floatX*)malloc_or_die(n_out * sizeof(floatX), "dout");
    Ref r;
    reference_case(&r, B, T, NH, HS, h_qkv, h_dout);
    double t0 = omp_get_wtime();
    reference(&r);
    double ref_s = omp_get_wtime() - t0;

    floatX *d_qkv, *d_dout, *d_out, *d_dqkv, *d_dqkv2;
    float *d_stats, *d_D;
    cudaCheck(cudaMalloc(&d_qkv, n_qkv * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dout, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dqkv, n_qkv * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dqkv2, n_qkv * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_stats, n_st * sizeof(float)));
    cudaCheck(cudaMalloc(&d_D, n_st * sizeof(float)));
    cudaCheck(cudaMemcpy(d_qkv, h_qkv, n_qkv * sizeof(floatX), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_dout, h_dout, n_out * sizeof(floatX), cudaMemcpyHostToDevice));
    floatX* h_out = (floatX*)malloc_or_die(n_out * sizeof(floatX), "out");
    floatX* h_dqkv = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "dqkv");
    floatX* h_dqkv2 = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "dqkv2");
    float* h_stats = (float*)malloc_or_die(n_st * sizeof(float), "stats");
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));

    // --- cuDNN: plans
    char why[1200];
    cudnn_attention_deterministic = 1;
    t0 = omp_get_wtime();
    int ok = cudnn_attention_supported(B, T, NH, HS, why, sizeof(why));
    double plan_s = omp_get_wtime() - t0;
    if (!ok) {
        printf("%s  FAIL: cudnn_attention_supported: %s\n", label, why);
        note_fail("%s: not supported: %s", label, why);
    } else {
        // --- cuDNN forward (training)
        fill_nan_bf16(d_out, n_out);
        fill_nan_f32(d_stats, n_st);
        attention_forward_cudnn(d_out, d_stats, d_qkv, B, T, NH, HS, 1);
        cudaCheck(cudaDeviceSynchronize());
        cudaCheck(cudaMemcpy(h_out, d_out, n_out * sizeof(floatX), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(h_stats, d_stats, n_st * sizeof(float), cudaMemcpyDeviceToHost));
        Cmp c_out = compare_bf16(h_out, r.out, r.tol_out, B, T, C, -1);
        Cmp c_lse = compare_stats(h_stats, r.lse, (long)n_st, 1.0);
        // --- cuDNN backward (deterministic), twice
        fill_nan_bf16(d_dqkv, n_qkv);
        attention_backward_cudnn(d_dqkv, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS);
        cudaCheck(cudaDeviceSynchronize());
        fill_nan_bf16(d_dqkv2, n_qkv);
        attention_backward_cudnn(d_dqkv2, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS);
        cudaCheck(cudaDeviceSynchronize());
        cudaCheck(cudaMemcpy(h_dqkv, d_dqkv, n_qkv * sizeof(floatX), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(h_dqkv2, d_dqkv2, n_qkv * sizeof(floatX), cudaMemcpyDeviceToHost));
        int det_same = memcmp(h_dqkv, h_dqkv2, n_qkv * sizeof(floatX)) == 0;
        Cmp c_dq = compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 0);
        Cmp c_dk = compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 1);
        Cmp c_dv = compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 2);
        // --- timings (5 runs each, after the runs above)
        cudaCheck(cudaEventRecord(e0));
        for (int i = 0; i < 5; i++) { attention_forward_cudnn(d_out, d_stats, d_qkv, B, T, NH, HS, 1); }
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        double fwd_ms = ms_since(e0, e1) / 5;
        cudaCheck(cudaEventRecord(e0));
        for (int i = 0; i < 5; i++) { attention_backward_cudnn(d_dqkv2, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS); }
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        double bwd_ms = ms_since(e0, e1) / 5;

        // --- flash kernels (HS 16/32/64)
        char flash_cell[160] = "-";
        if (gpu_flash_head_size(HS)) {
            floatX* d_fout;
            float* d_fstats;
            cudaCheck(cudaMalloc(&d_fout, n_out * sizeof(floatX)));
            cudaCheck(cudaMalloc(&d_fstats, n_st * sizeof(float)));
            fill_nan_bf16(d_fout, n_out);
            fill_nan_f32(d_fstats, n_st);
            attention_forward_fast(d_fout, d_fstats, d_qkv, B, T, C, NH);
            fill_nan_bf16(d_dqkv, n_qkv);
            attention_backward_fast(d_dqkv, d_dout, d_qkv, d_fout, d_fstats, d_D, B, T, C, NH);
            fill_nan_bf16(d_dqkv2, n_qkv);
            attention_backward_fast(d_dqkv2, d_dout, d_qkv, d_fout, d_fstats, d_D, B, T, C, NH);
            cudaCheck(cudaDeviceSynchronize());
            floatX* h_fout = (floatX*)malloc_or_die(n_out * sizeof(floatX), "flash out");
            cudaCheck(cudaMemcpy(h_fout, d_fout, n_out * sizeof(floatX), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(h_stats, d_fstats, n_st * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(h_dqkv, d_dqkv, n_qkv * sizeof(floatX), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(h_dqkv2, d_dqkv2, n_qkv * sizeof(floatX), cudaMemcpyDeviceToHost));
            Cmp f_out = compare_bf16(h_fout, r.out, r.tol_out, B, T, C, -1);
            Cmp f_lse = compare_stats(h_stats, r.lse, (long)n_st, 0.69314718055994530942);   // base 2 -> e
            Cmp f_bwd = cmp_max(cmp_max(compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 0),
                                        compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 1)),
                                compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 2));
            int f_same = memcmp(h_dqkv, h_dqkv2, n_qkv * sizeof(floatX)) == 0;
            // max |cuDNN out - flash out|, for information
            double dmax = 0.0;
            for (size_t i = 0; i < n_out; i++) {
                double dd = fabs((double)__bfloat162float(h_out[i]) - (double)__bfloat162float(h_fout[i]));
                dmax = dd > dmax ? dd : dmax;
            }
            char a[24], b2[24], c2[24];
            snprintf(flash_cell, sizeof(flash_cell), "out %s lse %s bwd %s rep %s |cudnn-flash| %.1e",
                     ratio_cell(&f_out, a, sizeof(a)), ratio_cell(&f_lse, b2, sizeof(b2)),
                     ratio_cell(&f_bwd, c2, sizeof(c2)), f_same ? "same" : "DIFF", dmax);
            if (f_out.bad || f_lse.bad || f_bwd.bad) {
                note_fail("%s: flash kernels outside tolerance (out %.3g, lse %.3g, bwd %.3g x tol)", label,
                          f_out.ratio, f_lse.ratio, f_bwd.ratio);
            }
            if (!f_same) { note_fail("%s: flash backward not bitwise repeatable", label); }
            free(h_fout);
            cudaCheck(cudaFree(d_fout));
            cudaCheck(cudaFree(d_fstats));
        }

        char a[24], b2[24], c2[24], d2[24], e2[24];
        int pass = !c_out.bad && !c_lse.bad && !c_dq.bad && !c_dk.bad && !c_dv.bad && det_same;
        printf("%s  %-4s out %s (%.1e/%.1e) lse %s  dq %s dk %s dv %s (%.1e/%.1e) rep %-4s  fwd %6.3f bwd %6.3f ms  "
               "plans %.1fs ref %.1fs | flash: %s\n",
               label, pass ? "ok" : "FAIL", ratio_cell(&c_out, a, sizeof(a)), c_out.err, c_out.tol,
               ratio_cell(&c_lse, b2, sizeof(b2)), ratio_cell(&c_dq, c2, sizeof(c2)), ratio_cell(&c_dk, d2, sizeof(d2)),
               ratio_cell(&c_dv, e2, sizeof(e2)), cmp_max(cmp_max(c_dq, c_dk), c_dv).err,
               cmp_max(cmp_max(c_dq, c_dk), c_dv).tol, det_same ? "same" : "DIFF", fwd_ms, bwd_ms, plan_s, ref_s,
               flash_cell);
        if (c_out.bad || c_lse.bad) {
            note_fail("%s: cuDNN forward outside tolerance: out %ld elements (worst %.3g x tol), stats %ld (worst %.3g x tol)",
                      label, c_out.bad, c_out.ratio, c_lse.bad, c_lse.ratio);
        }
        if (c_dq.bad || c_dk.bad || c_dv.bad) {
            note_fail("%s: cuDNN backward outside tolerance: dq %ld (%.3g x tol), dk %ld (%.3g x tol), dv %ld (%.3g x tol)",
                      label, c_dq.bad, c_dq.ratio, c_dk.bad, c_dk.ratio, c_dv.bad, c_dv.ratio);
        }
        if (!det_same) { note_fail("%s: deterministic cuDNN backward gave different bits on a second run", label); }

        // --- inference forward (training = 0)
        if (T == 256 && !ca_get(CA_FWD, B, T, NH, HS, 0, why, sizeof(why))) {   // its plan, without dying
            printf("%s  FAIL   inference forward (training=0): %s\n", label, why);
            note_fail("%s: inference forward not supported: %s", label, why);
        } else if (T == 256) {
            fill_nan_bf16(d_out, n_out);
            t0 = omp_get_wtime();
            attention_forward_cudnn(d_out, NULL, d_qkv, B, T, NH, HS, 0);
            cudaCheck(cudaDeviceSynchronize());
            double s = omp_get_wtime() - t0;
            cudaCheck(cudaMemcpy(h_out, d_out, n_out * sizeof(floatX), cudaMemcpyDeviceToHost));
            Cmp c_inf = compare_bf16(h_out, r.out, r.tol_out, B, T, C, -1);
            printf("%s  %-4s   inference forward (training=0): out %s (%.1e/%.1e), plan + run %.1fs\n", label,
                   c_inf.bad ? "FAIL" : "ok", ratio_cell(&c_inf, a, sizeof(a)), c_inf.err, c_inf.tol, s);
            if (c_inf.bad) { note_fail("%s: inference forward outside tolerance (%.3g x tol)", label, c_inf.ratio); }
        }
        // --- nondeterministic backward (dQ accumulated in fp32 by atomics)
        if (NH == 12 && (T == 64 || T == 1024)) {
            cudnn_attention_deterministic = 0;
            t0 = omp_get_wtime();
            ok = cudnn_attention_supported(B, T, NH, HS, why, sizeof(why));
            double s = omp_get_wtime() - t0;
            if (!ok) {
                printf("%s  FAIL   nondeterministic backward: %s\n", label, why);
                note_fail("%s: nondeterministic backward not supported: %s", label, why);
            } else {
                attention_forward_cudnn(d_out, d_stats, d_qkv, B, T, NH, HS, 1);
                fill_nan_bf16(d_dqkv, n_qkv);
                attention_backward_cudnn(d_dqkv, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS);
                fill_nan_bf16(d_dqkv2, n_qkv);
                attention_backward_cudnn(d_dqkv2, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS);
                cudaCheck(cudaDeviceSynchronize());
                cudaCheck(cudaEventRecord(e0));
                for (int i = 0; i < 5; i++) { attention_backward_cudnn(d_dqkv2, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS); }
                cudaCheck(cudaEventRecord(e1));
                cudaCheck(cudaEventSynchronize(e1));
                double nd_ms = ms_since(e0, e1) / 5;
                cudaCheck(cudaMemcpy(h_dqkv, d_dqkv, n_qkv * sizeof(floatX), cudaMemcpyDeviceToHost));
                cudaCheck(cudaMemcpy(h_dqkv2, d_dqkv2, n_qkv * sizeof(floatX), cudaMemcpyDeviceToHost));
                int same = memcmp(h_dqkv, h_dqkv2, n_qkv * sizeof(floatX)) == 0;
                Cmp nd = cmp_max(cmp_max(compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 0),
                                         compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 1)),
                                 compare_bf16(h_dqkv, r.dqkv, r.tol_dqkv, B, T, C, 2));
                printf("%s  %-4s   nondeterministic backward: dqkv %s (%.1e/%.1e) rep %s (not required) bwd %6.3f ms, "
                       "plans %.1fs\n", label, nd.bad ? "FAIL" : "ok", ratio_cell(&nd, a, sizeof(a)), nd.err, nd.tol,
                       same ? "same" : "diff", nd_ms, s);
                if (nd.bad) { note_fail("%s: nondeterministic backward outside tolerance (%.3g x tol)", label, nd.ratio); }
            }
            cudnn_attention_deterministic = 1;
        }
    }

    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dqkv));
    cudaCheck(cudaFree(d_dqkv2));
    cudaCheck(cudaFree(d_stats));
    cudaCheck(cudaFree(d_D));
    free(h_qkv); free(h_dout); free(h_out); free(h_dqkv); free(h_dqkv2); free(h_stats);
    reference_free(&r);
}

int main(void) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        printf("test_attention_gpu: no CUDA GPU (%s): skipped\n",
               err != cudaSuccess ? cudaGetErrorString(err) : "no devices");
        return 77;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    size_t v = cudnnGetVersion();
    printf("test_attention_gpu: %s (sm_%d%d), cuDNN %zu.%zu.%zu (headers %d.%d.%d), %d CPU threads for the reference\n",
           prop.name, prop.major, prop.minor, v / 10000, (v / 100) % 100, v % 100, CUDNN_MAJOR, CUDNN_MINOR,
           CUDNN_PATCHLEVEL, omp_get_max_threads());
    printf("columns: worst |gpu-ref|/tol per quantity (pass <= 1; '!' marks a failure), (max err / tol there), rep: "
           "two backward runs bitwise equal\n");
    flash_attention_setup();
    const int Ts[3] = {64, 256, 1024}, NHs[2] = {4, 12}, HSs[2] = {64, 128};
    double t0 = omp_get_wtime();
    for (int ti = 0; ti < 3; ti++) {
        for (int ni = 0; ni < 2; ni++) {
            for (int hi = 0; hi < 2; hi++) { run_case(2, Ts[ti], NHs[ni], HSs[hi]); }
        }
    }
    printf("plans (engine = cuDNN global engine index; rtc = runtime-compiled; ws = workspace incl. our Dsum/dQ "
           "buffers):\n");
    for (int ti = 0; ti < 3; ti++) {
        for (int ni = 0; ni < 2; ni++) {
            for (int hi = 0; hi < 2; hi++) {
                char info[1024];
                cudnn_attention_plan_info(2, Ts[ti], NHs[ni], HSs[hi], info, sizeof(info));
                if (info[0]) { printf("  T=%4d NH=%2d HS=%3d  %s\n", Ts[ti], NHs[ni], HSs[hi], info); }
            }
        }
    }
    cudnn_attention_free();
    printf("total %.1fs\n", omp_get_wtime() - t0);
    if (failures) {
        printf("FAIL: %d problem(s):\n", failures);
        for (int i = 0; i < nfail_notes; i++) { printf("  %s\n", fail_notes[i]); }
        return 1;
    }
    printf("PASS: cuDNN attention forward and backward within bf16 tolerances in all %d cases; deterministic "
           "backward bitwise repeatable\n", 12);
    return 0;
}
