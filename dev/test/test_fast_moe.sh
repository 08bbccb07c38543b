#!/usr/bin/env bash
# Fast mode (bf16) with experts on the emulated GPU (./train_gpt2cu_emu --deterministic 0, real
# mpirun): a 2-layer model of 4 experts top 2 (ARGS of fast_emu_lib.sh with -e ...e4k2).
#   1. one rank within dev/gpu/fast_tolerance.awk's bf16 tolerances of the fp32 CPU reference
#      ./train_gpt2 (loss, aux loss included, and gradient norm at every step, the validation
#      losses). The router is fp32 and its choice moe.h's; the expert path rounds as the dense
#      MLP does (fc, GELU, fcproj) plus the combine, within the same budget of roundings;
#   2. --ep 2 (2 data x 2 expert ranks, ZeRO-0 and ZeRO-3), --pp 2 (1f1b) and --pp 2 with zb1
#      (a split backward of every expert layer) byte-identical to one rank (main.log and the
#      final checkpoint): the experts see the same rows in the same order on whichever rank
#      holds them, their gradient slices per source microbatch are combined by zero.h's trees,
#      the bf16 rows cross the ep group unchanged, and each half of a split backward computes
#      what the whole does;
#   3. rank 0's all-to-all bytes per step against its routing counts: per layer pass the
#      counts ((Q-1) E/Q ints) and positions (4 bytes a row out), then the bf16 rows (2C bytes
#      each) out and back in the forward and again in the backward: 4C (out + in);
#   4. what fast mode does not run with experts (--tp): refused in one line.
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun, fast mode with experts is not tested"; exit 0; }
W=$(mktemp -d /tmp/llmc_fast_moe.XXXXXX)
trap 'rm -rf "$W"' EXIT
. dev/test/lib.sh   # fail, pass, MPI
. dev/test/fast_emu_lib.sh   # ARGS, FAST, run, vs_cpu
ARGS+=(-e d2c32h2v512t32e4k2)   # (a later -e wins) 2 layers, 4 experts top 2
L=2 C=32 E=4

# 1. one rank against the fp32 reference
run ref 1 "${FAST[@]}" "${ARGS[@]}"
run cpu 1 ./train_gpt2 "${ARGS[@]}"
grep -q "aux:" "$W/ref/main.log" || fail "fast mode with experts: main.log has no aux loss"
vs_cpu ref "one rank, 4 experts top 2" $L

# 2. expert and pipeline parallelism against one rank
for layout in "--ep 2" "--ep 2 -z 3" "--pp 2" "--pp 2 --schedule zb1"; do
  name=$(echo "$layout" | tr -d ' -')
  run "$name" 2 "${FAST[@]}" "${ARGS[@]}" $layout
  cmp -s "$W/ref/main.log" "$W/$name/main.log" || fail "fast mode $layout: main.log differs from one rank's"
  cmp -s "$W/ref/model_00000002.bin" "$W/$name/model_00000002.bin" || fail "fast mode $layout: the checkpoint differs from one rank's"
done
pass "fast mode with experts: --ep 2 (ZeRO-0, ZeRO-3), --pp 2 (1f1b, zb1) = one rank byte for byte"

# 3. rank 0's all-to-all bytes against its routing counts (Q = 2 ep ranks)
Q=2 n=0
while read -r bytes out in passes; do
  want=$(( passes * (Q - 1) * (E / Q) * 4 + out * 4 + 4 * C * (out + in) ))
  [ "$bytes" = "$want" ] || fail "--ep 2: all-to-all $bytes bytes, its counts say $want ($out rows out, $in in, $passes passes)"
  [ "$out" -gt 0 ] && [ "$in" -gt 0 ] || fail "--ep 2: rank 0 sent or received no rows, the accounting proves nothing"
  n=$((n + 1))
done < <(sed -n 's/.*all-to-all \([0-9]*\) bytes: \([0-9]*\) rows out, \([0-9]*\) in, \([0-9]*\) layer passes.*/\1 \2 \3 \4/p' "$W/ep2.out")
[ $n -gt 0 ] || fail "--ep 2: no all-to-all line"
pass "--ep 2: all-to-all bytes per step = the routing counts' (bf16 rows: half of deterministic mode's fp32)"

# 4. refusals
out=$($MPI 2 "${FAST[@]}" "${ARGS[@]}" --tp 2 -o "$W/refused" 2>&1) && fail "fast mode --tp 2 with experts: not refused"
echo "$out" | grep -q "^error: \[rank [01]\] --tp with experts: fast mode runs a mixture-of-experts model .*--deterministic 1$" \
  || fail "fast mode --tp 2 with experts: no one-line refusal ($(echo "$out" | grep -m1 -i error))"
pass "fast mode with experts: --tp 2 refused in one line"
