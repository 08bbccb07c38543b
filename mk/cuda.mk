# The CUDA build: train_gpt2cu (train_gpt2.cu; --deterministic 1 bit-exact with train_gpt2,
# fast bf16 mode by default) and its tests.
#
#   make train_gpt2cu            needs CUDA: nvcc, cuBLASLt (found under CUDA_HOME)
#   build/test_cuda_host         gcc, always: the CUDA build's plan and per-output arithmetic
#                                against train_gpt2.c, train_gpt2cu --help and its no-GPU error
#   build/test_cuda_kernels      nvcc: the same file as CUDA; on a GPU, every kernel against its
#                                train_gpt2.c twin (dev/gpu/check.sh runs it first)
#
# CUDA is found by its files, not by a package manager: nvcc at $(CUDA_HOME)/bin/nvcc (default
# /usr/local/cuda, else nvcc on PATH), cublasLt.h and libcublasLt under CUDA_HOME. Without
# them `make` builds the rest and says it skipped train_gpt2cu.
# Knobs: NVCC=..., CUDA_HOME=..., CUDA_ARCHS="80 90" (compute capabilities to build for).
#
# Deterministic mode depends on these flags: -fmad=false (no contraction of a*b+c: every fused
# multiply-add is an explicit fmaf, as in the CPU build's -ffp-contract=off), IEEE division and
# square root (-prec-div=true -prec-sqrt=true), subnormals kept (-ftz=false); never
# --use_fast_math. The host code that must match train_gpt2's bits (initialisation, learning
# rate, AdamW constants) gets the CPU build's -ffp-contract=off through -Xcompiler.

NVCC ?= $(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(realpath $(NVCC))),/usr/local/cuda)
CUDA_LIBDIR := $(firstword $(wildcard $(CUDA_HOME)/lib64/libcublasLt.so) \
                           $(wildcard $(CUDA_HOME)/targets/x86_64-linux/lib/libcublasLt.so))
HAVE_CUDA := $(if $(and $(NVCC),$(wildcard $(CUDA_HOME)/include/cublasLt.h),$(CUDA_LIBDIR)),1)

CUDA_ARCHS ?= 80 90
NVCC_FLAGS ?= -O3
# SASS for each listed architecture, and PTX of the last one so that a newer GPU (JIT) still runs
NVCC_FLAGS += -std=c++17 $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
              -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS)) --threads 0 \
              -fmad=false -prec-div=true -prec-sqrt=true -ftz=false -I. \
              -Xcompiler -ffp-contract=off,-Wall,-Wextra,-Wno-unused-parameter,-Wno-sign-compare
NVCC_LDLIBS = -L$(dir $(CUDA_LIBDIR)) -Xlinker -rpath=$(dir $(CUDA_LIBDIR)) -lcublasLt
CUDA_HEADERS := $(wildcard llmc/*.cuh)

TEST_BINS += build/test_cuda_host
TESTS     += build/test_cuda_host

build/test_cuda_host: dev/test/test_cuda_host.c train_gpt2.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

ifeq ($(HAVE_CUDA),1)
all: train_gpt2cu

train_gpt2cu: train_gpt2.cu $(LLMC_HEADERS) $(CUDA_HEADERS)
	$(NVCC) $(NVCC_FLAGS) -o $@ $< $(NVCC_LDLIBS)

# the host test also runs train_gpt2cu (--help, the no-GPU error) when it exists
build/test_cuda_host: | train_gpt2cu

# the kernel test includes train_gpt2.c for the reference kernels (OpenMP for their speed; its
# CPU code under g++ -O3 raises a maybe-uninitialized warning that gcc -O2 in C does not)
build/test_cuda_kernels: dev/test/test_cuda_host.c train_gpt2.c $(LLMC_HEADERS) $(CUDA_HEADERS) | build
	$(NVCC) $(NVCC_FLAGS) -Xcompiler -fopenmp,-Wno-unused-function,-Wno-maybe-uninitialized -diag-suppress 1675 -x cu -o $@ $< \
	    $(NVCC_LDLIBS) -lgomp
TEST_BINS += build/test_cuda_kernels
TESTS     += build/test_cuda_kernels
else
all: cuda-note
.PHONY: cuda-note
cuda-note:
	@echo "note: CUDA not found (nvcc, cublasLt.h and libcublasLt under CUDA_HOME=$(CUDA_HOME)): skipping train_gpt2cu"

train_gpt2cu build/test_cuda_kernels:
	@echo "error: $@ needs CUDA: nvcc, cublasLt.h and libcublasLt under CUDA_HOME=$(CUDA_HOME) (or pass NVCC=...)"; exit 1
endif
