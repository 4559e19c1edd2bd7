// Few-row products on CPUs, y (M, N) = x (M, K) @ W.T, for the two kinds of weight a fused
// decode step reads (decode.c): plain fp32 rows, and GGML blocks (qdot.c). x is prepared
// once per product (zoo_qx_prepare: for blocks, each row quantized to 8-bit blocks), then any
// thread computes any range of W's rows from it (zoo_qgemv_rows).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zoo_cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define W 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSUM(v) _mm512_reduce_add_ps(v)
#define VLOAD_N(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)  // n < 16 floats
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VLOAD(p) _mm256_loadu_ps(p)
static inline float VSUM(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf VLOAD_N(const float *p, int64_t n) {  // n < 8 floats, the rest 0
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
}
#else
#define W 1
typedef float vf;
#define VZERO() 0.0f
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VADD(a, b) ((a) + (b))
#define VLOAD(p) (*(p))
#define VSUM(v) (v)
#endif

// A fp32 weight row against a row of x, in four accumulators: the row streams from memory,
// where one accumulator's multiply-add latency would bound the loop below the memory's rate.
// The last K % W columns are one masked load, not a scalar loop: with the scalar loop (never
// run at SmolLM2's 576 columns) the compiler's code around it cost each row enough that a
// step's products read 31 GB/s where the same rows without it read 48 (AMD EPYC, 2 threads).
static float dot4(const float *a, const float *b, int64_t K) {
    vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    int64_t k = 0;
    for (; k + 4 * W <= K; k += 4 * W) {
        a0 = VFMA(VLOAD(a + k), VLOAD(b + k), a0);
        a1 = VFMA(VLOAD(a + k + W), VLOAD(b + k + W), a1);
        a2 = VFMA(VLOAD(a + k + 2 * W), VLOAD(b + k + 2 * W), a2);
        a3 = VFMA(VLOAD(a + k + 3 * W), VLOAD(b + k + 3 * W), a3);
    }
    for (; k + W <= K; k += W) a0 = VFMA(VLOAD(a + k), VLOAD(b + k), a0);
#if W > 1
    if (k < K) a1 = VFMA(VLOAD_N(a + k, K - k), VLOAD_N(b + k, K - k), a1);
#endif
    return VSUM(VADD(VADD(a0, a1), VADD(a2, a3)));
}

int64_t zoo_qx_bytes(const qweight_t *w, int64_t M) {
    return w->type ? M * zoo_q8_row_bytes(w->K) : 0;
}

void zoo_qx_prepare(const qweight_t *w, const float *x, int64_t M, qx_t *px, void *buf) {
    px->x = x;
    px->M = M;
    if (w->type)  // GGML blocks: each row of x in 8-bit blocks
        for (int64_t r = 0; r < M; r++)
            zoo_q8_quantize_row(x + r * w->K, w->K, (char *)buf + r * zoo_q8_row_bytes(w->K),
                                &px->q8[r]);
}

void zoo_qgemv_rows(const qweight_t *w, const qx_t *px, float *y, int64_t ldy, int64_t n0,
                    int64_t n1) {
    if (w->type) {
        zoo_qdot_rows(w, px->q8, px->M, y, ldy, n0, n1);
        return;
    }
    const int64_t K = w->K;
    for (int64_t n = n0; n < n1; n++) {
        const float *wn = (const float *)w->data + n * K;
        for (int64_t r = 0; r < px->M; r++) y[r * ldy + n] = dot4(wn, px->x + r * K, K);
    }
}
