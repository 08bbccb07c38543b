/*
 * ptx_emu.h (emulated): the PTX that llmc/attention_flash.cuh's small wrappers issue, as C++
 * on the emulated GPU (they include this in place of their inline asm). Everything here runs
 * in the kernel's own translation unit, so the race check sees its loads and stores.
 *
 *   cp.async.cg.shared.global 16 bytes: queued per thread; the destination is poisoned
 *     (0xFF bytes, NaN) by the issuing thread at once and written when the thread waits for
 *     its group (cp.async.wait_group N: all but the N most recent commit groups complete).
 *     A missing wait leaves NaNs; a missing barrier after the wait is a race on the
 *     destination (another thread's write with no barrier in between).
 *   ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the row addresses
 *     (16 bytes each, 16-byte aligned, in shared memory) of matrix i; register i of lane l
 *     gets row l/4, columns 2(l%4) and 2(l%4)+1 of matrix i (.trans: of its transpose). The
 *     row addresses are exchanged across the warp, each lane then reads its elements.
 *   mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D = A (16x16) B (16x8) + C with the
 *     PTX ISA's fragment layouts (lane = 4 group + tig):
 *       A  reg 0: (group, 2tig..+1)  reg 1: (group+8, 2tig..+1)  reg 2: (group, 2tig+8..+9)
 *          reg 3: (group+8, 2tig+8..+9); the lower column in the low 16 bits
 *       B  reg 0: (k = 2tig..+1, n = group)  reg 1: (k = 2tig+8..+9, n = group)
 *       C  c0, c1: (group, 2tig..+1)  c2, c3: (group+8, 2tig..+1)
 *     The fragments are exchanged across the warp; each lane forms its four sums from C,
 *     adding the (exact) bf16 products in k order in fp32. The tensor core's order and
 *     internal rounding differ: the last bits of a sum are what only a GPU shows.
 *   ex2.approx.f32: exp2f (the GPU's is within 2 ulp of it).
 */
#ifndef LLMC_EMU_PTX_EMU_H
#define LLMC_EMU_PTX_EMU_H

#include <stdint.h>
#include "cuda_bf16.h"

struct alignas(16) EmuBytes16 { uint32_t w[4]; };   // one 16-byte load or store

static inline void emu_cp_async16(void* smem, const void* gmem, bool valid) {
    if (emu_is_device_pointer(smem) || !emu_is_device_pointer(gmem) || (uintptr_t)smem % 16 || (uintptr_t)gmem % 16) {
        emu_kernel_error("cp.async of 16 bytes from %p to %p: the source must be 16-byte aligned global memory, "
                         "the destination 16-byte aligned shared memory", gmem, smem);
        return;
    }
    EmuBytes16 poison = {{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}};
    *(EmuBytes16*)smem = poison;
    emu_cp_async_push(smem, valid ? gmem : NULL);
}

static inline void emu_cp_async_wait(unsigned newest_pending) {
    void* dst;
    const void* src;
    while (emu_cp_async_pop_done(newest_pending, &dst, &src)) {
        EmuBytes16 zero = {{0, 0, 0, 0}};
        *(EmuBytes16*)dst = src ? *(const EmuBytes16*)src : zero;
    }
}

static inline void emu_ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
    unsigned lane = emu_lane();
    if ((uintptr_t)row % 16 != 0 || emu_is_device_pointer(row)) {
        emu_kernel_error("ldmatrix: lane %u's row address %p is not a 16-byte aligned shared-memory address", lane,
                         row);
    }
    const uint16_t* rows[32];
    emu_warp_exchange(&row, sizeof(row), rows);
    unsigned quad = lane / 4, pair = 2 * (lane % 4);
    for (int m = 0; m < 4; m++) {
        uint16_t lo, hi;
        if (trans) {
            lo = rows[8 * m + pair][quad];
            hi = rows[8 * m + pair + 1][quad];
        } else {
            lo = rows[8 * m + quad][pair];
            hi = rows[8 * m + quad][pair + 1];
        }
        r[m] = (uint32_t)lo | (uint32_t)hi << 16;
    }
}

// one bf16 of a fragment register: `high` picks the upper 16 bits
static inline float emu_bf16_of(uint32_t reg, int high) {
    __nv_bfloat16 h;
    h.__x = (uint16_t)(reg >> (16 * high));
    return __bfloat162float(h);
}

static inline void emu_mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    struct Fragments { uint32_t a[4], b[2]; };
    Fragments mine = {{a[0], a[1], a[2], a[3]}, {b0, b1}}, all[32];
    emu_warp_exchange(&mine, sizeof(mine), all);
    unsigned lane = emu_lane(), group = lane / 4, tig = lane % 4;
    for (int e = 0; e < 4; e++) {
        int row = (int)group + (e >> 1) * 8, col = 2 * (int)tig + (e & 1);
        float acc = c[e];
        for (int k = 0; k < 16; k++) {
            // A (row, k) is held by lane 4 (row % 8) + (k % 8) / 2, register row / 8 + 2 (k / 8);
            // B (k, col) by lane 4 col + (k % 8) / 2, register k / 8; both in half k % 2
            float av = emu_bf16_of(all[4 * (row % 8) + (k % 8) / 2].a[row / 8 + 2 * (k / 8)], k % 2);
            float bv = emu_bf16_of(all[4 * col + (k % 8) / 2].b[k / 8], k % 2);
            acc += av * bv;   // exact product: 8 x 8 significant bits
        }
        c[e] = acc;
    }
}

static inline float emu_ex2_approx(float x) { return exp2f(x); }

#endif // LLMC_EMU_PTX_EMU_H
