#!/usr/bin/env bash
# The checks of the CUDA build can fail: copies of the tree with one deliberate defect in the
# deterministic kernels, each of which the emulated tests must report.
#   1. det_gemm_kernel without the barrier between its shared-memory tiles: the race check
#      (build/test_cuda_kernels_emu_race) must stop with a data race in that kernel, and the
#      shuffled emulator alone (build/test_cuda_kernels_emu) must get wrong bits.
#   2. the streaming tree over the 8 chunk partials (gpu_plan.h det_tree8_push) summing them
#      left to right instead of by the R1 tree: the kernels' bits must differ from train_gpt2.c.
# and in fast mode's kernels (build/test_emu, build/test_fast_emu):
#   3. a wrong fragment index: fa_frag_a's ldmatrix row addresses taking the column half's bit
#      for the row half: the 16x16x16 tile must differ from the triple loop and flash
#      attention leave its tolerance;
#   4. a missing cp.async wait (the flash forward's wait_group 1): the forward must fail;
#   5. an off-by-one in the flash kernels' causal mask (fa_hidden: each query sees one future
#      key): flash attention and the ring's diagonal block (kernels_fast_cp.cuh) must fail;
#   6. a cuBLASLt call with a misaligned pointer: lt_matmul no longer passes A's alignment in
#      the preference (cuBLASLt then assumes 256 bytes), and an input at a 2-byte offset must
#      be refused by the stand-in (CUBLAS_STATUS_INVALID_VALUE = 7);
#   7. the experts' batched matmul without its bias batch stride (every expert adds the first
#      expert's bias): the batched experts must differ from one matmul per expert.
# A mutation that does not apply (the source changed) fails the test instead of passing it.
set -u
cd "$(dirname "$0")/../.."
W=$(mktemp -d /tmp/llmc_emu_mutants.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null; wait; rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
pass() { echo "ok   $*"; }

# a copy of what the emulated kernel tests are built from; the emulator's own objects are
# copied too (no mutation touches the emulator), so a mutant compiles only its test programs
copy_tree() {
  mkdir -p "$1/dev/test" "$1/dev/gpu" "$1/build"
  cp -r Makefile mk llmc train_gpt2.c train_gpt2.cu "$1/"
  cp dev/test/test_cuda_host.c dev/test/test_emu.cpp dev/test/test_fast_emu.cpp "$1/dev/test/"
  cp -r dev/gpu/emu dev/gpu/attention_reference.h "$1/dev/gpu/"
  for o in build/cuda_emu.o build/cuda_emu_race.o; do
    [ -f "$o" ] && cp "$o" "$1/$o" && touch "$1/$o"
  done
}

# mutant NAME FILE SED-SCRIPT WHAT: a copy of the tree with the sed script applied to FILE
mutant() {
  copy_tree "$W/$1"
  sed -i "$3" "$W/$1/$2"
  cmp -s "$2" "$W/$1/$2" && fail "mutation $1 did not apply: $4 not found"
}
# build NAME TARGET...: make the targets in mutant NAME in the background (all mutants build at
# once, so the machine's cores are busy; built waits for one)
build() {
  local name=$1; shift
  ( make -s -C "$W/$name" "$@" >"$W/$name.build.log" 2>&1; echo $? >"$W/$name.built" ) &
}
built() {
  while [ ! -f "$W/$1.built" ]; do sleep 0.5; done
  [ "$(cat "$W/$1.built")" = 0 ] || { tail -5 "$W/$1.build.log"; fail "mutant $1 did not build: $2"; }
}
# expect_caught NAME TEST PATTERN WHAT: TEST built in mutant NAME fails, saying PATTERN
expect_caught() {   # MUTANT BINARY TEXT WHAT [PARTS: test_fast_emu's, those the mutation breaks]
  built "$1" "$2"
  "$W/$1/$2" ${5:+"$5"} >"$W/$1.$(basename "$2").log" 2>&1 && fail "$2 passed $4"
  local log="$W/$1.$(basename "$2").log"
  grep -q "$3" "$log" || { tail -3 "$log"; fail "$2 failed on $4, but not saying '$3'"; }
  pass "$4: $(grep -m1 "$3" "$log" | cut -c1-110)"
}

# The seven mutants, made and set building first, checked in order after.
# 1. the barrier
mutant no_barrier llmc/kernels_det.cuh '/if (have) { store_tile(buf ^ 1); }/{n;/__syncthreads();/d}' \
  "det_gemm_kernel's barrier"
build no_barrier build/test_cuda_kernels_emu_race build/test_cuda_kernels_emu
# 2. the tree order
mutant sequential_tree llmc/gpu_plan.h \
  's|        case 3: \*s1 = \*s1 + p; \*s0 = \*s0 + \*s1; break;|        case 3: *s0 = (*s0 + *s1) + p; break;|' \
  "det_tree8_push's case 3"
build sequential_tree build/test_cuda_kernels_emu
# 3. a wrong fragment index
mutant fragment llmc/attention_flash.cuh 's|ldmatrix_x4(a, s + (r0 + r + (i \& 1) \* 8)|ldmatrix_x4(a, s + (r0 + r + (i >> 1) * 8)|' \
  "fa_frag_a's ldmatrix row address"
build fragment build/test_emu build/test_fast_emu
# 4. a missing cp.async wait
mutant no_wait llmc/attention_flash.cuh '0,/cp_async_wait<1>();/{/cp_async_wait<1>();/d}' "the forward's cp_async_wait<1>"
build no_wait build/test_fast_emu
# 5. the causal mask one key late
mutant mask llmc/attention_flash.cuh 's|(m.causal \&\& key > q)|(m.causal \&\& key > q + 1)|' "fa_hidden's causal mask"
build mask build/test_fast_emu
# 6. a misaligned pointer passed to cuBLASLt
mutant align llmc/matmul_cublaslt.cuh '/CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES/d' "the preference's A alignment"
build align build/test_fast_emu
# 7. a batched matmul's bias batch stride left unset
mutant bias_stride llmc/matmul_cublaslt.cuh 's/if (batch->count > 1 \&\& bias) {/if (batch->count < 1 \&\& bias) {/' \
  "the bias batch stride's attribute"
build bias_stride build/test_fast_emu

# 1: the race check names the kernel, and the shuffled emulator alone gets wrong bits
M1="$W/no_barrier"
built no_barrier "the race check and the shuffled kernels"
"$M1/build/test_cuda_kernels_emu_race" >"$W/race.log" 2>&1 && fail "the race check passed a kernel without its barrier"
grep -q "data race in kernel det_gemm_instance" "$W/race.log" || { tail -3 "$W/race.log"; fail "the race check did not name the racing kernel"; }
pass "a removed barrier: $(grep -o 'data race in kernel det_gemm_instance: block [0-9]*: thread [0-9]* reads' "$W/race.log" | head -1)"
"$M1/build/test_cuda_kernels_emu" >"$W/shuffle.log" 2>&1 && fail "the shuffled emulator gave right bits without the barrier"
pass "... and the shuffled emulator: $(grep -c '^FAIL' "$W/shuffle.log") kernel comparisons fail"

# 2: the device matmul check catches a left-to-right chunk sum
built sequential_tree build/test_cuda_kernels_emu
"$W/sequential_tree/build/test_cuda_kernels_emu" >"$W/tree.log" 2>&1 && fail "the kernels matched train_gpt2.c with a left-to-right chunk sum"
grep -q "^FAIL device matmul_forward" "$W/tree.log" || { tail -3 "$W/tree.log"; fail "the tree mutant was not caught by the device matmul check"; }
pass "a sequential tree instead of R1: $(grep -c '^FAIL device' "$W/tree.log") device kernel comparisons fail"

expect_caught fragment build/test_emu "FAIL: ldmatrix + mma.sync" "a wrong ldmatrix row address (the mma tile)"
expect_caught fragment build/test_fast_emu "FAIL: flash forward" "... and flash attention" flash
expect_caught no_wait build/test_fast_emu "FAIL: flash forward" "a missing cp.async wait" flash
expect_caught mask build/test_fast_emu "FAIL: flash forward" "an off-by-one in the causal mask" flash,ring
grep -q "FAIL: ring forward" "$W/mask.test_fast_emu.log" || fail "test_fast_emu passed the ring's diagonal block with an off-by-one causal mask"
pass "... and the ring's diagonal block: $(grep -m1 "FAIL: ring forward" "$W/mask.test_fast_emu.log" | cut -c1-100)"
expect_caught align build/test_fast_emu "cuBLASLt error 7" "a cuBLASLt call with a misaligned pointer" matmul
expect_caught bias_stride build/test_fast_emu "FAIL: grouped expert matmul" "the experts' batch without its bias stride" moe
