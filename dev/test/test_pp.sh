#!/usr/bin/env bash
# Pipeline parallelism under real mpirun, against one rank with the same microbatches:
#  - --pp 2 and --pp 4 with the 1f1b and gpipe schedules, and data x pipeline = 2 x 2 with
#    ZeRO 0-3: every logged loss, the samples and the final checkpoint bytes are identical;
#  - one microbatch per step (the pipeline is all bubble), and more microbatches than stages;
#  - resume across layouts: 4 stages -> 2 x 2 (ZeRO-1) -> one rank continues exactly;
#  - interleaved 1F1B (2 chunks per rank), zb1 and zbv (split backwards), alone and with DP 2 x
#    ZeRO-1: identical to one rank, each stage's peak activations the schedule's textbook bound;
#  - the startup table shows each stage's layers and peak activations (1F1B: S - stage);
#  - a rank killed in the middle of the pipeline ends the job (no hang).
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d /tmp/llmc_pp_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

build/testdata tokens "$W/train.bin" 20000 64 1 && build/testdata tokens "$W/val.bin" 3000 64 2 || fail "test data"
COMMON=(-e d4c32h2v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 3 -m 3 -s 3 -g 5 -l 3e-3 --shuffle 0 -c 0.1)

run ref 1 "${COMMON[@]}" -d 128 -x 6 -n 6 -o "$W/ref"
for layout in "2 --pp 2 --schedule 1f1b" "2 --pp 2 --schedule gpipe" "4 --pp 4 --schedule 1f1b" \
              "4 --pp 4 --schedule gpipe" "4 --pp 2 -z 0" "4 --pp 2 -z 1" "4 --pp 2 -z 2" "4 --pp 2 -z 3 --schedule gpipe"; do
  set -- $layout
  np=$1; shift
  name=$(echo "$layout" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -d 128 -x 6 -n 6 "$@" -o "$W/$name"
  same ref "$name" 6
done
pass "--pp 2/4 x 1f1b/gpipe, and 2 data x 2 pipeline x ZeRO 0-3: identical to one rank"

run ref1 1 "${COMMON[@]}" -d 32 -x 3 -n 3 -o "$W/ref1"
run pp1mb 4 "${COMMON[@]}" -d 32 -x 3 -n 3 --pp 4 -o "$W/pp1mb"
same ref1 pp1mb 3
run ref16 1 "${COMMON[@]}" -d 512 -x 2 -n 2 -o "$W/ref16"
run pp16 2 "${COMMON[@]}" -d 512 -x 2 -n 2 --pp 2 -o "$W/pp16"
same ref16 pp16 2
pass "1 microbatch per step on 4 stages, 16 microbatches on 2: identical"

# each stage's peak activations: 1F1B holds S - stage microbatches, GPipe all M
grep -q "stage 0 .* + embeddings, peak activations: 4 microbatch" "$W/4pp4schedule1f1b.out" || fail "1f1b stage 0 should hold 4 microbatches"
grep -q "stage 3 .* + head, peak activations: 1 microbatch" "$W/4pp4schedule1f1b.out" || fail "1f1b stage 3 should hold 1 microbatch"
grep -q "stage 3 .* + head, peak activations: 4 microbatch" "$W/4pp4schedulegpipe.out" || fail "gpipe stage 3 should hold all 4 microbatches"
grep -q "pipeline idle per stage" "$W/4pp4schedule1f1b.out" || fail "no measured bubble printed"
pass "stage table: 1F1B peak activations S - stage, GPipe M; measured idle time printed"

# the schedules with split backwards (zb1, zbv) and several model chunks per rank
# (interleaved, zbv), alone and with 2 data-parallel ranks under ZeRO-1: identical to one rank.
# Each stage's measured peak of (microbatch, chunk) activations held is within the textbook bound
# (M microbatches per data-parallel rank, S stages, v chunks): interleaved
# min(2(S-s-1) + (v-1)S + 1, vM) (Megatron-LM's warmup + 1), zb1 min(S, M) (ZB-H1 keeps 1F1B's
# stage-0 memory), zbv min(2S, 2M) (ZB-V: S microbatches of a 1F1B stage's layers).
peaks=""
for layout in "2 --pp 2 --schedule interleaved --vpp 2:5 3" "4 --pp 4 --schedule zb1:4 4 4 4" \
              "2 --pp 2 --schedule zbv:4 4" "4 --pp 2 --schedule interleaved --vpp 2 -z 1:4 3" \
              "8 --pp 4 --schedule zb1 -z 1:2 2 2 2" "4 --pp 2 --schedule zbv -z 1:4 4"; do
  peak=${layout##*:}
  set -- ${layout%%:*}
  np=$1; shift
  name=$(echo "${layout%%:*}" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -d 128 -x 6 -n 6 "$@" -o "$W/$name"
  same ref "$name" 6
  got=$(sed -n 's/^pipeline activations held per stage (peak, [^:]*): //p' "$W/$name.out")
  paste -d' ' <(echo "$got" | tr ' ' '\n') <(echo "$peak" | tr ' ' '\n') | awk '$1 < 1 || $1 > $2 { bad = 1 } END { exit bad }' \
    || fail "$name: peak activations held per stage '$got', the schedule's bound is '$peak'"
  [ "$(echo "$got" | wc -w)" = "$(echo "$peak" | wc -w)" ] || fail "$name: no peak activations per stage printed"
  peaks="$peaks $name: $got (bound $peak);"
done
echo "     measured peaks:$peaks"
grep -q "stage 0 .*layers \[0, 1) \[2, 3) + embeddings" "$W/2pp2scheduleinterleavedvpp2.out" || fail "interleaved: stage 0 should hold layers 0 and 2"
grep -q "stage 0 .*layers \[0, 1) \[3, 4) + embeddings + head" "$W/2pp2schedulezbv.out" || fail "zbv: stage 0 should hold layers 0 and 3, the embeddings and the head"
grep -q "^  dev/tools/pp_schedule --stages 2 --microbatches 4 --schedule zbv --fwd [0-9.,]* --bwd [0-9.,]* --wgt [0-9.,]* --svg" \
  "$W/2pp2schedulezbv.out" || fail "zbv: no command drawing the schedule from its measured F, B and W costs"
pass "interleaved (2 chunks), zb1 (4 stages), zbv, and each with 2 data x ZeRO-1: identical to one rank; peak activations within the textbook bound"

# resume: 4 stages -> 2 data x 2 stages with ZeRO-1 -> one rank
run long 1 "${COMMON[@]}" -d 128 -x 9 -n 9 -o "$W/long"
run a 4 "${COMMON[@]}" -d 128 -x 9 -n 3 --pp 4 -o "$W/a"
mkdir -p "$W/b" "$W/c"
cp "$W/a/model_00000003.bin" "$W"/a/state_00000003_* "$W/a/DONE_00000003" "$W/b/"
run b 4 "${COMMON[@]}" -d 128 -x 9 -n 3 --pp 2 -z 1 -o "$W/b" -y 1
cp "$W/b/model_00000006.bin" "$W"/b/state_00000006_* "$W/b/DONE_00000006" "$W/c/"
run c 1 "${COMMON[@]}" -d 128 -x 9 -n 3 -o "$W/c" -y 1
cmp -s "$W/long/model_00000009.bin" "$W/c/model_00000009.bin" || fail "resumed 4 stages -> 2x2 ZeRO-1 -> 1 rank differs"
diff <(grep trl "$W/long/main.log" | sed -n '4,9p') <(grep trl "$W/b/main.log") >/dev/null || fail "losses after the first resume differ"
diff <(grep trl "$W/long/main.log" | sed -n '7,9p') <(grep trl "$W/c/main.log") >/dev/null || fail "losses after the second resume differ"
pass "resume 4 stages -> 2 data x 2 stages ZeRO-1 -> 1 rank: identical"

# bad layouts
$MPI 2 $BIN "${COMMON[@]}" -e d1c32h2v64t32 --pp 2 -x 1 >"$W/bad.out" 2>&1 && fail "--pp 2 with 1 layer should fail"
grep -q "error: .*only 1 layers" "$W/bad.out" || fail "no clear error for --pp > layers"
$MPI 2 $BIN "${COMMON[@]}" --pp 3 -x 1 >"$W/bad2.out" 2>&1 && fail "--pp 3 on 2 ranks should fail"
grep -q "error: .*does not divide" "$W/bad2.out" || fail "no clear error for --pp not dividing the ranks"
$MPI 2 $BIN "${COMMON[@]}" --pp 2 --schedule interleaved --vpp 4 -x 1 >"$W/bad3.out" 2>&1 && fail "8 virtual stages of 4 layers should fail"
grep -q "error: .*8 virtual stages: the model has only 4 layers" "$W/bad3.out" || fail "no clear error for more virtual stages than layers"
$MPI 2 $BIN "${COMMON[@]}" --pp 2 --schedule interleaved -d 96 -x 1 >"$W/bad4.out" 2>&1 && fail "interleaved with 3 microbatches on 2 stages should fail"
grep -q "error: .*--schedule interleaved with -d 96 .*multiple of the number of stages" "$W/bad4.out" || fail "no clear error for interleaved with M not a multiple of S"
$BIN "${COMMON[@]}" --schedule zbv --vpp 3 -x 1 >"$W/bad5.out" 2>&1 && fail "zbv with 3 chunks should fail"
grep -q "error: .*--vpp 3: the zbv schedule runs 2 model chunk" "$W/bad5.out" || fail "no clear error for --vpp with zbv"
pass "bad layouts: clear errors"

# kill the middle of a 4-stage pipeline
kill_one_rank 4 3 "${COMMON[@]}" -d 128 -x 100000 -v 0 -s 0 --pp 4
pass "a stage killed mid-pipeline ends the job with an error"
echo "all pipeline-parallel tests passed"
