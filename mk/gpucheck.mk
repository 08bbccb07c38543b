# dev/gpu/check.sh (the GPU check a session with a GPU runs: see its header) and its dry run
# without a GPU, dev/test/test_gpu_check.sh: the emulated CUDA trainer and ./train_gpt2 stand
# in for train_gpt2cu; the check must pass clean and FAIL on a corrupted loss, a 'nan' norm,
# missing real tokens, an off fast-mode loss and a budget too small. Needs tiny Shakespeare
# (make data, offline from ../shared/data) and mpirun for its multi-rank stage.
TESTS     += dev/test/test_gpu_check.sh
TEST_BINS += train_gpt2cu_emu build/testdata
