#!/usr/bin/env bash
# FlexSP's per-sequence gradient exchange (llmc/flexsp.h): build/test_flexsp_exchange
# (dev/test/test_flexsp_exchange.c) on 1, 2 and 4 ranks, each rank's shard against the R1 tree
# over the step's sequences in index order. Exits non-zero if any run failed, naming it.
set -u
cd "$(dirname "$0")/../.."
bin=build/test_flexsp_exchange
if [ ! -x "$bin" ]; then echo "FAIL: $bin is not built (make $bin)"; exit 1; fi
fails=()
if ! command -v mpirun >/dev/null 2>&1; then
  if ! $bin; then fails+=("1 rank"); fi
else
  for np in 1 2 4; do
    if ! MPI_TIMEOUT=${MPI_TIMEOUT:-120} dev/test/mpi.sh $np $bin; then fails+=("$np ranks"); fi
  done
fi
if [ ${#fails[@]} -ne 0 ]; then echo "FAIL: test_flexsp_exchange on ${fails[*]}"; exit 1; fi
echo "OK: test_flexsp_exchange (1, 2, 4 ranks)"
