# Serving (issue 26): the engine (llmc/serve_engine.h, llmc/paged_kv.h) tested without HTTP.
TEST_BINS += build/test_serve_engine
TESTS     += build/test_serve_engine

build/test_serve_engine: dev/test/test_serve_engine.c train_gpt2.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)
