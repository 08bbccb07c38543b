# The test drivers and the trainer under AddressSanitizer + UndefinedBehaviorSanitizer, with
# leak checking (dev/test/test_sanitize.sh). Built apart in build/asan/: -O1 -g, no recovery
# (the first report ends the program with an error).
SAN_FLAGS = -std=c11 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
            $(ARCH) -ffp-contract=off -fno-fast-math -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare \
            -Wno-unused-function -Wno-maybe-uninitialized -D_GNU_SOURCE -I. -fopenmp
SAN_BINS := build/asan/test_canonical build/asan/test_kernels build/asan/test_gpt2 build/asan/testdata \
            build/asan/test_tp_ops build/asan/train_gpt2
TEST_BINS += $(SAN_BINS)
TESTS     += dev/test/test_sanitize.sh

build/asan/%: dev/test/%.c train_gpt2.c $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(SAN_FLAGS) -o $@ $< -lm

# one process, no MPI: every allocation is ours, so a leak report is ours
build/asan/train_gpt2: train_gpt2.c $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(SAN_FLAGS) -o $@ $< -lm
