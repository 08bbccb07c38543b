/*
 * serve_pipeline.h: pipeline-parallel serving (issue 27): `mpirun -np S*K serve_gpt2 --pp S
 * [--tp K]`, the model's layers cut into S stages, several iterations in flight.
 *
 * THE STAGES: the trainer's grid (comm.h: tensor parallel fastest, pipeline slowest): stage s
 * is world ranks s*Q*K .. (s+1)*Q*K - 1, Q = --ep (default 1) tp groups of K ranks, its ep
 * groups the Q ranks of each tp coordinate (serve_parallel.h: every one of them holds every
 * row, the experts dealt over the ep group, the routed rows sent by all-to-all within the
 * stage); with --kvp P instead each stage is a KVP x TP pool of P*K ranks (llmc/serve_kvp.h:
 * its own KVP groups, its own pool for the output projection and the MLP, the KV cache of its
 * layers cut along the positions over its KVP ranks). The pp group of each (ep or kvp, tp)
 * coordinate joins the S stages. Stage s holds layers [s*L/S, (s+1)*L/S) (--pp must divide L), the first stage also
 * the embeddings, the last the final layernorm and the head (wte on both), placed as the
 * trainer places a stage (serve_model.c: pipeline.h's ChunkPlace, zero.h), and the KV cache of
 * its own layers only: L/S layers of the same blocks (the block tables are rank 0's).
 *
 * AN ITERATION: world rank 0 (stage 0, tp rank 0) schedules it (serve_engine_schedule) and
 * sends it down: stage 0's ranks get the step by broadcast (serve_step_broadcast: over rank 0's
 * ep group, or KVP group, then over each tp group), then each rank of stage s < S-1 sends the
 * step and its output rows (N x C floats, the residual stream after its last layer) to the rank
 * of the same coordinates in stage s+1 (pp group, point to point); the last stage's ep rank 0
 * (KVP rank 0) runs the head (vocabulary-parallel: its tp group alone) and its tp rank 0 sends
 * the probabilities (M x Vp floats) back to world rank 0 (pp group), which draws each
 * request's token.
 *
 * SEVERAL ITERATIONS IN FLIGHT. The rule: a request is in at most one iteration in flight
 * (ServeRequest.in_flight), since its next row is the token its last one draws. Rank 0 keeps up
 * to S iterations in flight; each is formed by serve_engine_schedule from the requests not in
 * flight, at most ceil(A/S) of them for A requests running or waiting (ServeEngine.max_sched),
 * so that A requests decoding go round the stages as S micro-batches of about A/S: while stage
 * 1 runs iteration i, stage 0 runs i+1. When S are in flight, or no request is left to
 * schedule, rank 0 waits for the oldest's probabilities, draws for its requests
 * (serve_engine_finish_step), and they may join the next iteration. While any iteration is in
 * flight nobody is preempted (its blocks are being written): a request short of blocks waits
 * for the iterations in flight to end; a cancel waits likewise (serve_engine_cancel). Every
 * stage runs the iterations in the order rank 0 sent them, so a block freed and given to
 * another request is written by the later iteration after the earlier one, on every stage.
 *
 * BITS: every row's forward is batch-invariant (serve_engine.h: the same bits whatever shares
 * its batch), and each request draws from its own sampler and RNG in its own token order; so
 * whatever the micro-batches and their interleaving, the tokens and probabilities are one
 * rank's. The stages' layers are the trainer's (the residual stream handed on is the one a
 * single rank would hold between those layers).
 *
 * NO DEADLOCK: rank 0 posts the receive of an iteration's probabilities before it sends the
 * iteration down, and every other rank handles the iterations one at a time in order (receive
 * the step and rows, compute, send on); the sends block until the next stage takes them, which
 * it does once it finished the iteration before: the pipeline's back-pressure.
 *
 * THE TRAFFIC per iteration of N rows, M of them read by the head (C channels, Vp the padded
 * vocabulary, max_blocks = maxT/block_size), as each rank sends it (comm.h's accounting):
 *   pp:    each rank of stage s < S-1: N*C*4 bytes to stage s+1 (its output rows); the last
 *          stage's tp rank 0: M*Vp*4 back to world rank 0 (the probabilities)
 *   other: each rank of stage s < S-1: the step to stage s+1, (2 + N*(2 + max_blocks) + M)*4
 *          (the counts, each row's token, position and block table, the head's rows, as floats);
 *          world rank 0 with K > 1 the same ints as the step broadcast over stage 0's tp group,
 *          with Q > 1 once more over its ep group, with --kvp P > 1 over its KVP group
 *   ep:    (serve_parallel.h) within each stage, per MoE layer of its own, the routed rows'
 *          all-to-alls over its ep groups (routing-dependent)
 *   tp:    (serve_parallel.h) over each stage's tp group, for its own layers: stage 0 the
 *          embedding's all-reduce and 2 per layer, the later stages 2 per layer, the last also
 *          the head's max and sums and the gather of the probabilities; with --kvp the 2 per
 *          layer over the stage's P*K pool (serve_kvp.h), and its KVP group's cp traffic
 * A decode step of one request is N = M = 1: per generated token C*4 bytes cross each of the
 * S-1 boundaries and Vp*4 come back. /metrics shows what rank 0 sent and received; each other
 * rank prints its totals when it ends (dev/test/test_serve_pp.sh checks both).
 */
#ifndef LLMC_SERVE_PIPELINE_H
#define LLMC_SERVE_PIPELINE_H

#include <stdio.h>
#include "llmc/comm.h"
#include "llmc/serve_engine.h"

// A stage's ends (serve_model.c): where the stage before's (N,C) rows arrive, its own output rows.
static float* serve_model_stage_input(ServeModel* m);
static float* serve_model_stage_output(ServeModel* m, int N);

enum { SERVE_PP_TAG_COUNTS = 1, SERVE_PP_TAG_STEP, SERVE_PP_TAG_ROWS, SERVE_PP_TAG_PROBS };

// An iteration in flight, on world rank 0: what its draws need when its probabilities are back.
typedef struct {
    int num_rows, num_sched, M;
    ServeRequest** sched;    // (max_requests) its requests ...
    int* sched_last_row;     // ... their last rows ...
    int* sched_head;         // ... and their rows of probs (-1: no draw; a prompt's chunk before its last)
    int* row_pos;            // (rows) its rows' positions
    float* probs;            // (max_head, Vp) what the last stage sends back
    CommRequest* probs_recv;
} ServePipeSlot;

typedef struct {
    int S, stage;
    ServePipeSlot* slots;    // world rank 0: a ring of S, the oldest at `oldest`
    int oldest, count, max_head;
    float* step;             // the step as floats: tokens, positions, block tables, head rows
    // counters: iterations, rows and head rows this rank ran; the most in flight at once; on
    // world rank 0 the probabilities' bytes received from the last stage
    long long iterations, rows, head_rows;
    int max_in_flight;
    unsigned long long returned_bytes;
} ServePipeline;

static inline void serve_pp_init(ServePipeline* p, ServeEngine* e) {
    memset(p, 0, sizeof(*p));
    p->S = e->comm->pp;
    p->stage = e->comm->pp_rank;
    int rows = e->max_batch_tokens;
    p->max_head = rows < e->max_requests ? rows : e->max_requests;
    p->step = (float*)malloc_or_die(sizeof(float) * ((size_t)rows * (2 + (size_t)e->max_blocks) + (size_t)p->max_head),
                                    "pipeline step");
    if (e->comm->world_rank != 0) { return; }
    p->slots = (ServePipeSlot*)calloc_or_die((size_t)p->S, sizeof(ServePipeSlot), "pipeline iterations");
    for (int i = 0; i < p->S; i++) {
        ServePipeSlot* slot = &p->slots[i];
        slot->sched = (ServeRequest**)malloc_or_die(sizeof(ServeRequest*) * (size_t)e->max_requests, "pipeline iteration");
        slot->sched_last_row = (int*)malloc_or_die(sizeof(int) * (2 * (size_t)e->max_requests + (size_t)rows), "pipeline iteration");
        slot->sched_head = slot->sched_last_row + e->max_requests;
        slot->row_pos = slot->sched_head + e->max_requests;
        slot->probs = (float*)malloc_or_die(sizeof(float) * (size_t)p->max_head * e->Vp, "pipeline probabilities");
    }
}

static inline void serve_pp_free(ServePipeline* p) {
    for (int i = 0; p->slots && i < p->S; i++) {
        free(p->slots[i].sched);
        free(p->slots[i].sched_last_row);
        free(p->slots[i].probs);
    }
    free(p->slots);
    free(p->step);
}

static inline void serve_pp_send(CommGroup* g, const float* buf, size_t n, int peer, int tag, CommKind kind) {
    comm_wait(comm_isend(g, buf, n, peer, tag, kind));
}
static inline void serve_pp_recv(CommGroup* g, float* buf, size_t n, int peer, int tag) {
    comm_wait(comm_irecv(g, buf, n, peer, tag, COMM_KIND_PP));
}

// The step (N rows, M head rows; N = -1: the end) and, for N > 0, this stage's output rows to
// the next stage (pp group, point to point). The ints go as floats: every one (token, position,
// block, row) is below 2^24, so each float is exact.
static inline void serve_pp_send_down(ServePipeline* p, ServeEngine* e, int M) {
    CommGroup* pp = &e->comm->pp_group;
    int N = e->num_rows, mb = e->max_blocks, next = p->stage + 1;
    float counts[2] = {(float)N, (float)M};
    serve_pp_send(pp, counts, 2, next, SERVE_PP_TAG_COUNTS, COMM_KIND_OTHER);
    if (N <= 0) { return; }
    size_t n = 0;
    for (int r = 0; r < N; r++) { p->step[n++] = (float)e->row_tok[r]; }
    for (int r = 0; r < N; r++) { p->step[n++] = (float)e->row_pos[r]; }
    for (size_t i = 0; i < (size_t)N * mb; i++) { p->step[n++] = (float)e->row_tables[i]; }
    for (int i = 0; i < M; i++) { p->step[n++] = (float)e->head_rows[i]; }
    serve_pp_send(pp, p->step, n, next, SERVE_PP_TAG_STEP, COMM_KIND_OTHER);
    serve_pp_send(pp, serve_model_stage_output(e->model, N), (size_t)N * e->config.channels, next, SERVE_PP_TAG_ROWS,
                  COMM_KIND_PP);
}

// A stage s > 0: the step from stage s-1 into the engine's rows (e->num_rows = -1: the end),
// then its rows into this stage's input; returns M.
static inline int serve_pp_recv_step(ServePipeline* p, ServeEngine* e) {
    CommGroup* pp = &e->comm->pp_group;
    int prev = p->stage - 1, mb = e->max_blocks;
    float counts[2];
    serve_pp_recv(pp, counts, 2, prev, SERVE_PP_TAG_COUNTS);
    int N = (int)counts[0], M = (int)counts[1];
    e->num_rows = N;
    if (N <= 0) { return 0; }
    size_t n = (size_t)N * (2 + (size_t)mb) + (size_t)M;
    serve_pp_recv(pp, p->step, n, prev, SERVE_PP_TAG_STEP);
    n = 0;
    for (int r = 0; r < N; r++) { e->row_tok[r] = (int)p->step[n++]; }
    for (int r = 0; r < N; r++) { e->row_pos[r] = (int)p->step[n++]; }
    for (size_t i = 0; i < (size_t)N * mb; i++) { e->row_tables[i] = (int)p->step[n++]; }
    for (int i = 0; i < M; i++) { e->head_rows[i] = (int)p->step[n++]; }
    serve_pp_recv(pp, serve_model_stage_input(e->model), (size_t)N * e->config.channels, prev, SERVE_PP_TAG_ROWS);
    return M;
}

// World rank 0, under the server's lock: the next iteration from the requests not in flight, at
// most ceil(A/S) of the A running or waiting (the micro-batches), each marked in flight;
// returns its rows (0: none left to schedule).
static inline int serve_pp_schedule(ServePipeline* p, ServeEngine* e) {
    int active = e->num_running + e->num_waiting;
    e->max_sched = (active + p->S - 1) / p->S;
    int rows = serve_engine_schedule(e);
    for (int s = 0; s < e->num_sched; s++) { e->sched[s]->in_flight = 1; }
    e->num_in_flight += e->num_sched;
    return rows;
}

// World rank 0: the scheduled iteration through stage 0 and down the pipeline; it joins the
// ring of iterations in flight. The requests are not touched (no lock needed).
static inline void serve_pp_launch(ServePipeline* p, ServeEngine* e) {
    if (e->num_rows == 0) { return; }
    int M = serve_head_rows(e);
    ServePipeSlot* slot = &p->slots[(p->oldest + p->count) % p->S];
    // the last stage's probabilities may come back while rank 0 still sends: receive them first
    slot->probs_recv = M > 0 ? comm_irecv(&e->comm->pp_group, slot->probs, (size_t)M * e->Vp, p->S - 1,
                                          SERVE_PP_TAG_PROBS, COMM_KIND_PP)
                             : NULL;
    serve_step_broadcast(e, &M);   // stage 0's tp group
    serve_forward(e, e->num_rows);
    serve_pp_send_down(p, e, M);
    slot->num_rows = e->num_rows;
    slot->num_sched = e->num_sched;
    slot->M = M;
    memcpy(slot->sched, e->sched, sizeof(*e->sched) * (size_t)e->num_sched);
    memcpy(slot->sched_last_row, e->sched_last_row, sizeof(int) * (size_t)e->num_sched);
    memcpy(slot->sched_head, e->sched_head, sizeof(int) * (size_t)e->num_sched);
    memcpy(slot->row_pos, e->row_pos, sizeof(int) * (size_t)e->num_rows);
    p->iterations++;
    p->rows += e->num_rows;
    p->count++;
    // read by the HTTP threads' /metrics without the engine's lock: stored atomically
    if (p->count > p->max_in_flight) { __atomic_store_n(&p->max_in_flight, p->count, __ATOMIC_RELAXED); }
    e->num_rows = 0;
}

// World rank 0: whether to wait for the oldest iteration now: S in flight, or none scheduled
// (the requests left are all in flight).
static inline int serve_pp_should_wait(const ServePipeline* p, int scheduled_rows) {
    return p->count == p->S || (scheduled_rows == 0 && p->count > 0);
}

// World rank 0: the oldest iteration's probabilities (no lock needed) ...
static inline void serve_pp_wait_oldest(ServePipeline* p) {
    ServePipeSlot* slot = &p->slots[p->oldest];
    comm_wait(slot->probs_recv);
    slot->probs_recv = NULL;
}

// ... then, under the server's lock, its requests draw (serve_engine_finish_step) and leave
// the flight.
static inline void serve_pp_finish_oldest(ServePipeline* p, ServeEngine* e) {
    ServePipeSlot* slot = &p->slots[p->oldest];
    e->num_rows = slot->num_rows;
    e->num_sched = slot->num_sched;
    memcpy(e->sched, slot->sched, sizeof(*e->sched) * (size_t)slot->num_sched);
    memcpy(e->sched_last_row, slot->sched_last_row, sizeof(int) * (size_t)slot->num_sched);
    memcpy(e->sched_head, slot->sched_head, sizeof(int) * (size_t)slot->num_sched);
    memcpy(e->row_pos, slot->row_pos, sizeof(int) * (size_t)slot->num_rows);
    for (int s = 0; s < slot->num_sched; s++) { slot->sched[s]->in_flight = 0; }
    e->num_in_flight -= slot->num_sched;
    p->head_rows += slot->M;
    __atomic_fetch_add(&p->returned_bytes, (unsigned long long)slot->M * e->Vp * sizeof(float), __ATOMIC_RELAXED);
    float* probs = e->probs;
    e->probs = slot->probs;
    serve_engine_finish_step(e);
    e->probs = probs;
    p->oldest = (p->oldest + 1) % p->S;
    p->count--;
}

// Whether this rank of the last stage runs the head: it is vocabulary-parallel over a tp group
// and the same on the others (the ep ranks', or under --kvp the KVP ranks' replicas of it), so
// the tp group of ep rank 0 (KVP rank 0) runs it.
static inline int serve_pp_runs_head(const Comm* c) { return c->cp > 1 ? c->cp_rank == 0 : c->ep_rank == 0; }

// Every rank but world rank 0: the iterations as they come, until the end.
static inline void serve_pp_follow(ServePipeline* p, ServeEngine* e) {
    int last = p->stage == p->S - 1;
    for (;;) {
        int M = 0;
        if (p->stage == 0) {   // stage 0's tp ranks: rank 0's step by broadcast
            e->num_rows = 0;
            serve_step_broadcast(e, &M);
        } else {
            M = serve_pp_recv_step(p, e);
        }
        if (e->num_rows < 0) {
            if (!last) { serve_pp_send_down(p, e, 0); }
            return;
        }
        serve_forward(e, e->num_rows);
        p->iterations++;
        p->rows += e->num_rows;
        if (!last) {
            serve_pp_send_down(p, e, M);
        } else if (M > 0 && serve_pp_runs_head(e->comm)) {
            e->mem->from_host(e->head_rows_dev, e->head_rows, sizeof(int) * (size_t)M);
            serve_model_head(e->model, e->num_rows, e->head_rows_dev, M, e->probs);
            p->head_rows += M;
            if (e->comm->tp_rank == 0) {   // the whole vocabulary's, gathered: one tp rank sends it back
                serve_pp_send(&e->comm->pp_group, e->probs, (size_t)M * e->Vp, 0, SERVE_PP_TAG_PROBS, COMM_KIND_PP);
            }
        }
        e->num_rows = 0;
    }
}

// World rank 0, with nothing in flight: the end, to stage 0's tp ranks and down the stages.
static inline void serve_pp_stop(ServePipeline* p, ServeEngine* e) {
    int M = 0;
    e->num_rows = -1;
    serve_step_broadcast(e, &M);
    serve_pp_send_down(p, e, 0);
    e->num_rows = 0;
}

#endif // LLMC_SERVE_PIPELINE_H
