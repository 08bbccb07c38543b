#!/usr/bin/env bash
# Fast mode's (bf16) MFU per layout (a table, not a test; make bench-fast-mfu): train_gpt2cu
# --deterministic 0 for GPT-2 124M (d12) and 350M (d24) at T=1024 under
#   DP      every GPU found, one rank each (one GPU: one rank)
#   TP 2    --tp 2
#   PP 2    --pp 2 --schedule 1f1b, 8 microbatches a step
#   CP 2    --cp 2 at T=8192 (the model's maxT raised to 8192)
#   EP 2    the experts model d12e8k2 (8 experts top 2 in every layer), 2 data ranks --ep 2
# and prints per run: layout, model, T, ranks, tok/s (the run summary's, steps after the first)
# and MFU. A layout fast mode refuses gets its row with the refusal's line.
#   FLOPs per token F = 6 N + 6 L C T: N the parameters a token meets (the model's P; with
#     experts the dense part and k of the E experts, the startup table's "active parameters"),
#     6 N their matmuls forward and backward; 6 L C T attention's QK^T and AV (12 L C T,
#     halved by the causal mask). The same formula as the trainer's own MFU (engine.h).
#   MFU = tok/s x F / (G x peak): G the GPUs the ranks run on (two ranks on a one-GPU machine
#     share it: G = 1, said in the row); the GPU's dense bf16 peak by nvidia-smi's name:
#     H100 and H200 989 TFLOP/s (SXM), A100 312; another GPU: "?".
# Targets (issue 23), on H100/H200: DP >= 55 %, TP 2 and PP 2 (1f1b) >= 45 %.
# Without a GPU (no nvidia-smi GPU or no ./train_gpt2cu) the same layouts run on
# ./train_gpt2cu_emu with a tiny model (C=32, V=512, T=32; CP at T=64) on synthetic tokens,
# only to prove the script runs: its tok/s say nothing about a GPU and its MFU is "?".
# Knobs: STEPS (GPU 10, emulated 2), B (GPU 16 for d12, 8 for d24 and the experts, 2 at
# T=8192; emulated 1), DATA (GPU: tiny Shakespeare tokens), MPI_TIMEOUT (each run's limit).
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d "${TMPDIR:-/tmp}/llmc_bench_mfu.XXXXXX")
trap 'rm -rf "$W"' EXIT

NGPU=0
GPU_NAME=""
if command -v nvidia-smi >/dev/null 2>&1; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
fi
if [ "$NGPU" -gt 0 ] && [ -x ./train_gpt2cu ]; then
  EMULATED=0 BIN=./train_gpt2cu STEPS=${STEPS:-10}
  case "$GPU_NAME" in
    *H100*|*H200*) PEAK=989 ;;
    *A100*) PEAK=312 ;;
    *) PEAK="?" ;;
  esac
  DATA=${DATA:-dev/data/tinyshakespeare/tiny_shakespeare_train.bin}
  [ -f "$DATA" ] || DATA=../shared/data/gpt2/tiny_shakespeare_train.bin
  [ -f "$DATA" ] || { echo "error: no tiny Shakespeare tokens (make data, or DATA=file)" >&2; exit 1; }
  T=1024 TCP=8192
  D12=d12 D24=d24 D12CP=d12t8192 D24CP=d24t8192 EXPERTS=d12e8k2
  B12=${B:-16} B24=${B:-8} BCP=${B:-2} BEXP=${B:-8}
  echo "== fast mode (bf16) on $NGPU x $GPU_NAME (dense bf16 peak $PEAK TFLOP/s), $STEPS steps a run =="
else
  EMULATED=1 BIN=./train_gpt2cu_emu STEPS=${STEPS:-2} PEAK="?"
  make -s train_gpt2cu_emu build/testdata >/dev/null || exit 1
  export OMP_NUM_THREADS=1
  DATA=$W/train.bin
  build/testdata tokens "$DATA" 20000 512 1 || exit 1
  T=32 TCP=64
  D12=d2c32h2v512t32 D24=d4c32h2v512t32 D12CP=d2c32h2v512t64 D24CP=d4c32h2v512t64 EXPERTS=d2c32h2v512t32e8k2
  B12=${B:-1} B24=${B:-1} BCP=${B:-1} BEXP=${B:-1}
  NGPU=1
  echo "== EMULATED GPU (dev/gpu/emu, no GPU here): tiny models stand in for d12/d24, $STEPS steps a run; this only"
  echo "   proves the script runs: the tok/s say nothing about a GPU, MFU is ? =="
fi

# mfu TOKS N L C T G: tok/s x F / (G x peak), F = 6N + 6LCT
mfu() {
  [ "$PEAK" = "?" ] && { echo "?"; return; }
  awk -v s="$1" -v n="$2" -v l="$3" -v c="$4" -v t="$5" -v g="$6" -v p="$PEAK" \
    'BEGIN { printf "%.1f %%", 100 * s * (6 * n + 6 * l * c * t) / (g * p * 1e12) }'
}
printf "%-14s %-18s %6s %6s %12s %8s  %s\n" "layout" "model" "T" "ranks" "tok/s" "MFU" "note"
# bench LAYOUT MODEL LABEL T B RANKS FLAGS...: one run, one row
bench() {
  local layout=$1 model=$2 label=$3 t=$4 b=$5 np=$6 out toks n l c g note
  shift 6
  out=$W/run.out
  local cmd=($BIN --deterministic 0 -e "$model" -i "$DATA" -j "$DATA" -b "$b" -t "$t" -x "$STEPS" -v 0 -s 0 "$@")
  if [ "$np" = 1 ]; then "${cmd[@]}" >"$out" 2>&1; else dev/test/mpi.sh "$np" "${cmd[@]}" >"$out" 2>&1; fi
  toks=$(sed -n 's/^  average step .*, \([0-9.]*\) tok\/s.*/\1/p' "$out")
  if [ -z "$toks" ]; then
    note=$(grep -m1 -i "error" "$out" | cut -c1-150)
    printf "%-14s %-18s %6s %6s %12s %8s  %s\n" "$layout" "$label" "$t" "$np" "-" "-" "did not run: ${note:-see the log}"
    return
  fi
  n=$(sed -n 's/.* \([0-9]*\) active parameters per token.*/\1/p' "$out")
  [ -n "$n" ] || n=$(sed -n 's/^| parameters *P = \([0-9]*\).*/\1/p' "$out")
  l=$(sed -n 's/^| model *L=\([0-9]*\) C=.*/\1/p' "$out")
  c=$(sed -n 's/^| model *L=[0-9]* C=\([0-9]*\) .*/\1/p' "$out")
  g=$(( np < NGPU ? np : NGPU ))
  note=""
  [ "$EMULATED" = 0 ] && [ "$np" -gt "$NGPU" ] && note="$np ranks share $NGPU GPU(s)"
  printf "%-14s %-18s %6s %6s %12s %8s  %s\n" "$layout" "$label" "$t" "$np" "$toks" "$(mfu "$toks" "$n" "$l" "$c" "$t" "$g")" "$note"
}
DP=$NGPU
for size in 12 24; do
  if [ $size = 12 ]; then m=$D12 mcp=$D12CP b=$B12 label="124M (d12)"; else m=$D24 mcp=$D24CP b=$B24 label="350M (d24)"; fi
  [ "$EMULATED" = 1 ] && label="$m"
  bench "DP $DP" "$m" "$label" $T "$b" "$DP"
  bench "TP 2" "$m" "$label" $T "$b" 2 --tp 2
  bench "PP 2 1f1b" "$m" "$label" $T "$b" 2 --pp 2 --schedule 1f1b -d $((8 * b * T))
  bench "CP 2" "$mcp" "$label" $TCP "$BCP" 2 --cp 2
done
bench "EP 2" "$EXPERTS" "$([ "$EMULATED" = 1 ] && echo "$EXPERTS" || echo "d12e8k2")" $T "$BEXP" 2 --ep 2
echo "FLOPs per token F = 6N + 6LCT (N: the parameters a token meets, the experts' active ones); MFU = tok/s x F / (GPUs x peak)"
