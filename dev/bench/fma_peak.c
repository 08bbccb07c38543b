/*
 * fma_peak.c: prints this machine's fused multiply-add peak in GFLOP/s (llmc/fma_peak.h), the
 * median of 5 runs: the denominator of the benchmark's "% of peak".
 */
#include <stdio.h>
#include <stdlib.h>
#include "llmc/fma_peak.h"

int main(int argc, char** argv) {
    long iters = argc > 1 ? atol(argv[1]) : 50000000;
    printf("%.1f\n", fma_peak_median(iters));
    return 0;
}
