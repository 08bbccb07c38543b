/*
 * train_gpt2.c: GPT-2 training on the CPU, the reference build.
 *
 * Read top to bottom: the kernels (each forward beside its backward, with the shapes above
 * them), then the model (activations; the forward and backward in three parts - embeddings,
 * layers, head - with the tensor-parallel f/g operators where Megatron puts them), then a
 * short main. Everything else is shared with the CUDA build and lives in llmc/: the training
 * loop, the pipeline executor, validation, sampling and checkpoints in engine.h; parameters,
 * gradients and AdamW in zero.h (data parallelism, ZeRO); the communication in comm.h. Every
 * floating-point reduction follows the canonical order of llmc/canonical.h (rules R1-R6),
 * which is what makes this file the arithmetic truth: the CUDA build in deterministic mode
 * runs this very model on device kernels of the same names and arguments (train_gpt2.cu
 * includes this file with LLMC_DEVICE_KERNELS defined, which leaves out the CPU kernels and
 * main), and every parallel layout reproduces its bits.
 *
 * Shapes: B sequences of T tokens, C channels, NH heads of hs = C/NH, vocabulary V padded to
 * Vp, L layers. "BT" is B*T positions, row-major (b, t).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "llmc/utils.h"
#include "llmc/canonical.h"
#include "llmc/model.h"
#include "llmc/memory.h"
#include "llmc/comm.h"
#include "llmc/zero.h"
#include "llmc/tensor_parallel.h"
#include "llmc/moe.h"
#include "llmc/expert_parallel.h"
#include "llmc/engine.h"

#ifndef LLMC_DEVICE_KERNELS
#include "llmc/simd.h"
#include "llmc/fma_peak.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

// Scratch memory reused across calls (kernels run one at a time; slots keep them apart).
enum { SCRATCH_PACK, SCRATCH_DINP, SCRATCH_DOUT, SCRATCH_XPACK, SCRATCH_ATT, SCRATCH_ATT_PACK, SCRATCH_ATT_TILE, SCRATCH_SORT,
       SCRATCH_TREE, NUM_SCRATCH };
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
// dwpe[t] gets one term per sequence (its chunk sum is 0.0f + dout[b,t]), combined by the
// R1 tree over sequences; dwte_emb[v] sums the positions holding token v: per sequence the
// R2Z chunk sums over t (0.0f for chunks without v), then R1 over sequences. Rows of tokens
// not in the batch are 0. Every element is written (no accumulation into old values).
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
        int next = begin;   // first position of token v in sequence b, in (b, t) order
        for (int b = 0; b < B; b++) {
            // piece_at[p]: the first of v's positions in sequence b at or past piece p of 16
            int piece_at[2 * CANON_R + 1];
            for (int p = 0; p <= 2 * CANON_R; p++) {
                long start = (long)b * T + canon_piece_begin(T, 2 * CANON_R, p);
                while (next < end && order[next] < start) { next++; }
                piece_at[p] = next;
            }
            for (int ch = 0; ch < CANON_R; ch++) {
                float* acc = stack + (size_t)top * C;
                for (int c = 0; c < C; c++) { acc[c] = 0.0f; }
                int pieces[2] = {ch, 2 * CANON_R - 1 - ch};
                for (int half = 0; half < 2; half++) {
                    for (int i = piece_at[pieces[half]]; i < piece_at[pieces[half] + 1]; i++) {
                        const float* d = dout + (size_t)order[i] * C;
                        for (int c = 0; c < C; c++) { acc[c] = acc[c] + d[c]; }
                    }
                }
                top++;
                for (int m = canon_pos_merges_after(b, B, ch, CANON_R); m > 0; m--) {
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
// Under sequence (or context) parallelism a rank holds a zig-zag slice of T = T_full/K
// positions of each sequence, i.e. nchunks = 8/K of every sequence's 8 R2Z chunks: then
// seq_partials (2,B,C) receives each sequence's subtree for dweight and dbias, for the caller
// to finish over the group and over the sequences (sequence_tree); otherwise (seq_partials
// NULL, nchunks 8) the R3 is done here. The two halves are independent: dres NULL skips the
// input gradient, dweight and seq_partials NULL the parameter gradients (a split backward runs
// them at different times).
void layernorm_backward(float* dres, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int B, int T, int C, int nchunks, float* seq_partials) {
    int BT = dres ? B * T : 0;
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
    int Cp = dweight || seq_partials ? C : 0;
    #pragma omp parallel for
    for (int c0 = 0; c0 < Cp; c0 += 64) {
        int cn = C - c0 < 64 ? C - c0 : 64;
        float sw[40][64], sb[40][64];
        int top = 0;
        for (int b = 0; b < B; b++) {
            for (int ch = 0; ch < nchunks; ch++) {
                float aw[64], ab[64];
                for (int j = 0; j < cn; j++) { aw[j] = 0.0f; ab[j] = 0.0f; }
                for (int half = 0; half < 2; half++) {
                    long tb, te;
                    canon_zz_half(T, nchunks, ch, half, &tb, &te);
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
// products fused with fmaf, and the bias added after the tree. The specification, one output
// at a time (the kernel after it computes exactly these bits, faster; test_kernels checks):
void matmul_forward_naive(float* out, const float* inp, const float* weight, const float* bias,
                          int BT, int K, int OC, int nchunks) {
    #pragma omp parallel for
    for (int bt = 0; bt < BT; bt++) {
        for (int o = 0; o < OC; o++) {
            float partial[CANON_R];
            for (int ch = 0; ch < nchunks; ch++) {
                float acc = 0.0f;
                for (long k = ((long)K * ch) / nchunks; k < ((long)K * (ch + 1)) / nchunks; k++) {
                    acc = fmaf(inp[(size_t)bt * K + k], weight[(size_t)o * K + k], acc);
                }
                partial[ch] = acc;
            }
            float sum = canon_tree_sum(partial, nchunks, 1);
            out[(size_t)bt * OC + o] = bias ? sum + bias[o] : sum;
        }
    }
}

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

// A row or two (the sampler's KV-cache steps): the row tile would compute MR rows for one,
// so vectorise across outputs instead, lane j walking weight row o0 + j (a gather per k), four
// groups of VLEN outputs in flight; each output's chunks and tree are the tile's.
#define MM_FEW_ROWS 2
#define MM_FEW_GROUPS 4
static void matmul_forward_few_rows(float* out, const float* inp, const float* weight, const float* bias,
                                    int BT, int K, int OC, int nchunks) {
    int W = VLEN * MM_FEW_GROUPS, tasks = (OC + W - 1) / W;
    #pragma omp parallel for schedule(static)
    for (int task = 0; task < tasks; task++) {
        int o0 = task * W;
        vidx lanes[MM_FEW_GROUPS];
        for (int g = 0; g < MM_FEW_GROUPS; g++) {
            int n = OC - (o0 + g * VLEN);
            lanes[g] = vidx_strided(K, n < 0 ? 0 : n > VLEN ? VLEN : n);
        }
        for (int bt = 0; bt < BT; bt++) {
            const float* x = inp + (size_t)bt * K;
            vf stack[CANON_LOG2_R + 2][MM_FEW_GROUPS];
            int top = 0;
            for (int ch = 0; ch < nchunks; ch++) {
                int kb = (int)(((long)K * ch) / nchunks), ke = (int)(((long)K * (ch + 1)) / nchunks);
                vf acc[MM_FEW_GROUPS];
                for (int g = 0; g < MM_FEW_GROUPS; g++) { acc[g] = vf_zero(); }
                for (int k = kb; k < ke; k++) {
                    vf a = vf_set1(x[k]);
                    _Pragma("GCC unroll 4") for (int g = 0; g < MM_FEW_GROUPS; g++) {
                        const float* w = weight + (size_t)(o0 + g * VLEN < OC ? o0 + g * VLEN : o0) * K + k;
                        acc[g] = vf_fma(a, vf_gather(w, lanes[g]), acc[g]);
                    }
                }
                for (int g = 0; g < MM_FEW_GROUPS; g++) { stack[top][g] = acc[g]; }
                top++;
                for (int m = canon_tree_merges_after(ch, nchunks); m > 0; m--) {
                    for (int g = 0; g < MM_FEW_GROUPS; g++) { stack[top - 2][g] = vf_add(stack[top - 2][g], stack[top - 1][g]); }
                    top--;
                }
            }
            float tile[VLEN * MM_FEW_GROUPS];
            for (int g = 0; g < MM_FEW_GROUPS; g++) { vf_store(tile + g * VLEN, stack[0][g]); }
            for (int j = 0; j < W && o0 + j < OC; j++) {
                out[(size_t)bt * OC + o0 + j] = bias ? tile[j] + bias[o0 + j] : tile[j];
            }
        }
    }
}

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int BT, int K, int OC, int nchunks) {
    if (BT <= MM_FEW_ROWS) {
        matmul_forward_few_rows(out, inp, weight, bias, BT, K, OC, nchunks);
        return;
    }
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
// The specification of the backward below, one output at a time.
void matmul_backward_naive(float* dinp, float* dweight, float* dbias, const float* dout,
                           const float* inp, const float* weight, int B, int T, int K, int OC,
                           int groups, int nchunks) {
    int BT = B * T, og = OC / groups;
    #pragma omp parallel for
    for (int bt = 0; bt < BT; bt++) {   // dinp: chunk c is the c-th slice of every group
        for (int k = 0; dinp && k < K; k++) {
            float partial[CANON_R];
            for (int ch = 0; ch < nchunks; ch++) {
                float acc = 0.0f;
                for (int g = 0; g < groups; g++) {
                    for (long j = ((long)og * ch) / nchunks; j < ((long)og * (ch + 1)) / nchunks; j++) {
                        long o = (long)g * og + j;
                        acc = fmaf(dout[(size_t)bt * OC + o], weight[(size_t)o * K + k], acc);
                    }
                }
                partial[ch] = acc;
            }
            dinp[(size_t)bt * K + k] = canon_tree_sum(partial, nchunks, 1);
        }
    }
    #pragma omp parallel for
    for (int o = 0; o < OC; o++) {   // dweight, dbias: R3, per sequence the R2Z chunks of T, then R1
        for (int k = -1; k < K; k++) {   // k = -1: the bias
            if ((k < 0 && !dbias) || (k >= 0 && !dweight)) { continue; }
            float* seq = (float*)malloc_or_die(sizeof(float) * B, "matmul spec");
            for (int b = 0; b < B; b++) {
                float partial[CANON_R];
                for (int ch = 0; ch < CANON_R; ch++) {
                    float acc = 0.0f;
                    for (int half = 0; half < 2; half++) {
                        long tb, te;
                        canon_zz_half(T, CANON_R, ch, half, &tb, &te);
                        for (long t = tb; t < te; t++) {
                            size_t pos = (size_t)b * T + t;
                            acc = k < 0 ? acc + dout[pos * OC + o] : fmaf(dout[pos * OC + o], inp[pos * K + k], acc);
                        }
                    }
                    partial[ch] = acc;
                }
                seq[b] = canon_tree8(partial);
            }
            float sum = canon_tree_sum(seq, B, 1);
            if (k < 0) { dbias[o] = sum; } else { dweight[(size_t)o * K + k] = sum; }
            free(seq);
        }
    }
}

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

// dW tile: MM_NO outputs x (nv*VLEN) columns [k0, ...), all positions (R3; each sequence's T
// positions in tchunks R2Z chunks: 8, or a zig-zag slice's 8/D). x: the tile's columns of inp,
// position pos's at x + pos * ldx.
ALWAYS_INLINE void matmul_dweight_tile(float* dweight, const float* dout, const float* x, long ldx,
                                       int B, int T, int K, int OC, int o0, const int no,
                                       int k0, const int nv, int tchunks) {
    vf acc[MM_NO][MM_MV];
    vf stack[CANON_LOG2_R + 34][MM_NO][MM_MV];
    int top = 0;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < tchunks; ch++) {
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_zero(); }
            }
            for (int half = 0; half < 2; half++) {
                long tb, te;
                canon_zz_half(T, tchunks, ch, half, &tb, &te);
                for (long t = tb; t < te; t++) {
                    size_t pos = (size_t)b * T + t;
                    const float* xp = x + pos * ldx;
                    vf xv[MM_MV];
                    _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { xv[v] = vf_load(xp + v * VLEN); }
                    _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                        vf d = vf_set1(dout[pos * OC + o0 + j]);
                        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_fma(d, xv[v], acc[j][v]); }
                    }
                }
            }
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { stack[top][j][v] = acc[j][v]; }
            }
            top++;
            for (int m = canon_pos_merges_after(b, B, ch, tchunks); m > 0; m--) {
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
                                  int B, int T, int tchunks) {
    float stack[CANON_LOG2_R + 34];
    int top = 0;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < tchunks; ch++) {
            float acc = 0.0f;
            for (int half = 0; half < 2; half++) {
                long tb, te;
                canon_zz_half(T, tchunks, ch, half, &tb, &te);
                for (long t = tb; t < te; t++) {
                    size_t pos = (size_t)b * T + t;
                    acc = x ? fmaf(dout[pos * OC + o], x[pos * K + k], acc) : acc + dout[pos * OC + o];
                }
            }
            stack[top++] = acc;
            for (int m = canon_pos_merges_after(b, B, ch, tchunks); m > 0; m--) {
                stack[top - 2] = stack[top - 2] + stack[top - 1];
                top--;
            }
        }
    }
    return stack[0];
}

// dW of outputs [o0, o0 + no) and columns [k0, k0 + nv*VLEN), nv <= MM_MV (compile-time
// constants in each case)
ALWAYS_INLINE void matmul_dweight_nv(float* dweight, const float* dout, const float* x, long ldx, int B, int T,
                                     int K, int OC, int o0, const int no, int k0, int nv, int tchunks) {
    switch (nv) {
        case 1: matmul_dweight_tile(dweight, dout, x, ldx, B, T, K, OC, o0, no, k0, 1, tchunks); break;
#if MM_MV > 2
        case 3: matmul_dweight_tile(dweight, dout, x, ldx, B, T, K, OC, o0, no, k0, 3, tchunks); break;
        case 4: matmul_dweight_tile(dweight, dout, x, ldx, B, T, K, OC, o0, no, k0, 4, tchunks); break;
#endif
        default: matmul_dweight_tile(dweight, dout, x, ldx, B, T, K, OC, o0, no, k0, 2, tchunks); break;
    }
}

static void matmul_dweight_block(float* dweight, const float* dout, const float* x, long ldx, int B, int T, int K,
                                 int OC, int o0, int no, int k0, int nv, int tchunks) {
    switch (no) {
        case 6: matmul_dweight_nv(dweight, dout, x, ldx, B, T, K, OC, o0, 6, k0, nv, tchunks); break;
        case 5: matmul_dweight_nv(dweight, dout, x, ldx, B, T, K, OC, o0, 5, k0, nv, tchunks); break;
        case 4: matmul_dweight_nv(dweight, dout, x, ldx, B, T, K, OC, o0, 4, k0, nv, tchunks); break;
        case 3: matmul_dweight_nv(dweight, dout, x, ldx, B, T, K, OC, o0, 3, k0, nv, tchunks); break;
        case 2: matmul_dweight_nv(dweight, dout, x, ldx, B, T, K, OC, o0, 2, k0, nv, tchunks); break;
        default: matmul_dweight_nv(dweight, dout, x, ldx, B, T, K, OC, o0, 1, k0, nv, tchunks); break;
    }
}

// dweight (OC,K), dbias (OC) = R3 over positions, each sequence's in tchunks R2Z chunks.
// Tasks of MM_STRIP outputs (whole cache lines of dout's rows): the strip's columns of dout are
// packed once (they stream from cache for every tile of the strip, instead of one cache line
// per position and tile from a row OC floats long: the LM head's dout is B*T x Vp), then for
// each block of MM_MV vectors of inp's columns (packed too, one contiguous stream per block,
// and in cache for the strip's tiles) the strip's tiles of MM_NO outputs.
#define MM_STRIP 48
static void matmul_weight_grads(float* dweight, float* dbias, const float* dout, const float* inp, int B, int T,
                                int K, int OC, int tchunks) {
    int nstrips = dweight ? (OC + MM_STRIP - 1) / MM_STRIP : 0;
    size_t BT = (size_t)B * T;
    int kvec_end = K / VLEN * VLEN, W = MM_MV * VLEN, kblocks = (kvec_end + W - 1) / W;
    float* packs = scratch(SCRATCH_DOUT, sizeof(float) * (size_t)thread_count() * BT * MM_STRIP);
    float* xpack = scratch(SCRATCH_XPACK, sizeof(float) * ((size_t)kblocks * BT * W + 1));   // [block][pos][W]
    #pragma omp parallel for collapse(2)
    for (int kb = 0; kb < (nstrips ? kblocks : 0); kb++) {
        for (size_t pos = 0; pos < BT; pos++) {
            int k0 = kb * W, w = kvec_end - k0 < W ? kvec_end - k0 : W;
            memcpy(xpack + ((size_t)kb * BT + pos) * W, inp + pos * K + k0, sizeof(float) * w);
        }
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (int s = 0; s < nstrips; s++) {
        int s0 = s * MM_STRIP, ns = OC - s0 < MM_STRIP ? OC - s0 : MM_STRIP;
        float* strip = packs + (size_t)thread_index() * BT * MM_STRIP;   // (BT, ns) of dout
        for (size_t pos = 0; pos < BT; pos++) { memcpy(strip + pos * ns, dout + pos * OC + s0, sizeof(float) * ns); }
        float* dw = dweight + (size_t)s0 * K;
        for (int kb = 0; kb < kblocks; kb++) {
            int k0 = kb * W, nv = (kvec_end - k0) / VLEN < MM_MV ? (kvec_end - k0) / VLEN : MM_MV;
            const float* x = xpack + (size_t)kb * BT * W;
            for (int o0 = 0; o0 < ns; o0 += MM_NO) {
                matmul_dweight_block(dw, strip, x, W, B, T, K, ns, o0, ns - o0 < MM_NO ? ns - o0 : MM_NO, k0, nv, tchunks);
            }
        }
        for (int o = 0; o < ns; o++) {   // the columns that do not fill a vector
            for (int k = kvec_end; k < K; k++) {
                dw[(size_t)o * K + k] = position_reduce_elem(strip, ns, o, inp, K, k, B, T, tchunks);
            }
        }
    }
    if (dbias) {
        #pragma omp parallel for
        for (int o = 0; o < OC; o++) { dbias[o] = position_reduce_elem(dout, OC, o, NULL, 0, 0, B, T, tchunks); }
    }
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int B, int T, int K, int OC,
                     int groups, int nchunks) {
    if (dinp) { matmul_backward_dinp(dinp, dout, weight, B * T, K, OC, groups, nchunks); }
    matmul_weight_grads(dweight, dbias, dout, inp, B, T, K, OC, CANON_R);
}

// Each sequence's subtree of matmul_backward's weight and bias gradients, for a rank that holds
// a zig-zag slice of T positions of every sequence (context parallelism: tchunks = 8/D of the
// R2Z chunks), which the group finishes: sequence b's at dweight + b*seq_stride (OC,K) and
// dbias + b*seq_stride (OC; NULL: none).
void matmul_backward_seqs(float* dweight, float* dbias, long seq_stride, const float* dout, const float* inp,
                          int B, int T, int K, int OC, int tchunks) {
    for (int b = 0; b < B; b++) {
        matmul_weight_grads(dweight + b * seq_stride, dbias ? dbias + b * seq_stride : NULL, dout + (size_t)b * T * OC,
                            inp + (size_t)b * T * K, 1, T, K, OC, tchunks);
    }
}

// ------------------------------------------------------------------------------------------
// attention, causal, per (b, h) with hs = C/NH. The specification, written plainly (the fast
// kernels after it compute exactly these bits):
//   qkv (B,T,3C) holds q | k | v, head h at channels [h*hs, (h+1)*hs) of each
//   s[t][t2] = dot(q_t, k_t2) * (1/sqrt(hs))     R2 over hs, for t2 <= t
//   att[t][t2] = exp(s - max_t2 s) / Z_t,  Z_t = R2Z over keys of the exps (the max is exact)
//   out[t] = R2Z over keys t2 <= t of att[t][t2] * v_t2       out (B,T,C), att (B,NH,T,T)
// Keys past t are not part of any sum (an empty stretch of a chunk adds nothing).
// out (n) = R2Z over j of w[j] * rows[j] for the j in [lo, hi) of a dimension of length T (the
// keys, or the queries): zig-zag chunk c of T accumulates its j's in order with fmaf, the 8
// partial rows are combined by R1; positions outside [lo, hi) are not part of the sum.
static void attention_weighted_rows(float* out, const float* w, long wstride, const float* rows,
                                    long rstride, int T, long lo, long hi, int n) {
    float stack[CANON_LOG2_R + 1][256];
    int top = 0;
    for (int ch = 0; ch < CANON_R; ch++) {
        float* acc = stack[top];
        for (int d = 0; d < n; d++) { acc[d] = 0.0f; }
        for (int half = 0; half < 2; half++) {
            long b, e;
            canon_zz_half(T, CANON_R, ch, half, &b, &e);
            for (long j = b < lo ? lo : b; j < e && j < hi; j++) {
                float wj = w[j * wstride];
                const float* r = rows + j * rstride;
                for (int d = 0; d < n; d++) { acc[d] = fmaf(wj, r[d], acc[d]); }
            }
        }
        top++;
        for (int m = canon_tree_merges_after(ch, CANON_R); m > 0; m--) {
            for (int d = 0; d < n; d++) { stack[top - 2][d] = stack[top - 2][d] + stack[top - 1][d]; }
            top--;
        }
    }
    memcpy(out, stack[0], sizeof(float) * n);
}

// Query row t of head h of one sequence (qkv (T,3C)): att row a (T) and out (hs) = the row's
// output, exactly as above.
static void attention_query_row(float* out, float* a, const float* qkv, int t, int T, int C, int NH, int h) {
    int hs = C / NH;
    size_t C3 = 3 * (size_t)C;
    float scale = canon_rsqrtf((float)hs);
    const float* q = qkv + (size_t)t * C3 + h * hs;
    float maxv = -canon_inf();
    for (int t2 = 0; t2 <= t; t2++) {
        const float* k = qkv + (size_t)t2 * C3 + C + h * hs;
        a[t2] = canon_dot(q, 1, k, 1, hs) * scale;
        if (a[t2] > maxv) { maxv = a[t2]; }
    }
    for (int t2 = 0; t2 <= t; t2++) { a[t2] = canon_expf(a[t2] - maxv); }
    float partial[CANON_R];
    for (int ch = 0; ch < CANON_R; ch++) {
        float acc = 0.0f;
        for (int half = 0; half < 2; half++) {
            long b0, e0;
            canon_zz_half(T, CANON_R, ch, half, &b0, &e0);
            for (long t2 = b0; t2 < e0 && t2 <= t; t2++) { acc = acc + a[t2]; }
        }
        partial[ch] = acc;
    }
    float z = canon_tree8(partial);
    for (int t2 = 0; t2 <= t; t2++) { a[t2] = a[t2] / z; }
    for (int t2 = t + 1; t2 < T; t2++) { a[t2] = 0.0f; }
    attention_weighted_rows(out, a, 1, qkv + 2 * C + h * hs, C3, T, 0, t + 1, hs);
}

void attention_forward_naive(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    size_t C3 = 3 * (size_t)C;
    #pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            for (int t = 0; t < T; t++) {
                attention_query_row(out + ((size_t)b * T + t) * C + h * hs, att + (((size_t)b * NH + h) * T + t) * T,
                                    qkv + (size_t)b * T * C3, t, T, C, NH, h);
            }
        }
    }
}

// Generation with a KV cache (train_gpt2.c's sampler): query row t of one sequence laid out
// over T positions, against the keys and values of rows 0..t that qkv (T,3C) already holds:
// out row t (C) and att's rows t (NH,T,T). Row t of attention_forward over the same T, bit for
// bit (the reductions over keys are R2Z chunks of T, whatever rows are computed).
void attention_forward_row(float* out, float* att, const float* qkv, int t, int T, int C, int NH) {
    int hs = C / NH;
    #pragma omp parallel for
    for (int h = 0; h < NH; h++) {
        attention_query_row(out + (size_t)t * C + h * hs, att + ((size_t)h * T + t) * T, qkv, t, T, C, NH, h);
    }
}

// Backward, per (b, h):
//   datt[t][t2] = dot(dout_t, v_t2)                       R2 over hs
//   S_t = R2Z over keys of fmaf(att, datt);  ds = att * (datt - S_t) * scale
//   dq_t  = R2Z over keys t2 <= t of ds[t][t2] * k_t2
//   dk_t2 = R2Z over queries t >= t2 of ds[t][t2] * q_t
//   dv_t2 = R2Z over queries t >= t2 of att[t][t2] * dout_t         dqkv (B,T,3C) written
void attention_backward_naive(float* dqkv, const float* dout, const float* qkv, const float* att,
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
                    for (int half = 0; half < 2; half++) {
                        long b0, e0;
                        canon_zz_half(T, CANON_R, ch, half, &b0, &e0);
                        for (long t2 = b0; t2 < e0 && t2 <= t; t2++) { acc = fmaf(at[(size_t)t * T + t2], dst[t2], acc); }
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
// attention, fast: exactly the bits of attention_forward_naive and attention_backward_naive
// (test_kernels checks), vectorised across outputs and blocked so that a tile's rows of att
// stay in cache. Every product has one of two shapes:
//  - scores (s = q.k, datt = dout.v): a tile of up to ATT_NR query rows x vectors of keys; the
//    keys packed transposed (kt[d][j], zero past T), the query broadcast; R2 over hs in
//    registers, as matmul_forward's tiles do.
//  - weighted rows (att@v and ds@k over keys; ds^T@q and att^T@dout over queries): a tile of up
//    to ATT_NR output rows x vectors of the head's channels; the weight broadcast, the x row
//    loaded; R2Z over j, where output row r takes only the j in [lo[r], hi[r]) (the causal
//    mask: a term outside is skipped, never added as a zero).
// The row reductions of the softmax (Z) and of its backward (S) run the tile's rows side by
// side, each row's chunks in its own order.
#define ATT_NR 6

// out row r (r < nr) = R2Z over j < nj (nchunks chunks) of w(r, j) * x row j, j in [lo[r], hi[r])
typedef struct {
    const float* w; long wr, wj;   // w(r, j) = w[r * wr + j * wj]
    const float* x; long ldx;      // x row j at x + j * ldx
    float* out; long ldo;          // out row r at out + r * ldo
    long nj; int nchunks;          // the reduced dimension: its length and R2Z chunks
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
    vf stack[CANON_LOG2_R + 2][ATT_NR][MM_MV];
    int top = 0;
    for (int c = 0; c < a->nchunks; c++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[r][v] = vf_zero(); }
        }
        for (int half = 0; half < 2; half++) {
            long pb, pe;
            canon_zz_half(a->nj, a->nchunks, c, half, &pb, &pe);
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
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { stack[top][r][v] = acc[r][v]; }
        }
        top++;
        for (int m = canon_tree_merges_after(c, a->nchunks); m > 0; m--) {
            _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
                    stack[top - 2][r][v] = vf_add(stack[top - 2][r][v], stack[top - 1][r][v]);
                }
            }
            top--;
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { vf_store(a->out + r * a->ldo + d0 + v * VLEN, stack[0][r][v]); }
    }
}

// One output of the same, scalar (the channels that do not fill a vector).
static float attn_rows_elem(const AttRows* a, int r, int d) {
    float stack[CANON_LOG2_R + 2];
    int top = 0;
    for (int c = 0; c < a->nchunks; c++) {
        float acc = 0.0f;
        for (int half = 0; half < 2; half++) {
            long pb, pe;
            canon_zz_half(a->nj, a->nchunks, c, half, &pb, &pe);
            for (long j = pb < a->lo[r] ? a->lo[r] : pb; j < pe && j < a->hi[r]; j++) {
                acc = fmaf(a->w[r * a->wr + j * a->wj], a->x[j * a->ldx + d], acc);
            }
        }
        stack[top++] = acc;
        for (int m = canon_tree_merges_after(c, a->nchunks); m > 0; m--) {
            stack[top - 2] = stack[top - 2] + stack[top - 1];
            top--;
        }
    }
    return stack[0];
}

ALWAYS_INLINE void attn_rows_nv(const AttRows* a, const int nr, int d0, int nv) {
    switch (nv) {
        case 1: attn_rows_tile(a, nr, d0, 1); break;
#if MM_MV > 2
        case 3: attn_rows_tile(a, nr, d0, 3); break;
        case 4: attn_rows_tile(a, nr, d0, 4); break;
#endif
        default: attn_rows_tile(a, nr, d0, 2); break;
    }
}

// The outputs of nr <= ATT_NR rows, channels [0, n).
static void attn_rows(const AttRows* a, int nr, int n) {
    int nvec = n / VLEN;
    for (int d0 = 0; d0 < nvec * VLEN; d0 += MM_MV * VLEN) {
        int nv = nvec - d0 / VLEN < MM_MV ? nvec - d0 / VLEN : MM_MV;
        switch (nr) {
            case 6: attn_rows_nv(a, 6, d0, nv); break;
            case 5: attn_rows_nv(a, 5, d0, nv); break;
            case 4: attn_rows_nv(a, 4, d0, nv); break;
            case 3: attn_rows_nv(a, 3, d0, nv); break;
            case 2: attn_rows_nv(a, 2, d0, nv); break;
            default: attn_rows_nv(a, 1, d0, nv); break;
        }
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
    vf stack[CANON_LOG2_R + 2][ATT_NR][MM_MV];
    int top = 0;
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
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { stack[top][r][v] = acc[r][v]; }
        }
        top++;
        for (int m = canon_tree_merges_after(c, CANON_R); m > 0; m--) {
            _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
                    stack[top - 2][r][v] = vf_add(stack[top - 2][r][v], stack[top - 1][r][v]);
                }
            }
            top--;
        }
    }
    vf sc = vf_set1(scale);
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) {
            vf_store(s + r * lds + j0 + v * VLEN, scale == 1.0f ? stack[0][r][v] : vf_mul(stack[0][r][v], sc));
        }
    }
}

ALWAYS_INLINE void attn_scores_nv(float* s, long lds, const float* q, long ldq, const float* kt, long ldk, int hs,
                                  const int nr, int j0, int nv, float scale) {
    switch (nv) {
        case 1: attn_scores_tile(s, lds, q, ldq, kt, ldk, hs, nr, j0, 1, scale); break;
#if MM_MV > 2
        case 3: attn_scores_tile(s, lds, q, ldq, kt, ldk, hs, nr, j0, 3, scale); break;
        case 4: attn_scores_tile(s, lds, q, ldq, kt, ldk, hs, nr, j0, 4, scale); break;
#endif
        default: attn_scores_tile(s, lds, q, ldq, kt, ldk, hs, nr, j0, 2, scale); break;
    }
}

// Scores of nr <= ATT_NR query rows against the keys [0, nkeys) (rounded up to whole vectors:
// s rows and kt rows hold at least that many).
static void attn_scores(float* s, long lds, const float* q, long ldq, const float* kt, long ldk, int hs, int nr,
                        int nkeys, float scale) {
    int nvec = (nkeys + VLEN - 1) / VLEN;
    for (int j0 = 0; j0 < nvec * VLEN; j0 += MM_MV * VLEN) {
        int nv = nvec - j0 / VLEN < MM_MV ? nvec - j0 / VLEN : MM_MV;
        switch (nr) {
            case 6: attn_scores_nv(s, lds, q, ldq, kt, ldk, hs, 6, j0, nv, scale); break;
            case 5: attn_scores_nv(s, lds, q, ldq, kt, ldk, hs, 5, j0, nv, scale); break;
            case 4: attn_scores_nv(s, lds, q, ldq, kt, ldk, hs, 4, j0, nv, scale); break;
            case 3: attn_scores_nv(s, lds, q, ldq, kt, ldk, hs, 3, j0, nv, scale); break;
            case 2: attn_scores_nv(s, lds, q, ldq, kt, ldk, hs, 2, j0, nv, scale); break;
            default: attn_scores_nv(s, lds, q, ldq, kt, ldk, hs, 1, j0, nv, scale); break;
        }
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

// R2Z sums (nchunks chunks over nj) of the nr rows x (stride ldx), row r over j < hi[r]: the
// sum of x (y NULL), or the fmaf-accumulated dot product with y (stride ldy); rows side by side.
static void attn_row_sums(float* out, const float* x, long ldx, const float* y, long ldy, int nr, const int* hi,
                          long nj, int nchunks) {
    float part[CANON_R][ATT_NR];
    int hi_any = 0;
    for (int r = 0; r < nr; r++) { hi_any = hi[r] > hi_any ? hi[r] : hi_any; }
    for (int c = 0; c < nchunks; c++) {
        float acc[ATT_NR] = {0.0f};
        for (int half = 0; half < 2; half++) {
            long pb, pe;
            canon_zz_half(nj, nchunks, c, half, &pb, &pe);
            for (long j = pb; j < pe && j < hi_any; j++) {
                for (int r = 0; r < nr; r++) {
                    if (j < hi[r]) { acc[r] = y ? fmaf(x[r * ldx + j], y[r * ldy + j], acc[r]) : acc[r] + x[r * ldx + j]; }
                }
            }
        }
        for (int r = 0; r < nr; r++) { part[c][r] = acc[r]; }
    }
    for (int r = 0; r < nr; r++) {
        float p[CANON_R];
        for (int c = 0; c < nchunks; c++) { p[c] = part[c][r]; }
        out[r] = canon_tree_sum(p, nchunks, 1);
    }
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
static long attn_padded(int T) { return ((long)T + MM_MV * VLEN - 1) / (MM_MV * VLEN) * (MM_MV * VLEN); }

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH, BH = B * NH;
    long C3 = 3L * C, Tp = attn_padded(T);
    float scale = canon_rsqrtf((float)hs);
    float* kt = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * hs * (Tp + T));
    float* vr = kt + (size_t)BH * hs * Tp;
    float* tiles = scratch(SCRATCH_ATT_TILE, sizeof(float) * (size_t)thread_count() * ATT_NR * Tp);
    attn_pack_transposed(kt, Tp, qkv + C, C3, B, T, NH, hs);
    attn_pack_rows(vr, qkv + 2 * C, C3, B, T, NH, hs);
    int ntiles = (T + ATT_NR - 1) / ATT_NR;
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {   // a head's tiles in a row, longest rows first
        int tile = ntiles - 1 - (int)(idx % ntiles), bh = (int)(idx / ntiles), b = bh / NH, h = bh % NH;
        int t0 = tile * ATT_NR, nr = T - t0 < ATT_NR ? T - t0 : ATT_NR;
        int lo[ATT_NR], hi[ATT_NR];
        attn_bounds(lo, hi, t0, 0, T);
        float* s = tiles + (size_t)thread_index() * ATT_NR * Tp;
        float* a = att + ((size_t)bh * T + t0) * T;
        attn_scores(s, Tp, qkv + ((size_t)b * T + t0) * C3 + h * hs, C3, kt + (size_t)bh * hs * Tp, Tp, hs, nr,
                    t0 + nr, scale);
        // softmax: the max (exact), the exps, Z = R2Z over the keys, the division; 0 past t
        float z[ATT_NR];
        for (int r = 0; r < nr; r++) {
            float* sr = s + r * Tp;
            exps_shifted(sr, hi[r], attn_row_max(sr, hi[r]));
        }
        attn_row_sums(z, s, Tp, NULL, 0, nr, hi, T, CANON_R);
        for (int r = 0; r < nr; r++) {
            float* ar = a + (size_t)r * T;
            const float* sr = s + r * Tp;
            float zr = z[r];
            #pragma omp simd
            for (int j = 0; j < hi[r]; j++) { ar[j] = sr[j] / zr; }
            for (int j = hi[r]; j < T; j++) { ar[j] = 0.0f; }
        }
        AttRows av = {a, T, 1, vr + (size_t)bh * T * hs, hs, out + ((size_t)b * T + t0) * C + h * hs, C, T, CANON_R, lo, hi};
        attn_rows(&av, nr, hs);
    }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                        int B, int T, int C, int NH) {
    int hs = C / NH, BH = B * NH;
    long C3 = 3L * C, Tp = attn_padded(T);
    float scale = canon_rsqrtf((float)hs);
    size_t head = (size_t)T * hs;
    float* vt = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * (hs * Tp + 3 * head));
    float* kr = vt + (size_t)BH * hs * Tp;   // the rows of k, q and dout of every head
    float* qr = kr + BH * head;
    float* dr = qr + BH * head;
    float* tiles = scratch(SCRATCH_ATT_TILE, sizeof(float) * (size_t)thread_count() * ATT_NR * Tp);
    float* ds_all = scratch(SCRATCH_ATT, sizeof(float) * (size_t)BH * T * T);
    attn_pack_transposed(vt, Tp, qkv + 2 * C, C3, B, T, NH, hs);
    attn_pack_rows(kr, qkv + C, C3, B, T, NH, hs);
    attn_pack_rows(qr, qkv, C3, B, T, NH, hs);
    attn_pack_rows(dr, dout, C, B, T, NH, hs);
    int ntiles = (T + ATT_NR - 1) / ATT_NR;
    // per query tile: datt, S, ds (kept for the second part), dq = R2Z over keys of ds * k
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {   // a head's tiles in a row, longest rows first
        int tile = ntiles - 1 - (int)(idx % ntiles), bh = (int)(idx / ntiles), b = bh / NH, h = bh % NH;
        int t0 = tile * ATT_NR, nr = T - t0 < ATT_NR ? T - t0 : ATT_NR;
        int lo[ATT_NR], hi[ATT_NR];
        attn_bounds(lo, hi, t0, 0, T);
        float* datt = tiles + (size_t)thread_index() * ATT_NR * Tp;
        const float* a = att + ((size_t)bh * T + t0) * T;
        float* ds = ds_all + ((size_t)bh * T + t0) * T;
        attn_scores(datt, Tp, dout + ((size_t)b * T + t0) * C + h * hs, C, vt + (size_t)bh * hs * Tp, Tp, hs, nr,
                    t0 + nr, 1.0f);
        float S[ATT_NR];
        attn_row_sums(S, a, T, datt, Tp, nr, hi, T, CANON_R);
        for (int r = 0; r < nr; r++) {
            const float* ar = a + (size_t)r * T;
            const float* dr = datt + r * Tp;
            float* sr = ds + (size_t)r * T;
            float Sr = S[r];
            #pragma omp simd
            for (int j = 0; j < hi[r]; j++) { sr[j] = ar[j] * (dr[j] - Sr) * scale; }
        }
        AttRows dq = {ds, T, 1, kr + bh * head, hs, dqkv + ((size_t)b * T + t0) * C3 + h * hs, C3, T, CANON_R, lo, hi};
        attn_rows(&dq, nr, hs);
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
            AttRows dk = {ds_all + tt + t0, 1, T, qr + bh * head, hs, drow + C, C3, T, CANON_R, lo, hi};
            AttRows dv = {att + tt + t0, 1, T, dr + bh * head, hs, drow + 2 * C, C3, T, CANON_R, lo, hi};
            attn_rows(&dk, nr, hs);
            attn_rows(&dv, nr, hs);
        }
    }
}

// ------------------------------------------------------------------------------------------
// context parallelism's attention, one block of keys at a time (llmc/context_parallel.h drives
// them around the group). Rank r of an N-way context-parallel group holds the queries of its
// zig-zag slice of each sequence (Tq = T/N local positions, canonical.h R2Z) and sees the keys
// and values of every rank's slice in turn: block s. att (B,NH,Tq,T) keeps block s in columns
// [s*Tq, (s+1)*Tq); a query attends to the keys of block s at global positions up to its own,
// a prefix of the block (canon_zz_count_le). Each reduction over keys is R2Z within a block
// (8/N chunks of the block's local sequence: a complete subtree of the one-rank tree) and R1
// over the blocks in rank order; the reductions over queries (dk, dv) likewise, over each
// rank's queries, then R1 over the ranks. With N = 1 these are attention_forward and
// attention_backward cut into passes: the same helpers, the same bits.
//   qkv (B,Tq,3C) this rank's; kblk, vblk (B,Tq,C) block s's keys or values; C, NH this
//   rank's channels and heads (tensor parallelism splits them as usual)

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
    int Tq = T / N;
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
    int hs = C / NH, BH = B * NH, Tq = T / N;
    long Tp = attn_padded(Tq);
    float* kt = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * hs * Tp);
    float* tiles = scratch(SCRATCH_ATT_TILE, sizeof(float) * (size_t)thread_count() * ATT_NR * Tp);
    attn_pack_transposed(kt, Tp, kblk, C, B, Tq, NH, hs);
    int ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        int tile = (int)(idx % ntiles), bh = (int)(idx / ntiles), b = bh / NH, h = bh % NH;
        int t0 = tile * ATT_NR, nr = Tq - t0 < ATT_NR ? Tq - t0 : ATT_NR;
        int lo[ATT_NR], hi[ATT_NR];
        cp_key_bounds(lo, hi, t0, nr, T, N, r, s);
        int nkeys = cp_max(hi, nr);
        if (nkeys == 0) { continue; }
        float* tile_s = tiles + (size_t)thread_index() * ATT_NR * Tp;
        attn_scores(tile_s, Tp, q + ((size_t)b * Tq + t0) * ldq + h * hs, ldq, kt + (size_t)bh * hs * Tp, Tp, hs, nr,
                    nkeys, scale);
        for (int i = 0; i < nr; i++) {
            memcpy(att + ((size_t)bh * Tq + t0 + i) * T + (size_t)s * Tq, tile_s + i * Tp, sizeof(float) * hi[i]);
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
    int Tq = T / N, ntiles = (Tq + ATT_NR - 1) / ATT_NR;
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
                float ms = attn_row_max(rows + (size_t)i * T + (size_t)s * Tq, hi[s][i]);
                m = ms > m ? ms : m;
            }
            maxv[i] = m;
        }
        for (int s = 0; s < N; s++) {
            for (int i = 0; i < nr; i++) { exps_shifted(rows + (size_t)i * T + (size_t)s * Tq, hi[s][i], maxv[i]); }
            attn_row_sums(zs[s], rows + (size_t)s * Tq, T, NULL, 0, nr, hi[s], Tq, CANON_R / N);
        }
        for (int i = 0; i < nr; i++) {
            float part[CANON_R];
            for (int s = 0; s < N; s++) { part[s] = zs[s][i]; }
            float z = canon_tree_sum(part, N, 1);
            for (int s = 0; s < N; s++) {
                float* a = rows + (size_t)i * T + (size_t)s * Tq;
                #pragma omp simd
                for (int j = 0; j < hi[s][i]; j++) { a[j] = a[j] / z; }
                for (int j = hi[s][i]; j < Tq; j++) { a[j] = 0.0f; }
            }
        }
    }
}

// out (B,Tq,C) = block s's subtree of att @ v: R2Z over the block's keys (8/N chunks)
void attention_values_block(float* out, const float* att, const float* vblk, int B, int T, int C, int NH, int N,
                            int r, int s) {
    int hs = C / NH, BH = B * NH, Tq = T / N, ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    float* vr = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * Tq * hs);
    attn_pack_rows(vr, vblk, C, B, Tq, NH, hs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        int tile = (int)(idx % ntiles), bh = (int)(idx / ntiles), b = bh / NH, h = bh % NH;
        int t0 = tile * ATT_NR, nr = Tq - t0 < ATT_NR ? Tq - t0 : ATT_NR;
        int lo[ATT_NR], hi[ATT_NR];
        cp_key_bounds(lo, hi, t0, nr, T, N, r, s);
        AttRows av = {att + ((size_t)bh * Tq + t0) * T + (size_t)s * Tq, T, 1, vr + (size_t)bh * Tq * hs, hs,
                      out + ((size_t)b * Tq + t0) * C + h * hs, C, Tq, CANON_R / N, lo, hi};
        attn_rows(&av, nr, hs);
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
    int Tq = T / N, ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    float scale = canon_rsqrtf((float)(C / NH));
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)B * NH * ntiles; idx++) {
        int tile = (int)(idx % ntiles), bh = (int)(idx / ntiles);
        int t0 = tile * ATT_NR, nr = Tq - t0 < ATT_NR ? Tq - t0 : ATT_NR;
        size_t row0 = ((size_t)bh * Tq + t0) * T;
        int lo[CANON_R][ATT_NR], hi[CANON_R][ATT_NR];
        float ss[CANON_R][ATT_NR];
        for (int s = 0; s < N; s++) {
            cp_key_bounds(lo[s], hi[s], t0, nr, T, N, r, s);
            attn_row_sums(ss[s], att + row0 + (size_t)s * Tq, T, ds + row0 + (size_t)s * Tq, T, nr, hi[s], Tq, CANON_R / N);
        }
        for (int i = 0; i < nr; i++) {
            float part[CANON_R];
            for (int s = 0; s < N; s++) { part[s] = ss[s][i]; }
            float S = canon_tree_sum(part, N, 1);
            for (int s = 0; s < N; s++) {
                const float* a = att + row0 + (size_t)i * T + (size_t)s * Tq;
                float* d = ds + row0 + (size_t)i * T + (size_t)s * Tq;
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

// dk, dv (B,Tq,C) of block s's keys = this rank's subtree over its queries (R2Z, 8/N chunks)
// of ds^T @ q and att^T @ dout: the partials the key's owner sums over the ranks
void attention_dkv_block(float* dk, float* dv, const float* ds, const float* att, const float* qkv, const float* dout,
                         int B, int T, int C, int NH, int N, int r, int s) {
    int hs = C / NH, BH = B * NH, Tq = T / N, ntiles = (Tq + ATT_NR - 1) / ATT_NR;
    float* qr = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)BH * Tq * hs * 2);
    float* dr = qr + (size_t)BH * Tq * hs;
    attn_pack_rows(qr, qkv, 3L * C, B, Tq, NH, hs);
    attn_pack_rows(dr, dout, C, B, Tq, NH, hs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (long idx = 0; idx < (long)BH * ntiles; idx++) {
        int tile = (int)(idx % ntiles), bh = (int)(idx / ntiles), b = bh / NH, h = bh % NH;
        int j0 = tile * ATT_NR, nr = Tq - j0 < ATT_NR ? Tq - j0 : ATT_NR;
        int lo[ATT_NR], hi[ATT_NR];
        cp_query_bounds(lo, hi, j0, nr, T, N, r, s);
        size_t cols = (size_t)bh * Tq * T + (size_t)s * Tq + j0;
        size_t o = ((size_t)b * Tq + j0) * C + h * hs;
        AttRows k = {ds + cols, 1, T, qr + (size_t)bh * Tq * hs, hs, dk + o, C, Tq, CANON_R / N, lo, hi};
        AttRows v = {att + cols, 1, T, dr + (size_t)bh * Tq * hs, hs, dv + o, C, Tq, CANON_R / N, lo, hi};
        attn_rows(&k, nr, hs);
        attn_rows(&v, nr, hs);
    }
}

// dst rows (stride ldd) <- width floats of each of `rows` src rows (stride lds): a tensor's
// columns packed for sending, or unpacked into place
void copy_rows(float* dst, long ldd, const float* src, long lds, long rows, int width) {
    #pragma omp parallel for
    for (long i = 0; i < rows; i++) { memcpy(dst + i * ldd, src + i * lds, sizeof(float) * width); }
}

// ------------------------------------------------------------------------------------------
// GELU (tanh form), elementwise. vf_tanh, vf_gelu and vf_gelu_grad are canonical.h's
// canon_tanhf, canon_gelu and canon_gelu_grad in every lane, operation for operation (the
// constant 3 * 0.044715 folded as C folds it); test_kernels compares them over a sweep.
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

// dinp = gelu'(inp) * dout (may be in place: dinp == dout)
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
    size_t nvec = n / VLEN;
    #pragma omp parallel for
    for (size_t i = 0; i < nvec; i++) {
        vf_store(dinp + i * VLEN, vf_mul(vf_gelu_grad(vf_load(inp + i * VLEN)), vf_load(dout + i * VLEN)));
    }
    for (size_t i = nvec * VLEN; i < n; i++) { dinp[i] = canon_gelu_grad(inp[i]) * dout[i]; }
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
    return position_reduce_elem(x, 1, 0, NULL, 0, 0, B, T, CANON_R);
}

// the mixture-of-experts layer's kernels (llmc/moe.h), on the helpers above
#define LLMC_CPU_KERNELS
#include "llmc/moe.h"

#endif // LLMC_DEVICE_KERNELS

// ==========================================================================================
// The model
// ==========================================================================================
//
// Written once, on the kernels above: the CUDA build's deterministic mode (train_gpt2.cu)
// compiles this same section on its device kernels, which take the same arguments. So the
// model never touches tensor memory itself: it allocates and fills through the MemOps of
// memory.h (host here, device there), and its parameters come unit by unit from zero.h.
// Context parallelism's attention and gradient finishing (context_parallel.h) drive these
// kernels too, so the header comes here.
#include "llmc/context_parallel.h"

// Activations of one forward pass of a model chunk (its `layers` transformer layers, and
// the head on the chunk holding it), allocated for a capacity of (B, T) positions; a pass with fewer
// positions lays its tensors out with its own B, T inside the same memory.
// With tensor parallelism over tp ranks the per-head and per-neuron tensors hold this rank's
// part: qkv 3C/tp, atty C/tp, att NH/tp heads, fch 4C/tp, probs Vp/tp (the widths below).
// With context parallelism over cp ranks (cp_split = cp; else 1) every tensor holds this rank's
// zig-zag slice of each sequence, T/cp positions (zigzag.h; att (L,B,NH,T/cp,T): its queries
// against every key, or with --cp-mode a2a (L,B,NH/cp,T,T): every query of NH/cp heads, whose
// q|k|v (qkvh) it keeps too). The shapes below are per rank with T the slice's length.
// With sequence parallelism (seq_split = tp x cp_split; else cp_split) the residual stream, the
// layernorms' inputs and statistics hold T/tp positions of each (slice of a) sequence: encoded,
// residual2, residual3, the means and rstds; the layernorm outputs are stored all-gathered.
// A mixture-of-experts layer keeps its routing and its experts' activations in `moe` instead
// of fch and fch_gelu: the rows its local experts received vary from pass to pass, so those
// buffers grow to the largest seen.
//
// Each float tensor is named once, in the lists below, with its element count in
// activations_alloc's terms (L layers, BT this rank's positions, BTs the sequence-split ones,
// Tq the queries' positions per sequence, H, S and the like 1 or 0: the head's chunk, a split
// backward; a count of 0 leaves the tensor out).
#define ACTIVATION_TENSORS(X, owner)                                                                                   \
    X(owner, float, encoded, BTs * C)          /* (B,T,C)   the stage's input: embedding output, or received */        \
    X(owner, float, ln1, L * BT * C)           /* (L,B,T,C) */                                                         \
    X(owner, float, ln1_mean, L * BTs)         /* (L,B,T) */                                                           \
    X(owner, float, ln1_rstd, L * BTs)         /* (L,B,T) */                                                           \
    X(owner, float, qkv, L * BT * C3)          /* (L,B,T,3C) */                                                        \
    X(owner, float, atty, L * BT * Ca)         /* (L,B,T,C)  attention output, before the projection */                \
    X(owner, float, att, L * B * NHl * Tq * T) /* (L,B,NH,T,T) */                                                      \
    X(owner, float, qkvh, a2a * L * BT * C3)   /* (L,B,T*cp_split,3C/cp_split) --cp-mode a2a: head-split */            \
    X(owner, float, residual2, L * BTs * C)    /* (L,B,T,C)  residual stream after attention */                        \
    X(owner, float, ln2, L * BT * C)           /* (L,B,T,C) */                                                         \
    X(owner, float, ln2_mean, L * BTs)         /* (L,B,T) */                                                           \
    X(owner, float, ln2_rstd, L * BTs)         /* (L,B,T) */                                                           \
    X(owner, float, fch, dense * L * BT * C4)  /* (L,B,T,4C) */                                                        \
    X(owner, float, fch_gelu, gelus * BT * C4) /* (L,B,T,4C), or (B,T,4C) reused by every layer with -r 1 */           \
    X(owner, float, residual3, L * BTs * C)    /* (L,B,T,C)  residual stream after the MLP = layer output */           \
    X(owner, float, lnf, H * BT * C)           /* (B,T,C)    the head's chunk only (like the three below) */           \
    X(owner, float, lnf_mean, H * BTs)         /* (B,T) */                                                             \
    X(owner, float, lnf_rstd, H * BTs)         /* (B,T) */                                                             \
    X(owner, float, probs, H * BT * Vl)        /* (B,T,Vp)   logits, then probabilities, then dlogits */               \
    X(owner, float, losses, H * B * T)         /* (B,T*cp_split) every position's (CP gathers them) */                 \
    X(owner, float, proj, BT * C)              /* (B,T,C)    a projection's output before the residual add */          \
    X(owner, float, proj_s, sp * BTs * C)      /* (B,T/tp,C) ... after SP's reduce-scatter */                          \
    X(owner, float, ln_s, sp * BTs * C)        /* (B,T/tp,C) a layernorm's output before SP's all-gather */            \
    X(owner, float, ce, H * 4 * BT)            /* (4,B,T) cross-entropy's max, sum of exps, target logit, loss */
// A split backward (the zero-bubble schedules) runs the input-gradient half of a (microbatch,
// chunk) long before its weight-gradient half, which reads the gradient at the output of every
// weight. They are kept here from one half to the other (split_backward = 1; without, one set
// in ActivationGrads serves every layer). With SP the layernorm outputs' gradients are summed
// over the tp group and hold T/tp positions of each sequence.
#define KEPT_GRADIENTS(X, owner)                                                                                       \
    X(owner, float, dfcproj, S * L * BT * C)   /* (L,B,T,C)  d(the MLP projection's output), full T */                 \
    X(owner, float, dfch, S * L * BT * C4)     /* (L,B,T,4C) d(fc's output), before GELU */                            \
    X(owner, float, dln2, S * L * BTs * C)     /* (L,B,T,C)  d(ln2's output), summed over the tp group */              \
    X(owner, float, dattproj, S * L * BT * C)  /* (L,B,T,C)  d(the attention projection's output), full T */           \
    X(owner, float, dqkv, S * L * BT * C3)     /* (L,B,T,3C) */                                                        \
    X(owner, float, dln1, S * L * BTs * C)     /* (L,B,T,C)  d(ln1's output), summed over the tp group */              \
    X(owner, float, dlnf, S * H * BTs * C)     /* (B,T,C)    head chunk: d(lnf's output), summed over tp */            \
    X(owner, float, dencoded, S * emb * BT * C) /* (B,T,C)   embedding chunk: d(encoded), full T */

// A mixture-of-experts layer's routing (element type, name, count) and the buffers whose rows
// are what the rank's experts received (type, name, row width: 0 leaves it out).
#define MOE_ROUTING(X, owner)                                                                                          \
    X(owner, float, probs, BT * num_experts)   /* (B,T,E)    the router's logits, then probabilities */                \
    X(owner, float, gates, slots)              /* (B,T,k) */                                                           \
    X(owner, int, chosen, slots)               /* (B,T,k)    the chosen experts, ascending */                          \
    X(owner, int, slot_row, slots)             /* (B,T,k)    the dispatch row of each slot */                          \
    X(owner, int, row_pos, slots)              /* (B*T*k)    the position of each dispatch row */                      \
    X(owner, int, leaf, leaves)                /* the R3 leaves of each local expert's rows */                         \
    X(owner, float, ret, slots * C)            /* (B*T*k,C)  each slot's expert output, back at the source */
#define MOE_LAYER_ROWS(X, owner)                                                                                       \
    X(owner, float, xin, C)                    /* (rows,C)   the rows the local experts received, by expert */         \
    X(owner, float, fch, C4)                   /* (rows,4C/tp) */                                                      \
    X(owner, float, fch_gelu, recompute ? 0 : C4) /* (rows,4C/tp) (recomputed in backward with -r 1) */                \
    X(owner, int, perm, 1)                     /* (rows)     work row <- received row (expert parallelism) */          \
    X(owner, int, inv, 1)                      /* (rows)     received row <- work row */
#define DECLARE(owner, type, name, count) type* name;

typedef struct {
    MoeRoute route;     // the routing plan (host)
    MOE_ROUTING(DECLARE, _)
    MOE_LAYER_ROWS(DECLARE, _)
    size_t rows_cap;    // rows xin .. inv hold
    float aux;          // the load-balancing loss of the last pass
} MoeLayerActs;

typedef struct {
    int layers, cap_B, cap_T, recompute, seq_split, cp_split;
    int C3, Ca, NHl, C4, Vl;   // local widths: qkv, atty, heads, fch, vocabulary
    int* inputs;        // (B,T)     the pass's tokens
    int* inputs_full;   // (B,T*cp_split) every position's tokens (context parallelism: the
                        //           embedding's gradient runs on whole sequences)
    int* targets;       // (B,T)     ... and the next tokens (the loss): target_buf, or NULL: none
    int* target_buf;
    ACTIVATION_TENSORS(DECLARE, _)
    int split_backward;
    KEPT_GRADIENTS(DECLARE, _)
    MoeLayerActs* moe;  // (L)        mixture of experts: each layer's routing and experts
    size_t bytes;
} Activations;

// Gradients of activations during backward: one set, reused by every layer. dfcproj .. dln1
// are one layer's gradients at the output of its weights (Activations' kept set, for a
// backward that is not split). Counts in activation_grads_alloc's terms (BTC this rank's
// positions x C; emb, sp, moe 1 or 0).
#define ACTIVATION_GRADS(X, owner)                                                                                     \
    X(owner, float, dresidual, BTC)            /* (B,T,C)  d(residual stream); (B,T/tp,C) under SP */                  \
    X(owner, float, dwhole, cp_whole * BTC * cp) /* (B,T*cp_split,C) the embedding's, gathered along T */              \
    X(owner, float, ln_partials, per_seq * 2 * B * C) /* (2,B,C) layernorm weight/bias grads per sequence */           \
    X(owner, float, dbtc, sp * BTC)            /* (B,T,C)  a layernorm output's gradient before the tp sum */          \
    X(owner, float, datty, BTC / tp)           /* (B,T,C/tp) d(attention output) */                                    \
    X(owner, float, dfcproj, BTC)              /* (B,T,C)  also d(encoded) in the embeddings' backward */              \
    X(owner, float, dfch, dense * 4 * BTC / tp) /* (B,T,4C/tp) */                                                      \
    X(owner, float, dln2, BTC)                 /* (B,T,C) */                                                           \
    X(owner, float, dattproj, BTC)             /* (B,T,C) */                                                           \
    X(owner, float, dqkv, 3 * BTC / tp)        /* (B,T,3C/tp) */                                                       \
    X(owner, float, dln1, BTC)                 /* (B,T,C)  also d(lnf's output) in the head's backward */              \
    X(owner, float, dgate, moe * slots)        /* (B,T,k)  mixture of experts from here */                             \
    X(owner, float, dlogits, moe * B * T * num_experts) /* (B,T,E) */                                                  \
    X(owner, float, drouter, moe * BTC)        /* (B,T,C)  the router's input gradient */                              \
    X(owner, float, daux, moe * num_experts)   /* (E)      the load-balancing loss's gradient per position */          \
    X(owner, float, dslots, moe * slots * C)   /* (B,T*k,C) the slots' output, then input, gradients */
#define MOE_GRAD_ROWS(X, owner)                                                                                        \
    X(owner, float, dwork, C)                  /* (rows,C) at the experts: output, then input, gradients */            \
    X(owner, float, dwork2, C)                 /* (rows,C) ... in the other order (expert parallelism) */              \
    X(owner, float, dh, C4)                    /* (rows,4C/tp) */                                                      \
    X(owner, float, hgelu, C4)                 /* (rows,4C/tp) GELU recomputed (-r 1) */

typedef struct {
    int seq_split, cp_split;   // as in Activations
    ACTIVATION_GRADS(DECLARE, _)
    MOE_GRAD_ROWS(DECLARE, _)
    size_t rows_cap;
    size_t bytes;
} ActivationGrads;

// The model's own buffers for the experts' rows: the dispatch rows (slots, C), and those a
// rank's experts received (rows, width).
#define MOE_MODEL_ROWS(X, owner)                                                                                       \
    X(owner, float, xrecv, C)                  /* (rows,C)  the rows received (source-major); outputs back */          \
    X(owner, float, yout, C)                   /* (rows,C)  the local experts' outputs (expert-major) */               \
    X(owner, float, hgelu, C4)                 /* (rows,4C/tp) the experts' GELU output in a forward, -r 1 */

typedef struct {
    GPT2Config config;
    int first_layer, last_layer; // this model chunk's layers [first, last) (a pipeline stage's,
                                // or one of its virtual stages')
    int has_embedding, has_head; // the embeddings; the final layernorm + LM head
    CommGroup* tp;              // tensor-parallel group (tensor_parallel.h)
    int tp_size, v0, Vl;        // ... its size, and this rank's vocabulary rows [v0, v0 + Vl) of wte
    int seq_parallel;           // sequence parallelism in the passes that split sequences
    ContextParallel cp;         // context parallelism (context_parallel.h)
    int cp_size;
    float* seq_grads;           // (B, largest unit) each sequence's subtree of a unit's gradient (CP)
    float* sp_scratch;          // (B,T,C) reordering for sequence parallelism's collectives
    float* probs_all;           // (Vp) one position's probabilities, all-gathered (sampling)
    Zero* zero;                 // parameters, gradients and AdamW state, possibly sharded (zero.h)
    const MemOps* mem;          // the memory of every tensor (zero.h's)
    // mixture of experts (config.num_experts > 0; llmc/moe.h, llmc/expert_parallel.h)
    int num_experts, top_k, ep_size, El; // experts, chosen per position, ep group size, experts held
    CommGroup* ep;              // the expert-parallel group (zero.h's)
    float* xsend;               // (B*T*k,C) the dispatch rows
    MOE_MODEL_ROWS(DECLARE, _)
    float* psum;                // (E)       the router's probability sums (the aux loss)
    float* psum_host;           // (E)       ... on the host
    float* daux_host;           // (E)       the aux loss's gradient per position, on the host
    size_t rows_cap, xsend_cap;
    MoeCounters counters;       // routing since the engine's last reset
} GPT2;

// The tied token embedding gets two gradients: from the LM head (wte as the output matmul)
// and from the embedding lookup. They are kept apart (the lookup half is zero.h's unit
// zero_lookup_unit(z)) until the whole step's gradient is reduced, then added (lm part + lookup part),
// because that is the order a pipeline can reproduce: there the LM head lives on the last
// stage and the embedding on the first (Megatron sums the two copies' gradients after the
// data-parallel reduction). zero_finish_grads() does the addition.

// Each list's tensors allocated (count elements each; 0: none), released, or (the expert row
// buffers, count their row width) grown to `rows`; `total` adds up the bytes.
static void* act_alloc(const GPT2* model, size_t n, size_t elem_bytes, size_t* total) {
    *total += n * elem_bytes;
    return n ? model->mem->alloc(n * elem_bytes, "activations") : NULL;
}
static void grow_rows(const GPT2* model, void** buf, size_t rows, size_t row_bytes) {
    model->mem->release(*buf);
    *buf = model->mem->alloc((rows ? rows : 1) * row_bytes, "expert activations");
}
#define ALLOC(owner, type, name, count) owner->name = (type*)act_alloc(model, count, sizeof(type), total);
#define RELEASE(owner, type, name, count) model->mem->release(owner->name);
#define GROW(owner, type, name, width) \
    if ((width) > 0) { grow_rows(model, (void**)&owner->name, rows, (size_t)(width) * sizeof(type)); }

static void moe_acts_rows(const GPT2* model, const Activations* a, MoeLayerActs* moe_act, size_t rows) {
    if (rows <= moe_act->rows_cap && moe_act->rows_cap > 0) { return; }
    size_t C = model->config.channels;
    int C4 = a->C4, recompute = a->recompute;
    MOE_LAYER_ROWS(GROW, moe_act)
    moe_act->rows_cap = rows;
}
static void moe_model_rows(GPT2* model, size_t rows, size_t slots, int C4) {
    size_t C = model->config.channels;
    if (slots > model->xsend_cap) {
        grow_rows(model, (void**)&model->xsend, slots, C * sizeof(float));
        model->xsend_cap = slots;
    }
    if (rows <= model->rows_cap && model->rows_cap > 0) { return; }
    MOE_MODEL_ROWS(GROW, model)
    model->rows_cap = rows;
}
static void moe_grads_rows(const GPT2* model, ActivationGrads* g, size_t rows, int C4) {
    if (rows <= g->rows_cap && g->rows_cap > 0) { return; }
    size_t C = model->config.channels;
    MOE_GRAD_ROWS(GROW, g)
    g->rows_cap = rows;
}

// split_seqs: the sequences are split as the model's layout says (context parallelism over
// its cp group, and with seq_parallel the residual stream over the tensor-parallel group:
// Megatron's sequence parallelism); 0: every position on every rank (the sampler's passes).
// split_backward: room for a split backward's kept gradients.
void activations_alloc(Activations* a, const GPT2* model, int B, int T, int recompute, int split_seqs,
                       int split_backward) {
    const GPT2Config* c = &model->config;
    int tp = model->tp_size, cp = split_seqs ? model->cp_size : 1, sp = split_seqs && model->seq_parallel;
    size_t L = model->last_layer - model->first_layer, C = c->channels, BT = (size_t)B * T / cp;
    size_t BTs = BT / (sp ? tp : 1);   // positions of the sequence-split tensors
    size_t H = model->has_head ? 1 : 0, S = split_backward ? 1 : 0, emb = model->has_embedding ? 1 : 0;
    size_t dense = model->num_experts > 0 ? 0 : 1, a2a = cp > 1 && model->cp.a2a, Tq = T / cp;
    size_t gelus = dense * (recompute ? 1 : L);   // fch_gelu: one layer's, reused by all, with recompute
    memset(a, 0, sizeof(*a));
    a->layers = (int)L;
    a->cap_B = B;
    a->cap_T = T;
    a->recompute = recompute;
    a->cp_split = cp;
    a->seq_split = (sp ? tp : 1) * cp;
    size_t C3 = a->C3 = 3 * c->channels / tp, Ca = a->Ca = c->channels / tp, NHl = a->NHl = c->num_heads / tp;
    size_t C4 = a->C4 = 4 * c->channels / tp, Vl = a->Vl = c->padded_vocab_size / tp;
    a->inputs = (int*)model->mem->alloc(BT * sizeof(int), "tokens");
    a->target_buf = (int*)model->mem->alloc(BT * sizeof(int), "tokens");
    a->inputs_full = cp > 1 ? (int*)model->mem->alloc((size_t)B * T * sizeof(int), "tokens") : a->inputs;
    a->bytes = (2 * BT + (cp > 1 ? (size_t)B * T : 0)) * sizeof(int);
    size_t* total = &a->bytes;
    ACTIVATION_TENSORS(ALLOC, a)
    a->split_backward = split_backward;
    KEPT_GRADIENTS(ALLOC, a)
    if (model->num_experts > 0) {   // the routing of every layer; the experts' rows start at the balanced load
        int num_experts = model->num_experts, ep_size = model->ep_size;
        size_t slots = BT * model->top_k, rows = slots;
        size_t leaves = (size_t)model->El * ((size_t)ep_size * B * CANON_R + 1);
        a->moe = (MoeLayerActs*)calloc_or_die(L ? L : 1, sizeof(MoeLayerActs), "expert activations");
        for (size_t l = 0; l < L; l++) {
            MoeLayerActs* moe_act = &a->moe[l];
            moe_route_init(&moe_act->route, (int)BT, model->top_k, num_experts, ep_size, B);
            MOE_ROUTING(ALLOC, moe_act)
            moe_acts_rows(model, a, moe_act, rows);
            a->bytes += rows * (C + (recompute ? 1 : 2) * C4) * sizeof(float) + 2 * rows * sizeof(int);
        }
    }
}

void activations_free(const GPT2* model, Activations* a) {
    model->mem->release(a->inputs);
    model->mem->release(a->target_buf);
    if (a->inputs_full != a->inputs) { model->mem->release(a->inputs_full); }
    ACTIVATION_TENSORS(RELEASE, a)
    KEPT_GRADIENTS(RELEASE, a)
    for (int l = 0; a->moe && l < a->layers; l++) {
        MoeLayerActs* moe_act = &a->moe[l];
        MOE_ROUTING(RELEASE, moe_act)
        MOE_LAYER_ROWS(RELEASE, moe_act)
        moe_route_free(&moe_act->route);
    }
    free(a->moe);
    memset(a, 0, sizeof(*a));
}

// The pass's tokens (B sequences of T), from host memory; targets NULL: the pass computes no
// loss. With context parallelism the rank keeps its slice of each sequence (and all of the
// inputs, for the embedding's gradient).
void activations_set_tokens(const GPT2* model, Activations* a, const int* inputs, const int* targets,
                            int B, int T) {
    int cp = a->cp_split, Tl = T / cp;
    size_t bytes = (size_t)B * Tl * sizeof(int);
    a->targets = targets ? a->target_buf : NULL;
    if (cp == 1) {
        model->mem->from_host(a->inputs, inputs, bytes);
        if (targets) { model->mem->from_host(a->target_buf, targets, bytes); }
        return;
    }
    model->mem->from_host(a->inputs_full, inputs, (size_t)B * T * sizeof(int));
    int* slice = (int*)malloc_or_die(2 * bytes, "token slices");
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < Tl; t++) {
            long pos = (long)b * T + canon_zz_global(t, T, cp, model->cp.rank);
            slice[b * Tl + t] = inputs[pos];
            slice[(size_t)B * Tl + b * Tl + t] = targets ? targets[pos] : 0;
        }
    }
    model->mem->from_host(a->inputs, slice, bytes);
    if (targets) { model->mem->from_host(a->target_buf, slice + (size_t)B * Tl, bytes); }
    free(slice);
}

// split_seqs: as activations_alloc's
void activation_grads_alloc(ActivationGrads* g, const GPT2* model, int B, int T, int split_seqs) {
    int tp = model->tp_size, cp = split_seqs ? model->cp_size : 1, sp = split_seqs && model->seq_parallel;
    size_t C = model->config.channels, BTC = (size_t)B * T / cp * C, num_experts = model->num_experts;
    size_t moe = num_experts > 0, dense = !moe, slots = (size_t)B * T * model->top_k;
    size_t cp_whole = cp > 1 && model->has_embedding, per_seq = sp || cp > 1;
    memset(g, 0, sizeof(*g));
    g->cp_split = cp;
    g->seq_split = (sp ? tp : 1) * cp;
    size_t* total = &g->bytes;
    ACTIVATION_GRADS(ALLOC, g)
    if (moe) {
        moe_grads_rows(model, g, slots, (int)(4 * C / tp));
        g->bytes += slots * (2 * C + 8 * C / tp) * sizeof(float);
    }
}

void activation_grads_free(const GPT2* model, ActivationGrads* g) {
    ACTIVATION_GRADS(RELEASE, g)
    MOE_GRAD_ROWS(RELEASE, g)
}

// Per-layer views of the activations for a pass over (B, T) (this rank's share of them) at
// row t0 of every per-position tensor (att: the whole of it, attention picks its rows); l
// counts the chunk's layers.
typedef struct {
    float *residual, *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *qkvh, *residual2;
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu, *residual3;
} LayerActs;

static LayerActs layer_acts(const Activations* a, const GPT2Config* c, int l, int B, int T, int t0) {
    size_t C = c->channels, BT = (size_t)B * T / a->cp_split, BTs = (size_t)B * T / a->seq_split, r0 = t0;
    LayerActs v;
    v.residual = (l == 0 ? a->encoded : a->residual3 + (l - 1) * BTs * C) + r0 * C;
    v.ln1 = a->ln1 + (l * BT + r0) * C;
    v.ln1_mean = a->ln1_mean + l * BTs + r0;
    v.ln1_rstd = a->ln1_rstd + l * BTs + r0;
    v.qkv = a->qkv + (l * BT + r0) * a->C3;
    v.atty = a->atty + (l * BT + r0) * a->Ca;
    v.att = a->att + l * (size_t)B * a->NHl * (T / a->cp_split) * T;
    v.qkvh = a->qkvh ? a->qkvh + l * BT * a->C3 : NULL;
    v.residual2 = a->residual2 + (l * BTs + r0) * C;
    v.ln2 = a->ln2 + (l * BT + r0) * C;
    v.ln2_mean = a->ln2_mean + l * BTs + r0;
    v.ln2_rstd = a->ln2_rstd + l * BTs + r0;
    v.fch = a->fch ? a->fch + (l * BT + r0) * a->C4 : NULL;   // NULL: a mixture-of-experts layer's are in a->moe
    v.fch_gelu = a->fch_gelu ? a->fch_gelu + ((a->recompute ? 0 : l * BT) + r0) * a->C4 : NULL;
    v.residual3 = a->residual3 + (l * BTs + r0) * C;
    return v;
}

// Where layer l's backward keeps the gradients at the outputs of its weights, from its input
// half to its weight half: the kept set of a (a split backward), or g's one set.
typedef struct { float *dfcproj, *dfch, *dln2, *dattproj, *dqkv, *dln1; } LayerOutGrads;

static LayerOutGrads layer_out_grads(const Activations* a, const ActivationGrads* g, const GPT2Config* c, int l,
                                     int B, int T) {
    if (!a->split_backward) { return (LayerOutGrads){g->dfcproj, g->dfch, g->dln2, g->dattproj, g->dqkv, g->dln1}; }
    size_t C = c->channels, BT = (size_t)B * T / a->cp_split, BTs = (size_t)B * T / a->seq_split;
    LayerOutGrads d = {a->dfcproj + l * BT * C, a->dfch + l * BT * a->C4, a->dln2 + l * BTs * C,
                       a->dattproj + l * BT * C, a->dqkv + l * BT * a->C3, a->dln1 + l * BTs * C};
    return d;
}

// The output of the stage's layers (B,T,C), or its sequence slice: what the next stage, or
// the head, receives.
static float* stage_output(const Activations* a, const GPT2Config* c, int B, int T) {
    size_t BTs = (size_t)B * T / a->seq_split;
    return a->layers > 0 ? a->residual3 + (size_t)(a->layers - 1) * BTs * c->channels : a->encoded;
}

// Views of layer unit u's tensors (this rank's tensor-parallel parts, zero.h's unit layout)
// in a buffer starting at `base`.
static LayerTensors layer_unit(const Zero* z, int u, const float* base) {
    float* f = (float*)base;
    const TPPiece* p = z->lay.pieces[u];   // ln1w ln1b qkvw qkvb attprojw attprojb ln2w ... fcprojb
    if (z->lay.npieces[u] == NUM_LAYER_TENSORS) {
        LayerTensors v = {f + p[0].local, f + p[1].local, f + p[2].local, f + p[3].local, f + p[4].local,
                          f + p[5].local, f + p[6].local, f + p[7].local, f + p[8].local, f + p[9].local,
                          f + p[10].local, f + p[11].local, NULL};
        return v;
    }
    // a mixture-of-experts layer: ln1w .. ln2b, routerw (the experts are their own unit)
    LayerTensors v = {f + p[0].local, f + p[1].local, f + p[2].local, f + p[3].local, f + p[4].local,
                      f + p[5].local, f + p[6].local, f + p[7].local, NULL, NULL, NULL, NULL, f + p[8].local};
    return v;
}

// Views of expert unit u's tensors (this rank's experts, tensor-major): local expert e's fcw
// is fcw + e * fcw_n, and so on.
typedef struct {
    float *fcw, *fcb, *fcprojw, *fcprojb;
    size_t fcw_n, fcb_n, fcprojw_n, fcprojb_n;
} ExpertTensors;

static ExpertTensors expert_unit(const Zero* z, int u, const float* base) {
    float* f = (float*)base;
    const TPPiece* p = z->lay.pieces[u];
    int El = z->lay.npieces[u] / 4;
    ExpertTensors v = {f + p[0].local, f + p[El].local, f + p[2 * El].local, f + p[3 * El].local,
                       tp_piece_elements(&p[0]), tp_piece_elements(&p[El]), tp_piece_elements(&p[2 * El]),
                       tp_piece_elements(&p[3 * El])};
    return v;
}

// The forward and backward come in three parts, run by the stages that hold them: the
// embeddings (the first chunk), the transformer layers of a chunk, and the head (final
// layernorm, LM head, cross-entropy; the last chunk). Parameters come unit by unit from zero.h (ZeRO-3
// gathers each unit just before use, prefetching the next, and frees it after).
//
// Sequence parallelism's f and g (tensor_parallel.h) apply to passes whose residual stream is
// split along T over the tensor-parallel group (seq_split > cp_split); they are the identity /
// all-reduce of tp_f_* and tp_g_* without it. With context parallelism (cp_split > 1) a pass
// holds this rank's slice of each sequence, Tl = T/cp_split positions (T: the whole sequence,
// as the engine passes it): everything is per position except attention (context_parallel.h's
// ring or all-to-all) and the reductions over positions, whose per-sequence subtrees the group
// finishes (cp_finish_sequences), or which run on whole sequences gathered along T (the
// embedding's gradient, the loss).
//
// A forward computes the rows [t0, t1) of each of its B sequences of T positions: a whole pass
// 0, T; the sampler's KV-cache step one new position t, t + 1, of a pass of one sequence
// (B = 1, never split over ranks) whose rows before t the earlier steps computed. Every
// reduction over positions is laid out by T (R2Z chunks of T), so such a row equals that row
// of the whole pass, bit for bit, whatever the rows after it hold (test_gpt2 checks). Of the
// rows, this rank computes pass_rows(.., cp_split) of the per-position tensors and
// pass_rows(.., seq_split) of the sequence-split ones, from row t0 of each.
static size_t pass_rows(int B, int t0, int t1, int ranks) { return (size_t)B * (t1 - t0) / ranks; }

// out (B,T/D,C) += wpe at the global positions of rank r's D-way zig-zag slice (zigzag.h):
// its two stretches per sequence
static void add_zigzag_positions(float* out, const float* wpe, int B, int T, int C, int D, int r) {
    int Tl = T / D, stretch = Tl / 2;
    for (int b = 0; b < B; b++) {
        for (int half = 0; half < 2; half++) {
            const float* pe = wpe + zz_stretch_begin(T, D, r, half) * C;
            encoder_add_positions(out + ((size_t)b * Tl + half * stretch) * C, pe, 1, stretch, C);
        }
    }
}

// (the chunk with the embeddings) encoded (B,T,C) = wte[inputs] + wpe (with SP and CP: this
// rank's positions)
void embed_forward(GPT2* model, Activations* a, int B, int T, int t0, int t1) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    int C = c->channels, sp = a->seq_split > a->cp_split;
    size_t r0 = (size_t)t0, rows = pass_rows(B, t0, t1, a->cp_split);
    const float* wte = zero_params_acquire(z, ZERO_WTE, ZERO_WPE);
    float* lookup = sp ? a->proj : a->encoded + r0 * C;
    encoder_lookup(lookup, a->inputs + r0, wte, model->v0, model->Vl, (int)rows, C);
    zero_params_release(z, ZERO_WTE);
    // the vocab-parallel lookup summed over the tp group (each row came from the rank holding
    // its token): all-reduce, or with SP reduce-scatter along T
    if (sp) {
        tp_sp_reduce_scatter(model->tp, lookup, a->encoded, B, T / a->cp_split, C, model->sp_scratch);
    } else {
        tp_vocab_embedding_reduce(model->tp, lookup, rows * C);
    }
    const float* wpe = zero_params_acquire(z, ZERO_WPE, ZERO_LAYER(model->first_layer));
    if (a->seq_split == 1) {
        encoder_add_positions(a->encoded + r0 * C, wpe + r0 * C, B, t1 - t0, C);
    } else {   // this rank's positions: the slice of its context-parallel rank, and of that its
               // tensor-parallel rank's with SP (a slice of a slice is a slice, zigzag.h)
        int r = (a->cp_split > 1 ? model->cp.rank : 0) * (sp ? model->tp_size : 1) + (sp ? model->tp->rank : 0);
        add_zigzag_positions(a->encoded, wpe, B, T, C, a->seq_split, r);
    }
    zero_params_release(z, ZERO_WPE);
}

// A layernorm before a column-parallel layer over B sequences of Tn rows: ln (B,Tn,C) =
// LN(inp); with SP, inp holds this rank's positions and the output is all-gathered along T
// (Megatron's f).
static void ln_forward_f(GPT2* model, Activations* a, float* ln, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, int B, int Tn) {
    int C = model->config.channels, Tl = Tn / a->cp_split;
    if (a->seq_split > a->cp_split) {
        layernorm_forward(a->ln_s, mean, rstd, inp, weight, bias, B * Tn / a->seq_split, C);
        tp_sp_all_gather(model->tp, a->ln_s, ln, B, Tl, C, model->sp_scratch);
    } else {
        layernorm_forward(ln, mean, rstd, inp, weight, bias, B * Tl, C);
        tp_f_forward(model->tp, ln, (size_t)B * Tl * C);
    }
}

// After a row-parallel layer: the partial outputs a->proj (B,Tn,C) summed over the tp group
// (Megatron's g: all-reduce, or with SP reduce-scatter along T), then its bias; returns the
// result (with SP, this rank's positions).
static float* proj_g_bias(GPT2* model, Activations* a, const float* bias, int B, int Tn) {
    int C = model->config.channels, Tl = Tn / a->cp_split;
    float* out = a->proj;
    if (a->seq_split > a->cp_split) {
        tp_sp_reduce_scatter(model->tp, a->proj, a->proj_s, B, Tl, C, model->sp_scratch);
        out = a->proj_s;
    } else {
        tp_g_forward(model->tp, a->proj, (size_t)B * Tl * C);
    }
    bias_forward(out, bias, B * Tn / a->seq_split, C);
    return out;
}

// A mixture-of-experts layer (llmc/moe.h THE LAYER) in place of layer l's MLP: out (B,T,C)
// from ln (B,T,C), complete on every tensor-parallel rank. The router and the combine run here
// on this rank's positions; the slots go to their experts' ranks and back (expert_parallel.h;
// one rank: the dispatch rows are already the experts' rows). `next`: the unit ZeRO-3
// prefetches after the experts.
static void moe_forward(GPT2* model, Activations* a, int l, const LayerTensors* w, const float* ln, float* out,
                        int next, int B, int T) {
    const GPT2Config* c = &model->config;
    const MemOps* mem = model->mem;
    Zero* z = model->zero;
    MoeLayerActs* moe_act = &a->moe[l - model->first_layer];
    MoeRoute* route = &moe_act->route;
    int C = c->channels, C4 = a->C4, num_experts = model->num_experts, top_k = model->top_k;
    int ep_size = model->ep_size, BT = B * T;
    size_t slots = (size_t)BT * top_k;
    // the router: probabilities, the top_k chosen experts and their gates per position
    matmul_forward(moe_act->probs, ln, w->routerw, NULL, BT, C, num_experts, CANON_R);
    moe_router_forward(moe_act->probs, moe_act->chosen, moe_act->gates, moe_act->probs, BT, num_experts, top_k);
    mem->to_host(route->chosen, moe_act->chosen, slots * sizeof(int));
    moe_route_plan(route, model->ep, B, T);   // the counts and positions each expert receives
    moe_acts_rows(model, a, moe_act, (size_t)route->n_recv);
    moe_model_rows(model, (size_t)route->n_recv, slots, C4);
    mem->from_host(moe_act->slot_row, route->slot_row, slots * sizeof(int));
    mem->from_host(moe_act->row_pos, route->row_pos, slots * sizeof(int));
    mem->from_host(moe_act->perm, route->perm, (size_t)route->n_recv * sizeof(int));
    mem->from_host(moe_act->inv, route->inv, (size_t)route->n_recv * sizeof(int));
    size_t nleaf = (size_t)ep_size * B * CANON_R + 1;
    mem->from_host(moe_act->leaf, route->leaf, (size_t)model->El * nleaf * sizeof(int));
    // the tokens to their experts (expert-major rows)
    if (ep_size == 1) {
        moe_gather_rows(moe_act->xin, ln, moe_act->row_pos, (int)slots, C);
    } else {
        moe_gather_rows(model->xsend, ln, moe_act->row_pos, (int)slots, C);
        moe_route_dispatch(route, model->ep, model->xsend, model->xrecv, C);
        moe_gather_rows(moe_act->xin, model->xrecv, moe_act->perm, route->n_recv, C);
    }
    // the local experts, each one matmul over the rows it received (the grouped matmul)
    int unit = zero_expert_unit(z, l);
    ExpertTensors ex = expert_unit(z, unit, zero_params_acquire(z, unit, next));
    float* gelu_out = a->recompute ? model->hgelu : moe_act->fch_gelu;
    float* y = ep_size == 1 ? moe_act->ret : model->yout;
    for (int e = 0; e < model->El; e++) {
        int r0 = route->first[e], n = route->first[e + 1] - r0;
        if (n == 0) { continue; }
        matmul_forward(moe_act->fch + (size_t)r0 * C4, moe_act->xin + (size_t)r0 * C, ex.fcw + e * ex.fcw_n,
                       ex.fcb + e * ex.fcb_n, n, C, C4, CANON_R);
        gelu_forward(gelu_out + (size_t)r0 * C4, moe_act->fch + (size_t)r0 * C4, (size_t)n * C4);
        matmul_forward(y + (size_t)r0 * C, gelu_out + (size_t)r0 * C4, ex.fcprojw + e * ex.fcprojw_n, NULL, n, C4, C,
                       CANON_R / model->tp_size);
    }
    // g (tp group): each expert's row-parallel partial outputs y (rows, C), all-reduced per
    // row, then its bias
    tp_g_forward(model->tp, y, (size_t)route->n_recv * C);
    for (int e = 0; e < model->El; e++) {
        int r0 = route->first[e], n = route->first[e + 1] - r0;
        if (n > 0) { bias_forward(y + (size_t)r0 * C, ex.fcprojb + e * ex.fcprojb_n, n, C); }
    }
    zero_params_release(z, unit);
    if (ep_size > 1) {   // the outputs back to their sources, in dispatch-row order
        moe_gather_rows(model->xrecv, model->yout, moe_act->inv, route->n_recv, C);
        moe_route_return(route, model->ep, model->xrecv, moe_act->ret, C);
    }
    moe_combine(out, moe_act->ret, moe_act->gates, moe_act->slot_row, BT, top_k, C);
    // the load-balancing loss of this layer and microbatch
    moe_expert_prob_sums(model->psum, moe_act->probs, B, T, num_experts);
    mem->to_host(model->psum_host, model->psum, (size_t)num_experts * sizeof(float));
    moe_act->aux = moe_aux_loss(route->count, model->psum_host, num_experts, top_k, BT, c->aux_loss_coef);
    MoeCounters* counters = &model->counters;
    for (int e = 0; e < num_experts; e++) {
        counters->tokens[(size_t)(l - model->first_layer) * num_experts + e] += route->count[e];
    }
    long long out_rows, in_rows;
    moe_route_remote_rows(route, model->ep->rank, &out_rows, &in_rows);
    counters->passes++;
    counters->rows_out += out_rows;
    counters->rows_in += in_rows;
}

// Attention of this rank's heads (and with CP its queries) for the rows [t0, t1) of layer l
// (chunk-relative): qkv -> atty, att. A whole pass runs the fast kernels; rows of a KV-cache
// step, each against the keys and values of the rows before it, the per-row kernel.
static void attention_forward_rows(GPT2* model, Activations* a, int l, int B, int T, int t0, int t1) {
    LayerActs act = layer_acts(a, &model->config, l, B, T, 0);
    if (t1 - t0 < T) {
        for (int t = t0; t < t1; t++) { attention_forward_row(act.atty, act.att, act.qkv, t, T, a->Ca, a->NHl); }
    } else if (a->cp_split == 1) {
        attention_forward(act.atty, act.att, act.qkv, B, T, a->Ca, a->NHl);
    } else if (model->cp.a2a) {
        cp_a2a_forward(&model->cp, act.atty, act.att, act.qkvh, act.qkv, B, T, a->Ca, a->NHl);
    } else {
        cp_ring_forward(&model->cp, act.atty, act.att, act.qkv, B, T, a->Ca, a->NHl);
    }
}

// this chunk's layers on the rows [t0, t1): a->encoded (B,T,C) -> stage_output. Megatron's
// partitioning: qkv and fc are column-parallel (f before them), attproj and fcproj
// row-parallel (g after them, then the bias); attention runs on this rank's heads.
void layers_forward(GPT2* model, Activations* a, int B, int T, int t0, int t1) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    int C = c->channels, Tn = t1 - t0, tp_size = model->tp_size, moe = model->num_experts > 0;
    int rows = (int)pass_rows(B, t0, t1, a->cp_split);
    size_t rows_s = pass_rows(B, t0, t1, a->seq_split);
    for (int l = model->first_layer; l < model->last_layer; l++) {
        int next = l + 1 < model->last_layer ? ZERO_LAYER(l + 1) : model->has_head ? z->lay.num_units - 1 : -1;
        LayerTensors w = layer_unit(z, ZERO_LAYER(l), zero_params_acquire(z, ZERO_LAYER(l), moe ? zero_expert_unit(z, l) : next));
        LayerActs act = layer_acts(a, c, l - model->first_layer, B, T, t0);
        ln_forward_f(model, a, act.ln1, act.ln1_mean, act.ln1_rstd, act.residual, w.ln1w, w.ln1b, B, Tn);
        matmul_forward(act.qkv, act.ln1, w.qkvw, w.qkvb, rows, C, a->C3, CANON_R);
        attention_forward_rows(model, a, l - model->first_layer, B, T, t0, t1);
        matmul_forward(a->proj, act.atty, w.attprojw, NULL, rows, a->Ca, C, CANON_R / tp_size);
        residual_forward(act.residual2, act.residual, proj_g_bias(model, a, w.attprojb, B, Tn), rows_s * C);
        ln_forward_f(model, a, act.ln2, act.ln2_mean, act.ln2_rstd, act.residual2, w.ln2w, w.ln2b, B, Tn);
        if (moe) {   // complete on every tp rank: with SP this rank keeps its positions (no CP)
            moe_forward(model, a, l, &w, act.ln2, a->proj, next, B, Tn);
            if (a->seq_split > 1) { tp_sp_take_slice(model->tp, a->proj, a->proj_s, B, Tn, C); }
            residual_forward(act.residual3, act.residual2, a->seq_split > 1 ? a->proj_s : a->proj, rows_s * C);
        } else {
            matmul_forward(act.fch, act.ln2, w.fcw, w.fcb, rows, C, a->C4, CANON_R);
            gelu_forward(act.fch_gelu, act.fch, (size_t)rows * a->C4);
            matmul_forward(a->proj, act.fch_gelu, w.fcprojw, NULL, rows, a->C4, C, CANON_R / tp_size);
            residual_forward(act.residual3, act.residual2, proj_g_bias(model, a, w.fcprojb, B, Tn), rows_s * C);
        }
        zero_params_release(z, ZERO_LAYER(l));
    }
}

// (the chunk with the head) stage_output -> probs (B,T,Vl) of this rank's vocabulary rows, and
// per-position losses (B,T) when the pass has targets, on the rows [t0, t1). The LM head is
// column-parallel over the vocabulary; the cross-entropy's three reductions are finished over
// the tp group. With `training`, the units the backward starts with (wte, the final
// layernorm) stay held for it. With CP the losses of every position are all-gathered (the
// loss is summed over whole sequences).
void head_forward(GPT2* model, Activations* a, int B, int T, int t0, int t1, int training) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    int C = c->channels, V = c->vocab_size, Vl = model->Vl, v0 = model->v0, LNF = z->lay.num_units - 1;
    size_t r0 = (size_t)t0;
    int rows = (int)pass_rows(B, t0, t1, a->cp_split);
    const float* lnf = zero_params_acquire(z, LNF, ZERO_WTE);
    ln_forward_f(model, a, a->lnf + r0 * C, a->lnf_mean + r0, a->lnf_rstd + r0, stage_output(a, c, B, T) + r0 * C,
                 lnf, lnf + C, B, t1 - t0);
    const float* wte = zero_params_acquire(z, ZERO_WTE, -1);
    float* logits = a->probs + r0 * Vl;
    matmul_forward(logits, a->lnf + r0 * C, wte, NULL, rows, C, Vl, CANON_R);
    float *maxes = a->ce, *zs = a->ce + rows, *target_logits = a->ce + 2 * rows;
    const int* targets = a->targets ? a->targets + r0 : NULL;
    crossentropy_max(maxes, logits, rows, V, v0, Vl);
    tp_vocab_ce_max(model->tp, maxes, (size_t)rows);
    crossentropy_exps(zs, target_logits, logits, maxes, targets, rows, V, v0, Vl, CANON_R / model->tp_size);
    tp_vocab_ce_sums(model->tp, zs, (size_t)rows);   // zs, then target_logits
    float* losses = a->cp_split > 1 ? a->ce + 3 * rows : a->losses + r0;
    crossentropy_normalize(logits, losses, zs, target_logits, maxes, targets, rows, V, v0, Vl);
    // all-gather (cp group): every position's loss, in sequence order
    if (a->cp_split > 1 && targets) { cp_gather_sequences(&model->cp, losses, a->losses, B, T, 1); }
    if (!training) {
        zero_params_release(z, ZERO_WTE);
        zero_params_release(z, LNF);
    }
}

// ---- generation with a KV cache ----------------------------------------------------------
// The sampler lays one sequence out over T positions (T: the sampler's length, the same for a
// whole generation) exactly as a forward pass over (1, T) does, and computes one new position
// t at a time: the forward on the rows [t, t + 1), attention's row t against the keys and
// values of rows 0..t that the earlier steps left in qkv (the cache). Tensor parallelism's f
// and g act on the one row.
void embed_decode(GPT2* model, Activations* a, int token, int t, int T) {
    model->mem->from_host(a->inputs + t, &token, sizeof(int));
    embed_forward(model, a, 1, T, t, t + 1);
}
void layers_decode(GPT2* model, Activations* a, int t, int T) { layers_forward(model, a, 1, T, t, t + 1); }
void head_decode(GPT2* model, Activations* a, int t, int T) { head_forward(model, a, 1, T, t, t + 1, 0); }


// Backward of a layernorm that feeds a column-parallel layer, in two halves. Input half: the
// gradient of its full output dln (B,T,C) as this rank computed it (its slice of the layer's
// outputs) is summed over the tp group into dln_sum (Megatron's f backward: all-reduce, in
// place when dln_sum == dln; with SP a reduce-scatter along T), then dres += the layernorm's
// input gradient. complete: dln is already the whole sum on every rank (a mixture-of-experts
// layer's): no sum, with SP this rank's slice.
static void ln_backward_f_input(GPT2* model, ActivationGrads* g, float* dres, float* dln, float* dln_sum,
                                const float* inp, const float* weight, const float* mean, const float* rstd,
                                int B, int T, int complete) {
    int C = model->config.channels, Tl = T / g->cp_split;
    if (g->seq_split > g->cp_split) {
        if (complete) {
            tp_sp_take_slice(model->tp, dln, dln_sum, B, Tl, C);
        } else {
            tp_sp_reduce_scatter(model->tp, dln, dln_sum, B, Tl, C, model->sp_scratch);
        }
        layernorm_backward(dres, NULL, NULL, dln_sum, inp, weight, mean, rstd, B, T / g->seq_split, C,
                           CANON_R / g->seq_split, NULL);
    } else {
        if (!complete) { tp_f_backward(model->tp, dln, (size_t)B * Tl * C); }
        layernorm_backward(dres, NULL, NULL, dln, inp, weight, mean, rstd, B, Tl, C, CANON_R / g->cp_split, NULL);
    }
}

// Weight half: its weight and bias gradients from dln_sum. With SP or CP those are sums over
// positions held by several ranks: each rank's per-sequence subtrees (over its chunks of T),
// with SP all-reduced over the tp group (the R1 tree), then either finished by the R1 tree
// over sequences or, with CP, put at dweight + b*seq_stride, dbias + b*seq_stride for the
// caller to finish over the cp group (the outer level of the positions' ranks).
static void ln_backward_f_weight(GPT2* model, ActivationGrads* g, float* dweight, float* dbias, long seq_stride,
                                 const float* dln_sum, const float* inp, const float* mean, const float* rstd,
                                 int B, int T) {
    int C = model->config.channels;
    if (g->seq_split == 1) {
        layernorm_backward(NULL, dweight, dbias, dln_sum, inp, NULL, mean, rstd, B, T, C, CANON_R, NULL);
        return;
    }
    layernorm_backward(NULL, NULL, NULL, dln_sum, inp, NULL, mean, rstd, B, T / g->seq_split, C,
                       CANON_R / g->seq_split, g->ln_partials);
    // all-reduce (tp group): every rank's per-sequence subtrees of the two sums (2,B,C)
    if (g->seq_split > g->cp_split) { sp_layernorm_grads_reduce(model->tp, g->ln_partials, B, C); }
    if (g->cp_split > 1) {
        for (int b = 0; b < B; b++) {
            model->mem->copy(dweight + b * seq_stride, g->ln_partials + (size_t)b * C, sizeof(float) * C);
            model->mem->copy(dbias + b * seq_stride, g->ln_partials + (size_t)(B + b) * C, sizeof(float) * C);
        }
    } else {
        sequence_tree(dweight, g->ln_partials, B, C);
        sequence_tree(dbias, g->ln_partials + (size_t)B * C, B, C);
    }
}

// The weight and bias gradients of a matmul (dout (B,Tl,OC), inp (B,Tl,C)) over this rank's
// positions; with CP (cp_split > 1) as per-sequence subtrees at dweight + b*seq_stride, dbias
// + b*seq_stride, for the caller to finish over the group.
static void matmul_weight_backward_cp(int cp_split, float* dweight, float* dbias, long seq_stride, const float* dout,
                                      const float* inp, int B, int Tl, int C, int OC) {
    if (cp_split == 1) {
        matmul_backward(NULL, dweight, dbias, dout, inp, NULL, B, Tl, C, OC, 1, CANON_R);
        return;
    }
    matmul_backward_seqs(dweight, dbias, seq_stride, dout, inp, B, Tl, C, OC, CANON_R / cp_split);
}

// The gradient of a row-parallel layer's output, full (B,T,C) (with CP this rank's slice), from
// d(residual), into dst (Megatron's g backward: the identity, or with SP an all-gather along
// T). A copy, because the backward goes on to change d(residual) before the weight half reads it.
static void dres_g_backward(GPT2* model, ActivationGrads* g, float* dst, int B, int T) {
    int Tl = T / g->cp_split;
    size_t BTC = (size_t)B * Tl * model->config.channels;
    if (g->seq_split == g->cp_split) {
        tp_g_backward(model->tp, g->dresidual, BTC);
        model->mem->copy(dst, g->dresidual, BTC * sizeof(float));
        return;
    }
    tp_sp_all_gather(model->tp, g->dresidual, dst, B, Tl, model->config.channels, model->sp_scratch);
}

// (the chunk with the head) backward of the head. Input half: g->dresidual = d(loss)/d(stage_output), and
// the probabilities become d(loss)/d(logits) in place; dloss = d(loss)/d(per-position loss) =
// 1 / (tokens in the global batch). Weight half: the LM-head half of wte's gradient and the
// final layernorm's.
void head_backward(GPT2* model, Activations* a, ActivationGrads* g, int B, int T, float dloss, int part) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    int C = c->channels, V = c->vocab_size, cp_split = a->cp_split, Tl = T / cp_split, BT = B * Tl;
    int sp = g->seq_split > cp_split, LNF = z->lay.num_units - 1;
    float* dlnf = a->split_backward ? a->dlnf : g->dln1;
    if (part & BACKWARD_INPUT) {
        const float* wte = zero_params_acquire(z, ZERO_WTE, -1);
        crossentropy_backward(a->probs, a->targets, dloss, BT, V, model->v0, model->Vl);
        float* dlnf_part = sp ? g->dbtc : dlnf;   // this rank's vocabulary rows' share
        matmul_backward(dlnf_part, NULL, NULL, a->probs, NULL, wte, B, Tl, C, model->Vl, 1, CANON_R / model->tp_size);
        zero_params_release(z, ZERO_WTE);
        int next = model->last_layer > model->first_layer ? ZERO_LAYER(model->last_layer - 1) : -1;
        const float* lnf = zero_params_acquire(z, LNF, next);
        model->mem->fill(g->dresidual, 0.0f, (size_t)B * T / g->seq_split * C);
        ln_backward_f_input(model, g, g->dresidual, dlnf_part, dlnf, stage_output(a, c, B, T), lnf, a->lnf_mean,
                            a->lnf_rstd, B, T, 0);
        zero_params_release(z, LNF);
    }
    if (part & BACKWARD_WEIGHT) {
        float* dwte_lm = zero_grad_unit(z, ZERO_WTE);    // the LM-head half of wte's gradient
        size_t nwte = (size_t)model->Vl * C;
        matmul_weight_backward_cp(cp_split, cp_split > 1 ? model->seq_grads : dwte_lm, NULL, (long)nwte, a->probs,
                                  a->lnf, B, Tl, C, model->Vl);
        if (cp_split > 1) { cp_finish_sequences(&model->cp, dwte_lm, model->seq_grads, B, nwte); }
        zero_grad_unit_done(z, ZERO_WTE);
        float* dlnfw = zero_grad_unit(z, LNF);
        float* dl = cp_split > 1 ? model->seq_grads : dlnfw;   // [weight | bias], per sequence with CP
        ln_backward_f_weight(model, g, dl, dl + C, 2L * C, dlnf, stage_output(a, c, B, T), a->lnf_mean, a->lnf_rstd,
                             B, T);
        if (cp_split > 1) { cp_finish_sequences(&model->cp, dlnfw, model->seq_grads, B, 2 * (size_t)C); }
        zero_grad_unit_done(z, LNF);
    }
}

// The backward of layer l's mixture of experts (moe.h THE BACKWARD): dln (B,T,C), complete on
// every tensor-parallel rank, from dout (B,T,C); the router's gradient into dw, the experts'
// into their unit (a slice per source microbatch, expert_parallel.h). `next`: the unit ZeRO-3
// prefetches after the experts.
static void moe_backward(GPT2* model, Activations* a, ActivationGrads* g, int l, const LayerTensors* w,
                         const LayerTensors* dw, const float* ln, const float* dout, float* dln, int next, int B,
                         int T) {
    const GPT2Config* c = &model->config;
    const MemOps* mem = model->mem;
    Zero* z = model->zero;
    MoeLayerActs* moe_act = &a->moe[l - model->first_layer];
    MoeRoute* route = &moe_act->route;
    int C = c->channels, C4 = a->C4, num_experts = model->num_experts, top_k = model->top_k;
    int ep_size = model->ep_size, BT = B * T;
    moe_grads_rows(model, g, (size_t)route->n_recv, C4);
    moe_combine_backward(g->dgate, g->dslots, dout, moe_act->ret, moe_act->gates, moe_act->slot_row, BT, top_k, C);
    // the router, with the load-balancing loss of this microbatch (1/M of the step's loss each)
    moe_aux_grad(model->daux_host, route->count, num_experts, top_k, BT, c->aux_loss_coef,
                 z->local_microbatches * z->streams);
    mem->from_host(g->daux, model->daux_host, (size_t)num_experts * sizeof(float));
    moe_router_backward(g->dlogits, moe_act->probs, moe_act->chosen, moe_act->gates, g->dgate, g->daux, BT,
                        num_experts, top_k);
    matmul_backward(g->drouter, dw->routerw, NULL, g->dlogits, ln, w->routerw, B, T, C, num_experts, 1, CANON_R);
    // the output gradients to the experts (expert-major rows)
    const float* dy = g->dslots;
    float* dx = g->dwork;
    if (ep_size > 1) {
        moe_route_dispatch(route, model->ep, g->dslots, g->dwork2, C);
        moe_gather_rows(g->dwork, g->dwork2, moe_act->perm, route->n_recv, C);
        dy = g->dwork;
        dx = g->dwork2;
    }
    int unit = zero_expert_unit(z, l);
    ExpertTensors ex = expert_unit(z, unit, zero_params_acquire(z, unit, next));
    ExpertTensors dex = expert_unit(z, unit, zero_grad_unit(z, unit));
    size_t slice = z->lay.size[unit], nleaf = (size_t)ep_size * B * CANON_R + 1;
    const float* gelu_out = a->recompute ? g->hgelu : moe_act->fch_gelu;
    for (int e = 0; e < model->El; e++) {
        int r0 = route->first[e], n = route->first[e + 1] - r0;
        const int* leaf = moe_act->leaf + e * nleaf;
        float* fch = moe_act->fch + (size_t)r0 * C4;
        if (a->recompute && n > 0) { gelu_forward(g->hgelu + (size_t)r0 * C4, fch, (size_t)n * C4); }
        moe_expert_dweight(dex.fcprojw + e * dex.fcprojw_n, dex.fcprojb + e * dex.fcprojb_n, slice, dy, gelu_out, leaf,
                           ep_size, B, C4, C);
        if (n > 0) {
            matmul_backward(g->dh + (size_t)r0 * C4, NULL, NULL, dy + (size_t)r0 * C, NULL, ex.fcprojw + e * ex.fcprojw_n,
                            1, n, C4, C, 1, CANON_R);
            gelu_backward(g->dh + (size_t)r0 * C4, fch, g->dh + (size_t)r0 * C4, (size_t)n * C4);
        }
        moe_expert_dweight(dex.fcw + e * dex.fcw_n, dex.fcb + e * dex.fcb_n, slice, g->dh, moe_act->xin, leaf, ep_size,
                           B, C, C4);
        if (n > 0) {
            matmul_backward(dx + (size_t)r0 * C, NULL, NULL, g->dh + (size_t)r0 * C4, NULL, ex.fcw + e * ex.fcw_n, 1, n,
                            C, C4, 1, CANON_R / model->tp_size);
        }
    }
    zero_grad_unit_done(z, unit);
    zero_params_release(z, unit);
    // f backward (tp group): each expert's column-parallel input gradients dx (rows, C),
    // all-reduced per row
    tp_f_backward(model->tp, dx, (size_t)route->n_recv * C);
    const float* dret = dx;
    if (ep_size > 1) {   // the input gradients back to their sources, in dispatch-row order
        moe_gather_rows(g->dwork, dx, moe_act->inv, route->n_recv, C);
        moe_route_return(route, model->ep, g->dwork, g->dslots, C);
        dret = g->dslots;
    }
    moe_dinput_combine(dln, g->drouter, dret, moe_act->slot_row, BT, top_k, C);
}

// this chunk's layers backward. Input half: g->dresidual = d(loss)/d(stage_output) in,
// d(loss)/d(a->encoded) out, each layer's gradients at the outputs of its weights kept
// (layer_out_grads). Weight half: from those, each layer's weight gradients, handed to zero.h
// when complete, so that their reduction overlaps the backward of the layers below. Run whole,
// each weight gradient is computed right after the gradient it reads (while it is in cache).
// With CP the weight half computes each sequence's subtree of the layer's gradient in
// model->seq_grads and the cp group finishes it (cp_finish_sequences) before zero.h gets it.
void layers_backward(GPT2* model, Activations* a, ActivationGrads* g, int B, int T, int part) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    int C = c->channels, cp_split = a->cp_split, Tl = T / cp_split, BT = B * Tl, tp_size = model->tp_size;
    int sp = g->seq_split > cp_split;
    int in = part & BACKWARD_INPUT, wt = part & BACKWARD_WEIGHT, moe = model->num_experts > 0;
    if (moe && part != BACKWARD_BOTH) { fatal("internal: a mixture-of-experts layer runs whole backwards only"); }
    for (int l = model->last_layer - 1; l >= model->first_layer; l--) {
        LayerActs act = layer_acts(a, c, l - model->first_layer, B, T, 0);
        LayerOutGrads d = layer_out_grads(a, g, c, l - model->first_layer, B, T);
        int next = l - 1 >= model->first_layer ? ZERO_LAYER(l - 1) : -1;
        LayerTensors w, dw;   // the parameters (input half), where their gradients go (weight half)
        memset(&w, 0, sizeof(w));
        memset(&dw, 0, sizeof(dw));
        float* grad = NULL;
        long us = (long)z->lay.size[ZERO_LAYER(l)];   // with CP: sequence b's subtrees at seq_grads + b * us
        if (in) { w = layer_unit(z, ZERO_LAYER(l), zero_params_acquire(z, ZERO_LAYER(l), moe ? zero_expert_unit(z, l) : next)); }
        if (wt) {
            grad = zero_grad_unit(z, ZERO_LAYER(l));
            dw = layer_unit(z, ZERO_LAYER(l), cp_split > 1 ? model->seq_grads : grad);
        }
        float* dln2_part = sp ? g->dbtc : d.dln2;   // this rank's share, before the tp sum
        float* dln1_part = sp ? g->dbtc : d.dln1;
        if (moe) {   // residual3 = residual2 + moe(ln2(residual2)); its dln2 is complete on every rank
            dres_g_backward(model, g, d.dfcproj, B, T);
            moe_backward(model, a, g, l, &w, &dw, act.ln2, d.dfcproj, dln2_part, next, B, T);
            ln_backward_f_input(model, g, g->dresidual, dln2_part, d.dln2, act.residual2, w.ln2w, act.ln2_mean,
                                act.ln2_rstd, B, T, 1);
        } else {     // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
            if (wt && a->recompute) { gelu_forward(act.fch_gelu, act.fch, (size_t)BT * a->C4); }
            if (in) { dres_g_backward(model, g, d.dfcproj, B, T); }
            if (wt) { matmul_weight_backward_cp(cp_split, dw.fcprojw, dw.fcprojb, us, d.dfcproj, act.fch_gelu, B, Tl, a->C4, C); }
            if (in) {
                matmul_backward(d.dfch, NULL, NULL, d.dfcproj, NULL, w.fcprojw, B, Tl, a->C4, C, 1, CANON_R);
                gelu_backward(d.dfch, act.fch, d.dfch, (size_t)BT * a->C4);
            }
            if (wt) { matmul_weight_backward_cp(cp_split, dw.fcw, dw.fcb, us, d.dfch, act.ln2, B, Tl, C, a->C4); }
            if (in) {
                matmul_backward(dln2_part, NULL, NULL, d.dfch, NULL, w.fcw, B, Tl, C, a->C4, 1, CANON_R / tp_size);
                ln_backward_f_input(model, g, g->dresidual, dln2_part, d.dln2, act.residual2, w.ln2w, act.ln2_mean,
                                    act.ln2_rstd, B, T, 0);
            }
        }
        if (wt) { ln_backward_f_weight(model, g, dw.ln2w, dw.ln2b, us, d.dln2, act.residual2, act.ln2_mean, act.ln2_rstd, B, T); }
        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        if (in) { dres_g_backward(model, g, d.dattproj, B, T); }
        if (wt) { matmul_weight_backward_cp(cp_split, dw.attprojw, dw.attprojb, us, d.dattproj, act.atty, B, Tl, a->Ca, C); }
        if (in) {
            matmul_backward(g->datty, NULL, NULL, d.dattproj, NULL, w.attprojw, B, Tl, a->Ca, C, 1, CANON_R);
            if (cp_split == 1) {
                attention_backward(d.dqkv, g->datty, act.qkv, act.att, B, T, a->Ca, a->NHl);
            } else if (model->cp.a2a) {
                cp_a2a_backward(&model->cp, d.dqkv, g->datty, act.qkvh, act.att, B, T, a->Ca, a->NHl);
            } else {
                cp_ring_backward(&model->cp, d.dqkv, g->datty, act.qkv, act.att, B, T, a->Ca, a->NHl);
            }
        }
        if (wt) { matmul_weight_backward_cp(cp_split, dw.qkvw, dw.qkvb, us, d.dqkv, act.ln1, B, Tl, C, a->C3); }
        if (in) {
            matmul_backward(dln1_part, NULL, NULL, d.dqkv, NULL, w.qkvw, B, Tl, C, a->C3, 3, CANON_R / tp_size);
            ln_backward_f_input(model, g, g->dresidual, dln1_part, d.dln1, act.residual, w.ln1w, act.ln1_mean,
                                act.ln1_rstd, B, T, 0);
        }
        if (wt) {
            ln_backward_f_weight(model, g, dw.ln1w, dw.ln1b, us, d.dln1, act.residual, act.ln1_mean, act.ln1_rstd, B, T);
            if (cp_split > 1) { cp_finish_sequences(&model->cp, grad, model->seq_grads, B, (size_t)us); }
            zero_grad_unit_done(z, ZERO_LAYER(l));
        }
        if (in) { zero_params_release(z, ZERO_LAYER(l)); }
    }
}

// (the chunk with the embeddings) the embeddings' gradients from g->dresidual = d(loss)/d(encoded): the lookup
// half of wte's gradient (zero_lookup_unit; this rank's vocabulary rows) and wpe's. Both sum over all
// positions: with SP the gradient is all-gathered along T first (the input half, which keeps
// it), with CP then along the sequence (cp group, the weight half), and every rank runs the
// one-rank embedding backward on whole sequences.
void embed_backward(GPT2* model, Activations* a, ActivationGrads* g, int B, int T, int part) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    int lookup_unit = zero_lookup_unit(z);
    float* dencoded = a->split_backward ? a->dencoded : g->dfcproj;
    if (part & BACKWARD_INPUT) { dres_g_backward(model, g, dencoded, B, T); }
    if (part & BACKWARD_WEIGHT) {
        const float* dwhole = dencoded;
        if (a->cp_split > 1) {
            cp_gather_sequences(&model->cp, dencoded, g->dwhole, B, T, c->channels);
            dwhole = g->dwhole;
        }
        float* dwte_lookup = zero_grad_unit(z, lookup_unit);
        float* dwpe = zero_grad_unit(z, ZERO_WPE);
        encoder_backward(dwte_lookup, dwpe, dwhole, a->inputs_full, B, T, c->channels, model->v0, model->Vl,
                         c->max_seq_len);
        if (a->cp_split > 1) {   // every rank of the group computed them whole: hand ZeRO its part
            cp_keep_part(&model->cp, dwte_lookup, z->lay.size[lookup_unit]);
            cp_keep_part(&model->cp, dwpe, z->lay.size[ZERO_WPE]);
        }
        zero_grad_unit_done(z, ZERO_WPE);
        zero_grad_unit_done(z, lookup_unit);
    }
}

// The probabilities of one position over the whole vocabulary, into host memory: this rank's
// slice, all-gathered over the tp group (sampling).
void probs_at(GPT2* model, Activations* a, int position, float* host_probs) {
    tp_gather_vocab(model->tp, a->probs + (size_t)position * model->Vl, model->probs_all, (size_t)model->Vl);
    model->mem->to_host(host_probs, model->probs_all, sizeof(float) * model->config.padded_vocab_size);
}

// The whole model on a rank that holds all of it (one pipeline stage): the tests' entry points.
void gpt2_forward(GPT2* model, Activations* a, const int* inputs, const int* targets, int B, int T,
                  int training) {
    activations_set_tokens(model, a, inputs, targets, B, T);
    embed_forward(model, a, B, T, 0, T);
    layers_forward(model, a, B, T, 0, T);
    head_forward(model, a, B, T, 0, T, training);
}

void gpt2_backward(GPT2* model, Activations* a, ActivationGrads* g, int B, int T, float dloss, int part) {
    head_backward(model, a, g, B, T, dloss, part);
    layers_backward(model, a, g, B, T, part);
    embed_backward(model, a, g, B, T, part);
}

// --- building the model -------------------------------------------------------------------

// The model of a model chunk (`place`: its layers, whether it has the embeddings and the
// head) on the parameters zero.h holds, its tensor-parallel slices over tp (tensor_parallel.h);
// for passes over up to (B, T) positions: seq_parallel, sequence parallelism (2 tp | T); cp,
// the context-parallel group (context_parallel.h; of one rank: none) and its attention
// (cp_a2a: all-to-all, else the ring).
void gpt2_init(GPT2* model, const GPT2Config* config, const ChunkPlace* place, Zero* zero,
               CommGroup* tp, CommGroup* cp, int cp_a2a, int seq_parallel, int B, int T) {
    memset(model, 0, sizeof(*model));
    model->config = *config;
    const char* problem = tp_problem(config, tp->size);
    if (problem) { fatal("--tp %d: %s (model: NH=%d, Vp=%d)", tp->size, problem, config->num_heads, config->padded_vocab_size); }
    char why[256];
    problem = cp_problem(cp->size, cp_a2a, T, config->num_heads / tp->size, seq_parallel ? tp->size : 1, why,
                         sizeof(why));
    if (problem) { fatal("--cp %d: %s", cp->size, problem); }
    model->tp = tp;
    model->seq_parallel = seq_parallel;
    model->cp_size = cp->size;
    model->tp_size = tp->size;
    model->Vl = config->padded_vocab_size / tp->size;
    model->v0 = tp->rank * model->Vl;
    model->first_layer = place->first_layer;
    model->last_layer = place->last_layer;
    model->has_embedding = place->has_embedding;
    model->has_head = place->has_head;
    model->zero = zero;
    model->mem = zero->mem;
    model->sp_scratch = seq_parallel ? mem_floats(model->mem, (size_t)B * T * config->channels, "sequence parallelism")
                                     : NULL;
    model->probs_all = place->has_head ? mem_floats(model->mem, config->padded_vocab_size, "probabilities") : NULL;
    // context parallelism: each sequence's subtree of a unit's gradient (the largest unit
    // this rank computes), and the group's finishing of it (context_parallel.h)
    size_t unit = 0;
    for (int u = 0; u < zero->lay.num_units; u++) {
        if (zero->lay.grads_here[u] && zero->lay.size[u] > unit) { unit = zero->lay.size[u]; }
    }
    int cp_size = model->cp_size;
    size_t finish = ((size_t)cp_size * B + B) * ((unit + cp_size - 1) / cp_size);
    // the embedding chunk all-gathers its input gradient at full width (B,T,C)
    size_t gather = place->has_embedding ? (size_t)B * T * config->channels : 0;
    cp_init(&model->cp, cp, cp_a2a, model->mem, B, T, config->channels / tp->size, config->num_heads / tp->size,
            finish > gather ? finish : gather);
    model->seq_grads = cp_size > 1 ? mem_floats(model->mem, (size_t)B * unit, "context-parallel gradients") : NULL;
    if (config->num_experts > 0) {   // the expert-parallel group and the experts' layout are zero.h's
        int num_experts = model->num_experts = config->num_experts;
        model->top_k = config->top_k;
        model->ep = zero->ep;
        model->ep_size = zero->ep->size;
        model->El = num_experts / model->ep_size;
        model->psum = mem_floats(model->mem, (size_t)num_experts, "router probability sums");
        model->psum_host = (float*)malloc_or_die(sizeof(float) * 2 * (size_t)num_experts, "router probability sums");
        model->daux_host = model->psum_host + num_experts;
        int layers = place->last_layer - place->first_layer;
        model->counters = (MoeCounters){layers, num_experts, place->first_layer,
                                        (double*)calloc_or_die((size_t)(layers ? layers : 1) * num_experts,
                                                               sizeof(double), "expert counters"), 0, 0, 0};
    }
}

void gpt2_free(GPT2* model) {
    void* all[] = {model->sp_scratch, model->probs_all, model->xsend, model->psum, model->seq_grads};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) { model->mem->release(all[i]); }
    MOE_MODEL_ROWS(RELEASE, model)
    cp_free(&model->cp);
    free(model->psum_host);
    free(model->counters.tokens);
}

// --- the model as the engine drives it (engine.h ModelOps) --------------------------------

static void* model_create(const GPT2Config* config, const ChunkPlace* place, Zero* zero, CommGroup* tp,
                          CommGroup* cp, int cp_a2a, int seq_parallel, int B, int T) {
    GPT2* model = (GPT2*)malloc_or_die(sizeof(GPT2), "model");
    gpt2_init(model, config, place, zero, tp, cp, cp_a2a, seq_parallel, B, T);
    return model;
}
static void model_destroy(void* m) { gpt2_free((GPT2*)m); free(m); }
static void* model_acts_create(void* m, int B, int T, int recompute, int split_seqs, int split_backward,
                               size_t* bytes) {
    Activations* a = (Activations*)malloc_or_die(sizeof(Activations), "activations");
    activations_alloc(a, (GPT2*)m, B, T, recompute, split_seqs, split_backward);
    *bytes = a->bytes;
    return a;
}
static void model_acts_destroy(void* m, void* a) { activations_free((GPT2*)m, (Activations*)a); free(a); }
static void model_set_tokens(void* m, void* a, const int* inputs, const int* targets, int B, int T) {
    activations_set_tokens((GPT2*)m, (Activations*)a, inputs, targets, B, T);
}
static float* model_stage_input(void* m, void* a) { (void)m; return ((Activations*)a)->encoded; }
static float* model_stage_output(void* m, void* a, int B, int T) {
    return stage_output((Activations*)a, &((GPT2*)m)->config, B, T);
}
static void model_embed_forward(void* m, void* a, int B, int T) {
    embed_forward((GPT2*)m, (Activations*)a, B, T, 0, T);
}
static void model_layers_forward(void* m, void* a, int B, int T) {
    layers_forward((GPT2*)m, (Activations*)a, B, T, 0, T);
}
static void model_head_forward(void* m, void* a, int B, int T, int training) {
    head_forward((GPT2*)m, (Activations*)a, B, T, 0, T, training);
}
static float model_loss_sum(void* m, void* a, int B, int T) { (void)m; return position_sum(((Activations*)a)->losses, B, T); }
static void model_probs_at(void* m, void* a, int position, float* host_probs) {
    probs_at((GPT2*)m, (Activations*)a, position, host_probs);
}
static void* model_grads_create(void* m, int B, int T, int split_seqs, size_t* bytes) {
    ActivationGrads* g = (ActivationGrads*)malloc_or_die(sizeof(ActivationGrads), "activation gradients");
    activation_grads_alloc(g, (GPT2*)m, B, T, split_seqs);
    *bytes = g->bytes;
    return g;
}
static void model_grads_destroy(void* m, void* g) { activation_grads_free((GPT2*)m, (ActivationGrads*)g); free(g); }
static float* model_grad_residual(void* m, void* g) { (void)m; return ((ActivationGrads*)g)->dresidual; }
static void model_head_backward(void* m, void* a, void* g, int B, int T, float dloss, int part) {
    head_backward((GPT2*)m, (Activations*)a, (ActivationGrads*)g, B, T, dloss, part);
}
static void model_layers_backward(void* m, void* a, void* g, int B, int T, int part) {
    layers_backward((GPT2*)m, (Activations*)a, (ActivationGrads*)g, B, T, part);
}
static void model_embed_backward(void* m, void* a, void* g, int B, int T, int part) {
    embed_backward((GPT2*)m, (Activations*)a, (ActivationGrads*)g, B, T, part);
}
static void model_embed_decode(void* m, void* a, int token, int t, int T) {
    embed_decode((GPT2*)m, (Activations*)a, token, t, T);
}
static void model_layers_decode(void* m, void* a, int t, int T) { layers_decode((GPT2*)m, (Activations*)a, t, T); }
static void model_head_decode(void* m, void* a, int t, int T) { head_decode((GPT2*)m, (Activations*)a, t, T); }
static void model_moe_aux(void* m, void* a, float* host_aux) {
    const Activations* acts = (const Activations*)a;
    for (int l = 0; l < acts->layers; l++) { host_aux[l] = acts->moe ? acts->moe[l].aux : 0.0f; }
}
static MoeCounters* model_moe_counters(void* m) { return ((GPT2*)m)->num_experts > 0 ? &((GPT2*)m)->counters : NULL; }

static const ModelOps gpt2_model_ops = {
    model_create, model_destroy, model_acts_create, model_acts_destroy, model_set_tokens,
    model_stage_input, model_stage_output, model_embed_forward, model_layers_forward,
    model_head_forward, model_loss_sum, model_probs_at, model_grads_create, model_grads_destroy,
    model_grad_residual, model_head_backward, model_layers_backward, model_embed_backward,
    model_moe_aux, model_moe_counters, model_embed_decode, model_layers_decode, model_head_decode
};

// ==========================================================================================
// main: the shared engine (llmc/engine.h) on this model and host memory
// ==========================================================================================
#if !defined(TESTING) && !defined(LLMC_DEVICE_KERNELS)
static void cpu_banner(void) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    printf("| train_gpt2 (CPU reference, canonical arithmetic, %-6s kernels, %2d threads)|\n", LLMC_SIMD_NAME, threads);
}

static void cpu_throughput(char* out, size_t len, double flops_per_second) {
    snprintf(out, len, "%.1f GFLOP/s", flops_per_second / 1e9);
}

// against this machine's FMA peak, measured now (llmc/fma_peak.h, a fraction of a second)
static void cpu_summary_throughput(char* out, size_t len, double flops_per_second) {
    double peak = fma_peak_median(5000000);
    snprintf(out, len, "%.1f GFLOP/s = %.0f%% of this machine's FMA peak (%.1f GFLOP/s, measured now)",
             flops_per_second / 1e9, 100.0 * flops_per_second / 1e9 / peak, peak);
}

int main(int argc, char** argv) {
    Trainer trainer;
    if (!trainer_begin(&trainer, argc, argv)) { return 0; }
    if (trainer.args.deterministic || strcmp(trainer.args.comm, "auto") != 0 || strcmp(trainer.args.attention, "auto") != 0) {
        fatal("--deterministic, --comm and --attention are flags of the CUDA build (train_gpt2cu)");
    }
    if (trainer.config.channels / trainer.config.num_heads > 256) {
        fatal("-e: head size C/NH = %d is larger than the 256 this build supports", trainer.config.channels / trainer.config.num_heads);
    }
    trainer_build(&trainer, &gpt2_model_ops, &memory_host);
    BuildInfo build = {"train_gpt2", cpu_banner, NULL, cpu_throughput, cpu_summary_throughput};
    trainer_run(&trainer, &build);
    trainer_end(&trainer);
    return 0;
}
#endif
