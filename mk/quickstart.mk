# The quick start's GPU twin and the quick start's test.
#
#   make train_gpu    scripts/quickstart.sh gpu: `make train` on one GPU with ./train_gpt2cu (fast
#                     bf16 mode; QUICKSTART_ARGS="--deterministic 1" for the bit-exact one). The
#                     script checks for a GPU before it builds train_gpt2cu or downloads anything.
#
# dev/test/test_quickstart.sh runs the quick start with the download forced to fail (the one
# offline line, the fallback run), and the sha256 check of the weights on local files.
.PHONY: train_gpu
train_gpu: dev/tools/gpt2_weights dev/tools/plot_log data
	scripts/quickstart.sh gpu

TESTS += dev/test/test_quickstart.sh
