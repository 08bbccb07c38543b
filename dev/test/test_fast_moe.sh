#!/usr/bin/env bash
# Fast mode (bf16) with experts on the emulated GPU (./train_gpt2cu_emu --deterministic 0, real
# mpirun): a 2-layer model of 4 experts top 2 (ARGS of fast_emu_lib.sh with -e ...e4k2).
#   1. one rank within dev/gpu/fast_tolerance.awk's bf16 tolerances of the fp32 CPU reference
#      ./train_gpt2 (loss, aux loss included, and gradient norm at every step, the validation
#      losses). The router is fp32 and its choice moe.h's; the expert path rounds as the dense
#      MLP does (fc, GELU, fcproj) plus the combine, within the same budget of roundings;
#   2. --ep 2 (2 data x 2 expert ranks), --pp 2 (1f1b) and --pp 2 with zb1 (a split backward
#      of every expert layer) byte-identical to one rank (main.log and the final checkpoint):
#      the experts see the same rows in the same order on whichever rank holds them, their
#      gradient slices per source microbatch are combined by zero.h's trees, the bf16 rows
#      cross the ep group unchanged, and each half of a split backward computes what the whole
#      does (ZeRO-3 with --ep: the 4-rank run of 4);
#   3. rank 0's all-to-all bytes per step against its routing counts: per layer pass the
#      counts ((Q-1) E/Q ints) and positions (4 bytes a row out), then the bf16 rows (2C bytes
#      each) out and back in the forward and again in the backward: 4C (out + in);
#   4. --tp 2 (each expert's fc column-parallel, fcproj row-parallel: the dense MLP's split)
#      against one rank within the tolerance of dev/gpu/fast_reorder_tolerance.awk (as
#      test_fast_tp.sh derives it: a reordered fp32 sum of n <= 4C terms flips a bf16 rounding
#      with probability p <= n 2^-24 / 2^-8; the reordered roundings of a path are, per layer,
#      attproj's output and qkv's input gradient, and for each of a position's k experts its
#      fcproj output and its fc input gradient, plus the LM head's input gradient:
#      K_tp = 2(k+1)L + 1), the same samples, and within the bf16 tolerances of ./train_gpt2;
#      the tp bytes of a step against Megatron's count, recomputed here: per microbatch and
#      layer the all-reduces of attproj's partial outputs and qkv's input gradients (B*T*C
#      floats each) and of the experts' partial outputs and fc input gradients, one row per
#      slot (k*B*T*C floats each), then the embedding lookup and the LM head's input gradient
#      (B*T*C) and the classifier's maxima (B*T) and (Z, target logit) (2*B*T);
#   5. --tp 2 --sp 1 --ep 2 -z 3 (4 ranks: 2 tensor x 2 data ranks, the 2 data ranks one ep
#      group; ZeRO-3) = --tp 2 byte for byte (main.log, checkpoint, samples): each tp
#      rank routes the same whole ln2 rows and exchanges them with its counterpart of the ep
#      group, an expert's partial sums per row are all-reduced in the same R1 tree, and SP's
#      slices hold the rows --tp 2 computes;
#   6. --cp 2 --cp-mode a2a --pp 2 --schedule zb1 -z 3 (4 ranks: 2 context x 2 pipeline ranks,
#      the split backward, ZeRO-3). Every rank of the cp group runs each expert layer on whole
#      sequences (its input all-gathered along T, bf16; it keeps its slice of the output), so
#      the routing, the load-balancing loss and the experts' weight gradients are one rank's,
#      and with the all-to-all the forward is one rank's bits; the dense weights' gradients
#      (the router's among them) are sums over the ranks' slices, test_fast_cp.sh's reordering:
#      within its derived tolerance of one rank (K_cp = 4L + 2, a bound: the experts' weights
#      are one rank's bits), within the bf16 tolerances of ./train_gpt2, and stage 0's cp bytes
#      against test_fast_cp.sh's all-to-all count for its layer and the embedding's gradient
#      plus the expert layer's two all-gathers ((N-1) B (T/N) C bf16 each: its input forward,
#      its output's gradient backward).
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun, fast mode with experts is not tested"; exit 0; }
W=$(mktemp -d /tmp/llmc_fast_moe.XXXXXX)
trap 'rm -rf "$W"' EXIT
. dev/test/lib.sh   # fail, pass, MPI
. dev/test/fast_emu_lib.sh   # ARGS, FAST, run, vs_cpu
ARGS+=(-e d2c32h2v512t32e4k2)   # (a later -e wins) 2 layers, 4 experts top 2
L=2 C=32 E=4 k=2 B=1 T=32 M=4   # M: ARGS' microbatches a step
samples() { grep -A2 generating "$W/$1.out"; }

# 1. one rank against the fp32 reference
run ref 1 "${FAST[@]}" "${ARGS[@]}"
run cpu 1 ./train_gpt2 "${ARGS[@]}"
grep -q "aux:" "$W/ref/main.log" || fail "fast mode with experts: main.log has no aux loss"
vs_cpu ref "one rank, 4 experts top 2" $L

# 2. expert and pipeline parallelism against one rank
for layout in "--ep 2" "--pp 2" "--pp 2 --schedule zb1"; do
  name=$(echo "$layout" | tr -d ' -')
  run "$name" 2 "${FAST[@]}" "${ARGS[@]}" $layout
  cmp -s "$W/ref/main.log" "$W/$name/main.log" || fail "fast mode $layout: main.log differs from one rank's"
  cmp -s "$W/ref/model_00000002.bin" "$W/$name/model_00000002.bin" || fail "fast mode $layout: the checkpoint differs from one rank's"
done
pass "fast mode with experts: --ep 2, --pp 2 (1f1b, zb1) = one rank byte for byte"

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

# 4. tensor parallelism against one rank, and its tp bytes
run tp2 2 "${FAST[@]}" "${ARGS[@]}" --tp 2
res=$(awk -v S=6 -v u=0.00390625 -v n=$((4 * C)) -v K=$((2 * (k + 1) * L + 1)) -v Kname=K_tp -v N=$((M * B * T)) \
      -f dev/gpu/fast_reorder_tolerance.awk "$W/ref/main.log" "$W/tp2/main.log")
[ "${res%% *}" = ok ] || fail "--tp 2 with experts vs one rank: ${res#* }"
diff <(samples ref) <(samples tp2) >/dev/null || fail "--tp 2 with experts: the samples differ from one rank's"
pass "fast mode with experts --tp 2 vs one rank: ${res#* }; the same samples"
vs_cpu tp2 "with experts --tp 2" $L
K=2
ar() { echo $(( 2 * (K - 1) * (($1 + K - 1) / K) * 4 )); }
btc=$((B * T * C)) bt=$((B * T))
want=$(( M * (L * (2 * $(ar $btc) + 2 * $(ar $((k * btc)))) + 2 * $(ar $btc) + $(ar $bt) + $(ar $((2 * bt)))) ))
got=$(awk '$1 == "tp" { print $3; exit }' "$W/tp2.out")
[ "$got" = "$want" ] || fail "--tp 2 with experts: $got bytes over the tp group in step 1, Megatron's count is $want"
pass "fast mode with experts --tp 2: tp bytes per step $want (= Megatron's count in fp32, the experts' rows per slot)"

# 5. tensor, sequence and expert parallelism with ZeRO-3 at once
run tp2_sp_ep2_z3 4 "${FAST[@]}" "${ARGS[@]}" --tp 2 --sp 1 --ep 2 -z 3
for f in main.log model_00000002.bin; do
  cmp -s "$W/tp2/$f" "$W/tp2_sp_ep2_z3/$f" || fail "--tp 2 --sp 1 --ep 2 -z 3 with experts: $f differs from --tp 2's"
done
diff <(samples tp2) <(samples tp2_sp_ep2_z3) >/dev/null || fail "--tp 2 --sp 1 --ep 2 -z 3 with experts: the samples differ from --tp 2's"
grep -q 'all-to-all [1-9][0-9]* bytes' "$W/tp2_sp_ep2_z3.out" || fail "--tp 2 --sp 1 --ep 2 -z 3: no rows crossed the ep group"
pass "fast mode with experts --tp 2 --sp 1 --ep 2 -z 3 (4 ranks) = --tp 2 byte for byte (main.log, checkpoint, samples)"

# 6. context parallelism inside 2 pipeline stages (the split backward, ZeRO-3)
run cp2_pp2_z3 4 "${FAST[@]}" "${ARGS[@]}" --cp 2 --cp-mode a2a --pp 2 --schedule zb1 -z 3
res=$(awk -v S=6 -v u=0.00390625 -v n=$((B * T)) -v K=$((4 * L + 2)) -v Kname=K_cp -v N=$((M * B * T)) -v exact0=1 \
      -f dev/gpu/fast_reorder_tolerance.awk "$W/ref/main.log" "$W/cp2_pp2_z3/main.log")
[ "${res%% *}" = ok ] || fail "--cp 2 --pp 2 -z 3 with experts vs one rank: ${res#* }"
pass "fast mode with experts --cp 2 --cp-mode a2a --pp 2 --schedule zb1 -z 3 vs one rank: step 0 and the first validation equal, ${res#* }"
vs_cpu cp2_pp2_z3 "with experts --cp 2 --pp 2" $L
N=2
blk=$((B * T / N * C))   # a block: this rank's B (T/N) positions of C channels
want=$(( M * (8 * (N - 1) * blk / N * 2 + 2 * (N - 1) * blk * 2 + (N - 1) * blk * 2) ))
line=$(grep -m1 "^cp accounting:" "$W/cp2_pp2_z3.out") || fail "--cp 2 --pp 2 with experts: no cp accounting line"
got=$(echo "$line" | sed -n 's/.*bytes\/rank\/step cp \([0-9]*\),.*/\1/p')
[ "$got" = "$want" ] || fail "--cp 2 --pp 2 with experts: stage 0 sent $got bytes over the cp group in a step, the formula says $want"
pass "fast mode with experts --cp 2 --pp 2: stage 0's cp bytes per step $want (bf16 all-to-alls, the expert layer's gathers and the embedding gradient's) = the formula"
