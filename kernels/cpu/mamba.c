// A Mamba2 layer (Granite 4.0-H, Nemotron-H) on the fused decode step's threads, as
// core/layers/mamba2.py decodes one token per row:
//     z | xBC | dt = in_proj(x);  x|B|C = silu(causal depthwise conv(the row's last K - 1 inputs
//     | xBC) + bias);  dt = clamp(softplus(dt + dt_bias), dt_min, dt_max) per head
//     per head (group g = h / (heads / groups) of B and C): S = exp(dt A) S + dt x B^T;
//     y = S C + D x
//     h += out_proj(grouped_rms_norm(y * silu(z)) * w)   (the gate before the norm)
// in four parts with a meeting between each: (1) each thread's share of in_proj's rows, and
// for those that are x|B|C channels the conv (zoo_conv_channel, as delta.c); (2) the (row,
// head) pairs split over the threads, each reading and writing its head's state (p x n, one
// pass, the inner loop over n contiguous) and gating its output; (3) the (row, group) pairs'
// RMSNorm (a group spans several heads); (4) out_proj, each thread its columns of h.
#include <string.h>

#include "step.h"

int64_t zoo_mamba_arena(const zmamba_t *m, int64_t M) {
    return max64(zoo_linear_bytes(&m->in, M), zoo_linear_bytes(&m->out, M));
}

// One head of one row: its state S (p, n) updated in place; y = (S C + D x) silu(z) into o.
static void mamba_head(float *restrict S, const float *restrict x, const float *restrict B,
                       const float *restrict C, const float *restrict z, float dt, float a,
                       float D, int64_t p, int64_t n, float *restrict o) {
    const float decay = expf(dt * a);
    for (int64_t i = 0; i < p; i++) {
        float *restrict s = S + i * n;
        const float dx = dt * x[i];
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = s[j] * decay + dx * B[j];
            acc += s[j] * C[j];
        }
        const float y = acc + D * x[i];
        o[i] = y * (z[i] * zoo_sigmoid(z[i]));
    }
}

// The (row, head) pairs of thread t: dt, the state update and the gated output into out.
static void heads(const zmamba_t *m, const float *proj, int64_t N, const float *mixed,
                  int64_t C, float *out, int64_t M, const int64_t *pos, const int64_t *rows,
                  int64_t t, int64_t T) {
    const int64_t H = m->heads, p = m->p, n = m->n, I = H * p, r = H / m->groups;
    for (int64_t u = M * H * t / T; u < M * H * (t + 1) / T; u++) {
        const int64_t row = u / H, h = u % H, g = h / r;
        const float *x = mixed + row * C, *pr = proj + row * N;
        float dt = zoo_softplus(pr[I + C + h] + m->dt_bias[h]);
        dt = fminf(fmaxf(dt, m->dt_min), m->dt_max);
        float *S = m->state + (rows ? rows[row] : row) * m->state_sb + h * p * n;
        if (pos[row] == 0) memset(S, 0, p * n * sizeof(float));  // a fresh row's state
        mamba_head(S, x + h * p, x + I + g * n, x + I + (m->groups + g) * n, pr + h * p, dt,
                   m->neg_a[h], m->d[h], p, n, out + row * I + h * p);
    }
}

void zoo_mamba(const zmamba_t *m, const float *xn, float *h, int64_t M, int64_t H,
               const int64_t *pos, const int64_t *rows, int64_t t, int64_t T, float *y,
               qx_t *px, char *buf, spin_barrier_t *bar, float scale) {
    const int64_t N = m->in.N, I = m->heads * m->p, C = I + 2 * m->groups * m->n;
    float *proj = m->scratch, *mixed = proj + M * N, *out = mixed + M * C;
    // in_proj: this thread's rows, and the conv of those that are x|B|C channels
    zoo_linear_prepare(&m->in, xn, M, px, buf);
    const int64_t n0 = share(N, t, T), n1 = share(N, t + 1, T);
    zoo_linear_rows(&m->in, px, proj, N, M, n0, n1);
    for (int64_t n = n0 > I ? n0 : I; n < n1 && n < I + C; n++)
        zoo_conv_channel(&m->conv, proj, N, mixed, C, n, n - I, M, pos, rows);
    zoo_meet(bar, T);
    heads(m, proj, N, mixed, C, out, M, pos, rows, t, T);
    zoo_meet(bar, T);
    // the grouped RMSNorm: (row, group) pairs
    const int64_t G = m->groups, gs = I / G;
    for (int64_t u = M * G * t / T; u < M * G * (t + 1) / T; u++) {
        float *o = out + (u / G) * I + (u % G) * gs;
        zoo_rms_norm(o, NULL, NULL, m->norm + (u % G) * gs, o, 1, gs, m->eps);
    }
    zoo_meet(bar, T);
    // h += out_proj(out): this thread's columns
    const int64_t h0 = share(H, t, T), h1 = share(H, t + 1, T);
    zoo_add_product(&m->out, out, h, y, M, H, h0, h1, px, buf, NULL, 0.0f, NULL, bar, T, scale);
}
