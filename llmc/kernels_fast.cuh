/*
 * kernels_fast.cuh: fast mode's own kernels (bf16 activations, fp32 arithmetic inside each
 * kernel), named after their train_gpt2.c twins. Not bit-exact: sums run in whatever order
 * the warp reduction takes, results are rounded to bf16. The matmuls are cuBLASLt's
 * (matmul_cublaslt.cuh), attention is attention_flash.cuh; the exact and cheap reductions
 * (bias / layernorm-parameter gradients, embedding gradients, norm, AdamW) are shared with
 * deterministic mode (kernels_det.cuh).
 *
 * Row kernels use one warp per row and 16-byte accesses: C must be a multiple of 8.
 */
#ifndef LLMC_KERNELS_FAST_CUH
#define LLMC_KERNELS_FAST_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/canonical.h"

// out (B,T,C) = wte[inp[b,t]] + wpe[t]
__global__ void encoder_forward_fast_kernel(floatX* out, const int* inp, const floatX* wte,
                                            const floatX* wpe, int B, int T, int C) {
    size_t n8 = (size_t)B * T * C / 8;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        size_t bt = i * 8 / C;
        int c = (int)(i * 8 % C);
        float a[8], b[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(wte + (size_t)inp[bt] * C + c), a);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(wpe + (bt % T) * C + c), b);
        for (int k = 0; k < 8; k++) { a[k] = a[k] + b[k]; }
        *reinterpret_cast<bf16x8*>(out + i * 8) = float_to_bf16x8(a);
    }
}

static void encoder_forward_fast(floatX* out, const int* inp, const floatX* wte, const floatX* wpe,
                                 int B, int T, int C) {
    size_t n8 = (size_t)B * T * C / 8;
    LAUNCH(encoder_forward_fast_kernel, elementwise_blocks(n8, 256), 256, out, inp, wte, wpe, B, T, C);
    cudaLaunchCheck("encoder_forward_fast_kernel");
}

// layernorm of one row x (C) into out; writes mean and rstd. With res_in and proj given, x is
// first formed as the residual sum res_in + proj (rounded to bf16, stored to x) so that the
// stored residual and the normalised values agree exactly.
__device__ __forceinline__ void layernorm_row_fast(floatX* out, float* mean, float* rstd, floatX* x,
                                                   const floatX* res_in, const floatX* proj,
                                                   const floatX* weight, const floatX* bias, int C) {
    int lane = threadIdx.x % 32;
    float sum = 0.0f;
    for (int c = lane * 8; c < C; c += 256) {
        float v[8];
        if (res_in) {
            float r[8], p[8];
            bf16x8_to_float(*reinterpret_cast<const bf16x8*>(res_in + c), r);
            bf16x8_to_float(*reinterpret_cast<const bf16x8*>(proj + c), p);
            for (int k = 0; k < 8; k++) { r[k] = r[k] + p[k]; }
            bf16x8 rounded = float_to_bf16x8(r);
            *reinterpret_cast<bf16x8*>(x + c) = rounded;
            bf16x8_to_float(rounded, v);
        } else {
            bf16x8_to_float(*reinterpret_cast<const bf16x8*>(x + c), v);
        }
        for (int k = 0; k < 8; k++) { sum += v[k]; }
    }
    float m = warp_sum(sum) / (float)C;
    float sq = 0.0f;
    for (int c = lane * 8; c < C; c += 256) {   // the lane reads back only what it wrote
        float v[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(x + c), v);
        for (int k = 0; k < 8; k++) { float d = v[k] - m; sq = __fmaf_rn(d, d, sq); }
    }
    float s = rsqrtf(warp_sum(sq) / (float)C + 1e-5f);
    for (int c = lane * 8; c < C; c += 256) {
        float v[8], w[8], b[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(x + c), v);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(weight + c), w);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(bias + c), b);
        for (int k = 0; k < 8; k++) { v[k] = __fmaf_rn((v[k] - m) * s, w[k], b[k]); }
        *reinterpret_cast<bf16x8*>(out + c) = float_to_bf16x8(v);
    }
    if (lane == 0) {
        *mean = m;
        *rstd = s;
    }
}

__global__ void layernorm_forward_fast_kernel(floatX* out, float* mean, float* rstd, const floatX* inp,
                                              const floatX* weight, const floatX* bias, int N, int C) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (row >= N) { return; }
    layernorm_row_fast(out + (size_t)row * C, mean + row, rstd + row, const_cast<floatX*>(inp + (size_t)row * C),
                       NULL, NULL, weight, bias, C);
}

static void layernorm_forward_fast(floatX* out, float* mean, float* rstd, const floatX* inp,
                                   const floatX* weight, const floatX* bias, int N, int C) {
    LAUNCH(layernorm_forward_fast_kernel, ceil_div_u((size_t)N * 32, 256), 256, out, mean, rstd, inp, weight, bias,
           N, C);
    cudaLaunchCheck("layernorm_forward_fast_kernel");
}

// residual_out = res_in + proj; out = layernorm(residual_out) (train_gpt2.c residual_forward
// followed by the next layernorm_forward, in one pass)
__global__ void fused_residual_layernorm_kernel(floatX* residual_out, floatX* out, float* mean, float* rstd,
                                                const floatX* res_in, const floatX* proj,
                                                const floatX* weight, const floatX* bias, int N, int C) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (row >= N) { return; }
    size_t off = (size_t)row * C;
    layernorm_row_fast(out + off, mean + row, rstd + row, residual_out + off, res_in + off, proj + off,
                       weight, bias, C);
}

static void fused_residual_layernorm(floatX* residual_out, floatX* out, float* mean, float* rstd,
                                     const floatX* res_in, const floatX* proj, const floatX* weight,
                                     const floatX* bias, int N, int C) {
    LAUNCH(fused_residual_layernorm_kernel, ceil_div_u((size_t)N * 32, 256), 256, residual_out, out, mean, rstd,
           res_in, proj, weight, bias, N, C);
    cudaLaunchCheck("fused_residual_layernorm_kernel");
}

// out (n) = a + b, rounded to bf16 (train_gpt2.c residual_forward): a chunk's last residual
// add when the next layernorm runs on the next pipeline stage. The same sum, rounded the same
// way, that fused_residual_layernorm stores, so a stage boundary changes no bits.
__global__ void residual_forward_fast_kernel(floatX* out, const floatX* a, const floatX* b, size_t n8) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float x[8], y[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(a + i * 8), x);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(b + i * 8), y);
        for (int k = 0; k < 8; k++) { x[k] = x[k] + y[k]; }
        *reinterpret_cast<bf16x8*>(out + i * 8) = float_to_bf16x8(x);
    }
}

static void residual_forward_fast(floatX* out, const floatX* a, const floatX* b, size_t n) {
    LAUNCH(residual_forward_fast_kernel, elementwise_blocks(n / 8, 256), 256, out, a, b, n / 8);
    cudaLaunchCheck("residual_forward_fast_kernel");
}

// dres (N,C) <- dres + d input of layernorm (the parameter gradients are kernels_det.cuh's
// layernorm_param_grads)
__global__ void layernorm_backward_fast_kernel(floatX* dres, const floatX* dout, const floatX* inp,
                                               const floatX* weight, const float* mean, const float* rstd,
                                               int N, int C) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (row >= N) { return; }
    size_t off = (size_t)row * C;
    float m = mean[row], s = rstd[row];
    float a1 = 0.0f, a2 = 0.0f;
    for (int c = lane * 8; c < C; c += 256) {
        float x[8], dy[8], w[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(inp + off + c), x);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(dout + off + c), dy);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(weight + c), w);
        for (int k = 0; k < 8; k++) {
            float dnorm = dy[k] * w[k];
            a1 += dnorm;
            a2 = __fmaf_rn(dnorm, (x[k] - m) * s, a2);
        }
    }
    float dnorm_mean = warp_sum(a1) / (float)C, dnorm_norm_mean = warp_sum(a2) / (float)C;
    for (int c = lane * 8; c < C; c += 256) {
        float x[8], dy[8], w[8], dr[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(inp + off + c), x);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(dout + off + c), dy);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(weight + c), w);
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(dres + off + c), dr);
        for (int k = 0; k < 8; k++) {
            float n = (x[k] - m) * s;
            dr[k] = dr[k] + ((dy[k] * w[k] - dnorm_mean) - n * dnorm_norm_mean) * s;
        }
        *reinterpret_cast<bf16x8*>(dres + off + c) = float_to_bf16x8(dr);
    }
}

static void layernorm_backward_fast(floatX* dres, const floatX* dout, const floatX* inp, const floatX* weight,
                                    const float* mean, const float* rstd, int N, int C) {
    LAUNCH(layernorm_backward_fast_kernel, ceil_div_u((size_t)N * 32, 256), 256, dres, dout, inp, weight, mean, rstd,
           N, C);
    cudaLaunchCheck("layernorm_backward_fast_kernel");
}

// out = gelu(inp): the recompute of -r 1 (the forward's GELU is the fc matmul's epilogue)
__global__ void gelu_forward_fast_kernel(floatX* out, const floatX* inp, size_t n8) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float v[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(inp + i * 8), v);
        for (int k = 0; k < 8; k++) { v[k] = canon_gelu(v[k]); }
        *reinterpret_cast<bf16x8*>(out + i * 8) = float_to_bf16x8(v);
    }
}

static void gelu_forward_fast(floatX* out, const floatX* inp, size_t n) {
    LAUNCH(gelu_forward_fast_kernel, elementwise_blocks(n / 8, 256), 256, out, inp, n / 8);
    cudaLaunchCheck("gelu_forward_fast_kernel");
}

// Softmax + cross-entropy + its gradient in one block per position (train_gpt2.c
// crossentropy_forward and crossentropy_backward fused): pass 1 finds the max and the sum of
// exps (online), the loss is log(sum) - (logit_target - max); pass 2 (when write_grad)
// overwrites the logits with (softmax - onehot(target)) * dloss, 0 for the padding.
#define CLASSIFIER_THREADS 512
__global__ void __launch_bounds__(CLASSIFIER_THREADS) fused_classifier_kernel(
        floatX* logits, float* losses, const int* targets, float dloss, int V, int Vp, int write_grad) {
    __shared__ float s_m[CLASSIFIER_THREADS / 32], s_s[CLASSIFIER_THREADS / 32];
    __shared__ float s_target;
    int i = blockIdx.x;
    floatX* x = logits + (size_t)i * Vp;
    int target = targets[i];
    if (threadIdx.x == 0) { s_target = __bfloat162float(x[target]); }
    float m = -INFINITY, s = 0.0f;
    for (int v0 = threadIdx.x * 8; v0 < V; v0 += CLASSIFIER_THREADS * 8) {
        float f[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(x + v0), f);
        for (int k = 0; k < 8 && v0 + k < V; k++) {
            if (f[k] > m) { s = s * __expf(m - f[k]) + 1.0f; m = f[k]; }
            else { s += __expf(f[k] - m); }
        }
    }
    // combine (m, s) over the warp, then over the warps
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
        float mm = fmaxf(m, m2);
        s = (m == -INFINITY ? 0.0f : s * __expf(m - mm)) + (m2 == -INFINITY ? 0.0f : s2 * __expf(m2 - mm));
        m = mm;
    }
    if (threadIdx.x % 32 == 0) { s_m[threadIdx.x / 32] = m; s_s[threadIdx.x / 32] = s; }
    __syncthreads();
    m = s_m[0];
    for (int w = 1; w < CLASSIFIER_THREADS / 32; w++) { m = fmaxf(m, s_m[w]); }
    s = 0.0f;
    for (int w = 0; w < CLASSIFIER_THREADS / 32; w++) {
        if (s_m[w] != -INFINITY) { s += s_s[w] * __expf(s_m[w] - m); }
    }
    if (threadIdx.x == 0) { losses[i] = logf(s) - (s_target - m); }
    if (!write_grad) { return; }
    float inv = 1.0f / s;
    for (int v0 = threadIdx.x * 8; v0 < Vp; v0 += CLASSIFIER_THREADS * 8) {
        float f[8];
        bf16x8_to_float(*reinterpret_cast<const bf16x8*>(x + v0), f);
        for (int k = 0; k < 8; k++) {
            int v = v0 + k;
            f[k] = v < V ? (__expf(f[k] - m) * inv - (v == target ? 1.0f : 0.0f)) * dloss : 0.0f;
        }
        *reinterpret_cast<bf16x8*>(x + v0) = float_to_bf16x8(f);
    }
}

// logits (BT,Vp) -> losses (BT); with write_grad the logits become dlogits (dloss each)
static void fused_classifier(floatX* logits, float* losses, const int* targets, float dloss,
                             int BT, int V, int Vp, int write_grad) {
    LAUNCH(fused_classifier_kernel, BT, CLASSIFIER_THREADS, logits, losses, targets, dloss, V, Vp, write_grad);
    cudaLaunchCheck("fused_classifier_kernel");
}

// out = round(in), fp32 -> bf16
__global__ void float_to_bf16_kernel(floatX* out, const float* in, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = __float2bfloat16_rn(in[i]);
    }
}

static void float_to_bf16(floatX* out, const float* in, size_t n) {
    LAUNCH(float_to_bf16_kernel, elementwise_blocks(n, 256), 256, out, in, n);
    cudaLaunchCheck("float_to_bf16_kernel");
}

#endif // LLMC_KERNELS_FAST_CUH
