/*
 * pipeline.h: pipeline-parallel schedules as data.
 *
 * Pipeline parallelism cuts the model's layers into contiguous pieces, the virtual stages, and
 * the step's batch into M microbatches. Each rank (stage) holds one piece, or v pieces (model
 * chunks). A piece runs FORWARD and BACKWARD of every microbatch; it receives the input
 * activation of a microbatch from the piece before it and sends its output activation to the
 * piece after it, and going back it receives the gradient of its output from the piece after it
 * and sends the gradient of its input to the piece before it. The order of those computations and
 * messages on every stage is the schedule. This header produces it as a plain list of actions per
 * stage, so that the trainer only executes a list (a switch over eight kinds), the tests check
 * every schedule exhaustively, and dev/tools/pp_schedule draws it. Nothing here talks to MPI.
 *
 * Computations. FORWARD (F). BACKWARD (B) computes the gradients of a piece's input and of its
 * weights in one go. The zero-bubble schedules split it in two (Qi et al. 2023, "Zero Bubble
 * Pipeline Parallelism"): BACKWARD_INPUT (I) computes only the input gradient, the one thing the
 * piece before waits for, and BACKWARD_WEIGHT (W) the weight gradient, which nobody waits for, so
 * it can run later and fill time the stage would otherwise sit idle.
 *
 * Schedules (compute order on stage s; F3 = FORWARD of microbatch 3, B3 its BACKWARD, I3 / W3
 * its BACKWARD_INPUT / BACKWARD_WEIGHT; c1 = on chunk 1):
 *   gpipe        F0 F1 ... F(M-1), then B0 B1 ... B(M-1). Every stage holds the activations of
 *                all M microbatches before the first backward.
 *   1f1b         Megatron-LM's non-interleaved 1F1B (PipeDream-Flush). warmup: the first
 *                min(S-s-1, M) forwards; steady state: M - warmup pairs "forward of the next
 *                microbatch, then backward of the oldest"; cooldown: the remaining backwards.
 *                Stage s holds at most min(S-s, M) microbatches of activations.
 *                S=4, M=8, stage 1: F0 F1 | F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 | B6 B7.
 *   interleaved  Megatron-LM's interleaved 1F1B: each rank holds v model chunks. The model is
 *                cut into S*v virtual stages; chunk c of rank s is virtual stage c*S + s, so an
 *                activation goes round the ring of ranks v times. Microbatches go in groups of
 *                S: the forwards of a group run through chunk 0, then chunk 1, ...; backwards
 *                through the chunks in reverse. warmup = min(2*(S-s-1) + (v-1)*S, v*M)
 *                forwards, then 1F1B pairs, then the remaining backwards. Needs S >= 2, v >= 2
 *                and M a multiple of S (as Megatron-LM requires). Holds at most warmup + 1
 *                (microbatch, chunk) pairs, each 1/v of the stage's layers.
 *   zb1          ZB-H1 (the paper's section 3.1; PyTorch's ScheduleInterleavedZeroBubble with
 *                one chunk): 1f1b with the backward split. The warmup forwards of 1f1b, then for
 *                each backward j = 0..M-1: the next forward while any is left, I(j), and W(j-s)
 *                once j >= s; then the W's left. Stage s defers its W's by s microbatches, so
 *                every stage holds up to min(S, M) microbatches: what stage 0 holds under 1f1b,
 *                the paper's "same peak memory as 1F1B" (a stage s > 0 holds up to s more than
 *                under 1f1b). The deferred W's fill the cooldown, where 1f1b waits for gradients.
 *                S=4, M=8, stage 1: F0 F1 | F2 I0 F3 I1 W0 F4 I2 W1 ... F7 I5 W4 | I6 W5 I7 W6 W7.
 *   zbv          ZB-V (the paper's section 6; PyTorch's ScheduleZBVZeroBubble): 2 chunks per rank
 *                placed as a V, rank s holding virtual stages s (chunk 0) and 2S-1-s (chunk 1);
 *                rank 0 has both the embedding and the head, and the last rank hands chunk 0's
 *                output to its own chunk 1. With N = max(M, 2S-1), rank s runs 2(S-s)-1 forwards
 *                of chunk 0; s times (F c1, F c0); S-s times (F I W of c1); then, while forwards
 *                are left, (F c0 while any is left, I W c0, F I W c1); then s times (I c0, I c1),
 *                S-s times (I c0, the oldest W left of c0), the W's left of c1, those of c0.
 *                Microbatches >= M (when M < 2S-1) are left out. A rank holds at most 2S
 *                (microbatch, chunk) pairs, i.e. S microbatches of a 1f1b stage's layers: the
 *                paper's peak memory p*M_B, on every rank.
 *                S=2, M=4, rank 1: F0c0 F0c1 F1c0 F1c1 I0c1 W0c1 F2c0 I0c0 W0c0 F2c1 I1c1 W1c1
 *                F3c0 I1c0 W1c0 F3c1 I2c1 W2c1 I2c0 I3c1 I3c0 W2c0 W3c1 W3c0.
 *
 * Layer placement (pipeline_place_layers). The layers are balanced over the S*v virtual stages
 * (pipeline_partition_layers) in model order, and chunk c of rank s holds the layers of
 * pipeline_virtual_stage(cfg, s, c): s for one chunk, c*S + s for interleaved (Megatron's
 * round-robin), s or 2S-1-s for zbv. Virtual stage 0 also holds the embedding, the last one the
 * final layernorm, the LM head and the loss.
 *
 * Local hand-offs. When consecutive virtual stages w and w+1 are on the same rank (zbv: the
 * last rank, w = S-1 in chunk 0 and w+1 in chunk 1; every hand-off when S = 1) nothing is sent:
 * the lists have no SEND/RECV for it (a SEND or RECV never has peer == its own stage), and
 * pipeline_neighbour_stage returns the stage itself. The consumer reads the producer's result
 * in place: the FORWARD of (m, w+1) takes the output of the FORWARD of (m, w) as its input, and
 * the BACKWARD / BACKWARD_INPUT of (m, w) takes the input gradient computed by the backward of
 * (m, w+1) as its output gradient. The producer always comes earlier in the same list. (A send
 * to oneself would need non-blocking MPI and a second buffer, and deadlocks under the blocking
 * execution the pairing rule allows.)
 *
 * Where the sends and receives go (the pairing rule). Take the reference timeline: the compute
 * orders above run with FORWARD = 1 and BACKWARD = 2 time units (backward computes gradients of
 * both inputs and weights, about twice the forward), or, when the backward is split, FORWARD =
 * BACKWARD_INPUT = BACKWARD_WEIGHT = 1 (the zero-bubble paper's T_F = T_B = T_W); instant
 * transfers, and every computation starting as soon as its stage is free and its input is there.
 * Every message gets one instant: the first time, from when its producer ends to when its
 * consumer starts, at which neither the sender nor the receiver is in the middle of a
 * computation (if there is none: the producer's end). The sender and the receiver both place the
 * SEND / RECV after their computations that start before that instant and before those that start
 * at or after it. Messages at the same instant are ordered by link (the message from virtual
 * stage w to w+1 or back goes on link w mod S; with one chunk per rank link k joins rank k and
 * rank k+1), forward before backward, then by the producer's end, then by w.
 *   - Every stage therefore issues its sends and receives in one global message order, which
 *     makes in-order execution with BLOCKING sends and receives deadlock-free even when every
 *     send waits for its receiver (rendezvous, the strictest semantics): take the earliest
 *     message not yet delivered; both ends have finished every earlier message and only compute
 *     in between (inputs of those computations come from earlier messages or, handed off
 *     locally, from earlier in the same list), so both reach it. Non-blocking execution
 *     (MPI_Isend at SEND, MPI_Irecv at RECV, wait before the computation that reads the buffer)
 *     is only more permissive.
 *   - In the 1F1B steady state (from its second pair on) this is Megatron-LM's pairing: right
 *     after F(i), stage s sends F(i)'s output to s+1 and receives the gradient for its next
 *     backward from s+1 (send_forward_recv_backward); right after B(j) it sends B(j)'s input
 *     gradient to s-1 and receives the input of its next forward (send_backward_recv_forward).
 *   - With costs in the reference ratio every message of gpipe, 1f1b, zb1 and zbv finds both
 *     ends free at its instant, so even blocking execution reaches the textbook makespan.
 *     Interleaved does with non-blocking sends; with blocking ones a few messages find both ends
 *     busy and the sender waits (S=2, v=2, M=4: 29 instead of 27 chunk-forward units).
 *   - Sends and receives at the same instant on a stage are marked post_with_next (all but the
 *     last of the run). An executor may post such a run as one batch (MPI_Isend/MPI_Irecv for
 *     each, then MPI_Waitall; MPI_Sendrecv for a send+receive pair with one peer), as Megatron's
 *     batch_isend_irecv does. That is deadlock-free too (a batch completes once both ends of each
 *     of its messages are posted, which the argument above guarantees).
 *   - On each ordered pair of ranks the sends and the receives come in the same order, so
 *     messages match even with a single MPI tag; a tag from (microbatch, chunk, direction) works.
 *
 * Executing a stage's list (the trainer), for (m, c) = (a.microbatch, a.chunk):
 *   RECV_FORWARD     receive the input activation of (m, c) from a.peer
 *   FORWARD          run chunk c forward on microbatch m; its input comes from the data loader
 *                    (virtual stage 0), a RECV_FORWARD, or the local hand-off above
 *   SEND_FORWARD     send its output activation to a.peer
 *   RECV_BACKWARD    receive the gradient of that output from a.peer
 *   BACKWARD         gradients of (m, c)'s input and weights; frees its activations
 *   BACKWARD_INPUT   the gradient of (m, c)'s input only; keeps the activations (W reads them)
 *   BACKWARD_WEIGHT  the weight gradient of (m, c), after its BACKWARD_INPUT; frees them
 *   SEND_BACKWARD    send the gradient of (m, c)'s input to a.peer
 * On every chunk the B's (or the W's) come in microbatch order, so a weight's gradient sums the
 * microbatches in the same order as on one rank. Virtual stage 0 reads its input from the
 * data loader and the last virtual stage computes the loss, so they have no RECV_FORWARD /
 * RECV_BACKWARD respectively. What follows the lists (all-reducing the tied embedding's gradient
 * between the ranks holding the embedding and the head, the optimizer step) is not part of the
 * schedule.
 *
 * API (all functions static inline):
 *   pipeline_check_config(cfg, err, errlen)             0, or -1 with a message
 *   pipeline_parse_schedule("1f1b", &kind, err, errlen)  names: gpipe, 1f1b, interleaved, zb1, zbv
 *   pipeline_splits_backward(kind)                       1: I and W instead of B (zb1, zbv)
 *   pipeline_virtual_stage(cfg, stage, chunk), pipeline_virtual_stage_owner(cfg, vs, &stage, &chunk)
 *   pipeline_neighbour_stage(cfg, stage, chunk, -1 or +1)
 *                                                        the stage before / after a chunk: -1
 *                                                        none, `stage` a local hand-off
 *   pipeline_stage_actions(cfg, stage, out, capacity, err, errlen)
 *                                                        one stage's list into a caller buffer
 *                                                        (out = NULL: just the count, at most
 *                                                        pipeline_max_actions(cfg))
 *   pipeline_schedule_build(&sch, cfg, err, errlen)      every stage's list, malloc'd;
 *   pipeline_schedule_free(&sch)                         stage s: sch.actions[sch.offset[s] ..)
 *   pipeline_max_in_flight(actions, n)                   most (microbatch, chunk) activations held
 *   pipeline_memory_bound(cfg, stage)                    the textbook bound on that number
 *   pipeline_bubble_fraction(cfg)                        the modelled bubble
 *   pipeline_partition_layers(L, parts, embed, head, first_layer, err, errlen)
 *   pipeline_place_layers(cfg, L, embed, head, out, err, errlen)
 *                                                        the layers of each (rank, chunk)
 *   pipeline_simulate(&sch, &costs, &timeline, err, errlen), pipeline_timeline_free(&timeline)
 *                                                        runs any lists with given compute costs
 *                                                        under rendezvous, batched or eager
 *                                                        sends; the timeline, the bubble per
 *                                                        stage, or a deadlock / invalid schedule
 *                                                        reported instead of hanging
 *
 * Errors: functions that can fail return -1 and write one line into the caller's err buffer
 * (err may be NULL). Only allocation failure (malloc_or_die) and a guard on an internal
 * invariant end the program.
 * Header-only C11; also compiles as C++ host code under nvcc (no VLAs, explicit casts).
 */
#ifndef LLMC_PIPELINE_H
#define LLMC_PIPELINE_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------------
// configuration

typedef enum {
    PP_GPIPE = 0,
    PP_1F1B = 1,
    PP_INTERLEAVED = 2,
    PP_ZB1 = 3,
    PP_ZBV = 4,
} PipelineScheduleKind;

typedef struct {
    int num_stages;             // S: pipeline ranks
    int num_microbatches;       // M: microbatches per optimizer step
    PipelineScheduleKind kind;
    int num_chunks;             // v: model chunks per rank; 1 for gpipe, 1f1b and zb1, >= 2
                                // interleaved, 2 zbv
} PipelineConfig;

// Bound on S*v*M (e.g. 64 stages x 4 chunks x 4096 microbatches), so that counts fit an int
// and building a schedule stays within tens of megabytes.
#define PIPELINE_MAX_UNITS (1 << 20)

__attribute__((format(printf, 3, 4)))
static inline int pp_error(char* err, size_t errlen, const char* fmt, ...) {
    if (err != NULL && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static inline const char* pipeline_schedule_name(PipelineScheduleKind kind) {
    switch (kind) {
        case PP_GPIPE: return "gpipe";
        case PP_1F1B: return "1f1b";
        case PP_INTERLEAVED: return "interleaved";
        case PP_ZB1: return "zb1";
        case PP_ZBV: return "zbv";
    }
    return "unknown";
}

static inline int pipeline_parse_schedule(const char* name, PipelineScheduleKind* kind,
                                          char* err, size_t errlen) {
    static const PipelineScheduleKind kinds[] = {PP_GPIPE, PP_1F1B, PP_INTERLEAVED, PP_ZB1, PP_ZBV};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        if (name != NULL && strcmp(name, pipeline_schedule_name(kinds[i])) == 0) {
            *kind = kinds[i];
            return 0;
        }
    }
    return pp_error(err, errlen, "unknown pipeline schedule '%s' (expected gpipe, 1f1b, interleaved, zb1 or zbv)",
                    name != NULL ? name : "(null)");
}

// 1 when the schedule runs BACKWARD_INPUT and BACKWARD_WEIGHT instead of BACKWARD.
static inline int pipeline_splits_backward(PipelineScheduleKind kind) {
    return kind == PP_ZB1 || kind == PP_ZBV;
}

static inline int pipeline_check_config(const PipelineConfig* cfg, char* err, size_t errlen) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    if (S < 1) { return pp_error(err, errlen, "pipeline: the number of stages must be at least 1, got %d", S); }
    if (M < 1) { return pp_error(err, errlen, "pipeline: the number of microbatches must be at least 1, got %d", M); }
    switch (cfg->kind) {
        case PP_GPIPE:
        case PP_1F1B:
        case PP_ZB1:
            if (v != 1) {
                return pp_error(err, errlen, "pipeline: the %s schedule runs one model chunk per stage, "
                                "so the number of chunks must be 1, got %d", pipeline_schedule_name(cfg->kind), v);
            }
            break;
        case PP_INTERLEAVED:
            if (S < 2) {
                return pp_error(err, errlen, "pipeline: the interleaved schedule needs at least 2 stages, got %d", S);
            }
            if (v < 2) {
                return pp_error(err, errlen, "pipeline: the interleaved schedule needs at least 2 model chunks "
                                "per stage, got %d", v);
            }
            if (M % S != 0) {
                return pp_error(err, errlen, "pipeline: the interleaved schedule needs the number of microbatches "
                                "(%d) to be a multiple of the number of stages (%d)", M, S);
            }
            break;
        case PP_ZBV:
            if (v != 2) {
                return pp_error(err, errlen, "pipeline: the zbv schedule runs two model chunks per stage (the V), "
                                "so the number of chunks must be 2, got %d", v);
            }
            break;
        default:
            return pp_error(err, errlen, "pipeline: unknown schedule kind %d", (int)cfg->kind);
    }
    if ((long long)S * v * M > PIPELINE_MAX_UNITS) {
        return pp_error(err, errlen, "pipeline: %d stages x %d chunks x %d microbatches is too large (limit %d)",
                        S, v, M, PIPELINE_MAX_UNITS);
    }
    return 0;
}

// ----------------------------------------------------------------------------------------------
// actions

typedef enum {
    PP_RECV_FORWARD = 0,  // receive the input activation of (microbatch, chunk) from peer
    PP_FORWARD,           // forward of (microbatch, chunk)
    PP_SEND_FORWARD,      // send the output activation of (microbatch, chunk) to peer
    PP_RECV_BACKWARD,     // receive the gradient w.r.t. that output from peer
    PP_BACKWARD,          // backward of (microbatch, chunk): input and weight gradients
    PP_SEND_BACKWARD,     // send the gradient w.r.t. the input of (microbatch, chunk) to peer
    PP_BACKWARD_INPUT,    // split backward, first half: the input gradient only
    PP_BACKWARD_WEIGHT,   // split backward, second half: the weight gradient
} PipelineActionKind;

typedef struct {
    PipelineActionKind kind;
    int microbatch;      // 0 .. M-1
    int chunk;           // model chunk on this stage, 0 .. v-1
    int peer;            // the stage at the other end of a send/receive (never this stage);
                         // -1 for computations
    int post_with_next;  // 1: a send/receive at the same instant as the next action, which is one
                         // too; the run may be posted as one batch (see the pairing rule above)
} PipelineAction;

static inline int pipeline_is_compute(PipelineActionKind kind) {
    return kind == PP_FORWARD || kind == PP_BACKWARD || kind == PP_BACKWARD_INPUT || kind == PP_BACKWARD_WEIGHT;
}

// The computations that produce the input gradient, which SEND_BACKWARD sends.
static inline int pipeline_is_input_backward(PipelineActionKind kind) {
    return kind == PP_BACKWARD || kind == PP_BACKWARD_INPUT;
}

static inline const char* pipeline_action_kind_name(PipelineActionKind kind) {
    switch (kind) {
        case PP_RECV_FORWARD: return "RECV_FORWARD";
        case PP_FORWARD: return "FORWARD";
        case PP_SEND_FORWARD: return "SEND_FORWARD";
        case PP_RECV_BACKWARD: return "RECV_BACKWARD";
        case PP_BACKWARD: return "BACKWARD";
        case PP_SEND_BACKWARD: return "SEND_BACKWARD";
        case PP_BACKWARD_INPUT: return "BACKWARD_INPUT";
        case PP_BACKWARD_WEIGHT: return "BACKWARD_WEIGHT";
    }
    return "UNKNOWN";
}

// Compact token: F3 / B3 / I3 / W3 for computations, rF3 sF3 rB3 sB3 for receive/send of the
// forward activation or backward gradient of microbatch 3; "c1" appended for chunk 1 when the
// stages hold several chunks.
static inline void pipeline_action_token(const PipelineAction* a, int with_chunk, char* buf, size_t len) {
    const char* prefix = "?";
    switch (a->kind) {
        case PP_RECV_FORWARD: prefix = "rF"; break;
        case PP_FORWARD: prefix = "F"; break;
        case PP_SEND_FORWARD: prefix = "sF"; break;
        case PP_RECV_BACKWARD: prefix = "rB"; break;
        case PP_BACKWARD: prefix = "B"; break;
        case PP_SEND_BACKWARD: prefix = "sB"; break;
        case PP_BACKWARD_INPUT: prefix = "I"; break;
        case PP_BACKWARD_WEIGHT: prefix = "W"; break;
    }
    if (with_chunk) {
        snprintf(buf, len, "%s%dc%d", prefix, a->microbatch, a->chunk);
    } else {
        snprintf(buf, len, "%s%d", prefix, a->microbatch);
    }
}

// The position in the model of chunk `chunk` of stage `stage`, 0 .. S*v-1: the stage itself
// with one chunk, c*S + s interleaved (round-robin), s and 2S-1-s for zbv (the V).
static inline int pipeline_virtual_stage(const PipelineConfig* cfg, int stage, int chunk) {
    if (cfg->kind == PP_ZBV) { return chunk == 0 ? stage : 2 * cfg->num_stages - 1 - stage; }
    return chunk * cfg->num_stages + stage;
}

// The inverse: which stage and chunk hold virtual stage vs.
static inline void pipeline_virtual_stage_owner(const PipelineConfig* cfg, int vs, int* stage, int* chunk) {
    int S = cfg->num_stages;
    if (cfg->kind == PP_ZBV) {
        *chunk = vs < S ? 0 : 1;
        *stage = vs < S ? vs : 2 * S - 1 - vs;
    } else {
        *chunk = vs / S;
        *stage = vs % S;
    }
}

static inline int pp_owner_stage(const PipelineConfig* cfg, int vs) {
    int stage, chunk;
    pipeline_virtual_stage_owner(cfg, vs, &stage, &chunk);
    return stage;
}

// The stage holding the virtual stage before (step = -1) or after (step = +1) chunk `chunk` of
// `stage`: -1 if there is none (the first / last virtual stage), `stage` itself for a local
// hand-off (no message; see the header comment).
static inline int pipeline_neighbour_stage(const PipelineConfig* cfg, int stage, int chunk, int step) {
    int vs = pipeline_virtual_stage(cfg, stage, chunk) + step;
    if (vs < 0 || vs >= cfg->num_stages * cfg->num_chunks) { return -1; }
    return pp_owner_stage(cfg, vs);
}

// Most actions one stage's list can have: per (microbatch, chunk) its computations (F and B, or
// F, I and W) plus at most two receives and two sends.
static inline int pipeline_max_actions(const PipelineConfig* cfg) {
    return (pipeline_splits_backward(cfg->kind) ? 7 : 6) * cfg->num_chunks * cfg->num_microbatches;
}

// ----------------------------------------------------------------------------------------------
// compute order

// Computations per stage: F and B, or F, I and W, of every (microbatch, chunk).
static inline int pp_computations(const PipelineConfig* cfg) {
    return (pipeline_splits_backward(cfg->kind) ? 3 : 2) * cfg->num_chunks * cfg->num_microbatches;
}

// Appends a computation unless its microbatch does not exist (zbv writes its pattern for at
// least 2S-1 microbatches and leaves out those past M).
static inline void pp_push(const PipelineConfig* cfg, PipelineAction* out, int* count, PipelineActionKind kind,
                           int microbatch, int chunk) {
    if (microbatch >= cfg->num_microbatches) { return; }
    PipelineAction* a = &out[(*count)++];
    a->kind = kind;
    a->microbatch = microbatch;
    a->chunk = chunk;
    a->peer = -1;
    a->post_with_next = 0;
}

// The k-th forward (or backward) of a stage, k in 0 .. v*M-1, as (microbatch, chunk).
// Microbatches go in groups of S; inside a group the forwards run chunk 0 for all S, then
// chunk 1, ...; the backwards run the chunks in reverse. With v = 1 this is microbatch k.
static inline void pp_unit(const PipelineConfig* cfg, int k, int backward, int* microbatch, int* chunk) {
    int S = cfg->num_stages, v = cfg->num_chunks;
    int group = k / (S * v), in_group = k % (S * v);
    *microbatch = group * S + in_group % S;
    *chunk = backward ? v - 1 - in_group / S : in_group / S;
}

// Forwards a stage runs before its first backward (gpipe, 1f1b, interleaved, zb1).
static inline int pp_warmup(const PipelineConfig* cfg, int stage) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    int w = 0;
    switch (cfg->kind) {
        case PP_GPIPE: w = M; break;
        // In the steady state each of the S-s stages from s to the last works on a different
        // microbatch, so stage s runs S-s-1 forwards ahead of its first backward.
        case PP_1F1B:
        case PP_ZB1: w = S - stage - 1; break;
        // Megatron-LM: a group of S forwards for each chunk but the last, plus two per later
        // stage (the activation has one more stage to go out, the gradient one more to come back).
        case PP_INTERLEAVED: w = 2 * (S - stage - 1) + (v - 1) * S; break;
        case PP_ZBV: break;  // has phases of its own (pp_order_zbv)
    }
    return w < v * M ? w : v * M;
}

// gpipe, 1f1b, interleaved: warmup forwards, steady-state (forward, backward) pairs, cooldown
// backwards. GPipe is the case "warmup = every forward".
static inline int pp_order_one_forward_one_backward(const PipelineConfig* cfg, int stage, PipelineAction* out) {
    int n = cfg->num_chunks * cfg->num_microbatches;
    int warmup = pp_warmup(cfg, stage);
    int count = 0;
    for (int i = 0; i < n + warmup; i++) {
        // step i runs forward i (while any are left) and, once the warmup is over, backward i - warmup
        for (int backward = 0; backward <= 1; backward++) {
            int k = backward ? i - warmup : i;
            if (k < 0 || k >= n) { continue; }
            int microbatch, chunk;
            pp_unit(cfg, k, backward, &microbatch, &chunk);
            pp_push(cfg, out, &count, backward ? PP_BACKWARD : PP_FORWARD, microbatch, chunk);
        }
    }
    return count;
}

// zb1 (ZB-H1): 1f1b's warmup, then per backward j the next forward, I(j) and W(j - stage).
static inline int pp_order_zb1(const PipelineConfig* cfg, int stage, PipelineAction* out) {
    int M = cfg->num_microbatches, warmup = pp_warmup(cfg, stage);
    int count = 0;
    for (int k = 0; k < warmup; k++) { pp_push(cfg, out, &count, PP_FORWARD, k, 0); }
    for (int j = 0; j < M; j++) {
        if (warmup + j < M) { pp_push(cfg, out, &count, PP_FORWARD, warmup + j, 0); }
        pp_push(cfg, out, &count, PP_BACKWARD_INPUT, j, 0);
        if (j >= stage) { pp_push(cfg, out, &count, PP_BACKWARD_WEIGHT, j - stage, 0); }
    }
    for (int j = M - stage > 0 ? M - stage : 0; j < M; j++) { pp_push(cfg, out, &count, PP_BACKWARD_WEIGHT, j, 0); }
    return count;
}

// pp_push of the next microbatch of `chunk` by the counter `next` [2], which moves on.
static inline void pp_push_next(const PipelineConfig* cfg, PipelineAction* out, int* count, PipelineActionKind kind,
                                int* next, int chunk) {
    pp_push(cfg, out, count, kind, next[chunk]++, chunk);
}


// zbv (ZB-V), the phases of the header comment. Counters: next forward, input backward and
// weight backward of each chunk.
static inline int pp_order_zbv(const PipelineConfig* cfg, int stage, PipelineAction* out) {
    int S = cfg->num_stages, M = cfg->num_microbatches;
    // the phases are written for at least the 2S-1 forwards of chunk 0 that rank 0 starts with
    int N = M > 2 * S - 1 ? M : 2 * S - 1;
    int forwards[2] = {0, 0}, inputs[2] = {0, 0}, weights[2] = {0, 0};
    int count = 0;
    for (int i = 0; i < 2 * (S - stage) - 1; i++) { pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 0); }
    for (int i = 0; i < stage; i++) {
        pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 1);
        pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 0);
    }
    for (int i = 0; i < S - stage; i++) {
        pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 1);
        pp_push_next(cfg, out, &count, PP_BACKWARD_INPUT, inputs, 1);
        pp_push_next(cfg, out, &count, PP_BACKWARD_WEIGHT, weights, 1);
    }
    while (forwards[1] < forwards[0] || forwards[0] < N) {
        if (forwards[0] < N) { pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 0); }
        pp_push_next(cfg, out, &count, PP_BACKWARD_INPUT, inputs, 0);
        pp_push_next(cfg, out, &count, PP_BACKWARD_WEIGHT, weights, 0);
        pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 1);
        pp_push_next(cfg, out, &count, PP_BACKWARD_INPUT, inputs, 1);
        pp_push_next(cfg, out, &count, PP_BACKWARD_WEIGHT, weights, 1);
    }
    for (int i = 0; i < stage; i++) {
        pp_push_next(cfg, out, &count, PP_BACKWARD_INPUT, inputs, 0);
        pp_push_next(cfg, out, &count, PP_BACKWARD_INPUT, inputs, 1);
    }
    for (int i = 0; i < S - stage; i++) {
        pp_push_next(cfg, out, &count, PP_BACKWARD_INPUT, inputs, 0);
        pp_push_next(cfg, out, &count, PP_BACKWARD_WEIGHT, weights, 0);
    }
    while (weights[1] < N) { pp_push_next(cfg, out, &count, PP_BACKWARD_WEIGHT, weights, 1); }
    while (weights[0] < N) { pp_push_next(cfg, out, &count, PP_BACKWARD_WEIGHT, weights, 0); }
    return count;
}

// Writes the stage's computations in execution order; returns their number.
static inline int pp_compute_order(const PipelineConfig* cfg, int stage, PipelineAction* out) {
    switch (cfg->kind) {
        case PP_ZB1: return pp_order_zb1(cfg, stage, out);
        case PP_ZBV: return pp_order_zbv(cfg, stage, out);
        default: return pp_order_one_forward_one_backward(cfg, stage, out);
    }
}

// The reference timeline (see the pairing rule): every stage's compute order run with the
// reference costs, each computation starting once its stage is free and its input exists,
// transfers instant. Integer times, so exact.
typedef struct {
    int n;                  // computations per stage
    PipelineAction* order;  // [S*n]: each stage's compute order
    int* start;             // [S*n]: when each of them starts
    int* fwd_start;         // [V*M]: when the FORWARD of (virtual stage, microbatch) starts
    int* fwd_end;           //        ... and ends
    int* bwd_start;         // [V*M]: when the computation of its input gradient (B or I) starts
    int* bwd_end;           //        ... and ends
    int horizon;            // when the last computation ends
    char* inside;           // [S*(horizon+1)]: stage s is in the middle of a computation at time t
} PPReference;

static inline int pp_reference_cost(PipelineActionKind kind) {
    return kind == PP_BACKWARD ? 2 : 1;
}

static inline void pp_reference_build(PPReference* ref, const PipelineConfig* cfg) {
    int S = cfg->num_stages, M = cfg->num_microbatches, V = S * cfg->num_chunks;
    int n = pp_computations(cfg);
    size_t units = (size_t)V * M;
    ref->n = n;
    ref->order = (PipelineAction*)malloc_or_die((size_t)S * n * sizeof(PipelineAction), "pipeline order");
    ref->start = (int*)malloc_or_die((size_t)S * n * sizeof(int), "pipeline reference timeline");
    ref->fwd_start = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    ref->fwd_end = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    ref->bwd_start = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    ref->bwd_end = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    int* pos = (int*)calloc_or_die((size_t)S, sizeof(int), "pipeline reference timeline");
    int* clock = (int*)calloc_or_die((size_t)S, sizeof(int), "pipeline reference timeline");
    for (int s = 0; s < S; s++) {
        int count = pp_compute_order(cfg, s, ref->order + (size_t)s * n);
        if (count != n) {
            fatal("pipeline: internal error: the %s compute order of stage %d has %d computations, expected %d",
                  pipeline_schedule_name(cfg->kind), s, count, n);
        }
    }
    for (size_t i = 0; i < units; i++) { ref->fwd_start[i] = ref->fwd_end[i] = ref->bwd_start[i] = ref->bwd_end[i] = -1; }
    long long remaining = (long long)S * n;
    while (remaining > 0) {
        int progress = 0;
        for (int s = 0; s < S; s++) {
            while (pos[s] < n) {
                const PipelineAction* a = &ref->order[(size_t)s * n + pos[s]];
                int u = pipeline_virtual_stage(cfg, s, a->chunk) * M + a->microbatch;
                int ready;  // when the input exists; -1: not yet
                if (a->kind == PP_FORWARD) {
                    ready = u < M ? 0 : ref->fwd_end[u - M];
                } else if (a->kind == PP_BACKWARD_WEIGHT) {
                    ready = ref->bwd_end[u];
                } else {
                    ready = u >= (V - 1) * M ? ref->fwd_end[u] : ref->bwd_end[u + M];
                }
                if (ready < 0) { break; }
                int start = clock[s] > ready ? clock[s] : ready;
                clock[s] = start + pp_reference_cost(a->kind);
                ref->start[(size_t)s * n + pos[s]] = start;
                if (a->kind == PP_FORWARD) {
                    ref->fwd_start[u] = start;
                    ref->fwd_end[u] = clock[s];
                } else if (pipeline_is_input_backward(a->kind)) {
                    ref->bwd_start[u] = start;
                    ref->bwd_end[u] = clock[s];
                }
                pos[s]++;
                remaining--;
                progress = 1;
            }
        }
        // Cannot happen: each compute order only waits for work that comes earlier in its own
        // or another stage's order. A loud guard against an edit that breaks that.
        if (!progress) { fatal("pipeline: internal error: the %s compute order is cyclic", pipeline_schedule_name(cfg->kind)); }
    }
    ref->horizon = 0;
    for (int s = 0; s < S; s++) { ref->horizon = clock[s] > ref->horizon ? clock[s] : ref->horizon; }
    ref->inside = (char*)calloc_or_die((size_t)S * (ref->horizon + 1), 1, "pipeline reference timeline");
    for (int s = 0; s < S; s++) {
        for (int j = 0; j < n; j++) {
            int start = ref->start[(size_t)s * n + j];
            int end = start + pp_reference_cost(ref->order[(size_t)s * n + j].kind);
            for (int t = start + 1; t < end; t++) { ref->inside[(size_t)s * (ref->horizon + 1) + t] = 1; }
        }
    }
    free(pos);
    free(clock);
}

static inline void pp_reference_free(PPReference* ref) {
    free(ref->order);
    free(ref->start);
    free(ref->fwd_start);
    free(ref->fwd_end);
    free(ref->bwd_start);
    free(ref->bwd_end);
    free(ref->inside);
}

// The instant of a message produced at time `produced` on stage `from` and consumed by a
// computation starting at time `consumed` on stage `to`: the first time from `produced` to
// `consumed` at which neither stage is in the middle of a computation, so that with blocking
// sends neither waits for the other in the reference timeline. If there is none (both busy
// throughout), the producer's end: a blocking sender then waits there.
static inline int pp_message_instant(const PPReference* ref, int from, int to, int produced, int consumed) {
    const char* busy_from = ref->inside + (size_t)from * (ref->horizon + 1);
    const char* busy_to = ref->inside + (size_t)to * (ref->horizon + 1);
    for (int t = produced; t <= consumed; t++) {
        if (!busy_from[t] && !busy_to[t]) { return t; }
    }
    return produced;
}

// One entry of a stage's list before sorting: actions are ordered by (time, phase, link, dir,
// produced, boundary). Sends and receives (phase 0) at an instant come before a computation
// starting then (phase 1). A message crosses boundary w (between virtual stages w and w+1) on
// link w mod S. Messages across one boundary in one direction come from one virtual stage, whose
// computations end at distinct times, so (produced, boundary) makes the order of messages total
// and the same on both ends.
typedef struct {
    int time, phase, link, dir, produced, boundary;
    PipelineAction action;
} PPEvent;

static inline int pp_event_compare(const void* pa, const void* pb) {
    const PPEvent* a = (const PPEvent*)pa;
    const PPEvent* b = (const PPEvent*)pb;
    if (a->time != b->time) { return a->time < b->time ? -1 : 1; }
    if (a->phase != b->phase) { return a->phase < b->phase ? -1 : 1; }
    if (a->link != b->link) { return a->link < b->link ? -1 : 1; }
    if (a->dir != b->dir) { return a->dir < b->dir ? -1 : 1; }
    if (a->produced != b->produced) { return a->produced < b->produced ? -1 : 1; }
    return a->boundary < b->boundary ? -1 : (a->boundary > b->boundary ? 1 : 0);
}

static inline void pp_add_event(PPEvent* events, int* count, int time, int phase, int boundary, int num_stages,
                                int dir, int produced, PipelineActionKind kind, const PipelineAction* compute,
                                int peer) {
    PPEvent* e = &events[(*count)++];
    e->time = time;
    e->phase = phase;
    e->link = boundary % num_stages;
    e->dir = dir;
    e->produced = produced;
    e->boundary = boundary;
    e->action = *compute;
    e->action.kind = kind;
    e->action.peer = peer;
}

// Builds the full action list of one stage from the reference timeline. events must hold
// pipeline_max_actions(cfg) entries. Returns the number of actions; writes them to out only if
// capacity allows. A hand-off between virtual stages on this same stage gets no message.
static inline int pp_emit_stage(const PipelineConfig* cfg, const PPReference* ref, int stage,
                                PPEvent* events, PipelineAction* out, int capacity) {
    int S = cfg->num_stages, M = cfg->num_microbatches, n = ref->n;
    const int* fwd_end = ref->fwd_end;
    const int* bwd_end = ref->bwd_end;
    int count = 0;
    for (int j = 0; j < n; j++) {
        const PipelineAction* a = &ref->order[(size_t)stage * n + j];
        int start = ref->start[(size_t)stage * n + j];
        int vs = pipeline_virtual_stage(cfg, stage, a->chunk);
        int u = vs * M + a->microbatch;
        // messages only to and from another stage
        int prev = pipeline_neighbour_stage(cfg, stage, a->chunk, -1);
        int next = pipeline_neighbour_stage(cfg, stage, a->chunk, +1);
        int prev_is_remote = prev >= 0 && prev != stage, next_is_remote = next >= 0 && next != stage;
        // dir 0 forward, 1 backward
        if (a->kind == PP_FORWARD) {
            if (prev_is_remote) {
                int t = pp_message_instant(ref, prev, stage, fwd_end[u - M], start);
                pp_add_event(events, &count, t, 0, vs - 1, S, 0, fwd_end[u - M], PP_RECV_FORWARD, a, prev);
            }
            pp_add_event(events, &count, start, 1, 0, S, 0, 0, a->kind, a, -1);
            if (next_is_remote) {
                int t = pp_message_instant(ref, stage, next, fwd_end[u], ref->fwd_start[u + M]);
                pp_add_event(events, &count, t, 0, vs, S, 0, fwd_end[u], PP_SEND_FORWARD, a, next);
            }
        } else if (pipeline_is_input_backward(a->kind)) {
            if (next_is_remote) {
                int t = pp_message_instant(ref, next, stage, bwd_end[u + M], start);
                pp_add_event(events, &count, t, 0, vs, S, 1, bwd_end[u + M], PP_RECV_BACKWARD, a, next);
            }
            pp_add_event(events, &count, start, 1, 0, S, 0, 0, a->kind, a, -1);
            if (prev_is_remote) {
                int t = pp_message_instant(ref, stage, prev, bwd_end[u], ref->bwd_start[u - M]);
                pp_add_event(events, &count, t, 0, vs - 1, S, 1, bwd_end[u], PP_SEND_BACKWARD, a, prev);
            }
        } else {
            pp_add_event(events, &count, start, 1, 0, S, 0, 0, a->kind, a, -1);
        }
    }
    qsort(events, (size_t)count, sizeof(PPEvent), pp_event_compare);
    for (int i = 0; i + 1 < count; i++) {
        events[i].action.post_with_next = events[i].phase == 0 && events[i + 1].phase == 0 &&
                                          events[i].time == events[i + 1].time;
    }
    if (count <= capacity) {
        for (int i = 0; i < count; i++) { out[i] = events[i].action; }
    }
    return count;
}

// The ordered actions of one stage. Returns their number n and writes them to out[0 .. n),
// or returns -1 with a message when cfg or stage is invalid or capacity < n.
// Pass out = NULL, capacity = 0 to get n only. n <= pipeline_max_actions(cfg) always.
static inline int pipeline_stage_actions(const PipelineConfig* cfg, int stage, PipelineAction* out,
                                         int capacity, char* err, size_t errlen) {
    if (pipeline_check_config(cfg, err, errlen) != 0) { return -1; }
    if (stage < 0 || stage >= cfg->num_stages) {
        return pp_error(err, errlen, "pipeline: stage %d is out of range 0..%d", stage, cfg->num_stages - 1);
    }
    PPReference ref;
    pp_reference_build(&ref, cfg);
    PPEvent* events = (PPEvent*)malloc_or_die((size_t)pipeline_max_actions(cfg) * sizeof(PPEvent), "pipeline events");
    int n = pp_emit_stage(cfg, &ref, stage, events, out, out != NULL ? capacity : 0);
    pp_reference_free(&ref);
    free(events);
    if (out != NULL && n > capacity) {
        return pp_error(err, errlen, "pipeline: stage %d has %d actions but the buffer holds %d", stage, n, capacity);
    }
    return n;
}

// ----------------------------------------------------------------------------------------------
// all stages at once (for the simulator, the tests and the drawing tool)

typedef struct {
    PipelineConfig cfg;
    int* offset;              // [S+1]: stage s's actions are actions[offset[s] .. offset[s+1])
    PipelineAction* actions;  // [offset[S]]
} PipelineSchedule;

// Builds every stage's list (free with pipeline_schedule_free). Returns -1 on an invalid cfg.
static inline int pipeline_schedule_build(PipelineSchedule* sch, const PipelineConfig* cfg, char* err, size_t errlen) {
    sch->offset = NULL;
    sch->actions = NULL;
    if (pipeline_check_config(cfg, err, errlen) != 0) { return -1; }
    int S = cfg->num_stages, per_stage = pipeline_max_actions(cfg);
    PPReference ref;
    pp_reference_build(&ref, cfg);
    PPEvent* events = (PPEvent*)malloc_or_die((size_t)per_stage * sizeof(PPEvent), "pipeline events");
    sch->cfg = *cfg;
    sch->offset = (int*)malloc_or_die((size_t)(S + 1) * sizeof(int), "pipeline schedule");
    sch->actions = (PipelineAction*)malloc_or_die((size_t)S * per_stage * sizeof(PipelineAction), "pipeline schedule");
    sch->offset[0] = 0;
    for (int s = 0; s < S; s++) {
        int n = pp_emit_stage(cfg, &ref, s, events, sch->actions + sch->offset[s], per_stage);
        sch->offset[s + 1] = sch->offset[s] + n;
    }
    pp_reference_free(&ref);
    free(events);
    return 0;
}

static inline void pipeline_schedule_free(PipelineSchedule* sch) {
    free(sch->offset);
    free(sch->actions);
    sch->offset = NULL;
    sch->actions = NULL;
}

// ----------------------------------------------------------------------------------------------
// activations held, bubble model

// Most (microbatch, chunk) activations a stage holds at once, maximised over the list: each is
// held from its FORWARD until its BACKWARD, or until its BACKWARD_WEIGHT when the backward is
// split (the weight gradient reads the layer inputs too). With several chunks a pair holds one
// chunk's activations (1/v of the stage's layers).
static inline int pipeline_max_in_flight(const PipelineAction* actions, int n) {
    int held = 0, most = 0;
    for (int i = 0; i < n; i++) {
        if (actions[i].kind == PP_FORWARD) { held++; }
        if (actions[i].kind == PP_BACKWARD || actions[i].kind == PP_BACKWARD_WEIGHT) { held--; }
        if (held > most) { most = held; }
    }
    return most;
}

// The textbook bound on pipeline_max_in_flight of stage s, in (microbatch, chunk) pairs:
//   gpipe        M: every forward before the first backward
//   1f1b         min(S-s, M): the S-s-1 warmup forwards and the one of the steady pair
//   interleaved  min(2*(S-s-1) + (v-1)*S + 1, v*M): Megatron-LM's warmup and one more
//   zb1          min(S, M) on every stage: 1f1b's stage 0 (ZB-H1 keeps 1F1B's peak memory;
//                stage s defers its W's by s microbatches)
//   zbv          min(2S, 2M) on every rank: S microbatches of a 1f1b stage's layers, as each
//                chunk has half of them (ZB-V's peak memory p*M_B in the paper)
static inline int pipeline_memory_bound(const PipelineConfig* cfg, int stage) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    int bound = 0;
    switch (cfg->kind) {
        case PP_GPIPE: bound = M; break;
        case PP_1F1B: bound = S - stage; break;
        case PP_INTERLEAVED: bound = 2 * (S - stage - 1) + (v - 1) * S + 1; break;
        case PP_ZB1: bound = S; break;
        case PP_ZBV: bound = 2 * S; break;
    }
    return bound < v * M ? bound : v * M;
}

// Modelled fraction of the step's time a stage sits idle (idle / total), for per-microbatch
// costs that are the same on every stage and free transfers.
//   gpipe, 1f1b  the fill and the drain cost S-1 forward+backward slots on each stage, out of
//                M + S - 1 slots in all: (S-1)/(M+S-1), whatever the forward:backward ratio.
//   interleaved  each fill/drain slot is one chunk, 1/v of a stage's work per microbatch:
//                (S-1)/(v*M + S - 1). (The Megatron-LM paper divides by the ideal time instead
//                of the total: (S-1)/M and (S-1)/(v*M).)
//   zb1, zbv     with F = I = W (the zero-bubble paper's T_F = T_B = T_W), 1 unit each, a
//                stage computes for 3vM units in a step of T units: (T - 3vM) / T.
//     zb1: T = max(3M + S - 1, 2M + 2S - 1). The last stage cannot start before microbatch 0
//          crossed S-1 stages, then has 3M units of work; ZB-H1 reaches that when M >= S, every
//          stage idling S-1 units (the paper's bubble (p-1)(T_F + T_B - T_W)). With M < S the
//          last stage defers all its W's and alternates F and I, so its last I ends at S-1+2M;
//          that gradient crosses S-1 stages back, then stage 0 runs its last W.
//     zbv: T = max(6M + S - 1, 4M + 4S - 2). Rank s can start at s (microbatch 0 crosses s
//          ranks); from M >= 2S-1 on, every rank then computes without a gap (the paper's zero
//          bubble) and ends at 6M + s. With M < (3S-1)/2 the gradients' path is longer:
//          microbatch 0's reaches rank S-1 (the tip of the V) at 3S-1, from there rank S-1 runs
//          I and W of both its chunks, 4 units per microbatch, and the last gradient then
//          crosses S-1 ranks back before rank 0 runs the last W.
static inline double pipeline_bubble_fraction(const PipelineConfig* cfg) {
    double S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    double T;
    switch (cfg->kind) {
        case PP_ZB1: T = fmax(3.0 * M + S - 1.0, 2.0 * M + 2.0 * S - 1.0); break;
        case PP_ZBV: T = fmax(6.0 * M + S - 1.0, 4.0 * M + 4.0 * S - 2.0); break;
        default: return (S - 1.0) / (v * M + S - 1.0);
    }
    return (T - 3.0 * v * M) / T;
}

// ----------------------------------------------------------------------------------------------
// layer partition and placement

// Cost of stage s of a partition: its transformer layers (1 unit each), plus the embedding on
// the first stage and the final layernorm + LM head + loss on the last stage.
static inline double pipeline_stage_cost(const int* first_layer, int num_stages, int stage,
                                         double embed_cost, double head_cost) {
    double cost = first_layer[stage + 1] - first_layer[stage];
    if (stage == 0) { cost += embed_cost; }
    if (stage == num_stages - 1) { cost += head_cost; }
    return cost;
}

// Splits L transformer layers into S contiguous ranges, stage s getting layers
// [first_layer[s], first_layer[s+1]) (first_layer has S+1 entries). Cost model: a layer costs
// 1 unit, the embedding embed_cost on stage 0 and the head head_cost on stage S-1 (e.g. a
// trainer passes (Vp*C)/(12*C*C) layer-equivalents for the head matmul).
// Method: every stage starts with one layer (none if L < S), then each remaining layer goes to
// the currently cheapest stage. That minimises the most expensive stage (which sets the
// pipeline's pace), and max - min <= the largest single item (a layer, the embedding or the
// head): a stage that received a layer was the cheapest when it did, and one that did not costs
// at most its own fixed item plus one layer. Ties go to the later stage, because under 1f1b an
// earlier stage holds more microbatches of activations. Deterministic. For schedules with
// several chunks per rank, partition into the S*v virtual stages (pipeline_place_layers).
static inline int pipeline_partition_layers(int num_layers, int num_stages, double embed_cost, double head_cost,
                                            int* first_layer, char* err, size_t errlen) {
    if (num_layers < 1) { return pp_error(err, errlen, "pipeline partition: the number of layers must be at least 1, got %d", num_layers); }
    if (num_stages < 1) { return pp_error(err, errlen, "pipeline partition: the number of stages must be at least 1, got %d", num_stages); }
    if (!(embed_cost >= 0.0) || !isfinite(embed_cost)) {
        return pp_error(err, errlen, "pipeline partition: the embedding cost must be finite and >= 0, got %g", embed_cost);
    }
    if (!(head_cost >= 0.0) || !isfinite(head_cost)) {
        return pp_error(err, errlen, "pipeline partition: the head cost must be finite and >= 0, got %g", head_cost);
    }
    int S = num_stages;
    int* layers = (int*)malloc_or_die((size_t)S * sizeof(int), "pipeline partition");
    int base = num_layers >= S ? 1 : 0;
    for (int s = 0; s < S; s++) { layers[s] = base; }
    for (int left = num_layers - base * S; left > 0; left--) {
        // the cheapest stage; scanning from the last, a tie keeps the later one
        int best = S - 1;
        double best_cost = layers[S - 1] + head_cost + (S == 1 ? embed_cost : 0.0);
        for (int s = S - 2; s >= 0; s--) {
            double cost = layers[s] + (s == 0 ? embed_cost : 0.0);
            if (cost < best_cost) { best = s; best_cost = cost; }
        }
        layers[best]++;
    }
    first_layer[0] = 0;
    for (int s = 0; s < S; s++) { first_layer[s + 1] = first_layer[s] + layers[s]; }
    free(layers);
    return 0;
}

// What one model chunk of one rank holds.
typedef struct {
    int virtual_stage;  // its position in the model, 0 .. S*v-1
    int first_layer;    // transformer layers first_layer .. first_layer + num_layers - 1
    int num_layers;     // 0 when there are fewer layers than virtual stages
    int has_embedding;  // virtual stage 0: token and position embeddings
    int has_head;       // the last virtual stage: final layernorm, LM head and loss
} PipelineChunkLayers;

// The layers of every (stage, chunk) of the schedule, into out[stage * v + chunk] (S*v
// entries): L layers balanced over the S*v virtual stages in model order by
// pipeline_partition_layers (same cost model), virtual stage pipeline_virtual_stage(cfg, stage,
// chunk) going to that chunk. Under zbv rank 0 thus holds both the embedding and the head.
static inline int pipeline_place_layers(const PipelineConfig* cfg, int num_layers, double embed_cost, double head_cost,
                                        PipelineChunkLayers* out, char* err, size_t errlen) {
    if (pipeline_check_config(cfg, err, errlen) != 0) { return -1; }
    int S = cfg->num_stages, v = cfg->num_chunks, V = S * v;
    int* first = (int*)malloc_or_die((size_t)(V + 1) * sizeof(int), "pipeline placement");
    if (pipeline_partition_layers(num_layers, V, embed_cost, head_cost, first, err, errlen) != 0) {
        free(first);
        return -1;
    }
    for (int s = 0; s < S; s++) {
        for (int c = 0; c < v; c++) {
            PipelineChunkLayers* p = &out[s * v + c];
            int vs = pipeline_virtual_stage(cfg, s, c);
            p->virtual_stage = vs;
            p->first_layer = first[vs];
            p->num_layers = first[vs + 1] - first[vs];
            p->has_embedding = vs == 0;
            p->has_head = vs == V - 1;
        }
    }
    free(first);
    return 0;
}

// ----------------------------------------------------------------------------------------------
// timeline simulator

typedef enum {
    PP_COMM_RENDEZVOUS = 0,  // each send/receive in list order; a send completes only when the
                             // receiver has posted the matching receive (the strictest)
    PP_COMM_BATCHED,         // like rendezvous, but a post_with_next run is posted at once and
                             // completes when all its messages have (batch_isend_irecv)
    PP_COMM_EAGER,           // sends are buffered and never wait; receives wait for the send
} PipelineCommModel;

static inline const char* pipeline_comm_model_name(PipelineCommModel comm) {
    switch (comm) {
        case PP_COMM_RENDEZVOUS: return "rendezvous";
        case PP_COMM_BATCHED: return "batched";
        case PP_COMM_EAGER: return "eager";
    }
    return "unknown";
}

typedef struct {
    const double* forward;   // [S]: time of one FORWARD (one microbatch, one chunk) on each stage
    const double* backward;  // [S]: time of one BACKWARD (input and weight gradients)
    double transfer;         // a message arrives this long after both ends are ready (eager: after the send)
    PipelineCommModel comm;
    const double* weight;    // [S]: time of one BACKWARD_WEIGHT, 0 .. backward; a BACKWARD_INPUT
                             // takes backward - weight. NULL: half the backward each (the
                             // zero-bubble paper's T_B = T_W)
} PipelineCosts;

typedef struct {
    int num_stages;
    double makespan;  // when the last stage finishes
    double* start;    // [offset[S]], parallel to the schedule's actions: when each computation
    double* end;      // started and ended; for a send/receive when it was posted and completed
    double* busy;     // [S]: time each stage spends computing
    double* idle;     // [S]: makespan - busy, the stage's bubble
} PipelineTimeline;

static inline void pipeline_timeline_free(PipelineTimeline* tl) {
    free(tl->start);
    free(tl->end);
    free(tl->busy);
    free(tl->idle);
    tl->start = tl->end = tl->busy = tl->idle = NULL;
}

// Simulated bubble: idle time summed over stages / (S * makespan).
static inline double pipeline_timeline_bubble(const PipelineTimeline* tl) {
    double idle = 0.0;
    for (int s = 0; s < tl->num_stages; s++) { idle += tl->idle[s]; }
    return tl->makespan > 0.0 ? idle / (tl->num_stages * tl->makespan) : 0.0;
}

// Time of one computation of `kind` on stage s.
static inline double pp_compute_cost(const PipelineCosts* costs, int s, PipelineActionKind kind) {
    double weight = costs->weight != NULL ? costs->weight[s] : 0.5 * costs->backward[s];
    switch (kind) {
        case PP_FORWARD: return costs->forward[s];
        case PP_BACKWARD_INPUT: return costs->backward[s] - weight;
        case PP_BACKWARD_WEIGHT: return weight;
        default: return costs->backward[s];
    }
}

// Writes "stage 2 action 5 (SEND_FORWARD of microbatch 3 chunk 0 to stage 3)".
static inline void pp_describe(const PipelineSchedule* sch, int stage, int index, char* buf, size_t len) {
    const PipelineAction* a = &sch->actions[sch->offset[stage] + index];
    if (pipeline_is_compute(a->kind)) {
        snprintf(buf, len, "stage %d action %d (%s of microbatch %d chunk %d)", stage, index,
                 pipeline_action_kind_name(a->kind), a->microbatch, a->chunk);
    } else {
        int sends = a->kind == PP_SEND_FORWARD || a->kind == PP_SEND_BACKWARD;
        snprintf(buf, len, "stage %d action %d (%s of microbatch %d chunk %d %s stage %d)", stage, index,
                 pipeline_action_kind_name(a->kind), a->microbatch, a->chunk, sends ? "to" : "from", a->peer);
    }
}

// Checks one action in isolation: fields in range, sends/receives only where a neighbour
// exists on another stage, peer = the stage holding the neighbouring virtual stage,
// post_with_next only between two sends/receives.
static inline int pp_check_action(const PipelineSchedule* sch, int stage, int index, char* err, size_t errlen) {
    const PipelineConfig* cfg = &sch->cfg;
    int S = cfg->num_stages, V = S * cfg->num_chunks;
    const PipelineAction* a = &sch->actions[sch->offset[stage] + index];
    int count = sch->offset[stage + 1] - sch->offset[stage];
    if ((int)a->kind < (int)PP_RECV_FORWARD || (int)a->kind > (int)PP_BACKWARD_WEIGHT) {
        return pp_error(err, errlen, "pipeline: stage %d action %d has unknown kind %d", stage, index, (int)a->kind);
    }
    if (a->microbatch < 0 || a->microbatch >= cfg->num_microbatches || a->chunk < 0 || a->chunk >= cfg->num_chunks) {
        return pp_error(err, errlen, "pipeline: stage %d action %d (%s) has microbatch %d chunk %d, "
                        "expected 0..%d and 0..%d", stage, index, pipeline_action_kind_name(a->kind),
                        a->microbatch, a->chunk, cfg->num_microbatches - 1, cfg->num_chunks - 1);
    }
    char what[160];
    pp_describe(sch, stage, index, what, sizeof(what));
    int vs = pipeline_virtual_stage(cfg, stage, a->chunk);
    int to_prev = a->kind == PP_RECV_FORWARD || a->kind == PP_SEND_BACKWARD;
    int to_next = a->kind == PP_SEND_FORWARD || a->kind == PP_RECV_BACKWARD;
    if ((to_prev && vs == 0) || (to_next && vs == V - 1)) {
        return pp_error(err, errlen, "pipeline: %s: the %s virtual stage has no neighbour on that side",
                        what, to_prev ? "first" : "last");
    }
    int want_peer = to_prev || to_next ? pipeline_neighbour_stage(cfg, stage, a->chunk, to_prev ? -1 : +1) : -1;
    if (want_peer == stage) {
        return pp_error(err, errlen, "pipeline: %s: virtual stages %d and %d are both on stage %d, a local hand-off "
                        "that takes no message", what, to_prev ? vs - 1 : vs, to_prev ? vs : vs + 1, stage);
    }
    if (a->peer != want_peer) {
        return pp_error(err, errlen, "pipeline: %s: the peer must be %d", what, want_peer);
    }
    if (a->post_with_next &&
        (pipeline_is_compute(a->kind) || index + 1 >= count || pipeline_is_compute(a[1].kind))) {
        return pp_error(err, errlen, "pipeline: %s: post_with_next is set but this action and the next "
                        "are not both sends/receives", what);
    }
    return 0;
}

// Simulator state: what each stage has done and received, and the messages in flight.
typedef struct {
    const PipelineSchedule* sch;
    const PipelineCosts* costs;
    PipelineTimeline* tl;
    int M, V;
    size_t units;       // V*M (virtual stage, microbatch) pairs
    char* fwd_done;     // [units] FORWARD ran
    char* bwd_done;     // [units] the input gradient is computed (BACKWARD or BACKWARD_INPUT ran)
    char* wgt_done;     // [units] the weight gradient is computed (BACKWARD or BACKWARD_WEIGHT ran)
    char* fwd_in;       // [units] input activation received
    char* bwd_in;       // [units] output gradient received
    char* sent;         // [2*units] per message (direction, sending virtual stage, microbatch)
    char* received;     // [2*units]
    double* sent_at;    // [2*units] when an eager send was posted
    char* done;         // [offset[S]] per action
    int* pc;            // [S] next action of each stage
    double* clock;      // [S] when the stage is free (or posted its current sends/receives)
} PPSim;

// Last action of the run that stage s has posted at its current position.
static inline int pp_sim_posted_until(const PPSim* sim, int s) {
    const PipelineAction* a = sim->sch->actions + sim->sch->offset[s];
    int last = sim->pc[s];
    if (sim->costs->comm == PP_COMM_BATCHED) {
        while (a[last].post_with_next) { last++; }
    }
    return last;
}

static inline int pp_sim_compute(PPSim* sim, int s, char* err, size_t errlen) {
    const PipelineConfig* cfg = &sim->sch->cfg;
    int i = sim->sch->offset[s] + sim->pc[s];
    const PipelineAction* a = &sim->sch->actions[i];
    int vs = pipeline_virtual_stage(cfg, s, a->chunk);
    int prev = pipeline_neighbour_stage(cfg, s, a->chunk, -1), next = pipeline_neighbour_stage(cfg, s, a->chunk, +1);
    size_t u = (size_t)vs * sim->M + a->microbatch;
    char what[160];
    pp_describe(sim->sch, s, sim->pc[s], what, sizeof(what));
    if (a->kind == PP_FORWARD) {
        if (sim->fwd_done[u]) { return pp_error(err, errlen, "pipeline: %s runs a second time", what); }
        if (prev == s && !sim->fwd_done[u - sim->M]) {
            return pp_error(err, errlen, "pipeline: %s runs before the FORWARD of virtual stage %d on the same stage, "
                            "whose output is its input", what, vs - 1);
        }
        if (prev >= 0 && prev != s && !sim->fwd_in[u]) {
            return pp_error(err, errlen, "pipeline: %s runs before its input activation was received", what);
        }
        sim->fwd_done[u] = 1;
    } else if (a->kind == PP_BACKWARD_WEIGHT) {
        if (sim->wgt_done[u]) { return pp_error(err, errlen, "pipeline: %s runs a second time", what); }
        if (!sim->bwd_done[u]) { return pp_error(err, errlen, "pipeline: %s runs before its BACKWARD_INPUT", what); }
        sim->wgt_done[u] = 1;
    } else {
        if (sim->bwd_done[u]) { return pp_error(err, errlen, "pipeline: %s runs a second time", what); }
        if (!sim->fwd_done[u]) { return pp_error(err, errlen, "pipeline: %s runs before its forward", what); }
        if (next == s && !sim->bwd_done[u + sim->M]) {
            return pp_error(err, errlen, "pipeline: %s runs before the backward of virtual stage %d on the same stage, "
                            "whose input gradient is its output gradient", what, vs + 1);
        }
        if (next >= 0 && next != s && !sim->bwd_in[u]) {
            return pp_error(err, errlen, "pipeline: %s runs before its output gradient was received", what);
        }
        sim->bwd_done[u] = 1;
        if (a->kind == PP_BACKWARD) { sim->wgt_done[u] = 1; }
    }
    double cost = pp_compute_cost(sim->costs, s, a->kind);
    sim->tl->start[i] = sim->clock[s];
    sim->clock[s] += cost;
    sim->tl->end[i] = sim->clock[s];
    sim->tl->busy[s] += cost;
    sim->done[i] = 1;
    sim->pc[s]++;
    return 1;
}

// Tries to complete the posted send/receive index of stage s. A rendezvous send completes
// together with the matching receive if the receiver has posted it; a rendezvous receive waits
// for its sender to find it. Returns 1 if something completed, 0 if not, -1 on an invalid schedule.
static inline int pp_sim_message(PPSim* sim, int s, int index, char* err, size_t errlen) {
    const PipelineSchedule* sch = sim->sch;
    int i = sch->offset[s] + index;
    const PipelineAction* a = &sch->actions[i];
    int vs = pipeline_virtual_stage(&sch->cfg, s, a->chunk);
    int is_send = a->kind == PP_SEND_FORWARD || a->kind == PP_SEND_BACKWARD;
    int dir = a->kind == PP_SEND_BACKWARD || a->kind == PP_RECV_BACKWARD;  // 0 forward, 1 backward
    int sender_vs = is_send ? vs : (dir == 0 ? vs - 1 : vs + 1);
    size_t msg = (size_t)dir * sim->units + (size_t)sender_vs * sim->M + a->microbatch;
    size_t u = (size_t)vs * sim->M + a->microbatch;
    char what[160];
    pp_describe(sch, s, index, what, sizeof(what));
    if (!is_send) {
        if (sim->costs->comm != PP_COMM_EAGER) { return 0; }
        if (sim->received[msg]) { return pp_error(err, errlen, "pipeline: %s receives a message a second time", what); }
        if (!sim->sent[msg]) { return 0; }
        double arrival = sim->sent_at[msg] + sim->costs->transfer;
        sim->tl->start[i] = sim->clock[s];
        sim->tl->end[i] = sim->clock[s] > arrival ? sim->clock[s] : arrival;
        sim->received[msg] = 1;
        (dir == 0 ? sim->fwd_in : sim->bwd_in)[u] = 1;
        sim->done[i] = 1;
        return 1;
    }
    if (!(dir == 0 ? sim->fwd_done : sim->bwd_done)[u]) {
        return pp_error(err, errlen, "pipeline: %s comes before the %s that produces it", what,
                        dir == 0 ? "FORWARD" : "BACKWARD (or BACKWARD_INPUT)");
    }
    if (sim->sent[msg]) { return pp_error(err, errlen, "pipeline: %s sends a message a second time", what); }
    if (sim->costs->comm == PP_COMM_EAGER) {
        sim->sent[msg] = 1;
        sim->sent_at[msg] = sim->clock[s];
        sim->tl->start[i] = sim->tl->end[i] = sim->clock[s];
        sim->done[i] = 1;
        return 1;
    }
    int p = a->peer, pbase = sch->offset[p];
    if (sim->pc[p] >= sch->offset[p + 1] - pbase || pipeline_is_compute(sch->actions[pbase + sim->pc[p]].kind)) {
        return 0;  // the receiver has not posted anything
    }
    int plast = pp_sim_posted_until(sim, p);
    for (int k = sim->pc[p]; k <= plast; k++) {
        const PipelineAction* r = &sch->actions[pbase + k];
        int rvs = pipeline_virtual_stage(&sch->cfg, p, r->chunk);
        int match = !sim->done[pbase + k] && r->microbatch == a->microbatch &&
                    ((dir == 0 && r->kind == PP_RECV_FORWARD && rvs - 1 == sender_vs) ||
                     (dir == 1 && r->kind == PP_RECV_BACKWARD && rvs + 1 == sender_vs));
        if (!match) { continue; }
        double t = (sim->clock[s] > sim->clock[p] ? sim->clock[s] : sim->clock[p]) + sim->costs->transfer;
        sim->tl->start[i] = sim->clock[s];
        sim->tl->start[pbase + k] = sim->clock[p];
        sim->tl->end[i] = sim->tl->end[pbase + k] = t;
        sim->done[i] = sim->done[pbase + k] = 1;
        sim->sent[msg] = sim->received[msg] = 1;
        (dir == 0 ? sim->fwd_in : sim->bwd_in)[(size_t)rvs * sim->M + r->microbatch] = 1;
        return 1;
    }
    return 0;
}

// One move of stage s: run its next computation, or try to complete the sends/receives it has
// posted; the stage moves on once all of them completed, at the latest completion time.
// Returns 1 if anything completed, 0 if the stage waits or is finished, -1 on an invalid schedule.
static inline int pp_sim_step(PPSim* sim, int s, char* err, size_t errlen) {
    int base = sim->sch->offset[s];
    if (sim->pc[s] >= sim->sch->offset[s + 1] - base) { return 0; }
    if (pipeline_is_compute(sim->sch->actions[base + sim->pc[s]].kind)) { return pp_sim_compute(sim, s, err, errlen); }
    int last = pp_sim_posted_until(sim, s);
    int moved = 0;
    for (int i = sim->pc[s]; i <= last; i++) {
        if (sim->done[base + i]) { continue; }
        int r = pp_sim_message(sim, s, i, err, errlen);
        if (r < 0) { return -1; }
        moved |= r;
    }
    double t = sim->clock[s];
    for (int i = sim->pc[s]; i <= last; i++) {
        if (!sim->done[base + i]) { return moved; }
        if (sim->tl->end[base + i] > t) { t = sim->tl->end[base + i]; }
    }
    sim->clock[s] = t;
    sim->pc[s] = last + 1;
    return 1;
}

// Runs every stage's list in order and fills tl (free with pipeline_timeline_free).
// Computations take the stage's forward/backward/weight time. A message is identified by
// (direction, microbatch, sending virtual stage). Besides timing, checks that the lists are a
// valid schedule: a FORWARD only after its input was received (or computed earlier on the same
// stage, or on virtual stage 0), a BACKWARD or BACKWARD_INPUT only after its FORWARD and its
// output gradient (likewise), a BACKWARD_WEIGHT only after its BACKWARD_INPUT, a SEND only after
// the computation producing it, of every (microbatch, chunk) one FORWARD and either one BACKWARD
// or one BACKWARD_INPUT and one BACKWARD_WEIGHT, every message received exactly once. Returns -1
// with a message on an invalid schedule or a deadlock (no stage can move), naming the blocked
// actions.
static inline int pipeline_simulate(const PipelineSchedule* sch, const PipelineCosts* costs, PipelineTimeline* tl,
                                    char* err, size_t errlen) {
    const PipelineConfig* cfg = &sch->cfg;
    tl->start = tl->end = tl->busy = tl->idle = NULL;
    if (pipeline_check_config(cfg, err, errlen) != 0) { return -1; }
    int S = cfg->num_stages;
    for (int s = 0; s < S; s++) {
        if (!(costs->forward[s] >= 0.0) || !isfinite(costs->forward[s]) ||
            !(costs->backward[s] >= 0.0) || !isfinite(costs->backward[s])) {
            return pp_error(err, errlen, "pipeline simulation: stage %d costs must be finite and >= 0, "
                            "got forward %g backward %g", s, costs->forward[s], costs->backward[s]);
        }
        if (costs->weight != NULL && !(costs->weight[s] >= 0.0 && costs->weight[s] <= costs->backward[s])) {
            return pp_error(err, errlen, "pipeline simulation: stage %d: the weight-gradient time must be within "
                            "0 .. the backward time %g, got %g", s, costs->backward[s], costs->weight[s]);
        }
    }
    if (!(costs->transfer >= 0.0) || !isfinite(costs->transfer)) {
        return pp_error(err, errlen, "pipeline simulation: the transfer time must be finite and >= 0, got %g",
                        costs->transfer);
    }
    if ((int)costs->comm < (int)PP_COMM_RENDEZVOUS || (int)costs->comm > (int)PP_COMM_EAGER) {
        return pp_error(err, errlen, "pipeline simulation: unknown communication model %d", (int)costs->comm);
    }
    for (int s = 0; s < S; s++) {
        if (sch->offset[s + 1] < sch->offset[s]) {
            return pp_error(err, errlen, "pipeline simulation: stage %d has a negative number of actions", s);
        }
        for (int i = 0; i < sch->offset[s + 1] - sch->offset[s]; i++) {
            if (pp_check_action(sch, s, i, err, errlen) != 0) { return -1; }
        }
    }

    PPSim sim;
    sim.sch = sch;
    sim.costs = costs;
    sim.tl = tl;
    sim.M = cfg->num_microbatches;
    sim.V = S * cfg->num_chunks;
    sim.units = (size_t)sim.V * sim.M;
    size_t total = (size_t)sch->offset[S];
    sim.fwd_done = (char*)calloc_or_die(sim.units, 1, "pipeline simulation");
    sim.bwd_done = (char*)calloc_or_die(sim.units, 1, "pipeline simulation");
    sim.wgt_done = (char*)calloc_or_die(sim.units, 1, "pipeline simulation");
    sim.fwd_in = (char*)calloc_or_die(sim.units, 1, "pipeline simulation");
    sim.bwd_in = (char*)calloc_or_die(sim.units, 1, "pipeline simulation");
    sim.sent = (char*)calloc_or_die(2 * sim.units, 1, "pipeline simulation");
    sim.received = (char*)calloc_or_die(2 * sim.units, 1, "pipeline simulation");
    sim.sent_at = (double*)calloc_or_die(2 * sim.units, sizeof(double), "pipeline simulation");
    sim.done = (char*)calloc_or_die(total, 1, "pipeline simulation");
    sim.pc = (int*)calloc_or_die((size_t)S, sizeof(int), "pipeline simulation");
    sim.clock = (double*)calloc_or_die((size_t)S, sizeof(double), "pipeline simulation");
    tl->num_stages = S;
    tl->makespan = 0.0;
    tl->start = (double*)calloc_or_die(total, sizeof(double), "pipeline timeline");
    tl->end = (double*)calloc_or_die(total, sizeof(double), "pipeline timeline");
    tl->busy = (double*)calloc_or_die((size_t)S, sizeof(double), "pipeline timeline");
    tl->idle = (double*)calloc_or_die((size_t)S, sizeof(double), "pipeline timeline");

    int status = 0;
    for (;;) {
        int progress = 0, finished = 0;
        for (int s = 0; s < S && status == 0; s++) {
            int r;
            while ((r = pp_sim_step(&sim, s, err, errlen)) == 1) { progress = 1; }
            if (r < 0) { status = -1; }
            finished += sim.pc[s] == sch->offset[s + 1] - sch->offset[s];
        }
        if (status != 0 || finished == S) { break; }
        if (!progress) {
            // nobody can move: name every stage and the action it waits at
            char msg[1024], what[160];
            size_t len = (size_t)snprintf(msg, sizeof(msg), "pipeline: deadlock with %s sends:",
                                          pipeline_comm_model_name(costs->comm));
            for (int s = 0; s < S && len < sizeof(msg); s++) {
                if (sim.pc[s] == sch->offset[s + 1] - sch->offset[s]) { continue; }
                pp_describe(sch, s, sim.pc[s], what, sizeof(what));
                len += (size_t)snprintf(msg + len, sizeof(msg) - len, " %s waits;", what);
            }
            status = pp_error(err, errlen, "%s", msg);
            break;
        }
    }
    // every computation ran (a second run was caught above) and every message was received
    for (size_t u = 0; u < sim.units && status == 0; u++) {
        if (!sim.fwd_done[u] || !sim.bwd_done[u] || !sim.wgt_done[u]) {
            int stage, chunk;
            pipeline_virtual_stage_owner(cfg, (int)(u / sim.M), &stage, &chunk);
            // a BACKWARD sets both, so an input gradient without a weight gradient was split
            const char* missing = !sim.fwd_done[u] ? "FORWARD" : (!sim.bwd_done[u] ? "BACKWARD" : "BACKWARD_WEIGHT");
            status = pp_error(err, errlen, "pipeline: stage %d never runs the %s of microbatch %d chunk %d",
                              stage, missing, (int)(u % sim.M), chunk);
        }
    }
    for (size_t m = 0; m < 2 * sim.units && status == 0; m++) {
        if (sim.sent[m] && !sim.received[m]) {
            int stage, chunk;
            pipeline_virtual_stage_owner(cfg, (int)((m % sim.units) / sim.M), &stage, &chunk);
            status = pp_error(err, errlen, "pipeline: the %s message of microbatch %d from stage %d chunk %d "
                              "is never received", m < sim.units ? "forward" : "backward", (int)(m % sim.M),
                              stage, chunk);
        }
    }
    for (int s = 0; s < S; s++) {
        if (sim.clock[s] > tl->makespan) { tl->makespan = sim.clock[s]; }
    }
    for (int s = 0; s < S; s++) { tl->idle[s] = tl->makespan - tl->busy[s]; }
    free(sim.fwd_done);
    free(sim.bwd_done);
    free(sim.wgt_done);
    free(sim.fwd_in);
    free(sim.bwd_in);
    free(sim.sent);
    free(sim.received);
    free(sim.sent_at);
    free(sim.done);
    free(sim.pc);
    free(sim.clock);
    if (status != 0) { pipeline_timeline_free(tl); }
    return status;
}

#endif // LLMC_PIPELINE_H
