// A decode step's decoder blocks in one call, on the threads of one OpenMP region.
//
// An eager step runs ~15 torch ops and 4 products per block: on a 2-core CPU and a small model
// (SmolLM2-135M: 30 blocks) their dispatch and the products' fork-joins took more time than
// the products' arithmetic. Here the blocks of the plain pre-norm kind run back to back:
//     h += o(attention(rope(q), rope(k) -> cache, v -> cache)),  q|k|v = qkv(rms_norm(h))
//     h += down(act(gate) * up),                                  gate|up = gate_up(rms_norm(h))
// (or, relu2's non-gated MLP, h += down(relu(up)^2); a block of one sub-block, Nemotron-H's,
// skips the other with its norm and residual add.)
// (Gemma 2 / 3 norm each sum's o(...) and down(...) first; DeepSeek's MLA attends over its
// latent cache in mla.c instead.)
// Every thread normalises the few rows of h itself (a few hundred numbers: cheaper than
// waiting for one thread to do it), then takes its share of each product's output rows (the
// same rows every block, so a thread adds to the h columns it computed), of the kv heads
// (rope, cache write) and of the query heads (attention), with a barrier where one part
// reads what another wrote. A block may hold a gated DeltaNet layer (delta.c), a Mamba2 layer
// (mamba.c) or a gated short conv (shortconv.c) in attention's place. The arithmetic is the
// separate ops' (zoo_qgemv_rows, zoo_rms_norm, zoo_rope, zoo_attend_group), so the result
// equals the eager step's to rounding.
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "step.h"

typedef struct {
    const float *norm1, *norm2;  // (H,): before attention, before the MLP
    float eps1, eps2;
    zlinear_t qkv, o, gate_up, down;
    void *k, *v;                 // (B, Hkv, S, D) caches, strided (elements); fp16 when `half`
    int64_t ksb, ksh, kss, vsb, vsh, vss;
    int64_t slots, ring;         // S; ring: a sliding window's ring buffer of S slots
    int64_t hq, hkv, d;
    int64_t rope, half, interleaved;  // rope: index of the call's cos/sin table, -1: none
    float scale, softcap;        // softcap 0: none
    const float *sinks;          // (hq,) or NULL
    int64_t act, inter;          // 0 SiLU, 1 GELU (tanh); intermediate size
    int64_t kv_half;             // the caches hold fp16 (else fp32)
    const float *qnorm, *knorm;  // (d,): RMSNorm of each q and k head before rope, or NULL
    float qk_eps;
    const zmoe_t *moe;           // a MoE MLP in place of gate_up / down, or NULL
    const zdelta_t *delta;       // a gated DeltaNet layer in place of attention, or NULL
    int64_t ogate;               // q|k|v holds q_h | gate_h per head: o_h *= sigmoid(gate_h)
    // Gemma 2 / 3: (H,) RMSNorms of attention's and the MLP's output before each residual add
    const float *post1, *post2;  // or NULL
    float post_eps1, post_eps2;
    const zmla_t *mla;  // latent attention in place of qkv / the k, v caches (hq = hkv, d = dv)
    int64_t qk_whole;   // qnorm / knorm span all of q's (k's) heads at once (MiniMax M2)
    const zmamba_t *mamba;  // a Mamba2 layer in place of attention, or NULL
    float rscale;           // each sub-block's output times this before its residual add (Granite)
    const zsconv_t *sconv;  // a gated short-conv layer in place of attention (LFM2), or NULL
    // Nemotron-H's one-mixer layers: no attention (the MLP normed by norm2), or no MLP
    int64_t skip_attn, skip_mlp;
} zblock_t;


// Rotate one head (x: head_dim floats) of row r by the block's rope table for this step.
static void rotate(const zblock_t *b, float *x, int64_t r, const float *const *cos,
                   const float *const *sin, const int64_t *cstride) {
    if (b->rope < 0) return;  // a layer without rope
    const int64_t at = r * cstride[b->rope];
    zoo_rope(x, 1, 1, 1, 0, 0, 0, cos[b->rope] + at, sin[b->rope] + at, 0, b->half,
             (int)b->interleaved);
}

// Unit u = (row r, kv head kh) of q|k|v: row r's k of head kh normed (q/k norms) and rotated
// in place (q|k|v is this step's own), then k and v written to the row's cache slot.
static void write_kv(const zblock_t *b, float *qkv, int64_t u, const int64_t *pos,
                     const int64_t *rows, const float *const *cos, const float *const *sin,
                     const int64_t *cstride) {
    const int64_t r = u / b->hkv, kh = u % b->hkv, dh = b->d;
    const int64_t slot = b->ring ? pos[r] % b->slots : pos[r];
    const int64_t c = rows ? rows[r] : r;  // the row's place in the cache
    float *kr = qkv + r * b->qkv.N + b->hq * (b->ogate ? 2 * dh : dh) + kh * dh;
    float *vr = kr + b->hkv * dh;
    void *kc = slot_at(b->k, c * b->ksb + kh * b->ksh + slot * b->kss, b->kv_half);
    void *vc = slot_at(b->v, c * b->vsb + kh * b->vsh + slot * b->vss, b->kv_half);
    if (b->knorm && !b->qk_whole) zoo_rms_norm(kr, NULL, NULL, b->knorm, kr, 1, dh, b->qk_eps);
    rotate(b, kr, r, cos, sin, cstride);
    if (b->kv_half) {
        zoo_float_to_half(kr, kc, dh);
        zoo_float_to_half(vr, vc, dh);
    } else {
        memcpy(kc, kr, dh * sizeof(float));
        memcpy(vc, vr, dh * sizeof(float));
    }
}

// Kv head kh of the n tokens toks of one cache row (a chain's, at ascending positions; else
// n = 1): each token's query heads (kh's group) normed and rotated into q, then all of them
// attending together to the row's filled slots, token i's heads to the slots up to its own
// position: each key and value read (and converted) once for them all (zoo_attend_heads),
// into att (through o, n group rows of d, for a chain).
static void attend_unit(const zblock_t *b, const float *qkv, float *att, int64_t kh,
                        const int64_t *toks, int64_t n, const int64_t *pos, const int64_t *rows,
                        const float *const *cos, const float *const *sin,
                        const int64_t *cstride, float *q, float *p, float *tmp, float *o) {
    const int64_t dh = b->d, group = b->hq / b->hkv;
    const int64_t j0 = kh * group, qs = b->ogate ? 2 * dh : dh;  // q_h (and gate_h) qs apart
    const int64_t c = rows ? rows[toks[0]] : toks[0];
    int64_t seen[MAX_ROWS];
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = toks[i];
        for (int64_t g = 0; g < group; g++) {
            float *qg = q + (i * group + g) * dh;
            memcpy(qg, qkv + r * b->qkv.N + (j0 + g) * qs, dh * sizeof(float));
            if (b->qnorm && !b->qk_whole)
                zoo_rms_norm(qg, NULL, NULL, b->qnorm, qg, 1, dh, b->qk_eps);
            rotate(b, qg, r, cos, sin, cstride);
        }
        seen[i] = b->ring && pos[r] >= b->slots ? b->slots : pos[r] + 1;
    }
    float *out = n == 1 ? att + (toks[0] * b->hq + j0) * dh : o;
    zoo_attend_heads(q, n * group, group, dh,
                     slot_at(b->k, c * b->ksb + kh * b->ksh, b->kv_half), b->kss,
                     slot_at(b->v, c * b->vsb + kh * b->vsh, b->kv_half), b->vss, 0, seen, dh,
                     dh, b->scale, b->softcap, b->sinks ? b->sinks + j0 : NULL, (int)b->kv_half,
                     p, tmp, out);
    for (int64_t i = 0; i < n; i++) {
        const float *qr = qkv + toks[i] * b->qkv.N;
        float *oi = att + (toks[i] * b->hq + j0) * dh;
        if (n > 1) memcpy(oi, o + i * group * dh, group * dh * sizeof(float));
        for (int64_t g = 0; b->ogate && g < group; g++) {  // the output gate
            const float *gate = qr + (j0 + g) * qs + dh;
            for (int64_t e = 0; e < dh; e++) oi[g * dh + e] *= 1.0f / (1.0f + expf(-gate[e]));
        }
    }
}

// GQA attention of the normed rows xn for block b: q|k|v (rows split over the threads), then
// each (row, kv head) unit of a thread's share writes its k and v to the row's cache slot
// (write_kv) and attends (attend_unit) into att (M, hq d). A thread attends to the slots of
// this step that it wrote itself, except in a chain (`chained`: a cache row repeated at
// consecutive positions, the tokens of one sequence verified together), where a token reads
// the slots of the row's earlier tokens, which other threads write: every thread writes its
// units first and the threads meet, then the units of attention are (cache row, kv head),
// each holding all of the row's tokens, which read the row's slots once together. (A ring
// would evict a key that an earlier token of the chain still reads: core/cpu_step.py runs no
// chain over one.) With `ogate`, q_h and gate_h alternate per head in q|k|v and each head's
// output is multiplied by sigmoid(gate_h).
static void attend(const zblock_t *b, const float *xn, float *qkv, float *att, int64_t M,
                   const int64_t *pos, const int64_t *rows, int64_t chained,
                   const float *const *cos, const float *const *sin, const int64_t *cstride,
                   int64_t t, int64_t T, float *q, float *p, float *tmp, float *o, qx_t *px,
                   char *buf, spin_barrier_t *bar) {
    const int64_t nq = b->qkv.N, dh = b->d;
    zoo_linear_share(&b->qkv, xn, qkv, M, t, T, px, buf);
    zoo_meet(bar, T);
    if (b->qk_whole) {  // each row's whole q and k normed first: the heads below read them all
        for (int64_t r = M * t / T; r < M * (t + 1) / T; r++) {
            float *qr = qkv + r * nq, *kr = qr + b->hq * dh;
            zoo_rms_norm(qr, NULL, NULL, b->qnorm, qr, 1, b->hq * dh, b->qk_eps);
            zoo_rms_norm(kr, NULL, NULL, b->knorm, kr, 1, b->hkv * dh, b->qk_eps);
        }
        zoo_meet(bar, T);
    }
    const int64_t u0 = M * b->hkv * t / T, u1 = M * b->hkv * (t + 1) / T;
    for (int64_t u = u0; u < u1; u++) write_kv(b, qkv, u, pos, rows, cos, sin, cstride);
    if (!chained) {
        for (int64_t u = u0; u < u1; u++) {
            const int64_t r = u / b->hkv;
            attend_unit(b, qkv, att, u % b->hkv, &r, 1, pos, rows, cos, sin, cstride, q, p, tmp,
                        o);
        }
        return;
    }
    zoo_meet(bar, T);
    int64_t first[MAX_ROWS], nf = 0, most = 1;  // each cache row's first token; its most
    for (int64_t r = 0; r < M; r++) {
        int64_t before = 0, n = 0;
        for (int64_t j = 0; j < M; j++) {
            before |= j < r && rows[j] == rows[r];
            n += rows[j] == rows[r];
        }
        if (!before) first[nf++] = r;
        most = max64(most, n);
    }
    // Where the units cannot be shared evenly (one row's chain, 3 kv heads, 2 threads), each
    // row's tokens go in `parts` parts (each reading the slots once), enough to share them.
    int64_t parts = T, x = nf * b->hkv;  // parts = T / gcd(units, T), at most `most`
    for (int64_t y = T; y;) {
        const int64_t z = x % y;
        x = y;
        y = z;
    }
    parts = parts / x < most ? parts / x : most;
    const int64_t units = nf * b->hkv * parts, c0 = units * t / T, c1 = units * (t + 1) / T;
    for (int64_t u = c0; u < c1; u++) {
        const int64_t r0 = first[u / parts / b->hkv], part = u % parts;
        int64_t all[MAX_ROWS], n = 0;  // the row's tokens, in order (ascending positions)
        for (int64_t r = r0; r < M; r++)
            if (rows[r] == rows[r0]) all[n++] = r;
        const int64_t *toks = all + n * part / parts;
        n = n * (part + 1) / parts - n * part / parts;
        if (n == 0) continue;
        attend_unit(b, qkv, att, u / parts % b->hkv, toks, n, pos, rows, cos, sin, cstride, q,
                    p, tmp, o);
    }
}

// The final norm and the LM head: logits (M, V) = head(rms_norm(h)).
typedef struct {
    const float *norm;
    float eps;
    zlinear_t head;
} zhead_t;

// The L blocks on h (M, H) in place, for M <= MAX_ROWS rows at positions pos (M,) in the
// cache rows `rows` (M,; NULL: rows 0..M-1), then (where hd is given) the logits (M, V) of the
// result. cos[j], sin[j]: rope table j for this step, (1 or M, half) with row stride cstride[j].
// A row named more than once is a chain: its tokens at consecutive positions, each attending
// to the row's cache up to its own (the caller checks the positions and that no block is a
// ring or a recurrent layer, whose state the tokens would step in parallel).
void zoo_decode_blocks(const zblock_t *blocks, int64_t L, float *h, int64_t M, int64_t H,
                       const int64_t *pos, const int64_t *rows, const float *const *cos,
                       const float *const *sin, const int64_t *cstride, const zhead_t *hd,
                       float *logits, int threads) {
    int64_t arena = 0, in = H, nqkv = 0, hqd = 0, inter = 0, slots = 1, d = 1, group = 1;
    int64_t pairs = 1, experts = 1, ebytes = 64;  // MoE: rows x chosen experts, router rows
    int64_t mshared = 1;                          // MLA's shared scratch
    int64_t chain = 1;  // the most tokens of one cache row: over 1, a chain of a sequence's
    for (int64_t i = 0; rows && i < M; i++) {
        int64_t n = 0;
        for (int64_t j = 0; j < M; j++) n += rows[i] == rows[j];
        chain = max64(chain, n);
    }
    const int64_t chained = chain > 1;
    if (hd) {
        arena = zoo_linear_bytes(&hd->head, M);
    }
    for (int64_t l = 0; l < L; l++) {
        const zblock_t *b = &blocks[l];
        const zlinear_t *ls[4] = {&b->qkv, &b->o, &b->gate_up, &b->down};
        for (int i = 0; i < 4; i++) {
            arena = max64(arena, zoo_linear_bytes(ls[i], M));
        }
        if (b->moe) {
            const zmoe_t *m = b->moe;
            arena = max64(arena, zoo_moe_arena(m, M));
            inter = max64(inter, m->topk * m->inter + m->shared_inter);  // + shared experts
            pairs = max64(pairs, m->topk + 1);  // + the shared experts' output
            experts = max64(experts, m->experts + 1);  // + the shared experts' gate
            ebytes = max64(ebytes, zoo_moe_ebytes(m, M));
        }
        if (b->delta) arena = max64(arena, zoo_delta_arena(b->delta, M));
        if (b->mamba) arena = max64(arena, zoo_mamba_arena(b->mamba, M));
        if (b->sconv) arena = max64(arena, zoo_sconv_arena(b->sconv, M));
        if (b->mla) {
            arena = max64(arena, zoo_mla_arena(b->mla, M));
            mshared = max64(mshared, zoo_mla_shared(b->mla, M));
        }
        nqkv = max64(nqkv, b->qkv.N);
        hqd = max64(hqd, b->hq * b->d);
        inter = max64(inter, b->inter);
        slots = max64(slots, b->slots);
        d = max64(d, b->d);
        group = max64(group, b->delta || b->mamba || b->sconv || b->skip_attn ? 1 : b->hq / b->hkv);
    }
    in = max64(max64(in, hqd), inter);
    // shared: the q|k|v rows, attention's output, gate|up, act(gate) * up, a product's output
    float *qkv = malloc(M * nqkv * sizeof(float)), *att = malloc(M * hqd * sizeof(float));
    float *gu = malloc(M * 2 * inter * sizeof(float)), *act = malloc(M * inter * sizeof(float));
    float *y = malloc(M * pairs * H * sizeof(float)), *logit = malloc(M * experts * sizeof(float));
    float *mla = malloc(mshared * sizeof(float));
    spin_barrier_t bar;
    atomic_init(&bar.arrived, 0);
    atomic_init(&bar.round, 0);
    atomic_init(&bar.sleepers, 0);
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        float *xn = malloc(M * in * sizeof(float));
        // attention: the scores of a kv head's query heads (of each token of a chain), the
        // heads, a row and the totals, the heads' outputs
        const int64_t heads = chain * group;
        float *p = malloc(heads * slots * sizeof(float)), *q = malloc(heads * d * sizeof(float));
        float *tmp = malloc((d + heads) * sizeof(float)), *o = malloc(heads * d * sizeof(float));
        char *buf = aligned_alloc(64, (arena + 64) / 64 * 64);
        char *ebuf = aligned_alloc(64, (ebytes + 63) / 64 * 64);
        int64_t mlocal = 1;  // MLA's scratch: it depends on the heads of each of the T threads
        for (int64_t l = 0; l < L; l++)
            if (blocks[l].mla) mlocal = max64(mlocal, zoo_mla_local(blocks[l].mla, M, T));
        float *mlocal_t = malloc(mlocal * sizeof(float));
        qx_t px[MAX_PARTS];
        const int64_t h0 = share(H, t, T), h1 = share(H, t + 1, T);  // this thread's columns of h
        for (int64_t l = 0; l < L; l++) {
            const zblock_t *b = &blocks[l];
            const int64_t I = b->inter;
            if (!b->skip_attn) zoo_rms_norm(h, NULL, NULL, b->norm1, xn, M, H, b->eps1);
            if (b->skip_attn) {
                // no attention (Nemotron-H's MLP and MoE layers): the MLP alone, below
            } else if (b->delta) {  // a gated DeltaNet layer (delta.c): h += its output
                zoo_delta(b->delta, xn, h, M, H, pos, rows, t, T, y, px, buf, &bar, b->rscale);
            } else if (b->mamba) {  // a Mamba2 layer (mamba.c): h += its output
                zoo_mamba(b->mamba, xn, h, M, H, pos, rows, t, T, y, px, buf, &bar, b->rscale);
            } else if (b->sconv) {  // a gated short-conv layer (shortconv.c): h += its output
                zoo_sconv(b->sconv, xn, h, M, H, pos, rows, t, T, y, px, buf, &bar, b->rscale);
            } else {
                if (b->mla)  // mla.c: its own products, cache and heads
                    zoo_mla(b->mla, xn, att, M, pos, rows, cos[b->rope], sin[b->rope],
                            cstride[b->rope], t, T, mla, mlocal_t, px, buf, &bar);
                else
                    attend(b, xn, qkv, att, M, pos, rows, chained, cos, sin, cstride, t, T, q, p,
                           tmp, o, px, buf, &bar);
                zoo_meet(&bar, T);
                // h += o(attention): this thread's columns of h
                zoo_add_product(&b->o, att, h, y, M, H, h0, h1, px, buf, b->post1, b->post_eps1, xn,
                                &bar, T, b->rscale);
            }
            if (!b->skip_attn) zoo_meet(&bar, T);  // (the last block ended on one)
            if (b->skip_mlp) continue;
            // the MLP: gate and up rows i of this thread's share, then act(gate) * up
            zoo_rms_norm(h, NULL, NULL, b->norm2, xn, M, H, b->eps2);
            if (b->moe) {
                zoo_moe(b->moe, xn, h, M, H, t, T, logit, gu, act, y, px, buf, ebuf, &bar,
                        b->rscale);
                zoo_meet(&bar, T);
                continue;
            }
            zoo_linear_prepare(&b->gate_up, xn, M, px, buf);
            zoo_mlp_hidden(&b->gate_up, px, gu, act, M, I, share(I, t, T), share(I, t + 1, T),
                           b->act);
            zoo_meet(&bar, T);
            zoo_add_product(&b->down, act, h, y, M, H, h0, h1, px, buf, b->post2, b->post_eps2, xn,
                            &bar, T, b->rscale);
            zoo_meet(&bar, T);
        }
        if (hd) {  // the vocabulary's rows split over the threads
            zoo_rms_norm(h, NULL, NULL, hd->norm, xn, M, H, hd->eps);
            zoo_linear_share(&hd->head, xn, logits, M, t, T, px, buf);
        }
        free(xn);
        free(p);
        free(q);
        free(tmp);
        free(o);
        free(buf);
        free(ebuf);
        free(mlocal_t);
    }
    free(qkv);
    free(att);
    free(gu);
    free(act);
    free(y);
    free(logit);
    free(mla);
}
