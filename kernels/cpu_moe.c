// A MoE MLP of the fused decode step (cpu_step.h's zmoe_t): the router's logits, each row's
// chosen experts, and only those experts' rows of their stacked weights read.
#include <math.h>
#include <stdint.h>

#include "cpu_step.h"

int64_t zoo_moe_ebytes(const zmoe_t *m, int64_t M) {
    return M * m->topk * ((zoo_qx_bytes(&m->down[0], 1) + 63) / 64 * 64);
}

int64_t zoo_moe_arena(const zmoe_t *m, int64_t M) {
    return max64(zoo_linear_bytes(&m->router, M), zoo_qx_bytes(&m->gate_up[0], M));
}

// Row r's routing: the `topk` largest of softmax(logits) (E), by probability, the lower index
// first among equals; their probabilities, renormalised to sum 1 where `renorm`.
static void route(const float *logits, int64_t E, int64_t topk, int64_t renorm, int64_t *ids,
                  float *w) {
    float top = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < E; e++) top = logits[e] > top ? logits[e] : top;
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - top);
    float chosen = 0.0f;
    for (int64_t k = 0; k < topk; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= ids[j] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[k] = best;
        w[k] = expf(logits[best] - top) / sum;
        chosen += w[k];
    }
    if (renorm)
        for (int64_t k = 0; k < topk; k++) w[k] /= chosen;
}

// The MoE MLP on the normed rows xn (M, H): h[:, h0:h1] += sum_k w_k expert_k(xn) for each row,
// the experts' gate|up rows i0..i1 (and the down rows h0..h1) on this thread. logit (M, E),
// gu (M K, 2I), act (M K, I), y (M K, H): shared; px, buf, ebuf: this thread's.
void zoo_moe(const zmoe_t *m, const float *xn, float *h, int64_t M, int64_t H, int64_t t,
             int64_t T, float *logit, float *gu, float *act, float *y, qx_t *px, char *buf,
             char *ebuf, spin_barrier_t *bar) {
    const int64_t E = m->experts, K = m->topk, I = m->inter;
    zoo_linear_prepare(&m->router, xn, M, px, buf);
    zoo_linear_rows(&m->router, px, logit, E, M, share(E, t, T), share(E, t + 1, T));
    zoo_meet(bar, T);
    int64_t ids[MAX_ROWS * 64];
    float w[MAX_ROWS * 64];
    for (int64_t r = 0; r < M; r++)  // every thread routes every row, the same way
        route(logit + r * E, E, K, m->renorm, ids + r * K, w + r * K);
    qx_t xq;
    zoo_qx_prepare(&m->gate_up[0], xn, M, &xq, buf);  // x quantized once for every expert
    const int64_t i0 = share(I, t, T), i1 = share(I, t + 1, T);
    for (int64_t p = 0; p < M * K; p++) {
        const int64_t r = p / K;
        const qweight_t *wg = &m->gate_up[ids[p]];
        qx_t one = xq;
        one.x = xn + r * H;
        one.M = 1;
        one.q8[0] = xq.q8[r];
        zoo_qgemv_rows(wg, &one, gu + p * 2 * I, 2 * I, i0, i1);
        zoo_qgemv_rows(wg, &one, gu + p * 2 * I, 2 * I, I + i0, I + i1);
        zoo_activate(gu + p * 2 * I + i0, gu + p * 2 * I + I + i0, act + p * I + i0, i1 - i0, 0);
    }
    zoo_meet(bar, T);
    const int64_t h0 = share(H, t, T), h1 = share(H, t + 1, T), ab = zoo_qx_bytes(&m->down[0], 1);
    for (int64_t p = 0; p < M * K; p++) {
        qx_t aq;
        zoo_qx_prepare(&m->down[ids[p]], act + p * I, 1, &aq, ebuf + p * ((ab + 63) / 64 * 64));
        zoo_qgemv_rows(&m->down[ids[p]], &aq, y + p * H, H, h0, h1);
    }
    for (int64_t r = 0; r < M; r++) {  // the experts' sum in the order of their ids, as eager
        int64_t order[64];
        for (int64_t k = 0; k < K; k++) {
            int64_t at = k;
            while (at > 0 && ids[r * K + order[at - 1]] > ids[r * K + k]) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = k;
        }
        for (int64_t n = h0; n < h1; n++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < K; j++)
                sum += y[(r * K + order[j]) * H + n] * w[r * K + order[j]];
            h[r * H + n] += sum;
        }
    }
}
