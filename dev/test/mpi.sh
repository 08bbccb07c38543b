#!/usr/bin/env bash
# Runs a command on N MPI ranks on this machine, the way every multi-rank test does:
#
#   dev/test/mpi.sh N CMD ARGS...
#
# under `timeout` (MPI_TIMEOUT seconds, default 300) so a hang fails instead of blocking CI, with
# the cores shared out among the ranks' OpenMP threads; exits with the command's status (124
# when it timed out).
#   --oversubscribe     more ranks than cores (this machine has 2)
#   --bind-to none      ranks float over the cores instead of each being pinned to one
#   --allow-run-as-root CI runs as root; mpirun refuses to otherwise
# The ranks are on one machine, so they talk through shared memory (the vader BTL). Its
# single-copy transfers (CMA: process_vm_readv) are refused in containers whose seccomp filter
# or Yama ptrace policy forbids them: Open MPI 4.1 then prints "Read -1, expected N, errno = 1"
# for every large message and retries another way. There we ask for copies through the shared
# segment from the start. OMPI_MCA_* settings already in the environment win.
set -u
if [ $# -lt 2 ]; then
  echo "usage: $0 N CMD [ARGS...]" >&2
  exit 2
fi
np=$1
shift
limit=${MPI_TIMEOUT:-300}

root_flag=()
if [ "$(id -u)" = 0 ]; then root_flag=(--allow-run-as-root); fi

ptrace_scope=$(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo 0)
seccomp=$(awk '/^Seccomp:/ {print $2}' /proc/self/status 2>/dev/null)
if [ "${ptrace_scope:-0}" -ge 2 ] || [ "${seccomp:-0}" = 2 ]; then
  export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
fi

# OpenMP threads: the cores shared out among the ranks (4 ranks of 2 threads each on 2 cores run
# 10-40x slower than 4 ranks of 1), unless the caller chose
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc 2>/dev/null || echo 1)
  per=$(( cores / np ))
  export OMP_NUM_THREADS=$(( per > 0 ? per : 1 ))
fi

# -k: if mpirun ignores the TERM, kill it 10 s later (timeout then exits 137, which is also
# what mpirun returns for a rank killed by SIGKILL: the clock tells the two apart)
SECONDS=0
timeout -k 10 "$limit" mpirun -np "$np" --oversubscribe --bind-to none ${root_flag[@]+"${root_flag[@]}"} "$@"
rc=$?
if [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ $SECONDS -ge "$limit" ]; }; then
  echo "mpi.sh: timed out after ${limit}s: mpirun -np $np $*" >&2
  exit 124
fi
exit $rc
