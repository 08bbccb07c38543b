/*
 * pp_sim.h: what dev/tools/pp_schedule and dev/test/test_pipeline.c need beyond the schedules
 * of llmc/pipeline.h: the actions' names, the textbook memory bound of each schedule, and a
 * timeline simulator that runs any stage lists with given compute costs under rendezvous,
 * batched or eager sends, reporting the timeline and the bubble per stage, or a deadlock / an
 * invalid schedule instead of hanging. The trainer needs none of it.
 *
 * API (all functions static inline):
 *   pipeline_action_kind_name(kind), pipeline_action_token(action, with_chunk, buf, len)
 *   pipeline_memory_bound(cfg, stage)       the textbook bound on pipeline_max_in_flight
 *   pipeline_simulate(&sch, &costs, &timeline, err, errlen), pipeline_timeline_free(&timeline)
 *   pipeline_timeline_bubble(&timeline)     idle time over stages x makespan
 *
 * Errors as in pipeline.h: -1 with one line in err. Header-only C11.
 */
#ifndef DEV_TOOLS_PP_SIM_H
#define DEV_TOOLS_PP_SIM_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/pipeline.h"
#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------------
// kinds and names of actions

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
        case PP_FORWARD_BACKWARD: return "FORWARD_BACKWARD";
    }
    return "UNKNOWN";
}

// Compact token: F3 / B3 / I3 / W3 for computations, rF3 sF3 rB3 sB3 for receive/send of the
// forward activation or backward gradient of microbatch 3; "c1" appended for chunk 1 when the
// stages hold several chunks; an F&B as its two halves joined by "&" (F3c0&B1c1).
static inline void pipeline_action_token(const PipelineAction* a, int with_chunk, char* buf, size_t len) {
    PipelineAction halves[2];
    if (a->kind == PP_FORWARD_BACKWARD && len > 0) {
        pipeline_action_halves(a, halves);
        pipeline_action_token(&halves[0], with_chunk, buf, len);
        size_t used = strlen(buf);
        if (used + 1 < len) {
            buf[used] = '&';
            pipeline_action_token(&halves[1], with_chunk, buf + used + 1, len - used - 1);
        }
        return;
    }
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
        case PP_FORWARD_BACKWARD: break;
    }
    if (with_chunk) {
        snprintf(buf, len, "%s%dc%d", prefix, a->microbatch, a->chunk);
    } else {
        snprintf(buf, len, "%s%d", prefix, a->microbatch);
    }
}

// ----------------------------------------------------------------------------------------------
// activations held

// The textbook bound on pipeline_max_in_flight of stage s, in (microbatch, chunk) pairs:
//   gpipe        M: every forward before the first backward
//   1f1b         min(S-s, M): the S-s-1 warmup forwards and the one of the steady pair
//   interleaved  min(2*(S-s-1) + (v-1)*S + 1, v*M): Megatron-LM's warmup and one more
//   zb1          min(S, M) on every stage: 1f1b's stage 0 (ZB-H1 keeps 1F1B's peak memory;
//                stage s defers its W's by s microbatches)
//   zbv          min(2S, 2M) on every rank: S microbatches of a 1f1b stage's layers, as each
//                chunk has half of them (ZB-V's peak memory p*M_B in the paper)
//   dualpipev    2S + 1 on every rank: DeepSeek's PP + 1 chunk activations (PP = 2S, the
//                DualPipe ranks it halves), the one more being an F&B's two halves together
//   dualpipe     S + 1 on every rank: DeepSeek's PP + 1
static inline int pipeline_memory_bound(const PipelineConfig* cfg, int stage) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    int bound = 0;
    switch (cfg->kind) {
        case PP_GPIPE: bound = M; break;
        case PP_1F1B: bound = S - stage; break;
        case PP_INTERLEAVED: bound = 2 * (S - stage - 1) + (v - 1) * S + 1; break;
        case PP_ZB1: bound = S; break;
        case PP_ZBV: bound = 2 * S; break;
        case PP_DUALPIPEV: bound = 2 * S + 1; break;
        case PP_DUALPIPE: bound = S + 1; break;
    }
    return bound < v * M ? bound : v * M;
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
    const double* overlapped;  // [S]: time of one F&B (less than forward + backward where one half
                               // hides the other's messages or idle units). NULL: forward +
                               // backward (nothing hidden, as on one CPU thread)
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
        case PP_FORWARD_BACKWARD:
            return costs->overlapped != NULL ? costs->overlapped[s] : costs->forward[s] + costs->backward[s];
        default: return costs->backward[s];
    }
}

// Writes "stage 2 action 5 (SEND_FORWARD of microbatch 3 chunk 0 to stage 3)".
static inline void pp_describe(const PipelineSchedule* sch, int stage, int index, char* buf, size_t len) {
    const PipelineAction* a = &sch->actions[sch->offset[stage] + index];
    if (a->kind == PP_FORWARD_BACKWARD) {
        snprintf(buf, len, "stage %d action %d (FORWARD of microbatch %d chunk %d & BACKWARD of microbatch %d chunk %d)",
                 stage, index, a->microbatch, a->chunk, a->backward_microbatch, a->backward_chunk);
    } else if (pipeline_is_compute(a->kind)) {
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
    int V = pipeline_num_virtual_stages(cfg);
    const PipelineAction* a = &sch->actions[sch->offset[stage] + index];
    int count = sch->offset[stage + 1] - sch->offset[stage];
    if ((int)a->kind < (int)PP_RECV_FORWARD || (int)a->kind > (int)PP_FORWARD_BACKWARD) {
        return pp_error(err, errlen, "pipeline: stage %d action %d has unknown kind %d", stage, index, (int)a->kind);
    }
    if (a->microbatch < 0 || a->microbatch >= cfg->num_microbatches || a->chunk < 0 || a->chunk >= cfg->num_chunks) {
        return pp_error(err, errlen, "pipeline: stage %d action %d (%s) has microbatch %d chunk %d, "
                        "expected 0..%d and 0..%d", stage, index, pipeline_action_kind_name(a->kind),
                        a->microbatch, a->chunk, cfg->num_microbatches - 1, cfg->num_chunks - 1);
    }
    int first, count_of_chunk, pair = a->kind == PP_FORWARD_BACKWARD;
    pipeline_chunk_microbatches(cfg, stage, a->chunk, &first, &count_of_chunk);
    if (a->microbatch < first || a->microbatch >= first + count_of_chunk) {
        return pp_error(err, errlen, "pipeline: stage %d action %d (%s) has microbatch %d, but its chunk %d runs "
                        "microbatches %d..%d", stage, index, pipeline_action_kind_name(a->kind), a->microbatch,
                        a->chunk, first, first + count_of_chunk - 1);
    }
    if (pair ? (a->backward_microbatch < 0 || a->backward_microbatch >= cfg->num_microbatches ||
                a->backward_chunk < 0 || a->backward_chunk >= cfg->num_chunks)
             : (a->backward_microbatch != -1 || a->backward_chunk != -1)) {
        return pp_error(err, errlen, "pipeline: stage %d action %d (%s) has backward half microbatch %d chunk %d, "
                        "expected %s", stage, index, pipeline_action_kind_name(a->kind), a->backward_microbatch,
                        a->backward_chunk, pair ? "an existing one" : "-1 -1 (none)");
    }
    char what[200];
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

// Checks and records one computation c (an F&B runs two) of the action `what` on stage s.
static inline int pp_sim_half(PPSim* sim, int s, const PipelineAction* c, const char* what, char* err, size_t errlen) {
    const PipelineConfig* cfg = &sim->sch->cfg;
    int vs = pipeline_virtual_stage(cfg, s, c->chunk);
    int prev = pipeline_neighbour_stage(cfg, s, c->chunk, -1), next = pipeline_neighbour_stage(cfg, s, c->chunk, +1);
    size_t u = (size_t)vs * sim->M + c->microbatch;
    const char* half = c->kind == PP_FORWARD ? "FORWARD" : c->kind == PP_BACKWARD_WEIGHT ? "BACKWARD_WEIGHT" : "backward";
    if (c->kind == PP_FORWARD) {
        if (sim->fwd_done[u]) { return pp_error(err, errlen, "pipeline: %s runs a second time", what); }
        if (prev == s && !sim->fwd_done[u - sim->M]) {
            return pp_error(err, errlen, "pipeline: %s runs before the FORWARD of virtual stage %d on the same stage, "
                            "whose output is its input", what, vs - 1);
        }
        if (prev >= 0 && prev != s && !sim->fwd_in[u]) {
            return pp_error(err, errlen, "pipeline: %s runs before its input activation was received", what);
        }
        sim->fwd_done[u] = 1;
    } else if (c->kind == PP_BACKWARD_WEIGHT) {
        if (sim->wgt_done[u]) { return pp_error(err, errlen, "pipeline: %s runs a second time", what); }
        if (!sim->bwd_done[u]) { return pp_error(err, errlen, "pipeline: %s runs before its BACKWARD_INPUT", what); }
        sim->wgt_done[u] = 1;
    } else {
        if (sim->bwd_done[u]) { return pp_error(err, errlen, "pipeline: %s (its %s) runs a second time", what, half); }
        if (!sim->fwd_done[u]) { return pp_error(err, errlen, "pipeline: %s (its %s) runs before its forward", what, half); }
        if (next == s && !sim->bwd_done[u + sim->M]) {
            return pp_error(err, errlen, "pipeline: %s runs before the backward of virtual stage %d on the same stage, "
                            "whose input gradient is its output gradient", what, vs + 1);
        }
        if (next >= 0 && next != s && !sim->bwd_in[u]) {
            return pp_error(err, errlen, "pipeline: %s (its %s) runs before its output gradient was received", what, half);
        }
        sim->bwd_done[u] = 1;
        if (c->kind == PP_BACKWARD) { sim->wgt_done[u] = 1; }
    }
    return 0;
}

static inline int pp_sim_compute(PPSim* sim, int s, char* err, size_t errlen) {
    int i = sim->sch->offset[s] + sim->pc[s];
    const PipelineAction* a = &sim->sch->actions[i];
    char what[200];
    pp_describe(sim->sch, s, sim->pc[s], what, sizeof(what));
    PipelineAction halves[2];
    int nh = pipeline_action_halves(a, halves);
    for (int h = 0; h < nh; h++) {
        if (pp_sim_half(sim, s, &halves[h], what, err, errlen) != 0) { return -1; }
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
        if (costs->overlapped != NULL && (!(costs->overlapped[s] >= 0.0) || !isfinite(costs->overlapped[s]))) {
            return pp_error(err, errlen, "pipeline simulation: stage %d: the F&B time must be finite and >= 0, got %g", s,
                            costs->overlapped[s]);
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
    sim.V = pipeline_num_virtual_stages(cfg);
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
            pipeline_unit_owner(cfg, (int)(u / sim.M), (int)(u % sim.M), &stage, &chunk);
            // a BACKWARD sets both, so an input gradient without a weight gradient was split
            const char* missing = !sim.fwd_done[u] ? "FORWARD" : (!sim.bwd_done[u] ? "BACKWARD" : "BACKWARD_WEIGHT");
            status = pp_error(err, errlen, "pipeline: stage %d never runs the %s of microbatch %d chunk %d",
                              stage, missing, (int)(u % sim.M), chunk);
        }
    }
    for (size_t m = 0; m < 2 * sim.units && status == 0; m++) {
        if (sim.sent[m] && !sim.received[m]) {
            int stage, chunk;
            pipeline_unit_owner(cfg, (int)((m % sim.units) / sim.M), (int)(m % sim.M), &stage, &chunk);
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

#endif // DEV_TOOLS_PP_SIM_H
