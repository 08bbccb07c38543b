#!/usr/bin/env bash
# KV parallelism's benchmark (a table, not a test): one layer's decode attention per KVP size P
# (1, 2, 4, 8) at full contexts of T = 1024 and 4096, 1 and 8 requests (build/bench_kv_parallel).
# The ranks share this machine's 2 cores (oversubscribed past 2): the time shows the split's and
# the collectives' cost here, not the speed-up P GPUs would give.
set -euo pipefail
cd "$(dirname "$0")/../.."
make -s build/bench_kv_parallel >/dev/null
printf "%-4s %-6s %-4s %10s %12s\n" "P" "T" "N" "ms" "bytes/rank"
for T in ${TS:-1024 4096}; do
  for N in 1 8; do
    for P in 1 2 4 8; do dev/test/mpi.sh "$P" build/bench_kv_parallel "$T" "$N" "${REPS:-20}"; done
  done
done
