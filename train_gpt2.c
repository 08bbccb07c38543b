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
 * which is what makes this file the arithmetic truth.
 *
 * The kernels here are the plain specification: loops in the canonical order, one output at a
 * time where that is clearest. The ones the training time lives in have a fast twin in
 * llmc/cpu_fast.h (register tiles, SIMD, cache blocking) that computes exactly their bits
 * (test_kernels compares them); together they implement the kernel contract, llmc/kernels.h.
 * The CUDA build in deterministic mode runs this very model on the contract's device set
 * (train_gpt2.cu includes this file with LLMC_DEVICE_KERNELS defined, which leaves out the
 * CPU kernels and main), and every parallel layout reproduces its bits.
 *
 * Shapes: B sequences of T tokens, C channels, NH heads of hs = C/NH, vocabulary V padded to
 * Vp, L layers. "BT" is B*T positions, row-major (b, t). A matmul reduces IC inputs to OC
 * outputs.
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
#include "llmc/kernels.h"
#include "llmc/model.h"
#include "llmc/memory.h"
#include "llmc/comm.h"
#include "llmc/zero.h"
#include "llmc/tensor_parallel.h"
#include "llmc/context_parallel.h"
#include "llmc/moe.h"
#include "llmc/paged_kv.h"
#include "llmc/expert_parallel.h"
#include "llmc/engine.h"

#ifndef LLMC_DEVICE_KERNELS
#include "llmc/cpu_fast.h"
#include "llmc/decode_matmul.h"
#include "llmc/fma_peak.h"

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
            float partials[64];
            CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
            for (int b = 0; b < B; b++) {
                canon_stack_push_value(&stack, 0.0f + dout[((size_t)b * T + t) * C + c], canon_tree_merges_after(b, B));
            }
            dst[c] = partials[0];
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
    float* stacks = scratch(SCRATCH_TREE, sizeof(float) * (size_t)depth * C * thread_count());
    #pragma omp parallel for schedule(dynamic, 1)
    for (int v = 0; v < Vl; v++) {
        int begin = first[v], end = first[v + 1];
        if (begin == end) { continue; }
        CanonStack stack = canon_stack(stacks + (size_t)thread_index() * depth * C, C, 1, C, C);
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
                float* acc = canon_stack_next(&stack);
                for (int c = 0; c < C; c++) { acc[c] = 0.0f; }
                int pieces[2] = {ch, 2 * CANON_R - 1 - ch};
                for (int half = 0; half < 2; half++) {
                    for (int i = piece_at[pieces[half]]; i < piece_at[pieces[half] + 1]; i++) {
                        const float* d = dout + (size_t)order[i] * C;
                        for (int c = 0; c < C; c++) { acc[c] = acc[c] + d[c]; }
                    }
                }
                canon_stack_push(&stack, canon_pos_merges_after(b, B, ch, CANON_R));
            }
        }
        memcpy(dwte_emb + (size_t)v * C, stack.base, sizeof(float) * C);
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
// dweight[c] = R3 over positions of dout*n (fmaf), dbias[c] = R3 of dout: B sequences of T
// positions, the rows rank r's D-way zig-zag slice of each (canonical.h; canon_zz_len(T, D, r)
// rows a sequence, its 8/D R2Z chunks; D = 1: whole). Under sequence (or context) parallelism
// (D > 1) seq_partials (2,B,C) receives each sequence's subtree for dweight and dbias, for the
// caller to finish over the group and over the sequences (sequence_tree); otherwise
// (seq_partials NULL, D 1) the R3 is done here. The two halves are independent: dres
// NULL skips the input gradient, dweight and seq_partials NULL the parameter gradients (the
// pipeline's deferred weight gradients run them at different times).
void layernorm_backward(float* dres, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int B, int T, int D, int r, int C, float* seq_partials) {
    int Tl = (int)canon_zz_len(T, D, r), nchunks = CANON_R / D;
    int BT = dres ? B * Tl : 0;
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
    // parameter gradients: R3 (or its per-sequence subtrees), 64 channels at a time
    int Cp = dweight || seq_partials ? C : 0;
    #pragma omp parallel for
    for (int c0 = 0; c0 < Cp; c0 += 64) {
        int cn = C - c0 < 64 ? C - c0 : 64;
        float sw[40][64], sb[40][64];
        CanonStack wstack = canon_stack(sw[0], 64, 1, cn, 64), bstack = canon_stack(sb[0], 64, 1, cn, 64);
        for (int b = 0; b < B; b++) {
            for (int ch = 0; ch < nchunks; ch++) {
                float* aw = canon_stack_next(&wstack);
                float* ab = canon_stack_next(&bstack);
                for (int j = 0; j < cn; j++) { aw[j] = 0.0f; ab[j] = 0.0f; }
                for (int half = 0; half < 2; half++) {
                    long tb, te;
                    canon_zz_slice_half(T, D, r, ch, half, &tb, &te);
                    for (long t = tb; t < te; t++) {
                        size_t i = (size_t)b * Tl + t;
                        const float* x = inp + i * C + c0;
                        const float* dy = dout + i * C + c0;
                        for (int j = 0; j < cn; j++) {
                            float n = (x[j] - mean[i]) * rstd[i];
                            aw[j] = fmaf(dy[j], n, aw[j]);
                            ab[j] = ab[j] + dy[j];
                        }
                    }
                }
                // a sequence's own subtree, or on through the tree over sequences
                int merges = seq_partials ? canon_tree_merges_after(ch, nchunks) : canon_pos_merges_after(b, B, ch, nchunks);
                canon_stack_push(&wstack, merges);
                canon_stack_push(&bstack, merges);
            }
            if (seq_partials) {   // this sequence's subtree; the caller finishes the tree
                memcpy(seq_partials + (size_t)b * C + c0, sw[0], sizeof(float) * cn);
                memcpy(seq_partials + ((size_t)B + b) * C + c0, sb[0], sizeof(float) * cn);
                wstack.top = bstack.top = 0;
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
// matmul: out (BT,OC) = inp (BT,IC) @ weight (OC,IC)^T + bias (OC)
//
// Each output is the R2 reduction over ic with `nchunks` chunks (CANON_R; a tensor-parallel
// rank holding a 1/tp slice of ic uses CANON_R/tp chunks and finishes the tree across ranks),
// products fused with fmaf, and the bias added after the tree. The specification, one output
// at a time (cpu_fast.h's matmul_forward computes exactly these bits; test_kernels checks):
void matmul_forward_naive(float* out, const float* inp, const float* weight, const float* bias,
                          int BT, int IC, int OC, int nchunks) {
    #pragma omp parallel for
    for (int bt = 0; bt < BT; bt++) {
        for (int o = 0; o < OC; o++) {
            float partial[CANON_R];
            for (int ch = 0; ch < nchunks; ch++) {
                float acc = 0.0f;
                for (long ic = ((long)IC * ch) / nchunks; ic < ((long)IC * (ch + 1)) / nchunks; ic++) {
                    acc = fmaf(inp[(size_t)bt * IC + ic], weight[(size_t)o * IC + ic], acc);
                }
                partial[ch] = acc;
            }
            float sum = canon_tree_sum(partial, nchunks, 1);
            out[(size_t)bt * OC + o] = bias ? sum + bias[o] : sum;
        }
    }
}

// Backward of the matmul, three reductions:
//  dinp (BT,IC) = dout (BT,OC) @ weight (OC,IC): R2 over the OUTPUTS o. A weight made of
//                 `groups` fused matrices (qkv: 3) is chunked per group: chunk c is the c-th
//                 slice of every group, in group order, so that a column-parallel partition by
//                 heads (rank r owns slice r of q, of k and of v) owns whole chunks.
//  dweight (OC,IC) = R3 over positions of dout[.,o] * inp[.,ic];   dbias (OC) = R3 of dout.
// Every element is written (=), never accumulated. The specification, one output at a time
// (cpu_fast.h's matmul_backward computes exactly these bits).
void matmul_backward_naive(float* dinp, float* dweight, float* dbias, const float* dout,
                           const float* inp, const float* weight, int B, int T, int IC, int OC,
                           int groups, int nchunks) {
    int BT = B * T, og = OC / groups;
    #pragma omp parallel for
    for (int bt = 0; bt < BT; bt++) {   // dinp: chunk c is the c-th slice of every group
        for (int ic = 0; dinp && ic < IC; ic++) {
            float partial[CANON_R];
            for (int ch = 0; ch < nchunks; ch++) {
                float acc = 0.0f;
                for (int g = 0; g < groups; g++) {
                    for (long j = ((long)og * ch) / nchunks; j < ((long)og * (ch + 1)) / nchunks; j++) {
                        long o = (long)g * og + j;
                        acc = fmaf(dout[(size_t)bt * OC + o], weight[(size_t)o * IC + ic], acc);
                    }
                }
                partial[ch] = acc;
            }
            dinp[(size_t)bt * IC + ic] = canon_tree_sum(partial, nchunks, 1);
        }
    }
    #pragma omp parallel for
    for (int o = 0; o < OC; o++) {   // dweight, dbias: R3, per sequence the R2Z chunks of T, then R1
        for (int ic = -1; ic < IC; ic++) {   // ic = -1: the bias
            if ((ic < 0 && !dbias) || (ic >= 0 && !dweight)) { continue; }
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
                            acc = ic < 0 ? acc + dout[pos * OC + o] : fmaf(dout[pos * OC + o], inp[pos * IC + ic], acc);
                        }
                    }
                    partial[ch] = acc;
                }
                seq[b] = canon_tree8(partial);
            }
            float sum = canon_tree_sum(seq, B, 1);
            if (ic < 0) { dbias[o] = sum; } else { dweight[(size_t)o * IC + ic] = sum; }
            free(seq);
        }
    }
}

// ------------------------------------------------------------------------------------------
// attention, causal, per (b, h) with hs = C/NH. The specification, written plainly
// (cpu_fast.h's attention_forward and attention_backward compute exactly these bits):
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
    float partials[CANON_LOG2_R + 1][256];
    CanonStack stack = canon_stack(partials[0], 256, 1, n, 256);
    for (int ch = 0; ch < CANON_R; ch++) {
        float* acc = canon_stack_next(&stack);
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
        canon_stack_push(&stack, canon_tree_merges_after(ch, CANON_R));
    }
    memcpy(out, partials[0], sizeof(float) * n);
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

// Generation with a KV cache (engine.h's sampler): query row t of one sequence laid out
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

// Serving (llmc/serve_engine.h): N query rows of different sequences, each against the keys
// and values its own sequence holds in a paged KV cache (llmc/paged_kv.h), every sequence laid
// out over the same T positions (the model's maxT), so a row's reductions depend on its own
// position only: never on the other rows, nor on the longest sequence.
//   qkv (N,3C): each row's q (its own k, v are already in the cache)
//   tables (N,max_blocks): each row's block table; pos (N): each row's position; out (N,C)
//   key p of row r: kv + tables[r * max_blocks + p / bs] * block_stride + (p % bs) * 2C, k (C) | v (C)
//   scratch: (N,NH,T) the probabilities
// Row r is row pos[r] of attention_forward over that one sequence (1,T), bit for bit: its keys
// and values, gathered into a sequence of T*3C floats, are that pass's qkv rows, and
// attention_query_row runs on them unchanged. The specification of cpu_fast.h's
// attention_forward_paged, which reads the keys and values in place.
void attention_forward_paged_naive(float* out, float* scratch_att, const float* qkv, const float* kv, long block_stride,
                                   const int* tables, int max_blocks, const int* pos, int N, int T, int bs, int C,
                                   int NH) {
    size_t C3 = 3 * (size_t)C;
    int hs = C / NH;
    float* seq = scratch(SCRATCH_ATT_PACK, sizeof(float) * (size_t)T * C3);
    for (int r = 0; r < N; r++) {
        const int* table = tables + (size_t)r * max_blocks;
        int t = pos[r];
        for (int p = 0; p <= t; p++) {
            memcpy(seq + p * C3 + C, kv + paged_kv_slot(table, block_stride, p, bs, C), sizeof(float) * 2 * C);
        }
        memcpy(seq + t * C3, qkv + r * C3, sizeof(float) * C);
        for (int h = 0; h < NH; h++) {
            attention_query_row(out + (size_t)r * C + h * hs, scratch_att + ((size_t)r * NH + h) * T, seq, t, T, C, NH, h);
        }
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

// dst rows (stride ldd) <- width floats of each of `rows` src rows (stride lds): a tensor's
// columns packed for sending, or unpacked into place
void copy_rows(float* dst, long ldd, const float* src, long lds, long rows, int width) {
    #pragma omp parallel for
    for (long i = 0; i < rows; i++) { memcpy(dst + i * ldd, src + i * lds, sizeof(float) * width); }
}

// ------------------------------------------------------------------------------------------
// out = a + b, elementwise (the residual stream)
void residual_forward(float* out, const float* a, const float* b, size_t n) {
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) { out[i] = a[i] + b[i]; }
}

// out (BT,OC) += bias: a row-parallel layer's bias, added once after its all-reduce (the same
// addition matmul_forward does after its tree when it holds all of ic).
void bias_forward(float* out, const float* bias, int BT, int OC) {
    #pragma omp parallel for
    for (int i = 0; i < BT; i++) {
        float* o = out + (size_t)i * OC;
        for (int c = 0; c < OC; c++) { o[c] = o[c] + bias[c]; }
    }
}

// R3 sum of per-position values x (B,T): the loss sum of a microbatch.
float position_sum(const float* x, int B, int T) {
    return position_reduce_elem(x, 1, 0, NULL, 0, 0, B, T, 1, 0);
}

// ------------------------------------------------------------------------------------------
// GELU (gelu_forward, gelu_backward: canon_gelu and canon_gelu_grad of every element) and the
// fused softmax + cross-entropy (crossentropy_*) are written once, vectorised: cpu_fast.h.

// ------------------------------------------------------------------------------------------
// the mixture-of-experts layer: its per-output arithmetic is moe.h's (the CPU kernels and the
// device twins call the same functions), its kernels' loops are in cpu_fast.h, beside the
// experts' weight-gradient tiles, whose specification this is.
// One expert's weight and bias gradients from its rows: for each of nsrc source microbatches
// q (leaves leaf[q*B*8 .. (q+1)*B*8], absolute rows of dout (.,OC) and inp (.,IC)), the R3
// reduction over the source's rows into slice q: dweight + q*slice (OC,IC) and dbias + q*slice
// (OC) (either may be NULL). The specification, one output at a time (cpu_fast.h's
// moe_expert_dweight computes exactly these bits):
void moe_expert_dweight_naive(float* dweight, float* dbias, size_t slice, const float* dout, const float* inp,
                              const int* leaf, int nsrc, int B, int IC, int OC) {
    #pragma omp parallel for collapse(2)
    for (int q = 0; q < nsrc; q++) {
        for (int o = 0; o < OC; o++) {
            const int* lq = leaf + (size_t)q * B * CANON_R;
            for (int ic = 0; dweight && ic < IC; ic++) {
                dweight[q * slice + (size_t)o * IC + ic] = moe_rows_reduce_elem(dout, OC, o, inp, IC, ic, lq, B);
            }
            if (dbias) { dbias[q * slice + o] = moe_rows_reduce_elem(dout, OC, o, NULL, 0, 0, lq, B); }
        }
    }
}

#endif // LLMC_DEVICE_KERNELS

// ==========================================================================================
// The model
// ==========================================================================================
//
// Written once, on the kernels above: the CUDA build's deterministic mode (train_gpt2.cu)
// compiles this same section on its device kernels, which take the same arguments. So the
// model never touches tensor memory itself: it allocates and fills through the MemOps of
// memory.h (host here, device there), and its parameters come unit by unit from zero.h.

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
    X(owner, float, ret, slots * C)            /* (B*T*k,C)  each slot's expert output, back at the source */          \
    X(owner, float, dlogits, S * BT * num_experts) /* (B,T,E) split backward: the router's output gradient */
#define MOE_LAYER_ROWS(X, owner)                                                                                       \
    X(owner, float, xin, C)                    /* (rows,C)   the rows the local experts received, by expert */         \
    X(owner, float, fch, C4)                   /* (rows,4C/tp) */                                                      \
    X(owner, float, fch_gelu, recompute ? 0 : C4) /* (rows,4C/tp) (recomputed in backward with -r 1) */                \
    X(owner, int, perm, 1)                     /* (rows)     work row <- received row (expert parallelism) */          \
    X(owner, int, inv, 1)                      /* (rows)     received row <- work row */                               \
    X(owner, float, dy, split ? C : 0)         /* (rows,C)   split backward: the experts' output gradients */          \
    X(owner, float, dh, split ? C4 : 0)        /* (rows,4C/tp) ... and fc's output gradients (before GELU) */
#define DECLARE(owner, type, name, count) type* name;

typedef struct {
    MoeRoute route;     // the routing plan (host)
    MOE_ROUTING(DECLARE, _)
    MOE_LAYER_ROWS(DECLARE, _)
    size_t rows_cap;    // rows xin .. inv hold
    float aux;          // the load-balancing loss of the last pass
} MoeLayerActs;

typedef struct {
    int layers, cap_B, cap_T, recompute;
    ZzPass pass;        // how the pass is split, and this rank's slices (zigzag.h)
    int by_length;      // SEQS_SPLIT_BY_LENGTH: each pass picks its split from its length (pass_split)
    int C3, Ca, NHl, C4, Vl;   // local widths: qkv, atty, heads, fch, vocabulary
    int Co;             // the attention output's columns the output projection reads: Ca, but in
                        // Helix's serving layout (GPT2.tp_ffn) C / its size
    int* inputs;        // (B,T)     the pass's tokens
    int* inputs_full;   // (B,T*cp_split) every position's tokens (context parallelism: the
                        //           embedding's gradient runs on whole sequences)
    int* targets;       // (B,T)     ... and the next tokens (the loss): target_buf, or NULL: none
    int* target_buf;
    ACTIVATION_TENSORS(DECLARE, _)
    int split_backward;
    KEPT_GRADIENTS(DECLARE, _)
    MoeLayerActs* moe;  // (L)        mixture of experts: each layer's routing and experts
    float* moe_whole;   // (B,T*cp_split,2C+E) mixture of experts with CP: a layer's input and
                        //           output (or their gradients) on whole sequences, and the
                        //           router's output gradient of this rank's positions
    // The attention step of layers_forward, when set: attend(ctx, l, qkv, atty, Ca, NHl) for
    // chunk layer l on the pass's rows, in place of the trainer's attention over (B,T) rows (the
    // serving engine's, serve_engine.h: rows of different requests against a paged KV cache)
    void (*attend)(void* ctx, int l, const float* qkv, float* atty, int C, int NH);
    void* attend_ctx;
    size_t bytes;
} Activations;

// Gradients of activations during backward: one set, reused by every layer. dfcproj .. dln1
// are one layer's gradients at the output of its weights (Activations' kept set, for a
// backward that is not split). Counts in activation_grads_alloc's terms (BTC this rank's
// positions x C; emb, sp, moe 1 or 0).
#define ACTIVATION_GRADS(X, owner)                                                                                     \
    X(owner, float, dresidual, BTC)            /* (B,T,C)  d(residual stream); (B,T/tp,C) under SP */                  \
    X(owner, float, dwhole, cp_whole * whole)  /* (B,T*cp_split,C) the embedding's, gathered along T */              \
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
    X(owner, float, drouter, moe * whole)      /* (B,T,C)  the router's input gradient (CP: whole sequences) */        \
    X(owner, float, daux, moe * num_experts)   /* (E)      the load-balancing loss's gradient per position */          \
    X(owner, float, dslots, moe * slots * C)   /* (B,T*k,C) the slots' output, then input, gradients */
#define MOE_GRAD_ROWS(X, owner)                                                                                        \
    X(owner, float, dwork, C)                  /* (rows,C) at the experts: output, then input, gradients */            \
    X(owner, float, dwork2, C)                 /* (rows,C) ... in the other order (expert parallelism) */              \
    X(owner, float, dh, C4)                    /* (rows,4C/tp) */                                                      \
    X(owner, float, hgelu, C4)                 /* (rows,4C/tp) GELU recomputed (-r 1) */

typedef struct {
    ZzPass pass;   // as in Activations
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

#define CP_GROUP_LEVELS 4   // context-parallel groups of 1, 2, 4 or 8 ranks (a sequence splits at most CANON_R ways)

typedef struct {
    GPT2Config config;
    int first_layer, last_layer; // this model chunk's layers [first, last) (a pipeline stage's,
                                // or one of its virtual stages')
    int has_embedding, has_head; // the embeddings; the final layernorm + LM head
    CommGroup* tp;              // tensor-parallel group (tensor_parallel.h)
    int tp_size, v0, Vl;        // ... its size, and this rank's vocabulary rows [v0, v0 + Vl) of wte
    CommGroup* tp_ffn;          // the group the attention output projection and the MLP are cut
                                // over: tp, but in Helix's serving layout all K x P ranks of the
                                // pool (gpt2_set_ffn_groups; forward only)
    CommGroup* tp_exp;          // ... and each expert's fc and fcproj: tp_ffn, but with Helix's
                                // FFN as TP x EP the pool's ranks that hold the same experts
    int seq_parallel;           // sequence parallelism in the passes that split sequences
    ContextParallel* cp;        // context parallelism of the passes (context_parallel.h): one of cp_groups
    int cp_size;                // ... its ranks
    ContextParallel cp_groups[CP_GROUP_LEVELS]; // by log2 of a group's size: create's group, and
                                // FlexSP's pool sub-groups (model_cp_select)
    int cp_len[CP_GROUP_LEVELS];// ... the longest sequence a pass over each holds (FlexSP: what
                                // its ranks' memory holds together; else the passes' T)
    int cp_a2a, cap_B, cap_T;   // ... their attention (all-to-all, else the ring), the passes' capacity
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
    float* ep_rows;             // serving (gpt2_split_expert_rows): (ep x share, C) the expert
                                // layers' outputs of every ep rank's share of the rows, or NULL
    // the sampler's packed weight copies (CPU build, forward_matmul): of the layers, of wte;
    // `decoding` is the one a decode step in progress reads (NULL: none)
    struct DecodeWeights *decode_layers, *decode_head, *decoding;
} GPT2;

// Every matmul of the forward. A decode step of the sampler multiplies one row by every
// weight, bound by reading them: on the CPU it reads packed copies (llmc/decode_matmul.h),
// made on first use in a generation and found by the weight's address, with matmul_forward's
// bits. Under ZeRO-3 the gathered units share buffers, so the row-major weights stay.
static void forward_matmul(GPT2* model, float* out, const float* inp, const float* weight, const float* bias, int rows,
                           int IC, int OC, int nchunks) {
#ifndef LLMC_DEVICE_KERNELS
    if (model->decoding) {
        decode_matmul(model->decoding, out, inp, weight, bias, rows, IC, OC, nchunks);
        return;
    }
#endif
    matmul_forward(out, inp, weight, bias, rows, IC, OC, nchunks);
}

// A decode step at position t reads the copies in *copies; the weights change between
// generations, so position 0 (every generation's first) makes them anew.
static void decode_copies_begin(GPT2* model, struct DecodeWeights** copies, int t) {
#ifndef LLMC_DEVICE_KERNELS
    if (model->zero->stage == 3) { return; }
    if (!*copies) { *copies = (DecodeWeights*)calloc_or_die(1, sizeof(DecodeWeights), "decode weights"); }
    if (t == 0) { decode_weights_free(*copies); }
    model->decoding = *copies;
#else
    (void)model, (void)copies, (void)t;
#endif
}

static void decode_copies_free(GPT2* model) {
#ifndef LLMC_DEVICE_KERNELS
    struct DecodeWeights* all[] = {model->decode_layers, model->decode_head};
    for (int i = 0; i < 2; i++) {
        if (all[i]) { decode_weights_free(all[i]); }
        free(all[i]);
    }
#else
    (void)model;
#endif
}

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
    int C4 = a->C4, recompute = a->recompute, split = a->split_backward;
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

// The ranks that split the sequences of passes laid out as split_seqs (SeqSplit; SEQS_WHOLE:
// none), and this rank's place among them.
static ZzGroup model_split_group(const GPT2* model, int split_seqs) {
    ZzGroup g = {split_seqs ? model->cp_size : 1, split_seqs && model->seq_parallel ? model->tp_size : 1,
                 model->cp->rank, model->tp->rank};
    return g;
}

// The positions of each sequence a pass of split_seqs (SeqSplit) over up to T positions holds
// on this rank at most: all T unsplit, T/cp split over the cp group (with SP the residual
// stream a tp-th of that), and by length the largest slice of any length a group runs, or of
// a sequence too short to split (zz_max_len), over any of the groups the model's passes may
// run on: the cp group's sequences up to T; FlexSP's, each group's up to what its ranks hold
// together (cp_len: about --flexsp-tokens on each rank, a group of one among them).
static int pass_capacity(const GPT2* model, int T, int split_seqs) {
    if (split_seqs != SEQS_SPLIT_BY_LENGTH) { return T / (split_seqs ? model->cp_size : 1); }
    int most = 0;
    for (int k = 0; k < CP_GROUP_LEVELS; k++) {
        int longest = model->cp_len[k] < T ? model->cp_len[k] : T;
        int len = model->cp_groups[k].group ? zz_max_len(longest, 1 << k) : 0;
        most = len > most ? len : most;
    }
    return most;
}

// split_seqs (model_ops.h SeqSplit): SEQS_SPLIT, the sequences are split as the model's layout
// says (context parallelism over its cp group, and with seq_parallel the residual stream over
// the tensor-parallel group: Megatron's sequence parallelism); SEQS_WHOLE: every position on
// every rank (the sampler's passes); SEQS_SPLIT_BY_LENGTH (--varlen with CP or SP): each pass is
// split or whole by its length (pass_split), in memory for the most positions a rank holds of
// any length up to T (pass_capacity).
// split_backward: room for a split backward's kept gradients.
void activations_alloc(Activations* a, const GPT2* model, int B, int T, int recompute, int split_seqs,
                       int split_backward) {
    const GPT2Config* c = &model->config;
    int tp = model->tp_size, cp = split_seqs ? model->cp_size : 1, sp = split_seqs && model->seq_parallel;
    int by_length = split_seqs == SEQS_SPLIT_BY_LENGTH && (cp > 1 || sp);
    size_t L = model->last_layer - model->first_layer, C = c->channels, Tq = pass_capacity(model, T, split_seqs);
    size_t BT = (size_t)B * Tq, BTs = BT / (sp && !by_length ? tp : 1);   // positions of the sequence-split tensors
    size_t H = model->has_head ? 1 : 0, S = split_backward ? 1 : 0, emb = model->has_embedding ? 1 : 0;
    size_t dense = model->num_experts > 0 ? 0 : 1, a2a = cp > 1 && model->cp->a2a;
    size_t gelus = dense * (recompute ? 1 : L);   // fch_gelu: one layer's, reused by all, with recompute
    memset(a, 0, sizeof(*a));
    a->layers = (int)L;
    a->cap_B = B;
    a->cap_T = T;
    a->recompute = recompute;
    a->by_length = by_length;
    a->pass = zz_pass(model_split_group(model, split_seqs), T, 0);
    size_t C3 = a->C3 = 3 * c->channels / tp, Ca = a->Ca = c->channels / tp, NHl = a->NHl = c->num_heads / tp;
    size_t C4 = a->C4 = 4 * c->channels / (model->num_experts > 0 ? model->tp_exp : model->tp_ffn)->size;
    size_t Vl = a->Vl = c->padded_vocab_size / tp;
    a->Co = c->channels / model->tp_ffn->size;
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
        BT = (size_t)B * T;   // with CP every rank routes whole sequences (moe_forward)
        if (cp > 1) {
            a->moe_whole = mem_floats(model->mem, BT * (2 * C + num_experts), "expert activations (whole sequences)");
            a->bytes += BT * (2 * C + num_experts) * sizeof(float);
        }
        size_t slots = BT * model->top_k, rows = slots;
        size_t leaves = (size_t)model->El * ((size_t)ep_size * B * CANON_R + 1);
        a->moe = (MoeLayerActs*)calloc_or_die(L ? L : 1, sizeof(MoeLayerActs), "expert activations");
        for (size_t l = 0; l < L; l++) {
            MoeLayerActs* moe_act = &a->moe[l];
            moe_route_init(&moe_act->route, (int)BT, model->top_k, num_experts, ep_size, B);
            MOE_ROUTING(ALLOC, moe_act)
            moe_acts_rows(model, a, moe_act, rows);
            a->bytes += rows * ((1 + S) * C + (recompute ? 1 : 2) * C4 + S * C4) * sizeof(float) + 2 * rows * sizeof(int);
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
    if (a->moe_whole) { model->mem->release(a->moe_whole); }
    memset(a, 0, sizeof(*a));
}

// Activations laid out by length (--varlen with CP or SP): a pass over sequences of T
// positions is split as zz_split_length says (over the cp group, in R2Z's unequal pieces if
// need be, and with SP over the tensor-parallel group too when the stretches are equal) or
// whole on every rank (context_parallel.h, VARIABLE LENGTHS); g, the backward's gradients,
// follows the pass. Every entry point of a pass calls it before reading the split.
static void pass_split(const GPT2* model, Activations* a, ActivationGrads* g, int T) {
    if (!a->by_length) { return; }
    int k = flexsp_log2(model->cp_size);
    if (T > model->cp_len[k]) {   // the buffers and activations hold no more (model_cp_select)
        fatal("internal: a pass of %d positions over a context-parallel group of %d made for %d", T, model->cp_size,
              model->cp_len[k]);
    }
    a->pass = zz_pass(model_split_group(model, SEQS_SPLIT_BY_LENGTH), T, 1);
    if (g) { g->pass = a->pass; }
}

// The positions of each sequence of T a pass holds: this rank's slice of the context split
// (the per-position tensors), and of the sequence split (the residual stream); x an
// Activations or ActivationGrads.
#define CP_LEN(x, T) ((int)canon_zz_len((T), (x)->pass.cp_split, (x)->pass.cp_rank))
#define SEQ_LEN(x, T) ((int)canon_zz_len((T), (x)->pass.seq_split, (x)->pass.seq_rank))

// A pass that every rank of a context-parallel group computes whole (--varlen, a length the
// group does not split): each rank hands ZeRO its part of every gradient (cp_keep_part).
static int whole_in_group(const GPT2* model, const Activations* a) {
    return a->by_length && model->cp_size > 1 && a->pass.cp_split == 1;
}

// The pass's tokens (B sequences of T), from host memory; targets NULL: the pass computes no
// loss. With context parallelism the rank keeps its slice of each sequence (and all of the
// inputs, for the embedding's gradient).
void activations_set_tokens(const GPT2* model, Activations* a, const int* inputs, const int* targets,
                            int B, int T) {
    pass_split(model, a, NULL, T);
    int cp = a->pass.cp_split, Tl = CP_LEN(a, T);
    size_t bytes = (size_t)B * Tl * sizeof(int);
    a->targets = targets ? a->target_buf : NULL;
    if (cp == 1) {
        model->mem->from_host(a->inputs, inputs, bytes);
        if (targets) { model->mem->from_host(a->target_buf, targets, bytes); }
        // a whole pass of a context-parallel model: the embedding's gradient reads inputs_full
        if (a->inputs_full != a->inputs) { model->mem->from_host(a->inputs_full, inputs, bytes); }
        return;
    }
    model->mem->from_host(a->inputs_full, inputs, (size_t)B * T * sizeof(int));
    int* slice = (int*)malloc_or_die(2 * bytes, "token slices");
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < Tl; t++) {
            long pos = (long)b * T + canon_zz_global(t, T, cp, a->pass.cp_rank);
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
    size_t C = model->config.channels, BTC = (size_t)B * pass_capacity(model, T, split_seqs) * C;
    size_t num_experts = model->num_experts, whole = (size_t)B * T * C;   // whole: (B,T,C), gathered along T
    size_t moe = num_experts > 0, dense = !moe, slots = (size_t)B * T * model->top_k;
    size_t cp_whole = cp > 1 && model->has_embedding, per_seq = sp || cp > 1;
    memset(g, 0, sizeof(*g));
    g->pass = zz_pass(model_split_group(model, split_seqs), T, 0);
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
    size_t C = c->channels, BT = (size_t)B * CP_LEN(a, T), BTs = (size_t)B * SEQ_LEN(a, T), r0 = t0;
    LayerActs v;
    v.residual = (l == 0 ? a->encoded : a->residual3 + (l - 1) * BTs * C) + r0 * C;
    v.ln1 = a->ln1 + (l * BT + r0) * C;
    v.ln1_mean = a->ln1_mean + l * BTs + r0;
    v.ln1_rstd = a->ln1_rstd + l * BTs + r0;
    v.qkv = a->qkv + (l * BT + r0) * a->C3;
    v.atty = a->atty + (l * BT + r0) * a->Ca;
    // att a layer: (B,NH,Tl,T) this rank's queries, or with the all-to-all (B,NH/cp,T,T) its heads
    int a2a = a->qkvh && a->pass.cp_split > 1;
    size_t layer_att = a2a ? (size_t)B * (a->NHl / a->pass.cp_split) * T * T : (size_t)B * a->NHl * CP_LEN(a, T) * T;
    v.att = a->att + l * layer_att;
    v.qkvh = a->qkvh ? a->qkvh + l * (size_t)B * T * (a->C3 / a->pass.cp_split) : NULL;   // (B,T,3C/cp) a layer
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
    size_t C = c->channels, BT = (size_t)B * CP_LEN(a, T), BTs = (size_t)B * SEQ_LEN(a, T);
    LayerOutGrads d = {a->dfcproj + l * BT * C, a->dfch + l * BT * a->C4, a->dln2 + l * BTs * C,
                       a->dattproj + l * BT * C, a->dqkv + l * BT * a->C3, a->dln1 + l * BTs * C};
    return d;
}

// The output of the stage's layers (B,T,C), or its sequence slice: what the next stage, or
// the head, receives.
static float* stage_output(const Activations* a, const GPT2Config* c, int B, int T) {
    size_t BTs = (size_t)B * SEQ_LEN(a, T);
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
// holds this rank's slice of each sequence, Tl = CP_LEN(a, T) positions (T/cp_split, or with
// --varlen R2Z's unequal pieces: canon_zz_len; T: the whole sequence, as the engine passes it): everything is per position except attention (context_parallel.h's
// ring or all-to-all) and the reductions over positions, whose per-sequence subtrees the group
// finishes (cp_finish_sequences), or which run on whole sequences gathered along T (the
// embedding's gradient, the loss).
//
// A forward computes the rows [t0, t1) of each of its B sequences of T positions: a whole pass
// 0, T; the sampler's KV-cache step one new position t, t + 1, of a pass of one sequence
// (B = 1, never split over ranks) whose rows before t the earlier steps computed. Every
// reduction over positions is laid out by T (R2Z chunks of T), so such a row equals that row
// of the whole pass, bit for bit, whatever the rows after it hold (test_gpt2 checks). Of the
// rows, this rank computes pass_rows(.., cp_split, cp_rank) of the per-position tensors and
// pass_rows(.., seq_split, seq_rank) of the sequence-split ones, from row t0 of each (a split
// pass is a whole one, t0 = 0).
static size_t pass_rows(int B, int t0, int t1, int D, int r) { return (size_t)B * canon_zz_len(t1 - t0, D, r); }

// out (B,Tl,C) += wpe at the global positions of rank r's D-way zig-zag slice (zigzag.h):
// its two stretches per sequence
static void add_zigzag_positions(float* out, const float* wpe, int B, int T, int C, int D, int r) {
    long Tl = canon_zz_len(T, D, r), at = 0;
    for (int half = 0; half < 2; half++) {
        long begin, end;
        canon_zz_stretch(T, D, r, half, &begin, &end);
        for (int b = 0; b < B; b++) {
            encoder_add_positions(out + ((size_t)b * Tl + at) * C, wpe + begin * C, 1, (int)(end - begin), C);
        }
        at += end - begin;
    }
}

// (the chunk with the embeddings) encoded (B,T,C) = wte[inputs] + wpe (with SP and CP: this
// rank's positions)
void embed_forward(GPT2* model, Activations* a, int B, int T, int t0, int t1) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    int C = c->channels, sp = a->pass.seq_split > a->pass.cp_split;
    size_t r0 = (size_t)t0, rows = pass_rows(B, t0, t1, a->pass.cp_split, a->pass.cp_rank);
    const float* wte = zero_params_acquire(z, ZERO_WTE, ZERO_WPE);
    float* lookup = sp ? a->proj : a->encoded + r0 * C;
    encoder_lookup(lookup, a->inputs + r0, wte, model->v0, model->Vl, (int)rows, C);
    zero_params_release(z, ZERO_WTE);
    // the vocab-parallel lookup summed over the tp group (each row came from the rank holding
    // its token): all-reduce, or with SP reduce-scatter along T
    if (sp) {
        tp_sp_reduce_scatter(model->tp, lookup, a->encoded, B, CP_LEN(a, T), C, model->sp_scratch);
    } else {
        tp_vocab_embedding_reduce(model->tp, lookup, rows * C);
    }
    const float* wpe = zero_params_acquire(z, ZERO_WPE, ZERO_LAYER(model->first_layer));
    if (a->pass.seq_split == 1) {
        encoder_add_positions(a->encoded + r0 * C, wpe + r0 * C, B, t1 - t0, C);
    } else {   // this rank's positions: the slice of its context-parallel rank, and of that its
               // tensor-parallel rank's with SP (a slice of a slice is a slice, zigzag.h)
        add_zigzag_positions(a->encoded, wpe, B, T, C, a->pass.seq_split, a->pass.seq_rank);
    }
    zero_params_release(z, ZERO_WPE);
}

// A layernorm before a column-parallel layer over B sequences of Tn rows: ln (B,Tn,C) =
// LN(inp); with SP, inp holds this rank's positions and the output is all-gathered along T
// (Megatron's f).
static void ln_forward_f(GPT2* model, Activations* a, float* ln, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, int B, int Tn) {
    int C = model->config.channels, Tl = CP_LEN(a, Tn);
    if (a->pass.seq_split > a->pass.cp_split) {
        layernorm_forward(a->ln_s, mean, rstd, inp, weight, bias, B * SEQ_LEN(a, Tn), C);
        tp_sp_all_gather(model->tp, a->ln_s, ln, B, Tl, C, model->sp_scratch);
    } else {
        layernorm_forward(ln, mean, rstd, inp, weight, bias, B * Tl, C);
        tp_f_forward(model->tp, ln, (size_t)B * Tl * C);
    }
}

// After a row-parallel layer: the partial outputs a->proj (B,Tn,C) summed over the group it is
// cut over (tp_ffn: the tp group but in Helix's serving layout; Megatron's g: all-reduce, or
// with SP reduce-scatter along T), then its bias; returns the result (with SP, this rank's
// positions).
static float* proj_g_bias(GPT2* model, Activations* a, const float* bias, int B, int Tn) {
    int C = model->config.channels, Tl = CP_LEN(a, Tn);
    float* out = a->proj;
    if (a->pass.seq_split > a->pass.cp_split) {
        tp_sp_reduce_scatter(model->tp_ffn, a->proj, a->proj_s, B, Tl, C, model->sp_scratch);
        out = a->proj_s;
    } else {
        tp_g_forward(model->tp_ffn, a->proj, (size_t)B * Tl * C);
    }
    bias_forward(out, bias, B * SEQ_LEN(a, Tn), C);
    return out;
}

// A mixture-of-experts layer (llmc/moe.h THE LAYER) in place of layer l's MLP: out (B,T,C)
// from ln (B,T,C), complete on every tensor-parallel rank. The router and the combine run here
// on this rank's positions; the slots go to their experts' ranks and back (expert_parallel.h;
// one rank: the dispatch rows are already the experts' rows). `next`: the unit ZeRO-3
// prefetches after the experts. With context parallelism (out, ln this rank's slice of each
// sequence) every rank of the cp group runs the layer on whole sequences, the one-rank
// routing and arithmetic, and keeps its slice of the output: the experts' gradients are then
// the one-rank bits on every rank of the group (moe_weight_backward hands ZeRO a part each).
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
    float* out_slice = out;
    if (a->pass.cp_split > 1) {   // all-gather (cp group) of ln along T
        cp_gather_sequences(model->cp, ln, a->moe_whole, B, T, C);
        ln = a->moe_whole;
        out = a->moe_whole + (size_t)BT * C;
    }
    // the router: probabilities, the top_k chosen experts and their gates per position (a
    // serving rank's share of a step may be no rows: it still takes part in the all-to-alls)
    if (BT > 0) {
        forward_matmul(model, moe_act->probs, ln, w->routerw, NULL, BT, C, num_experts, CANON_R);
        moe_router_forward(moe_act->probs, moe_act->chosen, moe_act->gates, moe_act->probs, BT, num_experts, top_k);
    }
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
        forward_matmul(model, moe_act->fch + (size_t)r0 * C4, moe_act->xin + (size_t)r0 * C, ex.fcw + e * ex.fcw_n,
                       ex.fcb + e * ex.fcb_n, n, C, C4, CANON_R);
        gelu_forward(gelu_out + (size_t)r0 * C4, moe_act->fch + (size_t)r0 * C4, (size_t)n * C4);
        forward_matmul(model, y + (size_t)r0 * C, gelu_out + (size_t)r0 * C4, ex.fcprojw + e * ex.fcprojw_n, NULL, n, C4, C,
                       CANON_R / model->tp_exp->size);
    }
    // g (the tp_exp group: tp's but in Helix's serving layout): each expert's row-parallel
    // partial outputs y (rows, C), all-reduced per row, then its bias
    tp_g_forward(model->tp_exp, y, (size_t)route->n_recv * C);
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
    if (a->pass.cp_split > 1) { zz_copy_slice(mem, out, out_slice, B, T, C, a->pass.cp_split, a->pass.cp_rank, 1); }
    // the load-balancing loss of this layer and microbatch (none over no rows: moe_aux_loss
    // divides by BT)
    moe_act->aux = 0.0f;
    if (BT > 0) {
        moe_expert_prob_sums(model->psum, moe_act->probs, B, T, num_experts);
        mem->to_host(model->psum_host, model->psum, (size_t)num_experts * sizeof(float));
        moe_act->aux = moe_aux_loss(route->count, model->psum_host, num_experts, top_k, BT, c->aux_loss_coef);
    }
    MoeCounters* counters = &model->counters;
    for (int e = 0; model->cp->rank == 0 && e < num_experts; e++) {   // a sequence's routing counted once in its group
        counters->tokens[(size_t)(l - model->first_layer) * num_experts + e] += route->count[e];
    }
    long long out_rows, in_rows;
    moe_route_remote_rows(route, model->ep->rank, &out_rows, &in_rows);
    counters->passes++;
    counters->rows_out += out_rows;
    counters->rows_in += in_rows;
}

// A mixture-of-experts layer of layers_forward: out (B,T,C) from ln. In serving across ep
// ranks (GPT2.ep_rows: every rank of the ep group holds the step's rows alike, attention
// replicated over it) each ep rank runs the layer on its share of the rows, ceil(BT/Q)
// consecutive ones as one sequence, so that every routed row reaches its expert once, not once
// from each ep rank; then the shares' outputs are all-gathered (Megatron's dispatch under
// sequence parallelism). The same bits: a row's routing and its experts' arithmetic are its
// own (moe.h), whichever rank computes it.
static void moe_forward_layer(GPT2* model, Activations* a, int l, const LayerTensors* w, const float* ln, float* out,
                              int next, int B, int T) {
    if (!model->ep_rows) {
        moe_forward(model, a, l, w, ln, out, next, B, T);
        return;
    }
    int Q = model->ep_size, q = model->ep->rank, C = model->config.channels, BT = B * T;
    int share = (BT + Q - 1) / Q, r0 = q * share < BT ? q * share : BT, n = BT - r0 < share ? BT - r0 : share;
    moe_forward(model, a, l, w, ln + (size_t)r0 * C, model->ep_rows + (size_t)q * share * C, next, 1, n);
    moe_gather_row_shares(model->ep, model->ep_rows, (size_t)share, C);   // the Q shares' output rows, in order
    model->mem->copy(out, model->ep_rows, sizeof(float) * (size_t)BT * C);
}

// Attention of this rank's heads (and with CP its queries) for the rows [t0, t1) of layer l
// (chunk-relative): qkv -> atty, att. A whole pass runs the fast kernels; rows of a KV-cache
// step, each against the keys and values of the rows before it, the per-row kernel; a pass
// with an attention step of its own (a->attend: serving), that step.
static void attention_forward_rows(GPT2* model, Activations* a, int l, int B, int T, int t0, int t1) {
    LayerActs act = layer_acts(a, &model->config, l, B, T, 0);
    if (a->attend) {
        a->attend(a->attend_ctx, l, act.qkv, act.atty, a->Ca, a->NHl);
    } else if (t1 - t0 < T) {
        for (int t = t0; t < t1; t++) { attention_forward_row(act.atty, act.att, act.qkv, t, T, a->Ca, a->NHl); }
    } else if (a->pass.cp_split == 1) {
        attention_forward(act.atty, act.att, act.qkv, B, T, a->Ca, a->NHl);
    } else if (model->cp->a2a) {
        cp_a2a_forward(model->cp, act.atty, act.att, act.qkvh, act.qkv, B, T, a->Ca, a->NHl);
    } else {
        cp_ring_forward(model->cp, act.atty, act.att, act.qkv, B, T, a->Ca, a->NHl);
    }
}

// this chunk's layers on the rows [t0, t1): a->encoded (B,T,C) -> stage_output. Megatron's
// partitioning: qkv and fc are column-parallel (f before them), attproj and fcproj
// row-parallel (g after them, then the bias); attention runs on this rank's heads.
void layers_forward(GPT2* model, Activations* a, int B, int T, int t0, int t1) {
    const GPT2Config* c = &model->config;
    Zero* z = model->zero;
    pass_split(model, a, NULL, T);   // a stage without the embeddings gets no set_tokens
    int C = c->channels, Tn = t1 - t0, ffn_size = model->tp_ffn->size, moe = model->num_experts > 0;
    int rows = (int)pass_rows(B, t0, t1, a->pass.cp_split, a->pass.cp_rank);
    size_t rows_s = pass_rows(B, t0, t1, a->pass.seq_split, a->pass.seq_rank);
    for (int l = model->first_layer; l < model->last_layer; l++) {
        int next = l + 1 < model->last_layer ? ZERO_LAYER(l + 1) : model->has_head ? z->lay.num_units - 1 : -1;
        LayerTensors w = layer_unit(z, ZERO_LAYER(l), zero_params_acquire(z, ZERO_LAYER(l), moe ? zero_expert_unit(z, l) : next));
        LayerActs act = layer_acts(a, c, l - model->first_layer, B, T, t0);
        ln_forward_f(model, a, act.ln1, act.ln1_mean, act.ln1_rstd, act.residual, w.ln1w, w.ln1b, B, Tn);
        forward_matmul(model, act.qkv, act.ln1, w.qkvw, w.qkvb, rows, C, a->C3, CANON_R);
        attention_forward_rows(model, a, l - model->first_layer, B, T, t0, t1);
        forward_matmul(model, a->proj, act.atty, w.attprojw, NULL, rows, a->Co, C, CANON_R / ffn_size);
        residual_forward(act.residual2, act.residual, proj_g_bias(model, a, w.attprojb, B, Tn), rows_s * C);
        ln_forward_f(model, a, act.ln2, act.ln2_mean, act.ln2_rstd, act.residual2, w.ln2w, w.ln2b, B, Tn);
        if (moe) {   // complete on every tp rank: with SP this rank keeps its positions (no CP)
            int sp = a->pass.seq_split > a->pass.cp_split;
            moe_forward_layer(model, a, l, &w, act.ln2, a->proj, next, B, Tn);
            if (sp) { tp_sp_take_slice(model->tp, a->proj, a->proj_s, B, Tn, C); }
            residual_forward(act.residual3, act.residual2, sp ? a->proj_s : a->proj, rows_s * C);
        } else {
            forward_matmul(model, act.fch, act.ln2, w.fcw, w.fcb, rows, C, a->C4, CANON_R);
            gelu_forward(act.fch_gelu, act.fch, (size_t)rows * a->C4);
            forward_matmul(model, a->proj, act.fch_gelu, w.fcprojw, NULL, rows, a->C4, C, CANON_R / ffn_size);
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
    int rows = (int)pass_rows(B, t0, t1, a->pass.cp_split, a->pass.cp_rank);
    const float* lnf = zero_params_acquire(z, LNF, ZERO_WTE);
    ln_forward_f(model, a, a->lnf + r0 * C, a->lnf_mean + r0, a->lnf_rstd + r0, stage_output(a, c, B, T) + r0 * C,
                 lnf, lnf + C, B, t1 - t0);
    const float* wte = zero_params_acquire(z, ZERO_WTE, -1);
    float* logits = a->probs + r0 * Vl;
    forward_matmul(model, logits, a->lnf + r0 * C, wte, NULL, rows, C, Vl, CANON_R);
    float *maxes = a->ce, *zs = a->ce + rows, *target_logits = a->ce + 2 * rows;
    const int* targets = a->targets ? a->targets + r0 : NULL;
    crossentropy_max(maxes, logits, rows, V, v0, Vl);
    tp_vocab_ce_max(model->tp, maxes, (size_t)rows);
    crossentropy_exps(zs, target_logits, logits, maxes, targets, rows, V, v0, Vl, CANON_R / model->tp_size);
    tp_vocab_ce_sums(model->tp, zs, (size_t)rows);   // zs, then target_logits
    float* losses = a->pass.cp_split > 1 ? a->ce + 3 * rows : a->losses + r0;
    crossentropy_normalize(logits, losses, zs, target_logits, maxes, targets, rows, V, v0, Vl);
    // all-gather (cp group): every position's loss, in sequence order
    if (a->pass.cp_split > 1 && targets) { cp_gather_sequences(model->cp, losses, a->losses, B, T, 1); }
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
void layers_decode(GPT2* model, Activations* a, int t, int T) {
    decode_copies_begin(model, &model->decode_layers, t);
    layers_forward(model, a, 1, T, t, t + 1);
    model->decoding = NULL;
}
void head_decode(GPT2* model, Activations* a, int t, int T) {
    decode_copies_begin(model, &model->decode_head, t);
    head_forward(model, a, 1, T, t, t + 1, 0);
    model->decoding = NULL;
}


// Backward of a layernorm that feeds a column-parallel layer, in two halves. Input half: the
// gradient of its full output dln (B,T,C) as this rank computed it (its slice of the layer's
// outputs) is summed over the tp group into dln_sum (Megatron's f backward: all-reduce, in
// place when dln_sum == dln; with SP a reduce-scatter along T), then dres += the layernorm's
// input gradient. complete: dln is already the whole sum on every rank (a mixture-of-experts
// layer's): no sum, with SP this rank's slice.
static void ln_backward_f_input(GPT2* model, ActivationGrads* g, float* dres, float* dln, float* dln_sum,
                                const float* inp, const float* weight, const float* mean, const float* rstd,
                                int B, int T, int complete) {
    int C = model->config.channels, Tl = CP_LEN(g, T);
    if (g->pass.seq_split > g->pass.cp_split) {
        if (complete) {
            tp_sp_take_slice(model->tp, dln, dln_sum, B, Tl, C);
        } else {
            tp_sp_reduce_scatter(model->tp, dln, dln_sum, B, Tl, C, model->sp_scratch);
        }
        layernorm_backward(dres, NULL, NULL, dln_sum, inp, weight, mean, rstd, B, T, g->pass.seq_split, g->pass.seq_rank, C,
                           NULL);
    } else {
        if (!complete) { tp_f_backward(model->tp, dln, (size_t)B * Tl * C); }
        layernorm_backward(dres, NULL, NULL, dln, inp, weight, mean, rstd, B, T, g->pass.cp_split, g->pass.cp_rank, C, NULL);
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
    if (g->pass.seq_split == 1) {
        layernorm_backward(NULL, dweight, dbias, dln_sum, inp, NULL, mean, rstd, B, T, 1, 0, C, NULL);
        return;
    }
    layernorm_backward(NULL, NULL, NULL, dln_sum, inp, NULL, mean, rstd, B, T, g->pass.seq_split, g->pass.seq_rank, C,
                       g->ln_partials);
    // all-reduce (tp group): every rank's per-sequence subtrees of the two sums (2,B,C)
    if (g->pass.seq_split > g->pass.cp_split) { sp_layernorm_grads_reduce(model->tp, g->ln_partials, B, C); }
    if (g->pass.cp_split > 1) {
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
// positions, its slice of sequences of T (a's context split); with CP (cp_split > 1) as
// per-sequence subtrees at dweight + b*seq_stride, dbias + b*seq_stride, for the caller to
// finish over the group.
static void matmul_weight_backward_cp(const Activations* a, float* dweight, float* dbias, long seq_stride,
                                      const float* dout, const float* inp, int B, int T, int C, int OC) {
    if (a->pass.cp_split == 1) {
        matmul_backward(NULL, dweight, dbias, dout, inp, NULL, B, T, C, OC, 1, CANON_R);
        return;
    }
    matmul_backward_seqs(dweight, dbias, seq_stride, dout, inp, B, T, a->pass.cp_split, a->pass.cp_rank, C, OC);
}

// The gradient of a row-parallel layer's output, full (B,T,C) (with CP this rank's slice), from
// d(residual), into dst (Megatron's g backward: the identity, or with SP an all-gather along
// T). A copy, because the backward goes on to change d(residual) before the weight half reads it.
static void dres_g_backward(GPT2* model, ActivationGrads* g, float* dst, int B, int T) {
    int Tl = CP_LEN(g, T);
    size_t BTC = (size_t)B * Tl * model->config.channels;
    if (g->pass.seq_split == g->pass.cp_split) {
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
    pass_split(model, a, g, T);
    int C = c->channels, V = c->vocab_size, cp_split = a->pass.cp_split, Tl = CP_LEN(a, T), BT = B * Tl;
    int sp = g->pass.seq_split > cp_split, LNF = z->lay.num_units - 1;
    float* dlnf = a->split_backward ? a->dlnf : g->dln1;
    if (part & BACKWARD_INPUT) {
        const float* wte = zero_params_acquire(z, ZERO_WTE, -1);
        crossentropy_backward(a->probs, a->targets, dloss, BT, V, model->v0, model->Vl);
        float* dlnf_part = sp ? g->dbtc : dlnf;   // this rank's vocabulary rows' share
        matmul_backward(dlnf_part, NULL, NULL, a->probs, NULL, wte, B, Tl, C, model->Vl, 1, CANON_R / model->tp_size);
        zero_params_release(z, ZERO_WTE);
        int next = model->last_layer > model->first_layer ? ZERO_LAYER(model->last_layer - 1) : -1;
        const float* lnf = zero_params_acquire(z, LNF, next);
        model->mem->fill(g->dresidual, 0.0f, (size_t)B * SEQ_LEN(g, T) * C);
        ln_backward_f_input(model, g, g->dresidual, dlnf_part, dlnf, stage_output(a, c, B, T), lnf, a->lnf_mean,
                            a->lnf_rstd, B, T, 0);
        zero_params_release(z, LNF);
    }
    if (part & BACKWARD_WEIGHT) {
        float* dwte_lm = zero_grad_unit(z, ZERO_WTE);    // the LM-head half of wte's gradient
        size_t nwte = (size_t)model->Vl * C;
        matmul_weight_backward_cp(a, cp_split > 1 ? model->seq_grads : dwte_lm, NULL, (long)nwte, a->probs, a->lnf, B, T,
                                  C, model->Vl);
        if (cp_split > 1) { cp_finish_sequences(model->cp, dwte_lm, model->seq_grads, B, nwte); }
        if (whole_in_group(model, a)) { cp_keep_part(model->cp, dwte_lm, nwte); }
        zero_grad_unit_done(z, ZERO_WTE);
        float* dlnfw = zero_grad_unit(z, LNF);
        float* dl = cp_split > 1 ? model->seq_grads : dlnfw;   // [weight | bias], per sequence with CP
        ln_backward_f_weight(model, g, dl, dl + C, 2L * C, dlnf, stage_output(a, c, B, T), a->lnf_mean, a->lnf_rstd,
                             B, T);
        if (cp_split > 1) { cp_finish_sequences(model->cp, dlnfw, model->seq_grads, B, 2 * (size_t)C); }
        if (whole_in_group(model, a)) { cp_keep_part(model->cp, dlnfw, 2 * (size_t)C); }
        zero_grad_unit_done(z, LNF);
    }
}

// The weight half of layer l's mixture-of-experts backward: the router's weight gradient into
// dw->routerw from dlogits (B,T,E) and ln (B,T,C); the experts' into their unit (a slice per
// source microbatch, expert_parallel.h) from their output gradients dy (rows,C) and fc's output
// gradients dh (rows,4C/tp), in the rows' expert-major order. Reads only what the input half
// left: no exchange of its own. With context parallelism (ln this rank's slice, dlogits whole
// sequences) the router's gradient is this rank's per-sequence subtrees, as the dense weights'
// (the layer finishes them over the cp group), and the experts', which every rank of the group
// computed whole, go to ZeRO as this rank's part of each slice, -0.0f elsewhere (cp_keep_part:
// ZeRO reduces the expert units over expert-data x context ranks).
static void moe_weight_backward(GPT2* model, Activations* a, ActivationGrads* g, int l, const LayerTensors* dw,
                                const float* ln, const float* dlogits, const float* dy, const float* dh, int B, int T) {
    Zero* z = model->zero;
    MoeLayerActs* moe_act = &a->moe[l - model->first_layer];
    const MoeRoute* route = &moe_act->route;
    int C = model->config.channels, C4 = a->C4, ep_size = model->ep_size, unit = zero_expert_unit(z, l);
    int num_experts = model->num_experts, cp = a->pass.cp_split;
    size_t slice = z->lay.size[unit], nleaf = (size_t)ep_size * B * CANON_R + 1;
    if (cp > 1) {   // this rank's positions of dlogits
        float* mine = a->moe_whole + 2 * (size_t)B * T * C;
        zz_copy_slice(model->mem, (float*)dlogits, mine, B, T, num_experts, cp, a->pass.cp_rank, 1);
        dlogits = mine;
    }
    matmul_weight_backward_cp(a, dw->routerw, NULL, (long)z->lay.size[ZERO_LAYER(l)], dlogits, ln, B, T, C,
                              num_experts);
    float* dunit = zero_grad_unit(z, unit);
    ExpertTensors dex = expert_unit(z, unit, dunit);
    const float* gelu_out = a->recompute ? g->hgelu : moe_act->fch_gelu;
    for (int e = 0; e < model->El; e++) {
        int r0 = route->first[e], n = route->first[e + 1] - r0;
        const int* leaf = moe_act->leaf + e * nleaf;
        if (a->recompute && n > 0) { gelu_forward(g->hgelu + (size_t)r0 * C4, moe_act->fch + (size_t)r0 * C4, (size_t)n * C4); }
        moe_expert_dweight(dex.fcprojw + e * dex.fcprojw_n, dex.fcprojb + e * dex.fcprojb_n, slice, dy, gelu_out, leaf,
                           ep_size, B, C4, C);
        moe_expert_dweight(dex.fcw + e * dex.fcw_n, dex.fcb + e * dex.fcb_n, slice, dh, moe_act->xin, leaf, ep_size, B,
                           C, C4);
    }
    int whole = cp > 1 || whole_in_group(model, a);   // every rank of the group computed them whole
    for (int q = 0; whole && q < ep_size; q++) { cp_keep_part(model->cp, dunit + q * slice, slice); }
    zero_grad_unit_done(z, unit);
}

// The backward of layer l's mixture of experts (moe.h THE BACKWARD), in the dense layer's two
// halves. Input half: dln (B,T,C), complete on every tensor-parallel rank, from dout (B,T,C):
// the combine's, the router's and the experts' input gradients, with expert parallelism's two
// all-to-alls of gradients (ep group). Weight half: moe_weight_backward, from the output
// gradients the input half left (a split backward keeps them per layer in a->moe: dlogits, dy,
// dh). `next`: the unit ZeRO-3 prefetches after the experts. With context parallelism (dout,
// dln and ln this rank's slice) the input half runs on whole sequences, as the forward did.
static void moe_backward(GPT2* model, Activations* a, ActivationGrads* g, int l, const LayerTensors* w,
                         const LayerTensors* dw, const float* ln, const float* dout, float* dln, int next, int B,
                         int T, int part) {
    const GPT2Config* c = &model->config;
    const MemOps* mem = model->mem;
    Zero* z = model->zero;
    MoeLayerActs* moe_act = &a->moe[l - model->first_layer];
    MoeRoute* route = &moe_act->route;
    int C = c->channels, C4 = a->C4, num_experts = model->num_experts, top_k = model->top_k;
    int ep_size = model->ep_size, BT = B * T, split = a->split_backward, unit = zero_expert_unit(z, l);
    moe_grads_rows(model, g, (size_t)route->n_recv, C4);
    // where the weight half finds the router's output gradient, the experts' output gradients
    // (expert-major rows; one rank: the dispatch rows are the experts' rows) and fc's
    float* dlogits = split ? moe_act->dlogits : g->dlogits;
    float* dslots = split && ep_size == 1 ? moe_act->dy : g->dslots;
    float* dy = ep_size == 1 ? dslots : split ? moe_act->dy : g->dwork;
    float* dh = split ? moe_act->dh : g->dh;
    if (!(part & BACKWARD_INPUT)) {
        moe_weight_backward(model, a, g, l, dw, ln, dlogits, dy, dh, B, T);
        return;
    }
    float* dln_slice = dln;
    if (a->pass.cp_split > 1) {   // all-gather (cp group) of dout along T
        cp_gather_sequences(model->cp, dout, a->moe_whole, B, T, C);
        dout = a->moe_whole;
        dln = a->moe_whole + (size_t)BT * C;
    }
    moe_combine_backward(g->dgate, dslots, dout, moe_act->ret, moe_act->gates, moe_act->slot_row, BT, top_k, C);
    // the router, with the load-balancing loss of this microbatch (1/M of the step's loss each)
    moe_aux_grad(model->daux_host, route->count, num_experts, top_k, BT, c->aux_loss_coef,
                 z->local_microbatches * z->streams);
    mem->from_host(g->daux, model->daux_host, (size_t)num_experts * sizeof(float));
    moe_router_backward(dlogits, moe_act->probs, moe_act->chosen, moe_act->gates, g->dgate, g->daux, BT,
                        num_experts, top_k);
    matmul_backward(g->drouter, NULL, NULL, dlogits, NULL, w->routerw, B, T, C, num_experts, 1, CANON_R);
    float* dx = g->dwork;
    if (ep_size > 1) {   // all-to-all (ep group): the output gradients to the experts (expert-major rows)
        moe_route_dispatch(route, model->ep, g->dslots, g->dwork2, C);
        moe_gather_rows(dy, g->dwork2, moe_act->perm, route->n_recv, C);
        dx = g->dwork2;
    }
    ExpertTensors ex = expert_unit(z, unit, zero_params_acquire(z, unit, next));
    for (int e = 0; e < model->El; e++) {
        int r0 = route->first[e], n = route->first[e + 1] - r0;
        if (n == 0) { continue; }
        matmul_backward(dh + (size_t)r0 * C4, NULL, NULL, dy + (size_t)r0 * C, NULL, ex.fcprojw + e * ex.fcprojw_n, 1,
                        n, C4, C, 1, CANON_R);
        gelu_backward(dh + (size_t)r0 * C4, moe_act->fch + (size_t)r0 * C4, dh + (size_t)r0 * C4, (size_t)n * C4);
        matmul_backward(dx + (size_t)r0 * C, NULL, NULL, dh + (size_t)r0 * C4, NULL, ex.fcw + e * ex.fcw_n, 1, n, C,
                        C4, 1, CANON_R / model->tp_size);
    }
    zero_params_release(z, unit);
    // run whole, the weight half reads dy and dh now, before the return below reuses dwork
    if (part & BACKWARD_WEIGHT) { moe_weight_backward(model, a, g, l, dw, ln, dlogits, dy, dh, B, T); }
    // f backward (tp group): each expert's column-parallel input gradients dx (rows, C),
    // all-reduced per row
    tp_f_backward(model->tp, dx, (size_t)route->n_recv * C);
    const float* dret = dx;
    if (ep_size > 1) {   // all-to-all (ep group): the input gradients back to their sources, in dispatch-row order
        moe_gather_rows(g->dwork, dx, moe_act->inv, route->n_recv, C);
        moe_route_return(route, model->ep, g->dwork, g->dslots, C);
        dret = g->dslots;
    }
    moe_dinput_combine(dln, g->drouter, dret, moe_act->slot_row, BT, top_k, C);
    if (a->pass.cp_split > 1) { zz_copy_slice(mem, dln, dln_slice, B, T, C, a->pass.cp_split, a->pass.cp_rank, 1); }
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
    if (model->tp_ffn != model->tp || model->ep_rows) {
        fatal("internal: the backward of a serving model (its MLP cut wider than its heads, or its expert rows shared)");
    }
    pass_split(model, a, g, T);
    int C = c->channels, cp_split = a->pass.cp_split, Tl = CP_LEN(a, T), BT = B * Tl, tp_size = model->tp_size;
    int sp = g->pass.seq_split > cp_split;
    int in = part & BACKWARD_INPUT, wt = part & BACKWARD_WEIGHT, moe = model->num_experts > 0;
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
            if (in) { dres_g_backward(model, g, d.dfcproj, B, T); }
            moe_backward(model, a, g, l, &w, &dw, act.ln2, d.dfcproj, dln2_part, next, B, T, part);
            if (in) {
                ln_backward_f_input(model, g, g->dresidual, dln2_part, d.dln2, act.residual2, w.ln2w, act.ln2_mean,
                                    act.ln2_rstd, B, T, 1);
            }
        } else {     // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
            if (wt && a->recompute) { gelu_forward(act.fch_gelu, act.fch, (size_t)BT * a->C4); }
            if (in) { dres_g_backward(model, g, d.dfcproj, B, T); }
            if (wt) { matmul_weight_backward_cp(a, dw.fcprojw, dw.fcprojb, us, d.dfcproj, act.fch_gelu, B, T, a->C4, C); }
            if (in) {
                matmul_backward(d.dfch, NULL, NULL, d.dfcproj, NULL, w.fcprojw, B, Tl, a->C4, C, 1, CANON_R);
                gelu_backward(d.dfch, act.fch, d.dfch, (size_t)BT * a->C4);
            }
            if (wt) { matmul_weight_backward_cp(a, dw.fcw, dw.fcb, us, d.dfch, act.ln2, B, T, C, a->C4); }
            if (in) {
                matmul_backward(dln2_part, NULL, NULL, d.dfch, NULL, w.fcw, B, Tl, C, a->C4, 1, CANON_R / tp_size);
                ln_backward_f_input(model, g, g->dresidual, dln2_part, d.dln2, act.residual2, w.ln2w, act.ln2_mean,
                                    act.ln2_rstd, B, T, 0);
            }
        }
        if (wt) { ln_backward_f_weight(model, g, dw.ln2w, dw.ln2b, us, d.dln2, act.residual2, act.ln2_mean, act.ln2_rstd, B, T); }
        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        if (in) { dres_g_backward(model, g, d.dattproj, B, T); }
        if (wt) { matmul_weight_backward_cp(a, dw.attprojw, dw.attprojb, us, d.dattproj, act.atty, B, T, a->Ca, C); }
        if (in) {
            matmul_backward(g->datty, NULL, NULL, d.dattproj, NULL, w.attprojw, B, Tl, a->Ca, C, 1, CANON_R);
            if (cp_split == 1) {
                attention_backward(d.dqkv, g->datty, act.qkv, act.att, B, T, a->Ca, a->NHl);
            } else if (model->cp->a2a) {
                cp_a2a_backward(model->cp, d.dqkv, g->datty, act.qkvh, act.att, B, T, a->Ca, a->NHl);
            } else {
                cp_ring_backward(model->cp, d.dqkv, g->datty, act.qkv, act.att, B, T, a->Ca, a->NHl);
            }
        }
        if (wt) { matmul_weight_backward_cp(a, dw.qkvw, dw.qkvb, us, d.dqkv, act.ln1, B, T, C, a->C3); }
        if (in) {
            matmul_backward(dln1_part, NULL, NULL, d.dqkv, NULL, w.qkvw, B, Tl, C, a->C3, 3, CANON_R / tp_size);
            ln_backward_f_input(model, g, g->dresidual, dln1_part, d.dln1, act.residual, w.ln1w, act.ln1_mean,
                                act.ln1_rstd, B, T, 0);
        }
        if (wt) {
            ln_backward_f_weight(model, g, dw.ln1w, dw.ln1b, us, d.dln1, act.residual, act.ln1_mean, act.ln1_rstd, B, T);
            if (cp_split > 1) { cp_finish_sequences(model->cp, grad, model->seq_grads, B, (size_t)us); }
            if (whole_in_group(model, a)) { cp_keep_part(model->cp, grad, (size_t)us); }
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
    pass_split(model, a, g, T);
    float* dencoded = a->split_backward ? a->dencoded : g->dfcproj;
    if (part & BACKWARD_INPUT) { dres_g_backward(model, g, dencoded, B, T); }
    if (part & BACKWARD_WEIGHT) {
        const float* dwhole = dencoded;
        if (a->pass.cp_split > 1) {
            cp_gather_sequences(model->cp, dencoded, g->dwhole, B, T, c->channels);
            dwhole = g->dwhole;
        }
        float* dwte_lookup = zero_grad_unit(z, lookup_unit);
        float* dwpe = zero_grad_unit(z, ZERO_WPE);
        encoder_backward(dwte_lookup, dwpe, dwhole, a->inputs_full, B, T, c->channels, model->v0, model->Vl,
                         c->max_seq_len);
        if (a->pass.cp_split > 1 || whole_in_group(model, a)) {   // every rank of the group computed them whole: hand ZeRO its part
            cp_keep_part(model->cp, dwte_lookup, z->lay.size[lookup_unit]);
            cp_keep_part(model->cp, dwpe, z->lay.size[ZERO_WPE]);
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

// The largest unit of gradient this rank computes (the per-sequence partials' room).
static size_t largest_grad_unit(const Zero* zero) {
    size_t unit = 0;
    for (int u = 0; u < zero->lay.num_units; u++) {
        if (zero->lay.grads_here[u] && zero->lay.size[u] > unit) { unit = zero->lay.size[u]; }
    }
    return unit;
}

// The passes that follow run their context parallelism over `group` (a group of one: none):
// create's cp group, or under FlexSP the pool sub-group of the next sequence's group
// (engine.h). Each group's buffers (context_parallel.h) are made on its first selection, for B
// sequences of up to max_len positions (the model's T, or what a FlexSP group's ranks hold
// together); one group per size.
static void model_cp_select(GPT2* model, CommGroup* group, int max_len) {
    int k = flexsp_log2(group->size);
    if (k >= CP_GROUP_LEVELS || (1 << k) != group->size) {
        fatal("internal: a context-parallel group of %d ranks (a power of two up to %d)", group->size, CANON_R);
    }
    ContextParallel* cp = &model->cp_groups[k];
    int longest = max_len < model->cap_T ? max_len : model->cap_T;
    if (cp->group != group) {
        if (cp->group != NULL) { fatal("internal: two context-parallel groups of %d ranks", group->size); }
        const GPT2Config* c = &model->config;
        int N = group->size, B = model->cap_B, T = longest;
        model->cp_len[k] = T;
        size_t unit = largest_grad_unit(model->zero);
        // each sequence's subtree of a unit's gradient finished over the group, and the
        // all-gathers along T at full width (B,T,C) of the embedding chunk's input gradient and
        // of a mixture of experts' input and output gradient (with N copies of a slice beside
        // them when the slices differ in length, context_parallel.h)
        size_t finish = ((size_t)N * B + B) * ((unit + N - 1) / N);
        size_t gather = model->has_embedding || c->num_experts > 0
                        ? (size_t)B * (T + (size_t)N * zz_max_len(T, N)) * c->channels : 0;
        cp_init(cp, group, model->cp_a2a, model->mem, B, T, c->channels / model->tp_size, c->num_heads / model->tp_size,
                finish > gather ? finish : gather);
    }
    if (longest > model->cp_len[k]) {
        fatal("internal: a pass of up to %d positions over a context-parallel group made for %d", longest, model->cp_len[k]);
    }
    model->cp = cp;
    model->cp_size = group->size;
}

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
    model->tp = model->tp_ffn = model->tp_exp = tp;
    model->seq_parallel = seq_parallel;
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
    // context parallelism: the group's buffers, and each sequence's subtree of a unit's
    // gradient (the largest unit this rank computes) before the group finishes it
    model->cp_a2a = cp_a2a;
    model->cap_B = B;
    model->cap_T = T;
    model_cp_select(model, cp, T);
    model->seq_grads = cp->size > 1 ? mem_floats(model->mem, (size_t)B * largest_grad_unit(zero), "context-parallel gradients")
                                    : NULL;
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

// Helix's layout in the server (llmc/serve_kvp.h): the attention output projection and the
// MLP cut over ffn (every rank of the pool, its slice ffn->rank) instead of the tp group, each
// expert's fc and fcproj over exp (ffn, or with --ep the pool's ranks that hold the same
// experts), as the parameters' cut says (zero_init_cut); before activations_alloc. The
// forward only: the trainer cuts them over tp.
void gpt2_set_ffn_groups(GPT2* model, CommGroup* ffn, CommGroup* exp) {
    const TPCut* cut = &model->zero->lay.cut;
    if (cut->ffn_K != ffn->size || cut->ffn_r != ffn->rank || cut->exp_K != exp->size || cut->exp_r != exp->rank) {
        fatal("internal: the MLP's groups (rank %d of %d, experts %d of %d) are not the parameters' cut (slice %d "
              "of %d, experts %d of %d)", ffn->rank, ffn->size, exp->rank, exp->size, cut->ffn_r, cut->ffn_K,
              cut->exp_r, cut->exp_K);
    }
    model->tp_ffn = ffn;
    model->tp_exp = exp;
}

// Serving's expert layers across ep ranks that hold the same rows (llmc/serve_parallel.h): each
// ep rank takes its share of a pass's rows (moe_forward_layer), passes of up to `rows` rows.
// The forward only: the trainer's ep ranks hold microbatches of their own.
void gpt2_split_expert_rows(GPT2* model, int rows) {
    int Q = model->ep_size, share = (rows + Q - 1) / Q;
    model->ep_rows = mem_floats(model->mem, (size_t)Q * share * model->config.channels, "expert rows' shares");
}

void gpt2_free(GPT2* model) {
    void* all[] = {model->sp_scratch, model->probs_all, model->xsend, model->psum, model->seq_grads, model->ep_rows};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) { model->mem->release(all[i]); }
    MOE_MODEL_ROWS(RELEASE, model)
    decode_copies_free(model);
    for (int k = 0; k < CP_GROUP_LEVELS; k++) { cp_free(&model->cp_groups[k]); }
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
static void model_cp_select_op(void* m, CommGroup* group, int max_len) { model_cp_select((GPT2*)m, group, max_len); }
static MoeCounters* model_moe_counters(void* m) { return ((GPT2*)m)->num_experts > 0 ? &((GPT2*)m)->counters : NULL; }

static const ModelOps gpt2_model_ops = {
    model_create, model_destroy, model_acts_create, model_acts_destroy, model_set_tokens,
    model_stage_input, model_stage_output, model_embed_forward, model_layers_forward,
    model_head_forward, model_loss_sum, model_probs_at, model_grads_create, model_grads_destroy,
    model_grad_residual, model_head_backward, model_layers_backward, model_embed_backward,
    model_moe_aux, model_moe_counters, model_embed_decode, model_layers_decode, model_head_decode, sizeof(float),
    sizeof(float), model_cp_select_op
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
