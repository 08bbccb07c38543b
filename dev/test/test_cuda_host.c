/*
 * test_cuda_host.c: the CUDA build (train_gpt2.cu) against the CPU reference (train_gpt2.c).
 *
 * Built three times (mk/cuda.mk):
 *  - build/test_cuda_host, by gcc, on every machine: what needs no GPU.
 *     1. The deterministic kernels' arithmetic, recomputed on the host: every output as the one
 *        GPU thread that owns it computes it, with the same functions and arguments
 *        (llmc/gpu_plan.h: the canonical walk of a tiled reduction, the streaming tree over
 *        chunks, the argument builders of every matmul-shaped product, the R3 leaves and tree,
 *        the row kernels' per-chunk formulas, the embedding gradient's grouping by token), and
 *        compared BIT FOR BIT with train_gpt2.c's kernels on awkward shapes: sizes below 8
 *        chunks, tiles cut short, several tiles, the qkv groups, T past one 128-row tile in
 *        attention, bf16 inputs of the shared reductions, and a tensor-parallel rank's share
 *        of every split reduction (nchunks = 8/K, vocabulary rows, sequence partials).
 *        The tiled kernel's thread mapping: every tile element loaded and every output
 *        owned by exactly one of its 256 threads, float4 reads aligned.
 *     2. The plan: launch grids, the startup launch check (gpu_launch_problem: GPT-2 124M at
 *        B=64, T=1024, logits past 2^31 elements, fits in both modes; impossible shapes are
 *        refused with a reason), the initialisation (llmc/gpt2_init.h), the MFU peaks.
 *     3. The binaries, when built: train_gpt2cu --help and its refusals; without a GPU, one
 *        clear error line and exit status 1; train_gpt2cu_emu in fast mode
 *        refuses --attention cudnn in one line (dev/test/test_fast_e2e.sh runs it).
 *  - build/test_cuda_kernels_emu, by g++ on the CPU emulation of CUDA (dev/gpu/emu): only
 *    4. (1-3 are build/test_cuda_host's): every kernel of llmc/kernels_det.cuh and the device memory operations, launched
 *    (emulated: fibers, shuffled blocks and threads, poisoned memory) and compared with their
 *    train_gpt2.c twins bit for bit; fast mode's kernels (cuBLASLt matmuls on the stand-in,
 *    flash attention, fused classifier, layernorms) against the reference within bf16
 *    tolerances.
 *  - build/test_cuda_kernels, by nvcc as CUDA: on a GPU, 4. on the real device. Without a GPU
 *    it says so and runs the host checks.
 * Exits non-zero on any failure.
 */
#define TESTING
#include "train_gpt2.c"
#include <sys/wait.h>
#include "llmc/gpu_plan.h"
#include "llmc/gpt2_init.h"

#if defined(__CUDACC__) || defined(LLMC_CUDA_EMU)
#define TEST_DEVICE 1   // section 4: the kernels themselves
#endif

static int failures = 0, checks = 0;
#define CHECK(cond, ...) do { checks++; if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

static uint64_t rng_state = 4242;
static float frand(void) {   // mixed magnitudes, so that summation order matters
    uint32_t r = random_u32(&rng_state);
    float base = (float)((int)(r % 20001) - 10000) / 10000.0f;
    int scale = (r >> 20) % 4;
    return base * (scale == 0 ? 1e-3f : scale == 1 ? 1.0f : scale == 2 ? 30.0f : 0.1f);
}
static float* rand_buf(size_t n) {
    float* p = (float*)malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) { p[i] = frand(); }
    return p;
}
static float* zero_buf(size_t n) { return (float*)calloc(n ? n : 1, sizeof(float)); }
static float* copy_buf(const float* x, size_t n) {
    float* p = (float*)malloc(sizeof(float) * (n ? n : 1));
    memcpy(p, x, sizeof(float) * n);
    return p;
}
static int* rand_tokens(int n, int V) {
    int* t = (int*)malloc(sizeof(int) * (n ? n : 1));
    for (int i = 0; i < n; i++) { t[i] = (int)(random_u32(&rng_state) % (uint32_t)V); }
    if (n > 3) { t[3] = t[1]; }   // a repeated token
    return t;
}

static void expect_same(const char* what, const float* got, const float* want, size_t n) {
    checks++;
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], 4) != 0) {
            failures++;
            printf("FAIL %s: element %zu is %.9g, reference %.9g\n", what, i, got[i], want[i]);
            return;
        }
    }
}

// bf16 storage of the shared reductions: values rounded to bf16, and their raw bits
static uint16_t to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static uint16_t* bf16_round(float* x, size_t n) {
    uint16_t* h = (uint16_t*)malloc(sizeof(uint16_t) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        h[i] = to_bf16_bits(x[i]);
        uint32_t u = (uint32_t)h[i] << 16;
        memcpy(&x[i], &u, 4);
    }
    return h;
}

// train_gpt2.c's kernels on one rank, where they come in tensor-parallel pieces
static void cpu_encoder_forward(float* out, const int* inp, const float* wte, const float* wpe, int B, int T,
                                int C, int Vp) {
    encoder_lookup(out, inp, wte, 0, Vp, B * T, C);
    encoder_add_positions(out, wpe, B, T, C);
}
static void cpu_crossentropy_forward(float* probs, float* losses, const int* targets, int BT, int V, int Vp) {
    float* ce = zero_buf(3 * (size_t)BT);
    crossentropy_max(ce, probs, BT, V, 0, Vp);
    crossentropy_exps(ce + BT, ce + 2 * BT, probs, ce, targets, BT, V, 0, Vp, CANON_R);
    crossentropy_normalize(probs, losses, ce + BT, ce + 2 * BT, ce, targets, BT, V, 0, Vp);
    free(ce);
}

// ==========================================================================================
// 1. the deterministic kernels, one output at a time as its GPU thread computes it
// ==========================================================================================

// det_gemm_kernel's output (z, m, n): the walk over the tiles of its block's reduction, the
// causal rule per term, the streaming tree, the epilogue.
static float thread_gemm_out(const DetGemmArgs* g, int z, int m, int n) {
    const float* A = g->A + det_zoff(z, g->zdiv, g->a_zhi, g->a_zlo);
    const float* B = g->B + det_zoff(z, g->zdiv, g->b_zhi, g->b_zlo);
    int m0 = m / DET_MT * DET_MT;
    int m_last = (m0 + DET_MT < g->M ? m0 + DET_MT : g->M) - 1;
    DetReduction red = det_tile_reduction(g, g->causal, m0, m_last);
    float acc = 0.0f, s0 = 0.0f, s1 = 0.0f, s2 = 0.0f;
    int c = 0, grp = 0, k0 = -1, kend = 0, cur = 0;
    while (det_walk_seek(&red, &c, &grp, &k0, &kend)) {
        int klen = kend - k0 < DET_KT ? kend - k0 : DET_KT;
        while (cur < c) { det_tree8_push(cur++, acc, &s0, &s1, &s2); acc = 0.0f; }
        for (int kk = 0; kk < klen; kk++) {
            int r = k0 + kk;
            if (det_term_included(g, g->causal, r, m)) {
                acc = fmaf(A[(long)m * g->a_m + (long)r * g->a_r], B[(long)n * g->b_n + (long)r * g->b_r], acc);
            }
        }
        k0 += DET_KT;
    }
    while (cur < g->nchunks) { det_tree8_push(cur++, acc, &s0, &s1, &s2); acc = 0.0f; }
    float v = s0 * g->scale;
    if (g->bias) { v = v + g->bias[n]; }
    return v;
}

static void thread_gemm(const DetGemmArgs* g) {
    for (int z = 0; z < g->Z; z++) {
        float* out = g->out + det_zoff(z, g->zdiv, g->o_zhi, g->o_zlo);
        for (int m = 0; m < g->M; m++) {
            for (int n = 0; n < g->N; n++) {
                if (!det_out_exists(g, g->out_lower, m, n)) { continue; }
                out[(long)m * g->o_m + n] = thread_gemm_out(g, z, m, n);
            }
        }
    }
}

// position_reduce_x: leaves, then the R3 tree per output
static void thread_position_reduce(float* out, const void* x, int bf16, int B, int T, int OC) {
    float* leaves = zero_buf((size_t)B * CANON_R * OC);
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            for (int o = 0; o < OC; o++) {
                leaves[((size_t)b * CANON_R + ch) * OC + o] = det_position_leaf(x, bf16, OC, o, b, T, 1, 0, ch);
            }
        }
    }
    for (int o = 0; o < OC; o++) { out[o] = det_pos_tree(leaves + o, B, CANON_R, OC); }
    free(leaves);
}

static void thread_matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                const float* weight, int B, int T, int K, int OC, int groups, int nchunks) {
    DetGemmArgs g = det_args_matmul_dinp(dinp, dout, weight, B * T, K, OC, groups, nchunks);
    thread_gemm(&g);
    size_t n = (size_t)OC * K;
    float* seq = zero_buf((size_t)B * n);
    g = det_args_matmul_dweight(B > 1 ? seq : dweight, dout, inp, B, T, 1, 0, K, OC);
    thread_gemm(&g);
    if (B > 1) {
        for (size_t i = 0; i < n; i++) { dweight[i] = canon_tree_sum(seq + i, B, (long)n); }
    }
    free(seq);
    thread_position_reduce(dbias, dout, 0, B, T, OC);
}

static void thread_layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                                  const float* b, int BT, int C) {
    for (int i = 0; i < BT; i++) {
        const float* x = inp + (size_t)i * C;
        float p[CANON_R], q[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) { p[ch] = det_chunk_sum(x, canon_chunk_begin(C, ch), canon_chunk_begin(C, ch + 1)); }
        float m = canon_tree8(p) / (float)C;
        for (int ch = 0; ch < CANON_R; ch++) { q[ch] = det_ln_chunk_var(x, m, canon_chunk_begin(C, ch), canon_chunk_begin(C, ch + 1)); }
        float s = canon_rsqrtf(canon_tree8(q) / (float)C + 1e-5f);
        for (int c = 0; c < C; c++) { out[(size_t)i * C + c] = fmaf((x[c] - m) * s, w[c], b[c]); }
        mean[i] = m;
        rstd[i] = s;
    }
}

// the rows rank r's D-way zig-zag slice of each sequence of T (8/D chunks); with seq_partials
// (2,B,C) each sequence's subtrees
static void thread_layernorm_backward(float* dres, float* dw, float* db, const float* dout, const float* inp,
                                   const float* w, const float* mean, const float* rstd, int B, int T, int D, int r,
                                   int C, float* seq_partials) {
    int nchunks = CANON_R / D;
    for (int i = 0; i < B * canon_zz_len(T, D, r); i++) {
        size_t off = (size_t)i * C;
        float p1[CANON_R], p2[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) {
            det_ln_bwd_chunk(inp + off, dout + off, w, mean[i], rstd[i], canon_chunk_begin(C, ch),
                             canon_chunk_begin(C, ch + 1), &p1[ch], &p2[ch]);
        }
        float m1 = canon_tree8(p1) / (float)C, m2 = canon_tree8(p2) / (float)C;
        for (int c = 0; c < C; c++) {
            dres[off + c] = dres[off + c] + det_ln_bwd_dx(inp[off + c], dout[off + c], w[c], mean[i], rstd[i], m1, m2);
        }
    }
    size_t n = (size_t)B * nchunks * C;
    float* leaves = zero_buf(2 * n);
    for (size_t idx = 0; idx < n; idx++) {
        int c = (int)(idx % C), leaf = (int)(idx / C);
        det_ln_param_leaf(inp, dout, 0, mean, rstd, C, c, leaf / nchunks, T, D, r, leaf % nchunks, &leaves[idx],
                          &leaves[n + idx]);
    }
    for (int c = 0; c < C; c++) {
        if (seq_partials) {
            for (int b = 0; b < B; b++) {
                seq_partials[(size_t)b * C + c] = det_seq_tree(leaves + c, b, nchunks, C);
                seq_partials[((size_t)B + b) * C + c] = det_seq_tree(leaves + n + c, b, nchunks, C);
            }
        } else {
            dw[c] = det_pos_tree(leaves + c, B, nchunks, C);
            db[c] = det_pos_tree(leaves + n + c, B, nchunks, C);
        }
    }
    free(leaves);
}

// attention_softmax_kernel on row (z, t): max, exps, chunk sums (lanes 0-7), tree, division
static void thread_softmax_row(float* a, int t, int T) {
    float maxv = -canon_inf();
    for (int t2 = 0; t2 <= t; t2++) { if (a[t2] > maxv) { maxv = a[t2]; } }
    for (int t2 = 0; t2 <= t; t2++) { a[t2] = canon_expf(a[t2] - maxv); }
    float p[CANON_R];
    for (int ch = 0; ch < CANON_R; ch++) { p[ch] = det_zz_chunk_row(a, NULL, T, 1, 0, ch, t + 1); }
    float z = canon_tree8(p);
    for (int t2 = 0; t2 < T; t2++) { a[t2] = t2 <= t ? a[t2] / z : 0.0f; }
}

static void thread_attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    DetGemmArgs g = det_args_attention_scores(att, qkv, B, T, C, NH);
    thread_gemm(&g);
    for (long row = 0; row < (long)B * NH * T; row++) { thread_softmax_row(att + row * T, (int)(row % T), T); }
    g = det_args_attention_by_keys(out, C, att, qkv + 2 * C, 3L * C, B, T, C, NH);
    thread_gemm(&g);
}

static void thread_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                   int B, int T, int C, int NH) {
    long C3 = 3L * C;
    float* ds = zero_buf((size_t)B * NH * T * T);
    DetGemmArgs g = det_args_attention_datt(ds, dout, qkv, B, T, C, NH);
    thread_gemm(&g);
    float scale = canon_rsqrtf((float)(C / NH));
    for (long row = 0; row < (long)B * NH * T; row++) {
        int t = (int)(row % T);
        float* d = ds + row * T;
        const float* at = att + row * T;
        float p[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) { p[ch] = det_zz_chunk_row(at, d, T, 1, 0, ch, t + 1); }
        float S = canon_tree8(p);
        for (int t2 = 0; t2 <= t; t2++) { d[t2] = at[t2] * (d[t2] - S) * scale; }
    }
    g = det_args_attention_by_keys(dqkv, C3, ds, qkv + C, C3, B, T, C, NH);
    thread_gemm(&g);
    g = det_args_attention_by_queries(dqkv + C, C3, ds, qkv, C3, B, T, C, NH);
    thread_gemm(&g);
    g = det_args_attention_by_queries(dqkv + 2 * C, C3, att, dout, C, B, T, C, NH);
    thread_gemm(&g);
    free(ds);
}

// crossentropy_max/exps/normalize kernels on row i, over the vocabulary slice [v0, v0 + Vl)
// of one tensor-parallel rank (nchunks of the 8 chunks); the group's max, Z and target logit
// are those of the one-rank call when v0 = 0, Vl = Vp.
static void thread_crossentropy_slice(float* logits, float* maxes, float* zs, float* target_logits,
                                      const int* targets, int BT, int V, int v0, int Vl, int nchunks) {
    for (int i = 0; i < BT; i++) {
        float* p = logits + (size_t)i * Vl;
        float m = -canon_inf();
        for (int v = 0; v < Vl && v0 + v < V; v++) { if (p[v] > m) { m = p[v]; } }
        maxes[i] = m;
        int t = targets ? targets[i] - v0 : -1;
        target_logits[i] = t >= 0 && t < Vl ? p[t] : -0.0f;
        for (int v = 0; v < Vl && v0 + v < V; v++) { p[v] = canon_expf(p[v] - m); }
        float part[CANON_R];
        long real = (long)V - v0;
        for (int ch = 0; ch < nchunks; ch++) {
            long b = ((long)Vl * ch) / nchunks, e = ((long)Vl * (ch + 1)) / nchunks;
            part[ch] = det_chunk_sum(p, b < real ? b : real, e < real ? e : real);
        }
        zs[i] = canon_tree_sum(part, nchunks, 1);
    }
}

static void thread_crossentropy_forward(float* probs, float* losses, const int* targets, int BT, int V, int Vp) {
    float *maxes = zero_buf(BT), *zs = zero_buf(BT), *tl = zero_buf(BT);
    thread_crossentropy_slice(probs, maxes, zs, tl, targets, BT, V, 0, Vp, CANON_R);
    for (int i = 0; i < BT; i++) {
        float* p = probs + (size_t)i * Vp;
        for (int v = 0; v < Vp; v++) { p[v] = v < V ? p[v] / zs[i] : 0.0f; }
        if (targets) { losses[i] = canon_logf(zs[i]) - (tl[i] - maxes[i]); }
    }
    free(maxes); free(zs); free(tl);
}

// the embedding gradients of the vocabulary rows [v0, v0 + Vl)
static void thread_encoder_backward(float* dwte, float* dwpe, const void* dout, int bf16, const int* inp,
                                 int B, int T, int C, int v0, int Vl, int maxT) {
    int BT = B * T;
    int* count = (int*)malloc(sizeof(int) * ((size_t)Vl + 1));
    int *order = (int*)malloc(sizeof(int) * BT), *begin = (int*)malloc(sizeof(int) * (BT + 1));
    int* tokens = (int*)malloc(sizeof(int) * BT);
    int nuniq = encoder_backward_plan(inp, BT, v0, Vl, count, order, begin, tokens);
    for (int t = 0; t < maxT; t++) {
        for (int c = 0; c < C; c++) {
            dwpe[(size_t)t * C + c] = t < T ? det_encoder_dwpe_elem(dout, bf16, B, T, C, t, c) : 0.0f;
        }
    }
    memset(dwte, 0, sizeof(float) * (size_t)Vl * C);
    for (int u = 0; u < nuniq; u++) {
        for (int c = 0; c < C; c++) {
            dwte[(size_t)tokens[u] * C + c] = det_encoder_dwte_elem(dout, bf16, order, begin[u], begin[u + 1], B, T, C, c);
        }
    }
    free(count); free(order); free(begin); free(tokens);
}

// ---- the comparisons ---------------------------------------------------------------------

static void test_walk(void) {
    // det_tree8_push is canon_tree8
    for (int trial = 0; trial < 200; trial++) {
        float p[CANON_R], s0 = 0, s1 = 0, s2 = 0;
        for (int c = 0; c < CANON_R; c++) { p[c] = frand(); det_tree8_push(c, p[c], &s0, &s1, &s2); }
        float want = canon_tree8(p);
        CHECK(memcmp(&s0, &want, 4) == 0, "det_tree8_push differs from canon_tree8 (trial %d)", trial);
    }
    // the walk visits each index of each segment once, in canonical order, in tiles <= DET_KT
    // (plain chunks, the qkv groups, R2Z chunks along a sequence)
    int ns[] = {1, 3, 7, 8, 16, 17, 100, 129, 768};
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        for (int kind = 0; kind < 3; kind++) {
            int groups = kind == 1 ? 3 : 1, n = ns[i] * groups;
            DetGemmArgs a = det_gemm_args(1, 1, n, 1, 1, DET_CAUSAL_NONE, DET_OUT_ALL);
            a.groups = groups;
            a.zigzag = kind == 2;
            DetReduction r = det_tile_reduction(&a, DET_CAUSAL_NONE, 0, 0);
            int c = 0, g = 0, k0 = -1, kend = 0, expect_c = 0, expect_g = 0, visited = 0, ok = 1;
            int expect_r = -1;
            while (det_walk_seek(&r, &c, &g, &k0, &kend)) {
                int b, e;
                det_segment(&r, c, g, &b, &e);
                if (c < expect_c || (c == expect_c && g < expect_g) || k0 < b || kend != e) { ok = 0; }
                if (expect_r >= 0 && (c != expect_c || g != expect_g) && k0 != b) { ok = 0; }
                if ((c == expect_c && g == expect_g) && expect_r >= 0 && k0 != expect_r) { ok = 0; }
                int len = kend - k0 < DET_KT ? kend - k0 : DET_KT;
                visited += len;
                expect_c = c; expect_g = g; expect_r = k0 + len;
                k0 += DET_KT;
            }
            CHECK(ok && visited == n, "det_walk_seek over n=%d groups=%d: visited %d", n, groups, visited);
        }
    }
}

// A tensor-parallel rank's share of a chunked reduction over n: its 8/K chunks are a
// contiguous range [n*r/K, n*(r+1)/K) (canonical.h R2), reduced with nchunks = 8/K.
static int tp_begin(int n, int r, int K) { return (int)(((long)n * r) / K); }

static void test_matmul(void) {
    int shapes[][5] = {   // B, T, K, OC, groups
        {1, 1, 1, 1, 1}, {2, 3, 5, 7, 1}, {2, 5, 17, 30, 3}, {3, 7, 40, 9, 1}, {1, 130, 70, 65, 1},
        {4, 33, 129, 12, 3}, {2, 70, 200, 130, 1}, {1, 9, 16, 256, 1}
    };
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int B = shapes[s][0], T = shapes[s][1], K = shapes[s][2], OC = shapes[s][3], groups = shapes[s][4];
        int BT = B * T;
        float *inp = rand_buf((size_t)BT * K), *w = rand_buf((size_t)OC * K), *bias = rand_buf(OC);
        float *dout = rand_buf((size_t)BT * OC);
        float *ref = zero_buf((size_t)BT * OC), *got = zero_buf((size_t)BT * OC);
        char what[128];
        matmul_forward(ref, inp, w, bias, BT, K, OC, CANON_R);
        DetGemmArgs g = det_args_matmul_forward(got, inp, w, bias, BT, K, OC, CANON_R);
        thread_gemm(&g);
        snprintf(what, sizeof(what), "matmul_forward B=%d T=%d K=%d OC=%d", B, T, K, OC);
        expect_same(what, got, ref, (size_t)BT * OC);
        matmul_forward(ref, inp, w, NULL, BT, K, OC, CANON_R);
        g = det_args_matmul_forward(got, inp, w, NULL, BT, K, OC, CANON_R);
        thread_gemm(&g);
        expect_same("matmul_forward without bias", got, ref, (size_t)BT * OC);
        // a row-parallel rank's partial sum: its K/tp inputs (columns of w), 8/tp chunks
        for (int tp = 2; tp <= 8 && K % tp == 0; tp *= 2) {
            int Kl = K / tp, k0 = tp_begin(K, tp - 1, tp);
            float *inp_l = zero_buf((size_t)BT * Kl), *w_l = zero_buf((size_t)OC * Kl);
            for (int i = 0; i < BT; i++) { memcpy(inp_l + (size_t)i * Kl, inp + (size_t)i * K + k0, Kl * 4); }
            for (int o = 0; o < OC; o++) { memcpy(w_l + (size_t)o * Kl, w + (size_t)o * K + k0, Kl * 4); }
            matmul_forward(ref, inp_l, w_l, NULL, BT, Kl, OC, CANON_R / tp);
            g = det_args_matmul_forward(got, inp_l, w_l, NULL, BT, Kl, OC, CANON_R / tp);
            thread_gemm(&g);
            snprintf(what, sizeof(what), "matmul_forward, row-parallel rank's share (tp %d) K=%d", tp, K);
            expect_same(what, got, ref, (size_t)BT * OC);
            free(inp_l); free(w_l);
        }

        float *dinp_r = zero_buf((size_t)BT * K), *dw_r = zero_buf((size_t)OC * K), *db_r = zero_buf(OC);
        float *dinp_g = zero_buf((size_t)BT * K), *dw_g = zero_buf((size_t)OC * K), *db_g = zero_buf(OC);
        for (int nchunks = CANON_R; nchunks >= 1; nchunks /= 2) {   // one rank, and column-parallel shares
            matmul_backward(dinp_r, dw_r, db_r, dout, inp, w, B, T, K, OC, groups, nchunks);
            thread_matmul_backward(dinp_g, dw_g, db_g, dout, inp, w, B, T, K, OC, groups, nchunks);
            snprintf(what, sizeof(what), "matmul_backward dinp B=%d T=%d K=%d OC=%d groups=%d nchunks=%d", B, T, K, OC,
                     groups, nchunks);
            expect_same(what, dinp_g, dinp_r, (size_t)BT * K);
        }
        snprintf(what, sizeof(what), "matmul_backward dweight B=%d T=%d K=%d OC=%d", B, T, K, OC);
        expect_same(what, dw_g, dw_r, (size_t)OC * K);
        snprintf(what, sizeof(what), "matmul_backward dbias B=%d T=%d OC=%d", B, T, OC);
        expect_same(what, db_g, db_r, OC);
        free(inp); free(w); free(bias); free(dout); free(ref); free(got);
        free(dinp_r); free(dw_r); free(db_r); free(dinp_g); free(dw_g); free(db_g);
    }
}

static void test_layernorm(void) {
    int shapes[][3] = {{1, 1, 1}, {1, 3, 7}, {2, 5, 64}, {3, 17, 100}, {2, 9, 768}, {2, 16, 32}};   // B, T, C
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], BT = B * T;
        float *x = rand_buf((size_t)BT * C), *w = rand_buf(C), *b = rand_buf(C), *dy = rand_buf((size_t)BT * C);
        float *out_r = zero_buf((size_t)BT * C), *mean_r = zero_buf(BT), *rstd_r = zero_buf(BT);
        float *out_g = zero_buf((size_t)BT * C), *mean_g = zero_buf(BT), *rstd_g = zero_buf(BT);
        layernorm_forward(out_r, mean_r, rstd_r, x, w, b, BT, C);
        thread_layernorm_forward(out_g, mean_g, rstd_g, x, w, b, BT, C);
        char what[96];
        snprintf(what, sizeof(what), "layernorm_forward BT=%d C=%d", BT, C);
        expect_same(what, out_g, out_r, (size_t)BT * C);
        expect_same("layernorm_forward mean", mean_g, mean_r, BT);
        expect_same("layernorm_forward rstd", rstd_g, rstd_r, BT);
        float* dres_r = rand_buf((size_t)BT * C);
        float* dres_g = copy_buf(dres_r, (size_t)BT * C);
        float *dw_r = zero_buf(C), *db_r = zero_buf(C), *dw_g = zero_buf(C), *db_g = zero_buf(C);
        layernorm_backward(dres_r, dw_r, db_r, dy, x, w, mean_r, rstd_r, B, T, 1, 0, C, NULL);
        thread_layernorm_backward(dres_g, dw_g, db_g, dy, x, w, mean_r, rstd_r, B, T, 1, 0, C, NULL);
        snprintf(what, sizeof(what), "layernorm_backward B=%d T=%d C=%d", B, T, C);
        expect_same(what, dres_g, dres_r, (size_t)BT * C);
        expect_same("layernorm_backward dweight", dw_g, dw_r, C);
        expect_same("layernorm_backward dbias", db_g, db_r, C);
        // a sequence- or context-parallel rank (its zig-zag slice of each sequence, 8/K chunks;
        // R2Z's unequal pieces when 2K does not divide T): the per-sequence subtrees of the
        // parameter gradients
        for (int K = 2; K <= 8 && T >= 2 * K; K *= 2) {
            for (int r = 0; r < K; r += K - 1) {
                float *sp_r = zero_buf(2 * (size_t)B * C), *sp_g = zero_buf(2 * (size_t)B * C);
                layernorm_backward(dres_r, dw_r, db_r, dy, x, w, mean_r, rstd_r, B, T, K, r, C, sp_r);
                thread_layernorm_backward(dres_g, dw_g, db_g, dy, x, w, mean_r, rstd_r, B, T, K, r, C, sp_g);
                snprintf(what, sizeof(what), "layernorm_backward sequence partials B=%d T=%d, slice %d of %d C=%d", B, T,
                         r, K, C);
                expect_same(what, sp_g, sp_r, 2 * (size_t)B * C);
                free(sp_r); free(sp_g);
            }
        }
        free(x); free(w); free(b); free(dy); free(out_r); free(mean_r); free(rstd_r); free(out_g);
        free(mean_g); free(rstd_g); free(dres_r); free(dres_g); free(dw_r); free(db_r); free(dw_g); free(db_g);
    }
}

static void test_attention(void) {
    int shapes[][4] = {{1, 1, 8, 2}, {2, 5, 8, 2}, {2, 9, 24, 3}, {1, 150, 16, 1}, {2, 131, 32, 2}, {1, 20, 128, 2}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], NH = shapes[s][3];
        size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, natt = (size_t)B * NH * T * T;
        float *qkv = rand_buf(nqkv), *dout = rand_buf(nout);
        float *out_r = zero_buf(nout), *att_r = zero_buf(natt), *out_g = zero_buf(nout), *att_g = zero_buf(natt);
        attention_forward(out_r, att_r, qkv, B, T, C, NH);
        thread_attention_forward(out_g, att_g, qkv, B, T, C, NH);
        char what[96];
        snprintf(what, sizeof(what), "attention_forward out B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_same(what, out_g, out_r, nout);
        snprintf(what, sizeof(what), "attention_forward att B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_same(what, att_g, att_r, natt);
        float *dqkv_r = zero_buf(nqkv), *dqkv_g = zero_buf(nqkv);
        attention_backward(dqkv_r, dout, qkv, att_r, B, T, C, NH);
        thread_attention_backward(dqkv_g, dout, qkv, att_r, B, T, C, NH);
        snprintf(what, sizeof(what), "attention_backward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_same(what, dqkv_g, dqkv_r, nqkv);
        free(qkv); free(dout); free(out_r); free(att_r); free(out_g); free(att_g); free(dqkv_r); free(dqkv_g);
    }
}

// Serving's paged attention (train_gpt2.c attention_forward_paged): a few sequences laid out
// over T positions, their keys and values in blocks of bs positions dealt in a shuffled order,
// and N query rows of them in a shuffled order, each at its own position. Reference: row p of
// attention_forward over that one sequence (1,T), the trainer's whole pass.
typedef struct {
    int T, C, NH, bs, N, max_blocks;
    float *qkv_rows, *kv, *want;   // (N,3C) queries; the cache (blocks,bs,2C); (N,C) the pass's rows
    int *tables, *pos;             // (N,max_blocks), (N)
    long block_stride;
} PagedCase;

static PagedCase paged_case(int S, int T, int C, int NH, int bs) {
    PagedCase k = {T, C, NH, bs, 0, (T + bs - 1) / bs, NULL, NULL, NULL, NULL, NULL, (long)bs * 2 * C};
    int nblocks = S * k.max_blocks, *order = (int*)malloc(sizeof(int) * nblocks);
    for (int i = 0; i < nblocks; i++) { order[i] = i; }
    for (int i = nblocks - 1; i > 0; i--) {
        int j = (int)(random_u32(&rng_state) % (uint32_t)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    k.kv = rand_buf((size_t)nblocks * k.block_stride);
    k.N = S * T;
    k.qkv_rows = zero_buf((size_t)k.N * 3 * C);
    k.want = zero_buf((size_t)k.N * C);
    k.tables = (int*)malloc(sizeof(int) * (size_t)k.N * k.max_blocks);
    k.pos = (int*)malloc(sizeof(int) * (size_t)k.N);
    float *out = zero_buf((size_t)T * C), *att = zero_buf((size_t)NH * T * T);
    for (int q = 0; q < S; q++) {
        float* qkv = rand_buf((size_t)T * 3 * C);   // sequence q's pass; its k, v into its blocks
        const int* blocks = order + q * k.max_blocks;
        for (int p = 0; p < T; p++) {
            memcpy(k.kv + blocks[p / bs] * k.block_stride + (size_t)(p % bs) * 2 * C, qkv + (size_t)p * 3 * C + C,
                   sizeof(float) * 2 * C);
        }
        attention_forward(out, att, qkv, 1, T, C, NH);
        for (int p = 0; p < T; p++) {   // row (q, p) goes to a scattered place among the N
            int r = (int)(((size_t)q * T + p) * 7919 % (size_t)k.N);
            memcpy(k.qkv_rows + (size_t)r * 3 * C, qkv + (size_t)p * 3 * C, sizeof(float) * 3 * C);
            memcpy(k.want + (size_t)r * C, out + (size_t)p * C, sizeof(float) * C);
            memcpy(k.tables + (size_t)r * k.max_blocks, blocks, sizeof(int) * k.max_blocks);
            k.pos[r] = p;
        }
        free(qkv);
    }
    free(out); free(att); free(order);
    return k;
}

static void paged_case_free(PagedCase* k) {
    free(k->qkv_rows); free(k->kv); free(k->want); free(k->tables); free(k->pos);
}

static const int paged_shapes[][5] = {{1, 1, 8, 2, 16}, {3, 9, 24, 3, 4}, {2, 40, 16, 2, 3}, {2, 131, 32, 2, 16}};   // S T C NH bs

static void test_attention_paged(void) {
    for (size_t s = 0; s < sizeof(paged_shapes) / sizeof(paged_shapes[0]); s++) {
        const int* sh = paged_shapes[s];
        PagedCase k = paged_case(sh[0], sh[1], sh[2], sh[3], sh[4]);
        float *out = zero_buf((size_t)k.N * k.C), *scratch = zero_buf((size_t)k.N * k.NH * k.T + (size_t)k.T * 3 * k.C);
        attention_forward_paged(out, scratch, k.qkv_rows, k.kv, k.block_stride, k.tables, k.max_blocks, k.pos, k.N,
                                k.T, k.bs, k.C, k.NH);
        char what[96];
        snprintf(what, sizeof(what), "attention_forward_paged S=%d T=%d C=%d NH=%d bs=%d", sh[0], sh[1], sh[2], sh[3], sh[4]);
        expect_same(what, out, k.want, (size_t)k.N * k.C);
        free(out); free(scratch);
        paged_case_free(&k);
    }
}

// Context parallelism's attention blocks (train_gpt2.c attention_*_block): rank r's queries
// against block s's keys and values. The products as det_gemm computes them (the ZZ causal
// variants of gpu_plan.h), the softmax rows as the lanes of attention_softmax_blocks_kernel
// compute them (lane L: chunk L % (8/N) of block L / (8/N), canon_tree8 of the 8 lanes).
static void thread_softmax_blocks_row(float* a, int t, int T, int N, int r) {
    int per = CANON_R / N;
    long p = canon_zz_global(t, T, N, r);
    float maxv = -canon_inf();
    for (int s = 0; s < N; s++) {
        float* blk = a + canon_zz_offset(T, N, s);
        for (int j = 0; j < canon_zz_count_le(p, T, N, s); j++) { if (blk[j] > maxv) { maxv = blk[j]; } }
    }
    for (int s = 0; s < N; s++) {
        float* blk = a + canon_zz_offset(T, N, s);
        for (int j = 0; j < canon_zz_count_le(p, T, N, s); j++) { blk[j] = canon_expf(blk[j] - maxv); }
    }
    float lanes[CANON_R];
    for (int L = 0; L < CANON_R; L++) {
        int s = L / per;
        lanes[L] = det_zz_chunk_row(a + canon_zz_offset(T, N, s), NULL, T, N, s, L % per, canon_zz_count_le(p, T, N, s));
    }
    float z = canon_tree8(lanes);
    for (int s = 0; s < N; s++) {
        int cnt = canon_zz_count_le(p, T, N, s);
        float* blk = a + canon_zz_offset(T, N, s);
        for (int j = 0; j < canon_zz_len(T, N, s); j++) { blk[j] = j < cnt ? blk[j] / z : 0.0f; }
    }
}

static void thread_softmax_backward_blocks_row(float* d, const float* at, int t, int T, int N, int r, float scale) {
    int per = CANON_R / N;
    long p = canon_zz_global(t, T, N, r);
    float lanes[CANON_R];
    for (int L = 0; L < CANON_R; L++) {
        int s = L / per;
        long col = canon_zz_offset(T, N, s);
        lanes[L] = det_zz_chunk_row(at + col, d + col, T, N, s, L % per, canon_zz_count_le(p, T, N, s));
    }
    float S = canon_tree8(lanes);
    for (int s = 0; s < N; s++) {
        long col = canon_zz_offset(T, N, s);
        for (int j = 0; j < canon_zz_count_le(p, T, N, s); j++) { d[col + j] = at[col + j] * (d[col + j] - S) * scale; }
    }
}

static void test_attention_blocks(void) {
    // B T C NH N; with T not a multiple of 2N, R2Z's unequal pieces (--varlen)
    int shapes[][5] = {{1, 16, 8, 2, 2}, {2, 32, 16, 2, 4}, {1, 48, 24, 3, 8}, {2, 280, 32, 2, 4}, {1, 21, 16, 2, 2},
                       {1, 45, 24, 3, 4}, {1, 37, 16, 2, 8}};
    for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++) {
        int B = shapes[k][0], T = shapes[k][1], C = shapes[k][2], NH = shapes[k][3], N = shapes[k][4];
        size_t nl = (size_t)B * zz_max_len(T, N) * C;   // room for any rank's (B, Tl, C)
        float scale = canon_rsqrtf((float)(C / NH));
        float *qkv = rand_buf(3 * nl), *dout = rand_buf(nl), *kv = rand_buf(2 * (size_t)N * nl);
        for (int r = 0; r < N; r++) {
            int Tq = (int)canon_zz_len(T, N, r);
            size_t natt = (size_t)B * NH * Tq * T;
            float *att = zero_buf(natt), *att_t = zero_buf(natt), *ds = zero_buf(natt), *ds_t = zero_buf(natt);
            float *o = zero_buf(nl), *o_t = zero_buf(nl), *o2 = zero_buf(nl), *o2_t = zero_buf(nl);
            char what[128];
            for (int s = 0; s < N; s++) {
                attention_scores_block(att, qkv, kv + s * nl, B, T, C, NH, N, r, s);
                DetGemmArgs g = det_args_attention_block_products(att_t, qkv, 3L * C, kv + s * nl, B, T, C, NH, N, r, s, scale);
                thread_gemm(&g);
            }
            attention_softmax_blocks(att, B, T, NH, N, r);
            for (long row = 0; row < (long)B * NH * Tq; row++) { thread_softmax_blocks_row(att_t + row * T, (int)(row % Tq), T, N, r); }
            snprintf(what, sizeof(what), "attention blocks B=%d T=%d C=%d NH=%d, rank %d of %d: probabilities", B, T, C, NH, r, N);
            expect_same(what, att_t, att, natt);
            for (int s = 0; s < N; s++) {
                attention_datt_block(ds, dout, kv + (N + s) * nl, B, T, C, NH, N, r, s);
                DetGemmArgs g = det_args_attention_block_products(ds_t, dout, C, kv + (N + s) * nl, B, T, C, NH, N, r, s, 1.0f);
                thread_gemm(&g);
                attention_values_block(o, att, kv + (N + s) * nl, B, T, C, NH, N, r, s);
                g = det_args_attention_block_by_keys(o_t, att, kv + (N + s) * nl, B, T, C, NH, N, r, s);
                thread_gemm(&g);
                snprintf(what, sizeof(what), "attention_values_block rank %d of %d, block %d", r, N, s);
                expect_same(what, o_t, o, nl);
            }
            attention_softmax_backward_blocks(ds, att, B, T, C, NH, N, r);
            for (long row = 0; row < (long)B * NH * Tq; row++) {
                thread_softmax_backward_blocks_row(ds_t + row * T, att + row * T, (int)(row % Tq), T, N, r, scale);
            }
            expect_same("attention_softmax_backward_blocks (ds)", ds_t, ds, natt);
            for (int s = 0; s < N; s++) {
                attention_dq_block(o, ds, kv + s * nl, B, T, C, NH, N, r, s);
                DetGemmArgs g = det_args_attention_block_by_keys(o_t, ds, kv + s * nl, B, T, C, NH, N, r, s);
                thread_gemm(&g);
                snprintf(what, sizeof(what), "attention_dq_block rank %d of %d, block %d", r, N, s);
                expect_same(what, o_t, o, nl);
                attention_dkv_block(o, o2, ds, att, qkv, dout, B, T, C, NH, N, r, s);
                g = det_args_attention_block_by_queries(o_t, ds, qkv, 3L * C, B, T, C, NH, N, r, s);
                thread_gemm(&g);
                g = det_args_attention_block_by_queries(o2_t, att, dout, C, B, T, C, NH, N, r, s);
                thread_gemm(&g);
                snprintf(what, sizeof(what), "attention_dkv_block rank %d of %d, block %d: dk", r, N, s);
                expect_same(what, o_t, o, nl);
                expect_same("attention_dkv_block dv", o2_t, o2, nl);
            }
            free(att); free(att_t); free(ds); free(ds_t); free(o); free(o_t); free(o2); free(o2_t);
        }
        free(qkv); free(dout); free(kv);
    }
    // the weight gradients' per-sequence subtrees of a zig-zag slice (its 8/D chunks), of
    // sequences of 24 positions and of 21 (R2Z's unequal pieces), the first and last rank
    int B = 3, K = 20, OC = 17;
    long stride = (long)OC * K + OC + 5;
    for (int T = 24; T >= 21; T -= 3) {
        float *inp = rand_buf((size_t)B * T * K), *dout = rand_buf((size_t)B * T * OC);
        for (int D = 1; D <= CANON_R; D *= 2) {
            for (int r = 0; r < D; r += D > 1 ? D - 1 : 1) {
                float *seq = zero_buf(B * stride), *seq_t = zero_buf(B * stride);
                matmul_backward_seqs(seq, seq + (long)OC * K, stride, dout, inp, B, T, D, r, K, OC);
                DetGemmArgs g = det_args_matmul_dweight(seq_t, dout, inp, B, T, D, r, K, OC);
                g.o_zhi = stride;
                thread_gemm(&g);
                for (int b = 0; b < B; b++) {
                    for (int o = 0; o < OC; o++) {
                        float leaves[CANON_R];
                        for (int ch = 0; ch < CANON_R / D; ch++) { leaves[ch] = det_position_leaf(dout, 0, OC, o, b, T, D, r, ch); }
                        seq_t[b * stride + (long)OC * K + o] = canon_tree_sum(leaves, CANON_R / D, 1);
                    }
                }
                char what[96];
                snprintf(what, sizeof(what), "matmul_backward_seqs T=%d, slice %d of %d", T, r, D);
                expect_same(what, seq_t, seq, B * stride);
                free(seq); free(seq_t);
            }
        }
        free(inp); free(dout);
    }
}

static void test_crossentropy(void) {
    int shapes[][3] = {{3, 5, 8}, {2, 7, 7}, {4, 100, 128}, {2, 1000, 1024}};   // BT, V, Vp
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int BT = shapes[s][0], V = shapes[s][1], Vp = shapes[s][2];
        float* logits = rand_buf((size_t)BT * Vp);
        int* targets = rand_tokens(BT, V);
        float *p_r = copy_buf(logits, (size_t)BT * Vp), *p_g = copy_buf(logits, (size_t)BT * Vp);
        float *l_r = zero_buf(BT), *l_g = zero_buf(BT);
        cpu_crossentropy_forward(p_r, l_r, targets, BT, V, Vp);
        thread_crossentropy_forward(p_g, l_g, targets, BT, V, Vp);
        char what[96];
        snprintf(what, sizeof(what), "crossentropy_forward probs BT=%d V=%d Vp=%d", BT, V, Vp);
        expect_same(what, p_g, p_r, (size_t)BT * Vp);
        expect_same("crossentropy_forward losses", l_g, l_r, BT);
        // a vocab-parallel rank's slice: its max, chunk subtree of Z, target logit (or -0)
        for (int K = 2; K <= 8 && Vp % K == 0; K *= 2) {
            int Vl = Vp / K, v0 = (K - 1) * Vl;
            float *slice_r = zero_buf((size_t)BT * Vl), *slice_g = zero_buf((size_t)BT * Vl);
            for (int i = 0; i < BT; i++) { memcpy(slice_r + (size_t)i * Vl, logits + (size_t)i * Vp + v0, Vl * 4); }
            memcpy(slice_g, slice_r, (size_t)BT * Vl * 4);
            float *ce_r = zero_buf(3 * (size_t)BT), *ce_g = zero_buf(3 * (size_t)BT);
            crossentropy_max(ce_r, slice_r, BT, V, v0, Vl);
            crossentropy_exps(ce_r + BT, ce_r + 2 * BT, slice_r, ce_r, targets, BT, V, v0, Vl, CANON_R / K);
            thread_crossentropy_slice(slice_g, ce_g, ce_g + BT, ce_g + 2 * BT, targets, BT, V, v0, Vl, CANON_R / K);
            snprintf(what, sizeof(what), "cross-entropy of the last of %d vocabulary slices, Vp=%d", K, Vp);
            expect_same(what, ce_g, ce_r, 3 * (size_t)BT);
            expect_same("cross-entropy slice exps", slice_g, slice_r, (size_t)BT * Vl);
            free(slice_r); free(slice_g); free(ce_r); free(ce_g);
        }
        free(logits); free(targets); free(p_r); free(p_g); free(l_r); free(l_g);
    }
}

static void test_position_reductions(void) {
    int shapes[][3] = {{1, 1, 1}, {3, 5, 1}, {4, 33, 1}, {2, 17, 40}, {5, 3, 7}};   // B, T, OC
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int B = shapes[s][0], T = shapes[s][1], OC = shapes[s][2];
        float* x = rand_buf((size_t)B * T * OC);
        float* got = zero_buf(OC);
        thread_position_reduce(got, x, 0, B, T, OC);
        if (OC == 1) {
            float want = position_sum(x, B, T);
            CHECK(memcmp(got, &want, 4) == 0, "position_sum B=%d T=%d: %.9g vs %.9g", B, T, got[0], want);
        }
        // the bf16 path (fast mode's bias gradients): the same bits as fp32 on the rounded values
        uint16_t* h = bf16_round(x, (size_t)B * T * OC);
        float* want = zero_buf(OC);
        float* got16 = zero_buf(OC);
        thread_position_reduce(want, x, 0, B, T, OC);
        thread_position_reduce(got16, h, 1, B, T, OC);
        expect_same("position reduction of bf16 values", got16, want, OC);
        free(x); free(got); free(h); free(want); free(got16);
    }
}

static void test_encoder_backward(void) {
    int shapes[][5] = {{1, 1, 1, 4, 1}, {2, 5, 3, 16, 8}, {3, 20, 7, 64, 20}, {4, 9, 33, 128, 16}};   // B T C Vp maxT
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], Vp = shapes[s][3], maxT = shapes[s][4];
        int BT = B * T;
        int* inp = rand_tokens(BT, Vp < 11 ? Vp : 11);   // few distinct tokens: many repeats
        float* dout = rand_buf((size_t)BT * C);
        dout[0] = -0.0f;   // 0.0f + -0.0f is +0.0f: the CPU's dwpe terms start from 0.0f
        float *dwte_r = rand_buf((size_t)Vp * C), *dwpe_r = rand_buf((size_t)maxT * C);
        float *dwte_g = rand_buf((size_t)Vp * C), *dwpe_g = rand_buf((size_t)maxT * C);
        encoder_backward(dwte_r, dwpe_r, dout, inp, B, T, C, 0, Vp, maxT);
        thread_encoder_backward(dwte_g, dwpe_g, dout, 0, inp, B, T, C, 0, Vp, maxT);
        char what[96];
        snprintf(what, sizeof(what), "encoder_backward dwte B=%d T=%d C=%d", B, T, C);
        expect_same(what, dwte_g, dwte_r, (size_t)Vp * C);
        expect_same("encoder_backward dwpe", dwpe_g, dwpe_r, (size_t)maxT * C);
        // a vocab-parallel rank's rows: the second half of the vocabulary
        if (Vp >= 2) {
            int Vl = Vp / 2;
            encoder_backward(dwte_r, dwpe_r, dout, inp, B, T, C, Vl, Vl, maxT);
            thread_encoder_backward(dwte_g, dwpe_g, dout, 0, inp, B, T, C, Vl, Vl, maxT);
            expect_same("encoder_backward dwte of a vocab-parallel rank's rows", dwte_g, dwte_r, (size_t)Vl * C);
        }
        uint16_t* h = bf16_round(dout, (size_t)BT * C);
        encoder_backward(dwte_r, dwpe_r, dout, inp, B, T, C, 0, Vp, maxT);
        thread_encoder_backward(dwte_g, dwpe_g, h, 1, inp, B, T, C, 0, Vp, maxT);
        expect_same("encoder_backward dwte from bf16", dwte_g, dwte_r, (size_t)Vp * C);
        expect_same("encoder_backward dwpe from bf16", dwpe_g, dwpe_r, (size_t)maxT * C);
        free(inp); free(dout); free(dwte_r); free(dwpe_r); free(dwte_g); free(dwpe_g); free(h);
    }
}

// sumsq_kernel: per-thread accumulators whose digits are added in any order
static void test_sumsq(void) {
    size_t n = 100003;
    float* g = rand_buf(n);
    g[5] = 0.0f; g[7] = 1e-40f; g[11] = -3e38f;   // zero, subnormal, huge
    SumSq all;
    canon_sumsq_init(&all);
    for (size_t i = 0; i < n; i++) { canon_sumsq_add(&all, g[i]); }
    float want = (float)sqrt(canon_sumsq_value(&all));
    for (int threads = 1; threads <= 1000; threads *= 10) {
        SumSq total;
        canon_sumsq_init(&total);
        for (int t = threads - 1; t >= 0; t--) {   // any order
            SumSq mine;
            canon_sumsq_init(&mine);
            for (size_t i = t; i < n; i += threads) { canon_sumsq_add(&mine, g[i]); }
            for (int d = 0; d < CANON_SUMSQ_DIGITS; d++) { total.digit[d] += mine.digit[d]; }
            total.nonfinite += mine.nonfinite;
        }
        total.pending = 0;
        float got = (float)sqrt(canon_sumsq_value(&total));
        CHECK(memcmp(&got, &want, 4) == 0, "gradient norm from %d accumulators: %.9g vs %.9g", threads, got, want);
    }
    free(g);
}

// ==========================================================================================
// 2. the plan
// ==========================================================================================

// det_gemm_kernel's thread mapping (gpu_plan.h): the 256 threads load every element of the A
// and B tiles exactly once, in both load orders, and own every output of the 128 x 64 block
// tile exactly once, with the float4 reads of the tiles 16-byte aligned.
static void test_det_gemm_threads(void) {
    for (int rc = 0; rc <= 1; rc++) {
        static int a_seen[DET_MT][DET_KT], b_seen[DET_NT][DET_KT];
        memset(a_seen, 0, sizeof(a_seen));
        memset(b_seen, 0, sizeof(b_seen));
        int bad = 0;
        for (int tid = 0; tid < DET_THREADS; tid++) {
            for (int e = 0; e < DET_A_PER_THREAD; e++) {
                int mi, kk;
                det_tile_a_slot(tid, e, rc, &mi, &kk);
                if (mi < 0 || mi >= DET_MT || kk < 0 || kk >= DET_KT) { bad++; } else { a_seen[mi][kk]++; }
            }
            for (int e = 0; e < DET_B_PER_THREAD; e++) {
                int ni, kk;
                det_tile_b_slot(tid, e, rc, &ni, &kk);
                if (ni < 0 || ni >= DET_NT || kk < 0 || kk >= DET_KT) { bad++; } else { b_seen[ni][kk]++; }
            }
        }
        for (int i = 0; i < DET_MT; i++) { for (int k = 0; k < DET_KT; k++) { bad += a_seen[i][k] != 1; } }
        for (int i = 0; i < DET_NT; i++) { for (int k = 0; k < DET_KT; k++) { bad += b_seen[i][k] != 1; } }
        CHECK(bad == 0, "det_gemm tile loads (along %s): %d elements not loaded exactly once", rc ? "r" : "m/n", bad);
    }
    static int out_seen[DET_MT][DET_NT];
    memset(out_seen, 0, sizeof(out_seen));
    int bad = 0;
    for (int tid = 0; tid < DET_THREADS; tid++) {
        for (int i = 0; i < 8; i++) {
            int r = det_out_row(tid, i);
            // rows i = 0..3 and 4..7 are each one float4 of the A tile: consecutive, aligned
            if (i % 4 != 0 ? r != det_out_row(tid, i - 1) + 1 : r % 4 != 0) { bad++; }
            for (int j = 0; j < 4; j++) {
                int n = det_out_col(tid, j);
                if (j != 0 ? n != det_out_col(tid, j - 1) + 1 : n % 4 != 0) { bad++; }
                if (r < 0 || r >= DET_MT || n < 0 || n >= DET_NT) { bad++; } else { out_seen[r][n]++; }
            }
        }
    }
    for (int r = 0; r < DET_MT; r++) { for (int n = 0; n < DET_NT; n++) { bad += out_seen[r][n] != 1; } }
    CHECK(bad == 0, "det_gemm outputs: %d not owned by exactly one thread (or float4 reads misaligned)", bad);
    // the shared tiles' rows (pitch DET_MT + 4, DET_NT + 4 floats) keep float4 reads aligned
    CHECK((DET_MT + 4) % 4 == 0 && (DET_NT + 4) % 4 == 0, "det_gemm shared-memory pitch breaks float4 alignment");
    CHECK(2 * DET_KT * ((DET_MT + 4) + (DET_NT + 4)) * 4 <= 48 * 1024, "det_gemm static shared memory over 48 KB");
}

// The startup check of every launch (gpu_plan.h gpu_launch_problem) and the sizes it guards:
// GPT-2 124M at B=64, T=1024 fits in both modes (its B*T*Vp logits are past 2^31 elements,
// which every kernel indexes in 64 bits); impossible shapes are refused with a reason.
static void test_launch_plans(void) {
    char buf[256];
    GPT2Config d12;
    config_from_descriptor("d12", &d12);
    for (int det = 0; det <= 1; det++) {
        const char* p = gpu_launch_problem(&d12, 64, 1024, det, 1024, buf, sizeof(buf));
        CHECK(p == NULL, "d12 B=64 T=1024 %s mode: %s", det ? "deterministic" : "fast", p ? p : "");
    }
    CHECK((size_t)64 * 1024 * d12.padded_vocab_size > ((size_t)1 << 31), "the d12 B=64 logits exceed 2^31 elements");
    // every det_gemm of d12 at B=64, T=1024 has a grid within CUDA's limits
    {
        int B = 64, T = 1024, C = 768, NH = 12, Vp = d12.padded_vocab_size, BT = B * T;
        DetGemmArgs gs[] = {
            det_args_matmul_forward(NULL, NULL, NULL, NULL, BT, C, Vp, CANON_R),
            det_args_matmul_forward(NULL, NULL, NULL, NULL, BT, 4 * C, C, CANON_R),
            det_args_matmul_dinp(NULL, NULL, NULL, BT, C, Vp, 1, CANON_R),
            det_args_matmul_dinp(NULL, NULL, NULL, BT, C, 3 * C, 3, CANON_R),
            det_args_matmul_dweight(NULL, NULL, NULL, B, T, 1, 0, C, Vp),
            det_args_matmul_dweight(NULL, NULL, NULL, B, T, 1, 0, 4 * C, C),
            det_args_attention_scores(NULL, NULL, B, T, C, NH),
            det_args_attention_datt(NULL, NULL, NULL, B, T, C, NH),
            det_args_attention_by_keys(NULL, C, NULL, NULL, 3L * C, B, T, C, NH),
            det_args_attention_by_queries(NULL, 3L * C, NULL, NULL, 3L * C, B, T, C, NH),
        };
        int ok = 1;
        unsigned gx = 0, gy = 0, gz = 0;
        for (size_t i = 0; i < sizeof(gs) / sizeof(gs[0]); i++) {
            ok &= det_gemm_grid(gs[i].M, gs[i].N, gs[i].Z, &gx, &gy, &gz) && gy <= 65535 && gz <= 65535;
            // the largest offset the kernel forms, (Z-1) z-stride + (M-1) m-stride + ..., is a long
            long zmax = det_zoff(gs[i].Z - 1, gs[i].zdiv, gs[i].o_zhi, gs[i].o_zlo);
            ok &= zmax + (long)(gs[i].M - 1) * gs[i].o_m + gs[i].N - 1 >= 0;
        }
        CHECK(ok, "a deterministic d12 B=64 T=1024 launch exceeds CUDA's grid");
        // the elementwise and row kernels: grid-stride (capped) or one block per row
        CHECK(elementwise_blocks((size_t)BT * Vp, 256) == 65536 * 8 && ceil_div_u((size_t)BT, 1) == (unsigned)BT, "elementwise grid");
        CHECK((size_t)B * NH * T * 32 / 256 <= 2147483647u && (long)B * NH <= 65535, "attention rows / flash grid");
    }
    // refused: Vp not a multiple of 8 (fast), B*NH past flash attention's grid.y, row tiles past
    // det_gemm's grid.y, more than 2^31 gradient values (head sizes are fast mode's attention
    // setup's to judge: cuDNN runs those flash attention lacks)
    GPT2Config c = d12;
    c.padded_vocab_size = c.vocab_size;   // 50257: an llm.c file could say so
    CHECK(gpu_launch_problem(&c, 4, 64, 0, 0, buf, sizeof(buf)) != NULL && strstr(buf, "multiples of 8"), "Vp=V fast");
    CHECK(gpu_launch_problem(&c, 4, 64, 1, 0, buf, sizeof(buf)) == NULL, "Vp=V deterministic is fine");
    CHECK(gpu_launch_problem(&d12, 6000, 16, 0, 0, buf, sizeof(buf)) != NULL && strstr(buf, "grid.y"), "B*NH > 65535");
    CHECK(gpu_launch_problem(&d12, 65536, 256, 1, 0, buf, sizeof(buf)) != NULL, "B*T past the det grid / 32-bit rows");
    GPT2Config big;
    config_from_descriptor("d48c4096h32", &big);
    CHECK(gpu_launch_problem(&big, 1, 64, 0, 0, buf, sizeof(buf)) != NULL && strstr(buf, "2^31"), "2^31 gradient values");
    // fast mode's per-layer softmax statistics: every layer's block 16-byte aligned for cuDNN,
    // none overlapping the next (B*NH*T = 1*3*7 = 21 floats is not a multiple of 4)
    for (long b = 1; b <= 3; b++) {
        for (long t = 1; t <= 9; t++) {
            size_t stride = gpu_attention_stats_stride(b, 3, t);
            CHECK(stride * sizeof(float) % 16 == 0 && stride >= (size_t)(b * 3 * t) && stride < (size_t)(b * 3 * t) + 4,
                  "stats stride of B=%ld NH=3 T=%ld: %zu floats", b, t, stride);
        }
    }
}

static void test_plan(void) {
    // the initialisation (llmc/gpt2_init.h) against its definition: layernorm weights 1, biases
    // and padded vocabulary rows 0, weights N(0, 0.02) and the residual projections
    // N(0, 0.02/sqrt(2L)) (sample std within 3%), reproducible for a seed, different across seeds;
    // with experts, each expert as GPT-2's MLP and the router N(0, 0.02)
    for (int moe = 0; moe <= 1; moe++) {
        GPT2Config ci;
        config_from_descriptor(moe ? "d4e4k2" : "d4", &ci);
        size_t P = param_count(&ci);
        float* a = (float*)aligned_calloc_or_die(P * sizeof(float), "params");
        float* b = (float*)aligned_calloc_or_die(P * sizeof(float), "params");
        gpt2_init_params(a, &ci, 42);
        gpt2_init_params(b, &ci, 42);
        CHECK(memcmp(a, b, P * sizeof(float)) == 0, "the same seed gives different parameters");
        gpt2_init_params(b, &ci, 43);
        CHECK(memcmp(a, b, P * sizeof(float)) != 0, "different seeds give the same parameters");
        for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
            if (param_tensor_elements(&ci, t) == 0) { continue; }   // the dense model's router
            int layers = param_is_layer_tensor(t) ? ci.num_layers : 1;
            double sum = 0, sum2 = 0;
            size_t n = 0;
            int ones = 1, zeros = 1;
            for (int l = 0; l < layers; l++) {
                const float* p = a + param_offset(&ci, t, l);
                size_t cnt = param_tensor_elements(&ci, t);
                if (t == P_WTE) {   // padded rows are zero
                    for (size_t i = (size_t)ci.vocab_size * ci.channels; i < cnt; i++) { zeros &= p[i] == 0.0f; }
                    cnt = (size_t)ci.vocab_size * ci.channels;
                }
                for (size_t i = 0; i < cnt; i++) {
                    sum += p[i];
                    sum2 += (double)p[i] * p[i];
                    ones &= p[i] == 1.0f;
                    if (t != P_WTE) { zeros &= p[i] == 0.0f; }
                }
                n += cnt;
            }
            if (t == P_LN1W || t == P_LN2W || t == P_LNFW) {
                CHECK(ones, "%s should be all ones", param_tensor_names[t]);
            } else if (!param_is_decayed(t)) {
                CHECK(zeros, "%s should be all zeros", param_tensor_names[t]);
            } else {
                double want = t == P_ATTPROJW || t == P_FCPROJW ? 0.02 / sqrt(2.0 * ci.num_layers) : 0.02;
                double sd = sqrt(sum2 / n - (sum / n) * (sum / n));
                CHECK(fabs(sd / want - 1.0) < 0.03 && fabs(sum / n) < 0.1 * want, "%s: mean %.3g std %.4g, "
                      "expected N(0, %.4g)", param_tensor_names[t], sum / n, sd, want);
                if (t == P_WTE) { CHECK(zeros, "wte's padded rows should be zero"); }
            }
        }
        free(a);
        free(b);
    }
    // launch grids of GPT-2 124M at B=64, T=1024 fit; an impossible one is refused
    unsigned gx, gy, gz;
    CHECK(det_gemm_grid(64 * 1024, 50304, 1, &gx, &gy, &gz) && gx == 786 && gy == 512, "LM head grid");
    CHECK(det_gemm_grid(50304, 768, 64, &gx, &gy, &gz) && gz == 64, "LM head weight-gradient grid");
    CHECK(det_gemm_grid(1024, 1024, 64 * 12, &gx, &gy, &gz) && gx == 16 && gy == 8, "attention grid");
    CHECK(!det_gemm_grid((long)DET_MT * 65536, 64, 1, &gx, &gy, &gz), "too many row tiles must be refused");
    test_launch_plans();

    const char* name;
    CHECK(gpu_peak_tflops(9, 0, "NVIDIA H100 80GB HBM3", 0, &name) == 989.0, "H100 bf16 peak");
    CHECK(gpu_peak_tflops(9, 0, "NVIDIA H200", 1, &name) == 67.0, "H200 fp32 peak");
    CHECK(gpu_peak_tflops(9, 0, "NVIDIA H100 PCIe", 0, &name) == 756.0, "H100 PCIe peak");
    CHECK(gpu_peak_tflops(8, 0, "NVIDIA A100-SXM4-80GB", 0, &name) == 312.0, "A100 peak");
    CHECK(gpu_peak_tflops(8, 9, "NVIDIA L4", 0, &name) == 0.0, "unknown GPU: no MFU");
}

// ==========================================================================================
// 3. the binary
// ==========================================================================================

// runs a shell command; returns its exit status, its output (stdout + stderr) in out
static int run_cmd(const char* cmd, char* out, size_t cap) {
    char full[1024];
    snprintf(full, sizeof(full), "%s 2>&1", cmd);
    FILE* p = popen(full, "r");
    if (!p) { return -1; }
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int count_error_lines(const char* out) {
    int n = 0;
    for (const char* s = out; (s = strstr(s, "error:")) != NULL; s++) {
        if (s == out || s[-1] == '\n') { n++; }
    }
    return n;
}

static void test_binary(void) {
    static char out[1 << 16];
    int rc;
    if (file_exists("train_gpt2cu_emu")) {
        // fast mode runs there on the flash kernels (the emulator has no cuDNN)
        rc = run_cmd("./train_gpt2cu_emu --deterministic 0 --attention cudnn -e d2c32h2v64t32 -t 8 -x 1", out, sizeof(out));
        CHECK(rc == 1 && count_error_lines(out) == 1 && strstr(out, "error: --attention cudnn: the emulated GPU has no cuDNN"),
              "train_gpt2cu_emu must refuse --attention cudnn with one line (exit %d): %s", rc, out);
    }
    if (!file_exists("train_gpt2cu")) {
        printf("note: ./train_gpt2cu not built (no CUDA): its command-line checks are skipped\n");
        return;
    }
    rc = run_cmd("./train_gpt2cu --help", out, sizeof(out));
    CHECK(rc == 0 && strstr(out, "--deterministic") && strstr(out, "--grad-clip"), "train_gpt2cu --help (exit %d)", rc);
    const char* refused[][2] = {
        {"./train_gpt2cu --tp 2 -e d2c32h2v64t32 -t 8", "does not divide"},
        {"./train_gpt2cu --sp 1 -e d2c32h2v64t32 -t 8", "--sp 1"},
        {"./train_gpt2cu -b 0", "microbatch size"},
        {"./train_gpt2cu --deterministic 2", "--deterministic"},
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        rc = run_cmd(refused[i][0], out, sizeof(out));
        CHECK(rc == 1 && count_error_lines(out) == 1 && strstr(out, refused[i][1]),
              "'%s' must fail with one error line about '%s' (exit %d): %s", refused[i][0], refused[i][1], rc, out);
    }
    // no GPU: one clear line; with a GPU the run gets as far as the (missing) data
    rc = run_cmd("./train_gpt2cu -e d2c32h2v64t32 -i /nonexistent/train.bin -j /nonexistent/val.bin -b 2 -t 8 -x 1",
                 out, sizeof(out));
    int no_gpu = strstr(out, "no CUDA GPU") != NULL;
    CHECK(rc == 1 && count_error_lines(out) == 1 && (no_gpu || strstr(out, "no token files")),
          "train_gpt2cu without a GPU (or without data) must fail with one error line (exit %d): %s", rc, out);
    printf("train_gpt2cu: %s\n", no_gpu ? "no GPU here: fails with one clear line" : "a GPU is present");
}

#ifdef TEST_DEVICE
// ==========================================================================================
// 4. the kernels themselves, on a GPU or on the emulated one
// ==========================================================================================
// The device launchers have their CPU twins' names, so they live in namespace gpu here.
#include "llmc/cuda_common.cuh"
namespace gpu {
#include "llmc/kernels_moe_det.cuh"   // the device set (kernels_det.cuh and the experts' twins)
#include <cublasLt.h>   // the emulated build's is dev/gpu/emu's stand-in
#include "llmc/kernels_fast.cuh"
#include "llmc/matmul_cublaslt.cuh"
#include "llmc/attention_flash.cuh"
}

static void* dev_alloc(size_t bytes) {
    void* d = NULL;
    cudaCheck(cudaMalloc(&d, bytes ? bytes : 4));
    cudaCheck(cudaMemset(d, 0xff, bytes ? bytes : 4));   // NaN poison: unwritten outputs show
    return d;
}
static float* dev_floats(const float* h, size_t n) {
    float* d = (float*)dev_alloc(n * 4);
    cudaCheck(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
    return d;
}
static int* dev_ints(const int* h, size_t n) {
    int* d = (int*)dev_alloc(n * 4);
    cudaCheck(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
    return d;
}
static float* host_floats(const float* d, size_t n) {
    float* h = (float*)malloc(4 * (n ? n : 1));
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost));
    return h;
}

// bit-exact comparison of a device fp32 result with the reference
static void expect_device(const char* what, const float* d, const float* want, size_t n) {
    float* got = host_floats(d, n);
    expect_same(what, got, want, n);
    free(got);
}

static void test_device_det(void) {
    // matmul, with the shares of tensor-parallel ranks (nchunks 8/K)
#if LLMC_EMU_RACE_CHECK
    // (every access of the kernels checked: the shapes that take several tiles each way, not
    // GPT-2's K = 768, which the unchecked builds run)
    int mm[][5] = {{1, 1, 1, 1, 1}, {2, 5, 17, 30, 3}, {4, 33, 129, 12, 3}, {2, 70, 200, 130, 1}};
#else
    int mm[][5] = {{1, 1, 1, 1, 1}, {2, 5, 17, 30, 3}, {4, 33, 129, 12, 3}, {2, 70, 200, 130, 1}, {1, 300, 96, 200, 1},
                   {3, 64, 768, 96, 3}};
#endif
    for (size_t s = 0; s < sizeof(mm) / sizeof(mm[0]); s++) {
        int B = mm[s][0], T = mm[s][1], K = mm[s][2], OC = mm[s][3], groups = mm[s][4], BT = B * T;
        char what[128];
        float *inp = rand_buf((size_t)BT * K), *w = rand_buf((size_t)OC * K), *bias = rand_buf(OC);
        float* dout = rand_buf((size_t)BT * OC);
        float *d_inp = dev_floats(inp, (size_t)BT * K), *d_w = dev_floats(w, (size_t)OC * K), *d_bias = dev_floats(bias, OC);
        float* d_dout = dev_floats(dout, (size_t)BT * OC);
        float* d_out = (float*)dev_alloc((size_t)BT * OC * 4);
        float *d_dinp = (float*)dev_alloc((size_t)BT * K * 4), *d_dw = (float*)dev_alloc((size_t)OC * K * 4);
        float* d_db = (float*)dev_alloc((size_t)OC * 4);
        float* ref = zero_buf((size_t)BT * OC);
        float *dinp = zero_buf((size_t)BT * K), *dw = zero_buf((size_t)OC * K), *db = zero_buf(OC);
        for (int nchunks = CANON_R; nchunks >= 1; nchunks /= 4) {
            matmul_forward(ref, inp, w, bias, BT, K, OC, nchunks);
            gpu::matmul_forward(d_out, d_inp, d_w, d_bias, BT, K, OC, nchunks);
            snprintf(what, sizeof(what), "device matmul_forward B=%d T=%d K=%d OC=%d nchunks=%d", B, T, K, OC, nchunks);
            expect_device(what, d_out, ref, (size_t)BT * OC);
            matmul_backward(dinp, dw, db, dout, inp, w, B, T, K, OC, groups, nchunks);
            gpu::matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, B, T, K, OC, groups, nchunks);
            snprintf(what, sizeof(what), "device matmul_backward B=%d T=%d K=%d OC=%d groups=%d nchunks=%d: dinp", B, T,
                     K, OC, groups, nchunks);
            expect_device(what, d_dinp, dinp, (size_t)BT * K);
        }
        expect_device("device matmul_backward dweight", d_dw, dw, (size_t)OC * K);
        expect_device("device matmul_backward dbias", d_db, db, OC);
        free(inp); free(w); free(bias); free(dout); free(ref); free(dinp); free(dw); free(db);
        cudaFree(d_inp); cudaFree(d_w); cudaFree(d_bias); cudaFree(d_out); cudaFree(d_dout); cudaFree(d_dinp);
        cudaFree(d_dw); cudaFree(d_db);
    }
    // layernorm, with a sequence-parallel rank's partials
    int ln[][3] = {{1, 1, 1}, {1, 3, 7}, {2, 5, 64}, {3, 17, 100}, {4, 64, 768}, {2, 16, 32}};
    for (size_t s = 0; s < sizeof(ln) / sizeof(ln[0]); s++) {
        int B = ln[s][0], T = ln[s][1], C = ln[s][2], BT = B * T;
        size_t n = (size_t)BT * C;
        float *x = rand_buf(n), *w = rand_buf(C), *b = rand_buf(C), *dy = rand_buf(n), *dres = rand_buf(n);
        float *out = zero_buf(n), *mean = zero_buf(BT), *rstd = zero_buf(BT);
        layernorm_forward(out, mean, rstd, x, w, b, BT, C);
        float *d_x = dev_floats(x, n), *d_w = dev_floats(w, C), *d_b = dev_floats(b, C);
        float *d_out = (float*)dev_alloc(n * 4), *d_mean = (float*)dev_alloc(BT * 4), *d_rstd = (float*)dev_alloc(BT * 4);
        gpu::layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, BT, C);
        char what[96];
        snprintf(what, sizeof(what), "device layernorm_forward BT=%d C=%d", BT, C);
        expect_device(what, d_out, out, n);
        expect_device("device layernorm_forward mean", d_mean, mean, BT);
        expect_device("device layernorm_forward rstd", d_rstd, rstd, BT);
        float *d_dy = dev_floats(dy, n), *d_dres = dev_floats(dres, n);
        float *d_dw = (float*)dev_alloc(C * 4), *d_db = (float*)dev_alloc(C * 4);
        float *dw = zero_buf(C), *db = zero_buf(C);
        layernorm_backward(dres, dw, db, dy, x, w, mean, rstd, B, T, 1, 0, C, NULL);
        gpu::layernorm_backward(d_dres, d_dw, d_db, d_dy, d_x, d_w, d_mean, d_rstd, B, T, 1, 0, C, NULL);
        snprintf(what, sizeof(what), "device layernorm_backward B=%d T=%d C=%d", B, T, C);
        expect_device(what, d_dres, dres, n);
        expect_device("device layernorm_backward dweight", d_dw, dw, C);
        expect_device("device layernorm_backward dbias", d_db, db, C);
        if (T >= 4) {   // rank 1 of 2's slice (R2Z's unequal pieces when 4 does not divide T)
            float* sp = zero_buf(2 * (size_t)B * C);
            float* d_sp = (float*)dev_alloc(2 * (size_t)B * C * 4);
            layernorm_backward(dres, dw, db, dy, x, w, mean, rstd, B, T, 2, 1, C, sp);
            gpu::layernorm_backward(d_dres, d_dw, d_db, d_dy, d_x, d_w, d_mean, d_rstd, B, T, 2, 1, C, d_sp);
            expect_device("device layernorm_backward sequence partials", d_sp, sp, 2 * (size_t)B * C);
            float* tree = zero_buf(C);
            sequence_tree(tree, sp, B, C);
            gpu::sequence_tree(d_dw, d_sp, B, C);
            expect_device("device sequence_tree", d_dw, tree, C);
            free(sp); free(tree);
            cudaFree(d_sp);
        }
        free(x); free(w); free(b); free(dy); free(dres); free(out); free(mean); free(rstd); free(dw); free(db);
        cudaFree(d_x); cudaFree(d_w); cudaFree(d_b); cudaFree(d_out); cudaFree(d_mean); cudaFree(d_rstd);
        cudaFree(d_dy); cudaFree(d_dres); cudaFree(d_dw); cudaFree(d_db);
    }
    // attention
    int at[][4] = {{1, 1, 8, 2}, {2, 5, 8, 2}, {2, 9, 24, 3}, {1, 150, 16, 1}, {2, 131, 32, 2}, {1, 40, 128, 2}};
    for (size_t s = 0; s < sizeof(at) / sizeof(at[0]); s++) {
        int B = at[s][0], T = at[s][1], C = at[s][2], NH = at[s][3];
        size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, natt = (size_t)B * NH * T * T;
        float *qkv = rand_buf(nqkv), *dout = rand_buf(nout);
        float *out = zero_buf(nout), *att = zero_buf(natt), *dqkv = zero_buf(nqkv);
        attention_forward(out, att, qkv, B, T, C, NH);
        attention_backward(dqkv, dout, qkv, att, B, T, C, NH);
        float *d_qkv = dev_floats(qkv, nqkv), *d_dout = dev_floats(dout, nout);
        float *d_out = (float*)dev_alloc(nout * 4), *d_att = (float*)dev_alloc(natt * 4);
        float* d_dqkv = (float*)dev_alloc(nqkv * 4);
        gpu::attention_forward(d_out, d_att, d_qkv, B, T, C, NH);
        gpu::attention_backward(d_dqkv, d_dout, d_qkv, d_att, B, T, C, NH);
        char what[96];
        snprintf(what, sizeof(what), "device attention_forward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_device(what, d_out, out, nout);
        expect_device("device attention_forward att", d_att, att, natt);
        snprintf(what, sizeof(what), "device attention_backward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_device(what, d_dqkv, dqkv, nqkv);
        // the KV cache's one query row at a time (sequence 0): the full forward's rows
        cudaMemset(d_out, 0, nout * 4);
        cudaMemset(d_att, 0, natt * 4);
        for (int t = 0; t < T; t++) { gpu::attention_forward_row(d_out, d_att, d_qkv, t, T, C, NH); }
        snprintf(what, sizeof(what), "device attention_forward_row T=%d C=%d NH=%d", T, C, NH);
        expect_device(what, d_out, out, (size_t)T * C);
        expect_device(what, d_att, att, (size_t)NH * T * T);
        free(qkv); free(dout); free(out); free(att); free(dqkv);
        cudaFree(d_qkv); cudaFree(d_dout); cudaFree(d_out); cudaFree(d_att); cudaFree(d_dqkv);
    }
    // context parallelism's attention blocks, every rank of N, and its other kernels
    // (with T not a multiple of 2N, R2Z's unequal pieces: --varlen)
    int cpb[][5] = {{1, 16, 8, 2, 2}, {2, 48, 32, 2, 4}, {1, 272, 64, 2, 8}, {1, 27, 16, 2, 4}};   // B T C NH N
    for (size_t k = 0; k < sizeof(cpb) / sizeof(cpb[0]); k++) {
        int B = cpb[k][0], T = cpb[k][1], C = cpb[k][2], NH = cpb[k][3], N = cpb[k][4];
        size_t nl = (size_t)B * zz_max_len(T, N) * C;   // room for any rank's (B, Tl, C)
        float *qkv = rand_buf(3 * nl), *dout = rand_buf(nl), *kv = rand_buf(2 * (size_t)N * nl);
        float *d_qkv = dev_floats(qkv, 3 * nl), *d_dout = dev_floats(dout, nl), *d_kv = dev_floats(kv, 2 * (size_t)N * nl);
        for (int r = 0; r < N; r++) {
            int Tq = (int)canon_zz_len(T, N, r);
            size_t natt = (size_t)B * NH * Tq * T;
            float *att = zero_buf(natt), *ds = zero_buf(natt), *o = zero_buf(nl), *o2 = zero_buf(nl);
            float *d_att = dev_floats(att, natt), *d_ds = dev_floats(ds, natt);
            float *d_o = (float*)dev_alloc(nl * 4), *d_o2 = (float*)dev_alloc(nl * 4);
            char what[128];
            for (int s = 0; s < N; s++) {
                attention_scores_block(att, qkv, kv + s * nl, B, T, C, NH, N, r, s);
                gpu::attention_scores_block(d_att, d_qkv, d_kv + s * nl, B, T, C, NH, N, r, s);
            }
            attention_softmax_blocks(att, B, T, NH, N, r);
            gpu::attention_softmax_blocks(d_att, B, T, NH, N, r);
            snprintf(what, sizeof(what), "device attention blocks B=%d T=%d C=%d NH=%d rank %d of %d: probabilities", B, T,
                     C, NH, r, N);
            expect_device(what, d_att, att, natt);
            for (int s = 0; s < N; s++) {
                attention_values_block(o, att, kv + (N + s) * nl, B, T, C, NH, N, r, s);
                gpu::attention_values_block(d_o, d_att, d_kv + (N + s) * nl, B, T, C, NH, N, r, s);
                expect_device("device attention_values_block", d_o, o, (size_t)B * Tq * C);
                attention_datt_block(ds, dout, kv + (N + s) * nl, B, T, C, NH, N, r, s);
                gpu::attention_datt_block(d_ds, d_dout, d_kv + (N + s) * nl, B, T, C, NH, N, r, s);
            }
            attention_softmax_backward_blocks(ds, att, B, T, C, NH, N, r);
            gpu::attention_softmax_backward_blocks(d_ds, d_att, B, T, C, NH, N, r);
            expect_device("device attention_softmax_backward_blocks (ds)", d_ds, ds, natt);
            for (int s = 0; s < N; s++) {
                attention_dq_block(o, ds, kv + s * nl, B, T, C, NH, N, r, s);
                gpu::attention_dq_block(d_o, d_ds, d_kv + s * nl, B, T, C, NH, N, r, s);
                expect_device("device attention_dq_block", d_o, o, (size_t)B * Tq * C);
                attention_dkv_block(o, o2, ds, att, qkv, dout, B, T, C, NH, N, r, s);
                gpu::attention_dkv_block(d_o, d_o2, d_ds, d_att, d_qkv, d_dout, B, T, C, NH, N, r, s);
                size_t nk = (size_t)B * canon_zz_len(T, N, s) * C;
                expect_device("device attention_dkv_block dk", d_o, o, nk);
                expect_device("device attention_dkv_block dv", d_o2, o2, nk);
            }
            free(att); free(ds); free(o); free(o2);
            cudaFree(d_att); cudaFree(d_ds); cudaFree(d_o); cudaFree(d_o2);
        }
        // copy_rows: a tensor's columns packed, as the ring sends its K and V
        long rows = (long)B * canon_zz_len(T, N, 0);
        float* packed = zero_buf(nl);
        float* d_packed = (float*)dev_alloc(nl * 4);
        copy_rows(packed, C, qkv + C, 3L * C, rows, C);
        gpu::copy_rows(d_packed, C, d_qkv + C, 3L * C, rows, C);
        expect_device("device copy_rows", d_packed, packed, (size_t)rows * C);
        free(qkv); free(dout); free(kv); free(packed);
        cudaFree(d_qkv); cudaFree(d_dout); cudaFree(d_kv); cudaFree(d_packed);
    }
    {   // the weight gradients' per-sequence subtrees of a zig-zag slice (R2Z's unequal pieces: T = 21)
        int B = 3, T = 21, K = 20, OC = 17;
        long stride = (long)OC * K + OC;
        float *inp = rand_buf((size_t)B * T * K), *dout = rand_buf((size_t)B * T * OC);
        float *d_inp = dev_floats(inp, (size_t)B * T * K), *d_dout = dev_floats(dout, (size_t)B * T * OC);
        for (int D = 1; D <= CANON_R; D *= 2) {
            float* seq = zero_buf(B * stride);
            float* d_seq = (float*)dev_alloc(B * stride * 4);
            matmul_backward_seqs(seq, seq + (long)OC * K, stride, dout, inp, B, T, D, D - 1, K, OC);
            gpu::matmul_backward_seqs(d_seq, d_seq + (long)OC * K, stride, d_dout, d_inp, B, T, D, D - 1, K, OC);
            expect_device("device matmul_backward_seqs", d_seq, seq, B * stride);
            free(seq);
            cudaFree(d_seq);
        }
        free(inp); free(dout);
        cudaFree(d_inp); cudaFree(d_dout);
    }
    // cross-entropy in its three phases, one rank's vocabulary slice or all of it; its
    // backward; the loss sum
    int ce[][4] = {{3, 5, 8, 1}, {2, 7, 7, 1}, {6, 1000, 1024, 1}, {6, 1000, 1024, 4}, {3, 50257, 50304, 1},
                   {3, 50257, 50304, 2}};   // BT V Vp K
    for (size_t s = 0; s < sizeof(ce) / sizeof(ce[0]); s++) {
        int BT = ce[s][0], V = ce[s][1], Vp = ce[s][2], K = ce[s][3], Vl = Vp / K, v0 = (K - 1) * Vl;
        size_t n = (size_t)BT * Vl;
        float* logits = rand_buf(n);
        int* targets = rand_tokens(BT, V);
        targets[0] = v0;   // a target in the slice
        float *probs = copy_buf(logits, n), *losses = zero_buf(BT), *cebuf = zero_buf(3 * (size_t)BT);
        crossentropy_max(cebuf, probs, BT, V, v0, Vl);
        crossentropy_exps(cebuf + BT, cebuf + 2 * BT, probs, cebuf, targets, BT, V, v0, Vl, CANON_R / K);
        crossentropy_normalize(probs, losses, cebuf + BT, cebuf + 2 * BT, cebuf, targets, BT, V, v0, Vl);
        float *d_p = dev_floats(logits, n), *d_losses = (float*)dev_alloc(BT * 4), *d_ce = (float*)dev_alloc(3 * BT * 4);
        int* d_t = dev_ints(targets, BT);
        gpu::crossentropy_max(d_ce, d_p, BT, V, v0, Vl);
        gpu::crossentropy_exps(d_ce + BT, d_ce + 2 * BT, d_p, d_ce, d_t, BT, V, v0, Vl, CANON_R / K);
        gpu::crossentropy_normalize(d_p, d_losses, d_ce + BT, d_ce + 2 * BT, d_ce, d_t, BT, V, v0, Vl);
        char what[112];
        snprintf(what, sizeof(what), "device cross-entropy BT=%d V=%d Vp=%d, slice %d of %d: max, Z, target", BT, V, Vp, K, K);
        expect_device(what, d_ce, cebuf, 3 * (size_t)BT);
        expect_device("device cross-entropy probabilities", d_p, probs, n);
        expect_device("device cross-entropy losses", d_losses, losses, BT);
        crossentropy_backward(probs, targets, 1.0f / 77.0f, BT, V, v0, Vl);
        gpu::crossentropy_backward(d_p, d_t, 1.0f / 77.0f, BT, V, v0, Vl);
        expect_device("device crossentropy_backward", d_p, probs, n);
        float want = position_sum(losses, 1, BT);
        float got = gpu::position_sum(d_losses, 1, BT);
        CHECK(memcmp(&got, &want, 4) == 0, "device position_sum %.9g, reference %.9g", got, want);
        free(logits); free(targets); free(probs); free(losses); free(cebuf);
        cudaFree(d_p); cudaFree(d_losses); cudaFree(d_t); cudaFree(d_ce);
    }
    // encoder (all rows, and a vocab-parallel rank's), GELU, residual, bias
    {
        int B = 3, T = 37, C = 40, Vp = 128, maxT = 64, BT = B * T;
        int* inp = rand_tokens(BT, 100);
        float *wte = rand_buf((size_t)Vp * C), *wpe = rand_buf((size_t)maxT * C), *dout = rand_buf((size_t)BT * C);
        int* d_inp = dev_ints(inp, BT);
        float *d_wte = dev_floats(wte, (size_t)Vp * C), *d_wpe = dev_floats(wpe, (size_t)maxT * C);
        float* d_out = (float*)dev_alloc((size_t)BT * C * 4);
        float* d_dout = dev_floats(dout, (size_t)BT * C);
        float *d_dwte = (float*)dev_alloc((size_t)Vp * C * 4), *d_dwpe = (float*)dev_alloc((size_t)maxT * C * 4);
        float* out = zero_buf((size_t)BT * C);
        for (int K = 1; K <= 2; K++) {
            int Vl = Vp / K, v0 = (K - 1) * Vl;
            encoder_lookup(out, inp, wte + (size_t)v0 * C, v0, Vl, BT, C);
            encoder_add_positions(out, wpe, B, T, C);
            gpu::encoder_lookup(d_out, d_inp, d_wte + (size_t)v0 * C, v0, Vl, BT, C);
            gpu::encoder_add_positions(d_out, d_wpe, B, T, C);
            expect_device(K == 1 ? "device encoder lookup + positions" : "device encoder lookup of a vocab slice",
                          d_out, out, (size_t)BT * C);
            float *dwte = zero_buf((size_t)Vl * C), *dwpe = zero_buf((size_t)maxT * C);
            encoder_backward(dwte, dwpe, dout, inp, B, T, C, v0, Vl, maxT);
            gpu::encoder_backward(d_dwte, d_dwpe, d_dout, d_inp, B, T, C, v0, Vl, maxT);
            expect_device("device encoder_backward dwte", d_dwte, dwte, (size_t)Vl * C);
            expect_device("device encoder_backward dwpe", d_dwpe, dwpe, (size_t)maxT * C);
            free(dwte); free(dwpe);
        }
        size_t n = (size_t)BT * C;
        float *g = zero_buf(n), *gb = zero_buf(n), *r = copy_buf(out, n);
        gelu_forward(g, dout, n);
        gelu_backward(gb, dout, out, n);
        residual_forward(r, dout, out, n);
        bias_forward(r, wpe, BT, C);
        float *d_g = (float*)dev_alloc(n * 4), *d_gb = (float*)dev_alloc(n * 4), *d_r = (float*)dev_alloc(n * 4);
        gpu::gelu_forward(d_g, d_dout, n);
        gpu::gelu_backward(d_gb, d_dout, d_out, n);
        gpu::residual_forward(d_r, d_dout, d_out, n);
        gpu::bias_forward(d_r, d_wpe, BT, C);
        expect_device("device gelu_forward", d_g, g, n);
        expect_device("device gelu_backward", d_gb, gb, n);
        expect_device("device residual_forward + bias_forward", d_r, r, n);
        free(inp); free(wte); free(wpe); free(dout); free(out); free(g); free(gb); free(r);
        cudaFree(d_inp); cudaFree(d_wte); cudaFree(d_wpe); cudaFree(d_out); cudaFree(d_dout); cudaFree(d_dwte);
        cudaFree(d_dwpe); cudaFree(d_g); cudaFree(d_gb); cudaFree(d_r);
    }
    // memory_device against memory_host: the exact sum of squares, AdamW, the tree merge, fill
    {
        size_t n = 100003;
        float *p = rand_buf(n), *m = rand_buf(n), *v = rand_buf(n), *grad = rand_buf(n);
        for (size_t i = 0; i < n; i++) { v[i] = fabsf(v[i]); }
        grad[5] = 0.0f; grad[7] = 1e-40f; grad[11] = -3e38f;   // zero, subnormal, huge
        SumSq want, got;
        canon_sumsq_init(&want);
        canon_sumsq_init(&got);
        memory_host.sumsq(&want, grad, n);
        float *d_p = dev_floats(p, n), *d_m = dev_floats(m, n), *d_v = dev_floats(v, n), *d_g = dev_floats(grad, n);
        gpu::memory_device.sumsq(&got, d_g, n);
        float nw = (float)sqrt(canon_sumsq_value(&want)), ng = (float)sqrt(canon_sumsq_value(&got));
        CHECK(memcmp(&nw, &ng, 4) == 0, "device sum of squares %.9g, host %.9g", ng, nw);
        AdamWStep st = adamw_step_constants(3e-4f, 0.9f, 0.95f, 1e-8f, 3, 0.5f);
        memory_host.adamw(p, m, v, grad, n, &st, 0.1f);
        gpu::memory_device.adamw(d_p, d_m, d_v, d_g, n, &st, 0.1f);
        expect_device("device AdamW params", d_p, p, n);
        expect_device("device AdamW m", d_m, m, n);
        expect_device("device AdamW v", d_v, v, n);
        memory_host.add(p, p, grad, n);
        gpu::memory_device.add(d_p, d_p, d_g, n);
        expect_device("device tree merge (add)", d_p, p, n);
        memory_host.fill(p, -0.0f, n);
        gpu::memory_device.fill(d_p, -0.0f, n);
        expect_device("device fill", d_p, p, n);
        free(p); free(m); free(v); free(grad);
        cudaFree(d_p); cudaFree(d_m); cudaFree(d_v); cudaFree(d_g);
    }
}

static floatX* dev_bf16(const float* h, size_t n) {   // h holds bf16-representable values
    uint16_t* bits = (uint16_t*)malloc(2 * (n ? n : 1));
    for (size_t i = 0; i < n; i++) { bits[i] = to_bf16_bits(h[i]); }
    floatX* d = (floatX*)dev_alloc(n * 2);
    cudaCheck(cudaMemcpy(d, bits, n * 2, cudaMemcpyHostToDevice));
    free(bits);
    return d;
}
static float* host_bf16(const floatX* d, size_t n) {
    uint16_t* bits = (uint16_t*)malloc(2 * (n ? n : 1));
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(bits, d, n * 2, cudaMemcpyDeviceToHost));
    float* h = (float*)malloc(4 * (n ? n : 1));
    for (size_t i = 0; i < n; i++) { uint32_t u = (uint32_t)bits[i] << 16; memcpy(&h[i], &u, 4); }
    free(bits);
    return h;
}
static float* rand_bf16_buf(size_t n) {   // random values that bf16 holds exactly
    float* x = rand_buf(n);
    free(bf16_round(x, n));
    return x;
}

// max |got - ref| / max |ref|, NaN-aware
static double rel_err(const float* got, const float* ref, size_t n) {
    double num = 0.0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        if (!(d == d)) { return INFINITY; }
        if (d > num) { num = d; }
        if (fabs((double)ref[i]) > den) { den = fabs((double)ref[i]); }
    }
    return num / den;
}
static void expect_close(const char* what, const float* got, const float* ref, size_t n, double tol) {
    double e = rel_err(got, ref, n);
    CHECK(e <= tol, "%s: relative error %.3g > %.3g", what, e, tol);
}

// Fast mode against the reference run on the same (bf16-representable) inputs. Tolerances,
// relative to the largest reference value: outputs stored in bf16 carry its rounding (2^-9
// relative) plus fp32 accumulation in another order: 1e-2; fp32 weight gradients of bf16
// inputs: products are exact in fp32, only the order differs: 1e-3; attention rounds P to bf16
// before P.V (2e-2) and dS before dS.K, dS^T.Q (5e-2).
static void test_device_fast(void) {
    gpu::cublaslt_init();
    gpu::flash_attention_setup();
    // matmuls, plain and with the GELU epilogues
#if LLMC_EMU_RACE_CHECK
    int mm[][4] = {{2, 64, 64, 192}, {1, 37, 96, 72}};   // B T K OC (smaller: every access checked)
#else
    int mm[][4] = {{2, 64, 64, 192}, {4, 37, 256, 1024}, {1, 100, 1024, 256}};   // B T K OC
#endif
    for (size_t s = 0; s < sizeof(mm) / sizeof(mm[0]); s++) {
        int B = mm[s][0], T = mm[s][1], K = mm[s][2], OC = mm[s][3], BT = B * T;
        char what[128];
        float *inp = rand_bf16_buf((size_t)BT * K), *w = rand_bf16_buf((size_t)OC * K), *bias = rand_bf16_buf(OC);
        float* dout = rand_bf16_buf((size_t)BT * OC);
        float* ref = zero_buf((size_t)BT * OC);
        matmul_forward(ref, inp, w, bias, BT, K, OC, CANON_R);
        floatX *d_inp = dev_bf16(inp, (size_t)BT * K), *d_w = dev_bf16(w, (size_t)OC * K), *d_bias = dev_bf16(bias, OC);
        floatX *d_out = (floatX*)dev_alloc((size_t)BT * OC * 2), *d_pre = (floatX*)dev_alloc((size_t)BT * OC * 2);
        gpu::matmul_forward_fast(d_out, d_inp, d_w, d_bias, BT, K, OC, NULL);
        float* got = host_bf16(d_out, (size_t)BT * OC);
        snprintf(what, sizeof(what), "fast matmul_forward BT=%d K=%d OC=%d", BT, K, OC);
        expect_close(what, got, ref, (size_t)BT * OC, 1e-2);
        free(got);
        gpu::matmul_forward_fast(d_out, d_inp, d_w, d_bias, BT, K, OC, d_pre);
        float* pre = host_bf16(d_pre, (size_t)BT * OC);
        expect_close("fast matmul_forward + GELU: pre-activation", pre, ref, (size_t)BT * OC, 1e-2);
        for (size_t i = 0; i < (size_t)BT * OC; i++) { ref[i] = canon_gelu(ref[i]); }
        got = host_bf16(d_out, (size_t)BT * OC);
        expect_close("fast matmul_forward + GELU", got, ref, (size_t)BT * OC, 1e-2);
        free(got);
        float *dinp = zero_buf((size_t)BT * K), *dw = zero_buf((size_t)OC * K), *db = zero_buf(OC);
        matmul_backward(dinp, dw, db, dout, inp, w, B, T, K, OC, 1, CANON_R);
        floatX *d_dout = dev_bf16(dout, (size_t)BT * OC), *d_dinp = (floatX*)dev_alloc((size_t)BT * K * 2);
        float *d_dw = (float*)dev_alloc((size_t)OC * K * 4), *d_db = (float*)dev_alloc(OC * 4);
        gpu::matmul_backward_fast(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, B, T, K, OC, NULL);
        got = host_bf16(d_dinp, (size_t)BT * K);
        expect_close("fast matmul_backward dinp", got, dinp, (size_t)BT * K, 1e-2);
        free(got);
        got = host_floats(d_dw, (size_t)OC * K);
        expect_close("fast matmul_backward dweight", got, dw, (size_t)OC * K, 1e-3);
        free(got);
        expect_device("fast matmul_backward dbias (the exact R3 kernel on bf16 input)", d_db, db, OC);
        // DGELU: dinp times gelu'(pre), pre: the (bf16) pre-activation of the layer below,
        // shaped like dinp (K = its width)
        float* pre_in = rand_bf16_buf((size_t)BT * K);
        floatX* d_pre_in = dev_bf16(pre_in, (size_t)BT * K);
        gpu::matmul_backward_fast(d_dinp, NULL, NULL, d_dout, d_inp, d_w, B, T, K, OC, d_pre_in);
        for (size_t i = 0; i < (size_t)BT * K; i++) { dinp[i] = canon_gelu_grad(pre_in[i]) * dinp[i]; }
        got = host_bf16(d_dinp, (size_t)BT * K);
        expect_close("fast matmul_backward dinp + DGELU", got, dinp, (size_t)BT * K, 1e-2);
        free(got);
        free(inp); free(w); free(bias); free(dout); free(ref); free(pre); free(dinp); free(dw); free(db); free(pre_in);
        cudaFree(d_inp); cudaFree(d_w); cudaFree(d_bias); cudaFree(d_out); cudaFree(d_pre); cudaFree(d_dout);
        cudaFree(d_dinp); cudaFree(d_dw); cudaFree(d_db); cudaFree(d_pre_in);
    }
    // flash attention against the reference attention
    int at[][4] = {{1, 64, 128, 2}, {2, 100, 128, 2}, {2, 257, 192, 3}, {1, 50, 64, 2}, {1, 70, 64, 4}};   // B T C NH
    for (size_t s = 0; s < sizeof(at) / sizeof(at[0]); s++) {
        int B = at[s][0], T = at[s][1], C = at[s][2], NH = at[s][3];
        size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, natt = (size_t)B * NH * T * T;
        float *qkv = rand_bf16_buf(nqkv), *dout = rand_bf16_buf(nout);
        for (size_t i = 0; i < nqkv; i++) { qkv[i] *= 0.1f; }   // scores of a trained model's size
        free(bf16_round(qkv, nqkv));
        float *out = zero_buf(nout), *att = zero_buf(natt), *dqkv = zero_buf(nqkv);
        attention_forward(out, att, qkv, B, T, C, NH);
        attention_backward(dqkv, dout, qkv, att, B, T, C, NH);
        floatX *d_qkv = dev_bf16(qkv, nqkv), *d_dout = dev_bf16(dout, nout);
        floatX *d_out = (floatX*)dev_alloc(nout * 2), *d_dqkv = (floatX*)dev_alloc(nqkv * 2);
        float *d_stats = (float*)dev_alloc((size_t)B * NH * T * 4), *d_D = (float*)dev_alloc((size_t)B * NH * T * 4);
        gpu::attention_forward_fast(d_out, d_stats, d_qkv, B, T, C, NH);
        gpu::attention_backward_fast(d_dqkv, d_dout, d_qkv, d_out, d_stats, d_D, B, T, C, NH);
        char what[96];
        float* got = host_bf16(d_out, nout);
        snprintf(what, sizeof(what), "flash attention forward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_close(what, got, out, nout, 2e-2);
        free(got);
        got = host_bf16(d_dqkv, nqkv);
        snprintf(what, sizeof(what), "flash attention backward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_close(what, got, dqkv, nqkv, 5e-2);
        free(got);
        free(qkv); free(dout); free(out); free(att); free(dqkv);
        cudaFree(d_qkv); cudaFree(d_dout); cudaFree(d_out); cudaFree(d_dqkv); cudaFree(d_stats); cudaFree(d_D);
    }
    // the fused classifier against cross-entropy forward and backward
    {
        int BT = 5, V = 50257, Vp = 50304;
        size_t n = (size_t)BT * Vp;
        float* logits = rand_bf16_buf(n);
        int* targets = rand_tokens(BT, V);
        float *probs = copy_buf(logits, n), *losses = zero_buf(BT);
        cpu_crossentropy_forward(probs, losses, targets, BT, V, Vp);
        float dloss = 1.0f / 5.0f;
        crossentropy_backward(probs, targets, dloss, BT, V, 0, Vp);
        floatX* d_logits = dev_bf16(logits, n);
        float* d_losses = (float*)dev_alloc(BT * 4);
        int* d_t = dev_ints(targets, BT);
        gpu::fused_classifier(d_logits, d_losses, d_t, dloss, BT, V, Vp, 1);
        float* got = host_floats(d_losses, BT);
        expect_close("fused classifier losses", got, losses, BT, 1e-4);
        free(got);
        got = host_bf16(d_logits, n);
        expect_close("fused classifier dlogits", got, probs, n, 1e-2);
        free(got);
        free(logits); free(targets); free(probs); free(losses);
        cudaFree(d_logits); cudaFree(d_losses); cudaFree(d_t);
    }
    // layernorms (with the fused residual) and the bf16 encoder
    {
        int B = 3, T = 40, C = 256, BT = B * T;
        size_t n = (size_t)BT * C;
        float *res = rand_bf16_buf(n), *proj = rand_bf16_buf(n), *w = rand_bf16_buf(C), *b = rand_bf16_buf(C);
        float *dy = rand_bf16_buf(n), *dres = rand_bf16_buf(n);
        float* sum = zero_buf(n);
        residual_forward(sum, res, proj, n);
        free(bf16_round(sum, n));   // the fused kernel stores the rounded residual and normalises it
        float *out = zero_buf(n), *mean = zero_buf(BT), *rstd = zero_buf(BT);
        layernorm_forward(out, mean, rstd, sum, w, b, BT, C);
        floatX *d_res = dev_bf16(res, n), *d_proj = dev_bf16(proj, n), *d_w = dev_bf16(w, C), *d_b = dev_bf16(b, C);
        floatX *d_sum = (floatX*)dev_alloc(n * 2), *d_out = (floatX*)dev_alloc(n * 2);
        float *d_mean = (float*)dev_alloc(BT * 4), *d_rstd = (float*)dev_alloc(BT * 4);
        gpu::fused_residual_layernorm(d_sum, d_out, d_mean, d_rstd, d_res, d_proj, d_w, d_b, BT, C);
        float* got = host_bf16(d_sum, n);
        expect_same("fast fused residual", got, sum, n);
        free(got);
        got = host_bf16(d_out, n);
        expect_close("fast fused residual + layernorm", got, out, n, 1e-2);
        free(got);
        gpu::layernorm_forward_fast(d_out, d_mean, d_rstd, d_sum, d_w, d_b, BT, C);
        got = host_bf16(d_out, n);
        expect_close("fast layernorm_forward", got, out, n, 1e-2);
        free(got);
        // backward: the GPU starts from the same dres the reference adds into
        floatX *d_dy = dev_bf16(dy, n), *d_dres = dev_bf16(dres, n);
        float *dw = zero_buf(C), *db = zero_buf(C);
        layernorm_backward(dres, dw, db, dy, sum, w, mean, rstd, B, T, 1, 0, C, NULL);
        float *d_mean_ref = dev_floats(mean, BT), *d_rstd_ref = dev_floats(rstd, BT);
        gpu::layernorm_backward_fast(d_dres, d_dy, d_sum, d_w, d_mean_ref, d_rstd_ref, BT, C);
        got = host_bf16(d_dres, n);
        expect_close("fast layernorm_backward", got, dres, n, 1e-2);
        free(got);
        // the parameter gradients: the exact R3 kernel on bf16 inputs, the reference's bits
        float *d_dw = (float*)dev_alloc(C * 4), *d_db = (float*)dev_alloc(C * 4);
        gpu::layernorm_param_grads_x(d_dw, d_db, NULL, d_sum, d_dy, 1, d_mean_ref, d_rstd_ref, B, T, C, CANON_R);
        expect_device("layernorm_param_grads on bf16 dweight", d_dw, dw, C);
        expect_device("layernorm_param_grads on bf16 dbias", d_db, db, C);
        free(dw); free(db);
        cudaFree(d_mean_ref); cudaFree(d_rstd_ref); cudaFree(d_dw); cudaFree(d_db);
        // the bf16 embedding
        int* inp = rand_tokens(BT, 200);
        float *wte = rand_bf16_buf((size_t)256 * C), *wpe = rand_bf16_buf((size_t)T * C), *enc = zero_buf(n);
        cpu_encoder_forward(enc, inp, wte, wpe, B, T, C, 256);
        int* d_inp = dev_ints(inp, BT);
        floatX *d_wte = dev_bf16(wte, (size_t)256 * C), *d_wpe = dev_bf16(wpe, (size_t)T * C);
        gpu::encoder_forward_fast(d_out, d_inp, d_wte, d_wpe, B, T, C);
        free(bf16_round(enc, n));
        got = host_bf16(d_out, n);
        expect_same("fast encoder_forward (one rounding)", got, enc, n);
        free(got);
        free(inp); free(wte); free(wpe); free(enc);
        cudaFree(d_inp); cudaFree(d_wte); cudaFree(d_wpe);
        free(res); free(proj); free(w); free(b); free(dy); free(dres); free(sum); free(out); free(mean); free(rstd);
        cudaFree(d_res); cudaFree(d_proj); cudaFree(d_w); cudaFree(d_b); cudaFree(d_sum); cudaFree(d_out);
        cudaFree(d_mean); cudaFree(d_rstd); cudaFree(d_dy); cudaFree(d_dres);
    }
    gpu::cublaslt_free();
}

// the mixture-of-experts twins (llmc/kernels_moe_det.cuh) against train_gpt2.c's (llmc/moe.h),
// on a routing with ties, k = 1 and k = E, and experts that receive nothing from a source
static void test_device_moe(int B, int T, int E, int k, int C, int Q) {
    char what[160];
    int BT = B * T;
    size_t slots = (size_t)BT * k;
    float* logits = rand_buf((size_t)BT * E);
    for (int i = 0; i < BT; i += 2) { logits[(size_t)i * E + E - 1] = logits[(size_t)i * E]; }
    float *probs = zero_buf((size_t)BT * E), *gates = zero_buf(slots);
    int* chosen = (int*)calloc(slots, sizeof(int));
    moe_router_forward(probs, chosen, gates, logits, BT, E, k);
    float* d_probs = dev_floats(logits, (size_t)BT * E);
    float* d_gates = (float*)dev_alloc(slots * 4);
    int* d_chosen = (int*)dev_alloc(slots * 4);
    gpu::moe_router_forward(d_probs, d_chosen, d_gates, d_probs, BT, E, k);
    snprintf(what, sizeof(what), "device moe_router_forward BT=%d E=%d k=%d", BT, E, k);
    expect_device(what, d_probs, probs, (size_t)BT * E);
    expect_device(what, d_gates, gates, slots);
    int* got = (int*)host_floats((const float*)d_chosen, slots);
    checks++;
    if (memcmp(got, chosen, slots * sizeof(int)) != 0) { failures++; printf("FAIL %s: chosen experts differ\n", what); }
    free(got);
    float psum[64], *d_psum = (float*)dev_alloc(64 * 4);
    moe_expert_prob_sums(psum, probs, B, T, E);
    gpu::moe_expert_prob_sums(d_psum, d_probs, B, T, E);
    expect_device("device moe_expert_prob_sums", d_psum, psum, (size_t)E);
    // the plan (host) and the kernels that move and combine rows
    int *count = (int*)calloc(E, sizeof(int)), *row_pos = (int*)calloc(slots, sizeof(int));
    int *slot_row = (int*)calloc(slots, sizeof(int)), *cursor = (int*)calloc(E, sizeof(int));
    moe_plan_routes(chosen, B, T, k, E, count, row_pos, slot_row, cursor);
    int *d_row_pos = dev_ints(row_pos, slots), *d_slot_row = dev_ints(slot_row, slots);
    float* x = rand_buf((size_t)BT * C);
    float *d_x = dev_floats(x, (size_t)BT * C), *rows = zero_buf(slots * C), *d_rows = (float*)dev_alloc(slots * C * 4);
    moe_gather_rows(rows, x, row_pos, (int)slots, C);
    gpu::moe_gather_rows(d_rows, d_x, d_row_pos, (int)slots, C);
    expect_device("device moe_gather_rows", d_rows, rows, slots * C);
    float *y = rand_buf(slots * C), *d_y = dev_floats(y, slots * C);
    float *out = zero_buf((size_t)BT * C), *d_out = (float*)dev_alloc((size_t)BT * C * 4);
    moe_combine(out, y, gates, slot_row, BT, k, C);
    gpu::moe_combine(d_out, d_y, d_gates, d_slot_row, BT, k, C);
    expect_device("device moe_combine", d_out, out, (size_t)BT * C);
    float *dout = rand_buf((size_t)BT * C), *d_dout = dev_floats(dout, (size_t)BT * C);
    float *dgate = zero_buf(slots), *drows = zero_buf(slots * C);
    float *d_dgate = (float*)dev_alloc(slots * 4), *d_drows = (float*)dev_alloc(slots * C * 4);
    moe_combine_backward(dgate, drows, dout, y, gates, slot_row, BT, k, C);
    gpu::moe_combine_backward(d_dgate, d_drows, d_dout, d_y, d_gates, d_slot_row, BT, k, C);
    expect_device("device moe_combine_backward dgate", d_dgate, dgate, slots);
    expect_device("device moe_combine_backward drows", d_drows, drows, slots * C);
    float *daux = rand_buf(E), *d_daux = dev_floats(daux, E);
    float *dlogits = zero_buf((size_t)BT * E), *d_dlogits = (float*)dev_alloc((size_t)BT * E * 4);
    moe_router_backward(dlogits, probs, chosen, gates, dgate, daux, BT, E, k);
    gpu::moe_router_backward(d_dlogits, d_probs, d_chosen, d_gates, d_dgate, d_daux, BT, E, k);
    expect_device("device moe_router_backward", d_dlogits, dlogits, (size_t)BT * E);
    float *drouter = rand_buf((size_t)BT * C), *d_drouter = dev_floats(drouter, (size_t)BT * C);
    moe_dinput_combine(out, drouter, drows, slot_row, BT, k, C);
    gpu::moe_dinput_combine(d_out, d_drouter, d_drows, d_slot_row, BT, k, C);
    expect_device("device moe_dinput_combine", d_out, out, (size_t)BT * C);
    // an expert's weight gradient from Q sources' rows (this microbatch's rows as every source's)
    int El = E / Q, nleaf = Q * B * CANON_R + 1;
    int* rcount = (int*)calloc((size_t)Q * El, sizeof(int));
    int n = 0;
    int* pos = (int*)calloc(slots * Q + 1, sizeof(int));
    for (int q = 0; q < Q; q++) {
        for (int e = 0; e < El; e++) {
            rcount[q * El + e] = q == 1 && e == 0 ? 0 : count[e];   // source 1 sends expert 0 nothing
            int r0 = 0;
            for (int ee = 0; ee < e; ee++) { r0 += count[ee]; }
            for (int r = 0; r < rcount[q * El + e]; r++) { pos[n++] = row_pos[r0 + r]; }
        }
    }
    int *perm = (int*)calloc(n + 1, sizeof(int)), *inv = (int*)calloc(n + 1, sizeof(int));
    int *first = (int*)calloc(El + 1, sizeof(int)), *leaf = (int*)calloc((size_t)El * nleaf, sizeof(int));
    moe_plan_experts(rcount, pos, Q, El, B, T, perm, inv, first, leaf);
    int K = 4 * C, OC = C;
    size_t slice = (size_t)OC * K + OC;
    float *wd = rand_buf((size_t)n * OC + 1), *wx = rand_buf((size_t)n * K + 1);
    float *d_wd = dev_floats(wd, (size_t)n * OC + 1), *d_wx = dev_floats(wx, (size_t)n * K + 1);
    int* d_leaf = dev_ints(leaf, (size_t)El * nleaf);
    float *dw = zero_buf(Q * slice), *d_dw = (float*)dev_alloc(Q * slice * 4);
    for (int e = 0; e < El; e++) {
        moe_expert_dweight(dw, dw + (size_t)OC * K, slice, wd, wx, leaf + (size_t)e * nleaf, Q, B, K, OC);
        gpu::moe_expert_dweight(d_dw, d_dw + (size_t)OC * K, slice, d_wd, d_wx, d_leaf + (size_t)e * nleaf, Q, B, K, OC);
        snprintf(what, sizeof(what), "device moe_expert_dweight Q=%d B=%d T=%d expert %d K=%d OC=%d", Q, B, T, e, K, OC);
        expect_device(what, d_dw, dw, Q * slice);
    }
    void* dev[] = {d_probs, d_gates, d_chosen, d_psum, d_row_pos, d_slot_row, d_x, d_rows, d_y, d_out, d_dout, d_dgate,
                   d_drows, d_daux, d_dlogits, d_drouter, d_wd, d_wx, d_leaf, d_dw};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) { cudaCheck(cudaFree(dev[i])); }
    void* host[] = {logits, probs, gates, chosen, count, row_pos, slot_row, cursor, x, rows, y, out, dout, dgate, drows,
                    daux, dlogits, drouter, rcount, pos, perm, inv, first, leaf, wd, wx, dw};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) { free(host[i]); }
}

// serving's paged attention on the device: the same rows as the whole pass's
static void test_device_attention_paged(void) {
    for (size_t s = 0; s < sizeof(paged_shapes) / sizeof(paged_shapes[0]); s++) {
        const int* sh = paged_shapes[s];
        PagedCase k = paged_case(sh[0], sh[1], sh[2], sh[3], sh[4]);
        size_t nblocks = (size_t)sh[0] * k.max_blocks;
        float *d_q = dev_floats(k.qkv_rows, (size_t)k.N * 3 * k.C), *d_kv = dev_floats(k.kv, nblocks * k.block_stride);
        float *d_out = (float*)dev_alloc((size_t)k.N * k.C * 4);
        float* d_scratch = (float*)dev_alloc(((size_t)k.N * k.NH * k.T + (size_t)k.T * 3 * k.C) * 4);
        int *d_tables = dev_ints(k.tables, (size_t)k.N * k.max_blocks), *d_pos = dev_ints(k.pos, (size_t)k.N);
        gpu::attention_forward_paged(d_out, d_scratch, d_q, d_kv, k.block_stride, d_tables, k.max_blocks, d_pos, k.N,
                                     k.T, k.bs, k.C, k.NH);
        char what[96];
        snprintf(what, sizeof(what), "device attention_forward_paged S=%d T=%d C=%d NH=%d bs=%d", sh[0], sh[1], sh[2],
                 sh[3], sh[4]);
        expect_device(what, d_out, k.want, (size_t)k.N * k.C);
        cudaFree(d_q); cudaFree(d_kv); cudaFree(d_out); cudaFree(d_scratch); cudaFree(d_tables); cudaFree(d_pos);
        paged_case_free(&k);
    }
}

static void test_device(void) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        printf("no GPU (%s): the device checks are skipped\n", err != cudaSuccess ? cudaGetErrorString(err) : "none");
        return;
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("device checks on %s\n", prop.name);
    int before = failures;
    test_device_det();
    test_device_attention_paged();
    test_device_moe(2, 5, 4, 2, 7, 2);
    test_device_moe(3, 16, 8, 1, 32, 4);
    test_device_moe(1, 9, 3, 3, 20, 1);
    printf("deterministic kernels: %s\n", failures == before ? "bit-identical to train_gpt2.c" : "MISMATCHES above");
    before = failures;
    test_device_fast();
    printf("fast kernels: %s\n", failures == before ? "within tolerance" : "OUT OF TOLERANCE above");
}
#endif

int main(void) {
#ifndef LLMC_CUDA_EMU
    // sections 1-3; the emulated builds leave them to build/test_cuda_host (the same source), as
    // the race check's call on every load and store would only make them slower
    test_walk();
    test_det_gemm_threads();
    test_matmul();
    test_layernorm();
    test_attention();
    test_attention_paged();
    test_attention_blocks();
    test_crossentropy();
    test_position_reductions();
    test_encoder_backward();
    test_sumsq();
    test_plan();
    test_binary();
#endif
#ifdef TEST_DEVICE
    test_device();
#endif
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
