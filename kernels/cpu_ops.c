// Decode's small per-layer ops on CPUs, fp32, one call each instead of the reference's chain of
// torch ops (each a few microseconds of dispatch for a few hundred numbers). Same arithmetic,
// rounding for rounding, as kernels/reference.py (ISO C: no fused multiply-adds are formed),
// except where a sum's order differs.
#include <math.h>
#include <stdint.h>

// out = w * (h * (1 / sqrt(mean(h^2) + eps))) per row of `dim`, h = x, or x + res when res is
// given (h is then also written to h_out: the block's new residual).
void zoo_rms_norm(const float *x, const float *res, float *h_out, const float *w, float *out,
                  int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim, *h = res ? h_out + r * dim : (float *)xr;
        if (res)
            for (int64_t i = 0; i < dim; i++) h[i] = xr[i] + res[r * dim + i];
        float acc[16] = {0};  // 16 partial sums: vectorizable without reassociating a chain
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += h[i + j] * h[i + j];
        float ss = 0;
        for (int j = 0; j < 16; j++) ss += acc[j];
        for (; i < dim; i++) ss += h[i] * h[i];
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
