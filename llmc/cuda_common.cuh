/*
 * cuda_common.cuh: what every CUDA file of the trainer needs: error checks that end the
 * program with one clear line (utils.h fatal), kernel launches that the emulated build can
 * run on the CPU, device memory with a running total, warp helpers, and (not in the emulated
 * build) the bf16 storage type of fast mode.
 */
#ifndef LLMC_CUDA_COMMON_CUH
#define LLMC_CUDA_COMMON_CUH

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include "llmc/utils.h"
#include "llmc/gpu_plan.h"

static inline void cuda_check_(cudaError_t err, const char* what, const char* file, int line) {
    if (err != cudaSuccess) {
        fatal("CUDA error in %s (%s:%d): %s", what, file, line, cudaGetErrorString(err));
    }
}
#define cudaCheck(call) cuda_check_((call), #call, __FILE__, __LINE__)
// after a kernel launch: a bad configuration is reported here, a fault at the next sync
#define cudaLaunchCheck(name) cuda_check_(cudaGetLastError(), name, __FILE__, __LINE__)

// Kernel launches are written LAUNCH(kernel, grid, block, args...): the triple-chevron launch
// under nvcc; in the emulated build (dev/gpu/emu, g++) every thread of every block calls the
// kernel with copies of the arguments, on the CPU. `kernel` may be a pointer to a __global__
// function (a template instance chosen at run time). LAUNCH_SMEM also gives the bytes of
// dynamic shared memory, which the kernel declares with DYNAMIC_SHARED(name) (16-byte aligned).
#ifdef LLMC_CUDA_EMU
void emu_label(const void* p, const char* what);
extern void (*emu_fatal_hook)(const char* message);
#define LAUNCH_SMEM(kernel, grid, block, smem_bytes, ...) \
    emu_launch(#kernel, emu_kernel_key(kernel), grid, block, smem_bytes, [=]() { kernel(__VA_ARGS__); })
#define DYNAMIC_SHARED(name) unsigned char* name = emu_dynamic_shared()
#else
#define LAUNCH_SMEM(kernel, grid, block, smem_bytes, ...) kernel<<<grid, block, smem_bytes>>>(__VA_ARGS__)
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif
#define LAUNCH(kernel, grid, block, ...) LAUNCH_SMEM(kernel, grid, block, 0, __VA_ARGS__)

// ceil_div_u and elementwise_blocks (the grids of the elementwise kernels) are in gpu_plan.h,
// where the host test checks them

// --- the device ---------------------------------------------------------------------------

// This rank's GPU: its node-local rank modulo the GPUs there (one GPU a rank under mpirun; more
// ranks than GPUs share them), set as the current device, its properties in *prop; returns its
// index. Without a usable one, one clear line naming the program and what its CPU twin does
// (program "train_gpt2cu", cpu_twin "train_gpt2 trains on the CPU").
static inline int cuda_select_device(int node_local_rank, const char* program, const char* cpu_twin,
                                     cudaDeviceProp* prop) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        fatal("no CUDA GPU available (%s): %s needs an NVIDIA GPU and its driver; %s", err != cudaSuccess ?
              cudaGetErrorString(err) : "no device", program, cpu_twin);
    }
    int device = node_local_rank % count;
    cudaCheck(cudaSetDevice(device));
    cudaCheck(cudaGetDeviceProperties(prop, device));
    if (prop->major < 8) {
        fatal("GPU '%s' has compute capability %d.%d; %s needs 8.0 or newer (Ampere, Hopper)", prop->name, prop->major,
              prop->minor, program);
    }
    return device;
}

// --- device memory ------------------------------------------------------------------------

// bytes allocated on the device by this process (both translation units of the CUDA build)
inline size_t device_bytes_allocated = 0;

static inline void* device_alloc(size_t bytes, const char* what) {
    void* p = NULL;
    if (bytes == 0) { return NULL; }
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        fatal("out of GPU memory allocating %.2f GiB for %s (%.2f GiB allocated so far, %.2f GiB "
              "free of %.2f): lower -b, use -r 1, or shard with -z / --tp / --pp", bytes / 1073741824.0, what,
              device_bytes_allocated / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0);
    }
#ifdef LLMC_CUDA_EMU
    emu_label(p, what);
#endif
    device_bytes_allocated += (bytes + 255) / 256 * 256;
    return p;
}

static inline void device_free(void* p) { if (p) { cudaCheck(cudaFree(p)); } }

// 1 if p is device memory (what a CUDA-aware MPI asks the driver before it stages a buffer)
static inline int device_holds(const void* p) {
#ifdef LLMC_CUDA_EMU
    return emu_is_device_pointer(p);
#else
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) { cudaGetLastError(); return 0; }
    return attr.type == cudaMemoryTypeDevice;
#endif
}

// --- warp helpers -------------------------------------------------------------------------
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) { v += __shfl_xor_sync(FULL_MASK, v, o); }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) { v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o)); }
    return v;
}

// --- fast mode's bf16 (the emulated build's cuda_bf16.h is dev/gpu/emu's) ------------------
#include <cuda_bf16.h>

// fast mode's storage type for weights and activations (fp32 master weights in AdamW)
typedef __nv_bfloat16 floatX;

// 8 bf16 in 16 bytes: the unit of vectorized loads and stores in fast-mode kernels
struct alignas(16) bf16x8 {
    __nv_bfloat162 h[4];
};

__device__ __forceinline__ void bf16x8_to_float(const bf16x8& v, float f[8]) {
    for (int i = 0; i < 4; i++) {
        float2 t = __bfloat1622float2(v.h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ bf16x8 float_to_bf16x8(const float f[8]) {
    bf16x8 v;
    for (int i = 0; i < 4; i++) { v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]); }
    return v;
}

#endif // LLMC_CUDA_COMMON_CUH
