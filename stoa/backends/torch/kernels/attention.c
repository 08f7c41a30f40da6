/* Decode attention on the CPU: one new query per row against that row's cached keys and values.
 *
 * The torch engine's decode step (stoa.backends.torch.decoder; built and loaded with the int8 kernel by
 * stoa.backends.torch.qlinear). For each row and key/value head, the `rep` query heads that share it
 * (grouped-query attention) read its keys and values once: scores q . k_t * scale over the row's
 * visible positions, a float32 softmax, and the probability-weighted sum of the values. It is the
 * attention of the engine's torch path up to the order of float32 sums (~1e-6); no score matrix of
 * the whole batch is built, masked or copied. Portable C with GCC/Clang vector extensions (simd.h:
 * 16, 8 or 4 lanes), threads are OpenMP's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define MAXD 512 /* largest head dimension taken */

/* s[t] = q . K[t] for t < len (q pre-scaled, dv vectors; K rows of dv vectors): VL rows at a time,
 * summed across lanes by one reduction tree. */
static inline __attribute__((always_inline)) void
scores(const vf *q, const float *K, int64_t len, const int dv, float *s) {
    int64_t t = 0;
    for (; t + VL <= len; t += VL) {
        vf a[VL];
        for (int u = 0; u < VL; u++) {
            const float *k = K + (t + u) * dv * VL;
            vf acc = q[0] * loadf(k);
            for (int i = 1; i < dv; i++) acc = fmadd(q[i], loadf(k + i * VL), acc);
            a[u] = acc;
        }
        reduce_tree(a);
        for (int j = 0; j < VL; j++) s[t + lane_of[j]] = a[0][j];
    }
    for (; t < len; t++) {
        const float *k = K + t * dv * VL;
        vf acc = q[0] * loadf(k);
        for (int i = 1; i < dv; i++) acc = fmadd(q[i], loadf(k + i * VL), acc);
        float x = 0.f;
        for (int j = 0; j < VL; j++) x += acc[j];
        s[t] = x;
    }
}

/* s[t] <- softmax(s)[t], t < len. */
static void softmax(float *s, int64_t len) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < len; t++) mx = s[t] > mx ? s[t] : mx;
    vf tot = bcast(0.f);
    int64_t t = 0;
    for (; t + VL <= len; t += VL) {
        const vf e = vexp(loadf(s + t) - mx);
        storef(s + t, e);
        tot += e;
    }
    if (t < len) {
        vf x = bcast(-INFINITY);
        for (int i = 0; t + i < len; i++) x[i] = s[t + i] - mx;
        const vf e = vexp(x);
        for (int i = 0; t + i < len; i++) s[t + i] = e[i];
        tot += e;
    }
    float sum = 0.f;
    for (int j = 0; j < VL; j++) sum += tot[j];
    const float inv = 1.0f / sum;
    for (t = 0; t < len; t++) s[t] *= inv;
}

/* o = sum_t p[t] V[t] (dv vectors). */
static inline __attribute__((always_inline)) void weigh(const float *p, const float *V, int64_t len, const int dv,
                                                        float *o) {
    vf acc[MAXD / VL];
    for (int i = 0; i < dv; i++) acc[i] = bcast(0.f);
    for (int64_t t = 0; t < len; t++) {
        const vf w = bcast(p[t]);
        for (int i = 0; i < dv; i++) acc[i] = fmadd(w, loadf(V + (t * dv + i) * VL), acc[i]);
    }
    for (int i = 0; i < dv; i++) storef(o + i * VL, acc[i]);
}

static inline __attribute__((always_inline)) void
head(const float *q, const float *K, const float *V, int64_t len, int rep, const int dv, float scale, float *s,
     float *out) {
    for (int j = 0; j < rep; j++) {
        vf qv[MAXD / VL];
        for (int i = 0; i < dv; i++) qv[i] = loadf(q + (j * dv + i) * VL) * scale;
        scores(qv, K, len, dv, s + j * len);
        softmax(s + j * len, len);
        weigh(s + j * len, V, len, dv, out + j * dv * VL);
    }
}

/* out[r, h * rep + j, :] for rows r < n, key/value heads h < nkv, j < rep: query q[r, h * rep + j, :]
 * (q, out: [n, nkv * rep, d]) against cache row rows[r] of kc / vc ([slots, nkv, cap, d]) at positions
 * lo .. pos[r] (lo = 0, or pos[r] - window + 1 when window > 0). d % VL == 0 and d <= 512.
 * Returns 0, or -1 for a shape it does not take or a buffer it cannot allocate. */
int stoa_attn_decode(const float *q, const float *kc, const float *vc, const int64_t *rows, const int64_t *pos,
                     int64_t n, int nkv, int rep, int d, int64_t cap, float scale, int64_t window, float *out,
                     int threads) {
    if (n <= 0 || nkv <= 0 || rep <= 0 || d <= 0 || d % VL || d > MAXD) return -1;
    for (int64_t r = 0; r < n; r++)
        if (pos[r] < 0 || pos[r] >= cap || rows[r] < 0) return -1;
    reduce_init();
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * (size_t)(rep * cap));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * nkv; w++) {
            if (!s) continue;
            const int64_t r = w / nkv, h = w % nkv;
            const int64_t hi = pos[r], lo = window > 0 && hi - window + 1 > 0 ? hi - window + 1 : 0;
            const float *K = kc + ((rows[r] * nkv + h) * cap + lo) * d;
            const float *V = vc + ((rows[r] * nkv + h) * cap + lo) * d;
            const float *qh = q + (r * nkv + h) * rep * d;
            float *oh = out + (r * nkv + h) * rep * d;
            switch (d / VL) { /* constant widths keep the accumulators in registers */
            case 4: head(qh, K, V, hi - lo + 1, rep, 4, scale, s, oh); break;
            case 8: head(qh, K, V, hi - lo + 1, rep, 8, scale, s, oh); break;
            case 16: head(qh, K, V, hi - lo + 1, rep, 16, scale, s, oh); break;
#if VL == 4
            case 32: head(qh, K, V, hi - lo + 1, rep, 32, scale, s, oh); break; /* head_dim 128 on NEON */
#endif
            default: head(qh, K, V, hi - lo + 1, rep, d / VL, scale, s, oh); break;
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
