# cuDNN: fast mode's fused attention (llmc/attention_cudnn.cuh, cuDNN 9's backend API) and its
# GPU test.
#
#   build/test_attention_gpu   nvcc + cuDNN 9: on a GPU, cuDNN's attention forward and backward
#                              against an fp32 CPU reference and the flash kernels; no GPU:
#                              says so and exits 77 (skip)
#   make gpu-tests             builds every program of GPU_TESTS (GPU-only tests, not in TESTS:
#                              `make test` runs on machines without a GPU)
#
# cuDNN is found by its files, like CUDA in mk/cuda.mk (included before this one): cudnn_graph.h
# and libcudnn.so under CUDNN_HOME (default CUDA_HOME), else under /usr (Debian/Ubuntu
# packages). Without them (or without CUDA) the targets say what is missing.
# Knobs: CUDNN_HOME=...
#
# The test is compiled without -fmad=false -prec-div=true -prec-sqrt=true:
# attention_cudnn.cuh and attention_flash.cuh must be right without them (fast mode's
# translation unit has -fmad=false only for the kernels_det.cuh reductions it reuses).

CUDNN_HOME ?= $(CUDA_HOME)
CUDNN_INCDIR := $(patsubst %/cudnn_graph.h,%,$(firstword $(wildcard $(CUDNN_HOME)/include/cudnn_graph.h) \
                  $(wildcard /usr/include/cudnn_graph.h) $(wildcard /usr/include/x86_64-linux-gnu/cudnn_graph.h)))
CUDNN_LIBDIR := $(patsubst %/libcudnn.so,%,$(firstword $(wildcard $(CUDNN_HOME)/lib64/libcudnn.so) \
                  $(wildcard $(CUDNN_HOME)/lib/libcudnn.so) \
                  $(wildcard $(CUDNN_HOME)/targets/x86_64-linux/lib/libcudnn.so) \
                  $(wildcard /usr/lib/x86_64-linux-gnu/libcudnn.so)))
HAVE_CUDNN := $(if $(and $(HAVE_CUDA),$(CUDNN_INCDIR),$(CUDNN_LIBDIR)),1)

GPU_TESTS ?=

# (each fragment adds its GPU tests to gpu-tests itself: prerequisites are expanded when read)
.PHONY: gpu-tests
gpu-tests: $(GPU_TESTS)

ifeq ($(HAVE_CUDNN),1)
CUDNN_NVCC_FLAGS = $(filter-out -fmad=false -prec-div=true -prec-sqrt=true,$(NVCC_FLAGS)) -I$(CUDNN_INCDIR)
CUDNN_LDLIBS = $(NVCC_LDLIBS) -L$(CUDNN_LIBDIR) -Xlinker -rpath=$(CUDNN_LIBDIR) -lcudnn

# the CPU reference runs on every core (OpenMP)
build/test_attention_gpu: dev/gpu/test_attention.cu dev/gpu/attention_reference.h $(LLMC_HEADERS) $(CUDA_HEADERS) | build
	$(NVCC) $(CUDNN_NVCC_FLAGS) -Xcompiler -fopenmp -o $@ $< $(CUDNN_LDLIBS) -lgomp
GPU_TESTS += build/test_attention_gpu
gpu-tests: build/test_attention_gpu
else
.PHONY: build/test_attention_gpu
build/test_attention_gpu:
	@echo "error: $@ needs CUDA (nvcc, cuBLASLt) and cuDNN 9 (cudnn_graph.h, libcudnn.so) under CUDA_HOME=$(CUDA_HOME) or CUDNN_HOME=$(CUDNN_HOME)"; exit 1
endif
