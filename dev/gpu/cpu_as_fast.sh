#!/usr/bin/env bash
# dev/gpu/cpu_as_fast.sh: the stand-in for train_gpt2cu's fast mode in dev/gpu/check.sh's dry
# run (DRY_RUN=1: no GPU, the default FAST_BIN there). Runs ./train_gpt2 with the same flags
# minus the CUDA-only ones (--attention, --deterministic, --comm), after the banner line fast
# mode prints about its attention, so every comparison, the banner test and the table run
# as on a GPU. Its numbers are the CPU's: the drift against the CPU is 0, and it has no MFU.
root=$(cd "$(dirname "$0")/../.." && pwd)
args=()
attention=auto
while [ $# -gt 0 ]; do
  case $1 in
    --attention) attention=${2:-}; shift 2 ;;
    --deterministic|--comm) shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
case $attention in
  flash) echo "| attention     flash attention (dry-run stand-in: train_gpt2 on the CPU)" ;;
  *) echo "| attention     cuDNN fused attention (dry-run stand-in: train_gpt2 on the CPU)" ;;
esac
exec "$root/train_gpt2" ${args[@]+"${args[@]}"}
