#!/usr/bin/env bash
# End-to-end tests of train_gpt2 on a tiny model and synthetic tokens (V=64):
#   determinism, resume (also after a kill -9 in the middle of checkpointing), gradient
#   accumulation invariance, the bf16 checkpoint, the loss going down, and every bad input
#   getting one clear error line, a non-zero exit, and nothing overwritten.
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
BIN=./train_gpt2
DATA=build/testdata
W=$(mktemp -d /tmp/llmc_train_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }

$DATA tokens "$W/train.bin" 20000 64 1 || fail "could not write test tokens"
$DATA tokens "$W/val.bin" 3000 64 2 || fail "could not write test tokens"
MODEL=d2c32h2v64t32
COMMON=(-e $MODEL -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -v 5 -m 3 -s 0 -l 3e-3 --shuffle 0)

run() {   # run OUT_NAME args...: output to $W/NAME.out, fail on non-zero exit
  local name=$1; shift
  $BIN "$@" >"$W/$name.out" 2>&1 || { cat "$W/$name.out"; fail "$name: exit code $?"; }
}
train_lines() { grep trl "$1"; }

# --- determinism: two identical runs, identical logs and checkpoint bytes ---
run a "${COMMON[@]}" -x 10 -n 5 -o "$W/a"
run b "${COMMON[@]}" -x 10 -n 5 -o "$W/b"
cmp -s "$W/a/main.log" "$W/b/main.log" || fail "two identical runs wrote different logs"
for f in model_00000005.bin model_00000010.bin state_00000010_00000.bin; do
  cmp -s "$W/a/$f" "$W/b/$f" || fail "two identical runs wrote different $f"
done
[ -f "$W/a/DONE_00000010" ] || fail "no DONE marker for the last checkpoint"
[ "$(grep -c trl "$W/a/main.log")" = 10 ] || fail "main.log should have 10 train lines"
grep -q '^s:0 trl:[0-9.e+-]* lr:[0-9.e+-]* norm:[0-9.e+-]*$' "$W/a/main.log" || fail "main.log line format"
grep -q '^s:10 tel:' "$W/a/main.log" || fail "main.log has no final validation line"
first=$(grep '^s:0 trl' "$W/a/main.log" | sed 's/.*trl:\([^ ]*\).*/\1/')
last=$(grep '^s:9 trl' "$W/a/main.log" | sed 's/.*trl:\([^ ]*\).*/\1/')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.3) }' || fail "loss did not fall: $first -> $last"
pass "determinism: identical logs and checkpoints; loss $first -> $last"

# --- resume from the step-5 checkpoint: the same losses and final bytes ---
mkdir -p "$W/r"
cp "$W/a/model_00000005.bin" "$W/a/state_00000005_00000.bin" "$W/a/DONE_00000005" "$W/r/"
run r "${COMMON[@]}" -x 10 -n 5 -o "$W/r" -y 1
grep -q "resuming" "$W/r.out" || fail "resume run did not say it resumed"
cmp -s "$W/a/model_00000010.bin" "$W/r/model_00000010.bin" || fail "resumed run ends with different parameters"
cmp -s "$W/a/state_00000010_00000.bin" "$W/r/state_00000010_00000.bin" || fail "resumed run ends with a different optimizer state"
diff <(train_lines "$W/a/main.log" | sed -n '6,10p') <(train_lines "$W/r/main.log") >/dev/null \
  || fail "resumed run's losses differ from the uninterrupted run's"
pass "resume from step 5: identical steps 5-9 and final checkpoint"

# --- a run stopped after its step-10 checkpoint was begun but not finished (no DONE_10)
# resumes from step 5 in the same directory: main.log reads as one run (the steps after the
# checkpoint are not repeated) ---
cp -r "$W/a" "$W/again"
rm "$W/again/DONE_00000010"
run again "${COMMON[@]}" -x 10 -n 5 -o "$W/again" -y 1
grep -q "from step 5" "$W/again.out" || fail "the run without DONE_10 did not resume from step 5"
cmp -s "$W/a/main.log" "$W/again/main.log" || fail "main.log of a resumed run repeats or loses steps: $(diff "$W/a/main.log" "$W/again/main.log" | head -4)"
pass "resume in place: main.log identical to the uninterrupted run's"

# --- kill -9 at random moments while checkpointing every step, then resume ---
run kref "${COMMON[@]}" -x 60 -n 30 -o "$W/kref"
killed_mid=0
for attempt in 1 2 3 4; do
  rm -rf "$W/k"
  $BIN "${COMMON[@]}" -x 60 -n 1 -o "$W/k" >"$W/k.out" 2>&1 &
  pid=$!
  sleep "0.0$((RANDOM % 9 + 1))"
  kill -9 $pid 2>/dev/null
  wait $pid 2>/dev/null
  [ -f "$W/k/DONE_00000060" ] || killed_mid=$((killed_mid + 1))
  run k2 "${COMMON[@]}" -x 60 -n 1 -o "$W/k" -y 1
  cmp -s "$W/kref/model_00000060.bin" "$W/k/model_00000060.bin" \
    || fail "run killed and resumed (attempt $attempt) ends with different parameters"
done
[ $killed_mid -ge 1 ] || fail "the kill never landed before the run finished: the test proved nothing"
pass "kill -9 at random moments ($killed_mid of 4 mid-run) + resume: identical final checkpoint"

# --- gradient accumulation: B=4 x 1 == B=2 x 2 == B=1 x 4 microbatches ---
ACC=(-e $MODEL -i "$W/train.bin" -j "$W/val.bin" -t 16 -v 0 -s 0 -l 1e-3 --shuffle 0 -x 6 -n 6 -d 64)
run m1 "${ACC[@]}" -b 4 -o "$W/m1"
run m2 "${ACC[@]}" -b 2 -o "$W/m2"
run m4 "${ACC[@]}" -b 1 -o "$W/m4"
for m in m2 m4; do
  cmp -s "$W/m1/main.log" "$W/$m/main.log" || fail "$m: losses differ from a single microbatch of B=4"
  cmp -s "$W/m1/model_00000006.bin" "$W/$m/model_00000006.bin" || fail "$m: parameters differ from B=4"
done
pass "gradient accumulation: 1, 2 and 4 microbatches give identical logs and parameters"

# --- shuffled data and the other schedules run and are deterministic too ---
run s1 -e $MODEL -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -x 4 -v 2 -s 2 -g 30 -k linear -u 2 -q 0.1 -c 0.1 -o "$W/s1" --tokenizer "$W/none.bin"
run s2 -e $MODEL -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -x 4 -v 2 -s 2 -g 30 -k linear -u 2 -q 0.1 -c 0.1 -o "$W/s2" --tokenizer "$W/none.bin" --kv-cache 0
cmp -s "$W/s1/main.log" "$W/s2/main.log" || fail "shuffled runs differ"
grep -q "generating" "$W/s1.out" || fail "no sample was generated"
# the KV cache's samples are the full forward's (s2 runs one per token), token for token
[ "$(grep -c generating "$W/s1.out")" = 2 ] || fail "2 samples expected (steps 0 and 2)"
diff <(grep -A2 generating "$W/s1.out") <(grep -A2 generating "$W/s2.out") >/dev/null \
  || fail "samples with the KV cache differ from --kv-cache 0's full forward per token"
lr0=$(grep '^s:0 trl' "$W/s1/main.log" | sed 's/.*lr:\([^ ]*\).*/\1/')
[ "$lr0" = "0.000150000007" ] || fail "warmup: lr at step 0 should be 3e-4 * 1/2, got $lr0"
pass "shuffle, sampling without a tokenizer file (the KV cache = a full forward per token), linear schedule with warmup"

# --- a bf16 (version 5) checkpoint loads as its exactly rounded values ---
$DATA bf16 "$W/a/model_00000005.bin" "$W/bf16.bin" "$W/rounded.bin" || fail "bf16 conversion"
run h1 -e "$W/bf16.bin" -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0 -o "$W/h1"
run h2 -e "$W/rounded.bin" -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0 -o "$W/h2"
cmp -s "$W/h1/main.log" "$W/h2/main.log" || fail "bf16 checkpoint does not load as its rounded values"
pass "bf16 checkpoint (version 5) reads exactly"

# --- help ---
$BIN --help >"$W/help.out" 2>&1 || fail "--help exited non-zero"
grep -q -- "--grad-clip" "$W/help.out" && grep -q -- "-e" "$W/help.out" || fail "--help does not list the flags"
pass "--help"

# --- bad input: one clear error line, non-zero exit, nothing overwritten ---
expect_error() {   # expect_error 'pattern' args...
  local pattern=$1; shift
  $BIN "$@" >"$W/err.out" 2>&1
  local rc=$?
  [ $rc -ne 0 ] || fail "expected failure for: $* (exit 0)"
  grep -q "^error: .*$pattern" "$W/err.out" || { cat "$W/err.out"; fail "no error line matching '$pattern' for: $*"; }
  [ "$(grep -c '^error:' "$W/err.out")" = 1 ] || fail "more than one error line for: $*"
}
GOOD=(-i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0)
printf 'garbage' >"$W/garbage.bin"
head -c 2000 "$W/a/model_00000005.bin" >"$W/trunc_model.bin"
python_free_patch() { # patch_int FILE OFFSET VALUE: writes a little-endian int32 at OFFSET
  printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x' $(( $3 & 255 )) $(( ($3 >> 8) & 255 )) $(( ($3 >> 16) & 255 )) $(( ($3 >> 24) & 255 )))" \
    | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
cp "$W/a/model_00000005.bin" "$W/badmagic.bin"; python_free_patch "$W/badmagic.bin" 0 12345
cp "$W/a/model_00000005.bin" "$W/badversion.bin"; python_free_patch "$W/badversion.bin" 4 7
cp "$W/train.bin" "$W/badtok_magic.bin"; python_free_patch "$W/badtok_magic.bin" 0 777
head -c 5000 "$W/train.bin" >"$W/trunc_tokens.bin"
$DATA tokens "$W/tiny.bin" 40 64 3
$DATA tokens "$W/bigvocab.bin" 3000 200 4
expect_error "smaller than the 1024-byte header" -e "$W/garbage.bin" "${GOOD[@]}"
expect_error "truncated"        -e "$W/trunc_model.bin" "${GOOD[@]}"
expect_error "magic 12345"      -e "$W/badmagic.bin" "${GOOD[@]}"
expect_error "version 7"        -e "$W/badversion.bin" "${GOOD[@]}"
expect_error "not found"        -e "$W/missing.bin" "${GOOD[@]}"
expect_error "magic 777"        -e $MODEL "${GOOD[@]/$W\/train.bin/$W/badtok_magic.bin}"
expect_error "truncated"        -e $MODEL -i "$W/trunc_tokens.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0
expect_error "no token files"   -e $MODEL -i "$W/nothing*.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0
expect_error "token id"         -e $MODEL -i "$W/bigvocab.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0
expect_error "fewer than B\*T+1" -e $MODEL -i "$W/tiny.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0
expect_error "exceeds the model's maxT" -e $MODEL "${GOOD[@]}" -t 64
expect_error "unknown flag"     -e $MODEL "${GOOD[@]}" -Z 3
expect_error "needs a value"    -e $MODEL "${GOOD[@]}" -b
expect_error "expects an integer" -e $MODEL "${GOOD[@]}" -b four
expect_error "not a multiple"   -e $MODEL "${GOOD[@]}" -d 100
expect_error "schedule"         -e $MODEL "${GOOD[@]}" -k sawtooth
expect_error "ZeRO stage"       -e $MODEL "${GOOD[@]}" -z 5
expect_error "need an output directory" -e $MODEL "${GOOD[@]}" -n 2
expect_error "divide channels"  -e d2c30h4v64t32 "${GOOD[@]}"
touch "$W/notadir"
expect_error "not a directory"  -e $MODEL "${GOOD[@]}" -o "$W/notadir"
mkdir -p "$W/ro" && chmod 500 "$W/ro"
if [ "$(id -u)" != 0 ]; then   # root can write anywhere
  expect_error "not writable"   -e $MODEL "${GOOD[@]}" -o "$W/ro"
fi
expect_error "cannot create output directory" -e $MODEL "${GOOD[@]}" -o /proc/llmc_no_such_dir/sub
# a failed run leaves an existing checkpoint alone
cp "$W/a/model_00000010.bin" "$W/keep.bin"
expect_error "magic 777" -e $MODEL -i "$W/badtok_magic.bin" -j "$W/val.bin" -b 4 -t 16 -x 2 -v 0 -s 0 -n 1 -o "$W/a" -y 1
cmp -s "$W/keep.bin" "$W/a/model_00000010.bin" || fail "a failing run changed an existing checkpoint"
ls "$W/a" | grep -q tmp && fail "temporary files left behind"
pass "bad inputs: 22 cases, one error line each, non-zero exit, checkpoints untouched"
echo "all train_gpt2 end-to-end tests passed"
