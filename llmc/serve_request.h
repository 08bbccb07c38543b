/*
 * serve_request.h: an OpenAI request body (JSON, parsed by cJSON) to the engine's request
 * parameters, or the OpenAI-style error that answers it (serve_gpt2.c; fuzzed by
 * dev/fuzz/fuzz_serve_request.c).
 *
 * /v1/completions: prompt (a string, or an array of token ids), max_tokens (default 16),
 * temperature (default 1; 0 = greedy), top_p (1), top_k (0 = off, as -1), seed (in [1, 2^53];
 * default 1337, the trainer's sampler's), stop (a string or up to 4), stream, stream_options.include_usage,
 * ignore_eos (vLLM's), n (1 only), model (must name the served model when given). Other fields
 * OpenAI clients send (user, logprobs: null, echo: false, ...) are ignored.
 * /v1/chat/completions: messages [{role, content}] become the plain template
 *     "<role>: <content>\n" for each message, then "assistant:"
 * (GPT-2 has no chat template of its own); the other fields as above.
 */
#ifndef LLMC_SERVE_REQUEST_H
#define LLMC_SERVE_REQUEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>

#define SERVE_MAX_STOP 4
#define SERVE_DEFAULT_SEED 1337

typedef struct {
    int max_prompt;             // tokens a prompt may have: maxT - 1
    int vocab_size;
    const char* model_name;
    // text -> token ids (malloc'd into *ids); returns the count
    int (*encode)(void* ctx, const char* text, size_t n, int** ids);
    void* encode_ctx;
} ServeLimits;

typedef struct {
    int* prompt;
    int num_prompt;
    int max_tokens, top_k, stream, include_usage, ignore_eos;
    float temperature, top_p;
    uint64_t seed;
    char** stop;
    int num_stop;
} ServeParams;

typedef struct {
    int status;             // HTTP status
    const char* type;       // OpenAI's error type
    char param[32];         // the field at fault, "" for none
    char message[256];
} ServeError;

static inline int serve_fail(ServeError* err, int status, const char* param, const char* fmt, const char* detail) {
    err->status = status;
    err->type = status == 404 ? "not_found_error" : "invalid_request_error";
    snprintf(err->param, sizeof(err->param), "%s", param);
    snprintf(err->message, sizeof(err->message), fmt, detail);
    return 0;
}

static inline void serve_params_free(ServeParams* p) {
    free(p->prompt);
    for (int i = 0; i < p->num_stop; i++) { free(p->stop[i]); }
    free(p->stop);
    memset(p, 0, sizeof(*p));
}

// An optional number field in [lo, hi] (integral when `integer`) into *out; 0 on a wrong type.
static inline int serve_number(const cJSON* root, const char* name, double lo, double hi, int integer, double* out,
                               ServeError* err) {
    const cJSON* v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (v == NULL || cJSON_IsNull(v)) { return 1; }
    char range[96];
    snprintf(range, sizeof(range), "%s in [%g, %g]", integer ? "an integer" : "a number", lo, hi);
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < lo || v->valuedouble > hi ||
        (integer && v->valuedouble != floor(v->valuedouble))) {
        char msg[160];
        snprintf(msg, sizeof(msg), "'%s' must be %s", name, range);
        return serve_fail(err, 400, name, "%s", msg);
    }
    *out = v->valuedouble;
    return 1;
}

static inline int serve_bool(const cJSON* root, const char* name, int* out, ServeError* err) {
    const cJSON* v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (v == NULL || cJSON_IsNull(v)) { return 1; }
    if (!cJSON_IsBool(v)) { return serve_fail(err, 400, name, "'%s' must be true or false", name); }
    *out = cJSON_IsTrue(v);
    return 1;
}

// messages [{role, content}] -> the plain chat template (malloc'd)
static inline char* serve_chat_text(const cJSON* messages, ServeError* err) {
    if (!cJSON_IsArray(messages) || cJSON_GetArraySize(messages) == 0) {
        serve_fail(err, 400, "messages", "%s", "'messages' must be a non-empty array of {role, content}");
        return NULL;
    }
    size_t len = 0, cap = 256;
    char* text = (char*)malloc(cap);
    const cJSON* m;
    cJSON_ArrayForEach(m, messages) {
        const cJSON* role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON* content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsString(role) || !cJSON_IsString(content)) {
            free(text);
            serve_fail(err, 400, "messages", "%s", "each message must have a string 'role' and a string 'content'");
            return NULL;
        }
        size_t need = len + strlen(role->valuestring) + strlen(content->valuestring) + 16;
        if (need > cap) {
            cap = 2 * need;
            text = (char*)realloc(text, cap);
        }
        len += (size_t)sprintf(text + len, "%s: %s\n", role->valuestring, content->valuestring);
    }
    if (len + 16 > cap) { text = (char*)realloc(text, len + 16); }
    strcpy(text + len, "assistant:");
    return text;
}

static inline int serve_parse_prompt(const cJSON* prompt, const char* chat_text, const ServeLimits* lim, ServeParams* p,
                                     ServeError* err) {
    if (chat_text || cJSON_IsString(prompt)) {
        const char* text = chat_text ? chat_text : prompt->valuestring;
        if (!lim->encode) { return serve_fail(err, 400, "prompt", "%s", "this server takes token-id prompts only"); }
        p->num_prompt = lim->encode(lim->encode_ctx, text, strlen(text), &p->prompt);
    } else if (cJSON_IsArray(prompt)) {
        int n = cJSON_GetArraySize(prompt);
        p->prompt = (int*)malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
        const cJSON* id;
        cJSON_ArrayForEach(id, prompt) {
            if (cJSON_IsString(id) || cJSON_IsArray(id)) {
                return serve_fail(err, 400, "prompt", "%s", "one prompt per request: a string or an array of token ids");
            }
            if (!cJSON_IsNumber(id) || id->valuedouble != floor(id->valuedouble) || id->valuedouble < 0 ||
                id->valuedouble >= lim->vocab_size) {
                char msg[96];
                snprintf(msg, sizeof(msg), "token ids must be integers in [0, %d)", lim->vocab_size);
                return serve_fail(err, 400, "prompt", "%s", msg);
            }
            p->prompt[p->num_prompt++] = (int)id->valuedouble;
        }
    } else {
        return serve_fail(err, 400, "prompt", "%s", "'prompt' must be a string or an array of token ids");
    }
    if (p->num_prompt == 0) { return serve_fail(err, 400, chat_text ? "messages" : "prompt", "%s", "the prompt is empty"); }
    if (p->num_prompt > lim->max_prompt) {
        char msg[128];
        snprintf(msg, sizeof(msg), "the prompt has %d tokens; this model's context holds %d (maxT %d, one left to generate)",
                 p->num_prompt, lim->max_prompt, lim->max_prompt + 1);
        return serve_fail(err, 400, chat_text ? "messages" : "prompt", "%s", msg);
    }
    return 1;
}

static inline int serve_parse_stop(const cJSON* stop, ServeParams* p, ServeError* err) {
    if (stop == NULL || cJSON_IsNull(stop)) { return 1; }
    p->stop = (char**)calloc(SERVE_MAX_STOP, sizeof(char*));
    if (cJSON_IsString(stop)) {
        p->stop[p->num_stop++] = strdup(stop->valuestring);
        return 1;
    }
    if (!cJSON_IsArray(stop) || cJSON_GetArraySize(stop) > SERVE_MAX_STOP) {
        return serve_fail(err, 400, "stop", "%s", "'stop' must be a string or an array of up to 4 strings");
    }
    const cJSON* s;
    cJSON_ArrayForEach(s, stop) {
        if (!cJSON_IsString(s)) { return serve_fail(err, 400, "stop", "%s", "'stop' must be a string or an array of up to 4 strings"); }
        p->stop[p->num_stop++] = strdup(s->valuestring);
    }
    return 1;
}

// The body (len bytes, not necessarily 0-terminated) of a completion (chat = 0) or chat
// request: 1 with *p filled (serve_params_free it), or 0 with *err.
static inline int serve_parse_request(const char* body, size_t len, int chat, const ServeLimits* lim, ServeParams* p,
                                      ServeError* err) {
    memset(p, 0, sizeof(*p));
    p->max_tokens = 16;
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->seed = SERVE_DEFAULT_SEED;
    cJSON* root = cJSON_ParseWithLength(body, len);
    if (root == NULL || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return serve_fail(err, 400, "", "%s", "the body must be a JSON object");
    }
    int ok = 1;
    const cJSON* model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (model && !cJSON_IsNull(model)) {
        if (!cJSON_IsString(model)) {
            ok = serve_fail(err, 400, "model", "%s", "'model' must be a string");
        } else if (strcmp(model->valuestring, lim->model_name) != 0) {
            char msg[200];
            snprintf(msg, sizeof(msg), "The model '%.64s' does not exist (this server has '%.64s')", model->valuestring,
                     lim->model_name);
            ok = serve_fail(err, 404, "model", "%s", msg);
        }
    }
    double max_tokens = p->max_tokens, temperature = p->temperature, top_p = p->top_p, top_k = 0, seed = (double)p->seed;
    double n = 1;
    ok = ok && serve_number(root, "max_tokens", 1, 1e9, 1, &max_tokens, err);
    ok = ok && serve_number(root, "temperature", 0, 100, 0, &temperature, err);
    ok = ok && serve_number(root, "top_p", 1e-9, 1, 0, &top_p, err);
    ok = ok && serve_number(root, "top_k", -1, 1e9, 1, &top_k, err);
    ok = ok && serve_number(root, "seed", 1, 9007199254740991.0, 1, &seed, err);
    ok = ok && serve_number(root, "n", 1, 1, 1, &n, err);
    ok = ok && serve_bool(root, "stream", &p->stream, err);
    ok = ok && serve_bool(root, "ignore_eos", &p->ignore_eos, err);
    const cJSON* opts = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (ok && opts && !cJSON_IsNull(opts)) {
        ok = cJSON_IsObject(opts) ? serve_bool(opts, "include_usage", &p->include_usage, err)
                                  : serve_fail(err, 400, "stream_options", "%s", "'stream_options' must be an object");
    }
    ok = ok && serve_parse_stop(cJSON_GetObjectItemCaseSensitive(root, "stop"), p, err);
    if (ok && chat) {
        char* text = serve_chat_text(cJSON_GetObjectItemCaseSensitive(root, "messages"), err);
        ok = text && serve_parse_prompt(NULL, text, lim, p, err);
        free(text);
    } else if (ok) {
        const cJSON* prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
        ok = prompt ? serve_parse_prompt(prompt, NULL, lim, p, err) : serve_fail(err, 400, "prompt", "%s", "'prompt' is required");
    }
    cJSON_Delete(root);
    p->max_tokens = (int)max_tokens;
    p->temperature = (float)temperature;
    p->top_p = (float)top_p;
    p->top_k = top_k < 0 ? 0 : (int)top_k;
    p->seed = (uint64_t)seed;
    if (!ok) { serve_params_free(p); }
    return ok;
}

#endif // LLMC_SERVE_REQUEST_H
