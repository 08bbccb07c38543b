/*
 * test_cuda_host.c: the CUDA build (train_gpt2.cu) against the CPU reference (train_gpt2.c).
 *
 * Built twice (mk/cuda.mk):
 *  - build/test_cuda_host, by gcc, on every machine: what needs no GPU.
 *     1. The deterministic kernels' arithmetic, run on the host: every output is recomputed
 *        here as the one GPU thread that owns it computes it, with the same functions and
 *        arguments (llmc/gpu_plan.h: the canonical walk of a tiled reduction, the streaming
 *        tree over chunks, the argument builders of every matmul-shaped product, the R3
 *        leaves and tree, the row kernels' per-chunk formulas, the embedding gradient's
 *        grouping by token), and compared BIT FOR BIT with train_gpt2.c's kernels on awkward
 *        shapes: sizes below 8 chunks, tiles cut short, several tiles, the qkv groups, T past
 *        one 128-row tile in attention, bf16 inputs of the shared reductions.
 *        The tiled kernel's thread mapping: every tile element loaded and every output
 *        owned by exactly one of its 256 threads, float4 reads aligned.
 *     2. The plan: launch grids, buffer sizes, the gradient tree's depth, AdamW's
 *        weight-decay runs, the state file's ranges (against train_gpt2.c's own), the
 *        initialisation (llmc/gpt2_init.h against train_gpt2.c's), the MFU peaks; the
 *        startup launch check (gpu_launch_problem): GPT-2 124M at B=64, T=1024 (logits past
 *        2^31 elements) fits in both modes, impossible shapes are refused with a reason.
 *     3. The binary, when built: train_gpt2cu --help; the refusals of what is not done yet
 *        (and -z accepted on one GPU, as train_gpt2 accepts it on one rank); without a GPU,
 *        one clear error line and exit status 1.
 *  - build/test_cuda_kernels, by nvcc as CUDA: the same, and on a GPU every kernel of
 *    llmc/kernels_det.cuh against its train_gpt2.c twin, bit for bit, and fast mode's kernels
 *    (cuBLASLt matmuls, flash attention, fused classifier, layernorms) against the reference
 *    within bf16 tolerances. Without a GPU it says so and runs the host checks.
 * Exits non-zero on any failure.
 */
#define TESTING
#include "train_gpt2.c"
#include <sys/wait.h>
#include "llmc/gpu_plan.h"
#include "llmc/gpt2_init.h"

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
static float emu_gemm_out(const DetGemmArgs* g, int z, int m, int n) {
    const float* A = g->A + det_zoff(z, g->zdiv, g->a_zhi, g->a_zlo);
    const float* B = g->B + det_zoff(z, g->zdiv, g->b_zhi, g->b_zlo);
    int m0 = m / DET_MT * DET_MT;
    int m_last = (m0 + DET_MT < g->M ? m0 + DET_MT : g->M) - 1;
    DetReduction red = det_tile_reduction(g->R, g->groups, g->causal, m0, m_last);
    float acc = 0.0f, s0 = 0.0f, s1 = 0.0f, s2 = 0.0f;
    int c = 0, grp = 0, k0 = -1, kend = 0, cur = 0;
    while (det_walk_seek(&red, &c, &grp, &k0, &kend)) {
        int klen = kend - k0 < DET_KT ? kend - k0 : DET_KT;
        while (cur < c) { det_tree8_push(cur++, acc, &s0, &s1, &s2); acc = 0.0f; }
        for (int kk = 0; kk < klen; kk++) {
            int r = k0 + kk;
            if (det_term_included(g->causal, r, m)) {
                acc = fmaf(A[(long)m * g->a_m + (long)r * g->a_r], B[(long)n * g->b_n + (long)r * g->b_r], acc);
            }
        }
        k0 += DET_KT;
    }
    while (cur < CANON_R) { det_tree8_push(cur++, acc, &s0, &s1, &s2); acc = 0.0f; }
    float v = s0 * g->scale;
    if (g->bias) { v = v + g->bias[n]; }
    return v;
}

static void emu_gemm(const DetGemmArgs* g) {
    for (int z = 0; z < g->Z; z++) {
        float* out = g->out + det_zoff(z, g->zdiv, g->o_zhi, g->o_zlo);
        for (int m = 0; m < g->M; m++) {
            for (int n = 0; n < g->N; n++) {
                if (g->out_lower && n > m) { continue; }
                out[(long)m * g->o_m + n] = emu_gemm_out(g, z, m, n);
            }
        }
    }
}

// position_reduce: leaves, then the R3 tree per output
static void emu_position_reduce(float* out, const void* x, int bf16, int B, int T, int OC) {
    float* leaves = zero_buf((size_t)B * CANON_R * OC);
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            for (int o = 0; o < OC; o++) {
                leaves[((size_t)b * CANON_R + ch) * OC + o] = det_position_leaf(x, bf16, OC, o, b, T, ch);
            }
        }
    }
    for (int o = 0; o < OC; o++) { out[o] = det_pos_tree(leaves + o, B, OC); }
    free(leaves);
}

static void emu_matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                const float* weight, int B, int T, int K, int OC, int groups) {
    DetGemmArgs g = det_args_matmul_dinp(dinp, dout, weight, B * T, K, OC, groups);
    emu_gemm(&g);
    size_t n = (size_t)OC * K;
    float* seq = zero_buf((size_t)B * n);
    g = det_args_matmul_dweight(B > 1 ? seq : dweight, dout, inp, B, T, K, OC);
    emu_gemm(&g);
    if (B > 1) {
        for (size_t i = 0; i < n; i++) { dweight[i] = canon_tree_sum(seq + i, B, (long)n); }
    }
    free(seq);
    emu_position_reduce(dbias, dout, 0, B, T, OC);
}

static void emu_layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
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

static void emu_layernorm_backward(float* dres, float* dw, float* db, const float* dout, const float* inp,
                                   const float* w, const float* mean, const float* rstd, int B, int T, int C) {
    for (int i = 0; i < B * T; i++) {
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
    size_t n = (size_t)B * CANON_R * C;
    float* leaves = zero_buf(2 * n);
    for (size_t idx = 0; idx < n; idx++) {
        int c = (int)(idx % C), leaf = (int)(idx / C);
        det_ln_param_leaf(inp, dout, 0, mean, rstd, C, c, leaf / CANON_R, T, leaf % CANON_R, &leaves[idx], &leaves[n + idx]);
    }
    for (int c = 0; c < C; c++) {
        dw[c] = det_pos_tree(leaves + c, B, C);
        db[c] = det_pos_tree(leaves + n + c, B, C);
    }
    free(leaves);
}

// attention_softmax_kernel on row (z, t): max, exps, chunk sums (lanes 0-7), tree, division
static void emu_softmax_row(float* a, int t, int T) {
    float maxv = -canon_inf();
    for (int t2 = 0; t2 <= t; t2++) { if (a[t2] > maxv) { maxv = a[t2]; } }
    for (int t2 = 0; t2 <= t; t2++) { a[t2] = canon_expf(a[t2] - maxv); }
    float p[CANON_R];
    for (int ch = 0; ch < CANON_R; ch++) {
        long end = canon_chunk_begin(T, ch + 1);
        p[ch] = det_chunk_sum(a, canon_chunk_begin(T, ch), end < t + 1 ? end : t + 1);
    }
    float z = canon_tree8(p);
    for (int t2 = 0; t2 < T; t2++) { a[t2] = t2 <= t ? a[t2] / z : 0.0f; }
}

static void emu_attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    DetGemmArgs g = det_args_attention_scores(att, qkv, B, T, C, NH);
    emu_gemm(&g);
    for (long row = 0; row < (long)B * NH * T; row++) { emu_softmax_row(att + row * T, (int)(row % T), T); }
    g = det_args_attention_by_keys(out, C, att, qkv + 2 * C, 3L * C, B, T, C, NH);
    emu_gemm(&g);
}

static void emu_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                   int B, int T, int C, int NH) {
    long C3 = 3L * C;
    float* ds = zero_buf((size_t)B * NH * T * T);
    DetGemmArgs g = det_args_attention_datt(ds, dout, qkv, B, T, C, NH);
    emu_gemm(&g);
    float scale = canon_rsqrtf((float)(C / NH));
    for (long row = 0; row < (long)B * NH * T; row++) {
        int t = (int)(row % T);
        float* d = ds + row * T;
        const float* at = att + row * T;
        float p[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) {
            long end = canon_chunk_begin(T, ch + 1);
            p[ch] = det_chunk_dot(at, d, canon_chunk_begin(T, ch), end < t + 1 ? end : t + 1);
        }
        float S = canon_tree8(p);
        for (int t2 = 0; t2 <= t; t2++) { d[t2] = at[t2] * (d[t2] - S) * scale; }
    }
    g = det_args_attention_by_keys(dqkv, C3, ds, qkv + C, C3, B, T, C, NH);
    emu_gemm(&g);
    g = det_args_attention_by_queries(dqkv + C, C3, ds, qkv, C3, B, T, C, NH);
    emu_gemm(&g);
    g = det_args_attention_by_queries(dqkv + 2 * C, C3, att, dout, C, B, T, C, NH);
    emu_gemm(&g);
    free(ds);
}

// crossentropy_forward_kernel on row i
static void emu_crossentropy_forward(float* probs, float* losses, const int* targets, int BT, int V, int Vp) {
    for (int i = 0; i < BT; i++) {
        float* p = probs + (size_t)i * Vp;
        float maxv = -canon_inf();
        for (int v = 0; v < V; v++) { if (p[v] > maxv) { maxv = p[v]; } }
        float target = targets ? p[targets[i]] - maxv : 0.0f;
        for (int v = 0; v < V; v++) { p[v] = canon_expf(p[v] - maxv); }
        float part[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) {
            long b = canon_chunk_begin(Vp, ch), e = canon_chunk_begin(Vp, ch + 1);
            part[ch] = det_chunk_sum(p, b < V ? b : V, e < V ? e : V);
        }
        float z = canon_tree8(part);
        for (int v = 0; v < Vp; v++) { p[v] = v < V ? p[v] / z : 0.0f; }
        if (targets) { losses[i] = canon_logf(z) - target; }
    }
}

static void emu_encoder_backward(float* dwte, float* dwpe, const void* dout, int bf16, const int* inp,
                                 int B, int T, int C, int Vp, int maxT) {
    int BT = B * T;
    int* count = (int*)malloc(sizeof(int) * ((size_t)Vp + 1));
    int *order = (int*)malloc(sizeof(int) * BT), *begin = (int*)malloc(sizeof(int) * (BT + 1));
    int* tokens = (int*)malloc(sizeof(int) * BT);
    int nuniq = encoder_backward_plan(inp, BT, Vp, count, order, begin, tokens);
    for (int t = 0; t < maxT; t++) {
        for (int c = 0; c < C; c++) {
            dwpe[(size_t)t * C + c] = t < T ? det_encoder_dwpe_elem(dout, bf16, B, T, C, t, c) : 0.0f;
        }
    }
    memset(dwte, 0, sizeof(float) * (size_t)Vp * C);
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
    int ns[] = {1, 3, 7, 8, 16, 17, 100, 129, 768};
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        for (int groups = 1; groups <= 3; groups += 2) {
            int n = ns[i] * groups;
            DetReduction r = {n, groups, 0, n};
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
        DetGemmArgs g = det_args_matmul_forward(got, inp, w, bias, BT, K, OC);
        emu_gemm(&g);
        snprintf(what, sizeof(what), "matmul_forward B=%d T=%d K=%d OC=%d", B, T, K, OC);
        expect_same(what, got, ref, (size_t)BT * OC);
        matmul_forward(ref, inp, w, NULL, BT, K, OC, CANON_R);
        g = det_args_matmul_forward(got, inp, w, NULL, BT, K, OC);
        emu_gemm(&g);
        expect_same("matmul_forward without bias", got, ref, (size_t)BT * OC);

        float *dinp_r = zero_buf((size_t)BT * K), *dw_r = zero_buf((size_t)OC * K), *db_r = zero_buf(OC);
        float *dinp_g = zero_buf((size_t)BT * K), *dw_g = zero_buf((size_t)OC * K), *db_g = zero_buf(OC);
        matmul_backward(dinp_r, dw_r, db_r, dout, inp, w, B, T, K, OC, groups, CANON_R);
        emu_matmul_backward(dinp_g, dw_g, db_g, dout, inp, w, B, T, K, OC, groups);
        snprintf(what, sizeof(what), "matmul_backward dinp B=%d T=%d K=%d OC=%d groups=%d", B, T, K, OC, groups);
        expect_same(what, dinp_g, dinp_r, (size_t)BT * K);
        snprintf(what, sizeof(what), "matmul_backward dweight B=%d T=%d K=%d OC=%d", B, T, K, OC);
        expect_same(what, dw_g, dw_r, (size_t)OC * K);
        snprintf(what, sizeof(what), "matmul_backward dbias B=%d T=%d OC=%d", B, T, OC);
        expect_same(what, db_g, db_r, OC);
        free(inp); free(w); free(bias); free(dout); free(ref); free(got);
        free(dinp_r); free(dw_r); free(db_r); free(dinp_g); free(dw_g); free(db_g);
    }
}

static void test_layernorm(void) {
    int shapes[][3] = {{1, 1, 1}, {1, 3, 7}, {2, 5, 64}, {3, 17, 100}, {2, 9, 768}};   // B, T, C
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], BT = B * T;
        float *x = rand_buf((size_t)BT * C), *w = rand_buf(C), *b = rand_buf(C), *dy = rand_buf((size_t)BT * C);
        float *out_r = zero_buf((size_t)BT * C), *mean_r = zero_buf(BT), *rstd_r = zero_buf(BT);
        float *out_g = zero_buf((size_t)BT * C), *mean_g = zero_buf(BT), *rstd_g = zero_buf(BT);
        layernorm_forward(out_r, mean_r, rstd_r, x, w, b, BT, C);
        emu_layernorm_forward(out_g, mean_g, rstd_g, x, w, b, BT, C);
        char what[96];
        snprintf(what, sizeof(what), "layernorm_forward BT=%d C=%d", BT, C);
        expect_same(what, out_g, out_r, (size_t)BT * C);
        expect_same("layernorm_forward mean", mean_g, mean_r, BT);
        expect_same("layernorm_forward rstd", rstd_g, rstd_r, BT);
        float* dres_r = rand_buf((size_t)BT * C);
        float* dres_g = copy_buf(dres_r, (size_t)BT * C);
        float *dw_r = zero_buf(C), *db_r = zero_buf(C), *dw_g = zero_buf(C), *db_g = zero_buf(C);
        layernorm_backward(dres_r, dw_r, db_r, dy, x, w, mean_r, rstd_r, B, T, C, CANON_R, NULL);
        emu_layernorm_backward(dres_g, dw_g, db_g, dy, x, w, mean_r, rstd_r, B, T, C);
        snprintf(what, sizeof(what), "layernorm_backward B=%d T=%d C=%d", B, T, C);
        expect_same(what, dres_g, dres_r, (size_t)BT * C);
        expect_same("layernorm_backward dweight", dw_g, dw_r, C);
        expect_same("layernorm_backward dbias", db_g, db_r, C);
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
        emu_attention_forward(out_g, att_g, qkv, B, T, C, NH);
        char what[96];
        snprintf(what, sizeof(what), "attention_forward out B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_same(what, out_g, out_r, nout);
        snprintf(what, sizeof(what), "attention_forward att B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_same(what, att_g, att_r, natt);
        float *dqkv_r = zero_buf(nqkv), *dqkv_g = zero_buf(nqkv);
        attention_backward(dqkv_r, dout, qkv, att_r, B, T, C, NH);
        emu_attention_backward(dqkv_g, dout, qkv, att_r, B, T, C, NH);
        snprintf(what, sizeof(what), "attention_backward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_same(what, dqkv_g, dqkv_r, nqkv);
        free(qkv); free(dout); free(out_r); free(att_r); free(out_g); free(att_g); free(dqkv_r); free(dqkv_g);
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
        emu_crossentropy_forward(p_g, l_g, targets, BT, V, Vp);
        char what[96];
        snprintf(what, sizeof(what), "crossentropy_forward probs BT=%d V=%d Vp=%d", BT, V, Vp);
        expect_same(what, p_g, p_r, (size_t)BT * Vp);
        expect_same("crossentropy_forward losses", l_g, l_r, BT);
        free(logits); free(targets); free(p_r); free(p_g); free(l_r); free(l_g);
    }
}

static void test_position_reductions(void) {
    int shapes[][3] = {{1, 1, 1}, {3, 5, 1}, {4, 33, 1}, {2, 17, 40}, {5, 3, 7}};   // B, T, OC
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int B = shapes[s][0], T = shapes[s][1], OC = shapes[s][2];
        float* x = rand_buf((size_t)B * T * OC);
        float* got = zero_buf(OC);
        emu_position_reduce(got, x, 0, B, T, OC);
        if (OC == 1) {
            float want = position_sum(x, B, T);
            CHECK(memcmp(got, &want, 4) == 0, "position_sum B=%d T=%d: %.9g vs %.9g", B, T, got[0], want);
        }
        // the bf16 path (fast mode's bias gradients): the same bits as fp32 on the rounded values
        uint16_t* h = bf16_round(x, (size_t)B * T * OC);
        float* want = zero_buf(OC);
        float* got16 = zero_buf(OC);
        emu_position_reduce(want, x, 0, B, T, OC);
        emu_position_reduce(got16, h, 1, B, T, OC);
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
        emu_encoder_backward(dwte_g, dwpe_g, dout, 0, inp, B, T, C, Vp, maxT);
        char what[96];
        snprintf(what, sizeof(what), "encoder_backward dwte B=%d T=%d C=%d", B, T, C);
        expect_same(what, dwte_g, dwte_r, (size_t)Vp * C);
        expect_same("encoder_backward dwpe", dwpe_g, dwpe_r, (size_t)maxT * C);
        uint16_t* h = bf16_round(dout, (size_t)BT * C);
        encoder_backward(dwte_r, dwpe_r, dout, inp, B, T, C, 0, Vp, maxT);
        emu_encoder_backward(dwte_g, dwpe_g, h, 1, inp, B, T, C, Vp, maxT);
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
            det_args_matmul_forward(NULL, NULL, NULL, NULL, BT, C, Vp),
            det_args_matmul_forward(NULL, NULL, NULL, NULL, BT, 4 * C, C),
            det_args_matmul_dinp(NULL, NULL, NULL, BT, C, Vp, 1),
            det_args_matmul_dinp(NULL, NULL, NULL, BT, C, 3 * C, 3),
            det_args_matmul_dweight(NULL, NULL, NULL, B, T, C, Vp),
            det_args_matmul_dweight(NULL, NULL, NULL, B, T, 4 * C, C),
            det_args_attention_scores(NULL, NULL, B, T, C, NH),
            det_args_attention_datt(NULL, NULL, NULL, B, T, C, NH),
            det_args_attention_by_keys(NULL, C, NULL, NULL, 3L * C, B, T, C, NH),
            det_args_attention_by_queries(NULL, 3L * C, NULL, NULL, 3L * C, B, T, C, NH),
        };
        int ok = 1;
        unsigned gx, gy, gz;
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
    // refused: head sizes flash attention lacks (fast), Vp not a multiple of 8 (fast), B*NH past
    // flash attention's grid.y, row tiles past det_gemm's grid.y, more than 2^31 gradient values
    GPT2Config c = d12;
    c.num_heads = 6;   // hs = 128
    CHECK(gpu_launch_problem(&c, 4, 64, 0, 0, buf, sizeof(buf)) != NULL && strstr(buf, "head size"), "hs=128 fast");
    CHECK(gpu_launch_problem(&c, 4, 64, 1, 0, buf, sizeof(buf)) == NULL, "hs=128 deterministic is fine");
    c = d12;
    c.padded_vocab_size = c.vocab_size;   // 50257: an llm.c file could say so
    CHECK(gpu_launch_problem(&c, 4, 64, 0, 0, buf, sizeof(buf)) != NULL && strstr(buf, "multiples of 8"), "Vp=V fast");
    CHECK(gpu_launch_problem(&c, 4, 64, 1, 0, buf, sizeof(buf)) == NULL, "Vp=V deterministic is fine");
    CHECK(gpu_launch_problem(&d12, 6000, 16, 0, 0, buf, sizeof(buf)) != NULL && strstr(buf, "grid.y"), "B*NH > 65535");
    CHECK(gpu_launch_problem(&d12, 65536, 256, 1, 0, buf, sizeof(buf)) != NULL, "B*T past the det grid / 32-bit rows");
    GPT2Config big;
    config_from_descriptor("d48c4096h32", &big);
    CHECK(gpu_launch_problem(&big, 1, 64, 0, 0, buf, sizeof(buf)) != NULL && strstr(buf, "2^31"), "2^31 gradient values");
}

static void test_plan(void) {
    int depths[][2] = {{1, 1}, {2, 2}, {3, 2}, {4, 3}, {5, 3}, {8, 4}, {16, 5}, {24, 5}};
    for (size_t i = 0; i < sizeof(depths) / sizeof(depths[0]); i++) {
        CHECK(gradstack_depth(depths[i][0]) == depths[i][1], "gradstack_depth(%d) = %d, expected %d",
              depths[i][0], gradstack_depth(depths[i][0]), depths[i][1]);
    }

    GPT2Config c;
    config_from_descriptor("d3c48h2v100t16", &c);
    size_t P = param_count(&c);
    // AdamW runs: contiguous, covering [0, P), and every element's decay is its tensor's
    int64_t run_end[64];
    int run_decay[64];
    int nruns = adamw_decay_runs(&c, run_end, run_decay, 64);
    CHECK(nruns > 0 && run_end[nruns - 1] == (int64_t)P, "adamw_decay_runs: %d runs ending at %lld of %zu",
          nruns, nruns > 0 ? (long long)run_end[nruns - 1] : -1LL, P);
    int bad = 0;
    for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
        int layers = param_is_layer_tensor(t) ? c.num_layers : 1;
        for (int l = 0; l < layers; l++) {
            size_t off = param_offset(&c, t, l);
            for (size_t i = off; i < off + param_tensor_elements(&c, t); i++) {
                int lo = 0, hi = nruns - 1;   // adamw_kernel's search
                while (lo < hi) { int mid = (lo + hi) / 2; if (run_end[mid] > (int64_t)i) { hi = mid; } else { lo = mid + 1; } }
                if (run_decay[lo] != param_is_decayed(t)) { bad++; }
            }
        }
    }
    CHECK(bad == 0, "adamw runs: %d elements get the wrong weight decay", bad);

    // the state file's ranges are those a single-rank train_gpt2 writes
    int argc = 1;
    char* argv0[] = {(char*)"test_cuda_host", NULL};
    char** argv = argv0;
    Comm comm;
    comm_init(&comm, &argc, &argv);
    float* params = gpt2_random_params(&c, 3);
    Zero zero;
    zero_init(&zero, &c, &memory_host, 0, &comm.dp_group, &comm.pp_group, &comm.tp_group, 0, c.num_layers, params, 1);
    zero_state_host_buffers(&zero);
    int n = zero_state_ranges(&zero, 1, NULL);
    StateRange* ranges = (StateRange*)malloc(sizeof(StateRange) * (n + 1));
    zero_state_ranges(&zero, 1, ranges);
    int64_t begin[64], end[64];
    int m = state_tensor_ranges(&c, begin, end);
    int same = n == m;
    for (int r = 0; same && r < n; r++) {
        same = ranges[r].begin == begin[r] && ranges[r].end == end[r] && ranges[r].m - zero.m == begin[r];
    }
    CHECK(same, "state_tensor_ranges differ from train_gpt2.c's zero_state_ranges (%d vs %d ranges)", m, n);
    free(ranges);
    zero_free(&zero);

    // the initialisation (llmc/gpt2_init.h) against its definition: layernorm weights 1, biases
    // and padded vocabulary rows 0, weights N(0, 0.02) and the residual projections
    // N(0, 0.02/sqrt(2L)) (sample std within 3%), reproducible for a seed, different across seeds
    {
        GPT2Config ci;
        config_from_descriptor("d4", &ci);
        size_t P = param_count(&ci);
        float* a = (float*)aligned_calloc_or_die(P * sizeof(float), "params");
        float* b = (float*)aligned_calloc_or_die(P * sizeof(float), "params");
        gpt2_init_params(a, &ci, 42);
        gpt2_init_params(b, &ci, 42);
        CHECK(memcmp(a, b, P * sizeof(float)) == 0, "the same seed gives different parameters");
        gpt2_init_params(b, &ci, 43);
        CHECK(memcmp(a, b, P * sizeof(float)) != 0, "different seeds give the same parameters");
        for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
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
    free(params);
    comm_finalize(&comm);

    // memory plan of GPT-2 124M
    GPT2Config d12;
    config_from_descriptor("d12", &d12);
    CHECK(param_count(&d12) == 124475904, "d12 has %zu parameters, expected 124475904", param_count(&d12));
    GpuMemoryPlan det = gpu_memory_plan(&d12, 4, 64, 4, 1, 1, 64);
    GpuMemoryPlan fast = gpu_memory_plan(&d12, 4, 64, 4, 0, 0, 0);
    size_t Pd = param_count(&d12), VpC = (size_t)d12.padded_vocab_size * d12.channels;
    CHECK(det.grad_buffers == 3 && det.count[BUF_GRADS] == 3 * (Pd + VpC), "gradient buffers of 4 microbatches");
    CHECK(det.count[BUF_ATT] == (size_t)12 * 4 * 12 * 64 * 64 && det.width[BUF_ATT] == 4, "deterministic attention buffer");
    CHECK(fast.count[BUF_ATT] == (size_t)12 * 4 * 12 * 64 && fast.width[BUF_LN1] == 2 && fast.width[BUF_LOGITS] == 2,
          "fast mode's stats and bf16 activations");
    CHECK(det.count[BUF_FCH_GELU] == (size_t)4 * 64 * 4 * 768 && fast.count[BUF_FCH_GELU] == 12 * det.count[BUF_FCH_GELU],
          "recompute keeps one layer of GELU output");
    CHECK(det.count[BUF_PARAMS_BF16] == 0 && fast.count[BUF_PARAMS_BF16] == Pd, "bf16 parameter copy only in fast mode");
    CHECK(det.count[BUF_DWEIGHT_SEQ] == 4 * VpC && det.count[BUF_LEAVES] >= (size_t)4 * CANON_R * 2 * 768 + 1,
          "deterministic scratch sizes");
    CHECK(fast.count[BUF_CUBLASLT_WS] == CUBLASLT_WORKSPACE_BYTES && det.count[BUF_CUBLASLT_WS] == 0, "cuBLASLt workspace");
    size_t total = 0;
    for (int i = 0; i < NUM_BUFS; i++) {
        CHECK(gpu_buf_names[i] != NULL, "buffer %d has no name", i);
        total += gpu_round256(gpu_plan_bytes(&det, i));
    }
    CHECK(total == gpu_plan_total_bytes(&det), "total bytes");
    // the sampler's activations are carved from one allocation
    size_t sc[NUM_BUFS], sw[NUM_BUFS], carved = 0;
    gpu_plan_activations(&d12, 1, 64, 1, 1, sc, sw);
    for (int i = BUF_ENCODED; i <= BUF_PROJ; i++) { carved += gpu_round256(sc[i] * sw[i]); }
    CHECK(carved + 256 == det.count[BUF_SAMPLE_ACTS], "sampler allocation: %zu carved of %zu", carved, det.count[BUF_SAMPLE_ACTS]);

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
    double f = gpt2_flops_per_step(Pd, &d12, 1024, 524288);
    CHECK(f == (6.0 * (double)Pd + 6.0 * 12 * 768 * 1024) * 524288.0, "flops per step");
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
    if (!file_exists("train_gpt2cu")) {
        printf("note: ./train_gpt2cu not built (no CUDA): its command-line checks are skipped\n");
        return;
    }
    static char out[1 << 16];
    int rc = run_cmd("./train_gpt2cu --help", out, sizeof(out));
    CHECK(rc == 0 && strstr(out, "--deterministic") && strstr(out, "--grad-clip"), "train_gpt2cu --help (exit %d)", rc);
    const char* refused[][2] = {
        {"./train_gpt2cu --tp 2", "not done yet"},
        {"./train_gpt2cu --sp 1", "not done yet"},
        {"./train_gpt2cu --pp 2", "not done yet"},
        {"OMPI_COMM_WORLD_SIZE=2 ./train_gpt2cu", "not done yet"},
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
    // -z on one GPU is accepted as train_gpt2 accepts it on one rank (ZeRO over one rank is
    // stage 0): the run gets as far as the GPU (or the data), like the one above
    rc = run_cmd("./train_gpt2cu -z 3 --tp 1 --pp 1 --schedule gpipe -e d2c32h2v64t32 -i /nonexistent/train.bin "
                 "-j /nonexistent/val.bin -b 2 -t 8 -x 1", out, sizeof(out));
    CHECK(rc == 1 && count_error_lines(out) == 1 && !strstr(out, "not done yet") &&
          (strstr(out, "no CUDA GPU") || strstr(out, "no token files")),
          "train_gpt2cu -z 3 --tp 1 --pp 1 on one GPU must be accepted (exit %d): %s", rc, out);
    printf("train_gpt2cu: %s\n", no_gpu ? "no GPU here: fails with one clear line" : "a GPU is present");
}


#ifdef __CUDACC__
// ==========================================================================================
// 4. on a GPU: the kernels themselves
// ==========================================================================================
// The GPU launchers have their CPU twins' names, so they live in namespace gpu here.
#include <cublasLt.h>
#include "llmc/cuda_common.cuh"
namespace gpu {
#include "llmc/kernels_det.cuh"
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
static floatX* dev_bf16(const float* h, size_t n) {   // h holds bf16-representable values
    uint16_t* bits = (uint16_t*)malloc(2 * (n ? n : 1));
    for (size_t i = 0; i < n; i++) { bits[i] = to_bf16_bits(h[i]); }
    floatX* d = (floatX*)dev_alloc(n * 2);
    cudaCheck(cudaMemcpy(d, bits, n * 2, cudaMemcpyHostToDevice));
    free(bits);
    return d;
}
static float* host_floats(const float* d, size_t n) {
    float* h = (float*)malloc(4 * (n ? n : 1));
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost));
    return h;
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

// bit-exact comparison of a device fp32 result with the reference
static void expect_device(const char* what, const float* d, const float* want, size_t n) {
    float* got = host_floats(d, n);
    expect_same(what, got, want, n);
    free(got);
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

static void test_device_det(void) {
    // matmul
    int mm[][5] = {{1, 1, 1, 1, 1}, {2, 5, 17, 30, 3}, {4, 33, 129, 12, 3}, {2, 70, 200, 130, 1}, {1, 300, 96, 200, 1},
                   {3, 64, 768, 96, 3}};
    for (size_t s = 0; s < sizeof(mm) / sizeof(mm[0]); s++) {
        int B = mm[s][0], T = mm[s][1], K = mm[s][2], OC = mm[s][3], groups = mm[s][4], BT = B * T;
        char what[128];
        float *inp = rand_buf((size_t)BT * K), *w = rand_buf((size_t)OC * K), *bias = rand_buf(OC);
        float* dout = rand_buf((size_t)BT * OC);
        float* ref = zero_buf((size_t)BT * OC);
        matmul_forward(ref, inp, w, bias, BT, K, OC, CANON_R);
        float *d_inp = dev_floats(inp, (size_t)BT * K), *d_w = dev_floats(w, (size_t)OC * K), *d_bias = dev_floats(bias, OC);
        float* d_out = (float*)dev_alloc((size_t)BT * OC * 4);
        gpu::matmul_forward(d_out, d_inp, d_w, d_bias, BT, K, OC);
        snprintf(what, sizeof(what), "GPU matmul_forward B=%d T=%d K=%d OC=%d", B, T, K, OC);
        expect_device(what, d_out, ref, (size_t)BT * OC);
        float *dinp = zero_buf((size_t)BT * K), *dw = zero_buf((size_t)OC * K), *db = zero_buf(OC);
        matmul_backward(dinp, dw, db, dout, inp, w, B, T, K, OC, groups, CANON_R);
        float* d_dout = dev_floats(dout, (size_t)BT * OC);
        float *d_dinp = (float*)dev_alloc((size_t)BT * K * 4), *d_dw = (float*)dev_alloc((size_t)OC * K * 4);
        float* d_db = (float*)dev_alloc((size_t)OC * 4);
        float* d_seq = (float*)dev_alloc((size_t)B * OC * K * 4);
        float* d_leaves = (float*)dev_alloc((size_t)B * CANON_R * OC * 4 + 4);
        gpu::matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, B, T, K, OC, groups, d_seq, d_leaves);
        snprintf(what, sizeof(what), "GPU matmul_backward B=%d T=%d K=%d OC=%d groups=%d: dinp", B, T, K, OC, groups);
        expect_device(what, d_dinp, dinp, (size_t)BT * K);
        expect_device("GPU matmul_backward dweight", d_dw, dw, (size_t)OC * K);
        expect_device("GPU matmul_backward dbias", d_db, db, OC);
        free(inp); free(w); free(bias); free(dout); free(ref); free(dinp); free(dw); free(db);
        cudaFree(d_inp); cudaFree(d_w); cudaFree(d_bias); cudaFree(d_out); cudaFree(d_dout); cudaFree(d_dinp);
        cudaFree(d_dw); cudaFree(d_db); cudaFree(d_seq); cudaFree(d_leaves);
    }
    // layernorm
    int ln[][3] = {{1, 1, 1}, {1, 3, 7}, {2, 5, 64}, {3, 17, 100}, {4, 64, 768}};
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
        snprintf(what, sizeof(what), "GPU layernorm_forward BT=%d C=%d", BT, C);
        expect_device(what, d_out, out, n);
        expect_device("GPU layernorm_forward mean", d_mean, mean, BT);
        expect_device("GPU layernorm_forward rstd", d_rstd, rstd, BT);
        float *d_dy = dev_floats(dy, n), *d_dres = dev_floats(dres, n);
        float *d_dw = (float*)dev_alloc(C * 4), *d_db = (float*)dev_alloc(C * 4);
        float* d_leaves = (float*)dev_alloc((size_t)B * CANON_R * 2 * C * 4);
        float *dw = zero_buf(C), *db = zero_buf(C);
        layernorm_backward(dres, dw, db, dy, x, w, mean, rstd, B, T, C, CANON_R, NULL);
        gpu::layernorm_backward(d_dres, d_dw, d_db, d_dy, d_x, d_w, d_mean, d_rstd, B, T, C, d_leaves);
        snprintf(what, sizeof(what), "GPU layernorm_backward B=%d T=%d C=%d", B, T, C);
        expect_device(what, d_dres, dres, n);
        expect_device("GPU layernorm_backward dweight", d_dw, dw, C);
        expect_device("GPU layernorm_backward dbias", d_db, db, C);
        free(x); free(w); free(b); free(dy); free(dres); free(out); free(mean); free(rstd); free(dw); free(db);
        cudaFree(d_x); cudaFree(d_w); cudaFree(d_b); cudaFree(d_out); cudaFree(d_mean); cudaFree(d_rstd);
        cudaFree(d_dy); cudaFree(d_dres); cudaFree(d_dw); cudaFree(d_db); cudaFree(d_leaves);
    }
    // attention
    int at[][4] = {{1, 1, 8, 2}, {2, 5, 8, 2}, {2, 9, 24, 3}, {1, 150, 16, 1}, {2, 131, 32, 2}, {2, 200, 128, 2}};
    for (size_t s = 0; s < sizeof(at) / sizeof(at[0]); s++) {
        int B = at[s][0], T = at[s][1], C = at[s][2], NH = at[s][3];
        size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, natt = (size_t)B * NH * T * T;
        float *qkv = rand_buf(nqkv), *dout = rand_buf(nout);
        float *out = zero_buf(nout), *att = zero_buf(natt), *dqkv = zero_buf(nqkv);
        attention_forward(out, att, qkv, B, T, C, NH);
        attention_backward(dqkv, dout, qkv, att, B, T, C, NH);
        float *d_qkv = dev_floats(qkv, nqkv), *d_dout = dev_floats(dout, nout);
        float *d_out = (float*)dev_alloc(nout * 4), *d_att = (float*)dev_alloc(natt * 4);
        float *d_dqkv = (float*)dev_alloc(nqkv * 4), *d_ds = (float*)dev_alloc(natt * 4);
        gpu::attention_forward(d_out, d_att, d_qkv, B, T, C, NH);
        gpu::attention_backward(d_dqkv, d_dout, d_qkv, d_att, B, T, C, NH, d_ds);
        char what[96];
        snprintf(what, sizeof(what), "GPU attention_forward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_device(what, d_out, out, nout);
        expect_device("GPU attention_forward att", d_att, att, natt);
        snprintf(what, sizeof(what), "GPU attention_backward B=%d T=%d C=%d NH=%d", B, T, C, NH);
        expect_device(what, d_dqkv, dqkv, nqkv);
        free(qkv); free(dout); free(out); free(att); free(dqkv);
        cudaFree(d_qkv); cudaFree(d_dout); cudaFree(d_out); cudaFree(d_att); cudaFree(d_dqkv); cudaFree(d_ds);
    }
    // cross-entropy, its backward, the loss sum
    int ce[][3] = {{3, 5, 8}, {2, 7, 7}, {6, 1000, 1024}, {3, 50257, 50304}};
    for (size_t s = 0; s < sizeof(ce) / sizeof(ce[0]); s++) {
        int BT = ce[s][0], V = ce[s][1], Vp = ce[s][2];
        size_t n = (size_t)BT * Vp;
        float* logits = rand_buf(n);
        int* targets = rand_tokens(BT, V);
        float *probs = copy_buf(logits, n), *losses = zero_buf(BT);
        cpu_crossentropy_forward(probs, losses, targets, BT, V, Vp);
        float *d_p = dev_floats(logits, n), *d_losses = (float*)dev_alloc(BT * 4);
        int* d_t = dev_ints(targets, BT);
        gpu::crossentropy_forward(d_p, d_losses, d_t, BT, V, Vp);
        char what[96];
        snprintf(what, sizeof(what), "GPU crossentropy_forward BT=%d V=%d Vp=%d", BT, V, Vp);
        expect_device(what, d_p, probs, n);
        expect_device("GPU crossentropy_forward losses", d_losses, losses, BT);
        crossentropy_backward(probs, targets, 1.0f / 77.0f, BT, V, 0, Vp);
        gpu::crossentropy_backward(d_p, d_t, 1.0f / 77.0f, BT, V, Vp);
        expect_device("GPU crossentropy_backward", d_p, probs, n);
        float* d_leaves = (float*)dev_alloc((size_t)BT * CANON_R * 4 + 4);
        float* d_sum = (float*)dev_alloc(4);
        gpu::position_reduce(d_sum, d_leaves, d_losses, 0, 1, BT, 1);
        float want = position_sum(losses, 1, BT);
        expect_device("GPU position_sum", d_sum, &want, 1);
        free(logits); free(targets); free(probs); free(losses);
        cudaFree(d_p); cudaFree(d_losses); cudaFree(d_t); cudaFree(d_leaves); cudaFree(d_sum);
    }
    // encoder, GELU, residual
    {
        int B = 3, T = 37, C = 40, Vp = 128, maxT = 64, BT = B * T;
        int* inp = rand_tokens(BT, 100);
        float *wte = rand_buf((size_t)Vp * C), *wpe = rand_buf((size_t)maxT * C), *dout = rand_buf((size_t)BT * C);
        float* out = zero_buf((size_t)BT * C);
        cpu_encoder_forward(out, inp, wte, wpe, B, T, C, Vp);
        int* d_inp = dev_ints(inp, BT);
        float *d_wte = dev_floats(wte, (size_t)Vp * C), *d_wpe = dev_floats(wpe, (size_t)maxT * C);
        float* d_out = (float*)dev_alloc((size_t)BT * C * 4);
        gpu::encoder_forward(d_out, d_inp, d_wte, d_wpe, B, T, C);
        expect_device("GPU encoder_forward", d_out, out, (size_t)BT * C);
        float *dwte = zero_buf((size_t)Vp * C), *dwpe = zero_buf((size_t)maxT * C);
        encoder_backward(dwte, dwpe, dout, inp, B, T, C, 0, Vp, maxT);
        int* count = (int*)malloc(sizeof(int) * (Vp + 1));
        int *order = (int*)malloc(sizeof(int) * BT), *begin = (int*)malloc(sizeof(int) * (BT + 1));
        int* tokens = (int*)malloc(sizeof(int) * BT);
        int nuniq = encoder_backward_plan(inp, BT, Vp, count, order, begin, tokens);
        int *d_order = dev_ints(order, BT), *d_begin = dev_ints(begin, nuniq + 1), *d_tokens = dev_ints(tokens, nuniq);
        float* d_dout = dev_floats(dout, (size_t)BT * C);
        float *d_dwte = (float*)dev_alloc((size_t)Vp * C * 4), *d_dwpe = (float*)dev_alloc((size_t)maxT * C * 4);
        gpu::encoder_backward(d_dwte, d_dwpe, d_dout, 0, d_order, d_begin, d_tokens, nuniq, B, T, C, Vp, maxT);
        expect_device("GPU encoder_backward dwte", d_dwte, dwte, (size_t)Vp * C);
        expect_device("GPU encoder_backward dwpe", d_dwpe, dwpe, (size_t)maxT * C);
        size_t n = (size_t)BT * C;
        float *g = zero_buf(n), *gb = zero_buf(n), *r = zero_buf(n);
        gelu_forward(g, dout, n);
        gelu_backward(gb, dout, out, n);
        residual_forward(r, dout, out, n);
        float *d_g = (float*)dev_alloc(n * 4), *d_gb = (float*)dev_alloc(n * 4), *d_r = (float*)dev_alloc(n * 4);
        gpu::gelu_forward(d_g, d_dout, n);
        gpu::gelu_backward(d_gb, d_dout, d_out, n);
        gpu::residual_forward(d_r, d_dout, d_out, n);
        expect_device("GPU gelu_forward", d_g, g, n);
        expect_device("GPU gelu_backward", d_gb, gb, n);
        expect_device("GPU residual_forward", d_r, r, n);
        free(inp); free(wte); free(wpe); free(dout); free(out); free(dwte); free(dwpe); free(count); free(order);
        free(begin); free(tokens); free(g); free(gb); free(r);
        cudaFree(d_inp); cudaFree(d_wte); cudaFree(d_wpe); cudaFree(d_out); cudaFree(d_order); cudaFree(d_begin);
        cudaFree(d_tokens); cudaFree(d_dout); cudaFree(d_dwte); cudaFree(d_dwpe); cudaFree(d_g); cudaFree(d_gb); cudaFree(d_r);
    }
    // the optimizer step: exact norm, AdamW with the weight-decay runs
    {
        GPT2Config c;
        config_from_descriptor("d2c64h2v300t32", &c);
        size_t P = param_count(&c);
        float *p = rand_buf(P), *m = rand_buf(P), *v = rand_buf(P), *grad = rand_buf(P);
        for (size_t i = 0; i < P; i++) { v[i] = fabsf(v[i]); }
        SumSq all;
        canon_sumsq_init(&all);
        for (size_t i = 0; i < P; i++) { canon_sumsq_add(&all, grad[i]); }
        float norm = (float)sqrt(canon_sumsq_value(&all));
        float *d_p = dev_floats(p, P), *d_m = dev_floats(m, P), *d_v = dev_floats(v, P), *d_g = dev_floats(grad, P);
        SumSq* d_sumsq = (SumSq*)dev_alloc(sizeof(SumSq));
        float got = gpu::gradient_norm(d_g, P, d_sumsq);
        CHECK(memcmp(&got, &norm, 4) == 0, "GPU gradient_norm %.9g, reference %.9g", got, norm);
        AdamWStep s = adamw_step_constants(3e-4f, 0.9f, 0.95f, 1e-8f, 3, 0.5f);
        int64_t run_end[128];
        int run_decay[128];
        int nruns = adamw_decay_runs(&c, run_end, run_decay, 128);
        for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
            int layers = param_is_layer_tensor(t) ? c.num_layers : 1;
            for (int l = 0; l < layers; l++) {
                size_t off = param_offset(&c, t, l);
                for (size_t i = off; i < off + param_tensor_elements(&c, t); i++) {
                    adamw_update_elem(&p[i], &m[i], &v[i], grad[i], &s, param_is_decayed(t) ? 0.1f : 0.0f);
                }
            }
        }
        int64_t* d_run_end = (int64_t*)dev_alloc(sizeof(int64_t) * nruns);
        int* d_run_decay = (int*)dev_alloc(sizeof(int) * nruns);
        cudaCheck(cudaMemcpy(d_run_end, run_end, sizeof(int64_t) * nruns, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_run_decay, run_decay, sizeof(int) * nruns, cudaMemcpyHostToDevice));
        floatX* d_px = (floatX*)dev_alloc(P * 2);
        gpu::adamw_update(d_p, d_px, d_m, d_v, d_g, P, d_run_end, d_run_decay, nruns, &s, 0.1f);
        expect_device("GPU adamw_update params", d_p, p, P);
        expect_device("GPU adamw_update m", d_m, m, P);
        expect_device("GPU adamw_update v", d_v, v, P);
        float* px = host_bf16(d_px, P);
        free(bf16_round(p, P));
        expect_same("GPU adamw_update bf16 copy", px, p, P);
        free(p); free(m); free(v); free(grad); free(px);
        cudaFree(d_p); cudaFree(d_m); cudaFree(d_v); cudaFree(d_g); cudaFree(d_sumsq); cudaFree(d_run_end);
        cudaFree(d_run_decay); cudaFree(d_px);
    }
}

// Fast mode against the reference run on the same (bf16-representable) inputs. Tolerances,
// relative to the largest reference value: outputs stored in bf16 carry its rounding (2^-9
// relative) plus fp32 accumulation in another order: 1e-2; fp32 weight gradients of bf16
// inputs: products are exact in fp32, only the order differs: 1e-3; attention rounds P to bf16
// before P.V (2e-2) and dS before dS.K, dS^T.Q (5e-2).
static void test_device_fast(void) {
    void* ws = dev_alloc(CUBLASLT_WORKSPACE_BYTES);
    gpu::cublaslt_init(ws);
    gpu::flash_attention_setup();
    // matmuls, plain and with the GELU epilogues
    int mm[][4] = {{2, 64, 64, 192}, {4, 37, 256, 1024}, {1, 100, 1024, 256}};   // B T K OC
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
        float* d_leaves = (float*)dev_alloc((size_t)B * CANON_R * OC * 4);
        gpu::matmul_backward_fast(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, B, T, K, OC, NULL, d_leaves);
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
        gpu::matmul_backward_fast(d_dinp, NULL, NULL, d_dout, d_inp, d_w, B, T, K, OC, d_pre_in, d_leaves);
        for (size_t i = 0; i < (size_t)BT * K; i++) { dinp[i] = canon_gelu_grad(pre_in[i]) * dinp[i]; }
        got = host_bf16(d_dinp, (size_t)BT * K);
        expect_close("fast matmul_backward dinp + DGELU", got, dinp, (size_t)BT * K, 1e-2);
        free(got);
        free(inp); free(w); free(bias); free(dout); free(ref); free(pre); free(dinp); free(dw); free(db); free(pre_in);
        cudaFree(d_inp); cudaFree(d_w); cudaFree(d_bias); cudaFree(d_out); cudaFree(d_pre); cudaFree(d_dout);
        cudaFree(d_dinp); cudaFree(d_dw); cudaFree(d_db); cudaFree(d_leaves); cudaFree(d_pre_in);
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
        layernorm_backward(dres, dw, db, dy, sum, w, mean, rstd, B, T, C, CANON_R, NULL);
        float *d_mean_ref = dev_floats(mean, BT), *d_rstd_ref = dev_floats(rstd, BT);
        gpu::layernorm_backward_fast(d_dres, d_dy, d_sum, d_w, d_mean_ref, d_rstd_ref, BT, C);
        got = host_bf16(d_dres, n);
        expect_close("fast layernorm_backward", got, dres, n, 1e-2);
        free(got);
        // the parameter gradients: the exact R3 kernel on bf16 inputs, the reference's bits
        float *d_dw = (float*)dev_alloc(C * 4), *d_db = (float*)dev_alloc(C * 4);
        float* d_leaves = (float*)dev_alloc((size_t)B * CANON_R * 2 * C * 4);
        gpu::layernorm_param_grads(d_dw, d_db, d_leaves, d_sum, d_dy, 1, d_mean_ref, d_rstd_ref, B, T, C);
        expect_device("layernorm_param_grads on bf16 dweight", d_dw, dw, C);
        expect_device("layernorm_param_grads on bf16 dbias", d_db, db, C);
        free(dw); free(db);
        cudaFree(d_mean_ref); cudaFree(d_rstd_ref); cudaFree(d_dw); cudaFree(d_db); cudaFree(d_leaves);
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
    cudaFree(ws);
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
    printf("deterministic kernels: %s\n", failures == before ? "bit-identical to train_gpt2.c" : "MISMATCHES above");
    before = failures;
    test_device_fast();
    printf("fast kernels: %s\n", failures == before ? "within tolerance" : "OUT OF TOLERANCE above");
}
#endif

int main(void) {
    test_walk();
    test_det_gemm_threads();
    test_matmul();
    test_layernorm();
    test_attention();
    test_crossentropy();
    test_position_reductions();
    test_encoder_backward();
    test_sumsq();
    test_plan();
    test_binary();
#ifdef __CUDACC__
    test_device();
#endif
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
