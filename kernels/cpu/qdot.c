// Products with weights in GGML's block formats against x quantized to 8-bit blocks, on CPUs:
// y (M, N) = x (M, K) @ W.T.
//
// Weights are repacked once, at load, losslessly: each group of 16 rows is stored unit by unit
// (a unit: the rows' blocks over 32 columns, or 256 for the K-quants), the 16 block headers
// side by side and the codes interleaved 4 bytes per row, so that one 64-byte vector holds 4
// codes of each of the 16 rows (zoo_repack; same bytes as the file, reordered). x is quantized
// once per product, each row on its own, in blocks of 32: 8-bit codes and the 8-bit codes of
// their remainder, 15 bits in effect (zoo_q8_quantize_row, qformats.c). A vector of codes then
// meets 4 codes of x broadcast to every lane in one u8 x s8 multiply-add (vpdpbusd where the
// CPU has VNNI; maddubs + madd on AVX2), so the integer sums of a block land in one lane per
// output row and are scaled once per block:
//     y[n] += fw[n, b] * d_x[b] * (q_w . q_x)_b + mw[n, b] * (d_x * sum q_x)_b
// (q_x = 256 q1 + q2: two multiply-adds per vector of codes, the sums joined once a block)
// (fw, mw: the block's scale and minimum, or for the K-quants d * sub-scale and -dmin * min;
// Q6_K's -32 * d * sub-scale per 16 columns). The codes of a group are unpacked once and serve
// every row of x: a step of 4 rows of x costs little more than a step of 1.
// Each output (row of x, row of W) is computed by the same instructions in the same order
// whatever the number of rows of x or threads, so a token's product does not depend on the
// batch or on how a prompt was cut into chunks. Layouts: ggml-common.h (block_q4_0 ...).
// Here: the microkernels and the entry points (zoo_qdot_rows, zoo_qgemm). The formats
// (repacking, dequantization, x's quantization): qformats.c and .h; the 16-lane vectors: qvec.h.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "qformats.h"
#include "qvec.h"
#include "zoo_cpu.h"

const char *zoo_qdot_isa(void) { return ZOO_QDOT_ISA; }

// The next unit's codes, requested ahead: the hardware's prefetchers do not follow the
// kernels' order within a unit far enough (Q6_K from memory: 10 GB/s a core without, 32 with).
#ifndef PF_AHEAD
#define PF_AHEAD 2  // units ahead: 1, 2, 4 and 8 measured within 3% of each other; 2 best
#endif
INLINE void prefetch(const uint8_t *p, int64_t n) {
#if defined(__SSE2__)
    for (int64_t k = 0; k < n; k += 64) _mm_prefetch((const char *)(p + k), _MM_HINT_T0);
#else
    (void)p, (void)n;
#endif
}

// ---- the microkernels: one group of 16 rows of W against M rows of x --------------------------------
// acc[r] (16 lanes: the group's rows) gathers row r of x's products, block by block:
// acc += cvt(int sum) * (fw * d_x) + mw * ds_x. M is a constant where dot_group_m calls them,
// so the accumulators stay in registers; a row's arithmetic does not depend on M.

// The block factors of one unit of a legacy type: scale fw, and mw (minimum, or the offset
// term -8 / -16 * d).
INLINE void legacy_factors(int64_t type, const uint8_t *u, vf *fw, vf *mw) {
    if (type == ZOO_MXFP4) {  // codes made unsigned: value + 12 (mk_legacy), so -12 * d
        *fw = vf_e8m0(u);
        *mw = vf_mul(*fw, vf_set1(-12.0f));
        return;
    }
    *fw = vf_half(u);
    if (type == ZOO_Q4_1 || type == ZOO_Q5_1)
        *mw = vf_half(u + 32);
    else if (type == ZOO_Q8_0)
        *mw = vf_zero();
    else
        *mw = vf_mul(*fw, vf_set1(type == ZOO_Q4_0 ? -8.0f : -16.0f));
}

// Q5_0 / Q5_1: 0x10 in the bytes whose code has its fifth bit set: codes 4g..4g+3 (low) or
// 16+4g.. (high) of each row, from the row's 32 bits of high bits (one lane).
INLINE vb q5_high(vb qh, int first) {
    const int byte = first / 8, shift = first % 8;  // bits first..first+3 sit in one byte
    const vb idx = vb_lanes4(0x01010101u * (uint32_t)byte, 0x01010101u * (uint32_t)(4 + byte),
                             0x01010101u * (uint32_t)(8 + byte), 0x01010101u * (uint32_t)(12 + byte));
    const vb bits = vb_pattern(0x08040201u << shift);
    return vb_and(vb_bytemask(vb_shuffle(qh, idx), bits), vb_set1(0x10));
}

// s1 += w . q1, s2 += w . q2 for 4 codes of x (at column `at`) in every lane. With several
// rows of x, AVX-512 takes x's codes straight from memory within the multiply-add ({1to16}:
// one instruction where compilers emit a broadcast and a multiply-add; 10-20% faster at 4
// rows, slower at one).
INLINE void dot2(vi *s1, vi *s2, vb w, const q8row_t *x, int64_t at, int M) {
#if defined(__AVX512VNNI__) && defined(ZOO_QDOT_ISA_AVX512)
    if (M > 1) {
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*s1) : "v"(w), "m"(*(const int32_t *)(x->q + at)));
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*s2) : "v"(w), "m"(*(const int32_t *)(x->q2 + at)));
        return;
    }
#else
    (void)M;
#endif
    *s1 = vi_dot(*s1, w, vb_x(x->q + at));
    *s2 = vi_dot(*s2, w, vb_x(x->q2 + at));
}

// dot2 for two vectors of codes (each under 64) at columns a1 and a2: one widening for both
// without VNNI (vi_dot2).
INLINE void dot2x2(vi *s1, vi *s2, vb w1, vb w2, const q8row_t *x, int64_t a1, int64_t a2, int M) {
#if defined(__AVX512VNNI__) && defined(ZOO_QDOT_ISA_AVX512)
    if (M > 1) {
        dot2(s1, s2, w1, x, a1, M);
        dot2(s1, s2, w2, x, a2, M);
        return;
    }
#else
    (void)M;
#endif
    *s1 = vi_dot2(*s1, w1, vb_x(x->q + a1), w2, vb_x(x->q + a2));
    *s2 = vi_dot2(*s2, w1, vb_x(x->q2 + a1), w2, vb_x(x->q2 + a2));
}

// acc += cvt(256 s1 + s2) * fw * d_x + mw * ds_x: a block's (or sub-block's) sums, scaled.
INLINE vf flush(vf acc, vi s1, vi s2, vf fw, vf mw, float d, float ds) {
    acc = vf_fmadd(vf_cvt(vi_join(s1, s2)), vf_mul(fw, vf_set1(d)), acc);
    return vf_fmadd(mw, vf_set1(ds), acc);
}

INLINE void mk_legacy(int64_t type, const uint8_t *w, int64_t nu, const q8row_t *x, int M,
                      vf *acc) {
    const layout_t l = layout(type);
    const uint8_t *codes = w + pad64(nu * l.header);
    const vb low = vb_set1(0x0F);
    const int five = type == ZOO_Q5_0 || type == ZOO_Q5_1, fp4 = type == ZOO_MXFP4;
    // MXFP4's codes -> their doubled e2m1 values + 12 (0..24: unsigned, as the products need)
    const vb fp4_values = vb_lanes4(0x0F0E0D0Cu, 0x18141210u, 0x090A0B0Cu, 0x00040608u);
    for (int64_t b = 0; b < nu; b++) {
        const uint8_t *u = w + b * l.header, *qh = codes + b * l.codes, *qs = qh + (five ? 64 : 0);
        prefetch(qh + PF_AHEAD * l.codes, l.codes);
        vf fw, mw;
        legacy_factors(type, u, &fw, &mw);
        vi s1[ROWS], s2[ROWS];
UNROLL
        for (int r = 0; r < M; r++) s1[r] = s2[r] = vi_zero();
        if (type == ZOO_Q8_0) {  // signed codes: |w| times x with w's sign
UNROLL
            for (int g = 0; g < 8; g++) {
                const vb c = vb_load(qs + 64 * g), w8 = vb_abs8(c);
UNROLL
                for (int r = 0; r < M; r++) {
                    s1[r] = vi_dot(s1[r], w8, vb_sign8(vb_x(x[r].q + 32 * b + 4 * g), c));
                    s2[r] = vi_dot(s2[r], w8, vb_sign8(vb_x(x[r].q2 + 32 * b + 4 * g), c));
                }
            }
        } else {
            const vb hb = five ? vb_load(qh) : low;
UNROLL
            for (int g = 0; g < 4; g++) {
                const vb c = vb_load(qs + 64 * g);
                vb lo = vb_and(c, low), hi = vb_and(vb_srl(c, 4), low);
                if (five) {
                    lo = vb_or(lo, q5_high(hb, 4 * g));
                    hi = vb_or(hi, q5_high(hb, 16 + 4 * g));
                }
                if (fp4) {
                    lo = vb_shuffle(fp4_values, lo);
                    hi = vb_shuffle(fp4_values, hi);
                }
UNROLL
                for (int r = 0; r < M; r++) {
                    dot2x2(&s1[r], &s2[r], lo, hi, &x[r], 32 * b + 4 * g, 32 * b + 16 + 4 * g, M);
                }
            }
        }
UNROLL
        for (int r = 0; r < M; r++) acc[r] = flush(acc[r], s1[r], s2[r], fw, mw, x[r].d[b], x[r].ds[b]);
    }
}

// Q4_K / Q5_K: 8 sub-blocks of 32 per unit, run j holding sub-blocks 2j (low nibbles) and
// 2j + 1 (high); each sub-block's scale d * sc and minimum -dmin * m, for the 16 rows.
INLINE void k45_factors(const uint8_t *u, float fw[8][R], float mw[8][R]) {
    b16 S[12];  // k4_scales for the 16 rows at once: byte k of every row is one vector
    for (int k = 0; k < 12; k++) S[k] = b16_load(u + 64 + R * k);
    const vf d = vf_half(u), dmin = vf_mul(vf_half(u + 32), vf_set1(-1.0f));
    for (int t = 0; t < 4; t++) {
        const b16 sc = b16_and(S[t], 63), mn = b16_and(S[t + 4], 63);
        const b16 sc4 = b16_or(b16_and(S[t + 8], 15), b16_sll(b16_srl(S[t], 6), 4));
        const b16 mn4 = b16_or(b16_srl(S[t + 8], 4), b16_sll(b16_srl(S[t + 4], 6), 4));
        vf_store(fw[t], vf_mul(vf_b16(sc), d));
        vf_store(mw[t], vf_mul(vf_b16(mn), dmin));
        vf_store(fw[t + 4], vf_mul(vf_b16(sc4), d));
        vf_store(mw[t + 4], vf_mul(vf_b16(mn4), dmin));
    }
}

// Columns 32 sub + 4g .. + 3 of the 16 rows (sub-block sub: run sub / 2's low or high nibbles,
// with Q5_K's fifth bit from bit `sub` of each code's byte of high bits).
INLINE vb k45_codes(int five, const uint8_t *qs, const uint8_t *qh, int sub, int g) {
    const vb low = vb_set1(0x0F), c = vb_load(qs + 64 * (8 * (sub / 2) + g));
    vb q = sub % 2 ? vb_and(vb_srl(c, 4), low) : vb_and(c, low);
    if (five) {
        const vb h = vb_load(qh + 64 * g);
        q = vb_or(q, vb_and(sub < 4 ? vb_sll(h, 4 - sub) : vb_srl(h, sub - 4), vb_set1(0x10)));
    }
    return q;
}

// Q6_K: 16 sub-blocks of 16 per unit with int8 scales, codes 0..63 less 32. Half h holds 128
// columns: from its low bits' first (L0) and second (L1) 32 bytes and its 32 bytes of high
// bits (H), column 4g + k of chunk c is  c 0: L0 & 15 | H bits 0-1,  c 1: L1 & 15 | H 2-3,
// c 2: L0 >> 4 | H 4-5,  c 3: L1 >> 4 | H 6-7  (4 codes of each row per vector). Sub-block
// `sub` (columns 16 sub ..) is half sub / 8, chunk (sub / 2) % 4, its g (0-3) 4 (sub % 2) + g.
INLINE vb q6_codes(const uint8_t *unit_codes, int sub, int g) {
    const int h = sub / 8, c = (sub / 2) % 4, at = 4 * (sub % 2) + g;
    const uint8_t *ql = unit_codes + 1536 * h, *qh = ql + 1024;
    const vb low = vb_set1(0x0F), top = vb_set1(0x30);
    const vb lb = vb_load(ql + 64 * (8 * (c % 2) + at)), hb = vb_load(qh + 64 * at);
    const vb lo = c < 2 ? vb_and(lb, low) : vb_and(vb_srl(lb, 4), low);
    const vb hi = vb_and(c == 0 ? vb_sll(hb, 4) : c == 1 ? vb_sll(hb, 2) : c == 2 ? hb
                         : vb_srl(hb, 2), top);  // fmt: skip
    return vb_or(lo, hi);
}

INLINE void q6_factors(const uint8_t *u, float fw[16][R], float mw[16][R]) {
    const vf d = vf_half(u);
    for (int sub = 0; sub < 16; sub++) {
        const vf f = vf_mul(vf_i8(u + 32 + R * sub), d);
        vf_store(fw[sub], f);
        vf_store(mw[sub], vf_mul(f, vf_set1(-32.0f)));
    }
}

// A K-quant unit's sub-blocks (8 of 32 columns, or Q6_K's 16 of 16) against M rows of x, in
// column order, sub-block by sub-block: s1, s2 over its codes (codes(sub, g)), then flushed
// into acc with its factors. The one arithmetic of every K-quant product: streamed from the
// weights (decode) or from a unit unpacked ahead (many rows: kq_rows).
#define KQ_PASS(nsub, codes)                                                                  \
    for (int sub = 0; sub < (nsub); sub++) {                                                  \
        vi s1[ROWS], s2[ROWS];                                                                \
        UNROLL for (int r = 0; r < M; r++) s1[r] = s2[r] = vi_zero();                         \
        UNROLL for (int g2 = 0; g2 < 256 / (nsub) / 4; g2 += 2) {  /* codes g2, g2 + 1 */     \
            vb q[2];                                                                          \
            UNROLL for (int g = g2; g < g2 + 2; g++) q[g - g2] = codes;                       \
            const int64_t at = 256 * s + 256 / (nsub) * sub + 4 * g2;                         \
            UNROLL for (int r = 0; r < M; r++)                                                \
                dot2x2(&s1[r], &s2[r], q[0], q[1], &x[r], at, at + 4, M);                     \
        }                                                                                     \
        const vf f = vf_load(fw[sub]), m = vf_load(mw[sub]);                                  \
        UNROLL for (int r = 0; r < M; r++) {                                                  \
            const int64_t blk = 8 * s + sub * 8 / (nsub);                                     \
            const float off = (nsub) == 16 ? x[r].ds16[16 * s + sub] : x[r].ds[blk];          \
            acc[r] = flush(acc[r], s1[r], s2[r], f, m, x[r].d[blk], off);                     \
        }                                                                                     \
    }

INLINE void mk_k45(int five, const uint8_t *w, int64_t nu, const q8row_t *x, int M, vf *acc) {
    const uint8_t *codes = w + pad64(nu * 256);
    for (int64_t s = 0; s < nu; s++) {
        const uint8_t *u = w + s * 256, *qh = codes + s * (five ? 2560 : 2048);
        const uint8_t *qs = qh + (five ? 512 : 0);
        prefetch(qh + PF_AHEAD * (five ? 2560 : 2048), five ? 2560 : 2048);
        float fw[8][R] __attribute__((aligned(64))), mw[8][R] __attribute__((aligned(64)));
        k45_factors(u, fw, mw);
        UNROLL_SUBS KQ_PASS(8, k45_codes(five, qs, qh, sub, g))
    }
}

INLINE void mk_q6_k(const uint8_t *w, int64_t nu, const q8row_t *x, int M, vf *acc) {
    const uint8_t *codes = w + pad64(nu * 288);
    for (int64_t s = 0; s < nu; s++) {
        prefetch(codes + (s + PF_AHEAD) * 3072, 3072);
        float fw[16][R] __attribute__((aligned(64))), mw[16][R] __attribute__((aligned(64)));
        q6_factors(w + s * 288, fw, mw);
        if (M == 1) {  // one row: unrolled, each sub-block's shifts constant (AVX2: +13%)
            UNROLL_Q6 KQ_PASS(16, q6_codes(codes + s * 3072, sub, g))
        } else {  // (AVX2: more rows unrolled spill registers, -30%)
            UNROLL_SUBS KQ_PASS(16, q6_codes(codes + s * 3072, sub, g))
        }
    }
}

// One unit's codes unpacked for many passes of rows: ub[sub][g] (64 bytes each).
INLINE void mk_unpacked(const uint8_t *ub, int nsub, const float *fwp, const float *mwp,
                        int64_t s, const q8row_t *x, int M, vf *acc) {
    const float (*fw)[R] = (const float (*)[R])fwp, (*mw)[R] = (const float (*)[R])mwp;
    if (nsub == 8) {  // (sub-blocks not unrolled: the loads need no constant, the registers do)
        _Pragma("GCC unroll 1") KQ_PASS(8, vb_load(ub + 64 * (8 * sub + g)))
    } else {
        _Pragma("GCC unroll 1") KQ_PASS(16, vb_load(ub + 64 * (4 * sub + g)))
    }
}

// Many rows of x against one Q5_K / Q6_K group, unit by unit: the unit's factors decoded and its
// codes unpacked once (ub: 4 KiB, in L1), then every pass of rows of x through it, each
// pass's sums carried in acc (M x 16 floats) from unit to unit. The same arithmetic, in the
// same order, as the streamed kernels (mk_k45, mk_q6_k) that decode steps run.
INLINE void unpacked_pass(const uint8_t *ub, int nsub, const float *fw, const float *mw,
                          int64_t s, const q8row_t *x, int M, float *accs) {
    vf acc[ROWS];
UNROLL
    for (int r = 0; r < M; r++) acc[r] = vf_load(accs + R * r);
    mk_unpacked(ub, nsub, fw, mw, s, x, M, acc);
UNROLL
    for (int r = 0; r < M; r++) vf_store(accs + R * r, acc[r]);
}

static void kq_group(const qweight_t *w, const uint8_t *group, const q8row_t *x, int64_t M,
                     float *accs) {
    const int64_t nu = w->K / 256;
    const int q6 = w->type == ZOO_Q6_K, five = w->type == ZOO_Q5_K, nsub = q6 ? 16 : 8;
    const uint8_t *codes = group + pad64(nu * layout(w->type).header);
    uint8_t ub[64 * 64] __attribute__((aligned(64)));
    float fw[16][R] __attribute__((aligned(64))), mw[16][R] __attribute__((aligned(64)));
    memset(fw, 0, sizeof fw);  // Q4_K / Q5_K fill 8 of the 16
    memset(mw, 0, sizeof mw);
    memset(accs, 0, M * R * sizeof(float));
    for (int64_t s = 0; s < nu; s++) {
        if (q6) {
            q6_factors(group + s * 288, fw, mw);
            for (int sub = 0; sub < 16; sub++)
                for (int g = 0; g < 4; g++)
                    vb_store(ub + 64 * (4 * sub + g), q6_codes(codes + s * 3072, sub, g));
        } else {
            const uint8_t *qh = codes + s * (five ? 2560 : 2048), *qs = qh + (five ? 512 : 0);
            k45_factors(group + s * 256, fw, mw);
            for (int sub = 0; sub < 8; sub++)
                for (int g = 0; g < 8; g++)
                    vb_store(ub + 64 * (8 * sub + g), k45_codes(five, qs, qh, sub, g));
        }
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            float *a = accs + r0 * R;
            switch (M - r0 < ROWS ? M - r0 : ROWS) {
#define PASS(k) case k: unpacked_pass(ub, nsub, fw[0], mw[0], s, x + r0, k, a); break;
                PASS(1) PASS(2) PASS(3) PASS(4)
#undef PASS
            }
        }
    }
}

INLINE void dot_group(const qweight_t *w, const uint8_t *group, const q8row_t *x, int M,
                      float *out, int64_t ldo) {
    vf acc[ROWS];
UNROLL
    for (int r = 0; r < M; r++) acc[r] = vf_zero();
    const int64_t nu = w->K / block_values(w->type);
    switch (w->type) {
        case ZOO_Q4_K: mk_k45(0, group, nu, x, M, acc); break;
        case ZOO_Q5_K: mk_k45(1, group, nu, x, M, acc); break;
        case ZOO_Q6_K: mk_q6_k(group, nu, x, M, acc); break;
        default: mk_legacy(w->type, group, nu, x, M, acc);
    }
UNROLL
    for (int r = 0; r < M; r++) vf_store(out + r * ldo, acc[r]);
}

static void dot_group_m(const qweight_t *w, const uint8_t *group, const q8row_t *x, int64_t M,
                        float *out, int64_t ldo) {
    switch (M) {
#define CASE(k) case k: dot_group(w, group, x, k, out, ldo); break;
        CASE(1) CASE(2) CASE(3) CASE(4)
#if ROWS > 4
        CASE(5) CASE(6) CASE(7) CASE(8)
#endif
#undef CASE
    }
}

// The part of a weight that stays in a core's L2 cache while every pass of rows of x goes
// through it (prefill: x's rows are re-read for each part, from the shared L3; each part's
// codes once, from memory).
#define PANEL_BYTES (256 << 10)

// One group against one pass of rows of x: y's rows n0..n1 of it (the group computed whole).
static void group_pass(const qweight_t *w, const uint8_t *group, int64_t g, const q8row_t *x,
                       int64_t k, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    float out[ROWS * R] __attribute__((aligned(64)));
    const int64_t a = g * R > n0 ? g * R : n0, b = (g + 1) * R < n1 ? (g + 1) * R : n1;
    if (a == g * R && b == a + R) {  // a whole group: straight into y
        dot_group_m(w, group, x, k, y + a, ldy);
        return;
    }
    dot_group_m(w, group, x, k, out, R);
    for (int64_t r = 0; r < k; r++)
        for (int64_t n = a; n < b; n++) y[r * ldy + n] = out[r * R + n - g * R];
}

// y[r * ldy + n] = x_r . W[n] for the rows n0 <= n < n1 of W (the M rows of x quantized). The
// groups of 16 rows that the range touches are computed whole; only the range is written.
void zoo_qdot_rows(const qweight_t *w, const q8row_t *x, int64_t M, float *y, int64_t ldy,
                   int64_t n0, int64_t n1) {
    const int64_t gb = group_bytes(w->type, w->K / block_values(w->type));
    // many rows of Q5_K / Q6_K, whose codes take most unpacking: unit by unit (kq_group; Q6_K
    // prefill 19% faster), the others streamed in panels
    if (M > ROWS && (w->type == ZOO_Q5_K || w->type == ZOO_Q6_K)) {
        float *accs = aligned_alloc(64, M * R * sizeof(float));
        for (int64_t g = n0 / R; g * R < n1; g++) {
            kq_group(w, (const uint8_t *)w->data + g * gb, x, M, accs);
            const int64_t a = g * R > n0 ? g * R : n0, b = (g + 1) * R < n1 ? (g + 1) * R : n1;
            for (int64_t r = 0; r < M; r++)
                memcpy(y + r * ldy + a, accs + r * R + a - g * R, (b - a) * sizeof(float));
        }
        free(accs);
        return;
    }
    const int64_t panel = PANEL_BYTES / gb > 1 ? PANEL_BYTES / gb : 1, last = (n1 + R - 1) / R;
    for (int64_t p = n0 / R; p < last; p += panel) {
        const int64_t end = p + panel < last ? p + panel : last;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int64_t k = M - r0 < ROWS ? M - r0 : ROWS;
            for (int64_t g = p; g < end; g++)
                group_pass(w, (const uint8_t *)w->data + g * gb, g, x + r0, k, y + r0 * ldy, ldy,
                           n0, n1);
        }
    }
}

// Any number of rows of x: x quantized by all threads, then each thread takes whole groups of
// W's rows (zoo_qdot_rows).
void zoo_qgemm(const qweight_t *w, const float *x, float *y, int64_t M, int threads) {
    const int64_t bytes = zoo_q8_row_bytes(w->K), G = (w->N + R - 1) / R;
    char *buf = aligned_alloc(64, M * bytes);
    q8row_t *rows = malloc(M * sizeof(q8row_t));
    if (w->N * w->K * M < (1 << 20)) threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            zoo_q8_quantize_row(x + r * w->K, w->K, buf + r * bytes, &rows[r]);
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t g0 = G * t / T, g1 = G * (t + 1) / T;
        zoo_qdot_rows(w, rows, M, y, w->N, g0 * R, g1 * R < w->N ? g1 * R : w->N);
    }
    free(rows);
    free(buf);
}
