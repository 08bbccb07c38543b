/*
 * test_fast_emu.cpp: fast mode's attention and matmuls on the emulated GPU (dev/gpu/emu), the
 * same source that nvcc compiles for a GPU.
 *
 *   flash attention (llmc/attention_flash.cuh: cp.async, ldmatrix, mma.sync through
 *     dev/gpu/emu/ptx_emu.h), forward and backward, against dev/gpu/attention_reference.h:
 *     double precision from the same bf16 inputs, a tolerance per element of 2^-6 times the
 *     sum of |terms| of its contraction (dev/gpu/test_attention.cu states why), stats to
 *     2^-13 (1 + |lse|); every output starts as NaN. The backward is also run with another
 *     LLMC_EMU_SEED (another block and thread order) and must give the same bits. The KV
 *     cache's one-row launch: row t (at tile edges) is the full forward's bit for bit, the
 *     rows after t NaN.
 *   the ring's blocks (llmc/kernels_fast_cp.cuh: the flash kernels on fp32 outputs under the
 *     ring's three masks, the log-sum-exp merge, the backward with the global statistics)
 *     for every rank of N = 2, 3 on one process, against the same reference of the whole
 *     sequence through the zig-zag layout with the same bounds; every output starts as NaN.
 *   cuBLASLt (dev/gpu/emu/cublasLt.h) through llmc/matmul_cublaslt.cuh unchanged: the forward
 *     with bias and with GELU_AUX_BIAS, the input gradient plain and with DGELU, the fp32
 *     weight gradient, each bit-identical to a triple loop that sums the bf16 products in k
 *     order in fp32 and rounds where cuBLASLt rounds; an input at a 2-byte offset (its
 *     alignment passed in the preference) computes right too. The stand-in's refusals: the
 *     status code for each thing cuBLASLt refuses (a strided batch's among them).
 *   the mixture-of-experts layer (llmc/kernels_fast_moe.cuh, the calls train_gpt2_fast.cu's
 *     layer makes on one rank, with moe.h's routing plan), forward and backward, against a
 *     double-precision naive layer from the same bf16 inputs and the same load-balancing
 *     gradient: the router chooses the experts the double softmax ranks first; the output,
 *     d input, the router's and every expert's weight and bias gradients each within 2^-5 of
 *     the tensor's largest |reference| (a path rounds to bf16 at most about six times, by up
 *     to 2^-9 each: fch, GELU, y, the combine; backward d slot, d h, d x, d logits); every
 *     output starts as NaN.
 *   the grouped expert matmul (kernels_fast_moe.cuh: one strided-batched cuBLASLt call for all
 *     local experts over their rows padded to a common count): the forward (fch, GELU, y), the
 *     input half (d fch, d xin), the weight half (fc and fcproj, each source's slice) and
 *     --tp's fp32 partial sums (fcproj's outputs, fc's input gradients) equal one matmul per
 *     expert and source bit for bit, on hand-made counts with an expert without rows, a
 *     one-row expert and a source that sends an expert nothing.
 * Built twice by mk/fast_emu.mk: build/test_fast_emu and build/test_fast_emu_race (the race
 * check on, smaller cases).
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/cuda_common.cuh"
#include "llmc/attention_flash.cuh"
#include "llmc/matmul_cublaslt.cuh"
#include "llmc/kernels_fast_moe.cuh"
#include "llmc/kernels_fast_cp.cuh"
#include "dev/gpu/attention_reference.h"

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

template <typename T> static T* device_copy(const T* h, size_t n) {
    T* d = (T*)device_alloc(n * sizeof(T), "test buffer");
    cudaCheck(cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
template <typename T> static T* host_copy(const T* d, size_t n) {
    T* h = (T*)malloc_or_die(n * sizeof(T), "test buffer");
    cudaCheck(cudaMemcpy(h, d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
static void* device_nan(size_t bytes) {   // 0xFF bytes: NaN in bf16 and fp32
    void* d = device_alloc(bytes, "test output");
    cudaCheck(cudaMemset(d, 0xFF, bytes));
    return d;
}

// ---- flash attention -------------------------------------------------------------------------

static void flash_case(int B, int T, int NH, int HS) {
    const int C = NH * HS;
    const size_t n_qkv = (size_t)B * T * 3 * C, n_out = (size_t)B * T * C, n_st = (size_t)B * NH * T;
    floatX* h_qkv = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "qkv");
    floatX* h_dout = (floatX*)malloc_or_die(n_out * sizeof(floatX), "dout");
    Ref r;
    reference_case(&r, B, T, NH, HS, h_qkv, h_dout);   // test_attention.cu's inputs
    reference(&r);

    floatX *d_qkv = device_copy(h_qkv, n_qkv), *d_dout = device_copy(h_dout, n_out);
    floatX* d_out = (floatX*)device_nan(n_out * sizeof(floatX));
    floatX* d_dqkv = (floatX*)device_nan(n_qkv * sizeof(floatX));
    float* d_stats = (float*)device_nan(n_st * sizeof(float));
    float* d_D = (float*)device_nan(n_st * sizeof(float));
    attention_forward_fast(d_out, d_stats, d_qkv, B, T, C, NH);
    attention_backward_fast(d_dqkv, d_dout, d_qkv, d_out, d_stats, d_D, B, T, C, NH);
    floatX* out = host_copy(d_out, n_out);
    float* stats = host_copy(d_stats, n_st);
    floatX* dqkv = host_copy(d_dqkv, n_qkv);
    // the same backward in another block and thread order
    setenv("LLMC_EMU_SEED", "7", 1);
    cudaCheck(cudaMemset(d_dqkv, 0xFF, n_qkv * sizeof(floatX)));
    attention_backward_fast(d_dqkv, d_dout, d_qkv, d_out, d_stats, d_D, B, T, C, NH);
    unsetenv("LLMC_EMU_SEED");
    floatX* dqkv2 = host_copy(d_dqkv, n_qkv);
    int same = memcmp(dqkv, dqkv2, n_qkv * sizeof(floatX)) == 0;

    Cmp c_out = compare_bf16(out, r.out, r.tol_out, B, T, C, -1);
    Cmp c_lse = compare_stats(stats, r.lse, (long)n_st, 0.69314718055994530942);   // base 2 -> e
    Cmp c_dq = compare_bf16(dqkv, r.dqkv, r.tol_dqkv, B, T, C, 0);
    Cmp c_dk = compare_bf16(dqkv, r.dqkv, r.tol_dqkv, B, T, C, 1);
    Cmp c_dv = compare_bf16(dqkv, r.dqkv, r.tol_dqkv, B, T, C, 2);
    int pass = !c_out.bad && !c_lse.bad && !c_dq.bad && !c_dk.bad && !c_dv.bad && same;
    printf("flash B=%d T=%3d NH=%d HS=%2d  %-4s worst |err|/tol: out %.3f lse %.3f dq %.3f dk %.3f dv %.3f, "
           "backward %s across seeds\n", B, T, NH, HS, pass ? "ok" : "FAIL", c_out.ratio, c_lse.ratio, c_dq.ratio,
           c_dk.ratio, c_dv.ratio, same ? "the same bits" : "DIFFERENT bits");
    CHECK(!c_out.bad && !c_lse.bad, "flash forward B=%d T=%d NH=%d HS=%d: %ld + %ld elements over tolerance", B, T, NH,
          HS, c_out.bad, c_lse.bad);
    CHECK(!c_dq.bad && !c_dk.bad && !c_dv.bad, "flash backward B=%d T=%d NH=%d HS=%d: %ld elements over tolerance", B,
          T, NH, HS, c_dq.bad + c_dk.bad + c_dv.bad);
    CHECK(same, "flash backward B=%d T=%d NH=%d HS=%d: other bits under another LLMC_EMU_SEED", B, T, NH, HS);
    free(h_qkv); free(h_dout); free(out); free(stats); free(dqkv); free(dqkv2);
    reference_free(&r);
    device_free(d_qkv); device_free(d_dout); device_free(d_out); device_free(d_dqkv); device_free(d_stats);
    device_free(d_D);
}

// The sampler's KV cache: attention_forward_fast_row's row t of one sequence is the full
// forward's row t bit for bit, with every row of qkv after t NaN (the rows the cache does not
// have yet must not be read).
static void flash_row_case(int T, int NH, int HS, const int* rows, int nrows) {
    const int C = NH * HS;
    const size_t n_qkv = (size_t)T * 3 * C, n_out = (size_t)T * C;
    floatX* h_qkv = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "qkv");
    floatX* h_dout = (floatX*)malloc_or_die(n_out * sizeof(floatX), "dout");
    Ref r;
    reference_case(&r, 1, T, NH, HS, h_qkv, h_dout);
    floatX* d_qkv = device_copy(h_qkv, n_qkv);
    floatX* d_full = (floatX*)device_nan(n_out * sizeof(floatX));
    float* d_stats = (float*)device_nan((size_t)NH * T * sizeof(float));
    attention_forward_fast(d_full, d_stats, d_qkv, 1, T, C, NH);
    floatX* full = host_copy(d_full, n_out);
    int bad = 0;
    for (int i = 0; i < nrows; i++) {
        int t = rows[i];
        floatX* d_cache = device_copy(h_qkv, n_qkv);
        cudaCheck(cudaMemset(d_cache + (size_t)(t + 1) * 3 * C, 0xFF, (n_qkv - (size_t)(t + 1) * 3 * C) * sizeof(floatX)));
        floatX* d_row = (floatX*)device_nan(n_out * sizeof(floatX));
        attention_forward_fast_row(d_row, d_stats, d_cache, t, C, NH);
        floatX* row = host_copy(d_row, n_out);
        int same = memcmp(row + (size_t)t * C, full + (size_t)t * C, C * sizeof(floatX)) == 0;
        CHECK(same, "flash one-row launch T=%d NH=%d HS=%d: row %d differs from the full forward's", T, NH, HS, t);
        bad += !same;
        free(row);
        device_free(d_cache); device_free(d_row);
    }
    printf("flash one row  T=%3d NH=%d HS=%2d  %-4s %d rows (tile edges included) = the full forward's, bit for bit\n",
           T, NH, HS, bad ? "FAIL" : "ok", nrows);
    free(h_qkv); free(h_dout); free(full);
    reference_free(&r);
    device_free(d_qkv); device_free(d_full); device_free(d_stats);
}

// ---- the ring's blocks (context parallelism) -----------------------------------------------

// global position of row t of rank r's zig-zag slice: stretches r and 2N-1-r of T/2N
static int zigzag_position(int t, int T, int N, int r) {
    int S = T / (2 * N);
    return t < S ? r * S + t : (2 * N - 1 - r) * S + t - S;
}

// kernels_fast_cp.cuh's ring for every rank of N on this one process, as each rank computes it:
// its blocks in its pass's order (its own, then r-1, r-2, ...: ring_block_forward merging
// each), the output rounded once; D from that output, ring_block_backward per block with the
// global log-sum-exp, and each block's owner summing the N ranks' dk|dv partials in rank order
// (fp32) and rounding once. Against the double reference of the whole sequence (the slices'
// rows put back in place) with flash_case's bounds; every output and scratch starts as NaN.
static void ring_case(int N, int B, int T, int NH, int HS) {
    const int C = NH * HS, Tq = T / N;
    const long rows = (long)B * Tq;
    const size_t n_qkv = (size_t)B * T * 3 * C, n_out = (size_t)B * T * C, n_st = (size_t)B * NH * T;
    floatX* h_qkv = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "qkv");
    floatX* h_dout = (floatX*)malloc_or_die(n_out * sizeof(floatX), "dout");
    Ref r;
    reference_case(&r, B, T, NH, HS, h_qkv, h_dout);
    reference(&r);
    // rank q's slices: q|k|v (rows, 3C), its K|V block (rows, 2C), d out (rows, C)
    floatX* s_qkv = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "slices");
    floatX* s_kv = (floatX*)malloc_or_die((size_t)N * rows * 2 * C * sizeof(floatX), "slices");
    floatX* s_dout = (floatX*)malloc_or_die(n_out * sizeof(floatX), "slices");
    for (int q = 0; q < N; q++) {
        for (int b = 0; b < B; b++) {
            for (int t = 0; t < Tq; t++) {
                size_t row = (size_t)q * rows + (size_t)b * Tq + t, g = (size_t)b * T + zigzag_position(t, T, N, q);
                memcpy(s_qkv + row * 3 * C, h_qkv + g * 3 * C, 3 * C * sizeof(floatX));
                memcpy(s_kv + row * 2 * C, h_qkv + g * 3 * C + C, 2 * C * sizeof(floatX));
                memcpy(s_dout + row * C, h_dout + g * C, C * sizeof(floatX));
            }
        }
    }
    floatX *d_qkv = device_copy(s_qkv, n_qkv), *d_kv = device_copy(s_kv, (size_t)N * rows * 2 * C);
    floatX* d_dout = device_copy(s_dout, n_out);
    floatX* d_out = (floatX*)device_nan(n_out * sizeof(floatX));
    float* d_o = (float*)device_nan(n_out * sizeof(float));       // every rank's running output
    float* d_lse = (float*)device_nan(n_st * sizeof(float));      // and log-sum-exp
    float* d_o_blk = (float*)device_nan(rows * C * sizeof(float));
    float* d_lse_blk = (float*)device_nan(rows * NH * sizeof(float));
    float* d_D = (float*)device_nan(rows * NH * sizeof(float));
    float* d_dq = (float*)device_nan(n_out * sizeof(float));
    float* d_part = (float*)device_nan((size_t)N * N * rows * 2 * C * sizeof(float));   // [rank][block]
    for (int q = 0; q < N; q++) {
        const floatX* qkv = d_qkv + q * rows * 3 * C;
        float *o = d_o + q * rows * C, *lse = d_lse + q * rows * NH;
        for (int i = 0; i < N; i++) {
            int s = (q - i + N) % N;
            ring_block_forward(o, lse, d_o_blk, d_lse_blk, qkv, d_kv + s * rows * 2 * C, B, T, C, NH, N, q, s);
        }
        ring_round_rows(d_out + q * rows * C, C, o, C, rows, C);
        attention_backward_D_fast(d_D, d_dout + q * rows * C, d_out + q * rows * C, B, Tq, C, NH);
        for (int i = 0; i < N; i++) {
            int s = (q - i + N) % N;
            ring_block_backward(d_dq + q * rows * C, d_part + ((size_t)q * N + s) * rows * 2 * C, d_dout + q * rows * C,
                                qkv, d_kv + s * rows * 2 * C, lse, d_D, B, T, C, NH, N, q, s);
        }
    }
    floatX* out_s = host_copy(d_out, n_out);
    float *lse_s = host_copy(d_lse, n_st), *dq_s = host_copy(d_dq, n_out);
    float* part = host_copy(d_part, (size_t)N * N * rows * 2 * C);
    // the whole sequence's out, stats and dqkv, rows in place
    floatX* out = (floatX*)malloc_or_die(n_out * sizeof(floatX), "out");
    float* stats = (float*)malloc_or_die(n_st * sizeof(float), "stats");
    floatX* dqkv = (floatX*)malloc_or_die(n_qkv * sizeof(floatX), "dqkv");
    for (int q = 0; q < N; q++) {
        for (int b = 0; b < B; b++) {
            for (int t = 0; t < Tq; t++) {
                size_t row = (size_t)q * rows + (size_t)b * Tq + t, g = (size_t)b * T + zigzag_position(t, T, N, q);
                memcpy(out + g * C, out_s + row * C, C * sizeof(floatX));
                for (int c = 0; c < C; c++) {
                    dqkv[g * 3 * C + c] = __float2bfloat16_rn(dq_s[row * C + c]);
                    for (int kv = 0; kv < 2; kv++) {
                        float sum = 0.0f;   // the owner's (q's) sum over the ranks' partials of its block
                        for (int from = 0; from < N; from++) {
                            sum += part[(((size_t)from * N + q) * rows + (size_t)b * Tq + t) * 2 * C + kv * C + c];
                        }
                        dqkv[g * 3 * C + (1 + kv) * C + c] = __float2bfloat16_rn(sum);
                    }
                }
                for (int h = 0; h < NH; h++) {
                    stats[((size_t)b * NH + h) * T + zigzag_position(t, T, N, q)] =
                        lse_s[(size_t)q * rows * NH + ((size_t)b * NH + h) * Tq + t];
                }
            }
        }
    }
    Cmp c_out = compare_bf16(out, r.out, r.tol_out, B, T, C, -1);
    Cmp c_lse = compare_stats(stats, r.lse, (long)n_st, 0.69314718055994530942);   // base 2 -> e
    Cmp c_dq = compare_bf16(dqkv, r.dqkv, r.tol_dqkv, B, T, C, 0);
    Cmp c_dk = compare_bf16(dqkv, r.dqkv, r.tol_dqkv, B, T, C, 1);
    Cmp c_dv = compare_bf16(dqkv, r.dqkv, r.tol_dqkv, B, T, C, 2);
    int pass = !c_out.bad && !c_lse.bad && !c_dq.bad && !c_dk.bad && !c_dv.bad;
    printf("ring N=%d B=%d T=%3d (T/N %3d) NH=%d HS=%2d  %-4s worst |err|/tol: out %.3f lse %.3f dq %.3f dk %.3f dv %.3f\n",
           N, B, T, Tq, NH, HS, pass ? "ok" : "FAIL", c_out.ratio, c_lse.ratio, c_dq.ratio, c_dk.ratio, c_dv.ratio);
    CHECK(!c_out.bad && !c_lse.bad, "ring forward N=%d B=%d T=%d NH=%d HS=%d: %ld + %ld elements over tolerance", N, B,
          T, NH, HS, c_out.bad, c_lse.bad);
    CHECK(!c_dq.bad && !c_dk.bad && !c_dv.bad, "ring backward N=%d B=%d T=%d NH=%d HS=%d: %ld elements over tolerance",
          N, B, T, NH, HS, c_dq.bad + c_dk.bad + c_dv.bad);
    void* host[] = {h_qkv, h_dout, s_qkv, s_kv, s_dout, out_s, lse_s, dq_s, part, out, stats, dqkv};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) { free(host[i]); }
    void* dev[] = {d_qkv, d_kv, d_dout, d_out, d_o, d_lse, d_o_blk, d_lse_blk, d_D, d_dq, d_part};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) { device_free(dev[i]); }
    reference_free(&r);
}

// ---- cuBLASLt --------------------------------------------------------------------------------

static float bf16_value(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// What cuBLASLt computes for matmul_cublaslt.cuh's calls, the stand-in's way: the sum of the
// bf16 products in k order in fp32, then the epilogue.
static float dot_k_order(const float* a, long a_stride, const float* b, long b_stride, int k) {
    float acc = 0.0f;
    for (int i = 0; i < k; i++) { acc += a[i * a_stride] * b[i * b_stride]; }
    return acc;
}

static int count_differences(const floatX* got, const float* want, size_t n) {
    int differ = 0;
    for (size_t i = 0; i < n; i++) { differ += __bfloat162float(got[i]) != want[i] || want[i] != want[i]; }
    return differ;
}

// inp (BT,K) at an `offset` of elements into its buffer, weight (OC,K), bias (OC), dout (BT,OC)
static void matmul_case(int BT, int K, int OC, int offset) {
    size_t n_inp = (size_t)BT * K + offset, n_w = (size_t)OC * K, n_out = (size_t)BT * OC;
    floatX *h_inp = (floatX*)malloc_or_die(n_inp * 2, "inp"), *h_w = (floatX*)malloc_or_die(n_w * 2, "w");
    floatX *h_bias = (floatX*)malloc_or_die(OC * 2, "bias"), *h_dout = (floatX*)malloc_or_die(n_out * 2, "dout");
    floatX* h_pre = (floatX*)malloc_or_die((size_t)BT * K * 2, "pre");
    float *inp = (float*)malloc_or_die(n_inp * 4, "inp"), *w = (float*)malloc_or_die(n_w * 4, "w");
    float *bias = (float*)malloc_or_die(OC * 4, "bias"), *dout = (float*)malloc_or_die(n_out * 4, "dout");
    float* pre = (float*)malloc_or_die((size_t)BT * K * 4, "pre");
    fill_bf16(h_inp, inp, n_inp, -1.0, 1.0);
    fill_bf16(h_w, w, n_w, -1.0, 1.0);
    fill_bf16(h_bias, bias, OC, -1.0, 1.0);
    fill_bf16(h_dout, dout, n_out, -1.0, 1.0);
    fill_bf16(h_pre, pre, (size_t)BT * K, -1.0, 1.0);
    floatX *d_inp = device_copy(h_inp, n_inp), *d_w = device_copy(h_w, n_w), *d_bias = device_copy(h_bias, OC);
    floatX *d_dout = device_copy(h_dout, n_out), *d_pre_in = device_copy(h_pre, (size_t)BT * K);
    floatX *d_out = (floatX*)device_nan(n_out * 2), *d_gelu_pre = (floatX*)device_nan(n_out * 2);
    floatX* d_dinp = (floatX*)device_nan((size_t)BT * K * 2);
    float* d_dw = (float*)device_nan(n_w * 4);
    const float* x = inp + offset;

    float *want = (float*)malloc_or_die(n_out * 4, "want"), *want_pre = (float*)malloc_or_die(n_out * 4, "want");
    for (int t = 0; t < BT; t++) {
        for (int o = 0; o < OC; o++) {
            float v = dot_k_order(w + (size_t)o * K, 1, x + (size_t)t * K, 1, K) + bias[o];
            want_pre[(size_t)t * OC + o] = bf16_value(v);
            want[(size_t)t * OC + o] = v;
        }
    }
    // forward with bias
    matmul_forward_fast(d_out, d_inp + offset, d_w, d_bias, BT, K, OC, NULL);
    floatX* got = host_copy(d_out, n_out);
    float* want_out = (float*)malloc_or_die(n_out * 4, "want");
    for (size_t i = 0; i < n_out; i++) { want_out[i] = bf16_value(want[i]); }
    int d_fwd = count_differences(got, want_out, n_out);
    free(got);
    // forward with GELU_AUX_BIAS: the pre-activation stored rounded, GELU of the fp32 sum
    matmul_forward_fast(d_out, d_inp + offset, d_w, d_bias, BT, K, OC, d_gelu_pre);
    got = host_copy(d_gelu_pre, n_out);
    int d_pre = count_differences(got, want_pre, n_out);
    free(got);
    got = host_copy(d_out, n_out);
    for (size_t i = 0; i < n_out; i++) { want_out[i] = bf16_value(canon_gelu(want[i])); }
    int d_gelu = count_differences(got, want_out, n_out);
    free(got);
    // input gradient, plain and times gelu'(pre) (DGELU); the fp32 weight gradient
    float* want_dinp = (float*)malloc_or_die((size_t)BT * K * 4, "want");
    float* want_dgelu = (float*)malloc_or_die((size_t)BT * K * 4, "want");
    for (int t = 0; t < BT; t++) {
        for (int c = 0; c < K; c++) {
            float v = dot_k_order(w + c, K, dout + (size_t)t * OC, 1, OC);
            want_dinp[(size_t)t * K + c] = bf16_value(v);
            want_dgelu[(size_t)t * K + c] = bf16_value(v * canon_gelu_grad(pre[(size_t)t * K + c]));
        }
    }
    matmul_backward_fast(d_dinp, d_dw, NULL, d_dout, d_inp + offset, d_w, 1, BT, K, OC, NULL);
    got = host_copy(d_dinp, (size_t)BT * K);
    int d_dinp_plain = count_differences(got, want_dinp, (size_t)BT * K);
    free(got);
    float* got_dw = host_copy(d_dw, n_w);
    int d_dw_count = 0;
    for (int o = 0; o < OC; o++) {
        for (int c = 0; c < K; c++) {
            d_dw_count += got_dw[(size_t)o * K + c] != dot_k_order(x + c, K, dout + o, OC, BT);
        }
    }
    free(got_dw);
    matmul_backward_fast(d_dinp, NULL, NULL, d_dout, d_inp + offset, d_w, 1, BT, K, OC, d_pre_in);
    got = host_copy(d_dinp, (size_t)BT * K);
    int d_dgelu = count_differences(got, want_dgelu, (size_t)BT * K);
    free(got);
    int differ = d_fwd + d_pre + d_gelu + d_dinp_plain + d_dw_count + d_dgelu;
    printf("cuBLASLt BT=%3d K=%3d OC=%3d input offset %d: %s (elements differing from the triple loop: forward %d, "
           "GELU aux %d, GELU %d, dinp %d, DGELU %d, dweight %d)\n", BT, K, OC, offset, differ ? "FAIL" : "ok", d_fwd,
           d_pre, d_gelu, d_dinp_plain, d_dgelu, d_dw_count);
    CHECK(differ == 0, "cuBLASLt through matmul_cublaslt.cuh, BT=%d K=%d OC=%d offset %d: %d elements differ", BT, K,
          OC, offset, differ);
    free(h_inp); free(h_w); free(h_bias); free(h_dout); free(h_pre); free(inp); free(w); free(bias); free(dout);
    free(pre); free(want); free(want_pre); free(want_out); free(want_dinp); free(want_dgelu);
    device_free(d_inp); device_free(d_w); device_free(d_bias); device_free(d_dout); device_free(d_pre_in);
    device_free(d_out); device_free(d_gelu_pre); device_free(d_dinp); device_free(d_dw);
}

// The stand-in's refusals, one property at a time, on an otherwise valid 16 x 16 x 16 problem.
static void cublaslt_refusals(void) {
    floatX* buf = (floatX*)device_nan(4096);
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t l16, lfp32, lsmall;
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasCheck(cublasLtMatrixLayoutCreate(&l16, CUDA_R_16BF, 16, 16, 16));
    cublasCheck(cublasLtMatrixLayoutCreate(&lfp32, CUDA_R_32F, 16, 16, 16));
    cublasCheck(cublasLtMatrixLayoutCreate(&lsmall, CUDA_R_16BF, 16, 8, 16));
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t result;
    int found = 1;
    auto heuristic = [&](cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d) {
        return cublasLtMatmulAlgoGetHeuristic(cublaslt_handle, desc, a, b, d, d, pref, 1, &result, &found);
    };
    struct { const char* what; cublasStatus_t got, want; } cases[20];
    int n = 0;
    cublasLtMatrixLayout_t unused;
    cases[n++] = {"a leading dimension below the rows", cublasLtMatrixLayoutCreate(&unused, CUDA_R_16BF, 16, 16, 8),
                  CUBLAS_STATUS_INVALID_VALUE};
    cases[n++] = {"fp16 compute", cublasLtMatmulDescCreate(&desc, (cublasComputeType_t)64, CUDA_R_32F),
                  CUBLAS_STATUS_NOT_SUPPORTED};
    cases[n++] = {"fp32 A", heuristic(lfp32, l16, l16), CUBLAS_STATUS_NOT_SUPPORTED};
    cases[n++] = {"shapes that do not chain (n 8, D 16 columns)", heuristic(l16, lsmall, l16),
                  CUBLAS_STATUS_INVALID_VALUE};
    int found_after_refusal = found;
    cases[n++] = {"bf16 A, B and fp32 D", heuristic(l16, l16, lfp32), CUBLAS_STATUS_SUCCESS};
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    cases[n++] = {"a bias epilogue without a bias pointer", heuristic(l16, l16, l16), CUBLAS_STATUS_INVALID_VALUE};
    const floatX* bias = buf;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    cases[n++] = {"a bias epilogue with fp32 D", heuristic(l16, l16, lfp32), CUBLAS_STATUS_NOT_SUPPORTED};
    epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    floatX* aux = buf + 512;
    int64_t aux_ld = 20;   // >= m = 16, not a multiple of 8
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    cases[n++] = {"a GELU aux leading dimension of 20", heuristic(l16, l16, l16), CUBLAS_STATUS_INVALID_VALUE};
    aux_ld = 8;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    cases[n++] = {"a GELU aux leading dimension below m", heuristic(l16, l16, l16), CUBLAS_STATUS_INVALID_VALUE};
    cases[n++] = {"an aux leading dimension of 4 bytes",
                  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, 4),
                  CUBLAS_STATUS_INVALID_VALUE};
    aux_ld = 16;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    // a strided batch: every layout of the same count, a GELU aux batch stride a multiple of 8
    cublasLtMatrixLayout_t lbatch;
    int32_t three = 3;
    int64_t stride = 256, aux_stride = 260;
    cublasCheck(cublasLtMatrixLayoutCreate(&lbatch, CUDA_R_16BF, 16, 16, 16));
    cublasCheck(cublasLtMatrixLayoutSetAttribute(lbatch, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &three, sizeof(three)));
    cublasCheck(cublasLtMatrixLayoutSetAttribute(lbatch, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                 sizeof(stride)));
    cases[n++] = {"a batch of 3 with a D of one", heuristic(lbatch, lbatch, l16), CUBLAS_STATUS_INVALID_VALUE};
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &aux_stride,
                                               sizeof(aux_stride)));
    cases[n++] = {"a GELU aux batch stride of 260", heuristic(lbatch, lbatch, lbatch), CUBLAS_STATUS_INVALID_VALUE};
    aux_stride = 256;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &aux_stride,
                                               sizeof(aux_stride)));
    cases[n++] = {"a batch of 3 with GELU_AUX_BIAS", heuristic(lbatch, lbatch, lbatch), CUBLAS_STATUS_SUCCESS};
    cases[n++] = {"a batch count of 8 bytes",
                  cublasLtMatrixLayoutSetAttribute(lbatch, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &stride, sizeof(stride)),
                  CUBLAS_STATUS_INVALID_VALUE};
    cublasCheck(cublasLtMatrixLayoutDestroy(lbatch));
    epilogue = (cublasLtEpilogue_t)2;   // CUBLASLT_EPILOGUE_RELU: not in the subset
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    cases[n++] = {"the RELU epilogue", heuristic(l16, l16, l16), CUBLAS_STATUS_NOT_SUPPORTED};
    epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    // an algorithm chosen for 16-byte aligned pointers (the default promise: 256), then called
    // with A at a 2-byte offset; and beta = 1
    cublasCheck(heuristic(l16, l16, l16));
    const float alpha = 1.0f, beta0 = 0.0f, beta1 = 1.0f;
    floatX *A = buf + 1024, *Bm = buf + 1280, *D = buf + 1536;
    cases[n++] = {"the matmul on the pointers it was chosen for",
                  cublasLtMatmul(cublaslt_handle, desc, &alpha, A, l16, Bm, l16, &beta0, D, l16, D, l16, &result.algo,
                                 cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES, 0), CUBLAS_STATUS_SUCCESS};
    cases[n++] = {"A less aligned than the algorithm was chosen for",
                  cublasLtMatmul(cublaslt_handle, desc, &alpha, A + 1, l16, Bm, l16, &beta0, D, l16, D, l16,
                                 &result.algo, cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES, 0),
                  CUBLAS_STATUS_INVALID_VALUE};
    cases[n++] = {"beta = 1", cublasLtMatmul(cublaslt_handle, desc, &alpha, A, l16, Bm, l16, &beta1, D, l16, D, l16,
                                             &result.algo, cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES, 0),
                  CUBLAS_STATUS_NOT_SUPPORTED};
    int wrong = found_after_refusal != 0;
    CHECK(found_after_refusal == 0, "a refused heuristic must return no algorithm");
    for (int i = 0; i < n; i++) {
        CHECK(cases[i].got == cases[i].want, "cuBLASLt stand-in, %s: status %d, cuBLASLt's is %d", cases[i].what,
              (int)cases[i].got, (int)cases[i].want);
        wrong += cases[i].got != cases[i].want;
    }
    printf("cuBLASLt stand-in: %d refusals and acceptances with cuBLASLt's status codes: %s\n", n,
           wrong ? "FAIL" : "ok");
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    cublasCheck(cublasLtMatrixLayoutDestroy(l16));
    cublasCheck(cublasLtMatrixLayoutDestroy(lfp32));
    cublasCheck(cublasLtMatrixLayoutDestroy(lsmall));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
    device_free(buf);
}

// ---- the mixture-of-experts layer ------------------------------------------------------------

static double gelu_ref(double x) { return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
static double gelu_grad_ref(double x) {
    double s = sqrt(2.0 / M_PI), u = s * (x + 0.044715 * x * x * x), t = tanh(u);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * 0.044715 * x * x);
}
static floatX* random_bf16(size_t n, float scale, uint64_t* state, float* as_float) {
    floatX* h = (floatX*)malloc_or_die(n * sizeof(floatX), "test input");
    for (size_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        float v = scale * ((float)(*state >> 40) / (float)(1ull << 24) * 2.0f - 1.0f);
        h[i] = __float2bfloat16_rn(v);
        as_float[i] = __bfloat162float(h[i]);
    }
    return h;
}
// every element of got (n, bf16 or fp32 on the device) within tol of want's largest |value|
static double as_double(float v) { return v; }
static double as_double(floatX v) { return __bfloat162float(v); }
template <typename X> static double moe_compare(const char* what, const X* d_got, const double* want, size_t n) {
    X* got = host_copy(d_got, n);
    double peak = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++) { if (fabs(want[i]) > peak) { peak = fabs(want[i]); } }
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        double g = as_double(got[i]), d = fabs(g - want[i]);
        if (!(d <= ldexp(peak, -5))) { bad++; }
        if (d > worst || d != d) { worst = d; }
    }
    CHECK(bad == 0 && peak > 0.0, "moe layer %s: %zu of %zu elements off by more than 2^-5 of max|ref| %.3g (worst %.3g)", what,
          bad, n, peak, worst);
    free(got);
    return peak > 0.0 ? worst / peak : worst;
}

static void moe_layer_case(int B, int T, int C, int E, int k) {
    const int BT = B * T, C4 = 4 * C, slots = BT * k;
    uint64_t state = 12345;
    float *x = (float*)malloc_or_die(sizeof(float) * BT * C, "x"), *rw = (float*)malloc_or_die(sizeof(float) * E * C, "rw");
    float *fcw = (float*)malloc_or_die(sizeof(float) * E * C4 * C, "w"), *fcb = (float*)malloc_or_die(sizeof(float) * E * C4, "w");
    float *pw = (float*)malloc_or_die(sizeof(float) * E * C * C4, "w"), *pb = (float*)malloc_or_die(sizeof(float) * E * C, "w");
    float* dout = (float*)malloc_or_die(sizeof(float) * BT * C, "dout");
    floatX* h_x = random_bf16((size_t)BT * C, 1.0f, &state, x);
    floatX* h_rw = random_bf16((size_t)E * C, 0.5f, &state, rw);
    floatX* h_fcw = random_bf16((size_t)E * C4 * C, 0.3f, &state, fcw);
    floatX* h_fcb = random_bf16((size_t)E * C4, 0.1f, &state, fcb);
    floatX* h_pw = random_bf16((size_t)E * C * C4, 0.15f, &state, pw);
    floatX* h_pb = random_bf16((size_t)E * C, 0.1f, &state, pb);
    floatX* h_dout = random_bf16((size_t)BT * C, 1.0f, &state, dout);
    float* daux = (float*)malloc_or_die(sizeof(float) * E, "daux");
    for (int e = 0; e < E; e++) { daux[e] = 0.05f * (float)(e + 1) / (float)BT; }
    // the device layer, one rank: the calls of train_gpt2_fast.cu's fast_moe_forward / _backward
    floatX *ln = device_copy(h_x, (size_t)BT * C), *routerw = device_copy(h_rw, (size_t)E * C);
    MoeExperts<const floatX> w = {device_copy(h_fcw, (size_t)E * C4 * C), device_copy(h_fcb, (size_t)E * C4),
                                  device_copy(h_pw, (size_t)E * C * C4), device_copy(h_pb, (size_t)E * C)};
    floatX* d_dout = device_copy(h_dout, (size_t)BT * C);
    float* d_daux = device_copy(daux, (size_t)E);
    float* probs = (float*)device_nan(sizeof(float) * BT * E);
    int* chosen = (int*)device_nan(sizeof(int) * slots);
    float* gates = (float*)device_nan(sizeof(float) * slots);
    moe_router_forward_fast(probs, chosen, gates, ln, routerw, BT, C, E, k);
    int *h_chosen = host_copy(chosen, slots), *count = (int*)malloc_or_die(sizeof(int) * E, "plan");
    int *row_pos = (int*)malloc_or_die(sizeof(int) * slots, "plan"), *slot_row = (int*)malloc_or_die(sizeof(int) * slots, "plan");
    int *cursor = (int*)malloc_or_die(sizeof(int) * E, "plan"), *first = (int*)malloc_or_die(sizeof(int) * (E + 1), "plan");
    int* src_first = (int*)malloc_or_die(sizeof(int) * 2 * E, "plan");
    moe_plan_routes(h_chosen, B, T, k, E, count, row_pos, slot_row, cursor);
    first[0] = 0;
    for (int e = 0; e < E; e++) { first[e + 1] = first[e] + count[e]; src_first[2 * e] = first[e]; src_first[2 * e + 1] = first[e + 1]; }
    int *d_row_pos = device_copy(row_pos, slots), *d_slot_row = device_copy(slot_row, slots);
    floatX* xin = (floatX*)device_nan(sizeof(floatX) * slots * C);
    floatX* fch = (floatX*)device_nan(sizeof(floatX) * slots * C4);
    floatX* fch_gelu = (floatX*)device_nan(sizeof(floatX) * slots * C4);
    floatX* ret = (floatX*)device_nan(sizeof(floatX) * slots * C);
    floatX* out = (floatX*)device_nan(sizeof(floatX) * BT * C);
    moe_gather_rows_fast(xin, ln, d_row_pos, slots, C);
    moe_experts_forward_fast(ret, NULL, fch, fch_gelu, xin, w, first, E, C, C4);
    moe_combine_fast(out, ret, gates, d_slot_row, BT, k, C);
    float* dgate = (float*)device_nan(sizeof(float) * slots);
    floatX* dslots = (floatX*)device_nan(sizeof(floatX) * slots * C);
    float *dlogits = (float*)device_nan(sizeof(float) * BT * E), *drouter = (float*)device_nan(sizeof(float) * BT * C);
    floatX* dlogits_bf16 = (floatX*)device_nan(sizeof(floatX) * BT * E);
    float* drouterw = (float*)device_nan(sizeof(float) * E * C);
    floatX *dh = (floatX*)device_nan(sizeof(floatX) * slots * C4), *dx = (floatX*)device_nan(sizeof(floatX) * slots * C);
    MoeExperts<float> dw = {(float*)device_nan(sizeof(float) * E * C4 * C), (float*)device_nan(sizeof(float) * E * C4),
                            (float*)device_nan(sizeof(float) * E * C * C4), (float*)device_nan(sizeof(float) * E * C)};
    floatX* dln = (floatX*)device_nan(sizeof(floatX) * BT * C);
    moe_combine_backward_fast(dgate, dslots, d_dout, ret, gates, d_slot_row, BT, k, C);
    moe_router_backward_fast(drouter, dlogits, dlogits_bf16, probs, chosen, gates, dgate, d_daux, routerw, BT, C, E, k);
    moe_router_weight_grad_fast(drouterw, dlogits_bf16, ln, BT, C, E);
    moe_experts_backward_input_fast(dx, NULL, dh, dslots, fch, w, src_first, 1, E, C, C4);
    moe_experts_backward_weight_fast(dw, 0, dslots, dh, fch_gelu, xin, src_first, 1, E, C, C4);
    moe_dinput_combine_fast(dln, drouter, dx, d_slot_row, BT, k, C);
    // the naive layer in double
    double* r_out = (double*)calloc_or_die((size_t)BT * C, sizeof(double), "ref");
    double* r_dln = (double*)calloc_or_die((size_t)BT * C, sizeof(double), "ref");
    double* r_drw = (double*)calloc_or_die((size_t)E * C, sizeof(double), "ref");
    double* r_dfcw = (double*)calloc_or_die((size_t)E * C4 * C, sizeof(double), "ref");
    double* r_dfcb = (double*)calloc_or_die((size_t)E * C4, sizeof(double), "ref");
    double* r_dpw = (double*)calloc_or_die((size_t)E * C * C4, sizeof(double), "ref");
    double* r_dpb = (double*)calloc_or_die((size_t)E * C, sizeof(double), "ref");
    double *p = (double*)malloc_or_die(sizeof(double) * E, "ref"), *dp = (double*)malloc_or_die(sizeof(double) * E, "ref");
    double *h = (double*)malloc_or_die(sizeof(double) * C4, "ref"), *y = (double*)malloc_or_die(sizeof(double) * C, "ref");
    double* dhv = (double*)malloc_or_die(sizeof(double) * C4, "ref");
    int choice_differs = 0;
    for (int i = 0; i < BT; i++) {
        const float* xi = x + (size_t)i * C;
        const float* di = dout + (size_t)i * C;
        double mx = -1e300, z = 0.0;
        for (int e = 0; e < E; e++) {
            double l = 0.0;
            for (int c = 0; c < C; c++) { l += (double)xi[c] * rw[e * C + c]; }
            p[e] = l;
            if (l > mx) { mx = l; }
        }
        for (int e = 0; e < E; e++) { p[e] = exp(p[e] - mx); z += p[e]; }
        for (int e = 0; e < E; e++) { p[e] /= z; }
        int pick[16];
        for (int j = 0; j < k; j++) {   // the j-th largest p
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int jj = 0; jj < j; jj++) { taken |= pick[jj] == e; }
                if (!taken && (best < 0 || p[e] > p[best])) { best = e; }
            }
            pick[j] = best;
        }
        for (int j = 0; j < k; j++) {   // ascending, as moe.h lists them
            for (int jj = j + 1; jj < k; jj++) { if (pick[jj] < pick[j]) { int t = pick[j]; pick[j] = pick[jj]; pick[jj] = t; } }
            choice_differs |= pick[j] != h_chosen[i * k + j];
        }
        double S = 0.0, G = 0.0, H = 0.0;
        for (int j = 0; j < k; j++) { S += p[pick[j]]; }
        double dgate_r[16];
        for (int e = 0; e < E; e++) { dp[e] = daux[e]; }
        for (int j = 0; j < k; j++) {
            int e = pick[j];
            double gate = p[e] / S;
            for (int o = 0; o < C4; o++) {
                double a = fcb[e * C4 + o];
                for (int c = 0; c < C; c++) { a += (double)xi[c] * fcw[((size_t)e * C4 + o) * C + c]; }
                h[o] = a;
            }
            for (int c = 0; c < C; c++) {
                double a = pb[e * C + c];
                for (int o = 0; o < C4; o++) { a += gelu_ref(h[o]) * pw[((size_t)e * C + c) * C4 + o]; }
                y[c] = a;
                r_out[(size_t)i * C + c] += gate * a;
            }
            double dg = 0.0;
            for (int c = 0; c < C; c++) { dg += (double)di[c] * y[c]; }
            dgate_r[j] = dg;
            G += dg * gate;
            // the expert's backward from dy = gate * dout
            for (int o = 0; o < C4; o++) {
                double a = 0.0;
                for (int c = 0; c < C; c++) { a += gate * di[c] * pw[((size_t)e * C + c) * C4 + o]; }
                dhv[o] = a * gelu_grad_ref(h[o]);
            }
            for (int c = 0; c < C; c++) {
                r_dpb[e * C + c] += gate * di[c];
                for (int o = 0; o < C4; o++) { r_dpw[((size_t)e * C + c) * C4 + o] += gate * di[c] * gelu_ref(h[o]); }
            }
            for (int o = 0; o < C4; o++) {
                r_dfcb[e * C4 + o] += dhv[o];
                for (int c = 0; c < C; c++) {
                    r_dfcw[((size_t)e * C4 + o) * C + c] += dhv[o] * xi[c];
                    r_dln[(size_t)i * C + c] += dhv[o] * fcw[((size_t)e * C4 + o) * C + c];
                }
            }
        }
        for (int j = 0; j < k; j++) { dp[pick[j]] += (dgate_r[j] - G) / S; }
        for (int e = 0; e < E; e++) { H += p[e] * dp[e]; }
        for (int e = 0; e < E; e++) {
            double dl = p[e] * (dp[e] - H);
            for (int c = 0; c < C; c++) {
                r_drw[e * C + c] += dl * xi[c];
                r_dln[(size_t)i * C + c] += dl * rw[e * C + c];
            }
        }
    }
    CHECK(!choice_differs, "moe layer: the router's choice differs from the double softmax's top %d", k);
    int before = failures;
    double e_out = moe_compare("out", out, r_out, (size_t)BT * C);
    double e_dln = moe_compare("d input", dln, r_dln, (size_t)BT * C);
    double e_drw = moe_compare("d routerw", drouterw, r_drw, (size_t)E * C);
    double e_w = fmax(moe_compare("d fcw", dw.fcw, r_dfcw, (size_t)E * C4 * C),
                      moe_compare("d fcprojw", dw.fcprojw, r_dpw, (size_t)E * C * C4));
    double e_b = fmax(moe_compare("d fcb", dw.fcb, r_dfcb, (size_t)E * C4), moe_compare("d fcprojb", dw.fcprojb, r_dpb, (size_t)E * C));
    printf("moe layer B=%d T=%d C=%d E=%d k=%d  %s worst |err|/max|ref| (tol 2^-5 = 0.031): out %.4f d input %.4f d routerw %.4f "
           "d expert weights %.4f d expert biases %.4f\n", B, T, C, E, k, failures == before ? "ok  " : "FAIL", e_out, e_dln,
           e_drw, e_w, e_b);
    void* dev[] = {ln, routerw, (void*)w.fcw, (void*)w.fcb, (void*)w.fcprojw, (void*)w.fcprojb, d_dout, d_daux, probs,
                   chosen, gates, d_row_pos, d_slot_row, xin, fch, fch_gelu, ret, out, dgate, dslots, dlogits, drouter,
                   dlogits_bf16, drouterw, dh, dx, dw.fcw, dw.fcb, dw.fcprojw, dw.fcprojb, dln};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) { device_free(dev[i]); }
    void* host[] = {x, rw, fcw, fcb, pw, pb, dout, h_x, h_rw, h_fcw, h_fcb, h_pw, h_pb, h_dout, daux, h_chosen, count,
                    row_pos, slot_row, cursor, first, src_first, r_out, r_dln, r_drw, r_dfcw, r_dfcb, r_dpw, r_dpb, p, dp,
                    h, y, dhv};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) { free(host[i]); }
}

// ---- the grouped expert matmul ---------------------------------------------------------------

// the experts' MLPs as one cuBLASLt matmul per expert and source (what kernels_fast_moe.cuh ran
// before its batched calls), forward, input half and weight half, and --tp's fp32 partial sums
// (fcproj's outputs, fc's input gradients)
static void moe_experts_one_by_one(floatX* y, floatX* fch, floatX* fch_gelu, floatX* dh, floatX* dx,
                                   float* y_partial, float* dx_partial, MoeExperts<float> dw, size_t slice,
                                   const floatX* xin, const floatX* dy, MoeExperts<const floatX> w,
                                   const int* src_first, int Q, int El, int C) {
    size_t C4 = 4 * (size_t)C;
    for (int e = 0; e < El; e++) {
        const int* sf = src_first + (size_t)e * (Q + 1);
        int r0 = sf[0], n = sf[Q] - r0;
        if (n == 0) { continue; }
        matmul_forward_fast(fch_gelu + r0 * C4, xin + (size_t)r0 * C, w.fcw + e * C4 * C, w.fcb + e * C4, n, C,
                            (int)C4, fch + r0 * C4);
        matmul_forward_fast(y + (size_t)r0 * C, fch_gelu + r0 * C4, w.fcprojw + e * C4 * C, w.fcprojb + e * C, n,
                            (int)C4, C, NULL);
        matmul_backward_fast(dh + r0 * C4, NULL, NULL, dy + (size_t)r0 * C, NULL, w.fcprojw + e * C4 * C, 1, n,
                             (int)C4, C, fch + r0 * C4);
        matmul_backward_fast(dx + (size_t)r0 * C, NULL, NULL, dh + r0 * C4, NULL, w.fcw + e * C4 * C, 1, n, C,
                             (int)C4, NULL);
        matmul_forward_partial_fast(y_partial + (size_t)r0 * C, fch_gelu + r0 * C4, w.fcprojw + e * C4 * C, n, (int)C4,
                                    C);
        matmul_backward_dinp_partial_fast(dx_partial + (size_t)r0 * C, dh + r0 * C4, w.fcw + e * C4 * C, n, C, (int)C4);
    }
    for (int e = 0; e < El; e++) {
        for (int q = 0; q < Q; q++) {
            int q0 = src_first[e * (Q + 1) + q], nq = src_first[e * (Q + 1) + q + 1] - q0;
            float* dfcw = dw.fcw + q * slice + e * C4 * C;
            float* dfcprojw = dw.fcprojw + q * slice + e * C4 * C;
            if (nq > 0) {
                matmul_backward_fast(NULL, dfcprojw, NULL, dy + (size_t)q0 * C, fch_gelu + q0 * C4, NULL, 1, nq,
                                     (int)C4, C, NULL);
                matmul_backward_fast(NULL, dfcw, NULL, dh + q0 * C4, xin + (size_t)q0 * C, NULL, 1, nq, C, (int)C4,
                                     NULL);
            } else {
                cudaCheck(cudaMemset(dfcprojw, 0, sizeof(float) * C4 * C));
                cudaCheck(cudaMemset(dfcw, 0, sizeof(float) * C4 * C));
            }
        }
    }
}

static int bytes_differ(const void* d_a, const void* d_b, size_t bytes) {
    unsigned char *a = host_copy((const unsigned char*)d_a, bytes), *b = host_copy((const unsigned char*)d_b, bytes);
    int differ = memcmp(a, b, bytes) != 0;
    free(a);
    free(b);
    return differ;
}

// The batched expert matmuls (kernels_fast_moe.cuh) = one matmul per expert, bit for bit, on
// rows counted by hand: an expert without rows, one with a single row, Q sources (the weight
// half's slices; a source that sends an expert nothing). Every output starts as NaN.
static void moe_grouped_case(int C, int El, int Q, const int* counts /* El x Q */) {
    const size_t C4 = 4 * (size_t)C;
    int* src_first = (int*)malloc_or_die(sizeof(int) * El * (Q + 1), "plan");
    int rows = 0;
    for (int e = 0; e < El; e++) {
        for (int q = 0; q < Q; q++) { src_first[e * (Q + 1) + q] = rows; rows += counts[e * Q + q]; }
        src_first[e * (Q + 1) + Q] = rows;
    }
    int* first = (int*)malloc_or_die(sizeof(int) * (El + 1), "plan");
    for (int e = 0; e <= El; e++) { first[e] = e < El ? src_first[e * (Q + 1)] : rows; }
    uint64_t state = 777;
    float* scratch = (float*)malloc_or_die(sizeof(float) * El * C4 * C, "as float");
    floatX* h_xin = random_bf16((size_t)rows * C, 1.0f, &state, scratch);
    floatX* h_dy = random_bf16((size_t)rows * C, 1.0f, &state, scratch);
    floatX* h_fcw = random_bf16(El * C4 * C, 0.3f, &state, scratch);
    floatX* h_fcb = random_bf16(El * C4, 0.1f, &state, scratch);
    floatX* h_pw = random_bf16(El * C4 * C, 0.15f, &state, scratch);
    floatX* h_pb = random_bf16((size_t)El * C, 0.1f, &state, scratch);
    floatX *xin = device_copy(h_xin, (size_t)rows * C), *dy = device_copy(h_dy, (size_t)rows * C);
    MoeExperts<const floatX> w = {device_copy(h_fcw, El * C4 * C), device_copy(h_fcb, El * C4),
                                  device_copy(h_pw, El * C4 * C), device_copy(h_pb, (size_t)El * C)};
    const size_t slice = El * C4 * C * 2 + 64;   // per source, as zero.h's slices: both weights and a gap
    floatX* act[2][5];   // y, fch, fch_gelu, dh, dx: batched, one by one
    MoeExperts<float> dw[2];
    for (int v = 0; v < 2; v++) {
        act[v][0] = (floatX*)device_nan(sizeof(floatX) * rows * C);
        act[v][1] = (floatX*)device_nan(sizeof(floatX) * rows * C4);
        act[v][2] = (floatX*)device_nan(sizeof(floatX) * rows * C4);
        act[v][3] = (floatX*)device_nan(sizeof(floatX) * rows * C4);
        act[v][4] = (floatX*)device_nan(sizeof(floatX) * rows * C);
        float* g = (float*)device_nan(sizeof(float) * slice * Q);
        dw[v] = {g, NULL, g + El * C4 * C + 32, NULL};   // the weights' gradients (the biases: below)
    }
    float* partial[2][2];   // --tp's fp32 partial sums, fcproj's outputs and fc's input gradients
    for (int v = 0; v < 2; v++) {
        for (int i = 0; i < 2; i++) { partial[v][i] = (float*)device_nan(sizeof(float) * rows * C); }
    }
    moe_experts_forward_fast(NULL, partial[0][0], act[0][1], act[0][2], xin, w, first, El, C, (int)C4);
    moe_experts_backward_input_fast(NULL, partial[0][1], act[0][3], dy, act[0][1], w, src_first, Q, El, C, (int)C4);
    moe_experts_forward_fast(act[0][0], NULL, act[0][1], act[0][2], xin, w, first, El, C, (int)C4);
    moe_experts_backward_input_fast(act[0][4], NULL, act[0][3], dy, act[0][1], w, src_first, Q, El, C, (int)C4);
    MoeExperts<float> dw_weights = {dw[0].fcw, (float*)device_nan(sizeof(float) * Q * slice), dw[0].fcprojw,
                                    (float*)device_nan(sizeof(float) * Q * slice)};   // the biases apart
    moe_experts_backward_weight_fast(dw_weights, slice, dy, act[0][3], act[0][2], xin, src_first, Q, El, C, (int)C4);
    moe_experts_one_by_one(act[1][0], act[1][1], act[1][2], act[1][3], act[1][4], partial[1][0], partial[1][1], dw[1],
                           slice, xin, dy, w, src_first, Q, El, C);
    const char* names[5] = {"y", "fch", "fch_gelu", "d fch", "d xin"};
    const size_t widths[5] = {(size_t)C, C4, C4, C4, (size_t)C};
    int bad = 0;
    for (int i = 0; i < 5; i++) {
        int d = bytes_differ(act[0][i], act[1][i], sizeof(floatX) * rows * widths[i]);
        CHECK(!d, "grouped expert matmul C=%d El=%d Q=%d: %s differs from one matmul per expert", C, El, Q, names[i]);
        bad += d;
    }
    const char* partial_names[2] = {"fcproj's fp32 partial outputs", "fc's fp32 partial input gradients"};
    for (int i = 0; i < 2; i++) {
        int d = bytes_differ(partial[0][i], partial[1][i], sizeof(float) * rows * C);
        CHECK(!d, "grouped expert matmul C=%d El=%d Q=%d: %s differ from one matmul per expert", C, El, Q,
              partial_names[i]);
        bad += d;
    }
    for (int q = 0; q < Q; q++) {
        int d = bytes_differ(dw[0].fcw + q * slice, dw[1].fcw + q * slice, sizeof(float) * El * C4 * C) ||
                bytes_differ(dw[0].fcprojw + q * slice, dw[1].fcprojw + q * slice, sizeof(float) * El * C4 * C);
        CHECK(!d, "grouped expert matmul C=%d El=%d Q=%d: source %d's weight gradients differ from one matmul per expert",
              C, El, Q, q);
        bad += d;
    }
    printf("grouped expert matmul C=%d El=%d Q=%d, %d rows: forward, input and weight gradients, --tp's fp32 partial "
           "sums = one matmul per expert bit for bit: %s\n", C, El, Q, rows, bad ? "FAIL" : "ok");
    void* dev[] = {xin, dy, (void*)w.fcw, (void*)w.fcb, (void*)w.fcprojw, (void*)w.fcprojb, dw[0].fcw, dw[1].fcw,
                   dw_weights.fcb, dw_weights.fcprojb};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) { device_free(dev[i]); }
    for (int v = 0; v < 2; v++) {
        for (int i = 0; i < 5; i++) { device_free(act[v][i]); }
        for (int i = 0; i < 2; i++) { device_free(partial[v][i]); }
    }
    void* host[] = {src_first, first, scratch, h_xin, h_dy, h_fcw, h_fcb, h_pw, h_pb};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) { free(host[i]); }
}

// with an argument, only the parts it lists (comma-separated: flash, ring, rows, matmul, moe), so
// that dev/test/test_emu_mutants.sh runs a broken copy against the parts it breaks
static const char* only_parts = NULL;
static bool part(const char* name) {
    if (!only_parts) { return true; }
    size_t n = strlen(name);
    for (const char* p = only_parts; (p = strstr(p, name)) != NULL; p += n) {
        if ((p == only_parts || p[-1] == ',') && (p[n] == '\0' || p[n] == ',')) { return true; }
    }
    return false;
}

int main(int argc, char** argv) {
    only_parts = argc > 1 ? argv[1] : NULL;
    flash_attention_setup();
    cublaslt_init();
#if LLMC_EMU_RACE_CHECK
    // (every access of the kernels checked: smaller problems)
    static const int flash_cases[][4] = {{1, 70, 1, 16}, {1, 80, 1, 64}};   // B T NH HS
    static const int matmul_cases[][4] = {{24, 32, 40, 0}, {17, 24, 16, 1}};   // BT K OC input-offset
#else
    static const int flash_cases[][4] = {{1, 64, 2, 16}, {2, 100, 2, 32}, {1, 257, 2, 64}, {2, 130, 3, 64}};
    static const int matmul_cases[][4] = {{64, 64, 192, 0}, {37, 96, 256, 0}, {50, 40, 24, 1}};
#endif
    for (size_t i = 0; part("flash") && i < sizeof(flash_cases) / sizeof(flash_cases[0]); i++) {
        flash_case(flash_cases[i][0], flash_cases[i][1], flash_cases[i][2], flash_cases[i][3]);
    }
    // N B T NH HS: T/N a multiple of 64 and not, the stretches T/2N crossing a tile edge
#if LLMC_EMU_RACE_CHECK
    static const int ring_cases[][5] = {{2, 1, 68, 1, 16}};
#else
    static const int ring_cases[][5] = {{2, 1, 128, 1, 16}, {2, 2, 100, 2, 32}, {2, 1, 260, 1, 64}, {3, 1, 150, 2, 16}};
#endif
    for (size_t i = 0; part("ring") && i < sizeof(ring_cases) / sizeof(ring_cases[0]); i++) {
        ring_case(ring_cases[i][0], ring_cases[i][1], ring_cases[i][2], ring_cases[i][3], ring_cases[i][4]);
    }
    static const int rows[] = {0, 1, 63, 64, 65, 127, 129};
    if (part("rows")) {
#if LLMC_EMU_RACE_CHECK
        flash_row_case(70, 1, 16, rows, 5);
#else
        flash_row_case(130, 2, 16, rows, 7);
        flash_row_case(130, 1, 64, rows, 7);
#endif
    }
    for (size_t i = 0; part("matmul") && i < sizeof(matmul_cases) / sizeof(matmul_cases[0]); i++) {
        matmul_case(matmul_cases[i][0], matmul_cases[i][1], matmul_cases[i][2], matmul_cases[i][3]);
    }
    if (part("matmul")) { cublaslt_refusals(); }
    if (part("moe")) {
#if LLMC_EMU_RACE_CHECK
        moe_layer_case(1, 8, 16, 4, 2);
        static const int counts_q1[] = {3, 0, 1};
        moe_grouped_case(16, 3, 1, counts_q1);
#else
        moe_layer_case(2, 16, 32, 4, 2);
        static const int counts_q1[] = {5, 0, 1, 13};          // El 4, one source
        static const int counts_q2[] = {3, 4, 0, 6, 0, 0, 9, 0};   // El 4, two sources
        moe_grouped_case(32, 4, 1, counts_q1);
        moe_grouped_case(24, 4, 2, counts_q2);
#endif
    }
    cublaslt_free();
    if (failures) { printf("%d FAILED\n", failures); }
    else { printf("fast mode's attention, matmuls and expert layer on the emulated GPU (%s): all checks passed\n",
                  only_parts ? only_parts : "every part"); }
    return failures ? 1 : 0;
}
