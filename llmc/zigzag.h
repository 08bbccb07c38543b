/*
 * zigzag.h: which positions of a sequence a rank holds when D ranks split it (canonical.h
 * R2Z), the one slicing that sequence parallelism (tensor_parallel.h) and context parallelism
 * (context_parallel.h) share. The T positions are cut into 2D stretches (T/2D each when 2D |
 * T; else R2Z's unequal pieces, canon_zz_stretch); rank r holds stretches r and 2D-1-r, stored
 * as a slice of canon_zz_len(T, D, r) positions, low stretch first. Under the causal mask that
 * gives every rank the same attention work, within a position or two (Megatron's load
 * balance), and the slice's positions are whole chunks of every reduction over positions, so a
 * rank computes each sequence's subtree and the group finishes it. A slice of a slice is a
 * slice when the stretches are equal: context rank c's slice split again K ways is the
 * (c*K + k)-th of the D = N*K-way slices.
 */
#ifndef LLMC_ZIGZAG_H
#define LLMC_ZIGZAG_H

#include <stddef.h>
#include "llmc/canonical.h"
#include "llmc/memory.h"

// The first global position of stretch `half` (0: the low one, 1: the high one) of rank r's
// D-way slice of a sequence of T positions.
static inline size_t zz_stretch_begin(int T, int D, int r, int half) {
    long begin, end;
    canon_zz_stretch(T, D, r, half, &begin, &end);
    return (size_t)begin;
}

// Whether D ranks split a sequence of n positions into equal stretches (2D | n): what sequence
// parallelism needs (its collectives cut each slice evenly, tensor_parallel.h).
static inline int zz_splits_length(int D, int n) { return D > 1 && n % (2 * D) == 0; }

// How a --varlen pass over a sequence of n positions is split (context_parallel.h, VARIABLE
// LENGTHS) over N context ranks whose tensor-parallel ranks split each slice K more ways with
// sequence parallelism (K = 1 without): *cp_split (N or 1) the context split, *seq_split the
// residual stream's. N x K equal stretches when 2NK | n (the fixed-T layout); else, with
// context parallelism, N slices in R2Z's pieces when n >= 2N (each stretch holds a position),
// the residual stream split no further; else whole on every rank.
static inline void zz_split_length(int N, int K, int n, int* cp_split, int* seq_split) {
    int equal = N * K > 1 && zz_splits_length(N * K, n);
    *cp_split = N > 1 && (equal || n >= 2 * N) ? N : 1;
    *seq_split = equal ? N * K : *cp_split;
}

// The ranks that split a pass's sequences: N context ranks, whose slices K tensor-parallel
// ranks split again with sequence parallelism (K = 1 without), and this rank's place among them.
typedef struct { int N, K, cp_rank, tp_rank; } ZzGroup;

// How a pass over sequences of n positions is split (by_length: zz_split_length's rule, for
// --varlen; else N x K ways, 2NK | n), and this rank's slices: of the per-position tensors
// canon_zz_len(n, cp_split, cp_rank) positions, of the residual stream canon_zz_len(n,
// seq_split, seq_rank).
typedef struct { int cp_split, seq_split, cp_rank, seq_rank; } ZzPass;
static inline ZzPass zz_pass(ZzGroup g, int n, int by_length) {
    ZzPass p;
    if (by_length) {
        zz_split_length(g.N, g.K, n, &p.cp_split, &p.seq_split);
    } else {
        p.cp_split = g.N;
        p.seq_split = g.N * g.K;
    }
    p.cp_rank = p.cp_split > 1 ? g.cp_rank : 0;
    p.seq_rank = p.seq_split > p.cp_split ? p.cp_rank * g.K + g.tp_rank : p.cp_rank;
    return p;
}

// The most positions rank r of a D-way split holds of a sequence of at most T positions run
// by zz_split_length (split when n >= 2D, else whole): the per-rank capacity of a --varlen
// pass (max(T/D, 2D - 1) when 16 | T: the slices of shorter lengths are no longer, and a
// sequence shorter than 2D runs whole; a position or two more otherwise).
static inline int zz_max_len(int T, int D) {
    long most = T < 2 * D - 1 ? T : 2 * D - 1;   // a sequence the group does not split
    for (int n = 2 * D; D > 1 && n <= T; n++) {
        for (int r = 0; r < D; r++) {
            long len = canon_zz_len(n, D, r);
            most = len > most ? len : most;
        }
    }
    return (int)(D > 1 ? most : T);
}

// Copies rank r's slice (B, Tl, C) between B whole sequences (B, T, C) and its own buffer;
// `to_slice` picks the direction. Both buffers live in `mem`.
static inline void zz_copy_slice(const MemOps* mem, float* seqs, float* slice, int B, int T, int C, int D, int r,
                                 int to_slice) {
    size_t Tl = (size_t)canon_zz_len(T, D, r), at = 0;
    for (int half = 0; half < 2; half++) {
        long begin, end;
        canon_zz_stretch(T, D, r, half, &begin, &end);
        for (int b = 0; b < B; b++) {
            float* seq = seqs + ((size_t)b * T + begin) * C;
            float* mine = slice + ((size_t)b * Tl + at) * C;
            if (to_slice) { mem->copy(mine, seq, (size_t)(end - begin) * C * sizeof(float)); }
            else { mem->copy(seq, mine, (size_t)(end - begin) * C * sizeof(float)); }
        }
        at += (size_t)(end - begin);
    }
}

// Copies between the rank-major stack of all D slices (rank r's (B, Tl_r, C) at B * C *
// canon_zz_offset(T, D, r)) and the sequences in order (B, T, C): what an all-gather along T
// receives, and what a reduce-scatter along T sends.
static inline void zz_reorder(const MemOps* mem, float* seqs, float* slices, int B, int T, int C, int D,
                              int to_slices) {
    for (int r = 0; r < D; r++) {
        zz_copy_slice(mem, seqs, slices + (size_t)B * C * canon_zz_offset(T, D, r), B, T, C, D, r, to_slices);
    }
}

#endif // LLMC_ZIGZAG_H
