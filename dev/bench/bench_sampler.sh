#!/usr/bin/env bash
# The sampler's benchmark (a table, not a test): seconds to generate -g tokens with the KV
# cache (one position per token) and with a full forward over the -g positions per token
# (--kv-cache 0; the same tokens), for GPT-2 124M's shape (-e d12, random weights), B=1, on
# this machine's cores. Each time is a one-step run that samples once (after its step) minus
# the same run without sampling. A KV-cache step reads every weight once (fp32: 4 bytes x 124M parameters),
# so its floor is that over the machine's memory bandwidth, measured here by streaming a
# buffer of the weights' size.
# Usage: dev/bench/bench_sampler.sh [tokens] (default 64, the quick start's -g)
set -euo pipefail
cd "$(dirname "$0")/../.."
G=${1:-64}
make -s train_gpt2 build/testdata >/dev/null
W=$(mktemp -d /tmp/llmc_bench_sampler.XXXXXX)
trap 'rm -rf "$W"' EXIT
build/testdata tokens "$W/train.bin" 20000 50257 1 >/dev/null
secs() {   # the run's wall time in seconds
  local t0 t1
  t0=$(date +%s.%N)
  ./train_gpt2 -e d12 -i "$W/train.bin" -b 1 -t 64 -x 1 -v 0 "$@" >"$W/out" 2>&1 || { tail -3 "$W/out"; exit 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }'
}
base=$(secs -s 0)
kv=$(secs -s 1 -g "$G" --kv-cache 1)
full=$(secs -s 1 -g "$G" --kv-cache 0)
# the floor: stream 498 MB (d12's fp32 parameters) a few times, best of them
cat > "$W/bw.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
int main(void) {
    size_t n = 124475904; float* a = malloc(n * 4); double best = 0, s = 0;
    for (size_t i = 0; i < n; i++) { a[i] = (float)(i & 7); }
    for (int rep = 0; rep < 5; rep++) {
        double t = omp_get_wtime();
        #pragma omp parallel for reduction(+ : s)
        for (size_t i = 0; i < n; i++) { s += a[i]; }
        t = omp_get_wtime() - t;
        if (n * 4 / t > best) { best = n * 4 / t; }
    }
    printf("%.2f %.0f\n", best / 1e9, s > 0 ? 1.0 : 0.0);
    return 0;
}
C
gcc -O3 -march=native -fopenmp "$W/bw.c" -o "$W/bw"
bw=$("$W/bw" | awk '{ print $1 }')
printf "%-28s %10s %12s\n" "d12, -g $G, $(nproc) cores" "seconds" "ms/token"
awk -v b="$base" -v kv="$kv" -v full="$full" -v g="$G" -v bw="$bw" 'BEGIN {
    n = g - 1
    printf "%-28s %10.2f %12.1f\n", "KV cache", kv - b, 1000 * (kv - b) / n
    printf "%-28s %10.2f %12.1f\n", "full forward per token", full - b, 1000 * (full - b) / n
    printf "%-28s %10.2f %12.1f   (498 MB of weights per token at %.1f GB/s)\n", "floor: memory bandwidth",
           n * 0.498 / bw, 1000 * 0.498 / bw, bw
}'
