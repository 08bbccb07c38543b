/*
 * cuda_runtime.h (emulated): the part of CUDA that train_gpt2.cu and train_gpt2_fast.cu use,
 * on the CPU, so that `make train_gpt2cu_emu` builds and runs the CUDA trainer's real kernels
 * (both modes), launch configurations and host orchestration with g++ and no GPU.
 *
 * The build puts dev/gpu/emu first on the include path, so the sources' own
 * `#include <cuda_runtime.h>` lands here; they are unchanged except that kernel launches are
 * written LAUNCH(kernel, grid, block, args...) (llmc/cuda_common.cuh: the triple-chevron
 * launch under nvcc, emu_launch here).
 *
 * HOW IT RUNS A KERNEL. Blocks one after another (or spread over OpenMP threads), in a
 * shuffled order; a block's threads as fibers that run until they reach a barrier
 * (__syncthreads, __syncwarp, a warp shuffle), in a shuffled order that changes at every
 * barrier. __shared__ variables are `static thread_local`: one copy per OS thread, which runs
 * one block at a time, so a block's threads share them. Warp shuffles go through a per-warp
 * slot array between two warp barriers. Integer atomics are atomic.
 *
 * HOW IT FAILS (what a GPU would do differently, caught on the CPU):
 *  - device memory is an arena the host cannot read or write: outside a kernel launch,
 *    cudaMemcpy or cudaMemset it is mapped PROT_NONE, so host code that dereferences a device
 *    pointer (a crash or garbage on a real GPU) stops with one line naming the allocation;
 *  - fresh device memory is filled with 0xFF bytes (a NaN in every float, -1 in every int), so
 *    a kernel that reads what nothing wrote produces NaNs instead of a lucky zero;
 *  - blocks and threads run in a seeded shuffled order (LLMC_EMU_SEED, default 1; 0 = in
 *    order), so a missing barrier or an order-dependent sum changes the bits;
 *  - a barrier that not all threads of the block (or of the warp's mask) reach, or a thread
 *    that exits while others wait at a barrier, is reported (on a GPU: a hang or undefined
 *    behaviour);
 *  - with the race check compiled in (emu_race.mk: every memory access of the kernels reported
 *    through gcc's -fsanitize=kernel-address hooks), a read of bytes (tracked in 2-byte
 *    halves: bf16) that another thread of the block wrote since the last barrier that orders
 *    them, or that another block wrote in the same launch, stops the run naming the kernel,
 *    the threads and the address.
 *  - dynamic shared memory (the launch's byte count, LAUNCH_SMEM) is a per-thread buffer ending
 *    at a guard page, filled with 0xFF bytes for each block; a launch above 48 KiB without
 *    cudaFuncSetAttribute(MaxDynamicSharedMemorySize), or above an H100's 227 KiB, fails with
 *    cudaErrorInvalidValue at cudaGetLastError, as on the GPU.
 * Fast mode's pieces: cuda_bf16.h (bf16 bit for bit), ptx_emu.h (cp.async, ldmatrix,
 * mma.sync, ex2.approx for attention_flash.cuh's wrappers), cublasLt.h (a stand-in computing
 * with a reference GEMM kernel).
 * What it cannot show: speed, real concurrency between blocks, tensor-core rounding (its mma
 * adds exact products in fp32 in k order), the approximate intrinsics' last bits (__expf,
 * ex2.approx, rsqrtf are computed exactly rounded), cuDNN, NCCL.
 */
#ifndef LLMC_EMU_CUDA_RUNTIME_H
#define LLMC_EMU_CUDA_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LLMC_CUDA_EMU 1

// ---- qualifiers ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// one copy per OS thread, which runs one block at a time: the block's shared memory
#define __shared__ static thread_local

// ---- vector types ---------------------------------------------------------------------------
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef dim3 uint3;
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { float4 v = {x, y, z, w}; return v; }

// ---- the runtime API ------------------------------------------------------------------------
typedef enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorNoDevice = 100,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719
} cudaError_t;
typedef cudaError_t cudaError;
typedef enum {
    cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4
} cudaMemcpyKind;
typedef struct EmuStream* cudaStream_t;
typedef struct EmuEvent* cudaEvent_t;
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02
typedef enum { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 } cudaFuncAttribute;
typedef struct {
    char name[256];
    int major, minor;
    int multiProcessorCount;
    size_t totalGlobalMem;
} cudaDeviceProp;

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemset(void* p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s = 0);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceReset(void);
cudaError_t cudaGetLastError(void);
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

// 1 if p points into the emulated device's memory (what cudaPointerGetAttributes tells).
int emu_is_device_pointer(const void* p);

// The kernel a launch or cudaFuncSetAttribute names, as a key: a __global__ function (a
// template instance too) or a pointer to one.
template <typename F> static inline const void* emu_kernel_key(F* kernel) { return (const void*)kernel; }
cudaError_t emu_func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value);
template <typename F> static inline cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
    return emu_func_set_attribute(emu_kernel_key(kernel), attr, value);
}

// ---- inside a kernel ------------------------------------------------------------------------
struct EmuThreadState {
    dim3 thread_idx, block_idx, block_dim, grid_dim;
};
extern thread_local EmuThreadState* emu_current;
#define threadIdx (emu_current->thread_idx)
#define blockIdx (emu_current->block_idx)
#define blockDim (emu_current->block_dim)
#define gridDim (emu_current->grid_dim)

void emu_syncthreads(void);
void emu_syncwarp(unsigned mask);
// one value per lane of the warp: writes this lane's, waits for the mask's lanes, reads lane
// src's (a lane outside [0, 32) or outside the mask reads its own), waits again
uint64_t emu_shuffle(unsigned mask, uint64_t mine, int src);
unsigned emu_lane(void);
// every lane of the (full) warp publishes `bytes` (<= 32) of its own; all[lane] gets each
// lane's, between two warp barriers: the warp-wide exchange behind ldmatrix and mma.sync
void emu_warp_exchange(const void* mine, size_t bytes, void* all);
// the block's dynamic shared memory (this launch's size, 0xFF bytes at the block's start)
unsigned char* emu_dynamic_shared(void);
// stops the launch after this thread's next barrier with the message (block and kernel named)
void emu_kernel_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// the calling thread's cp.async queue (ptx_emu.h moves the bytes, in the kernel's own code):
// push one 16-byte copy (src NULL: zero-fill) into the open group; close the group; pop the
// next copy, in issue order, of the groups older than the `newest_pending` most recent closed
// ones (0 when there is none left)
void emu_cp_async_push(void* dst, const void* src);
void emu_cp_async_commit(void);
int emu_cp_async_pop_done(unsigned newest_pending, void** dst, const void** src);
unsigned long long emu_atomic_add_u64(unsigned long long* p, unsigned long long v);
int emu_atomic_add_i32(int* p, int v);

static inline void __syncthreads(void) { emu_syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { emu_syncwarp(mask); }

template <typename V> static inline V emu_shfl(unsigned mask, V v, int src) {
    static_assert(sizeof(V) <= 8, "shuffle of a value wider than 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(V));
    bits = emu_shuffle(mask, bits, src);
    V out;
    memcpy(&out, &bits, sizeof(V));
    return out;
}
template <typename V> static inline V __shfl_sync(unsigned mask, V v, int src, int width = 32) {
    int lane = (int)emu_lane();
    return emu_shfl(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename V> static inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int width = 32) {
    int lane = (int)emu_lane();
    int src = lane ^ lane_mask;
    return emu_shfl(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename V> static inline V __shfl_down_sync(unsigned mask, V v, unsigned delta, int width = 32) {
    int lane = (int)emu_lane();
    int src = lane + (int)delta;
    return emu_shfl(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename V> static inline V __shfl_up_sync(unsigned mask, V v, unsigned delta, int width = 32) {
    int lane = (int)emu_lane();
    int src = lane - (int)delta;
    return emu_shfl(mask, v, src >= (lane & ~(width - 1)) ? src : lane);
}

static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return emu_atomic_add_u64(p, v); }
static inline int atomicAdd(int* p, int v) { return emu_atomic_add_i32(p, v); }

// the device intrinsics fast mode uses: CUDA computes __expf, __log2f, rsqrtf and
// ex2.approx to a few ulp; here they are the C library's (glibc declares __expf and __log2f
// as its internal names without exporting them: these are their definitions)
extern "C" inline float __expf(float x) noexcept { return expf(x); }
extern "C" inline float __log2f(float x) noexcept { return log2f(x); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

// CUDA's device min/max for the integer types the kernels use
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long min(long a, long b) { return a < b ? a : b; }
static inline long max(long a, long b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

// ---- launches -------------------------------------------------------------------------------
void emu_run_kernel(const char* name, const void* kernel, dim3 grid, dim3 block, size_t dynamic_shared,
                    void (*body)(void*), void* closure);

// LAUNCH(kernel, grid, block, args...) and LAUNCH_SMEM(kernel, grid, block, bytes, args...)
// in llmc/cuda_common.cuh expand to this: each thread of each block calls the kernel with
// copies of the arguments.
template <typename F>
static inline void emu_launch(const char* name, const void* kernel, dim3 grid, dim3 block, size_t dynamic_shared,
                              F body) {
    emu_run_kernel(name, kernel, grid, block, dynamic_shared, [](void* f) { (*(F*)f)(); }, &body);
}

#endif // LLMC_EMU_CUDA_RUNTIME_H
