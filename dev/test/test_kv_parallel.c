/*
 * test_kv_parallel.c: KV parallelism (llmc/kv_parallel.h) on a real communicator against the
 * one-rank paged attention the server runs (attention_forward_paged, llmc/cpu_fast.h).
 *
 *   mpirun -np W build/test_kv_parallel [--tp tp]     KVP P = W/tp (the cp groups) x TP tp
 *
 * Every rank regenerates the same requests (random q, k, v; several context lengths T and block
 * sizes; rows at positions that are short, inside a block, on block and chunk edges, at the
 * middle and at the end of the context), runs the one-rank paged attention over the whole cache
 * (all heads), and checks, bit for bit, what KVP computes for its heads from its share of the
 * cache, for both combines (all-reduce, and the reduce-scatter by heads). It also checks the
 * bytes each step sent against comm.h's formulas, and that a full-context request's blocks on a
 * rank are 1/P of one rank's. The reduce-scatter's heads then go through the row-parallel
 * output projection on the same P x tp ranks, against the one-rank projection. Prints the bytes per generated token of each collective.
 *
 *   build/test_kv_parallel --check --kvp P --tp tp --context T --block-size bs --heads NH
 * (no MPI) prints kvp_problem's refusal line and exits 1, or exits 0 when the layout is fine.
 */
#define TESTING
#include "train_gpt2.c"
#include "llmc/kv_parallel.h"

static int failures = 0;

// Values mostly in [-1, 1], a quarter of them 30x larger (scores far apart: the max matters,
// many exps underflow) and a quarter 1000x smaller.
static float* random_values(size_t n, uint64_t* seed) {
    float* p = (float*)malloc_or_die(sizeof(float) * (n ? n : 1), "test values");
    for (size_t i = 0; i < n; i++) {
        uint32_t r = random_u32(seed);
        float scale = (r >> 30) == 0 ? 30.0f : (r >> 30) == 1 ? 1e-3f : 1.0f;
        p[i] = ((float)(r % 20001) - 10000.0f) / 10000.0f * scale;
    }
    return p;
}

static void expect_same_bits(const char* what, const float* got, long got_stride, const float* want,
                             long want_stride, int rows, int cols, int rank) {
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++) {
            float g = got[(size_t)r * got_stride + c], w = want[(size_t)r * want_stride + c];
            if (memcmp(&g, &w, 4) != 0) {
                printf("FAIL [rank %d] %s: row %d channel %d is %.9g, one rank's %.9g\n", rank, what, r, c, g, w);
                failures++;
                return;
            }
        }
    }
}

// The bytes comm.h's formulas give for one step (written out here, from the header comment).
static uint64_t expected_bytes(int P, int N, int NHl, int Cl, KVPCombine combine) {
    uint64_t stat = 2ull * (P - 1) * ((uint64_t)(N * NHl + P - 1) / P) * 4;
    uint64_t out = combine == KVP_COMBINE_ALL_REDUCE ? 2ull * (P - 1) * ((uint64_t)(N * Cl + P - 1) / P) * 4
                                                     : (uint64_t)(P - 1) * N * (Cl / P) * 4;
    return 2 * stat + out;
}

// One context length T and block size bs, with N rows at the positions pos.
static void check_case(Comm* comm, int tp, int T, int bs, int C, int NH, const int* pos, int N, uint64_t seed,
                       int print_bytes) {
    CommGroup* g = &comm->cp_group;
    int P = g->size, kvp_rank = g->rank, tp_rank = comm->tp_rank, rank = comm->world_rank;
    int NHl = NH / tp, Cl = C / tp, C3 = 3 * C;
    // the requests: row r's q (in a qkv row, as the server's), its keys and values (T, 2C)
    float* qkv = random_values((size_t)N * C3, &seed);
    float** kvs = (float**)malloc_or_die(sizeof(float*) * N, "test requests");
    for (int r = 0; r < N; r++) { kvs[r] = random_values((size_t)(pos[r] + 1) * 2 * C, &seed); }

    // one rank: the whole cache, every head (the server's paged attention)
    int max_blocks = T / bs;
    PagedKV one;
    paged_kv_init(&one, &memory_host, N * max_blocks, bs, 1, C);
    BlockTable* one_bt = (BlockTable*)calloc(N, sizeof(BlockTable));
    int* one_tables = (int*)calloc((size_t)N * max_blocks, sizeof(int));
    for (int r = 0; r < N; r++) {
        if (!block_table_reserve(&one, &one_bt[r], pos[r] + 1)) { fatal("test: one-rank cache too small"); }
        for (int p = 0; p <= pos[r]; p++) {
            float* row = one.data + one_bt[r].blocks[p / bs] * paged_kv_block_stride(&one) + (long)(p % bs) * 2 * C;
            memcpy(row, kvs[r] + (size_t)p * 2 * C, sizeof(float) * 2 * C);
        }
        memcpy(one_tables + (size_t)r * max_blocks, one_bt[r].blocks, sizeof(int) * one_bt[r].n);
    }
    float* want = (float*)malloc_or_die(sizeof(float) * (size_t)N * C, "test output");
    float* scratch = (float*)malloc_or_die(sizeof(float) * ((size_t)N * NH * T + (size_t)T * C3), "test scratch");
    attention_forward_paged(want, scratch, qkv, one.data, paged_kv_block_stride(&one), one_tables, max_blocks, pos,
                            N, T, bs, C, NH);

    for (int mode = 0; mode < 2; mode++) {
        KVPCombine combine = mode == 0 ? KVP_COMBINE_ALL_REDUCE : KVP_COMBINE_REDUCE_SCATTER;
        char line[256];
        if (kvp_problem(line, sizeof(line), P, tp, T, bs, NH, combine)) { continue; }
        KVPLayout lay;
        kvp_init(&lay, P, kvp_rank, tp, T, bs, C, NH, combine);
        // this rank's share: its positions of every request, its heads' channels
        PagedKV kv;
        paged_kv_init(&kv, &memory_host, N * max_blocks / P, bs, 1, Cl);
        BlockTable* bt = (BlockTable*)calloc(N, sizeof(BlockTable));
        int* tables = (int*)calloc((size_t)N * max_blocks, sizeof(int));
        for (int r = 0; r < N; r++) {
            if (!kvp_reserve(&kv, &bt[r], &lay, pos[r] + 1)) { fatal("test: KVP cache too small"); }
            int stored = 0;
            for (int p = 0; p <= pos[r]; p++) {
                const float* k = kvs[r] + (size_t)p * 2 * C + tp_rank * Cl;
                stored += kvp_store(&kv, &bt[r], &lay, 0, p, k, k + C);
            }
            if (stored != canon_zz_count_le(pos[r], T, P, kvp_rank)) {
                printf("FAIL [rank %d] T %d: stored %d positions of row %d\n", rank, T, stored, r);
                failures++;
            }
            if (pos[r] == T - 1 && bt[r].n != max_blocks / P) {
                printf("FAIL [rank %d] T %d: a full context takes %d blocks, expected %d (1/%d)\n", rank, T,
                       bt[r].n, max_blocks / P, P);
                failures++;
            }
            memcpy(tables + (size_t)r * max_blocks, bt[r].blocks, sizeof(int) * bt[r].n);
        }
        int out_cols = combine == KVP_COMBINE_ALL_REDUCE ? Cl : Cl / P;
        float* out = (float*)malloc_or_die(sizeof(float) * (size_t)N * out_cols, "test KVP output");
        comm_reset_stats(comm);
        kvp_attention_decode(&lay, g, out, qkv + tp_rank * Cl, C3, kv.data, paged_kv_block_stride(&kv), tables,
                             max_blocks, pos, N);
        char what[128];
        snprintf(what, sizeof(what), "T %d bs %d N %d kvp %d x tp %d, %s", T, bs, N, P, tp,
                 mode == 0 ? "all-reduce" : "reduce-scatter");
        int first = tp_rank * Cl + (combine == KVP_COMBINE_ALL_REDUCE ? 0 : kvp_rank * out_cols);
        expect_same_bits(what, out, out_cols, want + first, C, N, out_cols, rank);
        if (combine == KVP_COMBINE_REDUCE_SCATTER && CANON_R % (P * tp) == 0) {
            // the same ranks then run the attention output projection row-parallel on their heads'
            // channels: channel slice tp_rank * P + kvp_rank of P*tp, 8/(P*tp) chunks of the
            // inputs each. The slices of one TP rank are a subtree of the R1 tree, so the g
            // all-reduce runs over the KVP group (in kvp rank order), then over the TP group (in
            // tp rank order): the one-rank projection of the one-rank attention, bit for bit
            float* w = random_values((size_t)C * C, &seed);
            float* w_slice = (float*)malloc_or_die(sizeof(float) * (size_t)C * out_cols, "test projection slice");
            for (int o = 0; o < C; o++) { memcpy(w_slice + (size_t)o * out_cols, w + (size_t)o * C + first, sizeof(float) * out_cols); }
            float* proj = (float*)malloc_or_die(sizeof(float) * (size_t)N * C, "test projection");
            float* proj_one = (float*)malloc_or_die(sizeof(float) * (size_t)N * C, "test projection");
            matmul_forward(proj_one, want, w, NULL, N, C, C, CANON_R);
            matmul_forward(proj, out, w_slice, NULL, N, out_cols, C, CANON_R / (P * tp));
            tp_g_forward(g, proj, (size_t)N * C);                  // the KVP group: each TP rank's subtree
            tp_g_forward(&comm->tp_group, proj, (size_t)N * C);    // the TP group: the root (bytes count as tp)
            char pwhat[256];
            snprintf(pwhat, sizeof(pwhat), "%s, then the row-parallel output projection", what);
            expect_same_bits(pwhat, proj, C, proj_one, C, N, C, rank);
            free(w);
            free(w_slice);
            free(proj);
            free(proj_one);
        }
        uint64_t sent = comm->stats.bytes[COMM_KIND_CP], expected = expected_bytes(P, N, NHl, Cl, combine);
        if (sent != expected || sent != kvp_step_bytes(&lay, N)) {
            printf("FAIL [rank %d] %s: sent %llu bytes, the formulas give %llu\n", rank, what,
                   (unsigned long long)sent, (unsigned long long)expected);
            failures++;
        }
        if (rank == 0 && print_bytes) {
            uint64_t stat = 2ull * (P - 1) * ((uint64_t)(NHl + P - 1) / P) * 4;
            printf("bytes sent per generated token per rank per layer (kvp %d x tp %d, %d heads of %d per rank, %s): "
                   "max %llu, Z %llu, output %llu, total %llu\n", P, tp, NHl, C / NH,
                   mode == 0 ? "all-reduce" : "reduce-scatter", (unsigned long long)stat, (unsigned long long)stat,
                   (unsigned long long)(sent - 2 * stat), (unsigned long long)sent);
        }
        free(out);
        for (int r = 0; r < N; r++) { block_table_free(&bt[r]); }
        free(bt);
        free(tables);
        paged_kv_free(&kv);
        kvp_free(&lay);
    }
    for (int r = 0; r < N; r++) { block_table_free(&one_bt[r]); free(kvs[r]); }
    free(one_bt);
    free(one_tables);
    free(kvs);
    paged_kv_free(&one);
    free(want);
    free(scratch);
    free(qkv);
}

static int arg_int(int argc, char** argv, const char* flag, int fallback) {
    for (int i = 1; i + 1 < argc; i++) {
        if (strcmp(argv[i], flag) == 0) { return atoi(argv[i + 1]); }
    }
    return fallback;
}

int main(int argc, char** argv) {
    int tp = arg_int(argc, argv, "--tp", 1);
    if (argc > 1 && strcmp(argv[1], "--check") == 0) {
        char line[256];
        const char* problem = kvp_problem(line, sizeof(line), arg_int(argc, argv, "--kvp", 1), tp,
                                          arg_int(argc, argv, "--context", 1024), arg_int(argc, argv, "--block-size", 16),
                                          arg_int(argc, argv, "--heads", 12), KVP_COMBINE_ALL_REDUCE);
        if (problem) { fatal("%s", problem); }
        return 0;
    }
    Comm comm;
    comm_init(&comm, &argc, &argv);
    comm_setup_grid_cp(&comm, tp, comm.world_size / tp, 1);
    const int C = 128, NH = 8;
    const int cases[][2] = { {256, 16}, {512, 8}, {128, 8}, {1024, 64} };   // T, block size
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int T = cases[i][0], bs = cases[i][1];
        char line[256];
        if (kvp_problem(line, sizeof(line), comm.cp, tp, T, bs, NH, KVP_COMBINE_ALL_REDUCE)) { continue; }
        int pos[] = { 0, 1, 2, bs - 1, bs, bs + 1, 3 * bs + 5, T / 16 - 1, T / 16, T / 4 + 3, T / 2 - 1, T / 2,
                      T / 2 + 7, 3 * T / 4, T - 2, T - 1 };
        int N = (int)(sizeof(pos) / sizeof(pos[0]));
        check_case(&comm, tp, T, bs, C, NH, pos, N, 1000 + i, 0);
        int one[] = { T - 1 };
        check_case(&comm, tp, T, bs, C, NH, one, 1, 2000 + i, i == 0);
        int prompt[] = { 37 };
        check_case(&comm, tp, T, bs, C, NH, prompt, 1, 3000 + i, 0);
    }
    float any = (float)failures;   // every rank's verdict
    comm_all_reduce_max(&comm.world, &any, 1, COMM_KIND_OTHER);
    int all = any > 0.0f;
    if (comm.world_rank == 0) {
        if (all) { printf("test_kv_parallel (%d ranks, kvp %d x tp %d): FAILED\n", comm.world_size, comm.cp, tp); }
        else { printf("test_kv_parallel (%d ranks, kvp %d x tp %d): all passed\n", comm.world_size, comm.cp, tp); }
    }
    comm_finalize(&comm);
    return all ? 1 : 0;
}
