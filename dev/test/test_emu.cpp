/*
 * test_emu.cpp: the emulated GPU (dev/gpu/emu) fails where a GPU would misbehave. Each case
 * is a small CUDA kernel or host program with one defect, run in a child process, and the
 * test expects the child to stop with the emulator's line about it (or, for the correct
 * twins, to succeed):
 *   - host code dereferencing device memory (a crash or garbage on a GPU);
 *   - fresh device memory holds 0xFF bytes (NaN floats), never a lucky zero;
 *   - __syncthreads that some threads of the block skip by returning early;
 *   - a warp shuffle whose mask names a lane that has exited;
 *   - with the race check compiled in (test_emu_race): a read of a __shared__ word another
 *     thread wrote with no barrier in between, and a read of a global word another block
 *     wrote in the same launch; the barrier-correct twin passes;
 *   - shuffled thread order: a block sum without its barrier gives different results for
 *     different LLMC_EMU_SEED values, the correct one the same bits for every seed.
 * Built twice by mk/cuda.mk: build/test_emu and build/test_emu_race (kernels instrumented).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "llmc/cuda_common.cuh"

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

// Runs fn in a child process; returns its exit status and what it wrote to stderr in out.
static int in_child(void (*fn)(void), char* out, size_t cap) {
    int pipefd[2];
    if (pipe(pipefd) != 0) { perror("pipe"); exit(2); }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        fn();
        exit(0);
    }
    close(pipefd[1]);
    size_t n = 0;
    ssize_t got;
    while (n + 1 < cap && (got = read(pipefd[0], out + n, cap - 1 - n)) > 0) { n += (size_t)got; }
    out[n] = '\0';
    close(pipefd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void expect_failure(const char* what, void (*fn)(void), const char* message) {
    char out[4096];
    int rc = in_child(fn, out, sizeof(out));
    CHECK(rc != 0 && strstr(out, message) != NULL, "%s: expected a failure saying '%s', got exit %d and: %s", what,
          message, rc, out);
    printf("%-58s %s\n", what, rc != 0 && strstr(out, message) ? "caught" : "NOT CAUGHT");
}

static void expect_success(const char* what, void (*fn)(void)) {
    char out[4096];
    int rc = in_child(fn, out, sizeof(out));
    CHECK(rc == 0, "%s: expected success, got exit %d: %s", what, rc, out);
    printf("%-58s %s\n", what, rc == 0 ? "passes" : "FAILS");
}

// ---- kernels -------------------------------------------------------------------------------

// out[0] = the sum over the threads of (index + salt) through shared memory: every thread
// stores its value, then thread 0 adds them up; `barrier` says whether the stores are ordered
// before the sum. (The salt makes a value left over from an earlier launch a wrong one.)
__global__ void block_sum_kernel(float* out, int barrier, float salt) {
    __shared__ float s[256];
    s[threadIdx.x] = (float)threadIdx.x + salt;
    if (barrier) { __syncthreads(); }
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (unsigned i = 0; i < blockDim.x; i++) { acc += s[i]; }
        out[0] = acc;
    }
}

// threads past `live` return before the barrier the others wait at
__global__ void early_exit_kernel(float* out, int live) {
    __shared__ float s[64];
    if ((int)threadIdx.x >= live) { return; }
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % live];
}

// a full-mask shuffle after lane 31 has left
__global__ void shuffle_exited_kernel(float* out) {
    if (threadIdx.x == 31) { return; }
    out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, (float)threadIdx.x, 1);
}

// every block reads the word block 0 writes (no ordering between blocks)
__global__ void cross_block_kernel(float* data) {
    if (blockIdx.x == 0 && threadIdx.x == 0) { data[0] = 1.0f; }
    if (blockIdx.x == 1 && threadIdx.x == 0) { data[1] = data[0]; }
}

static float* device_floats(size_t n) {
    float* d = NULL;
    cudaCheck(cudaMalloc((void**)&d, n * sizeof(float)));
    return d;
}

static float run_block_sum(int barrier, float salt) {
    float* d = device_floats(1);
    LAUNCH(block_sum_kernel, 1, 256, d, barrier, salt);
    float h;
    cudaCheck(cudaMemcpy(&h, d, sizeof(float), cudaMemcpyDeviceToHost));
    cudaFree(d);
    return h;
}

// ---- the cases -----------------------------------------------------------------------------

static void host_reads_device(void) {
    float* d = device_floats(16);
    volatile float x = d[3];   // a host read of device memory
    (void)x;
}

static void host_writes_device(void) {
    float* d = device_floats(16);
    d[5] = 1.0f;
}

static void early_exit(void) {
    float* d = device_floats(64);
    LAUNCH(early_exit_kernel, 1, 64, d, 40);
}
static void early_exit_none(void) {   // the correct twin: every thread reaches the barrier
    float* d = device_floats(64);
    LAUNCH(early_exit_kernel, 1, 64, d, 64);
}

static void shuffle_exited(void) {
    float* d = device_floats(32);
    LAUNCH(shuffle_exited_kernel, 1, 32, d);
}

static void race_shared(void) { run_block_sum(0, 0.5f); }
static void race_shared_none(void) { run_block_sum(1, 0.5f); }

static void race_blocks(void) {
    float* d = device_floats(2);
    LAUNCH(cross_block_kernel, 2, 32, d);
}

int main(void) {
    // poison: fresh device memory is NaN, not zero
    {
        float* d = device_floats(100);
        float h[100];
        cudaCheck(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
        int nan = 0;
        for (int i = 0; i < 100; i++) { nan += h[i] != h[i]; }
        CHECK(nan == 100, "fresh device memory: %d of 100 floats are NaN", nan);
        printf("%-58s %s\n", "fresh device memory is NaN", nan == 100 ? "yes" : "NO");
        cudaFree(d);
    }
    expect_failure("host code reads device memory", host_reads_device, "host code touched device memory");
    expect_failure("host code writes device memory", host_writes_device, "host code touched device memory");
    expect_failure("threads exit before a __syncthreads others wait at", early_exit, "exited while the others wait");
    expect_success("... every thread at the barrier", early_exit_none);
    expect_failure("full-mask shuffle after a lane exited", shuffle_exited, "exited while lanes of its warp wait");
#if LLMC_EMU_RACE_CHECK
    expect_failure("race check: shared read with no barrier", race_shared, "data race in kernel block_sum_kernel");
    expect_success("race check: ... with the barrier", race_shared_none);
    expect_failure("race check: read of another block's write", race_blocks, "that block 0 wrote");
#else
    (void)race_shared; (void)race_shared_none; (void)race_blocks;
    // shuffled order: the racy sum depends on the seed, the correct one does not
    int racy_differs = 0, correct_same = 1;
    const char* seeds[] = {"1", "2", "3", "4", "5", "6", "7", "8"};
    for (int k = 0; k < 8; k++) {
        setenv("LLMC_EMU_SEED", seeds[k], 1);
        float salt = 0.25f * (float)(k + 1), want = 0.0f;
        for (int i = 0; i < 256; i++) { want += (float)i + salt; }
        float correct = run_block_sum(1, salt), racy = run_block_sum(0, salt + 1000.0f);
        float want_racy = 0.0f;
        for (int i = 0; i < 256; i++) { want_racy += (float)i + salt + 1000.0f; }
        racy_differs += memcmp(&racy, &want_racy, 4) != 0;
        correct_same &= memcmp(&correct, &want, 4) == 0;
    }
    CHECK(racy_differs > 0, "a block sum without its barrier gave the right answer under all 8 shuffles");
    CHECK(correct_same, "the correct block sum changed with the shuffle seed");
    printf("%-58s %d of 8 seeds wrong\n", "shuffled threads: block sum without its barrier", racy_differs);
#endif
    printf(failures ? "%d FAILED\n" : "all emulator checks passed\n", failures);
    return failures ? 1 : 0;
}
