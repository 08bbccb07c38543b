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
 * stage, so that the trainer only executes a list (a switch over nine kinds: the executor,
 * llmc/pipeline_executor.h), the tests check every schedule exhaustively, and
 * dev/tools/pp_schedule draws it (both through the simulator beside it, dev/tools/pp_sim.h).
 * Nothing here talks to MPI.
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
 *   dualpipev    DeepSeek's DualPipe cut in half (deepseek-ai/DualPipe's DualPipeV): zbv's V
 *                placement, and the overlapped pair F&B (FORWARD_BACKWARD: the forward of one
 *                chunk and the whole backward of the other in one action, so that one's
 *                computation hides the other's messages). Rank r of P = S, N = M >= 2S
 *                microbatches, DeepSeek's eight phases (pp_order_dualpipev): F0 x 2(P-r-1);
 *                (F0, F1) x (r+1); (I1, W1, F1) x (P-r-1); (F0&B1, F1&B0) x (N-2P+r+1), the
 *                last rank's first pair not overlapped; (B1, F1&B0) x (P-r-1); (B1, B0) x (r+1),
 *                the last r+1 of them split; (W, I0) x (P-r-1); W x (r+1). A rank holds up to
 *                2S+1 (microbatch, chunk) pairs (DeepSeek's PP+1 with PP = 2S).
 *                S=2, M=4, rank 1: F0c0 F0c1 F1c0 F1c1 B0c1 F2c0 F2c1&B0c0 F3c0&B1c1 F3c1&B1c0
 *                B2c1 B2c0 I3c1 I3c0 W3c1 W3c0.
 *   dualpipe     DeepSeek's DualPipe: the model's S stages each on two ranks. Microbatches
 *                [0, M/2) enter at rank 0 (model stage k on rank k), [M/2, M) at rank S-1
 *                (model stage k on rank S-1-k); rank s and its mirror S-1-s hold model stages
 *                h = min(s, S-1-s) (chunk 0) and S-1-h (chunk 1), each chunk on one half of the
 *                microbatches (pipeline_chunk_microbatches), and both run rank h's dualpipev
 *                phases for S/2 ranks and M/2 microbatches. Needs S even, M even and >= 2S.
 *                A rank holds up to S+1 (microbatch, chunk) pairs (DeepSeek's PP+1); the two
 *                copies of a stage sum their halves' gradients (zero.h zero_set_mirror).
 *
 * Layer placement (pipeline_place_layers). The layers are balanced over the S*v virtual stages
 * (pipeline_partition_layers) in model order, and chunk c of rank s holds the layers of
 * pipeline_virtual_stage(cfg, s, c): s for one chunk, c*S + s for interleaved (Megatron's
 * round-robin), s or 2S-1-s for zbv and dualpipev. Virtual stage 0 also holds the embedding, the last one the
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
 * BACKWARD_INPUT = BACKWARD_WEIGHT = 1 (the zero-bubble paper's T_F = T_B = T_W), an F&B
 * F + B = 3 (both its halves' outputs ready when it ends); instant
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
 * Executing a stage's list (llmc/pipeline_executor.h), for (m, c) = (a.microbatch, a.chunk):
 *   RECV_FORWARD     receive the input activation of (m, c) from a.peer
 *   FORWARD          run chunk c forward on microbatch m; its input comes from the data loader
 *                    (virtual stage 0), a RECV_FORWARD, or the local hand-off above
 *   SEND_FORWARD     send its output activation to a.peer
 *   RECV_BACKWARD    receive the gradient of that output from a.peer
 *   BACKWARD         gradients of (m, c)'s input and weights; frees its activations
 *   BACKWARD_INPUT   the gradient of (m, c)'s input only; keeps the activations (W reads them)
 *   BACKWARD_WEIGHT  the weight gradient of (m, c), after its BACKWARD_INPUT; frees them
 *   FORWARD_BACKWARD FORWARD of (m, c) and BACKWARD of (a.backward_microbatch, a.backward_chunk)
 *                    together; the receives of both halves come before it, the sends after
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
 *   pipeline_parse_schedule("1f1b", &kind, err, errlen)  names: gpipe, 1f1b, interleaved, zb1, zbv,
 *                                                        dualpipev, dualpipe
 *   pipeline_splits_backward(kind)                       1: I and W instead of B (zb1, zbv; some
 *                                                        backwards under dualpipev)
 *   pipeline_is_compute(kind), pipeline_action_halves(action, halves)
 *                                                        computations; an F&B's F and B
 *   pipeline_virtual_stage(cfg, stage, chunk), pipeline_virtual_stage_owner(cfg, vs, &stage, &chunk),
 *   pipeline_num_virtual_stages(cfg), pipeline_unit_owner(cfg, vs, microbatch, &stage, &chunk),
 *   pipeline_chunk_microbatches(cfg, stage, chunk, &first, &count)   (dualpipe's two copies)
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
 *   pipeline_bubble_fraction(cfg)                        the modelled bubble
 *   pipeline_partition_layers(L, parts, embed, head, first_layer, err, errlen)
 *   pipeline_place_layers(cfg, L, embed, head, out, err, errlen)
 *                                                        the layers of each (rank, chunk), as
 *                                                        ChunkPlace
 * dev/tools/pp_sim.h simulates any lists with given compute costs (for the tests and the tool).
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
    PP_DUALPIPEV = 5,
    PP_DUALPIPE = 6,
} PipelineScheduleKind;

typedef struct {
    int num_stages;             // S: pipeline ranks
    int num_microbatches;       // M: microbatches per optimizer step
    PipelineScheduleKind kind;
    int num_chunks;             // v: model chunks per rank; 1 for gpipe, 1f1b and zb1, >= 2
                                // interleaved, 2 zbv and dualpipev
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
        case PP_DUALPIPEV: return "dualpipev";
        case PP_DUALPIPE: return "dualpipe";
    }
    return "unknown";
}

static inline int pipeline_parse_schedule(const char* name, PipelineScheduleKind* kind,
                                          char* err, size_t errlen) {
    static const PipelineScheduleKind kinds[] = {PP_GPIPE, PP_1F1B, PP_INTERLEAVED, PP_ZB1, PP_ZBV, PP_DUALPIPEV, PP_DUALPIPE};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        if (name != NULL && strcmp(name, pipeline_schedule_name(kinds[i])) == 0) {
            *kind = kinds[i];
            return 0;
        }
    }
    return pp_error(err, errlen, "unknown pipeline schedule '%s' (expected gpipe, 1f1b, interleaved, zb1, zbv, dualpipev or dualpipe)",
                    name != NULL ? name : "(null)");
}

// 1 when the schedule runs BACKWARD_INPUT and BACKWARD_WEIGHT instead of BACKWARD: for every
// (microbatch, chunk) under zb1 and zbv, for some under dualpipev and dualpipe (their other
// backwards are whole).
static inline int pipeline_splits_backward(PipelineScheduleKind kind) {
    return kind == PP_ZB1 || kind == PP_ZBV || kind == PP_DUALPIPEV || kind == PP_DUALPIPE;
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
        case PP_DUALPIPEV:
        case PP_DUALPIPE:
            if (v != 2) {
                return pp_error(err, errlen, "pipeline: the %s schedule runs two model chunks per stage (the V), "
                                "so the number of chunks must be 2, got %d", pipeline_schedule_name(cfg->kind), v);
            }
            // its phases are written for at least two microbatches per virtual stage of a rank
            if (cfg->kind == PP_DUALPIPEV && M < 2 * S) {
                return pp_error(err, errlen, "pipeline: the dualpipev schedule needs at least 2 x stages = %d "
                                "microbatches, got %d", 2 * S, M);
            }
            // half the microbatches enter at each end; each half runs dualpipev's phases on
            // half the ranks
            if (cfg->kind == PP_DUALPIPE && S % 2 != 0) {
                return pp_error(err, errlen, "pipeline: the dualpipe schedule needs an even number of stages, got %d", S);
            }
            if (cfg->kind == PP_DUALPIPE && (M % 2 != 0 || M < 2 * S)) {
                return pp_error(err, errlen, "pipeline: the dualpipe schedule needs an even number of microbatches, at "
                                "least 2 x stages = %d, got %d", 2 * S, M);
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
    PP_FORWARD_BACKWARD,  // F&B (dualpipev): the forward of (microbatch, chunk) overlapped with the
                          // whole backward of (backward_microbatch, backward_chunk)
} PipelineActionKind;

typedef struct {
    PipelineActionKind kind;
    int microbatch;      // 0 .. M-1
    int chunk;           // model chunk on this stage, 0 .. v-1
    int peer;            // the stage at the other end of a send/receive (never this stage);
                         // -1 for computations
    int post_with_next;  // 1: a send/receive at the same instant as the next action, which is one
                         // too; the run may be posted as one batch (see the pairing rule above)
    int backward_microbatch, backward_chunk;  // the backward half of a FORWARD_BACKWARD; -1 otherwise
} PipelineAction;

// 1 for F, B, I, W and F&B; 0 for sends and receives.
static inline int pipeline_is_compute(PipelineActionKind kind) {
    return kind == PP_FORWARD || kind == PP_BACKWARD || kind == PP_BACKWARD_INPUT || kind == PP_BACKWARD_WEIGHT ||
           kind == PP_FORWARD_BACKWARD;
}

// The one or two computations an action runs: itself, or a FORWARD_BACKWARD's FORWARD then its
// BACKWARD. Returns their number (0 for a send or receive).
static inline int pipeline_action_halves(const PipelineAction* a, PipelineAction* halves) {
    if (a->kind != PP_FORWARD_BACKWARD) {
        halves[0] = *a;
        return pipeline_is_compute(a->kind);
    }
    halves[0] = *a;
    halves[0].kind = PP_FORWARD;
    halves[0].backward_microbatch = halves[0].backward_chunk = -1;
    halves[1] = halves[0];
    halves[1].kind = PP_BACKWARD;
    halves[1].microbatch = a->backward_microbatch;
    halves[1].chunk = a->backward_chunk;
    return 2;
}

// The computations that produce the input gradient, which SEND_BACKWARD sends.
static inline int pipeline_is_input_backward(PipelineActionKind kind) {
    return kind == PP_BACKWARD || kind == PP_BACKWARD_INPUT;
}

// The position in the model of chunk `chunk` of stage `stage`, 0 .. S*v-1: the stage itself
// with one chunk, c*S + s interleaved (round-robin), s and 2S-1-s for zbv (the V).
static inline int pp_is_v_shape(PipelineScheduleKind kind) { return kind == PP_ZBV || kind == PP_DUALPIPEV; }

// Virtual stages of the model: S*v, but S under dualpipe (each stage is on two ranks).
static inline int pipeline_num_virtual_stages(const PipelineConfig* cfg) {
    return cfg->kind == PP_DUALPIPE ? cfg->num_stages : cfg->num_stages * cfg->num_chunks;
}

// dualpipe: the direction of chunk `chunk` of `stage`: 0 for the microbatches entering at
// stage 0 (stage s runs model stage s), 1 for those entering at stage S-1 (stage s runs model
// stage S-1-s). Rank s < S/2 holds model stage s for direction 0 as chunk 0 and S-1-s for
// direction 1 as chunk 1; rank S-1-s mirrors it.
static inline int pipeline_direction(const PipelineConfig* cfg, int stage, int chunk) {
    if (cfg->kind != PP_DUALPIPE) { return 0; }
    return (stage < cfg->num_stages / 2) == (chunk == 0) ? 0 : 1;
}

// The microbatches chunk `chunk` of `stage` runs: [first, first + count). Every one but under
// dualpipe, where each direction has half: [0, M/2) enter at stage 0, [M/2, M) at stage S-1.
static inline void pipeline_chunk_microbatches(const PipelineConfig* cfg, int stage, int chunk, int* first, int* count) {
    int M = cfg->num_microbatches;
    *first = cfg->kind == PP_DUALPIPE ? pipeline_direction(cfg, stage, chunk) * (M / 2) : 0;
    *count = cfg->kind == PP_DUALPIPE ? M / 2 : M;
}

static inline int pipeline_virtual_stage(const PipelineConfig* cfg, int stage, int chunk) {
    if (cfg->kind == PP_DUALPIPE) {
        int h = stage < cfg->num_stages - 1 - stage ? stage : cfg->num_stages - 1 - stage;
        return chunk == 0 ? h : cfg->num_stages - 1 - h;
    }
    if (pp_is_v_shape(cfg->kind)) { return chunk == 0 ? stage : 2 * cfg->num_stages - 1 - stage; }
    return chunk * cfg->num_stages + stage;
}

// The inverse: which stage and chunk hold virtual stage vs (under dualpipe its copy of
// direction 0, stage vs; pipeline_unit_owner names the copy a microbatch runs on).
static inline void pipeline_virtual_stage_owner(const PipelineConfig* cfg, int vs, int* stage, int* chunk) {
    int S = cfg->num_stages;
    if (cfg->kind == PP_DUALPIPE) {
        *stage = vs;
        *chunk = vs < S / 2 ? 0 : 1;
    } else if (pp_is_v_shape(cfg->kind)) {
        *chunk = vs < S ? 0 : 1;
        *stage = vs < S ? vs : 2 * S - 1 - vs;
    } else {
        *chunk = vs / S;
        *stage = vs % S;
    }
}

// The stage and chunk running virtual stage vs of microbatch m.
static inline void pipeline_unit_owner(const PipelineConfig* cfg, int vs, int m, int* stage, int* chunk) {
    pipeline_virtual_stage_owner(cfg, vs, stage, chunk);
    // direction 1: the mirror rank, whose chunk of the same number holds vs too
    if (cfg->kind == PP_DUALPIPE && m >= cfg->num_microbatches / 2) { *stage = cfg->num_stages - 1 - vs; }
}

// The stage holding the virtual stage before (step = -1) or after (step = +1) chunk `chunk` of
// `stage` (on that chunk's microbatches' way): -1 if there is none (the first / last virtual
// stage), `stage` itself for a local hand-off (no message; see the header comment).
static inline int pipeline_neighbour_stage(const PipelineConfig* cfg, int stage, int chunk, int step) {
    int vs = pipeline_virtual_stage(cfg, stage, chunk) + step;
    if (vs < 0 || vs >= pipeline_num_virtual_stages(cfg)) { return -1; }
    int first, count, owner, owner_chunk;
    pipeline_chunk_microbatches(cfg, stage, chunk, &first, &count);
    pipeline_unit_owner(cfg, vs, first, &owner, &owner_chunk);
    return owner;
}

// Most actions one stage's list can have: per (microbatch, chunk) its computations (F and B, or
// F, I and W) plus at most two receives and two sends.
static inline int pipeline_max_actions(const PipelineConfig* cfg) {
    return (pipeline_splits_backward(cfg->kind) ? 7 : 6) * cfg->num_chunks * cfg->num_microbatches;
}

// ----------------------------------------------------------------------------------------------
// compute order

// Computations per stage: F and B, or F, I and W, of every (microbatch, chunk); for dualpipev
// at most that (an F&B is one computation).
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
    a->backward_microbatch = a->backward_chunk = -1;
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
        case PP_ZBV:
        case PP_DUALPIPEV:
        case PP_DUALPIPE: break;  // have phases of their own (pp_order_zbv, pp_order_dualpipev)
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

// dualpipev: appends the next backward of chunk c (counter backwards[c]), whole or with its
// weight half split off; a split one's W joins the queue weights_due (the FIFO of DeepSeek's
// WeightGradStore) as microbatch * 2 + chunk.
static inline void pp_push_dualpipev_backward(const PipelineConfig* cfg, PipelineAction* out, int* count,
                                              int* backwards, int c, int split, int* weights_due, int* due_count) {
    if (split) { weights_due[(*due_count)++] = backwards[c] * 2 + c; }
    pp_push_next(cfg, out, count, split ? PP_BACKWARD_INPUT : PP_BACKWARD, backwards, c);
}

// dualpipev: the oldest weight half in the queue (head: its index).
static inline void pp_push_dualpipev_weight(const PipelineConfig* cfg, PipelineAction* out, int* count,
                                            const int* weights_due, int* head) {
    int due = weights_due[(*head)++];
    pp_push(cfg, out, count, PP_BACKWARD_WEIGHT, due / 2, due % 2);
}

// dualpipev: F&B, the next forward of chunk fc overlapped with the next whole backward of chunk bc.
static inline void pp_push_dualpipev_pair(const PipelineConfig* cfg, PipelineAction* out, int* count,
                                          int* forwards, int fc, int* backwards, int bc) {
    pp_push_next(cfg, out, count, PP_FORWARD, forwards, fc);
    PipelineAction* a = &out[*count - 1];
    a->kind = PP_FORWARD_BACKWARD;
    a->backward_microbatch = backwards[bc]++;
    a->backward_chunk = bc;
}

// dualpipev (DeepSeek's DualPipe cut in half, as deepseek-ai/DualPipe's DualPipeV), the eight
// phases of rank r of P = S ranks, N = M microbatches, chunk 0 = virtual stage r going down the
// V, chunk 1 = virtual stage 2P-1-r coming back:
//   1. F0 x 2(P-r-1)            2. (F0, F1) x (r+1)          3. (I1, W1, F1) x (P-r-1)
//   4. (F0&B1, F1&B0) x (N-2P+r+1), on the last rank the first pair as F0 then B1 (not overlapped)
//   5. (B1, F1&B0) x (P-r-1)    6. (B1, B0) x (r+1), the last r+1 of these backwards split
//   7. (W, I0) x (P-r-1)        8. W x (r+1)
// A W is always the oldest weight half still due (the reference's FIFO), so each chunk's W's
// come in microbatch order.
//
// dualpipe (DeepSeek's DualPipe): rank s and its mirror S-1-s both run rank r = min(s, S-1-s)'s
// phases of a dualpipev of P = S/2 ranks and N = M/2 microbatches, chunk 0 being model stage r
// and chunk 1 model stage S-1-r, each chunk on the microbatches of its direction
// (pipeline_chunk_microbatches).
static inline int pp_order_dualpipev(const PipelineConfig* cfg, int stage, PipelineAction* out) {
    int dual = cfg->kind == PP_DUALPIPE;
    int P = dual ? cfg->num_stages / 2 : cfg->num_stages, N = dual ? cfg->num_microbatches / 2 : cfg->num_microbatches;
    int r = stage < P ? stage : cfg->num_stages - 1 - stage;
    int forwards[2], backwards[2], per_chunk;
    for (int c = 0; c < 2; c++) {
        pipeline_chunk_microbatches(cfg, stage, c, &forwards[c], &per_chunk);
        backwards[c] = forwards[c];
    }
    int* weights_due = (int*)malloc_or_die((size_t)2 * cfg->num_microbatches * sizeof(int), "pipeline order");
    int due_count = 0, head = 0, count = 0;
    for (int i = 0; i < 2 * (P - r - 1); i++) { pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 0); }
    for (int i = 0; i < r + 1; i++) {
        pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 0);
        pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 1);
    }
    for (int i = 0; i < P - r - 1; i++) {
        pp_push_dualpipev_backward(cfg, out, &count, backwards, 1, 1, weights_due, &due_count);
        pp_push_dualpipev_weight(cfg, out, &count, weights_due, &head);
        pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 1);
    }
    for (int i = 0; i < N - 2 * P + r + 1; i++) {
        if (i == 0 && r == P - 1) {
            pp_push_next(cfg, out, &count, PP_FORWARD, forwards, 0);
            pp_push_dualpipev_backward(cfg, out, &count, backwards, 1, 0, weights_due, &due_count);
        } else {
            pp_push_dualpipev_pair(cfg, out, &count, forwards, 0, backwards, 1);
        }
        pp_push_dualpipev_pair(cfg, out, &count, forwards, 1, backwards, 0);
    }
    for (int i = 0; i < P - r - 1; i++) {
        pp_push_dualpipev_backward(cfg, out, &count, backwards, 1, 0, weights_due, &due_count);
        pp_push_dualpipev_pair(cfg, out, &count, forwards, 1, backwards, 0);
    }
    for (int k = 0; k < 2 * (r + 1); k++) {
        pp_push_dualpipev_backward(cfg, out, &count, backwards, k % 2 == 0 ? 1 : 0, k >= r + 1, weights_due, &due_count);
    }
    for (int i = 0; i < P - r - 1; i++) {
        pp_push_dualpipev_weight(cfg, out, &count, weights_due, &head);
        pp_push_dualpipev_backward(cfg, out, &count, backwards, 0, 1, weights_due, &due_count);
    }
    while (head < due_count) { pp_push_dualpipev_weight(cfg, out, &count, weights_due, &head); }
    free(weights_due);
    return count;
}

// Writes the stage's computations in execution order; returns their number.
static inline int pp_compute_order(const PipelineConfig* cfg, int stage, PipelineAction* out) {
    switch (cfg->kind) {
        case PP_ZB1: return pp_order_zb1(cfg, stage, out);
        case PP_ZBV: return pp_order_zbv(cfg, stage, out);
        case PP_DUALPIPEV:
        case PP_DUALPIPE: return pp_order_dualpipev(cfg, stage, out);
        default: return pp_order_one_forward_one_backward(cfg, stage, out);
    }
}

// The reference timeline (see the pairing rule): every stage's compute order run with the
// reference costs, each computation starting once its stage is free and its input exists,
// transfers instant. Integer times, so exact.
typedef struct {
    int n;                  // room for computations per stage (pp_computations)
    int* count;             // [S]: stage s's computations, order[s*n .. s*n + count[s])
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
    return kind == PP_FORWARD_BACKWARD ? 3 : kind == PP_BACKWARD ? 2 : 1;
}

// When the input of one computation (not an F&B) exists in the reference timeline; -1: not yet.
static inline int pp_reference_ready(const PPReference* ref, const PipelineConfig* cfg, int stage,
                                     const PipelineAction* a) {
    int M = cfg->num_microbatches, V = pipeline_num_virtual_stages(cfg);
    int u = pipeline_virtual_stage(cfg, stage, a->chunk) * M + a->microbatch;
    if (a->kind == PP_FORWARD) { return u < M ? 0 : ref->fwd_end[u - M]; }
    if (a->kind == PP_BACKWARD_WEIGHT) { return ref->bwd_end[u]; }
    return u >= (V - 1) * M ? ref->fwd_end[u] : ref->bwd_end[u + M];
}

static inline void pp_reference_build(PPReference* ref, const PipelineConfig* cfg) {
    int S = cfg->num_stages, M = cfg->num_microbatches, V = pipeline_num_virtual_stages(cfg);
    int n = pp_computations(cfg);
    size_t units = (size_t)V * M;
    ref->n = n;
    ref->count = (int*)malloc_or_die((size_t)S * sizeof(int), "pipeline order");
    ref->order = (PipelineAction*)malloc_or_die((size_t)S * n * sizeof(PipelineAction), "pipeline order");
    ref->start = (int*)malloc_or_die((size_t)S * n * sizeof(int), "pipeline reference timeline");
    ref->fwd_start = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    ref->fwd_end = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    ref->bwd_start = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    ref->bwd_end = (int*)malloc_or_die(units * sizeof(int), "pipeline reference timeline");
    int* pos = (int*)calloc_or_die((size_t)S, sizeof(int), "pipeline reference timeline");
    int* clock = (int*)calloc_or_die((size_t)S, sizeof(int), "pipeline reference timeline");
    long long remaining = 0;
    for (int s = 0; s < S; s++) {
        int count = pp_compute_order(cfg, s, ref->order + (size_t)s * n);
        if (count > n || (cfg->kind != PP_DUALPIPEV && cfg->kind != PP_DUALPIPE && count != n)) {
            fatal("pipeline: internal error: the %s compute order of stage %d has %d computations, expected %d",
                  pipeline_schedule_name(cfg->kind), s, count, n);
        }
        ref->count[s] = count;
        remaining += count;
    }
    for (size_t i = 0; i < units; i++) { ref->fwd_start[i] = ref->fwd_end[i] = ref->bwd_start[i] = ref->bwd_end[i] = -1; }
    while (remaining > 0) {
        int progress = 0;
        for (int s = 0; s < S; s++) {
            while (pos[s] < ref->count[s]) {
                const PipelineAction* a = &ref->order[(size_t)s * n + pos[s]];
                // an F&B starts once the inputs of both halves exist; both end with it
                PipelineAction halves[2];
                int nh = pipeline_action_halves(a, halves), ready = 0;  // when the input exists; -1: not yet
                for (int h = 0; h < nh && ready >= 0; h++) {
                    int r = pp_reference_ready(ref, cfg, s, &halves[h]);
                    ready = r < 0 ? -1 : (r > ready ? r : ready);
                }
                if (ready < 0) { break; }
                int start = clock[s] > ready ? clock[s] : ready;
                clock[s] = start + pp_reference_cost(a->kind);
                ref->start[(size_t)s * n + pos[s]] = start;
                for (int h = 0; h < nh; h++) {
                    int u = pipeline_virtual_stage(cfg, s, halves[h].chunk) * M + halves[h].microbatch;
                    if (halves[h].kind == PP_FORWARD) {
                        ref->fwd_start[u] = start;
                        ref->fwd_end[u] = clock[s];
                    } else if (pipeline_is_input_backward(halves[h].kind)) {
                        ref->bwd_start[u] = start;
                        ref->bwd_end[u] = clock[s];
                    }
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
        for (int j = 0; j < ref->count[s]; j++) {
            int start = ref->start[(size_t)s * n + j];
            int end = start + pp_reference_cost(ref->order[(size_t)s * n + j].kind);
            for (int t = start + 1; t < end; t++) { ref->inside[(size_t)s * (ref->horizon + 1) + t] = 1; }
        }
    }
    free(pos);
    free(clock);
}

static inline void pp_reference_free(PPReference* ref) {
    free(ref->count);
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
// and the same on both ends; under dualpipe the middle link carries two directions' messages
// across one boundary, and the microbatch tells them apart.
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
    if (a->boundary != b->boundary) { return a->boundary < b->boundary ? -1 : 1; }
    // dualpipe's middle pair of ranks carries both directions across one boundary
    return a->action.microbatch < b->action.microbatch ? -1 : (a->action.microbatch > b->action.microbatch ? 1 : 0);
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
    for (int j = 0; j < ref->count[stage]; j++) {
        const PipelineAction* a = &ref->order[(size_t)stage * n + j];
        int start = ref->start[(size_t)stage * n + j];
        pp_add_event(events, &count, start, 1, 0, S, 0, 0, a->kind, a, -1);
        // the messages of each half (an F&B's: both receives before it, both sends after)
        PipelineAction halves[2];
        int nh = pipeline_action_halves(a, halves);
        for (int h = 0; h < nh; h++) {
            const PipelineAction* c = &halves[h];
            int vs = pipeline_virtual_stage(cfg, stage, c->chunk);
            int u = vs * M + c->microbatch;
            // messages only to and from another stage
            int prev = pipeline_neighbour_stage(cfg, stage, c->chunk, -1);
            int next = pipeline_neighbour_stage(cfg, stage, c->chunk, +1);
            int prev_is_remote = prev >= 0 && prev != stage, next_is_remote = next >= 0 && next != stage;
            // dir 0 forward, 1 backward
            if (c->kind == PP_FORWARD) {
                if (prev_is_remote) {
                    int t = pp_message_instant(ref, prev, stage, fwd_end[u - M], start);
                    pp_add_event(events, &count, t, 0, vs - 1, S, 0, fwd_end[u - M], PP_RECV_FORWARD, c, prev);
                }
                if (next_is_remote) {
                    int t = pp_message_instant(ref, stage, next, fwd_end[u], ref->fwd_start[u + M]);
                    pp_add_event(events, &count, t, 0, vs, S, 0, fwd_end[u], PP_SEND_FORWARD, c, next);
                }
            } else if (pipeline_is_input_backward(c->kind)) {
                if (next_is_remote) {
                    int t = pp_message_instant(ref, next, stage, bwd_end[u + M], start);
                    pp_add_event(events, &count, t, 0, vs, S, 1, bwd_end[u + M], PP_RECV_BACKWARD, c, next);
                }
                if (prev_is_remote) {
                    int t = pp_message_instant(ref, stage, prev, bwd_end[u], ref->bwd_start[u - M]);
                    pp_add_event(events, &count, t, 0, vs - 1, S, 1, bwd_end[u], PP_SEND_BACKWARD, c, prev);
                }
            }
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
// all stages at once (the startup table, the simulator, the tests and the drawing tool)

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
// chunk's activations (1/v of the stage's layers). An F&B holds its forward's and its
// backward's together.
static inline int pipeline_max_in_flight(const PipelineAction* actions, int n) {
    int held = 0, most = 0;
    for (int i = 0; i < n; i++) {
        PipelineAction halves[2];
        int nh = pipeline_action_halves(&actions[i], halves);
        for (int h = 0; h < nh; h++) {
            if (halves[h].kind == PP_FORWARD) { held++; }
            if (held > most) { most = held; }
            if (halves[h].kind == PP_BACKWARD || halves[h].kind == PP_BACKWARD_WEIGHT) { held--; }
        }
    }
    return most;
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
//   dualpipev  with F = 1, B = 2, I = W = 1 and an F&B costing F + B = 3 (nothing hidden):
//          T = 6M + 2(S-1). Every rank idles 2(S-1) units: DeepSeek's DualPipe bubble
//          (PP/2-1)(F&B + B - 3W) with PP = 2S (the DualPipe it halves) = (S-1)(3 + 2 - 3).
static inline double pipeline_bubble_fraction(const PipelineConfig* cfg) {
    double S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    double T;
    switch (cfg->kind) {
        case PP_ZB1: T = fmax(3.0 * M + S - 1.0, 2.0 * M + 2.0 * S - 1.0); break;
        case PP_ZBV: T = fmax(6.0 * M + S - 1.0, 4.0 * M + 4.0 * S - 2.0); break;
        case PP_DUALPIPEV: T = 6.0 * M + 2.0 * (S - 1.0); break;
        case PP_DUALPIPE: return (S - 2.0) / (3.0 * M + S - 2.0);
        default: return (S - 1.0) / (v * M + S - 1.0);
    }
    return (T - 3.0 * v * M) / T;
}

// ----------------------------------------------------------------------------------------------
// layer partition and placement

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

// What one model chunk of one rank holds (a rank without pipeline parallelism holds one chunk:
// every layer, the embeddings and the head). The model builds, zero.h and the executor take
// this rank's chunks in this form.
typedef struct {
    int first_layer, last_layer;   // its transformer layers [first_layer, last_layer); empty when
                                   // there are fewer layers than virtual stages
    int has_embedding;             // token and position embeddings (virtual stage 0)
    int has_head;                  // final layernorm, LM head and loss (the last virtual stage)
    int virtual_stage;             // its position in the model, 0 .. S*v-1
} ChunkPlace;

// The layers of every (stage, chunk) of the schedule, into out[stage * v + chunk] (S*v
// entries): L layers balanced over the S*v virtual stages in model order by
// pipeline_partition_layers (same cost model), virtual stage pipeline_virtual_stage(cfg, stage,
// chunk) going to that chunk. Under zbv rank 0 thus holds both the embedding and the head.
static inline int pipeline_place_layers(const PipelineConfig* cfg, int num_layers, double embed_cost, double head_cost,
                                        ChunkPlace* out, char* err, size_t errlen) {
    if (pipeline_check_config(cfg, err, errlen) != 0) { return -1; }
    int S = cfg->num_stages, v = cfg->num_chunks, V = pipeline_num_virtual_stages(cfg);
    int* first = (int*)malloc_or_die((size_t)(V + 1) * sizeof(int), "pipeline placement");
    if (pipeline_partition_layers(num_layers, V, embed_cost, head_cost, first, err, errlen) != 0) {
        free(first);
        return -1;
    }
    for (int s = 0; s < S; s++) {
        for (int c = 0; c < v; c++) {
            int vs = pipeline_virtual_stage(cfg, s, c);
            out[s * v + c] = (ChunkPlace){first[vs], first[vs + 1], vs == 0, vs == V - 1, vs};
        }
    }
    free(first);
    return 0;
}

#endif // LLMC_PIPELINE_H
