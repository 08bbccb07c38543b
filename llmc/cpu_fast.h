/*
 * cpu_fast.h: the CPU kernels of the contract (llmc/kernels.h) that train_gpt2.c does not
 * write as their plain specification, and the helpers they share (scratch pools, thread
 * indices, the tile dispatch):
 *  - the matmul, the attention and the experts' weight gradients: exactly the bits of
 *    train_gpt2.c's specifications (named above each: "= matmul_forward_naive, bit for bit";
 *    test_kernels compares them on awkward shapes, with SIMD and without), vectorised across
 *    output elements (simd.h: every lane runs the canonical operations of its own output) in
 *    register tiles, and blocked so that the operands stay in cache;
 *  - context parallelism's attention blocks: attention_forward and attention_backward cut into
 *    passes over blocks of keys, on the same tiles;
 *  - GELU and the fused softmax + cross-entropy: canonical.h's per-element functions in every
 *    lane; the mixture-of-experts loops: moe.h's per-output functions (the device twins call
 *    the same ones).
 * Every streamed reduction keeps its partials on a canonical.h CanonStack.
 */
#ifndef LLMC_CPU_FAST_H
#define LLMC_CPU_FAST_H

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/utils.h"
#include "llmc/canonical.h"
#include "llmc/paged_kv.h"
#include "llmc/simd.h"
#include "llmc/moe.h"
#include "llmc/kernels.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

// Scratch memory reused across calls (kernels run one at a time; slots keep them apart).
enum { SCRATCH_PACK, SCRATCH_DINP, SCRATCH_DOUT, SCRATCH_XPACK, SCRATCH_ATT, SCRATCH_ATT_PACK, SCRATCH_ATT_TILE, SCRATCH_SORT,
       SCRATCH_TREE, SCRATCH_DECODE, NUM_SCRATCH };
static float* scratch_ptr[NUM_SCRATCH];
static size_t scratch_bytes[NUM_SCRATCH];
static float* scratch(int slot, size_t bytes) {
    if (bytes > scratch_bytes[slot]) {
        free(scratch_ptr[slot]);
        scratch_ptr[slot] = (float*)aligned_calloc_or_die(bytes, "kernel scratch");
        scratch_bytes[slot] = bytes;
    }
    return scratch_ptr[slot];
}

// The calling OpenMP thread's index, and how many a parallel region has (per-thread scratch).
static int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int thread_count(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

// A register tile is up to 6 outputs (or rows) x MM_MV vectors of VLEN lanes; MR = its lanes.
#define MM_NO 6
#define MM_MV (VLEN == 16 ? 4 : 2)   // 24 accumulators with AVX-512's 32 registers
#define MR (MM_MV * VLEN)

// The one dispatch from a tile's run-time size to compile-time constants, so that its loops
// have fixed bounds (unrolled, the accumulators in registers): CPU_TILE(count, vecs, BODY)
// runs BODY(N, V) with the integer constants N == count (1..MM_NO: outputs or rows) and
// V == vecs (1..MM_MV vectors).
#if MM_MV > 2
#define CPU_TILE_WIDE(N, BODY) case 3: BODY(N, 3); break; case 4: BODY(N, 4); break;
#else
#define CPU_TILE_WIDE(N, BODY)
#endif
#define CPU_TILE_VECS(N, vecs, BODY) switch (vecs) { case 1: BODY(N, 1); break; CPU_TILE_WIDE(N, BODY) default: BODY(N, 2); break; }
#define CPU_TILE(count, vecs, BODY) do { switch (count) {                                            \
        case 6: CPU_TILE_VECS(6, vecs, BODY); break; case 5: CPU_TILE_VECS(5, vecs, BODY); break;   \
        case 4: CPU_TILE_VECS(4, vecs, BODY); break; case 3: CPU_TILE_VECS(3, vecs, BODY); break;   \
        case 2: CPU_TILE_VECS(2, vecs, BODY); break; default: CPU_TILE_VECS(1, vecs, BODY); break;  \
    } } while (0)

// A tile's partials: entry = n rows of MR floats (nv vectors of each take part in the sum).
#define TILE_STACK(name, depth) float name[(depth) * MM_NO * MR]
static inline CanonStack tile_stack(float* partials, int n, int nv) { return canon_stack(partials, MM_NO * MR, n, nv * VLEN, MR); }

// A tile's accumulators acc[n][nv] join its stack as one leaf, then `merges` pop-and-add steps.
ALWAYS_INLINE void tile_push(CanonStack* stack, vf acc[MM_NO][MM_MV], const int n, const int nv, int merges) {
    float* leaf = canon_stack_next(stack);
    _Pragma("GCC unroll 8") for (int j = 0; j < n; j++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { vf_store(leaf + j * MR + v * VLEN, acc[j][v]); }
    }
    canon_stack_push(stack, merges);
}

// ------------------------------------------------------------------------------------------
// R3 over positions of dout[pos][o] * x[pos][ic] (x = NULL: of dout[pos][o] alone), scalar:
// B sequences of T positions, of which the rows hold rank r's D-way zig-zag slice (canonical.h:
// canon_zz_len(T, D, r) rows each, its 8/D R2Z chunks; D = 1: whole sequences).
static float position_reduce_elem(const float* dout, int OC, int o, const float* x, int IC, int ic,
                                  int B, int T, int D, int r) {
    float partials[CANON_LOG2_R + 34];
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    long Tl = canon_zz_len(T, D, r);
    int tchunks = CANON_R / D;
    for (int b = 0; b < B; b++) {
        const float* dseq = dout + (size_t)b * Tl * OC + o;   // sequence b's terms, position t at t * OC
        const float* xseq = x ? x + (size_t)b * Tl * IC + ic : NULL;
        for (int ch = 0; ch < tchunks; ch++) {
            float acc = 0.0f;
            for (int half = 0; half < 2; half++) {
                long tb, te;
                canon_zz_slice_half(T, D, r, ch, half, &tb, &te);
                for (long t = tb; t < te; t++) { acc = xseq ? fmaf(dseq[t * OC], xseq[t * IC], acc) : acc + dseq[t * OC]; }
            }
            canon_stack_push_value(&stack, acc, canon_pos_merges_after(b, B, ch, tchunks));
        }
    }
    return partials[0];
}

// ------------------------------------------------------------------------------------------
// matmul_forward = matmul_forward_naive, bit for bit. It vectorises across ROWS: a tile of MR
// rows x up to MM_NO outputs; inp is packed transposed so each ic gives one vector load per
// VLEN rows.
ALWAYS_INLINE void matmul_forward_tile(float* out, const float* packed, const float* weight,
                                       const float* bias, int IC, int OC, int o0, const int no,
                                       int bt0, int nbt, int nchunks) {
    vf acc[MM_NO][MM_MV];
    TILE_STACK(partials, CANON_LOG2_R + 2);
    CanonStack stack = tile_stack(partials, no, MM_MV);
    for (int ch = 0; ch < nchunks; ch++) {
        int kb = (int)(((long)IC * ch) / nchunks), ke = (int)(((long)IC * (ch + 1)) / nchunks);
        _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) { acc[j][v] = vf_zero(); }
        }
        for (int ic = kb; ic < ke; ic++) {
            vf a[MM_MV];
            _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) { a[v] = vf_load(packed + (size_t)ic * MR + v * VLEN); }
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                vf w = vf_set1(weight[(size_t)(o0 + j) * IC + ic]);
                _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) { acc[j][v] = vf_fma(a[v], w, acc[j][v]); }
            }
        }
        tile_push(&stack, acc, no, MM_MV, canon_tree_merges_after(ch, nchunks));
    }
    for (int j = 0; j < no; j++) {
        const float* tile = partials + j * MR;
        float* o = out + (size_t)bt0 * OC + o0 + j;
        if (bias) {
            float bj = bias[o0 + j];
            for (int i = 0; i < nbt; i++) { o[(size_t)i * OC] = tile[i] + bj; }
        } else {
            for (int i = 0; i < nbt; i++) { o[(size_t)i * OC] = tile[i]; }
        }
    }
}

// A row or two (the sampler's KV-cache steps): the row tile would compute MR rows for one,
// so vectorise across outputs instead, lane j walking weight row o0 + j (a gather per ic),
// four groups of VLEN outputs in flight; each output's chunks and tree are the tile's.
#define MM_FEW_ROWS 2
#define MM_FEW_GROUPS 4
static void matmul_forward_few_rows(float* out, const float* inp, const float* weight, const float* bias,
                                    int BT, int IC, int OC, int nchunks) {
    int W = VLEN * MM_FEW_GROUPS, tasks = (OC + W - 1) / W;
    #pragma omp parallel for schedule(static)
    for (int task = 0; task < tasks; task++) {
        int o0 = task * W;
        vidx lanes[MM_FEW_GROUPS];
        for (int g = 0; g < MM_FEW_GROUPS; g++) {
            int n = OC - (o0 + g * VLEN);
            lanes[g] = vidx_strided(IC, n < 0 ? 0 : n > VLEN ? VLEN : n);
        }
        for (int bt = 0; bt < BT; bt++) {
            const float* x = inp + (size_t)bt * IC;
            float partials[(CANON_LOG2_R + 2) * VLEN * MM_FEW_GROUPS];
            CanonStack stack = canon_stack(partials, W, 1, W, W);
            for (int ch = 0; ch < nchunks; ch++) {
                int kb = (int)(((long)IC * ch) / nchunks), ke = (int)(((long)IC * (ch + 1)) / nchunks);
                vf acc[MM_FEW_GROUPS];
                for (int g = 0; g < MM_FEW_GROUPS; g++) { acc[g] = vf_zero(); }
                for (int ic = kb; ic < ke; ic++) {
                    vf a = vf_set1(x[ic]);
                    _Pragma("GCC unroll 4") for (int g = 0; g < MM_FEW_GROUPS; g++) {
                        const float* w = weight + (size_t)(o0 + g * VLEN < OC ? o0 + g * VLEN : o0) * IC + ic;
                        acc[g] = vf_fma(a, vf_gather(w, lanes[g]), acc[g]);
                    }
                }
                float* leaf = canon_stack_next(&stack);
                for (int g = 0; g < MM_FEW_GROUPS; g++) { vf_store(leaf + g * VLEN, acc[g]); }
                canon_stack_push(&stack, canon_tree_merges_after(ch, nchunks));
            }
            for (int j = 0; j < W && o0 + j < OC; j++) {
                out[(size_t)bt * OC + o0 + j] = bias ? partials[j] + bias[o0 + j] : partials[j];
            }
        }
    }
}

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int BT, int IC, int OC, int nchunks) {
    if (BT <= MM_FEW_ROWS) {
        matmul_forward_few_rows(out, inp, weight, bias, BT, IC, OC, nchunks);
        return;
    }
    // pack inp as blocks of MR rows, transposed: packed[block][ic][MR], zero rows past BT
    int nblocks = (BT + MR - 1) / MR;
    float* packed = scratch(SCRATCH_PACK, sizeof(float) * (size_t)nblocks * IC * MR);
    #pragma omp parallel for
    for (int blk = 0; blk < nblocks; blk++) {
        float* p = packed + (size_t)blk * IC * MR;
        for (int i = 0; i < MR; i++) {
            int bt = blk * MR + i;
            if (bt < BT) {
                const float* row = inp + (size_t)bt * IC;
                for (int ic = 0; ic < IC; ic++) { p[(size_t)ic * MR + i] = row[ic]; }
            } else {
                for (int ic = 0; ic < IC; ic++) { p[(size_t)ic * MR + i] = 0.0f; }
            }
        }
    }
    // tiles: 8 groups of MM_NO outputs per task, so a task's weight rows stay in cache
    int ogroups = (OC + MM_NO - 1) / MM_NO;
    int otasks = (ogroups + 7) / 8;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int ot = 0; ot < otasks; ot++) {
        for (int blk = 0; blk < nblocks; blk++) {
            int bt0 = blk * MR;
            int nbt = BT - bt0 < MR ? BT - bt0 : MR;
            const float* p = packed + (size_t)blk * IC * MR;
            for (int g = ot * 8; g < ogroups && g < ot * 8 + 8; g++) {
                int o0 = g * MM_NO;
                int no = OC - o0 < MM_NO ? OC - o0 : MM_NO;
#define FORWARD_TILE(N, V) matmul_forward_tile(out, p, weight, bias, IC, OC, o0, N, bt0, nbt, nchunks)
                CPU_TILE(no, MM_MV, FORWARD_TILE);
#undef FORWARD_TILE
            }
        }
    }
}

// dinp, one register tile: rows [bt0, bt0+nr) x columns [k0, k0 + nv*VLEN), over the outputs
// o in [ob, oe) of the current chunk, continuing the partial sums in acc_mem (zero = start).
ALWAYS_INLINE void matmul_dinp_tile(float* acc_mem, const float* dout, const float* weight,
                                    int IC, int OC, int ob, int oe, int start, int bt0,
                                    const int nr, int k0, const int nv) {
    vf acc[MM_NO][MM_MV];
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
            acc[r][v] = start ? vf_zero() : vf_load(acc_mem + (size_t)(bt0 + r) * IC + k0 + v * VLEN);
        }
    }
    for (int o = ob; o < oe; o++) {
        const float* w = weight + (size_t)o * IC + k0;
        vf wv[MM_MV];
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { wv[v] = vf_load(w + v * VLEN); }
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            vf d = vf_set1(dout[(size_t)(bt0 + r) * OC + o]);
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_fma(d, wv[v], acc[r][v]); }
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { vf_store(acc_mem + (size_t)(bt0 + r) * IC + k0 + v * VLEN, acc[r][v]); }
    }
}

// One output element of dinp, scalar, for the columns that do not fill a vector.
static float matmul_dinp_elem(const float* dout_row, const float* weight, int ic, int IC, int OC,
                              int groups, int nchunks) {
    float partials[CANON_LOG2_R + 2] = {0.0f};
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    int og = OC / groups;
    for (int ch = 0; ch < nchunks; ch++) {
        float acc = 0.0f;
        for (int g = 0; g < groups; g++) {
            int ob = g * og + (int)(((long)og * ch) / nchunks);
            int oe = g * og + (int)(((long)og * (ch + 1)) / nchunks);
            for (int o = ob; o < oe; o++) { acc = fmaf(dout_row[o], weight[(size_t)o * IC + ic], acc); }
        }
        canon_stack_push_value(&stack, acc, canon_tree_merges_after(ch, nchunks));
    }
    return partials[0];
}

// dinp (BT,IC) = matmul_backward_naive's, bit for bit: each chunk's partial for every (row, ic)
// is accumulated in memory, MM_DINP_OB outputs at a time (so a block of weight columns stays
// in L1 while every row tile passes over it), on a stack of BT x IC entries, each task on its
// own stripe of columns; the stripe of entry 0 is then dinp's.
#define MM_DINP_OB 128
static void matmul_backward_dinp(float* dinp, const float* dout, const float* weight, int BT,
                                 int IC, int OC, int groups, int nchunks) {
    size_t entry = (size_t)BT * IC;
    float* levels = scratch(SCRATCH_DINP, sizeof(float) * (size_t)(CANON_LOG2_R + 2) * entry);
    int kvec_end = IC / VLEN * VLEN;
    int ktiles = (kvec_end + MR - 1) / MR;
    int og = OC / groups;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int kt = 0; kt < ktiles; kt++) {
        int k0 = kt * MR;
        int nv = kvec_end - k0 >= MR ? MM_MV : (kvec_end - k0) / VLEN;
        CanonStack stack = canon_stack(levels + k0, (long)entry, BT, nv * VLEN, IC);
        for (int ch = 0; ch < nchunks; ch++) {
            float* acc = canon_stack_next(&stack) - k0;
            int start = 1;
            for (int g = 0; g < groups; g++) {
                int sb = g * og + (int)(((long)og * ch) / nchunks);
                int se = g * og + (int)(((long)og * (ch + 1)) / nchunks);
                for (int ob = sb; ob < se; ob += MM_DINP_OB) {
                    int oe = se - ob < MM_DINP_OB ? se : ob + MM_DINP_OB;
                    for (int bt0 = 0; bt0 < BT; bt0 += MM_NO) {
                        int nr = BT - bt0 < MM_NO ? BT - bt0 : MM_NO;
#define DINP_TILE(N, V) matmul_dinp_tile(acc, dout, weight, IC, OC, ob, oe, start, bt0, N, k0, V)
                        CPU_TILE(nr, nv, DINP_TILE);
#undef DINP_TILE
                    }
                    start = 0;
                }
            }
            if (start) {   // an empty chunk: its partial is 0
                for (int r = 0; r < BT; r++) {
                    for (int ic = k0; ic < k0 + nv * VLEN; ic++) { acc[(size_t)r * IC + ic] = 0.0f; }
                }
            }
            canon_stack_push(&stack, canon_tree_merges_after(ch, nchunks));
        }
        for (int r = 0; r < BT; r++) {
            memcpy(dinp + (size_t)r * IC + k0, levels + (size_t)r * IC + k0, sizeof(float) * nv * VLEN);
        }
    }
    if (kvec_end < IC) {
        #pragma omp parallel for
        for (int r = 0; r < BT; r++) {
            for (int ic = kvec_end; ic < IC; ic++) {
                dinp[(size_t)r * IC + ic] = matmul_dinp_elem(dout + (size_t)r * OC, weight, ic, IC, OC, groups, nchunks);
            }
        }
    }
}

// dW tile: no outputs x (nv*VLEN) columns [k0, ...), all positions (R3; each sequence's rows
// rank r's D-way slice of T positions: its 8/D R2Z chunks). x: the tile's columns of inp,
// position pos's at x + pos * ldx.
ALWAYS_INLINE void matmul_dweight_tile(float* dweight, const float* dout, const float* x, long ldx,
                                       int B, int T, int D, int r, int IC, int OC, int o0, const int no,
                                       int k0, const int nv) {
    vf acc[MM_NO][MM_MV];
    TILE_STACK(partials, CANON_LOG2_R + 34);
    CanonStack stack = tile_stack(partials, no, nv);
    long Tl = canon_zz_len(T, D, r);
    int tchunks = CANON_R / D;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < tchunks; ch++) {
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_zero(); }
            }
            for (int half = 0; half < 2; half++) {
                long tb, te;
                canon_zz_slice_half(T, D, r, ch, half, &tb, &te);
                for (long t = tb; t < te; t++) {
                    size_t pos = (size_t)b * Tl + t;
                    const float* xp = x + pos * ldx;
                    vf xv[MM_MV];
                    _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { xv[v] = vf_load(xp + v * VLEN); }
                    _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                        vf d = vf_set1(dout[pos * OC + o0 + j]);
                        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_fma(d, xv[v], acc[j][v]); }
                    }
                }
            }
            tile_push(&stack, acc, no, nv, canon_pos_merges_after(b, B, ch, tchunks));
        }
    }
    for (int j = 0; j < no; j++) { memcpy(dweight + (size_t)(o0 + j) * IC + k0, partials + j * MR, sizeof(float) * nv * VLEN); }
}

// dweight (OC,IC), dbias (OC) = matmul_backward_naive's (D = 1), bit for bit: R3 over
// positions, each sequence's rows rank r's D-way slice of T positions. Tasks of MM_STRIP outputs (whole cache
// lines of dout's rows): the strip's columns of dout are packed once (they stream from cache
// for every tile of the strip, instead of one cache line per position and tile from a row OC
// floats long: the LM head's dout is B*T x Vp), then for each block of MM_MV vectors of inp's
// columns (packed too, one contiguous stream per block, and in cache for the strip's tiles)
// the strip's tiles of MM_NO outputs.
#define MM_STRIP 48
static void matmul_weight_grads(float* dweight, float* dbias, const float* dout, const float* inp, int B, int T,
                                int D, int r, int IC, int OC) {
    int nstrips = dweight ? (OC + MM_STRIP - 1) / MM_STRIP : 0;
    size_t BT = (size_t)B * canon_zz_len(T, D, r);
    int kvec_end = IC / VLEN * VLEN, kblocks = (kvec_end + MR - 1) / MR;
    float* packs = scratch(SCRATCH_DOUT, sizeof(float) * (size_t)thread_count() * BT * MM_STRIP);
    float* xpack = scratch(SCRATCH_XPACK, sizeof(float) * ((size_t)kblocks * BT * MR + 1));   // [block][pos][MR]
    #pragma omp parallel for collapse(2)
    for (int kb = 0; kb < (nstrips ? kblocks : 0); kb++) {
        for (size_t pos = 0; pos < BT; pos++) {
            int k0 = kb * MR, w = kvec_end - k0 < MR ? kvec_end - k0 : MR;
            memcpy(xpack + ((size_t)kb * BT + pos) * MR, inp + pos * IC + k0, sizeof(float) * w);
        }
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (int s = 0; s < nstrips; s++) {
        int s0 = s * MM_STRIP, ns = OC - s0 < MM_STRIP ? OC - s0 : MM_STRIP;
        float* strip = packs + (size_t)thread_index() * BT * MM_STRIP;   // (BT, ns) of dout
        for (size_t pos = 0; pos < BT; pos++) { memcpy(strip + pos * ns, dout + pos * OC + s0, sizeof(float) * ns); }
        float* dw = dweight + (size_t)s0 * IC;
        for (int kb = 0; kb < kblocks; kb++) {
            int k0 = kb * MR, nv = (kvec_end - k0) / VLEN < MM_MV ? (kvec_end - k0) / VLEN : MM_MV;
            const float* x = xpack + (size_t)kb * BT * MR;
            for (int o0 = 0; o0 < ns; o0 += MM_NO) {
#define DWEIGHT_TILE(N, V) matmul_dweight_tile(dw, strip, x, MR, B, T, D, r, IC, ns, o0, N, k0, V)
                CPU_TILE(ns - o0 < MM_NO ? ns - o0 : MM_NO, nv, DWEIGHT_TILE);
#undef DWEIGHT_TILE
            }
        }
        for (int o = 0; o < ns; o++) {   // the columns that do not fill a vector
            for (int ic = kvec_end; ic < IC; ic++) {
                dw[(size_t)o * IC + ic] = position_reduce_elem(strip, ns, o, inp, IC, ic, B, T, D, r);
            }
        }
    }
    if (dbias) {
        #pragma omp parallel for
        for (int o = 0; o < OC; o++) { dbias[o] = position_reduce_elem(dout, OC, o, NULL, 0, 0, B, T, D, r); }
    }
}

// = matmul_backward_naive, bit for bit
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int B, int T, int IC, int OC,
                     int groups, int nchunks) {
    if (dinp) { matmul_backward_dinp(dinp, dout, weight, B * T, IC, OC, groups, nchunks); }
    matmul_weight_grads(dweight, dbias, dout, inp, B, T, 1, 0, IC, OC);
}

// Each sequence's subtree of matmul_backward's weight and bias gradients, for a rank that holds
// its D-way zig-zag slice r of every sequence of T positions (context parallelism: the slice's
// 8/D R2Z chunks), which the group finishes: sequence b's at dweight + b*seq_stride (OC,IC) and
// dbias + b*seq_stride (OC; NULL: none).
void matmul_backward_seqs(float* dweight, float* dbias, long seq_stride, const float* dout, const float* inp,
                          int B, int T, int D, int r, int IC, int OC) {
    size_t Tl = (size_t)canon_zz_len(T, D, r);
    for (int b = 0; b < B; b++) {
        matmul_weight_grads(dweight + b * seq_stride, dbias ? dbias + b * seq_stride : NULL, dout + (size_t)b * Tl * OC,
                            inp + (size_t)b * Tl * IC, 1, T, D, r, IC, OC);
    }
}

// ------------------------------------------------------------------------------------------
// attention = attention_forward_naive and attention_backward_naive, bit for bit, vectorised
// across outputs and blocked so that a tile's rows of att stay in cache. Every product has one
// of two shapes:
//  - scores (s = q.k, datt = dout.v): a tile of up to ATT_NR query rows x vectors of keys; the
//    keys packed transposed (kt[d][j], zero past T), the query broadcast; R2 over hs in
//    registers, as matmul_forward's tiles do.
//  - weighted rows (att@v and ds@k over keys; ds^T@q and att^T@dout over queries): a tile of up
//    to ATT_NR output rows x vectors of the head's channels; the weight broadcast, the x row
//    loaded; R2Z over j, where output row r takes only the j in [lo[r], hi[r]) (the causal
//    mask: a term outside is skipped, never added as a zero).
// The row reductions of the softmax (Z) and of its backward (S) run the tile's rows side by
// side, each row's chunks in its own order.
#define ATT_NR MM_NO

// out row r (r < nr) = R2Z over j of w(r, j) * x row j, j in [lo[r], hi[r]); j runs over rank
// zr's zD-way zig-zag slice of a sequence of n positions (its 8/zD chunks; zD = 1: all of it)
typedef struct {
    const float* w; long wr, wj;   // w(r, j) = w[r * wr + j * wj]
    const float* x; long ldx;      // x row j at x + j * ldx
    float* out; long ldo;          // out row r at out + r * ldo
    long n; int zD, zr;            // the reduced dimension: the slice
    const int* lo; const int* hi;  // row r's terms: j in [lo[r], hi[r])
} AttRows;

// One register tile: rows [0, nr) x channels [d0, d0 + nv*VLEN).
ALWAYS_INLINE void attn_rows_tile(const AttRows* a, const int nr, int d0, const int nv) {
    int lo_any = a->lo[0], hi_any = a->hi[0], lo_all = a->lo[0], hi_all = a->hi[0];
    _Pragma("GCC unroll 8") for (int r = 1; r < nr; r++) {
        lo_any = a->lo[r] < lo_any ? a->lo[r] : lo_any;
        hi_any = a->hi[r] > hi_any ? a->hi[r] : hi_any;
        lo_all = a->lo[r] > lo_all ? a->lo[r] : lo_all;
        hi_all = a->hi[r] < hi_all ? a->hi[r] : hi_all;
    }
    vf acc[ATT_NR][MM_MV];
    TILE_STACK(partials, CANON_LOG2_R + 2);
    CanonStack stack = tile_stack(partials, nr, nv);
    int nchunks = CANON_R / a->zD;
    for (int c = 0; c < nchunks; c++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_zero(); }
        }
        for (int half = 0; half < 2; half++) {
            long pb, pe;
            canon_zz_slice_half(a->n, a->zD, a->zr, c, half, &pb, &pe);
            if (pb < lo_any) { pb = lo_any; }
            if (pe > hi_any) { pe = hi_any; }
            for (long j = pb; j < pe; j++) {
                const float* xr = a->x + j * a->ldx + d0;
                const float* wc = a->w + j * a->wj;
                vf xv[MM_MV];
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { xv[v] = vf_load(xr + v * VLEN); }
                if (j >= lo_all && j < hi_all) {
                    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
                        vf wv = vf_set1(wc[r * a->wr]);
                        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_fma(wv, xv[v], acc[r][v]); }
                    }
                } else {
                    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
                        if (j < a->lo[r] || j >= a->hi[r]) { continue; }
                        vf wv = vf_set1(wc[r * a->wr]);
                        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_fma(wv, xv[v], acc[r][v]); }
                    }
                }
            }
        }
        tile_push(&stack, acc, nr, nv, canon_tree_merges_after(c, nchunks));
    }
    for (int r = 0; r < nr; r++) { memcpy(a->out + r * a->ldo + d0, partials + r * MR, sizeof(float) * nv * VLEN); }
}

// One output of the same, scalar (the channels that do not fill a vector).
static float attn_rows_elem(const AttRows* a, int r, int d) {
    float partials[CANON_LOG2_R + 2] = {0.0f};
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    int nchunks = CANON_R / a->zD;
    for (int c = 0; c < nchunks; c++) {
        float acc = 0.0f;
        for (int half = 0; half < 2; half++) {
            long pb, pe;
            canon_zz_slice_half(a->n, a->zD, a->zr, c, half, &pb, &pe);
            for (long j = pb < a->lo[r] ? a->lo[r] : pb; j < pe && j < a->hi[r]; j++) {
                acc = fmaf(a->w[r * a->wr + j * a->wj], a->x[j * a->ldx + d], acc);
            }
        }
        canon_stack_push_value(&stack, acc, canon_tree_merges_after(c, nchunks));
    }
    return partials[0];
}

// The outputs of nr <= ATT_NR rows, channels [0, n).
static void attn_rows(const AttRows* a, int nr, int n) {
    int nvec = n / VLEN;
    for (int d0 = 0; d0 < nvec * VLEN; d0 += MR) {
        int nv = nvec - d0 / VLEN < MM_MV ? nvec - d0 / VLEN : MM_MV;
#define ROWS_TILE(N, V) attn_rows_tile(a, N, d0, V)
        CPU_TILE(nr, nv, ROWS_TILE);
#undef ROWS_TILE
    }
    for (int r = 0; r < nr; r++) {
        for (int d = nvec * VLEN; d < n; d++) { a->out[r * a->ldo + d] = attn_rows_elem(a, r, d); }
    }
}

// s rows r < nr (stride lds), keys [j0, j0 + nv*VLEN) = (R2 over d < hs of fmaf(q[r][d], kt[d][j]))
// times scale (1: none)
ALWAYS_INLINE void attn_scores_tile(float* s, long lds, const float* q, long ldq, const float* kt, long ldk,
                                    int hs, const int nr, int j0, const int nv, float scale) {
    vf acc[ATT_NR][MM_MV];
    TILE_STACK(partials, CANON_LOG2_R + 2);
    CanonStack stack = tile_stack(partials, nr, nv);
    for (int c = 0; c < CANON_R; c++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_zero(); }
        }
        for (long d = canon_chunk_begin(hs, c); d < canon_chunk_begin(hs, c + 1); d++) {
            vf kv[MM_MV];
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { kv[v] = vf_load(kt + d * ldk + j0 + v * VLEN); }
            _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
                vf qv = vf_set1(q[r * ldq + d]);
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_fma(qv, kv[v], acc[r][v]); }
            }
        }
        tile_push(&stack, acc, nr, nv, canon_tree_merges_after(c, CANON_R));
    }
    vf sc = vf_set1(scale);
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
            vf sum = vf_load(partials + r * MR + v * VLEN);
            vf_store(s + r * lds + j0 + v * VLEN, scale == 1.0f ? sum : vf_mul(sum, sc));
        }
    }
}

// Scores of nr <= ATT_NR query rows against the keys [0, nkeys) (rounded up to whole vectors:
// s rows and kt rows hold at least that many).
static void attn_scores(float* s, long lds, const float* q, long ldq, const float* kt, long ldk, int hs, int nr,
                        int nkeys, float scale) {
    int nvec = (nkeys + VLEN - 1) / VLEN;
    for (int j0 = 0; j0 < nvec * VLEN; j0 += MR) {
        int nv = nvec - j0 / VLEN < MM_MV ? nvec - j0 / VLEN : MM_MV;
#define SCORES_TILE(N, V) attn_scores_tile(s, lds, q, ldq, kt, ldk, hs, N, j0, V, scale)
        CPU_TILE(nr, nv, SCORES_TILE);
#undef SCORES_TILE
    }
}

// kt[bh][d][j] (hs x ldk per head, zero for j >= T) <- the rows x[b, j] + h*hs (stride ldx)
static void attn_pack_transposed(float* kt, long ldk, const float* x, long ldx, int B, int T, int NH, int hs) {
    #pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            float* dst = kt + ((size_t)b * NH + h) * hs * ldk;
            const float* src = x + (size_t)b * T * ldx + h * hs;
            for (int d = 0; d < hs; d++) {
                for (int j = 0; j < T; j++) { dst[d * ldk + j] = src[j * ldx + d]; }
                for (long j = T; j < ldk; j++) { dst[d * ldk + j] = 0.0f; }
            }
        }
    }
}

// rows[bh][j][d] (T x hs per head, contiguous) <- x[b, j] + h*hs (stride ldx): a head's rows
// read in the reductions over j, packed so that they stream from cache
static void attn_pack_rows(float* rows, const float* x, long ldx, int B, int T, int NH, int hs) {
    #pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            float* dst = rows + ((size_t)b * NH + h) * T * hs;
            const float* src = x + (size_t)b * T * ldx + h * hs;
            for (int j = 0; j < T; j++) { memcpy(dst + (size_t)j * hs, src + j * ldx, sizeof(float) * hs); }
        }
    }
}

// The largest of x[0..n): `if (x > m) m = x` from -inf, in any order (exact; a NaN never wins).
static float attn_row_max(const float* x, long n) {
    vf mv = vf_set1(-canon_inf());
    long j = 0;
    for (; j + VLEN <= n; j += VLEN) { mv = vf_max_gt(mv, vf_load(x + j)); }
    float lanes[VLEN], m = -canon_inf();
    vf_store(lanes, mv);
    for (int i = 0; i < VLEN; i++) { m = lanes[i] > m ? lanes[i] : m; }
    for (; j < n; j++) { m = x[j] > m ? x[j] : m; }
    return m;
}

// x[j] <- canon_expf(x[j] - m) for j < n, vectorised (vf_expf is canon_expf in every lane)
static void exps_shifted(float* x, long n, float m) {
    vf mv = vf_set1(m);
    long j = 0;
    for (; j + VLEN <= n; j += VLEN) { vf_store(x + j, vf_expf(vf_sub(vf_load(x + j), mv))); }
    for (; j < n; j++) { x[j] = canon_expf(x[j] - m); }
}

// R2Z sums of the nr rows x (stride ldx), row r over j < hi[r], j over rank zr's zD-way slice
// of a sequence of n positions (as AttRows): the sum of x (y NULL), or the fmaf-accumulated dot
// product with y (stride ldy); rows side by side.
static void attn_row_sums(float* out, const float* x, long ldx, const float* y, long ldy, int nr, const int* hi,
                          long n, int zD, int zr) {
    int nchunks = CANON_R / zD;
    float part[CANON_R][ATT_NR];
    int hi_any = 0;
    for (int r = 0; r < nr; r++) { hi_any = hi[r] > hi_any ? hi[r] : hi_any; }
    for (int c = 0; c < nchunks; c++) {
        float acc[ATT_NR] = {0.0f};
        for (int half = 0; half < 2; half++) {
            long pb, pe;
            canon_zz_slice_half(n, zD, zr, c, half, &pb, &pe);
            for (long j = pb; j < pe && j < hi_any; j++) {
                for (int r = 0; r < nr; r++) {
                    if (j < hi[r]) { acc[r] = y ? fmaf(x[r * ldx + j], y[r * ldy + j], acc[r]) : acc[r] + x[r * ldx + j]; }
                }
            }
        }
        for (int r = 0; r < nr; r++) { part[c][r] = acc[r]; }
    }
    for (int r = 0; r < nr; r++) { out[r] = canon_tree_sum(&part[0][r], nchunks, ATT_NR); }
}

// The causal bounds of ATT_NR rows at positions p0, p0 + 1, ...: keys [0, p + 1), or, for the
// reductions over queries, queries [p, T).
static void attn_bounds(int* lo, int* hi, int p0, int over_queries, int T) {
    for (int r = 0; r < ATT_NR; r++) {
        lo[r] = over_queries ? p0 + r : 0;
        hi[r] = over_queries ? T : p0 + r + 1;
    }
}

// Keys (or queries) padded to whole tiles of key vectors.
static long attn_padded(int T) { return ((long)T + MR - 1) / MR * MR; }

// Task idx of a pass over every head's tiles of ATT_NR rows (of n; ntiles per head, a head's
// in a row, from the last when last_first: under the causal mask the longest first): head
// bh = (b, h), rows [t0, t0 + nr). Its rows' bounds lo, hi are filled by the caller.
typedef struct { int bh, b, h, t0, nr; int lo[ATT_NR], hi[ATT_NR]; } AttTile;
static AttTile attn_tile(long idx, int ntiles, int NH, int n, int last_first) {
    AttTile q;
    int tile = (int)(idx % ntiles);
    q.bh = (int)(idx / ntiles);
    q.b = q.bh / NH;
    q.h = q.bh % NH;
    q.t0 = (last_first ? ntiles - 1 - tile : tile) * ATT_NR;
    q.nr = n - q.t0 < ATT_NR ? n - q.t0 : ATT_NR;
    return q;
}

// = attention_forward_naive, bit for bit
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH, BH = B * NH, ntiles = (T + ATT_NR - 1) / ATT_NR;
    long C3 = 3L * C, Tp = attn_padded(T);
    float* kt = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * hs * (Tp + T));
    float* vr = kt + (size_t)BH * hs * Tp;
    float* tiles = scratch(SCRATCH_ATT_TILE, sizeof(float) * (size_t)thread_count() * ATT_NR * Tp);
    attn_pack_transposed(kt, Tp, qkv + C, C3, B, T, NH, hs);
    attn_pack_rows(vr, qkv + 2 * C, C3, B, T, NH, hs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        AttTile q = attn_tile(idx, ntiles, NH, T, 1);
        attn_bounds(q.lo, q.hi, q.t0, 0, T);
        float* s = tiles + (size_t)thread_index() * ATT_NR * Tp;
        float* a = att + ((size_t)q.bh * T + q.t0) * T;
        attn_scores(s, Tp, qkv + ((size_t)q.b * T + q.t0) * C3 + q.h * hs, C3, kt + (size_t)q.bh * hs * Tp, Tp, hs,
                    q.nr, q.t0 + q.nr, canon_rsqrtf((float)hs));
        // softmax: the max (exact), the exps, Z = R2Z over the keys, the division; 0 past t
        float z[ATT_NR];
        for (int r = 0; r < q.nr; r++) {
            float* sr = s + r * Tp;
            exps_shifted(sr, q.hi[r], attn_row_max(sr, q.hi[r]));
        }
        attn_row_sums(z, s, Tp, NULL, 0, q.nr, q.hi, T, 1, 0);
        for (int r = 0; r < q.nr; r++) {
            float* ar = a + (size_t)r * T;
            const float* sr = s + r * Tp;
            float zr = z[r];
            #pragma omp simd
            for (int j = 0; j < q.hi[r]; j++) { ar[j] = sr[j] / zr; }
            for (int j = q.hi[r]; j < T; j++) { ar[j] = 0.0f; }
        }
        AttRows av = {a, T, 1, vr + (size_t)q.bh * T * hs, hs, out + ((size_t)q.b * T + q.t0) * C + q.h * hs, C, T,
                      1, 0, q.lo, q.hi};
        attn_rows(&av, q.nr, hs);
    }
}

// = attention_backward_naive, bit for bit
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                        int B, int T, int C, int NH) {
    int hs = C / NH, BH = B * NH, ntiles = (T + ATT_NR - 1) / ATT_NR;
    long C3 = 3L * C, Tp = attn_padded(T);
    float scale = canon_rsqrtf((float)hs);
    size_t head = (size_t)T * hs;
    float* vt = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * (hs * Tp + 3 * head));
    float* kr = vt + (size_t)BH * hs * Tp;   // the rows of k, q and dout of every head
    float* qr = kr + BH * head;
    float* dr = qr + BH * head;
    float* ds_all = scratch(SCRATCH_ATT, sizeof(float) * (size_t)BH * T * T);
    attn_pack_transposed(vt, Tp, qkv + 2 * C, C3, B, T, NH, hs);
    attn_pack_rows(kr, qkv + C, C3, B, T, NH, hs);
    attn_pack_rows(qr, qkv, C3, B, T, NH, hs);
    attn_pack_rows(dr, dout, C, B, T, NH, hs);
    float* tiles = scratch(SCRATCH_ATT_TILE, sizeof(float) * (size_t)thread_count() * ATT_NR * Tp);
    // per query tile: datt, S, ds (kept for the second part), dq = R2Z over keys of ds * k
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        AttTile q = attn_tile(idx, ntiles, NH, T, 1);
        attn_bounds(q.lo, q.hi, q.t0, 0, T);
        float* datt = tiles + (size_t)thread_index() * ATT_NR * Tp;
        const float* a = att + ((size_t)q.bh * T + q.t0) * T;
        float* ds = ds_all + ((size_t)q.bh * T + q.t0) * T;
        attn_scores(datt, Tp, dout + ((size_t)q.b * T + q.t0) * C + q.h * hs, C, vt + (size_t)q.bh * hs * Tp, Tp, hs,
                    q.nr, q.t0 + q.nr, 1.0f);
        float S[ATT_NR];
        attn_row_sums(S, a, T, datt, Tp, q.nr, q.hi, T, 1, 0);
        for (int r = 0; r < q.nr; r++) {
            const float* ar = a + (size_t)r * T;
            const float* dr = datt + r * Tp;
            float* sr = ds + (size_t)r * T;
            float Sr = S[r];
            #pragma omp simd
            for (int j = 0; j < q.hi[r]; j++) { sr[j] = ar[j] * (dr[j] - Sr) * scale; }
        }
        AttRows dq = {ds, T, 1, kr + q.bh * head, hs, dqkv + ((size_t)q.b * T + q.t0) * C3 + q.h * hs, C3, T, 1, 0,
                      q.lo, q.hi};
        attn_rows(&dq, q.nr, hs);
    }
    // per strip of keys (tiles of ATT_NR, a few in a row so the strip of ds and att columns
    // stays in cache): dk = R2Z over queries of ds * q, dv = R2Z over queries of att * dout
    int strip = 3, nstrips = (ntiles + strip - 1) / strip;
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * nstrips; idx++) {   // a head's strips in a row, longest first
        int bh = (int)(idx / nstrips), b = bh / NH, h = bh % NH, first = (int)(idx % nstrips) * strip;
        for (int tile = first; tile < first + strip && tile < ntiles; tile++) {
            int t0 = tile * ATT_NR, nr = T - t0 < ATT_NR ? T - t0 : ATT_NR;
            int lo[ATT_NR], hi[ATT_NR];
            attn_bounds(lo, hi, t0, 1, T);
            size_t tt = (size_t)bh * T * T;
            float* drow = dqkv + ((size_t)b * T + t0) * C3 + h * hs;
            AttRows dk = {ds_all + tt + t0, 1, T, qr + bh * head, hs, drow + C, C3, T, 1, 0, lo, hi};
            AttRows dv = {att + tt + t0, 1, T, dr + bh * head, hs, drow + 2 * C, C3, T, 1, 0, lo, hi};
            attn_rows(&dk, nr, hs);
            attn_rows(&dv, nr, hs);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Serving's paged attention = attention_forward_paged_naive (train_gpt2.c), bit for bit, the
// keys and values read in place through the block table instead of gathered into a sequence.
// A row (its query at position t) is bound by reading its keys and values from memory, so
// each key's and each value's channels are read once, in order (a stream the hardware
// prefetches), for all of the row's heads together:
//  - scores: MR keys at a time, their channels transposed 8 x 8 into a tile kt (C x MR), then
//    per head attn_scores' register tile (R2 over hs, the query broadcast);
//  - the softmax per head: the max (exact), the exps, Z = R2Z over T (attn_row_sums), the
//    division;
//  - out = R2Z over the keys of att * v, every channel at once: key by key in each chunk's
//    order into a row of accumulators per chunk, then the R1 tree over the 8 rows.
// The rows of a step go to the threads (one parallel region per layer, not a fork and join per
// row); a lone row's heads are split among the threads (nested in an inactive region of one
// thread, libgomp would start new threads every call: measured 16 -> 40 ms a decoded token on
// d12).

// offs[p] for p <= t: where key p of a row (block table `table`) starts in the layer's cache
static void attn_paged_places(long* offs, const int* table, int t, int bs, long block_stride, int C) {
    for (int p = 0; p <= t; p++) { offs[p] = paged_kv_slot(table, block_stride, p, bs, C); }
}

// out (nh*hs) = R2Z over keys j <= t (of T) of p[h][j] * value j's channel (h*hs + d), for the
// nh heads at once; value j at v + offs[j], p row h at p + h * ldp; part: CANON_R rows of
// nh*hs floats, each chunk's partials, then the R1 tree over them
static void attn_paged_values(float* out, const float* p, long ldp, const float* v, const long* offs, int t, int T,
                              int hs, int nh, float* part) {
    int n = nh * hs, nvec = hs / VLEN;
    for (int c = 0; c < CANON_R; c++) {
        float* acc = part + (size_t)c * n;
        memset(acc, 0, sizeof(float) * n);
        for (int half = 0; half < 2; half++) {
            long b, e;
            canon_zz_half(T, CANON_R, c, half, &b, &e);
            for (long j = b; j < e && j <= t; j++) {
                const float* vj = v + offs[j];
                for (int h = 0; h < nh; h++) {
                    float w = p[h * ldp + j];
                    vf wv = vf_set1(w);
                    float* ah = acc + h * hs;
                    const float* xh = vj + h * hs;
                    for (int i = 0; i < nvec; i++) {
                        vf_store(ah + i * VLEN, vf_fma(wv, vf_load(xh + i * VLEN), vf_load(ah + i * VLEN)));
                    }
                    for (int d = nvec * VLEN; d < hs; d++) { ah[d] = fmaf(w, xh[d], ah[d]); }
                }
            }
        }
    }
    const float* q[CANON_R];
    for (int c = 0; c < CANON_R; c++) { q[c] = part + (size_t)c * n; }
    int d = 0;
    for (; d + VLEN <= n; d += VLEN) {   // canon_tree8, lane by lane
        vf s01 = vf_add(vf_load(q[0] + d), vf_load(q[1] + d)), s23 = vf_add(vf_load(q[2] + d), vf_load(q[3] + d));
        vf s45 = vf_add(vf_load(q[4] + d), vf_load(q[5] + d)), s67 = vf_add(vf_load(q[6] + d), vf_load(q[7] + d));
        vf_store(out + d, vf_add(vf_add(s01, s23), vf_add(s45, s67)));
    }
    for (; d < n; d++) {
        float pd[CANON_R];
        for (int c = 0; c < CANON_R; c++) { pd[c] = q[c][d]; }
        out[d] = canon_tree8(pd);
    }
}

// kt (n x MR) <- the nk <= MR keys at k + offs[j] (n channels each) transposed, in 8 x 8
// blocks; the lanes past nk up to a whole vector repeat key nk - 1 (their scores are never read)
static void attn_key_tile(float* kt, const float* k, const long* offs, int nk, int n) {
    int nj = (nk + VLEN - 1) / VLEN * VLEN, n8 = n / 8 * 8;   // VLEN is a multiple of 8
    for (int j0 = 0; j0 < nj; j0 += 8) {
        const float* src[8];
        for (int j = 0; j < 8; j++) { src[j] = k + offs[j0 + j < nk ? j0 + j : nk - 1]; }
        for (int d0 = 0; d0 < n8; d0 += 8) {
            transpose8x8(kt + d0 * MR + j0, MR, src);
            for (int j = 0; j < 8; j++) { src[j] += 8; }
        }
        for (int d = n8; d < n; d++) {
            for (int j = 0; j < 8; j++) { kt[d * MR + j0 + j] = src[j][d - n8]; }
        }
    }
}

// Heads [h0, h0 + nh) of one row: out (nh*hs, the heads' channels) from q (the row's C query
// channels). Scratch: s (nh x Tp) the scores, then probabilities; kt (nh*hs x MR) the key
// tile; part as attn_paged_values'.
static void attn_paged_heads(float* out, float* s, long Tp, float* kt, float* part, const float* q, const float* kv,
                             const long* offs, int t, int T, int C, int hs, int h0, int nh) {
    float scale = canon_rsqrtf((float)hs);
    for (int j0 = 0; j0 <= t; j0 += MR) {
        int nk = t + 1 - j0 < MR ? t + 1 - j0 : MR;
        attn_key_tile(kt, kv + h0 * hs, offs + j0, nk, nh * hs);
        for (int h = 0; h < nh; h++) {
            attn_scores(s + h * Tp + j0, 0, q + (h0 + h) * hs, 0, kt + (size_t)h * hs * MR, MR, hs, 1, nk, scale);
        }
    }
    for (int h0r = 0; h0r < nh; h0r += ATT_NR) {
        int nr = nh - h0r < ATT_NR ? nh - h0r : ATT_NR, hi[ATT_NR];
        float z[ATT_NR];
        for (int r = 0; r < nr; r++) {
            float* sr = s + (h0r + r) * Tp;
            exps_shifted(sr, t + 1, attn_row_max(sr, t + 1));
            hi[r] = t + 1;
        }
        attn_row_sums(z, s + h0r * Tp, Tp, NULL, 0, nr, hi, T, 1, 0);
        for (int r = 0; r < nr; r++) {
            float* sr = s + (h0r + r) * Tp;
            float zr = z[r];
            #pragma omp simd
            for (int j = 0; j <= t; j++) { sr[j] = sr[j] / zr; }
        }
    }
    attn_paged_values(out, s, Tp, kv + C + h0 * hs, offs, t, T, hs, nh, part);
}

void attention_forward_paged(float* out, float* scratch_att, const float* qkv, const float* kv, long block_stride,
                             const int* tables, int max_blocks, const int* pos, int N, int T, int bs, int C, int NH) {
    int hs = C / NH, threads = thread_count();
    long C3 = 3L * C, Tp = attn_padded(T), per_thread = NH * Tp + (long)C * MR + (long)CANON_R * C;
    float* bufs = scratch(SCRATCH_ATT_TILE, sizeof(float) * (size_t)threads * per_thread);
    long* places = (long*)scratch(SCRATCH_ATT_PACK, sizeof(long) * (size_t)threads * T);
#define PAGED_HEADS(out, q, offs, t, h0, nh) do {                                                               \
        float* s = bufs + (size_t)thread_index() * per_thread;                                                   \
        attn_paged_heads(out, s, Tp, s + NH * Tp, s + NH * Tp + (long)C * MR, q, kv, offs, t, T, C, hs, h0, nh); \
    } while (0)
    if (N == 1) {   // the heads in as many groups as threads
        attn_paged_places(places, tables, pos[0], bs, block_stride, C);
        #pragma omp parallel for
        for (int g = 0; g < threads; g++) {
            int h0 = NH * g / threads, h1 = NH * (g + 1) / threads;
            if (h1 > h0) { PAGED_HEADS(out + h0 * hs, qkv, places, pos[0], h0, h1 - h0); }
        }
        return;
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (int r = 0; r < N; r++) {
        long* offs = places + (size_t)thread_index() * T;
        attn_paged_places(offs, tables + (size_t)r * max_blocks, pos[r], bs, block_stride, C);
        PAGED_HEADS(out + r * C, qkv + r * C3, offs, pos[r], 0, NH);
    }
#undef PAGED_HEADS
}

// ------------------------------------------------------------------------------------------
// context parallelism's attention, one block of keys at a time (llmc/context_parallel.h drives
// them around the group). Rank r of an N-way context-parallel group holds the queries of its
// zig-zag slice of each sequence of T positions (Tq = canon_zz_len(T, N, r) local positions,
// canonical.h R2Z: T/N when 2N | T, else R2Z's unequal pieces) and sees the keys and values
// of every rank's slice in turn: block s, Tk = canon_zz_len(T, N, s) positions. att
// (B,NH,Tq,T) keeps block s in columns [canon_zz_offset(T, N, s), ... + Tk); a query attends
// to the keys of block s at global positions up to its own, a prefix of the block
// (canon_zz_count_le). Each reduction over keys is R2Z within a block (its 8/N chunks: a
// complete subtree of the one-rank tree) and R1 over the blocks in rank order; the reductions
// over queries (dk, dv) likewise, over each rank's queries, then R1 over the ranks. With N = 1
// these are attention_forward and attention_backward (so attention_*_naive) cut into passes:
// the same helpers, the same bits.
//   qkv (B,Tq,3C) this rank's; kblk, vblk (B,Tk,C) block s's keys or values; C, NH this
//   rank's channels and heads (tensor parallelism divides them as usual)

// The keys of block s that query rows t0, t0+1, ... (nr of them, of rank r's slice) attend to:
// [lo[i], hi[i]) = [0, count); rows past nr repeat the last one.
static void cp_key_bounds(int* lo, int* hi, int t0, int nr, int T, int N, int r, int s) {
    for (int i = 0; i < ATT_NR; i++) {
        int t = t0 + (i < nr ? i : nr - 1);
        lo[i] = 0;
        hi[i] = canon_zz_count_le(canon_zz_global(t, T, N, r), T, N, s);
    }
}

// The queries of rank r that block s's keys j0, j0+1, ... are attended by: [lo[i], Tq).
static void cp_query_bounds(int* lo, int* hi, int j0, int nr, int T, int N, int r, int s) {
    int Tq = (int)canon_zz_len(T, N, r);
    for (int i = 0; i < ATT_NR; i++) {
        int j = j0 + (i < nr ? i : nr - 1);
        lo[i] = Tq - canon_zz_count_ge(canon_zz_global(j, T, N, s), T, N, r);
        hi[i] = Tq;
    }
}

static int cp_max(const int* x, int n) {
    int m = 0;
    for (int i = 0; i < n; i++) { m = x[i] > m ? x[i] : m; }
    return m;
}

// q.k (or dout.v: scale 1) of this rank's queries against block s, into att's (or ds's) block
// columns: the entries each query attends to
static void cp_block_products(float* att, const float* q, long ldq, const float* kblk, int B, int T, int C, int NH,
                              int N, int r, int s, float scale) {
    int hs = C / NH, BH = B * NH, Tq = (int)canon_zz_len(T, N, r), Tk = (int)canon_zz_len(T, N, s);
    long Tp = attn_padded(Tk), col = canon_zz_offset(T, N, s);
    float* kt = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * hs * Tp);
    float* tiles = scratch(SCRATCH_ATT_TILE, sizeof(float) * (size_t)thread_count() * ATT_NR * Tp);
    attn_pack_transposed(kt, Tp, kblk, C, B, Tk, NH, hs);
    int ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        AttTile qt = attn_tile(idx, ntiles, NH, Tq, 0);
        cp_key_bounds(qt.lo, qt.hi, qt.t0, qt.nr, T, N, r, s);
        int nkeys = cp_max(qt.hi, qt.nr);
        if (nkeys == 0) { continue; }
        float* tile_s = tiles + (size_t)thread_index() * ATT_NR * Tp;
        attn_scores(tile_s, Tp, q + ((size_t)qt.b * Tq + qt.t0) * ldq + qt.h * hs, ldq, kt + (size_t)qt.bh * hs * Tp, Tp,
                    hs, qt.nr, nkeys, scale);
        for (int i = 0; i < qt.nr; i++) {
            memcpy(att + ((size_t)qt.bh * Tq + qt.t0 + i) * T + col, tile_s + i * Tp, sizeof(float) * qt.hi[i]);
        }
    }
}

// att block s <- the scores q.k * (1/sqrt(hs)) of the keys each query attends to
void attention_scores_block(float* att, const float* qkv, const float* kblk, int B, int T, int C, int NH, int N,
                            int r, int s) {
    cp_block_products(att, qkv, 3L * C, kblk, B, T, C, NH, N, r, s, canon_rsqrtf((float)(C / NH)));
}

// The softmax of every row over all N blocks: the max (exact), the exps, Z = R1 over blocks of
// each block's R2Z subtree, the division; 0 for the keys a query does not attend to.
void attention_softmax_blocks(float* att, int B, int T, int NH, int N, int r) {
    int Tq = (int)canon_zz_len(T, N, r), ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    long col[CANON_R], Tk[CANON_R];   // block s: its columns of att start at col[s], Tk[s] keys
    for (int s = 0; s < N; s++) { col[s] = canon_zz_offset(T, N, s); Tk[s] = canon_zz_len(T, N, s); }
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)B * NH * ntiles; idx++) {
        int tile = (int)(idx % ntiles), bh = (int)(idx / ntiles);
        int t0 = tile * ATT_NR, nr = Tq - t0 < ATT_NR ? Tq - t0 : ATT_NR;
        float* rows = att + ((size_t)bh * Tq + t0) * T;
        int lo[CANON_R][ATT_NR], hi[CANON_R][ATT_NR];
        float zs[CANON_R][ATT_NR], maxv[ATT_NR];
        for (int s = 0; s < N; s++) { cp_key_bounds(lo[s], hi[s], t0, nr, T, N, r, s); }
        for (int i = 0; i < nr; i++) {
            float m = -canon_inf();
            for (int s = 0; s < N; s++) {
                float ms = attn_row_max(rows + (size_t)i * T + col[s], hi[s][i]);
                m = ms > m ? ms : m;
            }
            maxv[i] = m;
        }
        for (int s = 0; s < N; s++) {
            for (int i = 0; i < nr; i++) { exps_shifted(rows + (size_t)i * T + col[s], hi[s][i], maxv[i]); }
            attn_row_sums(zs[s], rows + col[s], T, NULL, 0, nr, hi[s], T, N, s);
        }
        for (int i = 0; i < nr; i++) {
            float z = canon_tree_sum(&zs[0][i], N, ATT_NR);
            for (int s = 0; s < N; s++) {
                float* a = rows + (size_t)i * T + col[s];
                #pragma omp simd
                for (int j = 0; j < hi[s][i]; j++) { a[j] = a[j] / z; }
                for (int j = hi[s][i]; j < Tk[s]; j++) { a[j] = 0.0f; }
            }
        }
    }
}

// out (B,Tq,C) = block s's subtree of att @ v: R2Z over the block's keys (its 8/N chunks)
void attention_values_block(float* out, const float* att, const float* vblk, int B, int T, int C, int NH, int N,
                            int r, int s) {
    int hs = C / NH, BH = B * NH, Tq = (int)canon_zz_len(T, N, r), Tk = (int)canon_zz_len(T, N, s);
    int ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    long col = canon_zz_offset(T, N, s);
    float* vr = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * Tk * hs);
    attn_pack_rows(vr, vblk, C, B, Tk, NH, hs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        AttTile q = attn_tile(idx, ntiles, NH, Tq, 0);
        cp_key_bounds(q.lo, q.hi, q.t0, q.nr, T, N, r, s);
        AttRows av = {att + ((size_t)q.bh * Tq + q.t0) * T + col, T, 1, vr + (size_t)q.bh * Tk * hs, hs,
                      out + ((size_t)q.b * Tq + q.t0) * C + q.h * hs, C, T, N, s, q.lo, q.hi};
        attn_rows(&av, q.nr, hs);
    }
}

// ds block s <- datt = dout . v of the keys each query attends to
void attention_datt_block(float* ds, const float* dout, const float* vblk, int B, int T, int C, int NH, int N,
                          int r, int s) {
    cp_block_products(ds, dout, C, vblk, B, T, C, NH, N, r, s, 1.0f);
}

// ds <- att * (datt - S) * (1/sqrt(hs)) over every block, S = R1 over blocks of each block's
// R2Z subtree of fmaf(att, datt)
void attention_softmax_backward_blocks(float* ds, const float* att, int B, int T, int C, int NH, int N, int r) {
    int Tq = (int)canon_zz_len(T, N, r), ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    float scale = canon_rsqrtf((float)(C / NH));
    long col[CANON_R];   // block s's columns of att and ds start at col[s]
    for (int s = 0; s < N; s++) { col[s] = canon_zz_offset(T, N, s); }
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)B * NH * ntiles; idx++) {
        int tile = (int)(idx % ntiles), bh = (int)(idx / ntiles);
        int t0 = tile * ATT_NR, nr = Tq - t0 < ATT_NR ? Tq - t0 : ATT_NR;
        size_t row0 = ((size_t)bh * Tq + t0) * T;
        int lo[CANON_R][ATT_NR], hi[CANON_R][ATT_NR];
        float ss[CANON_R][ATT_NR];
        for (int s = 0; s < N; s++) {
            cp_key_bounds(lo[s], hi[s], t0, nr, T, N, r, s);
            attn_row_sums(ss[s], att + row0 + col[s], T, ds + row0 + col[s], T, nr, hi[s], T, N, s);
        }
        for (int i = 0; i < nr; i++) {
            float S = canon_tree_sum(&ss[0][i], N, ATT_NR);
            for (int s = 0; s < N; s++) {
                const float* a = att + row0 + (size_t)i * T + col[s];
                float* d = ds + row0 + (size_t)i * T + col[s];
                #pragma omp simd
                for (int j = 0; j < hi[s][i]; j++) { d[j] = a[j] * (d[j] - S) * scale; }
            }
        }
    }
}

// dq (B,Tq,C) = block s's subtree of ds @ k
void attention_dq_block(float* dq, const float* ds, const float* kblk, int B, int T, int C, int NH, int N, int r,
                        int s) {
    attention_values_block(dq, ds, kblk, B, T, C, NH, N, r, s);
}

// dk, dv (B,Tk,C) of block s's keys = this rank's subtree over its queries (R2Z over its slice,
// 8/N chunks) of ds^T @ q and att^T @ dout: the partials the key's owner sums over the ranks
void attention_dkv_block(float* dk, float* dv, const float* ds, const float* att, const float* qkv, const float* dout,
                         int B, int T, int C, int NH, int N, int r, int s) {
    int hs = C / NH, BH = B * NH, Tq = (int)canon_zz_len(T, N, r), Tk = (int)canon_zz_len(T, N, s);
    int ntiles = (Tk + ATT_NR - 1) / ATT_NR;
    float* qr = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * Tq * hs * 2);
    float* dr = qr + (size_t)BH * Tq * hs;
    attn_pack_rows(qr, qkv, 3L * C, B, Tq, NH, hs);
    attn_pack_rows(dr, dout, C, B, Tq, NH, hs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        AttTile kt = attn_tile(idx, ntiles, NH, Tk, 0);   // rows: block s's keys [t0, t0 + nr)
        cp_query_bounds(kt.lo, kt.hi, kt.t0, kt.nr, T, N, r, s);
        size_t cols = (size_t)kt.bh * Tq * T + canon_zz_offset(T, N, s) + kt.t0;
        size_t o = ((size_t)kt.b * Tk + kt.t0) * C + kt.h * hs;
        AttRows k = {ds + cols, 1, T, qr + (size_t)kt.bh * Tq * hs, hs, dk + o, C, T, N, r, kt.lo, kt.hi};
        AttRows v = {att + cols, 1, T, dr + (size_t)kt.bh * Tq * hs, hs, dv + o, C, T, N, r, kt.lo, kt.hi};
        attn_rows(&k, kt.nr, hs);
        attn_rows(&v, kt.nr, hs);
    }
}

// ------------------------------------------------------------------------------------------
// GELU (tanh form), elementwise: out[i] = canon_gelu(inp[i]), dinp[i] = canon_gelu_grad(inp[i])
// * dout[i]. vf_tanh, vf_gelu and vf_gelu_grad are canonical.h's canon_tanhf, canon_gelu and
// canon_gelu_grad in every lane, operation for operation (the constant 3 * 0.044715 folded as
// C folds it); test_kernels compares them over a sweep.
static inline vf vf_tanh(vf x) {
    vf ax = vf_if_negative(x, vf_mul(x, vf_set1(-1.0f)), x);
    vf t = vf_expf(vf_mul(vf_set1(-2.0f), ax));
    vf r = vf_div(vf_sub(vf_set1(1.0f), t), vf_add(vf_set1(1.0f), t));
    return vf_if_negative(x, vf_mul(r, vf_set1(-1.0f)), r);
}
static inline vf vf_gelu(vf x) {
    vf cube = vf_mul(vf_mul(vf_mul(vf_set1(0.044715f), x), x), x);
    vf u = vf_mul(vf_set1(CANON_GELU_SCALE), vf_add(x, cube));
    return vf_mul(vf_mul(vf_set1(0.5f), x), vf_add(vf_set1(1.0f), vf_tanh(u)));
}
static inline vf vf_gelu_grad(vf x) {
    vf cube = vf_mul(vf_mul(vf_mul(vf_set1(0.044715f), x), x), x);
    vf u = vf_mul(vf_set1(CANON_GELU_SCALE), vf_add(x, cube));
    vf th = vf_tanh(u);
    vf sech2 = vf_sub(vf_set1(1.0f), vf_mul(th, th));
    vf du_dx = vf_mul(vf_set1(CANON_GELU_SCALE), vf_add(vf_set1(1.0f), vf_mul(vf_mul(vf_set1(3.0f * 0.044715f), x), x)));
    return vf_add(vf_mul(vf_set1(0.5f), vf_add(vf_set1(1.0f), th)),
                  vf_mul(vf_mul(vf_mul(vf_set1(0.5f), x), sech2), du_dx));
}

void gelu_forward(float* out, const float* inp, size_t n) {
    size_t nvec = n / VLEN;
    #pragma omp parallel for
    for (size_t i = 0; i < nvec; i++) { vf_store(out + i * VLEN, vf_gelu(vf_load(inp + i * VLEN))); }
    for (size_t i = nvec * VLEN; i < n; i++) { out[i] = canon_gelu(inp[i]); }
}

// (may be in place: dinp == dout)
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
    size_t nvec = n / VLEN;
    #pragma omp parallel for
    for (size_t i = 0; i < nvec; i++) {
        vf_store(dinp + i * VLEN, vf_mul(vf_gelu_grad(vf_load(inp + i * VLEN)), vf_load(dout + i * VLEN)));
    }
    for (size_t i = nvec * VLEN; i < n; i++) { dinp[i] = canon_gelu_grad(inp[i]) * dout[i]; }
}

// ------------------------------------------------------------------------------------------
// fused softmax + cross-entropy, per position over the vocabulary (entries v >= V are padding:
// probability 0, never part of a sum):
//   max = max_{v<V} logit, e_v = exp(logit_v - max), Z = R2 over Vp of e_v,
//   probs_v = e_v / Z, loss = log(Z) - (logit_target - max).
// In three phases, so that a vocab-parallel rank (holding the logits (BT,Vl) of vocabulary
// entries [v0, v0 + Vl), i.e. nchunks = 8/tp of the 8 canonical chunks) can finish the max, Z
// and the target logit over its group in between (the model's head). One rank: v0 = 0, Vl = Vp.

// maxes (BT) = the largest real logit of each position among this rank's entries
void crossentropy_max(float* maxes, const float* logits, int BT, int V, int v0, int Vl) {
    long real = V - v0 < Vl ? V - v0 : Vl;   // entries at or past `real` are padding
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) { maxes[i] = attn_row_max(logits + (size_t)i * Vl, real > 0 ? real : 0); }
}

// logits <- exp(logits - max) in place; zs (BT) = the R2 subtree over this rank's chunks;
// target_logits (BT) = the target's logit where this rank holds it, else -0.0f.
void crossentropy_exps(float* zs, float* target_logits, float* logits, const float* maxes,
                       const int* targets, int BT, int V, int v0, int Vl, int nchunks) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        float* p = logits + (size_t)i * Vl;
        int t = targets ? targets[i] - v0 : -1;
        target_logits[i] = t >= 0 && t < Vl ? p[t] : -0.0f;
        long real = V - v0 < Vl ? V - v0 : Vl;   // entries at or past `real` are padding
        exps_shifted(p, real > 0 ? real : 0, maxes[i]);
        float partial[CANON_R];
        for (int ch = 0; ch < nchunks; ch++) {
            float acc = 0.0f;
            long end = ((long)Vl * (ch + 1)) / nchunks;
            for (long v = ((long)Vl * ch) / nchunks; v < end && v < real; v++) { acc = acc + p[v]; }
            partial[ch] = acc;
        }
        zs[i] = canon_tree_sum(partial, nchunks, 1);
    }
}

// probs = exps / Z (0 for padding); losses (BT) = log(Z) - (target logit - max) if targets
void crossentropy_normalize(float* probs, float* losses, const float* zs, const float* target_logits,
                            const float* maxes, const int* targets, int BT, int V, int v0, int Vl) {
    long real = V - v0 < Vl ? (V - v0 > 0 ? V - v0 : 0) : Vl;   // entries at or past `real` are padding
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        float* p = probs + (size_t)i * Vl;
        vf z = vf_set1(zs[i]);
        long v = 0;
        for (; v + VLEN <= real; v += VLEN) { vf_store(p + v, vf_div(vf_load(p + v), z)); }
        for (; v < Vl; v++) { p[v] = v < real ? p[v] / zs[i] : 0.0f; }
        if (targets) { losses[i] = canon_logf(zs[i]) - (target_logits[i] - maxes[i]); }
    }
}

// dlogits (BT,Vl) = (probs - onehot(target)) * dloss, written over probs; 0 for padding.
void crossentropy_backward(float* dlogits_probs, const int* targets, float dloss, int BT, int V,
                           int v0, int Vl) {
    long real = V - v0 < Vl ? (V - v0 > 0 ? V - v0 : 0) : Vl;   // entries at or past `real` are padding
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        float* p = dlogits_probs + (size_t)i * Vl;
        long t = (long)targets[i] - v0;   // the target's entry, if this rank holds it
        float target = t >= 0 && t < real ? p[t] : 0.0f;
        vf d = vf_set1(dloss), zero = vf_zero();
        long v = 0;
        for (; v + VLEN <= real; v += VLEN) { vf_store(p + v, vf_mul(vf_sub(vf_load(p + v), zero), d)); }
        for (; v < real; v++) { p[v] = (p[v] - 0.0f) * dloss; }
        if (t >= 0 && t < real) { p[t] = (target - 1.0f) * dloss; }
    }
}

// ------------------------------------------------------------------------------------------
// The mixture-of-experts layer: loops over moe.h's per-output functions (which the device
// twins call too), and the experts' weight-gradient tiles.

// probs (BT,E) = softmax of logits (BT,E) (probs may be logits); chosen, gates (BT,k)
void moe_router_forward(float* probs, int* chosen, float* gates, const float* logits, int BT, int E, int k) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        moe_router_row(probs + (size_t)i * E, chosen + (size_t)i * k, gates + (size_t)i * k, logits + (size_t)i * E,
                       E, k);
    }
}

// psum (E) = R3 over the positions of probs (B,T,E) of each expert's probability
void moe_expert_prob_sums(float* psum, const float* probs, int B, int T, int E) {
    #pragma omp parallel for
    for (int e = 0; e < E; e++) { psum[e] = position_reduce_elem(probs, E, e, NULL, 0, 0, B, T, 1, 0); }
}

// out (n,C) = rows in[index[i]] of in (., C)
void moe_gather_rows(float* out, const float* in, const int* index, int n, int C) {
    #pragma omp parallel for
    for (int i = 0; i < n; i++) { memcpy(out + (size_t)i * C, in + (size_t)index[i] * C, sizeof(float) * C); }
}

// out (BT,C) = the gated sum of each position's k expert outputs, rows (BT*k,C) at the
// positions' slot rows slot_row (BT,k)
void moe_combine(float* out, const float* rows, const float* gates, const int* slot_row, int BT, int k, int C) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        for (int c = 0; c < C; c++) {
            out[(size_t)i * C + c] = moe_combine_elem(rows, gates + (size_t)i * k, slot_row + (size_t)i * k, k, C, c);
        }
    }
}

// dgate (BT,k) = R2 over C of dout . the slot's expert output; drows (BT*k,C) at the slot rows
// = gate * dout
void moe_combine_backward(float* dgate, float* drows, const float* dout, const float* rows, const float* gates,
                          const int* slot_row, int BT, int k, int C) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        const float* d = dout + (size_t)i * C;
        for (int j = 0; j < k; j++) {
            size_t s = (size_t)i * k + j, r = (size_t)slot_row[s];
            dgate[s] = canon_dot(d, 1, rows + r * C, 1, C);
            for (int c = 0; c < C; c++) { drows[r * C + c] = gates[s] * d[c]; }
        }
    }
}

// dlogits (BT,E) from probs (BT,E), chosen, gates, dgate (BT,k) and daux (E)
void moe_router_backward(float* dlogits, const float* probs, const int* chosen, const float* gates, const float* dgate,
                         const float* daux, int BT, int E, int k) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        moe_router_backward_row(dlogits + (size_t)i * E, probs + (size_t)i * E, chosen + (size_t)i * k,
                                gates + (size_t)i * k, dgate + (size_t)i * k, daux, E, k);
    }
}

// dinp (BT,C) = drouter (BT,C) + the input gradients of the position's k slots, drows (BT*k,C)
void moe_dinput_combine(float* dinp, const float* drouter, const float* drows, const int* slot_row, int BT, int k,
                        int C) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        for (int c = 0; c < C; c++) {
            dinp[(size_t)i * C + c] = moe_dinput_elem(drouter[(size_t)i * C + c], drows, slot_row + (size_t)i * k, k, C, c);
        }
    }
}

// The experts' weight gradients = moe_expert_dweight_naive, bit for bit: matmul_dweight_tile's
// register tiles (MM_NO outputs x nv vectors of columns) walking the leaves of moe.h's
// routing plan instead of the chunks of T.
ALWAYS_INLINE void moe_dweight_tile(float* dweight, const float* dout, const float* inp, const int* leaf, int B,
                                    int IC, int OC, int o0, const int no, int k0, const int nv) {
    vf acc[MM_NO][MM_MV];
    TILE_STACK(partials, CANON_LOG2_R + 34);
    CanonStack stack = tile_stack(partials, no, nv);
    memset(partials, 0, sizeof(float) * MM_NO * MR);   // a source without sequences: 0
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_zero(); }
            }
            for (int r = leaf[b * CANON_R + ch]; r < leaf[b * CANON_R + ch + 1]; r++) {
                const float* x = inp + (size_t)r * IC + k0;
                vf xv[MM_MV];
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { xv[v] = vf_load(x + v * VLEN); }
                _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                    vf d = vf_set1(dout[(size_t)r * OC + o0 + j]);
                    _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_fma(d, xv[v], acc[j][v]); }
                }
            }
            tile_push(&stack, acc, no, nv, canon_pos_merges_after(b, B, ch, CANON_R));
        }
    }
    for (int j = 0; j < no; j++) { memcpy(dweight + (size_t)(o0 + j) * IC + k0, partials + j * MR, sizeof(float) * nv * VLEN); }
}

void moe_expert_dweight(float* dweight, float* dbias, size_t slice, const float* dout, const float* inp,
                        const int* leaf, int nsrc, int B, int IC, int OC) {
    int ogroups = dweight ? (OC + MM_NO - 1) / MM_NO : 0;
    int kvec_end = IC / VLEN * VLEN;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int q = 0; q < nsrc; q++) {
        for (int g = 0; g < ogroups; g++) {
            const int* lq = leaf + (size_t)q * B * CANON_R;
            float* dw = dweight + q * slice;
            int o0 = g * MM_NO;
            int no = OC - o0 < MM_NO ? OC - o0 : MM_NO;
            for (int k0 = 0; k0 < kvec_end; k0 += MR) {
                int nv = (kvec_end - k0) / VLEN < MM_MV ? (kvec_end - k0) / VLEN : MM_MV;
#define EXPERT_TILE(N, V) moe_dweight_tile(dw, dout, inp, lq, B, IC, OC, o0, N, k0, V)
                CPU_TILE(no, nv, EXPERT_TILE);
#undef EXPERT_TILE
            }
            for (int j = 0; j < no; j++) {   // the columns that do not fill a vector
                for (int ic = kvec_end; ic < IC; ic++) {
                    dw[(size_t)(o0 + j) * IC + ic] = moe_rows_reduce_elem(dout, OC, o0 + j, inp, IC, ic, lq, B);
                }
            }
        }
    }
    if (dbias) {
        #pragma omp parallel for collapse(2)
        for (int q = 0; q < nsrc; q++) {
            for (int o = 0; o < OC; o++) {
                dbias[q * slice + o] = moe_rows_reduce_elem(dout, OC, o, NULL, 0, 0, leaf + (size_t)q * B * CANON_R, B);
            }
        }
    }
}

#endif // LLMC_CPU_FAST_H
