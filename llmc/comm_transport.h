/*
 * comm_transport.h: what a transport of comm.h is. comm.h holds the groups, the canonical
 * collectives and the accounting; a transport only moves bytes between the ranks of a group,
 * through the small table below. Three exist:
 *   comm_mpi.h    comm_mpi_host: MPI on host buffers
 *                 comm_mpi_staged: MPI on device buffers, staged through host memory (what the
 *                 emulated CUDA build and ranks sharing a GPU use)
 *   comm_nccl.h   comm_nccl_transport: NCCL on device buffers (train_gpt2cu, one GPU per rank)
 * A transport never sums floats: comm.h's reduce-scatter asks it for an all-to-all and runs
 * canonical.h's R1 tree over the landed rows itself, in the memory they landed in, so every
 * transport gives the same bits. A transport calls nothing in comm.h.
 *
 * Every call gets the transport's own state for one group (`link`: an MPI communicator, an
 * NCCL communicator and its stream, ...), made by the transport's setup functions.
 */
#ifndef LLMC_COMM_TRANSPORT_H
#define LLMC_COMM_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include "llmc/canonical.h"
#include "llmc/memory.h"

// The elements of an all-to-all with counts per rank: both are 4-byte copies, named so that a
// transport can tell MPI what they are.
typedef enum { COMM_ELEM_FLOAT, COMM_ELEM_INT } CommElem;

// The operations that start something return it in flight (void*: each transport's own
// record), which test() progresses and wait() finishes and frees. With `blocking` set they
// finish before returning and return NULL, which wait() takes as nothing left to do.
typedef struct CommTransport {
    const char* name;
    // 1 if comm.h must hand it landing buffers in the group's (device) memory, 0 for host memory
    int lands_on_device;
    // exchanges of floats, exact copies; n floats per rank:
    //   all_to_all  block r of send (size blocks of n) goes to rank r; row r of recv comes from rank r
    //   all_gather  recv (size blocks of n) = every rank's send in rank order; send may be this
    //               rank's own block of recv (in place)
    void* (*all_to_all)(void* link, const float* send, float* recv, size_t n, int blocking);
    void* (*all_gather)(void* link, const float* send, float* recv, size_t n, int blocking);
    // point to point, always started: n floats to or from rank `peer`, matched by tag in order
    void* (*send)(void* link, const float* buf, size_t n, int peer, int tag);
    void* (*recv)(void* link, float* buf, size_t n, int peer, int tag);
    int (*test)(void* op);     // 1 once its transfers are done (and lets them progress)
    void (*wait)(void* op);
    // blocking and order-free: an all-to-all with a count per rank (send_counts[r] elements to
    // rank r, recv_counts[r] from it, contiguous in rank order), and the elementwise max of
    // comm_max2 below
    void (*all_to_all_v)(void* link, const void* send, const size_t* send_counts, void* recv,
                         const size_t* recv_counts, CommElem elem);
    void (*all_reduce_max)(void* link, float* buf, size_t n);
    // host values only (an MPI transport's; comm.h routes host buffers to one): integer sums
    // (any order is exact), a broadcast of bytes from rank root, a barrier
    void (*all_reduce_sum_u64)(void* link, uint64_t* words, size_t n);
    void (*broadcast)(void* link, void* buf, size_t bytes, int root);
    void (*barrier)(void* link);
} CommTransport;

// Elementwise max, the same bits in any order of combining: a NaN anywhere gives the
// canonical quiet NaN, and +0 beats -0. (MPI_MAX computes a > b ? a : b, whose answer for a
// NaN or for -0 vs +0 depends on which rank's value comes first.)
static inline float comm_max2(float a, float b) {
    if (a != a || b != b) { return canon_nan(); }
    if (a != b) { return a > b ? a : b; }
    return (canon_float_to_bits(a) >> 31) ? b : a;     // equal: only +0 and -0 differ in bits
}

// ------------------------------------------------------------------------------------------
// Workspace buffers (landing areas, padded copies, staging copies), kept for reuse by whoever
// owns the pool (a group of comm.h, a transport's link): fresh memory costs a page fault per
// 4 KiB on first touch, which made a 64 MB non-blocking reduce-scatter 3x slower. A pool holds
// as many buffers as were ever in flight at once (at most COMM_POOL kept), until it is freed.
#define COMM_POOL 16
typedef struct { float* buf; size_t floats; } CommBuffer;
typedef struct { CommBuffer idle[COMM_POOL]; int count; } CommPool;

// The smallest idle buffer that fits, else the largest one replaced by a big enough one.
static inline CommBuffer comm_pool_get(CommPool* pool, const MemOps* mem, size_t floats) {
    int best = -1, largest = -1;
    for (int i = 0; i < pool->count; i++) {
        if (pool->idle[i].floats >= floats && (best < 0 || pool->idle[i].floats < pool->idle[best].floats)) { best = i; }
        if (largest < 0 || pool->idle[i].floats > pool->idle[largest].floats) { largest = i; }
    }
    CommBuffer buffer = { NULL, 0 };
    int take = best >= 0 ? best : largest;
    if (take >= 0) {
        buffer = pool->idle[take];
        pool->idle[take] = pool->idle[--pool->count];
    }
    if (buffer.floats < floats) {
        mem->release(buffer.buf);
        buffer.buf = (float*)mem->alloc(floats * sizeof(float), "communication workspace");
        buffer.floats = floats;
    }
    return buffer;
}

static inline void comm_pool_put(CommPool* pool, const MemOps* mem, CommBuffer buffer) {
    if (buffer.buf == NULL) { return; }
    if (pool->count < COMM_POOL) { pool->idle[pool->count++] = buffer; } else { mem->release(buffer.buf); }
}

static inline void comm_pool_free(CommPool* pool, const MemOps* mem) {
    for (int i = 0; i < pool->count; i++) { mem->release(pool->idle[i].buf); }
    pool->count = 0;
}

#endif // LLMC_COMM_TRANSPORT_H
