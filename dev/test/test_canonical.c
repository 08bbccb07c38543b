/*
 * test_canonical.c: the per-element math and the reduction machinery of llmc/canonical.h.
 *  - canon_expf / canon_logf within 1 ulp of the correctly rounded value (libm in double,
 *    rounded to float) over their whole useful range, special values exact;
 *    canon_tanhf within 1.5e-7 absolute; gelu and its derivative against double formulas;
 *    canon_cospi_d / canon_log_d against libm in double.
 *  - canon_tree_merges_after streams exactly the R1 tree (compared with the recursive
 *    definition on data where the order matters) for every n up to 300.
 *  - SumSq: the exact sum of squares, rounded once, equals a __float128 sum on data whose
 *    exact sum __float128 can hold, for inputs spanning tiny to huge magnitudes, subnormals,
 *    any split of the data into partial accumulators; nan/inf give NaN.
 *  - canon_bf16_bits (and memory.h's to_bf16, the rounding of fast mode's weights) against the
 *    definition of round to nearest, ties to even, on 4 million bit patterns and the special
 *    values: the nearer of the two bf16 values around x (computed in double), the even one on
 *    a tie, infinity past the largest bf16 plus half its ulp, NaN as 0x7fff.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/canonical.h"
#include "llmc/memory.h"
#include "llmc/rand.h"

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

static int64_t ulp_diff(float a, float b) {
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    if (ia < 0) { ia = (int32_t)0x80000000 - ia; }
    if (ib < 0) { ib = (int32_t)0x80000000 - ib; }
    return llabs((long long)ia - (long long)ib);
}

// The value of a bf16's bits, with the one past the largest finite magnitude counted as 2^128
// (where IEEE rounding to nearest puts the boundary to infinity).
static double bf16_value(uint32_t h) {
    if ((h & 0x7fffu) == 0x7f80u) { return (h & 0x8000u) ? -ldexp(1.0, 128) : ldexp(1.0, 128); }
    return (double)canon_bits_to_float(h << 16);
}

// x rounded to bf16 by the definition: of the two bf16 values around x, the nearer, on a tie the
// one with an even last bit.
static uint16_t bf16_by_definition(float x) {
    if (isnan(x)) { return 0x7fffu; }
    uint32_t lo = canon_float_to_bits(x) >> 16, hi = lo + 1;   // |lo| <= |x| < |hi|, same sign
    if (canon_bits_to_float(lo << 16) == x || isinf(x)) { return (uint16_t)lo; }
    double dlo = fabs(bf16_value(lo) - (double)x), dhi = fabs(bf16_value(hi) - (double)x);
    return (uint16_t)(dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1u) ? hi : lo);
}

static float r1_ref(const float* v, int n) {
    if (n == 1) { return v[0]; }
    int mid = (n + 1) / 2;
    return r1_ref(v, mid) + r1_ref(v + mid, n - mid);
}

int main(void) {
    // exp: 20 million floats spread over [-104, 89] (every 97th float near 0 and beyond)
    int64_t worst = 0;
    float worst_x = 0;
    uint64_t s = 5;
    for (int i = 0; i < 20000000; i++) {
        float x = i < 10000000 ? -104.0f + 193.0f * (float)i / 1e7f : (random_f32(&s) - 0.5f) * 4.0f;
        int64_t d = ulp_diff(canon_expf(x), (float)exp((double)x));
        if (d > worst) { worst = d; worst_x = x; }
    }
    printf("canon_expf: max %lld ulp (at x = %.9g)\n", (long long)worst, worst_x);
    CHECK(worst <= 1, "canon_expf is %lld ulp off at %.9g", (long long)worst, worst_x);
    CHECK(canon_expf(0.0f) == 1.0f && canon_expf(-200.0f) == 0.0f && isinf(canon_expf(100.0f)) &&
          isnan(canon_expf(NAN)) && isinf(canon_expf(INFINITY)) && canon_expf(-INFINITY) == 0.0f,
          "canon_expf special values");
    // log: every 101st positive float from the smallest subnormal to 2^64
    worst = 0;
    for (uint32_t u = 1; u < 0x5f800000u; u += 101) {
        float x;
        memcpy(&x, &u, 4);
        int64_t d = ulp_diff(canon_logf(x), (float)log((double)x));
        if (d > worst) { worst = d; worst_x = x; }
    }
    printf("canon_logf: max %lld ulp (at x = %.9g)\n", (long long)worst, worst_x);
    CHECK(worst <= 1, "canon_logf is %lld ulp off at %.9g", (long long)worst, worst_x);
    CHECK(canon_logf(1.0f) == 0.0f && isinf(canon_logf(0.0f)) && canon_logf(0.0f) < 0 &&
          isnan(canon_logf(-1.0f)) && isinf(canon_logf(INFINITY)), "canon_logf special values");
    double worst_abs = 0, worst_gelu = 0, worst_dgelu = 0;
    for (int i = -200000; i <= 200000; i++) {
        float x = i * 1e-4f;
        double e = fabs(canon_tanhf(x) - tanh((double)x));
        if (e > worst_abs) { worst_abs = e; }
        double u = sqrt(2.0 / M_PI) * (x + 0.044715 * (double)x * x * x);
        double g = 0.5 * x * (1.0 + tanh(u));
        double sech2 = 1.0 - tanh(u) * tanh(u);
        double dg = 0.5 * (1.0 + tanh(u)) + 0.5 * x * sech2 * sqrt(2.0 / M_PI) * (1.0 + 3 * 0.044715 * (double)x * x);
        // 1 + tanh(u) cancels for negative x, so the error is absolute, proportional to |x|
        double scale = fabs(x) > 1.0 ? fabs(x) : 1.0;
        double eg = fabs(canon_gelu(x) - g) / scale;
        double edg = fabs(canon_gelu_grad(x) - dg) / scale;
        if (eg > worst_gelu) { worst_gelu = eg; }
        if (edg > worst_dgelu) { worst_dgelu = edg; }
    }
    printf("canon_tanhf: max abs err %.3g; gelu, gelu': max abs err / max(1,|x|) %.3g, %.3g\n",
           worst_abs, worst_gelu, worst_dgelu);
    CHECK(worst_abs < 1.5e-7, "canon_tanhf absolute error %.3g", worst_abs);
    CHECK(worst_gelu < 3e-7, "canon_gelu error %.3g", worst_gelu);
    CHECK(worst_dgelu < 4e-7, "canon_gelu_grad error %.3g", worst_dgelu);
    double wc = 0, wl = 0;
    for (int i = -30000; i <= 30000; i++) {
        double x = i * 1e-4;
        double e = fabs(canon_cospi_d(x) - cos(M_PI * x));
        if (e > wc) { wc = e; }
    }
    for (int i = 1; i <= 60000; i++) {
        double x = exp(-700.0 + i * 0.0233);
        double e = fabs(canon_log_d(x) - log(x)) / fabs(log(x));
        if (e > wl && fabs(log(x)) > 1e-3) { wl = e; }
    }
    printf("canon_cospi_d: max abs err %.3g; canon_log_d: max rel err %.3g\n", wc, wl);
    CHECK(wc < 4e-15, "canon_cospi_d error %.3g", wc);
    CHECK(wl < 1e-15, "canon_log_d error %.3g", wl);

    // R1 streaming vs the recursion, data where order matters
    float v[300];
    int order_mattered = 0;
    for (int n = 1; n <= 300; n++) {
        for (int i = 0; i < n; i++) { v[i] = (random_f32(&s) - 0.5f) * (i % 3 == 0 ? 1e7f : 1.0f); }
        float streamed = canon_tree_sum(v, n, 1), recursive = r1_ref(v, n), sequential = 0.0f;
        for (int i = 0; i < n; i++) { sequential += v[i]; }
        if (memcmp(&recursive, &sequential, 4) != 0) { order_mattered++; }
        CHECK(memcmp(&streamed, &recursive, 4) == 0, "R1 tree of %d leaves: streamed %.9g, recursive %.9g",
              n, streamed, recursive);
        if (n <= 64) {   // the stack never needs more than ceil(log2 n) + 1 entries
            int top = 0, max_top = 0;
            for (int i = 0; i < n; i++) {
                top++;
                if (top > max_top) { max_top = top; }
                top -= canon_tree_merges_after(i, n);
            }
            int bound = 1;
            while ((1 << (bound - 1)) < n) { bound++; }
            CHECK(top == 1 && max_top <= bound, "R1 stack for n=%d: final %d, max %d", n, top, max_top);
        }
    }
    printf("R1 tree: 300 sizes streamed == recursive; the order changed the result in %d of them\n", order_mattered);
    CHECK(order_mattered > 100, "test data too benign: order changed only %d sums", order_mattered);
    // R2 chunks: contiguous, covering, K|8 split aligned
    for (long n = 0; n < 200; n++) {
        CHECK(canon_chunk_begin(n, 0) == 0 && canon_chunk_begin(n, CANON_R) == n, "chunks of %ld", n);
        for (int K = 1; K <= CANON_R; K *= 2) {
            for (int r = 0; r <= K; r++) {
                CHECK(canon_chunk_begin(n, r * (CANON_R / K)) == n * r / K, "chunk split n=%ld K=%d r=%d", n, K, r);
            }
        }
    }

    // SumSq exact
    for (int trial = 0; trial < 50; trial++) {
        int n = 1 + trial * 997 % 5000;
        float* x = malloc(sizeof(float) * n);
        int lo_exp = -60 + trial % 40, span = 1 + trial % 50;   // keep the exact sum within __float128
        for (int i = 0; i < n; i++) {
            float m = random_f32(&s) + 0.5f;
            int e = lo_exp + (int)(random_u32(&s) % (uint32_t)span);
            x[i] = (random_u32(&s) & 1 ? -1.0f : 1.0f) * ldexpf(m, e);
        }
        __float128 exact = 0;
        for (int i = 0; i < n; i++) { exact += (__float128)x[i] * (__float128)x[i]; }
        SumSq whole, a, b;
        canon_sumsq_init(&whole);
        canon_sumsq_init(&a);
        canon_sumsq_init(&b);
        int cut = n / 3;
        for (int i = 0; i < n; i++) { canon_sumsq_add(&whole, x[i]); }
        for (int i = n - 1; i >= cut; i--) { canon_sumsq_add(&a, x[i]); }
        for (int i = 0; i < cut; i++) { canon_sumsq_add(&b, x[i]); }
        canon_sumsq_merge(&a, &b);
        double got = canon_sumsq_value(&whole), got_split = canon_sumsq_value(&a);
        double want = (double)exact;   // __float128 -> double rounds to nearest even
        CHECK(got == want, "SumSq trial %d: %.17g, exact %.17g", trial, got, want);
        CHECK(got_split == got, "SumSq split differs: %.17g vs %.17g", got_split, got);
        free(x);
    }
    {   // extremes: subnormal and huge values together, ties
        float vals[] = {1e-45f, 3e-39f, 1.5e19f, 7.0f, 1e-45f, 2.0f, -3e38f};
        __float128 exact = 0;
        SumSq q;
        canon_sumsq_init(&q);
        for (int i = 0; i < 7; i++) { exact += (__float128)vals[i] * vals[i]; canon_sumsq_add(&q, vals[i]); }
        CHECK(canon_sumsq_value(&q) == (double)exact, "SumSq extremes: %.17g vs %.17g", canon_sumsq_value(&q), (double)exact);
        SumSq t;
        canon_sumsq_init(&t);
        canon_sumsq_add(&t, 1.0f);
        canon_sumsq_add(&t, NAN);
        CHECK(isnan(canon_sumsq_value(&t)), "SumSq with a NaN must be NaN");
        canon_sumsq_init(&t);
        CHECK(canon_sumsq_value(&t) == 0.0, "empty SumSq");
    }
    {   // the array version (exponent buckets) gives the digits of adding one by one
        size_t n = 300007;
        float* x = malloc(sizeof(float) * n);
        for (size_t i = 0; i < n; i++) {
            uint32_t u = random_u32(&s);
            memcpy(&x[i], &u, 4);                       // every bit pattern: subnormals too
            if (!isfinite(x[i])) { x[i] = (float)(u % 1000) * 1e-3f; }
        }
        x[17] = 0.0f; x[18] = -0.0f; x[19] = 1e-45f;
        SumSq one, arr;
        canon_sumsq_init(&one);
        canon_sumsq_init(&arr);
        for (size_t i = 0; i < n; i++) { canon_sumsq_add(&one, x[i]); }
        canon_sumsq_add_array(&arr, x, n);
        canon_sumsq_normalize(&one);
        canon_sumsq_normalize(&arr);
        CHECK(memcmp(one.digit, arr.digit, sizeof(one.digit)) == 0 && one.nonfinite == arr.nonfinite,
              "SumSq array version differs from adding one by one");
        x[5] = INFINITY;
        canon_sumsq_init(&arr);
        canon_sumsq_add_array(&arr, x, n);
        CHECK(isnan(canon_sumsq_value(&arr)), "SumSq array version with an inf must be NaN");
        free(x);
    }
    printf("SumSq: 50 random trials and the extremes equal the exactly rounded sum; the array version is identical\n");

    {   // bf16 rounding: random bit patterns (every exponent), the ties, and the special values
        size_t n = (size_t)1 << 22, wrong = 0;
        float* x = (float*)malloc(sizeof(float) * n);
        uint16_t* h = (uint16_t*)malloc(sizeof(uint16_t) * n);
        uint64_t state = 7;
        for (size_t i = 0; i < n; i++) {
            uint32_t u = random_u32(&state);
            if (i % 4 == 1) { u = (u & 0xffff0000u) | 0x8000u; }   // exactly halfway
            x[i] = canon_bits_to_float(u);
        }
        float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, 3.3961776e38f, 3.4028235e38f,
                           -3.4028235e38f, 1.00390625f, 1.01171875f};
        memcpy(x, special, sizeof(special));
        memory_host.to_bf16(h, x, n);
        for (size_t i = 0; i < n; i++) {
            uint16_t want = bf16_by_definition(x[i]);
            if (h[i] != want || canon_bf16_bits(x[i]) != want) {
                if (wrong++ < 5) { printf("bf16 of %.9g (0x%08x): 0x%04x, want 0x%04x\n", x[i], canon_float_to_bits(x[i]), h[i], want); }
            }
        }
        CHECK(wrong == 0, "canon_bf16_bits: %zu of %zu values not rounded to nearest even", wrong, n);
        CHECK(canon_bf16_bits(3.3961776e38f) == 0x7f80u && canon_bf16_bits(1.00390625f) == 0x3f80u &&
              canon_bf16_bits(1.01171875f) == 0x3f82u, "bf16 rounding of the overflow and tie cases");
        free(x);
        free(h);
    }
    printf("bf16 rounding: 4 million values and the special ones rounded to nearest, ties to even\n");
    if (failures) { printf("%d check(s) FAILED\n", failures); return 1; }
    printf("all checks passed\n");
    return 0;
}
