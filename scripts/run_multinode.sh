#!/usr/bin/env bash
# Several machines with Open MPI and a hostfile (one line per machine: "hostname slots=R"):
#   scripts/run_multinode.sh HOSTFILE N [train_gpt2 arguments]
# Every machine needs the same build of train_gpt2 and the data at the same path (a shared
# filesystem, or copies), and password-less ssh from this one. Megatron's rank order puts a
# tensor-parallel group on consecutive ranks: keep --tp within one machine.
#   scripts/run_multinode.sh hosts.txt 16 --tp 2 --pp 2 -z 1 -e d12 -t 1024
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${1:?usage: scripts/run_multinode.sh HOSTFILE N [train_gpt2 arguments]}
N=${2:?usage: scripts/run_multinode.sh HOSTFILE N [train_gpt2 arguments]}
shift 2
[ -r "$HOSTFILE" ] || { echo "error: cannot read hostfile '$HOSTFILE'" >&2; exit 1; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec mpirun -np "$N" --hostfile "$HOSTFILE" --map-by slot --bind-to none -x OMP_NUM_THREADS \
    "$PWD/train_gpt2" -o "$PWD/out/multinode" "$@"
