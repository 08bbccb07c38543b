/*
 * kernels_fast_moe.cuh: fast mode's mixture-of-experts kernels (llmc/moe.h THE LAYER and THE
 * BACKWARD on bf16 rows, fp32 arithmetic inside each kernel). The router runs in fp32 on
 * kernels_moe_det.cuh's kernels (its softmax, top-k and gates, and its backward row, are
 * moe.h's per-output functions): the choice of experts is then the deterministic build's for
 * the same logits. The expert MLPs are cuBLASLt matmuls (matmul_cublaslt.cuh), one per expert
 * over the rows it received. What is here moves bf16 rows between the positions and the
 * experts' rows, forms the gated combine and its backward, and reduces the experts' bias
 * gradients. Each output is computed by one thread in a fixed order, so a run is repeatable.
 * The layer's pieces that need no routing plan or exchange are here as functions of their own
 * (the router, the local experts' MLPs, forward and backward), called by train_gpt2_fast.cu's
 * layer and by dev/test/test_fast_emu.cpp's layer test.
 */
#ifndef LLMC_KERNELS_FAST_MOE_CUH
#define LLMC_KERNELS_FAST_MOE_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/moe.h"
#include "llmc/kernels_fast.cuh"      // float_to_bf16
#include "llmc/matmul_cublaslt.cuh"
#include "llmc/kernels_fast_tp.cuh"   // the matmuls with fp32 output (the router's)
#include "llmc/kernels_moe_det.cuh"   // the fp32 router rows (moe.h's softmax, top-k, gates)

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

// The local experts' tensors (bf16 weights or fp32 gradients): expert e's fcw is fcw + e *
// 4C*C, and so on (zero.h keeps each tensor's experts one after the other).
template <typename X> struct MoeExperts { X *fcw, *fcb, *fcprojw, *fcprojb; };

// The router of BT positions: probs (BT,E) fp32 = softmax(ln . routerw^T) from a cuBLASLt
// matmul with fp32 output, the k chosen experts (ascending) and their gates.
static void moe_router_forward_fast(float* probs, int* chosen, float* gates, const floatX* ln, const floatX* routerw,
                                    int BT, int C, int E, int k) {
    matmul_forward_partial_fast(probs, ln, routerw, BT, C, E);
    moe_router_forward(probs, chosen, gates, probs, BT, E, k);
}

// The local experts' MLPs over their work rows (expert e: rows [first[e], first[e+1]), host
// array): fch_gelu = gelu(fch), fch = xin . fcw_e^T + fcb_e (one matmul, GELU fused), y =
// fch_gelu . fcprojw_e^T + fcprojb_e. One cuBLASLt matmul per expert and layer (not a grouped
// one).
static void moe_experts_forward_fast(floatX* y, floatX* fch, floatX* fch_gelu, const floatX* xin,
                                     MoeExperts<const floatX> w, const int* first, int El, int C) {
    size_t C4 = 4 * (size_t)C;
    for (int e = 0; e < El; e++) {
        int r0 = first[e], n = first[e + 1] - r0;
        if (n == 0) { continue; }
        matmul_forward_fast(fch_gelu + r0 * C4, xin + (size_t)r0 * C, w.fcw + e * C4 * C, w.fcb + e * C4, n, C,
                            (int)C4, fch + r0 * C4);
        matmul_forward_fast(y + (size_t)r0 * C, fch_gelu + r0 * C4, w.fcprojw + e * C4 * C, w.fcprojb + e * C, n,
                            (int)C4, C, NULL);
    }
}

// Their backward from the output gradients dy (work rows, C), in the split backward's two
// halves. Expert e's rows from source q are [src_first[e*(Q+1)+q], src_first[e*(Q+1)+q+1])
// (host array). Input half: dh = d fch (gelu' applied), dx = d xin.
static void moe_experts_backward_input_fast(floatX* dx, floatX* dh, const floatX* dy, const floatX* fch,
                                            MoeExperts<const floatX> w, const int* src_first, int Q, int El, int C) {
    size_t C4 = 4 * (size_t)C;
    for (int e = 0; e < El; e++) {
        const int* sf = src_first + (size_t)e * (Q + 1);
        int r0 = sf[0], n = sf[Q] - r0;
        if (n == 0) { continue; }   // fcproj's input gradient with gelu'(fch) applied, then fc's
        matmul_backward_fast(dh + r0 * C4, NULL, NULL, dy + (size_t)r0 * C, NULL, w.fcprojw + e * C4 * C, 1, n,
                             (int)C4, C, fch + r0 * C4);
        matmul_backward_fast(dx + (size_t)r0 * C, NULL, NULL, dh + r0 * C4, NULL, w.fcw + e * C4 * C, 1, n, C,
                             (int)C4, NULL);
    }
}
// Weight half (from dy and the input half's dh): the weight and bias gradients, the rows of
// each source q into slice q of the gradients (dw + q * slice). An expert without rows from a
// source gets zero gradients there.
static void moe_experts_backward_weight_fast(MoeExperts<float> dw, size_t slice, const floatX* dy, const floatX* dh,
                                             const floatX* fch_gelu, const floatX* xin, const int* src_first, int Q,
                                             int El, int C) {
    size_t C4 = 4 * (size_t)C;
    for (int e = 0; e < El; e++) {
        const int* sf = src_first + (size_t)e * (Q + 1);
        for (int q = 0; q < Q; q++) {
            int q0 = sf[q], nq = sf[q + 1] - q0;
            float* dfcw = dw.fcw + q * slice + e * C4 * C;
            float* dfcprojw = dw.fcprojw + q * slice + e * C4 * C;
            if (nq > 0) {
                matmul_backward_fast(NULL, dfcprojw, NULL, dy + (size_t)q0 * C, fch_gelu + q0 * C4, NULL, 1, nq,
                                     (int)C4, C, NULL);
                matmul_backward_fast(NULL, dfcw, NULL, dh + q0 * C4, xin + (size_t)q0 * C, NULL, 1, nq, C, (int)C4,
                                     NULL);
            } else {
                cudaCheck(cudaMemsetAsync(dfcprojw, 0, sizeof(float) * C4 * C));
                cudaCheck(cudaMemsetAsync(dfcw, 0, sizeof(float) * C4 * C));
            }
            moe_bias_grad_fast(dw.fcprojb + q * slice + e * C, dy + (size_t)q0 * C, nq, C);
            moe_bias_grad_fast(dw.fcb + q * slice + e * C4, dh + q0 * C4, nq, (int)C4);
        }
    }
}

// The router's backward. Input half: dlogits (BT,E) fp32 from the gate gradients dgate (BT,k)
// and the load-balancing loss's daux (E), then in bf16 (dlogits_bf16, kept for the weight
// half) through the router's matmul: drouter (BT,C) fp32 = d ln. Weight half: drouterw (E,C)
// fp32.
static void moe_router_backward_fast(float* drouter, float* dlogits, floatX* dlogits_bf16, const float* probs,
                                     const int* chosen, const float* gates, const float* dgate, const float* daux,
                                     const floatX* routerw, int BT, int C, int E, int k) {
    moe_router_backward(dlogits, probs, chosen, gates, dgate, daux, BT, E, k);
    float_to_bf16(dlogits_bf16, dlogits, (size_t)BT * E);
    matmul_backward_dinp_partial_fast(drouter, dlogits_bf16, routerw, BT, C, E);
}
static void moe_router_weight_grad_fast(float* drouterw, const floatX* dlogits_bf16, const floatX* ln, int BT, int C,
                                        int E) {
    matmul_backward_fast(NULL, drouterw, NULL, dlogits_bf16, ln, NULL, 1, BT, C, E, NULL);
}

#endif // LLMC_KERNELS_FAST_MOE_CUH
