/*
 * cuda_bf16.h (emulated): the bf16 type and conversions of fast mode's kernels, bit for bit
 * what CUDA's cuda_bf16.h does: a bf16 is the upper 16 bits of an IEEE float; float -> bf16
 * rounds to nearest, ties to even (cvt.rn.bf16.f32), keeps infinities and subnormals, and
 * turns every NaN into the canonical 0x7FFF; bf16 -> float is exact.
 *
 * No implicit conversions between float and bf16 (CUDA's header has them unless
 * __CUDA_NO_BFLOAT16_CONVERSIONS__): the kernels convert explicitly, and an implicit one that
 * crept in fails to compile here instead of rounding where nobody looked.
 */
#ifndef LLMC_EMU_CUDA_BF16_H
#define LLMC_EMU_CUDA_BF16_H

#include <stdint.h>
#include <string.h>
#include "cuda_runtime.h"

struct __attribute__((aligned(2))) __nv_bfloat16 {
    uint16_t __x;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    __nv_bfloat16 h;
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {   // NaN
        h.__x = 0x7FFF;
        return h;
    }
    // adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to the even result;
    // a carry out of the mantissa steps the exponent (up to infinity), as it should
    uint32_t lsb = (bits >> 16) & 1u;
    h.__x = (uint16_t)((bits + 0x7FFFu + lsb) >> 16);
    return h;
}
// CUDA's __float2bfloat16 rounds to nearest even too
static inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

static inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t bits = (uint32_t)h.__x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    __nv_bfloat162 v = {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
    return v;
}
static inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    float2 f = {__bfloat162float(v.x), __bfloat162float(v.y)};
    return f;
}

#endif // LLMC_EMU_CUDA_BF16_H
