/*
 * context_parallel.h: context parallelism (--cp N, --cp-mode ring | a2a): the positions of each
 * sequence are split over the N ranks of a context-parallel group, and the run trains bit for
 * bit the model one rank trains.
 *
 * THE LAYOUT (canonical.h R2Z; zigzag.h, shared with sequence parallelism). Rank r holds the
 * zig-zag slice of every sequence: stretches r and 2N-1-r of the 2N stretches of T/2N
 * positions (Megatron's load balance: under the causal mask every rank has the same attention
 * work), stored low stretch first, T/N positions (with --varlen R2Z's unequal pieces of a
 * length that is not a multiple of 2N: below).
 * Everything outside attention is per position, except the reductions over positions, and
 * those follow R2Z: a rank's positions are whole chunks (8/N of each sequence's 8), so it
 * computes each sequence's subtree and the group finishes it.
 *
 * ATTENTION, RING (the default). Queries stay; the keys and values of every rank's slice, a
 * block of T/N positions, travel around the group (rank r sends to r+1 and receives from r-1,
 * non-blocking, the next block in flight while the kernels work on the block in hand). The
 * one-rank attention's order is one a ring reproduces, because R2Z makes every block a complete
 * subtree of each reduction over keys: the row max is exact in any order, and Z and att@v
 * are R1 over the blocks (in rank order) of each block's R2Z subtree; no log-sum-exp
 * rescaling. So the forward makes two passes: the keys (scores of every block), the softmax
 * over all blocks, then the values (each block's subtree of att@v, the N subtrees summed by
 * R1). The backward: the values (datt of every block), the softmax backward (S over all
 * blocks), then the keys (dq's subtrees) with, per block, this rank's subtree over its queries
 * of dk and dv, sent to the block's owner, who sums the N ranks' partials by R1 over ranks.
 * Per layer and microbatch each rank sends (N-1) K and (N-1) V blocks forward, (N-1) V and
 * (N-1) K blocks backward and (N-1) dK|dV partial blocks: 6 (N-1) B (T/N) C floats (C this
 * rank's channels).
 *
 * ATTENTION, ALL-TO-ALL (Ulysses, --cp-mode a2a; N | the heads). An all-to-all turns the
 * sequence-split q, k, v into head-split ones (every position of the sequence, NH/N heads), the
 * one-rank attention runs on those heads, and an all-to-all turns the output back; the
 * backward likewise (dout in, dq|dk|dv out). Each head's arithmetic is the one-rank
 * arithmetic, so nothing about the order changes. 8 (N-1)/N B (T/N) C floats per layer.
 *
 * EVERYTHING ELSE. The weight and bias gradients of the layers and of the LM head: each
 * sequence's subtree (train_gpt2.c matmul_backward_seqs, layernorm_backward's partials),
 * finished over the group (cp_finish_sequences: a reduce-scatter of the B per-sequence
 * partials, R1 over the ranks, the R1 tree over sequences on each rank's part of the unit).
 * The embedding gradients: the input gradient is all-gathered along T and the one-rank
 * embedding backward runs on whole sequences. Either way rank r hands ZeRO its part r of the
 * unit's finished gradient and -0.0f elsewhere (cp_keep_part): ZeRO reduces over data x
 * context ranks (Megatron's grouping; zero.h), and since x + -0.0f == x for every x, the R1
 * tree over a data-parallel rank's context ranks is exactly its gradient, and the reduction
 * finishes the tree over the data-parallel ranks; the optimizer state and (ZeRO-3) the
 * parameters are sharded over data x context ranks. The loss: the per-position losses are
 * all-gathered along T and summed as one rank sums them, over the global token count.
 *
 * VARIABLE LENGTHS (--varlen: one sequence of its own length n per microbatch). A sequence of
 * n >= 2N positions is split over the group (zigzag.h zz_split_length). When 2N | n its 2N
 * stretches of n/2N are whole R2Z pieces of its own length (floor(r*(8/N)*n/16) == r*n/2N),
 * and the passes above run as for a fixed T = n. Any other n is cut into R2Z's own pieces of n
 * (floor division): rank r still holds chunks [r*8/N, (r+1)*8/N), its two stretches floor or
 * ceil of n/2N positions, so every rank computes about n/N of the sequence and its positions
 * are a complete subtree of every reduction over positions. The slices then differ in length
 * (canon_zz_len): the ring's blocks travel with their own lengths and sit at their own columns
 * of att (canon_zz_offset), the block kernels take their chunks from the slice
 * (canon_zz_slice_half), the all-to-alls and the gathers along T carry a count per rank, and
 * the bits are one rank's. (Padding would change n and so R2Z's pieces: other bits.) A sequence
 * shorter than 2N (a stretch would be empty) is not split: every rank of the group computes
 * it whole, as one rank does, and hands ZeRO its part of each gradient and -0.0f elsewhere
 * (cp_keep_part, as with the embedding's gradient), so the data x context reduction finishes
 * exactly one rank's tree, with no message. With sequence parallelism the tensor-parallel
 * ranks split a slice further only when 2 N tp | n (their collectives cut it evenly). The
 * buffers here and the model's activations hold the most positions a rank holds of any length
 * up to -t (zz_max_len), not a whole pass (train_gpt2.c pass_capacity).
 *
 * It drives llmc/kernels.h's kernels (the CPU set, or the device twins of kernels_det.cuh in
 * the CUDA build); the engine checks each step's bytes against cp_bytes_per_step (the end of
 * this file). Every buffer lives in the model's memory
 * (MemOps); the messages are comm.h's (staged through host memory, or NCCL, for device
 * buffers).
 */
#ifndef LLMC_CONTEXT_PARALLEL_H
#define LLMC_CONTEXT_PARALLEL_H

#include <stddef.h>
#include <stdint.h>
#include "llmc/canonical.h"
#include "llmc/comm.h"
#include "llmc/kernels.h"
#include "llmc/memory.h"
#include "llmc/model.h"
#include "llmc/tensor_parallel.h"
#include "llmc/utils.h"
#include "llmc/zigzag.h"

typedef struct {
    CommGroup* group;     // the context-parallel group (comm.h grid: cp_group)
    int N, rank, a2a;
    const MemOps* mem;
    size_t block_cap;     // the floats of the largest block (B, Tc, C), Tc = zz_max_len(T, N)
    float* kv[2];         // ring: the block in hand and the next one, (B, Tc, C) each
    float* parts;         // ring: N subtrees of an output (N, B, Tq, C); a2a: head-split buffers
    float* dkv;           // ring: this rank's dk|dv partials of every block (N, 2, B, Tc, C)
    float* dkv_in;        // ring: the partials for this rank's block from every rank (N, 2, B, Tq, C)
    float* ds;            // ring: the backward's ds (B, NH, Tc, T); a2a: unused
    float* gather;        // all-gathers along T, and cp_finish_sequences' reorder
    size_t gather_floats;
} ContextParallel;

// What keeps a run of (B, T) positions, C channels and NH heads per tensor-parallel rank from
// being split N ways (NULL: nothing); sp_degree: the tensor-parallel degree if sequence
// parallelism splits each rank's slice further, else 1.
static inline const char* cp_problem(int N, int a2a, int T, int NH, int sp_degree, char* buf, size_t cap) {
    if (N == 1) { return NULL; }
    if (N * sp_degree > CANON_R) {
        snprintf(buf, cap, "context x sequence parallelism splits each sequence %d ways, more than the 8 canonical "
                 "chunks (lower --cp or --tp)", N * sp_degree);
        return buf;
    }
    if (T % (2 * N * sp_degree) != 0) {
        snprintf(buf, cap, "the sequence length -t %d must be a multiple of 2 x %d (each of the %d slices of a "
                 "sequence is two stretches)", T, N * sp_degree, N * sp_degree);
        return buf;
    }
    if (a2a && NH % N != 0) {
        snprintf(buf, cap, "--cp-mode a2a gives each rank NH/cp heads: the %d heads per tensor-parallel rank are not a "
                 "multiple of --cp %d", NH, N);
        return buf;
    }
    return NULL;
}

// Buffers for passes over up to (B, T) positions, C channels and NH heads (this
// tensor-parallel rank's), in the model's memory.
// The group and the gathers' buffer of gather_floats alone: for a caller whose attention keeps
// its own buffers (fast mode's ring, kernels_fast_cp.cuh) and gathers only along T.
static inline void cp_init_gather(ContextParallel* cp, CommGroup* g, int a2a, const MemOps* mem, size_t gather_floats) {
    memset(cp, 0, sizeof(*cp));
    cp->group = g;
    cp->N = g->size;
    cp->rank = g->rank;
    cp->a2a = a2a;
    cp->mem = mem;
    if (cp->N == 1) { return; }
    cp->gather = mem_floats(mem, gather_floats, "context parallelism (gathers)");
    cp->gather_floats = gather_floats;
}

// The passes may split any length up to T (--varlen: R2Z's unequal pieces), so each rank's
// buffers hold the largest slice, Tc = zz_max_len(T, N) positions (max(T/N, 2N-1) for a T that
// is a multiple of 16); the gathers need the whole (B, T, C) and N copies of a slice beside it.
static inline void cp_init(ContextParallel* cp, CommGroup* g, int a2a, const MemOps* mem, int B, int T, int C,
                           int NH, size_t gather_floats) {
    size_t Tc = (size_t)zz_max_len(T, g->size), n = (size_t)B * Tc * C;
    size_t need = (size_t)B * T * C + g->size * n;
    cp_init_gather(cp, g, a2a, mem, need > gather_floats ? need : gather_floats);
    if (cp->N == 1) { return; }
    cp->block_cap = n;
    if (a2a) {
        cp->parts = mem_floats(mem, 8 * n, "context parallelism (all-to-all)");
    } else {
        cp->kv[0] = mem_floats(mem, n, "context parallelism (K/V blocks)");
        cp->kv[1] = mem_floats(mem, n, "context parallelism (K/V blocks)");
        cp->parts = mem_floats(mem, cp->N * n, "context parallelism (subtrees)");
        cp->dkv = mem_floats(mem, 2 * cp->N * n, "context parallelism (dK/dV partials)");
        cp->dkv_in = mem_floats(mem, 2 * cp->N * n, "context parallelism (dK/dV partials)");
        cp->ds = mem_floats(mem, (size_t)B * NH * Tc * T, "context parallelism (ds)");
    }
}

// The floats of rank s's block of a pass: its slice (B, canon_zz_len(T, N, s), C).
static inline size_t cp_block_floats(const ContextParallel* cp, int B, int T, int C, int s) {
    return (size_t)B * canon_zz_len(T, cp->N, s) * C;
}

static inline void cp_free(ContextParallel* cp) {
    const MemOps* mem = cp->mem;
    if (mem == NULL) { return; }
    float* all[] = {cp->kv[0], cp->kv[1], cp->parts, cp->dkv, cp->dkv_in, cp->ds, cp->gather};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) { mem->release(all[i]); }
    memset(cp, 0, sizeof(*cp));
}

// ------------------------------------------------------------------------------------------
// the ring

// Tags of the ring's messages (distinct per pass, so a late receive never matches the next
// pass's send): base + step.
enum { CP_TAG_K = 1000, CP_TAG_V = 2000, CP_TAG_BV = 3000, CP_TAG_BK = 4000, CP_TAG_DKV = 5000 };

// One pass around the ring over sequences of T positions, blocks of `width` floats a position
// (fast mode's: bf16 pairs): block (rank - i) mod N, that rank's slice of B x
// canon_zz_len(T, N, s) positions (its own length: R2Z's unequal pieces), is in kv[i % 2] at
// step i (this rank's own first, packed from the first `width` floats of each of src's rows,
// stride ld); fn(ctx, block, s) computes on it while the isend of it to the next rank and the
// irecv of the following block from the previous rank are in flight.
typedef void (*CpBlockFn)(void* ctx, const float* block, int s);
static inline void cp_ring_pass(ContextParallel* cp, float* const kv[2], const float* src, long ld, int B, int T,
                                int width, int tag, CpBlockFn fn, void* ctx) {
    int N = cp->N, r = cp->rank, next = (r + 1) % N, prev = (r + N - 1) % N;
    copy_rows(kv[0], width, src, ld, (long)B * canon_zz_len(T, N, r), width);
    CommRequest *send = NULL, *recv = NULL;
    for (int i = 0; i < N; i++) {
        float* cur = kv[i % 2];
        int s = (r - i + N) % N;
        comm_wait(recv);   // block i has landed in cur
        recv = NULL;
        comm_wait(send);   // kv[(i + 1) % 2] was sent at step i - 1: free again
        send = NULL;
        if (i < N - 1) {
            // irecv (cp group) of the next block, rank s - 1's, from the previous rank, isend
            // (cp group) of this one to the next rank
            size_t incoming = (size_t)B * canon_zz_len(T, N, (s + N - 1) % N) * width;
            recv = comm_irecv(cp->group, kv[(i + 1) % 2], incoming, prev, tag + i, COMM_KIND_CP);
            send = comm_isend(cp->group, cur, (size_t)B * canon_zz_len(T, N, s) * width, next, tag + i, COMM_KIND_CP);
        }
        fn(ctx, cur, s);
    }
    comm_wait(send);
}

typedef struct {
    ContextParallel* cp;
    float *att, *ds;
    const float *qkv, *dout;
    int B, T, C, NH;
    CommRequest** sends;   // the backward's dk|dv partials on their way to each block's owner
} CpAttention;

static inline void cp_fwd_scores(void* v, const float* kblk, int s) {
    CpAttention* a = (CpAttention*)v;
    attention_scores_block(a->att, a->qkv, kblk, a->B, a->T, a->C, a->NH, a->cp->N, a->cp->rank, s);
}
static inline void cp_fwd_values(void* v, const float* vblk, int s) {
    CpAttention* a = (CpAttention*)v;
    size_t n = cp_block_floats(a->cp, a->B, a->T, a->C, a->cp->rank);   // this rank's queries' rows
    attention_values_block(a->cp->parts + s * n, a->att, vblk, a->B, a->T, a->C, a->NH, a->cp->N, a->cp->rank, s);
}
static inline void cp_bwd_datt(void* v, const float* vblk, int s) {
    CpAttention* a = (CpAttention*)v;
    attention_datt_block(a->ds, a->dout, vblk, a->B, a->T, a->C, a->NH, a->cp->N, a->cp->rank, s);
}
// dq's subtree of block s, and this rank's dk|dv partials of block s's keys, on their way to
// the block's owner at once (this rank's own: straight into its slot of dkv_in)
static inline void cp_bwd_keys(void* v, const float* kblk, int s) {
    CpAttention* a = (CpAttention*)v;
    ContextParallel* cp = a->cp;
    int N = cp->N, r = cp->rank;
    size_t nq = cp_block_floats(cp, a->B, a->T, a->C, r), nk = cp_block_floats(cp, a->B, a->T, a->C, s);
    attention_dq_block(cp->parts + s * nq, a->ds, kblk, a->B, a->T, a->C, a->NH, N, r, s);
    float* mine = s == r ? cp->dkv_in + 2 * (size_t)r * nq : cp->dkv + 2 * (size_t)s * cp->block_cap;
    attention_dkv_block(mine, mine + nk, a->ds, a->att, a->qkv, a->dout, a->B, a->T, a->C, a->NH, N, r, s);
    // isend (cp group): the partials to block s's owner
    if (s != r) { a->sends[s] = comm_isend(cp->group, mine, 2 * nk, s, CP_TAG_DKV, COMM_KIND_CP); }
}

// out (B,Tq,C) and att (B,NH,Tq,T) of this rank's queries (T: the whole sequence; Tq =
// canon_zz_len(T, N, rank)).
static inline void cp_ring_forward(ContextParallel* cp, float* out, float* att, const float* qkv, int B, int T, int C,
                                   int NH) {
    int N = cp->N;
    CpAttention a = {cp, att, NULL, qkv, NULL, B, T, C, NH, NULL};
    cp_ring_pass(cp, cp->kv, qkv + C, 3L * C, B, T, C, CP_TAG_K, cp_fwd_scores, &a);
    attention_softmax_blocks(att, B, T, NH, N, cp->rank);
    cp_ring_pass(cp, cp->kv, qkv + 2 * C, 3L * C, B, T, C, CP_TAG_V, cp_fwd_values, &a);
    cp->mem->tree_rows(cp->parts, cp_block_floats(cp, B, T, C, cp->rank), N, out);   // R1 over the blocks' subtrees
}

// dqkv (B,Tq,3C) of this rank's positions from dout (B,Tq,C).
static inline void cp_ring_backward(ContextParallel* cp, float* dqkv, const float* dout, const float* qkv,
                                    const float* att, int B, int T, int C, int NH) {
    int N = cp->N, r = cp->rank;
    long Tq = canon_zz_len(T, N, r);
    size_t n = cp_block_floats(cp, B, T, C, r);
    CommRequest* send[CANON_R] = {NULL};
    CpAttention a = {cp, (float*)att, cp->ds, qkv, dout, B, T, C, NH, send};
    cp_ring_pass(cp, cp->kv, qkv + 2 * C, 3L * C, B, T, C, CP_TAG_BV, cp_bwd_datt, &a);
    attention_softmax_backward_blocks(cp->ds, att, B, T, C, NH, N, r);
    // every other rank's dk|dv partials of this rank's keys land in slot (their rank) of
    // dkv_in: irecv (cp group) posted before the pass, so no send waits for its receive
    CommRequest* recv[CANON_R] = {NULL};
    for (int q = 0; q < N; q++) {
        if (q != r) { recv[q] = comm_irecv(cp->group, cp->dkv_in + 2 * (size_t)q * n, 2 * n, q, CP_TAG_DKV, COMM_KIND_CP); }
    }
    cp_ring_pass(cp, cp->kv, qkv + C, 3L * C, B, T, C, CP_TAG_BK, cp_bwd_keys, &a);
    float* dq = cp->dkv + 2 * (size_t)r * cp->block_cap;   // this rank's own slot of dkv is free: dq lands there
    cp->mem->tree_rows(cp->parts, n, N, dq);
    copy_rows(dqkv, 3L * C, dq, C, (long)B * Tq, C);
    comm_wait_all(recv, N);
    // dk, dv: R1 over the ranks' partials (slot q: rank q's), each a (2, n) pair; the tree
    // runs over the k halves and the v halves at once (rows of 2n)
    cp->mem->tree_rows(cp->dkv_in, 2 * n, N, cp->parts);
    copy_rows(dqkv + C, 3L * C, cp->parts, C, (long)B * Tq, C);
    copy_rows(dqkv + 2 * C, 3L * C, cp->parts + n, C, (long)B * Tq, C);
    comm_wait_all(send, N);
}

// ------------------------------------------------------------------------------------------
// all-to-all (Ulysses)

// The head-split tensors of a pass: qkv_h (B,T,3C/N) and out_h (B,T,C/N) with every position,
// this rank's NH/N heads (channels [rank*C/N, (rank+1)*C/N) of q, k and v).

// The all-to-alls' counts: each rank's share of a pass laid out rank-major by slice (zz_reorder),
// `width` floats a position: rank d's B * canon_zz_len(T, N, d) * width floats (mine: every
// count this rank's own).
static inline void cp_a2a_counts(const ContextParallel* cp, int B, int T, int width, int mine, size_t* counts) {
    for (int d = 0; d < cp->N; d++) { counts[d] = (size_t)B * canon_zz_len(T, cp->N, mine ? cp->rank : d) * width; }
}

// qkv_h <- all-to-all (cp group) of every rank's slice of this rank's heads; out_h, att on
// those heads by the one-rank kernel; out (B,Tq,C) <- all-to-all back. qkv_h is kept for
// the backward (an activation). The slices may differ in length (R2Z's unequal pieces): an
// all-to-all with a count per rank.
static inline void cp_a2a_forward(ContextParallel* cp, float* out, float* att, float* qkv_h, const float* qkv, int B,
                                  int T, int C, int NH) {
    int N = cp->N, Cr = C / N;
    long Tq = canon_zz_len(T, N, cp->rank);
    size_t blk = (size_t)B * Tq * 3 * Cr, oblk = (size_t)B * Tq * Cr;   // this rank's slice of one rank's heads
    size_t mine[CANON_R] = {0}, theirs[CANON_R] = {0};
    float *send = cp->parts, *recv = cp->parts + 3 * cp->block_cap;
    for (int d = 0; d < N; d++) {
        for (int part = 0; part < 3; part++) {
            copy_rows(send + d * blk + part * Cr, 3L * Cr, qkv + (size_t)part * C + (size_t)d * Cr, 3L * C, (long)B * Tq, Cr);
        }
    }
    cp_a2a_counts(cp, B, T, 3 * Cr, 1, mine);
    cp_a2a_counts(cp, B, T, 3 * Cr, 0, theirs);
    comm_all_to_all_v(cp->group, send, mine, recv, theirs, COMM_KIND_CP);
    zz_reorder(cp->mem, qkv_h, recv, B, T, 3 * Cr, N, 0);
    float* out_h = send;   // (B,T,Cr)
    attention_forward(out_h, att, qkv_h, B, T, Cr, NH / N);
    zz_reorder(cp->mem, out_h, recv, B, T, Cr, N, 1);
    cp_a2a_counts(cp, B, T, Cr, 0, theirs);
    cp_a2a_counts(cp, B, T, Cr, 1, mine);
    comm_all_to_all_v(cp->group, recv, theirs, send, mine, COMM_KIND_CP);
    for (int d = 0; d < N; d++) { copy_rows(out + (size_t)d * Cr, C, send + d * oblk, Cr, (long)B * Tq, Cr); }
}

// dqkv (B,Tq,3C) from dout (B,Tq,C): dout to the heads (all-to-all), the one-rank backward
// on them, dq|dk|dv back (all-to-all).
static inline void cp_a2a_backward(ContextParallel* cp, float* dqkv, const float* dout, const float* qkv_h,
                                   const float* att, int B, int T, int C, int NH) {
    int N = cp->N, Cr = C / N;
    long Tq = canon_zz_len(T, N, cp->rank);
    size_t oblk = (size_t)B * Tq * Cr, blk = 3 * oblk;
    size_t mine[CANON_R] = {0}, theirs[CANON_R] = {0};
    float *a = cp->parts, *b = cp->parts + 3 * cp->block_cap, *dout_h = cp->parts + 6 * cp->block_cap;
    for (int d = 0; d < N; d++) { copy_rows(a + d * oblk, Cr, dout + (size_t)d * Cr, C, (long)B * Tq, Cr); }
    cp_a2a_counts(cp, B, T, Cr, 1, mine);
    cp_a2a_counts(cp, B, T, Cr, 0, theirs);
    comm_all_to_all_v(cp->group, a, mine, b, theirs, COMM_KIND_CP);
    zz_reorder(cp->mem, dout_h, b, B, T, Cr, N, 0);
    attention_backward(a, dout_h, qkv_h, att, B, T, Cr, NH / N);   // dqkv_h (B,T,3Cr)
    zz_reorder(cp->mem, a, b, B, T, 3 * Cr, N, 1);
    cp_a2a_counts(cp, B, T, 3 * Cr, 0, theirs);
    cp_a2a_counts(cp, B, T, 3 * Cr, 1, mine);
    comm_all_to_all_v(cp->group, b, theirs, a, mine, COMM_KIND_CP);
    for (int d = 0; d < N; d++) {
        for (int part = 0; part < 3; part++) {
            copy_rows(dqkv + (size_t)part * C + (size_t)d * Cr, 3L * C, a + d * blk + part * Cr, 3L * Cr, (long)B * Tq, Cr);
        }
    }
}

// ------------------------------------------------------------------------------------------
// the rest: gathers along T, and the per-sequence gradients finished over the group

// full (B,T,C) <- every rank's slice (B,Tq,C): all-gather (cp group), then each slice's
// positions put in place. Slices of unequal length (R2Z's unequal pieces; comm.h's all-gather
// takes equal blocks) go by an all-to-all with a count per rank of N copies of this rank's.
static inline void cp_gather_sequences(ContextParallel* cp, const float* slice, float* full, int B, int T, int C) {
    int N = cp->N;
    size_t n = (size_t)B * canon_zz_len(T, N, cp->rank) * C, all = (size_t)B * T * C;
    if (T % (2 * N) == 0) {
        if (all > cp->gather_floats) { fatal("internal: context-parallel gather of %zu floats", all); }
        comm_all_gather(cp->group, slice, cp->gather, n, COMM_KIND_CP);
    } else {
        if (all + N * n > cp->gather_floats) { fatal("internal: context-parallel gather of %zu floats", all + N * n); }
        size_t mine[CANON_R] = {0}, theirs[CANON_R] = {0};
        float* copies = cp->gather + all;
        for (int d = 0; d < N; d++) { cp->mem->copy(copies + d * n, slice, n * sizeof(float)); }
        cp_a2a_counts(cp, B, T, C, 1, mine);
        cp_a2a_counts(cp, B, T, C, 0, theirs);
        comm_all_to_all_v(cp->group, copies, mine, cp->gather, theirs, COMM_KIND_CP);
    }
    zz_reorder(cp->mem, full, cp->gather, B, T, C, N, 0);
}

// Rank r's part of a unit of n floats: [r*ceil(n/N), ...) clipped to n.
static inline void cp_part(const ContextParallel* cp, size_t n, size_t* lo, size_t* len) {
    size_t shard = (n + cp->N - 1) / cp->N;
    *lo = (size_t)cp->rank * shard > n ? n : (size_t)cp->rank * shard;
    *len = n - *lo < shard ? n - *lo : shard;
}

// x (n) keeps this rank's part; -0.0f elsewhere (a gradient every rank of the group computed
// whole, handed to ZeRO's data x context reduction once)
static inline void cp_keep_part(ContextParallel* cp, float* x, size_t n) {
    size_t lo, len;
    cp_part(cp, n, &lo, &len);
    cp->mem->fill(x, -0.0f, lo);
    cp->mem->fill(x + lo + len, -0.0f, n - lo - len);
}

// out (n): this rank's part = R1 over the B sequences of (R1 over the group's ranks of their
// partials[b] (B, n)), -0.0f elsewhere. Each rank finishes its part of every sequence's sum (a
// reduce-scatter, cp group: the R1 tree over ranks), then the tree over sequences on it
// (sequence_tree). partials is overwritten.
static inline void cp_finish_sequences(ContextParallel* cp, float* out, float* partials, int B, size_t n) {
    int N = cp->N;
    size_t shard = (n + N - 1) / N, need = (size_t)N * B * shard + (size_t)B * shard;
    if (need > cp->gather_floats) { fatal("internal: context-parallel gradient of %zu floats x %d sequences", n, B); }
    float* ranked = cp->gather;                        // (N, B, shard): rank r's columns of every sequence
    float* mine = ranked + (size_t)N * B * shard;      // (B, shard)
    for (int r = 0; r < N; r++) {
        size_t lo = (size_t)r * shard, len = lo >= n ? 0 : (n - lo < shard ? n - lo : shard);
        for (int b = 0; b < B; b++) {
            float* dst = ranked + ((size_t)r * B + b) * shard;
            cp->mem->copy(dst, partials + (size_t)b * n + lo, len * sizeof(float));
            cp->mem->fill(dst + len, 0.0f, shard - len);
        }
    }
    // reduce-scatter (cp group, gradients): rank r gets every sequence's finished columns
    comm_reduce_scatter(cp->group, ranked, mine, (size_t)B * shard, COMM_KIND_GRAD);
    sequence_tree(partials, mine, B, (int)shard);
    size_t lo, len;
    cp_part(cp, n, &lo, &len);
    cp->mem->copy(out + lo, partials, len * sizeof(float));
    cp_keep_part(cp, out, n);
}

// The bytes rank r sends over its context-parallel group of N ranks in one optimizer step of
// `microbatches` microbatches of B sequences of T positions, for a rank whose chunks hold
// `layers` transformer layers, the embeddings (has_embedding) and the head (has_head). Rank s's
// slice holds Ts = canon_zz_len(T, N, s) positions of a sequence (T/N when 2N | T), and per
// microbatch each layer sends, with the ring, every block but rank r+1's twice forward (K, V)
// and twice backward (V, K), B Ts (C/tp) floats each, and the dK|dV partials of every other
// rank's block (2 B Ts (C/tp) floats); with the all-to-all q|k|v and dout of its own slice of
// every other rank's heads and out and dq|dk|dv of every other rank's slice of its heads, 4 B
// (C/tp/N) floats a position; the embeddings' chunk all-gathers the embedding's gradient ((N-1)
// B Tr C elements), the head's chunk the per-position losses ((N-1) B Tr floats). With equal
// slices a layer's ring is 4 (N-1) K/V blocks and 2 (N-1) partial blocks, its all-to-all 8 (N-1)/N
// blocks, a block B (T/N) (C/tp) floats. elem_bytes: the bytes of an element of the K/V
// blocks, the all-to-alls' and the embedding's gradient (4: fp32, deterministic mode; 2: bf16,
// fast mode, kernels_fast_cp.cuh); the ring's dK|dV partials and the losses are fp32 in both.
static inline uint64_t cp_bytes_per_step(int N, int r, int a2a, int layers, int has_embedding, int has_head, int B,
                                         int T, int C, int tp, int microbatches, int elem_bytes) {
    uint64_t mine = (uint64_t)B * canon_zz_len(T, N, r), next = (uint64_t)B * canon_zz_len(T, N, (r + 1) % N);
    uint64_t all = (uint64_t)B * T, width = (uint64_t)(C / tp);
    uint64_t per_layer = a2a ? elem_bytes * 4 * ((N - 1) * mine + all - mine) * (width / N)
                             : elem_bytes * 4 * (all - next) * width + sizeof(float) * 2 * (all - mine) * width;
    uint64_t embedding = has_embedding ? elem_bytes * (uint64_t)(N - 1) * mine * C : 0;
    uint64_t losses = has_head ? sizeof(float) * (uint64_t)(N - 1) * mine : 0;
    return (layers * per_layer + embedding + losses) * (uint64_t)microbatches;
}

// The bytes a mixture-of-experts model adds to cp_bytes_per_step: each expert layer runs on
// whole sequences (train_gpt2.c moe_forward; fast mode's fast_moe_layer_forward), so per
// microbatch it all-gathers its input forward and its output's gradient backward, (N-1) B Tr C
// elements of elem_bytes each (Tr = canon_zz_len(T, N, r), this rank's slice; C whole: the
// layer's input is complete on every tensor-parallel rank).
static inline uint64_t cp_moe_bytes_per_step(int N, int r, int layers, int B, int T, int C, int microbatches,
                                             int elem_bytes) {
    return elem_bytes * 2 * (uint64_t)(N - 1) * B * canon_zz_len(T, N, r) * C * (uint64_t)layers *
           (uint64_t)microbatches;
}

// cp_bytes_per_step for a --varlen step: the sum over this rank's sequences (lengths[i], i <
// count) of one microbatch of B = 1, T = lengths[i] each, for those the context group splits
// (zz_split_length, K the sequence-parallel degree); a sequence every rank computes whole
// sends nothing. moe: a mixture-of-experts model (cp_moe_bytes_per_step too).
static inline uint64_t cp_bytes_per_varlen_step(int N, int K, int r, int a2a, int moe, int layers, int has_embedding,
                                                int has_head, const int* lengths, int count, int C, int tp) {
    uint64_t bytes = 0;
    for (int i = 0; i < count; i++) {
        int cp_split, seq_split;
        zz_split_length(N, K, lengths[i], &cp_split, &seq_split);
        if (cp_split > 1) {
            bytes += cp_bytes_per_step(N, r, a2a, layers, has_embedding, has_head, 1, lengths[i], C, tp, 1, sizeof(float));
            if (moe) { bytes += cp_moe_bytes_per_step(N, r, layers, 1, lengths[i], C, 1, sizeof(float)); }
        }
    }
    return bytes;
}

#endif // LLMC_CONTEXT_PARALLEL_H
