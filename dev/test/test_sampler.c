// llmc/sampler.h against a plain reference: with temperature 1 and top-k off, llm.c's
// sample_mult; otherwise the tokens sorted by probability (a full sort, not the sampler's heap),
// the k best kept, then (top-p) the fewest best whose weight reaches top_p of the total, the coin
// walked along their cumulative weight in vocabulary order. Also properties no implementation
// detail decides: top-k 1 and temperature 0 are the argmax, and the drawn frequencies follow
// the tempered distribution.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "llmc/rand.h"
#include "llmc/sampler.h"

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL: "); printf(__VA_ARGS__); printf("\n"); } } while (0)

// llm.c's sample_mult (train_gpt2.c), verbatim in substance
static int sample_mult(const float* probabilities, int n, float coin) {
    float cdf = 0.0f;
    for (int i = 0; i < n; i++) {
        cdf += probabilities[i];
        if (coin < cdf) { return i; }
    }
    return n - 1;
}

static const double* sort_weights;
static int by_weight_then_id(const void* a, const void* b) {
    int i = *(const int*)a, j = *(const int*)b;
    if (sort_weights[i] != sort_weights[j]) { return sort_weights[i] > sort_weights[j] ? -1 : 1; }
    return i - j;
}

static int reference_draw(const float* probs, int V, float temperature, int top_k, float top_p, float coin) {
    double* w = malloc(sizeof(double) * V);
    int* order = malloc(sizeof(int) * V);
    for (int v = 0; v < V; v++) {
        double p = probs[v] > 0.0f ? probs[v] : 0.0;
        w[v] = temperature == 1.0f || p == 0.0 ? p : exp(log(p) / temperature);
        order[v] = v;
    }
    if (top_k > 0 && top_k < V) {
        sort_weights = w;
        qsort(order, V, sizeof(int), by_weight_then_id);
        for (int r = top_k; r < V; r++) { w[order[r]] = 0.0; }
    }
    if (top_p < 1.0f) {
        double mass = 0.0, kept = 0.0;
        for (int v = 0; v < V; v++) { mass += w[v]; order[v] = v; }
        sort_weights = w;
        qsort(order, V, sizeof(int), by_weight_then_id);
        for (int r = 0; r < V; r++) {
            if (kept >= (double)top_p * mass) { w[order[r]] = 0.0; } else { kept += w[order[r]]; }
        }
    }
    double total = 0.0;
    for (int v = 0; v < V; v++) { total += w[v]; }
    double cdf = 0.0, target = coin * total;
    int pick = -1, last = V - 1;
    for (int v = 0; v < V && pick < 0; v++) {
        if (w[v] == 0.0) { continue; }
        cdf += w[v];
        last = v;
        if (target < cdf) { pick = v; }
    }
    free(w);
    free(order);
    return pick >= 0 ? pick : last;
}

int main(void) {
    uint64_t rng = 42;
    int V = 300;
    float* probs = malloc(sizeof(float) * V);
    // 1. against the references, on distributions with ties and zeros
    const float temps[] = {1.0f, 0.7f, 1.5f, 0.05f};
    const int ks[] = {0, 1, 5, 40, 299, 300, 1000};
    const float tps[] = {1.0f, 0.9f, 0.3f};
    long draws = 0;
    for (int trial = 0; trial < 40; trial++) {
        double sum = 0.0;
        for (int v = 0; v < V; v++) {
            float r = random_f32(&rng);
            probs[v] = trial % 3 == 0 ? (float)((int)(r * 8)) : r * r * r;   // ties (and zeros) every third trial
            sum += probs[v];
        }
        for (int v = 0; v < V; v++) { probs[v] = (float)(probs[v] / sum); }
        for (size_t ti = 0; ti < sizeof(temps) / sizeof(temps[0]); ti++) {
            for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
                for (size_t pi = 0; pi < sizeof(tps) / sizeof(tps[0]); pi++) {
                    Sampler s;
                    sampler_init(&s, temps[ti], ks[ki], V);
                    s.top_p = tps[pi];
                    for (int c = 0; c < 50; c++) {
                        float coin = random_f32(&rng);
                        int got = sampler_draw(&s, probs, V, coin);
                        int want = temps[ti] == 1.0f && (ks[ki] == 0 || ks[ki] >= V) && tps[pi] == 1.0f
                                 ? sample_mult(probs, V, coin) : reference_draw(probs, V, temps[ti], ks[ki], tps[pi], coin);
                        CHECK(got == want, "trial %d temperature %g top-k %d top-p %g coin %.9g: drew %d, the reference %d",
                              trial, temps[ti], ks[ki], tps[pi], coin, got, want);
                        draws++;
                    }
                    sampler_free(&s);
                }
            }
        }
    }
    printf("%ld draws against llm.c's sample_mult and the sorted reference\n", draws);

    // 2. top-k 1 is the argmax (the lowest id among equal maxima), whatever the coin
    for (int v = 0; v < V; v++) { probs[v] = 1.0f / V; }
    probs[17] = probs[230] = 2.0f / V;
    Sampler one;
    sampler_init(&one, 0.9f, 1, V);
    for (int c = 0; c < 100; c++) {
        int got = sampler_draw(&one, probs, V, random_f32(&rng));
        CHECK(got == 17, "top-k 1 drew %d, the argmax is 17", got);
    }
    sampler_free(&one);
    // temperature 0 (greedy) is the argmax too, top-k and top-p aside
    Sampler greedy;
    sampler_init(&greedy, 0.0f, 5, V);
    greedy.top_p = 0.5f;
    for (int c = 0; c < 100; c++) {
        int got = sampler_draw(&greedy, probs, V, random_f32(&rng));
        CHECK(got == 17, "temperature 0 drew %d, the argmax is 17", got);
    }
    sampler_free(&greedy);
    // sampler_argmax (the greedy draw, lanes combined) = the one-by-one loop it replaces, on
    // lengths around its lanes, values from a few levels (ties in every lane position), NaNs
    // (at 0 too), infinities
    float levels[] = {0.0f, 0.25f, 0.5f, 0.5f, 1.0f, -canon_inf(), canon_inf(), canon_nan()};
    float* x = malloc(sizeof(float) * 4099);
    long argmax_cases = 0;
    for (int trial = 0; trial < 4000; trial++) {
        int n = trial < 2000 ? 1 + trial % 40 : 4099 - trial % 7;
        int spread = 2 + trial % 7;   // which levels occur: a few (many ties) or all (NaN and inf)
        for (int v = 0; v < n; v++) { x[v] = levels[(int)(random_f32(&rng) * spread) % spread]; }
        if (trial % 5 == 0) { x[0] = canon_nan(); }
        int want = 0;
        for (int v = 1; v < n; v++) {
            if (x[v] > x[want]) { want = v; }
        }
        int got = sampler_argmax(x, n);
        CHECK(got == want, "sampler_argmax trial %d of %d values: %d, the loop %d", trial, n, got, want);
        argmax_cases++;
    }
    free(x);
    printf("%ld argmax cases against the one-by-one loop\n", argmax_cases);

    // 3. frequencies: 4 tokens with p = .1 .2 .3 .4 at temperature 0.5 are drawn in proportion
    //    to p^2 = 1 : 4 : 9 : 16 (chi-square with 3 degrees of freedom below 16.3: p < 0.001)
    float four[4] = {0.1f, 0.2f, 0.3f, 0.4f};
    Sampler hot;
    sampler_init(&hot, 0.5f, 0, 4);
    long count[4] = {0, 0, 0, 0}, n = 200000;
    for (long i = 0; i < n; i++) { count[sampler_draw(&hot, four, 4, random_f32(&rng))]++; }
    sampler_free(&hot);
    double chi2 = 0.0;
    for (int v = 0; v < 4; v++) {
        double expected = n * (double)((v + 1) * (v + 1)) / 30.0;
        chi2 += (count[v] - expected) * (count[v] - expected) / expected;
    }
    printf("temperature 0.5 on (.1 .2 .3 .4): counts %ld %ld %ld %ld of %ld, chi-square %.2f\n", count[0], count[1],
           count[2], count[3], n, chi2);
    CHECK(chi2 < 16.3, "temperature 0.5: frequencies do not follow p^2 (chi-square %.2f)", chi2);

    free(probs);
    if (failures) { printf("%d check(s) failed\n", failures); return 1; }
    printf("all sampler checks passed\n");
    return 0;
}
