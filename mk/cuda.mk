# The CUDA build: train_gpt2cu (train_gpt2.cu + train_gpt2_fast.cu; --deterministic 1 bit-exact
# with train_gpt2, fast bf16 mode by default), its emulated twin train_gpt2cu_emu, and their tests.
#
#   make train_gpt2cu            needs CUDA: nvcc, cuBLASLt (found under CUDA_HOME); links Open MPI
#                                when mpicc is found (several GPUs under mpirun)
#   make train_gpt2cu_emu        no nvcc, no GPU: train_gpt2.cu and train_gpt2_fast.cu compiled by
#                                g++ on the CPU emulation of CUDA in dev/gpu/emu (its header says
#                                what it proves): --deterministic 1 with the same flags, files and
#                                bits as train_gpt2; fast mode on the flash kernels and the
#                                cuBLASLt stand-in (no cuDNN)
#   build/test_cuda_host         gcc, always: the CUDA build's per-output arithmetic against
#                                train_gpt2.c and its launch planning, train_gpt2cu's startup errors
#   build/test_cuda_kernels      nvcc: the same file as CUDA; on a GPU, every kernel against its
#                                train_gpt2.c twin (dev/gpu/check.sh runs it first)
#
# CUDA is found by its files, not by a package manager: nvcc at $(CUDA_HOME)/bin/nvcc (default
# /usr/local/cuda, else nvcc on PATH), cublasLt.h and libcublasLt under CUDA_HOME. Without
# them `make` builds the rest and says it skipped train_gpt2cu.
# Knobs: NVCC=..., CUDA_HOME=..., CUDA_ARCHS="80 90" (compute capabilities to build for).
#
# Deterministic mode depends on these flags, given to train_gpt2.cu: -fmad=false (no
# contraction of a*b+c: every fused multiply-add is an explicit fmaf, as in the CPU build's
# -ffp-contract=off), IEEE division and square root (-prec-div=true -prec-sqrt=true),
# subnormals kept (-ftz=false); never --use_fast_math. Host code that must match train_gpt2's
# bits (initialisation, learning rate, AdamW constants) gets the CPU build's -ffp-contract=off
# through -Xcompiler. train_gpt2_fast.cu gets -fmad=false too: it includes kernels_det.cuh for
# the exact bias, layernorm and embedding gradient reductions, which are exact only without
# contraction (the other three are nvcc's defaults); its own kernels write their fused
# multiply-adds explicitly (__fmaf_rn) and take the rest of their speed from cuBLASLt and mma.

NVCC ?= $(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(realpath $(NVCC))),/usr/local/cuda)
CUDA_LIBDIR := $(firstword $(wildcard $(CUDA_HOME)/lib64/libcublasLt.so) \
                           $(wildcard $(CUDA_HOME)/targets/x86_64-linux/lib/libcublasLt.so))
HAVE_CUDA := $(if $(and $(NVCC),$(wildcard $(CUDA_HOME)/include/cublasLt.h),$(CUDA_LIBDIR)),1)

# Open MPI for the CUDA build (the emulated build uses mpicxx); without it, one rank only.
# NCCL (nccl.h and libnccl under CUDA_HOME, or NCCL_HOME) for --comm nccl, bootstrapped by MPI.
NCCL_HOME ?= $(CUDA_HOME)
NCCL_LIBDIR := $(patsubst %/libnccl.so,%,$(firstword $(wildcard $(NCCL_HOME)/lib64/libnccl.so) \
                 $(wildcard $(NCCL_HOME)/lib/libnccl.so) $(wildcard /usr/lib/x86_64-linux-gnu/libnccl.so)))
NCCL_INCDIR := $(patsubst %/nccl.h,%,$(firstword $(wildcard $(NCCL_HOME)/include/nccl.h) $(wildcard /usr/include/nccl.h)))
ifeq ($(HAVE_MPI),1)
MPI_CUDA_CFLAGS := $(shell $(MPICC) --showme:compile 2>/dev/null) -DUSE_MPI -DOMPI_SKIP_MPICXX
MPI_CUDA_LIBS := $(shell $(MPICC) --showme:link 2>/dev/null)
ifneq ($(and $(NCCL_LIBDIR),$(NCCL_INCDIR)),)
MPI_CUDA_CFLAGS += -DUSE_NCCL -I$(NCCL_INCDIR)
MPI_CUDA_LIBS += -L$(NCCL_LIBDIR) -Xlinker -rpath=$(NCCL_LIBDIR) -lnccl
endif
EMU_CXX = OMPI_CXX=$(CXX) mpicxx
EMU_MPI = -DUSE_MPI -DOMPI_SKIP_MPICXX
else
EMU_CXX = $(CXX)
endif

CUDA_ARCHS ?= 80 90
NVCC_FLAGS ?= -O3
# SASS for each listed architecture, and PTX of the last one so that a newer GPU (JIT) still runs
NVCC_FLAGS += -std=c++17 $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
              -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS)) --threads 0 \
              -I. -Xcompiler -ffp-contract=off,-Wall,-Wextra,-Wno-unused-parameter,-Wno-sign-compare,-Wno-unknown-pragmas
NVCC_DET_FLAGS = -fmad=false -prec-div=true -prec-sqrt=true -ftz=false
NVCC_LDLIBS = -L$(dir $(CUDA_LIBDIR)) -Xlinker -rpath=$(dir $(CUDA_LIBDIR)) -lcublasLt
CUDA_HEADERS := $(wildcard llmc/*.cuh)
EMU_FILES := $(wildcard dev/gpu/emu/*.h dev/gpu/emu/*.cpp)

# --- the emulated build: g++, no GPU --------------------------------------------------------
# The same IEEE rules as train_gpt2 (-ffp-contract=off, no fast math); -fno-strict-aliasing
# because the kernels read shared memory through float4 views, which the GPU allows.
ifeq ($(origin CXX),default)
CXX = g++
endif
EMU_CXXFLAGS = -std=c++17 -O2 $(ARCH) -ffp-contract=off -fno-fast-math -fno-strict-aliasing -fopenmp \
               -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare -Wno-unknown-pragmas -D_GNU_SOURCE \
               -I. -Idev/gpu/emu $(EMU_MPI)

build/cuda_emu.o: dev/gpu/emu/cuda_emu.cpp dev/gpu/emu/cuda_runtime.h | build
	$(CXX) $(EMU_CXXFLAGS) -c -o $@ $<

# fast mode's translation unit too (no LLMC_CUDNN: the emulator has no cuDNN)
build/train_gpt2_fast_emu.o: train_gpt2_fast.cu $(LLMC_HEADERS) $(CUDA_HEADERS) $(EMU_FILES) | build
	$(EMU_CXX) $(EMU_CXXFLAGS) -x c++ -c -o $@ $<
train_gpt2cu_emu: train_gpt2.cu train_gpt2.c build/cuda_emu.o build/train_gpt2_fast_emu.o $(LLMC_HEADERS) $(CUDA_HEADERS) $(EMU_FILES)
	$(EMU_CXX) $(EMU_CXXFLAGS) $(FLEXSP_GLPK) -x c++ train_gpt2.cu -x none build/train_gpt2_fast_emu.o build/cuda_emu.o -o $@ $(FLEXSP_LIBS) -lm

TEST_BINS += build/test_cuda_host train_gpt2cu_emu build/test_cuda_kernels_emu
TESTS     += build/test_cuda_host build/test_cuda_kernels_emu

# every deterministic kernel against its train_gpt2.c twin, launched on the emulated GPU
EMU_TEST_FLAGS = $(filter-out $(EMU_MPI),$(EMU_CXXFLAGS)) -DLLMC_CUDA_EMU -Wno-unused-function
build/test_cuda_kernels_emu: dev/test/test_cuda_host.c train_gpt2.c build/cuda_emu.o $(LLMC_HEADERS) $(CUDA_HEADERS) $(EMU_FILES) | build
	$(CXX) $(EMU_TEST_FLAGS) -x c++ $< -x none build/cuda_emu.o -o $@ -lm

# The race check: the kernels' every load and store reported to the emulator through gcc's
# kernel-address-sanitizer hooks (a call per access, no ASan runtime), checked against the
# barriers (dev/gpu/emu/cuda_emu.cpp, part 3). -O1: the instrumented file compiles faster.
EMU_RACE_FLAGS = -O1 -fsanitize=kernel-address --param asan-instrumentation-with-call-threshold=0 \
                 --param asan-stack=0 --param asan-globals=0
build/cuda_emu_race.o: dev/gpu/emu/cuda_emu.cpp dev/gpu/emu/cuda_runtime.h | build
	$(CXX) $(EMU_CXXFLAGS) -DLLMC_EMU_RACE_CHECK=1 -c -o $@ $<
build/test_cuda_kernels_emu_race: dev/test/test_cuda_host.c train_gpt2.c build/cuda_emu_race.o $(LLMC_HEADERS) $(CUDA_HEADERS) $(EMU_FILES) | build
	$(CXX) $(EMU_TEST_FLAGS) $(EMU_RACE_FLAGS) -DLLMC_EMU_RACE_CHECK=1 -x c++ $< -x none build/cuda_emu_race.o -o $@ -lm

# the emulator itself fails where a GPU would misbehave (dev/test/test_emu.cpp)
build/test_emu: dev/test/test_emu.cpp build/cuda_emu.o $(CUDA_HEADERS) $(EMU_FILES) | build
	$(CXX) $(EMU_TEST_FLAGS) -x c++ $< -x none build/cuda_emu.o -o $@ -lm
build/test_emu_race: dev/test/test_emu.cpp build/cuda_emu_race.o $(CUDA_HEADERS) $(EMU_FILES) | build
	$(CXX) $(EMU_TEST_FLAGS) $(EMU_RACE_FLAGS) -DLLMC_EMU_RACE_CHECK=1 -x c++ $< -x none build/cuda_emu_race.o -o $@ -lm

TEST_BINS += build/test_cuda_kernels_emu_race build/test_emu build/test_emu_race
TESTS     += build/test_emu build/test_emu_race build/test_cuda_kernels_emu_race dev/test/test_cuda_emu.sh \
             dev/test/test_emu_mutants.sh

build/test_cuda_host: dev/test/test_cuda_host.c train_gpt2.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

ifeq ($(HAVE_CUDA),1)
all: train_gpt2cu

build/train_gpt2cu.o: train_gpt2.cu train_gpt2.c $(LLMC_HEADERS) $(CUDA_HEADERS) | build
	$(NVCC) $(NVCC_FLAGS) $(NVCC_DET_FLAGS) $(MPI_CUDA_CFLAGS) -c -o $@ $<

# fast mode uses cuDNN's attention when mk/cudnn.mk finds cuDNN (read when the recipe runs)
build/train_gpt2_fast.o: train_gpt2_fast.cu $(LLMC_HEADERS) $(CUDA_HEADERS) | build
	$(NVCC) $(NVCC_FLAGS) -fmad=false $(MPI_CUDA_CFLAGS) $(if $(HAVE_CUDNN),-DLLMC_CUDNN -I$(CUDNN_INCDIR)) -c -o $@ $<

train_gpt2cu: build/train_gpt2cu.o build/train_gpt2_fast.o
	$(NVCC) $(NVCC_FLAGS) -o $@ $^ $(NVCC_LDLIBS) $(MPI_CUDA_LIBS) \
	    $(if $(HAVE_CUDNN),-L$(CUDNN_LIBDIR) -Xlinker -rpath=$(CUDNN_LIBDIR) -lcudnn)

# the host test also runs train_gpt2cu (--help, the no-GPU error) when it exists
build/test_cuda_host: | train_gpt2cu

# the kernel test includes train_gpt2.c for the reference kernels (OpenMP for their speed; its
# CPU code under g++ -O3 raises a maybe-uninitialized warning that gcc -O2 in C does not)
build/test_cuda_kernels: dev/test/test_cuda_host.c train_gpt2.c $(LLMC_HEADERS) $(CUDA_HEADERS) | build
	$(NVCC) $(NVCC_FLAGS) $(NVCC_DET_FLAGS) -Xcompiler -fopenmp,-Wno-unused-function,-Wno-maybe-uninitialized -diag-suppress 1675 -x cu -o $@ $< \
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
