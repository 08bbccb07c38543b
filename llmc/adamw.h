/*
 * adamw.h: the AdamW update of one parameter (shared by gcc and nvcc) and the learning-rate
 * schedules (host). Defaults follow llm.c's train_gpt2.cu: beta1 0.9, beta2 0.95, eps 1e-8,
 * weight decay on 2-D tensors only (model.h param_is_decayed), gradients clipped to a global
 * norm of 1.0.
 */
#ifndef LLMC_ADAMW_H
#define LLMC_ADAMW_H

#include <string.h>
#include "llmc/canonical.h"

// Everything one optimizer step needs besides the tensors. Computed once per step on the
// host (adamw_step_constants), identical on every rank and device.
typedef struct {
    float lr;
    float beta1, beta2, eps;
    float one_minus_beta1, one_minus_beta2;
    float bias_correction1, bias_correction2;   // 1 - beta^t
    float grad_scale;                           // gradient clipping factor (1 when not clipped)
} AdamWStep;

// beta^t in double by repeated squaring: the same bits on every IEEE machine.
static inline double adamw_pow(double beta, long long t) {
    double result = 1.0, base = beta;
    while (t > 0) {
        if (t & 1) { result *= base; }
        base *= base;
        t >>= 1;
    }
    return result;
}

static inline AdamWStep adamw_step_constants(float lr, float beta1, float beta2, float eps,
                                             long long t, float grad_scale) {
    AdamWStep s;
    s.lr = lr;
    s.beta1 = beta1;
    s.beta2 = beta2;
    s.eps = eps;
    s.one_minus_beta1 = 1.0f - beta1;
    s.one_minus_beta2 = 1.0f - beta2;
    s.bias_correction1 = (float)(1.0 - adamw_pow((double)beta1, t));
    s.bias_correction2 = (float)(1.0 - adamw_pow((double)beta2, t));
    s.grad_scale = grad_scale;
    return s;
}

// One parameter: m <- beta1 m + (1-beta1) g;  v <- beta2 v + (1-beta2) g^2;
// p <- p - lr (mhat / (sqrt(vhat) + eps) + wd p), with mhat = m / (1-beta1^t) etc.
HD void adamw_update_elem(float* p, float* m, float* v, float grad, const AdamWStep* s,
                          float weight_decay) {
    float g = grad * s->grad_scale;
    float mt = fmaf(s->beta1, *m, s->one_minus_beta1 * g);
    float vt = fmaf(s->beta2, *v, s->one_minus_beta2 * (g * g));
    float mhat = mt / s->bias_correction1;
    float vhat = vt / s->bias_correction2;
    float update = fmaf(weight_decay, *p, mhat / (sqrtf(vhat) + s->eps));
    *p = fmaf(-s->lr, update, *p);
    *m = mt;
    *v = vt;
}

// --- learning-rate schedules (llm.c's schedulers: cosine, linear, constant) ---------------
typedef enum { LR_COSINE, LR_LINEAR, LR_CONSTANT } LRScheduleKind;

typedef struct {
    LRScheduleKind kind;
    float max_lr;
    int warmup;           // linear warmup steps
    int total_steps;
    float final_frac;     // lr at the end = max_lr * final_frac
} LRSchedule;

// Returns 0 if name is not a known schedule.
static inline int lr_schedule_kind(const char* name, LRScheduleKind* kind) {
    if (strcmp(name, "cosine") == 0) { *kind = LR_COSINE; return 1; }
    if (strcmp(name, "linear") == 0) { *kind = LR_LINEAR; return 1; }
    if (strcmp(name, "constant") == 0) { *kind = LR_CONSTANT; return 1; }
    return 0;
}

static inline float lr_at_step(const LRSchedule* s, int step) {
    double max_lr = s->max_lr;
    if (s->kind == LR_CONSTANT) { return s->max_lr; }
    if (step < s->warmup) { return (float)(max_lr * (double)(step + 1) / (double)s->warmup); }
    double min_lr = max_lr * (double)s->final_frac;
    int span = s->total_steps - s->warmup;
    double ratio = span > 0 ? (double)(step - s->warmup) / (double)span : 1.0;
    if (ratio > 1.0) { ratio = 1.0; }
    if (s->kind == LR_LINEAR) { return (float)(max_lr - ratio * (max_lr - min_lr)); }
    double coeff = 0.5 * (1.0 + canon_cospi_d(ratio));
    return (float)(min_lr + coeff * (max_lr - min_lr));
}

#endif // LLMC_ADAMW_H
