/*
 * simd.h: a small vector type for the CPU kernels (AVX-512, AVX2+FMA, or plain C).
 *
 * The kernels vectorise ACROSS OUTPUT ELEMENTS: each lane computes a different output with
 * exactly the canonical sequence of operations (canonical.h), so the lanes, the vector width
 * and the scalar fallback all give the same bits. vf_fma is a fused multiply-add per lane,
 * i.e. fmaf; vf_max_gt(m, x) is `x > m ? x : m` per lane (a NaN never wins, as in a scalar
 * running maximum, so a maximum taken in any order is exact); vf_if_negative(x, a, b) is
 * `x < 0 ? a : b` per lane; vf_expf is canonical.h's
 * canon_expf in every lane, the same operations in the same order (test_kernels compares it
 * with canon_expf over a sweep of all float exponents and the special values). vf_load_bf16
 * reads VLEN bf16 values (the top halves of floats) and widens them to fp32, which is exact, so
 * arithmetic on them is the arithmetic on the floats they stand for. Build with NO_SIMD=1 (-DLLMC_NO_SIMD) to use the plain-C version; the tests
 * compare both.
 */
#ifndef LLMC_SIMD_H
#define LLMC_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "llmc/canonical.h"

#if defined(__AVX512F__) && !defined(LLMC_NO_SIMD)
#include <immintrin.h>
#define VLEN 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// lanes j < n read p[j * stride], the others p[0] (vf_gather)
typedef __m512i vidx;
static inline vidx vidx_strided(int stride, int n) {
    int i[16];
    for (int j = 0; j < 16; j++) { i[j] = j < n ? j * stride : 0; }
    return _mm512_loadu_si512(i);
}
// the masked form with a zero source: the plain one starts from an undefined register, which
// g++ 12 reports as used uninitialised
static inline vf vf_gather(const float* p, vidx i) { return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xFFFF, i, p, 4); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_if_negative(vf x, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_max_gt(vf m, vf x) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, m, _CMP_GT_OQ), m, x); }
// canon_expf in every lane, operation for operation (see the scalar version below). (g++ 12
// warns that the intrinsics' own placeholder operands may be uninitialized: they are unused.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline vf vf_expf(vf x) {
    const __m512 top = _mm512_set1_ps(88.72283935546875f), bottom = _mm512_set1_ps(-103.972084045410156f);
    const __m512 zero = _mm512_setzero_ps();
    __m512 xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, top, _CMP_GT_OQ), x, top);
    xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xc, bottom, _CMP_LT_OQ), xc, bottom);
    xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xc, xc, _CMP_ORD_Q), zero, xc);
    __m512 kf = _mm512_mul_ps(xc, _mm512_set1_ps(1.44269502162933349609f));
    __m512 half = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(kf, zero, _CMP_GE_OQ), _mm512_set1_ps(-0.5f), _mm512_set1_ps(0.5f));
    __m512i k = _mm512_cvttps_epi32(_mm512_add_ps(kf, half));
    kf = _mm512_cvtepi32_ps(k);
    __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(0.693145751953125f), xc);
    r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(1.42860676533018704e-06f), r);
    __m512 p = _mm512_set1_ps(1.98412698412698413e-04f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.38888888888888889e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333333333333e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666666666666667e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666666666666667e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i k1 = _mm512_srai_epi32(_mm512_sub_epi32(k, _mm512_srai_epi32(k, 31)), 1);   // k / 2, toward zero
    __m512i bias = _mm512_set1_epi32(127);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k1, bias), 23));
    __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(k, k1), bias), 23));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, top, _CMP_GT_OQ), y, _mm512_set1_ps(canon_inf()));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, bottom, _CMP_LT_OQ), y, zero);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), x, y);
}
#pragma GCC diagnostic pop
#define LLMC_SIMD_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LLMC_NO_SIMD)
#include <immintrin.h>
#define VLEN 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
typedef __m256i vidx;
static inline vidx vidx_strided(int stride, int n) {
    int i[8];
    for (int j = 0; j < 8; j++) { i[j] = j < n ? j * stride : 0; }
    return _mm256_loadu_si256((const __m256i*)i);
}
static inline vf vf_gather(const float* p, vidx i) {
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), p, i, _mm256_castsi256_ps(_mm256_set1_epi32(-1)), 4);
}
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_if_negative(vf x, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ)); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_max_gt(vf m, vf x) { return _mm256_blendv_ps(m, x, _mm256_cmp_ps(x, m, _CMP_GT_OQ)); }
// canon_expf in every lane, operation for operation (see the scalar version below)
static inline vf vf_expf(vf x) {
    const __m256 top = _mm256_set1_ps(88.72283935546875f), bottom = _mm256_set1_ps(-103.972084045410156f);
    const __m256 zero = _mm256_setzero_ps();
    __m256 xc = _mm256_blendv_ps(x, top, _mm256_cmp_ps(x, top, _CMP_GT_OQ));
    xc = _mm256_blendv_ps(xc, bottom, _mm256_cmp_ps(xc, bottom, _CMP_LT_OQ));
    xc = _mm256_blendv_ps(zero, xc, _mm256_cmp_ps(xc, xc, _CMP_ORD_Q));
    __m256 kf = _mm256_mul_ps(xc, _mm256_set1_ps(1.44269502162933349609f));
    __m256 half = _mm256_blendv_ps(_mm256_set1_ps(-0.5f), _mm256_set1_ps(0.5f), _mm256_cmp_ps(kf, zero, _CMP_GE_OQ));
    __m256i k = _mm256_cvttps_epi32(_mm256_add_ps(kf, half));
    kf = _mm256_cvtepi32_ps(k);
    __m256 r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(0.693145751953125f), xc);
    r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(1.42860676533018704e-06f), r);
    __m256 p = _mm256_set1_ps(1.98412698412698413e-04f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.38888888888888889e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333333333333e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666666666666667e-02f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666666666666667e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i k1 = _mm256_srai_epi32(_mm256_sub_epi32(k, _mm256_srai_epi32(k, 31)), 1);   // k / 2, toward zero
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(k, k1), bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(canon_inf()), _mm256_cmp_ps(x, top, _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, zero, _mm256_cmp_ps(x, bottom, _CMP_LT_OQ));
    return _mm256_blendv_ps(x, y, _mm256_cmp_ps(x, x, _CMP_ORD_Q));
}
#define LLMC_SIMD_NAME "avx2"
#else
#define VLEN 8
typedef struct { float x[VLEN]; } vf;
static inline vf vf_zero(void) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = 0.0f; } return r; }
static inline vf vf_load(const float* p) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = p[i]; } return r; }
static inline void vf_store(float* p, vf v) { for (int i = 0; i < VLEN; i++) { p[i] = v.x[i]; } }
static inline vf vf_load_bf16(const uint16_t* p) {
    vf r;
    for (int i = 0; i < VLEN; i++) { uint32_t u = (uint32_t)p[i] << 16; memcpy(&r.x[i], &u, 4); }
    return r;
}
typedef struct { int i[VLEN]; } vidx;
static inline vidx vidx_strided(int stride, int n) {
    vidx r;
    for (int j = 0; j < VLEN; j++) { r.i[j] = j < n ? j * stride : 0; }
    return r;
}
static inline vf vf_gather(const float* p, vidx i) { vf r; for (int j = 0; j < VLEN; j++) { r.x[j] = p[i.i[j]]; } return r; }
static inline vf vf_set1(float a) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a; } return r; }
static inline vf vf_fma(vf a, vf b, vf c) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = fmaf(a.x[i], b.x[i], c.x[i]); } return r; }
static inline vf vf_add(vf a, vf b) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a.x[i] + b.x[i]; } return r; }
static inline vf vf_sub(vf a, vf b) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a.x[i] - b.x[i]; } return r; }
static inline vf vf_div(vf a, vf b) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a.x[i] / b.x[i]; } return r; }
static inline vf vf_if_negative(vf x, vf a, vf b) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = x.x[i] < 0.0f ? a.x[i] : b.x[i]; } return r; }
static inline vf vf_mul(vf a, vf b) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a.x[i] * b.x[i]; } return r; }
static inline vf vf_max_gt(vf m, vf x) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = x.x[i] > m.x[i] ? x.x[i] : m.x[i]; } return r; }
static inline vf vf_expf(vf x) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = canon_expf(x.x[i]); } return r; }
#define LLMC_SIMD_NAME "scalar"
#endif

// dst[i * ldd + j] = src[j][i] for i, j < 8: eight rows of eight floats written as columns
// (keys laid out one per lane). Moves only, so every build writes the same floats; with AVX2
// (which AVX-512 machines have too) the 8 x 8 block is transposed in registers.
#if (defined(__AVX2__) || defined(__AVX512F__)) && !defined(LLMC_NO_SIMD)
static inline void transpose8x8(float* dst, long ldd, const float* const src[8]) {
    __m256 t[8], s[8];
    _Pragma("GCC unroll 4") for (int i = 0; i < 8; i += 2) {
        __m256 a = _mm256_loadu_ps(src[i]), b = _mm256_loadu_ps(src[i + 1]);
        t[i] = _mm256_unpacklo_ps(a, b);       // a0 b0 a1 b1 | a4 b4 a5 b5
        t[i + 1] = _mm256_unpackhi_ps(a, b);   // a2 b2 a3 b3 | a6 b6 a7 b7
    }
    _Pragma("GCC unroll 2") for (int i = 0; i < 8; i += 4) {   // columns (0|4), (1|5), (2|6), (3|7) of rows i .. i+3
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}
#else
static inline void transpose8x8(float* dst, long ldd, const float* const src[8]) {
    for (int i = 0; i < 8; i++) {
        for (int j = 0; j < 8; j++) { dst[i * ldd + j] = src[j][i]; }
    }
}
#endif

#endif // LLMC_SIMD_H
