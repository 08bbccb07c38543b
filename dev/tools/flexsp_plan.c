/*
 * flexsp_plan: FlexSP's plan and its simulated time for a list of sequence lengths
 * (llmc/varlen_flexsp.h: the cost model, the sequence blaster, the buckets, the policies).
 *
 *   flexsp_plan [--gpus N] [--policy static|adaptive|milp|greedy|all] [--max-len S] [--time-limit MS]
 *               (--lengths L1,L2,... | --lognormal MEDIAN SIGMA COUNT SEED)
 *   flexsp_plan --table     the README's table: 16 and 64 GPUs, 128-512 sequences, longest
 *                           64K-256K, lengths lognormal (median 347, sigma 1.41) cut at the longest
 *
 * Per policy and microbatch it prints the groups (size: the lengths they hold) with their
 * planned time, then the step's simulated time and the planner's own time. The coefficients
 * are FlexSP's GPT-7B ones (flexsp_cost_gpt7b); --max-len is the longest sequence the run
 * allows (static's group size; default the longest given).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/rand.h"
#include "llmc/utils.h"
#include "llmc/varlen_flexsp.h"

// greedy: milp's starting point alone (groups of different sizes by bisection, no solver), to
// show what the solver adds
typedef enum { POLICY_STATIC, POLICY_ADAPTIVE, POLICY_MILP, POLICY_GREEDY } Policy;
static const char* policy_names[] = {"static", "adaptive", "milp", "greedy"};

static int by_length_desc(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

// One microbatch's plan under a policy; INFINITY when it does not fit. *solved: what planned it.
static double plan_microbatch(const FlexCost* c, Policy policy, int static_size, const double* len, int n, int N,
                              int tm_lim_ms, FlexPlan* p, int* group_of, FlexSolved* solved) {
    *solved = FLEXSP_GREEDY;
    if (policy == POLICY_STATIC) { return flexsp_uniform_plan(c, len, n, N, static_size, p, group_of); }
    if (policy == POLICY_ADAPTIVE) { return flexsp_adaptive_plan(c, len, n, N, p, group_of); }
    if (policy == POLICY_GREEDY) { return flexsp_hetero_plan(c, len, n, N, p, group_of); }
    *solved = flexsp_milp_plan(c, len, n, N, tm_lim_ms, 1, p, group_of, NULL, NULL);
    return p->ms;
}

// The step under a policy: the sequence blaster (sorted descending, each microbatch extended
// while its greedy plan still fits), each microbatch planned. Returns the simulated ms.
static double plan_step(const FlexCost* c, Policy policy, double max_len, const double* sorted, int n, int N,
                        int tm_lim_ms, int verbose, double* planner_ms, int* microbatches, int* solver_counts) {
    int static_size = flexsp_min_group(c, max_len, N);
    FlexPlan* p = (FlexPlan*)malloc_or_die(sizeof(FlexPlan), "plan");
    int* group_of = (int*)malloc_or_die(sizeof(int) * (size_t)n, "plan");
    double total = 0, t0 = now_seconds();
    *microbatches = 0;
    for (int begin = 0; begin < n;) {
        int end = begin + 1;   // extend while a greedy plan fits (static: its own size)
        while (end < n) {
            FlexPlan trial;
            int* of = (int*)malloc_or_die(sizeof(int) * (size_t)(end + 1 - begin), "plan");
            double ms = policy == POLICY_STATIC ? flexsp_uniform_plan(c, sorted + begin, end + 1 - begin, N, static_size, &trial, of)
                                                : flexsp_adaptive_plan(c, sorted + begin, end + 1 - begin, N, &trial, of);
            free(of);
            if (ms == INFINITY) { break; }
            end++;
        }
        FlexSolved solved;
        // the solver's share of the step's budget: half of what is left, at least 20 ms
        double left = tm_lim_ms - (now_seconds() - t0) * 1e3;
        int limit = left / 2 > 20 ? (int)(left / 2) : 20;
        double ms = plan_microbatch(c, policy, static_size, sorted + begin, end - begin, N, limit, p, group_of, &solved);
        if (ms == INFINITY) { fatal("--lengths: a sequence of %.0f tokens does not fit the pool of %d devices' memory", sorted[begin], N); }
        if (policy == POLICY_MILP) { solver_counts[solved]++; }
        if (verbose) {
            double* gms = (double*)malloc_or_die(sizeof(double) * (size_t)p->ngroups, "plan");
            flexsp_plan_ms(c, p, sorted + begin, group_of, end - begin, gms);
            printf("  %s microbatch %d: %d sequences, %.0f ms\n", policy_names[policy], *microbatches, end - begin, ms);
            for (int k = 0; k < p->ngroups; k++) {
                printf("    group %d (%d devices, %.0f ms):", k, p->size[k], gms[k]);
                for (int i = 0; i < end - begin; i++) { if (group_of[i] == k) { printf(" %.0f", sorted[begin + i]); } }
                printf("\n");
            }
            free(gms);
        }
        total += ms;
        (*microbatches)++;
        begin = end;
    }
    *planner_ms = (now_seconds() - t0) * 1e3;
    free(p);
    free(group_of);
    return total;
}

// n lengths lognormal(median, sigma), at least 1 and at most max_len tokens.
static void lognormal_lengths(double* out, int n, double median, double sigma, uint64_t seed, double max_len) {
    uint64_t s = seed * 2654435761u + 1;
    for (int i = 0; i < n; i++) {
        double u1 = (random_u32(&s) + 1.0) / 4294967297.0, u2 = random_u32(&s) / 4294967296.0;
        double z = sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
        double v = floor(median * exp(sigma * z));
        out[i] = v < 1 ? 1 : v > max_len ? max_len : v;
    }
}

static void print_solvers(const int* counts) {
#ifdef HAVE_GLPK
    printf("solver: GLPK optimal in %d microbatch(es), stopped at the time limit in %d (its best plan, never worse "
           "than the greedy warm start); the greedy plan alone in %d\n", counts[FLEXSP_MILP_OPTIMAL], counts[FLEXSP_MILP_TIME_LIMIT],
           counts[FLEXSP_GREEDY]);
#else
    printf("solver: GLPK not built in (no glpk.h): the greedy plan in all %d microbatch(es)\n", counts[FLEXSP_GREEDY]);
#endif
}

static void table(const FlexCost* c, int tm_lim_ms) {
    printf("| GPUs | sequences | longest | microbatches | static ms | adaptive ms | greedy ms | milp ms | milp vs static | milp vs adaptive | planner ms/step |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    int gpus[] = {16, 64}, batches[] = {128, 256, 512};
    double longest[] = {65536, 131072, 262144};
    int counts[4] = {0};
    for (int gi = 0; gi < 2; gi++) {
        for (int li = 0; li < 3; li++) {
            for (int bi = 0; bi < 3; bi++) {
                int n = batches[bi], N = gpus[gi];
                double* len = (double*)malloc_or_die(sizeof(double) * (size_t)n, "lengths");
                lognormal_lengths(len, n, 347, 1.41, 1000 + bi, longest[li]);
                qsort(len, (size_t)n, sizeof(double), by_length_desc);
                double ms[4], planner = 0;
                int mbs = 0;
                if (flexsp_min_group(c, longest[li], N) == 0) { free(len); continue; }
                for (int pol = 0; pol < 4; pol++) {
                    double pm;
                    int mb;
                    ms[pol] = plan_step(c, (Policy)pol, longest[li], len, n, N, tm_lim_ms, 0, &pm, &mb, counts);
                    if (pol == POLICY_MILP) { planner = pm; mbs = mb; }
                }
                printf("| %d | %d | %.0fK | %d | %.0f | %.0f | %.0f | %.0f | %.2fx | %.2fx | %.0f |\n", N, n, longest[li] / 1024,
                       mbs, ms[0], ms[1], ms[3], ms[2], ms[0] / ms[2], ms[1] / ms[2], planner);
                free(len);
            }
        }
    }
    print_solvers(counts);
}

int main(int argc, char** argv) {
    FlexCost c = flexsp_cost_gpt7b();
    int N = 64, tm_lim_ms = 800, verbose = 1, n = 0;
    double max_len = 0;
    const char* policy = "all";
    double* len = NULL;
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (strcmp(a, "--table") == 0) { table(&c, tm_lim_ms); return 0; }
        if (i + 1 >= argc) { fatal("flag %s needs a value (see the header of dev/tools/flexsp_plan.c)", a); }
        if (strcmp(a, "--gpus") == 0) {
            N = atoi(argv[++i]);
            if (N < 1 || N > FLEXSP_MAX_POOL || (N & (N - 1))) { fatal("--gpus: expected a power of two in [1, %d], got '%s'", FLEXSP_MAX_POOL, argv[i]); }
        } else if (strcmp(a, "--policy") == 0) {
            policy = argv[++i];
            if (strcmp(policy, "static") && strcmp(policy, "adaptive") && strcmp(policy, "milp") && strcmp(policy, "greedy") &&
                strcmp(policy, "all")) {
                fatal("--policy: expected static, adaptive, milp, greedy or all, got '%s'", policy);
            }
        } else if (strcmp(a, "--max-len") == 0) {
            max_len = atof(argv[++i]);
            if (!(max_len >= 1)) { fatal("--max-len: expected a length >= 1, got '%s'", argv[i]); }
        } else if (strcmp(a, "--time-limit") == 0) {
            tm_lim_ms = atoi(argv[++i]);
            if (tm_lim_ms < 1) { fatal("--time-limit: expected milliseconds >= 1, got '%s'", argv[i]); }
        } else if (strcmp(a, "--lengths") == 0) {
            const char* s = argv[++i];
            len = (double*)malloc_or_die(sizeof(double) * (strlen(s) / 2 + 2), "lengths");
            for (char* end; *s; s = *end == ',' ? end + 1 : end) {
                double v = strtod(s, &end);
                if (end == s || !(v >= 1) || (*end != ',' && *end != '\0')) { fatal("--lengths: expected lengths >= 1 separated by commas, at '%s'", s); }
                len[n++] = floor(v);
            }
        } else if (strcmp(a, "--lognormal") == 0) {
            if (i + 4 >= argc) { fatal("--lognormal needs MEDIAN SIGMA COUNT SEED"); }
            double median = atof(argv[i + 1]), sigma = atof(argv[i + 2]);
            n = atoi(argv[i + 3]);
            if (n < 1 || !(median >= 1) || !(sigma >= 0)) { fatal("--lognormal: expected MEDIAN >= 1, SIGMA >= 0, COUNT >= 1"); }
            len = (double*)malloc_or_die(sizeof(double) * (size_t)n, "lengths");
            lognormal_lengths(len, n, median, sigma, (uint64_t)atoll(argv[i + 4]), max_len > 0 ? max_len : 262144);
            i += 4;
        } else if (strcmp(a, "--verbose") == 0) {
            verbose = atoi(argv[++i]);
        } else {
            fatal("unknown flag '%s' (see the header of dev/tools/flexsp_plan.c)", a);
        }
    }
    if (n == 0) { fatal("give the lengths: --lengths L1,L2,... or --lognormal MEDIAN SIGMA COUNT SEED"); }
    qsort(len, (size_t)n, sizeof(double), by_length_desc);
    if (max_len == 0) { max_len = len[0]; }
    if (len[0] > max_len) { fatal("--max-len %.0f: a sequence has %.0f tokens", max_len, len[0]); }
    if (flexsp_min_group(&c, max_len, N) == 0) {
        fatal("--lengths: a sequence of %.0f tokens does not fit the memory of the whole pool of %d devices", max_len, N);
    }
    int counts[4] = {0};
    printf("%d sequences (%.0f to %.0f tokens), %d devices, GPT-7B cost model (FlexSP's coefficients)\n", n, len[n - 1],
           len[0], N);
    for (int pol = 0; pol < 4; pol++) {
        if (strcmp(policy, "all") != 0 && strcmp(policy, policy_names[pol]) != 0) { continue; }
        double pm;
        int mbs;
        double ms = plan_step(&c, (Policy)pol, max_len, len, n, N, tm_lim_ms, verbose, &pm, &mbs, counts);
        printf("%s: %d microbatch(es), simulated step %.0f ms, planned in %.1f ms\n", policy_names[pol], mbs, ms, pm);
    }
    print_solvers(counts);
    free(len);
    return 0;
}
