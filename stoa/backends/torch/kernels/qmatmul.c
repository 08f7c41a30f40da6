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
 * stoa_qmatmul_int (the `int24` and `int16` modes; x86 with AVX-512 VNNI, and with AVX2 the same bits
 * from 16-bit products in qmatmul_avx2.c): each row of x is rounded,
 * per group of 64 inputs, to 24- or 16-bit integers q on a scale sx = max|x| / qmax, and
 * sum_k code_k * q_k is exact integer arithmetic (int8 dot products, one per byte of q: the CPU's
 * fastest multiply); then, per group, in float32, y += float(that sum) * (scale * sx) and
 * y += bias * (sx * sum_k q_k). The weights are the weights of record; the inputs carry an error of
 * at most 6e-8 (24-bit) or 1.5e-5 (16-bit) of their group's largest entry.
 *
 * Both are batch-invariant: a row's result does not depend on its neighbours, the batch size or the
 * threads. Several matrices with the same input width can be one call (q|k|v, gate|up): their
 * outputs are laid side by side in y's rows. Portable C with GCC/Clang vector extensions: the vector
 * width follows the target (16 floats with AVX-512, 8 with AVX2, 4 with NEON on 64-bit ARM), threads
 * are OpenMP's.
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

#if VL == 8
#define RT 2 /* rows per tile: AVX2's 16 registers hold 2 x 4 accumulators */
#define OT 4 /* outputs per tile */
#else
#define RT 4 /* AVX-512's and NEON's 32 registers hold 4 x 4 */
#define OT 4
#endif
#if VL % OT || RT % (VL / OT)
#error "a tile's accumulators must fill whole reduction trees"
#endif

typedef uint8_t vb __attribute__((vector_size(VL)));

/* VL codes as floats (exact: 0 .. 255). GCC turns the generic conversion into byte-by-byte
 * inserts, so x86 and ARM get their widening loads. */
static inline vf codes_f(const uint8_t *p) {
#if defined(STOA_AVX512)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(STOA_AVX2)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif defined(STOA_NEON)
    uint32_t w;
    memcpy(&w, p, 4);
    return (vf)vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w))))));
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

/* Writes the nr x no results of a tile's accumulators to y, VL / OT rows per reduction tree. The
 * tree sums each accumulator's lanes in one fixed order whatever the others hold, so a row's result
 * does not depend on its neighbours in the tile, the batch size or the threads. */
static inline __attribute__((always_inline)) void
store_tile(vf acc[RT][OT], const int nr, const int no, float *y, int64_t ldy) {
    enum { TR = VL / OT };
    for (int r0 = 0; r0 < RT; r0 += TR) {
        vf a[VL];
        for (int r = 0; r < TR; r++)
            for (int o = 0; o < OT; o++) a[r * OT + o] = acc[r0 + r][o];
        reduce_tree(a);
        for (int j = 0; j < VL; j++) {
            const int i = lane_of[j], r = r0 + i / OT, o = i % OT;
            if (r < nr && o < no) y[r * ldy + o] = a[0][j];
        }
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

/* Few rows (n < FEW): no panel buffer; each weight is dequantized in registers (dequant_vec) and
 * used at once, and the next outputs' codes are prefetched (the hardware prefetcher does not follow
 * OT short rows read side by side: without it one row ran at half the memory's speed). Same
 * accumulation order per (row, output) as tile(): the results are bit for bit those of the buffered
 * path. */
#ifndef FEW
#if VL == 8
#define FEW 9 /* fewer rows than this take this path (AVX2: up to 8 rows beat the buffered path's tiles) */
#else
#define FEW 4
#endif
#endif
#define FC 3 /* rows at a time */

static inline __attribute__((always_inline)) void
few_rows_body(const float *x, int64_t K, const int nr, const uint8_t *code, const float *scale, const float *bias,
              const int no, float *y, int64_t ldy) {
    enum { FR = 4 }; /* FC rows in whole tiles of RT rows, for store_tile */
    vf acc[FR][OT];
    for (int r = 0; r < FR; r++)
        for (int o = 0; o < OT; o++) acc[r][o] = (vf){0};
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        for (int o = 0; o < OT; o++) __builtin_prefetch(code + (OT + o) * K + g * GROUP);
        for (int64_t j = 0; j < GROUP; j += VL) {
            const int64_t k = g * GROUP + j;
            for (int o = 0; o < no; o++) {
                vf w = dequant_vec(code + o * K + k, scale[o * G + g], bias[o * G + g]);
                for (int r = 0; r < nr; r++) acc[r][o] = fmadd(loadf(x + r * K + k), w, acc[r][o]);
            }
        }
    }
    for (int r = 0; r < nr; r += RT) store_tile(&acc[r], nr - r < RT ? nr - r : RT, no, y + r * ldy, ldy);
}

/* As tile(): constant counts keep the accumulators in registers. */
static void few_rows(const float *x, int64_t K, int nr, const uint8_t *code, const float *scale,
                     const float *bias, int no, float *y, int64_t ldy) {
    if (no == OT) {
        switch (nr) {
        case 1: few_rows_body(x, K, 1, code, scale, bias, OT, y, ldy); return;
        case 2: few_rows_body(x, K, 2, code, scale, bias, OT, y, ldy); return;
        case 3: few_rows_body(x, K, 3, code, scale, bias, OT, y, ldy); return;
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
    if (n < FEW) { /* blocks of OT outputs split evenly over the threads; rows FC at a time */
        const int64_t G = K / GROUP;
        int64_t nblk = 0;
        for (int i = 0; i < m; i++) nblk += (outs[i] + OT - 1) / OT;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            int i = 0;
            int64_t o = b;
            while (i < m - 1 && o >= (outs[i] + OT - 1) / OT) o -= (outs[i++] + OT - 1) / OT;
            o *= OT;
            const int nn = outs[i] - o < OT ? (int)(outs[i] - o) : OT;
            for (int64_t r = 0; r < n; r += FC)
                few_rows(x + r * K, K, n - r < FC ? (int)(n - r) : FC, codes[i] + o * K, scales[i] + o * G,
                         biases[i] + o * G, nn, y + r * ldy + col[i] + o, ldy);
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

#if defined(STOA_AVX512) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IOB 2 /* blocks of 16 outputs per tile; rows per tile: irt(D) */

/* Inputs are rounded to D signed bytes (D = 2: 16-bit, D = 3: 24-bit integers), |q| <= qmax(D), so
 * that q = sum_i 256^(D-1-i) digit_i with every digit in [-128, 127] and the first in [-127, 127]. */
static inline int qmax(int D) { return D == 2 ? 32639 : 8355711; }
static inline int irt(int D) { return D == 2 ? 4 : 3; } /* rows per tile: D * irt * IOB int32 accumulators */

typedef int32_t vd __attribute__((vector_size(64)));

/* a[i] lane l <-> a[l] lane i for 16 vectors of 16 dwords: at level k, the entries whose row and lane
 * differ in bit k swap (four levels of two-source shuffles). */
static inline __attribute__((always_inline)) void transpose16(vd *a) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) { /* unrolled, so the shuffle masks are constants */
        const int B = 1 << k;
        vd m0, m1;
#pragma GCC unroll 16
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

/* Row r's digits: xd[i][r][k] int8 (digit i of q, most significant first, D digits), sx [n][G] its
 * groups' scales and cb [n][G] = sx * sum q. A group holding an infinity or NaN gets sx = NaN (its
 * outputs are NaN). */
static void quantize_rows(const float *x, int64_t n, int64_t K, int D, int8_t *xd, float *sx, float *cb) {
    const int64_t G = K / GROUP;
    const int Q = qmax(D);
    const __m512i c128 = _mm512_set1_epi32(128), m255 = _mm512_set1_epi32(255);
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *p = x + r * K + g * GROUP;
            __m512 m = _mm512_setzero_ps();
            __mmask16 nan = 0; /* max_ps drops a NaN operand: it is looked for on its own */
            for (int j = 0; j < GROUP; j += 16) {
                const __m512 v = _mm512_loadu_ps(p + j);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                m = _mm512_max_ps(m, _mm512_abs_ps(v));
            }
            const float mx = _mm512_reduce_max_ps(m);
            float s = 0.f, inv = 0.f;
            if (nan || !(mx <= 3.4028235e38f)) s = NAN;
            else if (mx > 0.f) { s = mx / (float)Q; inv = (float)Q / mx; }
            __m512i qs = _mm512_setzero_si512();
            for (int j = 0; j < GROUP; j += 16) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + j), _mm512_set1_ps(inv)));
                q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(Q)), _mm512_set1_epi32(-Q));
                qs = _mm512_add_epi32(qs, q);
                for (int i = D - 1; i >= 0; i--) { /* balanced base 256, least significant first */
                    const __m512i d = i ? _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, c128), m255), c128) : q;
                    _mm_storeu_si128((__m128i *)(xd + (i * n + r) * K + g * GROUP + j), _mm512_cvtepi32_epi8(d));
                    q = _mm512_srai_epi32(_mm512_sub_epi32(q, d), 8);
                }
            }
            sx[r * G + g] = s;
            cb[r * G + g] = s * (float)_mm512_reduce_add_epi32(qs);
        }
}

/* A group's dot products as one float per lane, from the digits' exact int32 sums a[0 .. D-1]
 * (most significant first): D = 2 sums exactly in int32; D = 3 adds the top digit's sum in float. */
static inline __attribute__((always_inline)) __m512 group_dot(const __m512i *a, const int D) {
    if (D == 2) return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(a[0], 8), a[1]));
    const __m512i low = _mm512_add_epi32(_mm512_slli_epi32(a[1], 8), a[2]);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[0]), _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(low));
}

/* Rows 0 .. nr-1 (nr <= irt(D)) times packed blocks 0 .. nb-1 (nb <= IOB; valid[b] real outputs each);
 * xd: the rows' first digit plane, the next ones dstride bytes apart. Per group: one int32 dot
 * product per digit and (row, output), then the float32 epilogue, in group order, whatever the
 * tile: a result does not depend on the tiling. */
static inline __attribute__((always_inline)) void
itile_body(const int8_t *xd, int64_t dstride, const float *sx, const float *cb, int64_t K, const int D, const int nr,
           const int nb, const uint8_t *pc, const float *ps, const float *pb, float *y, int64_t ldy,
           const int *valid) {
    const int64_t G = K / GROUP, bc = K * 16, bs = K / 4; /* a block's bytes of codes, floats of scales */
    __m512 acc[4][IOB];
    const int8_t *xr[4][3]; /* row r's digit plane i */
    for (int r = 0; r < nr; r++) {
        for (int b = 0; b < nb; b++) acc[r][b] = _mm512_setzero_ps();
        for (int i = 0; i < D; i++) xr[r][i] = xd + i * dstride + r * K;
    }
    for (int64_t g = 0; g < G; g++) {
        __m512i a[4][IOB][3];
        for (int r = 0; r < nr; r++)
            for (int b = 0; b < nb; b++)
                for (int i = 0; i < D; i++) a[r][b][i] = _mm512_setzero_si512();
        for (int t = 0; t < 16; t++) {
            __m512i c[IOB];
            for (int b = 0; b < nb; b++) c[b] = _mm512_loadu_si512(pc + b * bc + g * 1024 + t * 64);
            for (int r = 0; r < nr; r++)
                for (int i = 0; i < D; i++) {
                    int32_t w;
                    memcpy(&w, xr[r][i] + g * GROUP + 4 * t, 4);
                    const __m512i x = _mm512_set1_epi32(w);
                    for (int b = 0; b < nb; b++) a[r][b][i] = _mm512_dpbusd_epi32(a[r][b][i], c[b], x);
                }
        }
        for (int r = 0; r < nr; r++) {
            const __m512 s = _mm512_set1_ps(sx[r * G + g]), q = _mm512_set1_ps(cb[r * G + g]);
            for (int b = 0; b < nb; b++) {
                acc[r][b] = _mm512_fmadd_ps(group_dot(a[r][b], D), _mm512_mul_ps(_mm512_loadu_ps(ps + b * bs + g * 16), s),
                                            acc[r][b]);
                acc[r][b] = _mm512_fmadd_ps(_mm512_loadu_ps(pb + b * bs + g * 16), q, acc[r][b]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int b = 0; b < nb; b++)
            _mm512_mask_storeu_ps(y + r * ldy + b * 16, (__mmask16)((1u << valid[b]) - 1u), acc[r][b]);
}

/* The body with constant counts (accumulators in registers, as tile()). */
static void itile(const int8_t *xd, int64_t dstride, const float *sx, const float *cb, int64_t K, int D, int nr,
                  int nb, const uint8_t *pc, const float *ps, const float *pb, float *y, int64_t ldy, const int *valid) {
#define ICASE(DD, R, B) itile_body(xd, dstride, sx, cb, K, DD, R, B, pc, ps, pb, y, ldy, valid); return
    if (D == 2) {
        if (nb == IOB) switch (nr) { case 4: ICASE(2, 4, IOB); case 3: ICASE(2, 3, IOB); case 2: ICASE(2, 2, IOB); default: ICASE(2, 1, IOB); }
        switch (nr) { case 4: ICASE(2, 4, 1); case 3: ICASE(2, 3, 1); case 2: ICASE(2, 2, 1); default: ICASE(2, 1, 1); }
    }
    if (nb == IOB) switch (nr) { case 3: ICASE(3, 3, IOB); case 2: ICASE(3, 2, IOB); default: ICASE(3, 1, IOB); }
    switch (nr) { case 3: ICASE(3, 3, 1); case 2: ICASE(3, 2, 1); default: ICASE(3, 1, 1); }
#undef ICASE
}

/* Few rows (fewer than a tile's): no packing; a row's group of 64 codes times one digit's 64 bytes is
 * one vpdpbusd (lanes over inputs), and a tree sums 16 outputs' lanes at once (reduce_tree_i: exact).
 * The float32 epilogue is the tiles' own, lane for lane, so the results are bit for bit theirs. */
static inline __attribute__((always_inline)) void
ifew_body(const int8_t *xd, int64_t dstride, const float *sx, const float *cb, int64_t K, const int D, const int nr,
          const uint8_t *code, const float *scale, const float *bias, int no, float *y, int64_t ldy) {
    const int64_t G = K / GROUP;
    int idx[16];
    __mmask16 live = 0;
    for (int j = 0; j < 16; j++) {
        idx[j] = lane_of[j] * (int)G;
        if (lane_of[j] < no) live |= (__mmask16)(1u << j);
    }
    const __m512i base = _mm512_loadu_si512(idx), z = _mm512_setzero_si512();
    __m512 acc[3];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int o = 0; o < 16; o++) _mm_prefetch((const char *)(code + (16 + o) * K + g * GROUP), _MM_HINT_T0);
        vi t[3][2][16]; /* per row: the top digit's sums (D = 3) and the rest's, exact */
        for (int o = 0; o < 16; o++) {
            if (o >= no) {
                for (int r = 0; r < nr; r++) t[r][0][o] = t[r][1][o] = (vi){0};
                continue;
            }
            const __m512i c = _mm512_loadu_si512(code + o * K + g * GROUP);
            for (int r = 0; r < nr; r++) {
                __m512i d[3];
                for (int i = 0; i < D; i++)
                    d[i] = _mm512_dpbusd_epi32(z, c, _mm512_loadu_si512(xd + i * dstride + r * K + g * GROUP));
                t[r][0][o] = (vi)d[0];
                t[r][1][o] = (vi)_mm512_add_epi32(_mm512_slli_epi32(d[D - 2], 8), d[D - 1]);
            }
        }
        const __m512i at = _mm512_add_epi32(base, _mm512_set1_epi32((int)g));
        const __m512 ps = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, scale, 4);
        const __m512 pb = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, bias, 4);
        for (int r = 0; r < nr; r++) {
            __m512i sums[3];
            reduce_tree_i(t[r][1]);
            if (D == 3) {
                reduce_tree_i(t[r][0]);
                sums[0] = (__m512i)t[r][0][0];
                sums[1] = _mm512_setzero_si512(); /* group_dot(D = 3) takes (top, middle, low) */
                sums[2] = (__m512i)t[r][1][0];
            } else {
                sums[0] = _mm512_setzero_si512();
                sums[1] = (__m512i)t[r][1][0];
            }
            const __m512 dot = group_dot(sums, D);
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

static void ifew_rows(const int8_t *xd, int64_t dstride, const float *sx, const float *cb, int64_t K, int D, int nr,
                      const uint8_t *code, const float *scale, const float *bias, int no, float *y, int64_t ldy) {
#define FCASE(DD, R) ifew_body(xd, dstride, sx, cb, K, DD, R, code, scale, bias, no, y, ldy); return
    if (D == 2) switch (nr) { case 3: FCASE(2, 3); case 2: FCASE(2, 2); default: FCASE(2, 1); }
    switch (nr) { case 2: FCASE(3, 2); default: FCASE(3, 1); }
#undef FCASE
}

/* As stoa_qmatmul, on the integer path with inputs of `digits` bytes (2 or 3). Returns -2 when this
 * build has none (no AVX-512 VNNI), -1 for a bad argument or when out of memory. */
int stoa_qmatmul_int(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                     const float *const *scales, const float *const *biases, const int64_t *outs,
                     float *y, int64_t ldy, int threads, int digits) {
    if (K % GROUP != 0 || n <= 0 || m <= 0 || (digits != 2 && digits != 3)) return -1;
    const int D = digits, RTI = irt(D);
    const int64_t G = K / GROUP, bc = K * 16, bs = K / 4;
    int64_t P = (256 * 1024) / K / 16 * 16; /* outputs whose packed codes fill ~256 KB */
    if (P < 16) P = 16;
    int64_t npanels, *pm, *col;
    if (plan(m, outs, P, &npanels, &pm, &col)) return -1;
    int8_t *xd = malloc(D * n * K);
    float *sx = malloc(n * G * 4), *cb = malloc(n * G * 4);
    int failed = !xd || !sx || !cb;
    if (!failed) quantize_rows(x, n, K, D, xd, sx, cb);
    if (threads < 1) threads = 1;
    reduce_init();
    if (n < RTI && !failed) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < npanels; p++) {
            const int i = (int)pm[2 * p];
            const int64_t o0 = pm[2 * p + 1];
            const int64_t no = outs[i] - o0 < P ? outs[i] - o0 : P;
            for (int64_t o = 0; o < no; o += 16)
                ifew_rows(xd, n * K, sx, cb, K, D, (int)n, codes[i] + (o0 + o) * K, scales[i] + (o0 + o) * G,
                          biases[i] + (o0 + o) * G, no - o < 16 ? (int)(no - o) : 16, y + col[i] + o0 + o, ldy);
        }
        free(pm); free(col); free(xd); free(sx); free(cb);
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
            for (int64_t r = 0; r < n; r += RTI) {
                const int nr = n - r < RTI ? (int)(n - r) : RTI;
                for (int64_t b = 0; b < nblocks; b += IOB) {
                    const int nb = nblocks - b < IOB ? (int)(nblocks - b) : IOB;
                    int valid[IOB];
                    for (int v = 0; v < IOB; v++) {
                        const int64_t left = no - (b + v) * 16;
                        valid[v] = left >= 16 ? 16 : (left > 0 ? (int)left : 0);
                    }
                    itile(xd + r * K, n * K, sx + r * G, cb + r * G, K, D, nr, nb, pc + b * bc, ps + b * bs,
                          pb + b * bs, y + r * ldy + col[i] + o0 + b * 16, ldy, valid);
                }
            }
        }
        free(pc); free(ps); free(pb);
    }
    free(pm); free(col); free(xd); free(sx); free(cb);
    return failed ? -1 : 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
int stoa_qmatmul_int_avx2(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                          const float *const *scales, const float *const *biases, const int64_t *outs,
                          float *y, int64_t ldy, int threads, int digits);

/* Without VNNI: the same results from 16-bit products (qmatmul_avx2.c). */
int stoa_qmatmul_int(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                     const float *const *scales, const float *const *biases, const int64_t *outs,
                     float *y, int64_t ldy, int threads, int digits) {
    return stoa_qmatmul_int_avx2(x, n, K, m, codes, scales, biases, outs, y, ldy, threads, digits);
}
#else
int stoa_qmatmul_int(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                     const float *const *scales, const float *const *biases, const int64_t *outs,
                     float *y, int64_t ldy, int threads, int digits) {
    (void)x; (void)n; (void)K; (void)m; (void)codes; (void)scales; (void)biases; (void)outs; (void)y; (void)ldy;
    (void)threads; (void)digits;
    return -2;
}
#endif

/* Which integer path this build has: 0 none, 1 AVX-512 VNNI (byte products), 2 AVX2 (16-bit products). */
int stoa_qmatmul_has_int(void) {
#if defined(STOA_AVX512) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#elif defined(__AVX2__) && defined(__FMA__)
    return 2;
#else
    return 0;
#endif
}
