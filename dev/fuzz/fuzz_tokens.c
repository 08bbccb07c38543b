/*
 * fuzz_tokens: llm.c token shards (llmc/dataloader.h), one input file per shard, loaded with
 * and without shuffling at the first, last and next epoch's microbatches. Independent
 * checks: every id served is < V, and unshuffled microbatch 0 is the first B*T+1 ids of the
 * first shard as the file holds them.
 */
#include "dev/fuzz/fuzz.h"
#include "llmc/dataloader.h"
#include "dev/fuzz/fuzz_setup.h"

#define B 2
#define T 3

static void check_ids(const DataLoader* d) {
    for (int i = 0; i < B * T; i++) {
        if (d->inputs[i] < 0 || d->inputs[i] >= FUZZ_TOKENS_V || d->targets[i] < 0 ||
            d->targets[i] >= FUZZ_TOKENS_V) {
            fprintf(stderr, "fuzz_tokens: the loader served an id outside the vocabulary\n");
            abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    FuzzFiles files = fuzz_split(data, size);
    for (int k = 0; k < FUZZ_MAX_FILES; k++) {
        char name[32];
        snprintf(name, sizeof(name), "shard_%d.bin", k);
        if (k < files.n) { fuzz_write_file(k, name, files.data[k], files.size[k]); }
        else { fuzz_remove_file(name); }   // no shard left over from an earlier input
    }
    char pattern[300];
    snprintf(pattern, sizeof(pattern), "%s/shard_*.bin", fuzz_workdir());
    FUZZ_BEGIN();
    static DataLoader d;
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        dataloader_init(&d, pattern, "-i", B, T, FUZZ_TOKENS_V, shuffle, 7);
        int64_t n = d.microbatches_per_epoch;
        const int64_t picks[4] = {0, n - 1, n, 2 * n + 1};
        for (int p = 0; p < 4; p++) {
            dataloader_load(&d, picks[p]);
            check_ids(&d);
            if (!shuffle && p == 0) {
                for (int i = 0; i <= B * T; i++) {
                    uint16_t id;
                    memcpy(&id, files.data[0] + 1024 + 2 * i, 2);
                    int served = i < B * T ? d.inputs[i] : d.targets[B * T - 1];
                    if (served != id) {
                        fprintf(stderr, "fuzz_tokens: microbatch 0 differs from the file at token %d\n", i);
                        abort();
                    }
                }
            }
        }
        dataloader_free(&d);
    }
    fuzz_expect_nothing_live("dataloader_free");
    return 0;
}
