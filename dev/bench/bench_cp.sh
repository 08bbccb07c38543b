#!/usr/bin/env bash
# Context parallelism's benchmark (a table, not a test): per-rank activation memory (the
# startup table's, rank 0) and the median step time (the steps after the first) of train_gpt2
# against the sequence length T, for --cp 1, 2 and 4 (ring; --cp-mode a2a with MODE=a2a), on
# L=4 C=256 NH=4 with a 512-token vocabulary (so that attention, not the LM head, is what
# grows with T), B=1. The ranks share this machine's cores (dev/test/mpi.sh gives each
# cores/ranks OpenMP threads): the step time shows the communication's and the split's cost,
# not the speed-up N machines would give; the memory per rank is what N machines would hold.
# Usage: dev/bench/bench_cp.sh [steps] (T list: TS="256 512 1024 2048")
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-4}
MODE=${MODE:-ring}
make -s train_gpt2 build/testdata >/dev/null
W=$(mktemp -d /tmp/llmc_bench_cp.XXXXXX)
trap 'rm -rf "$W"' EXIT
build/testdata tokens "$W/train.bin" 200000 512 1 >/dev/null
printf "%-6s %-4s %14s %12s\n" "T" "cp" "act MiB/rank" "ms/step"
for T in ${TS:-256 512 1024 2048}; do
  for N in 1 2 4; do
    out=$(dev/test/mpi.sh "$N" ./train_gpt2 -e d4c256h4v512t2048 -i "$W/train.bin" -b 1 -t "$T" -x "$STEPS" -v 0 -s 0 \
          --cp "$N" --cp-mode "$MODE" 2>&1) || { echo "$out" | tail -3; exit 1; }
    act=$(echo "$out" | grep "memory/rank" | sed 's/.*activations \([0-9.]*\) MiB.*/\1/')
    ms=$(echo "$out" | awk '/^step/ && !/ 1\// { for (i = 1; i <= NF; i++) if ($(i+1) == "ms") print $i }' | sort -n \
         | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
    printf "%-6s %-4s %14s %12s\n" "$T" "$N" "$act" "$ms"
  done
done
