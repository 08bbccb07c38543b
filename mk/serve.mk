# Serving (issue 26): serve_gpt2, an OpenAI-compatible server (serve_gpt2.c) on the serving
# engine (llmc/serve_engine.h, llmc/paged_kv.h, its model side serve_model.c; the request parser
# llmc/serve_request.h).
#
#   make serve_gpt2     the server (needs libmicrohttpd and cJSON: Debian libmicrohttpd-dev,
#                       libcjson-dev; without them `make` says so in one line and skips it)
#   make serve          serves the quick start's checkpoint (make train) on port 8000
#   make bench-serve    in-flight vs static batching vs one at a time on d12 (a table, not a test)
#   make bench-serve-layouts  decode tok/s and ITL per layout (--tp, --pp, --kvp, --ep; a table)
#
# Tests: build/test_serve_engine drives the engine without HTTP; dev/test/test_serve.sh runs the
# server under curl; dev/test/test_serve_parallel.sh across ranks under mpirun (llmc/serve_parallel.h),
# dev/test/test_serve_kvp.sh with Helix's KV parallelism (llmc/serve_kvp.h), dev/test/test_serve_pp.sh
# the pipeline stages (--pp, llmc/serve_pipeline.h).
TEST_BINS += build/test_serve_engine
TESTS     += build/test_serve_engine

build/test_serve_engine: dev/test/test_serve_engine.c train_gpt2.c serve_model.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)

SERVE_LIBS := -lmicrohttpd -lcjson -lpthread
# their headers, as Debian installs them (a $(shell) test program would need '#', which GNU make
# before 4.3 reads as a comment there and 4.3 keeps escaped)
HAVE_SERVE_LIBS := $(if $(and $(wildcard /usr/include/microhttpd.h),$(wildcard /usr/include/cjson/cJSON.h)),1,)

ifeq ($(HAVE_SERVE_LIBS),1)
all: serve_gpt2
TEST_BINS += serve_gpt2
TESTS     += dev/test/test_serve.sh
# serving across ranks under mpirun (--tp, --ep, --kvp, --pp): needs serve_gpt2 built with mpicc
ifeq ($(HAVE_MPI),1)
TESTS     += dev/test/test_serve_parallel.sh
TESTS     += dev/test/test_serve_kvp.sh
TESTS     += dev/test/test_serve_pp.sh
endif
else
all: serve_gpt2_skipped
endif

.PHONY: serve serve_gpt2_skipped
serve_gpt2_skipped:
	@echo "note: libmicrohttpd or cJSON not found (Debian: libmicrohttpd-dev libcjson-dev): skipping serve_gpt2"

# built with mpicc where the trainer is (mpirun -np K*Q serve_gpt2 --tp K --ep Q); it runs as
# one process without mpirun too
serve_gpt2: serve_gpt2.c train_gpt2.c serve_model.c $(LLMC_HEADERS)
	$(TRAIN_CC) $(CFLAGS) $(TRAIN_CFLAGS) -Wno-unused-function -o $@ $< $(LDLIBS) $(SERVE_LIBS)

# serve_gpt2cu, the CUDA build's server (serve_gpt2.cu: serve_gpt2.c on the deterministic device
# kernels, its tensors in device memory), and its emulated twin (mk/cuda.mk's emulator, no GPU);
# dev/test/test_serve_cu.sh checks the emulated one's tokens against serve_gpt2's, on one rank and
# across ranks (both are built with MPI where the trainer is, as train_gpt2cu and its twin). (C++ warns
# about C's {0} initializers, which serve_gpt2.c uses.)
SERVE_CU_FLAGS := -Wno-missing-field-initializers
SERVE_CU_DEPS := serve_gpt2.cu serve_gpt2.c train_gpt2.c serve_model.c $(LLMC_HEADERS) $(CUDA_HEADERS)
serve_gpt2cu_emu: $(SERVE_CU_DEPS) build/cuda_emu.o $(EMU_FILES)
	$(EMU_CXX) $(EMU_TEST_FLAGS) $(EMU_MPI) $(SERVE_CU_FLAGS) -x c++ serve_gpt2.cu -x none build/cuda_emu.o -o $@ -lm $(SERVE_LIBS)
ifeq ($(HAVE_SERVE_LIBS),1)
TEST_BINS += serve_gpt2cu_emu
TESTS     += dev/test/test_serve_cu.sh
ifeq ($(HAVE_CUDA),1)
all: serve_gpt2cu
endif
endif
ifeq ($(HAVE_CUDA),1)
serve_gpt2cu: $(SERVE_CU_DEPS)
	$(NVCC) $(NVCC_FLAGS) $(NVCC_DET_FLAGS) $(MPI_CUDA_CFLAGS) -Xcompiler -Wno-unused-function,$(SERVE_CU_FLAGS) -o $@ serve_gpt2.cu \
	    $(SERVE_LIBS) $(MPI_CUDA_LIBS)
else
serve_gpt2cu:
	@echo "error: $@ needs CUDA: nvcc under CUDA_HOME=$(CUDA_HOME) (or pass NVCC=...)"; exit 1
endif

# the quick start's checkpoint: the latest a run of `make train` wrote, else the GPT-2 124M
# weights it fine-tuned
serve: serve_gpt2
	@ckpt=$$(ls -t out/quickstart/*/model_*.bin 2>/dev/null | head -1); \
	[ -n "$$ckpt" ] || ckpt=gpt2_124M.bin; \
	[ -s "$$ckpt" ] || { echo "make serve: no checkpoint: run make train first"; exit 1; }; \
	echo "./serve_gpt2 -e $$ckpt"; ./serve_gpt2 -e "$$ckpt"

build/serve_json: dev/test/serve_json.c | build
	$(CC) $(CFLAGS) -o $@ $< -lcjson
ifeq ($(HAVE_SERVE_LIBS),1)
TEST_BINS += build/serve_json
endif

# the request parser's libFuzzer target (clang, ASan, UBSan; mk/fuzz.mk's toolchain), replayed
# over dev/fuzz/seeds_serve_request by test_serve.sh; `make fuzz-serve` runs a campaign
build/fuzz/fuzz_serve_request: dev/fuzz/fuzz_serve_request.c $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ $< -lcjson -lm
ifeq ($(HAVE_SERVE_LIBS)$(HAVE_FUZZ),11)
TEST_BINS += build/fuzz/fuzz_serve_request
endif
.PHONY: fuzz-serve
fuzz-serve: build/fuzz/fuzz_serve_request
	@mkdir -p build/fuzz/corpus/serve_request
	build/fuzz/fuzz_serve_request -max_total_time=$(FUZZ_SECONDS) build/fuzz/corpus/serve_request dev/fuzz/seeds_serve_request

# the serving benchmark (dev/bench/bench_serve.sh; a table, not a test): in-flight against
# static batching and one request at a time, on d12, under our load generator
build/serve_load: dev/bench/serve_load.c | build
	$(CC) -O2 -std=c11 -Wall -Wextra -o $@ $< -lm -lpthread
.PHONY: bench-serve
bench-serve: serve_gpt2 build/serve_load
	dev/bench/bench_serve.sh
# a serving step's parts (layers, attention, head, draws, fingerprints) at 1 and 16 rows
build/bench_serve_step: dev/bench/bench_serve_step.c dev/bench/bench_median.h train_gpt2.c serve_model.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)
# per layout (issue 27): decode tok/s and ITL of one process, --tp, --pp, --kvp, --ep on d12 and
# d12 with 8 experts, long prompts (dev/bench/bench_serve_layouts.sh; under mpirun)
.PHONY: bench-serve-layouts
bench-serve-layouts: serve_gpt2 build/serve_load train_gpt2
	dev/bench/bench_serve_layouts.sh

.PHONY: clean-serve
clean: clean-serve
clean-serve:
	rm -f serve_gpt2 serve_gpt2cu serve_gpt2cu_emu
