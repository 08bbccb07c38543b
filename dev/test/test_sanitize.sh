#!/usr/bin/env bash
# The test drivers and the trainer run clean under AddressSanitizer + UndefinedBehaviorSanitizer
# with leak checking (mk/sanitize.mk builds them in build/asan/, single-process, no MPI, so every
# allocation is ours): the unit tests, the token writer, the tensor-parallel operators on one
# rank, and train_gpt2 through validation, sampling, checkpoints, a resume and a bad input (and
# a mixture-of-experts model's training, validation, sampling and checkpoints).
# Any sanitizer report fails the program, and so this test.
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d /tmp/llmc_sanitize.XXXXXX)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=23
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export OMP_NUM_THREADS=2

san() {   # san NAME CMD...: runs CMD, fails on a non-zero exit or any sanitizer report
  local name=$1; shift
  "$@" >"$W/$name.log" 2>&1 || { tail -30 "$W/$name.log"; fail "$name: exit code $?"; }
  if grep -q "ERROR: AddressSanitizer\|ERROR: LeakSanitizer\|runtime error:" "$W/$name.log"; then
    grep -m5 -A10 "ERROR\|runtime error" "$W/$name.log"
    fail "$name: sanitizer report"
  fi
}

for t in test_canonical test_kernels test_gpt2 test_tp_ops; do san "$t" "build/asan/$t"; done
pass "unit tests (canonical arithmetic, kernels, gradients, tensor-parallel operators)"
san testdata build/asan/testdata tokens "$W/train.bin" 8000 64 1
san testdata_val build/asan/testdata tokens "$W/val.bin" 2000 64 2
pass "testdata"
T=(build/asan/train_gpt2 -e d2c32h2v64t32 -i "$W/train.bin" -j "$W/val.bin" -b 2 -t 16 -v 2 -m 2 -s 2 -g 6 -l 3e-3)
san train "${T[@]}" -x 4 -n 2 -o "$W/run"
rm "$W/run/DONE_00000004"
san resume "${T[@]}" -x 4 -n 2 -o "$W/run" -y 1
grep -q "from step 2" "$W/resume.log" || fail "the sanitized run did not resume from step 2"
printf 'garbage' > "$W/bad.bin"
build/asan/train_gpt2 -e d2c32h2v64t32 -i "$W/bad.bin" -j "$W/val.bin" -t 16 -x 1 >"$W/bad.log" 2>&1 \
  && fail "a bad token file was accepted"
grep -q "ERROR: AddressSanitizer\|ERROR: LeakSanitizer\|runtime error:" "$W/bad.log" && { cat "$W/bad.log"; fail "sanitizer report on a bad input"; }
pass "train_gpt2: training, validation, sampling, checkpoints, resume, a bad input"
san moe "${T[@]}" -e d2c32h2v64t32e4k2 -x 3 -n 3 -r 0 -o "$W/moe"
pass "train_gpt2 with a mixture of experts: training, validation, sampling, checkpoints"
