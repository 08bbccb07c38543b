#!/usr/bin/env bash
# Long sequences on one rank, side by side with PyTorch (a table, not a test): the median step
# time of train_gpt2 and of the same GPT-2 step in PyTorch (dev/bench/bench_pytorch.py: fp32
# eager, attention written out, AdamW) on L=4 C=256 NH=4 V=50257, B=4, at T = 64, 256 and 1024,
# the same threads, run one after the other in the same session (ratios, not absolute times,
# are what a shared machine can compare). Needs python3 with torch (Debian: apt-get install
# python3-torch libopenblas0-openmp); OpenBLAS is told the CPU's kernels (OPENBLAS_CORETYPE)
# when its own detection falls back to generic ones, so that PyTorch runs at its best.
# Usage: dev/bench/bench_attention.sh [steps] [rounds]
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-5}
ROUNDS=${2:-2}
PY=${PYTHON:-/usr/bin/python3}
"$PY" -c "import torch" 2>/dev/null || { echo "error: $PY has no torch (apt-get install python3-torch)" >&2; exit 1; }
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -q avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX; elif grep -q avx2 /proc/cpuinfo; then export OPENBLAS_CORETYPE=Haswell; fi
fi
make -s train_gpt2 >/dev/null
DATA=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
[ -f "$DATA" ] || DATA=../shared/data/gpt2/tiny_shakespeare_train.bin
threads=${OMP_NUM_THREADS:-$(nproc)}
export OMP_NUM_THREADS=$threads
median() { sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
echo "== L=4 C=256 NH=4 V=50257 B=4, $threads threads, median of $((STEPS - 1)) steps after the first, $ROUNDS rounds each =="
printf "%-6s %12s %12s %8s\n" "T" "ours ms" "pytorch ms" "ratio"
for T in 64 256 1024; do
  ours=(); theirs=()
  for _ in $(seq "$ROUNDS"); do
    ours+=("$(./train_gpt2 -e d4 -i "$DATA" -b 4 -t "$T" -x "$STEPS" -v 0 -s 0 2>&1 \
             | awk '/^step/ && !/ 1\// { for (i = 1; i <= NF; i++) if ($(i+1) == "ms") print $i }' | median)")
    theirs+=("$("$PY" dev/bench/bench_pytorch.py 4 256 4 50257 4 "$T" "$STEPS" "$threads" | sed 's/.*ms=//')")
  done
  o=$(printf "%s\n" "${ours[@]}" | median); p=$(printf "%s\n" "${theirs[@]}" | median)
  printf "%-6s %12s %12s %7.2fx\n" "$T" "$o" "$p" "$(awk -v o="$o" -v p="$p" 'BEGIN { print o / p }')"
done
