/*
 * sampler.h: drawing the next token from the model's probabilities, as llm.c's sampler does
 * (one xorshift coin in [0, 1) per token, walked along the cumulative distribution), with a
 * temperature and top-k on top.
 *
 * With temperature 1 and top-k off this is llm.c's sample_mult exactly: the float cumulative
 * sum in vocabulary order, the first token whose cdf exceeds the coin (the last token if
 * rounding leaves the coin above the total). Otherwise each probability p becomes
 * p^(1/temperature) (that is softmax(logits / temperature) once normalised), top-k keeps the k
 * largest (ties to the lower token id) and zeroes the rest, and the coin is scaled by their
 * total, in double. Temperature 0 is greedy: the most likely token (ties to the lower id), no
 * coin looked at. top-p (nucleus, the server's requests) then keeps the fewest most likely
 * tokens (by weight, ties to the lower id) whose weights reach top_p of the total.
 */
#ifndef LLMC_SAMPLER_H
#define LLMC_SAMPLER_H

#include <math.h>
#include <stdlib.h>
#include "llmc/canonical.h"
#include "llmc/utils.h"

typedef struct {
    float temperature;   // >= 0; 1 = the model's distribution, 0 = greedy
    int top_k;           // 0 = every token
    float top_p;         // 1 = every token (sampler_init); else the nucleus of top_p
    double* weights;     // scratch of V entries (sampler_init)
    int* heap;           // scratch of top_k entries
    int* order;          // scratch of V entries for top-p
} Sampler;

static inline void sampler_init(Sampler* s, float temperature, int top_k, int V) {
    s->temperature = temperature;
    s->top_k = top_k >= V ? 0 : top_k;
    s->top_p = 1.0f;
    s->order = (int*)malloc_or_die(sizeof(int) * (V > 0 ? V : 1), "sampler");
    s->weights = (double*)malloc_or_die(sizeof(double) * (V > 0 ? V : 1), "sampler");
    s->heap = (int*)malloc_or_die(sizeof(int) * (s->top_k > 0 ? s->top_k : 1), "sampler");
}

static inline void sampler_free(Sampler* s) {
    free(s->weights);
    free(s->heap);
    free(s->order);
}

// Token a ranks below token b: a smaller weight, or the same weight and a larger id.
static inline int sampler_below(const double* w, int a, int b) {
    return w[a] < w[b] || (w[a] == w[b] && a > b);
}

// Restores the min-heap (by sampler_below) below position i of heap[0 .. n).
static inline void sampler_sift_down(const double* w, int* heap, int n, int i) {
    for (;;) {
        int least = i, l = 2 * i + 1, r = l + 1;
        if (l < n && sampler_below(w, heap[l], heap[least])) { least = l; }
        if (r < n && sampler_below(w, heap[r], heap[least])) { least = r; }
        if (least == i) { return; }
        int t = heap[i]; heap[i] = heap[least]; heap[least] = t;
        i = least;
    }
}

static inline int sampler_heavier_first_(const void* a, const void* b, void* weights) {
    const double* w = (const double*)weights;
    int x = *(const int*)a, y = *(const int*)b;
    return sampler_below(w, y, x) ? -1 : sampler_below(w, x, y) ? 1 : 0;
}

// Zeroes every weight outside the nucleus: the heaviest weights, in order, until their sum
// reaches top_p of the total.
static inline void sampler_nucleus(Sampler* s, double* w, int V) {
    int n = 0;
    double total = 0.0;
    for (int v = 0; v < V; v++) {
        if (w[v] > 0.0) { s->order[n++] = v; total += w[v]; }
    }
    qsort_r(s->order, (size_t)n, sizeof(int), sampler_heavier_first_, w);   // glibc's (_GNU_SOURCE)
    double kept = 0.0;
    int i = 0;
    while (i < n && kept < (double)s->top_p * total) { kept += w[s->order[i++]]; }
    for (; i < n; i++) { w[s->order[i]] = 0.0; }
}

// The greedy token: what `best = 0; for v: if (p[v] > p[best]) best = v` returns (the first
// index of the largest value; NaNs never win, and a NaN at 0 wins). That loop waits on each
// compare; here SAMPLER_LANES lanes each keep their own first maximum over v = lane mod
// SAMPLER_LANES, from -inf, and the lanes' winners are combined by value, ties to the lower
// index: the same token (test_sampler compares the two).
#define SAMPLER_LANES 8
static inline int sampler_argmax(const float* p, int V) {
    if (V <= 0 || p[0] != p[0]) { return 0; }
    float best[SAMPLER_LANES];
    int at[SAMPLER_LANES];
    for (int l = 0; l < SAMPLER_LANES; l++) { best[l] = -canon_inf(); at[l] = -1; }
    int v = 0;
    for (; v + SAMPLER_LANES <= V; v += SAMPLER_LANES) {
        for (int l = 0; l < SAMPLER_LANES; l++) {
            if (p[v + l] > best[l]) { best[l] = p[v + l]; at[l] = v + l; }
        }
    }
    for (int l = 0; v + l < V; l++) {
        if (p[v + l] > best[l]) { best[l] = p[v + l]; at[l] = v + l; }
    }
    int win = 0;   // p[0] when nothing beats -inf (every value -inf or NaN), as the loop gives
    float top = -canon_inf();
    for (int l = 0; l < SAMPLER_LANES; l++) {
        if (at[l] >= 0 && (best[l] > top || (best[l] == top && at[l] < win))) { top = best[l]; win = at[l]; }
    }
    return win;
}

// The next token from probs[0 .. V) (host memory) and a coin in [0, 1).
static inline int sampler_draw(Sampler* s, const float* probs, int V, float coin) {
    if (s->temperature == 0.0f) { return sampler_argmax(probs, V); }   // greedy
    if (s->temperature == 1.0f && s->top_k == 0 && s->top_p >= 1.0f) {   // llm.c's sample_mult
        float cdf = 0.0f;
        for (int v = 0; v < V; v++) {
            cdf += probs[v];
            if (coin < cdf) { return v; }
        }
        return V - 1;
    }
    double* w = s->weights;
    for (int v = 0; v < V; v++) {
        double p = probs[v] > 0.0f ? (double)probs[v] : 0.0;
        w[v] = s->temperature == 1.0f || p == 0.0 ? p : exp(log(p) / s->temperature);
    }
    if (s->top_k > 0) {   // the k largest in a min-heap; every other weight becomes 0
        int k = s->top_k, n = 0;
        for (int v = 0; v < V; v++) {
            if (n < k) {
                s->heap[n++] = v;
                if (n == k) { for (int i = k / 2 - 1; i >= 0; i--) { sampler_sift_down(w, s->heap, k, i); } }
            } else if (sampler_below(w, s->heap[0], v)) {
                s->heap[0] = v;
                sampler_sift_down(w, s->heap, k, 0);
            }
        }
        double threshold = w[s->heap[0]];
        int lowest_kept = s->heap[0];
        for (int v = 0; v < V; v++) {
            if (w[v] < threshold || (w[v] == threshold && v > lowest_kept)) { w[v] = 0.0; }
        }
    }
    if (s->top_p < 1.0f) { sampler_nucleus(s, w, V); }
    double total = 0.0;
    for (int v = 0; v < V; v++) { total += w[v]; }
    double target = (double)coin * total, cdf = 0.0;
    int last = V - 1;
    for (int v = 0; v < V; v++) {
        if (w[v] == 0.0) { continue; }
        cdf += w[v];
        last = v;
        if (target < cdf) { return v; }
    }
    return last;
}

#endif // LLMC_SAMPLER_H
