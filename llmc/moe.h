/*
 * moe.h: the mixture-of-experts layer: its canonical arithmetic (the per-output functions
 * both kernel sets compute with) and the routing plan. The layer's kernels are part of the
 * contract (llmc/kernels.h): the CPU's in train_gpt2.c (the plain specification) and
 * llmc/cpu_fast.h (the experts' weight-gradient tiles), the device twins in
 * llmc/kernels_moe_det.cuh; the communication of expert parallelism is
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
#include "llmc/utils.h"

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
// leaf[b*8+ch+1]), accumulated in row order from 0.0f (fmaf of dout[r][o] and x[r][ic], or
// the sum of dout[r][o] when x is NULL), combined by the chunk tree of each sequence, then the
// R1 tree over its B sequences.
HD float moe_rows_reduce_elem(const float* dout, int OC, int o, const float* x, int IC, int ic, const int* leaf,
                              int B) {
    float partials[CANON_LOG2_R + 34];
    CanonStack stack = canon_stack(partials, 1, 1, 1, 1);
    partials[0] = 0.0f;
    for (int b = 0; b < B; b++) {
        for (int ch = 0; ch < CANON_R; ch++) {
            float acc = 0.0f;
            for (int r = leaf[b * CANON_R + ch]; r < leaf[b * CANON_R + ch + 1]; r++) {
                acc = x ? fmaf(dout[(size_t)r * OC + o], x[(size_t)r * IC + ic], acc) : acc + dout[(size_t)r * OC + o];
            }
            canon_stack_push_value(&stack, acc, canon_pos_merges_after(b, B, ch, CANON_R));
        }
    }
    return partials[0];
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
// absolute work rows) are leaf[e * (Q*B*8 + 1) + (q*B + b)*8 + ch]. Source q's sequences have
// T_of[q] positions (--varlen: each rank's microbatch is a sequence of its own length).
static inline void moe_plan_experts_sources(const int* count, const int* pos, int Q, int El, int B, const int* T_of,
                                            int* perm, int* inv, int* first, int* leaf) {
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
            for (int r = r0; r < r0 + n; r++) { lq[moe_leaf_of(pos[r], T_of[q])]++; }
            for (int l = 0, at = w; l < B * CANON_R; l++) { int c = lq[l]; lq[l] = at; at += c; }
            for (int r = r0; r < r0 + n; r++) { perm[w] = r; inv[r] = w; w++; }
        }
        lf[Q * B * CANON_R] = w;
        first[e + 1] = w;
    }
}

// The same for sources whose sequences all have T positions.
static inline void moe_plan_experts(const int* count, const int* pos, int Q, int El, int B, int T, int* perm,
                                    int* inv, int* first, int* leaf) {
    int* T_of = (int*)malloc_or_die(sizeof(int) * (size_t)Q, "routing");
    for (int q = 0; q < Q; q++) { T_of[q] = T; }
    moe_plan_experts_sources(count, pos, Q, El, B, T_of, perm, inv, first, leaf);
    free(T_of);
}

#endif // LLMC_MOE_H
