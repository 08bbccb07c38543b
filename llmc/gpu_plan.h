/*
 * gpu_plan.h: the parts of the CUDA build (train_gpt2.cu) that are plain arithmetic, in C,
 * so that gcc compiles them too and dev/test/test_cuda_host.c checks them on any machine:
 *
 *  1. the canonical reductions as the deterministic GPU kernels walk them (HD functions the
 *     kernels call): the tiles of a chunked reduction (rule R2) in canonical order, the
 *     streaming R1 tree over the 8 chunk partials, the R3 tree over (sequence, chunk) leaves,
 *     and the per-chunk and per-element formulas of the row kernels. Each is written once
 *     here and called by the kernels in llmc/kernels_det.cuh; the host test runs the same
 *     functions over every output and compares with train_gpt2.c's kernels bit for bit.
 *  2. host planning: launch grids, the startup check of every launch's shape, the per-token
 *     grouping of positions for the embedding gradient, and the peak used for MFU.
 */
#ifndef LLMC_GPU_PLAN_H
#define LLMC_GPU_PLAN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "llmc/canonical.h"
#include "llmc/model.h"

// ==========================================================================================
// 1. Canonical reductions as the GPU walks them
// ==========================================================================================

// A value of a device tensor that holds fp32 (bf16 == 0) or bf16 (bf16 == 1, raw bits):
// bf16 widens to float exactly. The shared reduction kernels read either storage.
HD float det_load(const void* p, size_t i, int bf16) {
    if (bf16) { return canon_bits_to_float((uint32_t)((const uint16_t*)p)[i] << 16); }
    return ((const float*)p)[i];
}

// ---- tiled chunked reductions (matmul-shaped) ---------------------------------------------
//
// Every deterministic matmul-shaped kernel computes out[m][n] = (R2 over r of A(m,r)*B(n,r))
// with the reduction r walked in tiles of at most DET_KT indices: chunk by chunk (the 8
// chunks of R2, or a tensor-parallel rank's 8/tp of them: `nchunks`), within a chunk group by
// group (the qkv weight's dinp is chunked per group, see train_gpt2.c matmul_backward_naive),
// increasing r. A reduction along the positions of a sequence (over T, keys or queries) is
// zig-zag (canonical.h R2Z): its chunk c is walked as two groups, piece c then piece
// 2*nchunks-1-c. A tile never straddles a chunk or group boundary, so each output's terms are
// accumulated in exactly the reference order, from 0.0f, with fmaf; when the walk leaves
// chunk c its partial is pushed into the streaming tree.
#define DET_MT 128        // rows m of a block tile
#define DET_NT 64         // columns n of a block tile
#define DET_KT 16         // reduction indices per shared-memory tile
#define DET_THREADS 256   // 16 x 16 threads, 8 x 4 outputs each
#define DET_A_PER_THREAD (DET_MT * DET_KT / DET_THREADS)   // 8 elements of the A tile
#define DET_B_PER_THREAD (DET_NT * DET_KT / DET_THREADS)   // 4 elements of the B tile

// Which elements of a tile thread tid loads and which outputs it owns (det_gemm_kernel; the
// host test checks that the 256 threads cover each tile and each output exactly once).
// Element e of the thread's share of the A tile (DET_MT rows x DET_KT reduction indices) is
// (row *mi, index *kk): consecutive threads walk r when A is contiguous along r (a_rc), else
// m, so that global reads coalesce. Likewise the B tile (DET_NT columns x DET_KT).
HD void det_tile_a_slot(int tid, int e, int a_rc, int* mi, int* kk) {
    *mi = a_rc ? tid / DET_KT + (DET_THREADS / DET_KT) * e : tid % DET_MT;
    *kk = a_rc ? tid % DET_KT : tid / DET_MT + (DET_THREADS / DET_MT) * e;
}
HD void det_tile_b_slot(int tid, int e, int b_rc, int* ni, int* kk) {
    *ni = b_rc ? tid / DET_KT + (DET_THREADS / DET_KT) * e : tid % DET_NT;
    *kk = b_rc ? tid % DET_KT : tid / DET_NT + (DET_THREADS / DET_NT) * e;
}
// Thread tid's outputs: rows det_out_row(tid, i) for i < 8 (two runs of 4, read as float4
// from the A tile) and columns det_out_col(tid, j) for j < 4 (one float4 of the B tile).
HD int det_out_row(int tid, int i) { return (i < 4 ? 0 : DET_MT / 2) + (tid / 16) * 4 + i % 4; }
HD int det_out_col(int tid, int j) { return (tid % 16) * 4 + j; }

// Which terms of row m take part (the causal attention products):
enum {
    DET_CAUSAL_NONE = 0,   // all r
    DET_CAUSAL_R_LE_M = 1, // r <= m: keys up to the query (att @ v, ds @ k)
    DET_CAUSAL_R_GE_M = 2, // r >= m: queries from the key on (ds^T @ q, att^T @ dout)
    // context parallelism's blocks (cpu_fast.h attention_*_block): row m a query of rank
    // zz_r's slice and r the keys of block zz_s that it attends to, a prefix of the block; or
    // row m a key of block zz_s and r the queries of rank zz_r that attend to it, a suffix
    DET_CAUSAL_ZZ_KEYS = 3,
    DET_CAUSAL_ZZ_QUERIES = 4
};

// Which outputs (m, n) exist: all, n <= m (the one-rank scores), or n among the keys of block
// zz_s that query m attends to (a block's scores)
enum { DET_OUT_ALL = 0, DET_OUT_LOWER = 1, DET_OUT_ZZ = 2 };
// ---- the deterministic matmul-shaped kernel's arguments -------------------------------------
//
// One kernel (kernels_det.cuh det_gemm_kernel) serves every matmul-shaped reduction; these
// are its arguments, and below, the arguments of each use (the matmul's three products, the
// attention's five), so that the host test runs exactly the configurations the GPU gets.
typedef struct {
    // A(z, m, r) = A[zoff_a(z) + m * a_m + r * a_r], likewise B(z, n, r) and out(z, m, n),
    // with zoff(z) = (z / zdiv) * z_hi + (z % zdiv) * z_lo for z in [0, Z) (z = (b, h) for
    // attention, b for the per-sequence weight gradients)
    const float* A; long a_zhi, a_zlo, a_m, a_r;
    const float* B; long b_zhi, b_zlo, b_n, b_r;
    float* out; long o_zhi, o_zlo, o_m;
    const float* bias;   // added after the tree (may be NULL)
    float scale;         // multiplied after the tree (attention scores; 1 otherwise, exact)
    int M, N, R;         // outputs M x N, reduction length R
    int groups;          // R's chunk groups (the qkv dinp: 3)
    int nchunks;         // R's chunks (8, or a tensor-parallel rank's 8/tp)
    int zigzag;          // R is along a sequence: R2Z chunks, R over the positions of ...
    int slice_n, slice_D, slice_rank;   // ... rank slice_rank's slice_D-way zig-zag slice of a
                                        // sequence of slice_n (nchunks = 8/slice_D; 1 way: all of it).
                                        // Not the causal mask's zz_* below: a CP block's reduction
                                        // runs over the keys' block (dq, att@v) or the queries' (dk, dv)
    int zdiv, Z;
    // the kernel variant: a_rc / b_rc: A (B) contiguous along r, else along m (n) (only how
    // tiles are loaded); causal: DET_CAUSAL_*; out_lower: DET_OUT_*
    int a_rc, b_rc, causal, out_lower;
    // context parallelism: the sequence length, the group size, the rank whose queries the
    // product is about and the owner of the block of keys (the ZZ variants)
    int zz_T, zz_N, zz_r, zz_s;
} DetGemmArgs;

// The keys of block zz_s that query m (of rank zz_r's slice) attends to: [0, this).
HD int det_zz_keys(const DetGemmArgs* g, int m) {
    return canon_zz_count_le(canon_zz_global(m, g->zz_T, g->zz_N, g->zz_r), g->zz_T, g->zz_N, g->zz_s);
}
// The first of rank zz_r's queries that attends to key m of block zz_s: [this, its slice's length).
HD int det_zz_first_query(const DetGemmArgs* g, int m) {
    return (int)canon_zz_len(g->zz_T, g->zz_N, g->zz_r) -
           canon_zz_count_ge(canon_zz_global(m, g->zz_T, g->zz_N, g->zz_s), g->zz_T, g->zz_N, g->zz_r);
}


typedef struct {
    int n;        // length of the reduced dimension
    int groups;   // its groups (n / groups each); 1 except for the qkv dinp (3); 2 if zigzag
    int nchunks;  // its chunks: 8, or 8/tp for a tensor-parallel rank's share (a power of two)
    int zigzag;   // R2Z: group 0 of chunk c is piece c, group 1 piece 2*nchunks-1-c of the slice
    int slice_n, slice_D, slice_rank;   // ... of rank slice_rank's slice_D-way slice of a sequence of
                                        // slice_n positions (DetGemmArgs)
    int lo, hi;   // only r in [lo, hi) can take part in this tile (causal clamp); [0, n) else
} DetReduction;

// The reduction of a block tile of g (under the variant `causal`, g->causal) whose rows are
// m0..m_last. The bounds of the ZZ variants are monotone in m, so m0's and m_last's bound the
// tile's.
HD DetReduction det_tile_reduction(const DetGemmArgs* g, int causal, int m0, int m_last) {
    DetReduction r;
    r.n = g->R;
    r.groups = g->zigzag ? 2 : g->groups;
    r.nchunks = g->nchunks;
    r.zigzag = g->zigzag;
    r.slice_n = g->slice_n;
    r.slice_D = g->slice_D;
    r.slice_rank = g->slice_rank;
    r.lo = 0;
    r.hi = r.n;
    if (causal == DET_CAUSAL_R_LE_M && m_last + 1 < r.hi) { r.hi = m_last + 1; }
    if (causal == DET_CAUSAL_R_GE_M && m0 > r.lo) { r.lo = m0; }
    if (causal == DET_CAUSAL_ZZ_KEYS) { r.hi = det_zz_keys(g, m_last); }
    if (causal == DET_CAUSAL_ZZ_QUERIES) { r.lo = det_zz_first_query(g, m0); }
    return r;
}

HD int det_term_included(const DetGemmArgs* g, int causal, int r, int m) {
    switch (causal) {
        case DET_CAUSAL_R_LE_M: return r <= m;
        case DET_CAUSAL_R_GE_M: return r >= m;
        case DET_CAUSAL_ZZ_KEYS: return r < det_zz_keys(g, m);
        case DET_CAUSAL_ZZ_QUERIES: return r >= det_zz_first_query(g, m);
        default: return 1;
    }
}

// Whether every row m0..m_last of a tile takes every term of [k0, k0 + len).
HD int det_tile_all_in(const DetGemmArgs* g, int causal, int k0, int len, int m0, int m_last) {
    switch (causal) {
        case DET_CAUSAL_R_LE_M: return k0 + len - 1 <= m0;
        case DET_CAUSAL_R_GE_M: return k0 >= m_last;
        case DET_CAUSAL_ZZ_KEYS: return k0 + len <= det_zz_keys(g, m0);
        case DET_CAUSAL_ZZ_QUERIES: return k0 >= det_zz_first_query(g, m_last);
        default: return 1;
    }
}

// Whether output (m, n) exists (g->out_lower).
HD int det_out_exists(const DetGemmArgs* g, int out, int m, int n) {
    return out == DET_OUT_ALL || (out == DET_OUT_LOWER ? n <= m : n < det_zz_keys(g, m));
}

// Whether a tile of rows up to m_last and columns from n0 has no output at all.
HD int det_tile_empty(const DetGemmArgs* g, int out, int n0, int m_last) {
    return out != DET_OUT_ALL && (out == DET_OUT_LOWER ? n0 > m_last : n0 >= det_zz_keys(g, m_last));
}

// Indices [*begin, *end) of chunk c, group g (clamped to [lo, hi); may be empty). Chunk c of
// group g is [g*og + og*c/nchunks, g*og + og*(c+1)/nchunks), og = n / groups, as in
// train_gpt2.c; zig-zag, group g is stretch g of the slice's R2Z chunk c (canon_zz_slice_half).
HD void det_segment(const DetReduction* r, int c, int g, int* begin, int* end) {
    long og = r->n / r->groups;
    long b = g * og + (og * c) / r->nchunks;
    long e = g * og + (og * (c + 1)) / r->nchunks;
    if (r->zigzag) { canon_zz_slice_half(r->slice_n, r->slice_D, r->slice_rank, c, g, &b, &e); }
    if (b < r->lo) { b = r->lo; }
    if (e > r->hi) { e = r->hi; }
    *begin = (int)b;
    *end = (int)(e > b ? e : b);
}

// The walk: positions (c, g, k0) of non-empty tiles. Moves (c, g, k0) to the first tile at or
// after it (k0 = -1: the start of segment (c, g)) and sets *kend to the end of its segment;
// the tile is [k0, min(k0 + DET_KT, *kend)). Returns 0 when the walk is over. To advance, add
// DET_KT to k0 and seek again.
HD int det_walk_seek(const DetReduction* r, int* c, int* g, int* k0, int* kend) {
    while (*c < r->nchunks) {
        int b, e;
        det_segment(r, *c, *g, &b, &e);
        if (*k0 < b) { *k0 = b; }
        if (*k0 < e) { *kend = e; return 1; }
        *k0 = -1;
        if (++*g == r->groups) { *g = 0; ++*c; }
    }
    return 0;
}

// Streaming R1 tree over the 8 chunk partials p0..p7 with three open subtrees s0, s1, s2:
// after chunk 7, s0 = ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)) = canon_tree8. (This is
// canon_tree_merges_after(c, 8) written out for registers.) The first 2^k pushes build the
// R1 tree of 2^k partials in s0, so a tensor-parallel rank's 8/tp chunks use it unchanged.
HD void det_tree8_push(int c, float p, float* s0, float* s1, float* s2) {
    switch (c) {
        case 0: *s0 = p; break;
        case 1: *s0 = *s0 + p; break;
        case 2: *s1 = p; break;
        case 3: *s1 = *s1 + p; *s0 = *s0 + *s1; break;
        case 4: *s1 = p; break;
        case 5: *s1 = *s1 + p; break;
        case 6: *s2 = p; break;
        default: *s2 = *s2 + p; *s1 = *s1 + *s2; *s0 = *s0 + *s1; break;
    }
}

HD long det_zoff(int z, int zdiv, long hi, long lo) { return (long)(z / zdiv) * hi + (long)(z % zdiv) * lo; }

static inline DetGemmArgs det_gemm_args(int M, int N, int R, int a_rc, int b_rc, int causal, int out_lower) {
    DetGemmArgs g;
    memset(&g, 0, sizeof(g));
    g.M = M; g.N = N; g.R = R;
    g.groups = 1; g.nchunks = CANON_R; g.zdiv = 1; g.Z = 1; g.scale = 1.0f;
    g.slice_n = R; g.slice_D = 1; g.slice_rank = 0;   // a zig-zag R: the whole sequence
    g.a_rc = a_rc; g.b_rc = b_rc; g.causal = causal; g.out_lower = out_lower;
    return g;
}

// matmul_forward: out (BT,OC) = R2 over k (nchunks chunks) of inp (BT,K) . weight (OC,K),
// then + bias
static inline DetGemmArgs det_args_matmul_forward(float* out, const float* inp, const float* weight,
                                                  const float* bias, int BT, int K, int OC, int nchunks) {
    DetGemmArgs g = det_gemm_args(BT, OC, K, 1, 1, DET_CAUSAL_NONE, 0);
    g.nchunks = nchunks;
    g.A = inp;     g.a_m = K;  g.a_r = 1;
    g.B = weight;  g.b_n = K;  g.b_r = 1;
    g.out = out;   g.o_m = OC;
    g.bias = bias;
    return g;
}

// matmul_backward's dinp (BT,K) = R2 over outputs o (nchunks chunks of each group) of
// dout . weight
static inline DetGemmArgs det_args_matmul_dinp(float* dinp, const float* dout, const float* weight,
                                               int BT, int K, int OC, int groups, int nchunks) {
    DetGemmArgs g = det_gemm_args(BT, K, OC, 1, 0, DET_CAUSAL_NONE, 0);
    g.nchunks = nchunks;
    g.A = dout;    g.a_m = OC; g.a_r = 1;
    g.B = weight;  g.b_n = 1;  g.b_r = K;
    g.out = dinp;  g.o_m = K;
    g.groups = groups;
    return g;
}

// matmul_backward's dweight per sequence b: seq[b] (OC,K) = R2Z over t of dout[b,t,o] * inp[b,t,k]
// (the R1 tree over b finishes the R3 reduction; with B = 1, seq is dweight itself); the rows
// t are rank r's D-way zig-zag slice of each sequence of T positions (D = 1: all of it)
static inline DetGemmArgs det_args_matmul_dweight(float* seq, const float* dout, const float* inp,
                                                  int B, int T, int D, int r, int K, int OC) {
    long Tl = canon_zz_len(T, D, r);
    DetGemmArgs g = det_gemm_args(OC, K, (int)Tl, 0, 0, DET_CAUSAL_NONE, 0);
    g.zigzag = 1;
    g.slice_n = T; g.slice_D = D; g.slice_rank = r;
    g.nchunks = CANON_R / D;
    g.A = dout;  g.a_zhi = Tl * OC;  g.a_m = 1;  g.a_r = OC;
    g.B = inp;   g.b_zhi = Tl * K;   g.b_n = 1;  g.b_r = K;
    g.out = seq; g.o_zhi = (long)OC * K;  g.o_m = K;
    g.Z = B;
    return g;
}

// context parallelism: rank r's queries and block s (of N) of the sequence of length T
static inline void det_args_zz(DetGemmArgs* g, int T, int N, int r, int s) {
    g->zz_T = T; g->zz_N = N; g->zz_r = r; g->zz_s = s;
}

// attention scores: att[b,h][t][t2] = R2 over hs of q_t . k_t2 times 1/sqrt(hs), t2 <= t
static inline DetGemmArgs det_args_attention_scores(float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    long C3 = 3L * C, TT = (long)T * T;
    DetGemmArgs g = det_gemm_args(T, T, hs, 1, 1, DET_CAUSAL_NONE, 1);
    g.A = qkv;      g.a_zhi = (long)T * C3;  g.a_zlo = hs;  g.a_m = C3;  g.a_r = 1;
    g.B = qkv + C;  g.b_zhi = (long)T * C3;  g.b_zlo = hs;  g.b_n = C3;  g.b_r = 1;
    g.out = att;    g.o_zhi = NH * TT;       g.o_zlo = TT;  g.o_m = T;
    g.zdiv = NH;
    g.Z = B * NH;
    g.scale = canon_rsqrtf((float)hs);
    return g;
}

// attention backward's datt: ds[b,h][t][t2] = R2 over hs of dout_t . v_t2, t2 <= t
static inline DetGemmArgs det_args_attention_datt(float* ds, const float* dout, const float* qkv,
                                                  int B, int T, int C, int NH) {
    int hs = C / NH;
    long C3 = 3L * C, TT = (long)T * T;
    DetGemmArgs g = det_gemm_args(T, T, hs, 1, 1, DET_CAUSAL_NONE, 1);
    g.A = dout;         g.a_zhi = (long)T * C;   g.a_zlo = hs;  g.a_m = C;   g.a_r = 1;
    g.B = qkv + 2 * C;  g.b_zhi = (long)T * C3;  g.b_zlo = hs;  g.b_n = C3;  g.b_r = 1;
    g.out = ds;         g.o_zhi = NH * TT;       g.o_zlo = TT;  g.o_m = T;
    g.zdiv = NH;
    g.Z = B * NH;
    return g;
}

// out rows t of head h (stride ldo) = R2Z over keys t2 <= t of w[b,h][t][t2] * x rows t2
// of head h (stride ldx): the forward's att @ v (x = v) and the backward's ds @ k (x = k)
static inline DetGemmArgs det_args_attention_by_keys(float* out, long ldo, const float* w, const float* x,
                                                     long ldx, int B, int T, int C, int NH) {
    int hs = C / NH;
    long TT = (long)T * T;
    DetGemmArgs g = det_gemm_args(T, hs, T, 1, 0, DET_CAUSAL_R_LE_M, 0);
    g.zigzag = 1;
    g.A = w;    g.a_zhi = NH * TT;         g.a_zlo = TT;  g.a_m = T;  g.a_r = 1;
    g.B = x;    g.b_zhi = (long)T * ldx;   g.b_zlo = hs;  g.b_n = 1;  g.b_r = ldx;
    g.out = out; g.o_zhi = (long)T * ldo;  g.o_zlo = hs;  g.o_m = ldo;
    g.zdiv = NH;
    g.Z = B * NH;
    return g;
}

// out rows t2 of head h (stride ldo) = R2Z over queries t >= t2 of w[b,h][t][t2] * x rows
// t of head h (stride ldx): the backward's ds^T @ q (dk) and att^T @ dout (dv)
static inline DetGemmArgs det_args_attention_by_queries(float* out, long ldo, const float* w, const float* x,
                                                        long ldx, int B, int T, int C, int NH) {
    int hs = C / NH;
    long TT = (long)T * T;
    DetGemmArgs g = det_gemm_args(T, hs, T, 0, 0, DET_CAUSAL_R_GE_M, 0);
    g.zigzag = 1;
    g.A = w;    g.a_zhi = NH * TT;         g.a_zlo = TT;  g.a_m = 1;  g.a_r = T;
    g.B = x;    g.b_zhi = (long)T * ldx;   g.b_zlo = hs;  g.b_n = 1;  g.b_r = ldx;
    g.out = out; g.o_zhi = (long)T * ldo;  g.o_zlo = hs;  g.o_m = ldo;
    g.zdiv = NH;
    g.Z = B * NH;
    return g;
}

// ---- context parallelism's blocks (cpu_fast.h attention_*_block) ---------------------------
// Rank r's Tq = canon_zz_len(T, N, r) queries against block s's Tk = canon_zz_len(T, N, s)
// keys (T/N each when 2N | T); att and ds (B,NH,Tq,T) keep block s in columns
// [canon_zz_offset(T, N, s), ... + Tk).

// att (or ds) block s [b,h][t][j] = R2 over hs of q_t . k_j (times scale) for the keys j that
// query t attends to; q rows of stride ldq (qkv's q, or dout), kblk (B,Tk,C)
static inline DetGemmArgs det_args_attention_block_products(float* att, const float* q, long ldq, const float* kblk,
                                                            int B, int T, int C, int NH, int N, int r, int s,
                                                            float scale) {
    int hs = C / NH, Tq = (int)canon_zz_len(T, N, r), Tk = (int)canon_zz_len(T, N, s);
    long TT = (long)Tq * T;
    DetGemmArgs g = det_gemm_args(Tq, Tk, hs, 1, 1, DET_CAUSAL_NONE, DET_OUT_ZZ);
    g.A = q;                                g.a_zhi = (long)Tq * ldq;  g.a_zlo = hs;  g.a_m = ldq;  g.a_r = 1;
    g.B = kblk;                             g.b_zhi = (long)Tk * C;    g.b_zlo = hs;  g.b_n = C;    g.b_r = 1;
    g.out = att + canon_zz_offset(T, N, s); g.o_zhi = NH * TT;         g.o_zlo = TT;  g.o_m = T;
    g.zdiv = NH;
    g.Z = B * NH;
    g.scale = scale;
    det_args_zz(&g, T, N, r, s);
    return g;
}

// out (B,Tq,C) head h = block s's subtree (R2Z over its keys, its 8/N chunks) of w[b,h][t][j] *
// x rows j (stride C): att @ v (w = att, x = vblk) and ds @ k (w = ds, x = kblk)
static inline DetGemmArgs det_args_attention_block_by_keys(float* out, const float* w, const float* x, int B, int T,
                                                           int C, int NH, int N, int r, int s) {
    int hs = C / NH, Tq = (int)canon_zz_len(T, N, r), Tk = (int)canon_zz_len(T, N, s);
    long TT = (long)Tq * T;
    DetGemmArgs g = det_gemm_args(Tq, hs, Tk, 1, 0, DET_CAUSAL_ZZ_KEYS, DET_OUT_ALL);
    g.zigzag = 1;
    g.slice_n = T; g.slice_D = N; g.slice_rank = s;
    g.nchunks = CANON_R / N;
    g.A = w + canon_zz_offset(T, N, s);  g.a_zhi = NH * TT;        g.a_zlo = TT;  g.a_m = T;  g.a_r = 1;
    g.B = x;                             g.b_zhi = (long)Tk * C;   g.b_zlo = hs;  g.b_n = 1;  g.b_r = C;
    g.out = out;                         g.o_zhi = (long)Tq * C;   g.o_zlo = hs;  g.o_m = C;
    g.zdiv = NH;
    g.Z = B * NH;
    det_args_zz(&g, T, N, r, s);
    return g;
}

// out (B,Tk,C) rows j = block s's keys, head h = rank r's subtree (R2Z over its queries, its 8/N
// chunks) of w[b,h][t][j] * x rows t (stride ldx): ds^T @ q (dk) and att^T @ dout (dv)
static inline DetGemmArgs det_args_attention_block_by_queries(float* out, const float* w, const float* x, long ldx,
                                                              int B, int T, int C, int NH, int N, int r, int s) {
    int hs = C / NH, Tq = (int)canon_zz_len(T, N, r), Tk = (int)canon_zz_len(T, N, s);
    long TT = (long)Tq * T;
    DetGemmArgs g = det_gemm_args(Tk, hs, Tq, 0, 0, DET_CAUSAL_ZZ_QUERIES, DET_OUT_ALL);
    g.zigzag = 1;
    g.slice_n = T; g.slice_D = N; g.slice_rank = r;
    g.nchunks = CANON_R / N;
    g.A = w + canon_zz_offset(T, N, s);  g.a_zhi = NH * TT;         g.a_zlo = TT;  g.a_m = 1;  g.a_r = T;
    g.B = x;                             g.b_zhi = (long)Tq * ldx;  g.b_zlo = hs;  g.b_n = 1;  g.b_r = ldx;
    g.out = out;                         g.o_zhi = (long)Tk * C;    g.o_zlo = hs;  g.o_m = C;
    g.zdiv = NH;
    g.Z = B * NH;
    det_args_zz(&g, T, N, r, s);
    return g;
}

// ---- reductions over positions (R3) -------------------------------------------------------
//
// A position reduction is computed as leaves, one per (sequence b, R2Z chunk ch of T), each
// the sequential sum over its positions from 0.0f, then combined by the R3 tree. Leaf (b, ch)
// of output o is stored at leaves[(b * nchunks + ch) * stride + o]. nchunks is 8, or 8/D when
// a sequence- or context-parallel rank holds its D-way zig-zag slice r of each sequence of T
// positions (canon_zz_len(T, D, r) rows a sequence; its chunks of the 8).

// The R1 tree over the nchunks leaves of sequence b: the sequence's subtree of the R3 tree.
HD float det_seq_tree(const float* leaves, int b, int nchunks, long stride) {
    return canon_tree_sum(leaves + (long)b * nchunks * stride, nchunks, stride);
}

// The R3 tree of nseq * nchunks leaves: the chunks of each sequence, then R1 over sequences.
HD float det_pos_tree(const float* leaves, int nseq, int nchunks, long stride) {
    float partials[34];
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    partials[0] = 0.0f;   // the value of an empty reduction (nseq == 0)
    for (int b = 0; b < nseq; b++) {
        canon_stack_push_value(&stack, det_seq_tree(leaves, b, nchunks, stride), canon_tree_merges_after(b, nseq));
    }
    return partials[0];
}

// Leaf (b, ch) of sum over positions of x[pos * OC + o] (x: B sequences' rows of OC, each rank
// r's D-way slice of T; bias gradients, the loss).
HD float det_position_leaf(const void* x, int bf16, int OC, int o, int b, int T, int D, int r, int ch) {
    float acc = 0.0f;
    long Tl = canon_zz_len(T, D, r);
    for (int half = 0; half < 2; half++) {
        long tb, te;
        canon_zz_slice_half(T, D, r, ch, half, &tb, &te);
        for (long t = tb; t < te; t++) { acc = acc + det_load(x, ((size_t)b * Tl + t) * OC + o, bf16); }
    }
    return acc;
}

// Leaves (b, ch) of layernorm's parameter gradients at channel c: dweight = sum dy * n
// (fmaf), dbias = sum dy, with n = (x - mean) * rstd (train_gpt2.c layernorm_backward).
HD void det_ln_param_leaf(const void* x, const void* dy, int bf16, const float* mean,
                          const float* rstd, int C, int c, int b, int T, int D, int r, int ch,
                          float* leaf_w, float* leaf_b) {
    float aw = 0.0f, ab = 0.0f;
    long Tl = canon_zz_len(T, D, r);
    for (int half = 0; half < 2; half++) {
        long tb, te;
        canon_zz_slice_half(T, D, r, ch, half, &tb, &te);
        for (long t = tb; t < te; t++) {
            size_t i = (size_t)b * Tl + t;
            float d = det_load(dy, i * C + c, bf16);
            float n = (det_load(x, i * C + c, bf16) - mean[i]) * rstd[i];
            aw = fmaf(d, n, aw);
            ab = ab + d;
        }
    }
    *leaf_w = aw;
    *leaf_b = ab;
}

// ---- the embedding gradients (train_gpt2.c encoder_backward) ------------------------------

// dwpe[t][c] for t < T: one term per sequence, 0.0f + dout[b,t,c], combined by R1 over b.
HD float det_encoder_dwpe_elem(const void* dout, int bf16, int B, int T, int C, int t, int c) {
    float partials[34];
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    partials[0] = 0.0f;   // the value of an empty reduction (B == 0)
    for (int b = 0; b < B; b++) {
        canon_stack_push_value(&stack, 0.0f + det_load(dout, ((size_t)b * T + t) * C + c, bf16),
                               canon_tree_merges_after(b, B));
    }
    return partials[0];
}

// dwte_emb[v][c] for a token v present in the batch: its positions order[begin..end) in
// (b, t) order; per sequence the R2Z chunk sums over t (0.0f for chunks without v), then R1
// over sequences (R3).
HD float det_encoder_dwte_elem(const void* dout, int bf16, const int* order, int begin, int end,
                               int B, int T, int C, int c) {
    float partials[CANON_LOG2_R + 34];
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    partials[0] = 0.0f;   // the value of an empty reduction (B == 0)
    int next = begin;
    for (int b = 0; b < B; b++) {
        int piece_at[2 * CANON_R + 1];   // v's first position in sequence b at or past piece p
        for (int p = 0; p <= 2 * CANON_R; p++) {
            long start = (long)b * T + canon_piece_begin(T, 2 * CANON_R, p);
            while (next < end && order[next] < start) { next++; }
            piece_at[p] = next;
        }
        for (int ch = 0; ch < CANON_R; ch++) {
            float acc = 0.0f;
            int pieces[2] = {ch, 2 * CANON_R - 1 - ch};
            for (int half = 0; half < 2; half++) {
                for (int i = piece_at[pieces[half]]; i < piece_at[pieces[half] + 1]; i++) {
                    acc = acc + det_load(dout, (size_t)order[i] * C + c, bf16);
                }
            }
            canon_stack_push_value(&stack, acc, canon_pos_merges_after(b, B, ch, CANON_R));
        }
    }
    return partials[0];
}

// ---- row kernels: one chunk of a row per thread, the 8 partials by canon_tree8 ------------

// sum of x[i] for i in [begin, end), from 0.0f
HD float det_chunk_sum(const float* x, long begin, long end) {
    float acc = 0.0f;
    for (long i = begin; i < end; i++) { acc = acc + x[i]; }
    return acc;
}

// R2Z chunk c of an attention row's keys, rank r's D-way zig-zag slice of a sequence of n
// positions, that a query attends to, those below `count`: the sum of a[j] (b NULL), or the
// fmaf-accumulated dot product of a and b, from 0.0f, the chunk's low piece then its high one.
// One rank: D = 1 (8 chunks), count = t + 1; context parallelism: block r of N, 8/N chunks.
HD float det_zz_chunk_row(const float* a, const float* b, long n, int D, int r, int c, long count) {
    float acc = 0.0f;
    for (int half = 0; half < 2; half++) {
        long kb, ke;
        canon_zz_slice_half(n, D, r, c, half, &kb, &ke);
        for (long j = kb; j < ke && j < count; j++) { acc = b ? fmaf(a[j], b[j], acc) : acc + a[j]; }
    }
    return acc;
}

// layernorm: fmaf-accumulated squared deviations from the mean m
HD float det_ln_chunk_var(const float* x, float m, long begin, long end) {
    float acc = 0.0f;
    for (long i = begin; i < end; i++) {
        float d = x[i] - m;
        acc = fmaf(d, d, acc);
    }
    return acc;
}

// layernorm backward: the chunk's sums of dnorm = dy * w and of dnorm * n (fmaf)
HD void det_ln_bwd_chunk(const float* x, const float* dy, const float* w, float m, float s,
                         long begin, long end, float* p1, float* p2) {
    float a1 = 0.0f, a2 = 0.0f;
    for (long i = begin; i < end; i++) {
        float n = (x[i] - m) * s;
        float dnorm = dy[i] * w[i];
        a1 = a1 + dnorm;
        a2 = fmaf(dnorm, n, a2);
    }
    *p1 = a1;
    *p2 = a2;
}

// layernorm backward: d input of element i given the two means over C
HD float det_ln_bwd_dx(float x, float dy, float w, float m, float s, float dnorm_mean,
                       float dnorm_norm_mean) {
    float n = (x - m) * s;
    float dnorm = dy * w;
    return ((dnorm - dnorm_mean) - n * dnorm_norm_mean) * s;
}

// ==========================================================================================
// 2. Host planning
// ==========================================================================================

static inline unsigned ceil_div_u(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }

// Grid of a grid-stride elementwise kernel over n elements (at most 2^19 blocks).
static inline unsigned elementwise_blocks(size_t n, int threads) {
    size_t blocks = (n + threads - 1) / threads;
    return (unsigned)(blocks > 65536 * 8 ? 65536 * 8 : (blocks ? blocks : 1));
}

// Grid of a deterministic tiled kernel over M x N outputs and Z batches (x: column tiles,
// y: row tiles, z: batches). Returns 0 if a dimension exceeds CUDA's grid limits.
static inline int det_gemm_grid(long M, long N, long Z, unsigned* gx, unsigned* gy, unsigned* gz) {
    long x = (N + DET_NT - 1) / DET_NT, y = (M + DET_MT - 1) / DET_MT;
    if (M < 1 || N < 1 || Z < 1 || x > 2147483647L || y > 65535 || Z > 65535) { return 0; }
    *gx = (unsigned)x;
    *gy = (unsigned)y;
    *gz = (unsigned)Z;
    return 1;
}

// Flash attention (fast mode): head sizes it is built for; its grid is (T/64 query or key
// tiles, B*NH).
static inline int gpu_flash_head_size(int hs) { return hs == 16 || hs == 32 || hs == 64; }

// Fast mode keeps one layer's softmax statistics (B,NH,T) fp32 after another; cuDNN reads and
// writes them only at 16-byte aligned addresses, so each layer's block starts on a multiple of
// 4 floats (B*NH*T need not be one).
static inline size_t gpu_attention_stats_stride(long B, long NH, long T) { return ((size_t)(B * NH * T) + 3) & ~(size_t)3; }

// Every launch a run over (B, T) positions makes (and the sampler's, B = 1, T = genT; genT 0:
// no sampling), checked against CUDA's limits and the kernels' assumptions before anything is
// allocated, so that an impossible shape fails at startup with one line instead of in the
// middle of a step. Returns NULL if the run fits, else what does not (written to buf).
static inline const char* gpu_launch_problem(const GPT2Config* c, long B, long T, int det, int genT,
                                             char* buf, size_t cap) {
    long C = c->channels, NH = c->num_heads, Vp = c->padded_vocab_size;
    long BT = B * T, Ta = T > genT ? T : genT;   // the sampler's attention has genT rows
    unsigned gx, gy, gz;
    size_t P = param_count(c);
    if (BT > 2147483647L / CANON_R || B * NH * Ta > 2147483647L / 32) {
        snprintf(buf, cap, "B*T = %ld positions (B*NH*T = %ld attention rows) are more than the kernels' "
                 "32-bit position and row indices take", BT, B * NH * Ta);
        return buf;
    }
    if (P >= ((size_t)1 << 31)) {   // kernels_det.cuh gradient_norm: its digits stay below 2^63
        snprintf(buf, cap, "%zu parameters: the exact gradient norm kernel sums fewer than 2^31 values", P);
        return buf;
    }
    if (det) {
        // det_gemm grids: matmuls (BT rows), per-sequence weight gradients (B batches of OC rows),
        // attention (B*NH batches of T rows; the sampler's NH batches of genT rows)
        long rows[] = {BT, 4 * C, Vp, Ta};
        long batches[] = {1, B, B, B * NH};
        for (int i = 0; i < 4; i++) {
            if (!det_gemm_grid(rows[i], 4 * C > Vp ? 4 * C : Vp, batches[i], &gx, &gy, &gz)) {
                snprintf(buf, cap, "a deterministic tiled kernel over %ld rows in %ld batches exceeds CUDA's "
                         "grid (65535 tiles of %d rows, 65535 batches): lower -b or -t", rows[i], batches[i], DET_MT);
                return buf;
            }
        }
        return NULL;
    }
    if (C % 8 != 0 || Vp % 8 != 0) {   // bf16x8 (16-byte) accesses along C and along the vocabulary
        snprintf(buf, cap, "fast mode needs C and the padded vocabulary Vp to be multiples of 8 (C = %ld, "
                 "Vp = %ld; llm.c pads V to a multiple of 128)", C, Vp);
        return buf;
    }
    if (B * NH > 65535) {
        snprintf(buf, cap, "B*NH = %ld (batch x heads) is more than the 65535 blocks of flash attention's "
                 "grid.y: lower -b", B * NH);
        return buf;
    }
    return NULL;   // the sampler (B = 1, T = genT) launches within the same limits
}

// Groups the B*T positions of a microbatch by token for the embedding gradient of the
// vocabulary rows [v0, v0 + Vl) this rank holds (one rank: v0 = 0, Vl = Vp): the u-th distinct
// token held (ascending id) is v0 + tokens[u], its positions order[begin[u] .. begin[u+1]) in
// (b, t) order (a stable counting sort, as train_gpt2.c encoder_backward does); positions of
// tokens other ranks hold are left out. count needs Vl + 1 ints. Returns the number of
// distinct tokens held.
static inline int encoder_backward_plan(const int* inp, int BT, int v0, int Vl, int* count, int* order,
                                        int* begin, int* tokens) {
    memset(count, 0, sizeof(int) * ((size_t)Vl + 1));
    for (int i = 0; i < BT; i++) {
        int v = inp[i] - v0;
        if (v >= 0 && v < Vl) { count[v + 1]++; }
    }
    int nuniq = 0;
    for (int v = 0; v < Vl; v++) {
        if (count[v + 1] > 0) { tokens[nuniq++] = v; }
        count[v + 1] += count[v];
    }
    int held = count[Vl];
    for (int u = 0; u <= nuniq; u++) { begin[u] = u < nuniq ? count[tokens[u]] : held; }
    for (int i = 0; i < BT; i++) {
        int v = inp[i] - v0;
        if (v >= 0 && v < Vl) { order[count[v]++] = i; }
    }
    return nuniq;
}

// ---- throughput --------------------------------------------------------------------------

// The dense peak (TFLOP/s) that MFU is measured against: the bf16 tensor-core peak in fast
// mode, the plain fp32 (non-tensor) peak in deterministic mode, from the vendor datasheets.
// 0 when the GPU is not in the table (MFU is then not printed). *name_out says which.
static inline double gpu_peak_tflops(int cc_major, int cc_minor, const char* device_name,
                                     int deterministic, const char** name_out) {
    int pcie = device_name != NULL && strstr(device_name, "PCIe") != NULL;
    double peak = 0.0;
    const char* what = "unknown GPU: no peak";
    if (cc_major == 9 && cc_minor == 0) {          // H100 / H200
        if (pcie) {
            peak = deterministic ? 51.0 : 756.0;
            what = deterministic ? "H100 PCIe fp32 51 TFLOP/s" : "H100 PCIe dense bf16 756 TFLOP/s";
        } else {
            peak = deterministic ? 67.0 : 989.0;
            what = deterministic ? "H100/H200 SXM fp32 67 TFLOP/s" : "H100/H200 SXM dense bf16 989 TFLOP/s";
        }
    } else if (cc_major == 8 && cc_minor == 0) {   // A100
        peak = deterministic ? 19.5 : 312.0;
        what = deterministic ? "A100 fp32 19.5 TFLOP/s" : "A100 dense bf16 312 TFLOP/s";
    }
    if (name_out) { *name_out = what; }
    return peak;
}

#endif // LLMC_GPU_PLAN_H
