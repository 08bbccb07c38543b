/*
 * kernels_fast_moe.cuh: fast mode's mixture-of-experts kernels (llmc/moe.h THE LAYER and THE
 * BACKWARD on bf16 rows, fp32 arithmetic inside each kernel). The router runs in fp32 on
 * kernels_moe_det.cuh's kernels (its softmax, top-k and gates, and its backward row, are
 * moe.h's per-output functions): the choice of experts is then the deterministic build's for
 * the same logits. The expert MLPs are cuBLASLt matmuls (matmul_cublaslt.cuh), one per expert
 * over the rows it received. What is here moves bf16 rows between the positions and the
 * experts' rows, forms the gated combine and its backward, and reduces the experts' bias
 * gradients. Each output is computed by one thread in a fixed order, so a run is repeatable.
 */
#ifndef LLMC_KERNELS_FAST_MOE_CUH
#define LLMC_KERNELS_FAST_MOE_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/moe.h"

// out (n,C) row r = in row index[r] (bf16): dispatch rows from positions, work rows from
// received rows and back
__global__ void moe_gather_rows_fast_kernel(floatX* out, const floatX* in, const int* index, int n, int C) {
    size_t total = (size_t)n * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / C, c = i % C;
        out[i] = in[(size_t)index[r] * C + c];
    }
}
static void moe_gather_rows_fast(floatX* out, const floatX* in, const int* index, int n, int C) {
    if (n == 0) { return; }
    LAUNCH(moe_gather_rows_fast_kernel, elementwise_blocks((size_t)n * C, 256), 256, out, in, index, n, C);
    cudaLaunchCheck("moe_gather_rows_fast_kernel");
}

// out (BT,C) = the gated sum of each position's k expert rows (rows: dispatch order, bf16),
// in fp32 in ascending expert index (moe.h's combine), rounded once
__global__ void moe_combine_fast_kernel(floatX* out, const floatX* rows, const float* gates, const int* slot_row,
                                        int BT, int k, int C) {
    size_t total = (size_t)BT * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t p = i / C, c = i % C;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            acc = fmaf(gates[p * k + j], __bfloat162float(rows[(size_t)slot_row[p * k + j] * C + c]), acc);
        }
        out[i] = __float2bfloat16(acc);
    }
}
static void moe_combine_fast(floatX* out, const floatX* rows, const float* gates, const int* slot_row, int BT, int k,
                             int C) {
    LAUNCH(moe_combine_fast_kernel, elementwise_blocks((size_t)BT * C, 256), 256, out, rows, gates, slot_row, BT, k, C);
    cudaLaunchCheck("moe_combine_fast_kernel");
}

// The combine's backward, one slot (position p, pick j) per thread: dgate (BT,k) fp32 = dout[p]
// . rows[slot_row], drows[slot_row] (bf16) = gate * dout[p]
__global__ void moe_combine_backward_fast_kernel(float* dgate, floatX* drows, const floatX* dout, const floatX* rows,
                                                 const float* gates, const int* slot_row, int BT, int k, int C) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= BT * k) { return; }
    size_t p = s / k, r = slot_row[s];
    float g = gates[s], acc = 0.0f;
    for (int c = 0; c < C; c++) {
        float d = __bfloat162float(dout[p * C + c]);
        acc = fmaf(d, __bfloat162float(rows[r * C + c]), acc);
        drows[r * C + c] = __float2bfloat16(g * d);
    }
    dgate[s] = acc;
}
static void moe_combine_backward_fast(float* dgate, floatX* drows, const floatX* dout, const floatX* rows,
                                      const float* gates, const int* slot_row, int BT, int k, int C) {
    LAUNCH(moe_combine_backward_fast_kernel, ceil_div_u((size_t)BT * k, 128), 128, dgate, drows, dout, rows, gates,
           slot_row, BT, k, C);
    cudaLaunchCheck("moe_combine_backward_fast_kernel");
}

// dinp (BT,C) = the router's input gradient (fp32) + each pick's expert input gradient (bf16
// rows, dispatch order), ascending expert index, rounded once
__global__ void moe_dinput_combine_fast_kernel(floatX* dinp, const float* drouter, const floatX* drows,
                                               const int* slot_row, int BT, int k, int C) {
    size_t total = (size_t)BT * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t p = i / C, c = i % C;
        float acc = drouter[i];
        for (int j = 0; j < k; j++) { acc = acc + __bfloat162float(drows[(size_t)slot_row[p * k + j] * C + c]); }
        dinp[i] = __float2bfloat16(acc);
    }
}
static void moe_dinput_combine_fast(floatX* dinp, const float* drouter, const floatX* drows, const int* slot_row,
                                    int BT, int k, int C) {
    LAUNCH(moe_dinput_combine_fast_kernel, elementwise_blocks((size_t)BT * C, 256), 256, dinp, drouter, drows,
           slot_row, BT, k, C);
    cudaLaunchCheck("moe_dinput_combine_fast_kernel");
}

// dbias (OC) fp32 = the sum over an expert's n rows of dout (n,OC) bf16, one column per
// thread in row order (0 for an expert without rows)
__global__ void moe_bias_grad_fast_kernel(float* dbias, const floatX* dout, int n, int OC) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) { return; }
    float acc = 0.0f;
    for (int r = 0; r < n; r++) { acc = acc + __bfloat162float(dout[(size_t)r * OC + o]); }
    dbias[o] = acc;
}
static void moe_bias_grad_fast(float* dbias, const floatX* dout, int n, int OC) {
    LAUNCH(moe_bias_grad_fast_kernel, ceil_div_u((size_t)OC, 128), 128, dbias, dout, n, OC);
    cudaLaunchCheck("moe_bias_grad_fast_kernel");
}

#endif // LLMC_KERNELS_FAST_MOE_CUH
