/*
 * zigzag.h: which positions of a sequence a rank holds when D ranks split it (canonical.h
 * R2Z), the one slicing that sequence parallelism (tensor_parallel.h) and context parallelism
 * (context_parallel.h) share. The T positions are cut into 2D stretches of T/2D; rank r holds
 * stretches r and 2D-1-r, stored as a slice of T/D positions, low stretch first. Under the
 * causal mask that gives every rank the same attention work (Megatron's load balance), and the
 * slice's positions are whole chunks of every reduction over positions, so a rank computes
 * each sequence's subtree and the group finishes it. A slice of a slice is a slice: context
 * rank c's slice split again K ways is the (c*K + k)-th of the D = N*K-way slices.
 */
#ifndef LLMC_ZIGZAG_H
#define LLMC_ZIGZAG_H

#include <stddef.h>
#include "llmc/canonical.h"
#include "llmc/memory.h"

// The first global position of stretch `half` (0: the low one, 1: the high one) of rank r's
// D-way slice of a sequence of T positions; each stretch is T/2D long.
static inline size_t zz_stretch_begin(int T, int D, int r, int half) {
    return (size_t)canon_zz_global((long)half * (T / (2 * D)), T, D, r);
}

// Whether D ranks split a sequence of n positions (--varlen, whose lengths vary): only when its
// 2D stretches are equal (2D | n), which makes them whole R2Z pieces of n (context_parallel.h,
// VARIABLE LENGTHS); else every rank computes the sequence whole.
static inline int zz_splits_length(int D, int n) { return D > 1 && n % (2 * D) == 0; }

// Copies rank r's slice (B, T/D, C) between B whole sequences (B, T, C) and its own buffer;
// `to_slice` picks the direction. Both buffers live in `mem`.
static inline void zz_copy_slice(const MemOps* mem, float* seqs, float* slice, int B, int T, int C, int D, int r,
                                 int to_slice) {
    size_t stretch = (size_t)T / (2 * D), Tl = (size_t)T / D;
    for (int b = 0; b < B; b++) {
        for (int half = 0; half < 2; half++) {
            float* seq = seqs + ((size_t)b * T + zz_stretch_begin(T, D, r, half)) * C;
            float* mine = slice + ((size_t)b * Tl + half * stretch) * C;
            if (to_slice) { mem->copy(mine, seq, stretch * C * sizeof(float)); }
            else { mem->copy(seq, mine, stretch * C * sizeof(float)); }
        }
    }
}

// Copies between the rank-major stack of all D slices (D, B, T/D, C) and the sequences in
// order (B, T, C): what an all-gather along T receives, and what a reduce-scatter along T sends.
static inline void zz_reorder(const MemOps* mem, float* seqs, float* slices, int B, int T, int C, int D,
                              int to_slices) {
    size_t n = (size_t)B * T / D * C;
    for (int r = 0; r < D; r++) { zz_copy_slice(mem, seqs, slices + r * n, B, T, C, D, r, to_slices); }
}

#endif // LLMC_ZIGZAG_H
