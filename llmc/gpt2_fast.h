/*
 * gpt2_fast.h: what train_gpt2.cu sees of fast mode (train_gpt2_fast.cu, a translation unit of
 * its own so that its kernels are compiled without the deterministic flags): the model as the
 * engine drives it, and the libraries it sets up.
 */
#ifndef LLMC_GPT2_FAST_H
#define LLMC_GPT2_FAST_H

#include "llmc/engine.h"

const ModelOps* gpt2_fast_model_ops(void);
// cuBLASLt, and the attention of --attention (auto, cudnn, flash) for training passes of
// (B, T); returns a line saying which attention runs
const char* gpt2_fast_setup(const char* attention, const GPT2Config* c, int B, int T, int genT);
void gpt2_fast_teardown(void);

#endif // LLMC_GPT2_FAST_H
