# Variable-length sequences (--varlen, llmc/dataloader.h): the independent reference program
# and the end-to-end test (fixed-T equivalence, the reference, every layout against one rank).
build/test_varlen: dev/test/test_varlen.c train_gpt2.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)
TEST_BINS += build/test_varlen
TESTS += dev/test/test_varlen.sh

# FlexSP's planner on its cost model (llmc/varlen_flexsp.h), with GLPK where it is installed
FLEXSP_GLPK := $(if $(wildcard /usr/include/glpk.h),-DHAVE_GLPK,)
FLEXSP_LIBS := $(if $(wildcard /usr/include/glpk.h),-lglpk,)
dev/tools/flexsp_plan: dev/tools/flexsp_plan.c $(LLMC_HEADERS)
	$(CC) $(CFLAGS) $(FLEXSP_GLPK) -o $@ $< $(FLEXSP_LIBS) -lm
build/test_flexsp: dev/test/test_flexsp.c $(LLMC_HEADERS) | build
	$(CC) $(TEST_CFLAGS) $(FLEXSP_GLPK) -o $@ $< $(FLEXSP_LIBS) -lm
TEST_BINS += build/test_flexsp dev/tools/flexsp_plan
TESTS += build/test_flexsp

# FlexSP's per-sequence gradient exchange (llmc/flexsp.h), built like train_gpt2, on 1-4 ranks
build/test_flexsp_exchange: dev/test/test_flexsp_exchange.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(TEST_CFLAGS) $(TRAIN_CFLAGS) $(FLEXSP_GLPK) -o $@ $< $(FLEXSP_LIBS) $(LDLIBS)
TEST_BINS += build/test_flexsp_exchange
TESTS += dev/test/test_flexsp_exchange.sh

# FlexSP's all-to-all bandwidth per group size (a table for make bench-flexsp), built like train_gpt2
build/bench_flexsp_a2a: dev/bench/bench_flexsp_a2a.c $(LLMC_HEADERS) | build
	$(TRAIN_CC) $(CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)

.PHONY: bench-flexsp
bench-flexsp: train_gpt2 build/bench_flexsp_a2a
	dev/bench/bench_flexsp.sh

.PHONY: clean-varlen
clean: clean-varlen
clean-varlen:
	rm -f dev/tools/flexsp_plan
