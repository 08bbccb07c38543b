#!/usr/bin/env bash
# The README's loss-curve pictures, drawn with dev/tools/plot_log:
#   docs/quickstart_offline.svg   the offline quick start (make train without the network: a
#                                 fresh d4 GPT-2, 200 steps on tiny Shakespeare), train and val
#                                 loss and the learning rate
#   docs/layouts_identical.svg    the same recipe (fewer steps, B=4, 512 tokens per step) on one
#                                 rank (2 microbatches accumulated) and on 2 data-parallel ranks
#                                 with ZeRO-1 (one microbatch each): the two curves lie exactly on
#                                 top of each other, because the two main.log files are
#                                 byte-identical (checked here with cmp; no picture otherwise)
# The quick start is forced offline (GPT2_HF_BASE at a closed port), so the picture is the same
# with or without the network; QUICKSTART_LOG=out/quickstart/d4/main.log draws an offline
# `make train` already run instead of running it again. The runs go to out/pictures/.
#   usage: dev/tools/quickstart_pictures.sh [STEPS_OF_THE_LAYOUT_RUNS]   (default 100; after
#          make train_gpt2 dev/tools/plot_log data; needs Open MPI's mpirun)
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-100}
die() { echo "error: quickstart_pictures.sh: $*" >&2; exit 1; }
for t in ./train_gpt2 dev/tools/plot_log; do [ -x $t ] || die "$t is not built: make ${t#./}"; done
command -v mpirun >/dev/null || die "mpirun not found: apt-get install openmpi-bin libopenmpi-dev"
out=out/pictures
mkdir -p docs "$out"

# 1. the offline quick start, as make train runs it
log=${QUICKSTART_LOG:-}
if [ -z "$log" ]; then
  GPT2_HF_BASE=http://127.0.0.1:9 GPT2_OUT_DIR="$out/no_weights" GPT2_HF_DIR="$out/no_weights/hf" \
    QUICKSTART_OUT="$out/quickstart" scripts/quickstart.sh cpu | grep -a '^quickstart: '
  log=$out/quickstart/d4/main.log
fi
[ -s "$log" ] || die "QUICKSTART_LOG=$log: no such main.log"
dev/tools/plot_log -o docs/quickstart_offline.svg --lr --labels "d4 (16M)" \
  --title "make train, offline: a fresh d4 GPT-2 on tiny Shakespeare" \
  "$log"

# 2. one rank and two data-parallel ranks, the same global batch of 512 tokens (one rank
# accumulates the 2 microbatches the two ranks run at once)
recipe=(-e d4 -b 4 -t 64 -d 512 -x "$steps" -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 25 -m 10 -s 0)
rm -rf "$out/rank1" "$out/dp2"
./train_gpt2 "${recipe[@]}" -o "$out/rank1" >"$out/rank1.out" 2>&1 || { tail -3 "$out/rank1.out"; die "the one-rank run failed"; }
dev/test/mpi.sh 2 ./train_gpt2 "${recipe[@]}" -z 1 -o "$out/dp2" >"$out/dp2.out" 2>&1 ||
  { tail -3 "$out/dp2.out"; die "the two-rank run failed"; }
cmp "$out/rank1/main.log" "$out/dp2/main.log" ||
  die "$out/rank1/main.log and $out/dp2/main.log differ: the layouts did not train the same bits"
echo "cmp: $out/rank1/main.log and $out/dp2/main.log are byte-identical ($(wc -l <"$out/rank1/main.log") lines)"
dev/tools/plot_log -o docs/layouts_identical.svg --norm \
  --labels "1 rank,2 ranks (DP)" \
  --title "d4: 1 rank and 2 data-parallel ranks (ZeRO-1), identical logs" \
  "$out/rank1/main.log" "$out/dp2/main.log"
