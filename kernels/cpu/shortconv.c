// A gated short-conv layer (LFM2) on the fused decode step's threads, as
// core/layers/shortconv.py's ShortConv decodes one token per row:
//     B | C | x = in_proj(xn);  y = C * conv(the row's last K - 1 inputs | B * x);  h += out_proj(y)
// in three parts with a meeting between each: (1) each thread's share of in_proj's rows;
// (2) each thread's share of the channels, B * x joining the channel's window in the cache
// (a channel reads and writes only its own cache entries), the K taps, times C; (3) out_proj,
// each thread its columns of h.
#include <stddef.h>

#include "step.h"

int64_t zoo_sconv_arena(const zsconv_t *s, int64_t M) {
    return max64(zoo_linear_bytes(&s->in, M), zoo_linear_bytes(&s->out, M));
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
    // each channel of each row: B * x joins its window (zoo_conv_tap), times C
    const zconv_t cv = {s->conv_w, s->conv_b, s->conv, s->kernel, s->conv_sb, s->conv_half};
    for (int64_t c = h0; c < h1; c++) {
        for (int64_t r = 0; r < M; r++) {
            const float *p = proj + r * N;
            const float bx = p[c] * p[2 * H + c];
            out[r * H + c] = p[H + c] * zoo_conv_tap(&cv, c, rows ? rows[r] : r, pos[r], bx);
        }
    }
    zoo_meet(bar, T);
    // h += scale * out_proj(out): this thread's columns
    zoo_add_product(&s->out, out, h, y, M, H, h0, h1, px, buf, NULL, 0.0f, NULL, bar, T, scale);
}
