/*
 * comm_nccl.h: comm.h's NCCL transport (the CUDA build compiled with USE_NCCL, --comm nccl):
 * the collectives and point-to-point messages of device buffers go over NCCL, one GPU per
 * rank, with the SAME canonical order as the MPI transports:
 *   reduce-scatter  all-to-all of the blocks (grouped ncclSend/ncclRecv, the bytes of a ring),
 *                   then the R1 tree over the ranks in rank order, in a device kernel (the
 *                   MemOps tree_rows of memory.h: the reduction runs where the data lives);
 *                   never NCCL's own float sum, whose order changes with topology and size
 *   all-gather      ncclAllGather (a copy: exact)
 *   all-reduce      that reduce-scatter, then that all-gather
 *   send / receive  ncclSend / ncclRecv
 * Host buffers (losses, flags, the exact squared norm's integers) and max-reductions still go
 * over MPI, which also bootstraps NCCL: rank 0 of each group makes the unique id and MPI
 * broadcasts it.
 *
 * Streams: each group posts its NCCL operations on a stream of its own, so that ZeRO's
 * reductions (dp group), the pipeline's messages (pp group) and tensor parallelism's
 * collectives (tp group) are ordered within their group only, as MPI's non-blocking calls are.
 * An operation starts after everything the compute stream has queued (an event), and the
 * compute stream waits for it (another event) when comm_wait() is called: until then the
 * transfer overlaps the compute, as on the CPU.
 *
 * Included by comm.h inside its USE_MPI section; nothing here is compiled without USE_NCCL.
 */
#ifndef LLMC_COMM_NCCL_H
#define LLMC_COMM_NCCL_H

#include <cuda_runtime.h>
#include <nccl.h>

struct CommNccl {
    ncclComm_t comm;
    cudaStream_t stream;           // this group's NCCL operations, in the order posted
    CommBuffer pool[COMM_POOL];    // idle device landing buffers
    int npool;
};

static inline void comm_nccl_check(ncclResult_t r, const char* what) {
    if (r != ncclSuccess) { fatal("NCCL error in %s: %s", what, ncclGetErrorString(r)); }
}
static inline void comm_cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) { fatal("CUDA error in %s: %s", what, cudaGetErrorString(e)); }
}

// A device buffer for an operation in flight (a landing area), from the group's pool.
static inline CommBuffer comm_nccl_buffer_get(CommGroup* g, size_t floats) {
    struct CommNccl* nc = g->nccl;
    for (int i = 0; i < nc->npool; i++) {
        if (nc->pool[i].floats >= floats) {
            CommBuffer b = nc->pool[i];
            nc->pool[i] = nc->pool[--nc->npool];
            return b;
        }
    }
    CommBuffer b = {(float*)g->mem->alloc(floats * sizeof(float), "NCCL landing buffer"), floats};
    return b;
}
static inline void comm_nccl_buffer_put(CommGroup* g, CommBuffer b) {
    struct CommNccl* nc = g->nccl;
    if (b.buf == NULL) { return; }
    if (nc->npool < COMM_POOL) { nc->pool[nc->npool++] = b; } else { g->mem->release(b.buf); }
}

// The group's stream waits for everything the compute (legacy default) stream has queued.
static inline void comm_nccl_after_compute(CommGroup* g) {
    cudaEvent_t ev;
    comm_cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    comm_cuda_check(cudaEventRecord(ev, 0), "cudaEventRecord");
    comm_cuda_check(cudaStreamWaitEvent(g->nccl->stream, ev, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ev);
}
// An event after the operations posted on the group's stream so far.
static inline cudaEvent_t comm_nccl_mark(CommGroup* g) {
    cudaEvent_t ev;
    comm_cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    comm_cuda_check(cudaEventRecord(ev, g->nccl->stream), "cudaEventRecord");
    return ev;
}
// The compute stream waits for the event (and the event is done with).
static inline void comm_nccl_before_compute(cudaEvent_t ev) {
    comm_cuda_check(cudaStreamWaitEvent(0, ev, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ev);
}

// One communicator per group of more than one rank: rank 0 makes the unique id, MPI
// broadcasts it (group communicator), every rank joins.
static inline void comm_nccl_init_group(CommGroup* g) {
    if (g->size == 1 || g->nccl) { return; }
    ncclUniqueId id;
    if (g->rank == 0) { comm_nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId"); }
    comm_check(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, g->mpi), "MPI_Bcast (NCCL unique id)");
    g->nccl = (struct CommNccl*)calloc_or_die(1, sizeof(struct CommNccl), "NCCL group");
    comm_nccl_check(ncclCommInitRank(&g->nccl->comm, g->size, id, g->rank), "ncclCommInitRank");
    comm_cuda_check(cudaStreamCreateWithFlags(&g->nccl->stream, cudaStreamNonBlocking), "cudaStreamCreate");
}

static inline void comm_nccl_free_group(CommGroup* g) {
    if (!g->nccl) { return; }
    cudaStreamSynchronize(g->nccl->stream);
    for (int i = 0; i < g->nccl->npool; i++) { g->mem->release(g->nccl->pool[i].buf); }
    ncclCommDestroy(g->nccl->comm);
    cudaStreamDestroy(g->nccl->stream);
    free(g->nccl);
    g->nccl = NULL;
}

// This group sends p (and the buffers of the same operation) over NCCL.
static inline int comm_nccl_on(const CommGroup* g, const void* p) { return g->nccl != NULL && comm_staged(g, p); }

// all-to-all of size blocks of n floats (send: block r goes to rank r) into landing (row r
// from rank r), on the group's stream
static inline void comm_nccl_alltoall(CommGroup* g, const float* send, float* landing, size_t n) {
    struct CommNccl* nc = g->nccl;
    comm_nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < g->size; r++) {
        if (r == g->rank) { continue; }
        comm_nccl_check(ncclSend(send + (size_t)r * n, n, ncclFloat, r, nc->comm, nc->stream), "ncclSend (reduce-scatter)");
        comm_nccl_check(ncclRecv(landing + (size_t)r * n, n, ncclFloat, r, nc->comm, nc->stream), "ncclRecv (reduce-scatter)");
    }
    comm_nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    comm_cuda_check(cudaMemcpyAsync(landing + (size_t)g->rank * n, send + (size_t)g->rank * n, n * sizeof(float),
                                    cudaMemcpyDeviceToDevice, nc->stream), "cudaMemcpyAsync (own block)");
}

// Starts a reduce-scatter / all-gather / all-reduce / send / receive of device buffers (the
// calls of comm.h route them here); comm_wait() finishes them with comm_nccl_finish.
static inline CommRequest* comm_nccl_reduce_scatter_start(CommGroup* g, const float* send, float* recv, size_t n) {
    CommRequest* req = comm_request_new(COMM_OP_REDUCE_SCATTER, g, 0);
    req->n = n;
    req->out = recv;
    req->work = comm_nccl_buffer_get(g, (size_t)g->size * n);
    comm_nccl_after_compute(g);
    comm_nccl_alltoall(g, send, req->work.buf, n);
    req->nccl_done = comm_nccl_mark(g);
    return req;
}

static inline CommRequest* comm_nccl_all_gather_start(CommGroup* g, const float* send, float* recv, size_t n) {
    CommRequest* req = comm_request_new(COMM_OP_ALL_GATHER, g, 0);
    comm_nccl_after_compute(g);
    comm_nccl_check(ncclAllGather(send, recv, n, ncclFloat, g->nccl->comm, g->nccl->stream), "ncclAllGather");
    req->nccl_done = comm_nccl_mark(g);
    return req;
}

// The all-reduce works on a padded device copy of buf (npad floats, a multiple of the group
// size): the all-to-all of its shards here; the tree, the all-gather and the copy back in
// comm_nccl_finish.
static inline CommRequest* comm_nccl_all_reduce_start(CommGroup* g, float* buf, size_t n) {
    size_t shard = (n + g->size - 1) / g->size, npad = shard * g->size;
    CommRequest* req = comm_request_new(COMM_OP_ALL_REDUCE, g, 0);
    req->n = shard;
    req->out = buf;
    req->out_n = n;
    req->work = comm_nccl_buffer_get(g, 2 * npad);   // the padded copy, then the landing area
    req->padded = req->work.buf;
    comm_nccl_after_compute(g);
    cudaStream_t s = g->nccl->stream;
    comm_cuda_check(cudaMemcpyAsync(req->padded, buf, n * sizeof(float), cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    comm_cuda_check(cudaMemsetAsync(req->padded + n, 0, (npad - n) * sizeof(float), s), "cudaMemsetAsync");
    comm_nccl_alltoall(g, req->padded, req->work.buf + npad, shard);
    req->nccl_done = comm_nccl_mark(g);
    return req;
}

static inline CommRequest* comm_nccl_p2p_start(CommGroup* g, float* buf, size_t n, int peer, int is_send) {
    CommRequest* req = comm_request_new(COMM_OP_P2P, g, 0);
    struct CommNccl* nc = g->nccl;
    comm_nccl_after_compute(g);
    if (is_send) {
        comm_nccl_check(ncclSend(buf, n, ncclFloat, peer, nc->comm, nc->stream), "ncclSend");
    } else {
        comm_nccl_check(ncclRecv(buf, n, ncclFloat, peer, nc->comm, nc->stream), "ncclRecv");
    }
    req->nccl_done = comm_nccl_mark(g);
    return req;
}

// comm_test for an NCCL request: are its transfers done?
static inline int comm_nccl_test(CommRequest* req) {
    cudaError_t e = cudaEventQuery((cudaEvent_t)req->nccl_done);
    if (e == cudaErrorNotReady) { return 0; }
    comm_cuda_check(e, "cudaEventQuery");
    return 1;
}

// comm_wait for an NCCL request: the compute stream waits for its transfers, then the local
// half of a reduction runs there (the R1 tree over ranks), and an all-reduce all-gathers.
static inline void comm_nccl_finish(CommRequest* req) {
    CommGroup* g = req->group;
    comm_nccl_before_compute((cudaEvent_t)req->nccl_done);
    if (req->op == COMM_OP_REDUCE_SCATTER) {
        g->mem->tree_rows(req->work.buf, req->n, g->size, req->out);
    } else if (req->op == COMM_OP_ALL_REDUCE) {
        size_t npad = req->n * g->size;
        float* shard = req->padded + (size_t)g->rank * req->n;
        g->mem->tree_rows(req->work.buf + npad, req->n, g->size, shard);
        comm_nccl_after_compute(g);
        comm_nccl_check(ncclAllGather(shard, req->padded, req->n, ncclFloat, g->nccl->comm, g->nccl->stream),
                        "ncclAllGather (all-reduce)");
        comm_nccl_before_compute(comm_nccl_mark(g));
        comm_cuda_check(cudaMemcpyAsync(req->out, req->padded, req->out_n * sizeof(float), cudaMemcpyDeviceToDevice, 0),
                        "cudaMemcpyAsync");
    }
    comm_nccl_buffer_put(g, req->work);
    free(req);
}

#endif // LLMC_COMM_NCCL_H
