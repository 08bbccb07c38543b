// FlexSP's per-sequence gradient exchange (llmc/flexsp.h) on P ranks: whatever pool ranks
// computed each sequence (groups of one at scattered places, power-of-two groups whose members
// each hold a part and -0.0f elsewhere), every rank's shard equals the R1 tree over the
// sequences in index order, summed here by a recursive halving tree written again from
// canonical.h's rule, bit for bit. Run by dev/test/test_flexsp_exchange.sh on 1, 2 and 4 ranks.
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "llmc/comm.h"
#include "llmc/flexsp.h"

static Comm comm;

// sequence j's gradient element i: magnitudes over 2^-10 .. 2^10, so the order of the sum shows
static float grad_value(int j, size_t i) {
    uint32_t h = (uint32_t)(j * 2654435761u) ^ (uint32_t)(i * 40503u + 12345u);
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    float mant = 1.0f + (float)(h & 0xffff) / 65536.0f;
    int expo = (int)((h >> 16) % 21) - 10;
    return ((h >> 31) ? -1.0f : 1.0f) * ldexpf(mant, expo);
}

// R1 (canonical.h): n == 1: the leaf; else tree(first ceil(n/2)) + tree(the rest)
static float reference_tree(int lo, int hi, size_t i) {
    if (hi - lo == 1) { return grad_value(lo, i); }
    int mid = lo + (hi - lo + 1) / 2;
    return reference_tree(lo, mid, i) + reference_tree(mid, hi, i);
}

// One plan: sequence j computed by the pool ranks [first[j], first[j] + size[j]); member m of
// the group holds the elements i with (i / 5) % size == m, -0.0f elsewhere.
static int check_plan(const char* name, const int* first, const int* size, int nseq, size_t shard) {
    int P = comm.world.size, me = comm.world.rank;
    size_t n = (size_t)P * shard;
    int mine = 0;
    for (int j = 0; j < nseq; j++) { if (flexsp_holds(first, size, j, me)) { mine++; } }
    float* grads = (float*)malloc(((size_t)mine * n + 1) * sizeof(float));
    for (int j = 0, k = 0; j < nseq; j++) {
        if (!flexsp_holds(first, size, j, me)) { continue; }
        int member = me - first[j];
        for (size_t i = 0; i < n; i++) {
            grads[(size_t)k * n + i] = (int)((i / 5) % (size_t)size[j]) == member ? grad_value(j, i) : -0.0f;
        }
        k++;
    }
    float* out = (float*)malloc(shard * sizeof(float));
    flexsp_reduce_sequence_grads(&comm.world, NULL, first, size, nseq, grads, shard, out);
    int bad = 0, order_matters = 0;
    for (size_t e = 0; e < shard; e++) {
        size_t i = (size_t)me * shard + e;
        float want = reference_tree(0, nseq, i);
        float left_to_right = 0.0f;
        for (int j = 0; j < nseq; j++) { left_to_right += grad_value(j, i); }
        if (left_to_right != want) { order_matters = 1; }
        if (memcmp(&want, &out[e], sizeof(float)) != 0) {
            if (bad++ < 3) { fprintf(stderr, "[rank %d] %s: element %zu is %.9g, the tree gives %.9g\n", me, name, i, out[e], want); }
        }
    }
    // the data must tell a wrong order from the right one, or this test proves nothing
    float any = (float)order_matters;
    comm_all_reduce_max(&comm.world, &any, 1, COMM_KIND_OTHER);
    if (any == 0.0f) { fprintf(stderr, "[rank %d] %s: no element depends on the order of the sum\n", me, name); bad++; }
    free(grads);
    free(out);
    return bad;
}

int main(int argc, char** argv) {
    comm_init(&comm, &argc, &argv);
    int P = comm.world.size, bad = 0;
    enum { G = 13 };   // not a power of two: R1's ceil(n/2) cuts show
    int first[G], size[G];
    // groups of one, scattered: sequence j on rank (7j + 3) mod P (no block of indices per rank)
    for (int j = 0; j < G; j++) { first[j] = (7 * j + 3) % P; size[j] = 1; }
    bad += check_plan("groups of one", first, size, G, 37);
    // mixed power-of-two groups, aligned: sizes 1, 2, 4, ... up to P, in turn
    int levels = 0;
    while ((1 << (levels + 1)) <= P) { levels++; }
    for (int j = 0; j < G; j++) {
        size[j] = 1 << (j % (levels + 1));
        first[j] = ((3 * j) % (P / size[j])) * size[j];
    }
    bad += check_plan("mixed groups", first, size, G, 37);
    // the whole pool as one group for every sequence (static's plan at the largest size)
    for (int j = 0; j < G; j++) { first[j] = 0; size[j] = P; }
    bad += check_plan("one group of the pool", first, size, G, 8);
    // the planner's own plans (varlen_flexsp.h, FlexSP's GPT-7B cost model) of a long-tail step
    // in scrambled index order, made on rank 0 and broadcast, laid over the pool's blocks
    static const double base[G] = { 300, 40000, 80, 1000, 9000, 347, 20000, 40, 500, 3000, 120, 800, 200 };
    double len[G];
    for (int j = 0; j < G; j++) { len[j] = base[j] * P / 8; }   // the step fits the pool
    FlexCost cost = flexsp_cost_gpt7b();
    cost.params = 1e9;   // 7B's 16 bytes per parameter leave nothing to a pool of 1 or 2 devices
    const char* policies[] = { "static", "adaptive", "milp" };
    for (int policy = 0; policy < 3; policy++) {
        int blocks[2 * G];
        if (comm.world.rank == 0) {
            int sorted[G], group_of[G];
            double sorted_len[G];
            flexsp_sort_by_length(len, G, sorted);
            for (int i = 0; i < G; i++) { sorted_len[i] = len[sorted[i]]; }
            FlexPlan plan;
            double ms;
            if (policy == 0) {
                ms = flexsp_uniform_plan(&cost, sorted_len, G, P, flexsp_min_group(&cost, sorted_len[0], P), &plan, group_of);
            } else if (policy == 1) {
                ms = flexsp_adaptive_plan(&cost, sorted_len, G, P, &plan, group_of);
            } else {
                flexsp_milp_plan(&cost, sorted_len, G, P, 200, 1, &plan, group_of, NULL, NULL);
                ms = plan.ms;
            }
            if (!(ms < INFINITY)) { fatal("%s: no plan fits the pool of %d", policies[policy], P); }
            flexsp_plan_blocks(&plan, group_of, sorted, G, P, blocks, blocks + G);
            printf("%s plan on %d ranks (%.0f ms simulated):", policies[policy], P, ms);
            for (int j = 0; j < G; j++) { printf(" %.0f@[%d,%d)", len[j], blocks[j], blocks[j] + blocks[G + j]); }
            printf("\n");
        }
        // broadcast (the whole pool; the plan): every sequence's block of ranks, from rank 0
        comm_broadcast(&comm.world, blocks, sizeof(blocks), 0, COMM_KIND_OTHER);
        bad += check_plan(policies[policy], blocks, blocks + G, G, 37);
    }
    float any = (float)bad;
    comm_all_reduce_max(&comm.world, &any, 1, COMM_KIND_OTHER);
    if (comm.world.rank == 0) { printf("%s: flexsp exchange on %d ranks\n", any == 0.0f ? "OK" : "FAIL", P); }
    comm_finalize(&comm);
    return any == 0.0f ? 0 : 1;
}
