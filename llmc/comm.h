/*
 * comm.h: the communicator. A rank grid (data x context x tensor x pipeline parallel), the
 * collectives the trainer needs with their canonical order, and the traffic accounting. The
 * bytes are moved by a transport (comm_transport.h's table): MPI on host buffers, MPI staged
 * through host memory for device buffers (comm_mpi.h), NCCL on device buffers (comm_nccl.h).
 *
 * The trainer calls comm_* functions with buffers, sizes, a group and a traffic kind; nothing
 * in those signatures is a transport's. Built without USE_MPI this is a genuine single-rank
 * communicator: the world has one rank, every group has one rank, a collective over one rank
 * is a copy, and no transport is called.
 *
 * DETERMINISM
 * MPI_SUM's order of combining ranks is unspecified (it changes with the algorithm Open MPI
 * picks for the message size, and with the number of ranks), and so is NCCL's, so float sums
 * NEVER use them. A float sum over a group is canonical.h's rule R1: the halving tree over the
 * group's ranks in rank order. comm_reduce_scatter() has the transport send every rank the
 * blocks it owns with an all-to-all, and sums the landed rows here, in that tree order, with
 * the MemOps tree_rows of the memory they landed in; all-reduce is that reduce-scatter followed
 * by an all-gather. Both send what a ring sends: (size-1)/size of the buffer per rank each, so
 * the all-reduce costs the bandwidth-optimal 2(size-1)/size. A DP rank that owns a complete
 * subtree of microbatches (canonical.h R3) finishes the same tree one rank would have built.
 * Max uses its own commutative operator (comm_max2), the exact sum of squares (SumSq) integer
 * sums: both are order-free, so a transport may combine them in any order.
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
 * transport (see comm_print_stats for the formulas), so layouts can be compared by them.
 *
 * WHERE THE BUFFERS LIVE
 * A group knows the memory the model's tensors live in (its MemOps, memory.h: host memory by
 * default, the GPU's with comm_set_memory). Like a CUDA-aware MPI, comm.h tells device buffers
 * from host ones by asking where the pointer lives (MemOps.holds), and routes each call: host
 * buffers to MPI, device buffers to NCCL (comm_enable_nccl) or else to MPI staged through host
 * memory - which is what the CUDA build does when several ranks share one GPU, and what the
 * emulated CUDA build always does. So the small host-side collectives (losses, norms, flags)
 * and the device-side ones (gradients, parameters, activations) use the same calls.
 *
 * WORKSPACE
 * A reduce-scatter of size*n floats lands size*n floats before summing them (all-reduce: the
 * padded buffer, and a padded copy when the buffer cannot be used). The landing buffers are in
 * the memory the transport lands in (host memory for MPI, the device for NCCL), kept per group
 * and reused (comm_transport.h's CommPool), until comm_finalize.
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
 *   comm_setup_pool_groups(&comm)  (FlexSP: aligned power-of-two sub-groups of the dp x cp ranks)
 *   comm_all_to_all_v(g, send, send_counts, recv, recv_counts, kind)   floats, counts per rank
 *   comm_all_to_all_ints(g, send, send_counts, recv, recv_counts, kind) host ints, likewise
 *   non-blocking: req = comm_reduce_scatter_start / comm_all_gather_start /
 *     comm_all_reduce_sum_start (same arguments), comm_isend(g, buf, n, peer, tag, kind),
 *     comm_irecv(...); comm_test(req); comm_wait(req); comm_wait_all(reqs, count)
 *   comm_sendrecv(g, send, n_send, dest, recv, n_recv, source, tag, kind)
 *   comm_set_memory(&comm, mem)  comm_enable_nccl(&comm)  comm_node_local_rank(&comm)
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
#include "llmc/canonical.h"
#include "llmc/comm_mpi.h"
#include "llmc/comm_transport.h"
#include "llmc/memory.h"
#include "llmc/utils.h"
#ifdef USE_NCCL
#include "llmc/comm_nccl.h"
#endif

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

// How a group moves one kind of buffer: a transport, and its link for this group.
typedef struct { const CommTransport* transport; void* link; } CommRoute;

// One group of ranks (the world, or this rank's dp, cp, tp or pp group).
typedef struct {
    int rank, size;
    const MemOps* mem;         // the memory of the model's tensors (see WHERE THE BUFFERS LIVE)
    CommStats* stats;          // the owning Comm's counters
    CommRoute host, device;    // the transports of host buffers and of buffers in `mem` (none
                               // for a group of one that was never split from the world)
    CommPool host_pool;        // idle workspace in host memory
    CommPool device_pool;      // ... and in `mem` (NCCL's landing buffers)
#ifdef USE_MPI
    CommMpi* mpi;              // the group's MPI communicator
    CommMpiStaged staged;      // MPI staged through host memory, over it
#endif
#ifdef USE_NCCL
    CommNccl* nccl;            // NCCL for its device buffers (comm_enable_nccl), or NULL
#endif
} CommGroup;

#define COMM_POOL_LEVELS 7             // FlexSP's sub-groups of the pool: 1, 2, 4, ... 64 ranks

// A Comm must stay where comm_init() put it: its groups point at its counters.
typedef struct {
    int world_rank, world_size;
    int dp, tp, pp;                    // grid sizes: world_size == dp * cp * tp * pp
    int dp_rank, tp_rank, pp_rank;     // this rank's coordinates
    CommGroup world, dp_group, tp_group, pp_group;
    // expert parallelism (comm_setup_expert_groups): the dp group is cut into ep groups of ep
    // consecutive dp ranks (which exchange tokens), and edp groups of the ranks at the same
    // place in every ep group, and their context ranks (which hold the same experts and reduce
    // their gradients)
    int ep, ep_rank, edp_rank;
    CommGroup ep_group, edp_group;
    int cp, cp_rank;                   // the context-parallel dimension (context_parallel.h)
    CommGroup cp_group;
    CommGroup dpcp_group;              // data x context parallel (ranked dp_rank * cp + cp_rank):
                                       // ZeRO's sharding group, Megatron's dp group "with cp"
    // FlexSP's pool (comm_setup_pool_groups): the dp x cp ranks cut into aligned power-of-two
    // sub-groups; pool_groups[k] is this rank's group of 2^k, k < pool_levels (0: none set up)
    int pool_levels;
    CommGroup pool_groups[COMM_POOL_LEVELS];
    CommStats stats;
    const MemOps* mem;                 // given to every group
} Comm;

#define COMM_NO_PEER (-1)              // "no neighbour": point-to-point calls do nothing

// ------------------------------------------------------------------------------------------
// small helpers

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
    uintptr_t send_at = (uintptr_t)send, recv_at = (uintptr_t)recv, bytes = n * sizeof(float);
    int own = send == recv + (size_t)g->rank * n;
    if (!own && send_at < recv_at + (size_t)g->size * bytes && send_at + bytes > recv_at) {
        fatal("all-gather: the send buffer overlaps the receive buffer, and is not this rank's block of it");
    }
}

static inline int comm_on_device(const CommGroup* g, const void* p) { return p != NULL && g->mem->holds(p) != 0; }

// The transport of an operation on these buffers (see WHERE THE BUFFERS LIVE).
static inline CommRoute comm_route(const CommGroup* g, const void* send, const void* recv, const char* what) {
    CommRoute route = comm_on_device(g, send) || comm_on_device(g, recv) ? g->device : g->host;
    if (route.transport == NULL) { fatal("internal: %s on a group of %d ranks without a transport", what, g->size); }
    return route;
}

// Where a transport's landing buffers live, and the group's pool of them.
static inline const MemOps* comm_landing_mem(const CommGroup* g, const CommTransport* t) {
    return t->lands_on_device ? g->mem : &memory_host;
}
static inline CommPool* comm_landing_pool(CommGroup* g, const CommTransport* t) {
    return t->lands_on_device ? &g->device_pool : &g->host_pool;
}
static inline CommBuffer comm_landing_get(CommGroup* g, const CommTransport* t, size_t floats) {
    return comm_pool_get(comm_landing_pool(g, t), comm_landing_mem(g, t), floats);
}
static inline void comm_landing_put(CommGroup* g, const CommTransport* t, CommBuffer buffer) {
    comm_pool_put(comm_landing_pool(g, t), comm_landing_mem(g, t), buffer);
}

// A copy between any two buffers of the group's memory and host memory.
static inline void comm_copy(const CommGroup* g, float* dst, const float* src, size_t n) {
    int dst_device = comm_on_device(g, dst), src_device = comm_on_device(g, src);
    if (dst_device && src_device) { g->mem->copy(dst, src, n * sizeof(float)); }
    else if (src_device) { g->mem->to_host(dst, src, n * sizeof(float)); }
    else if (dst_device) { g->mem->from_host(dst, src, n * sizeof(float)); }
    else if (n) { memcpy(dst, src, n * sizeof(float)); }
}

// out[i] (i < n) = R1 tree over the group's ranks, in rank order, of the landed rows[r*n + i]
// (row r from rank r), summed in the memory the rows landed in. out may be in the other memory
// (a device buffer staged through host memory): the sum is copied there.
static inline void comm_tree_rows(CommGroup* g, const CommTransport* t, float* rows, size_t n, float* out) {
    const MemOps* mem = comm_landing_mem(g, t);
    if (comm_on_device(g, out) == t->lands_on_device) {
        mem->tree_rows(rows, n, g->size, out);
        return;
    }
    CommBuffer sum = comm_landing_get(g, t, n);
    mem->tree_rows(rows, n, g->size, sum.buf);
    comm_copy(g, out, sum.buf, n);
    comm_landing_put(g, t, sum);
}

// ------------------------------------------------------------------------------------------
// operations in flight

// A collective or point-to-point operation in flight (comm_*_start, comm_isend, comm_irecv).
// NULL means nothing is left to do (size-1 groups, missing pipeline neighbours).
typedef enum { COMM_OP_REDUCE_SCATTER, COMM_OP_ALL_GATHER, COMM_OP_ALL_REDUCE, COMM_OP_P2P } CommOp;

typedef struct CommRequest {
    CommOp op;
    CommGroup* group;
    CommRoute route;
    void* inflight;        // the transport's operation (NULL once done)
    size_t n;              // per-rank block (reduce-scatter), shard (all-reduce)
    float* out;            // reduce-scatter: recv; all-reduce: the caller's buffer
    size_t out_n;          // all-reduce: the caller's length
    CommBuffer landing;    // the all-to-all's rows, in the transport's landing memory
    CommBuffer copy;       // all-reduce: the padded copy, when the caller's buffer cannot be used
    float* padded;         // all-reduce: copy.buf, or the caller's buffer
} CommRequest;

static inline CommRequest* comm_request_new(CommOp op, CommGroup* g, CommRoute route) {
    CommRequest* req = (CommRequest*)calloc_or_die(1, sizeof(CommRequest), "communication request");
    req->op = op;
    req->group = g;
    req->route = route;
    return req;
}

// Lets the transport progress the request's transfers (Open MPI moves non-blocking data only
// inside MPI calls: call this between layers to keep background transfers going). Returns 1
// once the transfers are done; comm_wait() is still needed to finish and free the request.
static inline int comm_test(CommRequest* req) {
    if (req == NULL) { return 1; }
    return req->route.transport->test(req->inflight);
}

// Finishes a request and frees it: the local half of a reduction (the R1 tree over the landed
// rows) and an all-reduce's all-gather happen here. NULL is a request with nothing left to do.
static inline void comm_wait(CommRequest* req) {
    if (req == NULL) { return; }
    CommGroup* g = req->group;
    const CommTransport* t = req->route.transport;
    t->wait(req->inflight);
    if (req->op == COMM_OP_REDUCE_SCATTER) {
        comm_tree_rows(g, t, req->landing.buf, req->n, req->out);
    } else if (req->op == COMM_OP_ALL_REDUCE) {
        // finish the reduce-scatter into this rank's shard, then all-gather over the group
        float* shard = req->padded + (size_t)g->rank * req->n;
        comm_tree_rows(g, t, req->landing.buf, req->n, shard);
        t->all_gather(req->route.link, shard, req->padded, req->n, 1);
        if (req->padded != req->out) { comm_copy(g, req->out, req->padded, req->out_n); }
    }
    comm_landing_put(g, t, req->landing);
    comm_landing_put(g, t, req->copy);
    free(req);
}

static inline void comm_wait_all(CommRequest** reqs, int count) {
    for (int i = 0; i < count; i++) {
        comm_wait(reqs[i]);
        reqs[i] = NULL;
    }
}

// ------------------------------------------------------------------------------------------
// setup

static inline void comm_group_init_single(CommGroup* g, CommStats* stats, const MemOps* mem) {
    memset(g, 0, sizeof(*g));
    g->rank = 0;
    g->size = 1;
    g->stats = stats;
    g->mem = mem;
}

static inline void comm_group_free(CommGroup* g) {
#ifdef USE_NCCL
    comm_nccl_free(g->nccl);       // first: it waits for its stream, which may use the pools
#endif
    comm_pool_free(&g->host_pool, &memory_host);
    comm_pool_free(&g->device_pool, g->mem);
#ifdef USE_MPI
    comm_pool_free(&g->staged.pool, &memory_host);
    comm_mpi_free(g->mpi);
#endif
    comm_group_init_single(g, g->stats, g->mem);
    g->size = 0;
}

#ifdef USE_MPI
// The group's MPI communicator, and its routes: host buffers over it, device buffers staged.
static inline void comm_group_connect(CommGroup* g, CommMpi* mpi) {
    g->mpi = mpi;
    g->rank = mpi->rank;
    g->size = mpi->size;
    g->staged.mpi = mpi;
    g->staged.device = g->mem;
    g->host = (CommRoute){ &comm_mpi_host, mpi };
    g->device = (CommRoute){ &comm_mpi_staged, &g->staged };
}

// The group of the ranks with the same `color`, ranked by `coordinate`.
static inline void comm_split(const Comm* c, CommGroup* g, int color, int coordinate, const char* name) {
    comm_group_connect(g, comm_mpi_split(c->world.mpi, color, coordinate));
    if (g->rank != coordinate) {
        fatal("%s group: rank %d in the group, expected coordinate %d", name, g->rank, coordinate);
    }
}
#endif

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
    for (int k = 0; k < COMM_POOL_LEVELS; k++) { comm_group_init_single(&c->pool_groups[k], &c->stats, c->mem); }
#ifdef USE_MPI
    comm_group_connect(&c->world, comm_mpi_init(argc, argv));
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


static inline void comm_free_pool_groups(Comm* c) {
    for (int k = 0; k < c->pool_levels; k++) { comm_group_free(&c->pool_groups[k]); }
    c->pool_levels = 0;
}

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
    comm_free_pool_groups(c);
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
// and rank d / ep of the edp group of dp ranks d % ep, d % ep + ep, ... (with context
// parallelism each of them with its cp ranks: rank (d / ep) * cp + cp_rank). Collective over
// the world (after comm_setup_grid).
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
    // the edp group takes in the context ranks, ranked edp_rank * cp + cp_rank as the dp x cp
    // group is (each context rank hands in its part of an expert unit's gradient)
    int base_cp = c->pp_rank * c->tp + c->tp_rank;
    comm_split(c, &c->edp_group, base_cp * c->dp + c->dp_rank % ep, c->edp_rank * c->cp + c->cp_rank, "edp");
#else
    comm_group_init_single(&c->ep_group, &c->stats, c->mem);
    comm_group_init_single(&c->edp_group, &c->stats, c->mem);
#endif
    c->ep_group.mem = c->edp_group.mem = c->mem;
}

// FlexSP's pool: the dp x cp ranks of this rank's (pp, tp) coordinates, ranked as in the dp x
// cp group (r = dp_rank * cp + cp_rank), cut into aligned power-of-two sub-groups: for each
// size g = 2^k that divides the pool, rank r's group is the ranks [r - r % g, r - r % g + g),
// ranked by r % g. Real communicators, made once at startup, so that a plan can run each of
// its groups over its own every step. Collective over the world (after comm_setup_grid_cp).
static inline void comm_setup_pool_groups(Comm* c) {
    comm_free_pool_groups(c);
    int P = c->dpcp_group.size;
    for (int k = 0, g = 1; g <= P && P % g == 0; k++, g *= 2) {
        if (k == COMM_POOL_LEVELS) { fatal("a pool of %d ranks: sub-groups of at most %d", P, 1 << (COMM_POOL_LEVELS - 1)); }
#ifdef USE_MPI
        // the same pp and tp coordinates and the same block of g pool ranks: one group
        int r = c->dpcp_group.rank;
        comm_split(c, &c->pool_groups[k], (c->pp_rank * c->tp + c->tp_rank) * P + r / g, r % g, "pool");
#else
        comm_group_init_single(&c->pool_groups[k], &c->stats, c->mem);
#endif
        c->pool_groups[k].mem = c->mem;
        c->pool_levels = k + 1;
    }
}

// The grid without context parallelism: dp x tp x pp.
static inline void comm_setup_grid(Comm* c, int tp, int pp) { comm_setup_grid_cp(c, tp, 1, pp); }

// The memory of the model's tensors, for every group (see WHERE THE BUFFERS LIVE). Set before
// any collective on device buffers: the groups' device workspace is allocated in it.
static inline void comm_set_memory(Comm* c, const MemOps* mem) {
    CommGroup* groups[] = { &c->world, &c->dp_group, &c->tp_group, &c->pp_group, &c->cp_group, &c->dpcp_group,
                            &c->ep_group, &c->edp_group };
    c->mem = mem;
    for (size_t i = 0; i < sizeof(groups) / sizeof(groups[0]) + c->pool_levels; i++) {
        CommGroup* g = i < sizeof(groups) / sizeof(groups[0]) ? groups[i] : &c->pool_groups[i - sizeof(groups) / sizeof(groups[0])];
        g->mem = mem;
#ifdef USE_MPI
        g->staged.device = mem;
#endif
    }
}

#ifdef USE_NCCL
// The NCCL transport for the device buffers of the dp, tp, pp, cp and dp x cp groups
// (comm_nccl.h); one GPU per rank. Collective over the world: every rank creates the
// communicators in this order. With cp = 1 the dp x cp group is the dp group's ranks in the
// same order, and shares its communicator (no idle duplicate).
static inline void comm_enable_nccl(Comm* c) {
    CommGroup* groups[] = { &c->dp_group, &c->tp_group, &c->pp_group, &c->cp_group, &c->dpcp_group };
    for (size_t i = 0; i < sizeof(groups) / sizeof(groups[0]); i++) {
        CommGroup* g = groups[i];
        if (g->size == 1 || g->nccl) { continue; }
        int same_as_dp = g == &c->dpcp_group && c->cp == 1 && c->dp_group.nccl;
        g->nccl = same_as_dp ? comm_nccl_share(c->dp_group.nccl) : comm_nccl_new(&g->staged);
        g->device = (CommRoute){ &comm_nccl_transport, g->nccl };
    }
    for (int k = 0; k < c->pool_levels; k++) {   // FlexSP's sub-groups (comm_setup_pool_groups)
        CommGroup* g = &c->pool_groups[k];
        if (g->size == 1 || g->nccl) { continue; }
        g->nccl = comm_nccl_new(&g->staged);
        g->device = (CommRoute){ &comm_nccl_transport, g->nccl };
    }
}
#endif

// This rank's index among the ranks on its node (a shared-memory split of the world): the GPU
// it takes. Collective over the world.
static inline int comm_node_local_rank(const Comm* c) {
#ifdef USE_MPI
    return comm_mpi_node_local_rank(c->world.mpi);
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
    comm_free_pool_groups(c);
    comm_group_free(&c->ep_group);
    comm_group_free(&c->edp_group);
    comm_group_free(&c->cp_group);
    comm_group_free(&c->dpcp_group);
    comm_group_free(&c->dp_group);
    comm_group_free(&c->tp_group);
    comm_group_free(&c->pp_group);
    comm_group_free(&c->world);
#ifdef USE_MPI
    comm_mpi_finalize();
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
// collectives (every rank of the group calls them, in the same order, with the same sizes).
// Each reduce-scatter, all-gather and all-reduce is started (blocking: finished by its
// transport at once, and by comm_wait here), so both forms are one piece of code.

// recv[i] (i < n) = R1 tree over the group's ranks, in rank order, of their send[rank*n + i]:
// rank r gets block r of the sum. send holds size*n floats. recv may be any part of send
// (this rank's block, for a reduction in place): it is written after send has been read.
static inline CommRequest* comm_reduce_scatter_begin(CommGroup* g, const float* send, float* recv, size_t n,
                                                     CommKind kind, int blocking) {
    comm_check_group(g, "reduce-scatter");
    comm_account(g, kind, (uint64_t)(g->size - 1) * n * sizeof(float), "reduce-scatter");
    if (g->size == 1) {
        g->mem->copy(recv, send, n * sizeof(float));
        return NULL;
    }
    CommRequest* req = comm_request_new(COMM_OP_REDUCE_SCATTER, g, comm_route(g, send, recv, "reduce-scatter"));
    const CommTransport* t = req->route.transport;
    req->n = n;
    req->out = recv;
    req->landing = comm_landing_get(g, t, (size_t)g->size * n);
    req->inflight = t->all_to_all(req->route.link, send, req->landing.buf, n, blocking);
    return req;
}

// recv (size*n floats) = every rank's n floats of send, in rank order. send may be this
// rank's own block of recv (in place); any other overlap is an error.
static inline CommRequest* comm_all_gather_begin(CommGroup* g, const float* send, float* recv, size_t n,
                                                 CommKind kind, int blocking) {
    comm_check_group(g, "all-gather");
    comm_account(g, kind, (uint64_t)(g->size - 1) * n * sizeof(float), "all-gather");
    comm_check_gather_buffers(g, send, recv, n);
    if (g->size == 1) {
        g->mem->copy(recv, send, n * sizeof(float));
        return NULL;
    }
    CommRequest* req = comm_request_new(COMM_OP_ALL_GATHER, g, comm_route(g, send, recv, "all-gather"));
    req->inflight = req->route.transport->all_gather(req->route.link, send, recv, n, blocking);
    return req;
}

// buf[i] = R1 tree over the group's ranks of their buf[i], in place: the reduce-scatter above
// on the buffer padded with zeros to a multiple of the group size, then an all-gather.
// Every rank gets the same bits. (Make n a multiple of the group size, on a transport that
// lands where buf lives, to skip the padded copy.)
static inline CommRequest* comm_all_reduce_sum_begin(CommGroup* g, float* buf, size_t n, CommKind kind, int blocking) {
    comm_check_group(g, "all-reduce");
    comm_account(g, kind, comm_all_reduce_bytes(g->size, n, sizeof(float)), "all-reduce");
    if (g->size == 1) { return NULL; }
    CommRequest* req = comm_request_new(COMM_OP_ALL_REDUCE, g, comm_route(g, buf, buf, "all-reduce"));
    const CommTransport* t = req->route.transport;
    size_t shard = (n + g->size - 1) / g->size, npad = shard * g->size;
    req->n = shard;
    req->out = buf;
    req->out_n = n;
    req->padded = buf;
    if (npad != n || comm_on_device(g, buf) != t->lands_on_device) {   // a staged buffer lands in the copy
        req->copy = comm_landing_get(g, t, npad);
        req->padded = req->copy.buf;
        comm_copy(g, req->padded, buf, n);
        if (npad > n) {
            if (t->lands_on_device) { g->mem->fill(req->padded + n, 0.0f, npad - n); }
            else { memset(req->padded + n, 0, (npad - n) * sizeof(float)); }
        }
    }
    req->landing = comm_landing_get(g, t, npad);
    req->inflight = t->all_to_all(req->route.link, req->padded, req->landing.buf, shard, blocking);
    return req;
}

static inline void comm_reduce_scatter(CommGroup* g, const float* send, float* recv, size_t n, CommKind kind) {
    comm_wait(comm_reduce_scatter_begin(g, send, recv, n, kind, 1));
}
static inline void comm_all_gather(CommGroup* g, const float* send, float* recv, size_t n, CommKind kind) {
    comm_wait(comm_all_gather_begin(g, send, recv, n, kind, 1));
}
static inline void comm_all_reduce_sum(CommGroup* g, float* buf, size_t n, CommKind kind) {
    comm_wait(comm_all_reduce_sum_begin(g, buf, n, kind, 1));
}

// Non-blocking: start one (e.g. per gradient bucket during backward), compute, then
// comm_wait() for it. Several may be in flight. Buffers must not be touched until the wait
// returns. Wait for them in the same order on every rank of the group (the all-reduce runs
// its all-gather inside the wait). NULL when already done (group of one).
static inline CommRequest* comm_reduce_scatter_start(CommGroup* g, const float* send, float* recv,
                                                     size_t n, CommKind kind) {
    return comm_reduce_scatter_begin(g, send, recv, n, kind, 0);
}
static inline CommRequest* comm_all_gather_start(CommGroup* g, const float* send, float* recv,
                                                 size_t n, CommKind kind) {
    return comm_all_gather_begin(g, send, recv, n, kind, 0);
}
static inline CommRequest* comm_all_reduce_sum_start(CommGroup* g, float* buf, size_t n, CommKind kind) {
    return comm_all_reduce_sum_begin(g, buf, n, kind, 0);
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
    CommRoute route = comm_route(g, send, recv, "all-to-all");
    route.transport->all_to_all(route.link, send, recv, n, 1);
}

// buf[i] = max over the group's ranks of their buf[i], in place. Order-free (comm_max2): a NaN
// on any rank gives the canonical NaN, +0 beats -0.
static inline void comm_all_reduce_max(CommGroup* g, float* buf, size_t n, CommKind kind) {
    comm_check_group(g, "all-reduce max");
    comm_account(g, kind, comm_all_reduce_bytes(g->size, n, sizeof(float)), "all-reduce max");
    if (g->size > 1) {
        CommRoute route = comm_route(g, buf, buf, "all-reduce max");
        route.transport->all_reduce_max(route.link, buf, n);
        return;
    }
    // the same NaN rule as for several ranks, so the bits do not depend on the group size
    CommBuffer copy = { buf, n };
    if (comm_on_device(g, buf)) {
        copy = comm_pool_get(&g->host_pool, &memory_host, n);
        g->mem->to_host(copy.buf, buf, n * sizeof(float));
    }
    for (size_t i = 0; i < n; i++) { copy.buf[i] = comm_max2(copy.buf[i], copy.buf[i]); }
    if (copy.buf != buf) {
        g->mem->from_host(buf, copy.buf, n * sizeof(float));
        comm_pool_put(&g->host_pool, &memory_host, copy);
    }
}

// The exact sum of squares over the group (canonical.h R6), in place: the digits are integers,
// and an integer sum is the same in any order, so the transport's sum is exact here.
static inline void comm_all_reduce_sumsq(CommGroup* g, SumSq* s, CommKind kind) {
    enum { WORDS = CANON_SUMSQ_DIGITS + 1 };
    comm_check_group(g, "all-reduce sumsq");
    comm_account(g, kind, comm_all_reduce_bytes(g->size, WORDS, sizeof(uint64_t)), "all-reduce sumsq");
    // digits below 2^32 each: the sum over up to 2^31 ranks cannot overflow a 64-bit word
    canon_sumsq_normalize(s);
    if (g->size > 1) {
        uint64_t words[WORDS];
        memcpy(words, s->digit, sizeof(s->digit));
        words[CANON_SUMSQ_DIGITS] = s->nonfinite;
        CommRoute route = comm_route(g, words, words, "all-reduce sumsq");
        route.transport->all_reduce_sum_u64(route.link, words, WORDS);
        memcpy(s->digit, words, sizeof(s->digit));
        s->nonfinite = words[CANON_SUMSQ_DIGITS];
        canon_sumsq_normalize(s);
    }
}

// Every rank's buf (bytes long, host memory: a loss, a sampled token) = the root's.
static inline void comm_broadcast(CommGroup* g, void* buf, size_t bytes, int root, CommKind kind) {
    comm_check_group(g, "broadcast");
    if (comm_on_device(g, buf)) { fatal("internal: comm_broadcast of device memory (it takes host values)"); }
    if (root < 0 || root >= g->size) { fatal("broadcast from rank %d of a group of %d", root, g->size); }
    int last_in_chain = (root + g->size - 1) % g->size;
    comm_account(g, kind, g->rank == last_in_chain ? 0 : bytes, "broadcast");
    if (g->size > 1) {
        CommRoute route = comm_route(g, buf, buf, "broadcast");
        route.transport->broadcast(route.link, buf, bytes, root);
    }
}

// ------------------------------------------------------------------------------------------
// all-to-all with a count per rank (expert parallelism's token exchange): rank r's
// send_counts[r'] elements (contiguous, in rank order) go to rank r', which receives them in
// its recv at the block of source r (recv_counts[r] elements, in rank order). Exact (a copy).
// Bytes sent: the elements for the other ranks.

static inline uint64_t comm_alltoallv_sent(const CommGroup* g, const size_t* send_counts, size_t elem_bytes) {
    uint64_t bytes = 0;
    for (int r = 0; r < g->size; r++) { if (r != g->rank) { bytes += send_counts[r] * elem_bytes; } }
    return bytes;
}

// floats, in the group's memory
static inline void comm_all_to_all_v(CommGroup* g, const float* send, const size_t* send_counts, float* recv,
                                     const size_t* recv_counts, CommKind kind) {
    comm_check_group(g, "all-to-all");
    comm_account(g, kind, comm_alltoallv_sent(g, send_counts, sizeof(float)), "all-to-all");
    if (g->size == 1) {
        if (send_counts[0] != recv_counts[0]) {
            fatal("internal: all-to-all of one rank with %zu sent, %zu received", send_counts[0], recv_counts[0]);
        }
        g->mem->copy(recv, send, send_counts[0] * sizeof(float));
        return;
    }
    CommRoute route = comm_route(g, send, recv, "all-to-all");
    route.transport->all_to_all_v(route.link, send, send_counts, recv, recv_counts, COMM_ELEM_FLOAT);
}

// ints in host memory (counts, positions)
static inline void comm_all_to_all_ints(CommGroup* g, const int* send, const size_t* send_counts, int* recv,
                                        const size_t* recv_counts, CommKind kind) {
    comm_check_group(g, "all-to-all");
    comm_account(g, kind, comm_alltoallv_sent(g, send_counts, sizeof(int)), "all-to-all");
    if (g->size == 1) {
        memmove(recv, send, send_counts[0] * sizeof(int));
        return;
    }
    CommRoute route = comm_route(g, send, recv, "all-to-all");
    route.transport->all_to_all_v(route.link, send, send_counts, recv, recv_counts, COMM_ELEM_INT);
}

static inline void comm_barrier(CommGroup* g) {
    comm_check_group(g, "barrier");
    comm_account(g, COMM_KIND_OTHER, 0, "barrier");
    if (g->size > 1) {
        CommRoute route = comm_route(g, NULL, NULL, "barrier");
        route.transport->barrier(route.link);
    }
}

// ------------------------------------------------------------------------------------------
// point to point (floats; n must match on both sides)

static inline CommRequest* comm_p2p_start(CommGroup* g, float* buf, size_t n, int peer, int tag,
                                          int is_send, const char* what) {
#ifndef USE_MPI
    if (peer != COMM_NO_PEER) {
        fatal("%s %s rank %d: MPI is not built in (single rank only)", what, is_send ? "to" : "from", peer);
    }
#endif
    comm_check_group(g, what);
    if (peer == COMM_NO_PEER) { return NULL; }
    if (peer < 0 || peer >= g->size) { fatal("%s: peer %d is not a rank of a group of %d", what, peer, g->size); }
    if (tag < 0 || tag > 32767) { fatal("%s: tag %d outside 0..32767 (the least MPI guarantees)", what, tag); }
    CommRequest* req = comm_request_new(COMM_OP_P2P, g, comm_route(g, buf, buf, what));
    const CommTransport* t = req->route.transport;
    req->inflight = is_send ? t->send(req->route.link, buf, n, peer, tag) : t->recv(req->route.link, buf, n, peer, tag);
    return req;
}

// Starts sending n floats to rank `peer` of the group (COMM_NO_PEER: nothing, returns NULL).
static inline CommRequest* comm_isend(CommGroup* g, const float* buf, size_t n, int peer, int tag, CommKind kind) {
    if (peer != COMM_NO_PEER) { comm_account(g, kind, n * sizeof(float), "send"); }
    return comm_p2p_start(g, (float*)buf, n, peer, tag, 1, "send");
}

// Starts receiving n floats from rank `peer` of the group (COMM_NO_PEER: nothing, returns NULL).
static inline CommRequest* comm_irecv(CommGroup* g, float* buf, size_t n, int peer, int tag, CommKind kind) {
    if (peer != COMM_NO_PEER) { comm_account(g, kind, 0, "receive"); }
    return comm_p2p_start(g, buf, n, peer, tag, 0, "receive");
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
