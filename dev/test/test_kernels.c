/*
 * test_kernels.c: every CPU kernel against the canonical order written out naively.
 *
 * The reference functions here implement the rules of llmc/canonical.h directly from their
 * text (R1 as a recursion with the ceil(n/2) split, R2 as 8 chunks [c*n/8, (c+1)*n/8)
 * accumulated from 0.0f, R2Z as 8 chunks of piece c then piece 15-c of 16 pieces
 * [p*n/16, (p+1)*n/16), R3 as R2Z over t per sequence then R1 over sequences), scalar and
 * without the kernels' tiling, SIMD or stacks. The optimised kernels must match them BIT FOR
 * BIT on awkward shapes (sizes that fill no vector, tiles cut short, T < 8 chunks, ...).
 * Also checked: a reduction split in 2 or 4 slices of whole chunks and finished by the R1
 * tree gives the unsplit bits (what tensor parallelism relies on).
 */
#define TESTING
#include "train_gpt2.c"
#include "llmc/decode_matmul.h"

static int failures = 0, checks = 0;

static uint64_t rng_state = 99;
static float frand(void) {   // values of mixed magnitude, so that summation order matters
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

static void expect_same(const char* what, const float* got, const float* want, size_t n) {
    checks++;
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], 4) != 0) {
            failures++;
            printf("FAIL %s: element %zu is %.9g, canonical %.9g\n", what, i, got[i], want[i]);
            return;
        }
    }
}

// --- the rules, written out ---------------------------------------------------------------

static float r1(const float* v, int n) {
    if (n == 1) { return v[0]; }
    int mid = (n + 1) / 2;
    return r1(v, mid) + r1(v + mid, n - mid);
}

// R2Z: the stretch `half` of zig-zag chunk c of nchunks over a sequence of length n, from the
// rule's text: 2*nchunks pieces [p*n/(2*nchunks), (p+1)*n/(2*nchunks)); chunk c is piece c,
// then piece 2*nchunks-1-c
static void zz(long n, int nchunks, int c, int half, long* b, long* e) {
    long p = half == 0 ? c : 2 * nchunks - 1 - c;
    *b = n * p / (2 * nchunks);
    *e = n * (p + 1) / (2 * nchunks);
}

// Rank r's D-way zig-zag slice of a sequence of T positions, from the rule's text: R2Z chunks
// [r*k, (r+1)*k), k = 8/D, i.e. pieces r*k .. r*k+k-1 (the low stretch) then their mirrors
// 16-(r+1)*k .. 15-r*k (the high stretch), piece p = [p*T/16, (p+1)*T/16): the slice's length,
// and the global position of its local position t.
static long piece(long T, int p) { return T * p / 16; }
static long slice_len(long T, int D, int r) {
    int k = 8 / D;
    return (piece(T, (r + 1) * k) - piece(T, r * k)) + (piece(T, 16 - r * k) - piece(T, 16 - (r + 1) * k));
}
static long slice_pos(long T, int D, int r, long t) {
    int k = 8 / D;
    long low = piece(T, (r + 1) * k) - piece(T, r * k);
    return t < low ? piece(T, r * k) + t : piece(T, 16 - (r + 1) * k) + (t - low);
}

typedef float (*TermFn)(long i, const void* ctx);   // i-th term of a reduction
typedef struct { int is_product; } Kind;

// R2 over n terms with `nchunks` chunks: term(i) is either a value added, or (a, b) fused
static float r2_generic(long n, int nchunks, float (*a)(long, const void*), float (*b)(long, const void*),
                        const void* ctx) {
    float partial[64];
    for (int c = 0; c < nchunks; c++) {
        float acc = 0.0f;
        for (long i = n * c / nchunks; i < n * (c + 1) / nchunks; i++) {
            acc = b ? fmaf(a(i, ctx), b(i, ctx), acc) : acc + a(i, ctx);
        }
        partial[c] = acc;
    }
    return r1(partial, nchunks);
}

// --- matmul -------------------------------------------------------------------------------
typedef struct { const float *x, *w; int K, OC, groups, nchunks; long row, col; } MMCtx;
static float mm_x(long k, const void* c) { const MMCtx* m = c; return m->x[m->row * m->K + k]; }
static float mm_w(long k, const void* c) { const MMCtx* m = c; return m->w[m->col * m->K + k]; }

static void ref_matmul_forward(float* out, const float* inp, const float* w, const float* bias,
                               int BT, int K, int OC, int nchunks) {
    for (int r = 0; r < BT; r++) {
        for (int o = 0; o < OC; o++) {
            MMCtx c = {inp, w, K, OC, 1, nchunks, r, o};
            float s = r2_generic(K, nchunks, mm_x, mm_w, &c);
            out[(size_t)r * OC + o] = bias ? s + bias[o] : s;
        }
    }
}

// dinp: the reduction over outputs in the grouped order: index i of the reduction maps to
// output o = g*(OC/G) + j where chunk c holds [c*og/nch, (c+1)*og/nch) of every group in turn.
static void ref_matmul_dinp(float* dinp, const float* dout, const float* w, int BT, int K, int OC,
                            int groups, int nchunks) {
    int og = OC / groups;
    for (int r = 0; r < BT; r++) {
        for (int k = 0; k < K; k++) {
            float partial[64];
            for (int c = 0; c < nchunks; c++) {
                float acc = 0.0f;
                for (int g = 0; g < groups; g++) {
                    for (int j = og * c / nchunks; j < og * (c + 1) / nchunks; j++) {
                        int o = g * og + j;
                        acc = fmaf(dout[(size_t)r * OC + o], w[(size_t)o * K + k], acc);
                    }
                }
                partial[c] = acc;
            }
            dinp[(size_t)r * K + k] = r1(partial, nchunks);
        }
    }
}

// R3 over positions (B sequences of T): f(b, t)*g(b, t) fused, or f alone
static float ref_r3(int B, int T, const float* f, long fstride, long foff, const float* g, long gstride, long goff) {
    float seq[512];
    for (int b = 0; b < B; b++) {
        float partial[CANON_R];
        for (int c = 0; c < CANON_R; c++) {
            float acc = 0.0f;
            for (int half = 0; half < 2; half++) {
                long tb, te;
                zz(T, CANON_R, c, half, &tb, &te);
                for (long t = tb; t < te; t++) {
                    long pos = (long)b * T + t;
                    acc = g ? fmaf(f[pos * fstride + foff], g[pos * gstride + goff], acc) : acc + f[pos * fstride + foff];
                }
            }
            partial[c] = acc;
        }
        seq[b] = r1(partial, CANON_R);
    }
    return r1(seq, B);
}

static void test_matmul(int B, int T, int K, int OC, int groups) {
    int BT = B * T;
    char what[128];
    float* inp = rand_buf((size_t)BT * K);
    float* w = rand_buf((size_t)OC * K);
    float* bias = rand_buf(OC);
    float* dout = rand_buf((size_t)BT * OC);
    float* got = malloc(sizeof(float) * ((size_t)BT * (K > OC ? K : OC) + (size_t)OC * K + 1));
    float* want = malloc(sizeof(float) * ((size_t)BT * (K > OC ? K : OC) + (size_t)OC * K + 1));
    // the fast kernel and its written-out specification in train_gpt2.c (matmul_*_naive)
    // against the rules above
    float* spec = malloc(sizeof(float) * ((size_t)BT * (K > OC ? K : OC) + 1));
    for (int nch = CANON_R; nch >= 1; nch /= 2) {
        matmul_forward(got, inp, w, nch == CANON_R ? bias : NULL, BT, K, OC, nch);
        matmul_forward_naive(spec, inp, w, nch == CANON_R ? bias : NULL, BT, K, OC, nch);
        ref_matmul_forward(want, inp, w, nch == CANON_R ? bias : NULL, BT, K, OC, nch);
        snprintf(what, sizeof(what), "matmul_forward BT=%d K=%d OC=%d chunks=%d", BT, K, OC, nch);
        expect_same(what, got, want, (size_t)BT * OC);
        snprintf(what, sizeof(what), "matmul_forward_naive BT=%d K=%d OC=%d chunks=%d", BT, K, OC, nch);
        expect_same(what, spec, want, (size_t)BT * OC);
    }
    float* dw = malloc(sizeof(float) * OC * K);
    float* db = malloc(sizeof(float) * OC);
    float* dw_spec = malloc(sizeof(float) * OC * K);
    float* db_spec = malloc(sizeof(float) * OC);
    matmul_backward(got, dw, db, dout, inp, w, B, T, K, OC, groups, CANON_R);
    matmul_backward_naive(spec, dw_spec, db_spec, dout, inp, w, B, T, K, OC, groups, CANON_R);
    ref_matmul_dinp(want, dout, w, BT, K, OC, groups, CANON_R);
    snprintf(what, sizeof(what), "matmul dinp B=%d T=%d K=%d OC=%d groups=%d", B, T, K, OC, groups);
    expect_same(what, got, want, (size_t)BT * K);
    expect_same("matmul_backward_naive dinp", spec, want, (size_t)BT * K);
    for (int o = 0; o < OC; o++) {
        for (int k = 0; k < K; k++) { want[(size_t)o * K + k] = ref_r3(B, T, dout, OC, o, inp, K, k); }
    }
    snprintf(what, sizeof(what), "matmul dweight B=%d T=%d K=%d OC=%d", B, T, K, OC);
    expect_same(what, dw, want, (size_t)OC * K);
    expect_same("matmul_backward_naive dweight", dw_spec, want, (size_t)OC * K);
    for (int o = 0; o < OC; o++) { want[o] = ref_r3(B, T, dout, OC, o, NULL, 0, 0); }
    snprintf(what, sizeof(what), "matmul dbias B=%d T=%d OC=%d", B, T, OC);
    expect_same(what, db, want, OC);
    expect_same("matmul_backward_naive dbias", db_spec, want, OC);
    free(inp); free(w); free(bias); free(dout); free(got); free(want); free(dw); free(db);
    free(spec); free(dw_spec); free(db_spec);
}

// x rounded to the nearest bf16, ties to the even one: of the two bf16 values around x (its
// bits truncated, and the next one away from zero), the closer
static float ref_round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t lo_bits = u & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
    float lo, hi;
    memcpy(&lo, &lo_bits, 4);
    memcpy(&hi, &hi_bits, 4);
    double dlo = fabs((double)x - lo), dhi = fabs((double)hi - x);
    if (dlo < dhi) { return lo; }
    if (dhi < dlo) { return hi; }
    return (lo_bits >> 16) % 2 == 0 ? lo : hi;
}

// The decode matmul on its packed copy (llmc/decode_matmul.h): the fast kernel and its
// specification against the rules above, and decode_matmul (packed for few rows, matmul_forward
// for more) against matmul_forward, for N = 1 .. 20 rows and around every multiple of the row
// tiles (VLEN rows: 16 with AVX-512, 8 otherwise) up to DECODE_MAX_ROWS + 1, so each kernel,
// full and partial row tiles and remainders of both sizes are met; OC not a multiple of the
// panel, K whose chunks are uneven or empty, tensor-parallel chunk counts.
static int decode_test_rows_next(int N) {
    if (N < 20) { return N + 1; }
    int next = (N + 2) / 8 * 8 + 7;   // 23, 24, 25, 31, 32, 33, ...: 8k - 1, 8k, 8k + 1
    return N % 8 == 7 ? N + 1 : N % 8 == 0 ? N + 1 : next;
}
static void test_decode_matmul(int K, int OC) {
    int maxN = DECODE_MAX_ROWS + 1;
    char what[128];
    float* inp = rand_buf((size_t)maxN * K);
    float* w = rand_buf((size_t)OC * K);
    float* bias = rand_buf(OC);
    float* got = malloc(sizeof(float) * (size_t)maxN * OC);
    float* want = malloc(sizeof(float) * (size_t)maxN * OC);
    DecodeWeights dw = {0};
    decode_weights_add(&dw, w, OC, K);
    const DecodeMatrix* m = decode_weights_find(&dw, w, OC, K);
    for (int N = 1; N <= maxN; N = decode_test_rows_next(N)) {
        for (int nch = CANON_R; nch >= 1; nch /= 2) {
            const float* b = nch == CANON_R || N % 2 ? bias : NULL;
            ref_matmul_forward(want, inp, w, b, N, K, OC, nch);
            if (N <= DECODE_MAX_ROWS) {
                decode_matmul_forward(got, inp, m, b, N, nch);
                snprintf(what, sizeof(what), "decode_matmul_forward N=%d K=%d OC=%d chunks=%d", N, K, OC, nch);
                expect_same(what, got, want, (size_t)N * OC);
                decode_matmul_forward_naive(got, inp, m, b, N, nch);
                snprintf(what, sizeof(what), "decode_matmul_forward_naive N=%d K=%d OC=%d chunks=%d", N, K, OC, nch);
                expect_same(what, got, want, (size_t)N * OC);
            }
            decode_matmul(&dw, got, inp, w, b, N, K, OC, nch);
            matmul_forward(want, inp, w, b, N, K, OC, nch);
            snprintf(what, sizeof(what), "decode_matmul = matmul_forward N=%d K=%d OC=%d chunks=%d", N, K, OC, nch);
            expect_same(what, got, want, (size_t)N * OC);
        }
    }
    decode_weights_free(&dw);
    // bf16 copies (serving's --weights bf16): the bits of the rules above on the weights rounded
    // to bf16, which decode_round_bf16 gives too
    float* rounded = malloc(sizeof(float) * (size_t)OC * K);
    for (size_t i = 0; i < (size_t)OC * K; i++) { rounded[i] = ref_round_bf16(w[i]); }
    DecodeWeights dwb = {0};
    dwb.bf16 = 1;
    decode_weights_add(&dwb, w, OC, K);
    const DecodeMatrix* mb = decode_weights_find(&dwb, w, OC, K);
    for (int N = 1; N <= maxN; N = decode_test_rows_next(N)) {
        for (int nch = CANON_R; nch >= 1; nch /= 2) {
            const float* b = nch == CANON_R || N % 2 ? bias : NULL;
            ref_matmul_forward(want, inp, rounded, b, N, K, OC, nch);
            decode_matmul_forward(got, inp, mb, b, N, nch);
            snprintf(what, sizeof(what), "decode_matmul_forward bf16 N=%d K=%d OC=%d chunks=%d", N, K, OC, nch);
            expect_same(what, got, want, (size_t)N * OC);
            decode_matmul_forward_naive(got, inp, mb, b, N, nch);
            snprintf(what, sizeof(what), "decode_matmul_forward_naive bf16 N=%d K=%d OC=%d chunks=%d", N, K, OC, nch);
            expect_same(what, got, want, (size_t)N * OC);
        }
    }
    decode_weights_free(&dwb);
    decode_round_bf16(w, (size_t)OC * K);
    expect_same("decode_round_bf16", w, rounded, (size_t)OC * K);
    free(rounded);
    free(inp); free(w); free(bias); free(got); free(want);
}

// Context parallelism's weight gradients: D ranks hold zig-zag slices of every sequence (R2Z's
// unequal pieces when 2D does not divide T); each gives per-sequence subtrees over its 8/D
// chunks (matmul_backward_seqs), R1 over the ranks per sequence then R1 over the sequences ==
// the one-rank dweight and dbias.
static void test_matmul_seqs(int B, int T, int K, int OC) {
    float* inp = rand_buf((size_t)B * T * K), *dout = rand_buf((size_t)B * T * OC);
    float* dw = malloc(sizeof(float) * OC * K), *db = malloc(sizeof(float) * OC);
    matmul_backward(NULL, dw, db, dout, inp, NULL, B, T, K, OC, 1, CANON_R);
    for (int D = 2; D <= 8 && T >= 2 * D; D *= 2) {
        long stride = (long)OC * K + OC;
        float* parts = malloc(sizeof(float) * D * B * stride);
        float* sx = malloc(sizeof(float) * B * T * K), *sd = malloc(sizeof(float) * B * T * OC);
        for (int r = 0; r < D; r++) {
            long Tl = slice_len(T, D, r);
            for (int b = 0; b < B; b++) {
                for (int t = 0; t < Tl; t++) {
                    size_t g = (size_t)b * T + slice_pos(T, D, r, t);
                    memcpy(sx + ((size_t)b * Tl + t) * K, inp + g * K, sizeof(float) * K);
                    memcpy(sd + ((size_t)b * Tl + t) * OC, dout + g * OC, sizeof(float) * OC);
                }
            }
            float* p = parts + (size_t)r * B * stride;
            matmul_backward_seqs(p, p + (long)OC * K, stride, sd, sx, B, T, D, r, K, OC);
        }
        float* got = malloc(sizeof(float) * stride);
        for (long i = 0; i < stride; i++) {
            float seq[64];
            for (int b = 0; b < B; b++) {
                float v[8];
                for (int r = 0; r < D; r++) { v[r] = parts[((size_t)r * B + b) * stride + i]; }
                seq[b] = r1(v, D);
            }
            got[i] = r1(seq, B);
        }
        char what[96];
        snprintf(what, sizeof(what), "matmul dweight from %d zig-zag slices B=%d T=%d K=%d OC=%d", D, B, T, K, OC);
        expect_same(what, got, dw, (size_t)OC * K);
        snprintf(what, sizeof(what), "matmul dbias from %d zig-zag slices", D);
        expect_same(what, got + (long)OC * K, db, OC);
        free(parts); free(sx); free(sd); free(got);
    }
    free(inp); free(dout); free(dw); free(db);
}

// The zig-zag layout of any length (canonical.h canon_zz_*, zigzag.h zz_max_len) against the
// rule's text above (slice_len, slice_pos), for every n from 2D to 300 (R2Z's unequal pieces
// where 2D does not divide n): the slices partition the sequence; each slice's offset is the
// lengths before it; a query at p attends to exactly the keys of a slice at positions <= p, a
// key at p is attended by exactly the queries at positions >= p; each local chunk's stretch is
// its global piece; zz_max_len(T, D) is the most a rank holds of any length up to T (split
// from 2D positions, else whole).
static void test_zigzag_layout(void) {
    static int seen[300];
    for (int D = 2; D <= 8; D *= 2) {
        int k = 8 / D;
        for (long n = 2 * D; n <= 300; n++) {
            int bad = 0;
            long offset = 0;
            memset(seen, 0, sizeof(seen));
            for (int r = 0; r < D; r++) {
                long len = slice_len(n, D, r);
                bad |= canon_zz_len(n, D, r) != len || canon_zz_offset(n, D, r) != offset;
                offset += len;
                for (long t = 0; t < len; t++) {
                    long g = slice_pos(n, D, r, t);
                    bad |= canon_zz_global(t, n, D, r) != g;
                    seen[g]++;
                }
                for (long p = 0; p < n; p++) {
                    long le = 0, ge = 0;
                    for (long t = 0; t < len; t++) { le += slice_pos(n, D, r, t) <= p; ge += slice_pos(n, D, r, t) >= p; }
                    bad |= canon_zz_count_le(p, n, D, r) != le || canon_zz_count_ge(p, n, D, r) != ge;
                }
                for (int c = 0; c < k; c++) {
                    for (int half = 0; half < 2; half++) {
                        long b, e;
                        canon_zz_slice_half(n, D, r, c, half, &b, &e);
                        int pc = half == 0 ? r * k + c : 15 - r * k - c;
                        bad |= e - b != piece(n, pc + 1) - piece(n, pc) || (e > b && slice_pos(n, D, r, b) != piece(n, pc));
                    }
                }
            }
            for (long g = 0; g < n; g++) { bad |= seen[g] != 1; }
            bad |= offset != n;
            checks++;
            if (bad) { failures++; printf("FAIL zig-zag layout of %ld positions over %d ranks\n", n, D); }
        }
        for (int T = 1; T <= 300; T++) {
            long most = T < 2 * D - 1 ? T : 2 * D - 1;
            for (long n = 2 * D; n <= T; n++) {
                for (int r = 0; r < D; r++) { most = slice_len(n, D, r) > most ? slice_len(n, D, r) : most; }
            }
            checks++;
            if (zz_max_len(T, D) != most) {
                failures++;
                printf("FAIL zz_max_len(%d, %d) = %d, the most a rank holds is %ld\n", T, D, zz_max_len(T, D), most);
            }
        }
    }
}

// A row-parallel split: K cut into `parts` slices of whole chunks, each reduced with
// CANON_R/parts chunks, the slices' results combined by the R1 tree == the unsplit result.
static void test_split_reductions(int parts) {
    int BT = 7, K = 48, OC = 9, C = 16;
    float* inp = rand_buf((size_t)BT * K);
    float* w = rand_buf((size_t)OC * K);
    float* full = malloc(sizeof(float) * BT * OC);
    float* piece = malloc(sizeof(float) * BT * OC * parts);
    matmul_forward(full, inp, w, NULL, BT, K, OC, CANON_R);
    int ks = K / parts;
    float* xs = malloc(sizeof(float) * BT * ks);
    float* ws = malloc(sizeof(float) * OC * ks);
    for (int p = 0; p < parts; p++) {
        for (int r = 0; r < BT; r++) { memcpy(xs + r * ks, inp + r * K + p * ks, sizeof(float) * ks); }
        for (int o = 0; o < OC; o++) { memcpy(ws + o * ks, w + o * K + p * ks, sizeof(float) * ks); }
        matmul_forward(piece + (size_t)p * BT * OC, xs, ws, NULL, BT, ks, OC, CANON_R / parts);
    }
    float* combined = malloc(sizeof(float) * BT * (OC > C ? OC : C));
    for (int i = 0; i < BT * OC; i++) {
        float v[8];
        for (int p = 0; p < parts; p++) { v[p] = piece[(size_t)p * BT * OC + i]; }
        combined[i] = r1(v, parts);
    }
    char what[96];
    snprintf(what, sizeof(what), "row-parallel matmul split in %d", parts);
    expect_same(what, combined, full, (size_t)BT * OC);
    // column-parallel qkv: dinp over 3C outputs split by slices of q, k and v
    int OC3 = 3 * C;
    float* w3 = rand_buf((size_t)OC3 * C);
    float* dout = rand_buf((size_t)BT * OC3);
    float* x3 = rand_buf((size_t)BT * C);
    float* dfull = malloc(sizeof(float) * BT * C);
    float* dw = malloc(sizeof(float) * OC3 * C);
    matmul_backward(dfull, dw, NULL, dout, x3, w3, 1, BT, C, OC3, 3, CANON_R);
    int cs = C / parts;
    float* dpieces = malloc(sizeof(float) * BT * C * parts);
    float* wsl = malloc(sizeof(float) * 3 * cs * C);
    float* dsl = malloc(sizeof(float) * BT * 3 * cs);
    float* dwsl = malloc(sizeof(float) * 3 * cs * C);
    for (int p = 0; p < parts; p++) {
        for (int g = 0; g < 3; g++) {
            memcpy(wsl + (size_t)g * cs * C, w3 + ((size_t)g * C + p * cs) * C, sizeof(float) * cs * C);
            for (int r = 0; r < BT; r++) {
                memcpy(dsl + (size_t)r * 3 * cs + g * cs, dout + (size_t)r * OC3 + g * C + p * cs, sizeof(float) * cs);
            }
        }
        matmul_backward(dpieces + (size_t)p * BT * C, dwsl, NULL, dsl, x3, wsl, 1, BT, C, 3 * cs, 3, CANON_R / parts);
    }
    for (int i = 0; i < BT * C; i++) {
        float v[8];
        for (int p = 0; p < parts; p++) { v[p] = dpieces[(size_t)p * BT * C + i]; }
        combined[i] = r1(v, parts);
    }
    snprintf(what, sizeof(what), "column-parallel qkv dinp split in %d", parts);
    expect_same(what, combined, dfull, (size_t)BT * C);
    free(inp); free(w); free(full); free(piece); free(xs); free(ws); free(combined);
    free(w3); free(dout); free(x3); free(dfull); free(dw); free(dpieces); free(wsl); free(dsl); free(dwsl);
}

// --- layernorm ----------------------------------------------------------------------------
static float ln_val(long i, const void* c) { return ((const float*)c)[i]; }

static void test_layernorm(int B, int T, int C) {
    int BT = B * T;
    float* x = rand_buf((size_t)BT * C);
    float* w = rand_buf(C);
    float* bb = rand_buf(C);
    float* dy = rand_buf((size_t)BT * C);
    float* out = malloc(sizeof(float) * BT * C), *mean = malloc(sizeof(float) * BT), *rstd = malloc(sizeof(float) * BT);
    float* wout = malloc(sizeof(float) * BT * C), *wmean = malloc(sizeof(float) * BT), *wrstd = malloc(sizeof(float) * BT);
    layernorm_forward(out, mean, rstd, x, w, bb, BT, C);
    float* d = malloc(sizeof(float) * C);
    float* n = malloc(sizeof(float) * C);
    for (int i = 0; i < BT; i++) {
        const float* xi = x + (size_t)i * C;
        float m = r2_generic(C, CANON_R, ln_val, NULL, xi) / (float)C;
        for (int c = 0; c < C; c++) { d[c] = xi[c] - m; }
        float var = r2_generic(C, CANON_R, ln_val, ln_val, d) / (float)C;
        float s = 1.0f / sqrtf(var + 1e-5f);
        for (int c = 0; c < C; c++) { wout[(size_t)i * C + c] = fmaf((xi[c] - m) * s, w[c], bb[c]); }
        wmean[i] = m;
        wrstd[i] = s;
    }
    char what[96];
    snprintf(what, sizeof(what), "layernorm_forward BT=%d C=%d", BT, C);
    expect_same(what, out, wout, (size_t)BT * C);
    expect_same("layernorm mean", mean, wmean, BT);
    expect_same("layernorm rstd", rstd, wrstd, BT);
    // backward
    float* dres = rand_buf((size_t)BT * C);
    float* wdres = malloc(sizeof(float) * BT * C);
    memcpy(wdres, dres, sizeof(float) * BT * C);
    float* dw = malloc(sizeof(float) * C), *db = malloc(sizeof(float) * C);
    layernorm_backward(dres, dw, db, dy, x, w, mean, rstd, B, T, 1, 0, C, NULL);
    float* dnorm = malloc(sizeof(float) * C);
    float* nrm = malloc(sizeof(float) * (size_t)BT * C);
    for (int i = 0; i < BT; i++) {
        for (int c = 0; c < C; c++) {
            n[c] = (x[(size_t)i * C + c] - mean[i]) * rstd[i];
            nrm[(size_t)i * C + c] = n[c];
            dnorm[c] = dy[(size_t)i * C + c] * w[c];
        }
        float dm = r2_generic(C, CANON_R, ln_val, NULL, dnorm) / (float)C;
        // fmaf(dnorm, n): the second factor from its own array
        float partial[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) {
            float acc = 0.0f;
            for (long c = (long)C * ch / CANON_R; c < (long)C * (ch + 1) / CANON_R; c++) { acc = fmaf(dnorm[c], n[c], acc); }
            partial[ch] = acc;
        }
        float dnm = r1(partial, CANON_R) / (float)C;
        for (int c = 0; c < C; c++) {
            float dx = ((dnorm[c] - dm) - n[c] * dnm) * rstd[i];
            wdres[(size_t)i * C + c] = wdres[(size_t)i * C + c] + dx;
        }
    }
    snprintf(what, sizeof(what), "layernorm dinp BT=%d C=%d", BT, C);
    expect_same(what, dres, wdres, (size_t)BT * C);
    float* wdw = malloc(sizeof(float) * C), *wdb = malloc(sizeof(float) * C);
    for (int c = 0; c < C; c++) {
        wdw[c] = ref_r3(B, T, dy, C, c, nrm, C, c);
        wdb[c] = ref_r3(B, T, dy, C, c, NULL, 0, 0);
    }
    expect_same("layernorm dweight", dw, wdw, C);
    expect_same("layernorm dbias", db, wdb, C);
    // sequence (and context) parallelism: K ranks hold zig-zag slices of each sequence (rank r:
    // stretches r and 2K-1-r, low one first; R2Z's unequal pieces when 2K does not divide T);
    // each gives per-sequence subtrees over its 8/K chunks, finished by R1 over ranks, then R1
    // over sequences
    for (int K = 2; K <= 8 && T >= 2 * K; K *= 2) {
        float* parts = malloc(sizeof(float) * 2 * B * C * K);
        float* sx = malloc(sizeof(float) * B * T * C), *sdy = malloc(sizeof(float) * B * T * C);
        float* sm = malloc(sizeof(float) * B * T), *sr = malloc(sizeof(float) * B * T);
        float* sdres = calloc((size_t)B * T * C, sizeof(float));
        for (int r = 0; r < K; r++) {
            long Tl = slice_len(T, K, r);
            for (int b = 0; b < B; b++) {
                for (int t = 0; t < Tl; t++) {
                    size_t src = (size_t)b * T + slice_pos(T, K, r, t);
                    size_t dst = (size_t)b * Tl + t;
                    memcpy(sx + dst * C, x + src * C, sizeof(float) * C);
                    memcpy(sdy + dst * C, dy + src * C, sizeof(float) * C);
                    sm[dst] = mean[src];
                    sr[dst] = rstd[src];
                }
            }
            layernorm_backward(sdres, NULL, NULL, sdy, sx, w, sm, sr, B, T, K, r, C, parts + (size_t)r * 2 * B * C);
        }
        float* combined = malloc(sizeof(float) * 2 * B * C);
        for (size_t i = 0; i < 2 * (size_t)B * C; i++) {
            float v[8];
            for (int r = 0; r < K; r++) { v[r] = parts[(size_t)r * 2 * B * C + i]; }
            combined[i] = r1(v, K);
        }
        float* sdw = malloc(sizeof(float) * C), *sdb = malloc(sizeof(float) * C);
        sequence_tree(sdw, combined, B, C);
        sequence_tree(sdb, combined + (size_t)B * C, B, C);
        snprintf(what, sizeof(what), "layernorm dweight, sequence-parallel over %d", K);
        expect_same(what, sdw, wdw, C);
        snprintf(what, sizeof(what), "layernorm dbias, sequence-parallel over %d", K);
        expect_same(what, sdb, wdb, C);
        free(parts); free(sx); free(sdy); free(sm); free(sr); free(sdres); free(combined); free(sdw); free(sdb);
    }
    free(x); free(w); free(bb); free(dy); free(out); free(mean); free(rstd); free(wout); free(wmean);
    free(wrstd); free(d); free(n); free(dres); free(wdres); free(dw); free(db); free(dnorm); free(nrm);
    free(wdw); free(wdb);
}

// --- attention ----------------------------------------------------------------------------
// Serving's paged attention on the same sequences: their keys and values dealt into blocks of
// bs positions in a shuffled order, every row of every sequence asked at once in a scattered
// order, then the last row alone (a lone row's heads are split among the threads): each row
// must be the canonical row wout of its sequence.
static void check_attention_paged(const float* qkv, const float* wout, int B, int T, int C, int NH, int bs) {
    size_t C3 = 3 * (size_t)C;
    int max_blocks = (T + bs - 1) / bs, nblocks = B * max_blocks, N = B * T;
    long block_stride = (long)bs * 2 * C;
    int* order = malloc(sizeof(int) * nblocks);
    for (int i = 0; i < nblocks; i++) { order[i] = i; }
    for (int i = nblocks - 1; i > 0; i--) {
        int j = (int)(random_u32(&rng_state) % (uint32_t)(i + 1)), x = order[i];
        order[i] = order[j];
        order[j] = x;
    }
    float* kv = calloc((size_t)nblocks * block_stride, sizeof(float));
    float* rows = malloc(sizeof(float) * N * C3), *want = malloc(sizeof(float) * N * C);
    int* tables = malloc(sizeof(int) * N * max_blocks), *pos = malloc(sizeof(int) * N);
    for (int b = 0; b < B; b++) {
        for (int p = 0; p < T; p++) {
            const float* src = qkv + ((size_t)b * T + p) * C3;
            memcpy(kv + order[b * max_blocks + p / bs] * block_stride + (long)(p % bs) * 2 * C, src + C, sizeof(float) * 2 * C);
            int r = (int)(((size_t)b * T + p) * 7919 % (size_t)N);
            memcpy(rows + r * C3, src, sizeof(float) * C3);
            memcpy(want + (size_t)r * C, wout + ((size_t)b * T + p) * C, sizeof(float) * C);
            memcpy(tables + (size_t)r * max_blocks, order + b * max_blocks, sizeof(int) * max_blocks);
            pos[r] = p;
        }
    }
    float* out = malloc(sizeof(float) * N * C), *sout = malloc(sizeof(float) * N * C);
    float* scratch = malloc(sizeof(float) * (size_t)N * NH * T);
    attention_forward_paged(out, scratch, rows, kv, block_stride, tables, max_blocks, pos, N, T, bs, C, NH);
    attention_forward_paged_naive(sout, scratch, rows, kv, block_stride, tables, max_blocks, pos, N, T, bs, C, NH);
    char what[96];
    snprintf(what, sizeof(what), "attention_forward_paged B=%d T=%d C=%d NH=%d bs=%d", B, T, C, NH, bs);
    expect_same(what, out, want, (size_t)N * C);
    expect_same("attention_forward_paged_naive", sout, want, (size_t)N * C);
    int last = (int)(((size_t)N - 1) * 7919 % (size_t)N);
    attention_forward_paged(out, scratch, rows + last * C3, kv, block_stride, tables + (size_t)last * max_blocks,
                            max_blocks, pos + last, 1, T, bs, C, NH);
    expect_same("attention_forward_paged, a lone row", out, want + (size_t)last * C, C);
    free(order); free(kv); free(rows); free(want); free(tables); free(pos); free(out); free(sout); free(scratch);
}

static void test_attention(int B, int T, int C, int NH, int bs) {
    int hs = C / NH;
    size_t C3 = 3 * (size_t)C;
    float* qkv = rand_buf((size_t)B * T * C3);
    for (size_t i = 0; i < (size_t)B * T * C3; i++) { qkv[i] *= 0.3f; }
    float* out = malloc(sizeof(float) * B * T * C), *att = malloc(sizeof(float) * B * NH * T * T);
    float* wout = malloc(sizeof(float) * B * T * C), *watt = calloc((size_t)B * NH * T * T, sizeof(float));
    float* sout = malloc(sizeof(float) * B * T * C), *satt = malloc(sizeof(float) * B * NH * T * T);
    attention_forward(out, att, qkv, B, T, C, NH);
    attention_forward_naive(sout, satt, qkv, B, T, C, NH);
    float scale = 1.0f / sqrtf((float)hs);
    for (int b = 0; b < B; b++) for (int h = 0; h < NH; h++) for (int t = 0; t < T; t++) {
        float* a = watt + (((size_t)b * NH + h) * T + t) * T;
        float mx = -INFINITY;
        for (int t2 = 0; t2 <= t; t2++) {
            float partial[CANON_R];
            for (int c = 0; c < CANON_R; c++) {
                float acc = 0.0f;
                for (long d = (long)hs * c / CANON_R; d < (long)hs * (c + 1) / CANON_R; d++) {
                    acc = fmaf(qkv[((size_t)b * T + t) * C3 + h * hs + d], qkv[((size_t)b * T + t2) * C3 + C + h * hs + d], acc);
                }
                partial[c] = acc;
            }
            a[t2] = r1(partial, CANON_R) * scale;
            if (a[t2] > mx) { mx = a[t2]; }
        }
        for (int t2 = 0; t2 <= t; t2++) { a[t2] = canon_expf(a[t2] - mx); }
        float partial[CANON_R];
        for (int c = 0; c < CANON_R; c++) {
            float acc = 0.0f;
            for (int half = 0; half < 2; half++) {
                long kb, ke;
                zz(T, CANON_R, c, half, &kb, &ke);
                for (long t2 = kb; t2 < ke && t2 <= t; t2++) { acc = acc + a[t2]; }
            }
            partial[c] = acc;
        }
        float z = r1(partial, CANON_R);
        for (int t2 = 0; t2 <= t; t2++) { a[t2] = a[t2] / z; }
        for (int d = 0; d < hs; d++) {
            float pd[CANON_R];
            for (int c = 0; c < CANON_R; c++) {
                float acc = 0.0f;
                for (int half = 0; half < 2; half++) {
                    long kb, ke;
                    zz(T, CANON_R, c, half, &kb, &ke);
                    for (long t2 = kb; t2 < ke && t2 <= t; t2++) {
                        acc = fmaf(a[t2], qkv[((size_t)b * T + t2) * C3 + 2 * C + h * hs + d], acc);
                    }
                }
                pd[c] = acc;
            }
            wout[((size_t)b * T + t) * C + h * hs + d] = r1(pd, CANON_R);
        }
    }
    char what[96];
    snprintf(what, sizeof(what), "attention_forward B=%d T=%d C=%d NH=%d", B, T, C, NH);
    expect_same(what, out, wout, (size_t)B * T * C);
    expect_same("attention probabilities", att, watt, (size_t)B * NH * T * T);
    expect_same("attention_forward_naive", sout, wout, (size_t)B * T * C);
    expect_same("attention_forward_naive probabilities", satt, watt, (size_t)B * NH * T * T);
    check_attention_paged(qkv, wout, B, T, C, NH, bs);
    // backward
    float* dy = rand_buf((size_t)B * T * C);
    float* dqkv = malloc(sizeof(float) * B * T * C3), *wdqkv = malloc(sizeof(float) * B * T * C3);
    float* sdqkv = malloc(sizeof(float) * B * T * C3);
    attention_backward(dqkv, dy, qkv, att, B, T, C, NH);
    attention_backward_naive(sdqkv, dy, qkv, att, B, T, C, NH);
    float* ds = malloc(sizeof(float) * T * T);
    for (int b = 0; b < B; b++) for (int h = 0; h < NH; h++) {
        const float* a = att + ((size_t)b * NH + h) * T * T;
        for (int t = 0; t < T; t++) {
            float datt[1024];
            for (int t2 = 0; t2 <= t; t2++) {
                float partial[CANON_R];
                for (int c = 0; c < CANON_R; c++) {
                    float acc = 0.0f;
                    for (long d = (long)hs * c / CANON_R; d < (long)hs * (c + 1) / CANON_R; d++) {
                        acc = fmaf(dy[((size_t)b * T + t) * C + h * hs + d], qkv[((size_t)b * T + t2) * C3 + 2 * C + h * hs + d], acc);
                    }
                    partial[c] = acc;
                }
                datt[t2] = r1(partial, CANON_R);
            }
            float partial[CANON_R];
            for (int c = 0; c < CANON_R; c++) {
                float acc = 0.0f;
                for (int half = 0; half < 2; half++) {
                    long kb, ke;
                    zz(T, CANON_R, c, half, &kb, &ke);
                    for (long t2 = kb; t2 < ke && t2 <= t; t2++) { acc = fmaf(a[(size_t)t * T + t2], datt[t2], acc); }
                }
                partial[c] = acc;
            }
            float S = r1(partial, CANON_R);
            for (int t2 = 0; t2 < T; t2++) { ds[(size_t)t * T + t2] = t2 <= t ? a[(size_t)t * T + t2] * (datt[t2] - S) * scale : 0.0f; }
        }
        for (int d = 0; d < hs; d++) {
            for (int t = 0; t < T; t++) {   // dq over keys t2 <= t; dk, dv over queries >= t
                float pq[CANON_R], pk[CANON_R], pv[CANON_R];
                for (int c = 0; c < CANON_R; c++) {
                    float aq = 0.0f, ak = 0.0f, av = 0.0f;
                    for (int half = 0; half < 2; half++) {
                        long ub, ue;
                        zz(T, CANON_R, c, half, &ub, &ue);
                        for (long u = ub; u < ue; u++) {
                            if (u <= t) { aq = fmaf(ds[(size_t)t * T + u], qkv[((size_t)b * T + u) * C3 + C + h * hs + d], aq); }
                            if (u >= t) {
                                ak = fmaf(ds[(size_t)u * T + t], qkv[((size_t)b * T + u) * C3 + h * hs + d], ak);
                                av = fmaf(a[(size_t)u * T + t], dy[((size_t)b * T + u) * C + h * hs + d], av);
                            }
                        }
                    }
                    pq[c] = aq; pk[c] = ak; pv[c] = av;
                }
                wdqkv[((size_t)b * T + t) * C3 + h * hs + d] = r1(pq, CANON_R);
                wdqkv[((size_t)b * T + t) * C3 + C + h * hs + d] = r1(pk, CANON_R);
                wdqkv[((size_t)b * T + t) * C3 + 2 * C + h * hs + d] = r1(pv, CANON_R);
            }
        }
    }
    snprintf(what, sizeof(what), "attention_backward B=%d T=%d C=%d NH=%d", B, T, C, NH);
    expect_same(what, dqkv, wdqkv, (size_t)B * T * C3);
    expect_same("attention_backward_naive", sdqkv, wdqkv, (size_t)B * T * C3);
    free(qkv); free(out); free(att); free(wout); free(watt); free(dy); free(dqkv); free(wdqkv); free(ds);
    free(sout); free(satt); free(sdqkv);
}

// Context parallelism's attention (the block kernels a ring drives), N ranks simulated here:
// rank r holds the queries of its zig-zag slice (stretches r and 2N-1-r; R2Z's unequal pieces
// when 2N does not divide T, slice_len(T, N, r) positions), sees every rank's keys and values
// as a block, sums the blocks' subtrees by R1 over blocks, and the owner of a key sums the
// ranks' dk/dv subtrees by R1 over ranks: bit for bit the one-rank attention.
static void test_attention_blocks(int B, int T, int C, int NH, int N) {
    size_t C3 = 3 * (size_t)C, cap = (size_t)B * T * C;   // cap: room for any rank's (B, Tl, C)
    float* qkv = rand_buf((size_t)B * T * C3);
    for (size_t i = 0; i < (size_t)B * T * C3; i++) { qkv[i] *= 0.3f; }
    float* dy = rand_buf((size_t)B * T * C);
    float* out = malloc(sizeof(float) * B * T * C), *att = malloc(sizeof(float) * B * NH * T * T);
    float* dqkv = malloc(sizeof(float) * B * T * C3);
    attention_forward(out, att, qkv, B, T, C, NH);
    attention_backward(dqkv, dy, qkv, att, B, T, C, NH);
    long Tl[8], col[8];
    for (int r = 0, at = 0; r < N; at += Tl[r], r++) { Tl[r] = slice_len(T, N, r); col[r] = at; }
    float* lqkv = malloc(sizeof(float) * N * cap * 3);   // every rank's slice
    float* ldy = malloc(sizeof(float) * N * cap);
    float* kv = malloc(sizeof(float) * 2 * N * cap);       // every rank's k and v
    for (int r = 0; r < N; r++) {
        for (int b = 0; b < B; b++) {
            for (int t = 0; t < Tl[r]; t++) {
                size_t g = (size_t)b * T + slice_pos(T, N, r, t);
                size_t l = (size_t)b * Tl[r] + t;
                memcpy(lqkv + r * cap * 3 + l * C3, qkv + g * C3, sizeof(float) * C3);
                memcpy(ldy + r * cap + l * C, dy + g * C, sizeof(float) * C);
                memcpy(kv + r * cap + l * C, qkv + g * C3 + C, sizeof(float) * C);
                memcpy(kv + (N + r) * cap + l * C, qkv + g * C3 + 2 * C, sizeof(float) * C);
            }
        }
    }
    float* latt = malloc(sizeof(float) * B * NH * T * T), *lds = malloc(sizeof(float) * B * NH * T * T);
    float* part = malloc(sizeof(float) * N * cap), *dkp = malloc(sizeof(float) * N * N * cap), *dvp = malloc(sizeof(float) * N * N * cap);
    int bad_out = 0, bad_att = 0, bad_dq = 0, bad_dkv = 0;
    for (int r = 0; r < N; r++) {
        const float* q = lqkv + r * cap * 3;
        size_t nl = (size_t)B * Tl[r] * C;   // this rank's subtrees of an output
        for (int s = 0; s < N; s++) { attention_scores_block(latt, q, kv + s * cap, B, T, C, NH, N, r, s); }
        attention_softmax_blocks(latt, B, T, NH, N, r);
        for (int s = 0; s < N; s++) { attention_values_block(part + s * nl, latt, kv + (N + s) * cap, B, T, C, NH, N, r, s); }
        for (int s = 0; s < N; s++) { attention_datt_block(lds, ldy + r * cap, kv + (N + s) * cap, B, T, C, NH, N, r, s); }
        attention_softmax_backward_blocks(lds, latt, B, T, C, NH, N, r);
        for (int b = 0; b < B; b++) for (int t = 0; t < Tl[r]; t++) {
            size_t g = (size_t)b * T + slice_pos(T, N, r, t);
            for (int c = 0; c < C; c++) {
                float v[8];
                for (int s = 0; s < N; s++) { v[s] = part[s * nl + ((size_t)b * Tl[r] + t) * C + c]; }
                float got = r1(v, N);
                bad_out += memcmp(&got, &out[g * C + c], 4) != 0;
            }
            for (int hh = 0; hh < NH; hh++) for (int s = 0; s < N; s++) for (int j = 0; j < Tl[s]; j++) {
                long kp = slice_pos(T, N, s, j);
                float got = latt[(((size_t)b * NH + hh) * Tl[r] + t) * T + col[s] + j];
                bad_att += memcmp(&got, &att[(((size_t)b * NH + hh) * T + (g - (size_t)b * T)) * T + kp], 4) != 0;
            }
        }
        for (int s = 0; s < N; s++) { attention_dq_block(part + s * nl, lds, kv + s * cap, B, T, C, NH, N, r, s); }
        for (int b = 0; b < B; b++) for (int t = 0; t < Tl[r]; t++) {
            size_t g = (size_t)b * T + slice_pos(T, N, r, t);
            for (int c = 0; c < C; c++) {
                float v[8];
                for (int s = 0; s < N; s++) { v[s] = part[s * nl + ((size_t)b * Tl[r] + t) * C + c]; }
                float got = r1(v, N);
                bad_dq += memcmp(&got, &dqkv[g * C3 + c], 4) != 0;
            }
        }
        for (int s = 0; s < N; s++) {
            attention_dkv_block(dkp + ((size_t)s * N + r) * cap, dvp + ((size_t)s * N + r) * cap, lds, latt, q,
                                ldy + r * cap, B, T, C, NH, N, r, s);
        }
    }
    for (int s = 0; s < N; s++) {   // the owner of block s: R1 over the ranks' partials
        for (int b = 0; b < B; b++) for (int t = 0; t < Tl[s]; t++) {
            size_t g = (size_t)b * T + slice_pos(T, N, s, t);
            for (int c = 0; c < C; c++) {
                float vk[8], vv[8];
                for (int r = 0; r < N; r++) {
                    vk[r] = dkp[((size_t)s * N + r) * cap + ((size_t)b * Tl[s] + t) * C + c];
                    vv[r] = dvp[((size_t)s * N + r) * cap + ((size_t)b * Tl[s] + t) * C + c];
                }
                float gk = r1(vk, N), gv = r1(vv, N);
                bad_dkv += memcmp(&gk, &dqkv[g * C3 + C + c], 4) != 0;
                bad_dkv += memcmp(&gv, &dqkv[g * C3 + 2 * C + c], 4) != 0;
            }
        }
    }
    checks += 4;
    if (bad_out || bad_att || bad_dq || bad_dkv) {
        failures++;
        printf("FAIL context-parallel attention blocks B=%d T=%d C=%d NH=%d N=%d: %d out, %d att, %d dq, %d dk/dv "
               "values differ from one rank\n", B, T, C, NH, N, bad_out, bad_att, bad_dq, bad_dkv);
    }
    free(qkv); free(dy); free(out); free(att); free(dqkv); free(lqkv); free(ldy); free(kv); free(latt); free(lds);
    free(part); free(dkp); free(dvp);
}

// --- cross-entropy and the embedding ------------------------------------------------------
static void test_crossentropy(int BT, int V, int Vp) {
    float* logits = rand_buf((size_t)BT * Vp);
    float* want = malloc(sizeof(float) * BT * Vp);
    float* losses = malloc(sizeof(float) * BT), *wlosses = malloc(sizeof(float) * BT);
    int* tgt = malloc(sizeof(int) * BT);
    for (int i = 0; i < BT; i++) { tgt[i] = (int)(random_u32(&rng_state) % V); }
    for (int i = 0; i < BT; i++) {
        const float* l = logits + (size_t)i * Vp;
        float mx = -INFINITY;
        for (int v = 0; v < V; v++) { if (l[v] > mx) { mx = l[v]; } }
        float* e = want + (size_t)i * Vp;
        float partial[CANON_R];
        for (int c = 0; c < CANON_R; c++) {
            float acc = 0.0f;
            for (long v = (long)Vp * c / CANON_R; v < (long)Vp * (c + 1) / CANON_R && v < V; v++) {
                e[v] = canon_expf(l[v] - mx);
                acc = acc + e[v];
            }
            partial[c] = acc;
        }
        float z = r1(partial, CANON_R);
        for (int v = 0; v < Vp; v++) { e[v] = v < V ? e[v] / z : 0.0f; }
        wlosses[i] = canon_logf(z) - (l[tgt[i]] - mx);
    }
    float* logits_copy = malloc(sizeof(float) * BT * Vp);
    memcpy(logits_copy, logits, sizeof(float) * BT * Vp);
    float* ce = malloc(sizeof(float) * 3 * BT);
    crossentropy_max(ce, logits, BT, V, 0, Vp);
    crossentropy_exps(ce + BT, ce + 2 * BT, logits, ce, tgt, BT, V, 0, Vp, CANON_R);
    crossentropy_normalize(logits, losses, ce + BT, ce + 2 * BT, ce, tgt, BT, V, 0, Vp);
    char what[96];
    snprintf(what, sizeof(what), "crossentropy probs BT=%d V=%d Vp=%d", BT, V, Vp);
    expect_same(what, logits, want, (size_t)BT * Vp);
    expect_same("crossentropy losses", losses, wlosses, BT);
    // vocab-parallel: K slices of the vocabulary, each its 8/K chunks; the max over slices,
    // the R1 tree over the slices' partial sums, the target logit from its slice (-0 elsewhere)
    for (int K = 2; K <= 4 && Vp % K == 0; K *= 2) {
        int Vl = Vp / K;
        float* sl = malloc(sizeof(float) * BT * Vl);
        float* sce = malloc(sizeof(float) * 3 * BT * K);
        float* slosses = malloc(sizeof(float) * BT);
        float* probs_all = malloc(sizeof(float) * BT * Vp);
        float* m = calloc(BT, sizeof(float)), *zz = calloc(BT, sizeof(float)), *tl = calloc(BT, sizeof(float));
        for (int i = 0; i < BT; i++) { m[i] = -INFINITY; }
        for (int r = 0; r < K; r++) {   // phase 1 on every slice, then the max
            for (int i = 0; i < BT; i++) { memcpy(sl + (size_t)i * Vl, logits_copy + (size_t)i * Vp + r * Vl, sizeof(float) * Vl); }
            crossentropy_max(sce + (size_t)r * 3 * BT, sl, BT, V, r * Vl, Vl);
            for (int i = 0; i < BT; i++) { if (sce[(size_t)r * 3 * BT + i] > m[i]) { m[i] = sce[(size_t)r * 3 * BT + i]; } }
        }
        for (int r = 0; r < K; r++) {   // phase 2 with the global max
            for (int i = 0; i < BT; i++) { memcpy(sl + (size_t)i * Vl, logits_copy + (size_t)i * Vp + r * Vl, sizeof(float) * Vl); }
            float* rc = sce + (size_t)r * 3 * BT;
            crossentropy_exps(rc + BT, rc + 2 * BT, sl, m, tgt, BT, V, r * Vl, Vl, CANON_R / K);
            for (int i = 0; i < BT; i++) { memcpy(probs_all + (size_t)i * Vp + r * Vl, sl + (size_t)i * Vl, sizeof(float) * Vl); }
        }
        for (int i = 0; i < BT; i++) {   // the cross-slice sums: R1 over slices
            float zv[8], tv[8];
            for (int r = 0; r < K; r++) { zv[r] = sce[(size_t)r * 3 * BT + BT + i]; tv[r] = sce[(size_t)r * 3 * BT + 2 * BT + i]; }
            zz[i] = r1(zv, K);
            tl[i] = r1(tv, K);
        }
        for (int r = 0; r < K; r++) {   // phase 3 per slice
            for (int i = 0; i < BT; i++) { memcpy(sl + (size_t)i * Vl, probs_all + (size_t)i * Vp + r * Vl, sizeof(float) * Vl); }
            crossentropy_normalize(sl, slosses, zz, tl, m, tgt, BT, V, r * Vl, Vl);
            for (int i = 0; i < BT; i++) { memcpy(probs_all + (size_t)i * Vp + r * Vl, sl + (size_t)i * Vl, sizeof(float) * Vl); }
        }
        snprintf(what, sizeof(what), "vocab-parallel crossentropy (K=%d) probs", K);
        expect_same(what, probs_all, want, (size_t)BT * Vp);
        snprintf(what, sizeof(what), "vocab-parallel crossentropy (K=%d) losses", K);
        expect_same(what, slosses, wlosses, BT);
        free(sl); free(sce); free(slosses); free(probs_all); free(m); free(zz); free(tl);
    }
    free(logits_copy); free(ce);
    free(logits); free(want); free(losses); free(wlosses); free(tgt);
}

static void test_encoder_backward(int B, int T, int C, int V, int maxT) {
    int Vp = padded_vocab(V);
    int BT = B * T;
    int* inp = malloc(sizeof(int) * BT);
    for (int i = 0; i < BT; i++) { inp[i] = (int)(random_u32(&rng_state) % 5) * (Vp / 5); }   // repeats, both halves
    float* dout = rand_buf((size_t)BT * C);
    float* dwte = rand_buf((size_t)Vp * C), *dwpe = rand_buf((size_t)maxT * C);   // garbage in: must be overwritten
    encoder_backward(dwte, dwpe, dout, inp, B, T, C, 0, Vp, maxT);
    float* wdwte = calloc((size_t)Vp * C, sizeof(float)), *wdwpe = calloc((size_t)maxT * C, sizeof(float));
    float* masked = malloc(sizeof(float) * BT);
    for (int v = 0; v < Vp; v++) {
        for (int c = 0; c < C; c++) {
            for (int i = 0; i < BT; i++) { masked[i] = inp[i] == v ? dout[(size_t)i * C + c] : 0.0f; }
            // R3 with non-matching positions contributing nothing: skip them exactly
            float seq[512];
            for (int b = 0; b < B; b++) {
                float partial[CANON_R];
                for (int ch = 0; ch < CANON_R; ch++) {
                    float acc = 0.0f;
                    for (int half = 0; half < 2; half++) {
                        long tb, te;
                        zz(T, CANON_R, ch, half, &tb, &te);
                        for (long t = tb; t < te; t++) {
                            if (inp[b * T + t] == v) { acc = acc + masked[b * T + t]; }
                        }
                    }
                    partial[ch] = acc;
                }
                seq[b] = r1(partial, CANON_R);
            }
            wdwte[(size_t)v * C + c] = r1(seq, B);
        }
    }
    for (int t = 0; t < T; t++) {
        for (int c = 0; c < C; c++) {
            float seq[512];
            for (int b = 0; b < B; b++) { seq[b] = 0.0f + dout[((size_t)b * T + t) * C + c]; }
            wdwpe[(size_t)t * C + c] = r1(seq, B);
        }
    }
    char what[96];
    snprintf(what, sizeof(what), "encoder_backward dwte B=%d T=%d C=%d", B, T, C);
    expect_same(what, dwte, wdwte, (size_t)Vp * C);
    snprintf(what, sizeof(what), "encoder_backward dwpe B=%d T=%d C=%d", B, T, C);
    expect_same(what, dwpe, wdwpe, (size_t)maxT * C);
    // a vocab-parallel rank's rows: [v0, v0 + Vl) of the same
    for (int r = 0; r < 2; r++) {
        int Vl = Vp / 2;
        float* part = rand_buf((size_t)Vl * C);
        encoder_backward(part, dwpe, dout, inp, B, T, C, r * Vl, Vl, maxT);
        snprintf(what, sizeof(what), "encoder_backward vocab rows of rank %d of 2", r);
        expect_same(what, part, wdwte + (size_t)r * Vl * C, (size_t)Vl * C);
        free(part);
    }
    free(inp); free(dout); free(dwte); free(dwpe); free(wdwte); free(wdwpe); free(masked);
}

// --- mixture of experts (llmc/moe.h) --------------------------------------------------------

// The router from its definition: max, exps, Z = R2 over E, p = e / Z; the k largest p with
// ties to the lower index (a stable sort by p, descending), listed ascending; gates p / S with
// S summed in that order.
static void ref_router(float* p, int* chosen, float* gates, const float* logits, int E, int k) {
    float maxv = -INFINITY;
    for (int e = 0; e < E; e++) { maxv = logits[e] > maxv ? logits[e] : maxv; }
    float* ex = malloc(sizeof(float) * E);
    for (int e = 0; e < E; e++) { ex[e] = canon_expf(logits[e] - maxv); }
    float partial[CANON_R];
    for (int c = 0; c < CANON_R; c++) {
        float acc = 0.0f;
        for (long e = (long)E * c / CANON_R; e < (long)E * (c + 1) / CANON_R; e++) { acc = acc + ex[e]; }
        partial[c] = acc;
    }
    float z = r1(partial, CANON_R);
    int* order = malloc(sizeof(int) * E);
    for (int e = 0; e < E; e++) {
        p[e] = ex[e] / z;
        int m = e;   // insertion: after every earlier expert with a probability >= p[e]
        while (m > 0 && p[order[m - 1]] < p[e]) { order[m] = order[m - 1]; m--; }
        order[m] = e;
    }
    for (int j = 0; j < k; j++) { chosen[j] = order[j]; }
    for (int j = 0; j < k; j++) {
        for (int m = j + 1; m < k; m++) { if (chosen[m] < chosen[j]) { int t = chosen[j]; chosen[j] = chosen[m]; chosen[m] = t; } }
    }
    float s = 0.0f;
    for (int j = 0; j < k; j++) { s = s + p[chosen[j]]; }
    for (int j = 0; j < k; j++) { gates[j] = p[chosen[j]] / s; }
    free(ex);
    free(order);
}

// Q source microbatches of B x T positions, each position routed to k of E experts; this rank
// holds experts [0, El). The weight gradients of each local expert per source against R3 over
// the source's positions written out with the positions not routed skipped; the router and the
// combine against their definitions.
static void test_moe(int Q, int B, int T, int E, int El, int k, int K, int OC) {
    char what[160];
    int BT = B * T;
    uint64_t s = 1234 + Q * 7 + B * 11 + T;
    // the router: every position's logits, a few with ties
    float* logits = rand_buf((size_t)BT * E);
    for (int i = 0; i < BT; i += 3) { logits[(size_t)i * E + E - 1] = logits[(size_t)i * E]; }
    if (E > 2) { for (int e = 0; e < E; e++) { logits[e] = 0.5f; } }   // position 0: all tied
    float *p = malloc(sizeof(float) * BT * E), *pr = malloc(sizeof(float) * BT * E);
    int *ch = malloc(sizeof(int) * BT * k), *chr = malloc(sizeof(int) * BT * k);
    float *g = malloc(sizeof(float) * BT * k), *gr = malloc(sizeof(float) * BT * k);
    moe_router_forward(p, ch, g, logits, BT, E, k);
    for (int i = 0; i < BT; i++) { ref_router(pr + (size_t)i * E, chr + (size_t)i * k, gr + (size_t)i * k, logits + (size_t)i * E, E, k); }
    snprintf(what, sizeof(what), "moe_router_forward BT=%d E=%d k=%d", BT, E, k);
    expect_same(what, p, pr, (size_t)BT * E);
    expect_same(what, g, gr, (size_t)BT * k);
    checks++;
    if (memcmp(ch, chr, sizeof(int) * BT * k) != 0) { failures++; printf("FAIL %s: the chosen experts differ\n", what); }
    // the combine: out = sum_j fmaf(gate_j, y_j, .) in ascending expert order
    float* y = rand_buf((size_t)BT * k * OC);
    int* slot_row = malloc(sizeof(int) * BT * k);
    for (int i = 0; i < BT * k; i++) { slot_row[i] = (i * 7 + 3) % (BT * k); }
    float *out = malloc(sizeof(float) * BT * OC), *outr = malloc(sizeof(float) * BT * OC);
    moe_combine(out, y, g, slot_row, BT, k, OC);
    for (int i = 0; i < BT; i++) {
        for (int c = 0; c < OC; c++) {
            float acc = 0.0f;
            for (int j = 0; j < k; j++) { acc = fmaf(g[i * k + j], y[(size_t)slot_row[i * k + j] * OC + c], acc); }
            outr[(size_t)i * OC + c] = acc;
        }
    }
    snprintf(what, sizeof(what), "moe_combine BT=%d k=%d C=%d", BT, k, OC);
    expect_same(what, out, outr, (size_t)BT * OC);
    // the choices of Q sources, and what this rank's El experts receive from them
    int* count = calloc((size_t)Q * E, sizeof(int));
    int* pos = malloc(sizeof(int) * Q * BT * k);
    int n = 0;
    for (int q = 0; q < Q; q++) {
        int* chosen = malloc(sizeof(int) * BT * k);
        for (int i = 0; i < BT; i++) {   // k distinct experts, some sequences never reaching expert 0
            for (int j = 0; j < k; j++) {
                int e;
                do { e = (int)(random_u32(&s) % E); } while (i / T == 1 && e == 0 && E > k);
                int dup = 0;
                for (int m = 0; m < j; m++) { dup |= chosen[i * k + m] == e; }
                if (dup) { j--; continue; }
                chosen[i * k + j] = e;
            }
        }
        int *cnt = malloc(sizeof(int) * E), *row_pos = malloc(sizeof(int) * BT * k), *sr = malloc(sizeof(int) * BT * k);
        int* cursor = malloc(sizeof(int) * E);
        moe_plan_routes(chosen, B, T, k, E, cnt, row_pos, sr, cursor);
        int first = 0;   // rows of experts [0, El) lead the dispatch order
        for (int e = 0; e < El; e++) { count[q * El + e] = cnt[e]; first += cnt[e]; }
        for (int r = 0; r < first; r++) { pos[n++] = row_pos[r]; }
        free(chosen); free(cnt); free(row_pos); free(sr); free(cursor);
    }
    int nleaf = Q * B * CANON_R + 1;
    int *perm = malloc(sizeof(int) * (n + 1)), *inv = malloc(sizeof(int) * (n + 1)), *efirst = malloc(sizeof(int) * (El + 1));
    int* leaf = malloc(sizeof(int) * El * nleaf);
    moe_plan_experts(count, pos, Q, El, B, T, perm, inv, efirst, leaf);
    float *dout = rand_buf((size_t)n * OC), *x = rand_buf((size_t)n * K);
    size_t slice = (size_t)OC * K + OC;
    float *dw = malloc(sizeof(float) * Q * slice), *dwn = malloc(sizeof(float) * Q * slice), *dwr = malloc(sizeof(float) * Q * slice);
    for (int e = 0; e < El; e++) {
        moe_expert_dweight(dw, dw + (size_t)OC * K, slice, dout, x, leaf + (size_t)e * nleaf, Q, B, K, OC);
        moe_expert_dweight_naive(dwn, dwn + (size_t)OC * K, slice, dout, x, leaf + (size_t)e * nleaf, Q, B, K, OC);
        // the reference: per source, R3 (R2Z chunks) over its positions, the rows routed to e taking part
        for (int q = 0; q < Q; q++) {
            int* row_at = malloc(sizeof(int) * BT);   // the work row of position pos, or -1
            for (int i = 0; i < BT; i++) { row_at[i] = -1; }
            int r0 = 0;
            for (int qq = 0; qq < q; qq++) { for (int ee = 0; ee < El; ee++) { r0 += count[qq * El + ee]; } }
            for (int ee = 0; ee < e; ee++) { r0 += count[q * El + ee]; }
            for (int r = r0; r < r0 + count[q * El + e]; r++) { row_at[pos[r]] = inv[r]; }
            for (int o = 0; o < OC; o++) {
                for (int kk = -1; kk < K; kk++) {
                    float seq[64];
                    for (int b = 0; b < B; b++) {
                        float partial[CANON_R];
                        for (int c = 0; c < CANON_R; c++) {
                            float acc = 0.0f;
                            for (int piece = c; piece <= 2 * CANON_R - 1 - c; piece += 2 * CANON_R - 1 - 2 * c) {
                                // zig-zag chunk c: sixteenth c of the sequence, then its mirror 15 - c
                                for (long t = (long)T * piece / 16; t < (long)T * (piece + 1) / 16; t++) {
                                    int w = row_at[b * T + t];
                                    if (w < 0) { continue; }
                                    acc = kk < 0 ? acc + dout[(size_t)w * OC + o] : fmaf(dout[(size_t)w * OC + o], x[(size_t)w * K + kk], acc);
                                }
                            }
                            partial[c] = acc;
                        }
                        seq[b] = r1(partial, CANON_R);
                    }
                    dwr[q * slice + (kk < 0 ? (size_t)OC * K + o : (size_t)o * K + kk)] = r1(seq, B);
                }
            }
            free(row_at);
        }
        snprintf(what, sizeof(what), "moe_expert_dweight Q=%d B=%d T=%d expert %d of %d K=%d OC=%d", Q, B, T, e, El, K, OC);
        expect_same(what, dw, dwr, Q * slice);
        snprintf(what, sizeof(what), "moe_expert_dweight_naive Q=%d B=%d T=%d expert %d K=%d OC=%d", Q, B, T, e, K, OC);
        expect_same(what, dwn, dwr, Q * slice);
    }
    free(logits); free(p); free(pr); free(ch); free(chr); free(g); free(gr); free(y); free(slot_row); free(out);
    free(outr); free(count); free(pos); free(perm); free(inv); free(efirst); free(leaf); free(dout); free(x);
    free(dw); free(dwn); free(dwr);
}

// vf_expf (simd.h) is canon_expf in every lane, and the GELU kernels' vf_gelu / vf_gelu_grad
// are canon_gelu / canon_gelu_grad: every exponent of both signs (and many mantissas of each),
// the boundaries of the exp's clamps, infinities and NaN
static void test_vector_exp(void) {
    float special[] = {0.0f, -0.0f, 1.0f, -1.0f, 88.72283935546875f, 88.7228469848632812f, 88.72283172607421875f,
                       -103.972084045410156f, -103.97209167480469f, -103.97207641601562f, -87.33654f, -87.33655f,
                       canon_inf(), -canon_inf(), canon_nan(), 1e-40f, -1e-40f, 0.5f, -0.5f, 0.34657359f, -0.34657359f};
    int bad = 0;
    long n = 0;
    float x[VLEN], y[VLEN];
    for (uint64_t i = 0; i < (1u << 24) + sizeof(special) / sizeof(special[0]); i++) {
        float v;
        if (i < sizeof(special) / sizeof(special[0])) {
            v = special[i];
        } else {   // sign, all 256 exponents, 2^15 mantissas spread over the 23 bits
            uint64_t j = i - sizeof(special) / sizeof(special[0]);
            uint32_t u = (uint32_t)((j & 1) << 31) | (uint32_t)(((j >> 1) & 255) << 23) | (uint32_t)(((j >> 9) * 255u) & 0x7fffffu);
            memcpy(&v, &u, 4);
        }
        x[n % VLEN] = v;
        if (++n % VLEN == 0) {
            for (int f = 0; f < 3; f++) {
                vf in = vf_load(x);
                vf_store(y, f == 0 ? vf_expf(in) : f == 1 ? vf_gelu(in) : vf_gelu_grad(in));
                for (int l = 0; l < VLEN; l++) {
                    float want = f == 0 ? canon_expf(x[l]) : f == 1 ? canon_gelu(x[l]) : canon_gelu_grad(x[l]);
                    if (memcmp(&y[l], &want, 4) != 0 && bad++ < 5) {
                        printf("FAIL vector %s(%.9g) = %.9g, canonical %.9g\n", f == 0 ? "exp" : f == 1 ? "gelu" : "gelu_grad",
                               x[l], y[l], want);
                    }
                }
            }
        }
    }
    checks++;
    if (bad) { failures++; }
}

int main(void) {
    test_vector_exp();
    int shapes[][5] = {   // B, T, K, OC, groups
        {1, 1, 1, 1, 1}, {1, 5, 7, 5, 1}, {2, 3, 16, 6, 1}, {3, 11, 40, 13, 1}, {2, 17, 33, 48, 3},
        {1, 70, 100, 50, 1}, {4, 9, 64, 96, 3}, {2, 40, 48, 7, 1}, {5, 8, 24, 66, 3},
        {1, 1, 77, 150, 1}, {1, 2, 33, 19, 3}, {2, 1, 96, 70, 1},   // a row or two: the KV cache's matmuls
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        test_matmul(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], shapes[i][4]);
    }
    int decode_shapes[][2] = {{1, 1}, {5, 7}, {7, 16}, {33, 17}, {40, 50}, {77, 150}, {96, 31}, {200, 48}};   // K, OC
    for (size_t i = 0; i < sizeof(decode_shapes) / sizeof(decode_shapes[0]); i++) {
        test_decode_matmul(decode_shapes[i][0], decode_shapes[i][1]);
    }
    test_matmul_seqs(3, 16, 40, 13);
    test_matmul_seqs(2, 48, 16, 7);
    test_matmul_seqs(1, 37, 24, 9);   // R2Z's unequal pieces (a --varlen length)
    test_zigzag_layout();
    test_split_reductions(2);
    test_split_reductions(4);
    test_layernorm(1, 1, 1);
    test_layernorm(2, 5, 7);
    test_layernorm(3, 16, 64);
    test_layernorm(1, 3, 200);
    test_layernorm(1, 37, 24);   // R2Z's unequal pieces over 2, 4 and 8 ranks
    test_attention(1, 1, 8, 1, 16);   // (the last argument: the paged cache's block size)
    test_attention(2, 5, 16, 2, 2);
    test_attention(1, 19, 24, 3, 5);
    test_attention(2, 12, 128, 2, 16);
    test_attention(1, 70, 128, 2, 16);   // head size 64: whole vector tiles, several row and key tiles
    test_attention(2, 37, 48, 1, 3);     // head size 48: a partial tile of channel vectors
    test_attention(1, 33, 40, 2, 7);     // head size 20: a vector and a scalar tail
    for (int N = 2; N <= 8; N *= 2) {
        test_attention_blocks(2, 32, 16, 2, N);
        test_attention_blocks(1, 48, 128, 2, N);   // head size 64, stretches of 3..12 positions
    }
    test_attention_blocks(1, 64, 40, 2, 4);        // head size 20
    for (int N = 2; N <= 8; N *= 2) {              // R2Z's unequal pieces: --varlen lengths 2N <= T < 16 and beyond
        test_attention_blocks(1, 2 * N + 1, 16, 2, N);
        test_attention_blocks(1, 45, 128, 2, N);
    }
    test_crossentropy(3, 5, 128);
    test_crossentropy(4, 100, 128);
    test_crossentropy(2, 1000, 1024);
    test_encoder_backward(2, 5, 7, 9, 8);
    test_encoder_backward(3, 13, 20, 30, 16);
    test_moe(1, 2, 5, 4, 4, 2, 7, 5);      // one rank, T < 8 chunks
    test_moe(2, 3, 16, 8, 4, 2, 33, 13);   // two sources, columns past a vector
    test_moe(4, 2, 11, 8, 2, 1, 64, 6);    // four sources, top 1
    test_moe(2, 2, 9, 3, 3, 3, 20, 9);     // every expert chosen
    printf("%d kernel checks (%s kernels), %d failed\n", checks, LLMC_SIMD_NAME, failures);
    return failures ? 1 : 0;
}
