/*
 * utils.h: fatal errors, checked allocation and checked file I/O, atomic file replacement.
 *
 * Bad input must end the program with ONE clear line naming the file or flag and what was
 * expected, and a non-zero exit. Every helper here prints such a line through fatal().
 * Under MPI, a rank that calls fatal() must take the whole job down (no hang): the
 * communicator installs llmc_fatal_hook to call MPI_Abort after the message is printed.
 *
 * Files that must never be half-written (checkpoints, state, token files) are written
 * through atomic_writer_open()/atomic_writer_commit(): the bytes go to "PATH.tmp.PID", are
 * flushed and fsync'ed, then renamed over PATH. A crash mid-save leaves PATH untouched.
 */
#ifndef LLMC_UTILS_H
#define LLMC_UTILS_H

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

// Seconds on the monotonic clock: what the executor times its computations with, the trainer
// its steps and fma_peak.h its measurements.
static inline double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Called after the fatal message is printed, before exit (MPI_Abort under MPI).
static void (*llmc_fatal_hook)(int exit_code) = NULL;
// Prefix for fatal messages ("[rank 3] " under MPI), so the rank that saw the problem is named.
static char llmc_fatal_prefix[32] = "";

__attribute__((format(printf, 1, 2), noreturn))
static inline void fatal(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    // one write for the whole line: stderr is unbuffered, and under mpirun pieces written
    // apart can be forwarded apart and interleaved with other ranks' output
    char line[2048];
    int n = snprintf(line, sizeof(line), "error: %s", llmc_fatal_prefix);
    if (n < 0 || n >= (int)sizeof(line)) { n = 0; }
    vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    strcat(line, "\n");
    fputs(line, stderr);
    fflush(stderr);
    va_end(ap);
    if (llmc_fatal_hook) { llmc_fatal_hook(1); }
    exit(1);
}

static inline void* malloc_or_die(size_t bytes, const char* what) {
    void* p = malloc(bytes ? bytes : 1);
    if (p == NULL) { fatal("out of memory allocating %zu bytes for %s", bytes, what); }
    return p;
}

static inline void* calloc_or_die(size_t count, size_t size, const char* what) {
    void* p = calloc(count ? count : 1, size ? size : 1);
    if (p == NULL) { fatal("out of memory allocating %zu x %zu bytes for %s", count, size, what); }
    return p;
}

// 64-byte aligned, so SIMD kernels can use aligned loads on buffer starts; zero-filled.
static inline void* aligned_calloc_or_die(size_t bytes, const char* what) {
    void* p = NULL;
    size_t rounded = (bytes + 63) / 64 * 64;
    if (posix_memalign(&p, 64, rounded ? rounded : 64) != 0) {
        fatal("out of memory allocating %zu bytes for %s", bytes, what);
    }
    memset(p, 0, rounded ? rounded : 64);
    return p;
}

static inline FILE* fopen_or_die(const char* path, const char* mode, const char* what) {
    FILE* f = fopen(path, mode);
    if (f == NULL) {
        fatal("cannot open %s '%s' for %s: %s", what, path,
              mode[0] == 'r' ? "reading" : "writing", strerror(errno));
    }
    return f;
}

// Reads exactly count items or dies naming the file: a short read means a truncated file.
static inline void fread_or_die(void* dst, size_t size, size_t count, FILE* f, const char* path) {
    size_t got = fread(dst, size, count, f);
    if (got != count) {
        fatal("file '%s' is truncated or unreadable: expected %zu more bytes, got %zu",
              path, size * count, size * got);
    }
}

static inline void fwrite_or_die(const void* src, size_t size, size_t count, FILE* f, const char* path) {
    if (fwrite(src, size, count, f) != count) {
        fatal("cannot write %zu bytes to '%s': %s", size * count, path, strerror(errno));
    }
}

static inline void fseek_or_die(FILE* f, int64_t offset, int whence, const char* path) {
    if (fseeko(f, (off_t)offset, whence) != 0) {
        fatal("cannot seek to byte %lld of '%s': %s", (long long)offset, path, strerror(errno));
    }
}

static inline int64_t file_size_or_die(FILE* f, const char* path) {
    fseek_or_die(f, 0, SEEK_END, path);
    off_t size = ftello(f);
    if (size < 0) { fatal("cannot determine the size of '%s': %s", path, strerror(errno)); }
    fseek_or_die(f, 0, SEEK_SET, path);
    return (int64_t)size;
}

// --- atomic replacement of a file ---------------------------------------------------------
#define ATOMIC_WRITER_PATH_MAX 1023   // the longest path (in bytes) an AtomicWriter writes

typedef struct {
    FILE* f;
    char final_path[ATOMIC_WRITER_PATH_MAX + 1];
    char tmp_path[ATOMIC_WRITER_PATH_MAX + 32];   // final_path ".tmp.PID"
} AtomicWriter;

static inline void atomic_writer_open(AtomicWriter* w, const char* path) {
    size_t n = strlen(path);
    if (n > ATOMIC_WRITER_PATH_MAX) { fatal("output path too long: '%s'", path); }
    memcpy(w->final_path, path, n + 1);
    snprintf(w->tmp_path, sizeof(w->tmp_path), "%s.tmp.%d", w->final_path, (int)getpid());
    w->f = fopen(w->tmp_path, "wb");
    if (w->f == NULL) {
        fatal("cannot write '%s' (temporary file '%s'): %s", path, w->tmp_path, strerror(errno));
    }
}

static inline void atomic_writer_write(AtomicWriter* w, const void* src, size_t bytes) {
    if (bytes && fwrite(src, 1, bytes, w->f) != bytes) {
        int e = errno;
        fclose(w->f);
        remove(w->tmp_path);
        fatal("cannot write '%s': %s (the previous file, if any, is untouched)", w->final_path,
              strerror(e));
    }
}

// Flush, fsync, rename over the final path. Only after this returns does the new file exist.
static inline void atomic_writer_commit(AtomicWriter* w) {
    int ok = fflush(w->f) == 0 && fsync(fileno(w->f)) == 0;
    int e = errno;
    ok = (fclose(w->f) == 0) && ok;
    if (!ok || rename(w->tmp_path, w->final_path) != 0) {
        if (ok) { e = errno; }
        remove(w->tmp_path);
        fatal("cannot write '%s': %s (the previous file, if any, is untouched)", w->final_path,
              strerror(e));
    }
}

// A directory that ensure_writable_dir() accepts has room for file names of up to this many
// bytes (the longest the trainers write is "state_00000000_00000.bin"), so a run whose output
// path is too long fails at startup, not at its first checkpoint. (A tool that writes longer
// names, like dev/data/tokenize --name, checks them itself.)
#define OUTPUT_NAME_MAX 32

// Creates DIR (and its parents) if needed; dies with a clear message if it cannot be written to
// or if DIR/NAME would not fit an AtomicWriter for every NAME of up to OUTPUT_NAME_MAX bytes.
static inline void ensure_writable_dir(const char* dir, const char* flag) {
    char path[1024];
    if (dir[0] == '\0') { fatal("%s: expected an output directory, got an empty path", flag); }
    if (strlen(dir) + 1 + OUTPUT_NAME_MAX > ATOMIC_WRITER_PATH_MAX) {
        fatal("%s: output directory path is %zu bytes; files inside it need it to be at most %d",
              flag, strlen(dir), ATOMIC_WRITER_PATH_MAX - 1 - OUTPUT_NAME_MAX);
    }
    snprintf(path, sizeof(path), "%s", dir);
    for (char* p = path + 1; ; p++) {   // each prefix ending at a '/', then the whole path
        int end = *p == '\0';
        if (*p != '/' && !end) { continue; }
        *p = '\0';
        struct stat st;
        if (stat(path, &st) != 0) {
            if (mkdir(path, 0755) != 0) {
                fatal("%s: cannot create output directory '%s': %s", flag, path, strerror(errno));
            }
        } else if (!S_ISDIR(st.st_mode)) {
            fatal("%s: '%s' exists and is not a directory", flag, path);
        }
        if (end) { break; }
        *p = '/';
    }
    if (access(dir, W_OK | X_OK) != 0) {
        fatal("%s: output directory '%s' is not writable: %s", flag, dir, strerror(errno));
    }
}

static inline int file_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0;
}

#endif // LLMC_UTILS_H
