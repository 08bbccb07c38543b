/*
 * args.h: the command line of train_gpt2 and train_gpt2cu (one table, both builds).
 *
 * llm.c's single-letter flags where llm.c has the concept (-i -j -e -o -b -t -d -x -l -u -q -k
 * -c -v -m -s -g -n -y -z -r -a), each followed by its value; new options are long options
 * (--beta1 0.9). -h / --help prints the table. An unknown flag, a missing value, a value that
 * does not parse or one outside the flag's range is one clear error line naming the flag and
 * what it accepts.
 *
 * Every number flag has its accepted range in the table: the values the trainers can act on
 * without overflowing an int (steps, microbatches per step, B*T) or training on nonsense
 * (an infinite or 1e30 learning rate, beta >= 1). Relations between flags that need no model
 * or data (B*T, microbatches per step) are checked by train_args_validate; the rest where the
 * facts are known.
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
#include "llmc/pipeline.h"

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
    float temperature;            // sampling: 1 = the model's distribution
    int top_k;                    // sampling: 0 = every token
    int kv_cache;                 // sampling: 1 = one new position per token (the same tokens)
    const char* sample_prompt;    // sampling: comma-separated token ids; NULL = <|endoftext|>
    int checkpoint_every;
    int resume;
    int zero_stage;
    int recompute;
    int overfit_single_batch;
    float beta1, beta2, eps, grad_clip;
    int shuffle;
    long long seed;
    int varlen;                   // sequences per step cut at EOT (dataloader.h); 0 = fixed-T windows
    int flexsp;                   // FlexSP: each step's sequences over the planner's groups (flexsp.h)
    const char* flexsp_policy;    // ... static | adaptive | milp (varlen_flexsp.h)
    int flexsp_tokens;            // ... the longest sequence one rank computes alone; 0 = -t
    int tp, pp, sp;               // tensor / pipeline / sequence parallelism
    int ep;                       // expert parallelism (a mixture-of-experts model)
    float aux_loss;               // alpha of the experts' load-balancing loss
    int cp;                       // context parallelism (context_parallel.h)
    const char* cp_mode;          // ... ring | a2a
    const char* pp_schedule;
    int vpp;                      // model chunks per pipeline rank; 0 = the schedule's own
    int deterministic;            // CUDA build: bit-exact mode
    const char* comm;             // CUDA build: transport of device buffers (auto, nccl, mpi)
    const char* attention;        // CUDA build, fast mode: auto, cudnn, flash
    int allow_nonfinite;          // load a model file with NaN/inf parameters
} TrainArgs;

// Checkpoint files carry the step in 8 digits (model_%08d.bin, DONE_%08d): a run longer than
// this could not resume from its own checkpoints.
#define MAX_TRAIN_STEPS 99999999
// Model dimensions (model.h config_problem) stay below this; T and -g cannot exceed maxT.
#define MAX_SEQ_LEN (1 << 20)

typedef enum { ARG_INT, ARG_LLONG, ARG_FLOAT, ARG_STR } ArgType;

// How a number flag's range [min, max] reads (all bounds inclusive unless flagged).
enum {
    ARG_OR_MINUS_ONE = 1,   // -1 is accepted too (a special meaning, see the help)
    ARG_ABOVE_MIN = 2,      // min itself is excluded: (min, max]
    ARG_BELOW_MAX = 4,      // max itself is excluded: [min, max)
    ARG_ANY_VALUE = 8,      // no range: every value of the type means something (a seed)
};

typedef struct {
    const char* name;     // "-i" or "--beta1"
    ArgType type;
    size_t offset;        // into TrainArgs
    double min, max;      // accepted range of a number flag (exact for every int bound used)
    int range_flags;      // ARG_OR_MINUS_ONE ...
    const char* help;
} ArgSpec;

#define ARG_FIELD(f) offsetof(TrainArgs, f)
#define ARG_STRING(name, field, help) {name, ARG_STR, ARG_FIELD(field), 0, 0, 0, help}
static const ArgSpec arg_specs[] = {
    ARG_STRING("-i", train_pattern, "train token files (glob)"),
    ARG_STRING("-j", val_pattern, "validation token files (glob)"),
    ARG_STRING("-e", model, "model: llm.c checkpoint file, or dN[cC][hNH][vV][tMAXT][eE][kK] for a fresh GPT-2 of depth N (e.g. d12; e8k2: a mixture of 8 experts per layer, top 2)"),
    ARG_STRING("-o", output_dir, "output dir for main.log and checkpoints"),
    {"-b", ARG_INT, ARG_FIELD(B), 1, INT_MAX, 0, "microbatch size B (sequences per rank per microbatch)"},
    {"-t", ARG_INT, ARG_FIELD(T), 1, MAX_SEQ_LEN, 0, "sequence length T (<= the model's maxT)"},
    // 2^62 >= B*T * microbatches for any B*T and microbatch count that fit an int (the
    // bound that matters, checked by train_args_validate)
    {"-d", ARG_LLONG, ARG_FIELD(total_batch), 1, 4611686018427387904.0, ARG_OR_MINUS_ONE,
     "total batch in tokens per step (at most 2^31-1 microbatches of B*T); -1 = B*T*DP (no accumulation)"},
    {"-x", ARG_INT, ARG_FIELD(max_steps), 1, MAX_TRAIN_STEPS, ARG_OR_MINUS_ONE,
     "optimizer steps (checkpoint names hold 8 digits); -1 = one epoch of the train data"},
    // AdamW moves each weight by about lr per step: beyond 1 it destroys any model
    {"-l", ARG_FLOAT, ARG_FIELD(lr), 0, 1, 0, "peak learning rate"},
    {"-u", ARG_INT, ARG_FIELD(warmup), 0, MAX_TRAIN_STEPS, 0, "learning-rate warmup steps"},
    {"-q", ARG_FLOAT, ARG_FIELD(final_lr_frac), 0, 1, 0, "final learning rate as a fraction of the peak"},
    ARG_STRING("-k", lr_schedule, "learning-rate schedule: cosine | linear | constant"),
    // decoupled decay scales a weight by 1 - lr*wd per step: with lr <= 1, wd <= 1 never flips its sign
    {"-c", ARG_FLOAT, ARG_FIELD(weight_decay), 0, 1, 0, "AdamW weight decay (2-D weights only)"},
    {"-v", ARG_INT, ARG_FIELD(val_every), 0, INT_MAX, 0, "validation loss every N steps; 0 = never"},
    {"-m", ARG_INT, ARG_FIELD(val_max_steps), 1, INT_MAX, ARG_OR_MINUS_ONE, "validation batches per evaluation; -1 = all"},
    {"-s", ARG_INT, ARG_FIELD(sample_every), 0, INT_MAX, 0, "sample text every N steps; 0 = never"},
    {"-g", ARG_INT, ARG_FIELD(gen_T), 1, MAX_SEQ_LEN, 0, "tokens to generate when sampling"},
    {"--temperature", ARG_FLOAT, ARG_FIELD(temperature), 0, 100, 0, "sampling temperature (1 = the model's distribution, as llm.c; 0 = greedy)"},
    {"--top-k", ARG_INT, ARG_FIELD(top_k), 0, INT_MAX, 0, "sample among the k most likely tokens only; 0 = all (as llm.c)"},
    {"--kv-cache", ARG_INT, ARG_FIELD(kv_cache), 0, 1, 0, "sampling: 1 = a KV cache (each token computes one position), 0 = a full forward per token; the same tokens"},
    {"-n", ARG_INT, ARG_FIELD(checkpoint_every), 0, INT_MAX, 0, "write a checkpoint every N steps (and at the end); 0 = never (needs -o)"},
    {"-y", ARG_INT, ARG_FIELD(resume), 0, 1, 0, "1 = resume from the latest checkpoint in the -o dir"},
    {"-z", ARG_INT, ARG_FIELD(zero_stage), 0, 3, 0, "ZeRO stage 0-3 (optimizer / gradient / parameter sharding over data-parallel ranks)"},
    {"-r", ARG_INT, ARG_FIELD(recompute), 0, 1, 0, "1 = recompute GELU in backward instead of storing it (less memory)"},
    {"-a", ARG_INT, ARG_FIELD(overfit_single_batch), 0, 1, 0, "1 = train on the first microbatch only (debugging)"},
    {"--beta1", ARG_FLOAT, ARG_FIELD(beta1), 0, 1, ARG_BELOW_MAX, "AdamW beta1"},
    {"--beta2", ARG_FLOAT, ARG_FIELD(beta2), 0, 1, ARG_BELOW_MAX, "AdamW beta2"},
    {"--eps", ARG_FLOAT, ARG_FIELD(eps), 0, 1, ARG_ABOVE_MIN, "AdamW epsilon"},
    // any threshold above the largest gradient norms ever seen is the same as no clipping
    {"--grad-clip", ARG_FLOAT, ARG_FIELD(grad_clip), 0, 1e6, 0, "clip the global gradient norm to this; 0 = off"},
    {"--shuffle", ARG_INT, ARG_FIELD(shuffle), 0, 1, 0, "1 = shuffle the train shards and microbatches each epoch"},
    {"--varlen", ARG_INT, ARG_FIELD(varlen), 1, INT_MAX, 0, "G: train on G variable-length sequences per step, cut at EOT, of at most -t tokens, one per microbatch (-b, -d unused); default 0 = fixed windows of -t tokens"},
    {"--flexsp", ARG_INT, ARG_FIELD(flexsp), 0, 1, 0, "1 = FlexSP (with --varlen, data parallelism, any ZeRO stage): rank 0 plans each step's groups of the data-parallel pool and assigns the sequences to them; the same bits as one rank"},
    ARG_STRING("--flexsp-policy", flexsp_policy, "FlexSP's planner: static (one group size for the run) | adaptive (the best single size per step) | milp (FlexSP's integer program, GLPK)"),
    {"--flexsp-tokens", ARG_INT, ARG_FIELD(flexsp_tokens), 0, INT_MAX, 0, "FlexSP: the longest sequence one rank's memory holds (tokens); 0 = -t"},
    {"--seed", ARG_LLONG, ARG_FIELD(seed), 0, 0, ARG_ANY_VALUE, "seed of the weight init (-e dN) and of the shuffle"},
    ARG_STRING("--prompt", sample_prompt, "sampling: the prompt as comma-separated token ids (default: <|endoftext|>); the sample continues it"),
    ARG_STRING("--tokenizer", tokenizer_path, "llm.c tokenizer file used to print samples"),
    {"--tp", ARG_INT, ARG_FIELD(tp), 1, 4096, 0, "tensor-parallel degree (Megatron column/row splits)"},
    {"--sp", ARG_INT, ARG_FIELD(sp), 0, 1, 0, "1 = Megatron sequence parallelism within the tensor-parallel group"},
    {"--pp", ARG_INT, ARG_FIELD(pp), 1, 4096, 0, "pipeline-parallel degree (stages)"},
    {"--ep", ARG_INT, ARG_FIELD(ep), 1, 4096, 0, "expert-parallel degree: the experts split over this many data-parallel ranks (a divisor of E and of the data-parallel size)"},
    // the load-balancing loss is about 1 when balanced: alpha above 100 would drown the language model
    {"--aux-loss", ARG_FLOAT, ARG_FIELD(aux_loss), 0, 100, 0, "alpha of the experts' load-balancing loss (Switch Transformer), added to each microbatch's loss"},
    ARG_STRING("--schedule", pp_schedule, "pipeline schedule: 1f1b | gpipe | interleaved (Megatron's, --vpp chunks per rank) | zb1 (zero bubble ZB-H1) | zbv (zero bubble, V-shaped, 2 chunks per rank) | dualpipev (DeepSeek's DualPipeV: V-shaped, F&B pairs, >= 2 x --pp microbatches)"),
    {"--vpp", ARG_INT, ARG_FIELD(vpp), 0, 64, 0, "model chunks (virtual pipeline stages) per pipeline rank: interleaved >= 2, zbv and dualpipev 2, others 1; 0 = the schedule's (interleaved 2)"},
    {"--cp", ARG_INT, ARG_FIELD(cp), 1, 8, 0, "context-parallel degree: 1, 2, 4 or 8 ranks split each sequence (zig-zag, 2*cp | T)"},
    ARG_STRING("--cp-mode", cp_mode, "context parallelism's attention: ring (K/V blocks around the group) | a2a (Ulysses: all-to-all to heads)"),
    {"--deterministic", ARG_INT, ARG_FIELD(deterministic), 0, 1, 0, "CUDA build: 1 = fp32 canonical kernels, bit-identical to the CPU build"},
    ARG_STRING("--comm", comm, "CUDA build: how ranks exchange device buffers: nccl (one GPU per rank), mpi (staged through host memory; ranks may share a GPU) or auto (nccl when every rank has a GPU of its own)"),
    {"--allow-nonfinite", ARG_INT, ARG_FIELD(allow_nonfinite), 0, 1, 0, "1 = load a model file whose parameters are not all finite (refused otherwise)"},
    ARG_STRING("--attention", attention, "CUDA build, fast mode: cudnn (cuDNN's fused attention), flash (our kernels) or auto (cudnn when a plan builds)"),
};
#undef ARG_STRING
#define NUM_ARG_SPECS ((int)(sizeof(arg_specs) / sizeof(arg_specs[0])))

// Model chunks per pipeline rank: --vpp, or the schedule's own (interleaved, zbv and dualpipev 2,
// else 1).
static inline int train_args_chunks(const TrainArgs* a) {
    if (a->vpp > 0) { return a->vpp; }
    return strcmp(a->pp_schedule, "interleaved") == 0 || strcmp(a->pp_schedule, "zbv") == 0 ||
           strcmp(a->pp_schedule, "dualpipev") == 0 || strcmp(a->pp_schedule, "dualpipe") == 0 ? 2 : 1;
}

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
    a->temperature = 1.0f;
    a->kv_cache = 1;
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
    a->ep = 1;
    a->aux_loss = 0.01f;
    a->cp = 1;
    a->cp_mode = "ring";
    a->flexsp_policy = "milp";
    a->pp_schedule = "1f1b";
    a->deterministic = 0;
    a->comm = "auto";
    a->attention = "auto";
}

// The values a number flag accepts, for messages and --help: "an integer in [1, 8] or -1".
static inline const char* arg_range_text(const ArgSpec* s, char* out, size_t cap) {
    int f = s->range_flags;
    if (f & ARG_ANY_VALUE) {
        snprintf(out, cap, "a 64-bit integer");
    } else if (s->type == ARG_FLOAT) {
        snprintf(out, cap, "a number in %c%g, %g%c", (f & ARG_ABOVE_MIN) ? '(' : '[', s->min, s->max,
                 (f & ARG_BELOW_MAX) ? ')' : ']');
    } else {   // integer bounds are below 2^63 and exact in a double: %.0f prints them exactly
        snprintf(out, cap, "an integer in [%.0f, %.0f]%s", s->min, s->max, (f & ARG_OR_MINUS_ONE) ? " or -1" : "");
    }
    return out;
}

// NaN is in no range (every comparison with it is false).
static inline int arg_in_range(const ArgSpec* s, double v) {
    int f = s->range_flags;
    if (f & ARG_ANY_VALUE) { return 1; }
    if ((f & ARG_OR_MINUS_ONE) && v == -1.0) { return 1; }
    int above = (f & ARG_ABOVE_MIN) ? v > s->min : v >= s->min;
    int below = (f & ARG_BELOW_MAX) ? v < s->max : v <= s->max;
    return above && below;
}

__attribute__((noreturn))
static inline void arg_out_of_range(const ArgSpec* s, const char* value) {
    char range[96];
    fatal("%s: expected %s, got '%s' (%s)", s->name, arg_range_text(s, range, sizeof(range)), value, s->help);
}

// The value of flag s in *a as text (floats exactly: %.9g), "none" for an unset string.
static inline void train_arg_value_text(const ArgSpec* s, const TrainArgs* a, char* out, size_t len) {
    const char* base = (const char*)a + s->offset;
    switch (s->type) {
        case ARG_INT: snprintf(out, len, "%d", *(const int*)base); break;
        case ARG_LLONG: snprintf(out, len, "%lld", *(const long long*)base); break;
        case ARG_FLOAT: snprintf(out, len, "%.9g", *(const float*)base); break;
        case ARG_STR: {
            const char* v = *(const char* const*)base;
            snprintf(out, len, "%s", v ? v : "none");
            break;
        }
    }
}

static inline void train_args_print_help(const char* prog, const TrainArgs* defaults) {
    printf("usage: %s [options]\n\n", prog);
    printf("Trains GPT-2 on llm.c token shards, single rank or under mpirun (DP x CP x TP x PP).\n\n");
    for (int i = 0; i < NUM_ARG_SPECS; i++) {
        const ArgSpec* s = &arg_specs[i];
        char def[256], range[96] = "";
        train_arg_value_text(s, defaults, def, sizeof(def));
        if (s->type == ARG_FLOAT) { snprintf(def, sizeof(def), "%g", *(const float*)((const char*)defaults + s->offset)); }
        if (s->type != ARG_STR) { arg_range_text(s, range, sizeof(range)); }
        const char* meta = s->type == ARG_STR ? "<str>" : s->type == ARG_FLOAT ? "<float>" : "<int>";
        printf("  %-16s %-7s %s (default: %s%s%s)\n", s->name, meta, s->help, def, range[0] ? "; " : "", range);
    }
    printf("  %-16s %-7s %s\n", "-h, --help", "", "this help");
}

// Parses argv into *a (which holds the defaults). Returns 1 if help was requested. Every value
// is checked against its flag's range here, where the text the user typed can be quoted.
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
            case ARG_INT:
            case ARG_LLONG: {
                long long v = strtoll(value, &end, 10);
                if (*value == '\0' || *end != '\0') {
                    fatal("flag %s expects an integer, got '%s'", spec->name, value);
                }
                // ERANGE: beyond 64 bits, so beyond every range (a seed too: it is 64 bits)
                if (errno == ERANGE || !arg_in_range(spec, (double)v)) { arg_out_of_range(spec, value); }
                if (spec->type == ARG_INT) { *(int*)base = (int)v; }   // the range is within int
                else { *(long long*)base = v; }
                break;
            }
            case ARG_FLOAT: {
                // ERANGE is left to the range: an overflow gives +-HUGE_VAL (out of every
                // range), an underflow a tiny value, which the float check below judges
                double v = strtod(value, &end);
                if (*value == '\0' || *end != '\0') {
                    fatal("flag %s expects a number, got '%s'", spec->name, value);
                }
                // the double first (converting one beyond float's range is undefined), then
                // the float the trainer will use (1e-50 is > 0 but becomes 0.0f)
                if (!arg_in_range(spec, v) || !arg_in_range(spec, (float)v)) { arg_out_of_range(spec, value); }
                *(float*)base = (float)v;
                break;
            }
            case ARG_STR:
                if (*value == '\0') { fatal("flag %s expects a non-empty value (%s)", spec->name, spec->help); }
                *(const char**)base = value;
                break;
        }
    }
    return 0;
}

// Checks between flags that need no model or data (each flag's own range is checked by
// train_args_parse); the rest are checked where the facts are known.
static inline void train_args_validate(const TrainArgs* a) {
    long long tokens_per_microbatch = (long long)a->B * a->T;
    if (tokens_per_microbatch > INT_MAX) {   // the kernels index a microbatch's B*T tokens with an int
        fatal("-b/-t: B*T = %d*%d = %lld tokens per microbatch; at most %d", a->B, a->T,
              tokens_per_microbatch, INT_MAX);
    }
    if (a->total_batch != -1 && a->total_batch / tokens_per_microbatch > INT_MAX) {
        fatal("-d: %lld tokens per step is %lld microbatches of B*T = %lld tokens; at most %d", a->total_batch,
              a->total_batch / tokens_per_microbatch, tokens_per_microbatch, INT_MAX);
    }
    if (a->checkpoint_every > 0 && a->output_dir == NULL) {
        fatal("-n: checkpoints need an output directory: pass -o DIR");
    }
    if (a->resume == 1 && a->output_dir == NULL) { fatal("-y 1: resuming needs the output directory -o DIR"); }
    if (strcmp(a->comm, "auto") != 0 && strcmp(a->comm, "nccl") != 0 && strcmp(a->comm, "mpi") != 0) {
        fatal("--comm must be auto, nccl or mpi, got '%s'", a->comm);
    }
    if (strcmp(a->attention, "auto") != 0 && strcmp(a->attention, "cudnn") != 0 && strcmp(a->attention, "flash") != 0) {
        fatal("--attention must be auto, cudnn or flash, got '%s'", a->attention);
    }
    PipelineScheduleKind kind;
    char err[256];
    if (pipeline_parse_schedule(a->pp_schedule, &kind, err, sizeof(err)) != 0) { fatal("--schedule: %s", err); }
    int chunks = train_args_chunks(a);
    int own_chunks = kind == PP_ZBV || kind == PP_DUALPIPEV || kind == PP_DUALPIPE ? 2 : 1;
    if (kind != PP_INTERLEAVED && chunks != own_chunks) {
        fatal("--vpp %d: the %s schedule runs %d model chunk(s) per pipeline rank; --vpp is for --schedule "
              "interleaved", a->vpp, a->pp_schedule, own_chunks);
    }
    if (kind == PP_INTERLEAVED && chunks < 2) {
        fatal("--vpp %d: the interleaved schedule needs at least 2 model chunks per pipeline rank", a->vpp);
    }
    if (a->cp != 1 && a->cp != 2 && a->cp != 4 && a->cp != 8) {
        fatal("--cp %d: the context-parallel degree must be 1, 2, 4 or 8 (a divisor of the 8 canonical chunks)", a->cp);
    }
    if (strcmp(a->flexsp_policy, "static") != 0 && strcmp(a->flexsp_policy, "adaptive") != 0 &&
        strcmp(a->flexsp_policy, "milp") != 0) {
        fatal("--flexsp-policy: expected static, adaptive or milp, got '%s'", a->flexsp_policy);
    }
    if (strcmp(a->cp_mode, "ring") != 0 && strcmp(a->cp_mode, "a2a") != 0) {
        fatal("--cp-mode must be ring or a2a, got '%s'", a->cp_mode);
    }
}

// The data flags of both trainers resolved into loaders: -i (train), -j and -m (validation
// batches, when -v > 0), and -x -1 = one epoch of -i at -d tokens per step.
// With --varlen a batch is G sequences: -m batches validate on the first m*G sequences of -j,
// and an epoch is the train data's sequences over G.
static inline void train_data_open(const TrainArgs* a, int B, int T, int V, long long total_batch,
                                   DataLoader* train, DataLoader* val, int* val_batches, int* train_steps) {
    if (a->varlen) {
        dataloader_init_varlen(train, a->train_pattern, "-i", T, V, a->shuffle, (uint64_t)a->seed);
    } else {
        dataloader_init(train, a->train_pattern, "-i", B, T, V, a->shuffle, (uint64_t)a->seed);
    }
    *val_batches = 0;
    if (a->val_every > 0) {
        if (a->varlen) {
            dataloader_init_varlen(val, a->val_pattern, "-j", T, V, 0, 0);
            long long m = a->val_max_steps == -1 ? -1 : (long long)a->val_max_steps * a->varlen;
            if (m == -1 || m > val->num_seqs) { m = val->num_seqs; }
            if (m > INT_MAX) { fatal("-m: %lld validation sequences (-m x --varlen, or all of -j); at most %d", m, INT_MAX); }
            *val_batches = (int)m;
        }
    }
    if (a->val_every > 0 && !a->varlen) {
        dataloader_init(val, a->val_pattern, "-j", B, T, V, 0, 0);
        int64_t all = val->microbatches_per_epoch;
        if (a->val_max_steps == -1 && all > INT_MAX) {
            fatal("-m -1: the validation data -j holds %lld batches, more than %d; pass -m N",
                  (long long)all, INT_MAX);
        }
        *val_batches = a->val_max_steps == -1 || a->val_max_steps > all ? (int)all : a->val_max_steps;
    }
    *train_steps = a->max_steps;
    if (*train_steps == -1) {
        long long epoch_steps = a->varlen ? train->num_seqs / a->varlen : train->total_tokens / total_batch;
        if (epoch_steps < 1 && a->varlen) {
            fatal("-i: the train data has %lld sequences, fewer than one step of --varlen %d", (long long)train->num_seqs,
                  a->varlen);
        }
        if (epoch_steps < 1) {
            fatal("-i: the train data has %lld tokens, less than one step of -d %lld tokens",
                  (long long)train->total_tokens, total_batch);
        }
        if (epoch_steps > MAX_TRAIN_STEPS) {
            fatal("-x -1: one epoch of -i is %lld steps of -d %lld tokens, more than %d (checkpoint "
                  "names hold 8 digits); pass -x N or a larger -d", epoch_steps, total_batch, MAX_TRAIN_STEPS);
        }
        *train_steps = (int)epoch_steps;
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
