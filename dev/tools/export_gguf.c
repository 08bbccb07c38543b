/*
 * export_gguf: an llm.c checkpoint and GPT-2's tokenizer files -> one GGUF file that llama.cpp
 * loads as its architecture "gpt2", so llama.cpp can run our models side by side with our
 * decoder (dev/bench/bench_llamacpp.sh).
 *
 *   export_gguf in.bin out.gguf [--type f32|f16] [--encoder encoder.json] [--bpe vocab.bpe]
 *
 * The file (GGUF version 3, ggml's gguf.h), little-endian: "GGUF", version, tensor count and
 * key count (int64), the keys, the tensor infos (name, dims, ne[], ggml type, offset), zeros
 * to a multiple of 32 bytes (gguf.h's default alignment: no general.alignment key), then each
 * tensor's data at its offset from there, every offset a multiple of 32, in the infos' order.
 *
 * Keys: general.architecture "gpt2", general.name, general.file_type (0 all f32, 1 mostly
 * f16); gpt2.context_length (maxT), .embedding_length (C), .feed_forward_length (4C),
 * .block_count (L), .attention.head_count (NH) as uint32 and .attention.layer_norm_epsilon
 * (1e-5, float32: layernorm's in kernels.h); tokenizer.ggml.model "gpt2", .pre "gpt-2" (GPT-2's
 * pre-tokenizer regex), .tokens (encoder.json's keys by id, in its byte-to-unicode spelling),
 * .token_type (1 normal, 3 control for <|endoftext|>), .merges (vocab.bpe's lines "A B" by
 * rank), .bos_token_id and .eos_token_id (<|endoftext|>, 50256).
 *
 * Tensors: ggml's ne[0] is the fastest dimension, so our nn.Linear weight [out][in] row-major
 * is ne = [in, out], the same bytes in the same order (no transpose):
 *   token_embd.weight [C, V] (wte's first V rows: the Vp - V padding rows are no tokens)
 *   position_embd.weight [C, maxT]
 *   blk.N.attn_norm.weight/.bias [C]        blk.N.attn_qkv.weight [C, 3C]  .bias [3C]
 *   blk.N.attn_output.weight [C, C] .bias [C]   blk.N.ffn_norm.weight/.bias [C]
 *   blk.N.ffn_up.weight [C, 4C] .bias [4C]  blk.N.ffn_down.weight [4C, C]  .bias [C]
 *   output_norm.weight/.bias [C]
 * and no output.weight: GPT-2 ties its head to wte, and llama.cpp's gpt2 loader takes
 * token_embd when output.weight is absent. --type f16 writes the 2-D tensors as IEEE half
 * (rounded to nearest, ties to even) and keeps the 1-D ones (norms, biases) f32, as llama.cpp's
 * convert_hf_to_gguf.py --outtype f16 does.
 *
 * The checkpoint's vocabulary must be encoder.json's (GPT-2's 50257 tokens); a mixture-of-
 * experts checkpoint is refused (llama.cpp's gpt2 has no experts). The file is written
 * atomically, after every input has been read and checked.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/utils.h"
#include "llmc/model.h"
#include "llmc/checkpoint.h"
#include "llmc/bpe_encoder.h"

enum { GGUF_UINT32 = 4, GGUF_INT32 = 5, GGUF_FLOAT32 = 6, GGUF_STRING = 8, GGUF_ARRAY = 9 };
enum { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1 };
enum { LLAMA_TOKEN_NORMAL = 1, LLAMA_TOKEN_CONTROL = 3 };
#define GGUF_ALIGNMENT 32
#define GGUF_KEYS 16   // the keys write_gguf writes (it checks the count)

static void usage_exit(void) {
    fprintf(stderr, "usage: export_gguf in.bin out.gguf [--type f32|f16] [--encoder encoder.json] [--bpe vocab.bpe]\n");
    exit(1);
}

// llama.cpp's name of our tensor t (of layer l).
static void gguf_tensor_name(int t, int l, char* out, size_t cap) {
    static const char* const layer_name[NUM_LAYER_TENSORS] = {
        "attn_norm.weight", "attn_norm.bias", "attn_qkv.weight", "attn_qkv.bias", "attn_output.weight",
        "attn_output.bias", "ffn_norm.weight", "ffn_norm.bias", "ffn_up.weight", "ffn_up.bias",
        "ffn_down.weight", "ffn_down.bias"
    };
    switch (t) {
        case P_WTE:  snprintf(out, cap, "token_embd.weight"); break;
        case P_WPE:  snprintf(out, cap, "position_embd.weight"); break;
        case P_LNFW: snprintf(out, cap, "output_norm.weight"); break;
        case P_LNFB: snprintf(out, cap, "output_norm.bias"); break;
        default:     snprintf(out, cap, "blk.%d.%s", l, layer_name[t - P_LN1W]); break;
    }
}

// fp32 -> IEEE half, round to nearest, ties to even; overflow to infinity, NaN stays NaN.
static uint16_t f32_to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t sign = (u >> 16) & 0x8000u, exp = (u >> 23) & 0xFFu, man = u & 0x7FFFFFu;
    if (exp == 0xFF) { return (uint16_t)(sign | 0x7C00u | (man ? 0x200u : 0)); }
    int e = (int)exp - 127 + 15;   // the half's biased exponent
    if (e >= 31) { return (uint16_t)(sign | 0x7C00u); }
    uint32_t bits;    // the value in units of the half's last place (before rounding), shifted
    int shift;        // left by `shift` bits, which are rounded away
    if (e <= 0) {     // subnormal half (or zero): units of 2^-24
        if (e < -10) { return (uint16_t)sign; }   // below half the smallest subnormal
        bits = man | 0x800000u;
        shift = 14 - e;
    } else {
        bits = (uint32_t)e << 23 | man;   // exponent and mantissa together: a carry rounds up the exponent
        shift = 13;
    }
    uint32_t half = bits >> shift, rest = bits & ((1u << shift) - 1), tie = 1u << (shift - 1);
    if (rest > tie || (rest == tie && (half & 1))) { half++; }
    return (uint16_t)(sign | half);
}

// --- the file ------------------------------------------------------------------------------

typedef struct {
    AtomicWriter w;
    uint64_t bytes;   // written so far: what the padding pads
    int keys;         // written so far
} GgufOut;

static void out_bytes(GgufOut* o, const void* p, size_t n) {
    atomic_writer_write(&o->w, p, n);
    o->bytes += n;
}
static void out_u32(GgufOut* o, uint32_t v) { out_bytes(o, &v, 4); }
static void out_u64(GgufOut* o, uint64_t v) { out_bytes(o, &v, 8); }
static void out_string(GgufOut* o, const void* s, size_t n) { out_u64(o, n); out_bytes(o, s, n); }
static void out_pad(GgufOut* o) {
    static const uint8_t zeros[GGUF_ALIGNMENT];
    out_bytes(o, zeros, (GGUF_ALIGNMENT - o->bytes % GGUF_ALIGNMENT) % GGUF_ALIGNMENT);
}

static void key_header(GgufOut* o, const char* key, uint32_t type) {
    o->keys++;
    out_string(o, key, strlen(key));
    out_u32(o, type);
}
static void key_u32(GgufOut* o, const char* key, uint32_t v) { key_header(o, key, GGUF_UINT32); out_u32(o, v); }
static void key_f32(GgufOut* o, const char* key, float v) { key_header(o, key, GGUF_FLOAT32); out_bytes(o, &v, 4); }
static void key_string(GgufOut* o, const char* key, const char* v) {
    key_header(o, key, GGUF_STRING);
    out_string(o, v, strlen(v));
}
static void key_array(GgufOut* o, const char* key, uint32_t type, uint64_t n) {
    key_header(o, key, GGUF_ARRAY);
    out_u32(o, type);
    out_u64(o, n);
}

// Token id's bytes in GPT-2's byte-to-unicode spelling (encoder.json's keys, vocab.bpe's
// parts) at out (room for twice the token's bytes); returns the length.
static size_t spell_token(const BPEEncoder* b, uint32_t id, uint8_t* out) {
    size_t n, len = 0;
    const uint8_t* bytes = bpe_token(b, id, &n);
    for (size_t i = 0; i < n; i++) { len += (size_t)bpe_byte_to_unicode_utf8(bytes[i], out + len); }
    return len;
}

typedef struct {
    char name[64];
    int tensor, layer;
    uint32_t n_dims;
    uint64_t ne[2];
    uint32_t type;
    uint64_t offset;   // from the start of the data section
} GgufTensor;

static void add_tensor(GgufTensor* list, int* n, const GPT2Config* c, int t, int l, int f16, uint64_t* offset) {
    GgufTensor* g = &list[(*n)++];
    gguf_tensor_name(t, l, g->name, sizeof(g->name));
    g->tensor = t;
    g->layer = l;
    size_t rows, cols;
    param_shape(c, t, &rows, &cols);
    if (t == P_WTE) { rows = (size_t)c->vocab_size; }
    int matrix = param_is_decayed(t);
    g->n_dims = matrix ? 2 : 1;
    g->ne[0] = cols;
    g->ne[1] = rows;
    g->type = matrix && f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    g->offset = *offset;
    uint64_t bytes = rows * cols * (g->type == GGML_TYPE_F16 ? 2 : 4);
    *offset += (bytes + GGUF_ALIGNMENT - 1) / GGUF_ALIGNMENT * GGUF_ALIGNMENT;
}

// The tensors in memory order (wte, wpe, layer by layer, lnf) with their offsets; returns the count.
static int gguf_tensor_list(const GPT2Config* c, int f16, GgufTensor* list) {
    int n = 0;
    uint64_t offset = 0;
    add_tensor(list, &n, c, P_WTE, 0, f16, &offset);
    add_tensor(list, &n, c, P_WPE, 0, f16, &offset);
    for (int l = 0; l < c->num_layers; l++) {
        for (int i = PARAM_LAYER_FIRST; i < PARAM_LAYER_END; i++) {
            if (param_file_order[i] != P_ROUTERW) { add_tensor(list, &n, c, param_file_order[i], l, f16, &offset); }
        }
    }
    add_tensor(list, &n, c, P_LNFW, 0, f16, &offset);
    add_tensor(list, &n, c, P_LNFB, 0, f16, &offset);
    return n;
}

static void write_gguf(const char* path, const GPT2Config* c, const float* params, int f16, const BPEEncoder* b,
                       const char* name) {
    GgufTensor* list = (GgufTensor*)calloc_or_die(4 + (size_t)c->num_layers * NUM_LAYER_TENSORS, sizeof(GgufTensor),
                                                  "tensor list");
    int n = gguf_tensor_list(c, f16, list);
    size_t longest = 0;
    for (uint32_t id = 0; id < b->vocab_size; id++) {
        size_t len = b->token_offset[id + 1] - b->token_offset[id];
        longest = len > longest ? len : longest;
    }
    uint8_t* spelled = (uint8_t*)malloc_or_die(4 * longest + 1, "a token's spelling");
    // vocab.bpe's merges by rank: the pair table holds each (left, right) with its line's rank
    size_t merges = 0;
    for (size_t k = 0; k < b->pairs_cap; k++) { merges += b->pairs[k].pair != PAIR_EMPTY; }
    uint64_t* merge = (uint64_t*)malloc_or_die(merges * sizeof(uint64_t) + 1, "merge list");
    for (size_t k = 0; k < b->pairs_cap; k++) {
        if (b->pairs[k].pair != PAIR_EMPTY) { merge[b->pairs[k].rank] = b->pairs[k].pair; }
    }

    GgufOut o = {.bytes = 0, .keys = 0};
    atomic_writer_open(&o.w, path);
    out_bytes(&o, "GGUF", 4);
    out_u32(&o, 3);
    out_u64(&o, (uint64_t)n);
    out_u64(&o, GGUF_KEYS);
    key_string(&o, "general.architecture", "gpt2");
    key_string(&o, "general.name", name);
    key_u32(&o, "general.file_type", f16 ? 1 : 0);
    key_u32(&o, "gpt2.context_length", (uint32_t)c->max_seq_len);
    key_u32(&o, "gpt2.embedding_length", (uint32_t)c->channels);
    key_u32(&o, "gpt2.feed_forward_length", 4 * (uint32_t)c->channels);
    key_u32(&o, "gpt2.block_count", (uint32_t)c->num_layers);
    key_u32(&o, "gpt2.attention.head_count", (uint32_t)c->num_heads);
    key_f32(&o, "gpt2.attention.layer_norm_epsilon", 1e-5f);
    key_string(&o, "tokenizer.ggml.model", "gpt2");
    key_string(&o, "tokenizer.ggml.pre", "gpt-2");
    key_array(&o, "tokenizer.ggml.tokens", GGUF_STRING, b->vocab_size);
    for (uint32_t id = 0; id < b->vocab_size; id++) { out_string(&o, spelled, spell_token(b, id, spelled)); }
    key_array(&o, "tokenizer.ggml.token_type", GGUF_INT32, b->vocab_size);
    for (uint32_t id = 0; id < b->vocab_size; id++) {
        out_u32(&o, id == b->eot_token ? LLAMA_TOKEN_CONTROL : LLAMA_TOKEN_NORMAL);
    }
    key_array(&o, "tokenizer.ggml.merges", GGUF_STRING, merges);
    for (size_t r = 0; r < merges; r++) {
        size_t len = spell_token(b, (uint32_t)(merge[r] >> 32), spelled);
        spelled[len++] = ' ';
        len += spell_token(b, (uint32_t)merge[r], spelled + len);
        out_string(&o, spelled, len);
    }
    key_u32(&o, "tokenizer.ggml.bos_token_id", b->eot_token);
    key_u32(&o, "tokenizer.ggml.eos_token_id", b->eot_token);
    if (o.keys != GGUF_KEYS) { fatal("internal error: %d GGUF keys written, the header says %d", o.keys, GGUF_KEYS); }
    for (int i = 0; i < n; i++) {
        out_string(&o, list[i].name, strlen(list[i].name));
        out_u32(&o, list[i].n_dims);
        for (uint32_t d = 0; d < list[i].n_dims; d++) { out_u64(&o, list[i].ne[d]); }
        out_u32(&o, list[i].type);
        out_u64(&o, list[i].offset);
    }
    out_pad(&o);
    uint64_t data_start = o.bytes;
    size_t largest = 0;
    for (int i = 0; i < n; i++) { largest = list[i].ne[0] * list[i].ne[1] > largest ? list[i].ne[0] * list[i].ne[1] : largest; }
    uint16_t* half = f16 ? (uint16_t*)malloc_or_die(largest * sizeof(uint16_t), "f16 buffer") : NULL;
    for (int i = 0; i < n; i++) {
        if (o.bytes - data_start != list[i].offset) { fatal("internal error: tensor '%s' is not at its offset", list[i].name); }
        const float* src = params + param_offset(c, list[i].tensor, list[i].layer);
        size_t count = list[i].ne[0] * list[i].ne[1];
        if (list[i].type == GGML_TYPE_F16) {
            for (size_t k = 0; k < count; k++) { half[k] = f32_to_f16(src[k]); }
            out_bytes(&o, half, count * sizeof(uint16_t));
        } else {
            out_bytes(&o, src, count * sizeof(float));
        }
        out_pad(&o);
    }
    atomic_writer_commit(&o.w);
    printf("exported '%s' (L=%d C=%d NH=%d V=%d maxT=%d) -> '%s': GGUF v3, %d tensors (%s), %u tokens, %zu merges, "
           "%llu bytes\n", name, c->num_layers, c->channels, c->num_heads, c->vocab_size, c->max_seq_len, path, n,
           f16 ? "2-D f16, 1-D f32" : "f32", b->vocab_size, merges, (unsigned long long)o.bytes);
    free(half);
    free(merge);
    free(spelled);
    free(list);
}

int main(int argc, char** argv) {
    if (argc < 3 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) { usage_exit(); }
    const char* in = argv[1];
    const char* out = argv[2];
    const char* encoder = "dev/data/gpt2/encoder.json";
    const char* merges = "dev/data/gpt2/vocab.bpe";
    int f16 = 0;
    for (int i = 3; i < argc; i += 2) {
        if (i + 1 >= argc) { fatal("flag %s needs a value (usage: see export_gguf --help)", argv[i]); }
        if (strcmp(argv[i], "--type") == 0) {
            if (strcmp(argv[i + 1], "f32") != 0 && strcmp(argv[i + 1], "f16") != 0) {
                fatal("--type: expected f32 or f16, got '%s'", argv[i + 1]);
            }
            f16 = strcmp(argv[i + 1], "f16") == 0;
        } else if (strcmp(argv[i], "--encoder") == 0) {
            encoder = argv[i + 1];
        } else if (strcmp(argv[i], "--bpe") == 0) {
            merges = argv[i + 1];
        } else {
            fatal("unknown flag '%s' (usage: export_gguf in.bin out.gguf [--type f32|f16] [--encoder F] [--bpe F])", argv[i]);
        }
    }
    GPT2Config c;
    float* params = checkpoint_read_model(in, &c);
    if (c.num_experts > 0) {
        fatal("'%s' is a mixture-of-experts model (E=%d): llama.cpp's gpt2 architecture has no experts", in, c.num_experts);
    }
    BPEEncoder b;
    bpe_init(&b, encoder, merges);
    if ((uint32_t)c.vocab_size != b.vocab_size) {
        fatal("'%s' has a vocabulary of V=%d tokens, '%s' of %u: a GGUF file's tokenizer must be its model's", in,
              c.vocab_size, encoder, b.vocab_size);
    }
    write_gguf(out, &c, params, f16, &b, in);
    bpe_free(&b);
    free(params);
    return 0;
}
