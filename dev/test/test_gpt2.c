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
 *  4. 1 and 2 again for a mixture-of-experts model (llmc/moe.h: router, top-k with
 *     renormalised gates, E expert MLPs, the load-balancing loss added to the loss): the
 *     reference routes in double and adds alpha*E*sum f_e P_e per layer (f held constant, as
 *     its derivative is 0 wherever the choice does not flip; the test checks no choice is
 *     within reach of the finite-difference step).
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

// The smallest gap between a chosen expert's probability and an unchosen one's, over every
// position and layer of the last forward: the room the finite differences have.
static double ref_route_gap;

// Layer l's mixture of experts at one position: out (C) from x (C); p (E) the router's
// probabilities, chosen (k) marked in `taken` (E).
static void ref_moe(const RefModel* m, int l, const double* x, double* out, double* p, int* taken) {
    const GPT2Config* c = m->c;
    int C = c->channels, E = c->num_experts, k = c->top_k;
    double maxl = -1e300, z = 0, s = 0;
    for (int e = 0; e < E; e++) {
        p[e] = 0;
        for (int i = 0; i < C; i++) { p[e] += refp(m, P_ROUTERW, l)[(size_t)e * C + i] * x[i]; }
        if (p[e] > maxl) { maxl = p[e]; }
        taken[e] = 0;
    }
    for (int e = 0; e < E; e++) { p[e] = exp(p[e] - maxl); z += p[e]; }
    for (int e = 0; e < E; e++) { p[e] /= z; }
    for (int j = 0; j < k; j++) {   // the largest untaken, ties to the lower index
        int best = -1;
        for (int e = 0; e < E; e++) { if (!taken[e] && (best < 0 || p[e] > p[best])) { best = e; } }
        taken[best] = 1;
        s += p[best];
    }
    double lowest_taken = 1, highest_left = 0;
    for (int e = 0; e < E; e++) {
        if (taken[e] && p[e] < lowest_taken) { lowest_taken = p[e]; }
        if (!taken[e] && p[e] > highest_left) { highest_left = p[e]; }
    }
    if (k < E && lowest_taken - highest_left < ref_route_gap) { ref_route_gap = lowest_taken - highest_left; }
    double* h = calloc((size_t)4 * C, sizeof(double));
    double* y = calloc((size_t)C, sizeof(double));
    for (int i = 0; i < C; i++) { out[i] = 0; }
    for (int e = 0; e < E; e++) {
        if (!taken[e]) { continue; }
        ref_linear(h, x, refp(m, P_FCW, l) + (size_t)e * 4 * C * C, refp(m, P_FCB, l) + (size_t)e * 4 * C, C, 4 * C);
        for (int i = 0; i < 4 * C; i++) { h[i] = ref_gelu(h[i]); }
        ref_linear(y, h, refp(m, P_FCPROJW, l) + (size_t)e * C * 4 * C, refp(m, P_FCPROJB, l) + (size_t)e * C, 4 * C, C);
        for (int i = 0; i < C; i++) { out[i] += p[e] / s * y[i]; }
    }
    free(h);
    free(y);
}

// Mean cross-entropy over the B*T positions, plus each layer's load-balancing loss when the
// model has experts; probs_out (B,T,V) if not NULL.
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
    int E = c->num_experts;
    double* p = calloc((size_t)E + 1, sizeof(double));
    double* psum = calloc((size_t)E + 1, sizeof(double));
    int* taken = calloc((size_t)E + 1, sizeof(int));
    int* count = calloc((size_t)E + 1, sizeof(int));
    double aux = 0;
    ref_route_gap = 1;
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
            if (E > 0) {
                if (i == 0) { for (int e = 0; e < E; e++) { psum[e] = 0; count[e] = 0; } }
                ref_moe(m, l, ln + (size_t)i * C, tmp, p, taken);
                for (int e = 0; e < E; e++) { psum[e] += p[e]; count[e] += taken[e]; }
                for (int j = 0; j < C; j++) { x[(size_t)i * C + j] += tmp[j]; }
                if (i == BT - 1) {   // Switch Transformer: alpha E sum_e f_e P_e
                    double s = 0;
                    for (int e = 0; e < E; e++) { s += (double)count[e] / ((double)c->top_k * BT) * (psum[e] / BT); }
                    aux += (double)c->aux_loss_coef * E * s;
                }
                continue;
            }
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
    free(p); free(psum); free(taken); free(count);
    return loss / BT + aux;
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
    ChunkPlace place = {0, c->num_layers, 1, 1, 0};
    zero_init(z, c, &memory_host, 0, &comm->dp_group, &comm->pp_group, &comm->tp_group, &place, 1, 0, params, M);
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
        zero_begin_microbatch(z, 0, i);
        gpt2_forward(model, a, inp + i * Bm * T, tgt + i * Bm * T, Bm, T, 1);
        losses[i] = position_sum(a->losses, Bm, T);
        gpt2_backward(model, a, g, Bm, T, dloss, BACKWARD_BOTH);
        zero_end_microbatch(z);
    }
    zero_finish_grads(z);
    return canon_tree_sum(losses, M, 1);
}

// The step's gradient in canonical (MEMORY) order, P floats: every unit's pieces put in place
// (the expert units are not in canonical order in the gradient buffer; wte has both halves).
static void full_grads(Zero* z, float* out) {
    for (int u = 0; u < z->lay.num_all; u++) {
        if (!zero_param_unit(&z->lay, u) || !z->lay.params_here[u]) { continue; }
        ZeroScatterCtx ctx = {out, u == ZERO_WTE ? zero_wte_grad_at(z, 0) : zero_grad_at(z, u, 0)};
        for (int k = 0; k < z->lay.npieces[u]; k++) {
            const TPPiece* p = &z->lay.pieces[u][k];
            tp_piece_runs(p, 0, tp_piece_elements(p), zero_scatter_run, &ctx);
        }
    }
}

// 1 and 2 for the model of configuration c: the forward against the double reference, every
// parameter's gradient against central finite differences.
static void check_model(Comm* comm, GPT2Config c, uint64_t seed, const char* name) {
    printf("== %s: L=%d C=%d NH=%d V=%d E=%d k=%d alpha %g\n", name, c.num_layers, c.channels, c.num_heads,
           c.vocab_size, c.num_experts, c.top_k, c.aux_loss_coef);
    float* params = gpt2_random_params(&c, seed);
    random_params(params, &c);
    GPT2 model;
    Zero zero;
    model_on_one_rank(&model, &zero, &c, params, 1, comm);
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
    activations_alloc(&acts, &model, 4, T, 1, 0, 0);
    activation_grads_alloc(&ag, &model, 4, T, 0);

    // 1. forward
    double* probs_ref = malloc(sizeof(double) * BT * c.vocab_size);
    double loss_ref = ref_forward(&ref, inp, tgt, B, T, probs_ref);
    double gap = ref_route_gap;
    zero_begin_microbatch(&zero, 0, 0);
    gpt2_forward(&model, &acts, inp, tgt, B, T, 1);
    float loss = position_sum(acts.losses, B, T) / (float)BT;
    float aux = 0.0f;
    for (int l = 0; c.num_experts > 0 && l < c.num_layers; l++) { aux = aux + acts.moe[l].aux; }
    loss = loss + aux;
    double max_prob_err = 0;
    for (int i = 0; i < BT; i++) {
        for (int v = 0; v < c.vocab_size; v++) {
            double e = fabs(acts.probs[(size_t)i * c.padded_vocab_size + v] - probs_ref[(size_t)i * c.vocab_size + v]);
            if (e > max_prob_err) { max_prob_err = e; }
        }
    }
    gpt2_backward(&model, &acts, &ag, B, T, 1.0f / (float)BT, BACKWARD_BOTH);
    zero_end_microbatch(&zero);
    zero_finish_grads(&zero);
    float* grads = malloc(sizeof(float) * P);
    full_grads(&zero, grads);
    printf("forward: loss float %.9g double %.12g (rel err %.2e), max |prob err| %.2e", loss,
           loss_ref, fabs(loss - loss_ref) / loss_ref, max_prob_err);
    if (c.num_experts > 0) { printf(", aux %.6g, smallest routing gap %.3g", aux, gap); }
    printf("\n");
    // float32 has 24 bits: a loss of ~3 computed through 2 layers is good to a few 1e-7
    CHECK(fabs(loss - loss_ref) <= 2e-6 * loss_ref, "loss %.9g vs double %.12g", loss, loss_ref);
    CHECK(max_prob_err <= 2e-6, "probabilities differ from the double reference by %.3g", max_prob_err);
    // a step of 1e-5 moves a probability by less than 1e-4: no choice flips in the differences
    CHECK(c.num_experts == 0 || gap > 1e-4, "a routing choice is within %.3g of flipping: pick another seed", gap);

    // 2. gradients, every parameter, central differences in double
    double h = 1e-5;
    double worst_rel = 0;
    for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
        if (param_tensor_elements(&c, t) == 0) { continue; }   // the dense model's router
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
        CHECK(max_err <= 1e-5 * max_abs_fd + 1e-9, "%s: gradient of %s: max error %.3g (max |fd| %.3g)", name,
              param_tensor_names[t], max_err, max_abs_fd);
        CHECK(max_abs_fd > 0 || t == P_WPE, "%s: gradient of %s is identically zero: the check proves nothing", name,
              param_tensor_names[t]);
    }
    printf("gradient check: worst tensor relative L2 error %.2e\n", worst_rel);
    activations_free(&model, &acts);
    activation_grads_free(&model, &ag);
    model_free(&model, &zero);
    free(grads);
    free(probs_ref);
    free(pd);
    free(params);
}

// The sampler's KV cache (train_gpt2.c layers_decode): positions decoded one at a time give, at
// every position, the probabilities of the full forward over the same T, bit for bit (the
// decode runs the plain per-row attention, the full forward the fast kernels).
static void check_kv_cache(Comm* comm, GPT2Config c, int T, int recompute, const char* name) {
    float* params = gpt2_random_params(&c, 11);
    random_params(params, &c);
    GPT2 model;
    Zero zero;
    model_on_one_rank(&model, &zero, &c, params, 1, comm);
    Activations full, dec;
    activations_alloc(&full, &model, 1, T, recompute, 0, 0);
    activations_alloc(&dec, &model, 1, T, recompute, 0, 0);
    int* tokens = malloc(sizeof(int) * T);
    for (int t = 0; t < T; t++) { tokens[t] = (int)((urand() + 1.0) * 0.5 * c.vocab_size) % c.vocab_size; }
    gpt2_forward(&model, &full, tokens, NULL, 1, T, 0);
    int Vp = c.padded_vocab_size, bad = -1;
    for (int t = 0; t < T; t++) {
        embed_decode(&model, &dec, tokens[t], t, T);
        layers_decode(&model, &dec, t, T);
        head_decode(&model, &dec, t, T);
        if (bad < 0 && memcmp(dec.probs + (size_t)t * Vp, full.probs + (size_t)t * Vp, sizeof(float) * Vp) != 0) { bad = t; }
    }
    printf("KV cache, %s, T=%d%s: %s\n", name, T, recompute ? " (-r 1)" : "",
           bad < 0 ? "every position's probabilities = the full forward's" : "DIFFERS");
    CHECK(bad < 0, "KV cache (%s, T=%d): position %d's probabilities differ from the full forward", name, T, bad);
    activations_free(&model, &full);
    activations_free(&model, &dec);
    model_free(&model, &zero);
    free(tokens);
    free(params);
}

int main(int argc, char** argv) {
    Comm comm;   // a single rank: the test runs without mpirun
    comm_init(&comm, &argc, &argv);
    GPT2Config c = {.max_seq_len = 8, .vocab_size = 23, .padded_vocab_size = padded_vocab(23),
                    .num_layers = 2, .num_heads = 2, .channels = 16};
    check_model(&comm, c, 7, "dense GPT-2");
    // 4 experts, top 2, and an alpha large enough that the load-balancing loss's gradient
    // is a visible part of the router's
    GPT2Config moe = c;
    moe.num_experts = 4;
    moe.top_k = 2;
    moe.aux_loss_coef = 0.1f;
    check_model(&comm, moe, 7, "mixture of experts");
    GPT2Config wide = {.max_seq_len = 64, .vocab_size = 50, .padded_vocab_size = padded_vocab(50),
                       .num_layers = 3, .num_heads = 4, .channels = 32};
    check_kv_cache(&comm, wide, 37, 0, "dense");
    check_kv_cache(&comm, wide, 64, 1, "dense");
    GPT2Config wide_moe = wide;
    wide_moe.num_experts = 4;
    wide_moe.top_k = 2;
    check_kv_cache(&comm, wide_moe, 21, 0, "4 experts top 2");
    int T = 5;
    float* params = gpt2_random_params(&c, 7);
    random_params(params, &c);
    size_t P = param_count(&c);
    GPT2 model;
    Zero zero;
    model_on_one_rank(&model, &zero, &c, params, 1, &comm);
    Activations acts;
    ActivationGrads ag;
    activations_alloc(&acts, &model, 4, T, 1, 0, 0);
    activation_grads_alloc(&ag, &model, 4, T, 0);

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
    free(params);
    comm_finalize(&comm);

    if (failures) { printf("%d check(s) FAILED\n", failures); return 1; }
    printf("all checks passed\n");
    return 0;
}
