#!/usr/bin/env bash
# Hostile and inconsistent inputs to train_gpt2, end to end: every case was accepted (or
# crashed, or failed late) before it was checked, and must now end with ONE error line naming
# the file or flag and what it expects, a non-zero exit, and no checkpoint lost or written.
#   - optimizer state files (checkpoint.h) whose values disagree with the DONE marker, the
#     model and the run's flags: the microbatch count, the step, ranges listed twice, NaN or
#     negative second moments (bytes patched into a real checkpoint; layout in checkpoint.h)
#   - flags beyond what the trainer can act on (args.h): -d, -x, -m, -n beyond an int or the
#     checkpoint names, non-finite or absurd hyperparameters, an empty or too long -o
#   - a tokenizer file whose header claims 2^32 tokens
#   - a model file holding a NaN parameter
#   - temporary files of a killed checkpoint save are removed at the next start, and only
#     those
# Exits non-zero on the first failure, saying which.
set -u
cd "$(dirname "$0")/../.."
BIN=./train_gpt2
DATA=build/testdata
W=$(mktemp -d /tmp/llmc_inputs_test.XXXXXX)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }

$DATA tokens "$W/train.bin" 20000 64 1 || fail "could not write test tokens"
$DATA tokens "$W/val.bin" 3000 64 2 || fail "could not write test tokens"
COMMON=(-e d2c32h2v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 4 -t 16 -v 0 -s 0)

# expect_error PATTERN ARGS...: exit non-zero with exactly one "error: ...PATTERN..." line
expect_error() {
  local pattern=$1; shift
  $BIN "$@" >"$W/err.out" 2>&1
  local rc=$?
  [ $rc -ne 0 ] || { tail -3 "$W/err.out"; fail "expected an error matching '$pattern', got exit 0 for: $*"; }
  grep -q -- "^error: .*$pattern" "$W/err.out" || { cat "$W/err.out"; fail "no error line matching '$pattern' for: $*"; }
  [ "$(grep -c '^error:' "$W/err.out")" = 1 ] || { cat "$W/err.out"; fail "more than one error line for: $*"; }
}

# little-endian integers at a byte offset of a file
put_i64() { printf "$(printf '%016x' "$3" | sed 's/../& /g' | awk '{for (i = 8; i >= 1; i--) printf "\\x%s", $i}')" \
              | dd of="$1" bs=1 seek="$2" conv=notrunc status=none; }
put_u32() { printf "$(printf '%08x' "$3" | sed 's/../& /g' | awk '{for (i = 4; i >= 1; i--) printf "\\x%s", $i}')" \
              | dd of="$1" bs=1 seek="$2" conv=notrunc status=none; }
get_i64() { od -An -t d8 -j "$2" -N 8 "$1" | tr -d ' '; }

# --- checkpoints to corrupt: steps 2 and 4 of a run with and without shuffling (M = 1) ---
for s in 0 1; do
  $BIN "${COMMON[@]}" --shuffle $s -x 4 -n 2 -o "$W/ck$s" >"$W/ck$s.out" 2>&1 || { cat "$W/ck$s.out"; fail "base run"; }
done
STATE=state_00000004_00000.bin
P=$(get_i64 "$W/ck1/$STATE" 48)
R=$(od -An -t d4 -j 56 -N 4 "$W/ck1/$STATE" | tr -d ' ')
[ "$P" -gt 0 ] && [ "$R" -gt 0 ] || fail "cannot read P and R from the state header"
# v of parameter i: after the 1024-byte header, R ranges of 16 bytes and the P values of m
V_AT=$((1024 + 16 * R + 4 * P))

# resume_rejects NAME SHUFFLE PATTERN PATCH...: copy checkpoint ckSHUFFLE, patch its step-4
# state with the command PATCH (run with the file as its last argument), resume to step 8:
# one error line, nothing written, nothing changed
resume_rejects() {
  local name=$1 shuffle=$2 pattern=$3; shift 3
  local d="$W/$name"
  rm -rf "$d" && cp -r "$W/ck$shuffle" "$d" && cp -r "$d" "$d.before"
  "$@" "$d/$STATE"
  cp "$d/$STATE" "$d.before/$STATE"   # the patched file is what must survive
  expect_error "$pattern" "${COMMON[@]}" --shuffle "$shuffle" -x 8 -n 2 -o "$d" -y 1
  diff -r "$d.before" "$d" >/dev/null || fail "$name: the failed resume changed the checkpoint directory"
}
microbatches() { put_i64 "$2" 72 "$1"; }
step() { put_i64 "$2" 40 "$1"; }
v_value() { put_u32 "$3" $((V_AT + 4 * $1)) "$2"; }
ranges_twice() {   # the R ranges -> [0, P/2) twice: the lengths still add up to P
  head -c 1024 "$1" >"$1.new"
  put_u32 "$1.new" 56 2
  put_i64 "$1.new" 1024 0; put_i64 "$1.new" 1032 $((P / 2))
  put_i64 "$1.new" 1040 0; put_i64 "$1.new" 1048 $((P / 2))
  tail -c +$((1024 + 16 * R + 1)) "$1" >>"$1.new"
  mv "$1.new" "$1"
}

resume_rejects neg1 1 "says -1000 microbatches were consumed in 4 steps" microbatches -1000
resume_rejects neg0 0 "says -1000 microbatches were consumed in 4 steps" microbatches -1000
resume_rejects step_neg 1 "says step -5, but its name and DONE marker say step 4" step -5
resume_rejects step_big 1 "says step 2147483648, but its name and DONE marker say step 4" step 2147483648
resume_rejects twice 1 "lists parameters 0\.\.$((P / 2)), which .* lists too" ranges_twice
resume_rejects nan_v 1 "holds second moment v = nan for parameter 7" v_value 7 $((0x7fc00000))
resume_rejects neg_v 1 "holds second moment v = -1 for parameter 9" v_value 9 $((0xbf800000))
resume_rejects other_d 1 "-d: the checkpoint in .* consumed 5 microbatches in 4 steps" microbatches 5
pass "state files: negative microbatch count (shuffled or not), step != DONE, ranges twice, NaN and negative v, a count not of this -d"

# a checkpoint past the run's last step (-x) is refused rather than silently doing nothing
rm -rf "$W/past" && cp -r "$W/ck1" "$W/past"
expect_error "-x: the checkpoint in .* is at step 4, past this run's last step 2" \
  "${COMMON[@]}" --shuffle 1 -x 2 -n 2 -o "$W/past" -y 1
# and an untouched checkpoint still resumes (the checks reject nothing valid)
$BIN "${COMMON[@]}" --shuffle 1 -x 6 -n 2 -o "$W/past" -y 1 >"$W/good.out" 2>&1 || { cat "$W/good.out"; fail "a valid resume failed"; }
[ -f "$W/past/DONE_00000006" ] || fail "a valid resume wrote no checkpoint"
pass "resume: past -x refused; a valid checkpoint resumes"

# --- flags ---
expect_error "-d: 274877907008 tokens per step is 4294967297 microbatches of B\*T = 64 tokens; at most 2147483647" \
  "${COMMON[@]}" -x 2 -d 274877907008
for flag in -x -m -n -v -s -u -g -b; do
  expect_error "$flag: expected an integer in \[" "${COMMON[@]}" -x 2 $flag 3000000000
done
expect_error "-x: expected an integer in \[1, 99999999\] or -1, got '100000000'" "${COMMON[@]}" -x 100000000
for bad in "-l inf" "-l nan" "-l 1e30" "-l -0.1" "-c inf" "-c 2" "--eps inf" "--eps 0" "--eps 1e-50" \
           "--beta1 -0.1" "--beta2 1" "--grad-clip inf" "-q 1.5"; do
  set -- $bad
  expect_error "$1: expected a number in .*, got '$2'" "${COMMON[@]}" -x 2 "$1" "$2"
done
expect_error "-b/-t: B\*T = 2147483647\*16" "${COMMON[@]}" -x 2 -b 2147483647
expect_error "flag -o expects a non-empty value" "${COMMON[@]}" -x 2 -n 1 -o ""
component=$(printf 'd%.0s' $(seq 100))
long="$W"
while [ ${#long} -lt 1000 ]; do long="$long/$component"; done
expect_error "-o: output directory path is ${#long} bytes; files inside it need it to be at most" \
  "${COMMON[@]}" -x 2 -n 1 -o "$long"
[ -e "$W/$component" ] && fail "a rejected -o created directories"
# the edges of the ranges are accepted
$BIN "${COMMON[@]}" -x 1 -l 1 -c 1 -q 0 --beta1 0 --beta2 0.999 --eps 1 --grad-clip 0 >"$W/edge.out" 2>&1 \
  || { cat "$W/edge.out"; fail "the edges of the flag ranges must be accepted"; }
pass "flags: -d microbatches, 8 integer flags beyond int, -x beyond 8 digits, 13 non-finite or absurd numbers, B*T, empty and too long -o"

# --- a tokenizer file whose header claims 2^32-1 tokens ---
{ printf '\xc8\xd7\x34\x01\x02\x00\x00\x00\xff\xff\xff\xff'; head -c 1022 /dev/zero; } >"$W/huge_tokenizer.bin"
expect_error "tokenizer file '$W/huge_tokenizer.bin' has vocab_size 4294967295 but its 1034 bytes hold at most 5 tokens" \
  "${COMMON[@]}" -x 1 -s 1 --tokenizer "$W/huge_tokenizer.bin"
pass "tokenizer: a vocabulary larger than the file is refused before allocating it"
"$BIN" "${COMMON[@]}" -x 1 -s 0 --tokenizer "$W/huge_tokenizer.bin" >"$W/nosample.out" 2>&1 \
  || { tail -3 "$W/nosample.out"; fail "a corrupt tokenizer stopped a run that never samples (-s 0)"; }
pass "tokenizer: a corrupt one does not stop a run that never samples"

# --- a model file with a NaN parameter (the final layernorm's first weight, 256 bytes from
# the end of a C=32 file: lnfw then lnfb, 32 floats each) is refused unless asked; asked, the
# run stops at its first non-finite loss, before writing anything ---
cp "$W/ck0/model_00000004.bin" "$W/nan_model.bin"
put_u32 "$W/nan_model.bin" $(( $(stat -c %s "$W/nan_model.bin") - 256 )) 2143289344   # 0x7fc00000, NaN
expect_error "model file '$W/nan_model.bin' holds a non-finite parameter (nan, in lnfw" "${COMMON[@]}" -e "$W/nan_model.bin" -x 1
expect_error "step 1: the loss is nan" "${COMMON[@]}" -e "$W/nan_model.bin" -x 2 -n 1 -o "$W/nan_run" --allow-nonfinite 1
ls "$W/nan_run" | grep -q "model_" && fail "a run that diverged wrote a checkpoint"
pass "a model file with NaN parameters is refused; loaded anyway, the run stops at its first NaN loss and writes nothing"

# --- temporary files of a killed save: removed at the next start when their writer is gone ---
sh -c 'exit 0' & dead=$!
wait $dead
kill -0 $dead 2>/dev/null && fail "pid $dead is still alive: cannot test orphan removal"
rm -rf "$W/orphans" && cp -r "$W/ck1" "$W/orphans"
for f in model_00000006.bin state_00000006_00000.bin DONE_00000006; do echo x >"$W/orphans/$f.tmp.$dead"; done
echo x >"$W/orphans/model_00000006.bin.tmp.$$"   # its writer (this shell) is alive
echo x >"$W/orphans/notes.txt.tmp.$dead"          # not a checkpoint file
$BIN "${COMMON[@]}" --shuffle 1 -x 6 -n 2 -o "$W/orphans" -y 1 >"$W/orphans.out" 2>&1 || { cat "$W/orphans.out"; fail "orphan run"; }
grep -q "^removed 3 temporary file(s) left in '$W/orphans' by an interrupted checkpoint save" "$W/orphans.out" \
  || { cat "$W/orphans.out"; fail "no line saying 3 orphan temporary files were removed"; }
for f in model_00000006.bin state_00000006_00000.bin DONE_00000006; do
  [ -e "$W/orphans/$f.tmp.$dead" ] && fail "orphan $f.tmp.$dead was not removed"
done
[ -e "$W/orphans/model_00000006.bin.tmp.$$" ] || fail "the temporary file of a live process was removed"
[ -e "$W/orphans/notes.txt.tmp.$dead" ] || fail "a file not written by the checkpoint writer was removed"
pass "orphan .tmp.PID files of checkpoints removed (3), a live writer's and a foreign file kept"
echo "all bad-input tests passed"
