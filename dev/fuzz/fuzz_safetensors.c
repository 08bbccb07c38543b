/*
 * fuzz_safetensors: Hugging Face safetensors files (dev/tools/safetensors.h st_open,
 * st_read_f32, st_read_raw) and, on a second input file when there is one, the strict JSON
 * reader of config.json (st_json_get_ints). Independent check: an accepted file written back
 * by st_write_file and re-opened holds the same tensors (names, dtypes, shapes, bytes) and
 * metadata.
 */
#include "dev/fuzz/fuzz.h"
#include "dev/tools/safetensors.h"

__attribute__((noreturn)) static void disagree(const char* what, const char* name) {
    fprintf(stderr, "fuzz_safetensors: the file written back differs: %s of '%s'\n", what, name);
    abort();
}

// The bytes of every tensor, read through the reader's public functions.
static uint8_t** read_all(StFile* sf) {
    uint8_t** bytes = (uint8_t**)calloc(sf->num_tensors + 1, sizeof(uint8_t*));
    for (size_t i = 0; i < sf->num_tensors; i++) {
        const StTensor* t = &sf->tensors[i];
        bytes[i] = (uint8_t*)malloc(t->nbytes + 1);   // nbytes <= the file size (st_validate)
        st_read_raw(sf, t, bytes[i]);
        if (t->dtype == ST_F32 || t->dtype == ST_F16 || t->dtype == ST_BF16) {
            float* f = (float*)malloc(t->numel * sizeof(float) + 1);
            st_read_f32(sf, t, f);
            free(f);
        }
    }
    return bytes;
}

static void free_all(uint8_t** bytes, size_t n) {
    for (size_t i = 0; i < n; i++) { free(bytes[i]); }
    free(bytes);
}

static void check_written_back(StFile* sf, uint8_t** bytes) {
    for (size_t i = 0; i < sf->num_tensors; i++) {
        if (sf->tensors[i].rank > ST_WRITE_MAX_RANK) { return; }   // beyond what the writer takes
    }
    StWriteTensor* w = (StWriteTensor*)calloc(sf->num_tensors + 1, sizeof(StWriteTensor));
    for (size_t i = 0; i < sf->num_tensors; i++) {
        const StTensor* t = &sf->tensors[i];
        w[i].name = t->name;
        w[i].dtype = t->dtype;
        w[i].rank = t->rank;
        if (t->rank) { memcpy(w[i].shape, t->shape, (size_t)t->rank * sizeof(uint64_t)); }
        w[i].data = bytes[i];
    }
    char copy[300];
    snprintf(copy, sizeof(copy), "%s/copy.safetensors", fuzz_workdir());
    st_write_file(copy, w, (int)sf->num_tensors, (const char* const*)sf->metadata_keys,
                  (const char* const*)sf->metadata_values, (int)sf->num_metadata, NULL, NULL);
    free(w);
    static StFile again;
    st_open(&again, copy);
    if (again.num_tensors != sf->num_tensors || again.num_metadata != sf->num_metadata) {
        disagree("the number of tensors or metadata entries", copy);
    }
    for (size_t i = 0; i < sf->num_tensors; i++) {
        const StTensor* t = &sf->tensors[i];
        const StTensor* u = st_find(&again, t->name);
        if (u == NULL) { disagree("presence", t->name); }
        if (u->dtype != t->dtype || u->rank != t->rank ||
            (t->rank && memcmp(u->shape, t->shape, (size_t)t->rank * sizeof(uint64_t)) != 0)) {
            disagree("dtype or shape", t->name);
        }
        uint8_t* b = (uint8_t*)malloc(u->nbytes + 1);
        st_read_raw(&again, u, b);
        if (memcmp(b, bytes[i], t->nbytes) != 0) { disagree("bytes", t->name); }
        free(b);
    }
    for (size_t i = 0; i < sf->num_metadata; i++) {
        size_t j = 0;
        while (j < again.num_metadata && strcmp(again.metadata_keys[j], sf->metadata_keys[i]) != 0) { j++; }
        if (j == again.num_metadata || strcmp(again.metadata_values[j], sf->metadata_values[i]) != 0) {
            disagree("metadata", sf->metadata_keys[i]);
        }
    }
    st_close(&again);
}

// Each parse has its own FUZZ_BEGIN: a rejection returns from that function only.
static int parse_safetensors(const char* path) {
    FUZZ_BEGIN();
    static StFile sf;
    st_open(&sf, path);
    uint8_t** bytes = read_all(&sf);
    check_written_back(&sf, bytes);
    free_all(bytes, sf.num_tensors);
    st_close(&sf);
    fuzz_expect_nothing_live("st_close");
    return 0;
}

static int parse_config_json(const uint8_t* data, size_t size) {
    const char* path = fuzz_write_file(1, "config.json", data, size);   // read from memory; named in messages
    FUZZ_BEGIN();
    static const char* const keys[] = {"n_head", "n_embd", "n_layer", "vocab_size"};
    long values[4];
    int found[4];
    st_json_get_ints(path, (const char*)data, size, 4, keys, values, found);
    fuzz_expect_nothing_live("st_json_get_ints");
    return 0;
}

// Input: a safetensors file, optionally followed by a config.json.
int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    FuzzFiles files = fuzz_split(data, size);
    parse_safetensors(fuzz_write_file(0, "model.safetensors", files.data[0], files.size[0]));
    if (files.n > 1) { parse_config_json(files.data[1], files.size[1]); }
    return 0;
}
