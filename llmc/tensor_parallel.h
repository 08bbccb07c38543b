/*
 * tensor_parallel.h: Megatron-LM's tensor parallelism over a group of K ranks (--tp K).
 *
 * WHO HOLDS WHAT (TPSplit below names each tensor's split as Megatron does). Rank r of the
 * tensor-parallel group holds, of every transformer layer:
 *   qkvw, qkvb   column-parallel: the rows (outputs) of its NH/K heads, of q, of k and of v
 *                (rows [g*C + r*C/K, g*C + (r+1)*C/K) for g = q, k, v)
 *   attprojw     row-parallel: the columns (inputs) of its heads, [r*C/K, (r+1)*C/K)
 *   fcw, fcb     column-parallel: rows [r*4C/K, (r+1)*4C/K)
 *   fcprojw      row-parallel: columns [r*4C/K, (r+1)*4C/K)
 *   ln1, ln2, attprojb, fcprojb: replicated (the bias of a row-parallel layer is added once,
 *                after the all-reduce)
 * and of the embeddings: wte vocab-parallel (rows [r*Vp/K, (r+1)*Vp/K)), wpe and the final
 * layernorm replicated. In a mixture-of-experts layer the router is replicated, and each
 * expert's fc and fcproj are split like the dense MLP's (Megatron's expert tensor
 * parallelism): the pieces of an expert unit (tp_expert_unit_pieces) are one per expert and
 * tensor. Parameters are always initialised and saved in the full (unsharded)
 * llm.c layout: a rank takes its slices from the full tensors, so --tp 1 and --tp K start
 * identical and read and write the same files.
 *
 * THE COMMUNICATION (per layer; all on the tensor-parallel group; B*T*C floats each)
 *   forward:  f = identity before qkv and before fc (tp_f_forward);
 *             g = all-reduce after attproj and after fcproj (tp_g_forward)   2 all-reduces
 *   backward: g = identity (tp_g_backward); f = all-reduce of the input gradient of qkv and
 *             of fc (tp_f_backward)                                           2 all-reduces
 *   embedding: all-reduce of the lookup (each position's row lives on one rank;
 *             tp_vocab_embedding_reduce)
 *   LM head + cross-entropy (vocab-parallel): all-reduce MAX of the row maxima
 *             (tp_vocab_ce_max), all-reduce of the sums of exponentials and of the target
 *             logits (tp_vocab_ce_sums; B*T floats each); the backward needs none, then the
 *             input gradient of the LM head is all-reduced (f).
 *   experts:  each expert's fc and fcproj take the dense MLP's f and g, per row received.
 *   sampling: all-gather of one position's probabilities (tp_gather_vocab).
 *
 * EXACTNESS. A row-parallel layer's reduction over its inputs, and a column-parallel layer's
 * input gradient (a reduction over its outputs), are canonical.h R2 reductions whose 8 chunks
 * split evenly over K | 8 ranks: each rank reduces its 8/K chunks (the kernels' `nchunks`), and
 * the all-reduce (comm.h: the R1 tree over ranks) finishes the same tree: bit-identical to one
 * rank. The vocabulary sum of the cross-entropy likewise (Vp chunks). A sum where exactly one
 * rank holds the value (the embedding lookup, the target logit) has the other ranks
 * contribute -0.0f, because x + (-0) == x for every x (with +0, a -0 would come out +0).
 * Requires K a power of two dividing 8, NH and Vp (and, for sequence parallelism, 2K | T).
 */
#ifndef LLMC_TENSOR_PARALLEL_H
#define LLMC_TENSOR_PARALLEL_H

#include <stddef.h>
#include "llmc/canonical.h"
#include "llmc/comm.h"
#include "llmc/model.h"
#include "llmc/utils.h"
#include "llmc/zigzag.h"

// Megatron's names. A column-parallel linear layer splits its OUTPUTS over the ranks: its
// weight's rows as stored (nn.Linear's [out][in]) and its bias. A row-parallel layer splits its
// INPUTS: its weight's columns (its bias is replicated, added once after the all-reduce). wte
// is column-parallel over the vocabulary (the vocab-parallel embedding and LM head).
typedef enum { TP_REPLICATED, TP_COLUMN_PARALLEL, TP_ROW_PARALLEL } TPSplit;

// How tensor t is split, in `groups` equal fused blocks along the split dimension (qkv: q, k,
// v) that are each cut in K slices.
static inline TPSplit tp_split_of(int t, int* groups) {
    *groups = 1;
    switch (t) {
        case P_WTE: case P_FCW: case P_FCB: return TP_COLUMN_PARALLEL;
        case P_QKVW: case P_QKVB: *groups = 3; return TP_COLUMN_PARALLEL;
        case P_ATTPROJW: case P_FCPROJW: return TP_ROW_PARALLEL;
        default: return TP_REPLICATED;
    }
}

// One tensor of a unit as rank r of K holds it.
typedef struct {
    int tensor, layer;
    TPSplit split;
    int groups;
    int K, r;                   // cut in K slices, this rank's slice r (TPCut)
    size_t rows, cols;          // the full tensor
    size_t lrows, lcols;        // this rank's part
    size_t canon;               // the full tensor's canonical offset (model.h MEMORY order)
    size_t local;               // offset of this rank's part in the unit's local buffer
    int cuts_rows;              // the split cuts the stored rows (a column-parallel weight), else
                                // the columns (a column-parallel bias, a row-parallel weight)
} TPPiece;

static inline size_t tp_piece_elements(const TPPiece* p) { return p->lrows * p->lcols; }

// The canonical index of element `i` (in this rank's part, row-major) of piece p.
static inline size_t tp_piece_canonical(const TPPiece* p, size_t i) {
    size_t row = i / p->lcols, col = i % p->lcols, r = (size_t)p->r, K = (size_t)p->K;
    if (p->split == TP_REPLICATED) {
        // every rank holds the whole tensor
    } else if (p->cuts_rows) {
        size_t per = p->rows / p->groups / K, g = row / per;
        row = g * (p->rows / p->groups) + r * per + row % per;
    } else {
        size_t per = p->cols / p->groups / K, g = col / per;
        col = g * (p->cols / p->groups) + r * per + col % per;
    }
    return p->canon + row * p->cols + col;
}

// How a rank's slices are cut (Megatron's names for who holds what): the heads (qkv) and the
// vocabulary (wte) in K slices, of which it holds slice r; the attention output projection and
// the MLP (attprojw, fcw, fcb, fcprojw) in ffn_K slices, of which it holds ffn_r; each expert's
// fc and fcproj in exp_K slices (Megatron's expert tensor parallelism), of which it holds
// exp_r. The same K and r (tp_cut) but in Helix's layout in the server (llmc/serve_kvp.h: the
// output projection and the MLP over all K x P ranks of the pool, the experts over the pool's
// ranks that hold the same ones).
typedef struct { int K, r, ffn_K, ffn_r, exp_K, exp_r; } TPCut;
static inline TPCut tp_cut(int K, int r) { TPCut cut = {K, r, K, r, K, r}; return cut; }

// Whether tensor t sits after attention, in the cut's ffn_K slices.
static inline int tp_after_attention(int t) { return t == P_ATTPROJW || t == P_FCW || t == P_FCB || t == P_FCPROJW; }

// Piece of tensor t (rows x cols as held whole, at canonical offset canon) on a rank of the
// cut, at local offset `local`.
static inline void tp_piece_init(TPPiece* p, int t, int layer, size_t rows, size_t cols, size_t canon, TPCut cut,
                                 size_t local) {
    p->tensor = t;
    p->layer = layer;
    p->split = tp_split_of(t, &p->groups);
    int replicated = p->split == TP_REPLICATED, after = tp_after_attention(t);
    p->K = replicated ? 1 : after ? cut.ffn_K : cut.K;
    p->r = replicated ? 0 : after ? cut.ffn_r : cut.r;
    p->rows = rows;
    p->cols = cols;
    p->cuts_rows = p->split == TP_COLUMN_PARALLEL && p->rows > 1;   // 1-D tensors are one row
    p->lrows = p->cuts_rows ? p->rows / p->K : p->rows;
    p->lcols = p->cuts_rows ? p->cols : p->cols / p->K;
    p->canon = canon;
    p->local = local;
}

// The pieces of parameter unit u (zero.h numbering: 0 wte, 1 wpe, 2.. layers, L+2 lnf) on a
// rank of the cut; returns their count, local offsets from 0. A layer
// with experts holds its attention, layernorms and router here (TP_MAX_PIECES at most), its
// experts in expert units.
#define TP_MAX_PIECES 12
static inline int tp_unit_pieces(const GPT2Config* c, TPCut cut, int u, TPPiece* out) {
    int L = c->num_layers, n = 0, first, last, layer = 0;
    if (u == 0) { first = last = 0; }
    else if (u == 1) { first = last = 1; }
    else if (u == L + 2) { first = PARAM_LAYER_END; last = PARAM_LAYER_END + 1; }
    else { first = PARAM_LAYER_FIRST; last = PARAM_LAYER_END - 1; layer = u - 2; }
    size_t local = 0;
    for (int i = first; i <= last; i++) {
        int t = param_file_order[i];
        if (t == P_ROUTERW && c->num_experts == 0) { continue; }
        if (param_is_expert_tensor(t) && c->num_experts > 0) { continue; }
        size_t rows, cols;
        param_shape(c, t, &rows, &cols);
        tp_piece_init(&out[n], t, layer, rows, cols, param_offset(c, t, layer), cut, local);
        local += tp_piece_elements(&out[n++]);
    }
    return n;
}

// The pieces of the expert unit of `layer` holding experts [e0, e0 + El): fcw, fcb, fcprojw,
// fcprojb (tensor-major), within each the experts in order, each split like the dense MLP's
// tensor but in the cut's exp_K slices. Returns their count (4 El).
static inline int tp_expert_unit_pieces(const GPT2Config* c, TPCut cut, int layer, int e0, int El, TPPiece* out) {
    static const int tensors[4] = {P_FCW, P_FCB, P_FCPROJW, P_FCPROJB};
    cut.ffn_K = cut.exp_K;
    cut.ffn_r = cut.exp_r;
    int n = 0;
    size_t local = 0;
    for (int i = 0; i < 4; i++) {
        size_t rows, cols;
        param_expert_shape(c, tensors[i], &rows, &cols);
        for (int e = e0; e < e0 + El; e++) {
            size_t canon = param_offset(c, tensors[i], layer) + (size_t)e * rows * cols;
            tp_piece_init(&out[n], tensors[i], layer, rows, cols, canon, cut, local);
            local += tp_piece_elements(&out[n++]);
        }
    }
    return n;
}

// Calls fn(canonical_begin, local_begin, length, ctx) for the maximal runs of consecutive
// canonical indices covering the local elements [lb, le) of piece p.
typedef void (*TPRunFn)(size_t canonical, size_t local, size_t len, void* ctx);
static inline void tp_piece_runs(const TPPiece* p, size_t lb, size_t le, TPRunFn fn, void* ctx) {
    size_t i = lb;
    while (i < le) {
        size_t start = tp_piece_canonical(p, i), len = 1;
        while (i + len < le && tp_piece_canonical(p, i + len) == start + len) { len++; }
        fn(start, p->local + i, len, ctx);
        i += len;
    }
}

// Checks the layout can be split K ways exactly; returns NULL or what is wrong.
static inline const char* tp_problem(const GPT2Config* c, int K) {
    if (K != 1 && K != 2 && K != 4 && K != 8) { return "the tensor-parallel degree must be 1, 2, 4 or 8 (a divisor of the 8 canonical chunks)"; }
    if (c->num_heads % K != 0) { return "the number of heads NH must be a multiple of the tensor-parallel degree"; }
    if (c->padded_vocab_size % K != 0) { return "the padded vocabulary Vp must be a multiple of the tensor-parallel degree"; }
    return NULL;
}

// ------------------------------------------------------------------------------------------
// the f and g operators (Megatron's names), on activations of B*T*C floats

// f before a column-parallel layer: forward is the identity (every rank has the full input).
static inline void tp_f_forward(CommGroup* tp, float* x, size_t n) { (void)tp; (void)x; (void)n; }

// f backward: the input gradient is summed over the ranks (each computed it from its slice of
// the outputs): all-reduce (tensor-parallel group), the R1 tree over ranks.
static inline void tp_f_backward(CommGroup* tp, float* dx, size_t n) {
    if (tp->size > 1) { comm_all_reduce_sum(tp, dx, n, COMM_KIND_TP); }
}

// g after a row-parallel layer: forward all-reduces the partial outputs (each rank reduced its
// slice of the inputs) - the R1 tree over ranks finishes the canonical R2 tree.
static inline void tp_g_forward(CommGroup* tp, float* y, size_t n) {
    if (tp->size > 1) { comm_all_reduce_sum(tp, y, n, COMM_KIND_TP); }
}

// g backward: the identity (every rank needs the full output gradient).
static inline void tp_g_backward(CommGroup* tp, float* dy, size_t n) { (void)tp; (void)dy; (void)n; }

// ------------------------------------------------------------------------------------------
// the vocab-parallel embedding and cross-entropy: rank r holds wte's rows [r*Vp/K, (r+1)*Vp/K)

// The embedding lookup x (n floats: rows of C), each row from the rank holding its token
// (-0.0f on the others): all-reduce (tp group).
static inline void tp_vocab_embedding_reduce(CommGroup* tp, float* x, size_t n) {
    if (tp->size > 1) { comm_all_reduce_sum(tp, x, n, COMM_KIND_TP); }
}

// maxes (BT): each position's largest logit over the whole vocabulary, from every rank's
// maximum over its rows: all-reduce MAX (tp group).
static inline void tp_vocab_ce_max(CommGroup* tp, float* maxes, size_t BT) {
    if (tp->size > 1) { comm_all_reduce_max(tp, maxes, BT, COMM_KIND_TP); }
}

// sums (2,BT): each position's sum of exponentials Z (each rank's chunks of the vocabulary,
// finished by the R1 tree), then its target logit (held by one rank, -0.0f elsewhere):
// all-reduce (tp group).
static inline void tp_vocab_ce_sums(CommGroup* tp, float* sums, size_t BT) {
    if (tp->size > 1) { comm_all_reduce_sum(tp, sums, 2 * BT, COMM_KIND_TP); }
}

// full (Vp) <- every rank's slice (Vp/K) of one position's probabilities (the sampler's):
// all-gather (tp group), accounted as small traffic, not as the activations'.
static inline void tp_gather_vocab(CommGroup* tp, const float* slice, float* full, size_t Vl) {
    comm_all_gather(tp, slice, full, Vl, COMM_KIND_OTHER);
}

// ------------------------------------------------------------------------------------------
// Megatron's sequence parallelism (--sp 1): outside the tensor-parallel regions (layernorms,
// residual stream, dropout) rank r keeps its zig-zag slice of every sequence (zigzag.h:
// stretches r and 2K-1-r of T/2K positions), a (B, T/K, C) slice: the layout whose positions
// are whole chunks of every reduction over positions. f becomes an all-gather along
// T (forward) / reduce-scatter (backward), g a reduce-scatter along T (forward) / all-gather
// (backward): the same bytes as the all-reduces they replace (an all-reduce is a
// reduce-scatter plus an all-gather), and the reduce-scatter sums by the same R1 tree. The
// layernorm weight and bias gradients, summed over positions that are now on K ranks, are
// finished per sequence over the group (sp_layernorm_grads_reduce, then the model's tree over
// sequences).

// full (B,T,C) <- every rank's slice (B,T/K,C): all-gather (tp group) and reorder (the
// buffers live in the group's memory, memory.h).
static inline void tp_sp_all_gather(CommGroup* tp, const float* slice, float* full, int B, int T,
                                    int C, float* scratch /* B*T*C */) {
    comm_all_gather(tp, slice, scratch, (size_t)B * T / tp->size * C, COMM_KIND_TP);
    zz_reorder(tp->mem, full, scratch, B, T, C, tp->size, 0);
}

// slice (B,T/K,C) <- the sum over the group of everyone's full (B,T,C), this rank's positions:
// reorder to rank-major, then reduce-scatter (tp group, the R1 tree over ranks).
static inline void tp_sp_reduce_scatter(CommGroup* tp, const float* full, float* slice, int B, int T,
                                        int C, float* scratch /* B*T*C */) {
    zz_reorder(tp->mem, (float*)full, scratch, B, T, C, tp->size, 1);
    comm_reduce_scatter(tp, scratch, slice, (size_t)B * T / tp->size * C, COMM_KIND_TP);
}

// slice (B,T/K,C) <- this rank's positions of full (B,T,C) when every rank holds the whole of
// it already (a mixture-of-experts layer's output and input gradient, complete per expert):
// the sequence-parallel form of "no sum over the group", the slice tp_sp_reduce_scatter leaves.
static inline void tp_sp_take_slice(CommGroup* tp, const float* full, float* slice, int B, int T, int C) {
    zz_copy_slice(tp->mem, (float*)full, slice, B, T, C, tp->size, tp->rank, 1);
}

// The layernorm weight and bias gradients' per-sequence subtrees ln_partials (2,B,C), each
// rank's over its positions: all-reduce (tp group), the R1 tree over ranks finishing the
// subtrees over the sequence's chunks.
static inline void sp_layernorm_grads_reduce(CommGroup* tp, float* ln_partials, int B, int C) {
    comm_all_reduce_sum(tp, ln_partials, 2 * (size_t)B * C, COMM_KIND_TP);
}

#endif // LLMC_TENSOR_PARALLEL_H
