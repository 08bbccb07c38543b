#!/usr/bin/env bash
# Fast mode (bf16, the cuBLASLt stand-in, flash attention) end to end on the emulated GPU:
# ./train_gpt2cu_emu --deterministic 0 against the fp32 CPU reference ./train_gpt2 with the same
# flags, within the bf16 tolerances of dev/gpu/check.sh (the formulas defined once, in
# dev/gpu/fast_tolerance.awk, and run by both), then the exact properties that need none:
#   1. synthetic tokens, V=512: step 0 and the drift of 4 steps with validation and sampling;
#      the banner says the flash kernels run (the emulator has no cuDNN)
#   2. real tiny-Shakespeare tokens (V=50257), one repeated batch: step 0 and 3 steps' drift;
#      its main.log is dev/gpu/golden's, byte for byte (the numbers check.sh compares a GPU with)
#   3. bit-identical across LLMC_EMU_SEED (block and thread order): main.log, checkpoint bytes
#      and samples; fast mode's own run-to-run determinism
#   4. DP 2 x ZeRO 0-3 (mpirun -np 2, the staged MPI transport) identical to one rank of fast
#      mode with the same global batch -d: main.log and the checkpoint bytes; against formulas
#      (zero.h BF16 WEIGHTS): the bf16 weights per rank (the startup table's line and the
#      accounting line: every unit at ZeRO 0-2, the gathered units' buffers at ZeRO-3), the
#      fp32 parameters per rank (the shard only from ZeRO-1 on) and the parameter bytes per step
#      (the all-gathers carry bf16: half of fp32's)
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d /tmp/llmc_fast_e2e.XXXXXX)
trap 'rm -rf "$W"' EXIT
. dev/test/lib.sh   # fail, pass, MPI
export OMP_NUM_THREADS=1   # 2 shared cores: OpenMP threads would only wait on each other
for f in ./train_gpt2 ./train_gpt2cu_emu build/testdata; do [ -x "$f" ] || fail "$f is not built (make test builds it)"; done

build/testdata tokens "$W/train.bin" 20000 512 1 || fail "could not write test tokens"
build/testdata tokens "$W/val.bin" 3000 512 2 || fail "could not write test tokens"
SYN=(-e d2c64h2v512t64 -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 64 -l 1e-3 --shuffle 0)

# run NAME NP BIN... : output in $W/NAME (+ NAME.out); fails on an error exit
run() {
  local name=$1 np=$2; shift 2
  $MPI "$np" "$@" -o "$W/$name" >"$W/$name.out" 2>&1 || { tail -5 "$W/$name.out"; fail "$name: $1 exited with an error"; }
}
FAST=(./train_gpt2cu_emu --deterministic 0)

# within NAME L N CPU FAST: fast_tolerance.awk's step-0 and drift verdicts
within() {
  local res s0 dr
  res=$(awk -v L="$2" -v N="$3" -v drift="$W/drift_$1.txt" -f dev/gpu/fast_tolerance.awk \
        "$W/$4/main.log" "$W/$4/main.log" "$W/$5/main.log")
  s0=$(echo "$res" | sed -n 's/^S0 //p') dr=$(echo "$res" | sed -n 's/^DRIFT //p')
  [ "${s0%% *}" = ok ] || { cat "$W/drift_$1.txt"; fail "$1: step 0 vs the CPU: ${s0#* }"; }
  [ "${dr%% *}" = ok ] || { cat "$W/drift_$1.txt"; fail "$1: drift vs the CPU: ${dr#* }"; }
  pass "$1 vs the CPU: step 0 ${s0#* }; ${dr#* }"
}

# identical A B WHAT: main.log and the model files of A in B byte for byte, and the optimizer
# state files when both runs cut the state into the same pieces (ZeRO 1-3 shard it by rank)
identical() {
  local f states=""
  [ "$(ls "$W/$1" | grep -c '^state_')" = "$(ls "$W/$2" | grep -c '^state_')" ] && states=$(cd "$W/$1" && ls state_*.bin)
  ls "$W/$1" | grep -q '^model_' || fail "$3: no checkpoint was written"
  for f in main.log $(cd "$W/$1" && ls model_*.bin) $states; do
    cmp -s "$W/$1/$f" "$W/$2/$f" || fail "$3: $f differs"
  done
}

# 1. synthetic tokens
run cpu_syn 1 ./train_gpt2 "${SYN[@]}" -x 4 -v 2 -m 2 -s 4 -g 8 -n 4
run fast_syn 1 "${FAST[@]}" "${SYN[@]}" -x 4 -v 2 -m 2 -s 4 -g 8 -n 4
grep -q '^| attention     flash attention (cuDNN cannot: the emulated GPU has no cuDNN)$' "$W/fast_syn.out" \
  || fail "synthetic: the banner must say the flash kernels run ($(grep '^| attention' "$W/fast_syn.out"))"
grep -q '^generating:' "$W/fast_syn.out" || fail "synthetic: no sample printed"
grep -q 'tel:' "$W/fast_syn/main.log" || fail "synthetic: no validation loss logged"
within "synthetic V=512 (L=2, B=4 T=64)" 2 256 cpu_syn fast_syn

# 2. real tokens: one repeated batch (-a 1) of tiny Shakespeare, as check.sh's stage 2 on a GPU
D=dev/data/tinyshakespeare
if [ ! -f $D/tiny_shakespeare_train.bin ]; then
  make data >"$W/data.out" 2>&1 || { tail -3 "$W/data.out"; fail "make data failed: this test needs tiny Shakespeare"; }
fi
# the run dev/gpu/golden holds the emulated numbers of (check.sh compares a GPU's with them)
GOLDEN=dev/gpu/golden/fast_emu_tinyshakespeare
read -r -a REAL <"$GOLDEN.args" || fail "cannot read $GOLDEN.args"
REAL+=(-i $D/tiny_shakespeare_train.bin -j $D/tiny_shakespeare_val.bin)
run cpu_real 1 ./train_gpt2 "${REAL[@]}"
run fast_real 1 "${FAST[@]}" --attention flash "${REAL[@]}"
within "tiny Shakespeare (L=2, B=2 T=16)" 2 32 cpu_real fast_real
cmp -s "$GOLDEN.log" "$W/fast_real/main.log" || fail "$GOLDEN.log is not what the emulated fast mode computes now \
($(diff "$GOLDEN.log" "$W/fast_real/main.log" | head -3 | tr '\n' ' ')); if fast mode's arithmetic changed on purpose: \
./train_gpt2cu_emu --deterministic 0 --attention flash \$(cat $GOLDEN.args) -i $D/tiny_shakespeare_train.bin \
-j $D/tiny_shakespeare_val.bin -o DIR, then cp DIR/main.log $GOLDEN.log"
pass "$GOLDEN.log (the GPU check's emulated numbers) is what the emulator computes"

# 3. run-to-run: another block and thread order of the emulator, the same bits
for seed in 0 5; do   # 0: blocks and threads in order
  LLMC_EMU_SEED=$seed run "fast_syn_seed$seed" 1 "${FAST[@]}" "${SYN[@]}" -x 4 -v 2 -m 2 -s 4 -g 8 -n 4
  identical fast_syn "fast_syn_seed$seed" "LLMC_EMU_SEED 1 vs $seed"
  diff <(grep -A2 generating "$W/fast_syn.out") <(grep -A2 generating "$W/fast_syn_seed$seed.out") >/dev/null \
    || fail "LLMC_EMU_SEED 1 vs $seed: samples differ"
done
pass "fast mode is bit-identical across LLMC_EMU_SEED 0, 1, 5 (main.log, checkpoints, samples)"

# 4. data parallelism and ZeRO: the same bits as one rank with the same global batch
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun, fast-mode data parallelism is not tested"; exit 0; }
DP=(-e d2c32h2v512t32 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 32 -d 128 -l 1e-3 --shuffle 0 -x 2 -v 0 -s 0 -n 2)
run fast_ref 1 "${FAST[@]}" "${DP[@]}"
# d2c32h2v512t32's units: wte Vp x C, wpe T x C, a layer 12C^2 + 13C, lnf 2C; padded to a
# multiple of 2N (a bf16 shard is whole 4-byte words); at ZeRO 0-2 the bf16 copy holds every
# unit from a multiple of 128 elements; at ZeRO-3 three buffers of the largest unit (a pass holds
# wte while it acquires wpe and prefetches layer 0). 2 bytes a bf16 weight.
C=32 L=2 Vp=512 T=32 N=2
WTE=$((Vp * C)) WPE=$((T * C)) LAYER=$((12 * C * C + 13 * C)) LNF=$((2 * C))
P=$((WTE + WPE + L * LAYER + LNF))
up() { echo $(( ($1 + $2 - 1) / $2 * $2 )); }
copy=0 largest=0
for n in $WTE $WPE $(for l in $(seq $L); do echo $LAYER; done) $LNF; do
  copy=$((copy + $(up "$(up $n $((2 * N)))" 128))); [ "$(up $n $((2 * N)))" -gt $largest ] && largest=$(up $n $((2 * N)))
done
bf16_bytes() { sed -n 's/^| bf16 weights  \([0-9]*\) bytes per rank.*/\1/p' "$W/$1.out"; }
# accounting NAME: the zero accounting line's param bytes/step, fp32 params/rank, bf16 weights/rank
accounting() {
  grep "zero accounting" "$W/$1.out" | sed 's/.*| bytes\/rank\/step grad [0-9]* param \([0-9]*\) | bytes\/rank params \([0-9]*\) .* bf16 weights \([0-9]*\)$/\1 \2 \3/'
}
for z in 0 1 2 3; do
  run "fast_dp2z$z" $N "${FAST[@]}" "${DP[@]}" -z $z
  identical fast_ref "fast_dp2z$z" "DP 2 x ZeRO $z"
  # bf16 weights; fp32 parameters (whole at ZeRO-0, the shard after); the parameter all-gathers:
  # ZeRO 1-2 every unit once a step, ZeRO-3 (one microbatch per rank) wte, lnf and each layer
  # twice (forward, backward), wpe once: 2P - wpe elements; each (N-1)/N of 2 bytes an element,
  # where fp32 all-gathers send 4
  case $z in
    0) want_w=$((2 * copy)) want_p=$((4 * P)) want_sent=0;;
    1|2) want_w=$((2 * copy)) want_p=$((4 * P / N)) want_sent=$(((N - 1) * 2 * P / N));;
    3) want_w=$((3 * 2 * largest)) want_p=$((4 * P / N)) want_sent=$(((N - 1) * 2 * (2 * P - WPE) / N));;
  esac
  got=$(bf16_bytes "fast_dp2z$z")
  [ "$got" = "$want_w" ] || fail "DP 2 x ZeRO $z: the bf16 weights take '$got' bytes per rank, want $want_w \
($(grep '^| bf16 weights' "$W/fast_dp2z$z.out"))"
  [ "$(accounting "fast_dp2z$z")" = "$want_sent $want_p $want_w" ] || fail "DP 2 x ZeRO $z: param bytes/step, fp32 \
params/rank, bf16 weights/rank '$(accounting "fast_dp2z$z")', want '$want_sent $want_p $want_w'"
done
pass "fast mode DP 2 x ZeRO 0-3 = one rank (main.log, checkpoints); per rank: bf16 weights $((2 * copy)) bytes \
(ZeRO 0-2), $((6 * largest)) (ZeRO-3: 3 buffers of the largest unit); fp32 parameters $((4 * P / N)) from ZeRO-1; \
param all-gathers in bf16: $(((N - 1) * 2 * P / N)) bytes/step at ZeRO 1-2 (fp32: $(((N - 1) * 4 * P / N)))"
