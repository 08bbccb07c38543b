# Variable-length sequences (--varlen, llmc/dataloader.h): the independent reference program
# and the end-to-end test (fixed-T equivalence, the reference, every layout against one rank).
build/test_varlen: dev/test/test_varlen.c train_gpt2.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)
TEST_BINS += build/test_varlen
TESTS += dev/test/test_varlen.sh
