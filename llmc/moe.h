/*
 * moe.h: the mixture-of-experts layer: its canonical arithmetic, the routing plan, and its CPU
 * kernels (each beside the plain specification it must equal bit for bit). The device twins
 * are llmc/kernels_moe_det.cuh; the communication of expert parallelism is
 * llmc/expert_parallel.h; train_gpt2.c's model calls both.
 *
 * THE LAYER (GPT2Config.num_experts E > 0) replaces a transformer layer's MLP. For position i
 * of a microbatch of B sequences of T positions, x = the ln2 output (C):
 *   logits = x . routerw^T (E)      matmul_forward: R2 over C, no bias
 *   p = softmax(logits)             max over E (R5), e = exp(logit - max), Z = R2 over E of e,
 *                                   p = e / Z
 *   chosen c_1 < ... < c_k          the k largest p, ties to the lower expert index (R5: a
 *                                   selection is exact), listed in ascending expert index
 *   S = ((0 + p_c1) + p_c2) + ...   sequential, ascending expert index
 *   gate_j = p_cj / S
 *   y_e = fcproj_e(gelu(fc_e(x)))   expert e: a GPT-2 MLP (matmul_forward, bias after the tree)
 *   out = fmaf(gate_k, y_ck, ... fmaf(gate_1, y_c1, 0.0f))   ascending expert index
 * No capacity limit: every slot (position, j) reaches its expert.
 *
 * THE LOAD-BALANCING LOSS of a microbatch (Switch Transformer), per layer:
 *   count_e = slots routed to expert e (integers: exact),  f_e = count_e / (k*B*T)
 *   P_e = (R3 over the microbatch's positions of p_e) / (B*T)
 *   aux = (alpha * E) * (R2 over E of fmaf(f_e, P_e))
 * f is a constant for the gradient. A microbatch's loss is its mean cross-entropy plus the sum
 * of its layers' aux; a step minimises the mean of its M microbatches' losses, so
 *   D_e = d(step loss)/d(P_e) = ((alpha * E) * f_e) / M,  daux_e = D_e / (B*T) per position.
 *
 * THE BACKWARD, per position (dout = d(loss)/d(out)):
 *   dgate_j = R2 over C of dout . y_cj;   dy_cj = gate_j * dout
 *   G = fmaf(dgate_k, gate_k, ... fmaf(dgate_1, gate_1, 0.0f))
 *   dp_e = daux_e; for e = c_j: dp_e = ((dgate_j - G) / S) + daux_e
 *   H = R2 over E of fmaf(p_e, dp_e);   dlogit_e = p_e * (dp_e - H)
 *   the router's matmul backward (dx_router, droutherw R3), the experts' (below), and
 *   dx = ((dx_router + dx_c1) + dx_c2) + ...  ascending expert index
 * The expert weight and bias gradients are rule R3 over the positions routed to the expert:
 * per sequence the R2Z chunks of T, each accumulating the routed positions of its chunk in
 * order from 0.0f (positions not routed take no part; a chunk without any sums to 0), then
 * the R1 tree over the sequences of the global batch. One microbatch's positions are a
 * complete subtree, so an expert's gradient is computed per source microbatch ("slice"), and
 * the slices are finished by the same trees as every other gradient (zero.h), whichever rank
 * the tokens came from (expert_parallel.h).
 *
 * THE ROUTING PLAN (host). Slot (i, j) is the j-th chosen expert of position i. Dispatch
 * rows are the slots sorted by expert, then by position in canonical order (a stable counting
 * sort; per sequence its R2Z chunks in turn, each chunk's positions ascending): the rows of
 * one expert are one block, in canonical position order, and the experts of one
 * expert-parallel rank are consecutive (expert_parallel.h). At an expert, the rows of each
 * source microbatch keep that order, and `leaf` marks where each (source, sequence, chunk of T)
 * starts: the leaves of the R3 reduction.
 */
#ifndef LLMC_MOE_H
#define LLMC_MOE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "llmc/canonical.h"

// ==========================================================================================
// 1. The per-output arithmetic (HD: the CPU kernels, the device twins and the host test)
// ==========================================================================================

// Expert a outranks expert b: a larger probability, or the same and a lower index. A NaN
// ranks below everything, so that a diverged router still picks k distinct experts.
HD int moe_outranks(float pa, int a, float pb, int b) {
    float ka = pa == pa ? pa : -canon_inf(), kb = pb == pb ? pb : -canon_inf();
    return ka > kb || (ka == kb && a < b);
}

// One position: p (E) = softmax(logits) (p may be logits), chosen (k) ascending, gates (k).
HD void moe_router_row(float* p, int* chosen, float* gates, const float* logits, int E, int k) {
    float maxv = -canon_inf();
    for (int e = 0; e < E; e++) { if (logits[e] > maxv) { maxv = logits[e]; } }
    for (int e = 0; e < E; e++) { p[e] = canon_expf(logits[e] - maxv); }
    float z = canon_sum(p, E, 1);
    for (int e = 0; e < E; e++) { p[e] = p[e] / z; }
    // the j-th pick: the best of the experts the (j-1)-th outranks
    int prev = -1;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (prev >= 0 && !moe_outranks(p[prev], prev, p[e], e)) { continue; }
            if (best < 0 || moe_outranks(p[e], e, p[best], best)) { best = e; }
        }
        chosen[j] = best;
        prev = best;
    }
    for (int j = 1; j < k; j++) {   // ascending expert index
        int v = chosen[j], m = j;
        while (m > 0 && chosen[m - 1] > v) { chosen[m] = chosen[m - 1]; m--; }
        chosen[m] = v;
    }
    float s = 0.0f;
    for (int j = 0; j < k; j++) { s = s + p[chosen[j]]; }
    for (int j = 0; j < k; j++) { gates[j] = p[chosen[j]] / s; }
}

// out[c] of one position: the gated sum of its k expert outputs (rows at row[j]).
HD float moe_combine_elem(const float* rows, const float* gates, const int* row, int k, int C, int c) {
    float acc = 0.0f;
    for (int j = 0; j < k; j++) { acc = fmaf(gates[j], rows[(size_t)row[j] * C + c], acc); }
    return acc;
}

// dinp[c] of one position: the router's input gradient, then each expert's, ascending.
HD float moe_dinput_elem(float drouter, const float* drows, const int* row, int k, int C, int c) {
    float acc = drouter;
    for (int j = 0; j < k; j++) { acc = acc + drows[(size_t)row[j] * C + c]; }
    return acc;
}

// One position's router backward: dlogits (E) from p (E), its choice, gates and dgate (k),
// and the load-balancing loss's daux (E).
HD void moe_router_backward_row(float* dlogits, const float* p, const int* chosen, const float* gates,
                                const float* dgate, const float* daux, int E, int k) {
    float g = 0.0f, s = 0.0f;
    for (int j = 0; j < k; j++) { g = fmaf(dgate[j], gates[j], g); }
    for (int j = 0; j < k; j++) { s = s + p[chosen[j]]; }
    for (int e = 0; e < E; e++) { dlogits[e] = daux[e]; }
    for (int j = 0; j < k; j++) { dlogits[chosen[j]] = ((dgate[j] - g) / s) + daux[chosen[j]]; }
    float h = canon_dot(p, 1, dlogits, 1, E);
    for (int e = 0; e < E; e++) { dlogits[e] = p[e] * (dlogits[e] - h); }
}

// Leaf index (sequence b, R2Z chunk ch of T) of position pos = b*T + t of a microbatch.
HD int moe_leaf_of(int pos, int T) {
    int b = pos / T, t = pos % T, piece = 2 * CANON_R - 1;
    while (canon_piece_begin(T, 2 * CANON_R, piece) > t) { piece--; }
    return b * CANON_R + (piece < CANON_R ? piece : 2 * CANON_R - 1 - piece);
}

// R3 over the rows of one source microbatch: leaf (b, ch) is rows [leaf[b*8+ch],
// leaf[b*8+ch+1]), accumulated in row order from 0.0f (fmaf of dout[r][o] and x[r][kk], or
// the sum of dout[r][o] when x is NULL), combined by the chunk tree of each sequence, then the
// R1 tree over its B sequences.
HD float moe_rows_reduce_elem(const float* dout, int OC, int o, const float* x, int K, int kk, const int* leaf,
                              int B) {
    float stack[CANON_LOG2_R + 34];
    int top = 0;
    stack[0] = 0.0f;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            float acc = 0.0f;
            for (int r = leaf[b * CANON_R + ch]; r < leaf[b * CANON_R + ch + 1]; r++) {
                acc = x ? fmaf(dout[(size_t)r * OC + o], x[(size_t)r * K + kk], acc) : acc + dout[(size_t)r * OC + o];
            }
            stack[top++] = acc;
            for (int m = canon_pos_merges_after(b, B, ch, CANON_R); m > 0; m--) {
                stack[top - 2] = stack[top - 2] + stack[top - 1];
                top--;
            }
        }
    }
    return stack[0];
}

// ==========================================================================================
// 2. The load-balancing loss (host: E values per layer and microbatch)
// ==========================================================================================

// f_e = count_e / (k*BT)
static inline float moe_fraction(const int* count, int e, int k, int BT) {
    return (float)count[e] / (float)((long)k * BT);
}

// aux of one layer and microbatch from the slot counts and psum_e = R3 over positions of p_e.
static inline float moe_aux_loss(const int* count, const float* psum, int E, int k, int BT, float alpha) {
    float partial[CANON_R];
    for (int c = 0; c < CANON_R; c++) {
        float acc = 0.0f;
        for (long e = canon_chunk_begin(E, c); e < canon_chunk_begin(E, c + 1); e++) {
            acc = fmaf(moe_fraction(count, (int)e, k, BT), psum[e] / (float)BT, acc);
        }
        partial[c] = acc;
    }
    return (alpha * (float)E) * canon_tree8(partial);
}

// daux (E): d(step loss)/d(p_e) of each position, for a step of M microbatches.
static inline void moe_aux_grad(float* daux, const int* count, int E, int k, int BT, float alpha, int M) {
    for (int e = 0; e < E; e++) {
        daux[e] = (((alpha * (float)E) * moe_fraction(count, e, k, BT)) / (float)M) / (float)BT;
    }
}

// ==========================================================================================
// 3. The routing plan (host)
// ==========================================================================================

// Dispatch rows from the choice (B sequences of T positions x k): count (E) slots per expert;
// row_pos (BT*k) the position of each dispatch row (sorted by expert, then by position in
// canonical order: sequence by sequence, its R2Z chunks in turn, so that the rows of every
// leaf of the R3 reduction are consecutive and ascending); slot_row (BT*k) the dispatch row
// of slot i*k + j.
static inline void moe_plan_routes(const int* chosen, int B, int T, int k, int E, int* count, int* row_pos,
                                   int* slot_row, int* cursor /* E */) {
    long BT = (long)B * T;
    memset(count, 0, sizeof(int) * (size_t)E);
    for (long s = 0; s < BT * k; s++) { count[chosen[s]]++; }
    int at = 0;
    for (int e = 0; e < E; e++) { cursor[e] = at; at += count[e]; }
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            for (int half = 0; half < 2; half++) {
                long t0, t1;
                canon_zz_half(T, CANON_R, ch, half, &t0, &t1);
                for (long t = t0; t < t1; t++) {
                    int i = (int)(b * (long)T + t);
                    for (int j = 0; j < k; j++) {
                        int r = cursor[chosen[(long)i * k + j]]++;
                        row_pos[r] = i;
                        slot_row[(long)i * k + j] = r;
                    }
                }
            }
        }
    }
}

// At a rank holding El experts, the rows received from Q sources (source-major: from source
// q, expert 0's rows, then expert 1's, ..., count[q*El + e] each, positions pos[] within the
// source's microbatch of B sequences of T) put in expert-major order (expert e's rows: source
// 0's, then source 1's, ...): work row w holds received row perm[w], received row r lands in
// work row inv[r]; expert e's rows are [first[e], first[e+1]); its leaves (Q*B*8 + 1 each,
// absolute work rows) are leaf[e * (Q*B*8 + 1) + (q*B + b)*8 + ch].
static inline void moe_plan_experts(const int* count, const int* pos, int Q, int El, int B, int T, int* perm,
                                    int* inv, int* first, int* leaf) {
    int nleaf = Q * B * CANON_R + 1;
    int w = 0;
    first[0] = 0;
    for (int e = 0; e < El; e++) {
        int* lf = leaf + (size_t)e * nleaf;
        for (int q = 0; q < Q; q++) {
            int r0 = 0;   // the first received row of (q, e)
            for (int qq = 0; qq < q; qq++) { for (int ee = 0; ee < El; ee++) { r0 += count[qq * El + ee]; } }
            for (int ee = 0; ee < e; ee++) { r0 += count[q * El + ee]; }
            int n = count[q * El + e];
            int* lq = lf + (size_t)q * B * CANON_R;
            for (int l = 0; l < B * CANON_R; l++) { lq[l] = 0; }
            for (int r = r0; r < r0 + n; r++) { lq[moe_leaf_of(pos[r], T)]++; }
            for (int l = 0, at = w; l < B * CANON_R; l++) { int c = lq[l]; lq[l] = at; at += c; }
            for (int r = r0; r < r0 + n; r++) { perm[w] = r; inv[r] = w; w++; }
        }
        lf[Q * B * CANON_R] = w;
        first[e + 1] = w;
    }
}

#endif // LLMC_MOE_H

// ==========================================================================================
// 4. The CPU kernels: compiled where train_gpt2.c includes this header again after its own
//    kernels, with LLMC_CPU_KERNELS defined (their helpers: the SIMD tiles, scratch). The CUDA
//    build's twins of the same names are llmc/kernels_moe_det.cuh.
// ==========================================================================================
#if defined(LLMC_CPU_KERNELS) && !defined(LLMC_MOE_CPU_KERNELS_H)
#define LLMC_MOE_CPU_KERNELS_H

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
    for (int e = 0; e < E; e++) { psum[e] = position_reduce_elem(probs, E, e, NULL, 0, 0, B, T, CANON_R); }
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

// One expert's weight and bias gradients from its rows: for each of nsrc source microbatches
// q (leaves leaf[q*B*8 .. (q+1)*B*8], absolute rows of dout (.,OC) and inp (.,K)), the R3
// reduction over the source's rows into slice q: dweight + q*slice (OC,K) and dbias + q*slice
// (OC) (either may be NULL). The specification, one output at a time:
void moe_expert_dweight_naive(float* dweight, float* dbias, size_t slice, const float* dout, const float* inp,
                              const int* leaf, int nsrc, int B, int K, int OC) {
    #pragma omp parallel for collapse(2)
    for (int q = 0; q < nsrc; q++) {
        for (int o = 0; o < OC; o++) {
            const int* lq = leaf + (size_t)q * B * CANON_R;
            for (int kk = 0; dweight && kk < K; kk++) {
                dweight[q * slice + (size_t)o * K + kk] = moe_rows_reduce_elem(dout, OC, o, inp, K, kk, lq, B);
            }
            if (dbias) { dbias[q * slice + o] = moe_rows_reduce_elem(dout, OC, o, NULL, 0, 0, lq, B); }
        }
    }
}

// The kernel: matmul_dweight_tile's register tiles (MM_NO outputs x nv vectors of columns)
// walking the leaves instead of the chunks of T.
ALWAYS_INLINE void moe_dweight_tile(float* dweight, const float* dout, const float* inp, const int* leaf, int B,
                                    int K, int OC, int o0, const int no, int k0, const int nv) {
    vf acc[MM_NO][MM_MV];
    vf stack[CANON_LOG2_R + 34][MM_NO][MM_MV];
    int top = 0;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_zero(); }
            }
            for (int r = leaf[b * CANON_R + ch]; r < leaf[b * CANON_R + ch + 1]; r++) {
                const float* x = inp + (size_t)r * K + k0;
                vf xv[MM_MV];
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { xv[v] = vf_load(x + v * VLEN); }
                _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                    vf d = vf_set1(dout[(size_t)r * OC + o0 + j]);
                    _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { acc[j][v] = vf_fma(d, xv[v], acc[j][v]); }
                }
            }
            _Pragma("GCC unroll 8") for (int j = 0; j < no; j++) {
                _Pragma("GCC unroll 4") for (int v = 0; v < nv; v++) { stack[top][j][v] = acc[j][v]; }
            }
            top++;
            for (int m = canon_pos_merges_after(b, B, ch, CANON_R); m > 0; m--) {
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

ALWAYS_INLINE void moe_dweight_cols(float* dweight, const float* dout, const float* inp, const int* leaf, int B,
                                    int K, int OC, int o0, const int no) {
    int kvec_end = K / VLEN * VLEN;
    for (int k0 = 0; k0 < kvec_end; k0 += MM_MV * VLEN) {
        switch ((kvec_end - k0) / VLEN < MM_MV ? (kvec_end - k0) / VLEN : MM_MV) {
            case 1: moe_dweight_tile(dweight, dout, inp, leaf, B, K, OC, o0, no, k0, 1); break;
#if MM_MV > 2
            case 3: moe_dweight_tile(dweight, dout, inp, leaf, B, K, OC, o0, no, k0, 3); break;
            case 4: moe_dweight_tile(dweight, dout, inp, leaf, B, K, OC, o0, no, k0, 4); break;
#endif
            default: moe_dweight_tile(dweight, dout, inp, leaf, B, K, OC, o0, no, k0, 2); break;
        }
    }
    for (int j = 0; j < no; j++) {
        for (int kk = kvec_end; kk < K; kk++) {
            dweight[(size_t)(o0 + j) * K + kk] = moe_rows_reduce_elem(dout, OC, o0 + j, inp, K, kk, leaf, B);
        }
    }
}

void moe_expert_dweight(float* dweight, float* dbias, size_t slice, const float* dout, const float* inp,
                        const int* leaf, int nsrc, int B, int K, int OC) {
    int ogroups = dweight ? (OC + MM_NO - 1) / MM_NO : 0;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int q = 0; q < nsrc; q++) {
        for (int g = 0; g < ogroups; g++) {
            const int* lq = leaf + (size_t)q * B * CANON_R;
            float* dw = dweight + q * slice;
            int o0 = g * MM_NO;
            int no = OC - o0 < MM_NO ? OC - o0 : MM_NO;
            switch (no) {
                case 6: moe_dweight_cols(dw, dout, inp, lq, B, K, OC, o0, 6); break;
                case 5: moe_dweight_cols(dw, dout, inp, lq, B, K, OC, o0, 5); break;
                case 4: moe_dweight_cols(dw, dout, inp, lq, B, K, OC, o0, 4); break;
                case 3: moe_dweight_cols(dw, dout, inp, lq, B, K, OC, o0, 3); break;
                case 2: moe_dweight_cols(dw, dout, inp, lq, B, K, OC, o0, 2); break;
                default: moe_dweight_cols(dw, dout, inp, lq, B, K, OC, o0, 1); break;
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

#endif // the CPU kernels
