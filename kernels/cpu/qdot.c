// Products with weights in GGML's block formats against x quantized to 8-bit blocks, on CPUs:
// y (M, N) = x (M, K) @ W.T.
//
// Weights are repacked once, at load, losslessly: each group of 16 rows is stored unit by unit
// (a unit: the rows' blocks over 32 columns, or 256 for the K-quants), the 16 block headers
// side by side and the codes interleaved 4 bytes per row, so that one 64-byte vector holds 4
// codes of each of the 16 rows (zoo_repack; same bytes as the file, reordered). x is quantized
// once per product, each row on its own, in blocks of 32: 8-bit codes and the 8-bit codes of
// their remainder, 15 bits in effect (zoo_q8_quantize_row, below). A vector of codes then
// meets 4 codes of x broadcast to every lane in one u8 x s8 multiply-add (vpdpbusd where the
// CPU has VNNI; maddubs + madd on AVX2), so the integer sums of a block land in one lane per
// output row and are scaled once per block:
//     y[n] += fw[n, b] * d_x[b] * (q_w . q_x)_b + mw[n, b] * (d_x * sum q_x)_b
// (q_x = 256 q1 + q2: two multiply-adds per vector of codes, the sums joined once a block)
// (fw, mw: the block's scale and minimum, or for the K-quants d * sub-scale and -dmin * min;
// Q6_K's -32 * d * sub-scale per 16 columns). The codes of a group are unpacked once and serve
// every row of x: a step of 4 rows of x costs little more than a step of 1.
// Each output (row of x, row of W) is computed by the same instructions in the same order
// whatever the number of rows of x or threads, so a token's product does not depend on the
// batch or on how a prompt was cut into chunks. Layouts: ggml-common.h (block_q4_0 ...).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "zoo_cpu.h"

#if defined(__SSE2__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float f16(const uint8_t *p) {  // a little-endian fp16
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// ---- the formats -------------------------------------------------------------------------------
#define R 16  // rows per group

static int64_t block_bytes(int64_t type) {
    switch (type) {
        case ZOO_Q4_0: return 18;
        case ZOO_Q4_1: return 20;
        case ZOO_Q5_0: return 22;
        case ZOO_Q5_1: return 24;
        case ZOO_Q8_0: return 34;
        case ZOO_Q4_K: return 144;
        case ZOO_Q5_K: return 176;
        case ZOO_Q6_K: return 210;
        case ZOO_MXFP4: return 17;
        default: return 0;
    }
}

static int64_t block_values(int64_t type) {
    return type == ZOO_Q4_K || type == ZOO_Q5_K || type == ZOO_Q6_K ? 256 : 32;
}

int64_t zoo_block_bytes(int64_t type) { return block_bytes(type); }
int64_t zoo_block_values(int64_t type) { return block_values(type); }

// A group of 16 rows is stored unit by unit (a unit: the 16 rows' blocks over the same
// columns), headers first, then codes: [headers of units 0..nu-1, padded to 64 bytes][codes of
// units 0..nu-1], every unit's codes a multiple of 64 bytes, so the kernels' 64-byte loads of
// codes never straddle cache lines. In a unit's headers, 2-byte fields (fp16 d, dmin / m) of
// the 16 rows sit side by side and other header bytes byte-major (byte k of the 16 rows
// together); codes go in pieces of 4 bytes per row (one 64-byte vector: 4 bytes of each row).
// part: {offset in the block, length, offset in the unit's headers or codes, bytes per row in
// a piece, 1 if a part of the codes}.
typedef struct { int src, len, dst, piece, code; } part_t;

typedef struct { int header, codes, parts; part_t p[6]; } layout_t;

static layout_t layout(int64_t type) {
    const part_t d0 = {0, 2, 0, 2, 0};
    switch (type) {
        case ZOO_Q8_0: return (layout_t){32, 512, 2, {d0, {2, 32, 0, 4, 1}}};
        case ZOO_Q4_0: return (layout_t){32, 256, 2, {d0, {2, 16, 0, 4, 1}}};
        case ZOO_MXFP4:  // headers: the e8m0 scale byte; codes as Q4_0's
            return (layout_t){16, 256, 2, {{0, 1, 0, 1, 0}, {1, 16, 0, 4, 1}}};
        case ZOO_Q4_1: return (layout_t){64, 256, 3, {d0, {2, 2, 32, 2, 0}, {4, 16, 0, 4, 1}}};
        case ZOO_Q5_0:  // codes: 64 bytes of high bits (the rows' 32-bit masks), then the nibbles
            return (layout_t){32, 320, 3, {d0, {2, 4, 0, 4, 1}, {6, 16, 64, 4, 1}}};
        case ZOO_Q5_1:
            return (layout_t){64, 320, 4, {d0, {2, 2, 32, 2, 0}, {4, 4, 0, 4, 1}, {8, 16, 64, 4, 1}}};
        case ZOO_Q4_K:  // headers: d, dmin, 12 scale bytes; codes: 128 bytes of nibbles
            return (layout_t){256, 2048, 4, {d0, {2, 2, 32, 2, 0}, {4, 12, 64, 1, 0}, {16, 128, 0, 4, 1}}};
        case ZOO_Q5_K:  // codes: 32 bytes of high bits, then the nibbles
            return (layout_t){256, 2560, 5, {d0, {2, 2, 32, 2, 0}, {4, 12, 64, 1, 0},
                                             {16, 32, 0, 4, 1}, {48, 128, 512, 4, 1}}};
        case ZOO_Q6_K:  // headers: d, 16 int8 scales; codes: per half of the columns, its 64
            // bytes of low bits and 32 of high bits (the order the kernel reads them in)
            return (layout_t){288, 3072, 6, {{208, 2, 0, 2, 0}, {192, 16, 32, 1, 0},
                                             {0, 64, 0, 4, 1}, {128, 32, 1024, 4, 1},
                                             {64, 64, 1536, 4, 1}, {160, 32, 2560, 4, 1}}};
    }
    return (layout_t){0, 0, 0, {{0}}};
}

static inline int64_t pad64(int64_t n) { return (n + 63) / 64 * 64; }

// Bytes of one group of 16 rows over nu units.
static int64_t group_bytes(int64_t type, int64_t nu) {
    const layout_t l = layout(type);
    return pad64(nu * l.header) + nu * l.codes;
}

// Bytes of W repacked: whole groups of 16 rows (the last padded with zero rows).
int64_t zoo_repacked_bytes(int64_t type, int64_t N, int64_t K) {
    return (N + R - 1) / R * group_bytes(type, K / block_values(type));
}

// Row i's block of unit u <-> its place in the group; `to_group`: block -> group. Inlined
// with a constant type (repack_group), the layout folds away into plain moves.
static inline __attribute__((always_inline)) void move_block(int64_t type, uint8_t *group,
                                                             int64_t nu, int64_t u,
                                                             uint8_t *block, int i,
                                                             int to_group) {
    const layout_t l = layout(type);
    uint8_t *hdr = group + u * l.header, *codes = group + pad64(nu * l.header) + u * l.codes;
    for (int k = 0; k < l.parts; k++) {
        const part_t p = l.p[k];
        for (int at = 0; at < p.len; at += p.piece) {
            uint8_t *g = (p.code ? codes : hdr) + p.dst + R * at + p.piece * i;
            if (to_group)
                memcpy(g, block + p.src + at, p.piece);
            else
                memcpy(block + p.src + at, g, p.piece);
        }
    }
}

static inline __attribute__((always_inline)) void repack_group(int64_t type,
                                                               const uint8_t *const *rows,
                                                               int n, int64_t nu, uint8_t *out) {
    const int64_t bb = block_bytes(type);
    memset(out, 0, group_bytes(type, nu));  // rows past N: zero blocks (scale 0)
    for (int i = 0; i < n; i++)
        for (int64_t u = 0; u < nu; u++) move_block(type, out, nu, u, (uint8_t *)rows[i] + u * bb, i, 1);
}

// rows: where each of W's N rows of K / block_values blocks is, as a file stores it (rows of
// several tensors, or in another order: llama.cpp's q/k row order is undone here); dst:
// zoo_repacked_bytes of it.
void zoo_repack(int64_t type, const uint8_t *const *rows, int64_t N, int64_t K, uint8_t *dst,
                int threads) {
    const int64_t nu = K / block_values(type), G = (N + R - 1) / R, gb = group_bytes(type, nu);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        const int n = N - g * R < R ? (int)(N - g * R) : R;
        switch (type) {
#define TYPE(t) case t: repack_group(t, rows + g * R, n, nu, dst + g * gb); break;
            TYPE(ZOO_Q4_0) TYPE(ZOO_Q4_1) TYPE(ZOO_Q5_0) TYPE(ZOO_Q5_1) TYPE(ZOO_Q8_0)
            TYPE(ZOO_Q4_K) TYPE(ZOO_Q5_K) TYPE(ZOO_Q6_K) TYPE(ZOO_MXFP4)
#undef TYPE
        }
    }
}

// Q4_K / Q5_K: 12 bytes of 6-bit sub-scales and mins -> 8 of each (get_scale_min_k4's layout:
// the low 6 bits of bytes 0-7 hold the first four of each, the last four are a nibble of bytes
// 8-11 plus the top two bits of bytes 0-7), four bytes at a time.
static inline void k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], out[4];
    memcpy(u, s, 12);
    out[0] = u[0] & 0x3F3F3F3F;                                               // sc 0-3
    out[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);         // sc 4-7
    out[2] = u[1] & 0x3F3F3F3F;                                               // mn 0-3
    out[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);  // mn 4-7
    memcpy(sc, out, 8);
    memcpy(mn, out + 2, 8);
}

// MXFP4: e2m1 codes as doubled values (kvalues_mxfp4), and the block scale: ggml's
// ggml_e8m0_to_fp32_half, 2^(e - 128) (subnormal below e = 2).
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// ---- dequantization: the gguf package's floats bit for bit (the same fp32 operations) ----------
static void dequantize_block(int64_t type, const uint8_t *b, float *out) {
    switch (type) {
        case ZOO_MXFP4: {
            const float d = e8m0_half(b[0]);
            for (int j = 0; j < 32; j++) out[j] = d * (float)MXFP4_VALUES[(b[1 + (j & 15)] >> (j < 16 ? 0 : 4)) & 15];
            return;
        }
        case ZOO_Q8_0: {
            const float d = f16(b);
            for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
            return;
        }
        case ZOO_Q4_0:
        case ZOO_Q4_1: {
            const int min = type == ZOO_Q4_1;
            const float d = f16(b), m = min ? f16(b + 2) : 0.0f;
            const uint8_t *qs = b + (min ? 4 : 2);
            for (int j = 0; j < 32; j++) {
                const int q = (qs[j & 15] >> (j < 16 ? 0 : 4)) & 15;
                out[j] = min ? d * (float)q + m : d * (float)(q - 8);
            }
            return;
        }
        case ZOO_Q5_0:
        case ZOO_Q5_1: {
            const int min = type == ZOO_Q5_1;
            const float d = f16(b), m = min ? f16(b + 2) : 0.0f;
            uint32_t qh;
            memcpy(&qh, b + (min ? 4 : 2), 4);
            const uint8_t *qs = b + (min ? 8 : 6);
            for (int j = 0; j < 32; j++) {
                const int q = ((qs[j & 15] >> (j < 16 ? 0 : 4)) & 15) | (((qh >> j) & 1) << 4);
                out[j] = min ? d * (float)q + m : d * (float)(q - 16);
            }
            return;
        }
        case ZOO_Q4_K:
        case ZOO_Q5_K: {
            const float d = f16(b), dmin = f16(b + 2);
            uint8_t sc[8], mn[8];
            k4_scales(b + 4, sc, mn);
            const int five = type == ZOO_Q5_K;
            const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
            for (int s = 0; s < 8; s++) {  // sub-block s: run s / 2's low (even) or high nibbles
                const float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
                for (int i = 0; i < 32; i++) {
                    int q = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 15;
                    if (five) q |= ((qh[i] >> s) & 1) << 4;
                    out[32 * s + i] = ds * (float)q - dm;
                }
            }
            return;
        }
        case ZOO_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = f16(b + 208);
            for (int c = 0; c < 8; c++) {  // chunks of 32 columns, in the gguf package's order
                const int h = c / 4, k = c % 4;
                for (int i = 0; i < 32; i++) {
                    const int lo = (ql[64 * h + 32 * (k % 2) + i] >> (4 * (k / 2))) & 15;
                    const int hi = (qh[32 * h + i] >> (2 * k)) & 3;
                    const int col = 32 * c + i;
                    out[col] = (d * (float)sc[col / 16]) * (float)((lo | (hi << 4)) - 32);
                }
            }
            return;
        }
    }
}

// Rows ids (n of them; NULL: 0..n-1) of a repacked W as floats (n, K): embedding lookups, and
// the reference the products are tested against.
void zoo_dequantize_rows(const qweight_t *w, const int64_t *ids, int64_t n, float *out,
                         int threads) {
    const int64_t per = block_values(w->type), nu = w->K / per;
    if (n * w->K < (1 << 18)) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < n; k++) {
        const int64_t row = ids ? ids[k] : k;
        uint8_t *group = (uint8_t *)w->data + row / R * group_bytes(w->type, nu);
        uint8_t block[256];
        for (int64_t u = 0; u < nu; u++) {
            move_block(w->type, group, nu, u, block, (int)(row % R), 0);
            dequantize_block(w->type, block, out + k * w->K + u * per);
        }
    }
}

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

const char *zoo_qdot_isa(void) { return ZOO_QDOT_ISA; }

// ---- x in 8-bit blocks, twice --------------------------------------------------------------------
// Each block of 32 values is quantized twice: codes q1 = rint(x / d), d = max|x| / 127, then
// the remainder's, q2 = rint((x - d q1) / (d / 256)) (clamped to +-127). The kernels multiply
// both (one more multiply-add per vector of codes) and join the integer sums as 256 s1 + s2:
// x in effect has 15 bits, x = (d / 256) (256 q1 + q2). One 8-bit pass lost 8% of SmolLM2's
// top-1 tokens (KL 5e-3 against the float model: a few huge activations leave the others of
// their block a step or two); with the remainder's codes, KL 5e-8.
// One row's buffer, sections 64-byte aligned, K padded to a multiple of 64 with zeros:
//   q1 int8 (Kp) | q2 int8 (Kp) | d float (Kp / 32): d / 256 | ds float (Kp / 32):
//   (d / 256) * sum(256 q1 + q2) | ds16 float (Kp / 16): the same per half block
int64_t zoo_q8_row_bytes(int64_t K) {
    const int64_t Kp = pad64(K);
    return 2 * Kp + 2 * pad64(Kp / 32 * 4) + pad64(Kp / 16 * 4);
}

void zoo_q8_quantize_row(const float *x, int64_t K, void *buf, q8row_t *row) {
    const int64_t Kp = pad64(K);
    int8_t *q = (int8_t *)buf, *q2 = q + Kp;
    float *d = (float *)(q2 + Kp), *ds = (float *)((char *)d + pad64(Kp / 32 * 4));
    float *ds16 = (float *)((char *)ds + pad64(Kp / 32 * 4));
    memset(buf, 0, zoo_q8_row_bytes(K));
    const vf top = vf_set1(127.0f), bottom = vf_set1(-127.0f);
    for (int64_t b = 0; b < K / 32; b++) {
        const vf x0 = vf_load(x + 32 * b), x1 = vf_load(x + 32 * b + 16);
        const float amax = vf_hmax(vf_max(vf_abs(x0), vf_abs(x1)));
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 1.0f / scale : 0.0f;
        const vf s = vf_set1(scale), i1 = vf_set1(inv), i2 = vf_set1(inv * 256.0f);
        int sums[2];
        for (int h = 0; h < 2; h++) {  // 16 values: codes, the remainder's codes
            const vf xv = h ? x1 : x0;
            const vf v1 = vf_rint(vf_mul(xv, i1));  // nearest, ties to even
            const vf rest = vf_sub(xv, vf_mul(s, v1));  // not fused: as the reference rounds
            const vf v2 = vf_min(vf_max(vf_rint(vf_mul(rest, i2)), bottom), top);
            const vi c1 = vi_of(v1), c2 = vi_of(v2);
            vi_store8(q + 32 * b + 16 * h, c1);
            vi_store8(q2 + 32 * b + 16 * h, c2);
            sums[h] = 256 * vi_sum(c1) + vi_sum(c2);
        }
        const float unit = scale / 256.0f;
        d[b] = unit;
        ds[b] = unit * (float)(sums[0] + sums[1]);
        ds16[2 * b] = unit * (float)sums[0];
        ds16[2 * b + 1] = unit * (float)sums[1];
    }
    row->q = q;
    row->q2 = q2;
    row->d = d;
    row->ds = ds;
    row->ds16 = ds16;
}

// The next unit's codes, requested ahead: the hardware's prefetchers do not follow the
// kernels' order within a unit far enough (Q6_K from memory: 10 GB/s a core without, 32 with).
#ifndef PF_AHEAD
#define PF_AHEAD 2  // units ahead: 1, 2, 4 and 8 measured within 3% of each other; 2 best
#endif
INLINE void prefetch(const uint8_t *p, int64_t n) {
#if defined(__SSE2__)
    for (int64_t k = 0; k < n; k += 64) _mm_prefetch((const char *)(p + k), _MM_HINT_T0);
#else
    (void)p, (void)n;
#endif
}

// ---- the microkernels: one group of 16 rows of W against M rows of x --------------------------------
// acc[r] (16 lanes: the group's rows) gathers row r of x's products, block by block:
// acc += cvt(int sum) * (fw * d_x) + mw * ds_x. M is a constant where dot_group_m calls them,
// so the accumulators stay in registers; a row's arithmetic does not depend on M.

// The block factors of one unit of a legacy type: scale fw, and mw (minimum, or the offset
// term -8 / -16 * d).
INLINE void legacy_factors(int64_t type, const uint8_t *u, vf *fw, vf *mw) {
    if (type == ZOO_MXFP4) {  // codes made unsigned: value + 12 (mk_legacy), so -12 * d
        *fw = vf_e8m0(u);
        *mw = vf_mul(*fw, vf_set1(-12.0f));
        return;
    }
    *fw = vf_half(u);
    if (type == ZOO_Q4_1 || type == ZOO_Q5_1)
        *mw = vf_half(u + 32);
    else if (type == ZOO_Q8_0)
        *mw = vf_zero();
    else
        *mw = vf_mul(*fw, vf_set1(type == ZOO_Q4_0 ? -8.0f : -16.0f));
}

// Q5_0 / Q5_1: 0x10 in the bytes whose code has its fifth bit set: codes 4g..4g+3 (low) or
// 16+4g.. (high) of each row, from the row's 32 bits of high bits (one lane).
INLINE vb q5_high(vb qh, int first) {
    const int byte = first / 8, shift = first % 8;  // bits first..first+3 sit in one byte
    const vb idx = vb_lanes4(0x01010101u * (uint32_t)byte, 0x01010101u * (uint32_t)(4 + byte),
                             0x01010101u * (uint32_t)(8 + byte), 0x01010101u * (uint32_t)(12 + byte));
    const vb bits = vb_pattern(0x08040201u << shift);
    return vb_and(vb_bytemask(vb_shuffle(qh, idx), bits), vb_set1(0x10));
}

// s1 += w . q1, s2 += w . q2 for 4 codes of x (at column `at`) in every lane. With several
// rows of x, AVX-512 takes x's codes straight from memory within the multiply-add ({1to16}:
// one instruction where compilers emit a broadcast and a multiply-add; 10-20% faster at 4
// rows, slower at one).
INLINE void dot2(vi *s1, vi *s2, vb w, const q8row_t *x, int64_t at, int M) {
#if defined(__AVX512VNNI__) && defined(ZOO_QDOT_ISA_AVX512)
    if (M > 1) {
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*s1) : "v"(w), "m"(*(const int32_t *)(x->q + at)));
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*s2) : "v"(w), "m"(*(const int32_t *)(x->q2 + at)));
        return;
    }
#else
    (void)M;
#endif
    *s1 = vi_dot(*s1, w, vb_x(x->q + at));
    *s2 = vi_dot(*s2, w, vb_x(x->q2 + at));
}

// dot2 for two vectors of codes (each under 64) at columns a1 and a2: one widening for both
// without VNNI (vi_dot2).
INLINE void dot2x2(vi *s1, vi *s2, vb w1, vb w2, const q8row_t *x, int64_t a1, int64_t a2, int M) {
#if defined(__AVX512VNNI__) && defined(ZOO_QDOT_ISA_AVX512)
    if (M > 1) {
        dot2(s1, s2, w1, x, a1, M);
        dot2(s1, s2, w2, x, a2, M);
        return;
    }
#else
    (void)M;
#endif
    *s1 = vi_dot2(*s1, w1, vb_x(x->q + a1), w2, vb_x(x->q + a2));
    *s2 = vi_dot2(*s2, w1, vb_x(x->q2 + a1), w2, vb_x(x->q2 + a2));
}

// acc += cvt(256 s1 + s2) * fw * d_x + mw * ds_x: a block's (or sub-block's) sums, scaled.
INLINE vf flush(vf acc, vi s1, vi s2, vf fw, vf mw, float d, float ds) {
    acc = vf_fmadd(vf_cvt(vi_join(s1, s2)), vf_mul(fw, vf_set1(d)), acc);
    return vf_fmadd(mw, vf_set1(ds), acc);
}

INLINE void mk_legacy(int64_t type, const uint8_t *w, int64_t nu, const q8row_t *x, int M,
                      vf *acc) {
    const layout_t l = layout(type);
    const uint8_t *codes = w + pad64(nu * l.header);
    const vb low = vb_set1(0x0F);
    const int five = type == ZOO_Q5_0 || type == ZOO_Q5_1, fp4 = type == ZOO_MXFP4;
    // MXFP4's codes -> their doubled e2m1 values + 12 (0..24: unsigned, as the products need)
    const vb fp4_values = vb_lanes4(0x0F0E0D0Cu, 0x18141210u, 0x090A0B0Cu, 0x00040608u);
    for (int64_t b = 0; b < nu; b++) {
        const uint8_t *u = w + b * l.header, *qh = codes + b * l.codes, *qs = qh + (five ? 64 : 0);
        prefetch(qh + PF_AHEAD * l.codes, l.codes);
        vf fw, mw;
        legacy_factors(type, u, &fw, &mw);
        vi s1[ROWS], s2[ROWS];
UNROLL
        for (int r = 0; r < M; r++) s1[r] = s2[r] = vi_zero();
        if (type == ZOO_Q8_0) {  // signed codes: |w| times x with w's sign
UNROLL
            for (int g = 0; g < 8; g++) {
                const vb c = vb_load(qs + 64 * g), w8 = vb_abs8(c);
UNROLL
                for (int r = 0; r < M; r++) {
                    s1[r] = vi_dot(s1[r], w8, vb_sign8(vb_x(x[r].q + 32 * b + 4 * g), c));
                    s2[r] = vi_dot(s2[r], w8, vb_sign8(vb_x(x[r].q2 + 32 * b + 4 * g), c));
                }
            }
        } else {
            const vb hb = five ? vb_load(qh) : low;
UNROLL
            for (int g = 0; g < 4; g++) {
                const vb c = vb_load(qs + 64 * g);
                vb lo = vb_and(c, low), hi = vb_and(vb_srl(c, 4), low);
                if (five) {
                    lo = vb_or(lo, q5_high(hb, 4 * g));
                    hi = vb_or(hi, q5_high(hb, 16 + 4 * g));
                }
                if (fp4) {
                    lo = vb_shuffle(fp4_values, lo);
                    hi = vb_shuffle(fp4_values, hi);
                }
UNROLL
                for (int r = 0; r < M; r++) {
                    dot2x2(&s1[r], &s2[r], lo, hi, &x[r], 32 * b + 4 * g, 32 * b + 16 + 4 * g, M);
                }
            }
        }
UNROLL
        for (int r = 0; r < M; r++) acc[r] = flush(acc[r], s1[r], s2[r], fw, mw, x[r].d[b], x[r].ds[b]);
    }
}

// Q4_K / Q5_K: 8 sub-blocks of 32 per unit, run j holding sub-blocks 2j (low nibbles) and
// 2j + 1 (high); each sub-block's scale d * sc and minimum -dmin * m, for the 16 rows.
INLINE void k45_factors(const uint8_t *u, float fw[8][R], float mw[8][R]) {
    b16 S[12];  // k4_scales for the 16 rows at once: byte k of every row is one vector
    for (int k = 0; k < 12; k++) S[k] = b16_load(u + 64 + R * k);
    const vf d = vf_half(u), dmin = vf_mul(vf_half(u + 32), vf_set1(-1.0f));
    for (int t = 0; t < 4; t++) {
        const b16 sc = b16_and(S[t], 63), mn = b16_and(S[t + 4], 63);
        const b16 sc4 = b16_or(b16_and(S[t + 8], 15), b16_sll(b16_srl(S[t], 6), 4));
        const b16 mn4 = b16_or(b16_srl(S[t + 8], 4), b16_sll(b16_srl(S[t + 4], 6), 4));
        vf_store(fw[t], vf_mul(vf_b16(sc), d));
        vf_store(mw[t], vf_mul(vf_b16(mn), dmin));
        vf_store(fw[t + 4], vf_mul(vf_b16(sc4), d));
        vf_store(mw[t + 4], vf_mul(vf_b16(mn4), dmin));
    }
}

// Columns 32 sub + 4g .. + 3 of the 16 rows (sub-block sub: run sub / 2's low or high nibbles,
// with Q5_K's fifth bit from bit `sub` of each code's byte of high bits).
INLINE vb k45_codes(int five, const uint8_t *qs, const uint8_t *qh, int sub, int g) {
    const vb low = vb_set1(0x0F), c = vb_load(qs + 64 * (8 * (sub / 2) + g));
    vb q = sub % 2 ? vb_and(vb_srl(c, 4), low) : vb_and(c, low);
    if (five) {
        const vb h = vb_load(qh + 64 * g);
        q = vb_or(q, vb_and(sub < 4 ? vb_sll(h, 4 - sub) : vb_srl(h, sub - 4), vb_set1(0x10)));
    }
    return q;
}

// Q6_K: 16 sub-blocks of 16 per unit with int8 scales, codes 0..63 less 32. Half h holds 128
// columns: from its low bits' first (L0) and second (L1) 32 bytes and its 32 bytes of high
// bits (H), column 4g + k of chunk c is  c 0: L0 & 15 | H bits 0-1,  c 1: L1 & 15 | H 2-3,
// c 2: L0 >> 4 | H 4-5,  c 3: L1 >> 4 | H 6-7  (4 codes of each row per vector). Sub-block
// `sub` (columns 16 sub ..) is half sub / 8, chunk (sub / 2) % 4, its g (0-3) 4 (sub % 2) + g.
INLINE vb q6_codes(const uint8_t *unit_codes, int sub, int g) {
    const int h = sub / 8, c = (sub / 2) % 4, at = 4 * (sub % 2) + g;
    const uint8_t *ql = unit_codes + 1536 * h, *qh = ql + 1024;
    const vb low = vb_set1(0x0F), top = vb_set1(0x30);
    const vb lb = vb_load(ql + 64 * (8 * (c % 2) + at)), hb = vb_load(qh + 64 * at);
    const vb lo = c < 2 ? vb_and(lb, low) : vb_and(vb_srl(lb, 4), low);
    const vb hi = vb_and(c == 0 ? vb_sll(hb, 4) : c == 1 ? vb_sll(hb, 2) : c == 2 ? hb
                         : vb_srl(hb, 2), top);  // fmt: skip
    return vb_or(lo, hi);
}

INLINE void q6_factors(const uint8_t *u, float fw[16][R], float mw[16][R]) {
    const vf d = vf_half(u);
    for (int sub = 0; sub < 16; sub++) {
        const vf f = vf_mul(vf_i8(u + 32 + R * sub), d);
        vf_store(fw[sub], f);
        vf_store(mw[sub], vf_mul(f, vf_set1(-32.0f)));
    }
}

// A K-quant unit's sub-blocks (8 of 32 columns, or Q6_K's 16 of 16) against M rows of x, in
// column order, sub-block by sub-block: s1, s2 over its codes (codes(sub, g)), then flushed
// into acc with its factors. The one arithmetic of every K-quant product: streamed from the
// weights (decode) or from a unit unpacked ahead (many rows: kq_rows).
#define KQ_PASS(nsub, codes)                                                                  \
    for (int sub = 0; sub < (nsub); sub++) {                                                  \
        vi s1[ROWS], s2[ROWS];                                                                \
        UNROLL for (int r = 0; r < M; r++) s1[r] = s2[r] = vi_zero();                         \
        UNROLL for (int g2 = 0; g2 < 256 / (nsub) / 4; g2 += 2) {  /* codes g2, g2 + 1 */     \
            vb q[2];                                                                          \
            UNROLL for (int g = g2; g < g2 + 2; g++) q[g - g2] = codes;                       \
            const int64_t at = 256 * s + 256 / (nsub) * sub + 4 * g2;                         \
            UNROLL for (int r = 0; r < M; r++)                                                \
                dot2x2(&s1[r], &s2[r], q[0], q[1], &x[r], at, at + 4, M);                     \
        }                                                                                     \
        const vf f = vf_load(fw[sub]), m = vf_load(mw[sub]);                                  \
        UNROLL for (int r = 0; r < M; r++) {                                                  \
            const int64_t blk = 8 * s + sub * 8 / (nsub);                                     \
            const float off = (nsub) == 16 ? x[r].ds16[16 * s + sub] : x[r].ds[blk];          \
            acc[r] = flush(acc[r], s1[r], s2[r], f, m, x[r].d[blk], off);                     \
        }                                                                                     \
    }

INLINE void mk_k45(int five, const uint8_t *w, int64_t nu, const q8row_t *x, int M, vf *acc) {
    const uint8_t *codes = w + pad64(nu * 256);
    for (int64_t s = 0; s < nu; s++) {
        const uint8_t *u = w + s * 256, *qh = codes + s * (five ? 2560 : 2048);
        const uint8_t *qs = qh + (five ? 512 : 0);
        prefetch(qh + PF_AHEAD * (five ? 2560 : 2048), five ? 2560 : 2048);
        float fw[8][R] __attribute__((aligned(64))), mw[8][R] __attribute__((aligned(64)));
        k45_factors(u, fw, mw);
        UNROLL_SUBS KQ_PASS(8, k45_codes(five, qs, qh, sub, g))
    }
}

INLINE void mk_q6_k(const uint8_t *w, int64_t nu, const q8row_t *x, int M, vf *acc) {
    const uint8_t *codes = w + pad64(nu * 288);
    for (int64_t s = 0; s < nu; s++) {
        prefetch(codes + (s + PF_AHEAD) * 3072, 3072);
        float fw[16][R] __attribute__((aligned(64))), mw[16][R] __attribute__((aligned(64)));
        q6_factors(w + s * 288, fw, mw);
        if (M == 1) {  // one row: unrolled, each sub-block's shifts constant (AVX2: +13%)
            UNROLL_Q6 KQ_PASS(16, q6_codes(codes + s * 3072, sub, g))
        } else {  // (AVX2: more rows unrolled spill registers, -30%)
            UNROLL_SUBS KQ_PASS(16, q6_codes(codes + s * 3072, sub, g))
        }
    }
}

// One unit's codes unpacked for many passes of rows: ub[sub][g] (64 bytes each).
INLINE void mk_unpacked(const uint8_t *ub, int nsub, const float *fwp, const float *mwp,
                        int64_t s, const q8row_t *x, int M, vf *acc) {
    const float (*fw)[R] = (const float (*)[R])fwp, (*mw)[R] = (const float (*)[R])mwp;
    if (nsub == 8) {  // (sub-blocks not unrolled: the loads need no constant, the registers do)
        _Pragma("GCC unroll 1") KQ_PASS(8, vb_load(ub + 64 * (8 * sub + g)))
    } else {
        _Pragma("GCC unroll 1") KQ_PASS(16, vb_load(ub + 64 * (4 * sub + g)))
    }
}

// Many rows of x against one Q5_K / Q6_K group, unit by unit: the unit's factors decoded and its
// codes unpacked once (ub: 4 KiB, in L1), then every pass of rows of x through it, each
// pass's sums carried in acc (M x 16 floats) from unit to unit. The same arithmetic, in the
// same order, as the streamed kernels (mk_k45, mk_q6_k) that decode steps run.
INLINE void unpacked_pass(const uint8_t *ub, int nsub, const float *fw, const float *mw,
                          int64_t s, const q8row_t *x, int M, float *accs) {
    vf acc[ROWS];
UNROLL
    for (int r = 0; r < M; r++) acc[r] = vf_load(accs + R * r);
    mk_unpacked(ub, nsub, fw, mw, s, x, M, acc);
UNROLL
    for (int r = 0; r < M; r++) vf_store(accs + R * r, acc[r]);
}

static void kq_group(const qweight_t *w, const uint8_t *group, const q8row_t *x, int64_t M,
                     float *accs) {
    const int64_t nu = w->K / 256;
    const int q6 = w->type == ZOO_Q6_K, five = w->type == ZOO_Q5_K, nsub = q6 ? 16 : 8;
    const uint8_t *codes = group + pad64(nu * layout(w->type).header);
    uint8_t ub[64 * 64] __attribute__((aligned(64)));
    float fw[16][R] __attribute__((aligned(64))), mw[16][R] __attribute__((aligned(64)));
    memset(fw, 0, sizeof fw);  // Q4_K / Q5_K fill 8 of the 16
    memset(mw, 0, sizeof mw);
    memset(accs, 0, M * R * sizeof(float));
    for (int64_t s = 0; s < nu; s++) {
        if (q6) {
            q6_factors(group + s * 288, fw, mw);
            for (int sub = 0; sub < 16; sub++)
                for (int g = 0; g < 4; g++)
                    vb_store(ub + 64 * (4 * sub + g), q6_codes(codes + s * 3072, sub, g));
        } else {
            const uint8_t *qh = codes + s * (five ? 2560 : 2048), *qs = qh + (five ? 512 : 0);
            k45_factors(group + s * 256, fw, mw);
            for (int sub = 0; sub < 8; sub++)
                for (int g = 0; g < 8; g++)
                    vb_store(ub + 64 * (8 * sub + g), k45_codes(five, qs, qh, sub, g));
        }
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            float *a = accs + r0 * R;
            switch (M - r0 < ROWS ? M - r0 : ROWS) {
#define PASS(k) case k: unpacked_pass(ub, nsub, fw[0], mw[0], s, x + r0, k, a); break;
                PASS(1) PASS(2) PASS(3) PASS(4)
#undef PASS
            }
        }
    }
}

INLINE void dot_group(const qweight_t *w, const uint8_t *group, const q8row_t *x, int M,
                      float *out, int64_t ldo) {
    vf acc[ROWS];
UNROLL
    for (int r = 0; r < M; r++) acc[r] = vf_zero();
    const int64_t nu = w->K / block_values(w->type);
    switch (w->type) {
        case ZOO_Q4_K: mk_k45(0, group, nu, x, M, acc); break;
        case ZOO_Q5_K: mk_k45(1, group, nu, x, M, acc); break;
        case ZOO_Q6_K: mk_q6_k(group, nu, x, M, acc); break;
        default: mk_legacy(w->type, group, nu, x, M, acc);
    }
UNROLL
    for (int r = 0; r < M; r++) vf_store(out + r * ldo, acc[r]);
}

static void dot_group_m(const qweight_t *w, const uint8_t *group, const q8row_t *x, int64_t M,
                        float *out, int64_t ldo) {
    switch (M) {
#define CASE(k) case k: dot_group(w, group, x, k, out, ldo); break;
        CASE(1) CASE(2) CASE(3) CASE(4)
#if ROWS > 4
        CASE(5) CASE(6) CASE(7) CASE(8)
#endif
#undef CASE
    }
}

// The part of a weight that stays in a core's L2 cache while every pass of rows of x goes
// through it (prefill: x's rows are re-read for each part, from the shared L3; each part's
// codes once, from memory).
#define PANEL_BYTES (256 << 10)

// One group against one pass of rows of x: y's rows n0..n1 of it (the group computed whole).
static void group_pass(const qweight_t *w, const uint8_t *group, int64_t g, const q8row_t *x,
                       int64_t k, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    float out[ROWS * R] __attribute__((aligned(64)));
    const int64_t a = g * R > n0 ? g * R : n0, b = (g + 1) * R < n1 ? (g + 1) * R : n1;
    if (a == g * R && b == a + R) {  // a whole group: straight into y
        dot_group_m(w, group, x, k, y + a, ldy);
        return;
    }
    dot_group_m(w, group, x, k, out, R);
    for (int64_t r = 0; r < k; r++)
        for (int64_t n = a; n < b; n++) y[r * ldy + n] = out[r * R + n - g * R];
}

// y[r * ldy + n] = x_r . W[n] for the rows n0 <= n < n1 of W (the M rows of x quantized). The
// groups of 16 rows that the range touches are computed whole; only the range is written.
void zoo_qdot_rows(const qweight_t *w, const q8row_t *x, int64_t M, float *y, int64_t ldy,
                   int64_t n0, int64_t n1) {
    const int64_t gb = group_bytes(w->type, w->K / block_values(w->type));
    // many rows of Q5_K / Q6_K, whose codes take most unpacking: unit by unit (kq_group; Q6_K
    // prefill 19% faster), the others streamed in panels
    if (M > ROWS && (w->type == ZOO_Q5_K || w->type == ZOO_Q6_K)) {
        float *accs = aligned_alloc(64, M * R * sizeof(float));
        for (int64_t g = n0 / R; g * R < n1; g++) {
            kq_group(w, (const uint8_t *)w->data + g * gb, x, M, accs);
            const int64_t a = g * R > n0 ? g * R : n0, b = (g + 1) * R < n1 ? (g + 1) * R : n1;
            for (int64_t r = 0; r < M; r++)
                memcpy(y + r * ldy + a, accs + r * R + a - g * R, (b - a) * sizeof(float));
        }
        free(accs);
        return;
    }
    const int64_t panel = PANEL_BYTES / gb > 1 ? PANEL_BYTES / gb : 1, last = (n1 + R - 1) / R;
    for (int64_t p = n0 / R; p < last; p += panel) {
        const int64_t end = p + panel < last ? p + panel : last;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int64_t k = M - r0 < ROWS ? M - r0 : ROWS;
            for (int64_t g = p; g < end; g++)
                group_pass(w, (const uint8_t *)w->data + g * gb, g, x + r0, k, y + r0 * ldy, ldy,
                           n0, n1);
        }
    }
}

// Any number of rows of x: x quantized by all threads, then each thread takes whole groups of
// W's rows (zoo_qdot_rows).
void zoo_qgemm(const qweight_t *w, const float *x, float *y, int64_t M, int threads) {
    const int64_t bytes = zoo_q8_row_bytes(w->K), G = (w->N + R - 1) / R;
    char *buf = aligned_alloc(64, M * bytes);
    q8row_t *rows = malloc(M * sizeof(q8row_t));
    if (w->N * w->K * M < (1 << 20)) threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            zoo_q8_quantize_row(x + r * w->K, w->K, buf + r * bytes, &rows[r]);
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t g0 = G * t / T, g1 = G * (t + 1) / T;
        zoo_qdot_rows(w, rows, M, y, w->N, g0 * R, g1 * R < w->N ? g1 * R : w->N);
    }
    free(rows);
    free(buf);
}
