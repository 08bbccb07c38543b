# Mixture of experts and expert parallelism (llmc/moe.h, llmc/expert_parallel.h): the
# end-to-end test, one rank against every expert-parallel layout (dev/test/test_moe.sh; the
# gradient check is test_gpt2's, the kernels test_kernels' and test_cuda_kernels_emu's).
TESTS += dev/test/test_moe.sh
# experts with context parallelism (ring, a2a; x DP, EP, TP, PP), against one rank
TESTS += dev/test/test_moe_cp.sh

# the benchmark: d4 dense against d4 with 8 experts top 2 (a table, not a test)
.PHONY: bench-moe
bench-moe: train_gpt2
	dev/bench/bench_moe.sh

# F, B, W and F&B under dualpipev with experts (a table, not a test)
.PHONY: bench-moe-pipeline
bench-moe-pipeline: train_gpt2 build/testdata
	dev/bench/bench_moe_pipeline.sh
