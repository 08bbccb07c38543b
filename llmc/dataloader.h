/*
 * dataloader.h: llm.c's token shards, served by GLOBAL MICROBATCH INDEX.
 *
 * Token file (llm.c): 256 int32 header [0] 20240520 magic, [1] 1 version, [2] number of
 * tokens; then that many uint16 token ids. A pattern (glob) names the shards, taken in sorted
 * order.
 *
 * Microbatch g of the stream (B sequences of T tokens, plus one target token) is defined once,
 * independently of ranks: with shuffling off it is exactly what llm.c's loader reads, in
 * order: shard s holds (ntok_s - 1) / (B*T) microbatches, microbatch j of a shard is tokens
 * [j*B*T, j*B*T + B*T + 1), shards follow each other in sorted order, and after the last
 * shard the stream starts again (epoch e = g / microbatches_per_epoch). With shuffling on,
 * epoch e visits the shards in a permutation of their order and the microbatches of each
 * shard in a permutation of theirs, both drawn from (seed, e[, shard]) by Fisher-Yates.
 * Because any rank can load any g, a data-parallel rank simply loads the indices of its
 * microbatches, and a resumed run continues at the g where the checkpoint stopped.
 * File offsets are 64-bit everywhere (shards over 2 GB work).
 *
 * Variable-length sequences (--varlen, dataloader_init_varlen): the stream is one of
 * SEQUENCES instead. Each shard is cut once, at init: from position p a sequence is
 * tokens[p:q] with q = min(p + T, the next EOT (50256) strictly after p, ntok - 1), its
 * targets tokens[p+1:q+1]; then p = q (so a sequence after a document boundary starts with
 * that EOT, as GPT-2's training data does). Shards follow each other in sorted order; an
 * epoch is every sequence of every shard, and after the last the first again. Item g of the
 * stream is sequence g % S of epoch g / S (S sequences per epoch) in file order, or with
 * shuffling in the epoch's permutation of all S, drawn from (seed, epoch). A load gives one
 * row (B = 1) of `loaded_T` <= T positions. On a shard without EOT and within the first epoch
 * sequence g is exactly row g % B of fixed-T microbatch g / B.
 */
#ifndef LLMC_DATALOADER_H
#define LLMC_DATALOADER_H

#include <glob.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/rand.h"
#include "llmc/utils.h"

#define TOKENS_MAGIC 20240520
#define TOKEN_EOT 50256          // GPT-2's <|endoftext|>: where --varlen cuts documents

typedef struct {
    const char* flag;            // the flag that named the data, for error messages ("-i")
    glob_t glob;
    int num_shards;
    int64_t* shard_tokens;
    int64_t* shard_microbatches;
    int64_t microbatches_per_epoch;
    int64_t total_tokens;
    int B, T, vocab_size;
    int shuffle;
    uint64_t seed;
    // the open shard
    FILE* file;
    int open_shard;
    // shuffle permutations of the current epoch (computed when the epoch changes)
    int64_t perm_epoch;
    int* shard_order;
    int64_t perm_shard_epoch;
    int perm_shard;
    int64_t* sample_order;
    // --varlen: the stream's sequences (file order), the shuffle's order of the current epoch
    int varlen;
    int64_t num_seqs;
    int* seq_shard;
    int64_t* seq_start;          // token offset in its shard
    int* seq_len;                // inputs (= targets) of the sequence, 1..T
    int64_t perm_seq_epoch[2];   // two epochs' orders (slot epoch % 2): a step may straddle two
    int64_t* seq_order[2];
    int loaded_T;                // positions of the loaded row(s): T, or the sequence's length
    // the loaded microbatch
    uint16_t* buffer;
    int* inputs;                 // (B, T)
    int* targets;                // (B, T)
} DataLoader;

// Validates a shard header and size; returns its token count.
static inline int64_t dataloader_check_shard_(const char* path, const char* flag) {
    FILE* f = fopen_or_die(path, "rb", "token file");
    int64_t size = file_size_or_die(f, path);
    int header[256];
    if (size < (int64_t)sizeof(header)) {
        fatal("%s: token file '%s' is truncated: %lld bytes, smaller than the 1024-byte header",
              flag, path, (long long)size);
    }
    fread_or_die(header, sizeof(int), 256, f, path);
    fclose(f);
    if (header[0] != TOKENS_MAGIC) {
        fatal("%s: token file '%s' has magic %d, expected %d (llm.c token shard)", flag, path,
              header[0], TOKENS_MAGIC);
    }
    if (header[1] != 1) {
        fatal("%s: token file '%s' has version %d, expected 1", flag, path, header[1]);
    }
    int64_t ntok = (uint32_t)header[2];
    if (size != (int64_t)sizeof(header) + 2 * ntok) {
        fatal("%s: token file '%s' is %lld bytes, expected %lld for its %lld tokens%s", flag, path,
              (long long)size, (long long)(sizeof(header) + 2 * ntok), (long long)ntok,
              size < (int64_t)sizeof(header) + 2 * ntok ? " (truncated)" : "");
    }
    return ntok;
}

// What both kinds of stream start with: the fields, the shards matching the pattern.
static inline void dataloader_open_(DataLoader* d, const char* pattern, const char* flag, int B, int T,
                                    int vocab_size, int shuffle, uint64_t seed) {
    memset(d, 0, sizeof(*d));
    d->flag = flag;
    d->B = B;
    d->T = T;
    d->vocab_size = vocab_size;
    d->shuffle = shuffle;
    d->seed = seed;
    d->open_shard = -1;
    d->perm_epoch = -1;
    d->perm_shard_epoch = -1;
    d->perm_shard = -1;
    d->perm_seq_epoch[0] = d->perm_seq_epoch[1] = -1;
    int rc = glob(pattern, 0, NULL, &d->glob);
    if (rc != 0 || d->glob.gl_pathc == 0) {
        fatal("%s: no token files match '%s' (run `make data` for tiny Shakespeare, or pass a "
              "path/glob of llm.c .bin shards)", flag, pattern);
    }
    d->num_shards = (int)d->glob.gl_pathc;
    d->shard_tokens = (int64_t*)malloc_or_die(sizeof(int64_t) * d->num_shards, "shard sizes");
}

static inline void dataloader_init(DataLoader* d, const char* pattern, const char* flag, int B, int T,
                            int vocab_size, int shuffle, uint64_t seed) {
    dataloader_open_(d, pattern, flag, B, T, vocab_size, shuffle, seed);
    d->shard_microbatches = (int64_t*)malloc_or_die(sizeof(int64_t) * d->num_shards, "shard sizes");
    int64_t tokens_per_microbatch = (int64_t)B * T;
    for (int s = 0; s < d->num_shards; s++) {
        const char* path = d->glob.gl_pathv[s];
        d->shard_tokens[s] = dataloader_check_shard_(path, flag);
        d->shard_microbatches[s] = d->shard_tokens[s] > 0
            ? (d->shard_tokens[s] - 1) / tokens_per_microbatch : 0;
        if (d->shard_microbatches[s] == 0) {
            fatal("%s: token file '%s' has %lld tokens, fewer than B*T+1 = %lld needed for one "
                  "microbatch (lower -b or -t)", flag, path, (long long)d->shard_tokens[s],
                  (long long)tokens_per_microbatch + 1);
        }
        d->microbatches_per_epoch += d->shard_microbatches[s];
        d->total_tokens += d->shard_tokens[s];
    }
    d->shard_order = (int*)malloc_or_die(sizeof(int) * d->num_shards, "shard order");
    d->buffer = (uint16_t*)malloc_or_die(sizeof(uint16_t) * (tokens_per_microbatch + 1), "tokens");
    d->inputs = (int*)malloc_or_die(sizeof(int) * tokens_per_microbatch, "inputs");
    d->targets = (int*)malloc_or_die(sizeof(int) * tokens_per_microbatch, "targets");
}

// The --varlen stream of sequences of up to T tokens cut at EOT (the header comment), B = 1.
// Every shard is read once here to find its documents' boundaries.
static inline void dataloader_init_varlen(DataLoader* d, const char* pattern, const char* flag, int T,
                                          int vocab_size, int shuffle, uint64_t seed) {
    dataloader_open_(d, pattern, flag, 1, T, vocab_size, shuffle, seed);
    d->varlen = 1;
    int64_t cap = 0;
    for (int s = 0; s < d->num_shards; s++) {
        const char* path = d->glob.gl_pathv[s];
        int64_t ntok = dataloader_check_shard_(path, flag);
        d->shard_tokens[s] = ntok;
        d->total_tokens += ntok;
        uint16_t* tok = (uint16_t*)malloc_or_die(sizeof(uint16_t) * (size_t)(ntok > 0 ? ntok : 1), "tokens");
        FILE* f = fopen_or_die(path, "rb", "token file");
        fseek_or_die(f, 1024, SEEK_SET, path);
        fread_or_die(tok, sizeof(uint16_t), (size_t)ntok, f, path);
        fclose(f);
        for (int64_t p = 0; p < ntok - 1;) {
            int64_t q = p + T < ntok - 1 ? p + T : ntok - 1;
            for (int64_t i = p + 1; i < q; i++) { if (tok[i] == TOKEN_EOT) { q = i; break; } }
            if (d->num_seqs == cap) {
                cap = cap ? 2 * cap : 1024;
                d->seq_shard = (int*)realloc(d->seq_shard, sizeof(int) * (size_t)cap);
                d->seq_start = (int64_t*)realloc(d->seq_start, sizeof(int64_t) * (size_t)cap);
                d->seq_len = (int*)realloc(d->seq_len, sizeof(int) * (size_t)cap);
                if (!d->seq_shard || !d->seq_start || !d->seq_len) { fatal("out of memory for the sequence table"); }
            }
            d->seq_shard[d->num_seqs] = s;
            d->seq_start[d->num_seqs] = p;
            d->seq_len[d->num_seqs] = (int)(q - p);
            d->num_seqs++;
            p = q;
        }
        free(tok);
    }
    if (d->num_seqs == 0) {
        fatal("%s: the token files '%s' hold no sequence (every file has fewer than 2 tokens)", flag, pattern);
    }
    d->microbatches_per_epoch = d->num_seqs;
    d->buffer = (uint16_t*)malloc_or_die(sizeof(uint16_t) * ((size_t)T + 1), "tokens");
    d->inputs = (int*)malloc_or_die(sizeof(int) * (size_t)T, "inputs");
    d->targets = (int*)malloc_or_die(sizeof(int) * (size_t)T, "targets");
}

// Fisher-Yates with the xorshift generator seeded from (seed, a, b).
static inline void dataloader_permutation_(int64_t* out, int64_t n, uint64_t seed, uint64_t a, uint64_t b) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull ^ (a + 1) * 0xD1B54A32D192ED03ull
                   ^ (b + 1) * 0x94D049BB133111EBull;
    if (state == 0) { state = 1; }
    for (int64_t i = 0; i < n; i++) { out[i] = i; }
    for (int64_t i = n - 1; i > 0; i--) {
        uint64_t r = ((uint64_t)random_u32(&state) << 32) | random_u32(&state);
        int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        int64_t t = out[i]; out[i] = out[j]; out[j] = t;
    }
}

// Which sequence of the table item g (>= 0) of a --varlen stream is.
static inline int64_t dataloader_sequence_(DataLoader* d, int64_t g) {
    int64_t epoch = g / d->num_seqs, k = g % d->num_seqs;
    if (!d->shuffle) { return k; }
    int slot = (int)(epoch % 2);
    if (d->perm_seq_epoch[slot] != epoch) {
        if (d->seq_order[slot] == NULL) {
            d->seq_order[slot] = (int64_t*)malloc_or_die(sizeof(int64_t) * (size_t)d->num_seqs, "sequence order");
        }
        dataloader_permutation_(d->seq_order[slot], d->num_seqs, d->seed, (uint64_t)epoch, 0xfffffffeull);
        d->perm_seq_epoch[slot] = epoch;
    }
    return d->seq_order[slot][k];
}

// The positions of microbatch g: T, or with --varlen its sequence's length.
static inline int dataloader_length(DataLoader* d, int64_t g) {
    return d->varlen ? d->seq_len[dataloader_sequence_(d, g)] : d->T;
}

// The targets of microbatches [first, first + n) (the token count a step's loss is divided by).
static inline int64_t dataloader_targets(DataLoader* d, int64_t first, int64_t n) {
    if (!d->varlen) { return (int64_t)d->B * d->T * n; }
    int64_t sum = 0;
    for (int64_t g = first; g < first + n; g++) { sum += dataloader_length(d, g); }
    return sum;
}

// The targets of a step of M microbatches from `first` (with overfit: microbatch 0, M times).
static inline int64_t dataloader_step_targets(DataLoader* d, int64_t first, int64_t M, int overfit) {
    return overfit ? M * dataloader_targets(d, 0, 1) : dataloader_targets(d, first, M);
}

// Reads n + 1 tokens at token offset `at` of shard `shard` into buffer, checks them against
// the vocabulary, and splits them into inputs (the first n) and targets (the last n).
static inline void dataloader_read_(DataLoader* d, int shard, int64_t at, int64_t n) {
    const char* path = d->glob.gl_pathv[shard];
    if (d->open_shard != shard) {
        if (d->file) { fclose(d->file); }
        d->file = fopen_or_die(path, "rb", "token file");
        d->open_shard = shard;
    }
    fseek_or_die(d->file, 1024 + 2 * at, SEEK_SET, path);
    fread_or_die(d->buffer, sizeof(uint16_t), (size_t)(n + 1), d->file, path);
    for (int64_t i = 0; i <= n; i++) {
        if (d->buffer[i] >= d->vocab_size) {
            fatal("%s: token file '%s' holds token id %d at token %lld, but the model's "
                  "vocabulary has V=%d ids", d->flag, path, d->buffer[i], (long long)(at + i),
                  d->vocab_size);
        }
    }
    for (int64_t i = 0; i < n; i++) {
        d->inputs[i] = d->buffer[i];
        d->targets[i] = d->buffer[i + 1];
    }
}

// Loads microbatch g (>= 0) of the stream into inputs/targets (loaded_T positions per row).
static inline void dataloader_load(DataLoader* d, int64_t g) {
    if (g < 0) {   // a corrupt data position (state_read checks saved ones; this guards every caller)
        fatal("%s: asked for microbatch %lld of the data stream: the data position is corrupt", d->flag,
              (long long)g);
    }
    if (d->varlen) {
        int64_t q = dataloader_sequence_(d, g);
        d->loaded_T = d->seq_len[q];
        dataloader_read_(d, d->seq_shard[q], d->seq_start[q], d->loaded_T);
        return;
    }
    int64_t epoch = g / d->microbatches_per_epoch;
    int64_t k = g % d->microbatches_per_epoch;
    if (d->shuffle && d->perm_epoch != epoch) {
        int64_t* tmp = (int64_t*)malloc_or_die(sizeof(int64_t) * d->num_shards, "shard order");
        dataloader_permutation_(tmp, d->num_shards, d->seed, (uint64_t)epoch, 0xffffffffull);
        for (int s = 0; s < d->num_shards; s++) { d->shard_order[s] = (int)tmp[s]; }
        free(tmp);
        d->perm_epoch = epoch;
    }
    int shard = 0, pos = 0;
    for (pos = 0; pos < d->num_shards; pos++) {
        shard = d->shuffle ? d->shard_order[pos] : pos;
        if (k < d->shard_microbatches[shard]) { break; }
        k -= d->shard_microbatches[shard];
    }
    int64_t j = k;
    if (d->shuffle) {
        if (d->perm_shard_epoch != epoch || d->perm_shard != shard) {
            free(d->sample_order);
            d->sample_order = (int64_t*)malloc_or_die(
                sizeof(int64_t) * d->shard_microbatches[shard], "microbatch order");
            dataloader_permutation_(d->sample_order, d->shard_microbatches[shard], d->seed,
                                    (uint64_t)epoch, (uint64_t)shard);
            d->perm_shard_epoch = epoch;
            d->perm_shard = shard;
        }
        j = d->sample_order[k];
    }
    d->loaded_T = d->T;
    int64_t n = (int64_t)d->B * d->T;
    dataloader_read_(d, shard, j * n, n);
}

static inline void dataloader_free(DataLoader* d) {
    if (d->file) { fclose(d->file); }
    globfree(&d->glob);
    free(d->shard_tokens);
    free(d->shard_microbatches);
    free(d->shard_order);
    free(d->sample_order);
    free(d->seq_shard);
    free(d->seq_start);
    free(d->seq_len);
    free(d->seq_order[0]);
    free(d->seq_order[1]);
    free(d->buffer);
    free(d->inputs);
    free(d->targets);
}

#endif // LLMC_DATALOADER_H
