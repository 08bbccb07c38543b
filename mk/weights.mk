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
