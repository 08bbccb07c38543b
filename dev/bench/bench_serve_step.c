/*
 * bench_serve_step.c: where a serving step's time goes, at 1 row and at 16 (a table, not a
 * test): what decides whether batching 16 requests costs little more than one
 * (make bench-serve's targets).
 *
 *   build/bench_serve_step [model] [steps] [warm-up steps]    (default d12 20 6)
 *
 * The engine (llmc/serve_engine.h) as serve_gpt2 runs it, on random weights: R requests (1, then
 * 16) with prompts of 32 tokens, greedy, admitted and prefilled together; then `warm-up` decode
 * steps not counted (the first packs the decode copies, llmc/decode_matmul.h), then `steps`
 * decode steps of R rows each, every part of a step timed: the layers (embeddings, matmuls,
 * layernorms, GELU: the forward without its attention), attention (serve_attend: the keys and
 * values into the cache, attention_forward_paged), the head (final layernorm, the logits against
 * wte, softmax), the draws with the fingerprints (serve_engine_finish_step), and the
 * fingerprints alone (serve_fnv1a over the same rows once more). Per step in ms, the median over
 * the steps, in the wall clock and in the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID;
 * with OMP_NUM_THREADS=1 the whole step's, which a machine shared with other work disturbs
 * least), and the minimum over the steps of that CPU time (the step least disturbed: on a
 * loaded machine the other jobs' turns on the core evict the step's data and slow even its CPU
 * time).
 */
#define TESTING
#include <time.h>
#include "train_gpt2.c"
#include "llmc/gpt2_init.h"
#include "llmc/serve_engine.h"
#include "serve_model.c"   // the engine's model side

enum { PART_LAYERS, PART_ATTENTION, PART_HEAD, PART_DRAWS, PART_FNV, PART_TOTAL, NUM_PARTS };
static const char* part_names[NUM_PARTS] = {"layers", "attention", "head", "draws+fnv", "fnv alone", "step"};

typedef struct { double wall, cpu; } Clock;
static Clock clock_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    Clock c = {omp_get_wtime(), ts.tv_sec + 1e-9 * ts.tv_nsec};
    return c;
}
static Clock clock_since(Clock a) {
    Clock b = clock_now();
    Clock d = {b.wall - a.wall, b.cpu - a.cpu};
    return d;
}

static Clock attention_time;   // this step's, summed over the layers
static void timed_attend(void* ctx, int l, const float* qkv, float* atty, int C, int NH) {
    Clock t = clock_now();
    serve_attend(ctx, l, qkv, atty, C, NH);
    Clock d = clock_since(t);
    attention_time.wall += d.wall;
    attention_time.cpu += d.cpu;
}

#include "dev/bench/bench_median.h"

// R requests decoding together: each part's median per step (ms), wall and CPU
static void bench_rows(Comm* comm, const GPT2Config* c, const float* params, int R, int steps, int warm,
                       double wall_ms[NUM_PARTS], double cpu_ms[NUM_PARTS], double cpu_min_ms[NUM_PARTS]) {
    enum { PROMPT = 32 };
    int block_size = 16, per_request = (PROMPT + warm + steps + block_size) / block_size;
    int blocks = R * per_request > c->max_seq_len / block_size ? R * per_request : c->max_seq_len / block_size;
    ServeEngine e;
    serve_engine_init(&e, comm, &memory_host, c, params, blocks, block_size, R * PROMPT, R);
    e.model->acts.attend = timed_attend;
    ServeRequest* reqs = (ServeRequest*)calloc_or_die((size_t)R, sizeof(ServeRequest), "requests");
    for (int i = 0; i < R; i++) {
        int prompt[PROMPT];
        for (int p = 0; p < PROMPT; p++) { prompt[p] = (int)((i * 7919u + p * 977u) % (unsigned)c->vocab_size); }
        serve_request_init(&reqs[i], prompt, PROMPT, warm + steps + 1, 0.0f, 0, 1.0f, 1337, c->vocab_size);
        reqs[i].ignore_eos = 1;
        serve_engine_submit(&e, &reqs[i]);
    }
    serve_engine_step(&e);   // the prefill of every prompt, one step
    for (int s = 0; s < warm; s++) { serve_engine_step(&e); }
    double* wall = (double*)malloc(sizeof(double) * NUM_PARTS * (size_t)steps);
    double* cpu = (double*)malloc(sizeof(double) * NUM_PARTS * (size_t)steps);
    uint64_t sink = 0;
    for (int s = 0; s < steps; s++) {
        Clock parts[NUM_PARTS];
        Clock step = clock_now();
        if (serve_engine_schedule(&e) != R) { fatal("bench_serve_step: step %d has %d rows, expected %d", s, e.num_rows, R); }
        int M = serve_head_rows(&e);   // (serve_engine_forward, part by part)
        attention_time = (Clock){0, 0};
        Clock t = clock_now();
        serve_forward(&e, e.num_rows);
        parts[PART_LAYERS] = clock_since(t);
        parts[PART_ATTENTION] = attention_time;
        parts[PART_LAYERS].wall -= attention_time.wall;
        parts[PART_LAYERS].cpu -= attention_time.cpu;
        t = clock_now();
        e.mem->from_host(e.head_rows_dev, e.head_rows, sizeof(int) * (size_t)M);
        serve_model_head(e.model, e.num_rows, e.head_rows_dev, M, e.probs);
        parts[PART_HEAD] = clock_since(t);
        t = clock_now();
        serve_engine_finish_step(&e);
        parts[PART_DRAWS] = clock_since(t);
        parts[PART_TOTAL] = clock_since(step);
        t = clock_now();
        for (int m = 0; m < M; m++) { sink ^= serve_fnv1a(SERVE_FNV_BASIS, e.probs + (size_t)m * e.Vp, (size_t)c->vocab_size); }
        parts[PART_FNV] = clock_since(t);
        for (int p = 0; p < NUM_PARTS; p++) {
            wall[(size_t)p * steps + s] = 1e3 * parts[p].wall;
            cpu[(size_t)p * steps + s] = 1e3 * parts[p].cpu;
        }
    }
    for (int p = 0; p < NUM_PARTS; p++) {
        wall_ms[p] = median(wall + (size_t)p * steps, steps);
        cpu_ms[p] = median(cpu + (size_t)p * steps, steps);
        cpu_min_ms[p] = cpu[(size_t)p * steps];   // (median sorted them)
    }
    if (sink == 1) { printf("(fingerprint sink %llu)\n", (unsigned long long)sink); }   // keeps the hashing
    free(wall);
    free(cpu);
    for (int i = 0; i < R; i++) { serve_request_free(&reqs[i]); }
    free(reqs);
    serve_engine_free(&e);
}

int main(int argc, char** argv) {
    Comm comm;   // one rank
    comm_init(&comm, &argc, &argv);
    const char* model = argc > 1 ? argv[1] : "d12";
    int steps = argc > 2 ? atoi(argv[2]) : 20, warm = argc > 3 ? atoi(argv[3]) : 6;
    GPT2Config c;
    if (!config_from_descriptor(model, &c)) { fatal("bench_serve_step: model '%s': expected a descriptor such as d12", model); }
    if (steps < 1 || warm < 1 || 32 + warm + steps + 1 > c.max_seq_len) {
        fatal("bench_serve_step: steps %d, warm-up %d: expected steps >= 1, warm-up >= 1, 33 + both <= maxT = %d", steps,
              warm, c.max_seq_len);
    }
    float* params = gpt2_random_params(&c, 7);
    double load = -1.0;
    FILE* f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &load) != 1) { load = -1.0; }
        fclose(f);
    }
    printf("model %s, %d threads, %s kernels, load average %.2f; ms per decode step, median of %d (after %d warm-up)\n",
           model, thread_count(), LLMC_SIMD_NAME, load, steps, warm);
    int rows[] = {1, 16};
    double ms[2][3][NUM_PARTS];   // rows, clock (wall, thread CPU, its minimum), part
    static const char* clocks[3] = {"wall", "thread CPU", "thread CPU, min"};
    for (int i = 0; i < 2; i++) { bench_rows(&comm, &c, params, rows[i], steps, warm, ms[i][0], ms[i][1], ms[i][2]); }
    printf("| rows | clock |");
    for (int p = 0; p < NUM_PARTS; p++) { printf(" %s |", part_names[p]); }
    printf("\n|---|---|");
    for (int p = 0; p < NUM_PARTS; p++) { printf("---|"); }
    printf("\n");
    for (int i = 0; i < 2; i++) {
        for (int k = 0; k < 3; k++) {
            printf("| %d | %s |", rows[i], clocks[k]);
            for (int p = 0; p < NUM_PARTS; p++) { printf(" %.2f |", ms[i][k][p]); }
            printf("\n");
        }
    }
    printf("16 rows / 1 row, whole step: %.2fx wall, %.2fx thread CPU, %.2fx its minimum\n",
           ms[1][0][PART_TOTAL] / ms[0][0][PART_TOTAL], ms[1][1][PART_TOTAL] / ms[0][1][PART_TOTAL],
           ms[1][2][PART_TOTAL] / ms[0][2][PART_TOTAL]);
    free(params);
    comm_finalize(&comm);
    return 0;
}
