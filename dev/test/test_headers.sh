#!/usr/bin/env bash
# The structure the code promises a reader (docs/ARCHITECTURE.md), checked:
#  1. every header in llmc/ compiles on its own: it includes what it uses, and calls no function
#     (a kernel above all) that it neither declares nor includes (C headers with gcc, with
#     implicit declarations an error; .cuh files with g++ on the emulated GPU's headers);
#  2. the include graph of llmc/ has no cycle (no two files include each other, directly or
#     through others);
#  3. the model in train_gpt2.c calls named operators of the technique headers, never the
#     communicator itself (no comm_ call after its kernels).
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

CC=${CC:-gcc}
CXX=${CXX:-g++}
MPI_FLAGS=""
if command -v mpicc >/dev/null 2>&1; then CC="mpicc"; MPI_FLAGS="-DUSE_MPI"; fi
CFLAGS="-std=c11 -D_GNU_SOURCE -I. -fsyntax-only -Wall -Werror=implicit-function-declaration -Wno-unused-function"
# the emulated GPU's headers stand in for CUDA's (no nvcc needed; cuBLASLt's too, and the PTX
# of the flash kernels); NCCL and cuDNN exist only in the real CUDA build, whose compile (make
# train_gpt2cu) checks those headers
CXXFLAGS="-std=c++17 -D_GNU_SOURCE -DLLMC_CUDA_EMU -I. -Idev/gpu/emu -fsyntax-only -Wall -Wno-unused-function"
real_cuda_only="comm_nccl.h attention_cudnn.cuh"

checked=0
for h in llmc/*.h llmc/*.cuh; do
  base=$(basename "$h")
  case " $real_cuda_only " in *" $base "*) continue ;; esac
  case "$h" in
    *.h) printf '#include "%s"\n' "$h" > "$W/one.c"
         out=$($CC $CFLAGS $MPI_FLAGS "$W/one.c" 2>&1) || fail "$h does not compile on its own: $(grep -m1 -E 'error' <<<"$out")" ;;
    *.cuh) printf '#include "%s"\n' "$h" > "$W/one.cpp"
         out=$($CXX $CXXFLAGS -x c++ "$W/one.cpp" 2>&1) || fail "$h does not compile on its own: $(grep -m1 -E 'error' <<<"$out")" ;;
  esac
  checked=$((checked + 1))
done
echo "ok   $checked headers of llmc/ compile on their own"

# 2. cycles: a depth-first walk of "llmc/a includes llmc/b" edges
edges="$W/edges"
for h in llmc/*.h llmc/*.cuh; do
  grep -oE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"llmc/[^"]+"' "$h" | sed -E 's/.*"(llmc\/[^"]+)"/\1/' |
    while read -r to; do echo "$h $to"; done
done > "$edges"
cycle=$(awk '
  { adj[$1] = adj[$1] " " $2; nodes[$1] = 1; nodes[$2] = 1 }
  function visit(n,   i, k, parts) {
    if (state[n] == 1) { found = found " " n; return 1 }
    if (state[n] == 2) { return 0 }
    state[n] = 1
    k = split(adj[n], parts, " ")
    for (i = 1; i <= k; i++) { if (visit(parts[i])) { found = found " <- " n; return 1 } }
    state[n] = 2
    return 0
  }
  END { for (n in nodes) { if (visit(n)) { print found; exit } } }' "$edges")
if [ -n "$cycle" ]; then fail "the include graph of llmc/ has a cycle:$cycle"; else echo "ok   the include graph of llmc/ ($(wc -l < "$edges") edges) has no cycle"; fi

# 3. the model's collectives are named operators
model_start=$(grep -n '^// The model' train_gpt2.c | head -1 | cut -d: -f1)
if [ -z "$model_start" ]; then
  fail "train_gpt2.c has no '// The model' section heading to check from"
else
  raw=$(tail -n +"$model_start" train_gpt2.c | grep -nE '\bcomm_[a-z_]+\(' | head -3)
  if [ -n "$raw" ]; then fail "train_gpt2.c's model calls the communicator directly (use a named operator): $raw"
  else echo "ok   train_gpt2.c's model (from line $model_start) calls no comm_ function"; fi
fi

# 4. no CUDA source is compiled only for some architectures: CI compiles the CUDA build for
# sm_80 alone (.ci/run), which then compiles every line the GPU build runs
guarded=$(grep -lE '__CUDA_ARCH__' llmc/*.cuh llmc/*.h ./*.cu dev/gpu/*.cu 2>/dev/null | head -3)
if [ -n "$guarded" ]; then fail "code under __CUDA_ARCH__ in $guarded: CI's one-architecture build (.ci/run CUDA_ARCHS) would not compile all of it"
else echo "ok   no CUDA source depends on __CUDA_ARCH__ (CI builds sm_80 only)"; fi

[ $fails -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
echo "all header checks passed"
