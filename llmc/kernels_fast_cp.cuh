/*
 * kernels_fast_cp.cuh: context parallelism in fast mode (--cp N, --cp-mode a2a or ring), the
 * bf16 form of context_parallel.h's all-to-all (Ulysses) layout on its buffers (ContextParallel:
 * the group, `parts` for the exchanges, `gather` for the gathers along T), and a ring of bf16
 * K|V blocks with log-sum-exp merging (the second half of this file, its own buffers).
 *
 * THE LAYOUT is deterministic mode's (zigzag.h): a training pass holds this rank's zig-zag slice
 * of every sequence, T/N positions, and everything outside attention is per position on it.
 * Under --tp K (C, NH below: the tp rank's C/K channels and NH/K heads) the tp collectives run
 * on the slice's rows, and with --sp 1 the residual stream holds this rank's slice of the
 * slice (the (c*K + k)-th of N*K zig-zag slices). An expert layer runs on whole sequences
 * (every rank of the group the one-rank layer; fast_take_slice keeps this rank's positions).
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

// slice (B,T/D,width) bf16 <- rank r's positions of whole sequences (B,T,width) that every rank
// holds complete (a mixture-of-experts layer's output and input gradient, its router's output
// gradient; zigzag.h's D-way slice: D = N with CP, K with SP). No exchange.
static void fast_take_slice(const MemOps* mem, floatX* slice, const floatX* whole, int B, int T, int width, int D,
                            int r) {
    size_t stretch = (size_t)T / (2 * D), Tl = (size_t)T / D;
    for (int b = 0; b < B; b++) {
        for (int half = 0; half < 2; half++) {
            mem->copy(slice + ((size_t)b * Tl + half * stretch) * width,
                      whole + ((size_t)b * T + zz_stretch_begin(T, D, r, half)) * width, stretch * width * sizeof(floatX));
        }
    }
}

// ------------------------------------------------------------------------------------------
// the ring (--cp-mode ring)
//
// Queries stay; the bf16 K|V of every rank's slice (a block of B (T/N) positions, k and v side
// by side) travel around the group (rank r sends to r+1, receives from r-1, the next block in
// flight while the kernels work on the one in hand). Forward, per block: this rank's queries
// against the block's keys under the causal mask of their global positions (zigzag.h) give the
// block's partial output and log-sum-exp (base 2, as the flash kernels keep it), fp32; the merge
// folds them into the running output and log-sum-exp (the rescaling by 2^(lse_block - lse)),
// fp32, and the output is rounded to bf16 once at the end. The global log-sum-exp is the flash
// statistics the backward reads. Backward, per block (K|V around again): dq accumulates in
// fp32 from P = 2^(s - lse) with the global lse and D = rowsum(dO * O); this rank's dk|dv
// partials of the block's keys (fp32) go to the block's owner, who sums the N ranks' partials in
// rank order (R1) and rounds once. Per layer and microbatch a rank sends 2 (N-1) bf16 blocks
// forward, 2 (N-1) bf16 blocks and (N-1) fp32 dk|dv pairs backward.
//
// The block kernels are the naive loops (one thread per query row, or per key row for dk|dv),
// not tensor-core tiles: correct and order-fixed, not tuned. P stays fp32 (the flash kernels
// round it to bf16 for the P V product), so the ring is within fast mode's bf16 tolerance of
// one rank, not its bits.

// global position of row t of rank r's slice (zigzag.h: stretch r, then stretch 2N-1-r)
__device__ __forceinline__ int ring_global_pos(int t, int T, int N, int r) {
    int stretch = T / (2 * N);
    return t < stretch ? r * stretch + t : (2 * N - 1 - r) * stretch + (t - stretch);
}

// o_blk (B,Tq,C) fp32, lse_blk (B,NH,Tq): queries of rank r (qkv (B,Tq,3C)) against block s's
// keys and values (kv (B,Tq,2C)), causal by global position; a row that sees no key of the
// block gets lse -inf and output 0. The naive loop: online softmax over the block's keys.
template <int HS>
__global__ void ring_block_forward_kernel(float* o_blk, float* lse_blk, const floatX* qkv, const floatX* kv, int B,
                                          int T, int NH, int N, int r, int s, float scale_log2) {
    int Tq = T / N, C = NH * HS;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)B * NH * Tq) { return; }
    int t = (int)(idx % Tq), h = (int)(idx / Tq % NH), b = (int)(idx / Tq / NH);
    int qpos = ring_global_pos(t, T, N, r);
    const floatX* qrow = qkv + ((long)b * Tq + t) * 3 * C + h * HS;
    float q[HS], o[HS];
    for (int d = 0; d < HS; d++) { q[d] = __bfloat162float(qrow[d]); o[d] = 0.0f; }
    float m = -INFINITY, l = 0.0f;
    for (int j = 0; j < Tq; j++) {
        if (ring_global_pos(j, T, N, s) > qpos) { continue; }
        const floatX* krow = kv + ((long)b * Tq + j) * 2 * C + h * HS;
        float sc = 0.0f;
        for (int d = 0; d < HS; d++) { sc = __fmaf_rn(q[d], __bfloat162float(krow[d]), sc); }
        sc = sc * scale_log2;
        float mnew = fmaxf(m, sc), corr = exp2f(m - mnew), p = exp2f(sc - mnew);
        l = l * corr + p;
        for (int d = 0; d < HS; d++) { o[d] = __fmaf_rn(p, __bfloat162float(krow[C + d]), o[d] * corr); }
        m = mnew;
    }
    float* orow = o_blk + ((long)b * Tq + t) * C + h * HS;
    for (int d = 0; d < HS; d++) { orow[d] = l > 0.0f ? o[d] / l : 0.0f; }
    lse_blk[idx] = l > 0.0f ? m + log2f(l) : -INFINITY;
}

// The merge: (o_acc, lse_acc) <- the log-sum-exp combination of themselves and a block's
// (o_blk, lse_blk), one thread per (b, h, t): lse = log2(2^lse_acc + 2^lse_blk), o = (o_acc
// 2^lse_acc + o_blk 2^lse_blk) / 2^lse, computed relative to their max.
template <int HS>
__global__ void ring_merge_kernel(float* o_acc, float* lse_acc, const float* o_blk, const float* lse_blk, int B, int Tq,
                                  int NH) {
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)B * NH * Tq) { return; }
    float a = lse_acc[idx], c = lse_blk[idx], mx = fmaxf(a, c);
    if (mx == -INFINITY) { return; }
    float wa = exp2f(a - mx), wc = exp2f(c - mx), ws = wa + wc;
    int t = (int)(idx % Tq), h = (int)(idx / Tq % NH), b = (int)(idx / Tq / NH), C = NH * HS;
    long row = ((long)b * Tq + t) * C + h * HS;
    for (int d = 0; d < HS; d++) { o_acc[row + d] = (o_acc[row + d] * wa + o_blk[row + d] * wc) / ws; }
    lse_acc[idx] = mx + log2f(ws);
}

// dq_acc (B,Tq,C) fp32 += this rank's queries' gradient from block s: P = 2^(s2 - lse),
// dP = dO v, dS = P (dP - D), dq += dS k scale, D = rowsum(dO * O) (out: the forward's bf16
// output), one thread per query row.
template <int HS>
__global__ void ring_block_dq_kernel(float* dq_acc, const floatX* dout, const floatX* out, const floatX* qkv,
                                     const floatX* kv, const float* lse, int B, int T, int NH, int N, int r, int s,
                                     float scale_log2, float scale) {
    int Tq = T / N, C = NH * HS;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)B * NH * Tq) { return; }
    int t = (int)(idx % Tq), h = (int)(idx / Tq % NH), b = (int)(idx / Tq / NH);
    int qpos = ring_global_pos(t, T, N, r);
    long row = (long)b * Tq + t;
    float q[HS], dy[HS], dq[HS], D = 0.0f;
    for (int d = 0; d < HS; d++) {
        q[d] = __bfloat162float(qkv[row * 3 * C + h * HS + d]);
        dy[d] = __bfloat162float(dout[row * C + h * HS + d]);
        D = __fmaf_rn(dy[d], __bfloat162float(out[row * C + h * HS + d]), D);
        dq[d] = 0.0f;
    }
    for (int j = 0; j < Tq; j++) {
        if (ring_global_pos(j, T, N, s) > qpos) { continue; }
        const floatX* krow = kv + ((long)b * Tq + j) * 2 * C + h * HS;
        float sc = 0.0f, dp = 0.0f;
        for (int d = 0; d < HS; d++) {
            sc = __fmaf_rn(q[d], __bfloat162float(krow[d]), sc);
            dp = __fmaf_rn(dy[d], __bfloat162float(krow[C + d]), dp);
        }
        float ds = exp2f(sc * scale_log2 - lse[idx]) * (dp - D);
        for (int d = 0; d < HS; d++) { dq[d] = __fmaf_rn(ds, __bfloat162float(krow[d]), dq[d]); }
    }
    for (int d = 0; d < HS; d++) { dq_acc[row * C + h * HS + d] += dq[d] * scale; }
}

// dkv (B,Tq,2C) fp32: this rank's partials of block s's dk | dv over its queries, one thread
// per key row j: dk = sum over visible queries of dS q scale, dv = sum of P dO.
template <int HS>
__global__ void ring_block_dkv_kernel(float* dkv, const floatX* dout, const floatX* out, const floatX* qkv,
                                      const floatX* kv, const float* lse, int B, int T, int NH, int N, int r, int s,
                                      float scale_log2, float scale) {
    int Tq = T / N, C = NH * HS;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)B * NH * Tq) { return; }
    int j = (int)(idx % Tq), h = (int)(idx / Tq % NH), b = (int)(idx / Tq / NH);
    int kpos = ring_global_pos(j, T, N, s);
    const floatX* krow = kv + ((long)b * Tq + j) * 2 * C + h * HS;
    float k[HS], v[HS], dk[HS], dv[HS];
    for (int d = 0; d < HS; d++) {
        k[d] = __bfloat162float(krow[d]);
        v[d] = __bfloat162float(krow[C + d]);
        dk[d] = dv[d] = 0.0f;
    }
    for (int t = 0; t < Tq; t++) {
        if (kpos > ring_global_pos(t, T, N, r)) { continue; }
        long row = (long)b * Tq + t;
        const floatX* qrow = qkv + row * 3 * C + h * HS;
        const floatX* dyrow = dout + row * C + h * HS;
        const floatX* yrow = out + row * C + h * HS;
        float sc = 0.0f, dp = 0.0f, D = 0.0f;
        for (int d = 0; d < HS; d++) {
            float dy = __bfloat162float(dyrow[d]);
            sc = __fmaf_rn(__bfloat162float(qrow[d]), k[d], sc);
            dp = __fmaf_rn(dy, v[d], dp);
            D = __fmaf_rn(dy, __bfloat162float(yrow[d]), D);
        }
        float p = exp2f(sc * scale_log2 - lse[((long)b * NH + h) * Tq + t]), ds = p * (dp - D);
        for (int d = 0; d < HS; d++) {
            dk[d] = __fmaf_rn(ds, __bfloat162float(qrow[d]), dk[d]);
            dv[d] = __fmaf_rn(p, __bfloat162float(dyrow[d]), dv[d]);
        }
    }
    float* drow = dkv + ((long)b * Tq + j) * 2 * C + h * HS;
    for (int d = 0; d < HS; d++) {
        drow[d] = dk[d] * scale;
        drow[C + d] = dv[d];
    }
}

// dst rows (bf16, stride ldd) <- width fp32 values of each of `rows` src rows (stride lds), rounded
__global__ void ring_round_rows_kernel(floatX* dst, long ldd, const float* src, long lds, long rows, int width) {
    size_t n = (size_t)rows * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t row = i / width, col = i % width;
        dst[row * ldd + col] = __float2bfloat16_rn(src[row * lds + col]);
    }
}
static void ring_round_rows(floatX* dst, long ldd, const float* src, long lds, long rows, int width) {
    LAUNCH(ring_round_rows_kernel, elementwise_blocks((size_t)rows * width, 256), 256, dst, ldd, src, lds, rows, width);
    cudaLaunchCheck("ring_round_rows_kernel");
}

// The ring's buffers for passes of up to (B, T) positions, C channels and NH heads (this
// rank's), in the model's memory: rows = B T/N.
typedef struct {
    floatX* kv[2];     // the K|V block in hand and the next one (rows, 2C) bf16
    float* o_acc;      // (rows, C) the running output, fp32; the backward's dq
    float* o_blk;      // (rows, C) a block's partial output
    float* lse_blk;    // (B, NH, T/N) a block's log-sum-exp
    float* dkv;        // (N, rows, 2C) this rank's dk|dv partials of every block
    float* dkv_in;     // (N, rows, 2C) the partials of this rank's block from every rank
    float* dkv_sum;    // (rows, 2C) their sum
} FastRing;

static void fast_ring_init(FastRing* R, const MemOps* mem, int N, int B, int T, int C, int NH) {
    size_t rows = (size_t)B * (T / N);
    R->kv[0] = (floatX*)mem->alloc(sizeof(floatX) * rows * 2 * C, "context parallelism (K/V blocks)");
    R->kv[1] = (floatX*)mem->alloc(sizeof(floatX) * rows * 2 * C, "context parallelism (K/V blocks)");
    R->o_acc = mem_floats(mem, rows * C, "context parallelism (ring)");
    R->o_blk = mem_floats(mem, rows * C, "context parallelism (ring)");
    R->lse_blk = mem_floats(mem, rows * NH, "context parallelism (ring)");
    R->dkv = mem_floats(mem, N * rows * 2 * C, "context parallelism (dK/dV partials)");
    R->dkv_in = mem_floats(mem, N * rows * 2 * C, "context parallelism (dK/dV partials)");
    R->dkv_sum = mem_floats(mem, rows * 2 * C, "context parallelism (dK/dV partials)");
}
static void fast_ring_free(FastRing* R, const MemOps* mem) {
    void* all[] = {R->kv[0], R->kv[1], R->o_acc, R->o_blk, R->lse_blk, R->dkv, R->dkv_in, R->dkv_sum};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) { mem->release(all[i]); }
}

// One pass around the ring: block (rank - i) mod N is in kv[i % 2] at step i (this rank's own
// first, packed from qkv's k|v columns); fn(ctx, block, s) computes on it while the isend of it
// to the next rank and the irecv of the following block from the previous rank (cp group, bf16
// K|V) are in flight.
typedef void (*FastRingFn)(void* ctx, const floatX* block, int s);
static void fast_ring_pass(ContextParallel* cp, FastRing* R, const floatX* qkv, int B, int T, int C, int tag,
                           FastRingFn fn, void* ctx) {
    int N = cp->N, r = cp->rank, next = (r + 1) % N, prev = (r + N - 1) % N;
    long rows = (long)B * (T / N);
    size_t n = (size_t)rows * C;   // floats: a (rows, 2C) bf16 block
    copy_rows((float*)R->kv[0], C, (const float*)qkv + C / 2, 3L * C / 2, rows, C);
    CommRequest *send = NULL, *recv = NULL;
    for (int i = 0; i < N; i++) {
        floatX* cur = R->kv[i % 2];
        comm_wait(recv);   // block i has landed in cur
        recv = NULL;
        comm_wait(send);   // kv[(i + 1) % 2] was sent at step i - 1: free again
        send = NULL;
        if (i < N - 1) {
            recv = comm_irecv(cp->group, (float*)R->kv[(i + 1) % 2], n, prev, tag + i, COMM_KIND_CP);
            send = comm_isend(cp->group, (const float*)cur, n, next, tag + i, COMM_KIND_CP);
        }
        fn(ctx, cur, (r - i + N) % N);
    }
    comm_wait(send);
}

typedef struct {
    ContextParallel* cp;
    FastRing* R;
    float* lse;                   // (B,NH,T/N) the global log-sum-exp (the forward writes it)
    const floatX *qkv, *dout, *out;
    int B, T, C, NH;
    CommRequest** sends;          // the backward's dk|dv partials on their way to each block's owner
} FastRingCtx;

#define RING_HS_SWITCH(HS_VAR, CALL)                                                              \
    switch (HS_VAR) {                                                                             \
        case 16: { constexpr int HS = 16; CALL; } break;                                          \
        case 32: { constexpr int HS = 32; CALL; } break;                                          \
        case 64: { constexpr int HS = 64; CALL; } break;                                          \
        default: fatal("fast-mode attention supports head sizes 16, 32 and 64, not %d", HS_VAR);  \
    }

static void fast_ring_fwd_block(void* v, const floatX* kv, int s) {
    FastRingCtx* x = (FastRingCtx*)v;
    int N = x->cp->N, r = x->cp->rank, hs = x->C / x->NH;
    long n = (long)x->B * x->NH * (x->T / N);
    float scale_log2 = FA_LOG2E / sqrtf((float)hs);
    RING_HS_SWITCH(hs, {
        LAUNCH(ring_block_forward_kernel<HS>, ceil_div_u(n, 128), 128, x->R->o_blk, x->R->lse_blk, x->qkv, kv, x->B, x->T,
               x->NH, N, r, s, scale_log2);
        cudaLaunchCheck("ring_block_forward_kernel");
        LAUNCH(ring_merge_kernel<HS>, ceil_div_u(n, 256), 256, x->R->o_acc, x->lse, x->R->o_blk, x->R->lse_blk, x->B,
               x->T / N, x->NH);
        cudaLaunchCheck("ring_merge_kernel");
    });
}

// out (B,T/N,C) bf16 and lse (B,NH,T/N) (the flash statistics, base 2) of this rank's queries
// (qkv (B,T/N,3C); T: the whole sequence).
static void fast_cp_ring_forward(ContextParallel* cp, FastRing* R, floatX* out, float* lse, const floatX* qkv, int B,
                                 int T, int C, int NH) {
    long rows = (long)B * (T / cp->N);
    cp->mem->fill(R->o_acc, 0.0f, (size_t)rows * C);
    cp->mem->fill(lse, -INFINITY, (size_t)rows * NH);
    FastRingCtx x = {cp, R, lse, qkv, NULL, NULL, B, T, C, NH, NULL};
    fast_ring_pass(cp, R, qkv, B, T, C, CP_TAG_K, fast_ring_fwd_block, &x);
    ring_round_rows(out, C, R->o_acc, C, rows, C);
}

// dq's share of block s, and this rank's dk|dv partials of block s's keys, on their way to the
// block's owner at once (isend, cp group, fp32; this rank's own: straight into its slot of dkv_in)
static void fast_ring_bwd_block(void* v, const floatX* kv, int s) {
    FastRingCtx* x = (FastRingCtx*)v;
    ContextParallel* cp = x->cp;
    int N = cp->N, r = cp->rank, hs = x->C / x->NH;
    long n = (long)x->B * x->NH * (x->T / N);
    size_t blk = (size_t)x->B * (x->T / N) * 2 * x->C;
    float scale = 1.0f / sqrtf((float)hs), scale_log2 = FA_LOG2E * scale;
    float* mine = s == r ? x->R->dkv_in + r * blk : x->R->dkv + s * blk;
    RING_HS_SWITCH(hs, {
        LAUNCH(ring_block_dq_kernel<HS>, ceil_div_u(n, 128), 128, x->R->o_acc, x->dout, x->out, x->qkv, kv, x->lse, x->B,
               x->T, x->NH, N, r, s, scale_log2, scale);
        cudaLaunchCheck("ring_block_dq_kernel");
        LAUNCH(ring_block_dkv_kernel<HS>, ceil_div_u(n, 128), 128, mine, x->dout, x->out, x->qkv, kv, x->lse, x->B,
               x->T, x->NH, N, r, s, scale_log2, scale);
        cudaLaunchCheck("ring_block_dkv_kernel");
    });
    if (s != r) { x->sends[s] = comm_isend(cp->group, mine, blk, s, CP_TAG_DKV, COMM_KIND_CP); }
}

// dqkv (B,T/N,3C) bf16 of this rank's positions from dout (B,T/N,C), given the forward's out
// and lse.
static void fast_cp_ring_backward(ContextParallel* cp, FastRing* R, floatX* dqkv, const floatX* dout,
                                  const floatX* qkv, const floatX* out, const float* lse, int B, int T, int C, int NH) {
    int N = cp->N, r = cp->rank;
    long rows = (long)B * (T / N);
    size_t blk = (size_t)rows * 2 * C;
    CommRequest* send[CANON_R] = {NULL};
    CommRequest* recv[CANON_R] = {NULL};
    // every other rank's dk|dv partials of this rank's keys land in slot (their rank) of
    // dkv_in: irecv (cp group, fp32) posted before the pass, so no send waits for its receive
    for (int q = 0; q < N; q++) {
        if (q != r) { recv[q] = comm_irecv(cp->group, R->dkv_in + q * blk, blk, q, CP_TAG_DKV, COMM_KIND_CP); }
    }
    cp->mem->fill(R->o_acc, 0.0f, (size_t)rows * C);   // dq
    FastRingCtx x = {cp, R, (float*)lse, qkv, dout, out, B, T, C, NH, send};
    fast_ring_pass(cp, R, qkv, B, T, C, CP_TAG_BK, fast_ring_bwd_block, &x);
    ring_round_rows(dqkv, 3L * C, R->o_acc, C, rows, C);
    comm_wait_all(recv, N);
    cp->mem->tree_rows(R->dkv_in, blk, N, R->dkv_sum);   // R1 over the ranks' partials
    ring_round_rows(dqkv + C, 3L * C, R->dkv_sum, 2 * C, rows, 2 * C);
    comm_wait_all(send, N);
}

#endif // LLMC_KERNELS_FAST_CP_CUH
