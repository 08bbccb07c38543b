# The sampler's temperature and top-k (llmc/sampler.h) against llm.c's sample_mult and a sorted
# reference.
TEST_BINS += build/test_sampler
TESTS     += build/test_sampler

build/test_sampler: dev/test/test_sampler.c $(LLMC_HEADERS) | build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

# decoding's speed against the machine's streaming read: serving's one-request decode step
# (packed weights, llmc/decode_matmul.h, and row-major) and the trainer's sampler (the KV cache
# and a full forward per token), d12 (a table, not a test)
build/bench_decode: dev/bench/bench_decode.c dev/bench/bench_median.h train_gpt2.c serve_model.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)

.PHONY: bench-sampler
bench-sampler: train_gpt2 build/testdata build/bench_decode
	dev/bench/bench_sampler.sh
