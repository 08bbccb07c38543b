# Fast mode on the emulated GPU (dev/gpu/emu): flash attention and the context-parallel ring's
# blocks against the double-precision reference with per-element bounds, and
# llmc/matmul_cublaslt.cuh on the cuBLASLt stand-in (dev/test/test_fast_emu.cpp), once plain
# and once with the race check (mk/cuda.mk's flags and emulator objects).
build/test_fast_emu: dev/test/test_fast_emu.cpp dev/gpu/attention_reference.h build/cuda_emu.o $(LLMC_HEADERS) \
                     $(CUDA_HEADERS) $(EMU_FILES) | build
	$(CXX) $(EMU_TEST_FLAGS) -x c++ $< -x none build/cuda_emu.o -o $@ -lm
build/test_fast_emu_race: dev/test/test_fast_emu.cpp dev/gpu/attention_reference.h build/cuda_emu_race.o \
                          $(LLMC_HEADERS) $(CUDA_HEADERS) $(EMU_FILES) | build
	$(CXX) $(EMU_TEST_FLAGS) $(EMU_RACE_FLAGS) -DLLMC_EMU_RACE_CHECK=1 -x c++ $< -x none build/cuda_emu_race.o -o $@ -lm

TEST_BINS += build/test_fast_emu build/test_fast_emu_race
TESTS     += build/test_fast_emu build/test_fast_emu_race

# fast mode end to end: train_gpt2cu_emu --deterministic 0 against train_gpt2 within
# dev/gpu/fast_tolerance.awk's bf16 tolerances, bit-identical across LLMC_EMU_SEED, DP 2 x
# ZeRO 0-3 = one rank
TESTS += dev/test/test_fast_e2e.sh

# fast mode with pipeline parallelism: every schedule on 2 stages, 4 stages, DP 2 x PP 2, bit-identical
# to one rank of fast mode (samples with the KV cache = without), within the bf16 tolerances of
# train_gpt2
TESTS += dev/test/test_fast_pp.sh

# fast mode with tensor parallelism: --tp 2 within a derived tolerance of one rank (DP 2 x TP 2
# at ZeRO-3 = TP 2 byte for byte), within the bf16 tolerances of train_gpt2, tp bytes = Megatron's
# count; --tp 2 --sp 1 = --tp 2 byte for byte, its tp bytes = the formula; --tp with --pp
# refused in one line
TESTS += dev/test/test_fast_tp.sh

# fast mode with context parallelism: --cp 2 --cp-mode a2a (ZeRO-0, 3) within a derived
# tolerance of one rank (its forward equal), --cp-mode ring within the bf16 tolerances of one
# rank, both within those of train_gpt2, cp bytes (bf16 messages, fp32 dK/dV and losses) = the
# formula; --cp with --tp, --pp, experts, cudnn refused
TESTS += dev/test/test_fast_cp.sh

# fast mode with experts: one rank within the bf16 tolerances of train_gpt2, --ep 2 (ZeRO-0, 3)
# and --pp 2 (1f1b, zb1) = one rank byte for byte, rank 0's all-to-all bytes (bf16 rows) against
# its routing counts; --tp with experts refused in one line
TESTS += dev/test/test_fast_moe.sh
