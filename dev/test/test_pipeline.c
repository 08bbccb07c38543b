/*
 * Unit tests for llmc/pipeline.h: pipeline schedules, their communication, the simulator, the
 * bubble model and the layer partition.
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

#include "llmc/pipeline.h"

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
    return kind == PP_GPIPE ? "gpipe" : kind == PP_1F1B ? "1f1b" : "interleaved";
}

static void describe(char* buf, size_t len, const PipelineConfig* cfg) {
    if (cfg->kind == PP_INTERLEAVED) {
        snprintf(buf, len, "%s S=%d M=%d v=%d", kind_name(cfg->kind), cfg->num_stages, cfg->num_microbatches,
                 cfg->num_chunks);
    } else {
        snprintf(buf, len, "%s S=%d M=%d", kind_name(cfg->kind), cfg->num_stages, cfg->num_microbatches);
    }
}

// Tokens: F3 B3 computations; rF3 sF3 rB3 sB3 receive/send forward activation or backward
// gradient; "c1" for chunk 1 when with_chunk; a trailing "+" marks post_with_next.
static void format_actions(char* buf, size_t len, const PipelineAction* a, int n, int with_comm, int with_chunk) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && used < len; i++) {
        const char* p = NULL;
        switch (a[i].kind) {
            case PP_FORWARD: p = "F"; break;
            case PP_BACKWARD: p = "B"; break;
            case PP_RECV_FORWARD: p = "rF"; break;
            case PP_SEND_FORWARD: p = "sF"; break;
            case PP_RECV_BACKWARD: p = "rB"; break;
            case PP_SEND_BACKWARD: p = "sB"; break;
        }
        int compute = a[i].kind == PP_FORWARD || a[i].kind == PP_BACKWARD;
        if (!compute && !with_comm) { continue; }
        char chunk[16] = "";
        if (with_chunk) { snprintf(chunk, sizeof(chunk), "c%d", a[i].chunk); }
        used += (size_t)snprintf(buf + used, len - used, "%s%s%d%s%s", used ? " " : "", p, a[i].microbatch, chunk,
                                 with_comm && a[i].post_with_next ? "+" : "");
    }
}

// Parses tokens in the format above into actions of stage s of a 1-chunk pipeline of S stages.
static int parse_actions(const char* text, int s, PipelineAction* out) {
    int n = 0;
    const char* p = text;
    while (*p) {
        while (*p == ' ') { p++; }
        if (!*p) { break; }
        PipelineAction a;
        memset(&a, 0, sizeof(a));
        int recv = *p == 'r', send = *p == 's';
        if (recv || send) { p++; }
        int fwd = *p++ == 'F';
        a.kind = recv ? (fwd ? PP_RECV_FORWARD : PP_RECV_BACKWARD)
               : send ? (fwd ? PP_SEND_FORWARD : PP_SEND_BACKWARD)
                      : (fwd ? PP_FORWARD : PP_BACKWARD);
        a.microbatch = (int)strtol(p, (char**)&p, 10);
        a.peer = (recv && fwd) || (send && !fwd) ? s - 1 : (recv || send) ? s + 1 : -1;
        if (*p == '+') { a.post_with_next = 1; p++; }
        out[n++] = a;
    }
    return n;
}

// Expected compute order from the definitions in the task: gpipe = all forwards then all
// backwards; 1f1b = warmup min(S-s-1, M) forwards, M - warmup (forward, backward) pairs, then
// the remaining backwards; interleaved = Megatron-LM's table (groups of S microbatches; forward
// k is microbatch (k / (S*v))*S + k % S on chunk (k % (S*v)) / S, backwards run chunks reversed),
// warmup min(2*(S-s-1) + (v-1)*S, v*M).
static int expected_compute(const PipelineConfig* cfg, int s, int* is_fwd, int* mb, int* chunk) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks, n = v * M;
    int warmup = cfg->kind == PP_GPIPE ? n : cfg->kind == PP_1F1B ? S - s - 1 : 2 * (S - s - 1) + (v - 1) * S;
    if (warmup > n) { warmup = n; }
    int count = 0;
    int f = 0, b = 0;  // next forward, next backward unit
    for (int i = 0; i < warmup; i++) { is_fwd[count++] = 1; f++; }
    for (int i = 0; i < n - warmup; i++) { is_fwd[count++] = 1; is_fwd[count++] = 0; f++; b++; }
    while (b < n) { is_fwd[count++] = 0; b++; }
    f = b = 0;
    for (int i = 0; i < count; i++) {
        int k = is_fwd[i] ? f++ : b++;
        int in_group = k % (S * v);
        mb[i] = (k / (S * v)) * S + in_group % S;
        chunk[i] = is_fwd[i] ? in_group / S : v - 1 - in_group / S;
    }
    return count;
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
}

// ----------------------------------------------------------------------------------------------
// properties of every schedule

// Checks the timeline of a successful simulation against the schedule: each computation lasts
// its cost and starts after everything before it on its stage and after its input arrived;
// makespan and idle time add up.
static void check_timeline(const char* name, const char* model, const PipelineSchedule* sch, const PipelineTimeline* tl,
                           const double* fwd, const double* bwd, double transfer) {
    const PipelineConfig* cfg = &sch->cfg;
    int S = cfg->num_stages, M = cfg->num_microbatches, V = S * cfg->num_chunks;
    double* fwd_end = (double*)calloc((size_t)V * M, sizeof(double));
    double* bwd_end = (double*)calloc((size_t)V * M, sizeof(double));
    double makespan = 0.0;
    for (int s = 0; s < S; s++) {
        double busy = 0.0, free_at = 0.0;
        for (int i = sch->offset[s]; i < sch->offset[s + 1]; i++) {
            const PipelineAction* a = &sch->actions[i];
            if (tl->end[i] > makespan) { makespan = tl->end[i]; }
            if (a->kind != PP_FORWARD && a->kind != PP_BACKWARD) {
                CHECK(tl->end[i] >= tl->start[i], "%s %s stage %d action %d: ends before it starts", name, model, s, i);
                continue;
            }
            double cost = a->kind == PP_FORWARD ? fwd[s] : bwd[s];
            busy += cost;
            CHECK(fabs(tl->end[i] - tl->start[i] - cost) <= 1e-9, "%s %s stage %d action %d: lasts %g, cost %g",
                  name, model, s, i, tl->end[i] - tl->start[i], cost);
            CHECK(tl->start[i] >= free_at - 1e-9, "%s %s stage %d action %d: starts at %g before the stage is free at %g",
                  name, model, s, i, tl->start[i], free_at);
            free_at = tl->end[i];
            int vs = a->chunk * S + s;
            (a->kind == PP_FORWARD ? fwd_end : bwd_end)[vs * M + a->microbatch] = tl->end[i];
        }
        CHECK(fabs(tl->busy[s] - busy) <= 1e-9 && fabs(tl->idle[s] - (tl->makespan - busy)) <= 1e-9,
              "%s %s stage %d: busy %g idle %g, expected %g and %g", name, model, s, tl->busy[s], tl->idle[s], busy,
              tl->makespan - busy);
    }
    CHECK(fabs(tl->makespan - makespan) <= 1e-9, "%s %s: makespan %g, last action ends at %g", name, model, tl->makespan,
          makespan);
    // dependencies across stages: input activation and output gradient arrive transfer after
    // the producer ends (the stage-local order above covers the rest)
    for (int s = 0; s < S; s++) {
        for (int i = sch->offset[s]; i < sch->offset[s + 1]; i++) {
            const PipelineAction* a = &sch->actions[i];
            int u = (a->chunk * S + s) * M + a->microbatch;
            if (a->kind == PP_FORWARD && u >= M) {
                CHECK(tl->start[i] >= fwd_end[u - M] + transfer - 1e-9, "%s %s stage %d: F%d starts at %g before its input "
                      "arrives at %g", name, model, s, a->microbatch, tl->start[i], fwd_end[u - M] + transfer);
            }
            if (a->kind == PP_BACKWARD && u < (V - 1) * M) {
                CHECK(tl->start[i] >= bwd_end[u + M] + transfer - 1e-9, "%s %s stage %d: B%d starts at %g before its "
                      "gradient arrives at %g", name, model, s, a->microbatch, tl->start[i], bwd_end[u + M] + transfer);
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
// makespans and bubbles in [0], [1], [2].
static void simulate_all_models(const char* name, const PipelineSchedule* sch, const double* fwd, const double* bwd,
                                double transfer, double* makespan, double* bubble) {
    static const PipelineCommModel models[3] = {PP_COMM_RENDEZVOUS, PP_COMM_BATCHED, PP_COMM_EAGER};
    static const char* model_names[3] = {"rendezvous", "batched", "eager"};
    for (int m = 0; m < 3; m++) {
        PipelineCosts costs = {fwd, bwd, transfer, models[m]};
        PipelineTimeline tl;
        char err[1024];
        makespan[m] = NAN;
        int rc = pipeline_simulate(sch, &costs, &tl, err, sizeof(err));
        CHECK(rc == 0, "%s: simulation with %s sends failed: %s", name, model_names[m], err);
        if (rc != 0) { continue; }
        check_timeline(name, model_names[m], sch, &tl, fwd, bwd, transfer);
        makespan[m] = tl.makespan;
        bubble[m] = pipeline_timeline_bubble(&tl);
        pipeline_timeline_free(&tl);
    }
    CHECK(makespan[2] <= makespan[0] + 1e-9 && makespan[1] <= makespan[0] + 1e-9,
          "%s: makespans eager %g or batched %g exceed rendezvous %g", name, makespan[2], makespan[1], makespan[0]);
}

static void test_schedule(const PipelineConfig* cfg) {
    int S = cfg->num_stages, M = cfg->num_microbatches, v = cfg->num_chunks, V = S * v;
    char name[64], err[512];
    describe(name, sizeof(name), cfg);
    PipelineSchedule sch;
    int rc = pipeline_schedule_build(&sch, cfg, err, sizeof(err));
    CHECK(rc == 0, "%s: pipeline_schedule_build failed: %s", name, err);
    if (rc != 0) { return; }

    int* is_fwd = (int*)malloc(sizeof(int) * 2 * v * M);
    int* mb = (int*)malloc(sizeof(int) * 2 * v * M);
    int* chunk = (int*)malloc(sizeof(int) * 2 * v * M);
    for (int s = 0; s < S; s++) {
        const PipelineAction* acts = sch.actions + sch.offset[s];
        int n = sch.offset[s + 1] - sch.offset[s];

        // the per-stage API gives the same list, and its count query agrees
        PipelineAction* one = (PipelineAction*)malloc(sizeof(PipelineAction) * (n + 1));
        int count = pipeline_stage_actions(cfg, s, NULL, 0, err, sizeof(err));
        int got = pipeline_stage_actions(cfg, s, one, n + 1, err, sizeof(err));
        CHECK(count == n && got == n && memcmp(one, acts, sizeof(PipelineAction) * n) == 0,
              "%s stage %d: pipeline_stage_actions (count %d, got %d) differs from pipeline_schedule_build (%d)",
              name, s, count, got, n);
        free(one);

        // compute order: exactly the definition
        int want = expected_compute(cfg, s, is_fwd, mb, chunk);
        int k = 0, order_ok = 1;
        for (int i = 0; i < n; i++) {
            if (acts[i].kind != PP_FORWARD && acts[i].kind != PP_BACKWARD) { continue; }
            if (k >= want || (acts[i].kind == PP_FORWARD) != is_fwd[k] || acts[i].microbatch != mb[k] ||
                acts[i].chunk != chunk[k] || acts[i].peer != -1) {
                order_ok = 0;
            }
            k++;
        }
        CHECK(order_ok && k == want, "%s stage %d: compute order differs from the definition", name, s);

        // each (microbatch, chunk) forward and backward exactly once, F before B, forwards and
        // backwards of a chunk in microbatch order
        for (int c = 0; c < v; c++) {
            int next_f = 0, next_b = 0, ok = 1;
            for (int i = 0; i < n; i++) {
                if (acts[i].chunk != c) { continue; }
                if (acts[i].kind == PP_FORWARD) { ok &= acts[i].microbatch == next_f++; }
                if (acts[i].kind == PP_BACKWARD) { ok &= acts[i].microbatch == next_b++ && next_b <= next_f; }
            }
            CHECK(ok && next_f == M && next_b == M, "%s stage %d chunk %d: forwards/backwards not each once, in "
                  "microbatch order, F before B", name, s, c);
        }

        // communication around each computation: a FORWARD off virtual stage 0 has exactly one
        // RECV_FORWARD of it before it, one off the last virtual stage one SEND_FORWARD after it;
        // likewise RECV_BACKWARD before / SEND_BACKWARD after a BACKWARD. Nothing else.
        int* seen = (int*)calloc((size_t)4 * v * M, sizeof(int));  // [kind: rF sF rB sB][chunk][mb]
        int ok = 1;
        for (int i = 0; i < n; i++) {
            const PipelineAction* a = &acts[i];
            int vs = a->chunk * S + s, u = a->chunk * M + a->microbatch;
            int slot = a->kind == PP_RECV_FORWARD ? 0 : a->kind == PP_SEND_FORWARD ? 1
                     : a->kind == PP_RECV_BACKWARD ? 2 : a->kind == PP_SEND_BACKWARD ? 3 : -1;
            if (slot >= 0) {
                seen[slot * v * M + u]++;
                int want_peer = (slot == 0 || slot == 3) ? (vs - 1 + S) % S : (vs + 1) % S;
                int exists = (slot == 0 || slot == 3) ? vs > 0 : vs < V - 1;
                CHECK(exists && a->peer == want_peer, "%s stage %d action %d: %s of microbatch %d chunk %d: peer %d, "
                      "expected %s", name, s, i, pipeline_action_kind_name(a->kind), a->microbatch, a->chunk, a->peer,
                      exists ? "the neighbouring virtual stage's rank" : "no such action on this boundary");
                // sends after the computation that produces them
                if (slot == 1 || slot == 3) {
                    int produced = 0;
                    for (int j = 0; j < i; j++) {
                        produced |= acts[j].kind == (slot == 1 ? PP_FORWARD : PP_BACKWARD) &&
                                    acts[j].microbatch == a->microbatch && acts[j].chunk == a->chunk;
                    }
                    ok &= produced;
                }
            }
            if (a->kind == PP_FORWARD) { ok &= vs == 0 || seen[0 * v * M + u] == 1; }
            if (a->kind == PP_BACKWARD) { ok &= vs == V - 1 || seen[2 * v * M + u] == 1; }
        }
        for (int c = 0; c < v; c++) {
            int vs = c * S + s;
            for (int i = 0; i < M; i++) {
                int u = c * M + i;
                ok &= seen[0 * v * M + u] == (vs > 0) && seen[3 * v * M + u] == (vs > 0);
                ok &= seen[1 * v * M + u] == (vs < V - 1) && seen[2 * v * M + u] == (vs < V - 1);
            }
        }
        CHECK(ok, "%s stage %d: sends/receives are not exactly one per boundary crossing, receives before use and "
              "sends after production", name, s);
        free(seen);

        // post_with_next only joins sends/receives
        for (int i = 0; i < n; i++) {
            if (!acts[i].post_with_next) { continue; }
            int comm_here = acts[i].kind != PP_FORWARD && acts[i].kind != PP_BACKWARD;
            int comm_next = i + 1 < n && acts[i + 1].kind != PP_FORWARD && acts[i + 1].kind != PP_BACKWARD;
            CHECK(comm_here && comm_next, "%s stage %d action %d: post_with_next joins a computation", name, s, i);
        }

        // activations held: forwards done minus backwards done
        int held = 0, most = 0;
        for (int i = 0; i < n; i++) {
            held += (acts[i].kind == PP_FORWARD) - (acts[i].kind == PP_BACKWARD);
            if (held > most) { most = held; }
        }
        CHECK(pipeline_max_in_flight(acts, n) == most, "%s stage %d: pipeline_max_in_flight %d, counted %d", name, s,
              pipeline_max_in_flight(acts, n), most);
        if (cfg->kind == PP_1F1B) {
            int bound = S - s < M ? S - s : M;
            CHECK(most <= bound, "%s stage %d: holds %d microbatches, more than min(S-s, M) = %d", name, s, most, bound);
            CHECK(most == bound, "%s stage %d: holds at most %d microbatches; warmup + 1 = min(S-s, M) = %d", name, s,
                  most, bound);
        } else if (cfg->kind == PP_GPIPE) {
            CHECK(most == M, "%s stage %d: holds %d microbatches, gpipe holds M = %d", name, s, most, M);
        } else {
            int warmup = 2 * (S - s - 1) + (v - 1) * S;
            int bound = warmup + 1 < v * M ? warmup + 1 : v * M;
            CHECK(most == bound, "%s stage %d: holds %d chunk-microbatches, expected min(warmup + 1, v*M) = %d",
                  name, s, most, bound);
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
    free(is_fwd);
    free(mb);
    free(chunk);

    // sends and receives match across neighbours: for every ordered pair of stages (a, b), the
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
                int sender_vs = x->chunk * S + a;
                int receiver_vs = y->chunk * S + b;
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

    // uniform costs f and b = 2f: the textbook makespan (v*M + S - 1)*(f + b) (v = 1 but
    // interleaved, where f and b are per chunk), so the bubble is (S-1)/(v*M + S-1). gpipe and
    // 1f1b reach it with every communication model; interleaved with eager (non-blocking) sends.
    double fwd[16], bwd[16], makespan[3], bubble[3];
    double units[2] = {1.0, 0.5};  // 0.5: exact in binary too
    for (int t = 0; t < 2; t++) {
        for (int s = 0; s < S; s++) { fwd[s] = units[t]; bwd[s] = 2.0 * units[t]; }
        simulate_all_models(name, &sch, fwd, bwd, 0.0, makespan, bubble);
        double want = (double)(v * M + S - 1) * 3.0 * units[t];
        double want_bubble = (double)(S - 1) / (double)(v * M + S - 1);
        int first = cfg->kind == PP_INTERLEAVED ? 2 : 0;
        for (int m = first; m < 3; m++) {
            CHECK(makespan[m] == want, "%s: f=%g b=%g: makespan %g (model %d), textbook %g", name, units[t],
                  2 * units[t], makespan[m], m, want);
            CHECK(fabs(bubble[m] - want_bubble) <= 1e-9, "%s: simulated bubble %g, expected (S-1)/(vM+S-1) = %g", name,
                  bubble[m], want_bubble);
        }
    }
    // When stage 0 starts its first backward (f = 1, b = 2): 1f1b sends microbatch 0 straight
    // through (S forwards, every stage has it in time) and its gradient back over S-1 stages:
    // S + 2*(S-1). gpipe first runs all M forwards on the last stage: (M+S-1) + 2*(S-1).
    if (cfg->kind != PP_INTERLEAVED) {
        for (int s = 0; s < S; s++) { fwd[s] = 1.0; bwd[s] = 2.0; }
        PipelineCosts costs = {fwd, bwd, 0.0, PP_COMM_RENDEZVOUS};
        PipelineTimeline tl;
        if (pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)) == 0) {
            double want = (cfg->kind == PP_1F1B ? S : M + S - 1) + 2.0 * (S - 1), got = -1.0;
            for (int i = sch.offset[0]; i < sch.offset[1]; i++) {
                if (sch.actions[i].kind == PP_BACKWARD && sch.actions[i].microbatch == 0) { got = tl.start[i]; }
            }
            CHECK(got == want, "%s: stage 0 starts B0 at %g, expected %g", name, got, want);
            pipeline_timeline_free(&tl);
        }
    }
    CHECK(fabs(pipeline_bubble_fraction(cfg) - (double)(S - 1) / (double)(v * M + S - 1)) <= 1e-12,
          "%s: modelled bubble %g", name, pipeline_bubble_fraction(cfg));

    // measured per-stage costs, in any ratio, with transfer time: still no deadlock, and a
    // timeline that respects every dependency
    for (int s = 0; s < S; s++) { fwd[s] = rand_in(0.5, 1.5); bwd[s] = rand_in(0.5, 3.5); }
    simulate_all_models(name, &sch, fwd, bwd, rand_in(0.0, 0.3), makespan, bubble);
    pipeline_schedule_free(&sch);
}

static void test_all_schedules(void) {
    for (int S = 1; S <= 8; S++) {
        for (int M = 1; M <= 16; M++) {
            PipelineConfig g = {S, M, PP_GPIPE, 1};
            PipelineConfig f = {S, M, PP_1F1B, 1};
            test_schedule(&g);
            test_schedule(&f);
            for (int v = 2; v <= 4; v++) {
                PipelineConfig i = {S, M, PP_INTERLEAVED, v};
                if (S >= 2 && M % S == 0) { test_schedule(&i); }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------
// layer partition

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

// ----------------------------------------------------------------------------------------------
// invalid inputs are rejected with a message

static void expect_error(int rc, const char* err, const char* needle, const char* what) {
    CHECK(rc == -1, "%s: accepted (returned %d), expected an error", what, rc);
    CHECK(rc != -1 || strstr(err, needle) != NULL, "%s: message '%s' does not mention '%s'", what, err, needle);
}

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

    struct { PipelineConfig cfg; const char* needle; const char* what; } bad[] = {
        {{0, 4, PP_1F1B, 1}, "stages", "1f1b S=0"},
        {{-2, 4, PP_GPIPE, 1}, "stages", "gpipe S=-2"},
        {{4, 0, PP_1F1B, 1}, "microbatches", "1f1b M=0"},
        {{4, -1, PP_GPIPE, 1}, "microbatches", "gpipe M=-1"},
        {{4, 8, PP_1F1B, 2}, "chunks", "1f1b with 2 chunks"},
        {{4, 8, PP_INTERLEAVED, 1}, "chunks", "interleaved with 1 chunk"},
        {{1, 8, PP_INTERLEAVED, 2}, "stages", "interleaved S=1"},
        {{4, 6, PP_INTERLEAVED, 2}, "multiple", "interleaved M=6 S=4"},
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
    PipelineCosts costs = {f, b, 0.0, PP_COMM_EAGER};
    PipelineTimeline tl;
    expect_error(pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)), err, "stage 2", "a negative backward time");
    b[2] = 2;
    costs.transfer = NAN;
    expect_error(pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)), err, "transfer", "a NaN transfer time");
    pipeline_schedule_free(&sch);
}

// ----------------------------------------------------------------------------------------------
// the simulator on hand-made lists: deadlocks and invalid schedules are reported, not hung on

static int simulate_text(int S, int M, const char* const* stages, PipelineCommModel comm, char* err, size_t errlen) {
    PipelineAction acts[256];
    int offset[9];
    offset[0] = 0;
    for (int s = 0; s < S; s++) { offset[s + 1] = offset[s] + parse_actions(stages[s], s, acts + offset[s]); }
    PipelineSchedule sch;
    sch.cfg.num_stages = S;
    sch.cfg.num_microbatches = M;
    sch.cfg.kind = PP_1F1B;
    sch.cfg.num_chunks = 1;
    sch.offset = offset;
    sch.actions = acts;
    double f[8] = {1, 1, 1, 1, 1, 1, 1, 1}, b[8] = {2, 2, 2, 2, 2, 2, 2, 2};
    PipelineCosts costs = {f, b, 0.0, comm};
    PipelineTimeline tl;
    err[0] = '\0';
    int rc = pipeline_simulate(&sch, &costs, &tl, err, errlen);
    if (rc == 0) { pipeline_timeline_free(&tl); }
    return rc;
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
}

int main(void) {
    test_hand_written();
    test_all_schedules();
    test_partition();
    test_invalid_inputs();
    test_simulator_rejects();
    if (failures > 0) {
        printf("test_pipeline: %d of %d checks FAILED\n", failures, checks);
        return 1;
    }
    printf("test_pipeline: all %d checks passed\n", checks);
    return 0;
}
