/*
 * test_varlen.c: an independent reference for --varlen (dev/test/test_varlen.sh runs it).
 *
 *   test_varlen data OUT N SEED      an llm.c token file of N tokens: documents of 1..40
 *                                    tokens (ids < 64) each ended by an EOT (50256), the last
 *                                    one unterminated
 *   test_varlen model OUT            a fresh GPT-2 (L=2, C=32, NH=2, V=50257, maxT=32), llm.c
 *                                    checkpoint
 *   test_varlen check TOKENS T       the data loader's sequences against the rule,
 *                                    written here from its text (cutting, file order, the
 *                                    shuffle's permutations per epoch); exits non-zero on a
 *                                    difference
 *   test_varlen reference MODEL TOKENS T G
 *                                    the first G sequences of the rule, each run ALONE as its
 *                                    own one-sequence (B = 1, T = its length) forward and
 *                                    backward, their loss sums and gradients added in double
 *                                    and weighted by the G sequences' targets: prints
 *                                    "loss L norm N", what the trainer's first step with
 *                                    --varlen G must log (within float rounding)
 */
#define TESTING
#include "train_gpt2.c"

// The rule, from position p: q = min(p + T, the next EOT strictly after p, ntok - 1).
static int64_t cut_sequences(const uint16_t* tok, int64_t ntok, int T, int64_t* start, int* len) {
    int64_t n = 0;
    int64_t p = 0;
    while (p < ntok - 1) {
        int64_t q = p + 1;
        while (q < ntok - 1 && q < p + T && tok[q] != TOKEN_EOT) { q++; }
        start[n] = p;
        len[n] = (int)(q - p);
        n++;
        p = q;
    }
    return n;
}

static uint16_t* read_tokens(const char* path, int64_t* ntok) {
    *ntok = dataloader_check_shard_(path, "test");
    uint16_t* tok = malloc_or_die(sizeof(uint16_t) * (size_t)*ntok, "tokens");
    FILE* f = fopen_or_die(path, "rb", "token file");
    fseek_or_die(f, 1024, SEEK_SET, path);
    fread_or_die(tok, sizeof(uint16_t), (size_t)*ntok, f, path);
    fclose(f);
    return tok;
}

static GPT2Config test_config(void) {
    GPT2Config c = {.max_seq_len = 32, .vocab_size = 50257, .padded_vocab_size = padded_vocab(50257),
                    .num_layers = 2, .num_heads = 2, .channels = 32};
    return c;
}

static int check_loader(const char* path, int T) {
    int64_t ntok;
    uint16_t* tok = read_tokens(path, &ntok);
    int64_t* start = malloc_or_die(sizeof(int64_t) * (size_t)ntok, "starts");
    int* len = malloc_or_die(sizeof(int) * (size_t)ntok, "lengths");
    int64_t n = cut_sequences(tok, ntok, T, start, len);
    int failures = 0;
    DataLoader d;
    dataloader_init_varlen(&d, path, "-i", T, 50257, 0, 0);
    if (d.num_seqs != n) { printf("FAIL: the loader cut %lld sequences, the rule %lld\n", (long long)d.num_seqs, (long long)n); return 1; }
    int cut_t = 0, cut_eot = 0;
    for (int64_t g = 0; g < 2 * n; g++) {   // two epochs: after the last sequence the first again
        int64_t k = g % n;
        dataloader_load(&d, g);
        int ok = d.loaded_T == len[k] && dataloader_length(&d, g) == len[k];
        for (int i = 0; ok && i < len[k]; i++) {
            ok = d.inputs[i] == tok[start[k] + i] && d.targets[i] == tok[start[k] + i + 1];
        }
        if (!ok) { failures++; printf("FAIL: sequence %lld differs from the rule (start %lld length %d)\n", (long long)g, (long long)start[k], len[k]); }
        if (g < n) { cut_t += len[k] == T; cut_eot += tok[start[k] + len[k]] == TOKEN_EOT; }
    }
    if (cut_t == 0 || cut_eot == 0) { failures++; printf("FAIL: the data should have sequences cut at T and at EOT\n"); }
    dataloader_free(&d);
    // --shuffle 1: each epoch a permutation of all sequences, drawn from (seed, epoch)
    DataLoader s1, s2;
    dataloader_init_varlen(&s1, path, "-i", T, 50257, 1, 7);
    dataloader_init_varlen(&s2, path, "-i", T, 50257, 1, 7);
    int* seen = calloc_or_die((size_t)n, sizeof(int), "seen");
    int moved = 0, epochs_differ = 0;
    for (int64_t k = 0; k < n; k++) {
        dataloader_load(&s1, k);
        int64_t q = -1;   // which sequence of the rule it is (starts are unique per length)
        for (int64_t j = 0; j < n && q < 0; j++) {
            if (len[j] == s1.loaded_T && tok[start[j]] == s1.inputs[0] && memcmp(&tok[start[j]], s1.buffer, 2 * (size_t)(len[j] + 1)) == 0 && !seen[j]) { q = j; }
        }
        if (q < 0) { failures++; printf("FAIL: shuffled sequence %lld is no unseen sequence of the rule\n", (long long)k); break; }
        seen[q] = 1;
        moved += q != k;
        epochs_differ += dataloader_sequence_(&s1, k) != dataloader_sequence_(&s1, n + k);
        if (dataloader_sequence_(&s1, k) != dataloader_sequence_(&s2, k)) { failures++; printf("FAIL: the same seed gave another order\n"); break; }
    }
    if (!moved || !epochs_differ) { failures++; printf("FAIL: --shuffle 1 kept the file order, or the same order in two epochs\n"); }
    dataloader_free(&s1);
    dataloader_free(&s2);
    printf("%s: %lld sequences (%d cut at T, %d at EOT) as the rule cuts them, two epochs; shuffled: "
           "a permutation per epoch\n", failures ? "FAIL" : "ok", (long long)n, cut_t, cut_eot);
    free(seen);
    free(start);
    free(len);
    free(tok);
    return failures != 0;
}

static void reference(const char* model_path, const char* path, int T, int G) {
    int64_t ntok;
    uint16_t* tok = read_tokens(path, &ntok);
    int64_t* start = malloc_or_die(sizeof(int64_t) * (size_t)ntok, "starts");
    int* len = malloc_or_die(sizeof(int) * (size_t)ntok, "lengths");
    int64_t n = cut_sequences(tok, ntok, T, start, len);
    if (n < G) { fatal("reference: the data has %lld sequences, fewer than G = %d", (long long)n, G); }
    GPT2Config c;
    float* params = gpt2_starting_params(model_path, NULL, -1, 0, 0, &c);
    Comm comm;   // one rank, without mpirun
    int argc = 0;
    char** argv = NULL;
    comm_init(&comm, &argc, &argv);
    size_t P = param_count(&c);
    double* grad = calloc_or_die(P, sizeof(double), "gradient");
    double loss = 0.0, targets = 0.0;
    for (int k = 0; k < G; k++) { targets += len[k]; }
    int inp[64], tgt[64];
    for (int k = 0; k < G; k++) {   // sequence k alone: a one-sequence step of its own
        ChunkPlace place = {0, c.num_layers, 1, 1, 0};
        Zero z;
        GPT2 model;
        zero_init(&z, &c, &memory_host, 0, &comm.dp_group, &comm.pp_group, &comm.tp_group, &place, 1, 0, params, 1);
        gpt2_init(&model, &c, &place, &z, &comm.tp_group, &comm.cp_group, 0, 0, 0, 0);
        Activations acts;
        ActivationGrads ag;
        activations_alloc(&acts, &model, 1, len[k], 1, 0, 0);
        activation_grads_alloc(&ag, &model, 1, len[k], 0);
        for (int i = 0; i < len[k]; i++) { inp[i] = tok[start[k] + i]; tgt[i] = tok[start[k] + i + 1]; }
        zero_begin_microbatch(&z, 0, 0);
        gpt2_forward(&model, &acts, inp, tgt, 1, len[k], 1);
        loss += position_sum(acts.losses, 1, len[k]);
        gpt2_backward(&model, &acts, &ag, 1, len[k], 1.0f / (float)len[k], BACKWARD_BOTH);
        zero_end_microbatch(&z);
        zero_finish_grads(&z);
        // the first P floats: every parameter's gradient (wte's two halves summed), in unit order
        for (size_t i = 0; i < P; i++) { grad[i] += (double)z.grads[i] * len[k] / targets; }
        activations_free(&model, &acts);
        activation_grads_free(&model, &ag);
        gpt2_free(&model);
        zero_free(&z);
    }
    double sumsq = 0.0;
    for (size_t i = 0; i < P; i++) { sumsq += grad[i] * grad[i]; }
    printf("loss %.9g norm %.9g\n", loss / targets, sqrt(sumsq));
    free(grad);
    free(params);
    free(start);
    free(len);
    free(tok);
}

int main(int argc, char** argv) {
    if (argc == 5 && strcmp(argv[1], "data") == 0) {
        int64_t n = atoll(argv[3]);
        uint64_t s = (uint64_t)atoll(argv[4]) + 1;
        uint16_t* tok = malloc_or_die(sizeof(uint16_t) * (size_t)n, "tokens");
        int left = 0;
        for (int64_t i = 0; i < n; i++) {
            if (left == 0 && i > 0) { tok[i] = TOKEN_EOT; left = 1 + (int)(random_u32(&s) % 40); continue; }
            if (left == 0) { left = 1 + (int)(random_u32(&s) % 40); }
            tok[i] = (uint16_t)(random_u32(&s) % 64);
            left--;
        }
        int header[256] = {TOKENS_MAGIC, 1, (int)n};
        FILE* f = fopen_or_die(argv[2], "wb", "token file");
        fwrite(header, sizeof(int), 256, f);
        fwrite(tok, sizeof(uint16_t), (size_t)n, f);
        fclose(f);
        free(tok);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "model") == 0) {
        GPT2Config c = test_config();
        float* params = gpt2_random_params(&c, 11);
        checkpoint_write_model(argv[2], &c, params);
        free(params);
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "check") == 0) { return check_loader(argv[2], atoi(argv[3])); }
    if (argc == 6 && strcmp(argv[1], "reference") == 0) {
        reference(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]));
        return 0;
    }
    fprintf(stderr, "usage: test_varlen data OUT N SEED | model OUT | check TOKENS T | reference MODEL TOKENS T G\n");
    return 2;
}
