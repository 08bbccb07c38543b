/*
 * test_flexsp.c: FlexSP's planner (llmc/varlen_flexsp.h) against an exhaustive search.
 *
 *  1. small pools (4 and 8 devices, 5-8 sequences, one case whose optimum mixes group sizes, fewer lengths than buckets, so the buckets
 *     are the lengths): every way to cover the pool with power-of-two groups and to assign the
 *     sequences to them, within memory, is tried here; the milp policy's plan must reach that
 *     optimum (GLPK), and adaptive must equal the best single size found the same way (the last:
 *     not below it, adaptive packs greedily); the last
 *     case is the trainer's (engine.h trainer_flexsp_cost): memory per sequence, 15 tokens a
 *     device, so a 16-token sequence needs a group of 2 whatever else its group runs;
 *  2. plans of a long-tail batch on 64 devices: power-of-two groups, aligned, covering the
 *     pool exactly, each within memory, every sequence in a group; milp <= adaptive.
 * Without GLPK only the invariants and milp <= adaptive are checked. Exits non-zero on failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "llmc/varlen_flexsp.h"

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

// The best makespan over every assignment of len[0..n) to groups of the sizes size[0..k).
static double best_assignment(const FlexCost* c, const double* len, int n, int N, const int* size, int k) {
    int assign[16] = {0};
    double best = INFINITY;
    for (;;) {
        double ms[16], tok[16];
        for (int g = 0; g < k; g++) { ms[g] = c->beta; tok[g] = 0; }
        int ok = 1;
        for (int i = 0; i < n; i++) {
            ms[assign[i]] += flexsp_seq_ms(c, len[i], size[assign[i]]);
            tok[assign[i]] += len[i];
            if (c->per_sequence && len[i] > flexsp_group_tokens(c, size[assign[i]], N)) { ok = 0; }
        }
        double worst = 0;
        for (int g = 0; g < k; g++) {
            if (!c->per_sequence && tok[g] > flexsp_group_tokens(c, size[g], N)) { ok = 0; }
            if (ms[g] > worst) { worst = ms[g]; }
        }
        if (ok && worst < best) { best = worst; }
        int i = 0;
        while (i < n && ++assign[i] == k) { assign[i++] = 0; }
        if (i == n) { break; }
    }
    return best;
}

// Every multiset of power-of-two sizes (non-increasing) summing to N, uniform ones or all.
static double best_plan(const FlexCost* c, const double* len, int n, int N, int* size, int k, int left, int maxg,
                        int uniform_only) {
    if (left == 0) {
        if (uniform_only) { for (int g = 1; g < k; g++) { if (size[g] != size[0]) { return INFINITY; } } }
        return best_assignment(c, len, n, N, size, k);
    }
    double best = INFINITY;
    for (int g = maxg; g >= 1; g /= 2) {
        if (g > left) { continue; }
        size[k] = g;
        double v = best_plan(c, len, n, N, size, k + 1, left - g, g, uniform_only);
        if (v < best) { best = v; }
    }
    return best;
}

static void check_invariants(const FlexCost* c, const FlexPlan* p, const int* group_of, const double* len, int n,
                             int N, const char* name) {
    int at = 0;
    for (int k = 0; k < p->ngroups; k++) {
        CHECK((p->size[k] & (p->size[k] - 1)) == 0, "%s: group %d has %d devices, not a power of two", name, k, p->size[k]);
        CHECK(at % p->size[k] == 0, "%s: group %d (%d devices) starts at device %d, not aligned", name, k, p->size[k], at);
        at += p->size[k];
        double tok = 0;   // the group's tokens at once: all of them, or one sequence at a time
        for (int i = 0; i < n; i++) {
            if (group_of[i] == k) { tok = c->per_sequence ? fmax(tok, len[i]) : tok + len[i]; }
        }
        CHECK(tok <= flexsp_group_tokens(c, p->size[k], N), "%s: group %d holds %.0f tokens, more than its memory", name, k, tok);
    }
    CHECK(at == N, "%s: the groups cover %d devices of %d", name, at, N);
    for (int i = 0; i < n; i++) { CHECK(group_of[i] >= 0 && group_of[i] < p->ngroups, "%s: sequence %d in no group", name, i); }
}

int main(void) {
    FlexCost c = flexsp_cost_gpt7b();
    double cases[5][9] = {{20000, 9000, 2000, 1500, 300, 0}, {30000, 12000, 4000, 3000, 800, 200, 0},
                          {11000, 10000, 700, 600, 500, 0}, {25000, 8000, 8000, 8000, 8000, 0},
                          {16, 16, 15, 6, 4, 3, 2, 2, 0}};
    int pools[5] = {4, 8, 8, 8, 4};
    for (int t = 0; t < 5; t++) {
        if (t == 3) {   // 10K tokens per device, a slow all-to-all past pairs: the long sequence needs
                        // 4 devices, the others are best in pairs
            c.device_bytes = 58e9;
            for (int k = 2; k < FLEXSP_MAX_SIZES; k++) { c.bw[k] = 2.0; }
        }
        if (t == 4) {   // the trainer's: 15 tokens a device, one sequence at a time
            c = flexsp_cost_gpt7b();
            c.params = 0;
            c.act_per_token = 1;
            c.device_bytes = 15;
            c.per_sequence = 1;
        }
        int n = 0, N = pools[t], size[16], group_of[16];
        while (cases[t][n] > 0) { n++; }
        double want = best_plan(&c, cases[t], n, N, size, 0, N, N, 0);
        double want_uniform = best_plan(&c, cases[t], n, N, size, 0, N, N, 1);
        FlexPlan p, solver;
        int solver_of[16];
        FlexSolved solved = flexsp_milp_plan(&c, cases[t], n, N, 5000, 0, &p, group_of, &solver, solver_of);
        check_invariants(&c, &p, group_of, cases[t], n, N, "milp");
#ifdef HAVE_GLPK
        // the solver's own plan, without the greedy warm start
        CHECK(solved == FLEXSP_MILP_OPTIMAL, "case %d: GLPK did not prove its plan optimal", t);
        CHECK(solver.ms != INFINITY, "case %d: no plan from GLPK", t);
        if (solver.ms != INFINITY) { check_invariants(&c, &solver, solver_of, cases[t], n, N, "GLPK's plan"); }
        CHECK(fabs(solver.ms - want) <= 1e-9 * want, "case %d: GLPK's plan %.6f ms, the exhaustive optimum %.6f ms", t,
              solver.ms, want);
        CHECK(fabs(p.ms - want) <= 1e-9 * want, "case %d: milp %.6f ms, the exhaustive optimum %.6f ms", t, p.ms, want);
#else
        (void)solved;
        CHECK(p.ms >= want * (1 - 1e-9), "case %d: a plan faster than the optimum", t);
#endif
        FlexPlan a;
        flexsp_adaptive_plan(&c, cases[t], n, N, &a, group_of);
        check_invariants(&c, &a, group_of, cases[t], n, N, "adaptive");
        // adaptive packs greedily (longest first, to the least-loaded group): the best single
        // size's optimum in the first four cases, above it in the fifth (by 0.04 ms)
        if (t < 4) {
            CHECK(fabs(a.ms - want_uniform) <= 1e-9 * want_uniform, "case %d: adaptive %.6f ms, the best single size %.6f ms",
                  t, a.ms, want_uniform);
        } else {
            CHECK(a.ms >= want_uniform * (1 - 1e-9), "case %d: adaptive %.6f ms, below the best single size %.6f ms", t,
                  a.ms, want_uniform);
        }
        if (t == 3) { CHECK(want < want_uniform * 0.99, "case 3 should need groups of different sizes"); }
        printf("case %d: %d sequences on %d devices: milp %.1f ms (exhaustive optimum %.1f), adaptive %.1f ms (best "
               "single size %.1f)\n", t, n, N, p.ms, want, a.ms, want_uniform);
    }
    // a long-tail batch on 64 devices
    c = flexsp_cost_gpt7b();
    int n = 256, N = 64;
    double* len = malloc(sizeof(double) * n);
    uint64_t s = 5;
    for (int i = 0; i < n; i++) {   // lognormal(347, 1.41) by the central limit of 12 uniforms
        double z = -6;
        for (int k = 0; k < 12; k++) { s = s * 6364136223846793005ull + 1442695040888963407ull; z += (double)(s >> 11) / 9007199254740992.0; }
        len[i] = fmin(262144, fmax(1, floor(347 * exp(1.41 * z))));
    }
    for (int i = 1; i < n; i++) {   // descending
        double v = len[i];
        int j = i;
        while (j > 0 && len[j - 1] < v) { len[j] = len[j - 1]; j--; }
        len[j] = v;
    }
    int* group_of = malloc(sizeof(int) * n);
    FlexPlan* p = malloc(sizeof(FlexPlan));
    FlexPlan* a = malloc(sizeof(FlexPlan));
    flexsp_milp_plan(&c, len, n, N, 300, 1, p, group_of, NULL, NULL);
    check_invariants(&c, p, group_of, len, n, N, "milp, 256 sequences");
    flexsp_adaptive_plan(&c, len, n, N, a, group_of);
    check_invariants(&c, a, group_of, len, n, N, "adaptive, 256 sequences");
    CHECK(p->ms <= a->ms, "milp %.1f ms slower than adaptive %.1f ms", p->ms, a->ms);
    printf("256 sequences (longest %.0f) on 64 devices: milp %.1f ms, adaptive %.1f ms\n", len[0], p->ms, a->ms);
    free(len); free(group_of); free(p); free(a);
    if (failures) { printf("%d failure(s)\n", failures); return 1; }
    printf("ok\n");
    return 0;
}
