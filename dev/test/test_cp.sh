#!/usr/bin/env bash
# Context parallelism (--cp N, llmc/context_parallel.h) under real mpirun, against one rank:
#  - --cp 2, 4 and 8 with ring attention, --cp 2 and 4 with the all-to-all (Ulysses), and
#    context parallelism with tensor (+ sequence) parallelism, pipeline parallelism (1f1b,
#    interleaved, and the split backwards of zb1 and zbv), ZeRO 1-3 (with and without data
#    parallelism), and the 8-rank grid data x context x tensor =
#    2 x 2 x 2 with ZeRO-1: every logged loss, the samples and the final checkpoint bytes are
#    identical;
#  - ZeRO shards over data x context ranks (Megatron's grouping): DP 2 x CP 2 holds the
#    optimizer state of DP 4, to the byte;
#  - the bytes each rank sends for context parallelism in a step = the formula computed here
#    from the model's shape (ring: per layer and microbatch (N-1) K and (N-1) V blocks
#    forward, (N-1) V and (N-1) K blocks and (N-1) dK|dV partial blocks backward, a block
#    B*(T/N)*C/tp floats; all-to-all: 8 (N-1)/N blocks; plus the embedding gradient's and the
#    losses' all-gathers along T), and the startup table shows every rank's coordinates;
#  - activations per rank shrink with N;
#  - resume across layouts: a 4-way context-parallel ZeRO-3 run's checkpoint -> one rank;
#  - bad layouts (a degree that does not divide 8, T not a multiple of 2N, heads not
#    divisible for the all-to-all, context x sequence parallelism past 8 slices): clear errors.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d /tmp/llmc_cp_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

build/testdata tokens "$W/train.bin" 20000 64 1 && build/testdata tokens "$W/val.bin" 3000 64 2 || fail "test data"
# L=4, C=32, NH=4, V=64 (Vp=128), maxT=32; B=2, T=16, 4 microbatches per step
L=4; C=32; B=2; T=16
COMMON=(-e d4c32h4v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 3 -m 3 -s 3 -g 5 -l 3e-3 --shuffle 0 -c 0.1)

run ref 1 "${COMMON[@]}" -d 128 -x 4 -n 4 -o "$W/ref"
for layout in "2 --cp 2" "4 --cp 4" "8 --cp 8" "2 --cp 2 --cp-mode a2a" "4 --cp 4 --cp-mode a2a" \
              "4 --cp 2 --tp 2" "4 --cp 2 --tp 2 --sp 1" "4 --cp 2 --pp 2" "4 --cp 2 -z 1" "4 --cp 2 -z 3" \
              "2 --cp 2 -z 2" "8 --cp 2 --tp 2 -z 1" "4 -z 1" "4 --cp 2 --pp 2 --schedule interleaved" \
              "4 --cp 2 --pp 2 --schedule zb1 -z 2" "8 --cp 2 --pp 2 --tp 2 --sp 1 --schedule zbv -z 3"; do
  set -- $layout
  np=$1; shift
  name=c$(echo "$layout" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -d 128 -x 4 -n 4 "$@" -o "$W/$name"
  same ref "$name" 4
done
pass "--cp 2/4/8 ring, --cp 2/4 all-to-all, x TP (+SP), x PP, x ZeRO 1-3 (x DP), the 2x2x2 data x context x tensor grid: identical to one rank"
opt() { grep "zero accounting" "$1" | sed 's/.*optimizer \([0-9]*\).*/\1/'; }
[ "$(opt "$W/c4cp2z1.out")" = "$(opt "$W/c4z1.out")" ] || fail "DP 2 x CP 2 ZeRO-1 should hold DP 4's optimizer shard: $(opt "$W/c4cp2z1.out") vs $(opt "$W/c4z1.out") bytes"
pass "ZeRO shards over data x context ranks: DP 2 x CP 2 holds DP 4's optimizer state ($(opt "$W/c4z1.out") bytes/rank)"

# bytes of kind "cp" rank 0 sent in the first step (its stage: all layers, the embeddings and,
# without --pp, the head), against the formula
ml=4   # microbatches per data-parallel rank: -d 128 = 4 x B*T, one data-parallel rank
check_bytes() {   # file N mode tp layers first last
  local f=$1 N=$2 mode=$3 tp=$4 layers=$5 first=$6 last=$7
  local Tl=$(( T / N )) Ca=$(( C / tp ))
  local block=$(( B * Tl * Ca )) per_layer
  if [ "$mode" = ring ]; then per_layer=$(( 6 * (N - 1) * block )); else per_layer=$(( 8 * (N - 1) * block / N )); fi
  local want=$(( 4 * ml * (layers * per_layer + first * (N - 1) * B * Tl * C + last * (N - 1) * B * Tl) ))
  local got
  got=$(grep -A10 "communication per rank" "$f" | awk '$1 == "cp" { print $3 }')
  [ "$got" = "$want" ] || fail "$f: $got context-parallel bytes per step, the formula gives $want"
  grep -q "cp accounting: .* formula $want (equal)" "$f" || fail "$f: the trainer's own check of the formula is missing or failed"
  echo "     $(basename "$f" .out): $got bytes per rank per step = the formula"
}
check_bytes "$W/c2cp2.out" 2 ring 1 $L 1 1
check_bytes "$W/c8cp8.out" 8 ring 1 $L 1 1
check_bytes "$W/c4cp4cpmodea2a.out" 4 a2a 1 $L 1 1
check_bytes "$W/c4cp2tp2.out" 2 ring 2 $L 1 1
check_bytes "$W/c4cp2pp2.out" 2 ring 1 $(( L / 2 )) 1 0
check_bytes "$W/c4cp2pp2scheduleinterleaved.out" 2 ring 1 $(( L / 2 )) 1 0   # rank 0: 2 chunks of 1 layer
check_bytes "$W/c8cp2pp2tp2sp1schedulezbvz3.out" 2 ring 2 $(( L / 2 )) 1 1     # rank 0: the V's two ends
pass "context-parallel bytes per step = the ring's and the all-to-all's formulas"

grep -q "grid          rank (dp,cp,tp,pp): 0 (0,0,0,0) 1 (0,0,1,0) 2 (0,1,0,0) 3 (0,1,1,0) 4 (1,0,0,0)" "$W/c8cp2tp2z1.out" \
  || fail "the startup table does not show the grid in Megatron's order (tensor fastest, then context, data)"
act() { grep "memory/rank" "$1" | sed 's/.*activations \([0-9.]*\) MiB.*/\1/'; }
for np in 1 2 4; do run "mem$np" $np "${COMMON[@]}" -b 8 -t 32 -x 1 -v 0 -s 0 --cp $np; done
a1=$(act "$W/mem1.out"); a2=$(act "$W/mem2.out"); a4=$(act "$W/mem4.out")
awk -v a="$a1" -v b="$a2" -v c="$a4" 'BEGIN { exit !(b < 0.6 * a && c < 0.6 * b) }' \
  || fail "activations per rank should shrink with N: $a1, $a2, $a4 MiB for cp 1, 2, 4"
pass "startup table: every rank's coordinates; activations per rank $a1 -> $a2 -> $a4 MiB for cp 1, 2, 4"

run long 1 "${COMMON[@]}" -d 128 -x 6 -n 6 -o "$W/long"
run a 4 "${COMMON[@]}" -d 128 -x 6 -n 3 --cp 4 -z 3 -o "$W/a"
mkdir -p "$W/b"
cp "$W/a/model_00000003.bin" "$W"/a/state_00000003_* "$W/a/DONE_00000003" "$W/b/"
run b 1 "${COMMON[@]}" -d 128 -x 6 -n 3 -o "$W/b" -y 1
cmp -s "$W/long/model_00000006.bin" "$W/b/model_00000006.bin" || fail "resumed CP 4 ZeRO-3 -> 1 rank differs"
diff <(grep trl "$W/long/main.log" | sed -n '4,6p') <(grep trl "$W/b/main.log") >/dev/null || fail "losses after resuming differ"
pass "resume a 4-way context-parallel ZeRO-3 run on one rank: identical"

bad() {   # np expected-message args...
  local np=$1 msg=$2; shift 2
  $MPI "$np" $BIN "${COMMON[@]}" -x 1 "$@" >"$W/bad.out" 2>&1 && fail "$* should fail"
  grep -q -- "$msg" "$W/bad.out" || { cat "$W/bad.out"; fail "no clear error for $*"; }
}
bad 1 "--cp: expected an integer in \[1, 8\]" --cp 16
bad 3 "--cp 3: the context-parallel degree must be 1, 2, 4 or 8" --cp 3
bad 4 "--cp 4: the sequence length -t 12 must be a multiple of 2 x 4" --cp 4 -t 12
bad 8 "--cp-mode a2a gives each rank NH/cp heads" --cp 8 --cp-mode a2a
bad 16 "context x sequence parallelism splits each sequence 16 ways" --cp 8 --tp 2 --sp 1 -t 32
bad 1 "--cp-mode must be ring or a2a" --cp-mode star
pass "bad context-parallel layouts: clear errors"
echo "all context-parallel tests passed"
