# GPT-2 weights: Hugging Face model.safetensors <-> llm.c checkpoint (dev/tools/gpt2_weights),
# and its test (dev/test/test_weights.sh, which drives build/test_weights).
TOOLS     += dev/tools/gpt2_weights
TEST_BINS += build/test_weights
TESTS     += dev/test/test_weights.sh

dev/tools/gpt2_weights: dev/tools/gpt2_weights.c dev/tools/safetensors.h $(LLMC_HEADERS)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

build/test_weights: dev/test/test_weights.c $(LLMC_HEADERS)
	@mkdir -p build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

# An llm.c checkpoint -> GGUF for llama.cpp (dev/tools/export_gguf.c; make bench-llamacpp), and its
# test (dev/test/test_gguf.sh, which reads the file back with build/test_gguf's own parser).
TEST_BINS += build/export_gguf build/test_gguf
TESTS     += dev/test/test_gguf.sh

build/export_gguf: dev/tools/export_gguf.c $(LLMC_HEADERS)
	@mkdir -p build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

build/test_gguf: dev/test/test_gguf.c
	@mkdir -p build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

# llama.cpp (npm's node-llama-cpp, installed into build/llamacpp) beside our decoder, one request on
# d12, fp32 and f16/bf16 (a table, not a test; without npm one line and nothing else)
.PHONY: bench-llamacpp
bench-llamacpp: train_gpt2 build/export_gguf build/bench_decode
	dev/bench/bench_llamacpp.sh
