/*
 * attention_cudnn.cuh: fast mode's causal attention through cuDNN's fused flash attention
 * (forward and backward, bf16 in and out, fp32 softmax statistics), built with cuDNN 9's C
 * backend API: tensor and operation descriptors, an operation graph, engine heuristics, an
 * execution plan, a variant pack per call. This is the graph cudnn-frontend builds for
 * sdpa / sdpa_backward (its "composite" lowering), written out op by op in C: cudnn-frontend
 * (C++) is not used.
 *
 * Layouts are the trainer's (as attention_flash.cuh): qkv (B,T,3C) with q | k | v and head h
 * at channels [h*HS, (h+1)*HS) of each third; out (B,T,C); dqkv (B,T,3C); dout (B,T,C).
 * cuDNN reads them in place through strided (B,NH,T,HS) descriptors: no transposes. Causal
 * mask, scale 1/sqrt(HS). stats (B,NH,T) fp32 is the forward's log-sum-exp of each row of
 * scaled scores in NATURAL log: stats = max + ln(sum exp(s - max)), s = (q.k)/sqrt(HS).
 * (attention_flash.cuh keeps the same quantity in base 2: flash stats = cudnn stats * log2(e);
 * the two are not interchangeable.) The backward overwrites all of dqkv (no accumulation).
 *
 *   int  cudnn_attention_supported(B, T, NH, HS, why, len)  builds and caches the plans of a
 *        shape (training forward and backward); 0 with the reason in why if cuDNN cannot
 *   int  cudnn_attention_forward_supported(B, T, NH, HS, why, len)  the training forward's only
 *   void attention_forward_cudnn(out, stats, qkv, B, T, NH, HS, training)  stats may be NULL
 *        when training == 0 (its plan is built on first use)
 *   void attention_backward_cudnn(dqkv, dout, qkv, out, stats, B, T, NH, HS)
 *   void cudnn_attention_free(void)
 *   cudnn_attention_deterministic (default 1): set before the first call; see below
 *   void cudnn_attention_plan_info(B, T, NH, HS, buf, len): the engines and workspace chosen
 *
 * Which cuDNN, and which ops. cuDNN >= 9.13 has a single CUDNN_BACKEND_OPERATION_SDPA_FWD_-
 * DESCRIPTOR and >= 9.17 an SDPA_BWD one, but in cuDNN 9.19 (installed here) neither can be
 * told "causal": their attributes are Q, K, V, O, stats, scale, sequence lengths, page tables
 * and (forward) a tile-granular block-sparsity mask; the score-modifier subgraph through which
 * cudnn-frontend expresses a causal mask on them arrives with 9.21. So causal attention here
 * is the composite graph of matmul, pointwise and reduction ops that cuDNN's fused attention
 * engines recognise, as cudnn-frontend lowers sdpa / sdpa_backward for these versions:
 *   forward:  S = Q K^T (fp32); S *= scale; causal mask (GEN_INDEX row, GEN_INDEX col,
 *             CMP_GE, BINARY_SELECT with -inf); M = max_row S; E = exp(S - M); Z = sum_row E;
 *             stats = M + log Z; P = E / Z (bf16); O = P V
 *   backward: Dsum = sum_row(dO * O) * 1 (an fp32 tensor in our workspace); S = Q K^T * scale;
 *             P = exp(mask(S - stats)); dV = P^T dO; dS = (dO V^T - Dsum) * P * scale;
 *             dK = dS^T Q; dQ = dS K (P^T, dS^T and K are strided views: RESHAPE ops)
 * The backward is deterministic when the graph writes dQ directly (cuDNN's "dP workspace"
 * path; cudnn-frontend estimates that buffer at B*NH*T*T*2 bytes, part of the plan's
 * workspace: ~1.6 GB at B=64, NH=12, T=1024): that is what
 * cudnn-frontend builds for set_deterministic_algorithm(true) on Hopper and Ampere with this
 * cuDNN. cuDNN 9.19 has no deterministic attribute or knob for this graph (no
 * CUDNN_ATTR_*_DETERMINISTIC for attention; CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC is for the
 * reduction op; the behaviour notes say nothing about determinism): determinism is chosen by
 * the graph's shape. With cudnn_attention_deterministic = 0 the graph accumulates dQ in an
 * fp32 workspace tensor (atomics: faster, less memory, not bitwise reproducible) and copies it
 * to dQ (IDENTITY). Engines whose numerical notes include CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC
 * are passed over when determinism is asked for (and reported by cudnn_attention_plan_info).
 *
 * Requirements (checked, with the reason, by cudnn_attention_supported): cuDNN >= 9.16 at run
 * time (earlier 9.x need cudnn-frontend's padding-mask workaround for T % 128 != 0 and
 * numeric_limits<float>::lowest() as the mask value), an sm_80+ GPU, HS a multiple of 8 and at
 * most 128 (256 on sm_90+), 16-byte aligned tensors (checked on every call).
 *
 * Errors: every cuDNN call is checked; a failure while building a plan is returned by
 * cudnn_attention_supported as "the call: status: cuDNN's last error message"; anything else
 * ends the program with one line naming the call (fatal, utils.h).
 *
 * Host code only (no kernels): nothing here depends on nvcc's -fmad / -prec-* flags.
 */
#ifndef LLMC_ATTENTION_CUDNN_CUH
#define LLMC_ATTENTION_CUDNN_CUH

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <cudnn_graph.h>
#include "llmc/cuda_common.cuh"

#if !defined(CUDNN_MAJOR) || CUDNN_MAJOR < 9
#error "llmc/attention_cudnn.cuh needs the cuDNN 9 headers (cudnn_graph.h, backend API)"
#endif

// oldest cuDNN (run time) whose fused attention takes this graph as it is built here
#define CA_MIN_CUDNN_VERSION 91600

// 1: deterministic backward (dQ written directly; see above). Read when a backward plan is
// built; plans are cached per value, so changing it later builds new ones.
static int cudnn_attention_deterministic = 1;

// Attribute names cuDNN 9.19 marks deprecated (still the way a plan and an operation graph get
// their handle; cudnn-frontend sets them too). By value, so that no deprecation warning fires.
static const cudnnBackendAttributeName_t CA_ATTR_OPGRAPH_HANDLE = (cudnnBackendAttributeName_t)800;
static const cudnnBackendAttributeName_t CA_ATTR_PLAN_HANDLE = (cudnnBackendAttributeName_t)400;

// --- error reporting ------------------------------------------------------------------------

static void ca_status_text(cudnnStatus_t st, char* buf, size_t len) {
    char last[384];
    last[0] = '\0';
    cudnnGetLastErrorString(last, sizeof(last));
    snprintf(buf, len, "%s (%d)%s%s", cudnnGetErrorString(st), (int)st, last[0] ? ": " : "", last);
}

static inline void cudnn_check_(cudnnStatus_t st, const char* what, const char* file, int line) {
    if (st != CUDNN_STATUS_SUCCESS) {
        char msg[512];
        ca_status_text(st, msg, sizeof(msg));
        fatal("cuDNN error in %s (%s:%d): %s", what, file, line, msg);
    }
}
#define cudnnCheck(call) cudnn_check_((call), #call, __FILE__, __LINE__)

// --- graph building: every descriptor is recorded; the first failure is kept as the reason ---

#define CA_MAX_DESC 192

typedef struct {
    cudnnBackendDescriptor_t desc[CA_MAX_DESC];   // everything created, destroyed with the plan
    int ndesc;
    cudnnBackendDescriptor_t ops[48];             // the graph's operations, in build order
    int nops;
    int64_t next_virtual_uid;
    int ok;
    char why[1024];
} CaBuild;

static void ca_fail(CaBuild* g, const char* what, const char* name, cudnnStatus_t st) {
    if (!g->ok) { return; }
    char msg[512];
    ca_status_text(st, msg, sizeof(msg));
    snprintf(g->why, sizeof(g->why), "%s [%s]: %s", what, name, msg);
    g->ok = 0;
}

static cudnnBackendDescriptor_t ca_new(CaBuild* g, cudnnBackendDescriptorType_t type, const char* name) {
    if (!g->ok) { return NULL; }
    if (g->ndesc == CA_MAX_DESC) {
        snprintf(g->why, sizeof(g->why), "internal: more than %d cuDNN descriptors in one graph", CA_MAX_DESC);
        g->ok = 0;
        return NULL;
    }
    cudnnBackendDescriptor_t d = NULL;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(type, &d);
    if (st != CUDNN_STATUS_SUCCESS) {
        ca_fail(g, "cudnnBackendCreateDescriptor", name, st);
        return NULL;
    }
    g->desc[g->ndesc++] = d;
    return d;
}

static void ca_set_(CaBuild* g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr, const char* attr_name,
                    cudnnBackendAttributeType_t type, int64_t n, const void* v, const char* name) {
    if (!g->ok) { return; }
    cudnnStatus_t st = cudnnBackendSetAttribute(d, attr, type, n, v);
    if (st != CUDNN_STATUS_SUCCESS) {
        char what[160];
        snprintf(what, sizeof(what), "cudnnBackendSetAttribute(%s)", attr_name);
        ca_fail(g, what, name, st);
    }
}
#define CA_SET(g, d, attr, type, n, v, name) ca_set_((g), (d), (attr), #attr, (type), (n), (v), (name))

static void ca_finalize(CaBuild* g, cudnnBackendDescriptor_t d, const char* name) {
    if (!g->ok) { return; }
    cudnnStatus_t st = cudnnBackendFinalize(d);
    if (st != CUDNN_STATUS_SUCCESS) { ca_fail(g, "cudnnBackendFinalize", name, st); }
}

// A 4-d tensor. uid > 0: a tensor of the variant pack; uid 0: a virtual one (fresh uid).
static cudnnBackendDescriptor_t ca_tensor(CaBuild* g, int64_t uid, cudnnDataType_t dtype, const int64_t dim[4],
                                          const int64_t stride[4], bool by_value, const char* name) {
    cudnnBackendDescriptor_t t = ca_new(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, name);
    bool is_virtual = uid == 0;
    if (is_virtual) { uid = g->next_virtual_uid++; }
    int64_t alignment = 16;
    CA_SET(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dtype, name);
    CA_SET(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, name);
    CA_SET(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, stride, name);
    CA_SET(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, name);
    CA_SET(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, name);
    CA_SET(g, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, name);
    CA_SET(g, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, name);
    ca_finalize(g, t, name);
    return t;
}

static void ca_add_op(CaBuild* g, cudnnBackendDescriptor_t op) {
    if (!g->ok) { return; }
    if (g->nops == (int)(sizeof(g->ops) / sizeof(g->ops[0]))) {
        snprintf(g->why, sizeof(g->why), "internal: too many operations in one graph");
        g->ok = 0;
        return;
    }
    g->ops[g->nops++] = op;
}

// y = mode(x [, b [, t]]) computed in `compute`; axis >= 0 for GEN_INDEX
static void ca_pointwise(CaBuild* g, cudnnPointwiseMode_t mode, cudnnDataType_t compute, int64_t axis,
                         cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
                         cudnnBackendDescriptor_t y, const char* name) {
    cudnnBackendDescriptor_t pw = ca_new(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, name);
    CA_SET(g, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, name);
    CA_SET(g, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, name);
    if (axis >= 0) { CA_SET(g, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, name); }
    ca_finalize(g, pw, name);
    cudnnBackendDescriptor_t op = ca_new(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, name);
    if (b) { CA_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, name); }
    if (t) { CA_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, name); }
    CA_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, name);
    ca_finalize(g, op, name);
    ca_add_op(g, op);
}

static void ca_reduction(CaBuild* g, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                         const char* name) {
    cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t rd = ca_new(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, name);
    CA_SET(g, rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, name);
    CA_SET(g, rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, name);
    ca_finalize(g, rd, name);
    cudnnBackendDescriptor_t op = ca_new(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, name);
    ca_finalize(g, op, name);
    ca_add_op(g, op);
}

// c (batch dims, M, N) = a (.., M, K) . b (.., K, N), fp32 accumulation
static void ca_matmul(CaBuild* g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
                      const char* name) {
    cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t md = ca_new(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, name);
    CA_SET(g, md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, name);
    ca_finalize(g, md, name);
    cudnnBackendDescriptor_t op = ca_new(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md, name);
    ca_finalize(g, op, name);
    ca_add_op(g, op);
}

// y: the same elements as x seen through other dims/strides (how the graph says "transpose")
static void ca_reshape(CaBuild* g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y, const char* name) {
    cudnnBackendDescriptor_t op = ca_new(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, name);
    CA_SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, name);
    ca_finalize(g, op, name);
    ca_add_op(g, op);
}

// --- the two graphs -------------------------------------------------------------------------

// uids of the variant pack's tensors
enum {
    CA_UID_Q = 1, CA_UID_K, CA_UID_V, CA_UID_O, CA_UID_STATS, CA_UID_SCALE, CA_UID_NEGINF, CA_UID_ONE,
    CA_UID_DO, CA_UID_DQ, CA_UID_DK, CA_UID_DV, CA_UID_DSUM, CA_UID_DQACC
};

// the shapes every graph uses, from (B, T, NH, HS)
typedef struct {
    int64_t q_dim[4], q_str[4];     // Q, V, dQ, dK, dV: (B,NH,T,HS) inside (B,T,3C)
    int64_t kt_dim[4], kt_str[4];   // K^T, V^T: (B,NH,HS,T) inside (B,T,3C)
    int64_t o_str[4];               // O, dO: (B,NH,T,HS) inside (B,T,C)
    int64_t s_dim[4], s_str[4];     // scores (B,NH,T,T), packed (virtual)
    int64_t st_str[4];              // their transpose, same dims
    int64_t r_dim[4], r_str[4];     // per-row (B,NH,T,1): stats, row max/sum, Dsum
    int64_t one[4];                 // scalars (1,1,1,1)
    int64_t acc_str[4];             // dQ accumulator (B,NH,T,HS) packed fp32
    int64_t doo_str[4];             // dO * O (virtual; cudnn-frontend's strides)
} CaShapes;

static CaShapes ca_shapes(int64_t B, int64_t T, int64_t NH, int64_t HS) {
    int64_t C = NH * HS, C3 = 3 * C;
    CaShapes s = {
        {B, NH, T, HS}, {T * C3, HS, C3, 1},
        {B, NH, HS, T}, {T * C3, HS, 1, C3},
        {T * C, HS, C, 1},
        {B, NH, T, T}, {NH * T * T, T * T, T, 1},
        {NH * T * T, T * T, 1, T},
        {B, NH, T, 1}, {NH * T, T, 1, 1},
        {1, 1, 1, 1},
        {NH * T * HS, T * HS, HS, 1},
        {NH * T * HS, T * HS, NH * HS, 1},
    };
    return s;
}

// causal mask on scores x: keep x where row >= col, else -inf
static cudnnBackendDescriptor_t ca_causal_mask(CaBuild* g, const CaShapes* s, cudnnBackendDescriptor_t x,
                                               cudnnBackendDescriptor_t neginf) {
    cudnnBackendDescriptor_t row = ca_tensor(g, 0, CUDNN_DATA_INT32, s->s_dim, s->s_str, false, "row index");
    cudnnBackendDescriptor_t col = ca_tensor(g, 0, CUDNN_DATA_INT32, s->s_dim, s->s_str, false, "col index");
    cudnnBackendDescriptor_t keep = ca_tensor(g, 0, CUDNN_DATA_BOOLEAN, s->s_dim, s->s_str, false, "causal keep");
    cudnnBackendDescriptor_t y = ca_tensor(g, 0, CUDNN_DATA_FLOAT, s->s_dim, s->s_str, false, "masked scores");
    ca_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 2, x, NULL, NULL, row, "gen_index row");
    ca_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 3, x, NULL, NULL, col, "gen_index col");
    ca_pointwise(g, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, -1, row, col, NULL, keep, "row >= col");
    ca_pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, -1, x, neginf, keep, y, "causal select");
    return y;
}

static void ca_build_forward_graph(CaBuild* g, int B, int T, int NH, int HS, int training) {
    CaShapes s = ca_shapes(B, T, NH, HS);
    const cudnnDataType_t BF = CUDNN_DATA_BFLOAT16, F = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t Q = ca_tensor(g, CA_UID_Q, BF, s.q_dim, s.q_str, false, "Q");
    cudnnBackendDescriptor_t KT = ca_tensor(g, CA_UID_K, BF, s.kt_dim, s.kt_str, false, "K^T");
    cudnnBackendDescriptor_t V = ca_tensor(g, CA_UID_V, BF, s.q_dim, s.q_str, false, "V");
    cudnnBackendDescriptor_t O = ca_tensor(g, CA_UID_O, BF, s.q_dim, s.o_str, false, "O");
    cudnnBackendDescriptor_t scale = ca_tensor(g, CA_UID_SCALE, F, s.one, s.one, true, "attn scale");
    cudnnBackendDescriptor_t neginf = ca_tensor(g, CA_UID_NEGINF, F, s.one, s.one, true, "-inf");
    cudnnBackendDescriptor_t S = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "S");
    ca_matmul(g, Q, KT, S, "bmm1 Q.K^T");
    cudnnBackendDescriptor_t Ss = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "S*scale");
    ca_pointwise(g, CUDNN_POINTWISE_MUL, F, -1, S, scale, NULL, Ss, "attn scale");
    cudnnBackendDescriptor_t Sm = ca_causal_mask(g, &s, Ss, neginf);
    // softmax with statistics
    cudnnBackendDescriptor_t M = ca_tensor(g, 0, F, s.r_dim, s.r_str, false, "row max");
    ca_reduction(g, CUDNN_REDUCE_TENSOR_MAX, Sm, M, "reduce max");
    cudnnBackendDescriptor_t Sd = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "S-M");
    ca_pointwise(g, CUDNN_POINTWISE_SUB, F, -1, Sm, M, NULL, Sd, "sub max");
    cudnnBackendDescriptor_t E = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "exp(S-M)");
    ca_pointwise(g, CUDNN_POINTWISE_EXP, F, -1, Sd, NULL, NULL, E, "exp");
    cudnnBackendDescriptor_t Z = ca_tensor(g, 0, F, s.r_dim, s.r_str, false, "row sum");
    ca_reduction(g, CUDNN_REDUCE_TENSOR_ADD, E, Z, "reduce sum");
    if (training) {   // inference builds no statistics: nothing would read them
        cudnnBackendDescriptor_t stats = ca_tensor(g, CA_UID_STATS, F, s.r_dim, s.r_str, false, "stats");
        cudnnBackendDescriptor_t L = ca_tensor(g, 0, F, s.r_dim, s.r_str, false, "log sum");
        ca_pointwise(g, CUDNN_POINTWISE_LOG, F, -1, Z, NULL, NULL, L, "log");
        ca_pointwise(g, CUDNN_POINTWISE_ADD, F, -1, M, L, NULL, stats, "stats = max + log sum");
    }
    // P is bf16: the second matmul's A operand is of the i/o type
    cudnnBackendDescriptor_t P = ca_tensor(g, 0, BF, s.s_dim, s.s_str, false, "P");
    ca_pointwise(g, CUDNN_POINTWISE_DIV, F, -1, E, Z, NULL, P, "div sum");
    ca_matmul(g, P, V, O, "bmm2 P.V");
}

static void ca_build_backward_graph(CaBuild* g, int B, int T, int NH, int HS, int deterministic) {
    CaShapes s = ca_shapes(B, T, NH, HS);
    const cudnnDataType_t BF = CUDNN_DATA_BFLOAT16, F = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t Q = ca_tensor(g, CA_UID_Q, BF, s.q_dim, s.q_str, false, "Q");
    cudnnBackendDescriptor_t KT = ca_tensor(g, CA_UID_K, BF, s.kt_dim, s.kt_str, false, "K^T");
    cudnnBackendDescriptor_t VT = ca_tensor(g, CA_UID_V, BF, s.kt_dim, s.kt_str, false, "V^T");
    cudnnBackendDescriptor_t O = ca_tensor(g, CA_UID_O, BF, s.q_dim, s.o_str, false, "O");
    cudnnBackendDescriptor_t dO = ca_tensor(g, CA_UID_DO, BF, s.q_dim, s.o_str, false, "dO");
    cudnnBackendDescriptor_t stats = ca_tensor(g, CA_UID_STATS, F, s.r_dim, s.r_str, false, "stats");
    cudnnBackendDescriptor_t dQ = ca_tensor(g, CA_UID_DQ, BF, s.q_dim, s.q_str, false, "dQ");
    cudnnBackendDescriptor_t dK = ca_tensor(g, CA_UID_DK, BF, s.q_dim, s.q_str, false, "dK");
    cudnnBackendDescriptor_t dV = ca_tensor(g, CA_UID_DV, BF, s.q_dim, s.q_str, false, "dV");
    cudnnBackendDescriptor_t scale = ca_tensor(g, CA_UID_SCALE, F, s.one, s.one, true, "attn scale");
    cudnnBackendDescriptor_t neginf = ca_tensor(g, CA_UID_NEGINF, F, s.one, s.one, true, "-inf");
    cudnnBackendDescriptor_t one = ca_tensor(g, CA_UID_ONE, F, s.one, s.one, true, "1");
    cudnnBackendDescriptor_t dsum = ca_tensor(g, CA_UID_DSUM, F, s.r_dim, s.r_str, false, "Dsum (workspace)");

    // Dsum = rowsum(dO * O) * 1
    cudnnBackendDescriptor_t dOO = ca_tensor(g, 0, F, s.q_dim, s.doo_str, false, "dO*O");
    ca_pointwise(g, CUDNN_POINTWISE_MUL, F, -1, dO, O, NULL, dOO, "mul dO O");
    cudnnBackendDescriptor_t dOOsum = ca_tensor(g, 0, F, s.r_dim, s.r_str, false, "rowsum dO*O");
    ca_reduction(g, CUDNN_REDUCE_TENSOR_ADD, dOO, dOOsum, "reduce dO*O");
    ca_pointwise(g, CUDNN_POINTWISE_MUL, F, -1, dOOsum, one, NULL, dsum, "Dsum (dropout scale 1)");
    // P = exp(mask(Q K^T * scale - stats))
    cudnnBackendDescriptor_t S = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "S");
    ca_matmul(g, Q, KT, S, "matmul Q.K^T");
    cudnnBackendDescriptor_t Ss = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "S*scale");
    ca_pointwise(g, CUDNN_POINTWISE_MUL, F, -1, S, scale, NULL, Ss, "attn scale");
    cudnnBackendDescriptor_t Sl = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "S-stats");
    ca_pointwise(g, CUDNN_POINTWISE_SUB, F, -1, Ss, stats, NULL, Sl, "sub stats");
    cudnnBackendDescriptor_t Sm = ca_causal_mask(g, &s, Sl, neginf);
    cudnnBackendDescriptor_t P = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "P");
    ca_pointwise(g, CUDNN_POINTWISE_EXP, F, -1, Sm, NULL, NULL, P, "exp");
    // dV = P^T dO
    cudnnBackendDescriptor_t PT = ca_tensor(g, 0, BF, s.s_dim, s.st_str, false, "P^T");
    ca_reshape(g, P, PT, "reshape P^T");
    ca_matmul(g, PT, dO, dV, "matmul P^T.dO");
    // dS = (dO V^T - Dsum) * P * scale
    cudnnBackendDescriptor_t dP = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "dP");
    ca_matmul(g, dO, VT, dP, "matmul dO.V^T");
    cudnnBackendDescriptor_t dPs = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "dP-Dsum");
    ca_pointwise(g, CUDNN_POINTWISE_SUB, F, -1, dP, dsum, NULL, dPs, "sub Dsum");
    cudnnBackendDescriptor_t dS0 = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "(dP-Dsum)*P");
    ca_pointwise(g, CUDNN_POINTWISE_MUL, F, -1, dPs, P, NULL, dS0, "mul P");
    cudnnBackendDescriptor_t dS = ca_tensor(g, 0, F, s.s_dim, s.s_str, false, "dS");
    ca_pointwise(g, CUDNN_POINTWISE_MUL, F, -1, dS0, scale, NULL, dS, "dS attn scale");
    // dK = dS^T Q
    cudnnBackendDescriptor_t dST = ca_tensor(g, 0, BF, s.s_dim, s.st_str, false, "dS^T");
    ca_reshape(g, dS, dST, "reshape dS^T");
    ca_matmul(g, dST, Q, dK, "matmul dS^T.Q");
    // dQ = dS K (K: K^T seen back as (B,NH,T,HS))
    cudnnBackendDescriptor_t K = ca_tensor(g, 0, F, s.q_dim, s.q_str, false, "K");
    ca_reshape(g, KT, K, "reshape K");
    if (deterministic) {
        ca_matmul(g, dS, K, dQ, "matmul dS.K");
    } else {
        cudnnBackendDescriptor_t acc = ca_tensor(g, CA_UID_DQACC, F, s.q_dim, s.acc_str, false, "dQ accumulator");
        ca_matmul(g, dS, K, acc, "matmul dS.K (accumulator)");
        ca_pointwise(g, CUDNN_POINTWISE_IDENTITY, F, -1, acc, NULL, NULL, dQ, "dQ = accumulator");
    }
}

// --- plans ----------------------------------------------------------------------------------

enum { CA_FWD = 0, CA_BWD = 1 };

typedef struct {
    int used, kind, B, T, NH, HS, flag;   // flag: training (forward) or deterministic (backward)
    uint64_t last_use;
    cudnnBackendDescriptor_t plan;
    cudnnBackendDescriptor_t* descs;      // every descriptor the plan refers to
    int ndescs;
    size_t plan_ws;                       // the plan's own workspace
    size_t off_dsum, off_dqacc, ws_total; // backward: our tensors after it (256-byte aligned)
    int64_t engine;                       // global engine index
    int nondet_note, rtc_note;            // numerical note NONDETERMINISTIC, behaviour note RUNTIME_COMPILATION
    int configs_tried;
    double build_s;
} CaPlan;

#define CA_MAX_PLANS 64
static CaPlan ca_plans[CA_MAX_PLANS];
static uint64_t ca_clock = 0;
static cudnnHandle_t ca_handle = NULL;
static int ca_init_state = 0;   // 0 not tried, 1 ready, -1 unusable (ca_init_why)
static char ca_init_why[512];
static int ca_sm = 0;
static void* ca_ws = NULL;
static size_t ca_ws_bytes = 0;

static size_t ca_align256(size_t x) { return (x + 255) & ~(size_t)255; }

// src into dst[len], cut short if it does not fit
static void ca_copy(char* dst, size_t len, const char* src) {
    if (len == 0) { return; }
    size_t n = strlen(src);
    if (n >= len) { n = len - 1; }
    memcpy(dst, src, n);
    dst[n] = '\0';
}

// While a plan is built, cuDNN's own warnings are captured: when its support checks turn down
// every engine (a missing libcuda or libnvrtc, an unsupported shape), the first "Reason:" line
// says why, and goes into the reason cudnn_attention_supported returns. Messages are lines
// separated by NUL bytes and ended by an empty one (read with a bound, to be safe).
static char ca_log_reason[400];

static void ca_log_callback(cudnnSeverity_t sev, void* udata, const cudnnDebug_t* dbg, const char* msg) {
    (void)sev; (void)udata; (void)dbg;
    if (ca_log_reason[0] || msg == NULL) { return; }
    const char* p = msg;
    for (int guard = 0; *p && guard < 8192; guard++) {
        size_t n = strnlen(p, 8192);
        if (strstr(p, "Reason:") && !strstr(p, "CUDNN_STATUS_SUCCESS")) {
            while (*p == ' ') { p++; }
            ca_copy(ca_log_reason, sizeof(ca_log_reason), p);
            return;
        }
        p += n + 1;
    }
}

static void ca_destroy_plan(CaPlan* p) {
    if (p->plan) { cudnnBackendDestroyDescriptor(p->plan); }
    for (int i = p->ndescs - 1; i >= 0; i--) { cudnnBackendDestroyDescriptor(p->descs[i]); }
    free(p->descs);
    memset(p, 0, sizeof(*p));
}

static int ca_init(char* why, size_t len) {
    if (ca_init_state == 0) {
        ca_init_state = -1;
        size_t v = cudnnGetVersion();
        int dev = 0;
        cudaDeviceProp prop;
        cudnnStatus_t st;
        if (v / 10000 != CUDNN_MAJOR) {
            snprintf(ca_init_why, sizeof(ca_init_why), "the cuDNN library is version %zu.%zu.%zu, built against %d.%d.%d "
                     "headers: major versions differ", v / 10000, (v / 100) % 100, v % 100, CUDNN_MAJOR, CUDNN_MINOR,
                     CUDNN_PATCHLEVEL);
        } else if (v < CA_MIN_CUDNN_VERSION) {
            snprintf(ca_init_why, sizeof(ca_init_why), "cuDNN %zu.%zu.%zu is too old: fused causal attention here "
                     "needs cuDNN >= %d.%d.0", v / 10000, (v / 100) % 100, v % 100, CA_MIN_CUDNN_VERSION / 10000,
                     (CA_MIN_CUDNN_VERSION / 100) % 100);
        } else if ((st = cudnnGraphVersionCheck()) != CUDNN_STATUS_SUCCESS) {
            char msg[400];
            ca_status_text(st, msg, sizeof(msg));
            snprintf(ca_init_why, sizeof(ca_init_why), "cudnnGraphVersionCheck: cuDNN's sub-libraries disagree: %s", msg);
        } else if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
            cudaGetLastError();
            snprintf(ca_init_why, sizeof(ca_init_why), "no CUDA GPU for cuDNN");
        } else if (prop.major < 8) {
            snprintf(ca_init_why, sizeof(ca_init_why), "cuDNN's fused attention needs an sm_80 or newer GPU; this is "
                     "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
        } else if ((st = cudnnCreate(&ca_handle)) != CUDNN_STATUS_SUCCESS) {
            char msg[400];
            ca_status_text(st, msg, sizeof(msg));
            snprintf(ca_init_why, sizeof(ca_init_why), "cudnnCreate: %s", msg);
            ca_handle = NULL;
        } else {
            ca_sm = prop.major * 10 + prop.minor;
            ca_init_state = 1;
        }
    }
    if (ca_init_state < 0) { ca_copy(why, len, ca_init_why); }
    return ca_init_state > 0;
}

// the plan's engine: index and notes (best effort: left unknown if cuDNN does not say)
static void ca_engine_info(cudnnBackendDescriptor_t cfg, int64_t* index, int* nondet, int* rtc) {
    *index = -1;
    *nondet = 0;
    *rtc = 0;
    cudnnBackendDescriptor_t engine = NULL;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) != CUDNN_STATUS_SUCCESS) { return; }
    int64_t n = 0;
    if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine) ==
        CUDNN_STATUS_SUCCESS && n == 1) {
        cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, index);
        cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
        if (cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                     CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes) == CUDNN_STATUS_SUCCESS) {
            for (int64_t i = 0; i < n && i < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; i++) {
                if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) { *nondet = 1; }
            }
        }
        cudnnBackendBehaviorNote_t bnotes[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
        if (cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                                     CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &n, bnotes) == CUDNN_STATUS_SUCCESS) {
            for (int64_t i = 0; i < n && i < CUDNN_BEHAVIOR_NOTE_TYPE_COUNT; i++) {
                if (bnotes[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) { *rtc = 1; }
            }
        }
    }
    cudnnBackendDestroyDescriptor(engine);
}

// operation graph -> heuristics (mode A, then the fallback list) -> the first engine config
// that finalizes into an execution plan (passing over nondeterministic ones when asked)
static void ca_make_plan(CaBuild* g, CaPlan* p, int want_deterministic) {
    cudnnBackendDescriptor_t opg = ca_new(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    CA_SET(g, opg, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->nops, g->ops, "operation graph");
    ca_set_(g, opg, CA_ATTR_OPGRAPH_HANDLE, "CUDNN_ATTR_OPERATIONGRAPH_HANDLE", CUDNN_TYPE_HANDLE, 1, &ca_handle,
            "operation graph");
    ca_finalize(g, opg, "operation graph");
    if (!g->ok) { return; }
    char last_fail[600] = "";
    int tried = 0;
    int64_t offered = 0;   // engine configs the heuristics listed, before cuDNN's support checks
    const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    for (int m = 0; m < 2 && !p->plan; m++) {
        cudnnBackendDescriptor_t heur = ca_new(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
        CA_SET(g, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &opg, "engine heuristics");
        CA_SET(g, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &modes[m], "engine heuristics");
        ca_finalize(g, heur, "engine heuristics");
        if (!g->ok) { return; }
        int64_t n = 0;
        cudnnStatus_t st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                                    0, &n, NULL);
        if (st != CUDNN_STATUS_SUCCESS) {
            ca_fail(g, "cudnnBackendGetAttribute(CUDNN_ATTR_ENGINEHEUR_RESULTS count)", "engine heuristics", st);
            return;
        }
        offered += n;
        if (n <= 0) { continue; }
        if (n > 16) { n = 16; }
        cudnnBackendDescriptor_t cfgs[16];
        int64_t ncreated = 0;
        for (; ncreated < n; ncreated++) {
            if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfgs[ncreated]) != CUDNN_STATUS_SUCCESS) {
                break;
            }
        }
        int64_t got = 0;
        st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ncreated,
                                      &got, cfgs);
        if (st != CUDNN_STATUS_SUCCESS) {
            for (int64_t i = 0; i < ncreated; i++) { cudnnBackendDestroyDescriptor(cfgs[i]); }
            ca_fail(g, "cudnnBackendGetAttribute(CUDNN_ATTR_ENGINEHEUR_RESULTS)", "engine heuristics", st);
            return;
        }
        // two passes when determinism is asked for: engines without the NONDETERMINISTIC note
        // first, then (if none finalizes) any, reported by nondet_note
        int kept = -1;
        for (int pass = want_deterministic ? 0 : 1; pass < 2 && kept < 0; pass++) {
            for (int64_t i = 0; i < got && kept < 0; i++) {
                int64_t index;
                int nondet, rtc;
                ca_engine_info(cfgs[i], &index, &nondet, &rtc);
                if (pass == 0 && nondet) { continue; }
                if (pass == 1 && want_deterministic && !nondet) { continue; }   // tried in pass 0
                tried++;
                cudnnBackendDescriptor_t plan = NULL;
                st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan);
                if (st == CUDNN_STATUS_SUCCESS) {
                    st = cudnnBackendSetAttribute(plan, CA_ATTR_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &ca_handle);
                }
                if (st == CUDNN_STATUS_SUCCESS) {
                    st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
                }
                if (st == CUDNN_STATUS_SUCCESS) { st = cudnnBackendFinalize(plan); }
                int64_t ws = 0, nws = 0;
                if (st == CUDNN_STATUS_SUCCESS) {
                    st = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                                  &nws, &ws);
                }
                if (st != CUDNN_STATUS_SUCCESS) {
                    char msg[512];
                    ca_status_text(st, msg, sizeof(msg));
                    snprintf(last_fail, sizeof(last_fail), "engine %lld: %s", (long long)index, msg);
                    if (plan) { cudnnBackendDestroyDescriptor(plan); }
                    continue;
                }
                kept = (int)i;
                p->plan = plan;
                p->plan_ws = (size_t)(ws > 0 ? ws : 0);
                p->engine = index;
                p->nondet_note = nondet;
                p->rtc_note = rtc;
            }
        }
        for (int64_t i = 0; i < ncreated; i++) {
            if (i == kept && g->ndesc < CA_MAX_DESC) {
                g->desc[g->ndesc++] = cfgs[i];   // the plan refers to it: kept with it
            } else if (i == kept) {
                cudnnBackendDestroyDescriptor(p->plan);
                cudnnBackendDestroyDescriptor(cfgs[i]);
                p->plan = NULL;
                snprintf(g->why, sizeof(g->why), "internal: more than %d cuDNN descriptors in one graph", CA_MAX_DESC);
                g->ok = 0;
            } else {
                cudnnBackendDestroyDescriptor(cfgs[i]);
            }
        }
        if (!g->ok) { return; }
    }
    p->configs_tried = tried;
    if (!p->plan) {
        snprintf(g->why, sizeof(g->why), "no cuDNN engine takes this graph: heuristics modes A and fallback listed "
                 "%lld engine configs, %d passed cuDNN's support checks, none finalized%s%s", (long long)offered, tried,
                 last_fail[0] ? "; last: " : "", last_fail);
        g->ok = 0;
    }
}

// workspace: one buffer for every plan (forward and backward never run at once), grown on demand
static void ca_reserve_workspace(size_t bytes) {
    if (bytes <= ca_ws_bytes) { return; }
    if (ca_ws) {
        cudaCheck(cudaFree(ca_ws));
        device_bytes_allocated -= (ca_ws_bytes + 255) / 256 * 256;
    }
    ca_ws = device_alloc(bytes, "cuDNN attention workspace");
    ca_ws_bytes = bytes;
}

static CaPlan* ca_find(int kind, int B, int T, int NH, int HS, int flag) {
    for (int i = 0; i < CA_MAX_PLANS; i++) {
        CaPlan* p = &ca_plans[i];
        if (p->used && p->kind == kind && p->B == B && p->T == T && p->NH == NH && p->HS == HS && p->flag == flag) {
            p->last_use = ++ca_clock;
            return p;
        }
    }
    return NULL;
}

static int ca_shape_ok(int B, int T, int NH, int HS, char* why, size_t len) {
    if (B < 1 || T < 1 || NH < 1 || HS < 1) {
        snprintf(why, len, "bad shape B=%d T=%d NH=%d HS=%d", B, T, NH, HS);
        return 0;
    }
    int max_hs = ca_sm >= 90 ? 256 : 128;
    if (HS % 8 != 0 || HS > max_hs) {
        snprintf(why, len, "cuDNN's fused attention needs a head size that is a multiple of 8 and at most %d on "
                 "sm_%d, not %d", max_hs, ca_sm, HS);
        return 0;
    }
    return 1;
}

// the cached plan of a shape, built if new (evicting the least recently used when full);
// NULL with the reason in why if cuDNN cannot
static CaPlan* ca_get(int kind, int B, int T, int NH, int HS, int flag, char* why, size_t len) {
    if (!ca_init(why, len) || !ca_shape_ok(B, T, NH, HS, why, len)) { return NULL; }
    CaPlan* p = ca_find(kind, B, T, NH, HS, flag);
    if (p) { return p; }
    int slot = 0;
    for (int i = 0; i < CA_MAX_PLANS; i++) {
        if (!ca_plans[i].used) { slot = i; break; }
        if (ca_plans[i].last_use < ca_plans[slot].last_use) { slot = i; }
    }
    if (ca_plans[slot].used) { ca_destroy_plan(&ca_plans[slot]); }
    p = &ca_plans[slot];
    CaBuild* g = (CaBuild*)calloc(1, sizeof(CaBuild));
    if (!g) { fatal("out of memory building a cuDNN attention graph"); }
    g->ok = 1;
    g->next_virtual_uid = 1000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    unsigned prev_mask = 0;
    void* prev_udata = NULL;
    cudnnCallback_t prev_fn = NULL;
    int have_prev = cudnnGetCallback(&prev_mask, &prev_udata, &prev_fn) == CUDNN_STATUS_SUCCESS;
    ca_log_reason[0] = '\0';
    cudnnSetCallback(CUDNN_SEV_ERROR_EN | CUDNN_SEV_WARNING_EN, NULL, ca_log_callback);
    if (kind == CA_FWD) {
        ca_build_forward_graph(g, B, T, NH, HS, flag);
    } else {
        ca_build_backward_graph(g, B, T, NH, HS, flag);
    }
    if (g->ok) { ca_make_plan(g, p, kind == CA_BWD && flag); }
    if (have_prev) {
        cudnnSetCallback(prev_mask, prev_udata, prev_fn);
    } else {
        cudnnSetCallback(0, NULL, NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (!g->ok) {
        char msg[1200];
        snprintf(msg, sizeof(msg), "cuDNN %s attention plan for B=%d T=%d NH=%d HS=%d: %s%s%s%s",
                 kind == CA_FWD ? "forward" : "backward", B, T, NH, HS, g->why,
                 ca_log_reason[0] ? " (cuDNN says: " : "", ca_log_reason, ca_log_reason[0] ? ")" : "");
        ca_copy(why, len, msg);
        if (p->plan) { cudnnBackendDestroyDescriptor(p->plan); }
        for (int i = g->ndesc - 1; i >= 0; i--) { cudnnBackendDestroyDescriptor(g->desc[i]); }
        free(g);
        memset(p, 0, sizeof(*p));
        return NULL;
    }
    p->used = 1;
    p->kind = kind;
    p->B = B; p->T = T; p->NH = NH; p->HS = HS; p->flag = flag;
    p->last_use = ++ca_clock;
    p->ndescs = g->ndesc;
    p->descs = (cudnnBackendDescriptor_t*)malloc(sizeof(cudnnBackendDescriptor_t) * (size_t)g->ndesc);
    if (!p->descs) { fatal("out of memory keeping a cuDNN attention plan"); }
    memcpy(p->descs, g->desc, sizeof(cudnnBackendDescriptor_t) * (size_t)g->ndesc);
    free(g);
    p->build_s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    size_t off = ca_align256(p->plan_ws);
    p->off_dsum = p->off_dqacc = 0;
    if (kind == CA_BWD) {
        p->off_dsum = off;
        off = ca_align256(off + (size_t)B * NH * T * sizeof(float));
        if (!flag) {
            p->off_dqacc = off;
            off = ca_align256(off + (size_t)B * NH * T * HS * sizeof(float));
        }
    }
    p->ws_total = off;
    ca_reserve_workspace(p->ws_total);
    return p;
}

static CaPlan* ca_get_or_die(int kind, int B, int T, int NH, int HS, int flag) {
    char why[1200];
    CaPlan* p = ca_get(kind, B, T, NH, HS, flag, why, sizeof(why));
    if (!p) { fatal("%s", why); }
    return p;
}

static void ca_check_aligned(const void* p, const char* what) {
    if (((uintptr_t)p & 15) != 0) { fatal("cuDNN attention: %s is not 16-byte aligned (%p)", what, p); }
}

static void ca_execute(CaPlan* p, int n, const int64_t* uids, void** ptrs) {
    cudnnBackendDescriptor_t pack = NULL;
    cudnnCheck(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
    cudnnCheck(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids));
    cudnnCheck(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs));
    cudnnCheck(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ca_ws));
    cudnnCheck(cudnnBackendFinalize(pack));
    cudnnCheck(cudnnBackendExecute(ca_handle, p->plan, pack));
    cudnnCheck(cudnnBackendDestroyDescriptor(pack));
}

// by-value scalars of the variant pack: read on the host when the plan is executed
static float ca_scale_value, ca_neginf_value, ca_one_value;

// --- the interface --------------------------------------------------------------------------

// a forward pass that keeps its statistics (fast mode's forward always does), e.g. the sampler's
static int cudnn_attention_forward_supported(int B, int T, int NH, int HS, char* why, size_t len) {
    return ca_get(CA_FWD, B, T, NH, HS, 1, why, len) != NULL;
}

static int cudnn_attention_supported(int B, int T, int NH, int HS, char* why, size_t len) {
    if (!cudnn_attention_forward_supported(B, T, NH, HS, why, len)) { return 0; }
    if (!ca_get(CA_BWD, B, T, NH, HS, cudnn_attention_deterministic ? 1 : 0, why, len)) { return 0; }
    return 1;
}

// qkv (B,T,3C) -> out (B,T,C) and, when training, stats (B,NH,T) (natural-log log-sum-exp)
static void attention_forward_cudnn(floatX* out, float* stats, const floatX* qkv, int B, int T, int NH, int HS,
                                    int training) {
    training = training ? 1 : 0;
    CaPlan* p = ca_get_or_die(CA_FWD, B, T, NH, HS, training);
    if (training && stats == NULL) { fatal("attention_forward_cudnn: training needs the stats buffer"); }
    ca_check_aligned(qkv, "qkv");
    ca_check_aligned(out, "out");
    if (stats) { ca_check_aligned(stats, "stats"); }
    long C = (long)NH * HS;
    ca_scale_value = 1.0f / sqrtf((float)HS);
    ca_neginf_value = -INFINITY;
    int64_t uids[7] = {CA_UID_Q, CA_UID_K, CA_UID_V, CA_UID_O, CA_UID_SCALE, CA_UID_NEGINF, CA_UID_STATS};
    void* ptrs[7] = {(void*)qkv, (void*)(qkv + C), (void*)(qkv + 2 * C), (void*)out, &ca_scale_value,
                     &ca_neginf_value, (void*)stats};
    ca_execute(p, training ? 7 : 6, uids, ptrs);
}

// dqkv (B,T,3C) <- dout (B,T,C), given the forward's qkv, out and stats (all of dqkv is written)
static void attention_backward_cudnn(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out,
                                     const float* stats, int B, int T, int NH, int HS) {
    int det = cudnn_attention_deterministic ? 1 : 0;
    CaPlan* p = ca_get_or_die(CA_BWD, B, T, NH, HS, det);
    ca_check_aligned(dqkv, "dqkv");
    ca_check_aligned(dout, "dout");
    ca_check_aligned(qkv, "qkv");
    ca_check_aligned(out, "out");
    ca_check_aligned(stats, "stats");
    long C = (long)NH * HS;
    ca_scale_value = 1.0f / sqrtf((float)HS);
    ca_neginf_value = -INFINITY;
    ca_one_value = 1.0f;
    char* ws = (char*)ca_ws;
    if (!det) {   // cuDNN >= 9.6 clears the accumulator itself; cleared here too, cheaply, to be sure
        cudaCheck(cudaMemsetAsync(ws + p->off_dqacc, 0, (size_t)B * NH * T * HS * sizeof(float), 0));
    }
    int64_t uids[14] = {CA_UID_Q, CA_UID_K, CA_UID_V, CA_UID_O, CA_UID_DO, CA_UID_STATS, CA_UID_DQ, CA_UID_DK,
                        CA_UID_DV, CA_UID_SCALE, CA_UID_NEGINF, CA_UID_ONE, CA_UID_DSUM, CA_UID_DQACC};
    void* ptrs[14] = {(void*)qkv, (void*)(qkv + C), (void*)(qkv + 2 * C), (void*)out, (void*)dout, (void*)stats,
                      (void*)dqkv, (void*)(dqkv + C), (void*)(dqkv + 2 * C), &ca_scale_value, &ca_neginf_value,
                      &ca_one_value, ws + p->off_dsum, ws + p->off_dqacc};
    ca_execute(p, det ? 13 : 14, uids, ptrs);
}

// one line: the engines and workspace of a shape's plans (those built so far)
static void cudnn_attention_plan_info(int B, int T, int NH, int HS, char* buf, size_t len) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < CA_MAX_PLANS && used + 1 < len; i++) {
        CaPlan* p = &ca_plans[i];
        if (!p->used || p->B != B || p->T != T || p->NH != NH || p->HS != HS) { continue; }
        int w = snprintf(buf + used, len - used, "%s%s%s: engine %lld%s%s, ws %.1f MiB, built in %.2fs",
                         used ? "; " : "", p->kind == CA_FWD ? "fwd" : "bwd",
                         p->kind == CA_FWD ? (p->flag ? "(train)" : "(infer)") : (p->flag ? "(det)" : "(nondet)"),
                         (long long)p->engine, p->nondet_note ? " NONDETERMINISTIC-note" : "",
                         p->rtc_note ? " rtc" : "", p->ws_total / 1048576.0, p->build_s);
        if (w < 0) { break; }
        used += (size_t)w;
        if (used >= len) { used = len - 1; }
    }
}

static void cudnn_attention_free(void) {
    for (int i = 0; i < CA_MAX_PLANS; i++) {
        if (ca_plans[i].used) { ca_destroy_plan(&ca_plans[i]); }
    }
    if (ca_ws) {
        cudaCheck(cudaFree(ca_ws));
        device_bytes_allocated -= (ca_ws_bytes + 255) / 256 * 256;
        ca_ws = NULL;
        ca_ws_bytes = 0;
    }
    if (ca_handle) {
        cudnnCheck(cudnnDestroy(ca_handle));
        ca_handle = NULL;
    }
    ca_init_state = 0;
}

#endif // LLMC_ATTENTION_CUDNN_CUH
