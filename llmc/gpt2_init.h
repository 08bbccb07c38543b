/*
 * gpt2_init.h: GPT-2's random initialisation of a fresh model (-e dN), for both builds
 * (train_gpt2.cu initialises on the host and copies to the GPU): weights ~ N(0, 0.02), the two
 * projections back into the residual stream (attproj, fcproj) ~ N(0, 0.02/sqrt(2L)), biases
 * 0, layernorm weights 1, padded vocabulary rows 0, drawn tensor by tensor in llm.c's file
 * order, layer by layer, from one generator seeded with `seed` (rand.h: the same bits on
 * every machine). Every rank of every layout draws the full model and takes its part.
 */
#ifndef LLMC_GPT2_INIT_H
#define LLMC_GPT2_INIT_H

#include <math.h>
#include <stdint.h>
#include "llmc/model.h"
#include "llmc/rand.h"

typedef struct {
    float* params;
    const GPT2Config* c;
    uint64_t rng;
} Gpt2InitCtx;

static inline void gpt2_init_piece(int t, int layer, size_t offset, size_t elements, void* vctx) {
    Gpt2InitCtx* ctx = (Gpt2InitCtx*)vctx;
    float* dst = ctx->params + offset;
    (void)layer;
    if (t == P_LN1W || t == P_LN2W || t == P_LNFW) {
        for (size_t i = 0; i < elements; i++) { dst[i] = 1.0f; }
    } else if (param_is_decayed(t)) {
        float std = 0.02f;
        if (t == P_ATTPROJW || t == P_FCPROJW) {
            std = (float)(0.02 / sqrt(2.0 * ctx->c->num_layers));
        }
        size_t n = t == P_WTE ? (size_t)ctx->c->vocab_size * ctx->c->channels : elements;
        random_normal_fill(dst, n, 0.0f, std, &ctx->rng);
    }
}

// params: param_count(c) floats, zero-filled by the caller; MEMORY order (model.h).
static inline void gpt2_init_params(float* params, const GPT2Config* c, uint64_t seed) {
    Gpt2InitCtx ctx = {params, c, seed ? seed : 1};
    param_for_each_in_file_order(c, gpt2_init_piece, &ctx);
}

#endif // LLMC_GPT2_INIT_H
