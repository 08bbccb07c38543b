/*
 * gpt2_fast.h: what train_gpt2.cu sees of fast mode (train_gpt2_fast.cu, a translation unit of
 * its own so that its kernels are compiled without the deterministic flags): the model as the
 * engine drives it, and the libraries it sets up.
 */
#ifndef LLMC_GPT2_FAST_H
#define LLMC_GPT2_FAST_H

#include "llmc/engine.h"

const ModelOps* gpt2_fast_model_ops(void);
void gpt2_fast_setup(void);      // cuBLASLt handle and workspace, flash attention's shared memory
void gpt2_fast_teardown(void);

#endif // LLMC_GPT2_FAST_H
