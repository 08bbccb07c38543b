/*
 * kernels_fast_moe.cuh: fast mode's mixture-of-experts kernels (llmc/moe.h THE LAYER and THE
 * BACKWARD on bf16 rows, fp32 arithmetic inside each kernel). The router runs in fp32 on
 * kernels_moe_det.cuh's kernels (its softmax, top-k and gates, and its backward row, are
 * moe.h's per-output functions): the choice of experts is then the deterministic build's for
 * the same logits. The expert MLPs are cuBLASLt matmuls (matmul_cublaslt.cuh), each one
 * strided-batched call for all local experts over their rows padded to a common count ("the
 * grouped expert matmul" below says why not a grouped GEMM). What is here moves bf16 rows
 * between the positions and the experts' rows, forms the gated combine and its backward, and
 * reduces the experts' bias gradients. Each output is computed by one thread in a fixed order, so a run is repeatable.
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

// ---- the grouped expert matmul ------------------------------------------------------------
// Each matmul of the local experts is one cuBLASLt call for all of them: a strided batch
// (matmul_*_batched_fast) over the experts' rows padded to the layer's capacity `cap` (the
// most rows one expert has, rounded up to 8 so that every expert's block stays 16-byte
// aligned), in a scratch copy (DSCRATCH_EXPERT_ROWS) whose padding rows are zeros. Not
// cublasGemmGroupedBatchedEx (cuBLAS 12.5+, each group its own row count): it has no
// epilogues and with bf16 inputs writes bf16 only, so the fp32 weight gradients, fc's GELU
// fused on the fp32 pre-activation and fcproj's DGELU would each need a pass of their own and
// round differently from the single matmul. The strided batch keeps them, and per element it
// is the single matmul's arithmetic: the forward and the input gradients are row by row (a
// padding row is computed and dropped), and in a weight gradient, a sum over rows, a padding
// row adds an exact zero (0 x 0), so it equals the sum over the expert's own rows. The
// price: the copies in and out, and the padding's share of the arithmetic (cap x El over the
// rows held; an expert without rows costs a zero block). The work rows themselves stay
// contiguous and unpadded (moe.h's routing plan and the exchanges are the deterministic
// build's).

// Group g of a layer's rows: rows [start[g], start[g] + count[g]) of a work-row tensor; cap:
// the padded rows per group. By value into the kernels (no copy to the device per call).
#define MOE_MAX_LOCAL_EXPERTS 256
struct MoeRowGroups { int n, cap, start[MOE_MAX_LOCAL_EXPERTS], count[MOE_MAX_LOCAL_EXPERTS]; };
// expert e's rows [bounds[e*stride+lo], bounds[e*stride+hi]) (host array): first (stride 1,
// lo 0, hi 1) or src_first's sources [q0, q1) (stride Q+1, lo q0, hi q1)
static MoeRowGroups moe_row_groups(const int* bounds, int stride, int lo, int hi, int El) {
    if (El > MOE_MAX_LOCAL_EXPERTS) {
        fatal("fast mode runs at most %d experts per rank (this rank holds %d): use more --ep ranks",
              MOE_MAX_LOCAL_EXPERTS, El);
    }
    MoeRowGroups g;
    g.n = El;
    int most = 0;
    for (int e = 0; e < El; e++) {
        g.start[e] = bounds[(size_t)e * stride + lo];
        g.count[e] = bounds[(size_t)e * stride + hi] - g.start[e];
        most = g.count[e] > most ? g.count[e] : most;
    }
    g.cap = (most + 7) / 8 * 8;
    return g;
}

// padded (n*cap, W) row e*cap + i = in row start[e] + i for i < count[e], else zeros
__global__ void moe_pad_rows_kernel(floatX* padded, const floatX* in, MoeRowGroups g, int W) {
    size_t total = (size_t)g.n * g.cap * W;
    for (size_t x = blockIdx.x * (size_t)blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
        size_t r = x / W, c = x % W;
        int e = (int)(r / g.cap), i = (int)(r % g.cap);
        padded[x] = i < g.count[e] ? in[((size_t)g.start[e] + i) * W + c] : __float2bfloat16(0.0f);
    }
}
// out row start[e] + i = padded row e*cap + i, i < count[e] (the padding rows dropped); bf16,
// or the fp32 partial sums of --tp
template <typename X> __global__ void moe_unpad_rows_kernel(X* out, const X* padded, MoeRowGroups g, int W) {
    size_t total = (size_t)g.n * g.cap * W;
    for (size_t x = blockIdx.x * (size_t)blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
        size_t r = x / W, c = x % W;
        int e = (int)(r / g.cap), i = (int)(r % g.cap);
        if (i < g.count[e]) { out[((size_t)g.start[e] + i) * W + c] = padded[x]; }
    }
}
static void moe_pad_rows(floatX* padded, const floatX* in, const MoeRowGroups& g, int W) {
    LAUNCH(moe_pad_rows_kernel, elementwise_blocks((size_t)g.n * g.cap * W, 256), 256, padded, in, g, W);
    cudaLaunchCheck("moe_pad_rows_kernel");
}
template <typename X> static void moe_unpad_rows(X* out, const X* padded, const MoeRowGroups& g, int W) {
    LAUNCH(moe_unpad_rows_kernel<X>, elementwise_blocks((size_t)g.n * g.cap * W, 256), 256, out, padded, g, W);
    cudaLaunchCheck("moe_unpad_rows_kernel");
}
// four padded tensors of a layer's rows, of C, H, H and C columns (one scratch buffer; H the
// hidden units this rank holds of each expert); c_b has room for fp32 (the partial sums of --tp)
static void moe_padded_scratch(const MoeRowGroups& g, int C, int H, floatX** c_a, floatX** h_a, floatX** h_b,
                               floatX** c_b) {
    size_t rows = (size_t)g.n * g.cap;
    floatX* base = (floatX*)device_scratch(DSCRATCH_EXPERT_ROWS, sizeof(floatX) * rows * (3 * C + 2 * (size_t)H));
    *c_a = base;
    *h_a = base + rows * C;
    *h_b = base + rows * (C + H);
    *c_b = base + rows * (C + 2 * (size_t)H);
}

// The local experts' MLPs over their work rows (expert e: rows [first[e], first[e+1]), host
// array): fch_gelu = gelu(fch), fch = xin . fcw_e^T + fcb_e (one matmul, GELU fused), y =
// fch_gelu . fcprojw_e^T + fcprojb_e. Each matmul is one batched cuBLASLt call for the El
// experts (the grouped expert matmul above). H: the hidden units this rank holds of each
// expert, 4C, or under --tp K its 4C/K (fc column-parallel, fcproj row-parallel, as the dense
// MLP: tensor_parallel.h). With `partial` (--tp) fcproj's fp32 partial sums over this rank's
// H go to partial (work rows, C) instead of y, for the caller's g (all-reduce, then
// moe_bias_add_round).
static void moe_experts_forward_fast(floatX* y, float* partial, floatX* fch, floatX* fch_gelu, const floatX* xin,
                                     MoeExperts<const floatX> w, const int* first, int El, int C, int H) {
    MoeRowGroups g = moe_row_groups(first, 1, 0, 1, El);
    if (g.cap == 0) { return; }
    floatX *xin_p, *fch_p, *gelu_p, *y_p;
    moe_padded_scratch(g, C, H, &xin_p, &fch_p, &gelu_p, &y_p);
    moe_pad_rows(xin_p, xin, g, C);
    matmul_forward_batched_fast(gelu_p, xin_p, w.fcw, w.fcb, El, g.cap, C, H, fch_p);
    moe_unpad_rows(fch, fch_p, g, H);
    moe_unpad_rows(fch_gelu, gelu_p, g, H);
    if (partial) {
        matmul_forward_partial_batched_fast((float*)y_p, gelu_p, w.fcprojw, El, g.cap, H, C);
        moe_unpad_rows(partial, (const float*)y_p, g, C);
    } else {
        matmul_forward_batched_fast(y_p, gelu_p, w.fcprojw, w.fcprojb, El, g.cap, H, C, NULL);
        moe_unpad_rows(y, y_p, g, C);
    }
}

// y (work rows, C) = round(sum + fcprojb_e) for expert e's rows (first: host array): under
// --tp the replicated fcproj bias added once, after g's all-reduce (kernels_fast_tp.cuh)
static void moe_bias_add_round(floatX* y, const float* sum, const floatX* fcprojb, const int* first, int El, int C) {
    for (int e = 0; e < El; e++) {
        size_t r0 = first[e], n = first[e + 1] - first[e];
        if (n > 0) { bias_add_round(y + r0 * C, sum + r0 * C, fcprojb + (size_t)e * C, n, C); }
    }
}

// Their backward from the output gradients dy (work rows, C), in the split backward's two
// halves (H as above). Expert e's rows from source q are [src_first[e*(Q+1)+q],
// src_first[e*(Q+1)+q+1]) (host array). Input half: dh = d fch (gelu' applied), dx = d xin;
// one batched call per matmul. With `partial` (--tp) fc's fp32 partial input gradients over
// this rank's H go to partial (work rows, C) instead of dx, for the caller's f (all-reduce,
// then the rounding).
static void moe_experts_backward_input_fast(floatX* dx, float* partial, floatX* dh, const floatX* dy, const floatX* fch,
                                            MoeExperts<const floatX> w, const int* src_first, int Q, int El, int C,
                                            int H) {
    MoeRowGroups g = moe_row_groups(src_first, Q + 1, 0, Q, El);
    if (g.cap == 0) { return; }
    floatX *dy_p, *fch_p, *dh_p, *dx_p;
    moe_padded_scratch(g, C, H, &dy_p, &fch_p, &dh_p, &dx_p);
    moe_pad_rows(dy_p, dy, g, C);
    moe_pad_rows(fch_p, fch, g, H);
    // fcproj's input gradient with gelu'(fch) applied, then fc's
    matmul_backward_batched_fast(dh_p, NULL, dy_p, NULL, w.fcprojw, El, g.cap, H, C, fch_p);
    moe_unpad_rows(dh, dh_p, g, H);
    if (partial) {
        matmul_backward_dinp_partial_batched_fast((float*)dx_p, dh_p, w.fcw, El, g.cap, C, H);
        moe_unpad_rows(partial, (const float*)dx_p, g, C);
    } else {
        matmul_backward_batched_fast(dx_p, NULL, dh_p, NULL, w.fcw, El, g.cap, C, H, NULL);
        moe_unpad_rows(dx, dx_p, g, C);
    }
}
// Weight half (from dy and the input half's dh; H as above): the weight and bias gradients,
// the rows of each source q into slice q of the gradients (dw + q * slice): per source one
// batched call per weight for the El experts. An expert without rows from a source gets zero
// gradients there (its block is all padding). Under --tp the replicated fcproj bias's gradient
// is the same on every rank (dy is whole there), as the dense MLP's.
static void moe_experts_backward_weight_fast(MoeExperts<float> dw, size_t slice, const floatX* dy, const floatX* dh,
                                             const floatX* fch_gelu, const floatX* xin, const int* src_first, int Q,
                                             int El, int C, int H) {
    for (int q = 0; q < Q; q++) {
        MoeRowGroups g = moe_row_groups(src_first, Q + 1, q, q + 1, El);
        float* dfcw = dw.fcw + q * slice;
        float* dfcprojw = dw.fcprojw + q * slice;
        if (g.cap > 0) {
            floatX *dy_p, *gelu_p, *dh_p, *xin_p;
            moe_padded_scratch(g, C, H, &dy_p, &gelu_p, &dh_p, &xin_p);
            moe_pad_rows(dy_p, dy, g, C);
            moe_pad_rows(gelu_p, fch_gelu, g, H);
            moe_pad_rows(dh_p, dh, g, H);
            moe_pad_rows(xin_p, xin, g, C);
            matmul_backward_batched_fast(NULL, dfcprojw, dy_p, gelu_p, NULL, El, g.cap, H, C, NULL);
            matmul_backward_batched_fast(NULL, dfcw, dh_p, xin_p, NULL, El, g.cap, C, H, NULL);
        } else {
            cudaCheck(cudaMemsetAsync(dfcprojw, 0, sizeof(float) * El * (size_t)H * C));
            cudaCheck(cudaMemsetAsync(dfcw, 0, sizeof(float) * El * (size_t)H * C));
        }
        for (int e = 0; e < El; e++) {
            moe_bias_grad_fast(dw.fcprojb + q * slice + e * C, dy + (size_t)g.start[e] * C, g.count[e], C);
            moe_bias_grad_fast(dw.fcb + q * slice + e * (size_t)H, dh + (size_t)g.start[e] * H, g.count[e], H);
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
