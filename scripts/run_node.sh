#!/usr/bin/env bash
# N ranks on this machine with Open MPI: scripts/run_node.sh N [train_gpt2 arguments].
# The layout comes from the arguments: e.g. data parallel with ZeRO-2 (-z 2), --tp 2 --pp 2,
# or the 3D grid on 8 ranks (--tp 2 --pp 2 gives 2-way data parallelism). OpenMP threads are
# split evenly over the ranks. Defaults: the run of run_single.sh, with 4 microbatches per rank.
#   scripts/run_node.sh 4 -z 1
#   scripts/run_node.sh 8 --tp 2 --pp 2 -z 1 --schedule 1f1b
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: scripts/run_node.sh N [train_gpt2 arguments]}
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / N > 0 ? $(nproc) / N : 1 ))}
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
over=(); [ "$N" -gt "$(nproc)" ] && over=(--oversubscribe)
exec mpirun -np "$N" "${root[@]}" "${over[@]}" --bind-to none -x OMP_NUM_THREADS \
    ./train_gpt2 -e d4 -b 8 -t 64 -d $(( 8 * 64 * 4 * N )) -x 1000 -l 1e-3 -u 50 -q 0.1 -c 0.1 \
    -v 100 -m 20 -s 250 -g 64 -n 250 -o out/node "$@"
