#!/usr/bin/env bash
# F, B, W and F&B with experts (a table, not a test): DeepSeek's four costs, as the trainer
# measures them under --schedule dualpipev (ms per microbatch and chunk, the mean over the
# stages of the run summary's --fwd/--bwd/--wgt/--fb), for a GPT-2 of depth 8 (C=128, a
# 512-token vocabulary, so the layers dominate; B=4, T=64, 8 microbatches per data-parallel
# rank): dense, 4 experts top 2 in every layer, and the same on 2 data x 2 pipeline ranks
# without and with --ep 2 (each rank holding 2 experts per layer, so every expert layer's pass
# has its all-to-alls; the same 4 ranks on the cores, so the difference is the exchanges').
# F&B - (F + B) says what an F&B pair hides: on the CPU build its two halves run one after the
# other on the rank's thread and an expert all-to-all is a blocking collective, so nothing but
# the pipeline messages overlaps, and the pair costs about F + B.
# The ranks share this machine's cores (1 OpenMP thread each), so the numbers say what the
# pieces cost relative to each other here, not what a core per rank would measure.
#   usage: dev/bench/bench_moe_pipeline.sh [steps]   (after make train_gpt2 build/testdata)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-5}
command -v mpirun >/dev/null 2>&1 || { echo "error: needs mpirun (Open MPI)" >&2; exit 1; }
W=$(mktemp -d /tmp/llmc_bench_moe_pp.XXXXXX)
trap 'rm -rf "$W"' EXIT
build/testdata tokens "$W/train.bin" 200000 512 1 >/dev/null
mean() { echo "$1" | tr ',' '\n' | awk '{ s += $1 } END { printf "%.1f", s / NR }'; }
printf "%-34s %7s %7s %7s %7s %7s %8s\n" "model (dualpipev, ms)" "F" "B" "W" "F&B" "F+B" "F&B-F-B"
for run in "dense:2:d8c128h4v512t64:2048" "4 experts top 2:2:d8c128h4v512t64e4k2:2048" \
           "4 experts top 2, DP 2 (--ep 1):4:d8c128h4v512t64e4k2:4096" \
           "4 experts top 2, DP 2 x --ep 2:4:d8c128h4v512t64e4k2:4096:--ep 2"; do
  IFS=: read -r name np model batch extra <<<"$run"
  OMP_NUM_THREADS=1 dev/test/mpi.sh "$np" ./train_gpt2 -e "$model" -i "$W/train.bin" -b 4 -t 64 -d "$batch" \
    -x "$STEPS" -v 0 -s 0 --pp 2 --schedule dualpipev ${extra:-} >"$W/run.out" 2>&1 || { tail -5 "$W/run.out"; exit 1; }
  line=$(grep -A1 "^draw this run's pipeline schedule" "$W/run.out" | tail -1)
  f=$(mean "$(echo "$line" | sed 's/.*--fwd \([0-9.,]*\).*/\1/')")
  b=$(mean "$(echo "$line" | sed 's/.*--bwd \([0-9.,]*\).*/\1/')")
  w=$(mean "$(echo "$line" | sed 's/.*--wgt \([0-9.,]*\).*/\1/')")
  fb=$(mean "$(echo "$line" | sed 's/.*--fb \([0-9.,]*\).*/\1/')")
  printf "%-34s %7s %7s %7s %7s %7.1f %8.1f\n" "$name" "$f" "$b" "$w" "$fb" "$(echo "$f + $b" | bc)" \
    "$(echo "$fb - $f - $b" | bc)"
  grep -m1 "all-to-all" "$W/run.out" | sed 's/^ */    rank 0, first step: /' || true
done
