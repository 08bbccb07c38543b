#!/usr/bin/env bash
# Megatron tensor (and sequence) parallelism under real mpirun, against one rank:
#  - --tp 2 and --tp 4, with and without --sp 1, alone, with data parallelism and ZeRO 1/2/3,
#    with --pp 2, and the 8-rank grid data x tensor x pipeline = 2 x 2 x 2 with ZeRO-1 and
#    1F1B: every logged loss, the samples and the final checkpoint bytes are identical;
#  - the f/g operators and the vocab-parallel embedding and cross-entropy on real
#    communicators against the unsplit computation (build/test_tp_ops);
#  - tensor-parallel bytes per step = Megatron's 4 all-reduces of B*T*C per layer per
#    microbatch (+ the embedding, the LM head's input gradient and the cross-entropy's
#    three B*T reductions), computed here from the model's shape; with --sp the same volume
#    as all-gathers and reduce-scatters, plus the layernorm gradients' per-sequence sums;
#  - resume across layouts: 4-way TP -> 2 x 2 (TP x DP, ZeRO-3) -> one rank;
#  - NH or Vp not divisible, and a degree that does not divide 8: clear errors.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d /tmp/llmc_tp_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

for n in 2 4; do $MPI $n build/test_tp_ops || fail "test_tp_ops on $n ranks"; done
pass "f/g operators, vocab-parallel embedding and cross-entropy on 2 and 4 ranks: identical to unsplit"

build/testdata tokens "$W/train.bin" 20000 64 1 && build/testdata tokens "$W/val.bin" 3000 64 2 || fail "test data"
# L=4, C=32, NH=4, V=64 (Vp=128), maxT=32; B=2, T=16, 4 microbatches per step
COMMON=(-e d4c32h4v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 3 -m 3 -s 3 -g 5 -l 3e-3 --shuffle 0 -c 0.1)

run ref 1 "${COMMON[@]}" -d 128 -x 6 -n 6 -o "$W/ref"
for layout in "2 --tp 2" "4 --tp 4" "4 --tp 2 -z 1" "4 --tp 2 -z 3" "4 --tp 2 --pp 2 --schedule gpipe" \
              "8 --tp 2 --pp 2 -z 1 --schedule 1f1b" "8 --tp 4 -z 2" \
              "2 --tp 2 --sp 1" "4 --tp 4 --sp 1" "4 --tp 2 --sp 1 --pp 2" "4 --tp 2 --sp 1 -z 3" \
              "8 --tp 2 --sp 1 --pp 2 -z 1 --schedule 1f1b"; do
  set -- $layout
  np=$1; shift
  name=t$(echo "$layout" | tr -d ' -')
  run "$name" "$np" "${COMMON[@]}" -d 128 -x 6 -n 6 "$@" -o "$W/$name"
  same ref "$name" 6
done
pass "--tp 2/4 (+ --sp 1) alone, x DP with ZeRO 1/2/3, x PP, and the 2x2x2 grid with ZeRO-1 and 1F1B: identical to one rank"

# tensor-parallel traffic (bytes this rank sends): per microbatch, per layer 4 all-reduces of
# B*T*C (forward: after attproj and fcproj; backward: the input gradients of fc and qkv),
# plus the embedding lookup and the LM head's input gradient (B*T*C each), plus the
# cross-entropy's max and (Z, target logit) (B*T and 2*B*T). An all-reduce of n floats over
# K ranks sends 2 (K-1) ceil(n/K) floats.
L=4; C=32; B=2; T=16
for K in 2 4; do
  f="$W/t4tp$K.out"; [ $K = 2 ] && f="$W/t2tp2.out"
  ml=$(grep "zero accounting" "$f" | sed 's/.*microbatches\/rank \([0-9]*\).*/\1/')
  got=$(grep -A6 "communication per rank" "$f" | awk '$1 == "tp" { print $3 }')
  ar() { echo $(( 2 * (K - 1) * (($1 + K - 1) / K) * 4 )); }
  btc=$(( B * T * C )); bt=$(( B * T ))
  want=$(( ml * ((4 * L + 2) * $(ar $btc) + $(ar $bt) + $(ar $(( 2 * bt )))) ))
  [ "$got" = "$want" ] || fail "--tp $K: $got tensor-parallel bytes per step, Megatron's count is $want"
  echo "     --tp $K: $got bytes per rank per step = Megatron's 4 all-reduces of B*T*C per layer (+ embedding, LM head, loss)"
  # --sp 1: each all-reduce becomes a reduce-scatter + an all-gather (same bytes); the 2L+1
  # layernorms' weight and bias gradients add an all-reduce of 2*B*C each
  f="$W/t$([ $K = 2 ] && echo 2 || echo 4)tp${K}sp1.out"
  got=$(grep -A6 "communication per rank" "$f" | awk '$1 == "tp" { print $3 }')
  want=$(( want + ml * (2 * L + 1) * $(ar $(( 2 * B * C ))) ))
  [ "$got" = "$want" ] || fail "--tp $K --sp 1: $got tensor-parallel bytes per step, expected $want"
  echo "     --tp $K --sp 1: $got bytes per rank per step (the same B*T*C volume + layernorm gradients)"
done
pass "tensor-parallel communication matches Megatron's accounting"

run long 1 "${COMMON[@]}" -d 128 -x 9 -n 9 -o "$W/long"
run a 4 "${COMMON[@]}" -d 128 -x 9 -n 3 --tp 4 -o "$W/a"
mkdir -p "$W/b" "$W/c"
cp "$W/a/model_00000003.bin" "$W"/a/state_00000003_* "$W/a/DONE_00000003" "$W/b/"
run b 4 "${COMMON[@]}" -d 128 -x 9 -n 3 --tp 2 -z 3 -o "$W/b" -y 1
cp "$W/b/model_00000006.bin" "$W"/b/state_00000006_* "$W/b/DONE_00000006" "$W/c/"
run c 1 "${COMMON[@]}" -d 128 -x 9 -n 3 -o "$W/c" -y 1
cmp -s "$W/long/model_00000009.bin" "$W/c/model_00000009.bin" || fail "resumed TP4 -> TP2xDP2 ZeRO-3 -> 1 rank differs"
diff <(grep trl "$W/long/main.log" | sed -n '4,9p') <(grep trl "$W/b/main.log") >/dev/null || fail "losses after the first resume differ"
pass "resume 4-way TP -> 2-way TP x 2 DP (ZeRO-3) -> 1 rank: identical"

$MPI 2 $BIN "${COMMON[@]}" -e d2c48h3v64t32 --tp 2 -x 1 >"$W/bad.out" 2>&1 && fail "--tp 2 with NH=3 should fail"
grep -q -- "--tp 2: the number of heads" "$W/bad.out" || fail "no clear error for NH not divisible"
$MPI 3 $BIN "${COMMON[@]}" --tp 3 -x 1 >"$W/bad.out" 2>&1 && fail "--tp 3 should fail"
grep -q -- "--tp 3: the tensor-parallel degree must be 1, 2, 4 or 8" "$W/bad.out" || fail "no clear error for --tp 3"
$MPI 2 $BIN "${COMMON[@]}" --tp 2 --sp 1 -t 15 -x 1 >"$W/bad.out" 2>&1 && fail "--sp 1 with T=15 should fail"
grep -q -- "must be a multiple of 2 x --tp 2" "$W/bad.out" || fail "no clear error for T not divisible by 2 x --tp"
$MPI 2 $BIN "${COMMON[@]}" --sp 1 -x 1 >"$W/bad.out" 2>&1 && fail "--sp 1 without --tp should fail"
grep -q -- "needs --tp > 1" "$W/bad.out" || fail "no clear error for --sp without --tp"
pass "bad tensor/sequence-parallel layouts: clear errors"
echo "all tensor-parallel tests passed"
