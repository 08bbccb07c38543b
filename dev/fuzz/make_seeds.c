/*
 * make_seeds OUT_DIR: writes the seed corpus of every fuzz target, OUT_DIR/TARGET/NAME.
 *
 * Seeds are small files built with the project's own writers (checkpoint_write_model,
 * state_write_piece, st_write_file, bpe_write_tokenizer_file) for the fixed run of
 * fuzz_setup.h. A name says what the target must do with it, and dev/fuzz/replay.sh checks it:
 *   ok-*   accepted: no error line
 *   bad-*  rejected with exactly one "error: ..." line
 * Most bad-* seeds reproduce a defect of the "hostile and inconsistent inputs" issue: each
 * crashed, ran away or was silently accepted before it was fixed. Formats of several files
 * (state pieces, encoder.json + vocab.bpe + text) are one seed joined by FUZZ_FILE_SEPARATOR.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/checkpoint.h"
#include "llmc/gpt2_init.h"
#include "dev/tools/safetensors.h"
#include "llmc/bpe_encoder.h"
#include "dev/fuzz/fuzz_input.h"
#include "dev/fuzz/fuzz_setup.h"

static const char* out_dir;

typedef struct {
    uint8_t* p;
    size_t n;
} Bytes;

static Bytes read_bytes(const char* path) {
    FILE* f = fopen_or_die(path, "rb", "seed part");
    Bytes b;
    b.n = (size_t)file_size_or_die(f, path);
    b.p = (uint8_t*)malloc_or_die(b.n, "seed part");
    fread_or_die(b.p, 1, b.n, f, path);
    fclose(f);
    return b;
}

static Bytes text_bytes(const char* text) {
    Bytes b = {(uint8_t*)malloc_or_die(strlen(text), "seed text"), strlen(text)};
    memcpy(b.p, text, b.n);
    return b;
}

// A scratch file for the writers, under OUT_DIR/tmp.
static const char* scratch(const char* name) {
    static char path[4][1100];
    static int next;
    char* p = path[next++ % 4];
    snprintf(p, sizeof(path[0]), "%s/tmp/%s", out_dir, name);
    return p;
}

// Writes OUT_DIR/target/name: the parts joined by FUZZ_FILE_SEPARATOR.
static void seed(const char* target, const char* name, const Bytes* parts, int nparts) {
    char path[1100];
    snprintf(path, sizeof(path), "%s/%s", out_dir, target);
    ensure_writable_dir(path, "make_seeds");
    snprintf(path, sizeof(path), "%s/%s/%s", out_dir, target, name);
    AtomicWriter w;
    atomic_writer_open(&w, path);
    for (int k = 0; k < nparts; k++) {
        if (k) { atomic_writer_write(&w, FUZZ_FILE_SEPARATOR, strlen(FUZZ_FILE_SEPARATOR)); }
        atomic_writer_write(&w, parts[k].p, parts[k].n);
    }
    atomic_writer_commit(&w);
}

static void put_int(Bytes* b, size_t offset, int value) { memcpy(b->p + offset, &value, 4); }

// --- model checkpoints -----------------------------------------------------------------------

static uint16_t to_bf16(float f) {   // round to nearest even
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void model_seeds(void) {
    GPT2Config c = fuzz_model_config();
    float* params = gpt2_random_params(&c, 1);
    checkpoint_write_model(scratch("model.bin"), &c, params);
    free(params);
    Bytes fp32 = read_bytes(scratch("model.bin"));
    seed("model", "ok-fp32", &fp32, 1);

    Bytes bf16 = {(uint8_t*)malloc_or_die(fp32.n, "bf16"), 1024 + (fp32.n - 1024) / 2};
    memcpy(bf16.p, fp32.p, 1024);
    put_int(&bf16, 4, 5);   // version 5: bf16 parameters
    for (size_t i = 0; i < (fp32.n - 1024) / 4; i++) {
        float f;
        memcpy(&f, fp32.p + 1024 + 4 * i, 4);
        uint16_t h = to_bf16(f);
        memcpy(bf16.p + 1024 + 2 * i, &h, 2);
    }
    seed("model", "ok-bf16", &bf16, 1);

    GPT2Config moe_config = c;   // version 7: a mixture of 2 experts, top 1
    moe_config.num_experts = 2;
    moe_config.top_k = 1;
    float* moe_params = gpt2_random_params(&moe_config, 1);
    checkpoint_write_model(scratch("moe.bin"), &moe_config, moe_params);
    free(moe_params);
    Bytes moe = read_bytes(scratch("moe.bin"));
    seed("model", "ok-moe", &moe, 1);
    put_int(&moe, 36, 3);   // header[9]: k = 3 of E = 2 experts
    seed("model", "bad-moe-top-k", &moe, 1);
    free(moe.p);

    Bytes truncated = {fp32.p, 2000};
    seed("model", "bad-truncated", &truncated, 1);
    Bytes no_layers = read_bytes(scratch("model.bin"));
    put_int(&no_layers, 16, 0);   // L = 0
    seed("model", "bad-no-layers", &no_layers, 1);
    free(fp32.p); free(bf16.p); free(no_layers.p);
}

// --- optimizer state -------------------------------------------------------------------------

typedef struct {
    int npieces;
    int nranges[2];
    int64_t ranges[2][3][2];   // per piece, up to 3 [begin, end)
} StateLayout;

// The pieces of the checkpoint of step FUZZ_STEP as the state target resumes it, with this
// progress and layout, and moments m, v (P floats each).
static void state_seed(const char* name, TrainProgress prog, StateLayout layout, float* m, float* v) {
    GPT2Config c = fuzz_model_config();
    Bytes parts[2] = {{NULL, 0}, {NULL, 0}};
    for (int piece = 0; piece < layout.npieces; piece++) {
        StateRange r[3];
        for (int k = 0; k < layout.nranges[piece]; k++) {
            r[k].begin = layout.ranges[piece][k][0];
            r[k].end = layout.ranges[piece][k][1];
            r[k].m = m + r[k].begin;
            r[k].v = v + r[k].begin;
        }
        state_write_piece(scratch("state.bin"), &c, &prog, layout.npieces, piece, layout.nranges[piece], r);
        parts[piece] = read_bytes(scratch("state.bin"));
    }
    seed("state", name, parts, layout.npieces);
    for (int piece = 0; piece < layout.npieces; piece++) { free(parts[piece].p); }
}

static void state_seeds(void) {
    GPT2Config c = fuzz_model_config();
    const int64_t P = (int64_t)param_count(&c);
    float* m = (float*)malloc_or_die(sizeof(float) * P, "m");
    float* v = (float*)malloc_or_die(sizeof(float) * P, "v");
    for (int64_t i = 0; i < P; i++) { m[i] = 0.001f * (float)(i % 7 - 3); v[i] = 1e-6f * (float)(i % 5); }
    const TrainProgress good = {FUZZ_STEP, FUZZ_STEP * FUZZ_M, FUZZ_B * FUZZ_T, FUZZ_SHUFFLE, FUZZ_SEED};
    const StateLayout whole = {1, {1, 0}, {{{0, P}}}};
    const StateLayout split = {2, {2, 1}, {{{0, 300}, {700, P}}, {{300, 700}}}};
    state_seed("ok-one-piece", good, whole, m, v);
    state_seed("ok-two-pieces", good, split, m, v);

    TrainProgress p = good;
    p.microbatches_done = -1000;   // indexed the shuffle permutation out of bounds
    state_seed("bad-negative-microbatches", p, whole, m, v);
    p = good;
    p.microbatches_done = FUZZ_STEP * FUZZ_M + 1;   // possible, but not for this run's -d
    state_seed("bad-microbatches-not-this-runs-d", p, whole, m, v);
    p = good;
    p.step = -5;   // trained from a wrong step: lr -inf, NaN models over good checkpoints
    state_seed("bad-step-before-done", p, whole, m, v);
    p = good;
    p.step = (int64_t)1 << 31;   // ran ~2^31 steps
    state_seed("bad-step-beyond-int", p, whole, m, v);
    p = good;
    p.shuffle = 2;
    state_seed("bad-shuffle-2", p, whole, m, v);
    p = good;
    p.shuffle_seed = FUZZ_SEED + 1;
    state_seed("bad-other-seed", p, whole, m, v);

    // ranges listed twice: their lengths add up to P, yet [P/2, P) is never loaded
    const StateLayout twice = {1, {2, 0}, {{{0, P / 2}, {0, P / 2}}}};
    state_seed("bad-ranges-twice", good, twice, m, v);
    const StateLayout overlap = {2, {1, 1}, {{{0, 600}}, {{500, P - 100}}}};
    state_seed("bad-ranges-overlap-across-pieces", good, overlap, m, v);
    // found by fuzz_state: no ranges at all made the tiling check call qsort(NULL, 0, ...)
    const StateLayout empty = {1, {0, 0}, {{{0, 0}}}};
    state_seed("bad-no-ranges", good, empty, m, v);
    StateLayout missing = split;
    missing.npieces = 1;   // piece 0 says there are 2
    state_seed("bad-missing-piece", good, missing, m, v);

    float saved;
    saved = v[10]; v[10] = NAN;
    state_seed("bad-nan-v", good, whole, m, v);
    v[10] = -1.0f;
    state_seed("bad-negative-v", good, whole, m, v);
    v[10] = saved;
    saved = m[30]; m[30] = INFINITY;
    state_seed("bad-inf-m", good, whole, m, v);
    m[30] = saved;
    free(m); free(v);
}

// --- token files -----------------------------------------------------------------------------

static Bytes token_file(int n, uint64_t seed_value) {
    fuzz_write_token_file(scratch("tokens.bin"), n, FUZZ_TOKENS_V, seed_value);
    return read_bytes(scratch("tokens.bin"));
}

static void tokens_seeds(void) {
    Bytes one = token_file(40, 1);
    seed("tokens", "ok-one-shard", &one, 1);
    Bytes three[3] = {token_file(20, 2), token_file(13, 3), token_file(7, 4)};
    seed("tokens", "ok-three-shards", three, 3);
    Bytes beyond = token_file(40, 5);
    uint16_t id = 60000;
    memcpy(beyond.p + 1024 + 2 * 3, &id, 2);
    seed("tokens", "bad-id-beyond-vocabulary", &beyond, 1);
    Bytes truncated = {one.p, one.n - 20};
    seed("tokens", "bad-truncated", &truncated, 1);
    Bytes few = token_file(5, 6);   // B*T+1 = 7 needed
    seed("tokens", "bad-too-few-tokens", &few, 1);
    Bytes magic = token_file(40, 7);
    put_int(&magic, 0, 777);
    seed("tokens", "bad-magic", &magic, 1);
    free(one.p); free(beyond.p); free(few.p); free(magic.p);
    for (int k = 0; k < 3; k++) { free(three[k].p); }
}

// --- tokenizer files, encoder.json / vocab.bpe, texts ---------------------------------------

static void bpe_seeds(void) {
    fuzz_write_bpe_files(scratch("encoder.json"), scratch("vocab.bpe"));
    Bytes enc = read_bytes(scratch("encoder.json"));
    Bytes merges = read_bytes(scratch("vocab.bpe"));
    seed("bpe", "ok-decode-only", &enc, 1);
    Bytes full[3] = {enc, merges, text_bytes("The seething sea ceased, and thus the sea's seething sufficed us. Café!\n\n")};
    seed("bpe", "ok-encode", full, 3);
    Bytes dup[2] = {enc, {(uint8_t*)malloc_or_die(merges.n + 8, "merges"), merges.n + 4}};
    memcpy(dup[1].p, merges.p, merges.n);
    memcpy(dup[1].p + merges.n, "o u\n", 4);   // the merge "o u" once more
    seed("bpe", "bad-duplicate-merge", dup, 2);
    Bytes cut = {enc.p, enc.n - 10};
    seed("bpe", "bad-truncated-json", &cut, 1);

    BPEEncoder b;
    bpe_init(&b, scratch("encoder.json"), scratch("vocab.bpe"));
    bpe_write_tokenizer_file(&b, scratch("tokenizer.bin"));
    bpe_free(&b);
    Bytes tok = read_bytes(scratch("tokenizer.bin"));
    seed("tokenizer", "ok-small", &tok, 1);
    Bytes huge = {(uint8_t*)calloc_or_die(1034, 1, "tokenizer"), 1034};
    put_int(&huge, 0, TOKENIZER_MAGIC);
    put_int(&huge, 4, 2);
    put_int(&huge, 8, -1);   // vocab_size 2^32-1: allocated 32 GB before looking at the file size
    seed("tokenizer", "bad-vocab-size-4-billion", &huge, 1);
    Bytes trailing = {(uint8_t*)malloc_or_die(tok.n + 2, "tokenizer"), tok.n + 2};
    memcpy(trailing.p, tok.p, tok.n);
    memcpy(trailing.p + tok.n, "xx", 2);
    seed("tokenizer", "bad-trailing-bytes", &trailing, 1);

    const char* texts[][2] = {
        {"ok-english", "It's the end of the line; we've said all we'll say.\n\nThe end."},
        {"ok-utf8", "h\xc3\xa9llo w\xc3\xb6rld \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x99\x82"},
        {"ok-invalid-utf8", "\xff\xfe abc \xc3 \xe6\x97 \xed\xa0\x80 \xf4\x90\x80\x80 caf\xc3\xa9"},
        {"ok-whitespace", "a  \n\n  b\t\t c   \r\n \x0b\x0c end   "},
        {"ok-contractions", "'s 't 're 've 'm 'll 'd 'S ''s x's"},
        {"ok-numbers", "123 4567 \xc2\xbd 3.14 -2e10"},
        {"ok-empty", ""},
    };
    for (size_t k = 0; k < sizeof(texts) / sizeof(texts[0]); k++) {
        Bytes t = text_bytes(texts[k][1]);
        seed("bpe_roundtrip", texts[k][0], &t, 1);
        free(t.p);
    }
    free(enc.p); free(merges.p); free(full[2].p); free(dup[1].p); free(tok.p); free(huge.p); free(trailing.p);
}

// --- safetensors -----------------------------------------------------------------------------

static void safetensors_seeds(void) {
    float f32[6] = {1, -2, 3.5f, 0, -0.0f, 1e-20f};
    uint16_t bf16[4] = {0x3f80, 0xc000, 0x7f80, 0x0001};
    uint16_t f16[2] = {0x3c00, 0x0400};
    int64_t scalar = -7;
    StWriteTensor t[5] = {
        {"h.0.attn.weight", ST_F32, 2, {2, 3}, f32},
        {"bf16", ST_BF16, 1, {4}, bf16},
        {"f16", ST_F16, 1, {2}, f16},
        {"scalar", ST_I64, 0, {0}, &scalar},
        {"empty", ST_U8, 1, {0}, f32},
    };
    const char* mk[1] = {"format"};
    const char* mv[1] = {"pt"};
    st_write_file(scratch("small.safetensors"), t, 5, mk, mv, 1, NULL, NULL);
    Bytes small = read_bytes(scratch("small.safetensors"));
    seed("safetensors", "ok-small", &small, 1);
    Bytes with_config[2] = {small, text_bytes("{\"n_head\": 2, \"n_embd\": 8, \"n_layer\": null, \"x\": [1, {\"a\": \"\\u00e9\"}]}")};
    seed("safetensors", "ok-with-config", with_config, 2);
    Bytes bad_config[2] = {small, text_bytes("{\"n_head\": -2}")};
    seed("safetensors", "bad-config-negative", bad_config, 2);
    Bytes truncated = {small.p, small.n - 4};
    seed("safetensors", "bad-truncated", &truncated, 1);
    const char* overlap_header =
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}";
    size_t hn = strlen(overlap_header);
    Bytes overlap = {(uint8_t*)calloc_or_die(8 + hn + 12, 1, "safetensors"), 8 + hn + 12};
    overlap.p[0] = (uint8_t)hn;
    memcpy(overlap.p + 8, overlap_header, hn);
    seed("safetensors", "bad-overlapping-tensors", &overlap, 1);
    free(small.p); free(with_config[1].p); free(bad_config[1].p); free(overlap.p);
}

int main(int argc, char** argv) {
    if (argc != 2) { fatal("usage: make_seeds OUT_DIR"); }
    out_dir = argv[1];
    ensure_writable_dir(scratch(""), "make_seeds");
    model_seeds();
    state_seeds();
    tokens_seeds();
    bpe_seeds();
    safetensors_seeds();
    const char* names[] = {"model.bin", "state.bin", "tokens.bin", "encoder.json", "vocab.bpe",
                           "tokenizer.bin", "small.safetensors"};
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) { remove(scratch(names[k])); }
    remove(scratch(""));
    return 0;
}
