/*
 * serve_engine.h: the serving engine: in-flight batching over a paged KV cache, each request's
 * tokens the same bits whatever shares its batch (serve_gpt2.c puts HTTP in front of it).
 *
 * A step is one forward over the rows of every scheduled request (vLLM v1's scheduler,
 * DESIGN-NOTES 10): a request has `computed` positions in the cache and `len` known tokens
 * (prompt, then what it generated); a step computes rows computed .. computed + n of it, n =
 * one for a decoding request, a chunk of its prompt for a prefilling one, under a budget of
 * max_batch_tokens rows per step. Running requests go first, in admission order; when the
 * cache has no block for one, the latest running request is preempted (its blocks freed,
 * itself back at the head of the queue, recomputed from its tokens when it returns); waiting
 * requests join, first come first served, only in a step that preempted nobody. A request whose
 * known tokens are all computed draws its next token from its last row; one that finished
 * (max_tokens, maxT, a stop string, <|endoftext|>) leaves at once and frees its blocks.
 *
 * Batch invariance: every kernel of a row's forward reduces over that row's own inputs in the
 * canonical order (matmuls and layernorms per row, llmc/kernels.h), and attention
 * (attention_forward_paged) lays every request out over the same maxT positions, so its R2Z
 * chunks of keys are fixed by the position alone. A request's rows are therefore the rows of
 * the trainer's sampler's forward over (1, maxT), bit for bit: alone or batched, in any
 * arrival order, any prefill chunking, after a preemption. A mixture-of-experts layer keeps
 * this (serve_moe_forward): the router and its top-k choice are per row and the trainer's layer
 * has no capacity limit (moe.h: every slot reaches its expert), so nothing couples a row to the
 * other rows of its batch: not the serving batch, nor the padding positions after the prompt
 * in the sampler's (1, maxT) pass. Its draws come from its own
 * Sampler and xorshift state (seed), one coin per token as the trainer's sampler (engine.h),
 * which with -g maxT, --prompt and seed 1337 gives the same tokens.
 *
 * The engine is single-threaded: serve_engine_submit, serve_engine_cancel and
 * serve_engine_step are called from one thread (the server's engine thread).
 */
#ifndef LLMC_SERVE_ENGINE_H
#define LLMC_SERVE_ENGINE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/canonical.h"
#include "llmc/decode_matmul.h"
#include "llmc/kernels.h"
#include "llmc/model.h"
#include "llmc/moe.h"
#include "llmc/paged_kv.h"
#include "llmc/rand.h"
#include "llmc/sampler.h"
#include "llmc/utils.h"

#define SERVE_EOT 50256   // GPT-2's <|endoftext|>

typedef enum { SERVE_WAITING, SERVE_RUNNING, SERVE_FINISHED } ServeState;

// How waiting requests join: SERVE_INFLIGHT, at any step with room (continuous batching);
// SERVE_STATIC, a batch admitted together when the last one finished, none joining until all
// of it has (the baseline in-flight batching is measured against: make bench-serve). Either
// way a request's rows are the same bits, as batch invariance says.
typedef enum { SERVE_INFLIGHT, SERVE_STATIC } ServeBatching;

typedef struct ServeRequest {
    // what was asked (serve_request_init, then the caller's fields)
    int* tokens;            // (cap): the prompt's num_prompt tokens, then the generated ones
    int num_prompt, len, cap;
    int max_tokens;         // generated tokens at most
    int ignore_eos;         // 1: <|endoftext|> does not stop it
    char** stop;            // stop strings (their text ends the output before them)
    int num_stop;
    Sampler sampler;
    uint64_t rng;           // xorshift state: the seed
    // the engine's bookkeeping
    ServeState state;
    int computed;           // positions whose keys and values are in the cache
    BlockTable table;
    int preemptions;
    uint64_t fingerprint;   // FNV-1a over the bytes of every distribution drawn from: the bits tests compare
    const char* finish_reason;   // "length", "stop", "cancelled" once finished
    char* text;             // the generated tokens' bytes (with a token text table)
    size_t text_len, text_cap;
    size_t text_ready;      // bytes of text that no stop string can take back
    void* user;             // the caller's
} ServeRequest;

// token id -> its bytes (a BPE table), for stop strings and text; NULL: no text
typedef const uint8_t* (*ServeTokenText)(void* ctx, int token, size_t* len);

typedef struct ServeEngine {
    GPT2Config config;
    const float* params;    // MEMORY order (model.h)
    DecodeWeights decode;   // packed copies of its matrices, for steps of few rows (serve_matmul)
    int maxT, C, Vp, max_batch_tokens;
    PagedKV kv;
    ServeRequest** running;   // admission order
    int num_running;
    ServeRequest** waiting;   // FCFS; preempted requests at the front
    int num_waiting, max_requests;
    int max_running;          // requests in the batch at most (1: one at a time); default max_requests
    ServeBatching batching;   // default SERVE_INFLIGHT
    ServeTokenText token_text;
    void* token_text_ctx;
    // called for each drawn token (after the request's fields are updated) and once when it
    // finishes (token -1); both from serve_engine_step or serve_engine_cancel
    void (*on_event)(void* ctx, ServeRequest* r, int token);
    void* event_ctx;
    // the forward's activations over at most max_batch_tokens rows
    float *x, *ln, *mean, *rstd, *qkv, *atty, *proj, *x2, *fch, *fch_gelu, *att_scratch;
    float *hx, *logits, *ce;
    // a mixture-of-experts layer's routing over the step's rows (config.num_experts > 0; fch and
    // fch_gelu then hold the k dispatch rows of each row)
    float *moe_probs, *moe_gates, *moe_xin, *moe_ret;
    int *moe_chosen, *moe_count, *moe_row_pos, *moe_slot_row, *moe_cursor;
    int *row_tok, *row_pos, *head_rows;    // per row: token, position; the rows the head reads
    const int** row_table;                  // per row: its request's block table
    ServeRequest** sched;                   // the step's requests, their last rows
    int *sched_last_row, num_sched, num_rows;
    // counters
    long long steps, rows_computed, tokens_generated, preemptions;
} ServeEngine;

// FNV-1a of n floats' bytes, continued from h (start: SERVE_FNV_BASIS)
#define SERVE_FNV_BASIS 14695981039346656037ull
static inline uint64_t serve_fnv1a(uint64_t h, const float* x, size_t n) {
    const unsigned char* b = (const unsigned char*)x;
    for (size_t i = 0; i < n * sizeof(float); i++) { h = (h ^ b[i]) * 1099511628211ull; }
    return h;
}

static inline void serve_request_init(ServeRequest* r, const int* prompt, int n, int max_tokens, float temperature,
                                      int top_k, float top_p, uint64_t seed, int V) {
    memset(r, 0, sizeof(*r));
    r->cap = n + (max_tokens > 0 ? max_tokens : 0) + 1;
    r->tokens = (int*)malloc_or_die(sizeof(int) * (size_t)r->cap, "request tokens");
    memcpy(r->tokens, prompt, sizeof(int) * (size_t)n);
    r->num_prompt = r->len = n;
    r->max_tokens = max_tokens;
    sampler_init(&r->sampler, temperature, top_k, V);
    r->sampler.top_p = top_p;
    r->rng = seed;
    r->fingerprint = SERVE_FNV_BASIS;
}

static inline void serve_request_free(ServeRequest* r) {
    free(r->tokens);
    sampler_free(&r->sampler);
    block_table_free(&r->table);
    for (int i = 0; i < r->num_stop; i++) { free(r->stop[i]); }
    free(r->stop);
    free(r->text);
}

static inline int serve_generated(const ServeRequest* r) { return r->len - r->num_prompt; }

// kv_blocks must hold one request of maxT positions (a lone request never preempts itself).
static inline void serve_engine_init(ServeEngine* e, const GPT2Config* config, const float* params, int kv_blocks,
                                     int block_size, int max_batch_tokens, int max_requests) {
    memset(e, 0, sizeof(*e));
    e->config = *config;
    e->params = params;
    e->maxT = config->max_seq_len;
    e->C = config->channels;
    e->Vp = config->padded_vocab_size;
    e->max_batch_tokens = max_batch_tokens;
    e->max_requests = max_requests;
    e->max_running = max_requests;
    e->batching = SERVE_INFLIGHT;
    int C = e->C, N = max_batch_tokens;
    if (max_batch_tokens < 1) { fatal("--max-batch-tokens %d: at least 1 row per step", max_batch_tokens); }
    if ((long)kv_blocks * block_size < e->maxT) {
        fatal("--kv-blocks %d of --block-size %d: %ld positions, less than one request of maxT = %d needs", kv_blocks,
              block_size, (long)kv_blocks * block_size, e->maxT);
    }
    paged_kv_init(&e->kv, kv_blocks, block_size, config->num_layers, C);
    e->running = (ServeRequest**)malloc_or_die(sizeof(ServeRequest*) * (size_t)max_requests, "running requests");
    e->waiting = (ServeRequest**)malloc_or_die(sizeof(ServeRequest*) * (size_t)max_requests, "waiting requests");
    size_t rows = (size_t)N, E = (size_t)config->num_experts, slots = rows * (E > 0 ? (size_t)config->top_k : 1);
    e->x = (float*)malloc_or_die(sizeof(float) * rows * C, "serve activations");
    e->ln = (float*)malloc_or_die(sizeof(float) * rows * C, "serve activations");
    e->mean = (float*)malloc_or_die(sizeof(float) * rows, "serve activations");
    e->rstd = (float*)malloc_or_die(sizeof(float) * rows, "serve activations");
    e->qkv = (float*)malloc_or_die(sizeof(float) * rows * 3 * C, "serve activations");
    e->atty = (float*)malloc_or_die(sizeof(float) * rows * C, "serve activations");
    e->proj = (float*)malloc_or_die(sizeof(float) * rows * C, "serve activations");
    e->x2 = (float*)malloc_or_die(sizeof(float) * rows * C, "serve activations");
    e->fch = (float*)malloc_or_die(sizeof(float) * slots * 4 * C, "serve activations");
    e->fch_gelu = (float*)malloc_or_die(sizeof(float) * slots * 4 * C, "serve activations");
    if (E > 0) {
        e->moe_probs = (float*)malloc_or_die(sizeof(float) * rows * E, "serve routing");
        e->moe_gates = (float*)malloc_or_die(sizeof(float) * slots, "serve routing");
        e->moe_xin = (float*)malloc_or_die(sizeof(float) * slots * C, "serve expert rows");
        e->moe_ret = (float*)malloc_or_die(sizeof(float) * slots * C, "serve expert rows");
        e->moe_chosen = (int*)malloc_or_die(sizeof(int) * slots, "serve routing");
        e->moe_count = (int*)malloc_or_die(sizeof(int) * E, "serve routing");
        e->moe_row_pos = (int*)malloc_or_die(sizeof(int) * slots, "serve routing");
        e->moe_slot_row = (int*)malloc_or_die(sizeof(int) * slots, "serve routing");
        e->moe_cursor = (int*)malloc_or_die(sizeof(int) * E, "serve routing");
    }
    e->att_scratch = (float*)malloc_or_die(sizeof(float) * ((size_t)e->maxT * 3 * C + (size_t)config->num_heads * e->maxT),
                                           "serve attention scratch");
    e->hx = (float*)malloc_or_die(sizeof(float) * rows * C, "serve activations");
    e->logits = (float*)malloc_or_die(sizeof(float) * rows * e->Vp, "serve logits");
    e->ce = (float*)malloc_or_die(sizeof(float) * rows * 3, "serve activations");
    e->row_tok = (int*)malloc_or_die(sizeof(int) * rows, "serve rows");
    e->row_pos = (int*)malloc_or_die(sizeof(int) * rows, "serve rows");
    e->sched = (ServeRequest**)malloc_or_die(sizeof(ServeRequest*) * (size_t)max_requests, "serve step");
    e->sched_last_row = (int*)malloc_or_die(sizeof(int) * (size_t)max_requests, "serve step");
    e->head_rows = (int*)malloc_or_die(sizeof(int) * rows, "serve rows");
    e->row_table = (const int**)malloc_or_die(sizeof(int*) * rows, "serve rows");
    decode_weights_pack_model(&e->decode, config, params);
}

static inline void serve_engine_free(ServeEngine* e) {
    paged_kv_free(&e->kv);
    decode_weights_free(&e->decode);
    void* bufs[] = {e->running, e->waiting, e->x, e->ln, e->mean, e->rstd, e->qkv, e->atty, e->proj, e->x2, e->fch,
                    e->fch_gelu, e->att_scratch, e->hx, e->logits, e->ce, e->row_tok, e->row_pos, e->head_rows,
                    (void*)e->row_table, e->sched, e->sched_last_row, e->moe_probs, e->moe_gates, e->moe_xin,
                    e->moe_ret, e->moe_chosen, e->moe_count, e->moe_row_pos, e->moe_slot_row, e->moe_cursor};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) { free(bufs[i]); }
}

static inline int serve_engine_idle(const ServeEngine* e) { return e->num_running == 0 && e->num_waiting == 0; }

// Queues a request (its prompt: 1 .. maxT - 1 tokens, each in [0, V)); 0 when the engine
// holds max_requests already.
static inline int serve_engine_submit(ServeEngine* e, ServeRequest* r) {
    if (e->num_running + e->num_waiting >= e->max_requests) { return 0; }
    r->state = SERVE_WAITING;
    e->waiting[e->num_waiting++] = r;
    return 1;
}

static inline void serve_remove_at(ServeRequest** list, int* n, int i) {
    memmove(list + i, list + i + 1, sizeof(*list) * (size_t)(*n - i - 1));
    (*n)--;
}

static inline void serve_finish(ServeEngine* e, ServeRequest* r, const char* reason) {
    block_table_release(&e->kv, &r->table);
    r->state = SERVE_FINISHED;
    r->finish_reason = reason;
    r->text_ready = r->text_len;
    if (e->on_event) { e->on_event(e->event_ctx, r, -1); }
}

// Removes a request wherever it is (a client gone); its blocks go back to the free list.
static inline void serve_engine_cancel(ServeEngine* e, ServeRequest* r) {
    if (r->state == SERVE_FINISHED) { return; }
    for (int i = 0; i < e->num_running; i++) {
        if (e->running[i] == r) { serve_remove_at(e->running, &e->num_running, i); }
    }
    for (int i = 0; i < e->num_waiting; i++) {
        if (e->waiting[i] == r) { serve_remove_at(e->waiting, &e->num_waiting, i); }
    }
    serve_finish(e, r, "cancelled");
}

// Preemption by recompute: the latest running request gives its blocks back and waits at the
// head of the queue with its tokens; its rows come back the same bits when it is recomputed.
static inline void serve_preempt_latest(ServeEngine* e) {
    ServeRequest* r = e->running[--e->num_running];
    block_table_release(&e->kv, &r->table);
    r->computed = 0;
    r->state = SERVE_WAITING;
    r->preemptions++;
    e->preemptions++;
    memmove(e->waiting + 1, e->waiting, sizeof(*e->waiting) * (size_t)e->num_waiting);
    e->waiting[0] = r;
    e->num_waiting++;
}

// Every matmul of the engine: matmul_forward's bits, from the packed copy of the weight when the
// step has few rows (a decode step's one row per request is bound by reading the weights).
static inline void serve_matmul(ServeEngine* e, float* out, const float* inp, const float* weight, const float* bias,
                                int N, int IC, int OC) {
    decode_matmul(&e->decode, out, inp, weight, bias, N, IC, OC, CANON_R);
}

// A mixture-of-experts layer l in place of the MLP (llmc/moe.h THE LAYER; train_gpt2.c
// moe_forward at one rank, kernel for kernel) on the step's N rows: e->ln (N,C) -> e->proj
// (N,C). Each row's router logits, choice and gates are its own (per-row kernels), and every
// slot reaches its expert (no capacity limit), so the dispatch order (rows sorted by expert,
// moe_plan_routes with each row a sequence of one position) only places the rows: each
// expert's matmuls reduce per row, and the combine sums a row's k outputs in ascending expert
// index. A row's output is therefore the same bits in any batch, as in the sampler's pass.
static inline void serve_moe_forward(ServeEngine* e, int l, int N) {
    const GPT2Config* c = &e->config;
    int C = e->C, C4 = 4 * C, E = c->num_experts, k = c->top_k;
    const float* p = e->params;
    serve_matmul(e, e->moe_probs, e->ln, p + param_offset(c, P_ROUTERW, l), NULL, N, C, E);
    moe_router_forward(e->moe_probs, e->moe_chosen, e->moe_gates, e->moe_probs, N, E, k);
    moe_plan_routes(e->moe_chosen, N, 1, k, E, e->moe_count, e->moe_row_pos, e->moe_slot_row, e->moe_cursor);
    moe_gather_rows(e->moe_xin, e->ln, e->moe_row_pos, N * k, C);
    // expert x's tensors: block x of the stacked fcw (E,4C,C), fcb (E,4C), fcprojw (E,C,4C), fcprojb (E,C)
    const float *fcw = p + param_offset(c, P_FCW, l), *fcb = p + param_offset(c, P_FCB, l);
    const float *fcprojw = p + param_offset(c, P_FCPROJW, l), *fcprojb = p + param_offset(c, P_FCPROJB, l);
    for (int x = 0, r0 = 0; x < E; r0 += e->moe_count[x], x++) {
        int n = e->moe_count[x];
        if (n == 0) { continue; }
        float *fch = e->fch + (size_t)r0 * C4, *gelu = e->fch_gelu + (size_t)r0 * C4, *y = e->moe_ret + (size_t)r0 * C;
        serve_matmul(e, fch, e->moe_xin + (size_t)r0 * C, fcw + (size_t)x * C4 * C, fcb + (size_t)x * C4, n, C, C4);
        gelu_forward(gelu, fch, (size_t)n * C4);
        serve_matmul(e, y, gelu, fcprojw + (size_t)x * C * C4, NULL, n, C4, C);
        bias_forward(y, fcprojb + (size_t)x * C, n, C);
    }
    moe_combine(e->proj, e->moe_ret, e->moe_gates, e->moe_slot_row, N, k, C);
}

// The forward over the step's N rows: x (N,C) -> each layer -> the final residual in e->x.
// The layer is the trainer's (train_gpt2.c layers_forward at one rank), kernel for kernel; the
// new keys and values go into their cache slots before attention reads them.
static inline void serve_forward(ServeEngine* e, int N) {
    const GPT2Config* c = &e->config;
    int C = e->C, L = c->num_layers, NH = c->num_heads, bs = e->kv.block_size;
    const float* p = e->params;
    encoder_lookup(e->x, e->row_tok, p + param_offset(c, P_WTE, 0), 0, e->Vp, N, C);
    const float* wpe = p + param_offset(c, P_WPE, 0);
    for (int r = 0; r < N; r++) { encoder_add_positions(e->x + (size_t)r * C, wpe + (size_t)e->row_pos[r] * C, 1, 1, C); }
    long block_stride = paged_kv_block_stride(&e->kv);
    for (int l = 0; l < L; l++) {
#define W(t) (p + param_offset(c, t, l))
        layernorm_forward(e->ln, e->mean, e->rstd, e->x, W(P_LN1W), W(P_LN1B), N, C);
        serve_matmul(e, e->qkv, e->ln, W(P_QKVW), W(P_QKVB), N, C, 3 * C);
        float* kv = paged_kv_layer(&e->kv, l);
        for (int r = 0; r < N; r++) {
            int pos = e->row_pos[r];
            float* slot = kv + e->row_table[r][pos / bs] * block_stride + (size_t)(pos % bs) * 2 * C;
            memcpy(slot, e->qkv + (size_t)r * 3 * C + C, sizeof(float) * 2 * C);
        }
        attention_forward_paged(e->atty, e->att_scratch, e->qkv, kv, block_stride, e->row_table, e->row_pos, N, e->maxT,
                                bs, C, NH);
        serve_matmul(e, e->proj, e->atty, W(P_ATTPROJW), NULL, N, C, C);
        bias_forward(e->proj, W(P_ATTPROJB), N, C);
        residual_forward(e->x2, e->x, e->proj, (size_t)N * C);
        layernorm_forward(e->ln, e->mean, e->rstd, e->x2, W(P_LN2W), W(P_LN2B), N, C);
        if (c->num_experts > 0) {
            serve_moe_forward(e, l, N);
        } else {
            serve_matmul(e, e->fch, e->ln, W(P_FCW), W(P_FCB), N, C, 4 * C);
            gelu_forward(e->fch_gelu, e->fch, (size_t)N * 4 * C);
            serve_matmul(e, e->proj, e->fch_gelu, W(P_FCPROJW), NULL, N, 4 * C, C);
            bias_forward(e->proj, W(P_FCPROJB), N, C);
        }
        residual_forward(e->x, e->x2, e->proj, (size_t)N * C);
#undef W
    }
}

// The head on M of the rows (head_rows): probabilities (M,Vp) in e->logits, as the trainer's
// head_forward computes them (final layernorm, logits against wte, softmax).
static inline void serve_head(ServeEngine* e, int M) {
    const GPT2Config* c = &e->config;
    int C = e->C, V = c->vocab_size, Vp = e->Vp;
    for (int i = 0; i < M; i++) { memcpy(e->hx + (size_t)i * C, e->x + (size_t)e->head_rows[i] * C, sizeof(float) * C); }
    const float* lnf = e->params + param_offset(c, P_LNFW, 0);
    layernorm_forward(e->ln, e->mean, e->rstd, e->hx, lnf, e->params + param_offset(c, P_LNFB, 0), M, C);
    serve_matmul(e, e->logits, e->ln, e->params + param_offset(c, P_WTE, 0), NULL, M, C, Vp);
    float *maxes = e->ce, *zs = e->ce + M, *target_logits = e->ce + 2 * M;
    crossentropy_max(maxes, e->logits, M, V, 0, Vp);
    crossentropy_exps(zs, target_logits, e->logits, maxes, NULL, M, V, 0, Vp, CANON_R);
    crossentropy_normalize(e->logits, NULL, zs, target_logits, maxes, NULL, M, V, 0, Vp);
}

// The token's bytes appended to the request's text; a stop string found in it ends the text
// before it (returns 1). Text that a stop string could still take back is not ready.
static inline int serve_append_text(ServeEngine* e, ServeRequest* r, int token) {
    if (!e->token_text) { return 0; }
    size_t n;
    const uint8_t* bytes = e->token_text(e->token_text_ctx, token, &n);
    if (r->text_len + n + 1 > r->text_cap) {
        r->text_cap = 2 * (r->text_len + n + 1);
        r->text = (char*)realloc(r->text, r->text_cap);
        if (!r->text) { fatal("out of memory: a request's text of %zu bytes", r->text_cap); }
    }
    size_t old = r->text_len;
    memcpy(r->text + r->text_len, bytes, n);
    r->text_len += n;
    r->text[r->text_len] = '\0';
    size_t hold = 0;
    for (int i = 0; i < r->num_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        if (sl == 0) { continue; }
        size_t from = old + 1 > sl ? old + 1 - sl : 0;   // a match must end in the new bytes
        char* hit = memmem(r->text + from, r->text_len - from, r->stop[i], sl);
        if (hit) {
            r->text_len = (size_t)(hit - r->text);
            r->text[r->text_len] = '\0';
            return 1;
        }
        if (sl - 1 > hold) { hold = sl - 1; }
    }
    r->text_ready = r->text_len > hold ? r->text_len - hold : 0;
    if (r->text_ready < old) { r->text_ready = old; }   // never take back what was ready
    return 0;
}

// The next token of a request whose known tokens are all computed, from its probabilities;
// returns the finish reason, or NULL while it goes on.
static inline const char* serve_draw(ServeEngine* e, ServeRequest* r, const float* probs) {
    int V = e->config.vocab_size;
    r->fingerprint = serve_fnv1a(r->fingerprint, probs, (size_t)V);
    int token = sampler_draw(&r->sampler, probs, V, random_f32(&r->rng));
    r->tokens[r->len++] = token;
    e->tokens_generated++;
    if (token == SERVE_EOT && V > SERVE_EOT && !r->ignore_eos) {
        if (e->on_event) { e->on_event(e->event_ctx, r, token); }
        return "stop";
    }
    int stopped = serve_append_text(e, r, token);
    if (e->on_event) { e->on_event(e->event_ctx, r, token); }
    if (stopped) { return "stop"; }
    if (serve_generated(r) >= r->max_tokens || r->len >= e->maxT) { return "length"; }
    return NULL;
}

// Request r's rows [r->computed, r->computed + n) join the step's batch (its blocks reserved).
static inline void serve_schedule(ServeEngine* e, ServeRequest* r, int n, int* rows) {
    int s = e->num_sched++;
    e->sched[s] = r;
    for (int p = r->computed; p < r->computed + n; p++) {
        e->row_tok[*rows] = r->tokens[p];
        e->row_pos[*rows] = p;
        e->row_table[*rows] = r->table.blocks;
        (*rows)++;
    }
    e->sched_last_row[s] = *rows - 1;
}

// An iteration in three parts, so that a server can run the forward without its lock: the
// schedule and the draws change the requests and the queues, the forward only the cache and
// the engine's activations.
// 1. The schedule: which rows of which requests this step computes; returns their number.
static inline void serve_admit(ServeEngine* e) {
    ServeRequest* r = e->waiting[0];
    serve_remove_at(e->waiting, &e->num_waiting, 0);
    r->state = SERVE_RUNNING;
    e->running[e->num_running++] = r;
}

static inline int serve_engine_schedule(ServeEngine* e) {
    int budget = e->max_batch_tokens, rows = 0, preempted = 0;
    e->num_sched = 0;
    if (e->batching == SERVE_STATIC && e->num_running == 0) {   // the whole batch at once; its prefill chunked below
        while (e->num_waiting > 0 && e->num_running < e->max_running) { serve_admit(e); }
    }
    for (int i = 0; i < e->num_running && budget > 0; i++) {
        ServeRequest* r = e->running[i];
        int n = r->len - r->computed < budget ? r->len - r->computed : budget;
        int room;
        while (!(room = block_table_reserve(&e->kv, &r->table, r->computed + n))) {
            int itself = i == e->num_running - 1;
            serve_preempt_latest(e);
            preempted = 1;
            if (itself) { break; }
        }
        if (!room) { break; }
        serve_schedule(e, r, n, &rows);
        budget -= n;
    }
    while (e->batching == SERVE_INFLIGHT && !preempted && e->num_waiting > 0 && budget > 0 &&
           e->num_running < e->max_running) {
        ServeRequest* r = e->waiting[0];
        int n = r->len - r->computed < budget ? r->len - r->computed : budget;
        if (!block_table_reserve(&e->kv, &r->table, r->computed + n)) { break; }
        serve_admit(e);
        serve_schedule(e, r, n, &rows);
        budget -= n;
    }
    e->num_rows = rows;
    return rows;
}

// 2. The forward over the scheduled rows, and the head on the last row of every request that
// caught up (all its known tokens computed).
static inline void serve_engine_forward(ServeEngine* e) {
    if (e->num_rows == 0) { return; }
    serve_forward(e, e->num_rows);
    int M = 0;
    for (int s = 0; s < e->num_sched; s++) {
        ServeRequest* r = e->sched[s];
        if (e->row_pos[e->sched_last_row[s]] + 1 == r->len) { e->head_rows[M++] = e->sched_last_row[s]; }
    }
    if (M > 0) { serve_head(e, M); }
}

// 3. Each request that caught up draws its next token; the finished ones leave.
static inline void serve_engine_finish_step(ServeEngine* e) {
    if (e->num_rows == 0) { return; }
    for (int s = 0, m = 0; s < e->num_sched; s++) {
        ServeRequest* r = e->sched[s];
        r->computed = e->row_pos[e->sched_last_row[s]] + 1;
        if (r->computed != r->len) { continue; }
        const char* reason = serve_draw(e, r, e->logits + (size_t)m++ * e->Vp);
        if (reason) {
            for (int i = 0; i < e->num_running; i++) {
                if (e->running[i] == r) { serve_remove_at(e->running, &e->num_running, i); }
            }
            serve_finish(e, r, reason);
        }
    }
    e->steps++;
    e->rows_computed += e->num_rows;
    e->num_rows = 0;
}

// One iteration: schedule, one forward over the scheduled rows, a token for each request that
// caught up. Returns the rows computed (0: nothing to do).
static inline int serve_engine_step(ServeEngine* e) {
    int rows = serve_engine_schedule(e);
    serve_engine_forward(e);
    serve_engine_finish_step(e);
    return rows;
}

#endif // LLMC_SERVE_ENGINE_H
