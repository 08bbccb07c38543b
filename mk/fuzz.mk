# Fuzzing the parsers of hostile files (dev/fuzz/), and the end-to-end bad-input test.
#
#   make fuzz           a bounded libFuzzer campaign: FUZZ_SECONDS (default 60) per target, from
#                       the seeds and the corpus of earlier campaigns (build/fuzz/corpus/TARGET);
#                       a crash leaves its input in build/fuzz/crashes/TARGET/ and fails the make
#   make test           replays every target's seeds (build/fuzz/make_seeds) and regression inputs
#                       once (dev/fuzz/replay.sh), and runs dev/test/test_inputs.sh. A crash a
#                       campaign finds goes, once fixed, to dev/fuzz/regressions/TARGET/ named
#                       ok-* (must be accepted) or bad-* (must be rejected with one error line)
#
# The targets are built with clang's libFuzzer, ASan and UBSan (Debian: clang and
# libclang-rt-dev). Without them `make test` builds the rest and replay.sh fails with a line
# saying what to install. Knob: FUZZ_CC=clang-NN.
FUZZ_CC ?= clang
FUZZ_TARGETS := model state tokens tokenizer safetensors bpe bpe_roundtrip
FUZZ_CFLAGS = -std=c11 -g -O1 -D_GNU_SOURCE -I. -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare \
              -Wno-unused-function -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
FUZZ_SECONDS ?= 60
FUZZ_BINS  := $(FUZZ_TARGETS:%=build/fuzz/fuzz_%)
FUZZ_SEEDS := build/fuzz/seeds/.done

# libFuzzer's runtime ships with clang (Debian: libclang-rt-NN-dev): found, or not, by its file
HAVE_FUZZ := $(if $(wildcard $(shell $(FUZZ_CC) -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null)),1)

TESTS += dev/fuzz/replay.sh dev/test/test_inputs.sh
TEST_BINS += build/testdata
ifeq ($(HAVE_FUZZ),1)
TEST_BINS += $(FUZZ_BINS) $(FUZZ_SEEDS)
endif

FUZZ_HEADERS := $(wildcard dev/fuzz/*.h) dev/tools/safetensors.h
build/fuzz/fuzz_%: dev/fuzz/fuzz_%.c $(FUZZ_HEADERS) $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ $< -lm

build/fuzz/make_seeds: dev/fuzz/make_seeds.c $(FUZZ_HEADERS) $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -Wno-unused-function -o $@ $< $(LDLIBS)

# the seeds are rewritten whole, so none of an older make_seeds survives
$(FUZZ_SEEDS): build/fuzz/make_seeds
	rm -rf build/fuzz/seeds
	build/fuzz/make_seeds build/fuzz/seeds
	touch $@

.PHONY: fuzz
fuzz: $(FUZZ_BINS) $(FUZZ_SEEDS)
	@fails=""; \
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus/$$t build/fuzz/crashes/$$t; \
	  echo "== fuzz_$$t: $(FUZZ_SECONDS) s"; \
	  build/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=10 -close_fd_mask=3 \
	      -artifact_prefix=build/fuzz/crashes/$$t/ build/fuzz/corpus/$$t build/fuzz/seeds/$$t \
	      $$(ls -d dev/fuzz/regressions/$$t 2>/dev/null) 2>build/fuzz/$$t.log \
	    || fails="$$fails $$t"; \
	  grep -E '^(#[0-9]+ +DONE|Done [0-9]+ runs)' build/fuzz/$$t.log | tail -1; \
	done; \
	if [ -n "$$fails" ]; then \
	  echo "fuzzing found failures in:$$fails (inputs in build/fuzz/crashes/, logs in build/fuzz/*.log)"; exit 1; \
	fi; \
	echo "fuzzing found nothing"
