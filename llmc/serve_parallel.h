/*
 * serve_parallel.h: serving across ranks (issue 27): the layout of `mpirun -np N serve_gpt2
 * --tp K --ep Q`, its refusals, and the communicator's groups for it. The model's slices are
 * the trainer's (serve_model.c passes these groups to zero.h and gpt2_init, which cut the
 * column/row-parallel weights, the vocabulary-parallel wte and the experts exactly as in
 * training: tensor_parallel.h, expert_parallel.h); the per-step traffic is serve_engine.h's.
 *
 * With --kvp P (Helix's KV parallelism) the layout is N = P x K instead, --ep Q then dealing
 * the experts over Q ranks of that pool: llmc/serve_kvp.h.
 *
 * THE LAYOUT: N = K x Q ranks, the trainer's grid (comm.h: tensor parallel fastest) with the
 * Q "data-parallel" ranks of each tensor-parallel coordinate as the expert-parallel group
 * (comm_setup_expert_groups). Every rank holds every row of a step: the TP ranks each compute
 * their heads and their slice of the MLP and of the vocabulary, the EP ranks the same rows
 * (attention and the dense parts replicated) with the experts dealt out. In an expert layer
 * each ep rank takes its share of the rows, ceil(N/Q) consecutive ones (rank q's from q
 * ceil(N/Q)), routes them, sends each routed row by all-to-all to its expert's rank and gets
 * its output back (expert_parallel.h), then the shares' outputs are all-gathered over the ep
 * group (train_gpt2.c moe_forward_layer; Megatron's dispatch under sequence parallelism): every
 * routed row is computed once, by its expert's rank, with the one-rank bits (a row's routing
 * and arithmetic are its own). World rank 0 runs the HTTP server and the scheduler and
 * broadcasts each step (serve_step_broadcast); the others follow (serve_engine_follow).
 *
 * THE TRAFFIC per step of N rows, M of them read by the head (K = tp, L layers, C channels,
 * Vl = Vp/K), as this rank sends it (comm.h's accounting; all-reduce of n floats 2(K-1)ceil(n/K)*4):
 *   tp:    (2L + 1) all-reduces of N*C floats (the embedding lookup, then per layer the
 *          attention and MLP row-parallel outputs: Megatron's g), the head's max (M floats)
 *          and its Z and target-logit sums (2M floats); in an expert layer the MLP's
 *          all-reduce is over the rows the rank's experts received instead (one per slot
 *          routed to them, from every ep rank's share)
 *   other: the step broadcast 2 + N*(2 + max_blocks) + M ints from rank 0, the gather of
 *          the probabilities (K-1)*M*Vl*4 (tp_gather_vocab), and with EP per MoE layer the
 *          row count to each other ep rank, (Q-1)*4
 *   ep:    per MoE layer, for this rank's share of the rows: its E/Q slot counts to each other
 *          ep rank, (Q-1)*(E/Q)*4; a position (4) and a row (C*4) per slot routed to another
 *          rank's expert; the rows its experts computed for other ranks' slots, back (C*4
 *          each); its share's output rows to each other ep rank, (Q-1)*ceil(N/Q)*C*4 (the
 *          routing comes from /metrics' serve_expert_slots_total: test_serve_parallel.sh)
 * A decode step of one request is N = M = 1: those bytes per generated token (the row is ep
 * rank 0's share, the other ranks' shares empty).
 *
 * --pp S (llmc/serve_pipeline.h): N = S x Q x K ranks, stage s world ranks s*Q*K .. (s+1)*Q*K - 1
 * (comm_setup_grid's pipeline coordinate, slowest), its Q ep groups of K-rank tp groups as
 * above, each stage its L/S layers and its experts' all-to-alls over its own ep groups; the
 * step goes down the stages with the rows, not by world broadcast. With --kvp P each stage is
 * a pool of P x K ranks instead: N = S x P x K.
 */
#ifndef LLMC_SERVE_PARALLEL_H
#define LLMC_SERVE_PARALLEL_H

#include <stdio.h>
#include "llmc/comm.h"
#include "llmc/model.h"
#include "llmc/serve_kvp.h"
#include "llmc/tensor_parallel.h"

typedef struct { int tp, ep, pp, kvp; } ServeLayout;

// What the model or the world cannot take in this layout, in one line (NULL: none).
static inline const char* serve_layout_problem(const ServeLayout* l, const GPT2Config* c, int world_size, char* why,
                                               size_t n) {
    if (l->pp > 1 && c->num_layers % l->pp != 0) {   // llmc/serve_pipeline.h: L/S layers a stage
        snprintf(why, n, "--pp %d: must divide the model's %d layers", l->pp, c->num_layers);
        return why;
    }
    const char* tp = tp_problem(c, l->tp);
    if (tp) { snprintf(why, n, "--tp %d: %s (model: NH=%d, Vp=%d)", l->tp, tp, c->num_heads, c->padded_vocab_size); return why; }
    if (l->ep > 1 && c->num_experts == 0) {
        snprintf(why, n, "--ep %d: the model has no experts (expected --ep 1 for a dense checkpoint)", l->ep);
        return why;
    }
    if (l->ep > 1 && c->num_experts % l->ep != 0) {
        snprintf(why, n, "--ep %d: must divide the model's %d experts", l->ep, c->num_experts);
        return why;
    }
    // a stage's ranks: the KVP x TP pool (llmc/serve_kvp.h), or the tp groups of the ep group
    int stage = l->kvp > 1 ? l->kvp * l->tp : l->tp * l->ep;
    if (world_size != l->pp * stage) {
        int need = l->pp * stage;
        char dims[96];
        if (l->kvp > 1) { snprintf(dims, sizeof(dims), "--kvp %d x --tp %d", l->kvp, l->tp); }
        else { snprintf(dims, sizeof(dims), "--tp %d x --ep %d", l->tp, l->ep); }
        if (l->pp > 1) { snprintf(why, n, "--pp %d x %s needs %d ranks (mpirun -np %d), got %d", l->pp, dims, need, need, world_size); }
        else { snprintf(why, n, "%s needs %d ranks (mpirun -np %d), got %d", dims, need, need, world_size); }
        return why;
    }
    return NULL;
}

// The groups of the layout: tp groups of K consecutive ranks, then KVP (cp) groups or ep groups
// over the rest.
// Collective over the world.
static inline void serve_layout_setup(Comm* comm, const ServeLayout* l) {
    // --pp: stage s is world ranks s*Q*K .. (s+1)*Q*K - 1; the cp groups: the KVP groups (llmc/serve_kvp.h)
    comm_setup_grid_cp(comm, l->tp, l->kvp, l->pp);
    if (l->ep > 1 && l->kvp > 1) {
        serve_kvp_expert_groups(comm, l->ep);   // Helix's FFN: TP x EP on the pool
    } else if (l->ep > 1) {
        comm_setup_expert_groups(comm, l->ep);
    }
}

#endif // LLMC_SERVE_PARALLEL_H
