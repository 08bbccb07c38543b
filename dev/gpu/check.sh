#!/usr/bin/env bash
# dev/gpu/check.sh: the CUDA build's checks on a machine with an NVIDIA GPU, in one run that
# ends within BUDGET seconds (default 330). It can fail, and says which check did.
#
# ---- RUN IT (a GPU session; one H200 for 15 minutes in all, machine start included) -------
#   command:   OUT=$OUT BUDGET=330 dev/gpu/check.sh
#   carry:     dev/data/tinyshakespeare  gpt2_tokenizer.bin
#              (git-ignored: make them here first with `make data`; build outputs need not
#              travel, stage 0 builds for the GPU it finds)
#   timeout_s: 360 (every run is cut at BUDGET; then the packing. Start ~2 min + 330 s
#              leaves time for one rerun in the 15 minutes; a rerun of some stages only:
#              STAGES="2 3" OUT=$OUT BUDGET=200 dev/gpu/check.sh, stage 0's build is kept
#              on a warm machine)
#   comes back under $OUT: check_table.txt (one row per check, appended as soon as it is
#   known, so a run killed from outside still reports) and check_logs.tar.gz (every log:
#   the build, each run's console output and main.log, the per-step drift tables, GPU
#   memory samples). The table is also printed last on stdout. Exit status: 0 only if
#   nothing FAILed and nothing was SKIPped.
#
# Row status: PASS / FAIL; INFO (a number to read, not a verdict); SKIP (the stage's time
# would not fit in what is left of BUDGET: counts as a failure, the check did not run);
# N/A (not available on this machine, e.g. no Open MPI: not a failure, said why: a lent
# machine without Open MPI cannot be fixed offline, and the same multi-rank layouts over the
# same staged transport are run by make test on the emulated GPU).
#
# ---- the stages ----------------------------------------------------------------------------
#  0. build for this GPU (CUDA_ARCHS from nvidia-smi's compute_cap, 90 on Hopper):
#     train_gpt2 (NO_MPI=1 without mpicc), train_gpt2cu, build/test_cuda_kernels,
#     build/test_attention_gpu (cuDNN), build/testdata. cuDNN and NCCL are looked for under
#     /usr/local/cuda, /usr, CUDNN_HOME / NCCL_HOME, and else as pip wheels (nvidia-cudnn-cu13,
#     nvidia-nccl-cu13: python3 -c 'import nvidia.cudnn'); a wheel gets a shim directory in
#     build/gpucheck/ (the wheels ship libcudnn.so.9 only, the Makefile links -lcudnn).
#     Then build/test_cuda_kernels (every deterministic kernel bit-exact against its CPU
#     twin, fast kernels within tolerance; "device checks are skipped" is a FAIL here) and
#     build/test_attention_gpu (cuDNN vs the CPU vs flash; exit 77 = saw no GPU = FAIL here).
#  1. deterministic == CPU, bit for bit: GPT-2 of depth 4 (C=256, V=50257) on tiny
#     Shakespeare, B=4 T=64, 10 steps with validation (-v 5), samples (-s 5) and checkpoints
#     (-n 5): main.log, model and state files of steps 5 and 10, DONE_10 and the sampled text
#     identical to train_gpt2's. Then the GPU run resumed (-y 1) from its own step-5
#     checkpoint ends with the same bytes (main.log, step-10 model and state, samples).
#     And a mixture of experts (d4e8k2: 8 experts, top 2, in every layer; 4 steps): main.log
#     (with the aux loss) and the checkpoint identical to train_gpt2's.
#  2. fast mode vs the CPU on REAL tokens (synthetic tokens are refused: FAIL, carry the
#     data): one repeated batch (-a 1 --shuffle 0), d4, B=4 T=64, 60 steps at -l 1e-3, for
#     --attention cudnn and --attention flash (the banner must say which ran):
#       step 0   loss, gradient norm and validation loss within the tight tolerances below;
#       drift    every step's loss and norm within tolerances that grow with the step;
#       learns   the final loss below H/4, where H is the unigram entropy of the batch's
#                targets (computed here from the token file; 4.28 nats for tiny Shakespeare's
#                first 256 targets): H is the least loss any model ignoring the context can
#                reach on this batch, so going far below it means attention and MLPs learn;
#                ln V = 10.82 at init. The CPU gets to ~0.008 nats in 60 steps. The CPU
#                itself must pass it too (else the configuration proves nothing).
#     and cuDNN vs flash with the same drift tolerances (they differ only in the attention's
#     roundings, a subset of what separates each from fp32). And this GPU's flash fast mode
#     against the EMULATED fast mode's numbers for the same run (dev/gpu/golden: a small d2
#     run on the same tokens, its main.log from train_gpt2cu_emu, kept current by make test):
#     the same kernels on other hardware, within the same tolerances. Per-step tables with
#     every tolerance beside the measured drift: drift_*.txt in the archive.
#  3. finite values: every loss, lr, norm, ms, tok/s and MFU printed on the console and
#     every value in main.log of every GPU run is a number (a regex on the token: awk
#     comparisons with "nan" are silently false); a "diverged" line fails too. A bad run
#     gets its own FAIL row at once; one summary row at the end.
#  4. several ranks on one GPU over the staged transport: mpirun -np 2 train_gpt2cu
#     --deterministic 1 --comm mpi with -z 3 (data parallel, ZeRO-3), --tp 2, --pp 2, --cp 2
#     (context parallelism's ring attention: its device kernels and its messages), the
#     global batch -d 512 (2 microbatches): main.log, the final model file and the samples
#     identical to train_gpt2 on one rank with the same -d. Without mpirun/mpicc: N/A (not a
#     failure: this machine cannot run it; make test runs the same layouts on the emulated
#     GPU, dev/test/test_cuda_emu.sh). Fast mode on 2 pipeline stages (1f1b, zb1) identical to
#     fast mode on one rank; fast --tp 2 run and finite (its tolerance: test_fast_tp.sh), fast
#     --tp 2 --sp 1 and fast --tp 2 --pp 2 (4 ranks, zb1) identical to fast --tp 2 (with NCCL
#     only on 4+ GPUs), fast --cp 2 --cp-mode a2a and ring, and --cp 2 --tp 2 --sp 1 --cp-mode
#     ring (4 ranks), run and finite with their cp bytes = the formula (their tolerances:
#     test_fast_cp.sh), fast --cp 2 --pp 2 (4 ranks, zb1, a2a) identical to fast --cp 2 --cp-mode
#     a2a, fast experts (S1_MOE's model) --tp 2 and --cp 2 --cp-mode a2a run and finite (with
#     the cp bytes = the formula; their tolerances: test_fast_moe.sh). With 2+ GPUs also --comm
#     nccl, and fast-mode data parallelism's tok/s from 1 to N GPUs (INFO).
#  5. benchmark: GPT-2 124M (-e d12), T=1024, the largest B of 32, 16, 8 that fits; fast
#     mode with cuDNN and with flash attention (10 steps), deterministic mode (4 steps):
#     tok/s and MFU of the run summary (steps after the first), GPU memory (the startup
#     table's line and nvidia-smi's peak). Targets, INFO only: fast >= 55% MFU;
#     deterministic >= 1/3 of fast's tok/s.
#  6. only when STAGES names it (not in the default set: it needs ~5 minutes of its own):
#     fast mode's MFU per layout, dev/bench/bench_fast_mfu.sh (DP, TP 2, PP 2 1f1b with 8
#     microbatches, CP 2 at T=8192, experts d12e8k2 with EP 2; d12 and d24 at T=1024): an
#     INFO row per table line, the table in $OUT/mfu_table.txt. A GPU session records it with
#       STAGES="0 6" OUT=$OUT BUDGET=330 dev/gpu/check.sh
#     (the README's MFU table is filled from that file).
#
# ---- fast-mode tolerances (stage 2), and why -----------------------------------------------
# bf16 keeps 8 significant bits: unit roundoff u = 2^-8; round-to-nearest makes a relative
# error uniform in [-u/2, u/2], of standard deviation rho = u/(2 sqrt 3) = 1.13e-3. fp32
# accumulation and fp32 master weights/AdamW make everything else negligible (2^-24).
#   K = 4L + 2   bf16 roundings on one position's path to its logits (per layer: layernorm 1,
#                attention output, layernorm 2, GELU output; then the final layernorm and the
#                logits). Independent errors add in quadrature: a logit carries a relative
#                error sf = rho sqrt(K) (L=4: 4.8e-3); a gradient entry, whose backward path
#                has as many activation-gradient roundings again, sb = rho sqrt(2K) (6.8e-3).
#   N = B*T      positions per step. The loss is their mean and each gradient entry a sum over
#                them; their rounding errors are independent, so both shrink by sqrt(N).
#   S = 6        safety factor (a 6-sigma bound for an estimate of the error's size).
#   step 0 (the same weights on both sides):
#     loss   |d| <= tol_l0 = S sf Z / sqrt(N), Z = 1 bounding the logits' size at init
#            (wte ~ N(0, 0.02^2) against a unit-rms layernorm output: rms 0.02 sqrt(C) <= 0.6);
#            L=4, N=256: 1.8e-3 nats (1.7e-4 of ln V). The validation loss at step 0: the same.
#     norm   |d|/norm <= tol_n0 = S sb / sqrt(N) = 2.5e-3 (relative)
#   step s >= 1 (after s updates the weights differ): each update carries a fresh relative
#   error ~ sb/sqrt(N); they accumulate as a random walk, D(s) = tol_n0 sqrt(s), and act on
#   the progress made, l_0 - l_s (the CPU's losses):
#     loss   |d| <= tol_l0 + D(s) (l_0 - l_s)              (L=4, s=10, loss 7: 0.032 nats)
#     norm   |d|/norm <= tol_n0 + D(s) (l_0 - l_s) / min(l_s, 1): a loss drift of x nats
#            scales the predicted probabilities, hence dlogits = p - y, by about x; below one
#            nat the gradient is proportional to the loss (measured: norm ~ 2.2 loss), so
#            its relative drift is the loss's relative drift.
#   The learning rate does not depend on the arithmetic: equal strings. These are estimates:
#   every row prints measured/tolerance, the drift tables print them per step; the first GPU
#   run calibrates S (raise it with a reason if a correct kernel set needs more).
#
# ---- knobs -------------------------------------------------------------------------------
#   BUDGET=330  OUT=dir (default build/gpu_check)  STAGES="0 1 2 3 4 5" (a subset reruns only
#   those)  CUDA_ARCHS=90  CUDNN_HOME=...  NCCL_HOME=...  DATA_DIR=dev/data/tinyshakespeare
#   DRY RUN, no GPU (dev/test/test_gpu_check.sh does this in make test): DRY_RUN=1 skips
#   stage 0 and uses tiny models; GPU_BIN=path runs that in place of ./train_gpt2cu for the
#   deterministic runs (./train_gpt2cu_emu), FAST_BIN=path for the fast-mode runs (default
#   in a dry run: dev/gpu/cpu_as_fast.sh, ./train_gpt2 dressed as fast mode: drift 0). In a
#   dry run stages 1, 4 and 5 train on synthetic tokens of V=64 (the emulator is far too
#   slow for V=50257); stage 2 still needs the real tokens and refuses synthetic ones.
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
START=$(date +%s)
BUDGET=${BUDGET:-330}
DRY_RUN=${DRY_RUN:-0}
STAGES=" ${STAGES:-0 1 2 3 4 5} "
GPU_BIN=${GPU_BIN:-./train_gpt2cu}
if [ "$DRY_RUN" = 1 ]; then FAST_BIN=${FAST_BIN:-dev/gpu/cpu_as_fast.sh}; else FAST_BIN=${FAST_BIN:-$GPU_BIN}; fi
CPU_BIN=./train_gpt2
DEFAULT_DATA=dev/data/tinyshakespeare
DATA_DIR=${DATA_DIR:-$DEFAULT_DATA}
TOKENIZER=${TOKENIZER:-gpt2_tokenizer.bin}
OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT" || exit 1
TABLE_FILE=$OUT/check_table.txt
ARCHIVE=$OUT/check_logs.tar.gz
W=$(mktemp -d "${TMPDIR:-/tmp}/llmc_gpu_check.XXXXXX") || exit 1
LOGS=$W/logs
mkdir -p "$LOGS"
: >"$TABLE_FILE"
rm -f "$ARCHIVE"

# ---- rows, time, runs ----------------------------------------------------------------------
TABLE=()
FAILED=0 SKIPPED=0
now() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(now) )); }
row() {   # row STATUS NAME DETAIL: printed, kept for the final table, appended to the file
  local line
  line=$(printf '%-4s  %-44s  %s' "$1" "$2" "$3")
  TABLE+=("$line")
  echo "$line" >>"$TABLE_FILE"
  echo "$line"
}
pass() { row PASS "$1" "${2:-}"; }
fail() { row FAIL "$1" "${2:-}"; FAILED=$((FAILED + 1)); }
info() { row INFO "$1" "${2:-}"; }
na()   { row N/A "$1" "${2:-}"; }
skip() { row SKIP "$1" "${2:-}"; SKIPPED=$((SKIPPED + 1)); }
want() { [[ "$STAGES" == *" $1 "* ]]; }
stage() { echo; echo "== $* ($(now)s of ${BUDGET}s) =="; }
# in_time NAME SECONDS: true if a stage expected to take SECONDS fits in what is left of the
# budget; else a SKIP row (a failure)
in_time() {
  if [ $(( $(now) + $2 )) -gt "$BUDGET" ]; then
    skip "$1" "needs ~${2}s, only $(left)s of the ${BUDGET}s budget left"
    return 1
  fi
}
# run NAME LIMIT CMD...: output (after a first line "$ CMD") in $LOGS/NAME.out; LIMIT seconds
# at most, and never past the budget; sets RC (124 or 137: stopped by the limit)
RC=0
run() {
  local name=$1 limit=$2 l
  shift 2
  l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  [ "$limit" -lt 1 ] && limit=1
  echo "\$ $*" >"$LOGS/$name.out"
  MPI_TIMEOUT=$limit timeout -k 5 "$limit" "$@" >>"$LOGS/$name.out" 2>&1
  RC=$?
  if [ $RC = 124 ] || [ $RC = 137 ]; then echo "(stopped after ${limit}s)" >>"$LOGS/$name.out"; fi
  return $RC
}
why() { if [ "$1" = 124 ] || [ "$1" = 137 ]; then echo "timed out"; else echo "exit $1"; fi; }
# pair TAG LIMIT GPU_COMMAND... -- ARGS...: the CPU's run and GPU_COMMAND's of the same ARGS,
# output in $W/TAG_cpu and $W/TAG_gpu (logs kept, the GPU's numbers checked finite); 0 if both
# ran, else a FAIL row for $name saying which did not
pair() {
  local tag=$1 limit=$2 gpu=() rc_cpu rc_gpu
  shift 2
  while [ "$1" != -- ]; do gpu+=("$1"); shift; done
  shift
  run "${tag}_cpu" "$limit" $CPU_BIN "$@" -o "$W/${tag}_cpu"; rc_cpu=$RC; keep "${tag}_cpu" "$W/${tag}_cpu"
  run "${tag}_gpu" "$limit" "${gpu[@]}" "$@" -o "$W/${tag}_gpu"; rc_gpu=$RC; keep "${tag}_gpu" "$W/${tag}_gpu"
  finite "${tag}_gpu" "$W/${tag}_gpu"
  [ $rc_cpu = 0 ] && [ $rc_gpu = 0 ] && return 0
  [ $rc_cpu != 0 ] && said "${tag}_cpu"
  [ $rc_gpu != 0 ] && said "${tag}_gpu"
  fail "$name" "a run failed: CPU $(why $rc_cpu), GPU $(why $rc_gpu); see ${tag}_*.out"
  return 1
}
# tail of a failed run's output, on the console, and a short reason for its row
said() { tail -4 "$LOGS/$1.out" | sed 's/^/    /'; grep -m1 -i 'error\|fatal' "$LOGS/$1.out" | cut -c1-150; }
# keep NAME DIR: the run's main.log goes into the archive as NAME.main.log
keep() { [ -f "$2/main.log" ] && cp "$2/main.log" "$LOGS/$1.main.log"; }
# same A B: identical files, else prints where they first differ
same() {
  if [ ! -f "$1" ] || [ ! -f "$2" ]; then echo "missing $([ -f "$1" ] && echo "${2##*/}" || echo "${1##*/}")"; return 1; fi
  cmp -s "$1" "$2" && return 0
  cmp "$1" "$2" 2>/dev/null | head -1 | sed 's/.*differ: \(.*\)/\1/'
  return 1
}
# the sampled text of a run's output: the lines between "generating:\n---" and "---"
samples() { awk '/^generating:/ {on = 1; next} on && /^---$/ {n++; if (n % 2 == 0) on = 0; next} on' "$1"; }
pack() {   # every log into the one archive (replaced whole, so a killed run leaves a good one)
  tar czf "$ARCHIVE.tmp" -C "$W" logs 2>/dev/null && mv "$ARCHIVE.tmp" "$ARCHIVE"
}
finish() {
  echo
  echo "== table ($(now)s of ${BUDGET}s; logs: $ARCHIVE) =="
  local verdict="all passed"
  [ $((FAILED + SKIPPED)) -gt 0 ] && verdict="$FAILED failed, $SKIPPED skipped"
  row "----" "total" "$(now)s of a ${BUDGET}s budget, stages${STAGES% }: $verdict" >/dev/null
  cp "$TABLE_FILE" "$LOGS/check_table.txt"
  pack
  printf '%s\n' "${TABLE[@]}"
  rm -rf "$W"
}
on_signal() {
  fail "killed" "signal received at $(now)s"
  finish
  exit 2
}
trap on_signal TERM INT HUP

# ---- finite values (stage 3): every number printed or logged is a number -------------------
NUMRE='^[-+]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$'
FINITE_VALUES=0 FINITE_OUTPUTS=0 FINITE_FAILS=0
# finite NAME DIR: checks $LOGS/NAME.out (console) and DIR/main.log; a FAIL row if one is not
finite() {
  want 3 || return 0
  local name=$1 dir=$2 res n
  res=$(awk -v numre="$NUMRE" '
    function strip(v) { gsub(/^[(]+/, "", v); gsub(/[,;)%]+$/, "", v); return v }
    function check(v, what) {
      n++; v = strip(v)
      if (v !~ numre) { nbad++; if (bad == "") bad = sprintf("%s line %d: %s \"%s\"", fname, FNR, what, v) }
    }
    FNR == 1 { fname = FILENAME; sub(/.*\//, "", fname); if (FILENAME ~ /main[.]log$/) fname = "main.log" }
    /diverged/ { nbad++; if (bad == "") bad = sprintf("%s line %d: %s", fname, FNR, substr($0, 1, 100)) }
    FILENAME ~ /main[.]log$/ {
      for (i = 1; i <= NF; i++) { k = $i; sub(/:.*/, "", k); v = $i; sub(/^[^:]*:/, "", v); check(v, k) }
      next
    }
    /^step +[0-9]+\// || /^val loss / || /^run summary/ || /^  average step / || /^  best val loss / {
      for (i = 1; i <= NF; i++) {
        t = strip($i)
        if (t == "loss" || t == "lr" || t == "norm" || t == "MFU") check($(i + 1), t)
        if (i < NF && ($(i + 1) == "ms" || $(i + 1) ~ /^(tok|GFLOP|TFLOP)\/s,?$/)) check($i, strip($(i + 1)))
      }
    }
    END { printf "%d %s\n", n, bad == "" ? "ok" : sprintf("%d non-number(s), the first: %s", nbad, bad) }' "$LOGS/$name.out" $([ -f "$dir/main.log" ] && echo "$dir/main.log"))
  n=${res%% *}
  FINITE_VALUES=$((FINITE_VALUES + n))
  FINITE_OUTPUTS=$((FINITE_OUTPUTS + 1))
  if [ "${res#* }" != ok ]; then
    FINITE_FAILS=$((FINITE_FAILS + 1))
    fail "3. finite values: $name" "${res#* }"
  fi
}

# ---- machine -------------------------------------------------------------------------------
stage "machine"
NGPU=0 CAP=""
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  info "machine" "$NGPU GPU(s): $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1); $(getconf _NPROCESSORS_ONLN) cores"
elif [ "$DRY_RUN" = 1 ]; then
  info "machine" "dry run (DRY_RUN=1): no GPU; GPU_BIN=$GPU_BIN, FAST_BIN=$FAST_BIN; $(getconf _NPROCESSORS_ONLN) cores"
else
  fail "machine" "nvidia-smi not found: no NVIDIA driver? (DRY_RUN=1 tests this script without a GPU)"
fi
ARCHS=${CUDA_ARCHS:-${CAP:-90}}
HAVE_MPI=0
command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 && HAVE_MPI=1

# ---- configurations: the GPU's, and the dry run's tiny ones ----------------------------------
if [ "$DRY_RUN" = 1 ]; then
  DET_MODEL=d2c32h2v64t32 DET_V=64
  S1=(-e $DET_MODEL -b 4 -t 16 -x 6 -v 3 -m 2 -s 3 -g 8 -n 3 -l 3e-3); S1_MID=3 S1_END=6
  S1_MOE=(-e d2c32h2v64t32e4k2 -b 4 -t 16 -x 3 -v 0 -s 0 -n 3 -l 3e-3); S1_MOE_END=3
  S4_MOE=d2c32h2v64t32e4k2   # stage 4's model with experts (S4's shape and steps)
  S2_B=2 S2_T=16
  S2=(-e d2c32h2t32 -b $S2_B -t $S2_T -x 40 -a 1 --shuffle 0 -l 1e-2 -v 40 -m 2 -s 40 -g 8)
  S4=(-e $DET_MODEL -b 2 -t 16 -d 64 -x 3 -v 3 -m 2 -s 3 -g 4 -n 3); S4_END=3
  BENCH=(-e $DET_MODEL -t 32 -v 0 -s 0); BENCH_NAME="$DET_MODEL T=32"; FAST_STEPS=3 DET_STEPS=2
  T1=30 T2=30 T4=30 T5=30   # limits of one run per stage
else
  DET_MODEL=d4 DET_V=50257
  S1=(-e d4 -b 4 -t 64 -x 10 -v 5 -m 4 -s 5 -g 16 -n 5 -l 1e-3); S1_MID=5 S1_END=10
  S1_MOE=(-e d4e8k2 -b 4 -t 64 -x 4 -v 0 -s 0 -n 4 -l 1e-3); S1_MOE_END=4
  S4_MOE=d4e8k2
  S2_B=4 S2_T=64
  S2=(-e d4 -b $S2_B -t $S2_T -x 60 -a 1 --shuffle 0 -l 1e-3 -v 60 -m 4 -s 60 -g 16)
  S4=(-e d4 -b 4 -t 64 -d 512 -x 4 -v 2 -m 2 -s 4 -g 8 -n 4); S4_END=4
  BENCH=(-e d12 -t 1024 -v 0 -s 0); BENCH_NAME="d12 T=1024"; FAST_STEPS=10 DET_STEPS=4
  T1=90 T2=120 T4=90 T5=120
fi
STEP_END=$(printf %08d "$S1_END") STEP_MID=$(printf %08d "$S1_MID")

# ---- 0. build and the GPU's own tests ----------------------------------------------------------
# find_wheel HEADER: the directory of an NVIDIA pip wheel (nvidia-cudnn-cu13: site-packages/
# nvidia/cudnn, with include/HEADER and lib/), looked for in python3's site-packages
find_wheel() {
  local sp h
  for sp in $(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
    h=$(ls -d "$sp"/nvidia/*/include/"$1" "$sp"/nvidia/*/*/include/"$1" 2>/dev/null | head -1)
    if [ -n "$h" ]; then dirname "$(dirname "$h")"; return; fi
  done
}
# shim NAME DIR LIB: build/gpucheck/NAME with DIR's include/ and every file of DIR's lib/, plus
# libLIB.so (the wheels ship libLIB.so.N only; the Makefile looks for libLIB.so)
shim() {
  local d=$ROOT/build/gpucheck/$1 f lib=$2/lib
  [ -d "$lib" ] || lib=$2/lib64
  rm -rf "$d" && mkdir -p "$d/lib" && ln -s "$2/include" "$d/include"
  for f in "$lib"/*; do ln -s "$f" "$d/lib/${f##*/}"; done
  [ -e "$d/lib/lib$3.so" ] || ln -s "$(ls "$lib/lib$3.so."* 2>/dev/null | head -1)" "$d/lib/lib$3.so"
  echo "$d"
}
# cuDNN and NCCL: the toolkit's or the system's, else pip wheels (also for a rerun without
# stage 0: the trainer finds the wheels' libraries through LD_LIBRARY_PATH)
MAKE_VARS=(CUDA_ARCHS="$ARCHS")
command -v mpicc >/dev/null 2>&1 || MAKE_VARS+=(NO_MPI=1)
if [ "$DRY_RUN" != 1 ]; then
  if [ -z "${CUDNN_HOME:-}" ] && ! ls /usr/local/cuda/include/cudnn_graph.h /usr/include/cudnn_graph.h \
       /usr/include/x86_64-linux-gnu/cudnn_graph.h >/dev/null 2>&1; then
    wd=$(find_wheel cudnn_graph.h)
    if [ -n "$wd" ]; then
      CUDNN_HOME=$(shim cudnn "$wd" cudnn); export LD_LIBRARY_PATH="$CUDNN_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  fi
  if [ -z "${NCCL_HOME:-}" ] && ! ls /usr/local/cuda/include/nccl.h /usr/include/nccl.h >/dev/null 2>&1; then
    wd=$(find_wheel nccl.h)
    if [ -n "$wd" ]; then
      NCCL_HOME=$(shim nccl "$wd" nccl); export LD_LIBRARY_PATH="$NCCL_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  fi
  [ -n "${CUDNN_HOME:-}" ] && MAKE_VARS+=(CUDNN_HOME="$CUDNN_HOME")
  [ -n "${NCCL_HOME:-}" ] && MAKE_VARS+=(NCCL_HOME="$NCCL_HOME")
fi
if want 0 && [ "$DRY_RUN" != 1 ]; then
  stage "0. build (CUDA_ARCHS=$ARCHS) and the GPU's own tests"
  info "0. toolchain" "$( (/usr/local/cuda/bin/nvcc --version || nvcc --version) 2>/dev/null | grep -o 'release [0-9.]*' | head -1); cuDNN: ${CUDNN_HOME:-system}; NCCL: ${NCCL_HOME:-system}; MPI: $([ $HAVE_MPI = 1 ] && echo yes || echo "no (single rank)")"
  targets=(train_gpt2 train_gpt2cu build/test_cuda_kernels build/test_attention_gpu build/testdata)
  if in_time "0. build (sm_$ARCHS)" 60; then
    run build 200 make -k -j"$(getconf _NPROCESSORS_ONLN)" "${targets[@]}" "${MAKE_VARS[@]}"
    missing=()
    for t in "${targets[@]}"; do [ -x "$t" ] || missing+=("$t"); done
    if [ $RC = 0 ] && [ ${#missing[@]} = 0 ]; then
      pass "0. build (sm_$ARCHS)" "${targets[*]} in $(now)s"
    else
      grep -m5 -i 'error' "$LOGS/build.out"
      fail "0. build (sm_$ARCHS)" "make: $(why $RC); not built: ${missing[*]:-none}; see build.out"
    fi
  fi
  name="0. kernel test (build/test_cuda_kernels)"
  if in_time "$name" 30; then
    run kernels 90 build/test_cuda_kernels
    if [ $RC = 0 ] && grep -q "device checks are skipped" "$LOGS/kernels.out"; then
      fail "$name" "it saw no GPU: $(grep -m1 'device checks are skipped' "$LOGS/kernels.out")"
    elif [ $RC = 0 ]; then
      pass "$name" "$(tail -1 "$LOGS/kernels.out")"
    else
      grep -m10 FAIL "$LOGS/kernels.out"
      fail "$name" "$(why $RC), $(grep -c FAIL "$LOGS/kernels.out") FAIL line(s): $(grep -m1 FAIL "$LOGS/kernels.out" | cut -c1-100)"
    fi
  fi
  name="0. attention test (cuDNN vs CPU vs flash)"
  if in_time "$name" 20; then
    run attention 60 build/test_attention_gpu
    case $RC in
      0) pass "$name" "$(grep -m1 '^PASS' "$LOGS/attention.out" | cut -c1-120)" ;;
      77) fail "$name" "skipped itself (exit 77): $(tail -1 "$LOGS/attention.out")" ;;
      *) grep -m10 -A3 FAIL "$LOGS/attention.out"; fail "$name" "$(why $RC): $(tail -1 "$LOGS/attention.out" | cut -c1-120)" ;;
    esac
  fi
  pack
elif want 0; then
  info "0. build and the GPU's own tests" "not run: dry run (no GPU)"
fi

# ---- data: tiny Shakespeare, or (stages 1, 4, 5 only) synthetic tokens ------------------------
TRAIN=$DATA_DIR/tiny_shakespeare_train.bin VAL=$DATA_DIR/tiny_shakespeare_val.bin
REAL=0
if { [ ! -f "$TRAIN" ] || [ ! -f "$VAL" ]; } && [ "$DATA_DIR" = "$DEFAULT_DATA" ]; then
  run data 60 make data   # offline it copies ../shared/data when there is one
fi
if [ -f "$TRAIN" ] && [ -f "$VAL" ]; then
  REAL=1
  info "data" "tiny Shakespeare ($TRAIN)$([ -f "$TOKENIZER" ] || echo "; no $TOKENIZER: samples as token ids")"
  [ -f "$TOKENIZER" ] || TOKENIZER=$W/no_tokenizer.bin   # samples as token ids: still comparable
else
  TOKENIZER=$W/no_tokenizer.bin
  msg="no tiny Shakespeare in $DATA_DIR: carry dev/data/tinyshakespeare and gpt2_tokenizer.bin (make data first)"
  if [ "$DRY_RUN" = 1 ]; then info "data" "$msg"; else fail "data" "$msg; stages 1, 4, 5 use synthetic tokens"; fi
fi
# the deterministic stages' tokens: real ones on the GPU when there; synthetic in a dry run
if [ "$DRY_RUN" = 1 ] || [ $REAL = 0 ]; then
  DTRAIN=$W/synth_train.bin DVAL=$W/synth_val.bin
  if ! { build/testdata tokens "$DTRAIN" 400000 $DET_V 1 && build/testdata tokens "$DVAL" 40000 $DET_V 2; } >/dev/null 2>&1; then
    fail "data" "build/testdata cannot write synthetic tokens (make build/testdata)"
  fi
else
  DTRAIN=$TRAIN DVAL=$VAL
fi
D1=(-i "$DTRAIN" -j "$DVAL" --tokenizer "$TOKENIZER")

# ---- 1. deterministic == CPU, bit for bit ------------------------------------------------------
if want 1; then
  stage "1. deterministic mode vs the CPU, bit for bit"
  name="1. deterministic == CPU (bit for bit)"
  if in_time "$name" 40; then
    run s1_cpu $T1 $CPU_BIN "${S1[@]}" "${D1[@]}" -o "$W/s1_cpu"; rc_cpu=$RC; keep s1_cpu "$W/s1_cpu"
    run s1_gpu $T1 $GPU_BIN --deterministic 1 "${S1[@]}" "${D1[@]}" -o "$W/s1_gpu"; rc_gpu=$RC; keep s1_gpu "$W/s1_gpu"
    finite s1_gpu "$W/s1_gpu"
    if [ $rc_cpu != 0 ] || [ $rc_gpu != 0 ]; then
      [ $rc_cpu != 0 ] && said s1_cpu
      [ $rc_gpu != 0 ] && said s1_gpu
      fail "$name" "a run failed: CPU $(why $rc_cpu), GPU $(why $rc_gpu); see s1_*.out"
    else
      bad=()
      for f in main.log model_$STEP_MID.bin model_$STEP_END.bin state_${STEP_MID}_00000.bin \
               state_${STEP_END}_00000.bin DONE_$STEP_END; do
        where=$(same "$W/s1_cpu/$f" "$W/s1_gpu/$f") || bad+=("$f ($where)")
      done
      [ -n "$(samples "$LOGS/s1_cpu.out")" ] || bad+=("no samples printed")
      [ "$(samples "$LOGS/s1_cpu.out")" = "$(samples "$LOGS/s1_gpu.out")" ] || bad+=("samples")
      if [ ${#bad[@]} = 0 ]; then
        pass "$name" "main.log ($(grep -c trl "$W/s1_cpu/main.log") steps, $(grep -c tel "$W/s1_cpu/main.log") val), 2 models, 2 states, DONE, samples"
      else
        diff "$W/s1_cpu/main.log" "$W/s1_gpu/main.log" | head -6
        fail "$name" "differ: ${bad[*]}"
      fi
    fi
  fi
  name="1. deterministic resume on the GPU (-y 1)"
  if in_time "$name" 15; then
    r=$W/s1_resume
    mkdir -p "$r"
    cp "$W/s1_gpu/model_$STEP_MID.bin" "$W/s1_gpu/state_${STEP_MID}_00000.bin" "$W/s1_gpu/DONE_$STEP_MID" \
       "$W/s1_gpu/main.log" "$r/" 2>/dev/null
    if [ ! -f "$r/model_$STEP_MID.bin" ]; then
      fail "$name" "no step-$S1_MID checkpoint to resume from (the run above failed)"
    elif ! run s1_resume $T1 $GPU_BIN --deterministic 1 "${S1[@]}" "${D1[@]}" -o "$r" -y 1; then
      keep s1_resume "$r"; said s1_resume
      fail "$name" "the resumed run failed: $(why $RC)"
    else
      keep s1_resume "$r"; finite s1_resume "$r"
      bad=()
      grep -q "resuming .*from step $S1_MID" "$LOGS/s1_resume.out" || bad+=("it did not say it resumed from step $S1_MID")
      for f in main.log model_$STEP_END.bin state_${STEP_END}_00000.bin DONE_$STEP_END; do
        where=$(same "$W/s1_gpu/$f" "$r/$f") || bad+=("$f ($where)")
      done
      # the resumed run samples from its first step on: the full run's last samples
      nres=$(samples "$LOGS/s1_resume.out" | wc -l)
      [ "$(samples "$LOGS/s1_gpu.out" | tail -n "$nres")" = "$(samples "$LOGS/s1_resume.out")" ] || bad+=("samples")
      if [ ${#bad[@]} = 0 ]; then pass "$name" "from step $S1_MID: main.log, model, state, DONE of step $S1_END and samples identical"
      else fail "$name" "differ from the uninterrupted run: ${bad[*]}"; fi
    fi
  fi
  name="1. experts: deterministic == CPU"   # a mixture of experts (llmc/moe.h), its device twins
  if in_time "$name" 20; then
    if pair s1_moe $T1 $GPU_BIN --deterministic 1 -- "${S1_MOE[@]}" "${D1[@]}"; then
      bad=()
      for f in main.log model_$(printf %08d "$S1_MOE_END").bin; do
        where=$(same "$W/s1_moe_cpu/$f" "$W/s1_moe_gpu/$f") || bad+=("$f ($where)")
      done
      if [ ${#bad[@]} = 0 ]; then pass "$name" "main.log (with aux) and the checkpoint identical"
      else fail "$name" "differ: ${bad[*]}"; fi
    fi
  fi
  rm -rf "$W/s1_cpu" "$W/s1_gpu" "$W/s1_resume" "$W/s1_moe_cpu" "$W/s1_moe_gpu"
  pack
fi

# ---- 2. fast mode vs the CPU, within bf16 tolerances ------------------------------------------
# compare SCALE REF GOT L N DRIFTFILE: dev/gpu/fast_tolerance.awk (the tolerances derived in
# the header, defined there once): "S0 ok|bad DETAIL", "DRIFT ok|bad DETAIL", "FINAL LOSS"
compare() {
  awk -v L="$4" -v N="$5" -v drift="$6" -f "$ROOT/dev/gpu/fast_tolerance.awk" "$1" "$2" "$3"
}
if want 2; then
  stage "2. fast mode vs the CPU on real tokens, within bf16 tolerances"
  if [ $REAL = 0 ]; then
    fail "2. fast mode vs CPU (real tokens)" "refusing synthetic tokens (fast mode must learn real text): carry dev/data/tinyshakespeare and gpt2_tokenizer.bin (make data)"
  elif in_time "2. fast mode vs CPU (real tokens)" 40; then
    D2=(-i "$TRAIN" -j "$VAL" --tokenizer "$TOKENIZER")
    # H: the unigram entropy of the repeated batch's targets (tokens 1..B*T of the file, after
    # its 1024-byte header); the final loss must be below H/4
    H=$(od -A n -t u2 -v -j 1026 -N $((2 * S2_B * S2_T)) "$TRAIN" | tr -s ' ' '\n' | grep -v '^$' |
        awk '{c[$1]++; n++} END {for (k in c) {p = c[k] / n; h -= p * log(p)}; printf "%.4f", h}')
    LEARN=$(awk -v h="$H" 'BEGIN {printf "%.4f", h / 4}')
    run s2_cpu $T2 $CPU_BIN "${S2[@]}" "${D2[@]}" -o "$W/s2_cpu"; rc_cpu=$RC; keep s2_cpu "$W/s2_cpu"
    [ $rc_cpu = 0 ] || { said s2_cpu; fail "2. CPU reference run" "$(why $rc_cpu); see s2_cpu.out"; }
    L2=$(sed -n 's/^| model *L=\([0-9]*\) .*/\1/p' "$LOGS/s2_cpu.out" | head -1)
    N2=$((S2_B * S2_T))
    for att in cudnn flash; do
      name="2. fast ($att)"
      in_time "$name vs CPU" 15 || continue
      run "s2_$att" $T2 $FAST_BIN --attention $att "${S2[@]}" "${D2[@]}" -o "$W/s2_$att"; rc=$RC; keep "s2_$att" "$W/s2_$att"
      finite "s2_$att" "$W/s2_$att"
      if [ $rc != 0 ]; then said "s2_$att"; fail "$name vs CPU" "the run failed: $(why $rc); see s2_$att.out"; continue; fi
      banner=$(grep -m1 '^| attention' "$LOGS/s2_$att.out" | sed 's/^| attention *//')
      case "$att:$banner" in
        cudnn:cuDNN*|flash:flash*) ;;
        *) fail "$name: the attention that ran" "asked for $att, the banner says: ${banner:-nothing}" ;;
      esac
      grep -q '^generating:' "$LOGS/s2_$att.out" || fail "$name: sampling" "no sample printed"
      [ $rc_cpu = 0 ] || continue
      res=$(compare "$W/s2_cpu/main.log" "$W/s2_cpu/main.log" "$W/s2_$att/main.log" "${L2:-4}" $N2 "$LOGS/drift_${att}_vs_cpu.txt")
      s0=$(echo "$res" | sed -n 's/^S0 //p') dr=$(echo "$res" | sed -n 's/^DRIFT //p') fin=$(echo "$res" | sed -n 's/^FINAL //p')
      if [ "${s0%% *}" = ok ]; then pass "$name: step 0 vs CPU" "${s0#* }"; else fail "$name: step 0 vs CPU" "${s0#* }"; fi
      if [ "${dr%% *}" = ok ]; then pass "$name: drift vs CPU" "${dr#* }"; else fail "$name: drift vs CPU" "${dr#* }"; fi
      cfin=$(grep trl "$W/s2_cpu/main.log" | tail -1 | sed 's/.*trl:\([^ ]*\).*/\1/')
      detail="final loss $fin (CPU $cfin), threshold H/4 = $LEARN (H = $H nats, the batch's unigram entropy; ln V = 10.82)"
      if awk -v f="$fin" -v c="$cfin" -v t="$LEARN" -v re="$NUMRE" 'BEGIN {exit !(f ~ re && c ~ re && f + 0 < t + 0 && c + 0 < t + 0)}'; then
        pass "$name: learns" "$detail"
      else
        fail "$name: learns" "$detail"
      fi
    done
    name="2. fast cuDNN vs flash"
    if [ -f "$W/s2_cudnn/main.log" ] && [ -f "$W/s2_flash/main.log" ] && [ $rc_cpu = 0 ]; then
      res=$(compare "$W/s2_cpu/main.log" "$W/s2_cudnn/main.log" "$W/s2_flash/main.log" "${L2:-4}" $N2 "$LOGS/drift_flash_vs_cudnn.txt")
      s0=$(echo "$res" | sed -n 's/^S0 //p') dr=$(echo "$res" | sed -n 's/^DRIFT //p')
      if [ "${s0%% *}" = ok ] && [ "${dr%% *}" = ok ]; then pass "$name" "step 0: ${s0#* }; ${dr#* }"
      else fail "$name" "step 0: ${s0#* }; ${dr#* }"; fi
    else
      fail "$name" "a run is missing (see the rows above)"
    fi
  fi
  # the same kernels on the emulated GPU: dev/gpu/golden holds the emulated run's main.log
  # (make test keeps it current); this GPU's flash fast mode must be within the bf16 tolerances
  # of it (the emulator's reference GEMM accumulates in another order than the tensor cores)
  name="2. fast (flash) vs emulated fast"
  GOLDEN=$ROOT/dev/gpu/golden/fast_emu_tinyshakespeare
  if [ $REAL = 1 ] && in_time "$name" 10; then
    read -r -a S2E <"$GOLDEN.args"
    S2E_D=(-i "$TRAIN" -j "$VAL")
    S2E_N=$(echo "${S2E[*]}" | awk '{for (i = 1; i < NF; i++) {if ($i == "-b") b = $(i + 1); if ($i == "-t") t = $(i + 1)}; print b * t}')
    S2E_L=$(echo "${S2E[*]}" | sed -n 's/.*-e d\([0-9]*\).*/\1/p')
    if pair s2e $T2 $FAST_BIN --attention flash -- "${S2E[@]}" "${S2E_D[@]}"; then
      res=$(compare "$W/s2e_cpu/main.log" "$GOLDEN.log" "$W/s2e_gpu/main.log" "$S2E_L" "$S2E_N" "$LOGS/drift_gpu_vs_emu.txt")
      s0=$(echo "$res" | sed -n 's/^S0 //p') dr=$(echo "$res" | sed -n 's/^DRIFT //p')
      if [ "${s0%% *}" = ok ] && [ "${dr%% *}" = ok ]; then pass "$name" "step 0: ${s0#* }; ${dr#* }"
      else fail "$name" "step 0: ${s0#* }; ${dr#* }"; fi
    fi
  fi
  rm -rf "$W/s2_cpu" "$W/s2_cudnn" "$W/s2_flash" "$W/s2e_cpu" "$W/s2e_gpu"
  pack
fi

# ---- 4. several ranks: one GPU shared over the staged transport (and NCCL with 2+ GPUs) ---------
# differ REF RUN: what of RUN's main.log, final model and samples differs from REF's (nothing:
# identical)
differ() {
  local f where bad=()
  for f in main.log "model_$(printf %08d $S4_END).bin"; do
    where=$(same "$W/$1/$f" "$W/$2/$f") || bad+=("$f ($where)")
  done
  [ "$(samples "$LOGS/$1.out")" = "$(samples "$LOGS/$2.out")" ] || bad+=("samples")
  echo "${bad[*]}"
}
# layouts NAME COMM: 2 ranks with -z 3, --tp 2, --pp 2, --cp 2 against the CPU on one rank
layouts() {
  local comm=$1 layout ln bad
  for layout in "-z 3" "--tp 2" "--pp 2" "--cp 2"; do
    ln=$(echo "$layout" | tr -d ' -')
    name="4. 2 ranks $layout --comm $comm"
    in_time "$name" 15 || continue
    run "s4_${comm}_$ln" $T4 dev/test/mpi.sh 2 $GPU_BIN --deterministic 1 --comm "$comm" "${S4[@]}" "${D1[@]}" $layout \
        -o "$W/s4_${comm}_$ln"
    keep "s4_${comm}_$ln" "$W/s4_${comm}_$ln"
    finite "s4_${comm}_$ln" "$W/s4_${comm}_$ln"
    if [ $RC != 0 ]; then said "s4_${comm}_$ln"; fail "$name" "$(why $RC); see s4_${comm}_$ln.out"; continue; fi
    bad=$(differ s4_cpu "s4_${comm}_$ln")
    grep -q "transport *$comm" "$LOGS/s4_${comm}_$ln.out" || bad="$bad the banner does not say transport $comm"
    if [ -z "$bad" ]; then pass "$name" "main.log, final model, samples identical to the CPU on 1 rank"
    else fail "$name" "differ from the CPU on 1 rank: $bad"; fi
  done
}
# fast_layouts COMM: fast mode on 2 pipeline stages (1f1b; zb1, the split backward) against
# fast mode on one rank: identical, as on the emulated GPU (the same kernels on the same rows,
# bf16 boundaries, the split halves computing what the whole backward does)
fast_layouts() {
  local comm=$1 sched bad ln
  name="4. fast mode on 1 rank (-d 512)"
  in_time "$name" 15 || return
  run s4_fast $T4 $FAST_BIN "${S4[@]}" "${D1[@]}" -o "$W/s4_fast"; keep s4_fast "$W/s4_fast"; finite s4_fast "$W/s4_fast"
  if [ $RC != 0 ]; then said s4_fast; fail "$name" "$(why $RC)"; return; fi
  for sched in 1f1b zb1; do
    name="4. fast 2 ranks --pp 2 --schedule $sched --comm $comm"
    in_time "$name" 15 || continue
    run "s4_fast_${comm}_$sched" $T4 dev/test/mpi.sh 2 $FAST_BIN --comm "$comm" "${S4[@]}" "${D1[@]}" --pp 2 \
        --schedule $sched -o "$W/s4_fast_${comm}_$sched"
    keep "s4_fast_${comm}_$sched" "$W/s4_fast_${comm}_$sched"
    finite "s4_fast_${comm}_$sched" "$W/s4_fast_${comm}_$sched"
    if [ $RC != 0 ]; then said "s4_fast_${comm}_$sched"; fail "$name" "$(why $RC); see s4_fast_${comm}_$sched.out"; continue; fi
    bad=$(differ s4_fast "s4_fast_${comm}_$sched")
    if [ -z "$bad" ]; then pass "$name" "main.log, final model, samples identical to fast mode on 1 rank"
    else fail "$name" "differ from fast mode on 1 rank: $bad"; fi
  done
  # tensor parallelism (within a tolerance of one rank: test_fast_tp.sh derives it, so here it
  # must run and stay finite), sequence parallelism and tensor parallelism inside 2 pipeline
  # stages (4 ranks, zb1: the split backward): the same bits as --tp 2 alone; context
  # parallelism, the all-to-all, the ring, and the ring under --tp 2 --sp 1 (their tolerances:
  # test_fast_cp.sh; here each runs, stays finite, and its cp bytes equal the formula on the
  # trainer's accounting line), and inside 2 pipeline stages (zb1): the same bits as --cp 2
  # alone; a model with experts under --tp 2 and --cp 2 (their tolerances against one rank:
  # test_fast_moe.sh; here each runs and stays finite, and under --cp 2 its cp bytes equal the
  # formula)
  local tp np flags mode ref what
  for tp in "--tp 2" "--tp 2 --sp 1" "--tp 2 --pp 2 --schedule zb1" "--cp 2 --cp-mode a2a" "--cp 2 --cp-mode ring" \
            "--cp 2 --tp 2 --sp 1 --cp-mode ring" "--cp 2 --pp 2 --schedule zb1 --cp-mode a2a" "experts --tp 2" \
            "experts --cp 2 --cp-mode a2a"; do
    ln=$(echo "$tp" | tr -d ' -')
    np=$(echo "$tp" | awk '{ n = 1; for (i = 1; i < NF; i++) if ($i == "--tp" || $i == "--pp" || $i == "--cp") n *= $(i + 1); print n }')
    mode=$(echo "$tp" | sed -n 's/.*--cp-mode \([a-z0-9]*\).*/\1/p')
    flags=${tp#experts }; [ "$flags" = "$tp" ] || flags="$flags -e $S4_MOE"   # (a later -e wins)
    name="4. fast $np ranks $tp --comm $comm"
    if [ "$comm" = nccl ] && [ $np -gt "$NGPU" ]; then info "$name" "NCCL needs a GPU per rank: $np ranks, $NGPU GPUs"; continue; fi
    in_time "$name" 15 || continue
    run "s4_fast_${comm}_$ln" $T4 dev/test/mpi.sh $np $FAST_BIN --comm "$comm" "${S4[@]}" "${D1[@]}" $flags \
        -o "$W/s4_fast_${comm}_$ln"
    keep "s4_fast_${comm}_$ln" "$W/s4_fast_${comm}_$ln"
    finite "s4_fast_${comm}_$ln" "$W/s4_fast_${comm}_$ln"
    if [ $RC != 0 ]; then said "s4_fast_${comm}_$ln"; fail "$name" "$(why $RC); see s4_fast_${comm}_$ln.out"; continue; fi
    if [ "$ln" = tp2 ]; then pass "$name" "ran, finite (its tolerance against one rank: dev/test/test_fast_tp.sh)"; continue; fi
    if [ "$ln" = expertstp2 ]; then pass "$name" "ran, finite (its tolerance against one rank: dev/test/test_fast_moe.sh)"; continue; fi
    ref=tp2 what="--tp 2"
    if [ -n "$mode" ]; then
      if ! grep -q "^cp accounting: $mode .*(equal)$" "$LOGS/s4_fast_${comm}_$ln.out"; then
        fail "$name" "the cp accounting line is missing or says MISMATCH; see s4_fast_${comm}_$ln.out"; continue
      fi
      if [ "${tp#*--pp}" = "$tp" ]; then
        pass "$name" "ran, finite, cp bytes = the formula (its tolerance against one rank: dev/test/test_fast_$([ "$flags" = "$tp" ] && echo cp || echo moe).sh)"
        continue
      fi
      ref=cp2cpmodea2a what="--cp 2 --cp-mode a2a"   # pipeline stages keep the bits of one stage
    fi
    bad=$(differ "s4_fast_${comm}_$ref" "s4_fast_${comm}_$ln")
    if [ -z "$bad" ]; then pass "$name" "main.log, final model, samples identical to fast $what"
    else fail "$name" "differ from fast $what: $bad"; fi
  done
}
if want 4; then
  stage "4. several ranks on $([ "$NGPU" -gt 1 ] && echo "$NGPU GPUs" || echo "one GPU")"
  if [ $HAVE_MPI = 0 ]; then
    na "4. several ranks (--comm mpi)" "not available on this machine: no Open MPI (mpirun/mpicc); not a failure, make test runs these layouts on the emulated GPU (test_cuda_emu.sh)"
  elif in_time "4. CPU reference on 1 rank (-d 512)" 20; then
    run s4_cpu $T4 $CPU_BIN "${S4[@]}" "${D1[@]}" -o "$W/s4_cpu"; keep s4_cpu "$W/s4_cpu"
    if [ $RC != 0 ]; then
      said s4_cpu; fail "4. CPU reference on 1 rank" "$(why $RC)"
    else
      layouts mpi
      fast_layouts mpi
      if [ "$NGPU" -gt 1 ]; then
        layouts nccl
        fast_layouts nccl
        # fast-mode data parallelism: tok/s on 1 GPU and on all, the same B per GPU
        name="4. fast DP scaling 1 -> $NGPU GPUs"
        if in_time "$name" 60; then
          run s4_dp1 $T5 $FAST_BIN "${BENCH[@]}" -b 8 -x $FAST_STEPS -i "$DTRAIN" -j "$DVAL"; r1=$RC
          finite s4_dp1 "$W/none"
          run s4_dpn $T5 dev/test/mpi.sh "$NGPU" $FAST_BIN --comm nccl "${BENCH[@]}" -b 8 -d $((8 * 1024 * NGPU)) -x $FAST_STEPS -i "$DTRAIN" -j "$DVAL"; rn=$RC
          finite s4_dpn "$W/none"
          t1=$(sed -n 's/^  average step .*, \([0-9.]*\) tok\/s.*/\1/p' "$LOGS/s4_dp1.out")
          tn=$(sed -n 's/^  average step .*, \([0-9.]*\) tok\/s.*/\1/p' "$LOGS/s4_dpn.out")
          if [ $r1 = 0 ] && [ $rn = 0 ] && [ -n "$t1" ] && [ -n "$tn" ]; then
            info "$name" "$t1 tok/s on 1, $tn on $NGPU: $(awk -v a="$t1" -v b="$tn" -v n="$NGPU" 'BEGIN {printf "%.2fx (ideal %dx)", b / a, n}')"
          else
            fail "$name" "runs: 1 GPU $(why $r1), $NGPU GPUs $(why $rn)"
          fi
        fi
      else
        info "4. --comm nccl, DP scaling" "one GPU here: NCCL needs a GPU per rank (2+ GPUs)"
      fi
    fi
  fi
  rm -rf "$W"/s4_*
  pack
fi

# ---- 5. benchmark ----------------------------------------------------------------------------------
# bench LABEL BIN STEPS NEED FLAGS...: the largest B of 32, 16, 8 that fits; sets BENCH_TOKS
BENCH_TOKS="" BENCH_MFU=""
bench() {
  local label=$1 bin=$2 steps=$3 need=$4 B log mem avg toks mfu peak mpid
  shift 4
  BENCH_TOKS="" BENCH_MFU=""
  for B in 32 16 8; do
    in_time "5. $label $BENCH_NAME" "$need" || return
    log="s5_${label// /_}_B$B"
    mpid=""
    if command -v nvidia-smi >/dev/null 2>&1; then
      nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$LOGS/$log.mem" 2>/dev/null &
      mpid=$!
    fi
    run "$log" $T5 $bin "${BENCH[@]}" -b $B -x "$steps" -i "$DTRAIN" -j "$DVAL" "$@"
    [ -n "$mpid" ] && { kill "$mpid" 2>/dev/null; wait "$mpid" 2>/dev/null; }
    finite "$log" "$W/none"
    if [ $RC = 0 ]; then
      avg=$(sed -n 's/^  average step \([0-9.]*\) ms.*/\1/p' "$LOGS/$log.out")
      toks=$(sed -n 's/^  average step .*, \([0-9.]*\) tok\/s.*/\1/p' "$LOGS/$log.out")
      mfu=$(sed -n 's/^  average step .* MFU \([0-9.]*\)%.*/\1/p' "$LOGS/$log.out")
      mem=$(sed -n 's/^| GPU memory *\([0-9.]*\) GiB allocated.*/\1 GiB allocated at startup/p' "$LOGS/$log.out")
      peak=$([ -s "$LOGS/$log.mem" ] && sort -n "$LOGS/$log.mem" | tail -1 | awk '{printf ", peak %.1f GiB in use (nvidia-smi)", $1 / 1024}')
      BENCH_TOKS=$toks BENCH_MFU=$mfu
      info "5. $label $BENCH_NAME" "B=$B: ${toks:-?} tok/s, MFU $([ -n "$mfu" ] && echo "$mfu%" || echo n/a), ${avg:-?} ms/step; GPU memory: ${mem:-n/a}${peak}"
      return
    fi
    if ! grep -q "out of GPU memory" "$LOGS/$log.out"; then
      said "$log"
      fail "5. $label $BENCH_NAME" "B=$B: $(why $RC), not for memory; see $log.out"
      return
    fi
    echo "    B=$B does not fit ($label)"
  done
  fail "5. $label $BENCH_NAME" "no B of 32, 16, 8 fits"
}
if want 5; then
  stage "5. benchmark: $BENCH_NAME"
  bench "fast cudnn" $FAST_BIN $FAST_STEPS 25 --attention cudnn; fast_cudnn=$BENCH_TOKS mfu_cudnn=$BENCH_MFU
  bench "fast flash" $FAST_BIN $FAST_STEPS 25 --attention flash; fast_flash=$BENCH_TOKS mfu_flash=$BENCH_MFU
  bench "deterministic" $GPU_BIN $DET_STEPS 40 --deterministic 1; det=$BENCH_TOKS
  best=$(printf '%s\n%s\n' "${mfu_cudnn:-}" "${mfu_flash:-}" | grep . | sort -g | tail -1)
  info "5. target: fast MFU >= 55%" "$([ -n "$best" ] && awk -v m="$best" 'BEGIN {printf "best %.1f%%: %s", m, (m >= 55) ? "met" : "not met"}' || echo "no MFU measured")"
  fast_best=$(printf '%s\n%s\n' "${fast_cudnn:-}" "${fast_flash:-}" | grep . | sort -g | tail -1)
  if [ -n "$fast_best" ] && [ -n "${det:-}" ]; then
    info "5. target: deterministic >= 1/3 of fast" "$(awk -v d="$det" -v f="$fast_best" 'BEGIN {printf "%.0f / %.0f tok/s = %.2f: %s", d, f, d / f, (d / f >= 1 / 3) ? "met" : "not met"}')"
  else
    info "5. target: deterministic >= 1/3 of fast" "not measured"
  fi
  pack
fi

# ---- 6. fast mode's MFU per layout (only when STAGES names it) --------------------------------------
if want 6; then
  stage "6. fast mode's MFU per layout (dev/bench/bench_fast_mfu.sh)"
  if in_time "6. MFU per layout" 120; then
    run s6_mfu "$(left)" env DATA="$DTRAIN" dev/bench/bench_fast_mfu.sh
    sed -n '/^== /p; /^layout /,$p' "$LOGS/s6_mfu.out" >"$OUT/mfu_table.txt"
    while IFS= read -r line; do info "6. MFU" "$line"; done < <(sed -n '/^layout /,/^FLOPs per token/p' "$LOGS/s6_mfu.out")
    [ $RC = 0 ] || fail "6. MFU per layout" "the benchmark $(why $RC); see s6_mfu.out"
  fi
  pack
fi

# ---- 3. the finite-values summary ---------------------------------------------------------------
if want 3; then
  if [ "$FINITE_VALUES" = 0 ]; then info "3. finite values" "no value to check ($FINITE_OUTPUTS GPU runs)"
  elif [ "$FINITE_FAILS" = 0 ]; then pass "3. finite values" "$FINITE_VALUES values (loss, lr, norm, ms, tok/s, MFU) in $FINITE_OUTPUTS GPU runs are numbers"
  else fail "3. finite values" "$FINITE_FAILS of $FINITE_OUTPUTS GPU runs printed or logged a non-number (rows above)"; fi
fi

finish
[ $((FAILED + SKIPPED)) = 0 ]
