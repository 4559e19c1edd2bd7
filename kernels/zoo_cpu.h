// What the CPU kernels (qgemv.c, cpu_ops.c, cpu_decode.c: one library) share.
#pragma once
#include <stdint.h>

// A (N, K) weight: quantized codes with group scales (see qgemv.c), or plain fp32 when
// bits == 32 (codes is then the float matrix and no factor is read).
typedef struct {
    const void *codes;  // uint8 (N, K/2) when bits == 4, int8 (N, K) for 5-8, float (N, K) for 32
    const void *scales; // (N, G) of scale_kind
    const void *mins;   // (N, G) of min_kind, or NULL
    const uint16_t *d;  // fp16 (N, K/superblock) or NULL: scale = d * small int
    const uint16_t *dmin;
    int64_t N, K, gs, superblock, offset, bits;
    int64_t scale_kind, min_kind;  // 0 fp32, 1 fp16, 2 int8, 3 uint8
} qweight_t;

#define MAX_ROWS 8  // rows of x one product takes (kernels/cpu_quant.py's MAX_ROWS)

// A row of x as the bf16 loop reads it (qgemv.c's prepare_bf16).
typedef struct {
    uint16_t *xp;  // bf16(x) in the registers' order, zero-padded to whole chunks
    float *xs;     // each group's sum of bf16(x), zero-padded to a multiple of 16 groups
} bf16_row;

// x (M, K) prepared once for a weight's row products (zoo_qx_prepare).
typedef struct {
    const float *x;
    int64_t M;
    int bf16;        // the 4-bit codes multiply bf16(x) (AVX512-BF16 builds)
    bf16_row r[MAX_ROWS];
    float *xs;       // fp32 loop: each row's group sums of x (M x G)
} qx_t;

// Bytes of buffer zoo_qx_prepare needs for w and M rows of x.
int64_t zoo_qx_bytes(const qweight_t *w, int64_t M);
// Prepare x (M, K) for w's row products into buf (zoo_qx_bytes of it); x must outlive px.
// bf16_ok: 4-bit codes may multiply bf16(x) (where the CPU has AVX512-BF16); 0: fp32 x.
void zoo_qx_prepare(const qweight_t *w, const float *x, int64_t M, int bf16_ok, qx_t *px,
                    void *buf);
// Floats of scratch zoo_qgemv_rows needs for w.
int64_t zoo_qgemv_scratch(const qweight_t *w);
// y[r * ldy + n] = x_r . W[n] for the rows n0 <= n < n1 of W, on the calling thread.
void zoo_qgemv_rows(const qweight_t *w, const qx_t *px, float *y, int64_t ldy, int64_t n0,
                    int64_t n1, float *scratch);

// One query against keys/values slots lo..hi-1 (rows kss / vss floats apart): o (Dv) =
// softmax(scale * q.k, soft-capped, with an optional sink logit) @ v; p: hi - lo floats.
void zoo_attend(const float *q, const float *k, int64_t kss, const float *v, int64_t vss,
                int64_t lo, int64_t hi, int64_t D, int64_t Dv, float scale, float cap,
                const float *sink, float *p, float *o);
