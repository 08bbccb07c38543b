/*
 * bench_decode.c: how close one request's decode step comes to the memory's bandwidth (a table,
 * not a test; dev/bench/bench_sampler.sh runs it beside the trainer's sampler).
 *
 *   build/bench_decode [model] [tokens] [rounds]    (default d12 64 5; model: a descriptor)
 *
 * 1. stream: a read of a buffer the size of the model's matrices, all threads, several
 *    accumulators per thread (the bandwidth a streaming read really achieves here);
 * 2. each matmul shape of a decode step at one row: matmul_forward (row-major weights, the
 *    few-row kernel) against decode_matmul_forward (the packed copy, llmc/decode_matmul.h);
 * 3. the serving engine (llmc/serve_engine.h), one request: the median time of its decode
 *    steps, with the packed copies, with bf16 packed copies (serve_gpt2 --weights bf16: half
 *    the bytes, on the weights rounded to bf16) and without copies (matmul_forward for every
 *    matmul).
 * Each line gives ms and the GB/s of weights read. Rounds alternate between the variants and
 * each figure is the median over the rounds, so a machine shared with other work shifts them
 * alike.
 */
#define TESTING
#include "train_gpt2.c"
#include "llmc/gpt2_init.h"
#include "llmc/serve_engine.h"
#include "serve_model.c"   // the engine's model side

static double now_s(void) { return omp_get_wtime(); }

#include "dev/bench/bench_median.h"

// Seconds to read n floats once: each thread reads its contiguous part as 4 streams in lockstep
// (its quarters: one stream alone read 17 GB/s on the AVX2 EPYC, 4 at once 24, as the decode
// step's 4 panels at once do), summing 16 floats of each into 64 lanes, 64 / VLEN vector
// accumulators in registers (8 AVX2, 4 AVX-512), so the adds never wait on each other (a float
// acc[64] was kept on the stack by gcc: a load and a store per add)
static double stream_read_seconds(const float* a, size_t n, float* sink) {
    enum { STREAMS = 4, PER = 64 / STREAMS, NV = 64 / VLEN, NVS = NV / STREAMS };
    double t = now_s();
    float total = 0.0f;
    #pragma omp parallel reduction(+ : total)
    {
        int threads = thread_count(), me = thread_index();
        size_t lo = n * me / threads, hi = n * (me + 1) / threads, len = (hi - lo) / STREAMS / PER * PER;
        vf acc[NV];
        for (int j = 0; j < NV; j++) { acc[j] = vf_zero(); }
        for (size_t i = 0; i < len; i += PER) {
            _Pragma("GCC unroll 4") for (int s = 0; s < STREAMS; s++) {
                const float* p = a + lo + s * len + i;
                _Pragma("GCC unroll 2") for (int j = 0; j < NVS; j++) { acc[s * NVS + j] = vf_add(acc[s * NVS + j], vf_load(p + j * VLEN)); }
            }
        }
        float lanes[64];
        for (int j = 0; j < NV; j++) { vf_store(lanes + j * VLEN, acc[j]); }
        for (int j = 0; j < 64; j++) { total += lanes[j]; }
        for (size_t i = lo + STREAMS * len; i < hi; i++) { total += a[i]; }   // the tail
    }
    *sink += total;
    return now_s() - t;
}

typedef enum { ROW_MAJOR, PACKED, PACKED_BF16 } DecodeLayout;

// the median seconds of one decode step of a request alone (prompt of 16 tokens, then tokens
// steps), with the engine's packed copies (fp32 or bf16: params already rounded) or without them
static double serve_decode_step_seconds(Comm* comm, const GPT2Config* c, const float* params, int tokens,
                                        DecodeLayout layout) {
    ServeEngine e;
    int block_size = 16, blocks = (c->max_seq_len + block_size - 1) / block_size;
    serve_engine_init(&e, comm, &memory_host, c, params, blocks, block_size, 64, 1);
    if (layout == ROW_MAJOR) { e.model->model.decoding = NULL; }   // every matmul on the row-major weights
    e.model->model.decode_layers->bf16 = layout == PACKED_BF16;
    int prompt[16];
    for (int i = 0; i < 16; i++) { prompt[i] = (i * 977) % c->vocab_size; }
    ServeRequest r;
    serve_request_init(&r, prompt, 16, tokens, 1.0f, 0, 1.0f, 1337, c->vocab_size);
    r.ignore_eos = 1;
    serve_engine_submit(&e, &r);
    serve_engine_step(&e);   // the prefill
    double* step = (double*)malloc(sizeof(double) * (size_t)tokens);
    int n = 0;
    while (!serve_engine_idle(&e) && n < tokens) {
        double t = now_s();
        serve_engine_step(&e);
        step[n++] = now_s() - t;
    }
    double m = median(step, n);
    free(step);
    serve_request_free(&r);
    serve_engine_free(&e);
    return m;
}

int main(int argc, char** argv) {
    Comm comm;   // one rank: the engine's model takes its (trivial) groups
    comm_init(&comm, &argc, &argv);
    const char* model = argc > 1 ? argv[1] : "d12";
    int tokens = argc > 2 ? atoi(argv[2]) : 64, rounds = argc > 3 ? atoi(argv[3]) : 5;
    GPT2Config c;
    if (!config_from_descriptor(model, &c)) { fatal("bench_decode: model '%s': expected a descriptor such as d12", model); }
    if (tokens < 1 || tokens > c.max_seq_len - 16 || rounds < 1) {
        fatal("bench_decode: tokens %d, rounds %d: expected 1 <= tokens <= maxT - 16 = %d and rounds >= 1", tokens, rounds,
              c.max_seq_len - 16);
    }
    int C = c.channels, L = c.num_layers, Vp = c.padded_vocab_size;
    // a decode step's matrices (dense GPT-2): 12 C^2 per layer and wte for the logits
    double weight_bytes = 4.0 * ((double)L * 12 * C * C + (double)Vp * C);
    float* params = gpt2_random_params(&c, 7);
    printf("model %s: %.0f MB of matrices per decode step, %d threads, %d rounds, %s kernels\n", model,
           weight_bytes / 1e6, thread_count(), rounds, LLMC_SIMD_NAME);

    // 1. the stream read, over a buffer of the matrices' size
    size_t n = (size_t)(weight_bytes / 4) / 64 * 64;
    float* buf = (float*)aligned_calloc_or_die(n * sizeof(float), "stream buffer");
    for (size_t i = 0; i < n; i++) { buf[i] = (float)(i & 7); }
    float sink = 0.0f;
    double* st = (double*)malloc(sizeof(double) * (size_t)rounds);
    for (int r = 0; r < rounds; r++) { st[r] = stream_read_seconds(buf, n, &sink); }
    double stream_bw = n * 4.0 / median(st, rounds) / 1e9;
    printf("%-44s %9.2f ms  %6.1f GB/s\n", "stream read", 1e3 * n * 4.0 / stream_bw / 1e9, stream_bw);
    free(buf);

    // 2. each decode matmul at one row: the row-major weights against the packed copy
    struct { const char* name; int t, OC, IC; } shapes[] = {
        {"qkv", P_QKVW, 3 * C, C},
        {"attention projection", P_ATTPROJW, C, C},
        {"mlp up (fc)", P_FCW, 4 * C, C},
        {"mlp down (fcproj)", P_FCPROJW, C, 4 * C},
        {"logits (wte)", P_WTE, Vp, C},
    };
    float* x = (float*)malloc(sizeof(float) * 4 * C);
    float* out = (float*)malloc(sizeof(float) * (size_t)Vp);
    for (int i = 0; i < 4 * C; i++) { x[i] = 0.01f * (float)(i % 13); }
    printf("%-44s %12s %12s %9s\n", "one row, each matmul (ms, GB/s)", "row-major", "packed", "speedup");
    double* a = (double*)malloc(sizeof(double) * (size_t)rounds);
    double* b = (double*)malloc(sizeof(double) * (size_t)rounds);
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        // every layer's copy in turn, as a step reads them (so no copy is still in cache)
        int copies = shapes[s].t == P_WTE ? 1 : L, OC = shapes[s].OC, IC = shapes[s].IC;
        DecodeWeights dw = {0};
        for (int l = 0; l < copies; l++) { decode_weights_add(&dw, params + param_offset(&c, shapes[s].t, l), OC, IC); }
        for (int r = 0; r < rounds; r++) {
            double t = now_s();
            for (int l = 0; l < copies; l++) { matmul_forward(out, x, dw.m[l].source, NULL, 1, IC, OC, CANON_R); }
            a[r] = (now_s() - t) / copies;
            t = now_s();
            for (int l = 0; l < copies; l++) { decode_matmul_forward(out, x, &dw.m[l], NULL, 1, CANON_R); }
            b[r] = (now_s() - t) / copies;
        }
        double ta = median(a, rounds), tb = median(b, rounds), bytes = 4.0 * OC * IC;
        char name[64];
        snprintf(name, sizeof(name), "  %s %dx%d", shapes[s].name, OC, IC);
        printf("%-44s %6.3f %5.1f %6.3f %5.1f %8.2fx\n", name, 1e3 * ta, bytes / ta / 1e9, 1e3 * tb, bytes / tb / 1e9, ta / tb);
        decode_weights_free(&dw);
    }
    free(a);
    free(b);
    free(x);
    free(out);

    // 3. the serving engine, one request
    double* packed = (double*)malloc(sizeof(double) * (size_t)rounds);
    double* packed_bf16 = (double*)malloc(sizeof(double) * (size_t)rounds);
    double* rowmajor = (double*)malloc(sizeof(double) * (size_t)rounds);
    float* rounded = (float*)malloc(sizeof(float) * param_count(&c));
    memcpy(rounded, params, sizeof(float) * param_count(&c));
    decode_round_bf16(rounded, param_count(&c));
    for (int r = 0; r < rounds; r++) {
        packed[r] = serve_decode_step_seconds(&comm, &c, params, tokens, PACKED);
        packed_bf16[r] = serve_decode_step_seconds(&comm, &c, rounded, tokens, PACKED_BF16);
        rowmajor[r] = serve_decode_step_seconds(&comm, &c, params, tokens, ROW_MAJOR);
    }
    double tp = median(packed, rounds), tb16 = median(packed_bf16, rounds), tr = median(rowmajor, rounds);
    printf("%-44s %9.2f ms  %6.1f GB/s  (%.0f%% of the stream read)\n", "serving, one request: packed weights",
           1e3 * tp, weight_bytes / tp / 1e9, 100.0 * weight_bytes / tp / 1e9 / stream_bw);
    printf("%-44s %9.2f ms  %6.1f GB/s  (%.0f%% of the stream read)\n", "serving, one request: bf16 packed weights",
           1e3 * tb16, 0.5 * weight_bytes / tb16 / 1e9, 100.0 * 0.5 * weight_bytes / tb16 / 1e9 / stream_bw);
    printf("%-44s %9.2f ms  %6.1f GB/s  (%.0f%% of the stream read)\n", "serving, one request: row-major weights",
           1e3 * tr, weight_bytes / tr / 1e9, 100.0 * weight_bytes / tr / 1e9 / stream_bw);
    printf("(stream checksum %g)\n", (double)sink);
    free(packed);
    free(packed_bf16);
    free(rowmajor);
    free(rounded);
    free(st);
    free(params);
    comm_finalize(&comm);
    return 0;
}
