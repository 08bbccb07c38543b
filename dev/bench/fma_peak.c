/*
 * fma_peak.c: this machine's fused multiply-add peak in GFLOP/s (the denominator of the
 * benchmark's "% of peak"): 12 independent accumulators per thread in vector registers, no
 * memory traffic, the widest vectors the build targets (AVX-512, AVX2 or scalar), on every
 * OpenMP thread at once. Prints one number; the median of 5 runs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/simd.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static double run_once(long iters) {
    double t0 = now();
    float sink = 0.0f;
    #pragma omp parallel reduction(+:sink)
    {
        vf x = vf_set1(0.999f), y = vf_set1(1e-4f);
        vf a0 = vf_set1(0.1f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        vf a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
        for (long i = 0; i < iters; i++) {
            a0 = vf_fma(a0, x, y); a1 = vf_fma(a1, x, y); a2 = vf_fma(a2, x, y); a3 = vf_fma(a3, x, y);
            a4 = vf_fma(a4, x, y); a5 = vf_fma(a5, x, y); a6 = vf_fma(a6, x, y); a7 = vf_fma(a7, x, y);
            a8 = vf_fma(a8, x, y); a9 = vf_fma(a9, x, y); a10 = vf_fma(a10, x, y); a11 = vf_fma(a11, x, y);
        }
        vf s = vf_add(vf_add(vf_add(a0, a1), vf_add(a2, a3)), vf_add(vf_add(a4, a5), vf_add(a6, a7)));
        s = vf_add(s, vf_add(vf_add(a8, a9), vf_add(a10, a11)));
        float out[VLEN];
        vf_store(out, s);
        sink += out[0];
    }
    double dt = now() - t0;
    if (sink == 12345.0f) { printf("unlikely\n"); }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    return (double)iters * 12 * VLEN * 2 * threads / dt / 1e9;
}

int main(int argc, char** argv) {
    long iters = argc > 1 ? atol(argv[1]) : 50000000;
    double r[5];
    for (int i = 0; i < 5; i++) { r[i] = run_once(iters); }
    for (int i = 0; i < 5; i++) for (int j = i + 1; j < 5; j++) if (r[j] < r[i]) { double t = r[i]; r[i] = r[j]; r[j] = t; }
    printf("%.1f\n", r[2]);
    return 0;
}
