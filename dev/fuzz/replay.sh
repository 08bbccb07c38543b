#!/usr/bin/env bash
# Replays every fuzz target's inputs once under ASan + UBSan (a libFuzzer binary given files
# runs each once): the seeds from make_seeds (build/fuzz/seeds/TARGET) and the committed
# regression inputs (dev/fuzz/regressions/TARGET). Each input's name says what must happen:
#   ok-*   accepted: no error line
#   bad-*  rejected: exactly one "error: ..." line, naming the file (the target's temporary
#          directory /tmp/llmc_fuzz.*)
# and no input may crash or raise a sanitizer report. Needs `make test` (or `make fuzz`) to
# have built the targets with clang; without clang it fails saying what to install.
set -u
cd "$(dirname "$0")/../.."
TARGETS="model state tokens tokenizer safetensors bpe bpe_roundtrip"
fail() { echo "FAIL: $*"; exit 1; }

for t in $TARGETS; do
  [ -x "build/fuzz/fuzz_$t" ] || fail "build/fuzz/fuzz_$t is not built: the fuzz targets need clang with" \
    "libFuzzer, ASan and UBSan (Debian: apt-get install clang libclang-rt-dev), then make test"
done
[ -f build/fuzz/seeds/.done ] || fail "no seeds in build/fuzz/seeds: run make test"

shopt -s nullglob
failed=0
for t in $TARGETS; do
  inputs=(build/fuzz/seeds/"$t"/* dev/fuzz/regressions/"$t"/*)
  [ ${#inputs[@]} -gt 0 ] || fail "fuzz_$t: no inputs to replay"
  log=build/fuzz/replay_$t.log
  if ! "build/fuzz/fuzz_$t" "${inputs[@]}" >"$log" 2>&1; then
    tail -40 "$log"
    echo "FAIL: fuzz_$t crashed or raised a sanitizer report on $(grep '^Running: ' "$log" | tail -1 | cut -d' ' -f2)"
    failed=$((failed + 1))
    continue
  fi
  # Per input, the distinct error lines between its "Running:" and "Executed" lines (libFuzzer
  # runs an input a second time when it suspects a leak: the same line twice is one line).
  awk -v target="fuzz_$t" '
    /^Running: / { name = $2; sub(/.*\//, "", name); n = 0; delete seen; next }
    /^error: /   { if (!($0 in seen)) { seen[$0] = 1; n++; line = $0 }; next }
    /^Executed / {
      if (name ~ /^ok-/ && n != 0) { print "FAIL: " target " " name ": must be accepted, got: " line; bad++ }
      else if (name ~ /^bad-/ && n != 1) { print "FAIL: " target " " name ": must be rejected with one error line, got " n; bad++ }
      else if (name ~ /^bad-/ && index(line, "/tmp/llmc_fuzz.") == 0) { print "FAIL: " target " " name ": the error does not name the file: " line; bad++ }
      else if (name !~ /^(ok|bad)-/) { print "FAIL: " target " " name ": an input must be named ok-* or bad-*"; bad++ }
      else if (name ~ /^ok-/) { accepted++ } else { rejected++ }
    }
    END {
      if (bad) { exit 1 }
      printf "ok   %s: %d accepted, %d rejected with one error line each\n", target, accepted, rejected
    }' "$log" || failed=$((failed + 1))
done
[ $failed -eq 0 ] || fail "$failed of the fuzz targets failed their replay (logs in build/fuzz/replay_*.log)"
echo "all fuzz targets replayed their seeds and regressions cleanly"
