/*
 * test_comm.c: tests of llmc/comm.h. Built as build/test_comm, which dev/test/test_comm.sh runs
 * under dev/test/mpi.sh on 1 to 8 ranks, and as build/test_comm_nompi (no MPI, one rank).
 *
 *   test_comm                 every check below; exits 1 on every rank if any rank failed one
 *   test_comm --grid TP PP    only sets up that grid (test_comm.sh checks the error for a bad one)
 *   test_comm --fault fatal   rank 1 calls fatal() while the others wait in a barrier
 *   test_comm --fault kill    rank 2 kills itself (SIGKILL) while the others wait in an all-reduce
 *
 * Every rank builds its contribution from (seed, world rank) and can rebuild any other rank's,
 * so each rank computes the expected result of a collective by itself: the R1 halving tree
 * written here recursively from its definition (not canon_tree_sum, so a mistake in either
 * shows). The values span 2^-20 .. 2^20 with both signs, so the order of a sum matters: the
 * test checks that summing in another order gives different bits, i.e. that it can fail.
 */
#include <signal.h>
#include <time.h>
#include "llmc/comm.h"

static Comm comm;
static int failures = 0;
static long checks = 0;

// A failed check prints one line (written at once, so ranks' lines do not interleave); after
// 20 a rank stays quiet and only counts.
#define CHECK(cond, ...)                                                                     \
    do {                                                                                     \
        checks++;                                                                            \
        if (!(cond) && ++failures <= 20) {                                                   \
            char line_[512];                                                                 \
            int at_ = snprintf(line_, sizeof(line_), "FAIL [rank %d] %s:%d: ",               \
                               comm.world_rank, __FILE__, __LINE__);                         \
            snprintf(line_ + at_, sizeof(line_) - at_, __VA_ARGS__);                         \
            fprintf(stderr, "%s\n", line_);                                                  \
        }                                                                                    \
    } while (0)

// ------------------------------------------------------------------------------------------
// data

static uint64_t mix64(uint64_t x) {      // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Element i of world rank `rank`'s data for test `seed`: sign * 1.m * 2^e, e in [-span, span].
static float gen_span(uint64_t seed, int rank, size_t i, int span) {
    uint64_t h = mix64(mix64(mix64(seed) ^ (uint64_t)rank) ^ (uint64_t)i);
    uint32_t mantissa = (uint32_t)(h & 0x7fffff);
    int e = (int)((h >> 23) % (uint64_t)(2 * span + 1)) - span;
    uint32_t sign = (uint32_t)(h >> 63);
    return canon_bits_to_float((sign << 31) | ((uint32_t)(127 + e) << 23) | mantissa);
}

static float gen(uint64_t seed, int rank, size_t i) { return gen_span(seed, rank, i, 20); }

static void fill(float* x, size_t n, uint64_t seed, int rank) {
    for (size_t i = 0; i < n; i++) { x[i] = gen(seed, rank, i); }
}

// R1 from its definition: split at ceil(n/2), sum each half, add.
static float ref_tree(const float* leaf, int n) {
    if (n == 1) { return leaf[0]; }
    int mid = (n + 1) / 2;
    return ref_tree(leaf, mid) + ref_tree(leaf + mid, n - mid);
}

// Compares bits; reports the first differing element.
static void check_bits(const float* got, const float* want, size_t n, const char* what) {
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++) {
        if (canon_float_to_bits(got[i]) != canon_float_to_bits(want[i])) { bad = i; }
    }
    CHECK(bad == n, "%s: element %zu of %zu is %a (0x%08x), expected %a (0x%08x)", what, bad, n,
          bad < n ? got[bad] : 0.0f, bad < n ? canon_float_to_bits(got[bad]) : 0,
          bad < n ? want[bad] : 0.0f, bad < n ? canon_float_to_bits(want[bad]) : 0);
}

static float* alloc_floats(size_t n) { return (float*)malloc_or_die((n ? n : 1) * sizeof(float), "test"); }

// A group under test: its communicator and the world ranks of its members, in group order.
typedef struct {
    CommGroup* g;
    int members[64];
    const char* name;
} Group;

// Expected reduce-scatter result for this rank: element i of block `block` summed over members.
static void ref_reduce(const Group* G, uint64_t seed, size_t stride_n, size_t block, size_t n, float* out) {
    float leaf[64];
    for (size_t i = 0; i < n; i++) {
        for (int j = 0; j < G->g->size; j++) { leaf[j] = gen(seed, G->members[j], block * stride_n + i); }
        out[i] = ref_tree(leaf, G->g->size);
    }
}

// ------------------------------------------------------------------------------------------
// collectives against the reference

static void test_reduce_scatter(const Group* G, size_t n, uint64_t seed) {
    CommGroup* g = G->g;
    size_t total = (size_t)g->size * n;
    float* send = alloc_floats(total);
    float* recv = alloc_floats(n);
    float* want = alloc_floats(n);
    char what[160];
    fill(send, total, seed, comm.world_rank);
    ref_reduce(G, seed, n, g->rank, n, want);

    snprintf(what, sizeof(what), "%s reduce-scatter n=%zu piece=%zu", G->name, n, comm_piece_floats);
    comm_reduce_scatter(g, send, recv, n, COMM_KIND_GRAD);
    check_bits(recv, want, n, what);

    // in place: the result lands in this rank's own block of the send buffer
    snprintf(what, sizeof(what), "%s reduce-scatter in place n=%zu piece=%zu", G->name, n, comm_piece_floats);
    comm_reduce_scatter(g, send, send + (size_t)g->rank * n, n, COMM_KIND_GRAD);
    check_bits(send + (size_t)g->rank * n, want, n, what);

    // The test can fail: other orders of the same sum give other bits for this data. With 2
    // ranks every order is the same (a+b == b+a); from 3 the reverse order differs, from 4 the
    // left-to-right order differs too (R1 for 3 leaves is (l0+l1)+l2, left to right).
    if (g->size >= 3 && n >= 1000) {
        size_t reverse_differs = 0, naive_differs = 0;
        for (size_t i = 0; i < n; i++) {
            float rev = 0.0f, naive = 0.0f;
            for (int j = g->size - 1; j >= 0; j--) { rev += gen(seed, G->members[j], (size_t)g->rank * n + i); }
            for (int j = 0; j < g->size; j++) { naive += gen(seed, G->members[j], (size_t)g->rank * n + i); }
            reverse_differs += canon_float_to_bits(rev) != canon_float_to_bits(want[i]);
            naive_differs += canon_float_to_bits(naive) != canon_float_to_bits(want[i]);
        }
        CHECK(reverse_differs > 0, "%s: data too tame: reverse-order sums equal the tree", what);
        CHECK(g->size < 4 || naive_differs > 0, "%s: data too tame: left-to-right sums equal the tree", what);
    }
    free(send);
    free(recv);
    free(want);
}

static void test_all_gather(const Group* G, size_t n, uint64_t seed) {
    CommGroup* g = G->g;
    size_t total = (size_t)g->size * n;
    float* send = alloc_floats(n);
    float* recv = alloc_floats(total);
    float* want = alloc_floats(total);
    char what[160];
    fill(send, n, seed, comm.world_rank);
    for (int j = 0; j < g->size; j++) { fill(want + (size_t)j * n, n, seed, G->members[j]); }

    snprintf(what, sizeof(what), "%s all-gather n=%zu piece=%zu", G->name, n, comm_piece_floats);
    memset(recv, 0xff, total * sizeof(float));
    comm_all_gather(g, send, recv, n, COMM_KIND_PARAM);
    check_bits(recv, want, total, what);

    // in place: this rank's block is already in the receive buffer
    snprintf(what, sizeof(what), "%s all-gather in place n=%zu piece=%zu", G->name, n, comm_piece_floats);
    memset(recv, 0xff, total * sizeof(float));
    memcpy(recv + (size_t)g->rank * n, send, n * sizeof(float));
    comm_all_gather(g, recv + (size_t)g->rank * n, recv, n, COMM_KIND_PARAM);
    check_bits(recv, want, total, what);
    free(send);
    free(recv);
    free(want);
}

static void test_all_reduce(const Group* G, size_t n, uint64_t seed) {
    float* buf = alloc_floats(n);
    float* want = alloc_floats(n);
    char what[160];
    fill(buf, n, seed, comm.world_rank);
    ref_reduce(G, seed, 0, 0, n, want);
    snprintf(what, sizeof(what), "%s all-reduce n=%zu piece=%zu", G->name, n, comm_piece_floats);
    comm_all_reduce_sum(G->g, buf, n, COMM_KIND_GRAD);
    check_bits(buf, want, n, what);
    free(buf);
    free(want);
}

// Several non-blocking collectives in flight at once, waited for in reverse order.
static void test_nonblocking(const Group* G, size_t n) {
    enum { NRS = 3, NAR = 2 };
    CommGroup* g = G->g;
    size_t total = (size_t)g->size * n;
    float* rs_send[NRS]; float* rs_recv[NRS]; float* rs_want[NRS];
    float* ar_buf[NAR]; float* ar_want[NAR];
    float* ag_recv = alloc_floats(total);
    float* ag_want = alloc_floats(total);
    float* ag_send = alloc_floats(n);
    CommRequest* reqs[NRS + NAR + 1];
    int nreq = 0;
    char what[160];
    for (int k = 0; k < NRS; k++) {
        rs_send[k] = alloc_floats(total);
        rs_recv[k] = alloc_floats(n);
        rs_want[k] = alloc_floats(n);
        fill(rs_send[k], total, 100 + k, comm.world_rank);
        ref_reduce(G, 100 + k, n, g->rank, n, rs_want[k]);
        reqs[nreq++] = comm_reduce_scatter_start(g, rs_send[k], rs_recv[k], n, COMM_KIND_GRAD);
    }
    fill(ag_send, n, 200, comm.world_rank);
    for (int j = 0; j < g->size; j++) { fill(ag_want + (size_t)j * n, n, 200, G->members[j]); }
    reqs[nreq++] = comm_all_gather_start(g, ag_send, ag_recv, n, COMM_KIND_PARAM);
    for (int k = 0; k < NAR; k++) {
        size_t m = n + k;                 // one of them not a multiple of the group size
        ar_buf[k] = alloc_floats(m);
        ar_want[k] = alloc_floats(m);
        fill(ar_buf[k], m, 300 + k, comm.world_rank);
        ref_reduce(G, 300 + k, 0, 0, m, ar_want[k]);
        reqs[nreq++] = comm_all_reduce_sum_start(g, ar_buf[k], m, COMM_KIND_GRAD);
    }
    for (int spin = 0; spin < 3; spin++) {
        for (int k = 0; k < nreq; k++) { comm_test(reqs[k]); }
    }
    for (int k = nreq - 1; k >= 0; k--) { comm_wait(reqs[k]); }

    for (int k = 0; k < NRS; k++) {
        snprintf(what, sizeof(what), "%s reduce-scatter start/wait #%d n=%zu piece=%zu", G->name, k, n, comm_piece_floats);
        check_bits(rs_recv[k], rs_want[k], n, what);
        free(rs_send[k]); free(rs_recv[k]); free(rs_want[k]);
    }
    snprintf(what, sizeof(what), "%s all-gather start/wait n=%zu piece=%zu", G->name, n, comm_piece_floats);
    check_bits(ag_recv, ag_want, total, what);
    for (int k = 0; k < NAR; k++) {
        snprintf(what, sizeof(what), "%s all-reduce start/wait #%d n=%zu piece=%zu", G->name, k, n + k, comm_piece_floats);
        check_bits(ar_buf[k], ar_want[k], n + k, what);
        free(ar_buf[k]); free(ar_want[k]);
    }
    free(ag_recv); free(ag_want); free(ag_send);
}

// Max: exact in any order; a NaN anywhere gives the canonical NaN, +0 beats -0.
static float ref_max_input(int rank, int size, size_t i) {
    if (i == 0) { return rank == size - 1 ? 0.0f : -0.0f; }                  // one +0 among -0
    if (i == 1) { return -0.0f; }                                              // all -0
    if (i == 2 && rank == size / 2) { return canon_bits_to_float(0xffc01234u); }  // a NaN, payload
    return gen(400, rank, i);
}

static void test_max(const Group* G, size_t n) {
    CommGroup* g = G->g;
    float* buf = alloc_floats(n);
    float* want = alloc_floats(n);
    char what[160];
    for (size_t i = 0; i < n; i++) {
        buf[i] = ref_max_input(comm.world_rank, comm.world_size, i);
        float m = ref_max_input(G->members[0], comm.world_size, i);
        int nan = m != m;
        for (int j = 1; j < g->size; j++) {
            float v = ref_max_input(G->members[j], comm.world_size, i);
            nan |= v != v;
            if (v > m || (v == 0.0f && m == 0.0f && !(canon_float_to_bits(v) >> 31))) { m = v; }
        }
        want[i] = nan ? canon_bits_to_float(0x7fc00000u) : m;
    }
    snprintf(what, sizeof(what), "%s all-reduce max n=%zu piece=%zu", G->name, n, comm_piece_floats);
    comm_all_reduce_max(g, buf, n, COMM_KIND_OTHER);
    check_bits(buf, want, n, what);
    free(buf);
    free(want);
}

// SumSq: the exact sum of squares. Values 1.m * 2^e with |e| <= 10: every square and every
// partial sum fits the 113-bit significand of __float128 exactly, so the reference is exact.
static void test_sumsq(const Group* G, size_t n) {
    CommGroup* g = G->g;
    SumSq s, all;
    canon_sumsq_init(&s);
    canon_sumsq_init(&all);
    __float128 exact = 0;
    for (int j = 0; j < g->size; j++) {
        for (size_t i = 0; i < n; i++) {
            float x = gen_span(500, G->members[j], i, 10);
            if (G->members[j] == comm.world_rank) { canon_sumsq_add(&s, x); }
            canon_sumsq_add(&all, x);
            exact += (__float128)x * (__float128)x;
        }
    }
    comm_all_reduce_sumsq(g, &s, COMM_KIND_OTHER);
    canon_sumsq_normalize(&all);
    CHECK(memcmp(s.digit, all.digit, sizeof(s.digit)) == 0 && s.nonfinite == 0,
          "%s sumsq n=%zu: digits differ from the local exact sum over all members", G->name, n);
    double got = canon_sumsq_value(&s), want = (double)exact;
    CHECK(got == want, "%s sumsq n=%zu: %.17g, exact sum rounded %.17g", G->name, n, got, want);

    // one rank's infinity makes every rank's norm NaN
    canon_sumsq_init(&s);
    canon_sumsq_add(&s, 3.0f);
    if (g->rank == g->size - 1) { canon_sumsq_add(&s, canon_inf()); }
    comm_all_reduce_sumsq(g, &s, COMM_KIND_OTHER);
    double v = canon_sumsq_value(&s);
    CHECK(s.nonfinite == 1 && v != v, "%s sumsq: an infinity on one rank gave nonfinite=%llu value %g",
          G->name, (unsigned long long)s.nonfinite, v);
}

static void test_broadcast(const Group* G, size_t n) {
    CommGroup* g = G->g;
    float* buf = alloc_floats(n);
    float* want = alloc_floats(n);
    char what[160];
    for (int root = 0; root < g->size; root += (g->size > 1 ? g->size - 1 : 1)) {
        fill(want, n, 600 + root, G->members[root]);
        if (g->rank == root) { memcpy(buf, want, n * sizeof(float)); } else { memset(buf, 0xff, n * sizeof(float)); }
        comm_broadcast(g, buf, n * sizeof(float), root, COMM_KIND_OTHER);
        snprintf(what, sizeof(what), "%s broadcast from %d n=%zu piece=%zu", G->name, root, n, comm_piece_floats);
        check_bits(buf, want, n, what);
    }
    free(buf);
    free(want);
}

// Point to point around the ring of the group: two messages with different tags in flight
// each way, the receives posted in the opposite order to the sends.
static void test_ring(const Group* G, size_t n) {
#ifdef USE_MPI
    CommGroup* g = G->g;
    int next = (g->rank + 1) % g->size, prev = (g->rank + g->size - 1) % g->size;
    float* out[2]; float* in[2]; float* want[2];
    CommRequest* reqs[4];
    char what[160];
    for (int t = 0; t < 2; t++) {
        out[t] = alloc_floats(n); in[t] = alloc_floats(n); want[t] = alloc_floats(n);
        fill(out[t], n, 700 + t, comm.world_rank);
        fill(want[t], n, 700 + t, G->members[prev]);
        memset(in[t], 0xff, n * sizeof(float));
    }
    reqs[0] = comm_irecv(g, in[1], n, prev, 11, COMM_KIND_PP);
    reqs[1] = comm_irecv(g, in[0], n, prev, 10, COMM_KIND_PP);
    reqs[2] = comm_isend(g, out[0], n, next, 10, COMM_KIND_PP);
    reqs[3] = comm_isend(g, out[1], n, next, 11, COMM_KIND_PP);
    comm_wait_all(reqs, 4);
    for (int t = 0; t < 2; t++) {
        snprintf(what, sizeof(what), "%s ring isend/irecv tag %d n=%zu piece=%zu", G->name, 10 + t, n, comm_piece_floats);
        check_bits(in[t], want[t], n, what);
    }
    // the blocking exchange, the other way round
    memset(in[0], 0xff, n * sizeof(float));
    fill(want[0], n, 700, G->members[next]);
    comm_sendrecv(g, out[0], n, prev, in[0], n, next, 12, COMM_KIND_PP);
    snprintf(what, sizeof(what), "%s ring sendrecv n=%zu piece=%zu", G->name, n, comm_piece_floats);
    check_bits(in[0], want[0], n, what);
    for (int t = 0; t < 2; t++) { free(out[t]); free(in[t]); free(want[t]); }
#else
    (void)G; (void)n;
#endif
    // a missing neighbour is no communication at all
    CHECK(comm_isend(G->g, NULL, n, COMM_NO_PEER, 0, COMM_KIND_PP) == NULL, "isend to COMM_NO_PEER");
    CHECK(comm_irecv(G->g, NULL, n, COMM_NO_PEER, 0, COMM_KIND_PP) == NULL, "irecv from COMM_NO_PEER");
}

// big: also a message large enough for Open MPI to pick its bandwidth algorithms (ring,
// Rabenseifner), whose MPI_SUM order differs from R1 even for 4 or 8 ranks.
// all-to-all: block d of rank r's send (seed + d) goes to rank d; block s of the receive buffer
// is rank s's block for this rank
static void test_all_to_all(const Group* G, size_t n, uint64_t seed) {
    CommGroup* g = G->g;
    size_t total = (size_t)g->size * n;
    float* send = alloc_floats(total);
    float* recv = alloc_floats(total);
    float* want = alloc_floats(total);
    for (int d = 0; d < g->size; d++) { fill(send + (size_t)d * n, n, seed + d, comm.world_rank); }
    for (int s = 0; s < g->size; s++) { fill(want + (size_t)s * n, n, seed + g->rank, G->members[s]); }
    char what[160];
    snprintf(what, sizeof(what), "%s all-to-all n=%zu piece=%zu", G->name, n, comm_piece_floats);
    memset(recv, 0xff, total * sizeof(float));
    comm_all_to_all(g, send, recv, n, COMM_KIND_CP);
    check_bits(recv, want, total, what);
    free(send);
    free(recv);
    free(want);
}

static void test_group(const Group* G, int full, size_t big) {
    static const size_t sizes[] = { 0, 1, 3, 17, 1000, 4099 };
    int nsizes = full ? 6 : 4;
    if (big) {
        test_reduce_scatter(G, big, 10);
        test_all_gather(G, big, 60);
        test_all_reduce(G, big, 90);
    }
    for (int k = 0; k < nsizes; k++) {
        size_t n = sizes[k];
        test_reduce_scatter(G, n, 1 + k);
        test_all_gather(G, n, 50 + k);
        test_all_reduce(G, n, 80 + k);
        test_max(G, n);
        test_broadcast(G, n);
        test_ring(G, n);
        test_all_to_all(G, n, 700 + 16 * k);
    }
    test_nonblocking(G, full ? 1000 : 17);
    test_sumsq(G, 1000);
    comm_barrier(G->g);
}

// ------------------------------------------------------------------------------------------
// byte and call counters: the formulas of comm_print_stats, written out again here

static void test_counters(void) {
    CommGroup* g = &comm.world;
    uint64_t s = (uint64_t)g->size, me = (uint64_t)g->rank;
    size_t n = 10;
    float* big = alloc_floats(s * n);
    float* small = alloc_floats(n);
    fill(big, s * n, 900, comm.world_rank);
    fill(small, n, 901, comm.world_rank);
    SumSq sq;
    canon_sumsq_init(&sq);
    uint64_t want_bytes[COMM_KIND_COUNT] = { 0 }, want_calls[COMM_KIND_COUNT] = { 0 };
    uint64_t ar10 = 2 * (s - 1) * ((10 + s - 1) / s) * 4;    // ring all-reduce, padded
    comm_reset_stats(&comm);

    comm_reduce_scatter(g, big, small, n, COMM_KIND_GRAD);
    want_bytes[COMM_KIND_GRAD] += (s - 1) * n * 4; want_calls[COMM_KIND_GRAD]++;
    comm_all_gather(g, small, big, n, COMM_KIND_PARAM);
    want_bytes[COMM_KIND_PARAM] += (s - 1) * n * 4; want_calls[COMM_KIND_PARAM]++;
    comm_all_reduce_sum(g, small, 10, COMM_KIND_GRAD);
    want_bytes[COMM_KIND_GRAD] += ar10; want_calls[COMM_KIND_GRAD]++;
    comm_wait(comm_reduce_scatter_start(g, big, small, n, COMM_KIND_GRAD));
    want_bytes[COMM_KIND_GRAD] += (s - 1) * n * 4; want_calls[COMM_KIND_GRAD]++;
    comm_wait(comm_all_gather_start(g, small, big, n, COMM_KIND_PARAM));
    want_bytes[COMM_KIND_PARAM] += (s - 1) * n * 4; want_calls[COMM_KIND_PARAM]++;
    comm_wait(comm_all_reduce_sum_start(g, small, 10, COMM_KIND_GRAD));
    want_bytes[COMM_KIND_GRAD] += ar10; want_calls[COMM_KIND_GRAD]++;
    comm_all_reduce_max(g, small, 10, COMM_KIND_TP);
    want_bytes[COMM_KIND_TP] += ar10; want_calls[COMM_KIND_TP]++;
    comm_all_reduce_sumsq(g, &sq, COMM_KIND_OTHER);
    want_bytes[COMM_KIND_OTHER] += 2 * (s - 1) * ((19 + s - 1) / s) * 8; want_calls[COMM_KIND_OTHER]++;
    comm_broadcast(g, small, 40, 0, COMM_KIND_OTHER);        // a chain 0 -> 1 -> ... -> s-1
    want_bytes[COMM_KIND_OTHER] += me == s - 1 ? 0 : 40; want_calls[COMM_KIND_OTHER]++;
    comm_barrier(g);
    want_calls[COMM_KIND_OTHER]++;
#ifdef USE_MPI
    comm_sendrecv(g, big, 7, (int)((me + 1) % s), small, 7, (int)((me + s - 1) % s), 3, COMM_KIND_PP);
    want_bytes[COMM_KIND_PP] += 7 * 4; want_calls[COMM_KIND_PP] += 2;   // a send and a receive
#endif
    for (int k = 0; k < COMM_KIND_COUNT; k++) {
        CHECK(comm.stats.bytes[k] == want_bytes[k], "counter %s: %llu bytes, expected %llu", comm_kind_name[k],
              (unsigned long long)comm.stats.bytes[k], (unsigned long long)want_bytes[k]);
        CHECK(comm.stats.calls[k] == want_calls[k], "counter %s: %llu calls, expected %llu", comm_kind_name[k],
              (unsigned long long)comm.stats.calls[k], (unsigned long long)want_calls[k]);
    }
    if (comm.world_rank == 0) { comm_print_stats(&comm, stdout); }
    comm_reset_stats(&comm);
    for (int k = 0; k < COMM_KIND_COUNT; k++) {
        CHECK(comm.stats.bytes[k] == 0 && comm.stats.calls[k] == 0, "counters not reset");
    }
    free(big);
    free(small);
}

// ------------------------------------------------------------------------------------------
// the grid

// Each group's members, gathered over the group itself, must be exactly the ranks whose other
// two coordinates equal ours, in order of the group's own coordinate.
static void check_members(CommGroup* g, int expect_size, int expect_rank, int (*member)(int j), const char* name) {
    CHECK(g->size == expect_size, "%s group size %d, expected %d", name, g->size, expect_size);
    CHECK(g->rank == expect_rank, "%s group rank %d, expected %d", name, g->rank, expect_rank);
    if (g->size != expect_size) { return; }
    float me = (float)comm.world_rank;
    float* all = alloc_floats(g->size);
    comm_all_gather(g, &me, all, 1, COMM_KIND_OTHER);
    for (int j = 0; j < g->size; j++) {
        CHECK(all[j] == (float)member(j), "%s group member %d is world rank %g, expected %d", name, j, all[j], member(j));
    }
    free(all);
}

static int dp_member(int j) { return comm_grid_world_rank(&comm, j, comm.tp_rank, comm.pp_rank); }
static int tp_member(int j) { return comm_grid_world_rank(&comm, comm.dp_rank, j, comm.pp_rank); }
static int pp_member(int j) { return comm_grid_world_rank(&comm, comm.dp_rank, comm.tp_rank, j); }

static int cp_member(int j) { return comm_grid_world_rank_cp(&comm, comm.dp_rank, j, comm.tp_rank, comm.pp_rank); }

// FlexSP's pool: for each power-of-two size g dividing the dp x cp ranks, this rank's group is
// the aligned block of g consecutive pool ranks (pool rank dp_rank * cp + cp_rank) holding it,
// ranked within the block; the collectives over it sum exactly its members (every block runs
// its own at once).
static int pool_block_size;
static int pool_member(int j) {
    int r = comm.dp_rank * comm.cp + comm.cp_rank, q = r - r % pool_block_size + j;
    return comm_grid_world_rank_cp(&comm, q / comm.cp, q % comm.cp, comm.tp_rank, comm.pp_rank);
}
static void test_pool_groups(void) {
    comm_setup_pool_groups(&comm);
    int P = comm.dp * comm.cp, r = comm.dp_rank * comm.cp + comm.cp_rank, levels = 0;
    for (int g = 1; g <= P && P % g == 0; g *= 2) { levels++; }
    CHECK(comm.pool_levels == levels, "pool of %d: %d levels of sub-groups, expected %d", P, comm.pool_levels, levels);
    for (int k = 0; k < comm.pool_levels; k++) {
        pool_block_size = 1 << k;
        check_members(&comm.pool_groups[k], pool_block_size, r % pool_block_size, pool_member, "pool");
        Group G;
        G.g = &comm.pool_groups[k]; G.name = "pool";
        for (int j = 0; j < pool_block_size; j++) { G.members[j] = pool_member(j); }
        test_group(&G, 0, 0);
    }
}

// The 4-D grid: world rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank (Megatron's
// order: tensor fastest, then context, data, pipeline), each group the ranks that differ from
// this one in its coordinate only.
static void test_grid_cp(int tp, int cp, int pp) {
    comm_setup_grid_cp(&comm, tp, cp, pp);
    int w = comm.world_rank, dp = comm.world_size / (tp * cp * pp);
    CHECK(comm.cp == cp && comm.dp == dp, "grid (tp %d, cp %d, pp %d): cp %d dp %d", tp, cp, pp, comm.cp, comm.dp);
    CHECK(w == ((comm.pp_rank * dp + comm.dp_rank) * cp + comm.cp_rank) * tp + comm.tp_rank,
          "grid (tp %d, cp %d, pp %d): world rank %d is not at (pp %d, dp %d, cp %d, tp %d)", tp, cp, pp, w,
          comm.pp_rank, comm.dp_rank, comm.cp_rank, comm.tp_rank);
    check_members(&comm.dp_group, dp, comm.dp_rank, dp_member, "dp");
    check_members(&comm.cp_group, cp, comm.cp_rank, cp_member, "cp");
    check_members(&comm.tp_group, tp, comm.tp_rank, tp_member, "tp");
    check_members(&comm.pp_group, pp, comm.pp_rank, pp_member, "pp");
    Group G;
    G.g = &comm.cp_group; G.name = "cp";
    for (int j = 0; j < comm.cp; j++) { G.members[j] = cp_member(j); }
    test_group(&G, 0, 0);
    test_pool_groups();
}

static void test_grid(int tp, int pp) {
    comm_setup_grid(&comm, tp, pp);
    int w = comm.world_rank, dp = comm.world_size / (tp * pp);
    CHECK(comm.tp == tp && comm.pp == pp && comm.dp == dp, "grid (tp %d, pp %d): sizes dp %d tp %d pp %d",
          tp, pp, comm.dp, comm.tp, comm.pp);
    CHECK(w == (comm.pp_rank * dp + comm.dp_rank) * tp + comm.tp_rank,
          "grid (tp %d, pp %d): world rank %d != (pp %d * dp %d + dp %d) * tp %d + tp %d",
          tp, pp, w, comm.pp_rank, dp, comm.dp_rank, tp, comm.tp_rank);
    CHECK(comm.tp_rank < tp && comm.dp_rank < dp && comm.pp_rank < pp, "grid coordinates out of range");
    CHECK(comm_grid_world_rank(&comm, comm.dp_rank, comm.tp_rank, comm.pp_rank) == w, "comm_grid_world_rank");
    check_members(&comm.dp_group, dp, comm.dp_rank, dp_member, "dp");
    check_members(&comm.tp_group, tp, comm.tp_rank, tp_member, "tp");
    check_members(&comm.pp_group, pp, comm.pp_rank, pp_member, "pp");

    // pipeline neighbours: send our world rank down the pipeline, and back up
    int prev, next;
    comm_pp_neighbours(&comm, &prev, &next);
    CHECK(prev == (comm.pp_rank > 0 ? comm.pp_rank - 1 : COMM_NO_PEER), "pp prev %d at stage %d", prev, comm.pp_rank);
    CHECK(next == (comm.pp_rank < pp - 1 ? comm.pp_rank + 1 : COMM_NO_PEER), "pp next %d at stage %d", next, comm.pp_rank);
#ifdef USE_MPI
    float me = (float)w, from_prev = -1.0f, from_next = -1.0f;
    comm_sendrecv(&comm.pp_group, &me, 1, next, &from_prev, 1, prev, 1, COMM_KIND_PP);
    comm_sendrecv(&comm.pp_group, &me, 1, prev, &from_next, 1, next, 2, COMM_KIND_PP);
    CHECK(from_prev == (prev == COMM_NO_PEER ? -1.0f : (float)pp_member(prev)), "pp activation from prev: %g", from_prev);
    CHECK(from_next == (next == COMM_NO_PEER ? -1.0f : (float)pp_member(next)), "pp gradient from next: %g", from_next);
#endif

    // the collectives over each group of the grid (a shorter list of sizes)
    Group G;
    G.g = &comm.dp_group; G.name = "dp";
    for (int j = 0; j < comm.dp; j++) { G.members[j] = dp_member(j); }
    test_group(&G, 0, 0);
    G.g = &comm.tp_group; G.name = "tp";
    for (int j = 0; j < comm.tp; j++) { G.members[j] = tp_member(j); }
    test_group(&G, 0, 0);
    G.g = &comm.pp_group; G.name = "pp";
    for (int j = 0; j < comm.pp; j++) { G.members[j] = pp_member(j); }
    test_group(&G, 0, 0);
    test_pool_groups();
}

// ------------------------------------------------------------------------------------------

static void sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    nanosleep(&ts, NULL);
}

int main(int argc, char** argv) {
    comm_init(&comm, &argc, &argv);

    if (argc == 4 && strcmp(argv[1], "--grid") == 0) {
        comm_setup_grid(&comm, atoi(argv[2]), atoi(argv[3]));
        comm_finalize(&comm);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "--fault") == 0) {
        float x[4] = { 1, 2, 3, 4 };
        if (strcmp(argv[2], "fatal") == 0 && comm.world_rank == 1) {
            sleep_ms(300);                          // the others are in the barrier by now
            fatal("deliberate test failure on rank 1 (test_comm --fault fatal)");
        }
        if (strcmp(argv[2], "kill") == 0 && comm.world_rank == 2) {
            sleep_ms(300);
            raise(SIGKILL);
        }
        comm_barrier(&comm.world);
        comm_all_reduce_sum(&comm.world, x, 4, COMM_KIND_OTHER);
        fprintf(stderr, "rank %d: the collective returned although a rank died\n", comm.world_rank);
        comm_finalize(&comm);
        return 2;
    }
    if (argc != 1) { fatal("usage: test_comm [--grid TP PP | --fault fatal|kill]"); }
    if (comm.world_size > 64) { fatal("test_comm checks at most 64 ranks"); }

    Group world;
    world.g = &comm.world;
    world.name = "world";
    for (int j = 0; j < comm.world_size; j++) { world.members[j] = j; }

    // every collective twice: whole messages, then split into pieces of 7 floats (as buffers
    // over COMM_PIECE_FLOATS are), so the piecewise datatypes and requests are exercised
    test_group(&world, 1, 300001);
    comm_piece_floats = 7;
    test_group(&world, 1, 0);
    comm_piece_floats = COMM_PIECE_FLOATS;
    test_counters();

    // grids: every (tp, pp) of the list whose product divides the world size
    static const int grids[][2] = { {1, 1}, {2, 1}, {2, 2}, {1, 2}, {4, 2}, {2, 4}, {4, 1}, {1, 4}, {8, 1}, {1, 8} };
    int ngrids = 0;
    for (int k = 0; k < (int)(sizeof(grids) / sizeof(grids[0])); k++) {
        if (comm.world_size % (grids[k][0] * grids[k][1]) == 0) {
            test_grid(grids[k][0], grids[k][1]);
            ngrids++;
        }
    }
    // with a context-parallel dimension: every (tp, cp, pp) of the list dividing the world
    static const int grids_cp[][3] = { {1, 2, 1}, {2, 2, 1}, {1, 2, 2}, {2, 2, 2}, {1, 4, 1}, {1, 8, 1} };
    for (int k = 0; k < (int)(sizeof(grids_cp) / sizeof(grids_cp[0])); k++) {
        if (comm.world_size % (grids_cp[k][0] * grids_cp[k][1] * grids_cp[k][2]) == 0) {
            test_grid_cp(grids_cp[k][0], grids_cp[k][1], grids_cp[k][2]);
            ngrids++;
        }
    }
    comm_setup_grid(&comm, 1, 1);

    // every rank learns whether any rank failed (max is exact), so all exit alike
    float failed = (float)failures;
    comm_all_reduce_max(&comm.world, &failed, 1, COMM_KIND_OTHER);
    if (comm.world_rank == 0) {
        printf("test_comm: %d rank%s%s, %d grids, %ld checks on rank 0: %s\n", comm.world_size,
               comm.world_size > 1 ? "s" : "",
#ifdef USE_MPI
               "",
#else
               " (built without MPI)",
#endif
               ngrids, checks, failed > 0 ? "FAILED" : "all passed");
    }
    comm_finalize(&comm);
    return failed > 0 ? 1 : 0;
}
