/*
 * serve_layout_model.c: a bandwidth-bound model of decoding one request of a DeepSeek-R1-sized
 * mixture of experts on 16 H100s (two nodes of 8) in three layouts: tensor parallelism (TP 16),
 * expert parallelism (EP 16, attention on the request's GPU) and Helix's KV parallelism (KVP 16
 * for attention, then TP 16 for the output projection and the FFN). For 128K and 1M tokens of
 * context it prints each layout's memory per GPU and its inter-token latency when every byte is
 * read from HBM once per token and every collective moves its bytes at the link's bandwidth:
 *   ITL = (weights read + KV cache read) / HBM bandwidth + sum over collectives of bytes / link
 * Latencies of the links (the alpha of alpha-beta) and of kernel launches are left out, which
 * flatters the layouts with many small collectives; compute is left out (one request is far
 * below the tensor cores' ridge point). A model, not a measurement: nothing here ran on H100s.
 *
 *   dev/tools/serve_layout_model        (make serve-layout-model)
 */
#include <stdio.h>

// the hardware (the seed's): H100 SXM
static const double HBM_BYTES_PER_S = 3.35e12, GPU_BYTES = 80e9;
static const double NVLINK_BYTES_PER_S = 900e9;         // within a node of 8
static const double IB_BYTES_PER_S = 400e9 / 8;         // 400 Gb/s per GPU across nodes
static const int GPUS = 16;

// the model: DeepSeek-V3/R1's configuration (config.json)
static const double HIDDEN = 7168, LAYERS = 61, DENSE_LAYERS = 3, HEADS = 128;
static const double Q_LORA = 1536, KV_LORA = 512, QK_NOPE = 128, QK_ROPE = 64, V_HEAD = 128;
static const double EXPERTS = 256, TOP_K = 8, SHARED = 1, MOE_INTER = 2048, DENSE_INTER = 18432;
static const double VOCAB = 129280;
static const double WEIGHT_BYTES = 1;   // FP8 weights, as R1 is released
static const double KV_BYTES = 2;       // BF16 cache: MLA's latent, KV_LORA + QK_ROPE = 576 values per token per layer
static const double ACT_BYTES = 2;      // BF16 activations on the wire
static const double STAT_BYTES = 4;     // fp32 max and Z of KVP's combine

// Bytes a ring all-reduce (or reduce-scatter + all-gather) of n bytes sends per rank, and a
// reduce-scatter's (kv_parallel.h's, comm.h's formulas).
static double all_reduce(double n, int p) { return 2.0 * (p - 1) / p * n; }
static double reduce_scatter(double n, int p) { return (double)(p - 1) / p * n; }

int main(void) {
    // parameters per layer
    double attn_in = HIDDEN * Q_LORA + Q_LORA * HEADS * (QK_NOPE + QK_ROPE) + HIDDEN * (KV_LORA + QK_ROPE) +
                     KV_LORA * HEADS * (QK_NOPE + V_HEAD);    // q and kv projections (down and up)
    double attn_out = HEADS * V_HEAD * HIDDEN;                // the output projection
    double expert = 3 * HIDDEN * MOE_INTER, dense_ffn = 3 * HIDDEN * DENSE_INTER;
    double moe_layers = LAYERS - DENSE_LAYERS;
    double attention = LAYERS * (attn_in + attn_out);
    double routed = moe_layers * EXPERTS * expert;
    double ffn_always = DENSE_LAYERS * dense_ffn + moe_layers * SHARED * expert;   // dense layers, shared experts
    double embed = 2 * VOCAB * HIDDEN;
    double total = attention + routed + ffn_always + embed;
    double active_routed = moe_layers * TOP_K * expert;
    double active = attention + ffn_always + active_routed + VOCAB * HIDDEN;   // one embedding row: the head
    double kv_per_token = LAYERS * (KV_LORA + QK_ROPE) * KV_BYTES;

    printf("DeepSeek-R1-sized MoE as modelled: %.0fB parameters (%.1fB attention, %.1fB routed experts in %d x %d, "
           "%.1fB dense FFN and shared experts, %.1fB embeddings), %.1fB active per token (top %d)\n",
           total / 1e9, attention / 1e9, routed / 1e9, (int)moe_layers, (int)EXPERTS, ffn_always / 1e9, embed / 1e9,
           active / 1e9, (int)TOP_K);
    printf("MLA KV cache: %d values per token per layer x %d layers x %d bytes = %.0f bytes per token; "
           "weights FP8, cache and activations BF16\n", (int)(KV_LORA + QK_ROPE), (int)LAYERS, (int)KV_BYTES, kv_per_token);
    printf("H100: %.2f TB/s HBM, %.0f GB; NVLink %.0f GB/s in a node of 8; InfiniBand %.0f GB/s per GPU across nodes; "
           "%d GPUs, one request decoding\n\n", HBM_BYTES_PER_S / 1e12, GPU_BYTES / 1e9, NVLINK_BYTES_PER_S / 1e9,
           IB_BYTES_PER_S / 1e9, GPUS);

    const double contexts[2] = { 128.0 * 1024, 1024.0 * 1024 };
    printf("| layout | context | weights GB/GPU | KV GB/GPU | total GB/GPU | fits 80 GB | HBM read ms | comm ms | ITL ms |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    for (int ci = 0; ci < 2; ci++) {
        double ctx = contexts[ci], kv = ctx * kv_per_token;
        const char* ctx_name = ci == 0 ? "128K" : "1M";
        for (int layout = 0; layout < 3; layout++) {
            double weights_held, kv_held, read, comm;
            const char* name;
            if (layout == 0) {
                // TP 16: every matrix split 16 ways (heads, FFN columns, each expert's columns). MLA's
                // latent is one cache shared by all heads, so every rank holds and reads all of it.
                name = "TP 16";
                weights_held = total * WEIGHT_BYTES / GPUS;
                kv_held = kv;
                read = active * WEIGHT_BYTES / GPUS + kv;
                // two all-reduces of the hidden row per layer (attention and FFN outputs), the ring's
                // slowest link is the InfiniBand one between the nodes
                comm = LAYERS * 2 * all_reduce(HIDDEN * ACT_BYTES, GPUS) / IB_BYTES_PER_S;
            } else if (layout == 1) {
                // EP 16: 16 routed experts per GPU, attention, dense FFN and shared experts on every
                // GPU (attention data parallel, DeepSeek's serving layout): the request's attention
                // runs on one GPU, which holds its whole cache; its 8 experts on 8 GPUs in parallel
                name = "EP 16";
                weights_held = (total - routed) * WEIGHT_BYTES + routed * WEIGHT_BYTES / GPUS;
                kv_held = kv;
                read = (active - active_routed) * WEIGHT_BYTES + kv + moe_layers * expert * WEIGHT_BYTES;
                // dispatch and combine of the hidden row to 8 experts per MoE layer: half of them on the
                // other node (InfiniBand), half in this one (NVLink)
                double row = HIDDEN * ACT_BYTES;
                comm = moe_layers * 2 * (TOP_K / 2 * row / IB_BYTES_PER_S + TOP_K / 2 * row / NVLINK_BYTES_PER_S);
            } else {
                // Helix: KVP 16 x TP 1 for attention (one latent KV head: TP > 1 would duplicate it),
                // each rank 1/16 of the cache and every query head, the q and kv projections on
                // every rank; then the output projection and the FFN TP 16 (experts split by columns)
                name = "Helix KVP 16 x TP 1, FFN TP 16";
                weights_held = LAYERS * attn_in * WEIGHT_BYTES + (total - LAYERS * attn_in) * WEIGHT_BYTES / GPUS;
                kv_held = kv / GPUS;
                read = LAYERS * attn_in * WEIGHT_BYTES + (active - LAYERS * attn_in) * WEIGHT_BYTES / GPUS + kv / GPUS;
                // per layer: max and Z all-reduces (fp32 per head), the attention output reduce-scattered
                // by heads into the output projection's TP layout, then the row-parallel all-reduces of
                // the output projection and of the FFN
                double stats = 2 * all_reduce(HEADS * STAT_BYTES, GPUS);
                double out = reduce_scatter(HEADS * V_HEAD * ACT_BYTES, GPUS);
                double tp = 2 * all_reduce(HIDDEN * ACT_BYTES, GPUS);
                comm = LAYERS * (stats + out + tp) / IB_BYTES_PER_S;
            }
            double read_s = read / HBM_BYTES_PER_S, held = weights_held + kv_held;
            printf("| %s | %s | %.1f | %.2f | %.1f | %s | %.2f | %.3f | %.2f |\n", name, ctx_name, weights_held / 1e9,
                   kv_held / 1e9, held / 1e9, held <= GPU_BYTES ? "yes" : "no", read_s * 1e3, comm * 1e3,
                   (read_s + comm) * 1e3);
        }
    }
    return 0;
}
