/* The sampling rule of stoa.backends.sampling on the CPU, untruncated (no top-k / top-p).
 *
 * The torch engine's host sampler (stoa.backends.torch.csample; built and loaded with the int8 kernel by
 * stoa.backends.torch.qlinear). For each row of logits x [V] with 64-bit row seed (lo, hi):
 *
 *   z = x * inv_temp (float32), best = first argmax z, z -= z[best] (float32),
 *   token = argmax_j fl(z_j + g_j) (ties: the lowest index), g_j = float32 Gumbel noise of code
 *   c_j = mix(mix(j ^ lo) ^ hi) >> 9 (stoa.backends.sampling.noise_bits),
 *   log-prob = z[token] - log(sum_j exp(z_j)),
 *
 * with the same float32 operations as stoa.backends.sampling.HostSampler. The noise of a code is
 * -log(-log1p(w * -2^-23)), w = 2^23 - 0.5 - c (exact in float32), each log taken in double and
 * rounded to float32: the correctly rounded float32 chain. numpy's float32 log / log1p, which
 * HostSampler uses, are not correctly rounded: their noise differs from this by one float32 unit in
 * the last place (at most 1e-6) on ~30% of the codes, so the two draw different tokens only where
 * two noised scores lie that close (never seen in tests of ~10^5 rows).
 *
 * Noise is computed only where it can decide the draw, which gives the full computation's token: the
 * noised score of a token reached so far (first: `best`'s, z = 0) bounds the winner from below; a
 * token with z_j < bound - G_MAX - SLACK cannot reach it, and neither can one whose integer code is
 * below the threshold of its deficit's bin (the table of stoa.backends.sampling, `_NEED`). The bound
 * rises as the scan finds better scores, so a flat row (a random model's) gets float noise for a few
 * dozen tokens rather than half its vocabulary. One pass finds the maximum; a second computes the
 * exponentials' sum (float32 sums of 256 terms added in double: at least as accurate as numpy's
 * pairwise float32 sum) and, without branches, every token's code and its candidacy; only the rare
 * survivors take the scalar path (their float noise).
 *
 * A row is cut into segments of SEG tokens whatever the batch or the threads; each segment's exp sum
 * and its best score are combined in segment order, so a row's token and log-prob do not depend on
 * its neighbours, the batch size or the thread count. Rows are spread over OpenMP threads, or, when
 * there are fewer than two rows per thread, the segments are. Portable C with GCC/Clang vector
 * extensions (simd.h), AVX-512 and NEON intrinsics where they help. Build with -ffp-contract=off: no
 * multiply-add of the draw may be fused (the exponential of the sum uses explicit ones with AVX-512).
 */
#pragma STDC FP_CONTRACT OFF
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define SEG 8192 /* tokens per segment: fixed, so results do not depend on the threads */
#define PART 16  /* vectors of exponentials summed in float32 before they join the double sum */
#define H1 0x7FEB352Du
#define H2 0x846CA68Bu
#define NMAX 160 /* room for the code threshold table (137 entries) */

typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef double vd __attribute__((vector_size(VL * 8)));

static const float SLACK_F = 1e-3f; /* float32(_SLACK) */
static float GMAX_F;                /* float32(G_MAX): the largest noise a code gives */
static uint32_t need_tab[NMAX];     /* _NEED: entry 0 for a negative deficit, then BITS_AT[:-1] */
static int need_top;                /* the largest deficit bin (len(BITS_AT) - 2) */

/* e^x for x <= 0 (Cephes' single-precision polynomial, ~1 ulp); below -87.3 (and -inf) it is 0.
 * simd.h's vexp; with AVX-512, the same polynomial in fused multiply-adds and scalef (this sum needs no
 * particular rounding, only accuracy). */
static inline vf s_exp(vf x) {
#if defined(STOA_AVX512)
    const __m512 v = (__m512)x;
    const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ);
    const __m512 y = _mm512_max_ps(v, _mm512_set1_ps(-87.33654f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), y);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return (vf)_mm512_maskz_scalef_ps(live, e, n);
#else
    return vexp(x);
#endif
}

/* The lanes of a comparison mask as bits (lane i: bit i). */
static inline uint32_t lanes(vi m) {
#if defined(STOA_AVX512)
    return (uint32_t)_mm512_test_epi32_mask((__m512i)m, (__m512i)m);
#elif defined(STOA_AVX2)
    return (uint32_t)_mm256_movemask_ps((__m256)m);
#elif defined(STOA_NEON)
    const uint32x4_t bit = {1u, 2u, 4u, 8u}; /* a mask lane is all ones or zero */
    return vaddvq_u32(vandq_u32((uint32x4_t)m, bit));
#else
    uint32_t b = 0;
    for (int i = 0; i < VL; i++) b |= (uint32_t)(m[i] != 0) << i;
    return b;
#endif
}

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= H1;
    x ^= x >> 15;
    x *= H2;
    x ^= x >> 16;
    return x;
}

static inline vu vmix32(vu x) {
    x ^= x >> 16;
    x *= H1;
    x ^= x >> 15;
    x *= H2;
    x ^= x >> 16;
    return x;
}

/* The 23-bit noise code of token j. */
static inline uint32_t code_of(uint32_t j, uint32_t lo, uint32_t hi) { return mix32(mix32(j ^ lo) ^ hi) >> 9; }

/* float32 Gumbel noise of a 23-bit code: stoa.backends.sampling.gumbel's chain, each log correctly
 * rounded (taken in double, then rounded to float32). */
static inline float noise_of(uint32_t code) {
    const float w = 8388607.5f - (float)code;        /* exact */
    const float t = w * -0x1p-23f;                   /* exact: -(1 - u) */
    const float l1 = (float)log1p((double)t);        /* log(u) */
    return -(float)log(-(double)l1);
}

/* _need: the smallest code with which a token of shifted scaled logit z could reach `bound`. */
static inline uint32_t need_of(float bound, float z) {
    const float d = floorf(((bound - z) - SLACK_F) * 8.0f);
    const int b = d < -1.0f ? -1 : d > (float)need_top ? need_top : (int)d;
    return need_tab[b + 1];
}

/* A lower bound on need_of for VL tokens at once: the deficit's bin clamped to the first NV entries of
 * the table (thresholds only rise with the deficit), looked up with two-vector shuffles. */
#define NV 64
static vu need_lanes[NV / VL];

static inline vu need_vec(float bound, vf z) {
    vf d = ((bcast(bound) - z) - SLACK_F) * 8.0f;
#if defined(STOA_AVX512)
    d = (vf)_mm512_min_ps(_mm512_max_ps((__m512)d, _mm512_set1_ps(-1.0f)), _mm512_set1_ps((float)(NV - 2)));
    const vi k = (vi)_mm512_cvt_roundps_epi32((__m512)d, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
    d = sel(d < -1.0f, bcast(-1.0f), d);
    d = sel(d > (float)(NV - 2), bcast((float)(NV - 2)), d); /* clamped: then floor by truncation */
    vi k = __builtin_convertvector(d, vi);
    k -= (vi)(__builtin_convertvector(k, vf) > d) & 1;
#endif
    const vu u = (vu)(k + 1), low = u & (2 * VL - 1);
    vu r = __builtin_shuffle(need_lanes[0], need_lanes[1], low);
    for (int p = 1; p < NV / (2 * VL); p++) {
        const vu q = __builtin_shuffle(need_lanes[2 * p], need_lanes[2 * p + 1], low);
        const vu at = (vu)(u >= (vu){0} + (uint32_t)(2 * VL * p));
        r = (at & q) | (~at & r);
    }
    return r;
}

/* BITS_AT as stoa.backends.sampling._bits_at_least builds it (float64): for each bin edge k / 8 up to
 * G_MAX + 1/8 (numpy's arange), the smallest code whose noise can exceed it, one lower; then 2^23 (no
 * code) and 0 (index -1). need_tab is it shifted by one (_NEED). */
static void need_build(void) {
    const double gmax = -log(-log1p(-(0.5 * 0x1p-23)));
    const int nedge = (int)ceil((gmax + 0.125) / 0.125);
    uint32_t tab[NMAX];
    tab[0] = 0u;
    for (int k = 0; k < nedge; k++) {
        const double u = exp(-exp(-((double)k * 0.125)));
        const double c = floor(u * 8388608.0 - 0.5) - 1.0;
        tab[k + 1] = c < 0 ? 0u : (uint32_t)c;
    }
    tab[nedge + 1] = 1u << 23;
    memcpy(need_tab, tab, sizeof tab);
    memcpy(need_lanes, tab, sizeof need_lanes);
    need_top = nedge;
    GMAX_F = (float)gmax;
}

static void need_init(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, need_build);
}

/* The shifted code threshold table (stoa.backends.sampling._NEED) into out [cap]; returns its length. */
int stoa_sample_table(uint32_t *out, int cap) {
    need_init();
    for (int i = 0; i < cap && i < need_top + 2; i++) out[i] = need_tab[i];
    return need_top + 2;
}

/* Tokens a .. b of one row: the maximum of z = x * it, the first index holding it; *nan when some z is NaN. */
static void seg_max(const float *x, int64_t a, int64_t b, float it, float *mx, int64_t *at, int *nan) {
    enum { U = 4 }; /* independent maxima: a compare-and-select chain each */
    vf m[U];
    vi idx[U], bad = (vi){0}, iota;
    for (int i = 0; i < VL; i++) iota[i] = i;
    for (int u = 0; u < U; u++) m[u] = bcast(-INFINITY), idx[u] = (vi){0} - 1;
    int64_t j = a;
    for (; j + U * VL <= b; j += U * VL)
        for (int u = 0; u < U; u++) {
            const vf z = loadf(x + j + u * VL) * it;
            const vi gt = z > m[u];
            m[u] = sel(gt, z, m[u]);
            idx[u] = (gt & (iota + (int32_t)(j + u * VL - a))) | (~gt & idx[u]);
            bad |= z != z;
        }
    for (; j < b; j += VL) {
        vf z = bcast(-INFINITY);
        if (j + VL <= b)
            z = loadf(x + j) * it;
        else
            for (int i = 0; j + i < b; i++) z[i] = x[j + i] * it;
        const vi gt = z > m[0];
        m[0] = sel(gt, z, m[0]);
        idx[0] = (gt & (iota + (int32_t)(j - a))) | (~gt & idx[0]);
        bad |= z != z;
    }
    float best = -INFINITY;
    int64_t where = -1;
    for (int u = 0; u < U; u++) /* each (set, lane) holds its first maximum: the lowest index of the largest */
        for (int i = 0; i < VL; i++)
            if (idx[u][i] >= 0 && (m[u][i] > best || (m[u][i] == best && a + idx[u][i] < where)))
                best = m[u][i], where = a + idx[u][i];
    *mx = best;
    *at = where;
    *nan = lanes(bad) != 0;
}

/* Tokens a .. b of one row given its maximum mx (at `best`, whose score is `bound`): the sum of
 * exp(z - mx) in double, and the best noised score and its token among these and `best`. */
static void seg_draw(const float *x, int64_t a, int64_t b, float it, float mx, float bound, int64_t best,
                     uint32_t lo, uint32_t hi, double *sum, float *score, int64_t *tok) {
    vd acc = (vd){0};
    vi iota;
    for (int i = 0; i < VL; i++) iota[i] = i;
    float ws = bound;
    int64_t wi = best;
    float thr = (ws - GMAX_F) - SLACK_F;
    vf part = bcast(0.f); /* float32 sums of PART blocks, then double: as accurate as a pairwise float32 sum */
    for (int64_t j = a, k = 1; j < b; j += VL, k++) {
        vf zs;
        if (j + VL <= b) {
            zs = loadf(x + j) * it - mx;
        } else {
            zs = bcast(-INFINITY);
            for (int i = 0; j + i < b; i++) zs[i] = x[j + i] * it - mx;
        }
        part += s_exp(zs);
        if (k % PART == 0 || j + VL >= b) {
            acc += __builtin_convertvector(part, vd);
            part = bcast(0.f);
        }
        /* no branch before the rare survivors: whether a block holds a candidate is a coin toss */
        const vu c = vmix32(vmix32(((vu)iota + (uint32_t)j) ^ lo) ^ hi) >> 9;
        uint32_t m = lanes((zs >= bcast(thr)) & (vi)(c >= need_vec(ws, zs)));
        while (m) {
            const int i = __builtin_ctz(m);
            m &= m - 1;
            const float z = zs[i];
            if (z < thr || c[i] < need_of(ws, z)) continue;
            const float s = z + noise_of(c[i]);
            if (s > ws || (s == ws && j + i < wi)) {
                ws = s;
                wi = j + i;
                thr = (ws - GMAX_F) - SLACK_F;
            }
        }
    }
    double t = 0.0;
    for (int i = 0; i < VL; i++) t += acc[i];
    *sum = t;
    *score = ws;
    *tok = wi;
}

/* Float32 noise of n 23-bit codes (what the sampler uses). */
int stoa_sample_noise(const uint32_t *codes, int64_t n, float *out) {
    if (n < 0 || (n && (!codes || !out))) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (codes[i] >> 23) return -1;
        out[i] = noise_of(codes[i]);
    }
    return 0;
}

/* Tokens tok [n] and log-probs lp [n] of rows logits [n, V] (row stride ld floats) with row seed words
 * lo, hi [n], at inverse temperature inv_temp (float32(1 / T)). Returns 0; -1 for a bad argument,
 * -2 when a buffer cannot be allocated, 1 when some row's scaled logits hold a NaN or no finite
 * maximum (the caller's numpy sampler decides what such a row gives; tok and lp are then unset). */
int stoa_sample(const float *logits, int64_t n, int64_t V, int64_t ld, const uint32_t *lo, const uint32_t *hi,
                float inv_temp, int64_t *tok, float *lp, int threads) {
    if (n < 0 || V < 1 || V > ((int64_t)1 << 31) || ld < V || !(inv_temp > 0.f) || !isfinite(inv_temp)) return -1;
    if (n == 0) return 0;
    if (!logits || !lo || !hi || !tok || !lp) return -1;
    need_init();
    if (threads < 1) threads = 1;
    const int64_t nseg = (V + SEG - 1) / SEG;
    float *smax = malloc(sizeof(float) * (size_t)(n * nseg));
    int64_t *sat = malloc(sizeof(int64_t) * (size_t)(n * nseg));
    double *ssum = malloc(sizeof(double) * (size_t)(n * nseg));
    int *snan = malloc(sizeof(int) * (size_t)(n * nseg));
    float *rmax = malloc(sizeof(float) * (size_t)n), *rbound = malloc(sizeof(float) * (size_t)n);
    int64_t *rbest = malloc(sizeof(int64_t) * (size_t)n);
    int rc = 0;
    if (!smax || !sat || !ssum || !snan || !rmax || !rbound || !rbest) {
        rc = -2;
        goto done;
    }
    /* a row from its segments' results: the first maximum, and whether it can be sampled */
#define ROW_MAX(r)                                                                                        \
    do {                                                                                                  \
        float m_ = -INFINITY;                                                                             \
        int64_t w_ = -1;                                                                                  \
        int bad_ = 0;                                                                                     \
        for (int64_t s_ = 0; s_ < nseg; s_++) {                                                           \
            bad_ |= snan[(r) * nseg + s_];                                                                \
            if (smax[(r) * nseg + s_] > m_) m_ = smax[(r) * nseg + s_], w_ = sat[(r) * nseg + s_];        \
        }                                                                                                 \
        if (bad_ || !isfinite(m_)) {                                                                      \
            rmax[r] = NAN;                                                                                \
        } else {                                                                                          \
            rmax[r] = m_;                                                                                 \
            rbest[r] = w_;                                                                                \
            rbound[r] = noise_of(code_of((uint32_t)w_, lo[r], hi[r])); /* z[best] = 0 */                  \
        }                                                                                                 \
    } while (0)
    /* a row's token and log-prob from its segments' sums and winners, in segment order */
#define ROW_DRAW(r, scores, toks)                                                                         \
    do {                                                                                                  \
        double t_ = 0.0;                                                                                  \
        float s_best = -INFINITY;                                                                         \
        int64_t k_ = -1;                                                                                  \
        for (int64_t s_ = 0; s_ < nseg; s_++) {                                                           \
            t_ += ssum[(r) * nseg + s_];                                                                  \
            const float sc_ = (scores)[s_];                                                               \
            const int64_t tk_ = (toks)[s_];                                                               \
            if (sc_ > s_best || (sc_ == s_best && tk_ < k_)) s_best = sc_, k_ = tk_;                      \
        }                                                                                                 \
        tok[r] = k_;                                                                                      \
        lp[r] = (float)((double)(logits[(r) * ld + k_] * inv_temp - rmax[r]) - log(t_));                  \
    } while (0)
    int bad = 0;
    if (n >= 2 * threads) { /* a row per thread at a time: its second pass reads it from cache */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : bad)
        for (int64_t r = 0; r < n; r++) {
            const float *x = logits + r * ld;
            for (int64_t s = 0; s < nseg; s++) {
                const int64_t a = s * SEG, b = a + SEG < V ? a + SEG : V;
                seg_max(x, a, b, inv_temp, &smax[r * nseg + s], &sat[r * nseg + s], &snan[r * nseg + s]);
            }
            ROW_MAX(r);
            if (isnan(rmax[r])) {
                bad = 1;
                continue;
            }
            /* scores and tokens per segment: smax and sat are free again */
            for (int64_t s = 0; s < nseg; s++) {
                const int64_t a = s * SEG, b = a + SEG < V ? a + SEG : V;
                seg_draw(x, a, b, inv_temp, rmax[r], rbound[r], rbest[r], lo[r], hi[r], &ssum[r * nseg + s],
                         &smax[r * nseg + s], &sat[r * nseg + s]);
            }
            ROW_DRAW(r, smax + r * nseg, sat + r * nseg);
        }
    } else { /* few rows: their segments are spread over the threads */
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int64_t w = 0; w < n * nseg; w++) {
                const int64_t r = w / nseg, s = w % nseg, a = s * SEG, b = a + SEG < V ? a + SEG : V;
                seg_max(logits + r * ld, a, b, inv_temp, &smax[w], &sat[w], &snan[w]);
            }
#pragma omp for schedule(static) reduction(| : bad)
            for (int64_t r = 0; r < n; r++) {
                ROW_MAX(r);
                bad |= isnan(rmax[r]);
            }
            if (!bad) {
#pragma omp for schedule(static)
                for (int64_t w = 0; w < n * nseg; w++) {
                    const int64_t r = w / nseg, s = w % nseg, a = s * SEG, b = a + SEG < V ? a + SEG : V;
                    seg_draw(logits + r * ld, a, b, inv_temp, rmax[r], rbound[r], rbest[r], lo[r], hi[r], &ssum[w],
                             &smax[w], &sat[w]);
                }
#pragma omp for schedule(static)
                for (int64_t r = 0; r < n; r++) ROW_DRAW(r, smax + r * nseg, sat + r * nseg);
            }
        }
    }
#undef ROW_MAX
#undef ROW_DRAW
    if (bad) rc = 1;
done:
    free(smax);
    free(sat);
    free(ssum);
    free(snan);
    free(rmax);
    free(rbound);
    free(rbest);
    return rc;
}
