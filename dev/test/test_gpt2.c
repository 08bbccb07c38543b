/*
 * test_gpt2.c: the CPU trainer's model against an independent double-precision GPT-2.
 *
 *  1. forward: an independent naive forward in double (libm exp/tanh/log, written here from
 *     the GPT-2 definition, sharing nothing with the trainer's kernels) gives probabilities
 *     and the loss; the trainer's float forward must agree within float32 accuracy.
 *  2. gradients: central finite differences of the double loss for EVERY parameter of a tiny
 *     model, against the trainer's analytic float backward, tensor by tensor (all 16).
 *  3. gradient accumulation: one microbatch of B=4 sequences, two of B=2 and four of B=1,
 *     combined by the trainer's microbatch tree, give bit-identical gradients and loss (the
 *     canonical order promises it for power-of-two microbatch counts).
 * Exits non-zero on any failure.
 */
#define TESTING
#include "train_gpt2.c"

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

// --- the double-precision reference ------------------------------------------------------

typedef struct {
    const GPT2Config* c;
    const double* p;   // parameters, MEMORY order (model.h layout)
} RefModel;

static const double* refp(const RefModel* m, int tensor, int layer) {
    return m->p + param_offset(m->c, tensor, layer);
}

static void ref_layernorm(double* out, const double* x, const double* w, const double* b, int C) {
    double mean = 0, var = 0;
    for (int i = 0; i < C; i++) { mean += x[i]; }
    mean /= C;
    for (int i = 0; i < C; i++) { var += (x[i] - mean) * (x[i] - mean); }
    var /= C;
    double rstd = 1.0 / sqrt(var + 1e-5);
    for (int i = 0; i < C; i++) { out[i] = (x[i] - mean) * rstd * w[i] + b[i]; }
}

// y (OC) = W (OC x K) x + bias
static void ref_linear(double* y, const double* x, const double* W, const double* bias, int K, int OC) {
    for (int o = 0; o < OC; o++) {
        double s = bias ? bias[o] : 0.0;
        for (int k = 0; k < K; k++) { s += W[(size_t)o * K + k] * x[k]; }
        y[o] = s;
    }
}

static double ref_gelu(double x) {
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

// Mean cross-entropy over the B*T positions; probs_out (B,T,V) if not NULL.
static double ref_forward(const RefModel* m, const int* inp, const int* tgt, int B, int T, double* probs_out) {
    const GPT2Config* c = m->c;
    int C = c->channels, NH = c->num_heads, hs = C / NH, V = c->vocab_size, L = c->num_layers;
    int BT = B * T;
    double* x = calloc((size_t)BT * C, sizeof(double));
    double* ln = calloc((size_t)BT * C, sizeof(double));
    double* qkv = calloc((size_t)BT * 3 * C, sizeof(double));
    double* y = calloc((size_t)BT * C, sizeof(double));
    double* h = calloc((size_t)BT * 4 * C, sizeof(double));
    double* tmp = calloc((size_t)4 * C, sizeof(double));
    double* logits = calloc((size_t)V, sizeof(double));
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int i = 0; i < C; i++) {
                x[((size_t)b * T + t) * C + i] = refp(m, P_WTE, 0)[(size_t)inp[b * T + t] * C + i]
                                               + refp(m, P_WPE, 0)[(size_t)t * C + i];
            }
        }
    }
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < BT; i++) {
            ref_layernorm(ln + (size_t)i * C, x + (size_t)i * C, refp(m, P_LN1W, l), refp(m, P_LN1B, l), C);
            ref_linear(qkv + (size_t)i * 3 * C, ln + (size_t)i * C, refp(m, P_QKVW, l), refp(m, P_QKVB, l), C, 3 * C);
        }
        for (int b = 0; b < B; b++) {
            for (int hh = 0; hh < NH; hh++) {
                for (int t = 0; t < T; t++) {
                    const double* q = qkv + ((size_t)b * T + t) * 3 * C + hh * hs;
                    double scores[1024], maxs = -1e300, z = 0;
                    for (int t2 = 0; t2 <= t; t2++) {
                        const double* k = qkv + ((size_t)b * T + t2) * 3 * C + C + hh * hs;
                        double s = 0;
                        for (int d = 0; d < hs; d++) { s += q[d] * k[d]; }
                        scores[t2] = s / sqrt((double)hs);
                        if (scores[t2] > maxs) { maxs = scores[t2]; }
                    }
                    for (int t2 = 0; t2 <= t; t2++) { scores[t2] = exp(scores[t2] - maxs); z += scores[t2]; }
                    double* out = y + ((size_t)b * T + t) * C + hh * hs;
                    for (int d = 0; d < hs; d++) {
                        double s = 0;
                        for (int t2 = 0; t2 <= t; t2++) {
                            s += scores[t2] / z * qkv[((size_t)b * T + t2) * 3 * C + 2 * C + hh * hs + d];
                        }
                        out[d] = s;
                    }
                }
            }
        }
        for (int i = 0; i < BT; i++) {
            ref_linear(tmp, y + (size_t)i * C, refp(m, P_ATTPROJW, l), refp(m, P_ATTPROJB, l), C, C);
            for (int j = 0; j < C; j++) { x[(size_t)i * C + j] += tmp[j]; }
            ref_layernorm(ln + (size_t)i * C, x + (size_t)i * C, refp(m, P_LN2W, l), refp(m, P_LN2B, l), C);
            ref_linear(h + (size_t)i * 4 * C, ln + (size_t)i * C, refp(m, P_FCW, l), refp(m, P_FCB, l), C, 4 * C);
            for (int j = 0; j < 4 * C; j++) { h[(size_t)i * 4 * C + j] = ref_gelu(h[(size_t)i * 4 * C + j]); }
            ref_linear(tmp, h + (size_t)i * 4 * C, refp(m, P_FCPROJW, l), refp(m, P_FCPROJB, l), 4 * C, C);
            for (int j = 0; j < C; j++) { x[(size_t)i * C + j] += tmp[j]; }
        }
    }
    double loss = 0;
    for (int i = 0; i < BT; i++) {
        ref_layernorm(ln + (size_t)i * C, x + (size_t)i * C, refp(m, P_LNFW, 0), refp(m, P_LNFB, 0), C);
        ref_linear(logits, ln + (size_t)i * C, refp(m, P_WTE, 0), NULL, C, V);   // first V rows
        double maxl = -1e300, z = 0;
        for (int v = 0; v < V; v++) { if (logits[v] > maxl) { maxl = logits[v]; } }
        for (int v = 0; v < V; v++) { z += exp(logits[v] - maxl); }
        if (probs_out) { for (int v = 0; v < V; v++) { probs_out[(size_t)i * V + v] = exp(logits[v] - maxl) / z; } }
        if (tgt) { loss += -(logits[tgt[i]] - maxl - log(z)); }
    }
    free(x); free(ln); free(qkv); free(y); free(h); free(tmp); free(logits);
    return loss / BT;
}

// --- helpers ------------------------------------------------------------------------------

static uint64_t lcg = 12345;
static double urand(void) {   // uniform in [-1, 1)
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return ((double)(lcg >> 11) / 9007199254740992.0) * 2.0 - 1.0;
}

// Parameters with O(0.1..1) values everywhere (GPT-2's init would make many gradients tiny).
static void random_params(float* params, const GPT2Config* c) {
    for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
        int layers = param_is_layer_tensor(t) ? c->num_layers : 1;
        for (int l = 0; l < layers; l++) {
            float* p = params + param_offset(c, t, l);
            size_t n = param_tensor_elements(c, t);
            for (size_t i = 0; i < n; i++) {
                double r = urand();
                if (t == P_LN1W || t == P_LN2W || t == P_LNFW) { p[i] = (float)(1.0 + 0.2 * r); }
                else if (t == P_WTE && i >= (size_t)c->vocab_size * c->channels) { p[i] = 0.0f; }
                else { p[i] = (float)(0.3 * r); }
            }
        }
    }
}

// The whole model on one rank (one pipeline stage), its parameters in zero.h's host buffers,
// for steps of M microbatches.
static void model_on_one_rank(GPT2* model, Zero* z, const GPT2Config* c, const float* params, int M,
                              Comm* comm) {
    StagePlace place = {0, c->num_layers, 1, 1};
    zero_init(z, c, &memory_host, 0, &comm->dp_group, &comm->dp_group, &comm->pp_group, &comm->tp_group, 0, c->num_layers,
              params, M);
    gpt2_init(model, c, &place, z, &comm->tp_group, &comm->cp_group, 0, 0, 0, 0);
}

static void model_free(GPT2* model, Zero* z) {
    gpt2_free(model);
    zero_free(z);
}

// One optimizer step's gradient over M microbatches of Bm sequences (inp/tgt hold M*Bm*T
// tokens), exactly as the trainer computes it: into model->zero->grads, wte halves summed.
// Returns the R1 tree of the microbatch loss sums.
static float step_grads(GPT2* model, Activations* a, ActivationGrads* g, const int* inp,
                        const int* tgt, int Bm, int T, int M) {
    Zero* z = model->zero;
    float losses[16];
    float dloss = 1.0f / (float)(Bm * T * M);
    for (int i = 0; i < M; i++) {
        zero_begin_microbatch(z, i);
        gpt2_forward(model, a, inp + i * Bm * T, tgt + i * Bm * T, Bm, T, 1);
        losses[i] = position_sum(a->losses, Bm, T);
        gpt2_backward(model, a, g, Bm, T, dloss);
        zero_end_microbatch(z);
    }
    zero_finish_grads(z);
    return canon_tree_sum(losses, M, 1);
}

int main(int argc, char** argv) {
    Comm comm;   // a single rank: the test runs without mpirun
    comm_init(&comm, &argc, &argv);
    GPT2Config c = {.max_seq_len = 8, .vocab_size = 23, .padded_vocab_size = padded_vocab(23),
                    .num_layers = 2, .num_heads = 2, .channels = 16};
    float* params = gpt2_random_params(&c, 7);
    random_params(params, &c);
    GPT2 model;
    Zero zero;
    model_on_one_rank(&model, &zero, &c, params, 1, &comm);
    int B = 2, T = 5, BT = B * T;   // T < maxT and T not a multiple of the 8 chunks
    int inp[64], tgt[64];
    for (int i = 0; i < BT; i++) {
        inp[i] = (int)((urand() + 1.0) * 0.5 * c.vocab_size) % c.vocab_size;
        tgt[i] = (int)((urand() + 1.0) * 0.5 * c.vocab_size) % c.vocab_size;
    }
    inp[3] = inp[1];   // a repeated token: its embedding gradient sums two positions
    size_t P = param_count(&c);
    double* pd = malloc(sizeof(double) * P);
    for (size_t i = 0; i < P; i++) { pd[i] = params[i]; }
    RefModel ref = {&c, pd};

    Activations acts;
    ActivationGrads ag;
    activations_alloc(&acts, &model, 4, T, 1, 0);
    activation_grads_alloc(&ag, &model, 4, T, 0);

    // 1. forward
    double* probs_ref = malloc(sizeof(double) * BT * c.vocab_size);
    double loss_ref = ref_forward(&ref, inp, tgt, B, T, probs_ref);
    zero_begin_microbatch(&zero, 0);
    gpt2_forward(&model, &acts, inp, tgt, B, T, 1);
    float loss = position_sum(acts.losses, B, T) / (float)BT;
    double max_prob_err = 0;
    for (int i = 0; i < BT; i++) {
        for (int v = 0; v < c.vocab_size; v++) {
            double e = fabs(acts.probs[(size_t)i * c.padded_vocab_size + v] - probs_ref[(size_t)i * c.vocab_size + v]);
            if (e > max_prob_err) { max_prob_err = e; }
        }
    }
    gpt2_backward(&model, &acts, &ag, B, T, 1.0f / (float)BT);
    zero_end_microbatch(&zero);
    zero_finish_grads(&zero);
    const float* grads = zero.grads;
    printf("forward: loss float %.9g double %.12g (rel err %.2e), max |prob err| %.2e\n", loss,
           loss_ref, fabs(loss - loss_ref) / loss_ref, max_prob_err);
    // float32 has 24 bits: a loss of ~3 computed through 2 layers is good to a few 1e-7
    CHECK(fabs(loss - loss_ref) <= 2e-6 * loss_ref, "loss %.9g vs double %.12g", loss, loss_ref);
    CHECK(max_prob_err <= 2e-6, "probabilities differ from the double reference by %.3g", max_prob_err);

    // 2. gradients, every parameter, central differences in double
    double h = 1e-5;
    double worst_rel = 0;
    for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
        int layers = param_is_layer_tensor(t) ? c.num_layers : 1;
        double max_abs_fd = 0, max_err = 0, err2 = 0, fd2 = 0;
        for (int l = 0; l < layers; l++) {
            size_t off = param_offset(&c, t, l), n = param_tensor_elements(&c, t);
            for (size_t i = off; i < off + n; i++) {
                double saved = pd[i];
                pd[i] = saved + h;
                double lp = ref_forward(&ref, inp, tgt, B, T, NULL);
                pd[i] = saved - h;
                double lm = ref_forward(&ref, inp, tgt, B, T, NULL);
                pd[i] = saved;
                double fd = (lp - lm) / (2 * h);
                double e = fabs(fd - grads[i]);
                if (fabs(fd) > max_abs_fd) { max_abs_fd = fabs(fd); }
                if (e > max_err) { max_err = e; }
                err2 += e * e;
                fd2 += fd * fd;
            }
        }
        double rel = fd2 > 0 ? sqrt(err2 / fd2) : sqrt(err2);
        if (rel > worst_rel) { worst_rel = rel; }
        printf("  grad %-9s max|fd| %.3e  max|err| %.3e  rel L2 err %.2e\n", param_tensor_names[t],
               max_abs_fd, max_err, rel);
        // float32 backward vs O(h^2)+roundoff-accurate differences: errors of a few 1e-7
        // relative to the tensor's largest gradient are float rounding; 1e-5 is 20x that.
        CHECK(max_err <= 1e-5 * max_abs_fd + 1e-9, "gradient of %s: max error %.3g (max |fd| %.3g)",
              param_tensor_names[t], max_err, max_abs_fd);
        CHECK(max_abs_fd > 0 || t == P_WPE, "gradient of %s is identically zero: the check proves nothing",
              param_tensor_names[t]);
    }
    printf("gradient check: worst tensor relative L2 error %.2e\n", worst_rel);

    // 3. microbatches: B=4 once vs B=2 twice vs B=1 four times (same 4 sequences)
    int inp4[4 * 5], tgt4[4 * 5];
    for (int i = 0; i < 20; i++) {
        inp4[i] = (int)((urand() + 1.0) * 0.5 * c.vocab_size) % c.vocab_size;
        tgt4[i] = (int)((urand() + 1.0) * 0.5 * c.vocab_size) % c.vocab_size;
    }
    size_t G = P + (size_t)c.padded_vocab_size * c.channels;
    float* reference = malloc(sizeof(float) * G);
    GPT2 m1;
    Zero z1;
    model_on_one_rank(&m1, &z1, &c, params, 1, &comm);
    float loss_ref4 = step_grads(&m1, &acts, &ag, inp4, tgt4, 4, T, 1);
    memcpy(reference, z1.grads, sizeof(float) * G);
    model_free(&m1, &z1);
    for (int M = 2; M <= 4; M *= 2) {
        int Bm = 4 / M;
        GPT2 mm;
        Zero zm;
        model_on_one_rank(&mm, &zm, &c, params, M, &comm);
        float loss_m = step_grads(&mm, &acts, &ag, inp4, tgt4, Bm, T, M);
        size_t diff = 0;
        for (size_t i = 0; i < G; i++) {
            if (memcmp(&reference[i], &zm.grads[i], 4) != 0) { diff++; }
        }
        printf("microbatches: B=%d x M=%d vs B=4 x M=1: %zu of %zu gradient values differ, loss %s\n",
               Bm, M, diff, G, memcmp(&loss_m, &loss_ref4, 4) == 0 ? "identical" : "DIFFERS");
        CHECK(diff == 0, "B=%d x %d microbatches: %zu gradient values differ from B=4", Bm, M, diff);
        CHECK(memcmp(&loss_m, &loss_ref4, 4) == 0, "B=%d x %d: loss sum %.9g vs %.9g", Bm, M, loss_m, loss_ref4);
        model_free(&mm, &zm);
    }
    activations_free(&model, &acts);
    activation_grads_free(&model, &ag);
    model_free(&model, &zero);
    free(reference);
    free(probs_ref);
    free(pd);
    free(params);
    comm_finalize(&comm);

    if (failures) { printf("%d check(s) FAILED\n", failures); return 1; }
    printf("all checks passed\n");
    return 0;
}
