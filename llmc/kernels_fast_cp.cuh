/*
 * kernels_fast_cp.cuh: context parallelism in fast mode (--cp N --cp-mode a2a), the bf16 form of
 * context_parallel.h's all-to-all (Ulysses) layout, on its buffers (ContextParallel: the group,
 * `parts` for the exchanges, `gather` for the gathers along T).
 *
 * THE LAYOUT is deterministic mode's (zigzag.h): a training pass holds this rank's zig-zag slice
 * of every sequence, T/N positions, and everything outside attention is per position on it.
 *
 * ATTENTION. An all-to-all (cp group) turns the sequence-split bf16 q|k|v (B,T/N,3C) into
 * head-split ones (B,T,3C/N): every position of the sequence, this rank's NH/N heads. The flash
 * kernels (attention_flash.cuh) run unchanged on those heads and whole sequences, and an
 * all-to-all (cp group) turns the bf16 output (B,T,C/N) back into this rank's positions of every
 * head. The backward likewise: d out to the heads, the flash backward, d q|k|v back. A head's
 * arithmetic is the one-rank arithmetic (the heads are independent), so attention's output and
 * input gradients are one rank's bits. The head-split q|k|v and output are activations (kept for
 * the backward, with the flash statistics (B,NH/N,T), fp32). Per layer and microbatch a rank
 * sends 8 (N-1)/N blocks of B (T/N) C bf16 elements (forward: 3 of q|k|v, 1 of the output;
 * backward: 1 of d out, 3 of d q|k|v).
 *
 * WHAT CROSSES ELSEWHERE: the per-position losses are all-gathered along T (cp group, fp32) and
 * summed as one rank sums them; the embedding's input gradient is all-gathered along T (cp
 * group, bf16) and the one-rank embedding backward runs on whole sequences, each rank handing
 * ZeRO its part and -0.0f elsewhere (cp_keep_part). Every other weight gradient is this rank's
 * sum over its positions (the cuBLASLt matmul, the exact R3 bias and layernorm kernels on the
 * slice), handed to ZeRO whole: ZeRO reduces over data x context ranks (zero.h, Megatron's
 * grouping), which finishes the sum over positions. That last sum is in another order than one
 * rank's (fast mode is not bit-exact across layouts; dev/test/test_fast_cp.sh states the bound).
 *
 * comm.h moves floats: a bf16 row of w elements (w even: C/N is a multiple of the head size,
 * 16 or more) travels as w/2 floats, half the bytes of the fp32 exchange.
 */
#ifndef LLMC_KERNELS_FAST_CP_CUH
#define LLMC_KERNELS_FAST_CP_CUH

#include "llmc/cuda_common.cuh"
#include "llmc/attention_flash.cuh"
#include "llmc/context_parallel.h"

// out (B,T/N,C) of this rank's positions from their qkv (B,T/N,3C); qkv_h (B,T,3C/N), out_h
// (B,T,C/N) and stats (B,NH/N,T): this rank's heads at every position, kept for the backward.
// (T: the whole sequence; C, NH: this tensor-parallel rank's.)
static void fast_cp_a2a_forward(ContextParallel* cp, floatX* out, float* stats, floatX* qkv_h, floatX* out_h,
                                const floatX* qkv, int B, int T, int C, int NH) {
    int N = cp->N, Cr = C / N, h = Cr / 2, c2 = C / 2;   // h, c2: Cr and C bf16 as floats
    long rows = (long)B * (T / N);
    size_t blk = (size_t)rows * 3 * h, oblk = (size_t)rows * h;   // floats: one rank's positions of one rank's heads
    float *send = cp->parts, *recv = cp->parts + N * blk;
    for (int d = 0; d < N; d++) {
        for (int part = 0; part < 3; part++) {
            copy_rows(send + d * blk + part * h, 3L * h, (const float*)qkv + part * c2 + d * h, 3L * c2, rows, h);
        }
    }
    // all-to-all (cp group, bf16 q|k|v): rank d receives every rank's positions of its heads
    comm_all_to_all(cp->group, send, recv, blk, COMM_KIND_CP);
    zz_reorder(cp->mem, (float*)qkv_h, recv, B, T, 3 * h, N, 0);
    attention_forward_fast(out_h, stats, qkv_h, B, T, Cr, NH / N);
    zz_reorder(cp->mem, (float*)out_h, send, B, T, h, N, 1);
    // all-to-all (cp group, bf16 attention output): rank d receives its positions of every head
    comm_all_to_all(cp->group, send, recv, oblk, COMM_KIND_CP);
    for (int d = 0; d < N; d++) { copy_rows((float*)out + d * h, c2, recv + d * oblk, h, rows, h); }
}

// dqkv (B,T/N,3C) of this rank's positions from dout (B,T/N,C), given the forward's qkv_h, out_h
// and stats; D: (B,NH/N,T) scratch (flash's rowsum(dO * O)).
static void fast_cp_a2a_backward(ContextParallel* cp, floatX* dqkv, const floatX* dout, const floatX* qkv_h,
                                 const floatX* out_h, const float* stats, float* D, int B, int T, int C, int NH) {
    int N = cp->N, Cr = C / N, h = Cr / 2, c2 = C / 2;
    long rows = (long)B * (T / N);
    size_t blk = (size_t)rows * 3 * h, oblk = (size_t)rows * h;
    float *a = cp->parts, *b = cp->parts + N * blk, *dout_h = cp->parts + 2 * N * blk;   // (B,T,Cr) bf16
    for (int d = 0; d < N; d++) { copy_rows(a + d * oblk, h, (const float*)dout + d * h, c2, rows, h); }
    // all-to-all (cp group, bf16 d out): rank d receives every rank's positions of its heads
    comm_all_to_all(cp->group, a, b, oblk, COMM_KIND_CP);
    zz_reorder(cp->mem, dout_h, b, B, T, h, N, 0);
    attention_backward_fast((floatX*)a, (const floatX*)dout_h, qkv_h, out_h, stats, D, B, T, Cr, NH / N);   // dqkv_h (B,T,3Cr)
    zz_reorder(cp->mem, a, b, B, T, 3 * h, N, 1);
    // all-to-all (cp group, bf16 d q|k|v): rank d receives its positions of every head
    comm_all_to_all(cp->group, b, a, blk, COMM_KIND_CP);
    for (int d = 0; d < N; d++) {
        for (int part = 0; part < 3; part++) {
            copy_rows((float*)dqkv + part * c2 + d * h, 3L * c2, a + d * blk + part * h, 3L * h, rows, h);
        }
    }
}

// full (B,T,C) bf16 <- every rank's slice (B,T/N,C): all-gather (cp group, bf16) along T, each
// slice's positions put in place (the embedding's input gradient)
static void fast_cp_gather_sequences(ContextParallel* cp, floatX* full, const floatX* slice, int B, int T, int C) {
    cp_gather_sequences(cp, (const float*)slice, (float*)full, B, T, C / 2);
}

#endif // LLMC_KERNELS_FAST_CP_CUH
