/*
 * fma_peak.h: this machine's fused multiply-add peak in GFLOP/s, the denominator of every
 * "% of peak" the CPU build states (the benchmark's tables, the trainer's run summary):
 * FMA_PEAK_CHAINS independent accumulators per thread in vector registers (enough to cover the
 * FMA latency on every port, few enough to stay in registers), no memory traffic, the widest
 * vectors the build targets (simd.h: AVX-512, AVX2 or scalar), on every OpenMP thread at once.
 */
#ifndef LLMC_FMA_PEAK_H
#define LLMC_FMA_PEAK_H

#include <stdio.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/simd.h"
#include "llmc/utils.h"

// AVX-512 has 32 vector registers, AVX2 16: 24 accumulators there spilled to the stack, and
// every FMA waited on a load and a store (measured on an AVX2 EPYC: 47-76 GFLOP/s a core for
// 24, 92 for 12)
#if VLEN == 16
#define FMA_PEAK_CHAINS 24
#else
#define FMA_PEAK_CHAINS 12
#endif

// One measurement of `iters` rounds of FMA_PEAK_CHAINS vector FMAs per thread.
static inline double fma_peak_gflops(long iters) {
    double t0 = now_seconds();
    float sink = 0.0f;
    #pragma omp parallel reduction(+:sink)
    {
        vf x = vf_set1(0.999f), y = vf_set1(1e-4f);
        vf a[FMA_PEAK_CHAINS];
        for (int j = 0; j < FMA_PEAK_CHAINS; j++) { a[j] = vf_set1(0.1f * j); }
        for (long i = 0; i < iters; i++) {
            #pragma GCC unroll 24
            for (int j = 0; j < FMA_PEAK_CHAINS; j++) { a[j] = vf_fma(a[j], x, y); }
        }
        vf s = a[0];
        for (int j = 1; j < FMA_PEAK_CHAINS; j++) { s = vf_add(s, a[j]); }
        float out[VLEN];
        vf_store(out, s);
        sink += out[0];
    }
    double dt = now_seconds() - t0;
    if (sink == 12345.0f) { printf("unlikely\n"); }   // keeps the loop from being optimised away
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    return (double)iters * FMA_PEAK_CHAINS * VLEN * 2 * threads / dt / 1e9;
}

// The median of 5 measurements.
static inline double fma_peak_median(long iters) {
    double r[5];
    for (int i = 0; i < 5; i++) { r[i] = fma_peak_gflops(iters); }
    for (int i = 0; i < 5; i++) {
        for (int j = i + 1; j < 5; j++) { if (r[j] < r[i]) { double t = r[i]; r[i] = r[j]; r[j] = t; } }
    }
    return r[2];
}

#endif // LLMC_FMA_PEAK_H
