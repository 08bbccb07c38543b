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
#      mode with the same global batch -d: main.log and the checkpoint bytes; the bf16 copy of
#      the weights per rank (the startup table's line) against its formula: the whole model at
#      ZeRO 0-2, only the units in flight at ZeRO-3
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
# the bf16 copy of the weights per rank, from d2c32h2v512t32's shapes: ZeRO 0-2 the whole model
# (P elements); ZeRO-3 two units in flight (a pass holds one unit while it acquires the next) x
# the largest unit (wte Vp x C, wpe T x C, a layer 12C^2 + 13C, lnf 2C), 2 bytes an element
C=32 L=2 Vp=512 T=32
P=$((Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C))
largest=$((Vp * C)); for n in $((T * C)) $((12 * C * C + 13 * C)) $((2 * C)); do [ $n -gt $largest ] && largest=$n; done
bf16_bytes() { sed -n 's/^| bf16 weights  \([0-9]*\) bytes per rank.*/\1/p' "$W/$1.out"; }
for z in 0 1 2 3; do
  run "fast_dp2z$z" 2 "${FAST[@]}" "${DP[@]}" -z $z
  identical fast_ref "fast_dp2z$z" "DP 2 x ZeRO $z"
  want=$((2 * P)); [ $z = 3 ] && want=$((2 * 2 * largest))
  got=$(bf16_bytes "fast_dp2z$z")
  [ "$got" = "$want" ] || fail "DP 2 x ZeRO $z: the bf16 weights take '$got' bytes per rank, want $want \
($(grep '^| bf16 weights' "$W/fast_dp2z$z.out"))"
done
pass "fast mode DP 2 x ZeRO 0-3 = one rank (main.log, checkpoints); bf16 weights per rank: $((2 * P)) bytes \
(ZeRO 0-2), $((4 * largest)) (ZeRO-3: 2 units in flight x the largest unit)"
