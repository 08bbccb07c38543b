/*
 * serve_kvp.h: Helix's KV parallelism in the server (`mpirun -np P*K serve_gpt2 --kvp P --tp
 * K`): each request's KV cache cut along its positions over the P ranks of a KVP group, each
 * rank attending with all of its query heads over the positions it holds, the partials combined
 * into one rank's bits (llmc/kv_parallel.h, which says why they are the same bits).
 *
 * THE LAYOUT: the trainer's grid with a context-parallel dimension (comm_setup_grid_cp(tp, P,
 * 1): tensor parallel fastest, then KVP): the comm's cp group of a rank is its KVP group (the P
 * ranks of its tensor-parallel coordinate), and there are K such groups, one per slice of the
 * heads. The model's own context parallelism (the trainer's, over one sequence's rows) stays
 * one rank: a serving step's rows are all whole.
 *   attention:  rank (kvp r, tp t) attends with its tp slice's NH/K heads over the positions
 *               kv_parallel.h deals kvp rank r (zig-zag stretches r and 2P-1-r of maxT, whole
 *               blocks: not Helix's round-robin blocks, which cannot be exact); the combine is
 *               kv_parallel.h's all-reduce (KVP_COMBINE_ALL_REDUCE): every rank of the group
 *               has the attention output of its heads.
 *   after it:   the output projection, the MLP and the head run tensor-parallel over the tp
 *               group as without KVP, replicated over the P ranks of the KVP group (the same
 *               rows, the same slices: no traffic of their own; Helix's own layout would cut
 *               them over all P*K ranks, reduce-scattering the attention output instead). The
 *               replication costs P copies of each tp slice of the weights, not bytes on the
 *               wire.
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
 * THE TRAFFIC per step of N rows (COMM_KIND_CP, over the KVP group, per layer; kvp_step_bytes):
 * the max and Z all-reduces of N*NH/K floats and the output all-reduce of N*C/K floats, an
 * all-reduce of n floats sending 2(P-1)ceil(n/P)*4 bytes. A decode step of one request (N = 1)
 * gives the bytes per generated token: L x kvp_step_bytes(1).
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
static inline const char* serve_kvp_problem(char* why, size_t n, int P, int ep, int block_size, long kv_blocks,
                                            const GPT2Config* c) {
    if (P == 1) { return NULL; }
#ifdef LLMC_DEVICE_KERNELS
    // the KVP attention (kv_parallel.h) is host code; serve_gpt2cu's cache is on the GPU
    snprintf(why, n, "--kvp %d: KV parallelism serves from serve_gpt2 (the CPU server) only (expected --kvp 1)", P);
    return why;
#else
    // (tp 1 here: --tp's own refusals are serve_layout_problem's; KVP works on any tp's heads)
    if (kvp_problem(why, n, P, 1, c->max_seq_len, block_size, c->num_heads, KVP_COMBINE_ALL_REDUCE)) { return why; }
    if (ep > 1) {
        snprintf(why, n, "--kvp %d with --ep %d: KV parallelism does not compose with expert parallelism yet "
                 "(expected --ep 1)", P, ep);
    } else if (kv_blocks % P != 0) {
        snprintf(why, n, "--kv-blocks %ld with --kvp %d: expected a multiple of %d (each KVP rank holds 1/%d of "
                 "the blocks)", kv_blocks, P, P, P);
    } else {
        return NULL;
    }
    return why;
#endif
}

// The KVP state of a rank whose comm was set up for the layout (comm->cp: P); kv_blocks: the
// group's blocks together, bs the block size.
static inline void serve_kvp_init(ServeKVP* s, Comm* comm, const GPT2Config* c, int kv_blocks, int bs) {
    memset(s, 0, sizeof(*s));
    s->P = comm->cp;
    if (s->P == 1) { return; }
    s->group = &comm->cp_group;
    kvp_init(&s->lay, s->P, comm->cp_rank, comm->tp_group.size, c->max_seq_len, bs, c->channels, c->num_heads,
             KVP_COMBINE_ALL_REDUCE);
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

static inline void serve_kvp_free(ServeKVP* s) {
    for (int q = 0; q < s->P && s->pools; q++) { free(s->pools[q].free_stack); }
    free(s->pools);
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

// Layer l's attention step on the step's N rows (serve_engine.h serve_attend): qkv (N,3Cl) of
// this rank's heads -> atty (N,Cl). Each row's new key and value go to this rank's cache if it
// holds their position; then every row attends over the group (kv_parallel.h). row_tables
// (N, max_blocks): each row's request's P parts.
static inline void serve_kvp_attend(ServeKVP* s, const PagedKV* kv, int l, const float* qkv, float* atty,
                                    const int* row_pos, const int* row_tables, int max_blocks, int N) {
    int Cl = s->lay.Cl, r0 = s->lay.rank * s->local_blocks;
    for (int r = 0; r < N; r++) {
        BlockTable mine = {(int*)row_tables + (size_t)r * max_blocks + r0, s->local_blocks, s->local_blocks};
        const float* k = qkv + (size_t)r * 3 * Cl + Cl;
        kvp_store((PagedKV*)kv, &mine, &s->lay, l, row_pos[r], k, k + Cl);
    }
    kvp_attention_decode(&s->lay, s->group, atty, qkv, 3 * Cl, paged_kv_layer(kv, l), paged_kv_block_stride(kv),
                         row_tables + r0, max_blocks, row_pos, N);
}

#endif // LLMC_SERVE_KVP_H
