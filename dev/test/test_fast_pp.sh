#!/usr/bin/env bash
# Fast mode (bf16) with pipeline parallelism on the emulated GPU (./train_gpt2cu_emu
# --deterministic 0, real mpirun), every schedule against the same fast run on one rank.
#
# The tolerance is zero: pipeline parallelism does not change the arithmetic of a layer. Each
# stage runs the one-rank kernels on the same rows; its boundary is the bf16 residual stream
# that one rank stores too (the residual add before a boundary rounds the sum as the fused
# residual + layernorm kernel does); the split backward's halves (zb1, zbv, dualpipe(v))
# compute the same outputs as the whole backward. So every logged loss and norm, the samples
# and the checkpoint bytes must be identical to one rank's:
#   1. --pp 2 with 1f1b, gpipe, interleaved (--vpp 2), zbv, dualpipev, dualpipe; 1f1b
#      samples without the KV cache (--kv-cache 0: a full forward per token), the others with
#      it (one row per token through the pipeline), so equal samples also say that the KV
#      cache's tokens are the full forward's;
#      gpipe (every forward before the first backward) and zbv (one rank holds the
#      embeddings' chunk and the head's) at ZeRO-3, whose bf16 copies exist only for the
#      units in flight (zb1, with -r 1: the weight half recomputes GELU, runs with --tp 2 in
#      test_fast_tp.sh, byte-identical to --tp 2 on one stage; test_fast_moe.sh runs it too);
#   2. --pp 4 (1f1b, one layer a stage); 2 data x 2 pipeline ranks (zbv, ZeRO-1);
#   3. the 1f1b run against the fp32 CPU reference ./train_gpt2 within
#      dev/gpu/fast_tolerance.awk's bf16 tolerances (the same formulas as test_fast_e2e.sh);
#      the bytes stage 0 sends over the pp group against their formula, bf16 in fast mode and
#      fp32 in ./train_gpt2 --pp 2;
#   (tensor parallelism, inside pipeline stages too: dev/test/test_fast_tp.sh)
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun, fast-mode pipeline parallelism is not tested"; exit 0; }
W=$(mktemp -d /tmp/llmc_fast_pp.XXXXXX)
trap 'rm -rf "$W"' EXIT
. dev/test/lib.sh   # fail, pass, MPI
. dev/test/fast_emu_lib.sh   # ARGS (4 layers: interleaved and zbv one a virtual stage; 4
                             # microbatches, as dualpipe(v) need 2 x stages), FAST, run

# identical REF NAME: main.log, the final checkpoint and the samples byte for byte
identical() {
  cmp -s "$W/$1/main.log" "$W/$2/main.log" \
    || fail "$2: main.log differs from one rank's ($(diff "$W/$1/main.log" "$W/$2/main.log" | head -2 | tr '\n' ' '))"
  cmp -s "$W/$1/model_00000002.bin" "$W/$2/model_00000002.bin" || fail "$2: the checkpoint differs from one rank's"
  grep -q '^generating:' "$W/$2.out" || fail "$2: no sample printed"
  diff <(grep -A2 generating "$W/$1.out") <(grep -A2 generating "$W/$2.out") >/dev/null \
    || fail "$2: the samples differ from one rank's"
}

run ref 1 "${FAST[@]}" "${ARGS[@]}"
grep -q 'tel:' "$W/ref/main.log" || fail "ref: no validation loss logged"

# 1. every schedule on 2 stages
for layout in "1f1b --kv-cache 0" "gpipe -z 3" "interleaved --vpp 2" "zbv -z 3" dualpipev dualpipe; do
  set -- $layout
  name=pp2_$1$( [ "${2:-}" = -z ] && echo _z3)
  run "$name" 2 "${FAST[@]}" "${ARGS[@]}" --pp 2 --schedule "$@"
  identical ref "$name"
done
grep -q "stage 0 .*layers \[0, 1) \[3, 4) + embeddings + head" "$W/pp2_zbv_z3.out" \
  || fail "zbv: stage 0 should hold layers 0 and 3, the embeddings and the head ($(grep 'stage 0' "$W/pp2_zbv_z3.out"))"
pass "fast mode --pp 2 with 1f1b, gpipe (ZeRO-3), interleaved, zbv (ZeRO-3), dualpipev, dualpipe: bit-identical \
to one rank (main.log, checkpoint, samples; 1f1b's without the KV cache = the others' with it)"

# 2. 4 stages, one layer each; 2 data x 2 pipeline ranks (zbv, ZeRO-1: the gradients reduced
# over the dp group, the tied wte's halves over the pp group)
run pp4 4 "${FAST[@]}" "${ARGS[@]}" --pp 4
identical ref pp4
run dp2_pp2_zbv 4 "${FAST[@]}" "${ARGS[@]}" --pp 2 --schedule zbv -z 1
identical ref dp2_pp2_zbv
pass "fast mode --pp 4 (1f1b) and 2 data x 2 pipeline (zbv, ZeRO-1): bit-identical to one rank"

# 3. against the fp32 reference
run cpu 1 ./train_gpt2 "${ARGS[@]}"
vs_cpu pp2_1f1b "--pp 2 1f1b"

# the bytes a step sends over the pp group from stage 0 (its table is rank 0's): each of the
# M = 4 microbatches' activations, B*T*C elements, 2 bytes in fast mode and 4 in the CPU's fp32,
# and the tied wte's gradient halves summed over the two stages (Vp*C fp32, half sent each way
# of the 2-rank exchange, twice: reduce-scatter and all-gather)
run cpu_pp2 2 ./train_gpt2 "${ARGS[@]}" --pp 2
pp_bytes() { awk '$1 == "pp" { print $3; exit }' "$W/$1.out"; }
M=4 BTC=$((1 * 32 * 32)) VpC=$((512 * 32))
for v in "pp2_1f1b 2" "cpu_pp2 4"; do
  set -- $v
  want=$((M * BTC * $2 + 4 * VpC)) got=$(pp_bytes "$1")
  [ "$got" = "$want" ] || fail "$1: stage 0 sent $got bytes over the pp group in step 1, want $want ($M x $BTC x $2 + 4 x $VpC)"
done
pass "stage 0's pp bytes per step: $((M * BTC * 2 + 4 * VpC)) in fast mode (bf16 boundaries), $((M * BTC * 4 + 4 * VpC)) in fp32"

