#!/usr/bin/env bash
# Fast mode (bf16) with context parallelism on the emulated GPU (./train_gpt2cu_emu
# --deterministic 0 --cp 2, --cp-mode a2a and ring; real mpirun), against the same fast run on
# one rank.
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
#   1. --cp 2 --cp-mode a2a against one rank within that tolerance (the same samples: the
#      sampler runs whole sequences), and with ZeRO-3 (not ZeRO-0's bits: ZeRO-0 sums a rank's
#      microbatches before the ranks, ZeRO-3 each microbatch's ranks first, and the ranks'
#      partials make that order matter);
#   2. both modes against the fp32 CPU reference ./train_gpt2 within dev/gpu/fast_tolerance.awk,
#      the ring against one rank's fast run within the same tolerances;
#   3. the bytes a step sends over the cp group against the formula, recomputed here (bf16
#      all-to-alls, K|V blocks and the embedding gradient's gather; fp32 dK|dV partials and
#      losses);
#   4. what fast mode's context parallelism does not run (with --tp, --pp, experts, --attention
#      cudnn; NH not a multiple of --cp for the all-to-all): refused in one line.
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

# 1. --cp 2 --cp-mode a2a against one rank
run ref 1 "${FAST[@]}" "${ARGS[@]}"
run cp2 2 "${FAST[@]}" "${ARGS[@]}" --cp 2 --cp-mode a2a
res=$(near_ref cp2)
[ "${res%% *}" = ok ] || fail "--cp 2 --cp-mode a2a vs one rank: ${res#* }"
diff <(samples ref) <(samples cp2) >/dev/null || fail "--cp 2 --cp-mode a2a: the samples differ from one rank's"
run cp2_z3 2 "${FAST[@]}" "${ARGS[@]}" --cp 2 --cp-mode a2a -z 3
res3=$(near_ref cp2_z3)
[ "${res3%% *}" = ok ] || fail "--cp 2 --cp-mode a2a -z 3 vs one rank: ${res3#* }"
pass "fast mode --cp 2 --cp-mode a2a vs one rank: step 0 and the first validation equal, ${res#* }; the same samples; with ZeRO-3 ${res3#* }"

# 2. against the fp32 reference; the ring against one rank's fast run within the same tolerances
run cpu 1 ./train_gpt2 "${ARGS[@]}"
vs_cpu cp2 "--cp 2 --cp-mode a2a"
run ring2 2 "${FAST[@]}" "${ARGS[@]}" --cp 2 --cp-mode ring
vs_cpu ring2 "--cp 2 --cp-mode ring"
res=$(awk -v L=4 -v N=128 -v drift="$W/drift.txt" -f dev/gpu/fast_tolerance.awk "$W/cpu/main.log" "$W/ref/main.log" \
      "$W/ring2/main.log")
s0=$(echo "$res" | sed -n 's/^S0 //p') dr=$(echo "$res" | sed -n 's/^DRIFT //p')
[ "${s0%% *}" = ok ] && [ "${dr%% *}" = ok ] || { cat "$W/drift.txt"; fail "--cp 2 --cp-mode ring vs one rank: $s0; $dr"; }
pass "fast mode --cp 2 --cp-mode ring vs one rank: step 0 ${s0#* }; ${dr#* }"

# 3. the cp bytes of a step: per microbatch and layer the four all-to-alls (q|k|v and the
# output forward, d out and d q|k|v backward) send (N-1)/N of 3, 1, 1 and 3 blocks of B (T/N) C
# bf16 elements; the ring sends (N-1) K|V pairs of blocks forward and again backward (bf16) and
# (N-1) dK|dV pairs (fp32); the embedding's input gradient is all-gathered ((N-1) B (T/N) C
# bf16), the losses too ((N-1) B (T/N) fp32); every rank of the cp group runs all M
# microbatches (one data rank here).
N=2
blk=$((B * T / N * C)) rest=$(( (N - 1) * B * T / N * C * 2 + (N - 1) * B * T / N * 4 ))
cp_bytes() {   # cp_bytes NAME WANT LABEL
  local line got
  line=$(grep -m1 "^cp accounting:" "$W/$1.out") || fail "$3: no cp accounting line"
  got=$(echo "$line" | sed -n 's/.*bytes\/rank\/step cp \([0-9]*\),.*/\1/p')
  [ "$got" = "$2" ] || fail "$3: $got bytes over the cp group in a step, the formula says $2 ($line)"
}
want_a2a=$(( M * (L * 8 * (N - 1) * blk / N * 2 + rest) ))
want_ring=$(( M * (L * ((N - 1) * 4 * blk * 2 + (N - 1) * 2 * blk * 4) + rest) ))
cp_bytes cp2 $want_a2a "--cp 2 --cp-mode a2a"
cp_bytes ring2 $want_ring "--cp 2 --cp-mode ring"
pass "cp bytes per step: a2a $want_a2a, ring $want_ring (bf16 all-to-alls, K|V blocks and embedding gradient, fp32 dK|dV and losses) = the trainer's count"

# 4. what fast mode's context parallelism does not run: one line naming the flag
refused() {   # refused NP PATTERN FLAGS...
  local np=$1 pattern=$2 out; shift 2
  out=$($MPI "$np" "${FAST[@]}" "${ARGS[@]}" "$@" -o "$W/refused" 2>&1) && fail "fast mode $*: not refused"
  echo "$out" | grep -Eq "^error: (\[rank [0-3]\] )?$pattern" || fail "fast mode $*: no one-line refusal ($(echo "$out" | grep -m1 -i error))"
}
refused 4 "--cp with --tp: fast mode runs context parallelism without tensor parallelism.*--deterministic 1$" --cp 2 --cp-mode a2a --tp 2
refused 4 "--cp with --pp: fast mode runs context parallelism on one pipeline stage only.*--deterministic 1$" --cp 2 --cp-mode a2a --pp 2
refused 2 "--cp with experts: fast mode runs context parallelism on dense models only.*--deterministic 1$" --cp 2 --cp-mode a2a -e d2c32h2v512t32e4k2
refused 2 "--attention cudnn with --cp: .*use --attention flash or auto$" --cp 2 --cp-mode a2a --attention cudnn
refused 4 "--cp 4: --cp-mode a2a gives each rank NH/cp heads: the 2 heads per tensor-parallel rank are not a multiple of --cp 4$" --cp 4 --cp-mode a2a
pass "fast mode --cp with --tp, --pp, experts, --attention cudnn, and a2a with NH not a multiple of --cp: refused in one line"
