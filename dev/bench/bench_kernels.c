/*
 * bench_kernels.c: GFLOP/s of the CPU matmul kernels on GPT-2 124M shapes (B=4, T=64), the
 * median of several runs each, against the machine's FMA peak (pass it as argv[1] in
 * GFLOP/s; default 113, measured on the 2-core development machine), and all the matmuls of
 * one training step together (12 layers of each shape, the LM head once); then the attention
 * kernels (forward: q.k and att@v; backward: datt, dq, dk, dv) on the d4 model's heads
 * (B=4, C=256, NH=4) at T = 64, 256 and 1024, counting the causal products' multiply-adds
 * (T(T+1)/2 query-key pairs per head, 2 flops each per channel).
 */
#define TESTING
#include "train_gpt2.c"

static double median(double* v, int n) {
    for (int i = 0; i < n; i++) for (int j = i + 1; j < n; j++) if (v[j] < v[i]) { double t = v[i]; v[i] = v[j]; v[j] = t; }
    return v[n / 2];
}

int main(int argc, char** argv) {
    double peak = argc > 1 ? atof(argv[1]) : 113.0;
    int B = 4, T = 64, BT = B * T, C = 768;
    struct { const char* name; int K, OC, per_step; } shapes[] = {
        {"qkv", C, 3 * C, 12}, {"attproj", C, C, 12}, {"fc", C, 4 * C, 12}, {"fcproj", 4 * C, C, 12},
        {"lm head", C, 50304, 1},
    };
    double step_ms = 0.0, step_flops = 0.0;
    uint64_t s = 1;
    printf("%-8s %-8s %6s %6s %9s %9s %7s\n", "shape", "pass", "K", "OC", "ms", "GFLOP/s", "%peak");
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        int K = shapes[i].K, OC = shapes[i].OC;
        float* inp = malloc(sizeof(float) * BT * K), *w = malloc(sizeof(float) * OC * K);
        float* out = malloc(sizeof(float) * BT * OC), *dinp = malloc(sizeof(float) * BT * K);
        float* dw = malloc(sizeof(float) * OC * K), *bias = calloc(OC, sizeof(float)), *db = malloc(sizeof(float) * OC);
        for (long j = 0; j < (long)BT * K; j++) { inp[j] = random_f32(&s) - 0.5f; }
        for (long j = 0; j < (long)OC * K; j++) { w[j] = random_f32(&s) - 0.5f; }
        for (long j = 0; j < (long)BT * OC; j++) { out[j] = random_f32(&s) - 0.5f; }
        double flops = 2.0 * BT * K * OC;
        double tf[5], tdi[5], tdw[5];
        for (int r = 0; r < 5; r++) {
            double t0 = now_seconds();
            matmul_forward(out, inp, w, bias, BT, K, OC, CANON_R);
            double t1 = now_seconds();
            matmul_backward(dinp, NULL, NULL, out, inp, w, B, T, K, OC, 1, CANON_R);
            double t2 = now_seconds();
            matmul_backward(NULL, dw, db, out, inp, w, B, T, K, OC, 1, CANON_R);
            double t3 = now_seconds();
            tf[r] = t1 - t0; tdi[r] = t2 - t1; tdw[r] = t3 - t2;
        }
        double m;
        m = median(tf, 5);  printf("%-8s %-8s %6d %6d %9.2f %9.1f %6.0f%%\n", shapes[i].name, "forward", K, OC, m * 1e3, flops / m / 1e9, 100 * flops / m / 1e9 / peak);
        m = median(tdi, 5); printf("%-8s %-8s %6d %6d %9.2f %9.1f %6.0f%%\n", shapes[i].name, "dinp", K, OC, m * 1e3, flops / m / 1e9, 100 * flops / m / 1e9 / peak);
        m = median(tdw, 5); printf("%-8s %-8s %6d %6d %9.2f %9.1f %6.0f%%\n", shapes[i].name, "dweight", K, OC, m * 1e3, flops / m / 1e9, 100 * flops / m / 1e9 / peak);
        step_ms += shapes[i].per_step * (median(tf, 5) + median(tdi, 5) + median(tdw, 5)) * 1e3;
        step_flops += shapes[i].per_step * 3 * flops;
        free(inp); free(w); free(out); free(dinp); free(dw); free(bias); free(db);
    }
    printf("%-17s %13s %9.2f %9.1f %6.0f%%\n", "one 124M step", "(all matmuls)", step_ms,
           step_flops / step_ms / 1e6, 100 * step_flops / step_ms / 1e6 / peak);
    printf("\n%-8s %-8s %6s %6s %9s %9s %7s\n", "attention", "pass", "T", "C", "ms", "GFLOP/s", "%peak");
    int Ts[] = {64, 256, 1024};
    for (int i = 0; i < 3; i++) {
        int Ba = 4, Ca = 256, NHa = 4, Ta = Ts[i];
        size_t nq = (size_t)Ba * Ta * 3 * Ca, no = (size_t)Ba * Ta * Ca, na = (size_t)Ba * NHa * Ta * Ta;
        float *qkv = malloc(sizeof(float) * nq), *dqkv = malloc(sizeof(float) * nq), *att = malloc(sizeof(float) * na);
        float *out = malloc(sizeof(float) * no), *dout = malloc(sizeof(float) * no);
        for (size_t j = 0; j < nq; j++) { qkv[j] = random_f32(&s) - 0.5f; }
        for (size_t j = 0; j < no; j++) { dout[j] = random_f32(&s) - 0.5f; }
        double flops = 2.0 * 2.0 * Ba * ((double)Ta * (Ta + 1) / 2) * Ca;   // two products of the forward
        double tf[5], tb[5];
        for (int r = 0; r < 5; r++) {
            double t0 = now_seconds();
            attention_forward(out, att, qkv, Ba, Ta, Ca, NHa);
            double t1 = now_seconds();
            attention_backward(dqkv, dout, qkv, att, Ba, Ta, Ca, NHa);
            tf[r] = t1 - t0;
            tb[r] = now_seconds() - t1;
        }
        double m = median(tf, 5);
        printf("%-9s %-7s %6d %6d %9.2f %9.1f %6.0f%%\n", "attention", "forward", Ta, Ca, m * 1e3, flops / m / 1e9, 100 * flops / m / 1e9 / peak);
        m = median(tb, 5);
        printf("%-9s %-7s %6d %6d %9.2f %9.1f %6.0f%%\n", "attention", "backward", Ta, Ca, m * 1e3, 2 * flops / m / 1e9, 100 * 2 * flops / m / 1e9 / peak);
        free(qkv); free(dqkv); free(att); free(out); free(dout);
    }
    return 0;
}
