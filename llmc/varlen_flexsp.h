/*
 * varlen_flexsp.h: FlexSP's planner (Wang et al., ASPLOS 2025, arXiv 2412.01523) for a step of
 * variable-length sequences: sequence-parallel groups of different power-of-two sizes that
 * cover a pool of N devices, the sequences assigned to them by a mixed-integer program.
 * dev/tools/flexsp_plan simulates plans with it; the trainer runs its plans (engine.h
 * trainer_flexsp_plan), a group of several ranks with context parallelism over its pool
 * sub-group, and memory per sequence (FlexCost.per_sequence; README).
 *
 * The cost model (FlexSP's, milliseconds): a sequence of s tokens in a group of g devices
 * computes in (alpha1 s^2 + alpha2 s) / g and, for g > 1, sends Ulysses' all-to-alls,
 * 4 * 2 * L * h * s * 2 bytes / g over the bandwidth of a group of g; a group pays beta once
 * per microbatch; a microbatch takes its slowest group's time, a step the sum over its
 * microbatches. Memory per device: 16 bytes per parameter sharded over the whole pool
 * (ZeRO-3) plus act_per_token bytes for each of the group's tokens / g.
 *
 * The plan of a step:
 *  1. the sequence blaster: lengths sorted descending, cut into consecutive microbatches, each
 *     as long as a greedy plan of it still fits in memory (the fewest such cuts, greedily);
 *  2. per microbatch, the lengths bucketed (<= FLEXSP_BUCKETS buckets, a dynamic program over
 *     the sorted lengths minimising the padding sum(bound - length));
 *  3. policies: static (one group size for the run, the smallest that fits the longest
 *     sequence the run allows), adaptive (the best single size for this microbatch, sequences
 *     longest first to the least-loaded group), milp (FlexSP: integer counts x[b][p] of bucket
 *     b's sequences in candidate group p, N/g candidates of each size g; used-group binaries
 *     u[p] whose sizes sum to N; bucket b only in groups large enough for its bound; every
 *     group within memory; minimise M >= each group's time), solved by GLPK under a time
 *     limit, warm-started with the greedy plan of the same buckets (the best single size),
 *     and never returned worse than that greedy plan.
 */
#ifndef LLMC_VARLEN_FLEXSP_H
#define LLMC_VARLEN_FLEXSP_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/utils.h"
#ifdef HAVE_GLPK
#include <glpk.h>
#endif

#define FLEXSP_BUCKETS 16
#define FLEXSP_MAX_SIZES 11           // group sizes 1, 2, 4, ... 1024
#define FLEXSP_MAX_POOL 1024          // devices in the pool

typedef struct {
    double alpha1, alpha2, beta;      // ms: compute (alpha1 s^2 + alpha2 s) / g, beta per group
    double bw[FLEXSP_MAX_SIZES];      // GB/s of the all-to-all in a group of 2^k (bw[0] unused)
    int layers, hidden;               // L, h
    double params;                    // parameters (16 bytes each, sharded over the pool)
    double device_bytes;              // memory per device
    double act_per_token;             // activation bytes per token
    int max_group;                    // the largest group size a plan may use; 0: the pool
    int per_sequence;                 // 1: a group holds one of its sequences at a time (the trainer
                                      // runs them one after the other), so memory bounds each
                                      // sequence; 0: the sum of the group's (FlexSP's)
} FlexCost;

// FlexSP's published GPT-7B coefficients (8-GPU nodes on InfiniBand: groups past 8 leave the
// node), on 80 GB devices; activations 34 h L bytes per token (Megatron's estimate for 16-bit
// activations with flash attention and no recomputation).
static inline FlexCost flexsp_cost_gpt7b(void) {
    FlexCost c;
    memset(&c, 0, sizeof(c));
    c.alpha1 = 5.128e-6; c.alpha2 = 0.18396; c.beta = 629.36;
    double bw[] = {0, 119.54, 104.07, 96.5, 10.33, 5.94, 4.87};
    for (int k = 0; k < FLEXSP_MAX_SIZES; k++) { c.bw[k] = k < 7 ? bw[k] : 4.87; }
    c.layers = 32; c.hidden = 4096; c.params = 6.7e9;
    c.device_bytes = 80e9;
    c.act_per_token = 34.0 * 4096 * 32;
    return c;
}

static inline int flexsp_log2(int g) { int k = 0; while ((1 << k) < g) { k++; } return k; }

// The largest group a plan of a pool of N may use: N, or the cost model's max_group (the
// trainer's: the largest of its pool's sub-groups that context parallelism runs).
static inline int flexsp_largest_group(const FlexCost* c, int N) {
    return c->max_group > 0 && c->max_group < N ? c->max_group : N;
}

// ms of a sequence of s tokens in a group of g devices.
static inline double flexsp_seq_ms(const FlexCost* c, double s, int g) {
    double t = (c->alpha1 * s * s + c->alpha2 * s) / g;
    if (g > 1) { t += 4.0 * 2.0 * c->layers * c->hidden * s * 2.0 / g / (c->bw[flexsp_log2(g)] * 1e9) * 1e3; }
    return t;
}

// Tokens a group of g devices holds in a pool of N.
static inline double flexsp_group_tokens(const FlexCost* c, int g, int N) {
    double free_bytes = c->device_bytes - 16.0 * c->params / N;
    return free_bytes <= 0 ? 0 : floor(free_bytes / c->act_per_token) * g;
}

// Whether a group of g devices of a pool of N, holding `held` tokens already, has room for a
// sequence of s more.
static inline int flexsp_fits(const FlexCost* c, double held, double s, int g, int N) {
    return (c->per_sequence ? s : held + s) <= flexsp_group_tokens(c, g, N);
}

// The smallest power-of-two group of a pool of N that holds s tokens, or 0 if none.
static inline int flexsp_min_group(const FlexCost* c, double s, int N) {
    for (int g = 1; g <= flexsp_largest_group(c, N); g *= 2) { if (flexsp_group_tokens(c, g, N) >= s) { return g; } }
    return 0;
}

// A plan of one microbatch: group k has size[k] devices and the sequences with group_of == k.
typedef struct {
    int ngroups;
    int size[FLEXSP_MAX_POOL];
    double ms;                              // its slowest group (the microbatch's time)
} FlexPlan;

// Each group's time and the slowest, for sequences len[0..n) in group_of[].
static inline double flexsp_plan_ms(const FlexCost* c, const FlexPlan* p, const double* len, const int* group_of,
                                    int n, double* group_ms) {
    for (int k = 0; k < p->ngroups; k++) { group_ms[k] = c->beta; }
    for (int i = 0; i < n; i++) { group_ms[group_of[i]] += flexsp_seq_ms(c, len[i], p->size[group_of[i]]); }
    double worst = 0;
    for (int k = 0; k < p->ngroups; k++) { if (group_ms[k] > worst) { worst = group_ms[k]; } }
    return worst;
}

// N/g groups of g devices, the sequences (sorted descending) each to the least-loaded group
// with room. Returns the microbatch's time, or INFINITY when they do not fit.
static inline double flexsp_uniform_plan(const FlexCost* c, const double* len, int n, int N, int g, FlexPlan* p,
                                         int* group_of) {
    p->ngroups = N / g;
    double* load = (double*)calloc_or_die((size_t)p->ngroups, sizeof(double), "plan");
    double* tokens = (double*)calloc_or_die((size_t)p->ngroups, sizeof(double), "plan");
    for (int k = 0; k < p->ngroups; k++) { p->size[k] = g; load[k] = c->beta; }
    double result = 0;
    for (int i = 0; i < n && result == 0; i++) {
        int best = -1;
        for (int k = 0; k < p->ngroups; k++) {
            if (flexsp_fits(c, tokens[k], len[i], g, N) && (best < 0 || load[k] < load[best])) { best = k; }
        }
        if (best < 0) { result = INFINITY; break; }
        group_of[i] = best;
        tokens[best] += len[i];
        load[best] += flexsp_seq_ms(c, len[i], g);
    }
    if (result == 0) { result = flexsp_plan_ms(c, p, len, group_of, n, load); }
    p->ms = result;
    free(load);
    free(tokens);
    return result;
}

// Adaptive: the best single group size for these sequences (INFINITY: none fits).
static inline double flexsp_adaptive_plan(const FlexCost* c, const double* len, int n, int N, FlexPlan* p,
                                          int* group_of) {
    FlexPlan trial;
    int* trial_of = (int*)malloc_or_die(sizeof(int) * (size_t)(n ? n : 1), "plan");
    p->ms = INFINITY;
    for (int g = 1; g <= flexsp_largest_group(c, N); g *= 2) {
        if (flexsp_uniform_plan(c, len, n, N, g, &trial, trial_of) < p->ms) {
            *p = trial;
            memcpy(group_of, trial_of, sizeof(int) * (size_t)n);
        }
    }
    free(trial_of);
    return p->ms;
}

// Groups of different sizes for a target time M: the sequences (sorted descending) each to
// the open group where it fits best (the most loaded that stays within M and memory), else to
// a new group, the smallest power of two that runs it within M, while devices remain; the
// devices left over become groups of one. Returns 0 if M cannot be met.
static inline int flexsp_hetero_try(const FlexCost* c, const double* len, int n, int N, double M, FlexPlan* p,
                                    int* group_of) {
    double load[FLEXSP_MAX_POOL], tokens[FLEXSP_MAX_POOL];
    int devices = 0;
    p->ngroups = 0;
    for (int i = 0; i < n; i++) {
        int best = -1;
        for (int k = 0; k < p->ngroups; k++) {
            double t = load[k] + flexsp_seq_ms(c, len[i], p->size[k]);
            if (t <= M && flexsp_fits(c, tokens[k], len[i], p->size[k], N) && (best < 0 || load[k] > load[best])) { best = k; }
        }
        if (best < 0) {
            int g = 1;
            while (g <= N - devices && (c->beta + flexsp_seq_ms(c, len[i], g) > M || flexsp_group_tokens(c, g, N) < len[i])) { g *= 2; }
            if (g > N - devices || g > flexsp_largest_group(c, N)) { return 0; }
            best = p->ngroups++;
            p->size[best] = g;
            load[best] = c->beta;
            tokens[best] = 0;
            devices += g;
        }
        group_of[i] = best;
        load[best] += flexsp_seq_ms(c, len[i], p->size[best]);
        tokens[best] += len[i];
    }
    while (devices < N) { p->size[p->ngroups++] = 1; devices++; }
    return 1;
}

// The sizes of a plan's groups made aligned: largest first, so each starts at a multiple of its
// size (the groups the trainer would create once at startup); group_of follows the reorder.
static inline void flexsp_align_groups(FlexPlan* p, int* group_of, int n) {
    int order[FLEXSP_MAX_POOL], where[FLEXSP_MAX_POOL];
    for (int k = 0; k < p->ngroups; k++) { order[k] = k; }
    for (int a = 1; a < p->ngroups; a++) {   // stable insertion sort, descending size
        int k = order[a], b = a;
        while (b > 0 && p->size[order[b - 1]] < p->size[k]) { order[b] = order[b - 1]; b--; }
        order[b] = k;
    }
    int sizes[FLEXSP_MAX_POOL];
    for (int k = 0; k < p->ngroups; k++) { sizes[k] = p->size[order[k]]; where[order[k]] = k; }
    memcpy(p->size, sizes, sizeof(int) * (size_t)p->ngroups);
    for (int i = 0; i < n; i++) { group_of[i] = where[group_of[i]]; }
}

// The greedy plan of groups of different sizes: a bisection on the target time between a lower
// bound and the adaptive plan's time (INFINITY: nothing fits).
static inline double flexsp_hetero_plan(const FlexCost* c, const double* len, int n, int N, FlexPlan* p,
                                        int* group_of) {
    double hi = flexsp_adaptive_plan(c, len, n, N, p, group_of);
    if (hi == INFINITY) { return hi; }
    FlexPlan* trial = (FlexPlan*)malloc_or_die(sizeof(FlexPlan), "plan");
    int* of = (int*)malloc_or_die(sizeof(int) * (size_t)(n ? n : 1), "plan");
    double* scratch = (double*)malloc_or_die(sizeof(double) * FLEXSP_MAX_POOL, "plan");
    double lo = c->beta;
    for (int it = 0; it < 40 && hi - lo > 1e-3 * hi; it++) {
        double mid = 0.5 * (lo + hi);
        if (flexsp_hetero_try(c, len, n, N, mid, trial, of)) {
            trial->ms = flexsp_plan_ms(c, trial, len, of, n, scratch);
            if (trial->ms < p->ms) { *p = *trial; memcpy(group_of, of, sizeof(int) * (size_t)n); }
            hi = mid;
        } else {
            lo = mid;
        }
    }
    flexsp_align_groups(p, group_of, n);
    free(trial); free(of); free(scratch);
    return p->ms;
}

// The buckets of sorted-descending lengths: a dynamic program over the sorted order choosing
// at most nb contiguous runs, each padded to its longest, minimising the padding. bucket_of[i]
// is sequence i's bucket, bound[b] its bucket's length; returns the buckets used.
static inline int flexsp_buckets(const double* len, int n, int nb, int* bucket_of, double* bound) {
    if (nb > n) { nb = n; }
    // cost[i][j]: padding of the run [i, j) = sum(len[i] - len[k]) (len descending)
    double* prefix = (double*)malloc_or_die(sizeof(double) * (size_t)(n + 1), "buckets");
    prefix[0] = 0;
    for (int i = 0; i < n; i++) { prefix[i + 1] = prefix[i] + len[i]; }
    double* best = (double*)malloc_or_die(sizeof(double) * (size_t)(nb + 1) * (n + 1), "buckets");
    int* cut = (int*)malloc_or_die(sizeof(int) * (size_t)(nb + 1) * (n + 1), "buckets");
    for (int k = 0; k <= nb; k++) { for (int j = 0; j <= n; j++) { best[k * (n + 1) + j] = INFINITY; } }
    best[0] = 0;
    for (int k = 1; k <= nb; k++) {
        for (int j = 1; j <= n; j++) {
            for (int i = k - 1; i < j; i++) {
                double prev = best[(k - 1) * (n + 1) + i];
                if (prev == INFINITY) { continue; }
                double v = prev + len[i] * (j - i) - (prefix[j] - prefix[i]);
                if (v < best[k * (n + 1) + j]) { best[k * (n + 1) + j] = v; cut[k * (n + 1) + j] = i; }
            }
        }
    }
    int used = 1;
    for (int k = 1; k <= nb; k++) { if (best[k * (n + 1) + n] < best[used * (n + 1) + n]) { used = k; } }
    for (int k = used, j = n; k >= 1; k--) {
        int i = cut[k * (n + 1) + j];
        for (int q = i; q < j; q++) { bucket_of[q] = k - 1; }
        bound[k - 1] = len[i];
        j = i;
    }
    free(prefix); free(best); free(cut);
    return used;
}

typedef enum { FLEXSP_GREEDY, FLEXSP_MILP_OPTIMAL, FLEXSP_MILP_TIME_LIMIT, FLEXSP_NO_SOLVER } FlexSolved;

#ifdef HAVE_GLPK
typedef struct { const double* start; int done; } FlexWarm;

// GLPK's callback: the greedy plan offered once as the first incumbent.
static inline void flexsp_glpk_heuristic(glp_tree* tree, void* info) {
    FlexWarm* w = (FlexWarm*)info;
    if (glp_ios_reason(tree) == GLP_IHEUR && !w->done) { glp_ios_heur_sol(tree, w->start); w->done = 1; }
}
#endif

// FlexSP's MILP over the buckets of len[0..n) (sorted descending), warm-started with the
// adaptive plan of the bucketed lengths; writes the best (on the real lengths) of the solver's
// plan, that greedy plan and the greedy plan of the real lengths, so it is never slower than
// adaptive. tm_lim_ms bounds the solver; warm_start 0 leaves the greedy plan out of it, and
// solver_plan (NULL: not wanted) gets the solver's own plan (ms INFINITY: none), for tests.
static inline FlexSolved flexsp_milp_plan(const FlexCost* c, const double* len, int n, int N, int tm_lim_ms,
                                          int warm_start, FlexPlan* p, int* group_of, FlexPlan* solver_plan,
                                          int* solver_of) {
    if (solver_plan) { solver_plan->ms = INFINITY; }
    int* bucket_of = (int*)malloc_or_die(sizeof(int) * (size_t)(n ? n : 1), "plan");
    double bound[FLEXSP_BUCKETS];
    int nb = flexsp_buckets(len, n, FLEXSP_BUCKETS, bucket_of, bound);
    double* padded = (double*)malloc_or_die(sizeof(double) * (size_t)(n ? n : 1), "plan");
    for (int i = 0; i < n; i++) { padded[i] = bound[bucket_of[i]]; }
    FlexPlan greedy;
    int* greedy_of = (int*)malloc_or_die(sizeof(int) * (size_t)(n ? n : 1), "plan");
    flexsp_hetero_plan(c, padded, n, N, &greedy, greedy_of);
    double* scratch = (double*)malloc_or_die(sizeof(double) * (size_t)N * 2 + 8, "plan");
    FlexSolved solved = FLEXSP_NO_SOLVER;
    // the plan to beat: the better, on the real lengths, of the greedy plan of the buckets (the
    // solver's warm start) and the greedy plan of the real lengths (never slower than adaptive,
    // where its bisection starts)
    flexsp_hetero_plan(c, len, n, N, p, group_of);
    if (greedy.ms != INFINITY) {
        double ms = flexsp_plan_ms(c, &greedy, len, greedy_of, n, scratch);
        if (ms < p->ms) { *p = greedy; p->ms = ms; memcpy(group_of, greedy_of, sizeof(int) * (size_t)n); }
    }
#ifdef HAVE_GLPK
    if (greedy.ms != INFINITY) {
        // candidate groups: N/g of each size g; columns x[b][p] (nb x P), u[p] (P), M
        int P = 0, gsize[2 * FLEXSP_MAX_POOL];
        for (int g = 1; g <= flexsp_largest_group(c, N); g *= 2) { for (int k = 0; k < N / g; k++) { gsize[P++] = g; } }
        int ncols = nb * P + P + 1, colM = ncols;
        glp_prob* lp = glp_create_prob();
        glp_set_obj_dir(lp, GLP_MIN);
        glp_add_cols(lp, ncols);
        int count[FLEXSP_BUCKETS] = {0};
        for (int i = 0; i < n; i++) { count[bucket_of[i]]++; }
        for (int b = 0; b < nb; b++) {
            int gmin = flexsp_min_group(c, bound[b], N);
            for (int q = 0; q < P; q++) {
                int j = b * P + q + 1;
                glp_set_col_kind(lp, j, GLP_IV);
                if (gmin == 0 || gsize[q] < gmin) { glp_set_col_bnds(lp, j, GLP_FX, 0, 0); }
                else { glp_set_col_bnds(lp, j, GLP_DB, 0, count[b]); }
            }
        }
        for (int q = 0; q < P; q++) { glp_set_col_kind(lp, nb * P + q + 1, GLP_BV); }
        glp_set_col_bnds(lp, colM, GLP_LO, 0, 0);
        glp_set_obj_coef(lp, colM, 1.0);
        int maxnz = 3 * nb * P + 6 * P + 16;
        int* ia = (int*)malloc_or_die(sizeof(int) * (size_t)maxnz, "milp");
        int* ja = (int*)malloc_or_die(sizeof(int) * (size_t)maxnz, "milp");
        double* ar = (double*)malloc_or_die(sizeof(double) * (size_t)maxnz, "milp");
        int nz = 0, row = 0;
        for (int b = 0; b < nb; b++) {   // every sequence in exactly one group
            row = glp_add_rows(lp, 1);
            glp_set_row_bnds(lp, row, GLP_FX, count[b], count[b]);
            for (int q = 0; q < P; q++) { nz++; ia[nz] = row; ja[nz] = b * P + q + 1; ar[nz] = 1.0; }
        }
        for (int q = 0; q < P; q++) {
            // time: sum_b x[b][q] t(bound_b, g) + beta u[q] - M <= 0
            row = glp_add_rows(lp, 1);
            glp_set_row_bnds(lp, row, GLP_UP, 0, 0);
            for (int b = 0; b < nb; b++) { nz++; ia[nz] = row; ja[nz] = b * P + q + 1; ar[nz] = flexsp_seq_ms(c, bound[b], gsize[q]); }
            nz++; ia[nz] = row; ja[nz] = nb * P + q + 1; ar[nz] = c->beta;
            nz++; ia[nz] = row; ja[nz] = colM; ar[nz] = -1.0;
            // memory: sum_b x[b][q] bound_b - cap u[q] <= 0 (an unused group holds nothing);
            // one sequence at a time (per_sequence): the bucket's smallest group above bounds
            // the memory, and the row only keeps an unused group empty (sum_b x[b][q] <= n u[q])
            row = glp_add_rows(lp, 1);
            glp_set_row_bnds(lp, row, GLP_UP, 0, 0);
            for (int b = 0; b < nb; b++) { nz++; ia[nz] = row; ja[nz] = b * P + q + 1; ar[nz] = c->per_sequence ? 1.0 : bound[b]; }
            nz++; ia[nz] = row; ja[nz] = nb * P + q + 1; ar[nz] = c->per_sequence ? -(double)n : -flexsp_group_tokens(c, gsize[q], N);
        }
        row = glp_add_rows(lp, 1);   // the groups used cover the pool exactly
        glp_set_row_bnds(lp, row, GLP_FX, N, N);
        for (int q = 0; q < P; q++) { nz++; ia[nz] = row; ja[nz] = nb * P + q + 1; ar[nz] = gsize[q]; }
        for (int q = 0; q + 1 < P; q++) {   // symmetry: groups of one size are used in order
            if (gsize[q] != gsize[q + 1]) { continue; }
            row = glp_add_rows(lp, 1);
            glp_set_row_bnds(lp, row, GLP_LO, 0, 0);
            nz++; ia[nz] = row; ja[nz] = nb * P + q + 1; ar[nz] = 1.0;
            nz++; ia[nz] = row; ja[nz] = nb * P + q + 2; ar[nz] = -1.0;
        }
        glp_load_matrix(lp, nz, ia, ja, ar);
        // the warm start: the greedy plan's groups as the first candidates of their size
        double* start = (double*)calloc_or_die((size_t)ncols + 1, sizeof(double), "milp");
        int first_of_size[FLEXSP_MAX_SIZES], taken[FLEXSP_MAX_SIZES] = {0};
        for (int q = P - 1; q >= 0; q--) { first_of_size[flexsp_log2(gsize[q])] = q; }
        int* cand = (int*)malloc_or_die(sizeof(int) * (size_t)greedy.ngroups, "milp");
        for (int k = 0; k < greedy.ngroups; k++) {
            int s = flexsp_log2(greedy.size[k]);
            cand[k] = first_of_size[s] + taken[s]++;
            start[nb * P + cand[k] + 1] = 1.0;
        }
        for (int i = 0; i < n; i++) { start[bucket_of[i] * P + cand[greedy_of[i]] + 1] += 1.0; }
        start[colM] = greedy.ms;
        glp_smcp smcp;
        glp_init_smcp(&smcp);
        smcp.msg_lev = GLP_MSG_OFF;
        glp_iocp iocp;
        glp_init_iocp(&iocp);
        iocp.msg_lev = GLP_MSG_OFF;
        iocp.tm_lim = tm_lim_ms;
        FlexWarm warm = {start, !warm_start};
        iocp.cb_func = flexsp_glpk_heuristic;
        iocp.cb_info = &warm;
        glp_term_out(GLP_OFF);
        glp_scale_prob(lp, GLP_SF_AUTO);
        int src = glp_simplex(lp, &smcp);
        if (src == 0) {
            int rc = glp_intopt(lp, &iocp);
            int st = glp_mip_status(lp);
            if (st == GLP_OPT || st == GLP_FEAS) {
                solved = rc == 0 && st == GLP_OPT ? FLEXSP_MILP_OPTIMAL : FLEXSP_MILP_TIME_LIMIT;
                // the solution: used groups in order, each bucket's count to its groups
                FlexPlan milp;
                int* milp_of = (int*)malloc_or_die(sizeof(int) * (size_t)(n ? n : 1), "plan");
                int* index = (int*)malloc_or_die(sizeof(int) * (size_t)P, "plan");
                milp.ngroups = 0;
                for (int q = 0; q < P; q++) {
                    index[q] = -1;
                    if (glp_mip_col_val(lp, nb * P + q + 1) > 0.5) { index[q] = milp.ngroups; milp.size[milp.ngroups++] = gsize[q]; }
                }
                int ok = 1;
                for (int b = 0; b < nb && ok; b++) {
                    int q = 0, left = (int)lround(glp_mip_col_val(lp, b * P + 1));
                    for (int i = 0; i < n && ok; i++) {
                        if (bucket_of[i] != b) { continue; }
                        while (left == 0 && q + 1 < P) { q++; left = (int)lround(glp_mip_col_val(lp, b * P + q + 1)); }
                        if (left == 0 || index[q] < 0) { ok = 0; break; }
                        milp_of[i] = index[q];
                        left--;
                    }
                }
                if (ok) {
                    milp.ms = flexsp_plan_ms(c, &milp, len, milp_of, n, scratch);
                    if (milp.ms <= p->ms) { *p = milp; memcpy(group_of, milp_of, sizeof(int) * (size_t)n); }
                    if (solver_plan) { *solver_plan = milp; memcpy(solver_of, milp_of, sizeof(int) * (size_t)n); }
                }
                free(milp_of);
                free(index);
            }
        }
        free(cand); free(start); free(ia); free(ja); free(ar);
        glp_delete_prob(lp);
    }
#else
    (void)tm_lim_ms; (void)nb; (void)warm_start; (void)solver_of;
#endif
    if (solved == FLEXSP_NO_SOLVER) { solved = FLEXSP_GREEDY; }
    free(bucket_of); free(padded); free(greedy_of); free(scratch);
    return solved;
}

#endif // LLMC_VARLEN_FLEXSP_H
