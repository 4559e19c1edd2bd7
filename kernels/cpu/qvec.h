// 16-lane vectors for kernels/cpu/qdot.c's microkernels and qformats.c's quantization of x:
// one lane per row of a group of 16. Every helper is static inline (always_inline), so the hot
// loops that call them compile as if they were written there.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qformats.h"  // f16, e8m0_half: the plain-C build's lanes
#include "zoo_cpu.h"

#if defined(__SSE2__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// ---- 16-lane vectors: AVX-512, two AVX2 halves, or plain C ----------------------------------------
// vb: 64 bytes (16 lanes of 4 bytes: one lane per row of a group); vi: 16 int32; vf: 16 float.
#define INLINE static inline __attribute__((always_inline))
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZOO_QDOT_ISA "avx512"
#define ZOO_QDOT_ISA_AVX512 1
#define UNROLL _Pragma("GCC unroll 8")       // loops over rows of x and over a block's vectors
#define UNROLL_SUBS _Pragma("GCC unroll 16") // over a unit's sub-blocks: their choices constant
#define UNROLL_Q6 UNROLL_SUBS
#define ROWS 4  // rows of x per pass (8 spill registers: prefill half as fast)
typedef __m512i vb;
typedef __m512i vi;
typedef __m512 vf;
INLINE vb vb_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
INLINE void vb_store(uint8_t *p, vb a) { _mm512_storeu_si512(p, a); }
INLINE vb vb_x(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
INLINE vb vb_set1(uint8_t v) { return _mm512_set1_epi8((char)v); }
INLINE vb vb_and(vb a, vb b) { return _mm512_and_si512(a, b); }
INLINE vb vb_or(vb a, vb b) { return _mm512_or_si512(a, b); }
#define vb_srl(a, n) _mm512_srli_epi16(a, n)
#define vb_sll(a, n) _mm512_slli_epi16(a, n)
INLINE vb vb_abs8(vb a) { return _mm512_abs_epi8(a); }
INLINE vb vb_sign8(vb x, vb w) {  // x negated where w < 0 (|x| <= 127)
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
INLINE vb vb_bytemask(vb a, vb bits) {  // 0xFF in the bytes where a & bits is non-zero
    return _mm512_movm_epi8(_mm512_test_epi8_mask(a, bits));
}
INLINE vb vb_shuffle(vb a, vb idx) { return _mm512_shuffle_epi8(a, idx); }
INLINE vb vb_pattern(uint32_t v) { return _mm512_set1_epi32((int)v); }
INLINE vb vb_lanes4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {  // per 16-byte quarter
    return _mm512_set_epi32((int)d, (int)c, (int)b, (int)a, (int)d, (int)c, (int)b, (int)a,
                            (int)d, (int)c, (int)b, (int)a, (int)d, (int)c, (int)b, (int)a);
}
INLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
INLINE vi vi_dot(vi acc, vb w, vb x) {  // acc + (u8 w x s8 x, 4 bytes into each int32 lane)
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}
// acc + w1 . x1 + w2 . x2, where every code of w is under 64 (K-quants, 4- and 5-bit legacy
// codes): without VNNI the two products' int16 pair sums (at most 2 * 63 * 127 each) are added
// before widening, one multiply-add to int32 for two.
INLINE vi vi_dot2(vi acc, vb w1, vb x1, vb w2, vb x2) {
#if defined(__AVX512VNNI__)
    return vi_dot(vi_dot(acc, w1, x1), w2, x2);
#else
    const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(w1, x1), _mm512_maddubs_epi16(w2, x2));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}
INLINE vi vi_join(vi hi, vi lo) { return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo); }
INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vf vf_cvt(vi a) { return _mm512_cvtepi32_ps(a); }
INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
INLINE vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
INLINE vf vf_set1(float a) { return _mm512_set1_ps(a); }
INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vf_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf vf_e8m0(const uint8_t *p) {  // 16 e8m0 bytes -> e8m0_half of each
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 m = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(m, normal, small));
}
INLINE vf vf_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
INLINE vf vf_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
// x's quantization: |x|, max, rint (to nearest even), min / max, and 16 int32 as int8 bytes
INLINE vf vf_abs(vf a) { return _mm512_abs_ps(a); }
INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
INLINE float vf_hmax(vf a) { return _mm512_reduce_max_ps(a); }
INLINE vf vf_rint(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vi vi_of(vf a) { return _mm512_cvtps_epi32(a); }
INLINE void vi_store8(int8_t *p, vi a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a)); }
INLINE int vi_sum(vi a) { return _mm512_reduce_add_epi32(a); }

#elif defined(__AVX2__) && defined(__FMA__)
#define ZOO_QDOT_ISA "avx2"
#define UNROLL _Pragma("GCC unroll 8")
#define UNROLL_SUBS  // (two registers a vector: unrolled, the compiler spills and takes 15 s)
#define UNROLL_Q6 _Pragma("GCC unroll 16")  // Q6_K's sub-blocks, one row of x
#define ROWS 4
typedef struct { __m256i a, b; } vb;
typedef vb vi;
typedef struct { __m256 a, b; } vf;
INLINE vb mkvb(__m256i a, __m256i b) { vb r = {a, b}; return r; }
INLINE vf mkvf(__m256 a, __m256 b) { vf r = {a, b}; return r; }
INLINE vb vb_load(const uint8_t *p) {
    return mkvb(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32)));
}
INLINE void vb_store(uint8_t *p, vb x) {
    _mm256_storeu_si256((__m256i *)p, x.a);
    _mm256_storeu_si256((__m256i *)(p + 32), x.b);
}
INLINE vb vb_x(const int8_t *p) { int32_t v; memcpy(&v, p, 4); __m256i s = _mm256_set1_epi32(v); return mkvb(s, s); }
INLINE vb vb_set1(uint8_t v) { __m256i s = _mm256_set1_epi8((char)v); return mkvb(s, s); }
INLINE vb vb_and(vb x, vb y) { return mkvb(_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)); }
INLINE vb vb_or(vb x, vb y) { return mkvb(_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)); }
#define vb_srl(x, n) mkvb(_mm256_srli_epi16((x).a, n), _mm256_srli_epi16((x).b, n))
#define vb_sll(x, n) mkvb(_mm256_slli_epi16((x).a, n), _mm256_slli_epi16((x).b, n))
INLINE vb vb_abs8(vb x) { return mkvb(_mm256_abs_epi8(x.a), _mm256_abs_epi8(x.b)); }
INLINE vb vb_sign8(vb x, vb w) { return mkvb(_mm256_sign_epi8(x.a, w.a), _mm256_sign_epi8(x.b, w.b)); }
INLINE vb vb_bytemask(vb x, vb bits) {
    const __m256i z = _mm256_setzero_si256();
    return mkvb(_mm256_xor_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x.a, bits.a), z), _mm256_set1_epi8(-1)),
                _mm256_xor_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x.b, bits.b), z), _mm256_set1_epi8(-1)));
}
INLINE vb vb_shuffle(vb x, vb idx) { return mkvb(_mm256_shuffle_epi8(x.a, idx.a), _mm256_shuffle_epi8(x.b, idx.b)); }
INLINE vb vb_pattern(uint32_t v) { __m256i s = _mm256_set1_epi32((int)v); return mkvb(s, s); }
INLINE vb vb_lanes4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    const __m256i s = _mm256_set_epi32((int)d, (int)c, (int)b, (int)a, (int)d, (int)c, (int)b, (int)a);
    return mkvb(s, s);
}
INLINE vi vi_zero(void) { return mkvb(_mm256_setzero_si256(), _mm256_setzero_si256()); }
INLINE __m256i dot8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
INLINE vi vi_dot(vi acc, vb w, vb x) { return mkvb(dot8(acc.a, w.a, x.a), dot8(acc.b, w.b, x.b)); }
INLINE __m256i dot8x2(__m256i acc, __m256i w1, __m256i x1, __m256i w2, __m256i x2) {
#if defined(__AVXVNNI__)
    return dot8(dot8(acc, w1, x1), w2, x2);
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w1, x1), _mm256_maddubs_epi16(w2, x2));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}
INLINE vi vi_dot2(vi acc, vb w1, vb x1, vb w2, vb x2) {  // codes of w under 64: see AVX-512's
    return mkvb(dot8x2(acc.a, w1.a, x1.a, w2.a, x2.a), dot8x2(acc.b, w1.b, x1.b, w2.b, x2.b));
}
INLINE vi vi_join(vi hi, vi lo) {
    return mkvb(_mm256_add_epi32(_mm256_slli_epi32(hi.a, 8), lo.a), _mm256_add_epi32(_mm256_slli_epi32(hi.b, 8), lo.b));
}
INLINE vi vi_add(vi x, vi y) { return mkvb(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
INLINE vf vf_cvt(vi x) { return mkvf(_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)); }
INLINE vf vf_zero(void) { return mkvf(_mm256_setzero_ps(), _mm256_setzero_ps()); }
INLINE vf vf_load(const float *p) { return mkvf(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
INLINE void vf_store(float *p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
INLINE vf vf_set1(float v) { return mkvf(_mm256_set1_ps(v), _mm256_set1_ps(v)); }
INLINE vf vf_mul(vf x, vf y) { return mkvf(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
INLINE vf vf_fmadd(vf x, vf y, vf z) { return mkvf(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
INLINE vf vf_half(const uint8_t *p) {
    return mkvf(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))));
}
INLINE __m256 e8m0_8(__m128i b) {  // the low 8 e8m0 bytes of b -> e8m0_half of each
    const __m256i e = _mm256_cvtepu8_epi32(b), two = _mm256_set1_epi32(2);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i lt2 = _mm256_cmpgt_epi32(two, e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, lt2));
}
INLINE vf vf_e8m0(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return mkvf(e8m0_8(v), e8m0_8(_mm_srli_si128(v, 8)));
}
INLINE vf vf_u8(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return mkvf(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
INLINE vf vf_i8(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return mkvf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}
INLINE vf vf_abs(vf x) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return mkvf(_mm256_and_ps(x.a, m), _mm256_and_ps(x.b, m));
}
INLINE vf vf_max(vf x, vf y) { return mkvf(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); }
INLINE vf vf_min(vf x, vf y) { return mkvf(_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)); }
INLINE float vf_hmax(vf x) {
    __m256 m = _mm256_max_ps(x.a, x.b);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
INLINE vf vf_rint(vf x) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return mkvf(_mm256_round_ps(x.a, mode), _mm256_round_ps(x.b, mode));
}
INLINE vf vf_sub(vf x, vf y) { return mkvf(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
INLINE vi vi_of(vf x) { return mkvb(_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)); }
INLINE void vi_store8(int8_t *p, vi x) {  // 16 int32 in -127..127 -> bytes
    const __m256i w = _mm256_packs_epi32(x.a, x.b);  // 16-bit, lanes interleaved per 128 bits
    const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(w, w), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_shuffle_epi32(b, 0xD8)));
}
INLINE int vi_sum(vi x) {
    __m256i s = _mm256_add_epi32(x.a, x.b);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}

#else  // plain C: the same operations lane by lane
#define ZOO_QDOT_ISA "c"
#define UNROLL  // plain C, vectors of arrays: unrolled, compiling took minutes
#define UNROLL_SUBS
#define UNROLL_Q6
#define ROWS 4
typedef struct { uint8_t v[64]; } vb;
typedef struct { int32_t v[16]; } vi;
typedef struct { float v[16]; } vf;
INLINE vb vb_load(const uint8_t *p) { vb r; memcpy(r.v, p, 64); return r; }
INLINE void vb_store(uint8_t *p, vb x) { memcpy(p, x.v, 64); }
INLINE vb vb_x(const int8_t *p) { vb r; for (int i = 0; i < 16; i++) memcpy(r.v + 4 * i, p, 4); return r; }
INLINE vb vb_set1(uint8_t s) { vb r; memset(r.v, s, 64); return r; }
INLINE vb vb_and(vb x, vb y) { for (int i = 0; i < 64; i++) x.v[i] &= y.v[i]; return x; }
INLINE vb vb_or(vb x, vb y) { for (int i = 0; i < 64; i++) x.v[i] |= y.v[i]; return x; }
INLINE vb vb_shift16(vb x, int n) {  // 16-bit lanes: n > 0 right, n < 0 left
    for (int i = 0; i < 32; i++) {
        uint16_t u;
        memcpy(&u, x.v + 2 * i, 2);
        u = n > 0 ? (uint16_t)(u >> n) : (uint16_t)(u << -n);
        memcpy(x.v + 2 * i, &u, 2);
    }
    return x;
}
#define vb_srl(x, n) vb_shift16(x, n)
#define vb_sll(x, n) vb_shift16(x, -(n))
INLINE vb vb_abs8(vb x) { for (int i = 0; i < 64; i++) x.v[i] = (uint8_t)abs((int8_t)x.v[i]); return x; }
INLINE vb vb_sign8(vb x, vb w) {
    for (int i = 0; i < 64; i++) if ((int8_t)w.v[i] < 0) x.v[i] = (uint8_t)(-(int8_t)x.v[i]);
    return x;
}
INLINE vb vb_bytemask(vb x, vb bits) { for (int i = 0; i < 64; i++) x.v[i] = x.v[i] & bits.v[i] ? 0xFF : 0; return x; }
INLINE vb vb_shuffle(vb x, vb idx) {  // within each 16-byte quarter, as pshufb (no zeroing used)
    vb r;
    for (int i = 0; i < 64; i++) r.v[i] = x.v[(i & ~15) | (idx.v[i] & 15)];
    return r;
}
INLINE vb vb_pattern(uint32_t p) { vb r; for (int i = 0; i < 16; i++) memcpy(r.v + 4 * i, &p, 4); return r; }
INLINE vb vb_lanes4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    const uint32_t q[4] = {a, b, c, d};
    vb r;
    for (int i = 0; i < 16; i++) memcpy(r.v + 4 * i, &q[i % 4], 4);
    return r;
}
INLINE vi vi_zero(void) { vi r; memset(&r, 0, sizeof r); return r; }
INLINE vi vi_dot(vi acc, vb w, vb x) {
    for (int i = 0; i < 16; i++)
        for (int k = 0; k < 4; k++) acc.v[i] += (int32_t)w.v[4 * i + k] * (int8_t)x.v[4 * i + k];
    return acc;
}
INLINE vi vi_dot2(vi acc, vb w1, vb x1, vb w2, vb x2) { return vi_dot(vi_dot(acc, w1, x1), w2, x2); }
INLINE vi vi_join(vi hi, vi lo) { for (int i = 0; i < 16; i++) lo.v[i] += hi.v[i] * 256; return lo; }
INLINE vi vi_add(vi x, vi y) { for (int i = 0; i < 16; i++) x.v[i] += y.v[i]; return x; }
INLINE vf vf_cvt(vi x) { vf r; for (int i = 0; i < 16; i++) r.v[i] = (float)x.v[i]; return r; }
INLINE vf vf_zero(void) { vf r; memset(&r, 0, sizeof r); return r; }
INLINE vf vf_load(const float *p) { vf r; memcpy(r.v, p, 64); return r; }
INLINE void vf_store(float *p, vf x) { memcpy(p, x.v, 64); }
INLINE vf vf_set1(float s) { vf r; for (int i = 0; i < 16; i++) r.v[i] = s; return r; }
INLINE vf vf_mul(vf x, vf y) { for (int i = 0; i < 16; i++) x.v[i] *= y.v[i]; return x; }
INLINE vf vf_fmadd(vf x, vf y, vf z) { for (int i = 0; i < 16; i++) z.v[i] = fmaf(x.v[i], y.v[i], z.v[i]); return z; }
INLINE vf vf_half(const uint8_t *p) { vf r; for (int i = 0; i < 16; i++) r.v[i] = f16(p + 2 * i); return r; }
INLINE vf vf_e8m0(const uint8_t *p) { vf r; for (int i = 0; i < 16; i++) r.v[i] = e8m0_half(p[i]); return r; }
INLINE vf vf_u8(const uint8_t *p) { vf r; for (int i = 0; i < 16; i++) r.v[i] = p[i]; return r; }
INLINE vf vf_i8(const uint8_t *p) { vf r; for (int i = 0; i < 16; i++) r.v[i] = (int8_t)p[i]; return r; }
INLINE vf vf_abs(vf x) { for (int i = 0; i < 16; i++) x.v[i] = fabsf(x.v[i]); return x; }
INLINE vf vf_max(vf x, vf y) { for (int i = 0; i < 16; i++) x.v[i] = fmaxf(x.v[i], y.v[i]); return x; }
INLINE vf vf_min(vf x, vf y) { for (int i = 0; i < 16; i++) x.v[i] = fminf(x.v[i], y.v[i]); return x; }
INLINE float vf_hmax(vf x) { float m = x.v[0]; for (int i = 1; i < 16; i++) m = fmaxf(m, x.v[i]); return m; }
INLINE vf vf_rint(vf x) { for (int i = 0; i < 16; i++) x.v[i] = rintf(x.v[i]); return x; }
INLINE vf vf_sub(vf x, vf y) { for (int i = 0; i < 16; i++) x.v[i] -= y.v[i]; return x; }
INLINE vi vi_of(vf x) { vi r; for (int i = 0; i < 16; i++) r.v[i] = (int32_t)x.v[i]; return r; }
INLINE void vi_store8(int8_t *p, vi x) { for (int i = 0; i < 16; i++) p[i] = (int8_t)x.v[i]; }
INLINE int vi_sum(vi x) { int t = 0; for (int i = 0; i < 16; i++) t += x.v[i]; return t; }
#endif

// 16 bytes, one per row of a group: the K-quants' scale bytes, decoded for all rows at once.
#if defined(__SSE2__)
typedef __m128i b16;
INLINE b16 b16_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
INLINE b16 b16_and(b16 a, int m) { return _mm_and_si128(a, _mm_set1_epi8((char)m)); }
INLINE b16 b16_or(b16 a, b16 b) { return _mm_or_si128(a, b); }
INLINE b16 b16_srl(b16 a, int n) { return b16_and(_mm_srli_epi16(a, n), 0xFF >> n); }
INLINE b16 b16_sll(b16 a, int n) { return b16_and(_mm_slli_epi16(a, n), (0xFF << n) & 0xFF); }
#else
typedef struct { uint8_t v[16]; } b16;
INLINE b16 b16_load(const uint8_t *p) { b16 r; memcpy(r.v, p, 16); return r; }
INLINE b16 b16_and(b16 a, int m) { for (int i = 0; i < 16; i++) a.v[i] &= (uint8_t)m; return a; }
INLINE b16 b16_or(b16 a, b16 b) { for (int i = 0; i < 16; i++) a.v[i] |= b.v[i]; return a; }
INLINE b16 b16_srl(b16 a, int n) { for (int i = 0; i < 16; i++) a.v[i] >>= n; return a; }
INLINE b16 b16_sll(b16 a, int n) { for (int i = 0; i < 16; i++) a.v[i] = (uint8_t)(a.v[i] << n); return a; }
#endif
INLINE vf vf_b16(b16 a) {  // the 16 bytes as floats, one per lane
    uint8_t t[16];
    memcpy(t, &a, 16);
    return vf_u8(t);
}
