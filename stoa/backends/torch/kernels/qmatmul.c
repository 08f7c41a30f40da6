/* y = x @ W^T for int8 weights of record, W = code * scale + bias per group of 64 inputs.
 *
 * The rollout engine's CPU matmul (stoa.backends.torch.qlinear builds and loads it). Two entry points:
 *
 * stoa_qmatmul (the engine's `quantized` mode): every weight is dequantized exactly as the weights of
 * record are (float32 `code * scale` rounded, then `+ bias` rounded: no fused multiply-add there),
 * into a panel buffer that stays in cache, and the products are float32 multiply-adds on it; so the
 * kernel computes what a float32 matmul on the dequantized matrix computes, up to the order of the
 * sums, while reading one byte per weight from memory instead of four.
 *
 * stoa_qmatmul_int (the `integer` mode; x86 with AVX-512 VNNI): each row of x is rounded, per group of
 * 64 inputs, to 16-bit integers q on a scale sx = max|x| / 32639, and sum_k code_k * q_k is exact
 * integer arithmetic (int8 dot products, the CPU's fastest multiply); then, per group, in float32,
 * y += float(that sum) * (scale * sx) and y += bias * (sx * sum_k q_k). The weights are the weights of
 * record; the activations carry a relative error of at most 1.5e-5 of their group's largest entry.
 *
 * Both are batch-invariant: a row's result does not depend on its neighbours, the batch size or the
 * threads. Several matrices with the same input width can be one call (q|k|v, gate|up): their
 * outputs are laid side by side in y's rows. Portable C with GCC/Clang vector extensions: the vector
 * width follows the target (16 floats with AVX-512, 8 with AVX2 or NEON-sized targets), threads are
 * OpenMP's.
 */
/* Build with -ffp-contract=off (GCC ignores the pragma): `code * scale + bias` must round twice,
 * as the weights of record do; the products' sums use explicit fused multiply-adds (fmadd). */
#pragma STDC FP_CONTRACT OFF
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "simd.h"

#define GROUP 64

#if defined(__AVX512F__)
#define RT 4 /* rows per tile */
#define OT 4 /* outputs per tile */
#else
#define RT 2
#define OT 4 /* RT * OT == VL: one reduction tree per tile */
#endif

typedef uint8_t vb __attribute__((vector_size(VL)));

/* VL codes as floats (exact: 0 .. 255). GCC turns the generic conversion into byte-by-byte
 * inserts, so x86 gets the one-instruction widening loads. */
static inline vf codes_f(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vb c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(__builtin_convertvector(c, vi), vf);
#endif
}

/* VL weights of record: (float)code * scale, rounded, then + bias, rounded (no fused multiply-add). */
static inline vf dequant_vec(const uint8_t *code, float s, float b) {
    vf w = codes_f(code);
    vf m = w * s;
    return m + b;
}

/* One output row of the panel: buf[k] = the weight of record of code[k]. */
static void dequant_row(const uint8_t *code, const float *scale, const float *bias, int64_t K, float *buf) {
    for (int64_t g = 0; g < K / GROUP; g++)
        for (int64_t j = 0; j < GROUP; j += VL)
            storef(buf + g * GROUP + j, dequant_vec(code + g * GROUP + j, scale[g], bias[g]));
}

/* Writes the nr x no results of a tile's accumulators to y. The tree sums each accumulator's
 * lanes in one fixed order whatever the others hold, so a row's result does not depend on its
 * neighbours in the tile, the batch size or the threads. */
static inline __attribute__((always_inline)) void
store_tile(vf acc[RT][OT], const int nr, const int no, float *y, int64_t ldy) {
    vf a[VL];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) a[r * OT + o] = acc[r][o];
    reduce_tree(a);
    for (int j = 0; j < VL; j++) {
        const int i = lane_of[j], r = i / OT, o = i % OT;
        if (r < nr && o < no) y[r * ldy + o] = a[0][j];
    }
}

/* y[r, o] for rows r0 .. r0+nr-1 (nr <= RT) and panel outputs o0 .. o0+no-1 (no <= OT). */
static inline __attribute__((always_inline)) void
tile_body(const float *x, int64_t ldx, const float *w, int64_t K, const int nr, const int no, float *y, int64_t ldy) {
    vf acc[RT][OT];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) acc[r][o] = (vf){0};
    for (int64_t k = 0; k < K; k += VL) {
        vf xv[RT], wv[OT];
        for (int r = 0; r < nr; r++) xv[r] = loadf(x + r * ldx + k);
        for (int o = 0; o < no; o++) wv[o] = loadf(w + o * K + k);
        for (int r = 0; r < nr; r++)
            for (int o = 0; o < no; o++) acc[r][o] = fmadd(xv[r], wv[o], acc[r][o]);
    }
    store_tile(acc, nr, no, y, ldy);
}

/* The body with constant row and output counts, so the accumulators stay in registers (with
 * run-time counts GCC keeps them on the stack, and every multiply-add waits on a store). */
static void tile(const float *x, int64_t ldx, const float *w, int64_t K, int nr, int no, float *y, int64_t ldy) {
    if (no == OT) {
        switch (nr) {
        case RT: tile_body(x, ldx, w, K, RT, OT, y, ldy); return;
        case 1: tile_body(x, ldx, w, K, 1, OT, y, ldy); return;
#if RT > 2
        case 2: tile_body(x, ldx, w, K, 2, OT, y, ldy); return;
        case 3: tile_body(x, ldx, w, K, 3, OT, y, ldy); return;
#endif
        default: break;
        }
    }
    tile_body(x, ldx, w, K, nr, no, y, ldy);
}

/* Few rows (n < RT): no panel buffer; each weight is dequantized in registers (dequant_vec) and
 * used at once. Same accumulation order per (row, output) as tile(): the results are bit for bit
 * those of the buffered path. */

static inline __attribute__((always_inline)) void
few_rows_body(const float *x, int64_t K, const int nr, const uint8_t *code, const float *scale, const float *bias,
              const int no, float *y, int64_t ldy) {
    vf acc[RT][OT];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) acc[r][o] = (vf){0};
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        for (int64_t j = 0; j < GROUP; j += VL) {
            const int64_t k = g * GROUP + j;
            for (int o = 0; o < no; o++) {
                vf w = dequant_vec(code + o * K + k, scale[o * G + g], bias[o * G + g]);
                for (int r = 0; r < nr; r++) acc[r][o] = fmadd(loadf(x + r * K + k), w, acc[r][o]);
            }
        }
    }
    store_tile(acc, nr, no, y, ldy);
}

/* As tile(): constant counts keep the accumulators in registers. */
static void few_rows(const float *x, int64_t K, int nr, const uint8_t *code, const float *scale,
                     const float *bias, int no, float *y, int64_t ldy) {
    if (no == OT) {
        switch (nr) {
        case 1: few_rows_body(x, K, 1, code, scale, bias, OT, y, ldy); return;
#if RT > 2
        case 2: few_rows_body(x, K, 2, code, scale, bias, OT, y, ldy); return;
        case 3: few_rows_body(x, K, 3, code, scale, bias, OT, y, ldy); return;
#endif
        default: break;
        }
    }
    few_rows_body(x, K, nr, code, scale, bias, no, y, ldy);
}

/* The panel width: outputs whose dequantized rows fit ~256 KB (a core's L2 share), a multiple of OT. */
static int64_t panel_width(int64_t K) {
    int64_t p = (256 * 1024) / (K * 4);
    p = p / OT * OT;
    if (p < OT) p = OT;
    if (p > 256) p = 256;
    return p;
}

/* Splits the m matrices' outputs into panels of at most P: pm[2p], pm[2p+1] = panel p's matrix and
 * first output; col[i] = matrix i's first column of y. Returns -1 when out of memory. */
static int plan(int m, const int64_t *outs, int64_t P, int64_t *npanels, int64_t **pm, int64_t **col) {
    int64_t np = 0;
    for (int i = 0; i < m; i++) np += (outs[i] + P - 1) / P;
    *pm = malloc(sizeof(int64_t) * 2 * np);
    *col = malloc(sizeof(int64_t) * m);
    if (!*pm || !*col) { free(*pm); free(*col); return -1; }
    int64_t q = 0, c = 0;
    for (int i = 0; i < m; i++) {
        (*col)[i] = c; c += outs[i];
        for (int64_t o = 0; o < outs[i]; o += P) { (*pm)[2 * q] = i; (*pm)[2 * q + 1] = o; q++; }
    }
    *npanels = np;
    return 0;
}

/* y[n, ldy] (columns 0 .. sum(outs)-1) = x[n, K] @ [W_0; W_1; ...]^T for m matrices with out sizes
 * outs[i], codes[i] [outs[i], K] uint8, scales[i] / biases[i] [outs[i], K/64] float32. K % 64 == 0.
 * Returns 0, or -1 when K is not a multiple of 64 or a buffer cannot be allocated. */
int stoa_qmatmul(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                 const float *const *scales, const float *const *biases, const int64_t *outs,
                 float *y, int64_t ldy, int threads) {
    if (K % GROUP != 0 || n <= 0 || m <= 0) return -1;
    reduce_init();
    const int64_t P = panel_width(K);
    int64_t npanels, *pm, *col;
    if (plan(m, outs, P, &npanels, &pm, &col)) return -1;
    int failed = 0;
    if (threads < 1) threads = 1;
    if (n < RT) {
        const int64_t G = K / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < npanels; p++) {
            const int i = (int)pm[2 * p];
            const int64_t o0 = pm[2 * p + 1];
            const int64_t no = outs[i] - o0 < P ? outs[i] - o0 : P;
            for (int64_t o = 0; o < no; o += OT) {
                const int nn = no - o < OT ? (int)(no - o) : OT;
                few_rows(x, K, (int)n, codes[i] + (o0 + o) * K, scales[i] + (o0 + o) * G, biases[i] + (o0 + o) * G,
                         nn, y + col[i] + o0 + o, ldy);
            }
        }
        free(pm);
        free(col);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = aligned_alloc(64, (size_t)(P * K * 4 + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npanels; p++) {
            if (!buf) continue;
            const int i = (int)pm[2 * p];
            const int64_t o0 = pm[2 * p + 1];
            const int64_t no = outs[i] - o0 < P ? outs[i] - o0 : P;
            const int64_t G = K / GROUP;
            for (int64_t o = 0; o < no; o++)
                dequant_row(codes[i] + (o0 + o) * K, scales[i] + (o0 + o) * G, biases[i] + (o0 + o) * G, K,
                            buf + o * K);
            for (int64_t r = 0; r < n; r += RT) {
                const int nr = n - r < RT ? (int)(n - r) : RT;
                for (int64_t o = 0; o < no; o += OT) {
                    const int nn = no - o < OT ? (int)(no - o) : OT;
                    tile(x + r * K, K, buf + o * K, K, nr, nn, y + r * ldy + col[i] + o0 + o, ldy);
                }
            }
        }
        free(buf);
    }
    free(pm);
    free(col);
    return failed ? -1 : 0;
}

/* The vector width this build uses (for the loader's report). */
int stoa_qmatmul_width(void) { return VL; }

/* ---- the integer path (AVX-512 VNNI) ------------------------------------------------------------ */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QMAX 32639 /* |q| <= QMAX: q = 256 * hi + lo with hi in [-127, 127] and lo in [-128, 127] */
#define IRT 4      /* rows per tile */
#define IOB 2      /* blocks of 16 outputs per tile */

typedef int32_t vd __attribute__((vector_size(64)));

/* a[i] lane l <-> a[l] lane i for 16 vectors of 16 dwords: at level k, the entries whose row and lane
 * differ in bit k swap (four levels of two-source shuffles). */
static inline __attribute__((always_inline)) void transpose16(vd *a) {
    for (int k = 0; k < 4; k++) {
        const int B = 1 << k;
        vd m0, m1;
        for (int l = 0; l < 16; l++) {
            m0[l] = (l & B) ? 16 + (l ^ B) : l;
            m1[l] = (l & B) ? 16 + l : (l ^ B);
        }
        for (int i = 0; i < 16; i++)
            if (!(i & B)) {
                const vd x = a[i], y = a[i | B];
                a[i] = __builtin_shuffle(x, y, m0);
                a[i | B] = __builtin_shuffle(x, y, m1);
            }
    }
}

/* A block of 16 outputs (no <= 16 real ones; the rest read as zero): pc[g][t] = the 16 outputs' codes
 * 4t .. 4t+3 of group g (one dword per output: what vpdpbusd multiplies lane by lane), ps[g] / pb[g]
 * = their scales / biases. The next block's lines are prefetched: the codes are read 16 rows at a
 * time, which the hardware prefetcher does not follow. */
static void pack_block(const uint8_t *code, const float *scale, const float *bias, int64_t K, int no,
                       uint8_t *pc, float *ps, float *pb) {
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        vd a[16];
        for (int j = 0; j < 16; j++) _mm_prefetch((const char *)(code + (16 + j) * K + g * GROUP), _MM_HINT_T0);
        for (int j = 0; j < 16; j++) {
            if (j < no) memcpy(&a[j], code + j * K + g * GROUP, 64);
            else a[j] = (vd){0};
        }
        transpose16(a);
        memcpy(pc + g * 1024, a, 1024);
        for (int j = 0; j < 16; j++) {
            ps[g * 16 + j] = j < no ? scale[j * G + g] : 0.f;
            pb[g * 16 + j] = j < no ? bias[j * G + g] : 0.f;
        }
    }
}

/* Row r's digits: xh / xl [n][K] int8 (q = 256 * xh + xl), sx [n][G] its groups' scales and
 * cb [n][G] = sx * sum q. A group holding an infinity or NaN gets sx = NaN (its outputs are NaN). */
static void quantize_rows(const float *x, int64_t n, int64_t K, int8_t *xh, int8_t *xl, float *sx, float *cb) {
    const int64_t G = K / GROUP;
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *p = x + r * K + g * GROUP;
            __m512 m = _mm512_setzero_ps();
            for (int j = 0; j < GROUP; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(p + j)));
            const float mx = _mm512_reduce_max_ps(m);
            float s = 0.f, inv = 0.f;
            if (!(mx <= 3.4028235e38f)) s = NAN;
            else if (mx > 0.f) { s = mx / (float)QMAX; inv = (float)QMAX / mx; }
            __m512i qs = _mm512_setzero_si512();
            for (int j = 0; j < GROUP; j += 16) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + j), _mm512_set1_ps(inv)));
                q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(QMAX)), _mm512_set1_epi32(-QMAX));
                qs = _mm512_add_epi32(qs, q);
                const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
                const __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
                _mm_storeu_si128((__m128i *)(xh + r * K + g * GROUP + j), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i *)(xl + r * K + g * GROUP + j), _mm512_cvtepi32_epi8(lo));
            }
            sx[r * G + g] = s;
            cb[r * G + g] = s * (float)_mm512_reduce_add_epi32(qs);
        }
}

/* Rows 0 .. nr-1 (nr <= IRT) times packed blocks 0 .. nb-1 (nb <= IOB; valid[b] real outputs each).
 * Per group: two int32 dot products per (row, output) (high and low digits), then the float32
 * epilogue, in group order, whatever the tile: a result does not depend on the tiling. */
static inline __attribute__((always_inline)) void
itile_body(const int8_t *xh, const int8_t *xl, const float *sx, const float *cb, int64_t K, const int nr,
           const int nb, const uint8_t *pc, const float *ps, const float *pb, float *y, int64_t ldy,
           const int *valid) {
    const int64_t G = K / GROUP, bc = K * 16, bs = K / 4; /* a block's bytes of codes, floats of scales */
    __m512 acc[IRT][IOB];
    for (int r = 0; r < IRT; r++)
        for (int b = 0; b < IOB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i ah[IRT][IOB], al[IRT][IOB];
        for (int r = 0; r < IRT; r++)
            for (int b = 0; b < IOB; b++) ah[r][b] = al[r][b] = _mm512_setzero_si512();
        for (int t = 0; t < 16; t++) {
            __m512i c[IOB];
            for (int b = 0; b < nb; b++) c[b] = _mm512_loadu_si512(pc + b * bc + g * 1024 + t * 64);
            for (int r = 0; r < nr; r++) {
                int32_t h, l;
                memcpy(&h, xh + r * K + g * GROUP + 4 * t, 4);
                memcpy(&l, xl + r * K + g * GROUP + 4 * t, 4);
                const __m512i bh = _mm512_set1_epi32(h), bl = _mm512_set1_epi32(l);
                for (int b = 0; b < nb; b++) {
                    ah[r][b] = _mm512_dpbusd_epi32(ah[r][b], c[b], bh);
                    al[r][b] = _mm512_dpbusd_epi32(al[r][b], c[b], bl);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            const __m512 s = _mm512_set1_ps(sx[r * G + g]), q = _mm512_set1_ps(cb[r * G + g]);
            for (int b = 0; b < nb; b++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah[r][b], 8), al[r][b]));
                acc[r][b] = _mm512_fmadd_ps(dot, _mm512_mul_ps(_mm512_loadu_ps(ps + b * bs + g * 16), s), acc[r][b]);
                acc[r][b] = _mm512_fmadd_ps(_mm512_loadu_ps(pb + b * bs + g * 16), q, acc[r][b]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int b = 0; b < nb; b++)
            _mm512_mask_storeu_ps(y + r * ldy + b * 16, (__mmask16)((1u << valid[b]) - 1u), acc[r][b]);
}

/* The body with constant counts (accumulators in registers, as tile()). */
static void itile(const int8_t *xh, const int8_t *xl, const float *sx, const float *cb, int64_t K, int nr, int nb,
                  const uint8_t *pc, const float *ps, const float *pb, float *y, int64_t ldy, const int *valid) {
#define ICASE(R, B) itile_body(xh, xl, sx, cb, K, R, B, pc, ps, pb, y, ldy, valid); return
    if (nb == IOB) {
        switch (nr) { case 4: ICASE(4, IOB); case 3: ICASE(3, IOB); case 2: ICASE(2, IOB); default: ICASE(1, IOB); }
    }
    switch (nr) { case 4: ICASE(4, 1); case 3: ICASE(3, 1); case 2: ICASE(2, 1); default: ICASE(1, 1); }
#undef ICASE
}

/* Few rows (n < IRT): no packing; a row's group of 64 codes times its 64 digits is one vpdpbusd
 * (lanes over inputs), and a tree sums 16 outputs' lanes at once (reduce_tree, in integers: exact).
 * The float32 epilogue is the tiles' own, lane for lane, so the results are bit for bit theirs. */
static inline __attribute__((always_inline)) void
ifew_body(const int8_t *xh, const int8_t *xl, const float *sx, const float *cb, int64_t K, const int nr,
          const uint8_t *code, const float *scale, const float *bias, int no, float *y, int64_t ldy) {
    const int64_t G = K / GROUP;
    int idx[16];
    __mmask16 live = 0;
    for (int j = 0; j < 16; j++) {
        idx[j] = lane_of[j] * (int)G;
        if (lane_of[j] < no) live |= (__mmask16)(1u << j);
    }
    const __m512i base = _mm512_loadu_si512(idx), z = _mm512_setzero_si512();
    __m512 acc[IRT - 1];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int o = 0; o < 16; o++) _mm_prefetch((const char *)(code + (16 + o) * K + g * GROUP), _MM_HINT_T0);
        vi t[IRT - 1][16];
        for (int o = 0; o < 16; o++) {
            if (o >= no) {
                for (int r = 0; r < nr; r++) t[r][o] = (vi){0};
                continue;
            }
            const __m512i c = _mm512_loadu_si512(code + o * K + g * GROUP);
            for (int r = 0; r < nr; r++) {
                const __m512i h = _mm512_loadu_si512(xh + r * K + g * GROUP), l = _mm512_loadu_si512(xl + r * K + g * GROUP);
                t[r][o] = (vi)_mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, c, h), 8), _mm512_dpbusd_epi32(z, c, l));
            }
        }
        const __m512i at = _mm512_add_epi32(base, _mm512_set1_epi32((int)g));
        const __m512 ps = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, scale, 4);
        const __m512 pb = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, bias, 4);
        for (int r = 0; r < nr; r++) {
            reduce_tree_i(t[r]);
            const __m512 dot = _mm512_cvtepi32_ps((__m512i)t[r][0]);
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ps, _mm512_set1_ps(sx[r * G + g])), acc[r]);
            acc[r] = _mm512_fmadd_ps(pb, _mm512_set1_ps(cb[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float out[16];
        _mm512_storeu_ps(out, acc[r]);
        for (int j = 0; j < 16; j++)
            if (lane_of[j] < no) y[r * ldy + lane_of[j]] = out[j];
    }
}

static void ifew_rows(const int8_t *xh, const int8_t *xl, const float *sx, const float *cb, int64_t K, int nr,
                      const uint8_t *code, const float *scale, const float *bias, int no, float *y, int64_t ldy) {
    switch (nr) {
    case 3: ifew_body(xh, xl, sx, cb, K, 3, code, scale, bias, no, y, ldy); return;
    case 2: ifew_body(xh, xl, sx, cb, K, 2, code, scale, bias, no, y, ldy); return;
    default: ifew_body(xh, xl, sx, cb, K, 1, code, scale, bias, no, y, ldy); return;
    }
}

/* As stoa_qmatmul, on the integer path. Returns -2 when this build has none (no AVX-512 VNNI). */
int stoa_qmatmul_int(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                     const float *const *scales, const float *const *biases, const int64_t *outs,
                     float *y, int64_t ldy, int threads) {
    if (K % GROUP != 0 || n <= 0 || m <= 0) return -1;
    const int64_t G = K / GROUP, bc = K * 16, bs = K / 4;
    int64_t P = (256 * 1024) / K / 16 * 16; /* outputs whose packed codes fill ~256 KB */
    if (P < 16) P = 16;
    int64_t npanels, *pm, *col;
    if (plan(m, outs, P, &npanels, &pm, &col)) return -1;
    int8_t *xh = malloc(n * K), *xl = malloc(n * K);
    float *sx = malloc(n * G * 4), *cb = malloc(n * G * 4);
    int failed = !xh || !xl || !sx || !cb;
    if (!failed) quantize_rows(x, n, K, xh, xl, sx, cb);
    if (threads < 1) threads = 1;
    reduce_init();
    if (n < IRT && !failed) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < npanels; p++) {
            const int i = (int)pm[2 * p];
            const int64_t o0 = pm[2 * p + 1];
            const int64_t no = outs[i] - o0 < P ? outs[i] - o0 : P;
            for (int64_t o = 0; o < no; o += 16)
                ifew_rows(xh, xl, sx, cb, K, (int)n, codes[i] + (o0 + o) * K, scales[i] + (o0 + o) * G,
                          biases[i] + (o0 + o) * G, no - o < 16 ? (int)(no - o) : 16, y + col[i] + o0 + o, ldy);
        }
        free(pm); free(col); free(xh); free(xl); free(sx); free(cb);
        return 0;
    }
#pragma omp parallel num_threads(threads) if (!failed)
    {
        uint8_t *pc = aligned_alloc(64, P * K);
        float *ps = aligned_alloc(64, P * G * 4), *pb = aligned_alloc(64, P * G * 4);
        const int ok = !failed && pc && ps && pb;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npanels; p++) {
            if (!ok) continue;
            const int i = (int)pm[2 * p];
            const int64_t o0 = pm[2 * p + 1];
            const int64_t no = outs[i] - o0 < P ? outs[i] - o0 : P;
            const int64_t nblocks = (no + 15) / 16;
            for (int64_t b = 0; b < nblocks; b++)
                pack_block(codes[i] + (o0 + b * 16) * K, scales[i] + (o0 + b * 16) * G, biases[i] + (o0 + b * 16) * G,
                           K, no - b * 16 < 16 ? (int)(no - b * 16) : 16, pc + b * bc, ps + b * bs, pb + b * bs);
            for (int64_t r = 0; r < n; r += IRT) {
                const int nr = n - r < IRT ? (int)(n - r) : IRT;
                for (int64_t b = 0; b < nblocks; b += IOB) {
                    const int nb = nblocks - b < IOB ? (int)(nblocks - b) : IOB;
                    int valid[IOB];
                    for (int v = 0; v < IOB; v++) {
                        const int64_t left = no - (b + v) * 16;
                        valid[v] = left >= 16 ? 16 : (left > 0 ? (int)left : 0);
                    }
                    itile(xh + r * K, xl + r * K, sx + r * G, cb + r * G, K, nr, nb, pc + b * bc, ps + b * bs,
                          pb + b * bs, y + r * ldy + col[i] + o0 + b * 16, ldy, valid);
                }
            }
        }
        free(pc); free(ps); free(pb);
    }
    free(pm); free(col); free(xh); free(xl); free(sx); free(cb);
    return failed ? -1 : 0;
}
#else
int stoa_qmatmul_int(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                     const float *const *scales, const float *const *biases, const int64_t *outs,
                     float *y, int64_t ldy, int threads) {
    (void)x; (void)n; (void)K; (void)m; (void)codes; (void)scales; (void)biases; (void)outs; (void)y; (void)ldy;
    (void)threads;
    return -2;
}
#endif

/* Whether this build has the integer path. */
int stoa_qmatmul_has_int(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}
