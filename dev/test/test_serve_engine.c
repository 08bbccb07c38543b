/*
 * test_serve_engine.c: the serving engine (llmc/serve_engine.h) against the trainer's sampler,
 * without HTTP.
 *
 * The reference for each request is the trainer's sampler written out plainly: the trainer's
 * model (train_gpt2.c, one rank) runs its whole forward over (1, maxT) for each new token
 * (the path of --kv-cache 0, which test_gpt2 shows equal to the KV-cache decode bit for bit),
 * and the token is drawn from row len - 1 with the request's Sampler and xorshift seed, one
 * coin per token, as engine.h's trainer_sample does. The engine must give the same tokens,
 * drawn from the same bits (a fingerprint of every distribution):
 *  1. each request alone (prefill chunked by max_batch_tokens);
 *  2. all of them, arriving at random steps, in a cache small enough that requests are
 *     preempted and recomputed, then again in the reverse arrival order with other block
 *     and chunk sizes, and with few prompt rows per decoding step (no step that decodes
 *     carries more, and the cap is met); every block free at the end;
 *  3. a stop string ends the text before it (finish_reason "stop"), maxT ends with "length";
 *  4. a request cancelled midway gives its blocks back and changes nobody else's tokens.
 * All of it twice: on a dense model, and on a mixture-of-experts one (4 experts, top 2) whose
 * rows the trainer routes in its (1, maxT) pass beside the padding positions and the engine
 * beside other requests' rows.
 * Exits non-zero on any failure.
 */
#define TESTING
#include "train_gpt2.c"
#include "llmc/gpt2_init.h"
#include "llmc/serve_engine.h"
#include "serve_model.c"   // the engine's model side: train_gpt2.c's model on a step's rows

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

typedef struct {
    int prompt[64], num_prompt, max_tokens, top_k;
    float temperature, top_p;
    uint64_t seed;
    int expect[64], num_expect;   // the sampler's tokens
    uint64_t fingerprint;         // ... and the bits of the distributions they were drawn from
} Case;

#define NCASES 20

// token id -> one letter: enough text for stop strings
static const uint8_t* letter_text(void* ctx, int token, size_t* len) {
    static const uint8_t letters[] = "abcdefghijklmnopqrstuvwxyz";
    (void)ctx;
    *len = 1;
    return letters + token % 26;
}

// The trainer's sampler for one case: whole forwards over (1, maxT) on the trainer's model.
static void sampler_reference(GPT2* model, Activations* a, const GPT2Config* c, Case* k) {
    int T = c->max_seq_len, V = c->vocab_size, Vp = c->padded_vocab_size;
    int* seq = (int*)malloc(sizeof(int) * T);
    for (int t = 0; t < T; t++) { seq[t] = V - 1; }
    memcpy(seq, k->prompt, sizeof(int) * k->num_prompt);
    Sampler s;
    sampler_init(&s, k->temperature, k->top_k, V);
    s.top_p = k->top_p;
    uint64_t rng = k->seed;
    int len = k->num_prompt;
    k->num_expect = 0;
    k->fingerprint = SERVE_FNV_BASIS;
    while (k->num_expect < k->max_tokens && len < T) {
        gpt2_forward(model, a, seq, NULL, 1, T, 0);
        const float* probs = a->probs + (size_t)(len - 1) * Vp;
        k->fingerprint = serve_fnv1a(k->fingerprint, probs, (size_t)V);
        int next = sampler_draw(&s, probs, V, random_f32(&rng));
        seq[len++] = next;
        k->expect[k->num_expect++] = next;
    }
    sampler_free(&s);
    free(seq);
}

static void request_from_case(ServeRequest* r, const Case* k, int V) {
    serve_request_init(r, k->prompt, k->num_prompt, k->max_tokens, k->temperature, k->top_k, k->top_p, k->seed, V);
    r->ignore_eos = 1;
}

static int same_tokens(const ServeRequest* r, const Case* k) {
    return serve_generated(r) == k->num_expect && r->fingerprint == k->fingerprint &&
           memcmp(r->tokens + r->num_prompt, k->expect, sizeof(int) * k->num_expect) == 0;
}

// The prompt rows of the step just scheduled when some request in it decodes (its row: the
// last token it generated; every other row is a prompt row, or one a preemption took back);
// -1 when none decodes. *capped: 1 when a prompt in it got fewer rows than it has left.
static int decoding_step_prompt_rows(const ServeEngine* e, int* capped) {
    int prompt = 0, decodes = 0;
    for (int s = 0, first = 0; s < e->num_sched; first = e->sched_last_row[s] + 1, s++) {
        const ServeRequest* r = e->sched[s];
        int n = e->sched_last_row[s] + 1 - first, left = r->len - r->computed;
        if (r->len > r->num_prompt && left == 1) { decodes = 1; continue; }
        prompt += n;
        if (n < left) { *capped = 1; }
    }
    return decodes ? prompt : -1;
}

// Runs the cases through one engine; case i arrives at step arrive[i] (in that order when
// several share a step). max_prefill > 0: the engine's max_prefill_tokens, which no step that
// decodes may exceed and some such step must reach. Returns how many requests were preempted at
// least once.
static int run_batched(Comm* comm, const GPT2Config* c, const float* params, Case* cases, const int* order, const int* arrive,
                       int kv_blocks, int block_size, int max_batch_tokens, int max_prefill, ServeBatching batching,
                       int max_running, const char* name) {
    ServeEngine e;
    serve_engine_init(&e, comm, &memory_host, c, params, kv_blocks, block_size, max_batch_tokens, NCASES);
    e.batching = batching;
    e.max_prefill_tokens = max_prefill;
    if (max_running > 0) { e.max_running = max_running; }
    ServeRequest reqs[NCASES];
    int next = 0, busiest = 0, joined = 0;   // the schedule's own promises: the batch's cap, none joining a static batch
    int over = 0, capped_steps = 0;          // ... and the prompt rows of a decoding step
    for (int step = 0; next < NCASES || !serve_engine_idle(&e); step++) {
        while (next < NCASES && arrive[order[next]] <= step) {
            request_from_case(&reqs[order[next]], &cases[order[next]], c->vocab_size);
            CHECK(serve_engine_submit(&e, &reqs[order[next]]), "%s: submit refused", name);
            next++;
        }
        int before = e.num_running;
        serve_engine_schedule(&e);   // serve_engine_step, its schedule looked at
        int capped = 0, prompt = decoding_step_prompt_rows(&e, &capped);
        if (max_prefill > 0 && prompt > max_prefill) { over++; }
        capped_steps += max_prefill > 0 && prompt == max_prefill && capped;
        serve_engine_forward(&e);
        serve_engine_finish_step(&e);
        if (max_running > 0) { busiest = e.num_running > busiest ? e.num_running : busiest; }
        if (batching == SERVE_STATIC && before > 0 && e.num_running > before) { joined++; }
        CHECK(step < 100000, "%s: the engine does not finish", name);
        if (step >= 100000) { break; }
    }
    int preempted = 0, bad = 0;
    for (int i = 0; i < NCASES; i++) {
        if (!same_tokens(&reqs[i], &cases[i])) { bad++; printf("  %s: request %d differs from the sampler\n", name, i); }
        preempted += reqs[i].preemptions > 0;
        serve_request_free(&reqs[i]);
    }
    CHECK(bad == 0, "%s: %d request(s) differ from the sampler", name, bad);
    CHECK(busiest <= max_running, "%s: %d requests ran at once, over --max-running %d", name, busiest, max_running);
    CHECK(joined == 0, "%s: requests joined a running static batch at %d steps", name, joined);
    CHECK(over == 0, "%s: %d decoding steps carried more than %d prompt rows", name, over, max_prefill);
    CHECK(max_prefill == 0 || capped_steps > 0, "%s: no decoding step met the cap of %d prompt rows", name, max_prefill);
    CHECK(e.kv.num_free == kv_blocks, "%s: %d of %d blocks free at the end", name, e.kv.num_free, kv_blocks);
    printf("%s: %d requests = the sampler's tokens, %lld steps, %d preempted, all blocks free: %s\n", name, NCASES,
           e.steps, preempted, bad == 0 && e.kv.num_free == kv_blocks ? "ok" : "FAIL");
    serve_engine_free(&e);
    return preempted;
}

// Sections 1-4 on the model of configuration c.
static void check_engine(Comm* comm, GPT2Config c, const char* model_name) {
    printf("== %s: L=%d C=%d NH=%d V=%d maxT=%d E=%d k=%d\n", model_name, c.num_layers, c.channels, c.num_heads,
           c.vocab_size, c.max_seq_len, c.num_experts, c.top_k);
    float* params = gpt2_random_params(&c, 7);
    // larger embeddings than GPT-2's init, so the distributions are far from uniform
    for (size_t i = 0; i < (size_t)c.vocab_size * c.channels; i++) { params[i] *= 3.0f; }
    GPT2 model;
    Zero zero;
    ChunkPlace place = {0, c.num_layers, 1, 1, 0};
    zero_init(&zero, &c, &memory_host, 0, &comm->dp_group, &comm->pp_group, &comm->tp_group, &place, 1, 0, params, 1);
    gpt2_init(&model, &c, &place, &zero, &comm->tp_group, &comm->cp_group, 0, 0, 0, 0);
    Activations acts;
    activations_alloc(&acts, &model, 1, c.max_seq_len, 0, 0, 0);

    Case cases[NCASES];
    uint64_t rng = 42;
    for (int i = 0; i < NCASES; i++) {
        Case* k = &cases[i];
        k->num_prompt = 1 + (int)(random_u32(&rng) % 40);
        for (int t = 0; t < k->num_prompt; t++) { k->prompt[t] = (int)(random_u32(&rng) % c.vocab_size); }
        k->max_tokens = 1 + (int)(random_u32(&rng) % 30);
        if (i == 3) { k->max_tokens = 60; }   // runs into maxT
        float temps[4] = {0.0f, 1.0f, 0.7f, 1.3f};
        k->temperature = temps[i % 4];
        k->top_k = i % 3 == 0 ? 5 : 0;
        k->top_p = i % 5 == 1 ? 0.8f : 1.0f;
        k->seed = 1337 + i;
        sampler_reference(&model, &acts, &c, k);
    }
    CHECK(cases[3].num_prompt + cases[3].num_expect == c.max_seq_len, "case 3 should run into maxT");
    for (int i = 0; i < c.num_layers * c.num_experts; i++) {   // the routing really varies from row to row
        CHECK(model.counters.tokens[i] > 0, "expert %d of layer %d received no token: the test routes trivially",
              i % c.num_experts, i / c.num_experts);
    }

    // 1. each request alone, its prompt in chunks of 8 rows
    int alone_bad = 0;
    for (int i = 0; i < NCASES; i++) {
        ServeEngine e;
        serve_engine_init(&e, comm, &memory_host, &c, params, 16, 16, 8, 1);
        ServeRequest r;
        request_from_case(&r, &cases[i], c.vocab_size);
        serve_engine_submit(&e, &r);
        while (!serve_engine_idle(&e)) { serve_engine_step(&e); }
        alone_bad += !same_tokens(&r, &cases[i]);
        if (i == 3) { CHECK(r.finish_reason && strcmp(r.finish_reason, "length") == 0, "maxT: finish_reason %s", r.finish_reason); }
        serve_request_free(&r);
        serve_engine_free(&e);
    }
    CHECK(alone_bad == 0, "%d request(s) alone differ from the sampler", alone_bad);
    printf("alone: %d requests = the sampler's tokens: %s\n", NCASES, alone_bad == 0 ? "ok" : "FAIL");

    // 2. batched, random arrivals, preemption; then the reverse order, other blocks and chunks
    int order[NCASES], arrive[NCASES];
    for (int i = 0; i < NCASES; i++) {
        order[i] = i;
        arrive[i] = (int)(random_u32(&rng) % 12);
    }
    for (int i = 0; i < NCASES; i++) {   // arrival order sorted by step, ties in index order
        for (int j = i + 1; j < NCASES; j++) {
            if (arrive[order[j]] < arrive[order[i]]) { int t = order[i]; order[i] = order[j]; order[j] = t; }
        }
    }
    int p1 = run_batched(comm, &c, params, cases, order, arrive, 10, 16, 16, 0, SERVE_INFLIGHT, 0, "batched, 10 blocks of 16, chunks of 16");
    CHECK(p1 > 0, "the small cache preempted nobody: the test does not reach preemption");
    int reversed[NCASES], same_step[NCASES];
    for (int i = 0; i < NCASES; i++) {
        reversed[i] = order[NCASES - 1 - i];
        same_step[i] = 0;
    }
    run_batched(comm, &c, params, cases, reversed, same_step, 40, 4, 5, 0, SERVE_INFLIGHT, 0, "all at once reversed, 40 blocks of 4, chunks of 5");
    run_batched(comm, &c, params, cases, order, arrive, 256, 16, 256, 0, SERVE_INFLIGHT, 0, "batched, room for all, one chunk");
    run_batched(comm, &c, params, cases, order, arrive, 256, 16, 256, 3, SERVE_INFLIGHT, 0,
                "batched, room for all, 3 prompt rows in a decoding step");
    // the schedules make bench-serve compares in-flight batching with: the same bits
    run_batched(comm, &c, params, cases, order, arrive, 10, 16, 16, 0, SERVE_STATIC, 0, "static batches, 10 blocks of 16");
    run_batched(comm, &c, params, cases, order, arrive, 256, 16, 256, 0, SERVE_STATIC, 4, "static batches of 4");
    run_batched(comm, &c, params, cases, order, arrive, 256, 16, 7, 0, SERVE_INFLIGHT, 1, "one at a time, chunks of 7");

    // 3. a stop string: the letters the sampler's tokens spell, cut before the first match
    {
        Case* k = &cases[5];
        CHECK(k->num_expect >= 4, "case 5 is too short for the stop test");
        char stop[3] = {(char)('a' + k->expect[2] % 26), (char)('a' + k->expect[3] % 26), 0};
        char want[64];
        int n = 0;
        for (int t = 0; t < k->num_expect; t++) { want[n++] = (char)('a' + k->expect[t] % 26); }
        want[n] = 0;
        *strstr(want, stop) = 0;
        ServeEngine e;
        serve_engine_init(&e, comm, &memory_host, &c, params, 16, 16, 16, 1);
        e.token_text = letter_text;
        ServeRequest r;
        request_from_case(&r, k, c.vocab_size);
        r.stop = (char**)malloc(sizeof(char*));
        r.stop[0] = strdup(stop);
        r.num_stop = 1;
        serve_engine_submit(&e, &r);
        while (!serve_engine_idle(&e)) { serve_engine_step(&e); }
        CHECK(r.finish_reason && strcmp(r.finish_reason, "stop") == 0, "stop string: finish_reason %s", r.finish_reason);
        CHECK(strcmp(r.text, want) == 0, "stop string '%s': text '%s', expected '%s'", stop, r.text, want);
        printf("stop string '%s': text '%s', finish_reason %s\n", stop, r.text, r.finish_reason);
        serve_request_free(&r);
        serve_engine_free(&e);
    }

    // 4. a request cancelled midway: its blocks come back, the others keep their tokens
    {
        ServeEngine e;
        serve_engine_init(&e, comm, &memory_host, &c, params, 32, 8, 16, NCASES);
        ServeRequest reqs[4];
        for (int i = 0; i < 4; i++) {
            request_from_case(&reqs[i], &cases[i], c.vocab_size);
            serve_engine_submit(&e, &reqs[i]);
        }
        for (int s = 0; s < 6; s++) { serve_engine_step(&e); }
        CHECK(reqs[3].state == SERVE_RUNNING, "request 3 should be running when cancelled");
        serve_engine_cancel(&e, &reqs[3]);
        CHECK(reqs[3].table.n == 0, "the cancelled request still holds %d blocks", reqs[3].table.n);
        while (!serve_engine_idle(&e)) { serve_engine_step(&e); }
        int bad = 0;
        for (int i = 0; i < 3; i++) { bad += !same_tokens(&reqs[i], &cases[i]); }
        CHECK(bad == 0, "cancel: %d other request(s) changed", bad);
        CHECK(strcmp(reqs[3].finish_reason, "cancelled") == 0, "cancel: finish_reason %s", reqs[3].finish_reason);
        CHECK(e.kv.num_free == 32, "cancel: %d of 32 blocks free", e.kv.num_free);
        printf("cancel midway: blocks back, the others unchanged: %s\n", bad == 0 && e.kv.num_free == 32 ? "ok" : "FAIL");
        for (int i = 0; i < 4; i++) { serve_request_free(&reqs[i]); }
        serve_engine_free(&e);
    }

    activations_free(&model, &acts);
    gpt2_free(&model);
    zero_free(&zero);
    free(params);
}

int main(int argc, char** argv) {
    Comm comm;
    comm_init(&comm, &argc, &argv);
    GPT2Config c = {.max_seq_len = 64, .vocab_size = 90, .padded_vocab_size = padded_vocab(90),
                    .num_layers = 2, .num_heads = 4, .channels = 32};
    check_engine(&comm, c, "dense GPT-2");
    GPT2Config moe = c;
    moe.num_experts = 4;
    moe.top_k = 2;
    check_engine(&comm, moe, "mixture of experts");
    comm_finalize(&comm);
    if (failures) { printf("%d FAILURE(S)\n", failures); return 1; }
    printf("all serve engine tests passed\n");
    return 0;
}
