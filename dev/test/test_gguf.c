/*
 * test_gguf: the fixture and the checker of dev/test/test_gguf.sh (dev/tools/export_gguf).
 *
 *   test_gguf fixture OUT.bin V   a d2 checkpoint (C 36, NH 2, maxT 16, V tokens) written here in
 *                                 llm.c's layout (256 header ints, then the tensors tensor by
 *                                 tensor), every value a function of its place in the file that
 *                                 spans fp16's range (subnormals, ties, past 65504) and more
 *   test_gguf check F.gguf IN.bin encoder.json vocab.bpe f32|f16
 *                                 reads F.gguf with its own parser (GGUF v3 as ggml's gguf.h
 *                                 states it) and checks every byte of it: header, each key's
 *                                 type and value, tokens = encoder.json's keys (decoded here),
 *                                 merges = vocab.bpe's lines, the tensor infos (llama.cpp's
 *                                 names, ne = [in, out], offsets packed at 32 bytes), padding
 *                                 zero, and every tensor element = the fixture's value (f16: the
 *                                 compiler's own _Float16 rounding of it), the file's end
 * Nothing of the exporter is shared: the layout of the checkpoint is spelled out here.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char* what) {
    fprintf(stderr, "FAIL: %s\n", what);
    exit(1);
}

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL: " __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)

enum { L = 2, C = 36, NH = 2, MAXT = 16 };   // C*4 bytes is no multiple of 32: padding after 1-D tensors

// The fixture's value at float index i of the checkpoint's parameters (file order).
static float fixture_value(uint64_t i) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    int exponent = (int)(h % 48) - 30;           // 2^-30 .. 2^17: f16 subnormals, normals, overflow
    float mantissa = 1.0f + (float)((h >> 8) % 4096) / 4096.0f;   // often exactly on f16 ties
    if (h >> 63) { mantissa = -mantissa; }
    return ldexpf(mantissa, exponent);
}

// llm.c's checkpoint: the tensors in file order with their element counts (of all layers).
typedef struct { const char* ours; uint64_t elements; } FileTensor;
static int file_tensors(int V, FileTensor* t) {
    uint64_t Vp = (uint64_t)(V + 127) / 128 * 128;
    FileTensor list[] = {
        {"wte", Vp * C}, {"wpe", (uint64_t)MAXT * C}, {"ln1w", L * C}, {"ln1b", L * C},
        {"qkvw", (uint64_t)L * 3 * C * C}, {"qkvb", L * 3 * C}, {"attprojw", (uint64_t)L * C * C},
        {"attprojb", L * C}, {"ln2w", L * C}, {"ln2b", L * C}, {"fcw", (uint64_t)L * 4 * C * C},
        {"fcb", L * 4 * C}, {"fcprojw", (uint64_t)L * 4 * C * C}, {"fcprojb", L * C}, {"lnfw", C}, {"lnfb", C}
    };
    memcpy(t, list, sizeof(list));
    return (int)(sizeof(list) / sizeof(list[0]));
}

static int fixture(const char* path, int V) {
    FILE* f = fopen(path, "wb");
    if (!f) { die("cannot write the fixture"); }
    int header[256] = {20240326, 3, MAXT, V, L, NH, C, (V + 127) / 128 * 128};
    fwrite(header, sizeof(int), 256, f);
    FileTensor t[16];
    int n = file_tensors(V, t);
    uint64_t i = 0;
    for (int k = 0; k < n; k++) {
        for (uint64_t e = 0; e < t[k].elements; e++, i++) {
            float x = fixture_value(i);
            if (!strcmp(t[k].ours, "wte") && e >= (uint64_t)V * C) { x = 0.0f; }   // llm.c's padding rows
            fwrite(&x, 4, 1, f);
        }
    }
    if (fclose(f) != 0) { die("cannot write the fixture"); }
    return 0;
}

// --- reading ---------------------------------------------------------------------------------

typedef struct { const uint8_t* p; size_t n, at; } Reader;

static const uint8_t* take(Reader* r, size_t bytes) {
    CHECK(bytes <= r->n - r->at, "the file ends at byte %zu, inside a field of %zu bytes", r->n, bytes);
    const uint8_t* p = r->p + r->at;
    r->at += bytes;
    return p;
}
static uint32_t rd_u32(Reader* r) { uint32_t v; memcpy(&v, take(r, 4), 4); return v; }
static uint64_t rd_u64(Reader* r) { uint64_t v; memcpy(&v, take(r, 8), 8); return v; }
static const uint8_t* rd_string(Reader* r, uint64_t* len) { *len = rd_u64(r); return take(r, *len); }
static int string_is(const uint8_t* s, uint64_t len, const char* want) {
    return len == strlen(want) && memcmp(s, want, len) == 0;
}

static uint8_t* slurp(const char* path, size_t* n) {
    FILE* f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "FAIL: cannot open %s\n", path); exit(1); }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t* p = malloc((size_t)size + 1);
    if (!p || fread(p, 1, (size_t)size, f) != (size_t)size) { die("cannot read a file"); }
    fclose(f);
    p[size] = 0;
    *n = (size_t)size;
    return p;
}

// encoder.json's keys by id, each decoded from JSON to its UTF-8 bytes (GPT-2's file escapes
// with \uXXXX, all below U+0800, and \" \\).
typedef struct { uint8_t* bytes; size_t len; } Key;
static Key* read_encoder_keys(const char* path, int* count) {
    size_t n;
    uint8_t* s = slurp(path, &n);
    Key* keys = calloc(65536, sizeof(Key));
    *count = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '"') { continue; }
        uint8_t* out = malloc(1024);
        size_t len = 0;
        for (i++; s[i] != '"'; i++) {
            CHECK(len < 1020, "encoder.json key too long");
            if (s[i] != '\\') { out[len++] = s[i]; continue; }
            i++;
            if (s[i] == 'u') {
                char hex[5] = {0};
                memcpy(hex, s + i + 1, 4);
                char* end;
                unsigned long cp = strtoul(hex, &end, 16);
                CHECK(end == hex + 4 && cp < 0x800, "encoder.json: \\u escape");
                if (cp < 0x80) { out[len++] = (uint8_t)cp; }
                else { out[len++] = (uint8_t)(0xC0 | cp >> 6); out[len++] = (uint8_t)(0x80 | (cp & 0x3F)); }
                i += 4;
            } else {
                CHECK(s[i] == '"' || s[i] == '\\' || s[i] == '/', "encoder.json: escape \\%c", s[i]);
                out[len++] = s[i];
            }
        }
        for (i++; s[i] == ' ' || s[i] == ':'; i++) {}
        char* end;
        long id = strtol((const char*)s + i, &end, 10);
        CHECK(end != (char*)s + i && id >= 0 && id < 65536 && !keys[id].bytes,
              "encoder.json: value after key %d", *count);
        keys[id] = (Key){out, len};
        (*count)++;
    }
    free(s);
    return keys;
}

// The expected keys, in the order the exporter writes them (ours: gguf.h sets none).
enum { T_U32 = 4, T_I32 = 5, T_F32 = 6, T_STRING = 8, T_ARRAY = 9 };

static int check(const char* gguf, const char* ckpt, const char* encoder, const char* bpe, int f16) {
    size_t n, cn;
    uint8_t* file = slurp(gguf, &n);
    uint8_t* ck = slurp(ckpt, &cn);
    int header[256];
    CHECK(cn >= sizeof(header), "checkpoint too short");
    memcpy(header, ck, sizeof(header));
    const float* params = (const float*)(ck + sizeof(header));
    int V = header[3];
    int keys_n;
    Key* keys = read_encoder_keys(encoder, &keys_n);
    CHECK(keys_n == V, "encoder.json has %d keys, the fixture V=%d", keys_n, V);

    Reader r = {file, n, 0};
    CHECK(memcmp(take(&r, 4), "GGUF", 4) == 0, "magic");
    CHECK(rd_u32(&r) == 3, "version");
    uint64_t n_tensors = rd_u64(&r), n_kv = rd_u64(&r);
    CHECK(n_tensors == 4 + 12 * L, "tensor count %llu, expected %d", (unsigned long long)n_tensors, 4 + 12 * L);
    CHECK(n_kv == 16, "key count %llu, expected 16", (unsigned long long)n_kv);
    struct { const char* key; int type; uint64_t u; const char* s; } want[] = {
        {"general.architecture", T_STRING, 0, "gpt2"},
        {"general.name", T_STRING, 0, ckpt},
        {"general.file_type", T_U32, (uint64_t)f16, NULL},
        {"gpt2.context_length", T_U32, MAXT, NULL},
        {"gpt2.embedding_length", T_U32, C, NULL},
        {"gpt2.feed_forward_length", T_U32, 4 * C, NULL},
        {"gpt2.block_count", T_U32, L, NULL},
        {"gpt2.attention.head_count", T_U32, NH, NULL},
        {"gpt2.attention.layer_norm_epsilon", T_F32, 0, NULL},
        {"tokenizer.ggml.model", T_STRING, 0, "gpt2"},
        {"tokenizer.ggml.pre", T_STRING, 0, "gpt-2"},
        {"tokenizer.ggml.tokens", T_ARRAY, T_STRING, NULL},
        {"tokenizer.ggml.token_type", T_ARRAY, T_I32, NULL},
        {"tokenizer.ggml.merges", T_ARRAY, T_STRING, NULL},
        {"tokenizer.ggml.bos_token_id", T_U32, 50256, NULL},
        {"tokenizer.ggml.eos_token_id", T_U32, 50256, NULL},
    };
    for (int k = 0; k < 16; k++) {
        uint64_t len;
        const uint8_t* key = rd_string(&r, &len);
        CHECK(string_is(key, len, want[k].key), "key %d is '%.*s', expected '%s'", k, (int)len, key, want[k].key);
        uint32_t type = rd_u32(&r);
        CHECK(type == (uint32_t)want[k].type, "key %s has type %u, expected %d", want[k].key, type, want[k].type);
        if (type == T_STRING) {
            const uint8_t* s = rd_string(&r, &len);
            CHECK(string_is(s, len, want[k].s), "key %s = '%.*s', expected '%s'", want[k].key, (int)len, s, want[k].s);
        } else if (type == T_U32) {
            uint32_t v = rd_u32(&r);
            CHECK(v == want[k].u, "key %s = %u, expected %llu", want[k].key, v, (unsigned long long)want[k].u);
        } else if (type == T_F32) {
            float v;
            memcpy(&v, take(&r, 4), 4);
            CHECK(v == 1e-5f, "key %s = %g, expected 1e-5", want[k].key, v);
        } else {
            uint32_t elem = rd_u32(&r);
            uint64_t count = rd_u64(&r);
            CHECK(elem == want[k].u, "key %s holds type %u, expected %llu", want[k].key, elem, (unsigned long long)want[k].u);
            if (!strcmp(want[k].key, "tokenizer.ggml.tokens")) {
                CHECK(count == (uint64_t)V, "%llu tokens, expected %d", (unsigned long long)count, V);
                for (int id = 0; id < V; id++) {
                    const uint8_t* s = rd_string(&r, &len);
                    CHECK(len == keys[id].len && !memcmp(s, keys[id].bytes, len), "token %d is not encoder.json's", id);
                }
            } else if (!strcmp(want[k].key, "tokenizer.ggml.token_type")) {
                CHECK(count == (uint64_t)V, "%llu token types, expected %d", (unsigned long long)count, V);
                for (int id = 0; id < V; id++) {
                    uint32_t t = rd_u32(&r);
                    CHECK(t == (id == 50256 ? 3u : 1u), "token %d has type %u", id, t);
                }
            } else {
                size_t bn;
                uint8_t* lines = slurp(bpe, &bn);
                size_t at = (size_t)((uint8_t*)memchr(lines, '\n', bn) - lines) + 1;   // after '#version'
                uint64_t m = 0;
                for (; at < bn; m++) {
                    uint8_t* nl = memchr(lines + at, '\n', bn - at);
                    size_t end = nl ? (size_t)(nl - lines) : bn;
                    CHECK(m < count, "fewer merges (%llu) than vocab.bpe's lines", (unsigned long long)count);
                    const uint8_t* s = rd_string(&r, &len);
                    CHECK(len == end - at && !memcmp(s, lines + at, len), "merge %llu is not vocab.bpe's line %llu",
                          (unsigned long long)m, (unsigned long long)m + 2);
                    at = end + 1;
                }
                CHECK(m == count && m == 50000, "%llu merges, vocab.bpe has %llu lines of merges", (unsigned long long)count,
                      (unsigned long long)m);
                free(lines);
            }
        }
    }

    // tensor infos: llama.cpp's names, each ours at its place in the checkpoint file
    FileTensor ft[16];
    int nft = file_tensors(V, ft);
    uint64_t file_at[16];
    for (int k = 0, at = 0; k < nft; k++) { file_at[k] = (uint64_t)at; at += (int)ft[k].elements; }
    typedef struct { const char* name; const char* ours; int layered; uint64_t ne0, ne1; } Expect;   // layered: 1 + layer
    Expect expect[4 + 12 * L];
    int e = 0;
    expect[e++] = (Expect){"token_embd.weight", "wte", 0, C, (uint64_t)V};
    expect[e++] = (Expect){"position_embd.weight", "wpe", 0, C, MAXT};
    static char names[12 * L][48];
    const struct { const char* name; const char* ours; uint64_t ne0, ne1; } layer[12] = {
        {"attn_norm.weight", "ln1w", C, 0}, {"attn_norm.bias", "ln1b", C, 0}, {"attn_qkv.weight", "qkvw", C, 3 * C},
        {"attn_qkv.bias", "qkvb", 3 * C, 0}, {"attn_output.weight", "attprojw", C, C}, {"attn_output.bias", "attprojb", C, 0},
        {"ffn_norm.weight", "ln2w", C, 0}, {"ffn_norm.bias", "ln2b", C, 0}, {"ffn_up.weight", "fcw", C, 4 * C},
        {"ffn_up.bias", "fcb", 4 * C, 0}, {"ffn_down.weight", "fcprojw", 4 * C, C}, {"ffn_down.bias", "fcprojb", C, 0}};
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < 12; k++) {
            snprintf(names[l * 12 + k], 48, "blk.%d.%s", l, layer[k].name);
            expect[e++] = (Expect){names[l * 12 + k], layer[k].ours, 1 + l, layer[k].ne0, layer[k].ne1};
        }
    }
    expect[e++] = (Expect){"output_norm.weight", "lnfw", 0, C, 0};
    expect[e++] = (Expect){"output_norm.bias", "lnfb", 0, C, 0};
    uint64_t offset[4 + 12 * L], count[4 + 12 * L];
    uint32_t type[4 + 12 * L];
    uint64_t packed = 0;
    for (int k = 0; k < e; k++) {
        uint64_t len;
        const uint8_t* name = rd_string(&r, &len);
        CHECK(string_is(name, len, expect[k].name), "tensor %d is '%.*s', expected '%s'", k, (int)len, name, expect[k].name);
        uint32_t dims = rd_u32(&r);
        CHECK(dims == (expect[k].ne1 ? 2u : 1u), "%s has %u dims", expect[k].name, dims);
        uint64_t ne0 = rd_u64(&r), ne1 = dims == 2 ? rd_u64(&r) : 1;
        CHECK(ne0 == expect[k].ne0 && ne1 == (expect[k].ne1 ? expect[k].ne1 : 1), "%s has ne [%llu, %llu]", expect[k].name,
              (unsigned long long)ne0, (unsigned long long)ne1);
        type[k] = rd_u32(&r);
        CHECK(type[k] == (f16 && dims == 2 ? 1u : 0u), "%s has ggml type %u", expect[k].name, type[k]);
        offset[k] = rd_u64(&r);
        CHECK(offset[k] == packed && offset[k] % 32 == 0, "%s at offset %llu, expected %llu", expect[k].name,
              (unsigned long long)offset[k], (unsigned long long)packed);
        count[k] = ne0 * ne1;
        packed += (count[k] * (type[k] ? 2 : 4) + 31) / 32 * 32;
    }
    size_t data = (r.at + 31) / 32 * 32;
    for (size_t i = r.at; i < data; i++) { CHECK(file[i] == 0, "padding byte %zu is not zero", i); }
    CHECK(n == data + packed, "the file has %zu bytes, the tensors end at %llu", n, (unsigned long long)(data + packed));
    for (int k = 0; k < e; k++) {
        int t = 0;
        while (strcmp(ft[t].ours, expect[k].ours)) { t++; }
        uint64_t per_layer = ft[t].elements / (expect[k].layered ? L : 1);
        const float* src = params + file_at[t] + (expect[k].layered ? (uint64_t)(expect[k].layered - 1) * per_layer : 0);
        const uint8_t* dst = file + data + offset[k];
        for (uint64_t i = 0; i < count[k]; i++) {
            if (type[k] == 0) {
                CHECK(!memcmp(dst + 4 * i, src + i, 4), "%s[%llu] differs from the checkpoint's", expect[k].name,
                      (unsigned long long)i);
            } else {
                _Float16 h = (_Float16)src[i];
                CHECK(!memcmp(dst + 2 * i, &h, 2), "%s[%llu]: not the f16 of %.9g", expect[k].name, (unsigned long long)i,
                      (double)src[i]);
            }
        }
        uint64_t end = k + 1 < e ? offset[k + 1] : packed;
        for (uint64_t i = count[k] * (type[k] ? 2 : 4); i < end - offset[k]; i++) {
            CHECK(dst[i] == 0, "%s: padding byte %llu is not zero", expect[k].name, (unsigned long long)i);
        }
    }
    printf("ok   %s: GGUF v3, 16 keys, %d tokens = encoder.json's, 50000 merges = vocab.bpe's, %d tensors (%s) at "
           "32-byte offsets, every element = the checkpoint's%s, %zu bytes\n", gguf, V, e, f16 ? "2-D f16" : "f32",
           f16 ? " rounded by _Float16" : "", n);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 4 && !strcmp(argv[1], "fixture")) { return fixture(argv[2], atoi(argv[3])); }
    if (argc == 7 && !strcmp(argv[1], "check")) { return check(argv[2], argv[3], argv[4], argv[5], !strcmp(argv[6], "f16")); }
    die("usage: test_gguf fixture OUT.bin V | test_gguf check F.gguf IN.bin encoder.json vocab.bpe f32|f16");
    return 1;
}
