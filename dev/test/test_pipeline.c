/*
 * Unit tests for llmc/pipeline.h and its simulator (dev/tools/pp_sim.h): pipeline schedules (gpipe, 1f1b, interleaved, zb1, zbv,
 * dualpipev), their
 * communication, the simulator, the bubble model, the memory bound, the layer partition and
 * the placement of layers on (stage, chunk).
 *
 * Expected values come from the definitions (written out by hand below, or recomputed here from
 * the rule in a few lines), never from the code under test. Every failed check prints one line
 * naming the schedule, S, M (and v), the stage and what was wrong; the exit status is 1 if any
 * check failed.
 *
 *   build/test_pipeline        (built by `make test`, or: make build/test_pipeline)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dev/tools/pp_sim.h"

static int checks = 0, failures = 0;

// Prints the first failures in full; counts all of them.
#define CHECK(cond, ...)                                              \
    do {                                                              \
        checks++;                                                     \
        if (!(cond)) {                                                \
            failures++;                                               \
            if (failures <= 40) {                                     \
                printf("FAIL (line %d): ", __LINE__);                 \
                printf(__VA_ARGS__);                                  \
                printf("\n");                                         \
            }                                                         \
        }                                                             \
    } while (0)

// ----------------------------------------------------------------------------------------------
// helpers written independently of the code under test

static const char* kind_name(int kind) {
    switch (kind) {
        case PP_GPIPE: return "gpipe";
        case PP_1F1B: return "1f1b";
        case PP_INTERLEAVED: return "interleaved";
        case PP_ZB1: return "zb1";
        case PP_ZBV: return "zbv";
        case PP_DUALPIPEV: return "dualpipev";
        case PP_DUALPIPE: return "dualpipe";
    }
    return "?";
}

// zb1 and zbv split every backward, dualpipev some (the others whole), the rest none.
static int splits_backward(int kind) {
    return kind == PP_ZB1 || kind == PP_ZBV || kind == PP_DUALPIPEV || kind == PP_DUALPIPE;
}
static int splits_every_backward(int kind) { return kind == PP_ZB1 || kind == PP_ZBV; }

static int is_compute(PipelineActionKind kind) {
    return kind == PP_FORWARD || kind == PP_BACKWARD || kind == PP_BACKWARD_INPUT || kind == PP_BACKWARD_WEIGHT ||
           kind == PP_FORWARD_BACKWARD;
}

// An F&B as its forward, then its whole backward (peer -1); anything else as itself. Returns 2 or 1.
static int unpair(const PipelineAction* a, PipelineAction* out) {
    out[0] = *a;
    if (a->kind != PP_FORWARD_BACKWARD) { return 1; }
    out[0].kind = PP_FORWARD;
    out[1] = out[0];
    out[1].kind = PP_BACKWARD;
    out[1].microbatch = a->backward_microbatch;
    out[1].chunk = a->backward_chunk;
    return 2;
}

static void describe(char* buf, size_t len, const PipelineConfig* cfg) {
    if (cfg->num_chunks > 1) {
        snprintf(buf, len, "%s S=%d M=%d v=%d", kind_name(cfg->kind), cfg->num_stages, cfg->num_microbatches,
                 cfg->num_chunks);
    } else {
        snprintf(buf, len, "%s S=%d M=%d", kind_name(cfg->kind), cfg->num_stages, cfg->num_microbatches);
    }
}

// Where chunk c of stage s sits in the model, by the schedules' definitions: interleaved goes
// round the ring of stages v times (Megatron-LM), zbv down the stages and back up (the V);
// dualpipe's S model stages each on two ranks: rank s and rank S-1-s hold min(s, S-1-s) as
// chunk 0 and the mirror stage as chunk 1.
static int virtual_stage_of(const PipelineConfig* cfg, int s, int c) {
    int S = cfg->num_stages;
    if (cfg->kind == PP_ZBV || cfg->kind == PP_DUALPIPEV) { return c == 0 ? s : 2 * S - 1 - s; }
    if (cfg->kind == PP_DUALPIPE) {
        int h = s < S - 1 - s ? s : S - 1 - s;
        return c == 0 ? h : S - 1 - h;
    }
    return c * S + s;
}

static int model_stages(const PipelineConfig* cfg) {
    return cfg->kind == PP_DUALPIPE ? cfg->num_stages : cfg->num_stages * cfg->num_chunks;
}

// dualpipe: 1 when chunk c of stage s carries the microbatches that enter at stage 0 (model
// stage k on rank k) -- the first half, [0, M/2) -- rather than those entering at stage S-1
// (model stage k on rank S-1-k), [M/2, M). Every chunk of the other schedules runs all M.
static int runs_first_half(const PipelineConfig* cfg, int s, int c) {
    return cfg->kind != PP_DUALPIPE || (virtual_stage_of(cfg, s, c) == s);
}
static int first_microbatch_of(const PipelineConfig* cfg, int s, int c) {
    return runs_first_half(cfg, s, c) ? 0 : cfg->num_microbatches / 2;
}
static int microbatches_of(const PipelineConfig* cfg) {
    return cfg->kind == PP_DUALPIPE ? cfg->num_microbatches / 2 : cfg->num_microbatches;
}

// The stage holding virtual stage vs, by search; -1 if none.
static int stage_of(const PipelineConfig* cfg, int vs) {
    for (int s = 0; s < cfg->num_stages; s++) {
        for (int c = 0; c < cfg->num_chunks; c++) {
            if (virtual_stage_of(cfg, s, c) == vs) { return s; }
        }
    }
    return -1;
}

// The stage running the virtual stage before (step -1) or after (+1) chunk c of stage s on its
// microbatches' way; -1 if none.
static int neighbour_of(const PipelineConfig* cfg, int s, int c, int step) {
    int vs = virtual_stage_of(cfg, s, c) + step;
    if (vs < 0 || vs >= model_stages(cfg)) { return -1; }
    if (cfg->kind == PP_DUALPIPE) { return runs_first_half(cfg, s, c) ? vs : cfg->num_stages - 1 - vs; }
    return stage_of(cfg, vs);
}

// The chunk of stage s holding virtual stage vs; -1 if none.
static int chunk_of(const PipelineConfig* cfg, int s, int vs) {
    for (int c = 0; c < cfg->num_chunks; c++) {
        if (virtual_stage_of(cfg, s, c) == vs) { return c; }
    }
    return -1;
}

// Tokens: F3 B3 I3 W3 computations (forward, backward, its input / weight halves); rF3 sF3 rB3
// sB3 receive/send forward activation or backward gradient; "c1" for chunk 1 when with_chunk;
// a trailing "+" marks post_with_next; an F&B as F3c0&B1c1.
static void format_actions(char* buf, size_t len, const PipelineAction* a, int n, int with_comm, int with_chunk) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && used < len; i++) {
        const char* p = "?";
        switch (a[i].kind) {
            case PP_FORWARD: p = "F"; break;
            case PP_BACKWARD: p = "B"; break;
            case PP_BACKWARD_INPUT: p = "I"; break;
            case PP_BACKWARD_WEIGHT: p = "W"; break;
            case PP_RECV_FORWARD: p = "rF"; break;
            case PP_SEND_FORWARD: p = "sF"; break;
            case PP_RECV_BACKWARD: p = "rB"; break;
            case PP_SEND_BACKWARD: p = "sB"; break;
            case PP_FORWARD_BACKWARD: break;
        }
        if (!is_compute(a[i].kind) && !with_comm) { continue; }
        char chunk[16] = "";
        if (with_chunk) { snprintf(chunk, sizeof(chunk), "c%d", a[i].chunk); }
        if (a[i].kind == PP_FORWARD_BACKWARD) {
            char bchunk[16] = "";
            if (with_chunk) { snprintf(bchunk, sizeof(bchunk), "c%d", a[i].backward_chunk); }
            used += (size_t)snprintf(buf + used, len - used, "%sF%d%s&B%d%s", used ? " " : "", a[i].microbatch, chunk,
                                     a[i].backward_microbatch, bchunk);
            continue;
        }
        used += (size_t)snprintf(buf + used, len - used, "%s%s%d%s%s", used ? " " : "", p, a[i].microbatch, chunk,
                                 with_comm && a[i].post_with_next ? "+" : "");
    }
}

// Parses tokens in the format above (chunk 0 when there is no "c") into actions of stage s; a
// send/receive gets as peer the stage holding the neighbouring virtual stage (-1 if none).
static int parse_actions(const char* text, const PipelineConfig* cfg, int s, PipelineAction* out) {
    int n = 0;
    const char* p = text;
    while (*p) {
        while (*p == ' ') { p++; }
        if (!*p) { break; }
        PipelineAction a;
        memset(&a, 0, sizeof(a));
        a.backward_microbatch = a.backward_chunk = -1;
        int recv = *p == 'r', send = *p == 's';
        if (recv || send) { p++; }
        char letter = *p++;
        if (recv || send) {
            a.kind = letter == 'F' ? (recv ? PP_RECV_FORWARD : PP_SEND_FORWARD)
                                   : (recv ? PP_RECV_BACKWARD : PP_SEND_BACKWARD);
        } else {
            a.kind = letter == 'F' ? PP_FORWARD : letter == 'B' ? PP_BACKWARD : letter == 'I' ? PP_BACKWARD_INPUT
                   : PP_BACKWARD_WEIGHT;
        }
        a.microbatch = (int)strtol(p, (char**)&p, 10);
        if (*p == 'c') { p++; a.chunk = (int)strtol(p, (char**)&p, 10); }
        int towards_input = a.kind == PP_RECV_FORWARD || a.kind == PP_SEND_BACKWARD;
        a.peer = recv || send ? neighbour_of(cfg, s, a.chunk, towards_input ? -1 : +1) : -1;
        if (*p == '+') { a.post_with_next = 1; p++; }
        out[n++] = a;
    }
    return n;
}

typedef struct {
    PipelineActionKind kind;
    int microbatch, chunk;
    int backward_microbatch, backward_chunk;  // an F&B's backward half; -1 otherwise
} Computation;

static int add_computation(Computation* out, int n, int M, PipelineActionKind kind, int microbatch, int chunk) {
    if (microbatch >= M) { return n; }
    out[n].kind = kind;
    out[n].microbatch = microbatch;
    out[n].chunk = chunk;
    out[n].backward_microbatch = out[n].backward_chunk = -1;
    return n + 1;
}

// gpipe = all forwards then all backwards; 1f1b = warmup min(S-s-1, M) forwards, M - warmup
// (forward, backward) pairs, then the remaining backwards; interleaved = Megatron-LM's table
// (groups of S microbatches; forward k is microbatch (k / (S*v))*S + k % S on chunk
// (k % (S*v)) / S, backwards run chunks reversed), warmup min(2*(S-s-1) + (v-1)*S, v*M).
static int expected_one_forward_one_backward(const PipelineConfig* cfg, int s, Computation* out) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks, n = v * M;
    int warmup = cfg->kind == PP_GPIPE ? n : cfg->kind == PP_INTERLEAVED ? 2 * (S - s - 1) + (v - 1) * S : S - s - 1;
    if (warmup > n) { warmup = n; }
    int* is_fwd = (int*)malloc(sizeof(int) * 2 * n);
    int count = 0;
    int f = 0, b = 0;  // next forward, next backward unit
    for (int i = 0; i < warmup; i++) { is_fwd[count++] = 1; f++; }
    for (int i = 0; i < n - warmup; i++) { is_fwd[count++] = 1; is_fwd[count++] = 0; f++; b++; }
    while (b < n) { is_fwd[count++] = 0; b++; }
    f = b = 0;
    for (int i = 0; i < count; i++) {
        int k = is_fwd[i] ? f++ : b++;
        int in_group = k % (S * v);
        out[i].kind = is_fwd[i] ? PP_FORWARD : PP_BACKWARD;
        out[i].microbatch = (k / (S * v)) * S + in_group % S;
        out[i].chunk = is_fwd[i] ? in_group / S : v - 1 - in_group / S;
        out[i].backward_microbatch = out[i].backward_chunk = -1;
    }
    free(is_fwd);
    return count;
}

// ZB-H1 (Qi et al. 2023, section 3.1): the 1f1b order with every B(j) replaced by I(j)
// followed by W(j - s) once j >= s; the W's left at the end, in order.
static int expected_zb1(const PipelineConfig* cfg, int s, Computation* out) {
    PipelineConfig one = *cfg;
    one.kind = PP_1F1B;
    int M = cfg->num_microbatches;
    Computation* base = (Computation*)malloc(sizeof(Computation) * 2 * M);
    int n = expected_one_forward_one_backward(&one, s, base), count = 0, next_w = 0;
    for (int i = 0; i < n; i++) {
        int j = base[i].microbatch;
        if (base[i].kind == PP_FORWARD) {
            count = add_computation(out, count, M, PP_FORWARD, j, 0);
            continue;
        }
        count = add_computation(out, count, M, PP_BACKWARD_INPUT, j, 0);
        if (j >= s) { count = add_computation(out, count, M, PP_BACKWARD_WEIGHT, next_w++, 0); }
    }
    while (next_w < M) { count = add_computation(out, count, M, PP_BACKWARD_WEIGHT, next_w++, 0); }
    free(base);
    return count;
}

// Runs `pattern` ("F0 I1 W1": kind and chunk) `repeats` times, each step taking that chunk's
// next microbatch for that kind (next[F=0 / I=1 / W=2][chunk]). There are N forwards per chunk
// (a forward past them is skipped); microbatches >= M are left out of the list.
static int zbv_phase(Computation* out, int count, int M, int N, int next[3][2], int repeats, const char* pattern) {
    for (int r = 0; r < repeats; r++) {
        for (const char* p = pattern; *p; p += p[2] == ' ' ? 3 : 2) {
            int k = p[0] == 'F' ? 0 : p[0] == 'I' ? 1 : 2, c = p[1] - '0';
            if (k == 0 && next[0][c] >= N) { continue; }
            PipelineActionKind kind = k == 0 ? PP_FORWARD : k == 1 ? PP_BACKWARD_INPUT : PP_BACKWARD_WEIGHT;
            count = add_computation(out, count, M, kind, next[k][c]++, c);
        }
    }
    return count;
}

// ZB-V (Qi et al. 2023, section 6, as PyTorch's ScheduleZBVZeroBubble) on rank r, phase by
// phase, for N = max(M, 2S-1) microbatches (the pattern's minimum), those >= M left out.
static int expected_zbv(const PipelineConfig* cfg, int r, Computation* out) {
    int S = cfg->num_stages, M = cfg->num_microbatches, N = M > 2 * S - 1 ? M : 2 * S - 1;
    int next[3][2] = {{0, 0}, {0, 0}, {0, 0}};
    int count = 0;
    count = zbv_phase(out, count, M, N, next, 2 * (S - r) - 1, "F0");
    count = zbv_phase(out, count, M, N, next, r, "F1 F0");
    count = zbv_phase(out, count, M, N, next, S - r, "F1 I1 W1");
    while (next[0][0] < N || next[0][1] < N) { count = zbv_phase(out, count, M, N, next, 1, "F0 I0 W0 F1 I1 W1"); }
    count = zbv_phase(out, count, M, N, next, r, "I0 I1");
    count = zbv_phase(out, count, M, N, next, S - r, "I0 W0");
    while (next[2][1] < N) { count = zbv_phase(out, count, M, N, next, 1, "W1"); }
    while (next[2][0] < N) { count = zbv_phase(out, count, M, N, next, 1, "W0"); }
    return count;
}

// DualPipeV on rank r, DeepSeek's eight phases as the issue (and deepseek-ai/DualPipe's
// DualPipeV) give them, written as patterns: "F0" forward of chunk 0, "B1" whole backward of
// chunk 1, "I1" backward of chunk 1 with W split off, "W" the oldest W still due, "F0&B1" an
// F&B, each step taking that chunk's next microbatch. Phase 4's first pair on the last rank is
// "F0 B1"; in phase 6 the last r+1 of the 2(r+1) backwards are split.
typedef struct {
    int f[2], b[2];
    int due[128], due_head, due_count;  // W's due: microbatch * 2 + chunk, oldest first
} DualPipeVState;

static int dualpipev_phase(Computation* out, int n, int M, DualPipeVState* st, int repeats, const char* pattern) {
    for (int r = 0; r < repeats; r++) {
        for (const char* p = pattern; *p;) {
            if (*p == ' ') { p++; continue; }
            if (p[0] == 'W') {
                int d = st->due[st->due_head++];
                n = add_computation(out, n, M, PP_BACKWARD_WEIGHT, d / 2, d % 2);
                p += 1;
            } else if (p[0] == 'F' && p[2] == '&') {
                int fc = p[1] - '0', bc = p[4] - '0';
                n = add_computation(out, n, M, PP_FORWARD_BACKWARD, st->f[fc]++, fc);
                out[n - 1].backward_microbatch = st->b[bc]++;
                out[n - 1].backward_chunk = bc;
                p += 5;
            } else {
                int c = p[1] - '0';
                if (p[0] == 'I') { st->due[st->due_count++] = st->b[c] * 2 + c; }
                PipelineActionKind kind = p[0] == 'F' ? PP_FORWARD : p[0] == 'B' ? PP_BACKWARD : PP_BACKWARD_INPUT;
                n = add_computation(out, n, M, kind, p[0] == 'F' ? st->f[c]++ : st->b[c]++, c);
                p += 2;
            }
        }
    }
    return n;
}

// DualPipe (deepseek-ai/DualPipe): ranks s and S-1-s both run rank min(s, S-1-s)'s phases of a
// DualPipeV of S/2 ranks and M/2 microbatches, each chunk on its own half of the microbatches.
static int expected_dualpipev(const PipelineConfig* cfg, int s, Computation* out) {
    int dual = cfg->kind == PP_DUALPIPE, S = cfg->num_stages;
    int P = dual ? S / 2 : S, N = dual ? cfg->num_microbatches / 2 : cfg->num_microbatches;
    int r = s < S - 1 - s || !dual ? s : S - 1 - s;
    DualPipeVState st;
    memset(&st, 0, sizeof(st));
    for (int c = 0; c < 2; c++) { st.f[c] = st.b[c] = first_microbatch_of(cfg, s, c); }
    int n = 0;
    n = dualpipev_phase(out, n, cfg->num_microbatches, &st, 2 * (P - r - 1), "F0");
    n = dualpipev_phase(out, n, cfg->num_microbatches, &st, r + 1, "F0 F1");
    n = dualpipev_phase(out, n, cfg->num_microbatches, &st, P - r - 1, "I1 W F1");
    if (r == P - 1) {
        n = dualpipev_phase(out, n, cfg->num_microbatches, &st, 1, "F0 B1 F1&B0");
        n = dualpipev_phase(out, n, cfg->num_microbatches, &st, N - 2 * P + r, "F0&B1 F1&B0");
    } else {
        n = dualpipev_phase(out, n, cfg->num_microbatches, &st, N - 2 * P + r + 1, "F0&B1 F1&B0");
    }
    n = dualpipev_phase(out, n, cfg->num_microbatches, &st, P - r - 1, "B1 F1&B0");
    for (int k = 0; k < 2 * (r + 1); k++) {
        n = dualpipev_phase(out, n, cfg->num_microbatches, &st, 1, k % 2 == 0 ? (k >= r + 1 ? "I1" : "B1") : (k >= r + 1 ? "I0" : "B0"));
    }
    n = dualpipev_phase(out, n, cfg->num_microbatches, &st, P - r - 1, "W I0");
    n = dualpipev_phase(out, n, cfg->num_microbatches, &st, r + 1, "W");
    return n;
}

static int expected_compute(const PipelineConfig* cfg, int s, Computation* out) {
    if (cfg->kind == PP_ZB1) { return expected_zb1(cfg, s, out); }
    if (cfg->kind == PP_ZBV) { return expected_zbv(cfg, s, out); }
    if (cfg->kind == PP_DUALPIPEV || cfg->kind == PP_DUALPIPE) { return expected_dualpipev(cfg, s, out); }
    return expected_one_forward_one_backward(cfg, s, out);
}

// The textbook bound on the (microbatch, chunk) activations a stage holds, each from its F to
// its W (or B): gpipe every microbatch; 1f1b the warmup and one; interleaved Megatron-LM's
// warmup and one; zb1 1F1B's peak, min(S, M), on every stage (the paper: ZB-H1 keeps 1F1B's
// peak memory); zbv the paper's p*M_B, S microbatches of a 1f1b stage's layers = 2S chunks;
// dualpipev DeepSeek's PP + 1 for the DualPipe of PP = 2S ranks it halves; dualpipe PP + 1.
static int textbook_memory_bound(const PipelineConfig* cfg, int s) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    int bound = cfg->kind == PP_GPIPE ? M : cfg->kind == PP_1F1B ? S - s
              : cfg->kind == PP_INTERLEAVED ? 2 * (S - s - 1) + (v - 1) * S + 1 : cfg->kind == PP_ZB1 ? S
              : cfg->kind == PP_DUALPIPEV ? 2 * S + 1 : cfg->kind == PP_DUALPIPE ? S + 1 : 2 * S;
    return bound < v * M ? bound : v * M;
}

// Deterministic pseudo-random numbers in [lo, hi) for simulation costs.
static unsigned long long rng_state = 0x2545F4914F6CDD1DULL;
static double rand_in(double lo, double hi) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return lo + (hi - lo) * (double)(rng_state >> 11) / 9007199254740992.0;
}

// ----------------------------------------------------------------------------------------------
// hand-written schedules

static void check_stage_text(const PipelineConfig* cfg, int s, int with_comm, const char* want) {
    PipelineAction acts[512];
    char err[256], got[4096], name[64];
    describe(name, sizeof(name), cfg);
    int n = pipeline_stage_actions(cfg, s, acts, 512, err, sizeof(err));
    CHECK(n >= 0, "%s stage %d: pipeline_stage_actions failed: %s", name, s, err);
    if (n < 0) { return; }
    format_actions(got, sizeof(got), acts, n, with_comm, cfg->num_chunks > 1);
    CHECK(strcmp(got, want) == 0, "%s stage %d: got\n    %s\n  want\n    %s", name, s, got, want);
}

static void test_hand_written(void) {
    // 1f1b, S=4, M=8. Stage s: warmup min(S-s-1, M) = 3, 2, 1, 0 forwards; then M - warmup
    // pairs (forward of the next microbatch, backward of the oldest); then the remaining backwards.
    PipelineConfig c1 = {4, 8, PP_1F1B, 1};
    check_stage_text(&c1, 0, 0, "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
    check_stage_text(&c1, 1, 0, "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
    check_stage_text(&c1, 2, 0, "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
    check_stage_text(&c1, 3, 0, "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
    // 1f1b with fewer microbatches than stages: warmup min(S-s-1, M) = 2, 2, 1, 0 for S=4, M=2.
    PipelineConfig c2 = {4, 2, PP_1F1B, 1};
    check_stage_text(&c2, 0, 0, "F0 F1 B0 B1");
    check_stage_text(&c2, 2, 0, "F0 F1 B0 B1");
    check_stage_text(&c2, 3, 0, "F0 B0 F1 B1");
    // gpipe: every forward, then every backward in microbatch order.
    PipelineConfig c3 = {3, 4, PP_GPIPE, 1};
    check_stage_text(&c3, 1, 0, "F0 F1 F2 F3 B0 B1 B2 B3");

    // Interleaved, S=2, v=2, M=4: 8 forwards per rank. Table (groups of S=2 microbatches):
    // forward k = 0..7 -> 0c0 1c0 0c1 1c1 2c0 3c0 2c1 3c1; backward k -> 0c1 1c1 0c0 1c0 2c1 3c1 2c0 3c0.
    // Warmup: rank 0: 2*(2-0-1) + (2-1)*2 = 4; rank 1: 0 + 2 = 2.
    PipelineConfig c4 = {2, 4, PP_INTERLEAVED, 2};
    check_stage_text(&c4, 0, 0, "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0");
    check_stage_text(&c4, 1, 0, "F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0");

    // Communication, 1f1b S=2 M=4. Reference timeline (F = 1, B = 2, a computation starts as
    // soon as its stage is free and its input exists):
    //   stage 0: F0 [0,1] F1 [1,2] B0 [4,6] F2 [6,7] B1 [7,9] F3 [9,10] B2 [10,12] B3 [13,15]
    //   stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10] F3 [10,11] B3 [11,13]
    // A message goes at the first time from its producer's end to its consumer's start at which
    // neither stage is inside a computation: activations F0..F3 at 1, 2, 7, 10; gradients B0..B3
    // at 4, 7, 10, 13. Each goes before the computations starting at or after its instant. At 7
    // and 10 both stages have a message each way: a batched pair, forward one first. Stage 1
    // gets F1's activation at 2, before B0 (starting at 2), although it only runs F1 at 4.
    PipelineConfig c5 = {2, 4, PP_1F1B, 1};
    check_stage_text(&c5, 0, 1, "F0 sF0 F1 sF1 rB0 B0 F2 sF2+ rB1 B1 F3 sF3+ rB2 B2 rB3 B3");
    check_stage_text(&c5, 1, 1, "rF0 F0 rF1 B0 sB0 F1 B1 rF2+ sB1 F2 B2 rF3+ sB2 F3 B3 sB3");

    // Communication, gpipe S=3 M=2. Reference timeline:
    //   stage 0: F0 [0,1] F1 [1,2] B0 [8,10] B1 [10,12]
    //   stage 1: F0 [1,2] F1 [2,3] B0 [6,8]  B1 [8,10]
    //   stage 2: F0 [2,3] F1 [3,4] B0 [4,6]  B1 [6,8]
    // Stage 1 at 2: receives F1 from stage 0 (link 0) before sending F0 to stage 2 (link 1); at 8
    // it sends B0's gradient to stage 0 (link 0) before receiving B1's from stage 2 (link 1).
    PipelineConfig c6 = {3, 2, PP_GPIPE, 1};
    check_stage_text(&c6, 0, 1, "F0 sF0 F1 sF1 rB0 B0 rB1 B1");
    check_stage_text(&c6, 1, 1, "rF0 F0 rF1+ sF0 F1 sF1 rB0 B0 sB0+ rB1 B1 sB1");
    check_stage_text(&c6, 2, 1, "rF0 F0 rF1 F1 B0 sB0 B1 sB1");

    // zb1, S=4, M=8: 1f1b's warmup (3, 2, 1, 0 forwards), then per backward j: the next forward
    // while any is left, I(j), and W(j - s) once j >= s; then the W's left.
    PipelineConfig z1 = {4, 8, PP_ZB1, 1};
    check_stage_text(&z1, 0, 0, "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7");
    check_stage_text(&z1, 1, 0, "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7");
    check_stage_text(&z1, 3, 0, "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7");
    // zb1 with M < S (S=4, M=2): stage 2 warms up 1 forward and its W's (j >= 2) never come
    // in the pairs, so both go at the end.
    PipelineConfig z2 = {4, 2, PP_ZB1, 1};
    check_stage_text(&z2, 0, 0, "F0 F1 I0 W0 I1 W1");
    check_stage_text(&z2, 2, 0, "F0 F1 I0 I1 W0 W1");
    check_stage_text(&z2, 3, 0, "F0 I0 F1 I1 W0 W1");
    // Communication, zb1 S=2 M=2. Reference timeline (F = I = W = 1):
    //   stage 0: F0 [0,1] F1 [1,2] I0 [3,4] W0 [4,5] I1 [5,6] W1 [6,7]
    //   stage 1: F0 [1,2] I0 [2,3] F1 [3,4] I1 [4,5] W0 [5,6] W1 [6,7]
    // Nothing has an integer time inside it, so every message goes when it is produced:
    // activations at 1 and 2, gradients at 3 and 5.
    PipelineConfig z3 = {2, 2, PP_ZB1, 1};
    check_stage_text(&z3, 0, 1, "F0 sF0 F1 sF1 rB0 I0 W0 rB1 I1 W1");
    check_stage_text(&z3, 1, 1, "rF0 F0 rF1 I0 sB0 F1 I1 sB1 W0 W1");

    // zbv, S=2, M=4 (N = max(4, 3) = 4). Rank 0: 3 forwards of chunk 0; no (F c1, F c0);
    // 2 x (F I W of c1); steady (F c0 while left, I W c0, F I W c1) twice; 2 x (I c0, W c0).
    // Rank 1: 1 forward of c0; 1 x (F c1, F c0); 1 x (F I W c1); steady twice; 1 x (I c0, I c1);
    // 1 x (I c0, the oldest W of c0); the W left of c1, then of c0.
    PipelineConfig v1 = {2, 4, PP_ZBV, 2};
    check_stage_text(&v1, 0, 0, "F0c0 F1c0 F2c0 F0c1 I0c1 W0c1 F1c1 I1c1 W1c1 F3c0 I0c0 W0c0 F2c1 I2c1 W2c1 "
                                "I1c0 W1c0 F3c1 I3c1 W3c1 I2c0 W2c0 I3c0 W3c0");
    check_stage_text(&v1, 1, 0, "F0c0 F0c1 F1c0 F1c1 I0c1 W0c1 F2c0 I0c0 W0c0 F2c1 I1c1 W1c1 F3c0 I1c0 W1c0 "
                                "F3c1 I2c1 W2c1 I2c0 I3c1 I3c0 W2c0 W3c1 W3c0");
    // zbv, S=3, M=2: the pattern for N = 5 with microbatches 2..4 left out.
    PipelineConfig v2 = {3, 2, PP_ZBV, 2};
    check_stage_text(&v2, 0, 0, "F0c0 F1c0 F0c1 I0c1 W0c1 F1c1 I1c1 W1c1 I0c0 W0c0 I1c0 W1c0");
    // Communication, zbv S=2 M=1: rank 0 holds virtual stages 0 and 3, rank 1 stages 1 and 2.
    // Reference timeline (F = I = W = 1):
    //   rank 0: F0c0 [0,1]  F0c1 [3,4] I0c1 [4,5] W0c1 [5,6]  I0c0 [8,9] W0c0 [9,10]
    //   rank 1: F0c0 [1,2] F0c1 [2,3]  I0c1 [5,6] W0c1 [6,7] I0c0 [7,8] W0c0 [8,9]
    // Rank 1 hands chunk 0's output to its own chunk 1 and chunk 1's input gradient back to
    // chunk 0 without a message; the four messages go when produced (1, 3, 5, 8).
    PipelineConfig v3 = {2, 1, PP_ZBV, 2};
    check_stage_text(&v3, 0, 1, "F0c0 sF0c0 rF0c1 F0c1 I0c1 sB0c1 W0c1 rB0c0 I0c0 W0c0");
    check_stage_text(&v3, 1, 1, "rF0c0 F0c0 F0c1 sF0c1 rB0c1 I0c1 W0c1 I0c0 sB0c0 W0c0");
    // zbv on one stage: every hand-off is local, so there is no message at all. N = 2:
    // 1 forward of c0; 1 x (F I W c1); steady once; 1 x (I c0, W c0).
    PipelineConfig v4 = {1, 2, PP_ZBV, 2};
    check_stage_text(&v4, 0, 1, "F0c0 F0c1 I0c1 W0c1 F1c0 I0c0 W0c0 F1c1 I1c1 W1c1 I1c0 W1c0");

    // dualpipev, S=2, M=4, DeepSeek's phases by hand. Rank 0 (r = 0): F0 x 2; (F0, F1) x 1;
    // (I1, W, F1) x 1; (F0&B1, F1&B0) x (4-4+0+1) = 1; (B1, F1&B0) x 1; (B1, B0) x 1 with the
    // second (B0) split; (W, I0) x 1; W x 1. Rank 1 (the last): no F0 x ..; (F0, F1) x 2; no
    // phase 3; phase 4 twice, the first pair's F0&B1 as F0 then B1; no phase 5; (B1, B0) x 2,
    // the last two split; no phase 7; W x 2.
    PipelineConfig d1 = {2, 4, PP_DUALPIPEV, 2};
    static const char* const dualpipev_ranks[2] = {
        "F0c0 F1c0 F2c0 F0c1 I0c1 W0c1 F1c1 F3c0&B1c1 F2c1&B0c0 B2c1 F3c1&B1c0 B3c1 I2c0 W2c0 I3c0 W3c0",
        "F0c0 F0c1 F1c0 F1c1 F2c0 B0c1 F2c1&B0c0 F3c0&B1c1 F3c1&B1c0 B2c1 B2c0 I3c1 I3c0 W3c1 W3c0"};
    for (int r = 0; r < 2; r++) { check_stage_text(&d1, r, 0, dualpipev_ranks[r]); }
    // dualpipev on one stage: both hand-offs are local, no message at all; N = 2: (F0, F1);
    // phase 4 once, its first pair not overlapped (rank 0 is the last rank); (B1, B0), B0 split; W.
    PipelineConfig d2 = {1, 2, PP_DUALPIPEV, 2};
    check_stage_text(&d2, 0, 1, "F0c0 F0c1 F1c0 B0c1 F1c1&B0c0 B1c1 I1c0 W1c0");
    // dualpipe, S=2, M=4: both ranks run rank 0's phases of a one-rank dualpipev with N = 2 (the
    // list above), rank 0's chunk 0 on microbatches 0, 1 (they enter at rank 0, model stage 0)
    // and its chunk 1 on 2, 3 (they enter at rank 1 and end at rank 0, model stage 1); rank 1
    // the mirror: chunk 0 = model stage 0 on 2, 3, chunk 1 = model stage 1 on 0, 1.
    PipelineConfig d3 = {2, 4, PP_DUALPIPE, 2};
    check_stage_text(&d3, 0, 0, "F0c0 F2c1 F1c0 B2c1 F3c1&B0c0 B3c1 I1c0 W1c0");
    check_stage_text(&d3, 1, 0, "F2c0 F0c1 F3c0 B0c1 F1c1&B2c0 B1c1 I3c0 W3c0");
}

// ----------------------------------------------------------------------------------------------
// properties of every schedule

// Time of a computation of `kind` on stage s under the given costs (I = backward - weight).
static double cost_of(PipelineActionKind kind, int s, const double* fwd, const double* bwd, const double* wgt) {
    double w = wgt != NULL ? wgt[s] : bwd[s] / 2.0;
    if (kind == PP_FORWARD_BACKWARD) { return fwd[s] + bwd[s]; }  // nothing hidden, the simulator's default
    return kind == PP_FORWARD ? fwd[s] : kind == PP_BACKWARD_INPUT ? bwd[s] - w : kind == PP_BACKWARD_WEIGHT ? w : bwd[s];
}

// Checks the timeline of a successful simulation against the schedule: each computation lasts
// its cost and starts after everything before it on its stage and after its input arrived
// (transfer after its producer ended, or right after it when handed off on the same stage): F
// after the F of the previous virtual stage, B or I after the B or I of the next one, W after
// its own I; makespan and idle time add up.
static void check_timeline(const char* name, const char* model, const PipelineSchedule* sch, const PipelineTimeline* tl,
                           const double* fwd, const double* bwd, const double* wgt, double transfer) {
    const PipelineConfig* cfg = &sch->cfg;
    int S = cfg->num_stages, M = cfg->num_microbatches, V = model_stages(cfg);
    double* fwd_end = (double*)calloc((size_t)V * M, sizeof(double));
    double* bwd_end = (double*)calloc((size_t)V * M, sizeof(double));
    double makespan = 0.0;
    for (int s = 0; s < S; s++) {
        double busy = 0.0, free_at = 0.0;
        for (int i = sch->offset[s]; i < sch->offset[s + 1]; i++) {
            const PipelineAction* a = &sch->actions[i];
            if (tl->end[i] > makespan) { makespan = tl->end[i]; }
            if (!is_compute(a->kind)) {
                CHECK(tl->end[i] >= tl->start[i], "%s %s stage %d action %d: ends before it starts", name, model, s, i);
                continue;
            }
            double cost = cost_of(a->kind, s, fwd, bwd, wgt);
            busy += cost;
            CHECK(fabs(tl->end[i] - tl->start[i] - cost) <= 1e-9, "%s %s stage %d action %d: lasts %g, cost %g",
                  name, model, s, i, tl->end[i] - tl->start[i], cost);
            CHECK(tl->start[i] >= free_at - 1e-9, "%s %s stage %d action %d: starts at %g before the stage is free at %g",
                  name, model, s, i, tl->start[i], free_at);
            free_at = tl->end[i];
            PipelineAction halves[2];
            for (int h = 0, nh = unpair(a, halves); h < nh; h++) {
                int u = virtual_stage_of(cfg, s, halves[h].chunk) * M + halves[h].microbatch;
                if (halves[h].kind == PP_FORWARD) { fwd_end[u] = tl->end[i]; }
                if (halves[h].kind == PP_BACKWARD || halves[h].kind == PP_BACKWARD_INPUT) { bwd_end[u] = tl->end[i]; }
            }
        }
        CHECK(fabs(tl->busy[s] - busy) <= 1e-9 && fabs(tl->idle[s] - (tl->makespan - busy)) <= 1e-9,
              "%s %s stage %d: busy %g idle %g, expected %g and %g", name, model, s, tl->busy[s], tl->idle[s], busy,
              tl->makespan - busy);
    }
    CHECK(fabs(tl->makespan - makespan) <= 1e-9, "%s %s: makespan %g, last action ends at %g", name, model, tl->makespan,
          makespan);
    for (int s = 0; s < S; s++) {
        for (int i = sch->offset[s]; i < sch->offset[s + 1]; i++) {
          PipelineAction halves[2];
          for (int h = 0, nh = unpair(&sch->actions[i], halves); h < nh; h++) {
            const PipelineAction* a = &halves[h];
            int vs = virtual_stage_of(cfg, s, a->chunk), u = vs * M + a->microbatch;
            if (a->kind == PP_FORWARD && vs > 0) {
                double ready = fwd_end[u - M] + (neighbour_of(cfg, s, a->chunk, -1) == s ? 0.0 : transfer);
                CHECK(tl->start[i] >= ready - 1e-9, "%s %s stage %d: F%d chunk %d starts at %g before its input is "
                      "there at %g", name, model, s, a->microbatch, a->chunk, tl->start[i], ready);
            }
            if ((a->kind == PP_BACKWARD || a->kind == PP_BACKWARD_INPUT) && vs < V - 1) {
                double ready = bwd_end[u + M] + (neighbour_of(cfg, s, a->chunk, +1) == s ? 0.0 : transfer);
                CHECK(tl->start[i] >= ready - 1e-9, "%s %s stage %d: backward %d chunk %d starts at %g before its "
                      "gradient is there at %g", name, model, s, a->microbatch, a->chunk, tl->start[i], ready);
            }
            if (a->kind == PP_BACKWARD || a->kind == PP_BACKWARD_INPUT) {
                CHECK(tl->start[i] >= fwd_end[u] - 1e-9, "%s %s stage %d: backward %d chunk %d starts before its "
                      "forward ends", name, model, s, a->microbatch, a->chunk);
            }
            if (a->kind == PP_BACKWARD_WEIGHT) {
                CHECK(tl->start[i] >= bwd_end[u] - 1e-9, "%s %s stage %d: W%d chunk %d starts at %g before its I ends "
                      "at %g", name, model, s, a->microbatch, a->chunk, tl->start[i], bwd_end[u]);
            }
          }
        }
    }
    free(fwd_end);
    free(bwd_end);
}

// Simulates under every communication model; checks no deadlock, a consistent timeline, and
// that rendezvous is the slowest: eager runs the same order without senders waiting, batched
// posts runs of sends/receives at once. (Eager and batched are not ordered: eager still posts a
// send only after the receive before it completes.) Returns the rendezvous, batched and eager
// makespans and bubbles in [0], [1], [2]; with `busy_span`, also each stage's time from its
// first computation's start to its last one's end under rendezvous ([S]).
static void simulate_all_models(const char* name, const PipelineSchedule* sch, const double* fwd, const double* bwd,
                                const double* wgt, double transfer, double* makespan, double* bubble,
                                double* busy_span) {
    static const PipelineCommModel models[3] = {PP_COMM_RENDEZVOUS, PP_COMM_BATCHED, PP_COMM_EAGER};
    static const char* model_names[3] = {"rendezvous", "batched", "eager"};
    for (int m = 0; m < 3; m++) {
        PipelineCosts costs = {fwd, bwd, transfer, models[m], wgt, NULL};
        PipelineTimeline tl;
        char err[1024];
        makespan[m] = NAN;
        int rc = pipeline_simulate(sch, &costs, &tl, err, sizeof(err));
        CHECK(rc == 0, "%s: simulation with %s sends failed: %s", name, model_names[m], err);
        if (rc != 0) { continue; }
        check_timeline(name, model_names[m], sch, &tl, fwd, bwd, wgt, transfer);
        makespan[m] = tl.makespan;
        bubble[m] = pipeline_timeline_bubble(&tl);
        for (int s = 0; s < sch->cfg.num_stages && busy_span != NULL && m == 0; s++) {
            double first = INFINITY, last = 0.0;
            for (int i = sch->offset[s]; i < sch->offset[s + 1]; i++) {
                if (!is_compute(sch->actions[i].kind)) { continue; }
                first = tl.start[i] < first ? tl.start[i] : first;
                last = tl.end[i] > last ? tl.end[i] : last;
            }
            busy_span[s] = last - first;
        }
        pipeline_timeline_free(&tl);
    }
    CHECK(makespan[2] <= makespan[0] + 1e-9 && makespan[1] <= makespan[0] + 1e-9,
          "%s: makespans eager %g or batched %g exceed rendezvous %g", name, makespan[2], makespan[1], makespan[0]);
}

// Textbook makespan with unit costs: F = 1 and B = 2, or F = I = W = 1 when the backward is split.
//   gpipe, 1f1b   (M + S - 1) * 3: M forward+backward slots plus S-1 to fill and drain.
//   interleaved   (v*M + S - 1) * 3 in chunk units (Megatron-LM: bubble (S-1)/(v*M) of the
//                 ideal v*M*3).
//   zb1           3M + S - 1 when M >= S: the paper's bubble (p-1)(T_F + T_B - T_W) = S-1 on
//                 top of 3M. With M < S: the last stage alternates F and I (its W's deferred past
//                 the end) from S-1, so the last gradient leaves it at S-1 + 2M, crosses S-1
//                 stages back and stage 0 runs one W: 2M + 2S - 1, the larger of the two.
//   zbv           6M + S - 1 when the V's pattern runs in full: every rank busy without a gap
//                 (the paper's zero bubble in the steady state) from when microbatch 0 reaches it
//                 (rank s at s). With few microbatches 4M + 4S - 2, the larger of the two:
//                 microbatch 0's gradient reaches rank S-1 at 3S-1 (2S-1 forwards, the last
//                 stage's F and I, S-2 more I's), rank S-1 then runs I and W of both its chunks per
//                 microbatch (4 units), and the last gradient crosses S-1 ranks back before rank
//                 0's last W.
//   dualpipev     6M + 2(S-1): 6M units of work on every rank plus DeepSeek's bubble
//                 (PP/2-1)(F&B + B - 3W) for PP = 2S, with F&B = F + B = 3 (nothing hidden),
//                 B = 2, W = 1: (S-1)(3 + 2 - 3).
//   dualpipe      3M + S - 2: each rank runs M/2 microbatches on each chunk (3M units), plus
//                 DeepSeek's (PP/2-1)(F&B + B - 3W) = (S/2 - 1)(3 + 2 - 3).
static double textbook_makespan(const PipelineConfig* cfg) {
    double S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks;
    switch (cfg->kind) {
        case PP_DUALPIPE: return 3.0 * M + S - 2.0;
        case PP_DUALPIPEV: return 6.0 * M + 2.0 * (S - 1.0);
        case PP_ZB1: return fmax(3.0 * M + S - 1.0, 2.0 * M + 2.0 * S - 1.0);
        case PP_ZBV: return fmax(6.0 * M + S - 1.0, 4.0 * M + 4.0 * S - 2.0);
        default: return (v * M + S - 1.0) * 3.0;
    }
}

static void test_schedule(const PipelineConfig* cfg) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks, V = model_stages(cfg);
    int split = splits_backward(cfg->kind), split_all = splits_every_backward(cfg->kind);
    char name[64], err[512];
    describe(name, sizeof(name), cfg);
    PipelineSchedule sch;
    int rc = pipeline_schedule_build(&sch, cfg, err, sizeof(err));
    CHECK(rc == 0, "%s: pipeline_schedule_build failed: %s", name, err);
    if (rc != 0) { return; }

    Computation* want = (Computation*)malloc(sizeof(Computation) * 3 * v * M);
    PipelineAction* flat = (PipelineAction*)malloc(sizeof(PipelineAction) * (pipeline_max_actions(cfg) + v * M));
    for (int s = 0; s < S; s++) {
        const PipelineAction* listed = sch.actions + sch.offset[s];
        int listed_n = sch.offset[s + 1] - sch.offset[s];
        // most checks read the list with each F&B as its F, then its B (its messages come before
        // and after both)
        const PipelineAction* acts = flat;
        int n = 0;
        for (int i = 0; i < listed_n; i++) { n += unpair(&listed[i], flat + n); }

        // the per-stage API gives the same list, and its count query agrees
        PipelineAction* one = (PipelineAction*)malloc(sizeof(PipelineAction) * (n + 1));
        int count = pipeline_stage_actions(cfg, s, NULL, 0, err, sizeof(err));
        int got = pipeline_stage_actions(cfg, s, one, listed_n + 1, err, sizeof(err));
        CHECK(count == listed_n && got == listed_n && memcmp(one, listed, sizeof(PipelineAction) * listed_n) == 0,
              "%s stage %d: pipeline_stage_actions (count %d, got %d) differs from pipeline_schedule_build (%d)",
              name, s, count, got, listed_n);
        CHECK(listed_n <= pipeline_max_actions(cfg), "%s stage %d: %d actions, more than pipeline_max_actions %d", name,
              s, listed_n, pipeline_max_actions(cfg));
        free(one);

        // compute order: exactly the definition (an F&B with both its halves)
        int wanted = expected_compute(cfg, s, want);
        int k = 0, order_ok = 1;
        for (int i = 0; i < listed_n; i++) {
            const PipelineAction* a = &listed[i];
            if (!is_compute(a->kind)) {
                order_ok &= a->backward_microbatch == -1 && a->backward_chunk == -1;
                continue;
            }
            if (k >= wanted || a->kind != want[k].kind || a->microbatch != want[k].microbatch ||
                a->chunk != want[k].chunk || a->peer != -1 || a->backward_microbatch != want[k].backward_microbatch ||
                a->backward_chunk != want[k].backward_chunk) {
                order_ok = 0;
            }
            k++;
        }
        CHECK(order_ok && k == wanted, "%s stage %d: compute order differs from the definition", name, s);

        // each (microbatch, chunk) exactly once: F, then B (or I, then W; zb1 and zbv always split,
        // dualpipev sometimes, the others never); per chunk the F's, the B's and I's, and the W's
        // each in microbatch order, so weight gradients sum the microbatches in one rank's order
        for (int c = 0; c < v; c++) {
            int first = first_microbatch_of(cfg, s, c), last = first + microbatches_of(cfg);
            int next_f = first, next_b = first, inputs = 0, weights = 0, last_w = -1, ok = 1;
            char* input_done = (char*)calloc((size_t)M, 1);
            for (int i = 0; i < n; i++) {
                if (acts[i].chunk != c || !is_compute(acts[i].kind)) { continue; }
                PipelineActionKind kind = acts[i].kind;
                int mb = acts[i].microbatch;
                if (kind == PP_FORWARD) { ok &= mb == next_f++; }
                if (kind == PP_BACKWARD || kind == PP_BACKWARD_INPUT) {
                    ok &= mb == next_b++ && next_b <= next_f;
                    ok &= kind == PP_BACKWARD ? !split_all : split;
                    if (kind == PP_BACKWARD_INPUT) { input_done[mb] = 1; inputs++; }
                }
                if (kind == PP_BACKWARD_WEIGHT) {
                    ok &= split && input_done[mb] && mb > last_w;
                    last_w = mb;
                    weights++;
                }
            }
            free(input_done);
            CHECK(ok && next_f == last && next_b == last && weights == inputs && inputs == (split_all ? M : inputs) &&
                  (split || inputs == 0), "%s stage %d chunk %d: computations not each once, in microbatch order, F "
                  "before %s", name, s, c, split ? "I before W" : "B");
        }

        // communication around each computation: a FORWARD whose previous virtual stage is on
        // another stage has exactly one RECV_FORWARD of it before it, one whose next virtual
        // stage is on another stage one SEND_FORWARD after it; likewise RECV_BACKWARD before /
        // SEND_BACKWARD after the B or I. A hand-off to a virtual stage on the same stage has no
        // message, and its producer comes first in the list. Nothing else.
        int* seen = (int*)calloc((size_t)4 * v * M, sizeof(int));  // [kind: rF sF rB sB][chunk][mb]
        char* computed = (char*)calloc((size_t)2 * v * M, 1);       // [forward, input backward][chunk][mb]
        int ok = 1;
        for (int i = 0; i < n; i++) {
            const PipelineAction* a = &acts[i];
            int vs = virtual_stage_of(cfg, s, a->chunk), u = a->chunk * M + a->microbatch;
            int prev = neighbour_of(cfg, s, a->chunk, -1), next = neighbour_of(cfg, s, a->chunk, +1);
            int slot = a->kind == PP_RECV_FORWARD ? 0 : a->kind == PP_SEND_FORWARD ? 1
                     : a->kind == PP_RECV_BACKWARD ? 2 : a->kind == PP_SEND_BACKWARD ? 3 : -1;
            if (slot >= 0) {
                seen[slot * v * M + u]++;
                int want_peer = (slot == 0 || slot == 3) ? prev : next;
                const char* expected = want_peer < 0 ? "no such action on this boundary"
                                     : want_peer == s ? "no message for a hand-off on the same stage"
                                                      : "the neighbouring virtual stage's rank";
                CHECK(want_peer >= 0 && want_peer != s && a->peer == want_peer, "%s stage %d action %d: %s of microbatch "
                      "%d chunk %d: peer %d, expected %s", name, s, i, pipeline_action_kind_name(a->kind),
                      a->microbatch, a->chunk, a->peer, expected);
                // sends after the computation that produces them
                if (slot == 1) { ok &= computed[u]; }
                if (slot == 3) { ok &= computed[v * M + u]; }
            }
            if (a->kind == PP_FORWARD) {
                ok &= vs == 0 || (prev == s ? computed[chunk_of(cfg, s, vs - 1) * M + a->microbatch] == 1
                                            : seen[0 * v * M + u] == 1);
                computed[u] = 1;
            }
            if (a->kind == PP_BACKWARD || a->kind == PP_BACKWARD_INPUT) {
                ok &= vs == V - 1 || (next == s ? computed[v * M + chunk_of(cfg, s, vs + 1) * M + a->microbatch] == 1
                                                : seen[2 * v * M + u] == 1);
                computed[v * M + u] = 1;
            }
        }
        for (int c = 0; c < v; c++) {
            int prev = neighbour_of(cfg, s, c, -1), next = neighbour_of(cfg, s, c, +1);
            int first = first_microbatch_of(cfg, s, c), last = first + microbatches_of(cfg);
            for (int i = 0; i < M; i++) {
                int u = c * M + i, mine = i >= first && i < last;
                int remote_prev = mine && prev >= 0 && prev != s, remote_next = mine && next >= 0 && next != s;
                ok &= seen[0 * v * M + u] == remote_prev && seen[3 * v * M + u] == remote_prev;
                ok &= seen[1 * v * M + u] == remote_next && seen[2 * v * M + u] == remote_next;
            }
        }
        CHECK(ok, "%s stage %d: sends/receives are not exactly one per boundary crossing between stages, receives "
              "before use and sends after production, or a local hand-off comes before its producer", name, s);
        free(seen);
        free(computed);

        // post_with_next only joins sends/receives
        for (int i = 0; i < listed_n; i++) {
            if (!listed[i].post_with_next) { continue; }
            int comm_next = i + 1 < listed_n && !is_compute(listed[i + 1].kind);
            CHECK(!is_compute(listed[i].kind) && comm_next, "%s stage %d action %d: post_with_next joins a computation",
                  name, s, i);
        }

        // activations held: from F to W, or to B when whole (an F&B holds both its halves' at once)
        int held = 0, most = 0;
        for (int i = 0; i < n; i++) {
            held += acts[i].kind == PP_FORWARD;
            if (held > most) { most = held; }
            held -= acts[i].kind == PP_BACKWARD_WEIGHT || acts[i].kind == PP_BACKWARD;
        }
        int bound = textbook_memory_bound(cfg, s);
        CHECK(pipeline_max_in_flight(listed, listed_n) == most, "%s stage %d: pipeline_max_in_flight %d, counted %d",
              name, s, pipeline_max_in_flight(listed, listed_n), most);
        CHECK(pipeline_memory_bound(cfg, s) == bound, "%s stage %d: pipeline_memory_bound %d, textbook %d", name, s,
              pipeline_memory_bound(cfg, s), bound);
        CHECK(most <= bound, "%s stage %d: holds %d (microbatch, chunk) activations, more than the textbook %d", name, s,
              most, bound);
        // the bound is reached (zbv: once the V's pattern has all its microbatches)
        if (cfg->kind != PP_ZBV || M >= 2 * S - 1) {
            CHECK(most == bound, "%s stage %d: holds at most %d, the textbook peak is %d", name, s, most, bound);
        }

        // Megatron-LM's 1f1b pairing from the second steady-state pair on: right after F(w+k)
        // a batched (send F(w+k) to s+1, receive B(k)'s gradient from s+1); right after B(k)
        // a batched (receive F(w+k+1)'s input from s-1, send B(k)'s gradient to s-1).
        if (cfg->kind == PP_1F1B) {
            int w = S - s - 1 < M ? S - s - 1 : M;
            for (int pair = 1; pair < M - w; pair++) {
                int f = -1, b = -1;
                for (int i = 0; i < n; i++) {
                    if (acts[i].kind == PP_FORWARD && acts[i].microbatch == w + pair) { f = i; }
                    if (acts[i].kind == PP_BACKWARD && acts[i].microbatch == pair) { b = i; }
                }
                if (s < S - 1) {
                    CHECK(f + 2 < n && acts[f + 1].kind == PP_SEND_FORWARD && acts[f + 1].microbatch == w + pair &&
                          acts[f + 1].post_with_next && acts[f + 2].kind == PP_RECV_BACKWARD &&
                          acts[f + 2].microbatch == pair && !acts[f + 2].post_with_next,
                          "%s stage %d: steady pair %d: F%d is not followed by the batch sF%d+ rB%d", name, s, pair,
                          w + pair, w + pair, pair);
                }
                if (s > 0 && pair < M - w - 1) {
                    CHECK(b + 2 < n && acts[b + 1].kind == PP_RECV_FORWARD && acts[b + 1].microbatch == w + pair + 1 &&
                          acts[b + 1].post_with_next && acts[b + 2].kind == PP_SEND_BACKWARD &&
                          acts[b + 2].microbatch == pair && !acts[b + 2].post_with_next,
                          "%s stage %d: steady pair %d: B%d is not followed by the batch rF%d+ sB%d", name, s, pair,
                          pair, w + pair + 1, pair);
                }
            }
        }
    }
    free(want);
    free(flat);

    // sends and receives match across stages: for every ordered pair of stages (a, b), the
    // messages a sends to b, in a's order, are the messages b receives from a, in b's order.
    // A message is (direction, microbatch, sending virtual stage).
    for (int a = 0; a < S; a++) {
        for (int b = 0; b < S; b++) {
            int ia = sch.offset[a], ib = sch.offset[b], match = 1, sends = 0;
            for (;;) {
                while (ia < sch.offset[a + 1] && !((sch.actions[ia].kind == PP_SEND_FORWARD ||
                                                    sch.actions[ia].kind == PP_SEND_BACKWARD) && sch.actions[ia].peer == b)) {
                    ia++;
                }
                while (ib < sch.offset[b + 1] && !((sch.actions[ib].kind == PP_RECV_FORWARD ||
                                                    sch.actions[ib].kind == PP_RECV_BACKWARD) && sch.actions[ib].peer == a)) {
                    ib++;
                }
                int a_done = ia >= sch.offset[a + 1], b_done = ib >= sch.offset[b + 1];
                if (a_done || b_done) { match &= a_done && b_done; break; }
                const PipelineAction* x = &sch.actions[ia];
                const PipelineAction* y = &sch.actions[ib];
                int x_fwd = x->kind == PP_SEND_FORWARD, y_fwd = y->kind == PP_RECV_FORWARD;
                int sender_vs = virtual_stage_of(cfg, a, x->chunk);
                int receiver_vs = virtual_stage_of(cfg, b, y->chunk);
                match &= x_fwd == y_fwd && x->microbatch == y->microbatch &&
                         receiver_vs == (x_fwd ? sender_vs + 1 : sender_vs - 1);
                ia++;
                ib++;
                sends++;
            }
            CHECK(match, "%s: the sends of stage %d to stage %d and the receives of stage %d from stage %d differ "
                  "(after %d matching messages)", name, a, b, b, a, sends);
        }
    }

    // unit costs (f = 1, b = 2, so w = i = 1 when split; and scaled by 0.5, exact in binary):
    // the textbook makespan. gpipe, 1f1b, zb1 and zbv reach it with every communication model,
    // interleaved with eager (non-blocking) sends.
    double fwd[16], bwd[16], wgt[16], makespan[3], bubble[3], span[16];
    double units[2] = {1.0, 0.5};
    // per stage, in units: F + B = F + I + W = 3 per (microbatch, chunk) it runs
    double busy = 3.0 * v * microbatches_of(cfg);
    for (int t = 0; t < 2; t++) {
        for (int s = 0; s < S; s++) { fwd[s] = units[t]; bwd[s] = 2.0 * units[t]; wgt[s] = units[t]; }
        // the default split (NULL: half the backward) and an explicit W = f give the same timeline
        for (int explicit_weight = 0; explicit_weight <= split; explicit_weight++) {
            simulate_all_models(name, &sch, fwd, bwd, explicit_weight ? wgt : NULL, 0.0, makespan, bubble, span);
            double T = textbook_makespan(cfg);
            double want_time = T * units[t], want_bubble = (T - busy) / T;
            int first = cfg->kind == PP_INTERLEAVED ? 2 : 0;
            for (int m = first; m < 3; m++) {
                CHECK(makespan[m] == want_time, "%s: unit %g: makespan %g (model %d), textbook %g", name, units[t],
                      makespan[m], m, want_time);
                CHECK(fabs(bubble[m] - want_bubble) <= 1e-9, "%s: simulated bubble %g, textbook %g", name, bubble[m],
                      want_bubble);
            }
            if (cfg->kind == PP_INTERLEAVED) {
                double megatron = (makespan[2] / units[t] - busy) / busy;
                CHECK(fabs(megatron - (double)(S - 1) / (v * M)) <= 1e-9, "%s: bubble over ideal time %g, Megatron-LM's "
                      "(S-1)/(v*M) = %g", name, megatron, (double)(S - 1) / (v * M));
            }
            // zero bubble in the steady state: once the V's pattern runs in full, every rank computes
            // without a gap from its first computation to its last; ZB-H1 with M >= S idles S-1
            // units on every stage (the paper's (p-1)(T_F + T_B - T_W))
            for (int s = 0; s < S && cfg->kind == PP_ZBV && M >= 2 * S - 1; s++) {
                CHECK(fabs(span[s] - busy * units[t]) <= 1e-9, "%s rank %d: computes for %g within %g: a gap", name,
                      s, busy * units[t], span[s]);
            }
            if (cfg->kind == PP_ZB1 && M >= S) {
                CHECK(fabs(bubble[0] * S * makespan[0] - S * (S - 1) * units[t]) <= 1e-9, "%s: idle time %g in all, "
                      "expected S-1 units on each stage", name, bubble[0] * S * makespan[0]);
            }
        }
    }
    double T = textbook_makespan(cfg);
    CHECK(fabs(pipeline_bubble_fraction(cfg) - (T - busy) / T) <= 1e-12, "%s: modelled bubble %g, textbook %g", name,
          pipeline_bubble_fraction(cfg), (T - busy) / T);
    // When stage 0 starts its first backward (f = 1, b = 2): 1f1b sends microbatch 0 straight
    // through (S forwards, every stage has it in time) and its gradient back over S-1 stages:
    // S + 2*(S-1). gpipe first runs all M forwards on the last stage: (M+S-1) + 2*(S-1).
    if (cfg->kind == PP_GPIPE || cfg->kind == PP_1F1B) {
        for (int s = 0; s < S; s++) { fwd[s] = 1.0; bwd[s] = 2.0; }
        PipelineCosts costs = {fwd, bwd, 0.0, PP_COMM_RENDEZVOUS, NULL, NULL};
        PipelineTimeline tl;
        if (pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)) == 0) {
            double want_time = (cfg->kind == PP_1F1B ? S : M + S - 1) + 2.0 * (S - 1), got = -1.0;
            for (int i = sch.offset[0]; i < sch.offset[1]; i++) {
                if (sch.actions[i].kind == PP_BACKWARD && sch.actions[i].microbatch == 0) { got = tl.start[i]; }
            }
            CHECK(got == want_time, "%s: stage 0 starts B0 at %g, expected %g", name, got, want_time);
            pipeline_timeline_free(&tl);
        }
    }

    // measured per-stage costs, in any ratio (W anywhere from nothing to the whole backward),
    // with transfer time: still no deadlock, and a timeline that respects every dependency
    for (int s = 0; s < S; s++) {
        fwd[s] = rand_in(0.5, 1.5);
        bwd[s] = rand_in(0.5, 3.5);
        wgt[s] = rand_in(0.0, 1.0) * bwd[s];
    }
    simulate_all_models(name, &sch, fwd, bwd, split ? wgt : NULL, rand_in(0.0, 0.3), makespan, bubble, NULL);
    pipeline_schedule_free(&sch);
}

static void test_all_schedules(void) {
    for (int S = 1; S <= 8; S++) {
        for (int M = 1; M <= 16; M++) {
            PipelineConfig g = {S, M, PP_GPIPE, 1};
            PipelineConfig f = {S, M, PP_1F1B, 1};
            PipelineConfig z = {S, M, PP_ZB1, 1};
            PipelineConfig zv = {S, M, PP_ZBV, 2};
            test_schedule(&g);
            test_schedule(&f);
            test_schedule(&z);
            test_schedule(&zv);
            for (int v = 2; v <= 4; v++) {
                PipelineConfig i = {S, M, PP_INTERLEAVED, v};
                if (S >= 2 && M % S == 0) { test_schedule(&i); }
            }
        }
        // DualPipeV needs M >= 2S (its phases have 2S microbatches in flight)
        for (int M = 2 * S; M <= 32; M++) {
            PipelineConfig dv = {S, M, PP_DUALPIPEV, 2};
            PipelineConfig dp = {S, M, PP_DUALPIPE, 2};
            test_schedule(&dv);
            if (S % 2 == 0 && M % 2 == 0) { test_schedule(&dp); }   // its requirements
        }
    }
}

// ----------------------------------------------------------------------------------------------
// layer partition and placement

static double stage_cost(const int* first, int S, int s, double e, double h) {
    return (first[s + 1] - first[s]) + (s == 0 ? e : 0.0) + (s == S - 1 ? h : 0.0);
}

// Smallest possible maximum stage cost over all contiguous partitions (>= 1 layer per stage
// when L >= S), by trying every partition.
static double best_bottleneck(int L, int S, int s, int first, double e, double h, int min_layers) {
    if (s == S - 1) {
        int n = L - first;
        if (n < min_layers) { return INFINITY; }
        return n + (S == 1 ? e : 0.0) + h;
    }
    double best = INFINITY;
    for (int n = min_layers; first + n <= L; n++) {
        double here = n + (s == 0 ? e : 0.0);
        double rest = best_bottleneck(L, S, s + 1, first + n, e, h, min_layers);
        double worst = here > rest ? here : rest;
        if (worst < best) { best = worst; }
    }
    return best;
}

static void test_partition(void) {
    static const double item_costs[] = {0.0, 0.25, 1.0, 2.5, 50304.0 / (12.0 * 768.0), 20.0};
    int first[16], again[16];
    char err[256];
    for (int L = 1; L <= 40; L++) {
        for (int S = 1; S <= 12; S++) {
            for (int ie = 0; ie < 6; ie++) {
                for (int ih = 0; ih < 6; ih++) {
                    double e = item_costs[ie], h = item_costs[ih];
                    int rc = pipeline_partition_layers(L, S, e, h, first, err, sizeof(err));
                    CHECK(rc == 0, "partition L=%d S=%d e=%g h=%g: failed: %s", L, S, e, h, err);
                    if (rc != 0) { continue; }
                    int ok = first[0] == 0 && first[S] == L;
                    double lo = INFINITY, hi = -INFINITY;
                    for (int s = 0; s < S; s++) {
                        int n = first[s + 1] - first[s];
                        ok &= n >= (L >= S ? 1 : 0);
                        double c = stage_cost(first, S, s, e, h);
                        lo = c < lo ? c : lo;
                        hi = c > hi ? c : hi;
                    }
                    double largest = e > h ? e : h;
                    largest = largest > 1.0 ? largest : 1.0;
                    CHECK(ok, "partition L=%d S=%d e=%g h=%g: not contiguous ranges covering 0..L with >= 1 layer each",
                          L, S, e, h);
                    CHECK(hi - lo <= largest + 1e-9, "partition L=%d S=%d e=%g h=%g: stage costs %g..%g differ by more "
                          "than the largest item %g", L, S, e, h, lo, hi, largest);
                    pipeline_partition_layers(L, S, e, h, again, err, sizeof(err));
                    CHECK(memcmp(first, again, sizeof(int) * (S + 1)) == 0, "partition L=%d S=%d: not deterministic", L, S);
                    if (L <= 14 && S <= 5) {
                        double best = best_bottleneck(L, S, 0, 0, e, h, L >= S ? 1 : 0);
                        CHECK(fabs(hi - best) <= 1e-9, "partition L=%d S=%d e=%g h=%g: most expensive stage %g, best "
                              "possible %g", L, S, e, h, hi, best);
                    }
                }
            }
        }
    }
    // By hand. 12 layers, 4 stages, no extra cost: 3 each.
    int want1[] = {0, 3, 6, 9, 12};
    pipeline_partition_layers(12, 4, 0.0, 0.0, first, err, sizeof(err));
    CHECK(memcmp(first, want1, sizeof(want1)) == 0, "partition 12 layers / 4 stages: got %d %d %d %d %d", first[0],
          first[1], first[2], first[3], first[4]);
    // 10 layers, 4 stages: one each, then the 6 left go to the cheapest stage, ties to the later
    // stage: 3, 2, 1, 0, 3, 2 -> 2, 2, 3, 3 layers.
    int want2[] = {0, 2, 4, 7, 10};
    pipeline_partition_layers(10, 4, 0.0, 0.0, first, err, sizeof(err));
    CHECK(memcmp(first, want2, sizeof(want2)) == 0, "partition 10 layers / 4 stages: got %d %d %d %d %d", first[0],
          first[1], first[2], first[3], first[4]);
    // 12 layers, 4 stages, head = 3: start 1,1,1,1 (costs 1,1,1,4); the 8 left go to stages
    // 2,1,0,2,1,0,2,1 -> 3,4,4,1 layers, costs 3,4,4,4.
    int want3[] = {0, 3, 7, 11, 12};
    pipeline_partition_layers(12, 4, 0.0, 3.0, first, err, sizeof(err));
    CHECK(memcmp(first, want3, sizeof(want3)) == 0, "partition 12 layers / 4 stages / head 3: got %d %d %d %d %d",
          first[0], first[1], first[2], first[3], first[4]);
    // 2 layers, 4 stages (fewer layers than stages): 0 each, then stages 3 and 2 get one.
    int want4[] = {0, 0, 0, 1, 2};
    pipeline_partition_layers(2, 4, 0.0, 0.0, first, err, sizeof(err));
    CHECK(memcmp(first, want4, sizeof(want4)) == 0, "partition 2 layers / 4 stages: got %d %d %d %d %d", first[0],
          first[1], first[2], first[3], first[4]);
}

static void expect_error(int rc, const char* err, const char* needle, const char* what) {
    CHECK(rc == -1, "%s: accepted (returned %d), expected an error", what, rc);
    CHECK(rc != -1 || strstr(err, needle) != NULL, "%s: message '%s' does not mention '%s'", what, err, needle);
}

// Placement: chunk c of stage s holds virtual stage virtual_stage_of(s, c) of the balanced
// partition into S*v pieces, the embedding with virtual stage 0 and the head with the last.
static void test_placement(void) {
    static const PipelineScheduleKind kinds[] = {PP_GPIPE, PP_1F1B, PP_INTERLEAVED, PP_ZB1, PP_ZBV, PP_DUALPIPEV,
                                                 PP_DUALPIPE};
    ChunkPlace out[64];
    int first[65];
    char err[256], name[64];
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        for (int S = 1; S <= 8; S++) {
            for (int v = 1; v <= 4; v++) {
                PipelineConfig cfg = {S, 2 * S, kinds[k], v};
                if (pipeline_check_config(&cfg, NULL, 0) != 0) { continue; }
                describe(name, sizeof(name), &cfg);
                int ok = 1;
                for (int s = 0; s < S; s++) {
                    for (int c = 0; c < v; c++) {
                        int vs = virtual_stage_of(&cfg, s, c), owner = -1, owner_chunk = -1;
                        // the copy running microbatch first_microbatch_of(s, c) of vs is this one
                        pipeline_unit_owner(&cfg, vs, first_microbatch_of(&cfg, s, c), &owner, &owner_chunk);
                        ok &= pipeline_virtual_stage(&cfg, s, c) == vs && owner == s && owner_chunk == c;
                        ok &= pipeline_neighbour_stage(&cfg, s, c, -1) == neighbour_of(&cfg, s, c, -1);
                        ok &= pipeline_neighbour_stage(&cfg, s, c, +1) == neighbour_of(&cfg, s, c, +1);
                    }
                }
                CHECK(ok, "%s: virtual stages, their owners or neighbours differ from the definition", name);
                for (int L = 1; L <= 48; L += 5) {
                    double head = L % 3 == 0 ? 5.46 : 0.0;
                    int rc = pipeline_place_layers(&cfg, L, 0.25, head, out, err, sizeof(err));
                    CHECK(rc == 0, "%s L=%d: pipeline_place_layers failed: %s", name, L, err);
                    if (rc != 0) { continue; }
                    pipeline_partition_layers(L, model_stages(&cfg), 0.25, head, first, err, sizeof(err));
                    int ok = 1, covered = 0;
                    for (int s = 0; s < S; s++) {
                        for (int c = 0; c < v; c++) {
                            const ChunkPlace* p = &out[s * v + c];
                            int vs = virtual_stage_of(&cfg, s, c);
                            ok &= p->virtual_stage == vs && p->first_layer == first[vs] &&
                                  p->last_layer == first[vs + 1] && p->has_embedding == (vs == 0) &&
                                  p->has_head == (vs == model_stages(&cfg) - 1);
                            covered += p->last_layer - p->first_layer;
                        }
                    }
                    // dualpipe holds every piece twice
                    int copies = cfg.kind == PP_DUALPIPE ? 2 : 1;
                    CHECK(ok && covered == copies * L, "%s L=%d: the chunks do not hold the balanced pieces in "
                          "V/round-robin order", name, L);
                }
            }
        }
    }
    // By hand, 8 layers in 4 pieces of 2. zbv S=2: rank 0 holds pieces 0 and 3 (layers 0-1
    // with the embedding, 6-7 with the head), rank 1 pieces 1 and 2. Interleaved S=2 v=2:
    // rank 0 pieces 0 and 2, rank 1 pieces 1 and 3.
    PipelineConfig zbv = {2, 4, PP_ZBV, 2};
    pipeline_place_layers(&zbv, 8, 0.0, 0.0, out, err, sizeof(err));
    CHECK(out[0].first_layer == 0 && out[0].has_embedding && out[1].first_layer == 6 && out[1].has_head &&
          out[2].first_layer == 2 && out[3].first_layer == 4 && out[3].last_layer - out[3].first_layer == 2 && !out[3].has_head,
          "zbv S=2, 8 layers: got rank 0 at %d and %d, rank 1 at %d and %d", out[0].first_layer, out[1].first_layer,
          out[2].first_layer, out[3].first_layer);
    PipelineConfig il = {2, 4, PP_INTERLEAVED, 2};
    pipeline_place_layers(&il, 8, 0.0, 0.0, out, err, sizeof(err));
    CHECK(out[0].first_layer == 0 && out[1].first_layer == 4 && out[2].first_layer == 2 && out[3].first_layer == 6 &&
          out[3].has_head, "interleaved S=2 v=2, 8 layers: got rank 0 at %d and %d, rank 1 at %d and %d",
          out[0].first_layer, out[1].first_layer, out[2].first_layer, out[3].first_layer);
    expect_error(pipeline_place_layers(&zbv, 0, 0.0, 0.0, out, err, sizeof(err)), err, "layers", "placement of 0 layers");
    PipelineConfig bad = {2, 4, PP_ZBV, 3};
    expect_error(pipeline_place_layers(&bad, 8, 0.0, 0.0, out, err, sizeof(err)), err, "chunks", "zbv with 3 chunks");
}

// ----------------------------------------------------------------------------------------------
// invalid inputs are rejected with a message

static void test_invalid_inputs(void) {
    char err[512];
    PipelineScheduleKind kind = PP_GPIPE;
    err[0] = '\0';
    expect_error(pipeline_parse_schedule("2f2b", &kind, err, sizeof(err)), err, "2f2b", "schedule name 2f2b");
    expect_error(pipeline_parse_schedule("", &kind, err, sizeof(err)), err, "unknown", "empty schedule name");
    CHECK(pipeline_parse_schedule("1f1b", &kind, err, sizeof(err)) == 0 && kind == PP_1F1B, "1f1b is not parsed");
    CHECK(pipeline_parse_schedule("gpipe", &kind, err, sizeof(err)) == 0 && kind == PP_GPIPE, "gpipe is not parsed");
    CHECK(pipeline_parse_schedule("interleaved", &kind, err, sizeof(err)) == 0 && kind == PP_INTERLEAVED,
          "interleaved is not parsed");
    CHECK(pipeline_parse_schedule("zb1", &kind, err, sizeof(err)) == 0 && kind == PP_ZB1, "zb1 is not parsed");
    CHECK(pipeline_parse_schedule("zbv", &kind, err, sizeof(err)) == 0 && kind == PP_ZBV, "zbv is not parsed");
    CHECK(pipeline_parse_schedule("dualpipev", &kind, err, sizeof(err)) == 0 && kind == PP_DUALPIPEV,
          "dualpipev is not parsed");
    CHECK(pipeline_parse_schedule("dualpipe", &kind, err, sizeof(err)) == 0 && kind == PP_DUALPIPE,
          "dualpipe is not parsed");

    struct { PipelineConfig cfg; const char* needle; const char* what; } bad[] = {
        {{0, 4, PP_1F1B, 1}, "stages", "1f1b S=0"},
        {{-2, 4, PP_GPIPE, 1}, "stages", "gpipe S=-2"},
        {{4, 0, PP_1F1B, 1}, "microbatches", "1f1b M=0"},
        {{4, -1, PP_GPIPE, 1}, "microbatches", "gpipe M=-1"},
        {{4, 8, PP_1F1B, 2}, "chunks", "1f1b with 2 chunks"},
        {{4, 8, PP_INTERLEAVED, 1}, "chunks", "interleaved with 1 chunk"},
        {{1, 8, PP_INTERLEAVED, 2}, "stages", "interleaved S=1"},
        {{4, 6, PP_INTERLEAVED, 2}, "multiple", "interleaved M=6 S=4"},
        {{4, 8, PP_ZB1, 2}, "chunks", "zb1 with 2 chunks"},
        {{4, 8, PP_ZBV, 1}, "chunks", "zbv with 1 chunk"},
        {{4, 8, PP_ZBV, 4}, "chunks", "zbv with 4 chunks"},
        {{4, 0, PP_ZBV, 2}, "microbatches", "zbv M=0"},
        {{4, 7, PP_DUALPIPEV, 2}, "at least 2 x stages = 8 microbatches, got 7", "dualpipev M < 2S"},
        {{2, 4, PP_DUALPIPEV, 1}, "chunks must be 2", "dualpipev with 1 chunk"},
        {{3, 12, PP_DUALPIPE, 2}, "an even number of stages, got 3", "dualpipe on 3 stages"},
        {{4, 9, PP_DUALPIPE, 2}, "an even number of microbatches, at least 2 x stages = 8, got 9", "dualpipe M odd"},
        {{4, 6, PP_DUALPIPE, 2}, "at least 2 x stages = 8, got 6", "dualpipe M < 2S"},
        {{4, 8, (PipelineScheduleKind)7, 1}, "unknown", "schedule kind 7"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        PipelineSchedule sch;
        PipelineAction acts[64];
        err[0] = '\0';
        expect_error(pipeline_check_config(&bad[i].cfg, err, sizeof(err)), err, bad[i].needle, bad[i].what);
        err[0] = '\0';
        expect_error(pipeline_schedule_build(&sch, &bad[i].cfg, err, sizeof(err)), err, bad[i].needle, bad[i].what);
        CHECK(sch.actions == NULL && sch.offset == NULL, "%s: a failed build leaves memory behind", bad[i].what);
        err[0] = '\0';
        expect_error(pipeline_stage_actions(&bad[i].cfg, 0, acts, 64, err, sizeof(err)), err, bad[i].needle, bad[i].what);
    }
    PipelineConfig ok = {4, 8, PP_1F1B, 1};
    PipelineAction acts[8];
    expect_error(pipeline_stage_actions(&ok, 4, NULL, 0, err, sizeof(err)), err, "stage 4", "stage 4 of 4");
    expect_error(pipeline_stage_actions(&ok, -1, NULL, 0, err, sizeof(err)), err, "stage -1", "stage -1");
    expect_error(pipeline_stage_actions(&ok, 0, acts, 8, err, sizeof(err)), err, "buffer", "a buffer of 8 actions");
    CHECK(pipeline_check_config(&ok, NULL, 0) == 0, "1f1b S=4 M=8 is rejected");
    CHECK(pipeline_stage_actions(&ok, 0, NULL, 0, NULL, 0) > 0, "a count query without an error buffer fails");

    int first[8];
    expect_error(pipeline_partition_layers(0, 4, 0.0, 0.0, first, err, sizeof(err)), err, "layers", "partition L=0");
    expect_error(pipeline_partition_layers(12, 0, 0.0, 0.0, first, err, sizeof(err)), err, "stages", "partition S=0");
    expect_error(pipeline_partition_layers(12, 4, -1.0, 0.0, first, err, sizeof(err)), err, "embedding", "embedding cost -1");
    expect_error(pipeline_partition_layers(12, 4, 0.0, NAN, first, err, sizeof(err)), err, "head", "head cost NaN");

    PipelineSchedule sch;
    pipeline_schedule_build(&sch, &ok, err, sizeof(err));
    double f[4] = {1, 1, 1, 1}, b[4] = {2, 2, -2, 2};
    PipelineCosts costs = {f, b, 0.0, PP_COMM_EAGER, NULL, NULL};
    PipelineTimeline tl;
    expect_error(pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)), err, "stage 2", "a negative backward time");
    b[2] = 2;
    costs.transfer = NAN;
    expect_error(pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)), err, "transfer", "a NaN transfer time");
    costs.transfer = 0.0;
    double w[4] = {1, 1, 2.5, 1};
    costs.weight = w;
    expect_error(pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)), err, "weight", "a W longer than the backward");
    w[2] = -0.5;
    expect_error(pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)), err, "stage 2", "a negative W time");
    pipeline_schedule_free(&sch);
}

// ----------------------------------------------------------------------------------------------
// the simulator on hand-made lists: deadlocks and invalid schedules are reported, not hung on

static int simulate_lists(const PipelineConfig* cfg, const char* const* stages, PipelineCommModel comm, char* err,
                          size_t errlen) {
    PipelineAction acts[256];
    int offset[9];
    offset[0] = 0;
    for (int s = 0; s < cfg->num_stages; s++) {
        offset[s + 1] = offset[s] + parse_actions(stages[s], cfg, s, acts + offset[s]);
    }
    PipelineSchedule sch;
    sch.cfg = *cfg;
    sch.offset = offset;
    sch.actions = acts;
    double f[8] = {1, 1, 1, 1, 1, 1, 1, 1}, b[8] = {2, 2, 2, 2, 2, 2, 2, 2};
    PipelineCosts costs = {f, b, 0.0, comm, NULL, NULL};
    PipelineTimeline tl;
    err[0] = '\0';
    int rc = pipeline_simulate(&sch, &costs, &tl, err, errlen);
    if (rc == 0) { pipeline_timeline_free(&tl); }
    return rc;
}

// Hand-made lists for a one-chunk pipeline of S stages.
static int simulate_text(int S, int M, const char* const* stages, PipelineCommModel comm, char* err, size_t errlen) {
    PipelineConfig cfg = {S, M, PP_1F1B, 1};
    return simulate_lists(&cfg, stages, comm, err, errlen);
}

static void test_simulator_rejects(void) {
    char err[1024];
    // Both stages receive first: stage 0 waits for a gradient, stage 1 for an activation.
    const char* recv_first[] = {"rB0 F0 sF0 B0", "rF0 F0 B0 sB0"};
    for (int m = 0; m < 3; m++) {
        expect_error(simulate_text(2, 1, recv_first, (PipelineCommModel)m, err, sizeof(err)), err, "deadlock",
                     "receive-receive cycle");
        CHECK(strstr(err, "stage 0 action 0") && strstr(err, "stage 1 action 0"),
              "the deadlock message does not name both blocked stages: %s", err);
    }
    // Both stages send first while the other is not receiving: fine if sends are buffered
    // (eager), a deadlock if a send waits for its receiver (rendezvous). Stage 0 sends F1 while
    // stage 1 sends B0; each receives only afterwards.
    const char* send_first[] = {"F0 sF0 F1 sF1 rB0 B0 rB1 B1", "rF0 F0 B0 sB0 rF1 F1 B1 sB1"};
    CHECK(simulate_text(2, 2, send_first, PP_COMM_EAGER, err, sizeof(err)) == 0, "send-send with eager sends: %s", err);
    expect_error(simulate_text(2, 2, send_first, PP_COMM_RENDEZVOUS, err, sizeof(err)), err, "deadlock",
                 "send-send cycle with rendezvous sends");
    // The same exchange posted as batches (sF1 with rB0, sB0 with rF1) completes under rendezvous.
    const char* batched[] = {"F0 sF0 F1 sF1+ rB0 B0 rB1 B1", "rF0 F0 B0 sB0+ rF1 F1 B1 sB1"};
    CHECK(simulate_text(2, 2, batched, PP_COMM_BATCHED, err, sizeof(err)) == 0, "batched exchange: %s", err);
    expect_error(simulate_text(2, 2, batched, PP_COMM_RENDEZVOUS, err, sizeof(err)), err, "deadlock",
                 "the batched exchange run one message at a time with rendezvous sends");

    // invalid schedules
    const char* early_forward[] = {"F0 sF0 rB0 B0", "F0 rF0 B0 sB0"};
    expect_error(simulate_text(2, 1, early_forward, PP_COMM_EAGER, err, sizeof(err)), err, "before its input",
                 "a forward before its receive");
    const char* early_backward[] = {"B0 F0", ""};
    expect_error(simulate_text(1, 1, early_backward, PP_COMM_EAGER, err, sizeof(err)), err, "before its forward",
                 "a backward before its forward");
    const char* early_send[] = {"sF0 F0 rB0 B0", "rF0 F0 B0 sB0"};
    expect_error(simulate_text(2, 1, early_send, PP_COMM_EAGER, err, sizeof(err)), err, "produces",
                 "a send before its computation");
    const char* missing[] = {"F0 B0 F1"};
    expect_error(simulate_text(1, 2, missing, PP_COMM_EAGER, err, sizeof(err)), err, "never runs", "a missing backward");
    const char* twice[] = {"F0 B0 F0 B0"};
    expect_error(simulate_text(1, 1, twice, PP_COMM_EAGER, err, sizeof(err)), err, "second time", "a computation twice");
    const char* boundary[] = {"rF0 F0 B0"};
    expect_error(simulate_text(1, 1, boundary, PP_COMM_EAGER, err, sizeof(err)), err, "neighbour",
                 "a receive on the first stage");
    const char* bad_batch[] = {"F0+ B0"};
    expect_error(simulate_text(1, 1, bad_batch, PP_COMM_BATCHED, err, sizeof(err)), err, "post_with_next",
                 "post_with_next on a computation");
    const char* bad_mb[] = {"F0 B0 F5 B5"};
    expect_error(simulate_text(1, 2, bad_mb, PP_COMM_EAGER, err, sizeof(err)), err, "microbatch 5",
                 "a microbatch out of range");

    // split backward
    const char* split_ok[] = {"F0 I0 F1 I1 W1 W0"};
    CHECK(simulate_text(1, 2, split_ok, PP_COMM_EAGER, err, sizeof(err)) == 0, "W's in any order after their I: %s", err);
    const char* early_weight[] = {"F0 W0 I0"};
    expect_error(simulate_text(1, 1, early_weight, PP_COMM_EAGER, err, sizeof(err)), err, "before its BACKWARD_INPUT",
                 "a W before its I");
    const char* weight_after_full[] = {"F0 B0 W0"};
    expect_error(simulate_text(1, 1, weight_after_full, PP_COMM_EAGER, err, sizeof(err)), err, "second time",
                 "a W after a full backward");
    const char* no_weight[] = {"F0 I0"};
    expect_error(simulate_text(1, 1, no_weight, PP_COMM_EAGER, err, sizeof(err)), err, "never runs the BACKWARD_WEIGHT",
                 "a missing W");
    const char* early_gradient_send[] = {"F0 sF0 rB0 I0 W0", "rF0 F0 sB0 I0 W0"};
    expect_error(simulate_text(2, 1, early_gradient_send, PP_COMM_EAGER, err, sizeof(err)), err, "produces",
                 "a gradient sent before the I that computes it");

    // local hand-offs (zbv on one stage: virtual stages 0 and 1 both on stage 0)
    PipelineConfig v1 = {1, 1, PP_ZBV, 2};
    const char* local_ok[] = {"F0c0 F0c1 I0c1 W0c1 I0c0 W0c0"};
    CHECK(simulate_lists(&v1, local_ok, PP_COMM_RENDEZVOUS, err, sizeof(err)) == 0, "zbv S=1: %s", err);
    const char* local_early_forward[] = {"F0c1 F0c0 I0c1 W0c1 I0c0 W0c0"};
    expect_error(simulate_lists(&v1, local_early_forward, PP_COMM_EAGER, err, sizeof(err)), err, "same stage",
                 "chunk 1's forward before chunk 0's on the same stage");
    const char* local_early_backward[] = {"F0c0 F0c1 I0c0 I0c1 W0c1 W0c0"};
    expect_error(simulate_lists(&v1, local_early_backward, PP_COMM_EAGER, err, sizeof(err)), err, "same stage",
                 "chunk 0's backward before chunk 1's on the same stage");
    const char* self_message[] = {"F0c0 sF0c0 rF0c1 F0c1 I0c1 W0c1 I0c0 W0c0"};
    expect_error(simulate_lists(&v1, self_message, PP_COMM_EAGER, err, sizeof(err)), err, "local hand-off",
                 "a message from a stage to itself");
}

int main(void) {
    test_hand_written();
    test_all_schedules();
    test_partition();
    test_placement();
    test_invalid_inputs();
    test_simulator_rejects();
    if (failures > 0) {
        printf("test_pipeline: %d of %d checks FAILED\n", failures, checks);
        return 1;
    }
    printf("test_pipeline: all %d checks passed\n", checks);
    return 0;
}
