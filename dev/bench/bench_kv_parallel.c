/*
 * bench_kv_parallel.c: the time of one layer's decode attention under KV parallelism
 * (llmc/kv_parallel.h) on this machine, a table, not a test. Run under mpirun with P ranks (one
 * KVP group): N requests at a full context (every position of maxT = T in the cache), d12's
 * attention shape (C 768, 12 heads of 64), block size 16; the median over the repetitions of the
 * slowest rank's time per kvp_attention_decode, and the bytes each rank sent per step.
 *   dev/test/mpi.sh P build/bench_kv_parallel [T] [N] [reps]    (make bench-kvp: P = 1, 2, 4, 8)
 */
#include <time.h>
#include "llmc/kv_parallel.h"
#include "llmc/rand.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
    Comm comm;
    comm_init(&comm, &argc, &argv);
    comm_setup_grid_cp(&comm, 1, comm.world_size, 1);
    int T = argc > 1 ? atoi(argv[1]) : 1024, N = argc > 2 ? atoi(argv[2]) : 1, reps = argc > 3 ? atoi(argv[3]) : 20;
    const int C = 768, NH = 12, bs = 16;
    CommGroup* g = &comm.cp_group;
    KVPLayout lay;
    kvp_init(&lay, g->size, g->rank, 1, T, bs, C, NH, KVP_COMBINE_ALL_REDUCE);
    int max_blocks = T / bs;
    PagedKV kv;
    paged_kv_init(&kv, &memory_host, N * max_blocks / g->size, bs, 1, C);
    uint64_t seed = 7;
    float* q = (float*)malloc_or_die(sizeof(float) * (size_t)N * C, "bench q");
    float* k = (float*)malloc_or_die(sizeof(float) * 2 * C, "bench kv row");
    float* out = (float*)malloc_or_die(sizeof(float) * (size_t)N * C, "bench out");
    for (size_t i = 0; i < (size_t)N * C; i++) { q[i] = random_f32(&seed) - 0.5f; }
    int* tables = (int*)calloc((size_t)N * max_blocks, sizeof(int));
    int* pos = (int*)malloc(sizeof(int) * N);
    for (int r = 0; r < N; r++) {
        BlockTable bt = {0};
        pos[r] = T - 1;
        if (!kvp_reserve(&kv, &bt, &lay, T)) { fatal("bench: cache too small"); }
        for (int p = 0; p < T; p++) {
            for (int i = 0; i < 2 * C; i++) { k[i] = random_f32(&seed) - 0.5f; }
            kvp_store(&kv, &bt, &lay, 0, p, k, k + C);
        }
        memcpy(tables + (size_t)r * max_blocks, bt.blocks, sizeof(int) * bt.n);
        block_table_free(&bt);
    }
    double* times = (double*)malloc(sizeof(double) * reps);
    for (int i = 0; i < reps; i++) {
        comm_barrier(&comm.world);
        double t0 = now_s();
        kvp_attention_decode(&lay, g, out, q, C, kv.data, paged_kv_block_stride(&kv), tables, max_blocks, pos, N);
        float dt = (float)(now_s() - t0);
        comm_all_reduce_max(&comm.world, &dt, 1, COMM_KIND_OTHER);   // the slowest rank's
        times[i] = dt;
    }
    qsort(times, reps, sizeof(double), cmp_double);
    if (comm.world_rank == 0) {
        printf("%-4d %-6d %-4d %10.3f %12llu\n", g->size, T, N, times[reps / 2] * 1e3,
               (unsigned long long)kvp_step_bytes(&lay, N));
    }
    kvp_free(&lay);
    paged_kv_free(&kv);
    comm_finalize(&comm);
    return 0;
}
