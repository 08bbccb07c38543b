#!/usr/bin/env bash
# The checks of the CUDA build can fail: copies of the tree with one deliberate defect in the
# deterministic kernels, each of which the emulated tests must report.
#   1. det_gemm_kernel without the barrier between its shared-memory tiles: the race check
#      (build/test_cuda_kernels_emu_race) must stop with a data race in that kernel, and the
#      shuffled emulator alone (build/test_cuda_kernels_emu) must get wrong bits.
#   2. the streaming tree over the 8 chunk partials (gpu_plan.h det_tree8_push) summing them
#      left to right instead of by the R1 tree: the kernels' bits must differ from train_gpt2.c.
# A mutation that does not apply (the source changed) fails the test instead of passing it.
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d /tmp/llmc_emu_mutants.XXXXXX)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }

# a copy of what the emulated kernel tests are built from
copy_tree() {
  mkdir -p "$1/dev/test" "$1/dev/gpu"
  cp -r Makefile mk llmc train_gpt2.c train_gpt2.cu "$1/"
  cp dev/test/test_cuda_host.c "$1/dev/test/"
  cp -r dev/gpu/emu "$1/dev/gpu/"
}

# 1. the barrier
M1="$W/no_barrier"
copy_tree "$M1"
sed -i '/if (have) { store_tile(buf ^ 1); }/{n;/__syncthreads();/d}' "$M1/llmc/kernels_det.cuh"
cmp -s llmc/kernels_det.cuh "$M1/llmc/kernels_det.cuh" && fail "mutation 1 did not apply: det_gemm_kernel's barrier not found"
make -s -C "$M1" build/test_cuda_kernels_emu_race build/test_cuda_kernels_emu >"$W/build1.log" 2>&1 \
  || { tail -5 "$W/build1.log"; fail "the mutant without the barrier did not build"; }
"$M1/build/test_cuda_kernels_emu_race" >"$W/race.log" 2>&1 && fail "the race check passed a kernel without its barrier"
grep -q "data race in kernel det_gemm_instance" "$W/race.log" || { tail -3 "$W/race.log"; fail "the race check did not name the racing kernel"; }
pass "a removed barrier: $(grep -o 'data race in kernel det_gemm_instance: block [0-9]*: thread [0-9]* reads' "$W/race.log" | head -1)"
"$M1/build/test_cuda_kernels_emu" >"$W/shuffle.log" 2>&1 && fail "the shuffled emulator gave right bits without the barrier"
pass "... and the shuffled emulator: $(grep -c '^FAIL' "$W/shuffle.log") kernel comparisons fail"

# 2. the tree order
M2="$W/sequential_tree"
copy_tree "$M2"
sed -i 's|        case 3: \*s1 = \*s1 + p; \*s0 = \*s0 + \*s1; break;|        case 3: *s0 = (*s0 + *s1) + p; break;|' "$M2/llmc/gpu_plan.h"
cmp -s llmc/gpu_plan.h "$M2/llmc/gpu_plan.h" && fail "mutation 2 did not apply: det_tree8_push's case 3 not found"
make -s -C "$M2" build/test_cuda_kernels_emu >"$W/build2.log" 2>&1 || { tail -5 "$W/build2.log"; fail "the tree mutant did not build"; }
"$M2/build/test_cuda_kernels_emu" >"$W/tree.log" 2>&1 && fail "the kernels matched train_gpt2.c with a left-to-right chunk sum"
grep -q "^FAIL device matmul_forward" "$W/tree.log" || { tail -3 "$W/tree.log"; fail "the tree mutant was not caught by the device matmul check"; }
pass "a sequential tree instead of R1: $(grep -c '^FAIL device' "$W/tree.log") device kernel comparisons fail"
