# Context parallelism (llmc/context_parallel.h): its end-to-end test on 1-8 ranks, and its
# benchmark (per-rank activation memory and step time against T for --cp 1, 2, 4: a table,
# not a test).
TESTS += dev/test/test_cp.sh

.PHONY: bench-cp
bench-cp: train_gpt2
	dev/bench/bench_cp.sh

# fast mode's context parallelism on a GPU (train_gpt2cu; not run here, no GPU): GPT-2 124M's
# shape at T=2048 and 8192, --cp 1 against --cp 2 --cp-mode a2a and ring
.PHONY: bench-fast-cp
bench-fast-cp:
	dev/bench/bench_fast_cp.sh
