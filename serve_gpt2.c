/*
 * serve_gpt2.c: an OpenAI-compatible HTTP server for a trained checkpoint (CPU build), on the
 * serving engine of llmc/serve_engine.h (in-flight batching, a paged KV cache, every request's
 * tokens the same bits whatever shares its batch).
 *
 *   ./serve_gpt2 -e model.bin [--port 8000] [--host 127.0.0.1] [--kv-blocks N] ...
 *
 * HTTP is GNU libmicrohttpd (a thread per connection), JSON is cJSON; the request parser is
 * llmc/serve_request.h. Routes: POST /v1/completions, POST /v1/chat/completions, GET
 * /v1/models, GET /health, GET /metrics (Prometheus text). Streaming answers are server-sent
 * events ending with `data: [DONE]`. The main thread runs the engine's steps (MPI's FUNNELED
 * level: only it calls MPI); a connection's thread hands it a job and waits for (or streams)
 * its tokens. A client that goes away mid-stream cancels its job (its blocks go back to the
 * free list). SIGTERM or SIGINT: stop accepting, let what runs finish (--shutdown-timeout, then
 * cancel it), exit 0.
 *
 *   mpirun -np K*Q ./serve_gpt2 --tp K --ep Q -e model.bin ...
 *   mpirun -np P*K ./serve_gpt2 --kvp P --tp K [--ep Q] -e model.bin ...   (Helix's KVP: llmc/serve_kvp.h)
 *
 * serves across ranks (llmc/serve_parallel.h): world rank 0 runs HTTP and the scheduler and
 * broadcasts each step; the others follow on their slice of the model. Rank 0 watches the
 * others: one that dies ends the server with one line, every request in flight answered 503.
 *
 *   mpirun -np S*Q*K ./serve_gpt2 --pp S [--tp K] [--ep Q] -e model.bin ...
 *   mpirun -np S*P*K ./serve_gpt2 --pp S --kvp P [--tp K] -e model.bin ...
 *
 * cuts the layers into S pipeline stages (llmc/serve_pipeline.h): rank 0 schedules and runs
 * stage 0, each iteration's rows go stage to stage, the probabilities come back to rank 0, up
 * to S iterations in flight.
 */
#define TESTING   // train_gpt2.c's model without its main: on the CPU kernel set, or serve_gpt2.cu's device set
#include "train_gpt2.c"
#ifndef SERVE_MEMORY   // where the model's tensors live (serve_gpt2.cu: the GPU's, once it chose one)
#define SERVE_MEMORY (&memory_host)
#define SERVE_SELECT_DEVICE(comm) ((void)0)
#endif
#include "llmc/bpe_encoder.h"
#include "llmc/gpt2_init.h"
#include "llmc/serve_engine.h"
#include "llmc/serve_parallel.h"
#include "llmc/serve_pipeline.h"
#include "serve_model.c"   // the engine's model side: train_gpt2.c's model on a step's rows
#include "llmc/serve_request.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>

// ---- latency histograms (Prometheus) -----------------------------------------------------
static const double hist_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
#define HIST_N ((int)(sizeof(hist_bounds) / sizeof(hist_bounds[0])))
typedef struct { long long count[HIST_N + 1]; double sum; long long total; } Histogram;
static void hist_observe(Histogram* h, double x) {
    int i = 0;
    while (i < HIST_N && x > hist_bounds[i]) { i++; }
    h->count[i]++;
    h->sum += x;
    h->total++;
}

// ---- a job: one request on its way through the engine ------------------------------------
typedef struct Job {
    ServeRequest req;
    ServeParams params;
    int chat;
    int refs;               // the connection's and the engine's
    int cancel, done;
    struct Job* next;       // inbox, then the engine's list of jobs
    double t_arrival, t_last;
    int first_seen;
    char id[48];
    long created;
    // streaming
    size_t sent_text;       // bytes of the text already sent
    int sent_final;
    char* out;              // bytes formatted, not yet handed to MHD
    size_t out_len, out_off, out_cap;
} Job;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, progress;
    ServeEngine engine;
    ServePipeline pipe;     // --pp > 1: the iterations in flight (llmc/serve_pipeline.h)
    Job* inbox;
    Job* jobs;              // submitted and not finished
    int connections, max_connections, shutting_down, stop_engine;
    int step_delay_us;      // --step-delay-ms: a slower engine, for the tests of disconnects and SIGTERM
    size_t max_body;
    BPEEncoder bpe;
    ServeLimits limits;
    const char* model_name;
    long long next_id, prompt_tokens, generation_tokens, requests_ok, requests_cancelled, requests_rejected;
    Histogram ttft, itl;
    uint64_t comm_bytes[COMM_KIND_COUNT];   // what world rank 0 sent, by kind, after the last step
    long long* expert_slots;   // (layers, E) an expert model's slots rank 0's rows routed to each expert of
                               // its layers (its share of each step's rows under --ep), after the last step
    const char* dead;       // a rank died (rank_watch_thread): every request in flight gets this error
    int ranks_ending;       // rank 0 is ending the followers: their exits are no deaths
} S;

// S.expert_slots from the model's routing counters (train_gpt2.c MoeCounters); under S.mu
static void snapshot_expert_slots(void) {
    const MoeCounters* ct = &S.engine.model->model.counters;
    for (size_t i = 0; S.expert_slots && i < (size_t)ct->layers * ct->experts; i++) {
        S.expert_slots[i] = (long long)ct->tokens[i];
    }
}

static void job_unref(Job* j) {   // under S.mu
    if (--j->refs > 0) { return; }
    serve_request_free(&j->req);
    serve_params_free(&j->params);
    free(j->out);
    free(j);
}

static void list_remove(Job** head, Job* j) {
    for (Job** p = head; *p; p = &(*p)->next) {
        if (*p == j) { *p = j->next; return; }
    }
}

// engine events (the engine thread, S.mu held)
static void on_event(void* ctx, ServeRequest* r, int token) {
    Job* j = (Job*)r->user;
    double now = now_seconds();
    if (token >= 0) {
        if (!j->first_seen) { hist_observe(&S.ttft, now - j->t_arrival); }
        else { hist_observe(&S.itl, now - j->t_last); }
        j->first_seen = 1;
        j->t_last = now;
        S.generation_tokens++;
        return;
    }
    j->done = 1;
    if (strcmp(r->finish_reason, "cancelled") == 0) { S.requests_cancelled++; } else { S.requests_ok++; }
    list_remove(&S.jobs, j);
    job_unref(j);
}

// the engine loop (on the main thread), until SIGTERM's stopper says the work is done
static void* engine_thread(void* arg) {
    (void)arg;
    pthread_mutex_lock(&S.mu);
    for (;;) {
        int cancels = 0;
        for (Job* j = S.jobs; j; j = j->next) { cancels += j->cancel; }
        if (!S.inbox && !cancels && serve_engine_idle(&S.engine)) {
            if (S.stop_engine) { break; }
            pthread_cond_wait(&S.work, &S.mu);
            continue;
        }
        while (S.inbox) {   // in arrival order
            Job** last = &S.inbox;
            while ((*last)->next) { last = &(*last)->next; }
            Job* j = *last;
            *last = NULL;
            serve_engine_submit(&S.engine, &j->req);   // connections <= max_requests: room
            j->next = S.jobs;
            S.jobs = j;
        }
        for (Job* j = S.jobs, *next; j; j = next) {
            next = j->next;
            if (j->cancel) { serve_engine_cancel(&S.engine, &j->req); }
        }
        if (S.engine.comm->pp > 1) {   // up to S iterations in flight (llmc/serve_pipeline.h)
            int rows = serve_pp_schedule(&S.pipe, &S.engine);
            pthread_mutex_unlock(&S.mu);
            serve_pp_launch(&S.pipe, &S.engine);
            int wait = serve_pp_should_wait(&S.pipe, rows);
            if (wait) { serve_pp_wait_oldest(&S.pipe); }
            pthread_mutex_lock(&S.mu);
            if (wait) { serve_pp_finish_oldest(&S.pipe, &S.engine); }
        } else {
            serve_engine_schedule(&S.engine);
            pthread_mutex_unlock(&S.mu);   // the forward changes no request: connections read theirs meanwhile
            serve_engine_forward(&S.engine);
            pthread_mutex_lock(&S.mu);
            serve_engine_finish_step(&S.engine);
        }
        memcpy(S.comm_bytes, S.engine.comm->stats.bytes, sizeof(S.comm_bytes));
        snapshot_expert_slots();
        pthread_cond_broadcast(&S.progress);
        if (S.step_delay_us) {
            pthread_mutex_unlock(&S.mu);
            usleep((useconds_t)S.step_delay_us);
            pthread_mutex_lock(&S.mu);
        }
    }
    pthread_mutex_unlock(&S.mu);
    return NULL;
}

// ---- JSON answers -------------------------------------------------------------------------
static enum MHD_Result send_text(struct MHD_Connection* c, int status, const char* type, const char* body) {
    struct MHD_Response* r = MHD_create_response_from_buffer(strlen(body), (void*)body, MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(r, "Content-Type", type);
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result send_json(struct MHD_Connection* c, int status, cJSON* root) {
    char* body = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    enum MHD_Result ok = send_text(c, status, "application/json", body);
    free(body);
    return ok;
}

static enum MHD_Result send_error(struct MHD_Connection* c, const ServeError* e) {
    pthread_mutex_lock(&S.mu);
    S.requests_rejected++;
    pthread_mutex_unlock(&S.mu);
    cJSON* root = cJSON_CreateObject();
    cJSON* err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", e->message);
    cJSON_AddStringToObject(err, "type", e->type);
    if (e->param[0]) { cJSON_AddStringToObject(err, "param", e->param); } else { cJSON_AddNullToObject(err, "param"); }
    cJSON_AddNullToObject(err, "code");
    return send_json(c, e->status, root);
}

static enum MHD_Result fail(struct MHD_Connection* c, int status, const char* type, const char* message) {
    ServeError e = {status, type, "", ""};
    snprintf(e.message, sizeof(e.message), "%s", message);
    return send_error(c, &e);
}

// Bytes [0, n) of s as valid UTF-8 (an invalid byte becomes U+FFFD), malloc'd.
static char* utf8_clean(const char* s, size_t n) {
    char* out = (char*)malloc(3 * n + 1);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int len = utf8_decode((const uint8_t*)s, n, i, &cp);
        if (len > 0) {
            memcpy(out + o, s + i, (size_t)len);
            o += (size_t)len;
            i += (size_t)len;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    out[o] = '\0';
    return out;
}

// The longest prefix of s[0, n) that does not end inside a UTF-8 sequence more bytes could finish.
static size_t utf8_whole(const char* s, size_t n) {
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char b = (unsigned char)s[n - back];
        if ((b & 0xC0) != 0x80) {   // a lead byte (or ASCII): does its sequence fit?
            int need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
            return need > (int)back ? n - back : n;
        }
    }
    return n;
}

static void add_usage(cJSON* root, const Job* j) {
    cJSON* u = cJSON_AddObjectToObject(root, "usage");
    int out = serve_generated(&j->req);
    cJSON_AddNumberToObject(u, "prompt_tokens", j->req.num_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", out);
    cJSON_AddNumberToObject(u, "total_tokens", j->req.num_prompt + out);
}

// The frame of a completion or chunk: id, object, created, model, choices [one]; returns the choice.
static cJSON* completion_frame(const Job* j, cJSON** root, int chunk) {
    *root = cJSON_CreateObject();
    cJSON_AddStringToObject(*root, "id", j->id);
    cJSON_AddStringToObject(*root, "object", j->chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion");
    cJSON_AddNumberToObject(*root, "created", (double)j->created);
    cJSON_AddStringToObject(*root, "model", S.model_name);
    cJSON* choice = cJSON_CreateObject();
    cJSON_AddItemToArray(cJSON_AddArrayToObject(*root, "choices"), choice);
    cJSON_AddNumberToObject(choice, "index", 0);
    return choice;
}

static void add_text(cJSON* choice, const Job* j, const char* text, int chunk) {
    if (!j->chat) {
        cJSON_AddStringToObject(choice, "text", text);
        cJSON_AddNullToObject(choice, "logprobs");
        return;
    }
    cJSON* m = cJSON_AddObjectToObject(choice, chunk ? "delta" : "message");
    if (!chunk || j->sent_text == 0) { cJSON_AddStringToObject(m, "role", "assistant"); }
    cJSON_AddStringToObject(m, "content", text);
}

static const char* finish_reason(const Job* j) {
    return strcmp(j->req.finish_reason, "cancelled") == 0 ? "abort" : j->req.finish_reason;
}

// the whole answer of a finished job
static enum MHD_Result send_completion(struct MHD_Connection* c, const Job* j) {
    cJSON* root;
    cJSON* choice = completion_frame(j, &root, 0);
    char* text = utf8_clean(j->req.text ? j->req.text : "", j->req.text_len);
    add_text(choice, j, text, 0);
    free(text);
    cJSON_AddStringToObject(choice, "finish_reason", finish_reason(j));
    // beyond OpenAI's fields: the generated token ids (the tests compare them with the sampler's),
    // and the FNV-1a of the bytes of every distribution they were drawn from (serve_gpt2cu's test
    // compares those bits: a token can survive an ulp of difference, the hash cannot)
    cJSON_AddItemToObject(choice, "token_ids", cJSON_CreateIntArray(j->req.tokens + j->req.num_prompt, serve_generated(&j->req)));
    char fingerprint[17];
    snprintf(fingerprint, sizeof(fingerprint), "%016llx", (unsigned long long)j->req.fingerprint);
    cJSON_AddStringToObject(choice, "probs_fnv1a", fingerprint);
    add_usage(root, j);
    return send_json(c, 200, root);
}

static void out_append(Job* j, const char* s, size_t n) {
    if (j->out_len + n > j->out_cap) {
        j->out_cap = 2 * (j->out_len + n);
        j->out = (char*)realloc(j->out, j->out_cap);
    }
    memcpy(j->out + j->out_len, s, n);
    j->out_len += n;
}

static void out_event(Job* j, cJSON* root) {
    char* body = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    out_append(j, "data: ", 6);
    out_append(j, body, strlen(body));
    out_append(j, "\n\n", 2);
    free(body);
}

// Formats what the job has that the stream has not sent (S.mu held); 0 when nothing.
static int stream_more(Job* j) {
    size_t ready = j->done ? j->req.text_len : utf8_whole(j->req.text ? j->req.text : "", j->req.text_ready);
    if (ready > j->sent_text) {
        cJSON* root;
        cJSON* choice = completion_frame(j, &root, 1);
        char* text = utf8_clean(j->req.text + j->sent_text, ready - j->sent_text);
        add_text(choice, j, text, 1);
        free(text);
        cJSON_AddNullToObject(choice, "finish_reason");
        out_event(j, root);
        j->sent_text = ready;
        return 1;
    }
    if (!j->done) { return 0; }
    cJSON* root;
    cJSON* choice = completion_frame(j, &root, 1);
    add_text(choice, j, "", 1);
    cJSON_AddStringToObject(choice, "finish_reason", finish_reason(j));
    out_event(j, root);
    if (j->params.include_usage) {
        cJSON* usage = cJSON_CreateObject();
        cJSON_AddStringToObject(usage, "id", j->id);
        cJSON_AddStringToObject(usage, "object", j->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddNumberToObject(usage, "created", (double)j->created);
        cJSON_AddStringToObject(usage, "model", S.model_name);
        cJSON_AddArrayToObject(usage, "choices");
        add_usage(usage, j);
        out_event(j, usage);
    }
    out_append(j, "data: [DONE]\n\n", 14);
    j->sent_final = 1;
    return 1;
}

static ssize_t stream_reader(void* cls, uint64_t pos, char* buf, size_t max) {
    Job* j = (Job*)cls;
    (void)pos;
    pthread_mutex_lock(&S.mu);
    while (j->out_off == j->out_len) {
        j->out_off = j->out_len = 0;
        if (j->sent_final) {
            pthread_mutex_unlock(&S.mu);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        if (stream_more(j)) { break; }
        if (S.dead && !j->done) {   // no more tokens will come: an error event, then the end
            char ev[320];
            int n = snprintf(ev, sizeof(ev), "data: {\"error\":{\"message\":\"%s\",\"type\":\"server_error\",\"param\":null,\"code\":503}}\n\ndata: [DONE]\n\n", S.dead);
            out_append(j, ev, (size_t)n);
            j->sent_final = 1;
            break;
        }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        if (pthread_cond_timedwait(&S.progress, &S.mu, &until) == ETIMEDOUT) {
            out_append(j, ": waiting\n\n", 11);   // an SSE comment: finds out whether the client is still there
        }
    }
    size_t n = j->out_len - j->out_off < max ? j->out_len - j->out_off : max;
    memcpy(buf, j->out + j->out_off, n);
    j->out_off += n;
    pthread_mutex_unlock(&S.mu);
    return (ssize_t)n;
}

// the stream is over: sent, or the client went away (then the job is cancelled)
static void stream_done(void* cls) {
    Job* j = (Job*)cls;
    pthread_mutex_lock(&S.mu);
    if (!j->done) {
        j->cancel = 1;
        pthread_cond_signal(&S.work);
    }
    job_unref(j);
    pthread_mutex_unlock(&S.mu);
}

// ---- routes ----------------------------------------------------------------------------
typedef struct {
    char* body;
    size_t len;
    int too_large, counted, over_limit;
} ConnCtx;

// the encoder's scratch and word cache are shared: one connection encodes at a time (decoding,
// bpe_token, reads only the vocabulary)
static pthread_mutex_t encode_mu = PTHREAD_MUTEX_INITIALIZER;
static int encode_text(void* ctx, const char* text, size_t n, int** ids) {
    TokenIds t = {0};
    pthread_mutex_lock(&encode_mu);
    bpe_encode((BPEEncoder*)ctx, (const uint8_t*)text, n, 1, &t);
    pthread_mutex_unlock(&encode_mu);
    *ids = (int*)malloc(sizeof(int) * (t.n > 0 ? t.n : 1));
    for (size_t i = 0; i < t.n; i++) { (*ids)[i] = (int)t.ids[i]; }
    int count = (int)t.n;
    token_ids_free(&t);
    return count;
}

static const uint8_t* token_text(void* ctx, int token, size_t* len) { return bpe_token((const BPEEncoder*)ctx, (uint32_t)token, len); }

static enum MHD_Result handle_completion(struct MHD_Connection* c, const ConnCtx* cc, int chat) {
    ServeParams params;
    ServeError err;
    if (!serve_parse_request(cc->body ? cc->body : "", cc->len, chat, &S.limits, &params, &err)) { return send_error(c, &err); }
    Job* j = (Job*)calloc(1, sizeof(Job));
    j->params = params;
    j->chat = chat;
    j->created = (long)time(NULL);
    serve_request_init(&j->req, params.prompt, params.num_prompt, params.max_tokens, params.temperature, params.top_k,
                       params.top_p, params.seed, S.engine.config.vocab_size);
    j->req.ignore_eos = params.ignore_eos;
    j->req.stop = params.stop;   // the request owns them now
    j->req.num_stop = params.num_stop;
    j->params.stop = NULL;
    j->params.num_stop = 0;
    j->req.user = j;
    j->refs = 2;
    pthread_mutex_lock(&S.mu);
    snprintf(j->id, sizeof(j->id), "%s-%lld", chat ? "chatcmpl" : "cmpl", S.next_id++);
    j->t_arrival = now_seconds();
    S.prompt_tokens += params.num_prompt;
    j->next = S.inbox;
    S.inbox = j;
    pthread_cond_signal(&S.work);
    if (params.stream) {
        pthread_mutex_unlock(&S.mu);
        struct MHD_Response* r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, j, stream_done);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        enum MHD_Result ok = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ok;
    }
    while (!j->done && !S.dead) { pthread_cond_wait(&S.progress, &S.mu); }
    const char* dead = j->done ? NULL : S.dead;
    pthread_mutex_unlock(&S.mu);
    enum MHD_Result ok = dead ? fail(c, 503, "server_error", dead) : send_completion(c, j);
    pthread_mutex_lock(&S.mu);
    job_unref(j);
    pthread_mutex_unlock(&S.mu);
    return ok;
}

static enum MHD_Result handle_models(struct MHD_Connection* c) {
    cJSON* root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON* m = cJSON_CreateObject();
    cJSON_AddItemToArray(cJSON_AddArrayToObject(root, "data"), m);
    cJSON_AddStringToObject(m, "id", S.model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "llmc");
    cJSON_AddNumberToObject(m, "max_model_len", S.engine.maxT);
    return send_json(c, 200, root);
}

static void metric_hist(FILE* out, const char* name, const char* help, const Histogram* h) {
    fprintf(out, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    long long cum = 0;
    for (int i = 0; i < HIST_N; i++) {
        cum += h->count[i];
        fprintf(out, "%s_bucket{le=\"%g\"} %lld\n", name, hist_bounds[i], cum);
    }
    fprintf(out, "%s_bucket{le=\"+Inf\"} %lld\n%s_sum %.6f\n%s_count %lld\n", name, h->total, name, h->sum, name, h->total);
}

// This rank's KV cache: its blocks of its heads (serve_engine.h; every rank's the same size)
static size_t serve_kv_cache_bytes(const ServeEngine* e) {
    return (size_t)e->kv.num_blocks * (size_t)paged_kv_block_stride(&e->kv) * sizeof(float);
}

static enum MHD_Result handle_metrics(struct MHD_Connection* c) {
    char* text = NULL;
    size_t len = 0;
    FILE* out = open_memstream(&text, &len);   // grows to what is written: a line per expert of every layer
    if (!out) { fatal("out of memory: the /metrics text"); }
    pthread_mutex_lock(&S.mu);
    const ServeEngine* e = &S.engine;
    int waiting = e->num_waiting;
    for (Job* j = S.inbox; j; j = j->next) { waiting++; }
    fprintf(out, "# HELP serve_requests_running Requests in the running batch.\n# TYPE serve_requests_running gauge\n"
                 "serve_requests_running %d\n", e->num_running);
    fprintf(out, "# HELP serve_requests_waiting Requests waiting for KV blocks.\n# TYPE serve_requests_waiting gauge\n"
                 "serve_requests_waiting %d\n", waiting);
    // under KVP the blocks of all of a KVP group's ranks (each rank's 1/P of them: llmc/serve_kvp.h)
    int kv_blocks = e->kvp.P * e->kv.num_blocks;
    int kv_used = e->kvp.P > 1 ? serve_kvp_blocks_used(&e->kvp) : e->kv.num_blocks - e->kv.num_free;
    fprintf(out, "# HELP serve_kv_blocks_used KV cache blocks held by requests.\n# TYPE serve_kv_blocks_used gauge\n"
                 "serve_kv_blocks_used %d\n", kv_used);
    fprintf(out, "# HELP serve_kv_blocks_free KV cache blocks on the free list.\n# TYPE serve_kv_blocks_free gauge\n"
                 "serve_kv_blocks_free %d\n", kv_blocks - kv_used);
    fprintf(out, "# HELP serve_kv_cache_bytes_per_rank Bytes of the KV cache on each rank.\n"
                 "# TYPE serve_kv_cache_bytes_per_rank gauge\nserve_kv_cache_bytes_per_rank %zu\n", serve_kv_cache_bytes(e));
    fprintf(out, "# HELP serve_prompt_tokens_total Prompt tokens received.\n# TYPE serve_prompt_tokens_total counter\n"
                 "serve_prompt_tokens_total %lld\n", S.prompt_tokens);
    fprintf(out, "# HELP serve_generation_tokens_total Tokens generated.\n# TYPE serve_generation_tokens_total counter\n"
                 "serve_generation_tokens_total %lld\n", S.generation_tokens);
    fprintf(out, "# HELP serve_requests_total Requests by outcome.\n# TYPE serve_requests_total counter\n"
                 "serve_requests_total{outcome=\"finished\"} %lld\nserve_requests_total{outcome=\"cancelled\"} %lld\n"
                 "serve_requests_total{outcome=\"rejected\"} %lld\n", S.requests_ok, S.requests_cancelled, S.requests_rejected);
    fprintf(out, "# HELP serve_preemptions_total Requests preempted (recomputed later).\n# TYPE serve_preemptions_total counter\n"
                 "serve_preemptions_total %lld\n", e->preemptions);
    // the collectives of serving across ranks (llmc/serve_parallel.h states their formulas): what
    // world rank 0 sent, by kind, in total and per generated token
    fprintf(out, "# HELP serve_collective_bytes_total Bytes rank 0 sent in collectives, by kind.\n"
                 "# TYPE serve_collective_bytes_total counter\n");
    for (int k = 0; k < COMM_KIND_COUNT; k++) {
        fprintf(out, "serve_collective_bytes_total{kind=\"%s\"} %llu\n", comm_kind_name[k], (unsigned long long)S.comm_bytes[k]);
    }
    fprintf(out, "# HELP serve_collective_bytes_per_token Collective bytes rank 0 sent per generated token, by kind.\n"
                 "# TYPE serve_collective_bytes_per_token gauge\n");
    for (int k = 0; k < COMM_KIND_COUNT; k++) {
        double per = e->tokens_generated ? (double)S.comm_bytes[k] / (double)e->tokens_generated : 0.0;
        fprintf(out, "serve_collective_bytes_per_token{kind=\"%s\"} %.1f\n", comm_kind_name[k], per);
    }
    fprintf(out, "# HELP serve_ranks The layout: tensor-, expert-, KV- and pipeline-parallel ranks.\n# TYPE serve_ranks gauge\n"
                 "serve_ranks{dim=\"tp\"} %d\nserve_ranks{dim=\"ep\"} %d\nserve_ranks{dim=\"kvp\"} %d\n"
                 "serve_ranks{dim=\"pp\"} %d\n", e->comm->tp, e->comm->ep, e->comm->cp, e->comm->pp);
    // an expert model's routing (what the tests recompute the ep traffic from)
    if (S.expert_slots) {
        const MoeCounters* ct = &e->model->model.counters;
        fprintf(out, "# HELP serve_expert_slots_total Slots (top-k choices) that the rows rank 0 ran routed to each "
                     "expert, by layer: with --ep only rank 0's share of each step's rows, with --pp only stage 0's "
                     "layers.\n"
                     "# TYPE serve_expert_slots_total counter\n");
        for (int l = 0; l < ct->layers; l++) {
            for (int x = 0; x < ct->experts; x++) {
                fprintf(out, "serve_expert_slots_total{layer=\"%d\",expert=\"%d\"} %lld\n", ct->first_layer + l,
                        x, S.expert_slots[(size_t)l * ct->experts + x]);
            }
        }
    }
    // --pp (llmc/serve_pipeline.h): the probabilities back from the last stage, and the overlap
    fprintf(out, "# HELP serve_pipeline_returned_bytes_total Bytes rank 0 received from the last pipeline stage.\n"
                 "# TYPE serve_pipeline_returned_bytes_total counter\nserve_pipeline_returned_bytes_total %llu\n",
            __atomic_load_n(&S.pipe.returned_bytes, __ATOMIC_RELAXED));
    fprintf(out, "# HELP serve_pipeline_in_flight_max Most iterations in the pipeline at once.\n"
                 "# TYPE serve_pipeline_in_flight_max gauge\nserve_pipeline_in_flight_max %d\n",
            __atomic_load_n(&S.pipe.max_in_flight, __ATOMIC_RELAXED));
    metric_hist(out, "serve_time_to_first_token_seconds", "Arrival to the first generated token.", &S.ttft);
    metric_hist(out, "serve_inter_token_latency_seconds", "Between consecutive tokens of a request.", &S.itl);
    pthread_mutex_unlock(&S.mu);
    if (fclose(out) != 0) { fatal("out of memory: the /metrics text (%zu bytes)", len); }
    enum MHD_Result ok = send_text(c, 200, "text/plain; version=0.0.4", text);
    free(text);
    return ok;
}

static enum MHD_Result access_handler(void* cls, struct MHD_Connection* c, const char* url, const char* method,
                                      const char* version, const char* upload, size_t* upload_size, void** con_cls) {
    (void)cls;
    (void)version;
    ConnCtx* cc = (ConnCtx*)*con_cls;
    if (cc == NULL) {
        cc = (ConnCtx*)calloc(1, sizeof(ConnCtx));
        *con_cls = cc;
        pthread_mutex_lock(&S.mu);
        cc->counted = 1;
        cc->over_limit = ++S.connections > S.max_connections;
        pthread_mutex_unlock(&S.mu);
        return MHD_YES;
    }
    if (*upload_size > 0) {   // the body, kept up to the limit
        if (cc->len + *upload_size > S.max_body) {
            cc->too_large = 1;
        } else {
            cc->body = (char*)realloc(cc->body, cc->len + *upload_size + 1);
            memcpy(cc->body + cc->len, upload, *upload_size);
            cc->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    int post = strcmp(method, "POST") == 0, get = strcmp(method, "GET") == 0;
    int completions = strcmp(url, "/v1/completions") == 0, chat = strcmp(url, "/v1/chat/completions") == 0;
    if (completions || chat) {
        if (!post) { return fail(c, 405, "invalid_request_error", "use POST"); }
        if (cc->over_limit) {
            char msg[96];
            snprintf(msg, sizeof(msg), "too many connections: this server takes %d at a time", S.max_connections);
            return fail(c, 429, "rate_limit_error", msg);
        }
        if (S.shutting_down) { return fail(c, 503, "server_error", "the server is shutting down"); }
        if (cc->too_large) {
            char msg[96];
            snprintf(msg, sizeof(msg), "the body is over %zu bytes", S.max_body);
            return fail(c, 413, "invalid_request_error", msg);
        }
        return handle_completion(c, cc, chat);
    }
    if (strcmp(url, "/v1/models") == 0 || strcmp(url, "/health") == 0 || strcmp(url, "/metrics") == 0) {
        if (!get) { return fail(c, 405, "invalid_request_error", "use GET"); }
        if (url[1] == 'v') { return handle_models(c); }
        if (url[1] == 'h') { return send_text(c, 200, "application/json", "{\"status\":\"ok\"}"); }
        return handle_metrics(c);
    }
    char msg[160];
    snprintf(msg, sizeof(msg), "no route %.100s", url);
    return fail(c, 404, "not_found_error", msg);
}

static void request_completed(void* cls, struct MHD_Connection* c, void** con_cls, enum MHD_RequestTerminationCode toe) {
    (void)cls;
    (void)c;
    (void)toe;
    ConnCtx* cc = (ConnCtx*)*con_cls;
    if (!cc) { return; }
    pthread_mutex_lock(&S.mu);
    if (cc->counted) { S.connections--; }
    pthread_mutex_unlock(&S.mu);
    free(cc->body);
    free(cc);
    *con_cls = NULL;
}

// ---- main -----------------------------------------------------------------------------
static long flag_int(const char* flag, const char* v, long lo, long hi) {
    char* end;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < lo || x > hi) { fatal("%s: expected an integer in [%ld, %ld], got '%s'", flag, lo, hi, v); }
    return x;
}

// BYTES with an optional binary suffix K, M or G (512M = 512 x 2^20), as --kv-memory takes it
static size_t flag_bytes(const char* flag, const char* v) {
    char* end;
    unsigned long long x = strtoull(v, &end, 10);
    int shift = *end == 'K' ? 10 : *end == 'M' ? 20 : *end == 'G' ? 30 : 0;
    if (shift) { end++; }
    if (*v < '0' || *v > '9' || *end != '\0' || x == 0 || x > (1ull << 50) >> shift) {
        fatal("%s: expected a size in bytes such as 512M or 2G (suffix K, M or G: binary), got '%s'", flag, v);
    }
    return (size_t)(x << shift);
}

// SIGTERM and SIGINT, whichever thread they reach, wake main through a pipe
static int stop_pipe[2];
static void on_stop_signal(int sig) {
    unsigned char b = (unsigned char)sig;
    ssize_t w = write(stop_pipe[1], &b, 1);
    (void)w;
}

static void usage(void) {
    printf("usage: serve_gpt2 -e MODEL.bin [options]\n"
           "  -e FILE                 llm.c checkpoint (any the trainer reads, experts included)\n"
           "  --port N                TCP port (default 8000; 0 = any free one, printed)\n"
           "  --host ADDR             IPv4 address to listen on (default 127.0.0.1, loopback)\n"
           "  --served-model-name S   the model's name in /v1/models and requests (default gpt2)\n"
           "  --encoder FILE          GPT-2's encoder.json (default dev/data/gpt2/encoder.json)\n"
           "  --bpe FILE              GPT-2's vocab.bpe (default dev/data/gpt2/vocab.bpe)\n"
           "  --block-size N          positions per KV block (default 16)\n"
           "  --kv-blocks N           KV blocks (default: room for 8 requests of maxT)\n"
           "  --kv-memory BYTES       or the KV cache's memory a rank (512M, 2G): floor(BYTES / (2 x L x block size x C x 4))\n"
           "                          blocks, L and C the rank's layers and channels (x P under --kvp P)\n"
           "  --max-batch-tokens N    rows per step: decoding rows plus prefill chunks (default 256)\n"
           "  --max-prefill-tokens N  prompt rows (prefill chunks, a preempted request's recompute) in a step that\n"
           "                          also decodes, at most; a step without decoding rows takes up to\n"
           "                          --max-batch-tokens of them (default 32)\n"
           "  --batching MODE         inflight: a waiting request joins at any step with room (default);\n"
           "                          static: a batch admitted together, none joins until all of it finished\n"
           "  --max-running N         requests in the batch at most (1: one at a time; default --max-connections)\n"
           "  --max-connections N     requests at a time; more get 429 (default 64)\n"
           "  --max-body-bytes N      request bodies over this get 413 (default 1048576)\n"
           "  --shutdown-timeout S    on SIGTERM, seconds to finish what runs before cancelling it (default 30)\n"
           "  --step-delay-ms N       sleep after every engine step (tests: slow streams; default 0)\n"
           "  --tp K, --ep Q          across mpirun -np K*Q ranks: tensor-parallel over K, the experts over Q, each\n"
           "                          ep rank routing its share of a step's rows (llmc/serve_parallel.h); world\n"
           "                          rank 0 serves HTTP (default 1, 1)\n"
           "  --kvp P                 across mpirun -np P*K ranks with --tp K: each request's KV cache cut along\n"
           "                          its positions over P ranks (1, 2, 4, 8; 2 x P x --block-size must divide\n"
           "                          maxT; --kv-blocks counts all P ranks' blocks), the output projection and\n"
           "                          the MLP over all P*K ranks (P*K must divide 8; with --ep Q the experts\n"
           "                          over Q of those ranks, Q dividing P*K; llmc/serve_kvp.h; default 1)\n"
           "  --pp S                  across mpirun -np S*Q*K ranks (with --tp K, --ep Q; with --kvp P S*P*K): the layers\n"
           "                          cut into S pipeline stages (S must divide them), up to S iterations in flight\n"
           "                          (llmc/serve_pipeline.h)\n"
           "  --weights fp32|bf16     bf16: the weights rounded to bf16, the decode copies held in bf16 (half the\n"
           "                          bytes a step reads; fp32 arithmetic; the sampler's bits on the rounded\n"
           "                          checkpoint, not on this one; default fp32)\n");
}

// ---- a rank that dies -------------------------------------------------------------------
// World rank 0 watches the other ranks' processes (same machine: /proc/PID/stat; a zombie or a
// missing entry is a dead rank). The engine may then wait forever in a collective, so the
// watcher answers every request in flight with a 503 JSON error, prints one line naming the
// rank and ends the process (mpirun then ends the rest). Ranks on other machines are not
// watched this way: there the MPI runtime's own abort ends the job.
static int* rank_pids;   // (world_size) every rank's pid, rank 0's included
static int rank_pid_alive(int pid) {
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE* f = fopen(path, "r");
    if (!f) { return 0; }
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char* close_paren = strrchr(buf, ')');   // "pid (comm) STATE ..."
    return !(close_paren && (close_paren[2] == 'Z' || close_paren[2] == 'X'));
}

static void* rank_watch_thread(void* arg) {
    int world_size = *(int*)arg;
    static char message[128];
    for (;;) {
        pthread_mutex_lock(&S.mu);
        int ending = S.ranks_ending;
        pthread_mutex_unlock(&S.mu);
        if (ending) { return NULL; }
        for (int r = 1; r < world_size; r++) {
            if (rank_pid_alive(rank_pids[r])) { continue; }
            snprintf(message, sizeof(message), "rank %d (pid %d) died: the server ends", r, rank_pids[r]);
            pthread_mutex_lock(&S.mu);
            S.dead = message;
            S.shutting_down = 1;
            pthread_cond_broadcast(&S.progress);
            pthread_mutex_unlock(&S.mu);
            for (int i = 0; i < 100; i++) {   // the answers go out (a second at most)
                pthread_mutex_lock(&S.mu);
                int open = S.connections;
                pthread_mutex_unlock(&S.mu);
                if (open == 0) { break; }
                usleep(10000);
            }
            fprintf(stderr, "serve_gpt2: %s\n", message);
            fflush(stderr);
            _exit(1);
        }
        usleep(20000);
    }
    return NULL;
}

// SIGTERM or SIGINT: stop accepting, let what runs finish (--shutdown-timeout, then cancel it),
// then end the engine loop (main's)
static long shutdown_seconds;
static void* stopper_thread(void* arg) {
    struct MHD_Daemon* d = (struct MHD_Daemon*)arg;
    long shutdown_s = shutdown_seconds;
    unsigned char sig = 0;
    while (read(stop_pipe[0], &sig, 1) != 1 && errno == EINTR) {}
    printf("serve_gpt2: signal %d: no new requests; finishing the %d running\n", sig, S.connections);
    fflush(stdout);
    pthread_mutex_lock(&S.mu);
    S.shutting_down = 1;
    pthread_mutex_unlock(&S.mu);
    MHD_socket listen = MHD_quiesce_daemon(d);
    if (listen != MHD_INVALID_SOCKET) { close(listen); }
    double deadline = now_seconds() + (double)shutdown_s;
    pthread_mutex_lock(&S.mu);
    while (S.connections > 0) {
        if (now_seconds() > deadline) {   // cancel what is left; its answers end with finish_reason "abort"
            for (Job* j = S.jobs; j; j = j->next) { j->cancel = 1; }
            pthread_cond_signal(&S.work);
        }
        pthread_mutex_unlock(&S.mu);
        usleep(20000);
        pthread_mutex_lock(&S.mu);
    }
    S.stop_engine = 1;
    pthread_cond_signal(&S.work);
    pthread_mutex_unlock(&S.mu);
    return NULL;
}

int main(int argc, char** argv) {
    static Comm comm;   // the ranks of the layout (llmc/serve_parallel.h); one without mpirun
    comm_init(&comm, &argc, &argv);
    ServeLayout layout = {1, 1, 1, 1};
    const char *model = NULL, *host = "127.0.0.1", *encoder = "dev/data/gpt2/encoder.json", *merges = "dev/data/gpt2/vocab.bpe";
    size_t kv_memory = 0;
    long port = 8000, block_size = 16, kv_blocks = 0, max_batch = 256, max_prefill = 32, max_conn = 64, max_running = 0,
         max_body = 1 << 20, shutdown_s = 30;
    ServeBatching batching = SERVE_INFLIGHT;
    int weights_bf16 = 0;
    S.model_name = "gpt2";
    pthread_mutex_init(&S.mu, NULL);
    pthread_cond_init(&S.work, NULL);
    pthread_cond_init(&S.progress, NULL);
    for (int i = 1; i < argc; i++) {
        const char* f = argv[i];
        if (strcmp(f, "-h") == 0 || strcmp(f, "--help") == 0) { usage(); return 0; }
        if (i + 1 >= argc) { fatal("%s: needs a value (serve_gpt2 --help)", f); }
        const char* v = argv[++i];
        if (strcmp(f, "-e") == 0) { model = v; }
        else if (strcmp(f, "--port") == 0) { port = flag_int(f, v, 0, 65535); }
        else if (strcmp(f, "--host") == 0) { host = v; }
        else if (strcmp(f, "--served-model-name") == 0) { S.model_name = v; }
        else if (strcmp(f, "--encoder") == 0) { encoder = v; }
        else if (strcmp(f, "--bpe") == 0) { merges = v; }
        else if (strcmp(f, "--block-size") == 0) { block_size = flag_int(f, v, 1, 4096); }
        else if (strcmp(f, "--kv-blocks") == 0) { kv_blocks = flag_int(f, v, 1, 1 << 24); }
        else if (strcmp(f, "--kv-memory") == 0) { kv_memory = flag_bytes(f, v); }
        else if (strcmp(f, "--max-batch-tokens") == 0) { max_batch = flag_int(f, v, 1, 1 << 20); }
        else if (strcmp(f, "--max-prefill-tokens") == 0) { max_prefill = flag_int(f, v, 1, 1 << 20); }
        else if (strcmp(f, "--max-running") == 0) { max_running = flag_int(f, v, 1, 100000); }
        else if (strcmp(f, "--batching") == 0) {
            if (strcmp(v, "inflight") == 0) { batching = SERVE_INFLIGHT; }
            else if (strcmp(v, "static") == 0) { batching = SERVE_STATIC; }
            else { fatal("--batching: expected inflight or static, got '%s'", v); }
        }
        else if (strcmp(f, "--max-connections") == 0) { max_conn = flag_int(f, v, 1, 100000); }
        else if (strcmp(f, "--max-body-bytes") == 0) { max_body = flag_int(f, v, 64, 1L << 30); }
        else if (strcmp(f, "--shutdown-timeout") == 0) { shutdown_s = flag_int(f, v, 0, 86400); }
        else if (strcmp(f, "--step-delay-ms") == 0) { S.step_delay_us = (int)flag_int(f, v, 0, 10000) * 1000; }
        else if (strcmp(f, "--tp") == 0) { layout.tp = (int)flag_int(f, v, 1, 64); }
        else if (strcmp(f, "--ep") == 0) { layout.ep = (int)flag_int(f, v, 1, 1024); }
        else if (strcmp(f, "--pp") == 0) { layout.pp = (int)flag_int(f, v, 1, 1024); }
        else if (strcmp(f, "--kvp") == 0) { layout.kvp = (int)flag_int(f, v, 1, 1024); }
        else if (strcmp(f, "--weights") == 0) {
            if (strcmp(v, "fp32") == 0) { weights_bf16 = 0; }
            else if (strcmp(v, "bf16") == 0) { weights_bf16 = 1; }
            else { fatal("--weights: expected fp32 or bf16, got '%s'", v); }
        }
        else { fatal("unknown flag %s (serve_gpt2 --help)", f); }
    }
    if (!model) { fatal("-e: the model checkpoint to serve is required (serve_gpt2 --help)"); }
#ifdef LLMC_DEVICE_KERNELS
    if (weights_bf16) { fatal("--weights bf16: serve_gpt2 (the CPU server) only; serve_gpt2cu serves fp32 weights"); }
#endif
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) { fatal("--host: expected an IPv4 address such as 127.0.0.1, got '%s'", host); }

    SERVE_SELECT_DEVICE(&comm);
    GPT2Config config;
    float* params = gpt2_read_finite_model(model, &config, 0);
    char why[256];
    const char* kv_problem = NULL;
    long per_request = (config.max_seq_len + block_size - 1) / block_size;
    // a rank's cache: its heads' C/tp channels of keys and values per position, for its stage's
    // L/pp layers (the layout's own refusals follow)
    int kv_layers = config.num_layers % layout.pp == 0 ? config.num_layers / layout.pp : config.num_layers;
    size_t block_bytes = paged_kv_block_bytes(kv_layers, (int)block_size, config.channels / layout.tp);
    if (kv_memory > 0) {   // a budget per rank; under --kvp each of the P ranks holds its 1/P of the blocks
        if (kv_blocks > 0) {
            kv_problem = "--kv-memory and --kv-blocks: give one of them (the cache's size in bytes, or in blocks)";
        } else if (kv_memory / block_bytes > (1 << 24)) {
            snprintf(why, sizeof(why), "--kv-memory %zu: more than 2^24 blocks of %zu bytes", kv_memory, block_bytes);
            kv_problem = why;
        } else {
            kv_blocks = (long)(kv_memory / block_bytes) * layout.kvp;
            if (kv_blocks < per_request) {
                snprintf(why, sizeof(why), "--kv-memory %zu: %ld blocks of %zu bytes (2 x L %d x block size %ld x C %d x 4), "
                         "fewer than the %ld one request of maxT = %d needs: expected at least %zu bytes", kv_memory,
                         kv_blocks, block_bytes, kv_layers, block_size, config.channels / layout.tp, per_request,
                         config.max_seq_len, (size_t)((per_request + layout.kvp - 1) / layout.kvp) * block_bytes);
                kv_problem = why;
            }
        }
    }
    if (kv_blocks == 0) { kv_blocks = 8 * per_request; }
    if (kv_problem || serve_kvp_problem(why, sizeof(why), layout.kvp, layout.tp, layout.ep, (int)block_size, kv_blocks, &config) ||
        serve_layout_problem(&layout, &config, comm.world_size, why, sizeof(why))) {
        if (comm.world_rank == 0) { fatal("%s", kv_problem ? kv_problem : why); }   // one line: rank 0's abort ends the others
        comm_barrier(&comm.world);
    }
    serve_layout_setup(&comm, &layout);
#ifndef LLMC_DEVICE_KERNELS
    // every parameter rounded, so that the rows matmul_forward takes (prefill) and the
    // embeddings agree with the bf16 decode copies (llmc/decode_matmul.h)
    if (weights_bf16) { decode_round_bf16(params, param_count(&config)); }
#endif
    bpe_init(&S.bpe, encoder, merges);
    serve_engine_init(&S.engine, &comm, SERVE_MEMORY, &config, params, (int)kv_blocks, (int)block_size, (int)max_batch, (int)max_conn);
    free(params);   // the model holds its own slices: the whole checkpoint would cost every rank its size
    // every rank's decode copies in the same type (the followers branch off below)
#ifndef LLMC_DEVICE_KERNELS
    S.engine.model->model.decode_layers->bf16 = weights_bf16;
#endif
    // every rank's pid to rank 0's watcher: a broadcast from each rank (world group)
    rank_pids = (int*)malloc_or_die(sizeof(int) * (size_t)comm.world_size, "rank pids");
    for (int r = 0; r < comm.world_size; r++) {
        rank_pids[r] = (int)getpid();
        comm_broadcast(&comm.world, &rank_pids[r], sizeof(int), r, COMM_KIND_OTHER);
    }
    comm_reset_stats(&comm);   // the startup's broadcasts are not serving's traffic
    if (comm.pp > 1) { serve_pp_init(&S.pipe, &S.engine); }
    if (comm.world_rank != 0) {   // a follower: rank 0's steps on this rank's slice, until it ends
        // SIGTERM (mpirun forwards rank 0's) is rank 0's to handle: it finishes, then ends us
        signal(SIGTERM, SIG_IGN);
        signal(SIGINT, SIG_IGN);
        if (comm.pp > 1) {
            serve_pp_follow(&S.pipe, &S.engine);
            // what this rank sent, against llmc/serve_pipeline.h's formulas (the tests read it)
            printf("serve_gpt2: rank %d (pp stage %d, ep rank %d, kvp rank %d, tp rank %d): %lld iterations, %lld rows, %lld head rows; sent pp %llu other %llu tp %llu bytes\n",
                   comm.world_rank, comm.pp_rank, comm.ep_rank, comm.cp_rank, comm.tp_rank, S.pipe.iterations, S.pipe.rows, S.pipe.head_rows,
                   (unsigned long long)comm.stats.bytes[COMM_KIND_PP], (unsigned long long)comm.stats.bytes[COMM_KIND_OTHER],
                   (unsigned long long)comm.stats.bytes[COMM_KIND_TP]);
            fflush(stdout);
            serve_pp_free(&S.pipe);
        } else {
            serve_engine_follow(&S.engine);
        }
        serve_engine_free(&S.engine);
        bpe_free(&S.bpe);
        comm_finalize(&comm);
        free(rank_pids);
        return 0;
    }
    pthread_t watcher;         // world_size > 1: rank_watch_thread
    S.engine.batching = batching;
    S.engine.max_prefill_tokens = (int)max_prefill;
    if (max_running > 0) { S.engine.max_running = (int)(max_running < max_conn ? max_running : max_conn); }
    S.engine.token_text = token_text;
    S.engine.token_text_ctx = &S.bpe;
    S.engine.on_event = on_event;
    S.max_connections = (int)max_conn;
    S.max_body = (size_t)max_body;
    S.limits = (ServeLimits){config.max_seq_len - 1, config.vocab_size, S.model_name, encode_text, &S.bpe};
    if (config.num_experts > 0) {
        const MoeCounters* ct = &S.engine.model->model.counters;
        S.expert_slots = (long long*)calloc_or_die((size_t)ct->layers * ct->experts, sizeof(long long), "expert slots");
    }

    if (pipe(stop_pipe) != 0) { fatal("serve_gpt2: pipe: %s", strerror(errno)); }
    struct sigaction stop_action = {0};
    stop_action.sa_handler = on_stop_signal;
    sigaction(SIGTERM, &stop_action, NULL);
    sigaction(SIGINT, &stop_action, NULL);
    signal(SIGPIPE, SIG_IGN);
    // MHD's own limit sits above ours so that the requests past ours get a 429, not a closed socket
    struct MHD_Daemon* d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG, (uint16_t)port,
        NULL, NULL, access_handler, NULL, MHD_OPTION_SOCK_ADDR, (struct sockaddr*)&addr, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)(max_conn + 64), MHD_OPTION_NOTIFY_COMPLETED, request_completed, NULL, MHD_OPTION_END);
    if (!d) { fatal("--host %s --port %ld: cannot listen there (%s)", host, port, strerror(errno)); }
    const union MHD_DaemonInfo* info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    printf("serve_gpt2: %s (L=%d C=%d maxT=%d V=%d E=%d k=%d) in %s memory, %s weights, %ld KV blocks of %ld, %ld rows per step (%ld prompt rows in a decoding step), %s batching of %d at most\n",
           model, config.num_layers, config.channels, config.max_seq_len, config.vocab_size, config.num_experts,
           config.top_k, SERVE_MEMORY->name, weights_bf16 ? "bf16" : "fp32", kv_blocks, block_size,
           max_batch, max_prefill, batching == SERVE_STATIC ? "static" : "in-flight", S.engine.max_running);
    if (comm.world_size > 1) {
        printf("serve_gpt2: %d ranks (tp %d x ep %d x kvp %d x pp %d), rank pids", comm.world_size, comm.tp, comm.ep,
               comm.cp, comm.pp);
        for (int r = 0; r < comm.world_size; r++) { printf(" %d", rank_pids[r]); }
        printf("\n");
        if (comm.cp > 1) {   // KV parallelism (llmc/serve_kvp.h): the cache per rank, the traffic per token
            const KVPLayout* lay = &S.engine.kvp.lay;
            printf("serve_gpt2: kvp %d: KV cache per rank %d blocks of %d heads, %zu bytes; KVP collectives %llu bytes "
                   "per generated token (one row a step, per layer of the stage's %d all-reduces of %d + %d floats and "
                   "a reduce-scatter of %d over %d ranks); weights per rank %zu bytes (the output projection and the "
                   "MLP over all %d ranks)\n", comm.cp, S.engine.kv.num_blocks, lay->NHl, serve_kv_cache_bytes(&S.engine),
                   (unsigned long long)(kv_layers * kvp_step_bytes(lay, 1)), kv_layers, lay->NHl, lay->NHl, lay->Cl,
                   comm.cp, serve_model_weight_bytes(S.engine.model), comm.cp * comm.tp);
        }
        static int world_size;
        world_size = comm.world_size;
        pthread_create(&watcher, NULL, rank_watch_thread, &world_size);
    }
    printf("serve_gpt2: KV cache of %ld blocks x %zu bytes = %zu bytes a rank (2 x L x block size x C x 4 per block, "
           "L and C this rank's)\n", kv_blocks / layout.kvp, block_bytes, (size_t)(kv_blocks / layout.kvp) * block_bytes);
    printf("serving %s on http://%s:%u\n", S.model_name, host, info ? info->port : (unsigned)port);
    fflush(stdout);

    pthread_t stopper;
    shutdown_seconds = shutdown_s;
    pthread_create(&stopper, NULL, stopper_thread, d);
    // the engine loop on the main thread: MPI was started FUNNELED (comm_mpi.h), only this
    // thread calls it (the step broadcasts and the model's collectives)
    engine_thread(NULL);
    if (comm.world_size > 1) {
        pthread_mutex_lock(&S.mu);
        S.ranks_ending = 1;
        pthread_mutex_unlock(&S.mu);
        pthread_join(watcher, NULL);
        if (comm.pp > 1) {
            serve_pp_stop(&S.pipe, &S.engine);
            serve_pp_free(&S.pipe);
        } else {
            serve_engine_stop_followers(&S.engine);
        }
    }
    pthread_join(stopper, NULL);
    MHD_stop_daemon(d);
    serve_engine_free(&S.engine);
    bpe_free(&S.bpe);
    comm_finalize(&comm);
    free(rank_pids);
    free(S.expert_slots);
    printf("serve_gpt2: stopped\n");
    return 0;
}
