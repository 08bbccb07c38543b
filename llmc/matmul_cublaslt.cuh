/*
 * matmul_cublaslt.cuh: fast mode's matmuls on tensor cores through cuBLASLt: bf16 inputs,
 * fp32 accumulation, bf16 activations out, fp32 weight gradients out (written fresh per
 * microbatch: the microbatch tree adds them, as in train_gpt2.c). Epilogues fuse the bias
 * and GELU of the forward (GELU_AUX_BIAS keeps the pre-GELU input for the backward) and the
 * GELU derivative of the backward (DGELU).
 *
 * Row-major (BT,K) activations and (OC,K) weights are column-major (K,BT) and (K,OC) to
 * cuBLAS, so:  out (OC x BT) = W^T(OC x K) . inp (K x BT)        forward
 *              dinp (K x BT) = W (K x OC) . dout (OC x BT)        backward, data
 *              dW (K x OC)   = inp (K x BT) . dout^T (BT x OC)    backward, weights
 */
#ifndef LLMC_MATMUL_CUBLASLT_CUH
#define LLMC_MATMUL_CUBLASLT_CUH

#include <cublasLt.h>
#include "llmc/cuda_common.cuh"
#include "llmc/kernels_det.cuh"

static inline void cublas_check_(cublasStatus_t st, const char* what, const char* file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) { fatal("cuBLASLt error %d in %s (%s:%d)", (int)st, what, file, line); }
}
#define cublasCheck(call) cublas_check_((call), #call, __FILE__, __LINE__)

#define CUBLASLT_WORKSPACE_BYTES (32u << 20)
static cublasLtHandle_t cublaslt_handle;
static void* cublaslt_workspace;

static void cublaslt_init(void) {
    cublasCheck(cublasLtCreate(&cublaslt_handle));
    cublaslt_workspace = device_alloc(CUBLASLT_WORKSPACE_BYTES, "cuBLASLt workspace");
}

// the largest power of two (up to 256) dividing the address: the alignment cuBLASLt may assume
static inline uint32_t ptr_alignment(const void* p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a % al) != 0) { al /= 2; }
    return al;
}

// A strided batch of `count` problems (count 1: one matmul): problem b's A, B, D, bias and
// aux begin `a`, `b`, `d`, `bias`, `aux` elements after problem b-1's
// (CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT / _STRIDED_BATCH_OFFSET on the three layouts,
// CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE / _EPILOGUE_AUX_BATCH_STRIDE on the descriptor).
typedef struct { int count; int64_t a, b, d, bias, aux; } LtBatch;

// Per-problem cache: the matmul descriptor, the three layouts and the heuristic's algorithm,
// built once per problem (the same dozen shapes recur every step) and reused; only the bias
// and aux pointers, which change from call to call, are set on every call. The key is every
// field before `algo` (memset to zero, then filled field by field: its padding compares
// equal). A least-recently-used table: a new problem takes a free slot, or when all
// LT_CACHE_SIZE are taken evicts the one used longest ago (destroying its descriptors);
// entries are never dropped wholesale.
typedef struct {
    int transa, transb, m, n, k, d_fp32, epilogue, has_bias, has_aux;
    uint32_t align[5];   // A, B, D, bias, aux (0 when absent)
    LtBatch batch;
    // ---- not part of the key ----
    cublasLtMatmulAlgo_t algo;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    uint64_t last_use;   // 0: free slot
} LtCacheEntry;
#define LT_CACHE_SIZE 128
#define LT_KEY_BYTES offsetof(LtCacheEntry, algo)
static LtCacheEntry lt_cache[LT_CACHE_SIZE];
static uint64_t lt_cache_clock = 0;

static void lt_cache_release(LtCacheEntry* e) {
    if (e->last_use == 0) { return; }
    cublasCheck(cublasLtMatmulDescDestroy(e->desc));
    cublasCheck(cublasLtMatrixLayoutDestroy(e->la));
    cublasCheck(cublasLtMatrixLayoutDestroy(e->lb));
    cublasCheck(cublasLtMatrixLayoutDestroy(e->ld));
    memset(e, 0, sizeof(*e));
}

static void cublaslt_free(void) {
    for (int i = 0; i < LT_CACHE_SIZE; i++) { lt_cache_release(&lt_cache[i]); }
    lt_cache_clock = 0;
    cublasCheck(cublasLtDestroy(cublaslt_handle));
}

// the pointers that change from call to call, on a cached descriptor
static void lt_set_pointers(cublasLtMatmulDesc_t desc, const floatX* bias, floatX* aux, int m) {
    if (bias) {
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    if (aux) {
        int64_t ld = m;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    }
}

// the batch attributes of a layout (nothing for one problem)
static void lt_set_batch(cublasLtMatrixLayout_t layout, int count, int64_t stride) {
    if (count == 1) { return; }
    cublasCheck(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    cublasCheck(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                 sizeof(stride)));
}

// D (m x n, column-major, ld m) = op(A) . op(B) [+ bias] [epilogue], A/B bf16; D bf16 or fp32
// (d_fp32). transa: A stored k x m (else m x k); transb: B stored n x k (else k x n). For each
// of batch->count problems (the strides of LtBatch), in one cublasLtMatmul.
static void lt_matmul_batched(void* D, int d_fp32, const floatX* A, int transa, const floatX* B, int transb,
                              int m, int n, int k, cublasLtEpilogue_t epilogue, const floatX* bias,
                              floatX* aux, const LtBatch* batch, const char* name) {
    LtCacheEntry key;
    memset(&key, 0, sizeof(key));
    key.transa = transa; key.transb = transb; key.m = m; key.n = n; key.k = k;
    key.d_fp32 = d_fp32; key.epilogue = (int)epilogue; key.has_bias = bias != NULL; key.has_aux = aux != NULL;
    key.align[0] = ptr_alignment(A); key.align[1] = ptr_alignment(B); key.align[2] = ptr_alignment(D);
    key.align[3] = bias ? ptr_alignment(bias) : 0;
    key.align[4] = aux ? ptr_alignment(aux) : 0;
    key.batch.count = batch->count;   // field by field: LtBatch's padding stays the memset's zeros
    key.batch.a = batch->a; key.batch.b = batch->b; key.batch.d = batch->d;
    key.batch.bias = batch->bias; key.batch.aux = batch->aux;
    LtCacheEntry* e = NULL;
    int victim = 0;
    for (int i = 0; i < LT_CACHE_SIZE; i++) {
        LtCacheEntry* c = &lt_cache[i];
        if (c->last_use != 0 && memcmp(c, &key, LT_KEY_BYTES) == 0) { e = c; break; }
        if (c->last_use < lt_cache[victim].last_use) { victim = i; }   // a free slot (0) wins
    }
    if (e == NULL) {
        e = &lt_cache[victim];
        lt_cache_release(e);   // the least recently used, when the table is full
        memcpy(e, &key, LT_KEY_BYTES);
        cublasCheck(cublasLtMatmulDescCreate(&e->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t opa = transa ? CUBLAS_OP_T : CUBLAS_OP_N, opb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
        cublasCheck(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
        cublasCheck(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
        cublasCheck(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
        cublasCheck(cublasLtMatrixLayoutCreate(&e->la, CUDA_R_16BF, transa ? k : m, transa ? m : k, transa ? k : m));
        cublasCheck(cublasLtMatrixLayoutCreate(&e->lb, CUDA_R_16BF, transb ? n : k, transb ? k : n, transb ? n : k));
        cublasCheck(cublasLtMatrixLayoutCreate(&e->ld, d_fp32 ? CUDA_R_32F : CUDA_R_16BF, m, n, m));
        lt_set_batch(e->la, batch->count, batch->a);
        lt_set_batch(e->lb, batch->count, batch->b);
        lt_set_batch(e->ld, batch->count, batch->d);
        if (batch->count > 1 && bias) {
            cublasCheck(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &batch->bias,
                                                       sizeof(batch->bias)));
        }
        if (batch->count > 1 && aux) {
            cublasCheck(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE,
                                                       &batch->aux, sizeof(batch->aux)));
        }
        lt_set_pointers(e->desc, bias, aux, m);
        cublasLtMatmulPreference_t pref;
        cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
        size_t ws = CUBLASLT_WORKSPACE_BYTES;
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align[0], 4));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align[1], 4));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align[2], 4));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align[2], 4));
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle, e->desc, e->la, e->lb, e->ld, e->ld, pref,
                                                           1, &result, &found);
        cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
        if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
            fatal("cuBLASLt has no algorithm for %s (m=%d n=%d k=%d, batch %d, epilogue %d, status %d)", name, m, n,
                  k, batch->count, (int)epilogue, (int)st);
        }
        e->algo = result.algo;
    } else {
        lt_set_pointers(e->desc, bias, aux, m);
    }
    e->last_use = ++lt_cache_clock;
    const float alpha = 1.0f, beta = 0.0f;
    cublasCheck(cublasLtMatmul(cublaslt_handle, e->desc, &alpha, A, e->la, B, e->lb, &beta, D, e->ld, D, e->ld,
                               &e->algo, cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES, 0));
}
static void lt_matmul(void* D, int d_fp32, const floatX* A, int transa, const floatX* B, int transb, int m, int n,
                      int k, cublasLtEpilogue_t epilogue, const floatX* bias, floatX* aux, const char* name) {
    const LtBatch one = {1, 0, 0, 0, 0, 0};
    lt_matmul_batched(D, d_fp32, A, transa, B, transb, m, n, k, epilogue, bias, aux, &one, name);
}

// out (BT,OC) = inp (BT,K) @ weight (OC,K)^T + bias; with gelu_pre: gelu_pre = that, and
// out = gelu(that) (the fc layer's matmul and GELU in one)
static void matmul_forward_fast(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias,
                                int BT, int K, int OC, floatX* gelu_pre) {
    cublasLtEpilogue_t epi = gelu_pre ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                      : (bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
    lt_matmul(out, 0, weight, 1, inp, 0, OC, BT, K, epi, bias, gelu_pre, "matmul_forward");
}

// dinp (BT,K) = dout @ weight, times gelu'(gelu_pre) when given (the fcproj backward and the
// GELU backward in one); dweight (OC,K) fp32 = dout^T @ inp; dbias (OC) fp32 by the exact R3
// kernel of deterministic mode. Any output may be NULL.
static void matmul_backward_fast(floatX* dinp, float* dweight, float* dbias, const floatX* dout,
                                 const floatX* inp, const floatX* weight, int B, int T, int K, int OC,
                                 const floatX* gelu_pre) {
    int BT = B * T;
    if (dinp) {
        lt_matmul(dinp, 0, weight, 0, dout, 0, K, BT, OC,
                  gelu_pre ? CUBLASLT_EPILOGUE_DGELU : CUBLASLT_EPILOGUE_DEFAULT, NULL,
                  (floatX*)gelu_pre, "matmul_backward dinp");
    }
    if (dweight) {
        lt_matmul(dweight, 1, inp, 0, dout, 1, K, OC, BT, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL,
                  "matmul_backward dweight");
    }
    if (dbias) { position_reduce_x(dbias, dout, 1, B, T, OC); }
}

// The same three matmuls over `count` problems of `rows` rows each, in one cuBLASLt call:
// problem b's inp, out, dout, dinp and gelu_pre are rows [b*rows, (b+1)*rows) of theirs, its
// weight (OC,K), dweight and bias the b-th after one another. The problems' arithmetic is the
// single matmul's, element for element.
static void matmul_forward_batched_fast(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias,
                                        int count, int rows, int K, int OC, floatX* gelu_pre) {
    cublasLtEpilogue_t epi = gelu_pre ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                      : (bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
    const LtBatch batch = {count, (int64_t)OC * K, (int64_t)rows * K, (int64_t)rows * OC, OC, (int64_t)rows * OC};
    lt_matmul_batched(out, 0, weight, 1, inp, 0, OC, rows, K, epi, bias, gelu_pre, &batch, "matmul_forward batched");
}
static void matmul_backward_batched_fast(floatX* dinp, float* dweight, const floatX* dout, const floatX* inp,
                                         const floatX* weight, int count, int rows, int K, int OC,
                                         const floatX* gelu_pre) {
    if (dinp) {
        const LtBatch batch = {count, (int64_t)OC * K, (int64_t)rows * OC, (int64_t)rows * K, 0, (int64_t)rows * K};
        lt_matmul_batched(dinp, 0, weight, 0, dout, 0, K, rows, OC,
                          gelu_pre ? CUBLASLT_EPILOGUE_DGELU : CUBLASLT_EPILOGUE_DEFAULT, NULL, (floatX*)gelu_pre,
                          &batch, "matmul_backward dinp batched");
    }
    if (dweight) {
        const LtBatch batch = {count, (int64_t)rows * K, (int64_t)rows * OC, (int64_t)OC * K, 0, 0};
        lt_matmul_batched(dweight, 1, inp, 0, dout, 1, K, OC, rows, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, &batch,
                          "matmul_backward dweight batched");
    }
}

#endif // LLMC_MATMUL_CUBLASLT_CUH
