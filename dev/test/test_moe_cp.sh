#!/usr/bin/env bash
# A mixture of experts (llmc/moe.h) with context parallelism (--cp, llmc/context_parallel.h)
# under real mpirun, against one rank (every expert layer runs on whole sequences on each rank
# of the cp group: train_gpt2.c moe_forward / moe_backward / moe_weight_backward):
#  - --cp 2 and 4 ring, --cp 2 all-to-all, with data parallelism and ZeRO 1, with --ep 2
#    (ZeRO 0, 2, 3; the edp group takes in the context ranks), with TP 2, with PP 2 (1F1B,
#    zb1's split backward), dualpipev, the grid DP 2 x CP 2 x TP 2 with --ep 2: every logged
#    loss, aux loss and norm, the samples and the checkpoint bytes are identical to one rank's;
#  - the trainer's own check of the context-parallel bytes (cp_bytes_per_step plus
#    cp_moe_bytes_per_step) says equal in every layout;
#  - resume across layouts: one rank's checkpoint continues on CP 2 x DP 2 with --ep 2 at
#    ZeRO-1, and a CP 2 x --ep 2 ZeRO-0 checkpoint (state pieces of the edp x cp group's ranks)
#    on one rank, exactly;
#  - the emulated CUDA build (when built) with --cp 2: one CPU rank's bits;
#  - --cp with --sp 1 and experts: a clear error.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d /tmp/llmc_moe_cp_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

build/testdata tokens "$W/train.bin" 20000 64 1 && build/testdata tokens "$W/val.bin" 3000 64 2 || fail "test data"
# L=2, C=32, NH=2, V=64 (Vp=128), maxT=32, 4 experts top 2; B=2, T=16, 4 microbatches per step
COMMON=(-e d2c32h2v64t32e4k2 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 3 -m 3 -s 3 -g 5 -l 3e-3
        --shuffle 0 -c 0.1 --aux-loss 0.05 -d 128)

accounting() {   # the trainer's check of the cp bytes in every step line of its output
  grep -q "cp accounting: .*(equal)" "$W/$1.out" || fail "$1: no cp accounting line says equal"
  ! grep -q "cp accounting: .*MISMATCH" "$W/$1.out" || fail "$1: the cp bytes differ from the formula"
}

run ref 1 "${COMMON[@]}" -x 4 -n 2 -o "$W/ref"
layouts=("2 --cp 2" "2 --cp 2 --cp-mode a2a" "4 --cp 4" "4 --cp 2 -z 1" "4 --cp 2 --ep 2"
         "4 --cp 2 --ep 2 -z 2 --cp-mode a2a" "4 --cp 2 --ep 2 -z 3" "4 --cp 2 --tp 2" "4 --cp 2 --pp 2"
         "4 --cp 2 --pp 2 --schedule zb1 -r 1" "8 --cp 2 --ep 2 --tp 2 -z 1")
for layout in "${layouts[@]}"; do
  set -- $layout
  np=$1; shift
  name=c$(echo "$layout" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -x 4 -n 2 "$@" -o "$W/$name"
  same ref "$name" 4
  accounting "$name"
done
pass "--cp 2/4 ring and a2a with experts, x DP (ZeRO 1), x --ep 2 (ZeRO 0, 2, 3), x TP, x PP (1F1B, zb1), DP x CP x TP x EP: identical to one rank"

# dualpipev (4 layers on 2 ranks' V) with context parallelism
run ref4 1 "${COMMON[@]}" -e d4c32h2v64t32e4k2 -x 2 -n 2 -o "$W/ref4"
run dv 4 "${COMMON[@]}" -e d4c32h2v64t32e4k2 -x 2 -n 2 --pp 2 --schedule dualpipev --cp 2 -o "$W/dv"
same ref4 dv 2
accounting dv
pass "dualpipev x --cp 2 with experts: identical to one rank"

# resume: one rank's step-2 checkpoint -> CP 2 x DP 2 x --ep 2 ZeRO-1
mkdir -p "$W/r1"
cp "$W/ref/model_00000002.bin" "$W"/ref/state_00000002_* "$W/ref/DONE_00000002" "$W/r1/"
run r1 4 "${COMMON[@]}" -x 4 -n 2 --cp 2 --ep 2 -z 1 -o "$W/r1" -y 1
cmp -s "$W/ref/model_00000004.bin" "$W/r1/model_00000004.bin" || fail "resumed 1 rank -> --cp 2 --ep 2 -z 1 differs"
# ... and CP 2 x --ep 2 at ZeRO-0 (every ep rank of cp rank 0 writes its experts' state) -> one rank
[ "$(ls "$W"/c4cp2ep2/state_00000002_* | wc -l)" = 2 ] || fail "--cp 2 --ep 2 at ZeRO-0 should write a state piece per ep rank"
mkdir -p "$W/r2"
cp "$W/c4cp2ep2/model_00000002.bin" "$W"/c4cp2ep2/state_00000002_* "$W/c4cp2ep2/DONE_00000002" "$W/r2/"
run r2 1 "${COMMON[@]}" -x 4 -n 2 -o "$W/r2" -y 1
cmp -s "$W/ref/model_00000004.bin" "$W/r2/model_00000004.bin" || fail "resumed --cp 2 --ep 2 -> 1 rank differs"
pass "resume 1 rank -> CP 2 x DP 2 x --ep 2 (ZeRO-1), and CP 2 x --ep 2 (ZeRO-0) -> 1 rank: identical final checkpoint"

# the emulated CUDA build (when built: the same model code on the device kernels), --cp 2 ring
if [ -x ./train_gpt2cu_emu ]; then
  $MPI 2 ./train_gpt2cu_emu --deterministic 1 "${COMMON[@]}" -x 2 -n 2 --cp 2 -o "$W/emu" >"$W/emu.out" 2>&1 \
    || { tail -20 "$W/emu.out"; fail "emu: exit code $?"; }
  cmp -s "$W/ref/model_00000002.bin" "$W/emu/model_00000002.bin" || fail "emu --cp 2: parameters differ from one CPU rank"
  diff <(grep "trl" "$W/ref/main.log" | head -2) <(grep "trl" "$W/emu/main.log") >/dev/null || fail "emu --cp 2: losses differ"
  pass "the emulated CUDA build, experts x --cp 2: identical to one CPU rank"
fi

# refusal: context with sequence parallelism in a model with experts
if $MPI 4 $BIN "${COMMON[@]}" -x 1 --cp 2 --tp 2 --sp 1 -o "$W/bad" >"$W/bad.out" 2>&1; then fail "--cp 2 --sp 1 with experts ran"; fi
grep -q "error: .*--cp 2 with --sp 1: a mixture-of-experts model" "$W/bad.out" || { tail -3 "$W/bad.out"; fail "--cp with --sp 1: no clear error"; }
pass "--cp 2 --sp 1 with experts: a clear error"
