/*
 * fuzz_state: optimizer state pieces (llmc/checkpoint.h state_read), read the way a resumed
 * run reads them: the pieces of step FUZZ_STEP (input files 0.. = pieces 0..), the run's
 * ranges, its flags (train_progress_check), then the first microbatches the saved data
 * position points to (dataloader.h), which is where a corrupt position did its damage.
 */
#include "dev/fuzz/fuzz.h"
#include "llmc/checkpoint.h"
#include "llmc/dataloader.h"
#include "dev/fuzz/fuzz_setup.h"

static const char* data_path;

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    GPT2Config c = fuzz_model_config();
    data_path = fuzz_write_file(FUZZ_MAX_FILES, "data.bin", NULL, 0);
    fuzz_write_token_file(data_path, FUZZ_STATE_DATA_TOKENS, c.vocab_size, 3);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    FuzzFiles files = fuzz_split(data, size);
    for (int k = 0; k < FUZZ_MAX_FILES; k++) {
        char name[64];
        snprintf(name, sizeof(name), "state_%08d_%05d.bin", FUZZ_STEP, k);
        if (k < files.n) { fuzz_write_file(k, name, files.data[k], files.size[k]); }
        else { fuzz_remove_file(name); }   // no piece left over from an earlier input
    }
    FUZZ_BEGIN();
    static GPT2Config c;
    static StateRange want[3];
    static TrainProgress progress;
    static DataLoader loader;
    c = fuzz_model_config();
    int64_t P = (int64_t)param_count(&c);
    // three ranges, like a rank whose shard spans three units
    for (int k = 0; k < 3; k++) {
        want[k].begin = P * k / 3;
        want[k].end = P * (k + 1) / 3;
        want[k].m = (float*)malloc(sizeof(float) * (size_t)(want[k].end - want[k].begin));
        want[k].v = (float*)malloc(sizeof(float) * (size_t)(want[k].end - want[k].begin));
    }
    state_read(fuzz_workdir(), FUZZ_STEP, &c, 3, want, &progress);
    train_progress_check(&progress, fuzz_workdir(), FUZZ_M, FUZZ_B * FUZZ_T, FUZZ_SHUFFLE, FUZZ_SEED,
                         FUZZ_TRAIN_STEPS);
    dataloader_init(&loader, data_path, "-i", FUZZ_B, FUZZ_T, c.vocab_size, progress.shuffle,
                    progress.shuffle_seed);
    for (int i = 0; i < FUZZ_M; i++) { dataloader_load(&loader, progress.microbatches_done + i); }
    dataloader_free(&loader);
    for (int k = 0; k < 3; k++) {
        free(want[k].m);
        free(want[k].v);
    }
    fuzz_expect_nothing_live("state_read");
    return 0;
}
