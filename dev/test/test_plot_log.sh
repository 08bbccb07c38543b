#!/usr/bin/env bash
# Tests of dev/tools/plot_log, run from the repository root (make test):
#  - the SVG is well-formed XML (xmllint, Debian package libxml2-utils: the test fails without it)
#  - exactly one <polyline> per series drawn (train and val loss of each run, lr, norm)
#  - every point of a series sits where the log's value puts it in the documented plot box:
#    the panel's smallest/largest value on the box's bottom/top edge, first/last step on its
#    left/right edge (linear and --log)
#  - a repeated step (resumed run) is drawn with its last value; unknown keys and free text are
#    ignored; nan/inf are left out with one warning naming the file and the step
#  - titles, labels and paths are XML-escaped
#  - bad input ends in one "error: ..." line naming the file, a non-zero exit, and no SVG written
# Logs: a hand-written main.log, and two short real runs of ./train_gpt2 on tiny Shakespeare when
# the trainer and the data are there (dev/data/ from `make data`, else ../shared/data/).
set -u
cd "$(dirname "$0")/../.."

TOOL=dev/tools/plot_log
SHARED=${LLMC_SHARED_DATA:-../shared/data}   # override with LLMC_SHARED_DATA
W=$(mktemp -d /tmp/llmc_plot_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
pass() { echo "ok: $*"; }

[ -x $TOOL ] || { echo "FAIL: $TOOL is not built (make $TOOL)"; exit 1; }
command -v xmllint >/dev/null ||
  { echo "FAIL: xmllint not found: install libxml2-utils (apt-get install libxml2-utils)"; exit 1; }

# --- helpers ---------------------------------------------------------------------------------
# plot WHAT ARGS...: runs the tool, which must succeed and write a well-formed SVG
plot() {
  local what=$1; shift
  if ! $TOOL "$@" >$W/out 2>$W/err; then
    fail "$what: exit code $?: $(cat $W/err)"
    return 1
  fi
  local svg
  svg=$(sed -n 's/^wrote \([^:]*\):.*/\1/p' $W/out)
  xmllint --noout "$svg" 2>$W/xml || { fail "$what: $svg is not well-formed XML: $(head -3 $W/xml)"; return 1; }
}

count_polylines() { grep -o '<polyline' "$1" | wc -l; }

expect_polylines() {
  local what=$1 svg=$2 expected=$3 n
  n=$(count_polylines "$svg")
  [ "$n" -eq "$expected" ] && pass "$what: $n polylines" || fail "$what: $n polylines, expected $expected"
}

# attribute NAME of the first element matching TAG_PREFIX (e.g. '<rect id="loss-box"') in SVG
attr() {
  grep -o "$2[^>]*>" "$1" | head -1 | sed -n "s/.* $3=\"\([^\"]*\)\".*/\1/p"
}

# points N SVG CLASS: the points of the N-th polyline of CLASS, one "x,y" per line
points() { grep -o "<polyline class=\"$3\"[^>]*>" "$2" | sed -n "$1p" | sed 's/.* points="\([^"]*\)".*/\1/' | tr ' ' '\n'; }

# check_mapping WHAT SVG LOG KEY CLASS BOX "RANGE KEYS" LOG_SCALE: recomputes from LOG (the only
# log plotted) where every value of KEY must be drawn, and compares with the polyline of CLASS.
# The contract (dev/tools/plot_log.c): the last value of each step counts; the panel's extreme
# values over RANGE KEYS are the box's bottom and top; the first and last step logged are its
# left and right edges.
check_mapping() {
  local what=$1 svg=$2 log=$3 key=$4 class=$5 box=$6 range=$7 log_scale=$8
  local bx by bw bh
  bx=$(attr "$svg" "<rect id=\"$box\"" x); by=$(attr "$svg" "<rect id=\"$box\"" y)
  bw=$(attr "$svg" "<rect id=\"$box\"" width); bh=$(attr "$svg" "<rect id=\"$box\"" height)
  [ -n "$bx" ] && [ -n "$bh" ] || { fail "$what: no <rect id=\"$box\"> with x, y, width, height"; return; }
  points 1 "$svg" "$class" >$W/actual
  awk -v key="$key" -v range="$range" -v log_scale="$log_scale" -v bx="$bx" -v by="$by" -v bw="$bw" -v bh="$bh" '
    function scaled(v) { return log_scale ? log(v) : v }
    BEGIN { n = split(range, r, " "); for (i = 1; i <= n; i++) in_range[r[i]] = 1
            known["trl"]; known["tel"]; known["lr"]; known["norm"] }
    FNR == NR {  # the log
      if ($1 !~ /^s:/) next
      step = substr($1, 3) + 0
      for (i = 2; i <= NF; i++) {
        c = index($i, ":"); k = substr($i, 1, c - 1)
        if (!(k in known)) continue
        value[k, step] = substr($i, c + 1) + 0
        if (!logged++ || step < first) first = step
        if (step > last) last = step
      }
      next
    }
    { actual[++n_actual] = $0 }
    END {
      for (s = first; s <= last; s++) for (k in in_range) if ((k, s) in value) {
        v = scaled(value[k, s])
        if (!ranged++ || v < lo) lo = v
        if (v > hi) hi = v
      }
      n = 0
      for (s = first; s <= last; s++) if ((key, s) in value) {
        n++
        x = bx + (s - first) / (last - first) * bw
        y = by + bh - (scaled(value[key, s]) - lo) / (hi - lo) * bh
        split(actual[n], xy, ",")
        dx = xy[1] - x; dy = xy[2] - y
        if (n > n_actual || dx * dx + dy * dy > 0.02 * 0.02) {
          printf "step %d (%s:%g): expected %.2f,%.2f, drawn at %s\n", s, key, value[key, s], x, y, actual[n]
          exit 1
        }
      }
      if (n != n_actual) { printf "%d points drawn, the log has %d\n", n_actual, n; exit 1 }
      printf "%d points", n
    }' "$log" $W/actual >$W/mapping
  local rc=$?
  [ $rc -eq 0 ] && pass "$what: $(cat $W/mapping) where the log puts them" || fail "$what: $(cat $W/mapping)"
}

# expect_error WHAT PATTERN ARGS...: the tool must exit non-zero with one stderr line
# "error: ...PATTERN..." and leave $W/untouched.svg (a previous plot) as it was.
expect_error() {
  local what=$1 pattern=$2; shift 2
  cp $W/untouched.svg $W/before.svg
  $TOOL "$@" >$W/out 2>$W/err
  local rc=$? lines
  lines=$(wc -l <$W/err)
  if [ $rc -ne 0 ] && [ "$lines" -eq 1 ] && grep -q '^error: ' $W/err && grep -qF -- "$pattern" $W/err &&
     cmp -s $W/untouched.svg $W/before.svg; then
    pass "$what: $(cat $W/err)"
  else
    fail "$what: expected a non-zero exit, one line 'error: ...$pattern...' and the old SVG kept; got exit $rc and:"
    cat $W/err
  fi
}

# --- a hand-written log --------------------------------------------------------------------------
# Train loss from 4 (step 0) down to 2 (step 9), val loss in between, the last line a val loss
# at step 10. The run diverged at steps 4-5 (losses 9.5, 9) and was resumed from step 4: those
# values are replaced, so the largest loss drawn must be 4, at the top of the box.
mkdir -p $W/fixture
cat >$W/fixture/main.log <<'EOF'
s:0 tel:3.9
s:0 trl:4 lr:0.0001 norm:2.5
s:1 trl:3.6 lr:0.0002 norm:2
s:2 trl:3.5 aux:0.01 lr:0.0003 norm:1.5 future_key:1
s:3 trl:3.2 lr:0.0003 norm:1.2
s:4 trl:9.5 lr:0.0003 norm:7
s:5 tel:9.1
s:5 trl:9 lr:0.0003 norm:7
resumed from the checkpoint of step 4
s:4 trl:3.1 lr:0.0003 norm:1.1
s:5 tel:3.3
s:5 trl:2.8 lr:0.0003 norm:1
s:6 trl:2.7 lr:0.00025 norm:0.9
s:7 trl:2.5 aux:0.02 lr:0.0002 norm:0.9
s:8 trl:2.3 lr:0.00015 norm:0.8
s:9 trl:2 lr:0.0001 norm:0.8
s:10 tel:2.2
EOF
FIX=$W/fixture/main.log

$TOOL --help | grep -q "usage: dev/tools/plot_log" && $TOOL --help | grep -q "last value" &&
  pass "--help" || fail "--help prints no usage, or does not say that a step's last value counts"

if plot "fixture" -o $W/fixture.svg $FIX; then
  expect_polylines "fixture" $W/fixture.svg 2
  check_mapping "fixture train loss" $W/fixture.svg $FIX trl train-loss loss-box "trl tel" 0
  check_mapping "fixture val loss" $W/fixture.svg $FIX tel val-loss loss-box "trl tel" 0
  # the same by hand: loss 4 at step 0 is the top-left corner, loss 2 at step 9 is 90% across
  # the bottom edge
  bx=$(attr $W/fixture.svg '<rect id="loss-box"' x); by=$(attr $W/fixture.svg '<rect id="loss-box"' y)
  bw=$(attr $W/fixture.svg '<rect id="loss-box"' width); bh=$(attr $W/fixture.svg '<rect id="loss-box"' height)
  expected=$(awk -v x="$bx" -v y="$by" -v w="$bw" -v h="$bh" 'BEGIN { printf "%.2f,%.2f %.2f,%.2f", x, y, x + 0.9 * w, y + h }')
  drawn="$(points 1 $W/fixture.svg train-loss | sed -n 1p) $(points 1 $W/fixture.svg train-loss | sed -n 10p)"
  [ "$drawn" = "$expected" ] && pass "fixture: max loss at the box's top-left, min at its bottom edge ($drawn)" ||
    fail "fixture: train loss 4 and 2 drawn at $drawn, expected $expected (box $bx $by $bw $bh)"
  grep -q '>fixture<' $W/fixture.svg && pass "default label: the log's directory name" ||
    fail "the legend does not name the run 'fixture'"
fi

if plot "fixture --log" -o $W/fixture_log.svg --log $FIX; then
  check_mapping "fixture --log train loss" $W/fixture_log.svg $FIX trl train-loss loss-box "trl tel" 1
fi

if plot "fixture --lr --norm" -o $W/panels.svg --lr --norm $FIX; then
  expect_polylines "fixture --lr --norm" $W/panels.svg 4
  check_mapping "fixture lr panel" $W/panels.svg $FIX lr lr lr-box "lr" 0
  check_mapping "fixture norm panel" $W/panels.svg $FIX norm norm norm-box "norm" 0
  check_mapping "fixture train loss above the panels" $W/panels.svg $FIX trl train-loss loss-box "trl tel" 0
fi

# --- nan and inf: left out, one warning per file naming the step --------------------------------
mkdir -p $W/diverged
cat >$W/diverged/main.log <<'EOF'
s:0 tel:5.1
s:0 trl:5 lr:0.001 norm:3
s:1 trl:4.5 lr:0.001 norm:2
s:2 trl:nan lr:0.001 norm:nan
s:3 trl:inf lr:0.001 norm:inf
s:3 tel:-nan
EOF
if plot "nan and inf" -o $W/diverged.svg --lr --norm $FIX $W/diverged/main.log; then
  expect_polylines "two runs, one diverged, --lr --norm" $W/diverged.svg 8
  if [ "$(wc -l <$W/err)" -eq 1 ] && grep -q "^warning: $W/diverged/main.log: .*step 2" $W/err; then
    pass "nan/inf: one warning naming the file and step 2: $(cat $W/err)"
  else
    fail "nan/inf: expected one warning naming $W/diverged/main.log and step 2, got: $(cat $W/err)"
  fi
  n=$(points 2 $W/diverged.svg train-loss | wc -l)
  [ "$n" -eq 2 ] && pass "nan/inf: 2 finite train losses drawn" || fail "nan/inf: $n train-loss points drawn, expected 2"
fi

# --- a log without validation lines: no val series, so one polyline --------------------------------
grep trl $FIX >$W/train_only.log
plot "train lines only" -o $W/train_only.svg $W/train_only.log && expect_polylines "train lines only" $W/train_only.svg 1

# --- escaping of titles, labels and paths ----------------------------------------------------------
mkdir -p "$W/r&d <x>"
cp $FIX "$W/r&d <x>/main.log"
if plot "escaping" -o $W/escaped.svg --title 'loss <of> "A" & '"'B'" --labels 'a<b,c&d' $FIX "$W/r&d <x>/main.log"; then
  grep -qF '&lt;of&gt; &quot;A&quot; &amp; &apos;B&apos;' $W/escaped.svg && grep -qF '>a&lt;b<' $W/escaped.svg &&
    grep -qF '>c&amp;d<' $W/escaped.svg && grep -qF 'r&amp;d &lt;x&gt;/main.log' $W/escaped.svg &&
    pass "title, labels and paths escaped" || fail "title, labels or paths not escaped as expected"
fi
plot "escaped default label" -o $W/escaped2.svg "$W/r&d <x>/main.log" &&
  grep -qF '>r&amp;d &lt;x&gt;<' $W/escaped2.svg && pass "default label escaped" ||
  fail "the default label 'r&d <x>' is not in the legend, escaped"

# --- bad input ---------------------------------------------------------------------------------
$TOOL -o $W/untouched.svg $FIX >/dev/null
mkdir -p $W/text $W/bad $W/badstep $W/zero
printf 'hello\nthis is not a log\ns:3 foo:1\n' >$W/text/main.log
printf 's:0 trl:4 lr:1e-4 norm:1\ns:1 trl:3.2x lr:1e-4 norm:1\n' >$W/bad/main.log
printf 's:0 trl:4\ns:one trl:3\n' >$W/badstep/main.log
printf 's:0 trl:4\ns:1 trl:0\n' >$W/zero/main.log
expect_error "missing file" "cannot open log file '$W/nope/main.log'" -o $W/untouched.svg $W/nope/main.log
expect_error "missing second file" "'$W/nope/main.log'" -o $W/untouched.svg $FIX $W/nope/main.log
expect_error "no parsable lines" "$W/text/main.log: no loss lines" -o $W/untouched.svg $W/text/main.log
expect_error "malformed number" "$W/bad/main.log line 2: expected a number after 'trl:', got '3.2x'" \
  -o $W/untouched.svg $W/bad/main.log
expect_error "malformed step" "$W/badstep/main.log line 2: expected a step number after 's:', got 'one'" \
  -o $W/untouched.svg $W/badstep/main.log
expect_error "--log with a zero loss" "$W/zero/main.log line 2" -o $W/untouched.svg --log $W/zero/main.log
expect_error "labels for the wrong number of logs" "--labels: 1 names for 2 log files" \
  -o $W/untouched.svg --labels a $FIX $FIX
expect_error "no -o" "-o OUT.svg is required" $FIX
expect_error "no logs" "no log files given" -o $W/untouched.svg
expect_error "unknown flag" "unknown flag '--bogus'" -o $W/untouched.svg --bogus $FIX
expect_error "bad width" "--width: expected a whole number" -o $W/untouched.svg --width 12cm $FIX

# --- real logs from the CPU trainer --------------------------------------------------------------
pick() { for p in "$@"; do [ -f "$p" ] && { echo "$p"; return; }; done; }
TRAIN=$(pick dev/data/tinyshakespeare/tiny_shakespeare_train.bin $SHARED/gpt2/tiny_shakespeare_train.bin)
VAL=$(pick dev/data/tinyshakespeare/tiny_shakespeare_val.bin $SHARED/gpt2/tiny_shakespeare_val.bin)
# A depth-2, 64-channel GPT-2 with the full GPT-2 vocabulary (tiny Shakespeare's token ids go
# up to 50256): 20 steps take about 2 s on 2 cores.
TRAINER=(./train_gpt2 -e d2c64h2t32 -i "$TRAIN" -j "$VAL" -b 2 -t 32 -x 20 -v 5 -m 2 -s 0)
if [ ! -x ./train_gpt2 ] || [ -z "$TRAIN" ] || [ -z "$VAL" ]; then
  echo "SKIP: ./train_gpt2 or tiny Shakespeare (make data, or ../shared/data) missing: real logs not plotted"
elif ! "${TRAINER[@]}" -o $W/runA >$W/runA.out 2>&1 ||
     ! "${TRAINER[@]}" -l 1e-3 -u 5 -q 0.1 -o $W/runB >$W/runB.out 2>&1; then
  # the trainer has its own tests; here it only supplies logs, and the fixtures above stand in
  echo "SKIP: ./train_gpt2 failed, real logs not plotted; its last lines:"
  tail -3 $W/runA.out $W/runB.out
else
  if plot "trainer run" -o $W/runA.svg --lr $W/runA/main.log; then
    expect_polylines "trainer run --lr" $W/runA.svg 3
    check_mapping "trainer run train loss" $W/runA.svg $W/runA/main.log trl train-loss loss-box "trl tel" 0
    check_mapping "trainer run val loss" $W/runA.svg $W/runA/main.log tel val-loss loss-box "trl tel" 0
  fi
  if plot "two trainer runs" -o $W/runs.svg --lr --norm --log $W/runA/main.log $W/runB/main.log; then
    expect_polylines "two trainer runs --lr --norm" $W/runs.svg 8
    grep -q '>runA<' $W/runs.svg && grep -q '>runB<' $W/runs.svg && pass "legend names runA and runB" ||
      fail "the legend does not name runA and runB"
  fi
  plot "trainer run, single-run mapping of runB" -o $W/runB.svg --norm $W/runB/main.log &&
    check_mapping "trainer runB norm panel" $W/runB.svg $W/runB/main.log norm norm norm-box "norm" 0
fi

if [ $fails -ne 0 ]; then echo "test_plot_log.sh: $fails FAILED"; exit 1; fi
echo "test_plot_log.sh: all passed"
