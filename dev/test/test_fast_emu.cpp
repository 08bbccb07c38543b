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
 *   cuBLASLt (dev/gpu/emu/cublasLt.h) through llmc/matmul_cublaslt.cuh unchanged: the forward
 *     with bias and with GELU_AUX_BIAS, the input gradient plain and with DGELU, the fp32
 *     weight gradient, each bit-identical to a triple loop that sums the bf16 products in k
 *     order in fp32 and rounds where cuBLASLt rounds; an input at a 2-byte offset (its
 *     alignment passed in the preference) computes right too. The stand-in's refusals: the
 *     status code for each thing cuBLASLt refuses.
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
    struct { const char* what; cublasStatus_t got, want; } cases[16];
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

int main(void) {
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
    for (size_t i = 0; i < sizeof(flash_cases) / sizeof(flash_cases[0]); i++) {
        flash_case(flash_cases[i][0], flash_cases[i][1], flash_cases[i][2], flash_cases[i][3]);
    }
    static const int rows[] = {0, 1, 63, 64, 65, 127, 129};
#if LLMC_EMU_RACE_CHECK
    flash_row_case(70, 1, 16, rows, 5);
#else
    flash_row_case(130, 2, 16, rows, 7);
    flash_row_case(130, 1, 64, rows, 7);
#endif
    for (size_t i = 0; i < sizeof(matmul_cases) / sizeof(matmul_cases[0]); i++) {
        matmul_case(matmul_cases[i][0], matmul_cases[i][1], matmul_cases[i][2], matmul_cases[i][3]);
    }
    cublaslt_refusals();
    cublaslt_free();
    printf(failures ? "%d FAILED\n" : "fast mode's attention and matmuls on the emulated GPU: all checks passed\n",
           failures);
    return failures ? 1 : 0;
}
