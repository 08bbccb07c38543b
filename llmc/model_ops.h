/*
 * model_ops.h: the table through which the engine (engine.h, pipeline_executor.h) drives a
 * build's model, and what a build adds to the console. A build fills one ModelOps: train_gpt2.c's
 * model (on the CPU kernels, or on the CUDA deterministic kernels in train_gpt2cu) or fast
 * mode's bf16 model (train_gpt2_fast.cu). The memory its tensors live in is the other table,
 * MemOps (memory.h).
 */
#ifndef LLMC_MODEL_OPS_H
#define LLMC_MODEL_OPS_H

#include <stddef.h>
#include "llmc/comm.h"
#include "llmc/expert_parallel.h"
#include "llmc/model.h"
#include "llmc/pipeline.h"
#include "llmc/zero.h"

// Which half of a backward to run: both, the input gradient only (what the stage before waits
// for) or the weight gradient only (the zero-bubble schedules, pipeline.h). The halves compute
// exactly the sums of the whole, so splitting changes no bits.
#define BACKWARD_INPUT 1
#define BACKWARD_WEIGHT 2
#define BACKWARD_BOTH (BACKWARD_INPUT | BACKWARD_WEIGHT)

// One build's model of one model chunk (ChunkPlace, pipeline.h: a pipeline stage's layers, or one
// of its virtual stages'; every chunk of a rank shares the rank's Zero). `model`, `acts` and
// `grads` are the build's own structures; every float* is in the build's memory (MemOps),
// tokens come from host memory. Forward and backward come in three parts, run by the chunks
// that hold them: the embeddings, the chunk's transformer layers, the head (final layernorm,
// LM head, cross-entropy).
// How a training pass lays out its sequences over the ranks that split them (context
// parallelism, sequence parallelism): SEQS_WHOLE every position on every rank (the sampler);
// SEQS_SPLIT every pass split; SEQS_SPLIT_BY_LENGTH (--varlen with CP or SP) each pass split
// when its length allows, else whole on every rank of the group (context_parallel.h,
// VARIABLE LENGTHS), in memory for a whole pass of (B, T).
typedef enum { SEQS_WHOLE = 0, SEQS_SPLIT = 1, SEQS_SPLIT_BY_LENGTH = 2 } SeqSplit;

typedef struct {
    // the model of one chunk of this rank; its parameters, gradients and AdamW state are in
    // `zero`; seq_parallel: Megatron's sequence parallelism over the tensor-parallel group, for
    // passes over up to (B, T) positions; cp: the context-parallel group (context_parallel.h;
    // one rank: none), cp_a2a its all-to-all attention (else the ring)
    void* (*create)(const GPT2Config* config, const ChunkPlace* place, Zero* zero, CommGroup* tp,
                    CommGroup* cp, int cp_a2a, int seq_parallel, int B, int T);
    void (*destroy)(void* model);
    // activations of one pass over up to (B, T) positions; split_seqs (SeqSplit): split the
    // sequences as the model's seq_parallel and cp say (a pass of the sampler runs unsplit),
    // or per pass by its length (--varlen); split_backward: room for what a split backward
    // keeps between its halves; *bytes: their size
    void* (*acts_create)(void* model, int B, int T, int recompute, int split_seqs, int split_backward,
                         size_t* bytes);
    void (*acts_destroy)(void* model, void* acts);
    // the microbatch's tokens (host memory; targets NULL: no loss)
    void (*set_tokens)(void* model, void* acts, const int* inputs, const int* targets, int B, int T);
    float* (*stage_input)(void* model, void* acts);   // where a received activation goes
    float* (*stage_output)(void* model, void* acts, int B, int T);
    void (*embed_forward)(void* model, void* acts, int B, int T);
    void (*layers_forward)(void* model, void* acts, int B, int T);
    void (*head_forward)(void* model, void* acts, int B, int T, int training);
    float (*loss_sum)(void* model, void* acts, int B, int T);   // R3 sum of the last pass's losses
    // the probabilities at `position` over the whole padded vocabulary (Vp floats, host memory);
    // every tensor-parallel rank of the head's stage calls it
    void (*probs_at)(void* model, void* acts, int position, float* host_probs);
    // gradients of activations during backward, one set reused by every microbatch, chunk and
    // layer; its d(residual) is d(loss)/d(chunk output) going in and d(loss)/d(chunk input)
    // coming out of an input half. part: BACKWARD_BOTH, _INPUT or _WEIGHT (the weight half of
    // a (microbatch, chunk) after its input half, from what that kept in acts)
    void* (*grads_create)(void* model, int B, int T, int split_seqs, size_t* bytes);
    void (*grads_destroy)(void* model, void* grads);
    float* (*grad_residual)(void* model, void* grads);
    void (*head_backward)(void* model, void* acts, void* grads, int B, int T, float dloss, int part);
    void (*layers_backward)(void* model, void* acts, void* grads, int B, int T, int part);
    void (*embed_backward)(void* model, void* acts, void* grads, int B, int T, int part);
    // a model with experts (llmc/moe.h; NULL without): the load-balancing loss of each of the
    // chunk's layers in the last forward pass of acts (host, one float per layer), and the
    // routing counters, which the engine reads and zeroes every step
    void (*moe_aux)(void* model, void* acts, float* host_aux);
    MoeCounters* (*moe_counters)(void* model);
    // generation with a KV cache (NULL: the build has none, and the sampler runs a full
    // forward per token): row t of a pass laid out over (1, T), the rows before it computed by
    // the earlier calls; equal to row t of the full forward over (1, T), bit for bit (the
    // reference model runs its forward on the one row).
    void (*embed_decode)(void* model, void* acts, int token, int t, int T);
    void (*layers_decode)(void* model, void* acts, int t, int T);
    void (*head_decode)(void* model, void* acts, int t, int T);
    // bytes of one element of stage_input, stage_output and grad_residual (fp32 or bf16): what
    // the pipeline executor sizes, copies and sends them by
    size_t stage_elem_bytes;
    // bytes of one element of the weights its passes read: 4, the fp32 parameters
    // (zero_params_acquire), or 2, bf16 weights (zero_weights_acquire: zero.h BF16 WEIGHTS)
    size_t weight_elem_bytes;
    // FlexSP (engine.h trainer_flexsp_step): the context-parallel group of the passes that
    // follow, one of the pool's sub-groups (comm.h comm_setup_pool_groups; a group of one:
    // none), its buffers made on its first selection for sequences of up to max_len positions
    // (what the group's ranks hold together: --flexsp-tokens each), which the engine selects
    // every group for before it makes the activations (NULL: the build runs groups of one rank)
    void (*cp_select)(void* model, CommGroup* group, int max_len);
} ModelOps;

// What a build adds to the engine's console output.
typedef struct {
    const char* program;                        // "train_gpt2", "train_gpt2cu"
    void (*banner)(void);                       // its first lines of the startup table
    void (*memory_line)(void);                  // a line after the memory table (NULL: none)
    // the throughput field of the step line, e.g. "95.0 GFLOP/s" or "MFU 41.2%"
    void (*throughput)(char* out, size_t len, double flops_per_second);
    // the run summary's, against the machine's peak, e.g. "95.0 GFLOP/s, 41% of ... peak"
    void (*summary_throughput)(char* out, size_t len, double flops_per_second);
} BuildInfo;

#endif // LLMC_MODEL_OPS_H
