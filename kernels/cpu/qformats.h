// What qformats.c (repacking, dequantization) and qdot.c (the products) both read of the
// block formats: the values per block, the repacked layout of a group of 16 rows, and the
// fp16 and e8m0 scales. Plain `static` where they were (layout stays one out-of-line copy per
// file, as when both files were one): each file compiles them to the same code as before.
#pragma once
#include <stdint.h>
#include <string.h>

#include "zoo_cpu.h"

#if defined(__SSE2__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float f16(const uint8_t *p) {  // a little-endian fp16
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
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
#endif
}

// MXFP4's block scale: ggml's ggml_e8m0_to_fp32_half, 2^(e - 128) (subnormal below e = 2).
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// ---- the formats (block_bytes and the repacking itself: qformats.c) -----------------------------
#define R 16  // rows per group

static int64_t block_values(int64_t type) {
    return type == ZOO_Q4_K || type == ZOO_Q5_K || type == ZOO_Q6_K ? 256 : 32;
}

// A group of 16 rows is stored unit by unit (a unit: the 16 rows' blocks over the same
// columns), headers first, then codes: [headers of units 0..nu-1, padded to 64 bytes][codes of
// units 0..nu-1], every unit's codes a multiple of 64 bytes, so the kernels' 64-byte loads of
// codes never straddle cache lines. In a unit's headers, 2-byte fields (fp16 d, dmin / m) of
// the 16 rows sit side by side and other header bytes byte-major (byte k of the 16 rows
// together); codes go in pieces of 4 bytes per row (one 64-byte vector: 4 bytes of each row).
// part: {offset in the block, length, offset in the unit's headers or codes, bytes per row in
// a piece, 1 if a part of the codes}.
typedef struct { int src, len, dst, piece, code; } part_t;

typedef struct { int header, codes, parts; part_t p[6]; } layout_t;

static layout_t layout(int64_t type) {
    const part_t d0 = {0, 2, 0, 2, 0};
    switch (type) {
        case ZOO_Q8_0: return (layout_t){32, 512, 2, {d0, {2, 32, 0, 4, 1}}};
        case ZOO_Q4_0: return (layout_t){32, 256, 2, {d0, {2, 16, 0, 4, 1}}};
        case ZOO_MXFP4:  // headers: the e8m0 scale byte; codes as Q4_0's
            return (layout_t){16, 256, 2, {{0, 1, 0, 1, 0}, {1, 16, 0, 4, 1}}};
        case ZOO_Q4_1: return (layout_t){64, 256, 3, {d0, {2, 2, 32, 2, 0}, {4, 16, 0, 4, 1}}};
        case ZOO_Q5_0:  // codes: 64 bytes of high bits (the rows' 32-bit masks), then the nibbles
            return (layout_t){32, 320, 3, {d0, {2, 4, 0, 4, 1}, {6, 16, 64, 4, 1}}};
        case ZOO_Q5_1:
            return (layout_t){64, 320, 4, {d0, {2, 2, 32, 2, 0}, {4, 4, 0, 4, 1}, {8, 16, 64, 4, 1}}};
        case ZOO_Q4_K:  // headers: d, dmin, 12 scale bytes; codes: 128 bytes of nibbles
            return (layout_t){256, 2048, 4, {d0, {2, 2, 32, 2, 0}, {4, 12, 64, 1, 0}, {16, 128, 0, 4, 1}}};
        case ZOO_Q5_K:  // codes: 32 bytes of high bits, then the nibbles
            return (layout_t){256, 2560, 5, {d0, {2, 2, 32, 2, 0}, {4, 12, 64, 1, 0},
                                             {16, 32, 0, 4, 1}, {48, 128, 512, 4, 1}}};
        case ZOO_Q6_K:  // headers: d, 16 int8 scales; codes: per half of the columns, its 64
            // bytes of low bits and 32 of high bits (the order the kernel reads them in)
            return (layout_t){288, 3072, 6, {{208, 2, 0, 2, 0}, {192, 16, 32, 1, 0},
                                             {0, 64, 0, 4, 1}, {128, 32, 1024, 4, 1},
                                             {64, 64, 1536, 4, 1}, {160, 32, 2560, 4, 1}}};
    }
    return (layout_t){0, 0, 0, {{0}}};
}

static inline int64_t pad64(int64_t n) { return (n + 63) / 64 * 64; }

// Bytes of one group of 16 rows over nu units.
static int64_t group_bytes(int64_t type, int64_t nu) {
    const layout_t l = layout(type);
    return pad64(nu * l.header) + nu * l.codes;
}
