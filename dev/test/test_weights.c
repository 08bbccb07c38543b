/*
 * test_weights: fixtures and checks for dev/test/test_weights.sh (GPT-2 safetensors import /
 * export, dev/tools/gpt2_weights). Deliberately independent of the code under test: it writes
 * safetensors files and reads llm.c checkpoints with its own code, straight from the format
 * definitions, and includes none of llmc/.
 *
 *   test_weights fixtures DIR     writes the fixtures (see main) and DIR/bad/cases.tsv
 *   test_weights check FILE.bin MODE   checks an imported checkpoint value by value
 *       MODE f32:  L=2 C=16 V=50 maxT=8 NH=4, every value distinct (a transposition or
 *                  layer mix-up is caught), F32
 *       MODE f16 / bf16: L=1 C=16 V=4096 maxT=8 NH=4; wte holds all 65536 bit patterns of
 *                  the dtype (exact conversion of every half / bfloat16, subnormals, inf,
 *                  NaN), the other tensors values exact in F16 and BF16
 *
 * Value of element `flat` (row-major index in GPT-2's layout) of tensor number ti (ti: 0 wte,
 * 1 wpe, 2 + 12 l + k the k-th tensor of layer l in GPT-2's order, then ln_f.weight/bias):
 *   f32:  (ti * 65536 + flat + 1) / 1024, negated when flat is odd
 *   half: m = ti * 65536 + flat: (1 + m % 255) * 2^((m / 255) % 16 - 8), negated when m % 3 == 0
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char* msg, const char* arg) {
    fprintf(stderr, "test_weights: %s %s\n", msg, arg ? arg : "");
    exit(2);
}

// ---- the model definition -------------------------------------------------------------------
static const char* const SUFFIX[12] = {
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"
};

// GPT-2's (Hugging Face's) shape of layer tensor k: Conv1D weights are [in][out].
static int hf_layer_shape(int k, uint64_t C, uint64_t* d) {
    switch (k) {
        case 2: d[0] = C; d[1] = 3 * C; return 2;
        case 3: d[0] = 3 * C; return 1;
        case 4: d[0] = C; d[1] = C; return 2;
        case 8: d[0] = C; d[1] = 4 * C; return 2;
        case 9: d[0] = 4 * C; return 1;
        case 10: d[0] = 4 * C; d[1] = C; return 2;
        default: d[0] = C; return 1;
    }
}

enum { MODE_F32, MODE_F16, MODE_BF16 };

// exactly representable value: sign * M * 2^e, M in 1..255, e in -8..7
static void half_value(uint64_t m, int* sign, int* M, int* e) {
    *M = 1 + (int)(m % 255);
    *e = (int)((m / 255) % 16) - 8;
    *sign = m % 3 == 0 ? -1 : 1;
}

static float value_f32(int mode, int ti, uint64_t flat) {
    if (mode == MODE_F32) {
        double v = (double)((uint64_t)ti * 65536 + flat + 1) / 1024.0;
        return (float)((flat & 1) ? -v : v);
    }
    int s, M, e;
    half_value((uint64_t)ti * 65536 + flat, &s, &M, &e);
    return (float)(s * ldexp(M, e));
}

static int top_bit(int M) { int p = 0; while ((M >> (p + 1)) != 0) { p++; } return p; }

static uint16_t value_f16_bits(int ti, uint64_t flat) {
    int s, M, e;
    half_value((uint64_t)ti * 65536 + flat, &s, &M, &e);
    int p = top_bit(M);
    uint16_t exp = (uint16_t)(p + e + 15), mant = (uint16_t)((M << (10 - p)) & 0x3ff);
    return (uint16_t)((s < 0 ? 0x8000 : 0) | (exp << 10) | mant);
}

static uint16_t value_bf16_bits(int ti, uint64_t flat) {
    int s, M, e;
    half_value((uint64_t)ti * 65536 + flat, &s, &M, &e);
    int p = top_bit(M);
    uint16_t exp = (uint16_t)(p + e + 127), mant = (uint16_t)((M << (7 - p)) & 0x7f);
    return (uint16_t)((s < 0 ? 0x8000 : 0) | (exp << 7) | mant);
}

// Reference decoders from the IEEE definitions (NaN: returns NAN with the sign, *is_nan = 1).
static float ref_f16(uint16_t b, int* is_nan) {
    int s = b >> 15, exp = (b >> 10) & 31, mant = b & 1023;
    double v;
    *is_nan = 0;
    if (exp == 31) {
        if (mant) { *is_nan = 1; return s ? -NAN : NAN; }
        v = INFINITY;
    } else if (exp == 0) { v = ldexp(mant, -24); }
    else { v = ldexp(1024 + mant, exp - 25); }
    return (float)(s ? -v : v);
}

static float ref_bf16(uint16_t b, int* is_nan) {
    int s = b >> 15, exp = (b >> 7) & 255, mant = b & 127;
    double v;
    *is_nan = 0;
    if (exp == 255) {
        if (mant) { *is_nan = 1; return s ? -NAN : NAN; }
        v = INFINITY;
    } else if (exp == 0) { v = ldexp(mant, -133); }
    else { v = ldexp(128 + mant, exp - 134); }
    return (float)(s ? -v : v);
}

// ---- fixture tensors --------------------------------------------------------------------------
typedef struct {
    char name[128];
    char dtype[16];
    int rank;
    uint64_t shape[4];
    unsigned char* data;
    uint64_t nbytes;
    uint64_t begin, end;   // assigned by layout()
} Fx;

typedef struct {
    Fx t[256];
    int n;
} FxSet;

static Fx* fx_add(FxSet* s, const char* name, const char* dtype, int rank, const uint64_t* shape) {
    if (s->n == 256) { die("too many fixture tensors", NULL); }
    Fx* t = &s->t[s->n++];
    memset(t, 0, sizeof(*t));
    snprintf(t->name, sizeof(t->name), "%s", name);
    snprintf(t->dtype, sizeof(t->dtype), "%s", dtype);
    t->rank = rank;
    uint64_t numel = 1;
    for (int i = 0; i < rank; i++) { t->shape[i] = shape[i]; numel *= shape[i]; }
    int es = strcmp(dtype, "F32") == 0 || strcmp(dtype, "I32") == 0 ? 4 : strcmp(dtype, "BOOL") == 0 ? 1 : 2;
    t->nbytes = numel * (uint64_t)es;
    t->data = (unsigned char*)calloc(t->nbytes ? t->nbytes : 1, 1);
    if (!t->data) { die("out of memory", NULL); }
    return t;
}

static int fx_find(FxSet* s, const char* name) {
    for (int i = 0; i < s->n; i++) { if (strcmp(s->t[i].name, name) == 0) { return i; } }
    die("no fixture tensor", name);
    return -1;
}

static void fx_remove(FxSet* s, const char* name) {
    int i = fx_find(s, name);
    free(s->t[i].data);
    memmove(&s->t[i], &s->t[i + 1], (size_t)(s->n - i - 1) * sizeof(Fx));
    s->n--;
}

// dtype per tensor number: "F32", "F16", "BF16"
typedef const char* (*DtypeOf)(int ti, int mode);
static const char* dtype_all(int ti, int mode) {
    return mode == MODE_F32 ? "F32" : mode == MODE_F16 ? "F16" : "BF16";
}
// the f16 fixture mixes dtypes: wpe BF16, ln_f.bias F32, the rest F16
static int g_num_tensors;
static const char* dtype_mixed(int ti, int mode) {
    if (mode != MODE_F16) { return dtype_all(ti, mode); }
    if (ti == 1) { return "BF16"; }
    if (ti == g_num_tensors - 1) { return "F32"; }
    return "F16";
}

static void fill(Fx* t, int ti, int mode, int wte_patterns) {
    uint64_t numel = 1;
    for (int i = 0; i < t->rank; i++) { numel *= t->shape[i]; }
    for (uint64_t f = 0; f < numel; f++) {
        if (strcmp(t->dtype, "F32") == 0) {
            float v = value_f32(mode, ti, f);
            memcpy(t->data + 4 * f, &v, 4);
        } else {
            uint16_t b;
            if (wte_patterns && ti == 0) { b = (uint16_t)f; }
            else if (strcmp(t->dtype, "F16") == 0) { b = value_f16_bits(ti, f); }
            else { b = value_bf16_bits(ti, f); }
            t->data[2 * f] = (unsigned char)(b & 0xff);
            t->data[2 * f + 1] = (unsigned char)(b >> 8);
        }
    }
}

// A GPT-2 model in GPT-2's tensor order (ti order), names prefixed with `prefix`.
static void make_model(FxSet* s, int L, uint64_t C, uint64_t V, uint64_t T, int mode,
                       DtypeOf dt, const char* prefix, int zeros) {
    s->n = 0;
    g_num_tensors = 4 + 12 * L;
    char name[128];
    uint64_t d[2];
    int ti = 0;
    Fx* t;
    snprintf(name, sizeof(name), "%swte.weight", prefix);
    d[0] = V; d[1] = C;
    t = fx_add(s, name, dt(ti, mode), 2, d);
    if (!zeros) { fill(t, ti, mode, mode != MODE_F32); }
    ti++;
    snprintf(name, sizeof(name), "%swpe.weight", prefix);
    d[0] = T; d[1] = C;
    t = fx_add(s, name, dt(ti, mode), 2, d);
    if (!zeros) { fill(t, ti, mode, 0); }
    ti++;
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < 12; k++, ti++) {
            snprintf(name, sizeof(name), "%sh.%d.%s", prefix, l, SUFFIX[k]);
            int r = hf_layer_shape(k, C, d);
            t = fx_add(s, name, dt(ti, mode), r, d);
            if (!zeros) { fill(t, ti, mode, 0); }
        }
    }
    d[0] = C;
    snprintf(name, sizeof(name), "%sln_f.weight", prefix);
    t = fx_add(s, name, dt(ti, mode), 1, d);
    if (!zeros) { fill(t, ti, mode, 0); }
    ti++;
    snprintf(name, sizeof(name), "%sln_f.bias", prefix);
    t = fx_add(s, name, dt(ti, mode), 1, d);
    if (!zeros) { fill(t, ti, mode, 0); }
}

// ---- writing safetensors (our own, from the spec) ---------------------------------------------
typedef struct { char* p; size_t len, cap; } Str;
static void sadd(Str* s, const char* x, size_t n) {
    if (s->len + n + 1 > s->cap) {
        s->cap = (s->len + n + 1) * 2;
        s->p = (char*)realloc(s->p, s->cap);
        if (!s->p) { die("out of memory", NULL); }
    }
    memcpy(s->p + s->len, x, n);
    s->len += n;
    s->p[s->len] = '\0';
}
static void sputs(Str* s, const char* x) { sadd(s, x, strlen(x)); }
static void add_dim(Str* s, const char* sep, uint64_t v) {
    char tmp[64];
    snprintf(tmp, sizeof(tmp), "%s%llu", sep, (unsigned long long)v);
    sputs(s, tmp);
}
static void add_offsets(Str* s, const char* fmt, uint64_t a, uint64_t b) {
    char tmp[128];
    snprintf(tmp, sizeof(tmp), fmt, (unsigned long long)a, (unsigned long long)b);
    sputs(s, tmp);
}

static int cmp_name(const void* a, const void* b) {
    return strcmp(((const Fx*)a)->name, ((const Fx*)b)->name);
}

// Data laid out in the set's order, no gaps.
static void layout(FxSet* s) {
    uint64_t off = 0;
    for (int i = 0; i < s->n; i++) {
        s->t[i].begin = off;
        off += s->t[i].nbytes;
        s->t[i].end = off;
    }
}

// The header JSON for the set, in the set's order. pretty: spaces and newlines between tokens.
static Str header_json(FxSet* s, int metadata, int pretty) {
    Str h = {0};
    const char* sep = pretty ? ", \n  " : ",";
    sputs(&h, pretty ? "{\n  " : "{");
    int comma = 0;
    if (metadata) { sputs(&h, pretty ? "\"__metadata__\" : { \"format\" : \"pt\" }" : "\"__metadata__\":{\"format\":\"pt\"}"); comma = 1; }
    for (int i = 0; i < s->n; i++) {
        Fx* t = &s->t[i];
        if (comma) { sputs(&h, sep); }
        comma = 1;
        sputs(&h, "\"");
        sputs(&h, t->name);
        sputs(&h, pretty ? "\": {\"shape\": [" : "\":{\"dtype\":\"");
        if (pretty) {   // a different key order
            for (int d = 0; d < t->rank; d++) { add_dim(&h, d ? ", " : "", t->shape[d]); }
            add_offsets(&h, "], \"data_offsets\": [%llu, %llu], \"dtype\": \"", t->begin, t->end);
            sputs(&h, t->dtype);
            sputs(&h, "\"}");
        } else {
            sputs(&h, t->dtype);
            sputs(&h, "\",\"shape\":[");
            for (int d = 0; d < t->rank; d++) { add_dim(&h, d ? "," : "", t->shape[d]); }
            add_offsets(&h, "],\"data_offsets\":[%llu,%llu]}", t->begin, t->end);
        }
    }
    sputs(&h, pretty ? "\n}\n" : "}");
    return h;
}

static void pad8(Str* h) { while (h->len % 8) { sputs(h, " "); } }

// Writes 8-byte length (or len_override when != UINT64_MAX), header, then the tensors' data
// in the given order (by their begin offsets), then `extra` zero bytes; cut to `cut` bytes
// if cut != UINT64_MAX.
static void write_file(const char* path, const Str* h, FxSet* s, uint64_t len_override,
                       uint64_t extra, uint64_t cut) {
    uint64_t data_len = 0;
    for (int i = 0; i < s->n; i++) { if (s->t[i].end > data_len) { data_len = s->t[i].end; } }
    data_len += extra;
    uint64_t total = 8 + h->len + data_len;
    unsigned char* buf = (unsigned char*)calloc(total, 1);
    if (!buf) { die("out of memory", NULL); }
    uint64_t N = len_override != UINT64_MAX ? len_override : (uint64_t)h->len;
    for (int i = 0; i < 8; i++) { buf[i] = (unsigned char)(N >> (8 * i)); }
    memcpy(buf + 8, h->p, h->len);
    for (int i = 0; i < s->n; i++) {
        Fx* t = &s->t[i];
        if (t->end - t->begin == t->nbytes && t->end <= data_len) {
            memcpy(buf + 8 + h->len + t->begin, t->data, t->nbytes);
        }
    }
    if (cut != UINT64_MAX && cut < total) { total = cut; }
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, total, f) != total || fclose(f) != 0) { die("cannot write", path); }
    free(buf);
}

// The canonical form (what our exporter must produce): names sorted, data in that order,
// compact JSON with __metadata__ {"format":"pt"} first, header padded with spaces to 8.
static void write_canonical(const char* path, FxSet* s) {
    qsort(s->t, (size_t)s->n, sizeof(Fx), cmp_name);
    layout(s);
    Str h = header_json(s, 1, 0);
    pad8(&h);
    write_file(path, &h, s, UINT64_MAX, 0, UINT64_MAX);
    free(h.p);
}

static void write_text(const char* path, const char* text) {
    FILE* f = fopen(path, "wb");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) { die("cannot write", path); }
}

// Replaces the first occurrence of `from` in h by `to`; dies if absent.
static void replace(Str* h, const char* from, const char* to) {
    char* at = strstr(h->p, from);
    if (!at) { die("fixture: pattern not found:", from); }
    size_t pre = (size_t)(at - h->p), fl = strlen(from);
    Str r = {0};
    sadd(&r, h->p, pre);
    sputs(&r, to);
    sputs(&r, at + fl);
    free(h->p);
    *h = r;
}

static void free_set(FxSet* s) {
    for (int i = 0; i < s->n; i++) { free(s->t[i].data); }
    s->n = 0;
}

// ---- the corrupted variants -------------------------------------------------------------------
static FILE* g_cases;
static const char* g_dir;

static void tiny_model(FxSet* s) {
    make_model(s, 2, 16, 50, 8, MODE_F32, dtype_all, "", 0);
    qsort(s->t, (size_t)s->n, sizeof(Fx), cmp_name);
    layout(s);
}

static void bad_case(const char* name, const char* keyword, const char* args) {
    fprintf(g_cases, "%s/bad/%s.safetensors\t%s\t%s\n", g_dir, name, keyword, args);
}

static void bad_path(char* out, size_t cap, const char* name) {
    snprintf(out, cap, "%s/bad/%s.safetensors", g_dir, name);
}

// A header edit of the canonical tiny model (text replacement), keeping its data.
static void bad_edit(const char* name, const char* keyword, const char* from, const char* to) {
    FxSet s;
    tiny_model(&s);
    Str h = header_json(&s, 1, 0);
    replace(&h, from, to);
    pad8(&h);
    char path[1024];
    bad_path(path, sizeof(path), name);
    write_file(path, &h, &s, UINT64_MAX, 0, UINT64_MAX);
    bad_case(name, keyword, "--heads 4");
    free(h.p);
    free_set(&s);
}

static void make_bad_cases(void) {
    char path[1024];
    FxSet s;
    Str h;

    // the file itself
    tiny_model(&s);
    h = header_json(&s, 1, 0);
    pad8(&h);
    bad_path(path, sizeof(path), "truncated");
    write_file(path, &h, &s, UINT64_MAX, 0, 8 + h.len + s.t[s.n - 1].end - 7);
    bad_case("truncated", "truncated", "--heads 4");
    bad_path(path, sizeof(path), "tiny");
    write_file(path, &h, &s, UINT64_MAX, 0, 5);
    bad_case("tiny", "truncated", "--heads 4");
    bad_path(path, sizeof(path), "header_too_long");
    write_file(path, &h, &s, h.len + s.t[s.n - 1].end + 1, 0, UINT64_MAX);
    bad_case("header_too_long", "header length", "--heads 4");
    bad_path(path, sizeof(path), "header_huge");
    write_file(path, &h, &s, (uint64_t)1 << 63, 0, UINT64_MAX);
    bad_case("header_huge", "header length", "--heads 4");
    bad_path(path, sizeof(path), "header_zero");
    write_file(path, &h, &s, 0, 0, UINT64_MAX);
    bad_case("header_zero", "header length", "--heads 4");
    bad_path(path, sizeof(path), "trailing_bytes");
    write_file(path, &h, &s, UINT64_MAX, 8, UINT64_MAX);
    bad_case("trailing_bytes", "cover the data buffer", "--heads 4");
    free(h.p);

    // offsets
    int w = fx_find(&s, "wpe.weight");
    s.t[w].begin -= 4; s.t[w].end -= 4;
    h = header_json(&s, 1, 0); pad8(&h);
    bad_path(path, sizeof(path), "overlap");
    write_file(path, &h, &s, UINT64_MAX, 0, UINT64_MAX);
    bad_case("overlap", "overlap", "--heads 4");
    free(h.p);
    s.t[w].begin += 4; s.t[w].end += 4;
    int last = 0;
    for (int i = 0; i < s.n; i++) { if (s.t[i].end > s.t[last].end) { last = i; } }
    uint64_t data_len = s.t[last].end;
    s.t[last].begin += 4; s.t[last].end += 4;
    h = header_json(&s, 1, 0); pad8(&h);
    bad_path(path, sizeof(path), "past_end");
    write_file(path, &h, &s, UINT64_MAX, 0, 8 + h.len + data_len);   // the file keeps its size
    bad_case("past_end", "past the end", "--heads 4");
    free(h.p);
    s.t[last].begin -= 4; s.t[last].end -= 4;
    for (int i = 1; i < s.n; i++) { s.t[i].begin += 16; s.t[i].end += 16; }
    h = header_json(&s, 1, 0); pad8(&h);
    bad_path(path, sizeof(path), "hole");
    write_file(path, &h, &s, UINT64_MAX, 0, UINT64_MAX);
    bad_case("hole", "hole", "--heads 4");
    free(h.p);
    free_set(&s);

    // missing and unexpected tensors, wrong shapes
    tiny_model(&s);
    fx_remove(&s, "ln_f.bias");
    bad_path(path, sizeof(path), "missing_lnf");
    write_canonical(path, &s);
    bad_case("missing_lnf", "missing tensor 'ln_f.bias'", "--heads 4");
    free_set(&s);
    tiny_model(&s);
    fx_remove(&s, "h.1.mlp.c_fc.bias");
    bad_path(path, sizeof(path), "missing_layer");
    write_canonical(path, &s);
    bad_case("missing_layer", "missing tensor 'h.1.mlp.c_fc.bias'", "--heads 4");
    free_set(&s);
    tiny_model(&s);
    uint64_t one = 1;
    fx_add(&s, "foo.weight", "F32", 1, &one);
    bad_path(path, sizeof(path), "unknown_tensor");
    write_canonical(path, &s);
    bad_case("unknown_tensor", "unexpected tensor 'foo.weight'", "--heads 4");
    free_set(&s);
    tiny_model(&s);
    { uint64_t d[2] = {16, 16}; fx_add(&s, "transformer.wte.weight", "F32", 2, d); }
    bad_path(path, sizeof(path), "prefix_duplicate");
    write_canonical(path, &s);
    bad_case("prefix_duplicate", "duplicate", "--heads 4");
    free_set(&s);
    tiny_model(&s);
    w = fx_find(&s, "wpe.weight");
    s.t[w].shape[1] = 12; s.t[w].nbytes = 8 * 12 * 4;
    bad_path(path, sizeof(path), "wrong_shape_wpe");
    write_canonical(path, &s);
    bad_case("wrong_shape_wpe", "shape", "--heads 4");
    free_set(&s);
    tiny_model(&s);
    w = fx_find(&s, "h.1.attn.c_attn.weight");   // nn.Linear layout: same bytes, wrong shape
    s.t[w].shape[0] = 48; s.t[w].shape[1] = 16;
    bad_path(path, sizeof(path), "linear_layout");
    write_canonical(path, &s);
    bad_case("linear_layout", "has shape \\[48, 16\\], expected \\[C, 3C\\]", "--heads 4");
    free_set(&s);
    tiny_model(&s);
    w = fx_find(&s, "wte.weight");
    snprintf(s.t[w].dtype, sizeof(s.t[w].dtype), "I32");
    bad_path(path, sizeof(path), "int_dtype");
    write_canonical(path, &s);
    bad_case("int_dtype", "dtype I32; expected F32, F16 or BF16", "--heads 4");
    free_set(&s);
    tiny_model(&s);
    { uint64_t d[4] = {1, 1, 8, 9}; fx_add(&s, "h.0.attn.bias", "F32", 4, d); }   // odd mask: warning only
    { uint64_t d[2] = {1, 1}; fx_add(&s, "h.2.attn.bias", "F32", 2, d); }          // layer 2 has no weights
    bad_path(path, sizeof(path), "mask_only_layer");
    write_canonical(path, &s);
    bad_case("mask_only_layer", "missing tensor 'h.2.ln_1.weight'", "--heads 4");
    free_set(&s);

    // header JSON and schema
    bad_edit("not_json", "JSON", "\"wpe.weight\":{", "\"wpe.weight\"{");
    bad_edit("trailing_comma", "JSON", "\"data_offsets\":[0,", "\"data_offsets\":[0,,");
    bad_edit("leading_space", "begin with", "{\"__metadata__\"", " {\"__metadata__\"");
    bad_edit("dup_key", "duplicate", "\"wpe.weight\":{", "\"ln_f.bias\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},\"wpe.weight\":{");
    bad_edit("dup_escaped_key", "duplicate", "\"wpe.weight\":{", "\"ln_f.bia\\u0073\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},\"wpe.weight\":{");
    bad_edit("dup_field", "duplicate key 'dtype'", "\"wpe.weight\":{\"dtype\":\"F32\",", "\"wpe.weight\":{\"dtype\":\"F32\",\"dtype\":\"F32\",");
    bad_edit("dup_metadata", "duplicate", "{\"format\":\"pt\"}", "{\"format\":\"pt\",\"format\":\"pt\"}");
    bad_edit("wrong_dtype_size", "wrong dtype", "\"wpe.weight\":{\"dtype\":\"F32\"", "\"wpe.weight\":{\"dtype\":\"F16\"");
    bad_edit("unknown_dtype", "unknown dtype 'F33'", "\"wpe.weight\":{\"dtype\":\"F32\"", "\"wpe.weight\":{\"dtype\":\"F33\"");
    bad_edit("negative_dim", "negative", "\"shape\":[8,16]", "\"shape\":[-8,16]");
    bad_edit("minus_zero_dim", "negative", "\"shape\":[8,16]", "\"shape\":[8,-0]");
    bad_edit("float_dim", "not an integer", "\"shape\":[8,16]", "\"shape\":[8.0,16]");
    bad_edit("exp_dim", "not an integer", "\"shape\":[8,16]", "\"shape\":[8,1.6e1]");
    bad_edit("string_dim", "must be a non-negative integer", "\"shape\":[8,16]", "\"shape\":[8,\"16\"]");
    bad_edit("leading_zero", "leading zero", "\"shape\":[8,16]", "\"shape\":[08,16]");
    bad_edit("huge_offset", "too large", "\"data_offsets\":[0,", "\"data_offsets\":[0,99999999999999999999999");
    bad_edit("offset_2_64", "too large", "\"data_offsets\":[0,", "\"data_offsets\":[0,18446744073709551616");
    bad_edit("shape_overflow", "overflow", "\"shape\":[8,16]", "\"shape\":[4294967296,4294967296,16]");
    bad_edit("begin_after_end", "begin > end", "\"data_offsets\":[0,", "\"data_offsets\":[9999999,");
    bad_edit("three_offsets", "data_offsets", "\"data_offsets\":[0,", "\"data_offsets\":[0,0,");
    bad_edit("one_offset", "data_offsets", "\"ln_f.bias\":{\"dtype\":\"F32\",\"shape\":[16],\"data_offsets\":[", "\"ln_f.bias\":{\"dtype\":\"F32\",\"shape\":[16],\"data_offsets\":[0],\"x\":[");
    bad_edit("unknown_field", "unknown field 'extra'", "\"wpe.weight\":{", "\"wpe.weight\":{\"extra\":1,");
    bad_edit("missing_field", "missing field 'dtype'", "\"wpe.weight\":{\"dtype\":\"F32\",", "\"wpe.weight\":{");
    bad_edit("not_an_entry", "expected an object", "\"format\":\"pt\"},", "\"format\":\"pt\"},\"x\":[],");
    bad_edit("metadata_not_string", "metadata", "{\"format\":\"pt\"}", "{\"format\":1}");
    bad_edit("bad_escape", "escape", "\"wpe.weight\"", "\"wpe\\x.weight\"");
    bad_edit("lone_surrogate", "surrogate", "\"wpe.weight\"", "\"\\ud800wpe.weight\"");
    bad_edit("nul_in_key", "u0000", "\"wpe.weight\"", "\"wpe\\u0000.weight\"");
    bad_edit("control_char", "control character", "\"wpe.weight\"", "\"wpe\n.weight\"");
    bad_edit("bad_utf8", "UTF-8", "\"wpe.weight\"", "\"wpe\xff.weight\"");
    bad_edit("overlong_utf8", "UTF-8", "\"wpe.weight\"", "\"wpe\xc0\xae" "weight\"");

    // nul_padding: the header padded with NUL bytes instead of spaces
    tiny_model(&s);
    h = header_json(&s, 1, 0);
    sadd(&h, "\0\0\0\0\0\0\0\0", 8 - h.len % 8);
    bad_path(path, sizeof(path), "nul_padding");
    write_file(path, &h, &s, UINT64_MAX, 0, UINT64_MAX);
    bad_case("nul_padding", "JSON", "--heads 4");
    free(h.p);
    // trailing_garbage: one 'x' after the closing brace
    h = header_json(&s, 1, 0);
    sputs(&h, "x");
    pad8(&h);
    bad_path(path, sizeof(path), "trailing_garbage");
    write_file(path, &h, &s, UINT64_MAX, 0, UINT64_MAX);
    bad_case("trailing_garbage", "trailing garbage", "--heads 4");
    free(h.p);
    free_set(&s);
}

// ---- fixtures -------------------------------------------------------------------------------
static void path_in(char* out, size_t cap, const char* name) { snprintf(out, cap, "%s/%s", g_dir, name); }

static const char* CONFIG_TINY =
    "{\n  \"activation_function\": \"gelu_new\",\n  \"architectures\": [\"GPT2LMHeadModel\"],\n"
    "  \"layer_norm_epsilon\": 1e-05,\n  \"n_ctx\": 8,\n  \"n_embd\": 16,\n  \"n_head\": 4,\n"
    "  \"n_inner\": null,\n  \"n_layer\": 2,\n  \"n_positions\": 8,\n"
    "  \"task_specific_params\": {\"text-generation\": {\"do_sample\": true, \"max_length\": 50}},\n"
    "  \"vocab_size\": 50\n}\n";

static void make_fixtures(void) {
    char path[1024], cmd[2048];
    FxSet s;
    snprintf(cmd, sizeof(cmd), "mkdir -p '%s/bad' '%s/hf' '%s/family'", g_dir, g_dir, g_dir);
    if (system(cmd) != 0) { die("cannot create", g_dir); }

    // canon.safetensors: what the exporter must reproduce byte for byte
    make_model(&s, 2, 16, 50, 8, MODE_F32, dtype_all, "", 0);
    path_in(path, sizeof(path), "canon.safetensors");
    write_canonical(path, &s);
    free_set(&s);

    // hf/model.safetensors: the same model the way a PyTorch state dict may hold it:
    // "transformer." prefix, mask buffers (BOOL [1,1,T,T] and a scalar masked_bias),
    // lm_head.weight tied to wte, header in GPT-2's order (not sorted) with whitespace and
    // another key order, no metadata, data in reverse order; config.json next to it.
    make_model(&s, 2, 16, 50, 8, MODE_F32, dtype_all, "transformer.", 0);
    {
        uint64_t d[4] = {1, 1, 8, 8};
        for (int l = 0; l < 2; l++) {
            char name[64];
            snprintf(name, sizeof(name), "transformer.h.%d.attn.bias", l);
            Fx* t = fx_add(&s, name, "BOOL", 4, d);
            for (int i = 0; i < 8; i++) { for (int j = 0; j <= i; j++) { t->data[i * 8 + j] = 1; } }
            snprintf(name, sizeof(name), "transformer.h.%d.attn.masked_bias", l);
            t = fx_add(&s, name, "F32", 0, d);
            float m = -1e4f;
            memcpy(t->data, &m, 4);
        }
        uint64_t dw[2] = {50, 16};
        Fx* head = fx_add(&s, "lm_head.weight", "F32", 2, dw);
        memcpy(head->data, s.t[0].data, head->nbytes);
        uint64_t off = 0;
        for (int i = s.n - 1; i >= 0; i--) { s.t[i].begin = off; off += s.t[i].nbytes; s.t[i].end = off; }
        Str h = header_json(&s, 0, 1);
        path_in(path, sizeof(path), "hf/model.safetensors");
        write_file(path, &h, &s, UINT64_MAX, 0, UINT64_MAX);
        free(h.p);
        path_in(path, sizeof(path), "hf/config.json");
        write_text(path, CONFIG_TINY);
        // the same with an untied lm_head: a warning, same checkpoint
        float* hv = (float*)head->data;
        hv[17] += 1.0f;
        h = header_json(&s, 0, 1);
        path_in(path, sizeof(path), "untied.safetensors");
        write_file(path, &h, &s, UINT64_MAX, 0, UINT64_MAX);
        free(h.p);
    }
    free_set(&s);

    // f16 (mixed: wpe BF16, ln_f.bias F32) and bf16 models with every bit pattern in wte
    make_model(&s, 1, 16, 4096, 8, MODE_F16, dtype_mixed, "", 0);
    path_in(path, sizeof(path), "f16.safetensors");
    write_canonical(path, &s);
    free_set(&s);
    make_model(&s, 1, 16, 4096, 8, MODE_BF16, dtype_all, "", 0);
    path_in(path, sizeof(path), "bf16.safetensors");
    write_canonical(path, &s);
    free_set(&s);

    // family/model.safetensors: C=768 (GPT-2 small's width): NH=12 from the family table
    make_model(&s, 1, 768, 1, 1, MODE_F32, dtype_all, "", 1);
    path_in(path, sizeof(path), "family/model.safetensors");
    write_canonical(path, &s);
    free_set(&s);

    // config files
    path_in(path, sizeof(path), "config_deep.json");
    {
        Str t = {0};
        sputs(&t, "{\"n_head\": 4, \"x\": ");
        for (int i = 0; i < 5000; i++) { sputs(&t, "["); }
        for (int i = 0; i < 5000; i++) { sputs(&t, "]"); }
        sputs(&t, "}");
        write_text(path, t.p);
        free(t.p);
    }
    path_in(path, sizeof(path), "config_other.json");
    write_text(path, "{\"n_embd\": 32, \"n_head\": 4, \"n_layer\": 2}");
    path_in(path, sizeof(path), "config_dup.json");
    write_text(path, "{\"n_head\": 4, \"n_head\": 2}");
    path_in(path, sizeof(path), "config_float.json");
    write_text(path, "{\"n_head\": 4.0}");
    path_in(path, sizeof(path), "config_bad.json");
    write_text(path, "{\"n_head\": 4,}");
    path_in(path, sizeof(path), "config_heads3.json");
    write_text(path, "{\"n_head\": 3}");

    // corrupted variants, listed in bad/cases.tsv: file, expected message (grep -E), args
    path_in(path, sizeof(path), "bad/cases.tsv");
    g_cases = fopen(path, "w");
    if (!g_cases) { die("cannot write", path); }
    make_bad_cases();
    char canon[1024];
    path_in(canon, sizeof(canon), "canon.safetensors");
    fprintf(g_cases, "%s\tconfig_deep\\.json.*nested too deeply\t--config %s/config_deep.json\n", canon, g_dir);
    fprintf(g_cases, "%s\tn_embd=32.*another model\t--config %s/config_other.json\n", canon, g_dir);
    fprintf(g_cases, "%s\tduplicate key 'n_head'\t--config %s/config_dup.json\n", canon, g_dir);
    fprintf(g_cases, "%s\tn_head.*non-negative integer\t--config %s/config_float.json\n", canon, g_dir);
    fprintf(g_cases, "%s\tconfig_bad\\.json.*JSON\t--config %s/config_bad.json\n", canon, g_dir);
    fprintf(g_cases, "%s\tNH=3.*divide\t--config %s/config_heads3.json\n", canon, g_dir);
    fprintf(g_cases, "%s\t--heads\t\n", canon);
    fprintf(g_cases, "%s\tdivide\t--heads 5\n", canon);
    fprintf(g_cases, "%s\t--heads\t--heads 0\n", canon);
    fprintf(g_cases, "%s\t--heads\t--heads 4x\n", canon);
    fprintf(g_cases, "%s\tcannot open\t--heads 4 --config %s/no_such.json\n", canon, g_dir);
    fprintf(g_cases, "%s/no_such.safetensors\tcannot open\t--heads 4\n", g_dir);
    fclose(g_cases);
}

// ---- checking an imported checkpoint ---------------------------------------------------------
static int check(const char* path, int mode) {
    int L = mode == MODE_F32 ? 2 : 1, C = 16, V = mode == MODE_F32 ? 50 : 4096, T = 8, NH = 4;
    int Vp = (V + 127) / 128 * 128;
    FILE* f = fopen(path, "rb");
    if (!f) { die("cannot open", path); }
    int hdr[256];
    if (fread(hdr, 4, 256, f) != 256) { die("short checkpoint", path); }
    int want[8] = {20240326, 3, T, V, L, NH, C, Vp};
    const char* what[8] = {"magic", "version", "maxT", "V", "L", "NH", "C", "Vp"};
    int bad = 0;
    for (int i = 0; i < 8; i++) {
        if (hdr[i] != want[i]) { fprintf(stderr, "header %s = %d, expected %d\n", what[i], hdr[i], want[i]); bad++; }
    }
    for (int i = 8; i < 256; i++) { if (hdr[i] != 0) { fprintf(stderr, "header[%d] = %d, expected 0\n", i, hdr[i]); bad++; } }
    if (bad) { return 1; }
    // FILE order: wte [Vp][C], wpe [T][C], then each layer tensor for all layers, lnfw, lnfb.
    // Ours (llm.c) is nn.Linear [out][in]: qkvw [3C][C], attprojw [C][C], fcw [4C][C],
    // fcprojw [C][4C]; GPT-2's Conv1D stores [in][out], so ours[r][c] = GPT-2's[c][r].
    long checked = 0, nan_checked = 0;
    uint64_t mismatches = 0;
    for (int part = 0; part < 16; part++) {
        int layers = part >= 2 && part < 14 ? L : 1;
        for (int l = 0; l < layers; l++) {
            int k = part - 2;   // layer tensor index in GPT-2's order (== ours)
            int rows, cols, transposed = 0, ti;
            if (part == 0) { rows = Vp; cols = C; ti = 0; }
            else if (part == 1) { rows = T; cols = C; ti = 1; }
            else if (part == 14 || part == 15) { rows = 1; cols = C; ti = 2 + 12 * L + (part - 14); }
            else {
                ti = 2 + 12 * l + k;
                uint64_t d[2];
                int r = hf_layer_shape(k, (uint64_t)C, d);
                if (r == 1) { rows = 1; cols = (int)d[0]; }
                else { rows = (int)d[1]; cols = (int)d[0]; transposed = 1; }   // ours [out][in]
            }
            for (int r = 0; r < rows; r++) {
                for (int c = 0; c < cols; c++) {
                    float got;
                    if (fread(&got, 4, 1, f) != 1) { die("checkpoint too short:", path); }
                    uint64_t flat = transposed ? (uint64_t)c * (uint64_t)rows + (uint64_t)r
                                               : (uint64_t)r * (uint64_t)cols + (uint64_t)c;
                    float exp;
                    int is_nan = 0;
                    if (part == 0 && r >= V) { exp = 0.0f; }
                    else if (part == 0 && mode == MODE_F16) { exp = ref_f16((uint16_t)flat, &is_nan); }
                    else if (part == 0 && mode == MODE_BF16) { exp = ref_bf16((uint16_t)flat, &is_nan); }
                    else { exp = value_f32(mode, ti, flat); }
                    int ok;
                    if (is_nan) { ok = isnan(got) && signbit(got) == signbit(exp); nan_checked++; }
                    else { ok = memcmp(&got, &exp, 4) == 0; }
                    if (!ok) {
                        if (mismatches < 10) {
                            fprintf(stderr, "%s: part %d layer %d [%d][%d]: got %.9g, expected %.9g\n",
                                    path, part, l, r, c, got, exp);
                        }
                        mismatches++;
                    }
                    checked++;
                }
            }
        }
    }
    char extra;
    if (fread(&extra, 1, 1, f) != 0) { fprintf(stderr, "%s: longer than expected\n", path); mismatches++; }
    fclose(f);
    if (mismatches) { fprintf(stderr, "%s: %llu of %ld values wrong\n", path, (unsigned long long)mismatches, checked); return 1; }
    printf("%s: all %ld values as expected (%ld NaN patterns)\n", path, checked, nan_checked);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 3 && strcmp(argv[1], "fixtures") == 0) {
        g_dir = argv[2];
        make_fixtures();
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "check") == 0) {
        int mode = strcmp(argv[3], "f32") == 0 ? MODE_F32 : strcmp(argv[3], "f16") == 0 ? MODE_F16
                 : strcmp(argv[3], "bf16") == 0 ? MODE_BF16 : -1;
        if (mode < 0) { die("unknown mode", argv[3]); }
        return check(argv[2], mode);
    }
    fprintf(stderr, "usage: test_weights fixtures DIR | test_weights check FILE.bin f32|f16|bf16\n");
    return 2;
}
