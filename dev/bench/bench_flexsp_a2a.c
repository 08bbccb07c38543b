// FlexSP's all-to-all bandwidth by group size, measured on this machine (make bench-flexsp; a
// table, not a test). On P ranks, for each group size g = 2, 4, ... dividing P, every one of
// the pool's aligned sub-groups of g ranks (comm.h comm_setup_pool_groups: the communicators
// a FlexSP plan runs its groups over) runs the all-to-all of context parallelism's a2a mode
// (comm_all_to_all) at once, as a plan's groups run side by side. A rank's buffer is MIB MiB:
// n floats to each of the g members. The bandwidth is what varlen_flexsp.h's bw[] models
// (FlexSP's GB/s by group size): a rank's buffer bytes over the time of one all-to-all, the
// slowest rank's, the median of REPS timed rounds (each ITERS all-to-alls, after one warm-up).
// Usage: bench_flexsp_a2a [MIB] [REPS] [ITERS] (default 4 5 4), on P ranks (dev/test/mpi.sh P).
#include <stdio.h>
#include <stdlib.h>
#include "llmc/comm.h"
#include "llmc/utils.h"

static int compare_doubles(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

int main(int argc, char** argv) {
    Comm comm;
    comm_init(&comm, &argc, &argv);
    double mib = argc > 1 ? atof(argv[1]) : 4.0;
    int reps = argc > 2 ? atoi(argv[2]) : 5, iters = argc > 3 ? atoi(argv[3]) : 4;
    if (mib <= 0 || reps < 1 || reps > 99 || iters < 1) { fatal("usage: bench_flexsp_a2a [MIB > 0] [REPS 1-99] [ITERS >= 1]"); }
    comm_setup_grid_cp(&comm, 1, 1, 1);
    comm_setup_pool_groups(&comm);
    int P = comm.world_size;
    size_t total = (size_t)(mib * 1048576.0 / sizeof(float));
    float* send = (float*)malloc_or_die(total * sizeof(float) + 64, "all-to-all buffers");
    float* recv = (float*)malloc_or_die(total * sizeof(float) + 64, "all-to-all buffers");
    for (size_t i = 0; i < total; i++) { send[i] = (float)(i % 1000); }
    if (comm.world_rank == 0) {
        printf("all-to-all per group size: %d ranks, %.1f MiB per rank, every sub-group of g ranks at once, "
               "median of %d rounds of %d\n%-6s %8s %12s %12s\n", P, mib, reps, iters, "g", "groups", "ms", "GB/s");
    }
    for (int k = 1; k < comm.pool_levels; k++) {
        CommGroup* g = &comm.pool_groups[k];
        size_t n = total / (size_t)g->size;
        double ms[99];
        comm_all_to_all(g, send, recv, n, COMM_KIND_CP);   // warm-up: connections, pages
        for (int r = 0; r < reps; r++) {
            comm_barrier(&comm.world);
            double t0 = now_seconds();
            for (int i = 0; i < iters; i++) { comm_all_to_all(g, send, recv, n, COMM_KIND_CP); }
            float took = (float)((now_seconds() - t0) * 1e3 / iters);
            // all-reduce max (world): the slowest rank's time
            comm_all_reduce_max(&comm.world, &took, 1, COMM_KIND_OTHER);
            ms[r] = took;
        }
        qsort(ms, (size_t)reps, sizeof(double), compare_doubles);
        double median = ms[reps / 2];
        if (comm.world_rank == 0) {
            printf("%-6d %8d %12.3f %12.3f\n", g->size, P / g->size, median, (double)g->size * n * sizeof(float) / (median * 1e6));
        }
    }
    free(send);
    free(recv);
    comm_finalize(&comm);
    return 0;
}
