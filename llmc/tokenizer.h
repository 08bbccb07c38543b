/*
 * tokenizer.h: GPT-2's tokenizer as the trainer uses it: decoding token ids to bytes, from
 * llm.c's tokenizer file (gpt2_tokenizer.bin), to print samples. Header-only (C11). The
 * encoder (text -> ids, from GPT-2's encoder.json and vocab.bpe) is llmc/bpe_encoder.h, which
 * the trainer does not include.
 *
 *      Tokenizer t;
 *      tokenizer_init(&t, "gpt2_tokenizer.bin");  // missing file: warning, t.init_ok = 0
 *      if (t.init_ok) { safe_printf(tokenizer_decode(&t, id)); }
 *      tokenizer_free(&t);
 *
 * Format: 256 uint32 header {20240328, version, vocab_size, eot_token (version 2 only;
 * version 1 means 50256), 0...}, then per token a uint8 length and that many bytes.
 */
#ifndef LLMC_TOKENIZER_H
#define LLMC_TOKENIZER_H

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/utils.h"

#define TOKENIZER_MAGIC 20240328
#define GPT2_EOT 50256

// ----------------------------------------------------------------------------------------
// llm.c's tokenizer file

typedef struct {
    uint32_t vocab_size;
    char** token_table;  // token_table[id]: the token's bytes, NUL-terminated
    int init_ok;         // 0 when the file was missing: print ids instead
    int eot_token;
} Tokenizer;

static inline void tokenizer_init(Tokenizer* t, const char* filename) {
    memset(t, 0, sizeof(*t));
    FILE* f = fopen(filename, "rb");
    if (f == NULL) {
        if (errno != ENOENT) {
            fatal("cannot open tokenizer file '%s': %s", filename, strerror(errno));
        }
        fprintf(stderr, "warning: tokenizer file %s not found; samples will be printed as token "
                        "ids; run `make data` to create it\n", filename);
        return;
    }
    int64_t size = file_size_or_die(f, filename);
    uint32_t header[256];
    size_t got = fread(header, sizeof(uint32_t), 256, f);
    if (got != 256) {
        fatal("tokenizer file '%s' is truncated: expected a %zu-byte header, got %zu bytes",
              filename, sizeof(header), got * sizeof(uint32_t));
    }
    if (header[0] != TOKENIZER_MAGIC) {
        fatal("tokenizer file '%s' has magic %u, expected %u: not an llm.c tokenizer file",
              filename, header[0], TOKENIZER_MAGIC);
    }
    if (header[1] != 1 && header[1] != 2) {
        fatal("tokenizer file '%s' has version %u, expected 1 or 2", filename, header[1]);
    }
    t->vocab_size = header[2];
    t->eot_token = header[1] == 1 ? GPT2_EOT : (int)header[3];
    if (t->vocab_size == 0 || (uint32_t)t->eot_token >= t->vocab_size) {
        fatal("tokenizer file '%s' has vocab_size %u and eot token %d: expected eot < vocab_size",
              filename, t->vocab_size, t->eot_token);
    }
    // every token takes at least 2 bytes (a length byte and one byte): a vocab_size beyond that is
    // corrupt, and must not size an allocation (2^32 tokens would ask for 32 GB)
    int64_t room = (size - (int64_t)sizeof(header)) / 2;
    if ((int64_t)t->vocab_size > room) {
        fatal("tokenizer file '%s' has vocab_size %u but its %lld bytes hold at most %lld tokens",
              filename, t->vocab_size, (long long)size, (long long)room);
    }
    t->token_table = (char**)malloc_or_die(t->vocab_size * sizeof(char*), "tokenizer table");
    for (uint32_t i = 0; i < t->vocab_size; i++) {
        unsigned char length = 0;
        int ok = fread(&length, 1, 1, f) == 1 && length > 0;
        char* token = (char*)malloc_or_die(length + 1u, "tokenizer token");
        if (!ok || fread(token, 1, length, f) != length) {
            fatal("tokenizer file '%s' is truncated or corrupt at token %u: expected %u tokens, "
                  "each a length byte (1..255) and that many bytes", filename, i, t->vocab_size);
        }
        token[length] = '\0';
        t->token_table[i] = token;
    }
    if (fgetc(f) != EOF) {
        fatal("tokenizer file '%s' has bytes after its %u tokens: the header's vocab_size does "
              "not match the file", filename, t->vocab_size);
    }
    fclose(f);
    t->init_ok = 1;
}

// The bytes of one token, NUL-terminated; NULL (with a message) for an id out of range.
static inline const char* tokenizer_decode(Tokenizer* t, uint32_t token_id) {
    if (!t->init_ok) { return NULL; }
    if (token_id >= t->vocab_size) {
        fprintf(stderr, "invalid token id %u (vocab_size %u)\n", token_id, t->vocab_size);
        return NULL;
    }
    return t->token_table[token_id];
}

static inline void tokenizer_free(Tokenizer* t) {
    if (t->init_ok) {
        for (uint32_t i = 0; i < t->vocab_size; i++) { free(t->token_table[i]); }
        free(t->token_table);
    }
    memset(t, 0, sizeof(*t));
}

// The trainers' tokenizer for printing samples: one whose vocabulary is not the model's V is
// dropped with a warning (samples then print as token ids).
static inline void tokenizer_init_for_model(Tokenizer* t, const char* filename, int model_vocab_size) {
    tokenizer_init(t, filename);
    if (t->init_ok && (int)t->vocab_size != model_vocab_size) {
        fprintf(stderr, "warning: tokenizer file %s has %u tokens but the model has V=%d; "
                "samples will be printed as token ids\n", filename, t->vocab_size, model_vocab_size);
        tokenizer_free(t);
    }
}

// Prints a decoded piece, except a lone byte that is neither printable nor whitespace: such a
// byte is usually one part of a multi-byte UTF-8 character split across tokens (or a control
// byte), and printing it alone garbles the terminal.
static inline void safe_printf(const char* piece) {
    if (piece == NULL || piece[0] == '\0') { return; }
    if (piece[1] == '\0') {
        unsigned char byte = (unsigned char)piece[0];
        if (!(isprint(byte) || isspace(byte))) { return; }
    }
    printf("%s", piece);
}

#endif // LLMC_TOKENIZER_H
