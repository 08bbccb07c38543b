/*
 * kernels_moe_det.cuh: the deterministic device twins of the mixture-of-experts layer's CPU
 * kernels (llmc/kernels.h's contract; train_gpt2.c and llmc/cpu_fast.h), on top of
 * llmc/kernels_det.cuh (whose position reductions they reuse): with it, the whole device set
 * that train_gpt2.cu compiles the model on. The same names and arguments,
 * each output computed by one thread with moe.h's per-output functions (the router row, the
 * gated combine, the router's backward row, the R3 over an expert's rows), so the bits are the
 * CPU's. The expert MLPs themselves are kernels_det.cuh's matmuls, one per expert.
 */
#ifndef LLMC_KERNELS_MOE_DET_CUH
#define LLMC_KERNELS_MOE_DET_CUH

#include "llmc/kernels_det.cuh"
#include "llmc/kernels.h"
#include "llmc/moe.h"

// one position per thread: its softmax over E, its top k, its gates
static __global__ void moe_router_forward_kernel(float* probs, int* chosen, float* gates, const float* logits, int BT,
                                                 int E, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT) { return; }
    moe_router_row(probs + (size_t)i * E, chosen + (size_t)i * k, gates + (size_t)i * k, logits + (size_t)i * E, E, k);
}

static inline void moe_router_forward(float* probs, int* chosen, float* gates, const float* logits, int BT, int E, int k) {
    LAUNCH(moe_router_forward_kernel, ceil_div_u((size_t)BT, 128), 128, probs, chosen, gates, logits, BT, E, k);
    cudaLaunchCheck("moe_router_forward_kernel");
}

// psum (E) = R3 over positions of each expert's probability: the bias-gradient reduction
static inline void moe_expert_prob_sums(float* psum, const float* probs, int B, int T, int E) {
    position_reduce_x(psum, probs, 0, B, T, E);
}

static __global__ void moe_gather_rows_kernel(float* out, const float* in, const int* index, int n, int C) {
    size_t total = (size_t)n * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = in[(size_t)index[i / C] * C + i % C];
    }
}

static inline void moe_gather_rows(float* out, const float* in, const int* index, int n, int C) {
    if (n == 0) { return; }
    LAUNCH(moe_gather_rows_kernel, elementwise_blocks((size_t)n * C, 256), 256, out, in, index, n, C);
    cudaLaunchCheck("moe_gather_rows_kernel");
}

static __global__ void moe_combine_kernel(float* out, const float* rows, const float* gates, const int* slot_row, int BT,
                                          int k, int C) {
    size_t total = (size_t)BT * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t p = i / C;
        out[i] = moe_combine_elem(rows, gates + p * k, slot_row + p * k, k, C, (int)(i % C));
    }
}

static inline void moe_combine(float* out, const float* rows, const float* gates, const int* slot_row, int BT, int k,
                               int C) {
    LAUNCH(moe_combine_kernel, elementwise_blocks((size_t)BT * C, 256), 256, out, rows, gates, slot_row, BT, k, C);
    cudaLaunchCheck("moe_combine_kernel");
}

// one slot per thread: dgate = R2 over C of dout . the slot's expert output
static __global__ void moe_dgate_kernel(float* dgate, const float* dout, const float* rows, const int* slot_row, int BT,
                                        int k, int C) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= BT * k) { return; }
    dgate[s] = canon_dot(dout + (size_t)(s / k) * C, 1, rows + (size_t)slot_row[s] * C, 1, C);
}

static __global__ void moe_drows_kernel(float* drows, const float* dout, const float* gates, const int* slot_row, int BT,
                                        int k, int C) {
    size_t total = (size_t)BT * k * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t s = i / C, c = i % C;
        drows[(size_t)slot_row[s] * C + c] = gates[s] * dout[(s / k) * C + c];
    }
}

static inline void moe_combine_backward(float* dgate, float* drows, const float* dout, const float* rows,
                                        const float* gates, const int* slot_row, int BT, int k, int C) {
    LAUNCH(moe_dgate_kernel, ceil_div_u((size_t)BT * k, 128), 128, dgate, dout, rows, slot_row, BT, k, C);
    cudaLaunchCheck("moe_dgate_kernel");
    LAUNCH(moe_drows_kernel, elementwise_blocks((size_t)BT * k * C, 256), 256, drows, dout, gates, slot_row, BT, k, C);
    cudaLaunchCheck("moe_drows_kernel");
}

static __global__ void moe_router_backward_kernel(float* dlogits, const float* probs, const int* chosen,
                                                  const float* gates, const float* dgate, const float* daux, int BT,
                                                  int E, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT) { return; }
    moe_router_backward_row(dlogits + (size_t)i * E, probs + (size_t)i * E, chosen + (size_t)i * k,
                            gates + (size_t)i * k, dgate + (size_t)i * k, daux, E, k);
}

static inline void moe_router_backward(float* dlogits, const float* probs, const int* chosen, const float* gates,
                                       const float* dgate, const float* daux, int BT, int E, int k) {
    LAUNCH(moe_router_backward_kernel, ceil_div_u((size_t)BT, 128), 128, dlogits, probs, chosen, gates, dgate, daux, BT,
           E, k);
    cudaLaunchCheck("moe_router_backward_kernel");
}

static __global__ void moe_dinput_kernel(float* dinp, const float* drouter, const float* drows, const int* slot_row,
                                         int BT, int k, int C) {
    size_t total = (size_t)BT * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        dinp[i] = moe_dinput_elem(drouter[i], drows, slot_row + (i / C) * k, k, C, (int)(i % C));
    }
}

static inline void moe_dinput_combine(float* dinp, const float* drouter, const float* drows, const int* slot_row, int BT,
                                      int k, int C) {
    LAUNCH(moe_dinput_kernel, elementwise_blocks((size_t)BT * C, 256), 256, dinp, drouter, drows, slot_row, BT, k, C);
    cudaLaunchCheck("moe_dinput_kernel");
}

// one output (source q, o, ic) per thread, ic = IC: the bias; consecutive threads walk ic so
// that the rows' loads coalesce
static __global__ void moe_expert_dweight_kernel(float* dweight, float* dbias, size_t slice, const float* dout,
                                                 const float* inp, const int* leaf, int nsrc, int B, int IC, int OC) {
    size_t total = (size_t)nsrc * OC * (IC + 1);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        int ic = (int)(i % (IC + 1));
        int o = (int)(i / (IC + 1) % OC);
        int q = (int)(i / ((size_t)(IC + 1) * OC));
        const int* lq = leaf + (size_t)q * B * CANON_R;
        if (ic < IC && dweight) {
            dweight[q * slice + (size_t)o * IC + ic] = moe_rows_reduce_elem(dout, OC, o, inp, IC, ic, lq, B);
        } else if (ic == IC && dbias) {
            dbias[q * slice + o] = moe_rows_reduce_elem(dout, OC, o, NULL, 0, 0, lq, B);
        }
    }
}

static inline void moe_expert_dweight(float* dweight, float* dbias, size_t slice, const float* dout, const float* inp,
                                      const int* leaf, int nsrc, int B, int IC, int OC) {
    size_t total = (size_t)nsrc * OC * (IC + 1);
    LAUNCH(moe_expert_dweight_kernel, elementwise_blocks(total, 256), 256, dweight, dbias, slice, dout, inp, leaf, nsrc,
           B, IC, OC);
    cudaLaunchCheck("moe_expert_dweight_kernel");
}

#endif // LLMC_KERNELS_MOE_DET_CUH
