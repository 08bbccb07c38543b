/*
 * comm.h: the communicator. A rank grid (data x context x tensor x pipeline parallel) and the
 * collectives the trainer needs, on host float buffers, over MPI.
 *
 * The trainer calls comm_* functions with buffers, sizes, a group and a traffic kind; nothing
 * in those signatures is MPI's, so a second backend (NCCL, for train_gpt2cu) can live behind
 * the same functions. Built without USE_MPI this is a genuine single-rank communicator: the
 * world has one rank, every group has one rank, and a collective over one rank is a copy.
 *
 * DETERMINISM
 * MPI_SUM's order of combining ranks is unspecified (it changes with the algorithm Open MPI
 * picks for the message size, and with the number of ranks), so float sums NEVER use it.
 * A float sum over a group is canonical.h's rule R1: the halving tree over the group's ranks in
 * rank order. comm_reduce_scatter() sends every rank the blocks it owns with an all-to-all and
 * sums them locally in that tree order; all-reduce is that reduce-scatter followed by an
 * all-gather. Both send what a ring sends: (size-1)/size of the buffer per rank each, so the
 * all-reduce costs the bandwidth-optimal 2(size-1)/size. A DP rank that owns a complete
 * subtree of microbatches (canonical.h R3) finishes the same tree one rank would have built.
 * Max uses its own commutative operator (below), the exact sum of squares (SumSq) integer
 * sums: both are order-free, so MPI may combine them in any order.
 *
 * THE GRID (Megatron's rank order: tensor parallel fastest, then context, then data, then
 * pipeline)
 *     world_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
 * so a tensor-parallel group is tp consecutive ranks (one node, the fastest links), a
 * context-parallel group the next-closest, and the ranks of one pipeline stage are a
 * contiguous block. Each group's rank is its coordinate: dp_group.rank == dp_rank, and so on.
 *
 * FAULTS
 * comm_init() points utils.h's fatal() at MPI_Abort, so one rank's error ends every rank (with
 * that rank's message, prefixed "[rank R] ") instead of leaving the others waiting forever in
 * a collective. MPI errors are turned into fatal() lines naming the operation.
 *
 * ACCOUNTING
 * Every call adds the bytes THIS rank sends to a counter of the kind the caller names, and
 * counts the call. The bytes are those of the bandwidth-optimal algorithm, the same on every
 * backend (see comm_print_stats for the formulas), so layouts can be compared by them.
 *
 * WHERE THE BUFFERS LIVE
 * A group knows the memory the model's tensors live in (its MemOps, memory.h: host memory by
 * default, the GPU's with comm_set_memory). A buffer in that memory that the host cannot read
 * (MemOps.holds) is staged through host memory around the MPI calls - copied to a host buffer,
 * sent, received into a host buffer, summed there by the same R1 tree, copied back - which is
 * what the CUDA build does when several ranks share one GPU, and what the emulated CUDA build
 * always does. Like a CUDA-aware MPI, comm.h tells device buffers from host ones by asking
 * where the pointer lives, so the small host-side collectives (losses, norms, flags) and the
 * device-side ones (gradients, parameters, activations) use the same calls.
 *
 * WORKSPACE
 * A reduce-scatter of size*n floats receives size*n floats before summing them (all-reduce: the
 * padded buffer, once or twice). Workspace buffers are kept per group and reused (one per
 * collective in flight at once), until comm_finalize.
 *
 * Messages longer than COMM_PIECE_FLOATS per rank are sent in pieces, because MPI counts are
 * int: a buffer may hold up to about 2^31 floats per rank or more.
 *
 * THE CALLS (g: a CommGroup*, e.g. &comm.dp_group; kind: a CommKind)
 *   comm_init(&comm, &argc, &argv)  comm_setup_grid(&comm, tp, pp)  comm_finalize(&comm)
 *   comm_setup_grid_cp(&comm, tp, cp, pp)  (with a context-parallel dimension)
 *   comm_pp_neighbours(&comm, &prev, &next)  comm_grid_world_rank(&comm, dp_r, tp_r, pp_r)
 *   comm_reduce_scatter(g, send, recv, n, kind)   send: size*n floats, recv: n
 *   comm_all_gather(g, send, recv, n, kind)       send: n floats, recv: size*n
 *   comm_all_reduce_sum(g, buf, n, kind)  comm_all_reduce_max(g, buf, n, kind)
 *   comm_all_reduce_sumsq(g, &sumsq, kind)  comm_broadcast(g, buf, bytes, root, kind)
 *   comm_all_to_all(g, send, recv, n, kind)       send, recv: size*n floats
 *   comm_barrier(g)
 *   comm_setup_expert_groups(&comm, ep)  (expert parallelism: the ep and edp groups)
 *   comm_all_to_all_v(g, send, send_counts, recv, recv_counts, kind)   floats, counts per rank
 *   comm_all_to_all_ints(g, send, send_counts, recv, recv_counts, kind) host ints, likewise
 *   non-blocking: req = comm_reduce_scatter_start / comm_all_gather_start /
 *     comm_all_reduce_sum_start (same arguments), comm_isend(g, buf, n, peer, tag, kind),
 *     comm_irecv(...); comm_test(req); comm_wait(req); comm_wait_all(reqs, count)
 *   comm_sendrecv(g, send, n_send, dest, recv, n_recv, source, tag, kind)
 *   comm_print_stats(&comm, stdout)  comm_reset_stats(&comm)
 */
#ifndef LLMC_COMM_H
#define LLMC_COMM_H

#include <math.h>          // canonical.h uses fmaf and sqrtf
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef USE_MPI
#include <mpi.h>
#endif
#include "llmc/canonical.h"
#include "llmc/memory.h"
#include "llmc/utils.h"

// What the traffic is for; the caller names it on every call so the counters tell DP, ZeRO,
// TP and PP traffic apart.
typedef enum {
    COMM_KIND_GRAD,     // gradient reduce-scatter / all-reduce (DP, ZeRO)
    COMM_KIND_PARAM,    // parameter all-gather (ZeRO)
    COMM_KIND_TP,       // tensor-parallel activations and their gradients
    COMM_KIND_PP,       // pipeline activations and their gradients
    COMM_KIND_EP,       // expert parallelism: tokens to their experts and back, their counts
    COMM_KIND_CP,       // context-parallel attention: K/V blocks and dK/dV partials (ring), all-to-alls (a2a)
    COMM_KIND_OTHER,    // loss, norms, flags, barriers: small stuff
    COMM_KIND_COUNT
} CommKind;

static const char* comm_kind_name[COMM_KIND_COUNT] = { "grad", "param", "tp", "pp", "ep", "cp", "other" };

typedef struct {
    uint64_t bytes[COMM_KIND_COUNT];   // bytes this rank sent
    uint64_t calls[COMM_KIND_COUNT];
} CommStats;

// Workspace buffers a group keeps for reuse (see comm_workspace_get).
#define COMM_POOL 16
typedef struct { float* buf; size_t floats; } CommBuffer;

// One group of ranks (the world, or this rank's dp, cp, tp or pp group).
typedef struct {
    int rank, size;
    const MemOps* mem;         // the memory of the model's tensors (see WHERE THE BUFFERS LIVE)
    struct CommNccl* nccl;     // the NCCL transport of its device buffers, or NULL (comm_nccl.h)
    CommStats* stats;          // the owning Comm's counters
    CommBuffer pool[COMM_POOL];// idle workspace buffers
    int npool;
#ifdef USE_MPI
    MPI_Comm mpi;
#endif
} CommGroup;

// A Comm must stay where comm_init() put it: its groups point at its counters.
typedef struct {
    int world_rank, world_size;
    int dp, tp, pp;                    // grid sizes: world_size == dp * cp * tp * pp
    int dp_rank, tp_rank, pp_rank;     // this rank's coordinates
    CommGroup world, dp_group, tp_group, pp_group;
    // expert parallelism (comm_setup_expert_groups): the dp group is cut into ep groups of ep
    // consecutive dp ranks (which exchange tokens), and edp groups of the ranks at the same
    // place in every ep group (which hold the same experts and reduce their gradients)
    int ep, ep_rank, edp_rank;
    CommGroup ep_group, edp_group;
    int cp, cp_rank;                   // the context-parallel dimension (context_parallel.h)
    CommGroup cp_group;
    CommGroup dpcp_group;              // data x context parallel (ranked dp_rank * cp + cp_rank):
                                       // ZeRO's sharding group, Megatron's dp group "with cp"
    CommStats stats;
    const MemOps* mem;                 // given to every group
} Comm;

// A collective or point-to-point operation in flight (comm_*_start, comm_isend, comm_irecv).
// NULL means nothing is left to do (size-1 groups, missing pipeline neighbours).
typedef struct CommRequest CommRequest;
static inline void comm_wait(CommRequest* req);

#define COMM_NO_PEER (-1)              // "no neighbour": point-to-point calls do nothing

// Per-rank message size above which collectives and sends are split into pieces: MPI counts
// are int, and 2^28 floats (1 GiB) keeps every byte count below 2^31 as well.
#ifndef COMM_PIECE_FLOATS
#define COMM_PIECE_FLOATS ((size_t)1 << 28)
#endif
// The test lowers it to exercise the splitting on small buffers.
static size_t comm_piece_floats = COMM_PIECE_FLOATS;

// ------------------------------------------------------------------------------------------
// small helpers

static inline size_t comm_pieces(size_t n) { return (n + comm_piece_floats - 1) / comm_piece_floats; }

static inline size_t comm_piece_len(size_t n, size_t p) {
    size_t off = p * comm_piece_floats;
    return n - off < comm_piece_floats ? n - off : comm_piece_floats;
}

static inline void comm_check_group(const CommGroup* g, const char* what) {
    if (g->size < 1) { fatal("%s on a communicator group that was never set up", what); }
}

static inline void comm_account(CommGroup* g, CommKind kind, uint64_t bytes, const char* what) {
    if ((int)kind < 0 || kind >= COMM_KIND_COUNT) { fatal("%s: bad traffic kind %d", what, (int)kind); }
    g->stats->bytes[kind] += bytes;
    g->stats->calls[kind] += 1;
}

// Bytes a ring all-reduce of n floats sends per rank: reduce-scatter then all-gather of the
// buffer padded to a multiple of the group size.
static inline uint64_t comm_all_reduce_bytes(int size, size_t n, size_t elem_bytes) {
    uint64_t shard = (n + size - 1) / size;
    return 2 * (uint64_t)(size - 1) * shard * elem_bytes;
}

// An all-gather's send buffer is either separate from the receive buffer or exactly this rank's
// block of it (in place); anything else would be overwritten while it is being sent.
static inline void comm_check_gather_buffers(const CommGroup* g, const float* send, const float* recv, size_t n) {
    uintptr_t s = (uintptr_t)send, r = (uintptr_t)recv, bytes = n * sizeof(float);
    int own = send == recv + (size_t)g->rank * n;
    if (!own && s < r + (size_t)g->size * bytes && s + bytes > r) {
        fatal("all-gather: the send buffer overlaps the receive buffer, and is not this rank's block of it");
    }
}

// Workspace for a collective (the all-to-all's landing area, a padded copy). Buffers come back
// to the group's pool when the collective is done and are reused: fresh memory costs a page
// fault per 4 KiB on first touch, which made a 64 MB non-blocking reduce-scatter 3x slower.
// The pool holds as many buffers as were ever in flight at once (at most COMM_POOL kept),
// until comm_finalize. Takes the smallest idle buffer that fits, else replaces the largest.
static inline CommBuffer comm_workspace_get(CommGroup* g, size_t floats) {
    int best = -1, largest = -1;
    for (int i = 0; i < g->npool; i++) {
        if (g->pool[i].floats >= floats && (best < 0 || g->pool[i].floats < g->pool[best].floats)) { best = i; }
        if (largest < 0 || g->pool[i].floats > g->pool[largest].floats) { largest = i; }
    }
    CommBuffer b = { NULL, 0 };
    int take = best >= 0 ? best : largest;
    if (take >= 0) {
        b = g->pool[take];
        g->pool[take] = g->pool[--g->npool];
    }
    if (b.floats < floats) {
        free(b.buf);
        b.buf = (float*)malloc_or_die(floats * sizeof(float), "communication workspace");
        b.floats = floats;
    }
    return b;
}

static inline void comm_workspace_put(CommGroup* g, CommBuffer b) {
    if (b.buf == NULL) { return; }
    if (g->npool < COMM_POOL) { g->pool[g->npool++] = b; } else { free(b.buf); }
}

// Staging (see WHERE THE BUFFERS LIVE). comm_stage_in returns what the host reads for p: p
// itself, or a host copy of its n floats in *stage. comm_stage_out returns where the host
// writes for p (p, or *stage), and comm_unstage copies a staged result back into p.
static inline int comm_staged(const CommGroup* g, const void* p) { return g->mem->holds(p); }
static inline const float* comm_stage_in(CommGroup* g, const float* p, size_t n, CommBuffer* stage) {
    if (!comm_staged(g, p)) { return p; }
    *stage = comm_workspace_get(g, n);
    g->mem->to_host(stage->buf, p, n * sizeof(float));
    return stage->buf;
}
static inline float* comm_stage_out(CommGroup* g, float* p, size_t n, CommBuffer* stage) {
    if (!comm_staged(g, p)) { return p; }
    *stage = comm_workspace_get(g, n);
    return stage->buf;
}
static inline void comm_unstage(CommGroup* g, float* p, size_t n, CommBuffer* stage) {
    if (stage->buf == NULL) { return; }
    g->mem->from_host(p, stage->buf, n * sizeof(float));
    comm_workspace_put(g, *stage);
    stage->buf = NULL;
}

// Elementwise max, the same bits in any order of combining: a NaN anywhere gives the
// canonical quiet NaN, and +0 beats -0. (MPI_MAX computes a > b ? a : b, whose answer for a
// NaN or for -0 vs +0 depends on which rank's value comes first.)
static inline float comm_max2(float a, float b) {
    if (a != a || b != b) { return canon_nan(); }
    if (a != b) { return a > b ? a : b; }
    return (canon_float_to_bits(a) >> 31) ? b : a;     // equal: only +0 and -0 differ in bits
}

// ------------------------------------------------------------------------------------------
// MPI plumbing
#ifdef USE_MPI

static MPI_Op comm_max_op = MPI_OP_NULL;

static inline void comm_max_op_fn(void* in, void* inout, int* len, MPI_Datatype* type) {
    const float* a = (const float*)in;
    float* b = (float*)inout;
    for (int i = 0; i < *len; i++) { b[i] = comm_max2(a[i], b[i]); }
}

static inline void comm_fatal_hook(int exit_code) { MPI_Abort(MPI_COMM_WORLD, exit_code); }
// A job of one rank has no one to stop: finalize quietly instead of MPI_Abort's banner.
static inline void comm_fatal_hook_single(int exit_code) { (void)exit_code; MPI_Finalize(); }

static inline void comm_check(int err, const char* what) {
    if (err != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(err, msg, &len);
        fatal("MPI error in %s: %s", what, msg);
    }
}

// The datatype of one piece of one rank's block in a buffer of consecutive blocks of n floats:
// len floats, the next rank's piece n floats further on. A whole block (len == n) is plain
// floats; a shorter piece is a type stretched to the block stride (the stride in bytes is an
// MPI_Aint, so blocks of more than 2^31 floats are fine).
typedef struct { MPI_Datatype type; int count; } CommBlockType;

static inline CommBlockType comm_block_type(size_t len, size_t n) {
    CommBlockType t = { MPI_FLOAT, (int)len };
    if (len != n) {
        MPI_Datatype piece;
        comm_check(MPI_Type_contiguous((int)len, MPI_FLOAT, &piece), "MPI_Type_contiguous");
        comm_check(MPI_Type_create_resized(piece, 0, (MPI_Aint)(n * sizeof(float)), &t.type),
                   "MPI_Type_create_resized");
        comm_check(MPI_Type_commit(&t.type), "MPI_Type_commit");
        MPI_Type_free(&piece);
        t.count = 1;
    }
    return t;
}

// Operations still pending on the type are unaffected (MPI keeps it alive until they finish).
static inline void comm_block_type_free(CommBlockType* t) {
    if (t->type != MPI_FLOAT) { MPI_Type_free(&t->type); }
}

// All-to-all of size blocks of n floats (send: block r goes to rank r) into tmp, piece by
// piece: piece p of every block lands at tmp + size*off as size consecutive rows of len floats
// (row r from rank r), ready for host_tree_rows (memory.h). Blocking if reqs is NULL, else one
// request per piece.
static inline void comm_alltoall_pieces(CommGroup* g, const float* send, float* tmp, size_t n,
                                        MPI_Request* reqs) {
    for (size_t p = 0; p < comm_pieces(n); p++) {
        size_t off = p * comm_piece_floats, len = comm_piece_len(n, p);
        CommBlockType st = comm_block_type(len, n);
        float* dst = tmp + (size_t)g->size * off;
        if (reqs) {
            comm_check(MPI_Ialltoall(send + off, st.count, st.type, dst, (int)len, MPI_FLOAT,
                                     g->mpi, &reqs[p]), "MPI_Ialltoall (reduce-scatter)");
        } else {
            comm_check(MPI_Alltoall(send + off, st.count, st.type, dst, (int)len, MPI_FLOAT,
                                    g->mpi), "MPI_Alltoall (reduce-scatter)");
        }
        comm_block_type_free(&st);
    }
}

// The local half of the reduce-scatter, once the all-to-all has landed.
static inline void comm_reduce_pieces(CommGroup* g, float* tmp, float* recv, size_t n) {
    for (size_t p = 0; p < comm_pieces(n); p++) {
        size_t off = p * comm_piece_floats, len = comm_piece_len(n, p);
        host_tree_rows(tmp + (size_t)g->size * off, len, g->size, recv + off);
    }
}

// All-gather of n floats per rank into recv (size blocks of n), piece by piece. send may be
// this rank's own block of recv (in place). Blocking if reqs is NULL.
static inline void comm_allgather_pieces(CommGroup* g, const float* send, float* recv, size_t n,
                                         MPI_Request* reqs) {
    int in_place = send == recv + (size_t)g->rank * n;
    for (size_t p = 0; p < comm_pieces(n); p++) {
        size_t off = p * comm_piece_floats, len = comm_piece_len(n, p);
        CommBlockType rt = comm_block_type(len, n);
        const void* src = in_place ? MPI_IN_PLACE : (const void*)(send + off);
        if (reqs) {
            comm_check(MPI_Iallgather(src, (int)len, MPI_FLOAT, recv + off, rt.count, rt.type,
                                      g->mpi, &reqs[p]), "MPI_Iallgather");
        } else {
            comm_check(MPI_Allgather(src, (int)len, MPI_FLOAT, recv + off, rt.count, rt.type,
                                     g->mpi), "MPI_Allgather");
        }
        comm_block_type_free(&rt);
    }
}

typedef enum { COMM_OP_REDUCE_SCATTER, COMM_OP_ALL_GATHER, COMM_OP_ALL_REDUCE, COMM_OP_P2P } CommOp;

struct CommRequest {
    CommOp op;
    CommGroup* group;
    size_t n;              // per-rank block (reduce-scatter, all-gather), shard (all-reduce)
    float* out;            // reduce-scatter: recv; all-reduce: the caller's buffer
    size_t out_n;          // all-reduce: the caller's length
    CommBuffer work;       // the all-to-all's landing area, and the all-reduce's padded copy
    float* padded;         // all-reduce: the padded buffer (in work) or the caller's buffer
    CommBuffer stage_in;   // a staged send buffer (host copy of a device buffer)
    CommBuffer stage_out;  // a staged receive buffer, copied into `device` by comm_wait
    float* device;         // ... the device buffer it belongs to
    size_t device_n;       // ... and its length
    void* nccl_done;       // an NCCL operation: the event after its transfers (comm_nccl.h)
    int npieces;
    MPI_Request mpi[];     // one per piece
};

static inline CommRequest* comm_request_new(CommOp op, CommGroup* g, size_t pieces) {
    CommRequest* req = (CommRequest*)calloc_or_die(1, sizeof(CommRequest) + pieces * sizeof(MPI_Request),
                                                   "communication request");
    req->op = op;
    req->group = g;
    req->npieces = (int)pieces;
    for (size_t p = 0; p < pieces; p++) { req->mpi[p] = MPI_REQUEST_NULL; }
    return req;
}

#ifdef USE_NCCL
#include "llmc/comm_nccl.h"
#endif

// Where the request receives n floats meant for p: p itself, or a host buffer that comm_wait
// copies into the device buffer p.
static inline float* comm_request_stage_out(CommRequest* req, float* p, size_t n) {
    if (!comm_staged(req->group, p)) { return p; }
    req->device = p;
    req->device_n = n;
    return comm_stage_out(req->group, p, n, &req->stage_out);
}

#endif // USE_MPI

// ------------------------------------------------------------------------------------------
// setup

static inline void comm_group_init_single(CommGroup* g, CommStats* stats, const MemOps* mem) {
    memset(g, 0, sizeof(*g));
    g->rank = 0;
    g->size = 1;
    g->stats = stats;
    g->mem = mem;
#ifdef USE_MPI
    g->mpi = MPI_COMM_NULL;
#endif
}

static inline void comm_group_free(CommGroup* g) {
#ifdef USE_NCCL
    comm_nccl_free_group(g);
#endif
    for (int i = 0; i < g->npool; i++) { free(g->pool[i].buf); }
#ifdef USE_MPI
    if (g->mpi != MPI_COMM_NULL) { MPI_Comm_free(&g->mpi); }
#endif
    CommStats* stats = g->stats;
    const MemOps* mem = g->mem;
    memset(g, 0, sizeof(*g));
    g->stats = stats;
    g->mem = mem;
#ifdef USE_MPI
    g->mpi = MPI_COMM_NULL;
#endif
}

static inline void comm_setup_grid(Comm* c, int tp, int pp);

// Starts the communicator: MPI_Init, the world group, fatal() wired to MPI_Abort, and the
// trivial grid (every rank data parallel) until comm_setup_grid() says otherwise.
static inline void comm_init(Comm* c, int* argc, char*** argv) {
    memset(c, 0, sizeof(*c));
    c->mem = &memory_host;
    comm_group_init_single(&c->world, &c->stats, c->mem);
    comm_group_init_single(&c->dp_group, &c->stats, c->mem);
    comm_group_init_single(&c->tp_group, &c->stats, c->mem);
    comm_group_init_single(&c->pp_group, &c->stats, c->mem);
    comm_group_init_single(&c->ep_group, &c->stats, c->mem);
    comm_group_init_single(&c->edp_group, &c->stats, c->mem);
    c->ep = 1;
    comm_group_init_single(&c->cp_group, &c->stats, c->mem);
    comm_group_init_single(&c->dpcp_group, &c->stats, c->mem);
#ifdef USE_MPI
    int initialized = 0, provided = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
        // Only the main thread calls MPI (OpenMP threads compute between calls).
        comm_check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    }
    llmc_fatal_hook = comm_fatal_hook;
    // A private copy of the world, so no other traffic can match ours. Its errors come back as
    // codes, so comm_check names the operation in a fatal() line; the groups are split from it
    // and inherit that.
    comm_check(MPI_Comm_dup(MPI_COMM_WORLD, &c->world.mpi), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(c->world.mpi, MPI_ERRORS_RETURN);
    MPI_Comm_rank(c->world.mpi, &c->world.rank);
    MPI_Comm_size(c->world.mpi, &c->world.size);
    if (c->world.size > 1) {
        snprintf(llmc_fatal_prefix, sizeof(llmc_fatal_prefix), "[rank %d] ", c->world.rank);
    } else {
        llmc_fatal_hook = comm_fatal_hook_single;
    }
    comm_check(MPI_Op_create(comm_max_op_fn, 1, &comm_max_op), "MPI_Op_create");
#else
    // Started by mpirun without MPI built in, every process would believe it is the only rank
    // and they would all write the same files: refuse.
    const char* launched[] = { "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS" };
    for (int i = 0; i < 4; i++) {
        const char* v = getenv(launched[i]);
        if (v && atoi(v) > 1) {
            fatal("started as one of %s ranks (%s), but MPI is not built in: rebuild with mpicc "
                  "-DUSE_MPI (make does when mpicc is found)", v, launched[i]);
        }
    }
#endif
    c->world_rank = c->world.rank;
    c->world_size = c->world.size;
    comm_setup_grid(c, 1, 1);
}

// world_rank of the rank at grid coordinates (dp_rank, cp_rank, tp_rank, pp_rank).
static inline int comm_grid_world_rank_cp(const Comm* c, int dp_rank, int cp_rank, int tp_rank, int pp_rank) {
    return ((pp_rank * c->dp + dp_rank) * c->cp + cp_rank) * c->tp + tp_rank;
}

// ... at (dp_rank, tp_rank, pp_rank) and this rank's context-parallel coordinate.
static inline int comm_grid_world_rank(const Comm* c, int dp_rank, int tp_rank, int pp_rank) {
    return comm_grid_world_rank_cp(c, dp_rank, c->cp_rank, tp_rank, pp_rank);
}

#ifdef USE_MPI
// The group of the ranks with the same `color`, ranked by `coordinate`.
static inline void comm_split(const Comm* c, CommGroup* g, int color, int coordinate, const char* name) {
    comm_check(MPI_Comm_split(c->world.mpi, color, coordinate, &g->mpi), "MPI_Comm_split");
    MPI_Comm_rank(g->mpi, &g->rank);
    MPI_Comm_size(g->mpi, &g->size);
    if (g->rank != coordinate) {
        fatal("%s group: rank %d in the group, expected coordinate %d", name, g->rank, coordinate);
    }
}
#endif

// Arranges the world as dp x cp x tp x pp (dp = world_size / (cp * tp * pp)) and builds this
// rank's four groups. Collective over the world: every rank calls it with the same tp, cp and
// pp. May be called again to change the layout.
static inline void comm_setup_grid_cp(Comm* c, int tp, int cp, int pp) {
    if (tp < 1 || cp < 1 || pp < 1) {
        fatal("tensor, context and pipeline parallel sizes must be >= 1, got tp=%d cp=%d pp=%d", tp, cp, pp);
    }
#ifndef USE_MPI
    if (tp * cp * pp > 1) {
        fatal("tp=%d x cp=%d x pp=%d needs %d ranks, but MPI is not built in (single rank only): rebuild "
              "with mpicc -DUSE_MPI and run under mpirun", tp, cp, pp, tp * cp * pp);
    }
#endif
    if (c->world_size % (tp * cp * pp) != 0) {
        fatal("world size %d is not divisible by tp=%d x cp=%d x pp=%d (= %d): the data-parallel size "
              "must be a whole number", c->world_size, tp, cp, pp, tp * cp * pp);
    }
    comm_group_free(&c->dp_group);
    comm_group_free(&c->tp_group);
    comm_group_free(&c->pp_group);
    comm_group_free(&c->ep_group);
    comm_group_free(&c->edp_group);
    c->ep = 1;
    c->ep_rank = c->edp_rank = 0;
    comm_group_free(&c->cp_group);
    comm_group_free(&c->dpcp_group);
    c->tp = tp;
    c->cp = cp;
    c->pp = pp;
    c->dp = c->world_size / (tp * cp * pp);
    int w = c->world_rank;
    c->tp_rank = w % tp;
    c->cp_rank = (w / tp) % cp;
    c->dp_rank = (w / (tp * cp)) % c->dp;
    c->pp_rank = w / (tp * cp * c->dp);
#ifdef USE_MPI
    int pp_r = c->pp_rank, dp_r = c->dp_rank, cp_r = c->cp_rank, tp_r = c->tp_rank, dp = c->dp;
    // Same pp, dp and cp coordinates: one tp group (tp consecutive world ranks).
    comm_split(c, &c->tp_group, (pp_r * dp + dp_r) * cp + cp_r, tp_r, "tp");
    // Same pp, dp and tp coordinates: one cp group.
    comm_split(c, &c->cp_group, (pp_r * dp + dp_r) * tp + tp_r, cp_r, "cp");
    // Same pp, cp and tp coordinates: one dp group.
    comm_split(c, &c->dp_group, (pp_r * cp + cp_r) * tp + tp_r, dp_r, "dp");
    // Same dp, cp and tp coordinates: one pipeline.
    comm_split(c, &c->pp_group, (dp_r * cp + cp_r) * tp + tp_r, pp_r, "pp");
    // Same pp and tp coordinates: one data x context group.
    comm_split(c, &c->dpcp_group, pp_r * tp + tp_r, dp_r * cp + cp_r, "dp x cp");
#else
    comm_group_init_single(&c->tp_group, &c->stats, c->mem);
    comm_group_init_single(&c->dp_group, &c->stats, c->mem);
    comm_group_init_single(&c->pp_group, &c->stats, c->mem);
    comm_group_init_single(&c->cp_group, &c->stats, c->mem);
    comm_group_init_single(&c->dpcp_group, &c->stats, c->mem);
#endif
    comm_group_init_single(&c->ep_group, &c->stats, c->mem);
    comm_group_init_single(&c->edp_group, &c->stats, c->mem);
}

// Expert parallelism over ep ranks, carved from the data-parallel group as Megatron and
// DeepSpeed do: dp rank d is rank d % ep of the ep group of dp ranks [d - d % ep, ... + ep)
// and rank d / ep of the edp group of dp ranks d % ep, d % ep + ep, ... Collective over the
// world (after comm_setup_grid).
static inline void comm_setup_expert_groups(Comm* c, int ep) {
    if (ep < 1 || c->dp % ep != 0) {
        fatal("--ep %d: the expert-parallel degree must divide the %d data-parallel ranks", ep, c->dp);
    }
    comm_group_free(&c->ep_group);
    comm_group_free(&c->edp_group);
    c->ep = ep;
    c->ep_rank = c->dp_rank % ep;
    c->edp_rank = c->dp_rank / ep;
#ifdef USE_MPI
    int base = (c->pp_rank * c->cp + c->cp_rank) * c->tp + c->tp_rank;   // the dp group's colour (comm_setup_grid_cp)
    comm_split(c, &c->ep_group, base * c->dp + c->dp_rank / ep, c->ep_rank, "ep");
    comm_split(c, &c->edp_group, base * c->dp + c->dp_rank % ep, c->edp_rank, "edp");
#else
    comm_group_init_single(&c->ep_group, &c->stats, c->mem);
    comm_group_init_single(&c->edp_group, &c->stats, c->mem);
#endif
    c->ep_group.mem = c->edp_group.mem = c->mem;
}

// The grid without context parallelism: dp x tp x pp.
static inline void comm_setup_grid(Comm* c, int tp, int pp) { comm_setup_grid_cp(c, tp, 1, pp); }

#ifdef USE_NCCL
// The NCCL transport for the device buffers of the dp, tp and pp groups (comm_nccl.h); one GPU
// per rank. Collective over the world.
static inline void comm_enable_nccl(Comm* c) {
    comm_nccl_init_group(&c->dp_group);
    comm_nccl_init_group(&c->tp_group);
    comm_nccl_init_group(&c->pp_group);
    comm_nccl_init_group(&c->cp_group);
    comm_nccl_init_group(&c->dpcp_group);
}
#endif

// The memory of the model's tensors, for every group (see WHERE THE BUFFERS LIVE).
static inline void comm_set_memory(Comm* c, const MemOps* mem) {
    c->mem = mem;
    c->world.mem = c->dp_group.mem = c->tp_group.mem = c->pp_group.mem = c->cp_group.mem = c->dpcp_group.mem = mem;
    c->ep_group.mem = c->edp_group.mem = mem;
}

// This rank's index among the ranks on its node (a shared-memory split of the world): the GPU
// it takes. Collective over the world.
static inline int comm_node_local_rank(const Comm* c) {
#ifdef USE_MPI
    MPI_Comm node;
    comm_check(MPI_Comm_split_type(c->world.mpi, MPI_COMM_TYPE_SHARED, c->world_rank, MPI_INFO_NULL, &node),
               "MPI_Comm_split_type");
    int rank = 0;
    MPI_Comm_rank(node, &rank);
    MPI_Comm_free(&node);
    return rank;
#else
    (void)c;
    return 0;
#endif
}

// The previous and next pipeline stages' ranks in the pp group, COMM_NO_PEER at the ends.
static inline void comm_pp_neighbours(const Comm* c, int* prev, int* next) {
    *prev = c->pp_rank > 0 ? c->pp_rank - 1 : COMM_NO_PEER;
    *next = c->pp_rank < c->pp - 1 ? c->pp_rank + 1 : COMM_NO_PEER;
}

static inline void comm_finalize(Comm* c) {
    comm_group_free(&c->ep_group);
    comm_group_free(&c->edp_group);
    comm_group_free(&c->cp_group);
    comm_group_free(&c->dpcp_group);
    comm_group_free(&c->dp_group);
    comm_group_free(&c->tp_group);
    comm_group_free(&c->pp_group);
    comm_group_free(&c->world);
#ifdef USE_MPI
    MPI_Op_free(&comm_max_op);
    llmc_fatal_hook = NULL;       // MPI_Abort is no longer allowed
    MPI_Finalize();
#endif
}

// ------------------------------------------------------------------------------------------
// accounting

static inline void comm_reset_stats(Comm* c) { memset(&c->stats, 0, sizeof(c->stats)); }

// This rank's table. Bytes are what the bandwidth-optimal algorithm sends from this rank:
//   reduce-scatter, all-gather of n floats per rank   (size-1) * n * 4
//   all-reduce (sum, max) of n floats                 2 * (size-1) * ceil(n/size) * 4
//   SumSq all-reduce                                  the same, of 19 8-byte integers
//   broadcast of b bytes                              b, except the last rank of the chain
//                                                     root, root+1, ... (which sends nothing)
//   send of n floats                                  n * 4 (receives and barriers send 0)
static inline void comm_print_stats(const Comm* c, FILE* f) {
    uint64_t total_bytes = 0, total_calls = 0;
    fprintf(f, "comm traffic sent by rank %d of %d (dp %d x cp %d x tp %d x pp %d)\n",
            c->world_rank, c->world_size, c->dp, c->cp, c->tp, c->pp);
    fprintf(f, "%-6s %12s %18s %12s\n", "kind", "calls", "bytes", "MiB");
    for (int k = 0; k < COMM_KIND_COUNT; k++) {
        fprintf(f, "%-6s %12llu %18llu %12.2f\n", comm_kind_name[k],
                (unsigned long long)c->stats.calls[k], (unsigned long long)c->stats.bytes[k],
                c->stats.bytes[k] / 1048576.0);
        total_bytes += c->stats.bytes[k];
        total_calls += c->stats.calls[k];
    }
    fprintf(f, "%-6s %12llu %18llu %12.2f\n", "total", (unsigned long long)total_calls,
            (unsigned long long)total_bytes, total_bytes / 1048576.0);
}

// ------------------------------------------------------------------------------------------
// collectives (every rank of the group calls them, in the same order, with the same sizes)

// recv[i] (i < n) = R1 tree over the group's ranks, in rank order, of their send[rank*n + i]:
// rank r gets block r of the sum. send holds size*n floats. recv may be any part of send
// (this rank's block, for a reduction in place): it is written after send has been read.
static inline void comm_reduce_scatter(CommGroup* g, const float* send, float* recv, size_t n, CommKind kind) {
    comm_check_group(g, "reduce-scatter");
    comm_account(g, kind, (uint64_t)(g->size - 1) * n * sizeof(float), "reduce-scatter");
    if (g->size == 1) {
        g->mem->copy(recv, send, n * sizeof(float));
        return;
    }
#ifdef USE_MPI
#ifdef USE_NCCL
    if (comm_nccl_on(g, recv)) { comm_wait(comm_nccl_reduce_scatter_start(g, send, recv, n)); return; }
#endif
    CommBuffer in = {NULL, 0}, out = {NULL, 0};
    const float* hsend = comm_stage_in(g, send, (size_t)g->size * n, &in);
    float* hrecv = comm_stage_out(g, recv, n, &out);
    CommBuffer tmp = comm_workspace_get(g, (size_t)g->size * n);
    comm_alltoall_pieces(g, hsend, tmp.buf, n, NULL);
    comm_reduce_pieces(g, tmp.buf, hrecv, n);
    comm_workspace_put(g, tmp);
    comm_workspace_put(g, in);
    comm_unstage(g, recv, n, &out);
#endif
}

// recv (size*n floats) = every rank's n floats of send, in rank order. send may be this
// rank's own block of recv (in place); any other overlap is an error.
static inline void comm_all_gather(CommGroup* g, const float* send, float* recv, size_t n, CommKind kind) {
    comm_check_group(g, "all-gather");
    comm_account(g, kind, (uint64_t)(g->size - 1) * n * sizeof(float), "all-gather");
    comm_check_gather_buffers(g, send, recv, n);
    if (g->size == 1) {
        g->mem->copy(recv, send, n * sizeof(float));
        return;
    }
#ifdef USE_MPI
#ifdef USE_NCCL
    if (comm_nccl_on(g, recv)) { comm_wait(comm_nccl_all_gather_start(g, send, recv, n)); return; }
#endif
    CommBuffer in = {NULL, 0}, out = {NULL, 0};
    const float* hsend = comm_stage_in(g, send, n, &in);
    float* hrecv = comm_stage_out(g, recv, (size_t)g->size * n, &out);
    comm_allgather_pieces(g, hsend, hrecv, n, NULL);
    comm_workspace_put(g, in);
    comm_unstage(g, recv, (size_t)g->size * n, &out);
#endif
}

// recv (size*n floats) <- block `rank` of every rank's send (size*n floats): block r of send
// goes to rank r, block r of recv comes from rank r. No arithmetic (context parallelism's
// all-to-all between sequence-split and head-split tensors).
static inline void comm_all_to_all(CommGroup* g, const float* send, float* recv, size_t n, CommKind kind) {
    comm_check_group(g, "all-to-all");
    comm_account(g, kind, (uint64_t)(g->size - 1) * n * sizeof(float), "all-to-all");
    if (g->size == 1) {
        g->mem->copy(recv, send, n * sizeof(float));
        return;
    }
#ifdef USE_MPI
#ifdef USE_NCCL
    if (comm_nccl_on(g, recv)) {
        comm_nccl_after_compute(g);
        comm_nccl_alltoall(g, send, recv, n);
        comm_nccl_before_compute(comm_nccl_mark(g));
        return;
    }
#endif
    size_t total = (size_t)g->size * n;
    CommBuffer in = {NULL, 0}, out = {NULL, 0};
    const float* hsend = comm_stage_in(g, send, total, &in);
    float* hrecv = comm_stage_out(g, recv, total, &out);
    // the pieces land piece-major (comm_alltoall_pieces): put each rank's block together
    CommBuffer tmp = comm_workspace_get(g, total);
    comm_alltoall_pieces(g, hsend, tmp.buf, n, NULL);
    for (size_t p = 0; p < comm_pieces(n); p++) {
        size_t off = p * comm_piece_floats, len = comm_piece_len(n, p);
        for (int r = 0; r < g->size; r++) {
            memcpy(hrecv + (size_t)r * n + off, tmp.buf + (size_t)g->size * off + (size_t)r * len, len * sizeof(float));
        }
    }
    comm_workspace_put(g, tmp);
    comm_workspace_put(g, in);
    comm_unstage(g, recv, total, &out);
#endif
}

// buf[i] = R1 tree over the group's ranks of their buf[i], in place: the reduce-scatter above
// on the buffer padded with zeros to a multiple of the group size, then an all-gather.
// Every rank gets the same bits. (Make n a multiple of the group size to skip the padded copy.)
static inline void comm_all_reduce_sum(CommGroup* g, float* buf, size_t n, CommKind kind) {
    comm_check_group(g, "all-reduce");
    comm_account(g, kind, comm_all_reduce_bytes(g->size, n, sizeof(float)), "all-reduce");
    if (g->size == 1) { return; }
#ifdef USE_MPI
#ifdef USE_NCCL
    if (comm_nccl_on(g, buf)) { comm_wait(comm_nccl_all_reduce_start(g, buf, n)); return; }
#endif
    size_t shard = (n + g->size - 1) / g->size, npad = shard * g->size;
    int staged = comm_staged(g, buf);
    // a device buffer is staged into the padded copy (made for every staged buffer)
    CommBuffer tmp = comm_workspace_get(g, npad + (npad != n || staged ? npad : 0));
    float* padded = buf;
    if (npad != n || staged) {
        padded = tmp.buf + npad;
        if (staged) { g->mem->to_host(padded, buf, n * sizeof(float)); }
        else { memcpy(padded, buf, n * sizeof(float)); }
        memset(padded + n, 0, (npad - n) * sizeof(float));
    }
    // reduce-scatter over the group: this rank's shard of the sum, in place in the buffer
    comm_alltoall_pieces(g, padded, tmp.buf, shard, NULL);
    comm_reduce_pieces(g, tmp.buf, padded + (size_t)g->rank * shard, shard);
    // all-gather over the group: every shard to every rank
    comm_allgather_pieces(g, padded + (size_t)g->rank * shard, padded, shard, NULL);
    if (staged) { g->mem->from_host(buf, padded, n * sizeof(float)); }
    else if (padded != buf) { memcpy(buf, padded, n * sizeof(float)); }
    comm_workspace_put(g, tmp);
#endif
}

// buf[i] = max over the group's ranks of their buf[i], in place. Order-free (comm_max2): a NaN
// on any rank gives the canonical NaN, +0 beats -0.
static inline void comm_all_reduce_max(CommGroup* g, float* buf, size_t n, CommKind kind) {
    comm_check_group(g, "all-reduce max");
    comm_account(g, kind, comm_all_reduce_bytes(g->size, n, sizeof(float)), "all-reduce max");
    CommBuffer stage = {NULL, 0};
    float* host = comm_stage_out(g, buf, n, &stage);
    if (host != buf) { g->mem->to_host(host, buf, n * sizeof(float)); }
    if (g->size == 1) {
        // the same NaN rule as for several ranks, so the bits do not depend on the group size
        for (size_t i = 0; i < n; i++) { host[i] = comm_max2(host[i], host[i]); }
    }
#ifdef USE_MPI
    if (g->size > 1) {
        for (size_t p = 0; p < comm_pieces(n); p++) {
            comm_check(MPI_Allreduce(MPI_IN_PLACE, host + p * comm_piece_floats, (int)comm_piece_len(n, p),
                                     MPI_FLOAT, comm_max_op, g->mpi), "MPI_Allreduce (max)");
        }
    }
#endif
    comm_unstage(g, buf, n, &stage);
}

// The exact sum of squares over the group (canonical.h R6), in place: the digits are integers,
// and an integer sum is the same in any order, so MPI_SUM is exact here.
static inline void comm_all_reduce_sumsq(CommGroup* g, SumSq* s, CommKind kind) {
    enum { WORDS = CANON_SUMSQ_DIGITS + 1 };
    comm_check_group(g, "all-reduce sumsq");
    comm_account(g, kind, comm_all_reduce_bytes(g->size, WORDS, sizeof(uint64_t)), "all-reduce sumsq");
    // digits below 2^32 each: the sum over up to 2^31 ranks cannot overflow a 64-bit word
    canon_sumsq_normalize(s);
#ifdef USE_MPI
    if (g->size > 1) {
        uint64_t words[WORDS];
        memcpy(words, s->digit, sizeof(s->digit));
        words[CANON_SUMSQ_DIGITS] = s->nonfinite;
        comm_check(MPI_Allreduce(MPI_IN_PLACE, words, WORDS, MPI_UINT64_T, MPI_SUM, g->mpi),
                   "MPI_Allreduce (sum of squares)");
        memcpy(s->digit, words, sizeof(s->digit));
        s->nonfinite = words[CANON_SUMSQ_DIGITS];
        canon_sumsq_normalize(s);
    }
#endif
}

// Every rank's buf (bytes long, host memory: a loss, a sampled token) = the root's.
static inline void comm_broadcast(CommGroup* g, void* buf, size_t bytes, int root, CommKind kind) {
    comm_check_group(g, "broadcast");
    if (comm_staged(g, buf)) { fatal("internal: comm_broadcast of device memory (it takes host values)"); }
    if (root < 0 || root >= g->size) { fatal("broadcast from rank %d of a group of %d", root, g->size); }
    int last_in_chain = (root + g->size - 1) % g->size;
    comm_account(g, kind, g->rank == last_in_chain ? 0 : bytes, "broadcast");
#ifdef USE_MPI
    if (g->size > 1) {
        size_t piece = comm_piece_floats * sizeof(float);
        for (size_t off = 0; off < bytes; off += piece) {
            size_t len = bytes - off < piece ? bytes - off : piece;
            comm_check(MPI_Bcast((char*)buf + off, (int)len, MPI_BYTE, root, g->mpi), "MPI_Bcast");
        }
    }
#endif
}

// ------------------------------------------------------------------------------------------
// all-to-all with a count per rank (expert parallelism's token exchange): rank r's
// send_counts[r'] elements (contiguous, in rank order) go to rank r', which receives them in
// its recv at the block of source r (recv_counts[r] elements, in rank order). Exact (a copy).
// Bytes sent: the elements for the other ranks.

#ifdef USE_MPI
static inline void comm_alltoallv_mpi(CommGroup* g, const void* send, const size_t* scounts, void* recv,
                                      const size_t* rcounts, MPI_Datatype type, const char* what) {
    int* cd = (int*)malloc_or_die(sizeof(int) * 4 * (size_t)g->size, "all-to-all counts");
    size_t soff = 0, roff = 0;
    for (int r = 0; r < g->size; r++) {
        if (scounts[r] > INT32_MAX || rcounts[r] > INT32_MAX || soff > INT32_MAX || roff > INT32_MAX) {
            fatal("%s: more than 2^31 elements in one exchange", what);
        }
        cd[r] = (int)scounts[r];
        cd[g->size + r] = (int)soff;
        cd[2 * g->size + r] = (int)rcounts[r];
        cd[3 * g->size + r] = (int)roff;
        soff += scounts[r];
        roff += rcounts[r];
    }
    comm_check(MPI_Alltoallv(send, cd, cd + g->size, type, recv, cd + 2 * g->size, cd + 3 * g->size, type, g->mpi),
               what);
    free(cd);
}
#endif

static inline uint64_t comm_alltoallv_sent(const CommGroup* g, const size_t* scounts, size_t elem_bytes) {
    uint64_t n = 0;
    for (int r = 0; r < g->size; r++) { if (r != g->rank) { n += scounts[r] * elem_bytes; } }
    return n;
}

// floats, in the group's memory (staged through host memory like every collective)
static inline void comm_all_to_all_v(CommGroup* g, const float* send, const size_t* scounts, float* recv,
                                     const size_t* rcounts, CommKind kind) {
    comm_check_group(g, "all-to-all");
    comm_account(g, kind, comm_alltoallv_sent(g, scounts, sizeof(float)), "all-to-all");
    if (g->size == 1) {
        if (scounts[0] != rcounts[0]) { fatal("internal: all-to-all of one rank with %zu sent, %zu received", scounts[0], rcounts[0]); }
        g->mem->copy(recv, send, scounts[0] * sizeof(float));
        return;
    }
#ifdef USE_MPI
    size_t ns = 0, nr = 0;
    for (int r = 0; r < g->size; r++) { ns += scounts[r]; nr += rcounts[r]; }
    CommBuffer in = {NULL, 0}, out = {NULL, 0};
    const float* hsend = comm_stage_in(g, send, ns, &in);
    float* hrecv = comm_stage_out(g, recv, nr, &out);
    comm_alltoallv_mpi(g, hsend, scounts, hrecv, rcounts, MPI_FLOAT, "MPI_Alltoallv");
    comm_workspace_put(g, in);
    comm_unstage(g, recv, nr, &out);
#endif
}

// ints in host memory (counts, positions)
static inline void comm_all_to_all_ints(CommGroup* g, const int* send, const size_t* scounts, int* recv,
                                        const size_t* rcounts, CommKind kind) {
    comm_check_group(g, "all-to-all");
    comm_account(g, kind, comm_alltoallv_sent(g, scounts, sizeof(int)), "all-to-all");
    if (g->size == 1) {
        memmove(recv, send, scounts[0] * sizeof(int));
        return;
    }
#ifdef USE_MPI
    comm_alltoallv_mpi(g, send, scounts, recv, rcounts, MPI_INT, "MPI_Alltoallv (ints)");
#endif
}

static inline void comm_barrier(CommGroup* g) {
    comm_check_group(g, "barrier");
    comm_account(g, COMM_KIND_OTHER, 0, "barrier");
#ifdef USE_MPI
    if (g->size > 1) { comm_check(MPI_Barrier(g->mpi), "MPI_Barrier"); }
#endif
}

// ------------------------------------------------------------------------------------------
// non-blocking collectives: start one (e.g. per gradient bucket during backward), compute,
// then comm_wait() for it. Several may be in flight. Buffers must not be touched until the
// wait returns. Wait for them in the same order on every rank of the group (the all-reduce
// starts its all-gather inside the wait).

// comm_reduce_scatter, started. Returns NULL when already done (group of one).
static inline CommRequest* comm_reduce_scatter_start(CommGroup* g, const float* send, float* recv,
                                                     size_t n, CommKind kind) {
    comm_check_group(g, "reduce-scatter");
    if (g->size == 1) {
        comm_reduce_scatter(g, send, recv, n, kind);
        return NULL;
    }
#ifdef USE_MPI
    comm_account(g, kind, (uint64_t)(g->size - 1) * n * sizeof(float), "reduce-scatter");
#ifdef USE_NCCL
    if (comm_nccl_on(g, recv)) { return comm_nccl_reduce_scatter_start(g, send, recv, n); }
#endif
    CommRequest* req = comm_request_new(COMM_OP_REDUCE_SCATTER, g, comm_pieces(n));
    req->n = n;
    req->out = comm_request_stage_out(req, recv, n);
    req->work = comm_workspace_get(g, (size_t)g->size * n);
    comm_alltoall_pieces(g, comm_stage_in(g, send, (size_t)g->size * n, &req->stage_in), req->work.buf, n, req->mpi);
    return req;
#else
    return NULL;       // not reached: without MPI every group has one rank
#endif
}

// comm_all_gather, started. Returns NULL when already done (group of one).
static inline CommRequest* comm_all_gather_start(CommGroup* g, const float* send, float* recv,
                                                 size_t n, CommKind kind) {
    comm_check_group(g, "all-gather");
    if (g->size == 1) {
        comm_all_gather(g, send, recv, n, kind);
        return NULL;
    }
#ifdef USE_MPI
    comm_account(g, kind, (uint64_t)(g->size - 1) * n * sizeof(float), "all-gather");
    comm_check_gather_buffers(g, send, recv, n);
#ifdef USE_NCCL
    if (comm_nccl_on(g, recv)) { return comm_nccl_all_gather_start(g, send, recv, n); }
#endif
    CommRequest* req = comm_request_new(COMM_OP_ALL_GATHER, g, comm_pieces(n));
    const float* hsend = comm_stage_in(g, send, n, &req->stage_in);
    comm_allgather_pieces(g, hsend, comm_request_stage_out(req, recv, (size_t)g->size * n), n, req->mpi);
    return req;
#else
    return NULL;       // not reached: without MPI every group has one rank
#endif
}

// comm_all_reduce_sum, started: the reduce-scatter's all-to-all runs in the background; the
// local sum and the all-gather happen in comm_wait().
static inline CommRequest* comm_all_reduce_sum_start(CommGroup* g, float* buf, size_t n, CommKind kind) {
    comm_check_group(g, "all-reduce");
    if (g->size == 1) {
        comm_all_reduce_sum(g, buf, n, kind);
        return NULL;
    }
#ifdef USE_MPI
    comm_account(g, kind, comm_all_reduce_bytes(g->size, n, sizeof(float)), "all-reduce");
#ifdef USE_NCCL
    if (comm_nccl_on(g, buf)) { return comm_nccl_all_reduce_start(g, buf, n); }
#endif
    size_t shard = (n + g->size - 1) / g->size, npad = shard * g->size;
    CommRequest* req = comm_request_new(COMM_OP_ALL_REDUCE, g, comm_pieces(shard));
    int staged = comm_staged(g, buf);
    req->n = shard;
    req->out = buf;
    req->out_n = n;
    req->work = comm_workspace_get(g, npad + (npad != n || staged ? npad : 0));
    req->padded = buf;
    if (npad != n || staged) {   // a device buffer is staged into the padded copy
        req->padded = req->work.buf + npad;
        if (staged) { g->mem->to_host(req->padded, buf, n * sizeof(float)); }
        else { memcpy(req->padded, buf, n * sizeof(float)); }
        memset(req->padded + n, 0, (npad - n) * sizeof(float));
        if (staged) { req->device = buf; req->device_n = n; }
    }
    comm_alltoall_pieces(g, req->padded, req->work.buf, shard, req->mpi);
    return req;
#else
    return NULL;       // not reached: without MPI every group has one rank
#endif
}

// ------------------------------------------------------------------------------------------
// point to point (floats; n must match on both sides)

#ifdef USE_MPI
static inline CommRequest* comm_p2p_start(CommGroup* g, float* buf, size_t n, int peer, int tag,
                                          int is_send, const char* what) {
    comm_check_group(g, what);
    if (peer == COMM_NO_PEER) { return NULL; }
    if (peer < 0 || peer >= g->size) { fatal("%s: peer %d is not a rank of a group of %d", what, peer, g->size); }
    if (tag < 0 || tag > 32767) { fatal("%s: tag %d outside 0..32767 (the least MPI guarantees)", what, tag); }
#ifdef USE_NCCL
    if (comm_nccl_on(g, buf)) { return comm_nccl_p2p_start(g, buf, n, peer, is_send); }   // NCCL matches messages in order
#endif
    CommRequest* req = comm_request_new(COMM_OP_P2P, g, comm_pieces(n));
    buf = is_send ? (float*)comm_stage_in(g, buf, n, &req->stage_in) : comm_request_stage_out(req, buf, n);
    // pieces of one message keep their order: MPI never overtakes between the same two ranks
    // with the same tag
    for (size_t p = 0; p < comm_pieces(n); p++) {
        float* piece = buf + p * comm_piece_floats;
        int len = (int)comm_piece_len(n, p);
        if (is_send) {
            comm_check(MPI_Isend(piece, len, MPI_FLOAT, peer, tag, g->mpi, &req->mpi[p]), "MPI_Isend");
        } else {
            comm_check(MPI_Irecv(piece, len, MPI_FLOAT, peer, tag, g->mpi, &req->mpi[p]), "MPI_Irecv");
        }
    }
    return req;
}
#endif

// Starts sending n floats to rank `peer` of the group (COMM_NO_PEER: nothing, returns NULL).
static inline CommRequest* comm_isend(CommGroup* g, const float* buf, size_t n, int peer, int tag, CommKind kind) {
    if (peer != COMM_NO_PEER) { comm_account(g, kind, n * sizeof(float), "send"); }
#ifdef USE_MPI
    return comm_p2p_start(g, (float*)buf, n, peer, tag, 1, "send");
#else
    if (peer != COMM_NO_PEER) { fatal("send to rank %d: MPI is not built in (single rank only)", peer); }
    return NULL;
#endif
}

// Starts receiving n floats from rank `peer` of the group (COMM_NO_PEER: nothing, returns NULL).
static inline CommRequest* comm_irecv(CommGroup* g, float* buf, size_t n, int peer, int tag, CommKind kind) {
    if (peer != COMM_NO_PEER) { comm_account(g, kind, 0, "receive"); }
#ifdef USE_MPI
    return comm_p2p_start(g, buf, n, peer, tag, 0, "receive");
#else
    if (peer != COMM_NO_PEER) { fatal("receive from rank %d: MPI is not built in (single rank only)", peer); }
    return NULL;
#endif
}

// ------------------------------------------------------------------------------------------
// completion

// Lets MPI progress the request's transfers (Open MPI moves non-blocking data only inside MPI
// calls: call this between layers to keep background transfers going). Returns 1 once the
// transfers are done; comm_wait() is still needed to finish and free the request.
static inline int comm_test(CommRequest* req) {
    if (req == NULL) { return 1; }
#ifdef USE_MPI
#ifdef USE_NCCL
    if (req->nccl_done) { return comm_nccl_test(req); }
#endif
    int done = 0;
    comm_check(MPI_Testall(req->npieces, req->mpi, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    return done;
#else
    return 1;
#endif
}

// Finishes a request and frees it. NULL is a request with nothing left to do.
static inline void comm_wait(CommRequest* req) {
    if (req == NULL) { return; }
#ifdef USE_MPI
#ifdef USE_NCCL
    if (req->nccl_done) { comm_nccl_finish(req); return; }
#endif
    CommGroup* g = req->group;
    comm_check(MPI_Waitall(req->npieces, req->mpi, MPI_STATUSES_IGNORE), "MPI_Waitall");
    if (req->op == COMM_OP_REDUCE_SCATTER) {
        comm_reduce_pieces(g, req->work.buf, req->out, req->n);
    } else if (req->op == COMM_OP_ALL_REDUCE) {
        // finish the reduce-scatter into this rank's shard, then all-gather over the group
        float* shard = req->padded + (size_t)g->rank * req->n;
        comm_reduce_pieces(g, req->work.buf, shard, req->n);
        comm_allgather_pieces(g, shard, req->padded, req->n, NULL);
        if (req->device) { g->mem->from_host(req->device, req->padded, req->out_n * sizeof(float)); }
        else if (req->padded != req->out) { memcpy(req->out, req->padded, req->out_n * sizeof(float)); }
        req->device = NULL;
    }
    if (req->device) { comm_unstage(g, req->device, req->device_n, &req->stage_out); }
    comm_workspace_put(g, req->stage_in);
    comm_workspace_put(g, req->work);
    free(req);
#endif
}

static inline void comm_wait_all(CommRequest** reqs, int count) {
    for (int i = 0; i < count; i++) {
        comm_wait(reqs[i]);
        reqs[i] = NULL;
    }
}

// Sends n_send floats to rank `dest` while receiving n_recv floats from rank `source` (either
// may be COMM_NO_PEER): the pipeline's paired exchange, without deadlock.
static inline void comm_sendrecv(CommGroup* g, const float* send, size_t n_send, int dest,
                                 float* recv, size_t n_recv, int source, int tag, CommKind kind) {
    CommRequest* reqs[2];
    reqs[0] = comm_irecv(g, recv, n_recv, source, tag, kind);
    reqs[1] = comm_isend(g, send, n_send, dest, tag, kind);
    comm_wait_all(reqs, 2);
}

#endif // LLMC_COMM_H
