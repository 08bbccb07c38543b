/*
 * expert_parallel.h: expert parallelism (--ep Q), Megatron's and DeepSpeed's: the E experts of
 * every mixture-of-experts layer (llmc/moe.h) are split over the Q ranks of an expert-parallel
 * (ep) group carved from the data-parallel group (comm.h comm_setup_expert_groups), E/Q whole
 * experts each: rank q holds experts [q*E/Q, (q+1)*E/Q). Attention, the layernorms and the
 * router stay data-parallel. Each rank routes its own microbatch; the slots go to their
 * experts' ranks and come back:
 *
 *   1. counts   all-to-all (ep group): rank q tells rank r how many of its slots go to each of
 *               r's experts (E/Q ints), then the positions of those slots in its microbatch
 *               (the expert needs them for its gradient's canonical order)
 *   2. tokens   all-to-all (ep group) of the dispatch rows (sorted by expert, then position:
 *               one contiguous block per destination rank)
 *   3. experts  each local expert runs its MLP as one matmul over the rows it received from
 *               every source (the grouped matmul), rows put in expert-major order
 *   4. back     all-to-all (ep group) of the expert outputs, the reverse counts
 * and the backward mirrors it: the output gradients go out as the tokens did (2), the input
 * gradients come back (4).
 *
 * THE GRADIENT ORDER. An expert's weight gradient is R3 over the positions routed to it in the
 * canonical order of the global batch (moe.h). Rows from each source microbatch keep their
 * position order and are reduced as one R3 subtree into a slice of their own; the slices are
 * the leaves of the same trees every other gradient goes through (zero.h): with ZeRO 2-3 the
 * ranks' i-th microbatches are the consecutive global microbatches i*N + (ep group)*Q + q, so
 * the Q slices are combined at once (the R1 tree over sources) and reduce-scattered over the
 * expert-data-parallel (edp) group; with ZeRO 0-1 rank d holds the consecutive microbatches
 * d*M/N ..., so each slice keeps its own tree over local microbatches until the step's end,
 * then the slices' tree, then the edp reduction. Either way the bits are one rank's.
 *
 * Under tensor parallelism the expert matrices are split inside each expert as the dense MLP
 * (fc column-parallel, fcproj row-parallel, Megatron's expert tensor parallelism); every
 * tensor-parallel rank routes the same positions and exchanges the same rows with its
 * counterpart (same tp rank) of the other ep ranks; an expert's partial outputs and input
 * gradients are all-reduced over the tensor-parallel group at the expert, per row (the dense
 * MLP's g forward and f backward, tensor_parallel.h).
 */
#ifndef LLMC_EXPERT_PARALLEL_H
#define LLMC_EXPERT_PARALLEL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "llmc/comm.h"
#include "llmc/moe.h"
#include "llmc/utils.h"

// The routing of one microbatch through one layer, kept from its forward to its backward
// (host memory; the buffers grow to the largest routing seen).
typedef struct {
    int BT, k, E, Q, El;
    // this rank's microbatch (the source)
    int* chosen;        // (BT*k) the router's choice
    int* count;         // (E) slots routed to each expert
    int* row_pos;       // (BT*k) position of each dispatch row (sorted by expert, then position)
    int* slot_row;      // (BT*k) dispatch row of each slot
    int* cursor;        // (E) scratch
    size_t* send_rows;  // (Q) dispatch rows to each ep rank
    // this rank's experts
    int* recv_count;    // (Q*El) rows from source q for local expert e
    size_t* recv_rows;  // (Q) rows from each source
    int n_recv;
    int* recv_pos;      // (n_recv) their positions in the source's microbatch
    int* perm;          // (n_recv) work row -> received row
    int* inv;           // (n_recv) received row -> work row
    int* first;         // (El + 1) each local expert's first work row
    int* leaf;          // (El x (Q*B*8 + 1)) the R3 leaves of each expert's rows (moe.h)
    int* send_T;        // (Q) this pass's T, for each rank of the group
    int* src_T;         // (Q) each source's T (--varlen: microbatches of different lengths)
    int cap_recv;       // capacity of recv_pos, perm, inv
} MoeRoute;

static inline void moe_route_init(MoeRoute* r, int BT, int k, int E, int Q, int B) {
    memset(r, 0, sizeof(*r));
    r->BT = BT; r->k = k; r->E = E; r->Q = Q; r->El = E / Q;
    size_t slots = (size_t)BT * k;
    r->chosen = (int*)malloc_or_die(sizeof(int) * slots, "routing");
    r->count = (int*)malloc_or_die(sizeof(int) * (size_t)E, "routing");
    r->row_pos = (int*)malloc_or_die(sizeof(int) * slots, "routing");
    r->slot_row = (int*)malloc_or_die(sizeof(int) * slots, "routing");
    r->cursor = (int*)malloc_or_die(sizeof(int) * (size_t)E, "routing");
    r->send_rows = (size_t*)malloc_or_die(sizeof(size_t) * (size_t)Q, "routing");
    r->recv_count = (int*)malloc_or_die(sizeof(int) * (size_t)E, "routing");
    r->recv_rows = (size_t*)malloc_or_die(sizeof(size_t) * (size_t)Q, "routing");
    r->first = (int*)malloc_or_die(sizeof(int) * ((size_t)r->El + 1), "routing");
    r->leaf = (int*)malloc_or_die(sizeof(int) * (size_t)r->El * ((size_t)Q * B * CANON_R + 1), "routing");
    r->send_T = (int*)malloc_or_die(sizeof(int) * (size_t)Q, "routing");
    r->src_T = (int*)malloc_or_die(sizeof(int) * (size_t)Q, "routing");
}

static inline void moe_route_free(MoeRoute* r) {
    void* all[] = {r->chosen, r->count, r->row_pos, r->slot_row, r->cursor, r->send_rows, r->recv_count,
                   r->recv_rows, r->recv_pos, r->perm, r->inv, r->first, r->leaf, r->send_T, r->src_T};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) { free(all[i]); }
    memset(r, 0, sizeof(*r));
}

// The plan of a microbatch of B sequences of T positions whose choice is in r->chosen: the
// dispatch rows, then (ep group) the counts and positions each rank receives, and the expert-
// major order of the rows received. Every rank of the ep group calls it for the same layer.
static inline void moe_route_plan(MoeRoute* r, CommGroup* ep, int B, int T) {
    int Q = r->Q, El = r->El;
    r->BT = B * T;   // this pass's positions (up to the capacity of moe_route_init)
    moe_plan_routes(r->chosen, B, T, r->k, r->E, r->count, r->row_pos, r->slot_row, r->cursor);
    size_t* per = (size_t*)malloc_or_die(sizeof(size_t) * 2 * (size_t)Q, "routing");
    for (int q = 0; q < Q; q++) {
        r->send_rows[q] = 0;
        for (int e = 0; e < El; e++) { r->send_rows[q] += (size_t)r->count[q * El + e]; }
        per[q] = (size_t)El;
    }
    // all-to-all (ep group): each rank's slot counts for each of my experts
    comm_all_to_all_ints(ep, r->count, per, r->recv_count, per, COMM_KIND_EP);
    free(per);
    r->n_recv = 0;
    for (int q = 0; q < Q; q++) {
        r->recv_rows[q] = 0;
        for (int e = 0; e < El; e++) { r->recv_rows[q] += (size_t)r->recv_count[q * El + e]; }
        r->n_recv += (int)r->recv_rows[q];
    }
    if (r->n_recv > r->cap_recv) {
        free(r->recv_pos); free(r->perm); free(r->inv);
        r->cap_recv = r->n_recv;
        r->recv_pos = (int*)malloc_or_die(sizeof(int) * (size_t)r->n_recv, "routing");
        r->perm = (int*)malloc_or_die(sizeof(int) * (size_t)r->n_recv, "routing");
        r->inv = (int*)malloc_or_die(sizeof(int) * (size_t)r->n_recv, "routing");
    }
    // all-to-all (ep group): the positions of the rows each rank will receive
    comm_all_to_all_ints(ep, r->row_pos, r->send_rows, r->recv_pos, r->recv_rows, COMM_KIND_EP);
    // all-to-all (ep group): each source's T, which places its positions in their R3 leaves
    // (one int per rank, counted as other traffic: the experts' bytes are the rows and counts)
    size_t* one = (size_t*)malloc_or_die(sizeof(size_t) * (size_t)Q, "routing");
    for (int q = 0; q < Q; q++) { r->send_T[q] = T; one[q] = 1; }
    comm_all_to_all_ints(ep, r->send_T, one, r->src_T, one, COMM_KIND_OTHER);
    free(one);
    moe_plan_experts_sources(r->recv_count, r->recv_pos, Q, El, B, r->src_T, r->perm, r->inv, r->first, r->leaf);
}

// all-to-all (ep group) of rows of C floats: send_rows[q] rows to rank q, recv_rows[q] from it.
static inline void moe_route_exchange(const MoeRoute* r, CommGroup* ep, const float* send, const size_t* send_rows,
                                      float* recv, const size_t* recv_rows, int C) {
    size_t sc[64] = {0}, rc[64] = {0};   // initialised only to quiet gcc's -Wmaybe-uninitialized
    size_t *s = r->Q <= 64 ? sc : (size_t*)malloc_or_die(sizeof(size_t) * 2 * (size_t)r->Q, "routing");
    size_t *rr = r->Q <= 64 ? rc : s + r->Q;
    for (int q = 0; q < r->Q; q++) { s[q] = send_rows[q] * (size_t)C; rr[q] = recv_rows[q] * (size_t)C; }
    comm_all_to_all_v(ep, send, s, recv, rr, COMM_KIND_EP);
    if (s != sc) { free(s); }
}

// The dispatch rows (BT*k, C) to their experts' ranks, received source-major (n_recv, C);
// forward's tokens and backward's output gradients.
static inline void moe_route_dispatch(const MoeRoute* r, CommGroup* ep, const float* send, float* recv, int C) {
    moe_route_exchange(r, ep, send, r->send_rows, recv, r->recv_rows, C);
}

// The experts' rows (n_recv, C, source-major) back to their sources, in dispatch-row order
// (BT*k, C); forward's outputs and backward's input gradients.
static inline void moe_route_return(const MoeRoute* r, CommGroup* ep, const float* send, float* recv, int C) {
    moe_route_exchange(r, ep, send, r->recv_rows, recv, r->send_rows, C);
}

// Serving's expert layers across ep ranks that hold the same rows (train_gpt2.c
// moe_forward_layer): each rank's share of `share` rows of C floats, at its place in rows (ep
// x share, C), all-gathered (ep group) in rank order: every rank gets the rows in order.
static inline void moe_gather_row_shares(CommGroup* ep, float* rows, size_t share, int C) {
    comm_all_gather(ep, rows + (size_t)ep->rank * share * C, rows, share * C, COMM_KIND_EP);
}

// Rows this rank sent to and received from the other ranks of its ep group in one exchange.
static inline void moe_route_remote_rows(const MoeRoute* r, int ep_rank, long long* out, long long* in) {
    *out = *in = 0;
    for (int q = 0; q < r->Q; q++) {
        if (q == ep_rank) { continue; }
        *out += (long long)r->send_rows[q];
        *in += (long long)r->recv_rows[q];
    }
}

// What a model with experts tells the engine (ModelOps.moe_counters): its stage's routing since
// the last reset.
typedef struct {
    int layers, experts, first_layer;
    double* tokens;          // (layers x E) slots this rank's microbatches routed to each expert
    long long passes;        // forward passes through a mixture-of-experts layer
    long long rows_out;      // forward dispatch rows sent to other ep ranks
    long long rows_in;       // forward dispatch rows received from other ep ranks
} MoeCounters;

// ---- the step's statistics (what the trainer prints and logs) ----------------------------

// Zeroes the routing counters of a rank's chunks (counters[ch]; NULL: a chunk without experts)
// at the start of a step.
static inline void moe_counters_reset(MoeCounters* const* counters, int nchunks) {
    for (int ch = 0; ch < nchunks; ch++) {
        MoeCounters* ct = counters[ch];
        if (ct == NULL) { continue; }
        memset(ct->tokens, 0, sizeof(double) * (size_t)ct->layers * ct->experts);
        ct->passes = ct->rows_out = ct->rows_in = 0;
    }
}

// The all-to-all traffic of a rank's chunks in the step (passes, rows out and in; no tokens).
static inline MoeCounters moe_counters_total(MoeCounters* const* counters, int nchunks) {
    MoeCounters total;
    memset(&total, 0, sizeof(total));
    for (int ch = 0; ch < nchunks; ch++) {
        const MoeCounters* ct = counters[ch];
        if (ct == NULL) { continue; }
        total.rows_out += ct->rows_out;
        total.rows_in += ct->rows_in;
        total.passes += ct->passes;
    }
    return total;
}

// The fewest and the most slots routed to one expert of one layer (of L, with E experts each)
// in the step, over every rank's microbatches: the rank's counts (its chunks') summed over the
// ranks that hold different sequences (all-reduce, `data`: the dp group, or with context
// parallelism data x context ranks, each sequence counted by one rank of its context group),
// then the stages' layers into one table (all-reduce, pp group; each layer is held by one
// stage; integers below 2^24 are exact in floats).
static inline void moe_expert_loads(MoeCounters* const* counters, int nchunks, int L, int E, CommGroup* data,
                                    CommGroup* pp, double* lo, double* hi) {
    float* all = (float*)calloc_or_die((size_t)L * E, sizeof(float), "expert loads");
    for (int ch = 0; ch < nchunks; ch++) {
        const MoeCounters* ct = counters[ch];
        for (int l = 0; ct && l < ct->layers; l++) {
            for (int e = 0; e < E; e++) { all[(size_t)(ct->first_layer + l) * E + e] = (float)ct->tokens[(size_t)l * E + e]; }
        }
    }
    comm_all_reduce_sum(data, all, (size_t)L * E, COMM_KIND_OTHER);
    comm_all_reduce_sum(pp, all, (size_t)L * E, COMM_KIND_OTHER);
    *lo = *hi = all[0];
    for (size_t i = 1; i < (size_t)L * E; i++) {
        if (all[i] < *lo) { *lo = all[i]; }
        if (all[i] > *hi) { *hi = all[i]; }
    }
    free(all);
}

// The step's load-balancing loss of each microbatch, logged beside the cross-entropy (the
// trainer's global_mean_loss takes their mean): per microbatch the sum over the layers in layer
// order. aux (microbatches x L) holds this stage's layers, -0.0f for the others; every stage's
// layers are summed into one table (all-reduce, pp group: each value is held by one stage,
// -0.0f elsewhere, exact).
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

#endif // LLMC_EXPERT_PARALLEL_H
