/*
 * kernels_fast_tp.cuh: fast mode's kernels for tensor parallelism (--tp K), the pieces around
 * the collectives of tensor_parallel.h (the calls themselves are in train_gpt2_fast.cu, next
 * to the layer they serve). Tensors crossing the tp group are fp32: a row-parallel layer's
 * partial outputs and a column-parallel layer's partial input gradients come out of
 * cuBLASLt's fp32 accumulator unrounded, are summed by comm.h's fixed R1 tree over the ranks
 * and rounded to bf16 once, as one rank rounds its whole sum once. (bf16 partials would
 * round K times before the sum, and comm.h's reductions are fp32.)
 *
 * The vocab-parallel pieces: rank r holds wte's rows [v0, v0 + Vl), its logits (rows, Vl).
 */
#ifndef LLMC_KERNELS_FAST_TP_CUH
#define LLMC_KERNELS_FAST_TP_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/matmul_cublaslt.cuh"
#include "llmc/kernels_fast.cuh"

// partial (BT,OC) fp32 = inp (BT,K) @ weight (OC,K)^T: a row-parallel layer's share of its
// output (K: this rank's inputs), before g's all-reduce and the bias. The batched form runs
// `count` such problems of `rows` rows in one cuBLASLt call (matmul_cublaslt.cuh's strided
// batch: problem b's rows [b*rows, (b+1)*rows), its weight the b-th (OC,K) block): the experts'
// row-parallel fcproj, one problem per local expert (kernels_fast_moe.cuh).
static void matmul_forward_partial_batched_fast(float* partial, const floatX* inp, const floatX* weight, int count,
                                                int rows, int K, int OC) {
    const LtBatch batch = {count, (int64_t)OC * K, (int64_t)rows * K, (int64_t)rows * OC, 0, 0};
    lt_matmul_batched(partial, 1, weight, 1, inp, 0, OC, rows, K, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, &batch,
                      "matmul_forward partial");
}
static void matmul_forward_partial_fast(float* partial, const floatX* inp, const floatX* weight, int BT, int K, int OC) {
    matmul_forward_partial_batched_fast(partial, inp, weight, 1, BT, K, OC);
}

// dinp_partial (BT,K) fp32 = dout (BT,OC) @ weight (OC,K): a column-parallel layer's input
// gradient from this rank's outputs OC, before f's all-reduce; batched as above (the experts'
// column-parallel fc).
static void matmul_backward_dinp_partial_batched_fast(float* dinp_partial, const floatX* dout, const floatX* weight,
                                                      int count, int rows, int K, int OC) {
    const LtBatch batch = {count, (int64_t)OC * K, (int64_t)rows * OC, (int64_t)rows * K, 0, 0};
    lt_matmul_batched(dinp_partial, 1, weight, 0, dout, 0, K, rows, OC, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, &batch,
                      "matmul_backward dinp partial");
}
static void matmul_backward_dinp_partial_fast(float* dinp_partial, const floatX* dout, const floatX* weight, int BT,
                                              int K, int OC) {
    matmul_backward_dinp_partial_batched_fast(dinp_partial, dout, weight, 1, BT, K, OC);
}

// out (N,C) = round(sum + bias): the row-parallel bias added once, after the all-reduce (bias
// NULL: round only). The naive form: for n, c: out[n][c] = bf16(sum[n][c] + bias[c]).
__global__ void bias_add_round_kernel(floatX* out, const float* sum, const floatX* bias, size_t N, int C) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < N * C; i += (size_t)gridDim.x * blockDim.x) {
        float v = sum[i];
        if (bias) { v = v + __bfloat162float(bias[i % C]); }
        out[i] = __float2bfloat16_rn(v);
    }
}

static void bias_add_round(floatX* out, const float* sum, const floatX* bias, size_t N, int C) {
    LAUNCH(bias_add_round_kernel, elementwise_blocks(N * C, 256), 256, out, sum, bias, N, C);
    cudaLaunchCheck("bias_add_round_kernel");
}

// lookup (N,C) fp32 = wte[inp[n] - v0] where this rank holds the token's row, else -0.0f
// (x + -0 == x for every x, so the all-reduce leaves the owner's row exactly)
__global__ void encoder_lookup_tp_kernel(float* lookup, const int* inp, const floatX* wte, int v0, int Vl, size_t N,
                                         int C) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < N * C; i += (size_t)gridDim.x * blockDim.x) {
        int v = inp[i / C] - v0;
        lookup[i] = (v >= 0 && v < Vl) ? __bfloat162float(wte[(size_t)v * C + i % C]) : -0.0f;
    }
}

static void encoder_lookup_tp(float* lookup, const int* inp, const floatX* wte, int v0, int Vl, size_t N, int C) {
    LAUNCH(encoder_lookup_tp_kernel, elementwise_blocks(N * C, 256), 256, lookup, inp, wte, v0, Vl, N, C);
    cudaLaunchCheck("encoder_lookup_tp_kernel");
}

// out (B,T,C) = round(lookup + wpe[t]): encoder_forward_fast's sum on the all-reduced lookup
__global__ void encoder_add_positions_tp_kernel(floatX* out, const float* lookup, const floatX* wpe, int B, int T, int C) {
    size_t n = (size_t)B * T * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / C % T;
        out[i] = __float2bfloat16_rn(lookup[i] + __bfloat162float(wpe[t * C + i % C]));
    }
}

static void encoder_add_positions_tp(floatX* out, const float* lookup, const floatX* wpe, int B, int T, int C) {
    LAUNCH(encoder_add_positions_tp_kernel, elementwise_blocks((size_t)B * T * C, 256), 256, out, lookup, wpe, B, T, C);
    cudaLaunchCheck("encoder_add_positions_tp_kernel");
}

// ---- the vocab-parallel fused classifier: fused_classifier in three passes around the
// exchanges. stats (3,N): the row maxima M (all-reduce MAX), then the sums of exponentials Z
// and the target logits (all-reduce sum; -0.0f where another rank holds the target).
// A column v of this rank is a real token when v0 + v < V.

__device__ __forceinline__ float block_reduce_tp(float v, int is_max) {
    __shared__ float s_part[CLASSIFIER_THREADS / 32];
    v = is_max ? warp_max(v) : warp_sum(v);
    if (threadIdx.x % 32 == 0) { s_part[threadIdx.x / 32] = v; }
    __syncthreads();
    float r = s_part[0];
    for (int w = 1; w < CLASSIFIER_THREADS / 32; w++) { r = is_max ? fmaxf(r, s_part[w]) : r + s_part[w]; }
    __syncthreads();   // s_part is reused by the next call
    return r;
}

// stats[0][n] = max over this rank's real tokens of logits[n] (-inf when it has none)
__global__ void __launch_bounds__(CLASSIFIER_THREADS) classifier_max_tp_kernel(float* stats, const floatX* logits,
                                                                               int v0, int Vl, int V) {
    const floatX* x = logits + (size_t)blockIdx.x * Vl;
    float m = -INFINITY;
    for (int v = threadIdx.x; v < Vl && v0 + v < V; v += CLASSIFIER_THREADS) { m = fmaxf(m, __bfloat162float(x[v])); }
    m = block_reduce_tp(m, 1);
    if (threadIdx.x == 0) { stats[blockIdx.x] = m; }
}

// stats[1][n] = sum of exp(logit - M) over this rank's real tokens; stats[2][n] = the target's
// logit if this rank holds it, else -0.0f
__global__ void __launch_bounds__(CLASSIFIER_THREADS) classifier_sums_tp_kernel(float* stats, const floatX* logits,
                                                                                const int* targets, int v0, int Vl,
                                                                                int V, int N) {
    int n = blockIdx.x;
    const floatX* x = logits + (size_t)n * Vl;
    float m = stats[n], s = 0.0f;
    for (int v = threadIdx.x; v < Vl && v0 + v < V; v += CLASSIFIER_THREADS) { s += __expf(__bfloat162float(x[v]) - m); }
    s = block_reduce_tp(s, 0);
    if (threadIdx.x == 0) {
        int t = targets[n] - v0;
        stats[N + n] = s;
        stats[2 * N + n] = (t >= 0 && t < Vl) ? __bfloat162float(x[t]) : -0.0f;
    }
}

// losses[n] = log Z - (target logit - M); with write_grad the logits become
// (softmax - onehot(target)) * dloss, 0 for the padding
__global__ void __launch_bounds__(CLASSIFIER_THREADS) classifier_finish_tp_kernel(
        floatX* logits, float* losses, const float* stats, const int* targets, float dloss, int v0, int Vl, int V,
        int N, int write_grad) {
    int n = blockIdx.x;
    float m = stats[n], z = stats[N + n];
    if (threadIdx.x == 0) { losses[n] = logf(z) - (stats[2 * N + n] - m); }
    if (!write_grad) { return; }
    floatX* x = logits + (size_t)n * Vl;
    float inv = 1.0f / z;
    int target = targets[n] - v0;
    for (int v = threadIdx.x; v < Vl; v += CLASSIFIER_THREADS) {
        float f = __bfloat162float(x[v]);
        f = v0 + v < V ? (__expf(f - m) * inv - (v == target ? 1.0f : 0.0f)) * dloss : 0.0f;
        x[v] = __float2bfloat16_rn(f);
    }
}

#endif // LLMC_KERNELS_FAST_TP_CUH
