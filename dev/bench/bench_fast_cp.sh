#!/usr/bin/env bash
# Fast mode's context parallelism on a GPU (a table, not a test; prepared for a GPU, not run by
# this work, which had none): train_gpt2cu in fast mode on GPT-2 124M's shape (12 layers, C=768,
# NH=12, head size 64: the flash kernels) with maxT 8192, B=1, at T=8192 and the shorter T
# given, for --cp 1, --cp 2 --cp-mode a2a (the all-to-all: NH/2 heads a rank) and --cp 2
# --cp-mode ring (its block kernels are naive loops: this row prices them); per rank the
# activation memory (the startup table's, rank 0), the average step time (excluding the first)
# and the throughput with its MFU (the run summary's). One rank a GPU when there are as many GPUs
# as ranks (select_device); on one GPU the two ranks share it, which shows the memory per rank
# and the exchange's cost, not the speed-up.
# Usage: dev/bench/bench_fast_cp.sh [steps] (T list: TS="2048 8192"; BIN=./train_gpt2cu)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-5}
BIN=${BIN:-./train_gpt2cu}
[ -x "$BIN" ] || make -s train_gpt2cu build/testdata >/dev/null
make -s build/testdata >/dev/null
W=$(mktemp -d /tmp/llmc_bench_fast_cp.XXXXXX)
trap 'rm -rf "$W"' EXIT
build/testdata tokens "$W/train.bin" 400000 50257 1 >/dev/null
printf "%-6s %-12s %14s %12s %s\n" "T" "layout" "act MiB/rank" "ms/step" "throughput"
for T in ${TS:-2048 8192}; do
  for layout in "1" "2 a2a" "2 ring"; do
    N=${layout%% *}
    flags=()
    [ "$N" -gt 1 ] && flags=(--cp "$N" --cp-mode "${layout#* }")
    out=$(dev/test/mpi.sh "$N" "$BIN" -e d12t8192 -i "$W/train.bin" -b 1 -t "$T" -x "$STEPS" -v 0 -s 0 \
          ${flags[@]+"${flags[@]}"} 2>&1) || { echo "$out" | tail -3; exit 1; }
    act=$(echo "$out" | grep -m1 "memory/rank" | sed 's/.*activations \([0-9.]*\) MiB.*/\1/')
    avg=$(echo "$out" | sed -n 's/^ *average step \([0-9.]*\) ms.*/\1/p')
    tput=$(echo "$out" | sed -n 's/^ *average step [0-9.]* ms (excluding the first), //p')
    printf "%-6s %-12s %14s %12s %s\n" "$T" "cp $layout" "$act" "$avg" "$tput"
  done
done
