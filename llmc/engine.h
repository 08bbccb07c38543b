/*
 * engine.h: the training engine both builds share. Everything that is not a kernel or the model
 * is here, written once: the start of a run (flags, the rank grid, what the model starts from,
 * data, resume), the pipeline executor (every run is a pipeline, of one stage without --pp),
 * validation, sampling, checkpoints, the training loop and its console and main.log lines.
 *
 * A build hands the engine two tables:
 *   ModelOps (below)  its model of one model chunk (a pipeline stage, or one of a stage's
 *                     virtual stages): activations, the embeddings, the chunk's transformer
 *                     layers and the head, forward and backward (whole, or its input and
 *                     weight halves for the zero-bubble schedules). train_gpt2.c's
 *                     model on the CPU kernels (the CPU build), the same model on the CUDA
 *                     deterministic kernels (train_gpt2cu --deterministic 1), or fast mode's
 *                     bf16 model (train_gpt2_fast.cu).
 *   MemOps (memory.h) the memory the tensors live in (host or device), through which ZeRO
 *                     (zero.h) and the communicator (comm.h) do all their work.
 * Both builds therefore print the same lines and write the same files by construction; a
 * build adds only its banner lines and how it states throughput (GFLOP/s on the CPU, MFU on a
 * GPU).
 *
 * A main is:
 *   Trainer t;
 *   if (!trainer_begin(&t, argc, argv)) { return 0; }   // --help
 *   ... build-specific checks of t.args and t.config, the device ...
 *   trainer_build(&t, &model_ops, &memory_ops);
 *   trainer_run(&t, &build);                            // table, the loop, the summary
 *   trainer_end(&t);
 */
#ifndef LLMC_ENGINE_H
#define LLMC_ENGINE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llmc/utils.h"
#include "llmc/canonical.h"
#include "llmc/model.h"
#include "llmc/checkpoint.h"
#include "llmc/adamw.h"
#include "llmc/gpt2_init.h"
#include "llmc/dataloader.h"
#include "llmc/tokenizer.h"
#include "llmc/logger.h"
#include "llmc/args.h"
#include "llmc/memory.h"
#include "llmc/comm.h"
#include "llmc/zero.h"
#include "llmc/pipeline.h"
#include "llmc/sampler.h"
#include "llmc/expert_parallel.h"

// ==========================================================================================
// The model, as the engine drives it
// ==========================================================================================

// Which half of a backward to run: both, the input gradient only (what the stage before waits
// for) or the weight gradient only (the zero-bubble schedules, pipeline.h). The halves compute
// exactly the sums of the whole, so splitting changes no bits.
#define BACKWARD_INPUT 1
#define BACKWARD_WEIGHT 2
#define BACKWARD_BOTH (BACKWARD_INPUT | BACKWARD_WEIGHT)

// One build's model of one model chunk (ChunkPlace, zero.h: a pipeline stage's layers, or one
// of its virtual stages'; every chunk of a rank shares the rank's Zero). `model`, `acts` and
// `grads` are the build's own structures; every float* is in the build's memory (MemOps),
// tokens come from host memory. Forward and backward come in three parts, run by the chunks
// that hold them: the embeddings, the chunk's transformer layers, the head (final layernorm,
// LM head, cross-entropy).
typedef struct {
    // the model of one chunk of this rank; its parameters, gradients and AdamW state are in
    // `zero`; seq_parallel: Megatron's sequence parallelism over the tensor-parallel group, for
    // passes over up to (B, T) positions; cp: the context-parallel group (context_parallel.h;
    // one rank: none), cp_a2a its all-to-all attention (else the ring)
    void* (*create)(const GPT2Config* config, const ChunkPlace* place, Zero* zero, CommGroup* tp,
                    CommGroup* cp, int cp_a2a, int seq_parallel, int B, int T);
    void (*destroy)(void* model);
    // activations of one pass over up to (B, T) positions; split_seqs: split the sequences as
    // the model's seq_parallel and cp say (a pass of the sampler runs unsplit); split_backward:
    // room for what a split backward keeps between its halves; *bytes: their size
    void* (*acts_create)(void* model, int B, int T, int recompute, int split_seqs, int split_backward,
                         size_t* bytes);
    void (*acts_destroy)(void* model, void* acts);
    // the microbatch's tokens (host memory; targets NULL: no loss)
    void (*set_tokens)(void* model, void* acts, const int* inputs, const int* targets, int B, int T);
    float* (*stage_input)(void* model, void* acts);   // where a received activation goes
    float* (*stage_output)(void* model, void* acts, int B, int T);
    void (*embed_forward)(void* model, void* acts, int B, int T);
    void (*layers_forward)(void* model, void* acts, int B, int T);
    void (*head_forward)(void* model, void* acts, int B, int T, int training);
    float (*loss_sum)(void* model, void* acts, int B, int T);   // R3 sum of the last pass's losses
    // the probabilities at `position` over the whole padded vocabulary (Vp floats, host memory);
    // every tensor-parallel rank of the head's stage calls it
    void (*probs_at)(void* model, void* acts, int position, float* host_probs);
    // gradients of activations during backward, one set reused by every microbatch, chunk and
    // layer; its d(residual) is d(loss)/d(chunk output) going in and d(loss)/d(chunk input)
    // coming out of an input half. part: BACKWARD_BOTH, _INPUT or _WEIGHT (the weight half of
    // a (microbatch, chunk) after its input half, from what that kept in acts)
    void* (*grads_create)(void* model, int B, int T, int split_seqs, size_t* bytes);
    void (*grads_destroy)(void* model, void* grads);
    float* (*grad_residual)(void* model, void* grads);
    void (*head_backward)(void* model, void* acts, void* grads, int B, int T, float dloss, int part);
    void (*layers_backward)(void* model, void* acts, void* grads, int B, int T, int part);
    void (*embed_backward)(void* model, void* acts, void* grads, int B, int T, int part);
    // a model with experts (llmc/moe.h; NULL without): the load-balancing loss of each of the
    // chunk's layers in the last forward pass of acts (host, one float per layer), and the
    // routing counters, which the engine reads and zeroes every step
    void (*moe_aux)(void* model, void* acts, float* host_aux);
    MoeCounters* (*moe_counters)(void* model);
    // generation with a KV cache (NULL: the build has none, and the sampler runs a full
    // forward per token): row t of a pass laid out over (1, T), the rows before it computed by
    // the earlier calls; equal to row t of the full forward over (1, T), bit for bit (the
    // reference model runs its forward on the one row).
    void (*embed_decode)(void* model, void* acts, int token, int t, int T);
    void (*layers_decode)(void* model, void* acts, int t, int T);
    void (*head_decode)(void* model, void* acts, int t, int T);
} ModelOps;

// What a build adds to the engine's console output.
typedef struct {
    const char* program;                        // "train_gpt2", "train_gpt2cu"
    void (*banner)(void);                       // its first lines of the startup table
    void (*memory_line)(void);                  // a line after the memory table (NULL: none)
    // the throughput field of the step line, e.g. "95.0 GFLOP/s" or "MFU 41.2%"
    void (*throughput)(char* out, size_t len, double flops_per_second);
    // the run summary's, against the machine's peak, e.g. "95.0 GFLOP/s, 41% of ... peak"
    void (*summary_throughput)(char* out, size_t len, double flops_per_second);
} BuildInfo;

static inline double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// The cost of the head (LM head matmuls and cross-entropy) in units of one transformer
// layer, per token: the LM head is 2*C*Vp flops forward, a layer about 24*C^2.
static inline double head_cost_in_layers(const GPT2Config* c) {
    return (double)c->padded_vocab_size / (12.0 * c->channels);
}

// ==========================================================================================
// Pipeline execution: a stage runs its list of actions from llmc/pipeline.h
// ==========================================================================================
//
// Every rank runs a pipeline, of one stage when --pp is 1 (then the list is just F0 B0 F1
// B1 ...). A rank holds v model chunks (virtual stages; v = 1 but for interleaved and zbv),
// each with its own model on the rank's one Zero. A (microbatch, chunk) pair owns a slot of its
// chunk from its FORWARD to its BACKWARD (or, split, its BACKWARD_WEIGHT) on this stage: its
// activations (with its tokens) and the received gradient of its output; the schedule bounds
// how many are alive (1F1B: S - stage). Messages are non-blocking: a receive is posted at its
// RECV action and waited for right before the computation that reads it; a send is posted at
// its SEND action and waited for before its buffer is reused. Received activations and sent
// input gradients live in small message buffers of their own, so a receive posted early never
// needs a second slot. The schedule's message order makes this deadlock-free (pipeline.h).
// Consecutive virtual stages on one rank (zbv's tip of the V) hand over in memory: the forward
// reads the producer slot's output, the backward an input gradient kept in a message buffer.
// Tags name (microbatch, the boundary between virtual stages w and w+1, direction).
// Every buffer is in the build's memory.

typedef struct {
    int chunk;                 // the chunk whose activations these are
    int microbatch;            // -1: free
    void* acts;                // the model's activations, with the microbatch's tokens
    float* grad_out;           // (B,T,C) received d(loss)/d(chunk output)
    CommRequest* recv_grad;
    CommRequest* send_act;     // the chunk output being sent (the slot is not reused before)
} MicroSlot;

typedef enum { MSG_FREE, MSG_RECEIVING, MSG_TO_SEND, MSG_SENDING, MSG_HANDOFF } MessageState;

typedef struct {
    float* buf;                // (B,T,C)
    CommRequest* req;
    int microbatch, chunk;
    MessageState state;        // RECEIVING: an input activation until its FORWARD; TO_SEND: an
                               // input gradient from BACKWARD until its SEND_BACKWARD; HANDOFF:
                               // an input gradient for this rank's chunk `chunk`, until its
                               // BACKWARD
} MessageBuffer;

#define PP_MAX_MESSAGES 256

typedef struct {
    PipelineConfig cfg;
    PipelineAction* actions;
    int nactions;
    int nchunks;               // v
    void** models;             // [v] the model of each chunk
    ChunkPlace* places;        // [v]
    int* vstage;               // [v] each chunk's virtual stage
    int head_chunk;            // the chunk holding the head, or -1
    MicroSlot* slots;          // every chunk's slots
    int nslots;
    MessageBuffer msgs[PP_MAX_MESSAGES];
    int nmsgs;
    size_t msg_floats;
    CommGroup* pp;
    const ModelOps* ops;
    const MemOps* mem;
    int split;                 // the schedule splits backwards into input and weight halves
    double busy;               // seconds of computation in the last step
    double fwd, bwd, wgt;      // ... of which forwards, backwards (whole or input halves), weight halves
    int held, peak_held;       // (microbatch, chunk) activations alive now / at most in the last step
    size_t slot_bytes;         // every slot's bytes
    float* moe_aux;            // experts: (microbatches x L) each forward's aux loss per layer,
                               // -0.0f for the layers of other stages
    int num_layers;            // L
} Pipeline;

// The chunk of this stage holding virtual stage vs (-1: another stage's).
static inline int pipeline_chunk_of(const Pipeline* p, int vs) {
    int stage, chunk;
    pipeline_virtual_stage_owner(&p->cfg, vs, &stage, &chunk);
    return stage == p->pp->rank ? chunk : -1;
}

// The message tag of microbatch i crossing boundary w (between virtual stages w and w+1), forward
// or backward; modulo the 32768 every MPI accepts (the lists' message order pairs sends and
// receives anyway, pipeline.h).
static inline int pipeline_tag(const Pipeline* p, int i, int boundary, int backward) {
    long long V = (long long)p->cfg.num_stages * p->cfg.num_chunks;
    return (int)((((long long)i * V + boundary) * 2 + backward) % 32768);
}

static inline void pipeline_init(Pipeline* p, const ModelOps* ops, const MemOps* mem, void** models,
                                 const ChunkPlace* places, CommGroup* pp, PipelineScheduleKind kind, int nchunks,
                                 int M, int B, int T, int C, int recompute, int sp_degree) {
    memset(p, 0, sizeof(*p));
    p->pp = pp;
    p->ops = ops;
    p->mem = mem;
    p->nchunks = nchunks;
    p->models = models;
    p->places = (ChunkPlace*)malloc_or_die(sizeof(ChunkPlace) * nchunks, "pipeline chunks");
    memcpy(p->places, places, sizeof(ChunkPlace) * nchunks);
    p->cfg = (PipelineConfig){pp->size, M, kind, nchunks};
    p->split = pipeline_splits_backward(kind);
    char err[256];
    int n = pipeline_stage_actions(&p->cfg, pp->rank, NULL, 0, err, sizeof(err));
    if (n < 0) { fatal("--pp/--schedule: %s", err); }
    p->actions = (PipelineAction*)malloc_or_die(sizeof(PipelineAction) * (n ? n : 1), "pipeline actions");
    if (pipeline_stage_actions(&p->cfg, pp->rank, p->actions, n, err, sizeof(err)) != n) {
        fatal("--pp/--schedule: %s", err);
    }
    p->nactions = n;
    p->vstage = (int*)malloc_or_die(sizeof(int) * nchunks, "pipeline chunks");
    p->head_chunk = -1;
    for (int c = 0; c < nchunks; c++) {
        p->vstage[c] = pipeline_virtual_stage(&p->cfg, pp->rank, c);
        if (places[c].has_head) { p->head_chunk = c; }
    }
    // each chunk gets as many slots as its own actions ever hold at once
    PipelineAction* mine = (PipelineAction*)malloc_or_die(sizeof(PipelineAction) * (n ? n : 1), "pipeline actions");
    int* count = (int*)calloc_or_die((size_t)nchunks, sizeof(int), "pipeline chunks");
    for (int c = 0; c < nchunks; c++) {
        int k = 0;
        for (int j = 0; j < n; j++) { if (p->actions[j].chunk == c) { mine[k++] = p->actions[j]; } }
        count[c] = pipeline_max_in_flight(mine, k);
        p->nslots += count[c];
    }
    free(mine);
    p->slots = (MicroSlot*)calloc_or_die((size_t)(p->nslots ? p->nslots : 1), sizeof(MicroSlot), "pipeline slots");
    p->msg_floats = (size_t)B * T / sp_degree * C;
    for (int c = 0, k = 0; c < nchunks; c++) {
        for (int j = 0; j < count[c]; j++, k++) {
            MicroSlot* s = &p->slots[k];
            size_t bytes = 0;
            s->chunk = c;
            s->microbatch = -1;
            s->acts = ops->acts_create(models[c], B, T, recompute, sp_degree > 1, p->split, &bytes);
            s->grad_out = mem_floats(mem, p->msg_floats, "pipeline gradient");
            p->slot_bytes += bytes + sizeof(float) * p->msg_floats;
        }
    }
    free(count);
}

static inline void pipeline_free(Pipeline* p) {
    for (int i = 0; i < p->nslots; i++) {
        p->ops->acts_destroy(p->models[p->slots[i].chunk], p->slots[i].acts);
        p->mem->release(p->slots[i].grad_out);
    }
    for (int i = 0; i < p->nmsgs; i++) { p->mem->release(p->msgs[i].buf); }
    free(p->slots);
    free(p->actions);
    free(p->places);
    free(p->vstage);
}

// The first slot of chunk c (forward-only passes use it between steps).
static inline void* pipeline_chunk_acts(Pipeline* p, int c) {
    for (int k = 0; k < p->nslots; k++) { if (p->slots[k].chunk == c) { return p->slots[k].acts; } }
    fatal("internal: chunk %d has no pipeline slot", c);
}

// The slot of (microbatch i, chunk c); with `take`, a free one of the chunk (its output's send
// completed) if it has none.
static inline MicroSlot* pipeline_slot(Pipeline* p, int i, int c, int take) {
    for (int k = 0; k < p->nslots; k++) {
        if (p->slots[k].microbatch == i && p->slots[k].chunk == c) { return &p->slots[k]; }
    }
    if (!take) { fatal("internal: microbatch %d of chunk %d has no pipeline slot", i, c); }
    for (int k = 0; k < p->nslots; k++) {
        MicroSlot* s = &p->slots[k];
        if (s->chunk == c && s->microbatch < 0) {
            comm_wait(s->send_act);
            s->send_act = NULL;
            s->microbatch = i;
            if (++p->held > p->peak_held) { p->peak_held = p->held; }
            return s;
        }
    }
    fatal("internal: more microbatches in flight than the schedule's bound");
}

static inline void pipeline_slot_release(Pipeline* p, MicroSlot* s) {
    s->microbatch = -1;   // its activations are no longer needed
    p->held--;
}

// A message buffer for (microbatch i, chunk c) in `state`: a free one (a completed send's is
// reused).
static inline MessageBuffer* pipeline_message_new(Pipeline* p, int i, int c, MessageState state) {
    MessageBuffer* m = NULL;
    for (int k = 0; k < p->nmsgs && m == NULL; k++) {
        MessageBuffer* q = &p->msgs[k];
        if (q->state == MSG_SENDING && comm_test(q->req)) { comm_wait(q->req); q->req = NULL; q->state = MSG_FREE; }
        if (q->state == MSG_FREE) { m = q; }
    }
    if (m == NULL) {
        if (p->nmsgs == PP_MAX_MESSAGES) { fatal("internal: too many pipeline messages in flight"); }
        m = &p->msgs[p->nmsgs++];
        m->buf = mem_floats(p->mem, p->msg_floats, "pipeline message");
    }
    m->microbatch = i;
    m->chunk = c;
    m->state = state;
    return m;
}

// The message buffer of (microbatch i, chunk c) in `state`.
static inline MessageBuffer* pipeline_message(Pipeline* p, int i, int c, MessageState state) {
    for (int k = 0; k < p->nmsgs; k++) {
        MessageBuffer* m = &p->msgs[k];
        if (m->state == state && m->microbatch == i && m->chunk == c) { return m; }
    }
    fatal("internal: no pipeline message for microbatch %d of chunk %d", i, c);
}

// Runs this stage's actions for one optimizer step: forward and backward of this dp rank's
// microbatches (global indices from zero.h) on each of its chunks, gradients reduced, the tied
// halves summed. local_loss[i] gets microbatch i's loss sum on the head's stage. The compute
// times (busy, fwd, bwd, wgt) are measured only with several stages (they wait for the device
// to finish each computation).
static inline void pipeline_step(Pipeline* p, Zero* z, void* grads, DataLoader* loader,
                                 int64_t first_microbatch, int M_global, int B, int T, int overfit,
                                 float* local_loss) {
    const ModelOps* ops = p->ops;
    size_t bytes = p->msg_floats * sizeof(float);
    int timed = p->cfg.num_stages > 1, last_vs = p->cfg.num_stages * p->cfg.num_chunks - 1;
    float dloss = 1.0f / (float)((double)B * T * M_global);
    float* dres = ops->grad_residual(p->models[0], grads);
    p->busy = p->fwd = p->bwd = p->wgt = 0.0;
    p->peak_held = p->held;
    for (int k = 0; k < p->nactions; k++) {
        const PipelineAction* act = &p->actions[k];
        int i = act->microbatch, c = act->chunk, vs = p->vstage[c];
        void* model = p->models[c];
        const ChunkPlace* place = &p->places[c];
        MicroSlot* s;
        MessageBuffer* m;
        double t0;
        int part = act->kind == PP_BACKWARD ? BACKWARD_BOTH : act->kind == PP_BACKWARD_INPUT ? BACKWARD_INPUT
                 : BACKWARD_WEIGHT;
        switch (act->kind) {
            case PP_RECV_FORWARD:
                // irecv (pp group): the input activation of (microbatch i, chunk c) from the
                // stage holding virtual stage vs - 1
                m = pipeline_message_new(p, i, c, MSG_RECEIVING);
                m->req = comm_irecv(p->pp, m->buf, p->msg_floats, act->peer, pipeline_tag(p, i, vs - 1, 0), COMM_KIND_PP);
                break;
            case PP_FORWARD:
                s = pipeline_slot(p, i, c, 1);
                if (place->has_embedding || place->has_head) {
                    dataloader_load(loader, overfit ? 0 : zero_global_microbatch(z, first_microbatch, i));
                    ops->set_tokens(model, s->acts, loader->inputs, loader->targets, B, T);
                }
                if (!place->has_embedding) {   // waiting for the input is idle time, not compute
                    int producer = pipeline_chunk_of(p, vs - 1);
                    if (producer >= 0) {        // a hand-off on this rank
                        MicroSlot* from = pipeline_slot(p, i, producer, 0);
                        p->mem->copy(ops->stage_input(model, s->acts),
                                     ops->stage_output(p->models[producer], from->acts, B, T), bytes);
                    } else {
                        m = pipeline_message(p, i, c, MSG_RECEIVING);
                        comm_wait(m->req);
                        p->mem->copy(ops->stage_input(model, s->acts), m->buf, bytes);
                        m->req = NULL;
                        m->state = MSG_FREE;
                    }
                }
                t0 = now_seconds();
                if (place->has_embedding) { ops->embed_forward(model, s->acts, B, T); }
                ops->layers_forward(model, s->acts, B, T);
                if (p->moe_aux) {
                    ops->moe_aux(model, s->acts, p->moe_aux + (size_t)i * p->num_layers + place->first_layer);
                }
                if (place->has_head) {
                    ops->head_forward(model, s->acts, B, T, 1);
                    local_loss[i] = ops->loss_sum(model, s->acts, B, T);
                }
                if (timed) { p->mem->sync(); }
                p->fwd += now_seconds() - t0;
                break;
            case PP_SEND_FORWARD:
                // isend (pp group): the output of (microbatch i, chunk c) to the stage holding
                // virtual stage vs + 1
                s = pipeline_slot(p, i, c, 0);
                s->send_act = comm_isend(p->pp, ops->stage_output(model, s->acts, B, T), p->msg_floats,
                                         act->peer, pipeline_tag(p, i, vs, 0), COMM_KIND_PP);
                break;
            case PP_RECV_BACKWARD:
                // irecv (pp group): d(loss)/d(output of (microbatch i, chunk c)) from the stage
                // holding virtual stage vs + 1
                s = pipeline_slot(p, i, c, 0);
                s->recv_grad = comm_irecv(p->pp, s->grad_out, p->msg_floats, act->peer, pipeline_tag(p, i, vs, 1),
                                          COMM_KIND_PP);
                break;
            case PP_BACKWARD:
            case PP_BACKWARD_INPUT:
            case PP_BACKWARD_WEIGHT:
                s = pipeline_slot(p, i, c, 0);
                if ((part & BACKWARD_INPUT) && vs < last_vs) {   // d(loss)/d(chunk output)
                    if (pipeline_chunk_of(p, vs + 1) >= 0) {     // a hand-off on this rank
                        m = pipeline_message(p, i, c, MSG_HANDOFF);
                        p->mem->copy(dres, m->buf, bytes);
                        m->state = MSG_FREE;
                    } else {
                        comm_wait(s->recv_grad);
                        s->recv_grad = NULL;
                        p->mem->copy(dres, s->grad_out, bytes);
                    }
                }
                t0 = now_seconds();
                // the weight gradients go into the chunk's microbatch tree (zero.h)
                if (part & BACKWARD_WEIGHT) { zero_begin_microbatch(z, c, i); }
                if (place->has_head) { ops->head_backward(model, s->acts, grads, B, T, dloss, part); }
                ops->layers_backward(model, s->acts, grads, B, T, part);
                if (place->has_embedding) { ops->embed_backward(model, s->acts, grads, B, T, part); }
                if ((part & BACKWARD_INPUT) && vs > 0) {   // keep d(loss)/d(chunk input)
                    int consumer = pipeline_chunk_of(p, vs - 1);
                    m = consumer >= 0 ? pipeline_message_new(p, i, consumer, MSG_HANDOFF)
                                      : pipeline_message_new(p, i, c, MSG_TO_SEND);
                    p->mem->copy(m->buf, dres, bytes);
                }
                if (part & BACKWARD_WEIGHT) {
                    zero_end_microbatch(z);
                    pipeline_slot_release(p, s);
                }
                if (timed) { p->mem->sync(); }
                if (part == BACKWARD_WEIGHT) { p->wgt += now_seconds() - t0; } else { p->bwd += now_seconds() - t0; }
                break;
            case PP_SEND_BACKWARD:
                // isend (pp group): d(loss)/d(input of (microbatch i, chunk c)) to the stage
                // holding virtual stage vs - 1
                m = pipeline_message(p, i, c, MSG_TO_SEND);
                m->state = MSG_SENDING;
                m->req = comm_isend(p->pp, m->buf, p->msg_floats, act->peer, pipeline_tag(p, i, vs - 1, 1), COMM_KIND_PP);
                break;
        }
    }
    for (int k = 0; k < p->nslots; k++) { comm_wait(p->slots[k].send_act); p->slots[k].send_act = NULL; }
    for (int k = 0; k < p->nmsgs; k++) { comm_wait(p->msgs[k].req); p->msgs[k].req = NULL; p->msgs[k].state = MSG_FREE; }
    p->busy = p->fwd + p->bwd + p->wgt;
    zero_finish_grads(z);
}

// The step's mean load-balancing loss, logged beside the cross-entropy: per microbatch the
// sum over the layers in layer order, then the mean over microbatches as global_mean_loss
// takes it. aux (microbatches x L) holds this stage's layers, -0.0f for the others; every
// stage's layers are summed into one table (all-reduce, pp group: each value is held by one
// stage, -0.0f elsewhere, exact).
static inline void moe_microbatch_aux(CommGroup* pp, int L, const float* aux, int micro, float* out) {
    float* all = (float*)malloc_or_die(sizeof(float) * (size_t)micro * L + 1, "aux losses");
    memcpy(all, aux, sizeof(float) * (size_t)micro * L);
    if (pp->size > 1) { comm_all_reduce_sum(pp, all, (size_t)micro * L, COMM_KIND_OTHER); }
    for (int i = 0; i < micro; i++) {
        float s = 0.0f;
        for (int l = 0; l < L; l++) { s = s + all[(size_t)i * L + l]; }
        out[i] = s;
    }
    free(all);
}

// A forward-only pass of one batch through the pipeline (validation, sampling), acts[c] the
// activations of chunk c: the virtual stages in model order, each on the stage holding it; the
// first embeds the tokens, each receives its input (or takes it from the chunk before on this
// rank), runs its layers and sends its output on; the last runs the head. Blocking sends and
// receives: every stage walks the virtual stages in the same order.
// sp_degree: the tensor-parallel degree if acts are sequence-parallel, else 1.
// row >= 0 (generation with a KV cache, B = 1): only position `row` of the pass laid out over
// (1, T), its token inputs[row], through ModelOps' decode (the rows before it are in the
// chunks' activations from the earlier calls); one row of C floats goes from stage to stage.
static inline void pipeline_forward_pass(Pipeline* p, void** acts, const int* inputs, const int* targets,
                                         int B, int T, int C, int sp_degree, int row) {
    const ModelOps* ops = p->ops;
    int decode = row >= 0;
    size_t n = decode ? (size_t)C : (size_t)B * T / sp_degree * C;   // the message
    size_t at = decode ? (size_t)row * C : 0;                          // where it starts
    int V = p->cfg.num_stages * p->cfg.num_chunks;
    for (int vs = 0; vs < V; vs++) {
        int c = pipeline_chunk_of(p, vs);
        if (c < 0) { continue; }
        void* model = p->models[c];
        const ChunkPlace* place = &p->places[c];
        if (!decode && (place->has_embedding || place->has_head)) {
            ops->set_tokens(model, acts[c], inputs, targets, B, T);
        }
        if (place->has_embedding) {
            if (decode) { ops->embed_decode(model, acts[c], inputs[row], row, T); }
            else { ops->embed_forward(model, acts[c], B, T); }
        } else {
            int producer = pipeline_chunk_of(p, vs - 1);
            if (producer >= 0) {
                p->mem->copy(ops->stage_input(model, acts[c]) + at,
                             ops->stage_output(p->models[producer], acts[producer], B, T) + at, n * sizeof(float));
            } else {
                // recv (pp group): the output of virtual stage vs - 1
                comm_wait(comm_irecv(p->pp, ops->stage_input(model, acts[c]) + at, n, pp_owner_stage(&p->cfg, vs - 1),
                                     pipeline_tag(p, 0, vs - 1, 0), COMM_KIND_PP));
            }
        }
        if (decode) { ops->layers_decode(model, acts[c], row, T); }
        else { ops->layers_forward(model, acts[c], B, T); }
        if (place->has_head) {
            if (decode) { ops->head_decode(model, acts[c], row, T); }
            else { ops->head_forward(model, acts[c], B, T, 0); }
        } else if (pipeline_chunk_of(p, vs + 1) < 0) {
            // send (pp group): this output to the stage holding virtual stage vs + 1
            comm_wait(comm_isend(p->pp, ops->stage_output(model, acts[c], B, T) + at, n, pp_owner_stage(&p->cfg, vs + 1),
                                 pipeline_tag(p, 0, vs, 0), COMM_KIND_PP));
        }
    }
}

// ==========================================================================================
// The trainer
// ==========================================================================================

typedef struct {
    Comm comm;
    TrainArgs args;
    int root;                       // world rank 0: prints, writes main.log and the model file
    GPT2Config config;
    float* start_params;            // host, until trainer_build hands them to zero.h
    int resume_step;                // -1: a fresh start
    int B, T, M;                    // microbatch, sequence length, microbatches per step (global)
    long long tokens_per_micro, total_batch;
    PipelineScheduleKind pp_kind;
    LRScheduleKind lr_kind;
    int nchunks;                    // model chunks per pipeline rank (--vpp; zbv 2)
    // built by trainer_build
    const ModelOps* ops;
    const MemOps* mem;
    ChunkPlace* places;             // [nchunks] this rank's chunks (pipeline.h's placement)
    int head_stage;                 // the pipeline stage holding the head
    Zero zero;
    void** models;                  // [nchunks] the model of each chunk
    Pipeline pipe;
    void* grads;
    size_t grads_bytes;
    DataLoader train_loader, val_loader;
    int do_val, val_batches, train_steps;
    LRSchedule schedule;
    Tokenizer tokenizer;
    int do_sample, genT;
    void** sample_acts;             // [nchunks]
    float* sample_probs;            // host, Vp
    TrainProgress progress;
    Logger logger;
    int moe;                        // a mixture-of-experts model
    float* moe_micro_aux;           // (local microbatches) each one's aux loss, summed over layers
} Trainer;

// Every rank must run the same job: each compares its flags with world rank 0's (broadcast, as
// text) and stops the whole job at the first difference with one line naming the flag; a rank
// started with other flags would otherwise hang in a collective or train something else.
static inline void trainer_check_same_flags(Trainer* t) {
    char mine[128], theirs[128];
    for (int i = 0; i < NUM_ARG_SPECS; i++) {
        const ArgSpec* s = &arg_specs[i];
        train_arg_value_text(s, &t->args, mine, sizeof(mine));
        memcpy(theirs, mine, sizeof(theirs));
        // broadcast (world): rank 0's value of this flag
        comm_broadcast(&t->comm.world, theirs, sizeof(theirs), 0, COMM_KIND_OTHER);
        if (strncmp(mine, theirs, sizeof(mine)) != 0) {
            fatal("flag %s is '%s' on this rank but '%s' on rank 0: every rank of a job must run with the same "
                  "flags", s->name, mine, theirs);
        }
    }
}

// MPI, the flags (returns 0 after --help), the rank grid, and what the run starts from: the
// resume step (world rank 0 decides, every rank resumes from it), the full starting parameters
// (host), the batch. Checks that need only these.
static inline int trainer_begin(Trainer* t, int argc, char** argv) {
    memset(t, 0, sizeof(*t));
    comm_init(&t->comm, &argc, &argv);
    t->root = t->comm.world_rank == 0;
    TrainArgs* a = &t->args;
    train_args_defaults(a);
    if (train_args_parse(a, argc, argv)) {
        if (t->root) {
            TrainArgs defaults;
            train_args_defaults(&defaults);
            train_args_print_help(argv[0], &defaults);
        }
        comm_finalize(&t->comm);
        return 0;
    }
    train_args_validate(a);
    trainer_check_same_flags(t);
    if (a->sp && a->tp == 1) { fatal("--sp 1: sequence parallelism splits the sequence over the tensor-parallel group; it needs --tp > 1"); }
    if (t->comm.world_size % (a->tp * a->cp * a->pp) != 0) {
        fatal("--tp %d x --cp %d x --pp %d does not divide the %d ranks of this job", a->tp, a->cp, a->pp,
              t->comm.world_size);
    }
    comm_setup_grid_cp(&t->comm, a->tp, a->cp, a->pp);
    if (pipeline_parse_schedule(a->pp_schedule, &t->pp_kind, NULL, 0) != 0) { fatal("internal: --schedule"); }
    t->nchunks = train_args_chunks(a);
    if (!lr_schedule_kind(a->lr_schedule, &t->lr_kind)) {
        fatal("-k: unknown learning-rate schedule '%s' (cosine, linear or constant)", a->lr_schedule);
    }
    if (a->output_dir && t->root) {
        ensure_writable_dir(a->output_dir, "-o");
        checkpoint_remove_orphans(a->output_dir);   // temp files of a save that was killed
    }
    comm_barrier(&t->comm.world);

    // resume from the latest complete checkpoint in the output dir? World rank 0's decides
    // (broadcast, world): a rank whose directory lacks that checkpoint stops the job with one
    // line naming the file, instead of resuming from another step and hanging
    t->resume_step = a->resume && t->root ? checkpoint_latest_step(a->output_dir) : -1;
    comm_broadcast(&t->comm.world, &t->resume_step, sizeof(int), 0, COMM_KIND_OTHER);
    t->start_params = gpt2_starting_params(a->model, a->output_dir, t->resume_step, (uint64_t)a->seed,
                                           a->allow_nonfinite, &t->config);
    const GPT2Config* c = &t->config;
    int N = t->comm.dp;
    t->B = a->B;
    t->T = a->T;
    if (t->T > c->max_seq_len) { fatal("-t: sequence length %d exceeds the model's maxT = %d", t->T, c->max_seq_len); }
    if (a->pp > c->num_layers) {
        fatal("--pp %d: the model has only %d layers; every stage needs at least one", a->pp, c->num_layers);
    }
    if (c->num_experts > 0 && pipeline_splits_backward(t->pp_kind)) {
        fatal("--schedule %s: a mixture-of-experts model runs whole backwards (its expert exchanges are not split "
              "into input and weight halves); use 1f1b, gpipe or interleaved", a->pp_schedule);
    }
    if (a->pp * t->nchunks > c->num_layers) {
        fatal("--pp %d x %d model chunks (--schedule %s) = %d virtual stages: the model has only %d layers; every "
              "virtual stage needs at least one", a->pp, t->nchunks, a->pp_schedule, a->pp * t->nchunks, c->num_layers);
    }
    if (a->sp && t->T % (2 * a->tp) != 0) {
        fatal("--sp 1: the sequence length -t %d must be a multiple of 2 x --tp %d (each rank holds two stretches "
              "of every sequence)", t->T, a->tp);
    }
    t->config.aux_loss_coef = a->aux_loss;
    t->moe = c->num_experts > 0;
    if (t->moe && a->cp > 1) {
        fatal("--cp %d: a mixture-of-experts model runs without context parallelism (its routing and expert "
              "gradients are not split over a sequence's stretches); use --cp 1", a->cp);
    }
    if (a->ep > 1 && !t->moe) {
        fatal("--ep %d: expert parallelism needs a mixture-of-experts model (-e with eE, e.g. d4e8k2, or a version 7 file)", a->ep);
    }
    if (t->moe && c->num_experts % a->ep != 0) {
        fatal("--ep %d: the %d experts per layer must split evenly over the expert-parallel ranks", a->ep, c->num_experts);
    }
    if (a->ep > 1) { comm_setup_expert_groups(&t->comm, a->ep); }
    t->tokens_per_micro = (long long)t->B * t->T;
    t->total_batch = a->total_batch == -1 ? t->tokens_per_micro * N : a->total_batch;
    if (t->total_batch % (t->tokens_per_micro * N) != 0) {
        fatal("-d: total batch %lld tokens is not a multiple of B*T*DP = %d*%d*%d = %lld", t->total_batch,
              t->B, t->T, N, t->tokens_per_micro * N);
    }
    t->M = (int)(t->total_batch / t->tokens_per_micro);
    // the schedule's own requirements (interleaved: microbatches per rank a multiple of --pp)
    PipelineConfig cfg = {a->pp, t->M / N, t->pp_kind, t->nchunks};
    char err[256];
    if (pipeline_check_config(&cfg, err, sizeof(err)) != 0) {
        fatal("--schedule %s with -d %lld (%d microbatch(es) per data-parallel rank): %s", a->pp_schedule,
              t->total_batch, t->M / N, err);
    }
    return 1;
}

// How many ways a training pass splits each sequence's residual stream: context parallelism,
// times the tensor-parallel degree with sequence parallelism.
static inline int trainer_sequence_split(const Trainer* t) {
    return t->comm.cp * (t->args.sp ? t->comm.tp : 1);
}

// The model of this rank's stage on `ops` (its parameters, gradients and AdamW state in
// zero.h's buffers in `mem`), the data, the tokenizer, the pipeline, the resumed state, main.log.
static inline void trainer_build(Trainer* t, const ModelOps* ops, const MemOps* mem) {
    const TrainArgs* a = &t->args;
    const GPT2Config* c = &t->config;
    Comm* comm = &t->comm;
    int B = t->B, T = t->T;
    t->ops = ops;
    t->mem = mem;
    comm_set_memory(comm, mem);

    // this rank's model chunks: the layers balanced over the S*v virtual stages in model order,
    // each chunk a contiguous range (pipeline.h's placement: round-robin for interleaved, the V
    // for zbv)
    int S = comm->pp, v = t->nchunks;
    PipelineConfig cfg = {S, t->M / comm->dp, t->pp_kind, v};
    PipelineChunkLayers* all = (PipelineChunkLayers*)malloc_or_die(sizeof(PipelineChunkLayers) * S * v, "placement");
    char err[256];
    if (pipeline_place_layers(&cfg, c->num_layers, 0.0, head_cost_in_layers(c), all, err, sizeof(err)) != 0) {
        fatal("--pp: %s", err);
    }
    t->places = (ChunkPlace*)malloc_or_die(sizeof(ChunkPlace) * v, "placement");
    for (int ch = 0; ch < v; ch++) {
        const PipelineChunkLayers* q = &all[comm->pp_rank * v + ch];
        t->places[ch] = (ChunkPlace){q->first_layer, q->first_layer + q->num_layers, q->has_embedding, q->has_head};
    }
    for (int k = 0; k < S * v; k++) { if (all[k].has_head) { t->head_stage = k / v; } }
    free(all);
    zero_init_ep(&t->zero, c, mem, a->zero_stage, &comm->dp_group, &comm->dpcp_group, comm->ep > 1 ? &comm->ep_group : NULL,
                 comm->ep > 1 ? &comm->edp_group : NULL, &comm->pp_group, &comm->tp_group, t->places, v,
                 t->head_stage, t->start_params, t->M);
    free(t->start_params);
    t->start_params = NULL;
    t->models = (void**)malloc_or_die(sizeof(void*) * v, "models");
    for (int ch = 0; ch < v; ch++) {
        t->models[ch] = ops->create(c, &t->places[ch], &t->zero, &comm->tp_group, &comm->cp_group,
                                    strcmp(a->cp_mode, "a2a") == 0, a->sp, B, T);
    }

    t->do_val = a->val_every > 0;
    train_data_open(a, B, T, c->vocab_size, t->total_batch, &t->train_loader, &t->val_loader, &t->val_batches,
                    &t->train_steps);
    t->schedule = (LRSchedule){t->lr_kind, a->lr, a->warmup, t->train_steps, a->final_lr_frac};
    // only world rank 0 prints samples, and a run that never samples needs no tokenizer (a
    // corrupt one must not stop it)
    if (t->root && a->sample_every > 0) { tokenizer_init_for_model(&t->tokenizer, a->tokenizer_path, c->vocab_size); }

    int split = trainer_sequence_split(t);
    pipeline_init(&t->pipe, ops, mem, t->models, t->places, &comm->pp_group, t->pp_kind, v,
                  t->zero.local_microbatches, B, T, c->channels, a->recompute, split);
    t->grads = ops->grads_create(t->models[0], B, T, split > 1, &t->grads_bytes);
    if (t->moe) {
        size_t n = (size_t)t->zero.local_microbatches * c->num_layers;
        t->pipe.num_layers = c->num_layers;
        t->pipe.moe_aux = (float*)malloc_or_die(sizeof(float) * n, "aux losses");
        for (size_t k = 0; k < n; k++) { t->pipe.moe_aux[k] = -0.0f; }
        t->moe_micro_aux = (float*)calloc_or_die((size_t)t->zero.local_microbatches + 1, sizeof(float), "aux losses");
    }
    t->genT = a->gen_T < c->max_seq_len ? a->gen_T : c->max_seq_len;
    // the sampler's forward passes: every dp rank takes part under ZeRO-3 (parameter gathers)
    // and with expert parallelism (token exchanges)
    t->do_sample = a->sample_every > 0 && (comm->dp_rank == 0 || t->zero.stage == 3 || comm->ep > 1);
    if (t->do_sample) {
        size_t bytes;
        t->sample_acts = (void**)malloc_or_die(sizeof(void*) * v, "sampler activations");
        for (int ch = 0; ch < v; ch++) { t->sample_acts[ch] = ops->acts_create(t->models[ch], 1, t->genT, 0, 0, 0, &bytes); }
        t->sample_probs = (float*)malloc_or_die(sizeof(float) * c->padded_vocab_size, "sample probabilities");
    }

    t->progress = (TrainProgress){0, 0, t->tokens_per_micro, a->shuffle, (uint64_t)a->seed};
    if (t->resume_step >= 0) {
        Zero* z = &t->zero;
        zero_state_host_buffers(z);
        int n = zero_state_ranges(z, 0, NULL);   // every range this rank updates
        StateRange* ranges = (StateRange*)malloc_or_die(sizeof(StateRange) * (n + 1), "state ranges");
        zero_state_ranges(z, 0, ranges);
        TrainProgress saved;
        state_read(a->output_dir, t->resume_step, c, n, ranges, &saved);
        free(ranges);
        // the saved progress must be this run's: B*T, -d, --shuffle, --seed, a step within -x
        train_progress_check(&saved, a->output_dir, t->M, t->tokens_per_micro, a->shuffle, (uint64_t)a->seed,
                             t->train_steps);
        zero_state_from_host(z);
        t->progress = saved;
    }
    logger_init(&t->logger, a->output_dir, t->root, t->resume_step);
}

// ---- what a step computes beyond the pipeline --------------------------------------------

// The R1 tree over n values gathered from the dp ranks (`per_rank` each, rank-major in all):
// value j of the canonical order is microbatch j's (zero.h's assignment), or with
// round_robin value j = all[(j % N) * per_rank + j / N].
static inline float tree_in_order(const float* all, int per_rank, int n, const Zero* z, int round_robin) {
    float* ordered = (float*)malloc_or_die(sizeof(float) * (n > 0 ? n : 1), "ordered values");
    for (int j = 0; j < n; j++) {
        int r, local;
        if (round_robin) { r = j % z->streams; local = j / z->streams; }
        else { zero_owner_of_microbatch(z, j, &r, &local); }
        ordered[j] = all[(size_t)r * per_rank + local];
    }
    float sum = canon_tree_sum(ordered, n, 1);
    free(ordered);
    return sum;
}

// The mean loss over the global batch: the head stage's dp ranks gather their microbatch loss
// sums (all-gather, dp group), sum them by the R1 tree in global order, and the head stage
// broadcasts the result to the other stages (pp group).
static inline float global_mean_loss(Trainer* t, const float* local, int per_rank, int n, int round_robin,
                                     double tokens) {
    Zero* z = &t->zero;
    float loss = 0.0f;
    if (t->pipe.head_chunk >= 0) {
        float* all = (float*)malloc_or_die(sizeof(float) * (size_t)per_rank * z->streams + 1, "losses");
        comm_all_gather(&t->comm.dp_group, local, all, (size_t)per_rank, COMM_KIND_OTHER);
        loss = tree_in_order(all, per_rank, n, z, round_robin) / (float)tokens;
        free(all);
    }
    comm_broadcast(&t->comm.pp_group, &loss, sizeof(float), t->head_stage, COMM_KIND_OTHER);
    return loss;
}

// Validation loss over the first val_batches microbatches of the val data: batch j is done by
// dp rank j % N (through the pipeline), and the batch sums are summed in batch order.
static inline float trainer_validate(Trainer* t) {
    Zero* z = &t->zero;
    int B = t->B, T = t->T, batches = t->val_batches;
    int sp_degree = trainer_sequence_split(t);
    void** acts = (void**)malloc_or_die(sizeof(void*) * t->nchunks, "validation activations");
    for (int ch = 0; ch < t->nchunks; ch++) { acts[ch] = pipeline_chunk_acts(&t->pipe, ch); }
    int hc = t->pipe.head_chunk;
    int per_rank = (batches + z->streams - 1) / z->streams;
    float* local = (float*)calloc_or_die((size_t)per_rank + 1, sizeof(float), "val losses");
    for (int k = 0; k < per_rank; k++) {
        int j = k * z->streams + z->stream;
        // under ZeRO-3 every dp rank must take part in every forward's parameter gathers, with
        // expert parallelism in every forward's token exchanges
        if (j >= batches && z->stage != 3 && z->ep->size == 1) { continue; }
        dataloader_load(&t->val_loader, j < batches ? j : 0);
        pipeline_forward_pass(&t->pipe, acts, t->val_loader.inputs, t->val_loader.targets, B, T,
                              t->config.channels, sp_degree, -1);
        if (hc >= 0 && j < batches) { local[k] = t->ops->loss_sum(t->models[hc], acts[hc], B, T); }
    }
    float loss = global_mean_loss(t, local, per_rank, batches, 1, (double)batches * B * T);
    free(local);
    free(acts);
    return loss;
}

// Samples genT tokens after <|endoftext|> with xorshift seeded 1337 (llm.c's sampler, with
// --temperature and --top-k: llmc/sampler.h). Token pos is drawn from row pos - 1 of the
// forward pass over (1, genT) through the pipeline: with a KV cache (ModelOps' decode; not
// with --kv-cache 0) each step computes only that row, otherwise (fast mode) the whole pass,
// the positions not yet
// generated holding <|endoftext|> (causal attention: they change nothing before them). The
// head's stage draws the token (from the whole vocabulary) and broadcasts it to the other
// stages. Under ZeRO-3 every dp rank takes part (the forward gathers parameters), with expert
// parallelism every rank of the ep group; world rank 0 prints.
static inline void trainer_sample(Trainer* t) {
    int V = t->config.vocab_size, genT = t->genT, C = t->config.channels;
    int printing = t->root;
    int* gen = (int*)malloc_or_die(sizeof(int) * genT, "sample tokens");
    uint64_t rng = 1337;
    Sampler sampler;
    sampler_init(&sampler, t->args.temperature, t->args.top_k, V);
    for (int i = 0; i < genT; i++) { gen[i] = V > 50256 ? 50256 : V - 1; }   // <|endoftext|> for GPT-2's vocabulary
    if (printing) { printf("generating:\n---\n"); }
    for (int pos = 1; pos < genT; pos++) {
        int kv = t->ops->layers_decode && t->args.kv_cache;
        pipeline_forward_pass(&t->pipe, t->sample_acts, gen, NULL, 1, genT, C, 1, kv ? pos - 1 : -1);
        int next = V - 1, hc = t->pipe.head_chunk;
        if (hc >= 0) {
            t->ops->probs_at(t->models[hc], t->sample_acts[hc], pos - 1, t->sample_probs);
            next = sampler_draw(&sampler, t->sample_probs, V, random_f32(&rng));
        }
        comm_broadcast(&t->comm.pp_group, &next, sizeof(int), t->head_stage, COMM_KIND_OTHER);
        gen[pos] = next;
        if (!printing) { continue; }
        if (t->tokenizer.init_ok) {
            safe_printf(tokenizer_decode(&t->tokenizer, next));
        } else {
            printf("%d ", next);
        }
        fflush(stdout);
    }
    if (printing) { printf("\n---\n"); }
    sampler_free(&sampler);
    free(gen);
}

// Checkpoint of step progress->step: the model (world rank 0, llm.c format), every rank's
// piece of the optimizer state, then the DONE marker once all of it is on disk. The full
// parameters are assembled by a sum: every dp-rank-0 rank writes the elements it owns
// (zero_full_params: each element by exactly one rank) into a host buffer of -0.0f, and an
// all-reduce over the tp group, then over the pp group, adds them (x + -0 == x: exact).
// Context-parallel ranks hold copies of their group's parameters (cp rank 0 assembles them) and
// shards of the optimizer state (ZeRO's group is data x context).
static inline void trainer_write_checkpoint(Trainer* t) {
    Zero* z = &t->zero;
    Comm* comm = &t->comm;
    const char* dir = t->args.output_dir;
    char path[1200];
    int step = (int)t->progress.step;
    size_t P = param_count(&t->config);
    float* full = NULL;
    // dp rank 0 (its context rank 0: context-parallel ranks hold copies of their group's
    // parameters), and the rest of its ep group for their experts
    if (comm->dp_rank < comm->ep && comm->cp_rank == 0) {
        full = (float*)aligned_calloc_or_die(P * sizeof(float), "checkpoint");
        for (size_t i = 0; i < P; i++) { full[i] = -0.0f; }
    }
    zero_full_params(z, full);
    if (full) {
        // all-reduce (ep group, then tp group, then pp group): every rank's owned elements into
        // the full model
        if (comm->ep > 1) { comm_all_reduce_sum(&comm->ep_group, full, P, COMM_KIND_OTHER); }
        if (comm->tp > 1) { comm_all_reduce_sum(&comm->tp_group, full, P, COMM_KIND_OTHER); }
        if (comm->pp > 1) { comm_all_reduce_sum(&comm->pp_group, full, P, COMM_KIND_OTHER); }
    }
    if (comm->world_rank == 0) {
        snprintf(path, sizeof(path), "%s/model_%08d.bin", dir, step);
        checkpoint_write_model(path, &t->config, full);
    }
    free(full);
    // ZeRO-0: dp rank 0 writes its (and everyone's) state, with expert parallelism the rest of
    // its ep group their experts'
    int per_dp = z->stage == 0 ? comm->ep : z->N;
    if (zero_writes_state(z)) {
        zero_state_to_host(z);
        int n = zero_state_ranges(z, 1, NULL);
        StateRange* ranges = (StateRange*)malloc_or_die(sizeof(StateRange) * (n + 1), "state ranges");
        zero_state_ranges(z, 1, ranges);
        int piece = (comm->pp_rank * comm->tp + comm->tp_rank) * per_dp + (z->stage == 0 ? comm->dp_rank : z->rank);
        snprintf(path, sizeof(path), "%s/state_%08d_%05d.bin", dir, step, piece);
        state_write_piece(path, &t->config, &t->progress, comm->pp * comm->tp * per_dp, piece, n, ranges);
        free(ranges);
    }
    comm_barrier(&comm->world);
    if (comm->world_rank == 0) {
        checkpoint_write_done(dir, step);
        printf("checkpoint written: %s/model_%08d.bin\n", dir, step);
    }
}

// The fewest and the most slots routed to one expert of one layer in the step, over every
// rank's microbatches: the stage's counts (its chunks') summed over the dp group, then the
// stages' layers into one table (pp group; integers below 2^24 are exact in floats).
static inline void trainer_expert_loads(Trainer* t, double* lo, double* hi) {
    int L = t->config.num_layers, E = t->config.num_experts;
    float* all = (float*)calloc_or_die((size_t)L * E, sizeof(float), "expert loads");
    for (int ch = 0; ch < t->nchunks; ch++) {
        const MoeCounters* ct = t->ops->moe_counters(t->models[ch]);
        for (int l = 0; ct && l < ct->layers; l++) {
            for (int e = 0; e < E; e++) { all[(size_t)(ct->first_layer + l) * E + e] = (float)ct->tokens[(size_t)l * E + e]; }
        }
    }
    comm_all_reduce_sum(&t->comm.dp_group, all, (size_t)L * E, COMM_KIND_OTHER);
    comm_all_reduce_sum(&t->comm.pp_group, all, (size_t)L * E, COMM_KIND_OTHER);
    *lo = *hi = all[0];
    for (size_t i = 1; i < (size_t)L * E; i++) {
        if (all[i] < *lo) { *lo = all[i]; }
        if (all[i] > *hi) { *hi = all[i]; }
    }
    free(all);
}

// ---- the startup table -------------------------------------------------------------------

static inline void trainer_print_table(Trainer* t, const BuildInfo* build) {
    const TrainArgs* a = &t->args;
    const GPT2Config* c = &t->config;
    Comm* comm = &t->comm;
    Zero* z = &t->zero;
    Pipeline* pipe = &t->pipe;
    size_t P = param_count(c);
    int N = comm->dp;
    ZeroMemory mem = zero_memory(z);
    // every stage's activation memory, for the table (all-gather, pp group)
    float stage_mib = (float)(pipe->slot_bytes / 1048576.0), all_stage_mib[64];
    if (comm->pp <= 64) { comm_all_gather(&comm->pp_group, &stage_mib, all_stage_mib, 1, COMM_KIND_OTHER); }
    // every rank's grid coordinates (all-gather, world)
    float coords[4] = {(float)comm->dp_rank, (float)comm->cp_rank, (float)comm->tp_rank, (float)comm->pp_rank};
    float* all_coords = comm->world_size <= 64 ? (float*)malloc_or_die(sizeof(float) * 4 * comm->world_size, "grid") : NULL;
    if (all_coords) { comm_all_gather(&comm->world, coords, all_coords, 4, COMM_KIND_OTHER); }
    if (!t->root) { free(all_coords); return; }
    printf("+--------------------------------------------------------------------------+\n");
    build->banner();
    printf("+--------------------------------------------------------------------------+\n");
    printf("| model         L=%d C=%d NH=%d V=%d Vp=%d maxT=%d\n", c->num_layers, c->channels,
           c->num_heads, c->vocab_size, c->padded_vocab_size, c->max_seq_len);
    if (t->resume_step >= 0) { printf("| init          %s/model_%08d.bin\n", a->output_dir, t->resume_step); }
    else { printf("| init          %s\n", a->model); }
    printf("| parameters    P = %zu (%.1f M)\n", P, P / 1e6);
    printf("| ranks         %d = %d data x %d context x %d tensor%s x %d pipeline; ZeRO stage %d\n", comm->world_size, N,
           comm->cp, comm->tp, a->sp ? " (+ sequence parallel)" : "", comm->pp, z->stage);
    if (all_coords && comm->world_size > 1) {   // Megatron's order: tensor fastest, then context, data, pipeline
        for (int w = 0; w < comm->world_size; w++) {
            if (w % 8 == 0) { printf("%s| grid          rank (dp,cp,tp,pp):", w ? "\n" : ""); }
            printf(" %d (%d,%d,%d,%d)", w, (int)all_coords[4 * w], (int)all_coords[4 * w + 1], (int)all_coords[4 * w + 2],
                   (int)all_coords[4 * w + 3]);
        }
        printf("\n");
    }
    free(all_coords);
    if (comm->cp > 1) {
        printf("| context       %d-way %s: each rank holds stretches r and %d-r of every sequence (%d positions each)\n",
               comm->cp, strcmp(a->cp_mode, "a2a") == 0 ? "all-to-all (Ulysses)" : "ring attention", 2 * comm->cp - 1,
               t->T / (2 * comm->cp));
    }
    if (t->moe) {
        size_t active = param_active_count(c), experts = 0;
        for (int u = z->lay.num_units + 1; u < z->lay.num_all; u++) { if (z->lay.params_here[u]) { experts += z->lay.size[u]; } }
        printf("| experts       E=%d per layer, top k=%d, load-balancing alpha %g; %zu active parameters per token "
               "(%.1f%% of P)\n", c->num_experts, c->top_k, c->aux_loss_coef, active, 100.0 * active / P);
        printf("|               expert parallel %d (ep groups of %d data ranks; the experts' gradients reduced over %d "
               "ranks)\n", comm->ep, comm->ep, N / comm->ep);
        for (int q = 0; q < comm->ep; q++) {
            int El = c->num_experts / comm->ep;
            // every rank holds as many experts: rank 0's bytes are each rank's
            printf("|   ep rank %-3d experts [%d, %d) of each layer = %zu expert parameters; per rank (dense part "
                   "included) params %.1f MiB, grads %.1f MiB, AdamW %.1f MiB\n", q, q * El, (q + 1) * El, experts,
                   mem.params / 1048576, mem.grads / 1048576, mem.optimizer / 1048576);
        }
    }
    printf("| batch         B=%d T=%d, %d microbatch(es) per step (%d per data-parallel rank) = %lld tokens\n",
           t->B, t->T, t->M, z->local_microbatches, t->total_batch);
    if (comm->pp > 1) {
        PipelineConfig cfg = pipe->cfg;
        int v = cfg.num_chunks;
        printf("| pipeline      %s over %d stages", a->pp_schedule, comm->pp);
        if (v > 1) { printf(" x %d model chunks", v); }
        printf(", %d microbatches; bubble model %.3f\n", z->local_microbatches, pipeline_bubble_fraction(&cfg));
        PipelineChunkLayers* all = (PipelineChunkLayers*)malloc_or_die(sizeof(PipelineChunkLayers) * comm->pp * v, "placement");
        pipeline_place_layers(&cfg, c->num_layers, 0.0, head_cost_in_layers(c), all, NULL, 0);
        for (int st = 0; st < comm->pp && st < 64; st++) {
            int n = pipeline_stage_actions(&cfg, st, NULL, 0, NULL, 0);
            if (n < 0) { fatal("internal: pipeline stage %d has no schedule", st); }
            PipelineAction* acts = (PipelineAction*)malloc_or_die(sizeof(PipelineAction) * (n ? n : 1), "actions");
            pipeline_stage_actions(&cfg, st, acts, n, NULL, 0);
            printf("|   stage %-3d   layers", st);
            int embed = 0, head = 0;
            for (int ch = 0; ch < v; ch++) {
                const PipelineChunkLayers* q = &all[st * v + ch];
                printf(" [%d, %d)", q->first_layer, q->first_layer + q->num_layers);
                embed |= q->has_embedding;
                head |= q->has_head;
            }
            printf("%s%s, peak activations: %d %s, %.1f MiB\n", embed ? " + embeddings" : "", head ? " + head" : "",
                   pipeline_max_in_flight(acts, n), v > 1 ? "(microbatch, chunk) pairs" : "microbatch(es)",
                   all_stage_mib[st]);
            free(acts);
        }
        free(all);
    }
    train_data_print_summary(a, t->train_steps, &t->train_loader, &t->val_loader, t->val_batches);
    printf("| memory/rank   params %.1f MiB, grads %.1f MiB, AdamW %.1f MiB, activations %.1f MiB\n",
           mem.params / 1048576, mem.grads / 1048576, mem.optimizer / 1048576,
           (pipe->slot_bytes + t->grads_bytes) / 1048576.0);
    if (comm->pp == 1) {
        printf("|               ZeRO paper, fp32 AdamW: %s = %.1f MiB (ours: %.1f MiB incl. padding and wte's 2nd gradient half)\n",
               z->stage == 0 ? "16P" : z->stage == 1 ? "8P + 8P/N" : z->stage == 2 ? "4P + 12P/N" : "16P/N",
               (z->stage == 0 ? 16.0 * P : z->stage == 1 ? 8.0 * P + 8.0 * P / z->N
                : z->stage == 2 ? 4.0 * P + 12.0 * P / z->N : 16.0 * P / z->N) / 1048576,
               (mem.params + mem.grads + mem.optimizer) / 1048576);
    }
    if (build->memory_line) { build->memory_line(); }
    printf("| output        %s\n", a->output_dir ? a->output_dir : "(none)");
    if (t->resume_step >= 0) { printf("| resuming      from step %d\n", t->resume_step); }
    printf("+--------------------------------------------------------------------------+\n");
    fflush(stdout);
}

// ---- the loop ----------------------------------------------------------------------------

#define PP_TIMING 5   // per stage and step: idle fraction, forward, backward, weight half, peak held

// Context parallelism's bytes this rank sent in the step, against the formula
// (context_parallel.h), per microbatch: each of the rank's layers sends, with the ring,
// (N-1) K and (N-1) V blocks forward, (N-1) V and (N-1) K blocks and (N-1) dK|dV partial
// blocks backward, a block being B (T/N) C/tp floats; with the all-to-all 8 (N-1)/N blocks;
// the chunk with the embeddings all-gathers the embedding's gradient ((N-1) B (T/N) C floats),
// the chunk with the head the per-position losses ((N-1) B (T/N)).
static inline void trainer_print_cp_accounting(const Trainer* t) {
    const Comm* comm = &t->comm;
    const GPT2Config* c = &t->config;
    int N = comm->cp, a2a = strcmp(t->args.cp_mode, "a2a") == 0, layers = 0, first = 0, last = 0;
    for (int ch = 0; ch < t->nchunks; ch++) {
        layers += t->places[ch].last_layer - t->places[ch].first_layer;
        first |= t->places[ch].has_embedding;
        last |= t->places[ch].has_head;
    }
    int Tl = t->T / N, Ca = c->channels / comm->tp;
    uint64_t block = (uint64_t)t->B * Tl * Ca;
    uint64_t per_layer = a2a ? 8 * (uint64_t)(N - 1) * block / N : 6 * (uint64_t)(N - 1) * block;
    uint64_t per_micro = layers * per_layer + (first ? (uint64_t)(N - 1) * t->B * Tl * c->channels : 0) +
                         (last ? (uint64_t)(N - 1) * t->B * Tl : 0);
    uint64_t want = 4 * per_micro * (uint64_t)t->zero.local_microbatches, got = comm->stats.bytes[COMM_KIND_CP];
    printf("cp accounting: %s N %d layers %d B %d T/N %d C/tp %d microbatches/rank %d | bytes/rank/step cp %llu, "
           "formula %llu (%s)\n", a2a ? "a2a" : "ring", N, layers, t->B, Tl, Ca, t->zero.local_microbatches,
           (unsigned long long)got, (unsigned long long)want, got == want ? "equal" : "MISMATCH");
}

// The startup table, then every step: validation, sampling and checkpoints when due, the
// step's microbatches through the pipeline, the loss, the gradient norm, AdamW; the step line
// on the console and in main.log; at the end a summary of the run. A loss or gradient norm
// that is not finite stops the run before anything of that step is written (Megatron's NaN
// check).
static inline void trainer_run(Trainer* t, const BuildInfo* build) {
    const TrainArgs* a = &t->args;
    const GPT2Config* c = &t->config;
    Comm* comm = &t->comm;
    Zero* z = &t->zero;
    Pipeline* pipe = &t->pipe;
    size_t P = param_count(c);
    trainer_print_table(t, build);
    ZeroMemory mem = zero_memory(z);
    double flops_per_step = (6.0 * (double)(t->moe ? param_active_count(c) : P) + 6.0 * c->num_layers * c->channels * t->T) *
                            (double)t->total_batch;
    float* local_loss = (float*)calloc_or_die((size_t)z->local_microbatches + 1, sizeof(float), "losses");
    double total_time = 0.0, run_start = now_seconds();
    int timed_steps = 0;
    const int first_step = (int)t->progress.step;   // of this run (after -y, the resumed step)
    float best_val = 0.0f;
    int best_val_step = -1, last_checkpoint = -1;
    float cost_sum[PP_TIMING * 64] = {0};   // the pipeline's measured costs, summed over steps
    int cost_steps = 0;
    for (int step = first_step; step <= t->train_steps; step++) {
        int last_step = step == t->train_steps;

        if (t->do_val && (step % a->val_every == 0 || last_step)) {
            float val_loss = trainer_validate(t);
            if (t->root) { printf("val loss %.6f\n", val_loss); }
            logger_log_val(&t->logger, step, val_loss);
            if (best_val_step < 0 || val_loss < best_val) { best_val = val_loss; best_val_step = step; }
        }
        if (t->do_sample && ((step > 0 && step % a->sample_every == 0) || last_step)) { trainer_sample(t); }
        if (a->checkpoint_every > 0 && step != t->resume_step &&
            ((step > 0 && step % a->checkpoint_every == 0) || last_step)) {
            t->progress.step = step;
            trainer_write_checkpoint(t);
            last_checkpoint = step;
        }
        if (last_step) { break; }

        // ---- one optimizer step over M microbatches (M / N on each data-parallel rank) ----
        comm_reset_stats(comm);
        for (int ch = 0; t->moe && ch < t->nchunks; ch++) {   // every chunk's routing counters
            MoeCounters* ct = t->ops->moe_counters(t->models[ch]);
            if (ct == NULL) { continue; }
            memset(ct->tokens, 0, sizeof(double) * (size_t)ct->layers * ct->experts);
            ct->passes = ct->rows_out = ct->rows_in = 0;
        }
        double t0 = now_seconds();
        pipeline_step(pipe, z, t->grads, &t->train_loader, t->progress.microbatches_done, t->M, t->B, t->T,
                      a->overfit_single_batch, local_loss);
        float loss = global_mean_loss(t, local_loss, z->local_microbatches, t->M, 0, (double)t->total_batch);
        float aux = 0.0f;
        double load_min = 0, load_max = 0;
        if (t->moe) {
            moe_microbatch_aux(&comm->pp_group, c->num_layers, pipe->moe_aux, z->local_microbatches, t->moe_micro_aux);
            aux = global_mean_loss(t, t->moe_micro_aux, z->local_microbatches, t->M, 0, (double)t->M);
            trainer_expert_loads(t, &load_min, &load_max);
        }
        float norm = zero_grad_norm(z, &comm->tp_group);
        if (!isfinite(loss) || !isfinite(norm)) {
            fatal("step %d: the %s is %g: training diverged; stopping before this step updates the model "
                  "or writes anything (lower -l, check the data; the last checkpoint is intact)",
                  step + 1, isfinite(loss) ? "gradient norm" : "loss", isfinite(loss) ? norm : loss);
        }
        float grad_scale = a->grad_clip > 0.0f && norm > a->grad_clip ? a->grad_clip / norm : 1.0f;
        float lr = lr_at_step(&t->schedule, step);
        AdamWStep s = adamw_step_constants(lr, a->beta1, a->beta2, a->eps, step + 1, grad_scale);
        zero_adamw_step(z, &s, a->weight_decay);
        t->mem->sync();
        t->progress.microbatches_done += t->M;
        t->progress.step = step + 1;
        double dt = now_seconds() - t0;
        // the pipeline bubble: the fraction of the step each stage spent not computing; each
        // stage's mean time per (microbatch, chunk) of a forward, a whole backward and its
        // weight half; the most activations it held (all-gather, pp group)
        double units = (double)z->local_microbatches * pipe->nchunks;
        float timing[PP_TIMING] = {(float)(1.0 - pipe->busy / dt), (float)(pipe->fwd / units * 1e3),
                                   (float)((pipe->bwd + pipe->wgt) / units * 1e3), (float)(pipe->wgt / units * 1e3),
                                   (float)pipe->peak_held};
        float timing_all[PP_TIMING * 64];
        if (comm->pp > 1 && comm->pp <= 64) {
            comm_all_gather(&comm->pp_group, timing, timing_all, PP_TIMING, COMM_KIND_OTHER);
        }
        int first_of_run = step == first_step;   // carries the warm-up: not in the average
        if (!first_of_run) { total_time += dt; timed_steps++; }
        if (comm->pp > 1 && comm->pp <= 64 && (!first_of_run || t->train_steps - first_step == 1)) {
            for (int k = 0; k < PP_TIMING * comm->pp; k++) { cost_sum[k] += timing_all[k]; }
            cost_steps++;
        }
        if (t->root) {
            char throughput[64];
            build->throughput(throughput, sizeof(throughput), flops_per_step / dt);
            printf("step %4d/%d | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s | %s\n",
                   step + 1, t->train_steps, loss, lr, norm, dt * 1e3, t->total_batch / dt, throughput);
            if (t->moe) {   // the expert load over the whole step; rank 0's all-to-all traffic
                long long rows_out = 0, rows_in = 0, passes = 0;
                for (int ch = 0; ch < t->nchunks; ch++) {
                    const MoeCounters* ct = t->ops->moe_counters(t->models[ch]);
                    if (ct) { rows_out += ct->rows_out; rows_in += ct->rows_in; passes += ct->passes; }
                }
                printf("           experts: aux %.6f | tokens per expert min %.0f max %.0f (of %lld per layer) | "
                       "all-to-all %llu bytes: %lld rows out, %lld in, %lld layer passes\n", aux, load_min, load_max,
                       (long long)c->top_k * t->total_batch, (unsigned long long)comm->stats.bytes[COMM_KIND_EP],
                       rows_out, rows_in, passes);
            }
            if (comm->pp > 1 && comm->pp <= 64) {
                printf("           pipeline idle per stage:");
                for (int st = 0; st < comm->pp; st++) { printf(" %.2f", timing_all[PP_TIMING * st]); }
                printf(" (model %.2f)\n", pipeline_bubble_fraction(&pipe->cfg));
                if (first_of_run) {
                    printf("pipeline activations held per stage (peak, %s):",
                           pipe->nchunks > 1 ? "(microbatch, chunk) pairs" : "microbatches");
                    for (int st = 0; st < comm->pp; st++) { printf(" %d", (int)timing_all[PP_TIMING * st + 4]); }
                    printf("\n");
                }
            }
            if (first_of_run) {   // what this run's first step sent, and the memory plan
                printf("communication per rank in this step (bytes sent):\n");
                comm_print_stats(comm, stdout);
                printf("zero accounting: stage %d N %d P %zu VpC %zu L %d microbatches/rank %d | "
                       "bytes/rank/step grad %llu param %llu | bytes/rank params %.0f grads %.0f optimizer %.0f\n",
                       z->stage, z->N, P, (size_t)c->padded_vocab_size * c->channels, c->num_layers,
                       z->local_microbatches, (unsigned long long)comm->stats.bytes[COMM_KIND_GRAD],
                       (unsigned long long)comm->stats.bytes[COMM_KIND_PARAM], mem.params, mem.grads, mem.optimizer);
                if (comm->cp > 1) { trainer_print_cp_accounting(t); }
            }
            fflush(stdout);
        }
        if (t->moe) {
            logger_log_train_aux(&t->logger, step, loss, lr, norm, aux);
        } else {
            logger_log_train(&t->logger, step, loss, lr, norm);
        }
    }
    if (t->root) {
        // the run summary: what was trained, how fast (the steps after the first, which
        // carries the warm-up), the best validation loss, where the model is
        int steps = t->train_steps - first_step;
        printf("run summary: %d step(s) (%d -> %d), %.0f tokens in %.1f s", steps, first_step, t->train_steps,
               (double)steps * t->total_batch, now_seconds() - run_start);
        if (timed_steps > 0) {
            double avg = total_time / timed_steps;
            char throughput[160];
            build->summary_throughput(throughput, sizeof(throughput), flops_per_step / avg);
            printf("\n  average step %.1f ms (excluding the first), %.0f tok/s, %s", avg * 1e3, t->total_batch / avg,
                   throughput);
        }
        if (best_val_step >= 0) { printf("\n  best val loss %.6f (step %d)", best_val, best_val_step); }
        if (last_checkpoint >= 0) {
            printf("\n  checkpoint: %s/model_%08d.bin (resume with -y 1 -o %s)", a->output_dir, last_checkpoint,
                   a->output_dir);
        }
        printf("\n");
        if (cost_steps > 0) {   // the measured costs, ready for the schedule drawing tool
            printf("draw this run's pipeline schedule from its measured costs (ms per microbatch and chunk, "
                   "mean over %d step(s)):\n  dev/tools/pp_schedule --stages %d --microbatches %d --schedule %s",
                   cost_steps, comm->pp, z->local_microbatches, a->pp_schedule);
            if (pipe->cfg.kind == PP_INTERLEAVED) { printf(" --chunks %d", pipe->nchunks); }
            const char* flags[3] = {"--fwd", "--bwd", "--wgt"};
            for (int f = 0; f < (pipe->split ? 3 : 2); f++) {
                printf(" %s ", flags[f]);
                for (int st = 0; st < comm->pp; st++) {
                    printf("%s%.3f", st ? "," : "", cost_sum[PP_TIMING * st + 1 + f] / cost_steps);
                }
            }
            printf(" --svg pipeline.svg\n");
        }
    }
    free(local_loss);
}

static inline void trainer_end(Trainer* t) {
    free(t->pipe.moe_aux);
    free(t->moe_micro_aux);
    pipeline_free(&t->pipe);
    if (t->do_sample) {
        for (int ch = 0; ch < t->nchunks; ch++) { t->ops->acts_destroy(t->models[ch], t->sample_acts[ch]); }
        free(t->sample_acts);
        free(t->sample_probs);
    }
    t->ops->grads_destroy(t->models[0], t->grads);
    dataloader_free(&t->train_loader);
    if (t->do_val) { dataloader_free(&t->val_loader); }
    tokenizer_free(&t->tokenizer);
    for (int ch = 0; ch < t->nchunks; ch++) { t->ops->destroy(t->models[ch]); }
    free(t->models);
    free(t->places);
    zero_free(&t->zero);
    comm_finalize(&t->comm);
}

#endif // LLMC_ENGINE_H
