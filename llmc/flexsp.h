/*
 * flexsp.h: FlexSP's per-sequence gradient exchange (issue 24, part 2), the piece that makes a
 * plan's groups train the bits of one rank.
 *
 * WHY. With a fixed layout, data-parallel rank r computes a contiguous block of the step's G
 * sequences, which is a complete subtree of the R1 tree over the sequences (canonical.h R3),
 * so a reduce-scatter of each rank's block sum finishes the tree (zero.h THE CANONICAL ORDER).
 * A FlexSP plan (varlen_flexsp.h) hands sequences to groups by length, not by index: group 0
 * may get sequences 3, 7 and 12. Their sum is no subtree, and adding it to the others would
 * give other bits. So each sequence's gradient is kept whole (finished over its group), sent
 * shard by shard to the pool rank that owns each shard (ZeRO's sharding over the pool), and the
 * owner sums the step's G sequences in index order with the R1 tree: one rank's microbatch tree
 * over the step's sequences (one sequence per microbatch with --varlen), the same bits
 * whoever computed each sequence.
 *
 * WHO HOLDS WHAT. Sequence j was computed by the pool ranks [first[j], first[j] + size[j]) (an
 * aligned power-of-two block: comm.h comm_setup_pool_groups), each of which holds its part of
 * the sequence's gradient and -0.0f elsewhere (the context-parallel convention of
 * context_parallel.h: exactly one member holds each element; a group of one holds it all). The
 * owner adds the members' copies in member order first: x + (-0.0f) == x bit for bit (and
 * -0.0f + -0.0f == -0.0f), so that sum is the finished gradient, then pushes it to the tree.
 *
 * WHAT IS SENT (per rank, per step, floats of the padded gradient n = P x shard): every
 * sequence this rank helped compute, all of it but its own shard: (its sequences) x n x
 * (P-1)/P; against ZeRO's one reduce-scatter (n x (P-1)/P) that is about G/P times as much:
 * the price of summing in index order when the plan does not follow the index. ZeRO-0 adds
 * the all-gather of the reduced shards (n x (P-1)/P), ZeRO-3 the step's one gather of the
 * parameters (zero.h zero_flexsp_begin_step: every padded parameter unit x (P-1)/P).
 */
#ifndef LLMC_FLEXSP_H
#define LLMC_FLEXSP_H

#include <stddef.h>
#include <stdlib.h>
#include "llmc/canonical.h"
#include "llmc/comm.h"
#include "llmc/memory.h"
#include "llmc/utils.h"
#include "llmc/varlen_flexsp.h"
#include "llmc/zero.h"

// ---- from a plan to the pool's blocks ---------------------------------------------------

// sorted[0 .. n): the step's sequence indices by length descending, ties by index (the order
// the planner takes its lengths in: varlen_flexsp.h).
static inline void flexsp_sort_by_length(const double* len, int n, int* sorted) {
    for (int i = 0; i < n; i++) { sorted[i] = i; }
    for (int a = 1; a < n; a++) {   // stable insertion sort, descending length
        int k = sorted[a], b = a;
        while (b > 0 && len[sorted[b - 1]] < len[k]) { sorted[b] = sorted[b - 1]; b--; }
        sorted[b] = k;
    }
}

// Where each of the step's sequences runs: a plan's groups (aligned: largest first, as
// flexsp_align_groups leaves them) laid over the pool in order, group k on the ranks after
// groups 0 .. k-1, so each starts at a multiple of its size: exactly one of the pool's
// sub-groups (comm.h comm_setup_pool_groups). group_of[i] is the group of the i-th longest
// sequence, sorted[i] its index in the step; first[j], size[j]: sequence j's block of ranks.
static inline void flexsp_plan_blocks(const FlexPlan* p, const int* group_of, const int* sorted, int n, int N,
                                      int* first, int* size) {
    int start[FLEXSP_MAX_POOL], at = 0;
    for (int k = 0; k < p->ngroups; k++) {
        if (at % p->size[k] != 0) { fatal("internal: FlexSP's group %d of %d ranks starts at rank %d", k, p->size[k], at); }
        start[k] = at;
        at += p->size[k];
    }
    if (at != N) { fatal("internal: FlexSP's plan covers %d of the pool's %d ranks", at, N); }
    for (int i = 0; i < n; i++) {
        first[sorted[i]] = start[group_of[i]];
        size[sorted[i]] = p->size[group_of[i]];
    }
}

// ---- the gradient exchange ---------------------------------------------------------------

// The exchange's three buffers (packed sends, received parts, the tree's stack) and the
// trainer's step's fourth (a padded unit: ZeRO 0-1's reduced shard, ZeRO-0's gathered unit),
// kept from call to call by a caller that runs it every step (fresh pages would be faulted in
// each time).
typedef struct {
    float* buf[4];
    size_t cap[4];
} FlexWorkspace;

static inline float* flexsp_workspace(const MemOps* mem, FlexWorkspace* ws, int k, size_t n) {
    if (n > ws->cap[k]) {
        mem->release(ws->buf[k]);
        ws->buf[k] = mem_floats(mem, n, "FlexSP gradient exchange");
        ws->cap[k] = n;
    }
    return ws->buf[k];
}

static inline void flexsp_workspace_free(const MemOps* mem, FlexWorkspace* ws) {
    for (int k = 0; k < 4; k++) { mem->release(ws->buf[k]); ws->buf[k] = NULL; ws->cap[k] = 0; }
}

// The R1 tree over n sequences is at most ceil(log2 n) + 1 entries deep.
static inline int flexsp_tree_depth(int n) {
    int depth = 1;
    while ((1 << (depth - 1)) < n) { depth++; }
    return depth;
}

static inline int flexsp_holds(const int* first, const int* size, int j, int rank) {
    return rank >= first[j] && rank < first[j] + size[j];
}

// The step's gradient shard of this rank of the pool: out[0 .. shard) = R1 tree over the step's
// nseq sequences, in index order, of sequence j's gradient at [pool->rank * shard, + shard),
// each finished over the pool ranks [first[j], first[j] + size[j]) that computed it.
// grads: this rank's sequences (those whose block holds it), in index order, each the padded
// gradient of pool->size * shard floats (its part, -0.0f elsewhere). All buffers in pool->mem;
// ws: the working buffers (NULL: allocated for this call).
static inline void flexsp_reduce_sequence_grads(CommGroup* pool, FlexWorkspace* ws, const int* first, const int* size,
                                                int nseq, const float* grads, size_t shard, float* out) {
    const MemOps* mem = pool->mem;
    FlexWorkspace own = {{NULL, NULL, NULL, NULL}, {0, 0, 0, 0}};
    if (ws == NULL) { ws = &own; }
    int P = pool->size, me = pool->rank;
    if (nseq < 1) { fatal("internal: a FlexSP step of %d sequences", nseq); }
    size_t* send_counts = (size_t*)calloc((size_t)P, sizeof(size_t));
    size_t* recv_counts = (size_t*)calloc((size_t)P, sizeof(size_t));
    int mine = 0, received = 0;
    for (int j = 0; j < nseq; j++) {
        if (first[j] < 0 || size[j] < 1 || first[j] + size[j] > P) {
            fatal("internal: sequence %d's group [%d, %d) is not in the pool of %d", j, first[j], first[j] + size[j], P);
        }
        if (flexsp_holds(first, size, j, me)) { mine++; }
        received += size[j];
        for (int s = first[j]; s < first[j] + size[j]; s++) { recv_counts[s] += shard; }
    }
    for (int r = 0; r < P; r++) { send_counts[r] = (size_t)mine * shard; }
    // pack: the block for rank r is shard r of each of this rank's sequences, in index order
    float* send = flexsp_workspace(mem, ws, 0, (size_t)mine * P * shard + 1);
    float* recv = flexsp_workspace(mem, ws, 1, (size_t)received * shard + 1);
    for (int r = 0; r < P; r++) {
        for (int k = 0; k < mine; k++) {
            mem->copy(send + ((size_t)r * mine + k) * shard, grads + ((size_t)k * P + r) * shard, shard * sizeof(float));
        }
    }
    // all-to-all-v (the pool: every dp x cp rank; gradients): shard r of every sequence this
    // rank computed -> rank r, which receives, per source rank, that source's sequences in
    // index order
    comm_all_to_all_v(pool, send, send_counts, recv, recv_counts, COMM_KIND_GRAD);
    // where source s's copy of sequence j landed: s's block, then its sequences before j
    size_t* block = (size_t*)calloc((size_t)P, sizeof(size_t));
    size_t* next = (size_t*)calloc((size_t)P, sizeof(size_t));
    for (int s = 1; s < P; s++) { block[s] = block[s - 1] + recv_counts[s - 1]; }
    // the R1 tree over the sequences, streamed: push each finished sequence, then merge
    int depth = flexsp_tree_depth(nseq);
    float* stack = flexsp_workspace(mem, ws, 2, (size_t)depth * shard + 1);
    int top = 0;
    for (int j = 0; j < nseq; j++) {
        if (top == depth) { fatal("internal: the FlexSP gradient tree is deeper than %d", depth); }
        float* leaf = stack + (size_t)top * shard;
        for (int s = first[j]; s < first[j] + size[j]; s++) {
            const float* part = recv + block[s] + next[s];
            next[s] += shard;
            if (s == first[j]) { mem->copy(leaf, part, shard * sizeof(float)); }
            else { mem->add(leaf, leaf, part, shard); }   // member parts: -0.0f where not theirs
        }
        top++;
        for (int m = canon_tree_merges_after(j, nseq); m > 0; m--) {
            float* left = stack + (size_t)(top - 2) * shard;
            mem->add(left, left, left + shard, shard);
            top--;
        }
    }
    mem->copy(out, stack, shard * sizeof(float));
    flexsp_workspace_free(mem, &own);
    free(send_counts);
    free(recv_counts);
    free(block);
    free(next);
}

// ---- the trainer's step ------------------------------------------------------------------

// After a FlexSP step's backwards (zero.h's flexsp mode: each of this rank's sequences' whole
// gradient in z->flexsp_grads): unit by unit, the exchange above over the sharding group (the
// pool) gives this rank its shard of the R1 tree over the step's nseq sequences, which lands
// where ZeRO keeps its reduced gradient: stages 2-3 the shard buffer; stage 1 the shard's range
// of the gradient buffer; stage 0, where every rank holds the whole reduced gradient, the
// whole unit, all-gathered from the shard owners (the all-reduce of ZeRO-0 is that
// reduce-scatter and all-gather too, comm.h). zero_finish_grads then adds the tied embedding's
// halves, as after any step.
static inline void flexsp_reduce_step(Zero* z, FlexWorkspace* ws, const int* first, const int* size, int nseq) {
    zero_flexsp_end_passes(z);
    float* unit = z->stage <= 1 ? flexsp_workspace(z->mem, ws, 3, z->max_padded) : NULL;   // a padded unit
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!z->lay.grads_here[u] || z->lay.padded[u] == 0) { continue; }
        size_t shard = z->lay.shard[u], b, e;
        float* out = z->stage >= 2 ? z->grad_shard + z->lay.gshard_base[u] : unit + (size_t)z->rank * shard;
        // all-to-all-v (the pool: the sharding group; gradients): shard r of unit u of every
        // sequence this rank computed -> rank r, summed there in the step's index order
        flexsp_reduce_sequence_grads(z->group, ws, first, size, nseq, zero_flexsp_unit_region(z, u), shard, out);
        if (z->stage == 1) {
            zero_shard_range(&z->lay, u, z->rank, &b, &e);
            z->mem->copy(z->grads + z->lay.glocal[u] + b, out, (e - b) * sizeof(float));
        } else if (z->stage == 0) {
            // all-gather (the pool; gradients): every owner's reduced shard -> the whole unit
            comm_all_gather(z->group, out, unit, shard, COMM_KIND_GRAD);
            z->mem->copy(z->grads + z->lay.glocal[u], unit, z->lay.size[u] * sizeof(float));
        }
    }
}

#endif // LLMC_FLEXSP_H
