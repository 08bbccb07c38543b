/*
 * memory.h: the memory the model's tensors live in, as a table of operations.
 *
 * The shared engine (engine.h), ZeRO (zero.h) and the communicator (comm.h) are written once
 * and run in both builds. They never touch a parameter, gradient, optimizer-state or activation
 * buffer directly: they allocate, copy, fill and do their little arithmetic through a MemOps
 * table, which is host code in the CPU build (memory_host, below) and device code in the CUDA
 * build (llmc/device_memory.cuh). So ZeRO's unit and shard logic, the microbatch gradient tree
 * and the collectives' canonical order are one piece of code, and the work runs where the data
 * lives.
 *
 * The arithmetic is canonical.h's: add is one IEEE addition per element (the merge step of the
 * R1 trees: the microbatch tree, the tied embedding's two halves), tree_rows the R1 tree over
 * the rows of a buffer (the local half of a reduce-scatter over ranks), sumsq the exact sum of
 * squares (R6), adamw adamw.h's update of each element, to_bf16 the rounding of fast mode's
 * bf16 weights from their fp32 master parameters (zero.h). The device versions perform the same
 * operations on each element, so the bits are the same.
 */
#ifndef LLMC_MEMORY_H
#define LLMC_MEMORY_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/adamw.h"
#include "llmc/canonical.h"
#include "llmc/utils.h"

typedef struct MemOps {
    const char* name;                                        // "host" or "device", for messages
    void* (*alloc)(size_t bytes, const char* what);          // contents undefined; fatal if out of memory
    void (*release)(void* p);                                // NULL is fine
    void (*copy)(void* dst, const void* src, size_t bytes);  // both in this memory
    void (*to_host)(void* host_dst, const void* src, size_t bytes);
    void (*from_host)(void* dst, const void* host_src, size_t bytes);
    void (*fill)(float* dst, float value, size_t n);
    void (*add)(float* out, const float* a, const float* b, size_t n);   // out = a + b (may alias)
    // out[i] = R1 tree over rows r < nrows of rows[r * len + i] (rows may be overwritten)
    void (*tree_rows)(float* rows, size_t len, int nrows, float* out);
    void (*sumsq)(SumSq* total, const float* x, size_t n);             // total += exact sum of x^2
    void (*adamw)(float* p, float* m, float* v, const float* g, size_t n, const AdamWStep* s,
                  float weight_decay);
    void (*to_bf16)(uint16_t* dst, const float* src, size_t n);         // dst = canon_bf16_bits(src)
    int (*holds)(const void* p);     // 1 if p points into this memory and the host cannot read it
    void (*sync)(void);              // waits until every queued operation is done (timing)
} MemOps;

// Typed helpers: sizes in floats, as the callers think of them.
static inline float* mem_floats(const MemOps* mem, size_t n, const char* what) {
    return (float*)mem->alloc(n * sizeof(float), what);
}

// ------------------------------------------------------------------------------------------
// host memory (the CPU build, and every host-only buffer of the CUDA build)

static inline void* host_alloc(size_t bytes, const char* what) {
    return aligned_calloc_or_die(bytes ? bytes : 1, what);
}
static inline void host_release(void* p) { free(p); }
static inline void host_copy(void* dst, const void* src, size_t bytes) {
    if (bytes) { memmove(dst, src, bytes); }
}
static inline void host_fill(float* dst, float value, size_t n) {
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) { dst[i] = value; }
}
static inline void host_add(float* out, const float* a, const float* b, size_t n) {
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) { out[i] = a[i] + b[i]; }
}
// The tree is walked once for all i together: a stack of partial rows, merged in place
// (left += right) as canon_tree_merges_after says, the root's merge written into out. Each
// element sees exactly the additions of canon_tree_sum over its column, in the same order.
static inline void host_tree_rows(float* rows, size_t len, int nrows, float* out) {
    if (nrows == 1) { memmove(out, rows, len * sizeof(float)); return; }
    float* stack[64];
    int top = 0;
    for (int r = 0; r < nrows; r++) {
        stack[top++] = rows + (size_t)r * len;
        for (int m = canon_tree_merges_after(r, nrows); m > 0; m--) {
            float* right = stack[--top];
            float* left = stack[--top];
            float* dst = (top == 0 && r == nrows - 1) ? out : left;
            for (size_t i = 0; i < len; i++) { dst[i] = left[i] + right[i]; }
            stack[top++] = dst;
        }
    }
}
// Each thread sums a contiguous part exactly; the parts' integer digits are merged (exact, so
// the split does not matter).
static inline void host_sumsq(SumSq* total, const float* x, size_t n) {
    #pragma omp parallel
    {
        int threads = 1, t = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        size_t begin = n * t / threads, end = n * (t + 1) / threads;
        SumSq mine;
        canon_sumsq_init(&mine);
        canon_sumsq_add_array(&mine, x + begin, end - begin);
        #pragma omp critical
        canon_sumsq_merge(total, &mine);
    }
}
static inline void host_adamw(float* p, float* m, float* v, const float* g, size_t n,
                              const AdamWStep* s, float weight_decay) {
    AdamWStep st = *s;
    // elementwise and exact in every lane (IEEE division and sqrt), so vectorised
    #pragma omp parallel for simd
    for (size_t i = 0; i < n; i++) { adamw_update_elem(&p[i], &m[i], &v[i], g[i], &st, weight_decay); }
}
static inline void host_to_bf16(uint16_t* dst, const float* src, size_t n) {
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) { dst[i] = canon_bf16_bits(src[i]); }
}
static inline int host_holds(const void* p) { (void)p; return 0; }
static inline void host_sync(void) {}

static const MemOps memory_host = {
    "host", host_alloc, host_release, host_copy, host_copy, host_copy, host_fill, host_add,
    host_tree_rows, host_sumsq, host_adamw, host_to_bf16, host_holds, host_sync
};

#endif // LLMC_MEMORY_H
