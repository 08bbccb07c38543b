# KV parallelism for decode attention (llmc/kv_parallel.h, Helix's KVP), its test, its layout
# model and its benchmark.
#
# build/test_kv_parallel is built like train_gpt2 (mpicc -DUSE_MPI when mpicc exists) and run on
# 1, 2, 4 and 8 ranks (and 4 and 8 as KVP x TP 2) by dev/test/test_kv_parallel.sh.
TEST_BINS += build/test_kv_parallel
TESTS     += dev/test/test_kv_parallel.sh

build/test_kv_parallel: dev/test/test_kv_parallel.c train_gpt2.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)

# The layout model (a table for the README, not a test): DeepSeek-R1-sized MoE on 16 H100s, TP,
# EP and Helix's KVP x TP at 128K and 1M tokens of context.
.PHONY: serve-layout-model
build/serve_layout_model: dev/tools/serve_layout_model.c | build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)
serve-layout-model: build/serve_layout_model
	build/serve_layout_model

# The benchmark (dev/bench, not make test): one layer's decode attention per KVP size.
.PHONY: bench-kvp
build/bench_kv_parallel: dev/bench/bench_kv_parallel.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)
bench-kvp: build/bench_kv_parallel
	dev/bench/bench_kv_parallel.sh
