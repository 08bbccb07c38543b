/*
 * fuzz.h: what every libFuzzer target in dev/fuzz/ shares. Include it FIRST, then the llmc
 * headers under test.
 *
 * A parser rejects bad input with fatal() (llmc/utils.h), which exits. Here fatal's hook
 * longjmps back to the target instead: a clean one-line rejection is a pass; a crash, an
 * ASan or UBSan report, a malloc beyond libFuzzer's -malloc_limit_mb, or a leak is a failure.
 *
 * A rejected parse leaves behind what it had allocated and opened. So that thousands of
 * rejections per second neither leak nor run out of file descriptors, the parsers' malloc,
 * calloc, realloc, posix_memalign, free, fopen, fclose, glob and globfree are redirected (by
 * macros, in this translation unit only) to versions that remember what is live: after a
 * rejection fuzz_release_all() frees and closes all of it; after an accepted input and the
 * module's own free function, anything still live is a leak and aborts (libFuzzer reports it
 * with the input). This is why the system headers come before the macros and the llmc
 * headers after them: an llmc header that includes a new system header declaring one of
 * these names fails to compile here instead of being silently redirected.
 *
 * Inputs are files: a target writes its input to a private temporary directory, then calls
 * the parser on the path, like the trainer does. Formats made of several files (optimizer
 * state pieces, encoder.json + vocab.bpe + text) are one input split at FUZZ_FILE_SEPARATOR.
 */
#ifndef LLMC_FUZZ_H
#define LLMC_FUZZ_H

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "dev/fuzz/fuzz_input.h"

// --- what the parser under test has allocated and opened ------------------------------------

typedef enum { FUZZ_MEMORY, FUZZ_FILE, FUZZ_GLOB } FuzzResourceKind;

typedef struct {
    void* p;
    FuzzResourceKind kind;
} FuzzResource;

// A hash set of live resources (open addressing, linear probing; p == NULL: an empty slot):
// a tokenizer alone holds one allocation per token, tens of thousands.
static FuzzResource* fuzz_live;
static size_t fuzz_nlive, fuzz_live_cap;   // fuzz_live_cap: 0 or a power of two >= 2 * fuzz_nlive
// 0: the wrappers only pass calls through (a target whose parser state lives across inputs;
// LeakSanitizer then judges leaks, and fatal() must not happen at all).
static int fuzz_tracking = 1;

static size_t fuzz_home(const void* p) {
    uint64_t h = (uint64_t)(uintptr_t)p;   // splitmix64's finalizer: heap addresses share most bits
    h = (h ^ h >> 30) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ h >> 27) * 0x94D049BB133111EBull;
    return (size_t)(h ^ h >> 31) & (fuzz_live_cap - 1);
}

static void fuzz_place(FuzzResource r) {
    size_t i = fuzz_home(r.p);
    while (fuzz_live[i].p != NULL) { i = (i + 1) & (fuzz_live_cap - 1); }
    fuzz_live[i] = r;
}

static void fuzz_remember(void* p, FuzzResourceKind kind) {
    if (p == NULL || !fuzz_tracking) { return; }
    if (2 * (fuzz_nlive + 1) > fuzz_live_cap) {
        FuzzResource* old = fuzz_live;
        size_t old_cap = fuzz_live_cap;
        fuzz_live_cap = old_cap ? 2 * old_cap : 1024;
        fuzz_live = (FuzzResource*)calloc(fuzz_live_cap, sizeof(FuzzResource));
        if (fuzz_live == NULL) { abort(); }
        for (size_t i = 0; i < old_cap; i++) {
            if (old[i].p != NULL) { fuzz_place(old[i]); }
        }
        free(old);
    }
    FuzzResource r = {p, kind};
    fuzz_place(r);
    fuzz_nlive++;
}

// Forgets p. A pointer the parser releases that it never got from us is a bug in the harness:
// abort. The slots after p move back where their probe allows, so no search stops early.
static void fuzz_forget(void* p) {
    if (p == NULL || !fuzz_tracking) { return; }
    size_t mask = fuzz_live_cap - 1, i = fuzz_live_cap ? fuzz_home(p) : 0;
    while (fuzz_live_cap && fuzz_live[i].p != NULL && fuzz_live[i].p != p) { i = (i + 1) & mask; }
    if (fuzz_live_cap == 0 || fuzz_live[i].p == NULL) {
        fprintf(stderr, "fuzz harness: the parser released %p, which it never allocated or opened here\n", p);
        abort();
    }
    fuzz_nlive--;
    for (size_t j = i;;) {
        fuzz_live[i].p = NULL;
        for (;;) {
            j = (j + 1) & mask;
            if (fuzz_live[j].p == NULL) { return; }
            size_t home = fuzz_home(fuzz_live[j].p);
            int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) { break; }
        }
        fuzz_live[i] = fuzz_live[j];
        i = j;
    }
}

static void* fuzz_malloc(size_t n) { void* p = malloc(n); fuzz_remember(p, FUZZ_MEMORY); return p; }
static void* fuzz_calloc(size_t n, size_t size) { void* p = calloc(n, size); fuzz_remember(p, FUZZ_MEMORY); return p; }
static void fuzz_free(void* p) { fuzz_forget(p); free(p); }
static void* fuzz_realloc(void* old, size_t n) {
    void* p = realloc(old, n);
    if (p != NULL) { fuzz_forget(old); fuzz_remember(p, FUZZ_MEMORY); }
    return p;
}
static int fuzz_posix_memalign(void** out, size_t align, size_t n) {
    int rc = posix_memalign(out, align, n);
    if (rc == 0) { fuzz_remember(*out, FUZZ_MEMORY); }
    return rc;
}
static FILE* fuzz_fopen(const char* path, const char* mode) {
    FILE* f = fopen(path, mode);
    fuzz_remember(f, FUZZ_FILE);
    return f;
}
static int fuzz_fclose(FILE* f) { fuzz_forget(f); return fclose(f); }
static int fuzz_glob(const char* pattern, int flags, int (*err)(const char*, int), glob_t* g) {
    int rc = glob(pattern, flags, err, g);
    fuzz_remember(g, FUZZ_GLOB);   // glob_t needs globfree even when glob fails
    return rc;
}
static void fuzz_globfree(glob_t* g) { fuzz_forget(g); globfree(g); }

// After a rejection: frees and closes everything the aborted parse left.
static void fuzz_release_all(void) {
    for (size_t i = 0; i < fuzz_live_cap; i++) {
        void* p = fuzz_live[i].p;
        if (p == NULL) { continue; }
        switch (fuzz_live[i].kind) {
            case FUZZ_MEMORY: free(p); break;
            case FUZZ_FILE: fclose((FILE*)p); break;
            case FUZZ_GLOB: globfree((glob_t*)p); break;
        }
        fuzz_live[i].p = NULL;
    }
    fuzz_nlive = 0;
}

// After an accepted input has been freed by the module's own free function: nothing is live.
static void fuzz_expect_nothing_live(const char* after) {
    if (fuzz_nlive == 0) { return; }
    fprintf(stderr, "fuzz harness: leak: %zu allocation(s) or open file(s) still live after %s\n",
            fuzz_nlive, after);
    abort();
}

// --- fatal() returns to the target ------------------------------------------------------------

static jmp_buf fuzz_on_fatal;

static void fuzz_fatal_hook(int exit_code) {
    (void)exit_code;
    longjmp(fuzz_on_fatal, 1);
}

// Starts one input: a fatal() from here on comes back as a return of 0 from the target (a
// rejection: everything released). Locals are not read after the jump, so none need volatile.
#define FUZZ_BEGIN()                                 \
    do {                                             \
        llmc_fatal_hook = fuzz_fatal_hook;           \
        if (setjmp(fuzz_on_fatal) != 0) {            \
            fuzz_release_all();                      \
            return 0;                                \
        }                                            \
    } while (0)

// --- the input as files -------------------------------------------------------------------

static char fuzz_dir[64];   // this process's temporary directory

static void fuzz_remove_dir(void) {
    DIR* d = opendir(fuzz_dir);
    if (d == NULL) { return; }
    struct dirent* e;
    char path[512];
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') { continue; }
        snprintf(path, sizeof(path), "%s/%s", fuzz_dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(fuzz_dir);
}

// The directory the target's files go to; made on first use, removed at exit.
static const char* fuzz_workdir(void) {
    if (fuzz_dir[0] == '\0') {
        snprintf(fuzz_dir, sizeof(fuzz_dir), "/tmp/llmc_fuzz.XXXXXX");
        if (mkdtemp(fuzz_dir) == NULL) { perror("fuzz harness: mkdtemp"); abort(); }
        atexit(fuzz_remove_dir);
    }
    return fuzz_dir;
}

// Writes bytes to fuzz_workdir()/name (replacing it) and returns the path (static storage,
// one per slot so several files can be live at once).
static const char* fuzz_write_file(int slot, const char* name, const uint8_t* data, size_t size) {
    static char paths[FUZZ_MAX_FILES + 1][256];
    char* path = paths[slot];
    snprintf(path, sizeof(paths[slot]), "%s/%s", fuzz_workdir(), name);
    FILE* f = fopen(path, "wb");
    if (f == NULL || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        perror("fuzz harness: writing the input file");
        abort();
    }
    return path;
}

static void fuzz_remove_file(const char* name) {
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", fuzz_workdir(), name);
    unlink(path);
}

typedef struct {
    const uint8_t* data[FUZZ_MAX_FILES];
    size_t size[FUZZ_MAX_FILES];
    int n;
} FuzzFiles;

// Splits an input at FUZZ_FILE_SEPARATOR into at most FUZZ_MAX_FILES files (the last one
// keeps any further separators).
static FuzzFiles fuzz_split(const uint8_t* data, size_t size) {
    FuzzFiles files;
    memset(&files, 0, sizeof(files));
    size_t sep = strlen(FUZZ_FILE_SEPARATOR);
    while (files.n < FUZZ_MAX_FILES - 1) {
        const uint8_t* at = (const uint8_t*)memmem(data, size, FUZZ_FILE_SEPARATOR, sep);
        if (at == NULL) { break; }
        files.data[files.n] = data;
        files.size[files.n++] = (size_t)(at - data);
        size -= (size_t)(at - data) + sep;
        data = at + sep;
    }
    files.data[files.n] = data;
    files.size[files.n++] = size;
    return files;
}

// --- the parsers' calls, redirected -----------------------------------------------------------
#define malloc(n) fuzz_malloc(n)
#define calloc(n, size) fuzz_calloc(n, size)
#define realloc(p, n) fuzz_realloc(p, n)
#define free(p) fuzz_free(p)
#define posix_memalign(out, align, n) fuzz_posix_memalign(out, align, n)
#define fopen(path, mode) fuzz_fopen(path, mode)
#define fclose(f) fuzz_fclose(f)
#define glob(pattern, flags, err, g) fuzz_glob(pattern, flags, err, g)
#define globfree(g) fuzz_globfree(g)

#endif // LLMC_FUZZ_H
