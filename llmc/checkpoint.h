/*
 * checkpoint.h: llm.c's model checkpoint format, and our layout-independent optimizer state.
 *
 * MODEL FILE (llm.c, read and written): 256 int32 header
 *   [0] 20240326 magic  [1] version: 3 = fp32, 5 = bf16 (read only), 7 = fp32 mixture of
 *   experts (ours: llm.c's readers refuse it)  [2] maxT  [3] V  [4] L  [5] NH  [6] C  [7] Vp
 *   [8] E experts  [9] k chosen per position (version 7 only; the rest zero)
 * followed by the parameter tensors in FILE order (see model.h), fp32 or bf16: llm.c's 16, and
 * with experts routerw after ln2b and E blocks in each of fcw, fcb, fcprojw, fcprojb.
 *
 * STATE FILE (ours; "state_%08d_%05d.bin" per piece like llm.c's per-rank state files): what
 * a resumed run needs beyond the model: AdamW m and v, the step, and the data position.
 * m and v are indexed by the flat canonical (MEMORY order, model.h) parameter index. Each
 * piece holds a list of ranges [begin, end) of that index (a ZeRO rank: its shard of every
 * unit); together the pieces of a step cover every parameter exactly once. Any layout reads
 * the ranges it owns from whichever pieces hold them, so a state written by 4 ranks with
 * ZeRO-3 resumes on 2 ranks with ZeRO-1, or on one.
 *   header 256 int32: [0] 20240527 magic (llm.c's state magic)  [1] 101 version (ours; llm.c
 *   uses 1, so neither program mistakes the other's file)  [2] number of pieces  [3] this
 *   piece  [4..9] L C NH V Vp maxT  [10] step (int64)  [12] P (int64)  [14] number of ranges
 *   R  [18] microbatches consumed (int64)  [20] tokens per microbatch (int64)  [22] shuffle
 *   [23] shuffle seed (uint64)  [25] E  [26] k  (int64 values take two int32 slots)
 *   then R pairs of int64 (begin, end), then m of every range in order, then v likewise.
 *
 * Every file is written atomically (utils.h AtomicWriter): a crash mid-save never damages the
 * last good checkpoint. A checkpoint step is complete when its DONE_%08d marker exists.
 */
#ifndef LLMC_CHECKPOINT_H
#define LLMC_CHECKPOINT_H

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "llmc/model.h"
#include "llmc/utils.h"

#define MODEL_MAGIC 20240326
#define STATE_MAGIC 20240527
#define STATE_VERSION 101

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct {
    FILE* f;
    const char* path;
    float* params;
    int bf16;
} ReadPiecesCtx;

static inline void read_piece(int tensor, int layer, size_t offset, size_t elements, void* vctx) {
    ReadPiecesCtx* ctx = (ReadPiecesCtx*)vctx;
    if (!ctx->bf16) {
        fread_or_die(ctx->params + offset, sizeof(float), elements, ctx->f, ctx->path);
        return;
    }
    uint16_t buf[4096];
    for (size_t i = 0; i < elements; i += 4096) {
        size_t n = elements - i < 4096 ? elements - i : 4096;
        fread_or_die(buf, sizeof(uint16_t), n, ctx->f, ctx->path);
        for (size_t j = 0; j < n; j++) { ctx->params[offset + i + j] = bf16_to_float(buf[j]); }
    }
}

// Reads the header of a model file into *config; returns the version (3 or 5). Dies with a
// clear message on a wrong magic/version, an impossible configuration or a wrong file size.
static inline int checkpoint_read_header(FILE* f, const char* path, GPT2Config* config) {
    int64_t size = file_size_or_die(f, path);
    int header[256];
    if (size < (int64_t)sizeof(header)) {
        fatal("model file '%s' is truncated: %lld bytes, smaller than the 1024-byte header",
              path, (long long)size);
    }
    fread_or_die(header, sizeof(int), 256, f, path);
    if (header[0] != MODEL_MAGIC) {
        fatal("model file '%s' has magic %d, expected %d (an llm.c GPT-2 checkpoint)", path,
              header[0], MODEL_MAGIC);
    }
    if (header[1] != 3 && header[1] != 5 && header[1] != 7) {
        fatal("model file '%s' has version %d, expected 3 (fp32), 5 (bf16) or 7 (fp32, mixture of experts)", path,
              header[1]);
    }
    config->max_seq_len = header[2];
    config->vocab_size = header[3];
    config->num_layers = header[4];
    config->num_heads = header[5];
    config->channels = header[6];
    config->padded_vocab_size = header[7];
    config->num_experts = header[1] == 7 ? header[8] : 0;
    config->top_k = header[1] == 7 ? header[9] : 0;
    config->aux_loss_coef = 0.0f;
    if (header[1] == 7 && config->num_experts < 1) {
        fatal("model file '%s' is version 7 (mixture of experts) but says E = %d experts", path, header[8]);
    }
    const char* problem = config_problem(config);
    if (problem) { fatal("model file '%s' has an invalid header: %s", path, problem); }
    int64_t expected = 1024 + (int64_t)param_count(config) * (header[1] == 5 ? 2 : 4);
    if (size != expected) {
        fatal("model file '%s' is %lld bytes, expected %lld for its header (L=%d C=%d V=%d Vp=%d "
              "maxT=%d, version %d)%s", path, (long long)size, (long long)expected,
              config->num_layers, config->channels, config->vocab_size,
              config->padded_vocab_size, config->max_seq_len, header[1],
              size < expected ? ": truncated" : "");
    }
    return header[1];
}

// Reads a model checkpoint; returns the parameters (MEMORY order, malloc'd, P floats).
static inline float* checkpoint_read_model(const char* path, GPT2Config* config) {
    FILE* f = fopen_or_die(path, "rb", "model checkpoint");
    int version = checkpoint_read_header(f, path, config);
    float* params = (float*)aligned_calloc_or_die(param_count(config) * sizeof(float), "parameters");
    ReadPiecesCtx ctx = {f, path, params, version == 5};
    param_for_each_in_file_order(config, read_piece, &ctx);
    fclose(f);
    return params;
}

typedef struct {
    AtomicWriter* w;
    const float* params;
} WritePiecesCtx;

static inline void write_piece(int tensor, int layer, size_t offset, size_t elements, void* vctx) {
    WritePiecesCtx* ctx = (WritePiecesCtx*)vctx;
    atomic_writer_write(ctx->w, ctx->params + offset, elements * sizeof(float));
}

// Writes an fp32 llm.c checkpoint (version 3; version 7 with experts), atomically.
static inline void checkpoint_write_model(const char* path, const GPT2Config* config, const float* params) {
    int header[256];
    memset(header, 0, sizeof(header));
    header[0] = MODEL_MAGIC;
    header[1] = config->num_experts > 0 ? 7 : 3;
    header[2] = config->max_seq_len;
    header[3] = config->vocab_size;
    header[4] = config->num_layers;
    header[5] = config->num_heads;
    header[6] = config->channels;
    header[7] = config->padded_vocab_size;
    if (config->num_experts > 0) {
        header[8] = config->num_experts;
        header[9] = config->top_k;
    }
    AtomicWriter w;
    atomic_writer_open(&w, path);
    atomic_writer_write(&w, header, sizeof(header));
    WritePiecesCtx ctx = {&w, params};
    param_for_each_in_file_order(config, write_piece, &ctx);
    atomic_writer_commit(&w);
}

// --- optimizer state ----------------------------------------------------------------------

typedef struct {
    int64_t step;                 // optimizer steps done
    int64_t microbatches_done;    // global microbatches consumed by the train loader
    int64_t tokens_per_microbatch;
    int shuffle;
    uint64_t shuffle_seed;
} TrainProgress;

static inline void put_i64(int* h, int slot, int64_t v) { memcpy(&h[slot], &v, 8); }
static inline int64_t get_i64(const int* h, int slot) { int64_t v; memcpy(&v, &h[slot], 8); return v; }

// One range [begin, end) of the canonical parameter index, with its m and v values.
typedef struct {
    int64_t begin, end;
    float* m;
    float* v;
} StateRange;

// Writes piece `piece` of `num_pieces`, holding `nranges` ranges.
static inline void state_write_piece(const char* path, const GPT2Config* c, const TrainProgress* prog,
                                     int num_pieces, int piece, int nranges, const StateRange* ranges) {
    int h[256];
    memset(h, 0, sizeof(h));
    h[0] = STATE_MAGIC;
    h[1] = STATE_VERSION;
    h[2] = num_pieces;
    h[3] = piece;
    h[4] = c->num_layers; h[5] = c->channels; h[6] = c->num_heads;
    h[7] = c->vocab_size; h[8] = c->padded_vocab_size; h[9] = c->max_seq_len;
    put_i64(h, 10, prog->step);
    put_i64(h, 12, (int64_t)param_count(c));
    h[14] = nranges;
    put_i64(h, 18, prog->microbatches_done);
    put_i64(h, 20, prog->tokens_per_microbatch);
    h[22] = prog->shuffle;
    memcpy(&h[23], &prog->shuffle_seed, 8);
    h[25] = c->num_experts;
    h[26] = c->top_k;
    AtomicWriter w;
    atomic_writer_open(&w, path);
    atomic_writer_write(&w, h, sizeof(h));
    for (int r = 0; r < nranges; r++) {
        int64_t be[2] = {ranges[r].begin, ranges[r].end};
        atomic_writer_write(&w, be, sizeof(be));
    }
    for (int r = 0; r < nranges; r++) {
        atomic_writer_write(&w, ranges[r].m, (size_t)(ranges[r].end - ranges[r].begin) * sizeof(float));
    }
    for (int r = 0; r < nranges; r++) {
        atomic_writer_write(&w, ranges[r].v, (size_t)(ranges[r].end - ranges[r].begin) * sizeof(float));
    }
    atomic_writer_commit(&w);
}

static inline int train_progress_equal_(const TrainProgress* a, const TrainProgress* b) {
    return a->step == b->step && a->microbatches_done == b->microbatches_done &&
           a->tokens_per_microbatch == b->tokens_per_microbatch && a->shuffle == b->shuffle &&
           a->shuffle_seed == b->shuffle_seed;
}

static inline void state_read_progress_(const int* h, TrainProgress* p) {
    p->step = get_i64(h, 10);
    p->microbatches_done = get_i64(h, 18);
    p->tokens_per_microbatch = get_i64(h, 20);
    p->shuffle = h[22];
    memcpy(&p->shuffle_seed, &h[23], 8);
}

// What the progress of any run satisfies, whatever its flags. The step must be the one the
// file name and the DONE marker give: a step of -5 or 2^31 would train from a wrong step (lr
// -inf, NaN models written over good checkpoints) or for ~2^31 steps. A microbatch count
// outside [step, step * (2^31-1)] (every step consumes 1 to 2^31-1 microbatches) would make
// the data loader index out of bounds (a negative count) or train on the file header.
static inline void state_check_progress_(const char* path, int step, const TrainProgress* p) {
    if (p->step != step) {
        fatal("state file '%s' says step %lld, but its name and DONE marker say step %d", path,
              (long long)p->step, step);
    }
    if (p->tokens_per_microbatch < 1 || p->tokens_per_microbatch > INT_MAX) {
        fatal("state file '%s' says %lld tokens per microbatch, expected 1..%d", path,
              (long long)p->tokens_per_microbatch, INT_MAX);
    }
    if (p->shuffle != 0 && p->shuffle != 1) {
        fatal("state file '%s' says shuffle %d, expected 0 or 1", path, p->shuffle);
    }
    if (p->microbatches_done < step || p->microbatches_done > (int64_t)step * INT_MAX) {
        fatal("state file '%s' says %lld microbatches were consumed in %d steps; every step consumes "
              "1 to %d", path, (long long)p->microbatches_done, step, INT_MAX);
    }
}

// A range some piece lists, remembered for the check that the pieces tile [0, P).
typedef struct {
    int64_t begin, end;
    int piece;
} StateListedRange;

static inline int state_listed_range_cmp_(const void* a, const void* b) {
    const StateListedRange* x = (const StateListedRange*)a;
    const StateListedRange* y = (const StateListedRange*)b;
    if (x->begin != y->begin) { return x->begin < y->begin ? -1 : 1; }
    if (x->end != y->end) { return x->end < y->end ? -1 : 1; }
    return 0;
}

// Every parameter must be in exactly one range of one piece: a sum of range lengths equal to
// P is not enough (a range listed twice hides a gap, whose moments would never be loaded).
static inline void state_check_tiling_(const char* dir, int step, int64_t P, StateListedRange* listed,
                                       size_t n) {
    if (n > 0) { qsort(listed, n, sizeof(*listed), state_listed_range_cmp_); }   // listed is NULL when n is 0
    int64_t covered = 0;   // [0, covered) is tiled so far
    int last_piece = 0;    // the piece that covers parameter covered-1
    for (size_t i = 0; i < n; i++) {
        const StateListedRange* r = &listed[i];
        if (r->begin == r->end) { continue; }   // holds nothing; allowed anywhere
        if (r->begin < covered) {
            char this_file[1200], other_file[1200];
            snprintf(this_file, sizeof(this_file), "%s/state_%08d_%05d.bin", dir, step, r->piece);
            snprintf(other_file, sizeof(other_file), "%s/state_%08d_%05d.bin", dir, step, last_piece);
            fatal("state file '%s' lists parameters %lld..%lld, which '%s' lists too: every parameter "
                  "must be in exactly one range", this_file, (long long)r->begin,
                  (long long)(r->end < covered ? r->end : covered), other_file);
        }
        if (r->begin > covered) { break; }
        covered = r->end;
        last_piece = r->piece;
    }
    if (covered != P) {
        int64_t gap_end = P;
        for (size_t i = 0; i < n; i++) {
            if (listed[i].begin > covered) { gap_end = listed[i].begin; break; }
        }
        fatal("state files of step %d in '%s' hold no optimizer state for parameters %lld..%lld (of "
              "%lld): a piece is missing or corrupt", step, dir, (long long)covered, (long long)gap_end,
              (long long)P);
    }
}

// AdamW's moments as a file holds them: m finite, v finite and >= 0 (sqrt(v) divides the update).
static inline void state_check_moments_(const char* path, const float* m, const float* v, size_t n,
                                        int64_t first_param) {
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(m[i])) {
            fatal("state file '%s' holds first moment m = %g for parameter %lld: expected a finite number",
                  path, m[i], (long long)(first_param + (int64_t)i));
        }
        if (!isfinite(v[i]) || !(v[i] >= 0.0f)) {
            fatal("state file '%s' holds second moment v = %g for parameter %lld: expected a finite "
                  "number >= 0", path, v[i], (long long)(first_param + (int64_t)i));
        }
    }
}

// Reads the pieces "DIR/state_STEP_*.bin" of the checkpoint whose DONE marker says STEP: fills
// m and v of every range in `want` (the caller's own ranges) and *prog. Dies naming the file
// unless the pieces belong to this model and to each other, say step STEP, hold a possible
// data position (state_check_progress_), list ranges that tile every parameter exactly once,
// and hold finite moments (v >= 0) in the ranges read. The run's own flags are checked
// against *prog by train_progress_check.
static inline void state_read(const char* dir, int step, const GPT2Config* c, int nwant,
                              StateRange* want, TrainProgress* prog) {
    char path[1200];
    int num_pieces = 1;
    int64_t P = (int64_t)param_count(c);
    StateListedRange* listed = NULL;   // every range of every piece, for the tiling check
    size_t nlisted = 0, listed_cap = 0;
    for (int piece = 0; piece < num_pieces; piece++) {
        snprintf(path, sizeof(path), "%s/state_%08d_%05d.bin", dir, step, piece);
        FILE* f = fopen_or_die(path, "rb", "optimizer state");
        int64_t size = file_size_or_die(f, path);
        int h[256];
        if (size < (int64_t)sizeof(h)) { fatal("state file '%s' is truncated", path); }
        fread_or_die(h, sizeof(int), 256, f, path);
        if (h[0] != STATE_MAGIC || h[1] != STATE_VERSION) {
            fatal("state file '%s' has magic %d version %d, expected %d version %d", path, h[0],
                  h[1], STATE_MAGIC, STATE_VERSION);
        }
        if (h[4] != c->num_layers || h[5] != c->channels || h[6] != c->num_heads ||
            h[7] != c->vocab_size || h[8] != c->padded_vocab_size || h[9] != c->max_seq_len ||
            h[25] != c->num_experts || h[26] != c->top_k || get_i64(h, 12) != P) {
            fatal("state file '%s' belongs to a different model (L=%d C=%d NH=%d V=%d Vp=%d maxT=%d E=%d k=%d)",
                  path, h[4], h[5], h[6], h[7], h[8], h[9], h[25], h[26]);
        }
        TrainProgress here;
        state_read_progress_(h, &here);
        if (piece == 0) {
            num_pieces = h[2];
            if (num_pieces < 1 || num_pieces > 1 << 20) {
                fatal("state file '%s' claims %d pieces", path, num_pieces);
            }
            state_check_progress_(path, step, &here);
            *prog = here;
        } else if (h[2] != num_pieces || !train_progress_equal_(&here, prog)) {
            fatal("state file '%s' does not belong with piece 0 of step %d (a different piece count, "
                  "step or data position)", path, step);
        }
        if (h[3] != piece) { fatal("state file '%s' says it is piece %d", path, h[3]); }
        int nranges = h[14];
        if (nranges < 0 || nranges > 1 << 24 || size < (int64_t)sizeof(h) + 16 * (int64_t)nranges) {
            fatal("state file '%s' is corrupt or truncated (%d ranges)", path, nranges);
        }
        int64_t* be = (int64_t*)malloc_or_die(16 * (size_t)nranges + 16, "state ranges");
        fread_or_die(be, sizeof(int64_t), 2 * (size_t)nranges, f, path);
        if (nlisted + (size_t)nranges > listed_cap) {
            listed_cap = 2 * (nlisted + (size_t)nranges);
            listed = (StateListedRange*)realloc(listed, listed_cap * sizeof(*listed));
            if (listed == NULL) { fatal("out of memory reading the ranges of state file '%s'", path); }
        }
        int64_t floats = 0;
        for (int r = 0; r < nranges; r++) {
            if (be[2 * r] < 0 || be[2 * r + 1] < be[2 * r] || be[2 * r + 1] > P) {
                fatal("state file '%s' has an invalid range %lld..%lld", path,
                      (long long)be[2 * r], (long long)be[2 * r + 1]);
            }
            floats += be[2 * r + 1] - be[2 * r];
            listed[nlisted].begin = be[2 * r];
            listed[nlisted].end = be[2 * r + 1];
            listed[nlisted++].piece = piece;
        }
        int64_t data = (int64_t)sizeof(h) + 16 * (int64_t)nranges;
        if (size != data + 8 * floats) {
            fatal("state file '%s' is %lld bytes, expected %lld for its ranges", path,
                  (long long)size, (long long)(data + 8 * floats));
        }
        int64_t at = 0;   // float offset of range r's data within the m (or v) block
        for (int r = 0; r < nranges; r++) {
            int64_t pb = be[2 * r], pe = be[2 * r + 1];
            for (int k = 0; k < nwant; k++) {
                int64_t lo = pb > want[k].begin ? pb : want[k].begin;
                int64_t hi = pe < want[k].end ? pe : want[k].end;
                if (lo >= hi) { continue; }
                float* m = want[k].m + (lo - want[k].begin);
                float* v = want[k].v + (lo - want[k].begin);
                fseek_or_die(f, data + 4 * (at + lo - pb), SEEK_SET, path);
                fread_or_die(m, sizeof(float), (size_t)(hi - lo), f, path);
                fseek_or_die(f, data + 4 * (floats + at + lo - pb), SEEK_SET, path);
                fread_or_die(v, sizeof(float), (size_t)(hi - lo), f, path);
                state_check_moments_(path, m, v, (size_t)(hi - lo), lo);
            }
            at += pe - pb;
        }
        free(be);
        fclose(f);
    }
    state_check_tiling_(dir, step, P, listed, nlisted);
    free(listed);
}

// Checks the progress a resumed run read (state_read) against the run's own flags; dies
// naming the flag that differs. M: microbatches per optimizer step over all ranks (-d / (B*T));
// train_steps: the run's last step (-x). The data position is only right if every step of
// the checkpointed run took M microbatches of B*T tokens, drawn with the same shuffle and seed.
static inline void train_progress_check(const TrainProgress* saved, const char* dir, int64_t M,
                                        int64_t tokens_per_microbatch, int shuffle, uint64_t seed,
                                        int train_steps) {
    if (saved->tokens_per_microbatch != tokens_per_microbatch) {
        fatal("-b/-t: the checkpoint in '%s' was trained with B*T = %lld tokens per microbatch, this run "
              "has %lld; resume with the same -b and -t", dir, (long long)saved->tokens_per_microbatch,
              (long long)tokens_per_microbatch);
    }
    if (saved->shuffle != shuffle) {
        fatal("--shuffle: the checkpoint in '%s' was trained with --shuffle %d; resume with it", dir,
              saved->shuffle);
    }
    if (saved->shuffle_seed != seed) {
        fatal("--seed: the checkpoint in '%s' was trained with --seed %lld; resume with it", dir,
              (long long)saved->shuffle_seed);
    }
    if (saved->microbatches_done != saved->step * M) {
        fatal("-d: the checkpoint in '%s' consumed %lld microbatches in %lld steps, but this run takes %lld "
              "per step (-d %lld): resume with the -d it was trained with", dir,
              (long long)saved->microbatches_done, (long long)saved->step, (long long)M,
              (long long)(M * tokens_per_microbatch));
    }
    if (saved->step > train_steps) {
        fatal("-x: the checkpoint in '%s' is at step %lld, past this run's last step %d; raise -x", dir,
              (long long)saved->step, train_steps);
    }
}

// Whether `name` starts with `pattern`, where '#' stands for any digit; *rest: what follows.
static inline int checkpoint_name_prefix_(const char* name, const char* pattern, const char** rest) {
    for (; *pattern; pattern++, name++) {
        if (*pattern == '#' ? !isdigit((unsigned char)*name) : *name != *pattern) { return 0; }
    }
    *rest = name;
    return 1;
}

// The highest step with a DONE_%08d marker in dir, or -1.
static inline int checkpoint_latest_step(const char* dir) {
    DIR* d = opendir(dir);
    if (d == NULL) { return -1; }
    int best = -1;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        const char* rest;
        if (checkpoint_name_prefix_(e->d_name, "DONE_########", &rest) && *rest == '\0') {
            int step = atoi(e->d_name + 5);
            if (step > best) { best = step; }
        }
    }
    closedir(d);
    return best;
}

// Removes the temporary files ("NAME.tmp.PID", utils.h AtomicWriter) that a killed checkpoint
// save left in dir: only names of checkpoint files (model_, state_, DONE_) and only when
// process PID is gone (a live one may be saving right now). Says so in one line; returns the
// count. Call it at the start of a run that writes checkpoints to dir, before any rank saves.
static inline int checkpoint_remove_orphans(const char* dir) {
    static const char* const patterns[] = {"model_########.bin", "state_########_#####.bin", "DONE_########"};
    DIR* d = opendir(dir);
    if (d == NULL) { return 0; }
    int removed = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        const char* rest = NULL;
        for (int p = 0; p < 3 && rest == NULL; p++) { checkpoint_name_prefix_(e->d_name, patterns[p], &rest); }
        const char* suffix = ".tmp.";
        if (rest == NULL || strncmp(rest, suffix, strlen(suffix)) != 0) { continue; }
        const char* pid_text = rest + strlen(suffix);
        char* end;
        long pid = strtol(pid_text, &end, 10);
        if (!isdigit((unsigned char)pid_text[0]) || *end != '\0' || pid <= 0 || pid > INT_MAX ||
            pid == (long)getpid()) {
            continue;
        }
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) { continue; }   // alive (EPERM: another user's)
        char path[1200];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (unlink(path) == 0) { removed++; }
    }
    closedir(d);
    if (removed > 0) {
        printf("removed %d temporary file(s) left in '%s' by an interrupted checkpoint save (the "
               "process that wrote them is gone)\n", removed, dir);
    }
    return removed;
}

static inline void checkpoint_write_done(const char* dir, int step) {
    char path[1200];
    snprintf(path, sizeof(path), "%s/DONE_%08d", dir, step);
    AtomicWriter w;
    atomic_writer_open(&w, path);
    atomic_writer_commit(&w);
}

#endif // LLMC_CHECKPOINT_H
