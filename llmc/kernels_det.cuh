/*
 * kernels_det.cuh: the deterministic (--deterministic 1) kernels: fp32, each one the GPU twin
 * of the train_gpt2.c kernel of the same name and argument order, computing every output with
 * that kernel's sequence of floating-point operations (llmc/canonical.h), so the bits agree.
 *
 * How the parallel kernels keep the reference order:
 *  - matmul-shaped reductions (matmul forward/backward, the attention products) share one
 *    tiled SIMT kernel, det_gemm_kernel. Threads own OUTPUTS, never parts of a sum: each
 *    output is accumulated by one thread, sequentially within each canonical chunk (the walk
 *    of gpu_plan.h), and the 8 chunk partials are combined by the streaming R1 tree in
 *    registers. Tiling, shared memory and the grid change nothing in that sequence.
 *  - reductions over positions (weight, bias and layernorm-parameter gradients, the loss, the
 *    embedding gradients) are computed as R3 leaves (sequence, chunk of T) by parallel
 *    threads, then combined per output by the R3 tree (det_pos_tree); weight gradients keep
 *    one partial matrix per sequence and finish with the R1 tree over sequences.
 *  - row reductions (layernorm, softmax, cross-entropy) give each of 8 threads one chunk of
 *    the row and combine the partials with the canon_tree8 order through shuffles.
 * Per-element math is canonical.h's (canon_expf, canon_gelu, adamw_update_elem, ...), the
 * same functions the CPU calls. Compiled with -fmad=false -prec-div=true -prec-sqrt=true
 * -ftz=false: no contraction, IEEE division and sqrt, subnormals kept.
 *
 * Also here, shared with fast mode because they are exact AND cheap: the R3 reductions (bias
 * and layernorm parameter gradients, the loss, the embedding gradients; they read fp32 or
 * bf16), the microbatch gradient tree, the gradient norm (exact SumSq) and AdamW.
 */
#ifndef LLMC_KERNELS_DET_CUH
#define LLMC_KERNELS_DET_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/canonical.h"
#include "llmc/adamw.h"
#include "llmc/gpu_plan.h"

// ==========================================================================================
// The tiled canonical reduction: out[z][m][n] = epilogue(R2 over r of A(z,m,r) * B(z,n,r))
// ==========================================================================================

// One template instance per variant of gpu_plan.h's DetGemmArgs (a_rc, b_rc, causal,
// out_lower). A_RC / B_RC only change how a tile is loaded, so that global reads coalesce.
template <bool A_RC, bool B_RC, int CAUSAL, bool OUT_LOWER>
__global__ void __launch_bounds__(DET_THREADS, 1) det_gemm_kernel(const DetGemmArgs g) {
    __shared__ __align__(16) float As[2][DET_KT][DET_MT + 4];
    __shared__ __align__(16) float Bs[2][DET_KT][DET_NT + 4];
    const int tid = threadIdx.x;
    const int z = blockIdx.z;
    const int m0 = blockIdx.y * DET_MT, n0 = blockIdx.x * DET_NT;
    const int m_last = min(m0 + DET_MT, g.M) - 1;
    if (OUT_LOWER && n0 > m_last) { return; }   // the tile lies above the diagonal
    const float* A = g.A + det_zoff(z, g.zdiv, g.a_zhi, g.a_zlo);
    const float* Bm = g.B + det_zoff(z, g.zdiv, g.b_zhi, g.b_zlo);
    const DetReduction red = det_tile_reduction(g.R, g.groups, CAUSAL, m0, m_last);

    // this thread's outputs: rows m0 + row_of[i], columns n0 + det_out_col(tid, j) (gpu_plan.h)
    int row_of[8];
    #pragma unroll
    for (int i = 0; i < 8; i++) { row_of[i] = det_out_row(tid, i); }

    float acc[8][4], s0[8][4], s1[8][4], s2[8][4];
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        #pragma unroll
        for (int j = 0; j < 4; j++) { acc[i][j] = 0.0f; s0[i][j] = 0.0f; s1[i][j] = 0.0f; s2[i][j] = 0.0f; }
    }

    // global -> registers (the next tile, in flight while the current one is computed)
    float ra[DET_A_PER_THREAD], rb[DET_B_PER_THREAD];
    auto load_tile = [&](int k0, int klen) {
        #pragma unroll
        for (int e = 0; e < DET_A_PER_THREAD; e++) {
            int mi, kk;
            det_tile_a_slot(tid, e, A_RC, &mi, &kk);
            int m = m0 + mi;
            ra[e] = m < g.M && kk < klen ? A[(long)m * g.a_m + (long)(k0 + kk) * g.a_r] : 0.0f;
        }
        #pragma unroll
        for (int e = 0; e < DET_B_PER_THREAD; e++) {
            int ni, kk;
            det_tile_b_slot(tid, e, B_RC, &ni, &kk);
            int n = n0 + ni;
            rb[e] = n < g.N && kk < klen ? Bm[(long)n * g.b_n + (long)(k0 + kk) * g.b_r] : 0.0f;
        }
    };
    auto store_tile = [&](int buf) {
        #pragma unroll
        for (int e = 0; e < DET_A_PER_THREAD; e++) {
            int mi, kk;
            det_tile_a_slot(tid, e, A_RC, &mi, &kk);
            As[buf][kk][mi] = ra[e];
        }
        #pragma unroll
        for (int e = 0; e < DET_B_PER_THREAD; e++) {
            int ni, kk;
            det_tile_b_slot(tid, e, B_RC, &ni, &kk);
            Bs[buf][kk][ni] = rb[e];
        }
    };
    // one reduction index: every output of the thread takes its term (or, under a causal
    // rule, the outputs whose row includes r), in increasing r
    auto step = [&](int buf, int kk, int r, bool all_in) {
        float4 alo = *reinterpret_cast<const float4*>(&As[buf][kk][row_of[0]]);
        float4 ahi = *reinterpret_cast<const float4*>(&As[buf][kk][row_of[4]]);
        float4 bv = *reinterpret_cast<const float4*>(&Bs[buf][kk][det_out_col(tid, 0)]);
        const float a[8] = {alo.x, alo.y, alo.z, alo.w, ahi.x, ahi.y, ahi.z, ahi.w};
        const float b[4] = {bv.x, bv.y, bv.z, bv.w};
        #pragma unroll
        for (int i = 0; i < 8; i++) {
            bool in = all_in || det_term_included(CAUSAL, r, m0 + row_of[i]);
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                if (in) { acc[i][j] = fmaf(a[i], b[j], acc[i][j]); }
            }
        }
    };
    auto push = [&](int c) {
        #pragma unroll
        for (int i = 0; i < 8; i++) {
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                det_tree8_push(c, acc[i][j], &s0[i][j], &s1[i][j], &s2[i][j]);
                acc[i][j] = 0.0f;
            }
        }
    };

    // the walk (identical in every thread of the block, so the barriers are uniform)
    int c = 0, grp = 0, k0 = -1, kend = 0;
    int have = det_walk_seek(&red, &c, &grp, &k0, &kend);
    int cur = 0;   // the chunk whose partial acc holds
    int buf = 0;
    if (have) {
        load_tile(k0, min(DET_KT, kend - k0));
        store_tile(0);
    }
    __syncthreads();
    while (have) {
        const int tc = c, tk0 = k0, tlen = min(DET_KT, kend - k0);
        k0 += DET_KT;
        have = det_walk_seek(&red, &c, &grp, &k0, &kend);
        if (have) { load_tile(k0, min(DET_KT, kend - k0)); }
        while (cur < tc) { push(cur); cur++; }   // chunks before tc are complete (or empty: 0)
        const bool all_in = CAUSAL == DET_CAUSAL_NONE ||
                            (CAUSAL == DET_CAUSAL_R_LE_M ? tk0 + tlen - 1 <= m0 : tk0 >= m_last);
        if (all_in && tlen == DET_KT) {
            #pragma unroll
            for (int kk = 0; kk < DET_KT; kk++) { step(buf, kk, tk0 + kk, true); }
        } else {
            for (int kk = 0; kk < tlen; kk++) { step(buf, kk, tk0 + kk, all_in); }
        }
        if (have) { store_tile(buf ^ 1); }
        __syncthreads();
        buf ^= 1;
    }
    while (cur < CANON_R) { push(cur); cur++; }

    float* out = g.out + det_zoff(z, g.zdiv, g.o_zhi, g.o_zlo);
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        int m = m0 + row_of[i];
        if (m >= g.M) { continue; }
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            int n = n0 + det_out_col(tid, j);
            if (n >= g.N || (OUT_LOWER && n > m)) { continue; }
            float v = s0[i][j] * g.scale;
            if (g.bias) { v = v + g.bias[n]; }
            out[(long)m * g.o_m + n] = v;
        }
    }
}

// Launches the instance of g's variant over g's outputs (the six variants the trainer uses).
static void det_gemm(const DetGemmArgs& g, const char* name) {
    unsigned gx, gy, gz;
    if (!det_gemm_grid(g.M, g.N, g.Z, &gx, &gy, &gz)) {
        fatal("%s: %d x %d outputs in %d batches exceed the CUDA grid", name, g.M, g.N, g.Z);
    }
    dim3 grid(gx, gy, gz);
    int variant = g.a_rc * 1000 + g.b_rc * 100 + g.causal * 10 + g.out_lower;
    switch (variant) {
        case 1100: det_gemm_kernel<true, true, DET_CAUSAL_NONE, false><<<grid, DET_THREADS>>>(g); break;
        case 1000: det_gemm_kernel<true, false, DET_CAUSAL_NONE, false><<<grid, DET_THREADS>>>(g); break;
        case 0: det_gemm_kernel<false, false, DET_CAUSAL_NONE, false><<<grid, DET_THREADS>>>(g); break;
        case 1101: det_gemm_kernel<true, true, DET_CAUSAL_NONE, true><<<grid, DET_THREADS>>>(g); break;
        case 1010: det_gemm_kernel<true, false, DET_CAUSAL_R_LE_M, false><<<grid, DET_THREADS>>>(g); break;
        case 20: det_gemm_kernel<false, false, DET_CAUSAL_R_GE_M, false><<<grid, DET_THREADS>>>(g); break;
        default: fatal("%s: no deterministic kernel for variant %04d", name, variant);
    }
    cudaLaunchCheck(name);
}

// ==========================================================================================
// R3 reductions over positions (shared with fast mode: inputs fp32 or bf16)
// ==========================================================================================

// leaves[(b*8 + ch) * OC + o] = sum over the positions of chunk ch of sequence b of x[pos][o]
__global__ void position_leaves_kernel(float* leaves, const void* x, int bf16, int B, int T, int OC) {
    size_t n = (size_t)B * CANON_R * OC;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        int o = (int)(idx % OC);
        int leaf = (int)(idx / OC);
        leaves[idx] = det_position_leaf(x, bf16, OC, o, leaf / CANON_R, T, leaf % CANON_R);
    }
}

// out[o] = R3 tree of the leaves of output o (n outputs)
__global__ void position_tree_kernel(float* out, const float* leaves, int B, int n) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o < n) { out[o] = det_pos_tree(leaves + o, B, n); }
}

// out (OC) = R3 over positions of x (B,T,OC): bias gradients, and the loss sum (OC = 1)
static void position_reduce(float* out, float* leaves, const void* x, int bf16, int B, int T, int OC) {
    size_t n = (size_t)B * CANON_R * OC;
    position_leaves_kernel<<<elementwise_blocks(n, 256), 256>>>(leaves, x, bf16, B, T, OC);
    cudaLaunchCheck("position_leaves_kernel");
    position_tree_kernel<<<ceil_div_u(OC, 256), 256>>>(out, leaves, B, OC);
    cudaLaunchCheck("position_tree_kernel");
}

__global__ void ln_param_leaves_kernel(float* leaves_w, float* leaves_b, const void* x, const void* dy,
                                       int bf16, const float* mean, const float* rstd, int B, int T, int C) {
    size_t n = (size_t)B * CANON_R * C;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(idx % C);
        int leaf = (int)(idx / C);
        det_ln_param_leaf(x, dy, bf16, mean, rstd, C, c, leaf / CANON_R, T, leaf % CANON_R,
                          &leaves_w[idx], &leaves_b[idx]);
    }
}

// layernorm's dweight, dbias (C) = R3 of dy * n and of dy (the parameter half of
// train_gpt2.c layernorm_backward); x, dy fp32 or bf16
static void layernorm_param_grads(float* dweight, float* dbias, float* leaves, const void* x,
                                  const void* dy, int bf16, const float* mean, const float* rstd,
                                  int B, int T, int C) {
    size_t n = (size_t)B * CANON_R * C;
    ln_param_leaves_kernel<<<elementwise_blocks(n, 256), 256>>>(leaves, leaves + n, x, dy, bf16,
                                                                 mean, rstd, B, T, C);
    cudaLaunchCheck("ln_param_leaves_kernel");
    position_tree_kernel<<<ceil_div_u(C, 256), 256>>>(dweight, leaves, B, C);
    cudaLaunchCheck("position_tree_kernel");
    position_tree_kernel<<<ceil_div_u(C, 256), 256>>>(dbias, leaves + n, B, C);
    cudaLaunchCheck("position_tree_kernel");
}

// ==========================================================================================
// encoder
// ==========================================================================================

// out (B,T,C) = wte[inp[b,t]] + wpe[t]
__global__ void encoder_forward_kernel(float* out, const int* inp, const float* wte, const float* wpe,
                                       int B, int T, int C) {
    size_t n = (size_t)B * T * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t bt = i / C;
        int c = (int)(i % C);
        out[i] = wte[(size_t)inp[bt] * C + c] + wpe[(bt % T) * C + c];
    }
}

static void encoder_forward(float* out, const int* inp, const float* wte, const float* wpe, int B, int T, int C) {
    encoder_forward_kernel<<<elementwise_blocks((size_t)B * T * C, 256), 256>>>(out, inp, wte, wpe, B, T, C);
    cudaLaunchCheck("encoder_forward_kernel");
}

__global__ void encoder_dwpe_kernel(float* dwpe, const void* dout, int bf16, int B, int T, int C, int maxT) {
    size_t n = (size_t)maxT * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / C), c = (int)(i % C);
        dwpe[i] = t < T ? det_encoder_dwpe_elem(dout, bf16, B, T, C, t, c) : 0.0f;
    }
}

// one block row per distinct token, threads over channels
__global__ void encoder_dwte_kernel(float* dwte_emb, const void* dout, int bf16, const int* order,
                                    const int* begin, const int* tokens, int B, int T, int C) {
    int u = blockIdx.x;
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) { return; }
    dwte_emb[(size_t)tokens[u] * C + c] =
        det_encoder_dwte_elem(dout, bf16, order, begin[u], begin[u + 1], B, T, C, c);
}

// dwte_emb (Vp,C), dwpe (maxT,C) <- dout (B,T,C), with the positions grouped by token on the
// host (gpu_plan.h encoder_backward_plan: order, begin, tokens of the nuniq distinct tokens).
// Rows of tokens not in the batch are 0; every element is written.
static void encoder_backward(float* dwte_emb, float* dwpe, const void* dout, int bf16, const int* order,
                             const int* begin, const int* tokens, int nuniq, int B, int T, int C,
                             int Vp, int maxT) {
    encoder_dwpe_kernel<<<elementwise_blocks((size_t)maxT * C, 256), 256>>>(dwpe, dout, bf16, B, T, C, maxT);
    cudaLaunchCheck("encoder_dwpe_kernel");
    cudaCheck(cudaMemsetAsync(dwte_emb, 0, sizeof(float) * (size_t)Vp * C));
    if (nuniq > 0) {
        encoder_dwte_kernel<<<dim3(nuniq, ceil_div_u(C, 128)), 128>>>(dwte_emb, dout, bf16, order, begin,
                                                                      tokens, B, T, C);
        cudaLaunchCheck("encoder_dwte_kernel");
    }
}

// ==========================================================================================
// row reductions: 8 threads per row, thread ch owns chunk ch
// ==========================================================================================

// canon_tree8 of the partials of the 8 lanes of this lane's group (lane % 8 = chunk),
// returned to all 8: ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)).
__device__ __forceinline__ float det_tree8_shfl(float p) {
    p = p + __shfl_down_sync(FULL_MASK, p, 1);   // lanes 0,2,4,6 of the group: pairs
    p = p + __shfl_down_sync(FULL_MASK, p, 2);   // lanes 0,4: quads
    p = p + __shfl_down_sync(FULL_MASK, p, 4);   // lane 0: the tree
    return __shfl_sync(FULL_MASK, p, (threadIdx.x & 31) & ~7);
}

// layernorm per position over C (R2), eps 1e-5 (train_gpt2.c layernorm_forward)
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
                                         const float* weight, const float* bias, int BT, int C) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / CANON_R);
    int ch = threadIdx.x % CANON_R;
    bool valid = row < BT;
    const float* x = inp + (size_t)(valid ? row : 0) * C;
    long cb = canon_chunk_begin(C, ch), ce = canon_chunk_begin(C, ch + 1);
    float m = det_tree8_shfl(valid ? det_chunk_sum(x, cb, ce) : 0.0f) / (float)C;
    float var = det_tree8_shfl(valid ? det_ln_chunk_var(x, m, cb, ce) : 0.0f) / (float)C;
    float s = canon_rsqrtf(var + 1e-5f);
    if (!valid) { return; }
    float* o = out + (size_t)row * C;
    for (long c = cb; c < ce; c++) { o[c] = fmaf((x[c] - m) * s, weight[c], bias[c]); }
    if (ch == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

static void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                              const float* weight, const float* bias, int BT, int C) {
    layernorm_forward_kernel<<<ceil_div_u((size_t)BT * CANON_R, 256), 256>>>(out, mean, rstd, inp, weight, bias, BT, C);
    cudaLaunchCheck("layernorm_forward_kernel");
}

__global__ void layernorm_backward_dinp_kernel(float* dres, const float* dout, const float* inp,
                                               const float* weight, const float* mean,
                                               const float* rstd, int BT, int C) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / CANON_R);
    int ch = threadIdx.x % CANON_R;
    bool valid = row < BT;
    size_t off = (size_t)(valid ? row : 0) * C;
    float m = mean[valid ? row : 0], s = rstd[valid ? row : 0];
    long cb = canon_chunk_begin(C, ch), ce = canon_chunk_begin(C, ch + 1);
    float p1 = 0.0f, p2 = 0.0f;
    if (valid) { det_ln_bwd_chunk(inp + off, dout + off, weight, m, s, cb, ce, &p1, &p2); }
    float dnorm_mean = det_tree8_shfl(p1) / (float)C;
    float dnorm_norm_mean = det_tree8_shfl(p2) / (float)C;
    if (!valid) { return; }
    for (long c = cb; c < ce; c++) {
        dres[off + c] = dres[off + c] + det_ln_bwd_dx(inp[off + c], dout[off + c], weight[c], m, s,
                                                      dnorm_mean, dnorm_norm_mean);
    }
}

// dres (BT,C) <- dres + dinp_ln; dweight, dbias (C) = R3 (train_gpt2.c layernorm_backward)
static void layernorm_backward(float* dres, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight, const float* mean,
                               const float* rstd, int B, int T, int C, float* leaves) {
    int BT = B * T;
    layernorm_backward_dinp_kernel<<<ceil_div_u((size_t)BT * CANON_R, 256), 256>>>(dres, dout, inp, weight,
                                                                                   mean, rstd, BT, C);
    cudaLaunchCheck("layernorm_backward_dinp_kernel");
    layernorm_param_grads(dweight, dbias, leaves, inp, dout, 0, mean, rstd, B, T, C);
}

// ==========================================================================================
// matmul: out (BT,OC) = inp (BT,K) @ weight (OC,K)^T + bias (OC)
// ==========================================================================================

static void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                           int BT, int K, int OC) {
    det_gemm(det_args_matmul_forward(out, inp, weight, bias, BT, K, OC), "matmul_forward");
}

// R1 over the nseq per-sequence weight gradients: out[i] = tree over b of seq[b * n + i]
__global__ void sequence_tree_kernel(float* out, const float* seq, int nseq, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = canon_tree_sum(seq + i, nseq, (long)n);
    }
}

// dinp (BT,K) = R2 over outputs o (chunked per group); dweight (OC,K) = R3 over positions;
// dbias (OC) = R3 (train_gpt2.c matmul_backward). dinp, dweight, dbias may be NULL.
// Scratch: seq (B * OC * K floats, unused when B == 1) and leaves (B * 8 * OC floats).
static void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                            const float* inp, const float* weight, int B, int T, int K, int OC,
                            int groups, float* seq, float* leaves) {
    int BT = B * T;
    if (dinp) { det_gemm(det_args_matmul_dinp(dinp, dout, weight, BT, K, OC, groups), "matmul_backward dinp"); }
    if (dweight) {
        det_gemm(det_args_matmul_dweight(B > 1 ? seq : dweight, dout, inp, B, T, K, OC), "matmul_backward dweight");
        if (B > 1) {
            size_t n = (size_t)OC * K;
            sequence_tree_kernel<<<elementwise_blocks(n, 256), 256>>>(dweight, seq, B, n);
            cudaLaunchCheck("sequence_tree_kernel");
        }
    }
    if (dbias) { position_reduce(dbias, leaves, dout, 0, B, T, OC); }
}

// ==========================================================================================
// attention (train_gpt2.c attention_forward / attention_backward), causal, per (b, h)
// ==========================================================================================

// softmax of row (z, t) of the scores over keys t2 <= t, in place: max, exps, R2 over the
// key chunks (of T), division; 0 past t. One warp per row; lanes 0-7 own the chunk sums.
__global__ void attention_softmax_kernel(float* att, int rows, int T) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (row >= rows) { return; }   // whole warps: rows is per warp
    int t = row % T;
    float* a = att + (size_t)row * T;
    float maxv = -canon_inf();
    for (int t2 = lane; t2 <= t; t2 += 32) { if (a[t2] > maxv) { maxv = a[t2]; } }
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(FULL_MASK, maxv, o);
        if (other > maxv) { maxv = other; }
    }
    for (int t2 = lane; t2 <= t; t2 += 32) { a[t2] = canon_expf(a[t2] - maxv); }
    __syncwarp();
    float p = 0.0f;
    if (lane < CANON_R) {
        long end = canon_chunk_begin(T, lane + 1);
        p = det_chunk_sum(a, canon_chunk_begin(T, lane), end < t + 1 ? end : t + 1);
    }
    float zsum = __shfl_sync(FULL_MASK, det_tree8_shfl(p), 0);
    for (int t2 = lane; t2 < T; t2 += 32) { a[t2] = t2 <= t ? a[t2] / zsum : 0.0f; }
}

// ds row (z, t) <- att * (dst - S) * scale, S = R2 over key chunks of fmaf(att, dst)
__global__ void attention_softmax_backward_kernel(float* ds, const float* att, int rows, int T, float scale) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (row >= rows) { return; }
    int t = row % T;
    float* d = ds + (size_t)row * T;
    const float* at = att + (size_t)row * T;
    float p = 0.0f;
    if (lane < CANON_R) {
        long end = canon_chunk_begin(T, lane + 1);
        p = det_chunk_dot(at, d, canon_chunk_begin(T, lane), end < t + 1 ? end : t + 1);
    }
    float S = __shfl_sync(FULL_MASK, det_tree8_shfl(p), 0);
    for (int t2 = lane; t2 <= t; t2 += 32) { d[t2] = at[t2] * (d[t2] - S) * scale; }
}

// qkv (B,T,3C) -> out (B,T,C), att (B,NH,T,T) the probabilities (0 above the diagonal)
static void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    det_gemm(det_args_attention_scores(att, qkv, B, T, C, NH), "attention_forward scores");
    int rows = B * NH * T;
    attention_softmax_kernel<<<ceil_div_u((size_t)rows * 32, 256), 256>>>(att, rows, T);
    cudaLaunchCheck("attention_softmax_kernel");
    det_gemm(det_args_attention_by_keys(out, C, att, qkv + 2 * C, 3L * C, B, T, C, NH), "attention_forward att@v");
}

// dqkv (B,T,3C) <- dout (B,T,C); ds scratch (B,NH,T,T)
static void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                               int B, int T, int C, int NH, float* ds) {
    long C3 = 3L * C;
    det_gemm(det_args_attention_datt(ds, dout, qkv, B, T, C, NH), "attention_backward datt");
    int rows = B * NH * T;
    attention_softmax_backward_kernel<<<ceil_div_u((size_t)rows * 32, 256), 256>>>(
        ds, att, rows, T, canon_rsqrtf((float)(C / NH)));
    cudaLaunchCheck("attention_softmax_backward_kernel");
    det_gemm(det_args_attention_by_keys(dqkv, C3, ds, qkv + C, C3, B, T, C, NH), "attention_backward dq");
    det_gemm(det_args_attention_by_queries(dqkv + C, C3, ds, qkv, C3, B, T, C, NH), "attention_backward dk");
    det_gemm(det_args_attention_by_queries(dqkv + 2 * C, C3, att, dout, C, B, T, C, NH), "attention_backward dv");
}

// ==========================================================================================
// elementwise
// ==========================================================================================

__global__ void gelu_forward_kernel(float* out, const float* inp, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = canon_gelu(inp[i]);
    }
}

static void gelu_forward(float* out, const float* inp, size_t n) {
    gelu_forward_kernel<<<elementwise_blocks(n, 256), 256>>>(out, inp, n);
    cudaLaunchCheck("gelu_forward_kernel");
}

// dinp = gelu'(inp) * dout (may be in place)
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        dinp[i] = canon_gelu_grad(inp[i]) * dout[i];
    }
}

static void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
    gelu_backward_kernel<<<elementwise_blocks(n, 256), 256>>>(dinp, inp, dout, n);
    cudaLaunchCheck("gelu_backward_kernel");
}

// out = a + b (the residual stream; also the microbatch tree's merge and the tied embedding's
// two gradient halves)
__global__ void add_kernel(float* out, const float* a, const float* b, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = a[i] + b[i];
    }
}

static void residual_forward(float* out, const float* a, const float* b, size_t n) {
    add_kernel<<<elementwise_blocks(n, 256), 256>>>(out, a, b, n);
    cudaLaunchCheck("add_kernel");
}

// ==========================================================================================
// softmax + cross-entropy over the vocabulary (padding v >= V: probability 0, in no sum)
// ==========================================================================================

// One block per position: max (exact in any order), exps, the R2 chunk sums over Vp by
// threads 0-7, canon_tree8, division, loss = log(Z) - (logit_target - max).
__global__ void crossentropy_forward_kernel(float* probs_logits, float* losses, const int* targets,
                                            int V, int Vp) {
    __shared__ float s_red[32];
    __shared__ float s_part[CANON_R];
    __shared__ float s_target;
    int i = blockIdx.x;
    float* p = probs_logits + (size_t)i * Vp;
    float maxv = -canon_inf();
    for (int v = threadIdx.x; v < V; v += blockDim.x) { if (p[v] > maxv) { maxv = p[v]; } }
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(FULL_MASK, maxv, o);
        if (other > maxv) { maxv = other; }
    }
    if (threadIdx.x % 32 == 0) { s_red[threadIdx.x / 32] = maxv; }
    __syncthreads();
    maxv = s_red[0];
    for (int w = 1; w < (int)blockDim.x / 32; w++) { if (s_red[w] > maxv) { maxv = s_red[w]; } }
    if (threadIdx.x == 0) { s_target = targets ? p[targets[i]] - maxv : 0.0f; }
    __syncthreads();
    for (int v = threadIdx.x; v < V; v += blockDim.x) { p[v] = canon_expf(p[v] - maxv); }
    __syncthreads();
    if (threadIdx.x < CANON_R) {
        long begin = canon_chunk_begin(Vp, threadIdx.x), end = canon_chunk_begin(Vp, threadIdx.x + 1);
        s_part[threadIdx.x] = det_chunk_sum(p, begin < V ? begin : V, end < V ? end : V);
    }
    __syncthreads();
    float zsum = canon_tree8(s_part);
    for (int v = threadIdx.x; v < Vp; v += blockDim.x) { p[v] = v < V ? p[v] / zsum : 0.0f; }
    if (threadIdx.x == 0 && targets) { losses[i] = canon_logf(zsum) - s_target; }
}

// logits (BT,Vp) are overwritten by probs; losses (BT) only if targets != NULL
static void crossentropy_forward(float* probs_logits, float* losses, const int* targets, int BT, int V, int Vp) {
    crossentropy_forward_kernel<<<BT, 256>>>(probs_logits, losses, targets, V, Vp);
    cudaLaunchCheck("crossentropy_forward_kernel");
}

// dlogits = (probs - onehot(target)) * dloss over v < V, written over probs (padding stays 0)
__global__ void crossentropy_backward_kernel(float* dlogits_probs, const int* targets, float dloss,
                                             int BT, int V, int Vp) {
    size_t n = (size_t)BT * V;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t i = idx / V;
        int v = (int)(idx % V);
        float indicator = v == targets[i] ? 1.0f : 0.0f;
        float* p = dlogits_probs + i * Vp + v;
        *p = (*p - indicator) * dloss;
    }
}

static void crossentropy_backward(float* dlogits_probs, const int* targets, float dloss, int BT, int V, int Vp) {
    crossentropy_backward_kernel<<<elementwise_blocks((size_t)BT * V, 256), 256>>>(dlogits_probs, targets,
                                                                                    dloss, BT, V, Vp);
    cudaLaunchCheck("crossentropy_backward_kernel");
}

// ==========================================================================================
// the optimizer step (both modes)
// ==========================================================================================

// R6: the exact sum of squares. Each thread keeps a SumSq; the block adds the integer digits
// with shared-memory atomics, then the global ones: integer additions in any order are
// exact, so the total's digits are those of one sequential accumulator.
__global__ void sumsq_kernel(SumSq* total, const float* x, size_t n) {
    __shared__ unsigned long long block_digits[CANON_SUMSQ_DIGITS + 1];
    if (threadIdx.x <= CANON_SUMSQ_DIGITS) { block_digits[threadIdx.x] = 0; }
    __syncthreads();
    SumSq mine;
    canon_sumsq_init(&mine);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        canon_sumsq_add(&mine, x[i]);
    }
    for (int d = 0; d < CANON_SUMSQ_DIGITS; d++) {
        if (mine.digit[d]) { atomicAdd(&block_digits[d], (unsigned long long)mine.digit[d]); }
    }
    if (mine.nonfinite) { atomicAdd(&block_digits[CANON_SUMSQ_DIGITS], (unsigned long long)mine.nonfinite); }
    __syncthreads();
    if (threadIdx.x < CANON_SUMSQ_DIGITS) {
        atomicAdd((unsigned long long*)&total->digit[threadIdx.x], block_digits[threadIdx.x]);
    } else if (threadIdx.x == CANON_SUMSQ_DIGITS) {
        atomicAdd((unsigned long long*)&total->nonfinite, block_digits[CANON_SUMSQ_DIGITS]);
    }
}

// ||x|| over n elements (n < 2^31, so no digit can reach 2^63 before the host normalizes):
// the exact sum of squares rounded once (train_gpt2.c gradient_norm). d_sumsq: device scratch.
static float gradient_norm(const float* x, size_t n, SumSq* d_sumsq) {
    if (n >= ((size_t)1 << 31)) { fatal("gradient_norm: %zu elements, more than the 2^31 this kernel sums", n); }
    cudaCheck(cudaMemsetAsync(d_sumsq, 0, sizeof(SumSq)));
    sumsq_kernel<<<elementwise_blocks(n, 256) < 1024 ? elementwise_blocks(n, 256) : 1024, 256>>>(d_sumsq, x, n);
    cudaLaunchCheck("sumsq_kernel");
    SumSq total;
    cudaCheck(cudaMemcpy(&total, d_sumsq, sizeof(SumSq), cudaMemcpyDeviceToHost));
    total.pending = 0;
    return (float)sqrt(canon_sumsq_value(&total));
}

// AdamW over the flat parameters; the weight decay of element i comes from the run holding it
// (gpu_plan.h adamw_decay_runs). params_bf16 (fast mode): the rounded copy the model reads.
__global__ void adamw_kernel(float* params, floatX* params_bf16, float* m, float* v, const float* grads,
                             size_t n, const int64_t* run_end, const int* run_decay, int nruns,
                             AdamWStep s, float weight_decay) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int lo = 0, hi = nruns - 1;
        while (lo < hi) {   // the first run ending after i
            int mid = (lo + hi) / 2;
            if (run_end[mid] > (int64_t)i) { hi = mid; } else { lo = mid + 1; }
        }
        float wd = run_decay[lo] ? weight_decay : 0.0f;
        adamw_update_elem(&params[i], &m[i], &v[i], grads[i], &s, wd);
        if (params_bf16) { params_bf16[i] = __float2bfloat16_rn(params[i]); }
    }
}

static void adamw_update(float* params, floatX* params_bf16, float* m, float* v, const float* grads,
                         size_t n, const int64_t* run_end, const int* run_decay, int nruns,
                         const AdamWStep* s, float weight_decay) {
    adamw_kernel<<<elementwise_blocks(n, 256), 256>>>(params, params_bf16, m, v, grads, n, run_end,
                                                      run_decay, nruns, *s, weight_decay);
    cudaLaunchCheck("adamw_kernel");
}

#endif // LLMC_KERNELS_DET_CUH
