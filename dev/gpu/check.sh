#!/usr/bin/env bash
# dev/gpu/check.sh: the CUDA build's checks on a machine with an NVIDIA GPU, in one run that
# ends within about 8 minutes on one H100/H200. Run from anywhere:   dev/gpu/check.sh
#
#   0. build train_gpt2, train_gpt2cu and build/test_cuda_kernels for this GPU's architecture;
#      run the kernel test: every deterministic kernel against its train_gpt2.c twin (bit for
#      bit) and fast mode's kernels against the reference (bf16 tolerances)
#   a. deterministic mode == the CPU, bit for bit: GPT-2 of depth 4 (C=256, V=50257), B=4,
#      T=64, 10 steps with validation, samples and checkpoints; main.log, the model and state
#      files and the sampled text must be identical
#   b. fast mode follows the CPU within the tolerances below (the same run)
#   c. resume on the GPU: deterministic mode resumed from the step-5 checkpoint ends with the
#      same bytes as the run that did not stop (and fast mode's resume is reported)
#   d. more than one GPU: multi-GPU training (NCCL) is not done yet; said so
#   e. benchmark: GPT-2 124M (-e d12), T=1024, in fast and in deterministic mode, the largest B
#      of 64, 32, 16, 8 that fits, 20 and 10 steps: tok/s, MFU (fast: bf16 dense peak,
#      deterministic: fp32 peak, as train_gpt2cu prints), GPU memory
# Time: every run has a limit, and stages that would start after DEADLINE (420 s) are skipped
# and marked SKIP; expected total on an H100/H200 about 4-5 minutes (the build about 1).
# Prints PASS / FAIL per check and a table last; the table also goes to $OUT/check_table.txt
# and the logs to $OUT/logs when OUT is set. Exits non-zero if any check failed.
#
# Data: tiny Shakespeare from `make data` (which falls back to ../shared/data offline); where
# neither works, synthetic tokens (build/testdata) with GPT-2's vocabulary.
#
# Fast-mode tolerances (b), and why. Fast mode rounds weights and activations to bf16 (8 bits
# of mantissa: a relative rounding error up to 2^-9 = 0.2% per value) while accumulating in
# fp32; the reference is fp32 throughout. The loss is a mean over B*T positions of smooth
# functions of the logits, so the per-value rounding errors mostly average out: at init the
# two losses agree to about 1e-4 relative, and over 10 AdamW steps the two trajectories drift
# apart slowly. Train and validation losses must agree within 1e-2 relative at every step
# (llm.c's GPU test used the same order for its bf16 build). The gradient norm is a sum of
# squares dominated by the largest gradients, which carry bf16 rounding through the whole
# backward (the activation gradients are bf16 too): within 5e-2 relative. The learning rate
# does not depend on the arithmetic: equal.
set -u
cd "$(dirname "$0")/../.."
START=$(date +%s)
W=$(mktemp -d "${TMPDIR:-/tmp}/llmc_gpu_check.XXXXXX")
LOGS=${OUT:+$OUT/logs}
LOGS=${LOGS:-$W/logs}
mkdir -p "$LOGS"
TABLE=()
FAILED=0
row() { TABLE+=("$(printf '%-46s %s' "$1" "$2")"); }
pass() { echo "PASS $1${2:+: $2}"; row "$1" "PASS${2:+  $2}"; }
fail() { echo "FAIL $1${2:+: $2}"; row "$1" "FAIL${2:+  $2}"; FAILED=1; }
info() { echo "INFO $1${2:+: $2}"; row "$1" "$2"; }
elapsed() { echo $(( $(date +%s) - START ))s; }
# The whole script must end within about 8 minutes: a stage that would start after DEADLINE
# seconds is skipped (and says so), and every run has its own time limit.
DEADLINE=${DEADLINE:-420}
in_time() {   # in_time NAME: false (with a SKIP row) once the deadline has passed
  if [ $(( $(date +%s) - START )) -ge "$DEADLINE" ]; then
    echo "SKIP $1: past the ${DEADLINE}s time budget"; row "$1" "SKIP (time budget)"; FAILED=1; return 1
  fi
}
# run LOGNAME SECONDS cmd...: output to $LOGS/LOGNAME.out; returns the command's status
# (124: it ran past SECONDS and was stopped)
run() {
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" >"$LOGS/$name.out" 2>&1
}
why() { [ "$1" = 124 ] && echo "timed out" || echo "exit $1"; }

echo "== machine ($(elapsed)) =="
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader || true
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
ARCHS=${CUDA_ARCHS:-${CAP:-90}}

echo "== 0. build (CUDA_ARCHS=$ARCHS) and the kernel test ($(elapsed)) =="
if run build 420 make -j"$(nproc)" train_gpt2 train_gpt2cu build/test_cuda_kernels build/testdata CUDA_ARCHS="$ARCHS"; then
  pass "build (sm_$ARCHS)"
else
  tail -30 "$LOGS/build.out"
  fail "build (sm_$ARCHS)" "see $LOGS/build.out"
  printf '%s\n' "${TABLE[@]}"
  exit 1
fi
run kernels 150 build/test_cuda_kernels; rc=$?
if [ $rc -eq 0 ]; then
  pass "kernel test (GPU kernels vs train_gpt2.c)" "$(tail -1 "$LOGS/kernels.out")"
else
  grep -E "FAIL|error" "$LOGS/kernels.out" | head -20
  fail "kernel test (GPU kernels vs train_gpt2.c)" "$(why $rc), $(grep -c FAIL "$LOGS/kernels.out") failures, see $LOGS/kernels.out"
fi

echo "== data ($(elapsed)) =="
TRAIN=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
VAL=dev/data/tinyshakespeare/tiny_shakespeare_val.bin
TOK=gpt2_tokenizer.bin
if ! { [ -f "$TRAIN" ] && [ -f "$VAL" ]; } && ! run data 90 make data; then
  echo "make data failed (offline, no ../shared/data): synthetic tokens"
fi
if [ -f "$TRAIN" ] && [ -f "$VAL" ]; then
  info "data" "tiny Shakespeare"
else
  TRAIN=$W/train.bin VAL=$W/val.bin TOK=$W/no_tokenizer.bin
  build/testdata tokens "$TRAIN" 400000 50257 1 && build/testdata tokens "$VAL" 40000 50257 2 ||
    { fail "data" "cannot write synthetic tokens"; printf '%s\n' "${TABLE[@]}"; exit 1; }
  info "data" "synthetic tokens (V=50257)"
fi

SMALL=(-e d4 -i "$TRAIN" -j "$VAL" -b 4 -t 64 -x 10 -v 5 -m 4 -s 5 -g 16 -n 5 -l 1e-3 --tokenizer "$TOK")
samples() { awk '/^generating:/{on=1; next} on && /^---$/{n++; if (n % 2 == 0) on = 0; next} on' "$1"; }

echo "== a. deterministic mode vs the CPU, bit for bit ($(elapsed)) =="
run cpu 180 ./train_gpt2 "${SMALL[@]}" -o "$W/cpu"; CPU_RC=$?
run det 90 ./train_gpt2cu "${SMALL[@]}" --deterministic 1 -o "$W/det"; DET_RC=$?
if [ $CPU_RC -ne 0 ] || [ $DET_RC -ne 0 ]; then
  tail -5 "$LOGS/cpu.out" "$LOGS/det.out"
  fail "a. deterministic == CPU (bit for bit)" "a run failed (cpu: $(why $CPU_RC), gpu: $(why $DET_RC))"
else
  bad=()
  for f in main.log model_00000005.bin model_00000010.bin state_00000005_00000.bin state_00000010_00000.bin DONE_00000010; do
    cmp -s "$W/cpu/$f" "$W/det/$f" || bad+=("$f")
  done
  [ "$(samples "$LOGS/cpu.out")" = "$(samples "$LOGS/det.out")" ] || bad+=("samples")
  if [ ${#bad[@]} -eq 0 ]; then
    pass "a. deterministic == CPU (bit for bit)" "main.log, 2 checkpoints, state, samples"
  else
    diff <(cat "$W/cpu/main.log") <(cat "$W/det/main.log") | head -10
    fail "a. deterministic == CPU (bit for bit)" "differ: ${bad[*]}"
  fi
fi

echo "== b. fast mode vs the CPU, within tolerances ($(elapsed)) =="
run fast 90 ./train_gpt2cu "${SMALL[@]}" -o "$W/fast"; FAST_RC=$?
if [ $FAST_RC -eq 0 ] && [ $CPU_RC -eq 0 ]; then
  # per step: relative differences of train loss, val loss, norm; lr must be equal
  verdict=$(awk '
    function rel(a, b) { d = a - b; if (d < 0) d = -d; if (b < 0) b = -b; return b > 0 ? d / b : d }
    function field(s, k,   i, n, parts) { n = split(s, parts, " "); for (i = 1; i <= n; i++) if (index(parts[i], k ":") == 1) return substr(parts[i], length(k) + 2); return "" }
    FNR == 1 { file++ }
    { key = $1 (field($0, "trl") != "" ? " trl" : " tel") }
    file == 1 { ref[key] = $0; nref++; next }
    !(key in ref) { missing++; next }
    {
      r = ref[key]; seen++
      if (field($0, "trl") != "") {
        e = rel(field($0, "trl"), field(r, "trl")); if (e > loss) loss = e
        e = rel(field($0, "norm"), field(r, "norm")); if (e > norm) norm = e
        if (field($0, "lr") != field(r, "lr")) lr++
      } else {
        e = rel(field($0, "tel"), field(r, "tel")); if (e > val) val = e
      }
    }
    END {
      ok = seen == nref && !missing && loss <= 1e-2 && val <= 1e-2 && norm <= 5e-2 && !lr
      printf "%s max relative diff: train loss %.2e (<= 1e-2), val loss %.2e (<= 1e-2), norm %.2e (<= 5e-2), lr mismatches %d, lines %d/%d\n", ok ? "ok" : "bad", loss, val, norm, lr, seen, nref
    }' "$W/cpu/main.log" "$W/fast/main.log")
  case "$verdict" in
    ok*) pass "b. fast ~ CPU (bf16 tolerances)" "${verdict#ok }" ;;
    *) paste "$W/cpu/main.log" "$W/fast/main.log" | head -20; fail "b. fast ~ CPU (bf16 tolerances)" "${verdict#bad }" ;;
  esac
else
  tail -5 "$LOGS/fast.out"
  fail "b. fast ~ CPU (bf16 tolerances)" "a run failed (cpu: $(why $CPU_RC), gpu: $(why $FAST_RC))"
fi

echo "== c. resume on the GPU ($(elapsed)) =="
for mode in det fast; do
  in_time "c. resume ($mode)" || continue
  flag=(); [ $mode = det ] && flag=(--deterministic 1)
  mkdir -p "$W/${mode}_resume"
  cp "$W/$mode/model_00000005.bin" "$W/$mode/state_00000005_00000.bin" "$W/$mode/DONE_00000005" "$W/${mode}_resume/" 2>/dev/null
  if run "${mode}_resume" 90 ./train_gpt2cu "${SMALL[@]}" ${flag[@]+"${flag[@]}"} -o "$W/${mode}_resume" -y 1; then
    same=1
    for f in model_00000010.bin state_00000010_00000.bin; do cmp -s "$W/$mode/$f" "$W/${mode}_resume/$f" || same=0; done
    diff <(grep trl "$W/$mode/main.log" | sed -n '6,10p') <(grep trl "$W/${mode}_resume/main.log") >/dev/null || same=0
    if [ $mode = det ]; then
      [ $same = 1 ] && pass "c. resume (deterministic): identical bytes" || fail "c. resume (deterministic): identical bytes" "differs"
    else
      info "c. resume (fast)" "$([ $same = 1 ] && echo "identical bytes (fast mode is deterministic run to run)" || echo "differs (allowed: not promised)")"
    fi
  else
    tail -5 "$LOGS/${mode}_resume.out"
    [ $mode = det ] && fail "c. resume (deterministic): identical bytes" "the resumed run failed" || fail "c. resume (fast)" "the resumed run failed"
  fi
done

echo "== d. GPUs: $NGPU ($(elapsed)) =="
if [ "${NGPU:-1}" -gt 1 ]; then
  info "d. multi-GPU" "$NGPU GPUs present: multi-GPU training (NCCL DP/ZeRO/TP/PP) is not done yet; skipped"
else
  info "d. multi-GPU" "one GPU: nothing to check (and multi-GPU is not done yet)"
fi

echo "== e. benchmark: GPT-2 124M, T=1024 ($(elapsed)) =="
bench() {   # bench MODE STEPS SECONDS FLAGS...: tries B = 64, 32, 16, 8
  local mode=$1 steps=$2 secs=$3 rc; shift 3
  for B in 64 32 16 8; do
    in_time "e. $mode d12 T=1024 B=$B" || return 1
    run "bench_${mode}_B$B" "$secs" ./train_gpt2cu -e d12 -i "$TRAIN" -j "$VAL" -b $B -t 1024 -x "$steps" -v 0 -s 0 ${1+"$@"}
    rc=$?
    if [ $rc -eq 0 ]; then
      local avg mem
      avg=$(grep '^average step time' "$LOGS/bench_${mode}_B$B.out" | sed 's/average step time //')
      mem=$(grep '^device memory' "$LOGS/bench_${mode}_B$B.out" | sed 's/device memory: //')
      info "e. $mode d12 T=1024 B=$B" "$avg; $mem"
      grep '^| MFU peak' "$LOGS/bench_${mode}_B$B.out"
      return 0
    fi
    if ! grep -q "GPU memory\|out of GPU memory" "$LOGS/bench_${mode}_B$B.out"; then
      tail -5 "$LOGS/bench_${mode}_B$B.out"
      fail "e. $mode d12 T=1024" "B=$B: $(why $rc) (not for memory), see $LOGS/bench_${mode}_B$B.out"
      return 1
    fi
    echo "B=$B does not fit in $mode mode"
  done
  fail "e. $mode d12 T=1024" "no B of 64, 32, 16, 8 fits"
}
bench fast 20 90
bench deterministic 10 150 --deterministic 1

echo
echo "== summary ($(elapsed), logs in $LOGS) =="
printf '%s\n' "${TABLE[@]}" | tee "${OUT:-$W}/check_table.txt"
rm -rf "$W/cpu" "$W/det" "$W/fast" "$W/det_resume" "$W/fast_resume"
exit $FAILED
