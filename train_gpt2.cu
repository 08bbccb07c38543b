/*
 * train_gpt2.cu: GPT-2 training on NVIDIA GPUs, the CUDA build of train_gpt2.c.
 *
 * The same trainer: the shared engine (llmc/engine.h: flags, data, the pipeline executor,
 * validation, sampling, checkpoints, the loop and its output), ZeRO (llmc/zero.h) and the
 * communicator (llmc/comm.h) with their buffers in device memory (memory_device,
 * llmc/kernels_det.cuh). Two modes, chosen at run time:
 *
 *   --deterministic 1   train_gpt2.c's model itself (included below) on the deterministic
 *                       device kernels of llmc/kernels_det.cuh, the device set of the kernel
 *                       contract (llmc/kernels.h): the CPU kernels' names and arguments, every
 *                       output computed with their sequence of floating-point operations
 *                       (llmc/canonical.h): every logged loss, lr and norm, the samples and the
 *                       checkpoint bytes are train_gpt2's, in every layout (DP, ZeRO, TP, SP,
 *                       CP, PP, and EP for mixture-of-experts models).
 *   fast (the default)  bf16 weights and activations with fp32 master weights, gradients and
 *                       AdamW state; cuBLASLt tensor-core matmuls, flash attention, fused
 *                       kernels (train_gpt2_fast.cu, its own translation unit). It follows the
 *                       reference within bf16 precision (dev/gpu/check.sh states the tolerances).
 *
 * One GPU per rank under mpirun (the rank's index on its node selects the device; more ranks
 * than GPUs share them). `make train_gpt2cu_emu` builds this file and train_gpt2_fast.cu with g++
 * on the CPU emulation of CUDA in dev/gpu/emu: both modes, end to end, with no GPU (fast mode
 * there runs the flash kernels on the cuBLASLt stand-in; the emulator has no cuDNN).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/kernels_moe_det.cuh"   // the kernel contract's device set (with kernels_det.cuh)
#define LLMC_DEVICE_KERNELS
#include "train_gpt2.c"   // the model, on the kernels above (and the engine it includes)
#include "llmc/gpt2_fast.h"

// What the banner and the step line say about the device.
static cudaDeviceProp device_prop;
static int device_index, device_deterministic;
static double device_peak_tflops;
static const char* device_peak_name;
static const char* fast_attention = "";   // fast mode: which attention runs
static const char* transport_name = "mpi";  // --comm, as chosen

static void cuda_banner(void) {
    printf("| train_gpt2cu (%s mode)\n", device_deterministic
           ? "deterministic: fp32, canonical arithmetic, bit-exact with train_gpt2"
           : "fast: bf16, cuBLASLt, flash attention");
    printf("| GPU           %s, compute capability %d.%d, %d SMs, %.1f GiB (rank 0: device %d)\n", device_prop.name,
           device_prop.major, device_prop.minor, device_prop.multiProcessorCount,
           device_prop.totalGlobalMem / 1073741824.0, device_index);
    printf("| MFU peak      %s\n", device_peak_name);
    printf("| transport     %s (device buffers between ranks)\n", transport_name);
    if (!device_deterministic) { printf("| attention     %s\n", fast_attention); }
}

static void cuda_memory_line(void) {
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    printf("| GPU memory    %.2f GiB allocated by rank 0, %.2f GiB of %.1f GiB in use on its GPU\n",
           device_bytes_allocated / 1073741824.0, (total_b - free_b) / 1073741824.0, total_b / 1073741824.0);
    if (!device_deterministic) { printf("| bf16 weights  %s\n", gpt2_fast_weights_line()); }
}

static void cuda_throughput(char* out, size_t len, double flops_per_second) {
    if (device_peak_tflops > 0) {
        snprintf(out, len, "MFU %.1f%%", 100.0 * flops_per_second / (device_peak_tflops * 1e12));
    } else {
        snprintf(out, len, "%.2f TFLOP/s", flops_per_second / 1e12);
    }
}

static void cuda_summary_throughput(char* out, size_t len, double flops_per_second) {
    snprintf(out, len, "%.2f TFLOP/s", flops_per_second / 1e12);
    if (device_peak_tflops > 0) {
        size_t n = strlen(out);
        snprintf(out + n, len - n, " = MFU %.1f%% of the %s", 100.0 * flops_per_second / (device_peak_tflops * 1e12),
                 device_peak_name);
    }
}

// How ranks exchange device buffers (--comm): NCCL needs a GPU per rank (it refuses two ranks
// on one device); otherwise MPI staging through host memory, which the emulated build always
// uses. A group of one rank exchanges nothing.
static void choose_transport(Trainer* t) {
    const char* want = t->args.comm;
    int count = 1;
    cudaCheck(cudaGetDeviceCount(&count));
    float shares = comm_node_local_rank(&t->comm) >= count ? 1.0f : 0.0f;   // this rank shares a GPU
    comm_all_reduce_max(&t->comm.world, &shares, 1, COMM_KIND_OTHER);
#ifdef USE_NCCL
    if (strcmp(want, "nccl") == 0 && shares > 0.0f) {
        fatal("--comm nccl: ranks of this job share a GPU (%d per node here), which NCCL refuses; use --comm mpi "
              "or one rank per GPU", count);
    }
    if (strcmp(want, "mpi") != 0 && shares == 0.0f && t->comm.world_size > 1) {
        comm_enable_nccl(&t->comm);
        transport_name = "nccl";
    }
#else
    if (strcmp(want, "nccl") == 0) {
        fatal("--comm nccl: this build has no NCCL (%s); use --comm mpi",
#ifdef LLMC_CUDA_EMU
              "the emulated GPU runs over MPI only"
#else
              "nccl.h and libnccl were not found when it was built, or MPI was not"
#endif
              );
    }
#endif
}

#ifdef LLMC_CUDA_EMU
static void emu_fatal(const char* message) { fatal("%s", message); }
#endif

#ifndef TESTING
int main(int argc, char** argv) {
    Trainer t;
    if (!trainer_begin(&t, argc, argv)) { return 0; }
    int det = t.args.deterministic;
    device_deterministic = det;
#ifdef LLMC_CUDA_EMU
    emu_fatal_hook = emu_fatal;
#endif
    if (!det && t.args.varlen) {
        fatal("--varlen: fast mode trains fixed windows of -t tokens only (each sequence length would be a new "
              "attention plan); run --varlen with --deterministic 1");
    }
    if (!det && t.args.cp > 1) {   // fast mode's context parallelism (ring or a2a), with data parallelism and ZeRO
        if (t.args.tp > 1) {
            fatal("--cp with --tp: fast mode runs context parallelism without tensor parallelism; run --cp %d --tp %d "
                  "with --deterministic 1", t.args.cp, t.args.tp);
        }
        if (t.args.pp > 1) {
            fatal("--cp with --pp: fast mode runs context parallelism on one pipeline stage only; run --cp %d --pp %d "
                  "with --deterministic 1", t.args.cp, t.args.pp);
        }
        if (t.config.num_experts > 0) {
            fatal("--cp with experts: fast mode runs context parallelism on dense models only; run --cp %d with a "
                  "mixture-of-experts model with --deterministic 1", t.args.cp);
        }
        if (strcmp(t.args.attention, "cudnn") == 0) {
            fatal("--attention cudnn with --cp: fast mode's context parallelism runs the flash kernels on each "
                  "rank's heads; use --attention flash or auto");
        }
        t.args.attention = "flash";   // (auto: cuDNN would be chosen for the whole training shape)
    }
    // this rank's GPU (its index among the ranks of its node, modulo the GPUs there)
    device_index = cuda_select_device(comm_node_local_rank(&t.comm), "train_gpt2cu", "train_gpt2 trains on the CPU", &device_prop);
    choose_transport(&t);
    device_peak_tflops = gpu_peak_tflops(device_prop.major, device_prop.minor, device_prop.name, det, &device_peak_name);
    char err[256];
    int genT = t.args.sample_every > 0 ? (t.args.gen_T < t.config.max_seq_len ? t.args.gen_T : t.config.max_seq_len) : 0;
    const char* problem = gpu_launch_problem(&t.config, t.B, t.T, det, genT, err, sizeof(err));
    if (problem) { fatal("-e/-b/-t: %s", problem); }
    const ModelOps* ops = &gpt2_model_ops;
    if (!det) {
        fast_attention = gpt2_fast_setup(t.args.attention, &t.config, t.B, t.T, genT);
        ops = gpt2_fast_model_ops();
    }
    trainer_build(&t, ops, &memory_device);
    BuildInfo build = {"train_gpt2cu", cuda_banner, cuda_memory_line, cuda_throughput, cuda_summary_throughput};
    trainer_run(&t, &build);
    trainer_end(&t);
    if (!det) { gpt2_fast_teardown(); }
    return 0;
}
#endif
