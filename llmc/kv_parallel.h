/*
 * kv_parallel.h: KV parallelism (KVP, Helix's name) for decode attention: each request's KV
 * cache is cut along its positions over the P ranks of a KVP group; every rank attends with
 * all of its query heads over the keys it holds, and the partial results are combined into
 * exactly the bits one rank's paged attention (attention_forward_paged, cpu_fast.h's, the
 * server's) computes. The KV cache per rank is 1/P of a full-context request's.
 *
 * WHICH POSITIONS A RANK HOLDS (zig-zag stretches, not Helix's round-robin blocks)
 * The serving attention reduces over a request's keys by canonical.h's rule R2Z over the
 * model's context T (its maxT, whatever the request's length): 8 zig-zag chunks (chunk c =
 * pieces c and 15-c of 16), each summed in order, the 8 partials combined by the R1 tree. A
 * rank that holds whole chunks [r*8/P, (r+1)*8/P) holds a complete subtree of that tree, so its
 * partial sums combined over the group by the R1 tree in rank order (comm.h's all-reduce and
 * reduce-scatter are that tree) are the one-rank sums, bit for bit: no log-sum-exp rescaling.
 * Those chunks are the 2P-way stretches r and 2P-1-r of T (canonical.h R2Z: zigzag.h's slicing,
 * the one sequence and context parallelism cut a sequence with, applied to the cache). Dealing KV blocks round-robin, as Helix does, would give every
 * rank a piece of every chunk, whose in-order sum cannot be split, so it cannot be exact.
 * The price: a request shorter than T fills the low stretches first, so for short requests the
 * ranks' shares are uneven (a request of under T/(2P) positions lives on rank 0 alone); at a
 * full context every rank holds T/P positions. A stretch must be whole KV blocks: 2*P*block_size
 * must divide T (kvp_problem).
 *   rank r's local position l (its positions in increasing order, low stretch then high):
 *   global position canon_zz_global(l, T, P, r); it lives in slot l % bs of block
 *   table[l / bs] of the rank's own PagedKV (llmc/paged_kv.h), whose blocks hold rows of 2*Cl
 *   floats (k | v of the rank's heads).
 *
 * HEADS (KVP x TP)
 * A KVP group can be one of tp such groups, each holding NH/tp of the heads (Cl = C/tp
 * channels, the rank's tensor-parallel slice of q, k and v from the column-parallel qkv
 * matmul). Heads are independent in attention, so the KVP group's combine is over its own
 * heads only.
 *
 * THE DECODE STEP, per query row (one generated token of one request) and head, over the
 * rank's keys at positions <= t:
 *   s = dot(q, k) / sqrt(hs)                    (R2 over hs, as one rank)
 *   m = max over the KVP group of the local max    comm_all_reduce_max on the (N, NHl) maxes:
 *                                                  exact in any order (R5)
 *   Z = R1 over ranks of each rank's R1 subtree of its chunks' in-order sums of exp(s - m)
 *                                                  comm_all_reduce_sum on the (N, NHl) subtree
 *                                                  sums: comm.h's R1 tree over ranks in order
 *   o = R1 over ranks of each rank's subtree of its chunks' in-order fmaf sums of (e/Z) * v
 *       KVP_COMBINE_ALL_REDUCE:     comm_all_reduce_sum on the (N, Cl) partials: every rank
 *                                   has o for all of its heads (then a row-parallel output
 *                                   projection over the tp group, as without KVP)
 *       KVP_COMBINE_REDUCE_SCATTER: comm_reduce_scatter of the partials laid out (P, N, Cl/P):
 *                                   rank r gets heads [r*NHl/P, (r+1)*NHl/P) of its group's
 *                                   heads, the Megatron row-parallel layout of the output
 *                                   projection over all P*tp ranks (Helix's layout for the
 *                                   projection and the FFN after attention): rank (kvp r, tp t)
 *                                   holds channel slice t*P + r, so the projection's g is an
 *                                   all-reduce over the KVP group, then over the TP group (a TP
 *                                   rank's P slices are a subtree of the R1 tree), or one
 *                                   all-reduce over all P*tp ranks ranked by slice, the same
 *                                   tree (the server's: llmc/serve_kvp.h)
 * Traffic (COMM_KIND_CP), bytes this rank sends per decode step of N rows (comm.h's formulas):
 *   max       2(P-1) * ceil(N*NHl/P) * 4
 *   Z         2(P-1) * ceil(N*NHl/P) * 4
 *   output    all-reduce 2(P-1) * ceil(N*Cl/P) * 4   or   reduce-scatter (P-1) * N*Cl/P * 4
 * (kvp_step_bytes).
 *
 * TWO KERNEL SETS. The step between its collectives is three kernels (kvp_scores, kvp_exps,
 * kvp_values), each output computed by the per-output functions below (HD: host and device):
 * the CPU's loops here, the device's in llmc/kernels_kvp_det.cuh (serve_gpt2cu), the same bits;
 * the collectives run on the buffers where they live (comm.h stages device ones).
 */
#ifndef LLMC_KV_PARALLEL_H
#define LLMC_KV_PARALLEL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/canonical.h"
#include "llmc/comm.h"
#include "llmc/memory.h"
#include "llmc/paged_kv.h"
#include "llmc/utils.h"

typedef enum { KVP_COMBINE_ALL_REDUCE, KVP_COMBINE_REDUCE_SCATTER } KVPCombine;

typedef struct {
    int P, rank;        // the KVP group's size and this rank's place in it
    int T, bs;          // the model's context (the R2Z length) and the KV block size
    int NHl, hs;        // this rank's heads (NH/tp) and the head size
    int Cl;             // NHl * hs: the channels of q, k and v this rank holds
    KVPCombine combine;
    const MemOps* mem;  // where the workspace lives (the cache's memory; host unless kvp_set_memory)
    float* scores;      // workspace: (N, NHl, T/P) scores, then their exps, by local position
    float* partials;    // (N, Cl) the output partials, or (P, N, Cl/P) for a reduce-scatter
    float* stats;       // (2, N, NHl) maxes, then Z subtree sums
    int cap_rows;       // rows the partials and stats have room for
} KVPLayout;

// Why (P, tp, T, bs, NH, combine) cannot be laid out, as one line naming the flag, or NULL when
// it can. line: room for the message.
static inline const char* kvp_problem(char* line, size_t len, int P, int tp, int T, int bs, int NH,
                                      KVPCombine combine) {
    if (P < 1 || P > CANON_R || CANON_R % P != 0) {
        snprintf(line, len, "--kvp %d: expected 1, 2, 4 or 8 (a KVP rank holds whole chunks of the %d canonical "
                 "chunks of a request's keys)", P, CANON_R);
    } else if (tp < 1 || NH % tp != 0) {
        snprintf(line, len, "--tp %d: expected a divisor of the model's %d heads", tp, NH);
    } else if (bs < 1 || T % (2 * P * bs) != 0) {
        snprintf(line, len, "--kvp %d with --block-size %d: expected 2 x kvp x block size (%d) to divide the "
                 "context length %d (each KVP rank holds two stretches of T/%d positions in whole blocks)",
                 P, bs, 2 * P * bs, T, 2 * P);
    } else if (combine == KVP_COMBINE_REDUCE_SCATTER && (NH / tp) % P != 0) {
        snprintf(line, len, "--kvp %d: expected a divisor of the %d heads per tensor-parallel rank to scatter "
                 "the attention output by heads", P, NH / tp);
    } else {
        return NULL;
    }
    return line;
}

static inline void kvp_init(KVPLayout* lay, int P, int rank, int tp, int T, int bs, int C, int NH, KVPCombine combine) {
    char line[256];
    const char* problem = kvp_problem(line, sizeof(line), P, tp, T, bs, NH, combine);
    if (problem) { fatal("%s", problem); }
    memset(lay, 0, sizeof(*lay));
    lay->P = P;
    lay->rank = rank;
    lay->T = T;
    lay->bs = bs;
    lay->NHl = NH / tp;
    lay->hs = C / NH;
    lay->Cl = lay->NHl * lay->hs;
    lay->combine = combine;
    lay->mem = &memory_host;
}

// The workspace in mem (a cache on the GPU: serve_kvp.h), before the first decode.
static inline void kvp_set_memory(KVPLayout* lay, const MemOps* mem) { lay->mem = mem; }

static inline void kvp_free(KVPLayout* lay) {
    lay->mem->release(lay->scores);
    lay->mem->release(lay->partials);
    lay->mem->release(lay->stats);
}

// ---- where a position lives (HD: the CPU loops below and the device kernels) ---------------
// The rank of a KVP group of P that holds global position p of a context of T.
HD int kvp_owner_of(int p, int T, int P) {
    int h = T / (2 * P), s = p / h;   // stretch s of 2P
    return s < P ? s : 2 * P - 1 - s;
}

// Rank r's local position of global position p (which it must own).
HD int kvp_local_of(int p, int T, int P, int r) {
    int h = T / (2 * P);
    return p < T / 2 ? p - r * h : h + p - (T - (r + 1) * h);
}

static inline int kvp_owner(const KVPLayout* lay, int p) { return kvp_owner_of(p, lay->T, lay->P); }
static inline int kvp_local(const KVPLayout* lay, int p) { return kvp_local_of(p, lay->T, lay->P, lay->rank); }

// Grows this rank's block table to hold its share of a request's positions [0, positions):
// 1 when done, 0 (unchanged) when the rank's free list is short. Its share is a prefix of its
// local positions, so the table grows like a one-rank table does.
static inline int kvp_reserve(PagedKV* kv, BlockTable* bt, const KVPLayout* lay, int positions) {
    int local = positions > 0 ? canon_zz_count_le(positions - 1, lay->T, lay->P, lay->rank) : 0;
    return block_table_reserve(kv, bt, local);
}

// Where global position p's key and value go in a layer's view of this rank's cache, through
// the request's table on this rank: an offset, or -1 when another rank of the group holds p.
static inline long kvp_slot(const KVPLayout* lay, const int* table, long block_stride, int p) {
    if (kvp_owner(lay, p) != lay->rank) { return -1; }
    return paged_kv_slot(table, block_stride, kvp_local(lay, p), lay->bs, lay->Cl);
}

// Stores the k and v (Cl each, this rank's heads) of global position p of layer l, if this rank
// holds p; returns whether it did. The table must have been reserved past p. (Host memory.)
static inline int kvp_store(PagedKV* kv, const BlockTable* bt, const KVPLayout* lay, int l, int p,
                            const float* k, const float* v) {
    long slot = kvp_slot(lay, bt->blocks, paged_kv_block_stride(kv), p);
    if (slot < 0) { return 0; }
    float* row = paged_kv_layer(kv, l) + slot;
    memcpy(row, k, sizeof(float) * lay->Cl);
    memcpy(row + lay->Cl, v, sizeof(float) * lay->Cl);
    return 1;
}

// The bytes this rank sends in one kvp_attention_decode of N rows (the formulas above).
static inline uint64_t kvp_step_bytes(const KVPLayout* lay, int N) {
    uint64_t stats = 2 * comm_all_reduce_bytes(lay->P, (size_t)N * lay->NHl, sizeof(float));
    uint64_t out = lay->combine == KVP_COMBINE_ALL_REDUCE
                       ? comm_all_reduce_bytes(lay->P, (size_t)N * lay->Cl, sizeof(float))
                       : (uint64_t)(lay->P - 1) * N * (lay->Cl / lay->P) * sizeof(float);
    return stats + out;
}

// ---- the decode step's arithmetic per output (HD) --------------------------------------------
// The score of a (row, head) against local position l: dot(q, k) / sqrt(hs) (R2 over hs, as
// one rank; scale the 1/sqrt(hs)), q the row's q of the head, k read through the row's table
// on this rank at channel offset kc (h hs) of the position's k | v row.
HD float kvp_score(const float* q, const float* kv, long block_stride, const int* table, int l, int bs, int Cl, int kc,
                   int hs, float scale) {
    return canon_dot(q, 1, kv + paged_kv_slot(table, block_stride, l, bs, Cl) + kc, 1, hs) * scale;
}

// The max of a (row, head)'s n scores, in position order (exact in any order: R5).
HD float kvp_max(const float* s, int n) {
    float m = -canon_inf();
    for (int l = 0; l < n; l++) {
        if (s[l] > m) { m = s[l]; }
    }
    return m;
}

// The positions of half `half` (0 low, 1 high) of zig-zag chunk c of T that a row at position
// t attends to: [*b, *e), the half clipped at t (empty past it).
HD void kvp_chunk_half(int T, int c, int half, int t, long* b, long* e) {
    canon_zz_half(T, CANON_R, c, half, b, e);
    if (*e > (long)t + 1) { *e = (long)t + 1; }
}

// One (row, head) at position t: the exps of its n = canon_zz_count_le(t) scores s (by local
// position, in place: e = exp(s - m)), and this rank's subtree of the chunk sums of Z: rank r
// holds chunks [r 8/P, (r+1) 8/P) of the 8 zig-zag chunks of T, each summed in position order.
HD float kvp_exps_zsum(float* s, float m, int t, int T, int P, int rank) {
    int per_rank = CANON_R / P, chunk0 = rank * per_rank, n = canon_zz_count_le(t, T, P, rank);
    for (int l = 0; l < n; l++) { s[l] = canon_expf(s[l] - m); }
    float chunk_sum[CANON_R];
    for (int c = 0; c < per_rank; c++) {
        float acc = 0.0f;
        for (int half = 0; half < 2; half++) {
            long b, e;
            kvp_chunk_half(T, chunk0 + c, half, t, &b, &e);
            for (long p = b; p < e; p++) { acc = acc + s[kvp_local_of((int)p, T, P, rank)]; }
        }
        chunk_sum[c] = acc;
    }
    return canon_tree_sum(chunk_sum, per_rank, 1);
}

// One output channel d (of head h's hs) of a (row, head) at position t: this rank's subtree of
// the chunk sums, each from 0.0f in position order, of fmaf(e / z, v[d], acc); e the row's
// exps by local position, v read through the row's table on this rank at channel offset vc
// (Cl + h hs + d) of each position's k | v row.
HD float kvp_value(const float* e_row, float z, int t, int T, int P, int rank, const float* kv, long block_stride,
                   const int* table, int bs, int Cl, int vc) {
    int per_rank = CANON_R / P, chunk0 = rank * per_rank;
    float chunk_sum[CANON_R];
    for (int c = 0; c < per_rank; c++) {
        float acc = 0.0f;
        for (int half = 0; half < 2; half++) {
            long b, e;
            kvp_chunk_half(T, chunk0 + c, half, t, &b, &e);
            for (long p = b; p < e; p++) {
                int l = kvp_local_of((int)p, T, P, rank);
                acc = fmaf(e_row[l] / z, kv[paged_kv_slot(table, block_stride, l, bs, Cl) + vc], acc);
            }
        }
        chunk_sum[c] = acc;
    }
    return canon_tree_sum(chunk_sum, per_rank, 1);
}

// Where output channel c (of Cl) of row r goes among the partials: (N, Cl), or for the
// reduce-scatter by heads (P, N, Cl/P), block s the heads rank s gets.
HD long kvp_partial_at(KVPCombine combine, int P, int N, int Cl, int r, int c) {
    if (combine == KVP_COMBINE_ALL_REDUCE) { return (long)r * Cl + c; }
    int Cs = Cl / P;
    return ((long)(c / Cs) * N + r) * Cs + c % Cs;
}

// ---- the kernels: the CPU's here, the device's in llmc/kernels_kvp_det.cuh (included with
// LLMC_DEVICE_KERNELS defined) -----------------------------------------------------------------
// Every argument in the layout's memory but the layout itself: q (row r's q of this rank's
// heads at q + r q_stride, Cl floats), kv one layer's view of this rank's cache (block_stride
// apart), tables (N, max_blocks) each row's block table on this rank, pos (N) each row's
// position. Declared here so that a set that misses one does not build.
// scores (N, NHl, T/P) by local position <= pos[r], maxes (N, NHl) their max
static void kvp_scores(const KVPLayout* lay, float* scores, float* maxes, const float* q, long q_stride,
                       const float* kv, long block_stride, const int* tables, int max_blocks, const int* pos, int N);
// scores -> exps in place; zsum (N, NHl) this rank's subtree of Z (kvp_exps_zsum)
static void kvp_exps(const KVPLayout* lay, float* scores, float* zsum, const float* maxes, const int* pos, int N);
// partials (kvp_partial_at) = this rank's subtree of each output (kvp_value)
static void kvp_values(const KVPLayout* lay, float* partials, const float* scores, const float* zsum, const float* kv,
                       long block_stride, const int* tables, int max_blocks, const int* pos, int N);

#ifndef LLMC_DEVICE_KERNELS
static void kvp_scores(const KVPLayout* lay, float* scores, float* maxes, const float* q, long q_stride,
                       const float* kv, long block_stride, const int* tables, int max_blocks, const int* pos, int N) {
    int NHl = lay->NHl, hs = lay->hs, local_len = lay->T / lay->P;
    float scale = canon_rsqrtf((float)hs);
    for (int r = 0; r < N; r++) {
        int n = canon_zz_count_le(pos[r], lay->T, lay->P, lay->rank);
        for (int h = 0; h < NHl; h++) {
            float* s = scores + ((size_t)r * NHl + h) * local_len;
            for (int l = 0; l < n; l++) {
                s[l] = kvp_score(q + r * q_stride + h * hs, kv, block_stride, tables + (size_t)r * max_blocks, l, lay->bs,
                                 lay->Cl, h * hs, hs, scale);
            }
            maxes[(size_t)r * NHl + h] = kvp_max(s, n);
        }
    }
}

static void kvp_exps(const KVPLayout* lay, float* scores, float* zsum, const float* maxes, const int* pos, int N) {
    int NHl = lay->NHl, local_len = lay->T / lay->P;
    for (int r = 0; r < N; r++) {
        for (int h = 0; h < NHl; h++) {
            size_t rh = (size_t)r * NHl + h;
            zsum[rh] = kvp_exps_zsum(scores + rh * local_len, maxes[rh], pos[r], lay->T, lay->P, lay->rank);
        }
    }
}

static void kvp_values(const KVPLayout* lay, float* partials, const float* scores, const float* zsum, const float* kv,
                       long block_stride, const int* tables, int max_blocks, const int* pos, int N) {
    int Cl = lay->Cl, hs = lay->hs, local_len = lay->T / lay->P;
    for (int r = 0; r < N; r++) {
        for (int c = 0; c < Cl; c++) {
            size_t rh = (size_t)r * lay->NHl + c / hs;
            partials[kvp_partial_at(lay->combine, lay->P, N, Cl, r, c)] =
                kvp_value(scores + rh * local_len, zsum[rh], pos[r], lay->T, lay->P, lay->rank, kv, block_stride,
                          tables + (size_t)r * max_blocks, lay->bs, Cl, Cl + c);
        }
    }
}
#endif

// Decode attention of N query rows of different requests over the KVP group g (lay->P ranks,
// in lay->rank order), each row against its request's keys at positions <= pos[r]; every
// buffer in the layout's memory (the kernels' arguments above).
//   out: KVP_COMBINE_ALL_REDUCE (N, Cl); KVP_COMBINE_REDUCE_SCATTER (N, Cl/P), this rank's heads
// Every rank of the group calls it with the same N and pos.
static inline void kvp_attention_decode(KVPLayout* lay, CommGroup* g, float* out, const float* q, long q_stride,
                                        const float* kv, long block_stride, const int* tables, int max_blocks,
                                        const int* pos, int N) {
    int P = lay->P, NHl = lay->NHl, Cl = lay->Cl;
    if (g->size != P || g->rank != lay->rank) { fatal("KVP: group of %d ranks (rank %d) for a layout of %d (rank %d)", g->size, g->rank, P, lay->rank); }
    if (N > lay->cap_rows) {
        kvp_free(lay);
        lay->partials = mem_floats(lay->mem, (size_t)N * Cl, "KVP partials");
        lay->stats = mem_floats(lay->mem, 2 * (size_t)N * NHl, "KVP max and Z");
        lay->scores = mem_floats(lay->mem, (size_t)N * NHl * (lay->T / P), "KVP scores");
        lay->cap_rows = N;
    }
    float* maxes = lay->stats;                      // (N, NHl)
    float* zsum = lay->stats + (size_t)N * NHl;     // (N, NHl)

    // 1. scores of the rank's keys at positions <= t (its first n local positions, kvp_reserve)
    //    and their max per (row, head); the max over the KVP group: exact in any order
    kvp_scores(lay, lay->scores, maxes, q, q_stride, kv, block_stride, tables, max_blocks, pos, N);
    comm_all_reduce_max(g, maxes, (size_t)N * NHl, COMM_KIND_CP);

    // 2. exps and this rank's subtree of the chunk sums of Z; Z = R1 over the group's ranks in
    //    rank order of their subtrees: one rank's tree of 8
    kvp_exps(lay, lay->scores, zsum, maxes, pos, N);
    comm_all_reduce_sum(g, zsum, (size_t)N * NHl, COMM_KIND_CP);

    // 3. this rank's subtree of the chunk sums of (e/Z) v, laid out for the combine
    kvp_values(lay, lay->partials, lay->scores, zsum, kv, block_stride, tables, max_blocks, pos, N);

    // 4. the output: R1 over the group's ranks of the subtrees
    if (lay->combine == KVP_COMBINE_ALL_REDUCE) {
        // every rank gets o for all of its heads: all-reduce on (N, Cl)
        comm_all_reduce_sum(g, lay->partials, (size_t)N * Cl, COMM_KIND_CP);
        lay->mem->copy(out, lay->partials, sizeof(float) * (size_t)N * Cl);
    } else {
        // rank s gets heads [s*NHl/P, (s+1)*NHl/P): the partials (P, N, Cl/P), reduce-scattered
        comm_reduce_scatter(g, lay->partials, out, (size_t)N * (Cl / P), COMM_KIND_CP);
    }
}

#endif // LLMC_KV_PARALLEL_H
