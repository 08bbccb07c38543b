# The sampler's temperature and top-k (llmc/sampler.h) against llm.c's sample_mult and a sorted
# reference.
TEST_BINS += build/test_sampler
TESTS     += build/test_sampler

build/test_sampler: dev/test/test_sampler.c $(LLMC_HEADERS) | build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

# the sampler's speed: the KV cache against a full forward per token, d12 (a table, not a test)
.PHONY: bench-sampler
bench-sampler: train_gpt2 build/testdata
	dev/bench/bench_sampler.sh
