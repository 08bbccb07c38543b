/*
 * cuda_runtime.h (emulated): the part of CUDA that the deterministic path of train_gpt2.cu
 * uses, on the CPU, so that `make train_gpt2cu_emu` builds and runs the CUDA trainer's real
 * kernels, launch configurations and host orchestration with g++ and no GPU.
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
 *    through gcc's -fsanitize=kernel-address hooks), a read of a word that another thread of
 *    the block wrote since the last barrier that orders them, or that another block wrote in
 *    the same launch, stops the run naming the kernel, the threads and the address.
 * What it cannot show: speed, real concurrency between blocks, the fast path (cuBLASLt,
 * tensor cores, cuDNN, NCCL: compiled out of this build).
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
    cudaErrorLaunchFailure = 719
} cudaError_t;
typedef cudaError_t cudaError;
typedef enum {
    cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4
} cudaMemcpyKind;
typedef struct EmuStream* cudaStream_t;
typedef struct EmuEvent* cudaEvent_t;
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
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

// 1 if p points into the emulated device's memory (what cudaPointerGetAttributes tells).
int emu_is_device_pointer(const void* p);

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

// CUDA's device min/max for the integer types the kernels use
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long min(long a, long b) { return a < b ? a : b; }
static inline long max(long a, long b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

// ---- launches -------------------------------------------------------------------------------
void emu_run_kernel(const char* name, dim3 grid, dim3 block, void (*body)(void*), void* closure);

// LAUNCH(kernel, grid, block, args...) in llmc/cuda_common.cuh expands to this: each thread
// of each block calls the kernel with copies of the arguments.
template <typename F> static inline void emu_launch(const char* name, dim3 grid, dim3 block, F body) {
    emu_run_kernel(name, grid, block, [](void* f) { (*(F*)f)(); }, &body);
}

#endif // LLMC_EMU_CUDA_RUNTIME_H
