// The operands of kernels/cpu/qdot.c's products, in their formats: W's GGML blocks (sizes, the
// repacking into groups of 16 rows, dequantization bit for bit as the gguf package's) and x's
// 8-bit blocks (zoo_q8_quantize_row). The repacked layout: qformats.h; why: qdot.c's opening.
#include <stdint.h>
#include <string.h>

#include "qformats.h"
#include "qvec.h"
#include "zoo_cpu.h"

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

int64_t zoo_block_bytes(int64_t type) { return block_bytes(type); }
int64_t zoo_block_values(int64_t type) { return block_values(type); }

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

// MXFP4: e2m1 codes as doubled values (kvalues_mxfp4); the block scale: qformats.h's e8m0_half.
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

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
