/*
 * cuda_emu.cpp: the emulated GPU behind dev/gpu/emu/cuda_runtime.h (read its header comment
 * first). Three parts:
 *   1. device memory: one arena, PROT_NONE whenever the emulated device is not the one
 *      touching it, fresh allocations poisoned with 0xFF bytes;
 *   2. kernels: blocks in a shuffled order, a block's threads as fibers switched at barriers;
 *   3. the race check: handlers for the memory-access hooks that gcc's
 *      -fsanitize=kernel-address instrumentation calls (--param
 *      asan-instrumentation-with-call-threshold=0), active only in the build that is compiled
 *      with them (emu_race.mk) and only inside kernels.
 * This file itself is never instrumented.
 */
#include "cuda_runtime.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <execinfo.h>
#include <atomic>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

thread_local EmuThreadState* emu_current = NULL;

// The trainer points this at its fatal() (one line, MPI_Abort across ranks); until then an
// error prints and exits.
void (*emu_fatal_hook)(const char* message) = NULL;

__attribute__((format(printf, 1, 2), noreturn)) static void emu_fail(const char* fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (emu_fatal_hook) { emu_fatal_hook(msg); }
    fprintf(stderr, "error: %s\n", msg);
    exit(1);
}

// cudaGetErrorString's text for cudaErrorInvalidValue: CUDA's, unless the last such error was a
// launch the GPU refuses, whose reason it then adds (set_last_error)
static char last_error_detail[400] = "invalid argument";
static cudaError_t invalid_argument(void) {
    strcpy(last_error_detail, "invalid argument");
    return cudaErrorInvalidValue;
}

static long env_long(const char* name, long fallback) {
    const char* v = getenv(name);
    return v && *v ? strtol(v, NULL, 10) : fallback;
}

// ==========================================================================================
// 1. device memory
// ==========================================================================================

struct EmuAllocation {
    size_t offset, bytes;
    const char* what;   // a name for messages (emu_label), or NULL
    bool in_use;
};

static char* arena = NULL;
static size_t arena_capacity = 0;     // reserved
static size_t arena_top = 0;          // bytes handed out at least once (page rounded when mapped)
static size_t arena_mapped = 0;       // bytes currently readable/writable while open
static int arena_open_depth = 0;
static std::vector<EmuAllocation> allocations;   // by offset

static size_t page_round(size_t n) { size_t p = 4096; return (n + p - 1) / p * p; }

static const EmuAllocation* allocation_at(const void* p) {
    size_t off = (size_t)((const char*)p - arena);
    for (const EmuAllocation& a : allocations) {
        if (off >= a.offset && off < a.offset + (a.bytes ? a.bytes : 1)) { return &a; }
    }
    return NULL;
}

static bool runner_guard_hit(const char* p);

// A host access of device memory: on a GPU the pointer is not the host's (a crash, or
// garbage). Name the allocation and where the host code was.
static void emu_segv(int sig, siginfo_t* info, void* ctx) {
    (void)ctx;
    const char* p = (const char*)info->si_addr;
    if (arena && p >= arena && p < arena + arena_capacity) {
        const EmuAllocation* a = allocation_at(p);
        char msg[512];
        int n = snprintf(msg, sizeof(msg),
                         "error: emulated GPU: host code touched device memory at %p (%s, byte %zu): on a GPU "
                         "this is an illegal access; copy it with cudaMemcpy (memory.h MemOps) instead. "
                         "Host stack:\n", (const void*)p, a && a->what ? a->what : "an allocation",
                         a ? (size_t)(p - arena - a->offset) : (size_t)0);
        if (write(2, msg, (size_t)n) < 0) { _exit(1); }
        void* frames[32];
        int depth = backtrace(frames, 32);
        backtrace_symbols_fd(frames, depth, 2);
        _exit(1);
    }
    if (runner_guard_hit(p)) {
        static const char msg[] = "error: emulated GPU: a kernel accessed past the end of its dynamic shared memory "
                                  "(the launch's byte count)\n";
        if (write(2, msg, sizeof(msg) - 1) < 0) { _exit(1); }
        _exit(1);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void arena_init(void) {
    if (arena) { return; }
    arena_capacity = (size_t)env_long("LLMC_EMU_MEMORY_GIB", 16) << 30;
    void* p = mmap(NULL, arena_capacity, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { emu_fail("emulated GPU: cannot reserve %zu bytes of address space", arena_capacity); }
    arena = (char*)p;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = emu_segv;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGSEGV, &sa, NULL);
}

// The arena is readable and writable only between emu_open and emu_close (kernels, copies).
static void emu_open(void) {
    if (arena_open_depth++ == 0 && arena_top > 0) {
        arena_mapped = page_round(arena_top);
        if (mprotect(arena, arena_mapped, PROT_READ | PROT_WRITE) != 0) {
            emu_fail("emulated GPU: mprotect failed (%s)", strerror(errno));
        }
    }
}
static void emu_close(void) {
    if (--arena_open_depth == 0 && arena_mapped > 0) {
        mprotect(arena, arena_mapped, PROT_NONE);
        arena_mapped = 0;
    }
}

int emu_is_device_pointer(const void* p) {
    return arena && (const char*)p >= arena && (const char*)p < arena + arena_capacity;
}

void emu_label(const void* p, const char* what) {
    for (EmuAllocation& a : allocations) {
        if (arena + a.offset == (const char*)p) { a.what = what; return; }
    }
}

static void poison(size_t offset, size_t bytes) {
    emu_open();
    memset(arena + offset, 0xFF, bytes);
    emu_close();
}

cudaError_t cudaMalloc(void** out, size_t bytes) {
    arena_init();
    size_t need = (bytes + 255) / 256 * 256;
    if (need == 0) { need = 256; }
    // first fit among freed allocations, else the top of the arena
    for (EmuAllocation& a : allocations) {
        if (!a.in_use && a.bytes >= need) {
            if (a.bytes > need) {   // split: the rest stays free
                EmuAllocation rest = {a.offset + need, a.bytes - need, NULL, false};
                a.bytes = need;
                a.in_use = true;
                a.what = NULL;
                size_t off = a.offset;
                allocations.insert(allocations.begin() + (&a - &allocations[0]) + 1, rest);
                *out = arena + off;
                poison(off, need);
                return cudaSuccess;
            }
            a.in_use = true;
            a.what = NULL;
            *out = arena + a.offset;
            poison(a.offset, need);
            return cudaSuccess;
        }
    }
    if (arena_top + need > arena_capacity) { *out = NULL; return cudaErrorMemoryAllocation; }
    EmuAllocation a = {arena_top, need, NULL, true};
    allocations.push_back(a);
    arena_top += need;
    *out = arena + a.offset;
    poison(a.offset, need);
    return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
    if (p == NULL) { return cudaSuccess; }
    for (size_t i = 0; i < allocations.size(); i++) {
        EmuAllocation& a = allocations[i];
        if (arena + a.offset == (char*)p && a.in_use) {
            a.in_use = false;
            poison(a.offset, a.bytes);   // a use after free reads NaNs
            // merge with free neighbours
            if (i + 1 < allocations.size() && !allocations[i + 1].in_use) {
                a.bytes += allocations[i + 1].bytes;
                allocations.erase(allocations.begin() + i + 1);
            }
            if (i > 0 && !allocations[i - 1].in_use) {
                allocations[i - 1].bytes += allocations[i].bytes;
                allocations.erase(allocations.begin() + i);
            }
            return cudaSuccess;
        }
    }
    return invalid_argument();
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
    *p = malloc(bytes ? bytes : 1);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* p) { free(p); return cudaSuccess; }

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    (void)kind;
    emu_open();
    memmove(dst, src, bytes);
    emu_close();
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
    (void)s;
    return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
    emu_open();
    memset(p, value, bytes);
    emu_close();
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) { (void)s; return cudaMemset(p, value, bytes); }

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    arena_init();
    size_t used = 0;
    for (const EmuAllocation& a : allocations) { if (a.in_use) { used += a.bytes; } }
    *free_bytes = arena_capacity - used;
    *total_bytes = arena_capacity;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) { *count = 1; return cudaSuccess; }
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : invalid_argument(); }
cudaError_t cudaGetDevice(int* device) { *device = 0; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    (void)device;
    arena_init();
    memset(prop, 0, sizeof(*prop));
    snprintf(prop->name, sizeof(prop->name), "emulated GPU (CPU, dev/gpu/emu)");
    prop->major = 8;
    prop->minor = 0;
#ifdef _OPENMP
    prop->multiProcessorCount = omp_get_max_threads();
#else
    prop->multiProcessorCount = 1;
#endif
    prop->totalGlobalMem = arena_capacity;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }

// A launch the GPU refuses (its configuration) is reported by the next cudaGetLastError, as
// on the GPU; the message says why, where CUDA's string would say only "invalid argument".
static cudaError_t last_error = cudaSuccess;
cudaError_t cudaGetLastError(void) {
    cudaError_t err = last_error;
    last_error = cudaSuccess;
    return err;
}
const char* cudaGetErrorString(cudaError_t err) {
    switch (err) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return last_error_detail;
        case cudaErrorNotReady: return "device not ready";
        case cudaErrorMemoryAllocation: return "out of memory (the emulated device's arena: LLMC_EMU_MEMORY_GIB)";
        case cudaErrorNoDevice: return "no CUDA-capable device is detected";
        default: return "unknown error";
    }
}

// Streams and events: the emulated device runs everything at once, in order.
struct EmuStream { int unused; };
struct EmuEvent { double seconds; };
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { *s = new EmuStream(); return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) { (void)flags; return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s) { delete s; return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return cudaSuccess; }
cudaError_t cudaEventCreate(cudaEvent_t* e) { *e = new EmuEvent(); (*e)->seconds = 0; return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) { (void)flags; return cudaEventCreate(e); }
cudaError_t cudaEventQuery(cudaEvent_t e) { (void)e; return cudaSuccess; }   // all work is done when a call returns
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)s; e->seconds = now_s(); return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) { (void)s; (void)e; (void)flags; return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    *ms = (float)((end->seconds - start->seconds) * 1e3);
    return cudaSuccess;
}

// Dynamic shared memory limits of an H100 (sm_90): 48 KiB per block unless the kernel's
// cudaFuncAttributeMaxDynamicSharedMemorySize allows more, at most 227 KiB.
#define EMU_SHARED_DEFAULT_BYTES (48u << 10)
#define EMU_SHARED_OPTIN_BYTES (227u << 10)
struct KernelAttributes { const void* kernel; int max_dynamic_shared; };
static std::vector<KernelAttributes> kernel_attributes;

static void set_last_error(cudaError_t err, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_last_error(cudaError_t err, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(last_error_detail, sizeof(last_error_detail), "invalid argument (emulated GPU: ");
    vsnprintf(last_error_detail + n, sizeof(last_error_detail) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    strcat(last_error_detail, ")");
    last_error = err;
}

cudaError_t emu_func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > (int)EMU_SHARED_OPTIN_BYTES) {
        set_last_error(cudaErrorInvalidValue, "cudaFuncSetAttribute(%d, %d): the dynamic shared memory limit is "
                       "0 to %u bytes", (int)attr, value, EMU_SHARED_OPTIN_BYTES);
        return cudaErrorInvalidValue;
    }
    for (KernelAttributes& k : kernel_attributes) {
        if (k.kernel == kernel) { k.max_dynamic_shared = value; return cudaSuccess; }
    }
    kernel_attributes.push_back({kernel, value});
    return cudaSuccess;
}

static size_t dynamic_shared_allowed(const void* kernel) {
    for (const KernelAttributes& k : kernel_attributes) {
        if (k.kernel == kernel && (size_t)k.max_dynamic_shared > EMU_SHARED_DEFAULT_BYTES) {
            return (size_t)k.max_dynamic_shared;
        }
    }
    return EMU_SHARED_DEFAULT_BYTES;
}

// ==========================================================================================
// 2. kernels: blocks and fibers
// ==========================================================================================

enum FiberState { FIBER_RUNNABLE, FIBER_AT_BARRIER, FIBER_AT_WARP_BARRIER, FIBER_EXITED };

// one cp.async of 16 bytes that a thread issued and has not waited for
struct CpAsync {
    void* dst;
    const void* src;   // NULL: zero-fill
    unsigned group;    // the commit group it belongs to
};
#define EMU_CP_ASYNC_MAX 64

struct Fiber {
    void* sp;                 // saved stack pointer while switched out
#if !defined(__x86_64__)
    ucontext_t ctx;
#endif
    char* stack;              // its stack, and its size
    size_t stack_bytes;
    EmuThreadState st;
    FiberState state;
    unsigned warp_mask;       // the mask of the warp barrier it waits at
    int linear, lane, warp;
    CpAsync cp_async[EMU_CP_ASYNC_MAX];
    int cp_async_pending;
    unsigned cp_async_groups;   // commit groups closed so far
};

#define EMU_MAX_THREADS 1024
#define EMU_STACK_BYTES (256u << 10)

// What one OS thread needs to run blocks: fibers with their stacks (kept across launches),
// the scheduler's context, and the running block's state.
struct BlockRunner {
    Fiber fibers[EMU_MAX_THREADS];
    int stacks_made;
    void* scheduler_sp;
#if !defined(__x86_64__)
    ucontext_t scheduler_ctx;
#endif
    Fiber* current;
    int nthreads;
    void (*body)(void*);
    void* closure;
    uint64_t warp_slots[EMU_MAX_THREADS / 32][32];
    uint64_t warp_exchange_slots[EMU_MAX_THREADS / 32][32][4];
    unsigned char* dynamic_shared;                // this launch's buffer: its last byte ends at
    size_t dynamic_shared_bytes;                  // dynamic_guard, a page that faults
    unsigned char* dynamic_guard;
    unsigned char* dynamic_region;                // the mapping (buffer pages and the guard)
    size_t dynamic_region_bytes;
    unsigned block_epoch;                         // __syncthreads completed by the block
    unsigned warp_epoch[EMU_MAX_THREADS / 32];    // warp barriers completed by each warp
    unsigned block_linear;
    int order[EMU_MAX_THREADS];
    uint64_t rng;
    char error[512];                              // the first error of this runner's blocks
};
static thread_local BlockRunner* runner = NULL;

static bool runner_guard_hit(const char* p) {
    return runner && runner->dynamic_guard && p >= (const char*)runner->dynamic_guard &&
           p < (const char*)runner->dynamic_guard + 4096;
}

// The buffer ends where the guard page begins, so an access past the launch's size faults.
static void dynamic_shared_prepare(BlockRunner* r, size_t bytes) {
    size_t need = page_round(bytes ? bytes : 1) + 4096;
    if (need > r->dynamic_region_bytes) {
        if (r->dynamic_region) { munmap(r->dynamic_region, r->dynamic_region_bytes); }
        void* p = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) { emu_fail("emulated GPU: cannot allocate dynamic shared memory"); }
        r->dynamic_region = (unsigned char*)p;
        r->dynamic_region_bytes = need;
        r->dynamic_guard = r->dynamic_region + need - 4096;
        mprotect(r->dynamic_guard, 4096, PROT_NONE);
    }
    r->dynamic_shared_bytes = (bytes + 15) / 16 * 16;
    r->dynamic_shared = r->dynamic_guard - r->dynamic_shared_bytes;
}

unsigned char* emu_dynamic_shared(void) { return runner->dynamic_shared; }

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save,
// switches to `load` and restores the registers saved there (System V x86-64).
extern "C" void emu_switch(void** save, void* load);
__asm__(
    ".text\n"
    ".globl emu_switch\n"
    ".type emu_switch,@function\n"
    "emu_switch:\n"
    "    pushq %rbp\n    pushq %rbx\n    pushq %r12\n    pushq %r13\n    pushq %r14\n    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n    popq %r14\n    popq %r13\n    popq %r12\n    popq %rbx\n    popq %rbp\n"
    "    ret\n"
    ".size emu_switch, .-emu_switch\n");
#endif

static void to_scheduler(void) {
    Fiber* f = runner->current;
#if defined(__x86_64__)
    emu_switch(&f->sp, runner->scheduler_sp);
#else
    swapcontext(&f->ctx, &runner->scheduler_ctx);
#endif
}

static void fiber_main(void) {
    BlockRunner* r = runner;
    r->body(r->closure);
    r->current->state = FIBER_EXITED;
    to_scheduler();
    // never resumed
}

#if defined(__x86_64__)
extern "C" void emu_fiber_entry(void);
extern "C" void emu_fiber_entry(void) {
    fiber_main();
    abort();
}
#endif

static void fiber_start(BlockRunner* r, Fiber* f) {
    if (f->stack == NULL) {
        f->stack_bytes = EMU_STACK_BYTES;
        void* p = mmap(NULL, f->stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) { emu_fail("emulated GPU: cannot allocate a fiber stack"); }
        mprotect(p, 4096, PROT_NONE);   // a guard page below the stack
        f->stack = (char*)p;
    }
#if defined(__x86_64__)
    // the first switch pops six registers, then returns into emu_fiber_entry with the stack
    // aligned as after a call
    uintptr_t top = ((uintptr_t)(f->stack + f->stack_bytes)) & ~(uintptr_t)15;
    void** sp = (void**)(top - 16);
    sp[0] = (void*)emu_fiber_entry;
    sp -= 6;
    for (int i = 0; i < 6; i++) { sp[i] = NULL; }
    f->sp = sp;
#else
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack + 4096;
    f->ctx.uc_stack.ss_size = f->stack_bytes - 4096;
    f->ctx.uc_link = NULL;
    makecontext(&f->ctx, fiber_main, 0);
#endif
    (void)r;
}

static void fiber_resume(BlockRunner* r, Fiber* f) {
    r->current = f;
    emu_current = &f->st;
#if defined(__x86_64__)
    emu_switch(&r->scheduler_sp, f->sp);
#else
    swapcontext(&r->scheduler_ctx, &f->ctx);
#endif
    emu_current = NULL;
}

static uint64_t splitmix(uint64_t* s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static long emu_seed = 1;
static void shuffle(int* v, int n, uint64_t* rng) {
    if (emu_seed == 0) { return; }
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(splitmix(rng) % (uint64_t)(i + 1));
        int t = v[i]; v[i] = v[j]; v[j] = t;
    }
}

static const char* current_kernel = "";

__attribute__((format(printf, 2, 3))) static void block_error(BlockRunner* r, const char* fmt, ...) {
    if (r->error[0]) { return; }
    va_list ap;
    va_start(ap, fmt);
    char what[400];
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    Fiber* f0 = &r->fibers[0];
    snprintf(r->error, sizeof(r->error), "emulated GPU: kernel %s, block (%u,%u,%u): %s", current_kernel,
             f0->st.block_idx.x, f0->st.block_idx.y, f0->st.block_idx.z, what);
}

void emu_syncthreads(void) {
    runner->current->state = FIBER_AT_BARRIER;
    to_scheduler();
}

static void warp_barrier(unsigned mask) {
    Fiber* f = runner->current;
    if (!(mask >> f->lane & 1u)) {
        block_error(runner, "thread %d calls a warp barrier or shuffle with mask %08x that leaves out its own lane %d",
                    f->linear, mask, f->lane);
    }
    f->state = FIBER_AT_WARP_BARRIER;
    f->warp_mask = mask;
    to_scheduler();
}

void emu_syncwarp(unsigned mask) { warp_barrier(mask); }

void emu_warp_exchange(const void* mine, size_t bytes, void* all) {
    BlockRunner* r = runner;
    Fiber* f = r->current;
    if (bytes > sizeof(r->warp_exchange_slots[0][0])) { emu_fail("emulated GPU: a warp exchange of %zu bytes", bytes); }
    memcpy(r->warp_exchange_slots[f->warp][f->lane], mine, bytes);
    warp_barrier(0xffffffffu);
    for (int l = 0; l < 32; l++) { memcpy((char*)all + l * bytes, r->warp_exchange_slots[f->warp][l], bytes); }
    warp_barrier(0xffffffffu);   // every lane has read before the slots are written again
}

void emu_cp_async_push(void* dst, const void* src) {
    Fiber* f = runner->current;
    if (f->cp_async_pending == EMU_CP_ASYNC_MAX) {
        block_error(runner, "thread %d has more than %d cp.async in flight (the emulator's queue)", f->linear,
                    EMU_CP_ASYNC_MAX);
        return;
    }
    f->cp_async[f->cp_async_pending++] = {dst, src, f->cp_async_groups};
}
void emu_cp_async_commit(void) { runner->current->cp_async_groups++; }
int emu_cp_async_pop_done(unsigned newest_pending, void** dst, const void** src) {
    Fiber* f = runner->current;
    unsigned done_below = f->cp_async_groups >= newest_pending ? f->cp_async_groups - newest_pending : 0;
    if (f->cp_async_pending == 0 || f->cp_async[0].group >= done_below) { return 0; }   // groups complete in order
    *dst = f->cp_async[0].dst;
    *src = f->cp_async[0].src;
    memmove(&f->cp_async[0], &f->cp_async[1], (size_t)(--f->cp_async_pending) * sizeof(CpAsync));
    return 1;
}

void emu_kernel_error(const char* fmt, ...) {
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    block_error(runner, "thread %d: %s", runner->current->linear, what);
}
unsigned emu_lane(void) { return (unsigned)runner->current->lane; }

uint64_t emu_shuffle(unsigned mask, uint64_t mine, int src) {
    BlockRunner* r = runner;
    Fiber* f = r->current;
    r->warp_slots[f->warp][f->lane] = mine;
    warp_barrier(mask);
    uint64_t v = mine;
    if (src >= 0 && src < 32 && src != f->lane) {
        if (!(mask >> src & 1u)) {
            block_error(r, "thread %d shuffles from lane %d, which is not in the mask %08x", f->linear, src, mask);
        } else {
            v = r->warp_slots[f->warp][src];
        }
    }
    warp_barrier(mask);   // every lane has read before the slots are written again
    return v;
}

unsigned long long emu_atomic_add_u64(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
int emu_atomic_add_i32(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

// Releases the warp barriers every lane of whose mask has reached; returns how many fibers
// it released. A lane of a mask that exited, does not exist, waits at __syncthreads instead
// or at a barrier with another mask is an error (a hang or undefined behaviour on a GPU).
static int release_warp_barriers(BlockRunner* r) {
    int released = 0, n = r->nthreads;
    for (int w = 0; w * 32 < n; w++) {
        Fiber* first = NULL;
        for (int l = 0; l < 32 && w * 32 + l < n; l++) {
            Fiber* f = &r->fibers[w * 32 + l];
            if (f->state == FIBER_AT_WARP_BARRIER) { first = f; break; }
        }
        if (!first) { continue; }
        unsigned mask = first->warp_mask;
        int ready = 1;
        for (int l = 0; l < 32; l++) {
            if (!(mask >> l & 1u)) { continue; }
            int t = w * 32 + l;
            if (t >= n) {
                block_error(r, "a warp barrier or shuffle with mask %08x names lane %d, which does not exist "
                            "(the block has %d threads)", mask, l, n);
                return 0;
            }
            Fiber* f = &r->fibers[t];
            if (f->state == FIBER_EXITED) {
                block_error(r, "thread %d exited while lanes of its warp wait for it at a warp barrier or shuffle "
                            "(mask %08x)", t, mask);
                return 0;
            }
            if (f->state == FIBER_AT_BARRIER) {
                block_error(r, "thread %d waits at __syncthreads while lanes of its warp wait for it at a warp "
                            "barrier (mask %08x): divergent barriers", t, mask);
                return 0;
            }
            if (f->state != FIBER_AT_WARP_BARRIER || f->warp_mask != mask) { ready = 0; }
        }
        if (!ready) { continue; }
        for (int l = 0; l < 32; l++) {
            if (mask >> l & 1u) { r->fibers[w * 32 + l].state = FIBER_RUNNABLE; released++; }
        }
        r->warp_epoch[w]++;
    }
    return released;
}

static void run_block(BlockRunner* r, dim3 grid, dim3 block, dim3 bidx) {
    int n = r->nthreads;
    r->block_epoch = 0;
    r->block_linear = bidx.x + grid.x * (bidx.y + grid.y * bidx.z);
    memset(r->warp_epoch, 0, sizeof(r->warp_epoch));
    for (int i = 0; i < n; i++) {
        Fiber* f = &r->fibers[i];
        f->linear = i;
        f->lane = i % 32;
        f->warp = i / 32;
        f->st.thread_idx = dim3((unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / (block.x * block.y)));
        f->st.block_idx = bidx;
        f->st.block_dim = block;
        f->st.grid_dim = grid;
        f->cp_async_pending = 0;
        f->cp_async_groups = 0;
        f->state = FIBER_RUNNABLE;
        fiber_start(r, f);
        r->order[i] = i;
    }
    memset(r->dynamic_shared, 0xFF, r->dynamic_shared_bytes);   // NaN until the block writes it
    while (!r->error[0]) {
        shuffle(r->order, n, &r->rng);
        for (int k = 0; k < n && !r->error[0]; k++) {
            Fiber* f = &r->fibers[r->order[k]];
            if (f->state == FIBER_RUNNABLE) { fiber_resume(r, f); }
        }
        if (r->error[0]) { break; }
        if (release_warp_barriers(r) > 0) { continue; }
        int at_barrier = 0, exited = 0;
        for (int i = 0; i < n; i++) {
            at_barrier += r->fibers[i].state == FIBER_AT_BARRIER;
            exited += r->fibers[i].state == FIBER_EXITED;
        }
        if (exited == n) { break; }
        if (at_barrier + exited == n) {
            if (exited > 0) {
                block_error(r, "%d of %d threads exited while the others wait at __syncthreads (a barrier "
                            "in divergent code)", exited, n);
                break;
            }
            for (int i = 0; i < n; i++) { r->fibers[i].state = FIBER_RUNNABLE; }
            r->block_epoch++;
            continue;
        }
        block_error(r, "the block is stuck: some threads wait at warp barriers that cannot complete");
    }
}

static unsigned long long launches = 0;
static int race_check_on(void);
static void race_launch_begin(void);
static void race_launch_end(const char* kernel);

void emu_run_kernel(const char* name, const void* kernel, dim3 grid, dim3 block, size_t dynamic_shared,
                    void (*body)(void*), void* closure) {
    emu_seed = env_long("LLMC_EMU_SEED", 1);
    long nthreads_block = (long)block.x * block.y * block.z;
    if (nthreads_block < 1 || nthreads_block > EMU_MAX_THREADS || block.z > 64) {
        emu_fail("emulated GPU: kernel %s launched with %u x %u x %u threads per block (1 to 1024, z <= 64)", name,
                 block.x, block.y, block.z);
    }
    if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
        emu_fail("emulated GPU: kernel %s launched with a grid of %u x %u x %u blocks (CUDA's limits: 2^31-1 x "
                 "65535 x 65535)", name, grid.x, grid.y, grid.z);
    }
    if (dynamic_shared > dynamic_shared_allowed(kernel)) {   // the GPU does not launch it
        set_last_error(cudaErrorInvalidValue, "kernel %s launched with %zu bytes of dynamic shared memory; above %u "
                       "it needs cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize), an H100 allows "
                       "at most %u", name, dynamic_shared, EMU_SHARED_DEFAULT_BYTES, EMU_SHARED_OPTIN_BYTES);
        return;
    }
    launches++;
    current_kernel = name;
    long nblocks = (long)grid.x * grid.y * grid.z;
    std::vector<long> order((size_t)nblocks);
    for (long i = 0; i < nblocks; i++) { order[(size_t)i] = i; }
    uint64_t rng = (uint64_t)emu_seed * 0x9E3779B97F4A7C15ull + launches;
    if (emu_seed != 0) {
        for (long i = nblocks - 1; i > 0; i--) {
            long j = (long)(splitmix(&rng) % (uint64_t)(i + 1));
            long t = order[(size_t)i]; order[(size_t)i] = order[(size_t)j]; order[(size_t)j] = t;
        }
    }
    int workers = 1;
#ifdef _OPENMP
    workers = (int)env_long("LLMC_EMU_THREADS", omp_get_max_threads());
#endif
    if (race_check_on()) { workers = 1; }   // the race check's shadow memory is not shared
    if (workers < 1) { workers = 1; }
    char first_error[512] = "";
    emu_open();
    race_launch_begin();
    #pragma omp parallel num_threads(workers)
    {
        if (runner == NULL) { runner = new BlockRunner(); }   // value-initialised: no stacks yet
        BlockRunner* r = runner;
        r->nthreads = (int)nthreads_block;
        r->body = body;
        r->closure = closure;
        r->error[0] = '\0';
        dynamic_shared_prepare(r, dynamic_shared);
        #pragma omp for schedule(dynamic, 1)
        for (long k = 0; k < nblocks; k++) {
            if (r->error[0]) { continue; }
            long b = order[(size_t)k];
            dim3 bidx((unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / ((long)grid.x * grid.y)));
            r->rng = rng ^ (uint64_t)(b + 1) * 0xD1B54A32D192ED03ull;
            run_block(r, grid, block, bidx);
        }
        if (r->error[0]) {
            #pragma omp critical
            if (!first_error[0]) { memcpy(first_error, r->error, sizeof(first_error)); }
        }
    }
    race_launch_end(name);
    emu_close();
    if (first_error[0]) { emu_fail("%s", first_error); }
}

// ==========================================================================================
// 3. the race check
// ==========================================================================================
//
// The instrumented build reports every load and store of its code here. Inside a kernel, an
// access to anything but the thread's own stack (device memory, __shared__ variables) is
// checked against the last write of each 2-byte half of the 4-byte words it touches (bf16
// values of neighbouring threads share a word but not a half) in this launch:
//   written by another block                         -> a race (blocks are not ordered), except
//                                                       a write of __shared__ memory: the new
//                                                       block's own copy begins
//   written by another thread of the block in the same barrier epoch, unless both are lanes
//   of one warp and a warp barrier of that warp came in between  -> a race
// Stores record (launch, block, thread, block epoch, warp epoch). The table is reset by
// stamping entries with the launch number. Reads of another thread's write that an
// atomic made (atomics bypass the hooks) are not tracked.

struct ShadowWriter {
    uint32_t block, block_epoch, warp_epoch;
    uint16_t thread;          // NO_WRITER: not written in this launch
};
struct ShadowWord {
    uintptr_t word;           // address / 4; 0: empty
    uint32_t launch;
    ShadowWriter half[2];     // the last writer of bytes 0-1 and 2-3
};
#define NO_WRITER 0xFFFFu

static ShadowWord* shadow = NULL;
static size_t shadow_mask = 0;
static uint32_t shadow_launch = 0;
static bool race_enabled = false;
static bool race_reported = false;
static char race_message[512];
static unsigned long long race_count = 0;

// Compiled with -DLLMC_EMU_RACE_CHECK=1 for the build whose kernels are instrumented.
#ifndef LLMC_EMU_RACE_CHECK
#define LLMC_EMU_RACE_CHECK 0
#endif
static int race_check_on(void) { return LLMC_EMU_RACE_CHECK; }

static void race_launch_begin(void) {
    if (!race_check_on()) { return; }
    if (shadow == NULL) {
        size_t n = (size_t)1 << 24;
        shadow = (ShadowWord*)calloc(n, sizeof(ShadowWord));
        if (!shadow) { emu_fail("emulated GPU: no memory for the race check's shadow table"); }
        shadow_mask = n - 1;
    }
    shadow_launch++;
    race_enabled = true;
    race_count = 0;
    race_reported = false;
}

static void race_launch_end(const char* kernel) {
    if (!race_check_on()) { return; }
    race_enabled = false;
    if (race_count > 0) {
        emu_fail("emulated GPU: data race in kernel %s: %s (%llu racing accesses in this launch)", kernel,
                 race_message, race_count);
    }
}

static ShadowWord* shadow_slot(uintptr_t word, bool insert) {
    size_t h = (size_t)(word * 0x9E3779B97F4A7C15ull >> 20) & shadow_mask;
    for (size_t probe = 0; probe <= shadow_mask; probe++) {
        ShadowWord* s = &shadow[(h + probe) & shadow_mask];
        if (s->word == word && s->launch == shadow_launch) { return s; }
        if (s->word == 0 || s->launch != shadow_launch) {   // empty, or stale: this launch's key is not further on
            if (!insert) { return NULL; }
            s->word = word;
            s->launch = shadow_launch;
            s->half[0].thread = s->half[1].thread = NO_WRITER;
            return s;
        }
    }
    emu_fail("emulated GPU: the race check's shadow table is full (a kernel writes more than 16M words)");
}

static void race_report(const Fiber* f, const ShadowWriter* s, uintptr_t addr, bool is_write) {
    race_count++;
    if (race_reported) { return; }
    race_reported = true;
    BlockRunner* r = runner;
    const char* where = emu_is_device_pointer((void*)addr) ? "device memory" : "__shared__ memory";
    if (s->block != r->block_linear) {
        snprintf(race_message, sizeof(race_message),
                 "thread %d of block %u %s the word at %p (%s) that block %u wrote in the same launch",
                 f->linear, r->block_linear, is_write ? "writes" : "reads", (void*)addr, where, s->block);
    } else {
        snprintf(race_message, sizeof(race_message),
                 "block %u: thread %d %s the word at %p (%s) that thread %u wrote with no barrier in between",
                 r->block_linear, f->linear, is_write ? "writes" : "reads", (void*)addr, where, s->thread);
    }
}

static void race_access(uintptr_t addr, size_t bytes, bool is_write) {
    if (!race_enabled || emu_current == NULL || runner == NULL) { return; }
    const Fiber* f = runner->current;
    if (addr >= (uintptr_t)f->stack && addr < (uintptr_t)f->stack + f->stack_bytes) { return; }   // its own stack
    BlockRunner* r = runner;
    uintptr_t end = addr + (bytes ? bytes : 1);
    for (uintptr_t w = addr >> 2; w <= (end - 1) >> 2; w++) {
        ShadowWord* word = shadow_slot(w, is_write);
        if (!word) { continue; }
        for (int h = 0; h < 2; h++) {
            uintptr_t half_start = (w << 2) + 2 * (uintptr_t)h;
            if (half_start + 2 <= addr || half_start >= end) { continue; }   // not touched
            ShadowWriter* s = &word->half[h];
            if (s->thread != NO_WRITER && !(s->block == r->block_linear && s->thread == (uint16_t)f->linear)) {
                bool ordered;
                if (s->block != r->block_linear) {
                    // another block's write: a block's __shared__ memory starts afresh (writing
                    // over the previous block's is its own); anything else is unordered
                    ordered = is_write && !emu_is_device_pointer((void*)half_start);
                } else {
                    bool same_warp = s->thread / 32 == (uint16_t)f->warp;
                    ordered = s->block_epoch != r->block_epoch ||
                              (same_warp && r->warp_epoch[f->warp] != s->warp_epoch);
                }
                if (!ordered) { race_report(f, s, half_start, is_write); }
            }
            if (is_write) {
                s->block = r->block_linear;
                s->thread = (uint16_t)f->linear;
                s->block_epoch = r->block_epoch;
                s->warp_epoch = r->warp_epoch[f->warp];
            }
        }
    }
}

// The hooks (-fsanitize=kernel-address with asan-instrumentation-with-call-threshold=0).
extern "C" {
#define EMU_HOOKS(n)                                                                 \
    void __asan_load##n##_noabort(void* p) { race_access((uintptr_t)p, n, false); } \
    void __asan_store##n##_noabort(void* p) { race_access((uintptr_t)p, n, true); }
EMU_HOOKS(1)
EMU_HOOKS(2)
EMU_HOOKS(4)
EMU_HOOKS(8)
EMU_HOOKS(16)
void __asan_loadN_noabort(void* p, size_t n) { race_access((uintptr_t)p, n, false); }
void __asan_storeN_noabort(void* p, size_t n) { race_access((uintptr_t)p, n, true); }
void __asan_handle_no_return(void) {}
}
