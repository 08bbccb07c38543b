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
 * What fast mode needs (dev/gpu/emu/cuda_bf16.h, ptx_emu.h):
 *   - bf16 conversions bit for bit: round to nearest even (ties both ways, the carry into the
 *     exponent and to infinity), subnormals, signed zero, every NaN to 0x7FFF; the intrinsics;
 *     streams and events created with flags, cudaEventQuery;
 *   - dynamic shared memory: NaN for every block; a launch above 48 KiB without the kernel's
 *     cudaFuncSetAttribute, or above 227 KiB, refused with cudaErrorInvalidValue as on an
 *     H100 (per kernel, per template instance); an access past the launch's size stops the
 *     run; with the race check, a read of another thread's write with no barrier;
 *   - cp.async: zero-fill, wait_group N leaving the N newest groups in flight, NaN where the
 *     wait is missing, a race where the barrier after it is missing;
 *   - ldmatrix (.x4, .trans) + mma.sync m16n8k16 through attention_flash.cuh's fragment
 *     helpers: a 16x16x16 product bit-identical to a k-ordered fp32 triple loop; a row
 *     address that is not 16-byte aligned is reported.
 * Built twice by mk/cuda.mk: build/test_emu and build/test_emu_race (kernels instrumented).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "llmc/cuda_common.cuh"
#include "llmc/attention_flash.cuh"

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

// ---- fast mode's kernels' building blocks ----------------------------------------------------

// out[b, t] = the block's dynamic shared word t before the block writes it; then writes it
__global__ void dynamic_poison_kernel(float* out) {
    DYNAMIC_SHARED(smem);
    float* f = reinterpret_cast<float*>(smem);
    out[blockIdx.x * blockDim.x + threadIdx.x] = f[threadIdx.x];
    __syncthreads();
    f[threadIdx.x] = 1.0f;
}

// touches the first word only: how much dynamic shared memory it gets is the launch's business
template <int INSTANCE> __global__ void dynamic_size_kernel(float* out) {
    DYNAMIC_SHARED(smem);
    float* f = reinterpret_cast<float*>(smem);
    f[0] = (float)INSTANCE;
    out[0] = f[0];
}

// writes one float past the end of `bytes` of dynamic shared memory
__global__ void dynamic_overrun_kernel(int bytes) {
    DYNAMIC_SHARED(smem);
    reinterpret_cast<float*>(smem + bytes)[0] = 1.0f;
}

// block_sum_kernel's defect, in dynamic shared memory
__global__ void dynamic_sum_kernel(float* out, int barrier) {
    DYNAMIC_SHARED(smem);
    float* f = reinterpret_cast<float*>(smem);
    f[threadIdx.x] = (float)threadIdx.x;
    if (barrier) { __syncthreads(); }
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (unsigned i = 0; i < blockDim.x; i++) { acc += f[i]; }
        out[0] = acc;
    }
}

// Thread t copies in[4t..4t+3] to its 16-byte chunk of shared memory by cp.async (every fifth
// chunk zero-filled), then reads the chunk of thread t+1 into out[4t..]. mode 0: correct; 1:
// no wait; 2: no barrier after the wait. mode 3: two groups, read back by the thread itself
// after wait_group 1 (out) and after wait_group 0 (out + 4 * blockDim.x).
__global__ void cp_async_kernel(float* out, const float* in, int mode) {
    DYNAMIC_SHARED(smem);
    float* chunks = reinterpret_cast<float*>(smem);
    unsigned t = threadIdx.x, n = blockDim.x;
    if (mode == 3) {
        cp_async16(chunks + 4 * t, in + 4 * t, true);
        cp_async_commit();
        cp_async16(chunks + 4 * (n + t), in + 4 * (n + t), true);
        cp_async_commit();
        cp_async_wait<1>();
        for (int i = 0; i < 4; i++) {
            out[4 * t + i] = chunks[4 * t + i];
            out[4 * (n + t) + i] = chunks[4 * (n + t) + i];
        }
        cp_async_wait<0>();
        for (int i = 0; i < 4; i++) { out[4 * (2 * n + t) + i] = chunks[4 * (n + t) + i]; }
        return;
    }
    cp_async16(chunks + 4 * t, in + 4 * t, t % 5 != 0);
    cp_async_commit();
    if (mode != 1) { cp_async_wait<0>(); }
    if (mode != 2) { __syncthreads(); }
    unsigned next = (t + 1) % n;
    for (int i = 0; i < 4; i++) { out[4 * t + i] = chunks[4 * next + i]; }
}

// One warp: C1 = A . Bnk^T and C2 = A . Bkn (16 x 16 each, two 16x8 C tiles) from bf16 tiles in
// shared memory, through attention_flash.cuh's fragment helpers (ldmatrix .x4 / .x4.trans and
// mma.sync m16n8k16). in: A, Bnk ([n][k]), Bkn ([k][n]), each 16 x 16 row-major.
__global__ void mma_tile_kernel(float* c1, float* c2, const floatX* in) {
    __shared__ __align__(16) floatX tiles[3][16 * FaTile<16>::PITCH];
    for (int i = threadIdx.x; i < 3 * 256; i += 32) {
        tiles[i / 256][(i % 256) / 16 * FaTile<16>::PITCH + i % 16] = in[i];
    }
    __syncthreads();
    uint32_t a[4], bnk[4], bkn[4];
    fa_frag_a<16>(a, tiles[0], 0, 0);
    fa_frag_b_nk<16>(bnk, tiles[1], 0, 0);
    fa_frag_b_kn<16>(bkn, tiles[2], 0, 0);
    float acc1[2][4] = {{0}}, acc2[2][4] = {{0}};
    mma_16816(acc1[0], a, bnk[0], bnk[1]);
    mma_16816(acc1[1], a, bnk[2], bnk[3]);
    mma_16816(acc2[0], a, bkn[0], bkn[1]);
    mma_16816(acc2[1], a, bkn[2], bkn[3]);
    int group = threadIdx.x / 4, tig = threadIdx.x % 4;
    for (int nt = 0; nt < 2; nt++) {
        for (int e = 0; e < 4; e++) {
            int row = group + (e >> 1) * 8, col = nt * 8 + 2 * tig + (e & 1);
            c1[row * 16 + col] = acc1[nt][e];
            c2[row * 16 + col] = acc2[nt][e];
        }
    }
}

// ldmatrix with lane 5's row address one element off its 16-byte boundary
__global__ void ldmatrix_misaligned_kernel(float* out) {
    __shared__ __align__(16) floatX tile[16 * FaTile<16>::PITCH];
    for (int i = threadIdx.x; i < 16 * FaTile<16>::PITCH; i += 32) { tile[i] = __float2bfloat16_rn(1.0f); }
    __syncthreads();
    uint32_t r[4];
    ldmatrix_x4(r, tile + threadIdx.x % 8 * FaTile<16>::PITCH + (threadIdx.x == 5));
    out[threadIdx.x] = (float)r[0];
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

static void dynamic_overrun(void) { LAUNCH_SMEM(dynamic_overrun_kernel, 1, 1, 256, 256); }
static void race_dynamic(void) {
    float* d = device_floats(1);
    LAUNCH_SMEM(dynamic_sum_kernel, 1, 128, 128 * sizeof(float), d, 0);
}
static void race_dynamic_none(void) {
    float* d = device_floats(1);
    LAUNCH_SMEM(dynamic_sum_kernel, 1, 128, 128 * sizeof(float), d, 1);
}
static void ldmatrix_misaligned(void) {
    float* d = device_floats(32);
    LAUNCH(ldmatrix_misaligned_kernel, 1, 32, d);
}

#define CP_THREADS 64
// runs cp_async_kernel in `mode` on in[i] = i + 1; returns the output (3 x 4 x CP_THREADS floats)
static float* run_cp_async(int mode) {
    static float h[3 * 4 * CP_THREADS];
    float in[2 * 4 * CP_THREADS];
    for (int i = 0; i < 2 * 4 * CP_THREADS; i++) { in[i] = (float)(i + 1); }
    float *d_in = device_floats(2 * 4 * CP_THREADS), *d_out = device_floats(3 * 4 * CP_THREADS);
    cudaCheck(cudaMemcpy(d_in, in, sizeof(in), cudaMemcpyHostToDevice));
    LAUNCH_SMEM(cp_async_kernel, 1, CP_THREADS, 2 * 4 * CP_THREADS * sizeof(float), d_out, d_in, mode);
    cudaCheck(cudaGetLastError());
    cudaCheck(cudaMemcpy(h, d_out, sizeof(h), cudaMemcpyDeviceToHost));
    cudaFree(d_in);
    cudaFree(d_out);
    return h;
}
static void race_cp_async(void) { run_cp_async(2); }

static uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static void test_bf16(void) {
    // float bits -> the bf16 bits CUDA's __float2bfloat16_rn gives
    static const uint32_t cases[][2] = {
        {0x3F800000u, 0x3F80u}, {0x3F808000u, 0x3F80u} /* tie, even below */, {0x3F818000u, 0x3F82u} /* tie, odd */,
        {0x3F808001u, 0x3F81u}, {0x3F807FFFu, 0x3F80u}, {0xBF818000u, 0xBF82u} /* negative tie */,
        {0x3FFF8000u, 0x4000u} /* carry into the exponent */, {0x7F7FFFFFu, 0x7F80u} /* FLT_MAX to inf */,
        {0x7F800000u, 0x7F80u}, {0xFF800000u, 0xFF80u}, {0x7FC00000u, 0x7FFFu}, {0xFFC00001u, 0x7FFFu},
        {0x7F800001u, 0x7FFFu} /* a signalling NaN stays NaN */, {0x80000000u, 0x8000u},
        {0x00008000u, 0x0000u} /* subnormal tie to even zero */, {0x00018000u, 0x0002u}, {0x00010000u, 0x0001u},
        {0x007FFFFFu, 0x0080u} /* largest subnormal up to the smallest normal */, {0x80018000u, 0x8002u}};
    int bad = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        __nv_bfloat16 h = __float2bfloat16_rn(bits_float(cases[i][0]));
        __nv_bfloat16 h2 = __float2bfloat16(bits_float(cases[i][0]));
        CHECK(h.__x == cases[i][1] && h2.__x == cases[i][1], "bf16 of %08x: %04x, want %04x", cases[i][0], h.__x,
              cases[i][1]);
        bad += h.__x != cases[i][1];
        if (cases[i][1] != 0x7FFFu) {   // back to float: exact
            CHECK(float_bits(__bfloat162float(h)) == cases[i][1] << 16, "float of bf16 %04x", cases[i][1]);
        }
    }
    __nv_bfloat162 pair = __floats2bfloat162_rn(1.0f, -2.0f);
    uint32_t packed = pack_bf16x2(1.0f, -2.0f);
    float2 back = __bfloat1622float2(pair);
    CHECK(pair.x.__x == 0x3F80u && pair.y.__x == 0xC000u && packed == 0xC0003F80u && back.x == 1.0f && back.y == -2.0f,
          "bf16x2: the first value in .x and the low 16 bits");
    CHECK(rsqrtf(0.25f) == 2.0f && __expf(0.0f) == 1.0f && __log2f(8.0f) == 3.0f && fast_exp2(3.0f) == 8.0f &&
          fast_exp2(-INFINITY) == 0.0f && __fmaf_rn(2.0f, 3.0f, 1.0f) == 7.0f, "intrinsics");
    printf("%-58s %s\n", "bf16 rounding (ties, NaN, inf, subnormals), intrinsics", bad ? "WRONG" : "exact");
}

static void test_dynamic_shared(void) {
    float* d = device_floats(256);
    float h[256];
#if !LLMC_EMU_RACE_CHECK   // (the race check reports the second block's read of the first's write)
    LAUNCH_SMEM(dynamic_poison_kernel, 2, 128, 128 * sizeof(float), d);
    cudaCheck(cudaGetLastError());
    cudaCheck(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
    int poisoned = 0;
    for (int i = 0; i < 256; i++) { poisoned += float_bits(h[i]) == 0xFFFFFFFFu; }
    CHECK(poisoned == 256, "dynamic shared memory: %d of 256 words NaN at each block's start", poisoned);
    printf("%-58s %s\n", "dynamic shared memory is NaN for every block", poisoned == 256 ? "yes" : "NO");
#endif
    // the limits, as an H100 applies them
    const int kib = 1024;
    const cudaFuncAttribute max_dynamic = cudaFuncAttributeMaxDynamicSharedMemorySize;
    LAUNCH_SMEM(dynamic_size_kernel<1>, 1, 1, 48 * kib, d);
    cudaError_t at_48 = cudaGetLastError();
    LAUNCH_SMEM(dynamic_size_kernel<1>, 1, 1, 64 * kib, d);
    cudaError_t without = cudaGetLastError();
    int names_attribute = strstr(cudaGetErrorString(without), "cudaFuncSetAttribute") != NULL;
    cudaError_t set64 = cudaFuncSetAttribute(dynamic_size_kernel<1>, max_dynamic, 64 * kib);
    cudaCheck(cudaMemset(d, 0, 4));
    LAUNCH_SMEM(dynamic_size_kernel<1>, 1, 1, 64 * kib, d);
    cudaError_t with = cudaGetLastError();
    cudaCheck(cudaMemcpy(h, d, 4, cudaMemcpyDeviceToHost));
    LAUNCH_SMEM(dynamic_size_kernel<1>, 1, 1, 100 * kib, d);
    cudaError_t above_attribute = cudaGetLastError();
    LAUNCH_SMEM(dynamic_size_kernel<2>, 1, 1, 64 * kib, d);   // another instance: its own attribute
    cudaError_t other_instance = cudaGetLastError();
    cudaError_t set228 = cudaFuncSetAttribute(dynamic_size_kernel<2>, max_dynamic, 228 * kib);
    cudaGetLastError();
    cudaError_t set227 = cudaFuncSetAttribute(dynamic_size_kernel<2>, max_dynamic, 227 * kib);
    LAUNCH_SMEM(dynamic_size_kernel<2>, 1, 1, 227 * kib, d);
    cudaError_t at_227 = cudaGetLastError();
    int ok = at_48 == cudaSuccess && without == cudaErrorInvalidValue && names_attribute && set64 == cudaSuccess &&
             with == cudaSuccess && h[0] == 1.0f && above_attribute == cudaErrorInvalidValue &&
             other_instance == cudaErrorInvalidValue && set228 == cudaErrorInvalidValue && set227 == cudaSuccess &&
             at_227 == cudaSuccess;
    CHECK(ok, "dynamic shared memory limits: 48K %d, 64K without the attribute %d (names it %d), set 64K %d, 64K with "
          "it %d (ran: %g), 100K %d, the other instance %d, set 228K %d, set 227K %d, 227K %d", at_48, without,
          names_attribute, set64, with, h[0], above_attribute, other_instance, set228, set227, at_227);
    printf("%-58s %s\n", "dynamic shared memory limits (48 KiB, attribute, 227 KiB)", ok ? "as an H100" : "WRONG");
    cudaFree(d);
}

// the stream and event calls fast mode makes: on the emulated device every call has finished
// when it returns, so an event is always complete
static void test_streams_events(void) {
    cudaStream_t stream;
    cudaEvent_t event;
    int ok = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
             cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess &&
             cudaEventRecord(event, stream) == cudaSuccess && cudaEventQuery(event) == cudaSuccess &&
             cudaStreamWaitEvent(stream, event, 0) == cudaSuccess && cudaEventDestroy(event) == cudaSuccess &&
             cudaStreamDestroy(stream) == cudaSuccess;
    CHECK(ok, "cudaStreamCreateWithFlags, cudaEventCreateWithFlags, cudaEventQuery");
    printf("%-58s %s\n", "streams and events with flags, cudaEventQuery", ok ? "work" : "FAIL");
}

static void test_cp_async(void) {
    float* h = run_cp_async(0);
    int right = 1;
    for (int t = 0; t < CP_THREADS; t++) {
        int next = (t + 1) % CP_THREADS;
        for (int i = 0; i < 4; i++) { right &= h[4 * t + i] == (next % 5 ? (float)(4 * next + i + 1) : 0.0f); }
    }
    CHECK(right, "cp.async with its wait and barrier: the copied (and zero-filled) chunks");
    h = run_cp_async(3);
    int groups = 1;
    for (int j = 0; j < 4 * CP_THREADS; j++) {
        groups &= h[j] == (float)(j + 1) && float_bits(h[4 * CP_THREADS + j]) == 0xFFFFFFFFu &&
                  h[8 * CP_THREADS + j] == (float)(4 * CP_THREADS + j + 1);
    }
    CHECK(groups, "cp.async.wait_group 1 must complete the older group only, wait_group 0 both");
    h = run_cp_async(1);
    int nan = 0;
    for (int j = 0; j < 4 * CP_THREADS; j++) { nan += h[j] != h[j]; }
    CHECK(nan == 4 * CP_THREADS, "cp.async without its wait: %d of %d values NaN", nan, 4 * CP_THREADS);
    printf("%-58s %s\n", "cp.async: copies, zero-fill, wait_group 1 and 0", right && groups ? "right" : "WRONG");
    printf("%-58s %s\n", "cp.async without its wait reads NaN", nan == 4 * CP_THREADS ? "caught" : "NOT CAUGHT");
}

static void test_mma_tile(void) {
    float in[3 * 256];
    floatX in_bf16[3 * 256];
    uint64_t state = 12345;
    for (int i = 0; i < 3 * 256; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        in_bf16[i] = __float2bfloat16_rn((float)((int)(state >> 40) % 2001 - 1000) / 250.0f);
        in[i] = __bfloat162float(in_bf16[i]);
    }
    floatX* d_in = NULL;
    cudaCheck(cudaMalloc((void**)&d_in, sizeof(in_bf16)));
    cudaCheck(cudaMemcpy(d_in, in_bf16, sizeof(in_bf16), cudaMemcpyHostToDevice));
    float *d_c1 = device_floats(256), *d_c2 = device_floats(256), c1[256], c2[256];
    LAUNCH(mma_tile_kernel, 1, 32, d_c1, d_c2, d_in);
    cudaCheck(cudaMemcpy(c1, d_c1, sizeof(c1), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(c2, d_c2, sizeof(c2), cudaMemcpyDeviceToHost));
    const float *A = in, *Bnk = in + 256, *Bkn = in + 512;
    int wrong = 0;
    for (int r = 0; r < 16; r++) {
        for (int c = 0; c < 16; c++) {
            float want1 = 0.0f, want2 = 0.0f;
            for (int k = 0; k < 16; k++) {
                want1 += A[r * 16 + k] * Bnk[c * 16 + k];
                want2 += A[r * 16 + k] * Bkn[k * 16 + c];
            }
            wrong += float_bits(c1[r * 16 + c]) != float_bits(want1);
            wrong += float_bits(c2[r * 16 + c]) != float_bits(want2);
        }
    }
    CHECK(wrong == 0, "ldmatrix + mma.sync 16x16x16 tiles: %d of 512 elements differ from the triple loop", wrong);
    printf("%-58s %s\n", "ldmatrix (.x4, .trans) + mma.sync m16n8k16 vs a triple loop",
           wrong ? "WRONG" : "bit-identical");
    cudaFree(d_in); cudaFree(d_c1); cudaFree(d_c2);
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
    expect_failure("an access past the dynamic shared memory", dynamic_overrun, "past the end of its dynamic shared");
    expect_failure("ldmatrix with a row address off 16 bytes", ldmatrix_misaligned, "ldmatrix: lane 5's row address");
#if LLMC_EMU_RACE_CHECK
    expect_failure("race check: shared read with no barrier", race_shared, "data race in kernel block_sum_kernel");
    expect_success("race check: ... with the barrier", race_shared_none);
    expect_failure("race check: read of another block's write", race_blocks, "that block 0 wrote");
    expect_failure("race check: dynamic shared read with no barrier", race_dynamic,
                   "data race in kernel dynamic_sum_kernel");
    expect_success("race check: ... with the barrier", race_dynamic_none);
    expect_failure("race check: cp.async data read with no barrier", race_cp_async,
                   "data race in kernel cp_async_kernel");
#endif
    // kernels in this process only after the last child: OpenMP's threads do not survive a fork
    test_bf16();
    test_dynamic_shared();
    test_streams_events();
    test_cp_async();
    test_mma_tile();
#if !LLMC_EMU_RACE_CHECK
    (void)race_shared; (void)race_shared_none; (void)race_blocks; (void)race_dynamic; (void)race_dynamic_none;
    (void)race_cp_async;
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
