/*
 * serve_kvp.h: Helix's KV parallelism in the server (`mpirun -np P*K serve_gpt2 --kvp P --tp
 * K [--ep Q]`, with --pp S on S*P*K ranks: each stage such a pool, llmc/serve_pipeline.h): each
 * request's KV cache cut along its positions over the P ranks of a KVP group, each
 * rank attending with all of its query heads over the positions it holds, the partials combined
 * into one rank's bits (llmc/kv_parallel.h, which says why they are the same bits).
 *
 * THE LAYOUT: the trainer's grid with a context-parallel dimension (comm_setup_grid_cp(tp, P,
 * 1): tensor parallel fastest, then KVP): the comm's cp group of a rank is its KVP group (the P
 * ranks of its tensor-parallel coordinate), and there are K such groups, one per slice of the
 * heads. The model's own context parallelism (the trainer's, over one sequence's rows) stays
 * one rank: a serving step's rows are all whole. Helix's two layouts of one pool of P x K ranks:
 *   attention:  rank (kvp r, tp t) attends with its tp slice's NH/K heads (qkv column-parallel
 *               over the tp group, replicated over the KVP group) over the positions
 *               kv_parallel.h deals kvp rank r (zig-zag stretches r and 2P-1-r of maxT, whole
 *               blocks: not Helix's round-robin blocks, which cannot be exact); the combine is
 *               kv_parallel.h's reduce-scatter (KVP_COMBINE_REDUCE_SCATTER, over the KVP group)
 *               that leaves the rank the output of heads [r NH/(K P), (r+1) NH/(K P)) of its tp
 *               slice's: channel slice t*P + r of C/(P K) channels.
 *   after it:   the output projection (row-parallel) and the MLP (fc column-parallel, fcproj
 *               row-parallel; in an expert layer each expert's) tensor-parallel over all P x K
 *               ranks (the tp_ffn group, serve_kvp_ffn_group, ranked by that slice t*P + r: the
 *               rank holds attprojw's columns of its heads and 4C/(P K) of the MLP's): weights
 *               per rank 1/(P K) of them. Each row-parallel sum is canonical.h's R2 tree over 8
 *               chunks of its inputs, a rank's 8/(P K) chunks its subtree, so P x K | 8 and the
 *               all-reduce over the tp_ffn group (the R1 tree in slice order) finish the one-rank
 *               bits (tensor_parallel.h EXACTNESS). Every rank then has the layer's whole output
 *               rows, as the next layer's qkv (and the head) need them.
 *   the head:   vocabulary-parallel over the tp group as without KVP, replicated over the KVP
 *               group (as are the embeddings and the layernorms).
 *   --ep Q:     Helix's FFN as TP x EP on the same ranks (Q dividing P x K): slice f is rank
 *               f % Q of the ep group of the slices with the same f / Q (serve_kvp_expert_
 *               groups); the experts are dealt over it (E/Q each), each expert's fc and fcproj
 *               cut over the P x K / Q slices with the same f % Q (the exp group, ranked by
 *               f / Q; TPCut.exp_K). With Q = P that is EP over the KVP group and the experts
 *               cut over the tp group. Every rank holds the layer's whole rows, so each ep rank
 *               runs the experts on its share of them (train_gpt2.c moe_forward_layer), then
 *               the shares are all-gathered over the ep group. Without --ep an expert model's
 *               experts are all on every rank, each cut over the pool.
 * The attention's kernels run where the cache lives: kv_parallel.h's CPU loops (serve_gpt2),
 * llmc/kernels_kvp_det.cuh on the GPU (serve_gpt2cu); the keys and values a rank holds are
 * stored by the engine's own copy (serve_engine.h serve_forward's runs, serve_kvp_slot).
 *
 * THE CACHE: --kv-blocks B counts the blocks of all P ranks together; each rank's cache holds
 * B/P blocks of its heads (C/K channels of keys and values per position): 1/P of a one-rank
 * (--tp K) cache. World rank 0's scheduler alone hands blocks out: it keeps the P ranks' free
 * lists (pools, bookkeeping only), and a request's BlockTable holds its P per-rank tables laid
 * out (P, maxT/(P*bs)) (-1: no block), each rank's a prefix of its local positions as
 * kvp_reserve grows it. A step's row tables are these (the step broadcast sends them as it
 * sends one rank's: maxT/bs ints a row), and every rank reads its own part: the free lists are
 * consistent because only one rank ever changes them. A request is admitted when every rank of
 * the group has room for its share (all or nothing), so the blocks used add up to the global
 * count; a short request (under maxT/(2P) positions) lives on kvp rank 0 alone, the price of
 * exactness (kv_parallel.h).
 *
 * THE TRAFFIC per step of N rows, per layer (an all-reduce of n floats over G ranks sends
 * 2(G-1)ceil(n/G)*4 bytes, a reduce-scatter of G x n floats (G-1)*n*4):
 *   cp (the KVP group's, kvp_step_bytes): the max and Z all-reduces of N*NH/K floats, the
 *        output's reduce-scatter of P x N*C/(P K) floats
 *   tp: the output projection's and fcproj's all-reduces of N*C floats over the P x K ranks
 *        (Megatron's g); the embedding's and the head's over the tp group as without KVP; with
 *        --ep the experts' over the exp group, of the rows the rank's experts received
 *   ep (--ep): serve_parallel.h's, over the pool's ep groups, for each rank's share of the rows
 * A decode step of one request (N = 1) gives the bytes per generated token: L x the per layer.
 */
#ifndef LLMC_SERVE_KVP_H
#define LLMC_SERVE_KVP_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/canonical.h"
#include "llmc/comm.h"
#include "llmc/kv_parallel.h"
#include "llmc/model.h"
#include "llmc/paged_kv.h"
#include "llmc/tensor_parallel.h"
#include "llmc/utils.h"

typedef struct {
    int P;              // the KVP group's ranks (1: one rank's cache, the rest unused)
    KVPLayout lay;      // this rank's place in its group, its heads
    CommGroup* group;   // the KVP group (the comm's cp group)
    int local_blocks;   // a request's blocks on one rank at most: maxT / (P * bs)
    PagedKV* pools;     // (P) the ranks' free lists as world rank 0's scheduler keeps them (no data)
} ServeKVP;

// Why --kvp P cannot serve this model with these flags, as one line naming the flag, or NULL.
// (The world's size is serve_layout_problem's to check.)
static inline const char* serve_kvp_problem(char* why, size_t n, int P, int tp, int ep, int block_size, long kv_blocks,
                                            const GPT2Config* c) {
    if (P == 1) { return NULL; }
    if (tp_problem(c, tp)) { return NULL; }   // --tp's own refusals are serve_layout_problem's
    if (kvp_problem(why, n, P, tp, c->max_seq_len, block_size, c->num_heads, KVP_COMBINE_REDUCE_SCATTER)) { return why; }
    if (CANON_R % (P * tp) != 0) {
        snprintf(why, n, "--kvp %d x --tp %d: the output projection and the MLP are cut over all %d ranks, expected "
                 "kvp x tp to divide %d (the canonical chunks of their sums)", P, tp, P * tp, CANON_R);
    } else if ((P * tp) % ep != 0) {
        snprintf(why, n, "--ep %d with --kvp %d x --tp %d: the experts are dealt over ep ranks of the pool of %d, "
                 "expected a divisor of %d", ep, P, tp, P * tp, P * tp);
    } else if (kv_blocks % P != 0) {
        snprintf(why, n, "--kv-blocks %ld with --kvp %d: expected a multiple of %d (each KVP rank holds 1/%d of "
                 "the blocks)", kv_blocks, P, P, P);
    } else {
        return NULL;
    }
    return why;
}

// The KVP state of a rank whose comm was set up for the layout (comm->cp: P); kv_blocks: the
// group's blocks together, bs the block size; the attention's workspace in mem (the cache's).
static inline void serve_kvp_init(ServeKVP* s, Comm* comm, const MemOps* mem, const GPT2Config* c, int kv_blocks,
                                  int bs) {
    memset(s, 0, sizeof(*s));
    s->P = comm->cp;
    if (s->P == 1) { return; }
    s->group = &comm->cp_group;
    kvp_init(&s->lay, s->P, comm->cp_rank, comm->tp_group.size, c->max_seq_len, bs, c->channels, c->num_heads,
             KVP_COMBINE_REDUCE_SCATTER);
    kvp_set_memory(&s->lay, mem);
    s->local_blocks = c->max_seq_len / (s->P * bs);
    s->pools = (PagedKV*)calloc_or_die((size_t)s->P, sizeof(PagedKV), "KVP free lists");
    for (int q = 0; q < s->P; q++) {
        PagedKV* pool = &s->pools[q];
        pool->num_blocks = pool->num_free = kv_blocks / s->P;
        pool->block_size = bs;
        pool->free_stack = (int*)malloc_or_die(sizeof(int) * (size_t)pool->num_blocks, "KVP free list");
        for (int i = 0; i < pool->num_blocks; i++) { pool->free_stack[i] = pool->num_blocks - 1 - i; }   // as paged_kv_init
    }
}

// This rank's slices of the model (tensor_parallel.h TPCut): the heads and the vocabulary of
// tp slice t, the output projection and the MLP of slice f = t*P + r of P x K (the heads the
// reduce-scatter leaves it); with --ep Q its experts' fc and fcproj of slice f / Q of P x K / Q
// (serve_kvp_expert_groups). Without KVP (comm->cp 1) the tp group's.
static inline TPCut serve_kvp_cut(const Comm* comm) {
    TPCut cut = tp_cut(comm->tp, comm->tp_rank);
    int Q = comm->cp > 1 ? comm->ep : 1;   // without KVP the ep groups are not in the pool
    cut.ffn_K = comm->tp * comm->cp;
    cut.ffn_r = comm->tp_rank * comm->cp + comm->cp_rank;
    cut.exp_K = cut.ffn_K / Q;
    cut.exp_r = cut.ffn_r / Q;
    return cut;
}

// --kvp with --ep Q (Helix's FFN as TP x EP on the pool): slice f of the pool is rank f % Q of
// the ep group of the slices with its f / Q (the experts dealt over it, expert_parallel.h), and
// holds slice f / Q of those experts' fc and fcproj (serve_kvp_ffn_groups). Collective over the
// world (after comm_setup_grid_cp; comm->dp is 1).
static inline void serve_kvp_expert_groups(Comm* comm, int Q) {
    comm_group_free(&comm->ep_group);
    comm_group_free(&comm->edp_group);
    comm->ep = Q;
    int f = serve_kvp_cut(comm).ffn_r, G = comm->tp * comm->cp;
    comm->ep_rank = f % Q;
    comm->edp_rank = 0;
    comm_group_init_single(&comm->edp_group, &comm->stats, comm->mem);   // no gradients: serving
#ifdef USE_MPI
    comm_split(comm, &comm->ep_group, comm->pp_rank * (G / Q) + f / Q, f % Q, "kvp ep");
#else
    fatal("--kvp %d: KV parallelism needs MPI", comm->cp);
#endif
    comm->ep_group.mem = comm->mem;
}

// The pool's P x K ranks as the group the output projection and the MLP are cut over, ranked
// by their slices (serve_kvp_cut): their g all-reduces over it; and the group each expert's fc
// and fcproj are cut over: the pool, or with --ep Q the Q-th of it holding the same experts
// (the same f % Q), ranked by f / Q. Collective over the world (comm->cp > 1; set up for the
// layout).
static inline void serve_kvp_ffn_groups(Comm* comm, CommGroup* ffn, CommGroup* exp) {
    comm_group_init_single(ffn, &comm->stats, comm->mem);
    comm_group_init_single(exp, &comm->stats, comm->mem);
#ifdef USE_MPI
    TPCut cut = serve_kvp_cut(comm);
    comm_split(comm, ffn, comm->pp_rank * comm->dp + comm->dp_rank, cut.ffn_r, "kvp x tp");
    if (comm->ep > 1) { comm_split(comm, exp, comm->pp_rank * comm->ep + comm->ep_rank, cut.exp_r, "kvp x tp / ep"); }
#else
    fatal("--kvp %d: KV parallelism needs MPI", comm->cp);
#endif
}

static inline void serve_kvp_free(ServeKVP* s) {
    if (s->P == 1) { return; }
    for (int q = 0; q < s->P; q++) { free(s->pools[q].free_stack); }
    free(s->pools);
    kvp_free(&s->lay);
}

// Rank q's part of a request's table: its blocks, a prefix of (local_blocks) entries.
static inline BlockTable serve_kvp_part(const ServeKVP* s, int* blocks, int q) {
    BlockTable part = {blocks + (size_t)q * s->local_blocks, 0, s->local_blocks};
    while (part.n < part.cap && part.blocks[part.n] >= 0) { part.n++; }
    return part;
}

// Grows every rank's part of a request's table to hold its share of positions [0, positions):
// 1 when done, 0 when a rank's free list is short (then no block was taken: a fresh table is
// only laid out, every part empty).
static inline int serve_kvp_reserve(ServeKVP* s, BlockTable* bt, int positions) {
    int width = s->P * s->local_blocks;
    if (bt->n == 0) {   // a fresh table (or one released): every rank's part empty
        if (bt->cap < width) {
            bt->blocks = (int*)realloc(bt->blocks, sizeof(int) * (size_t)width);
            if (!bt->blocks) { fatal("out of memory: a KVP block table of %d blocks", width); }
            bt->cap = width;
        }
        for (int i = 0; i < width; i++) { bt->blocks[i] = -1; }
        bt->n = width;
    }
    int bs = s->lay.bs;
    for (int q = 0; q < s->P; q++) {   // all or nothing: first whether every rank has room
        BlockTable part = serve_kvp_part(s, bt->blocks, q);
        int local = positions > 0 ? canon_zz_count_le(positions - 1, s->lay.T, s->P, q) : 0;
        if ((local + bs - 1) / bs - part.n > s->pools[q].num_free) { return 0; }
    }
    for (int q = 0; q < s->P; q++) {
        BlockTable part = serve_kvp_part(s, bt->blocks, q);
        int local = positions > 0 ? canon_zz_count_le(positions - 1, s->lay.T, s->P, q) : 0;
        block_table_reserve(&s->pools[q], &part, local);   // within part.cap: never reallocates
    }
    return 1;
}

// Every rank's blocks of a request back to its free list.
static inline void serve_kvp_release(ServeKVP* s, BlockTable* bt) {
    if (bt->n == 0) { return; }
    for (int q = 0; q < s->P; q++) {
        BlockTable part = serve_kvp_part(s, bt->blocks, q);
        block_table_release(&s->pools[q], &part);
    }
    bt->n = 0;
}

// Blocks held by requests, over the group's ranks.
static inline int serve_kvp_blocks_used(const ServeKVP* s) {
    int used = 0;
    for (int q = 0; q < s->P; q++) { used += s->pools[q].num_blocks - s->pools[q].num_free; }
    return used;
}

// Where a row at position p writes its key and value in a layer's view of this rank's cache
// (row_table: its request's P parts, serve_kvp_part), or -1: another rank of the group holds p.
static inline long serve_kvp_slot(const ServeKVP* s, const int* row_table, long block_stride, int p) {
    return kvp_slot(&s->lay, row_table + (size_t)s->lay.rank * s->local_blocks, block_stride, p);
}

// Layer l's attention step on the step's N rows (serve_engine.h serve_attend, which stored the
// keys and values this rank holds): qkv (N,3Cl) of this rank's heads -> atty (N,Cl/P), its
// share of them (the output projection's input slice); every row attends over the group
// (kv_parallel.h). row_tables (N, max_blocks): each row's request's P parts; every buffer in
// the cache's memory.
static inline void serve_kvp_attend(ServeKVP* s, const PagedKV* kv, int l, const float* qkv, float* atty,
                                    const int* row_pos, const int* row_tables, int max_blocks, int N) {
    kvp_attention_decode(&s->lay, s->group, atty, qkv, 3 * s->lay.Cl, paged_kv_layer(kv, l), paged_kv_block_stride(kv),
                         row_tables + (size_t)s->lay.rank * s->local_blocks, max_blocks, row_pos, N);
}

#endif // LLMC_SERVE_KVP_H
