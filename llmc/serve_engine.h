/*
 * serve_engine.h: the serving engine: in-flight batching over a paged KV cache, each request's
 * tokens the same bits whatever shares its batch (serve_gpt2.c puts HTTP in front of it).
 *
 * A step is one forward over the rows of every scheduled request (vLLM v1's scheduler,
 * DESIGN-NOTES 10): a request has `computed` positions in the cache and `len` known tokens
 * (prompt, then what it generated); a step computes rows computed .. computed + n of it, n =
 * one for a decoding request, a chunk of its prompt for a prefilling one, under a budget of
 * max_batch_tokens rows per step, of which at most max_prefill_tokens are prompt rows when the
 * step also decodes (Sarathi-Serve's stall-free batching: a joining prompt does not stretch its
 * neighbours' inter-token latency). Running requests go first, in admission order; when the
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
 * arrival order, any prefill chunking, after a preemption. The layers are the trainer's own
 * (train_gpt2.c layers_forward, through serve_model.c), run on the step's rows as sequences of
 * one position with the engine's attention step (serve_attend); a mixture-of-experts
 * layer keeps the promise too: the router and its top-k choice are per row and the trainer's
 * layer has no capacity limit (moe.h: every slot reaches its expert), so nothing couples a row
 * to the other rows of its batch: not the serving batch, nor the padding positions after the
 * prompt in the sampler's (1, maxT) pass. Its draws come from its own
 * Sampler and xorshift state (seed), one coin per token as the trainer's sampler (engine.h),
 * which with -g maxT, --prompt and seed 1337 gives the same tokens.
 *
 * Across ranks (llmc/serve_parallel.h) world rank 0 schedules and broadcasts each step's
 * rows (serve_step_broadcast); every other rank runs serve_engine_follow, the same forward and
 * head on its slice of the model, until rank 0 sends the end (serve_engine_stop_followers).
 * Each rank's KV cache holds its own heads: C/K channels of keys and values per position;
 * with --kvp P (llmc/serve_kvp.h) only its KVP group's share of the positions, 1/P of the blocks.
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
#include "llmc/comm.h"
#include "llmc/kernels.h"
#include "llmc/memory.h"
#include "llmc/model.h"
#include "llmc/paged_kv.h"
#include "llmc/rand.h"
#include "llmc/sampler.h"
#include "llmc/serve_kvp.h"
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
    int in_flight;          // --pp: its rows are in an iteration the pipeline has not finished (serve_pipeline.h)
    uint64_t fingerprint;   // FNV-1a over the bytes of every distribution drawn from: the bits tests compare
    const char* finish_reason;   // "length", "stop", "cancelled" once finished
    char* text;             // the generated tokens' bytes (with a token text table)
    size_t text_len, text_cap;
    size_t text_ready;      // bytes of text that no stop string can take back
    void* user;             // the caller's
} ServeRequest;

// token id -> its bytes (a BPE table), for stop strings and text; NULL: no text
typedef const uint8_t* (*ServeTokenText)(void* ctx, int token, size_t* len);

// The model side of a step (serve_model.c: train_gpt2.c's model, this rank's slice, which a program
// includes with it): the model's parameters (without gradients or optimizer state),
// activations for `rows` rows, each a sequence of one position (B = rows, T = 1: every kernel
// but attention is per row), the layers' attention step `attend` (layer l's qkv (N,3C) -> atty
// (N,C), C and NH this rank's); every tensor in mem.
typedef struct ServeModel ServeModel;
typedef void (*ServeAttend)(void* ctx, int l, const float* qkv, float* atty, int C, int NH);
static ServeModel* serve_model_create(Comm* comm, const MemOps* mem, const GPT2Config* config, const float* params,
                                      int rows, ServeAttend attend, void* ctx);
static void serve_model_free(ServeModel* m);
// N rows (host: their tokens and positions): the embeddings, then the layers
static void serve_model_forward(ServeModel* m, const int* tokens, const int* pos, int N);
// the head on M of the N rows (rows_dev, in mem): probabilities (M,Vp) into probs (host)
static void serve_model_head(ServeModel* m, int N, const int* rows_dev, int M, float* probs);

typedef struct ServeEngine {
    GPT2Config config;
    int maxT, C, Vp, max_batch_tokens;
    Comm* comm;               // the ranks (llmc/serve_parallel.h's layout): world rank 0 schedules
    // the model (serve_model.c); the KV cache and the step's buffers below in its memory (mem:
    // host, or the GPU's in serve_gpt2cu)
    const MemOps* mem;
    ServeModel* model;
    PagedKV kv;               // this rank's cache (its heads; under KVP its blocks, handed out from kvp.pools)
    ServeKVP kvp;             // KV parallelism (llmc/serve_kvp.h); kvp.P == 1: none
    ServeRequest** running;   // admission order
    int num_running;
    ServeRequest** waiting;   // FCFS; preempted requests at the front
    int num_waiting, max_requests;
    int max_running;          // requests in the batch at most (1: one at a time); default max_requests
    int max_prefill_tokens;   // prompt rows in a step that also decodes, at most (0: max_batch_tokens)
    ServeBatching batching;   // default SERVE_INFLIGHT
    int max_sched;            // requests per step at most (serve_pipeline.h's micro-batches); 0: no limit
    int num_in_flight;        // requests in iterations in flight (serve_pipeline.h): never preempted
    ServeTokenText token_text;
    void* token_text_ctx;
    // called for each drawn token (after the request's fields are updated) and once when it
    // finishes (token -1); both from serve_engine_step or serve_engine_cancel
    void (*on_event)(void* ctx, ServeRequest* r, int token);
    void* event_ctx;
    // the step on the host: per row its token, position, block table (row_tables (rows,
    // max_blocks)); the rows the head reads; the runs of rows whose keys and values go to
    // consecutive slots of one block (run_row, its first row; run_slot, where it goes in a layer's
    // view of the cache; run_len, its rows)
    int *row_tok, *row_pos, *row_tables, *head_rows, max_blocks;
    int *run_row, *run_len, num_runs;
    long* run_slot;
    ServeRequest** sched;                   // the step's requests, their last rows
    int *sched_last_row, num_sched, num_rows;
    int* sched_head;                        // per scheduled request, its row of probs (-1: no draw this step)
    // ... and in mem: positions, tables and head rows as the kernels read them; attention's scratch
    int *pos_dev, *tables_dev, *head_rows_dev;
    float* att_scratch;
    float* probs;                           // (rows,Vp) on the host: what the requests draw from
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

// serve_fnv1a of SERVE_FNV_ROWS rows at once, each continued from its own h[j]: the same
// hashes, the rows' multiply chains interleaved (one row's waits on the multiplier's latency
// for every byte), each in a general register (the empty asm: gcc would otherwise put the four
// chains in one vector and multiply by shifts and adds, ten dependent operations a byte)
#define SERVE_FNV_ROWS 4
static inline void serve_fnv1a_rows(uint64_t h[SERVE_FNV_ROWS], const float* const x[SERVE_FNV_ROWS], size_t n) {
    const uint64_t prime = 1099511628211ull;
    const unsigned char *b0 = (const unsigned char*)x[0], *b1 = (const unsigned char*)x[1];
    const unsigned char *b2 = (const unsigned char*)x[2], *b3 = (const unsigned char*)x[3];
    uint64_t a0 = h[0], a1 = h[1], a2 = h[2], a3 = h[3];
    for (size_t i = 0; i < n * sizeof(float); i++) {
        a0 = (a0 ^ b0[i]) * prime;
        a1 = (a1 ^ b1[i]) * prime;
        a2 = (a2 ^ b2[i]) * prime;
        a3 = (a3 ^ b3[i]) * prime;
        __asm__("" : "+r"(a0), "+r"(a1), "+r"(a2), "+r"(a3));
    }
    h[0] = a0;
    h[1] = a1;
    h[2] = a2;
    h[3] = a3;
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

static void serve_attend(void* ctx, int l, const float* qkv, float* atty, int C, int NH);

// The engine on the model of `config` with the given parameters (MEMORY order, model.h, on the
// host), its tensors in mem; comm: the ranks, their groups set up for the layout
// (llmc/serve_parallel.h; one rank without mpirun), this rank's slice of the model and its heads
// of the cache from its tp and ep groups. kv_blocks must hold one request of
// maxT positions (a lone request never preempts itself); under KVP (comm->cp = P ranks) they are
// the P ranks' blocks together, each rank holding kv_blocks / P (llmc/serve_kvp.h).
static inline void serve_engine_init(ServeEngine* e, Comm* comm, const MemOps* mem, const GPT2Config* config,
                                     const float* params, int kv_blocks, int block_size, int max_batch_tokens,
                                     int max_requests) {
    memset(e, 0, sizeof(*e));
    e->config = *config;
    e->mem = mem;
    e->maxT = config->max_seq_len;
    e->C = config->channels;
    e->Vp = config->padded_vocab_size;
    e->max_batch_tokens = max_batch_tokens;
    e->max_requests = max_requests;
    e->max_running = max_requests;
    e->batching = SERVE_INFLIGHT;
    e->comm = comm;
    // the groups' collectives on the model's buffers in mem (device ones staged through host
    // memory, or NCCL: comm.h), as the trainer's (engine.h trainer_build)
    comm_set_memory(comm, mem);
    int K = comm->tp_group.size;
    int C = e->C / K, N = max_batch_tokens, NH = config->num_heads / K;   // this rank's heads
    int P = comm->cp;   // KVP ranks (llmc/serve_kvp.h), each holding kv_blocks / P of the blocks
    if (max_batch_tokens < 1) { fatal("--max-batch-tokens %d: at least 1 row per step", max_batch_tokens); }
    if ((long)kv_blocks * block_size < e->maxT) {
        fatal("--kv-blocks %d of --block-size %d: %ld positions, less than one request of maxT = %d needs", kv_blocks,
              block_size, (long)kv_blocks * block_size, e->maxT);
    }
    e->model = serve_model_create(comm, mem, config, params, N, serve_attend, e);
    paged_kv_init(&e->kv, mem, kv_blocks / P, block_size, config->num_layers / comm->pp, C);   // this stage's layers
    serve_kvp_init(&e->kvp, comm, mem, config, kv_blocks, block_size);
    e->max_blocks = paged_kv_blocks_for(&e->kv, e->maxT);
    e->running = (ServeRequest**)malloc_or_die(sizeof(ServeRequest*) * (size_t)max_requests, "running requests");
    e->waiting = (ServeRequest**)malloc_or_die(sizeof(ServeRequest*) * (size_t)max_requests, "waiting requests");
    e->sched = (ServeRequest**)malloc_or_die(sizeof(ServeRequest*) * (size_t)max_requests, "serve step");
    e->sched_last_row = (int*)malloc_or_die(sizeof(int) * 2 * (size_t)max_requests, "serve step");
    e->sched_head = e->sched_last_row + max_requests;
    size_t rows = (size_t)N;
    e->row_tok = (int*)calloc_or_die(rows * (5 + (size_t)e->max_blocks), sizeof(int), "serve rows");
    e->row_pos = e->row_tok + rows;
    e->head_rows = e->row_pos + rows;
    e->run_row = e->head_rows + rows;
    e->run_len = e->run_row + rows;
    e->row_tables = e->run_len + rows;
    e->run_slot = (long*)malloc_or_die(sizeof(long) * rows, "serve rows");
    e->pos_dev = (int*)mem->alloc(sizeof(int) * rows * (2 + (size_t)e->max_blocks), "serve rows");
    e->head_rows_dev = e->pos_dev + rows;
    e->tables_dev = e->head_rows_dev + rows;
    e->att_scratch = mem_floats(mem, rows * NH * e->maxT, "serve attention scratch");
    e->probs = (float*)malloc_or_die(sizeof(float) * rows * e->Vp, "serve probabilities");
}

static inline void serve_engine_free(ServeEngine* e) {
    paged_kv_free(&e->kv);
    serve_kvp_free(&e->kvp);
    serve_model_free(e->model);
    e->mem->release(e->pos_dev);
    e->mem->release(e->att_scratch);
    void* bufs[] = {e->running, e->waiting, e->sched, e->sched_last_row, e->row_tok, e->run_slot, e->probs};
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

// A request's blocks: of this rank's cache, or under KVP every KVP rank's share of them (the
// scheduler's, world rank 0's: llmc/serve_kvp.h).
static inline int serve_kv_reserve(ServeEngine* e, ServeRequest* r, int positions) {
    return e->kvp.P > 1 ? serve_kvp_reserve(&e->kvp, &r->table, positions) : block_table_reserve(&e->kv, &r->table, positions);
}
static inline void serve_kv_release(ServeEngine* e, ServeRequest* r) {
    if (e->kvp.P > 1) { serve_kvp_release(&e->kvp, &r->table); } else { block_table_release(&e->kv, &r->table); }
}

static inline void serve_finish(ServeEngine* e, ServeRequest* r, const char* reason) {
    serve_kv_release(e, r);
    r->state = SERVE_FINISHED;
    r->finish_reason = reason;
    r->text_ready = r->text_len;
    if (e->on_event) { e->on_event(e->event_ctx, r, -1); }
}

// Removes a request wherever it is (a client gone); its blocks go back to the free list. One in
// an iteration in flight (--pp) stays until that iteration ends (its blocks are being written):
// the caller asks again.
static inline void serve_engine_cancel(ServeEngine* e, ServeRequest* r) {
    if (r->state == SERVE_FINISHED || r->in_flight) { return; }
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
    serve_kv_release(e, r);
    r->computed = 0;
    r->state = SERVE_WAITING;
    r->preemptions++;
    e->preemptions++;
    memmove(e->waiting + 1, e->waiting, sizeof(*e->waiting) * (size_t)e->num_waiting);
    e->waiting[0] = r;
    e->num_waiting++;
}

// Layer l's attention step (Activations.attend) on the step's N rows, qkv (N,3C) -> atty
// (N,C): the new keys and values into their cache slots (a run of a request's rows at a time),
// then each row against its request's keys (attention_forward_paged; under KVP over the
// group, each rank's share of the keys, the partials combined: llmc/serve_kvp.h).
static void serve_attend(void* ctx, int l, const float* qkv, float* atty, int C, int NH) {
    ServeEngine* e = (ServeEngine*)ctx;
    float* kv = paged_kv_layer(&e->kv, l);
    for (int i = 0; i < e->num_runs; i++) {
        copy_rows(kv + e->run_slot[i], 2 * C, qkv + (size_t)e->run_row[i] * 3 * C + C, 3 * C, e->run_len[i], 2 * C);
    }
    if (e->kvp.P > 1) {
        serve_kvp_attend(&e->kvp, &e->kv, l, qkv, atty, e->pos_dev, e->tables_dev, e->max_blocks, e->num_rows);
        return;
    }
    attention_forward_paged(atty, e->att_scratch, qkv, kv, paged_kv_block_stride(&e->kv), e->tables_dev,
                            e->max_blocks, e->pos_dev, e->num_rows, e->maxT, e->kv.block_size, C, NH);
}

// The forward over the step's N rows (the model's embeddings and layers, its attention
// serve_attend), and the head on the last row of every request that caught up.
static inline void serve_forward(ServeEngine* e, int N) {
    const MemOps* mem = e->mem;
    int C = e->kv.C, bs = e->kv.block_size;   // this rank's channels of keys and values
    mem->from_host(e->pos_dev, e->row_pos, sizeof(int) * (size_t)N);
    mem->from_host(e->tables_dev, e->row_tables, sizeof(int) * (size_t)N * e->max_blocks);
    // where each run of rows writes its keys and values: consecutive rows into consecutive
    // slots of one block (a block belongs to one request); under KVP the rows whose positions
    // this rank holds
    e->num_runs = 0;
    long block_stride = paged_kv_block_stride(&e->kv);
    for (int r = 0, i = -1; r < N; r++) {
        int p = e->row_pos[r];
        const int* table = e->row_tables + (size_t)r * e->max_blocks;
        long slot = e->kvp.P > 1 ? serve_kvp_slot(&e->kvp, table, block_stride, p)
                                 : paged_kv_slot(table, block_stride, p, bs, C);
        if (slot < 0) { continue; }
        if (i >= 0 && r == e->run_row[i] + e->run_len[i] && slot % block_stride != 0 &&
            slot == e->run_slot[i] + (long)e->run_len[i] * 2 * C) {
            e->run_len[i]++;
        } else {
            i = e->num_runs++;
            e->run_row[i] = r;
            e->run_len[i] = 1;
            e->run_slot[i] = slot;
        }
    }
    serve_model_forward(e->model, e->row_tok, e->row_pos, N);
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
        char* hit = (char*)memmem(r->text + from, r->text_len - from, r->stop[i], sl);
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
        memcpy(e->row_tables + (size_t)*rows * e->max_blocks, r->table.blocks, sizeof(int) * (size_t)r->table.n);
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

// A request decodes when its one known token not computed is one it generated; otherwise its
// rows are prompt rows (its prompt, or the tokens a preemption took back).
static inline int serve_decodes(const ServeRequest* r) { return r->len > r->num_prompt && r->len - r->computed == 1; }

// A request's rows this step: its one row when it decodes, else a chunk of its prompt rows
// within both budgets.
static inline int serve_rows_for(const ServeRequest* r, int budget, int prefill) {
    if (serve_decodes(r)) { return budget > 0; }
    int left = r->len - r->computed, n = left < budget ? left : budget;
    return n < prefill ? n : prefill;
}

// The prompt rows a step may take: max_prefill_tokens when some running request decodes in it;
// a step with none takes them up to the whole budget (a lone request's prompt in as few steps
// as before).
static inline int serve_prefill_budget(const ServeEngine* e) {
    if (e->max_prefill_tokens <= 0) { return e->max_batch_tokens; }
    for (int i = 0; i < e->num_running; i++) {
        const ServeRequest* r = e->running[i];
        if (!r->in_flight && serve_decodes(r)) { return e->max_prefill_tokens; }
    }
    return e->max_batch_tokens;
}

static inline int serve_engine_schedule(ServeEngine* e) {
    int budget = e->max_batch_tokens, rows = 0, preempted = 0;
    e->num_sched = 0;
    if (e->batching == SERVE_STATIC && e->num_running == 0) {   // the whole batch at once; its prefill chunked below
        while (e->num_waiting > 0 && e->num_running < e->max_running) { serve_admit(e); }
    }
    int prefill = serve_prefill_budget(e);
    for (int i = 0; i < e->num_running && budget > 0 && !(e->max_sched && e->num_sched >= e->max_sched); i++) {
        ServeRequest* r = e->running[i];
        if (r->in_flight) { continue; }
        int n = serve_rows_for(r, budget, prefill);
        if (n == 0) { continue; }   // a prompt's chunk waits for a step with room
        int room;
        while (!(room = serve_kv_reserve(e, r, r->computed + n))) {
            if (e->num_in_flight > 0) { preempted = 1; break; }   // none admitted: the iterations in flight free blocks as they end
            int itself = i == e->num_running - 1;
            serve_preempt_latest(e);
            preempted = 1;
            if (itself) { break; }
        }
        if (!room) { break; }
        if (!serve_decodes(r)) { prefill -= n; }
        serve_schedule(e, r, n, &rows);
        budget -= n;
    }
    while (e->batching == SERVE_INFLIGHT && !preempted && e->num_waiting > 0 && budget > 0 &&
           e->num_running < e->max_running && !(e->max_sched && e->num_sched >= e->max_sched)) {
        ServeRequest* r = e->waiting[0];
        int n = serve_rows_for(r, budget, prefill);
        if (n == 0 || !serve_kv_reserve(e, r, r->computed + n)) { break; }
        serve_admit(e);
        if (!serve_decodes(r)) { prefill -= n; }
        serve_schedule(e, r, n, &rows);
        budget -= n;
    }
    e->num_rows = rows;
    return rows;
}

// One broadcast of the step from the group's rank 0 (every rank of `g` calls it): the row and
// head-row counts (2 ints; -1 rows: the end), then each row's token and position, its block
// table (max_blocks ints), and the head's rows.
static inline void serve_step_send(ServeEngine* e, CommGroup* g, int* M) {
    if (g->size == 1) { return; }
    int counts[2] = {e->num_rows, *M};
    comm_broadcast(g, counts, sizeof(counts), 0, COMM_KIND_OTHER);
    e->num_rows = counts[0];
    *M = counts[1];
    if (e->num_rows <= 0) { return; }
    size_t N = (size_t)e->num_rows;
    comm_broadcast(g, e->row_tok, sizeof(int) * N, 0, COMM_KIND_OTHER);
    comm_broadcast(g, e->row_pos, sizeof(int) * N, 0, COMM_KIND_OTHER);
    comm_broadcast(g, e->row_tables, sizeof(int) * N * e->max_blocks, 0, COMM_KIND_OTHER);
    if (*M > 0) { comm_broadcast(g, e->head_rows, sizeof(int) * (size_t)*M, 0, COMM_KIND_OTHER); }
}

// The step's rows from world rank 0 to every rank that runs them (its scheduler's choice; the
// others follow): over the world; with --pp only to stage 0's ranks (serve_pipeline.h sends it
// down the stages): over rank 0's group across the stage's tp groups (the stage's tp rank 0s:
// its KVP group under --kvp, else its ep group), then over each tp group.
static inline void serve_step_broadcast(ServeEngine* e, int* M) {
    Comm* c = e->comm;
    if (c->pp == 1) {
        serve_step_send(e, &c->world, M);
        return;
    }
    if (c->tp_rank == 0) { serve_step_send(e, c->cp > 1 ? &c->cp_group : &c->ep_group, M); }
    serve_step_send(e, &c->tp_group, M);
}

// The forward over the step's rows and the head on M of them (every rank).
static inline void serve_forward_and_head(ServeEngine* e, int M) {
    serve_forward(e, e->num_rows);
    if (M > 0) {
        e->mem->from_host(e->head_rows_dev, e->head_rows, sizeof(int) * (size_t)M);
        serve_model_head(e->model, e->num_rows, e->head_rows_dev, M, e->probs);
    }
}

// The rows the head reads: the last row of every request that caught up (all its known tokens
// computed), into head_rows; returns their number.
static inline int serve_head_rows(ServeEngine* e) {
    int M = 0;
    for (int s = 0; s < e->num_sched; s++) {
        ServeRequest* r = e->sched[s];
        e->sched_head[s] = -1;
        if (e->row_pos[e->sched_last_row[s]] + 1 == r->len) {
            e->sched_head[s] = M;
            e->head_rows[M++] = e->sched_last_row[s];
        }
    }
    return M;
}

// 2. The forward over the scheduled rows, and the head on the last row of every request that
// caught up; across ranks, first the step to every rank.
static inline void serve_engine_forward(ServeEngine* e) {
    if (e->num_rows == 0) { return; }
    int M = serve_head_rows(e);
    serve_step_broadcast(e, &M);
    serve_forward_and_head(e, M);
}

// A rank other than world rank 0: each step rank 0 broadcasts, on this rank's slice of the
// model and its heads of the KV cache (the block tables are rank 0's: every rank's cache has
// the same blocks), until the end.
static inline void serve_engine_follow(ServeEngine* e) {
    for (;;) {
        int M = 0;
        e->num_rows = 0;
        serve_step_broadcast(e, &M);
        if (e->num_rows < 0) { return; }
        serve_forward_and_head(e, M);
    }
}

// World rank 0, at the end: the followers return from serve_engine_follow.
static inline void serve_engine_stop_followers(ServeEngine* e) {
    int M = 0;
    e->num_rows = -1;
    serve_step_broadcast(e, &M);
    e->num_rows = 0;
}

// 3. Each request that caught up draws its next token; the finished ones leave.
static inline void serve_engine_finish_step(ServeEngine* e) {
    if (e->num_rows == 0) { return; }
    // each drawing request's fingerprint over its distribution (V floats' bytes, one FNV-1a
    // multiply per byte: 0.2 MB a row for GPT-2) is its own: the rows hashed SERVE_FNV_ROWS at
    // a time (the head's rows are the drawing requests in order), the groups in parallel
    int M = 0;
    for (int s = 0; s < e->num_sched; s++) { M += e->sched_head[s] >= 0; }
    #pragma omp parallel for schedule(dynamic, 1) if (M > SERVE_FNV_ROWS)
    for (int m0 = 0; m0 < M; m0 += SERVE_FNV_ROWS) {
        ServeRequest* group[SERVE_FNV_ROWS];
        int n = 0;
        for (int s = 0; s < e->num_sched; s++) {
            int m = e->sched_head[s];
            if (m >= m0 && m < m0 + SERVE_FNV_ROWS) { group[n++] = e->sched[s]; }
        }
        if (n < SERVE_FNV_ROWS) {   // the last few rows
            for (int j = 0; j < n; j++) {
                group[j]->fingerprint = serve_fnv1a(group[j]->fingerprint, e->probs + (size_t)(m0 + j) * e->Vp,
                                                    (size_t)e->config.vocab_size);
            }
            continue;
        }
        uint64_t h[SERVE_FNV_ROWS];
        const float* rows[SERVE_FNV_ROWS];
        for (int j = 0; j < SERVE_FNV_ROWS; j++) { h[j] = group[j]->fingerprint; rows[j] = e->probs + (size_t)(m0 + j) * e->Vp; }
        serve_fnv1a_rows(h, rows, (size_t)e->config.vocab_size);
        for (int j = 0; j < SERVE_FNV_ROWS; j++) { group[j]->fingerprint = h[j]; }
    }
    for (int s = 0; s < e->num_sched; s++) {
        ServeRequest* r = e->sched[s];
        r->computed = e->row_pos[e->sched_last_row[s]] + 1;
        if (e->sched_head[s] < 0) { continue; }
        const char* reason = serve_draw(e, r, e->probs + (size_t)e->sched_head[s] * e->Vp);
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
