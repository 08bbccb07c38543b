/*
 * zero.h: data parallelism and ZeRO stages 0-3 over the communicator (comm.h), for the units
 * of the model a rank holds (all of them, or a pipeline stage's).
 *
 * UNITS. The flat parameter buffer (model.h, MEMORY order) is cut into units, the buckets of
 * gradient reduction and the gather units of ZeRO-3: unit 0 = wte, unit 1 = wpe, units
 * 2..L+1 = the transformer layers, unit L+2 = the final layernorm [lnfw, lnfb]. The gradient
 * has one more piece, the lookup unit (number L+3): the embedding-lookup half of wte's gradient (Vp*C;
 * train_gpt2.c keeps the two halves of the tied embedding apart until the step's gradient is
 * reduced, which is the order a pipeline can reproduce: Megatron's).
 * Each unit is padded to a multiple of the data-parallel size N and cut into N equal shards;
 * rank r owns shard r of every unit. With context parallelism N counts data x context ranks
 * (the sharding group; zero_init_ep says how its reduction stays exact), while the microbatches
 * go to the data-parallel ranks (`streams`). The lookup unit is cut exactly like wte, so a rank owns the same
 * rows of both halves and adds them without communication.
 *
 * PIPELINE STAGES AND CHUNKS. A pipeline rank holds one or more model chunks (virtual
 * stages, pipeline.h), each a contiguous range of layers; the chunk with the embeddings also
 * wpe, wte (for the lookup) and the lookup unit (the lookup half of wte's gradient); the chunk with the head
 * the final layernorm, wte (a copy, for the LM head; one copy when the same rank holds both,
 * as zbv's rank 0) and the LM-head half of wte's gradient. After the data-parallel reduction,
 * the two ranks swap their halves for the rows they own (sendrecv over the pipeline group,
 * Megatron's embedding-gradient all-reduce) and both update their copy of wte with the same
 * sum, so the copies stay identical. wte counts once: on stage 0, which always holds the
 * embeddings (gradient norm, optimizer-state files).
 * Each chunk runs its own microbatch tree: a schedule with several chunks per rank computes
 * chunk 1's gradient of microbatch 3 while chunk 0 is at microbatch 1, and the zero-bubble
 * schedules compute a weight gradient (W) long after the input gradient. The tree only needs
 * every unit's microbatches in order, which pipeline.h guarantees per chunk, and a chunk's
 * units are disjoint from the others', so the chunks share the tree's buffers.
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
 *            gradient                                     ~ 2 (P + Vp*C) (N-1)/N
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
 * BF16 WEIGHTS (fast mode: Megatron's distributed optimizer, fp32 main parameters sharded on
 * their owners, bf16 model parameters gathered). A model whose passes read bf16 weights
 * (zero_init's weight_bytes = 2) takes them from zero_weights_acquire; the fp32 parameters stay
 * the master copy AdamW updates, and every element is rounded to bf16 once per step, by the
 * rank that updated it (memory.h's to_bf16), so bf16 is what travels:
 *   stage 0:   fp32 parameters whole (every rank updates all of them), rounded whole after the
 *              step (no communication)
 *   stages 1-2: fp32 parameters of the shard only; after AdamW each rank rounds its shard and
 *              all-gathers the bf16 shards into every unit's bf16 weights
 *   stage 3:   fp32 parameters of the shard; each acquire all-gathers the unit's rounded shards
 *              into a buffer of the largest unit (ZERO_WEIGHT_BUFFERS of them, made up front)
 * Rounding is elementwise, so every layout holds the bits one rank rounding the whole model
 * does. Whole fp32 parameters are read only by checkpoints (zero_full_params gathers them unit
 * by unit from stage 1 on). Units are padded to a multiple of 2N, so a bf16 shard is whole
 * 4-byte words (what comm.h moves). Per rank (the same accounting as above, 2 bytes a bf16
 * weight):
 *   stage 0:   fp32 params 4P, bf16 weights 2P, grads 4P, m and v 8P      = 18P
 *   stage 1:   4P/N + 2P + 4P + 8P/N                                       = 6P + 12P/N
 *   stage 2:   4P/N + 2P + 4P/N + 8P/N                                     = 2P + 16P/N
 *   stage 3:   16P/N + the gathered units' buffers (3 x 2 bytes x the largest unit)
 * and the parameter bytes sent are half of the fp32 all-gathers' above: ~ 2P (N-1)/N per step
 * at stages 1-2, 2 bytes per element of every unit gathered at stage 3.
 *
 * WHERE THE BUFFERS LIVE. Every buffer here is allocated, copied, filled, summed and updated
 * through the MemOps table given to zero_init (memory.h): host memory in the CPU build, device
 * memory in the CUDA build. Only the layout bookkeeping is host data.
 *
 * EXPERT UNITS (a mixture-of-experts model, llmc/moe.h). A layer's unit holds its attention,
 * layernorms and router; its experts are a unit of their own, unit X(l) = L+4+l
 * (zero_expert_unit), after the lookup unit. With expert parallelism (--ep Q, llmc/expert_parallel.h) a rank
 * holds E/Q of the experts of each layer, so its expert units are its experts' tensors; they
 * are sharded and reduced over the expert-data-parallel (edp) group, N/Q ranks holding the same
 * experts (with context parallelism: N the data x context ranks), where the dense units use
 * the dp group. An expert unit's gradient comes in Q slices,
 * one per source microbatch of the ep group (expert_parallel.h THE GRADIENT ORDER): stages 2-3
 * combine them (the R1 tree over sources) before each reduce-scatter; stages 0-1 keep them
 * apart in the local microbatch tree and combine them at the step's end, before reducing
 * (their gradient buffers hold Q slices of each expert unit: the canonical order needs them).
 *
 * THE CANONICAL ORDER. The step's gradient is the R1 tree (canonical.h) over the M global
 * microbatches of the step. Stages 0 and 1 give rank r the contiguous block of microbatches
 * r*M/N .. (r+1)*M/N - 1: it sums its block (a complete subtree when N is a power of two
 * dividing M) and the cross-rank reduction finishes the tree. Stages 2 and 3 reduce after
 * every local microbatch, so rank r takes microbatches i*N + r (local step i): the ranks'
 * i-th microbatches form the block [i*N, (i+1)*N), the reduce-scatter sums it, and the local
 * tree over i finishes the global tree (exact when N and M/N are powers of two). Either way
 * the bits are those of one rank running all M microbatches. With FlexSP (flexsp mode) a plan
 * gives a rank any set of the step's sequences, which is no subtree: each one's gradient is
 * kept whole and flexsp.h's exchange builds the tree over all of them at the shard owners.
 * The ranks then run different numbers of passes, so stage 3 cannot gather a unit per pass
 * (every rank of the group must join each gather): it gathers every unit once per step, ahead
 * of the step's passes, into a copy of the whole parameters kept for the run (4P bytes more per
 * rank: zero_flexsp_begin_step).
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
#include "llmc/checkpoint.h"
#include "llmc/memory.h"
#include "llmc/model.h"
#include "llmc/pipeline.h"       // ChunkPlace: the layers of one model chunk
#include "llmc/tensor_parallel.h"
#include "llmc/utils.h"

#define ZERO_WTE 0
#define ZERO_WPE 1
#define ZERO_LAYER(l) ((l) + 2)
// Each unit's bf16 weights start at a multiple of 128 elements (256 bytes, as every device
// allocation does), so a tensor's weights sit at the same alignment in every layout and stage
// (cuBLASLt may choose its algorithm by a pointer's alignment).
#define ZERO_WEIGHT_ALIGN 128

// ------------------------------------------------------------------------------------------
// the unit layout of one rank

typedef struct {
    int num_units;        // L + 3 parameter units; unit num_units is the gradient-only lookup unit
    int num_all;          // every unit: num_units + 1, then the expert units (L of them, or 0)
    int N;                // data-parallel size the shards are cut for
    TPCut cut;            // this rank's tensor-parallel slices (tensor_parallel.h): the tp group's
                          // size K and this rank's place r in it (ffn_K, ffn_r: Helix's serving)
    int Q, ep_rank;       // expert-parallel size and this rank's place in it
    size_t P;             // parameters of the whole model
    size_t* size;         // elements of unit u on this rank (its tensor-parallel slices)
    TPPiece** pieces;     // the tensors of unit u as this rank holds them
    int* npieces;
    int* Nu;              // the size of the group unit u is sharded over: N, or N/Q (expert units)
    int* slices;          // gradient slices of unit u: Q for expert units, else 1
    int* params_here;     // this rank holds unit u's parameters
    int* grads_here;      // this rank computes unit u's gradient
    size_t* padded;       // size rounded up to a multiple of N (bf16 weights: of 2N; 0 when not held)
    size_t* shard;        // padded / N
    size_t* local;        // offset of unit u in this rank's unsharded parameter buffer
    size_t* wlocal;       // offset of unit u in the bf16 weights (ZeRO 0-2: each padded, gathered in place)
    size_t* shard_base;   // offset of unit u's shard in this rank's parameter shard buffers
    size_t* glocal;       // the same two for the gradient buffers (which hold the lookup unit, and wte only
    size_t* gshard_base;  //   on the stage that computes its LM-head half)
    size_t local_params, local_grads;   // unsharded buffer sizes (params; grads incl. the lookup unit)
    size_t local_weights;               // the bf16 weights' size (elements)
    size_t shard_params, shard_grads;   // shard buffer sizes
} ZeroLayout;

// Unit u holds parameters (every unit but the lookup unit).
static inline int zero_param_unit(const ZeroLayout* z, int u) { return u != z->num_units; }
static inline int zero_is_expert_unit(const ZeroLayout* z, int u) { return u > z->num_units; }

// The number of units of a model (parameter units, the lookup unit, and the experts' units).
static inline int zero_units_all(const GPT2Config* c) {
    return c->num_layers + 4 + (c->num_experts > 0 ? c->num_layers : 0);
}

// The layout for a rank holding the chunks places[0 .. nchunks), its slices cut as `cut` says
// (rank cut.r of a cut.K-way tensor-parallel group), rank ep_rank of a Q-way expert-parallel
// group (Q divides N), each shard a multiple of `align` elements (2 for bf16 weights: a bf16
// shard is then whole 4-byte words, what comm.h moves).
// unit_chunk[u] (zero_units_all entries, filled here) is the chunk that computes unit u's
// gradient, -1 for none.
static inline void zero_layout_init(ZeroLayout* z, const GPT2Config* c, int N, const ChunkPlace* places,
                                    int nchunks, TPCut cut, int Q, int ep_rank, int align, int* unit_chunk) {
    int U = c->num_layers + 3, lookup = U, A = zero_units_all(c);
    z->num_units = U;
    z->num_all = A;
    z->N = N;
    z->cut = cut;
    z->Q = Q;
    z->ep_rank = ep_rank;
    z->P = param_count(c);
    size_t* all = (size_t*)calloc_or_die(8 * (size_t)A, sizeof(size_t), "unit layout");
    z->size = all;
    z->pieces = (TPPiece**)calloc_or_die((size_t)A, sizeof(TPPiece*), "unit layout");
    z->npieces = (int*)calloc_or_die((size_t)A, sizeof(int), "unit layout");
    z->padded = all + 1 * A;
    z->shard = all + 2 * A;
    z->local = all + 3 * A;
    z->shard_base = all + 4 * A;
    z->glocal = all + 5 * A;
    z->gshard_base = all + 6 * A;
    z->wlocal = all + 7 * A;
    int* flags = (int*)calloc_or_die(4 * (size_t)A, sizeof(int), "unit layout");
    z->params_here = flags;
    z->grads_here = flags + A;
    z->Nu = flags + 2 * A;
    z->slices = flags + 3 * A;
    int El = c->num_experts / Q;
    for (int u = 0; u < A; u++) {
        if (zero_is_expert_unit(z, u)) {
            z->pieces[u] = (TPPiece*)calloc_or_die(4 * (size_t)El, sizeof(TPPiece), "unit layout");
            z->npieces[u] = tp_expert_unit_pieces(c, cut, u - U - 1, ep_rank * El, El, z->pieces[u]);
        } else {
            z->pieces[u] = (TPPiece*)calloc_or_die(TP_MAX_PIECES, sizeof(TPPiece), "unit layout");
            z->npieces[u] = tp_unit_pieces(c, cut, u == lookup ? ZERO_WTE : u, z->pieces[u]);   // the lookup unit mirrors wte
        }
        const TPPiece* last = &z->pieces[u][z->npieces[u] - 1];
        z->size[u] = last->local + tp_piece_elements(last);
        z->Nu[u] = zero_is_expert_unit(z, u) ? N / Q : N;
        z->slices[u] = zero_is_expert_unit(z, u) ? Q : 1;
        unit_chunk[u] = -1;
    }
    for (int ch = 0; ch < nchunks; ch++) {
        const ChunkPlace* p = &places[ch];
        for (int l = p->first_layer; l < p->last_layer; l++) {
            z->params_here[ZERO_LAYER(l)] = z->grads_here[ZERO_LAYER(l)] = 1;
            unit_chunk[ZERO_LAYER(l)] = ch;
            if (A > U + 1) {   // the layer's experts
                z->params_here[U + 1 + l] = z->grads_here[U + 1 + l] = 1;
                unit_chunk[U + 1 + l] = ch;
            }
        }
        if (p->has_embedding) {
            z->params_here[ZERO_WTE] = 1;
            z->params_here[ZERO_WPE] = z->grads_here[ZERO_WPE] = 1;
            z->grads_here[lookup] = 1;                           // the lookup half
            unit_chunk[ZERO_WPE] = unit_chunk[lookup] = ch;
        }
        if (p->has_head) {
            z->params_here[ZERO_WTE] = z->grads_here[ZERO_WTE] = 1;   // the LM-head half
            z->params_here[U - 1] = z->grads_here[U - 1] = 1;
            unit_chunk[ZERO_WTE] = unit_chunk[U - 1] = ch;
        }
    }
    size_t local = 0, base = 0, glocal = 0, gbase = 0, wlocal = 0;
    for (int u = 0; u < A; u++) {
        int params = u != lookup && z->params_here[u], grads = z->grads_here[u];
        size_t n = params || grads ? z->size[u] : 0, cut_by = (size_t)z->Nu[u] * align;
        z->padded[u] = (n + cut_by - 1) / cut_by * cut_by;
        z->shard[u] = z->padded[u] / z->Nu[u];
        z->local[u] = local;
        z->shard_base[u] = base;
        z->glocal[u] = glocal;
        z->gshard_base[u] = gbase;
        z->wlocal[u] = wlocal;
        if (params) {
            local += n;
            base += z->shard[u];
            wlocal += (z->padded[u] + ZERO_WEIGHT_ALIGN - 1) / ZERO_WEIGHT_ALIGN * ZERO_WEIGHT_ALIGN;
        }
        if (grads) { glocal += n * z->slices[u]; gbase += z->shard[u]; }
    }
    z->local_params = local;
    z->local_weights = wlocal;
    z->shard_params = base;
    z->local_grads = glocal;
    z->shard_grads = gbase;
}

static inline void zero_layout_free(ZeroLayout* z) {
    free(z->size);
    for (int u = 0; u < z->num_all; u++) { free(z->pieces[u]); }
    free(z->pieces);
    free(z->npieces);
    free(z->params_here);
}

// The range [begin, end) of unit u's elements in shard r (clipped to the unit; may be empty).
static inline void zero_shard_range(const ZeroLayout* z, int u, int r, size_t* begin, size_t* end) {
    size_t n = z->padded[u] ? z->size[u] : 0;
    size_t lo = (size_t)r * z->shard[u], hi = lo + z->shard[u];
    *begin = lo > n ? n : lo;
    *end = hi > n ? n : hi;
}

// ------------------------------------------------------------------------------------------
// the engine

#define ZERO_MAX_INFLIGHT 64
// Stage 3 with bf16 weights: the gathered units' buffers made up front (more are made if a
// schedule holds more): a pass holds a unit (the embedding holds wte while it acquires wpe),
// acquires the next one and prefetches the one after.
#define ZERO_WEIGHT_BUFFERS 3

typedef struct {
    int unit;             // -1: free
    float* buf;           // capacity: the largest padded unit
    CommRequest* req;     // the gather in flight, or NULL when complete
} ZeroSlot;

typedef struct {
    int stage, N, rank;        // the sharding group: its size and this rank's shard
    int streams, stream;       // the data-parallel ranks (streams of microbatches) and this one's:
                               // the sharding group itself, or with context parallelism its
                               // data-parallel coordinate (see zero_init_ep)
    const MemOps* mem;         // where the buffers below live
    CommGroup* group;          // the sharding group: data parallel (x context parallel)
    CommGroup* ep;             // expert parallel (tokens; the model's), size Q
    CommGroup* edp;            // expert data parallel (the expert units), size N/Q
    CommGroup* pp;             // pipeline (the tied embedding's swap between the stages below)
    int pp_stage, head_stage;  // this rank's stage; the stage holding the head (stage 0 holds
                               // the embeddings)
    const GPT2Config* config;
    ZeroLayout lay;
    int local_microbatches;    // M / streams
    size_t max_padded;         // largest padded unit
    // persistent state
    float* params;             // the fp32 parameters: this rank's units (lay.local_params) ...
    float* param_shard;        // ... or its shards (lay.shard_params) when zero_params_sharded
    float* grads;              // stages 0-1: the step's gradient (lay.local_grads)
    float* grad_shard;         // stages 2-3: this rank's reduced gradient shards (lay.shard_grads)
    float* m;                  // stage 0: lay.local_params; stages 1-3: lay.shard_params
    float* v;
    size_t opt_len;            // floats in m and in v
    float *m_host, *v_host;    // m and v readable by the host (checkpoints): m and v themselves
                               // in host memory, else copies made by zero_state_to_host
    // the local microbatch tree: stages 0-1 over full gradient buffers, 2-3 over shard buffers;
    // one tree per chunk over the chunk's units, all in the same buffers
    float* stack[40];
    int stack_allocated, stack_top;
    size_t stack_len;
    int nchunks;
    int* unit_chunk;           // [lay.num_all]: the chunk computing unit u's gradient, or -1
    int* chunk_top;            // [nchunks]: each chunk's stack depth between its microbatches
    int* chunk_next;           // [nchunks]: how many of its microbatches each chunk has computed
    int* chunk_first;          // [nchunks]: the local microbatches of each chunk's tree: [first,
    int* chunk_count;          //   first + count), every one but under dualpipe (zero_set_mirror)
    int chunk, micro;          // the chunk being computed and its position in the chunk's tree
    int mirror;                // dualpipe: the stage holding this rank's chunks for the other
                               // microbatches (their gradients are summed), else -1
    int counts_params;         // this rank's copy counts (norm, checkpoint): 0 on a mirror's upper copy
    float** unit_grad;         // [num_units + 1]: where backward writes each unit's gradient now
    ZeroSlot gslots[ZERO_MAX_INFLIGHT];   // stages 2-3: unit gradients being reduce-scattered
    int ngslots;
    ZeroSlot pslots[ZERO_MAX_INFLIGHT];   // stage 3: gathered parameter units
    int npslots;
    ZeroSlot sslots[ZERO_MAX_INFLIGHT];   // stages 0-1: padded copies of gradients being reduced
    int nsslots;
    // bf16 weights (BF16 WEIGHTS above): what the passes read, as bf16's 16 bits
    int bf16_weights;
    uint16_t* weights;         // stages 0-2: every held unit's (lay.local_weights, at lay.wlocal)
    ZeroSlot wslots[ZERO_MAX_INFLIGHT];   // stage 3: gathered units (buffers of wslot_floats)
    int nwslots;
    size_t wslot_floats;       // the largest padded parameter unit in bf16, in 4-byte words
    // reductions in flight, finished in launch order (the same on every rank)
    CommRequest* inflight[ZERO_MAX_INFLIGHT];
    int inflight_unit[ZERO_MAX_INFLIGHT];
    ZeroSlot* inflight_slot[ZERO_MAX_INFLIGHT];
    int ninflight;
    // FlexSP (--flexsp 1, llmc/flexsp.h): the step's sequences this rank computes are its local
    // microbatches, each one's gradient kept whole (no tree, no reduction here) in
    // flexsp_grads: unit by unit, unit u's region holds every local microbatch's padded
    // gradient of u (zero_flexsp_unit_region), for flexsp_reduce_step's exchange
    int flexsp;
    const int* flexsp_index;   // [local microbatches of the step] each one's index in the step
    float* flexsp_grads;
    size_t flexsp_capacity;    // floats allocated in flexsp_grads (kept from step to step)
    // stage 3 under FlexSP: the ranks run different numbers of sequences, so no unit can be
    // gathered per pass (every pool rank must join each gather); every unit is gathered once
    // per step, ahead of its sequences (zero_flexsp_begin_step), into flexsp_params
    // (lay.local_params, kept from step to step), which the step's passes read
    float* flexsp_params;
    int flexsp_params_held;    // flexsp_params holds this step's parameters
} Zero;

static inline float* zero_alloc(const Zero* z, size_t n, const char* what) {
    return mem_floats(z->mem, n, what);
}

// A free buffer of a pool, of `floats` 4-byte words (slots keep their buffers; a pool grows to
// what is ever in use).
static inline ZeroSlot* zero_slot_get_sized(const Zero* z, ZeroSlot* slots, int* n, int unit, size_t floats) {
    for (int i = 0; i < *n; i++) {
        if (slots[i].unit < 0) { slots[i].unit = unit; slots[i].req = NULL; return &slots[i]; }
    }
    if (*n == ZERO_MAX_INFLIGHT) { fatal("too many ZeRO buffers in use"); }
    ZeroSlot* s = &slots[(*n)++];
    s->unit = unit;
    s->req = NULL;
    s->buf = zero_alloc(z, floats, "ZeRO working buffer");
    return s;
}
// ... of the largest unit's work (zero_unit_work) in fp32
static inline ZeroSlot* zero_slot_get(const Zero* z, ZeroSlot* slots, int* n, int unit) {
    return zero_slot_get_sized(z, slots, n, unit, z->max_padded);
}

// The slot of `slots` holding unit u, or NULL.
static inline ZeroSlot* zero_slot_of(ZeroSlot* slots, int n, int u) {
    for (int i = 0; i < n; i++) { if (slots[i].unit == u) { return &slots[i]; } }
    return NULL;
}

static inline int zero_lookup_unit(const Zero* z) { return z->lay.num_units; }

// The expert unit of layer l (a model with experts).
static inline int zero_expert_unit(const Zero* z, int l) { return z->lay.num_units + 1 + l; }

// The group unit u is sharded and reduced over, and this rank's place in it.
static inline CommGroup* zero_unit_group(const Zero* z, int u) {
    return zero_is_expert_unit(&z->lay, u) ? z->edp : z->group;
}
static inline int zero_unit_rank(const Zero* z, int u) { return zero_unit_group(z, u)->rank; }

// The gradient buffer unit u needs while it is computed: its slices, padded for the reduction.
static inline size_t zero_unit_work(const ZeroLayout* z, int u) {
    size_t n = z->size[u] * (size_t)z->slices[u];
    return n > z->padded[u] ? n : z->padded[u];
}

// This rank writes optimizer state at checkpoints: every rank from ZeRO-1 on (its shards); at
// ZeRO-0 dp rank 0 (everything replicated) and, with expert parallelism, the other ranks of
// its ep group (their experts).
static inline int zero_writes_state(const Zero* z) { return z->stage != 0 || z->edp->rank == 0; }

// Unit u's elements as this rank holds them (its tensor-parallel slices), from the full
// parameters in canonical (MEMORY) order; both in host memory.
typedef struct { float* dst; const float* src; } ZeroCopyCtx;
static inline void zero_copy_run(size_t canonical, size_t local, size_t len, void* vctx) {
    ZeroCopyCtx* ctx = (ZeroCopyCtx*)vctx;
    memcpy(ctx->dst + local, ctx->src + canonical, len * sizeof(float));
}
static inline void zero_unit_from_full(const ZeroLayout* z, int u, const float* full, float* unit) {
    ZeroCopyCtx ctx = {unit, full};
    for (int k = 0; k < z->npieces[u]; k++) {
        const TPPiece* p = &z->pieces[u][k];
        tp_piece_runs(p, 0, tp_piece_elements(p), zero_copy_run, &ctx);
    }
}

// ---- bf16 weights (BF16 WEIGHTS above) -----------------------------------------------------

// The fp32 parameters are held as this rank's shards (param_shard), not as whole units (params):
// at stage 3, and with bf16 weights from stage 1 on.
static inline int zero_params_sharded(const Zero* z) { return z->stage == 3 || (z->bf16_weights && z->stage >= 1); }

// This rank holds unit u's parameters.
static inline int zero_holds_params(const Zero* z, int u) {
    return u >= 0 && u < z->lay.num_all && zero_param_unit(&z->lay, u) && z->lay.params_here[u];
}

// Unit u's bf16 weights into dst (padded[u] elements, the padding never read): this rank rounds
// its fp32 shard into its block of dst, then
// all-gather (dp group; edp group for an expert unit; bf16 parameters, two to a 4-byte word):
// every rank's block -> the whole unit, in place.
// Each element is rounded once, by its owner, exactly as one rank rounds it.
static inline CommRequest* zero_weights_gather_start(Zero* z, int u, uint16_t* dst) {
    int r = zero_unit_rank(z, u);
    size_t b, e, shard = z->lay.shard[u];
    zero_shard_range(&z->lay, u, r, &b, &e);
    uint16_t* mine = dst + (size_t)r * shard;
    z->mem->to_bf16(mine, z->param_shard + z->lay.shard_base[u], e - b);
    return comm_all_gather_start(zero_unit_group(z, u), (const float*)mine, (float*)dst, shard / 2, COMM_KIND_PARAM);
}

// Stages 0-2: every held unit's bf16 weights from its fp32 parameters (at the start and after
// each update): stage 0 rounds its whole units, stages 1-2 gather the rounded shards (every
// unit's gather started, then each waited for). Stage 3 gathers a unit when a pass acquires it.
static inline void zero_weights_refresh(Zero* z) {
    if (z->stage == 3) { return; }
    CommRequest** gathers = (CommRequest**)calloc_or_die((size_t)z->lay.num_all, sizeof(CommRequest*), "gathers");
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!zero_holds_params(z, u)) { continue; }
        uint16_t* unit = z->weights + z->lay.wlocal[u];
        if (z->stage == 0) { z->mem->to_bf16(unit, z->params + z->lay.local[u], z->lay.size[u]); }
        else { gathers[u] = zero_weights_gather_start(z, u, unit); }
    }
    comm_wait_all(gathers, z->lay.num_all);
    free(gathers);
}

// params: the full initial parameters (every rank the same, MEMORY order); the engine keeps
// this rank's part of the units it holds (stage 3: only its shards). M: microbatches per step
// (global). dp: the data-parallel group (the streams of microbatches); shards: the group the
// gradients are reduced over and the optimizer state and (stage 3) the parameters are sharded
// over: dp itself, or with context parallelism data x context (Megatron's), whose ranks then
// each hand in the finished gradient of their part of every unit and -0.0f elsewhere
// (context_parallel.h), so the R1 tree over a data-parallel rank's context ranks is exact and
// the reduction over the group finishes the tree over the data-parallel ranks; ep, edp: the
// data-parallel group's expert-parallel cut, edp with the context ranks of its data-parallel
// ranks (comm.h comm_setup_expert_groups; both NULL: no expert parallelism, the experts are
// data-parallel); pp: the
// pipeline group of which this rank is stage pp->rank, holding the model chunks
// places[0 .. nchunks), stage head_stage holding the head; cut: this rank's tensor-parallel
// slices (zero_init_ep: its tp group's); weight_bytes: the bytes of an element of the weights
// the model's passes read, 4 (the fp32 parameters: zero_params_acquire) or 2 (bf16 weights:
// zero_weights_acquire).
static inline void zero_init_cut(Zero* z, const GPT2Config* c, const MemOps* mem, int stage, CommGroup* dp,
                                 CommGroup* shards, CommGroup* ep, CommGroup* edp, CommGroup* pp, TPCut cut,
                                 const ChunkPlace* places, int nchunks, int head_stage, const float* params,
                                 size_t weight_bytes, int M) {
    static CommGroup single;   // the ep group of a rank without expert parallelism
    if (weight_bytes != sizeof(float) && weight_bytes != sizeof(uint16_t)) {
        fatal("internal: the model reads weights of %zu bytes an element (ZeRO holds fp32 or bf16)", weight_bytes);
    }
    memset(z, 0, sizeof(*z));
    z->mem = mem;
    z->stage = stage;
    z->bf16_weights = weight_bytes == sizeof(uint16_t);
    z->N = shards->size;
    z->rank = shards->rank;
    z->group = shards;
    z->streams = dp->size;
    z->stream = dp->rank;
    if (ep == NULL) {
        comm_group_init_single(&single, dp->stats, dp->mem);
        ep = &single;
        edp = shards;
    } else if (edp->size * ep->size != shards->size) {
        fatal("internal: the edp group must hold the context ranks of its data-parallel ranks");
    }
    z->ep = ep;
    z->edp = edp;
    z->pp = pp;
    z->pp_stage = pp->rank;
    z->head_stage = head_stage;
    z->config = c;
    z->nchunks = nchunks;
    int A = zero_units_all(c);
    z->unit_chunk = (int*)calloc_or_die((size_t)A + 4 * (size_t)nchunks, sizeof(int), "unit chunks");
    z->chunk_top = z->unit_chunk + A;
    z->chunk_next = z->chunk_top + nchunks;
    z->chunk_first = z->chunk_next + nchunks;
    z->chunk_count = z->chunk_first + nchunks;
    zero_layout_init(&z->lay, c, z->N, places, nchunks, cut, ep->size, ep->rank, z->bf16_weights ? 2 : 1,
                     z->unit_chunk);
    z->local_microbatches = M / z->streams;
    for (int ch = 0; ch < nchunks; ch++) { z->chunk_count[ch] = z->local_microbatches; }
    z->mirror = -1;
    z->counts_params = 1;
    for (int u = 0; u < z->lay.num_all; u++) {
        if (zero_unit_work(&z->lay, u) > z->max_padded) { z->max_padded = zero_unit_work(&z->lay, u); }
    }
    // each unit is assembled on the host, then its part (sharded: its shard) copied into place
    float* unit = (float*)host_alloc(z->max_padded * sizeof(float), "parameter unit");
    int sharded = zero_params_sharded(z);
    if (!sharded) {
        z->params = zero_alloc(z, z->lay.local_params, "parameters");
    } else {
        z->param_shard = zero_alloc(z, z->lay.shard_params, "parameter shard");
    }
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u]) { continue; }
        zero_unit_from_full(&z->lay, u, params, unit);
        if (!sharded) {
            mem->from_host(z->params + z->lay.local[u], unit, z->lay.size[u] * sizeof(float));
        } else {
            size_t b, e;
            zero_shard_range(&z->lay, u, zero_unit_rank(z, u), &b, &e);
            mem->from_host(z->param_shard + z->lay.shard_base[u], unit + b, (e - b) * sizeof(float));
        }
    }
    free(unit);
    if (z->bf16_weights) {   // stages 0-2 the bf16 copy of every unit, stage 3 the buffers it gathers into
        for (int u = 0; u < z->lay.num_all; u++) {
            if (zero_holds_params(z, u) && z->lay.padded[u] / 2 > z->wslot_floats) { z->wslot_floats = z->lay.padded[u] / 2; }
        }
        if (stage <= 2) {
            z->weights = (uint16_t*)mem->alloc(z->lay.local_weights * sizeof(uint16_t), "bf16 weights");
        } else {
            for (z->nwslots = 0; z->nwslots < ZERO_WEIGHT_BUFFERS; z->nwslots++) {
                ZeroSlot* s = &z->wslots[z->nwslots];
                s->unit = -1;
                s->buf = zero_alloc(z, z->wslot_floats, "bf16 weights (gathered units)");
            }
        }
        zero_weights_refresh(z);
    }
    if (M == 0) { return; }   // no microbatches: inference (serve_engine.h), parameters only
    z->opt_len = stage == 0 ? z->lay.local_params : z->lay.shard_params;
    z->m = zero_alloc(z, z->opt_len, "AdamW m");
    z->v = zero_alloc(z, z->opt_len, "AdamW v");
    mem->fill(z->m, 0.0f, z->opt_len);
    mem->fill(z->v, 0.0f, z->opt_len);
    if (stage <= 1) {
        z->grads = zero_alloc(z, z->lay.local_grads, "gradients");
        z->stack_len = z->lay.local_grads;
        z->stack[0] = z->grads;
    } else {
        z->grad_shard = zero_alloc(z, z->lay.shard_grads, "gradient shard");
        z->stack_len = z->lay.shard_grads;
        z->stack[0] = z->grad_shard;
    }
    z->stack_allocated = 1;
    z->unit_grad = (float**)calloc_or_die((size_t)z->lay.num_all, sizeof(float*), "unit gradients");
}

// ... every tensor cut over the tensor-parallel group tp.
static inline void zero_init_ep(Zero* z, const GPT2Config* c, const MemOps* mem, int stage, CommGroup* dp,
                                CommGroup* shards, CommGroup* ep, CommGroup* edp, CommGroup* pp, CommGroup* tp,
                                const ChunkPlace* places, int nchunks, int head_stage, const float* params,
                                size_t weight_bytes, int M) {
    zero_init_cut(z, c, mem, stage, dp, shards, ep, edp, pp, tp_cut(tp->size, tp->rank), places, nchunks, head_stage,
                  params, weight_bytes, M);
}

static inline void zero_init(Zero* z, const GPT2Config* c, const MemOps* mem, int stage, CommGroup* dp,
                             CommGroup* pp, CommGroup* tp, const ChunkPlace* places, int nchunks, int head_stage,
                             const float* params, int M) {
    zero_init_ep(z, c, mem, stage, dp, dp, NULL, NULL, pp, tp, places, nchunks, head_stage, params, sizeof(float), M);
}

// dualpipe (pipeline.h): chunk c computes the gradient of the local microbatches [first[c],
// first[c] + count[c]) only, and pipeline stage `mirror` holds the same units for the other
// ones. R1 splits an even n at n/2, so each copy's tree over its half is a subtree of the tree
// over all of them, and zero_finish_grads adds the two (x + y == y + x: both copies get the
// same bits) before any data-parallel reduction that finishes the tree. The lower stage's copy
// is the one counted (gradient norm, checkpoint).
static inline void zero_set_mirror(Zero* z, int mirror, const int* first, const int* count) {
    for (int ch = 0; ch < z->nchunks; ch++) {
        z->chunk_first[ch] = first[ch];
        z->chunk_count[ch] = count[ch];
    }
    z->mirror = mirror;
    z->counts_params = z->pp_stage < mirror;
}

// Global index of this rank's local microbatch i of the step whose first global microbatch
// is `first` (see THE CANONICAL ORDER above).
static inline int64_t zero_global_microbatch(const Zero* z, int64_t first, int i) {
    if (z->flexsp) { return first + z->flexsp_index[i]; }
    if (z->stage <= 1) { return first + (int64_t)z->stream * z->local_microbatches + i; }
    return first + (int64_t)i * z->streams + z->stream;
}

// The data-parallel rank holding global microbatch j of a step, and its local index there.
static inline void zero_owner_of_microbatch(const Zero* z, int j, int* rank, int* local) {
    if (z->stage <= 1) { *rank = j / z->local_microbatches; *local = j % z->local_microbatches; }
    else { *rank = j % z->streams; *local = j / z->streams; }
}

// ---- parameters: where the forward/backward of unit u reads them -------------------------

// Sharded parameters only: start gathering unit u into a free buffer (the prefetch), if not
// there yet.
static inline void zero_params_prefetch(Zero* z, int u) {
    if (!zero_params_sharded(z) || !zero_holds_params(z, u) || zero_slot_of(z->pslots, z->npslots, u)) { return; }
    ZeroSlot* s = zero_slot_get(z, z->pslots, &z->npslots, u);
    // all-gather (dp group; edp group for an expert unit; parameters): every rank's shard of
    // unit u -> the whole unit
    s->req = comm_all_gather_start(zero_unit_group(z, u), z->param_shard + z->lay.shard_base[u], s->buf,
                                   z->lay.shard[u], COMM_KIND_PARAM);
}

// Unit u's buffer in a pool of gathered units, its gather finished.
static inline float* zero_gathered(ZeroSlot* slots, int n, int u) {
    ZeroSlot* s = zero_slot_of(slots, n, u);
    if (s->req) { comm_wait(s->req); s->req = NULL; }
    return s->buf;
}

// The full fp32 parameters of unit u. Sharded: waits for the gather (started now if no
// prefetch did), and starts prefetching `next` (-1: none).
static inline const float* zero_params_acquire(Zero* z, int u, int next) {
    if (!z->lay.params_here[u]) { fatal("internal: unit %d is not held by this rank", u); }
    if (!zero_params_sharded(z)) { return z->params + z->lay.local[u]; }
    if (z->flexsp_params_held) { return z->flexsp_params + z->lay.local[u]; }
    zero_params_prefetch(z, u);
    zero_params_prefetch(z, next);
    return zero_gathered(z->pslots, z->npslots, u);
}

// Stage 3 with bf16 weights: start gathering unit u's bf16 weights into a free buffer (the
// prefetch), if not there yet.
static inline void zero_weights_prefetch(Zero* z, int u) {
    if (z->stage != 3 || !zero_holds_params(z, u) || zero_slot_of(z->wslots, z->nwslots, u)) { return; }
    ZeroSlot* s = zero_slot_get_sized(z, z->wslots, &z->nwslots, u, z->wslot_floats);
    s->req = zero_weights_gather_start(z, u, (uint16_t*)s->buf);
}

// Unit u's bf16 weights (bf16 weights only; their 16 bits), as zero_params_acquire gives its
// fp32 parameters: stage 3 gathers the unit as it gathers the fp32 one, prefetching `next`.
static inline const uint16_t* zero_weights_acquire(Zero* z, int u, int next) {
    if (!z->bf16_weights || !z->lay.params_here[u]) { fatal("internal: unit %d has no bf16 weights on this rank", u); }
    if (z->stage != 3) { return z->weights + z->lay.wlocal[u]; }
    zero_weights_prefetch(z, u);
    zero_weights_prefetch(z, next);
    return (const uint16_t*)zero_gathered(z->wslots, z->nwslots, u);
}

// Sharded parameters: the gathered copies of unit u (its fp32 parameters, its bf16 weights) are
// no longer needed.
static inline void zero_slots_release(ZeroSlot* slots, int n, int u) {
    for (ZeroSlot* s = zero_slot_of(slots, n, u); s; s = zero_slot_of(slots, n, u)) {
        if (s->req) { comm_wait(s->req); }
        s->unit = -1;
        s->req = NULL;
    }
}
static inline void zero_params_release(Zero* z, int u) {
    if (!zero_params_sharded(z) || z->flexsp_params_held) { return; }
    zero_slots_release(z->pslots, z->npslots, u);
    zero_slots_release(z->wslots, z->nwslots, u);
}

// ---- gradients ---------------------------------------------------------------------------

static inline float* zero_stack_push(Zero* z) {
    if (z->stack_top == z->stack_allocated) {
        if (z->stack_allocated == 40) { fatal("internal: the microbatch tree is deeper than 40"); }
        z->stack[z->stack_allocated++] = zero_alloc(z, z->stack_len, "gradient accumulation");
    }
    return z->stack[z->stack_top++];
}

// left <- left + right over [begin, end) of the stack buffers at depth and depth + 1
static inline void zero_stack_add_range(Zero* z, int depth_left, size_t begin, size_t end) {
    float* left = z->stack[depth_left] + begin;
    z->mem->add(left, left, z->stack[depth_left + 1] + begin, end - begin);
}

// The same over the current chunk's units (their full gradients at stages 0-1, their shards at
// 2-3), a run of consecutive units at a time.
static inline void zero_stack_add_chunk(Zero* z, int depth_left) {
    size_t run_begin = 0, run_end = 0;
    for (int u = 0; u < z->lay.num_all; u++) {
        if (z->unit_chunk[u] != z->chunk) { continue; }
        size_t b = z->stage <= 1 ? z->lay.glocal[u] : z->lay.gshard_base[u];
        size_t e = b + (z->stage <= 1 ? z->lay.size[u] * z->lay.slices[u] : z->lay.shard[u]);
        if (b != run_end) {
            if (run_end > run_begin) { zero_stack_add_range(z, depth_left, run_begin, run_end); }
            run_begin = b;
        }
        run_end = e;
    }
    if (run_end > run_begin) { zero_stack_add_range(z, depth_left, run_begin, run_end); }
}

// FlexSP: where unit u's gradients of the step's local microbatches are in flexsp_grads
// (chunk_count[0] of them, each padded[u] floats, the padding 0).
static inline float* zero_flexsp_unit_region(const Zero* z, int u) {
    size_t before = 0;
    for (int w = 0; w < u; w++) { before += z->lay.padded[w]; }
    return z->flexsp_grads + before * (size_t)z->chunk_count[0];
}

// FlexSP: at stage 3 every unit's parameters gathered once, ahead of passes that ranks run in
// groups of different sizes (a step's, or validation's), which then read this copy (every rank
// of the sharding group calls this); other stages hold the whole parameters already.
static inline void zero_flexsp_hold_params(Zero* z) {
    if (z->stage != 3) { return; }
    if (z->flexsp_params == NULL) { z->flexsp_params = zero_alloc(z, z->lay.local_params, "FlexSP step parameters"); }
    for (int u = 0; u < z->lay.num_all; u++) {   // the all-gathers of zero_params_acquire, unit after unit
        if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u]) { continue; }
        z->mem->copy(z->flexsp_params + z->lay.local[u], zero_params_acquire(z, u, -1), z->lay.size[u] * sizeof(float));
        zero_params_release(z, u);
    }
    z->flexsp_params_held = 1;
}

// FlexSP: this step's local microbatches are the step's sequences index[0 .. count) (ascending):
// room for each one's whole gradient; at stage 3 every unit's parameters gathered for the step
// (every rank of the sharding group calls this, whatever its count).
static inline void zero_flexsp_begin_step(Zero* z, const int* index, int count) {
    if (z->nchunks != 1) { fatal("internal: FlexSP runs one model chunk per rank"); }
    size_t total = 0;
    for (int u = 0; u < z->lay.num_all; u++) { total += z->lay.padded[u]; }
    z->flexsp_index = index;
    z->chunk_count[0] = count;
    if (total * (size_t)count > z->flexsp_capacity) {
        z->mem->release(z->flexsp_grads);
        z->flexsp_capacity = total * (size_t)count;
        z->flexsp_grads = zero_alloc(z, z->flexsp_capacity, "FlexSP sequence gradients");
    }
    for (int u = 0; u < z->lay.num_all; u++) {   // backward writes the rest of each
        float* region = zero_flexsp_unit_region(z, u);
        for (int i = 0; i < count; i++) {
            z->mem->fill(region + (size_t)i * z->lay.padded[u] + z->lay.size[u], 0.0f, z->lay.padded[u] - z->lay.size[u]);
        }
    }
    zero_flexsp_hold_params(z);
}

// FlexSP: the passes that read the held parameters are done (AdamW will update the shards, so
// later passes, samples and the next step's gathers, gather anew).
static inline void zero_flexsp_end_passes(Zero* z) { z->flexsp_params_held = 0; }

// Starts the backward (its weight-gradient part) of chunk `chunk` on local microbatch i:
// decides where it writes each unit's gradient. A chunk's microbatches come in order.
static inline void zero_begin_microbatch(Zero* z, int chunk, int i) {
    if (chunk < 0 || chunk >= z->nchunks || i != z->chunk_first[chunk] + z->chunk_next[chunk]) {
        fatal("internal: chunk %d computes microbatch %d's gradient out of order", chunk, i);
    }
    z->chunk = chunk;
    z->micro = z->chunk_next[chunk];
    z->stack_top = z->chunk_top[chunk];
    if (z->flexsp) {   // microbatch i's own padded gradient of each unit
        for (int u = 0; u < z->lay.num_all; u++) {
            z->unit_grad[u] = zero_flexsp_unit_region(z, u) + (size_t)i * z->lay.padded[u];
        }
    } else if (z->stage <= 1) {
        float* g = zero_stack_push(z);
        for (int u = 0; u < z->lay.num_all; u++) { z->unit_grad[u] = g + z->lay.glocal[u]; }
    } else {
        zero_stack_push(z);   // this microbatch's reduced shards land in the new top buffer
        for (int u = 0; u < z->lay.num_all; u++) { z->unit_grad[u] = NULL; }
    }
}

// Where backward writes unit u's gradient (every element written; an expert unit's slice q at
// + q * lay.size[u]).
static inline float* zero_grad_unit(Zero* z, int u) {
    if (!z->lay.grads_here[u] || z->unit_chunk[u] != z->chunk) {
        fatal("internal: the gradient of unit %d is not computed by this rank's chunk %d", u, z->chunk);
    }
    if (z->unit_grad[u] == NULL) {   // stages 2-3: a full-size working buffer, zero padding
        ZeroSlot* s = zero_slot_get(z, z->gslots, &z->ngslots, u);
        z->mem->fill(s->buf + z->lay.size[u], 0.0f, z->lay.padded[u] - z->lay.size[u]);
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

// Stages 0-1: launch the data-parallel reduction of unit u's finished local gradient.
static inline void zero_reduce_unit_start(Zero* z, int u) {
    size_t size = z->lay.size[u], begin = z->lay.glocal[u];
    CommGroup* group = zero_unit_group(z, u);
    if (group->size == 1) { return; }
    ZeroSlot* s = zero_slot_get(z, z->sslots, &z->nsslots, u);
    z->mem->copy(s->buf, z->grads + begin, size * sizeof(float));
    z->mem->fill(s->buf + size, 0.0f, z->lay.padded[u] - size);
    CommRequest* req;
    if (z->stage == 0) {
        // all-reduce (dp group; edp group for an expert unit; gradients): the whole unit, R1
        // tree over ranks
        req = comm_all_reduce_sum_start(group, s->buf, size, COMM_KIND_GRAD);
    } else {
        // reduce-scatter (dp group; edp group for an expert unit; gradients): the unit -> this
        // rank's shard (in place at the shard's offset in the copy; copied back into the
        // gradient buffer when done)
        req = comm_reduce_scatter_start(group, s->buf, s->buf + (size_t)group->rank * z->lay.shard[u],
                                        z->lay.shard[u], COMM_KIND_GRAD);
    }
    zero_track(z, req, u, s);
    zero_progress(z);
}

// Backward has written all of unit u's gradient for the current microbatch: launch its
// reduction if this is the moment (see WHAT IS SENT, AND WHEN).
static inline void zero_grad_unit_done(Zero* z, int u) {
    size_t size = z->lay.size[u];
    int slices = z->lay.slices[u];
    CommGroup* group = zero_unit_group(z, u);
    if (z->flexsp) { return; }   // kept whole for flexsp_reduce_step
    if (z->stage >= 2) {
        if (slices > 1) {   // the R1 tree over the source microbatches, into slice 0
            z->mem->tree_rows(z->unit_grad[u], size, slices, z->unit_grad[u]);
            z->mem->fill(z->unit_grad[u] + size, 0.0f, z->lay.padded[u] - size);
        }
        // reduce-scatter (dp group; edp group for an expert unit; gradients): the unit's padded
        // gradient -> this rank's shard, summed over ranks by the R1 tree, into this
        // microbatch's shard buffer
        float* dst = z->stack[z->stack_top - 1] + z->lay.gshard_base[u];
        ZeroSlot* slot = NULL;
        for (int i = 0; i < z->ngslots; i++) {
            if (z->gslots[i].buf == z->unit_grad[u]) { slot = &z->gslots[i]; }
        }
        CommRequest* req = comm_reduce_scatter_start(group, z->unit_grad[u], dst, z->lay.shard[u], COMM_KIND_GRAD);
        zero_track(z, req, u, slot);
        z->unit_grad[u] = NULL;
        zero_progress(z);
        return;
    }
    int count = z->chunk_count[z->chunk];
    if (z->micro != count - 1) { return; }   // accumulate first, reduce once
    // the last local microbatch: finish the local tree over this unit's range (every slice),
    // then the tree over the slices, then reduce
    size_t begin = z->lay.glocal[u], end = begin + size * slices;
    int top = z->stack_top;
    for (int mg = canon_tree_merges_after(z->micro, count); mg > 0; mg--) {
        zero_stack_add_range(z, top - 2, begin, end);
        top--;
    }
    // dualpipe: the slices' tree and the reduction wait for the mirror's half (zero_finish_grads):
    // each slice's two halves are the two subtrees of its tree over the local microbatches
    if (z->mirror >= 0) { return; }
    if (slices > 1) { z->mem->tree_rows(z->grads + begin, size, slices, z->grads + begin); }
    zero_reduce_unit_start(z, u);
}

// Waits for every reduction in flight, in launch order, and puts the results in place.
static inline void zero_wait_reductions(Zero* z) {
    for (int i = 0; i < z->ninflight; i++) {
        comm_wait(z->inflight[i]);
        int u = z->inflight_unit[i];
        ZeroSlot* s = z->inflight_slot[i];
        if (z->stage == 0) {
            z->mem->copy(z->grads + z->lay.glocal[u], s->buf, z->lay.size[u] * sizeof(float));
        } else if (z->stage == 1) {
            size_t b, e;
            zero_shard_range(&z->lay, u, zero_unit_rank(z, u), &b, &e);
            z->mem->copy(z->grads + z->lay.glocal[u] + b, s->buf + b, (e - b) * sizeof(float));
        }
        if (s) { s->unit = -1; }
    }
    z->ninflight = 0;
}

// Ends the backward of the current chunk and local microbatch: stages 2-3 wait for its
// reduce-scatters and merge the chunk's local tree of shard buffers; stages 0-1 merge the
// chunk's local tree (the last microbatch was merged unit by unit in zero_grad_unit_done).
static inline void zero_end_microbatch(Zero* z) {
    int i = z->micro, count = z->chunk_count[z->chunk];
    if (z->flexsp) { z->chunk_next[z->chunk]++; z->chunk = -1; return; }
    if (z->stage >= 2) { zero_wait_reductions(z); }
    if (z->stage >= 2 || i != count - 1) {
        for (int mg = canon_tree_merges_after(i, count); mg > 0; mg--) {
            zero_stack_add_chunk(z, z->stack_top - 2);
            z->stack_top--;
        }
    } else {
        z->stack_top = 1;
    }
    z->chunk_top[z->chunk] = z->stack_top;
    z->chunk_next[z->chunk]++;
    z->chunk = -1;
}

// This rank's range [begin, end) of unit u's elements (stage 0: all of it; else its shard).
static inline void zero_my_range(const Zero* z, int u, size_t* begin, size_t* end) {
    if (z->stage == 0) { *begin = 0; *end = z->lay.padded[u] ? z->lay.size[u] : 0; return; }
    zero_shard_range(&z->lay, u, zero_unit_rank(z, u), begin, end);
}

// Pointers to element `at` of unit u (at in this rank's range) in the reduced gradient, the
// parameters, and the optimizer state.
static inline float* zero_grad_at(Zero* z, int u, size_t at) {
    if (z->stage <= 1) { return z->grads + z->lay.glocal[u] + at; }
    return z->grad_shard + z->lay.gshard_base[u] + (at - (size_t)zero_unit_rank(z, u) * z->lay.shard[u]);
}
static inline float* zero_param_at(Zero* z, int u, size_t at) {
    if (!zero_params_sharded(z)) { return z->params + z->lay.local[u] + at; }
    return z->param_shard + z->lay.shard_base[u] + (at - (size_t)zero_unit_rank(z, u) * z->lay.shard[u]);
}
static inline size_t zero_opt_index(const Zero* z, int u, size_t at) {
    if (z->stage == 0) { return z->lay.local[u] + at; }
    return z->lay.shard_base[u] + (at - (size_t)zero_unit_rank(z, u) * z->lay.shard[u]);
}

// The final gradient of wte's rows in this rank's range: the LM-head half's slot on the last
// stage, the lookup half's slot (which holds the sum after zero_finish_grads) on the others.
static inline float* zero_wte_grad_at(Zero* z, size_t at) {
    return zero_grad_at(z, z->lay.grads_here[ZERO_WTE] ? ZERO_WTE : zero_lookup_unit(z), at);
}

// After the step's microbatches: every reduction done, and the tied embedding's gradient =
// LM-head half + lookup half on this rank's rows of wte (with a pipeline, the first and the
// last stage swap their halves first).
static inline void zero_finish_grads(Zero* z) {
    zero_wait_reductions(z);
    for (int ch = 0; ch < z->nchunks; ch++) {
        if (z->chunk_next[ch] != z->chunk_count[ch]) {
            fatal("internal: chunk %d computed %d of %d microbatch gradients", ch, z->chunk_next[ch],
                  z->chunk_count[ch]);
        }
        z->chunk_top[ch] = z->chunk_next[ch] = 0;
    }
    z->stack_top = 0;
    if (z->mirror >= 0) {
        // sendrecv (pipeline group, gradients): this copy's tree over its half of the
        // microbatches <-> the mirror's over the other half, every unit at once (stages 0-1 the
        // local gradients, 2-3 the dp-reduced shards: the same dp and tp rank, the same rows)
        float* theirs = zero_alloc(z, z->stack_len, "mirror gradients");
        comm_sendrecv(z->pp, z->stack[0], z->stack_len, z->mirror, theirs, z->stack_len, z->mirror, 8, COMM_KIND_PP);
        z->mem->add(z->stack[0], z->stack[0], theirs, z->stack_len);
        z->mem->release(theirs);
        if (z->stage <= 1) {
            for (int u = 0; u < z->lay.num_all; u++) {
                if (!z->lay.grads_here[u]) { continue; }
                size_t at = z->lay.glocal[u], size = z->lay.size[u];
                if (z->lay.slices[u] > 1) { z->mem->tree_rows(z->grads + at, size, z->lay.slices[u], z->grads + at); }
                zero_reduce_unit_start(z, u);
            }
            zero_wait_reductions(z);
        }
    }
    int lookup_unit = zero_lookup_unit(z);
    int has_lm = z->lay.grads_here[ZERO_WTE], has_lookup = z->lay.grads_here[lookup_unit];
    if (!has_lm && !has_lookup) { return; }
    size_t b, e;
    zero_my_range(z, has_lm ? ZERO_WTE : lookup_unit, &b, &e);
    float* mine = zero_grad_at(z, has_lm ? ZERO_WTE : lookup_unit, b);
    float* theirs = mine;
    float* recv = NULL;
    if (has_lm && has_lookup) {
        theirs = zero_grad_at(z, lookup_unit, b);
    } else if (e > b) {
        // sendrecv (pipeline group, gradients): stage 0's lookup half <-> the head stage's
        // LM-head half, for the same rows (same dp rank, same shard)
        recv = zero_alloc(z, e - b, "embedding gradient");
        int peer = has_lm ? 0 : z->head_stage;
        comm_sendrecv(z->pp, mine, e - b, peer, recv, e - b, peer, 7, COMM_KIND_PP);
        theirs = recv;
    }
    float* lm = has_lm ? mine : theirs;
    const float* lookup = has_lm ? theirs : mine;
    z->mem->add(mine, lm, lookup, e - b);
    z->mem->release(recv);
}

// ||gradient|| over the P parameters: exact sum of squares of this rank's ranges, each
// parameter counted once (wte on the first stage, replicated tensors on tensor-parallel rank
// 0), summed over the dp, tp and pipeline groups (integer sums: the same bits for every
// layout). At ZeRO-0 with expert parallelism each ep group sums its ranks' experts (every ep
// group holds all of them, replicated over the edp group).
static inline float zero_grad_norm(Zero* z, CommGroup* tp) {
    SumSq total, experts;
    canon_sumsq_init(&total);
    canon_sumsq_init(&experts);
    int split_experts = z->stage == 0 && z->ep->size > 1;
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u] || (u == ZERO_WTE && z->pp_stage != 0) ||
            !z->counts_params) {
            continue;
        }
        SumSq* acc = split_experts && zero_is_expert_unit(&z->lay, u) ? &experts : &total;
        size_t b, e;
        zero_my_range(z, u, &b, &e);
        const float* g = u == ZERO_WTE ? zero_wte_grad_at(z, b) : zero_grad_at(z, u, b);
        for (int k = 0; k < z->lay.npieces[u]; k++) {
            const TPPiece* p = &z->lay.pieces[u][k];
            if (p->split == TP_REPLICATED && z->lay.cut.r != 0) { continue; }
            size_t lo = p->local > b ? p->local : b, hi = p->local + tp_piece_elements(p);
            if (hi > e) { hi = e; }
            if (lo >= hi) { continue; }
            z->mem->sumsq(acc, g + (lo - b), hi - lo);
        }
    }
    if (z->stage >= 1) { comm_all_reduce_sumsq(z->group, &total, COMM_KIND_OTHER); }
    if (split_experts) {
        comm_all_reduce_sumsq(z->ep, &experts, COMM_KIND_OTHER);
        canon_sumsq_merge(&total, &experts);
    }
    comm_all_reduce_sumsq(tp, &total, COMM_KIND_OTHER);
    comm_all_reduce_sumsq(z->pp, &total, COMM_KIND_OTHER);
    return (float)sqrt(canon_sumsq_value(&total));
}

// AdamW on this rank's ranges, then (stages 1-2) all-gather every unit's parameters, or with bf16
// weights refresh them (stage 0 rounds, stages 1-2 gather the rounded shards).
static inline void zero_adamw_step(Zero* z, const AdamWStep* s, float weight_decay) {
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u]) { continue; }
        size_t b, e;
        zero_my_range(z, u, &b, &e);
        float* p = zero_param_at(z, u, b);
        const float* g = u == ZERO_WTE ? zero_wte_grad_at(z, b) : zero_grad_at(z, u, b);
        size_t o = zero_opt_index(z, u, b);
        for (int k = 0; k < z->lay.npieces[u]; k++) {   // weight decay is per tensor
            const TPPiece* piece = &z->lay.pieces[u][k];
            size_t lo = piece->local > b ? piece->local : b, hi = piece->local + tp_piece_elements(piece);
            if (hi > e) { hi = e; }
            if (lo >= hi) { continue; }
            float wd = param_is_decayed(piece->tensor) ? weight_decay : 0.0f;
            size_t i = lo - b;
            z->mem->adamw(p + i, z->m + o + i, z->v + o + i, g + i, hi - lo, s, wd);
        }
    }
    if (z->bf16_weights) {
        zero_weights_refresh(z);
    } else if (z->stage == 1 || z->stage == 2) {
        // all-gather (dp group; edp group for an expert unit; parameters): every rank's
        // updated shard -> the whole unit
        for (int u = 0; u < z->lay.num_all; u++) {
            if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u]) { continue; }
            ZeroSlot* slot = zero_slot_get(z, z->sslots, &z->nsslots, u);
            size_t b, e;
            int r = zero_unit_rank(z, u);
            zero_shard_range(&z->lay, u, r, &b, &e);
            float* unit = z->params + z->lay.local[u];
            float* mine = slot->buf + (size_t)r * z->lay.shard[u];
            z->mem->copy(mine, unit + b, (e - b) * sizeof(float));
            z->mem->fill(mine + (e - b), 0.0f, z->lay.shard[u] - (e - b));
            comm_all_gather(zero_unit_group(z, u), mine, slot->buf, z->lay.shard[u], COMM_KIND_PARAM);
            z->mem->copy(unit, slot->buf, z->lay.size[u] * sizeof(float));
            slot->unit = -1;
        }
    }
}

// This rank's share of the full parameters, written into dst (host memory, canonical MEMORY
// order, P floats) where dst != NULL: each element by exactly one rank of the dp rank-0 ranks
// (wte by the first stage, replicated tensors by tensor-parallel rank 0), the experts of an
// expert-parallel run by the ranks of dp rank 0's ep group (edp rank 0); the rest of dst is
// left as is. Sharded parameters (stage 3; bf16 weights from stage 1) are gathered unit by
// unit: every dp rank must call.
typedef struct { float* dst; const float* src; } ZeroScatterCtx;
static inline void zero_scatter_run(size_t canonical, size_t local, size_t len, void* vctx) {
    ZeroScatterCtx* ctx = (ZeroScatterCtx*)vctx;
    memcpy(ctx->dst + canonical, ctx->src + local, len * sizeof(float));
}
static inline void zero_full_params(Zero* z, float* dst) {
    float* unit = dst ? (float*)host_alloc(z->max_padded * sizeof(float), "parameter unit") : NULL;
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u]) { continue; }
        const float* held = zero_params_acquire(z, u, -1);
        int writer = zero_is_expert_unit(&z->lay, u) ? z->edp->rank == 0 : z->rank == 0;
        if (dst && writer && z->counts_params && !(u == ZERO_WTE && z->pp_stage != 0)) {
            z->mem->to_host(unit, held, z->lay.size[u] * sizeof(float));
            ZeroScatterCtx ctx = {dst, unit};
            for (int k = 0; k < z->lay.npieces[u]; k++) {
                const TPPiece* p = &z->lay.pieces[u][k];
                if (p->split == TP_REPLICATED && z->lay.cut.r != 0) { continue; }
                tp_piece_runs(p, 0, tp_piece_elements(p), zero_scatter_run, &ctx);
            }
        }
        zero_params_release(z, u);
    }
    free(unit);
}

// The optimizer-state ranges of this rank as ranges of the canonical parameter index, with
// their m and v in host memory (z->m_host, z->v_host: see zero_state_to_host). writing = 1: only what this rank saves (each parameter by one rank: wte by the
// first stage, replicated tensors by tensor-parallel rank 0; the caller decides which dp ranks
// write at ZeRO-0); writing = 0: everything it updates (what it reads on resume). Returns the
// count; out may be NULL to count.
typedef struct { StateRange* out; int n; const Zero* z; int u; size_t b; } ZeroRangeCtx;
static inline void zero_range_run(size_t canonical, size_t local, size_t len, void* vctx) {
    ZeroRangeCtx* ctx = (ZeroRangeCtx*)vctx;
    if (ctx->out) {
        size_t at = zero_opt_index(ctx->z, ctx->u, local);
        StateRange r = {(int64_t)canonical, (int64_t)(canonical + len), ctx->z->m_host + at, ctx->z->v_host + at};
        ctx->out[ctx->n] = r;
    }
    ctx->n++;
}
static inline int zero_state_ranges(const Zero* z, int writing, StateRange* out) {
    ZeroRangeCtx ctx = {out, 0, z, 0, 0};
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u] ||
            (writing && ((u == ZERO_WTE && z->pp_stage != 0) || !z->counts_params))) {
            continue;
        }
        // ZeRO-0 replicates: dp rank 0 writes the dense units, edp rank 0 the expert units
        if (writing && z->stage == 0 && zero_unit_rank(z, u) != 0) { continue; }
        size_t b, e;
        zero_my_range(z, u, &b, &e);
        ctx.u = u;
        for (int k = 0; k < z->lay.npieces[u]; k++) {
            const TPPiece* p = &z->lay.pieces[u][k];
            if (writing && p->split == TP_REPLICATED && z->lay.cut.r != 0) { continue; }
            size_t lo = p->local > b ? p->local : b, hi = p->local + tp_piece_elements(p);
            if (hi > e) { hi = e; }
            if (lo < hi) { tp_piece_runs(p, lo - p->local, hi - p->local, zero_range_run, &ctx); }
        }
    }
    return ctx.n;
}

// The AdamW moments where the host can read and write them (checkpoints): z->m_host and
// z->v_host are m and v themselves in host memory, else host copies refreshed here.
// zero_state_from_host copies what a resume read into them back into place.
static inline void zero_state_host_buffers(Zero* z) {
    if (z->m_host) { return; }
    if (z->mem == &memory_host) { z->m_host = z->m; z->v_host = z->v; return; }
    z->m_host = (float*)host_alloc(z->opt_len * sizeof(float), "AdamW m (host copy)");
    z->v_host = (float*)host_alloc(z->opt_len * sizeof(float), "AdamW v (host copy)");
}
static inline void zero_state_to_host(Zero* z) {
    zero_state_host_buffers(z);
    if (z->m_host == z->m) { return; }
    z->mem->to_host(z->m_host, z->m, z->opt_len * sizeof(float));
    z->mem->to_host(z->v_host, z->v, z->opt_len * sizeof(float));
}
static inline void zero_state_from_host(Zero* z) {
    if (z->m_host == z->m) { return; }
    z->mem->from_host(z->m, z->m_host, z->opt_len * sizeof(float));
    z->mem->from_host(z->v, z->v_host, z->opt_len * sizeof(float));
}

// Bytes each rank holds, by kind (what the startup table prints and the tests check).
// weights: the bf16 weights (stages 0-2 the copy of every unit, stage 3 the buffers it gathers
// into); 0 when the passes read the fp32 parameters.
typedef struct { double params, grads, optimizer, weights; } ZeroMemory;

static inline ZeroMemory zero_memory(const Zero* z) {
    ZeroMemory mem;
    mem.params = 4.0 * (!zero_params_sharded(z) ? z->lay.local_params
                                                : z->lay.shard_params + (z->flexsp ? z->lay.local_params : 0));   // + FlexSP's step copy
    mem.grads = 4.0 * (z->stage <= 1 ? z->lay.local_grads : z->lay.shard_grads);
    mem.optimizer = 8.0 * (z->stage == 0 ? z->lay.local_params : z->lay.shard_params);
    mem.weights = !z->bf16_weights ? 0.0 : z->stage <= 2 ? 2.0 * z->lay.local_weights : 4.0 * z->nwslots * z->wslot_floats;
    return mem;
}

static inline void zero_free(Zero* z) {
    const MemOps* mem = z->mem;
    if (z->m_host != z->m) { free(z->m_host); free(z->v_host); }
    mem->release(z->params); mem->release(z->param_shard); mem->release(z->m); mem->release(z->v);
    for (int i = 1; i < z->stack_allocated; i++) { mem->release(z->stack[i]); }
    mem->release(z->grads); mem->release(z->grad_shard);
    mem->release(z->flexsp_grads);
    mem->release(z->flexsp_params);
    for (int i = 0; i < z->ngslots; i++) { mem->release(z->gslots[i].buf); }
    for (int i = 0; i < z->npslots; i++) { mem->release(z->pslots[i].buf); }
    for (int i = 0; i < z->nsslots; i++) { mem->release(z->sslots[i].buf); }
    for (int i = 0; i < z->nwslots; i++) { mem->release(z->wslots[i].buf); }
    mem->release(z->weights);
    free(z->unit_grad);
    free(z->unit_chunk);
    zero_layout_free(&z->lay);
}

#endif // LLMC_ZERO_H
