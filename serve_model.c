/*
 * serve_model.c: the serving engine's model side (llmc/serve_engine.h's serve_model_*): the
 * trainer's model (train_gpt2.c, included before this file), on the rows of a step.
 * Included by serve_gpt2.c (and so serve_gpt2.cu) and test_serve_engine.c after train_gpt2.c;
 * the engine header itself knows the model only by these four functions, so it needs none of
 * train_gpt2.c's types.
 *
 * A step's N rows are N sequences of one position (B = N, T = 1): the embeddings add each
 * row's own position, the layers are train_gpt2.c's layers_forward with the engine's attention
 * step (Activations.attend) in place of the trainer's, and the head runs on the rows the engine
 * asks for, as head_forward computes them (final layernorm, logits against wte, softmax). The
 * tensor-parallel operators stand where the trainer has them (identities at one rank).
 *
 * Across ranks (llmc/serve_parallel.h) the model is this rank's slice, cut by zero.h and
 * gpt2_init from the comm's tp and ep groups as the trainer cuts it: its heads, its columns and
 * rows of the MLP, its rows of wte, its experts. The head's probabilities over the whole
 * vocabulary are the tp group's slices all-gathered (tp_gather_vocab, as the trainer's sampler
 * gathers one position's). With --kvp (llmc/serve_kvp.h) the output projection and the MLP are
 * cut over all P x K ranks instead (Helix's layout; the ffn group). With --pp
 * (llmc/serve_pipeline.h) the model is one pipeline stage's, placed as the trainer places a
 * stage (pipeline.h's ChunkPlace): layers [s*L/S, (s+1)*L/S), the first stage the embeddings,
 * the last the final layernorm and the head (wte on both).
 */
struct ServeModel {
    Zero zero;          // the parameters (zero.h at one rank, M = 0: no gradients or AdamW state)
    GPT2 model;
    Activations acts;   // for `rows` rows; the head's (lnf .. ce) serve the head's rows
    float* head_in;     // (rows,C) the rows the head reads, gathered
    float* probs_ranks; // tp > 1: (K,rows,Vl) every rank's slice of the head's probabilities, in mem ...
    float* probs_host;  // ... and on the host, before they are laid out as (rows,Vp)
    CommGroup one_rank; // the model's own context-parallel group: the comm's cp groups are KVP's
    CommGroup ffn;      // --kvp: the pool of P x K ranks the output projection and the MLP are cut over ...
    CommGroup exp;      // ... and each expert's fc and fcproj (with --ep Q: the pool's ranks that hold the same experts)
};

static ServeModel* serve_model_create(Comm* comm, const MemOps* mem, const GPT2Config* config, const float* params,
                                      int rows, ServeAttend attend, void* ctx) {
    ServeModel* m = (ServeModel*)calloc_or_die(1, sizeof(ServeModel), "serving model");
    int S = comm->pp, s = comm->pp_rank, L = config->num_layers;   // L % S == 0 (serve_layout_problem)
    ChunkPlace place = {s * L / S, (s + 1) * L / S, s == 0, s == S - 1, s};
    int ep = comm->ep > 1;   // the experts dealt over the ep group (expert_parallel.h), as the trainer deals them
    // the slices of the tp group; under --kvp the output projection and the MLP over the whole
    // pool (Helix's layout, llmc/serve_kvp.h; without KVP serve_kvp_cut is the tp group's)
    TPCut cut = serve_kvp_cut(comm);
    // the ep group is the experts' data-parallel group (the trainer's carves it from the dp
    // group; under --kvp it is in the pool): no gradients, so no edp ranks to shard over
    CommGroup* dp = ep ? &comm->ep_group : &comm->dp_group;
    zero_init_cut(&m->zero, config, mem, 0, dp, dp, ep ? &comm->ep_group : NULL, ep ? &comm->edp_group : NULL,
                  &comm->pp_group, cut, &place, 1, S - 1, params, 0);
    // the comm's cp groups are the KVP groups of the engine's attention (llmc/serve_kvp.h); the
    // model's own context parallelism (the trainer's, over a sequence's rows) is one rank
    comm_group_init_single(&m->one_rank, &comm->stats, comm->mem);
    gpt2_init(&m->model, config, &place, &m->zero, &comm->tp_group, &m->one_rank, 0, 0, rows, 1);
    if (comm->cp > 1) {
        serve_kvp_ffn_groups(comm, &m->ffn, &m->exp);
        gpt2_set_ffn_groups(&m->model, &m->ffn, comm->ep > 1 ? &m->exp : &m->ffn);
    }
    // the ep ranks hold the same rows: each runs the expert layers on its share (train_gpt2.c moe_forward_layer)
    if (ep) { gpt2_split_expert_rows(&m->model, rows); }
    activations_alloc(&m->acts, &m->model, rows, 1, 1, 0, 0);   // recompute 1: one layer's GELU output
    m->acts.attend = attend;
    m->acts.attend_ctx = ctx;
#ifndef LLMC_DEVICE_KERNELS
    // every step's matmuls of few rows read packed copies of the weights (train_gpt2.c
    // forward_matmul, llmc/decode_matmul.h: matmul_forward's bits), made on first use; serving
    // never changes the weights, so they live as long as the model (gpt2_free frees them)
    m->model.decode_layers = (DecodeWeights*)calloc_or_die(1, sizeof(DecodeWeights), "decode weights");
    m->model.decoding = m->model.decode_layers;
#endif
    m->head_in = mem_floats(mem, (size_t)rows * config->channels, "serving head rows");
    if (comm->tp_group.size > 1) {
        m->probs_ranks = mem_floats(mem, (size_t)rows * config->padded_vocab_size, "serving gathered probabilities");
        m->probs_host = (float*)malloc_or_die(sizeof(float) * (size_t)rows * config->padded_vocab_size, "serving probabilities");
    }
    return m;
}

static void serve_model_free(ServeModel* m) {
    m->model.mem->release(m->head_in);
    if (m->probs_ranks) { m->model.mem->release(m->probs_ranks); }
    free(m->probs_host);
    activations_free(&m->model, &m->acts);
    gpt2_free(&m->model);
    zero_free(&m->zero);
    if (m->ffn.size > 1) { comm_group_free(&m->ffn); }
    if (m->exp.size > 1) { comm_group_free(&m->exp); }
    free(m);
}

// The bytes of the weights this rank holds (fp32; its slices of the layout).
static size_t serve_model_weight_bytes(const ServeModel* m) { return m->zero.lay.local_params * sizeof(float); }

static void serve_model_forward(ServeModel* m, const int* tokens, const int* pos, int N) {
    GPT2* model = &m->model;
    Activations* a = &m->acts;
    Zero* z = &m->zero;
    int C = model->config.channels;
    if (!model->has_embedding) {   // a later pipeline stage: its input came from the stage before
        layers_forward(model, a, N, 1, 0, 1);
        return;
    }
    model->mem->from_host(a->inputs, tokens, sizeof(int) * (size_t)N);
    const float* wte = zero_params_acquire(z, ZERO_WTE, ZERO_WPE);
    encoder_lookup(a->encoded, a->inputs, wte, model->v0, model->Vl, N, C);
    zero_params_release(z, ZERO_WTE);
    // the vocab-parallel lookup summed over the tp group (embed_forward)
    tp_vocab_embedding_reduce(model->tp, a->encoded, (size_t)N * C);
    const float* wpe = zero_params_acquire(z, ZERO_WPE, ZERO_LAYER(0));
    for (int r0 = 0, r = 1; r <= N; r++) {   // wpe added to each run of rows at consecutive positions
        if (r < N && pos[r] == pos[r - 1] + 1) { continue; }
        encoder_add_positions(a->encoded + (size_t)r0 * C, wpe + (size_t)pos[r0] * C, 1, r - r0, C);
        r0 = r;
    }
    zero_params_release(z, ZERO_WPE);
    layers_forward(model, a, N, 1, 0, 1);
}

static void serve_model_head(ServeModel* m, int N, const int* rows_dev, int M, float* probs) {
    GPT2* model = &m->model;
    Activations* a = &m->acts;
    Zero* z = &m->zero;
    int C = model->config.channels, V = model->config.vocab_size, Vl = model->Vl, v0 = model->v0;
    int LNF = z->lay.num_units - 1;
    moe_gather_rows(m->head_in, stage_output(a, &model->config, N, 1), rows_dev, M, C);
    const float* lnf = zero_params_acquire(z, LNF, ZERO_WTE);
    layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, m->head_in, lnf, lnf + C, M, C);
    const float* wte = zero_params_acquire(z, ZERO_WTE, -1);
    forward_matmul(model, a->probs, a->lnf, wte, NULL, M, C, Vl, CANON_R);
    float *maxes = a->ce, *zs = a->ce + M, *target_logits = a->ce + 2 * M;
    crossentropy_max(maxes, a->probs, M, V, v0, Vl);
    tp_vocab_ce_max(model->tp, maxes, (size_t)M);
    crossentropy_exps(zs, target_logits, a->probs, maxes, NULL, M, V, v0, Vl, CANON_R / model->tp_size);
    tp_vocab_ce_sums(model->tp, zs, (size_t)M);   // zs, then target_logits
    crossentropy_normalize(a->probs, NULL, zs, target_logits, maxes, NULL, M, V, v0, Vl);
    zero_params_release(z, ZERO_WTE);
    zero_params_release(z, LNF);
    int Vp = model->config.padded_vocab_size, K = model->tp_size;
    if (K == 1) {
        model->mem->to_host(probs, a->probs, sizeof(float) * (size_t)M * Vp);
        return;
    }
    // (K,M,Vl) <- every rank's (M,Vl): all-gather (tp group); then row m is the K slices in rank order
    tp_gather_vocab(model->tp, a->probs, m->probs_ranks, (size_t)M * Vl);
    model->mem->to_host(m->probs_host, m->probs_ranks, sizeof(float) * (size_t)M * Vp);
    for (int k = 0; k < K; k++) {
        for (int r = 0; r < M; r++) {
            memcpy(probs + (size_t)r * Vp + (size_t)k * Vl, m->probs_host + ((size_t)k * M + r) * Vl, sizeof(float) * (size_t)Vl);
        }
    }
}

// A pipeline stage's ends (llmc/serve_pipeline.h): where the stage before's (N,C) rows arrive,
// and this stage's (N,C) output, in mem.
static inline float* serve_model_stage_input(ServeModel* m) { return m->acts.encoded; }
static inline float* serve_model_stage_output(ServeModel* m, int N) { return stage_output(&m->acts, &m->model.config, N, 1); }
