// Multi-head latent attention (DeepSeek V2 / V3) in the fused decode step (decode.c),
// the absorbed form core/layers/mla.py's decode computes (step.h's zmla_t):
//     q_lat = W_uk^T q_nope,  p = softmax(scale (q_lat . latent_s + q_pe . k_pe_s)),
//     o = W_uv (sum_s p_s latent_s)
// over the cache of normed latents (R wide, shared by all heads) and roped k_pe.
// The threads share out the products' output rows, then the heads: a thread's heads meet each
// of kv_b's rows once for all the step's rows (W_uk, W_uv: read once per step), and each row's
// latent cache once for all its heads, a tile of slots at a time (an online softmax: the tile
// is scored and summed while in cache, so the cache streams from memory once per kv row).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "step.h"

#define TILE 32  // slots scored and summed together: 32 x (512 + 64) floats, 72 KiB

static inline int64_t most_heads(const zmla_t *m, int64_t T) { return (m->heads + T - 1) / T; }

int64_t zoo_mla_arena(const zmla_t *m, int64_t M) {
    return max64(max64(zoo_linear_bytes(&m->q, M), zoo_linear_bytes(&m->kv_a, M)),
                 m->q_rank ? zoo_linear_bytes(&m->q_a, M) : 0);
}

// q (M, heads (dn + dr)), kv_a's rows (M, R + dr), q_a's rows (M, q_rank)
int64_t zoo_mla_shared(const zmla_t *m, int64_t M) {
    return M * (m->heads * (m->dn + m->dr) + m->rank + m->dr + m->q_rank);
}

// q_lat and the summed latents (M, G, R) each, a tile of slots (TILE, R + dr), the tile's
// weights (G, TILE), each head's maximum and total (2 G), q_a's normed rows (M, q_rank)
int64_t zoo_mla_local(const zmla_t *m, int64_t M, int64_t T) {
    const int64_t G = most_heads(m, T);
    return 2 * M * G * m->rank + TILE * (m->rank + m->dr) + G * TILE + 2 * G + M * m->q_rank;
}

// Row r's latent normed and its k_pe roped, both written to the row's cache slot.
static void write_slot(const zmla_t *m, float *kv, int64_t c, int64_t slot, const float *cos,
                       const float *sin) {
    const int64_t R = m->rank;
    zoo_rms_norm(kv, NULL, NULL, m->kv_norm, kv, 1, R, m->kv_eps);  // in place: this step's
    zoo_rope(kv + R, 1, 1, 1, 0, 0, 0, cos, sin, 0, m->rope_half, (int)m->interleaved);
    void *lat = slot_at(m->latent, c * m->lsb + slot * m->lss, m->half);
    void *pe = slot_at(m->k_pe, c * m->psb + slot * m->pss, m->half);
    if (m->half) {
        zoo_float_to_half(kv, lat, R);
        zoo_float_to_half(kv + R, pe, m->dr);
    } else {
        memcpy(lat, kv, R * sizeof(float));
        memcpy(pe, kv + R, m->dr * sizeof(float));
    }
}

// Slots [s0, s0 + n) of cache row c into tile (n, R + dr) as floats.
static void load_tile(const zmla_t *m, int64_t c, int64_t s0, int64_t n, float *tile) {
    const int64_t R = m->rank, w = R + m->dr;
    for (int64_t s = 0; s < n; s++) {
        const int64_t la = c * m->lsb + (s0 + s) * m->lss, pa = c * m->psb + (s0 + s) * m->pss;
        if (m->half) {
            zoo_half_to_float((const uint16_t *)m->latent + la, tile + s * w, R);
            zoo_half_to_float((const uint16_t *)m->k_pe + pa, tile + s * w + R, m->dr);
        } else {
            memcpy(tile + s * w, (const float *)m->latent + la, R * sizeof(float));
            memcpy(tile + s * w + R, (const float *)m->k_pe + pa, m->dr * sizeof(float));
        }
    }
}

// Heads [g0, g1) of one row over its slots [0, seen): o (G, R) = softmax-weighted sums of the
// latents, for the absorbed queries qlat (G, R) and the roped q_pe of each head (q, nq apart).
// Slot by slot, each latent meets the G heads while it is in L1 (as zoo_attend_group).
static void attend(const zmla_t *m, int64_t c, int64_t seen, const float *qlat, const float *q,
                   int64_t g0, int64_t g1, float *o, float *tile, float *p, float *top,
                   float *total) {
    const int64_t R = m->rank, w = R + m->dr, qs = m->dn + m->dr, G = g1 - g0;
    for (int64_t g = 0; g < G; g++) {
        top[g] = -INFINITY;
        total[g] = 0.0f;
    }
    memset(o, 0, G * R * sizeof(float));
    for (int64_t s0 = 0; s0 < seen; s0 += TILE) {
        const int64_t n = seen - s0 < TILE ? seen - s0 : TILE;
        load_tile(m, c, s0, n, tile);
        for (int64_t s = 0; s < n; s++) {  // the scores, p (G, TILE)
            const float *ts = tile + s * w;
            for (int64_t g = 0; g < G; g++) {
                const float *qp = q + (g0 + g) * qs + m->dn;
                const float score = dot16(qlat + g * R, ts, R) + dot16(qp, ts + R, m->dr);
                p[g * TILE + s] = score * m->scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {  // the weights, against the running maximum
            float *pg = p + g * TILE, best = top[g];
            for (int64_t s = 0; s < n; s++) best = pg[s] > best ? pg[s] : best;
            // the sums so far rescaled to the new maximum (exp(-inf): 0 at the first tile)
            float shift = top[g] - best, keep;
            zoo_exp_nonpositive(&shift, &keep, 1);
            top[g] = best;
            for (int64_t s = 0; s < n; s++) pg[s] -= best;
            zoo_exp_nonpositive(pg, pg, n);
            float sum = total[g] * keep;
            for (int64_t s = 0; s < n; s++) sum += pg[s];
            total[g] = sum;
            if (keep != 1.0f)
                for (int64_t i = 0; i < R; i++) o[g * R + i] *= keep;
        }
        for (int64_t s = 0; s < n; s++)
            for (int64_t g = 0; g < G; g++) axpy(o + g * R, p[g * TILE + s], tile + s * w, R);
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = total[g] > 0 ? 1.0f / total[g] : 0.0f;
        for (int64_t i = 0; i < R; i++) o[g * R + i] *= inv;
    }
}

void zoo_mla(const zmla_t *m, const float *xn, float *att, int64_t M, const int64_t *pos,
             const int64_t *rows, const float *cos, const float *sin, int64_t cstride,
             int64_t t, int64_t T, float *shared, float *local, qx_t *px, char *buf,
             spin_barrier_t *bar) {
    const int64_t H = m->heads, R = m->rank, dn = m->dn, dr = m->dr, dv = m->dv;
    const int64_t nq = H * (dn + dr), nkv = R + dr, G = most_heads(m, T);
    float *q = shared, *kv = q + M * nq, *qa = kv + M * nkv;
    float *qlat = local, *olat = qlat + M * G * R, *tile = olat + M * G * R;
    float *p = tile + TILE * nkv, *top = p + G * TILE, *total = top + G, *qan = total + G;
    // the products of the normed rows: q (or q_a) and kv_a, each thread its share of rows
    zoo_linear_share(m->q_rank ? &m->q_a : &m->q, xn, m->q_rank ? qa : q, M, t, T, px, buf);
    zoo_linear_share(&m->kv_a, xn, kv, M, t, T, px, buf);
    zoo_meet(bar, T);
    if (m->q_rank) {  // q = q_b(rms_norm(q_a)): every thread norms the few rows itself
        zoo_rms_norm(qa, NULL, NULL, m->q_norm, qan, M, m->q_rank, m->q_eps);
        zoo_linear_share(&m->q, qan, q, M, t, T, px, buf);
    }
    for (int64_t r = t; r < M; r += T)  // each row's latent and k_pe into its cache slot
        write_slot(m, kv + r * nkv, rows ? rows[r] : r, pos[r], cos + r * cstride,
                   sin + r * cstride);
    zoo_meet(bar, T);
    const int64_t g0 = H * t / T, g1 = H * (t + 1) / T;
    if (g0 == g1) return;  // more threads than heads
    // q_lat (M, G, R) = W_uk^T q_nope for this thread's heads, kv_b's rows read once
    memset(qlat, 0, M * G * R * sizeof(float));
    for (int64_t g = g0; g < g1; g++)
        for (int64_t d = 0; d < dn; d++) {
            const float *wk = m->kv_b + (g * (dn + dv) + d) * R;
            for (int64_t r = 0; r < M; r++)
                axpy(qlat + (r * G + g - g0) * R, q[r * nq + g * (dn + dr) + d], wk, R);
        }
    for (int64_t r = 0; r < M; r++) {
        for (int64_t g = g0; g < g1; g++)  // q_pe roped in place: this thread's heads only
            zoo_rope(q + r * nq + g * (dn + dr) + dn, 1, 1, 1, 0, 0, 0, cos + r * cstride,
                     sin + r * cstride, 0, m->rope_half, (int)m->interleaved);
        attend(m, rows ? rows[r] : r, pos[r] + 1, qlat + r * G * R, q + r * nq, g0, g1,
               olat + r * G * R, tile, p, top, total);
    }
    // att (M, H dv) = W_uv o per head, kv_b's rows read once
    for (int64_t g = g0; g < g1; g++)
        for (int64_t v = 0; v < dv; v++) {
            const float *wv = m->kv_b + (g * (dn + dv) + dn + v) * R;
            for (int64_t r = 0; r < M; r++)
                att[r * H * dv + g * dv + v] = dot16(wv, olat + (r * G + g - g0) * R, R);
        }
}
