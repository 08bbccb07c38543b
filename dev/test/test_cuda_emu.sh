#!/usr/bin/env bash
# The CUDA trainer's deterministic path, end to end, without a GPU: train_gpt2cu_emu
# --deterministic 1 (train_gpt2.cu's kernels, launches and host code on the emulated GPU of
# dev/gpu/emu, device memory unreadable by the host, blocks and threads shuffled) against the
# CPU reference ./train_gpt2 with the same flags: identical main.log, samples, model and
# optimizer-state bytes. One rank: validation and sampling, gradient accumulation (-d),
# clipping with warmup, a cosine schedule and weight decay, GELU stored (-r 0), resume with -y
# from its own checkpoint and from the CPU build's (and the other way round). Several ranks
# (the MPI transport staging device buffers through host memory): DP 2 x ZeRO 0-3, DP 4 x
# ZeRO 3, TP 2 (+SP), PP 2 (1f1b, gpipe, zb1, zbv, interleaved) and the 2x2x2 grid; a
# mixture-of-experts model on one rank and with expert parallelism (--ep 2, alone and with TP 2
# and ZeRO-3); context parallelism: CP 2 and 4 (ring), CP 2 (all-to-all), CP 2 x TP 2 + SP,
# DP 2 x CP 2 with ZeRO-2, CP 2 x PP 2 zbv.
# Exits non-zero on the first difference, saying which.
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d /tmp/llmc_cuda_emu.XXXXXX)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }
MPI=dev/test/mpi.sh
[ -x ./train_gpt2cu_emu ] || fail "./train_gpt2cu_emu is not built (make train_gpt2cu_emu)"

build/testdata tokens "$W/train.bin" 20000 64 1 || fail "could not write test tokens"
build/testdata tokens "$W/val.bin" 3000 64 2 || fail "could not write test tokens"
COMMON=(-e d2c32h2v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -v 3 -m 3 -s 3 -g 8 -l 3e-3 --shuffle 0)

# run BUILD NAME NP args...: train_gpt2 (BUILD cpu) or train_gpt2cu_emu --deterministic 1 (emu) on
# NP ranks, output in $W/BUILD_NAME; fails on an error exit
run() {
  local build=$1 name=$2 np=$3; shift 3
  local bin=(./train_gpt2)
  [ "$build" = emu ] && bin=(./train_gpt2cu_emu --deterministic 1)
  $MPI "$np" "${bin[@]}" "${COMMON[@]}" "$@" -o "$W/${build}_$name" >"$W/${build}_$name.out" 2>&1 \
    || { tail -5 "$W/${build}_$name.out"; fail "$name: ${bin[0]} on $np rank(s) exited with an error"; }
}

# both NAME NP args...: the CPU build and the emulated CUDA build, the same flags; identical
both() {
  run cpu "$@"
  run emu "$@"
  same "cpu_$1" "emu_$1" "$1"
}

# same A B NAME: identical main.log, samples and model files, and (runs of the same layout)
# optimizer-state files; other layouts cut the state into other pieces (their resume across
# layouts is test_dp.sh's)
same() {
  cmp -s "$W/$1/main.log" "$W/$2/main.log" || fail "$3: main.log differs ($(diff "$W/$1/main.log" "$W/$2/main.log" | head -3))"
  local files=0 f states="$W/$1/state_*.bin"
  [ "$(ls "$W/$1" | grep -c '^state_')" = "$(ls "$W/$2" | grep -c '^state_')" ] || states=""
  for f in "$W/$1"/model_*.bin $states; do
    [ -f "$f" ] || continue
    cmp -s "$f" "$W/$2/$(basename "$f")" || fail "$3: $(basename "$f") differs"
    files=$((files + 1))
  done
  [ $files -ge 1 ] || fail "$3: no checkpoint files were compared"
  diff <(grep -A2 generating "$W/$1.out") <(grep -A2 generating "$W/$2.out") >/dev/null || fail "$3: samples differ"
  grep -q generating "$W/$2.out" || [ "${NO_SAMPLES:-0}" = 1 ] || fail "$3: no sample was printed"
}

both base 1 -x 6 -n 3
pass "one rank: 6 steps with validation, sampling, 2 checkpoints"
both accum 1 -x 4 -n 4 -d 256
pass "gradient accumulation: 4 microbatches per step"
both clip 1 -x 6 -n 6 --grad-clip 0.3 -u 3 -q 0.1 -k cosine -c 0.1 -r 0
pass "clipping (norms above 0.3), warmup + cosine, weight decay, GELU stored"
grep -q "norm 0.[3-9]\|norm [1-9]" "$W/emu_clip.out" || fail "clip: no step had a norm above the clip, the test proved nothing"

# resume from step 3: the emulated build from its own checkpoint and from the CPU build's, the
# CPU build from the emulated build's; all end with the uninterrupted run's bytes
for pair in emu:emu cpu:emu emu:cpu; do
  from=${pair%%:*} to=${pair##*:}
  r="$W/resume_${from}_$to"
  mkdir -p "$r"
  cp "$W/${from}_base/model_00000003.bin" "$W/${from}_base/state_00000003_00000.bin" "$W/${from}_base/DONE_00000003" "$r/"
  if [ "$to" = emu ]; then bin=(./train_gpt2cu_emu --deterministic 1); else bin=(./train_gpt2); fi
  "${bin[@]}" "${COMMON[@]}" -x 6 -n 3 -o "$r" -y 1 >"$r.out" 2>&1 || { tail -5 "$r.out"; fail "resume $from -> $to exited with an error"; }
  grep -q resuming "$r.out" || fail "resume $from -> $to did not resume"
  for f in model_00000006.bin state_00000006_00000.bin; do
    cmp -s "$W/cpu_base/$f" "$r/$f" || fail "resume $from -> $to: $f differs from the uninterrupted run"
  done
done
pass "resume with -y: emulated <-> CPU checkpoints, the uninterrupted run's bytes"

command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun, the multi-rank layouts are not tested"; exit 0; }
# every layout of the emulated build against ONE rank of the CPU build at the same global batch
run cpu ref_d256 1 -x 3 -n 3 -d 256
for z in 0 1 2 3; do run emu "dp2z$z" 2 -x 3 -n 3 -d 256 -z "$z"; same cpu_ref_d256 "emu_dp2z$z" "DP 2 x ZeRO $z"; done
pass "DP 2 x ZeRO 0-3 = one rank"
run emu dp4z3 4 -x 3 -n 3 -d 256 -z 3
same cpu_ref_d256 emu_dp4z3 "DP 4 x ZeRO 3"
pass "DP 4 x ZeRO 3 = one rank"
run emu pp2 2 -x 3 -n 3 --pp 2 -d 256
run emu pp2gpipe 2 -x 3 -n 3 --pp 2 -d 256 --schedule gpipe
same cpu_ref_d256 emu_pp2 "PP 2 1f1b"
same cpu_ref_d256 emu_pp2gpipe "PP 2 gpipe"
pass "PP 2 (1f1b, gpipe) = one rank"
# the schedules with split backwards and several chunks per rank (4 layers: 2 stages x 2 chunks)
run emu pp2zb1 2 -x 3 -n 3 --pp 2 -d 256 --schedule zb1
same cpu_ref_d256 emu_pp2zb1 "PP 2 zb1"
run cpu ref_d4 1 -x 3 -n 3 -d 256 -e d4c32h2v64t32
run emu pp2zbv 2 -x 3 -n 3 --pp 2 -d 256 -e d4c32h2v64t32 --schedule zbv
run emu pp2il 2 -x 3 -n 3 --pp 2 -d 256 -e d4c32h2v64t32 --schedule interleaved --vpp 2
same cpu_ref_d4 emu_pp2zbv "PP 2 zbv"
same cpu_ref_d4 emu_pp2il "PP 2 interleaved"
pass "PP 2 zb1, zbv, interleaved (2 chunks per rank) = one rank"
run cpu ref 1 -x 3 -n 3
run emu tp2 2 -x 3 -n 3 --tp 2
run emu tp2sp 2 -x 3 -n 3 --tp 2 --sp 1
same cpu_ref emu_tp2 "TP 2"
same cpu_ref emu_tp2sp "TP 2 + SP"
pass "TP 2, TP 2 + SP = one rank"
run emu cp2 2 -x 3 -n 3 --cp 2
run emu cp4 4 -x 3 -n 3 --cp 4
run emu cp2a2a 2 -x 3 -n 3 --cp 2 --cp-mode a2a
run emu cp2tp2sp 4 -x 3 -n 3 --cp 2 --tp 2 --sp 1
run emu dp2cp2z2 4 -x 3 -n 3 --cp 2 -z 2 -d 256
same cpu_ref emu_cp2 "CP 2 (ring)"
same cpu_ref emu_cp4 "CP 4 (ring)"
same cpu_ref emu_cp2a2a "CP 2 (all-to-all)"
same cpu_ref emu_cp2tp2sp "CP 2 x TP 2 + SP"
same cpu_ref_d256 emu_dp2cp2z2 "DP 2 x CP 2, ZeRO 2"
# context parallelism inside a split backward: each layer's per-sequence gradients finished
# over the cp group in the weight half
run emu cp2pp2zbv 4 -x 3 -n 3 --cp 2 --pp 2 -d 256 -e d4c32h2v64t32 --schedule zbv
same cpu_ref_d4 emu_cp2pp2zbv "CP 2 x PP 2 zbv"
pass "CP 2 and 4 (ring), CP 2 (all-to-all), CP 2 x TP 2 + SP, DP 2 x CP 2 with ZeRO-2, CP 2 x PP 2 zbv = one rank"
run cpu ref_d512 1 -x 2 -n 2 -d 512
run emu grid 8 -x 2 -n 2 --tp 2 --pp 2 -d 512 -z 1
same cpu_ref_d512 emu_grid "the 2x2x2 grid"
pass "the 2x2x2 grid (DP 2 x TP 2 x PP 2, ZeRO 1) = one rank"

# a mixture of experts (llmc/moe.h on llmc/kernels_moe_det.cuh): 4 experts, top 2
MOE=(-e d2c32h2v64t32e4k2 --aux-loss 0.05 -c 0.1)
both moe 1 -x 3 -n 3 -d 256 "${MOE[@]}"
pass "a mixture of experts on one rank = train_gpt2"
run emu moe_ep2 2 -x 3 -n 3 -d 256 "${MOE[@]}" --ep 2
run emu moe_ep2tp2 4 -x 3 -n 3 -d 256 "${MOE[@]}" --ep 2 --tp 2 -z 3
same cpu_moe emu_moe_ep2 "--ep 2"
same cpu_moe emu_moe_ep2tp2 "--ep 2 --tp 2 -z 3"
pass "expert parallelism --ep 2, and with --tp 2 and ZeRO-3 = one CPU rank"
