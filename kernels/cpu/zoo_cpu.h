// What the CPU kernels (qgemv.c, qdot.c, qformats.c, ops.c, decode.c: one library) share.
#pragma once
#include <stdint.h>

// GGML block types (GGML's own ids) that qdot.c multiplies as the file stores them.
enum { ZOO_Q4_0 = 2, ZOO_Q4_1 = 3, ZOO_Q5_0 = 6, ZOO_Q5_1 = 7, ZOO_Q8_0 = 8, ZOO_Q4_K = 12,
       ZOO_Q5_K = 13, ZOO_Q6_K = 14, ZOO_MXFP4 = 39 };

// A (N, K) weight as the CPU kernels read it: plain fp32 rows (type 0), or GGML blocks
// repacked in groups of 16 rows by qformats.c's zoo_repack (type: ZOO_Q4_0 ...).
typedef struct {
    const void *data;
    int64_t N, K, type;
} qweight_t;

// A row of x in 8-bit blocks of 32, quantized twice (qformats.c's zoo_q8_quantize_row): x =
// d * (256 q + q2) per block.
typedef struct {
    const int8_t *q;     // codes, K padded to a multiple of 64 with zeros
    const int8_t *q2;    // the remainder's codes
    const float *d;      // each block's scale (of 256 q + q2)
    const float *ds;     // each block's scale * the sum of its 256 q + q2
    const float *ds16;   // the same per half block (16 codes)
} q8row_t;

#define MAX_ROWS 16  // rows of x a decode step takes (kernels/cpu/build.py's MAX_ROWS)

// x (M, K) prepared once for a weight's row products (zoo_qx_prepare).
typedef struct {
    const float *x;
    int64_t M;
    q8row_t q8[MAX_ROWS];  // GGML blocks: each row of x in 8-bit blocks
} qx_t;

// Bytes of buffer zoo_qx_prepare needs for w and M rows of x.
int64_t zoo_qx_bytes(const qweight_t *w, int64_t M);
// Prepare x (M, K) for w's row products into buf (zoo_qx_bytes of it); x must outlive px.
void zoo_qx_prepare(const qweight_t *w, const float *x, int64_t M, qx_t *px, void *buf);
// y[r * ldy + n] = x_r . W[n] for the rows n0 <= n < n1 of W, on the calling thread.
void zoo_qgemv_rows(const qweight_t *w, const qx_t *px, float *y, int64_t ldy, int64_t n0,
                    int64_t n1);

// Bytes of one row of x in 8-bit blocks; quantize a row into such a buffer (64-byte aligned).
int64_t zoo_q8_row_bytes(int64_t K);
void zoo_q8_quantize_row(const float *x, int64_t K, void *buf, q8row_t *row);
// y[r * ldy + n] = x_r . W[n] for GGML-block W, n0 <= n < n1, the M rows of x quantized.
void zoo_qdot_rows(const qweight_t *w, const q8row_t *x, int64_t M, float *y, int64_t ldy,
                   int64_t n0, int64_t n1);

// One query against keys/values slots lo..hi-1 (rows kss / vss elements apart; fp16 when
// `half`, else fp32): o (Dv) = softmax(scale * q.k, soft-capped, with an optional sink logit)
// @ v; p: hi - lo floats, tmp: max(D, Dv) + 1 floats.
void zoo_attend(const float *q, const void *k, int64_t kss, const void *v, int64_t vss,
                int64_t lo, int64_t hi, int64_t D, int64_t Dv, float scale, float cap,
                const float *sink, int half, float *p, float *tmp, float *o);
// The same for the G query heads of one kv head (q: G rows qs floats apart; sinks: G or
// NULL), each key and value row read once: p G * (hi - lo) floats, tmp max(D, Dv) + G, o G
// rows of Dv.
void zoo_attend_group(const float *q, int64_t G, int64_t qs, const void *k, int64_t kss,
                      const void *v, int64_t vss, int64_t lo, int64_t hi, int64_t D, int64_t Dv,
                      float scale, float cap, const float *sinks, int half, float *p,
                      float *tmp, float *o);
// The same for G query heads in groups of `per` (a chain's tokens), group i against slots
// lo..his[i]-1 (his ascending), head g's sink sinks[g % per]: each key and value row read
// once for all the heads that reach it. p: G * (his[last] - lo) floats, tmp max(D, Dv) + G,
// o G rows of Dv.
void zoo_attend_heads(const float *q, int64_t G, int64_t per, int64_t qs, const void *k,
                      int64_t kss, const void *v, int64_t vss, int64_t lo, const int64_t *his,
                      int64_t D, int64_t Dv, float scale, float cap, const float *sinks,
                      int half, float *p, float *tmp, float *o);
// e[i] = exp(x[i]) for x[i] <= 0, vectorized (about 2 ulp; 0 below -87).
void zoo_exp_nonpositive(const float *x, float *e, int64_t n);
// fp16 <-> fp32, n values (round to nearest even).
void zoo_half_to_float(const uint16_t *h, float *out, int64_t n);
void zoo_float_to_half(const float *x, uint16_t *out, int64_t n);

// sum_i a[i] * b[i] in 16 lane-wise partial sums, then added pairwise.
#if defined(__AVX512F__)
#include <immintrin.h>
static inline float dot16(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    if (i < n) {  // the last n % 16 in masked lanes: a scalar loop here costs every call
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + i),
                                               _mm512_maskz_loadu_ps(m, b + i)));
    }
    return _mm512_reduce_add_ps(acc);
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
