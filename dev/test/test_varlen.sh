#!/usr/bin/env bash
# Variable-length sequences (--varlen G, llmc/dataloader.h), against independent references:
#  - on a file without EOT, --shuffle 0 and G = B x accumulation: every logged loss (train and
#    validation over the same sequences) and the checkpoint bytes equal today's fixed-T run;
#  - the loader cuts a file with documents exactly as the issue's rule, written again in
#    build/test_varlen (at T, at EOT, at the file's end; two epochs; the shuffle's permutations);
#  - the first step's loss and gradient norm equal the token-weighted sum of each sequence run
#    alone as its own one-sequence fixed-T step (build/test_varlen reference), within float
#    rounding;
#  - resume continues at the sequence where the checkpoint stopped;
#  - every layout equals one rank with --varlen on the documents: DP 2 x ZeRO 0-3, DP 4 x ZeRO-3, TP 2,
#    PP 2 under every schedule, DP 2 x PP 2 (main.log, checkpoint, samples);
#  - experts with --ep 2, --cp 2 (a2a), CP 2 x EP 2 and --flexsp 1 in groups of 1 and 2 ranks
#    equal one rank (main.log with aux, checkpoint, tokens per expert);
#  - the emulated CUDA build (deterministic) on 1 rank, DP 2 x ZeRO-3, PP 2, CP 2, and with experts
#    CP 2 and --flexsp 1 (DP 2 x ZeRO-3, a group of 2 ranks) equals the CPU build;
#  - context parallelism (ring and a2a, cp 2 and 4, with DP and PP) and sequence parallelism
#    (TP 2 + SP, with CP 2) equal one rank: a length that is a multiple of 2 x the ranks
#    splitting it is split into equal stretches, any other of at least 2 x cp in R2Z's unequal
#    pieces over the cp group, a shorter one computed whole by each rank;
#  - FlexSP (--flexsp 1): every policy on 1, 2 and 4 ranks (DP 4, and DP 2 x CP 2 as one
#    pool of 4), ZeRO 0-3, groups of 1, 2 and 4
#    ranks (context parallelism over the pool's sub-groups), equals one rank's --varlen run
#    (losses, norms, checkpoint), each step's line lists the groups, their sizes and lengths;
#    ZeRO-0's and ZeRO-3's bytes per step equal the formula;
#  - bad input: --varlen 0, -t above maxT, -d with --varlen, --flexsp without --varlen, an unknown
#    --flexsp-policy, a sequence too long for the pool (1 and 2 ranks), --tp 2 with --flexsp,
#    and dev/tools/flexsp_plan's unknown policy and a sequence too long for the pool: one line.
set -u
cd "$(dirname "$0")/../.."
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: no mpirun"; exit 0; }
DATA=build/testdata
REF=build/test_varlen
W=$(mktemp -d /tmp/llmc_varlen_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
source dev/test/lib.sh

# --- no EOT: the fixed-T run, bit for bit ---
$DATA tokens "$W/plain.bin" 20000 64 1 && $DATA tokens "$W/plainval.bin" 3000 64 2 || fail "test data"
PLAIN=(-e d2c32h2v64t32 -i "$W/plain.bin" -j "$W/plainval.bin" -t 16 -v 3 -s 3 -g 8 -l 3e-3 --shuffle 0 -c 0.1 -x 6 -n 6)
run fixed 1 "${PLAIN[@]}" -b 2 -d 128 -m 8 -o "$W/fixed"
run plain 1 "${PLAIN[@]}" --varlen 8 -m 2 -o "$W/plain"
same fixed plain 6
run fixeddp 2 "${PLAIN[@]}" -b 2 -d 128 -m 4 -o "$W/fixeddp"
run plaindp 2 "${PLAIN[@]}" --varlen 8 -m 1 -o "$W/plaindp"
same fixeddp plaindp 6
pass "no EOT, --shuffle 0, G = B x accumulation x DP = 8 (DP 1 and 2): every loss, the samples and the checkpoint equal the fixed-T run"

# --- documents: the rule, the reference ---
$REF data "$W/docs.bin" 4000 1 && $REF data "$W/docsval.bin" 1500 2 && $REF model "$W/model.bin" || fail "test data"
$REF check "$W/docs.bin" 16 || fail "the loader's sequences differ from the rule"
want=$($REF reference "$W/model.bin" "$W/docs.bin" 16 8) || fail "reference"
run docs 1 -e "$W/model.bin" -i "$W/docs.bin" -t 16 --varlen 8 --shuffle 0 -x 1 -v 0 -s 0 -o "$W/docs"
got=$(sed -n 's/^s:0 trl:\([^ ]*\) .*norm:\([^ ]*\)$/loss \1 norm \2/p' "$W/docs/main.log")
echo "   reference: $want; trainer: $got"
awk -v a="$want" -v b="$got" 'BEGIN { split(a, x, " "); split(b, y, " ");
  for (i = 2; i <= 4; i += 2) { d = x[i] - y[i]; if (d < 0) d = -d; if (y[i] == "" || d > 1e-5 * x[i]) exit 1 } }' \
  || fail "the trainer's loss and norm differ from the one-sequence-at-a-time reference"
pass "the first step's loss and gradient norm equal each sequence's own fixed-T step, token-weighted"

# --- resume: a run stopped at step 2 and resumed ends where the uninterrupted one does ---
RESUME=(-e "$W/model.bin" -i "$W/docs.bin" -t 16 --varlen 4 -v 0 -s 0 -l 3e-3 -x 4)
run whole 1 "${RESUME[@]}" -n 4 -o "$W/whole"
run half 1 "${RESUME[@]}" -x 2 -n 2 -o "$W/resumed"
run rest 1 "${RESUME[@]}" -n 2 -y 1 -o "$W/resumed"
cmp -s "$W/whole/model_00000004.bin" "$W/resumed/model_00000004.bin" || fail "resumed --varlen run differs"
cmp -s "$W/whole/main.log" "$W/resumed/main.log" || fail "resumed --varlen run's main.log differs"
pass "resume at step 2 of 4: the same checkpoint and main.log as the uninterrupted run"

# --- every layout against one rank, on the documents ---
DOCS=(-e d4c32h2v50257t32 -i "$W/docs.bin" -j "$W/docsval.bin" -t 16 --varlen 8 -v 2 -m 1 -s 2 -g 6 -l 3e-3 -c 0.1 -x 3 -n 3)
run one 1 "${DOCS[@]}" -o "$W/one"
grep -q "shuffle 1" "$W/one.out" || fail "the layouts should run with --shuffle 1"
for layout in "2 -z 0" "2 -z 1" "2 -z 2" "2 -z 3" "4 -z 3" "2 --tp 2" \
              "2 --pp 2 --schedule 1f1b" "2 --pp 2 --schedule gpipe" "2 --pp 2 --schedule zb1" \
              "2 --pp 2 --schedule zbv" "2 --pp 2 --schedule interleaved --vpp 2" "4 --pp 2 -z 1" \
              "2 --pp 2 --schedule dualpipev" "2 --pp 2 --schedule dualpipe"; do
  name=$(echo "$layout" | tr -d ' -')
  run "$name" $layout "${DOCS[@]}" -o "$W/$name"
  same one "$name" 3
done
pass "--varlen on DP 2 x ZeRO 0-3, DP 4 x ZeRO-3, TP 2, PP 2 (1f1b, gpipe, zb1, zbv, interleaved, dualpipev, dualpipe), DP 2 x PP 2: identical to one rank"

# --- context and sequence parallelism: a sequence whose length is a multiple of 2 x the ranks
# splitting it (cp, x tp with SP) is split into equal stretches, any other of at least 2 x cp
# positions over the cp group in R2Z's unequal pieces, a shorter one computed whole by every
# rank; the equal and the unequal split occur in every CP run, the equal and the whole in the
# TP + SP one (checked) ---
# split_kinds NAME KIND...: this rank's first step split some of its sequences into equal
# stretches, some in R2Z's unequal pieces, computed some whole (KIND: equal, unequal, whole)
# (the unequal pieces' part of the line only with --cp)
split_kinds() {
  local name=$1 kind line equal unequal whole; shift
  line=$(grep -m1 "^varlen split: " "$W/$name.out") || fail "$name: no varlen split line"
  equal=$(echo "$line" | sed -n 's/^varlen split: \([0-9][0-9]*\) of this rank.*/\1/p')
  unequal=$(echo "$line" | sed -n "s/.* \([0-9][0-9]*\) [0-9][0-9]* ways in R2Z's unequal pieces.*/\1/p")
  whole=$(echo "$line" | sed -n 's/.*, \([0-9][0-9]*\) computed whole by every rank$/\1/p')
  [ -n "$equal" ] && [ -n "$whole" ] || fail "$name: unreadable varlen split line: $line"
  unequal=${unequal:-0}
  for kind in "$@"; do [ "${!kind}" -gt 0 ] || fail "$name: no sequence $kind ($line)"; done
}
for layout in "2 --cp 2" "2 --cp 2 --cp-mode a2a" "4 --cp 4" "4 --cp 2 -z 1" "4 --cp 2 --cp-mode a2a -z 3" \
              "4 --cp 2 --pp 2" "2 --tp 2 --sp 1" "4 --tp 2 --sp 1 --cp 2"; do
  name=$(echo "$layout" | tr -d ' -')
  run "$name" $layout "${DOCS[@]}" -o "$W/$name"
  same one "$name" 3
  case "$layout" in *--cp*)
    grep -q "^cp accounting: .*(equal)" "$W/$name.out" || fail "$name: the cp bytes differ from the formula";;
  esac
  case "$layout" in *--cp*) split_kinds "$name" equal unequal;; *) split_kinds "$name" equal whole;; esac
done
DOCS4=(-e d4c32h4v50257t32 "${DOCS[@]:2}")   # 4 heads: the all-to-all over 4 ranks
run one4 1 "${DOCS4[@]}" -o "$W/one4"
run cp4a2a 4 "${DOCS4[@]}" --cp 4 --cp-mode a2a -o "$W/cp4a2a"
same one4 cp4a2a 3
pass "--varlen with --cp 2 and 4, ring and a2a, DP 2 x CP 2 (ZeRO 1, 3), CP 2 x PP 2, TP 2 + SP, TP 2 + SP x CP 2: identical to one rank; the cp bytes equal the formula over the split sequences"
# --- experts: every context rank runs each expert layer on whole sequences (split or not), and a
# FlexSP group of several ranks the same; the per-expert loads count each sequence once ---
MOE=(-e d2c32h2v50257t32e4k2 -i "$W/docs.bin" -t 16 --varlen 4 -v 0 -s 0 -l 3e-3 -x 2 -n 2)
run moe1 1 "${MOE[@]}" -o "$W/moe1"
loads() { grep "tokens per expert" "$W/$1.out" | sed 's/ | all-to-all.*//'; }
for layout in "2 --ep 2" "2 --cp 2 --cp-mode a2a" "4 --cp 2 --ep 2 -z 3" \
              "2 -z 1 --flexsp 1:group 1 (1 rank(s), 1-1)" \
              "2 -z 3 --flexsp 1 --flexsp-policy static --flexsp-tokens 8:group 0 (2 rank(s), 0-1)" \
              "4 -z 2 --flexsp 1 --flexsp-tokens 8 --cp-mode a2a:group 1 (2 rank(s), 2-3)"; do
  shows=${layout#*:}; layout=${layout%%:*}
  name=moe$(echo "$layout" | tr -d ' -')
  run "$name" $layout "${MOE[@]}" -o "$W/$name"
  cmp -s "$W/moe1/main.log" "$W/$name/main.log" || fail "$name: losses, norms or aux losses differ from one rank"
  cmp -s "$W/moe1/model_00000002.bin" "$W/$name/model_00000002.bin" || fail "$name: parameters differ"
  [ "$(loads moe1)" = "$(loads "$name")" ] || fail "$name: the tokens per expert differ from one rank's"
  case "$layout" in
    *--flexsp*) grep -q "^           $shows: lengths [0-9 ]* | planned" "$W/$name.out" \
                  || grep -q "^           $shows: lengths [0-9 ]* ([1-9][0-9]* split [0-9] ways, the others whole on each rank) | planned" "$W/$name.out" \
                  || { cat "$W/$name.out"; fail "$name: no step line of '$shows' (a group of several ranks: with a split sequence)"; };;
    *--cp*) grep -q "^cp accounting: .*(equal)" "$W/$name.out" || fail "$name: the cp bytes differ from the formula"
            case "$layout" in 2*) split_kinds "$name" equal unequal;; *) split_kinds "$name";; esac;;
  esac
done
pass "--varlen with experts: --ep 2, --cp 2 a2a, CP 2 x EP 2 (ZeRO-3), --flexsp 1 on DP 2 (ZeRO 1, 3) and DP 4 (ZeRO-2, a2a) with groups of 1 and 2 ranks: identical to one rank (losses, aux losses, norms, checkpoint, tokens per expert); the cp bytes equal the formula"

# --- FlexSP: rank 0 plans each step's groups, a group of several ranks runs its sequences with
# context parallelism (ring; a2a on 2 ranks) over its pool sub-group, the exchange keeps one rank's bits. Below -t,
# --flexsp-tokens makes the longer sequences need a group of 2 or 4 (LAYOUT:what its lines show) ---
FLEX=(-e d2c16h2v50257t32 -i "$W/docs.bin" -j "$W/docsval.bin" -t 16 --varlen 8 -v 2 -m 2 -s 0 -l 3e-3 -x 2 -n 2)
run flexone 1 "${FLEX[@]}" -o "$W/flexone"
for layout in "1 -z 1 --flexsp-policy milp:group 0 (1 rank(s), 0-0)" "2 -z 0 --flexsp-policy adaptive:group 1 (1 rank(s), 1-1)" \
              "2 -z 3 --flexsp-policy milp:group 1 (1 rank(s), 1-1)" \
              "2 -z 1 --flexsp-policy static --flexsp-tokens 8 --cp-mode a2a:group 0 (2 rank(s), 0-1)" \
              "4 -z 3 --flexsp-policy static --flexsp-tokens 4:group 0 (4 rank(s), 0-3)" \
              "4 -z 2 --flexsp-policy milp --flexsp-tokens 15:group 1 (2 rank(s), 2-3)" \
              "4 --cp 2 -z 3 --cp-mode a2a --flexsp-policy milp --flexsp-tokens 8:group 1 (2 rank(s), 2-3)"; do
  shows=${layout#*:}; layout=${layout%%:*}
  name=flex$(echo "$layout" | tr -d ' -')
  run "$name" $layout --flexsp 1 "${FLEX[@]}" -o "$W/$name"
  cmp -s "$W/flexone/main.log" "$W/$name/main.log" || fail "$name: losses or norms differ from one rank"
  cmp -s "$W/flexone/model_00000002.bin" "$W/$name/model_00000002.bin" || fail "$name: parameters differ from one rank"
  grep -q "^           $shows: lengths [0-9 ]* | planned" "$W/$name.out" || grep -q "^           $shows: lengths [0-9 ]* ([1-9][0-9]* split .* | planned" "$W/$name.out" \
    || { cat "$W/$name.out"; fail "$name: no step line of '$shows' (a group of several ranks: with a split sequence)"; }
  case "$layout" in *milp*) grep -q "flexsp: milp (GLPK: " "$W/$name.out" || fail "$name: GLPK did not plan";; esac
done
# a rank's activations hold a group's share of a sequence, not one of -t: with --flexsp-tokens 4
# (groups of up to 4 ranks) each sequence of up to 16 is split over its group, validation's too
# (main.log's validation losses above are one rank's)
act() { sed -n 's/^| memory\/rank .*activations \([0-9.]*\) MiB.*/\1/p' "$W/$1.out" | head -1; }
awk -v one="$(act flexone)" -v four="$(act flex4z3flexsppolicystaticflexsptokens4)" 'BEGIN { exit !(four > 0 && four < one / 2) }' \
  || fail "--flexsp-tokens 4 on 4 ranks: activations $(act flex4z3flexsppolicystaticflexsptokens4) MiB per rank, not under half of one rank's $(act flexone) MiB"
pass "--flexsp 1, static / adaptive / milp on 1, 2 and 4 ranks (DP 4, and DP 2 x CP 2 as one pool), ZeRO 0-3, groups of 1, 2 (one, and two side by side) and 4 ranks: losses (validation's, run in groups, too), norms and checkpoint identical to one rank's --varlen run; activations sized for a group's share"
# the first step's bytes on 2 ranks with groups of one (no cp traffic): the exchange sends shard
# r of each of rank 0's sequences to rank r ((N-1)/N of the padded gradient P + Vp*C each:
# every unit of d2c16 has an even size, so the padding is 0); ZeRO-0 all-gathers the reduced
# gradient once more, ZeRO-3 gathers the parameters once per step (not per pass) and holds them
# whole besides its shard
Vp=50304; C=16; P=$(( Vp * C + 32 * C + 2 * (12 * C * C + 13 * C) + 2 * C )); E=$(( Vp * C ))
for name in flex2z0flexsppolicyadaptive flex2z3flexsppolicymilp; do
  f="$W/$name.out" z=${name:6:1}
  mine=$(sed -n 's/^           group 0 (1 rank(s), 0-0): lengths \([0-9 ]*\) | planned.*/\1/p' "$f" | head -1 | wc -w)
  set -- $(sed -n 's/.*bytes\/rank\/step grad \([0-9]*\) param \([0-9]*\) | bytes\/rank params \([0-9]*\).*/\1 \2 \3/p' "$f")
  case $z in
    0) want="$(( (mine + 1) * 4 * (P + E) / 2 )) 0 $(( 4 * P ))";;
    3) want="$(( mine * 4 * (P + E) / 2 )) $(( 4 * P / 2 )) $(( 4 * P / 2 + 4 * P ))";;
  esac
  [ "$mine" -gt 0 ] && [ "$*" = "$want" ] || fail "$name: grad, param bytes per step and params held $*, expected $want (rank 0 ran $mine sequences)"
done
pass "--flexsp 1 on 2 ranks: ZeRO-0's and ZeRO-3's gradient and parameter bytes per step and ZeRO-3's parameters held equal the formula"

# --- the emulated CUDA build (deterministic) against the CPU build ---
# four files without EOT whose tails (1, 3, 7, 11 tokens) are short sequences, shuffled among the
# full ones: lengths below 16 and not multiples of it, on the small vocabulary the emulator runs fast
[ -x ./train_gpt2cu_emu ] || fail "./train_gpt2cu_emu is not built (make train_gpt2cu_emu)"
i=0; for k in 3 7 11 1; do i=$((i + 1)); $DATA tokens "$W/tail$i.bin" $((48 + 1 + k)) 64 $i || fail "test data"; done
TAILS=(-e d2c32h2v64t32 -i "$W/tail*.bin" -j "$W/tail1.bin" -t 16 --varlen 4 -v 2 -m 1 -s 2 -g 6 -l 3e-3 -x 3 -n 3)
run tails 1 "${TAILS[@]}" -o "$W/tails"
MTAILS=(-e d2c32h2v64t32e4k2 "${TAILS[@]:2}")
run mtails 1 "${MTAILS[@]}" -o "$W/mtails"
BIN="./train_gpt2cu_emu --deterministic 1"
for layout in "1" "2 -z 3" "2 --pp 2" "2 --cp 2" "2 --cp 2 --cp-mode a2a"; do
  name=emu$(echo "$layout" | tr -d ' -')
  run "$name" $layout "${TAILS[@]}" -o "$W/$name"
  same tails "$name" 3
done
# experts (4, top 2) with context parallelism, and in a FlexSP group of 2 ranks (the pool of
# --cp 2's data x context ranks)
for layout in "2 --cp 2" "2 --cp 2 -z 3 --flexsp 1 --flexsp-tokens 8"; do
  name=memu$(echo "$layout" | tr -d ' -')
  run "$name" $layout "${MTAILS[@]}" -o "$W/$name"
  same mtails "$name" 3
done
split_kinds emu2cp2 equal unequal
split_kinds emu2cp2cpmodea2a equal unequal
grep -q "^           group 0 (2 rank(s), 0-1): lengths .* split 2 ways" "$W/memu2cp2z3flexsp1flexsptokens8.out" || fail "emu --flexsp 1: no group of 2 ranks"
BIN=./train_gpt2
./train_gpt2cu_emu --deterministic 0 "${TAILS[@]}" -o "$W/fastbad" >"$W/fastbad.out" 2>&1 && fail "fast mode accepted --varlen"
grep -q -- "--varlen: fast mode trains fixed windows" "$W/fastbad.out" || { cat "$W/fastbad.out"; fail "fast mode with --varlen: no line naming the flag"; }
pass "the emulated CUDA build (--deterministic 1) with --varlen, on 1 rank, DP 2 ZeRO-3, PP 2, CP 2 (ring, a2a), and with experts CP 2 and --flexsp 1 over CP 2 ZeRO-3 (a group of 2): identical to the CPU build; fast mode refuses --varlen"

# --- bad input: one line, non-zero exit ---
bad() {   # expected-text args...
  local want=$1; shift
  ./train_gpt2 "$@" >"$W/bad.out" 2>&1 && fail "accepted: $*"
  [ "$(wc -l <"$W/bad.out")" -eq 1 ] && grep -q -- "$want" "$W/bad.out" || { cat "$W/bad.out"; fail "not one line naming '$want': $*"; }
}
BAD=(-e d2c32h2v50257t32 -i "$W/docs.bin" -t 16 --varlen 8 -v 0 -s 0 -x 1)
bad "--varlen: expected an integer in \[1," "${BAD[@]}" --varlen 0
bad "exceeds the model's maxT = 32" "${BAD[@]}" -t 64
bad "leave out -d" "${BAD[@]}" -d 256
bad "--flexsp 1: .* it needs --varlen G" "${BAD[@]/--varlen/-b}" --flexsp 1 -z 1
bad "--flexsp-policy: expected static, adaptive or milp" "${BAD[@]}" --flexsp 1 -z 1 --flexsp-policy bogus
bad "--flexsp-tokens 8: a sequence of -t 16 tokens does not fit the memory of the pool" "${BAD[@]}" --flexsp 1 -z 1 --flexsp-tokens 8
$MPI 2 ./train_gpt2 "${BAD[@]}" --flexsp 1 -z 1 --tp 2 >"$W/bad.out" 2>&1 && fail "accepted --flexsp 1 --tp 2"
grep -q -- "--flexsp 1: FlexSP's pool is the data x context ranks; --tp 2 --pp 1 --ep 1" "$W/bad.out" || { cat "$W/bad.out"; fail "--flexsp with --tp 2: no line"; }
$MPI 2 ./train_gpt2 "${BAD[@]}" --flexsp 1 -z 1 --flexsp-tokens 4 >"$W/bad.out" 2>&1 && fail "accepted a sequence longer than a group of two holds"
grep -q -- "--flexsp-tokens 4: a sequence of -t 16 tokens does not fit the memory of the pool's largest group (2 rank(s) x 4 tokens" "$W/bad.out" \
  || { cat "$W/bad.out"; fail "--flexsp-tokens 4 on 2 ranks: no line"; }
for args in "--policy bogus --lengths 5:--policy: expected static" "--gpus 2 --lengths 300000,5:does not fit the memory"; do
  dev/tools/flexsp_plan ${args%%:*} >"$W/bad.out" 2>&1 && fail "flexsp_plan accepted ${args%%:*}"
  [ "$(wc -l <"$W/bad.out")" -eq 1 ] && grep -q -- "${args#*:}" "$W/bad.out" || { cat "$W/bad.out"; fail "flexsp_plan ${args%%:*}: not one line"; }
done
pass "bad input: --varlen 0, -t above maxT, -d; --flexsp without --varlen, an unknown policy, a sequence too long for the pool of 1 and of 2 ranks, --tp 2; flexsp_plan's unknown policy, a sequence too long for the pool: one line each"
