/*
 * cublasLt.h (emulated): a stand-in for the part of cuBLASLt that llmc/matmul_cublaslt.cuh
 * uses, so that file runs unchanged on the emulated GPU: the handle, a matmul descriptor with
 * its transposes, epilogue, bias and GELU aux attributes, column-major layouts, a preference
 * (workspace, minimum alignments), the heuristic and cublasLtMatmul; bf16 A and B, bf16 or
 * fp32 C = D, fp32 compute and scale; epilogues DEFAULT, BIAS, GELU_AUX_BIAS, DGELU; a strided
 * batch (the layouts' BATCH_COUNT and STRIDED_BATCH_OFFSET, the descriptor's bias and aux
 * batch strides).
 *
 * It checks what cuBLASLt checks and answers with its status codes, never a silent wrong
 * answer:
 *   CUBLAS_STATUS_NOT_SUPPORTED  a type combination, epilogue, operation or beta outside the
 *                                subset (the heuristic then finds no algorithm);
 *   CUBLAS_STATUS_INVALID_VALUE  shapes that do not chain (op(A) m x k, op(B) k x n, D m x n),
 *                                a leading dimension below the rows, a missing bias or aux
 *                                pointer, a GELU aux leading dimension below m or not a
 *                                multiple of 8, layouts of different batch counts, a batch
 *                                count below 1, a negative batch stride, a GELU aux batch
 *                                stride not a multiple of 8, an attribute of the wrong size,
 *                                and a pointer
 *                                at cublasLtMatmul less aligned than the algorithm was chosen
 *                                for: the preference's MIN_ALIGNMENT_*_BYTES (default 256, as
 *                                cuBLASLt's) is a promise, checked up to 16 bytes, the widest
 *                                access of a bf16 tensor-core kernel (the GELU aux pointer is
 *                                held to 16 bytes: it is written and read like D).
 * It computes D = alpha op(A) op(B) [+ bias] [epilogue] with a reference GEMM kernel on the
 * emulated GPU: one thread per element, exact bf16 products summed in k order in fp32, the
 * epilogue in fp32, one rounding to bf16 where D (and the GELU aux) are bf16; problem b of a
 * batch is the same kernel on pointers b strides on (grid z). GELU is the tanh form, computed
 * as train_gpt2.c computes it (llmc/canonical.h).
 */
#ifndef LLMC_EMU_CUBLASLT_H
#define LLMC_EMU_CUBLASLT_H

#include <stddef.h>
#include <stdint.h>
#include "cuda_runtime.h"
#include "cuda_bf16.h"
#include "llmc/canonical.h"

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum {
    CUBLASLT_EPILOGUE_DEFAULT = 1,
    CUBLASLT_EPILOGUE_BIAS = 4,
    CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 164,
    CUBLASLT_EPILOGUE_DGELU = 192
} cublasLtEpilogue_t;
typedef enum {
    CUBLASLT_MATMUL_DESC_TRANSA = 3,
    CUBLASLT_MATMUL_DESC_TRANSB = 4,
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
    CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE = 13
} cublasLtMatmulDescAttributes_t;
typedef enum {
    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,
    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6
} cublasLtMatrixLayoutAttribute_t;
typedef enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
} cublasLtMatmulPreferenceAttributes_t;

struct EmuLtHandle { int unused; };
struct EmuLtMatmulDesc {
    cublasOperation_t transa, transb;
    cublasLtEpilogue_t epilogue;
    const void* bias;
    void* aux;
    int64_t aux_ld;
    int64_t bias_batch_stride, aux_batch_stride;   // elements
};
struct EmuLtLayout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
    int32_t batch_count;
    int64_t batch_stride;   // elements
};
struct EmuLtPreference { uint64_t max_workspace; uint32_t min_alignment[4]; };   // A, B, C, D
typedef EmuLtHandle* cublasLtHandle_t;
typedef EmuLtMatmulDesc* cublasLtMatmulDesc_t;
typedef EmuLtLayout* cublasLtMatrixLayout_t;
typedef EmuLtPreference* cublasLtMatmulPreference_t;
// the stand-in's one algorithm, and the alignments (A, B, C, D) it was chosen for
typedef struct { uint64_t data[8]; } cublasLtMatmulAlgo_t;
typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;
#define EMU_LT_ALGO_ID 0x4c4c4d43656d75ull   // marks an algorithm this stand-in's heuristic made

static inline cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    *handle = new EmuLtHandle();
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    if (!handle) { return CUBLAS_STATUS_NOT_INITIALIZED; }
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

static inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                                      cudaDataType_t scale) {
    if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) { return CUBLAS_STATUS_NOT_SUPPORTED; }
    *desc = new EmuLtMatmulDesc{CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0, 0, 0};
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    delete desc;
    return CUBLAS_STATUS_SUCCESS;
}

// copies an attribute whose size must be exactly the field's
static inline cublasStatus_t emu_lt_set(void* field, size_t field_bytes, const void* buf, size_t bytes) {
    if (bytes != field_bytes) { return CUBLAS_STATUS_INVALID_VALUE; }
    memcpy(field, buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                            cublasLtMatmulDescAttributes_t attr, const void* buf,
                                                            size_t bytes) {
    switch (attr) {
        case CUBLASLT_MATMUL_DESC_TRANSA: return emu_lt_set(&desc->transa, sizeof(desc->transa), buf, bytes);
        case CUBLASLT_MATMUL_DESC_TRANSB: return emu_lt_set(&desc->transb, sizeof(desc->transb), buf, bytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE: return emu_lt_set(&desc->epilogue, sizeof(desc->epilogue), buf, bytes);
        case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return emu_lt_set(&desc->bias, sizeof(desc->bias), buf, bytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return emu_lt_set(&desc->aux, sizeof(desc->aux), buf, bytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return emu_lt_set(&desc->aux_ld, sizeof(desc->aux_ld), buf, bytes);
        case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE:
            return emu_lt_set(&desc->bias_batch_stride, sizeof(desc->bias_batch_stride), buf, bytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE:
            return emu_lt_set(&desc->aux_batch_stride, sizeof(desc->aux_batch_stride), buf, bytes);
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

static inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType_t type,
                                                        uint64_t rows, uint64_t cols, int64_t ld) {
    if (ld < 1 || (uint64_t)ld < rows) { return CUBLAS_STATUS_INVALID_VALUE; }
    *layout = new EmuLtLayout{type, rows, cols, ld, 1, 0};
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                              cublasLtMatrixLayoutAttribute_t attr, const void* buf,
                                                              size_t bytes) {
    switch (attr) {
        case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
            return emu_lt_set(&layout->batch_count, sizeof(layout->batch_count), buf, bytes);
        case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
            return emu_lt_set(&layout->batch_stride, sizeof(layout->batch_stride), buf, bytes);
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}
static inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    delete layout;
    return CUBLAS_STATUS_SUCCESS;
}

static inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    *pref = new EmuLtPreference{0, {256, 256, 256, 256}};
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    delete pref;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                                  cublasLtMatmulPreferenceAttributes_t attr,
                                                                  const void* buf, size_t bytes) {
    switch (attr) {
        case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
            return emu_lt_set(&pref->max_workspace, sizeof(pref->max_workspace), buf, bytes);
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
            uint32_t* field = &pref->min_alignment[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES];
            return emu_lt_set(field, sizeof(*field), buf, bytes);
        }
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

// Whether the problem is one the stand-in computes, and consistent: the heuristic's and the
// matmul's first check. Sets m, n, k.
static inline cublasStatus_t emu_lt_check(const EmuLtMatmulDesc* desc, const EmuLtLayout* a, const EmuLtLayout* b,
                                          const EmuLtLayout* c, const EmuLtLayout* d, uint64_t* m, uint64_t* n,
                                          uint64_t* k) {
    if (a->type != CUDA_R_16BF || b->type != CUDA_R_16BF || c->type != d->type ||
        (d->type != CUDA_R_16BF && d->type != CUDA_R_32F)) {
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if ((desc->transa != CUBLAS_OP_N && desc->transa != CUBLAS_OP_T) ||
        (desc->transb != CUBLAS_OP_N && desc->transb != CUBLAS_OP_T)) {
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    *m = desc->transa == CUBLAS_OP_T ? a->cols : a->rows;
    *k = desc->transa == CUBLAS_OP_T ? a->rows : a->cols;
    uint64_t kb = desc->transb == CUBLAS_OP_T ? b->cols : b->rows;
    *n = desc->transb == CUBLAS_OP_T ? b->rows : b->cols;
    if (kb != *k || d->rows != *m || d->cols != *n || c->rows != *m || c->cols != *n || c->ld != d->ld) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (d->batch_count < 1 || a->batch_count != d->batch_count || b->batch_count != d->batch_count ||
        c->batch_count != d->batch_count || c->batch_stride != d->batch_stride || a->batch_stride < 0 ||
        b->batch_stride < 0 || d->batch_stride < 0 || desc->bias_batch_stride < 0 || desc->aux_batch_stride < 0) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    switch (desc->epilogue) {
        case CUBLASLT_EPILOGUE_DEFAULT: return CUBLAS_STATUS_SUCCESS;
        case CUBLASLT_EPILOGUE_BIAS:
        case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
        case CUBLASLT_EPILOGUE_DGELU: break;
        default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->type != CUDA_R_16BF) { return CUBLAS_STATUS_NOT_SUPPORTED; }   // bf16 bias and aux, as D
    if (desc->epilogue != CUBLASLT_EPILOGUE_DGELU && desc->bias == NULL) { return CUBLAS_STATUS_INVALID_VALUE; }
    if (desc->epilogue != CUBLASLT_EPILOGUE_BIAS &&
        (desc->aux == NULL || desc->aux_ld < (int64_t)*m || desc->aux_ld % 8 != 0 ||
         (d->batch_count > 1 && desc->aux_batch_stride % 8 != 0))) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}

static inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                            cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                            cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                                            cublasLtMatmulPreference_t pref, int requested,
                                                            cublasLtMatmulHeuristicResult_t* results, int* found) {
    *found = 0;
    if (!handle) { return CUBLAS_STATUS_NOT_INITIALIZED; }
    if (requested < 1) { return CUBLAS_STATUS_INVALID_VALUE; }
    uint64_t m, n, k;
    cublasStatus_t st = emu_lt_check(desc, a, b, c, d, &m, &n, &k);
    if (st != CUBLAS_STATUS_SUCCESS) { return st; }
    memset(&results[0], 0, sizeof(results[0]));
    results[0].algo.data[0] = EMU_LT_ALGO_ID;
    for (int i = 0; i < 4; i++) { results[0].algo.data[1 + i] = pref->min_alignment[i]; }
    results[0].workspaceSize = 0;
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}

// one element of D: the reference GEMM's thread (i, j) of problem blockIdx.z
struct EmuLtProblem {
    const __nv_bfloat16 *a, *b, *bias;
    void* d;
    __nv_bfloat16* aux;
    int64_t lda, ldb, ldd, aux_ld;
    uint64_t m, n, k;
    int transa, transb, d_fp32;
    cublasLtEpilogue_t epilogue;
    float alpha;
    int64_t stride_a, stride_b, stride_d, stride_bias, stride_aux;   // elements from one problem to the next
};

static inline void emu_lt_gemm_element(EmuLtProblem p) {
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x, j = (uint64_t)blockIdx.y * blockDim.y + threadIdx.y;
    if (i >= p.m || j >= p.n) { return; }
    uint64_t z = blockIdx.z;
    p.a += z * p.stride_a;
    p.b += z * p.stride_b;
    p.d = (char*)p.d + z * p.stride_d * (p.d_fp32 ? sizeof(float) : sizeof(__nv_bfloat16));
    if (p.bias) { p.bias += z * p.stride_bias; }
    if (p.aux) { p.aux += z * p.stride_aux; }
    float acc = 0.0f;
    for (uint64_t kk = 0; kk < p.k; kk++) {
        float av = __bfloat162float(p.transa ? p.a[kk + i * p.lda] : p.a[i + kk * p.lda]);
        float bv = __bfloat162float(p.transb ? p.b[j + kk * p.ldb] : p.b[kk + j * p.ldb]);
        acc += av * bv;   // exact product: 8 x 8 significant bits
    }
    float v = p.alpha * acc;
    if (p.epilogue == CUBLASLT_EPILOGUE_BIAS || p.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
        v += __bfloat162float(p.bias[i]);
    }
    if (p.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
        p.aux[i + j * p.aux_ld] = __float2bfloat16_rn(v);
        v = canon_gelu(v);
    }
    if (p.epilogue == CUBLASLT_EPILOGUE_DGELU) { v *= canon_gelu_grad(__bfloat162float(p.aux[i + j * p.aux_ld])); }
    if (p.d_fp32) {
        ((float*)p.d)[i + j * p.ldd] = v;
    } else {
        ((__nv_bfloat16*)p.d)[i + j * p.ldd] = __float2bfloat16_rn(v);
    }
}

// the widest alignment (up to 16) the pointer has: what the promise is checked against
static inline uint32_t emu_lt_alignment(const void* p) {
    uint32_t al = 16;
    while (al > 1 && (uintptr_t)p % al != 0) { al /= 2; }
    return al;
}

static inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                                            const void* A, cublasLtMatrixLayout_t a, const void* B,
                                            cublasLtMatrixLayout_t b, const void* beta, const void* C,
                                            cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                                            const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                                            cudaStream_t stream) {
    if (!handle) { return CUBLAS_STATUS_NOT_INITIALIZED; }
    uint64_t m, n, k;
    cublasStatus_t st = emu_lt_check(desc, a, b, c, d, &m, &n, &k);
    if (st != CUBLAS_STATUS_SUCCESS) { return st; }
    if (*(const float*)beta != 0.0f) { return CUBLAS_STATUS_NOT_SUPPORTED; }   // D = alpha op(A) op(B) only
    if (!algo || algo->data[0] != EMU_LT_ALGO_ID) { return CUBLAS_STATUS_INVALID_VALUE; }
    const void* ptrs[4] = {A, B, C, D};
    for (int i = 0; i < 4; i++) {
        uint32_t promised = (uint32_t)algo->data[1 + i] < 16 ? (uint32_t)algo->data[1 + i] : 16;
        if (emu_lt_alignment(ptrs[i]) < promised) { return CUBLAS_STATUS_INVALID_VALUE; }
    }
    if (desc->aux && emu_lt_alignment(desc->aux) < 16) { return CUBLAS_STATUS_INVALID_VALUE; }
    (void)workspace; (void)workspace_bytes; (void)stream;   // the reference GEMM needs no workspace
    EmuLtProblem p = {(const __nv_bfloat16*)A, (const __nv_bfloat16*)B, (const __nv_bfloat16*)desc->bias, D,
                      (__nv_bfloat16*)desc->aux, a->ld, b->ld, d->ld, desc->aux_ld, m, n, k,
                      desc->transa == CUBLAS_OP_T, desc->transb == CUBLAS_OP_T, d->type == CUDA_R_32F,
                      desc->epilogue, *(const float*)alpha, a->batch_stride, b->batch_stride, d->batch_stride,
                      desc->bias_batch_stride, desc->aux_batch_stride};
    dim3 block(16, 16), grid((unsigned)((m + 15) / 16), (unsigned)((n + 15) / 16), (unsigned)d->batch_count);
    emu_launch("cublasLtMatmul (the stand-in's reference GEMM)", (const void*)&emu_lt_gemm_element, grid, block, 0,
               [=]() { emu_lt_gemm_element(p); });
    return CUBLAS_STATUS_SUCCESS;
}

#endif // LLMC_EMU_CUBLASLT_H
