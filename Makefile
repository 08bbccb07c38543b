# Build for the GPT-2 reference trainer.
#
#   make            builds train_gpt2 (CPU) and the C tools; train_gpt2cu too when nvcc is found
#   make train      quick start: tiny Shakespeare, GPT-2 124M fine-tuned on the CPU (offline: a
#                   fresh small GPT-2); make train_gpu the same on one GPU
#   make test       every test; exits non-zero when any fails
#   make bench      CPU benchmark table (dev/bench)
#
# Knobs: NO_OMP=1 (no OpenMP), NO_MPI=1 (single rank only, no mpicc), NO_SIMD=1 (scalar
# kernels only: same bits, slower), ARCH=... (default -march=native), CC=..., NVCC=...
#
# The reference must be IEEE-exact and reproducible: -ffp-contract=off so the compiler never
# fuses a*b+c on its own (every fused multiply-add in the arithmetic is an explicit fmaf), and
# never -Ofast / -ffast-math. -fno-math-errno only lets sqrtf inline; results are unchanged.

ifeq ($(origin CC),default)
CC = gcc
endif
ARCH     ?= -march=native
CFLAGS   ?= -O2
CFLAGS   += -std=c11 $(ARCH) -ffp-contract=off -fno-fast-math -fno-math-errno \
            -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare -D_GNU_SOURCE -I.
LDLIBS   += -lm

ifneq ($(NO_OMP),1)
CFLAGS   += -fopenmp
endif
ifeq ($(NO_SIMD),1)
CFLAGS   += -DLLMC_NO_SIMD
endif

# Open MPI: train_gpt2 is built with mpicc (and can run under mpirun) when mpicc exists.
MPICC    ?= mpicc
ifneq ($(NO_MPI),1)
HAVE_MPI := $(shell command -v $(MPICC) >/dev/null 2>&1 && echo 1)
endif
ifeq ($(HAVE_MPI),1)
TRAIN_CC     = OMPI_CC=$(CC) $(MPICC)
TRAIN_CFLAGS = -DUSE_MPI
else
TRAIN_CC     = $(CC)
TRAIN_CFLAGS =
endif

# Every header the builds share; any change rebuilds everything (header-only modules).
LLMC_HEADERS := $(wildcard llmc/*.h)

# Fragments in mk/ append to these.
TOOLS :=
TESTS :=
TEST_BINS :=

.PHONY: all train test bench clean data
all: train_gpt2

# The quick start (scripts/quickstart.sh): tiny Shakespeare (downloaded, or from ../shared/data
# offline), then OpenAI's GPT-2 124M fine-tuned on it with llm.c's CPU recipe when its weights can
# be downloaded (checked against Hugging Face's sha256), else a fresh GPT-2 of depth 4 trained
# from scratch; validation loss before and after, a sample, the loss curves as SVG.
# make train_gpu (mk/quickstart.mk) is the same on one GPU.
train: train_gpt2 dev/tools/gpt2_weights dev/tools/plot_log data
	scripts/quickstart.sh cpu

train_gpt2: train_gpt2.c $(LLMC_HEADERS)
ifneq ($(HAVE_MPI),1)
	@echo "note: mpicc not found (or NO_MPI=1): building train_gpt2 for a single rank only"
endif
	@$(if $(FLEXSP_GLPK),true,echo "note: glpk.h not found (Debian: libglpk-dev): --flexsp-policy milp plans with the greedy plan")
	$(TRAIN_CC) $(CFLAGS) $(TRAIN_CFLAGS) $(FLEXSP_GLPK) -o $@ $< $(FLEXSP_LIBS) $(LDLIBS)

# --- tests of the reference trainer --------------------------------------------------------
# The kernel test is built twice: with the SIMD kernels and with the plain-C ones (same bits).
TEST_CFLAGS = $(CFLAGS) -Wno-unused-function
build:
	mkdir -p build
build/test_canonical: dev/test/test_canonical.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)
build/test_kernels: dev/test/test_kernels.c train_gpt2.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)
build/test_kernels_scalar: dev/test/test_kernels.c train_gpt2.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -DLLMC_NO_SIMD -o $@ $< $(LDLIBS)
build/test_gpt2: dev/test/test_gpt2.c train_gpt2.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)
build/testdata: dev/test/testdata.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)
build/test_tp_ops: dev/test/test_tp_ops.c train_gpt2.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)
TEST_BINS += build/test_canonical build/test_kernels build/test_kernels_scalar build/test_gpt2 build/testdata \
             build/test_tp_ops
TESTS += dev/test/test_headers.sh build/test_canonical build/test_kernels build/test_kernels_scalar build/test_gpt2 \
         dev/test/test_train.sh dev/test/test_dp.sh dev/test/test_pp.sh dev/test/test_tp.sh

# --- benchmarks (dev/bench: tables, not tests) ---------------------------------------------
build/bench_kernels: dev/bench/bench_kernels.c train_gpt2.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)
build/fma_peak: dev/bench/fma_peak.c $(LLMC_HEADERS) | build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)
bench: train_gpt2 build/bench_kernels build/fma_peak
	dev/bench/bench_cpu.sh

include $(sort $(wildcard mk/*.mk))

all: $(TOOLS)

# The test binaries build in parallel (one job per core; `make test` alone is otherwise serial,
# and the builds were a third of its time), then the tests run one after the other.
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
.PHONY: test-build
test-build: train_gpt2 $(TOOLS) $(TEST_BINS)
test:
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) test-build
	@dev/test/run_tests.sh $(TESTS)

clean:
	rm -rf train_gpt2 train_gpt2cu train_gpt2cu_emu build
