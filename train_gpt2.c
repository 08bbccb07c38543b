/*
 * train_gpt2.c: GPT-2 training on the CPU, the reference build.
 *
 * Read top to bottom: the kernels (each forward beside its backward, with the shapes above
 * them), the model (activations; the forward and backward in three parts - embeddings,
 * layers, head - with the tensor-parallel f/g operators where Megatron puts them), the
 * pipeline executor (every run is a pipeline, of one stage without --pp), then the training
 * loop. Parameters, gradients and AdamW live in llmc/zero.h (data parallelism, ZeRO); the
 * communication is llmc/comm.h. Every floating-point reduction follows the canonical order of
 * llmc/canonical.h (rules R1-R6), which is what makes this file the arithmetic truth: the CUDA
 * build in deterministic mode and every parallel layout reproduce its bits.
 *
 * Shapes: B sequences of T tokens, C channels, NH heads of hs = C/NH, vocabulary V padded to
 * Vp, L layers. "BT" is B*T positions, row-major (b, t).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "llmc/utils.h"
#include "llmc/canonical.h"
#include "llmc/simd.h"
#include "llmc/model.h"
#include "llmc/checkpoint.h"
#include "llmc/adamw.h"
#include "llmc/rand.h"
#include "llmc/gpt2_init.h"
#include "llmc/dataloader.h"
#include "llmc/tokenizer.h"
#include "llmc/logger.h"
#include "llmc/args.h"
#include "llmc/comm.h"
#include "llmc/zero.h"
#include "llmc/pipeline.h"
#include "llmc/tensor_parallel.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

// Scratch memory reused across calls (kernels run one at a time; slots keep them apart).
enum { SCRATCH_PACK, SCRATCH_DINP, SCRATCH_ATT, SCRATCH_SORT, SCRATCH_TREE, NUM_SCRATCH };
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

// ==========================================================================================
// Kernels
// ==========================================================================================

// ------------------------------------------------------------------------------------------
// encoder: token + position embedding, in two steps so that a vocab-parallel rank (holding
// rows [v0, v0 + Vl) of wte) can sum the lookups over its group in between:
// out (B,T,C) = wte[inp[b,t]] for tokens it holds, -0.0f for the others (x + -0 == x, so the
// sum over the group is exact); then out += wpe[t] (maxT,C).
void encoder_lookup(float* out, const int* inp, const float* wte, int v0, int Vl, int BT, int C) {
    #pragma omp parallel for
    for (int bt = 0; bt < BT; bt++) {
        int v = inp[bt] - v0;
        float* o = out + (size_t)bt * C;
        if (v >= 0 && v < Vl) {
            memcpy(o, wte + (size_t)v * C, sizeof(float) * C);
        } else {
            for (int c = 0; c < C; c++) { o[c] = -0.0f; }
        }
    }
}

void encoder_add_positions(float* out, const float* wpe, int B, int T, int C) {
    #pragma omp parallel for
    for (int bt = 0; bt < B * T; bt++) {
        const float* pe = wpe + (size_t)(bt % T) * C;
        float* o = out + (size_t)bt * C;
        for (int c = 0; c < C; c++) { o[c] = o[c] + pe[c]; }
    }
}

// dwte_emb (Vl,C) for the vocabulary rows [v0, v0 + Vl), dwpe (maxT,C) <- dout (B,T,C). Both
// are R3 reductions over positions:
// dwpe[t] gets one term per sequence (its R2 chunk sum is 0.0f + dout[b,t]), combined by the
// R1 tree over sequences; dwte_emb[v] sums the positions holding token v: per sequence the R2
// chunk sums over t (0.0f for chunks without v), then R1 over sequences. Rows of tokens not
// in the batch are 0. Every element is written (no accumulation into old values).
void encoder_backward(float* dwte_emb, float* dwpe, const float* dout, const int* inp,
                      int B, int T, int C, int v0, int Vl, int maxT) {
    #pragma omp parallel for
    for (int t = 0; t < maxT; t++) {
        float* dst = dwpe + (size_t)t * C;
        if (t >= T) { memset(dst, 0, sizeof(float) * C); continue; }
        for (int c = 0; c < C; c++) {
            float stack[64];
            int top = 0;
            for (int b = 0; b < B; b++) {
                stack[top++] = 0.0f + dout[((size_t)b * T + t) * C + c];
                for (int m = canon_tree_merges_after(b, B); m > 0; m--) {
                    float right = stack[--top];
                    stack[top - 1] = stack[top - 1] + right;
                }
            }
            dst[c] = stack[0];
        }
    }
    // counting sort of the positions by (local) token id: positions of token v0 + v are
    // order[first[v] .. first[v+1]) in (b, t) order; other ranks' tokens are left out
    int BT = B * T;
    int* first = (int*)scratch(SCRATCH_SORT, sizeof(int) * (2 * (size_t)Vl + 1 + (size_t)BT));
    int* cursor = first + Vl + 1;
    int* order = cursor + Vl;
    memset(first, 0, sizeof(int) * ((size_t)Vl + 1));
    for (int i = 0; i < BT; i++) {
        int v = inp[i] - v0;
        if (v >= 0 && v < Vl) { first[v + 1]++; }
    }
    for (int v = 0; v < Vl; v++) { first[v + 1] += first[v]; }
    memcpy(cursor, first, sizeof(int) * (size_t)Vl);
    for (int i = 0; i < BT; i++) {
        int v = inp[i] - v0;
        if (v >= 0 && v < Vl) { order[cursor[v]++] = i; }
    }
    memset(dwte_emb, 0, sizeof(float) * (size_t)Vl * C);
    int depth = 2 + CANON_LOG2_R + 32;
    int nthreads = 1;
#ifdef _OPENMP
    nthreads = omp_get_max_threads();
#endif
    float* stacks = scratch(SCRATCH_TREE, sizeof(float) * (size_t)depth * C * nthreads);
    #pragma omp parallel for schedule(dynamic, 1)
    for (int v = 0; v < Vl; v++) {
        int begin = first[v], end = first[v + 1];
        if (begin == end) { continue; }
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float* stack = stacks + (size_t)tid * depth * C;
        int top = 0;
        int next = begin;   // next position of token v, in (b, t) order
        for (int b = 0; b < B; b++) {
            for (int ch = 0; ch < CANON_R; ch++) {
                int t_end = (int)canon_chunk_begin(T, ch + 1);
                float* acc = stack + (size_t)top * C;
                for (int c = 0; c < C; c++) { acc[c] = 0.0f; }
                while (next < end && order[next] < b * T + t_end) {
                    const float* d = dout + (size_t)order[next] * C;
                    for (int c = 0; c < C; c++) { acc[c] = acc[c] + d[c]; }
                    next++;
                }
                top++;
                for (int m = canon_pos_merges_after(b, B, ch); m > 0; m--) {
                    float* right = stack + (size_t)(top - 1) * C;
                    float* left = stack + (size_t)(top - 2) * C;
                    for (int c = 0; c < C; c++) { left[c] = left[c] + right[c]; }
                    top--;
                }
            }
        }
        memcpy(dwte_emb + (size_t)v * C, stack, sizeof(float) * C);
    }
}

// ------------------------------------------------------------------------------------------
// layernorm, per position over C (R2), eps 1e-5:
// mean = sum(x)/C, var = sum((x-mean)^2)/C, rstd = 1/sqrt(var+eps), n = (x-mean)*rstd,
// out = fmaf(n, weight, bias).   inp, out (BT,C); mean, rstd (BT)
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int BT, int C) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        const float* x = inp + (size_t)i * C;
        float m = canon_sum(x, C, 1) / (float)C;
        float partial[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) {
            float acc = 0.0f;
            for (long c = canon_chunk_begin(C, ch); c < canon_chunk_begin(C, ch + 1); c++) {
                float d = x[c] - m;
                acc = fmaf(d, d, acc);
            }
            partial[ch] = acc;
        }
        float var = canon_tree8(partial) / (float)C;
        float s = canon_rsqrtf(var + 1e-5f);
        float* o = out + (size_t)i * C;
        for (int c = 0; c < C; c++) { o[c] = fmaf((x[c] - m) * s, weight[c], bias[c]); }
        mean[i] = m;
        rstd[i] = s;
    }
}

// dres (BT,C) <- dres + dinp_ln, where with n = (x-mean)*rstd, dnorm = dout*weight:
// dinp_ln = ((dnorm - mean(dnorm)) - n * mean(dnorm*n)) * rstd  (the means are R2 over C).
// dweight[c] = R3 over positions of dout*n (fmaf), dbias[c] = R3 of dout.  B,T for R3.
// Under sequence parallelism a rank holds T = T_full/K positions of each sequence, i.e.
// nchunks = 8/K of every sequence's 8 canonical chunks: then seq_partials (2,B,C) receives
// each sequence's subtree for dweight and dbias, for the caller to finish over the group and
// over the sequences (sequence_tree); otherwise (seq_partials NULL, nchunks 8) the R3 is done
// here.
void layernorm_backward(float* dres, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int B, int T, int C, int nchunks, float* seq_partials) {
    int BT = B * T;
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        const float* x = inp + (size_t)i * C;
        const float* dy = dout + (size_t)i * C;
        float m = mean[i], s = rstd[i];
        float p1[CANON_R], p2[CANON_R];
        for (int ch = 0; ch < CANON_R; ch++) {
            float a1 = 0.0f, a2 = 0.0f;
            for (long c = canon_chunk_begin(C, ch); c < canon_chunk_begin(C, ch + 1); c++) {
                float n = (x[c] - m) * s;
                float dnorm = dy[c] * weight[c];
                a1 = a1 + dnorm;
                a2 = fmaf(dnorm, n, a2);
            }
            p1[ch] = a1;
            p2[ch] = a2;
        }
        float dnorm_mean = canon_tree8(p1) / (float)C;
        float dnorm_norm_mean = canon_tree8(p2) / (float)C;
        float* dr = dres + (size_t)i * C;
        for (int c = 0; c < C; c++) {
            float n = (x[c] - m) * s;
            float dnorm = dy[c] * weight[c];
            float dx = ((dnorm - dnorm_mean) - n * dnorm_norm_mean) * s;
            dr[c] = dr[c] + dx;
        }
    }
    // parameter gradients: R3 (or its per-sequence subtrees), vectorised across channels
    #pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += 64) {
        int cn = C - c0 < 64 ? C - c0 : 64;
        float sw[40][64], sb[40][64];
        int top = 0;
        for (int b = 0; b < B; b++) {
            for (int ch = 0; ch < nchunks; ch++) {
                float aw[64], ab[64];
                for (int j = 0; j < cn; j++) { aw[j] = 0.0f; ab[j] = 0.0f; }
                long tb = ((long)T * ch) / nchunks, te = ((long)T * (ch + 1)) / nchunks;
                for (long t = tb; t < te; t++) {
                    size_t i = (size_t)b * T + t;
                    const float* x = inp + i * C + c0;
                    const float* dy = dout + i * C + c0;
                    for (int j = 0; j < cn; j++) {
                        float n = (x[j] - mean[i]) * rstd[i];
                        aw[j] = fmaf(dy[j], n, aw[j]);
                        ab[j] = ab[j] + dy[j];
                    }
                }
                memcpy(sw[top], aw, sizeof(float) * cn);
                memcpy(sb[top], ab, sizeof(float) * cn);
                top++;
                int merges = canon_tree_merges_after(ch, nchunks);
                if (!seq_partials && ch == nchunks - 1) { merges += canon_tree_merges_after(b, B); }
                for (int mg = merges; mg > 0; mg--) {
                    for (int j = 0; j < cn; j++) {
                        sw[top - 2][j] = sw[top - 2][j] + sw[top - 1][j];
                        sb[top - 2][j] = sb[top - 2][j] + sb[top - 1][j];
                    }
                    top--;
                }
            }
            if (seq_partials) {   // this sequence's subtree; the caller finishes the tree
                memcpy(seq_partials + (size_t)b * C + c0, sw[0], sizeof(float) * cn);
                memcpy(seq_partials + ((size_t)B + b) * C + c0, sb[0], sizeof(float) * cn);
                top = 0;
            }
        }
        if (!seq_partials) {
            memcpy(dweight + c0, sw[0], sizeof(float) * cn);
            memcpy(dbias + c0, sb[0], sizeof(float) * cn);
        }
    }
}

// out[c] = the R1 tree over sequences b of partials[b][c] (B,n): the last level of an R3
// reduction whose per-sequence sums were finished elsewhere (sequence parallelism).
void sequence_tree(float* out, const float* partials, int B, int n) {
    #pragma omp parallel for
    for (int c = 0; c < n; c++) { out[c] = canon_tree_sum(partials + c, B, n); }
}

// ------------------------------------------------------------------------------------------
// matmul: out (BT,OC) = inp (BT,K) @ weight (OC,K)^T + bias (OC)
//
// Each output is the R2 reduction over k with `nchunks` chunks (CANON_R; a tensor-parallel
// rank holding a 1/tp slice of k uses CANON_R/tp chunks and finishes the tree across ranks),
// products fused with fmaf, and the bias added after the tree.
// The CPU kernel vectorises across ROWS: a tile of MR rows x up to 6 outputs keeps 12 vector
// accumulators; inp is packed transposed so each k gives one vector load per MR/VLEN rows.
#define MM_NO 6
#define MM_MV (VLEN == 16 ? 4 : 2)   // vectors of rows per tile: 24 accumulators with AVX-512's 32 registers
#define MR (MM_MV * VLEN)

ALWAYS_INLINE void matmul_forward_tile(float* out, const float* packed, const float* weight,
                                       const float* bias, int K, int OC, int o0, const int no,
                                       int bt0, int nbt, int nchunks) {
    vf acc[MM_NO][MM_MV];
    vf stack[CANON_LOG2_R + 2][MM_NO][MM_MV];
    int top = 0;
    for (int ch = 0; ch < nchunks; ch++) {
        int kb = (int)(((long)K * ch) / nchunks), ke = (int)(((long)K * (ch + 1)) / nchunks);
        _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) { acc[j][v] = vf_zero(); }
        }
        for (int k = kb; k < ke; k++) {
            vf a[MM_MV];
            _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) { a[v] = vf_load(packed + (size_t)k * MR + v * VLEN); }
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                vf w = vf_set1(weight[(size_t)(o0 + j) * K + k]);
                _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) { acc[j][v] = vf_fma(a[v], w, acc[j][v]); }
            }
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) { stack[top][j][v] = acc[j][v]; }
        }
        top++;
        for (int m = canon_tree_merges_after(ch, nchunks); m > 0; m--) {
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < MM_MV; v++) {
                    stack[top - 2][j][v] = vf_add(stack[top - 2][j][v], stack[top - 1][j][v]);
                }
            }
            top--;
        }
    }
    float tile[MR];
    for (int j = 0; j < no; j++) {
        for (int v = 0; v < MM_MV; v++) { vf_store(tile + v * VLEN, stack[0][j][v]); }
        float* o = out + (size_t)bt0 * OC + o0 + j;
        if (bias) {
            float bj = bias[o0 + j];
            for (int i = 0; i < nbt; i++) { o[(size_t)i * OC] = tile[i] + bj; }
        } else {
            for (int i = 0; i < nbt; i++) { o[(size_t)i * OC] = tile[i]; }
        }
    }
}

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int BT, int K, int OC, int nchunks) {
    // pack inp as blocks of MR rows, transposed: packed[block][k][MR], zero rows past BT
    int nblocks = (BT + MR - 1) / MR;
    float* packed = scratch(SCRATCH_PACK, sizeof(float) * (size_t)nblocks * K * MR);
    #pragma omp parallel for
    for (int blk = 0; blk < nblocks; blk++) {
        float* p = packed + (size_t)blk * K * MR;
        for (int i = 0; i < MR; i++) {
            int bt = blk * MR + i;
            if (bt < BT) {
                const float* row = inp + (size_t)bt * K;
                for (int k = 0; k < K; k++) { p[(size_t)k * MR + i] = row[k]; }
            } else {
                for (int k = 0; k < K; k++) { p[(size_t)k * MR + i] = 0.0f; }
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
            const float* p = packed + (size_t)blk * K * MR;
            for (int g = ot * 8; g < ogroups && g < ot * 8 + 8; g++) {
                int o0 = g * MM_NO;
                int no = OC - o0 < MM_NO ? OC - o0 : MM_NO;
                switch (no) {
                    case 6: matmul_forward_tile(out, p, weight, bias, K, OC, o0, 6, bt0, nbt, nchunks); break;
                    case 5: matmul_forward_tile(out, p, weight, bias, K, OC, o0, 5, bt0, nbt, nchunks); break;
                    case 4: matmul_forward_tile(out, p, weight, bias, K, OC, o0, 4, bt0, nbt, nchunks); break;
                    case 3: matmul_forward_tile(out, p, weight, bias, K, OC, o0, 3, bt0, nbt, nchunks); break;
                    case 2: matmul_forward_tile(out, p, weight, bias, K, OC, o0, 2, bt0, nbt, nchunks); break;
                    default: matmul_forward_tile(out, p, weight, bias, K, OC, o0, 1, bt0, nbt, nchunks); break;
                }
            }
        }
    }
}

// Backward of the matmul, three reductions:
//  dinp (BT,K)  = dout (BT,OC) @ weight (OC,K): R2 over the OUTPUTS o. A weight made of
//                 `groups` fused matrices (qkv: 3) is chunked per group: chunk c is the c-th
//                 slice of every group, in group order, so that a column-parallel split by
//                 heads (rank r owns slice r of q, of k and of v) owns whole chunks.
//  dweight (OC,K) = R3 over positions of dout[.,o] * inp[.,k];   dbias (OC) = R3 of dout.
// Every element is written (=), never accumulated.
// dinp, one register tile: rows [bt0, bt0+nr) x columns [k0, k0 + nv*VLEN), over the outputs
// o in [ob, oe) of the current chunk, continuing the partial sums in acc_mem (zero = start).
ALWAYS_INLINE void matmul_dinp_tile(float* acc_mem, const float* dout, const float* weight,
                                    int K, int OC, int ob, int oe, int start, int bt0,
                                    const int nr, int k0, const int nv) {
    vf acc[MM_NO][MM_MV];
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
            acc[r][v] = start ? vf_zero() : vf_load(acc_mem + (size_t)(bt0 + r) * K + k0 + v * VLEN);
        }
    }
    for (int o = ob; o < oe; o++) {
        const float* w = weight + (size_t)o * K + k0;
        vf wv[MM_MV];
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { wv[v] = vf_load(w + v * VLEN); }
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            vf d = vf_set1(dout[(size_t)(bt0 + r) * OC + o]);
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_fma(d, wv[v], acc[r][v]); }
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { vf_store(acc_mem + (size_t)(bt0 + r) * K + k0 + v * VLEN, acc[r][v]); }
    }
}

ALWAYS_INLINE void matmul_dinp_rows(float* acc_mem, const float* dout, const float* weight, int BT,
                                    int K, int OC, int ob, int oe, int start, int k0, const int nv) {
    int bt0 = 0;
    for (; bt0 + MM_NO <= BT; bt0 += MM_NO) {
        matmul_dinp_tile(acc_mem, dout, weight, K, OC, ob, oe, start, bt0, MM_NO, k0, nv);
    }
    switch (BT - bt0) {
        case 5: matmul_dinp_tile(acc_mem, dout, weight, K, OC, ob, oe, start, bt0, 5, k0, nv); break;
        case 4: matmul_dinp_tile(acc_mem, dout, weight, K, OC, ob, oe, start, bt0, 4, k0, nv); break;
        case 3: matmul_dinp_tile(acc_mem, dout, weight, K, OC, ob, oe, start, bt0, 3, k0, nv); break;
        case 2: matmul_dinp_tile(acc_mem, dout, weight, K, OC, ob, oe, start, bt0, 2, k0, nv); break;
        case 1: matmul_dinp_tile(acc_mem, dout, weight, K, OC, ob, oe, start, bt0, 1, k0, nv); break;
        default: break;
    }
}

// all rows, columns [k0, k0 + nv*VLEN), nv <= MM_MV (a compile-time constant in each case)
static void matmul_dinp_block(float* acc_mem, const float* dout, const float* weight, int BT,
                              int K, int OC, int ob, int oe, int start, int k0, int nv) {
    switch (nv) {
        case 1: matmul_dinp_rows(acc_mem, dout, weight, BT, K, OC, ob, oe, start, k0, 1); break;
        case 2: matmul_dinp_rows(acc_mem, dout, weight, BT, K, OC, ob, oe, start, k0, 2); break;
#if MM_MV > 2
        case 3: matmul_dinp_rows(acc_mem, dout, weight, BT, K, OC, ob, oe, start, k0, 3); break;
        case 4: matmul_dinp_rows(acc_mem, dout, weight, BT, K, OC, ob, oe, start, k0, 4); break;
#endif
        default: fatal("internal: matmul_dinp_block with %d vectors", nv);
    }
}

// One output element of dinp, scalar, for the columns that do not fill a vector.
static float matmul_dinp_elem(const float* dout_row, const float* weight, int k, int K, int OC,
                              int groups, int nchunks) {
    float stack[CANON_LOG2_R + 2] = {0.0f};
    int top = 0;
    int og = OC / groups;
    for (int ch = 0; ch < nchunks; ch++) {
        float acc = 0.0f;
        for (int g = 0; g < groups; g++) {
            int ob = g * og + (int)(((long)og * ch) / nchunks);
            int oe = g * og + (int)(((long)og * (ch + 1)) / nchunks);
            for (int o = ob; o < oe; o++) { acc = fmaf(dout_row[o], weight[(size_t)o * K + k], acc); }
        }
        stack[top++] = acc;
        for (int m = canon_tree_merges_after(ch, nchunks); m > 0; m--) {
            stack[top - 2] = stack[top - 2] + stack[top - 1];
            top--;
        }
    }
    return stack[0];
}

// dinp (BT,K): each chunk's partial for every (row, k) is accumulated in memory, MM_DINP_OB
// outputs at a time (so a block of weight columns stays in L1 while every row tile passes
// over it), then pushed on the R1 stack; the bottom of the stack is dinp itself.
#define MM_DINP_OB 128
static void matmul_backward_dinp(float* dinp, const float* dout, const float* weight, int BT,
                                 int K, int OC, int groups, int nchunks) {
    float* level[CANON_LOG2_R + 2];
    float* extra = scratch(SCRATCH_DINP, sizeof(float) * (size_t)(CANON_LOG2_R + 1) * BT * K);
    level[0] = dinp;
    for (int i = 1; i < CANON_LOG2_R + 2; i++) { level[i] = extra + (size_t)(i - 1) * BT * K; }
    int kvec_end = K / VLEN * VLEN;
    int ktiles = (kvec_end + MM_MV * VLEN - 1) / (MM_MV * VLEN);
    int og = OC / groups;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int kt = 0; kt < ktiles; kt++) {
        int k0 = kt * MM_MV * VLEN;
        int nv = kvec_end - k0 >= MM_MV * VLEN ? MM_MV : (kvec_end - k0) / VLEN;
        int top = 0;
        for (int ch = 0; ch < nchunks; ch++) {
            float* acc = level[top];
            int start = 1;
            for (int g = 0; g < groups; g++) {
                int sb = g * og + (int)(((long)og * ch) / nchunks);
                int se = g * og + (int)(((long)og * (ch + 1)) / nchunks);
                for (int ob = sb; ob < se; ob += MM_DINP_OB) {
                    int oe = se - ob < MM_DINP_OB ? se : ob + MM_DINP_OB;
                    matmul_dinp_block(acc, dout, weight, BT, K, OC, ob, oe, start, k0, nv);
                    start = 0;
                }
            }
            if (start) {   // an empty chunk: its partial is 0
                for (int r = 0; r < BT; r++) {
                    for (int k = k0; k < k0 + nv * VLEN; k++) { acc[(size_t)r * K + k] = 0.0f; }
                }
            }
            top++;
            for (int m = canon_tree_merges_after(ch, nchunks); m > 0; m--) {
                float* left = level[top - 2];
                const float* right = level[top - 1];
                for (int r = 0; r < BT; r++) {
                    _Pragma("GCC unroll 8") for (int v = 0; v < nv; v++) {
                        size_t at = (size_t)r * K + k0 + v * VLEN;
                        vf_store(left + at, vf_add(vf_load(left + at), vf_load(right + at)));
                    }
                }
                top--;
            }
        }
    }
    if (kvec_end < K) {
        #pragma omp parallel for
        for (int r = 0; r < BT; r++) {
            for (int k = kvec_end; k < K; k++) {
                dinp[(size_t)r * K + k] = matmul_dinp_elem(dout + (size_t)r * OC, weight, k, K, OC, groups, nchunks);
            }
        }
    }
}

// dW tile: MM_NO outputs x (nv*VLEN) columns, all positions (R3).
ALWAYS_INLINE void matmul_dweight_tile(float* dweight, const float* dout, const float* inp,
                                       int B, int T, int K, int OC, int o0, const int no,
                                       int k0, const int nv) {
    vf acc[MM_NO][MM_MV];
    vf stack[CANON_LOG2_R + 34][MM_NO][MM_MV];
    int top = 0;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_zero(); }
            }
            for (long t = canon_chunk_begin(T, ch); t < canon_chunk_begin(T, ch + 1); t++) {
                size_t pos = (size_t)b * T + t;
                const float* x = inp + pos * K + k0;
                vf xv[MM_MV];
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { xv[v] = vf_load(x + v * VLEN); }
                _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                    vf d = vf_set1(dout[pos * OC + o0 + j]);
                    _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_fma(d, xv[v], acc[j][v]); }
                }
            }
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { stack[top][j][v] = acc[j][v]; }
            }
            top++;
            for (int m = canon_pos_merges_after(b, B, ch); m > 0; m--) {
                _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                    _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
                        stack[top - 2][j][v] = vf_add(stack[top - 2][j][v], stack[top - 1][j][v]);
                    }
                }
                top--;
            }
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { vf_store(dweight + (size_t)(o0 + j) * K + k0 + v * VLEN, stack[0][j][v]); }
    }
}

// R3 over positions of dout[pos][o] * x[pos][k] (x = NULL: of dout[pos][o] alone), scalar.
static float position_reduce_elem(const float* dout, int OC, int o, const float* x, int K, int k,
                                  int B, int T) {
    float stack[CANON_LOG2_R + 34];
    int top = 0;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            float acc = 0.0f;
            for (long t = canon_chunk_begin(T, ch); t < canon_chunk_begin(T, ch + 1); t++) {
                size_t pos = (size_t)b * T + t;
                acc = x ? fmaf(dout[pos * OC + o], x[pos * K + k], acc) : acc + dout[pos * OC + o];
            }
            stack[top++] = acc;
            for (int m = canon_pos_merges_after(b, B, ch); m > 0; m--) {
                stack[top - 2] = stack[top - 2] + stack[top - 1];
                top--;
            }
        }
    }
    return stack[0];
}

ALWAYS_INLINE void matmul_dweight_cols(float* dweight, const float* dout, const float* inp,
                                       int B, int T, int K, int OC, int o0, const int no) {
    int kvec_end = K / VLEN * VLEN;
    for (int k0 = 0; k0 < kvec_end; k0 += MM_MV * VLEN) {
        switch ((kvec_end - k0) / VLEN < MM_MV ? (kvec_end - k0) / VLEN : MM_MV) {
            case 1: matmul_dweight_tile(dweight, dout, inp, B, T, K, OC, o0, no, k0, 1); break;
#if MM_MV > 2
            case 3: matmul_dweight_tile(dweight, dout, inp, B, T, K, OC, o0, no, k0, 3); break;
            case 4: matmul_dweight_tile(dweight, dout, inp, B, T, K, OC, o0, no, k0, 4); break;
#endif
            default: matmul_dweight_tile(dweight, dout, inp, B, T, K, OC, o0, no, k0, 2); break;
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
        for (int k = kvec_end; k < K; k++) {
            dweight[(size_t)(o0 + j) * K + k] = position_reduce_elem(dout, OC, o0 + j, inp, K, k, B, T);
        }
    }
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int B, int T, int K, int OC,
                     int groups, int nchunks) {
    if (dinp) { matmul_backward_dinp(dinp, dout, weight, B * T, K, OC, groups, nchunks); }
    // dweight: tasks of MM_NO outputs
    int ogroups = dweight ? (OC + MM_NO - 1) / MM_NO : 0;
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < ogroups; g++) {
        int o0 = g * MM_NO;
        int no = OC - o0 < MM_NO ? OC - o0 : MM_NO;
        switch (no) {
            case 6: matmul_dweight_cols(dweight, dout, inp, B, T, K, OC, o0, 6); break;
            case 5: matmul_dweight_cols(dweight, dout, inp, B, T, K, OC, o0, 5); break;
            case 4: matmul_dweight_cols(dweight, dout, inp, B, T, K, OC, o0, 4); break;
            case 3: matmul_dweight_cols(dweight, dout, inp, B, T, K, OC, o0, 3); break;
            case 2: matmul_dweight_cols(dweight, dout, inp, B, T, K, OC, o0, 2); break;
            default: matmul_dweight_cols(dweight, dout, inp, B, T, K, OC, o0, 1); break;
        }
    }
    if (dbias) {
        #pragma omp parallel for
        for (int o = 0; o < OC; o++) { dbias[o] = position_reduce_elem(dout, OC, o, NULL, 0, 0, B, T); }
    }
}

// ------------------------------------------------------------------------------------------
// attention, causal, per (b, h) with hs = C/NH:
//   qkv (B,T,3C) holds q | k | v, head h at channels [h*hs, (h+1)*hs) of each
//   s[t][t2] = dot(q_t, k_t2) * (1/sqrt(hs))     R2 over hs, for t2 <= t
//   att[t][t2] = exp(s - max_t2 s) / Z_t,  Z_t = R2 over keys (chunks of T) of the exps
//   out[t] = R2 over keys t2 <= t of att[t][t2] * v_t2        out (B,T,C), att (B,NH,T,T)
// Keys past t are not part of any sum (an empty stretch of a chunk adds nothing).
// out (n) = R2 over j of w[j] * rows[j] for the j in [lo, hi) of a dimension of length T (the
// keys, or the queries): chunk c of T accumulates its j's in order with fmaf, the 8 partial
// rows are combined by R1; positions outside [lo, hi) are not part of the sum.
static void attention_weighted_rows(float* out, const float* w, long wstride, const float* rows,
                                    long rstride, int T, long lo, long hi, int n) {
    float stack[CANON_LOG2_R + 1][256];
    int top = 0;
    for (int ch = 0; ch < CANON_R; ch++) {
        float* acc = stack[top];
        for (int d = 0; d < n; d++) { acc[d] = 0.0f; }
        long b = canon_chunk_begin(T, ch), e = canon_chunk_begin(T, ch + 1);
        for (long j = b < lo ? lo : b; j < e && j < hi; j++) {
            float wj = w[j * wstride];
            const float* r = rows + j * rstride;
            for (int d = 0; d < n; d++) { acc[d] = fmaf(wj, r[d], acc[d]); }
        }
        top++;
        for (int m = canon_tree_merges_after(ch, CANON_R); m > 0; m--) {
            for (int d = 0; d < n; d++) { stack[top - 2][d] = stack[top - 2][d] + stack[top - 1][d]; }
            top--;
        }
    }
    memcpy(out, stack[0], sizeof(float) * n);
}

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    size_t C3 = 3 * (size_t)C;
    float scale = canon_rsqrtf((float)hs);
    #pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            for (int t = 0; t < T; t++) {
                const float* q = qkv + ((size_t)b * T + t) * C3 + h * hs;
                float* a = att + (((size_t)b * NH + h) * T + t) * T;
                float maxv = -canon_inf();
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    a[t2] = canon_dot(q, 1, k, 1, hs) * scale;
                    if (a[t2] > maxv) { maxv = a[t2]; }
                }
                float partial[CANON_R];
                for (int ch = 0; ch < CANON_R; ch++) {
                    float acc = 0.0f;
                    long end = canon_chunk_begin(T, ch + 1);
                    for (long t2 = canon_chunk_begin(T, ch); t2 < end && t2 <= t; t2++) {
                        a[t2] = canon_expf(a[t2] - maxv);
                        acc = acc + a[t2];
                    }
                    partial[ch] = acc;
                }
                float z = canon_tree8(partial);
                for (int t2 = 0; t2 <= t; t2++) { a[t2] = a[t2] / z; }
                for (int t2 = t + 1; t2 < T; t2++) { a[t2] = 0.0f; }
                attention_weighted_rows(out + ((size_t)b * T + t) * C + h * hs, a, 1,
                                        qkv + (size_t)b * T * C3 + 2 * C + h * hs, C3, T, 0, t + 1, hs);
            }
        }
    }
}

// Backward, per (b, h):
//   datt[t][t2] = dot(dout_t, v_t2)                       R2 over hs
//   S_t = R2 over keys of fmaf(att, datt);  ds = att * (datt - S_t) * scale
//   dq_t  = R2 over keys t2 <= t of ds[t][t2] * k_t2
//   dk_t2 = R2 over queries t >= t2 (chunks of T) of ds[t][t2] * q_t
//   dv_t2 = R2 over queries t >= t2 of att[t][t2] * dout_t          dqkv (B,T,3C) written
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                        int B, int T, int C, int NH) {
    int hs = C / NH;
    size_t C3 = 3 * (size_t)C;
    float scale = canon_rsqrtf((float)hs);
    float* ds_all = scratch(SCRATCH_ATT, sizeof(float) * (size_t)B * NH * T * T);
    #pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            float* ds = ds_all + ((size_t)b * NH + h) * T * T;
            const float* at = att + ((size_t)b * NH + h) * T * T;
            for (int t = 0; t < T; t++) {
                const float* dy = dout + ((size_t)b * T + t) * C + h * hs;
                float* dst = ds + (size_t)t * T;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    dst[t2] = canon_dot(dy, 1, v, 1, hs);
                }
                float partial[CANON_R];
                for (int ch = 0; ch < CANON_R; ch++) {
                    float acc = 0.0f;
                    long end = canon_chunk_begin(T, ch + 1);
                    for (long t2 = canon_chunk_begin(T, ch); t2 < end && t2 <= t; t2++) {
                        acc = fmaf(at[(size_t)t * T + t2], dst[t2], acc);
                    }
                    partial[ch] = acc;
                }
                float S = canon_tree8(partial);
                for (int t2 = 0; t2 <= t; t2++) { dst[t2] = at[(size_t)t * T + t2] * (dst[t2] - S) * scale; }
            }
            const float* seq = qkv + (size_t)b * T * C3 + h * hs;   // q of position 0, head h
            for (int t = 0; t < T; t++) {   // dq: over keys t2 <= t
                attention_weighted_rows(dqkv + ((size_t)b * T + t) * C3 + h * hs, ds + (size_t)t * T, 1,
                                        seq + C, C3, T, 0, t + 1, hs);
            }
            for (int t2 = 0; t2 < T; t2++) {   // dk, dv: over queries t >= t2
                attention_weighted_rows(dqkv + ((size_t)b * T + t2) * C3 + C + h * hs, ds + t2, T,
                                        seq, C3, T, t2, T, hs);
                attention_weighted_rows(dqkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs, at + t2, T,
                                        dout + (size_t)b * T * C + h * hs, C, T, t2, T, hs);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// GELU (tanh form), elementwise
void gelu_forward(float* out, const float* inp, size_t n) {
    #pragma omp parallel for simd
    for (size_t i = 0; i < n; i++) { out[i] = canon_gelu(inp[i]); }
}

// dinp = gelu'(inp) * dout (may be in place: dinp == dout)
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
    #pragma omp parallel for simd
    for (size_t i = 0; i < n; i++) { dinp[i] = canon_gelu_grad(inp[i]) * dout[i]; }
}

// out = a + b, elementwise (the residual stream)
void residual_forward(float* out, const float* a, const float* b, size_t n) {
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) { out[i] = a[i] + b[i]; }
}

// ------------------------------------------------------------------------------------------
// fused softmax + cross-entropy, per position over the vocabulary (entries v >= V are padding:
// probability 0, never part of a sum):
//   max = max_{v<V} logit, e_v = exp(logit_v - max), Z = R2 over Vp of e_v,
//   probs_v = e_v / Z, loss = log(Z) - (logit_target - max).
// In three phases, so that a vocab-parallel rank (holding the logits (BT,Vl) of vocabulary
// entries [v0, v0 + Vl), i.e. nchunks = 8/K of the 8 canonical chunks) can finish the max, Z
// and the target logit over its group in between (head_forward). One rank: v0 = 0, Vl = Vp.

// maxes (BT) = the largest real logit of each position among this rank's entries
void crossentropy_max(float* maxes, const float* logits, int BT, int V, int v0, int Vl) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        const float* p = logits + (size_t)i * Vl;
        float m = -canon_inf();
        for (int v = 0; v < Vl && v0 + v < V; v++) { if (p[v] > m) { m = p[v]; } }
        maxes[i] = m;
    }
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
        float partial[CANON_R];
        for (int ch = 0; ch < nchunks; ch++) {
            float acc = 0.0f;
            long end = ((long)Vl * (ch + 1)) / nchunks;
            for (long v = ((long)Vl * ch) / nchunks; v < end && v0 + v < V; v++) {
                p[v] = canon_expf(p[v] - maxes[i]);
                acc = acc + p[v];
            }
            partial[ch] = acc;
        }
        zs[i] = canon_tree_sum(partial, nchunks, 1);
    }
}

// probs = exps / Z (0 for padding); losses (BT) = log(Z) - (target logit - max) if targets
void crossentropy_normalize(float* probs, float* losses, const float* zs, const float* target_logits,
                            const float* maxes, const int* targets, int BT, int V, int v0, int Vl) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        float* p = probs + (size_t)i * Vl;
        for (int v = 0; v < Vl; v++) { p[v] = v0 + v < V ? p[v] / zs[i] : 0.0f; }
        if (targets) { losses[i] = canon_logf(zs[i]) - (target_logits[i] - maxes[i]); }
    }
}

// dlogits (BT,Vl) = (probs - onehot(target)) * dloss, written over probs; 0 for padding.
void crossentropy_backward(float* dlogits_probs, const int* targets, float dloss, int BT, int V,
                           int v0, int Vl) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        float* p = dlogits_probs + (size_t)i * Vl;
        for (int v = 0; v < Vl && v0 + v < V; v++) {
            float indicator = v0 + v == targets[i] ? 1.0f : 0.0f;
            p[v] = (p[v] - indicator) * dloss;
        }
    }
}

// out (BT,OC) += bias: a row-parallel layer's bias, added once after its all-reduce (the same
// addition matmul_forward does after its tree when it holds all of k).
void bias_forward(float* out, const float* bias, int BT, int OC) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        float* o = out + (size_t)i * OC;
        for (int c = 0; c < OC; c++) { o[c] = o[c] + bias[c]; }
    }
}

// R3 sum of per-position values x (B,T): the loss sum of a microbatch.
float position_sum(const float* x, int B, int T) {
    return position_reduce_elem(x, 1, 0, NULL, 0, 0, B, T);
}

// ==========================================================================================
// The model
// ==========================================================================================

// Activations of one forward pass of a pipeline stage (its `layers` transformer layers, and
// the head on the last stage), allocated for a capacity of (B, T) positions; a pass with fewer
// positions lays its tensors out with its own B, T inside the same memory.
// With tensor parallelism the per-head and per-neuron tensors hold this rank's part: qkv
// 3C/K, atty C/K, att NH/K heads, fch 4C/K, probs Vp/K (the widths below).
// With sequence parallelism (SPK = K; else 1) the residual stream, the layernorms' inputs and
// statistics hold T/SPK positions of each sequence: encoded, residual2, residual3, the means
// and rstds; the layernorm outputs are stored all-gathered (full T).
typedef struct {
    int layers, cap_B, cap_T, recompute, SPK;
    int C3, Ca, NHl, C4, Vl;   // local widths: qkv, atty, heads, fch, vocabulary
    float* encoded;     // (B,T,C)   the stage's input: embedding output, or received activation
    float* ln1;         // (L,B,T,C)
    float* ln1_mean;    // (L,B,T)
    float* ln1_rstd;    // (L,B,T)
    float* qkv;         // (L,B,T,3C)
    float* atty;        // (L,B,T,C)  attention output, before the projection
    float* att;         // (L,B,NH,T,T)
    float* residual2;   // (L,B,T,C)  residual stream after attention
    float* ln2;         // (L,B,T,C)
    float* ln2_mean;    // (L,B,T)
    float* ln2_rstd;    // (L,B,T)
    float* fch;         // (L,B,T,4C)
    float* fch_gelu;    // (L,B,T,4C), or (B,T,4C) reused by every layer with recompute
    float* residual3;   // (L,B,T,C)  residual stream after the MLP = output of layer l
    float* lnf;         // (B,T,C)    last stage only (like the three below)
    float* lnf_mean;    // (B,T)
    float* lnf_rstd;    // (B,T)
    float* probs;       // (B,T,Vp)   logits, then probabilities, then dlogits
    float* losses;      // (B,T)
    float* proj;        // (B,T,C)    scratch: a projection's output before the residual add
    float* proj_s;      // (B,T/K,C)  ... after sequence parallelism's reduce-scatter
    float* ln_s;        // (B,T/K,C)  a layernorm's output before sequence parallelism's all-gather
    float* ce;          // (3,B,T)    cross-entropy's per-position max, sum of exps, target logit
    size_t bytes;
} Activations;

// Gradients of activations during backward: one set, reused by every layer.
typedef struct {
    float* dresidual;   // (B,T,C)    d(residual stream); (B,T/K,C) under sequence parallelism
    float* dfull;       // (B,T,C)    ... all-gathered (sequence parallelism)
    float* dln_s;       // (B,T/K,C)  a layernorm output's gradient after the reduce-scatter
    float* ln_partials; // (2,B,C)    layernorm weight/bias gradients per sequence (SP)
    float* dbtc;        // (B,T,C)
    float* datty;       // (B,T,C/K)
    float* dqkv;        // (B,T,3C/K)
    float* dbt4c;       // (B,T,4C/K)
    size_t bytes;
} ActivationGrads;

typedef struct {
    GPT2Config config;
    size_t num_parameters;      // P
    int first_layer, last_layer; // this pipeline stage's layers [first, last)
    int is_first, is_last;      // first stage: embeddings; last stage: final layernorm + LM head
    CommGroup* tp;              // tensor-parallel group (size K; tensor_parallel.h)
    int K, v0, Vl;              // ... and this rank's vocabulary rows [v0, v0 + Vl) of wte
    int sp;                     // sequence parallelism over the tensor-parallel group
    float* sp_scratch;          // (B,T,C) reordering for its all-gathers and reduce-scatters
    Zero zero;                  // parameters, gradients and AdamW state, possibly sharded (zero.h)
} GPT2;

// The tied token embedding gets two gradients: from the LM head (wte as the output matmul)
// and from the embedding lookup. They are kept apart (the lookup half is zero.h's unit E)
// until the whole step's gradient is reduced, then added (lm part + lookup part), because that
// is the order a pipeline can reproduce: there the LM head lives on the last stage and the
// embedding on the first (Megatron sums the two copies' gradients after the data-parallel
// reduction). zero_finish_grads() does the addition.

static float* act_alloc(size_t n, size_t* total) {
    *total += n * sizeof(float);
    return (float*)aligned_calloc_or_die(n * sizeof(float), "activations");
}

void activations_alloc(Activations* a, const GPT2Config* c, int layers, int with_head, int B,
                       int T, int recompute, int K, int sp) {
    size_t L = layers, C = c->channels, BT = (size_t)B * T, H = with_head ? 1 : 0;
    size_t BTs = BT / (sp ? K : 1);   // positions of the sequence-split tensors
    memset(a, 0, sizeof(*a));
    a->layers = layers;
    a->cap_B = B;
    a->cap_T = T;
    a->recompute = recompute;
    a->SPK = sp ? K : 1;
    a->C3 = 3 * c->channels / K;
    a->Ca = c->channels / K;
    a->NHl = c->num_heads / K;
    a->C4 = 4 * c->channels / K;
    a->Vl = c->padded_vocab_size / K;
    a->encoded = act_alloc(BTs * C, &a->bytes);
    a->ln1 = act_alloc(L * BT * C, &a->bytes);
    a->ln1_mean = act_alloc(L * BTs, &a->bytes);
    a->ln1_rstd = act_alloc(L * BTs, &a->bytes);
    a->qkv = act_alloc(L * BT * a->C3, &a->bytes);
    a->atty = act_alloc(L * BT * a->Ca, &a->bytes);
    a->att = act_alloc(L * (size_t)B * a->NHl * T * T, &a->bytes);
    a->residual2 = act_alloc(L * BTs * C, &a->bytes);
    a->ln2 = act_alloc(L * BT * C, &a->bytes);
    a->ln2_mean = act_alloc(L * BTs, &a->bytes);
    a->ln2_rstd = act_alloc(L * BTs, &a->bytes);
    a->fch = act_alloc(L * BT * a->C4, &a->bytes);
    a->fch_gelu = act_alloc((recompute ? 1 : L) * BT * a->C4, &a->bytes);
    a->residual3 = act_alloc(L * BTs * C, &a->bytes);
    a->lnf = act_alloc(H * BT * C, &a->bytes);
    a->lnf_mean = act_alloc(H * BTs, &a->bytes);
    a->lnf_rstd = act_alloc(H * BTs, &a->bytes);
    a->probs = act_alloc(H * BT * a->Vl, &a->bytes);
    a->losses = act_alloc(H * BT, &a->bytes);
    a->proj = act_alloc(BT * C, &a->bytes);
    a->proj_s = act_alloc(sp ? BTs * C : 0, &a->bytes);
    a->ln_s = act_alloc(sp ? BTs * C : 0, &a->bytes);
    a->ce = act_alloc(H * 3 * BT, &a->bytes);
}

void activations_free(Activations* a) {
    float* all[] = {a->encoded, a->ln1, a->ln1_mean, a->ln1_rstd, a->qkv, a->atty, a->att,
                    a->residual2, a->ln2, a->ln2_mean, a->ln2_rstd, a->fch, a->fch_gelu,
                    a->residual3, a->lnf, a->lnf_mean, a->lnf_rstd, a->probs, a->losses, a->proj,
                    a->proj_s, a->ln_s, a->ce};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) { free(all[i]); }
    memset(a, 0, sizeof(*a));
}

void activation_grads_alloc(ActivationGrads* g, const GPT2Config* c, int B, int T, int K, int sp) {
    size_t BTC = (size_t)B * T * c->channels;
    g->bytes = 0;
    g->dresidual = act_alloc(BTC, &g->bytes);
    g->dfull = act_alloc(sp ? BTC : 0, &g->bytes);
    g->dln_s = act_alloc(sp ? BTC / K : 0, &g->bytes);
    g->ln_partials = act_alloc(sp ? 2 * (size_t)B * c->channels : 0, &g->bytes);
    g->dbtc = act_alloc(BTC, &g->bytes);
    g->datty = act_alloc(BTC / K, &g->bytes);
    g->dqkv = act_alloc(3 * BTC / K, &g->bytes);
    g->dbt4c = act_alloc(4 * BTC / K, &g->bytes);
}

void activation_grads_free(ActivationGrads* g) {
    free(g->dresidual); free(g->dfull); free(g->dln_s); free(g->ln_partials);
    free(g->dbtc); free(g->datty); free(g->dqkv); free(g->dbt4c);
}

// Per-layer views of the activations for a pass over (B, T); l counts the stage's layers.
typedef struct {
    float *residual, *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *residual2;
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu, *residual3;
} LayerActs;

static LayerActs layer_acts(const Activations* a, const GPT2Config* c, int l, int B, int T) {
    size_t C = c->channels, BT = (size_t)B * T, BTs = BT / a->SPK;
    LayerActs v;
    v.residual = l == 0 ? a->encoded : a->residual3 + (l - 1) * BTs * C;
    v.ln1 = a->ln1 + l * BT * C;
    v.ln1_mean = a->ln1_mean + l * BTs;
    v.ln1_rstd = a->ln1_rstd + l * BTs;
    v.qkv = a->qkv + l * BT * a->C3;
    v.atty = a->atty + l * BT * a->Ca;
    v.att = a->att + l * (size_t)B * a->NHl * T * T;
    v.residual2 = a->residual2 + l * BTs * C;
    v.ln2 = a->ln2 + l * BT * C;
    v.ln2_mean = a->ln2_mean + l * BTs;
    v.ln2_rstd = a->ln2_rstd + l * BTs;
    v.fch = a->fch + l * BT * a->C4;
    v.fch_gelu = a->fch_gelu + (a->recompute ? 0 : l * BT * a->C4);
    v.residual3 = a->residual3 + l * BTs * C;
    return v;
}

// The output of the stage's layers (B,T,C), or its sequence slice: what the next stage, or
// the head, receives.
static float* stage_output(const Activations* a, const GPT2Config* c, int B, int T) {
    size_t BTs = (size_t)B * T / a->SPK;
    return a->layers > 0 ? a->residual3 + (size_t)(a->layers - 1) * BTs * c->channels : a->encoded;
}

// Views of layer unit u's tensors (this rank's tensor-parallel parts, zero.h's unit layout)
// in a buffer starting at `base`.
static LayerTensors layer_unit(const Zero* z, int u, const float* base) {
    float* f = (float*)base;
    const TPPiece* p = z->lay.pieces[u];   // ln1w ln1b qkvw qkvb attprojw attprojb ln2w ... fcprojb
    LayerTensors v = {f + p[0].local, f + p[1].local, f + p[2].local, f + p[3].local, f + p[4].local,
                      f + p[5].local, f + p[6].local, f + p[7].local, f + p[8].local, f + p[9].local,
                      f + p[10].local, f + p[11].local};
    return v;
}

// The forward and backward come in three parts, run by the stages that hold them: the
// embeddings (first stage), the transformer layers of a stage, and the head (final layernorm,
// LM head, cross-entropy; last stage). Parameters come unit by unit from zero.h (ZeRO-3
// gathers each unit just before use, prefetching the next, and frees it after).

// Sequence parallelism's f and g (tensor_parallel.h) on the activations of a (B,T) pass; they
// are the identity / all-reduce of tp_f_* and tp_g_* without it.
static int sp_on(const GPT2* model) { return model->sp && model->K > 1; }

// (first stage) encoded (B,T,C) = wte[inputs] + wpe (with SP: this rank's positions)
void embed_forward(GPT2* model, Activations* a, const int* inputs, int B, int T) {
    const GPT2Config* c = &model->config;
    Zero* z = &model->zero;
    int C = c->channels, Ts = T / a->SPK;
    const float* wte = zero_params_acquire(z, ZERO_WTE, ZERO_WPE);
    float* lookup = sp_on(model) ? a->proj : a->encoded;
    encoder_lookup(lookup, inputs, wte, model->v0, model->Vl, B * T, C);
    zero_params_release(z, ZERO_WTE);
    // sum over the tp group (the vocab-parallel lookup: each row came from the rank holding
    // it): all-reduce, or with SP reduce-scatter along T
    if (sp_on(model)) {
        tp_sp_reduce_scatter(model->tp, lookup, a->encoded, B, T, C, model->sp_scratch);
    } else if (model->K > 1) {
        comm_all_reduce_sum(model->tp, a->encoded, (size_t)B * T * C, COMM_KIND_TP);
    }
    const float* wpe = zero_params_acquire(z, ZERO_WPE, ZERO_LAYER(model->first_layer));
    int t0 = sp_on(model) ? model->tp->rank * Ts : 0;
    encoder_add_positions(a->encoded, wpe + (size_t)t0 * C, B, Ts, C);
    zero_params_release(z, ZERO_WPE);
}

// A layernorm before a column-parallel layer: ln (B,T,C) = LN(x); with SP, x holds this
// rank's positions and the output is all-gathered along T (Megatron's f).
static void ln_forward_f(GPT2* model, Activations* a, float* ln, float* mean, float* rstd,
                         const float* x, const float* w, const float* b, int B, int T) {
    int C = model->config.channels;
    if (sp_on(model)) {
        layernorm_forward(a->ln_s, mean, rstd, x, w, b, B * T / a->SPK, C);
        tp_sp_all_gather(model->tp, a->ln_s, ln, B, T, C, model->sp_scratch);
    } else {
        layernorm_forward(ln, mean, rstd, x, w, b, B * T, C);
        tp_f_forward(model->tp, ln, (size_t)B * T * C);
    }
}

// After a row-parallel layer: the partial outputs a->proj (B,T,C) summed over the tp group
// (Megatron's g: all-reduce, or with SP reduce-scatter along T), then its bias; returns the
// result (with SP, this rank's positions).
static float* proj_g_bias(GPT2* model, Activations* a, const float* bias, int B, int T) {
    int C = model->config.channels;
    float* out = a->proj;
    if (sp_on(model)) {
        tp_sp_reduce_scatter(model->tp, a->proj, a->proj_s, B, T, C, model->sp_scratch);
        out = a->proj_s;
    } else {
        tp_g_forward(model->tp, a->proj, (size_t)B * T * C);
    }
    bias_forward(out, bias, B * T / a->SPK, C);
    return out;
}

// this stage's layers: a->encoded (B,T,C) -> stage_output. Megatron's split: qkv and fc are
// column-parallel (f before them), attproj and fcproj row-parallel (g after them, then the
// bias); attention runs on this rank's heads.
void layers_forward(GPT2* model, Activations* a, int B, int T) {
    const GPT2Config* c = &model->config;
    Zero* z = &model->zero;
    int C = c->channels, BT = B * T, K = model->K;
    size_t BTCs = (size_t)BT / a->SPK * C;
    for (int l = model->first_layer; l < model->last_layer; l++) {
        int next = l + 1 < model->last_layer ? ZERO_LAYER(l + 1) : model->is_last ? z->lay.num_units - 1 : -1;
        LayerTensors w = layer_unit(z, ZERO_LAYER(l), zero_params_acquire(z, ZERO_LAYER(l), next));
        LayerActs x = layer_acts(a, c, l - model->first_layer, B, T);
        ln_forward_f(model, a, x.ln1, x.ln1_mean, x.ln1_rstd, x.residual, w.ln1w, w.ln1b, B, T);
        matmul_forward(x.qkv, x.ln1, w.qkvw, w.qkvb, BT, C, a->C3, CANON_R);
        attention_forward(x.atty, x.att, x.qkv, B, T, a->Ca, a->NHl);
        matmul_forward(a->proj, x.atty, w.attprojw, NULL, BT, a->Ca, C, CANON_R / K);
        residual_forward(x.residual2, x.residual, proj_g_bias(model, a, w.attprojb, B, T), BTCs);
        ln_forward_f(model, a, x.ln2, x.ln2_mean, x.ln2_rstd, x.residual2, w.ln2w, w.ln2b, B, T);
        matmul_forward(x.fch, x.ln2, w.fcw, w.fcb, BT, C, a->C4, CANON_R);
        gelu_forward(x.fch_gelu, x.fch, (size_t)BT * a->C4);
        matmul_forward(a->proj, x.fch_gelu, w.fcprojw, NULL, BT, a->C4, C, CANON_R / K);
        residual_forward(x.residual3, x.residual2, proj_g_bias(model, a, w.fcprojb, B, T), BTCs);
        zero_params_release(z, ZERO_LAYER(l));
    }
}

// (last stage) stage_output -> probs (B,T,Vl) of this rank's vocabulary rows, and per-position
// losses (B,T) when targets != NULL. The LM head is column-parallel over the vocabulary; the
// cross-entropy's three reductions are finished over the tp group. With `training`, the
// units the backward starts with (wte, the final layernorm) stay held for it.
void head_forward(GPT2* model, Activations* a, const int* targets, int B, int T, int training) {
    const GPT2Config* c = &model->config;
    Zero* z = &model->zero;
    int C = c->channels, V = c->vocab_size, BT = B * T, K = model->K;
    int LNF = z->lay.num_units - 1;
    const float* lnf = zero_params_acquire(z, LNF, ZERO_WTE);
    ln_forward_f(model, a, a->lnf, a->lnf_mean, a->lnf_rstd, stage_output(a, c, B, T), lnf, lnf + C, B, T);
    const float* wte = zero_params_acquire(z, ZERO_WTE, -1);
    matmul_forward(a->probs, a->lnf, wte, NULL, BT, C, model->Vl, CANON_R);
    float *maxes = a->ce, *zs = a->ce + BT, *target_logits = a->ce + 2 * BT;
    crossentropy_max(maxes, a->probs, BT, V, model->v0, model->Vl);
    // all-reduce MAX (tp group): the largest logit over the whole vocabulary
    if (K > 1) { comm_all_reduce_max(model->tp, maxes, (size_t)BT, COMM_KIND_TP); }
    crossentropy_exps(zs, target_logits, a->probs, maxes, targets, BT, V, model->v0, model->Vl, CANON_R / K);
    // all-reduce (tp group): Z (each rank's chunks of the vocabulary sum, finished by the R1
    // tree) and the target logit (held by one rank, -0.0f elsewhere)
    if (K > 1) { comm_all_reduce_sum(model->tp, a->ce + BT, 2 * (size_t)BT, COMM_KIND_TP); }
    crossentropy_normalize(a->probs, a->losses, zs, target_logits, maxes, targets, BT, V, model->v0, model->Vl);
    if (!training) {
        zero_params_release(z, ZERO_WTE);
        zero_params_release(z, LNF);
    }
}

// Backward of a layernorm that feeds a column-parallel layer, from the gradient of its full
// output dln (B,T,C) as this rank computed it (its slice of the layer's outputs): summed over
// the tp group (Megatron's f backward: all-reduce, or with SP reduce-scatter along T), then
// dres += the layernorm's input gradient, and its weight/bias gradients. With SP those are
// sums over positions held by K ranks: each rank's per-sequence subtrees (over its chunks of
// T) are all-reduced (tp group, the R1 tree) and the R1 tree over sequences finishes them.
static void ln_backward_f(GPT2* model, ActivationGrads* g, float* dres, float* dweight, float* dbias,
                          float* dln, const float* inp, const float* weight, const float* mean,
                          const float* rstd, int B, int T) {
    int C = model->config.channels;
    if (sp_on(model)) {
        int K = model->K;
        tp_sp_reduce_scatter(model->tp, dln, g->dln_s, B, T, C, model->sp_scratch);
        layernorm_backward(dres, dweight, dbias, g->dln_s, inp, weight, mean, rstd, B, T / K, C,
                           CANON_R / K, g->ln_partials);
        comm_all_reduce_sum(model->tp, g->ln_partials, 2 * (size_t)B * C, COMM_KIND_TP);
        sequence_tree(dweight, g->ln_partials, B, C);
        sequence_tree(dbias, g->ln_partials + (size_t)B * C, B, C);
    } else {
        tp_f_backward(model->tp, dln, (size_t)B * T * C);
        layernorm_backward(dres, dweight, dbias, dln, inp, weight, mean, rstd, B, T, C, CANON_R, NULL);
    }
}

// The gradient of a row-parallel layer's output, full (B,T,C), from d(residual) (Megatron's g
// backward: the identity, or with SP an all-gather along T).
static const float* dres_g_backward(GPT2* model, ActivationGrads* g, int B, int T) {
    if (!sp_on(model)) {
        tp_g_backward(model->tp, g->dresidual, (size_t)B * T * model->config.channels);
        return g->dresidual;
    }
    tp_sp_all_gather(model->tp, g->dresidual, g->dfull, B, T, model->config.channels, model->sp_scratch);
    return g->dfull;
}

// (last stage) backward of the head: g->dresidual = d(loss)/d(stage_output). dloss =
// d(loss)/d(per-position loss) = 1 / (tokens in the global batch).
void head_backward(GPT2* model, Activations* a, ActivationGrads* g, const int* targets, int B,
                   int T, float dloss) {
    const GPT2Config* c = &model->config;
    Zero* z = &model->zero;
    int C = c->channels, V = c->vocab_size, BT = B * T;
    int LNF = z->lay.num_units - 1;
    const float* wte = zero_params_acquire(z, ZERO_WTE, -1);
    float* dwte_lm = zero_grad_unit(z, ZERO_WTE);    // the LM-head half of wte's gradient
    crossentropy_backward(a->probs, targets, dloss, BT, V, model->v0, model->Vl);
    matmul_backward(g->dbtc, dwte_lm, NULL, a->probs, a->lnf, wte, B, T, C, model->Vl, 1, CANON_R / model->K);
    zero_grad_unit_done(z, ZERO_WTE);
    zero_params_release(z, ZERO_WTE);
    int next = model->last_layer > model->first_layer ? ZERO_LAYER(model->last_layer - 1) : -1;
    const float* lnf = zero_params_acquire(z, LNF, next);
    float* dlnf = zero_grad_unit(z, LNF);
    memset(g->dresidual, 0, sizeof(float) * (size_t)BT / a->SPK * C);
    ln_backward_f(model, g, g->dresidual, dlnf, dlnf + C, g->dbtc, stage_output(a, c, B, T), lnf,
                  a->lnf_mean, a->lnf_rstd, B, T);
    zero_grad_unit_done(z, LNF);
    zero_params_release(z, LNF);
}

// this stage's layers backward: g->dresidual = d(loss)/d(stage_output) in, d(loss)/d(a->encoded)
// out. Each layer's gradient is handed to zero.h when complete, so its reduction overlaps the
// backward of the layers below.
void layers_backward(GPT2* model, Activations* a, ActivationGrads* g, int B, int T) {
    const GPT2Config* c = &model->config;
    Zero* z = &model->zero;
    int C = c->channels, BT = B * T, K = model->K;
    for (int l = model->last_layer - 1; l >= model->first_layer; l--) {
        int next = l - 1 >= model->first_layer ? ZERO_LAYER(l - 1) : -1;
        LayerTensors w = layer_unit(z, ZERO_LAYER(l), zero_params_acquire(z, ZERO_LAYER(l), next));
        LayerTensors dw = layer_unit(z, ZERO_LAYER(l), zero_grad_unit(z, ZERO_LAYER(l)));
        LayerActs x = layer_acts(a, c, l - model->first_layer, B, T);
        if (a->recompute) { gelu_forward(x.fch_gelu, x.fch, (size_t)BT * a->C4); }
        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        const float* dres = dres_g_backward(model, g, B, T);
        matmul_backward(g->dbt4c, dw.fcprojw, dw.fcprojb, dres, x.fch_gelu, w.fcprojw, B, T, a->C4, C, 1, CANON_R);
        gelu_backward(g->dbt4c, x.fch, g->dbt4c, (size_t)BT * a->C4);
        matmul_backward(g->dbtc, dw.fcw, dw.fcb, g->dbt4c, x.ln2, w.fcw, B, T, C, a->C4, 1, CANON_R / K);
        ln_backward_f(model, g, g->dresidual, dw.ln2w, dw.ln2b, g->dbtc, x.residual2, w.ln2w, x.ln2_mean, x.ln2_rstd, B, T);
        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        dres = dres_g_backward(model, g, B, T);
        matmul_backward(g->datty, dw.attprojw, dw.attprojb, dres, x.atty, w.attprojw, B, T, a->Ca, C, 1, CANON_R);
        attention_backward(g->dqkv, g->datty, x.qkv, x.att, B, T, a->Ca, a->NHl);
        matmul_backward(g->dbtc, dw.qkvw, dw.qkvb, g->dqkv, x.ln1, w.qkvw, B, T, C, a->C3, 3, CANON_R / K);
        ln_backward_f(model, g, g->dresidual, dw.ln1w, dw.ln1b, g->dbtc, x.residual, w.ln1w, x.ln1_mean, x.ln1_rstd, B, T);
        zero_grad_unit_done(z, ZERO_LAYER(l));
        zero_params_release(z, ZERO_LAYER(l));
    }
}

// (first stage) the embeddings' gradients from g->dresidual = d(loss)/d(encoded): the lookup
// half of wte's gradient (unit E; this rank's vocabulary rows) and wpe's. Both sum over all
// positions: with SP the gradient is all-gathered along T first.
void embed_backward(GPT2* model, ActivationGrads* g, const int* inputs, int B, int T) {
    const GPT2Config* c = &model->config;
    Zero* z = &model->zero;
    int E = zero_unit_E(z);
    const float* dencoded = dres_g_backward(model, g, B, T);
    encoder_backward(zero_grad_unit(z, E), zero_grad_unit(z, ZERO_WPE), dencoded, inputs, B, T,
                     c->channels, model->v0, model->Vl, c->max_seq_len);
    zero_grad_unit_done(z, ZERO_WPE);
    zero_grad_unit_done(z, E);
}

// The whole model on a rank that holds all of it (one pipeline stage, no sequence
// parallelism): the tests' entry points.
void gpt2_forward(GPT2* model, Activations* a, const int* inputs, const int* targets, int B, int T,
                  int training) {
    embed_forward(model, a, inputs, B, T);
    layers_forward(model, a, B, T);
    head_forward(model, a, targets, B, T, training);
}

void gpt2_backward(GPT2* model, Activations* a, ActivationGrads* g, const int* inputs,
                   const int* targets, int B, int T, float dloss) {
    head_backward(model, a, g, targets, B, T, dloss);
    layers_backward(model, a, g, B, T);
    embed_backward(model, g, inputs, B, T);
}

// --- building the model -------------------------------------------------------------------

// The cost of the head (LM head matmuls and cross-entropy) in units of one transformer
// layer, per token: the LM head is 2*C*Vp flops forward, a layer about 24*C^2.
static double head_cost_in_layers(const GPT2Config* c) {
    return (double)c->padded_vocab_size / (12.0 * c->channels);
}

// The model from full parameters (every rank the same): this rank's pipeline stage (pp group
// rank) gets a balanced contiguous range of layers (pipeline.h), its tensor-parallel slices of
// them (tensor_parallel.h), placed and sharded over the data-parallel group as ZeRO `stage`
// says; M microbatches per step.
void gpt2_init(GPT2* model, const GPT2Config* config, const float* params, int stage,
               CommGroup* dp, CommGroup* pp, CommGroup* tp, int M) {
    model->config = *config;
    model->num_parameters = param_count(config);
    const char* problem = tp_problem(config, tp->size);
    if (problem) { fatal("--tp %d: %s (model: NH=%d, Vp=%d)", tp->size, problem, config->num_heads, config->padded_vocab_size); }
    model->tp = tp;
    model->K = tp->size;
    model->Vl = config->padded_vocab_size / tp->size;
    model->v0 = tp->rank * model->Vl;
    int S = pp->size;
    int* first = (int*)malloc_or_die(sizeof(int) * (S + 1), "pipeline partition");
    char err[256];
    if (pipeline_partition_layers(config->num_layers, S, 0.0, head_cost_in_layers(config), first, err, sizeof(err)) != 0) {
        fatal("--pp: %s", err);
    }
    model->first_layer = first[pp->rank];
    model->last_layer = first[pp->rank + 1];
    model->is_first = pp->rank == 0;
    model->is_last = pp->rank == S - 1;
    free(first);
    model->sp = 0;
    model->sp_scratch = NULL;
    zero_init(&model->zero, &model->config, stage, dp, pp, tp, model->first_layer, model->last_layer, params, M);
}

// Megatron's sequence parallelism for passes over up to (B, T) positions (T a multiple of K).
void gpt2_enable_sequence_parallel(GPT2* model, int B, int T) {
    model->sp = 1;
    model->sp_scratch = (float*)aligned_calloc_or_die(sizeof(float) * B * T * model->config.channels, "sequence parallelism");
}

void gpt2_free(GPT2* model) {
    zero_free(&model->zero);
    free(model->sp_scratch);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// ==========================================================================================
// Pipeline execution: a stage runs its list of actions from llmc/pipeline.h
// ==========================================================================================
//
// Every rank runs a pipeline, of one stage when --pp is 1 (then the list is just F0 B0 F1
// B1 ...). A microbatch owns a slot from its FORWARD to its BACKWARD on this stage: its
// activations, its tokens and the received gradient of its output; the schedule bounds how
// many are alive (1F1B: S - stage). Messages are non-blocking: a receive is posted at its RECV
// action and waited for right before the computation that reads it; a send is posted at its
// SEND action and waited for before its buffer is reused. Received activations and sent input
// gradients live in small message buffers of their own, so a receive posted early never needs
// a second slot. The schedule's message order makes this deadlock-free (pipeline.h).
// Tags: 2*microbatch (+1 for gradients).

typedef struct {
    int microbatch;            // -1: free
    Activations acts;
    int* inputs;               // (B,T) the microbatch's tokens
    int* targets;              // (B,T)
    float* grad_out;           // (B,T,C) received d(loss)/d(stage output) (not the last stage)
    CommRequest* recv_grad;
    CommRequest* send_act;     // the stage output being sent (the slot is not reused before)
} MicroSlot;

typedef enum { MSG_FREE, MSG_RECEIVING, MSG_TO_SEND, MSG_SENDING } MessageState;

typedef struct {
    float* buf;                // (B,T,C)
    CommRequest* req;
    int microbatch;
    MessageState state;        // RECEIVING: an input activation until its FORWARD; TO_SEND: an
                               // input gradient from BACKWARD until its SEND_BACKWARD
} MessageBuffer;

#define PP_MAX_MESSAGES 64

typedef struct {
    PipelineConfig cfg;
    PipelineAction* actions;
    int nactions;
    MicroSlot* slots;
    int nslots;
    MessageBuffer msgs[PP_MAX_MESSAGES];
    int nmsgs;
    size_t msg_floats;
    int prev, next;            // pp-group ranks of the neighbouring stages (COMM_NO_PEER)
    CommGroup* pp;
    double busy;               // seconds of FORWARD/BACKWARD in the last step
    double fwd, bwd;           // ... of which forwards, backwards
    size_t slot_bytes;
} Pipeline;

static void pipeline_init(Pipeline* p, GPT2* model, CommGroup* pp, PipelineScheduleKind kind, int M,
                          int B, int T, int recompute) {
    memset(p, 0, sizeof(*p));
    p->pp = pp;
    p->cfg = (PipelineConfig){pp->size, M, kind, 1};
    char err[256];
    int n = pipeline_stage_actions(&p->cfg, pp->rank, NULL, 0, err, sizeof(err));
    if (n < 0) { fatal("--pp/--schedule: %s", err); }
    p->actions = (PipelineAction*)malloc_or_die(sizeof(PipelineAction) * (n ? n : 1), "pipeline actions");
    if (pipeline_stage_actions(&p->cfg, pp->rank, p->actions, n, err, sizeof(err)) != n) {
        fatal("--pp/--schedule: %s", err);
    }
    p->nactions = n;
    p->prev = pp->rank > 0 ? pp->rank - 1 : COMM_NO_PEER;
    p->next = pp->rank < pp->size - 1 ? pp->rank + 1 : COMM_NO_PEER;
    p->nslots = pipeline_max_in_flight(p->actions, n);
    p->slots = (MicroSlot*)calloc_or_die((size_t)p->nslots, sizeof(MicroSlot), "pipeline slots");
    p->msg_floats = (size_t)B * T / (sp_on(model) ? model->K : 1) * model->config.channels;
    for (int i = 0; i < p->nslots; i++) {
        MicroSlot* s = &p->slots[i];
        s->microbatch = -1;
        activations_alloc(&s->acts, &model->config, model->last_layer - model->first_layer,
                          model->is_last, B, T, recompute, model->K, sp_on(model));
        s->inputs = (int*)malloc_or_die(sizeof(int) * B * T, "tokens");
        s->targets = (int*)malloc_or_die(sizeof(int) * B * T, "tokens");
        s->grad_out = (float*)aligned_calloc_or_die(sizeof(float) * p->msg_floats, "pipeline gradient");
        p->slot_bytes = s->acts.bytes + sizeof(float) * p->msg_floats + 2 * sizeof(int) * B * T;
    }
}

static void pipeline_free(Pipeline* p) {
    for (int i = 0; i < p->nslots; i++) {
        activations_free(&p->slots[i].acts);
        free(p->slots[i].inputs); free(p->slots[i].targets); free(p->slots[i].grad_out);
    }
    for (int i = 0; i < p->nmsgs; i++) { free(p->msgs[i].buf); }
    free(p->slots);
    free(p->actions);
}

// The slot of microbatch i; with `take`, a free one (its output's send completed) if it has none.
static MicroSlot* pipeline_slot(Pipeline* p, int i, int take) {
    for (int k = 0; k < p->nslots; k++) { if (p->slots[k].microbatch == i) { return &p->slots[k]; } }
    if (!take) { fatal("internal: microbatch %d has no pipeline slot", i); }
    for (int k = 0; k < p->nslots; k++) {
        if (p->slots[k].microbatch < 0) {
            comm_wait(p->slots[k].send_act);
            p->slots[k].send_act = NULL;
            p->slots[k].microbatch = i;
            return &p->slots[k];
        }
    }
    fatal("internal: more microbatches in flight than the schedule's bound");
}

// A message buffer for microbatch i in `state`: a free one (a completed send's is reused).
static MessageBuffer* pipeline_message_new(Pipeline* p, int i, MessageState state) {
    MessageBuffer* m = NULL;
    for (int k = 0; k < p->nmsgs && m == NULL; k++) {
        MessageBuffer* q = &p->msgs[k];
        if (q->state == MSG_SENDING && comm_test(q->req)) { q->req = NULL; q->state = MSG_FREE; }
        if (q->state == MSG_FREE) { m = q; }
    }
    if (m == NULL) {
        if (p->nmsgs == PP_MAX_MESSAGES) { fatal("internal: too many pipeline messages in flight"); }
        m = &p->msgs[p->nmsgs++];
        m->buf = (float*)aligned_calloc_or_die(sizeof(float) * p->msg_floats, "pipeline message");
    }
    m->microbatch = i;
    m->state = state;
    return m;
}

// The message buffer of microbatch i in `state`.
static MessageBuffer* pipeline_message(Pipeline* p, int i, MessageState state) {
    for (int k = 0; k < p->nmsgs; k++) {
        if (p->msgs[k].state == state && p->msgs[k].microbatch == i) { return &p->msgs[k]; }
    }
    fatal("internal: no pipeline message for microbatch %d", i);
}

// Runs this stage's actions for one optimizer step: forward and backward of this dp rank's
// Ml microbatches (global indices from zero.h), gradients reduced, the tied halves summed.
// local_loss[i] gets microbatch i's loss sum on the last stage.
static void pipeline_step(Pipeline* p, GPT2* model, ActivationGrads* g, DataLoader* loader,
                          int64_t first_microbatch, int M_global, int B, int T, int overfit,
                          float* local_loss) {
    const GPT2Config* c = &model->config;
    Zero* z = &model->zero;
    size_t BTC = p->msg_floats;
    float dloss = 1.0f / (float)((double)B * T * M_global);
    p->busy = p->fwd = p->bwd = 0.0;
    for (int k = 0; k < p->nactions; k++) {
        const PipelineAction* act = &p->actions[k];
        int i = act->microbatch;
        MicroSlot* s;
        MessageBuffer* m;
        double t0;
        switch (act->kind) {
            case PP_RECV_FORWARD:
                // irecv (pp group): microbatch i's input activation from the previous stage
                m = pipeline_message_new(p, i, MSG_RECEIVING);
                m->req = comm_irecv(p->pp, m->buf, BTC, act->peer, 2 * i, COMM_KIND_PP);
                break;
            case PP_FORWARD:
                s = pipeline_slot(p, i, 1);
                if (model->is_first || model->is_last) {
                    dataloader_load(loader, overfit ? 0 : zero_global_microbatch(z, first_microbatch, i));
                    memcpy(s->inputs, loader->inputs, sizeof(int) * B * T);
                    memcpy(s->targets, loader->targets, sizeof(int) * B * T);
                }
                if (!model->is_first) {   // waiting for the input is idle time, not compute
                    m = pipeline_message(p, i, MSG_RECEIVING);
                    comm_wait(m->req);
                    memcpy(s->acts.encoded, m->buf, sizeof(float) * BTC);
                    m->req = NULL;
                    m->state = MSG_FREE;
                }
                t0 = now_seconds();
                if (model->is_first) { embed_forward(model, &s->acts, s->inputs, B, T); }
                layers_forward(model, &s->acts, B, T);
                if (model->is_last) {
                    head_forward(model, &s->acts, s->targets, B, T, 1);
                    local_loss[i] = position_sum(s->acts.losses, B, T);
                }
                p->fwd += now_seconds() - t0;
                break;
            case PP_SEND_FORWARD:
                // isend (pp group): the stage output of microbatch i to the next stage
                s = pipeline_slot(p, i, 0);
                s->send_act = comm_isend(p->pp, stage_output(&s->acts, c, B, T), BTC, act->peer, 2 * i, COMM_KIND_PP);
                break;
            case PP_RECV_BACKWARD:
                // irecv (pp group): d(loss)/d(stage output) of microbatch i from the next stage
                s = pipeline_slot(p, i, 0);
                s->recv_grad = comm_irecv(p->pp, s->grad_out, BTC, act->peer, 2 * i + 1, COMM_KIND_PP);
                break;
            case PP_BACKWARD:
                s = pipeline_slot(p, i, 0);
                if (!model->is_last) {
                    comm_wait(s->recv_grad);
                    s->recv_grad = NULL;
                    memcpy(g->dresidual, s->grad_out, sizeof(float) * BTC);
                }
                t0 = now_seconds();
                zero_begin_microbatch(z, i);
                if (model->is_last) { head_backward(model, &s->acts, g, s->targets, B, T, dloss); }
                layers_backward(model, &s->acts, g, B, T);
                if (model->is_first) {
                    embed_backward(model, g, s->inputs, B, T);
                } else {   // keep d(loss)/d(stage input) until its SEND_BACKWARD
                    memcpy(pipeline_message_new(p, i, MSG_TO_SEND)->buf, g->dresidual, sizeof(float) * BTC);
                }
                zero_end_microbatch(z);
                s->microbatch = -1;   // its activations are no longer needed
                p->bwd += now_seconds() - t0;
                break;
            case PP_SEND_BACKWARD:
                // isend (pp group): d(loss)/d(stage input) of microbatch i to the previous stage
                m = pipeline_message(p, i, MSG_TO_SEND);
                m->state = MSG_SENDING;
                m->req = comm_isend(p->pp, m->buf, BTC, act->peer, 2 * i + 1, COMM_KIND_PP);
                break;
        }
    }
    for (int k = 0; k < p->nslots; k++) { comm_wait(p->slots[k].send_act); p->slots[k].send_act = NULL; }
    for (int k = 0; k < p->nmsgs; k++) { comm_wait(p->msgs[k].req); p->msgs[k].req = NULL; p->msgs[k].state = MSG_FREE; }
    p->busy = p->fwd + p->bwd;
    zero_finish_grads(z);
}

// A forward-only pass through the pipeline of one batch (validation, sampling): the first
// stage embeds `inputs`, each stage receives, runs its layers, sends; the last stage runs the
// head. Blocking sends and receives: every stage handles the batch in the same order.
static void pipeline_forward_only(Pipeline* p, GPT2* model, Activations* a, const int* inputs,
                                  const int* targets, int B, int T) {
    size_t BTC = (size_t)B * T / a->SPK * model->config.channels;
    if (model->is_first) {
        embed_forward(model, a, inputs, B, T);
    } else {
        comm_wait(comm_irecv(p->pp, a->encoded, BTC, p->prev, 0, COMM_KIND_PP));
    }
    layers_forward(model, a, B, T);
    if (model->is_last) {
        head_forward(model, a, targets, B, T, 0);
    } else {
        comm_wait(comm_isend(p->pp, stage_output(a, &model->config, B, T), BTC, p->next, 0, COMM_KIND_PP));
    }
}

// ==========================================================================================
// Training
// ==========================================================================================

// The R1 tree over n values gathered from the dp ranks (`per_rank` each, rank-major in all):
// value j of the canonical order is microbatch j's (zero.h's assignment), or with
// round_robin value j = all[(j % N) * per_rank + j / N].
static float tree_in_order(const float* all, int per_rank, int n, const Zero* z, int round_robin) {
    float* ordered = (float*)malloc_or_die(sizeof(float) * (n > 0 ? n : 1), "ordered values");
    for (int j = 0; j < n; j++) {
        int r, local;
        if (round_robin) { r = j % z->N; local = j / z->N; }
        else { zero_owner_of_microbatch(z, j, &r, &local); }
        ordered[j] = all[(size_t)r * per_rank + local];
    }
    float sum = canon_tree_sum(ordered, n, 1);
    free(ordered);
    return sum;
}

// The mean loss over the global batch: the last stage's dp ranks gather their microbatch loss
// sums (all-gather, dp group), sum them by the R1 tree in global order, and the last stage
// broadcasts the result to the other stages (pp group).
static float global_mean_loss(GPT2* model, Comm* comm, const float* local, int per_rank, int n,
                              int round_robin, double tokens) {
    Zero* z = &model->zero;
    float loss = 0.0f;
    if (model->is_last) {
        float* all = (float*)malloc_or_die(sizeof(float) * (size_t)per_rank * z->N + 1, "losses");
        comm_all_gather(&comm->dp_group, local, all, (size_t)per_rank, COMM_KIND_OTHER);
        loss = tree_in_order(all, per_rank, n, z, round_robin) / (float)tokens;
        free(all);
    }
    comm_broadcast(&comm->pp_group, &loss, sizeof(float), comm->pp - 1, COMM_KIND_OTHER);
    return loss;
}

// Validation loss over the first `batches` microbatches of the val data: batch j is done by
// dp rank j % N (through the pipeline), and the batch sums are summed in batch order.
static float gpt2_validate(GPT2* model, Pipeline* p, Comm* comm, Activations* acts,
                           DataLoader* loader, int batches, int B, int T) {
    Zero* z = &model->zero;
    int per_rank = (batches + z->N - 1) / z->N;
    float* local = (float*)calloc_or_die((size_t)per_rank + 1, sizeof(float), "val losses");
    for (int k = 0; k < per_rank; k++) {
        int j = k * z->N + z->rank;
        // under ZeRO-3 every dp rank must take part in every forward's parameter gathers
        if (j >= batches && z->stage != 3) { continue; }
        dataloader_load(loader, j < batches ? j : 0);
        pipeline_forward_only(p, model, acts, loader->inputs, loader->targets, B, T);
        if (model->is_last && j < batches) { local[k] = position_sum(acts->losses, B, T); }
    }
    float loss = global_mean_loss(model, comm, local, per_rank, batches, 1, (double)batches * B * T);
    free(local);
    return loss;
}

// Samples genT tokens after <|endoftext|> with xorshift seeded 1337 (llm.c's sampler), each
// token a forward pass over the tokens so far (B = 1) through the pipeline; the last stage
// draws the token (from the whole vocabulary: its tensor-parallel ranks all-gather their
// slices of the probabilities) and broadcasts it to the other stages. Under ZeRO-3 every dp
// rank takes part (the forward gathers parameters); world rank 0 prints.
static void sample_text(GPT2* model, Pipeline* p, Comm* comm, Activations* acts, Tokenizer* tok, int genT) {
    int V = model->config.vocab_size, Vp = model->config.padded_vocab_size;
    int sp = model->sp;
    model->sp = 0;   // the length changes token by token; without SP the arithmetic is the same
    int printing = comm->world_rank == 0;
    int* gen = (int*)malloc_or_die(sizeof(int) * genT, "sample tokens");
    float* probs = (float*)malloc_or_die(sizeof(float) * Vp, "sample probabilities");
    uint64_t rng = 1337;
    gen[0] = V > 50256 ? 50256 : V - 1;   // <|endoftext|> for GPT-2's vocabulary
    if (printing) { printf("generating:\n---\n"); }
    for (int t = 1; t < genT; t++) {
        pipeline_forward_only(p, model, acts, gen, NULL, 1, t);
        int next = V - 1;
        if (model->is_last) {
            // all-gather (tp group): the probabilities of the last position over the vocabulary
            comm_all_gather(model->tp, acts->probs + (size_t)(t - 1) * model->Vl, probs, (size_t)model->Vl, COMM_KIND_OTHER);
            float coin = random_f32(&rng), cdf = 0.0f;
            for (int v = 0; v < V; v++) {
                cdf += probs[v];
                if (coin < cdf) { next = v; break; }
            }
        }
        comm_broadcast(&comm->pp_group, &next, sizeof(int), comm->pp - 1, COMM_KIND_OTHER);
        gen[t] = next;
        if (!printing) { continue; }
        if (tok->init_ok) {
            safe_printf(tokenizer_decode(tok, next));
        } else {
            printf("%d ", next);
        }
        fflush(stdout);
    }
    if (printing) { printf("\n---\n"); }
    model->sp = sp;
    free(probs);
    free(gen);
}

// Checkpoint of step progress->step: the model (world rank 0, llm.c format), every rank's
// piece of the optimizer state, then the DONE marker once all of it is on disk. The full
// parameters are assembled by a sum: every dp-rank-0 rank writes the elements it owns
// (zero_full_params: each element by exactly one rank) into a buffer of -0.0f, and an
// all-reduce over the tp group, then over the pp group, adds them (x + -0 == x: exact).
static void write_checkpoint(GPT2* model, const char* dir, TrainProgress* progress, Comm* comm) {
    Zero* z = &model->zero;
    char path[1200];
    int step = (int)progress->step;
    size_t P = model->num_parameters;
    float* full = NULL;
    if (comm->dp_rank == 0) {
        full = (float*)aligned_calloc_or_die(P * sizeof(float), "checkpoint");
        for (size_t i = 0; i < P; i++) { full[i] = -0.0f; }
    }
    zero_full_params(z, full);
    if (full) {
        // all-reduce (tp group, then pp group): every rank's owned elements into the full model
        if (comm->tp > 1) { comm_all_reduce_sum(&comm->tp_group, full, P, COMM_KIND_OTHER); }
        if (comm->pp > 1) { comm_all_reduce_sum(&comm->pp_group, full, P, COMM_KIND_OTHER); }
    }
    if (comm->world_rank == 0) {
        snprintf(path, sizeof(path), "%s/model_%08d.bin", dir, step);
        checkpoint_write_model(path, &model->config, full);
    }
    free(full);
    int per_dp = z->stage == 0 ? 1 : z->N;   // ZeRO-0: dp rank 0 writes its (and everyone's) state
    if (z->stage != 0 || z->rank == 0) {
        int n = zero_state_ranges(z, 1, NULL);
        StateRange* ranges = (StateRange*)malloc_or_die(sizeof(StateRange) * (n + 1), "state ranges");
        zero_state_ranges(z, 1, ranges);
        int piece = (comm->pp_rank * comm->tp + comm->tp_rank) * per_dp + (z->stage == 0 ? 0 : z->rank);
        snprintf(path, sizeof(path), "%s/state_%08d_%05d.bin", dir, step, piece);
        state_write_piece(path, &model->config, progress, comm->pp * comm->tp * per_dp, piece, n, ranges);
        free(ranges);
    }
    comm_barrier(&comm->world);
    if (comm->world_rank == 0) {
        checkpoint_write_done(dir, step);
        printf("checkpoint written: %s/model_%08d.bin\n", dir, step);
    }
}

#ifndef TESTING
int main(int argc, char** argv) {
    Comm comm;
    comm_init(&comm, &argc, &argv);
    int root = comm.world_rank == 0;
    TrainArgs args;
    train_args_defaults(&args);
    if (train_args_parse(&args, argc, argv)) {
        if (root) {
            TrainArgs defaults;
            train_args_defaults(&defaults);
            train_args_print_help(argv[0], &defaults);
        }
        comm_finalize(&comm);
        return 0;
    }
    train_args_validate(&args);
    if (args.sp && args.tp == 1) { fatal("--sp 1: sequence parallelism splits the sequence over the tensor-parallel group; it needs --tp > 1"); }
    if (args.deterministic) { fatal("--deterministic is a flag of the CUDA build (train_gpt2cu)"); }
    if (comm.world_size % (args.tp * args.pp) != 0) {
        fatal("--tp %d x --pp %d does not divide the %d ranks of this job", args.tp, args.pp, comm.world_size);
    }
    comm_setup_grid(&comm, args.tp, args.pp);
    PipelineScheduleKind pp_kind = strcmp(args.pp_schedule, "gpipe") == 0 ? PP_GPIPE : PP_1F1B;
    LRScheduleKind sched_kind;
    if (!lr_schedule_kind(args.lr_schedule, &sched_kind)) {
        fatal("-k: unknown learning-rate schedule '%s' (cosine, linear or constant)", args.lr_schedule);
    }
    if (args.output_dir && root) { ensure_writable_dir(args.output_dir, "-o"); }
    comm_barrier(&comm.world);

    // resume from the latest complete checkpoint in the output dir?
    int resume_step = args.resume ? checkpoint_latest_step(args.output_dir) : -1;
    GPT2Config config;
    float* params = gpt2_starting_params(args.model, args.output_dir, resume_step, (uint64_t)args.seed, &config);
    int B = args.B, T = args.T, N = comm.dp;
    if (T > config.max_seq_len) {
        fatal("-t: sequence length %d exceeds the model's maxT = %d", T, config.max_seq_len);
    }
    if (config.channels / config.num_heads > 256) {
        fatal("-e: head size C/NH = %d is larger than the 256 this build supports", config.channels / config.num_heads);
    }
    if (args.pp > config.num_layers) {
        fatal("--pp %d: the model has only %d layers; every stage needs at least one", args.pp, config.num_layers);
    }
    long long tokens_per_micro = (long long)B * T;
    long long total_batch = args.total_batch == -1 ? tokens_per_micro * N : args.total_batch;
    if (total_batch % (tokens_per_micro * N) != 0) {
        fatal("-d: total batch %lld tokens is not a multiple of B*T*DP = %d*%d*%d = %lld", total_batch,
              B, T, N, tokens_per_micro * N);
    }
    int M = (int)(total_batch / tokens_per_micro);   // microbatches per step, over all dp ranks

    if (args.sp && T % args.tp != 0) {
        fatal("--sp 1: the sequence length -t %d must be a multiple of --tp %d", T, args.tp);
    }
    GPT2 model;
    gpt2_init(&model, &config, params, args.zero_stage, &comm.dp_group, &comm.pp_group, &comm.tp_group, M);
    free(params);
    if (args.sp) { gpt2_enable_sequence_parallel(&model, B, T); }
    Zero* z = &model.zero;

    DataLoader train_loader, val_loader;
    int do_val = args.val_every > 0;
    int val_batches, train_steps;
    train_data_open(&args, B, T, config.vocab_size, total_batch, &train_loader, &val_loader, &val_batches,
                    &train_steps);
    LRSchedule schedule = {sched_kind, args.lr, args.warmup, train_steps, args.final_lr_frac};

    Tokenizer tokenizer;
    memset(&tokenizer, 0, sizeof(tokenizer));   // only world rank 0 prints samples
    if (root) {
        tokenizer_init_for_model(&tokenizer, args.tokenizer_path, config.vocab_size);
    }

    Pipeline pipe;
    pipeline_init(&pipe, &model, &comm.pp_group, pp_kind, z->local_microbatches, B, T, args.recompute);
    ActivationGrads agrads;
    activation_grads_alloc(&agrads, &config, B, T, comm.tp, args.sp);
    int genT = args.gen_T < config.max_seq_len ? args.gen_T : config.max_seq_len;
    int do_sample = args.sample_every > 0 && (comm.dp_rank == 0 || z->stage == 3);
    Activations sample_acts;
    if (do_sample) {
        activations_alloc(&sample_acts, &config, model.last_layer - model.first_layer, model.is_last, 1, genT, 0, comm.tp, 0);
    }

    TrainProgress progress = {0, 0, tokens_per_micro, args.shuffle, (uint64_t)args.seed};
    if (resume_step >= 0) {
        int n = zero_state_ranges(z, 0, NULL);   // every range this rank updates
        StateRange* ranges = (StateRange*)malloc_or_die(sizeof(StateRange) * (n + 1), "state ranges");
        zero_state_ranges(z, 0, ranges);
        TrainProgress saved;
        state_read(args.output_dir, resume_step, &config, n, ranges, &saved);
        free(ranges);
        if (saved.tokens_per_microbatch != tokens_per_micro || saved.shuffle != args.shuffle ||
            saved.shuffle_seed != (uint64_t)args.seed) {
            fatal("-y 1: the checkpoint in '%s' was trained with B*T = %lld, --shuffle %d, --seed %llu; "
                  "resume with the same values", args.output_dir, (long long)saved.tokens_per_microbatch,
                  saved.shuffle, (unsigned long long)saved.shuffle_seed);
        }
        progress = saved;
    }
    Logger logger;
    logger_init(&logger, args.output_dir, root, resume_step >= 0);

    double flops_per_step = (6.0 * (double)model.num_parameters
                           + 6.0 * config.num_layers * config.channels * T) * (double)total_batch;
    size_t P = model.num_parameters;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    ZeroMemory mem = zero_memory(z);
    // every stage's layers and activation memory, for the table (all-gather, pp group)
    float stage_info[3], all_stage_info[3 * 64];
    stage_info[0] = (float)model.first_layer;
    stage_info[1] = (float)model.last_layer;
    stage_info[2] = (float)(pipe.nslots * pipe.slot_bytes / 1048576.0);
    if (comm.pp <= 64) { comm_all_gather(&comm.pp_group, stage_info, all_stage_info, 3, COMM_KIND_OTHER); }
    if (root) {
        printf("+--------------------------------------------------------------------------+\n");
        printf("| train_gpt2 (CPU reference, canonical arithmetic, %-6s kernels, %2d threads)|\n", LLMC_SIMD_NAME, threads);
        printf("+--------------------------------------------------------------------------+\n");
        printf("| model         L=%d C=%d NH=%d V=%d Vp=%d maxT=%d\n", config.num_layers, config.channels,
               config.num_heads, config.vocab_size, config.padded_vocab_size, config.max_seq_len);
        if (resume_step >= 0) { printf("| init          %s/model_%08d.bin\n", args.output_dir, resume_step); }
        else { printf("| init          %s\n", args.model); }
        printf("| parameters    P = %zu (%.1f M)\n", P, P / 1e6);
        printf("| ranks         %d = %d data x %d tensor%s x %d pipeline; ZeRO stage %d\n", comm.world_size, N,
               comm.tp, args.sp ? " (+ sequence parallel)" : "", comm.pp, z->stage);
        printf("| batch         B=%d T=%d, %d microbatch(es) per step (%d per data-parallel rank) = %lld tokens\n",
               B, T, M, z->local_microbatches, total_batch);
        if (comm.pp > 1) {
            printf("| pipeline      %s over %d stages, %d microbatches; bubble model (S-1)/(M+S-1) = %.3f\n",
                   args.pp_schedule, comm.pp, z->local_microbatches, pipeline_bubble_fraction(&pipe.cfg));
            for (int st = 0; st < comm.pp && st < 64; st++) {
                PipelineConfig cfg = pipe.cfg;
                int n = pipeline_stage_actions(&cfg, st, NULL, 0, NULL, 0);
                PipelineAction* acts = (PipelineAction*)malloc_or_die(sizeof(PipelineAction) * (n ? n : 1), "actions");
                pipeline_stage_actions(&cfg, st, acts, n, NULL, 0);
                printf("|   stage %-3d   layers [%d, %d)%s%s, peak activations: %d microbatch(es), %.1f MiB\n", st,
                       (int)all_stage_info[3 * st], (int)all_stage_info[3 * st + 1], st == 0 ? " + embeddings" : "",
                       st == comm.pp - 1 ? " + head" : "", pipeline_max_in_flight(acts, n), all_stage_info[3 * st + 2]);
                free(acts);
            }
        }
        train_data_print_summary(&args, train_steps, &train_loader, &val_loader, val_batches);
        printf("| memory/rank   params %.1f MiB, grads %.1f MiB, AdamW %.1f MiB, activations %.1f MiB\n",
               mem.params / 1048576, mem.grads / 1048576, mem.optimizer / 1048576,
               (pipe.nslots * pipe.slot_bytes + agrads.bytes) / 1048576.0);
        if (comm.pp == 1) {
            printf("|               ZeRO paper, fp32 AdamW: %s = %.1f MiB (ours: %.1f MiB incl. padding and wte's 2nd gradient half)\n",
                   z->stage == 0 ? "16P" : z->stage == 1 ? "8P + 8P/N" : z->stage == 2 ? "4P + 12P/N" : "16P/N",
                   (z->stage == 0 ? 16.0 * P : z->stage == 1 ? 8.0 * P + 8.0 * P / N
                    : z->stage == 2 ? 4.0 * P + 12.0 * P / N : 16.0 * P / N) / 1048576,
                   (mem.params + mem.grads + mem.optimizer) / 1048576);
        }
        printf("| output        %s\n", args.output_dir ? args.output_dir : "(none)");
        if (resume_step >= 0) { printf("| resuming      from step %d\n", resume_step); }
        printf("+--------------------------------------------------------------------------+\n");
        fflush(stdout);
    }

    float* local_loss = (float*)calloc_or_die((size_t)z->local_microbatches + 1, sizeof(float), "losses");
    double total_time = 0.0;
    int timed_steps = 0;
    for (int step = (int)progress.step; step <= train_steps; step++) {
        int last_step = step == train_steps;

        if (do_val && (step % args.val_every == 0 || last_step)) {
            float val_loss = gpt2_validate(&model, &pipe, &comm, &pipe.slots[0].acts, &val_loader, val_batches, B, T);
            if (root) { printf("val loss %.6f\n", val_loss); }
            logger_log_val(&logger, step, val_loss);
        }
        if (do_sample && ((step > 0 && step % args.sample_every == 0) || last_step)) {
            sample_text(&model, &pipe, &comm, &sample_acts, &tokenizer, genT);
        }
        if (args.checkpoint_every > 0 && step != resume_step &&
            ((step > 0 && step % args.checkpoint_every == 0) || last_step)) {
            progress.step = step;
            write_checkpoint(&model, args.output_dir, &progress, &comm);
        }
        if (last_step) { break; }

        // ---- one optimizer step over M microbatches (M / N on each data-parallel rank) ----
        comm_reset_stats(&comm);
        double t0 = now_seconds();
        pipeline_step(&pipe, &model, &agrads, &train_loader, progress.microbatches_done, M, B, T,
                      args.overfit_single_batch, local_loss);
        float loss = global_mean_loss(&model, &comm, local_loss, z->local_microbatches, M, 0, (double)total_batch);
        float norm = zero_grad_norm(z, &comm.tp_group);
        float grad_scale = args.grad_clip > 0.0f && norm > args.grad_clip ? args.grad_clip / norm : 1.0f;
        float lr = lr_at_step(&schedule, step);
        AdamWStep s = adamw_step_constants(lr, args.beta1, args.beta2, args.eps, step + 1, grad_scale);
        zero_adamw_step(z, &s, args.weight_decay);
        progress.microbatches_done += M;
        progress.step = step + 1;
        double dt = now_seconds() - t0;
        // the pipeline bubble: the fraction of the step each stage spent not computing, and
        // each stage's mean forward and backward time per microbatch (all-gather, pp group)
        float timing[3] = {(float)(1.0 - pipe.busy / dt), (float)(pipe.fwd / z->local_microbatches * 1e3),
                           (float)(pipe.bwd / z->local_microbatches * 1e3)};
        float timing_all[3 * 64];
        if (comm.pp > 1 && comm.pp <= 64) { comm_all_gather(&comm.pp_group, timing, timing_all, 3, COMM_KIND_OTHER); }
        if (step > (int)0) { total_time += dt; timed_steps++; }
        if (root) {
            printf("step %4d/%d | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s | %.1f GFLOP/s\n",
                   step + 1, train_steps, loss, lr, norm, dt * 1e3, total_batch / dt, flops_per_step / dt / 1e9);
            if (comm.pp > 1 && comm.pp <= 64) {
                printf("           pipeline idle per stage:");
                for (int st = 0; st < comm.pp; st++) { printf(" %.2f", timing_all[3 * st]); }
                printf(" (model %.2f)\n", pipeline_bubble_fraction(&pipe.cfg));
                if (timed_steps == 0) {   // the measured costs, ready for the schedule drawing tool
                    printf("draw this step's schedule from its measured costs (ms per microbatch):\n"
                           "  dev/tools/pp_schedule --stages %d --microbatches %d --schedule %s --svg pipeline.svg --fwd ",
                           comm.pp, z->local_microbatches, args.pp_schedule);
                    for (int st = 0; st < comm.pp; st++) { printf("%s%.3f", st ? "," : "", timing_all[3 * st + 1]); }
                    printf(" --bwd ");
                    for (int st = 0; st < comm.pp; st++) { printf("%s%.3f", st ? "," : "", timing_all[3 * st + 2]); }
                    printf("\n");
                }
            }
            if (timed_steps == 0) {   // the first step of this run: what it sent, and the memory plan
                printf("communication per rank in this step (bytes sent):\n");
                comm_print_stats(&comm, stdout);
                printf("zero accounting: stage %d N %d P %zu VpC %zu L %d microbatches/rank %d | "
                       "bytes/rank/step grad %llu param %llu | bytes/rank params %.0f grads %.0f optimizer %.0f\n",
                       z->stage, N, P, (size_t)config.padded_vocab_size * config.channels, config.num_layers,
                       z->local_microbatches, (unsigned long long)comm.stats.bytes[COMM_KIND_GRAD],
                       (unsigned long long)comm.stats.bytes[COMM_KIND_PARAM], mem.params, mem.grads, mem.optimizer);
            }
            fflush(stdout);
        }
        logger_log_train(&logger, step, loss, lr, norm);
    }
    if (timed_steps > 0 && root) {
        printf("average step time %.1f ms (excluding the first)\n", total_time / timed_steps * 1e3);
    }

    free(local_loss);
    pipeline_free(&pipe);
    if (do_sample) { activations_free(&sample_acts); }
    activation_grads_free(&agrads);
    dataloader_free(&train_loader);
    if (do_val) { dataloader_free(&val_loader); }
    tokenizer_free(&tokenizer);
    gpt2_free(&model);
    comm_finalize(&comm);
    return 0;
}
#endif
