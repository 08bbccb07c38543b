/*
 * model.h: GPT-2's configuration and parameter layout, shared by every build and tool.
 *
 * Two orders of the same 16 parameter tensors exist:
 *  - FILE order (llm.c's checkpoint): tensor-major. wte, wpe, then ln1w of all L layers, ln1b
 *    of all layers, ..., fcprojb of all layers, then lnfw, lnfb.
 *  - MEMORY order (the flat buffer every build trains on): layer-major. wte, wpe, then the
 *    12 tensors of layer 0, the 12 of layer 1, ..., then lnfw, lnfb. A layer is one
 *    contiguous block, which is what pipeline stages and ZeRO-3 gather units want.
 * The canonical flat index of a parameter is its MEMORY-order index; optimizer state files
 * and ZeRO shards are defined on it.
 *
 * A mixture-of-experts model (num_experts E > 0, llmc/moe.h) has a router weight routerw
 * (E,C) after ln2b in every layer, and E experts in place of the MLP: fcw, fcb, fcprojw and
 * fcprojb hold the E experts' tensors one after the other (fcw (E,4C,C), fcb (E,4C), fcprojw
 * (E,C,4C), fcprojb (E,C)). The dense model's routerw has 0 elements, so its layout, files and
 * offsets are GPT-2's, unchanged.
 */
#ifndef LLMC_MODEL_H
#define LLMC_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int max_seq_len;        // maxT: positions in wpe
    int vocab_size;         // V: real tokens (50257 for GPT-2)
    int padded_vocab_size;  // Vp: rows of wte, V rounded up (128 in llm.c), extra rows are 0
    int num_layers;         // L
    int num_heads;          // NH
    int channels;           // C
    int num_experts;        // E: experts per layer (mixture of experts); 0 = GPT-2's dense MLP
    int top_k;              // k: experts each position is routed to (0 for the dense model)
    float aux_loss_coef;    // alpha of the load-balancing loss: a training setting, not in files
} GPT2Config;

// P_ROUTERW comes last in the enumeration (the dense tensors keep llm.c's numbers) but sits
// between ln2b and fcw in both orders (param_file_order).
#define NUM_PARAMETER_TENSORS 17
enum {
    P_WTE, P_WPE, P_LN1W, P_LN1B, P_QKVW, P_QKVB, P_ATTPROJW, P_ATTPROJB,
    P_LN2W, P_LN2B, P_FCW, P_FCB, P_FCPROJW, P_FCPROJB, P_LNFW, P_LNFB, P_ROUTERW
};
#define NUM_LAYER_TENSORS 12   // the dense layer's P_LN1W .. P_FCPROJB (llm.c's 12)

static const char* const param_tensor_names[NUM_PARAMETER_TENSORS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb", "routerw"
};

// The tensors in FILE order; param_file_order[PARAM_LAYER_FIRST .. PARAM_LAYER_END) are a
// layer's tensors in MEMORY order.
static const int param_file_order[NUM_PARAMETER_TENSORS] = {
    P_WTE, P_WPE, P_LN1W, P_LN1B, P_QKVW, P_QKVB, P_ATTPROJW, P_ATTPROJB, P_LN2W, P_LN2B,
    P_ROUTERW, P_FCW, P_FCB, P_FCPROJW, P_FCPROJB, P_LNFW, P_LNFB
};
#define PARAM_LAYER_FIRST 2
#define PARAM_LAYER_END 15

static inline int param_is_layer_tensor(int t) { return (t >= P_LN1W && t <= P_FCPROJB) || t == P_ROUTERW; }

// The tensors made of one block per expert in a mixture-of-experts layer.
static inline int param_is_expert_tensor(int t) {
    return t == P_FCW || t == P_FCB || t == P_FCPROJW || t == P_FCPROJB;
}

// AdamW weight decay applies to the 2-D tensors only (llm.c / GPT-2 convention).
static inline int param_is_decayed(int t) {
    return t == P_WTE || t == P_WPE || t == P_QKVW || t == P_ATTPROJW || t == P_FCW || t == P_FCPROJW ||
           t == P_ROUTERW;
}

// Rows and columns of ONE expert's tensor t: the dense MLP's shapes (fcb is 1 x 4C).
static inline void param_expert_shape(const GPT2Config* c, int t, size_t* rows, size_t* cols) {
    size_t C = (size_t)c->channels;
    *rows = t == P_FCW ? 4 * C : t == P_FCPROJW ? C : 1;
    *cols = t == P_FCB || t == P_FCPROJW ? 4 * C : C;
}

// Rows and columns of tensor t (of ONE layer for layer tensors); 1-D tensors have rows = 1.
// Weights are stored like PyTorch's nn.Linear: [out_features][in_features]. The expert tensors
// of a mixture-of-experts layer stack the E experts' blocks along the rows.
static inline void param_shape(const GPT2Config* c, int t, size_t* rows, size_t* cols) {
    if (param_is_expert_tensor(t)) {
        param_expert_shape(c, t, rows, cols);
        *rows *= (size_t)(c->num_experts > 0 ? c->num_experts : 1);
        return;
    }
    size_t C = (size_t)c->channels;
    size_t r = 1, k = C;
    switch (t) {
        case P_WTE:      r = (size_t)c->padded_vocab_size; break;
        case P_WPE:      r = (size_t)c->max_seq_len; break;
        case P_QKVW:     r = 3 * C; break;
        case P_QKVB:     k = 3 * C; break;
        case P_ATTPROJW: r = C; break;
        case P_FCW:      r = 4 * C; break;
        case P_FCB:      k = 4 * C; break;
        case P_FCPROJW:  r = C; k = 4 * C; break;
        case P_ROUTERW:  r = (size_t)c->num_experts; break;
        default:         break;   // ln*w, ln*b, attprojb, fcprojb: 1 x C
    }
    *rows = r;
    *cols = k;
}

// Elements of tensor t in one layer (layer tensors) or in total (the others).
static inline size_t param_tensor_elements(const GPT2Config* c, int t) {
    size_t rows, cols;
    param_shape(c, t, &rows, &cols);
    return rows * cols;
}

static inline size_t param_layer_elements(const GPT2Config* c) {
    size_t n = 0;
    for (int i = PARAM_LAYER_FIRST; i < PARAM_LAYER_END; i++) { n += param_tensor_elements(c, param_file_order[i]); }
    return n;   // 12 C^2 + 13 C; with E experts 4 C^2 + 9 C + E C + E (8 C^2 + 5 C)
}

// Elements of one expert of one layer (fcw, fcb, fcprojw, fcprojb): 8 C^2 + 5 C.
static inline size_t param_expert_elements(const GPT2Config* c) {
    return 8 * (size_t)c->channels * c->channels + 5 * (size_t)c->channels;
}

static inline size_t param_count(const GPT2Config* c) {
    return param_tensor_elements(c, P_WTE) + param_tensor_elements(c, P_WPE)
         + (size_t)c->num_layers * param_layer_elements(c)
         + param_tensor_elements(c, P_LNFW) + param_tensor_elements(c, P_LNFB);
}

// MEMORY-order offset of tensor t (of layer `layer` for layer tensors; ignored otherwise).
static inline size_t param_offset(const GPT2Config* c, int t, int layer) {
    size_t head = param_tensor_elements(c, P_WTE) + param_tensor_elements(c, P_WPE);
    if (t == P_WTE) { return 0; }
    if (t == P_WPE) { return param_tensor_elements(c, P_WTE); }
    if (param_is_layer_tensor(t)) {
        size_t off = head + (size_t)layer * param_layer_elements(c);
        for (int i = PARAM_LAYER_FIRST; param_file_order[i] != t; i++) { off += param_tensor_elements(c, param_file_order[i]); }
        return off;
    }
    size_t off = head + (size_t)c->num_layers * param_layer_elements(c);
    return t == P_LNFW ? off : off + param_tensor_elements(c, P_LNFW);
}

// The tensor and layer (0 for the tensors outside the layers) holding MEMORY-order index i.
static inline void param_locate(const GPT2Config* c, size_t i, int* tensor, int* layer) {
    for (int t = 0; t < NUM_PARAMETER_TENSORS; t++) {
        int layers = param_is_layer_tensor(t) ? c->num_layers : 1;
        for (int l = 0; l < layers; l++) {
            size_t off = param_offset(c, t, l);
            if (i >= off && i < off + param_tensor_elements(c, t)) { *tensor = t; *layer = l; return; }
        }
    }
    *tensor = 0;
    *layer = -1;
}

// Calls fn(tensor, layer, memory_offset, elements, ctx) for every tensor piece in FILE order:
// the order in which llm.c's checkpoint stores them.
typedef void (*ParamPieceFn)(int tensor, int layer, size_t offset, size_t elements, void* ctx);
static inline void param_for_each_in_file_order(const GPT2Config* c, ParamPieceFn fn, void* ctx) {
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        int t = param_file_order[i];
        int layers = param_is_layer_tensor(t) ? c->num_layers : 1;
        for (int l = 0; l < layers; l++) {
            fn(t, l, param_offset(c, t, l), param_tensor_elements(c, t), ctx);
        }
    }
}

// Named views of one transformer layer's parameters (or gradients): this rank's pieces of a
// layer unit (train_gpt2.c layer_unit).
typedef struct {
    float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb;
    float *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
    float* routerw;   // mixture of experts: the router (E,C); fcw .. fcprojb NULL (the experts are their
                      // own unit, train_gpt2.c ExpertTensors)
} LayerTensors;

// llm.c pads the vocabulary to a multiple of 128 (GPU-friendly tiles; also divisible by any
// tensor-parallel degree up to 128).
static inline int padded_vocab(int V) { return (V + 127) / 128 * 128; }

// Checks a configuration read from a file or a descriptor; returns NULL or what is wrong.
static inline const char* config_problem(const GPT2Config* c) {
    if (c->num_layers < 1 || c->num_layers > 4096) { return "num_layers L must be in 1..4096"; }
    if (c->channels < 1 || c->channels > 65536) { return "channels C must be in 1..65536"; }
    if (c->num_heads < 1 || c->channels % c->num_heads != 0) {
        return "num_heads NH must be >= 1 and divide channels C";
    }
    if (c->vocab_size < 1 || c->vocab_size > 65536) {
        return "vocab_size V must be in 1..65536 (token files store uint16 ids)";
    }
    if (c->padded_vocab_size < c->vocab_size || c->padded_vocab_size > 1 << 20) {
        return "padded_vocab_size Vp must be >= V (and at most 2^20)";
    }
    if (c->max_seq_len < 1 || c->max_seq_len > 1 << 20) { return "max_seq_len must be in 1..2^20"; }
    if (c->num_experts < 0 || c->num_experts > 4096) { return "num_experts E must be in 0..4096"; }
    if (c->num_experts == 0 && c->top_k != 0) { return "top_k k must be 0 without experts"; }
    if (c->num_experts > 0 && (c->top_k < 1 || c->top_k > c->num_experts)) {
        return "top_k k must be in 1..E (the number of experts)";
    }
    return NULL;
}

// Parameters one position's forward uses: all of them for the dense model; with E experts,
// k of each layer's E experts.
static inline size_t param_active_count(const GPT2Config* c) {
    size_t unused = c->num_experts > 0 ? (size_t)(c->num_experts - c->top_k) * param_expert_elements(c) : 0;
    return param_count(c) - (size_t)c->num_layers * unused;
}

// Parses a model descriptor "dN[cC][hNH][vV][tMAXT][eE][kK]" (e.g. "d12", "d2c64h4v512t32",
// "d4c64h4v512t32e8k2"): a fresh GPT-2 of depth N. Without c/h the width follows GPT-2's
// family (d6 384/6, d12 768/12, d24 1024/16, d36 1280/20, d48 1600/25) and otherwise 64*N
// channels with 64-wide heads; V defaults to 50257 (Vp padded to 128), maxT to 1024. eE: a
// mixture of E experts per layer, each position routed to k of them (kK, default min(2, E)).
// Returns 0 if `s` is not of this form.
static inline int config_from_descriptor(const char* s, GPT2Config* out) {
    if (s[0] != 'd' || s[1] < '0' || s[1] > '9') { return 0; }
    long vals[7] = {0, 0, 0, 0, 0, 0, 0};   // d c h v t e k
    const char* keys = "dchvtek";
    const char* p = s;
    int seen = 0;
    while (*p) {
        const char* k = strchr(keys, *p);
        if (k == NULL || *k == '\0') { return 0; }
        int idx = (int)(k - keys);
        if (seen & (1 << idx)) { return 0; }
        seen |= 1 << idx;
        p++;
        if (*p < '0' || *p > '9') { return 0; }
        char* end;
        vals[idx] = strtol(p, &end, 10);
        if (vals[idx] <= 0 || vals[idx] > 1 << 24) { return 0; }
        p = end;
    }
    int L = (int)vals[0];
    int C, NH;
    switch (L) {
        case 6:  C = 384;  NH = 6;  break;
        case 12: C = 768;  NH = 12; break;
        case 24: C = 1024; NH = 16; break;
        case 36: C = 1280; NH = 20; break;
        case 48: C = 1600; NH = 25; break;
        default: C = 64 * L; NH = L; break;
    }
    if (vals[1]) { C = (int)vals[1]; NH = C % 64 == 0 ? C / 64 : 1; }
    if (vals[2]) { NH = (int)vals[2]; }
    out->num_layers = L;
    out->channels = C;
    out->num_heads = NH;
    out->vocab_size = vals[3] ? (int)vals[3] : 50257;
    out->padded_vocab_size = padded_vocab(out->vocab_size);
    out->max_seq_len = vals[4] ? (int)vals[4] : 1024;
    if (vals[6] && !vals[5]) { return 0; }   // k without experts
    out->num_experts = (int)vals[5];
    out->top_k = vals[6] ? (int)vals[6] : (vals[5] >= 2 ? 2 : (int)vals[5]);
    out->aux_loss_coef = 0.0f;
    return 1;
}

#endif // LLMC_MODEL_H
