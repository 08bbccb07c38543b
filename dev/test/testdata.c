/*
 * testdata.c: writes the small inputs the end-to-end tests need, so they run anywhere.
 *
 *   testdata tokens OUT N V SEED   llm.c token file of N ids < V: a noisy bigram chain (next =
 *                                  5*prev+3 mod V, 1 in 8 random) that a small model
 *                                  learns within a few steps
 *   testdata bf16 IN OUT5 OUT3     from an fp32 (version 3) checkpoint IN: OUT5 = the same
 *                                  model as a bf16 (version 5) file, OUT3 = its values
 *                                  rounded to bf16 but stored as fp32 (what loading OUT5 must
 *                                  give)
 *   testdata moe-skew IN OUT E     from a mixture-of-experts checkpoint IN: OUT, in which every
 *                                  position's router prefers expert E (ln2 outputs its bias
 *                                  for every position, and only E's router row sees it)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/utils.h"
#include "llmc/rand.h"
#include "llmc/checkpoint.h"

static uint16_t to_bf16(float f) {   // round to nearest even
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + rounding) >> 16);
}

int main(int argc, char** argv) {
    if (argc == 6 && strcmp(argv[1], "tokens") == 0) {
        long n = atol(argv[3]);
        int V = atoi(argv[4]);
        uint64_t s = (uint64_t)atoll(argv[5]) + 1;
        if (n < 1 || V < 2 || V > 65536) { fatal("tokens: need N >= 1 and 2 <= V <= 65536"); }
        int header[256] = {20240520, 1, (int)n};
        uint16_t* tok = malloc_or_die(sizeof(uint16_t) * n, "tokens");
        int b = 1;
        for (long i = 0; i < n; i++) {
            int next = (b * 5 + 3) % V;
            if (random_u32(&s) % 8 == 0) { next = (int)(random_u32(&s) % V); }
            tok[i] = (uint16_t)next;
            b = next;
        }
        AtomicWriter w;
        atomic_writer_open(&w, argv[2]);
        atomic_writer_write(&w, header, sizeof(header));
        atomic_writer_write(&w, tok, sizeof(uint16_t) * n);
        atomic_writer_commit(&w);
        free(tok);
        return 0;
    }
    if (argc == 5 && strcmp(argv[1], "bf16") == 0) {
        FILE* f = fopen_or_die(argv[2], "rb", "checkpoint");
        int header[256];
        fread_or_die(header, sizeof(int), 256, f, argv[2]);
        if (header[1] != 3) { fatal("bf16: '%s' is not an fp32 (version 3) checkpoint", argv[2]); }
        long size = (long)file_size_or_die(f, argv[2]);
        fseek_or_die(f, 1024, SEEK_SET, argv[2]);
        long n = (size - 1024) / 4;
        float* p = malloc_or_die(sizeof(float) * n, "params");
        fread_or_die(p, sizeof(float), n, f, argv[2]);
        fclose(f);
        uint16_t* h = malloc_or_die(sizeof(uint16_t) * n, "bf16");
        for (long i = 0; i < n; i++) {
            h[i] = to_bf16(p[i]);
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&p[i], &u, 4);
        }
        AtomicWriter w;
        atomic_writer_open(&w, argv[3]);
        header[1] = 5;
        atomic_writer_write(&w, header, sizeof(header));
        atomic_writer_write(&w, h, sizeof(uint16_t) * n);
        atomic_writer_commit(&w);
        atomic_writer_open(&w, argv[4]);
        header[1] = 3;
        atomic_writer_write(&w, header, sizeof(header));
        atomic_writer_write(&w, p, sizeof(float) * n);
        atomic_writer_commit(&w);
        free(p);
        free(h);
        return 0;
    }
    if (argc == 5 && strcmp(argv[1], "moe-skew") == 0) {
        GPT2Config c;
        float* p = checkpoint_read_model(argv[2], &c);
        int target = atoi(argv[4]);
        if (c.num_experts < 1 || target < 0 || target >= c.num_experts) {
            fatal("moe-skew: '%s' has %d experts; expert %d does not exist", argv[2], c.num_experts, target);
        }
        size_t C = (size_t)c.channels;
        for (int l = 0; l < c.num_layers; l++) {
            for (size_t i = 0; i < C; i++) {
                p[param_offset(&c, P_LN2W, l) + i] = 0.0f;
                p[param_offset(&c, P_LN2B, l) + i] = 1.0f;
            }
            for (size_t i = 0; i < (size_t)c.num_experts * C; i++) {
                p[param_offset(&c, P_ROUTERW, l) + i] = i / C == (size_t)target ? 0.1f : 0.0f;
            }
        }
        checkpoint_write_model(argv[3], &c, p);
        free(p);
        return 0;
    }
    fatal("usage: testdata tokens OUT N V SEED | testdata bf16 IN OUT5 OUT3 | testdata moe-skew IN OUT EXPERT");
}
