// serve_load: a load generator for serve_gpt2 (make bench-serve, make bench-serve-layouts), after
// vLLM's benchmark_serving.
// Requests arrive as a Poisson process at --rate per second (inf: all at once), at most
// --max-concurrency in flight; each prompt is a passage of tiny Shakespeare (--prompt-chars
// MIN:MAX characters from a random line start), each output length uniform in --output-tokens
// MIN:MAX (ignore_eos, so a random model runs to it). Each request streams (SSE over HTTP/1.1
// on a plain socket, chunked transfer decoded here); the times are the client's:
//   TTFT  request sent -> first chunk with text
//   TPOT  (latency - TTFT) / (output tokens - 1)
//   ITL   every gap between consecutive chunks with text
//   decode tok/s  the tokens after each request's first, over the time some request was past its
//                 first token (the union of [first, done]): the decode rate, prefill excluded
// Output: one line of mean / p50 / p99 per metric, and request throughput, output tok/s; with
// --label, also one Markdown table row of them (make bench-serve's table).
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void die(const char* msg, const char* what) {
    fprintf(stderr, "serve_load: %s%s\n", msg, what);
    exit(1);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t rng_state = 42;
static double uniform01(void) {   // xorshift64*
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}

typedef struct {
    char* body;               // the JSON request
    int max_tokens;
    double arrive;            // seconds after the start
    double sent, first, done; // absolute
    double* chunk_times;      // every chunk with text
    int num_chunks, output_tokens, ok;
} Req;

static Req* reqs;
static int num_reqs, next_req, port;
static double t_start;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

// the prompt as a JSON string: quotes, backslashes and control characters escaped
static void json_string(char* out, const char* s, int n) {
    char* o = out;
    *o++ = '"';
    for (int i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') { *o++ = '\\'; *o++ = (char)ch; }
        else if (ch == '\n') { *o++ = '\\'; *o++ = 'n'; }
        else if (ch < 0x20) { o += sprintf(o, "\\u%04x", ch); }
        else { *o++ = (char)ch; }
    }
    *o++ = '"';
    *o = 0;
}

// one chunk of the SSE stream: each "data: {...}" event with a non-empty "text" is a token chunk
static void on_events(Req* r, const char* data, size_t n, size_t* scanned) {
    for (;;) {
        const char* start = data + *scanned;
        const char* end = memmem(start, n - *scanned, "\n\n", 2);
        if (!end) { return; }
        double t = now();
        if (memmem(start, (size_t)(end - start), "\"text\":\"", 8) && !memmem(start, (size_t)(end - start), "\"text\":\"\"", 9)) {
            if (r->num_chunks == 0) { r->first = t; }
            r->chunk_times[r->num_chunks++] = t;
        }
        const char* u = memmem(start, (size_t)(end - start), "\"completion_tokens\":", 20);
        if (u) { r->output_tokens = atoi(u + 20); }
        if (memmem(start, (size_t)(end - start), "data: [DONE]", 12)) { r->ok = 1; }
        *scanned = (size_t)(end + 2 - data);
    }
}

static void run_request(Req* r) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr*)&a, sizeof(a)) != 0) { die("connect: ", strerror(errno)); }
    size_t blen = strlen(r->body);
    char* msg = malloc(blen + 256);
    int hl = sprintf(msg, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Content-Length: %zu\r\nConnection: close\r\n\r\n", blen);
    memcpy(msg + hl, r->body, blen);
    r->sent = now();
    for (size_t off = 0; off < hl + blen;) {
        ssize_t w = write(fd, msg + off, hl + blen - off);
        if (w <= 0) { die("write: ", strerror(errno)); }
        off += (size_t)w;
    }
    free(msg);
    // raw bytes in; the headers, then chunked transfer decoded into the event stream `data`
    size_t cap = 1 << 16, len = 0, pos = 0, dlen = 0, scanned = 0;
    char *raw = malloc(cap), *data = malloc(cap);
    int in_body = 0, chunked = 0;
    long chunk_left = -1;   // -1: at a size line
    for (;;) {
        if (len + 4096 > cap) { cap *= 2; raw = realloc(raw, cap); data = realloc(data, cap); }
        ssize_t got = read(fd, raw + len, cap - len - 1);
        if (got <= 0) { break; }
        len += (size_t)got;
        raw[len] = 0;
        if (!in_body) {
            char* h = strstr(raw, "\r\n\r\n");
            if (!h) { continue; }
            if (strncmp(raw, "HTTP/1.1 200", 12) != 0) { break; }
            chunked = strcasestr(raw, "transfer-encoding: chunked") != NULL && strcasestr(raw, "transfer-encoding: chunked") < h;
            pos = (size_t)(h + 4 - raw);
            in_body = 1;
        }
        while (pos < len) {
            if (!chunked) { memcpy(data + dlen, raw + pos, len - pos); dlen += len - pos; pos = len; break; }
            if (chunk_left < 0) {   // "<hex>\r\n"
                char* eol = memmem(raw + pos, len - pos, "\r\n", 2);
                if (!eol) { break; }
                chunk_left = strtol(raw + pos, NULL, 16);
                pos = (size_t)(eol + 2 - raw);
                if (chunk_left == 0) { break; }
            }
            size_t take = len - pos < (size_t)chunk_left ? len - pos : (size_t)chunk_left;
            memcpy(data + dlen, raw + pos, take);
            dlen += take; pos += take; chunk_left -= (long)take;
            if (chunk_left == 0) {   // its trailing CRLF
                if (len - pos < 2) { break; }
                pos += 2;
                chunk_left = -1;
            }
        }
        on_events(r, data, dlen, &scanned);
        if (r->ok) { break; }
    }
    r->done = now();
    close(fd);
    free(raw);
    free(data);
}

static void* client(void* arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&mu);
        int i = next_req < num_reqs ? next_req++ : -1;
        pthread_mutex_unlock(&mu);
        if (i < 0) { return NULL; }
        double wait = t_start + reqs[i].arrive - now();
        if (wait > 0) { usleep((useconds_t)(wait * 1e6)); }
        run_request(&reqs[i]);
    }
}

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}

static int cmp_first(const void* a, const void* b) {
    return cmp_double(&(*(Req* const*)a)->first, &(*(Req* const*)b)->first);
}
// seconds during which some request of `done` (n of them, complete) was past its first token
static double decoding_seconds(Req** done, int n) {
    qsort(done, (size_t)n, sizeof(Req*), cmp_first);
    double total = 0, start = 0, end = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (done[i]->first > end) { total += end > start ? end - start : 0; start = done[i]->first; end = done[i]->done; }
        else if (done[i]->done > end) { end = done[i]->done; }
    }
    return total + (end > start ? end - start : 0);
}

// mean, p50, p99 in ms (linear interpolation between order statistics, as numpy's percentile)
static double row_stats[3][3];   // TTFT, TPOT, ITL: mean, p50, p99 in ms
static void report(const char* name, double* v, int n, double* stats) {
    if (n == 0) { printf("%-6s (none)\n", name); return; }
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) { sum += v[i]; }
    double p[2] = {50, 99}, q[2];
    for (int k = 0; k < 2; k++) {
        double x = p[k] / 100.0 * (n - 1);
        int lo = (int)x;
        q[k] = lo + 1 < n ? v[lo] + (x - lo) * (v[lo + 1] - v[lo]) : v[lo];
    }
    stats[0] = 1e3 * sum / n; stats[1] = 1e3 * q[0]; stats[2] = 1e3 * q[1];
    printf("%-6s mean %8.1f  p50 %8.1f  p99 %8.1f ms\n", name, stats[0], stats[1], stats[2]);
}

// an llm.c token file (llmc/dataloader.h: a 256-int32 header, magic 20240520, [2] the count, then
// uint16 ids): its ids
static uint16_t* read_tokens(const char* file, long* count) {
    FILE* fp = fopen(file, "rb");
    int32_t header[256];
    if (!fp || fread(header, sizeof(int32_t), 256, fp) != 256 || header[0] != 20240520) { die("--tokens: not an llm.c token file: ", file); }
    *count = header[2];
    uint16_t* ids = malloc(sizeof(uint16_t) * (size_t)*count);
    if (fread(ids, sizeof(uint16_t), (size_t)*count, fp) != (size_t)*count) { die("--tokens: shorter than its header says: ", file); }
    fclose(fp);
    return ids;
}

static void range(const char* flag, const char* v, int* lo, int* hi) {
    if (sscanf(v, "%d:%d", lo, hi) != 2 || *lo < 1 || *hi < *lo) { die(flag, ": expected MIN:MAX, 1 <= MIN <= MAX"); }
}

int main(int argc, char** argv) {
    const char *text_file = "dev/data/tinyshakespeare.txt", *tokens_file = NULL, *label = NULL;
    double rate = INFINITY;
    int concurrency = 1, pmin = 100, pmax = 400, omin = 16, omax = 48, prompt_tokens = 0;
    num_reqs = 16;
    port = 8000;
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) { die(argv[i], ": needs a value"); }
        const char *f = argv[i], *v = argv[i + 1];
        if (strcmp(f, "--port") == 0) { port = atoi(v); }
        else if (strcmp(f, "--num-prompts") == 0) { num_reqs = atoi(v); }
        else if (strcmp(f, "--rate") == 0) { rate = strcmp(v, "inf") == 0 ? INFINITY : atof(v); }
        else if (strcmp(f, "--max-concurrency") == 0) { concurrency = atoi(v); }
        else if (strcmp(f, "--prompt-chars") == 0) { range(f, v, &pmin, &pmax); }
        else if (strcmp(f, "--output-tokens") == 0) { range(f, v, &omin, &omax); }
        else if (strcmp(f, "--text") == 0) { text_file = v; }
        else if (strcmp(f, "--tokens") == 0) { tokens_file = v; }
        else if (strcmp(f, "--prompt-tokens") == 0) { prompt_tokens = atoi(v); }
        else if (strcmp(f, "--label") == 0) { label = v; }
        else if (strcmp(f, "--seed") == 0) { rng_state = strtoull(v, NULL, 10) | 1; }
        else { die("unknown flag ", f); }
    }
    if (num_reqs < 1 || concurrency < 1 || !(rate > 0)) { die("--num-prompts, --max-concurrency, --rate: ", "positive"); }
    if (!tokens_file != !prompt_tokens) { die("--tokens FILE and --prompt-tokens N: ", "both or neither"); }
    long ntokens = 0;
    uint16_t* ids = tokens_file ? read_tokens(tokens_file, &ntokens) : NULL;
    if (ids && (prompt_tokens < 1 || ntokens <= prompt_tokens)) { die("--prompt-tokens: expected 1 .. the file's token count - 1, in ", tokens_file); }
    char* text = NULL;
    long tlen = 0;
    if (!ids) {
        FILE* fp = fopen(text_file, "rb");
        if (!fp) { die("cannot read ", text_file); }
        fseek(fp, 0, SEEK_END);
        tlen = ftell(fp);
        fseek(fp, 0, SEEK_SET);
        text = malloc((size_t)tlen);
        if (fread(text, 1, (size_t)tlen, fp) != (size_t)tlen || tlen < 2 * pmax) { die("too short or unreadable: ", text_file); }
        fclose(fp);
    }

    reqs = calloc((size_t)num_reqs, sizeof(Req));
    // room for the prompt as JSON: a character escaped takes at most 6, an id 5 digits and a comma
    char* prompt = malloc((size_t)(ids ? prompt_tokens : pmax) * 6 + 3);
    double t = 0;
    for (int i = 0; i < num_reqs; i++) {
        Req* r = &reqs[i];
        if (ids) {   // a JSON array of prompt_tokens ids from a random offset
            long at = (long)(uniform01() * (double)(ntokens - prompt_tokens));
            char* o = prompt;
            *o++ = '[';
            for (int k = 0; k < prompt_tokens; k++) { o += sprintf(o, k ? ",%u" : "%u", ids[at + k]); }
            *o++ = ']';
            *o = 0;
        } else {
            long at = (long)(uniform01() * (double)(tlen - pmax - 1));
            while (at > 0 && text[at - 1] != '\n') { at--; }   // a passage from a line's start
            int chars = pmin + (int)(uniform01() * (pmax - pmin + 1));
            json_string(prompt, text + at, chars);
        }
        r->max_tokens = omin + (int)(uniform01() * (omax - omin + 1));
        r->body = malloc(strlen(prompt) + 256);
        sprintf(r->body, "{\"model\":\"gpt2\",\"prompt\":%s,\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                         "\"stream\":true,\"stream_options\":{\"include_usage\":true}}", prompt, r->max_tokens);
        r->chunk_times = malloc(sizeof(double) * (size_t)(r->max_tokens + 1));
        r->arrive = t;
        if (isfinite(rate)) { t += -log(1.0 - uniform01()) / rate; }   // exponential gaps: Poisson arrivals
    }
    pthread_t* th = malloc(sizeof(pthread_t) * (size_t)concurrency);
    t_start = now();
    for (int i = 0; i < concurrency; i++) { pthread_create(&th[i], NULL, client, NULL); }
    for (int i = 0; i < concurrency; i++) { pthread_join(th[i], NULL); }
    double t_end = now();

    double *ttft = malloc(sizeof(double) * num_reqs), *tpot = malloc(sizeof(double) * num_reqs);
    int nttft = 0, ntpot = 0, nitl = 0, ok = 0;
    long out = 0, decoded = 0;
    Req** done = malloc(sizeof(Req*) * num_reqs);
    for (int i = 0; i < num_reqs; i++) { nitl += reqs[i].num_chunks; }
    double* itl = malloc(sizeof(double) * (size_t)(nitl + 1));
    nitl = 0;
    for (int i = 0; i < num_reqs; i++) {
        Req* r = &reqs[i];
        if (!r->ok || r->num_chunks == 0) { continue; }
        done[ok++] = r;
        out += r->output_tokens;
        decoded += r->output_tokens - 1;
        ttft[nttft++] = r->first - r->sent;
        if (r->output_tokens > 1) { tpot[ntpot++] = (r->done - r->first) / (r->output_tokens - 1); }
        for (int c = 1; c < r->num_chunks; c++) { itl[nitl++] = r->chunk_times[c] - r->chunk_times[c - 1]; }
    }
    double secs = t_end - t_start;
    printf("requests %d of %d complete in %.2f s: %.3f req/s, %ld output tokens, %.1f output tok/s\n", ok, num_reqs, secs,
           ok / secs, out, out / secs);
    double dsecs = ok ? decoding_seconds(done, ok) : 0;
    printf("decode %ld tokens in %.2f s decoding: %.2f decode tok/s\n", decoded, dsecs, dsecs > 0 ? decoded / dsecs : 0);
    report("TTFT", ttft, nttft, row_stats[0]);
    report("TPOT", tpot, ntpot, row_stats[1]);
    report("ITL", itl, nitl, row_stats[2]);
    if (label) {
        printf("| %s | %d | %.3f | %.2f |", label, ok, ok / secs, out / secs);
        for (int m = 0; m < 3; m++) { printf(" %.0f / %.0f / %.0f |", row_stats[m][0], row_stats[m][1], row_stats[m][2]); }
        printf("\n");
    }
    return ok == num_reqs ? 0 : 1;
}
