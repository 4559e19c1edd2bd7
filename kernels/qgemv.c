// Few-row products with quantized weights on CPUs: y (M, N) = x (M, K) @ W.T, fp32 throughout.
//
// W in the layout of kernels/qweight.py: codes (4-bit pairs or int8), one scale per group of
// `gs` columns (fp16 or fp32, or a small int times a fp16 super-block scale), an optional
// additive minimum of the same two kinds, and an offset subtracted from every code:
//     W[n, k] = scale[n, g] * (code[n, k] - offset) + min[n, g],   g = k / gs
// Per row and group: s * sum_j code_j * x_j accumulates lane-wise into a vector of floats (one
// horizontal sum per row), and the offset and minimum terms use the group sums of x:
//     y = sum_g s_g * (dot_g - offset * xs_g) + m_g * xs_g
// OpenMP splits the output rows over the threads. Equal to F.linear on the dequantized weight to fp32 rounding.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "zoo_cpu.h"


#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
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
}
#endif

static inline float load(const void *p, int64_t kind, int64_t i) {
    switch (kind) {
        case 0: return ((const float *)p)[i];
        case 1: return half_to_float(((const uint16_t *)p)[i]);
        case 2: return (float)((const int8_t *)p)[i];
        default: return (float)((const uint8_t *)p)[i];
    }
}

// The group scales (or minimums) of row n: small values, times the super-block's fp16.
// (The kind is looked at once per row, not per group: decode runs this for every row.)
static void row_factors(const qweight_t *w, const void *small, int64_t kind,
                        const uint16_t *big, int64_t n, int64_t G, float *out) {
    int64_t per = w->superblock ? w->superblock / w->gs : 1, g = 0;
    if (kind == 1) {  // fp16: 16 at a time where the CPU converts them in one instruction
        const uint16_t *p = (const uint16_t *)small + n * G;
#if defined(__AVX512F__)
        for (; g + 16 <= G; g += 16)
            _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + g))));
#endif
        for (; g < G; g++) out[g] = half_to_float(p[g]);
    } else {
        for (; g < G; g++) out[g] = load(small, kind, n * G + g);
    }
    if (big) {
        const uint16_t *b = big + n * (G / per);
        for (g = 0; g < G; g++) out[g] = half_to_float(b[g / per]) * out[g];
    }
}

// Row n's fp16 factors where the kernel can read them as stored (one level, fp16), else NULL.
static inline const uint16_t *direct_fp16(const void *p, int64_t kind, const uint16_t *big,
                                          int64_t n, int64_t G) {
    return p && kind == 1 && !big ? (const uint16_t *)p + n * G : NULL;
}

// The inner loops in SIMD intrinsics: AVX-512 (16 lanes), AVX2 + FMA (8 lanes), or plain C.
// Each loads W codes (8-bit, or 4-bit pairs: low nibble, high nibble), widens them to floats and
// multiplies them by x in fused multiply-adds.
#if defined(__AVX512F__)
#include <immintrin.h>
#define W 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET(s) _mm512_set1_ps(s)
#define VLOADX(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSUM(v) _mm512_reduce_add_ps(v)
static inline vf codes8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void codes4(const uint8_t *p, vf *lo, vf *hi) {  // 16 bytes: 16 low, 16 high
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET(s) _mm256_set1_ps(s)
#define VLOADX(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
static inline float VSUM(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf codes8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void codes4(const uint8_t *p, vf *lo, vf *hi) {  // 8 bytes: 8 low, 8 high
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#else
#define W 1
typedef float vf;
#define VZERO() 0.0f
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VSET(s) (s)
#define VLOADX(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSUM(v) (v)
static inline vf codes8(const int8_t *p) { return (float)*p; }
static inline void codes4(const uint8_t *p, vf *lo, vf *hi) {
    *lo = (float)(*p & 15);
    *hi = (float)(*p >> 4);
}
#endif

// Row n of W as floats (zoo_dequantize: prefill's many rows go to the BLAS with them).
static void dequantize_row(const qweight_t *w, int64_t n, const float *s, const float *m,
                           float *out) {
    const int64_t K = w->K, gs = w->gs, G = K / gs;
    for (int64_t g = 0; g < G; g++) {  // q * s + (min - offset * s)
        vf scale = VSET(s[g]), shift = VSET((w->mins ? m[g] : 0.0f) - (float)w->offset * s[g]);
        if (w->bits == 4) {
            const uint8_t *c = (const uint8_t *)w->codes + n * (K / 2) + g * 16;
            for (int j = 0; j < 16; j += W) {
                vf lo, hi;
                codes4(c + j, &lo, &hi);
                VSTORE(out + g * 32 + j, VFMA(lo, scale, shift));
                VSTORE(out + g * 32 + 16 + j, VFMA(hi, scale, shift));
            }
        } else {
            const int8_t *c = (const int8_t *)w->codes + n * K;
            for (int64_t j = g * gs; j < (g + 1) * gs; j += W)
                VSTORE(out + j, VFMA(codes8(c + j), scale, shift));
        }
    }
}

static float dot(const float *a, const float *b, int64_t K) {
    vf acc = VZERO();
    int64_t k = 0;
    for (; k + W <= K; k += W) acc = VFMA(VLOADX(a + k), VLOADX(b + k), acc);
    float total = VSUM(acc);
    for (; k < K; k++) total += a[k] * b[k];
    return total;
}

// dot with four accumulators: a plain fp32 weight row streams from memory, where one
// accumulator's multiply-add latency would bound the loop below the memory's rate.
static float dot4(const float *a, const float *b, int64_t K) {
    vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    int64_t k = 0;
    for (; k + 4 * W <= K; k += 4 * W) {
        a0 = VFMA(VLOADX(a + k), VLOADX(b + k), a0);
        a1 = VFMA(VLOADX(a + k + W), VLOADX(b + k + W), a1);
        a2 = VFMA(VLOADX(a + k + 2 * W), VLOADX(b + k + 2 * W), a2);
        a3 = VFMA(VLOADX(a + k + 3 * W), VLOADX(b + k + 3 * W), a3);
    }
    for (; k + W <= K; k += W) a0 = VFMA(VLOADX(a + k), VLOADX(b + k), a0);
    float total = VSUM(a0) + VSUM(a1) + VSUM(a2) + VSUM(a3);
    for (; k < K; k++) total += a[k] * b[k];
    return total;
}

// Row n of W against the M <= MAX_ROWS rows of x, straight from the codes: each vector of
// codes is widened to floats once and serves every row of x, into one accumulator per row
// (a single horizontal sum each). M is a constant where rows_dot_m calls this, so the
// accumulators stay in registers.
static inline __attribute__((always_inline)) void rows_dot(const qweight_t *w, int64_t n,
                                                           const float *x, const float *xs,
                                                           int64_t M, int bits, const float *s,
                                                           const float *m, float *out) {
    const int64_t K = w->K, gs = w->gs, G = K / gs;
    vf acc[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) acc[r] = VZERO();
    for (int64_t g = 0; g < G; g++) {
        vf part[MAX_ROWS];
        for (int64_t r = 0; r < M; r++) part[r] = VZERO();
        if (bits == 4) {  // groups of 32: byte j holds column j (low) and j + 16 (high)
            const uint8_t *c = (const uint8_t *)w->codes + n * (K / 2) + g * 16;
            for (int j = 0; j < 16; j += W) {
                vf lo, hi;
                codes4(c + j, &lo, &hi);
                for (int64_t r = 0; r < M; r++) {
                    const float *xr = x + r * K + g * 32 + j;
                    part[r] = VFMA(hi, VLOADX(xr + 16), VFMA(lo, VLOADX(xr), part[r]));
                }
            }
        } else {
            const int8_t *c = (const int8_t *)w->codes + n * K;
            for (int64_t j = g * gs; j < (g + 1) * gs; j += W) {
                const vf q = codes8(c + j);
                for (int64_t r = 0; r < M; r++) part[r] = VFMA(q, VLOADX(x + r * K + j), part[r]);
            }
        }
        const vf sg = VSET(s[g]);
        for (int64_t r = 0; r < M; r++) acc[r] = VFMA(part[r], sg, acc[r]);
    }
    for (int64_t r = 0; r < M; r++) {
        float total = VSUM(acc[r]);
        if (w->offset) total -= (float)w->offset * dot(s, xs + r * G, G);
        if (w->mins) total += dot(m, xs + r * G, G);
        out[r] = total;
    }
}

static void rows_dot_m(const qweight_t *w, int64_t n, const float *x, const float *xs,
                       int64_t M, const float *s, const float *m, float *out) {
    switch (M * (w->bits == 4 ? -1 : 1)) {  // 4-bit codes: negative
#define ROWS(k)                                                    \
    case k: rows_dot(w, n, x, xs, k, 8, s, m, out); break;         \
    case -k: rows_dot(w, n, x, xs, k, 4, s, m, out); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
}

// 4-bit codes against bf16-rounded x (CPUs with AVX512-BF16): two multiply-adds per
// instruction and no integer-to-float conversion. A code q becomes the bf16 number 128 + q by
// putting the byte 0x43 above it (bf16 0x43qq = 128 + q for q < 128), so
//     sum_j (128 + q_j) x_j = dot_g + 128 * xs_g
// and the offset term simply grows by 128. The products are exact and the sums fp32, so the
// result is F.linear with bf16(x) to fp32 rounding: within bf16 rounding of x itself.
// Codes go 64 bytes (4 groups, one per 128-bit lane) at a time; unpacking the low and the high
// nibbles with 0x43 within each lane gives four registers of 32 bf16 in which lane L holds
// group L's columns 8r..8r+7 (r = 0..3); x is permuted once per call to the same order.
// A row of x as that loop reads it: bf16_row (zoo_cpu.h), made by prepare_bf16.

#if defined(__AVX512BF16__)
#define BF16_CODES 1
#define CHUNK 128  // columns per 64 bytes of codes
#define BH(v) ((__m512bh)(v))

// x (K, a multiple of 32) -> r: per chunk, the four groups' bf16 values (a group is one
// register of 32: blocks of 8 columns) transposed so that register j holds block j of each
// group; the group sums come from the same rounded values (a dot product with ones).
static void prepare_bf16(const float *x, int64_t K, bf16_row r) {
    const int64_t G = K / 32, chunks = (K + CHUNK - 1) / CHUNK;
    const __m512bh ones = BH(_mm512_set1_epi16(0x3F80));
    memset(r.xs, 0, (G + 16) * sizeof(float));
    for (int64_t c = 0; c < chunks; c++) {
        __m512i g[4];
        for (int l = 0; l < 4; l++) {
            const int64_t at = (4 * c + l) * 32;
            if (4 * c + l < G) {  // vcvtne2ps2bf16: round to nearest even, high half first
                g[l] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + at + 16),
                                                     _mm512_loadu_ps(x + at));
                r.xs[4 * c + l] = _mm512_reduce_add_ps(
                    _mm512_dpbf16_ps(_mm512_setzero_ps(), BH(g[l]), ones));
            } else {
                g[l] = _mm512_setzero_si512();
            }
        }
        // 4 x 4 transpose of 128-bit blocks: out j = (g0.j, g1.j, g2.j, g3.j)
        __m512i t0 = _mm512_shuffle_i64x2(g[0], g[1], 0x44), t1 = _mm512_shuffle_i64x2(g[0], g[1], 0xEE);
        __m512i t2 = _mm512_shuffle_i64x2(g[2], g[3], 0x44), t3 = _mm512_shuffle_i64x2(g[2], g[3], 0xEE);
        uint16_t *out = r.xp + c * CHUNK;
        _mm512_storeu_si512(out, _mm512_shuffle_i64x2(t0, t2, 0x88));
        _mm512_storeu_si512(out + 32, _mm512_shuffle_i64x2(t0, t2, 0xDD));
        _mm512_storeu_si512(out + 64, _mm512_shuffle_i64x2(t1, t3, 0x88));
        _mm512_storeu_si512(out + 96, _mm512_shuffle_i64x2(t1, t3, 0xDD));
    }
}

// Sixteen groups' factors from g0 on, fp16 read straight from the weight (h) or fp32 from a
// buffer (f), zero past the row's G groups.
static inline __m512 factors16(const uint16_t *h, const float *f, int64_t g0, int64_t G) {
    const int64_t left = G - g0;
    const __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    return h ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, h + g0))
             : _mm512_maskz_loadu_ps(mask, f + g0);
}

// out[r] = sum_g s_g * (sum_j (128 + q_j) bf16(x_rj) - (offset + 128) xs_rg) + m_g xs_rg for
// row n of W and the M <= 8 rows of x, in one vector accumulator per row of x (a single
// horizontal sum each). The factors come 16 groups at a time: a chunk's four spread over its
// lanes by one permute, and the offset and minimum terms as one multiply-add per 16 groups.
// A chunk's codes are unpacked once and serve every row of x.
static inline __attribute__((always_inline)) void row_dot_bf16(
    const qweight_t *w, int64_t n, const bf16_row *xr, int64_t M, const uint16_t *sh,
    const float *s, const uint16_t *mh, const float *m, float *out) {
    const int64_t K = w->K, G = K / 32, full = K / CHUNK, chunks = (K + CHUNK - 1) / CHUNK;
    const uint8_t *c = (const uint8_t *)w->codes + n * (K / 2);
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x43);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512 shift = _mm512_set1_ps(-(float)(w->offset + 128));
    const int64_t rest = (K % CHUNK) / 2;  // bytes of codes in a last, partial chunk
    const __mmask64 tail = rest ? (__mmask64)-1 >> (64 - rest) : 0;
    const int mins = mh || m;
    __m512 acc[MAX_ROWS], sblock = _mm512_setzero_ps();
    for (int64_t r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t ch = 0; ch < chunks; ch++) {
        if (ch % 4 == 0) {  // the next 16 groups: their offset and minimum terms
            sblock = factors16(sh, s, 4 * ch, G);
            __m512 mblock = mins ? factors16(mh, m, 4 * ch, G) : _mm512_setzero_ps();
            for (int64_t r = 0; r < M; r++) {
                __m512 xs = _mm512_loadu_ps(xr[r].xs + 4 * ch);
                acc[r] = _mm512_fmadd_ps(sblock, _mm512_mul_ps(xs, shift), acc[r]);
                if (mins) acc[r] = _mm512_fmadd_ps(mblock, xs, acc[r]);
            }
        }
        __m512i b = ch < full ? _mm512_loadu_si512(c + 64 * ch)
                              : _mm512_maskz_loadu_epi8(tail, c + 64 * ch);
        __m512i lo = _mm512_and_si512(b, low), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
        __m512bh w0 = BH(_mm512_unpacklo_epi8(lo, top)), w1 = BH(_mm512_unpackhi_epi8(lo, top));
        __m512bh w2 = BH(_mm512_unpacklo_epi8(hi, top)), w3 = BH(_mm512_unpackhi_epi8(hi, top));
        __m512i idx = _mm512_add_epi32(spread, _mm512_set1_epi32(4 * (int)(ch % 4)));
        __m512 sv = _mm512_permutexvar_ps(idx, sblock);
        for (int64_t r = 0; r < M; r++) {
            const uint16_t *xc = xr[r].xp + ch * CHUNK;
            __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, BH(_mm512_loadu_si512(xc)));
            __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w2, BH(_mm512_loadu_si512(xc + 64)));
            p0 = _mm512_dpbf16_ps(p0, w1, BH(_mm512_loadu_si512(xc + 32)));
            p1 = _mm512_dpbf16_ps(p1, w3, BH(_mm512_loadu_si512(xc + 96)));
            acc[r] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), sv, acc[r]);
        }
    }
    for (int64_t r = 0; r < M; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#else
#define BF16_CODES 0
#define CHUNK 128
#endif

// y (M, N) = x (M, K) @ W.T; gs must be a multiple of W (16 covers every format).
// Dot products straight from the codes, each row of W against every row of x while its codes
// sit in registers (rows_dot, row_dot_bf16). x is prepared once per product (zoo_qx_prepare:
// its bf16 copy, or its group sums), then any thread computes any range of W's rows from it
// (zoo_qgemv_rows): zoo_qgemv splits them over its threads, a fused decode step
// (cpu_decode.c) over the threads it already runs.
// A fork-join costs microseconds (and, where other processes hold the cores, a time slice per
// thread): small products run on the calling thread alone.
#define PARALLEL_WORK (1 << 18)

static inline int uses_bf16(const qweight_t *w, int64_t M) {
    return BF16_CODES && w->bits == 4 && w->gs == 32 && M <= MAX_ROWS;
}

int64_t zoo_qx_bytes(const qweight_t *w, int64_t M) {
    if (w->type) return M * zoo_q8_row_bytes(w->K);  // GGML blocks: x in 8-bit blocks
    const int64_t G = w->K / w->gs, chunks = (w->K + CHUNK - 1) / CHUNK;
    if (uses_bf16(w, M)) return M * (chunks * CHUNK * (int64_t)sizeof(uint16_t) + (G + 16) * 4);
    return w->bits != 32 ? M * G * (int64_t)sizeof(float) : 0;
}

void zoo_qx_prepare(const qweight_t *w, const float *x, int64_t M, int bf16_ok, qx_t *px,
                    void *buf) {
    const int64_t K = w->K, gs = w->gs, G = K / gs, chunks = (K + CHUNK - 1) / CHUNK;
    px->x = x;
    px->M = M;
    px->bf16 = bf16_ok && uses_bf16(w, M);
    px->xs = NULL;
    if (w->type) {  // GGML blocks (qdot.c): each row of x in 8-bit blocks
        px->bf16 = 0;
        for (int64_t r = 0; r < M; r++)
            zoo_q8_quantize_row(x + r * K, K, (char *)buf + r * zoo_q8_row_bytes(K), &px->q8[r]);
    } else if (px->bf16) {  // one buffer: each row of x's bf16 values and group sums
        const int64_t each = chunks * CHUNK * sizeof(uint16_t) + (G + 16) * sizeof(float);
        for (int64_t r = 0; r < M; r++) {
            px->r[r].xp = (uint16_t *)((char *)buf + r * each);
            px->r[r].xs = (float *)(px->r[r].xp + chunks * CHUNK);
#if BF16_CODES
            prepare_bf16(x + r * K, K, px->r[r]);
#endif
        }
    } else if (w->bits != 32) {  // per row and group: the sum of x (offset, minimum terms)
        px->xs = (float *)buf;
        for (int64_t g = 0; g < M * G; g++) {
            float t = 0;
            for (int64_t j = 0; j < gs; j++) t += x[g * gs + j];
            px->xs[g] = t;
        }
    }
}

int64_t zoo_qgemv_scratch(const qweight_t *w) {  // a row's scales and minimums (G each)
    return w->type ? 0 : 2 * (w->K / w->gs);
}

void zoo_qgemv_rows(const qweight_t *w, const qx_t *px, float *y, int64_t ldy, int64_t n0,
                    int64_t n1, float *scratch) {
    if (w->type) {
        zoo_qdot_rows(w, px->q8, px->M, y, ldy, n0, n1);
        return;
    }
    const int64_t K = w->K, G = K / w->gs, M = px->M;
    const float *x = px->x;
    float *s = scratch, *m = scratch + G;
    float dots[MAX_ROWS];
    for (int64_t n = n0; n < n1; n++) {
        if (w->bits == 32) {  // plain fp32 weight
            const float *wn = (const float *)w->codes + n * K;
            for (int64_t r = 0; r < M; r++) y[r * ldy + n] = dot4(wn, x + r * K, K);
            continue;
        }
        if (px->bf16) {
#if BF16_CODES
            // fp16 factors are read in the loop; others (two-level, fp32) go through s, m
            const uint16_t *sh = direct_fp16(w->scales, w->scale_kind, w->d, n, G);
            const uint16_t *mh = direct_fp16(w->mins, w->min_kind, w->dmin, n, G);
            if (!sh) row_factors(w, w->scales, w->scale_kind, w->d, n, G, s);
            if (w->mins && !mh) row_factors(w, w->mins, w->min_kind, w->dmin, n, G, m);
            const float *mf = w->mins && !mh ? m : NULL;
            if (M == 1)  // the common case, with its row count known to the compiler
                row_dot_bf16(w, n, px->r, 1, sh, s, mh, mf, dots);
            else
                row_dot_bf16(w, n, px->r, M, sh, s, mh, mf, dots);
            for (int64_t r = 0; r < M; r++) y[r * ldy + n] = dots[r];
#endif
            continue;
        }
        row_factors(w, w->scales, w->scale_kind, w->d, n, G, s);
        if (w->mins) row_factors(w, w->mins, w->min_kind, w->dmin, n, G, m);
        for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {  // MAX_ROWS rows of x at a time
            const int64_t k = M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS;
            rows_dot_m(w, n, x + r0 * K, px->xs + r0 * G, k, s, m, dots);
            for (int64_t r = 0; r < k; r++) y[(r0 + r) * ldy + n] = dots[r];
        }
    }
}

// bf16_ok: 4-bit codes may multiply bf16(x) (decode); 0: fp32 x (prefill, whose keys and values
// must not depend on how a prompt was cut into chunks: a reused prefix then answers the same).
void zoo_qgemv(const qweight_t *w, const float *x, float *y, int64_t M, int threads, int bf16_ok) {
    if (w->N * w->K * M < PARALLEL_WORK) threads = 1;
    qx_t px;
    void *buf = malloc(zoo_qx_bytes(w, M) + 64);
    zoo_qx_prepare(w, x, M, bf16_ok, &px, buf);
#pragma omp parallel num_threads(threads)
    {
        float *scratch = (float *)malloc(zoo_qgemv_scratch(w) * sizeof(float));
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        zoo_qgemv_rows(w, &px, y, w->N, w->N * t / T, w->N * (t + 1) / T, scratch);
        free(scratch);
    }
    free(buf);
}

// Whether 4-bit codes multiply bf16-rounded x (this build has AVX512-BF16): tests pick their
// reference by it.
int zoo_qgemv_bf16(void) { return BF16_CODES; }

// out (N, K) = W as floats: many rows of x (prefill) go to the BLAS with this.
void zoo_dequantize(const qweight_t *w, float *out, int threads) {
    const int64_t G = w->K / w->gs;
    if (w->N * w->K < PARALLEL_WORK) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *s = (float *)malloc(G * sizeof(float)), *m = (float *)malloc(G * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < w->N; n++) {
            row_factors(w, w->scales, w->scale_kind, w->d, n, G, s);
            if (w->mins) row_factors(w, w->mins, w->min_kind, w->dmin, n, G, m);
            dequantize_row(w, n, s, m, out + n * w->K);
        }
        free(s);
        free(m);
    }
}
