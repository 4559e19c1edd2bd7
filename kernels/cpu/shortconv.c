// A gated short-conv layer (LFM2) on the fused decode step's threads, as
// core/layers/shortconv.py's ShortConv decodes one token per row:
//     B | C | x = in_proj(xn);  y = C * conv(the row's last K - 1 inputs | B * x);  h += out_proj(y)
// in three parts with a meeting between each: (1) each thread's share of in_proj's rows;
// (2) each thread's share of the channels, B * x joining the channel's window in the cache
// (a channel reads and writes only its own cache entries), the K taps, times C; (3) out_proj,
// each thread its columns of h.
#include <string.h>

#include "step.h"

int64_t zoo_sconv_arena(const zsconv_t *s, int64_t M) {
    return max64(zoo_linear_bytes(&s->in, M), zoo_linear_bytes(&s->out, M));
}

// Channel c of the M rows: bx joins the row's window (a row at position 0 starts from an empty
// one, as the module zeroes it); the taps over [window | bx] plus the bias, times C, into out.
// An fp16 window holds bx rounded to fp16, and the module convolves that rounded bx too.
static void conv_channel(const zsconv_t *s, const float *proj, float *out, int64_t H, int64_t c,
                         int64_t M, const int64_t *pos, const int64_t *rows) {
    const int64_t K = s->kernel, N = s->in.N;
    const float *w = s->conv_w + c * K;
    for (int64_t r = 0; r < M; r++) {
        const float *p = proj + r * N;
        const int64_t at = (rows ? rows[r] : r) * s->conv_sb + c * (K - 1);
        float win[K];
        if (pos[r] == 0) {
            memset(win, 0, (K - 1) * sizeof(float));
        } else if (s->conv_half) {
            zoo_half_to_float((const uint16_t *)s->conv + at, win, K - 1);
        } else {
            memcpy(win, (const float *)s->conv + at, (K - 1) * sizeof(float));
        }
        win[K - 1] = p[c] * p[2 * H + c];  // B * x
        if (s->conv_half) {  // to fp16 and back: the value the window keeps
            uint16_t x16;
            zoo_float_to_half(&win[K - 1], &x16, 1);
            zoo_half_to_float(&x16, &win[K - 1], 1);
        }
        float acc = s->conv_b ? s->conv_b[c] : 0.0f;
        for (int64_t j = 0; j < K; j++) acc += w[j] * win[j];
        out[r * H + c] = p[H + c] * acc;  // C * conv
        if (s->conv_half)
            zoo_float_to_half(win + 1, (uint16_t *)s->conv + at, K - 1);
        else
            memcpy((float *)s->conv + at, win + 1, (K - 1) * sizeof(float));
    }
}

void zoo_sconv(const zsconv_t *s, const float *xn, float *h, int64_t M, int64_t H,
               const int64_t *pos, const int64_t *rows, int64_t t, int64_t T, float *y,
               qx_t *px, char *buf, spin_barrier_t *bar, float scale) {
    const int64_t N = s->in.N;
    float *proj = s->scratch, *out = proj + M * N;
    // in_proj: this thread's rows of B | C | x
    zoo_linear_prepare(&s->in, xn, M, px, buf);
    zoo_linear_rows(&s->in, px, proj, N, M, share(N, t, T), share(N, t + 1, T));
    zoo_meet(bar, T);
    const int64_t h0 = share(H, t, T), h1 = share(H, t + 1, T);  // this thread's channels
    for (int64_t c = h0; c < h1; c++) conv_channel(s, proj, out, H, c, M, pos, rows);
    zoo_meet(bar, T);
    // h += scale * out_proj(out): this thread's columns
    zoo_add_product(&s->out, out, h, y, M, H, h0, h1, px, buf, NULL, 0.0f, NULL, bar, T, scale);
}
