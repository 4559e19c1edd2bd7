// A gated DeltaNet layer (Qwen3-Next, Qwen3.5) on the fused decode step's threads, as
// core/layers/deltanet.py's GatedDeltaNet decodes one token per row:
//     q|k|v = silu(causal depthwise conv(the row's last K - 1 inputs | in_proj's q|k|v rows))
//     q, k l2-normed; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) per value head
//     S = exp(g) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T (q / sqrt(dk))
//     h += out_proj(rms_norm(o) * silu(z))
// in three parts with a meeting between each: (1) each thread's share of in_proj's rows, and
// for those that are q|k|v channels the conv (a channel's window reads and writes only its own
// cache entries, so the thread that computed the channel's row runs it at once); (2) the
// (row, value head) pairs split over the threads, each reading and writing its head's state
// in the cache (dk x dv: two passes over it, the inner loops over dv contiguous); (3) out_proj,
// each thread its columns of h. The delta rule's order is the module's (kernels/reference.py's
// _delta_step), so the result equals the modules' to fp32 rounding.
#include <math.h>
#include <string.h>

#include "step.h"

int64_t zoo_delta_arena(const zdelta_t *d, int64_t M) {
    return max64(zoo_linear_bytes(&d->in, M), zoo_linear_bytes(&d->out, M));
}

// The q|k|v channel (q's key heads, then k's, then v's value heads, as the conv and its cache
// order them) that in_proj's row n holds, or -1 for a row of z, b or a. Flat: q|k|v come first
// in that order. Grouped (Qwen3-Next): per key head [q (dk) | k (dk) | v (r dv) | z (r dv)],
// then [b (r) | a (r)] per key head.
static int64_t channel(const zdelta_t *d, int64_t n) {
    const int64_t kd = d->hk * d->dk, C = 2 * kd + d->hv * d->dv;
    if (!d->grouped) return n < C ? n : -1;
    const int64_t r = d->hv / d->hk, G = 2 * d->dk + 2 * r * d->dv;
    if (n >= d->hk * G) return -1;  // b, a
    const int64_t kh = n / G, j = n % G;
    if (j < d->dk) return kh * d->dk + j;
    if (j < 2 * d->dk) return kd + kh * d->dk + j - d->dk;
    if (j < 2 * d->dk + r * d->dv) return 2 * kd + kh * r * d->dv + j - 2 * d->dk;
    return -1;  // z
}

// Where value head v's z (dv values), b and a lie in a row of in_proj's output.
static void gates(const zdelta_t *d, int64_t v, int64_t *z, int64_t *b, int64_t *a) {
    const int64_t kd = d->hk * d->dk, V = d->hv * d->dv, C = 2 * kd + V;
    if (!d->grouped) {
        *z = C + v * d->dv, *b = C + V + v, *a = C + V + d->hv + v;
        return;
    }
    const int64_t r = d->hv / d->hk, G = 2 * d->dk + 2 * r * d->dv, kh = v / r, i = v % r;
    *z = kh * G + 2 * d->dk + r * d->dv + i * d->dv;
    *b = d->hk * G + kh * 2 * r + i, *a = *b + r;
}

// Channel c of one row (its cache row `row`, at position `pos`): x joins the row's window; the
// K taps over [window | x] plus the channel's bias, returned before any activation. A row at
// position 0 starts from an empty window (the module zeroes it). An fp16 window holds x rounded
// to fp16, and the module convolves that rounded x too.
float zoo_conv_tap(const zconv_t *cv, int64_t c, int64_t row, int64_t pos, float x) {
    const int64_t K = cv->kernel, at = row * cv->sb + c * (K - 1);
    const float *w = cv->w + c * K;
    float win[K];
    if (pos == 0) {
        memset(win, 0, (K - 1) * sizeof(float));
    } else if (cv->half) {
        zoo_half_to_float((const uint16_t *)cv->cache + at, win, K - 1);
    } else {
        memcpy(win, (const float *)cv->cache + at, (K - 1) * sizeof(float));
    }
    win[K - 1] = x;
    if (cv->half) {  // to fp16 and back: the value the window keeps
        uint16_t x16;
        zoo_float_to_half(&win[K - 1], &x16, 1);
        zoo_half_to_float(&x16, &win[K - 1], 1);
    }
    float acc = 0.0f;
    for (int64_t j = 0; j < K; j++) acc += w[j] * win[j];
    if (cv->bias) acc += cv->bias[c];
    if (cv->half)
        zoo_float_to_half(win + 1, (uint16_t *)cv->cache + at, K - 1);
    else
        memcpy((float *)cv->cache + at, win + 1, (K - 1) * sizeof(float));
    return acc;
}

// Channel c's conv for the M rows: in_proj's value x (row n of proj) through zoo_conv_tap,
// then SiLU, into mixed.
void zoo_conv_channel(const zconv_t *cv, const float *proj, int64_t N, float *mixed, int64_t C,
                      int64_t n, int64_t c, int64_t M, const int64_t *pos, const int64_t *rows) {
    for (int64_t r = 0; r < M; r++) {
        const float acc = zoo_conv_tap(cv, c, rows ? rows[r] : r, pos[r], proj[r * N + n]);
        mixed[r * C + c] = acc * zoo_sigmoid(acc);
    }
}

// x * rsqrt(sum(x^2) + 1e-6), then times `scale` (deltanet.py's l2norm; q is scaled after).
static void l2norm(const float *x, float *out, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv;
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) out[i] *= scale;
}

// One value head of one row: its state S (dk, dv) updated in place and o (dv) written.
static void delta_head(float *restrict S, const float *restrict q, const float *restrict k,
                       const float *restrict v, float g, float beta, int64_t dk, int64_t dv,
                       float *restrict o) {
    float u[DELTA_MAX_DIM];
    const float decay = expf(g);
    // S = exp(g) S and S^T k of the decayed state, in one pass
    for (int64_t j = 0; j < dv; j++) u[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *restrict s = S + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; j++) {
            s[j] *= decay;
            u[j] += s[j] * ki;
        }
    }
    for (int64_t j = 0; j < dv; j++) u[j] = beta * (v[j] - u[j]);
    // S += k u^T and o = S^T q of the new state, in a second
    for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *restrict s = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; j++) {
            s[j] += ki * u[j];
            o[j] += s[j] * qi;
        }
    }
}

// The (row, value head) pairs of thread t: q, k of the head's key head l2-normed (each value
// head of a key head normalises them itself: dk values, against its dk x dv state), the
// delta rule, then rms_norm(o) * w * silu(z) into out (M, hv dv).
static void heads(const zdelta_t *d, const float *proj, int64_t N, const float *mixed,
                  int64_t C, float *out, int64_t M, const int64_t *pos, const int64_t *rows,
                  int64_t t, int64_t T) {
    const int64_t hv = d->hv, dk = d->dk, dv = d->dv, kd = d->hk * dk, r = hv / d->hk;
    const float scale = 1.0f / sqrtf((float)dk);
    float q[DELTA_MAX_DIM], k[DELTA_MAX_DIM];
    for (int64_t u = M * hv * t / T; u < M * hv * (t + 1) / T; u++) {
        const int64_t row = u / hv, v = u % hv, kh = v / r;
        const float *m = mixed + row * C, *p = proj + row * N;
        int64_t z, b, a;
        gates(d, v, &z, &b, &a);
        l2norm(m + kh * dk, q, dk, scale);
        l2norm(m + kd + kh * dk, k, dk, 1.0f);
        const float beta = zoo_sigmoid(p[b]), x = p[a] + d->dt_bias[v];
        const float sp = zoo_softplus(x);
        float *S = d->state + (rows ? rows[row] : row) * d->state_sb + v * dk * dv;
        if (pos[row] == 0) memset(S, 0, dk * dv * sizeof(float));  // a fresh row's state
        float *o = out + row * hv * dv + v * dv;
        delta_head(S, q, k, m + 2 * kd + v * dv, d->neg_a[v] * sp, beta, dk, dv, o);
        zoo_rms_norm(o, NULL, NULL, d->norm, o, 1, dv, d->eps);
        for (int64_t j = 0; j < dv; j++) {
            const float zj = p[z + j];
            o[j] *= zj * zoo_sigmoid(zj);
        }
    }
}

void zoo_delta(const zdelta_t *d, const float *xn, float *h, int64_t M, int64_t H,
               const int64_t *pos, const int64_t *rows, int64_t t, int64_t T, float *y,
               qx_t *px, char *buf, spin_barrier_t *bar, float scale) {
    const int64_t N = d->in.N, C = 2 * d->hk * d->dk + d->hv * d->dv;
    float *proj = d->scratch, *mixed = proj + M * N, *out = mixed + M * C;
    // in_proj: this thread's rows, and the conv of those that are q|k|v channels
    zoo_linear_prepare(&d->in, xn, M, px, buf);
    const int64_t n0 = share(N, t, T), n1 = share(N, t + 1, T);
    zoo_linear_rows(&d->in, px, proj, N, M, n0, n1);
    const zconv_t cv = {d->conv_w, NULL, d->conv, d->kernel, d->conv_sb, d->conv_half};
    for (int64_t n = n0; n < n1; n++) {
        const int64_t c = channel(d, n);
        if (c >= 0) zoo_conv_channel(&cv, proj, N, mixed, C, n, c, M, pos, rows);
    }
    zoo_meet(bar, T);
    heads(d, proj, N, mixed, C, out, M, pos, rows, t, T);
    zoo_meet(bar, T);
    // h += out_proj(out): this thread's columns
    const int64_t h0 = share(H, t, T), h1 = share(H, t + 1, T);
    zoo_add_product(&d->out, out, h, y, M, H, h0, h1, px, buf, NULL, 0.0f, NULL, bar, T, scale);
}
