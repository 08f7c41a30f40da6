/* y = x @ W^T for int8 weights of record, W = code * scale + bias per group of 64 inputs.
 *
 * The rollout engine's CPU matmul (stoa.backends.torch.qlinear builds and loads it). Every weight is
 * dequantized exactly as the weights of record are (float32 `code * scale` rounded, then `+ bias`
 * rounded: no fused multiply-add there), into a panel buffer that stays in cache, and the products
 * are float32 multiply-adds on it; so the kernel computes what a float32 matmul on the dequantized
 * matrix computes, up to the order of the sums, while reading one byte per weight from memory
 * instead of four.
 *
 * Several matrices with the same input width can be one call (q|k|v, gate|up): their outputs are
 * laid side by side in y's rows. Portable C with GCC/Clang vector extensions: the vector width
 * follows the target (16 floats with AVX-512, 8 with AVX2 or NEON-sized targets), threads are
 * OpenMP's.
 */
/* Build with -ffp-contract=off (GCC ignores the pragma): `code * scale + bias` must round twice,
 * as the weights of record do; the products' sums use explicit fused multiply-adds (fmadd). */
#pragma STDC FP_CONTRACT OFF
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define GROUP 64

#if defined(__AVX512F__)
#define VL 16
#define RT 4 /* rows per tile */
#define OT 4 /* outputs per tile */
#else
#define VL 8
#define RT 2
#define OT 4 /* RT * OT == VL: one reduction tree per tile */
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint8_t vb __attribute__((vector_size(VL)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf fmadd(vf a, vf b, vf c) { /* a * b + c, rounded once where the CPU can */
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

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

static inline vf loadf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Horizontal sums of VL accumulators at once: a tree of VL - 1 shuffle-and-add steps whose lane j
 * ends up holding the sum of accumulator lane_of[j] (found once, by running the tree on one-hot
 * inputs). Cheaper than VL separate horizontal sums. */
static vi lo_mask[5], hi_mask[5];
static int lane_of[VL];
static int reduce_ready = 0;

static void reduce_tree(vf *a) { /* a[0 .. VL-1] -> a[0] */
    int count = VL, level = 0;
    for (int B = VL / 2; B >= 1; B /= 2, level++) {
        for (int i = 0; i < count / 2; i++)
            a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo_mask[level]) +
                   __builtin_shuffle(a[2 * i], a[2 * i + 1], hi_mask[level]);
        count /= 2;
    }
}

static void reduce_init(void) {
    if (reduce_ready) return;
    int level = 0;
    for (int B = VL / 2; B >= 1; B /= 2, level++) {
        const int per = VL / (2 * B); /* blocks of 2B lanes in each input vector */
        for (int t = 0; t < VL; t++) {
            int q = t / B, w = t % B, base = 0;
            if (q >= per) { q -= per; base = VL; }
            lo_mask[level][t] = base + q * 2 * B + w;
            hi_mask[level][t] = base + q * 2 * B + B + w;
        }
    }
    vf a[VL];
    for (int i = 0; i < VL; i++) { a[i] = (vf){0}; a[i][0] = (float)(i + 1); }
    reduce_tree(a);
    for (int j = 0; j < VL; j++) lane_of[j] = (int)a[0][j] - 1;
    reduce_ready = 1;
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

/* y[n, ldy] (columns 0 .. sum(outs)-1) = x[n, K] @ [W_0; W_1; ...]^T for m matrices with out sizes
 * outs[i], codes[i] [outs[i], K] uint8, scales[i] / biases[i] [outs[i], K/64] float32. K % 64 == 0.
 * Returns 0, or -1 when K is not a multiple of 64 or a buffer cannot be allocated. */
int stoa_qmatmul(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                 const float *const *scales, const float *const *biases, const int64_t *outs,
                 float *y, int64_t ldy, int threads) {
    if (K % GROUP != 0 || n <= 0 || m <= 0) return -1;
    reduce_init();
    const int64_t P = panel_width(K);
    int64_t npanels = 0;
    for (int i = 0; i < m; i++) npanels += (outs[i] + P - 1) / P;
    int64_t *pm = malloc(sizeof(int64_t) * 2 * npanels); /* panel -> (matrix, first output) */
    int64_t *col = malloc(sizeof(int64_t) * m);          /* matrix -> first column of y */
    if (!pm || !col) { free(pm); free(col); return -1; }
    int64_t q = 0, c = 0;
    for (int i = 0; i < m; i++) {
        col[i] = c; c += outs[i];
        for (int64_t o = 0; o < outs[i]; o += P) { pm[2 * q] = i; pm[2 * q + 1] = o; q++; }
    }
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
