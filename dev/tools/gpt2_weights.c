/*
 * gpt2_weights: OpenAI's GPT-2 weights between Hugging Face's model.safetensors and llm.c's
 * fp32 checkpoint (version 3, see llmc/checkpoint.h).
 *
 *   gpt2_weights import model.safetensors out.bin [--heads NH] [--config config.json]
 *   gpt2_weights export in.bin model.safetensors
 *   gpt2_weights info model.safetensors
 *
 * IMPORT reads GPT-2 as published on Hugging Face (openai-community/gpt2, -medium, -large,
 * -xl: GPT2Model / GPT2LMHeadModel state dicts):
 *   wte.weight [V, C]   wpe.weight [maxT, C]   ln_f.weight [C]   ln_f.bias [C]
 *   h.{l}.ln_1.weight/bias [C]           h.{l}.attn.c_attn.weight [C, 3C]  .bias [3C]
 *   h.{l}.attn.c_proj.weight [C, C] .bias [C]   h.{l}.ln_2.weight/bias [C]
 *   h.{l}.mlp.c_fc.weight [C, 4C] .bias [4C]    h.{l}.mlp.c_proj.weight [4C, C] .bias [C]
 * optionally every name prefixed "transformer.". The four .weight matrices of a layer are
 * Conv1D ([in][out]) and are transposed to our nn.Linear layout [out][in]. Skipped: the
 * attention mask buffers h.{l}.attn.bias / h.{l}.attn.masked_bias, and lm_head.weight, which
 * must equal wte.weight (GPT-2 ties them; a warning otherwise, and wte is used). Any other
 * tensor is an error (we never drop weights silently). Dtypes F32, F16 and BF16 are converted
 * exactly to fp32. L, C, V and maxT come from the shapes; NH from --heads, else from n_head of
 * config.json (--config, or config.json next to the model file), else from GPT-2's family
 * (C 768: 12, 1024: 16, 1280: 20, 1600: 25), else it is an error asking for --heads. When a
 * config.json is read, its n_embd/n_layer/vocab_size/n_positions must agree with the shapes.
 * wte is padded with zero rows to Vp = padded_vocab(V).
 *
 * EXPORT writes GPT-2's tensor names (no prefix, no mask buffers, no lm_head), F32, Conv1D
 * layout restored, wte cut back to V rows, __metadata__ {"format":"pt"}, in the reference
 * writer's canonical form (tensors sorted by name, header space-padded so the data starts
 * 8-byte aligned; see dev/tools/safetensors.h), and a config.json next to it with GPT-2's fields
 * (bos/eos_token_id are GPT-2's <|endoftext|> 50256 when V > 50256, else V - 1). Both files
 * are written atomically.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/utils.h"
#include "llmc/model.h"
#include "llmc/checkpoint.h"
#include "dev/tools/safetensors.h"

static const char* const layer_suffix[NUM_LAYER_TENSORS] = {
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"
};
// The shapes as GPT-2's code states them, for messages.
static const char* const layer_shape_text[NUM_LAYER_TENSORS] = {
    "[C]", "[C]", "[C, 3C]", "[3C]", "[C, C]", "[C]", "[C]", "[C]", "[C, 4C]", "[4C]", "[4C, C]", "[C]"
};

static int is_conv1d(int t) { return t == P_QKVW || t == P_ATTPROJW || t == P_FCW || t == P_FCPROJW; }

#define MAX_LAYERS 4096

static void usage_exit(void) {
    fprintf(stderr,
        "usage: gpt2_weights import model.safetensors out.bin [--heads NH] [--config config.json]\n"
        "       gpt2_weights export in.bin model.safetensors   (also writes config.json next to it)\n"
        "       gpt2_weights info model.safetensors\n");
    exit(1);
}

// GPT-2's tensor name of our tensor t (layer l), without prefix.
static void hf_name(int t, int l, char* out, size_t cap) {
    switch (t) {
        case P_WTE: snprintf(out, cap, "wte.weight"); break;
        case P_WPE: snprintf(out, cap, "wpe.weight"); break;
        case P_LNFW: snprintf(out, cap, "ln_f.weight"); break;
        case P_LNFB: snprintf(out, cap, "ln_f.bias"); break;
        default: snprintf(out, cap, "h.%d.%s", l, layer_suffix[t - P_LN1W]); break;
    }
}

// GPT-2's shape of our tensor t: wte [V, C] (not Vp), Conv1D weights [in, out], vectors [n].
static int hf_shape(const GPT2Config* c, int t, uint64_t dims[2]) {
    size_t rows, cols;
    param_shape(c, t, &rows, &cols);
    if (t == P_WTE) { dims[0] = (uint64_t)c->vocab_size; dims[1] = cols; return 2; }
    if (t == P_WPE) { dims[0] = rows; dims[1] = cols; return 2; }
    if (is_conv1d(t)) { dims[0] = cols; dims[1] = rows; return 2; }
    dims[0] = rows * cols;
    return 1;
}

// src [K][R] -> dst [R][K], cache-blocked.
static void transpose(const float* src, float* dst, size_t K, size_t R) {
    const size_t B = 32;
    for (size_t k0 = 0; k0 < K; k0 += B) {
        size_t k1 = k0 + B < K ? k0 + B : K;
        for (size_t r0 = 0; r0 < R; r0 += B) {
            size_t r1 = r0 + B < R ? r0 + B : R;
            for (size_t k = k0; k < k1; k++) {
                for (size_t r = r0; r < r1; r++) { dst[r * K + k] = src[k * R + r]; }
            }
        }
    }
}

static void shape_text(const StTensor* t, char* out, size_t cap) { st_format_shape(t, out, cap); }

// --- import ----------------------------------------------------------------------------------

typedef struct {
    const StTensor* wte;
    const StTensor* wpe;
    const StTensor* lnfw;
    const StTensor* lnfb;
    const StTensor* lm_head;
    const StTensor** layer;   // [MAX_LAYERS][NUM_LAYER_TENSORS]
    const StTensor** mask;    // [MAX_LAYERS]: h.{l}.attn.bias (for a shape warning)
    int L;
} Gpt2Tensors;

static void set_slot(const StTensor** slot, const StTensor* t, const char* path) {
    if (*slot) {
        fatal("file '%s': tensors '%s' and '%s' are the same GPT-2 parameter (duplicate key once "
              "the 'transformer.' prefix is dropped)", path, (*slot)->name, t->name);
    }
    *slot = t;
}

// Parses "h.{l}.rest": returns l (no sign, no leading zeros, < MAX_LAYERS) and *rest, or -1.
static int parse_layer_name(const char* s, const char** rest) {
    if (strncmp(s, "h.", 2) != 0) { return -1; }
    const char* p = s + 2;
    if (*p < '0' || *p > '9') { return -1; }
    if (*p == '0' && p[1] != '.') { return -1; }
    long l = 0;
    while (*p >= '0' && *p <= '9') {
        l = l * 10 + (*p - '0');
        if (l >= MAX_LAYERS) { return -2; }
        p++;
    }
    if (*p != '.') { return -1; }
    *rest = p + 1;
    return (int)l;
}

static void classify_tensors(const StFile* sf, Gpt2Tensors* g) {
    memset(g, 0, sizeof(*g));
    g->layer = (const StTensor**)calloc_or_die((size_t)MAX_LAYERS * NUM_LAYER_TENSORS, sizeof(StTensor*), "tensor table");
    g->mask = (const StTensor**)calloc_or_die(MAX_LAYERS, sizeof(StTensor*), "tensor table");
    const StTensor** masked_bias = (const StTensor**)calloc_or_die(MAX_LAYERS, sizeof(StTensor*), "tensor table");
    int max_layer = -1;
    for (size_t i = 0; i < sf->num_tensors; i++) {
        const StTensor* t = &sf->tensors[i];
        const char* s = strncmp(t->name, "transformer.", 12) == 0 ? t->name + 12 : t->name;
        const char* rest = NULL;
        int l;
        if (strcmp(s, "wte.weight") == 0) { set_slot(&g->wte, t, sf->path); continue; }
        if (strcmp(s, "wpe.weight") == 0) { set_slot(&g->wpe, t, sf->path); continue; }
        if (strcmp(s, "ln_f.weight") == 0) { set_slot(&g->lnfw, t, sf->path); continue; }
        if (strcmp(s, "ln_f.bias") == 0) { set_slot(&g->lnfb, t, sf->path); continue; }
        if (strcmp(s, "lm_head.weight") == 0) { set_slot(&g->lm_head, t, sf->path); continue; }
        if ((l = parse_layer_name(s, &rest)) >= 0) {
            int slot = -1;
            for (int k = 0; k < NUM_LAYER_TENSORS; k++) {
                if (strcmp(rest, layer_suffix[k]) == 0) { slot = k; }
            }
            if (slot >= 0) {
                set_slot(&g->layer[(size_t)l * NUM_LAYER_TENSORS + slot], t, sf->path);
            } else if (strcmp(rest, "attn.bias") == 0) {
                set_slot(&g->mask[l], t, sf->path);
            } else if (strcmp(rest, "attn.masked_bias") == 0) {
                set_slot(&masked_bias[l], t, sf->path);
            } else {
                l = -1;
            }
            if (l > max_layer) { max_layer = l; }
            if (l >= 0) { continue; }
        }
        char pr[200];
        if (l == -2) {
            fatal("file '%s': tensor '%s': layer index too large (at most %d layers)", sf->path,
                  st_printable(t->name, pr, sizeof(pr)), MAX_LAYERS);
        }
        fatal("file '%s': unexpected tensor '%s': not a GPT-2 parameter (expected wte.weight, "
              "wpe.weight, h.{l}.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}."
              "{weight,bias}, ln_f.{weight,bias}, optionally prefixed 'transformer.')", sf->path,
              st_printable(t->name, pr, sizeof(pr)));
    }
    free(masked_bias);
    const char* missing = !g->wte ? "wte.weight" : !g->wpe ? "wpe.weight" : !g->lnfw ? "ln_f.weight"
                        : !g->lnfb ? "ln_f.bias" : NULL;
    if (missing) { fatal("file '%s': missing tensor '%s' (not a GPT-2 checkpoint?)", sf->path, missing); }
    if (max_layer < 0) {
        fatal("file '%s': missing tensor 'h.0.ln_1.weight': no transformer layers h.{l}.* found", sf->path);
    }
    g->L = max_layer + 1;
    for (int l = 0; l < g->L; l++) {
        for (int k = 0; k < NUM_LAYER_TENSORS; k++) {
            if (!g->layer[(size_t)l * NUM_LAYER_TENSORS + k]) {
                fatal("file '%s': missing tensor 'h.%d.%s' (layers 0..%d are present)", sf->path,
                      l, layer_suffix[k], g->L - 1);
            }
        }
    }
}

static void expect_shape(const char* path, const StTensor* t, int rank, uint64_t d0, uint64_t d1,
                         const char* symbolic, const GPT2Config* c) {
    if (t->rank == rank && t->shape[0] == d0 && (rank == 1 || t->shape[1] == d1)) { return; }
    char got[200], want[64];
    shape_text(t, got, sizeof(got));
    if (rank == 1) { snprintf(want, sizeof(want), "[%llu]", (unsigned long long)d0); }
    else { snprintf(want, sizeof(want), "[%llu, %llu]", (unsigned long long)d0, (unsigned long long)d1); }
    fatal("file '%s': tensor '%s' has shape %s, expected %s = %s (C=%d from wte.weight, maxT=%d "
          "from wpe.weight)", path, t->name, got, symbolic, want, c->channels, c->max_seq_len);
}

static char* read_small_file(const char* path, size_t max, size_t* len, const char* what) {
    FILE* f = fopen_or_die(path, "rb", what);
    int64_t size = file_size_or_die(f, path);
    if (size > (int64_t)max) { fatal("%s '%s' is %lld bytes, more than the %zu-byte limit", what, path, (long long)size, max); }
    char* buf = (char*)malloc_or_die((size_t)size + 1, what);
    fread_or_die(buf, 1, (size_t)size, f, path);
    buf[size] = '\0';
    fclose(f);
    *len = (size_t)size;
    return buf;
}

// config.json next to `file` (same directory).
static void sibling_path(const char* file, const char* name, char* out, size_t cap) {
    const char* slash = strrchr(file, '/');
    int dir = slash ? (int)(slash - file) + 1 : 0;
    if ((size_t)dir + strlen(name) + 1 > cap) { fatal("path too long: '%s'", file); }
    snprintf(out, cap, "%.*s%s", dir, file, name);
}

static int parse_positive_int(const char* s, const char* flag, int max) {
    char* end;
    long v = strtol(s, &end, 10);
    if (s[0] < '0' || s[0] > '9' || *end != '\0' || v < 1 || v > max) {
        fatal("%s: expected a positive integer (at most %d), got '%s'", flag, max, s);
    }
    return (int)v;
}

static int family_heads(int C) {
    switch (C) {
        case 768: return 12;
        case 1024: return 16;
        case 1280: return 20;
        case 1600: return 25;
        default: return 0;
    }
}

static void cmd_import(int argc, char** argv) {
    const char* in = NULL;
    const char* out = NULL;
    const char* config_arg = NULL;
    int heads = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--heads") == 0) {
            if (i + 1 >= argc) { fatal("--heads needs a value (the number of attention heads)"); }
            heads = parse_positive_int(argv[++i], "--heads", 65536);
        } else if (strcmp(argv[i], "--config") == 0) {
            if (i + 1 >= argc) { fatal("--config needs a value (a Hugging Face config.json)"); }
            config_arg = argv[++i];
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            fatal("import: unknown option '%s' (usage: gpt2_weights import model.safetensors out.bin "
                  "[--heads NH] [--config config.json])", argv[i]);
        } else if (!in) { in = argv[i]; }
        else if (!out) { out = argv[i]; }
        else { fatal("import: unexpected argument '%s'", argv[i]); }
    }
    if (!in || !out) {
        fatal("import: expected model.safetensors and out.bin (usage: gpt2_weights import "
              "model.safetensors out.bin [--heads NH] [--config config.json])");
    }

    StFile sf;
    st_open(&sf, in);
    Gpt2Tensors g;
    classify_tensors(&sf, &g);

    // --- the configuration, from the shapes
    GPT2Config c;
    memset(&c, 0, sizeof(c));
    char shp[200];
    if (g.wte->rank != 2 || g.wte->shape[0] < 1 || g.wte->shape[0] > 65536 ||
        g.wte->shape[1] < 1 || g.wte->shape[1] > 65536) {
        shape_text(g.wte, shp, sizeof(shp));
        fatal("file '%s': tensor '%s' has shape %s, expected [V, C] with V in 1..65536 and C in "
              "1..65536", in, g.wte->name, shp);
    }
    c.vocab_size = (int)g.wte->shape[0];
    c.channels = (int)g.wte->shape[1];
    c.padded_vocab_size = padded_vocab(c.vocab_size);
    if (g.wpe->rank != 2 || g.wpe->shape[0] < 1 || g.wpe->shape[0] > (1u << 20) ||
        g.wpe->shape[1] != (uint64_t)c.channels) {
        shape_text(g.wpe, shp, sizeof(shp));
        fatal("file '%s': tensor '%s' has shape %s, expected [maxT, C] with C=%d (from "
              "wte.weight) and maxT in 1..2^20", in, g.wpe->name, shp, c.channels);
    }
    c.max_seq_len = (int)g.wpe->shape[0];
    c.num_layers = g.L;
    uint64_t C = (uint64_t)c.channels;
    for (int l = 0; l < g.L; l++) {
        for (int k = 0; k < NUM_LAYER_TENSORS; k++) {
            uint64_t d[2];
            int rank = hf_shape(&c, P_LN1W + k, d);
            expect_shape(in, g.layer[(size_t)l * NUM_LAYER_TENSORS + k], rank, d[0], d[1],
                         layer_shape_text[k], &c);
        }
        const StTensor* m = g.mask[l];
        uint64_t T = (uint64_t)c.max_seq_len;
        if (m && !(m->rank == 4 && m->shape[0] == 1 && m->shape[1] == 1 && m->shape[2] == T &&
                   m->shape[3] == T)) {
            shape_text(m, shp, sizeof(shp));
            fprintf(stderr, "warning: '%s': skipping attention mask buffer '%s' of unusual shape %s "
                    "(expected [1, 1, %d, %d])\n", in, m->name, shp, c.max_seq_len, c.max_seq_len);
        }
    }
    expect_shape(in, g.lnfw, 1, C, 0, "[C]", &c);
    expect_shape(in, g.lnfb, 1, C, 0, "[C]", &c);

    // --- the number of heads
    char config_path[1100];
    const char* config_file = NULL;
    if (config_arg) { config_file = config_arg; }
    else if (!heads) {
        sibling_path(in, "config.json", config_path, sizeof(config_path));
        if (file_exists(config_path)) { config_file = config_path; }
    }
    const char* heads_from = heads ? "--heads" : NULL;
    if (config_file) {
        size_t len;
        char* text = read_small_file(config_file, 16u << 20, &len, "config file");
        const char* keys[] = {"n_head", "num_attention_heads", "n_embd", "n_layer", "vocab_size", "n_positions"};
        long v[6];
        int found[6];
        st_json_get_ints(config_file, text, len, 6, keys, v, found);
        free(text);
        const long actual[6] = {0, 0, c.channels, c.num_layers, c.vocab_size, c.max_seq_len};
        const char* sym[6] = {"", "", "C", "L", "V", "maxT"};
        for (int k = 2; k < 6; k++) {
            if (found[k] && v[k] != actual[k]) {
                fatal("config file '%s' says %s=%ld but '%s' has %s=%ld: the config belongs to "
                      "another model (pass the right --config, or --heads)", config_file, keys[k],
                      v[k], in, sym[k], actual[k]);
            }
        }
        int k = found[0] ? 0 : found[1] ? 1 : -1;
        if (k >= 0) {
            if (heads && v[k] != heads) {
                fprintf(stderr, "warning: --heads %d overrides %s=%ld of '%s'\n", heads, keys[k], v[k], config_file);
            }
            if (!heads) {
                if (v[k] < 1 || v[k] > 65536) { fatal("config file '%s': %s=%ld is not a valid number of heads", config_file, keys[k], v[k]); }
                heads = (int)v[k];
                heads_from = "config.json";
            }
        }
    }
    if (!heads && (heads = family_heads(c.channels)) != 0) { heads_from = "GPT-2's family table"; }
    if (!heads) {
        fatal("cannot tell the number of attention heads of '%s' (L=%d C=%d, not a GPT-2 size and "
              "no n_head in a config.json): pass --heads NH (or --config config.json)", in,
              c.num_layers, c.channels);
    }
    c.num_heads = heads;
    if (c.channels % c.num_heads != 0) {
        fatal("%s gives NH=%d heads, which does not divide C=%d of '%s'", heads_from, heads, c.channels, in);
    }
    const char* problem = config_problem(&c);
    if (problem) { fatal("file '%s': unsupported model shape: %s", in, problem); }

    // --- every tensor we read must have a float dtype: check before allocating
    for (size_t i = 0; i < sf.num_tensors; i++) {
        const StTensor* t = &sf.tensors[i];
        int used = t == g.wte || t == g.wpe || t == g.lnfw || t == g.lnfb || t == g.lm_head;
        for (size_t j = 0; !used && j < (size_t)g.L * NUM_LAYER_TENSORS; j++) { used = g.layer[j] == t; }
        if (used && t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16) {
            fatal("file '%s': tensor '%s' has dtype %s; expected F32, F16 or BF16", in, t->name,
                  st_dtype_names[t->dtype]);
        }
    }

    // --- read, transposing Conv1D weights; wte rows V..Vp-1 stay zero
    size_t P = param_count(&c);
    float* params = (float*)aligned_calloc_or_die(P * sizeof(float), "parameters");
    float* tmp = (float*)malloc_or_die(4 * C * C * sizeof(float), "a transpose buffer");
    st_read_f32(&sf, g.wte, params + param_offset(&c, P_WTE, 0));
    st_read_f32(&sf, g.wpe, params + param_offset(&c, P_WPE, 0));
    for (int l = 0; l < g.L; l++) {
        for (int k = 0; k < NUM_LAYER_TENSORS; k++) {
            int t = P_LN1W + k;
            const StTensor* st = g.layer[(size_t)l * NUM_LAYER_TENSORS + k];
            float* dst = params + param_offset(&c, t, l);
            if (!is_conv1d(t)) { st_read_f32(&sf, st, dst); continue; }
            size_t rows, cols;
            param_shape(&c, t, &rows, &cols);
            st_read_f32(&sf, st, tmp);              // [in = cols][out = rows]
            transpose(tmp, dst, cols, rows);        // -> [out][in]
        }
    }
    st_read_f32(&sf, g.lnfw, params + param_offset(&c, P_LNFW, 0));
    st_read_f32(&sf, g.lnfb, params + param_offset(&c, P_LNFB, 0));
    free(tmp);

    if (g.lm_head) {
        const StTensor* t = g.lm_head;
        if (t->rank != 2 || t->shape[0] != (uint64_t)c.vocab_size || t->shape[1] != C) {
            shape_text(t, shp, sizeof(shp));
            fprintf(stderr, "warning: '%s': '%s' has shape %s, not wte's [%d, %d]: GPT-2 ties it to "
                    "wte.weight; ignoring it\n", in, t->name, shp, c.vocab_size, c.channels);
        } else {
            size_t n = (size_t)c.vocab_size * C;
            float* head = (float*)malloc_or_die(n * sizeof(float), "lm_head.weight");
            st_read_f32(&sf, t, head);
            if (memcmp(head, params + param_offset(&c, P_WTE, 0), n * sizeof(float)) != 0) {
                size_t bad = 0;
                for (size_t i = 0; i < n; i++) { bad += memcmp(&head[i], &params[i], 4) != 0; }
                fprintf(stderr, "warning: '%s': '%s' differs from wte.weight in %zu of %zu values; "
                        "GPT-2 ties them and so does llm.c: using wte.weight, ignoring it\n", in,
                        t->name, bad, n);
            }
            free(head);
        }
    }

    checkpoint_write_model(out, &c, params);
    printf("imported '%s' -> '%s': L=%d C=%d NH=%d (from %s) V=%d (Vp=%d) maxT=%d, %zu parameters\n",
           in, out, c.num_layers, c.channels, c.num_heads, heads_from, c.vocab_size,
           c.padded_vocab_size, c.max_seq_len, P);
    free(params);
    free(g.layer);
    free(g.mask);
    st_close(&sf);
}

// --- export ----------------------------------------------------------------------------------

typedef struct {
    const GPT2Config* c;
    const float* params;
    const int* tensor;   // our tensor id of write entry i
    const int* layer;
    float* tmp;
} ExportCtx;

static void emit_tensor(AtomicWriter* w, const StWriteTensor* wt, int i, void* vctx) {
    ExportCtx* x = (ExportCtx*)vctx;
    int t = x->tensor[i];
    const float* src = x->params + param_offset(x->c, t, x->layer[i]);
    size_t rows, cols;
    param_shape(x->c, t, &rows, &cols);
    if (t == P_WTE) { rows = (size_t)x->c->vocab_size; }   // drop the padding rows
    if (is_conv1d(t)) {
        transpose(src, x->tmp, rows, cols);   // ours [out = rows][in = cols] -> [in][out]
        src = x->tmp;
    }
    atomic_writer_write(w, src, rows * cols * sizeof(float));
}

static void write_config_json(const char* path, const GPT2Config* c) {
    int eot = c->vocab_size > 50256 ? 50256 : c->vocab_size - 1;
    char buf[4096];
    int n = snprintf(buf, sizeof(buf),
        "{\n"
        "  \"activation_function\": \"gelu_new\",\n"
        "  \"architectures\": [\n"
        "    \"GPT2LMHeadModel\"\n"
        "  ],\n"
        "  \"attn_pdrop\": 0.1,\n"
        "  \"bos_token_id\": %d,\n"
        "  \"embd_pdrop\": 0.1,\n"
        "  \"eos_token_id\": %d,\n"
        "  \"initializer_range\": 0.02,\n"
        "  \"layer_norm_epsilon\": 1e-05,\n"
        "  \"model_type\": \"gpt2\",\n"
        "  \"n_ctx\": %d,\n"
        "  \"n_embd\": %d,\n"
        "  \"n_head\": %d,\n"
        "  \"n_inner\": null,\n"
        "  \"n_layer\": %d,\n"
        "  \"n_positions\": %d,\n"
        "  \"reorder_and_upcast_attn\": false,\n"
        "  \"resid_pdrop\": 0.1,\n"
        "  \"scale_attn_by_inverse_layer_idx\": false,\n"
        "  \"scale_attn_weights\": true,\n"
        "  \"summary_activation\": null,\n"
        "  \"summary_first_dropout\": 0.1,\n"
        "  \"summary_proj_to_labels\": true,\n"
        "  \"summary_type\": \"cls_index\",\n"
        "  \"summary_use_proj\": true,\n"
        "  \"tie_word_embeddings\": true,\n"
        "  \"torch_dtype\": \"float32\",\n"
        "  \"use_cache\": true,\n"
        "  \"vocab_size\": %d\n"
        "}\n",
        eot, eot, c->max_seq_len, c->channels, c->num_heads, c->num_layers, c->max_seq_len,
        c->vocab_size);
    if (n < 0 || (size_t)n >= sizeof(buf)) { fatal("internal error: config.json too long"); }
    AtomicWriter w;
    atomic_writer_open(&w, path);
    atomic_writer_write(&w, buf, (size_t)n);
    atomic_writer_commit(&w);
}

static void cmd_export(int argc, char** argv) {
    if (argc != 2 || argv[0][0] == '-' || argv[1][0] == '-') {
        fatal("export: expected in.bin and model.safetensors (usage: gpt2_weights export in.bin "
              "model.safetensors)");
    }
    const char* in = argv[0];
    const char* out = argv[1];
    GPT2Config c;
    float* params = checkpoint_read_model(in, &c);
    if (c.num_experts > 0) {
        fatal("export: '%s' is a mixture-of-experts model (E=%d), which Hugging Face's GPT-2 layout cannot hold", in,
              c.num_experts);
    }
    int n = 4 + NUM_LAYER_TENSORS * c.num_layers;
    StWriteTensor* wt = (StWriteTensor*)calloc_or_die((size_t)n, sizeof(StWriteTensor), "tensor list");
    char (*names)[64] = (char (*)[64])calloc_or_die((size_t)n, 64, "tensor names");
    int* tensor = (int*)malloc_or_die((size_t)n * sizeof(int), "tensor list");
    int* layer = (int*)malloc_or_die((size_t)n * sizeof(int), "tensor list");
    int k = 0;
    for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
        if (t == P_ROUTERW) { continue; }   // the dense model has none
        int layers = param_is_layer_tensor(t) ? c.num_layers : 1;
        for (int l = 0; l < layers; l++, k++) {
            hf_name(t, l, names[k], sizeof(names[k]));
            uint64_t d[2];
            wt[k].name = names[k];
            wt[k].dtype = ST_F32;
            wt[k].rank = hf_shape(&c, t, d);
            wt[k].shape[0] = d[0];
            wt[k].shape[1] = d[1];
            wt[k].data = NULL;
            tensor[k] = t;
            layer[k] = l;
        }
    }
    size_t C = (size_t)c.channels;
    ExportCtx x = {&c, params, tensor, layer, (float*)malloc_or_die(4 * C * C * sizeof(float), "a transpose buffer")};
    const char* mk[] = {"format"};
    const char* mv[] = {"pt"};
    st_write_file(out, wt, n, mk, mv, 1, emit_tensor, &x);
    char config_path[1100];
    sibling_path(out, "config.json", config_path, sizeof(config_path));
    write_config_json(config_path, &c);
    printf("exported '%s' -> '%s' and '%s': L=%d C=%d NH=%d V=%d maxT=%d\n", in, out, config_path,
           c.num_layers, c.channels, c.num_heads, c.vocab_size, c.max_seq_len);
    free(x.tmp);
    free(wt);
    free(names);
    free(tensor);
    free(layer);
    free(params);
}

// --- info ------------------------------------------------------------------------------------

static void cmd_info(int argc, char** argv) {
    if (argc != 1) { fatal("info: expected one model.safetensors"); }
    StFile sf;
    st_open(&sf, argv[0]);
    printf("%s: %lld bytes, header %llu bytes, %zu tensors\n", argv[0], (long long)sf.file_size,
           (unsigned long long)sf.header_len, sf.num_tensors);
    for (size_t i = 0; i < sf.num_metadata; i++) {
        char pk[200], pv[200];
        printf("  __metadata__ %s = %s\n", st_printable(sf.metadata_keys[i], pk, sizeof(pk)),
               st_printable(sf.metadata_values[i], pv, sizeof(pv)));
    }
    for (size_t i = 0; i < sf.num_tensors; i++) {
        const StTensor* t = &sf.tensors[i];
        char shp[200], pr[200];
        shape_text(t, shp, sizeof(shp));
        printf("  %-40s %-7s %-22s [%llu, %llu)\n", st_printable(t->name, pr, sizeof(pr)),
               st_dtype_names[t->dtype], shp,
               (unsigned long long)t->begin, (unsigned long long)t->end);
    }
    st_close(&sf);
}

int main(int argc, char** argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) { usage_exit(); }
    if (strcmp(argv[1], "import") == 0) { cmd_import(argc - 2, argv + 2); }
    else if (strcmp(argv[1], "export") == 0) { cmd_export(argc - 2, argv + 2); }
    else if (strcmp(argv[1], "info") == 0) { cmd_info(argc - 2, argv + 2); }
    else {
        fatal("unknown command '%s' (usage: gpt2_weights import|export|info ...; see --help)", argv[1]);
    }
    return 0;
}
