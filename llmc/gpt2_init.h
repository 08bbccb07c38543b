/*
 * gpt2_init.h: GPT-2's random initialisation of a fresh model (-e dN), for both builds
 * (train_gpt2.cu initialises on the host and copies to the GPU): weights ~ N(0, 0.02), the two
 * projections back into the residual stream (attproj, fcproj) ~ N(0, 0.02/sqrt(2L)), biases
 * 0, layernorm weights 1, padded vocabulary rows 0, drawn tensor by tensor in llm.c's file
 * order, layer by layer, from one generator seeded with `seed` (rand.h: the same bits on
 * every machine). Every rank of every layout draws the full model and takes its part.
 * gpt2_starting_params picks what a run starts from (resume, fresh, or a model file).
 */
#ifndef LLMC_GPT2_INIT_H
#define LLMC_GPT2_INIT_H

#include <math.h>
#include <stdint.h>
#include "llmc/model.h"
#include "llmc/rand.h"
#include "llmc/checkpoint.h"
#include "llmc/utils.h"

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

// A fresh GPT-2 with GPT-2's initialisation.
static inline float* gpt2_random_params(const GPT2Config* config, uint64_t seed) {
    float* params = (float*)aligned_calloc_or_die(param_count(config) * sizeof(float), "parameters");
    gpt2_init_params(params, config, seed);
    return params;
}

// A model file whose parameters are not all finite is refused (training from it could only
// write more NaN checkpoints), unless allow_nonfinite.
static inline float* gpt2_read_finite_model(const char* path, GPT2Config* config, int allow_nonfinite) {
    float* params = checkpoint_read_model(path, config);
    size_t P = param_count(config);
    for (size_t i = 0; i < P && !allow_nonfinite; i++) {
        if (!isfinite(params[i])) {
            int tensor = 0, layer = 0;
            param_locate(config, i, &tensor, &layer);
            fatal("model file '%s' holds a non-finite parameter (%g, in %s of layer %d): it diverged; resume from an "
                  "earlier checkpoint, or pass --allow-nonfinite 1 to load it anyway", path, params[i],
                  param_tensor_names[tensor], layer);
        }
    }
    return params;
}

// The full parameters a run starts from, on the host: the checkpoint of resume_step in
// output_dir when resuming (resume_step >= 0), a fresh GPT-2 for -e dN, else the model file -e.
static inline float* gpt2_starting_params(const char* model, const char* output_dir, int resume_step,
                                          uint64_t seed, int allow_nonfinite, GPT2Config* config) {
    if (resume_step >= 0) {
        char path[1200];
        snprintf(path, sizeof(path), "%s/model_%08d.bin", output_dir, resume_step);
        return gpt2_read_finite_model(path, config, allow_nonfinite);
    }
    if (config_from_descriptor(model, config)) {
        const char* problem = config_problem(config);
        if (problem) { fatal("-e %s: %s", model, problem); }
        return gpt2_random_params(config, seed);
    }
    if (!file_exists(model)) {
        fatal("-e: model file '%s' not found; pass -e dN for a fresh GPT-2 of depth N (e.g. -e d12), "
              "or import OpenAI's weights with scripts/download_gpt2_weights.sh", model);
    }
    return gpt2_read_finite_model(model, config, allow_nonfinite);
}

#endif // LLMC_GPT2_INIT_H
