// Decode's small per-layer ops on CPUs, fp32, one call each instead of the reference's chain of
// torch ops (each a few microseconds of dispatch for a few hundred numbers). Same arithmetic,
// rounding for rounding, as kernels/reference.py (ISO C: no fused multiply-adds are formed),
// except where a sum's order differs.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "zoo_cpu.h"

// sum_i a[i] * b[i] in 16 lane-wise partial sums, then added pairwise.
#if defined(__AVX512F__)
#include <immintrin.h>
static inline float dot16(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    float total = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}
#else
static inline float dot16(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    for (; i < n; i++) acc[0] += a[i] * b[i];
    return acc[0];
}
#endif

// o[i] += e * v[i] (o and v do not overlap: the compiler vectorizes it)
static inline void axpy(float *restrict o, float e, const float *restrict v, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] += e * v[i];
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
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * Hq; bh++) {
            const int64_t b = bh / Hq, h = bh % Hq, kh = h / group;
            const int64_t at = pos ? pos[b] : pos0;
            const int64_t hi = all || at + 1 > S ? S : at + 1;
            const int64_t lo = all || window <= 0 || at - window + 1 < 0 ? 0 : at - window + 1;
            zoo_attend(q + b * qsb + h * qsh, k + b * ksb + kh * ksh, kss, v + b * vsb + kh * vsh,
                       vss, lo, hi, D, Dv, scale, cap, sinks ? sinks + h : NULL, p,
                       out + bh * Dv);
        }
        free(p);
    }
}

void zoo_attend(const float *q, const float *k, int64_t kss, const float *v, int64_t vss,
                int64_t lo, int64_t hi, int64_t D, int64_t Dv, float scale, float cap,
                const float *sink, float *p, float *o) {
    float top = sink ? *sink : -INFINITY;
    for (int64_t s = lo; s < hi; s++) {
        float score = dot16(q, k + s * kss, D) * scale;
        if (cap > 0) score = tanhf(score / cap) * cap;
        p[s - lo] = score;
        if (score > top) top = score;
    }
    float total = sink ? expf(*sink - top) : 0.0f;
    for (int64_t d = 0; d < Dv; d++) o[d] = 0;
    for (int64_t s = lo; s < hi; s++) {
        const float e = expf(p[s - lo] - top);
        total += e;
        axpy(o, e, v + s * vss, Dv);
    }
    const float inv = total > 0 ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < Dv; d++) o[d] *= inv;
}
