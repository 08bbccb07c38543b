#!/usr/bin/env bash
# Fast mode (bf16) with tensor parallelism on the emulated GPU (./train_gpt2cu_emu
# --deterministic 0 --tp 2, with sequence parallelism --sp 1, and inside 2 pipeline stages;
# real mpirun), against the same fast run on one rank.
#
# Not bit-identical: cuBLASLt's fp32 accumulator sums a row-parallel layer's inputs (attproj,
# fcproj) and a column-parallel layer's input gradient (qkv, fc, the LM head) in another order
# when each rank sums its half and the all-reduce adds the halves, and the classifier's sum of
# exponentials likewise. Everything else is the one-rank arithmetic: the embedding lookup is
# exact (-0 from the ranks without the token), the bias is added once after the all-reduce,
# and every sum crossing the tp group is fp32, rounded to bf16 once as one rank rounds it.
# THE TOLERANCE (dev/gpu/fast_reorder_tolerance.awk: u = 2^-8, S = 6, N = B*T positions): a
# reordered fp32 sum of n <= 4C terms moves by at most n 2^-24 relative, so a bf16 rounding
# of it comes out one bf16 ulp (u relative) apart with probability p <= n 2^-24 / u; of a
# path's roundings K_tp = 4L + 1 can (2L row-parallel outputs, 2L + 1 input gradients). So
#   |d loss| <= tol = S u sqrt(p K_tp / N)          (step 0, and the validation losses)
#   rel |d norm| <= tol sqrt(2) (forward and backward)
# plus fast_tolerance.awk's growth over later steps (tol_norm0 sqrt(s) (l_0 - l_s)).
#   1. --tp 2 against one rank within that tolerance (the samples, from the gathered logits,
#      equal); 2 data x 2 tensor ranks at ZeRO-3 = --tp 2 alone byte for byte (the replicated
#      tensors' gradients reduced over dp only);
#   2. --tp 2 against the fp32 CPU reference ./train_gpt2 within dev/gpu/fast_tolerance.awk;
#   3. the bytes a step sends over the tp group against Megatron's count (fp32, as
#      ./train_gpt2 --tp 2 sends);
#   4. --tp 2 --sp 1 = --tp 2 byte for byte (main.log, checkpoint, samples): a reduce-scatter
#      along T is the all-reduce's sum on this rank's rows, every kernel between the collectives
#      is per row, and the layernorm weight gradients' per-sequence subtrees finish over the
#      group in the R3 tree's order; so within the tolerance of 1 and 2; its tp bytes against
#      the formula (fp32 reduce-scatters, bf16 all-gathers, the layernorms' subtrees);
#   5. --tp 2 --pp 2 (4 ranks; each tp rank of a stage sends and receives its own bf16
#      boundary over its pp group, the whole residual stream, or with --sp 1 its slice) = --tp 2
#      on one stage byte for byte (main.log, checkpoint, samples), as fast PP keeps one rank's
#      bits: 1f1b at ZeRO-3 without the KV cache (so its samples = --tp 2's with it also say
#      that the KV cache's tokens are the full forward's), zb1 (the split backward) with -r 1
#      and --sp 1; within the bf16 tolerances of ./train_gpt2; stage 0's pp and tp bytes
#      against their formulas (what fast mode refuses with --tp, --cp: test_fast_cp.sh;
#      experts under --tp: test_fast_moe.sh).
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun, fast-mode tensor parallelism is not tested"; exit 0; }
W=$(mktemp -d /tmp/llmc_fast_tp.XXXXXX)
trap 'rm -rf "$W"' EXIT
. dev/test/lib.sh   # fail, pass, MPI
. dev/test/fast_emu_lib.sh   # ARGS, FAST, run
L=4 C=32 B=1 T=32 M=4        # ARGS' model and step: one head a rank, V = Vp = 512
samples() { grep -A2 generating "$W/$1.out"; }

# 1. --tp 2 against one rank
run ref 1 "${FAST[@]}" "${ARGS[@]}"
run tp2 2 "${FAST[@]}" "${ARGS[@]}" --tp 2
res=$(awk -v S=6 -v u=0.00390625 -v n=$((4 * C)) -v K=$((4 * L + 1)) -v Kname=K_tp -v N=$((M * B * T)) \
      -f dev/gpu/fast_reorder_tolerance.awk "$W/ref/main.log" "$W/tp2/main.log")
[ "${res%% *}" = ok ] || fail "--tp 2 vs one rank: ${res#* }"
diff <(samples ref) <(samples tp2) >/dev/null || fail "--tp 2: the samples differ from one rank's"
run dp2_tp2_z3 4 "${FAST[@]}" "${ARGS[@]}" --tp 2 -z 3
cmp -s "$W/tp2/main.log" "$W/dp2_tp2_z3/main.log" || fail "2 data x 2 tensor ranks (ZeRO-3): main.log differs from --tp 2's"
cmp -s "$W/tp2/model_00000002.bin" "$W/dp2_tp2_z3/model_00000002.bin" || fail "2 data x 2 tensor ranks (ZeRO-3): the checkpoint differs from --tp 2's"
pass "fast mode --tp 2 vs one rank: ${res#* }; the same samples; DP 2 x TP 2 (ZeRO-3) = TP 2 byte for byte"

# 2. against the fp32 reference
run cpu 1 ./train_gpt2 "${ARGS[@]}"
vs_cpu tp2 "--tp 2"

# 3. the tp bytes of a step (rank 0's table): per microbatch 4 all-reduces of B*T*C per layer
# (forward: the attproj and fcproj partial outputs; backward: the qkv and fc input gradients),
# the embedding lookup and the LM head's input gradient (B*T*C each), the classifier's maxima
# (B*T) and (Z, target logit) (2*B*T) once (the backward reuses them). fp32: an all-reduce of
# n floats over K ranks sends 2 (K-1) ceil(n/K) x 4 bytes.
run cpu_tp2 2 ./train_gpt2 "${ARGS[@]}" --tp 2
K=2
ar() { echo $(( 2 * (K - 1) * (($1 + K - 1) / K) * 4 )); }
btc=$((B * T * C)) bt=$((B * T))
want=$(( M * ((4 * L + 2) * $(ar $btc) + $(ar $bt) + $(ar $((2 * bt)))) ))
tp_bytes() { awk '$1 == "tp" { print $3; exit }' "$W/$1.out"; }
for name in tp2 cpu_tp2; do
  got=$(tp_bytes $name)
  [ "$got" = "$want" ] || fail "$name: $got bytes over the tp group in step 1, Megatron's count is $want"
done
pass "tp bytes per step: $want (= Megatron's count in fp32, as ./train_gpt2 --tp 2 sends)"

# 4. sequence parallelism: the same bits as --tp 2. Its tp bytes per microbatch: the
# reduce-scatters along T of the fp32 sums that --tp 2 all-reduces (4L + 2 of B*T*C: 4 a
# layer, the embedding lookup, the LM head's input gradient; (K-1) B*T/K*C x 4 bytes each),
# the bf16 all-gathers along T (2L + 1 forward: the layernorms before ln1's, ln2's and the
# head's column-parallel matmuls; 2L + 1 backward: d(residual) before each row-parallel
# matmul's and the embedding's gradient; (K-1) B*T/K*C x 2 bytes each), the all-reduce of each
# layernorm's per-sequence weight and bias subtrees (2L + 1 of 2*B*C floats) and the
# classifier's as in 3.
run sp2 2 "${FAST[@]}" "${ARGS[@]}" --tp 2 --sp 1
cmp -s "$W/tp2/main.log" "$W/sp2/main.log" || fail "--tp 2 --sp 1: main.log differs from --tp 2's"
cmp -s "$W/tp2/model_00000002.bin" "$W/sp2/model_00000002.bin" || fail "--tp 2 --sp 1: the checkpoint differs from --tp 2's"
diff <(samples tp2) <(samples sp2) >/dev/null || fail "--tp 2 --sp 1: the samples differ from --tp 2's"
sl=$(( (K - 1) * btc / K ))
want_sp=$(( M * ((4 * L + 2) * sl * 4 + (4 * L + 2) * sl * 2 + (2 * L + 1) * $(ar $((2 * B * C))) + $(ar $bt) + $(ar $((2 * bt)))) ))
got=$(tp_bytes sp2)
[ "$got" = "$want_sp" ] || fail "--tp 2 --sp 1: $got bytes over the tp group in step 1, the formula says $want_sp"
pass "fast mode --tp 2 --sp 1 = --tp 2 byte for byte (main.log, checkpoint, samples); tp bytes per step $want_sp = the formula"
vs_cpu sp2 "--tp 2 --sp 1"

# 5. tensor parallelism inside pipeline stages: 2 tensor x 2 pipeline ranks. Stage 0 holds
# layers [0, 3) and the embeddings (the startup table says so), stage 1 layer 3 and the head.
for layout in "1f1b --kv-cache 0 -z 3" "zb1 -r 1 --sp 1"; do
  set -- $layout
  name=tp2_pp2_$1
  run "$name" 4 "${FAST[@]}" "${ARGS[@]}" --tp 2 --pp 2 --schedule "$@"
  grep -q "stage 0 .*layers \[0, 3) + embeddings," "$W/$name.out" \
    || fail "$name: stage 0 should hold layers [0, 3) and the embeddings ($(grep 'stage 0' "$W/$name.out"))"
  cmp -s "$W/tp2/main.log" "$W/$name/main.log" \
    || fail "$name: main.log differs from --tp 2's ($(diff "$W/tp2/main.log" "$W/$name/main.log" | head -2 | tr '\n' ' '))"
  cmp -s "$W/tp2/model_00000002.bin" "$W/$name/model_00000002.bin" || fail "$name: the checkpoint differs from --tp 2's"
  grep -q '^generating:' "$W/$name.out" || fail "$name: no sample printed"
  diff <(samples tp2) <(samples "$name") >/dev/null || fail "$name: the samples differ from --tp 2's"
done
pass "fast mode --tp 2 --pp 2 with 1f1b (ZeRO-3, no KV cache) and zb1 (-r 1, --sp 1) = --tp 2 on one stage byte for byte \
(main.log, checkpoint, samples)"
vs_cpu tp2_pp2_1f1b "--tp 2 --pp 2 1f1b"

# stage 0's bytes of a step (rank 0's table: tp rank 0 of stage 0). pp: each microbatch's
# boundary, its tp rank's B*T*C bf16 (with SP the slice, B*T/K*C), and its half of the tied
# wte's vocabulary rows (Vp/K*C fp32) summed over the two stages as in test_fast_pp.sh
# (4 Vp/K C bytes). tp: 3's count on 3 layers and the embedding lookup (no head, no classifier);
# with SP 4's on them: 4*3 + 1 reduce-scatters, 2*3 forward and 2*3 + 1 backward all-gathers,
# 2*3 layernorm subtrees.
pp_bytes() { awk '$1 == "pp" { print $3; exit }' "$W/$1.out"; }
Vp=512 S0=3
for v in "tp2_pp2_1f1b $((M * btc * 2 + 4 * Vp / K * C)) $((M * (4 * S0 + 1) * $(ar $btc)))" \
         "tp2_pp2_zb1 $((M * btc / K * 2 + 4 * Vp / K * C)) $((M * ((4 * S0 + 1) * sl * 4 + (4 * S0 + 1) * sl * 2 + 2 * S0 * $(ar $((2 * B * C))))))"; do
  set -- $v
  [ "$(pp_bytes "$1")" = "$2" ] || fail "$1: stage 0 sent $(pp_bytes "$1") bytes over the pp group in step 1, the formula says $2"
  [ "$(tp_bytes "$1")" = "$3" ] || fail "$1: stage 0 sent $(tp_bytes "$1") bytes over the tp group in step 1, the formula says $3"
done
pass "stage 0's bytes per step under --tp 2 --pp 2: pp $(pp_bytes tp2_pp2_1f1b) (bf16 boundaries), with --sp 1 \
$(pp_bytes tp2_pp2_zb1) (the slice); tp $(tp_bytes tp2_pp2_1f1b), with --sp 1 $(tp_bytes tp2_pp2_zb1) (= the formulas)"
