// The median of n timings (sorted in place): the figure the decode benchmarks report, so that a
// machine shared with other work shifts it less than it shifts a mean.
#pragma once
#include <stdlib.h>

static int bench_cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}
static double median(double* v, int n) {
    qsort(v, (size_t)n, sizeof(double), bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
