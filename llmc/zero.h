/*
 * zero.h: data parallelism and ZeRO stages 0-3 over the communicator (comm.h).
 *
 * UNITS. The flat parameter buffer (model.h, MEMORY order) is cut into units, the buckets of
 * gradient reduction and the gather units of ZeRO-3: unit 0 = the embeddings [wte, wpe],
 * units 1..L = the transformer layers, unit L+1 = the final layernorm [lnfw, lnfb]. The
 * gradient has one more piece, unit E = L+2: the embedding-lookup half of wte's gradient
 * (Vp*C; train_gpt2.c keeps the two halves of the tied embedding apart until the step's
 * gradient is reduced, which is the order a pipeline can reproduce).
 * Each unit is padded to a multiple of the data-parallel size N and cut into N equal shards;
 * rank r owns shard r of every unit. Unit E is padded and sharded exactly like unit 0, so a
 * rank owns the same wte rows of both halves and can add them without communication.
 *
 * WHO HOLDS WHAT (P parameters, per rank, fp32 AdamW; the ZeRO paper's accounting)
 *   stage 0 (DDP): params P, grads P, m and v 2P                         = 16P
 *   stage 1:       params P, grads P, m and v of the shard                = 8P + 8P/N
 *   stage 2:       params P, grads of the shard, m and v of the shard     = 4P + 12P/N
 *   stage 3:       params, grads, m and v of the shard                    = 16P/N
 * plus padding, the wte gradient's second half (Vp*C, or its shard) and working buffers:
 * the gradient of the units in flight (stages 2-3) and the gathered units (stage 3).
 *
 * WHAT IS SENT, AND WHEN (per rank, per optimizer step, (N-1)/N of each buffer named)
 *   stage 0: after the last local microbatch's backward of each unit, all-reduce its
 *            gradient (E: the wte rows only)              ~ 2 (P + Vp*C) (N-1)/N
 *   stage 1: after the last local microbatch's backward of each unit, reduce-scatter its
 *            gradient; after AdamW on the shard, all-gather each unit's parameters
 *                                                         ~ (2P + Vp*C) (N-1)/N
 *   stage 2: reduce-scatter each unit's gradient after EVERY microbatch's backward of it
 *            (full-size gradients never all live at once); all-gather parameters after AdamW
 *                                                         ~ (M/N (P + Vp*C) + P) (N-1)/N
 *   stage 3: all-gather each unit's parameters before its forward and again before its
 *            backward (the next unit's gather is started while the current one computes),
 *            free them after use; reduce-scatter gradients like stage 2; no gather after
 *            the step                                     ~ M/N (3P + Vp*C) (N-1)/N
 * Reductions run as non-blocking collectives launched the moment a unit's backward is done,
 * overlapping the backward of the units below it.
 *
 * THE CANONICAL ORDER. The step's gradient is the R1 tree (canonical.h) over the M global
 * microbatches of the step. Stages 0 and 1 give rank r the contiguous block of microbatches
 * r*M/N .. (r+1)*M/N - 1: it sums its block (a complete subtree when N is a power of two
 * dividing M) and the cross-rank reduction finishes the tree. Stages 2 and 3 reduce after
 * every local microbatch, so rank r takes microbatches i*N + r (local step i): the ranks'
 * i-th microbatches form the block [i*N, (i+1)*N), the reduce-scatter sums it, and the local
 * tree over i finishes the global tree (exact when N and M/N are powers of two). Either way
 * the bits are those of one rank running all M microbatches.
 */
#ifndef LLMC_ZERO_H
#define LLMC_ZERO_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/adamw.h"
#include "llmc/canonical.h"
#include "llmc/comm.h"
#include "llmc/model.h"
#include "llmc/utils.h"

// ------------------------------------------------------------------------------------------
// the unit layout

typedef struct {
    int num_units;        // L + 2 parameter units; unit E = num_units is the gradient-only one
    int N;                // data-parallel size the shards are cut for
    size_t P;             // parameters
    size_t* offset;       // of unit u in the flat buffer (E: P, in the gradient buffer)
    size_t* size;         // elements of unit u
    size_t* padded;       // size rounded up to a multiple of N
    size_t* shard;        // padded / N
    size_t* shard_base;   // where unit u's shard sits in this rank's shard buffers
    size_t shard_total;   // sum of shard[u] over the parameter units
    size_t grad_shard_total;   // plus unit E's shard
} ZeroLayout;

static inline void zero_layout_init(ZeroLayout* z, const GPT2Config* c, int N) {
    int U = c->num_layers + 2;
    z->num_units = U;
    z->N = N;
    z->P = param_count(c);
    size_t* all = (size_t*)calloc_or_die(5 * (size_t)(U + 1), sizeof(size_t), "unit layout");
    z->offset = all;
    z->size = all + (U + 1);
    z->padded = all + 2 * (U + 1);
    z->shard = all + 3 * (U + 1);
    z->shard_base = all + 4 * (U + 1);
    size_t C = (size_t)c->channels;
    z->offset[0] = 0;
    z->size[0] = (size_t)c->padded_vocab_size * C + (size_t)c->max_seq_len * C;
    for (int l = 0; l < c->num_layers; l++) {
        z->offset[l + 1] = param_offset(c, P_LN1W, l);
        z->size[l + 1] = param_layer_elements(c);
    }
    z->offset[U - 1] = param_offset(c, P_LNFW, 0);
    z->size[U - 1] = 2 * C;
    z->offset[U] = z->P;                                   // E: after the P parameters
    z->size[U] = (size_t)c->padded_vocab_size * C;
    size_t base = 0;
    for (int u = 0; u <= U; u++) {
        size_t like = u == U ? z->size[0] : z->size[u];    // E is cut like unit 0
        z->padded[u] = (like + N - 1) / N * N;
        z->shard[u] = z->padded[u] / N;
        z->shard_base[u] = base;
        base += z->shard[u];
        if (u == U - 1) { z->shard_total = base; }
    }
    z->grad_shard_total = base;
}

static inline void zero_layout_free(ZeroLayout* z) { free(z->offset); }

// The canonical range [begin, end) of shard r of unit u (clipped to the unit; may be empty).
static inline void zero_shard_range(const ZeroLayout* z, int u, int r, size_t* begin, size_t* end) {
    size_t lo = (size_t)r * z->shard[u], hi = lo + z->shard[u];
    if (lo > z->size[u]) { lo = z->size[u]; }
    if (hi > z->size[u]) { hi = z->size[u]; }
    *begin = z->offset[u] + lo;
    *end = z->offset[u] + hi;
}

// ------------------------------------------------------------------------------------------
// the engine

#define ZERO_MAX_INFLIGHT 64

typedef struct {
    int unit;             // -1: free
    float* buf;           // padded[unit] floats (capacity max padded)
    CommRequest* req;     // the gather in flight, or NULL when complete
} ZeroSlot;

typedef struct {
    int stage, N, rank;
    CommGroup* group;
    const GPT2Config* config;
    ZeroLayout lay;
    int local_microbatches;    // M / N
    size_t max_padded;         // largest padded unit
    // persistent state
    float* params;             // stages 0-2: all P parameters; stage 3: NULL
    float* param_shard;        // stage 3: this rank's shards (lay.shard_total)
    float* grads;              // stages 0-1: the step's gradient, P + Vp*C
    float* grad_shard;         // stages 2-3: this rank's reduced gradient shards (grad_shard_total)
    float* m;                  // stage 0: P; stages 1-3: lay.shard_total
    float* v;
    // the local microbatch tree: stages 0-1 over full gradient buffers, 2-3 over shard buffers
    float* stack[40];
    int stack_allocated, stack_top;
    size_t stack_len;
    int micro;                 // local microbatch being computed
    // where backward writes each unit's gradient right now
    float** unit_grad;         // [num_units + 1]
    // stages 2-3: full-size gradient buffers of units whose reduce-scatter is in flight
    ZeroSlot gslots[ZERO_MAX_INFLIGHT];
    int ngslots;
    // stage 3: gathered parameter units
    ZeroSlot pslots[ZERO_MAX_INFLIGHT];
    int npslots;
    // stages 0-1: padded staging copies of unit gradients being reduced
    ZeroSlot sslots[ZERO_MAX_INFLIGHT];
    int nsslots;
    // reductions in flight, finished in launch order (the same on every rank)
    CommRequest* inflight[ZERO_MAX_INFLIGHT];
    int inflight_unit[ZERO_MAX_INFLIGHT];
    ZeroSlot* inflight_slot[ZERO_MAX_INFLIGHT];
    int ninflight;
} Zero;

static inline float* zero_alloc(size_t n, const char* what) {
    return (float*)aligned_calloc_or_die(n * sizeof(float), what);
}

// params: the full initial parameters (every rank holds the same); stage 3 keeps only its shard
// and frees nothing of the caller's. M: microbatches per step (global).
static inline void zero_init(Zero* z, const GPT2Config* c, int stage, CommGroup* dp,
                             const float* params, int M) {
    memset(z, 0, sizeof(*z));
    z->stage = stage;
    z->N = dp->size;
    z->rank = dp->rank;
    z->group = dp;
    z->config = c;
    zero_layout_init(&z->lay, c, z->N);
    z->local_microbatches = M / z->N;
    for (int u = 0; u <= z->lay.num_units; u++) {
        if (z->lay.padded[u] > z->max_padded) { z->max_padded = z->lay.padded[u]; }
    }
    size_t P = z->lay.P, G = P + z->lay.size[z->lay.num_units];
    if (stage <= 2) {
        z->params = zero_alloc(P, "parameters");
        memcpy(z->params, params, P * sizeof(float));
    } else {
        z->param_shard = zero_alloc(z->lay.shard_total, "parameter shard");
        for (int u = 0; u < z->lay.num_units; u++) {
            size_t b, e;
            zero_shard_range(&z->lay, u, z->rank, &b, &e);
            memcpy(z->param_shard + z->lay.shard_base[u], params + b, (e - b) * sizeof(float));
        }
    }
    size_t opt = stage == 0 ? P : z->lay.shard_total;
    z->m = zero_alloc(opt, "AdamW m");
    z->v = zero_alloc(opt, "AdamW v");
    if (stage <= 1) {
        z->grads = zero_alloc(G, "gradients");
        z->stack_len = G;
        z->stack[0] = z->grads;
    } else {
        z->grad_shard = zero_alloc(z->lay.grad_shard_total, "gradient shard");
        z->stack_len = z->lay.grad_shard_total;
        z->stack[0] = z->grad_shard;
    }
    z->stack_allocated = 1;
    z->unit_grad = (float**)calloc_or_die((size_t)z->lay.num_units + 1, sizeof(float*), "unit gradients");
}

static inline int zero_unit_E(const Zero* z) { return z->lay.num_units; }

// Global index of this rank's local microbatch i of the step whose first global microbatch
// is `first` (see THE CANONICAL ORDER above).
static inline int64_t zero_global_microbatch(const Zero* z, int64_t first, int i) {
    if (z->stage <= 1) { return first + (int64_t)z->rank * z->local_microbatches + i; }
    return first + (int64_t)i * z->N + z->rank;
}

// The rank holding global microbatch j of a step, and its local index there.
static inline void zero_owner_of_microbatch(const Zero* z, int j, int* rank, int* local) {
    if (z->stage <= 1) { *rank = j / z->local_microbatches; *local = j % z->local_microbatches; }
    else { *rank = j % z->N; *local = j / z->N; }
}

// A free buffer of a pool (slots keep their buffers; a pool grows to what is ever in use).
static inline ZeroSlot* zero_slot_get(ZeroSlot* slots, int* n, int unit, size_t floats) {
    for (int i = 0; i < *n; i++) {
        if (slots[i].unit < 0) { slots[i].unit = unit; slots[i].req = NULL; return &slots[i]; }
    }
    if (*n == ZERO_MAX_INFLIGHT) { fatal("too many ZeRO buffers in use"); }
    ZeroSlot* s = &slots[(*n)++];
    s->unit = unit;
    s->req = NULL;
    s->buf = zero_alloc(floats, "ZeRO working buffer");
    return s;
}

// ---- parameters: where the forward/backward of unit u reads them -------------------------

// Stage 3 only: start gathering unit u into a free buffer (the prefetch), if not there yet.
static inline void zero_params_prefetch(Zero* z, int u) {
    if (z->stage != 3 || u < 0 || u >= z->lay.num_units) { return; }
    for (int i = 0; i < z->npslots; i++) { if (z->pslots[i].unit == u) { return; } }
    ZeroSlot* s = zero_slot_get(z->pslots, &z->npslots, u, z->max_padded);
    // all-gather (dp group, parameters): every rank's shard of unit u -> the whole unit
    s->req = comm_all_gather_start(z->group, z->param_shard + z->lay.shard_base[u], s->buf,
                                   z->lay.shard[u], COMM_KIND_PARAM);
}

// The full parameters of unit u (unit-relative layout). Stage 3: waits for the gather
// (started now if no prefetch did), and starts prefetching `next` (-1: none).
static inline const float* zero_params_acquire(Zero* z, int u, int next) {
    if (z->stage != 3) { return z->params + z->lay.offset[u]; }
    zero_params_prefetch(z, u);
    ZeroSlot* s = NULL;
    for (int i = 0; i < z->npslots; i++) { if (z->pslots[i].unit == u) { s = &z->pslots[i]; } }
    zero_params_prefetch(z, next);
    if (s->req) { comm_wait(s->req); s->req = NULL; }
    return s->buf;
}

// Stage 3: the gathered copy of unit u is no longer needed.
static inline void zero_params_release(Zero* z, int u) {
    if (z->stage != 3) { return; }
    for (int i = 0; i < z->npslots; i++) {
        if (z->pslots[i].unit == u) {
            if (z->pslots[i].req) { comm_wait(z->pslots[i].req); }
            z->pslots[i].unit = -1;
            z->pslots[i].req = NULL;
        }
    }
}

// ---- gradients ---------------------------------------------------------------------------

static inline float* zero_stack_push(Zero* z) {
    if (z->stack_top == z->stack_allocated) {
        z->stack[z->stack_allocated++] = zero_alloc(z->stack_len, "gradient accumulation");
    }
    return z->stack[z->stack_top++];
}

// left <- left + right over [begin, end) of the top two buffers of the microbatch stack
static inline void zero_stack_add_range(Zero* z, int depth_left, size_t begin, size_t end) {
    float* left = z->stack[depth_left];
    const float* right = z->stack[depth_left + 1];
    #pragma omp parallel for
    for (size_t i = begin; i < end; i++) { left[i] = left[i] + right[i]; }
}

// Starts local microbatch i: decides where backward writes each unit's gradient.
static inline void zero_begin_microbatch(Zero* z, int i) {
    z->micro = i;
    if (z->stage <= 1) {
        float* g = zero_stack_push(z);
        for (int u = 0; u <= z->lay.num_units; u++) { z->unit_grad[u] = g + z->lay.offset[u]; }
    } else {
        zero_stack_push(z);   // this microbatch's reduced shards land in the new top buffer
        for (int u = 0; u <= z->lay.num_units; u++) { z->unit_grad[u] = NULL; }
    }
}

// Where backward writes unit u's gradient (unit-relative layout, every element written).
static inline float* zero_grad_unit(Zero* z, int u) {
    if (z->unit_grad[u] == NULL) {   // stages 2-3: a full-size working buffer, zero padding
        ZeroSlot* s = zero_slot_get(z->gslots, &z->ngslots, u, z->max_padded);
        memset(s->buf + z->lay.size[u], 0, (z->lay.padded[u] - z->lay.size[u]) * sizeof(float));
        z->unit_grad[u] = s->buf;
    }
    return z->unit_grad[u];
}

static inline void zero_track(Zero* z, CommRequest* req, int u, ZeroSlot* slot) {
    if (z->ninflight == ZERO_MAX_INFLIGHT) { fatal("too many ZeRO reductions in flight"); }
    z->inflight[z->ninflight] = req;
    z->inflight_unit[z->ninflight] = u;
    z->inflight_slot[z->ninflight] = slot;
    z->ninflight++;
}

// Drives the in-flight collectives (Open MPI progresses them only inside MPI calls).
static inline void zero_progress(Zero* z) {
    for (int i = 0; i < z->ninflight; i++) { if (z->inflight[i]) { comm_test(z->inflight[i]); } }
}

// Backward has written all of unit u's gradient for the current microbatch: launch its
// reduction if this is the moment (see WHAT IS SENT, AND WHEN).
static inline void zero_grad_unit_done(Zero* z, int u) {
    int E = zero_unit_E(z);
    if (z->stage >= 2) {
        // reduce-scatter (dp group, gradients): the unit's padded gradient -> this rank's
        // shard, summed over ranks by the R1 tree, into this microbatch's shard buffer
        float* dst = z->stack[z->stack_top - 1] + z->lay.shard_base[u];
        ZeroSlot* slot = NULL;
        for (int i = 0; i < z->ngslots; i++) {
            if (z->gslots[i].buf == z->unit_grad[u]) { slot = &z->gslots[i]; }
        }
        CommRequest* req = comm_reduce_scatter_start(z->group, z->unit_grad[u], dst, z->lay.shard[u], COMM_KIND_GRAD);
        zero_track(z, req, u, slot);
        z->unit_grad[u] = NULL;
        zero_progress(z);
        return;
    }
    if (z->micro != z->local_microbatches - 1) { return; }   // accumulate first, reduce once
    // the last local microbatch: finish the local tree over this unit's range, then reduce
    size_t begin = z->lay.offset[u], end = begin + z->lay.size[u];
    int top = z->stack_top;
    for (int mg = canon_tree_merges_after(z->micro, z->local_microbatches); mg > 0; mg--) {
        zero_stack_add_range(z, top - 2, begin, end);
        top--;
    }
    if (z->N == 1) { return; }
    float* g = z->grads + begin;
    ZeroSlot* s = zero_slot_get(z->sslots, &z->nsslots, u, z->max_padded);
    memcpy(s->buf, g, z->lay.size[u] * sizeof(float));
    memset(s->buf + z->lay.size[u], 0, (z->lay.padded[u] - z->lay.size[u]) * sizeof(float));
    CommRequest* req;
    if (z->stage == 0) {
        // all-reduce (dp group, gradients): the whole unit, R1 tree over ranks
        req = comm_all_reduce_sum_start(z->group, s->buf, z->lay.size[u], COMM_KIND_GRAD);
    } else {
        // reduce-scatter (dp group, gradients): the unit -> this rank's shard (in place at
        // the shard's offset in a copy; copied back into the flat gradient when done)
        req = comm_reduce_scatter_start(z->group, s->buf, s->buf + (size_t)z->rank * z->lay.shard[u],
                                        z->lay.shard[u], COMM_KIND_GRAD);
    }
    (void)E;
    zero_track(z, req, u, s);
    zero_progress(z);
}

// Waits for every reduction in flight, in launch order, and puts the results in place.
static inline void zero_wait_reductions(Zero* z) {
    for (int i = 0; i < z->ninflight; i++) {
        comm_wait(z->inflight[i]);
        int u = z->inflight_unit[i];
        ZeroSlot* s = z->inflight_slot[i];
        if (z->stage <= 1) {
            if (z->stage == 0) {
                memcpy(z->grads + z->lay.offset[u], s->buf, z->lay.size[u] * sizeof(float));
            } else {
                size_t b, e;
                zero_shard_range(&z->lay, u, z->rank, &b, &e);
                memcpy(z->grads + b, s->buf + (size_t)z->rank * z->lay.shard[u], (e - b) * sizeof(float));
            }
        }
        if (s) { s->unit = -1; }
    }
    z->ninflight = 0;
}

// Ends local microbatch i: stages 2-3 wait for its reduce-scatters and merge the local tree
// of shard buffers; stages 0-1 merge the local tree (the last microbatch merged per unit).
static inline void zero_end_microbatch(Zero* z) {
    int i = z->micro;
    if (z->stage >= 2) {
        zero_wait_reductions(z);
        for (int mg = canon_tree_merges_after(i, z->local_microbatches); mg > 0; mg--) {
            zero_stack_add_range(z, z->stack_top - 2, 0, z->stack_len);
            z->stack_top--;
        }
    } else if (i != z->local_microbatches - 1) {
        for (int mg = canon_tree_merges_after(i, z->local_microbatches); mg > 0; mg--) {
            zero_stack_add_range(z, z->stack_top - 2, 0, z->stack_len);
            z->stack_top--;
        }
    } else {
        z->stack_top = 1;   // merged per unit in zero_grad_unit_done
    }
}

// This rank's ranges of the final gradient: [begin, end) canonical with the gradient values
// (stages 0: everything; 1: the flat buffer at the shard; 2-3: the shard buffer).
static inline float* zero_grad_at(Zero* z, int u, size_t begin) {
    if (z->stage <= 1) { return z->grads + begin; }
    return z->grad_shard + z->lay.shard_base[u] + (begin - z->lay.offset[u] - (size_t)z->rank * z->lay.shard[u]);
}

static inline void zero_my_range(const Zero* z, int u, size_t* begin, size_t* end) {
    if (z->stage == 0) { *begin = z->lay.offset[u]; *end = *begin + z->lay.size[u]; return; }
    zero_shard_range(&z->lay, u, z->rank, begin, end);
}

// After the step's microbatches: every reduction done, and the tied embedding's gradient =
// lm-head half + embedding half on this rank's rows of wte.
static inline void zero_finish_grads(Zero* z) {
    zero_wait_reductions(z);
    z->stack_top = 0;
    int E = zero_unit_E(z);
    size_t wte_n = z->lay.size[E];
    size_t b, e;
    zero_my_range(z, 0, &b, &e);
    if (e > wte_n) { e = wte_n; }
    if (b >= e) { return; }
    float* lm = zero_grad_at(z, 0, b);
    const float* emb;
    if (z->stage <= 1) {
        emb = z->grads + z->lay.P + b;
    } else {
        emb = z->grad_shard + z->lay.shard_base[E] + (b - (size_t)z->rank * z->lay.shard[0]);
    }
    #pragma omp parallel for
    for (size_t i = 0; i < e - b; i++) { lm[i] = lm[i] + emb[i]; }
}

// ||gradient|| over the P parameters: exact sum of squares of this rank's ranges, summed over
// the dp group (an integer sum: the same bits for every layout).
static inline float zero_grad_norm(Zero* z) {
    SumSq total;
    canon_sumsq_init(&total);
    for (int u = 0; u < z->lay.num_units; u++) {
        size_t b, e;
        zero_my_range(z, u, &b, &e);
        const float* g = zero_grad_at(z, u, b);
        size_t n = e - b;
        #pragma omp parallel
        {
            SumSq mine;
            canon_sumsq_init(&mine);
            #pragma omp for schedule(static)
            for (size_t i = 0; i < n; i++) { canon_sumsq_add(&mine, g[i]); }
            #pragma omp critical
            canon_sumsq_merge(&total, &mine);
        }
    }
    if (z->stage >= 1) { comm_all_reduce_sumsq(z->group, &total, COMM_KIND_OTHER); }
    return (float)sqrt(canon_sumsq_value(&total));
}

// Pointers for unit u's range [b, e) of parameters, m and v on this rank.
static inline float* zero_param_at(Zero* z, int u, size_t begin) {
    if (z->stage <= 2) { return z->params + begin; }
    return z->param_shard + z->lay.shard_base[u] + (begin - z->lay.offset[u] - (size_t)z->rank * z->lay.shard[u]);
}
static inline size_t zero_opt_index(const Zero* z, int u, size_t begin) {
    if (z->stage == 0) { return begin; }
    return z->lay.shard_base[u] + (begin - z->lay.offset[u] - (size_t)z->rank * z->lay.shard[u]);
}

// AdamW on this rank's ranges, then (stages 1-2) all-gather every unit's parameters.
static inline void zero_adamw_step(Zero* z, const AdamWStep* s, float weight_decay) {
    const GPT2Config* c = z->config;
    for (int u = 0; u < z->lay.num_units; u++) {
        size_t b, e;
        zero_my_range(z, u, &b, &e);
        float* p = zero_param_at(z, u, b);
        const float* g = zero_grad_at(z, u, b);
        size_t o = zero_opt_index(z, u, b);
        // walk the tensors overlapping [b, e): weight decay is per tensor
        for (int t = 0; t < NUM_PARAMETER_TENSORS && b < e; t++) {
            int layers = param_is_layer_tensor(t) ? c->num_layers : 1;
            for (int l = 0; l < layers; l++) {
                size_t tb = param_offset(c, t, l), te = tb + param_tensor_elements(c, t);
                size_t lo = tb > b ? tb : b, hi = te < e ? te : e;
                if (lo >= hi) { continue; }
                float wd = param_is_decayed(t) ? weight_decay : 0.0f;
                #pragma omp parallel for
                for (size_t i = lo; i < hi; i++) {
                    adamw_update_elem(&p[i - b], &z->m[o + i - b], &z->v[o + i - b], g[i - b], s, wd);
                }
            }
        }
    }
    if (z->stage == 1 || z->stage == 2) {
        // all-gather (dp group, parameters): every rank's updated shard -> the whole unit
        for (int u = 0; u < z->lay.num_units; u++) {
            ZeroSlot* slot = zero_slot_get(z->sslots, &z->nsslots, u, z->max_padded);
            size_t b, e;
            zero_shard_range(&z->lay, u, z->rank, &b, &e);
            float* mine = slot->buf + (size_t)z->rank * z->lay.shard[u];
            memcpy(mine, z->params + b, (e - b) * sizeof(float));
            memset(mine + (e - b), 0, (z->lay.shard[u] - (e - b)) * sizeof(float));
            comm_all_gather(z->group, mine, slot->buf, z->lay.shard[u], COMM_KIND_PARAM);
            memcpy(z->params + z->lay.offset[u], slot->buf, z->lay.size[u] * sizeof(float));
            slot->unit = -1;
        }
    }
}

// Every rank: the full parameters into dst (rank `root` only; others pass NULL), in MEMORY
// order. Stage 3 gathers them (a collective: every rank must call).
static inline void zero_full_params(Zero* z, float* dst, int root) {
    if (z->stage <= 2) {
        if (dst) { memcpy(dst, z->params, z->lay.P * sizeof(float)); }
        return;
    }
    for (int u = 0; u < z->lay.num_units; u++) {
        const float* full = zero_params_acquire(z, u, -1);
        if (dst && z->rank == root) { memcpy(dst + z->lay.offset[u], full, z->lay.size[u] * sizeof(float)); }
        zero_params_release(z, u);
    }
}

// Bytes each rank holds, by kind (what the startup table prints and the tests check).
typedef struct { double params, grads, optimizer, working; } ZeroMemory;

static inline ZeroMemory zero_memory(const Zero* z) {
    ZeroMemory mem;
    size_t P = z->lay.P, G = P + z->lay.size[z->lay.num_units];
    mem.params = 4.0 * (z->stage <= 2 ? P : z->lay.shard_total);
    mem.grads = 4.0 * (z->stage <= 1 ? G : z->lay.grad_shard_total);
    mem.optimizer = 8.0 * (z->stage == 0 ? P : z->lay.shard_total);
    mem.working = 0;
    return mem;
}

static inline void zero_free(Zero* z) {
    free(z->params); free(z->param_shard); free(z->m); free(z->v);
    for (int i = 1; i < z->stack_allocated; i++) { free(z->stack[i]); }
    free(z->grads); free(z->grad_shard);
    for (int i = 0; i < z->ngslots; i++) { free(z->gslots[i].buf); }
    for (int i = 0; i < z->npslots; i++) { free(z->pslots[i].buf); }
    for (int i = 0; i < z->nsslots; i++) { free(z->sslots[i].buf); }
    free(z->unit_grad);
    zero_layout_free(&z->lay);
}

#endif // LLMC_ZERO_H
