/*
 * pipeline_executor.h: a pipeline stage runs its list of actions from llmc/pipeline.h.
 *
 * Every rank runs a pipeline, of one stage when --pp is 1 (then the list is just F0 B0 F1
 * B1 ...). A rank holds v model chunks (virtual stages; v = 1 but for interleaved, zbv and
 * dualpipev, dualpipe), each with its own model on the rank's one Zero (under dualpipe each
 * chunk runs half the microbatches, its mirror rank's same chunk the other half). A
 * (microbatch, chunk) pair owns a slot of its chunk from its FORWARD to its BACKWARD (or,
 * split, its BACKWARD_WEIGHT) on this stage: its activations (with its tokens) and the
 * received gradient of its output; the schedule bounds
 * how many are alive (1F1B: S - stage). Messages are non-blocking: a receive is posted at its
 * RECV action and waited for right before the computation that reads it; a send is posted at
 * its SEND action and waited for before its buffer is reused. Received activations and sent
 * input gradients live in small message buffers of their own, so a receive posted early never
 * needs a second slot. The schedule's message order makes this deadlock-free (pipeline.h).
 * Consecutive virtual stages on one rank (zbv's tip of the V) hand over in memory: the forward
 * reads the producer slot's output, the backward an input gradient kept in a message buffer.
 * Tags name (microbatch, the boundary between virtual stages w and w+1, direction).
 * Every buffer is in the build's memory.
 *
 * The schedule (which computation and which message come when, 1F1B's warmup, steady pairs
 * and cooldown included) is all in pipeline.h's lists; pipeline_step only runs them, one case
 * per action kind, each send and receive written with its tensor and group beside it. An F&B
 * (FORWARD_BACKWARD, dualpipev and dualpipe) runs its forward, then its backward, through the same two
 * functions as a lone FORWARD and BACKWARD: its messages are the list's around it.
 *
 * It drives a build's model through model_ops.h's ModelOps (and its BACKWARD_* parts).
 */
#ifndef LLMC_PIPELINE_EXECUTOR_H
#define LLMC_PIPELINE_EXECUTOR_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/comm.h"
#include "llmc/dataloader.h"
#include "llmc/memory.h"
#include "llmc/model_ops.h"
#include "llmc/pipeline.h"
#include "llmc/utils.h"
#include "llmc/zero.h"
#include "llmc/zigzag.h"

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

// Message buffers a stage may hold at once (a completed send's buffer is reused first); the
// schedules keep a few per stage in flight, so reaching this means an executor bug.
#define PP_MAX_MESSAGES 256
// Tags 0 .. 32767 are valid under every MPI (the standard's least MPI_TAG_UB).
#define PP_TAG_LIMIT 32768

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
    size_t msg_floats;         // the largest boundary activation (B, a rank's positions, C), in
                               // 4-byte words (ModelOps.stage_elem_bytes each element)
    int C;                     // C (a --varlen microbatch's message is B x its positions x C)
    ZzGroup seq_group;         // the ranks that split each sequence (context x sequence parallelism)
    SeqSplit split_mode;       // ... always, or per microbatch by its length (--varlen with CP, SP or
                               // FlexSP), or never
    CommGroup* pp;
    const ModelOps* ops;
    const MemOps* mem;
    int split;                 // the schedule splits backwards into input and weight halves
    double busy;               // seconds of computation in the last step
    double fwd, bwd, wgt;      // ... of which forwards, backwards (whole or input halves), weight halves
    double pair;               // ... of which in F&B pairs (their forward and backward halves)
    int held, peak_held;       // (microbatch, chunk) activations alive now / at most in the last step
    size_t slot_bytes;         // every slot's bytes
    float* moe_aux;            // experts: (microbatches x L) each forward's aux loss per layer,
                               // -0.0f for the layers of other stages
    int num_layers;            // L
} Pipeline;

// The chunk of this stage holding virtual stage vs (-1: another stage's); under dualpipe on
// the way of the microbatches entering at stage 0 (forward-only passes take it).
static inline int pipeline_chunk_of(const Pipeline* p, int vs) {
    int stage, chunk;
    pipeline_virtual_stage_owner(&p->cfg, vs, &stage, &chunk);
    return stage == p->pp->rank ? chunk : -1;
}

// The chunk of this stage holding the virtual stage before (step -1) or after (+1) chunk c on
// c's microbatches' way, -1 if another stage holds it or there is none (under dualpipe always:
// a rank's two chunks are on the two directions' ways).
static inline int pipeline_local_neighbour(const Pipeline* p, int c, int step) {
    if (pipeline_neighbour_stage(&p->cfg, p->pp->rank, c, step) != p->pp->rank) { return -1; }
    return pipeline_chunk_of(p, p->vstage[c] + step);
}

// The message tag of microbatch i crossing boundary w (between virtual stages w and w+1), forward
// or backward; modulo PP_TAG_LIMIT (the lists' message order pairs sends and receives anyway,
// pipeline.h).
static inline int pipeline_tag(const Pipeline* p, int i, int boundary, int backward) {
    long long V = pipeline_num_virtual_stages(&p->cfg);
    return (int)((((long long)i * V + boundary) * 2 + backward) % PP_TAG_LIMIT);
}

// n elements of a stage activation (or its gradient) in the 4-byte words the transports and
// the float* views count: a bf16 model's are half as many
static inline size_t pipeline_words(const ModelOps* ops, size_t n) {
    size_t bytes = n * ops->stage_elem_bytes;
    if (bytes % sizeof(float) != 0) { fatal("internal: a stage message of %zu bytes is not whole 4-byte words", bytes); }
    return bytes / sizeof(float);
}

static inline void pipeline_init(Pipeline* p, const ModelOps* ops, const MemOps* mem, void** models,
                                 const ChunkPlace* places, CommGroup* pp, PipelineScheduleKind kind, int nchunks,
                                 int M, int B, int T, int C, int recompute, ZzGroup seq_group, SeqSplit split_mode) {
    memset(p, 0, sizeof(*p));
    p->seq_group = seq_group;
    p->split_mode = split_mode;
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
        // under dualpipe both copies of the last stage hold the head: the one on the way of
        // the microbatches entering at stage 0 is the head of forward-only passes and of the loss
        if (places[c].has_head && pipeline_direction(&p->cfg, pp->rank, c) == 0) { p->head_chunk = c; }
    }
    // each chunk gets as many slots as its own computations (an F&B's halves apart) ever hold at once
    PipelineAction* mine = (PipelineAction*)malloc_or_die(sizeof(PipelineAction) * 2 * (n ? n : 1), "pipeline actions");
    int* count = (int*)calloc_or_die((size_t)nchunks, sizeof(int), "pipeline chunks");
    for (int c = 0; c < nchunks; c++) {
        int k = 0;
        for (int j = 0; j < n; j++) {
            PipelineAction halves[2];
            int nh = pipeline_action_halves(&p->actions[j], halves);
            for (int h = 0; h < nh; h++) { if (halves[h].chunk == c) { mine[k++] = halves[h]; } }
        }
        count[c] = pipeline_max_in_flight(mine, k);
        p->nslots += count[c];
    }
    free(mine);
    p->slots = (MicroSlot*)calloc_or_die((size_t)(p->nslots ? p->nslots : 1), sizeof(MicroSlot), "pipeline slots");
    int positions = p->split_mode == SEQS_SPLIT_BY_LENGTH ? zz_max_len(T, seq_group.N)
                    : p->split_mode == SEQS_SPLIT ? T / (seq_group.N * seq_group.K) : T;
    p->msg_floats = pipeline_words(ops, (size_t)B * positions * C);
    p->C = C;
    for (int c = 0, k = 0; c < nchunks; c++) {
        for (int j = 0; j < count[c]; j++, k++) {
            MicroSlot* s = &p->slots[k];
            size_t bytes = 0;
            s->chunk = c;
            s->microbatch = -1;
            s->acts = ops->acts_create(models[c], B, T, recompute, p->split_mode, p->split, &bytes);
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
            comm_wait(s->send_act);   // the isend (pp group) of its last output activation
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
        // an isend (pp group) of an input gradient that has completed frees its buffer
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

// What one step's computations share: the global microbatches, the loss scale, the tokens.
typedef struct {
    Zero* z;
    void* grads;
    DataLoader* loader;
    int64_t first_microbatch;
    int B, T, overfit, timed, last_vs;
    float dloss;
    float* dres;         // the residual stream's gradient buffer
    float* local_loss;
} PipelineStepContext;

// The positions of microbatch i: T, or its --varlen sequence's length, which every stage reads
// from the data's table, so the messages need no header (with CP, split or whole by it).
static inline int pipeline_positions(const PipelineStepContext* x, int i) {
    return dataloader_length(x->loader, x->overfit ? 0 : zero_global_microbatch(x->z, x->first_microbatch, i));
}

// The 4-byte words of a boundary message (an activation or its gradient) of a pass over B
// sequences of T positions laid out as split_mode says: this rank's positions of the residual
// stream (zigzag.h; with --varlen, SEQS_SPLIT_BY_LENGTH, split or whole by the length).
static inline size_t pipeline_pass_floats(const Pipeline* p, SeqSplit split_mode, int B, int T) {
    ZzGroup whole = {1, 1, 0, 0};
    ZzPass pass = zz_pass(split_mode == SEQS_WHOLE ? whole : p->seq_group, T, split_mode == SEQS_SPLIT_BY_LENGTH);
    return pipeline_words(p->ops, (size_t)B * canon_zz_len(T, pass.seq_split, pass.seq_rank) * p->C);
}

// The 4-byte words of microbatch i's boundary message.
static inline size_t pipeline_message_floats(const Pipeline* p, const PipelineStepContext* x, int i) {
    return pipeline_pass_floats(p, p->split_mode, x->B, pipeline_positions(x, i));
}

// FORWARD of (microbatch i, chunk c): its input from the data loader (virtual stage 0), the
// chunk before it on this rank, or the received message; the loss on the head's chunk.
static inline void pipeline_run_forward(Pipeline* p, const PipelineStepContext* x, int i, int c) {
    const ModelOps* ops = p->ops;
    int B = x->B, T = pipeline_positions(x, i);
    size_t bytes = pipeline_message_floats(p, x, i) * sizeof(float);
    void* model = p->models[c];
    const ChunkPlace* place = &p->places[c];
    MicroSlot* s = pipeline_slot(p, i, c, 1);
    if (place->has_embedding || place->has_head) {
        dataloader_load(x->loader, x->overfit ? 0 : zero_global_microbatch(x->z, x->first_microbatch, i));
        ops->set_tokens(model, s->acts, x->loader->inputs, x->loader->targets, B, T);
    }
    if (!place->has_embedding) {   // waiting for the input is idle time, not compute
        int producer = pipeline_local_neighbour(p, c, -1);
        if (producer >= 0) {        // a hand-off on this rank
            MicroSlot* from = pipeline_slot(p, i, producer, 0);
            p->mem->copy(ops->stage_input(model, s->acts), ops->stage_output(p->models[producer], from->acts, B, T),
                         bytes);
        } else {
            MessageBuffer* m = pipeline_message(p, i, c, MSG_RECEIVING);
            comm_wait(m->req);
            p->mem->copy(ops->stage_input(model, s->acts), m->buf, bytes);
            m->req = NULL;
            m->state = MSG_FREE;
        }
    }
    double t0 = now_seconds();
    if (place->has_embedding) { ops->embed_forward(model, s->acts, B, T); }
    ops->layers_forward(model, s->acts, B, T);
    if (p->moe_aux) { ops->moe_aux(model, s->acts, p->moe_aux + (size_t)i * p->num_layers + place->first_layer); }
    if (place->has_head) {
        ops->head_forward(model, s->acts, B, T, 1);
        x->local_loss[i] = ops->loss_sum(model, s->acts, B, T);
    }
    if (x->timed) { p->mem->sync(); }
    p->fwd += now_seconds() - t0;
}

// BACKWARD (part BACKWARD_BOTH), BACKWARD_INPUT or BACKWARD_WEIGHT of (microbatch i, chunk c):
// the gradient of its output from the received message or, handed off, from the chunk after it
// on this rank; the input gradient kept for the send or the hand-off; weight gradients into the
// chunk's microbatch tree (zero.h).
static inline void pipeline_run_backward(Pipeline* p, const PipelineStepContext* x, int i, int c, int part) {
    int vs = p->vstage[c], T = pipeline_positions(x, i);
    size_t bytes = pipeline_message_floats(p, x, i) * sizeof(float);
    MicroSlot* s = pipeline_slot(p, i, c, 0);
    if ((part & BACKWARD_INPUT) && vs < x->last_vs) {   // d(loss)/d(chunk output)
        if (pipeline_local_neighbour(p, c, +1) >= 0) {   // a hand-off on this rank
            MessageBuffer* m = pipeline_message(p, i, c, MSG_HANDOFF);
            p->mem->copy(x->dres, m->buf, bytes);
            m->state = MSG_FREE;
        } else {
            comm_wait(s->recv_grad);
            s->recv_grad = NULL;
            p->mem->copy(x->dres, s->grad_out, bytes);
        }
    }
    double t0 = now_seconds();
    const ModelOps* ops = p->ops;
    void* model = p->models[c];
    if (part & BACKWARD_WEIGHT) { zero_begin_microbatch(x->z, c, i); }
    if (p->places[c].has_head) { ops->head_backward(model, s->acts, x->grads, x->B, T, x->dloss, part); }
    ops->layers_backward(model, s->acts, x->grads, x->B, T, part);
    if (p->places[c].has_embedding) { ops->embed_backward(model, s->acts, x->grads, x->B, T, part); }
    if ((part & BACKWARD_INPUT) && vs > 0) {   // keep d(loss)/d(chunk input)
        int consumer = pipeline_local_neighbour(p, c, -1);
        MessageBuffer* m = consumer >= 0 ? pipeline_message_new(p, i, consumer, MSG_HANDOFF)
                                         : pipeline_message_new(p, i, c, MSG_TO_SEND);
        p->mem->copy(m->buf, x->dres, bytes);
    }
    if (part & BACKWARD_WEIGHT) {
        zero_end_microbatch(x->z);
        pipeline_slot_release(p, s);
    }
    if (x->timed) { p->mem->sync(); }
    if (part == BACKWARD_WEIGHT) { p->wgt += now_seconds() - t0; } else { p->bwd += now_seconds() - t0; }
}

// dualpipe: the copy of the head on the way of the microbatches entering at stage S-1 sends
// their loss sums to the head chunk's stage (send / recv, pp group), which then has them all.
static inline void pipeline_gather_losses(Pipeline* p, float* local_loss) {
    if (p->cfg.kind != PP_DUALPIPE) { return; }
    int S = p->cfg.num_stages, rank = p->pp->rank, first, count;
    for (int c = 0; c < p->nchunks; c++) {
        if (!p->places[c].has_head) { continue; }
        pipeline_chunk_microbatches(&p->cfg, rank, c, &first, &count);
        if (c == p->head_chunk) {
            comm_wait(comm_irecv(p->pp, local_loss + (first + count) % p->cfg.num_microbatches, (size_t)count,
                                 S - 1 - rank, PP_TAG_LIMIT - 1, COMM_KIND_OTHER));
        } else {
            comm_wait(comm_isend(p->pp, local_loss + first, (size_t)count, S - 1 - rank, PP_TAG_LIMIT - 1,
                                 COMM_KIND_OTHER));
        }
    }
}

// Runs this stage's actions for one optimizer step: forward and backward of this dp rank's
// microbatches (global indices from zero.h) on each of its chunks, gradients reduced, the tied
// halves summed. step_targets: the targets of all the step's microbatches (every rank's), the
// token-weighted loss's denominator. local_loss[i] gets microbatch i's loss sum on the head's
// stage. The compute times (busy, fwd, bwd, wgt, pair) are measured only with several stages
// (they wait for the device to finish each computation).
static inline void pipeline_step(Pipeline* p, Zero* z, void* grads, DataLoader* loader,
                                 int64_t first_microbatch, int64_t step_targets, int B, int T, int overfit,
                                 float* local_loss) {
    const ModelOps* ops = p->ops;
    // dloss = d(loss)/d(each position's loss): the step's loss is token-weighted (over --varlen's
    // sequences of different lengths too)
    float dloss = 1.0f / (float)(double)step_targets;
    PipelineStepContext x = {z, grads, loader, first_microbatch, B, T, overfit, p->cfg.num_stages > 1,
                             pipeline_num_virtual_stages(&p->cfg) - 1, dloss,
                             ops->grad_residual(p->models[0], grads), local_loss};
    p->busy = p->fwd = p->bwd = p->wgt = p->pair = 0.0;
    p->peak_held = p->held;
    for (int k = 0; k < p->nactions; k++) {
        const PipelineAction* act = &p->actions[k];
        int i = act->microbatch, c = act->chunk, vs = p->vstage[c];
        void* model = p->models[c];
        MicroSlot* s;
        MessageBuffer* m;
        double t0;
        switch (act->kind) {
            case PP_RECV_FORWARD:
                // irecv (pp group): the input activation of (microbatch i, chunk c) from the
                // stage holding virtual stage vs - 1
                m = pipeline_message_new(p, i, c, MSG_RECEIVING);
                m->req = comm_irecv(p->pp, m->buf, pipeline_message_floats(p, &x, i), act->peer, pipeline_tag(p, i, vs - 1, 0), COMM_KIND_PP);
                break;
            case PP_FORWARD:
                pipeline_run_forward(p, &x, i, c);
                break;
            case PP_FORWARD_BACKWARD:
                // F&B: every message of both halves was posted before it (their receives) or
                // is posted right after it (their sends), so both chunks' messages are in flight
                // together while it computes; on one CPU thread the two halves run one after the
                // other, the forward first (it frees nothing the backward needs)
                t0 = p->fwd + p->bwd;   // the pair's compute time, its waits for inputs left out
                pipeline_run_forward(p, &x, i, c);
                pipeline_run_backward(p, &x, act->backward_microbatch, act->backward_chunk, BACKWARD_BOTH);
                p->pair += p->fwd + p->bwd - t0;
                break;
            case PP_SEND_FORWARD:
                // isend (pp group): the output of (microbatch i, chunk c) to the stage holding
                // virtual stage vs + 1
                s = pipeline_slot(p, i, c, 0);
                s->send_act = comm_isend(p->pp, ops->stage_output(model, s->acts, B, pipeline_positions(&x, i)),
                                         pipeline_message_floats(p, &x, i),
                                         act->peer, pipeline_tag(p, i, vs, 0), COMM_KIND_PP);
                break;
            case PP_RECV_BACKWARD:
                // irecv (pp group): d(loss)/d(output of (microbatch i, chunk c)) from the stage
                // holding virtual stage vs + 1
                s = pipeline_slot(p, i, c, 0);
                s->recv_grad = comm_irecv(p->pp, s->grad_out, pipeline_message_floats(p, &x, i), act->peer, pipeline_tag(p, i, vs, 1),
                                          COMM_KIND_PP);
                break;
            case PP_BACKWARD:
            case PP_BACKWARD_INPUT:
            case PP_BACKWARD_WEIGHT:
                pipeline_run_backward(p, &x, i, c, act->kind == PP_BACKWARD ? BACKWARD_BOTH
                                                   : act->kind == PP_BACKWARD_INPUT ? BACKWARD_INPUT : BACKWARD_WEIGHT);
                break;
            case PP_SEND_BACKWARD:
                // isend (pp group): d(loss)/d(input of (microbatch i, chunk c)) to the stage
                // holding virtual stage vs - 1
                m = pipeline_message(p, i, c, MSG_TO_SEND);
                m->state = MSG_SENDING;
                m->req = comm_isend(p->pp, m->buf, pipeline_message_floats(p, &x, i), act->peer, pipeline_tag(p, i, vs - 1, 1), COMM_KIND_PP);
                break;
        }
    }
    // the step's last isends (pp group: activations and input gradients) complete
    for (int k = 0; k < p->nslots; k++) { comm_wait(p->slots[k].send_act); p->slots[k].send_act = NULL; }
    for (int k = 0; k < p->nmsgs; k++) { comm_wait(p->msgs[k].req); p->msgs[k].req = NULL; p->msgs[k].state = MSG_FREE; }
    p->busy = p->fwd + p->bwd + p->wgt;
    pipeline_gather_losses(p, local_loss);
    // the gradients' reductions (zero.h: dp group) and the tied embedding's halves (pp group)
    zero_finish_grads(z);
}

// What pipeline_step measured, as the PP_TIMING floats the trainer gathers from every stage:
// the fraction of the step (`seconds`) the stage spent not computing (its bubble); its mean ms
// per (microbatch, chunk) of a forward and of a whole backward (or input half plus weight
// half), and per weight half; the most (microbatch, chunk) activations it held; its mean ms
// per F&B pair (0 without pairs).
#define PP_TIMING 6
static inline void pipeline_step_timing(const Pipeline* p, double seconds, float* out) {
    double units = (double)p->cfg.num_microbatches * p->nchunks / (p->cfg.kind == PP_DUALPIPE ? 2 : 1);
    int pairs = 0, weights = 0;   // dualpipev splits only some backwards
    for (int k = 0; k < p->nactions; k++) {
        pairs += p->actions[k].kind == PP_FORWARD_BACKWARD;
        weights += p->actions[k].kind == PP_BACKWARD_WEIGHT;
    }
    out[0] = (float)(1.0 - p->busy / seconds);
    out[1] = (float)(p->fwd / units * 1e3);
    out[2] = (float)((p->bwd + p->wgt) / units * 1e3);
    out[3] = weights > 0 ? (float)(p->wgt / weights * 1e3) : 0.0f;
    out[4] = (float)p->peak_held;
    out[5] = pairs > 0 ? (float)(p->pair / pairs * 1e3) : 0.0f;
}

// A forward-only pass of one batch through the pipeline (validation, sampling), acts[c] the
// activations of chunk c: the virtual stages in model order, each on the stage holding it; the
// first embeds the tokens, each receives its input (or takes it from the chunk before on this
// rank), runs its layers and sends its output on; the last runs the head. Blocking sends and
// receives: every stage walks the virtual stages in the same order.
// split: acts are laid out as the training passes' (validation), else whole (sampling).
// row >= 0 (generation with a KV cache, B = 1): only position `row` of the pass laid out over
// (1, T), its token inputs[row], through ModelOps' decode (the rows before it are in the
// chunks' activations from the earlier calls); one row of C floats goes from stage to stage.
static inline void pipeline_forward_pass(Pipeline* p, void** acts, const int* inputs, const int* targets,
                                         int B, int T, int C, int split, int row) {
    const ModelOps* ops = p->ops;
    int decode = row >= 0;
    size_t n = decode ? pipeline_words(ops, (size_t)C) : pipeline_pass_floats(p, split ? p->split_mode : SEQS_WHOLE, B, T);   // the message
    size_t at = pipeline_words(ops, decode ? (size_t)row * C : 0);                          // where it starts
    int V = pipeline_num_virtual_stages(&p->cfg);
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
                comm_wait(comm_irecv(p->pp, ops->stage_input(model, acts[c]) + at, n,
                                     pipeline_neighbour_stage(&p->cfg, p->pp->rank, c, -1), pipeline_tag(p, 0, vs - 1, 0),
                                     COMM_KIND_PP));
            }
        }
        if (decode) { ops->layers_decode(model, acts[c], row, T); }
        else { ops->layers_forward(model, acts[c], B, T); }
        if (place->has_head) {
            if (decode) { ops->head_decode(model, acts[c], row, T); }
            else { ops->head_forward(model, acts[c], B, T, 0); }
        } else if (pipeline_chunk_of(p, vs + 1) < 0) {
            // send (pp group): this output to the stage holding virtual stage vs + 1
            comm_wait(comm_isend(p->pp, ops->stage_output(model, acts[c], B, T) + at, n,
                                 pipeline_neighbour_stage(&p->cfg, p->pp->rank, c, +1), pipeline_tag(p, 0, vs, 0),
                                 COMM_KIND_PP));
        }
    }
}

#endif // LLMC_PIPELINE_EXECUTOR_H
