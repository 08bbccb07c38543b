# Fast mode's MFU per layout (DP, TP 2, PP 2 1f1b with 8 microbatches, CP 2 at T=8192, the
# experts d12e8k2 with EP 2; GPT-2 124M and 350M at T=1024): a table, not a test. On a GPU
# machine it runs ./train_gpt2cu (build it first: make train_gpt2cu); elsewhere the emulated
# twin on a tiny model, only to prove the script runs (dev/bench/bench_fast_mfu.sh says so).
.PHONY: bench-fast-mfu
bench-fast-mfu: build/testdata
	dev/bench/bench_fast_mfu.sh
