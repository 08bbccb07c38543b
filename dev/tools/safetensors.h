/*
 * safetensors.h: a strict reader and a writer for Hugging Face's safetensors format, for
 * dev/tools/gpt2_weights (and its test and fuzzer); the trainer reads llm.c's checkpoints only.
 *
 * THE FORMAT
 *   bytes [0, 8)        N: little-endian uint64, the length of the header
 *   bytes [8, 8+N)      the header: UTF-8 JSON, one object mapping
 *                         tensor name -> {"dtype": "F32", "shape": [d0, d1, ...],
 *                                         "data_offsets": [begin, end]}
 *                       plus an optional "__metadata__": {string: string, ...}
 *   bytes [8+N, EOF)    the data buffer; a tensor's bytes are [begin, end) of it, row-major
 *                       (C order), little-endian. shape [] is a scalar (1 element).
 *
 * THE READER (st_open) treats the file as hostile. It fatal()s, naming the file, the tensor
 * and what was expected, on anything it cannot vouch for:
 *  - a file shorter than 8 bytes; N < 2, N > ST_MAX_HEADER_BYTES (100 MB, the reference
 *    implementation's limit) or N larger than the rest of the file;
 *  - a header that does not begin with '{' (the spec's requirement), that is not strict JSON
 *    (RFC 8259: no trailing commas, no leading zeros, no bad or unpaired-surrogate escapes,
 *    no raw control characters, valid UTF-8 only), or that has anything but whitespace after
 *    the closing '}' (writers pad with spaces);
 *  - a duplicate key anywhere (compared after unescaping, so "a" and "\u0061" are the same);
 *  - a tensor entry that is not an object with exactly the fields dtype, shape, data_offsets;
 *    an unknown dtype; shape dims or offsets that are not non-negative integers (no sign, no
 *    fraction, no exponent) or do not fit 64 bits; more than ST_MAX_RANK dims; begin > end;
 *  - product(shape) * dtype size overflowing 64 bits or differing from end - begin;
 *  - a tensor that ends past the end of the data buffer (a truncated file);
 *  - overlapping tensors, holes between tensors, or bytes after the last tensor: the spec
 *    requires the tensors to cover the data buffer exactly, and the reference implementation
 *    rejects such files too. We follow it (strict): every byte of the data buffer belongs to
 *    exactly one tensor (zero-size tensors occupy no bytes and may sit anywhere in range).
 *  - a tensor name or metadata string containing U+0000 (C strings cannot hold it);
 *  - "__metadata__" that is not null or an object of string values.
 * Offsets are 64-bit throughout; tensor data is read on demand with fseeko (never the whole
 * file), so 6 GB files are fine. The host must be little-endian (checked).
 *
 * THE WRITER (st_write_file) writes the canonical form of the reference implementation:
 * compact JSON, "__metadata__" first (keys sorted), then the tensors ordered by dtype
 * alignment (largest first, in the reference's dtype order) and then by name (bytewise), each
 * as {"dtype":..,"shape":[..],"data_offsets":[b,e]} with the data laid out in the same order
 * and no gaps; the header is padded with spaces to a multiple of 8 bytes so the data buffer
 * (and every tensor of the largest dtype) starts 8-byte aligned. Strings are escaped like
 * serde_json (", \, \b \f \n \r \t, other controls as \u00xx; nothing else). Output is
 * written atomically (utils.h AtomicWriter).
 *
 * The small strict JSON parser is also usable for other files (st_json_get_ints reads
 * integer fields of a config.json).
 */
#ifndef LLMC_SAFETENSORS_H
#define LLMC_SAFETENSORS_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/utils.h"

// Every function is static and may go unused by a given includer.
#define ST_FN static __attribute__((unused))

#define ST_MAX_HEADER_BYTES 100000000ull   // the reference implementation's limit
#define ST_MAX_RANK 64
#define ST_JSON_MAX_DEPTH 128

// In the reference implementation's order (its serializer sorts by this, largest first).
typedef enum {
    ST_BOOL, ST_U8, ST_I8, ST_F8_E5M2, ST_F8_E4M3, ST_F8_E8M0, ST_I16, ST_U16, ST_F16, ST_BF16,
    ST_I32, ST_U32, ST_F32, ST_F64, ST_I64, ST_U64, ST_NUM_DTYPES
} StDtype;

static const char* const st_dtype_names[ST_NUM_DTYPES] = {
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "F64", "I64", "U64"
};
static const int st_dtype_sizes[ST_NUM_DTYPES] = {1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8};

ST_FN int st_dtype_from_name(const char* s) {
    for (int i = 0; i < ST_NUM_DTYPES; i++) {
        if (strcmp(s, st_dtype_names[i]) == 0) { return i; }
    }
    return -1;
}

typedef struct {
    char* name;           // unescaped UTF-8
    int dtype;            // StDtype
    int rank;
    uint64_t* shape;      // rank dims (NULL for a scalar)
    uint64_t numel;       // product of the dims (1 for a scalar)
    uint64_t nbytes;      // numel * dtype size == end - begin
    uint64_t begin, end;  // byte range in the data buffer
} StTensor;

typedef struct {
    char* path;
    FILE* f;
    int64_t file_size;
    uint64_t header_len;   // N
    uint64_t data_start;   // 8 + N: file offset of the data buffer
    uint64_t data_len;     // file_size - data_start
    size_t num_tensors;
    StTensor* tensors;     // header order
    size_t num_metadata;
    char** metadata_keys;
    char** metadata_values;
} StFile;

// --- checked 64-bit arithmetic ---------------------------------------------------------------
ST_FN int st_mul_overflows(uint64_t a, uint64_t b, uint64_t* out) {
    if (a != 0 && b > UINT64_MAX / a) { return 1; }
    *out = a * b;
    return 0;
}

// --- a tiny growable byte buffer -------------------------------------------------------------
typedef struct {
    char* p;
    size_t len, cap;
} StBuf;

ST_FN void st_buf_reserve(StBuf* b, size_t extra) {
    if (extra > SIZE_MAX / 2 - b->len) { fatal("out of memory (JSON buffer)"); }
    if (b->len + extra + 1 <= b->cap) { return; }
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra + 1) { cap *= 2; }
    char* p = (char*)realloc(b->p, cap);
    if (p == NULL) { fatal("out of memory allocating %zu bytes for a JSON buffer", cap); }
    b->p = p;
    b->cap = cap;
}

ST_FN void st_buf_add(StBuf* b, const void* s, size_t n) {
    st_buf_reserve(b, n);
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

ST_FN void st_buf_addc(StBuf* b, char c) { st_buf_add(b, &c, 1); }

__attribute__((format(printf, 2, 3)))
ST_FN void st_buf_printf(StBuf* b, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char tmp[256];
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(tmp)) { fatal("internal error: st_buf_printf overflow"); }
    st_buf_add(b, tmp, (size_t)n);
}

// A JSON string literal, escaped like serde_json.
ST_FN void st_buf_add_json_string(StBuf* b, const char* s) {
    st_buf_addc(b, '"');
    for (const unsigned char* p = (const unsigned char*)s; *p; p++) {
        switch (*p) {
            case '"':  st_buf_add(b, "\\\"", 2); break;
            case '\\': st_buf_add(b, "\\\\", 2); break;
            case '\b': st_buf_add(b, "\\b", 2); break;
            case '\f': st_buf_add(b, "\\f", 2); break;
            case '\n': st_buf_add(b, "\\n", 2); break;
            case '\r': st_buf_add(b, "\\r", 2); break;
            case '\t': st_buf_add(b, "\\t", 2); break;
            default:
                if (*p < 0x20) { st_buf_printf(b, "\\u%04x", *p); }
                else { st_buf_addc(b, (char)*p); }
        }
    }
    st_buf_addc(b, '"');
}

// A name made printable for an error message (control and non-ASCII bytes as \xNN, cut).
ST_FN const char* st_printable(const char* s, char* out, size_t cap) {
    size_t o = 0;
    const unsigned char* p = (const unsigned char*)s;
    for (; *p && o + 8 < cap; p++) {
        if (*p < 0x20 || *p >= 0x7f || *p == '\'') { o += (size_t)snprintf(out + o, cap - o, "\\x%02x", *p); }
        else { out[o++] = (char)*p; }
    }
    out[o] = '\0';
    if (*p) { snprintf(out + o, cap - o, "..."); }
    return out;
}

// --- strict JSON pull parser -----------------------------------------------------------------
typedef struct {
    const char* path;            // the file, for messages
    const char* what;            // "header" / "config" etc., for messages
    const unsigned char* s;
    size_t n, pos;
    StBuf str;                   // the last string read (unescaped, NUL-terminated)
    int str_has_nul;             // it contained \u0000
} StJson;

typedef struct {
    int negative, integer, overflow;   // integer: no fraction, no exponent
    uint64_t value;                    // |value| when integer && !overflow
    size_t start, len;                 // the token's text
} StJsonNumber;

__attribute__((format(printf, 2, 3), noreturn))
ST_FN void st_json_fail(StJson* J, const char* fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fatal("file '%s': invalid JSON at byte %zu of the %s: %s", J->path, J->pos, J->what, msg);
}

ST_FN void st_json_init(StJson* J, const char* path, const char* what, const void* s, size_t n) {
    memset(J, 0, sizeof(*J));
    J->path = path;
    J->what = what;
    J->s = (const unsigned char*)s;
    J->n = n;
}

ST_FN void st_json_free(StJson* J) { free(J->str.p); J->str.p = NULL; }

ST_FN void st_json_ws(StJson* J) {
    while (J->pos < J->n) {
        unsigned char c = J->s[J->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') { break; }
        J->pos++;
    }
}

// Next non-whitespace byte (not consumed), or -1 at the end.
ST_FN int st_json_peek(StJson* J) {
    st_json_ws(J);
    return J->pos < J->n ? J->s[J->pos] : -1;
}

ST_FN const char* st_json_describe(int c, char* buf, size_t cap) {
    if (c < 0) { return "the end of the text"; }
    if (c >= 0x21 && c < 0x7f) { snprintf(buf, cap, "'%c'", c); }
    else { snprintf(buf, cap, "byte 0x%02x", c); }
    return buf;
}

ST_FN void st_json_expect(StJson* J, char want, const char* context) {
    int c = st_json_peek(J);
    if (c != (unsigned char)want) {
        char d[16];
        st_json_fail(J, "expected '%c' %s, found %s", want, context, st_json_describe(c, d, sizeof(d)));
    }
    J->pos++;
}

ST_FN int st_json_hex4(StJson* J) {
    if (J->n - J->pos < 4) { st_json_fail(J, "bad \\u escape: needs 4 hex digits"); }
    int v = 0;
    for (int i = 0; i < 4; i++) {
        int c = J->s[J->pos + i], d;
        if (c >= '0' && c <= '9') { d = c - '0'; }
        else if (c >= 'a' && c <= 'f') { d = c - 'a' + 10; }
        else if (c >= 'A' && c <= 'F') { d = c - 'A' + 10; }
        else { st_json_fail(J, "bad \\u escape: '%c' is not a hex digit", c >= 0x20 && c < 0x7f ? c : '?'); }
        v = v * 16 + d;
    }
    J->pos += 4;
    return v;
}

ST_FN void st_json_put_utf8(StBuf* b, uint32_t cp) {
    char u[4];
    size_t n;
    if (cp < 0x80) { u[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F)); n = 2; }
    else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | (cp >> 12)); u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F)); n = 3;
    } else {
        u[0] = (char)(0xF0 | (cp >> 18)); u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[3] = (char)(0x80 | (cp & 0x3F)); n = 4;
    }
    st_buf_add(b, u, n);
}

// Reads a string literal into J->str (unescaped). Validates escapes and UTF-8.
ST_FN const char* st_json_string(StJson* J) {
    st_json_expect(J, '"', "(a string)");
    J->str.len = 0;
    st_buf_reserve(&J->str, 0);
    J->str.p[0] = '\0';
    J->str_has_nul = 0;
    for (;;) {
        if (J->pos >= J->n) { st_json_fail(J, "unterminated string"); }
        unsigned char c = J->s[J->pos];
        if (c == '"') { J->pos++; break; }
        if (c < 0x20) { st_json_fail(J, "raw control character 0x%02x in a string (must be escaped)", c); }
        if (c == '\\') {
            if (J->pos + 1 >= J->n) { st_json_fail(J, "unterminated escape in a string"); }
            unsigned char e = J->s[J->pos + 1];
            J->pos += 2;
            switch (e) {
                case '"': st_buf_addc(&J->str, '"'); break;
                case '\\': st_buf_addc(&J->str, '\\'); break;
                case '/': st_buf_addc(&J->str, '/'); break;
                case 'b': st_buf_addc(&J->str, '\b'); break;
                case 'f': st_buf_addc(&J->str, '\f'); break;
                case 'n': st_buf_addc(&J->str, '\n'); break;
                case 'r': st_buf_addc(&J->str, '\r'); break;
                case 't': st_buf_addc(&J->str, '\t'); break;
                case 'u': {
                    uint32_t cp = (uint32_t)st_json_hex4(J);
                    if (cp >= 0xDC00 && cp <= 0xDFFF) {
                        J->pos -= 6;
                        st_json_fail(J, "bad \\u escape: unpaired low surrogate \\u%04X", cp);
                    }
                    if (cp >= 0xD800 && cp <= 0xDBFF) {
                        if (J->n - J->pos < 6 || J->s[J->pos] != '\\' || J->s[J->pos + 1] != 'u') {
                            st_json_fail(J, "bad \\u escape: high surrogate \\u%04X not followed by a low surrogate", cp);
                        }
                        J->pos += 2;
                        uint32_t lo = (uint32_t)st_json_hex4(J);
                        if (lo < 0xDC00 || lo > 0xDFFF) {
                            st_json_fail(J, "bad \\u escape: high surrogate \\u%04X followed by \\u%04X, not a low surrogate", cp, lo);
                        }
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    }
                    if (cp == 0) { J->str_has_nul = 1; }
                    st_json_put_utf8(&J->str, cp);
                    break;
                }
                default:
                    J->pos -= 2;
                    st_json_fail(J, "bad escape '\\%c' in a string", e >= 0x20 && e < 0x7f ? e : '?');
            }
            continue;
        }
        if (c < 0x80) { st_buf_addc(&J->str, (char)c); J->pos++; continue; }
        // multi-byte UTF-8: exact well-formedness (no overlongs, no surrogates, <= U+10FFFF)
        size_t len;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) { len = 2; }
        else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0) { lo = 0xA0; }
            if (c == 0xED) { hi = 0x9F; }
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0) { lo = 0x90; }
            if (c == 0xF4) { hi = 0x8F; }
        } else { st_json_fail(J, "invalid UTF-8 byte 0x%02x in a string", c); }
        if (J->n - J->pos < len) { st_json_fail(J, "truncated UTF-8 sequence in a string"); }
        for (size_t i = 1; i < len; i++) {
            unsigned char d = J->s[J->pos + i];
            unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
            if (d < l || d > h) { st_json_fail(J, "invalid UTF-8 sequence in a string (byte 0x%02x)", d); }
        }
        st_buf_add(&J->str, J->s + J->pos, len);
        J->pos += len;
    }
    return J->str.p;
}

// Reads a number token (RFC 8259 grammar) and classifies it.
ST_FN StJsonNumber st_json_number(StJson* J) {
    StJsonNumber num;
    memset(&num, 0, sizeof(num));
    st_json_ws(J);
    num.start = J->pos;
    num.integer = 1;
    const unsigned char* s = J->s;
    size_t n = J->n;
    if (J->pos < n && s[J->pos] == '-') { num.negative = 1; J->pos++; }
    if (J->pos >= n || s[J->pos] < '0' || s[J->pos] > '9') { st_json_fail(J, "expected a digit in a number"); }
    if (s[J->pos] == '0') {
        J->pos++;
        if (J->pos < n && s[J->pos] >= '0' && s[J->pos] <= '9') { st_json_fail(J, "number with a leading zero"); }
    } else {
        while (J->pos < n && s[J->pos] >= '0' && s[J->pos] <= '9') {
            uint64_t d = (uint64_t)(s[J->pos] - '0');
            if (!num.overflow) {
                if (num.value > (UINT64_MAX - d) / 10) { num.overflow = 1; }
                else { num.value = num.value * 10 + d; }
            }
            J->pos++;
        }
    }
    if (J->pos < n && s[J->pos] == '.') {
        num.integer = 0;
        J->pos++;
        if (J->pos >= n || s[J->pos] < '0' || s[J->pos] > '9') { st_json_fail(J, "expected a digit after '.' in a number"); }
        while (J->pos < n && s[J->pos] >= '0' && s[J->pos] <= '9') { J->pos++; }
    }
    if (J->pos < n && (s[J->pos] == 'e' || s[J->pos] == 'E')) {
        num.integer = 0;
        J->pos++;
        if (J->pos < n && (s[J->pos] == '+' || s[J->pos] == '-')) { J->pos++; }
        if (J->pos >= n || s[J->pos] < '0' || s[J->pos] > '9') { st_json_fail(J, "expected a digit in a number's exponent"); }
        while (J->pos < n && s[J->pos] >= '0' && s[J->pos] <= '9') { J->pos++; }
    }
    num.len = J->pos - num.start;
    return num;
}

ST_FN void st_json_literal(StJson* J, const char* word) {
    size_t k = strlen(word);
    if (J->n - J->pos < k || memcmp(J->s + J->pos, word, k) != 0) {
        st_json_fail(J, "invalid literal (expected %s)", word);
    }
    J->pos += k;
}

// Iteration helpers. Call with *first = 1 after the opening bracket; each returns 1 when
// another member/element follows (for objects: positioned at its key), 0 after the closer.
// The step they share: past the closer (0), or past the ',' before every member but the first.
ST_FN int st_json_next(StJson* J, int* first, int closer, const char* container) {
    int c = st_json_peek(J);
    char d[16];
    if (c == closer) { J->pos++; return 0; }
    if (!*first) {
        if (c != ',') {
            st_json_fail(J, "expected ',' or '%c' in %s, found %s", closer, container, st_json_describe(c, d, sizeof(d)));
        }
        J->pos++;
    }
    *first = 0;
    return 1;
}

ST_FN int st_json_object_next(StJson* J, int* first) {
    if (!st_json_next(J, first, '}', "an object")) { return 0; }
    int c = st_json_peek(J);
    char d[16];
    if (c != '"') { st_json_fail(J, "expected a string key in an object, found %s", st_json_describe(c, d, sizeof(d))); }
    return 1;
}

ST_FN int st_json_array_next(StJson* J, int* first) {
    int after_comma = !*first;
    if (!st_json_next(J, first, ']', "an array")) { return 0; }
    int c = st_json_peek(J);
    if (after_comma && c == ']') { st_json_fail(J, "trailing ',' before ']'"); }
    if (c < 0) { st_json_fail(J, "unterminated array"); }
    return 1;
}

ST_FN int st_json_strptr_cmp(const void* a, const void* b) {
    return strcmp(*(const char* const*)a, *(const char* const*)b);
}

// Returns a duplicate among keys[0..n) (sorts a copy of the pointer array), or NULL.
ST_FN const char* st_find_duplicate(char* const* keys, size_t n) {
    if (n < 2) { return NULL; }
    const char** sorted = (const char**)malloc_or_die(n * sizeof(char*), "duplicate-key check");
    memcpy(sorted, keys, n * sizeof(char*));
    qsort(sorted, n, sizeof(char*), st_json_strptr_cmp);
    const char* dup = NULL;
    for (size_t i = 1; i < n && !dup; i++) {
        if (strcmp(sorted[i - 1], sorted[i]) == 0) { dup = sorted[i]; }
    }
    free(sorted);
    return dup;
}

ST_FN char* st_strdup_or_die(const char* s) {
    size_t n = strlen(s);
    char* p = (char*)malloc_or_die(n + 1, "a JSON string");
    memcpy(p, s, n + 1);
    return p;
}

ST_FN void st_json_skip(StJson* J, int depth);

// Skips an object or an array, validating it (keys of an object must be unique).
ST_FN void st_json_skip_container(StJson* J, int depth) {
    if (depth > ST_JSON_MAX_DEPTH) { st_json_fail(J, "nested too deeply (more than %d levels)", ST_JSON_MAX_DEPTH); }
    int first = 1;
    if (J->s[J->pos] == '[') {
        J->pos++;
        while (st_json_array_next(J, &first)) { st_json_skip(J, depth + 1); }
        return;
    }
    J->pos++;
    size_t nkeys = 0, cap = 0;
    char** keys = NULL;
    while (st_json_object_next(J, &first)) {
        st_json_string(J);
        if (J->str_has_nul) { st_json_fail(J, "object key contains \\u0000"); }
        if (nkeys == cap) {
            cap = cap ? 2 * cap : 8;
            keys = (char**)realloc(keys, cap * sizeof(char*));
            if (keys == NULL) { fatal("out of memory parsing JSON"); }
        }
        keys[nkeys] = st_strdup_or_die(J->str.p);
        nkeys++;
        st_json_expect(J, ':', "after an object key");
        st_json_skip(J, depth + 1);
    }
    const char* dup = st_find_duplicate(keys, nkeys);
    if (dup) {
        char pr[200];
        st_json_fail(J, "duplicate key '%s' in an object", st_printable(dup, pr, sizeof(pr)));
    }
    for (size_t i = 0; i < nkeys; i++) { free(keys[i]); }
    free(keys);
}

// Skips any JSON value, validating it.
ST_FN void st_json_skip(StJson* J, int depth) {
    int c = st_json_peek(J);
    char d[16];
    if (c == '{' || c == '[') { st_json_skip_container(J, depth); }
    else if (c == '"') { st_json_string(J); }
    else if (c == '-' || (c >= '0' && c <= '9')) { st_json_number(J); }
    else if (c == 't') { st_json_literal(J, "true"); }
    else if (c == 'f') { st_json_literal(J, "false"); }
    else if (c == 'n') { st_json_literal(J, "null"); }
    else { st_json_fail(J, "expected a value, found %s", st_json_describe(c, d, sizeof(d))); }
}

// Dies with a JSON syntax error unless a value starts here (schema checks come after this,
// so "not JSON" and "JSON of the wrong shape" get different messages).
ST_FN int st_json_require_value(StJson* J) {
    int c = st_json_peek(J);
    if (c == '"' || c == '{' || c == '[' || c == 't' || c == 'f' || c == 'n' || c == '-' ||
        (c >= '0' && c <= '9')) {
        return c;
    }
    char d[16];
    st_json_fail(J, "expected a value, found %s", st_json_describe(c, d, sizeof(d)));
}

ST_FN void st_json_end(StJson* J) {
    int c = st_json_peek(J);
    if (c >= 0) {
        char d[16];
        st_json_fail(J, "unexpected %s after the end of the top-level object (trailing garbage)",
                     st_json_describe(c, d, sizeof(d)));
    }
}

// Parses `text` as one strict JSON object; for each of keys[0..nkeys): if present, it must
// be a non-negative integer < 2^31 (or null: treated as absent), stored in values[i] and
// found[i] = 1. Other fields are validated and ignored. Dies naming `path` on any problem.
ST_FN void st_json_get_ints(const char* path, const char* text, size_t len, int nkeys,
                             const char* const* keys, long* values, int* found) {
    StJson J;
    st_json_init(&J, path, "file", text, len);
    for (int i = 0; i < nkeys; i++) { found[i] = 0; values[i] = 0; }
    if (st_json_peek(&J) != '{') { st_json_fail(&J, "expected a JSON object"); }
    // validate the whole text first (duplicates, depth), then pick the fields
    st_json_skip(&J, 0);
    st_json_end(&J);
    J.pos = 0;
    st_json_expect(&J, '{', "at the start");
    int first = 1;
    while (st_json_object_next(&J, &first)) {
        st_json_string(&J);
        int which = -1;
        for (int i = 0; i < nkeys; i++) {
            if (strcmp(J.str.p, keys[i]) == 0) { which = i; }
        }
        st_json_expect(&J, ':', "after an object key");
        if (which < 0) { st_json_skip(&J, 1); continue; }
        int c = st_json_peek(&J);
        if (c == 'n') { st_json_literal(&J, "null"); continue; }
        if (c != '-' && (c < '0' || c > '9')) {
            fatal("file '%s': \"%s\" must be a non-negative integer", path, keys[which]);
        }
        StJsonNumber num = st_json_number(&J);
        if (num.negative || !num.integer || num.overflow || num.value > 0x7fffffff) {
            fatal("file '%s': \"%s\" is %.*s; expected a non-negative integer below 2^31", path,
                  keys[which], (int)(num.len > 40 ? 40 : num.len), text + num.start);
        }
        values[which] = (long)num.value;
        found[which] = 1;
    }
    st_json_free(&J);
}

// --- the reader ------------------------------------------------------------------------------

ST_FN int st_host_is_little_endian(void) {
    uint16_t x = 1;
    unsigned char b;
    memcpy(&b, &x, 1);
    return b == 1;
}

// Reads a non-negative integer that fits 64 bits; `what` names it for the message.
ST_FN uint64_t st_json_uint(StJson* J, const char* tensor, const char* what) {
    int c = st_json_require_value(J);
    char pr[200], d[16];
    if (c != '-' && (c < '0' || c > '9')) {
        fatal("file '%s': tensor '%s': %s must be a non-negative integer, found %s", J->path,
              st_printable(tensor, pr, sizeof(pr)), what, st_json_describe(c, d, sizeof(d)));
    }
    StJsonNumber num = st_json_number(J);
    int shown = (int)(num.len > 40 ? 40 : num.len);
    const char* text = (const char*)J->s + num.start;
    if (num.negative) {
        fatal("file '%s': tensor '%s': %s is %.*s: negative; expected a non-negative integer",
              J->path, st_printable(tensor, pr, sizeof(pr)), what, shown, text);
    }
    if (!num.integer) {
        fatal("file '%s': tensor '%s': %s is %.*s: not an integer; expected a non-negative integer "
              "(no fraction or exponent)", J->path, st_printable(tensor, pr, sizeof(pr)), what, shown, text);
    }
    if (num.overflow) {
        fatal("file '%s': tensor '%s': %s is %.*s%s: too large (overflows 64 bits)", J->path,
              st_printable(tensor, pr, sizeof(pr)), what, shown, text, num.len > 40 ? "..." : "");
    }
    return num.value;
}

// Parses one tensor entry {"dtype":..,"shape":[..],"data_offsets":[b,e]} into *t.
ST_FN void st_parse_tensor_entry(StJson* J, StTensor* t) {
    char pr[200];
    const char* name = st_printable(t->name, pr, sizeof(pr));
    int c = st_json_require_value(J);
    if (c != '{') {
        fatal("file '%s': tensor '%s': expected an object {\"dtype\", \"shape\", \"data_offsets\"}",
              J->path, name);
    }
    J->pos++;
    int have_dtype = 0, have_shape = 0, have_offsets = 0, first = 1;
    while (st_json_object_next(J, &first)) {
        st_json_string(J);
        char field[32];
        int known = 0;
        if (J->str.len < sizeof(field) && !J->str_has_nul) {
            memcpy(field, J->str.p, J->str.len + 1);
            known = strcmp(field, "dtype") == 0 || strcmp(field, "shape") == 0 ||
                    strcmp(field, "data_offsets") == 0;
        }
        if (!known) {
            char pf[100];
            fatal("file '%s': tensor '%s': unknown field '%s' (expected exactly dtype, shape, "
                  "data_offsets)", J->path, name, st_printable(J->str.p, pf, sizeof(pf)));
        }
        st_json_expect(J, ':', "after an object key");
        if (strcmp(field, "dtype") == 0) {
            if (have_dtype) { fatal("file '%s': tensor '%s': duplicate key 'dtype'", J->path, name); }
            have_dtype = 1;
            if (st_json_require_value(J) != '"') { fatal("file '%s': tensor '%s': dtype must be a string", J->path, name); }
            st_json_string(J);
            t->dtype = J->str_has_nul ? -1 : st_dtype_from_name(J->str.p);
            if (t->dtype < 0) {
                char pd[100];
                fatal("file '%s': tensor '%s': unknown dtype '%s' (expected one of BOOL U8 I8 "
                      "F8_E5M2 F8_E4M3 F8_E8M0 I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64)", J->path,
                      name, st_printable(J->str.p, pd, sizeof(pd)));
            }
        } else if (strcmp(field, "shape") == 0) {
            if (have_shape) { fatal("file '%s': tensor '%s': duplicate key 'shape'", J->path, name); }
            have_shape = 1;
            if (st_json_require_value(J) != '[') { fatal("file '%s': tensor '%s': shape must be an array of integers", J->path, name); }
            J->pos++;
            uint64_t dims[ST_MAX_RANK];
            int rank = 0, afirst = 1;
            while (st_json_array_next(J, &afirst)) {
                if (rank == ST_MAX_RANK) {
                    fatal("file '%s': tensor '%s': shape has more than %d dims", J->path, name, ST_MAX_RANK);
                }
                char what[48];
                snprintf(what, sizeof(what), "shape dim %d", rank);
                dims[rank++] = st_json_uint(J, t->name, what);
            }
            t->rank = rank;
            t->shape = rank ? (uint64_t*)malloc_or_die((size_t)rank * sizeof(uint64_t), "a tensor shape") : NULL;
            if (rank) { memcpy(t->shape, dims, (size_t)rank * sizeof(uint64_t)); }
        } else {
            if (have_offsets) { fatal("file '%s': tensor '%s': duplicate key 'data_offsets'", J->path, name); }
            have_offsets = 1;
            if (st_json_require_value(J) != '[') {
                fatal("file '%s': tensor '%s': data_offsets must be an array [begin, end]", J->path, name);
            }
            J->pos++;
            uint64_t v[2];
            int k = 0, afirst = 1;
            while (st_json_array_next(J, &afirst)) {
                if (k == 2) { fatal("file '%s': tensor '%s': data_offsets has more than 2 numbers; expected [begin, end]", J->path, name); }
                v[k] = st_json_uint(J, t->name, k == 0 ? "data_offsets begin" : "data_offsets end");
                k++;
            }
            if (k != 2) { fatal("file '%s': tensor '%s': data_offsets has %d number(s); expected [begin, end]", J->path, name, k); }
            t->begin = v[0];
            t->end = v[1];
        }
    }
    if (!have_dtype || !have_shape || !have_offsets) {
        fatal("file '%s': tensor '%s': missing field '%s' (expected dtype, shape, data_offsets)",
              J->path, name, !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
    }
}

ST_FN void st_format_shape(const StTensor* t, char* out, size_t cap) {
    size_t o = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < t->rank && o + 24 < cap; i++) {
        o += (size_t)snprintf(out + o, cap - o, i ? ", %llu" : "%llu", (unsigned long long)t->shape[i]);
    }
    if (o + 24 >= cap) { o += (size_t)snprintf(out + o, cap - o, ", ..."); }
    snprintf(out + o, cap - o, "]");
}

static __attribute__((unused)) const StTensor* st_sort_base;
ST_FN int st_cmp_by_offset(const void* a, const void* b) {
    const StTensor* x = &st_sort_base[*(const size_t*)a];
    const StTensor* y = &st_sort_base[*(const size_t*)b];
    if (x->begin != y->begin) { return x->begin < y->begin ? -1 : 1; }
    if (x->end != y->end) { return x->end < y->end ? -1 : 1; }
    return 0;
}

// Checks sizes, bounds, overlaps and coverage of the parsed tensors.
ST_FN void st_validate(StFile* sf) {
    char pr[200], pr2[200], shp[200];
    for (size_t i = 0; i < sf->num_tensors; i++) {
        StTensor* t = &sf->tensors[i];
        const char* name = st_printable(t->name, pr, sizeof(pr));
        st_format_shape(t, shp, sizeof(shp));
        uint64_t numel = 1;
        int zero = 0;
        for (int d = 0; d < t->rank; d++) { zero |= t->shape[d] == 0; }
        if (zero) { numel = 0; }
        else {
            for (int d = 0; d < t->rank; d++) {
                if (st_mul_overflows(numel, t->shape[d], &numel)) {
                    fatal("file '%s': tensor '%s': shape %s has too many elements (the product "
                          "overflows 64 bits)", sf->path, name, shp);
                }
            }
        }
        uint64_t nbytes;
        if (st_mul_overflows(numel, (uint64_t)st_dtype_sizes[t->dtype], &nbytes)) {
            fatal("file '%s': tensor '%s': shape %s of %s is too many bytes (overflows 64 bits)",
                  sf->path, name, shp, st_dtype_names[t->dtype]);
        }
        t->numel = numel;
        t->nbytes = nbytes;
        if (t->begin > t->end) {
            fatal("file '%s': tensor '%s': data_offsets [%llu, %llu] has begin > end", sf->path,
                  name, (unsigned long long)t->begin, (unsigned long long)t->end);
        }
        if (t->end - t->begin != nbytes) {
            fatal("file '%s': tensor '%s': dtype %s and shape %s make %llu bytes, but data_offsets "
                  "[%llu, %llu] span %llu bytes (wrong dtype or shape for the data)", sf->path,
                  name, st_dtype_names[t->dtype], shp, (unsigned long long)nbytes,
                  (unsigned long long)t->begin, (unsigned long long)t->end,
                  (unsigned long long)(t->end - t->begin));
        }
        if (t->end > sf->data_len) {
            fatal("file '%s': tensor '%s': data_offsets [%llu, %llu] go past the end of the data "
                  "buffer (%llu bytes after the header): the file is truncated or the offsets are "
                  "wrong", sf->path, name, (unsigned long long)t->begin,
                  (unsigned long long)t->end, (unsigned long long)sf->data_len);
        }
    }
    // overlaps and holes: walk the tensors in offset order
    size_t n = sf->num_tensors;
    size_t* order = (size_t*)malloc_or_die((n ? n : 1) * sizeof(size_t), "tensor order");
    for (size_t i = 0; i < n; i++) { order[i] = i; }
    st_sort_base = sf->tensors;
    qsort(order, n, sizeof(size_t), st_cmp_by_offset);
    uint64_t covered = 0;
    const StTensor* prev = NULL;
    for (size_t k = 0; k < n; k++) {
        const StTensor* t = &sf->tensors[order[k]];
        if (t->begin < covered) {
            fatal("file '%s': tensors '%s' (bytes [%llu, %llu)) and '%s' (bytes [%llu, %llu)) "
                  "overlap in the data buffer", sf->path, st_printable(prev->name, pr2, sizeof(pr2)),
                  (unsigned long long)prev->begin, (unsigned long long)prev->end,
                  st_printable(t->name, pr, sizeof(pr)), (unsigned long long)t->begin,
                  (unsigned long long)t->end);
        }
        if (t->begin > covered) {
            fatal("file '%s': bytes [%llu, %llu) of the data buffer belong to no tensor (a hole "
                  "before tensor '%s'); the format requires the tensors to cover the data buffer "
                  "exactly", sf->path, (unsigned long long)covered, (unsigned long long)t->begin,
                  st_printable(t->name, pr, sizeof(pr)));
        }
        if (t->end > covered) { covered = t->end; prev = t; }
        else if (prev == NULL) { prev = t; }
    }
    free(order);
    if (covered != sf->data_len) {
        fatal("file '%s': the tensors cover %llu bytes of the data buffer but it has %llu: "
              "%llu bytes after the last tensor belong to no tensor (trailing garbage or a wrong "
              "header length); the format requires the tensors to cover the data buffer exactly",
              sf->path, (unsigned long long)covered, (unsigned long long)sf->data_len,
              (unsigned long long)(sf->data_len - covered));
    }
}

// Parses and validates a header (the N bytes after the length) for a data buffer of
// data_len bytes. Fills sf->tensors and sf->metadata_*; sf->path must be set.
ST_FN void st_parse_header(StFile* sf, const char* header, size_t len) {
    StJson J;
    st_json_init(&J, sf->path, "header", header, len);
    if (len == 0 || header[0] != '{') {
        fatal("file '%s': the safetensors header must begin with '{' (found %s): not a "
              "safetensors file?", sf->path, len == 0 ? "nothing" : "something else");
    }
    J.pos = 1;
    size_t cap = 0;
    int have_meta = 0, first = 1;
    sf->num_tensors = 0;
    sf->tensors = NULL;
    while (st_json_object_next(&J, &first)) {
        st_json_string(&J);
        if (J.str_has_nul) { st_json_fail(&J, "a key contains \\u0000"); }
        if (strcmp(J.str.p, "__metadata__") == 0) {
            if (have_meta) { fatal("file '%s': duplicate key '__metadata__' in the header", sf->path); }
            have_meta = 1;
            st_json_expect(&J, ':', "after an object key");
            int c = st_json_require_value(&J);
            if (c == 'n') { st_json_literal(&J, "null"); continue; }
            if (c != '{') { fatal("file '%s': __metadata__ must be an object of string values", sf->path); }
            J.pos++;
            size_t mcap = 0;
            int mfirst = 1;
            while (st_json_object_next(&J, &mfirst)) {
                st_json_string(&J);
                if (J.str_has_nul) { st_json_fail(&J, "a __metadata__ key contains \\u0000"); }
                char* key = st_strdup_or_die(J.str.p);
                st_json_expect(&J, ':', "after an object key");
                if (st_json_require_value(&J) != '"') {
                    char pk[200];
                    fatal("file '%s': __metadata__ value of '%s' is not a string (metadata must "
                          "map strings to strings)", sf->path, st_printable(key, pk, sizeof(pk)));
                }
                st_json_string(&J);
                if (J.str_has_nul) { st_json_fail(&J, "a __metadata__ value contains \\u0000"); }
                if (sf->num_metadata == mcap) {
                    mcap = mcap ? 2 * mcap : 8;
                    sf->metadata_keys = (char**)realloc(sf->metadata_keys, mcap * sizeof(char*));
                    sf->metadata_values = (char**)realloc(sf->metadata_values, mcap * sizeof(char*));
                    if (!sf->metadata_keys || !sf->metadata_values) { fatal("out of memory reading '%s'", sf->path); }
                }
                sf->metadata_keys[sf->num_metadata] = key;
                sf->metadata_values[sf->num_metadata] = st_strdup_or_die(J.str.p);
                sf->num_metadata++;
            }
            const char* dup = st_find_duplicate(sf->metadata_keys, sf->num_metadata);
            if (dup) {
                char pd[200];
                fatal("file '%s': duplicate key '%s' in __metadata__", sf->path, st_printable(dup, pd, sizeof(pd)));
            }
            continue;
        }
        if (sf->num_tensors == cap) {
            cap = cap ? 2 * cap : 64;
            sf->tensors = (StTensor*)realloc(sf->tensors, cap * sizeof(StTensor));
            if (sf->tensors == NULL) { fatal("out of memory reading the header of '%s'", sf->path); }
        }
        StTensor* t = &sf->tensors[sf->num_tensors++];
        memset(t, 0, sizeof(*t));
        t->name = st_strdup_or_die(J.str.p);
        st_json_expect(&J, ':', "after an object key");
        st_parse_tensor_entry(&J, t);
    }
    st_json_end(&J);
    st_json_free(&J);
    char** names = (char**)malloc_or_die((sf->num_tensors + 1) * sizeof(char*), "tensor names");
    for (size_t i = 0; i < sf->num_tensors; i++) { names[i] = sf->tensors[i].name; }
    const char* dup = st_find_duplicate(names, sf->num_tensors);
    if (dup) {
        char pd[200];
        fatal("file '%s': duplicate key: tensor '%s' appears more than once in the header",
              sf->path, st_printable(dup, pd, sizeof(pd)));
    }
    free(names);
    st_validate(sf);
}

// Opens and fully validates a safetensors file; tensor data is read later on demand.
ST_FN void st_open(StFile* sf, const char* path) {
    memset(sf, 0, sizeof(*sf));
    if (!st_host_is_little_endian()) { fatal("safetensors files are little-endian; this host is not supported"); }
    sf->path = st_strdup_or_die(path);
    sf->f = fopen_or_die(path, "rb", "safetensors file");
    sf->file_size = file_size_or_die(sf->f, path);
    if (sf->file_size < 8) {
        fatal("file '%s' is truncated: %lld bytes, smaller than the 8-byte header length of a "
              "safetensors file", path, (long long)sf->file_size);
    }
    unsigned char lenbuf[8];
    fread_or_die(lenbuf, 1, 8, sf->f, path);
    uint64_t N = 0;
    for (int i = 7; i >= 0; i--) { N = (N << 8) | lenbuf[i]; }
    uint64_t rest = (uint64_t)sf->file_size - 8;
    if (N > ST_MAX_HEADER_BYTES) {
        fatal("file '%s': header length %llu is larger than the %llu-byte limit (file is %lld "
              "bytes): corrupt or not a safetensors file", path, (unsigned long long)N,
              (unsigned long long)ST_MAX_HEADER_BYTES, (long long)sf->file_size);
    }
    if (N > rest) {
        fatal("file '%s': header length %llu is larger than the %llu bytes that follow it: the "
              "file is truncated or not a safetensors file", path, (unsigned long long)N,
              (unsigned long long)rest);
    }
    if (N < 2) {
        fatal("file '%s': header length %llu is too small for a JSON object", path, (unsigned long long)N);
    }
    sf->header_len = N;
    sf->data_start = 8 + N;
    sf->data_len = rest - N;
    char* header = (char*)malloc_or_die((size_t)N, "the safetensors header");
    fread_or_die(header, 1, (size_t)N, sf->f, path);
    st_parse_header(sf, header, (size_t)N);
    free(header);
}

ST_FN const StTensor* st_find(const StFile* sf, const char* name) {
    for (size_t i = 0; i < sf->num_tensors; i++) {
        if (strcmp(sf->tensors[i].name, name) == 0) { return &sf->tensors[i]; }
    }
    return NULL;
}

ST_FN void st_close(StFile* sf) {
    if (sf->f) { fclose(sf->f); }
    for (size_t i = 0; i < sf->num_tensors; i++) {
        free(sf->tensors[i].name);
        free(sf->tensors[i].shape);
    }
    for (size_t i = 0; i < sf->num_metadata; i++) {
        free(sf->metadata_keys[i]);
        free(sf->metadata_values[i]);
    }
    free(sf->tensors);
    free(sf->metadata_keys);
    free(sf->metadata_values);
    free(sf->path);
    memset(sf, 0, sizeof(*sf));
}

// Exact IEEE half -> single (every half, including subnormals, infinities and NaN payloads,
// has an exact single-precision representation).
ST_FN float st_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) { bits = sign | 0x7f800000u | (mant << 13); }
    else if (exp != 0) { bits = sign | ((exp + 112u) << 23) | (mant << 13); }
    else if (mant == 0) { bits = sign; }
    else {   // subnormal: mant * 2^-24, normalized
        uint32_t e = 113;
        while (!(mant & 0x400u)) { mant <<= 1; e--; }
        bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

ST_FN float st_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Reads tensor t's raw bytes (t->nbytes) into dst.
ST_FN void st_read_raw(StFile* sf, const StTensor* t, void* dst) {
    fseek_or_die(sf->f, (int64_t)(sf->data_start + t->begin), SEEK_SET, sf->path);
    fread_or_die(dst, 1, (size_t)t->nbytes, sf->f, sf->path);
}

// Reads tensor t (F32, F16 or BF16) as fp32 into dst (t->numel floats), exactly.
ST_FN void st_read_f32(StFile* sf, const StTensor* t, float* dst) {
    char pr[200];
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16) {
        fatal("file '%s': tensor '%s' has dtype %s; expected F32, F16 or BF16", sf->path,
              st_printable(t->name, pr, sizeof(pr)), st_dtype_names[t->dtype]);
    }
    if (t->dtype == ST_F32) { st_read_raw(sf, t, dst); return; }
    fseek_or_die(sf->f, (int64_t)(sf->data_start + t->begin), SEEK_SET, sf->path);
    enum { CHUNK = 1 << 16 };
    uint16_t* buf = (uint16_t*)malloc_or_die(CHUNK * sizeof(uint16_t), "a conversion buffer");
    for (uint64_t i = 0; i < t->numel; i += CHUNK) {
        size_t n = (size_t)(t->numel - i < CHUNK ? t->numel - i : CHUNK);
        fread_or_die(buf, sizeof(uint16_t), n, sf->f, sf->path);
        if (t->dtype == ST_F16) { for (size_t j = 0; j < n; j++) { dst[i + j] = st_f16_to_f32(buf[j]); } }
        else { for (size_t j = 0; j < n; j++) { dst[i + j] = st_bf16_to_f32(buf[j]); } }
    }
    free(buf);
}

// --- the writer ------------------------------------------------------------------------------

#define ST_WRITE_MAX_RANK 8
typedef struct {
    const char* name;
    int dtype;                           // StDtype
    int rank;
    uint64_t shape[ST_WRITE_MAX_RANK];
    const void* data;                    // the bytes, or NULL: the emit callback writes them
} StWriteTensor;

// Writes exactly the tensor's bytes with atomic_writer_write(w, ...).
typedef void (*StEmitFn)(AtomicWriter* w, const StWriteTensor* t, int index, void* ctx);

static __attribute__((unused)) const StWriteTensor* st_wsort_base;
ST_FN int st_cmp_write_order(const void* a, const void* b) {
    const StWriteTensor* x = &st_wsort_base[*(const int*)a];
    const StWriteTensor* y = &st_wsort_base[*(const int*)b];
    if (x->dtype != y->dtype) { return x->dtype > y->dtype ? -1 : 1; }
    return strcmp(x->name, y->name);
}

ST_FN uint64_t st_write_nbytes(const StWriteTensor* t) {
    uint64_t n = (uint64_t)st_dtype_sizes[t->dtype];
    for (int d = 0; d < t->rank; d++) {
        if (st_mul_overflows(n, t->shape[d], &n)) { fatal("tensor '%s' is too large to write", t->name); }
    }
    return n;
}

// Writes a safetensors file (canonical form, see the top of this file), atomically.
// meta_keys/meta_values: n_meta metadata strings (n_meta = 0: no "__metadata__").
ST_FN void st_write_file(const char* path, const StWriteTensor* tensors, int n,
                          const char* const* meta_keys, const char* const* meta_values, int n_meta,
                          StEmitFn emit, void* ctx) {
    if (!st_host_is_little_endian()) { fatal("safetensors files are little-endian; this host is not supported"); }
    int* order = (int*)malloc_or_die((size_t)(n > 0 ? n : 1) * sizeof(int), "tensor order");
    for (int i = 0; i < n; i++) {
        order[i] = i;
        if (tensors[i].dtype < 0 || tensors[i].dtype >= ST_NUM_DTYPES || tensors[i].rank < 0 ||
            tensors[i].rank > ST_WRITE_MAX_RANK || strcmp(tensors[i].name, "__metadata__") == 0) {
            fatal("internal error: cannot write tensor '%s' to '%s'", tensors[i].name, path);
        }
    }
    st_wsort_base = tensors;
    qsort(order, (size_t)n, sizeof(int), st_cmp_write_order);
    for (int k = 1; k < n; k++) {
        if (strcmp(tensors[order[k - 1]].name, tensors[order[k]].name) == 0) {
            fatal("internal error: tensor '%s' given twice for '%s'", tensors[order[k]].name, path);
        }
    }
    StBuf h = {0};
    st_buf_addc(&h, '{');
    int need_comma = 0;
    if (n_meta > 0) {
        int* mo = (int*)malloc_or_die((size_t)n_meta * sizeof(int), "metadata order");
        for (int i = 0; i < n_meta; i++) { mo[i] = i; }
        for (int i = 1; i < n_meta; i++) {   // insertion sort by key (few entries)
            for (int j = i; j > 0 && strcmp(meta_keys[mo[j - 1]], meta_keys[mo[j]]) > 0; j--) {
                int tmp = mo[j]; mo[j] = mo[j - 1]; mo[j - 1] = tmp;
            }
        }
        st_buf_add(&h, "\"__metadata__\":{", 16);
        for (int i = 0; i < n_meta; i++) {
            if (i) { st_buf_addc(&h, ','); }
            st_buf_add_json_string(&h, meta_keys[mo[i]]);
            st_buf_addc(&h, ':');
            st_buf_add_json_string(&h, meta_values[mo[i]]);
        }
        st_buf_addc(&h, '}');
        free(mo);
        need_comma = 1;
    }
    uint64_t offset = 0;
    for (int k = 0; k < n; k++) {
        const StWriteTensor* t = &tensors[order[k]];
        uint64_t nb = st_write_nbytes(t);
        if (need_comma) { st_buf_addc(&h, ','); }
        need_comma = 1;
        st_buf_add_json_string(&h, t->name);
        st_buf_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_names[t->dtype]);
        for (int d = 0; d < t->rank; d++) {
            st_buf_printf(&h, d ? ",%llu" : "%llu", (unsigned long long)t->shape[d]);
        }
        st_buf_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                      (unsigned long long)(offset + nb));
        offset += nb;
    }
    st_buf_addc(&h, '}');
    while (h.len % 8 != 0) { st_buf_addc(&h, ' '); }
    if (h.len > ST_MAX_HEADER_BYTES) { fatal("the header for '%s' would be too large (%zu bytes)", path, h.len); }
    unsigned char lenbuf[8];
    for (int i = 0; i < 8; i++) { lenbuf[i] = (unsigned char)((uint64_t)h.len >> (8 * i)); }

    AtomicWriter w;
    atomic_writer_open(&w, path);
    atomic_writer_write(&w, lenbuf, 8);
    atomic_writer_write(&w, h.p, h.len);
    int64_t pos = 8 + (int64_t)h.len;
    for (int k = 0; k < n; k++) {
        const StWriteTensor* t = &tensors[order[k]];
        uint64_t nb = st_write_nbytes(t);
        if (t->data) { atomic_writer_write(&w, t->data, (size_t)nb); }
        else if (emit) { emit(&w, t, order[k], ctx); }
        else { fatal("internal error: no data for tensor '%s'", t->name); }
        pos += (int64_t)nb;
        if (ftello(w.f) != pos) {
            fatal("internal error: tensor '%s' of '%s' wrote the wrong number of bytes", t->name, path);
        }
    }
    atomic_writer_commit(&w);
    free(h.p);
    free(order);
}

#endif // LLMC_SAFETENSORS_H
