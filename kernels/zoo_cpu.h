// What the CPU kernels (qgemv.c, cpu_ops.c, cpu_decode.c: one library) share.
#pragma once
#include <stdint.h>

// GGML block types (GGML's own ids) that qdot.c multiplies as the file stores them.
enum { ZOO_Q4_0 = 2, ZOO_Q4_1 = 3, ZOO_Q5_0 = 6, ZOO_Q5_1 = 7, ZOO_Q8_0 = 8, ZOO_Q4_K = 12,
       ZOO_Q5_K = 13, ZOO_Q6_K = 14 };

// A (N, K) weight: quantized codes with group scales (see qgemv.c), plain fp32 when
// bits == 32 (codes is then the float matrix and no factor is read), or GGML blocks when
// type != 0 (codes: N rows of row_bytes; only N, K, type, row_bytes and perm are read).
typedef struct {
    const void *codes;  // uint8 (N, K/2) when bits == 4, int8 (N, K) for 5-8, float (N, K) for 32
    const void *scales; // (N, G) of scale_kind
    const void *mins;   // (N, G) of min_kind, or NULL
    const uint16_t *d;  // fp16 (N, K/superblock) or NULL: scale = d * small int
    const uint16_t *dmin;
    int64_t N, K, gs, superblock, offset, bits;
    int64_t scale_kind, min_kind;  // 0 fp32, 1 fp16, 2 int8, 3 uint8
    int64_t type, row_bytes;       // GGML blocks (ZOO_Q4_0 ...); 0: the layout above
    const int32_t *perm;           // blocks: NULL, or the stored row of each output row
} qweight_t;

// A row of x in 8-bit blocks of 32 (qdot.c's zoo_q8_quantize_row), read by every block type.
typedef struct {
    const int8_t *q;     // codes, K padded to a multiple of 64 with zeros
    const float *dsp;    // each block's scale, 8 times
    const float *dssp;   // each block's scale * sum of its codes / 8, 8 times
    const float *ds;     // each block's scale * sum of its codes
    const float *ds16;   // the same per half block (16 codes)
} q8row_t;

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
    q8row_t q8[MAX_ROWS];  // GGML blocks: each row of x in 8-bit blocks
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

// Bytes of one row of x in 8-bit blocks; quantize a row into such a buffer (64-byte aligned).
int64_t zoo_q8_row_bytes(int64_t K);
void zoo_q8_quantize_row(const float *x, int64_t K, void *buf, q8row_t *row);
// y[r * ldy + n] = x_r . W[n] for GGML-block W, n0 <= n < n1, the M rows of x quantized.
void zoo_qdot_rows(const qweight_t *w, const q8row_t *x, int64_t M, float *y, int64_t ldy,
                   int64_t n0, int64_t n1);

// One query against keys/values slots lo..hi-1 (rows kss / vss floats apart): o (Dv) =
// softmax(scale * q.k, soft-capped, with an optional sink logit) @ v; p: hi - lo floats.
void zoo_attend(const float *q, const float *k, int64_t kss, const float *v, int64_t vss,
                int64_t lo, int64_t hi, int64_t D, int64_t Dv, float scale, float cap,
                const float *sink, float *p, float *o);
