// Decode's small per-layer ops on CPUs, fp32, one call each instead of the reference's chain of
// torch ops (each a few microseconds of dispatch for a few hundred numbers). Same arithmetic,
// rounding for rounding, as kernels/reference.py (ISO C: no fused multiply-adds are formed),
// except where a sum's order differs.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zoo_cpu.h"

// fp16 <-> fp32 rows (a KV cache kept in fp16): F16C where the CPU has it, else the
// compiler's _Float16, else by hand; round to nearest even, as torch's .to(float16).
#if defined(__F16C__)
#include <immintrin.h>
#endif
void zoo_half_to_float(const uint16_t *h, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) {
#if defined(__FLT16_MAX__)
        _Float16 v;
        memcpy(&v, h + i, 2);
        out[i] = (float)v;
#else
        const uint32_t sign = (uint32_t)(h[i] & 0x8000) << 16, exp = (h[i] >> 10) & 0x1F;
        uint32_t man = h[i] & 0x3FF, bits;
        if (exp == 31) {
            bits = sign | 0x7F800000 | (man << 13);
        } else if (exp) {
            bits = sign | ((exp + 112) << 23) | (man << 13);
        } else {  // zero or subnormal: man * 2^-24, exactly
            const float f = (float)man * 5.9604644775390625e-8f;
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
        memcpy(out + i, &bits, 4);
#endif
    }
}

void zoo_float_to_half(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) {
#if defined(__FLT16_MAX__)
        const _Float16 v = (_Float16)x[i];
        memcpy(out + i, &v, 2);
#else
        uint32_t b;
        memcpy(&b, x + i, 4);
        const uint32_t sign = (b >> 16) & 0x8000, a = b & 0x7FFFFFFF;
        uint32_t hv;
        if (a >= 0x7F800000) {  // inf, nan
            hv = 0x7C00 | (a > 0x7F800000 ? 0x200 | ((a >> 13) & 0x3FF) : 0);
        } else if (a >= 0x477FF000) {  // rounds past the largest half: inf
            hv = 0x7C00;
        } else if (a < 0x38800000) {  // subnormal half (or zero): round a * 2^24 to an integer
            float f;
            memcpy(&f, &a, 4);
            hv = (uint32_t)rintf(f * 16777216.0f);
        } else {  // normal: rebias, round the 13 dropped bits to nearest even
            const uint32_t m = a + 0xC8000FFF + ((a >> 13) & 1);
            hv = m >> 13;
        }
        out[i] = (uint16_t)(sign | hv);
#endif
    }
}

// out = w * (h * (1 / sqrt(mean(h^2) + eps))) per row of `dim`, h = x, or x + res when res is
// given (h is then also written to h_out: the block's new residual).
void zoo_rms_norm(const float *x, const float *res, float *h_out, const float *w, float *out,
                  int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim, *h = res ? h_out + r * dim : (float *)xr;
        if (res)
            for (int64_t i = 0; i < dim; i++) h[i] = xr[i] + res[r * dim + i];
        float ss = dot16(h, h, dim);
        int64_t i;
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (i = 0; i < dim; i++) o[i] = w[i] * (h[i] * inv);
    }
}

// Rotate the first 2 * half dims of x (B, H, T, D) in place, D contiguous, strides sb, sh, st
// in floats; cos and sin are (B or 1, T, half), cb their row stride (0: shared by the batch).
// Half-split pairs dim i with i + half (Llama); interleaved pairs 2i with 2i + 1 (DeepSeek).
void zoo_rope(float *x, int64_t B, int64_t H, int64_t T, int64_t sb, int64_t sh, int64_t st,
              const float *cos, const float *sin, int64_t cb, int64_t half, int interleaved) {
    const int64_t a = interleaved ? 2 : 1, b = interleaved ? 1 : half;  // x1 at a*i, x2 at a*i+b
    for (int64_t n = 0; n < B; n++)
        for (int64_t t = 0; t < T; t++) {
            const float *c = cos + n * cb + t * half, *s = sin + n * cb + t * half;
            for (int64_t h = 0; h < H; h++) {
                float *p = x + n * sb + h * sh + t * st;
                for (int64_t i = 0; i < half; i++) {
                    float x1 = p[a * i], x2 = p[a * i + b];
                    p[a * i] = x1 * c[i] - x2 * s[i];
                    p[a * i + b] = x2 * c[i] + x1 * s[i];
                }
            }
        }
}

// Decode attention, one query per row: out (B, Hq, Dv) from q (B, Hq, D) over k (B, Hk, S, D)
// and v (B, Hk, S, Dv), each strided (sb, sh, ss in floats; the last dim contiguous). Row b's
// query sits at position pos[b] (or pos0 for every row when pos is NULL) and sees slots
// <= its position, and with a window > 0 only the last `window` of them; one position for all
// rows without a window (or with one no shorter than S) sees the whole slice, as
// reference._visible. Scores are scale * q.k, soft-capped as cap * tanh(score / cap) when
// cap > 0, and sinks (Hq,) add one logit per head to each softmax's denominator. Two passes:
// the scores, then their softmax's weighted sum of v.
void zoo_decode_attention(const float *q, int64_t qsb, int64_t qsh, const float *k, int64_t ksb,
                          int64_t ksh, int64_t kss, const float *v, int64_t vsb, int64_t vsh,
                          int64_t vss, float *out, int64_t B, int64_t Hq, int64_t Hk, int64_t S,
                          int64_t D, int64_t Dv, const int64_t *pos, int64_t pos0,
                          int64_t window, float scale, float cap, const float *sinks,
                          int threads) {
    const int64_t group = Hq / Hk, all = !pos && (window <= 0 || S <= window);
    if (B * Hq * S * (D + Dv) < (1 << 17)) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *p = (float *)malloc((S > 0 ? S : 1) * sizeof(float));
        float *tmp = (float *)malloc(((D > Dv ? D : Dv) + 1) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * Hq; bh++) {
            const int64_t b = bh / Hq, h = bh % Hq, kh = h / group;
            const int64_t at = pos ? pos[b] : pos0;
            const int64_t hi = all || at + 1 > S ? S : at + 1;
            const int64_t lo = all || window <= 0 || at - window + 1 < 0 ? 0 : at - window + 1;
            zoo_attend(q + b * qsb + h * qsh, k + b * ksb + kh * ksh, kss, v + b * vsb + kh * vsh,
                       vss, lo, hi, D, Dv, scale, cap, sinks ? sinks + h : NULL, 0, p, tmp,
                       out + bh * Dv);
        }
        free(p);
        free(tmp);
    }
}

// Row s of a cache of `half` (fp16) or fp32 rows `stride` elements apart, as floats (n):
// the row itself, or its conversion into tmp.
static inline const float *row(const void *base, int64_t s, int64_t stride, int64_t n, int half,
                               float *tmp) {
    if (!half) return (const float *)base + s * stride;
    zoo_half_to_float((const uint16_t *)base + s * stride, tmp, n);
    return tmp;
}

// e[i] = exp(x[i]) for x[i] <= 0 (scores less their maximum), in straight-line arithmetic the
// compiler vectorizes (libm's expf is a call per value: a third of a decode step's attention at
// 500 positions). Range reduction x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for
// e^r (relative error under 2e-7, about 2 ulp), 2^n put into the exponent; below -87 the
// result is 0 (e^-87 is under fp32's smallest normal, and a softmax weight that small is 0).
void zoo_exp_nonpositive(const float *x, float *e, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i] < -87.0f ? -87.0f : x[i];
        const float k = rintf(v * 1.44269504088896341f);
        const float r = (v - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
        float p = 1.3888889e-3f;
        p = p * r + 8.3333338e-3f;
        p = p * r + 4.1666668e-2f;
        p = p * r + 1.6666667e-1f;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        const int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, 4);
        e[i] = x[i] < -87.0f ? 0.0f : p * scale;
    }
}

void zoo_attend(const float *q, const void *k, int64_t kss, const void *v, int64_t vss,
                int64_t lo, int64_t hi, int64_t D, int64_t Dv, float scale, float cap,
                const float *sink, int half, float *p, float *tmp, float *o) {
    zoo_attend_group(q, 1, D, k, kss, v, vss, lo, hi, D, Dv, scale, cap, sink, half, p, tmp, o);
}

// G query heads (q: G rows qs floats apart) of one kv head against its slots lo..hi-1: each
// key and value row is read (and converted from fp16) once for the G heads; each head's
// arithmetic is zoo_attend's for it alone. p: G * (hi - lo) floats; o: G rows of Dv.
void zoo_attend_group(const float *q, int64_t G, int64_t qs, const void *k, int64_t kss,
                      const void *v, int64_t vss, int64_t lo, int64_t hi, int64_t D, int64_t Dv,
                      float scale, float cap, const float *sinks, int half, float *p,
                      float *tmp, float *o) {
    zoo_attend_heads(q, G, G, qs, k, kss, v, vss, lo, &hi, D, Dv, scale, cap, sinks, half, p,
                     tmp, o);
}

// The same for G query heads in groups of `per` (a chain's tokens, one group each), group i
// against slots lo..his[i]-1 (his ascending) and head g with sink sinks[g % per]: each key
// and value row is read (and converted) once for all the heads that reach it, each head's
// arithmetic still zoo_attend's. p: G * (his[last] - lo) floats.
void zoo_attend_heads(const float *q, int64_t G, int64_t per, int64_t qs, const void *k,
                      int64_t kss, const void *v, int64_t vss, int64_t lo, const int64_t *his,
                      int64_t D, int64_t Dv, float scale, float cap, const float *sinks,
                      int half, float *p, float *tmp, float *o) {
    const int64_t n = his[G / per - 1] - lo, at = D > Dv ? D : Dv;  // tmp: a row, G totals
    for (int64_t s = 0, i = 0, g0 = 0; s < n; s++) {  // groups i.. (heads g0..) reach slot s
        const float *kr = row(k, lo + s, kss, D, half, tmp);
        for (; lo + s >= his[i]; i++) g0 += per;
        for (int64_t g = g0; g < G; g++) {
            float score = dot16(q + g * qs, kr, D) * scale;
            if (cap > 0) score = tanhf(score / cap) * cap;
            p[g * n + s] = score;
        }
    }
    for (int64_t g = 0; g < G; g++) {  // softmax weights, unnormalized; each head's total
        const int64_t ng = his[g / per] - lo;
        float top = sinks ? sinks[g % per] : -INFINITY, *pg = p + g * n;
        for (int64_t s = 0; s < ng; s++) top = pg[s] > top ? pg[s] : top;
        for (int64_t s = 0; s < ng; s++) pg[s] -= top;
        zoo_exp_nonpositive(pg, pg, ng);
        for (int64_t d = 0; d < Dv; d++) o[g * Dv + d] = 0;
        float sink = 0.0f;
        if (sinks) {
            const float ds = sinks[g % per] - top;
            zoo_exp_nonpositive(&ds, &sink, 1);
        }
        tmp[at + g] = sink;  // the total so far
    }
    for (int64_t s = 0, i = 0, g0 = 0; s < n; s++) {
        const float *vr = row(v, lo + s, vss, Dv, half, tmp);
        for (; lo + s >= his[i]; i++) g0 += per;
        for (int64_t g = g0; g < G; g++) {
            tmp[at + g] += p[g * n + s];
            axpy(o + g * Dv, p[g * n + s], vr, Dv);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float total = tmp[at + g], inv = total > 0 ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < Dv; d++) o[g * Dv + d] *= inv;
    }
}
