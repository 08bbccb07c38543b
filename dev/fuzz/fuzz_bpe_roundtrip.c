/*
 * fuzz_bpe_roundtrip: GPT-2 BPE encoding of any bytes (llmc/bpe_encoder.h bpe_encode), with
 * GPT-2's own vocabulary when its files are found (dev/data/gpt2 from `make data`, else
 * $LLMC_SHARED_DATA/gpt2 or ../shared/data/gpt2), else the small one of fuzz_setup.h.
 * Independent checks: decode(encode(x)) == x for every x, and encoding x in pieces as a
 * stream (at_end = 0, as dev/data/tokenize reads files in chunks) gives the same ids as
 * encoding it whole. The encoder lives across inputs, so this target does not track
 * allocations (LeakSanitizer judges leaks) and any fatal() is a failure (it exits).
 */
#include "dev/fuzz/fuzz.h"
#include "llmc/bpe_encoder.h"
#include "dev/fuzz/fuzz_setup.h"

static BPEEncoder encoder;

__attribute__((noreturn)) static void disagree(const char* what, size_t n) {
    fprintf(stderr, "fuzz_bpe_roundtrip: %s (input of %zu bytes)\n", what, n);
    abort();
}

// The first directory holding GPT-2's encoder.json and vocab.bpe, or NULL.
static const char* gpt2_dir(void) {
    static char dirs[3][600];
    const char* shared = getenv("LLMC_SHARED_DATA");
    snprintf(dirs[0], sizeof(dirs[0]), "dev/data/gpt2");
    snprintf(dirs[1], sizeof(dirs[1]), "%s/gpt2", shared ? shared : "../shared/data");
    snprintf(dirs[2], sizeof(dirs[2]), "../shared/data/gpt2");
    for (int i = 0; i < 3; i++) {
        char path[700];
        snprintf(path, sizeof(path), "%s/vocab.bpe", dirs[i]);
        if (file_exists(path)) { return dirs[i]; }
    }
    return NULL;
}

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    fuzz_tracking = 0;
    char enc[700], merges[700];
    const char* dir = gpt2_dir();
    if (dir) {
        snprintf(enc, sizeof(enc), "%s/encoder.json", dir);
        snprintf(merges, sizeof(merges), "%s/vocab.bpe", dir);
    } else {
        snprintf(enc, sizeof(enc), "%s/encoder.json", fuzz_workdir());
        snprintf(merges, sizeof(merges), "%s/vocab.bpe", fuzz_workdir());
        fuzz_write_bpe_files(enc, merges);
    }
    bpe_init(&encoder, enc, merges);
    fprintf(stderr, "fuzz_bpe_roundtrip: %u-token vocabulary from %s\n", encoder.vocab_size,
            dir ? dir : "fuzz_setup.h");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t* text, size_t n) {
    TokenIds whole = {0}, streamed = {0};
    bpe_encode(&encoder, text, n, 1, &whole);
    size_t at = 0;
    for (size_t k = 0; k < whole.n; k++) {
        size_t len;
        const uint8_t* bytes = bpe_token(&encoder, whole.ids[k], &len);
        if (len > n - at || memcmp(bytes, text + at, len) != 0) { disagree("decode(encode(x)) != x", n); }
        at += len;
    }
    if (at != n) { disagree("decode(encode(x)) is shorter than x", n); }
    // the stream: pieces of 1, 2, 3, ... bytes (the piece ends cut characters and words anywhere)
    size_t done = 0, avail = 0;
    for (size_t piece = 1; avail < n; piece++) {
        avail = avail + piece < n ? avail + piece : n;
        done += bpe_encode(&encoder, text + done, avail - done, 0, &streamed);
    }
    bpe_encode(&encoder, text + done, n - done, 1, &streamed);
    if (streamed.n != whole.n || (whole.n && memcmp(streamed.ids, whole.ids, whole.n * sizeof(uint32_t)) != 0)) {
        disagree("encoding as a stream differs from encoding whole", n);
    }
    token_ids_free(&whole);
    token_ids_free(&streamed);
    return 0;
}
