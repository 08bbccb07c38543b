/*
 * fuzz_model: llm.c model checkpoints (llmc/checkpoint.h checkpoint_read_model), fp32 and
 * bf16. An accepted file must also survive a write and a re-read bit for bit (the writer
 * and the reader agree on the format).
 */
#include "dev/fuzz/fuzz.h"
#include "llmc/checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const char* path = fuzz_write_file(0, "model.bin", data, size);
    const char* copy = fuzz_write_file(1, "copy.bin", NULL, 0);
    FUZZ_BEGIN();
    static GPT2Config config, again;
    float* params = checkpoint_read_model(path, &config);
    checkpoint_write_model(copy, &config, params);
    float* reread = checkpoint_read_model(copy, &again);
    if (memcmp(&config, &again, sizeof(config)) != 0 ||
        memcmp(params, reread, param_count(&config) * sizeof(float)) != 0) {
        fprintf(stderr, "fuzz_model: the model written back reads differently\n");
        abort();
    }
    free(params);
    free(reread);
    fuzz_expect_nothing_live("checkpoint_read_model");
    return 0;
}
