/* The int8 kernel's integer path (qmatmul.c's stoa_qmatmul_int: the `int24` and `int16` modes) on x86
 * CPUs with AVX2 and FMA but no AVX-512 VNNI.
 *
 * It computes what the VNNI path computes, bit for bit: the same rounded inputs q (per group of 64,
 * |q| <= 8,355,711 or 32,639, on the same scale sx), the same exact integer sums per group and output,
 * the same float32 epilogue in the same order; only the way to the sums differs. AVX2's byte multiply
 * (vpmaddubsw) saturates its 16-bit pair sums on full bytes, so the products here are 16-bit ones
 * (vpmaddwd: int16 x int16, each pair summed exactly into int32), the codes widened to 16 bits, and a
 * 24-bit q is two int16 planes where the VNNI path has three byte planes:
 *
 *   q = 65536 * top + rest, rest in [-32896, 32639]  (the VNNI path's balanced base-256 split, top in
 *   [-127, 127]); plane 0 holds top, plane 1 holds rest + 128, which fits int16 ([-32768, 32767]).
 *
 * Per group of 64 inputs and output, with C = sum code (at most 64 * 255 = 16,320):
 *   A = sum code * top                          |A| <= 64 * 255 * 127   = 2,072,640
 *   R = sum code * (rest + 128) - 128 * C       |R| <= 64 * 255 * 32896 = 536,862,720 < 2^31
 * and every partial sum on the way lies within the same bounds, so both are exact in int32: the VNNI
 * path's top-digit sum and its lower digits' sum. Then dot = fma(float(A), 65536, float(R)), as there.
 * A 16-bit q is one plane (q itself; |sum| <= 64 * 255 * 32639 < 2^31), dot = float(sum). Sums restart
 * at every group, as there; across groups only the float32 epilogue accumulates.
 *
 * Rows are split over the threads by blocks of 8 outputs, evenly whatever the matrices' sizes. With
 * few rows the codes are read in place; with more, a panel of blocks is packed once (codes widened and
 * laid out as the multiply reads them) and reused by every row.
 */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP 64
#define BW 8 /* outputs per block: one int32 lane each */
#define IFEW 9 /* fewer rows than this read the codes in place (measured: up to 8 rows beat the tiles) */
#define IFR 4 /* rows at a time there */
#define TR3 4 /* a tile's rows and blocks, 24-bit: TR3 * TB3 * 2 int32 accumulators (GCC spills more) */
#define TB3 1
#define TR2 4 /* 16-bit: TR2 * TB2 accumulators */
#define TB2 3

static inline int qmax(int D) { return D == 2 ? 32639 : 8355711; }

static inline void store16(int16_t *p, __m256i v) { /* 8 int32 lanes within int16's range */
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

static inline int32_t hsum_i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Lane j of the result = the sum of v[j]'s 8 lanes (int32, exact). */
static inline __m256i hsum8(const __m256i *v) {
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* As qmatmul.c's quantize_rows (the same q, sx and cb bit for bit), into int16 planes: xp[p][r][k],
 * planes n * K apart (24-bit: top, rest + 128; 16-bit: q). */
static void quantize_rows(const float *x, int64_t n, int64_t K, int D, int16_t *xp, float *sx, float *cb) {
    const int64_t G = K / GROUP;
    const int Q = qmax(D);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i hi = _mm256_set1_epi32(Q), lo = _mm256_set1_epi32(-Q);
    const __m256i off = _mm256_set1_epi32(32896), c128 = _mm256_set1_epi32(128);
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *p = x + r * K + g * GROUP;
            __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps(); /* max_ps drops a NaN: looked for apart */
            for (int j = 0; j < GROUP; j += 8) {
                const __m256 v = _mm256_loadu_ps(p + j);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                m = _mm256_max_ps(m, _mm256_and_ps(v, absm));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float mx = _mm_cvtss_f32(h);
            float s = 0.f, inv = 0.f;
            if (_mm256_movemask_ps(bad) || !(mx <= 3.4028235e38f)) s = NAN;
            else if (mx > 0.f) { s = mx / (float)Q; inv = (float)Q / mx; }
            __m256i qs = _mm256_setzero_si256();
            for (int j = 0; j < GROUP; j += 8) {
                __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(inv)));
                q = _mm256_max_epi32(_mm256_min_epi32(q, hi), lo);
                qs = _mm256_add_epi32(qs, q);
                int16_t *o = xp + r * K + g * GROUP + j;
                if (D == 2) {
                    store16(o, q);
                } else {
                    const __m256i top = _mm256_srai_epi32(_mm256_add_epi32(q, off), 16);
                    store16(o, top);
                    store16(o + n * K, _mm256_add_epi32(_mm256_sub_epi32(q, _mm256_slli_epi32(top, 16)), c128));
                }
            }
            sx[r * G + g] = s;
            cb[r * G + g] = s * (float)hsum_i(qs);
        }
}

/* A group's dot products, one float per lane, from its exact sums: 16-bit a[0]; 24-bit a[0] = A, a[1] = R. */
static inline __attribute__((always_inline)) __m256 group_dot(const __m256i *a, const int D) {
    if (D == 2) return _mm256_cvtepi32_ps(a[0]);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[0]), _mm256_set1_ps(65536.f), _mm256_cvtepi32_ps(a[1]));
}

/* Few rows (nr < IFEW): outputs 0 .. no-1 (no <= 8) of code / scale / bias read in place. Per output
 * and group, each plane's products over 16 inputs at a time (lanes over inputs), then 8 outputs' lanes
 * summed at once (hsum8: exact); the float32 epilogue per group as the tiles'. */
static inline __attribute__((always_inline)) void
few_body(const int16_t *xp, int64_t pst, const float *sx, const float *cb, int64_t K, const int D, const int nr,
         const uint8_t *code, const float *scale, const float *bias, const int no, float *y, int64_t ldy) {
    const int64_t G = K / GROUP;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)G));
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(no), lane);
    const __m256i z = _mm256_setzero_si256();
    __m256 acc[IFR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int o = 0; o < BW; o++) _mm_prefetch((const char *)(code + (BW + o) * K + g * GROUP), _MM_HINT_T0);
        __m256i t[IFR][2][BW];
        for (int o = 0; o < BW; o++) {
            if (o >= no) {
                for (int r = 0; r < nr; r++) t[r][0][o] = t[r][1][o] = z;
                continue;
            }
            const uint8_t *cp = code + o * K + g * GROUP;
            __m256i c[4];
            for (int j = 0; j < 4; j++) c[j] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(cp + 16 * j)));
            __m256i k128 = z; /* 128 * C, in lanes 0, 2, 4, 6 */
            if (D == 3)
                k128 = _mm256_slli_epi32(_mm256_add_epi64(_mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)cp), z),
                                                          _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(cp + 32)), z)),
                                         7);
            for (int r = 0; r < nr; r++)
                for (int p = 0; p < D - 1; p++) {
                    const int16_t *xr = xp + p * pst + r * K + g * GROUP;
                    __m256i s = _mm256_madd_epi16(c[0], _mm256_loadu_si256((const __m256i *)xr));
                    for (int j = 1; j < 4; j++)
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(c[j], _mm256_loadu_si256((const __m256i *)(xr + 16 * j))));
                    t[r][p][o] = p ? _mm256_sub_epi32(s, k128) : s;
                }
        }
        const __m256 sc = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), scale + g, idx, _mm256_castsi256_ps(live), 4);
        const __m256 bi = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), bias + g, idx, _mm256_castsi256_ps(live), 4);
        for (int r = 0; r < nr; r++) {
            __m256i a[2];
            a[0] = hsum8(t[r][0]);
            if (D == 3) a[1] = hsum8(t[r][1]);
            acc[r] = _mm256_fmadd_ps(group_dot(a, D), _mm256_mul_ps(sc, _mm256_set1_ps(sx[r * G + g])), acc[r]);
            acc[r] = _mm256_fmadd_ps(bi, _mm256_set1_ps(cb[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm256_maskstore_ps(y + r * ldy, live, acc[r]);
}

static void few_rows(const int16_t *xp, int64_t pst, const float *sx, const float *cb, int64_t K, int D, int n,
                     const uint8_t *code, const float *scale, const float *bias, int no, float *y, int64_t ldy) {
#define FCASE(DD, R) case R: few_body(xp, pst, sx, cb, K, DD, R, code, scale, bias, no, y, ldy); break
    const int64_t G = K / GROUP;
    for (int r = 0; r < n; r += IFR, xp += IFR * K, sx += IFR * G, cb += IFR * G, y += IFR * ldy) {
        const int nr = n - r < IFR ? n - r : IFR;
        if (D == 2) switch (nr) { FCASE(2, 1); FCASE(2, 2); FCASE(2, 3); FCASE(2, 4); }
        else switch (nr) { FCASE(3, 1); FCASE(3, 2); FCASE(3, 3); FCASE(3, 4); }
    }
#undef FCASE
}

/* r[i] lane j <-> r[j] lane i for 8 vectors of 8 int32. */
static inline void transpose8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* A block of 8 outputs (no <= 8 real ones; the rest read as zero): pc[g][t] = their codes 2t, 2t+1 of
 * group g as int16 pairs, one int32 lane an output (what vpmaddwd multiplies lane by lane); ps[g] / pb[g]
 * their scales / biases, pk[g] = 128 * their code sums. */
static void pack_block(const uint8_t *code, const float *scale, const float *bias, int64_t K, int no, int16_t *pc,
                       float *ps, float *pb, int32_t *pk) {
    const int64_t G = K / GROUP;
    const __m256i z = _mm256_setzero_si256();
    for (int64_t g = 0; g < G; g++) {
        __m256i w[4][BW];
        for (int o = 0; o < BW; o++) {
            const uint8_t *cp = code + o * K + g * GROUP;
            _mm_prefetch((const char *)(cp + BW * K), _MM_HINT_T0);
            if (o >= no) {
                for (int j = 0; j < 4; j++) w[j][o] = z;
                ps[g * BW + o] = pb[g * BW + o] = 0.f;
                pk[g * BW + o] = 0;
                continue;
            }
            for (int j = 0; j < 4; j++) w[j][o] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(cp + 16 * j)));
            const __m256i s = _mm256_add_epi64(_mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)cp), z),
                                               _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(cp + 32)), z));
            pk[g * BW + o] = 128 * hsum_i(s);
            ps[g * BW + o] = scale[o * G + g];
            pb[g * BW + o] = bias[o * G + g];
        }
        for (int j = 0; j < 4; j++) {
            transpose8(w[j]);
            for (int t = 0; t < 8; t++) _mm256_store_si256((__m256i *)(pc + g * 512 + (8 * j + t) * 16), w[j][t]);
        }
    }
}

/* Rows 0 .. nr-1 (nr <= TR) times packed blocks 0 .. nb-1 (nb <= TB; valid[b] real outputs each). Per
 * group: the planes' exact int32 sums per (row, output), then the float32 epilogue, in group order
 * whatever the tile: a result does not depend on the tiling. */
static inline __attribute__((always_inline)) void
tile_body(const int16_t *xp, int64_t pst, const float *sx, const float *cb, int64_t K, const int D, const int nr,
          const int nb, const int16_t *pc, const float *ps, const float *pb, const int32_t *pk, float *y, int64_t ldy,
          const int *valid) {
    enum { MR = TR2 > TR3 ? TR2 : TR3, MB = TB2 > TB3 ? TB2 : TB3 };
    const int64_t G = K / GROUP, bc = K * BW, bs = G * BW; /* a block's int16 codes, its floats of scales */
    __m256 acc[MR][MB];
    for (int r = 0; r < nr; r++)
        for (int b = 0; b < nb; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i a[MR][MB][2];
        for (int r = 0; r < nr; r++)
            for (int b = 0; b < nb; b++)
                for (int p = 0; p < D - 1; p++) a[r][b][p] = _mm256_setzero_si256();
        const int16_t *xg = xp + g * GROUP;
        const int16_t *cg = pc + g * 512;
        for (int t = 0; t < 32; t++) {
            __m256i c[MB];
            for (int b = 0; b < nb; b++) c[b] = _mm256_load_si256((const __m256i *)(cg + b * bc + t * 16));
            for (int r = 0; r < nr; r++)
                for (int p = 0; p < D - 1; p++) {
                    int32_t w;
                    memcpy(&w, xg + p * pst + r * K + 2 * t, 4);
                    const __m256i x = _mm256_set1_epi32(w);
                    for (int b = 0; b < nb; b++) a[r][b][p] = _mm256_add_epi32(a[r][b][p], _mm256_madd_epi16(c[b], x));
                }
        }
        for (int r = 0; r < nr; r++) {
            const __m256 s = _mm256_set1_ps(sx[r * G + g]), q = _mm256_set1_ps(cb[r * G + g]);
            for (int b = 0; b < nb; b++) {
                if (D == 3)
                    a[r][b][1] = _mm256_sub_epi32(a[r][b][1], _mm256_load_si256((const __m256i *)(pk + b * bs + g * BW)));
                acc[r][b] = _mm256_fmadd_ps(group_dot(a[r][b], D),
                                            _mm256_mul_ps(_mm256_load_ps(ps + b * bs + g * BW), s), acc[r][b]);
                acc[r][b] = _mm256_fmadd_ps(_mm256_load_ps(pb + b * bs + g * BW), q, acc[r][b]);
            }
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int b = 0; b < nb; b++) {
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid[b]), lane);
        for (int r = 0; r < nr; r++) _mm256_maskstore_ps(y + r * ldy + b * BW, live, acc[r][b]);
    }
}

/* The body with constant counts (accumulators in registers). */
static void tile(const int16_t *xp, int64_t pst, const float *sx, const float *cb, int64_t K, int D, int nr, int nb,
                 const int16_t *pc, const float *ps, const float *pb, const int32_t *pk, float *y, int64_t ldy,
                 const int *valid) {
#define TCASE(DD, R, B) case R: tile_body(xp, pst, sx, cb, K, DD, R, B, pc, ps, pb, pk, y, ldy, valid); return
    if (D == 2) {
        if (nb == TB2) switch (nr) { TCASE(2, 4, TB2); TCASE(2, 3, TB2); TCASE(2, 2, TB2); default: TCASE(2, 1, TB2); }
        switch (nr) { TCASE(2, 4, 1); TCASE(2, 3, 1); TCASE(2, 2, 1); default: TCASE(2, 1, 1); }
    }
    switch (nr) { TCASE(3, 4, 1); TCASE(3, 3, 1); TCASE(3, 2, 1); default: TCASE(3, 1, 1); } /* TB3 = 1 */
#undef TCASE
}

/* Block b of all the matrices' blocks (each matrix's outputs in blocks of 8, the last one partial):
 * its matrix and first output. */
static inline void locate(int64_t b, int m, const int64_t *outs, int *i, int64_t *o0) {
    int k = 0;
    while (k < m - 1 && b >= (outs[k] + BW - 1) / BW) b -= (outs[k++] + BW - 1) / BW;
    *i = k;
    *o0 = b * BW;
}

/* As stoa_qmatmul_int (qmatmul.c). Returns 0, or -1 for a bad argument or when out of memory. */
int stoa_qmatmul_int_avx2(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                          const float *const *scales, const float *const *biases, const int64_t *outs, float *y,
                          int64_t ldy, int threads, int digits) {
    if (K % GROUP != 0 || n <= 0 || m <= 0 || (digits != 2 && digits != 3)) return -1;
    const int D = digits, TR = D == 2 ? TR2 : TR3, TB = D == 2 ? TB2 : TB3;
    const int64_t G = K / GROUP, bc = K * BW, bs = G * BW;
    int64_t nblk = 0, *col = malloc(sizeof(int64_t) * m);
    int16_t *xp = malloc(sizeof(int16_t) * (D - 1) * n * K);
    float *sx = malloc(n * G * 4), *cb = malloc(n * G * 4);
    int failed = !col || !xp || !sx || !cb;
    for (int i = 0; i < m && !failed; i++) {
        col[i] = i ? col[i - 1] + outs[i - 1] : 0;
        nblk += (outs[i] + BW - 1) / BW;
    }
    if (!failed) quantize_rows(x, n, K, D, xp, sx, cb);
    if (threads < 1) threads = 1;
    if (n < IFEW && !failed) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            int i;
            int64_t o0;
            locate(b, m, outs, &i, &o0);
            const int64_t left = outs[i] - o0;
            few_rows(xp, n * K, sx, cb, K, D, (int)n, codes[i] + o0 * K, scales[i] + o0 * G, biases[i] + o0 * G,
                     left < BW ? (int)left : BW, y + col[i] + o0, ldy);
        }
    } else if (!failed) {
        int64_t PB = (256 * 1024) / (K * BW * 2); /* blocks whose packed codes fill ~256 KB */
        if (PB < 1) PB = 1;
#pragma omp parallel num_threads(threads)
        {
            int16_t *pc = aligned_alloc(32, PB * bc * 2);
            float *ps = aligned_alloc(32, PB * bs * 4), *pb = aligned_alloc(32, PB * bs * 4);
            int32_t *pk = aligned_alloc(32, PB * bs * 4);
            int nt = 1, me = 0;
#ifdef _OPENMP
            nt = omp_get_num_threads();
            me = omp_get_thread_num();
#endif
            if (!pc || !ps || !pb || !pk) {
#pragma omp atomic write
                failed = 1;
            } else {
                /* this thread's blocks, in panels of at most PB blocks within one matrix */
                for (int64_t b = nblk * me / nt, end = nblk * (me + 1) / nt; b < end;) {
                    int i;
                    int64_t o0;
                    locate(b, m, outs, &i, &o0);
                    const int64_t mine = (outs[i] - o0 + BW - 1) / BW; /* the matrix's blocks from b on */
                    int64_t nb = end - b < mine ? end - b : mine;
                    if (nb > PB) nb = PB;
                    const int64_t no = outs[i] - o0 < nb * BW ? outs[i] - o0 : nb * BW;
                    for (int64_t k = 0; k < nb; k++)
                        pack_block(codes[i] + (o0 + k * BW) * K, scales[i] + (o0 + k * BW) * G,
                                   biases[i] + (o0 + k * BW) * G, K, no - k * BW < BW ? (int)(no - k * BW) : BW,
                                   pc + k * bc, ps + k * bs, pb + k * bs, pk + k * bs);
                    for (int64_t k = 0; k < nb;) {
                        const int tb = nb - k >= TB ? TB : 1;
                        int valid[TB2 > TB3 ? TB2 : TB3];
                        for (int v = 0; v < tb; v++) {
                            const int64_t l = no - (k + v) * BW;
                            valid[v] = l >= BW ? BW : (int)l;
                        }
                        for (int64_t r = 0; r < n; r += TR) {
                            const int nr = n - r < TR ? (int)(n - r) : TR;
                            tile(xp + r * K, n * K, sx + r * G, cb + r * G, K, D, nr, tb, pc + k * bc, ps + k * bs,
                                 pb + k * bs, pk + k * bs, y + r * ldy + col[i] + o0 + k * BW, ldy, valid);
                        }
                        k += tb;
                    }
                    b += nb;
                }
            }
            free(pc); free(ps); free(pb); free(pk);
        }
    }
    free(col); free(xp); free(sx); free(cb);
    return failed ? -1 : 0;
}
#endif
