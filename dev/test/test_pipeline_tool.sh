#!/usr/bin/env bash
# Tests of dev/tools/pp_schedule, run from the repository root (make test):
#  - every schedule prints, simulates and draws (with --actions --layers --svg)
#  - the simulated makespans with the default costs (F = 1, B = 2, so F = I = W = 1 when split)
#    are the textbook ones: 1f1b (M+S-1)*3, zb1 3M+S-1, zbv 6M+S-1, dualpipe 3M+S-2, dualpipev 6M+2(S-1) (and
#    less with an F&B cheaper than F + B, --fb)
#  - dualpipev draws its F&B pairs framed
#  - the split schedules draw W boxes in their own colour, the others none; the title carries
#    the bubble fraction
#  - per-stage --fwd/--bwd/--wgt as the trainer prints them are accepted; --wgt is ignored by
#    schedules without a split backward and must not exceed --bwd
#  - bad input ends in one "error: ..." line and a non-zero exit
set -u
cd "$(dirname "$0")/../.."

TOOL=dev/tools/pp_schedule
WORK=build/test_pipeline_tool
W_COLOUR='#3f9b4f'
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
pass() { echo "ok: $*"; }

[ -x $TOOL ] || { echo "FAIL: $TOOL is not built (make $TOOL)"; exit 1; }
rm -rf $WORK && mkdir -p $WORK

# makespan NAME: the simulated makespan printed in $WORK/NAME.out
makespan() { sed -n 's/.*makespan \([0-9.]*\)$/\1/p' "$WORK/$1.out"; }

for schedule in gpipe 1f1b interleaved zb1 zbv dualpipev dualpipe; do
  if $TOOL --stages 4 --microbatches 8 --schedule $schedule --actions --layers 12 --head-cost 5.46 \
       --svg $WORK/$schedule.svg >$WORK/$schedule.out 2>&1 && grep -q '</svg>' $WORK/$schedule.svg &&
     grep -q "Pipeline schedule: $schedule, 4 stages, 8 microbatches.*: bubble 0\.[0-9]" $WORK/$schedule.svg; then
    pass "$schedule prints, simulates and draws"
  else
    fail "$schedule: $(tail -1 $WORK/$schedule.out)"
  fi
done

# S = 4, M = 8
[ "$(makespan 1f1b)" = 33 ] && pass "1f1b makespan (M+S-1)*3 = 33" || fail "1f1b makespan $(makespan 1f1b), expected 33"
[ "$(makespan zb1)" = 27 ] && pass "zb1 makespan 3M+S-1 = 27" || fail "zb1 makespan $(makespan zb1), expected 27"
[ "$(makespan zbv)" = 51 ] && pass "zbv makespan 6M+S-1 = 51" || fail "zbv makespan $(makespan zbv), expected 51"
[ "$(makespan dualpipev)" = 54 ] && pass "dualpipev makespan 6M+2(S-1) = 54" \
  || fail "dualpipev makespan $(makespan dualpipev), expected 54"
[ "$(makespan dualpipe)" = 26 ] && pass "dualpipe makespan 3M+S-2 = 26" || fail "dualpipe makespan $(makespan dualpipe), expected 26"
# F&B = 2.5 instead of F + B = 3: rank 0 of 4 with 8 microbatches runs 2 pairs in phase 4
# (8 - 8 + 0 + 1 = 1 round) and 3 in phase 5 (4 - 0 - 1 rounds), so it is busy 48 - 5 x 0.5
$TOOL --stages 4 --microbatches 8 --schedule dualpipev --fb 2.5 --actions >$WORK/dualpipev_fb.out 2>&1
pairs=$(sed -n 's/^stage 0: //p' $WORK/dualpipev_fb.out | tr ' ' '\n' | grep -c '&')
busy=$(awk '$1 == "0" && NF >= 7 { print $5 }' $WORK/dualpipev_fb.out)
[ "$pairs" = 5 ] && [ "$busy" = 45.5 ] && pass "dualpipev --fb 2.5: stage 0 runs 5 pairs, busy 45.5" \
  || fail "dualpipev --fb 2.5: stage 0 runs $pairs pairs, busy '$busy'; expected 5 and 45.5"
grep -q 'stroke="#7b2d8e"' $WORK/dualpipev.svg && pass "dualpipev frames its F&B pairs" || fail "dualpipev: no framed F&B pair"

for schedule in zb1 zbv dualpipev; do
  grep -q "fill=\"$W_COLOUR\"" $WORK/$schedule.svg && grep -q 'weight gradient (W)' $WORK/$schedule.svg \
    && pass "$schedule draws W boxes" || fail "$schedule: no W boxes in the SVG"
done
for schedule in gpipe 1f1b interleaved; do
  grep -q "$W_COLOUR" $WORK/$schedule.svg && fail "$schedule draws W boxes" || pass "$schedule draws no W boxes"
done
# 12 layers over 8 virtual stages, head 5.46: one each, the 4 left to the cheapest (ties to
# the later): virtual stages 6, 5, 4, 3; the last one keeps layer 11 alone
grep -q 'stage 0 chunk 1 (virtual stage 7): layers 11..11 + head' $WORK/zbv.out \
  && pass "zbv places the last virtual stage, with the head, on stage 0" \
  || fail "zbv placement: $(grep 'stage 0 chunk 1' $WORK/zbv.out)"

# measured per-stage times, as the trainer prints them
if $TOOL --stages 2 --microbatches 4 --schedule zb1 --fwd 1.1,0.9 --bwd 2.3,2 --wgt 1,0.8 >$WORK/measured.out 2>&1; then
  pass "per-stage --fwd/--bwd/--wgt"
else
  fail "per-stage --fwd/--bwd/--wgt: $(tail -1 $WORK/measured.out)"
fi
$TOOL --stages 2 --microbatches 4 --schedule 1f1b --fwd 1.1,0.9 --bwd 2.3,2 >$WORK/plain.out 2>&1
$TOOL --stages 2 --microbatches 4 --schedule 1f1b --fwd 1.1,0.9 --bwd 2.3,2 --wgt 1,0.8 >$WORK/ignored.out 2>&1
cmp -s $WORK/plain.out $WORK/ignored.out && pass "--wgt is ignored by 1f1b" || fail "--wgt changes the 1f1b output"

# expect_error NAME WORD args...: the tool fails with one "error:" line mentioning WORD
expect_error() {
  local name=$1 word=$2; shift 2
  if $TOOL "$@" >$WORK/$name.out 2>&1; then
    fail "$name: accepted"
  elif [ "$(grep -c '^error:' $WORK/$name.out)" = 1 ] && grep -q -- "$word" $WORK/$name.out; then
    pass "$name is rejected"
  else
    fail "$name: unexpected output: $(cat $WORK/$name.out)"
  fi
}
expect_error wgt_over_bwd --wgt --stages 2 --microbatches 4 --schedule zbv --bwd 2 --wgt 2.5
expect_error wgt_count --wgt --stages 2 --microbatches 4 --schedule zb1 --wgt 1,1,1
expect_error zbv_chunks chunks --stages 2 --microbatches 4 --schedule zbv --chunks 3
expect_error unknown_schedule zb2 --stages 2 --microbatches 4 --schedule zb2
expect_error dualpipev_few "at least 2 x stages" --stages 4 --microbatches 7 --schedule dualpipev
expect_error dualpipe_odd "even number of stages" --stages 3 --microbatches 12 --schedule dualpipe
expect_error fb_negative --fb --stages 2 --microbatches 4 --schedule dualpipev --fb -1

[ $fails = 0 ] || { echo "$fails pp_schedule check(s) FAILED"; exit 1; }
echo "all pp_schedule checks passed"
