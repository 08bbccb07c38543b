/*
 * fuzz_setup.h: the fixed run the fuzz targets parse their inputs for (a tiny model, its
 * batch, the step being resumed) and the small valid files built from it, shared by the
 * targets and by the seed generator (make_seeds.c), so the seeds are exactly what the
 * targets accept.
 */
#ifndef LLMC_FUZZ_SETUP_H
#define LLMC_FUZZ_SETUP_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "llmc/model.h"
#include "llmc/rand.h"
#include "llmc/bpe_encoder.h"
#include "llmc/utils.h"

// The model of the model and state targets: P = 1048 parameters, so a model file is 5 KB.
static inline GPT2Config fuzz_model_config(void) {
    GPT2Config c;
    memset(&c, 0, sizeof(c));
    c.num_layers = 1;
    c.channels = 8;
    c.num_heads = 2;
    c.vocab_size = 16;
    c.padded_vocab_size = 16;
    c.max_seq_len = 4;
    return c;
}

// The run that resumes in the state target: the checkpoint of step FUZZ_STEP, microbatches of
// B*T tokens, FUZZ_M microbatches per step, -x FUZZ_TRAIN_STEPS, --shuffle, --seed.
#define FUZZ_STEP 4
#define FUZZ_B 2
#define FUZZ_T 4
#define FUZZ_M 2
#define FUZZ_TRAIN_STEPS 10
#define FUZZ_SHUFFLE 1
#define FUZZ_SEED 42
// The data the state target resumes on: 3 epochs' worth of steps never fit in it.
#define FUZZ_STATE_DATA_TOKENS 101

// The token-file target's vocabulary (GPT-2's: most uint16 ids are valid, some are not).
#define FUZZ_TOKENS_V 50257

// Writes an llm.c token file of n pseudo-random ids < V.
static inline void fuzz_write_token_file(const char* path, int n, int V, uint64_t seed) {
    int header[256];
    memset(header, 0, sizeof(header));
    header[0] = 20240520;
    header[1] = 1;
    header[2] = n;
    FILE* f = fopen_or_die(path, "wb", "token file");
    fwrite_or_die(header, sizeof(int), 256, f, path);
    uint64_t state = seed + 1;
    for (int i = 0; i < n; i++) {
        uint16_t id = (uint16_t)(random_u32(&state) % (uint32_t)V);
        fwrite_or_die(&id, sizeof(id), 1, f, path);
    }
    if (fclose(f) != 0) { fatal("cannot write '%s'", path); }
}

// --- a small GPT-2-style BPE vocabulary: the 256 byte tokens (id = byte), a few merges, and
// <|endoftext|>, as encoder.json and vocab.bpe

typedef struct {
    const char* left;
    const char* right;
} FuzzMerge;

static const FuzzMerge fuzz_merges[] = {
    {" ", "t"}, {"h", "e"}, {" t", "he"}, {"i", "n"}, {"in", "g"}, {"e", "r"}, {" ", "a"},
    {"o", "n"}, {"r", "e"}, {" ", "s"}, {"e", "d"}, {"\n", "\n"}, {"\xc3", "\xa9"}, {" ", "w"},
    {"o", "u"}, {"l", "l"}, {"'", "s"}, {" ", "\xc3\xa9"},
};
#define FUZZ_NUM_MERGES ((int)(sizeof(fuzz_merges) / sizeof(fuzz_merges[0])))

// Writes bytes in GPT-2's byte-to-unicode alphabet (bpe_encoder.h), as UTF-8; JSON-escaped
// when `json` (only '"' and '\' need it: the alphabet has no control characters).
static inline void fuzz_put_alphabet(FILE* f, const char* bytes, int json) {
    for (const unsigned char* p = (const unsigned char*)bytes; *p; p++) {
        uint32_t cp = *p;
        if (!bpe_byte_is_printable(*p)) {
            cp = 256;
            for (int b = 0; b < *p; b++) { cp += !bpe_byte_is_printable(b); }
        }
        if (json && (cp == '"' || cp == '\\')) { fputc('\\', f); }
        if (cp < 0x80) { fputc((int)cp, f); }
        else { fputc(0xC0 | (int)(cp >> 6), f); fputc(0x80 | (int)(cp & 0x3F), f); }   // cp < 0x800
    }
}

static inline void fuzz_write_bpe_files(const char* encoder_path, const char* merges_path) {
    FILE* enc = fopen_or_die(encoder_path, "wb", "encoder.json");
    fputc('{', enc);
    for (int b = 0; b < 256; b++) {
        char one[2] = {(char)b, 0};
        fputs(b ? ", \"" : "\"", enc);
        if (b == 0) { fputs("\\u0100", enc); }   // byte 0 stands for U+0100 (a C string cannot hold it)
        else { fuzz_put_alphabet(enc, one, 1); }
        fprintf(enc, "\": %d", b);
    }
    FILE* merges = fopen_or_die(merges_path, "wb", "vocab.bpe");
    fputs("#version: 0.2\n", merges);
    for (int k = 0; k < FUZZ_NUM_MERGES; k++) {
        char merged[16];
        snprintf(merged, sizeof(merged), "%s%s", fuzz_merges[k].left, fuzz_merges[k].right);
        fputs(", \"", enc);
        fuzz_put_alphabet(enc, merged, 1);
        fprintf(enc, "\": %d", 256 + k);
        fuzz_put_alphabet(merges, fuzz_merges[k].left, 0);
        fputc(' ', merges);
        fuzz_put_alphabet(merges, fuzz_merges[k].right, 0);
        fputc('\n', merges);
    }
    fprintf(enc, ", \"<|endoftext|>\": %d}\n", 256 + FUZZ_NUM_MERGES);
    if (fclose(enc) != 0 || fclose(merges) != 0) { fatal("cannot write the BPE files"); }
}

#endif // LLMC_FUZZ_SETUP_H
