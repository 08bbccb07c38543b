/*
 * paged_kv.h: the serving engine's KV cache in fixed blocks (vLLM's PagedAttention layout).
 *
 * The cache is num_blocks blocks of block_size positions; a block holds, for every layer, the
 * key and value rows (C each) of its positions: data (num_blocks, L, block_size, 2C). A request
 * owns a block table (its blocks in position order: position p lives in slot p % block_size
 * of block table[p / block_size]); free blocks sit on a stack, so allocation order is the same
 * on every run. A table grows whole blocks at a time, all or nothing, so a request either gets
 * the room it asked for or keeps what it had (the scheduler then preempts, serve_engine.h).
 */
#ifndef LLMC_PAGED_KV_H
#define LLMC_PAGED_KV_H

#include <stddef.h>
#include <stdlib.h>
#include "llmc/canonical.h"
#include "llmc/memory.h"
#include "llmc/utils.h"

typedef struct {
    int num_blocks, block_size, L, C;
    const MemOps* mem;   // where data lives: the model's memory (host, or the GPU's)
    float* data;      // (num_blocks, L, block_size, 2C)
    int* free_stack;  // the free blocks; the top is handed out next
    int num_free;
} PagedKV;

typedef struct {
    int* blocks;      // in position order
    int n, cap;
} BlockTable;

static inline void paged_kv_init(PagedKV* kv, const MemOps* mem, int num_blocks, int block_size, int L, int C) {
    kv->mem = mem;
    kv->num_blocks = num_blocks;
    kv->block_size = block_size;
    kv->L = L;
    kv->C = C;
    kv->data = mem_floats(mem, (size_t)num_blocks * L * block_size * 2 * C, "KV cache");
    kv->free_stack = (int*)malloc_or_die(sizeof(int) * (size_t)num_blocks, "KV cache free list");
    for (int i = 0; i < num_blocks; i++) { kv->free_stack[i] = num_blocks - 1 - i; }   // block 0 on top
    kv->num_free = num_blocks;
}

static inline void paged_kv_free(PagedKV* kv) {
    kv->mem->release(kv->data);
    free(kv->free_stack);
}

// floats from one block to the next, for one layer's view (kv->data + layer offset)
static inline long paged_kv_block_stride(const PagedKV* kv) { return (long)kv->L * kv->block_size * 2 * kv->C; }

// layer l's view of the cache: position slot s of block b is at + b * block_stride + s * 2C
static inline float* paged_kv_layer(const PagedKV* kv, int l) {
    return kv->data + (size_t)l * kv->block_size * 2 * kv->C;
}

// Where position p's row (k | v, 2C floats) is in a layer's view of a cache of blocks of bs
// positions, block_stride apart, through a request's block table (HD: the host's kernels and
// the device's read it too).
HD long paged_kv_slot(const int* table, long block_stride, int p, int bs, int C) {
    return table[p / bs] * block_stride + (long)(p % bs) * 2 * C;
}

// bytes of one block: fp32 keys and values (2) of every layer (L) for block_size positions of
// C channels (this rank's: C/tp under tensor parallelism): 2 x L x block_size x C x 4, so a
// memory budget of B bytes holds floor(B / that) blocks (serve_gpt2 --kv-memory)
static inline size_t paged_kv_block_bytes(int L, int block_size, int C) {
    return (size_t)2 * L * block_size * C * sizeof(float);
}

static inline int paged_kv_blocks_for(const PagedKV* kv, int positions) {
    return (positions + kv->block_size - 1) / kv->block_size;
}

// Grows the table to hold `positions` positions: 1 when done, 0 (table unchanged) when the
// free list has too few blocks.
static inline int block_table_reserve(PagedKV* kv, BlockTable* bt, int positions) {
    int need = paged_kv_blocks_for(kv, positions) - bt->n;
    if (need <= 0) { return 1; }
    if (need > kv->num_free) { return 0; }
    if (bt->n + need > bt->cap) {
        bt->cap = bt->n + need > 2 * bt->cap ? bt->n + need : 2 * bt->cap;
        bt->blocks = (int*)realloc(bt->blocks, sizeof(int) * (size_t)bt->cap);
        if (!bt->blocks) { fatal("out of memory: a block table of %d blocks", bt->cap); }
    }
    for (int i = 0; i < need; i++) { bt->blocks[bt->n++] = kv->free_stack[--kv->num_free]; }
    return 1;
}

// Returns every block of the table to the free list (last block first, so a request that
// reserves the same room again gets the same blocks).
static inline void block_table_release(PagedKV* kv, BlockTable* bt) {
    for (int i = bt->n - 1; i >= 0; i--) { kv->free_stack[kv->num_free++] = bt->blocks[i]; }
    bt->n = 0;
}

static inline void block_table_free(BlockTable* bt) {
    free(bt->blocks);
    bt->blocks = NULL;
    bt->n = bt->cap = 0;
}

#endif // LLMC_PAGED_KV_H
