#!/usr/bin/env bash
# A mixture of experts (llmc/moe.h) and expert parallelism (llmc/expert_parallel.h) under real
# mpirun, against one rank:
#  - --ep 2 and --ep 4, alone, with data parallelism and ZeRO 0-3, with tensor parallelism
#    (+ sequence parallelism) and pipeline parallelism (1F1B, GPipe), and the grid
#    DP 2 x TP 2 x PP 2 with --ep 2: every logged loss and aux loss, the samples and the final
#    checkpoint bytes are identical to one rank's;
#  - resume across layouts: a checkpoint of --ep 2 at ZeRO-0 (each ep rank writes its experts'
#    optimizer state) continues on one rank, and on 4 ranks with --ep 2 and ZeRO-3, exactly;
#  - rank 0's all-to-all bytes per step equal what its routing counts say it sent: per layer
#    pass the counts ((Q-1) E/Q ints) and positions (an int per row it dispatched), and four
#    exchanges of C floats per row (tokens out, outputs back, output gradients out, input
#    gradients back);
#  - a router that sends every token to one expert (on the other ep rank) runs, identical to
#    one rank, with the load of that expert = every slot of the step;
#  - zb1 and zbv (a split backward of every expert layer), with recompute, --ep 2 x ZeRO 1
#    and 3, --ep 2 x TP 2: identical to one rank (dualpipe and dualpipev: test_pp_dualpipe.sh);
#  - --ep that does not divide E or the data-parallel size, or a dense model: clear errors.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d /tmp/llmc_moe_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

build/testdata tokens "$W/train.bin" 20000 64 1 && build/testdata tokens "$W/val.bin" 3000 64 2 || fail "test data"
# L=2, C=32, NH=2, V=64 (Vp=128), maxT=32, 4 experts top 2; B=2, T=16, 4 microbatches per step
C=32
COMMON=(-e d2c32h2v64t32e4k2 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 3 -m 3 -s 3 -g 5 -l 3e-3
        --shuffle 0 -c 0.1 --aux-loss 0.05)

run ref 1 "${COMMON[@]}" -d 128 -x 6 -n 6 -o "$W/ref"
grep -q "aux:" "$W/ref/main.log" || fail "main.log has no aux: field"
grep -q "tokens per expert" "$W/ref.out" || fail "no expert load line"
layouts=("2 --ep 2" "4 --ep 4" "4 --ep 2" "2 --ep 2 -z 1" "2 --ep 2 -z 2" "2 --ep 2 -z 3" "4 --ep 2 -z 3"
         "4 --ep 4 -z 1" "2 -z 2"
         "2 --tp 2" "4 --ep 2 --tp 2" "4 --ep 2 --tp 2 --sp 1 -z 2" "4 --ep 2 --pp 2"
         "4 --ep 2 --pp 2 --schedule gpipe -z 3" "8 --ep 2 --tp 2 --pp 2 -z 1")
for layout in "${layouts[@]}"; do
  set -- $layout
  np=$1; shift
  name=m$(echo "$layout" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -d 128 -x 6 -n 6 "$@" -o "$W/$name"
  same ref "$name" 6
done
pass "--ep 2/4 alone, x DP with ZeRO 0-3, x TP (+SP), x PP, the 2x2x2 grid: identical to one rank"
# interleaved 1F1B (2 chunks per rank, 4 layers) with expert parallelism and ZeRO-1
run ref4 1 "${COMMON[@]}" -e d4c32h2v64t32e4k2 -d 128 -x 3 -n 3 -o "$W/ref4"
run il4 4 "${COMMON[@]}" -e d4c32h2v64t32e4k2 -d 128 -x 3 -n 3 --pp 2 --schedule interleaved --ep 2 -z 1 -o "$W/il4"
same ref4 il4 3
pass "interleaved 1F1B x --ep 2 x ZeRO-1: identical to one rank"

# the zero-bubble schedules split each expert layer's backward: the input half (with EP's
# all-to-alls of gradients) now, the router's and experts' weight gradients later (8 microbatches)
run ref4s 1 "${COMMON[@]}" -e d4c32h2v64t32e4k2 -d 256 -x 3 -n 3 -o "$W/ref4s"
for layout in "2 --pp 2 --schedule zb1" "2 --pp 2 --schedule zbv -r 1" "4 --pp 2 --schedule zb1 --ep 2 -z 1" \
              "4 --pp 2 --schedule zbv --ep 2 -z 3" "8 --pp 2 --schedule zbv --ep 2 --tp 2"; do
  set -- $layout
  np=$1; shift
  name=s$(echo "$layout" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -e d4c32h2v64t32e4k2 -d 256 -x 3 -n 3 "$@" -o "$W/$name"
  same ref4s "$name" 3
done
pass "zb1 and zbv with experts (-r 1, --ep 2 x ZeRO 1 and 3, --ep 2 x TP 2): identical to one rank"

# resume: 2 ranks --ep 2 ZeRO-0 -> 1 rank
run a 2 "${COMMON[@]}" -d 128 -x 6 -n 3 --ep 2 -o "$W/a"
[ "$(ls "$W"/a/state_00000003_* | wc -l)" = 2 ] || fail "--ep 2 at ZeRO-0 should write a state piece per ep rank"
mkdir -p "$W/b"
cp "$W/a/model_00000003.bin" "$W"/a/state_00000003_* "$W/a/DONE_00000003" "$W/b/"
run b 1 "${COMMON[@]}" -d 128 -x 6 -n 3 -o "$W/b" -y 1
cmp -s "$W/ref/model_00000006.bin" "$W/b/model_00000006.bin" || fail "resumed --ep 2 -> 1 rank differs"
mkdir -p "$W/c"
cp "$W/a/model_00000003.bin" "$W"/a/state_00000003_* "$W/a/DONE_00000003" "$W/c/"
run c 4 "${COMMON[@]}" -d 128 -x 6 -n 3 --ep 2 -z 3 -o "$W/c" -y 1
cmp -s "$W/ref/model_00000006.bin" "$W/c/model_00000006.bin" || fail "resumed --ep 2 -> 4 ranks --ep 2 -z 3 differs"
pass "resume --ep 2 (ZeRO-0) -> 1 rank, and -> 4 ranks --ep 2 ZeRO-3: identical final checkpoint"

# rank 0's all-to-all bytes against its own counts (Q ep ranks, E/Q experts each)
check_a2a() {   # FILE Q E
  local f=$1 Q=$2 E=$3 n=0
  while read -r bytes out in passes; do
    want=$(( passes * (Q - 1) * (E / Q) * 4 + out * 4 + 8 * C * (out + in) ))
    [ "$bytes" = "$want" ] || fail "$f: all-to-all $bytes bytes, its counts say $want ($out rows out, $in in, $passes passes)"
    n=$((n + 1))
  done < <(sed -n 's/.*all-to-all \([0-9]*\) bytes: \([0-9]*\) rows out, \([0-9]*\) in, \([0-9]*\) layer passes.*/\1 \2 \3 \4/p' "$f")
  [ $n -gt 0 ] || fail "$f: no all-to-all line"
}
check_a2a "$W/m2ep2.out" 2 4
check_a2a "$W/m4ep4.out" 4 4
check_a2a "$W/m4ep2z3.out" 2 4
check_a2a "$W/m4ep2tp2.out" 2 4
check_a2a "$W/m8ep2tp2pp2z1.out" 2 4
check_a2a "$W/s4pp2schedulezb1ep2z1.out" 2 4   # a split backward: the same four exchanges per row
grep -q "rows out, 0 in" "$W/m2ep2.out" && fail "--ep 2: rank 0 received no rows, the accounting proves nothing"
echo "     $(grep -m1 'all-to-all' "$W/m4ep4.out" | sed 's/^ *//')"
pass "all-to-all bytes per step = what the routing counts say was sent"

# a router that prefers expert 3 (held by ep rank 1) for every position: top 1, every token to it
run base 1 "${COMMON[@]}" -e d2c32h2v64t32e4k1 -d 128 -x 1 -n 1 -v 0 -s 0 -o "$W/base"
build/testdata moe-skew "$W/base/model_00000001.bin" "$W/skew.bin" 3 || fail "could not write the skewed model"
run skew1 1 "${COMMON[@]}" -e "$W/skew.bin" -d 128 -x 3 -n 3 -o "$W/skew1"
run skew2 2 "${COMMON[@]}" -e "$W/skew.bin" -d 128 -x 3 -n 3 --ep 2 -o "$W/skew2"
same skew1 skew2 3
grep -m1 "tokens per expert" "$W/skew2.out" | grep -q "min 0 max 128 (of 128 per layer)" \
  || { grep -m1 "tokens per expert" "$W/skew2.out"; fail "the skewed router's first step should send all 128 slots to one expert"; }
grep -m1 "all-to-all" "$W/skew2.out" | grep -q " 0 in," || fail "rank 0 holds no expert the skewed router picks, yet received rows"
check_a2a "$W/skew2.out" 2 4
echo "     $(grep -m1 'tokens per expert' "$W/skew2.out" | sed 's/^ *//')"
pass "every token to one expert (on the other rank): runs, load max = all, identical to one rank"

$MPI 2 $BIN "${COMMON[@]}" --ep 2 -e d2c32h2v64t32e3k2 -x 1 >"$W/bad.out" 2>&1 && fail "--ep 2 with 3 experts should fail"
grep -q -- "--ep 2: the 3 experts per layer must split evenly" "$W/bad.out" || { tail -2 "$W/bad.out"; fail "no clear error for E % ep"; }
$MPI 2 $BIN "${COMMON[@]}" --ep 4 -x 1 >"$W/bad.out" 2>&1 && fail "--ep 4 on 2 ranks should fail"
grep -q -- "--ep 4: the expert-parallel degree must divide the 2 data-parallel ranks" "$W/bad.out" || { tail -2 "$W/bad.out"; fail "no clear error for dp % ep"; }
$MPI 2 $BIN "${COMMON[@]}" -e d2c32h2v64t32 --ep 2 -x 1 >"$W/bad.out" 2>&1 && fail "--ep 2 with a dense model should fail"
grep -q -- "--ep 2: expert parallelism needs a mixture-of-experts model" "$W/bad.out" || { tail -2 "$W/bad.out"; fail "no clear error for a dense model"; }
pass "bad expert-parallel layouts: clear errors"
echo "all mixture-of-experts tests passed"
