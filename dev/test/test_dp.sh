#!/usr/bin/env bash
# Data parallelism and ZeRO 0-3 under real mpirun, against one rank:
#  - N in {1, 2, 4} ranks x ZeRO stage 0-3, the same global batch (one rank: 4 microbatches of
#    B; N ranks: 4/N each): every logged loss and the final checkpoint bytes are identical;
#    also N = 3 (padded shards) with 3 microbatches;
#  - per-rank memory and bytes sent per step equal the ZeRO paper's formulas for fp32 AdamW
#    (plus the second half of the tied embedding's gradient, see zero.h), computed here from
#    the model's shape;
#  - resume across layouts: 4 ranks ZeRO-3 -> 2 ranks ZeRO-1 -> 1 rank continues exactly;
#  - a bad input seen by one rank only, and a rank killed mid-run, end the whole job with an
#    error (no hang).
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
DATA=build/testdata
W=$(mktemp -d /tmp/llmc_dp_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

$DATA tokens "$W/train.bin" 20000 64 1 && $DATA tokens "$W/val.bin" 3000 64 2 || fail "test data"
# model d2c32h2v64t32: L=2, C=32, V=64 (Vp=128), maxT=32
L=2; C=32; Vp=128; maxT=32
COMMON=(-e d2c32h2v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 3 -m 3 -s 0 -l 3e-3 --shuffle 0 -c 0.1)


# --- bit-exact against one rank ---
run ref 1 "${COMMON[@]}" -d 128 -x 6 -n 6 -o "$W/ref"
for np in 1 2 4; do
  for z in 0 1 2 3; do
    run "n${np}z$z" $np "${COMMON[@]}" -d 128 -x 6 -n 6 -z $z -o "$W/n${np}z$z"
    cmp -s "$W/ref/main.log" "$W/n${np}z$z/main.log" || fail "$np ranks, ZeRO-$z: losses differ from one rank"
    cmp -s "$W/ref/model_00000006.bin" "$W/n${np}z$z/model_00000006.bin" || fail "$np ranks, ZeRO-$z: parameters differ"
  done
done
pass "1, 2, 4 ranks x ZeRO 0-3: every loss and the final checkpoint identical to one rank"
run ref3 1 "${COMMON[@]}" -d 96 -x 4 -n 4 -o "$W/ref3"
for z in 1 3; do
  run "n3z$z" 3 "${COMMON[@]}" -d 96 -x 4 -n 4 -z $z -o "$W/n3z$z"
  cmp -s "$W/ref3/main.log" "$W/n3z$z/main.log" || fail "3 ranks, ZeRO-$z: losses differ"
  cmp -s "$W/ref3/model_00000004.bin" "$W/n3z$z/model_00000004.bin" || fail "3 ranks, ZeRO-$z: parameters differ"
done
pass "3 ranks (shards padded) x ZeRO 1 and 3: identical to one rank"

# --- memory and communication against the formulas ---
# P = wte + wpe + L layers + lnf; the tied embedding's lookup half of the gradient (Vp*C) is
# reduced as one more unit (zero.h).
WTE=$(( Vp * C )); WPE=$(( maxT * C )); LAYER=$(( 12 * C * C + 13 * C )); LNF=$(( 2 * C ))
P=$(( WTE + WPE + L * LAYER + LNF )); E=$WTE
check_accounting() {   # stage N file
  local z=$1 n=$2 f=$3
  local line; line=$(grep "zero accounting" "$f") || fail "no accounting line in $f"
  set -- $(echo "$line" | sed 's/.*microbatches\/rank \([0-9]*\).*grad \([0-9]*\) param \([0-9]*\).*params \([0-9]*\) grads \([0-9]*\) optimizer \([0-9]*\).*/\1 \2 \3 \4 \5 \6/')
  local ml=$1 grad=$2 param=$3 mp=$4 mg=$5 mo=$6
  local q=$(( n - 1 ))   # a ring sends (N-1)/N of a buffer: (N-1) shards of size buffer/N
  local eg ep emp emg emo
  case $z in
    0) eg=$(( 2 * q * 4 * (P + E) / n )); ep=0; emp=$(( 4 * P )); emg=$(( 4 * (P + E) )); emo=$(( 8 * P ));;
    1) eg=$(( q * 4 * (P + E) / n )); ep=$(( q * 4 * P / n )); emp=$(( 4 * P )); emg=$(( 4 * (P + E) )); emo=$(( 8 * P / n ));;
    2) eg=$(( ml * q * 4 * (P + E) / n )); ep=$(( q * 4 * P / n )); emp=$(( 4 * P )); emg=$(( 4 * (P + E) / n )); emo=$(( 8 * P / n ));;
    # ZeRO-3 gathers every layer twice (forward, backward), wte twice (embedding, LM head),
    # wpe and the final layernorm once per microbatch: 2P - wpe - lnf
    3) eg=$(( ml * q * 4 * (P + E) / n )); ep=$(( ml * q * 4 * (2 * P - WPE - LNF) / n )); emp=$(( 4 * P / n )); emg=$(( 4 * (P + E) / n )); emo=$(( 8 * P / n ));;
  esac
  [ "$grad" = "$eg" ] || fail "ZeRO-$z N=$n: gradient bytes per step $grad, expected $eg"
  [ "$param" = "$ep" ] || fail "ZeRO-$z N=$n: parameter bytes per step $param, expected $ep"
  [ "$mp" = "$emp" ] && [ "$mg" = "$emg" ] && [ "$mo" = "$emo" ] \
    || fail "ZeRO-$z N=$n: memory params/grads/optimizer $mp/$mg/$mo, expected $emp/$emg/$emo"
  # the paper's totals: 16P, 8P+8P/N, 4P+12P/N, 16P/N (+ our tied-embedding half)
  local paper
  case $z in 0) paper=$(( 16 * P ));; 1) paper=$(( 8 * P + 8 * P / n ));; 2) paper=$(( 4 * P + 12 * P / n ));; 3) paper=$(( 16 * P / n ));; esac
  echo "     ZeRO-$z N=$n: memory $(( mp + mg + mo )) B/rank (paper $paper + embedding half), comm grad $grad + param $param B/rank/step"
}
for n in 2 4; do for z in 0 1 2 3; do check_accounting $z $n "$W/n${n}z$z.out"; done; done
pass "memory per rank and bytes per step match the ZeRO formulas"

# --- resume across layouts: 4 ranks ZeRO-3 -> 2 ranks ZeRO-1 -> 1 rank ---
run long 1 "${COMMON[@]}" -d 128 -x 9 -n 9 -o "$W/long"
run a 4 "${COMMON[@]}" -d 128 -x 9 -n 3 -z 3 -o "$W/a"
mkdir -p "$W/b" "$W/c"
cp "$W/a/model_00000003.bin" "$W"/a/state_00000003_* "$W/a/DONE_00000003" "$W/b/"
[ "$(ls "$W"/b/state_00000003_* | wc -l)" = 4 ] || fail "ZeRO-3 on 4 ranks should write 4 state pieces"
run b 2 "${COMMON[@]}" -d 128 -x 9 -n 3 -z 1 -o "$W/b" -y 1
cp "$W/b/model_00000006.bin" "$W"/b/state_00000006_* "$W/b/DONE_00000006" "$W/c/"
run c 1 "${COMMON[@]}" -d 128 -x 9 -n 3 -o "$W/c" -y 1
cmp -s "$W/long/model_00000009.bin" "$W/c/model_00000009.bin" || fail "resumed 4xZeRO-3 -> 2xZeRO-1 -> 1 rank differs from the uninterrupted run"
diff <(grep trl "$W/long/main.log" | sed -n '7,9p') <(grep trl "$W/c/main.log") >/dev/null || fail "losses after the last resume differ"
diff <(grep trl "$W/long/main.log" | sed -n '4,9p') <(grep trl "$W/b/main.log") >/dev/null || fail "losses after the first resume differ"
pass "resume 4 ranks ZeRO-3 -> 2 ranks ZeRO-1 -> 1 rank: identical losses and final checkpoint"

# --- faults ---
# a token id >= V only in microbatch 1, which rank 1 of 2 reads (ZeRO-0: contiguous blocks)
cp "$W/train.bin" "$W/bad.bin"
printf '\xe8\x03' | dd of="$W/bad.bin" bs=1 seek=$(( 1024 + 2 * (32 + 5) )) conv=notrunc status=none   # id 1000
start=$(date +%s)
$MPI 2 $BIN "${COMMON[@]}" -i "$W/bad.bin" -d 64 -x 2 -v 0 >"$W/bad.out" 2>&1 && fail "a bad token on rank 1 did not fail the job"
grep -q "error: \[rank 1\].*token id 1000" "$W/bad.out" || { cat "$W/bad.out"; fail "the job did not report rank 1's error"; }
[ $(( $(date +%s) - start )) -lt 60 ] || fail "the failing job took too long to end"
pass "a bad input seen by one rank ends the job with that rank's message"
# kill one rank of a running job
kill_one_rank 2 2 "${COMMON[@]}" -d 64 -x 100000 -v 0
pass "killing one rank mid-run ends the job with an error"

# ranks started with different flags (mpirun's MPMD form) stop at once with one line naming the
# flag, instead of hanging in a collective or training different things
$MPI 1 $BIN "${COMMON[@]}" -x 5 -o "$W/differ" : -np 1 $BIN "${COMMON[@]}" -x 6 -o "$W/differ" >"$W/differ.out" 2>&1 \
  && fail "ranks with different -x trained"
grep -q "flag -x is '6' on this rank but '5' on rank 0" "$W/differ.out" || { tail -3 "$W/differ.out"; fail "different flags per rank were not named"; }
pass "ranks with different flags: one line naming the flag, the job ends"
echo "all data-parallel tests passed"
