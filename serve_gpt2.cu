/*
 * serve_gpt2.cu: serve_gpt2cu, the OpenAI-compatible server on an NVIDIA GPU, the CUDA build of
 * serve_gpt2.c as train_gpt2.cu is train_gpt2.c's: the same server and engine (llmc/serve_engine.h)
 * on the deterministic device kernels of llmc/kernels_det.cuh and kernels_moe_det.cuh (the
 * device set of the kernel contract, llmc/kernels.h, attention_forward_paged included), with the
 * parameters, activations, KV cache and the step's buffers in device memory (memory_device). Every
 * kernel computes its outputs with the CPU set's sequence of floating-point operations, so a
 * request's tokens are serve_gpt2's, bit for bit (dev/test/test_serve_cu.sh checks it on the
 * emulated GPU: `make serve_gpt2cu_emu`). Deterministic mode only: fast mode's bf16 kernels have
 * no paged attention. Across ranks as serve_gpt2 (mpirun -np 2 ./serve_gpt2cu --tp 2, --ep 2,
 * --pp 2, --kvp 2): comm.h stages the collectives on device buffers through host memory (NCCL
 * is not enabled); --kvp's attention runs llmc/kernels_kvp_det.cuh on each rank's stretches.
 */
#include "llmc/kernels_moe_det.cuh"   // the kernel contract's device set (with kernels_det.cuh)
#include "llmc/comm.h"               // the ranks (comm_node_local_rank: which GPU is this rank's)

// This rank's GPU (cuda_common.cuh), or one clear line saying why there is none
static void serve_select_device(const Comm* comm) {
    cudaDeviceProp prop;
    cuda_select_device(comm_node_local_rank(comm), "serve_gpt2cu", "serve_gpt2 serves on the CPU", &prop);
}

#define LLMC_DEVICE_KERNELS
#include "llmc/kernels_kvp_det.cuh"   // --kvp: KV parallelism's decode attention on the device
#define SERVE_MEMORY (&memory_device)
#define SERVE_SELECT_DEVICE(comm) serve_select_device(comm)
#include "serve_gpt2.c"
