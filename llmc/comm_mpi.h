/*
 * comm_mpi.h: comm.h's MPI transports (comm_transport.h's table), and the MPI world they run in.
 *   comm_mpi_host    host buffers, over Open MPI
 *   comm_mpi_staged  device buffers (those the group's MemOps holds), copied to host buffers,
 *                    sent, received into host buffers and copied back: what the CUDA build does
 *                    when several ranks share one GPU, and what the emulated CUDA build always
 *                    does. Like a CUDA-aware MPI it asks where each pointer lives, so host
 *                    buffers given to it pass straight through.
 * Only copies cross the wire here (MPI_SUM's order of combining ranks is unspecified: comm.h
 * never asks for a float sum); the max has its own order-free operator (comm_max2) and the
 * integer sums are exact in any order.
 *
 * Messages longer than comm_piece_floats per rank are sent in pieces, because MPI counts are
 * int: a buffer may hold up to about 2^31 floats per rank or more.
 *
 * Built without USE_MPI this header holds only the piece size (comm.h is then one rank, and
 * calls no transport).
 */
#ifndef LLMC_COMM_MPI_H
#define LLMC_COMM_MPI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/comm_transport.h"
#include "llmc/memory.h"
#include "llmc/utils.h"

// Per-rank message size above which collectives and sends are split into pieces: MPI counts
// are int, and 2^28 floats (1 GiB) keeps every byte count below 2^31 as well.
#ifndef COMM_PIECE_FLOATS
#define COMM_PIECE_FLOATS ((size_t)1 << 28)
#endif
// The test lowers it to exercise the splitting on small buffers (and prints it in a build
// without MPI too, where nothing else reads it: hence `unused`).
static size_t comm_piece_floats __attribute__((unused)) = COMM_PIECE_FLOATS;

#ifdef USE_MPI
#include <mpi.h>

static inline size_t comm_pieces(size_t n) { return (n + comm_piece_floats - 1) / comm_piece_floats; }

static inline size_t comm_piece_len(size_t n, size_t p) {
    size_t off = p * comm_piece_floats;
    return n - off < comm_piece_floats ? n - off : comm_piece_floats;
}

// The host transport's link: one group's communicator.
typedef struct CommMpi { MPI_Comm comm; int rank, size; } CommMpi;

static MPI_Op comm_max_op = MPI_OP_NULL;

static inline void comm_max_op_fn(void* in, void* inout, int* len, MPI_Datatype* type) {
    const float* a = (const float*)in;
    float* b = (float*)inout;
    for (int i = 0; i < *len; i++) { b[i] = comm_max2(a[i], b[i]); }
}

static inline void comm_fatal_hook(int exit_code) { MPI_Abort(MPI_COMM_WORLD, exit_code); }
// A job of one rank has no one to stop: finalize quietly instead of MPI_Abort's banner.
static inline void comm_fatal_hook_single(int exit_code) { (void)exit_code; MPI_Finalize(); }

static inline void comm_mpi_check(int err, const char* what) {
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
        comm_mpi_check(MPI_Type_contiguous((int)len, MPI_FLOAT, &piece), "MPI_Type_contiguous");
        comm_mpi_check(MPI_Type_create_resized(piece, 0, (MPI_Aint)(n * sizeof(float)), &t.type),
                       "MPI_Type_create_resized");
        comm_mpi_check(MPI_Type_commit(&t.type), "MPI_Type_commit");
        MPI_Type_free(&piece);
        t.count = 1;
    }
    return t;
}

// Operations still pending on the type are unaffected (MPI keeps it alive until they finish).
static inline void comm_block_type_free(CommBlockType* t) {
    if (t->type != MPI_FLOAT) { MPI_Type_free(&t->type); }
}

// An operation in flight: one MPI request per piece.
typedef struct { int npieces; MPI_Request req[]; } CommMpiOp;

static inline CommMpiOp* comm_mpi_op_new(size_t pieces) {
    CommMpiOp* op = (CommMpiOp*)calloc_or_die(1, sizeof(CommMpiOp) + pieces * sizeof(MPI_Request),
                                              "communication request");
    op->npieces = (int)pieces;
    for (size_t p = 0; p < pieces; p++) { op->req[p] = MPI_REQUEST_NULL; }
    return op;
}

// Lets MPI progress the transfers (Open MPI moves non-blocking data only inside MPI calls).
static inline int comm_mpi_test(void* inflight) {
    if (inflight == NULL) { return 1; }
    CommMpiOp* op = (CommMpiOp*)inflight;
    int done = 0;
    comm_mpi_check(MPI_Testall(op->npieces, op->req, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    return done;
}

static inline void comm_mpi_wait(void* inflight) {
    if (inflight == NULL) { return; }
    CommMpiOp* op = (CommMpiOp*)inflight;
    comm_mpi_check(MPI_Waitall(op->npieces, op->req, MPI_STATUSES_IGNORE), "MPI_Waitall");
    free(op);
}

// All-to-all of size blocks of n floats, piece by piece: piece p of block r of send goes to rank
// r, which receives it at piece p of its block (of recv) for this rank. Blocking: op is NULL.
static inline void* comm_mpi_all_to_all(void* link, const float* send, float* recv, size_t n, int blocking) {
    CommMpi* mpi = (CommMpi*)link;
    CommMpiOp* op = blocking ? NULL : comm_mpi_op_new(comm_pieces(n));
    for (size_t p = 0; p < comm_pieces(n); p++) {
        size_t off = p * comm_piece_floats, len = comm_piece_len(n, p);
        CommBlockType bt = comm_block_type(len, n);
        if (op) {
            comm_mpi_check(MPI_Ialltoall(send + off, bt.count, bt.type, recv + off, bt.count, bt.type,
                                         mpi->comm, &op->req[p]), "MPI_Ialltoall");
        } else {
            comm_mpi_check(MPI_Alltoall(send + off, bt.count, bt.type, recv + off, bt.count, bt.type,
                                        mpi->comm), "MPI_Alltoall");
        }
        comm_block_type_free(&bt);
    }
    return op;
}

// All-gather of n floats per rank into recv (size blocks of n), piece by piece. send may be
// this rank's own block of recv (in place).
static inline void* comm_mpi_all_gather(void* link, const float* send, float* recv, size_t n, int blocking) {
    CommMpi* mpi = (CommMpi*)link;
    CommMpiOp* op = blocking ? NULL : comm_mpi_op_new(comm_pieces(n));
    int in_place = send == recv + (size_t)mpi->rank * n;
    for (size_t p = 0; p < comm_pieces(n); p++) {
        size_t off = p * comm_piece_floats, len = comm_piece_len(n, p);
        CommBlockType rt = comm_block_type(len, n);
        const void* src = in_place ? MPI_IN_PLACE : (const void*)(send + off);
        if (op) {
            comm_mpi_check(MPI_Iallgather(src, (int)len, MPI_FLOAT, recv + off, rt.count, rt.type,
                                          mpi->comm, &op->req[p]), "MPI_Iallgather");
        } else {
            comm_mpi_check(MPI_Allgather(src, (int)len, MPI_FLOAT, recv + off, rt.count, rt.type,
                                         mpi->comm), "MPI_Allgather");
        }
        comm_block_type_free(&rt);
    }
    return op;
}

// Pieces of one message keep their order: MPI never overtakes between the same two ranks with
// the same tag.
static inline void* comm_mpi_p2p(CommMpi* mpi, float* buf, size_t n, int peer, int tag, int is_send) {
    CommMpiOp* op = comm_mpi_op_new(comm_pieces(n));
    for (size_t p = 0; p < comm_pieces(n); p++) {
        float* piece = buf + p * comm_piece_floats;
        int len = (int)comm_piece_len(n, p);
        if (is_send) {
            comm_mpi_check(MPI_Isend(piece, len, MPI_FLOAT, peer, tag, mpi->comm, &op->req[p]), "MPI_Isend");
        } else {
            comm_mpi_check(MPI_Irecv(piece, len, MPI_FLOAT, peer, tag, mpi->comm, &op->req[p]), "MPI_Irecv");
        }
    }
    return op;
}
static inline void* comm_mpi_send(void* link, const float* buf, size_t n, int peer, int tag) {
    return comm_mpi_p2p((CommMpi*)link, (float*)buf, n, peer, tag, 1);
}
static inline void* comm_mpi_recv(void* link, float* buf, size_t n, int peer, int tag) {
    return comm_mpi_p2p((CommMpi*)link, buf, n, peer, tag, 0);
}

static inline void comm_mpi_all_to_all_v(void* link, const void* send, const size_t* send_counts, void* recv,
                                         const size_t* recv_counts, CommElem elem) {
    CommMpi* mpi = (CommMpi*)link;
    const char* what = elem == COMM_ELEM_INT ? "MPI_Alltoallv (ints)" : "MPI_Alltoallv";
    // MPI's counts and displacements, per rank: sent, where from, received, where to
    int* counts = (int*)malloc_or_die(sizeof(int) * 4 * (size_t)mpi->size, "all-to-all counts");
    size_t send_off = 0, recv_off = 0;
    for (int r = 0; r < mpi->size; r++) {
        if (send_counts[r] > INT32_MAX || recv_counts[r] > INT32_MAX || send_off > INT32_MAX || recv_off > INT32_MAX) {
            fatal("%s: more than 2^31 elements in one exchange", what);
        }
        counts[r] = (int)send_counts[r];
        counts[mpi->size + r] = (int)send_off;
        counts[2 * mpi->size + r] = (int)recv_counts[r];
        counts[3 * mpi->size + r] = (int)recv_off;
        send_off += send_counts[r];
        recv_off += recv_counts[r];
    }
    MPI_Datatype type = elem == COMM_ELEM_INT ? MPI_INT : MPI_FLOAT;
    comm_mpi_check(MPI_Alltoallv(send, counts, counts + mpi->size, type, recv, counts + 2 * mpi->size,
                                 counts + 3 * mpi->size, type, mpi->comm), what);
    free(counts);
}

static inline void comm_mpi_all_reduce_max(void* link, float* buf, size_t n) {
    CommMpi* mpi = (CommMpi*)link;
    for (size_t p = 0; p < comm_pieces(n); p++) {
        comm_mpi_check(MPI_Allreduce(MPI_IN_PLACE, buf + p * comm_piece_floats, (int)comm_piece_len(n, p),
                                     MPI_FLOAT, comm_max_op, mpi->comm), "MPI_Allreduce (max)");
    }
}

static inline void comm_mpi_all_reduce_sum_u64(void* link, uint64_t* words, size_t n) {
    comm_mpi_check(MPI_Allreduce(MPI_IN_PLACE, words, (int)n, MPI_UINT64_T, MPI_SUM, ((CommMpi*)link)->comm),
                   "MPI_Allreduce (sum of squares)");
}

static inline void comm_mpi_broadcast(void* link, void* buf, size_t bytes, int root) {
    size_t piece = comm_piece_floats * sizeof(float);
    for (size_t off = 0; off < bytes; off += piece) {
        size_t len = bytes - off < piece ? bytes - off : piece;
        comm_mpi_check(MPI_Bcast((char*)buf + off, (int)len, MPI_BYTE, root, ((CommMpi*)link)->comm), "MPI_Bcast");
    }
}

static inline void comm_mpi_barrier(void* link) { comm_mpi_check(MPI_Barrier(((CommMpi*)link)->comm), "MPI_Barrier"); }

static const CommTransport comm_mpi_host = {
    "mpi", 0, comm_mpi_all_to_all, comm_mpi_all_gather, comm_mpi_send, comm_mpi_recv, comm_mpi_test,
    comm_mpi_wait, comm_mpi_all_to_all_v, comm_mpi_all_reduce_max, comm_mpi_all_reduce_sum_u64,
    comm_mpi_broadcast, comm_mpi_barrier
};

// ------------------------------------------------------------------------------------------
// staged through host memory: the host transport on host copies of the device buffers

// The staged transport's link: the group's host link, the device memory, host copies for reuse.
typedef struct CommMpiStaged {
    CommMpi* mpi;
    const MemOps* device;
    CommPool pool;
} CommMpiStaged;

// An operation of the host transport on host copies, and what to copy back when it is done.
typedef struct {
    CommMpiStaged* link;
    void* inner;            // the host transport's operation
    CommBuffer in, out;     // the host copies of a device send buffer and of a device receive buffer
    float* device;          // the device receive buffer `out` is copied into
    size_t device_n;
} CommStagedOp;

static inline CommStagedOp* comm_staged_op_new(void* link) {
    CommStagedOp* op = (CommStagedOp*)calloc_or_die(1, sizeof(CommStagedOp), "communication request");
    op->link = (CommMpiStaged*)link;
    return op;
}

// What the host sends for buf: buf itself, or a host copy of its n floats.
static inline const float* comm_staged_in(CommStagedOp* op, const float* buf, size_t n) {
    CommMpiStaged* staged = op->link;
    if (!staged->device->holds(buf)) { return buf; }
    op->in = comm_pool_get(&staged->pool, &memory_host, n);
    staged->device->to_host(op->in.buf, buf, n * sizeof(float));
    return op->in.buf;
}

// Where the host receives n floats meant for buf: buf itself, or a host buffer copied into buf
// when the operation is done.
static inline float* comm_staged_out(CommStagedOp* op, float* buf, size_t n) {
    CommMpiStaged* staged = op->link;
    if (!staged->device->holds(buf)) { return buf; }
    op->out = comm_pool_get(&staged->pool, &memory_host, n);
    op->device = buf;
    op->device_n = n;
    return op->out.buf;
}

static inline int comm_staged_test(void* inflight) {
    return inflight == NULL || comm_mpi_test(((CommStagedOp*)inflight)->inner);
}

static inline void comm_staged_wait(void* inflight) {
    if (inflight == NULL) { return; }
    CommStagedOp* op = (CommStagedOp*)inflight;
    CommMpiStaged* staged = op->link;
    comm_mpi_wait(op->inner);
    if (op->device) { staged->device->from_host(op->device, op->out.buf, op->device_n * sizeof(float)); }
    comm_pool_put(&staged->pool, &memory_host, op->in);
    comm_pool_put(&staged->pool, &memory_host, op->out);
    free(op);
}

// The host operation has started (blocking: finished): copy back now, or when it is done.
static inline void* comm_staged_started(CommStagedOp* op, void* inner, int blocking) {
    op->inner = inner;
    if (blocking) { comm_staged_wait(op); return NULL; }
    return op;
}

static inline void* comm_staged_all_to_all(void* link, const float* send, float* recv, size_t n, int blocking) {
    CommStagedOp* op = comm_staged_op_new(link);
    size_t total = (size_t)op->link->mpi->size * n;
    const float* host_send = comm_staged_in(op, send, total);
    float* host_recv = comm_staged_out(op, recv, total);
    return comm_staged_started(op, comm_mpi_all_to_all(op->link->mpi, host_send, host_recv, n, blocking), blocking);
}

static inline void* comm_staged_all_gather(void* link, const float* send, float* recv, size_t n, int blocking) {
    CommStagedOp* op = comm_staged_op_new(link);
    const float* host_send = comm_staged_in(op, send, n);
    float* host_recv = comm_staged_out(op, recv, (size_t)op->link->mpi->size * n);
    return comm_staged_started(op, comm_mpi_all_gather(op->link->mpi, host_send, host_recv, n, blocking), blocking);
}

static inline void* comm_staged_send(void* link, const float* buf, size_t n, int peer, int tag) {
    CommStagedOp* op = comm_staged_op_new(link);
    return comm_staged_started(op, comm_mpi_send(op->link->mpi, comm_staged_in(op, buf, n), n, peer, tag), 0);
}

static inline void* comm_staged_recv(void* link, float* buf, size_t n, int peer, int tag) {
    CommStagedOp* op = comm_staged_op_new(link);
    return comm_staged_started(op, comm_mpi_recv(op->link->mpi, comm_staged_out(op, buf, n), n, peer, tag), 0);
}

static inline void comm_staged_all_to_all_v(void* link, const void* send, const size_t* send_counts, void* recv,
                                            const size_t* recv_counts, CommElem elem) {
    CommStagedOp* op = comm_staged_op_new(link);
    size_t nsend = 0, nrecv = 0;
    for (int r = 0; r < op->link->mpi->size; r++) { nsend += send_counts[r]; nrecv += recv_counts[r]; }
    // both element types are 4 bytes: staged as that many floats
    const float* host_send = comm_staged_in(op, (const float*)send, nsend);
    float* host_recv = comm_staged_out(op, (float*)recv, nrecv);
    comm_mpi_all_to_all_v(op->link->mpi, host_send, send_counts, host_recv, recv_counts, elem);
    comm_staged_wait(op);
}

static inline void comm_staged_all_reduce_max(void* link, float* buf, size_t n) {
    CommStagedOp* op = comm_staged_op_new(link);
    float* host = comm_staged_out(op, buf, n);
    if (host != buf) { op->link->device->to_host(host, buf, n * sizeof(float)); }
    comm_mpi_all_reduce_max(op->link->mpi, host, n);
    comm_staged_wait(op);
}

// Host values (integer sums, broadcasts, barriers) are comm_mpi_host's.
static const CommTransport comm_mpi_staged = {
    "mpi (staged)", 0, comm_staged_all_to_all, comm_staged_all_gather, comm_staged_send, comm_staged_recv,
    comm_staged_test, comm_staged_wait, comm_staged_all_to_all_v, comm_staged_all_reduce_max, NULL, NULL, NULL
};

// ------------------------------------------------------------------------------------------
// the MPI world

// MPI_Init (unless done), fatal() wired to MPI_Abort, and the world's link: a private copy of
// the world, so no other traffic can match ours. Its errors come back as codes, so
// comm_mpi_check names the operation in a fatal() line; the groups are split from it and
// inherit that.
static inline CommMpi* comm_mpi_init(int* argc, char*** argv) {
    int initialized = 0, provided = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
        // Only the main thread calls MPI (OpenMP threads compute between calls).
        comm_mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    }
    llmc_fatal_hook = comm_fatal_hook;
    CommMpi* world = (CommMpi*)calloc_or_die(1, sizeof(CommMpi), "MPI group");
    comm_mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &world->comm), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(world->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(world->comm, &world->rank);
    MPI_Comm_size(world->comm, &world->size);
    if (world->size > 1) {
        snprintf(llmc_fatal_prefix, sizeof(llmc_fatal_prefix), "[rank %d] ", world->rank);
    } else {
        llmc_fatal_hook = comm_fatal_hook_single;
    }
    comm_mpi_check(MPI_Op_create(comm_max_op_fn, 1, &comm_max_op), "MPI_Op_create");
    return world;
}

// The link of the ranks of `world` with the same `color`, ranked by `key`.
static inline CommMpi* comm_mpi_split(const CommMpi* world, int color, int key) {
    CommMpi* mpi = (CommMpi*)calloc_or_die(1, sizeof(CommMpi), "MPI group");
    comm_mpi_check(MPI_Comm_split(world->comm, color, key, &mpi->comm), "MPI_Comm_split");
    MPI_Comm_rank(mpi->comm, &mpi->rank);
    MPI_Comm_size(mpi->comm, &mpi->size);
    return mpi;
}

static inline void comm_mpi_free(CommMpi* mpi) {
    if (mpi == NULL) { return; }
    MPI_Comm_free(&mpi->comm);
    free(mpi);
}

// This rank's index among the ranks on its node (a shared-memory split of the world).
static inline int comm_mpi_node_local_rank(const CommMpi* world) {
    MPI_Comm node;
    comm_mpi_check(MPI_Comm_split_type(world->comm, MPI_COMM_TYPE_SHARED, world->rank, MPI_INFO_NULL, &node),
                   "MPI_Comm_split_type");
    int rank = 0;
    MPI_Comm_rank(node, &rank);
    MPI_Comm_free(&node);
    return rank;
}

static inline void comm_mpi_finalize(void) {
    MPI_Op_free(&comm_max_op);
    llmc_fatal_hook = NULL;       // MPI_Abort is no longer allowed
    MPI_Finalize();
}

#endif // USE_MPI
#endif // LLMC_COMM_MPI_H
