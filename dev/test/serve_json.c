/*
 * serve_json.c: what test_serve.sh reads out of the server's answers, with cJSON (the shell has
 * no JSON parser of its own).
 *
 *   serve_json FILE [PATH...]   FILE must hold one JSON value; prints each PATH (keys and array
 *                               indices joined by dots, e.g. choices.0.token_ids) on a line:
 *                               an array of numbers comma-separated, anything else (a string
 *                               too) as compact JSON
 *   serve_json --sse FILE       FILE must be a complete server-sent event stream of completion
 *                               chunks: every `data:` line JSON, the last one `data: [DONE]`;
 *                               prints the text the chunks carry (a JSON string), then the
 *                               finish_reason, then the usage's completion_tokens (or -1)
 * Exits 1 with one line on stderr when FILE is not what it should be, 2 when a PATH is absent.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>

static char* read_all(const char* path, size_t* n) {
    FILE* f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "error: %s: cannot open\n", path); exit(1); }
    size_t cap = 1 << 16;
    char* buf = malloc(cap + 1);
    *n = 0;
    size_t got;
    while ((got = fread(buf + *n, 1, cap - *n, f)) > 0) {
        *n += got;
        if (*n == cap) { cap *= 2; buf = realloc(buf, cap + 1); }
    }
    fclose(f);
    buf[*n] = '\0';
    return buf;
}

static const cJSON* at_path(const cJSON* v, const char* path) {
    char *copy = strdup(path), *state;
    for (char* key = strtok_r(copy, ".", &state); key && v; key = strtok_r(NULL, ".", &state)) {
        char* end;
        long i = strtol(key, &end, 10);
        v = *end == '\0' && cJSON_IsArray(v) ? cJSON_GetArrayItem(v, (int)i) : cJSON_GetObjectItemCaseSensitive(v, key);
    }
    free(copy);
    return v;
}

static void print_value(const cJSON* v) {
    if (cJSON_IsArray(v) && (cJSON_GetArraySize(v) == 0 || cJSON_IsNumber(cJSON_GetArrayItem(v, 0)))) {
        const cJSON* x;
        int first = 1;
        cJSON_ArrayForEach(x, v) { printf(first ? "%d" : ",%d", x->valueint); first = 0; }
    } else {
        char* s = cJSON_PrintUnformatted(v);
        fputs(s, stdout);
        free(s);
    }
    putchar('\n');
}

static int sse(const char* path) {
    size_t n;
    char* buf = read_all(path, &n);
    size_t tcap = n + 1, tlen = 0;
    char* text = calloc(tcap, 1);
    char finish[64] = "null";
    int done = 0, completion_tokens = -1;
    for (char* line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == ':' || line[0] == '\r') { continue; }   // comments
        if (strncmp(line, "data: ", 6) != 0) { fprintf(stderr, "error: %s: a line that is not an SSE field: %.60s\n", path, line); return 1; }
        if (done) { fprintf(stderr, "error: %s: an event after data: [DONE]\n", path); return 1; }
        if (strcmp(line + 6, "[DONE]") == 0) { done = 1; continue; }
        cJSON* ev = cJSON_Parse(line + 6);
        if (!ev) { fprintf(stderr, "error: %s: an event that is not JSON: %.60s\n", path, line + 6); return 1; }
        const cJSON* piece = at_path(ev, "choices.0.text");
        if (!piece) { piece = at_path(ev, "choices.0.delta.content"); }
        if (cJSON_IsString(piece)) {
            size_t k = strlen(piece->valuestring);
            memcpy(text + tlen, piece->valuestring, k);
            tlen += k;
        }
        const cJSON* fr = at_path(ev, "choices.0.finish_reason");
        if (cJSON_IsString(fr)) { snprintf(finish, sizeof(finish), "%s", fr->valuestring); }
        const cJSON* ct = at_path(ev, "usage.completion_tokens");
        if (cJSON_IsNumber(ct)) { completion_tokens = ct->valueint; }
        cJSON_Delete(ev);
    }
    if (!done) { fprintf(stderr, "error: %s: the stream does not end with data: [DONE]\n", path); return 1; }
    cJSON* t = cJSON_CreateString(text);
    char* quoted = cJSON_PrintUnformatted(t);
    printf("%s\n%s\n%d\n", quoted, finish, completion_tokens);
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 3 && strcmp(argv[1], "--sse") == 0) { return sse(argv[2]); }
    if (argc < 2) { fprintf(stderr, "usage: serve_json FILE [PATH...] | serve_json --sse FILE\n"); return 1; }
    size_t n;
    char* buf = read_all(argv[1], &n);
    cJSON* root = cJSON_ParseWithLength(buf, n);
    if (!root) { fprintf(stderr, "error: %s: not valid JSON: %.80s\n", argv[1], buf); return 1; }
    for (int i = 2; i < argc; i++) {
        const cJSON* v = at_path(root, argv[i]);
        if (!v) { fprintf(stderr, "error: %s: no %s in %.200s\n", argv[1], argv[i], buf); return 2; }
        print_value(v);
    }
    return 0;
}
