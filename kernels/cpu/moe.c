// A MoE MLP of the fused decode step (step.h's zmoe_t), as core.layers.moe.MoE: the
// router's logits, each row's chosen experts (`route` below: core.layers.moe.route's scorings
// and top-k methods), only those experts' rows of their stacked weights read, and the shared
// experts (an always-on MLP, optionally behind a sigmoid gate) in the same passes. Experts are
// SiLU-gated, gpt-oss's clamped SwiGLU, or Nemotron-H's non-gated relu2.
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "step.h"

static inline int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

int64_t zoo_moe_ebytes(const zmoe_t *m, int64_t M) {
    const int64_t shared = m->shared_inter ? zoo_linear_bytes(&m->shared_down, M) : 0;
    return M * m->topk * round64(zoo_qx_bytes(&m->down[0], 1)) + shared;
}

// The arena holds x prepared for the router and the shared gate, then (once the logits are
// read) for the experts' gate|up and the shared experts' gate|up.
int64_t zoo_moe_arena(const zmoe_t *m, int64_t M) {
    const int64_t first = zoo_linear_bytes(&m->router, M) + zoo_linear_bytes(&m->shared_gate, M);
    const int64_t shared = m->shared_inter ? zoo_linear_bytes(&m->shared_gate_up, M) : 0;
    return max64(first, round64(zoo_qx_bytes(&m->gate_up[0], M)) + shared);
}

// The `topk` indices of the largest c (E), the lower index first among equals (torch.topk's
// choice on the CPU; the tests do not rest on it).
static void top(const float *c, int64_t E, int64_t topk, int64_t *ids) {
    char taken[MAX_EXPERTS] = {0};
    for (int64_t k = 0; k < topk; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || c[e] > c[best])) best = e;
        ids[k] = best;
        taken[best] = 1;
    }
}

// One row's routing, as core.layers.moe.route: scores s = softmax | sigmoid(logits); the top
// k experts of s + correction (noaux_tc's bias), within the topk_groups groups of the largest
// max (group-limited greedy) or top-2 sum (noaux_tc) of it, the others masked to 0 or -inf;
// the weights: their unbiased s, / (their sum + 1e-20) where renorm, times scale.
static void route(const zmoe_t *m, const float *logits, int64_t *ids, float *w) {
    const int64_t E = m->experts, K = m->topk;
    float s[MAX_EXPERTS], c[MAX_EXPERTS];
    if (m->scoring == 0) {
        float most = logits[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) most = logits[e] > most ? logits[e] : most;
        for (int64_t e = 0; e < E; e++) {
            s[e] = expf(logits[e] - most);
            sum += s[e];
        }
        const float inv = 1.0f / sum;  // as torch's softmax: times the sum's reciprocal
        for (int64_t e = 0; e < E; e++) s[e] *= inv;
    } else {
        for (int64_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-logits[e]));
    }
    for (int64_t e = 0; e < E; e++) c[e] = m->correction ? s[e] + m->correction[e] : s[e];
    if (m->method != 0) {
        const int64_t G = m->groups, per = E / G;
        float score[MAX_EXPERTS];
        int64_t keep[MAX_EXPERTS];
        for (int64_t g = 0; g < G; g++) {
            const float *x = c + g * per;
            float a = -INFINITY, b = -INFINITY;  // the group's largest, second largest
            for (int64_t e = 0; e < per; e++) {
                if (x[e] > a) {
                    b = a;
                    a = x[e];
                } else if (x[e] > b) {
                    b = x[e];
                }
            }
            score[g] = m->method == 2 ? a + b : a;
        }
        top(score, G, m->topk_groups, keep);
        const float fill = m->method == 2 ? -INFINITY : 0.0f;
        for (int64_t g = 0; g < G; g++) {
            int kept = 0;
            for (int64_t j = 0; j < m->topk_groups; j++) kept |= keep[j] == g;
            if (!kept)
                for (int64_t e = g * per; e < (g + 1) * per; e++) c[e] = fill;
        }
    }
    top(c, E, K, ids);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        w[k] = s[ids[k]];
        sum += w[k];
    }
    for (int64_t k = 0; k < K; k++) w[k] = (m->renorm ? w[k] / (sum + 1e-20f) : w[k]) * m->scale;
}

void zoo_moe_route(const zmoe_t *m, const float *logits, int64_t M, int64_t *ids, float *w) {
    for (int64_t r = 0; r < M; r++)
        route(m, logits + r * m->experts, ids + r * m->topk, w + r * m->topk);
}

// gpt-oss's activation over interleaved (gate, up) pairs gu (2n): gate clamped to <= limit, up
// to [-limit, limit]; out = (up + 1) * (gate * sigmoid(gate * alpha)), kernels.reference's
// clamped_swiglu in its order.
static void clamped_swiglu(const float *gu, float *out, int64_t n, float alpha, float limit) {
    for (int64_t j = 0; j < n; j++) {
        const float g = fminf(gu[2 * j], limit), u = fmaxf(fminf(gu[2 * j + 1], limit), -limit);
        out[j] = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
    }
}

// Expert e's gate|up rows of this thread's share [i0, i1) for x prepared in one (+ biases),
// then its activation into act (I).
static void expert_up(const zmoe_t *m, int64_t e, const qx_t *one, float *gu, float *act,
                      int64_t i0, int64_t i1) {
    const int64_t I = m->inter;
    const qweight_t *wg = &m->gate_up[e];
    const float *bias = m->gate_up_bias ? m->gate_up_bias + e * 2 * I : NULL;
    // interleaved: pairs i0..i1 are rows 2 i0..2 i1; else the gate's rows and the up's (relu2:
    // up's alone, rows i0..i1)
    const int64_t spans[2][2] = {{m->glu ? 2 * i0 : i0, m->glu ? 2 * i1 : i1}, {I + i0, I + i1}};
    for (int s = 0; s < (m->glu || m->act == ZOO_RELU2 ? 1 : 2); s++) {
        zoo_qgemv_rows(wg, one, gu, 2 * I, spans[s][0], spans[s][1]);
        if (bias)
            for (int64_t n = spans[s][0]; n < spans[s][1]; n++) gu[n] += bias[n];
    }
    if (m->glu)
        clamped_swiglu(gu + 2 * i0, act + i0, i1 - i0, m->alpha, m->limit);
    else
        zoo_activate(gu + i0, gu + I + i0, act + i0, i1 - i0, m->act);
}

// The MoE MLP on the normed rows xn (M, H): h[:, h0:h1] += sum_k w_k expert_k(xn) (+ the
// shared experts) for each row, the experts' gate|up rows i0..i1 (and the down rows h0..h1) on
// this thread. logit (M, E + 1), gu, act, y: shared (step.h); px, buf, ebuf: this thread's.
void zoo_moe(const zmoe_t *m, const float *xn, float *h, int64_t M, int64_t H, int64_t t,
             int64_t T, float *logit, float *gu, float *act, float *y, qx_t *px, char *buf,
             char *ebuf, spin_barrier_t *bar, float scale) {
    const int64_t E = m->experts, K = m->topk, I = m->inter, S = m->shared_inter;
    float *glogit = logit + M * E;  // (M,): the shared experts' gate, x . shared_gate
    qx_t gpx[MAX_PARTS], spx[MAX_PARTS];
    zoo_linear_share(&m->router, xn, logit, M, t, T, px, buf);
    if (m->shared_gate.parts) {  // one row: the last thread's
        zoo_linear_prepare(&m->shared_gate, xn, M, gpx, buf + zoo_linear_bytes(&m->router, M));
        zoo_linear_rows(&m->shared_gate, gpx, glogit, 1, M, share(1, t, T), share(1, t + 1, T));
    }
    zoo_meet(bar, T);
    int64_t ids[MAX_ROWS * 64];
    float w[MAX_ROWS * 64];
    for (int64_t r = 0; r < M; r++)  // every thread routes every row, the same way
        route(m, logit + r * E, ids + r * K, w + r * K);
    qx_t xq;
    zoo_qx_prepare(&m->gate_up[0], xn, M, &xq, buf);  // x quantized once for every expert
    const int64_t i0 = share(I, t, T), i1 = share(I, t + 1, T);
    for (int64_t p = 0; p < M * K; p++) {
        const int64_t r = p / K;
        qx_t one = xq;
        one.x = xn + r * H;
        one.M = 1;
        one.q8[0] = xq.q8[r];
        expert_up(m, ids[p], &one, gu + p * 2 * I, act + p * I, i0, i1);
    }
    // the shared experts: an MLP of S rows after the routed pairs' gu and act
    float *sgu = gu + M * K * 2 * I, *sact = act + M * K * I, *sy = y + M * K * H;
    if (S) {
        const int64_t s0 = share(S, t, T), s1 = share(S, t + 1, T);
        char *at = buf + round64(zoo_qx_bytes(&m->gate_up[0], M));  // after the experts' x
        zoo_linear_prepare(&m->shared_gate_up, xn, M, spx, at);
        zoo_mlp_hidden(&m->shared_gate_up, spx, sgu, sact, M, S, s0, s1, m->shared_act);
    }
    zoo_meet(bar, T);
    const int64_t h0 = share(H, t, T), h1 = share(H, t + 1, T);
    const int64_t ab = round64(zoo_qx_bytes(&m->down[0], 1));
    for (int64_t p = 0; p < M * K; p++) {
        qx_t aq;
        zoo_qx_prepare(&m->down[ids[p]], act + p * I, 1, &aq, ebuf + p * ab);
        zoo_qgemv_rows(&m->down[ids[p]], &aq, y + p * H, H, h0, h1);
        if (m->down_bias)
            for (int64_t n = h0; n < h1; n++) y[p * H + n] += m->down_bias[ids[p] * H + n];
    }
    if (S) {
        zoo_linear_prepare(&m->shared_down, sact, M, spx, ebuf + M * K * ab);
        zoo_linear_rows(&m->shared_down, spx, sy, H, M, h0, h1);
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
        const float gate = m->shared_gate.parts ? 1.0f / (1.0f + expf(-glogit[r])) : 1.0f;
        for (int64_t n = h0; n < h1; n++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < K; j++)
                sum += y[(r * K + order[j]) * H + n] * w[r * K + order[j]];
            if (S)  // out = routed + shared, the module's order
                sum += m->shared_gate.parts ? gate * sy[r * H + n] : sy[r * H + n];
            h[r * H + n] += scale * sum;
        }
    }
}
