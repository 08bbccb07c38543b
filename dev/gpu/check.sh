#!/usr/bin/env bash
# dev/gpu/check.sh: the CUDA build's checks on a machine with an NVIDIA GPU, in one run of
# about 3-4 minutes on one H100/H200, never more than BUDGET seconds (default 400). Run from
# anywhere:   dev/gpu/check.sh        (OUT=DIR: the table and the logs go there too)
#
#   0. build train_gpt2, train_gpt2cu, build/test_cuda_kernels and build/testdata for this
#      GPU's architecture; run the kernel test: every deterministic kernel against its
#      train_gpt2.c twin (bit for bit) and fast mode's kernels against the reference (bf16
#      tolerances)
#   a. deterministic mode == the CPU, bit for bit: GPT-2 of depth 4 (C=256, V=50257), B=4,
#      T=64, 10 steps with validation, samples and checkpoints; main.log, the model and state
#      files of steps 5 and 10 and the sampled text must be identical
#   a2. a mixture of experts (8 experts top 2 in every layer of the same model, 4 steps),
#      deterministic mode == the CPU: main.log (with aux) and the checkpoint identical
#   b. fast mode follows the CPU within the tolerances below (the same run)
#   c. resume on the GPU: deterministic mode resumed from the step-5 checkpoint ends with the
#      same bytes as the run that did not stop (and fast mode's resume is reported)
#   d. more than one GPU: multi-GPU training (NCCL) is not done yet; said so
#   e. benchmark: GPT-2 124M (-e d12), T=1024, in fast and in deterministic mode, the largest B
#      of 64, 32, 16, 8 that fits (10 and 4 steps): tok/s, MFU (fast: bf16 dense peak,
#      deterministic: fp32 peak, as train_gpt2cu prints), GPU memory
#
# Time: every run has its own limit, and a stage starts only if its limit fits in what is
# left of BUDGET (else it is marked SKIP and the check fails), so the script ends within
# BUDGET seconds plus a few. Prints PASS / FAIL / INFO / SKIP per check and a table last; each
# row is also appended to $OUT/check_table.txt (else $W/check_table.txt) as soon as it is
# known, so a run stopped from outside still leaves its partial table. Logs: $OUT/logs.
# Exits non-zero if any check failed or was skipped.
#
# Data: tiny Shakespeare if dev/data/tinyshakespeare/*.bin exist (e.g. carried along with the
# working tree) or `make data` can make them (it downloads, or copies from ../shared/data);
# otherwise synthetic tokens (build/testdata) with GPT-2's vocabulary, and samples printed as
# token ids. Every comparison works on either.
#
# Testing this script without a GPU: GPU_BIN=path runs that program in place of
# ./train_gpt2cu (e.g. a wrapper that drops --deterministic and runs ./train_gpt2).
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
cd "$(dirname "$0")/../.." || exit 1
START=$(date +%s)
BUDGET=${BUDGET:-400}
GPU_BIN=${GPU_BIN:-./train_gpt2cu}
W=$(mktemp -d "${TMPDIR:-/tmp}/llmc_gpu_check.XXXXXX")
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi
LOGS=${OUT:+$OUT/logs}
LOGS=${LOGS:-$W/logs}
TABLE_FILE=${OUT:+$OUT/check_table.txt}
TABLE_FILE=${TABLE_FILE:-$W/check_table.txt}
mkdir -p "$LOGS"
: >"$TABLE_FILE"
TABLE=()
FAILED=0
now() { echo $(( $(date +%s) - START )); }
elapsed() { echo "$(now)s"; }
row() {
  local line
  line=$(printf '%-46s %s' "$1" "$2")
  TABLE+=("$line")
  echo "$line" >>"$TABLE_FILE"
}
pass() { echo "PASS $1${2:+: $2}"; row "$1" "PASS${2:+  $2}"; }
fail() { echo "FAIL $1${2:+: $2}"; row "$1" "FAIL${2:+  $2}"; FAILED=1; }
info() { echo "INFO $1${2:+: $2}"; row "$1" "$2"; }
summary() {
  echo
  echo "== summary ($(elapsed), logs in $LOGS) =="
  row "total" "$(elapsed) of a ${BUDGET}s budget, $([ $FAILED = 0 ] && echo "all passed" || echo "FAILURES")"
  printf '%s\n' "${TABLE[@]}"
  [ -n "${OUT:-}" ] || echo "(table: $TABLE_FILE)"
}
# in_time NAME SECONDS: true if a stage limited to SECONDS still ends within the budget;
# otherwise a SKIP row (a failure: the check did not run)
in_time() {
  if [ $(( $(now) + $2 )) -gt "$BUDGET" ]; then
    echo "SKIP $1: ${2}s would not fit in the ${BUDGET}s budget ($(elapsed) used)"
    row "$1" "SKIP (time budget: $(elapsed) used)"
    FAILED=1
    return 1
  fi
}
# run LOGNAME SECONDS cmd...: output to $LOGS/LOGNAME.out; returns the command's status
# (124: it ran past SECONDS and was stopped)
run() {
  local name=$1 secs=$2
  shift 2
  timeout -k 10 "$secs" "$@" >"$LOGS/$name.out" 2>&1
}
why() { if [ "$1" = 124 ] || [ "$1" = 137 ]; then echo "timed out"; else echo "exit $1"; fi; }
# same A B: the two files exist and are byte-identical; else says where they first differ
same() {
  if [ ! -f "$1" ] || [ ! -f "$2" ]; then echo "missing"; return 1; fi
  cmp "$1" "$2" >/dev/null 2>&1 && return 0
  cmp "$1" "$2" 2>&1 | head -1 | sed 's/.*differ: \(byte [0-9]*\).*/from \1/'
  return 1
}

echo "== machine ($(elapsed)) =="
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader || true
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
ARCHS=${CUDA_ARCHS:-${CAP:-90}}

echo "== 0. build (CUDA_ARCHS=$ARCHS) and the kernel test ($(elapsed)) =="
if run build 240 make -j"$(nproc)" train_gpt2 train_gpt2cu build/test_cuda_kernels build/testdata CUDA_ARCHS="$ARCHS"; then
  pass "build (sm_$ARCHS)"
else
  tail -30 "$LOGS/build.out"
  fail "build (sm_$ARCHS)" "see $LOGS/build.out"
  summary
  exit 1
fi
if in_time "kernel test (GPU kernels vs train_gpt2.c)" 120; then
  run kernels 120 build/test_cuda_kernels
  rc=$?
  if [ $rc -eq 0 ] && grep -q "device checks are skipped" "$LOGS/kernels.out"; then
    fail "kernel test (GPU kernels vs train_gpt2.c)" "it saw no GPU: $(grep -m1 "device checks are skipped" "$LOGS/kernels.out")"
  elif [ $rc -eq 0 ]; then
    pass "kernel test (GPU kernels vs train_gpt2.c)" "$(tail -1 "$LOGS/kernels.out")"
  else
    grep -E "FAIL|error" "$LOGS/kernels.out" | head -20
    fail "kernel test (GPU kernels vs train_gpt2.c)" "$(why $rc), $(grep -c FAIL "$LOGS/kernels.out") failures, see $LOGS/kernels.out"
  fi
fi

echo "== data ($(elapsed)) =="
TRAIN=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
VAL=dev/data/tinyshakespeare/tiny_shakespeare_val.bin
TOK=gpt2_tokenizer.bin
if ! { [ -f "$TRAIN" ] && [ -f "$VAL" ]; } && ! run data 60 make data; then
  echo "make data failed (offline, no ../shared/data): synthetic tokens"
fi
if [ -f "$TRAIN" ] && [ -f "$VAL" ]; then
  info "data" "tiny Shakespeare$([ -f "$TOK" ] || echo ", no tokenizer file: samples as ids")"
else
  TRAIN=$W/train.bin VAL=$W/val.bin TOK=$W/no_tokenizer.bin
  if build/testdata tokens "$TRAIN" 400000 50257 1 && build/testdata tokens "$VAL" 40000 50257 2; then
    info "data" "synthetic tokens (V=50257), samples as ids"
  else
    fail "data" "cannot write synthetic tokens"
    summary
    exit 1
  fi
fi

SMALL=(-e d4 -i "$TRAIN" -j "$VAL" -b 4 -t 64 -x 10 -v 5 -m 4 -s 5 -g 16 -n 5 -l 1e-3 --tokenizer "$TOK")
# the sampled text of a run's output: the lines between "generating:\n---" and "---"
samples() { awk '/^generating:/{on=1; next} on && /^---$/{n++; if (n % 2 == 0) on = 0; next} on' "$1"; }

echo "== a. deterministic mode vs the CPU, bit for bit ($(elapsed)) =="
# the status of a run: its exit status, or "not run" (its stage was skipped)
CPU_RC="not run" DET_RC="not run" FAST_RC="not run"
status() { if [ "$1" = "not run" ]; then echo "not run"; else why "$1"; fi; }
if in_time "CPU reference run (train_gpt2, for a and b)" 120; then
  run cpu 120 ./train_gpt2 "${SMALL[@]}" -o "$W/cpu"; CPU_RC=$?
  if [ $CPU_RC -ne 0 ]; then
    tail -5 "$LOGS/cpu.out"
    fail "CPU reference run (train_gpt2, for a and b)" "$(why $CPU_RC), see $LOGS/cpu.out"
  fi
fi
if in_time "a. deterministic == CPU (bit for bit)" 90; then
  run det 90 "$GPU_BIN" "${SMALL[@]}" --deterministic 1 -o "$W/det"; DET_RC=$?
  if [ "$CPU_RC" != 0 ] || [ $DET_RC -ne 0 ]; then
    tail -5 "$LOGS/det.out"
    fail "a. deterministic == CPU (bit for bit)" "a run failed (cpu: $(status "$CPU_RC"), gpu: $(why $DET_RC))"
  else
    bad=()
    for f in main.log model_00000005.bin model_00000010.bin state_00000005_00000.bin state_00000010_00000.bin DONE_00000010; do
      if ! where=$(same "$W/cpu/$f" "$W/det/$f"); then bad+=("$f ($where)"); fi
    done
    [ "$(samples "$LOGS/cpu.out")" = "$(samples "$LOGS/det.out")" ] || bad+=("samples")
    if [ ${#bad[@]} -eq 0 ]; then
      pass "a. deterministic == CPU (bit for bit)" "main.log, 2 checkpoints, 2 states, samples"
    else
      diff "$W/cpu/main.log" "$W/det/main.log" | head -10
      fail "a. deterministic == CPU (bit for bit)" "differ: ${bad[*]}"
    fi
  fi
fi

echo "== a2. a mixture of experts, deterministic mode vs the CPU ($(elapsed)) =="
MOE=(-e d4e8k2 -i "$TRAIN" -j "$VAL" -b 4 -t 64 -x 4 -v 0 -s 0 -n 4 -l 1e-3)
if in_time "a2. experts: deterministic == CPU" 120; then
  run moe_cpu 60 ./train_gpt2 "${MOE[@]}" -o "$W/moe_cpu"; MOE_CPU_RC=$?
  run moe_det 60 "$GPU_BIN" "${MOE[@]}" --deterministic 1 -o "$W/moe_det"; MOE_DET_RC=$?
  if [ $MOE_CPU_RC -ne 0 ] || [ $MOE_DET_RC -ne 0 ]; then
    tail -5 "$LOGS/moe_det.out"
    fail "a2. experts: deterministic == CPU" "a run failed (cpu: $(why $MOE_CPU_RC), gpu: $(why $MOE_DET_RC))"
  else
    bad=()
    for f in main.log model_00000004.bin; do
      if ! where=$(same "$W/moe_cpu/$f" "$W/moe_det/$f"); then bad+=("$f ($where)"); fi
    done
    if [ ${#bad[@]} -eq 0 ]; then pass "a2. experts: deterministic == CPU" "main.log (aux), checkpoint"
    else fail "a2. experts: deterministic == CPU" "differ: ${bad[*]}"; fi
  fi
fi

echo "== b. fast mode vs the CPU, within tolerances ($(elapsed)) =="
if in_time "b. fast ~ CPU (bf16 tolerances)" 90; then
  run fast 90 "$GPU_BIN" "${SMALL[@]}" -o "$W/fast"; FAST_RC=$?
  if [ $FAST_RC -eq 0 ] && [ "$CPU_RC" = 0 ]; then
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
    fail "b. fast ~ CPU (bf16 tolerances)" "a run failed (cpu: $(status "$CPU_RC"), gpu: $(why $FAST_RC))"
  fi
fi

echo "== c. resume on the GPU ($(elapsed)) =="
for mode in det fast; do
  name="c. resume ($mode)"
  in_time "$name" 60 || continue
  flag=()
  [ $mode = det ] && flag=(--deterministic 1)
  rc_first=$DET_RC
  [ $mode = fast ] && rc_first=$FAST_RC
  if [ "$rc_first" != 0 ]; then fail "$name" "the run to resume from: $(status "$rc_first")"; continue; fi
  mkdir -p "$W/${mode}_resume"
  cp "$W/$mode/model_00000005.bin" "$W/$mode/state_00000005_00000.bin" "$W/$mode/DONE_00000005" "$W/${mode}_resume/"
  if run "${mode}_resume" 60 "$GPU_BIN" "${SMALL[@]}" ${flag[@]+"${flag[@]}"} -o "$W/${mode}_resume" -y 1; then
    bad=()
    for f in model_00000010.bin state_00000010_00000.bin; do
      if ! where=$(same "$W/$mode/$f" "$W/${mode}_resume/$f"); then bad+=("$f ($where)"); fi
    done
    diff <(grep trl "$W/$mode/main.log" | sed -n '6,10p') <(grep trl "$W/${mode}_resume/main.log") >/dev/null ||
      bad+=("main.log steps 5-9")
    if [ $mode = det ]; then
      if [ ${#bad[@]} -eq 0 ]; then pass "$name" "identical bytes"; else fail "$name" "differ: ${bad[*]}"; fi
    elif [ ${#bad[@]} -eq 0 ]; then
      info "$name" "identical bytes (fast mode is deterministic run to run)"
    else
      info "$name" "differs (allowed, not promised): ${bad[*]}"
    fi
  else
    rc=$?
    tail -5 "$LOGS/${mode}_resume.out"
    fail "$name" "the resumed run failed ($(why $rc))"
  fi
done

echo "== d. GPUs: ${NGPU:-?} ($(elapsed)) =="
if [ "${NGPU:-1}" -gt 1 ]; then
  info "d. multi-GPU" "$NGPU GPUs present: multi-GPU training (NCCL DP/ZeRO/TP/PP) is not done yet; skipped"
else
  info "d. multi-GPU" "one GPU: nothing to check (and multi-GPU is not done yet)"
fi

echo "== e. benchmark: GPT-2 124M, T=1024 ($(elapsed)) =="
bench() {   # bench MODE STEPS SECONDS FLAGS...: tries B = 64, 32, 16, 8; the first that fits
  local mode=$1 steps=$2 secs=$3 rc B log
  shift 3
  for B in 64 32 16 8; do
    in_time "e. $mode d12 T=1024 B=$B" "$secs" || return 1
    log="bench_${mode}_B$B"
    run "$log" "$secs" "$GPU_BIN" -e d12 -i "$TRAIN" -j "$VAL" -b $B -t 1024 -x "$steps" -v 0 -s 0 ${1+"$@"}
    rc=$?
    if [ $rc -eq 0 ]; then
      local avg mem
      avg=$(grep '^average step time' "$LOGS/$log.out" | sed 's/average step time //')
      mem=$(grep '^device memory' "$LOGS/$log.out" | sed 's/device memory: //')
      info "e. $mode d12 T=1024 B=$B" "${avg:-no average}; ${mem:-no memory line}"
      grep '^| MFU peak' "$LOGS/$log.out"
      return 0
    fi
    if ! grep -q "GPU memory\|out of GPU memory" "$LOGS/$log.out"; then
      tail -5 "$LOGS/$log.out"
      fail "e. $mode d12 T=1024" "B=$B: $(why $rc) (not for memory), see $LOGS/$log.out"
      return 1
    fi
    echo "B=$B does not fit in $mode mode"
  done
  fail "e. $mode d12 T=1024" "no B of 64, 32, 16, 8 fits"
}
bench fast 10 60
bench deterministic 4 120 --deterministic 1

summary
rm -rf "$W/cpu" "$W/det" "$W/fast" "$W/det_resume" "$W/fast_resume" "$W/train.bin" "$W/val.bin"
exit $FAILED
