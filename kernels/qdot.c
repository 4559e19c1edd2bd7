// Products with weights in GGML's block formats, as a GGUF file stores them, against x
// quantized to 8-bit blocks: y (M, N) = x (M, K) @ W.T.
//
// x is quantized once per product, each row on its own (zoo_q8_quantize): blocks of 32 values
// with a fp32 scale d = max|x| / 127 and codes q = rint(x / d). Every weight format's codes are
// unsigned small integers (Q8_0's are made so with the sign trick), so one dot product of 64
// codes is one u8 x s8 multiply-add instruction where the CPU has VNNI (vpdpbusd), a pair of
// them on AVX2 (maddubs, madd). Per block of 32 the integer sum is scaled by the weight's block
// factor and x's d, in fp32; the weight's offsets and minimums use x's block sums:
//     y = sum_b fw_b d_b (q_w . q_x)_b + mw_b d_b (sum q_x)_b
// (K-quants: fw = d * sub-scale, mw = -dmin * min, or Q6_K's -32 * d * sub-scale per 16).
// Each (row of x, row of W) is computed by the same instructions in the same order whatever the
// number of rows or threads, so a token's product does not depend on the batch or on how a
// prompt was cut into chunks. Layouts: ggml-common.h (block_q4_0 ... block_q6_K).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "zoo_cpu.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float f16(const uint8_t *p) {  // a little-endian fp16 in a block header
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

// Bytes per block and values per block of each kept type (GGML's type ids).
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
        default: return 0;
    }
}

static int64_t block_values(int64_t type) { return type >= ZOO_Q4_K ? 256 : 32; }

int64_t zoo_block_bytes(int64_t type) { return block_bytes(type); }

// Q4_K / Q5_K: 12 bytes of 6-bit sub-scales and mins -> 8 of each (get_scale_min_k4's layout:
// the low 6 bits of bytes 0-7 hold the first four of each, the last four are a nibble of bytes
// 8-11 plus the top two bits of bytes 0-7), worked on four bytes at a time.
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

// ---- dequantization: the gguf package's floats bit for bit (same fp32 operations) -------------
static void dequantize_block(int64_t type, const uint8_t *b, float *out) {
    switch (type) {
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

void zoo_dequantize_rows(const qweight_t *w, const int64_t *ids, int64_t n, float *out,
                         int threads) {
    const int64_t per = block_values(w->type), bb = block_bytes(w->type), nb = w->K / per;
    if (n * w->K < (1 << 18)) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        int64_t row = ids ? ids[i] : i;
        if (w->perm) row = w->perm[row];
        const uint8_t *src = (const uint8_t *)w->codes + row * w->row_bytes;
        for (int64_t b = 0; b < nb; b++) dequantize_block(w->type, src + b * bb, out + i * w->K + b * per);
    }
}

// ---- x in 8-bit blocks ----------------------------------------------------------------------
// One row's buffer (64-byte aligned sections, K padded to a multiple of 64 with zeros):
//   q     int8 (Kp):             the codes
//   dsp   float (Kp / 32, 8):    each block's d, 8 times (a vector's lanes for its 32 codes)
//   dssp  float (Kp / 32, 8):    each block's d * sum(q) / 8, 8 times (8 lanes add up to it)
//   ds    float (Kp / 32 + 16):  each block's d * sum(q)
//   ds16  float (Kp / 16 + 16):  d * sum(q) of each half block
static inline int64_t pad64(int64_t n) { return (n + 63) / 64 * 64; }

static void row_layout(int64_t K, int64_t off[5], int64_t *total) {
    const int64_t Kp = pad64(K), nb = Kp / 32;
    off[0] = 0;
    off[1] = off[0] + Kp;
    off[2] = off[1] + pad64(nb * 32);
    off[3] = off[2] + pad64(nb * 32);
    off[4] = off[3] + pad64((nb + 16) * 4);
    *total = off[4] + pad64((2 * nb + 16) * 4);
}

int64_t zoo_q8_row_bytes(int64_t K) {
    int64_t off[5], total;
    row_layout(K, off, &total);
    return total;
}

void zoo_q8_quantize_row(const float *x, int64_t K, void *buf, q8row_t *row) {
    int64_t off[5], total;
    row_layout(K, off, &total);
    char *base = (char *)buf;
    int8_t *q = (int8_t *)(base + off[0]);
    float *dsp = (float *)(base + off[1]), *dssp = (float *)(base + off[2]);
    float *ds = (float *)(base + off[3]), *ds16 = (float *)(base + off[4]);
    const int64_t Kp = pad64(K), nb = Kp / 32;
    memset(base, 0, total);
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 1.0f / d : 0.0f;
        int s[2] = {0, 0};
        for (int j = 0; j < 32; j++) {
            const int v = (int)rintf(xb[j] * id);  // nearest, ties to even
            q[32 * b + j] = (int8_t)v;
            s[j / 16] += v;
        }
        for (int l = 0; l < 8; l++) {
            dsp[8 * b + l] = d;
            dssp[8 * b + l] = d * (float)(s[0] + s[1]) * 0.125f;
        }
        ds[b] = d * (float)(s[0] + s[1]);
        ds16[2 * b] = d * (float)s[0];
        ds16[2 * b + 1] = d * (float)s[1];
    }
    (void)nb;
    row->q = q;
    row->dsp = dsp;
    row->dssp = dssp;
    row->ds = ds;
    row->ds16 = ds16;
}

// ---- vectors of 64 bytes / 16 lanes: AVX-512, two AVX2 halves, or plain C ---------------------
// vb: 64 bytes; vi: 16 int32; vf: 16 float. Codes are unpacked into vb in the columns' natural
// order, so x's codes are read as they are.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZOO_QDOT_ISA "avx512"
#define ROWS_PER_PASS 8
typedef __m512i vb;
typedef __m512i vi;
typedef __m512 vf;
static inline vb vb_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vb vb_dup32(const void *p) {  // 32 bytes into both halves
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
static inline vb vb_2x32(const void *a, const void *b) {  // 32 bytes of a, then 32 of b
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline vb vb_2x16x2(const void *a, const void *b) {  // a, a, b, b (16 bytes each)
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b)), 1);
}
static inline vb vb_set1(uint8_t v) { return _mm512_set1_epi8((char)v); }
static inline vb vb_and(vb a, vb b) { return _mm512_and_si512(a, b); }
static inline vb vb_or(vb a, vb b) { return _mm512_or_si512(a, b); }
// 32-bit lanes shifted by a count per 128-bit quarter
static inline vb vb_srl4(vb a, int c0, int c1, int c2, int c3) {
    return _mm512_srlv_epi32(a, _mm512_set_epi32(c3, c3, c3, c3, c2, c2, c2, c2, c1, c1, c1, c1,
                                                 c0, c0, c0, c0));
}
static inline vb vb_sll4(vb a, int c0, int c1, int c2, int c3) {
    return _mm512_sllv_epi32(a, _mm512_set_epi32(c3, c3, c3, c3, c2, c2, c2, c2, c1, c1, c1, c1,
                                                 c0, c0, c0, c0));
}
static inline vb vb_bits(uint64_t m) { return _mm512_movm_epi8(m); }  // 0xFF where bit set
static inline vb vb_abs8(vb a) { return _mm512_abs_epi8(a); }
static inline vb vb_sign8(vb x, vb w) {  // x negated where w < 0 (|x| <= 127)
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
static inline vi vi_dot(vb w, vb x) {  // u8 w x s8 x, 4 bytes into each int32 lane
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
#endif
}
static inline vf vf_cvt(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_load8(const float *p) {  // 8 floats, the upper lanes zero
    return _mm512_zextps256_ps512(_mm256_loadu_ps(p));
}
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_pair(float a, float b) {  // lanes 0-7: a, 8-15: b
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
// f's lanes spread: lanes 0-7 f[2j], 8-15 f[2j + 1]  /  lanes 4k..4k+3 f[4j + k]
static inline vf vf_spread2(vf f, int j) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                  2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                  2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j,
                                                  2 * j, 2 * j), f);
}
static inline vf vf_spread4(vf f, int j) {
    const int a = 4 * j;
    return _mm512_permutexvar_ps(_mm512_set_epi32(a + 3, a + 3, a + 3, a + 3, a + 2, a + 2,
                                                  a + 2, a + 2, a + 1, a + 1, a + 1, a + 1, a,
                                                  a, a, a), f);
}
static inline vf vf_u8x8(const uint8_t *p) {  // 8 bytes as floats in lanes 0-7
    return _mm512_zextps256_ps512(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))));
}
static inline vf vf_i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define ZOO_QDOT_ISA "avx2"
#define ROWS_PER_PASS 4
typedef struct { __m256i a, b; } vb;
typedef struct { __m256i a, b; } vi;
typedef struct { __m256 a, b; } vf;
static inline vb mkvb(__m256i a, __m256i b) { vb r = {a, b}; return r; }
static inline vf mkvf(__m256 a, __m256 b) { vf r = {a, b}; return r; }
static inline vb vb_load(const void *p) {
    return mkvb(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
static inline vb vb_dup32(const void *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return mkvb(v, v);
}
static inline vb vb_2x32(const void *a, const void *b) {
    return mkvb(_mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b));
}
static inline vb vb_2x16x2(const void *a, const void *b) {
    return mkvb(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b)));
}
static inline vb vb_set1(uint8_t v) { __m256i s = _mm256_set1_epi8((char)v); return mkvb(s, s); }
static inline vb vb_and(vb x, vb y) { return mkvb(_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)); }
static inline vb vb_or(vb x, vb y) { return mkvb(_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)); }
static inline vb vb_srl4(vb x, int c0, int c1, int c2, int c3) {
    return mkvb(_mm256_srlv_epi32(x.a, _mm256_set_epi32(c1, c1, c1, c1, c0, c0, c0, c0)),
                _mm256_srlv_epi32(x.b, _mm256_set_epi32(c3, c3, c3, c3, c2, c2, c2, c2)));
}
static inline vb vb_sll4(vb x, int c0, int c1, int c2, int c3) {
    return mkvb(_mm256_sllv_epi32(x.a, _mm256_set_epi32(c1, c1, c1, c1, c0, c0, c0, c0)),
                _mm256_sllv_epi32(x.b, _mm256_set_epi32(c3, c3, c3, c3, c2, c2, c2, c2)));
}
static inline __m256i bits32(uint32_t m) {  // 0xFF in byte i where bit i of m is set
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
static inline vb vb_bits(uint64_t m) { return mkvb(bits32((uint32_t)m), bits32((uint32_t)(m >> 32))); }
static inline vb vb_abs8(vb x) { return mkvb(_mm256_abs_epi8(x.a), _mm256_abs_epi8(x.b)); }
static inline vb vb_sign8(vb x, vb w) { return mkvb(_mm256_sign_epi8(x.a, w.a), _mm256_sign_epi8(x.b, w.b)); }
static inline __m256i dot32(__m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
static inline vi vi_dot(vb w, vb x) { vi r = {dot32(w.a, x.a), dot32(w.b, x.b)}; return r; }
static inline vf vf_cvt(vi x) { return mkvf(_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)); }
static inline vf vf_zero(void) { return mkvf(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_load(const float *p) { return mkvf(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline vf vf_load8(const float *p) { return mkvf(_mm256_loadu_ps(p), _mm256_setzero_ps()); }
static inline vf vf_set1(float v) { return mkvf(_mm256_set1_ps(v), _mm256_set1_ps(v)); }
static inline vf vf_pair(float a, float b) { return mkvf(_mm256_set1_ps(a), _mm256_set1_ps(b)); }
static inline vf vf_mul(vf x, vf y) { return mkvf(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
static inline vf vf_fmadd(vf x, vf y, vf z) {
    return mkvf(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b));
}
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_sum(vf x) { return sum8(_mm256_add_ps(x.a, x.b)); }
static inline __m256 lane(vf f, int i) {  // f's lane i in all 8 lanes
    const __m256 h = i < 8 ? f.a : f.b;
    return _mm256_permutevar8x32_ps(h, _mm256_set1_epi32(i % 8));
}
static inline vf vf_spread2(vf f, int j) { return mkvf(lane(f, 2 * j), lane(f, 2 * j + 1)); }
static inline vf vf_spread4(vf f, int j) {
    const __m256 h = 4 * j < 8 ? f.a : f.b;
    const int a = (4 * j) % 8;
    return mkvf(_mm256_permutevar8x32_ps(h, _mm256_set_epi32(a + 1, a + 1, a + 1, a + 1, a, a, a, a)),
                _mm256_permutevar8x32_ps(h, _mm256_set_epi32(a + 3, a + 3, a + 3, a + 3, a + 2, a + 2, a + 2, a + 2)));
}
static inline vf vf_u8x8(const uint8_t *p) {
    return mkvf(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                _mm256_setzero_ps());
}
static inline vf vf_i8x16(const int8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return mkvf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}

#else  // plain C: the same operations lane by lane
#define ZOO_QDOT_ISA "c"
#define ROWS_PER_PASS 4
typedef struct { uint8_t v[64]; } vb;
typedef struct { int32_t v[16]; } vi;
typedef struct { float v[16]; } vf;
static inline vb vb_load(const void *p) { vb r; memcpy(r.v, p, 64); return r; }
static inline vb vb_dup32(const void *p) { vb r; memcpy(r.v, p, 32); memcpy(r.v + 32, p, 32); return r; }
static inline vb vb_2x32(const void *a, const void *b) { vb r; memcpy(r.v, a, 32); memcpy(r.v + 32, b, 32); return r; }
static inline vb vb_2x16x2(const void *a, const void *b) {
    vb r;
    memcpy(r.v, a, 16); memcpy(r.v + 16, a, 16); memcpy(r.v + 32, b, 16); memcpy(r.v + 48, b, 16);
    return r;
}
static inline vb vb_set1(uint8_t s) { vb r; memset(r.v, s, 64); return r; }
static inline vb vb_and(vb x, vb y) { for (int i = 0; i < 64; i++) x.v[i] &= y.v[i]; return x; }
static inline vb vb_or(vb x, vb y) { for (int i = 0; i < 64; i++) x.v[i] |= y.v[i]; return x; }
static inline vb shift32(vb x, const int c[4], int left) {
    for (int i = 0; i < 16; i++) {
        uint32_t u;
        memcpy(&u, x.v + 4 * i, 4);
        u = left ? u << c[i / 4] : u >> c[i / 4];
        memcpy(x.v + 4 * i, &u, 4);
    }
    return x;
}
static inline vb vb_srl4(vb x, int c0, int c1, int c2, int c3) { const int c[4] = {c0, c1, c2, c3}; return shift32(x, c, 0); }
static inline vb vb_sll4(vb x, int c0, int c1, int c2, int c3) { const int c[4] = {c0, c1, c2, c3}; return shift32(x, c, 1); }
static inline vb vb_bits(uint64_t m) { vb r; for (int i = 0; i < 64; i++) r.v[i] = (m >> i) & 1 ? 0xFF : 0; return r; }
static inline vb vb_abs8(vb x) { for (int i = 0; i < 64; i++) x.v[i] = (uint8_t)abs((int8_t)x.v[i]); return x; }
static inline vb vb_sign8(vb x, vb w) {
    for (int i = 0; i < 64; i++) if ((int8_t)w.v[i] < 0) x.v[i] = (uint8_t)(-(int8_t)x.v[i]);
    return x;
}
static inline vi vi_dot(vb w, vb x) {
    vi r;
    for (int i = 0; i < 16; i++) {
        int32_t s = 0;
        for (int k = 0; k < 4; k++) s += (int32_t)w.v[4 * i + k] * (int8_t)x.v[4 * i + k];
        r.v[i] = s;
    }
    return r;
}
static inline vf vf_cvt(vi x) { vf r; for (int i = 0; i < 16; i++) r.v[i] = (float)x.v[i]; return r; }
static inline vf vf_zero(void) { vf r; memset(&r, 0, sizeof r); return r; }
static inline vf vf_load(const float *p) { vf r; memcpy(r.v, p, 64); return r; }
static inline vf vf_load8(const float *p) { vf r = vf_zero(); memcpy(r.v, p, 32); return r; }
static inline vf vf_set1(float s) { vf r; for (int i = 0; i < 16; i++) r.v[i] = s; return r; }
static inline vf vf_pair(float a, float b) { vf r; for (int i = 0; i < 16; i++) r.v[i] = i < 8 ? a : b; return r; }
static inline vf vf_mul(vf x, vf y) { for (int i = 0; i < 16; i++) x.v[i] *= y.v[i]; return x; }
static inline vf vf_fmadd(vf x, vf y, vf z) { for (int i = 0; i < 16; i++) z.v[i] = fmaf(x.v[i], y.v[i], z.v[i]); return z; }
static inline float vf_sum(vf x) {
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) x.v[i] += x.v[i + w];
    return x.v[0];
}
static inline vf vf_spread2(vf f, int j) { return vf_pair(f.v[2 * j], f.v[2 * j + 1]); }
static inline vf vf_spread4(vf f, int j) { vf r; for (int i = 0; i < 16; i++) r.v[i] = f.v[4 * j + i / 4]; return r; }
static inline vf vf_u8x8(const uint8_t *p) { vf r = vf_zero(); for (int i = 0; i < 8; i++) r.v[i] = p[i]; return r; }
static inline vf vf_i8x16(const int8_t *p) { vf r; for (int i = 0; i < 16; i++) r.v[i] = p[i]; return r; }
#endif

const char *zoo_qdot_isa(void) { return ZOO_QDOT_ISA; }

// ---- the dot products: one row of W against M rows of x ----------------------------------------
// Each adds into acc[r] (16 lanes, summed at the end) and acc2[r] (a second sum, scaled at the
// end by `tail`). M is a constant where dot_rows calls these (always_inline), so the per-row
// accumulators stay in registers.
#define INLINE static inline __attribute__((always_inline))

// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: two blocks of 32 per vector. The offset / minimum term of a
// block, mw * d * sum(q_x), goes into acc through x's dssp lanes (each an eighth of it).
INLINE void dot_small(int64_t type, const uint8_t *w, const q8row_t *x, int M, int64_t nb,
                      vf *acc) {
    const int64_t bb = block_bytes(type);
    const vb low = vb_set1(0x0F);
    for (int64_t i = 0; i < nb; i += 2) {
        const int two = i + 1 < nb;
        const uint8_t *b0 = w + i * bb, *b1 = two ? b0 + bb : b0;
        vb c;
        vf fw, mw;
        const float d0 = f16(b0), d1 = two ? f16(b1) : 0.0f;
        fw = vf_pair(d0, d1);
        if (type == ZOO_Q8_0) {
            c = vb_2x32(b0 + 2, b1 + 2);
            mw = vf_zero();
        } else {
            const int min = type == ZOO_Q4_1 || type == ZOO_Q5_1;
            const int five = type == ZOO_Q5_0 || type == ZOO_Q5_1;
            const int at = (min ? 4 : 2) + (five ? 4 : 0);
            c = vb_and(vb_srl4(vb_2x16x2(b0 + at, b1 + at), 0, 4, 0, 4), low);
            if (five) {
                uint32_t h0, h1;
                memcpy(&h0, b0 + (min ? 4 : 2), 4);
                memcpy(&h1, b1 + (min ? 4 : 2), 4);
                c = vb_or(c, vb_and(vb_bits((uint64_t)h0 | ((uint64_t)h1 << 32)), vb_set1(0x10)));
            }
            if (min)
                mw = vf_pair(f16(b0 + 2), two ? f16(b1 + 2) : 0.0f);
            else
                mw = vf_pair(-(five ? 16.0f : 8.0f) * d0, -(five ? 16.0f : 8.0f) * d1);
        }
        if (type == ZOO_Q8_0) {
            const vb a = vb_abs8(c);
            for (int r = 0; r < M; r++) {
                const vi p = vi_dot(a, vb_sign8(vb_load(x[r].q + 32 * i), c));
                acc[r] = vf_fmadd(vf_cvt(p), vf_mul(fw, vf_load(x[r].dsp + 8 * i)), acc[r]);
            }
        } else {
            for (int r = 0; r < M; r++) {
                const vi p = vi_dot(c, vb_load(x[r].q + 32 * i));
                acc[r] = vf_fmadd(vf_cvt(p), vf_mul(fw, vf_load(x[r].dsp + 8 * i)), acc[r]);
                acc[r] = vf_fmadd(mw, vf_load(x[r].dssp + 8 * i), acc[r]);
            }
        }
    }
}

// Q4_K / Q5_K: per 256 columns, 8 sub-blocks of 32 with 6-bit scales and mins.
INLINE void dot_k45(int five, const uint8_t *w, const q8row_t *x, int M, int64_t nsb, vf *acc,
                    vf *acc2) {
    const vb low = vb_set1(0x0F), one = vb_set1(0x01);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + s * (five ? 176 : 144);
        uint8_t sc[8], mn[8];
        k4_scales(b + 4, sc, mn);
        const vf fw = vf_mul(vf_u8x8(sc), vf_set1(f16(b)));
        const vf mw = vf_mul(vf_u8x8(mn), vf_set1(f16(b + 2)));
        const uint8_t *qs = b + (five ? 48 : 16);
        vb c[4];
        vf f[4];
        for (int j = 0; j < 4; j++) {  // run j: sub-blocks 2j (low nibbles), 2j + 1 (high)
            c[j] = vb_and(vb_srl4(vb_dup32(qs + 32 * j), 0, 0, 4, 4), low);
            if (five) {
                const vb h = vb_srl4(vb_dup32(b + 16), 2 * j, 2 * j, 2 * j + 1, 2 * j + 1);
                c[j] = vb_or(c[j], vb_sll4(vb_and(h, one), 4, 4, 4, 4));
            }
            f[j] = vf_spread2(fw, j);
        }
        for (int r = 0; r < M; r++) {
            const int8_t *xq = x[r].q + 256 * s;
            const float *xd = x[r].dsp + 64 * s;
            for (int j = 0; j < 4; j++) {
                const vi p = vi_dot(c[j], vb_load(xq + 64 * j));
                acc[r] = vf_fmadd(vf_cvt(p), vf_mul(f[j], vf_load(xd + 16 * j)), acc[r]);
            }
            acc2[r] = vf_fmadd(mw, vf_load8(x[r].ds + 8 * s), acc2[r]);
        }
    }
}

// Q6_K: per 256 columns, 16 sub-blocks of 16 with int8 scales, codes 0..63 offset by 32.
INLINE void dot_q6_k(const uint8_t *w, const q8row_t *x, int M, int64_t nsb, vf *acc,
                     vf *acc2) {
    const vb low = vb_set1(0x0F), top = vb_set1(0x30);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + s * 210;
        const vf fw = vf_mul(vf_i8x16((const int8_t *)(b + 192)), vf_set1(f16(b + 208)));
        vb c[4];
        vf f[4];
        for (int h = 0; h < 2; h++) {  // 128 columns: 64 bytes of low bits, 32 of high bits
            const vb ql = vb_load(b + 64 * h), qh = vb_dup32(b + 128 + 32 * h);
            // columns 0-63: low nibbles, high bits 0-1 / 2-3; columns 64-127: high nibbles, 4-5 / 6-7
            c[2 * h] = vb_or(vb_and(ql, low), vb_and(vb_sll4(qh, 4, 4, 2, 2), top));
            c[2 * h + 1] = vb_or(vb_and(vb_srl4(ql, 4, 4, 4, 4), low),
                                 vb_and(vb_srl4(qh, 0, 0, 2, 2), top));
        }
        for (int j = 0; j < 4; j++) f[j] = vf_spread4(fw, j);
        for (int r = 0; r < M; r++) {
            const int8_t *xq = x[r].q + 256 * s;
            const float *xd = x[r].dsp + 64 * s;
            for (int j = 0; j < 4; j++) {
                const vi p = vi_dot(c[j], vb_load(xq + 64 * j));
                acc[r] = vf_fmadd(vf_cvt(p), vf_mul(f[j], vf_load(xd + 16 * j)), acc[r]);
            }
            acc2[r] = vf_fmadd(fw, vf_load(x[r].ds16 + 16 * s), acc2[r]);
        }
    }
}

// out[r] = x_r . W[row] for M <= ROWS_PER_PASS rows of x.
INLINE void dot_rows(const qweight_t *w, const uint8_t *row, const q8row_t *x, int M,
                     float *out) {
    vf acc[ROWS_PER_PASS], acc2[ROWS_PER_PASS];
    for (int r = 0; r < M; r++) acc[r] = acc2[r] = vf_zero();
    float tail = 0.0f;
    switch (w->type) {
        case ZOO_Q4_K: dot_k45(0, row, x, M, w->K / 256, acc, acc2); tail = -1.0f; break;
        case ZOO_Q5_K: dot_k45(1, row, x, M, w->K / 256, acc, acc2); tail = -1.0f; break;
        case ZOO_Q6_K: dot_q6_k(row, x, M, w->K / 256, acc, acc2); tail = -32.0f; break;
        default: dot_small(w->type, row, x, M, w->K / 32, acc);
    }
    for (int r = 0; r < M; r++) out[r] = vf_sum(acc[r]) + (tail != 0.0f ? tail * vf_sum(acc2[r]) : 0.0f);
}

static void dot_rows_m(const qweight_t *w, const uint8_t *row, const q8row_t *x, int64_t M,
                       float *out) {
    switch (M) {
#define ROWS(k) case k: dot_rows(w, row, x, k, out); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if ROWS_PER_PASS > 4
        ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#endif
#undef ROWS
    }
}

void zoo_qdot_rows(const qweight_t *w, const q8row_t *x, int64_t M, float *y, int64_t ldy,
                   int64_t n0, int64_t n1) {
    float out[ROWS_PER_PASS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)w->codes + (w->perm ? w->perm[n] : n) * w->row_bytes;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS_PER_PASS) {
            const int64_t k = M - r0 < ROWS_PER_PASS ? M - r0 : ROWS_PER_PASS;
            dot_rows_m(w, row, x + r0, k, out);
            for (int64_t r = 0; r < k; r++) y[(r0 + r) * ldy + n] = out[r];
        }
    }
}

// Many rows of x (prefill): each thread takes a range of W's rows and goes through them in
// tiles that stay in its caches, each tile against every pass of rows of x. The arithmetic
// per (row of x, row of W) is zoo_qdot_rows's.
#define TILE_BYTES (48 << 10)

void zoo_qgemm(const qweight_t *w, const float *x, float *y, int64_t M, int threads) {
    const int64_t bytes = zoo_q8_row_bytes(w->K);
    char *buf = aligned_alloc(64, M * bytes);
    q8row_t *rows = malloc(M * sizeof(q8row_t));
    if (w->N * w->K * M < (1 << 20)) threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) zoo_q8_quantize_row(x + r * w->K, w->K, buf + r * bytes, &rows[r]);
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = w->N * t / T, n1 = w->N * (t + 1) / T;
        int64_t tile = TILE_BYTES / (w->row_bytes ? w->row_bytes : 1);
        tile = tile < 1 ? 1 : tile;
        for (int64_t a = n0; a < n1; a += tile) {
            const int64_t b = a + tile < n1 ? a + tile : n1;
            for (int64_t r0 = 0; r0 < M; r0 += ROWS_PER_PASS) {
                const int64_t k = M - r0 < ROWS_PER_PASS ? M - r0 : ROWS_PER_PASS;
                zoo_qdot_rows(w, rows + r0, k, y + r0 * w->N, w->N, a, b);
            }
        }
    }
    free(rows);
    free(buf);
}
