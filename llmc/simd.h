/*
 * simd.h: a small vector type for the CPU kernels (AVX-512, AVX2+FMA, or plain C).
 *
 * The kernels vectorise ACROSS OUTPUT ELEMENTS: each lane computes a different output with
 * exactly the canonical sequence of operations (canonical.h), so the lanes, the vector width
 * and the scalar fallback all give the same bits. vf_fma is a fused multiply-add per lane,
 * i.e. fmaf. Build with NO_SIMD=1 (-DLLMC_NO_SIMD) to use the plain-C version; the tests
 * compare both.
 */
#ifndef LLMC_SIMD_H
#define LLMC_SIMD_H

#include <math.h>

#if defined(__AVX512F__) && !defined(LLMC_NO_SIMD)
#include <immintrin.h>
#define VLEN 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
#define LLMC_SIMD_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LLMC_NO_SIMD)
#include <immintrin.h>
#define VLEN 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
#define LLMC_SIMD_NAME "avx2"
#else
#define VLEN 8
typedef struct { float x[VLEN]; } vf;
static inline vf vf_zero(void) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = 0.0f; } return r; }
static inline vf vf_load(const float* p) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = p[i]; } return r; }
static inline void vf_store(float* p, vf v) { for (int i = 0; i < VLEN; i++) { p[i] = v.x[i]; } }
static inline vf vf_set1(float a) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a; } return r; }
static inline vf vf_fma(vf a, vf b, vf c) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = fmaf(a.x[i], b.x[i], c.x[i]); } return r; }
static inline vf vf_add(vf a, vf b) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a.x[i] + b.x[i]; } return r; }
static inline vf vf_mul(vf a, vf b) { vf r; for (int i = 0; i < VLEN; i++) { r.x[i] = a.x[i] * b.x[i]; } return r; }
#define LLMC_SIMD_NAME "scalar"
#endif

#endif // LLMC_SIMD_H
