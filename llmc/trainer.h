/*
 * trainer.h: the state of one training run, as engine.h's trainer_* functions build and run it
 * (and startup_table.h prints it): the flags, the rank grid, this rank's model chunks, ZeRO's
 * shards, the pipeline executor, the data, the logs.
 */
#ifndef LLMC_TRAINER_H
#define LLMC_TRAINER_H

#include "llmc/adamw.h"
#include "llmc/args.h"
#include "llmc/checkpoint.h"
#include "llmc/comm.h"
#include "llmc/dataloader.h"
#include "llmc/expert_parallel.h"
#include "llmc/flexsp.h"
#include "llmc/logger.h"
#include "llmc/memory.h"
#include "llmc/model.h"
#include "llmc/model_ops.h"
#include "llmc/pipeline.h"
#include "llmc/pipeline_executor.h"
#include "llmc/tokenizer.h"
#include "llmc/zero.h"


// The most pipeline stages the startup table and the step lines list one by one (their
// per-stage values are gathered into arrays of this size); a longer pipeline trains without
// those lines.
#define PP_MAX_LISTED_STAGES 64

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
    ChunkPlace* all_places;         // [pp x nchunks] every stage's chunks, stage-major (pipeline.h's placement)
    ChunkPlace* places;             // [nchunks] this rank's, in all_places
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
    int* sample_prompt;    // the sampler's first sample_prompt_len tokens (--prompt)
    int sample_prompt_len;
    void** sample_acts;             // [nchunks]
    float* sample_probs;            // host, Vp
    TrainProgress progress;
    Logger logger;
    int moe;                        // a mixture-of-experts model
    MoeCounters** moe_counters;     // [nchunks] each chunk's routing counters (NULL: none)
    float* moe_micro_aux;           // (local microbatches) each one's aux loss, summed over layers
    FlexCost flexsp_cost;           // --flexsp 1: the planner's cost model (engine.h trainer_flexsp_cost)
    FlexWorkspace flexsp_ws;        // ... the gradient exchange's buffers
    char* flexsp_line;              // ... the step's plan and times, for the step's console lines
} Trainer;

#endif // LLMC_TRAINER_H
