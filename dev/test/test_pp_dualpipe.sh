#!/usr/bin/env bash
# DualPipeV (--schedule dualpipev: DeepSeek's DualPipe cut in half, llmc/pipeline.h) and
# DualPipe (--schedule dualpipe: each stage on two ranks) under real mpirun, against one rank
# with the same microbatches (every logged loss, the samples and the final checkpoint bytes
# identical). dualpipev:
#  - --pp 1 (both hand-offs on the rank), --pp 2 and --pp 4 (8 virtual stages);
#  - data x pipeline = 2 x 2 with ZeRO 0-3, tensor x pipeline = 2 x 2 with sequence
#    parallelism, context x pipeline = 2 x 2;
#  - resume across layouts: dualpipev on 2 stages -> 2 data x 2 stages zbv (ZeRO-2) -> one rank;
#  - each rank's peak activations: DeepSeek's PP+1 = 2S+1 (microbatch, chunk) pairs;
#  - with ./train_gpt2cu_emu built: the emulated CUDA build on --pp 2 and DP 2 x PP 2 ZeRO-1,
#    identical to the CPU build;
#  - too few microbatches (M < 2S): one clear line.
# dualpipe:
#  - 2 stages, then resumed across layouts: -> one rank -> 4 stages; 2 data x 2 stages with
#    ZeRO 1 and 3;
#  - the two copies of every stage hold the same parameters and AdamW state after every step
#    (LLMC_DUALPIPE_DUMP: each rank's buffers, compared byte for byte with its mirror's);
#  - peak activations S+1 (DeepSeek's PP+1); the emulated CUDA build on 2 stages when built;
#  - an odd number of stages, an odd number of microbatches fewer than 2S: one line each.
# with experts (4 per layer, top 2; the split backward of an expert layer): dualpipev and
# dualpipe on 2 stages (-r 1), on 2 data x 2 stages with --ep 2 x ZeRO 1-3 (dualpipe's copies
# compared after every step), and dualpipev --ep 2 in the emulated CUDA build when built.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d /tmp/llmc_dualpipe_test.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

build/testdata tokens "$W/train.bin" 20000 64 1 && build/testdata tokens "$W/val.bin" 3000 64 2 || fail "test data"
COMMON=(-e d4c32h2v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 3 -m 3 -s 3 -g 5 -l 3e-3 --shuffle 0 -c 0.1)
DV=(--schedule dualpipev)

# 4 microbatches per step (-d 128 = 4 x B*T): 2 stages need at least 2S = 4 per data-parallel rank
run ref 1 "${COMMON[@]}" -d 128 -x 4 -n 4 -o "$W/ref"
run ref8 1 "${COMMON[@]}" -d 256 -x 4 -n 4 -o "$W/ref8"
for layout in "1 --pp 1:128:ref" "2 --pp 2:128:ref" "4 --pp 2 --tp 2 --sp 1:128:ref" "4 --pp 2 --cp 2:128:ref" \
              "4 --pp 2 -z 0:256:ref8" "4 --pp 2 -z 1:256:ref8" "4 --pp 2 -z 2:256:ref8" "4 --pp 2 -z 3:256:ref8"; do
  IFS=: read -r flags batch reference <<<"$layout"
  set -- $flags
  np=$1; shift
  name=dv$(echo "$flags" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -d "$batch" -x 4 -n 4 "$@" "${DV[@]}" -o "$W/$name"
  same "$reference" "$name" 4
done
grep -q "pipeline activations held per stage (peak, [^:]*): 5 5$" "$W/dv2pp2.out" \
  || fail "dualpipev on 2 stages: each rank's peak should be 2S+1 = 5 (microbatch, chunk) pairs: $(grep 'activations held' "$W/dv2pp2.out")"
pass "dualpipev on 1 and 2 stages, with TP 2 + SP, CP 2, and 2 data x 2 pipeline x ZeRO 0-3: identical to one rank; peak 2S+1 activations"

# 4 stages x 2 chunks = 8 virtual stages: a model of 8 layers, 8 microbatches
E8=(-e d8c32h2v64t32)
run ref8l 1 "${COMMON[@]}" "${E8[@]}" -d 256 -x 3 -n 3 -o "$W/ref8l"
run dv4 4 "${COMMON[@]}" "${E8[@]}" -d 256 -x 3 -n 3 --pp 4 "${DV[@]}" -o "$W/dv4"
same ref8l dv4 3
grep -q "pipeline activations held per stage (peak, [^:]*): 9 9 9 9$" "$W/dv4.out" \
  || fail "dualpipev on 4 stages: each rank's peak should be 2S+1 = 9: $(grep 'activations held' "$W/dv4.out")"
pass "dualpipev on 4 stages (8 virtual stages): identical to one rank; peak 2S+1 = 9 activations on every rank"

# resume: dualpipev on 2 stages -> 2 data x 2 stages zbv with ZeRO-2 -> one rank
run long 1 "${COMMON[@]}" -d 256 -x 6 -n 6 -o "$W/long"
run a 2 "${COMMON[@]}" -d 256 -x 6 -n 2 --pp 2 "${DV[@]}" -o "$W/a"
mkdir -p "$W/b" "$W/c"
cp "$W/a/model_00000002.bin" "$W"/a/state_00000002_* "$W/a/DONE_00000002" "$W/b/"
run b 4 "${COMMON[@]}" -d 256 -x 6 -n 2 --pp 2 -z 2 --schedule zbv -o "$W/b" -y 1
cp "$W/b/model_00000004.bin" "$W"/b/state_00000004_* "$W/b/DONE_00000004" "$W/c/"
run c 1 "${COMMON[@]}" -d 256 -x 6 -n 2 -o "$W/c" -y 1
cmp -s "$W/long/model_00000006.bin" "$W/c/model_00000006.bin" || fail "resumed dualpipev 2 stages -> 2x2 zbv ZeRO-2 -> 1 rank differs"
diff <(grep trl "$W/long/main.log" | sed -n '3,6p') <(grep trl "$W/b/main.log") >/dev/null || fail "losses after the first resume differ"
diff <(grep trl "$W/long/main.log" | sed -n '5,6p') <(grep trl "$W/c/main.log") >/dev/null || fail "losses after the second resume differ"
pass "resume dualpipev 2 stages -> 2 data x 2 stages zbv ZeRO-2 -> 1 rank: identical"

# the emulated CUDA build (deterministic kernels on dev/gpu/emu) runs the same lists
if [ -x ./train_gpt2cu_emu ]; then
  for layout in "2 --pp 2:128:ref" "4 --pp 2 -z 1:256:ref8"; do
    IFS=: read -r flags batch reference <<<"$layout"
    set -- $flags
    np=$1; shift
    name=emu$(echo "$flags" | tr -d ' -')
    $MPI "$np" ./train_gpt2cu_emu --deterministic 1 "${COMMON[@]}" -d "$batch" -x 4 -n 4 "$@" "${DV[@]}" -o "$W/$name" \
      >"$W/$name.out" 2>&1 || { tail -5 "$W/$name.out"; fail "$name: train_gpt2cu_emu exited with an error"; }
    same "$reference" "$name" 4
  done
  pass "the emulated CUDA build: dualpipev on 2 stages and 2 data x 2 stages ZeRO-1 identical to the CPU build's one rank"
else
  echo "     (./train_gpt2cu_emu not built: its dualpipev runs skipped; make train_gpt2cu_emu)"
fi

# refused NAME NP PATTERN ARGS...: train_gpt2 on NP ranks stops with one error line matching PATTERN
refused() {
  local name=$1 np=$2 pattern=$3
  shift 3
  $MPI "$np" $BIN "${COMMON[@]}" "$@" -x 1 >"$W/$name.out" 2>&1 && fail "$name should be refused"
  grep -q "error: .*$pattern" "$W/$name.out" || fail "$name: no clear error: $(grep error "$W/$name.out")"
}
refused dualpipev-few 2 "--schedule dualpipev with -d 96 .*at least 2 x stages = 4 microbatches, got 3" \
  -d 96 --pp 2 "${DV[@]}"
pass "refusals: M < 2S"

# ---- dualpipe: every stage on rank s and its mirror S-1-s ----
DP=(--schedule dualpipe)
# copies NAME S FIRST LAST: after each step FIRST..LAST every dumped rank's buffers equal its mirror's
copies() {
  local d="$W/$1.dump" s step f
  for step in $(seq "$3" "$4"); do
    for f in "$d"/copy_$(printf %08d "$step")_*_pp0.bin; do
      [ -s "$f" ] || fail "$1: no dump of step $step"
      for s in $(seq 0 $(($2 / 2 - 1))); do
        cmp -s "${f%_pp0.bin}_pp$s.bin" "${f%_pp0.bin}_pp$(($2 - 1 - s)).bin" \
          || fail "$1: after step $step the copies of stage $s (pp $s and pp $(($2 - 1 - s))) differ: ${f##*/}"
      done
    done
  done
}
# dumped NAME NP ARGS...: run with LLMC_DUALPIPE_DUMP into $W/NAME.dump
dumped() { mkdir -p "$W/$1.dump"; LLMC_DUALPIPE_DUMP="$W/$1.dump" run "$@"; }

# 2 stages from scratch (6 steps, checkpoints 2, 4, 6) -> one rank from step 2 -> 4 stages from
# step 4: each identical to the one-rank run, the copies identical after every step
dumped pa 2 "${COMMON[@]}" -d 256 -x 6 -n 2 --pp 2 "${DP[@]}" -o "$W/pa"
same long pa 6
copies pa 2 1 6
mkdir -p "$W/pb" "$W/pc"
cp "$W/pa/model_00000002.bin" "$W"/pa/state_00000002_* "$W/pa/DONE_00000002" "$W/pb/"
run pb 1 "${COMMON[@]}" -d 256 -x 6 -n 2 -o "$W/pb" -y 1
cp "$W/pb/model_00000004.bin" "$W"/pb/state_00000004_* "$W/pb/DONE_00000004" "$W/pc/"
dumped pc 4 "${COMMON[@]}" -d 256 -x 6 -n 2 --pp 4 "${DP[@]}" -o "$W/pc" -y 1
copies pc 4 5 6
cmp -s "$W/long/model_00000006.bin" "$W/pc/model_00000006.bin" || fail "resumed dualpipe 2 stages -> 1 rank -> dualpipe 4 stages differs"
diff <(grep trl "$W/long/main.log" | sed -n '3,6p') <(grep trl "$W/pb/main.log") >/dev/null || fail "losses after resuming from dualpipe differ"
diff <(grep trl "$W/long/main.log" | sed -n '5,6p') <(grep trl "$W/pc/main.log") >/dev/null || fail "losses after resuming into dualpipe differ"
grep -q "pipeline activations held per stage (peak, [^:]*): 5 5 5 5$" "$W/pc.out" \
  || fail "dualpipe on 4 stages: each rank's peak should be S+1 = 5: $(grep 'activations held' "$W/pc.out")"
pass "dualpipe on 2 stages, resumed on one rank, resumed on 4 stages: identical to one rank; each stage's copies identical after every step; peak S+1"

for z in 1 3; do   # ZeRO-1 reduces after the copies' sum, ZeRO-3 reduce-scatters before it
  dumped dpz$z 4 "${COMMON[@]}" -d 256 -x 4 -n 4 --pp 2 -z $z "${DP[@]}" -o "$W/dpz$z"
  same ref8 dpz$z 4
  copies dpz$z 2 1 4
done
pass "dualpipe on 2 data x 2 stages, ZeRO 1 and 3: identical to one rank; copies identical after every step"

if [ -x ./train_gpt2cu_emu ]; then
  $MPI 2 ./train_gpt2cu_emu --deterministic 1 "${COMMON[@]}" -d 128 -x 4 -n 4 --pp 2 "${DP[@]}" -o "$W/emudp" \
    >"$W/emudp.out" 2>&1 || { tail -5 "$W/emudp.out"; fail "emudp: train_gpt2cu_emu exited with an error"; }
  same ref emudp 4
  pass "the emulated CUDA build: dualpipe on 2 stages identical to the CPU build's one rank"
fi

refused dualpipe-3-stages 3 "--schedule dualpipe with -d 192 .*needs an even number of stages, got 3" \
  -d 192 --pp 3 "${DP[@]}"
refused dualpipe-few 2 "--schedule dualpipe with -d 96 .*an even number of microbatches, at least 2 x stages = 4, got 3" \
  -d 96 --pp 2 "${DP[@]}"
pass "dualpipe refusals: odd stages, M odd and < 2S"

# ---- with experts: every expert layer's backward split (input half with EP's all-to-alls of
# gradients, weight half later), in the F&B pairs too ----
MOE=(-e d4c32h2v64t32e4k2 --aux-loss 0.05)
run mref 1 "${COMMON[@]}" "${MOE[@]}" -d 128 -x 3 -n 3 -o "$W/mref"
run mref8 1 "${COMMON[@]}" "${MOE[@]}" -d 256 -x 3 -n 3 -o "$W/mref8"
for layout in "2 --pp 2 --schedule dualpipev:128:mref" "2 --pp 2 --schedule dualpipe -r 1:128:mref" \
              "4 --pp 2 --ep 2 --schedule dualpipev -z 2:256:mref8" "4 --pp 2 --ep 2 --schedule dualpipe -z 1:256:mref8" \
              "4 --pp 2 --ep 2 --schedule dualpipe -z 3:256:mref8"; do
  IFS=: read -r flags batch reference <<<"$layout"
  set -- $flags
  np=$1; shift
  name=moe$(echo "$flags" | tr -d ' -')
  dumped "$name" "$np" "${COMMON[@]}" "${MOE[@]}" -d "$batch" -x 3 -n 3 "$@" -o "$W/$name"
  same "$reference" "$name" 3
  case "$flags" in *"schedule dualpipe "*|*"schedule dualpipe") copies "$name" 2 1 3 ;; esac
done
pass "dualpipev and dualpipe with experts (-r 1, --ep 2 x ZeRO 1-3): identical to one rank; dualpipe's copies identical after every step"
if [ -x ./train_gpt2cu_emu ]; then
  $MPI 4 ./train_gpt2cu_emu --deterministic 1 "${COMMON[@]}" "${MOE[@]}" -d 256 -x 3 -n 3 --pp 2 --ep 2 "${DV[@]}" \
    -o "$W/emumoe" >"$W/emumoe.out" 2>&1 || { tail -5 "$W/emumoe.out"; fail "emumoe: train_gpt2cu_emu exited with an error"; }
  same mref8 emumoe 3
  pass "the emulated CUDA build: dualpipev with experts on 2 data x 2 stages --ep 2 identical to the CPU build's one rank"
fi
echo "all dualpipe tests passed"
