/*
 * bpe_encoder.h: GPT-2's byte-level BPE encoder, header-only (C11), for the tools that make
 * token files (dev/data/tokenize), the tests and the fuzzers; the trainer only decodes
 * (llmc/tokenizer.h, whose file format bpe_write_tokenizer_file writes).
 *
 * The exact GPT-2 encoder (OpenAI's encoder.py), loaded from encoder.json + vocab.bpe:
 *
 *      BPEEncoder b;
 *      bpe_init(&b, "encoder.json", "vocab.bpe");     // vocab.bpe may be NULL: decode only
 *      TokenIds ids = {0};
 *      bpe_encode(&b, text, len, 1, &ids);            // appends ids; never emits <|endoftext|>
 *      const uint8_t* bytes = bpe_token(&b, id, &n);  // the n bytes of one token
 *      bpe_write_tokenizer_file(&b, "gpt2_tokenizer.bin");
 *      token_ids_free(&ids); bpe_free(&b);
 *
 * bpe_encode(..., at_end = 0, ...) encodes a prefix of a stream: it stops before the
 * pre-tokens that more text could still change and returns how many bytes it consumed.
 *
 * How GPT-2 encodes text:
 *  - Pre-tokenization splits the text with the regex
 *        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *    implemented by hand in bpe_pretoken_end(), with the Unicode classes of unicode_tables.h
 *    (\s is Python's str.isspace()). Bytes that are not valid UTF-8 are taken one at a time
 *    as characters of class "other" (not a letter, number or space), so every byte string
 *    encodes and decode(encode(x)) == x.
 *  - Each pre-token's bytes start as single-byte tokens; the adjacent pair with the lowest
 *    merge rank (line of vocab.bpe) is merged, every occurrence left to right, until no
 *    pair has a rank. Results are cached per pre-token.
 *  - encoder.json's keys are token bytes written in GPT-2's byte-to-unicode alphabet:
 *    printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves, the other 68
 *    bytes for U+0100 + their index among those 68 (space 0x20 is U+0120 'Ġ').
 */
#ifndef LLMC_BPE_ENCODER_H
#define LLMC_BPE_ENCODER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/tokenizer.h"
#include "llmc/unicode_tables.h"
#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------
// growable list of token ids

typedef struct {
    uint32_t* ids;
    size_t n, cap;
} TokenIds;

static inline void token_ids_push(TokenIds* v, uint32_t id) {
    if (v->n == v->cap) {
        v->cap = v->cap ? 2 * v->cap : 1024;
        v->ids = (uint32_t*)realloc(v->ids, v->cap * sizeof(uint32_t));
        if (v->ids == NULL) { fatal("out of memory growing a token list to %zu ids", v->cap); }
    }
    v->ids[v->n++] = id;
}

static inline void token_ids_free(TokenIds* v) {
    free(v->ids);
    memset(v, 0, sizeof(*v));
}

// ----------------------------------------------------------------------------------------
// UTF-8 and character classes

// Length of the valid UTF-8 character at s[i] (i < n), storing its code point; 0 when the
// bytes there are not one (bad lead byte, bad or missing continuation, overlong form,
// surrogate, beyond U+10FFFF).
static inline int utf8_decode(const uint8_t* s, size_t n, size_t i, uint32_t* cp) {
    uint8_t c = s[i];
    if (c < 0x80) { *cp = c; return 1; }
    int len;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) { len = 2; *cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3; *cp = c & 0x0F;
        if (c == 0xE0) { lo = 0xA0; }  // overlong
        if (c == 0xED) { hi = 0x9F; }  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4; *cp = c & 0x07;
        if (c == 0xF0) { lo = 0x90; }  // overlong
        if (c == 0xF4) { hi = 0x8F; }  // beyond U+10FFFF
    } else {
        return 0;
    }
    if (n - i < (size_t)len || s[i + 1] < lo || s[i + 1] > hi) { return 0; }
    for (int k = 1; k < len; k++) {
        if ((s[i + k] & 0xC0) != 0x80) { return 0; }
        *cp = (*cp << 6) | (s[i + k] & 0x3F);
    }
    return len;
}

// UC_LETTER, UC_NUMBER, UC_SPACE or UC_OTHER (see unicode_tables.h).
static inline int unicode_class(uint32_t cp) {
    if (cp < 128) { return unicode_ascii_class[cp]; }
    size_t lo = 0, hi = UNICODE_CLASS_RANGES;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp > unicode_class_ranges[mid].last) { lo = mid + 1; }
        else if (cp < unicode_class_ranges[mid].first) { hi = mid; }
        else { return unicode_class_ranges[mid].cls; }
    }
    return UC_OTHER;
}

// Class of the character at s[i], and its length in bytes; an invalid byte is a one-byte
// character of class UC_OTHER.
static inline int char_class_at(const uint8_t* s, size_t n, size_t i, int* len) {
    if (s[i] < 0x80) { *len = 1; return unicode_ascii_class[s[i]]; }
    uint32_t cp;
    *len = utf8_decode(s, n, i, &cp);
    if (*len == 0) { *len = 1; return UC_OTHER; }
    return unicode_class(cp);
}

// End of the pre-token that starts at s[i] (i < n), with s[n] taken as the end of the text.
// The regex's alternatives, tried in order at i:
//   's 't 're 've 'm 'll 'd    (lowercase only; ASCII apostrophe)
//    ?\p{L}+  ?\p{N}+  ?[^\s\p{L}\p{N}]+    (an optional ' ' then a run of one class)
//   \s+(?!\S)   a whitespace run, minus its last character when a non-space follows it
//   \s+         a single whitespace character before a non-space
static inline size_t bpe_pretoken_end(const uint8_t* s, size_t n, size_t i) {
    if (s[i] == '\'' && i + 1 < n) {
        uint8_t c = s[i + 1];
        if (c == 's' || c == 't' || c == 'm' || c == 'd') { return i + 2; }
        if (i + 2 < n && ((c == 'r' && s[i + 2] == 'e') || (c == 'v' && s[i + 2] == 'e') ||
                          (c == 'l' && s[i + 2] == 'l'))) {
            return i + 3;
        }
    }
    int len;
    int cls = char_class_at(s, n, i, &len);
    size_t run = i;  // where the run of one class starts
    if (s[i] == ' ' && i + 1 < n) {
        int next_len;
        int next_cls = char_class_at(s, n, i + 1, &next_len);
        if (next_cls != UC_SPACE) { cls = next_cls; len = next_len; run = i + 1; }
    }
    size_t j = run + len;
    if (cls != UC_SPACE) {
        while (j < n && char_class_at(s, n, j, &len) == cls) { j += len; }
        return j;
    }
    // Whitespace, other than a ' ' that prefixes a run: \s+(?!\S) or else \s+.
    size_t last = i;  // start of the run's last character
    while (j < n && char_class_at(s, n, j, &len) == UC_SPACE) { last = j; j += len; }
    // At the end of the text, or a single character: the whole run. Otherwise the run gives
    // up its last character, which then prefixes the following pre-token (or stands alone).
    return (j == n || last == i) ? j : last;
}

// ----------------------------------------------------------------------------------------
// hash maps: byte strings -> uint32, and (left id, right id) -> merge

static inline uint64_t bytes_hash(const uint8_t* p, size_t n) {
    uint64_t h = 14695981039346656037ull;  // FNV-1a
    for (size_t i = 0; i < n; i++) { h = (h ^ p[i]) * 1099511628211ull; }
    return h | 1;  // never 0: 0 marks an empty slot
}

typedef struct {
    uint64_t hash;
    uint32_t key_off, key_len;
    uint32_t value;
} BytesMapSlot;

// Open addressing, linear probing; keys are copied into an arena.
typedef struct {
    BytesMapSlot* slots;
    size_t cap, count;  // cap: a power of two, at least twice count
    uint8_t* arena;
    size_t arena_len, arena_cap;
} BytesMap;

static inline void bytesmap_init(BytesMap* m, size_t cap) {
    memset(m, 0, sizeof(*m));
    m->cap = cap;
    m->slots = (BytesMapSlot*)calloc_or_die(cap, sizeof(BytesMapSlot), "hash map");
}

static inline uint32_t* bytesmap_find(BytesMap* m, const uint8_t* key, size_t len, uint64_t h) {
    for (size_t i = h & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        BytesMapSlot* s = &m->slots[i];
        if (s->hash == 0) { return NULL; }
        if (s->hash == h && s->key_len == len && memcmp(m->arena + s->key_off, key, len) == 0) {
            return &s->value;
        }
    }
}

static inline void bytesmap_place(BytesMap* m, BytesMapSlot slot) {
    size_t i = slot.hash & (m->cap - 1);
    while (m->slots[i].hash != 0) { i = (i + 1) & (m->cap - 1); }
    m->slots[i] = slot;
}

// Adds a key that is not in the map yet.
static inline void bytesmap_insert(BytesMap* m, const uint8_t* key, size_t len, uint64_t h,
                                   uint32_t value) {
    if (2 * (m->count + 1) > m->cap) {
        BytesMapSlot* old = m->slots;
        size_t old_cap = m->cap;
        m->cap *= 2;
        m->slots = (BytesMapSlot*)calloc_or_die(m->cap, sizeof(BytesMapSlot), "hash map");
        for (size_t i = 0; i < old_cap; i++) {
            if (old[i].hash != 0) { bytesmap_place(m, old[i]); }
        }
        free(old);
    }
    if (m->arena_len + len > UINT32_MAX) { fatal("hash map keys exceed 4 GiB"); }
    if (m->arena_len + len > m->arena_cap) {
        m->arena_cap = 2 * (m->arena_len + len) + 4096;
        m->arena = (uint8_t*)realloc(m->arena, m->arena_cap);
        if (m->arena == NULL) { fatal("out of memory growing a hash map to %zu B", m->arena_cap); }
    }
    if (len) { memcpy(m->arena + m->arena_len, key, len); }
    BytesMapSlot slot = {h, (uint32_t)m->arena_len, (uint32_t)len, value};
    m->arena_len += len;
    m->count++;
    bytesmap_place(m, slot);
}

static inline void bytesmap_clear(BytesMap* m) {
    memset(m->slots, 0, m->cap * sizeof(BytesMapSlot));
    m->count = 0;
    m->arena_len = 0;
}

static inline void bytesmap_free(BytesMap* m) {
    free(m->slots);
    free(m->arena);
    memset(m, 0, sizeof(*m));
}

typedef struct {
    uint64_t pair;    // left id << 32 | right id; PAIR_EMPTY marks an empty slot
    uint32_t rank;    // line of vocab.bpe (0 = first merge): lower merges first
    uint32_t merged;  // id of the token left+right
} PairSlot;

#define PAIR_EMPTY UINT64_MAX

static inline size_t pair_slot_index(uint64_t pair, size_t cap) {
    return (size_t)((pair * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
}

// ----------------------------------------------------------------------------------------
// the GPT-2 encoder

// The word cache is emptied when it holds this many pre-tokens or ids, so memory stays
// bounded (under ~100 MB) on corpora of any size; pre-tokens longer than WORD_CACHE_MAX_LEN
// bytes are rare and not cached.
#define WORD_CACHE_MAX_ENTRIES (1u << 19)
#define WORD_CACHE_MAX_IDS (1u << 24)
#define WORD_CACHE_MAX_LEN 128

typedef struct {
    uint32_t vocab_size;
    uint32_t eot_token;
    uint8_t* token_bytes;   // all tokens' bytes, back to back
    size_t* token_offset;   // token i is token_bytes[token_offset[i] .. token_offset[i+1])
    BytesMap vocab;         // token bytes -> id
    uint32_t byte_token[256];  // id of each single-byte token
    int has_merges;
    PairSlot* pairs;
    size_t pairs_cap;
    BytesMap word_cache;    // pre-token bytes -> offset into cache_ids
    TokenIds cache_ids;     // per cached pre-token: its id count, then its ids
    // scratch for merging one pre-token
    uint32_t *sym, *prev, *next, *pending;
    uint64_t* heap;
    size_t scratch_cap;
} BPEEncoder;

// GPT-2's byte-to-unicode alphabet (see the top of this file).
static inline int bpe_byte_is_printable(int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

// The byte a code point of the alphabet stands for, or -1 if it is not in the alphabet.
// The 68 non-printable bytes, in order, are 0x00..0x20, 0x7F..0xA0 and 0xAD.
static inline int bpe_unicode_to_byte(uint32_t cp) {
    if (cp < 256) { return bpe_byte_is_printable((int)cp) ? (int)cp : -1; }
    uint32_t k = cp - 256;  // index among the 68 other bytes
    if (k <= 0x20) { return (int)k; }
    if (k < 33 + 34) { return (int)(0x7F + (k - 33)); }
    return k == 67 ? 0xAD : -1;
}

// The inverse: writes byte b as its code point of the alphabet in UTF-8 (1 or 2 bytes, as
// encoder.json and vocab.bpe spell it); returns the count.
static inline int bpe_byte_to_unicode_utf8(uint8_t b, uint8_t out[2]) {
    uint32_t cp = b;
    if (!bpe_byte_is_printable(b)) { cp = 256 + (b <= 0x20 ? b : b <= 0xA0 ? 33 + (b - 0x7F) : 67); }
    if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
    out[0] = (uint8_t)(0xC0 | cp >> 6);
    out[1] = (uint8_t)(0x80 | (cp & 0x3F));
    return 2;
}

static inline const uint8_t* bpe_token(const BPEEncoder* b, uint32_t id, size_t* len) {
    if (id >= b->vocab_size) {
        fatal("token id %u is out of range (the vocabulary has %u tokens)", id, b->vocab_size);
    }
    *len = b->token_offset[id + 1] - b->token_offset[id];
    return b->token_bytes + b->token_offset[id];
}

static inline uint8_t* bpe_read_file(const char* path, size_t* len, const char* what) {
    FILE* f = fopen_or_die(path, "rb", what);
    size_t size = (size_t)file_size_or_die(f, path);
    uint8_t* data = (uint8_t*)malloc_or_die(size + 1, what);
    fread_or_die(data, 1, size, f, path);
    fclose(f);
    data[size] = '\0';
    *len = size;
    return data;
}

// --- encoder.json: a strict JSON parser for one object of string -> non-negative integer

typedef struct {
    const uint8_t* p;
    size_t n, i;
    const char* path;
} JsonCursor;

__attribute__((noreturn))
static inline void json_fail(const JsonCursor* c, const char* expected) {
    fatal("%s: invalid JSON at byte offset %zu: expected %s", c->path, c->i, expected);
}

static inline void json_skip_space(JsonCursor* c) {
    while (c->i < c->n && (c->p[c->i] == ' ' || c->p[c->i] == '\t' || c->p[c->i] == '\n' ||
                           c->p[c->i] == '\r')) {
        c->i++;
    }
}

static inline void json_expect(JsonCursor* c, char ch, const char* expected) {
    json_skip_space(c);
    if (c->i >= c->n || c->p[c->i] != (uint8_t)ch) { json_fail(c, expected); }
    c->i++;
}

static inline uint32_t json_hex4(JsonCursor* c) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++, c->i++) {
        int ch = c->i < c->n ? c->p[c->i] : -1;
        int d = (ch >= '0' && ch <= '9') ? ch - '0' : (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10
              : (ch >= 'A' && ch <= 'F') ? ch - 'A' + 10 : -1;
        if (d < 0) { json_fail(c, "4 hex digits after \\u"); }
        v = v * 16 + (uint32_t)d;
    }
    return v;
}

// Parses a string whose characters are all in GPT-2's byte alphabet, writing the bytes they
// stand for to out (room for as many bytes as the file has). Returns the byte count.
static inline size_t json_token_string(JsonCursor* c, uint8_t* out) {
    json_expect(c, '"', "'\"' (a string)");
    size_t len = 0;
    for (;;) {
        if (c->i >= c->n) { json_fail(c, "'\"' closing the string"); }
        size_t at = c->i;
        uint8_t ch = c->p[c->i];
        uint32_t cp;
        if (ch == '"') { c->i++; return len; }
        if (ch < 0x20) { json_fail(c, "no raw control character inside a string"); }
        if (ch == '\\') {
            c->i++;
            uint8_t e = c->i < c->n ? c->p[c->i] : 0;
            c->i++;
            switch (e) {
                case '"': cp = '"'; break;
                case '\\': cp = '\\'; break;
                case '/': cp = '/'; break;
                case 'b': cp = '\b'; break;
                case 'f': cp = '\f'; break;
                case 'n': cp = '\n'; break;
                case 'r': cp = '\r'; break;
                case 't': cp = '\t'; break;
                case 'u':
                    cp = json_hex4(c);
                    if (cp >= 0xDC00 && cp <= 0xDFFF) {
                        c->i = at;
                        json_fail(c, "a high surrogate before a low surrogate \\uDC00..\\uDFFF");
                    }
                    if (cp >= 0xD800 && cp <= 0xDBFF) {
                        if (c->i + 1 >= c->n || c->p[c->i] != '\\' || c->p[c->i + 1] != 'u') {
                            json_fail(c, "\\u low surrogate after a high surrogate");
                        }
                        c->i += 2;
                        uint32_t low = json_hex4(c);
                        if (low < 0xDC00 || low > 0xDFFF) {
                            c->i -= 6;
                            json_fail(c, "\\u low surrogate (DC00..DFFF) after a high surrogate");
                        }
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                    }
                    break;
                default:
                    c->i = at;
                    json_fail(c, "an escape \\\" \\\\ \\/ \\b \\f \\n \\r \\t or \\uXXXX");
            }
        } else {
            int n = utf8_decode(c->p, c->n, c->i, &cp);
            if (n == 0) { json_fail(c, "valid UTF-8"); }
            c->i += n;
        }
        int byte = bpe_unicode_to_byte(cp);
        if (byte < 0) {
            c->i = at;
            json_fail(c, "a character of GPT-2's byte-to-unicode alphabet (U+0021..U+0143)");
        }
        out[len++] = (uint8_t)byte;
    }
}

static inline uint32_t json_token_id(JsonCursor* c) {
    json_skip_space(c);
    size_t start = c->i;
    uint64_t v = 0;
    while (c->i < c->n && c->p[c->i] >= '0' && c->p[c->i] <= '9' && v <= UINT32_MAX) {
        v = v * 10 + (c->p[c->i++] - '0');
    }
    int digits = (int)(c->i - start);
    int bad_next = c->i < c->n && (c->p[c->i] == '.' || c->p[c->i] == 'e' || c->p[c->i] == 'E' ||
                                   (c->p[c->i] >= '0' && c->p[c->i] <= '9'));
    if (digits == 0 || (digits > 1 && c->p[start] == '0') || bad_next || v >= UINT32_MAX) {
        c->i = start;
        json_fail(c, "a token id (a non-negative integer below 2^32-1, no leading zeros)");
    }
    return (uint32_t)v;
}

static inline void bpe_load_encoder_json(BPEEncoder* b, const char* path) {
    size_t n;
    uint8_t* text = bpe_read_file(path, &n, "GPT-2 encoder.json");
    uint8_t* key = (uint8_t*)malloc_or_die(n + 1, "encoder.json key");
    // Tokens in file order first; placed by id once all ids are known to be 0..N-1.
    size_t cap = 65536, count = 0;
    uint32_t* ids = (uint32_t*)malloc_or_die(cap * sizeof(uint32_t), "encoder.json ids");
    size_t* key_at = (size_t*)malloc_or_die((cap + 1) * sizeof(size_t), "encoder.json keys");
    BytesMap* keys = &b->vocab;  // token bytes -> id, in file order
    bytesmap_init(keys, 1 << 17);

    JsonCursor c = {text, n, 0, path};
    json_expect(&c, '{', "'{' (encoder.json is one JSON object)");
    json_skip_space(&c);
    int empty = c.i < n && text[c.i] == '}';
    while (!empty) {
        json_skip_space(&c);
        size_t key_start = c.i;
        size_t len = json_token_string(&c, key);
        if (len == 0) {
            c.i = key_start;
            json_fail(&c, "a non-empty key (every token has at least one byte)");
        }
        uint64_t h = bytes_hash(key, len);
        if (bytesmap_find(keys, key, len, h)) {
            c.i = key_start;
            json_fail(&c, "no duplicate key");
        }
        json_expect(&c, ':', "':' after the key");
        uint32_t id = json_token_id(&c);
        if (count == cap) {
            cap *= 2;
            ids = (uint32_t*)realloc(ids, cap * sizeof(uint32_t));
            key_at = (size_t*)realloc(key_at, (cap + 1) * sizeof(size_t));
            if (!ids || !key_at) { fatal("out of memory reading %s", path); }
        }
        key_at[count] = keys->arena_len;
        ids[count++] = id;
        bytesmap_insert(keys, key, len, h, id);
        json_skip_space(&c);
        if (c.i < n && text[c.i] == ',') { c.i++; continue; }
        break;
    }
    json_expect(&c, '}', "',' or '}' after a value");
    json_skip_space(&c);
    if (c.i != n) { json_fail(&c, "the end of the file after the object"); }
    if (count == 0) { fatal("%s: the object is empty: expected GPT-2's vocabulary", path); }

    // ids must be exactly 0..count-1: token i's bytes are the key whose value is i.
    b->vocab_size = (uint32_t)count;
    size_t* key_of_id = (size_t*)malloc_or_die(count * sizeof(size_t), "encoder.json ids");
    uint8_t* seen = (uint8_t*)calloc_or_die(count, 1, "encoder.json ids");
    b->token_bytes = (uint8_t*)malloc_or_die(keys->arena_len, "token bytes");
    b->token_offset = (size_t*)malloc_or_die((count + 1) * sizeof(size_t), "token offsets");
    for (size_t k = 0; k < count; k++) {
        if (ids[k] >= count || seen[ids[k]]) {
            fatal("%s: token ids must be 0..%zu, each once; found id %u %s", path, count - 1,
                  ids[k], ids[k] >= count ? "out of that range" : "twice");
        }
        seen[ids[k]] = 1;
        key_of_id[ids[k]] = k;
    }
    key_at[count] = keys->arena_len;  // so key k is arena[key_at[k] .. key_at[k+1])
    size_t off = 0;
    for (size_t id = 0; id < count; id++) {
        size_t k = key_of_id[id], len = key_at[k + 1] - key_at[k];
        b->token_offset[id] = off;
        memcpy(b->token_bytes + off, keys->arena + key_at[k], len);
        off += len;
    }
    b->token_offset[count] = off;
    for (int byte = 0; byte < 256; byte++) {
        uint8_t one = (uint8_t)byte;
        uint32_t* id = bytesmap_find(&b->vocab, &one, 1, bytes_hash(&one, 1));
        if (id == NULL) {
            fatal("%s: no token for the single byte 0x%02X: every byte needs one", path, byte);
        }
        b->byte_token[byte] = *id;
    }
    const char* eot = "<|endoftext|>";
    uint32_t* eot_id = bytesmap_find(&b->vocab, (const uint8_t*)eot, strlen(eot),
                                     bytes_hash((const uint8_t*)eot, strlen(eot)));
    if (eot_id == NULL) { fatal("%s: no \"<|endoftext|>\" token", path); }
    b->eot_token = *eot_id;

    free(seen); free(key_of_id); free(key_at); free(ids); free(key); free(text);
}

// Bytes a vocab.bpe token (written in the byte-to-unicode alphabet) stands for; -1 if invalid.
static inline long bpe_merge_part(const uint8_t* s, size_t n, uint8_t* out) {
    size_t len = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = utf8_decode(s, n, i, &cp);
        int byte = k ? bpe_unicode_to_byte(cp) : -1;
        if (byte < 0) { return -1; }
        out[len++] = (uint8_t)byte;
        i += k;
    }
    return (long)len;
}

static inline uint32_t bpe_lookup_part(BPEEncoder* b, const uint8_t* bytes, size_t len,
                                       const char* path, size_t line, const char* encoder_path) {
    uint32_t* id = bytesmap_find(&b->vocab, bytes, len, bytes_hash(bytes, len));
    if (id == NULL) {
        fatal("%s line %zu: the merge uses or makes a token that is not in %s", path, line,
              encoder_path);
    }
    return *id;
}

static inline void bpe_load_merges(BPEEncoder* b, const char* path, const char* encoder_path) {
    size_t n;
    uint8_t* text = bpe_read_file(path, &n, "GPT-2 vocab.bpe");
    const char* header = "#version";
    if (n < strlen(header) || memcmp(text, header, strlen(header)) != 0) {
        fatal("%s: expected the first line to be '#version: 0.2' (GPT-2's vocab.bpe)", path);
    }
    size_t lines = 0;
    for (size_t i = 0; i < n; i++) { lines += text[i] == '\n'; }
    b->pairs_cap = 16;
    while (b->pairs_cap < 2 * (lines + 1)) { b->pairs_cap *= 2; }
    b->pairs = (PairSlot*)malloc_or_die(b->pairs_cap * sizeof(PairSlot), "merge table");
    for (size_t k = 0; k < b->pairs_cap; k++) { b->pairs[k].pair = PAIR_EMPTY; }
    uint8_t* buf = (uint8_t*)malloc_or_die(n + 1, "vocab.bpe line");

    const uint8_t* p = (const uint8_t*)memchr(text, '\n', n);
    size_t i = p ? (size_t)(p - text) + 1 : n;
    uint32_t rank = 0;
    for (size_t line = 2; i < n; line++) {
        const uint8_t* nl = (const uint8_t*)memchr(text + i, '\n', n - i);
        size_t end = nl ? (size_t)(nl - text) : n;
        const uint8_t* sp = (const uint8_t*)memchr(text + i, ' ', end - i);
        long left_len = sp ? bpe_merge_part(text + i, (size_t)(sp - text) - i, buf) : -1;
        long right_len = left_len > 0 ? bpe_merge_part(sp + 1, end - (size_t)(sp - text) - 1,
                                                       buf + left_len) : -1;
        if (left_len <= 0 || right_len <= 0) {
            fatal("%s line %zu: expected a merge 'A B': two tokens of GPT-2's byte-to-unicode "
                  "alphabet separated by one space", path, line);
        }
        uint32_t left = bpe_lookup_part(b, buf, left_len, path, line, encoder_path);
        uint32_t right = bpe_lookup_part(b, buf + left_len, right_len, path, line, encoder_path);
        uint32_t merged = bpe_lookup_part(b, buf, left_len + right_len, path, line, encoder_path);
        uint64_t pair = (uint64_t)left << 32 | right;
        size_t k = pair_slot_index(pair, b->pairs_cap);
        while (b->pairs[k].pair != PAIR_EMPTY && b->pairs[k].pair != pair) {
            k = (k + 1) & (b->pairs_cap - 1);
        }
        // (encoder.py's dict would quietly keep the later rank; a repeat means a broken file)
        if (b->pairs[k].pair == pair) { fatal("%s line %zu: duplicate merge", path, line); }
        b->pairs[k] = (PairSlot){pair, rank++, merged};
        i = end + 1;
    }
    b->has_merges = 1;
    free(buf);
    free(text);
}

// Loads encoder.json and (unless merges_path is NULL, for decoding only) vocab.bpe.
static inline void bpe_init(BPEEncoder* b, const char* encoder_path, const char* merges_path) {
    memset(b, 0, sizeof(*b));
    bpe_load_encoder_json(b, encoder_path);
    if (merges_path) { bpe_load_merges(b, merges_path, encoder_path); }
    bytesmap_init(&b->word_cache, 1 << 16);
}

static inline void bpe_free(BPEEncoder* b) {
    free(b->token_bytes); free(b->token_offset); free(b->pairs);
    bytesmap_free(&b->vocab);
    bytesmap_free(&b->word_cache);
    token_ids_free(&b->cache_ids);
    free(b->sym); free(b->prev); free(b->next); free(b->pending); free(b->heap);
    memset(b, 0, sizeof(*b));
}

// The merge of the pair (left, right), or NULL when vocab.bpe has none.
static inline const PairSlot* bpe_find_pair(const BPEEncoder* b, uint32_t left, uint32_t right) {
    uint64_t pair = (uint64_t)left << 32 | right;
    for (size_t k = pair_slot_index(pair, b->pairs_cap);; k = (k + 1) & (b->pairs_cap - 1)) {
        if (b->pairs[k].pair == pair) { return &b->pairs[k]; }
        if (b->pairs[k].pair == PAIR_EMPTY) { return NULL; }
    }
}

// Min-heap of (rank << 32 | position): lowest rank first, leftmost first within a rank.
static inline void heap_push(uint64_t* heap, size_t* n, uint64_t v) {
    size_t i = (*n)++;
    while (i > 0 && heap[(i - 1) / 2] > v) { heap[i] = heap[(i - 1) / 2]; i = (i - 1) / 2; }
    heap[i] = v;
}

static inline uint64_t heap_pop(uint64_t* heap, size_t* n) {
    uint64_t top = heap[0], v = heap[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) { break; }
        if (c + 1 < *n && heap[c + 1] < heap[c]) { c++; }
        if (heap[c] >= v) { break; }
        heap[i] = heap[c];
        i = c;
    }
    if (*n > 0) { heap[i] = v; }
    return top;
}

#define BPE_NONE UINT32_MAX

// Pushes the pair that starts at symbol i, if it has a merge.
static inline void bpe_push_pair(BPEEncoder* b, size_t* heap_n, uint32_t i) {
    if (i == BPE_NONE || b->next[i] == BPE_NONE) { return; }
    const PairSlot* m = bpe_find_pair(b, b->sym[i], b->sym[b->next[i]]);
    if (m) { heap_push(b->heap, heap_n, (uint64_t)m->rank << 32 | i); }
}

// GPT-2's bpe() on one pre-token, appending its ids. encoder.py merges, in each round, the
// lowest-ranked pair at every place it occurs (left to right, not overlapping), then looks
// for the next lowest pair. Here the symbols form a linked list and the candidate pairs a
// heap, so a pre-token of n bytes costs O(n log n). Pairs created by a round are pushed only
// after the round, since one of them may rank below the pair being merged.
static inline void bpe_merge_word(BPEEncoder* b, const uint8_t* w, size_t n, TokenIds* out) {
    if (n == 1) { token_ids_push(out, b->byte_token[w[0]]); return; }
    if (n >= BPE_NONE) { fatal("a single pre-token of %zu bytes is too long to encode", n); }
    if (n > b->scratch_cap) {
        b->scratch_cap = n > 2 * b->scratch_cap ? n : 2 * b->scratch_cap;
        free(b->sym); free(b->prev); free(b->next); free(b->pending); free(b->heap);
        b->sym = (uint32_t*)malloc_or_die(b->scratch_cap * sizeof(uint32_t), "BPE scratch");
        b->prev = (uint32_t*)malloc_or_die(b->scratch_cap * sizeof(uint32_t), "BPE scratch");
        b->next = (uint32_t*)malloc_or_die(b->scratch_cap * sizeof(uint32_t), "BPE scratch");
        b->pending = (uint32_t*)malloc_or_die(b->scratch_cap * sizeof(uint32_t), "BPE scratch");
        // each merge pushes at most 2 pairs, on top of the n-1 initial ones
        b->heap = (uint64_t*)malloc_or_die(3 * b->scratch_cap * sizeof(uint64_t), "BPE scratch");
    }
    size_t heap_n = 0;
    for (uint32_t i = 0; i < n; i++) {
        b->sym[i] = b->byte_token[w[i]];
        b->prev[i] = i > 0 ? i - 1 : BPE_NONE;
        b->next[i] = i + 1 < n ? i + 1 : BPE_NONE;
    }
    for (uint32_t i = 0; i + 1 < n; i++) { bpe_push_pair(b, &heap_n, i); }
    while (heap_n > 0) {
        uint32_t rank = (uint32_t)(b->heap[0] >> 32);
        size_t merged_n = 0;
        while (heap_n > 0 && (uint32_t)(b->heap[0] >> 32) == rank) {
            uint32_t i = (uint32_t)heap_pop(b->heap, &heap_n);
            // Skip stale entries: symbol i was merged away, or the pair at i is no longer the
            // one pushed (each pair has its own rank, so comparing ranks compares pairs).
            if (b->sym[i] == BPE_NONE || b->next[i] == BPE_NONE) { continue; }
            const PairSlot* m = bpe_find_pair(b, b->sym[i], b->sym[b->next[i]]);
            if (m == NULL || m->rank != rank) { continue; }
            uint32_t j = b->next[i];
            b->sym[i] = m->merged;
            b->next[i] = b->next[j];
            if (b->next[j] != BPE_NONE) { b->prev[b->next[j]] = i; }
            b->sym[j] = BPE_NONE;
            b->pending[merged_n++] = i;
        }
        for (size_t k = 0; k < merged_n; k++) {
            uint32_t i = b->pending[k];
            bpe_push_pair(b, &heap_n, b->prev[i]);
            bpe_push_pair(b, &heap_n, i);
        }
    }
    for (uint32_t i = 0; i != BPE_NONE; i = b->next[i]) { token_ids_push(out, b->sym[i]); }
}

static inline void bpe_encode_word(BPEEncoder* b, const uint8_t* w, size_t n, TokenIds* out) {
    if (n > WORD_CACHE_MAX_LEN) { bpe_merge_word(b, w, n, out); return; }
    uint64_t h = bytes_hash(w, n);
    uint32_t* at = bytesmap_find(&b->word_cache, w, n, h);
    if (at) {
        const uint32_t* cached = b->cache_ids.ids + *at;
        for (uint32_t k = 1; k <= cached[0]; k++) { token_ids_push(out, cached[k]); }
        return;
    }
    size_t first = out->n;
    bpe_merge_word(b, w, n, out);
    if (b->word_cache.count >= WORD_CACHE_MAX_ENTRIES || b->cache_ids.n >= WORD_CACHE_MAX_IDS) {
        bytesmap_clear(&b->word_cache);
        b->cache_ids.n = 0;
    }
    uint32_t offset = (uint32_t)b->cache_ids.n;
    token_ids_push(&b->cache_ids, (uint32_t)(out->n - first));
    for (size_t k = first; k < out->n; k++) { token_ids_push(&b->cache_ids, out->ids[k]); }
    bytesmap_insert(&b->word_cache, w, n, h, offset);
}

// Appends the ids of text[0..n) to out and returns the number of bytes encoded: all n when
// at_end, else only up to the last pre-token that the bytes after text[n] cannot change.
// A pre-token is settled once 8 more bytes follow it: deciding where it ends looks at most
// at the character after it (or, for whitespace, after the character it gives back).
static inline size_t bpe_encode(BPEEncoder* b, const uint8_t* text, size_t n, int at_end,
                                TokenIds* out) {
    if (!b->has_merges) { fatal("bpe_encode: the encoder was loaded without vocab.bpe"); }
    size_t i = 0;
    while (i < n) {
        size_t end = bpe_pretoken_end(text, n, i);
        if (!at_end && end + 8 > n) { break; }
        bpe_encode_word(b, text + i, end - i, out);
        i = end;
    }
    return i;
}

// Writes llm.c's tokenizer file (version 2) for this vocabulary, atomically.
static inline void bpe_write_tokenizer_file(const BPEEncoder* b, const char* path) {
    uint32_t header[256] = {TOKENIZER_MAGIC, 2, b->vocab_size, b->eot_token};
    AtomicWriter w;
    atomic_writer_open(&w, path);
    atomic_writer_write(&w, header, sizeof(header));
    for (uint32_t id = 0; id < b->vocab_size; id++) {
        size_t len;
        const uint8_t* bytes = bpe_token(b, id, &len);
        if (len == 0 || len > 255) {
            fatal("cannot write '%s': token %u has %zu bytes, the format allows 1..255", path,
                  id, len);
        }
        uint8_t length = (uint8_t)len;
        atomic_writer_write(&w, &length, 1);
        atomic_writer_write(&w, bytes, len);
    }
    atomic_writer_commit(&w);
}

#endif // LLMC_BPE_ENCODER_H
