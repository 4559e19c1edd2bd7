// What the fused decode step's files share (cpu_decode.c: the blocks and the driver,
// cpu_moe.c: routed experts, cpu_mla.c: latent attention): linear layers of stacked parts,
// the threads' meeting point and their shares of a product's rows.
#pragma once
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
// out[i] = act(gate[i]) * up[i], act 0: SiLU, 1: GELU (tanh form).
void zoo_activate(const float *gate, const float *up, float *out, int64_t n, int64_t act);

// The threads meet between the parts of a block (cpu_decode.c: why not an OpenMP barrier).
typedef struct {
    atomic_int arrived, round, sleepers;
} spin_barrier_t;
void zoo_meet(spin_barrier_t *b, int64_t T);

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Thread t of T's first row of N: whole groups of 16 (the block kernels compute a weight's
// rows 16 at a time; a group split between two threads would be computed by both).
static inline int64_t share(int64_t N, int64_t t, int64_t T) {
    return t == T ? N : N / 16 * t / T * 16;
}

// A MoE MLP (cpu_moe.c): softmax over the router's logits, the top `topk` experts
// (renormalised where `renorm`), each a SiLU-gated MLP of `inter` rows.
typedef struct {
    int64_t experts, topk, renorm, inter;
    zlinear_t router;                 // (experts, H)
    const qweight_t *gate_up, *down;  // per expert: (2 inter, H) [gate | up], (H, inter)
} zmoe_t;

// The shared scratch a MoE MLP of M rows needs: logit (M, E), gu (M K, 2I), act (M K, I),
// y (M K, H) floats; per thread, ebuf of zoo_moe_ebytes and the arena of zoo_moe_arena bytes.
int64_t zoo_moe_ebytes(const zmoe_t *m, int64_t M);
int64_t zoo_moe_arena(const zmoe_t *m, int64_t M);
// h[:, this thread's columns] += the MoE of the normed rows xn (M, H), thread t of T.
void zoo_moe(const zmoe_t *m, const float *xn, float *h, int64_t M, int64_t H, int64_t t,
             int64_t T, float *logit, float *gu, float *act, float *y, qx_t *px, char *buf,
             char *ebuf, spin_barrier_t *bar);

// Multi-head latent attention (cpu_mla.c; DeepSeek V2 / V3), decoded in the absorbed form:
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
