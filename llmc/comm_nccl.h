/*
 * comm_nccl.h: comm.h's NCCL transport (comm_transport.h's table) for device buffers, in the
 * CUDA build compiled with USE_NCCL (--comm nccl), one GPU per rank. It moves bytes only:
 *   all-to-all      grouped ncclSend/ncclRecv (what a reduce-scatter's all-to-all of the blocks
 *                   sends: the bytes of a ring); comm.h then runs the R1 tree over the ranks in
 *                   rank order where the rows landed (the MemOps tree_rows of memory.h, a device
 *                   kernel), never NCCL's own float sum, whose order changes with topology and size
 *   all-gather      ncclAllGather (a copy: exact)
 *   send / receive  ncclSend / ncclRecv
 * The max and the all-to-all with counts per rank go over MPI staged through host memory
 * (comm_mpi_staged), as host values do; MPI also bootstraps NCCL: rank 0 of each group makes
 * the unique id and MPI broadcasts it.
 *
 * Stream: every group's NCCL operations go on ONE stream per rank, in the order the rank
 * posts them (serialised). NCCL kernels of different communicators running concurrently can
 * deadlock unless every rank issues them in the same order (NCCL's documentation, "Using
 * multiple NCCL communicators concurrently"); on one stream they never run concurrently, and
 * the ranks of a group post that group's operations in the same program order (the schedules
 * are the same on every replica). An operation starts after everything the compute stream has
 * queued (an event), and the compute stream waits for it (another event, the operation in
 * flight) when it is waited for: until then the transfer overlaps the compute, as on the CPU.
 *
 * Nothing here is compiled without USE_NCCL (which the build sets only with USE_MPI).
 */
#ifndef LLMC_COMM_NCCL_H
#define LLMC_COMM_NCCL_H

#include <cuda_runtime.h>
#include <nccl.h>
#include "llmc/comm_mpi.h"
#include "llmc/comm_transport.h"
#include "llmc/utils.h"

// One group's link: its communicator, the rank's NCCL stream, and the staged MPI link of the
// same group. Groups of the same ranks (dp and dp x cp when cp = 1) share one link (refs).
typedef struct CommNccl {
    ncclComm_t comm;
    cudaStream_t stream;           // comm_nccl_stream: every group's NCCL operations, in the order posted
    int rank, size, refs;
    CommMpiStaged* staged;
} CommNccl;

// the rank's one NCCL stream, and how many links use it
static cudaStream_t comm_nccl_stream;
static int comm_nccl_links;

static inline void comm_nccl_check(ncclResult_t result, const char* what) {
    if (result != ncclSuccess) { fatal("NCCL error in %s: %s", what, ncclGetErrorString(result)); }
}
static inline void comm_cuda_check(cudaError_t err, const char* what) {
    if (err != cudaSuccess) { fatal("CUDA error in %s: %s", what, cudaGetErrorString(err)); }
}

// The group's stream waits for everything the compute (legacy default) stream has queued.
static inline void comm_nccl_after_compute(CommNccl* nc) {
    cudaEvent_t ev;
    comm_cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    comm_cuda_check(cudaEventRecord(ev, 0), "cudaEventRecord");
    comm_cuda_check(cudaStreamWaitEvent(nc->stream, ev, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ev);
}

// The operations posted on the group's stream so far, as one in flight: an event after them.
// Blocking: the compute stream waits for it now, and nothing is left in flight.
static inline void* comm_nccl_posted(CommNccl* nc, int blocking) {
    cudaEvent_t ev;
    comm_cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    comm_cuda_check(cudaEventRecord(ev, nc->stream), "cudaEventRecord");
    if (!blocking) { return (void*)ev; }
    comm_cuda_check(cudaStreamWaitEvent(0, ev, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ev);
    return NULL;
}

static inline int comm_nccl_test(void* op) {
    if (op == NULL) { return 1; }
    cudaError_t err = cudaEventQuery((cudaEvent_t)op);
    if (err == cudaErrorNotReady) { return 0; }
    comm_cuda_check(err, "cudaEventQuery");
    return 1;
}

// The compute stream waits for the operation's transfers (the host does not).
static inline void comm_nccl_wait(void* op) {
    if (op == NULL) { return; }
    comm_cuda_check(cudaStreamWaitEvent(0, (cudaEvent_t)op, 0), "cudaStreamWaitEvent");
    cudaEventDestroy((cudaEvent_t)op);
}

static inline void* comm_nccl_all_to_all(void* link, const float* send, float* recv, size_t n, int blocking) {
    CommNccl* nc = (CommNccl*)link;
    comm_nccl_after_compute(nc);
    comm_nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < nc->size; r++) {
        if (r == nc->rank) { continue; }
        comm_nccl_check(ncclSend(send + (size_t)r * n, n, ncclFloat, r, nc->comm, nc->stream), "ncclSend (all-to-all)");
        comm_nccl_check(ncclRecv(recv + (size_t)r * n, n, ncclFloat, r, nc->comm, nc->stream), "ncclRecv (all-to-all)");
    }
    comm_nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    comm_cuda_check(cudaMemcpyAsync(recv + (size_t)nc->rank * n, send + (size_t)nc->rank * n, n * sizeof(float),
                                    cudaMemcpyDeviceToDevice, nc->stream), "cudaMemcpyAsync (own block)");
    return comm_nccl_posted(nc, blocking);
}

static inline void* comm_nccl_all_gather(void* link, const float* send, float* recv, size_t n, int blocking) {
    CommNccl* nc = (CommNccl*)link;
    comm_nccl_after_compute(nc);
    comm_nccl_check(ncclAllGather(send, recv, n, ncclFloat, nc->comm, nc->stream), "ncclAllGather");
    return comm_nccl_posted(nc, blocking);
}

// NCCL matches the messages between two ranks in order (the tag is comm.h's check only).
static inline void* comm_nccl_send(void* link, const float* buf, size_t n, int peer, int tag) {
    CommNccl* nc = (CommNccl*)link;
    comm_nccl_after_compute(nc);
    comm_nccl_check(ncclSend(buf, n, ncclFloat, peer, nc->comm, nc->stream), "ncclSend");
    return comm_nccl_posted(nc, 0);
}

static inline void* comm_nccl_recv(void* link, float* buf, size_t n, int peer, int tag) {
    CommNccl* nc = (CommNccl*)link;
    comm_nccl_after_compute(nc);
    comm_nccl_check(ncclRecv(buf, n, ncclFloat, peer, nc->comm, nc->stream), "ncclRecv");
    return comm_nccl_posted(nc, 0);
}

static inline void comm_nccl_all_to_all_v(void* link, const void* send, const size_t* send_counts, void* recv,
                                          const size_t* recv_counts, CommElem elem) {
    comm_staged_all_to_all_v(((CommNccl*)link)->staged, send, send_counts, recv, recv_counts, elem);
}

static inline void comm_nccl_all_reduce_max(void* link, float* buf, size_t n) {
    comm_staged_all_reduce_max(((CommNccl*)link)->staged, buf, n);
}

// Host values (integer sums, broadcasts, barriers) are comm_mpi_host's.
static const CommTransport comm_nccl_transport = {
    "nccl", 1, comm_nccl_all_to_all, comm_nccl_all_gather, comm_nccl_send, comm_nccl_recv, comm_nccl_test,
    comm_nccl_wait, comm_nccl_all_to_all_v, comm_nccl_all_reduce_max, NULL, NULL, NULL
};

// The NCCL link of the group whose staged MPI link is `staged` (a group of more than one
// rank): rank 0 makes the unique id, MPI broadcasts it, every rank joins. Collective over the group.
static inline CommNccl* comm_nccl_new(CommMpiStaged* staged) {
    CommMpi* mpi = staged->mpi;
    ncclUniqueId id;
    if (mpi->rank == 0) { comm_nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId"); }
    comm_mpi_check(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi->comm), "MPI_Bcast (NCCL unique id)");
    CommNccl* nc = (CommNccl*)calloc_or_die(1, sizeof(CommNccl), "NCCL group");
    nc->rank = mpi->rank;
    nc->size = mpi->size;
    nc->staged = staged;
    nc->refs = 1;
    comm_nccl_check(ncclCommInitRank(&nc->comm, nc->size, id, nc->rank), "ncclCommInitRank");
    if (comm_nccl_links++ == 0) {
        comm_cuda_check(cudaStreamCreateWithFlags(&comm_nccl_stream, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    nc->stream = comm_nccl_stream;
    return nc;
}

// another group of the same ranks uses this link
static inline CommNccl* comm_nccl_share(CommNccl* nc) {
    nc->refs++;
    return nc;
}

static inline void comm_nccl_free(CommNccl* nc) {
    if (nc == NULL || --nc->refs > 0) { return; }
    cudaStreamSynchronize(nc->stream);
    ncclCommDestroy(nc->comm);
    if (--comm_nccl_links == 0) { cudaStreamDestroy(comm_nccl_stream); }
    free(nc);
}

#endif // LLMC_COMM_NCCL_H
