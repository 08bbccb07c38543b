# Context parallelism (llmc/context_parallel.h): its end-to-end test on 1-8 ranks, and its
# benchmark (per-rank activation memory and step time against T for --cp 1, 2, 4: a table,
# not a test).
TESTS += dev/test/test_cp.sh

.PHONY: bench-cp
bench-cp: train_gpt2
	dev/bench/bench_cp.sh
