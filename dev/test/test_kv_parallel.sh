#!/usr/bin/env bash
# KV parallelism (llmc/kv_parallel.h): build/test_kv_parallel under the real mpirun on 1, 2, 4
# and 8 ranks (KVP 1, 2, 4, 8) and on 4 and 8 ranks as KVP 2 and 4 x TP 2, each comparing decode
# attention bit for bit with the one-rank paged attention the server runs, and the bytes of each
# collective with their formulas; then the layouts kvp_problem must refuse, in one line each.
# Exits non-zero if anything failed, naming it.
set -u
cd "$(dirname "$0")/../.."
fails=()
fail() { echo "FAIL: $*"; fails+=("$1"); }
bin=build/test_kv_parallel
if [ ! -x "$bin" ]; then echo "FAIL: $bin is not built (make $bin)"; exit 1; fi

if command -v mpirun >/dev/null 2>&1; then
  for layout in "1" "2" "4" "8" "4 --tp 2" "8 --tp 2"; do
    set -- $layout
    np=$1; shift
    if ! MPI_TIMEOUT=${MPI_TIMEOUT:-120} dev/test/mpi.sh "$np" "$bin" "$@"; then
      fail "kvp on $np ranks $*"
    fi
  done
else
  echo "SKIP: no mpirun (multi-rank tests)"
fi

# Refused layouts: exit 1 with exactly one line, which names the flag and what it expects.
refuse() {
  local expect=$1; shift
  out=$("$bin" --check "$@" 2>&1)
  rc=$?
  lines=$(printf '%s\n' "$out" | wc -l)
  if [ $rc -eq 0 ] || [ "$lines" -ne 1 ] || ! grep -q -- "$expect" <<<"$out"; then
    fail "refuse $*" "(rc $rc, $lines lines): expected one line with '$expect'; got: $out"
  else
    echo "refused $*: $out"
  fi
}
refuse "error: --kvp 8 with --block-size 128: expected 2 x kvp x block size (2048) to divide the context length 1024" \
  --kvp 8 --block-size 128 --context 1024
refuse "error: --kvp 3: expected 1, 2, 4 or 8" --kvp 3
refuse "error: --kvp 16: expected 1, 2, 4 or 8" --kvp 16
refuse "error: --tp 5: expected a divisor of the model's 12 heads" --kvp 2 --tp 5 --heads 12
if ! "$bin" --check --kvp 8 --block-size 64 --context 1024; then fail "accept kvp 8 block 64 context 1024"; fi

if [ ${#fails[@]} -ne 0 ]; then
  echo "test_kv_parallel.sh: ${#fails[@]} failed: ${fails[*]}"
  exit 1
fi
echo "test_kv_parallel.sh: all passed"
