/*
 * startup_table.h: the table a run prints before its first step: what it trains, on which
 * ranks and layout, with which data, in how much memory per rank. Every rank takes part in the
 * table's gathers (each stage's activation memory over the pp group, each rank's grid
 * coordinates over the world); world rank 0 prints.
 *
 * It reads trainer.h's Trainer and model_ops.h's BuildInfo; engine.h includes it.
 */
#ifndef LLMC_STARTUP_TABLE_H
#define LLMC_STARTUP_TABLE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/args.h"
#include "llmc/comm.h"
#include "llmc/model.h"
#include "llmc/pipeline.h"
#include "llmc/trainer.h"
#include "llmc/utils.h"
#include "llmc/zero.h"

// The most ranks the table lists with their grid coordinates.
#define TABLE_MAX_LISTED_RANKS 64

// The table (world rank 0 prints it; every rank takes part in its gathers): the model, the rank
// grid, context and expert parallelism, the batch, the pipeline's stages, the data, the memory
// per rank.
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
    float stage_mib = (float)(pipe->slot_bytes / 1048576.0), all_stage_mib[PP_MAX_LISTED_STAGES];
    if (comm->pp <= PP_MAX_LISTED_STAGES) { comm_all_gather(&comm->pp_group, &stage_mib, all_stage_mib, 1, COMM_KIND_OTHER); }
    // every rank's grid coordinates (all-gather, world)
    float coords[4] = {(float)comm->dp_rank, (float)comm->cp_rank, (float)comm->tp_rank, (float)comm->pp_rank};
    float* all_coords = comm->world_size <= TABLE_MAX_LISTED_RANKS ? (float*)malloc_or_die(sizeof(float) * 4 * comm->world_size, "grid") : NULL;
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
    if (comm->cp > 1 && !a->flexsp) {   // (FlexSP forms its own groups in the dp x cp pool)
        printf("| context       %d-way %s: each rank holds stretches r and %d-r of every sequence (%d positions each%s)\n",
               comm->cp, strcmp(a->cp_mode, "a2a") == 0 ? "all-to-all (Ulysses)" : "ring attention", 2 * comm->cp - 1,
               t->T / (2 * comm->cp), a->varlen ? " of a -t sequence; --varlen: R2Z's pieces of each length" : "");
    }
    if (t->moe) {
        size_t active = param_active_count(c), experts = 0;
        for (int u = z->lay.num_units + 1; u < z->lay.num_all; u++) { if (z->lay.params_here[u]) { experts += z->lay.size[u]; } }
        printf("| experts       E=%d per layer, top k=%d, load-balancing alpha %g; %zu active parameters per token "
               "(%.1f%% of P)\n", c->num_experts, c->top_k, c->aux_loss_coef, active, 100.0 * active / P);
        printf("|               expert parallel %d (ep groups of %d data ranks; the experts' gradients reduced over %d "
               "ranks)\n", comm->ep, comm->ep, N * comm->cp / comm->ep);   // edp x cp
        for (int q = 0; q < comm->ep; q++) {
            int El = c->num_experts / comm->ep;
            // every rank holds as many experts: rank 0's bytes are each rank's
            printf("|   ep rank %-3d experts [%d, %d) of each layer = %zu expert parameters; per rank (dense part "
                   "included) params %.1f MiB, grads %.1f MiB, AdamW %.1f MiB\n", q, q * El, (q + 1) * El, experts,
                   mem.params / 1048576, mem.grads / 1048576, mem.optimizer / 1048576);
        }
    }
    if (a->flexsp) {
        int largest = t->flexsp_cost.max_group;
        char groups[96];
        if (largest > 1) { snprintf(groups, sizeof(groups), "1 to %d ranks (a group of several runs %s context parallelism)", largest, a->cp_mode); }
        else { snprintf(groups, sizeof(groups), "one rank%s", t->moe ? " (experts: no context parallelism)" : ""); }
        printf("| batch         --varlen: G=%d sequences of up to T=%d tokens cut at EOT, one per microbatch; --flexsp 1: "
               "rank 0 plans each step's groups of %s in the pool of %d data x context ranks (--flexsp-policy %s, %d "
               "tokens per rank); %lld sequences per epoch\n", t->M, t->T, groups, comm->dpcp_group.size,
               a->flexsp_policy, a->flexsp_tokens ? a->flexsp_tokens : t->T, (long long)t->train_loader.num_seqs);
    } else if (a->varlen) {
        printf("| batch         --varlen: G=%d sequences of up to T=%d tokens cut at EOT, one per microbatch (%d per "
               "data-parallel rank), at most %lld tokens; %lld sequences per epoch\n", t->M, t->T, z->local_microbatches,
               t->total_batch, (long long)t->train_loader.num_seqs);
    } else {
        printf("| batch         B=%d T=%d, %d microbatch(es) per step (%d per data-parallel rank) = %lld tokens\n",
               t->B, t->T, t->M, z->local_microbatches, t->total_batch);
    }
    if (comm->pp > 1) {
        PipelineConfig cfg = pipe->cfg;
        int v = cfg.num_chunks;
        printf("| pipeline      %s over %d stages", a->pp_schedule, comm->pp);
        if (v > 1) { printf(" x %d model chunks", v); }
        printf(", %d microbatches; bubble model %.3f\n", z->local_microbatches, pipeline_bubble_fraction(&cfg));
        PipelineSchedule sch;
        if (pipeline_schedule_build(&sch, &cfg, NULL, 0) != 0) { fatal("internal: the pipeline has no schedule"); }
        for (int st = 0; st < comm->pp && st < PP_MAX_LISTED_STAGES; st++) {
            printf("|   stage %-3d   layers", st);
            int embed = 0, head = 0;
            for (int ch = 0; ch < v; ch++) {
                const ChunkPlace* q = &t->all_places[st * v + ch];
                printf(" [%d, %d)", q->first_layer, q->last_layer);
                embed |= q->has_embedding;
                head |= q->has_head;
            }
            printf("%s%s, peak activations: %d %s, %.1f MiB\n", embed ? " + embeddings" : "", head ? " + head" : "",
                   pipeline_max_in_flight(sch.actions + sch.offset[st], sch.offset[st + 1] - sch.offset[st]),
                   v > 1 ? "(microbatch, chunk) pairs" : "microbatch(es)", all_stage_mib[st]);
        }
        pipeline_schedule_free(&sch);
    }
    train_data_print_summary(a, t->train_steps, &t->train_loader, &t->val_loader, t->val_batches);
    printf("| memory/rank   params %.1f MiB, grads %.1f MiB, AdamW %.1f MiB, activations %.1f MiB\n",
           mem.params / 1048576, mem.grads / 1048576, mem.optimizer / 1048576,
           (pipe->slot_bytes + t->grads_bytes) / 1048576.0);
    if (comm->pp == 1) {
        // with bf16 weights: Megatron's distributed optimizer (fp32 main parameters of the shard,
        // bf16 model parameters whole, zero.h BF16 WEIGHTS)
        static const char* formula[2][4] = {{"16P", "8P + 8P/N", "4P + 12P/N", "16P/N"},
                                            {"18P", "6P + 12P/N", "2P + 16P/N", "16P/N + gathered units"}};
        double paper[2][4] = {{16.0 * P, 8.0 * P + 8.0 * P / z->N, 4.0 * P + 12.0 * P / z->N, 16.0 * P / z->N},
                              {18.0 * P, 6.0 * P + 12.0 * P / z->N, 2.0 * P + 16.0 * P / z->N, 16.0 * P / z->N}};
        int b = z->bf16_weights;
        printf("|               ZeRO paper, fp32 AdamW%s: %s = %.1f MiB (ours: %.1f MiB incl. padding and wte's 2nd "
               "gradient half)\n", b ? " + bf16 weights" : "", formula[b][z->stage], paper[b][z->stage] / 1048576,
               (mem.params + mem.grads + mem.optimizer + mem.weights) / 1048576);
    }
    if (z->bf16_weights) {   // zero.h BF16 WEIGHTS
        if (z->stage <= 2) {
            printf("| bf16 weights  %.0f bytes per rank (every unit, padded: %zu elements), rounded from the fp32 "
                   "parameters once a step%s\n", mem.weights, z->lay.local_weights,
                   z->stage == 0 ? "" : " by their shard's owner and all-gathered in bf16");
        } else {
            printf("| bf16 weights  %.0f bytes per rank (ZeRO-3: %d buffers of the largest unit, %zu elements, each "
                   "unit all-gathered in bf16 when a pass acquires it)\n", mem.weights, z->nwslots, 2 * z->wslot_floats);
        }
    }
    if (build->memory_line) { build->memory_line(); }
    printf("| output        %s\n", a->output_dir ? a->output_dir : "(none)");
    if (t->resume_step >= 0) { printf("| resuming      from step %d\n", t->resume_step); }
    printf("+--------------------------------------------------------------------------+\n");
    fflush(stdout);
}

#endif // LLMC_STARTUP_TABLE_H
