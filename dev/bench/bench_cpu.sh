#!/usr/bin/env bash
# CPU benchmark of train_gpt2 (a table, not a test). Measures on this machine:
#   - the FMA peak (dev/bench/fma_peak: registers only, all threads) - the denominator of
#     "% of peak" below; the issue's reference figure for one core of the development machine
#     is 113 GFLOP/s;
#   - the matmul kernels on GPT-2 124M shapes (B=4, T=64), GFLOP/s and % of the peak;
#   - whole training steps of GPT-2 124M (d12) and of L=4 C=256 NH=4 (d4), V=50257, B=4,
#     T=64: the median of 5 steps after the first, ms/step, tok/s and GFLOP/s by llm.c's
#     formula (6N + 6LCT) * B*T per step, next to llm.c's train_gpt2.c (about 9 s per 124M
#     step on the 2-core development machine, ~21 GFLOP/s; reference figure, not measured here).
# Data: tiny Shakespeare tokens (make data). Usage: dev/bench/bench_cpu.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-6}
make -s train_gpt2 build/bench_kernels build/fma_peak >/dev/null
DATA=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
[ -f "$DATA" ] || DATA=../shared/data/gpt2/tiny_shakespeare_train.bin
[ -f "$DATA" ] || { echo "error: no tiny Shakespeare tokens: run make data" >&2; exit 1; }
threads=${OMP_NUM_THREADS:-$(nproc)}
export OMP_NUM_THREADS=$threads
peak=$(./build/fma_peak)
peak1=$(OMP_NUM_THREADS=1 ./build/fma_peak)
echo "== machine: $(nproc) cores, $threads OpenMP threads; FMA peak $peak GFLOP/s ($peak1 on one thread) =="
echo
echo "== matmul kernels, GPT-2 124M shapes (B=4, T=64), $threads threads =="
./build/bench_kernels "$peak"
echo
echo "== training steps (B=4, T=64, V=50257), median of $((STEPS - 1)) steps after the first =="
printf "%-28s %10s %9s %9s %12s\n" "model" "ms/step" "tok/s" "GFLOP/s" "vs llm.c"
for m in d12 d4; do
  out=$(./train_gpt2 -e $m -i "$DATA" -b 4 -t 64 -x "$STEPS" -v 0 -s 0 2>&1)
  ms=$(echo "$out" | awk '/^step/ && !/ 1\// { for (i = 1; i <= NF; i++) if ($(i+1) == "ms") print $i }' | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  gf=$(echo "$out" | awk -v ms="$ms" '/^step/ { for (i = 1; i <= NF; i++) if ($(i+1) == "ms" && $i == ms) for (j = i; j <= NF; j++) if ($(j+1) == "GFLOP/s") print $j }' | head -1)
  name=$([ $m = d12 ] && echo "GPT-2 124M (d12)" || echo "L=4 C=256 NH=4 (d4)")
  ratio=$([ $m = d12 ] && awk -v ms="$ms" 'BEGIN { printf "%.1fx", 9000 / ms }' || echo "-")
  printf "%-28s %10s %9.0f %9s %12s\n" "$name" "$ms" "$(awk -v ms="$ms" 'BEGIN { print 256 / ms * 1000 }')" "$gf" "$ratio"
done
