/*
 * args.h: the command line of train_gpt2 and train_gpt2cu (one table, both builds).
 *
 * llm.c's single-letter flags where llm.c has the concept (-i -j -e -o -b -t -d -x -l -u -q -k
 * -c -v -m -s -g -n -y -z -r -a), each followed by its value; new options are long options
 * (--beta1 0.9). -h / --help prints the table. An unknown flag, a missing value or a value
 * that does not parse is one clear error line naming the flag.
 */
#ifndef LLMC_ARGS_H
#define LLMC_ARGS_H

#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/utils.h"
#include "llmc/dataloader.h"

typedef struct {
    const char* train_pattern;
    const char* val_pattern;
    const char* model;            // checkpoint path or "dN..." descriptor
    const char* output_dir;
    const char* lr_schedule;
    const char* tokenizer_path;
    int B, T;
    long long total_batch;        // tokens per optimizer step; -1 = B*T*DP
    int max_steps;                // -1 = one epoch
    float lr;
    int warmup;
    float final_lr_frac;
    float weight_decay;
    int val_every, val_max_steps;
    int sample_every, gen_T;
    int checkpoint_every;
    int resume;
    int zero_stage;
    int recompute;
    int overfit_single_batch;
    float beta1, beta2, eps, grad_clip;
    int shuffle;
    long long seed;
    int tp, pp, sp;               // tensor / pipeline / sequence parallelism
    const char* pp_schedule;
    int deterministic;            // CUDA build: bit-exact mode
} TrainArgs;

typedef enum { ARG_INT, ARG_LLONG, ARG_FLOAT, ARG_STR } ArgType;

typedef struct {
    const char* name;     // "-i" or "--beta1"
    ArgType type;
    size_t offset;        // into TrainArgs
    const char* help;
} ArgSpec;

#define ARG_FIELD(f) offsetof(TrainArgs, f)
static const ArgSpec arg_specs[] = {
    {"-i", ARG_STR, ARG_FIELD(train_pattern), "train token files (glob)"},
    {"-j", ARG_STR, ARG_FIELD(val_pattern), "validation token files (glob)"},
    {"-e", ARG_STR, ARG_FIELD(model), "model: llm.c checkpoint file, or dN[cC][hNH][vV][tMAXT] for a fresh GPT-2 of depth N (e.g. d12)"},
    {"-o", ARG_STR, ARG_FIELD(output_dir), "output dir for main.log and checkpoints"},
    {"-b", ARG_INT, ARG_FIELD(B), "microbatch size B (sequences per rank per microbatch)"},
    {"-t", ARG_INT, ARG_FIELD(T), "sequence length T (<= the model's maxT)"},
    {"-d", ARG_LLONG, ARG_FIELD(total_batch), "total batch in tokens per step; -1 = B*T*DP (no accumulation)"},
    {"-x", ARG_INT, ARG_FIELD(max_steps), "optimizer steps; -1 = one epoch of the train data"},
    {"-l", ARG_FLOAT, ARG_FIELD(lr), "peak learning rate"},
    {"-u", ARG_INT, ARG_FIELD(warmup), "learning-rate warmup steps"},
    {"-q", ARG_FLOAT, ARG_FIELD(final_lr_frac), "final learning rate as a fraction of the peak"},
    {"-k", ARG_STR, ARG_FIELD(lr_schedule), "learning-rate schedule: cosine | linear | constant"},
    {"-c", ARG_FLOAT, ARG_FIELD(weight_decay), "AdamW weight decay (2-D weights only)"},
    {"-v", ARG_INT, ARG_FIELD(val_every), "validation loss every N steps; 0 = never"},
    {"-m", ARG_INT, ARG_FIELD(val_max_steps), "validation batches per evaluation; -1 = all"},
    {"-s", ARG_INT, ARG_FIELD(sample_every), "sample text every N steps; 0 = never"},
    {"-g", ARG_INT, ARG_FIELD(gen_T), "tokens to generate when sampling"},
    {"-n", ARG_INT, ARG_FIELD(checkpoint_every), "write a checkpoint every N steps (and at the end); 0 = never (needs -o)"},
    {"-y", ARG_INT, ARG_FIELD(resume), "1 = resume from the latest checkpoint in the -o dir"},
    {"-z", ARG_INT, ARG_FIELD(zero_stage), "ZeRO stage 0-3 (optimizer / gradient / parameter sharding over data-parallel ranks)"},
    {"-r", ARG_INT, ARG_FIELD(recompute), "1 = recompute GELU in backward instead of storing it (less memory)"},
    {"-a", ARG_INT, ARG_FIELD(overfit_single_batch), "1 = train on the first microbatch only (debugging)"},
    {"--beta1", ARG_FLOAT, ARG_FIELD(beta1), "AdamW beta1"},
    {"--beta2", ARG_FLOAT, ARG_FIELD(beta2), "AdamW beta2"},
    {"--eps", ARG_FLOAT, ARG_FIELD(eps), "AdamW epsilon"},
    {"--grad-clip", ARG_FLOAT, ARG_FIELD(grad_clip), "clip the global gradient norm to this; 0 = off"},
    {"--shuffle", ARG_INT, ARG_FIELD(shuffle), "1 = shuffle the train shards and microbatches each epoch"},
    {"--seed", ARG_LLONG, ARG_FIELD(seed), "seed of the weight init (-e dN) and of the shuffle"},
    {"--tokenizer", ARG_STR, ARG_FIELD(tokenizer_path), "llm.c tokenizer file used to print samples"},
    {"--tp", ARG_INT, ARG_FIELD(tp), "tensor-parallel degree (Megatron column/row splits)"},
    {"--sp", ARG_INT, ARG_FIELD(sp), "1 = Megatron sequence parallelism within the tensor-parallel group"},
    {"--pp", ARG_INT, ARG_FIELD(pp), "pipeline-parallel degree (stages)"},
    {"--schedule", ARG_STR, ARG_FIELD(pp_schedule), "pipeline schedule: 1f1b | gpipe"},
    {"--deterministic", ARG_INT, ARG_FIELD(deterministic), "CUDA build: 1 = fp32 canonical kernels, bit-identical to the CPU build"},
};
#define NUM_ARG_SPECS ((int)(sizeof(arg_specs) / sizeof(arg_specs[0])))

static inline void train_args_defaults(TrainArgs* a) {
    memset(a, 0, sizeof(*a));
    a->train_pattern = "dev/data/tinyshakespeare/tiny_shakespeare_train.bin";
    a->val_pattern = "dev/data/tinyshakespeare/tiny_shakespeare_val.bin";
    a->model = "gpt2_124M.bin";
    a->output_dir = NULL;
    a->lr_schedule = "cosine";
    a->tokenizer_path = "gpt2_tokenizer.bin";
    a->B = 4;
    a->T = 64;
    a->total_batch = -1;
    a->max_steps = -1;
    a->lr = 3e-4f;
    a->warmup = 0;
    a->final_lr_frac = 1.0f;
    a->weight_decay = 0.0f;
    a->val_every = 20;
    a->val_max_steps = 20;
    a->sample_every = 20;
    a->gen_T = 64;
    a->checkpoint_every = 0;
    a->resume = 0;
    a->zero_stage = 0;
    a->recompute = 1;
    a->overfit_single_batch = 0;
    a->beta1 = 0.9f;
    a->beta2 = 0.95f;
    a->eps = 1e-8f;
    a->grad_clip = 1.0f;
    a->shuffle = 1;
    a->seed = 42;
    a->tp = 1;
    a->pp = 1;
    a->sp = 0;
    a->pp_schedule = "1f1b";
    a->deterministic = 0;
}

static inline void train_args_print_help(const char* prog, const TrainArgs* defaults) {
    printf("usage: %s [options]\n\n", prog);
    printf("Trains GPT-2 on llm.c token shards, single rank or under mpirun (DP x TP x PP).\n\n");
    for (int i = 0; i < NUM_ARG_SPECS; i++) {
        const ArgSpec* s = &arg_specs[i];
        const char* base = (const char*)defaults + s->offset;
        char def[256];
        switch (s->type) {
            case ARG_INT: snprintf(def, sizeof(def), "%d", *(const int*)base); break;
            case ARG_LLONG: snprintf(def, sizeof(def), "%lld", *(const long long*)base); break;
            case ARG_FLOAT: snprintf(def, sizeof(def), "%g", *(const float*)base); break;
            case ARG_STR: {
                const char* v = *(const char* const*)base;
                snprintf(def, sizeof(def), "%s", v ? v : "none");
                break;
            }
        }
        const char* meta = s->type == ARG_STR ? "<str>" : s->type == ARG_FLOAT ? "<float>" : "<int>";
        printf("  %-16s %-7s %s (default: %s)\n", s->name, meta, s->help, def);
    }
    printf("  %-16s %-7s %s\n", "-h, --help", "", "this help");
}

// Parses argv into *a (which holds the defaults). Returns 1 if help was requested.
static inline int train_args_parse(TrainArgs* a, int argc, char** argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) { return 1; }
        const ArgSpec* spec = NULL;
        for (int s = 0; s < NUM_ARG_SPECS; s++) {
            if (strcmp(argv[i], arg_specs[s].name) == 0) { spec = &arg_specs[s]; break; }
        }
        if (spec == NULL) { fatal("unknown flag '%s' (see --help)", argv[i]); }
        if (i + 1 >= argc) { fatal("flag %s needs a value (see --help)", argv[i]); }
        const char* value = argv[++i];
        char* base = (char*)a + spec->offset;
        char* end = NULL;
        errno = 0;
        switch (spec->type) {
            case ARG_INT: {
                long v = strtol(value, &end, 10);
                if (*value == '\0' || *end != '\0' || errno || v < INT_MIN || v > INT_MAX) {
                    fatal("flag %s expects an integer, got '%s'", spec->name, value);
                }
                *(int*)base = (int)v;
                break;
            }
            case ARG_LLONG: {
                long long v = strtoll(value, &end, 10);
                if (*value == '\0' || *end != '\0' || errno) {
                    fatal("flag %s expects an integer, got '%s'", spec->name, value);
                }
                *(long long*)base = v;
                break;
            }
            case ARG_FLOAT: {
                float v = strtof(value, &end);
                if (*value == '\0' || *end != '\0' || errno || v != v) {
                    fatal("flag %s expects a number, got '%s'", spec->name, value);
                }
                *(float*)base = v;
                break;
            }
            case ARG_STR:
                *(const char**)base = value;
                break;
        }
    }
    return 0;
}

// Range checks that need no model or data; the rest are checked where the facts are known.
static inline void train_args_validate(const TrainArgs* a) {
    if (a->B < 1) { fatal("-b: microbatch size must be >= 1, got %d", a->B); }
    if (a->T < 1) { fatal("-t: sequence length must be >= 1, got %d", a->T); }
    if (a->total_batch < -1 || a->total_batch == 0) {
        fatal("-d: total batch must be a positive number of tokens or -1, got %lld", a->total_batch);
    }
    if (a->max_steps < -1 || a->max_steps == 0) {
        fatal("-x: steps must be >= 1 or -1 (one epoch), got %d", a->max_steps);
    }
    if (!(a->lr >= 0.0f)) { fatal("-l: learning rate must be >= 0"); }
    if (a->warmup < 0) { fatal("-u: warmup steps must be >= 0, got %d", a->warmup); }
    if (!(a->final_lr_frac >= 0.0f && a->final_lr_frac <= 1.0f)) {
        fatal("-q: final learning-rate fraction must be in [0, 1], got %g", a->final_lr_frac);
    }
    if (!(a->weight_decay >= 0.0f)) { fatal("-c: weight decay must be >= 0"); }
    if (a->val_every < 0) { fatal("-v: must be >= 0 (0 = no validation), got %d", a->val_every); }
    if (a->val_max_steps < -1 || a->val_max_steps == 0) {
        fatal("-m: validation batches must be >= 1 or -1 (all), got %d", a->val_max_steps);
    }
    if (a->sample_every < 0) { fatal("-s: must be >= 0 (0 = no sampling), got %d", a->sample_every); }
    if (a->gen_T < 1) { fatal("-g: generated tokens must be >= 1, got %d", a->gen_T); }
    if (a->checkpoint_every < 0) { fatal("-n: must be >= 0, got %d", a->checkpoint_every); }
    if (a->checkpoint_every > 0 && a->output_dir == NULL) {
        fatal("-n: checkpoints need an output directory: pass -o DIR");
    }
    if (a->resume != 0 && a->resume != 1) { fatal("-y: must be 0 or 1, got %d", a->resume); }
    if (a->resume == 1 && a->output_dir == NULL) { fatal("-y 1: resuming needs the output directory -o DIR"); }
    if (a->zero_stage < 0 || a->zero_stage > 3) { fatal("-z: ZeRO stage must be 0, 1, 2 or 3, got %d", a->zero_stage); }
    if (a->recompute != 0 && a->recompute != 1) { fatal("-r: must be 0 or 1, got %d", a->recompute); }
    if (a->overfit_single_batch != 0 && a->overfit_single_batch != 1) { fatal("-a: must be 0 or 1"); }
    if (!(a->beta1 >= 0.0f && a->beta1 < 1.0f)) { fatal("--beta1 must be in [0, 1), got %g", a->beta1); }
    if (!(a->beta2 >= 0.0f && a->beta2 < 1.0f)) { fatal("--beta2 must be in [0, 1), got %g", a->beta2); }
    if (!(a->eps > 0.0f)) { fatal("--eps must be > 0, got %g", a->eps); }
    if (!(a->grad_clip >= 0.0f)) { fatal("--grad-clip must be >= 0 (0 = off), got %g", a->grad_clip); }
    if (a->shuffle != 0 && a->shuffle != 1) { fatal("--shuffle must be 0 or 1, got %d", a->shuffle); }
    if (a->tp < 1) { fatal("--tp must be >= 1, got %d", a->tp); }
    if (a->pp < 1) { fatal("--pp must be >= 1, got %d", a->pp); }
    if (a->sp != 0 && a->sp != 1) { fatal("--sp must be 0 or 1, got %d", a->sp); }
    if (strcmp(a->pp_schedule, "1f1b") != 0 && strcmp(a->pp_schedule, "gpipe") != 0) {
        fatal("--schedule must be 1f1b or gpipe, got '%s'", a->pp_schedule);
    }
    if (a->deterministic != 0 && a->deterministic != 1) { fatal("--deterministic must be 0 or 1"); }
}

// The data flags of both trainers resolved into loaders: -i (train), -j and -m (validation
// batches, when -v > 0), and -x -1 = one epoch of -i at -d tokens per step.
static inline void train_data_open(const TrainArgs* a, int B, int T, int V, long long total_batch,
                                   DataLoader* train, DataLoader* val, int* val_batches, int* train_steps) {
    dataloader_init(train, a->train_pattern, "-i", B, T, V, a->shuffle, (uint64_t)a->seed);
    *val_batches = 0;
    if (a->val_every > 0) {
        dataloader_init(val, a->val_pattern, "-j", B, T, V, 0, 0);
        *val_batches = a->val_max_steps == -1 || a->val_max_steps > val->microbatches_per_epoch
                     ? (int)val->microbatches_per_epoch : a->val_max_steps;
    }
    *train_steps = a->max_steps;
    if (*train_steps == -1) {
        *train_steps = (int)(train->total_tokens / total_batch);
        if (*train_steps < 1) {
            fatal("-i: the train data has %lld tokens, less than one step of -d %lld tokens",
                  (long long)train->total_tokens, total_batch);
        }
    }
}

// The start-of-run summary lines both trainers print about the schedule and the data.
static inline void train_data_print_summary(const TrainArgs* a, int train_steps, const DataLoader* train,
                                            const DataLoader* val, int val_batches) {
    printf("| steps         %d (lr %g %s, warmup %d, final fraction %g, weight decay %g)\n", train_steps,
           a->lr, a->lr_schedule, a->warmup, a->final_lr_frac, a->weight_decay);
    printf("| AdamW         beta1 %g beta2 %g eps %g, grad clip %g\n", a->beta1, a->beta2, a->eps, a->grad_clip);
    printf("| train data    %s: %d shard(s), %lld tokens, shuffle %d\n", a->train_pattern,
           train->num_shards, (long long)train->total_tokens, a->shuffle);
    if (a->val_every > 0) {
        printf("| val data      %s: %lld tokens, %d batch(es) every %d steps\n", a->val_pattern,
               (long long)val->total_tokens, val_batches, a->val_every);
    }
}

#endif // LLMC_ARGS_H
