/*
 * fuzz_serve_request: the server's request parser (llmc/serve_request.h serve_parse_request),
 * a JSON body from the network to the engine's request parameters, as completion and as chat.
 * Checks on every input: an accepted request is within the limits the engine relies on (a
 * prompt of 1 .. max_prompt ids in [0, V), max_tokens >= 1, temperature in [0, 100], top_p in
 * (0, 1], at most 4 stop strings); a rejected one has a 4xx status and a message; the same
 * body parses the same way twice. String prompts encode one token per byte here.
 * Replayed by dev/test/test_serve.sh over dev/fuzz/seeds_serve_request.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/serve_request.h"

__attribute__((noreturn)) static void disagree(const char* what) {
    fprintf(stderr, "fuzz_serve_request: %s\n", what);
    abort();
}

static int bytes_to_ids(void* ctx, const char* text, size_t n, int** ids) {
    (void)ctx;
    *ids = (int*)malloc(sizeof(int) * (n > 0 ? n : 1));
    for (size_t i = 0; i < n; i++) { (*ids)[i] = (unsigned char)text[i]; }
    return (int)n;
}

static void check(const uint8_t* data, size_t size, int chat) {
    ServeLimits lim = {63, 50257, "gpt2", bytes_to_ids, NULL};
    ServeParams p, q;
    ServeError e, f;
    int ok = serve_parse_request((const char*)data, size, chat, &lim, &p, &e);
    int again = serve_parse_request((const char*)data, size, chat, &lim, &q, &f);
    if (ok != again) { disagree("the same body parsed two ways"); }
    if (!ok) {
        if (e.status < 400 || e.status > 499 || e.message[0] == '\0') { disagree("a rejection without a 4xx status and a message"); }
        if (strcmp(e.message, f.message) != 0) { disagree("the same body rejected two ways"); }
        return;
    }
    if (p.num_prompt < 1 || p.num_prompt > lim.max_prompt) { disagree("an accepted prompt of a length out of range"); }
    for (int i = 0; i < p.num_prompt; i++) {
        if (p.prompt[i] < 0 || p.prompt[i] >= lim.vocab_size) { disagree("an accepted token id out of range"); }
    }
    if (p.max_tokens < 1 || !(p.temperature >= 0 && p.temperature <= 100) || !(p.top_p > 0 && p.top_p <= 1) ||
        p.top_k < 0 || p.num_stop > SERVE_MAX_STOP || p.seed < 1) {
        disagree("accepted sampling parameters out of range");
    }
    if (p.num_prompt != q.num_prompt || memcmp(p.prompt, q.prompt, sizeof(int) * (size_t)p.num_prompt) != 0) {
        disagree("the same body gave two prompts");
    }
    serve_params_free(&p);
    serve_params_free(&q);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    check(data, size, 0);
    check(data, size, 1);
    return 0;
}
