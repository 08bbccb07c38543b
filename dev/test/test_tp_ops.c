/*
 * test_tp_ops.c: the tensor-parallel pieces on a real communicator (run under mpirun with K
 * ranks, all of them one tensor-parallel group) against the unsplit computation on one rank:
 *  - row-parallel matmul: each rank reduces its slice of the inputs with 8/K chunks, the g
 *    operator (all-reduce) finishes the tree: the bits of the unsplit matmul;
 *  - column-parallel input gradient (qkv, grouped q|k|v): each rank its heads' outputs, the
 *    f operator's backward all-reduce: the bits of the unsplit;
 *  - the vocab-parallel embedding lookup (with -0.0f and +0.0f table entries, which a +0
 *    filler would get wrong) and cross-entropy (max, Z, target logit over the group).
 * Every rank regenerates the full tensors from one seed and checks its own results.
 */
#define TESTING
#include "train_gpt2.c"

static int failures = 0;
static uint64_t seed = 4242;
static float* randn(size_t n) {
    float* p = (float*)malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        uint32_t r = random_u32(&seed);
        float scale = (r >> 30) == 0 ? 30.0f : (r >> 30) == 1 ? 1e-3f : 1.0f;
        p[i] = ((float)(r % 20001) - 10000.0f) / 10000.0f * scale;
    }
    return p;
}
static void same(const char* what, const float* got, const float* want, size_t n, int rank) {
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], 4) != 0) {
            printf("FAIL [rank %d] %s: element %zu is %.9g, unsplit %.9g\n", rank, what, i, got[i], want[i]);
            failures++;
            return;
        }
    }
}

int main(int argc, char** argv) {
    Comm comm;
    comm_init(&comm, &argc, &argv);
    comm_setup_grid(&comm, comm.world_size, 1);
    CommGroup* tp = &comm.tp_group;
    int K = tp->size, r = tp->rank;
    int BT = 37, Kd = 64, OC = 24;
    // row-parallel: y = x W^T over k, k split in K slices
    float* x = randn((size_t)BT * Kd), *w = randn((size_t)OC * Kd);
    float* full = malloc(sizeof(float) * BT * OC), *part = malloc(sizeof(float) * BT * OC);
    matmul_forward(full, x, w, NULL, BT, Kd, OC, CANON_R);
    int ks = Kd / K;
    float* xs = malloc(sizeof(float) * BT * ks), *ws = malloc(sizeof(float) * OC * ks);
    for (int i = 0; i < BT; i++) { memcpy(xs + i * ks, x + i * Kd + r * ks, sizeof(float) * ks); }
    for (int o = 0; o < OC; o++) { memcpy(ws + o * ks, w + o * Kd + r * ks, sizeof(float) * ks); }
    matmul_forward(part, xs, ws, NULL, BT, ks, OC, CANON_R / K);
    tp_g_forward(tp, part, (size_t)BT * OC);
    same("row-parallel matmul + g", part, full, (size_t)BT * OC, r);
    // column-parallel qkv: dinp = dout W over 3C outputs, each rank q|k|v slices of its heads
    int C = 32, OC3 = 3 * C, cs = C / K;
    float* w3 = randn((size_t)OC3 * C), *dout = randn((size_t)BT * OC3), *inp = randn((size_t)BT * C);
    float* dfull = malloc(sizeof(float) * BT * C), *dpart = malloc(sizeof(float) * BT * C);
    float* dw = malloc(sizeof(float) * OC3 * C);
    matmul_backward(dfull, dw, NULL, dout, inp, w3, 1, BT, C, OC3, 3, CANON_R);
    float* wsl = malloc(sizeof(float) * 3 * cs * C), *dsl = malloc(sizeof(float) * BT * 3 * cs);
    for (int g = 0; g < 3; g++) {
        memcpy(wsl + (size_t)g * cs * C, w3 + ((size_t)g * C + r * cs) * C, sizeof(float) * cs * C);
        for (int i = 0; i < BT; i++) { memcpy(dsl + (size_t)i * 3 * cs + g * cs, dout + (size_t)i * OC3 + g * C + r * cs, sizeof(float) * cs); }
    }
    matmul_backward(dpart, dw, NULL, dsl, inp, wsl, 1, BT, C, 3 * cs, 3, CANON_R / K);
    tp_f_backward(tp, dpart, (size_t)BT * C);
    same("column-parallel qkv input gradient + f backward", dpart, dfull, (size_t)BT * C, r);
    // vocab-parallel embedding
    int Vp = 64, V = 60, Vl = Vp / K;
    float* wte = randn((size_t)Vp * C);
    wte[3 * C + 1] = -0.0f;
    wte[5 * C + 2] = 0.0f;
    int tok[37];
    for (int i = 0; i < BT; i++) { tok[i] = (int)(random_u32(&seed) % V); }
    tok[0] = 3; tok[1] = 5;
    float* efull = malloc(sizeof(float) * BT * C), *epart = malloc(sizeof(float) * BT * C);
    encoder_lookup(efull, tok, wte, 0, Vp, BT, C);
    encoder_lookup(epart, tok, wte + (size_t)r * Vl * C, r * Vl, Vl, BT, C);
    if (K > 1) { comm_all_reduce_sum(tp, epart, (size_t)BT * C, COMM_KIND_TP); }
    same("vocab-parallel embedding lookup", epart, efull, (size_t)BT * C, r);
    // vocab-parallel cross-entropy
    float* logits = randn((size_t)BT * Vp);
    float* lsl = malloc(sizeof(float) * BT * Vl);
    for (int i = 0; i < BT; i++) { memcpy(lsl + (size_t)i * Vl, logits + (size_t)i * Vp + r * Vl, sizeof(float) * Vl); }
    float ce[3 * 37], cep[3 * 37], loss[37], lossp[37];
    crossentropy_max(ce, logits, BT, V, 0, Vp);
    crossentropy_exps(ce + BT, ce + 2 * BT, logits, ce, tok, BT, V, 0, Vp, CANON_R);
    crossentropy_normalize(logits, loss, ce + BT, ce + 2 * BT, ce, tok, BT, V, 0, Vp);
    crossentropy_max(cep, lsl, BT, V, r * Vl, Vl);
    if (K > 1) { comm_all_reduce_max(tp, cep, (size_t)BT, COMM_KIND_TP); }
    crossentropy_exps(cep + BT, cep + 2 * BT, lsl, cep, tok, BT, V, r * Vl, Vl, CANON_R / K);
    if (K > 1) { comm_all_reduce_sum(tp, cep + BT, 2 * (size_t)BT, COMM_KIND_TP); }
    crossentropy_normalize(lsl, lossp, cep + BT, cep + 2 * BT, cep, tok, BT, V, r * Vl, Vl);
    same("vocab-parallel cross-entropy losses", lossp, loss, BT, r);
    for (int i = 0; i < BT; i++) {
        same("vocab-parallel cross-entropy probabilities", lsl + (size_t)i * Vl, logits + (size_t)i * Vp + r * Vl, Vl, r);
    }
    int total = failures;
    SumSq dummy;   // sum the failure counts over the group (an exact integer sum)
    canon_sumsq_init(&dummy);
    for (int i = 0; i < failures; i++) { canon_sumsq_add(&dummy, 1.0f); }
    comm_all_reduce_sumsq(tp, &dummy, COMM_KIND_OTHER);
    total = (int)canon_sumsq_value(&dummy);
    if (r == 0) { printf("tensor-parallel operators on %d ranks: %s\n", K, total ? "FAILED" : "identical to unsplit"); }
    float* buffers[] = {x, w, full, part, xs, ws, w3, dout, inp, dfull, dpart, dw, wsl, dsl, wte, efull, epart, logits, lsl};
    for (size_t i = 0; i < sizeof(buffers) / sizeof(buffers[0]); i++) { free(buffers[i]); }
    comm_finalize(&comm);
    return total ? 1 : 0;
}
