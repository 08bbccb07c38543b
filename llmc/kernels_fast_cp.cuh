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
// by side) travel around the group (context_parallel.h's cp_ring_pass: rank r sends to r+1,
// receives from r-1, the next block in flight while the kernels work on the one in hand).
//
// THE BLOCKS ARE FLASH PROBLEMS. In zig-zag order (zigzag.h: rank r holds stretches r and
// 2N-1-r of T/2N = S positions) rank r's queries against block s's keys are one of three
// shapes, in the slice's rows t (queries) and j (keys):
//   s == r, the diagonal: causal, j <= t (the slice's order is the global order);
//   s < r: every query sees block s's low stretch and none of its high one: j < S;
//   s > r: the high stretch's queries see every key, the low stretch's none: t >= S;
// each a FaMask of attention_flash.cuh, so the flash kernels (tensor-core tiles, cp.async,
// the online softmax) run them unchanged, in fp32 outputs: the block's partial output,
// normalized by its own sum, and its log-sum-exp (base 2, as the flash statistics). Under the
// causal mask each rank does the same work: the diagonal and N-1 half blocks.
//
// Forward: block r comes first in every pass and writes the running output and log-sum-exp;
// every later block's partial is merged into them (ring_merge_kernel: the rescaling by
// 2^(lse_block - lse), fp32), and the output is rounded to bf16 once at the end. The global
// log-sum-exp is the flash statistics the backward reads. Backward (K|V around again): D =
// rowsum(dO * O) once from the bf16 output; per block the flash backward with the global
// statistics adds the block's share to dq (fp32; block r writes it first) and gives this
// rank's dk|dv partials of the block's keys (fp32), which go to the block's owner, who sums the
// N ranks' partials in rank order (R1) and rounds once. What is fp32: the partial and running
// outputs, every log-sum-exp, D, dq, the dk|dv partials and their sum; P and dS are rounded to
// bf16 for their products exactly as one rank's flash kernels round them. The blocks' order
// and the merge are other arithmetic than one rank's, so the ring is within fast mode's bf16
// tolerance of one rank, not its bits. Per layer and microbatch a rank sends 2 (N-1) bf16
// blocks forward, 2 (N-1) bf16 blocks and (N-1) fp32 dk|dv pairs backward.

// rank r's queries (qkv (B,T/N,3C)) against block s's keys and values (kv (B,T/N,2C)); T: the
// whole sequence
static FaProblem ring_block_problem(const floatX* qkv, const floatX* kv, int T, int C, int NH, int N, int r, int s) {
    int Tq = T / N, S = Tq / 2;
    FaMask mask = s == r ? FaMask{0, Tq, 1} : s < r ? FaMask{0, S, 0} : FaMask{S, Tq, 0};
    return FaProblem{qkv, kv, kv + C, 3L * C, 2L * C, Tq, NH, mask};
}

// (o, lse) <- the log-sum-exp combination of themselves and a block's (o_blk, lse_blk) in rows
// [q_lo, T) of each sequence: lse = log2(2^lse + 2^lse_blk), o = (o 2^lse + o_blk 2^lse_blk) /
// 2^lse_new, computed relative to their max; fp32. One thread per (b, t, h), h fastest; o
// (B,T,C), lse (B,NH,T). Both log-sum-exps are finite: every row of the range sees a key.
__global__ void ring_merge_kernel(float* o, float* lse, const float* o_blk, const float* lse_blk, int B, int T,
                                  int C, int NH, int q_lo) {
    int rows = T - q_lo, HS = C / NH;
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)B * rows * NH) { return; }
    int h = (int)(idx % NH), t = q_lo + (int)(idx / NH % rows), b = (int)(idx / NH / rows);
    long st = ((long)b * NH + h) * T + t;
    float a = lse[st], c = lse_blk[st], mx = fmaxf(a, c);
    float wa = exp2f(a - mx), wc = exp2f(c - mx), ws = wa + wc;
    float4* acc = reinterpret_cast<float4*>(o + ((long)b * T + t) * C + h * HS);
    const float4* blk = reinterpret_cast<const float4*>(o_blk + ((long)b * T + t) * C + h * HS);
    for (int d = 0; d < HS / 4; d++) {
        float4 x = acc[d], y = blk[d];
        acc[d] = make_float4((x.x * wa + y.x * wc) / ws, (x.y * wa + y.y * wc) / ws, (x.z * wa + y.z * wc) / ws,
                             (x.w * wa + y.w * wc) / ws);
    }
    lse[st] = mx + log2f(ws);
}

// rank r's running output o (B,T/N,C) and log-sum-exp lse (B,NH,T/N), fp32, after block s of
// the ring (kv: its K|V): block r, first in the pass, writes them; any other block's partial
// (o_blk, lse_blk: scratch of the same shapes) is merged into them.
static void ring_block_forward(float* o, float* lse, float* o_blk, float* lse_blk, const floatX* qkv, const floatX* kv,
                               int B, int T, int C, int NH, int N, int r, int s) {
    FaProblem p = ring_block_problem(qkv, kv, T, C, NH, N, r, s);
    if (s == r) {
        attention_forward_fast_fp32(o, lse, p, B, C);
        return;
    }
    attention_forward_fast_fp32(o_blk, lse_blk, p, B, C);
    int rows = p.T - p.mask.q_lo;
    LAUNCH(ring_merge_kernel, ceil_div_u((size_t)B * rows * NH, 256), 256, o, lse, o_blk, lse_blk, B, p.T, C, NH,
           p.mask.q_lo);
    cudaLaunchCheck("ring_merge_kernel");
}

// rank r's dq (B,T/N,C) fp32 += block s's share (block r, first in the pass, writes it) and
// dkv (B,T/N,2C) fp32 <- rank r's dk | dv partials of block s's keys, from dout (B,T/N,C), the
// global log-sum-exp lse and D (B,NH,T/N)
static void ring_block_backward(float* dq, float* dkv, const floatX* dout, const floatX* qkv, const floatX* kv,
                                const float* lse, const float* D, int B, int T, int C, int NH, int N, int r, int s) {
    attention_backward_fast_fp32(dq, s != r, dkv, dout, lse, D, ring_block_problem(qkv, kv, T, C, NH, N, r, s), B, C);
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
    float* kv[2];      // the K|V block in hand and the next one: (rows, 2C) bf16, as floats
    float* o_acc;      // (rows, C) the running output, fp32; the backward's dq
    float* o_blk;      // (rows, C) a block's partial output
    float* lse_blk;    // (B, NH, T/N) a block's log-sum-exp; the backward's D
    float* dkv;        // (N, rows, 2C) this rank's dk|dv partials of every block
    float* dkv_in;     // (N, rows, 2C) the partials of this rank's block from every rank
    float* dkv_sum;    // (rows, 2C) their sum
} FastRing;

static void fast_ring_init(FastRing* R, const MemOps* mem, int N, int B, int T, int C, int NH) {
    size_t rows = (size_t)B * (T / N);
    R->kv[0] = mem_floats(mem, rows * C, "context parallelism (K/V blocks)");
    R->kv[1] = mem_floats(mem, rows * C, "context parallelism (K/V blocks)");
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

typedef struct {
    ContextParallel* cp;
    FastRing* R;
    float* lse;                   // (B,NH,T/N) the global log-sum-exp (the forward writes it)
    const floatX *qkv, *dout;
    int B, T, C, NH;
    CommRequest** sends;          // the backward's dk|dv partials on their way to each block's owner
} FastRingCtx;

static void fast_ring_fwd_block(void* v, const float* kv, int s) {
    FastRingCtx* x = (FastRingCtx*)v;
    ring_block_forward(x->R->o_acc, x->lse, x->R->o_blk, x->R->lse_blk, x->qkv, (const floatX*)kv, x->B, x->T, x->C,
                       x->NH, x->cp->N, x->cp->rank, s);
}

// this rank's q|k|v (B,T/N,3C) bf16 in floats: its k|v columns are the ring's first block
static void fast_ring_pass(ContextParallel* cp, FastRing* R, const floatX* qkv, int B, int T, int C, int tag,
                           CpBlockFn fn, void* ctx) {
    cp_ring_pass(cp, R->kv, (const float*)qkv + C / 2, 3L * C / 2, B, T, C, tag, fn, ctx);
}

// out (B,T/N,C) bf16 and lse (B,NH,T/N) (the flash statistics, base 2) of this rank's queries
// (qkv (B,T/N,3C); T: the whole sequence).
static void fast_cp_ring_forward(ContextParallel* cp, FastRing* R, floatX* out, float* lse, const floatX* qkv, int B,
                                 int T, int C, int NH) {
    FastRingCtx x = {cp, R, lse, qkv, NULL, B, T, C, NH, NULL};
    fast_ring_pass(cp, R, qkv, B, T, C, CP_TAG_K, fast_ring_fwd_block, &x);
    ring_round_rows(out, C, R->o_acc, C, (long)B * (T / cp->N), C);
}

// dq's share of block s, and this rank's dk|dv partials of block s's keys, on their way to the
// block's owner at once (isend, cp group, fp32; this rank's own: straight into its slot of dkv_in)
static void fast_ring_bwd_block(void* v, const float* kv, int s) {
    FastRingCtx* x = (FastRingCtx*)v;
    ContextParallel* cp = x->cp;
    int N = cp->N, r = cp->rank;
    size_t blk = (size_t)x->B * (x->T / N) * 2 * x->C;
    float* mine = s == r ? x->R->dkv_in + r * blk : x->R->dkv + s * blk;
    ring_block_backward(x->R->o_acc, mine, x->dout, x->qkv, (const floatX*)kv, x->lse, x->R->lse_blk, x->B, x->T,
                        x->C, x->NH, N, r, s);
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
    attention_backward_D_fast(R->lse_blk, dout, out, B, T / N, C, NH);
    FastRingCtx x = {cp, R, (float*)lse, qkv, dout, B, T, C, NH, send};
    fast_ring_pass(cp, R, qkv, B, T, C, CP_TAG_BK, fast_ring_bwd_block, &x);
    ring_round_rows(dqkv, 3L * C, R->o_acc, C, rows, C);   // dq
    comm_wait_all(recv, N);
    cp->mem->tree_rows(R->dkv_in, blk, N, R->dkv_sum);   // R1 over the ranks' partials
    ring_round_rows(dqkv + C, 3L * C, R->dkv_sum, 2 * C, rows, 2 * C);
    comm_wait_all(send, N);
}

#endif // LLMC_KERNELS_FAST_CP_CUH
