// The parts of a fused decode step that every layer kind's file calls (declared in
// step.h): a product's rows from prepared inputs, the threads' meeting, the MLP's
// activation, and a product added into the residual stream. (decode.c runs the blocks.)
#define _GNU_SOURCE
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define WAIT(p, v) syscall(SYS_futex, p, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0)
#define WAKE(p) syscall(SYS_futex, p, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0)
#else  // elsewhere a waiter that spun long yields its CPU instead of sleeping
#include <sched.h>
#define WAIT(p, v) sched_yield()
#define WAKE(p) (void)0
#endif

#include "step.h"

// Rows [n0, n1) of l's output (rows of y ldy apart), from x prepared for each part in px.
void zoo_linear_rows(const zlinear_t *l, const qx_t *px, float *y, int64_t ldy, int64_t M,
                     int64_t n0, int64_t n1) {
    int64_t base = 0;
    for (int64_t i = 0; i < l->parts; i++) {
        const int64_t N = l->part[i].N, a = n0 > base ? n0 : base;
        const int64_t b = n1 < base + N ? n1 : base + N;
        if (a < b) zoo_qgemv_rows(&l->part[i], &px[i], y + base, ldy, a - base, b - base);
        base += N;
    }
    if (l->bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = n0; n < n1; n++) y[r * ldy + n] += l->bias[n];
}

void zoo_linear_prepare(const zlinear_t *l, const float *x, int64_t M, qx_t *px, char *arena) {
    for (int64_t i = 0; i < l->parts; i++) {
        if (i > 0 && l->part[i].type && l->part[i - 1].type) {  // blocks: x quantized once
            px[i] = px[i - 1];
            continue;
        }
        zoo_qx_prepare(&l->part[i], x, M, &px[i], arena);
        arena += (zoo_qx_bytes(&l->part[i], M) + 63) / 64 * 64;
    }
}

int64_t zoo_linear_bytes(const zlinear_t *l, int64_t M) {
    int64_t n = 0;
    for (int64_t i = 0; i < l->parts; i++) n += (zoo_qx_bytes(&l->part[i], M) + 63) / 64 * 64;
    return n;
}

// The threads meet between the parts of a block on a shared counter, spinning first: an
// OpenMP barrier may put a waiting thread to sleep at once (libgomp spins less where it counts
// more threads than CPUs), and waking it costs more than the part it waited for; steps then
// took 2-5x as long in some processes and not in others. A waiter that has spun ~4k pauses
// (tens of microseconds: another process holds the CPU the last thread needs) sleeps on a
// futex until the last one arrives, instead of spinning away its time slice at each of a
// step's ~180 meetings.
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

void zoo_meet(spin_barrier_t *b, int64_t T) {
    const int round = atomic_load(&b->round);
    if (atomic_fetch_add(&b->arrived, 1) == T - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->round, 1);  // seq_cst: a sleeper counted before it is seen here
        if (atomic_load(&b->sleepers) > 0)
            WAKE(&b->round);
        return;
    }
    for (int spins = 0; spins < 4096; spins++) {
        if (atomic_load_explicit(&b->round, memory_order_acquire) != round) return;
        cpu_relax();
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->round) == round)  // returns at once if the round moved meanwhile
        WAIT(&b->round, round);
    atomic_fetch_sub(&b->sleepers, 1);
}

// out[i] = act(gate[i]) * up[i]: SiLU (g * sigmoid(g), sigmoid from e^-|g| by the vectorized
// exp: libm's expf per value was 4% of a 1B model's step) or GELU (tanh form); relu2, a
// non-gated MLP's: out[i] = relu(gate[i])^2, up unread.
void zoo_activate(const float *gate, const float *up, float *out, int64_t n, int64_t act) {
    if (act == ZOO_RELU2) {
        for (int64_t i = 0; i < n; i++) {
            const float r = gate[i] > 0.0f ? gate[i] : 0.0f;
            out[i] = r * r;
        }
        return;
    }
    float e[64];
    for (int64_t at = 0; at < n; at += 64) {
        const int64_t k = n - at < 64 ? n - at : 64;
        const float *g = gate + at;
        if (act == 0) {
            for (int64_t i = 0; i < k; i++) e[i] = -fabsf(g[i]);
            zoo_exp_nonpositive(e, e, k);
            for (int64_t i = 0; i < k; i++) {
                const float sig = g[i] >= 0.0f ? 1.0f / (1.0f + e[i]) : e[i] / (1.0f + e[i]);
                out[at + i] = g[i] * sig * up[at + i];
            }
        } else {
            const float c = 0.7978845608028654f;  // GELU, tanh form: sqrt(2 / pi)
            for (int64_t i = 0; i < k; i++)
                out[at + i] = 0.5f * g[i] * (1.0f + tanhf(c * (g[i] + 0.044715f * g[i] * g[i] * g[i])))
                              * up[at + i];
        }
    }
}

void zoo_mlp_hidden(const zlinear_t *gate_up, const qx_t *px, float *gu, float *out, int64_t M,
                    int64_t I, int64_t i0, int64_t i1, int64_t act) {
    zoo_linear_rows(gate_up, px, gu, 2 * I, M, i0, i1);  // the gate's rows (relu2: up's)
    if (act != ZOO_RELU2) zoo_linear_rows(gate_up, px, gu, 2 * I, M, I + i0, I + i1);
    for (int64_t r = 0; r < M; r++)
        zoo_activate(gu + r * 2 * I + i0, gu + r * 2 * I + I + i0, out + r * I + i0, i1 - i0, act);
}

void zoo_linear_share(const zlinear_t *l, const float *x, float *y, int64_t M, int64_t t,
                      int64_t T, qx_t *px, char *arena) {
    zoo_linear_prepare(l, x, M, px, arena);
    zoo_linear_rows(l, px, y, l->N, M, share(l->N, t, T), share(l->N, t + 1, T));
}

void zoo_add_product(const zlinear_t *l, const float *x, float *h, float *y, int64_t M,
                     int64_t H, int64_t n0, int64_t n1, qx_t *px, char *arena,
                     const float *post, float eps, float *yn, spin_barrier_t *bar, int64_t T,
                     float scale) {
    zoo_linear_prepare(l, x, M, px, arena);
    zoo_linear_rows(l, px, y, H, M, n0, n1);
    if (post) {
        zoo_meet(bar, T);
        zoo_rms_norm(y, NULL, NULL, post, yn, M, H, eps);
        y = yn;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t n = n0; n < n1; n++) h[r * H + n] += scale * y[r * H + n];
}
