/*
 * fuzz_bpe: GPT-2's encoder.json and vocab.bpe (llmc/bpe_encoder.h bpe_init). Input files:
 * encoder.json, then optionally vocab.bpe, then optionally a text. Independent checks on an
 * accepted vocabulary: the text decodes back from its ids to the same bytes, and the llm.c
 * tokenizer file written from it (bpe_write_tokenizer_file) reads back (tokenizer_init) as
 * the same tokens.
 */
#include "dev/fuzz/fuzz.h"
#include "llmc/bpe_encoder.h"

__attribute__((noreturn)) static void disagree(const char* what) {
    fprintf(stderr, "fuzz_bpe: %s\n", what);
    abort();
}

static void check_round_trip(BPEEncoder* b, const uint8_t* text, size_t n) {
    TokenIds ids = {0};
    bpe_encode(b, text, n, 1, &ids);
    size_t at = 0;
    for (size_t k = 0; k < ids.n; k++) {
        size_t len;
        const uint8_t* bytes = bpe_token(b, ids.ids[k], &len);
        if (len > n - at || memcmp(bytes, text + at, len) != 0) { disagree("decode(encode(text)) != text"); }
        at += len;
    }
    if (at != n) { disagree("decode(encode(text)) is shorter than the text"); }
    token_ids_free(&ids);
}

static void check_tokenizer_file(const BPEEncoder* b) {
    for (uint32_t id = 0; id < b->vocab_size; id++) {
        size_t len;
        bpe_token(b, id, &len);
        if (len > 255) { return; }   // the llm.c format cannot hold it (bpe_write_tokenizer_file says so)
    }
    char path[300];
    snprintf(path, sizeof(path), "%s/tokenizer.bin", fuzz_workdir());
    bpe_write_tokenizer_file(b, path);
    static Tokenizer t;
    tokenizer_init(&t, path);
    if (t.vocab_size != b->vocab_size || (uint32_t)t.eot_token != b->eot_token) {
        disagree("the tokenizer file reads back with another vocab_size or eot token");
    }
    for (uint32_t id = 0; id < b->vocab_size; id++) {
        size_t len;
        const uint8_t* bytes = bpe_token(b, id, &len);
        if (memcmp(t.token_table[id], bytes, len) != 0 || t.token_table[id][len] != '\0') {
            disagree("a token of the tokenizer file differs from encoder.json's");
        }
    }
    tokenizer_free(&t);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    FuzzFiles files = fuzz_split(data, size);
    const char* encoder = fuzz_write_file(0, "encoder.json", files.data[0], files.size[0]);
    const char* merges = files.n > 1 ? fuzz_write_file(1, "vocab.bpe", files.data[1], files.size[1]) : NULL;
    FUZZ_BEGIN();
    static BPEEncoder b;
    bpe_init(&b, encoder, merges);
    if (merges && files.n > 2) { check_round_trip(&b, files.data[2], files.size[2]); }
    check_tokenizer_file(&b);
    bpe_free(&b);
    fuzz_expect_nothing_live("bpe_free");
    return 0;
}
