// What the fused decode step's files share (decode.c: the blocks and the driver,
// moe.c: the MoE MLP, delta.c: gated DeltaNet layers, mamba.c: Mamba2 layers, mla.c: latent
// attention):
// linear layers of stacked parts, the threads' meeting point and their shares of a product's
// rows.
#pragma once
#include <math.h>
#include <stdatomic.h>

#include "zoo_cpu.h"

#define MAX_PARTS 4

// A linear layer: up to MAX_PARTS weights stacked along the output rows (a fused q|k|v whose
// parts a file keeps in different formats), and an optional bias.
typedef struct {
    qweight_t part[MAX_PARTS];
    int64_t parts, N;
    const float *bias;  // (N,) or NULL
} zlinear_t;

// Rows [n0, n1) of l's output (rows of y ldy apart), from x prepared for each part in px.
void zoo_linear_rows(const zlinear_t *l, const qx_t *px, float *y, int64_t ldy, int64_t M,
                     int64_t n0, int64_t n1);
// x (M rows) prepared for each part of l into px, in arena (zoo_linear_bytes of it).
void zoo_linear_prepare(const zlinear_t *l, const float *x, int64_t M, qx_t *px, char *arena);
int64_t zoo_linear_bytes(const zlinear_t *l, int64_t M);
// out[i] = act(gate[i]) * up[i], act 0: SiLU, 1: GELU (tanh form); ZOO_RELU2 (a non-gated
// MLP's): out[i] = relu(gate[i])^2, up unread.
#define ZOO_RELU2 2
void zoo_activate(const float *gate, const float *up, float *out, int64_t n, int64_t act);
// An MLP's hidden rows [i0, i1) of M rows prepared in px: out (M, I) = act(gate) * up from
// gate_up's rows [gate | up] (gu (M, 2 I)), or relu(up)^2 (act ZOO_RELU2: gate_up holds up
// alone, computed into gu's first I columns).
void zoo_mlp_hidden(const zlinear_t *gate_up, const qx_t *px, float *gu, float *out, int64_t M,
                    int64_t I, int64_t i0, int64_t i1, int64_t act);

// The threads meet between the parts of a block (decode.c: why not an OpenMP barrier).
typedef struct {
    atomic_int arrived, round, sleepers;
} spin_barrier_t;
void zoo_meet(spin_barrier_t *b, int64_t T);

// y (M, l->N) rows [share(N, t), share(N, t + 1)) = l(x): thread t of T's share of a product.
void zoo_linear_share(const zlinear_t *l, const float *x, float *y, int64_t M, int64_t t,
                      int64_t T, qx_t *px, char *arena);
// h[:, n0:n1] += scale l(x)[:, n0:n1] for the M rows of x, by way of y (M, H): a residual add
// (scale: Granite's residual_multiplier, else 1); with `post` (H,), the product's whole rows
// RMS-normed into yn first (a meeting: every thread's columns of y are needed).
void zoo_add_product(const zlinear_t *l, const float *x, float *h, float *y, int64_t M,
                     int64_t H, int64_t n0, int64_t n1, qx_t *px, char *arena,
                     const float *post, float eps, float *yn, spin_barrier_t *bar, int64_t T,
                     float scale);

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline float zoo_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// softplus with torch's threshold (x itself above 20)
static inline float zoo_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// A cache slot's address: element `at` of a cache of fp16 or fp32 elements.
static inline void *slot_at(void *cache, int64_t at, int64_t half) {
    return half ? (void *)((uint16_t *)cache + at) : (void *)((float *)cache + at);
}

// ops.c's RMSNorm of `rows` rows (optionally h_out = x + res first) and rope, as the
// separate ops run them.
void zoo_rms_norm(const float *x, const float *res, float *h_out, const float *w, float *out,
                  int64_t rows, int64_t dim, float eps);
void zoo_rope(float *x, int64_t B, int64_t H, int64_t T, int64_t sb, int64_t sh, int64_t st,
              const float *cos, const float *sin, int64_t cb, int64_t half, int interleaved);

// Thread t of T's first row of N: whole groups of 16 (the block kernels compute a weight's
// rows 16 at a time; a group split between two threads would be computed by both).
static inline int64_t share(int64_t N, int64_t t, int64_t T) {
    return t == T ? N : N / 16 * t / T * 16;
}

// A MoE MLP (moe.c), as core.layers.moe.MoE: scores (softmax or sigmoid of the router's
// logits), the top `topk` experts (greedy, or within the best groups), their weights
// (renormalised where `renorm`, times `scale`), each expert a SiLU-gated MLP of `inter` rows
// (gpt-oss: biases, a clamped SwiGLU over interleaved rows; Nemotron-H: relu2 over up alone),
// plus always-on shared experts.
#define MAX_EXPERTS 1024
typedef struct {
    int64_t experts, topk, renorm, inter;
    zlinear_t router;                 // (experts, H), its bias gpt-oss's
    const qweight_t *gate_up, *down;  // per expert: (2 inter, H) [gate | up], (H, inter)
    int64_t scoring, method;          // 0 softmax, 1 sigmoid; 0 greedy, 1 group-limited, 2 noaux_tc
    int64_t groups, topk_groups;      // methods 1, 2: experts in `groups` groups, the best kept
    float scale;                      // routed_scaling_factor
    const float *correction;          // (experts,): noaux_tc's e_score_correction_bias, or NULL
    const float *gate_up_bias, *down_bias;  // (experts, 2 inter), (experts, H), or NULL
    int64_t glu;                      // gate_up's rows interleaved (gate, up), clamped SwiGLU
    float alpha, limit;
    int64_t shared_inter, shared_act;  // the shared experts' width (0: none), 0 SiLU, 1 GELU,
                                       // ZOO_RELU2 (shared_gate_up: up alone, (shared_inter, H))
    zlinear_t shared_gate_up, shared_down;  // (2 shared_inter, H) [gate | up], (H, shared_inter)
    zlinear_t shared_gate;            // (1, H): their output times sigmoid(x . it); parts 0: none
    int64_t act;                      // the routed experts': 0 SiLU-gated, ZOO_RELU2 (gate_up:
                                      // up alone, (inter, H) per expert)
} zmoe_t;

// The shared scratch a MoE MLP of M rows needs: logit (M, E + 1), gu (M, 2 (K I + S)), act
// (M, K I + S), y (M (K + 1), H) floats (S: the shared experts' width); per thread, ebuf of
// zoo_moe_ebytes and the arena of zoo_moe_arena bytes.
int64_t zoo_moe_ebytes(const zmoe_t *m, int64_t M);
int64_t zoo_moe_arena(const zmoe_t *m, int64_t M);
// h[:, this thread's columns] += scale times the MoE of the normed rows xn (M, H), thread t
// of T.
void zoo_moe(const zmoe_t *m, const float *xn, float *h, int64_t M, int64_t H, int64_t t,
             int64_t T, float *logit, float *gu, float *act, float *y, qx_t *px, char *buf,
             char *ebuf, spin_barrier_t *bar, float scale);
// The routing alone (as zoo_moe routes): rows' logits (M, E) -> ids (M, K), weights (M, K).
void zoo_moe_route(const zmoe_t *m, const float *logits, int64_t M, int64_t *ids, float *w);

// A gated DeltaNet layer (delta.c) in place of a block's attention: in_proj of the normed
// rows, the causal depthwise conv of q|k|v over the conv window in the cache and SiLU, l2-normed
// q and k, the gated delta rule on each value head's state in the cache, the gated RMSNorm of
// its output with silu(z), and out_proj added to h.
typedef struct {
    zlinear_t in, out;      // in_proj (flat: q|k|v|z|b|a; grouped per key head), out_proj
    int64_t hk, hv, dk, dv, kernel, grouped;
    const float *conv_w;    // (conv_dim, kernel): one filter per channel of q|k|v
    const float *neg_a;     // (hv,): -exp(A_log)
    const float *dt_bias;   // (hv,)
    const float *norm;      // (dv,): the gated RMSNorm's weight
    float eps;
    void *conv;             // (B, conv_dim, kernel - 1): each row's last inputs, fp16 if conv_half
    float *state;           // (B, hv, dk, dv)
    int64_t conv_sb, state_sb, conv_half;  // the caches' row strides (elements)
    float *scratch;         // shared, MAX_ROWS (in.N + conv_dim + hv dv) floats
} zdelta_t;

#define DELTA_MAX_DIM 512  // dk, dv at most (a thread's head buffers live on its stack)

int64_t zoo_delta_arena(const zdelta_t *d, int64_t M);
// h[:, this thread's columns] += scale times the layer's output for the normed rows xn (M, H)
// at positions pos in the cache rows `rows` (NULL: 0..M-1); thread t of T; y (M, H) shared.
void zoo_delta(const zdelta_t *d, const float *xn, float *h, int64_t M, int64_t H,
               const int64_t *pos, const int64_t *rows, int64_t t, int64_t T, float *y,
               qx_t *px, char *buf, spin_barrier_t *bar, float scale);

// A causal depthwise conv over each row's window of its last kernel - 1 inputs, kept in a cache
// (gated DeltaNet's q|k|v and Mamba2's x|B|C, then SiLU; LFM2's B * x): one filter (and bias)
// per channel.
typedef struct {
    const float *w, *bias;  // (C, kernel); (C,) or NULL
    void *cache;            // (B, C, kernel - 1), fp16 if `half`
    int64_t kernel, sb, half;  // sb: the cache's row stride (elements)
} zconv_t;
// Channel c of one row: x joins the window in cache row `row` (empty at position 0); the taps
// plus the bias, before any activation.
float zoo_conv_tap(const zconv_t *cv, int64_t c, int64_t row, int64_t pos, float x);
// Channel c (row n of proj (M, N)) for the M rows, SiLU'd into mixed (M, C); the windows updated.
void zoo_conv_channel(const zconv_t *cv, const float *proj, int64_t N, float *mixed, int64_t C,
                      int64_t n, int64_t c, int64_t M, const int64_t *pos, const int64_t *rows);

// A Mamba2 layer (mamba.c) in place of a block's attention: in_proj of the normed rows into
// z | x|B|C | dt, the conv of x|B|C, dt = clamp(softplus(dt + dt_bias)), per head the state
// h = exp(dt A) h + dt x B^T and y = h C + D x, the grouped RMSNorm of y * silu(z), out_proj
// added to h.
typedef struct {
    zlinear_t in, out;       // in_proj rows z (I) | x (I) | B (G N) | C (G N) | dt (heads)
    int64_t heads, p, groups, n;  // I = heads p; head h reads group h / (heads / groups)
    zconv_t conv;            // over x|B|C (I + 2 G N channels)
    const float *neg_a, *dt_bias, *d;  // (heads,): -exp(A_log), dt's bias, the D skip
    float dt_min, dt_max;    // dt's clamp (0, inf: none)
    const float *norm;       // (I,): the grouped RMSNorm's weight, groups of I / groups
    float eps;
    float *state;            // (B, heads, p, n)
    int64_t state_sb;        // its row stride (elements)
    float *scratch;          // shared, MAX_ROWS (in.N + conv channels + I) floats
} zmamba_t;

int64_t zoo_mamba_arena(const zmamba_t *m, int64_t M);
// h[:, this thread's columns] += the layer's output, as zoo_delta.
void zoo_mamba(const zmamba_t *m, const float *xn, float *h, int64_t M, int64_t H,
               const int64_t *pos, const int64_t *rows, int64_t t, int64_t T, float *y,
               qx_t *px, char *buf, spin_barrier_t *bar, float scale);

// Multi-head latent attention (mla.c; DeepSeek V2 / V3), decoded in the absorbed form:
// q = q_proj(x) or q_b(rms_norm(q_a(x))), per head [q_nope (dn) | q_pe (dr)]; kv_a(x) =
// [latent (R) | k_pe (dr)], the latent RMS-normed, k_pe and q_pe roped; both cached. Per head
// q_lat = W_uk^T q_nope (R), scores = scale (q_lat . latent_s + q_pe . k_pe_s), o = W_uv
// (softmax @ latent_s): kv_b's rows [W_uk (dn) | W_uv (dv)] per head, each (R,) wide.
typedef struct {
    int64_t heads, rank, dn, dr, dv, q_rank;  // q_rank 0: q is q_proj(x)
    zlinear_t q, q_a, kv_a;                   // q: q_proj or q_b_proj; q_a: unused when q_rank 0
    const float *q_norm, *kv_norm;            // (q_rank,), (R,): RMSNorm weights
    float q_eps, kv_eps, scale;
    const float *kv_b;                        // (heads (dn + dv), R) fp32
    void *latent, *k_pe;                      // (B, S, R), (B, S, dr) caches; fp16 when `half`
    int64_t lsb, lss, psb, pss, half;         // their batch and slot strides (elements)
    int64_t rope_half, interleaved;           // rope of dr = 2 rope_half dims
} zmla_t;

// The arena bytes (zoo_linear_prepare's) and the shared and per-thread floats zoo_mla needs.
int64_t zoo_mla_arena(const zmla_t *m, int64_t M);
int64_t zoo_mla_shared(const zmla_t *m, int64_t M);
int64_t zoo_mla_local(const zmla_t *m, int64_t M, int64_t T);
// att (M, heads dv) = the attention of the normed rows xn (M, H) at positions pos in the
// cache rows `rows` (NULL: 0..M-1), thread t of T: the products' rows and the heads shared
// out; cos / sin: the rope table of this step, row r at r * cstride. The caller meets
// before reading att.
void zoo_mla(const zmla_t *m, const float *xn, float *att, int64_t M, const int64_t *pos,
             const int64_t *rows, const float *cos, const float *sin, int64_t cstride,
             int64_t t, int64_t T, float *shared, float *local, qx_t *px, char *buf,
             spin_barrier_t *bar);

// A gated short-conv layer (shortconv.c; LFM2) in place of a block's attention: in_proj of the
// normed rows into B | C | x, the causal depthwise conv of B * x over the conv window in the
// cache (plus its bias), times C, and out_proj added to h.
typedef struct {
    zlinear_t in, out;     // in_proj (3 H rows: B | C | x), out_proj; biases LFM2's conv_bias
    int64_t kernel;
    const float *conv_w;   // (H, kernel): one filter per channel
    const float *conv_b;   // (H,) or NULL
    void *conv;            // (B, H, kernel - 1): each row's last inputs, fp16 if conv_half
    int64_t conv_sb, conv_half;  // the cache's row stride (elements)
    float *scratch;        // shared, MAX_ROWS 4 H floats
} zsconv_t;

int64_t zoo_sconv_arena(const zsconv_t *s, int64_t M);
// h[:, this thread's columns] += the layer's output for the normed rows xn (M, H) at
// positions pos in the cache rows `rows` (NULL: 0..M-1); thread t of T; y (M, H) shared;
// the output times `scale` (Granite's residual multiplier; 1 for LFM2).
void zoo_sconv(const zsconv_t *s, const float *xn, float *h, int64_t M, int64_t H,
               const int64_t *pos, const int64_t *rows, int64_t t, int64_t T, float *y,
               qx_t *px, char *buf, spin_barrier_t *bar, float scale);
