/*
 * fuzz_tokenizer: llm.c tokenizer files (llmc/tokenizer.h tokenizer_init, and the trainers'
 * tokenizer_init_for_model). Independent check: an accepted file is exactly the 1024-byte
 * header plus, per token, a length byte and that many bytes, which decode returns.
 */
#include "dev/fuzz/fuzz.h"
#include "llmc/tokenizer.h"

__attribute__((noreturn)) static void disagree(const char* what) {
    fprintf(stderr, "fuzz_tokenizer: accepted a file but %s\n", what);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const char* path = fuzz_write_file(0, "tokenizer.bin", data, size);
    FUZZ_BEGIN();
    static Tokenizer t;
    tokenizer_init(&t, path);
    size_t at = 1024;   // the next token's length byte
    for (uint32_t id = 0; id < t.vocab_size; id++) {
        if (at >= size || at + 1 + data[at] > size) { disagree("its tokens run past its end"); }
        size_t len = data[at];
        const char* token = tokenizer_decode(&t, id);
        if (token == NULL || memcmp(token, data + at + 1, len) != 0 || token[len] != '\0') {
            disagree("decode differs from the file's bytes");
        }
        at += 1 + len;
    }
    if (at != size) { disagree("its tokens do not end where the file does"); }
    tokenizer_free(&t);
    tokenizer_init_for_model(&t, path, 16);
    tokenizer_free(&t);
    fuzz_expect_nothing_live("tokenizer_free");
    return 0;
}
