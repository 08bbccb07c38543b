/*
 * train_gpt2.cu: GPT-2 training on one NVIDIA GPU, the CUDA build of train_gpt2.c.
 *
 * The same trainer as train_gpt2.c: the same flags (llmc/args.h), data (by global microbatch
 * index), initialisation, checkpoints, state files and resume, main.log lines, console lines
 * (plus tok/s and MFU) and sampler. Two modes, chosen at run time:
 *
 *   --deterministic 1   fp32 everywhere; every kernel (llmc/kernels_det.cuh) computes each
 *                       output with the reference's sequence of floating-point operations
 *                       (llmc/canonical.h), so a run is bit-identical to train_gpt2's: every
 *                       logged loss, lr and norm, the samples and the checkpoint bytes.
 *   fast (the default)  bf16 weights and activations with fp32 master weights, gradients and
 *                       AdamW state; cuBLASLt tensor-core matmuls with the bias and GELU fused
 *                       (llmc/matmul_cublaslt.cuh), flash attention (llmc/attention_flash.cuh),
 *                       the classifier fused (llmc/kernels_fast.cuh). It follows the reference
 *                       within bf16 precision (dev/gpu/check.sh states the tolerances).
 *
 * Organised like train_gpt2.c, so that multi-GPU can follow the CPU build's layouts: the
 * parameters are one flat fp32 buffer in MEMORY order (model.h); each microbatch's gradient
 * is written fresh into a (P + Vp*C) buffer (the tied embedding's two halves kept apart until
 * the step's gradient is complete, as zero.h's zero_finish_grads does) and the microbatch
 * gradients are combined by the R1 tree over the global microbatch index; the loss is
 * position_sum per microbatch and the same tree. One GPU, one process for now: --tp, --pp,
 * --sp and multi-process launches are refused (NCCL behind llmc/comm.h is not done); -z is
 * accepted and changes nothing, as on one CPU rank.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llmc/utils.h"
#include "llmc/canonical.h"
#include "llmc/model.h"
#include "llmc/checkpoint.h"
#include "llmc/adamw.h"
#include "llmc/rand.h"
#include "llmc/dataloader.h"
#include "llmc/tokenizer.h"
#include "llmc/logger.h"
#include "llmc/args.h"
#include "llmc/gpt2_init.h"
#include "llmc/gpu_plan.h"
#include "llmc/cuda_common.cuh"
#include "llmc/kernels_det.cuh"
#include "llmc/kernels_fast.cuh"
#include "llmc/matmul_cublaslt.cuh"
#include "llmc/attention_flash.cuh"

// ==========================================================================================
// The model on the device
// ==========================================================================================

// Activations of one forward pass over (B, T) positions, laid out as train_gpt2.c's. The
// "x" tensors (void*) are fp32 in deterministic mode and bf16 in fast mode; att holds the
// probabilities (L,B,NH,T,T) in deterministic mode and the softmax statistics (L,B,NH,T) of
// flash attention in fast mode; logits are the probabilities (fp32) in deterministic mode.
typedef struct {
    void *encoded, *ln1;
    float *ln1_mean, *ln1_rstd;
    void *qkv, *atty;
    float* att;
    void *residual2, *ln2;
    float *ln2_mean, *ln2_rstd;
    void *fch, *fch_gelu, *residual3, *lnf;
    float *lnf_mean, *lnf_rstd;
    void* logits;
    float* losses;
    void* proj;
    int recompute;
} Activations;

// Gradients of activations during backward: one set, reused by every layer.
typedef struct {
    void *dresidual, *dbtc, *dqkv, *dbt4c;
} ActivationGrads;

// Scratch of the backward pass and of the loss.
typedef struct {
    float* dweight_seq;   // deterministic: per-sequence weight gradients
    float* att_ds;        // deterministic: attention backward's ds
    float* att_D;         // fast: flash attention backward's rowsum(dO * O)
    float* leaves;        // R3 leaves; the last float receives a position_sum
    int *inputs, *targets;
    int *enc_order, *enc_begin, *enc_tokens;   // the embedding gradient's grouping by token
    int enc_nuniq;
    SumSq* sumsq;
} Scratch;

typedef struct {
    GPT2Config config;
    int det;                  // 1: --deterministic 1 (fp32), 0: fast mode (bf16)
    size_t num_parameters;    // P
    size_t num_grads;         // P + Vp*C: the tied embedding's two gradient halves
    float* params;            // (P) fp32, MEMORY order
    floatX* params_x;         // (P) bf16 copy that fast mode's forward and backward read
    float *m, *v;             // (P) AdamW moments
    float* grad_bufs;         // grad_buffers x (P + Vp*C): the microbatch tree's stack
    int grad_buffers;
    int64_t* run_end;         // AdamW weight-decay runs (gpu_plan.h adamw_decay_runs)
    int* run_decay;
    int nruns;
} Model;

static float* wte_emb_grad(const Model* model, float* grads) { return grads + model->num_parameters; }

// Typed views of one layer's parameters in a flat buffer (fp32 or bf16).
template <typename X> struct LayerParams {
    X *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
};

template <typename X> static LayerParams<X> layer_params(X* flat, const GPT2Config* c, int l) {
    LayerParams<X> v;
    v.ln1w = flat + param_offset(c, P_LN1W, l);         v.ln1b = flat + param_offset(c, P_LN1B, l);
    v.qkvw = flat + param_offset(c, P_QKVW, l);         v.qkvb = flat + param_offset(c, P_QKVB, l);
    v.attprojw = flat + param_offset(c, P_ATTPROJW, l); v.attprojb = flat + param_offset(c, P_ATTPROJB, l);
    v.ln2w = flat + param_offset(c, P_LN2W, l);         v.ln2b = flat + param_offset(c, P_LN2B, l);
    v.fcw = flat + param_offset(c, P_FCW, l);           v.fcb = flat + param_offset(c, P_FCB, l);
    v.fcprojw = flat + param_offset(c, P_FCPROJW, l);   v.fcprojb = flat + param_offset(c, P_FCPROJB, l);
    return v;
}

// Per-layer views of the activations for a pass over (B, T).
template <typename X> struct LayerActs {
    X *residual, *ln1, *qkv, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3;
    float *ln1_mean, *ln1_rstd, *att, *ln2_mean, *ln2_rstd;
};

template <typename X> static LayerActs<X> layer_acts(const Activations* a, const GPT2Config* c, int l, int B, int T, int det) {
    size_t C = c->channels, BT = (size_t)B * T, NH = c->num_heads;
    LayerActs<X> v;
    v.residual = l == 0 ? (X*)a->encoded : (X*)a->residual3 + (l - 1) * BT * C;
    v.ln1 = (X*)a->ln1 + l * BT * C;
    v.ln1_mean = a->ln1_mean + l * BT;
    v.ln1_rstd = a->ln1_rstd + l * BT;
    v.qkv = (X*)a->qkv + l * BT * 3 * C;
    v.atty = (X*)a->atty + l * BT * C;
    v.att = a->att + l * (det ? (size_t)B * NH * T * T : (size_t)B * NH * T);
    v.residual2 = (X*)a->residual2 + l * BT * C;
    v.ln2 = (X*)a->ln2 + l * BT * C;
    v.ln2_mean = a->ln2_mean + l * BT;
    v.ln2_rstd = a->ln2_rstd + l * BT;
    v.fch = (X*)a->fch + l * BT * 4 * C;
    v.fch_gelu = (X*)a->fch_gelu + (a->recompute ? 0 : l * BT * 4 * C);
    v.residual3 = (X*)a->residual3 + l * BT * C;
    return v;
}

template <typename X> static X* last_residual(const Activations* a, const GPT2Config* c, int B, int T) {
    return (X*)a->residual3 + (size_t)(c->num_layers - 1) * B * T * c->channels;
}

// Points the activation views at device memory: tensor i (BUF_ENCODED..BUF_PROJ) of the
// sizes in count/width gets its own allocation, or (blob != NULL) the next 256-byte aligned
// piece of blob.
static void activations_alloc(Activations* a, const size_t count[], const size_t width[], char* blob, int recompute) {
    void* p[NUM_BUFS];
    for (int i = BUF_ENCODED; i <= BUF_PROJ; i++) {
        size_t bytes = count[i] * width[i];
        if (blob) {
            p[i] = blob;
            blob += gpu_round256(bytes);
        } else {
            p[i] = device_alloc(bytes, gpu_buf_names[i]);
        }
    }
    a->encoded = p[BUF_ENCODED];
    a->ln1 = p[BUF_LN1];
    a->ln1_mean = (float*)p[BUF_LN1_MEAN];
    a->ln1_rstd = (float*)p[BUF_LN1_RSTD];
    a->qkv = p[BUF_QKV];
    a->atty = p[BUF_ATTY];
    a->att = (float*)p[BUF_ATT];
    a->residual2 = p[BUF_RESIDUAL2];
    a->ln2 = p[BUF_LN2];
    a->ln2_mean = (float*)p[BUF_LN2_MEAN];
    a->ln2_rstd = (float*)p[BUF_LN2_RSTD];
    a->fch = p[BUF_FCH];
    a->fch_gelu = p[BUF_FCH_GELU];
    a->residual3 = p[BUF_RESIDUAL3];
    a->lnf = p[BUF_LNF];
    a->lnf_mean = (float*)p[BUF_LNF_MEAN];
    a->lnf_rstd = (float*)p[BUF_LNF_RSTD];
    a->logits = p[BUF_LOGITS];
    a->losses = (float*)p[BUF_LOSSES];
    a->proj = p[BUF_PROJ];
    a->recompute = recompute;
}

// ==========================================================================================
// Forward and backward, deterministic mode: train_gpt2.c's gpt2_forward / gpt2_backward with
// the GPU twins of its kernels (fp32)
// ==========================================================================================

static void gpt2_forward_det(const Model* model, Activations* a, const int* inputs, const int* targets,
                             int B, int T) {
    const GPT2Config* c = &model->config;
    int C = c->channels, NH = c->num_heads, V = c->vocab_size, Vp = c->padded_vocab_size;
    int BT = B * T;
    float* p = model->params;
    float* proj = (float*)a->proj;
    encoder_forward((float*)a->encoded, inputs, p + param_offset(c, P_WTE, 0), p + param_offset(c, P_WPE, 0), B, T, C);
    for (int l = 0; l < c->num_layers; l++) {
        LayerParams<float> w = layer_params(p, c, l);
        LayerActs<float> x = layer_acts<float>(a, c, l, B, T, 1);
        layernorm_forward(x.ln1, x.ln1_mean, x.ln1_rstd, x.residual, w.ln1w, w.ln1b, BT, C);
        matmul_forward(x.qkv, x.ln1, w.qkvw, w.qkvb, BT, C, 3 * C);
        attention_forward(x.atty, x.att, x.qkv, B, T, C, NH);
        matmul_forward(proj, x.atty, w.attprojw, w.attprojb, BT, C, C);
        residual_forward(x.residual2, x.residual, proj, (size_t)BT * C);
        layernorm_forward(x.ln2, x.ln2_mean, x.ln2_rstd, x.residual2, w.ln2w, w.ln2b, BT, C);
        matmul_forward(x.fch, x.ln2, w.fcw, w.fcb, BT, C, 4 * C);
        gelu_forward(x.fch_gelu, x.fch, (size_t)BT * 4 * C);
        matmul_forward(proj, x.fch_gelu, w.fcprojw, w.fcprojb, BT, 4 * C, C);
        residual_forward(x.residual3, x.residual2, proj, (size_t)BT * C);
    }
    layernorm_forward((float*)a->lnf, a->lnf_mean, a->lnf_rstd, last_residual<float>(a, c, B, T),
                      p + param_offset(c, P_LNFW, 0), p + param_offset(c, P_LNFB, 0), BT, C);
    matmul_forward((float*)a->logits, (float*)a->lnf, p + param_offset(c, P_WTE, 0), NULL, BT, C, Vp);
    crossentropy_forward((float*)a->logits, a->losses, targets, BT, V, Vp);
}

static void gpt2_backward_det(const Model* model, Activations* a, ActivationGrads* g, Scratch* s,
                              float* grads, int B, int T, float dloss) {
    const GPT2Config* c = &model->config;
    int C = c->channels, NH = c->num_heads, V = c->vocab_size, Vp = c->padded_vocab_size;
    int BT = B * T;
    float* p = model->params;
    float *dresidual = (float*)g->dresidual, *dbtc = (float*)g->dbtc;
    float *dqkv = (float*)g->dqkv, *dbt4c = (float*)g->dbt4c;
    float* last = last_residual<float>(a, c, B, T);

    crossentropy_backward((float*)a->logits, s->targets, dloss, BT, V, Vp);
    matmul_backward(dbtc, grads + param_offset(c, P_WTE, 0), NULL, (float*)a->logits, (float*)a->lnf,
                    p + param_offset(c, P_WTE, 0), B, T, C, Vp, 1, s->dweight_seq, s->leaves);
    cudaCheck(cudaMemsetAsync(dresidual, 0, sizeof(float) * (size_t)BT * C));
    layernorm_backward(dresidual, grads + param_offset(c, P_LNFW, 0), grads + param_offset(c, P_LNFB, 0), dbtc,
                       last, p + param_offset(c, P_LNFW, 0), a->lnf_mean, a->lnf_rstd, B, T, C, s->leaves);
    for (int l = c->num_layers - 1; l >= 0; l--) {
        LayerParams<float> w = layer_params(p, c, l);
        LayerTensors dw = layer_tensors(c, grads, l);
        LayerActs<float> x = layer_acts<float>(a, c, l, B, T, 1);
        if (a->recompute) { gelu_forward(x.fch_gelu, x.fch, (size_t)BT * 4 * C); }
        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        matmul_backward(dbt4c, dw.fcprojw, dw.fcprojb, dresidual, x.fch_gelu, w.fcprojw, B, T, 4 * C, C, 1,
                        s->dweight_seq, s->leaves);
        gelu_backward(dbt4c, x.fch, dbt4c, (size_t)BT * 4 * C);
        matmul_backward(dbtc, dw.fcw, dw.fcb, dbt4c, x.ln2, w.fcw, B, T, C, 4 * C, 1, s->dweight_seq, s->leaves);
        layernorm_backward(dresidual, dw.ln2w, dw.ln2b, dbtc, x.residual2, w.ln2w, x.ln2_mean, x.ln2_rstd,
                           B, T, C, s->leaves);
        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        matmul_backward(dbtc, dw.attprojw, dw.attprojb, dresidual, x.atty, w.attprojw, B, T, C, C, 1,
                        s->dweight_seq, s->leaves);
        attention_backward(dqkv, dbtc, x.qkv, x.att, B, T, C, NH, s->att_ds);
        matmul_backward(dbtc, dw.qkvw, dw.qkvb, dqkv, x.ln1, w.qkvw, B, T, C, 3 * C, 3, s->dweight_seq, s->leaves);
        layernorm_backward(dresidual, dw.ln1w, dw.ln1b, dbtc, x.residual, w.ln1w, x.ln1_mean, x.ln1_rstd,
                           B, T, C, s->leaves);
    }
    encoder_backward(wte_emb_grad(model, grads), grads + param_offset(c, P_WPE, 0), dresidual, 0, s->enc_order,
                     s->enc_begin, s->enc_tokens, s->enc_nuniq, B, T, C, Vp, c->max_seq_len);
}

// ==========================================================================================
// Forward and backward, fast mode: bf16 activations, cuBLASLt, flash attention
// ==========================================================================================

// targets == NULL: logits only (the sampler). write_grad: the classifier also overwrites the
// logits with d(loss)/d(logits), dloss per position (training; the backward starts from them).
static void gpt2_forward_fast(const Model* model, Activations* a, const int* inputs, const int* targets,
                              int B, int T, int write_grad, float dloss) {
    const GPT2Config* c = &model->config;
    int C = c->channels, NH = c->num_heads, V = c->vocab_size, Vp = c->padded_vocab_size, L = c->num_layers;
    int BT = B * T;
    floatX* p = model->params_x;
    floatX* proj = (floatX*)a->proj;
    encoder_forward_fast((floatX*)a->encoded, inputs, p + param_offset(c, P_WTE, 0), p + param_offset(c, P_WPE, 0), B, T, C);
    LayerParams<floatX> w0 = layer_params(p, c, 0);
    LayerActs<floatX> x0 = layer_acts<floatX>(a, c, 0, B, T, 0);
    layernorm_forward_fast(x0.ln1, x0.ln1_mean, x0.ln1_rstd, x0.residual, w0.ln1w, w0.ln1b, BT, C);
    for (int l = 0; l < L; l++) {
        LayerParams<floatX> w = layer_params(p, c, l);
        LayerActs<floatX> x = layer_acts<floatX>(a, c, l, B, T, 0);
        matmul_forward_fast(x.qkv, x.ln1, w.qkvw, w.qkvb, BT, C, 3 * C, NULL);
        attention_forward_fast(x.atty, x.att, x.qkv, B, T, C, NH);
        matmul_forward_fast(proj, x.atty, w.attprojw, w.attprojb, BT, C, C, NULL);
        fused_residual_layernorm(x.residual2, x.ln2, x.ln2_mean, x.ln2_rstd, x.residual, proj, w.ln2w, w.ln2b, BT, C);
        matmul_forward_fast(x.fch_gelu, x.ln2, w.fcw, w.fcb, BT, C, 4 * C, x.fch);   // + GELU, keeps fch
        matmul_forward_fast(proj, x.fch_gelu, w.fcprojw, w.fcprojb, BT, 4 * C, C, NULL);
        // residual3 and the next layernorm: the next layer's ln1, or lnf after the last layer
        if (l + 1 < L) {
            LayerParams<floatX> wn = layer_params(p, c, l + 1);
            LayerActs<floatX> xn = layer_acts<floatX>(a, c, l + 1, B, T, 0);
            fused_residual_layernorm(x.residual3, xn.ln1, xn.ln1_mean, xn.ln1_rstd, x.residual2, proj,
                                     wn.ln1w, wn.ln1b, BT, C);
        } else {
            fused_residual_layernorm(x.residual3, (floatX*)a->lnf, a->lnf_mean, a->lnf_rstd, x.residual2, proj,
                                     p + param_offset(c, P_LNFW, 0), p + param_offset(c, P_LNFB, 0), BT, C);
        }
    }
    matmul_forward_fast((floatX*)a->logits, (floatX*)a->lnf, p + param_offset(c, P_WTE, 0), NULL, BT, C, Vp, NULL);
    if (targets) { fused_classifier((floatX*)a->logits, a->losses, targets, dloss, BT, V, Vp, write_grad); }
}

// Backward of the last gpt2_forward_fast (with write_grad): writes every element of grads.
static void gpt2_backward_fast(const Model* model, Activations* a, ActivationGrads* g, Scratch* s,
                               float* grads, int B, int T) {
    const GPT2Config* c = &model->config;
    int C = c->channels, NH = c->num_heads, Vp = c->padded_vocab_size;
    int BT = B * T;
    floatX* p = model->params_x;
    floatX *dresidual = (floatX*)g->dresidual, *dbtc = (floatX*)g->dbtc;
    floatX *dqkv = (floatX*)g->dqkv, *dbt4c = (floatX*)g->dbt4c;
    floatX* last = last_residual<floatX>(a, c, B, T);

    // the classifier left dlogits in the logits
    matmul_backward_fast(dbtc, grads + param_offset(c, P_WTE, 0), NULL, (floatX*)a->logits, (floatX*)a->lnf,
                         p + param_offset(c, P_WTE, 0), B, T, C, Vp, NULL, s->leaves);
    cudaCheck(cudaMemsetAsync(dresidual, 0, sizeof(floatX) * (size_t)BT * C));
    layernorm_backward_fast(dresidual, dbtc, last, p + param_offset(c, P_LNFW, 0), a->lnf_mean, a->lnf_rstd, BT, C);
    layernorm_param_grads(grads + param_offset(c, P_LNFW, 0), grads + param_offset(c, P_LNFB, 0), s->leaves,
                          last, dbtc, 1, a->lnf_mean, a->lnf_rstd, B, T, C);
    for (int l = c->num_layers - 1; l >= 0; l--) {
        LayerParams<floatX> w = layer_params(p, c, l);
        LayerTensors dw = layer_tensors(c, grads, l);
        LayerActs<floatX> x = layer_acts<floatX>(a, c, l, B, T, 0);
        if (a->recompute) { gelu_forward_fast(x.fch_gelu, x.fch, (size_t)BT * 4 * C); }
        // MLP; the fcproj backward's epilogue applies gelu'(fch): dbt4c = d fch
        matmul_backward_fast(dbt4c, dw.fcprojw, dw.fcprojb, dresidual, x.fch_gelu, w.fcprojw, B, T, 4 * C, C,
                             x.fch, s->leaves);
        matmul_backward_fast(dbtc, dw.fcw, dw.fcb, dbt4c, x.ln2, w.fcw, B, T, C, 4 * C, NULL, s->leaves);
        layernorm_backward_fast(dresidual, dbtc, x.residual2, w.ln2w, x.ln2_mean, x.ln2_rstd, BT, C);
        layernorm_param_grads(dw.ln2w, dw.ln2b, s->leaves, x.residual2, dbtc, 1, x.ln2_mean, x.ln2_rstd, B, T, C);
        // attention
        matmul_backward_fast(dbtc, dw.attprojw, dw.attprojb, dresidual, x.atty, w.attprojw, B, T, C, C, NULL, s->leaves);
        attention_backward_fast(dqkv, dbtc, x.qkv, x.atty, x.att, s->att_D, B, T, C, NH);
        matmul_backward_fast(dbtc, dw.qkvw, dw.qkvb, dqkv, x.ln1, w.qkvw, B, T, C, 3 * C, NULL, s->leaves);
        layernorm_backward_fast(dresidual, dbtc, x.residual, w.ln1w, x.ln1_mean, x.ln1_rstd, BT, C);
        layernorm_param_grads(dw.ln1w, dw.ln1b, s->leaves, x.residual, dbtc, 1, x.ln1_mean, x.ln1_rstd, B, T, C);
    }
    encoder_backward(wte_emb_grad(model, grads), grads + param_offset(c, P_WPE, 0), dresidual, 1, s->enc_order,
                     s->enc_begin, s->enc_tokens, s->enc_nuniq, B, T, C, Vp, c->max_seq_len);
}

// ==========================================================================================
// A microbatch: upload, forward (with the loss), backward
// ==========================================================================================

// Host buffers for grouping a microbatch's positions by token (encoder_backward_plan).
typedef struct {
    int *count, *order, *begin, *tokens;
} HostEncoderPlan;

// Copies the microbatch to the device; with plan, also its grouping by token for the
// embedding gradient.
static void upload_microbatch(Scratch* s, HostEncoderPlan* plan, const int* inputs, const int* targets,
                              int BT, int Vp) {
    cudaCheck(cudaMemcpy(s->inputs, inputs, sizeof(int) * BT, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(s->targets, targets, sizeof(int) * BT, cudaMemcpyHostToDevice));
    if (plan) {
        s->enc_nuniq = encoder_backward_plan(inputs, BT, Vp, plan->count, plan->order, plan->begin, plan->tokens);
        cudaCheck(cudaMemcpy(s->enc_order, plan->order, sizeof(int) * BT, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(s->enc_begin, plan->begin, sizeof(int) * (s->enc_nuniq + 1), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(s->enc_tokens, plan->tokens, sizeof(int) * s->enc_nuniq, cudaMemcpyHostToDevice));
    }
}

// Forward with targets; returns position_sum of the losses (R3, train_gpt2.c position_sum).
// train: fast mode's classifier also writes the logits' gradient (dloss per position).
static float forward_loss(const Model* model, Activations* a, Scratch* s, int B, int T, int train, float dloss) {
    if (model->det) {
        gpt2_forward_det(model, a, s->inputs, s->targets, B, T);
    } else {
        gpt2_forward_fast(model, a, s->inputs, s->targets, B, T, train, dloss);
    }
    float* out = s->leaves + (size_t)B * CANON_R;   // after the B*8 leaves of the loss
    position_reduce(out, s->leaves, a->losses, 0, B, T, 1);
    float loss;
    cudaCheck(cudaMemcpy(&loss, out, sizeof(float), cudaMemcpyDeviceToHost));
    return loss;
}

// ==========================================================================================
// Sampling (train_gpt2.c sample_text)
// ==========================================================================================

// Samples genT tokens after <|endoftext|> with xorshift seeded 1337 (llm.c's sampler), each
// step a full forward over the tokens so far (B = 1). Deterministic mode reads the GPU's
// probabilities (the same bits as the CPU's); fast mode forms them on the host from the bf16
// logits.
static void sample_text(const Model* model, Activations* sa, int* d_tokens, Tokenizer* tok, int genT) {
    const GPT2Config* c = &model->config;
    int V = c->vocab_size, Vp = c->padded_vocab_size;
    int* gen = (int*)malloc_or_die(sizeof(int) * genT, "sample tokens");
    float* probs = (float*)malloc_or_die(sizeof(float) * Vp, "sample probabilities");
    floatX* logits = (floatX*)malloc_or_die(sizeof(floatX) * Vp, "sample logits");
    uint64_t rng = 1337;
    gen[0] = V > 50256 ? 50256 : V - 1;   // <|endoftext|> for GPT-2's vocabulary
    printf("generating:\n---\n");
    for (int t = 1; t < genT; t++) {
        cudaCheck(cudaMemcpy(d_tokens, gen, sizeof(int) * t, cudaMemcpyHostToDevice));
        if (model->det) {
            gpt2_forward_det(model, sa, d_tokens, NULL, 1, t);
            cudaCheck(cudaMemcpy(probs, (float*)sa->logits + (size_t)(t - 1) * Vp, sizeof(float) * Vp,
                                 cudaMemcpyDeviceToHost));
        } else {
            gpt2_forward_fast(model, sa, d_tokens, NULL, 1, t, 0, 0.0f);
            cudaCheck(cudaMemcpy(logits, (floatX*)sa->logits + (size_t)(t - 1) * Vp, sizeof(floatX) * Vp,
                                 cudaMemcpyDeviceToHost));
            float maxv = -canon_inf(), z = 0.0f;
            for (int v = 0; v < V; v++) { probs[v] = __bfloat162float(logits[v]); if (probs[v] > maxv) { maxv = probs[v]; } }
            for (int v = 0; v < V; v++) { probs[v] = canon_expf(probs[v] - maxv); z += probs[v]; }
            for (int v = 0; v < V; v++) { probs[v] = probs[v] / z; }
        }
        float coin = random_f32(&rng), cdf = 0.0f;
        int next = V - 1;
        for (int v = 0; v < V; v++) {
            cdf += probs[v];
            if (coin < cdf) { next = v; break; }
        }
        gen[t] = next;
        if (tok->init_ok) {
            safe_printf(tokenizer_decode(tok, next));
        } else {
            printf("%d ", next);
        }
        fflush(stdout);
    }
    printf("\n---\n");
    free(gen);
    free(probs);
    free(logits);
}

// ==========================================================================================
// Setup
// ==========================================================================================

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Launchers (mpirun, srun, torchrun) say how many processes they started in these variables.
static void refuse_multi_process(void) {
    const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS", "WORLD_SIZE"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char* v = getenv(vars[i]);
        if (v && atoi(v) > 1) {
            fatal("%s=%s: train_gpt2cu trains on one GPU in one process; multi-GPU (NCCL data, tensor and "
                  "pipeline parallelism, ZeRO) is not done yet in the CUDA build", vars[i], v);
        }
    }
}

// The GPU, or one clear line saying why there is none.
static cudaDeviceProp select_device(void) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        fatal("no CUDA GPU available (%s): train_gpt2cu needs an NVIDIA GPU and its driver; "
              "train_gpt2 trains on the CPU", err != cudaSuccess ? cudaGetErrorString(err) : "no device");
    }
    cudaDeviceProp prop;
    cudaCheck(cudaSetDevice(0));
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    if (prop.major < 8) {
        fatal("GPU '%s' has compute capability %d.%d; train_gpt2cu needs 8.0 or newer (Ampere, Hopper)",
              prop.name, prop.major, prop.minor);
    }
    return prop;
}

#ifndef TESTING
// ==========================================================================================
// Training
// ==========================================================================================
int main(int argc, char** argv) {
    TrainArgs args;
    train_args_defaults(&args);
    if (train_args_parse(&args, argc, argv)) {
        TrainArgs defaults;
        train_args_defaults(&defaults);
        train_args_print_help(argv[0], &defaults);
        return 0;
    }
    train_args_validate(&args);
    // -z is accepted: ZeRO shards over the data-parallel ranks, and with one rank every stage
    // trains bit for bit as stage 0 (train_gpt2 accepts it on one rank too)
    if (args.tp != 1 || args.pp != 1 || args.sp != 0) {
        fatal("--tp/--pp/--sp: the CUDA build trains on one GPU only; tensor, pipeline and sequence "
              "parallelism (and data parallelism over NCCL) are not done yet");
    }
    refuse_multi_process();
    LRScheduleKind sched_kind;
    if (!lr_schedule_kind(args.lr_schedule, &sched_kind)) {
        fatal("-k: unknown learning-rate schedule '%s' (cosine, linear or constant)", args.lr_schedule);
    }
    cudaDeviceProp prop = select_device();
    int det = args.deterministic;
    if (args.output_dir) { ensure_writable_dir(args.output_dir, "-o"); }

    // the model on the host: resume, a fresh one, or a checkpoint file (as train_gpt2.c)
    int resume_step = args.resume ? checkpoint_latest_step(args.output_dir) : -1;
    char path[1200];
    GPT2Config config;
    float* host_params = gpt2_starting_params(args.model, args.output_dir, resume_step, (uint64_t)args.seed,
                                              &config);
    int B = args.B, T = args.T;
    int C = config.channels, NH = config.num_heads, Vp = config.padded_vocab_size;
    if (T > config.max_seq_len) {
        fatal("-t: sequence length %d exceeds the model's maxT = %d", T, config.max_seq_len);
    }
    int genT = args.gen_T < config.max_seq_len ? args.gen_T : config.max_seq_len;
    int do_sample = args.sample_every > 0;
    char launch_err[256];
    const char* launch_problem = gpu_launch_problem(&config, B, T, det, do_sample ? genT : 0, launch_err,
                                                    sizeof(launch_err));
    if (launch_problem) { fatal("-e/-b/-t: %s", launch_problem); }
    long long tokens_per_micro = (long long)B * T;
    long long total_batch = args.total_batch == -1 ? tokens_per_micro : args.total_batch;
    if (total_batch % tokens_per_micro != 0) {
        fatal("-d: total batch %lld tokens is not a multiple of B*T = %lld", total_batch, tokens_per_micro);
    }
    int M = (int)(total_batch / tokens_per_micro);

    DataLoader train_loader, val_loader;
    int do_val = args.val_every > 0;
    int val_batches, train_steps;
    train_data_open(&args, B, T, config.vocab_size, total_batch, &train_loader, &val_loader, &val_batches,
                    &train_steps);
    LRSchedule schedule = {sched_kind, args.lr, args.warmup, train_steps, args.final_lr_frac};
    Tokenizer tokenizer;
    tokenizer_init_for_model(&tokenizer, args.tokenizer_path, config.vocab_size);

    // ---- device memory: every buffer of the plan, checked against what is free ----
    GpuMemoryPlan plan = gpu_memory_plan(&config, B, T, M, det, args.recompute, do_sample ? genT : 0);
    size_t need = gpu_plan_total_bytes(&plan), free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    if (need > free_b) {
        fatal("GPU memory: this run needs %.2f GiB (%s mode, B=%d T=%d), the GPU has %.2f GiB free of %.2f: "
              "lower -b%s", need / 1073741824.0, det ? "deterministic" : "fast", B, T, free_b / 1073741824.0,
              total_b / 1073741824.0, args.recompute ? "" : " or use -r 1");
    }
    Model model;
    memset(&model, 0, sizeof(model));
    model.config = config;
    model.det = det;
    model.num_parameters = param_count(&config);
    model.num_grads = model.num_parameters + (size_t)Vp * C;
    size_t P = model.num_parameters;
    model.params = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_PARAMS), gpu_buf_names[BUF_PARAMS]);
    model.params_x = (floatX*)device_alloc(gpu_plan_bytes(&plan, BUF_PARAMS_BF16), gpu_buf_names[BUF_PARAMS_BF16]);
    model.m = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_ADAM_M), gpu_buf_names[BUF_ADAM_M]);
    model.v = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_ADAM_V), gpu_buf_names[BUF_ADAM_V]);
    model.grad_bufs = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_GRADS), gpu_buf_names[BUF_GRADS]);
    model.grad_buffers = plan.grad_buffers;
    Activations acts, sample_acts;
    activations_alloc(&acts, plan.count, plan.width, NULL, args.recompute);
    ActivationGrads agrads;
    agrads.dresidual = device_alloc(gpu_plan_bytes(&plan, BUF_DRESIDUAL), gpu_buf_names[BUF_DRESIDUAL]);
    agrads.dbtc = device_alloc(gpu_plan_bytes(&plan, BUF_DBTC), gpu_buf_names[BUF_DBTC]);
    agrads.dqkv = device_alloc(gpu_plan_bytes(&plan, BUF_DQKV), gpu_buf_names[BUF_DQKV]);
    agrads.dbt4c = device_alloc(gpu_plan_bytes(&plan, BUF_DBT4C), gpu_buf_names[BUF_DBT4C]);
    Scratch scratch;
    memset(&scratch, 0, sizeof(scratch));
    scratch.dweight_seq = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_DWEIGHT_SEQ), gpu_buf_names[BUF_DWEIGHT_SEQ]);
    scratch.att_ds = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_ATT_DS), gpu_buf_names[BUF_ATT_DS]);
    scratch.att_D = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_ATT_D), gpu_buf_names[BUF_ATT_D]);
    scratch.leaves = (float*)device_alloc(gpu_plan_bytes(&plan, BUF_LEAVES), gpu_buf_names[BUF_LEAVES]);
    scratch.inputs = (int*)device_alloc(gpu_plan_bytes(&plan, BUF_INPUTS), gpu_buf_names[BUF_INPUTS]);
    scratch.targets = (int*)device_alloc(gpu_plan_bytes(&plan, BUF_TARGETS), gpu_buf_names[BUF_TARGETS]);
    scratch.enc_order = (int*)device_alloc(gpu_plan_bytes(&plan, BUF_ENC_ORDER), gpu_buf_names[BUF_ENC_ORDER]);
    scratch.enc_begin = (int*)device_alloc(gpu_plan_bytes(&plan, BUF_ENC_BEGIN), gpu_buf_names[BUF_ENC_BEGIN]);
    scratch.enc_tokens = (int*)device_alloc(gpu_plan_bytes(&plan, BUF_ENC_TOKENS), gpu_buf_names[BUF_ENC_TOKENS]);
    scratch.sumsq = (SumSq*)device_alloc(sizeof(SumSq), "gradient norm");
    void* lt_workspace = device_alloc(gpu_plan_bytes(&plan, BUF_CUBLASLT_WS), gpu_buf_names[BUF_CUBLASLT_WS]);
    int* sample_tokens = NULL;
    if (do_sample) {
        size_t sc[NUM_BUFS], sw[NUM_BUFS];
        gpu_plan_activations(&config, 1, genT, det, 1, sc, sw);
        char* blob = (char*)device_alloc(gpu_plan_bytes(&plan, BUF_SAMPLE_ACTS), gpu_buf_names[BUF_SAMPLE_ACTS]);
        activations_alloc(&sample_acts, sc, sw, blob, 1);
        sample_tokens = (int*)(blob + gpu_plan_bytes(&plan, BUF_SAMPLE_ACTS) - gpu_round256((size_t)genT * 4));
    }
    int max_runs = 4 + NUM_LAYER_TENSORS * config.num_layers;
    int64_t* host_run_end = (int64_t*)malloc_or_die(sizeof(int64_t) * max_runs, "AdamW runs");
    int* host_run_decay = (int*)malloc_or_die(sizeof(int) * max_runs, "AdamW runs");
    model.nruns = adamw_decay_runs(&config, host_run_end, host_run_decay, max_runs);
    if (model.nruns == 0) { fatal("internal: the parameter tensors do not tile the flat buffer"); }
    model.run_end = (int64_t*)device_alloc(sizeof(int64_t) * model.nruns, "AdamW runs");
    model.run_decay = (int*)device_alloc(sizeof(int) * model.nruns, "AdamW runs");
    cudaCheck(cudaMemcpy(model.run_end, host_run_end, sizeof(int64_t) * model.nruns, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(model.run_decay, host_run_decay, sizeof(int) * model.nruns, cudaMemcpyHostToDevice));
    HostEncoderPlan enc_plan;
    enc_plan.count = (int*)malloc_or_die(sizeof(int) * ((size_t)Vp + 1), "token grouping");
    enc_plan.order = (int*)malloc_or_die(sizeof(int) * tokens_per_micro, "token grouping");
    enc_plan.begin = (int*)malloc_or_die(sizeof(int) * (tokens_per_micro + 1), "token grouping");
    enc_plan.tokens = (int*)malloc_or_die(sizeof(int) * tokens_per_micro, "token grouping");
    float* host_m = (float*)aligned_calloc_or_die(P * sizeof(float), "AdamW m");
    float* host_v = (float*)aligned_calloc_or_die(P * sizeof(float), "AdamW v");
    int max_state = 4 + NUM_LAYER_TENSORS * config.num_layers;
    int64_t* state_begin = (int64_t*)malloc_or_die(sizeof(int64_t) * max_state, "state ranges");
    int64_t* state_end = (int64_t*)malloc_or_die(sizeof(int64_t) * max_state, "state ranges");
    StateRange* state = (StateRange*)malloc_or_die(sizeof(StateRange) * max_state, "state ranges");
    int nstate = state_tensor_ranges(&config, state_begin, state_end);
    if (!det) {
        cublaslt_init(lt_workspace);
        flash_attention_setup();
    }

    cudaCheck(cudaMemcpy(model.params, host_params, P * sizeof(float), cudaMemcpyHostToDevice));
    if (!det) { float_to_bf16(model.params_x, model.params, P); }
    TrainProgress progress = {0, 0, tokens_per_micro, args.shuffle, (uint64_t)args.seed};
    if (resume_step >= 0) {
        TrainProgress saved;
        StateRange all = {0, (int64_t)P, host_m, host_v};
        state_read(args.output_dir, resume_step, &config, 1, &all, &saved);
        if (saved.tokens_per_microbatch != tokens_per_micro || saved.shuffle != args.shuffle ||
            saved.shuffle_seed != (uint64_t)args.seed) {
            fatal("-y 1: the checkpoint in '%s' was trained with B*T = %lld, --shuffle %d, --seed %llu; "
                  "resume with the same values", args.output_dir, (long long)saved.tokens_per_microbatch,
                  saved.shuffle, (unsigned long long)saved.shuffle_seed);
        }
        progress = saved;
    }
    cudaCheck(cudaMemcpy(model.m, host_m, P * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(model.v, host_v, P * sizeof(float), cudaMemcpyHostToDevice));
    Logger logger;
    logger_init(&logger, args.output_dir, 1, resume_step >= 0);

    double flops_per_step = gpt2_flops_per_step(P, &config, T, total_batch);
    size_t act_bytes = 0;
    for (int i = BUF_ENCODED; i <= BUF_PROJ; i++) { act_bytes += gpu_plan_bytes(&plan, i); }
    const char* peak_name;
    double peak_tflops = gpu_peak_tflops(prop.major, prop.minor, prop.name, det, &peak_name);
    printf("+--------------------------------------------------------------------------+\n");
    printf("| train_gpt2cu (%s mode)\n", det ? "deterministic: fp32, canonical arithmetic, bit-exact"
                                             : "fast: bf16, cuBLASLt, flash attention");
    printf("+--------------------------------------------------------------------------+\n");
    printf("| GPU           %s, compute capability %d.%d, %d SMs, %.1f GiB\n", prop.name, prop.major,
           prop.minor, prop.multiProcessorCount, total_b / 1073741824.0);
    printf("| MFU peak      %s\n", peak_name);
    printf("| model         L=%d C=%d NH=%d V=%d Vp=%d maxT=%d\n", config.num_layers, C, NH,
           config.vocab_size, Vp, config.max_seq_len);
    if (resume_step >= 0) { printf("| init          %s/model_%08d.bin\n", args.output_dir, resume_step); }
    else { printf("| init          %s\n", args.model); }
    printf("| parameters    %zu (%.1f M)\n", P, P / 1e6);
    printf("| batch         B=%d T=%d, %d microbatch(es) per step = %lld tokens\n", B, T, M, total_batch);
    if (args.zero_stage != 0) {
        printf("| ZeRO          stage %d over one GPU: nothing to shard (the same training as stage 0)\n",
               args.zero_stage);
    }
    train_data_print_summary(&args, train_steps, &train_loader, &val_loader, val_batches);
    printf("| memory        %.2f GiB on the GPU: params+AdamW %.2f, gradients %.2f (%d buffer(s)), "
           "activations %.2f, recompute %d\n", need / 1073741824.0,
           (gpu_plan_bytes(&plan, BUF_PARAMS) + gpu_plan_bytes(&plan, BUF_PARAMS_BF16) +
            gpu_plan_bytes(&plan, BUF_ADAM_M) + gpu_plan_bytes(&plan, BUF_ADAM_V)) / 1073741824.0,
           gpu_plan_bytes(&plan, BUF_GRADS) / 1073741824.0, plan.grad_buffers, act_bytes / 1073741824.0,
           args.recompute);
    printf("| output        %s\n", args.output_dir ? args.output_dir : "(none)");
    if (resume_step >= 0) { printf("| resuming      from step %d\n", resume_step); }
    printf("+--------------------------------------------------------------------------+\n");
    fflush(stdout);

    float dloss = 1.0f / (float)total_batch;
    size_t ngrad = model.num_grads;
    double total_time = 0.0;
    int timed_steps = 0;
    const int first_step = (int)progress.step;
    for (int step = (int)progress.step; step <= train_steps; step++) {
        int last_step = step == train_steps;

        if (do_val && (step % args.val_every == 0 || last_step)) {
            float stack[64];
            int top = 0;
            stack[0] = 0.0f;   // no batches: train_gpt2's empty tree is 0 too
            for (int i = 0; i < val_batches; i++) {
                dataloader_load(&val_loader, i);
                upload_microbatch(&scratch, NULL, val_loader.inputs, val_loader.targets, B * T, Vp);
                stack[top++] = forward_loss(&model, &acts, &scratch, B, T, 0, 0.0f);
                for (int mg = canon_tree_merges_after(i, val_batches); mg > 0; mg--) {
                    stack[top - 2] = stack[top - 2] + stack[top - 1];
                    top--;
                }
            }
            float val_loss = stack[0] / (float)((double)val_batches * B * T);
            printf("val loss %.6f\n", val_loss);
            logger_log_val(&logger, step, val_loss);
        }
        if (do_sample && ((step > 0 && step % args.sample_every == 0) || last_step)) {
            sample_text(&model, &sample_acts, sample_tokens, &tokenizer, genT);
        }
        if (args.checkpoint_every > 0 && step != resume_step &&
            ((step > 0 && step % args.checkpoint_every == 0) || last_step)) {
            cudaCheck(cudaMemcpy(host_params, model.params, P * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(host_m, model.m, P * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(host_v, model.v, P * sizeof(float), cudaMemcpyDeviceToHost));
            snprintf(path, sizeof(path), "%s/model_%08d.bin", args.output_dir, step);
            checkpoint_write_model(path, &config, host_params);
            snprintf(path, sizeof(path), "%s/state_%08d_%05d.bin", args.output_dir, step, 0);
            progress.step = step;
            for (int r = 0; r < nstate; r++) {
                state[r].begin = state_begin[r];
                state[r].end = state_end[r];
                state[r].m = host_m + state_begin[r];
                state[r].v = host_v + state_begin[r];
            }
            state_write_piece(path, &config, &progress, 1, 0, nstate, state);
            checkpoint_write_done(args.output_dir, step);
            printf("checkpoint written: %s/model_%08d.bin\n", args.output_dir, step);
        }
        if (last_step) { break; }

        // ---- one optimizer step over M microbatches: gradients by the R1 tree ----
        double t0 = now_seconds();
        float loss_stack[64];
        int loss_top = 0, grad_top = 0;
        for (int mb = 0; mb < M; mb++) {
            int64_t gidx = args.overfit_single_batch ? 0 : progress.microbatches_done + mb;
            dataloader_load(&train_loader, gidx);
            upload_microbatch(&scratch, &enc_plan, train_loader.inputs, train_loader.targets, B * T, Vp);
            float* grads = model.grad_bufs + (size_t)grad_top++ * ngrad;
            loss_stack[loss_top++] = forward_loss(&model, &acts, &scratch, B, T, 1, dloss);
            if (det) {
                gpt2_backward_det(&model, &acts, &agrads, &scratch, grads, B, T, dloss);
            } else {
                gpt2_backward_fast(&model, &acts, &agrads, &scratch, grads, B, T);
            }
            for (int mg = canon_tree_merges_after(mb, M); mg > 0; mg--) {
                float* left = model.grad_bufs + (size_t)(grad_top - 2) * ngrad;
                residual_forward(left, left, left + ngrad, ngrad);
                grad_top--;
                loss_stack[loss_top - 2] = loss_stack[loss_top - 2] + loss_stack[loss_top - 1];
                loss_top--;
            }
        }
        progress.microbatches_done += M;
        float loss = loss_stack[0] / (float)total_batch;
        float* grads = model.grad_bufs;
        // the tied embedding: wte gradient = lm-head half + lookup half (zero_finish_grads)
        float* dwte = grads + param_offset(&config, P_WTE, 0);
        residual_forward(dwte, dwte, wte_emb_grad(&model, grads), (size_t)Vp * C);
        float norm = gradient_norm(grads, P, scratch.sumsq);
        float grad_scale = args.grad_clip > 0.0f && norm > args.grad_clip ? args.grad_clip / norm : 1.0f;
        float lr = lr_at_step(&schedule, step);
        AdamWStep s = adamw_step_constants(lr, args.beta1, args.beta2, args.eps, step + 1, grad_scale);
        adamw_update(model.params, det ? NULL : model.params_x, model.m, model.v, grads, P, model.run_end,
                     model.run_decay, model.nruns, &s, args.weight_decay);
        cudaCheck(cudaDeviceSynchronize());
        progress.step = step + 1;
        double dt = now_seconds() - t0;
        if (step > first_step) { total_time += dt; timed_steps++; }   // the first carries the warm-up
        char mfu[32];
        if (peak_tflops > 0) {
            snprintf(mfu, sizeof(mfu), "MFU %.1f%%", 100.0 * flops_per_step / dt / (peak_tflops * 1e12));
        } else {
            snprintf(mfu, sizeof(mfu), "MFU n/a");
        }
        printf("step %4d/%d | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s | %s\n",
               step + 1, train_steps, loss, lr, norm, dt * 1e3, total_batch / dt, mfu);
        fflush(stdout);
        logger_log_train(&logger, step, loss, lr, norm);
    }
    if (timed_steps > 0) {
        double avg = total_time / timed_steps;
        printf("average step time %.1f ms (excluding the first), %.0f tok/s", avg * 1e3, total_batch / avg);
        if (peak_tflops > 0) { printf(", MFU %.1f%%", 100.0 * flops_per_step / avg / (peak_tflops * 1e12)); }
        printf("\n");
    }
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    printf("device memory: %.2f GiB allocated by train_gpt2cu, %.2f GiB in use on the GPU\n",
           device_bytes_allocated / 1073741824.0, (total_b - free_b) / 1073741824.0);

    if (!det) { cublaslt_free(); }
    dataloader_free(&train_loader);
    if (do_val) { dataloader_free(&val_loader); }
    tokenizer_free(&tokenizer);
    free(host_params);
    free(host_m);
    free(host_v);
    free(state_begin);
    free(state_end);
    free(state);
    free(host_run_end);
    free(host_run_decay);
    free(enc_plan.count);
    free(enc_plan.order);
    free(enc_plan.begin);
    free(enc_plan.tokens);
    cudaCheck(cudaDeviceReset());
    return 0;
}
#endif
