/*
 * engine.h: the training engine both builds share. Everything that is not a kernel or the model
 * is here or in a header it includes, written once: the start of a run (flags, the rank grid,
 * what the model starts from, data, resume), the pipeline executor (llmc/pipeline_executor.h:
 * every run is a pipeline, of one stage without --pp), validation, sampling, checkpoints, the
 * training loop and its console and main.log lines.
 *
 * A build hands the engine two tables:
 *   ModelOps (model_ops.h) its model of one model chunk (a pipeline stage, or one of a stage's
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
 *   trainer_run(&t, &build);                            // table, the loop, the summary:
 *                                                       // trainer_step, trainer_report_step,
 *                                                       // trainer_print_summary
 *   trainer_end(&t);
 */
#ifndef LLMC_ENGINE_H
#define LLMC_ENGINE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
#include "llmc/context_parallel.h"
#include "llmc/expert_parallel.h"
#include "llmc/model_ops.h"
#include "llmc/pipeline_executor.h"
#include "llmc/trainer.h"
#include "llmc/startup_table.h"

// The cost of the head (LM head matmuls and cross-entropy) in units of one transformer
// layer, per token: the LM head is 2*C*Vp flops forward, a layer about 24*C^2.
static inline double head_cost_in_layers(const GPT2Config* c) {
    return (double)c->padded_vocab_size / (12.0 * c->channels);
}


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

// The largest group FlexSP's plans use on a pool of N with -t T: a power of two that divides
// the pool (comm_setup_pool_groups' sub-groups), splits a sequence at most CANON_R ways
// (context_parallel.h), of which 2 x its ranks divide -t (cp_problem: the activations and the
// ring's blocks are laid out for -t) and, with --cp-mode a2a, its ranks divide the NH heads.
static inline int trainer_flexsp_max_group(int N, int T, int a2a, int NH) {
    int g = 1;
    while (2 * g <= CANON_R && N % (2 * g) == 0 && T % (4 * g) == 0 && (!a2a || NH % (2 * g) == 0)) { g *= 2; }
    return g;
}

// The cost model the trainer plans FlexSP's steps with: FlexSP's published computation
// coefficients (varlen_flexsp.h; this machine's fit, make bench-flexsp, is noisy and its
// per-sequence constant has no place in the model), groups up to max_group ranks, and memory
// per sequence (per_sequence: the engine runs a group's sequences one pass at a time): a
// sequence of s tokens needs a group of g ranks with g x budget >= s, budget the tokens one
// rank holds (--flexsp-tokens).
static inline FlexCost trainer_flexsp_cost(int budget, int max_group) {
    FlexCost c = flexsp_cost_gpt7b();
    c.params = 0;
    c.act_per_token = 1;
    c.device_bytes = budget;
    c.per_sequence = 1;
    c.max_group = max_group;
    return c;
}

// The longest sequence a FlexSP group of g ranks runs: what their memories hold together
// (g x --flexsp-tokens, the planner's bound: trainer_flexsp_cost), at most -t. The model sizes
// each group's buffers, and the activations, for it (ModelOps.cp_select).
static inline int trainer_flexsp_longest(const Trainer* t, int g) {
    long long longest = (long long)g * t->flexsp_cost.device_bytes;
    return longest < t->T ? (int)longest : t->T;
}

// The passes that follow run over this rank's FlexSP group of g ranks (its pool sub-group; 1:
// each sequence whole on this rank). Nothing to select when the plans use groups of one only.
static inline void trainer_flexsp_select(Trainer* t, int g) {
    if (t->flexsp_cost.max_group <= 1) { return; }
    t->ops->cp_select(t->models[0], &t->comm.pool_groups[flexsp_log2(g)], trainer_flexsp_longest(t, g));
}

// --flexsp 1 runs over the pool of data x context ranks (the dp x cp group: --cp N only makes
// the pool N times larger, FlexSP forming its own groups in it) with any ZeRO stage, each group
// of several ranks with context parallelism over its pool sub-group (README; with experts, each
// expert layer on whole sequences on every member, as --cp runs them); every other layout is
// refused in one line. Makes the pool's sub-groups (collective over the world).
static inline void trainer_check_flexsp(Trainer* t) {
    const TrainArgs* a = &t->args;
    int N = t->comm.dpcp_group.size, budget = a->flexsp_tokens ? a->flexsp_tokens : t->T;
    if (!a->varlen) { fatal("--flexsp 1: FlexSP plans a step of variable-length sequences; it needs --varlen G"); }
    if (a->tp > 1 || a->pp > 1 || a->ep > 1) {
        fatal("--flexsp 1: FlexSP's pool is the data x context ranks; --tp %d --pp %d --ep %d: use 1 for each", a->tp,
              a->pp, a->ep);
    }
    int a2a = strcmp(a->cp_mode, "a2a") == 0;
    int largest = trainer_flexsp_max_group(N, t->T, a2a, t->config.num_heads);
    if ((long long)budget * largest < t->T) {
        fatal("--flexsp-tokens %d: a sequence of -t %d tokens does not fit the memory of the pool's largest group "
              "(%d rank(s) x %d tokens; a group is a power of two of at most %d ranks that divides the pool of %d, "
              "2 x its ranks divide -t%s); raise --flexsp-tokens or lower -t", budget, t->T, largest, budget,
              CANON_R, N, a2a ? " and its ranks the heads (--cp-mode a2a)" : "");
    }
    t->flexsp_cost = trainer_flexsp_cost(budget, largest);
    comm_setup_pool_groups(&t->comm);
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
    // dualpipe's two chunks per rank are copies of the S stages' (pipeline.h)
    int virtual_stages = t->pp_kind == PP_DUALPIPE ? a->pp : a->pp * t->nchunks;
    if (virtual_stages > c->num_layers) {
        fatal("--pp %d x %d model chunks (--schedule %s) = %d virtual stages: the model has only %d layers; every "
              "virtual stage needs at least one", a->pp, t->nchunks, a->pp_schedule, virtual_stages, c->num_layers);
    }
    if (a->sp && t->T % (2 * a->tp) != 0) {
        fatal("--sp 1: the sequence length -t %d must be a multiple of 2 x --tp %d (each rank holds two stretches "
              "of every sequence)", t->T, a->tp);
    }
    t->config.aux_loss_coef = a->aux_loss;
    t->moe = c->num_experts > 0;
    if (t->moe && a->cp > 1 && a->sp) {
        fatal("--cp %d with --sp 1: a mixture-of-experts model does not combine context and sequence parallelism "
              "yet; use --sp 0 or --cp 1", a->cp);
    }
    if (a->ep > 1 && !t->moe) {
        fatal("--ep %d: expert parallelism needs a mixture-of-experts model (-e with eE, e.g. d4e8k2, or a version 7 file)", a->ep);
    }
    if (t->moe && c->num_experts % a->ep != 0) {
        fatal("--ep %d: the %d experts per layer must split evenly over the expert-parallel ranks", a->ep, c->num_experts);
    }
    if (a->ep > 1) { comm_setup_expert_groups(&t->comm, a->ep); }
    if (a->flexsp) { trainer_check_flexsp(t); }
    if (a->varlen) {   // one sequence per microbatch: the step's G sequences are its M = G microbatches
        if (a->total_batch != -1) {
            fatal("-d: a --varlen step is G = %d sequences (their targets weigh the loss); leave out -d", a->varlen);
        }
        if (a->varlen % N != 0) {
            fatal("--varlen %d: the G sequences of a step must split evenly over the %d data-parallel ranks", a->varlen, N);
        }
        t->B = 1;
    }
    t->tokens_per_micro = (long long)t->B * t->T;
    t->total_batch = a->varlen ? (long long)a->varlen * t->T : a->total_batch == -1 ? t->tokens_per_micro * N : a->total_batch;
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

// <|endoftext|>: GPT-2's 50256, or the last id of a smaller vocabulary
static inline int trainer_eot_token(int V) { return V > 50256 ? 50256 : V - 1; }

// --prompt "id,id,...": the token ids into prompt (room for genT, which the prompt must leave one
// position of); none: <|endoftext|> (GPT-2's 50256, or V - 1 for a smaller vocabulary).
// Returns the prompt's length.
static inline int trainer_parse_prompt(const char* text, int* prompt, int genT, int V) {
    if (text == NULL) {
        prompt[0] = trainer_eot_token(V);
        return 1;
    }
    int n = 0;
    const char* p = text;
    for (;;) {
        char* end;
        long id = strtol(p, &end, 10);
        if (end == p || id < 0 || id >= V) {
            fatal("--prompt: expected comma-separated token ids in [0, %d), got '%s'", V, text);
        }
        if (n + 1 >= genT) { fatal("--prompt: %s has %d or more tokens; -g %d leaves room for %d", text, n + 1, genT, genT - 1); }
        prompt[n++] = (int)id;
        if (*end == '\0') { return n; }
        if (*end != ',') { fatal("--prompt: expected comma-separated token ids in [0, %d), got '%s'", V, text); }
        p = end + 1;
    }
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
    ChunkPlace* all = (ChunkPlace*)malloc_or_die(sizeof(ChunkPlace) * S * v, "placement");
    char err[256];
    if (pipeline_place_layers(&cfg, c->num_layers, 0.0, head_cost_in_layers(c), all, err, sizeof(err)) != 0) {
        fatal("--pp: %s", err);
    }
    t->all_places = all;
    t->places = all + (size_t)comm->pp_rank * v;
    for (int k = 0; k < S * v; k++) { if (all[k].has_head) { t->head_stage = k / v; } }
    zero_init_ep(&t->zero, c, mem, a->zero_stage, &comm->dp_group, &comm->dpcp_group, comm->ep > 1 ? &comm->ep_group : NULL,
                 comm->ep > 1 ? &comm->edp_group : NULL, &comm->pp_group, &comm->tp_group, t->places, v,
                 t->head_stage, t->start_params, ops->weight_elem_bytes, t->M);
    t->zero.flexsp = a->flexsp;
    if (a->flexsp) { t->flexsp_line = (char*)calloc_or_die(4096, 1, "FlexSP line"); }
    if (t->pp_kind == PP_DUALPIPE) {   // each stage's chunks on this rank and its mirror (pipeline.h)
        int first[2], count[2];
        for (int ch = 0; ch < v; ch++) { pipeline_chunk_microbatches(&cfg, comm->pp_rank, ch, &first[ch], &count[ch]); }
        zero_set_mirror(&t->zero, S - 1 - comm->pp_rank, first, count);
    }
    free(t->start_params);
    t->start_params = NULL;
    t->models = (void**)malloc_or_die(sizeof(void*) * v, "models");
    // FlexSP: the model is made for context parallelism over the pool's largest sub-group a
    // plan uses (its buffers, and activations laid out by length); each sequence of a step
    // then selects its own group's (trainer_flexsp_step)
    int flexsp_largest = a->flexsp ? t->flexsp_cost.max_group : 1;
    CommGroup* cp_group = a->flexsp ? &comm->pool_groups[flexsp_log2(flexsp_largest)] : &comm->cp_group;
    if (flexsp_largest > 1 && ops->cp_select == NULL) {
        fatal("internal: --flexsp 1's groups of several ranks need the model's cp_select (fast mode refuses --varlen)");
    }
    for (int ch = 0; ch < v; ch++) {
        t->models[ch] = ops->create(c, &t->places[ch], &t->zero, &comm->tp_group, cp_group,
                                    strcmp(a->cp_mode, "a2a") == 0, a->sp, B, T);
    }
    // every pool sub-group's buffers now, before the activations, which hold a pass over any
    // of them: each group's sequences up to what its ranks hold together (the largest selected
    // last)
    for (int k = 0; flexsp_largest > 1 && k <= flexsp_log2(flexsp_largest); k++) {
        trainer_flexsp_select(t, 1 << k);
    }

    t->do_val = a->val_every > 0;
    train_data_open(a, B, T, c->vocab_size, t->total_batch, &t->train_loader, &t->val_loader, &t->val_batches,
                    &t->train_steps);
    t->schedule = (LRSchedule){t->lr_kind, a->lr, a->warmup, t->train_steps, a->final_lr_frac};
    // only world rank 0 prints samples, and a run that never samples needs no tokenizer (a
    // corrupt one must not stop it)
    if (t->root && a->sample_every > 0) { tokenizer_init_for_model(&t->tokenizer, a->tokenizer_path, c->vocab_size); }

    // the ranks that split a sequence: the cp group (its tp ranks with SP); under FlexSP each
    // sequence's own group (one stage: the executor's message buffers, sized by the cp group's
    // split, carry nothing)
    ZzGroup split = {comm->cp, a->sp ? comm->tp : 1, comm->cp_rank, comm->tp_rank};
    int splits = a->flexsp ? flexsp_largest : split.N * split.K;
    // --varlen with CP or SP (or FlexSP's groups): each sequence split or whole by its length
    // (context_parallel.h)
    SeqSplit layout = splits == 1 ? SEQS_WHOLE : a->varlen ? SEQS_SPLIT_BY_LENGTH : SEQS_SPLIT;
    pipeline_init(&t->pipe, ops, mem, t->models, t->places, &comm->pp_group, t->pp_kind, v,
                  t->zero.local_microbatches, B, T, c->channels, a->recompute, split, layout);
    t->grads = ops->grads_create(t->models[0], B, T, layout, &t->grads_bytes);
    if (flexsp_largest > 1) { trainer_flexsp_select(t, 1); }
    if (t->moe) {   // each local microbatch's aux losses (FlexSP: a rank may run all G = M sequences)
        size_t micro = (size_t)(a->flexsp ? t->M : t->zero.local_microbatches), n = micro * c->num_layers;
        t->pipe.num_layers = c->num_layers;
        t->pipe.moe_aux = (float*)malloc_or_die(sizeof(float) * n, "aux losses");
        for (size_t k = 0; k < n; k++) { t->pipe.moe_aux[k] = -0.0f; }
        t->moe_micro_aux = (float*)calloc_or_die(micro + 1, sizeof(float), "aux losses");
        t->moe_counters = (MoeCounters**)malloc_or_die(sizeof(MoeCounters*) * v, "routing counters");
        for (int ch = 0; ch < v; ch++) { t->moe_counters[ch] = ops->moe_counters(t->models[ch]); }
    }
    t->genT = a->gen_T < c->max_seq_len ? a->gen_T : c->max_seq_len;
    t->sample_prompt = (int*)malloc_or_die(sizeof(int) * t->genT, "sample prompt");
    t->sample_prompt_len = trainer_parse_prompt(a->sample_prompt, t->sample_prompt, t->genT, c->vocab_size);
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

// Validation loss over the first val_batches microbatches of the val data (with --varlen its
// first val_batches sequences): batch j is done by dp rank j % N (through the pipeline), the
// batch sums are summed in batch order and divided by their targets.
static inline float trainer_validate(Trainer* t) {
    Zero* z = &t->zero;
    int B = t->B, batches = t->val_batches;
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
        int Tj = t->val_loader.loaded_T;   // T, or the --varlen sequence's length
        pipeline_forward_pass(&t->pipe, acts, t->val_loader.inputs, t->val_loader.targets, B, Tj,
                              t->config.channels, 1, -1);
        if (hc >= 0 && j < batches) { local[k] = t->ops->loss_sum(t->models[hc], acts[hc], B, Tj); }
    }
    float loss = global_mean_loss(t, local, per_rank, batches, 1, (double)dataloader_targets(&t->val_loader, 0, batches));
    free(local);
    free(acts);
    return loss;
}

// Samples the tokens after the prompt (--prompt, or <|endoftext|>) up to genT with xorshift
// seeded 1337 (llm.c's sampler, with
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
    for (int i = 0; i < genT; i++) { gen[i] = trainer_eot_token(V); }
    memcpy(gen, t->sample_prompt, sizeof(int) * t->sample_prompt_len);
    if (printing) { printf("generating:\n---\n"); }
    for (int pos = 1; pos < genT; pos++) {
        int kv = t->ops->layers_decode && t->args.kv_cache;
        pipeline_forward_pass(&t->pipe, t->sample_acts, gen, NULL, 1, genT, C, 0, kv ? pos - 1 : -1);
        if (pos < t->sample_prompt_len) { continue; }   // the prompt's rows only fill the cache
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

// ---- the loop ----------------------------------------------------------------------------

// LLMC_DUALPIPE_DUMP=DIR (a debugging aid; test_pp_dualpipe.sh compares the files): under
// dualpipe every rank writes what it holds after step `step`'s update, its fp32 parameters
// (zero_params_sharded: its shards) then AdamW's m and v, to DIR/copy_STEP_dpD_cpC_tpT_ppS.bin.
// The two copies of a stage, pp S and pp S-1-S, hold the same layout, so their files must be
// the same bytes.
static inline void trainer_dump_copy(Trainer* t, int step) {
    const char* dir = getenv("LLMC_DUALPIPE_DUMP");
    if (dir == NULL || t->pp_kind != PP_DUALPIPE) { return; }
    const Zero* z = &t->zero;
    const Comm* comm = &t->comm;
    size_t n = zero_params_sharded(z) ? z->lay.shard_params : z->lay.local_params;
    float* host = (float*)host_alloc((n + 2 * z->opt_len + 1) * sizeof(float), "copy dump");
    t->mem->to_host(host, zero_params_sharded(z) ? z->param_shard : z->params, n * sizeof(float));
    t->mem->to_host(host + n, z->m, z->opt_len * sizeof(float));
    t->mem->to_host(host + n + z->opt_len, z->v, z->opt_len * sizeof(float));
    char path[1200];
    snprintf(path, sizeof(path), "%s/copy_%08d_dp%d_cp%d_tp%d_pp%d.bin", dir, step, comm->dp_rank, comm->cp_rank,
             comm->tp_rank, comm->pp_rank);
    FILE* f = fopen(path, "wb");
    if (f == NULL || fwrite(host, sizeof(float), n + 2 * z->opt_len, f) != n + 2 * z->opt_len || fclose(f) != 0) {
        fatal("LLMC_DUALPIPE_DUMP: cannot write '%s'", path);
    }
    free(host);
}

// --varlen: the lengths of this rank's sequences in the step just run (malloc'd, one per local
// microbatch).
static inline int* trainer_step_lengths(const Trainer* t) {
    int n = t->zero.local_microbatches, *lengths = (int*)malloc_or_die(sizeof(int) * n, "lengths");
    int64_t first_micro = t->progress.microbatches_done - t->M;
    for (int i = 0; i < n; i++) {
        int64_t g = t->args.overfit_single_batch ? 0 : zero_global_microbatch(&t->zero, first_micro, i);
        lengths[i] = dataloader_length((DataLoader*)&t->train_loader, g);
    }
    return lengths;
}

// --varlen with CP or SP: how this rank's sequences of the step just run were split
// (context_parallel.h, VARIABLE LENGTHS): into D = cp x tp (with SP) equal stretches; with SP,
// over the cp group alone in equal stretches (a multiple of 2 x cp, not of 2D); over the cp
// group in R2Z's unequal pieces; or not at all.
static inline void trainer_print_varlen_split(const Trainer* t) {
    int n = t->zero.local_microbatches, N = t->comm.cp, D = trainer_sequence_split(t), *lengths = trainer_step_lengths(t);
    int equal = 0, cp_equal = 0, unequal = 0;
    for (int i = 0; i < n; i++) {
        int cp_split, seq_split;
        zz_split_length(N, D / N, lengths[i], &cp_split, &seq_split);
        if (zz_splits_length(D, lengths[i])) { equal++; }
        else if (cp_split > 1 && zz_splits_length(N, lengths[i])) { cp_equal++; }
        else if (cp_split > 1) { unequal++; }
    }
    free(lengths);
    char by_cp[160] = "";   // the cp group's own splits (none without context parallelism)
    if (N > 1 && D > N) {
        snprintf(by_cp, sizeof(by_cp), ", %d %d ways (the cp group alone) in equal stretches, %d %d ways in R2Z's unequal "
                 "pieces", cp_equal, N, unequal, N);
    } else if (N > 1) {
        snprintf(by_cp, sizeof(by_cp), ", %d %d ways in R2Z's unequal pieces", unequal, N);
    }
    printf("varlen split: %d of this rank's %d sequences split %d ways in equal stretches (a multiple of 2 x %d)%s, "
           "%d computed whole by every rank\n", equal, n, D, D, by_cp, n - equal - cp_equal - unequal);
}

// Context parallelism's bytes this rank sent in the step, against cp_bytes_per_step for this
// rank's chunks.
static inline void trainer_print_cp_accounting(const Trainer* t) {
    const Comm* comm = &t->comm;
    int a2a = strcmp(t->args.cp_mode, "a2a") == 0, layers = 0, first = 0, last = 0;
    for (int ch = 0; ch < t->nchunks; ch++) {
        layers += t->places[ch].last_layer - t->places[ch].first_layer;
        first |= t->places[ch].has_embedding;
        last |= t->places[ch].has_head;
    }
    // the attention, embedding and expert layers' messages in the model's activation type (bf16
    // in fast mode)
    int elem = (int)t->ops->stage_elem_bytes;
    uint64_t want = cp_bytes_per_step(comm->cp, comm->cp_rank, a2a, layers, first, last, t->B, t->T, t->config.channels,
                                      comm->tp, t->zero.local_microbatches, elem);
    if (t->moe) {
        want += cp_moe_bytes_per_step(comm->cp, comm->cp_rank, layers, t->B, t->T, t->config.channels,
                                      t->zero.local_microbatches, elem);
    }
    if (t->args.varlen) {
        int n = t->zero.local_microbatches, *lengths = trainer_step_lengths(t);
        want = cp_bytes_per_varlen_step(comm->cp, trainer_sequence_split(t) / comm->cp, comm->cp_rank, a2a, t->moe,
                                        layers, first, last, lengths, n, t->config.channels, comm->tp);
        free(lengths);
    }
    uint64_t got = comm->stats.bytes[COMM_KIND_CP];
    printf("cp accounting: %s N %d layers %d B %d T/N %d C/tp %d microbatches/rank %d | bytes/rank/step cp %llu, "
           "formula %llu (%s)\n", a2a ? "a2a" : "ring", comm->cp, layers, t->B, t->T / comm->cp,
           t->config.channels / comm->tp, t->zero.local_microbatches, (unsigned long long)got,
           (unsigned long long)want, got == want ? "equal" : "MISMATCH");
}

// ---- FlexSP (--flexsp 1) --------------------------------------------------------------------

#define FLEXSP_SOLVER_MS 200   // GLPK's time limit per step (the plan is never worse than greedy)

// The plan of the step's G sequences (world rank 0 plans, the pool gets it by broadcast:
// GLPK under a time limit need not give every rank the same plan): first[j], size[j] the block
// of pool ranks computing sequence j. Rank 0 writes what it planned into `line` (NULL: nowhere).
static inline void trainer_flexsp_plan(Trainer* t, const double* len, int G, int* first, int* size,
                                       FlexPlan* plan, int* group_of, int* sorted, char* line) {
    CommGroup* pool = &t->comm.dpcp_group;
    int N = pool->size;
    if (pool->rank == 0) {
        const FlexCost* c = &t->flexsp_cost;
        double* sorted_len = (double*)malloc_or_die(sizeof(double) * (size_t)G, "FlexSP plan");
        flexsp_sort_by_length(len, G, sorted);
        for (int i = 0; i < G; i++) { sorted_len[i] = len[sorted[i]]; }
        double t0 = now_seconds();
        const char* how = "";
        if (strcmp(t->args.flexsp_policy, "static") == 0) {
            flexsp_uniform_plan(c, sorted_len, G, N, flexsp_min_group(c, t->T, N), plan, group_of);
        } else if (strcmp(t->args.flexsp_policy, "adaptive") == 0) {
            flexsp_adaptive_plan(c, sorted_len, G, N, plan, group_of);
        } else {
            FlexSolved solved = flexsp_milp_plan(c, sorted_len, G, N, FLEXSP_SOLVER_MS, 1, plan, group_of, NULL, NULL);
            how = solved == FLEXSP_MILP_OPTIMAL ? " (GLPK: optimal)" : solved == FLEXSP_MILP_TIME_LIMIT
                  ? " (GLPK: time limit, the best plan found)" : " (greedy: GLPK not built in)";
        }
        if (!isfinite(plan->ms)) { fatal("internal: no FlexSP plan fits the step's sequences"); }
        flexsp_align_groups(plan, group_of, G);
        flexsp_plan_blocks(plan, group_of, sorted, G, N, first, size);
        if (line) {
            snprintf(line, 4096, "           flexsp: %s%s planned in %.1f ms, %d group(s), planned %.0f ms (cost model)",
                     t->args.flexsp_policy, how, (now_seconds() - t0) * 1e3, plan->ngroups, plan->ms);
        }
        free(sorted_len);
    }
    // broadcast (dp x cp group: the pool): the plan's block of ranks of each sequence
    comm_broadcast(pool, first, sizeof(int) * (size_t)G, 0, COMM_KIND_OTHER);
    comm_broadcast(pool, size, sizeof(int) * (size_t)G, 0, COMM_KIND_OTHER);
}

// One FlexSP step's forward and backward passes, its gradient and its loss: this rank computes
// the sequences of its group (a group of one: each sequence whole, as one rank does; a group
// of several: with context parallelism over its pool sub-group), keeps each
// one's gradient whole (zero.h's flexsp mode), and flexsp_reduce_step sums them at the shard
// owners in the step's index order; the loss is the R1 tree over the sequences' loss sums in
// index order, the experts' aux loss (*aux, with experts) the R1 tree over their aux losses
// over G. Returns the loss; rank 0 adds each group's sequences and times to flexsp_line.
static inline float trainer_flexsp_step(Trainer* t, int64_t targets, float* aux) {
    const TrainArgs* a = &t->args;
    Zero* z = &t->zero;
    Pipeline* p = &t->pipe;
    CommGroup* pool = &t->comm.dpcp_group;
    int G = t->M, N = pool->size, me = pool->rank;
    int64_t done = t->progress.microbatches_done;
    double* len = (double*)malloc_or_die(sizeof(double) * (size_t)G, "FlexSP step");
    int* ints = (int*)malloc_or_die(sizeof(int) * 5 * (size_t)G, "FlexSP step");
    int *first = ints, *size = ints + G, *group_of = ints + 2 * G, *sorted = ints + 3 * G, *mine = ints + 4 * G;
    FlexPlan* plan = (FlexPlan*)malloc_or_die(sizeof(FlexPlan), "FlexSP plan");
    for (int j = 0; j < G; j++) { len[j] = dataloader_length(&t->train_loader, a->overfit_single_batch ? 0 : done + j); }
    trainer_flexsp_plan(t, len, G, first, size, plan, group_of, sorted, t->flexsp_line);
    int count = 0;
    for (int j = 0; j < G; j++) { if (flexsp_holds(first, size, j, me)) { mine[count++] = j; } }
    // the passes: each of this rank's sequences as one microbatch of one chunk (no pipeline),
    // over its group's pool sub-group: every member runs the group's sequences in index order,
    // each of at least 2 x the group's ranks split over them (ring or all-to-all context
    // parallelism, context_parallel.h: R2Z's unequal pieces where 2g does not divide the
    // length), a shorter one computed whole by each member; either way each member holds its
    // part of the gradient and -0.0f elsewhere, as the exchange expects
    double t0 = now_seconds();
    zero_flexsp_begin_step(z, mine, count);
    // this rank's sequences' loss sums, their aux losses (experts), its measured compute time
    size_t stride = 2 * (size_t)G + 1;
    float* local_loss = (float*)calloc_or_die(stride, sizeof(float), "FlexSP losses");
    PipelineStepContext x = {z, t->grads, &t->train_loader, done, t->B, t->T, a->overfit_single_batch, 0, 0,
                             1.0f / (float)(double)targets, t->ops->grad_residual(p->models[0], t->grads), local_loss};
    for (int k = 0; k < count; k++) {
        trainer_flexsp_select(t, size[mine[k]]);
        pipeline_run_forward(p, &x, k, 0);
        pipeline_run_backward(p, &x, k, 0, BACKWARD_BOTH);
    }
    trainer_flexsp_select(t, 1);
    t->mem->sync();
    float busy_ms = (float)((now_seconds() - t0) * 1e3);
    flexsp_reduce_step(z, &t->flexsp_ws, first, size, G);
    zero_finish_grads(z);
    if (t->moe) {   // each sequence's aux loss, summed over the layers in layer order
        moe_microbatch_aux(&t->comm.pp_group, t->config.num_layers, p->moe_aux, count, t->moe_micro_aux);
        memcpy(local_loss + G, t->moe_micro_aux, sizeof(float) * (size_t)count);
    }
    local_loss[2 * G] = busy_ms;
    // all-gather (dp x cp group: the pool): every rank's loss sums and aux losses (its sequences in index
    // order) and its measured compute time; the loss is the R1 tree over sequence j's sum, from
    // rank first[j], the aux loss the same over sequence j's aux loss
    float* all = (float*)malloc_or_die(sizeof(float) * (size_t)N * stride, "FlexSP losses");
    comm_all_gather(pool, local_loss, all, stride, COMM_KIND_OTHER);
    float* ordered = (float*)malloc_or_die(sizeof(float) * 2 * (size_t)G, "FlexSP losses");
    int* next = (int*)calloc_or_die((size_t)N, sizeof(int), "FlexSP losses");
    for (int j = 0; j < G; j++) {
        const float* held = all + (size_t)first[j] * stride + next[first[j]]++;
        ordered[j] = held[0];
        ordered[G + j] = held[G];
    }
    float loss = canon_tree_sum(ordered, G, 1) / (float)(double)targets;
    if (t->moe) { *aux = canon_tree_sum(ordered + G, G, 1) / (float)(double)G; }
    if (me == 0) {   // each group: its ranks, its sequences' lengths, planned and measured ms
        char* line = t->flexsp_line;
        size_t at = strlen(line);
        double scratch[FLEXSP_MAX_POOL];
        for (int k = 0; k < plan->ngroups; k++) { scratch[k] = t->flexsp_cost.beta; }
        for (int i = 0; i < G; i++) { scratch[group_of[i]] += flexsp_seq_ms(&t->flexsp_cost, len[sorted[i]], plan->size[group_of[i]]); }
        for (int k = 0, r = 0; k < plan->ngroups; r += plan->size[k], k++) {
            at += (size_t)snprintf(line + at, 4096 - at, "\n           group %d (%d rank(s), %d-%d): lengths", k,
                                   plan->size[k], r, r + plan->size[k] - 1);
            int split = 0;
            for (int i = 0; i < G && at < 4000; i++) {
                if (group_of[i] != k) { continue; }
                at += (size_t)snprintf(line + at, 4096 - at, " %d", (int)len[sorted[i]]);
                int cp_split, seq_split;
                zz_split_length(plan->size[k], 1, (int)len[sorted[i]], &cp_split, &seq_split);
                split += cp_split > 1;
            }
            if (plan->size[k] > 1 && at < 4000) {
                at += (size_t)snprintf(line + at, 4096 - at, " (%d split %d ways, the others whole on each rank)", split,
                                       plan->size[k]);
            }
            float measured = 0;
            for (int q = r; q < r + plan->size[k]; q++) {
                float ms = all[(size_t)q * stride + 2 * G];
                if (ms > measured) { measured = ms; }
            }
            if (at < 4000) {
                at += (size_t)snprintf(line + at, 4096 - at, " | planned %.0f ms, measured %.1f ms", scratch[k], measured);
            }
        }
    }
    free(len); free(ints); free(plan); free(local_loss); free(all); free(ordered); free(next);
    return loss;
}

// Validation under FlexSP. A rank's activations hold what one pass of a group holds (about
// --flexsp-tokens positions, ModelOps.cp_select), not a sequence of -t, so the validation
// sequences run in groups over the pool as a step's do: G at a time, each batch
// planned like a step (trainer_flexsp_plan), a group's members computing its sequences in
// index order with context parallelism over their pool sub-group. Every member ends with the
// sequence's whole loss sum (context parallelism gathers the losses); the group's first rank
// hands it on (all-gather over the pool), and the sums are added by the R1 tree in sequence order
// over their targets, as trainer_validate adds one rank's batches. Under ZeRO-3 every rank
// gathers the parameters once, ahead of the passes, as a step does.
static inline float trainer_validate_flexsp(Trainer* t) {
    Zero* z = &t->zero;
    Pipeline* p = &t->pipe;
    CommGroup* pool = &t->comm.dpcp_group;
    int batches = t->val_batches, G = t->M, N = pool->size, me = pool->rank;
    void* acts = pipeline_chunk_acts(p, 0);
    double* len = (double*)malloc_or_die(sizeof(double) * (size_t)G, "FlexSP validation");
    int* ints = (int*)malloc_or_die(sizeof(int) * (4 * (size_t)G + N), "FlexSP validation");
    int *first = ints, *size = ints + G, *group_of = ints + 2 * G, *sorted = ints + 3 * G, *next = ints + 4 * G;
    FlexPlan* plan = (FlexPlan*)malloc_or_die(sizeof(FlexPlan), "FlexSP plan");
    float* local = (float*)calloc_or_die((size_t)G, sizeof(float), "FlexSP validation");
    float* all = (float*)malloc_or_die(sizeof(float) * (size_t)N * G, "FlexSP validation");
    float* sums = (float*)malloc_or_die(sizeof(float) * ((size_t)batches + 1), "FlexSP validation");
    zero_flexsp_hold_params(z);
    for (int j0 = 0; j0 < batches; j0 += G) {
        int n = batches - j0 < G ? batches - j0 : G, count = 0;
        for (int j = 0; j < n; j++) { len[j] = dataloader_length(&t->val_loader, j0 + j); }
        trainer_flexsp_plan(t, len, n, first, size, plan, group_of, sorted, NULL);
        for (int j = 0; j < n; j++) {
            if (!flexsp_holds(first, size, j, me)) { continue; }
            trainer_flexsp_select(t, size[j]);
            dataloader_load(&t->val_loader, j0 + j);
            int Tj = t->val_loader.loaded_T;
            pipeline_forward_pass(p, &acts, t->val_loader.inputs, t->val_loader.targets, 1, Tj, t->config.channels, 1, -1);
            local[count++] = t->ops->loss_sum(p->models[0], acts, 1, Tj);
        }
        // all-gather (dp x cp group: the pool): every rank's loss sums, its sequences in index
        // order; sequence j's from the first rank of its group
        comm_all_gather(pool, local, all, (size_t)G, COMM_KIND_OTHER);
        memset(next, 0, sizeof(int) * (size_t)N);
        for (int j = 0; j < n; j++) { sums[j0 + j] = all[(size_t)first[j] * G + next[first[j]]++]; }
    }
    trainer_flexsp_select(t, 1);
    zero_flexsp_end_passes(z);
    float loss = canon_tree_sum(sums, batches, 1) / (float)(double)dataloader_targets(&t->val_loader, 0, batches);
    free(len); free(ints); free(plan); free(local); free(all); free(sums);
    return loss;
}

// What the loop keeps from step to step, for the step lines and the run summary.
typedef struct {
    int first_step;                 // of this run (after -y, the resumed step)
    double flops_per_step;
    double run_start, total_time;   // total_time: the timed steps' seconds
    int timed_steps;                // the steps after the first, which carries the warm-up
    double tokens, timed_tokens;    // the targets of all steps, of the timed ones
    float* local_loss;              // (local microbatches) this rank's loss sums of the step
    float best_val;
    int best_val_step, last_checkpoint;                   // -1: none
    float cost_sum[PP_TIMING * PP_MAX_LISTED_STAGES];     // the stages' measured costs, summed
    int cost_steps;                                       // ... over this many steps
} TrainRun;

// What one optimizer step produced, for its step line.
typedef struct {
    int step;                       // 0-based: the step line says step + 1
    float loss, aux, norm, lr;      // aux: the experts' load-balancing loss
    double tokens;                  // the step's targets (B*T*M; with --varlen its sequences')
    double seconds, load_min, load_max;   // load: the fewest / most slots of one expert
    float timing_all[PP_TIMING * PP_MAX_LISTED_STAGES];   // every stage's pipeline_step_timing
} StepResult;

// One optimizer step over M microbatches (M / N on each data-parallel rank): the pipeline, the
// loss, the experts' statistics, the gradient norm, AdamW. A loss or gradient norm that is not
// finite stops the run before the step updates the model or writes anything (Megatron's NaN
// check).
static inline void trainer_step(Trainer* t, TrainRun* run, int step, StepResult* out) {
    const TrainArgs* a = &t->args;
    Comm* comm = &t->comm;
    Zero* z = &t->zero;
    Pipeline* pipe = &t->pipe;
    memset(out, 0, sizeof(*out));
    out->step = step;
    comm_reset_stats(comm);
    if (t->moe) { moe_counters_reset(t->moe_counters, t->nchunks); }
    double t0 = now_seconds();
    int64_t targets = dataloader_step_targets(&t->train_loader, t->progress.microbatches_done, t->M,
                                              a->overfit_single_batch);
    out->tokens = (double)targets;
    if (a->flexsp) {
        out->loss = trainer_flexsp_step(t, targets, &out->aux);
    } else {
        pipeline_step(pipe, z, t->grads, &t->train_loader, t->progress.microbatches_done, targets, t->B, t->T,
                      a->overfit_single_batch, run->local_loss);
        out->loss = global_mean_loss(t, run->local_loss, z->local_microbatches, t->M, 0, out->tokens);
        if (t->moe) {
            moe_microbatch_aux(&comm->pp_group, t->config.num_layers, pipe->moe_aux, z->local_microbatches,
                               t->moe_micro_aux);
            out->aux = global_mean_loss(t, t->moe_micro_aux, z->local_microbatches, t->M, 0, (double)t->M);
        }
    }
    if (t->moe) {
        // the loads over data x context ranks (each sequence counted by its context group's first rank)
        moe_expert_loads(t->moe_counters, t->nchunks, t->config.num_layers, t->config.num_experts, &comm->dpcp_group,
                         &comm->pp_group, &out->load_min, &out->load_max);
    }
    out->norm = zero_grad_norm(z, &comm->tp_group);
    if (!isfinite(out->loss) || !isfinite(out->norm)) {
        fatal("step %d: the %s is %g: training diverged; stopping before this step updates the model "
              "or writes anything (lower -l, check the data; the last checkpoint is intact)",
              step + 1, isfinite(out->loss) ? "gradient norm" : "loss", isfinite(out->loss) ? out->norm : out->loss);
    }
    float grad_scale = a->grad_clip > 0.0f && out->norm > a->grad_clip ? a->grad_clip / out->norm : 1.0f;
    out->lr = lr_at_step(&t->schedule, step);
    AdamWStep s = adamw_step_constants(out->lr, a->beta1, a->beta2, a->eps, step + 1, grad_scale);
    zero_adamw_step(z, &s, a->weight_decay);
    t->mem->sync();
    trainer_dump_copy(t, step + 1);
    t->progress.microbatches_done += t->M;
    t->progress.step = step + 1;
    out->seconds = now_seconds() - t0;
    // every stage's measured costs (all-gather, pp group), summed for the run summary
    int first_of_run = step == run->first_step;
    run->tokens += out->tokens;
    if (!first_of_run) { run->total_time += out->seconds; run->timed_steps++; run->timed_tokens += out->tokens; }
    if (comm->pp > 1 && comm->pp <= PP_MAX_LISTED_STAGES) {
        float timing[PP_TIMING];
        pipeline_step_timing(pipe, out->seconds, timing);
        comm_all_gather(&comm->pp_group, timing, out->timing_all, PP_TIMING, COMM_KIND_OTHER);
        if (!first_of_run || t->train_steps - run->first_step == 1) {
            for (int k = 0; k < PP_TIMING * comm->pp; k++) { run->cost_sum[k] += out->timing_all[k]; }
            run->cost_steps++;
        }
    }
}

// The step line on the console (world rank 0) with the experts' and the pipeline's lines, after
// the run's first step what it sent and the memory plan; and the step in main.log.
static inline void trainer_report_step(Trainer* t, const BuildInfo* build, const TrainRun* run, const StepResult* r) {
    const GPT2Config* c = &t->config;
    Comm* comm = &t->comm;
    Zero* z = &t->zero;
    const Pipeline* pipe = &t->pipe;
    int first_of_run = r->step == run->first_step;
    if (t->root) {
        char throughput[64];
        // flops_per_step is for total_batch tokens (with --varlen: G x T, the most a step holds)
        build->throughput(throughput, sizeof(throughput), run->flops_per_step * (r->tokens / t->total_batch) / r->seconds);
        printf("step %4d/%d | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s | %s\n", r->step + 1,
               t->train_steps, r->loss, r->lr, r->norm, r->seconds * 1e3, r->tokens / r->seconds, throughput);
        if (t->args.flexsp) { printf("%s\n", t->flexsp_line); }
        if (t->moe) {   // the expert load over the whole step; rank 0's all-to-all traffic
            MoeCounters sent = moe_counters_total(t->moe_counters, t->nchunks);
            printf("           experts: aux %.6f | tokens per expert min %.0f max %.0f (of %lld per layer) | "
                   "all-to-all %llu bytes: %lld rows out, %lld in, %lld layer passes\n", r->aux, r->load_min,
                   r->load_max, (long long)(c->top_k * r->tokens), (unsigned long long)comm->stats.bytes[COMM_KIND_EP],
                   sent.rows_out, sent.rows_in, sent.passes);
        }
        if (comm->pp > 1 && comm->pp <= PP_MAX_LISTED_STAGES) {
            printf("           pipeline idle per stage:");
            for (int st = 0; st < comm->pp; st++) { printf(" %.2f", r->timing_all[PP_TIMING * st]); }
            printf(" (model %.2f)\n", pipeline_bubble_fraction(&pipe->cfg));
            if (first_of_run) {
                printf("pipeline activations held per stage (peak, %s):",
                       pipe->nchunks > 1 ? "(microbatch, chunk) pairs" : "microbatches");
                for (int st = 0; st < comm->pp; st++) { printf(" %d", (int)r->timing_all[PP_TIMING * st + 4]); }
                printf("\n");
            }
        }
        if (first_of_run) {   // what this run's first step sent, and the memory plan
            ZeroMemory mem = zero_memory(z);
            printf("communication per rank in this step (bytes sent):\n");
            comm_print_stats(comm, stdout);
            printf("zero accounting: stage %d N %d P %zu VpC %zu L %d microbatches/rank %d | "
                   "bytes/rank/step grad %llu param %llu | bytes/rank params %.0f grads %.0f optimizer %.0f",
                   z->stage, z->N, param_count(c), (size_t)c->padded_vocab_size * c->channels, c->num_layers,
                   t->args.flexsp ? z->chunk_count[0] : z->local_microbatches,   // FlexSP: the plan's count
                   (unsigned long long)comm->stats.bytes[COMM_KIND_GRAD],
                   (unsigned long long)comm->stats.bytes[COMM_KIND_PARAM], mem.params, mem.grads, mem.optimizer);
            if (z->bf16_weights) { printf(" bf16 weights %.0f", mem.weights); }
            printf("\n");
            // (FlexSP's groups, not the cp group, split its sequences: its step lines say how)
            if (t->args.varlen && !t->args.flexsp && trainer_sequence_split(t) > 1) { trainer_print_varlen_split(t); }
            if (comm->cp > 1 && !t->args.flexsp) { trainer_print_cp_accounting(t); }
        }
        fflush(stdout);
    }
    if (t->moe) {
        logger_log_train_aux(&t->logger, r->step, r->loss, r->lr, r->norm, r->aux);
    } else {
        logger_log_train(&t->logger, r->step, r->loss, r->lr, r->norm);
    }
}

// The run summary (world rank 0): what was trained, how fast (the steps after the first, which
// carries the warm-up), the best validation loss, where the model is, and the command that
// draws this run's pipeline schedule from its measured costs.
static inline void trainer_print_summary(const Trainer* t, const BuildInfo* build, const TrainRun* run) {
    if (!t->root) { return; }
    const TrainArgs* a = &t->args;
    const Comm* comm = &t->comm;
    const Pipeline* pipe = &t->pipe;
    int steps = t->train_steps - run->first_step;
    printf("run summary: %d step(s) (%d -> %d), %.0f tokens in %.1f s", steps, run->first_step, t->train_steps,
           run->tokens, now_seconds() - run->run_start);
    if (run->timed_steps > 0) {
        double avg = run->total_time / run->timed_steps;
        char throughput[160];
        build->summary_throughput(throughput, sizeof(throughput),
                                  run->flops_per_step * (run->timed_tokens / run->timed_steps / t->total_batch) / avg);
        printf("\n  average step %.1f ms (excluding the first), %.0f tok/s, %s", avg * 1e3, run->timed_tokens / run->total_time,
               throughput);
    }
    if (run->best_val_step >= 0) { printf("\n  best val loss %.6f (step %d)", run->best_val, run->best_val_step); }
    if (run->last_checkpoint >= 0) {
        printf("\n  checkpoint: %s/model_%08d.bin (resume with -y 1 -o %s)", a->output_dir, run->last_checkpoint,
               a->output_dir);
    }
    printf("\n");
    if (run->cost_steps > 0) {   // the measured costs, ready for the schedule drawing tool
        printf("draw this run's pipeline schedule from its measured costs (ms per microbatch and chunk, "
               "mean over %d step(s)):\n  dev/tools/pp_schedule --stages %d --microbatches %d --schedule %s",
               run->cost_steps, comm->pp, t->zero.local_microbatches, a->pp_schedule);
        if (pipe->cfg.kind == PP_INTERLEAVED) { printf(" --chunks %d", pipe->nchunks); }
        const char* flags[3] = {"--fwd", "--bwd", "--wgt"};
        for (int f = 0; f < (pipe->split ? 3 : 2); f++) {
            printf(" %s ", flags[f]);
            for (int st = 0; st < comm->pp; st++) {
                printf("%s%.3f", st ? "," : "", run->cost_sum[PP_TIMING * st + 1 + f] / run->cost_steps);
            }
        }
        if (pipe->cfg.kind == PP_DUALPIPEV) {   // the measured F&B pairs (PP_TIMING's last)
            printf(" --fb ");
            for (int st = 0; st < comm->pp; st++) {
                printf("%s%.3f", st ? "," : "", run->cost_sum[PP_TIMING * st + 5] / run->cost_steps);
            }
        }
        printf(" --svg pipeline.svg\n");
    }
}

// The startup table, then every step: validation, sampling and checkpoints when due, the
// step (trainer_step) and its lines (trainer_report_step); at the end the run summary.
static inline void trainer_run(Trainer* t, const BuildInfo* build) {
    const TrainArgs* a = &t->args;
    const GPT2Config* c = &t->config;
    trainer_print_table(t, build);
    TrainRun run;
    memset(&run, 0, sizeof(run));
    run.first_step = (int)t->progress.step;
    run.flops_per_step = (6.0 * (double)(t->moe ? param_active_count(c) : param_count(c)) +
                          6.0 * c->num_layers * c->channels * t->T) * (double)t->total_batch;
    run.run_start = now_seconds();
    run.local_loss = (float*)calloc_or_die((size_t)t->zero.local_microbatches + 1, sizeof(float), "losses");
    run.best_val_step = run.last_checkpoint = -1;
    for (int step = run.first_step; step <= t->train_steps; step++) {
        int last_step = step == t->train_steps;
        if (t->do_val && (step % a->val_every == 0 || last_step)) {
            // FlexSP: the validation sequences in groups over the pool too (a rank's memory holds a
            // group's share of a sequence, not a whole one of -t)
            float val_loss = t->args.flexsp ? trainer_validate_flexsp(t) : trainer_validate(t);
            if (t->root) { printf("val loss %.6f\n", val_loss); }
            logger_log_val(&t->logger, step, val_loss);
            if (run.best_val_step < 0 || val_loss < run.best_val) { run.best_val = val_loss; run.best_val_step = step; }
        }
        if (t->do_sample && ((step > 0 && step % a->sample_every == 0) || last_step)) { trainer_sample(t); }
        if (a->checkpoint_every > 0 && step != t->resume_step &&
            ((step > 0 && step % a->checkpoint_every == 0) || last_step)) {
            t->progress.step = step;
            trainer_write_checkpoint(t);
            run.last_checkpoint = step;
        }
        if (last_step) { break; }
        StepResult result;
        trainer_step(t, &run, step, &result);
        trainer_report_step(t, build, &run, &result);
    }
    trainer_print_summary(t, build, &run);
    free(run.local_loss);
}

static inline void trainer_end(Trainer* t) {
    free(t->pipe.moe_aux);
    free(t->moe_micro_aux);
    free(t->moe_counters);
    free(t->flexsp_line);
    flexsp_workspace_free(t->mem, &t->flexsp_ws);
    pipeline_free(&t->pipe);
    if (t->do_sample) {
        for (int ch = 0; ch < t->nchunks; ch++) { t->ops->acts_destroy(t->models[ch], t->sample_acts[ch]); }
        free(t->sample_acts);
        free(t->sample_probs);
    }
    free(t->sample_prompt);
    t->ops->grads_destroy(t->models[0], t->grads);
    dataloader_free(&t->train_loader);
    if (t->do_val) { dataloader_free(&t->val_loader); }
    tokenizer_free(&t->tokenizer);
    for (int ch = 0; ch < t->nchunks; ch++) { t->ops->destroy(t->models[ch]); }
    free(t->models);
    free(t->all_places);
    zero_free(&t->zero);
    comm_finalize(&t->comm);
}

#endif // LLMC_ENGINE_H
