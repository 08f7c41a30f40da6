/* A whole decode step's layers in one call: the torch engine's CPU decoder at one new token a row.
 *
 * For a quantized (int8) float32 decoder of the Llama-shaped families (llama, mistral, qwen2, qwen3), every
 * layer is: RMSNorm, the fused q|k|v projection (+ bias), the per-head q/k norms (Qwen 3), RoPE, the
 * new key and value written to the cache, decode attention (attention.c), the output projection, the
 * residual, RMSNorm, the fused gate|up projection, SiLU(gate) * up, the down projection and the
 * residual. The projections are the int8 kernel's (qmatmul.c, float32 or integer path); the rest is
 * the float32 arithmetic of the decoder's torch path (stoa.backends.torch.decoder) in the same order
 * of operations, up to the order of the norms' sums of squares. One call replaces ~35 small torch ops
 * and their Python per layer, which cost more than the matrices' arithmetic at small batches.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

int stoa_qmatmul(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                 const float *const *scales, const float *const *biases, const int64_t *outs,
                 float *y, int64_t ldy, int threads);
int stoa_qmatmul_int(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                     const float *const *scales, const float *const *biases, const int64_t *outs,
                     float *y, int64_t ldy, int threads, int digits);
int stoa_attn_decode(const float *q, const float *kc, const float *vc, const int64_t *rows, const int64_t *pos,
                     int64_t n, int nkv, int rep, int d, int64_t cap, float scale, int64_t window, float *out,
                     int threads);

/* One int8 matrix group (a QLinear): m matrices side by side, K inputs, N outputs in all; bias: N
 * floats or NULL. */
typedef struct {
    int64_t m, K, N;
    const uint8_t *const *codes;
    const float *const *scales;
    const float *const *biases;
    const int64_t *outs;
    const float *bias;
} stoa_mat;

typedef struct {
    stoa_mat qkv, o, gate_up, down;
    const float *norm_in, *norm_post; /* [hidden] */
    const float *q_norm, *k_norm;     /* [head_dim], or NULL */
    int64_t window;                   /* sliding window (0: none) */
    int64_t rope;                     /* which cos/sin table */
} stoa_layer;

/* y[n, N] = x[n, K] @ W^T (+ bias) */
static int matmul(const stoa_mat *w, const float *x, int64_t n, float *y, int digits, int threads) {
    const int rc = digits ? stoa_qmatmul_int(x, n, w->K, (int)w->m, w->codes, w->scales, w->biases, w->outs, y,
                                             w->N, threads, digits)
                          : stoa_qmatmul(x, n, w->K, (int)w->m, w->codes, w->scales, w->biases, w->outs, y, w->N,
                                         threads);
    if (rc == 0 && w->bias)
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = 0; j < w->N; j++) y[r * w->N + j] += w->bias[j];
    return rc;
}

/* out = w * (x * rsqrt(mean(x^2) + eps)) over k entries (transformers' Llama RMSNorm in float32). */
static void rms(const float *x, const float *w, int64_t k, float eps, float *out) {
    vf acc = (vf){0};
    int64_t i = 0;
    for (; i + VL <= k; i += VL) {
        const vf v = loadf(x + i);
        acc += v * v;
    }
    float ss = 0.f;
    for (int j = 0; j < VL; j++) ss += acc[j];
    for (; i < k; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)k + eps);
    for (i = 0; i < k; i++) out[i] = w[i] * (x[i] * r);
}

/* RoPE in rotate_half form on one head of d entries: x_i cos_i + (-x_{i+d/2}) sin_i, then
 * x_i cos_i + x_{i-d/2} sin_i. */
static void rope(float *x, const float *c, const float *s, int d) {
    const int h = d / 2;
    float t[1024];
    memcpy(t, x, sizeof(float) * d);
    for (int i = 0; i < h; i++) x[i] = t[i] * c[i] + (-t[i + h]) * s[i];
    for (int i = h; i < d; i++) x[i] = t[i] * c[i] + t[i - h] * s[i];
}

/* act[r, j] = silu(gu[r, j]) * gu[r, I + j]: x / (1 + e^-x), from e^-|x| only (no overflow). */
static void silu_mul(const float *gu, int64_t n, int64_t I, float *act, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * I >= 65536)
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *a = act + r * I;
        int64_t j = 0;
        for (; j + VL <= I; j += VL) {
            const vf x = loadf(g + j);
            const vi neg = x < 0.f;
            const vf t = vexp(sel(neg, x, -x)); /* e^-|x|: e^-x where x >= 0 (as torch), else x e^x / (1 + e^x) */
            storef(a + j, (sel(neg, x * t, x) / (1.0f + t)) * loadf(u + j));
        }
        for (; j < I; j++) {
            const float x = g[j];
            a[j] = x / (1.0f + expf(-x)) * u[j];
        }
    }
}

/* The layers L[0 .. nl-1] of a decode step, in place on the residual stream x [n, hidden]: row r's
 * new token sits at position pos[r] of cache row rows[r] (which must exist: the caller's promise); kcs[i] /
 * vcs[i]: layer i's cache [slots, nkv, cap, d]; cos[t] / sin[t]: RoPE table t [rope_len, d]. Shapes are checked before
 * anything is written. Returns 0; -1 for a shape it does not take (nothing written), -2 when a buffer
 * cannot be allocated (nothing written), -3 when a projection fails part way (x and the caches are
 * then partly updated). */
int stoa_decode_layers(const stoa_layer *L, int nl, float *x, int64_t n, const int64_t *rows, const int64_t *pos,
                       int64_t hidden, int nq, int nkv, int d, int64_t cap, float *const *kcs, float *const *vcs,
                       const float *const *cos, const float *const *sin, int64_t rope_len, float eps, float scale,
                       int digits, int threads) {
    if (nl <= 0 || n <= 0 || nq <= 0 || nkv <= 0 || nq % nkv || d <= 0 || d % 2 || d > 1024 || d % VL) return -1;
    const int64_t nqd = (int64_t)nq * d, nkd = (int64_t)nkv * d, width = nqd + 2 * nkd;
    int64_t inter = 0;
    for (int i = 0; i < nl; i++) {
        const stoa_layer *y = &L[i];
        if (y->qkv.K != hidden || y->qkv.N != width || y->o.K != nqd || y->o.N != hidden ||
            y->gate_up.K != hidden || y->gate_up.N % 2 || y->down.N != hidden || y->down.K * 2 != y->gate_up.N ||
            !kcs[i] || !vcs[i] || !y->norm_in || !y->norm_post || (!y->q_norm) != (!y->k_norm) || y->rope < 0)
            return -1;
        if (y->down.K > inter) inter = y->down.K;
    }
    for (int64_t r = 0; r < n; r++)
        if (pos[r] < 0 || pos[r] >= cap || pos[r] >= rope_len || rows[r] < 0) return -1;
    if (threads < 1) threads = 1;
    float *a = malloc(sizeof(float) * n * hidden), *qkv = malloc(sizeof(float) * n * width),
          *att = malloc(sizeof(float) * n * nqd), *o = malloc(sizeof(float) * n * hidden),
          *gu = malloc(sizeof(float) * n * 2 * inter), *act = malloc(sizeof(float) * n * inter),
          *q = malloc(sizeof(float) * n * nqd);
    int rc = (a && qkv && att && o && gu && act && q) ? 0 : -2;
    for (int i = 0; i < nl && rc == 0; i++) {
        const stoa_layer *y = &L[i];
        const int64_t I = y->down.K;
        for (int64_t r = 0; r < n; r++) rms(x + r * hidden, y->norm_in, hidden, eps, a + r * hidden);
        if (matmul(&y->qkv, a, n, qkv, digits, threads)) { rc = -3; break; }
        for (int64_t r = 0; r < n; r++) {
            const float *c = cos[y->rope] + pos[r] * d, *s = sin[y->rope] + pos[r] * d;
            float *qr = q + r * nqd;
            const float *src = qkv + r * width;
            for (int h = 0; h < nq; h++) {
                if (y->q_norm) rms(src + h * d, y->q_norm, d, eps, qr + h * d);
                else memcpy(qr + h * d, src + h * d, sizeof(float) * d);
                rope(qr + h * d, c, s, d);
            }
            for (int h = 0; h < nkv; h++) {
                float *kd = kcs[i] + ((rows[r] * nkv + h) * cap + pos[r]) * d;
                float *vd = vcs[i] + ((rows[r] * nkv + h) * cap + pos[r]) * d;
                if (y->k_norm) rms(src + nqd + h * d, y->k_norm, d, eps, kd);
                else memcpy(kd, src + nqd + h * d, sizeof(float) * d);
                rope(kd, c, s, d);
                memcpy(vd, src + nqd + nkd + h * d, sizeof(float) * d);
            }
        }
        if (stoa_attn_decode(q, kcs[i], vcs[i], rows, pos, n, nkv, nq / nkv, d, cap, scale, y->window, att, threads)) {
            rc = -3;
            break;
        }
        if (matmul(&y->o, att, n, o, digits, threads)) { rc = -3; break; }
        for (int64_t j = 0; j < n * hidden; j++) x[j] = x[j] + o[j];
        for (int64_t r = 0; r < n; r++) rms(x + r * hidden, y->norm_post, hidden, eps, a + r * hidden);
        if (matmul(&y->gate_up, a, n, gu, digits, threads)) { rc = -3; break; }
        silu_mul(gu, n, I, act, threads);
        if (matmul(&y->down, act, n, o, digits, threads)) { rc = -3; break; }
        for (int64_t j = 0; j < n * hidden; j++) x[j] = x[j] + o[j];
    }
    free(a); free(qkv); free(att); free(o); free(gu); free(act); free(q);
    return rc;
}
