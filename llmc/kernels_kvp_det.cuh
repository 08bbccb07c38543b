/*
 * kernels_kvp_det.cuh: the device twins of KV parallelism's decode attention kernels
 * (llmc/kv_parallel.h: kvp_scores, kvp_exps, kvp_values, whose CPU loops are there), so that
 * serve_gpt2cu serves --kvp with its cache on the GPU: the same names and arguments, each
 * output computed by one thread with kv_parallel.h's per-output functions (a score; a (row,
 * head)'s exps and its subtree of Z; an output channel's subtree of the weighted values), so
 * the bits are the CPU's. Include it with LLMC_DEVICE_KERNELS defined (serve_gpt2.cu), which
 * leaves the CPU loops out of kv_parallel.h.
 */
#ifndef LLMC_KERNELS_KVP_DET_CUH
#define LLMC_KERNELS_KVP_DET_CUH

#ifndef LLMC_DEVICE_KERNELS
#error "kernels_kvp_det.cuh: define LLMC_DEVICE_KERNELS first (kv_parallel.h then leaves its CPU loops out)"
#endif
#include "llmc/kernels_det.cuh"
#include "llmc/kv_parallel.h"

// one thread per (row, head, local position): its score, the rank's keys at positions <= pos[r]
static __global__ void kvp_scores_kernel(KVPLayout lay, float* scores, const float* q, long q_stride, const float* kv,
                                         long block_stride, const int* tables, int max_blocks, const int* pos, int N,
                                         float scale) {
    size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    int local_len = lay.T / lay.P, l = (int)(idx % local_len), h = (int)(idx / local_len % lay.NHl);
    int r = (int)(idx / local_len / lay.NHl);
    if (r >= N || l >= canon_zz_count_le(pos[r], lay.T, lay.P, lay.rank)) { return; }
    const float* k = kvp_row(kv, block_stride, tables + (size_t)r * max_blocks, l, lay.bs, lay.Cl) + h * lay.hs;
    scores[idx] = canon_dot(q + r * q_stride + h * lay.hs, 1, k, 1, lay.hs) * scale;
}

// one thread per (row, head): the max of its scores, in position order as the CPU's loop
static __global__ void kvp_max_kernel(KVPLayout lay, float* maxes, const float* scores, const int* pos, int N) {
    int rh = blockIdx.x * blockDim.x + threadIdx.x;
    if (rh >= N * lay.NHl) { return; }
    const float* s = scores + (size_t)rh * (lay.T / lay.P);
    float m = -canon_inf();
    for (int l = 0, n = canon_zz_count_le(pos[rh / lay.NHl], lay.T, lay.P, lay.rank); l < n; l++) {
        if (s[l] > m) { m = s[l]; }
    }
    maxes[rh] = m;
}

static void kvp_scores(const KVPLayout* lay, float* scores, float* maxes, const float* q, long q_stride,
                       const float* kv, long block_stride, const int* tables, int max_blocks, const int* pos, int N) {
    size_t n = (size_t)N * lay->NHl * (lay->T / lay->P);
    LAUNCH(kvp_scores_kernel, ceil_div_u(n, 256), 256, *lay, scores, q, q_stride, kv, block_stride, tables, max_blocks,
           pos, N, canon_rsqrtf((float)lay->hs));
    cudaLaunchCheck("kvp_scores_kernel");
    LAUNCH(kvp_max_kernel, ceil_div_u((size_t)N * lay->NHl, 128), 128, *lay, maxes, (const float*)scores, pos, N);
    cudaLaunchCheck("kvp_max_kernel");
}

// one thread per (row, head): its exps in place, its subtree of Z
static __global__ void kvp_exps_kernel(KVPLayout lay, float* scores, float* zsum, const float* maxes, const int* pos,
                                       int N) {
    int rh = blockIdx.x * blockDim.x + threadIdx.x;
    if (rh >= N * lay.NHl) { return; }
    zsum[rh] = kvp_exps_zsum(scores + (size_t)rh * (lay.T / lay.P), maxes[rh], pos[rh / lay.NHl], lay.T, lay.P,
                             lay.rank);
}

static void kvp_exps(const KVPLayout* lay, float* scores, float* zsum, const float* maxes, const int* pos, int N) {
    LAUNCH(kvp_exps_kernel, ceil_div_u((size_t)N * lay->NHl, 128), 128, *lay, scores, zsum, maxes, pos, N);
    cudaLaunchCheck("kvp_exps_kernel");
}

// one thread per (row, channel of this rank's heads): its subtree of the weighted values
static __global__ void kvp_values_kernel(KVPLayout lay, float* partials, const float* scores, const float* zsum,
                                         const float* kv, long block_stride, const int* tables, int max_blocks,
                                         const int* pos, int N) {
    size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    int c = (int)(idx % lay.Cl), r = (int)(idx / lay.Cl);
    if (r >= N) { return; }
    size_t rh = (size_t)r * lay.NHl + c / lay.hs;
    partials[kvp_partial_at(lay.combine, lay.P, N, lay.Cl, r, c)] =
        kvp_value(scores + rh * (lay.T / lay.P), zsum[rh], pos[r], lay.T, lay.P, lay.rank, kv, block_stride,
                  tables + (size_t)r * max_blocks, lay.bs, lay.Cl, lay.Cl + c);
}

static void kvp_values(const KVPLayout* lay, float* partials, const float* scores, const float* zsum, const float* kv,
                       long block_stride, const int* tables, int max_blocks, const int* pos, int N) {
    LAUNCH(kvp_values_kernel, ceil_div_u((size_t)N * lay->Cl, 128), 128, *lay, partials, scores, zsum, kv, block_stride,
           tables, max_blocks, pos, N);
    cudaLaunchCheck("kvp_values_kernel");
}

#endif // LLMC_KERNELS_KVP_DET_CUH
