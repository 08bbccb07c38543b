/*
 * decode_matmul.h: the matmul of decoding (a few rows against every weight) on a copy of each
 * weight laid out so that a step streams it.
 *
 * A decode step computes one row per request, so it reads every weight once and does two flops
 * per float read: it is bound by the memory's bandwidth. matmul_forward's few-row kernel reads
 * weight (OC,IC) row-major, lanes gathering VLEN rows at each k; here the weight is packed
 * k-major in panels of DECODE_PANEL outputs, so the outputs a vector computes are contiguous at
 * each k and a panel is one sequential stream:
 *
 *   packed[(p * IC + k) * DECODE_PANEL + j] = weight[(p * DECODE_PANEL + j) * IC + k]
 *   (0 for outputs p * DECODE_PANEL + j >= OC)
 *
 * The arithmetic is canonical.h's R2, unchanged: each output's IC inputs in `nchunks` chunks
 * [c*IC/nchunks, (c+1)*IC/nchunks), each accumulated from 0.0f in increasing k with fmaf, the
 * chunk partials combined by the R1 tree, the bias added after it. So every row is the bits
 * of matmul_forward (= matmul_forward_naive) whatever the rows beside it, and serving stays
 * equal to the trainer's sampler and batch-invariant (test_kernels compares the bits on odd
 * shapes, with SIMD and without).
 *
 * With `bf16` set (serving's --weights bf16), the copies hold each weight rounded to bf16
 * (round to nearest even), half the bytes to stream; the kernel widens them to fp32 as it loads
 * (exact) and computes as above, so a row's bits are matmul_forward's on the rounded weights,
 * still whatever the rows beside it. The caller rounds its fp32 weights the same way
 * (decode_round_bf16), so that the rows matmul_forward takes agree with the packed ones.
 *
 * Two tile kernels share a panel's loads among rows. A few rows (up to DECODE_ROW_TILE): the
 * lanes are the panel's outputs and each row's input is broadcast (decode_panel_tile, the tile's
 * inputs interleaved k-major once per call: decode_interleave_rows). A batch
 * (tiles of VLEN rows, 16 with AVX-512): the lanes are the rows, the inputs transposed once per
 * call (decode_transpose_rows: at each k the tile's VLEN inputs are one vector), and each of the
 * panel's DECODE_PANEL weights at k is broadcast (decode_panel_rows): DECODE_PANEL independent
 * accumulators, the panel read once per VLEN rows: with AVX-512's 32 registers; AVX2's 16 do
 * not hold them, so there a batch goes in tiles of 6 rows of the first kind (12 accumulators),
 * the panel streamed from memory for the first and found in cache by the others. Either way
 * each (row, output) pair is the same sequence of fmaf's, so the bits do not depend on which
 * kernel or tile a row lands in.
 *
 * DecodeWeights holds the packed copies, each found by the address of the weight it copies
 * (decode_weights_get makes one on first use);
 * decode_matmul takes the packed kernel for up to DECODE_MAX_ROWS rows (packing the weight on
 * its first such use) and matmul_forward otherwise. A packed copy is a snapshot: repack when the weight changes.
 */
#ifndef LLMC_DECODE_MATMUL_H
#define LLMC_DECODE_MATMUL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "llmc/canonical.h"
#include "llmc/simd.h"
#include "llmc/utils.h"
#include "llmc/kernels.h"
#include "llmc/cpu_fast.h"
#include "llmc/model.h"

#define DECODE_PANEL 16                          // outputs contiguous at each k (64 bytes)
#define DECODE_PANEL_VECS (DECODE_PANEL / VLEN)  // vectors per panel: 1 (AVX-512), 2 (AVX2, scalar)
#if VLEN == 16
#define DECODE_ROW_TILE 8                        // rows sharing a panel's loads: 8 accumulators + 1 (of 32 registers)
#define DECODE_ROW_LANES 1                       // batches in row-lane tiles (a remainder of more than 8 rows too)
#else
#define DECODE_ROW_TILE 6                        // 12 accumulators + 2 + a broadcast (of 16 registers)
#define DECODE_ROW_LANES 0                       // none: a row-lane tile's 16 accumulators, its input and a
                                                 // broadcast do not fit 16 registers (two spilled: every k waits
                                                 // on a store and a load), so every row goes in panel tiles
#endif
#define DECODE_MAX_ROWS 64                       // more rows: matmul_forward's row tiles
#define DECODE_PANEL_GROUP 4                     // panels a tile of one row takes at once (of two rows: 2)
#define DECODE_PREFETCH_K 16                     // panel rows (k) ahead that a row tile asks the cache for

typedef struct {
    const float* source;   // the weight (OC,IC) it copies
    float* packed;         // (ceil(OC/DECODE_PANEL), IC, DECODE_PANEL), or NULL and ...
    uint16_t* packed_bf16; // ... the same in bf16
    int OC, IC;
} DecodeMatrix;

typedef struct DecodeWeights {
    DecodeMatrix* m;
    int n, cap;
    int bf16;              // copies made from now on: bf16 (1) or fp32 (0)
} DecodeWeights;

// x rounded to the nearest bf16, ties to even (x finite)
static inline uint16_t decode_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// x[0..n) <- their values rounded to bf16 (still fp32): what a bf16 copy holds
static inline void decode_round_bf16(float* x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)decode_bf16(x[i]) << 16;
        memcpy(&x[i], &u, 4);
    }
}

// m's copy <- weight (m->OC, m->IC) in the layout above: fp32 into m->packed, or rounded to
// bf16 into m->packed_bf16 (whichever m holds); a panel's outputs past OC are zeros
static inline void decode_pack(DecodeMatrix* m, const float* weight) {
    int OC = m->OC, IC = m->IC, panels = (OC + DECODE_PANEL - 1) / DECODE_PANEL;
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        size_t base = (size_t)p * IC * DECODE_PANEL;
        for (int j = 0; j < DECODE_PANEL; j++) {
            int o = p * DECODE_PANEL + j;
            const float* row = weight + (size_t)o * IC;
            for (int k = 0; k < IC; k++) {
                size_t i = base + (size_t)k * DECODE_PANEL + j;
                float x = o < OC ? row[k] : 0.0f;
                if (m->packed) { m->packed[i] = x; }
                else { m->packed_bf16[i] = decode_bf16(x); }
            }
        }
    }
}

// the packed copy of weight (OC,IC), or NULL
static inline const DecodeMatrix* decode_weights_find(const DecodeWeights* dw, const float* weight, int OC, int IC) {
    for (int i = 0; i < dw->n; i++) {
        const DecodeMatrix* m = &dw->m[i];
        if (m->source == weight && m->OC == OC && m->IC == IC) { return m; }
    }
    return NULL;
}

// A packed copy of weight (OC,IC) joins dw (once per weight).
static inline void decode_weights_add(DecodeWeights* dw, const float* weight, int OC, int IC) {
    if (dw->n == dw->cap) {
        dw->cap = dw->cap ? 2 * dw->cap : 64;
        DecodeMatrix* grown = (DecodeMatrix*)realloc(dw->m, sizeof(DecodeMatrix) * (size_t)dw->cap);
        if (!grown) { fatal("out of memory for the decode weights' table"); }
        dw->m = grown;
    }
    size_t panels = (size_t)(OC + DECODE_PANEL - 1) / DECODE_PANEL;
    DecodeMatrix* m = &dw->m[dw->n++];
    m->source = weight;
    m->OC = OC;
    m->IC = IC;
    size_t elements = panels * IC * DECODE_PANEL;
    m->packed = dw->bf16 ? NULL : (float*)aligned_calloc_or_die(sizeof(float) * elements, "decode weights");
    m->packed_bf16 = dw->bf16 ? (uint16_t*)aligned_calloc_or_die(sizeof(uint16_t) * elements, "decode weights") : NULL;
    decode_pack(m, weight);
}

// the packed copy of weight (OC,IC), made now if dw has none
static inline const DecodeMatrix* decode_weights_get(DecodeWeights* dw, const float* weight, int OC, int IC) {
    const DecodeMatrix* m = decode_weights_find(dw, weight, OC, IC);
    if (m) { return m; }
    decode_weights_add(dw, weight, OC, IC);
    return &dw->m[dw->n - 1];
}

static inline void decode_weights_free(DecodeWeights* dw) {
    for (int i = 0; i < dw->n; i++) {
        free(dw->m[i].packed);
        free(dw->m[i].packed_bf16);
    }
    free(dw->m);
    dw->m = NULL;
    dw->n = dw->cap = 0;
}


// ------------------------------------------------------------------------------------------
// out (N,OC) = inp (N,IC) @ weight^T + bias, from the packed copy. The specification, one
// output at a time: matmul_forward_naive (train_gpt2.c) with weight[o][k] read from the panels.
static inline void decode_matmul_forward_naive(float* out, const float* inp, const DecodeMatrix* m,
                                               const float* bias, int N, int nchunks) {
    int IC = m->IC, OC = m->OC;
    for (int r = 0; r < N; r++) {
        for (int o = 0; o < OC; o++) {
            size_t at = (size_t)(o / DECODE_PANEL) * IC * DECODE_PANEL + o % DECODE_PANEL;
            float partial[CANON_R];
            for (int ch = 0; ch < nchunks; ch++) {
                float acc = 0.0f;
                for (long k = ((long)IC * ch) / nchunks; k < ((long)IC * (ch + 1)) / nchunks; k++) {
                    size_t i = at + (size_t)k * DECODE_PANEL;
                    float w;
                    if (m->packed) { w = m->packed[i]; }
                    else { uint32_t u = (uint32_t)m->packed_bf16[i] << 16; memcpy(&w, &u, 4); }
                    acc = fmaf(inp[(size_t)r * IC + k], w, acc);
                }
                partial[ch] = acc;
            }
            float sum = canon_tree_sum(partial, nchunks, 1);
            out[(size_t)r * OC + o] = bias ? sum + bias[o] : sum;
        }
    }
}

// panel row k's cache line into the cache ahead of its use (past the panel's end: a line of
// the next panel, which the thread reads next; a prefetch never faults). Only the row tiles
// ask for the rows of the panel they read: a few rows' loop is bound by the stream, which the
// hardware prefetcher already follows (asking too made one row's 48 matrices of d12 slower,
// 13-16 -> 18 ms, one thread); panel tiles ask for the next panel only when several share one
// (DecodeAhead).
static inline __attribute__((always_inline)) void decode_prefetch_panel(const float* panel, const uint16_t* panel_bf16, int k) {
    if (panel_bf16) { __builtin_prefetch(panel_bf16 + (size_t)k * DECODE_PANEL); }
    else { __builtin_prefetch(panel + (size_t)k * DECODE_PANEL); }
}

// Where a panel tile asks the cache for the next panel: at each k one prefetch of `at`, then at
// += step bytes, so that over its IC k's the tile walks its share of the next panel (each line
// asked for about 64/step times: a prefetch of a line already on its way costs a load slot,
// less than a branch to ask once per line did in the unrolled k loop). With nothing to ask
// for, at is the tile's own inputs (in cache) and step 0.
typedef struct { const char* at; long step; } DecodeAhead;

// The rows [r0, N) go to the panel tiles in ceil((N - r0) / DECODE_ROW_TILE) tiles of as
// equal sizes as can be (13 rows as 5 + 4 + 4, not 6 + 6 + 1: a tile's time at each k is about
// its FMAs or the FMA latency, whichever is more, so a tile of one row costs nearly what one of
// six does); tile t of n starts at row decode_tile_start(r0, N, t, n).
static inline int decode_tile_count(int r0, int N) { return (N - r0 + DECODE_ROW_TILE - 1) / DECODE_ROW_TILE; }
static inline int decode_tile_start(int r0, int N, int t, int n) { return r0 + (int)((long)(N - r0) * t / n); }

// xp <- inp's rows [r0, N) tile by tile, each tile's inputs interleaved k-major: a tile of nr
// rows from row t0 is xp[t0 * IC + k * nr + r] = inp[(t0 + r) * IC + k], so a panel tile's
// broadcasts at each k come from one place and its k loop reads one stream of inputs beside
// the panel's (reading nr rows IC apart cost a third of the 6-row tile's speed). Inside a
// parallel region.
static inline void decode_interleave_rows(float* xp, const float* inp, int r0, int N, int IC) {
    int n = decode_tile_count(r0, N);
    #pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        int t0 = decode_tile_start(r0, N, t, n), nr = decode_tile_start(r0, N, t + 1, n) - t0;
        float* dst = xp + (size_t)t0 * IC;
        for (int k = 0; k < IC; k++) {
            for (int r = 0; r < nr; r++) { dst[(size_t)k * nr + r] = inp[(size_t)(t0 + r) * IC + k]; }
        }
    }
}

// NP consecutive panels (outputs o0 .. o0 + NP * DECODE_PANEL, those below OC kept) for rows r0
// .. r0 + NR, their inputs x interleaved (decode_interleave_rows: x[k * NR + r]): at each k,
// each panel's vectors are loaded once (from fp32, or widened from bf16: panel_bf16) and each
// row's input broadcast into them; each chunk's accumulators join the stack as one leaf.
// Meanwhile its share of the next panel is asked for (ahead). Several panels at once are for a
// tile of one or two rows: each accumulator is a chain of FMAs, each waiting on the one before
// (4 cycles), and one row of one panel has only DECODE_PANEL_VECS chains: at that latency it
// could not read bf16 copies as fast as the memory sends them.
static inline __attribute__((always_inline)) void decode_panel_tile(float* out, const float* x, const float* panel,
                                                                    const uint16_t* panel_bf16, const float* bias, int IC,
                                                                    int OC, int o0, int r0, const int NR, const int NP,
                                                                    int nchunks, DecodeAhead ahead) {
    enum { PV = DECODE_PANEL_VECS, ENTRY = DECODE_ROW_TILE * DECODE_PANEL, MAX_NP = DECODE_PANEL_GROUP };
    float partials[(CANON_LOG2_R + 2) * ENTRY];
    int cols = NP * DECODE_PANEL;   // NR x cols of a leaf (NR * NP <= DECODE_ROW_TILE)
    CanonStack stack = canon_stack(partials, ENTRY, 1, NR * cols, ENTRY);
    size_t panel_size = (size_t)IC * DECODE_PANEL;   // elements between consecutive panels
    for (int ch = 0; ch < nchunks; ch++) {
        int kb = (int)(((long)IC * ch) / nchunks), ke = (int)(((long)IC * (ch + 1)) / nchunks);
        vf acc[DECODE_ROW_TILE][MAX_NP * PV];
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            _Pragma("GCC unroll 8") for (int v = 0; v < NP * PV; v++) { acc[r][v] = vf_zero(); }
        }
        const float* xk = x + (size_t)kb * NR;
        _Pragma("GCC unroll 4") for (int k = kb; k < ke; k++) {
            __builtin_prefetch(ahead.at);
            ahead.at += ahead.step;
            vf w[MAX_NP * PV];
            _Pragma("GCC unroll 8") for (int v = 0; v < NP * PV; v++) {
                size_t i = (size_t)(v / PV) * panel_size + (size_t)k * DECODE_PANEL + (v % PV) * VLEN;
                w[v] = panel_bf16 ? vf_load_bf16(panel_bf16 + i) : vf_load(panel + i);
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
                vf a = vf_set1(xk[r]);
                _Pragma("GCC unroll 8") for (int v = 0; v < NP * PV; v++) { acc[r][v] = vf_fma(a, w[v], acc[r][v]); }
            }
            xk += NR;
        }
        float* leaf = canon_stack_next(&stack);
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            _Pragma("GCC unroll 8") for (int v = 0; v < NP * PV; v++) { vf_store(leaf + r * cols + v * VLEN, acc[r][v]); }
        }
        canon_stack_push(&stack, canon_tree_merges_after(ch, nchunks));
    }
    int no = OC - o0 < cols ? OC - o0 : cols;
    for (int r = 0; r < NR; r++) {
        float* o = out + (size_t)(r0 + r) * OC + o0;
        for (int j = 0; j < no; j++) { o[j] = bias ? partials[r * cols + j] + bias[o0 + j] : partials[r * cols + j]; }
    }
}

// xt (tiles, IC, VLEN) <- inp rows: xt[(t * IC + k) * VLEN + r] = inp[(t * VLEN + r) * IC + k], the
// rows past N zeros (their lanes are computed and never stored). Inside a parallel region.
static inline void decode_transpose_rows(float* xt, const float* inp, int N, int IC, int tiles) {
    #pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        for (int r = 0; r < VLEN; r++) {
            int row = t * VLEN + r;
            float* dst = xt + (size_t)t * IC * VLEN + r;
            for (int k = 0; k < IC; k++) { dst[(size_t)k * VLEN] = row < N ? inp[(size_t)row * IC + k] : 0.0f; }
        }
    }
}

// One panel (outputs o0 .. o0 + no) for the rows r0 .. r0 + nr of one transposed tile xt (IC,
// VLEN): lane r of accumulator j is (row r0 + r, output o0 + j); at each k the tile's inputs are
// one load and each of the panel's weights a broadcast (from fp32, or from the panel row widened
// from bf16), DECODE_PANEL fmaf's per lane in flight; each chunk's accumulators join the stack
// as one leaf.
static inline __attribute__((always_inline)) void decode_panel_rows(float* out, const float* xt, const float* panel,
                                                                    const uint16_t* panel_bf16, const float* bias, int IC,
                                                                    int OC, int o0, int no, int r0, int nr, int nchunks) {
    enum { ENTRY = DECODE_PANEL * VLEN };
    float partials[(CANON_LOG2_R + 2) * ENTRY];
    CanonStack stack = canon_stack(partials, ENTRY, 1, ENTRY, ENTRY);
    for (int ch = 0; ch < nchunks; ch++) {
        int kb = (int)(((long)IC * ch) / nchunks), ke = (int)(((long)IC * (ch + 1)) / nchunks);
        vf acc[DECODE_PANEL];
        _Pragma("GCC unroll 16") for (int j = 0; j < DECODE_PANEL; j++) { acc[j] = vf_zero(); }
        for (int k = kb; k < ke; k++) {
            decode_prefetch_panel(panel, panel_bf16, k + DECODE_PREFETCH_K);
            float widened[DECODE_PANEL];
            const float* w = panel + (size_t)k * DECODE_PANEL;
            if (panel_bf16) {
                _Pragma("GCC unroll 2") for (int v = 0; v < DECODE_PANEL_VECS; v++) {
                    vf_store(widened + v * VLEN, vf_load_bf16(panel_bf16 + (size_t)k * DECODE_PANEL + v * VLEN));
                }
                w = widened;
            }
            vf x = vf_load(xt + (size_t)k * VLEN);
            _Pragma("GCC unroll 16") for (int j = 0; j < DECODE_PANEL; j++) { acc[j] = vf_fma(x, vf_set1(w[j]), acc[j]); }
        }
        float* leaf = canon_stack_next(&stack);
        _Pragma("GCC unroll 16") for (int j = 0; j < DECODE_PANEL; j++) { vf_store(leaf + j * VLEN, acc[j]); }
        canon_stack_push(&stack, canon_tree_merges_after(ch, nchunks));
    }
    for (int r = 0; r < nr; r++) {
        float* o = out + (size_t)(r0 + r) * OC + o0;
        for (int j = 0; j < no; j++) { o[j] = bias ? partials[j * VLEN + r] + bias[o0 + j] : partials[j * VLEN + r]; }
    }
}

// = decode_matmul_forward_naive = matmul_forward, bit for bit. With AVX-512 the rows go in
// tiles of VLEN to decode_panel_rows, and a remainder of at most DECODE_ROW_TILE rows (every row
// when N is that small, as a lone request's step) to decode_panel_tile; a remainder of more
// rows takes a row tile of its own, its missing rows zeros. Otherwise every row goes to
// decode_panel_tile, in tiles of at most DECODE_ROW_TILE rows. One or two rows in all take
// DECODE_PANEL_GROUP or 2 panels at once. The threads take contiguous runs of panels, so each
// streams its part of the copy once (the tiles after the first find the panel in cache).
static inline void decode_matmul_forward(float* out, const float* inp, const DecodeMatrix* m, const float* bias, int N,
                                         int nchunks) {
    int IC = m->IC, OC = m->OC, panels = (OC + DECODE_PANEL - 1) / DECODE_PANEL;
    int tiles = !DECODE_ROW_LANES ? 0 : N % VLEN > DECODE_ROW_TILE ? (N + VLEN - 1) / VLEN : N / VLEN;   // row tiles
    int tiled = tiles * VLEN < N ? tiles * VLEN : N;                            // rows they hold
    int ntiles = decode_tile_count(tiled, N);                                   // panel tiles
    int group = N == 1 ? DECODE_PANEL_GROUP : N == 2 ? 2 : 1;                  // panels a panel tile takes at once
    int groups = (panels + group - 1) / group;
    size_t panel_size = (size_t)IC * DECODE_PANEL, elem = m->packed_bf16 ? sizeof(uint16_t) : sizeof(float);
    // the row tiles' inputs transposed, then the other rows' interleaved for the panel tiles
    float* xt = scratch(SCRATCH_DECODE, sizeof(float) * ((size_t)tiles * IC * VLEN + (size_t)N * IC));
    float* xp = xt + (size_t)tiles * IC * VLEN - (size_t)tiled * IC;   // xp + r0 * IC: the tile of row r0 >= tiled
    #pragma omp parallel
    {
        if (tiles) { decode_transpose_rows(xt, inp, N, IC, tiles); }
        decode_interleave_rows(xp, inp, tiled, N, IC);   // (each omp for ends in a barrier)
        #pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            int p = g * group, np = panels - p < group ? panels - p : group;
            size_t at = (size_t)p * panel_size;
            for (int t = 0; t < tiles; t++) {   // (group is 1 here)
                int r0 = t * VLEN, nr = N - r0 < VLEN ? N - r0 : VLEN;
                int o0 = p * DECODE_PANEL, no = OC - o0 < DECODE_PANEL ? OC - o0 : DECODE_PANEL;
                const float* x = xt + (size_t)t * IC * VLEN;
                if (m->packed_bf16) { decode_panel_rows(out, x, NULL, m->packed_bf16 + at, bias, IC, OC, o0, no, r0, nr, nchunks); }
                else { decode_panel_rows(out, x, m->packed + at, NULL, bias, IC, OC, o0, no, r0, nr, nchunks); }
            }
            // with several panel tiles, each asks for its share of the next panel while it computes,
            // so the stream from memory overlaps the arithmetic of every tile, not only the first's
            size_t panel_bytes = panel_size * elem;
            const char* next = p + 1 == panels || ntiles < 2 ? NULL : (const char*)(m->packed_bf16 ? (const void*)(m->packed_bf16 + at + panel_size)
                                                                                                     : (const void*)(m->packed + at + panel_size));
            for (int tile = 0; tile < ntiles; tile++) {
                int r0 = decode_tile_start(tiled, N, tile, ntiles), nr = decode_tile_start(tiled, N, tile + 1, ntiles) - r0;
                const float* x = xp + (size_t)r0 * IC;
                DecodeAhead ahead = {(const char*)x, 0};
                if (next) { ahead = (DecodeAhead){next + panel_bytes * tile / ntiles, (long)(panel_bytes / ntiles / IC)}; }
                // one specialisation per row count, panel count and weight type (the branch on the
                // type is taken out of the k loop); a short group (the last) goes panel by panel
#define DECODE_TILE(NR, NP, P)                                                                                          \
    if (m->packed_bf16) { decode_panel_tile(out, x, NULL, m->packed_bf16 + (size_t)(P) * panel_size, bias, IC, OC,     \
                                            (P) * DECODE_PANEL, r0, NR, NP, nchunks, ahead); }                         \
    else { decode_panel_tile(out, x, m->packed + (size_t)(P) * panel_size, NULL, bias, IC, OC, (P) * DECODE_PANEL, r0, \
                             NR, NP, nchunks, ahead); }
                if (np == DECODE_PANEL_GROUP && nr == 1) { DECODE_TILE(1, DECODE_PANEL_GROUP, p); continue; }
                if (np == 2 && nr == 2) { DECODE_TILE(2, 2, p); continue; }
                for (int q = p; q < p + np; q++) {
                    switch (nr) {
                        case 1: DECODE_TILE(1, 1, q); break;
                        case 2: DECODE_TILE(2, 1, q); break;
                        case 3: DECODE_TILE(3, 1, q); break;
                        case 4: DECODE_TILE(4, 1, q); break;
                        case 5: DECODE_TILE(5, 1, q); break;
#if DECODE_ROW_TILE == 8
                        case 6: DECODE_TILE(6, 1, q); break;
                        case 7: DECODE_TILE(7, 1, q); break;
#endif
                        default: DECODE_TILE(DECODE_ROW_TILE, 1, q); break;
                    }
                }
#undef DECODE_TILE
            }
        }
    }
}

// matmul_forward's contract (kernels.h), on the packed copy of weight (made on first use) when
// the rows are few enough; the bits are the same either way (bf16 copies: when weight holds
// bf16 values, decode_round_bf16).
static inline void decode_matmul(DecodeWeights* dw, float* out, const float* inp, const float* weight,
                                 const float* bias, int N, int IC, int OC, int nchunks) {
    if (N <= DECODE_MAX_ROWS) {
        decode_matmul_forward(out, inp, decode_weights_get(dw, weight, OC, IC), bias, N, nchunks);
    } else {
        matmul_forward(out, inp, weight, bias, N, IC, OC, nchunks);
    }
}

#endif // LLMC_DECODE_MATMUL_H
