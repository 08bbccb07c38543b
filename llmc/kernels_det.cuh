/*
 * kernels_det.cuh: the deterministic (--deterministic 1) kernels: fp32, the device set of the
 * kernel contract (llmc/kernels.h): each host function launches the GPU twin of the CPU kernel
 * of the same name and ARGUMENTS (train_gpt2.c's specification), computing every output with
 * that kernel's sequence of floating-point operations (llmc/canonical.h), so the bits agree.
 * Because the names and arguments are the contract's, train_gpt2.cu compiles train_gpt2.c's
 * model on these kernels: one model, two kernel sets. Tensor and sequence parallelism reach the kernels as on
 * the CPU: a rank's share of the 8 reduction chunks (`nchunks`), its vocabulary rows (v0, Vl),
 * per-sequence partials of the layernorm gradients.
 *
 * How the parallel kernels keep the reference order:
 *  - matmul-shaped reductions (matmul forward/backward, the attention products) share one
 *    tiled SIMT kernel, det_gemm_kernel. Threads own OUTPUTS, never parts of a sum: each
 *    output is accumulated by one thread, sequentially within each canonical chunk (the walk
 *    of gpu_plan.h), and the chunk partials are combined by the streaming R1 tree in
 *    registers. Tiling, shared memory and the grid change nothing in that sequence.
 *  - reductions over positions (weight, bias and layernorm-parameter gradients, the loss, the
 *    embedding gradients) are computed as R3 leaves (sequence, chunk of T) by parallel
 *    threads, then combined per output by the R3 tree (det_pos_tree); weight gradients keep
 *    one partial matrix per sequence and finish with the R1 tree over sequences.
 *  - row reductions (layernorm, softmax, cross-entropy) give each of 8 threads one chunk of
 *    the row and combine the partials with the canon_tree8 order (through shuffles, or shared
 *    memory).
 * Per-element math is canonical.h's (canon_expf, canon_gelu, adamw_update_elem, ...), the
 * same functions the CPU calls. Compiled with -fmad=false -prec-div=true -prec-sqrt=true
 * -ftz=false: no contraction, IEEE division and sqrt, subnormals kept. Every launch is
 * LAUNCH(...) (cuda_common.cuh), so that the emulated build (dev/gpu/emu) runs them on the CPU;
 * kernels are static: fast mode's translation unit includes this header too.
 *
 * Also here, shared with fast mode because they are exact AND cheap: the R3 reductions over
 * positions (bias and layernorm parameter gradients, the loss, the embedding gradients), which
 * read fp32 or bf16 (the *_x functions), and the device memory operations of memory.h
 * (memory_device): fill, the tree merge, the exact sum of squares, AdamW, the bf16 rounding of
 * fast mode's weights.
 */
#ifndef LLMC_KERNELS_DET_CUH
#define LLMC_KERNELS_DET_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/canonical.h"
#include "llmc/kernels.h"
#include "llmc/adamw.h"
#include "llmc/gpu_plan.h"
#include "llmc/memory.h"
#include "llmc/paged_kv.h"

// ==========================================================================================
// scratch: device buffers the kernels reuse across calls (kernels run one at a time; slots
// keep them apart). Grown on demand, never shrunk.
// ==========================================================================================

enum { DSCRATCH_LEAVES, DSCRATCH_SEQ, DSCRATCH_ATT, DSCRATCH_ENC, DSCRATCH_SUMSQ, DSCRATCH_SUM, DSCRATCH_EXPERT_ROWS,
       NUM_DSCRATCH };
static void* dscratch_ptr[NUM_DSCRATCH];
static size_t dscratch_bytes[NUM_DSCRATCH];
static void* device_scratch(int slot, size_t bytes) {
    if (bytes > dscratch_bytes[slot]) {
        device_free(dscratch_ptr[slot]);
        dscratch_ptr[slot] = device_alloc(bytes, "kernel scratch");
        dscratch_bytes[slot] = bytes;
    }
    return dscratch_ptr[slot];
}

// ==========================================================================================
// The tiled canonical reduction: out[z][m][n] = epilogue(R2 over r of A(z,m,r) * B(z,n,r))
// ==========================================================================================

// One template instance per variant of gpu_plan.h's DetGemmArgs (a_rc, b_rc, causal,
// out_lower). A_RC / B_RC only change how a tile is loaded, so that global reads coalesce.
template <bool A_RC, bool B_RC, int CAUSAL, int OUT>
static __global__ void __launch_bounds__(DET_THREADS, 1) det_gemm_kernel(const DetGemmArgs g) {
    __shared__ __align__(16) float As[2][DET_KT][DET_MT + 4];
    __shared__ __align__(16) float Bs[2][DET_KT][DET_NT + 4];
    const int tid = threadIdx.x;
    const int z = blockIdx.z;
    const int m0 = blockIdx.y * DET_MT, n0 = blockIdx.x * DET_NT;
    const int m_last = min(m0 + DET_MT, g.M) - 1;
    if (det_tile_empty(&g, OUT, n0, m_last)) { return; }   // e.g. the tile lies above the diagonal
    const float* A = g.A + det_zoff(z, g.zdiv, g.a_zhi, g.a_zlo);
    const float* Bm = g.B + det_zoff(z, g.zdiv, g.b_zhi, g.b_zlo);
    const DetReduction red = det_tile_reduction(&g, CAUSAL, m0, m_last);

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
            bool in = all_in || det_term_included(&g, CAUSAL, r, m0 + row_of[i]);
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
        const bool all_in = CAUSAL == DET_CAUSAL_NONE || det_tile_all_in(&g, CAUSAL, tk0, tlen, m0, m_last);
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
    while (cur < g.nchunks) { push(cur); cur++; }

    float* out = g.out + det_zoff(z, g.zdiv, g.o_zhi, g.o_zlo);
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        int m = m0 + row_of[i];
        if (m >= g.M) { continue; }
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            int n = n0 + det_out_col(tid, j);
            if (n >= g.N || !det_out_exists(&g, OUT, m, n)) { continue; }
            float v = s0[i][j] * g.scale;
            if (g.bias) { v = v + g.bias[n]; }
            out[(long)m * g.o_m + n] = v;
        }
    }
}

// Launches the instance of g's variant over g's outputs (the nine variants the trainer uses).
static void det_gemm(const DetGemmArgs& g, const char* name) {
    unsigned gx, gy, gz;
    if (!det_gemm_grid(g.M, g.N, g.Z, &gx, &gy, &gz)) {
        fatal("%s: %d x %d outputs in %d batches exceed the CUDA grid", name, g.M, g.N, g.Z);
    }
    dim3 grid(gx, gy, gz);
    void (*det_gemm_instance)(const DetGemmArgs) = NULL;
    switch (g.a_rc * 1000 + g.b_rc * 100 + g.causal * 10 + g.out_lower) {
        case 1100: det_gemm_instance = det_gemm_kernel<true, true, DET_CAUSAL_NONE, DET_OUT_ALL>; break;
        case 1000: det_gemm_instance = det_gemm_kernel<true, false, DET_CAUSAL_NONE, DET_OUT_ALL>; break;
        case 0: det_gemm_instance = det_gemm_kernel<false, false, DET_CAUSAL_NONE, DET_OUT_ALL>; break;
        case 1101: det_gemm_instance = det_gemm_kernel<true, true, DET_CAUSAL_NONE, DET_OUT_LOWER>; break;
        case 1010: det_gemm_instance = det_gemm_kernel<true, false, DET_CAUSAL_R_LE_M, DET_OUT_ALL>; break;
        case 20: det_gemm_instance = det_gemm_kernel<false, false, DET_CAUSAL_R_GE_M, DET_OUT_ALL>; break;
        case 1102: det_gemm_instance = det_gemm_kernel<true, true, DET_CAUSAL_NONE, DET_OUT_ZZ>; break;
        case 1030: det_gemm_instance = det_gemm_kernel<true, false, DET_CAUSAL_ZZ_KEYS, DET_OUT_ALL>; break;
        case 40: det_gemm_instance = det_gemm_kernel<false, false, DET_CAUSAL_ZZ_QUERIES, DET_OUT_ALL>; break;
        default: fatal("%s: no deterministic kernel for variant a_rc %d b_rc %d causal %d lower %d", name,
                       g.a_rc, g.b_rc, g.causal, g.out_lower);
    }
    LAUNCH(det_gemm_instance, grid, DET_THREADS, g);
    cudaLaunchCheck(name);
}

// ==========================================================================================
// R3 reductions over positions (shared with fast mode: inputs fp32 or bf16)
// ==========================================================================================

// leaves[(b*nchunks + ch) * OC + o] = sum over the positions of chunk ch of sequence b of x[pos][o]:
// the rows rank r's D-way zig-zag slice of each sequence of T (nchunks = 8/D; D = 1: whole)
static __global__ void position_leaves_kernel(float* leaves, const void* x, int bf16, int B, int T, int D, int r,
                                              int OC) {
    int nchunks = CANON_R / D;
    size_t n = (size_t)B * nchunks * OC;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        int o = (int)(idx % OC);
        int leaf = (int)(idx / OC);
        leaves[idx] = det_position_leaf(x, bf16, OC, o, leaf / nchunks, T, D, r, leaf % nchunks);
    }
}

// out[o] = R3 tree of the leaves of output o (n outputs); or, with seq_out, every sequence's
// subtree: seq_out[b * n + o]
static __global__ void position_tree_kernel(float* out, float* seq_out, const float* leaves, int B, int nchunks, int n) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n) { return; }
    if (seq_out) {
        for (int b = 0; b < B; b++) { seq_out[(size_t)b * n + o] = det_seq_tree(leaves + o, b, nchunks, n); }
    } else {
        out[o] = det_pos_tree(leaves + o, B, nchunks, n);
    }
}

// out (OC) = R3 over positions of x (B,T,OC), x fp32 or bf16: bias gradients, the loss (OC = 1)
static inline void position_reduce_x(float* out, const void* x, int bf16, int B, int T, int OC) {
    size_t n = (size_t)B * CANON_R * OC;
    float* leaves = (float*)device_scratch(DSCRATCH_LEAVES, sizeof(float) * (n ? n : 1));
    LAUNCH(position_leaves_kernel, elementwise_blocks(n, 256), 256, leaves, x, bf16, B, T, 1, 0, OC);
    cudaLaunchCheck("position_leaves_kernel");
    LAUNCH(position_tree_kernel, ceil_div_u(OC, 256), 256, out, (float*)NULL, leaves, B, CANON_R, OC);
    cudaLaunchCheck("position_tree_kernel");
}

static __global__ void ln_param_leaves_kernel(float* leaves_w, float* leaves_b, const void* x, const void* dy,
                                       int bf16, const float* mean, const float* rstd, int B, int T, int D, int r,
                                       int C) {
    int nchunks = CANON_R / D;
    size_t n = (size_t)B * nchunks * C;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(idx % C);
        int leaf = (int)(idx / C);
        det_ln_param_leaf(x, dy, bf16, mean, rstd, C, c, leaf / nchunks, T, D, r, leaf % nchunks,
                          &leaves_w[idx], &leaves_b[idx]);
    }
}

// layernorm's dweight, dbias (C) = R3 of dy * n and of dy (the parameter half of train_gpt2.c
// layernorm_backward), the rows rank r's D-way zig-zag slice of each sequence of T positions
// (D = 1: whole); with seq_partials (2,B,C) each sequence's subtrees instead, for the caller to
// finish (sequence or context parallelism). x, dy fp32 or bf16.
static inline void layernorm_param_grads_slice(float* dweight, float* dbias, float* seq_partials, const void* x,
                                               const void* dy, int bf16, const float* mean, const float* rstd,
                                               int B, int T, int D, int r, int C) {
    int nchunks = CANON_R / D;
    size_t n = (size_t)B * nchunks * C;
    float* leaves = (float*)device_scratch(DSCRATCH_LEAVES, 2 * sizeof(float) * (n ? n : 1));
    LAUNCH(ln_param_leaves_kernel, elementwise_blocks(n, 256), 256, leaves, leaves + n, x, dy, bf16, mean, rstd,
           B, T, D, r, C);
    cudaLaunchCheck("ln_param_leaves_kernel");
    float* seq_w = seq_partials;
    float* seq_b = seq_partials ? seq_partials + (size_t)B * C : NULL;
    LAUNCH(position_tree_kernel, ceil_div_u(C, 256), 256, dweight, seq_w, leaves, B, nchunks, C);
    cudaLaunchCheck("position_tree_kernel");
    LAUNCH(position_tree_kernel, ceil_div_u(C, 256), 256, dbias, seq_b, leaves + n, B, nchunks, C);
    cudaLaunchCheck("position_tree_kernel");
}

// The same over T positions of each sequence in nchunks = 8/D chunks: a D-way slice in equal
// stretches (fast mode's), whose local chunks are the same for every rank (zigzag.h).
static inline void layernorm_param_grads_x(float* dweight, float* dbias, float* seq_partials, const void* x,
                                           const void* dy, int bf16, const float* mean, const float* rstd,
                                           int B, int T, int C, int nchunks) {
    int D = CANON_R / nchunks;
    layernorm_param_grads_slice(dweight, dbias, seq_partials, x, dy, bf16, mean, rstd, B, T * D, D, 0, C);
}

// R3 sum of per-position values x (B,T): the loss sum of a microbatch, to the host
// (train_gpt2.c position_sum).
static inline float position_sum(const float* x, int B, int T) {
    float* sum = (float*)device_scratch(DSCRATCH_SUM, sizeof(float));
    position_reduce_x(sum, x, 0, B, T, 1);
    float host;
    cudaCheck(cudaMemcpy(&host, sum, sizeof(float), cudaMemcpyDeviceToHost));
    return host;
}

// ==========================================================================================
// encoder (train_gpt2.c encoder_lookup, encoder_add_positions, encoder_backward)
// ==========================================================================================

// out (B*T,C) = wte row inp[i] - v0 for tokens this rank holds (rows [v0, v0 + Vl)), -0.0f for
// the others (x + -0 == x: the sum over the tensor-parallel group is exact)
static __global__ void encoder_lookup_kernel(float* out, const int* inp, const float* wte, int v0, int Vl, int BT, int C) {
    size_t n = (size_t)BT * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t bt = i / C;
        int c = (int)(i % C);
        int v = inp[bt] - v0;
        out[i] = v >= 0 && v < Vl ? wte[(size_t)v * C + c] : -0.0f;
    }
}

static inline void encoder_lookup(float* out, const int* inp, const float* wte, int v0, int Vl, int BT, int C) {
    LAUNCH(encoder_lookup_kernel, elementwise_blocks((size_t)BT * C, 256), 256, out, inp, wte, v0, Vl, BT, C);
    cudaLaunchCheck("encoder_lookup_kernel");
}

// out (B,T,C) += wpe[t]
static __global__ void encoder_add_positions_kernel(float* out, const float* wpe, int B, int T, int C) {
    size_t n = (size_t)B * T * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t bt = i / C;
        int c = (int)(i % C);
        out[i] = out[i] + wpe[(bt % T) * C + c];
    }
}

static inline void encoder_add_positions(float* out, const float* wpe, int B, int T, int C) {
    LAUNCH(encoder_add_positions_kernel, elementwise_blocks((size_t)B * T * C, 256), 256, out, wpe, B, T, C);
    cudaLaunchCheck("encoder_add_positions_kernel");
}

static __global__ void encoder_dwpe_kernel(float* dwpe, const void* dout, int bf16, int B, int T, int C, int maxT) {
    size_t n = (size_t)maxT * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / C), c = (int)(i % C);
        dwpe[i] = t < T ? det_encoder_dwpe_elem(dout, bf16, B, T, C, t, c) : 0.0f;
    }
}

// one block row per distinct token (rows past nuniq have none), threads over channels
static __global__ void encoder_dwte_kernel(float* dwte_emb, const void* dout, int bf16, const int* order,
                                    const int* begin, const int* tokens, const int* nuniq, int B, int T, int C) {
    int u = blockIdx.x;
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (u >= *nuniq || c >= C) { return; }
    dwte_emb[(size_t)tokens[u] * C + c] =
        det_encoder_dwte_elem(dout, bf16, order, begin[u], begin[u + 1], B, T, C, c);
}

// The positions grouped by token on the device, the plan gpu_plan.h's encoder_backward_plan
// specifies (tokens ascending, each token's positions ascending), in four steps whose results
// do not depend on the order threads run in: integer counts, one thread's prefix sum, the
// positions dropped into their token's range in any order, then each placed by its rank there
// (how many of the range's positions are smaller; positions are distinct).
// count (Vl+1) zeroed: count[v + 1] = positions holding token v0 + v
static __global__ void encoder_plan_count_kernel(int* count, const int* inp, int BT, int v0, int Vl) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT) { return; }
    int v = inp[i] - v0;
    if (v >= 0 && v < Vl) { atomicAdd(&count[v + 1], 1); }
}
// one thread: count -> each token's first slot, tokens/begin of the distinct tokens, nuniq;
// cursor (Vl) zeroed for the drop
static __global__ void encoder_plan_scan_kernel(int* count, int* cursor, int* tokens, int* begin, int* nuniq, int Vl) {
    int n = 0;
    for (int v = 0; v < Vl; v++) {
        cursor[v] = 0;
        if (count[v + 1] > 0) { tokens[n] = v; begin[n++] = count[v]; }
        count[v + 1] += count[v];
    }
    begin[n] = count[Vl];
    *nuniq = n;
}
static __global__ void encoder_plan_drop_kernel(int* dropped, int* cursor, const int* count, const int* inp, int BT,
                                         int v0, int Vl) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT) { return; }
    int v = inp[i] - v0;
    if (v >= 0 && v < Vl) { dropped[count[v] + atomicAdd(&cursor[v], 1)] = i; }
}
static __global__ void encoder_plan_rank_kernel(int* order, const int* dropped, const int* count, const int* inp,
                                         int BT, int v0, int Vl) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT) { return; }
    int v = inp[i] - v0;
    if (v < 0 || v >= Vl) { return; }
    int rank = 0;
    for (int k = count[v]; k < count[v + 1]; k++) { rank += dropped[k] < i; }
    order[count[v] + rank] = i;
}

// dwte_emb (Vl,C) for the vocabulary rows [v0, v0 + Vl), dwpe (maxT,C) <- dout (B,T,C), dout
// fp32 or bf16, inp the tokens (device). The positions are grouped by token on the device
// (the kernels above; no copy to the host); rows of tokens not in the batch are 0; every
// element is written.
static inline void encoder_backward_x(float* dwte_emb, float* dwpe, const void* dout, int bf16, const int* inp,
                                      int B, int T, int C, int v0, int Vl, int maxT) {
    int BT = B * T;
    // order (BT) | begin (BT+1) | tokens (BT) | nuniq | dropped (BT) | count (Vl+1) | cursor (Vl)
    size_t words = 4 * (size_t)BT + 2 + 2 * (size_t)Vl + 1;
    int* plan = (int*)device_scratch(DSCRATCH_ENC, sizeof(int) * words);
    int *order = plan, *begin = order + BT, *tokens = begin + BT + 1, *nuniq = tokens + BT, *dropped = nuniq + 1;
    int *count = dropped + BT, *cursor = count + Vl + 1;
    unsigned blocks = ceil_div_u(BT, 256);
    cudaCheck(cudaMemsetAsync(count, 0, sizeof(int) * ((size_t)Vl + 1)));
    LAUNCH(encoder_plan_count_kernel, blocks, 256, count, inp, BT, v0, Vl);
    cudaLaunchCheck("encoder_plan_count_kernel");
    LAUNCH(encoder_plan_scan_kernel, 1, 1, count, cursor, tokens, begin, nuniq, Vl);
    cudaLaunchCheck("encoder_plan_scan_kernel");
    LAUNCH(encoder_plan_drop_kernel, blocks, 256, dropped, cursor, count, inp, BT, v0, Vl);
    cudaLaunchCheck("encoder_plan_drop_kernel");
    LAUNCH(encoder_plan_rank_kernel, blocks, 256, order, dropped, count, inp, BT, v0, Vl);
    cudaLaunchCheck("encoder_plan_rank_kernel");
    LAUNCH(encoder_dwpe_kernel, elementwise_blocks((size_t)maxT * C, 256), 256, dwpe, dout, bf16, B, T, C, maxT);
    cudaLaunchCheck("encoder_dwpe_kernel");
    cudaCheck(cudaMemsetAsync(dwte_emb, 0, sizeof(float) * (size_t)Vl * C));
    LAUNCH(encoder_dwte_kernel, dim3(BT, ceil_div_u(C, 128)), 128, dwte_emb, dout, bf16, order, begin, tokens, nuniq,
           B, T, C);
    cudaLaunchCheck("encoder_dwte_kernel");
}

static inline void encoder_backward(float* dwte_emb, float* dwpe, const float* dout, const int* inp, int B, int T,
                                    int C, int v0, int Vl, int maxT) {
    encoder_backward_x(dwte_emb, dwpe, dout, 0, inp, B, T, C, v0, Vl, maxT);
}

// ==========================================================================================
// layernorm (row reductions: 8 threads per row, thread ch owns chunk ch)
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
static __global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
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

static inline void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                     const float* weight, const float* bias, int BT, int C) {
    LAUNCH(layernorm_forward_kernel, ceil_div_u((size_t)BT * CANON_R, 256), 256, out, mean, rstd, inp, weight,
           bias, BT, C);
    cudaLaunchCheck("layernorm_forward_kernel");
}

static __global__ void layernorm_backward_dinp_kernel(float* dres, const float* dout, const float* inp,
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

// dres (BT,C) <- dres + dinp_ln; dweight, dbias (C) = R3 over positions, the rows rank r's
// D-way zig-zag slice of each sequence of T; with seq_partials (2,B,C), each sequence's
// subtrees instead (sequence or context parallelism: the caller finishes them over the group).
// train_gpt2.c layernorm_backward: dres NULL skips the first half, dweight and seq_partials NULL
// the second.
static inline void layernorm_backward(float* dres, float* dweight, float* dbias, const float* dout,
                                      const float* inp, const float* weight, const float* mean,
                                      const float* rstd, int B, int T, int D, int r, int C, float* seq_partials) {
    int BT = B * (int)canon_zz_len(T, D, r);
    if (dres) {
        LAUNCH(layernorm_backward_dinp_kernel, ceil_div_u((size_t)BT * CANON_R, 256), 256, dres, dout, inp, weight,
               mean, rstd, BT, C);
        cudaLaunchCheck("layernorm_backward_dinp_kernel");
    }
    if (dweight || seq_partials) {
        layernorm_param_grads_slice(dweight, dbias, seq_partials, inp, dout, 0, mean, rstd, B, T, D, r, C);
    }
}

// R1 over the nseq per-sequence values: out[i] = tree over b of seq[b * n + i]
static __global__ void sequence_tree_kernel(float* out, const float* seq, int nseq, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = canon_tree_sum(seq + i, nseq, (long)n);
    }
}

// out[c] = the R1 tree over sequences b of partials[b][c] (B,n) (train_gpt2.c sequence_tree)
static inline void sequence_tree(float* out, const float* partials, int B, int n) {
    LAUNCH(sequence_tree_kernel, elementwise_blocks((size_t)n, 256), 256, out, partials, B, (size_t)n);
    cudaLaunchCheck("sequence_tree_kernel");
}

// ==========================================================================================
// matmul: out (BT,OC) = inp (BT,K) @ weight (OC,K)^T + bias (OC)
// ==========================================================================================

static inline void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                                  int BT, int K, int OC, int nchunks) {
    det_gemm(det_args_matmul_forward(out, inp, weight, bias, BT, K, OC, nchunks), "matmul_forward");
}

// dinp (BT,K) = R2 over outputs o (nchunks chunks of each group); dweight (OC,K) = R3 over
// positions; dbias (OC) = R3 (train_gpt2.c matmul_backward_naive). Any of them may be NULL.
static inline void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                   const float* inp, const float* weight, int B, int T, int K, int OC,
                                   int groups, int nchunks) {
    int BT = B * T;
    if (dinp) { det_gemm(det_args_matmul_dinp(dinp, dout, weight, BT, K, OC, groups, nchunks), "matmul_backward dinp"); }
    if (dweight) {
        // one partial matrix per sequence, then the R1 tree over sequences (B == 1: direct)
        size_t n = (size_t)OC * K;
        float* seq = B > 1 ? (float*)device_scratch(DSCRATCH_SEQ, sizeof(float) * n * B) : dweight;
        det_gemm(det_args_matmul_dweight(seq, dout, inp, B, T, 1, 0, K, OC), "matmul_backward dweight");
        if (B > 1) {
            LAUNCH(sequence_tree_kernel, elementwise_blocks(n, 256), 256, dweight, (const float*)seq, B, n);
            cudaLaunchCheck("sequence_tree_kernel");
        }
    }
    if (dbias) { position_reduce_x(dbias, dout, 0, B, T, OC); }
}

// out[b * stride + o] = sequence b's subtree of the R3 leaves of output o (n outputs)
static __global__ void position_seq_tree_kernel(float* out, long stride, const float* leaves, int B, int nchunks, int n) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n) { return; }
    for (int b = 0; b < B; b++) { out[(size_t)b * stride + o] = det_seq_tree(leaves + o, b, nchunks, n); }
}

// Each sequence's subtree (over rank r's D-way zig-zag slice of its T positions, 8/D R2Z
// chunks) of matmul_backward's dweight and dbias, at dweight + b*seq_stride and dbias +
// b*seq_stride (cpu_fast.h matmul_backward_seqs: context parallelism)
static inline void matmul_backward_seqs(float* dweight, float* dbias, long seq_stride, const float* dout,
                                        const float* inp, int B, int T, int D, int r, int K, int OC) {
    int tchunks = CANON_R / D;
    DetGemmArgs g = det_args_matmul_dweight(dweight, dout, inp, B, T, D, r, K, OC);
    g.o_zhi = seq_stride;
    det_gemm(g, "matmul_backward_seqs dweight");
    if (dbias) {
        size_t n = (size_t)B * tchunks * OC;
        float* leaves = (float*)device_scratch(DSCRATCH_LEAVES, sizeof(float) * (n ? n : 1));
        LAUNCH(position_leaves_kernel, elementwise_blocks(n, 256), 256, leaves, (const void*)dout, 0, B, T, D, r, OC);
        cudaLaunchCheck("position_leaves_kernel");
        LAUNCH(position_seq_tree_kernel, ceil_div_u(OC, 256), 256, dbias, seq_stride, (const float*)leaves, B, tchunks, OC);
        cudaLaunchCheck("position_seq_tree_kernel");
    }
}

// ==========================================================================================
// attention (train_gpt2.c attention_forward_naive / attention_backward_naive), causal, per (b, h)
// ==========================================================================================

// softmax of a row a (T) of the scores of query t over keys t2 <= t, in place: max, exps, R2Z
// over the keys, division; 0 past t. One warp per row; lanes 0-7 own the chunk sums.
__device__ __forceinline__ void det_causal_softmax_row(float* a, int t, int T, int lane) {
    float maxv = -canon_inf();
    for (int t2 = lane; t2 <= t; t2 += 32) { if (a[t2] > maxv) { maxv = a[t2]; } }
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(FULL_MASK, maxv, o);
        if (other > maxv) { maxv = other; }
    }
    for (int t2 = lane; t2 <= t; t2 += 32) { a[t2] = canon_expf(a[t2] - maxv); }
    __syncwarp();
    float p = 0.0f;
    if (lane < CANON_R) { p = det_zz_chunk_row(a, NULL, T, 1, 0, lane, t + 1); }
    float zsum = __shfl_sync(FULL_MASK, det_tree8_shfl(p), 0);
    for (int t2 = lane; t2 < T; t2 += 32) { a[t2] = t2 <= t ? a[t2] / zsum : 0.0f; }
}

static __global__ void attention_softmax_kernel(float* att, int rows, int T) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (row >= rows) { return; }   // whole warps: rows is per warp
    det_causal_softmax_row(att + (size_t)row * T, row % T, T, lane);
}

// ds row (z, t) <- att * (dst - S) * scale, S = R2Z over keys of fmaf(att, dst)
static __global__ void attention_softmax_backward_kernel(float* ds, const float* att, int rows, int T, float scale) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (row >= rows) { return; }
    int t = row % T;
    float* d = ds + (size_t)row * T;
    const float* at = att + (size_t)row * T;
    float p = 0.0f;
    if (lane < CANON_R) { p = det_zz_chunk_row(at, d, T, 1, 0, lane, t + 1); }
    float S = __shfl_sync(FULL_MASK, det_tree8_shfl(p), 0);
    for (int t2 = lane; t2 <= t; t2 += 32) { d[t2] = at[t2] * (d[t2] - S) * scale; }
}

// qkv (B,T,3C) -> out (B,T,C), att (B,NH,T,T) the probabilities (0 above the diagonal)
static inline void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    det_gemm(det_args_attention_scores(att, qkv, B, T, C, NH), "attention_forward scores");
    int rows = B * NH * T;
    LAUNCH(attention_softmax_kernel, ceil_div_u((size_t)rows * 32, 256), 256, att, rows, T);
    cudaLaunchCheck("attention_softmax_kernel");
    det_gemm(det_args_attention_by_keys(out, C, att, qkv + 2 * C, 3L * C, B, T, C, NH), "attention_forward att@v");
}

// Generation with a KV cache (train_gpt2.c attention_forward_row): query row t of one sequence
// over T positions, against rows 0..t of qkv (T,3C); out row t (C), att rows t (NH,T,T).
// Scores: one thread per (head, key), R2 over the head's channels; the softmax: one warp per
// head, as attention_softmax_kernel; att@v: one thread per channel, R2Z over the keys.
static __global__ void attention_row_scores_kernel(float* att, const float* qkv, int t, int T, int C, int NH,
                                                   float scale) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x, h = idx / (t + 1), t2 = idx % (t + 1), hs = C / NH;
    if (h >= NH) { return; }
    const float* q = qkv + (size_t)t * 3 * C + h * hs;
    const float* k = qkv + (size_t)t2 * 3 * C + C + h * hs;
    att[((size_t)h * T + t) * T + t2] = canon_dot(q, 1, k, 1, hs) * scale;
}

static __global__ void attention_row_softmax_kernel(float* att, int t, int T, int NH) {
    int h = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    if (h >= NH) { return; }   // whole warps
    det_causal_softmax_row(att + ((size_t)h * T + t) * T, t, T, threadIdx.x % 32);
}

// R2Z over the keys j <= t of a[j] * value(j): one output channel of att@v (value(j): key j's
// value in that channel, wherever the keys live)
template <typename Value>
__device__ __forceinline__ float det_weighted_values(const float* a, int t, int T, Value value) {
    float partial[CANON_R];
    for (int ch = 0; ch < CANON_R; ch++) {
        float acc = 0.0f;
        for (int half = 0; half < 2; half++) {
            long kb, ke;
            canon_zz_half(T, CANON_R, ch, half, &kb, &ke);
            for (long j = kb; j < ke && j <= t; j++) { acc = fmaf(a[j], value(j), acc); }
        }
        partial[ch] = acc;
    }
    return canon_tree8(partial);
}

static __global__ void attention_row_values_kernel(float* out, const float* att, const float* qkv, int t, int T,
                                                   int C, int NH) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) { return; }
    const float* a = att + ((size_t)(c / (C / NH)) * T + t) * T;
    const float* v = qkv + 2 * C + c;
    out[(size_t)t * C + c] = det_weighted_values(a, t, T, [=](long j) { return v[j * 3 * C]; });
}

static inline void attention_forward_row(float* out, float* att, const float* qkv, int t, int T, int C, int NH) {
    LAUNCH(attention_row_scores_kernel, ceil_div_u((size_t)NH * (t + 1), 256), 256, att, qkv, t, T, C, NH,
           canon_rsqrtf((float)(C / NH)));
    cudaLaunchCheck("attention_row_scores_kernel");
    LAUNCH(attention_row_softmax_kernel, ceil_div_u((size_t)NH * 32, 256), 256, att, t, T, NH);
    cudaLaunchCheck("attention_row_softmax_kernel");
    LAUNCH(attention_row_values_kernel, ceil_div_u((size_t)C, 256), 256, out, att, qkv, t, T, C, NH);
    cudaLaunchCheck("attention_row_values_kernel");
}

// Serving (train_gpt2.c attention_forward_paged_naive, the specification of cpu_fast.h's
// attention_forward_paged): N query rows of different sequences over T
// positions each, row r at position pos[r] against the keys and values of its sequence's
// positions 0..pos[r] in a paged KV cache (block tables (N,max_blocks)); the three row kernels
// above with the keys read through the block table: scores one thread per (row, head, key),
// the softmax one warp per (row, head) into scratch's att (N,NH,T), att@v one thread per (row,
// channel), R2Z over the keys. The same bits as the CPU's.

static __global__ void attention_paged_scores_kernel(float* att, const float* qkv, const float* kv, long block_stride,
                                                     const int* tables, int max_blocks, const int* pos, int N, int T,
                                                     int bs, int C, int NH, float scale) {
    size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    int t2 = (int)(idx % T), h = (int)(idx / T % NH), r = (int)(idx / T / NH), hs = C / NH;
    if (r >= N || t2 > pos[r]) { return; }
    const float* q = qkv + (size_t)r * 3 * C + h * hs;
    const float* k = kv + paged_kv_slot(tables + (size_t)r * max_blocks, block_stride, t2, bs, C) + h * hs;
    att[((size_t)r * NH + h) * T + t2] = canon_dot(q, 1, k, 1, hs) * scale;
}

static __global__ void attention_paged_softmax_kernel(float* att, const int* pos, int N, int T, int NH) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);   // (r, h)
    if (row >= N * NH) { return; }   // whole warps
    det_causal_softmax_row(att + (size_t)row * T, pos[row / NH], T, threadIdx.x % 32);
}

static __global__ void attention_paged_values_kernel(float* out, const float* att, const float* kv, long block_stride,
                                                     const int* tables, int max_blocks, const int* pos, int N, int T,
                                                     int bs, int C, int NH) {
    size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    int c = (int)(idx % C), r = (int)(idx / C);
    if (r >= N) { return; }
    int t = pos[r];
    const float* a = att + ((size_t)r * NH + c / (C / NH)) * T;
    const int* table = tables + (size_t)r * max_blocks;
    out[(size_t)r * C + c] =
        det_weighted_values(a, t, T, [=](long j) { return kv[paged_kv_slot(table, block_stride, (int)j, bs, C) + C + c]; });
}

// (inline, not static: kernels.h declares it extern; defined in every translation unit of this set)
inline void attention_forward_paged(float* out, float* scratch, const float* qkv, const float* kv, long block_stride,
                                    const int* tables, int max_blocks, const int* pos, int N, int T, int bs, int C,
                                    int NH) {
    size_t scores = (size_t)N * NH * T;
    LAUNCH(attention_paged_scores_kernel, ceil_div_u(scores, 256), 256, scratch, qkv, kv, block_stride, tables,
           max_blocks, pos, N, T, bs, C, NH, canon_rsqrtf((float)(C / NH)));
    cudaLaunchCheck("attention_paged_scores_kernel");
    LAUNCH(attention_paged_softmax_kernel, ceil_div_u((size_t)N * NH * 32, 256), 256, scratch, pos, N, T, NH);
    cudaLaunchCheck("attention_paged_softmax_kernel");
    LAUNCH(attention_paged_values_kernel, ceil_div_u((size_t)N * C, 256), 256, out, (const float*)scratch, kv,
           block_stride, tables, max_blocks, pos, N, T, bs, C, NH);
    cudaLaunchCheck("attention_paged_values_kernel");
}

// dqkv (B,T,3C) <- dout (B,T,C)
static inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                      int B, int T, int C, int NH) {
    long C3 = 3L * C;
    float* ds = (float*)device_scratch(DSCRATCH_ATT, sizeof(float) * (size_t)B * NH * T * T);
    det_gemm(det_args_attention_datt(ds, dout, qkv, B, T, C, NH), "attention_backward datt");
    int rows = B * NH * T;
    LAUNCH(attention_softmax_backward_kernel, ceil_div_u((size_t)rows * 32, 256), 256, ds, att, rows, T,
           canon_rsqrtf((float)(C / NH)));
    cudaLaunchCheck("attention_softmax_backward_kernel");
    det_gemm(det_args_attention_by_keys(dqkv, C3, ds, qkv + C, C3, B, T, C, NH), "attention_backward dq");
    det_gemm(det_args_attention_by_queries(dqkv + C, C3, ds, qkv, C3, B, T, C, NH), "attention_backward dk");
    det_gemm(det_args_attention_by_queries(dqkv + 2 * C, C3, att, dout, C, B, T, C, NH), "attention_backward dv");
}

// ==========================================================================================
// context parallelism's attention blocks (cpu_fast.h attention_*_block; context_parallel.h
// drives them): rank r's Tq = canon_zz_len(T, N, r) queries against block s's keys, att and ds
// (B,NH,Tq,T) with block s in columns [canon_zz_offset(T, N, s), ... + canon_zz_len(T, N, s))
// ==========================================================================================

static inline void attention_scores_block(float* att, const float* qkv, const float* kblk, int B, int T, int C,
                                          int NH, int N, int r, int s) {
    det_gemm(det_args_attention_block_products(att, qkv, 3L * C, kblk, B, T, C, NH, N, r, s,
                                               canon_rsqrtf((float)(C / NH))), "attention_scores_block");
}

static inline void attention_datt_block(float* ds, const float* dout, const float* vblk, int B, int T, int C, int NH,
                                        int N, int r, int s) {
    det_gemm(det_args_attention_block_products(ds, dout, C, vblk, B, T, C, NH, N, r, s, 1.0f), "attention_datt_block");
}

// The softmax of row (z, t) over every block: the max, the exps, Z = canon_tree8 of the 8
// lanes' chunk sums (lane L: chunk L % (8/N) of block L / (8/N), i.e. R1 over the blocks of
// each block's subtree), the division; 0 for the keys the query does not attend to. One warp
// per row.
static __global__ void attention_softmax_blocks_kernel(float* att, int rows, int T, int N, int r) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (row >= rows) { return; }   // whole warps: rows is per warp
    int Tq = (int)canon_zz_len(T, N, r), per = CANON_R / N;
    long p = canon_zz_global(row % Tq, T, N, r);
    float* a = att + (size_t)row * T;
    float maxv = -canon_inf();
    for (int s = 0; s < N; s++) {
        int cnt = canon_zz_count_le(p, T, N, s);
        float* blk = a + canon_zz_offset(T, N, s);
        for (int j = lane; j < cnt; j += 32) { if (blk[j] > maxv) { maxv = blk[j]; } }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(FULL_MASK, maxv, o);
        if (other > maxv) { maxv = other; }
    }
    for (int s = 0; s < N; s++) {
        int cnt = canon_zz_count_le(p, T, N, s);
        float* blk = a + canon_zz_offset(T, N, s);
        for (int j = lane; j < cnt; j += 32) { blk[j] = canon_expf(blk[j] - maxv); }
    }
    __syncwarp();
    float part = 0.0f;
    if (lane < CANON_R) {
        int s = lane / per;
        part = det_zz_chunk_row(a + canon_zz_offset(T, N, s), NULL, T, N, s, lane % per, canon_zz_count_le(p, T, N, s));
    }
    float z = __shfl_sync(FULL_MASK, det_tree8_shfl(part), 0);
    __syncwarp();
    for (int s = 0; s < N; s++) {
        int cnt = canon_zz_count_le(p, T, N, s), Tk = (int)canon_zz_len(T, N, s);
        float* blk = a + canon_zz_offset(T, N, s);
        for (int j = lane; j < Tk; j += 32) { blk[j] = j < cnt ? blk[j] / z : 0.0f; }
    }
}

static inline void attention_softmax_blocks(float* att, int B, int T, int NH, int N, int r) {
    int rows = B * NH * (int)canon_zz_len(T, N, r);
    LAUNCH(attention_softmax_blocks_kernel, ceil_div_u((size_t)rows * 32, 256), 256, att, rows, T, N, r);
    cudaLaunchCheck("attention_softmax_blocks_kernel");
}

// ds row (z, t) <- att * (ds - S) * scale over every block's attended keys, S = canon_tree8 of
// the lanes' chunk sums of fmaf(att, ds) (as attention_softmax_blocks_kernel's Z)
static __global__ void attention_softmax_backward_blocks_kernel(float* ds, const float* att, int rows, int T, int N,
                                                                int r, float scale) {
    int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (row >= rows) { return; }
    int Tq = (int)canon_zz_len(T, N, r), per = CANON_R / N;
    long p = canon_zz_global(row % Tq, T, N, r);
    float* d = ds + (size_t)row * T;
    const float* at = att + (size_t)row * T;
    float part = 0.0f;
    if (lane < CANON_R) {
        int s = lane / per;
        long col = canon_zz_offset(T, N, s);
        part = det_zz_chunk_row(at + col, d + col, T, N, s, lane % per, canon_zz_count_le(p, T, N, s));
    }
    float S = __shfl_sync(FULL_MASK, det_tree8_shfl(part), 0);
    __syncwarp();
    for (int s = 0; s < N; s++) {
        int cnt = canon_zz_count_le(p, T, N, s);
        long col = canon_zz_offset(T, N, s);
        for (int j = lane; j < cnt; j += 32) { d[col + j] = at[col + j] * (d[col + j] - S) * scale; }
    }
}

static inline void attention_softmax_backward_blocks(float* ds, const float* att, int B, int T, int C, int NH, int N,
                                                     int r) {
    int rows = B * NH * (int)canon_zz_len(T, N, r);
    LAUNCH(attention_softmax_backward_blocks_kernel, ceil_div_u((size_t)rows * 32, 256), 256, ds, att, rows, T, N, r,
           canon_rsqrtf((float)(C / NH)));
    cudaLaunchCheck("attention_softmax_backward_blocks_kernel");
}

static inline void attention_values_block(float* out, const float* att, const float* vblk, int B, int T, int C,
                                          int NH, int N, int r, int s) {
    det_gemm(det_args_attention_block_by_keys(out, att, vblk, B, T, C, NH, N, r, s), "attention_values_block");
}

static inline void attention_dq_block(float* dq, const float* ds, const float* kblk, int B, int T, int C, int NH,
                                      int N, int r, int s) {
    det_gemm(det_args_attention_block_by_keys(dq, ds, kblk, B, T, C, NH, N, r, s), "attention_dq_block");
}

static inline void attention_dkv_block(float* dk, float* dv, const float* ds, const float* att, const float* qkv,
                                       const float* dout, int B, int T, int C, int NH, int N, int r, int s) {
    det_gemm(det_args_attention_block_by_queries(dk, ds, qkv, 3L * C, B, T, C, NH, N, r, s), "attention_dkv_block dk");
    det_gemm(det_args_attention_block_by_queries(dv, att, dout, C, B, T, C, NH, N, r, s), "attention_dkv_block dv");
}

// dst rows (stride ldd) <- width floats of each of `rows` src rows (stride lds)
static __global__ void copy_rows_kernel(float* dst, long ldd, const float* src, long lds, long rows, int width) {
    size_t n = (size_t)rows * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t row = i / width, col = i % width;
        dst[row * ldd + col] = src[row * lds + col];
    }
}

static inline void copy_rows(float* dst, long ldd, const float* src, long lds, long rows, int width) {
    if (rows == 0 || width == 0) { return; }
    LAUNCH(copy_rows_kernel, elementwise_blocks((size_t)rows * width, 256), 256, dst, ldd, src, lds, rows, width);
    cudaLaunchCheck("copy_rows_kernel");
}

// ==========================================================================================
// elementwise
// ==========================================================================================

static __global__ void gelu_forward_kernel(float* out, const float* inp, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = canon_gelu(inp[i]);
    }
}

static inline void gelu_forward(float* out, const float* inp, size_t n) {
    LAUNCH(gelu_forward_kernel, elementwise_blocks(n, 256), 256, out, inp, n);
    cudaLaunchCheck("gelu_forward_kernel");
}

// dinp = gelu'(inp) * dout (may be in place)
static __global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        dinp[i] = canon_gelu_grad(inp[i]) * dout[i];
    }
}

static inline void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
    LAUNCH(gelu_backward_kernel, elementwise_blocks(n, 256), 256, dinp, inp, dout, n);
    cudaLaunchCheck("gelu_backward_kernel");
}

// out = a + b (the residual stream; also memory_device's tree merge)
static __global__ void add_kernel(float* out, const float* a, const float* b, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = a[i] + b[i];
    }
}

static inline void residual_forward(float* out, const float* a, const float* b, size_t n) {
    LAUNCH(add_kernel, elementwise_blocks(n, 256), 256, out, a, b, n);
    cudaLaunchCheck("add_kernel");
}

// out (BT,OC) += bias: a row-parallel layer's bias, added once after its all-reduce
static __global__ void bias_forward_kernel(float* out, const float* bias, int BT, int OC) {
    size_t n = (size_t)BT * OC;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = out[i] + bias[i % OC];
    }
}

static inline void bias_forward(float* out, const float* bias, int BT, int OC) {
    LAUNCH(bias_forward_kernel, elementwise_blocks((size_t)BT * OC, 256), 256, out, bias, BT, OC);
    cudaLaunchCheck("bias_forward_kernel");
}

// ==========================================================================================
// softmax + cross-entropy over this rank's vocabulary entries [v0, v0 + Vl) (cpu_fast.h's
// three phases; entries v >= V are padding: probability 0, in no sum)
// ==========================================================================================

// maxes (BT) = the largest real logit of each position among this rank's entries: one warp
// per position
static __global__ void crossentropy_max_kernel(float* maxes, const float* logits, int BT, int V, int v0, int Vl) {
    int i = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x % 32;
    if (i >= BT) { return; }   // whole warps: a warp is one position
    const float* p = logits + (size_t)i * Vl;
    float m = -canon_inf();
    for (int v = lane; v < Vl && v0 + v < V; v += 32) { if (p[v] > m) { m = p[v]; } }
    for (int o = 16; o > 0; o >>= 1) {
        float other = __shfl_xor_sync(FULL_MASK, m, o);
        if (other > m) { m = other; }
    }
    if (lane == 0) { maxes[i] = m; }
}

static inline void crossentropy_max(float* maxes, const float* logits, int BT, int V, int v0, int Vl) {
    LAUNCH(crossentropy_max_kernel, ceil_div_u((size_t)BT * 32, 256), 256, maxes, logits, BT, V, v0, Vl);
    cudaLaunchCheck("crossentropy_max_kernel");
}

// One block per position: logits <- exp(logits - max) over real entries, zs = the R1 tree of
// the nchunks chunk sums (threads 0..nchunks-1 own a chunk each), target_logits = the target's
// logit where this rank holds it, else -0.0f.
static __global__ void crossentropy_exps_kernel(float* zs, float* target_logits, float* logits, const float* maxes,
                                         const int* targets, int V, int v0, int Vl, int nchunks) {
    __shared__ float s_part[CANON_R];
    int i = blockIdx.x;
    float* p = logits + (size_t)i * Vl;
    float m = maxes[i];
    if (threadIdx.x == 0) {
        int t = targets ? targets[i] - v0 : -1;
        target_logits[i] = t >= 0 && t < Vl ? p[t] : -0.0f;
    }
    __syncthreads();   // the target logit is read before the exps overwrite it
    for (int v = threadIdx.x; v < Vl && v0 + v < V; v += blockDim.x) { p[v] = canon_expf(p[v] - m); }
    __syncthreads();
    if ((int)threadIdx.x < nchunks) {
        long begin = ((long)Vl * threadIdx.x) / nchunks, end = ((long)Vl * (threadIdx.x + 1)) / nchunks;
        long real = (long)V - v0;   // entries at or past `real` are padding
        s_part[threadIdx.x] = det_chunk_sum(p, begin < real ? begin : real, end < real ? end : real);
    }
    __syncthreads();
    if (threadIdx.x == 0) { zs[i] = canon_tree_sum(s_part, nchunks, 1); }
}

static inline void crossentropy_exps(float* zs, float* target_logits, float* logits, const float* maxes,
                                     const int* targets, int BT, int V, int v0, int Vl, int nchunks) {
    LAUNCH(crossentropy_exps_kernel, BT, 256, zs, target_logits, logits, maxes, targets, V, v0, Vl, nchunks);
    cudaLaunchCheck("crossentropy_exps_kernel");
}

// probs = exps / Z (0 for padding); losses = log(Z) - (target logit - max) if targets
static __global__ void crossentropy_normalize_kernel(float* probs, float* losses, const float* zs,
                                              const float* target_logits, const float* maxes, const int* targets,
                                              int BT, int V, int v0, int Vl) {
    size_t n = (size_t)BT * Vl;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        size_t i = idx / Vl;
        int v = (int)(idx % Vl);
        probs[idx] = v0 + v < V ? probs[idx] / zs[i] : 0.0f;
        if (v == 0 && targets) { losses[i] = canon_logf(zs[i]) - (target_logits[i] - maxes[i]); }
    }
}

static inline void crossentropy_normalize(float* probs, float* losses, const float* zs, const float* target_logits,
                                          const float* maxes, const int* targets, int BT, int V, int v0, int Vl) {
    LAUNCH(crossentropy_normalize_kernel, elementwise_blocks((size_t)BT * Vl, 256), 256, probs, losses, zs,
           target_logits, maxes, targets, BT, V, v0, Vl);
    cudaLaunchCheck("crossentropy_normalize_kernel");
}

// dlogits = (probs - onehot(target)) * dloss over real entries, written over probs (padding
// stays 0)
static __global__ void crossentropy_backward_kernel(float* dlogits_probs, const int* targets, float dloss,
                                             int BT, int V, int v0, int Vl) {
    size_t n = (size_t)BT * Vl;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        size_t i = idx / Vl;
        int v = (int)(idx % Vl);
        if (v0 + v >= V) { continue; }
        float indicator = v0 + v == targets[i] ? 1.0f : 0.0f;
        dlogits_probs[idx] = (dlogits_probs[idx] - indicator) * dloss;
    }
}

static inline void crossentropy_backward(float* dlogits_probs, const int* targets, float dloss, int BT, int V,
                                         int v0, int Vl) {
    LAUNCH(crossentropy_backward_kernel, elementwise_blocks((size_t)BT * Vl, 256), 256, dlogits_probs, targets,
           dloss, BT, V, v0, Vl);
    cudaLaunchCheck("crossentropy_backward_kernel");
}

// ==========================================================================================
// memory_device: memory.h's operations on device memory (ZeRO, the communicator, the engine)
// ==========================================================================================

static __global__ void fill_kernel(float* dst, float value, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        dst[i] = value;
    }
}

// R6: the exact sum of squares. Each thread keeps a SumSq; the block adds the integer digits
// with shared-memory atomics, then the global ones: integer additions in any order are
// exact, so the total's digits are those of one sequential accumulator.
static __global__ void sumsq_kernel(SumSq* total, const float* x, size_t n) {
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

static __global__ void adamw_kernel(float* p, float* m, float* v, const float* g, size_t n, AdamWStep s, float weight_decay) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        adamw_update_elem(&p[i], &m[i], &v[i], g[i], &s, weight_decay);
    }
}

static __global__ void to_bf16_kernel(uint16_t* dst, const float* src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        dst[i] = canon_bf16_bits(src[i]);
    }
}

static void* device_mem_alloc(size_t bytes, const char* what) { return device_alloc(bytes, what); }
static void device_mem_release(void* p) { device_free(p); }
static void device_mem_copy(void* dst, const void* src, size_t bytes) {
    if (bytes) { cudaCheck(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault)); }
}
static void device_mem_to_host(void* dst, const void* src, size_t bytes) {
    if (bytes) { cudaCheck(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost)); }
}
static void device_mem_from_host(void* dst, const void* src, size_t bytes) {
    if (bytes) { cudaCheck(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice)); }
}
static void device_mem_fill(float* dst, float value, size_t n) {
    if (n == 0) { return; }
    LAUNCH(fill_kernel, elementwise_blocks(n, 256), 256, dst, value, n);
    cudaLaunchCheck("fill_kernel");
}
static void device_mem_add(float* out, const float* a, const float* b, size_t n) {
    if (n) { residual_forward(out, a, b, n); }
}
// R6 on the device: integer digits summed with atomics (exact in any order), added to the
// host total. Each call sums fewer than 2^31 values, so no digit reaches 2^63 before the host
// normalizes.
static void device_mem_sumsq(SumSq* total, const float* x, size_t n) {
    if (n == 0) { return; }
    if (n >= ((size_t)1 << 31)) { fatal("gradient norm: %zu values in one range, more than the 2^31 the kernel sums", n); }
    SumSq* d = (SumSq*)device_scratch(DSCRATCH_SUMSQ, sizeof(SumSq));
    cudaCheck(cudaMemsetAsync(d, 0, sizeof(SumSq)));
    unsigned blocks = elementwise_blocks(n, 256);
    LAUNCH(sumsq_kernel, blocks < 1024 ? blocks : 1024, 256, d, x, n);
    cudaLaunchCheck("sumsq_kernel");
    SumSq part;
    cudaCheck(cudaMemcpy(&part, d, sizeof(SumSq), cudaMemcpyDeviceToHost));
    part.pending = 0;
    canon_sumsq_normalize(&part);
    canon_sumsq_merge(total, &part);
}
static void device_mem_adamw(float* p, float* m, float* v, const float* g, size_t n, const AdamWStep* s,
                             float weight_decay) {
    if (n == 0) { return; }
    LAUNCH(adamw_kernel, elementwise_blocks(n, 256), 256, p, m, v, g, n, *s, weight_decay);
    cudaLaunchCheck("adamw_kernel");
}
// the R1 tree over ranks of a reduce-scatter's landed rows (comm_nccl.h): per element the
// sequence_tree kernel's tree
static void device_mem_tree_rows(float* rows, size_t len, int nrows, float* out) {
    if (len == 0) { return; }
    LAUNCH(sequence_tree_kernel, elementwise_blocks(len, 256), 256, out, (const float*)rows, nrows, len);
    cudaLaunchCheck("sequence_tree_kernel (tree over ranks)");
}
static void device_mem_to_bf16(uint16_t* dst, const float* src, size_t n) {
    if (n == 0) { return; }
    LAUNCH(to_bf16_kernel, elementwise_blocks(n, 256), 256, dst, src, n);
    cudaLaunchCheck("to_bf16_kernel");
}
static void device_mem_sync(void) { cudaCheck(cudaDeviceSynchronize()); }

static const MemOps memory_device = {
    "device", device_mem_alloc, device_mem_release, device_mem_copy, device_mem_to_host, device_mem_from_host,
    device_mem_fill, device_mem_add, device_mem_tree_rows, device_mem_sumsq, device_mem_adamw, device_mem_to_bf16,
    device_holds, device_mem_sync
};

#endif // LLMC_KERNELS_DET_CUH
