#!/usr/bin/env bash
# Fast mode (bf16) with context parallelism on the emulated GPU (./train_gpt2cu_emu
# --deterministic 0 --cp 2, --cp-mode a2a and ring; alone, inside 2 pipeline stages and with
# tensor + sequence parallelism; real mpirun), against the same fast run on one rank.
#
# THE ALL-TO-ALL. The forward is one rank's arithmetic: every kernel outside attention is per position, and
# attention runs the flash kernels unchanged on whole sequences of this rank's heads (each head
# is independent), so a forward's losses are one rank's bits. Not bit-identical after the first
# update: a weight gradient's fp32 sum over a microbatch's n = B*T positions is each rank's sum
# over its slice (cuBLASLt's accumulator; the exact R3 bias and layernorm kernels on the slice),
# the ranks' partials then summed by ZeRO's data x context reduction: another order.
# THE TOLERANCE (dev/gpu/fast_reorder_tolerance.awk: u = 2^-8, S = 6, N = M*B*T positions a step): a
# reordered fp32 sum of n terms moves by at most n 2^-24 relative; AdamW carries that into the
# fp32 master weights, whose bf16 copy then comes out one ulp (u relative) apart with
# probability p <= n 2^-24 / u; a path reads K_cp = 4L + 2 rounded weight tensors (4 matmuls a
# layer, wte twice). So
#   step 0's train loss and the validation loss before any update: equal to one rank's;
#   |d loss| <= tol = S u sqrt(p K_cp / N), rel |d norm| <= tol sqrt(2)
# plus fast_tolerance.awk's growth over later steps (tol_norm0 sqrt(s) (l_0 - l_s)).
# THE RING's attention is other arithmetic than one rank's (the flash kernels per K|V block, each
# block's fp32 partial output and log-sum-exp merged by rescaling), so its tolerance against one
# rank is fast mode's against fp32: dev/gpu/fast_tolerance.awk with one rank's fast run as the
# reference.
# PIPELINE STAGES change no arithmetic of a layer (test_fast_pp.sh): each stage's cp group runs
# its chunk's layers as --cp 2 runs them, and a boundary carries this rank's bf16 slice of the
# residual stream, so --cp 2 --pp 2 trains --cp 2's bits.
# TENSOR PARALLELISM under CP: each tp rank attends with its NH/K heads (the ring passes their
# K|V blocks; the all-to-all needs NH/K a multiple of N), the tp collectives run on the slice's
# B*T/N rows, and with --sp 1 the residual stream holds this rank's slice of its cp slice (the
# (c*K + k)-th of N*K zig-zag slices, zigzag.h). Against one rank: the ring's tolerance, which
# takes every one of a path's 4L + 2 roundings to differ, so it covers the roundings that TP's
# reordered sums flip (each with probability p <= 4C 2^-24 / u, test_fast_tp.sh).
#   1. --cp 2 --cp-mode a2a against one rank within that tolerance (the same samples: the
#      sampler runs whole sequences); --cp 2 --cp-mode a2a --pp 2 (1f1b, 4 ranks) = --cp 2 byte
#      for byte (main.log, checkpoint, samples); with ZeRO-3 (not ZeRO-0's bits: ZeRO-0 sums a
#      rank's microbatches before the ranks, ZeRO-3 each microbatch's ranks first, and the
#      ranks' partials make that order matter) in test_fast_moe.sh's --cp 2 --pp 2 -z 3 run;
#   2. --cp 2 --tp 2 --sp 1 --cp-mode ring (4 ranks) against one rank's fast run within the
#      ring's tolerance, and against the fp32 CPU reference ./train_gpt2 within
#      dev/gpu/fast_tolerance.awk, as --cp 2 --cp-mode a2a is;
#   3. the bytes a step sends over the cp group against the formula, recomputed here (bf16
#      all-to-alls, K|V blocks of the rank's C/K channels and the embedding gradient's gather;
#      fp32 dK|dV partials and losses), over the tp group (test_fast_tp.sh's --sp 1 count on
#      the B*T/N rows of the slice) and over the pp group (stage 0's bf16 boundaries and the
#      tied wte's gradient);
#   4. what fast mode's context parallelism does not run (--attention cudnn; the all-to-all
#      with NH/K not a multiple of --cp): refused in one line.
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun, fast-mode context parallelism is not tested"; exit 0; }
W=$(mktemp -d /tmp/llmc_fast_cp.XXXXXX)
trap 'rm -rf "$W"' EXIT
. dev/test/lib.sh   # fail, pass, MPI
. dev/test/fast_emu_lib.sh   # ARGS, FAST, run, vs_cpu
L=4 C=32 B=1 T=32 M=4        # ARGS' model and step: NH = 2, one head a rank
samples() { grep -A2 generating "$W/$1.out"; }

# near_ref NAME: $W/NAME's main.log against one rank's ($W/ref) within the tolerance above;
# prints "ok DETAIL" or "bad DETAIL"
near_ref() {
  awk -v S=6 -v u=0.00390625 -v n=$((B * T)) -v K=$((4 * L + 2)) -v Kname=K_cp -v N=$((M * B * T)) -v exact0=1 \
      -f dev/gpu/fast_reorder_tolerance.awk "$W/ref/main.log" "$W/$1/main.log"
}

# 1. --cp 2 --cp-mode a2a against one rank, and inside 2 pipeline stages
run ref 1 "${FAST[@]}" "${ARGS[@]}"
run cp2 2 "${FAST[@]}" "${ARGS[@]}" --cp 2 --cp-mode a2a
res=$(near_ref cp2)
[ "${res%% *}" = ok ] || fail "--cp 2 --cp-mode a2a vs one rank: ${res#* }"
diff <(samples ref) <(samples cp2) >/dev/null || fail "--cp 2 --cp-mode a2a: the samples differ from one rank's"
pass "fast mode --cp 2 --cp-mode a2a vs one rank: step 0 and the first validation equal, ${res#* }; the same samples"
run cp2_pp2 4 "${FAST[@]}" "${ARGS[@]}" --cp 2 --cp-mode a2a --pp 2 --schedule 1f1b
for f in main.log model_00000002.bin; do
  cmp -s "$W/cp2/$f" "$W/cp2_pp2/$f" || fail "--cp 2 --cp-mode a2a --pp 2: $f differs from --cp 2's"
done
diff <(samples cp2) <(samples cp2_pp2) >/dev/null || fail "--cp 2 --cp-mode a2a --pp 2: the samples differ from --cp 2's"
pass "fast mode --cp 2 --cp-mode a2a --pp 2 (1f1b, 4 ranks) = --cp 2 byte for byte (main.log, checkpoint, samples)"

# 2. with tensor and sequence parallelism, the ring: against one rank's fast run, and both
# layouts against the fp32 reference
run cp2_tp2_sp 4 "${FAST[@]}" "${ARGS[@]}" --cp 2 --tp 2 --sp 1 --cp-mode ring
run cpu 1 ./train_gpt2 "${ARGS[@]}"
vs_cpu cp2 "--cp 2 --cp-mode a2a"
vs_cpu cp2_tp2_sp "--cp 2 --tp 2 --sp 1 --cp-mode ring"
res=$(awk -v L=4 -v N=128 -v drift="$W/drift.txt" -f dev/gpu/fast_tolerance.awk "$W/cpu/main.log" "$W/ref/main.log" \
      "$W/cp2_tp2_sp/main.log")
s0=$(echo "$res" | sed -n 's/^S0 //p') dr=$(echo "$res" | sed -n 's/^DRIFT //p')
[ "${s0%% *}" = ok ] && [ "${dr%% *}" = ok ] || { cat "$W/drift.txt"; fail "--cp 2 --tp 2 --sp 1 --cp-mode ring vs one rank: $s0; $dr"; }
pass "fast mode --cp 2 --tp 2 --sp 1 --cp-mode ring vs one rank: step 0 ${s0#* }; ${dr#* }"

# 3. the cp bytes of a step: per microbatch and layer the four all-to-alls (q|k|v and the
# output forward, d out and d q|k|v backward) send (N-1)/N of 3, 1, 1 and 3 blocks of B (T/N) C
# bf16 elements; the ring sends (N-1) K|V pairs of blocks forward and again backward (bf16) and
# (N-1) dK|dV pairs (fp32), a block being B (T/N) C/K elements under --tp K; the embedding's
# input gradient is all-gathered ((N-1) B (T/N) C bf16, C whole), the losses too ((N-1) B (T/N)
# fp32); every rank of the cp group runs all M microbatches (one data rank here). Stage 0 of
# --pp 2 holds layers [0, 3) and the embeddings, no head.
N=2 K=2
rest=$(( (N - 1) * B * T / N * C * 2 + (N - 1) * B * T / N * 4 )) emb=$(( (N - 1) * B * T / N * C * 2 ))
a2a_layer() { echo $(( 8 * (N - 1) * $1 / N * 2 )); }                    # a2a_layer BLOCK
ring_layer() { echo $(( (N - 1) * 4 * $1 * 2 + (N - 1) * 2 * $1 * 4 )); }  # ring_layer BLOCK
cp_bytes() {   # cp_bytes NAME WANT LABEL
  local line got
  line=$(grep -m1 "^cp accounting:" "$W/$1.out") || fail "$3: no cp accounting line"
  got=$(echo "$line" | sed -n 's/.*bytes\/rank\/step cp \([0-9]*\),.*/\1/p')
  [ "$got" = "$2" ] || fail "$3: $got bytes over the cp group in a step, the formula says $2 ($line)"
}
want_a2a=$(( M * (L * $(a2a_layer $((B * T / N * C))) + rest) ))
want_pp=$(( M * (3 * $(a2a_layer $((B * T / N * C))) + emb) ))
want_ring=$(( M * (L * $(ring_layer $((B * T / N * C / K))) + rest) ))
cp_bytes cp2 $want_a2a "--cp 2 --cp-mode a2a"
cp_bytes cp2_pp2 $want_pp "--cp 2 --cp-mode a2a --pp 2 (stage 0)"
cp_bytes cp2_tp2_sp $want_ring "--cp 2 --tp 2 --sp 1 --cp-mode ring"
pass "cp bytes per step: a2a $want_a2a, its stage 0 of --pp 2 $want_pp, ring under --tp 2 $want_ring (bf16 all-to-alls, \
K|V blocks and embedding gradient, fp32 dK|dV and losses) = the trainer's count"
# tp bytes (test_fast_tp.sh's --sp 1 count on the slice's rows): 4L + 2 fp32 reduce-scatters
# and 4L + 2 bf16 all-gathers of (K-1)/K of B (T/N) C, the layernorms' per-sequence subtrees
# (2L + 1 all-reduces of 2 B C floats) and the classifier's maxima and (Z, target logit)
# all-reduces of B (T/N) and 2 B (T/N) floats; an all-reduce of n floats over K ranks sends
# 2 (K-1) ceil(n/K) x 4 bytes. pp bytes of stage 0: the bf16 boundary (this rank's slice, B
# (T/N) C) per microbatch and the tied wte's fp32 gradient exchange (4 Vp C, test_fast_pp.sh).
ar() { echo $(( 2 * (K - 1) * (($1 + K - 1) / K) * 4 )); }
rows=$((B * T / N)) Vp=512
sl=$(( (K - 1) * rows * C / K ))
want_tp=$(( M * ((4 * L + 2) * sl * 6 + (2 * L + 1) * $(ar $((2 * B * C))) + $(ar $rows) + $(ar $((2 * rows)))) ))
got=$(awk '$1 == "tp" { print $3; exit }' "$W/cp2_tp2_sp.out")
[ "$got" = "$want_tp" ] || fail "--cp 2 --tp 2 --sp 1: $got bytes over the tp group in step 1, the formula says $want_tp"
want_pp=$(( M * rows * C * 2 + 4 * Vp * C ))
got=$(awk '$1 == "pp" { print $3; exit }' "$W/cp2_pp2.out")
[ "$got" = "$want_pp" ] || fail "--cp 2 --pp 2: stage 0 sent $got bytes over the pp group in step 1, the formula says $want_pp"
pass "tp bytes per step under --cp 2 --tp 2 --sp 1: $want_tp; pp bytes of stage 0 under --cp 2 --pp 2: $want_pp (bf16 slices) = the formulas"

# 4. what fast mode's context parallelism does not run: one line naming the flag
refused() {   # refused NP PATTERN FLAGS...
  local np=$1 pattern=$2 out; shift 2
  out=$($MPI "$np" "${FAST[@]}" "${ARGS[@]}" "$@" -o "$W/refused" 2>&1) && fail "fast mode $*: not refused"
  echo "$out" | grep -Eq "^error: (\[rank [0-3]\] )?$pattern" || fail "fast mode $*: no one-line refusal ($(echo "$out" | grep -m1 -i error))"
}
refused 2 "--attention cudnn with --cp: .*use --attention flash or auto$" --cp 2 --cp-mode a2a --attention cudnn
refused 4 "--cp 2: --cp-mode a2a gives each rank NH/cp heads: the 1 heads per tensor-parallel rank are not a multiple of --cp 2$" --cp 2 --tp 2 --cp-mode a2a
pass "fast mode --cp with --attention cudnn, and a2a with NH/tp not a multiple of --cp: refused in one line"
