/*
 * kernels.h: the kernel contract, every kernel the model (train_gpt2.c), the mixture-of-experts
 * layer and the technique headers (context_parallel.h, ...) call, with its shapes. Two sets
 * implement it with these names and arguments, and the same bits:
 *   the CPU set     train_gpt2.c's kernels, the readable specification, and llmc/cpu_fast.h's
 *                   vectorised ones (each names the plain specification it equals);
 *   the device set  llmc/kernels_det.cuh and llmc/kernels_moe_det.cuh: host functions that
 *                   launch the deterministic CUDA kernels (train_gpt2.cu).
 * The declarations are static, so a set that misses a kernel, or gives it other arguments,
 * does not build: a call to a kernel without a body is a link error ("used but never
 * defined"), a body with other arguments a conflicting declaration (C) or a second overload
 * whose contract twin has no body (C++).
 *
 * Shapes: B sequences of T positions (BT = B*T, row-major (b, t)), C channels, NH heads of
 * hs = C/NH, OC a matmul's outputs and IC its inputs (the reduced dimension), vocabulary V
 * padded to Vp; E experts, k chosen per position. A tensor-parallel rank passes its part of the
 * channels, heads or vocabulary rows (v0, Vl); nchunks = CANON_R / (the group size) when a
 * reduced dimension is divided over a group that finishes the tree (canonical.h R2). Every
 * reduction follows canonical.h; every output element is written (=), never accumulated,
 * unless a kernel says otherwise.
 */
#ifndef LLMC_KERNELS_H
#define LLMC_KERNELS_H

#include <stddef.h>

// ------------------------------------------------------------------------------------------
// embeddings: out (BT,C) = wte[inp] for the vocabulary rows [v0, v0 + Vl) this rank holds,
// -0.0f for the others; then out += wpe[t] (maxT,C)
static void encoder_lookup(float* out, const int* inp, const float* wte, int v0, int Vl, int BT, int C);
static void encoder_add_positions(float* out, const float* wpe, int B, int T, int C);
// dwte_emb (Vl,C), dwpe (maxT,C) <- dout (B,T,C): R3 over positions
static void encoder_backward(float* dwte_emb, float* dwpe, const float* dout, const int* inp,
                             int B, int T, int C, int v0, int Vl, int maxT);

// layernorm: out, inp (BT,C); mean, rstd (BT)
static void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                              const float* weight, const float* bias, int BT, int C);
// dres (B,T,C) += dinp; dweight, dbias (C) R3 over positions, or each sequence's subtree into
// seq_partials (2,B,C). The rows are rank r's D-way zig-zag slice of each of B sequences of T
// positions (canonical.h canon_zz_len(T, D, r) each, its 8/D R2Z chunks; D = 1: whole).
static void layernorm_backward(float* dres, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight, const float* mean,
                               const float* rstd, int B, int T, int D, int r, int C, float* seq_partials);
// out (n) = R1 over sequences of partials (B,n)
static void sequence_tree(float* out, const float* partials, int B, int n);

// matmul: out (BT,OC) = inp (BT,IC) @ weight (OC,IC)^T + bias (OC; NULL: none)
static void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                           int BT, int IC, int OC, int nchunks);
// dinp (B,T,IC), dweight (OC,IC), dbias (OC) <- dout (B,T,OC); any output may be NULL; a weight
// of `groups` fused matrices (qkv: 3) is chunked per group
static void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                            const float* inp, const float* weight, int B, int T, int IC, int OC,
                            int groups, int nchunks);
// each sequence's subtree of dweight, dbias over rank r's D-way zig-zag slice of it (rows as
// layernorm_backward's): sequence b's at + b*seq_stride
static void matmul_backward_seqs(float* dweight, float* dbias, long seq_stride, const float* dout,
                                 const float* inp, int B, int T, int D, int r, int IC, int OC);

// attention, causal: qkv (B,T,3C) -> out (B,T,C), att (B,NH,T,T)
static void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH);
// the KV-cache step: query row t of one sequence, qkv (T,3C) -> out row t (C), att rows t (NH,T,T)
static void attention_forward_row(float* out, float* att, const float* qkv, int t, int T, int C, int NH);
// serving: N rows of different sequences, each against its keys and values in a paged KV cache
// (C floats of k then v per position); tables (N,max_blocks) each row's blocks, pos (N) its
// position; out (N,C); scratch (N,NH,T), the probabilities where a kernel keeps them. Only the
// servers call it, so it is declared extern, not static: the trainers, which never do, leave it
// unused without a warning, and a set without its body is still a link error for a server.
void attention_forward_paged(float* out, float* scratch, const float* qkv, const float* kv, long block_stride,
                             const int* tables, int max_blocks, const int* pos, int N, int T, int bs, int C, int NH);
// dqkv (B,T,3C) <- dout (B,T,C)
static void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                               int B, int T, int C, int NH);

// context parallelism's attention, one block of keys at a time (context_parallel.h): rank r
// of an N-way group holds the queries of its zig-zag slice of sequences of T positions, Tq =
// canon_zz_len(T, N, r) (T/N when 2N | T); qkv (B,Tq,3C); kblk, vblk (B,Tk,C) block s's keys or
// values, Tk = canon_zz_len(T, N, s); att, ds (B,NH,Tq,T), block s in columns
// [canon_zz_offset(T, N, s), ... + Tk); out, dq (B,Tq,C) and dk, dv (B,Tk,C) block s's subtrees
static void attention_scores_block(float* att, const float* qkv, const float* kblk, int B, int T, int C, int NH,
                                   int N, int r, int s);
static void attention_softmax_blocks(float* att, int B, int T, int NH, int N, int r);
static void attention_values_block(float* out, const float* att, const float* vblk, int B, int T, int C, int NH,
                                   int N, int r, int s);
static void attention_datt_block(float* ds, const float* dout, const float* vblk, int B, int T, int C, int NH,
                                 int N, int r, int s);
static void attention_softmax_backward_blocks(float* ds, const float* att, int B, int T, int C, int NH, int N,
                                              int r);
static void attention_dq_block(float* dq, const float* ds, const float* kblk, int B, int T, int C, int NH, int N,
                               int r, int s);
static void attention_dkv_block(float* dk, float* dv, const float* ds, const float* att, const float* qkv,
                                const float* dout, int B, int T, int C, int NH, int N, int r, int s);
// dst rows (stride ldd) <- width floats of each of `rows` src rows (stride lds)
static void copy_rows(float* dst, long ldd, const float* src, long lds, long rows, int width);

// elementwise (n): GELU (tanh form) and its backward (dinp may be dout); the residual sum;
// out (BT,OC) += bias (OC)
static void gelu_forward(float* out, const float* inp, size_t n);
static void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n);
static void residual_forward(float* out, const float* a, const float* b, size_t n);
static void bias_forward(float* out, const float* bias, int BT, int OC);

// softmax + cross-entropy in three phases over this rank's logits (BT,Vl) of vocabulary rows
// [v0, v0 + Vl) (a group finishes the max, Z and the target logit in between); maxes, zs,
// target_logits, losses (BT)
static void crossentropy_max(float* maxes, const float* logits, int BT, int V, int v0, int Vl);
static void crossentropy_exps(float* zs, float* target_logits, float* logits, const float* maxes,
                              const int* targets, int BT, int V, int v0, int Vl, int nchunks);
static void crossentropy_normalize(float* probs, float* losses, const float* zs, const float* target_logits,
                                   const float* maxes, const int* targets, int BT, int V, int v0, int Vl);
// dlogits (BT,Vl) = (probs - onehot(target)) * dloss, over probs
static void crossentropy_backward(float* dlogits_probs, const int* targets, float dloss, int BT, int V,
                                  int v0, int Vl);
// R3 sum of x (B,T)
static float position_sum(const float* x, int B, int T);

// the mixture-of-experts layer (moe.h): probs (BT,E); chosen, gates, dgate (BT,k); dispatch
// rows (BT*k,C) at slot_row (BT,k); psum, daux (E)
static void moe_router_forward(float* probs, int* chosen, float* gates, const float* logits, int BT, int E, int k);
static void moe_expert_prob_sums(float* psum, const float* probs, int B, int T, int E);
// out (n,C) = in[index[i]] (.,C)
static void moe_gather_rows(float* out, const float* in, const int* index, int n, int C);
static void moe_combine(float* out, const float* rows, const float* gates, const int* slot_row, int BT, int k, int C);
static void moe_combine_backward(float* dgate, float* drows, const float* dout, const float* rows, const float* gates,
                                 const int* slot_row, int BT, int k, int C);
static void moe_router_backward(float* dlogits, const float* probs, const int* chosen, const float* gates,
                                const float* dgate, const float* daux, int BT, int E, int k);
static void moe_dinput_combine(float* dinp, const float* drouter, const float* drows, const int* slot_row, int BT,
                               int k, int C);
// one expert's dweight (OC,IC), dbias (OC) per source microbatch q at + q*slice, R3 over the
// rows of its leaves: rows [leaf[q*B*8 + l], leaf[q*B*8 + l + 1]) of dout (.,OC) and inp (.,IC)
static void moe_expert_dweight(float* dweight, float* dbias, size_t slice, const float* dout, const float* inp,
                               const int* leaf, int nsrc, int B, int IC, int OC);

#endif // LLMC_KERNELS_H
