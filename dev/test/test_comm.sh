#!/usr/bin/env bash
# Tests of the communicator (llmc/comm.h): build/test_comm (dev/test/test_comm.c) on 1, 2, 3,
# 4 and 8 ranks, the same test built without MPI, a grid that does not divide the world, and
# the two faults that must end a job instead of hanging it: a rank calling fatal() and a rank
# killed by a signal. Exits non-zero if anything failed, naming it.
set -u
cd "$(dirname "$0")/../.."
fails=()
fail() { echo "FAIL: $*"; fails+=("$1"); }

for bin in build/test_comm build/test_comm_nompi; do
  if [ ! -x "$bin" ]; then echo "FAIL: $bin is not built (make $bin)"; exit 1; fi
done

# without MPI: one genuine rank
if ! build/test_comm_nompi; then fail "test_comm_nompi"; fi

if ! command -v mpirun >/dev/null 2>&1; then
  echo "SKIP: no mpirun (multi-rank tests)"
  [ ${#fails[@]} -eq 0 ]
  exit
fi

for np in 1 2 3 4 8; do
  if ! MPI_TIMEOUT=${MPI_TIMEOUT:-120} dev/test/mpi.sh $np build/test_comm; then
    fail "test_comm on $np ranks"
  fi
done

# Runs a case that must fail: sets rc, secs and out (stdout and stderr together).
run_failing() {
  local start=$SECONDS
  out=$(MPI_TIMEOUT=30 dev/test/mpi.sh "$@" 2>&1)
  rc=$?
  secs=$((SECONDS - start))
}

# a grid that does not divide the world: one clear error, non-zero exit
run_failing 4 build/test_comm --grid 3 1
if [ $rc -eq 0 ] || ! grep -q "error: \[rank [0-9]*\] world size 4 is not divisible by tp=3" <<<"$out"; then
  fail "bad grid" "(rc $rc): expected 'world size 4 is not divisible' error; output:"; echo "$out"
fi

# rank 1 calls fatal() while ranks 0 and 2 wait in a barrier: all must end, promptly, with
# rank 1's message
run_failing 3 build/test_comm --fault fatal
if [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ $secs -gt 10 ] ||
   ! grep -q "error: \[rank 1\] deliberate test failure on rank 1" <<<"$out"; then
  fail "fault fatal" "(rc $rc after ${secs}s): expected a prompt non-zero exit with rank 1's message; output:"
  echo "$out"
else
  echo "fault fatal: job ended with status $rc after ${secs}s, rank 1's message shown"
fi

# rank 2 is killed by SIGKILL while ranks 0 and 1 wait in an all-reduce: the job must end
run_failing 3 build/test_comm --fault kill
if [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ $secs -gt 10 ] || grep -q "collective returned" <<<"$out"; then
  fail "fault kill" "(rc $rc after ${secs}s): expected a prompt non-zero exit; output:"
  echo "$out"
else
  echo "fault kill: job ended with status $rc after ${secs}s"
fi

if [ ${#fails[@]} -ne 0 ]; then
  echo "test_comm.sh: ${#fails[@]} failed: ${fails[*]}"
  exit 1
fi
echo "test_comm.sh: all passed"
