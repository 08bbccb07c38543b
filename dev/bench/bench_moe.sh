#!/usr/bin/env bash
# Mixture-of-experts benchmark of train_gpt2 (a table, not a test): L=4 C=256 NH=4, V=50257
# (d4), B=4, T=64 on the CPU, the dense model against 8 experts top 2 (d4e8k2) in every layer:
# parameters in total and per token (active: the dense parts and k of the E experts), the
# memory per rank the startup table reports (parameters, gradients, AdamW, activations), and
# the median step time of the steps after the first. Then the same 8-expert model on 2 ranks
# with --ep 2 (each holding 4 experts per layer): memory per rank and step time (the 2 ranks
# share the machine's cores, so its time says what oversubscription costs, not what EP gains).
# On a shared machine the runs alternate (dense, experts, dense, ...) for `rounds` rounds and
# each model's least disturbed round (the smallest median) is reported, with the ratio.
# Data: tiny Shakespeare tokens (make data). Usage: dev/bench/bench_moe.sh [steps] [rounds]
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-6}
ROUNDS=${2:-3}
make -s train_gpt2 >/dev/null
DATA=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
[ -f "$DATA" ] || DATA=../shared/data/gpt2/tiny_shakespeare_train.bin
[ -f "$DATA" ] || { echo "error: no tiny Shakespeare tokens: run make data" >&2; exit 1; }
threads=${OMP_NUM_THREADS:-$(nproc)}
export OMP_NUM_THREADS=$threads

median_ms() {   # the step lines after the first
  awk '/^step/ && !/ 1\// { for (i = 1; i <= NF; i++) if ($(i+1) == "ms") print $i }' | sort -n \
    | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'
}
row() {   # NAME OUTPUT
  local name=$1 out=$2 P active ms
  P=$(echo "$out" | sed -n 's/^| parameters *P = \([0-9]*\).*/\1/p')
  active=$(echo "$out" | sed -n 's/.* \([0-9]*\) active parameters per token.*/\1/p')
  [ -n "$active" ] || active=$P
  ms=$(echo "$out" | median_ms)
  set -- $(echo "$out" | sed -n 's/^| memory\/rank *params \([0-9.]*\) MiB, grads \([0-9.]*\) MiB, AdamW \([0-9.]*\) MiB, activations \([0-9.]*\) MiB/\1 \2 \3 \4/p')
  printf "%-26s %9.2fM %9.2fM %8s %8s %8s %8s %9s\n" "$name" "$(awk -v p="$P" 'BEGIN { print p / 1e6 }')" \
    "$(awk -v p="$active" 'BEGIN { print p / 1e6 }')" "$1" "$2" "$3" "$4" "$ms"
}
echo "== L=4 C=256 NH=4 V=50257, B=4 T=64, $threads OpenMP threads; median of $((STEPS - 1)) steps after the first," \
     "best of $ROUNDS alternating rounds =="
printf "%-26s %10s %10s %8s %8s %8s %8s %9s\n" "model" "params" "active" "params" "grads" "AdamW" "acts" "ms/step"
printf "%-26s %10s %10s %8s %8s %8s %8s %9s\n" "" "" "per token" "MiB" "MiB" "MiB" "MiB" ""
declare -A best out
for r in $(seq "$ROUNDS"); do
  for m in d4 d4e8k2; do
    o=$(./train_gpt2 -e $m -i "$DATA" -b 4 -t 64 -x "$STEPS" -v 0 -s 0 2>&1)
    ms=$(echo "$o" | median_ms)
    if [ -z "${best[$m]:-}" ] || awk -v a="$ms" -v b="${best[$m]}" 'BEGIN { exit !(a < b) }'; then
      best[$m]=$ms
      out[$m]=$o
    fi
  done
done
row "dense (d4)" "${out[d4]}"
row "8 experts top 2 (d4e8k2)" "${out[d4e8k2]}"
awk -v a="${best[d4e8k2]}" -v b="${best[d4]}" 'BEGIN { printf "step time, experts / dense: %.2fx\n", a / b }'
if command -v mpirun >/dev/null 2>&1; then
  o=$(OMP_NUM_THREADS=1 dev/test/mpi.sh 2 ./train_gpt2 -e d4e8k2 -i "$DATA" -b 4 -t 64 -x "$STEPS" -v 0 -s 0 --ep 2 2>&1)
  row "d4e8k2, 2 ranks --ep 2" "$o"
  echo "$o" | grep -m1 "all-to-all" | sed 's/^ */  rank 0, first step: /'
fi
