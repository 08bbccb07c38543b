#!/usr/bin/env bash
# The README's pipeline pictures: trains a GPT-2 of depth 8 (C=128, a 512-token vocabulary, so
# the layers, not the LM head, dominate) on 4 pipeline ranks with 8 microbatches per step under
# each schedule, and draws each schedule with dev/tools/pp_schedule from the costs that run
# measured (the mean forward, backward and weight-half time per microbatch and chunk of each
# stage, which the trainer prints at the end). The timelines are simulated from those costs,
# so they mean something even on a machine with fewer cores than ranks, where the measured idle
# time does not. Writes docs/pipeline_<schedule>.svg and prints a table of bubble fractions.
#   usage: dev/tools/pipeline_pictures.sh [SCHEDULE...]   (default: all of them; after make
#          train_gpt2 dev/tools/pp_schedule build/testdata)
set -eu
cd "$(dirname "$0")/../.."
W=$(mktemp -d /tmp/llmc_pp_pictures.XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir -p docs
build/testdata tokens "$W/train.bin" 200000 512 1
printf "| schedule | bubble, simulated from measured costs | bubble model (F = I = W) | peak activations per stage |\n|---|---|---|---|\n"
for schedule in ${*:-1f1b interleaved zb1 zbv dualpipev}; do
  OMP_NUM_THREADS=1 dev/test/mpi.sh 4 ./train_gpt2 -e d8c128h4v512t64 -i "$W/train.bin" -b 4 -t 64 -d 2048 -x 5 \
    -v 0 -s 0 --pp 4 --schedule "$schedule" >"$W/$schedule.out" 2>&1 || { tail -5 "$W/$schedule.out"; exit 1; }
  draw=$(grep -A1 "^draw this run's pipeline schedule" "$W/$schedule.out" | tail -1 | sed "s|--svg pipeline.svg|--svg docs/pipeline_$schedule.svg|")
  $draw >"$W/$schedule.draw"
  simulated=$(sed -n 's/^bubble fraction, simulated[^:]*: \([0-9.]*\).*/\1/p' "$W/$schedule.draw")
  model=$(sed -n 's/.*bubble model \([0-9.]*\)$/\1/p' "$W/$schedule.out")
  peaks=$(sed -n 's/^pipeline activations held per stage (peak, .*): //p' "$W/$schedule.out")
  echo "| $schedule | $simulated | $model | $peaks |"
  echo "  $draw" >&2
done
