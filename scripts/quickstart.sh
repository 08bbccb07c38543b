#!/usr/bin/env bash
# The quick start (make train, make train_gpu): llm.c's, where it can be.
#
#   scripts/quickstart.sh [cpu|gpu]     (default cpu; after `make train_gpt2 data`)
#
# Online: OpenAI's GPT-2 124M (scripts/download_gpt2_weights.sh: Hugging Face's
# model.safetensors, its sha256 checked, imported to gpt2_124M.bin) fine-tuned on tiny
# Shakespeare with llm.c's CPU recipe: B=4, T=64, 40 steps of AdamW at lr 1e-4 (beta2 0.999, no
# weight decay, no clipping), llm.c's unshuffled data order, the validation loss (5 batches) at
# step 0, every 10 steps and at the end, a 64-token sample at steps 20 and 40.
# Offline (the weights cannot be downloaded): one line saying what failed and how to get the
# weights by hand, then a fresh GPT-2 of depth 4 (L=4, C=256, 16M parameters) trained from
# scratch for 200 steps instead. gpt2_124M.bin already in place is used without the network.
# Either way the end prints the validation loss before and after, the time, main.log's path and
# an SVG of the loss curves (dev/tools/plot_log). A rerun starts over (the run's earlier main.log
# and checkpoints are removed first).
#
# gpu: the same on one GPU with ./train_gpt2cu (built by `make train_gpt2cu`), fast (bf16)
# mode; QUICKSTART_ARGS="--deterministic 1" for the bit-exact fp32 mode.
#
# Environment:
#   QUICKSTART_OUT     output directory (default out/quickstart): the run in gpt2_124M/ or d4/
#   QUICKSTART_STEPS   training steps (default 40 for GPT-2 124M, 200 for the fresh model)
#   QUICKSTART_ARGS    more trainer flags, appended (they win)
#   QUICKSTART_FALLBACK_MODEL  the fresh model of the offline path (default d4)
#   GPT2_HF_BASE, GPT2_HF_DIR, GPT2_OUT_DIR, GPT2_HF_API_JSON: as scripts/download_gpt2_weights.sh
#   (GPT2_OUT_DIR is where gpt2_124M.bin is looked for and written); GPT2_CONNECT_TIMEOUT and
#   GPT2_RETRIES default to 5 s and 1 here, so that offline fails within seconds
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "quickstart: $*"; }
die() { echo "error: quickstart: $*" >&2; exit 1; }

mode=${1:-cpu}
case "$mode" in
  cpu) trainer=./train_gpt2 ;;
  gpu) trainer=./train_gpt2cu ;;
  -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
  *) die "unknown mode '$mode': expected cpu (make train) or gpu (make train_gpu)" ;;
esac
out=${QUICKSTART_OUT:-out/quickstart}
steps=${QUICKSTART_STEPS:-}
if [ -n "$steps" ] && ! [[ "$steps" =~ ^[1-9][0-9]{0,7}$ ]]; then
  die "QUICKSTART_STEPS=$steps is not a number of steps in [1, 99999999]"
fi
read -r -a extra <<<"${QUICKSTART_ARGS:-}"
weights=${GPT2_OUT_DIR:-.}/gpt2_124M.bin

for f in dev/data/tinyshakespeare/tiny_shakespeare_train.bin \
         dev/data/tinyshakespeare/tiny_shakespeare_val.bin gpt2_tokenizer.bin; do
  [ -s "$f" ] || die "$f is missing: run make data (make train and make train_gpu do)"
done

# --- the GPU path needs a GPU and ./train_gpt2cu; both are checked before any download
if [ "$mode" = gpu ]; then
  if ! { nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } &&
     ! ls /proc/driver/nvidia/gpus/* >/dev/null 2>&1; then
    die "no NVIDIA GPU found (nvidia-smi lists none, no /proc/driver/nvidia/gpus): make train_gpu needs one; make train is the CPU quick start"
  fi
  mkdir -p build
  if ! make -s train_gpt2cu >build/quickstart_make.log 2>&1; then
    why=$(grep -m1 -i 'error' build/quickstart_make.log || true)
    die "cannot build ./train_gpt2cu (${why:-see build/quickstart_make.log}); it needs CUDA (nvcc and cuBLASLt under CUDA_HOME, see the README's CUDA build); make train is the CPU quick start"
  fi
else
  [ -x "$trainer" ] || die "$trainer is not built: run make train_gpt2 (make train does)"
fi

# --- GPT-2 124M, or the reason it cannot be had
mkdir -p "$out"
online=1
if [ -s "$weights" ]; then
  say "using $weights (OpenAI's GPT-2 124M)"
else
  err=$out/download_error.txt
  rm -f "$err"
  rc=0
  GPT2_ERROR_FILE=$err GPT2_CONNECT_TIMEOUT=${GPT2_CONNECT_TIMEOUT:-5} GPT2_RETRIES=${GPT2_RETRIES:-1} \
    scripts/download_gpt2_weights.sh gpt2 || rc=$?
  why=$(cat "$err" 2>/dev/null || true)
  rm -f "$err"
  case $rc in
    0) ;;
    2) online=0
       say "no GPT-2 124M: $why; training a fresh ${QUICKSTART_FALLBACK_MODEL:-d4} GPT-2 from scratch instead" ;;
    *) die "${why:-scripts/download_gpt2_weights.sh failed (exit status $rc)}" ;;
  esac
fi

# --- the run
if [ $online = 1 ]; then
  title="GPT-2 124M fine-tuned on tiny Shakespeare"
  run=$out/gpt2_124M
  args=(-e "$weights" -b 4 -t 64 -x "${steps:-40}" -l 1e-4 -k constant --beta2 0.999 --grad-clip 0 -c 0
        --shuffle 0 -v 10 -m 5 -s 20 -g 64)
else
  title="a fresh GPT-2 (${QUICKSTART_FALLBACK_MODEL:-d4}) trained on tiny Shakespeare"
  run=$out/${QUICKSTART_FALLBACK_MODEL:-d4}
  args=(-e "${QUICKSTART_FALLBACK_MODEL:-d4}" -b 8 -t 64 -x "${steps:-200}" -l 2e-3 -u 20 -q 0.1 -c 0.1
        -v 50 -m 10 -s 200 -g 96 -n 200)
fi
cmd=("$trainer" "${args[@]}" -o "$run" ${extra[@]+"${extra[@]}"})
# a rerun starts over: an earlier run's checkpoints there would be taken for this run's by -y 1
rm -f "$run"/main.log "$run"/loss.svg "$run"/model_*.bin "$run"/state_*.bin "$run"/DONE_*
say "${cmd[*]}"
SECONDS=0
"${cmd[@]}"
secs=$SECONDS

# --- what it did: the first and the last validation loss of main.log, and the curves
log=$run/main.log
first=$(sed -n 's/^s:\([0-9]*\) tel:\([^ ]*\).*/\1 \2/p' "$log" | head -1)
last=$(sed -n 's/^s:\([0-9]*\) tel:\([^ ]*\).*/\1 \2/p' "$log" | tail -1)
if [ -n "$first" ]; then
  summary="val loss ${first#* } at step ${first%% *} -> ${last#* } at step ${last%% *}"
else
  summary="no validation loss in $log"
fi
svg=$run/loss.svg
if [ -x dev/tools/plot_log ] &&
   dev/tools/plot_log -o "$svg" --title "quick start ($mode): $title" "$log" >/dev/null 2>&1; then
  pic=", loss curves $svg"
else
  pic=""
fi
say "$summary, ${secs} s; log $log$pic"
