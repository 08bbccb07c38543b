/*
 * train_gpt2_fast.cu: fast mode of the CUDA build (train_gpt2cu without --deterministic 1), in a
 * translation unit of its own. It is compiled with -fmad=false (mk/cuda.mk) because the exact
 * reductions it takes from kernels_det.cuh need it; its own kernels write their fused
 * multiply-adds explicitly.
 *
 * The same GPT-2 as train_gpt2.c's model, driven by the same engine (llmc/engine.h) through
 * the same ModelOps table, with its parameters, gradients and AdamW state in zero.h's fp32
 * buffers: only the arithmetic differs. Weights and activations are bf16 (zero.h's bf16 weights,
 * rounded once a step from the fp32 parameters by their shard's owner and gathered in bf16;
 * under ZeRO-3 only the units in flight), matmuls run on tensor cores through
 * cuBLASLt with the bias and GELU fused (llmc/matmul_cublaslt.cuh), attention is cuDNN's fused
 * attention (llmc/attention_cudnn.cuh) or our flash kernels (llmc/attention_flash.cuh), chosen
 * by --attention, the residual add and the next layernorm are one kernel,
 * the classifier is fused (llmc/kernels_fast.cuh). Weight gradients are fp32, and the bias,
 * layernorm and embedding gradients use deterministic mode's exact R3 reductions on the bf16
 * activations (kernels_det.cuh), so a fast run is repeatable run to run.
 *
 * Fast mode runs dense models with data parallelism, ZeRO 0-3 and pipeline parallelism with
 * every schedule: a model chunk is a range of layers (ChunkPlace), stage boundaries are the
 * bf16 residual stream, and the split backward's halves (the zero-bubble and DualPipe
 * schedules) are the input gradients, then the cuBLASLt weight-gradient matmuls and the exact
 * reductions. The sampler decodes with a KV cache (one new row per token). Tensor parallelism
 * splits the bf16 weights as tensor_parallel.h's pieces, with fp32 sums crossing the tp group
 * (kernels_fast_tp.cuh); inside pipeline stages each tp rank of a stage sends and receives its
 * own bf16 boundary over its pp group (comm.h's grid); with sequence parallelism (--sp 1) the residual
 * stream and the layernorms hold this rank's zig-zag slice of T (zigzag.h), the fp32 sums are
 * reduce-scattered along T and the bf16 layernorm outputs and residual gradients all-gathered
 * (the same bits as --tp K alone). Mixture-of-experts models (moe.h) run with data, expert
 * (--ep, bf16 all-to-alls), tensor (--tp K, + --sp 1: each expert's fc column-parallel and
 * fcproj row-parallel, fp32 partial sums of the work rows over the tp group) and pipeline
 * parallelism and ZeRO: an fp32 router, bf16 expert rows, all experts in each batched cuBLASLt
 * call (kernels_fast_moe.cuh), the routing plan and exchanges of expert_parallel.h; every
 * schedule, the split backward's too. Context parallelism (--cp N, in every layout above)
 * holds each rank's zig-zag slice of T (with --sp 1 the residual stream a slice of that slice);
 * attention either turns it into NH/N of the tp rank's heads of whole sequences around the
 * flash kernels with bf16 all-to-alls (--cp-mode a2a) or passes bf16 K|V blocks of its heads
 * around the ring, merging each block's partial output by its log-sum-exp
 * (kernels_fast_cp.cuh); pipeline stages send the slice; an expert layer runs on whole
 * sequences on every rank of the cp group, as in deterministic mode (fast_moe_layer_forward).
 */
#include "llmc/engine.h"
#include "llmc/kernels_moe_det.cuh"   // the device set (kernels_det.cuh with the experts' twins)
#include "llmc/kernels_fast.cuh"
#include "llmc/kernels_fast_tp.cuh"
#include "llmc/kernels_fast_moe.cuh"
#include "llmc/kernels_fast_cp.cuh"
#include "llmc/expert_parallel.h"
#include "llmc/tensor_parallel.h"
#include "llmc/matmul_cublaslt.cuh"
#include "llmc/attention_flash.cuh"
#ifdef LLMC_CUDNN
#include "llmc/attention_cudnn.cuh"
#endif
#include "llmc/gpt2_fast.h"

// Attention: cuDNN for the training shape (B, T) when chosen, our flash kernels for the rest
// (the sampler's growing T, where a cuDNN plan per length would be built) when their head
// sizes allow. The two keep different softmax statistics (cuDNN: natural-log logsumexp, flash:
// base 2), so a pass's forward and backward always use the same one.
#ifdef LLMC_CUDNN
static int attention_cudnn_B = 0, attention_cudnn_T = 0;   // the shape cuDNN runs (0: none)
static int attention_uses_cudnn(int B, int T, int hs) {
    return (B == attention_cudnn_B && T == attention_cudnn_T) || !gpu_flash_head_size(hs);
}
#endif
static void fast_attention_forward(floatX* out, float* stats, const floatX* qkv, int B, int T, int C, int NH) {
#ifdef LLMC_CUDNN
    if (attention_uses_cudnn(B, T, C / NH)) {
        attention_forward_cudnn(out, stats, qkv, B, T, NH, C / NH, 1);
        return;
    }
#endif
    attention_forward_fast(out, stats, qkv, B, T, C, NH);
}
static void fast_attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out,
                                    const float* stats, float* D, int B, int T, int C, int NH) {
#ifdef LLMC_CUDNN
    if (attention_uses_cudnn(B, T, C / NH)) {
        attention_backward_cudnn(dqkv, dout, qkv, out, stats, B, T, NH, C / NH);
        return;
    }
#endif
    attention_backward_fast(dqkv, dout, qkv, out, stats, D, B, T, C, NH);
}

// One model chunk (ChunkPlace): layers [first_layer, last_layer), the embeddings and the head
// when it has them.
typedef struct {
    GPT2Config config;
    Zero* zero;
    const MemOps* mem;
    int first_layer, layers;   // layers: how many this chunk has (0: none)
    int has_embedding, has_head;
    int hold_head;         // wte stays held from the head's forward to its backward (one stage)
    float* att_D;          // flash attention backward's rowsum(dO * O) (B,NH/K,T)
    // tensor parallelism (tensor_parallel.h's split; K = 1: none): this rank's heads NHl, its
    // attention width Cl = C/K, its vocabulary rows [v0, v0 + Vl) of wte
    CommGroup* tp;
    int K, NHl, Cl, v0, Vl;
    float* tp_sum;         // (B*T,C) fp32: what crosses the tp group (kernels_fast_tp.cuh)
    // sequence parallelism (--sp 1, tensor_parallel.h): the residual stream and the layernorms
    // on this rank's zig-zag slice (B,T/K,C) of the training passes
    int sp;
    float* sp_slice;       // (B*T/K,C) fp32: a reduce-scatter's slice, before the bias and the rounding
    float* sp_scratch;     // (B*T,C) fp32: tp_sp_*'s rank-major reorder
    floatX* sp_ln;         // (B*T/K,C) bf16: a layernorm's slice, before f's all-gather
    float* ln_partials;    // (2,B,C): a layernorm's weight and bias gradients per sequence
    float *probs_slice, *probs_all;   // (Vl), (Vp) fp32: the sampler's gathered logits
    // mixture of experts (E > 0, llmc/moe.h): this rank holds El = E/Q of each layer's E
    // experts, Q the size of its expert-parallel group ep (expert_parallel.h)
    int E, top_k, El, Q;
    CommGroup* ep;
    MoeCounters counters;
    float *psum, *daux;                // (E) device: the router's probability sums, d aux / d p
    float *psum_host, *daux_host;      // (E) their host copies
    float* moe_partial;    // --tp: (Q*B*T*k,C) fp32 the experts' partial outputs or input gradients per work row
    // --sp or --cp: (B*T,C) bf16 whole sequences: [1] the layer's output (forward) or d ln2
    // (backward), of which this rank keeps its slice; [0] (--cp) its input ln2 (forward) or d out
    // (backward), all-gathered along T
    floatX* moe_whole[2];
    // context parallelism (--cp N, kernels_fast_cp.cuh; N = 1: none): the training passes hold
    // this rank's zig-zag slice (B,T/N) of each sequence
    int N, ring;           // ring: --cp-mode ring, else the all-to-all
    ContextParallel cp;    // context_parallel.h's group and buffers (parts: the all-to-all's; gather)
    FastRing ring_bufs;    // the ring's blocks and partials
} FastModel;

// One mixture-of-experts layer's routing and expert activations, kept from its forward to its
// backward. Rows: dispatch rows are the microbatch's slots (BT*k) sorted by expert; work rows
// the rows this rank's experts received (expert-major; up to Q*BT*k with expert parallelism).
typedef struct {
    MoeRoute route;          // the routing plan (host)
    float* probs;            // (BT,E) fp32 the router's logits, then its probabilities
    int* chosen;             // (BT,k) the chosen experts, ascending
    float* gates;            // (BT,k)
    int *slot_row, *row_pos; // (BT*k) the dispatch row of each slot, the position of each dispatch row
    int *perm, *inv;         // (work rows) work row <- received row, received row <- work row
    int* leaf;               // the R3 leaves of each local expert's rows (moe.h), by source
    floatX* ret;             // (BT*k,C) each slot's expert output, back at the source
    floatX *xin, *fch, *fch_gelu;   // (work rows, C / 4C / 4C) the experts' inputs, fc out, GELU out
    // a split backward's gradients kept from its input half for its weight half: the router's
    // output (BT,E), the experts' outputs (work rows, C) and fc's (work rows, 4C)
    floatX *dlogits_bf16, *dy, *dh;
    float aux;               // the load-balancing loss of the last pass
} FastMoeLayer;

// Activations of one pass over up to (B, T) positions (layouts as train_gpt2.c's, l counting
// the chunk's layers; att holds flash attention's per-row softmax statistics (layers,B,NH,T)).
// encoded is the chunk's input: the embeddings' output, or the received activation.
typedef struct {
    int recompute, split_backward;
    int sp;                 // the pass is sequence-parallel (training and validation, not the sampler)
    int cp;                 // the pass is context-parallel (likewise): every tensor below holds the slice
    int* inputs;
    int* inputs_full;       // --cp: every position's tokens (B,T), for the embedding's gradient
    int* targets;           // NULL: no loss
    int* targets_buf;
    floatX *encoded, *ln1, *qkv, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3, *lnf, *logits, *proj;
    float *ln1_mean, *ln1_rstd, *att, *ln2_mean, *ln2_rstd, *lnf_mean, *lnf_rstd, *losses;
    float* ce_stats;        // --tp: the vocab-parallel classifier's (3,B,T) max, Z and target logit
    float* losses_full;     // --cp: every position's loss (B,T), gathered along T
    floatX *qkv_h, *atty_h; // --cp: (L,B,T,3Cl/N), (L,B,T,Cl/N) attention's head-split q|k|v and output
    // a split backward's gradients kept from its input half for its weight half: per layer
    // those at the outputs of its weights (FastOutGrads), the head's d lnf, the embeddings' d encoded
    floatX *dfcproj, *dfch, *dln2, *dattproj, *dqkv, *dln1, *dlnf, *dencoded;
    FastMoeLayer* moe;      // (layers) mixture of experts: each layer's routing and experts
    int moe_rows;           // work rows the layers' buffers hold: Q*BT*k, every slot of the ep group
    floatX *moe_send, *moe_recv, *moe_y;   // (moe_rows,C) expert parallelism's exchange buffers
} FastActs;

typedef struct {
    floatX *dresidual, *dbtc, *dqkv, *dbt4c;
    floatX* dfull;   // --sp: d(residual) all-gathered along T, what a row-parallel layer's backward reads
    // mixture of experts (one set, reused by every layer)
    float *dgate, *dlogits, *drouter, *daux;   // (BT,k) (BT,E) (BT,C) (E) fp32
    floatX *dlogits_bf16, *dslots;             // (BT,E), (BT*k,C) dispatch rows
    floatX* dlogits_mine;                      // --cp: (B*T/N,E) this rank's positions of dlogits_bf16
    floatX *dy, *dh, *dx, *dwork;              // (work rows, C / 4C / C / C)
} FastGrads;

// Typed views of one layer's tensors in a unit buffer (zero.h's unit layout: the 12 tensors in
// order, each this rank's tensor-parallel piece).
// A mixture-of-experts layer's unit holds ln1w .. ln2b and routerw (fcw .. fcprojb NULL: the
// experts are a unit of their own, expert_views).
template <typename X> struct LayerViews {
    X *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb, *routerw;
};
template <typename X> static LayerViews<X> layer_views(const Zero* z, int u, X* base) {
    const TPPiece* p = z->lay.pieces[u];
    if (z->lay.npieces[u] == 9) {
        LayerViews<X> v = {base + p[0].local, base + p[1].local, base + p[2].local, base + p[3].local,
                           base + p[4].local, base + p[5].local, base + p[6].local, base + p[7].local,
                           NULL, NULL, NULL, NULL, base + p[8].local};
        return v;
    }
    LayerViews<X> v = {base + p[0].local, base + p[1].local, base + p[2].local, base + p[3].local,
                       base + p[4].local, base + p[5].local, base + p[6].local, base + p[7].local,
                       base + p[8].local, base + p[9].local, base + p[10].local, base + p[11].local, NULL};
    return v;
}

// The local experts' tensors in expert unit u's buffer (zero.h: El fcw pieces one after the
// other, then El fcb, El fcprojw, El fcprojb; kernels_fast_moe.cuh's MoeExperts).
template <typename X> static MoeExperts<X> expert_views(const Zero* z, int u, X* base) {
    const TPPiece* p = z->lay.pieces[u];
    int El = z->lay.npieces[u] / 4;
    MoeExperts<X> v = {base + p[0].local, base + p[El].local, base + p[2 * El].local, base + p[3 * El].local};
    return v;
}

// Unit u's bf16 weights, zero.h's (BF16 WEIGHTS: rounded once a step by their owners; ZeRO-3
// gathers the unit, prefetching `next`), read only; fast_release(m, u) when done.
static floatX* fast_params(FastModel* m, int u, int next) {
    return (floatX*)zero_weights_acquire(m->zero, u, next);
}

static void fast_release(FastModel* m, int u) { zero_params_release(m->zero, u); }

static floatX* act(FastModel* m, size_t n, size_t* bytes) {
    *bytes += n * sizeof(floatX);
    return n ? (floatX*)m->mem->alloc(n * sizeof(floatX), "activations") : NULL;
}
static float* act_f(FastModel* m, size_t n, size_t* bytes) {
    *bytes += n * sizeof(float);
    return n ? (float*)m->mem->alloc(n * sizeof(float), "activations") : NULL;
}

// ---- ModelOps ----------------------------------------------------------------------------

static void* fast_create(const GPT2Config* c, const ChunkPlace* place, Zero* zero, CommGroup* tp, CommGroup* cp,
                         int cp_a2a, int seq_parallel, int B, int T) {
    FastModel* m = (FastModel*)calloc_or_die(1, sizeof(FastModel), "model");
    m->config = *c;
    m->zero = zero;
    m->mem = zero->mem;
    m->first_layer = place->first_layer;
    m->layers = place->last_layer - place->first_layer;
    m->has_embedding = place->has_embedding;
    m->has_head = place->has_head;
    m->hold_head = place->has_embedding && place->has_head;   // one stage: nothing runs in between
    m->tp = tp;
    m->K = tp->size;
    m->NHl = c->num_heads / m->K;
    m->Cl = c->channels / m->K;
    m->Vl = c->padded_vocab_size / m->K;
    m->v0 = tp->rank * m->Vl;
    m->att_D = (float*)m->mem->alloc(sizeof(float) * (size_t)B * m->NHl * T, "attention D");
    // the most positions a pass holds: a training pass's B*T, or the sampler's (1, genT) with
    // genT up to maxT (which -t may undercut)
    size_t pass_rows = (size_t)B * T > (size_t)c->max_seq_len ? (size_t)B * T : (size_t)c->max_seq_len;
    if (m->K > 1) {
        m->tp_sum = (float*)m->mem->alloc(sizeof(float) * pass_rows * c->channels, "tensor-parallel sums");
        m->probs_slice = (float*)m->mem->alloc(sizeof(float) * m->Vl, "sample logits");
        m->probs_all = (float*)m->mem->alloc(sizeof(float) * c->padded_vocab_size, "sample logits");
    }
    m->sp = seq_parallel && m->K > 1;
    m->N = cp->size;
    char why[256];
    const char* problem = cp_problem(m->N, cp_a2a, T, m->NHl, m->sp ? m->K : 1, why, sizeof(why));
    if (problem) { fatal("--cp %d: %s", m->N, problem); }
    if (m->N > 1) {   // room for the gathers along T (bf16 B*T*C: B*T*C/2 floats), and a2a's or the ring's buffers
        size_t gather = (size_t)B * T * c->channels / 2;
        m->ring = !cp_a2a;
        if (m->ring) {
            cp_init_gather(&m->cp, cp, 0, m->mem, gather);
            fast_ring_init(&m->ring_bufs, m->mem, m->N, B, T, m->Cl, m->NHl);
        } else {
            cp_init(&m->cp, cp, 1, m->mem, B, T, m->Cl, m->NHl, gather);
        }
    }
    if (m->sp) {
        size_t BTC = (size_t)B * T * c->channels;
        m->sp_slice = (float*)m->mem->alloc(sizeof(float) * BTC / m->K, "sequence parallelism");
        m->sp_scratch = (float*)m->mem->alloc(sizeof(float) * BTC, "sequence parallelism");
        m->sp_ln = (floatX*)m->mem->alloc(sizeof(floatX) * BTC / m->K, "sequence parallelism");
        m->ln_partials = (float*)m->mem->alloc(sizeof(float) * 2 * (size_t)B * c->channels, "sequence parallelism");
    }
    if (c->num_experts > 0) {
        m->E = c->num_experts;
        m->top_k = c->top_k;
        m->ep = zero->ep;
        m->Q = zero->ep->size;
        m->El = m->E / m->Q;
        m->counters.layers = m->layers;
        m->counters.experts = m->E;
        m->counters.first_layer = m->first_layer;
        m->counters.tokens = (double*)calloc_or_die((size_t)m->layers * m->E + 1, sizeof(double), "routing counters");
        m->psum = (float*)m->mem->alloc(sizeof(float) * m->E, "router sums");
        m->daux = (float*)m->mem->alloc(sizeof(float) * m->E, "router sums");
        m->psum_host = (float*)malloc_or_die(sizeof(float) * m->E, "router sums");
        m->daux_host = (float*)malloc_or_die(sizeof(float) * m->E, "router sums");
        if (m->K > 1) {   // (every slot of the ep group's passes)
            m->moe_partial = (float*)m->mem->alloc(sizeof(float) * m->Q * m->top_k * pass_rows * c->channels,
                                                   "tensor-parallel sums");
        }
        for (int i = 0; i < 2; i++) {   // (training and validation passes only)
            if (m->N > 1 || (m->sp && i == 1)) {
                m->moe_whole[i] = (floatX*)m->mem->alloc(sizeof(floatX) * (size_t)B * T * c->channels, "expert layers");
            }
        }
    }
    return m;
}

static void fast_destroy(void* vm) {
    FastModel* m = (FastModel*)vm;
    m->mem->release(m->att_D);
    if (m->N > 1) { cp_free(&m->cp); }
    if (m->ring) { fast_ring_free(&m->ring_bufs, m->mem); }
    if (m->K > 1) {
        m->mem->release(m->tp_sum);
        m->mem->release(m->probs_slice);
        m->mem->release(m->probs_all);
    }
    if (m->sp) {
        m->mem->release(m->sp_slice);
        m->mem->release(m->sp_scratch);
        m->mem->release(m->sp_ln);
        m->mem->release(m->ln_partials);
    }
    if (m->E > 0) {
        free(m->counters.tokens);
        m->mem->release(m->psum);
        m->mem->release(m->daux);
        free(m->psum_host);
        free(m->daux_host);
        if (m->moe_partial) { m->mem->release(m->moe_partial); }
        for (int i = 0; i < 2; i++) {
            if (m->moe_whole[i]) { m->mem->release(m->moe_whole[i]); }
        }
    }
    free(m);
}

static void* fast_acts_create(void* vm, int B, int T, int recompute, int split_seqs, int split_backward,
                              size_t* bytes) {
    FastModel* m = (FastModel*)vm;
    const GPT2Config* c = &m->config;
    FastActs* a = (FastActs*)calloc_or_die(1, sizeof(FastActs), "activations");
    a->cp = m->N > 1 && split_seqs == SEQS_SPLIT;
    size_t Tw = T;   // the whole sequence; with CP every per-position tensor holds the slice of T/N
    if (a->cp) { T /= m->N; }
    size_t L = m->layers, C = c->channels, Cl = m->Cl, NHl = m->NHl, Vl = m->Vl, BT = (size_t)B * T;
    size_t head = m->has_head;   // the head's tensors only on its chunk
    *bytes = 2 * BT * sizeof(int);
    a->sp = m->sp && split_seqs == SEQS_SPLIT;
    size_t BTs = a->sp ? BT / m->K : BT;   // the residual stream's rows and the layernorms' (SP: the slice)
    a->recompute = recompute;
    a->split_backward = split_backward;
    a->inputs = (int*)m->mem->alloc(BT * sizeof(int), "tokens");
    a->targets_buf = (int*)m->mem->alloc(BT * sizeof(int), "tokens");
    a->encoded = act(m, BTs * C, bytes);
    a->ln1 = act(m, L * BT * C, bytes);
    a->ln1_mean = act_f(m, L * BTs, bytes);
    a->ln1_rstd = act_f(m, L * BTs, bytes);
    a->qkv = act(m, L * BT * 3 * Cl, bytes);
    a->atty = act(m, L * BT * Cl, bytes);
    a->att = act_f(m, L * gpu_attention_stats_stride(B, NHl, T), bytes);
    a->residual2 = act(m, L * BTs * C, bytes);
    a->ln2 = act(m, L * BT * C, bytes);
    a->ln2_mean = act_f(m, L * BTs, bytes);
    a->ln2_rstd = act_f(m, L * BTs, bytes);
    a->fch = act(m, L * BT * 4 * Cl, bytes);
    a->fch_gelu = act(m, (recompute && L > 0 ? 1 : L) * BT * 4 * Cl, bytes);
    a->residual3 = act(m, L * BTs * C, bytes);
    a->lnf = act(m, head * BT * C, bytes);
    a->lnf_mean = act_f(m, head * BTs, bytes);
    a->lnf_rstd = act_f(m, head * BTs, bytes);
    a->logits = act(m, head * BT * Vl, bytes);
    a->losses = act_f(m, head * BT, bytes);
    a->ce_stats = act_f(m, (m->K > 1) * head * 3 * BT, bytes);
    a->proj = act(m, BT * C, bytes);
    if (a->cp) {   // the all-to-all's head-split tensors (as many elements as qkv's and atty's), whole sequences
        a->qkv_h = act(m, !m->ring * L * BT * 3 * Cl, bytes);
        a->atty_h = act(m, !m->ring * L * BT * Cl, bytes);
        a->losses_full = act_f(m, head * B * Tw, bytes);
        *bytes += B * Tw * sizeof(int);
        a->inputs_full = (int*)m->mem->alloc(B * Tw * sizeof(int), "tokens");
    }
    if (split_backward) {
        a->dfcproj = act(m, L * BT * C, bytes);
        a->dfch = act(m, L * BT * 4 * Cl, bytes);
        a->dln2 = act(m, L * BT * C, bytes);
        a->dattproj = act(m, L * BT * C, bytes);
        a->dqkv = act(m, L * BT * 3 * Cl, bytes);
        a->dln1 = act(m, L * BT * C, bytes);
        a->dlnf = act(m, head * BT * C, bytes);
        a->dencoded = act(m, m->has_embedding * B * Tw * C, bytes);   // (CP: gathered whole)
    }
    if (m->E > 0) {   // (CP: the expert layers run on whole sequences, fast_moe_layer_forward)
        size_t BTw = (size_t)B * Tw, E = m->E, k = m->top_k, slots = BTw * k, rows = (size_t)m->Q * slots;
        size_t nleaf = (size_t)m->El * ((size_t)m->Q * B * CANON_R + 1);
        a->moe_rows = (int)rows;
        a->moe = (FastMoeLayer*)calloc_or_die(L + 1, sizeof(FastMoeLayer), "expert activations");
        for (size_t l = 0; l < L; l++) {
            FastMoeLayer* x = &a->moe[l];
            moe_route_init(&x->route, (int)BTw, (int)k, (int)E, m->Q, B);
            x->probs = act_f(m, BTw * E, bytes);
            x->gates = act_f(m, slots, bytes);
            *bytes += (3 * slots + 2 * rows + nleaf) * sizeof(int);   // chosen, slot_row, row_pos; perm, inv; leaf
            x->chosen = (int*)m->mem->alloc(slots * sizeof(int), "expert activations");
            x->slot_row = (int*)m->mem->alloc(slots * sizeof(int), "expert activations");
            x->row_pos = (int*)m->mem->alloc(slots * sizeof(int), "expert activations");
            x->perm = (int*)m->mem->alloc(rows * sizeof(int), "expert activations");
            x->inv = (int*)m->mem->alloc(rows * sizeof(int), "expert activations");
            x->leaf = (int*)m->mem->alloc(nleaf * sizeof(int), "expert activations");
            x->ret = act(m, slots * C, bytes);
            x->xin = act(m, rows * C, bytes);
            x->fch = act(m, rows * 4 * C, bytes);
            x->fch_gelu = act(m, rows * 4 * C, bytes);
            if (split_backward) {   // what the input half leaves the weight half
                x->dlogits_bf16 = act(m, BTw * E, bytes);
                x->dy = act(m, rows * C, bytes);
                x->dh = act(m, rows * 4 * C, bytes);
            }
        }
        if (m->Q > 1) {
            a->moe_send = act(m, rows * C, bytes);
            a->moe_recv = act(m, rows * C, bytes);
            a->moe_y = act(m, rows * C, bytes);
        }
    }
    return a;
}

static void fast_acts_destroy(void* vm, void* va) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    void* all[] = {a->inputs, a->targets_buf, a->encoded, a->ln1, a->ln1_mean, a->ln1_rstd, a->qkv, a->atty, a->att,
                   a->residual2, a->ln2, a->ln2_mean, a->ln2_rstd, a->fch, a->fch_gelu, a->residual3, a->lnf,
                   a->lnf_mean, a->lnf_rstd, a->logits, a->losses, a->ce_stats, a->proj, a->dfcproj, a->dfch, a->dln2,
                   a->dattproj, a->dqkv, a->dln1, a->dlnf, a->dencoded, a->qkv_h, a->atty_h, a->losses_full,
                   a->inputs_full};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (all[i]) { m->mem->release(all[i]); }
    }
    for (int l = 0; a->moe && l < m->layers; l++) {
        FastMoeLayer* x = &a->moe[l];
        void* moe_all[] = {x->probs, x->gates, x->chosen, x->slot_row, x->row_pos, x->perm, x->inv, x->leaf, x->ret,
                           x->xin, x->fch, x->fch_gelu, x->dlogits_bf16, x->dy, x->dh};
        for (size_t i = 0; i < sizeof(moe_all) / sizeof(moe_all[0]); i++) {
            if (moe_all[i]) { m->mem->release(moe_all[i]); }
        }
        moe_route_free(&x->route);
    }
    if (a->moe_send) {
        m->mem->release(a->moe_send);
        m->mem->release(a->moe_recv);
        m->mem->release(a->moe_y);
    }
    free(a->moe);
    free(a);
}

// The pass's tokens (B sequences of T, host memory). With CP the rank keeps its zig-zag slice
// of each sequence (and all of the inputs, for the embedding's gradient).
static void fast_set_tokens(void* vm, void* va, const int* inputs, const int* targets, int B, int T) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    a->targets = targets ? a->targets_buf : NULL;
    if (!a->cp) {
        size_t bytes = (size_t)B * T * sizeof(int);
        m->mem->from_host(a->inputs, inputs, bytes);
        if (targets) { m->mem->from_host(a->targets_buf, targets, bytes); }
        return;
    }
    int N = m->N, Tl = T / N;
    size_t n = (size_t)B * Tl;
    m->mem->from_host(a->inputs_full, inputs, (size_t)B * T * sizeof(int));
    int* slice = (int*)malloc_or_die(2 * n * sizeof(int), "token slices");
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < Tl; t++) {
            long pos = (long)b * T + canon_zz_global(t, T, N, m->cp.rank);
            slice[b * Tl + t] = inputs[pos];
            slice[n + b * Tl + t] = targets ? targets[pos] : 0;
        }
    }
    m->mem->from_host(a->inputs, slice, n * sizeof(int));
    if (targets) { m->mem->from_host(a->targets_buf, slice + n, n * sizeof(int)); }
    free(slice);
}

// The positions a pass computes per sequence: the slice's T/N with CP, else T.
static int fast_pass_T(const FastModel* m, const FastActs* a, int T) { return a->cp ? T / m->N : T; }

// The ranks that split each sequence's residual stream in this pass (D: context x sequence
// parallelism, zigzag.h) and this rank's index among them: context rank c's slice split again
// K ways is the (c*K + k)-th of the D = N*K slices.
static int fast_seq_ranks(const FastModel* m, const FastActs* a) { return (a->cp ? m->N : 1) * (a->sp ? m->K : 1); }
static int fast_seq_rank(const FastModel* m, const FastActs* a) {
    return (a->cp ? m->cp.rank : 0) * (a->sp ? m->K : 1) + (a->sp ? m->tp->rank : 0);
}

// Stage boundaries are bf16 (stage_elem_bytes): a chunk's input and output are the residual
// stream, which one rank keeps in bf16 too, so sending it loses nothing and halves the bytes.
static float* fast_stage_input(void* vm, void* va) { (void)vm; return (float*)((FastActs*)va)->encoded; }
static floatX* fast_chunk_output(const FastModel* m, const FastActs* a, int B, int T) {
    size_t BTs = (size_t)B * T / (a->sp ? m->K : 1);
    return m->layers > 0 ? a->residual3 + (m->layers - 1) * BTs * m->config.channels : a->encoded;
}
static float* fast_stage_output(void* vm, void* va, int B, int T) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    return (float*)fast_chunk_output(m, a, B, fast_pass_T(m, a, T));
}

// Per-layer views of the activations of the chunk's layer l, at row t0, for a pass over (B, T)
// (att: the whole layer's, attention picks its rows).
struct FastLayerActs {
    floatX *residual, *ln1, *qkv, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3;
    floatX *qkv_h, *atty_h;   // --cp: attention's head-split q|k|v and output (whole sequences)
    float *ln1_mean, *ln1_rstd, *att, *ln2_mean, *ln2_rstd;
};
static FastLayerActs fast_layer_acts(const FastModel* m, const FastActs* a, int l, int B, int T, int t0) {
    size_t C = m->config.channels, Cl = m->Cl, BT = (size_t)B * T, r0 = t0;
    size_t BTs = a->sp ? BT / m->K : BT;   // the residual stream's rows (SP: the slice; never a decode)
    FastLayerActs v;
    v.residual = (l == 0 ? a->encoded : a->residual3 + (l - 1) * BTs * C) + r0 * C;
    v.ln1 = a->ln1 + (l * BT + r0) * C;
    v.ln1_mean = a->ln1_mean + l * BTs + r0;
    v.ln1_rstd = a->ln1_rstd + l * BTs + r0;
    v.qkv = a->qkv + (l * BT + r0) * 3 * Cl;
    v.atty = a->atty + (l * BT + r0) * Cl;
    v.qkv_h = a->cp ? a->qkv_h + l * BT * 3 * Cl : NULL;
    v.atty_h = a->cp ? a->atty_h + l * BT * Cl : NULL;
    v.att = a->att + l * gpu_attention_stats_stride(B, m->NHl, T);
    v.residual2 = a->residual2 + (l * BTs + r0) * C;
    v.ln2 = a->ln2 + (l * BT + r0) * C;
    v.ln2_mean = a->ln2_mean + l * BTs + r0;
    v.ln2_rstd = a->ln2_rstd + l * BTs + r0;
    v.fch = a->fch + (l * BT + r0) * 4 * Cl;
    v.fch_gelu = a->fch_gelu + ((a->recompute ? 0 : l * BT) + r0) * 4 * Cl;
    v.residual3 = a->residual3 + (l * BTs + r0) * C;
    return v;
}

// ---- tensor parallelism: the layers around tensor_parallel.h's collectives ------------------
// With K = 1 each is the one-rank call itself. With K > 1 what crosses the tp group is fp32
// (kernels_fast_tp.cuh says why), in m->tp_sum.

// out (rows,C) = inp (rows,ICl) @ weight^T + bias of a row-parallel layer (attproj, fcproj):
// this rank's partial sum over its ICl inputs; g forward: all-reduce (tp group) of the
// partial outputs (rows,C); the replicated bias added once, after it, rounded to bf16.
// With SP (sp: the pass's a->sp, rows = B*T) g forward is a reduce-scatter along T (tp group)
// of the partial outputs instead, out this rank's slice (B,T/K,C): the same R1 sums, rounded
// as the all-reduce's are, so the slice holds the same bits as those rows without SP.
static void fast_row_parallel_forward(FastModel* m, int sp, floatX* out, const floatX* inp, const floatX* weight,
                                      const floatX* bias, int B, int T, int rows, int ICl) {
    int C = m->config.channels;
    if (m->K == 1) { matmul_forward_fast(out, inp, weight, bias, rows, ICl, C, NULL); return; }
    matmul_forward_partial_fast(m->tp_sum, inp, weight, rows, ICl, C);
    if (sp) {
        tp_sp_reduce_scatter(m->tp, m->tp_sum, m->sp_slice, B, T, C, m->sp_scratch);
        bias_add_round(out, m->sp_slice, bias, (size_t)rows / m->K, C);
        return;
    }
    tp_g_forward(m->tp, m->tp_sum, (size_t)rows * C);
    bias_add_round(out, m->tp_sum, bias, (size_t)rows, C);
}

// dinp (rows,C) = dout (rows,OCl) @ weight of a column-parallel layer (qkv, fc, the LM head):
// this rank's share from its OCl outputs; f backward: all-reduce (tp group) of the input
// gradients (rows,C), rounded to bf16. (Its forward, f, is the identity: every rank holds the
// whole layernorm output.) With SP f backward is a reduce-scatter along T (tp group): dinp
// this rank's slice (B,T/K,C), which its layernorm's backward reads.
static void fast_column_parallel_dinp(FastModel* m, int sp, floatX* dinp, const floatX* dout, const floatX* weight,
                                      int B, int T, int rows, int OCl) {
    int C = m->config.channels;
    if (m->K == 1) { matmul_backward_fast(dinp, NULL, NULL, dout, NULL, weight, 1, rows, C, OCl, NULL); return; }
    matmul_backward_dinp_partial_fast(m->tp_sum, dout, weight, rows, C, OCl);
    if (sp) {
        tp_sp_reduce_scatter(m->tp, m->tp_sum, m->sp_slice, B, T, C, m->sp_scratch);
        bias_add_round(dinp, m->sp_slice, NULL, (size_t)rows / m->K, C);
        return;
    }
    tp_f_backward(m->tp, m->tp_sum, (size_t)rows * C);
    bias_add_round(dinp, m->tp_sum, NULL, (size_t)rows, C);
}

// ---- sequence parallelism (--sp 1): the bf16 tensors along T ----------------------------
// comm.h's collectives move floats: a bf16 row of C channels (C even) travels as C/2 of them.

// full (B,T,C) bf16 <- every rank's slice (B,T/K,C): all-gather along T (tp group). f forward
// before a column-parallel layer (the layernorm's output), g backward before a row-parallel
// layer's (d residual), and the embedding's gradient (its lookup reads every position).
static void fast_sp_all_gather(FastModel* m, floatX* full, const floatX* slice, int B, int T) {
    tp_sp_all_gather(m->tp, (const float*)slice, (float*)full, B, T, m->config.channels / 2, m->sp_scratch);
}

// Where a layernorm before a column-parallel layer writes: with SP its slice (m->sp_ln), which
// fast_sp_f_forward then all-gathers into ln; else ln itself.
static floatX* fast_ln_out(FastModel* m, const FastActs* a, floatX* ln) { return a->sp ? m->sp_ln : ln; }
static void fast_sp_f_forward(FastModel* m, const FastActs* a, floatX* ln, int B, int T) {
    if (a->sp) { fast_sp_all_gather(m, ln, m->sp_ln, B, T); }
}

// A layernorm's weight and bias gradients (rows of x, dy: this pass's, the slice with SP).
// With SP the positions of each sequence are on K ranks: each rank's per-sequence subtrees
// over its chunks (zigzag.h: whole chunks of the R3 tree), all-reduce (tp group) finishing
// them by the R1 tree over ranks, then the R1 tree over sequences: one rank's R3 sums.
static void fast_ln_param_grads(FastModel* m, const FastActs* a, float* dweight, float* dbias, const floatX* x,
                                const floatX* dy, const float* mean, const float* rstd, int B, int T) {
    int C = m->config.channels;
    int chunks = CANON_R / fast_seq_ranks(m, a);   // of each sequence's 8, on this rank's slice
    if (!a->sp) {   // (CP: ZeRO's data x context reduction sums the ranks' partials)
        layernorm_param_grads_x(dweight, dbias, NULL, x, dy, 1, mean, rstd, B, T, C, chunks);
        return;
    }
    layernorm_param_grads_x(NULL, NULL, m->ln_partials, x, dy, 1, mean, rstd, B, T / m->K, C, chunks);
    sp_layernorm_grads_reduce(m->tp, m->ln_partials, B, C);
    sequence_tree(dweight, m->ln_partials, B, C);
    sequence_tree(dbias, m->ln_partials + (size_t)B * C, B, C);
}

// logits (rows,Vl) -> losses (rows); with write_grad the logits become dlogits (dloss each).
// Vocab-parallel: the forward (!write_grad) takes this rank's maxima, all-reduce MAX (tp
// group), its sums of exponentials and the target logit where it holds it, all-reduce sum (tp
// group), into a->ce_stats; the backward reuses them (no exchange) for the gradients.
static void fast_classifier(FastModel* m, FastActs* a, float dloss, int rows, int write_grad) {
    int V = m->config.vocab_size;
    floatX* logits = a->logits;
    const int* targets = a->targets;
    if (m->K == 1) { fused_classifier(logits, a->losses, targets, dloss, rows, V, m->Vl, write_grad); return; }
    float* stats = a->ce_stats;
    if (!write_grad) {
        LAUNCH(classifier_max_tp_kernel, rows, CLASSIFIER_THREADS, stats, logits, m->v0, m->Vl, V);
        cudaLaunchCheck("classifier_max_tp_kernel");
        tp_vocab_ce_max(m->tp, stats, (size_t)rows);
        LAUNCH(classifier_sums_tp_kernel, rows, CLASSIFIER_THREADS, stats, logits, targets, m->v0, m->Vl, V, rows);
        cudaLaunchCheck("classifier_sums_tp_kernel");
        tp_vocab_ce_sums(m->tp, stats + rows, (size_t)rows);   // Z, then the target logits
    }
    LAUNCH(classifier_finish_tp_kernel, rows, CLASSIFIER_THREADS, logits, a->losses, stats, targets, dloss, m->v0,
           m->Vl, V, rows, write_grad);
    cudaLaunchCheck("classifier_finish_tp_kernel");
}

// ---- mixture of experts: llmc/moe.h's layer in bf16 around expert_parallel.h's exchanges ------
// The router is fp32 (its logits from a cuBLASLt matmul with fp32 output, then moe.h's softmax,
// top-k and gates: kernels_moe_det.cuh); the rows that move are bf16. With expert parallelism
// (Q > 1) the dispatch rows and the experts' outputs, and in the backward their gradients,
// cross the ep group as bf16, counted as C/2 floats per row (the same bytes). Under --tp K each
// expert's MLP is split as the dense one (expert_parallel.h): every tp rank routes the same
// positions (its ln2 rows are whole and the same on every rank), exchanges them with its
// counterparts of the ep group, and runs this rank's 4C/K hidden units of each expert; the
// fp32 partial outputs and input gradients of the work rows cross the tp group.

// all-to-all (ep group) of bf16 rows of C: the dispatch rows to the experts' ranks (forward's
// tokens, backward's output gradients) or the experts' rows back to their sources (forward's
// outputs, backward's input gradients)
static void fast_moe_dispatch(const FastModel* m, const MoeRoute* r, const floatX* send, floatX* recv) {
    moe_route_dispatch(r, m->ep, (const float*)send, (float*)recv, m->config.channels / 2);
}
static void fast_moe_return(const FastModel* m, const MoeRoute* r, const floatX* send, floatX* recv) {
    moe_route_return(r, m->ep, (const float*)send, (float*)recv, m->config.channels / 2);
}

// Layer l (chunk-relative) of a pass over (B, T): out (BT,C) from ln (BT,C), its routing kept in
// a->moe[l] for the backward. `next`: the unit ZeRO-3 prefetches after the experts.
static void fast_moe_forward(FastModel* m, FastActs* a, int l, const floatX* routerw, const floatX* ln, floatX* out,
                             int next, int B, int T) {
    const GPT2Config* c = &m->config;
    const MemOps* mem = m->mem;
    Zero* z = m->zero;
    FastMoeLayer* x = &a->moe[l];
    MoeRoute* route = &x->route;
    int C = c->channels, E = m->E, k = m->top_k, Q = m->Q, BT = B * T;
    size_t slots = (size_t)BT * k;
    // the router: fp32 logits, probabilities, the k chosen experts and their gates per position
    moe_router_forward_fast(x->probs, x->chosen, x->gates, ln, routerw, BT, C, E, k);
    mem->to_host(route->chosen, x->chosen, slots * sizeof(int));
    moe_route_plan(route, m->ep, B, T);   // the counts and positions each expert receives
    if (route->n_recv > a->moe_rows) { fatal("internal: %d expert rows, room for %d", route->n_recv, a->moe_rows); }
    mem->from_host(x->slot_row, route->slot_row, slots * sizeof(int));
    mem->from_host(x->row_pos, route->row_pos, slots * sizeof(int));
    mem->from_host(x->perm, route->perm, (size_t)route->n_recv * sizeof(int));
    mem->from_host(x->inv, route->inv, (size_t)route->n_recv * sizeof(int));
    size_t nleaf = (size_t)Q * B * CANON_R + 1;
    mem->from_host(x->leaf, route->leaf, (size_t)m->El * nleaf * sizeof(int));
    // the tokens to their experts (expert-major work rows; one rank: the dispatch rows)
    if (Q == 1) {
        moe_gather_rows_fast(x->xin, ln, x->row_pos, (int)slots, C);
    } else {
        moe_gather_rows_fast(a->moe_send, ln, x->row_pos, (int)slots, C);
        fast_moe_dispatch(m, route, a->moe_send, a->moe_recv);
        moe_gather_rows_fast(x->xin, a->moe_recv, x->perm, route->n_recv, C);
    }
    // each local expert's MLP over the rows it received: fc with GELU fused, fcproj with its bias
    int unit = zero_expert_unit(z, m->first_layer + l);
    floatX* y = Q == 1 ? x->ret : a->moe_y;
    MoeExperts<const floatX> w = expert_views<const floatX>(z, unit, fast_params(m, unit, next));
    moe_experts_forward_fast(y, m->moe_partial, x->fch, x->fch_gelu, x->xin, w, route->first, m->El, C, 4 * m->Cl);
    if (m->K > 1) {   // g forward: all-reduce (tp group) of the work rows' partial outputs, then fcproj's bias
        tp_g_forward(m->tp, m->moe_partial, (size_t)route->n_recv * C);
        moe_bias_add_round(y, m->moe_partial, w.fcprojb, route->first, m->El, C);
    }
    fast_release(m, unit);
    if (Q > 1) {   // the outputs back to their sources, in dispatch-row order
        moe_gather_rows_fast(a->moe_send, a->moe_y, x->inv, route->n_recv, C);
        fast_moe_return(m, route, a->moe_send, x->ret);
    }
    moe_combine_fast(out, x->ret, x->gates, x->slot_row, BT, k, C);
    // the load-balancing loss of this layer and microbatch
    moe_expert_prob_sums(m->psum, x->probs, B, T, E);
    mem->to_host(m->psum_host, m->psum, (size_t)E * sizeof(float));
    x->aux = moe_aux_loss(route->count, m->psum_host, E, k, BT, c->aux_loss_coef);
    for (int e = 0; e < E; e++) { m->counters.tokens[(size_t)l * E + e] += route->count[e]; }
    long long out_rows, in_rows;
    moe_route_remote_rows(route, m->ep->rank, &out_rows, &in_rows);
    m->counters.passes++;
    m->counters.rows_out += out_rows;
    m->counters.rows_in += in_rows;
}

// The backward of layer l's experts, in the dense layer's two halves (part). Input half: dln
// (BT,C) from dout (BT,C), through the combine, the router and the experts' input gradients,
// with expert parallelism's two all-to-alls of gradients. Weight half: the router's weight
// gradient into drouterw and the experts' into their unit, one slice per source microbatch of
// the ep group (expert_parallel.h THE GRADIENT ORDER: zero.h combines the slices), from the
// gradients the input half left (a split backward keeps them per layer in a->moe[l]).
// `next`: the unit ZeRO-3 prefetches after the experts. With CP (B, T whole sequences, ln this
// rank's slice) the router's weight gradient is this rank's positions' share, as the dense
// weights' are, and the experts', computed whole by every rank of the group, go to ZeRO as this
// rank's part of each slice, -0.0f elsewhere (cp_keep_part: ZeRO reduces the expert units over
// expert-data x context ranks, so the sum is the one-rank gradient).
static void fast_moe_backward(FastModel* m, FastActs* a, FastGrads* g, int l, const floatX* routerw, float* drouterw,
                              const floatX* ln, const floatX* dout, floatX* dln, int next, int B, int T, int part) {
    const GPT2Config* c = &m->config;
    Zero* z = m->zero;
    FastMoeLayer* x = &a->moe[l];
    const MoeRoute* route = &x->route;
    int C = c->channels, E = m->E, k = m->top_k, Q = m->Q, BT = B * T, split = a->split_backward;
    int unit = zero_expert_unit(z, m->first_layer + l);
    // where the weight half finds the router's output gradient, the experts' output gradients
    // (expert-major work rows; one rank: the dispatch rows are the work rows) and fc's
    floatX* dlogits_bf16 = split ? x->dlogits_bf16 : g->dlogits_bf16;
    floatX* dslots = split && Q == 1 ? x->dy : g->dslots;
    floatX* dy = Q == 1 ? dslots : split ? x->dy : g->dy;
    floatX* dh = split ? x->dh : g->dh;
    // expert e's rows from source q begin at moe.h's leaf[e*nleaf + q*B*8]
    size_t nleaf = (size_t)Q * B * CANON_R + 1;
    int* src_first = (int*)malloc_or_die(sizeof(int) * (size_t)m->El * (Q + 1), "routing");
    for (int e = 0; e < m->El; e++) {
        for (int q = 0; q < Q; q++) { src_first[e * (Q + 1) + q] = route->leaf[e * nleaf + (size_t)q * B * CANON_R]; }
        src_first[e * (Q + 1) + Q] = route->leaf[e * nleaf + nleaf - 1];
    }
    if (part & BACKWARD_INPUT) {
        // the combine: each slot's gate gradient and its expert output's gradient (dispatch rows)
        moe_combine_backward_fast(g->dgate, dslots, dout, x->ret, x->gates, x->slot_row, BT, k, C);
        // the router, with the load-balancing loss of this microbatch (1/M of the step's loss each)
        moe_aux_grad(m->daux_host, route->count, E, k, BT, c->aux_loss_coef, z->local_microbatches * z->streams);
        m->mem->from_host(g->daux, m->daux_host, (size_t)E * sizeof(float));
        moe_router_backward_fast(g->drouter, g->dlogits, dlogits_bf16, x->probs, x->chosen, x->gates, g->dgate, g->daux,
                                 routerw, BT, C, E, k);
        if (Q > 1) {   // the output gradients to the experts (expert-major work rows)
            fast_moe_dispatch(m, route, dslots, g->dwork);
            moe_gather_rows_fast(dy, g->dwork, x->perm, route->n_recv, C);
        }
        moe_experts_backward_input_fast(g->dx, m->moe_partial, dh, dy, x->fch,
                                        expert_views<const floatX>(z, unit, fast_params(m, unit, next)), src_first, Q,
                                        m->El, C, 4 * m->Cl);
        fast_release(m, unit);
        if (m->K > 1) {   // f backward: all-reduce (tp group) of the work rows' partial input gradients, rounded once
            tp_f_backward(m->tp, m->moe_partial, (size_t)route->n_recv * C);
            bias_add_round(g->dx, m->moe_partial, NULL, (size_t)route->n_recv, C);
        }
        // the input gradients back to their sources (dispatch rows), then each position's sum
        const floatX* dret = g->dx;
        if (Q > 1) {
            moe_gather_rows_fast(g->dwork, g->dx, x->inv, route->n_recv, C);
            fast_moe_return(m, route, g->dwork, g->dslots);
            dret = g->dslots;
        }
        moe_dinput_combine_fast(dln, g->drouter, dret, x->slot_row, BT, k, C);
    }
    if (part & BACKWARD_WEIGHT) {
        if (a->cp) {   // this rank's positions of the router's output gradient
            fast_take_slice(m->mem, g->dlogits_mine, dlogits_bf16, B, T, E, m->N, m->cp.rank);
            moe_router_weight_grad_fast(drouterw, g->dlogits_mine, ln, BT / m->N, C, E);
        } else {
            moe_router_weight_grad_fast(drouterw, dlogits_bf16, ln, BT, C, E);
        }
        float* dunit = zero_grad_unit(z, unit);
        size_t slice = z->lay.size[unit];
        moe_experts_backward_weight_fast(expert_views<float>(z, unit, dunit), slice, dy, dh, x->fch_gelu, x->xin,
                                         src_first, Q, m->El, C, 4 * m->Cl);
        for (int q = 0; a->cp && q < Q; q++) { cp_keep_part(&m->cp, dunit + q * slice, slice); }
        zero_grad_unit_done(z, unit);
    }
    free(src_first);
}

// A mixture-of-experts layer (fast_moe_forward) in a pass over B sequences of which this rank
// holds T positions each (the slice with CP): a->proj, the rows of this rank's residual stream,
// from ln2 (ln: the pass's rows, whole on every tp rank). The layer's output is whole on every
// tp rank, and with SP this rank keeps its slice. With CP every rank of the cp group runs the
// layer on whole sequences, as deterministic mode does: ln all-gathered along T (cp group,
// bf16), the one-rank routing and arithmetic, and each rank keeps its slice of the output (the
// engine refuses --cp with --sp 1 for experts, as deterministic mode does, so D below is N or
// K). Whole rather than each rank routing its own positions: the routing
// plan, the capacity and the load-balancing loss (a product of the microbatch's expert counts
// and probability sums) are then one rank's, and so are the experts' weight gradients
// (fast_moe_backward), at the price of every rank of the group computing each expert row.
static void fast_moe_layer_forward(FastModel* m, FastActs* a, int l, const floatX* routerw, const floatX* ln, int next,
                                   int B, int T) {
    int C = m->config.channels, Tw = a->cp ? T * m->N : T;
    if (!a->cp && !a->sp) {
        fast_moe_forward(m, a, l, routerw, ln, a->proj, next, B, T);
        return;
    }
    if (a->cp) {   // all-gather (cp group, bf16) of ln along T
        fast_cp_gather_sequences(&m->cp, m->moe_whole[0], ln, B, Tw, C);
        ln = m->moe_whole[0];
    }
    fast_moe_forward(m, a, l, routerw, ln, m->moe_whole[1], next, B, Tw);
    fast_take_slice(m->mem, a->proj, m->moe_whole[1], B, Tw, C, fast_seq_ranks(m, a), fast_seq_rank(m, a));
}

// Its backward (fast_moe_backward's halves): dln (d ln2, the rows of this rank's residual
// stream) from g->dresidual (the layer output's gradient, likewise), on whole sequences as the
// forward ran: d out all-gathered along T (with SP over the tp group, with CP over the cp
// group, bf16), d ln2 whole, of which this rank keeps its slice.
static void fast_moe_layer_backward(FastModel* m, FastActs* a, FastGrads* g, int l, const floatX* routerw,
                                    float* drouterw, const floatX* ln, floatX* dln, int next, int B, int T, int part) {
    int C = m->config.channels, Tw = a->cp ? T * m->N : T, in = part & BACKWARD_INPUT;
    const floatX* dout = g->dresidual;
    if (!a->cp && !a->sp) {
        fast_moe_backward(m, a, g, l, routerw, drouterw, ln, dout, dln, next, B, T, part);
        return;
    }
    if (in && a->sp) {   // all-gather (tp group, bf16) along T
        fast_sp_all_gather(m, g->dfull, g->dresidual, B, T);
        dout = g->dfull;
    }
    if (in && a->cp) {   // all-gather (cp group, bf16) along T
        fast_cp_gather_sequences(&m->cp, m->moe_whole[0], dout, B, Tw, C);
        dout = m->moe_whole[0];
    }
    fast_moe_backward(m, a, g, l, routerw, drouterw, ln, dout, m->moe_whole[1], next, B, Tw, part);
    if (in) { fast_take_slice(m->mem, dln, m->moe_whole[1], B, Tw, C, fast_seq_ranks(m, a), fast_seq_rank(m, a)); }
}

// The embeddings of `rows` positions from row t0 of a pass over (B, T) (all of the pass's
// positions, or one row of the sampler's (1, T) with the KV cache). T: the whole sequence; with
// CP and SP the residual stream holds this rank's D-way slice of each sequence (two stretches).
static void fast_embed_rows(FastModel* m, FastActs* a, int B, int T, int t0, int rows) {
    int C = m->config.channels;
    floatX* wte = fast_params(m, ZERO_WTE, ZERO_WPE);
    floatX* wpe = fast_params(m, ZERO_WPE, m->layers > 0 ? ZERO_LAYER(m->first_layer) : -1);
    int Bp = rows == 1 ? 1 : B, Tp = rows == 1 ? 1 : T;
    int D = fast_seq_ranks(m, a), r = fast_seq_rank(m, a), stretch = T / (2 * D);
    // fn(row, pos) for each of this rank's stretches of each sequence (D > 1): its first row in
    // the slice and its first global position
    auto each_stretch = [&](auto fn) {
        for (int b = 0; b < B; b++) {
            for (int half = 0; half < 2; half++) { fn((size_t)b * (T / D) + half * stretch, zz_stretch_begin(T, D, r, half)); }
        }
    };
    if (m->K == 1 && D == 1) {
        encoder_forward_fast(a->encoded + (size_t)t0 * C, a->inputs + t0, wte, wpe + (size_t)t0 * C, Bp, Tp, C);
    } else if (m->K == 1) {   // CP: the positions of this rank's slice
        each_stretch([&](size_t row, size_t pos) {
            encoder_forward_fast(a->encoded + row * C, a->inputs + row, wte, wpe + pos * C, 1, stretch, C);
        });
    } else {   // vocab-parallel: each row looked up by the rank holding its token (-0 elsewhere),
               // all-reduce (tp group), or with SP reduce-scatter along T (tp group), then the positions
        const float* sum = m->tp_sum;
        encoder_lookup_tp(m->tp_sum, a->inputs + t0, wte, m->v0, m->Vl, (size_t)rows, C);
        if (a->sp) {
            tp_sp_reduce_scatter(m->tp, m->tp_sum, m->sp_slice, B, fast_pass_T(m, a, T), C, m->sp_scratch);
            sum = m->sp_slice;
        } else {
            tp_vocab_embedding_reduce(m->tp, m->tp_sum, (size_t)rows * C);
        }
        if (D == 1) {
            encoder_add_positions_tp(a->encoded + (size_t)t0 * C, sum, wpe + (size_t)t0 * C, Bp, Tp, C);
        } else {
            each_stretch([&](size_t row, size_t pos) {
                encoder_add_positions_tp(a->encoded + row * C, sum + row * C, wpe + pos * C, 1, stretch, C);
            });
        }
    }
    fast_release(m, ZERO_WTE);
    fast_release(m, ZERO_WPE);
}

static void fast_embed_forward(void* vm, void* va, int B, int T) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    fast_embed_rows(m, a, B, T, 0, B * fast_pass_T(m, a, T));
}

// The chunk's layers on `rows` positions from row t0 (decode: rows == 1, the sampler's (1, T)
// pass with the rows before t0 in the KV cache), each layer's residual add fused into the next
// layernorm: the next layer's ln1 or, after the model's last layer, the final layernorm (lnf
// is computed here, the head reads it). After a chunk's last layer that the next stage
// continues, the residual add alone (the next chunk's first ln1 reads the bf16 sum it stores,
// as the fused kernel does).
static void fast_layers_rows(FastModel* m, FastActs* a, int B, int T, int t0, int rows) {
    if (m->layers == 0) { return; }
    const GPT2Config* c = &m->config;
    Zero* z = m->zero;
    int C = c->channels, Cl = m->Cl, NHl = m->NHl, first = m->first_layer, last = first + m->layers;
    int LNF = z->lay.num_units - 1, decode = rows == 1 && B * T > 1;
    int after_last = m->has_head ? LNF : -1;   // what ZeRO-3 prefetches after the chunk's last layer
    // what ZeRO-3 prefetches after layer l's experts (their unit comes after the layer's with
    // experts), and after layer l's unit
    auto after_experts = [&](int l) { return l + 1 < last ? ZERO_LAYER(l + 1) : after_last; };
    auto after_layer = [&](int l) { return m->E > 0 ? zero_expert_unit(z, l) : after_experts(l); };
    floatX* unit = fast_params(m, ZERO_LAYER(first), after_layer(first));
    LayerViews<floatX> w = layer_views(z, ZERO_LAYER(first), unit);
    FastLayerActs x0 = fast_layer_acts(m, a, 0, B, T, t0);
    int sp = a->sp, rs = sp ? rows / m->K : rows;   // rs: the rows of the residual stream (SP: the slice)
    layernorm_forward_fast(fast_ln_out(m, a, x0.ln1), x0.ln1_mean, x0.ln1_rstd, x0.residual, w.ln1w, w.ln1b, rs, C);
    fast_sp_f_forward(m, a, x0.ln1, B, T);
    for (int l = first; l < last; l++) {
        FastLayerActs x = fast_layer_acts(m, a, l - first, B, T, t0);
        // column-parallel qkv of this rank's NHl heads (f: identity), its heads' attention,
        // row-parallel attproj (g: all-reduce, then the bias)
        matmul_forward_fast(x.qkv, x.ln1, w.qkvw, w.qkvb, rows, C, 3 * Cl, NULL);
        if (decode) {   // query row t0 against the cached keys and values of rows 0..t0
            attention_forward_fast_row(x.atty - (size_t)t0 * Cl, x.att, x.qkv - (size_t)t0 * 3 * Cl, t0, Cl, NHl);
        } else if (a->cp && m->ring) {   // this rank's queries against every rank's K|V block around the ring
            fast_cp_ring_forward(&m->cp, &m->ring_bufs, x.atty, x.att, x.qkv, B, T * m->N, Cl, NHl);
        } else if (a->cp) {   // this rank's NH/N heads on whole sequences, between two all-to-alls (cp group)
            fast_cp_a2a_forward(&m->cp, x.atty, x.att, x.qkv_h, x.atty_h, x.qkv, B, T * m->N, Cl, NHl);
        } else {
            fast_attention_forward(x.atty, x.att, x.qkv, B, T, Cl, NHl);
        }
        fast_row_parallel_forward(m, sp, a->proj, x.atty, w.attprojw, w.attprojb, B, T, rows, Cl);
        fused_residual_layernorm(x.residual2, fast_ln_out(m, a, x.ln2), x.ln2_mean, x.ln2_rstd, x.residual, a->proj,
                                 w.ln2w, w.ln2b, rs, C);
        fast_sp_f_forward(m, a, x.ln2, B, T);
        if (m->E > 0) {   // the mixture of experts in place of the MLP
            fast_moe_layer_forward(m, a, l - first, w.routerw, x.ln2, after_experts(l), B, T);
        } else {          // column-parallel fc (+ GELU, keeps fch), row-parallel fcproj
            matmul_forward_fast(x.fch_gelu, x.ln2, w.fcw, w.fcb, rows, C, 4 * Cl, x.fch);
            fast_row_parallel_forward(m, sp, a->proj, x.fch_gelu, w.fcprojw, w.fcprojb, B, T, rows, 4 * Cl);
        }
        if (l + 1 < last) {
            floatX* next = fast_params(m, ZERO_LAYER(l + 1), after_layer(l + 1));
            LayerViews<floatX> wn = layer_views(z, ZERO_LAYER(l + 1), next);
            FastLayerActs xn = fast_layer_acts(m, a, l + 1 - first, B, T, t0);
            fused_residual_layernorm(x.residual3, fast_ln_out(m, a, xn.ln1), xn.ln1_mean, xn.ln1_rstd, x.residual2,
                                     a->proj, wn.ln1w, wn.ln1b, rs, C);
            fast_sp_f_forward(m, a, xn.ln1, B, T);
            fast_release(m, ZERO_LAYER(l));
            w = wn;
        } else if (m->has_head) {
            floatX* lnf = fast_params(m, LNF, ZERO_WTE);
            fused_residual_layernorm(x.residual3, fast_ln_out(m, a, a->lnf + (size_t)t0 * C), a->lnf_mean + t0,
                                     a->lnf_rstd + t0, x.residual2, a->proj, lnf, lnf + C, rs, C);
            fast_sp_f_forward(m, a, a->lnf, B, T);   // the LM head is column-parallel
            fast_release(m, LNF);
            fast_release(m, ZERO_LAYER(l));
        } else {
            residual_forward_fast(x.residual3, x.residual2, a->proj, (size_t)rs * C);
            fast_release(m, ZERO_LAYER(l));
        }
    }
}

static void fast_layers_forward(void* vm, void* va, int B, int T) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    int Tl = fast_pass_T(m, a, T);
    fast_layers_rows(m, a, B, Tl, 0, B * Tl);
}

// logits of `rows` positions from row t0, bf16, and with targets the losses. A head chunk
// without layers forms lnf itself from its input (the layers' fused kernel does otherwise).
// With `training` on one stage, wte stays held for the backward. The classifier runs again in
// the backward to turn the logits into their gradient (it needs the step's dloss).
static void fast_head_rows(FastModel* m, FastActs* a, int t0, int rows, int training) {
    const GPT2Config* c = &m->config;
    int C = c->channels, Vl = m->Vl;
    if (m->layers == 0) {
        floatX* lnf = fast_params(m, m->zero->lay.num_units - 1, ZERO_WTE);
        layernorm_forward_fast(a->lnf + (size_t)t0 * C, a->lnf_mean + t0, a->lnf_rstd + t0, a->encoded + (size_t)t0 * C,
                               lnf, lnf + C, rows, C);
        fast_release(m, m->zero->lay.num_units - 1);
    }
    floatX* wte = fast_params(m, ZERO_WTE, -1);
    // the vocab-parallel LM head: this rank's Vl logits of each position (f: identity)
    matmul_forward_fast(a->logits + (size_t)t0 * Vl, a->lnf + (size_t)t0 * C, wte, NULL, rows, C, Vl, NULL);
    if (a->targets) { fast_classifier(m, a, 0.0f, rows, 0); }
    if (!(training && m->hold_head)) { fast_release(m, ZERO_WTE); }
}

static void fast_head_forward(void* vm, void* va, int B, int T, int training) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    fast_head_rows(m, a, 0, B * fast_pass_T(m, a, T), training);
}

// ---- generation with the KV cache ---------------------------------------------------------
// Row t of the sampler's pass over (1, T), the rows before it left by the earlier calls (the
// cache: each layer's qkv rows). Row t equals the full forward's row t: every kernel is per
// row except attention, whose query row t reads the key and value rows 0..t only (later key
// rows are masked to a weight of exactly 0 in the full pass).
static void fast_embed_decode(void* vm, void* va, int token, int t, int T) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    m->mem->from_host(a->inputs + t, &token, sizeof(int));
    fast_embed_rows(m, a, 1, T, t, 1);
}
static void fast_layers_decode(void* vm, void* va, int t, int T) { fast_layers_rows((FastModel*)vm, (FastActs*)va, 1, T, t, 1); }
static void fast_head_decode(void* vm, void* va, int t, int T) { (void)T; fast_head_rows((FastModel*)vm, (FastActs*)va, t, 1, 0); }

// The R3 sum of the pass's per-position losses; with CP every position's, all-gathered (cp
// group, fp32) along T, summed as one rank sums them.
static float fast_loss_sum(void* vm, void* va, int B, int T) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    if (!a->cp) { return position_sum(a->losses, B, T); }
    cp_gather_sequences(&m->cp, a->losses, a->losses_full, B, T, 1);
    return position_sum(a->losses_full, B, T);
}

// The probabilities at one position, from its bf16 logits, formed on the host.
static void fast_probs_at(void* vm, void* va, int position, float* probs) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    int V = m->config.vocab_size, Vp = m->config.padded_vocab_size, Vl = m->Vl;
    floatX* logits = (floatX*)malloc_or_die(sizeof(floatX) * Vl, "sample logits");
    m->mem->to_host(logits, a->logits + (size_t)position * Vl, sizeof(floatX) * Vl);
    for (int v = 0; v < Vl; v++) { probs[v] = __bfloat162float(logits[v]); }
    if (m->K > 1) {   // every rank's Vl logits (exactly, in fp32): all-gather (tp group)
        m->mem->from_host(m->probs_slice, probs, sizeof(float) * Vl);
        tp_gather_vocab(m->tp, m->probs_slice, m->probs_all, (size_t)Vl);
        m->mem->to_host(probs, m->probs_all, sizeof(float) * Vp);
    }
    float maxv = -canon_inf(), sum = 0.0f;
    for (int v = 0; v < V; v++) { if (probs[v] > maxv) { maxv = probs[v]; } }
    for (int v = 0; v < V; v++) { probs[v] = canon_expf(probs[v] - maxv); sum += probs[v]; }
    for (int v = 0; v < Vp; v++) { probs[v] = v < V ? probs[v] / sum : 0.0f; }
    free(logits);
}

static void* fast_grads_create(void* vm, int B, int T, int split_seqs, size_t* bytes) {
    FastModel* m = (FastModel*)vm;
    size_t BTC = (size_t)B * T * m->config.channels, BTCl = (size_t)B * T * m->Cl;
    FastGrads* g = (FastGrads*)calloc_or_die(1, sizeof(FastGrads), "activation gradients");
    *bytes = 0;
    int sp = m->sp && split_seqs == SEQS_SPLIT, cp = m->N > 1 && split_seqs == SEQS_SPLIT;
    size_t BTCw = BTC;   // CP: every per-position gradient holds the slice; the embedding's is gathered whole
    if (cp) { BTC /= m->N; BTCl /= m->N; }
    g->dresidual = act(m, sp ? BTC / m->K : BTC, bytes);   // SP: the slice
    g->dbtc = act(m, BTC, bytes);
    g->dqkv = act(m, 3 * BTCl, bytes);
    g->dbt4c = act(m, 4 * BTCl, bytes);
    g->dfull = act(m, cp && m->has_embedding ? BTCw : sp ? BTC : 0, bytes);
    if (m->E > 0) {
        size_t BT = (size_t)B * T, C = m->config.channels, E = m->E, slots = BT * m->top_k, rows = m->Q * slots;
        g->dgate = act_f(m, slots, bytes);
        g->dlogits = act_f(m, BT * E, bytes);
        g->drouter = act_f(m, BT * C, bytes);
        g->daux = act_f(m, E, bytes);
        g->dlogits_bf16 = act(m, BT * E, bytes);
        g->dlogits_mine = act(m, cp ? BT / m->N * E : 0, bytes);
        g->dslots = act(m, rows * C, bytes);
        g->dy = act(m, rows * C, bytes);
        g->dh = act(m, rows * 4 * C, bytes);
        g->dx = act(m, rows * C, bytes);
        g->dwork = act(m, rows * C, bytes);
    }
    return g;
}

static void fast_grads_destroy(void* vm, void* vg) {
    FastModel* m = (FastModel*)vm;
    FastGrads* g = (FastGrads*)vg;
    m->mem->release(g->dresidual);
    m->mem->release(g->dbtc);
    m->mem->release(g->dqkv);
    m->mem->release(g->dbt4c);
    if (g->dfull) { m->mem->release(g->dfull); }
    void* moe_all[] = {g->dgate, g->dlogits, g->drouter, g->daux, g->dlogits_bf16, g->dlogits_mine, g->dslots, g->dy,
                       g->dh, g->dx, g->dwork};
    for (size_t i = 0; i < sizeof(moe_all) / sizeof(moe_all[0]); i++) {
        if (moe_all[i]) { m->mem->release(moe_all[i]); }
    }
    free(g);
}

static float* fast_grad_residual(void* vm, void* vg) { (void)vm; return (float*)((FastGrads*)vg)->dresidual; }

// The backwards in two halves (BACKWARD_INPUT, BACKWARD_WEIGHT; whole: both, interleaved so
// that each weight gradient runs right after the input gradient it reads). The input half
// needs the bf16 weights and produces d(residual); the weight half needs no weights: the
// cuBLASLt weight-gradient matmuls (fp32 out) and the exact bias / layernorm reductions read
// the activations and the gradients the input half kept (FastOutGrads). Each half computes
// exactly what the whole computes, so a split schedule changes no bits.

// (the head's chunk) Input half: d(loss)/d(logits) in place, d lnf, and d(residual) =
// d(loss)/d(chunk output). Weight half: the LM-head half of wte's gradient and lnf's.
static void fast_head_backward(void* vm, void* va, void* vg, int B, int T, float dloss, int part) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    FastGrads* g = (FastGrads*)vg;
    const GPT2Config* c = &m->config;
    Zero* z = m->zero;
    T = fast_pass_T(m, a, T);
    int C = c->channels, BT = B * T, in = part & BACKWARD_INPUT, wt = part & BACKWARD_WEIGHT;
    int LNF = z->lay.num_units - 1, BTs = a->sp ? BT / m->K : BT;   // BTs: the residual stream's rows
    floatX* dlnf = a->split_backward ? a->dlnf : g->dbtc;
    floatX* out = fast_chunk_output(m, a, B, T);   // lnf's input
    if (in) {
        floatX* wte = fast_params(m, ZERO_WTE, -1);   // with hold_head: still held since the forward
        fast_classifier(m, a, dloss, BT, 1);
        fast_column_parallel_dinp(m, a->sp, dlnf, a->logits, wte, B, T, BT, m->Vl);
    }
    if (wt) {
        matmul_backward_fast(NULL, zero_grad_unit(z, ZERO_WTE), NULL, a->logits, a->lnf, NULL, B, T, C, m->Vl, NULL);
        zero_grad_unit_done(z, ZERO_WTE);
    }
    if (in) {
        fast_release(m, ZERO_WTE);
        floatX* lnf = fast_params(m, LNF, m->layers > 0 ? ZERO_LAYER(m->first_layer + m->layers - 1) : -1);
        cudaCheck(cudaMemsetAsync(g->dresidual, 0, sizeof(floatX) * (size_t)BTs * C));
        layernorm_backward_fast(g->dresidual, dlnf, out, lnf, a->lnf_mean, a->lnf_rstd, BTs, C);
        fast_release(m, LNF);
    }
    if (wt) {
        float* dlnfw = zero_grad_unit(z, LNF);
        fast_ln_param_grads(m, a, dlnfw, dlnfw + C, out, dlnf, a->lnf_mean, a->lnf_rstd, B, T);
        zero_grad_unit_done(z, LNF);
    }
}

// Where the chunk's layer l keeps the gradients at the outputs of its weights between its
// input and weight halves: per layer in acts under a split backward, else grads' one set
// (d fcproj and d attproj are then d(residual) itself, read before the layernorm below
// changes it).
struct FastOutGrads { floatX *dfcproj, *dfch, *dln2, *dattproj, *dqkv, *dln1; };
static FastOutGrads fast_out_grads(const FastModel* m, const FastActs* a, const FastGrads* g, int l, int B, int T) {
    if (!a->split_backward) {
        floatX* dres = a->sp ? g->dfull : g->dresidual;   // SP: d(residual) all-gathered along T
        return (FastOutGrads){dres, g->dbt4c, g->dbtc, dres, g->dqkv, g->dbtc};
    }
    size_t BT = (size_t)B * T, BTC = BT * m->config.channels, BTCl = BT * m->Cl;
    return (FastOutGrads){a->dfcproj + l * BTC, a->dfch + l * 4 * BTCl, a->dln2 + l * BTC, a->dattproj + l * BTC,
                          a->dqkv + l * 3 * BTCl, a->dln1 + l * BTC};
}

// A row-parallel layer's d(output) (rows B*T) from d(residual) for the input half: with SP g
// backward, the all-gather along T (tp group) of the slice; under a split backward a copy kept
// for the weight half; else d(residual) itself (fast_out_grads).
static void fast_row_parallel_dout(FastModel* m, const FastActs* a, const FastGrads* g, floatX* dout, int B, int T) {
    if (a->sp) {
        fast_sp_all_gather(m, dout, g->dresidual, B, T);
    } else if (a->split_backward) {
        cudaCheck(cudaMemcpyAsync(dout, g->dresidual, sizeof(floatX) * (size_t)B * T * m->config.channels,
                                  cudaMemcpyDeviceToDevice));
    }
}

// The chunk's layers. Input half: g->dresidual = d(loss)/d(chunk output) in, d(loss)/d(chunk
// input) out. Weight half: each layer's weight gradients, handed to zero.h when complete.
static void fast_layers_backward(void* vm, void* va, void* vg, int B, int T, int part) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    FastGrads* g = (FastGrads*)vg;
    const GPT2Config* c = &m->config;
    Zero* z = m->zero;
    T = fast_pass_T(m, a, T);
    int C = c->channels, Cl = m->Cl, BT = B * T, in = part & BACKWARD_INPUT, wt = part & BACKWARD_WEIGHT;
    int sp = a->sp, BTs = sp ? BT / m->K : BT;   // BTs: the residual stream's rows (SP: the slice)
    int first = m->first_layer;
    for (int l = first + m->layers - 1; l >= first; l--) {
        LayerViews<floatX> w;      // the bf16 parameters (input half)
        LayerViews<float> dw;      // where their gradients go (weight half)
        memset(&w, 0, sizeof(w));
        memset(&dw, 0, sizeof(dw));
        int below = l > first ? ZERO_LAYER(l - 1) : -1;   // what ZeRO-3 prefetches after the layer
        if (in) { w = layer_views(z, ZERO_LAYER(l), fast_params(m, ZERO_LAYER(l), m->E > 0 ? zero_expert_unit(z, l) : below)); }
        if (wt) { dw = layer_views(z, ZERO_LAYER(l), zero_grad_unit(z, ZERO_LAYER(l))); }
        FastLayerActs x = fast_layer_acts(m, a, l - first, B, T, 0);
        FastOutGrads d = fast_out_grads(m, a, g, l - first, B, T);
        if (m->E > 0) {   // the experts (d(residual) is their output's gradient, read before ln2's backward
                          // adds to it)
            fast_moe_layer_backward(m, a, g, l - first, w.routerw, dw.routerw, x.ln2, d.dln2, below, B, T, part);
        } else {
            // MLP; the fcproj backward's epilogue applies gelu'(fch): d fch
            if (in) { fast_row_parallel_dout(m, a, g, d.dfcproj, B, T); }
            // (row-parallel fcproj: g backward is the identity, d fch is this rank's 4C/K columns;
            // its replicated bias's gradient is the same on every rank)
            if (in) { matmul_backward_fast(d.dfch, NULL, NULL, d.dfcproj, NULL, w.fcprojw, B, T, 4 * Cl, C, x.fch); }
            if (wt) {
                if (a->recompute) { gelu_forward_fast(x.fch_gelu, x.fch, (size_t)BT * 4 * Cl); }
                matmul_backward_fast(NULL, dw.fcprojw, dw.fcprojb, d.dfcproj, x.fch_gelu, NULL, B, T, 4 * Cl, C, NULL);
            }
            if (in) { fast_column_parallel_dinp(m, sp, d.dln2, d.dfch, w.fcw, B, T, BT, 4 * Cl); }
            if (wt) { matmul_backward_fast(NULL, dw.fcw, dw.fcb, d.dfch, x.ln2, NULL, B, T, C, 4 * Cl, NULL); }
        }
        if (in) { layernorm_backward_fast(g->dresidual, d.dln2, x.residual2, w.ln2w, x.ln2_mean, x.ln2_rstd, BTs, C); }
        if (wt) { fast_ln_param_grads(m, a, dw.ln2w, dw.ln2b, x.residual2, d.dln2, x.ln2_mean, x.ln2_rstd, B, T); }
        // attention; d atty in g->dbtc (the whole backward's d ln2 is used up by now)
        if (in) { fast_row_parallel_dout(m, a, g, d.dattproj, B, T); }
        if (in) { matmul_backward_fast(g->dbtc, NULL, NULL, d.dattproj, NULL, w.attprojw, B, T, Cl, C, NULL); }
        if (wt) { matmul_backward_fast(NULL, dw.attprojw, dw.attprojb, d.dattproj, x.atty, NULL, B, T, Cl, C, NULL); }
        if (in && a->cp && m->ring) {   // K|V around the ring again, dk|dv partials to their owners
            fast_cp_ring_backward(&m->cp, &m->ring_bufs, d.dqkv, g->dbtc, x.qkv, x.atty, x.att, B, T * m->N, Cl, m->NHl);
        } else if (in && a->cp) {   // d out to the heads, their backward, d q|k|v back (all-to-alls, cp group)
            fast_cp_a2a_backward(&m->cp, d.dqkv, g->dbtc, x.qkv_h, x.atty_h, x.att, m->att_D, B, T * m->N, Cl, m->NHl);
        } else if (in) {
            fast_attention_backward(d.dqkv, g->dbtc, x.qkv, x.atty, x.att, m->att_D, B, T, Cl, m->NHl);
        }
        if (in) {
            fast_column_parallel_dinp(m, sp, d.dln1, d.dqkv, w.qkvw, B, T, BT, 3 * Cl);
        }
        if (wt) { matmul_backward_fast(NULL, dw.qkvw, dw.qkvb, d.dqkv, x.ln1, NULL, B, T, C, 3 * Cl, NULL); }
        if (in) {
            layernorm_backward_fast(g->dresidual, d.dln1, x.residual, w.ln1w, x.ln1_mean, x.ln1_rstd, BTs, C);
            fast_release(m, ZERO_LAYER(l));
        }
        if (wt) {
            fast_ln_param_grads(m, a, dw.ln1w, dw.ln1b, x.residual, d.dln1, x.ln1_mean, x.ln1_rstd, B, T);
            zero_grad_unit_done(z, ZERO_LAYER(l));
        }
    }
}

// (the embeddings' chunk) the lookup half of wte's gradient and wpe's, from d(loss)/d(encoded)
// (the input half keeps it under a split backward).
static void fast_embed_backward(void* vm, void* va, void* vg, int B, int T, int part) {
    FastModel* m = (FastModel*)vm;
    FastActs* a = (FastActs*)va;
    FastGrads* g = (FastGrads*)vg;
    const GPT2Config* c = &m->config;
    Zero* z = m->zero;
    // with SP the lookup's gradient reads every position: d(encoded) all-gathered along T (tp
    // group); with CP likewise (cp group, bf16; with SP after the tp group's gather into this
    // rank's cp slice), and the one-rank backward runs on whole sequences
    floatX* dencoded = a->split_backward ? a->dencoded : a->sp || a->cp ? g->dfull : g->dresidual;
    if ((part & BACKWARD_INPUT) && a->cp) {
        const floatX* slice = g->dresidual;
        if (a->sp) {
            fast_sp_all_gather(m, g->dbtc, g->dresidual, B, T / m->N);
            slice = g->dbtc;
        }
        fast_cp_gather_sequences(&m->cp, dencoded, slice, B, T, c->channels);
    } else if (part & BACKWARD_INPUT) {
        fast_row_parallel_dout(m, a, g, dencoded, B, T);
    }
    if (!(part & BACKWARD_WEIGHT)) { return; }
    int lookup_unit = zero_lookup_unit(z);
    float *dlookup = zero_grad_unit(z, lookup_unit), *dwpe = zero_grad_unit(z, ZERO_WPE);
    encoder_backward_x(dlookup, dwpe, dencoded, 1, a->cp ? a->inputs_full : a->inputs, B, T, c->channels, m->v0,
                       m->Vl, c->max_seq_len);
    if (a->cp) {   // every rank of the group computed them whole: ZeRO gets this rank's part, -0.0f elsewhere
        cp_keep_part(&m->cp, dlookup, z->lay.size[lookup_unit]);
        cp_keep_part(&m->cp, dwpe, z->lay.size[ZERO_WPE]);
    }
    zero_grad_unit_done(z, ZERO_WPE);
    zero_grad_unit_done(z, lookup_unit);
}

// (experts) each layer's load-balancing loss of the last forward, and the routing counters
static void fast_moe_aux(void* vm, void* va, float* host_aux) {
    const FastActs* a = (const FastActs*)va;
    for (int l = 0; l < ((FastModel*)vm)->layers; l++) { host_aux[l] = a->moe ? a->moe[l].aux : 0.0f; }
}
static MoeCounters* fast_moe_counters(void* vm) { return ((FastModel*)vm)->E > 0 ? &((FastModel*)vm)->counters : NULL; }

// Not const: gpt2_fast_setup takes the KV cache away when only cuDNN can run the head size,
// and from models with experts (their routing plans a whole pass).
static ModelOps fast_model_ops = {
    fast_create, fast_destroy, fast_acts_create, fast_acts_destroy, fast_set_tokens, fast_stage_input,
    fast_stage_output, fast_embed_forward, fast_layers_forward, fast_head_forward, fast_loss_sum, fast_probs_at,
    fast_grads_create, fast_grads_destroy, fast_grad_residual, fast_head_backward, fast_layers_backward,
    fast_embed_backward,
    fast_moe_aux, fast_moe_counters,
    fast_embed_decode, fast_layers_decode, fast_head_decode,
    sizeof(floatX),     // bf16 activations between stages
    sizeof(floatX),     // bf16 weights, zero.h's
    NULL                // FlexSP needs --varlen, which fast mode refuses
};

const ModelOps* gpt2_fast_model_ops(void) { return &fast_model_ops; }

// Chooses the attention (see above) for training passes of (B, T); the sampler's forward
// passes of (1, genT) use flash attention unless the head size needs cuDNN. Returns one line
// saying which runs, or fails with one naming why the choice cannot run.
const char* gpt2_fast_setup(const char* attention, const GPT2Config* c, int B, int T, int genT) {
    static char said[256];
    int hs = c->channels / c->num_heads, want_cudnn = strcmp(attention, "flash") != 0;
    char why[256] = "this build has no cuDNN (cudnn_graph.h and libcudnn were not found)";
#ifdef LLMC_CUDA_EMU
    snprintf(why, sizeof(why), "the emulated GPU has no cuDNN");
#endif
    cublaslt_init();
    flash_attention_setup();
    if (!gpu_flash_head_size(hs) || c->num_experts > 0) {   // the KV cache's one-row launch is flash
                                      // attention's: without it the sampler runs a full forward per token
        fast_model_ops.embed_decode = NULL;
        fast_model_ops.layers_decode = NULL;
        fast_model_ops.head_decode = NULL;
    }
#ifdef LLMC_CUDNN
    int cudnn_ok = 0;
    if (want_cudnn) {
        cudnn_ok = cudnn_attention_supported(B, T, c->num_heads, hs, why, sizeof(why));
        if (cudnn_ok && genT > 0 && !gpu_flash_head_size(hs)) {   // the sampler's one shape, forward only
            cudnn_ok = cudnn_attention_forward_supported(1, genT, c->num_heads, hs, why, sizeof(why));
        }
    }
    if (cudnn_ok) {
        attention_cudnn_B = B;
        attention_cudnn_T = T;
        snprintf(said, sizeof(said), "cuDNN fused attention (deterministic backward)%s",
                 gpu_flash_head_size(hs) ? ", flash attention for the sampler" : "");
        return said;
    }
#endif
    if (strcmp(attention, "cudnn") == 0) { fatal("--attention cudnn: %s", why); }
    if (!gpu_flash_head_size(hs)) {
        fatal("-e: head size C/NH = %d: fast mode's flash attention supports 16, 32 and 64, and cuDNN cannot "
              "run it (%s); use --deterministic 1", hs, why);
    }
    snprintf(said, sizeof(said), "flash attention%s%s%s", want_cudnn ? " (cuDNN cannot: " : "", want_cudnn ? why : "",
             want_cudnn ? ")" : "");
    return said;
}

void gpt2_fast_teardown(void) {
#ifdef LLMC_CUDNN
    cudnn_attention_free();
#endif
    cublaslt_free();
}
