/* Vector types and helpers shared by the torch engine's CPU kernels (qmatmul.c, attention.c, step.c,
 * sample.c). The vector width follows the target's registers: 16 floats with AVX-512, 4 on 64-bit ARM
 * (NEON), else 8 (AVX2). STOA_VL, defined at build time, picks another width (4, 8 or 16): the tests
 * build an x86 twin of the ARM build's arithmetic with it. */
#ifndef STOA_SIMD_H
#define STOA_SIMD_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(STOA_VL)
#define VL STOA_VL
#elif defined(__AVX512F__)
#define VL 16
#elif defined(__aarch64__)
#define VL 4 /* NEON's registers: GCC keeps wider generic vectors in memory there */
#else
#define VL 8
#endif
#if VL != 4 && VL != 8 && VL != 16
#error "STOA_VL must be 4, 8 or 16"
#endif

/* The instruction set whose intrinsics fit vectors of VL floats (none: the portable code alone). */
#if defined(__AVX512F__) && VL == 16
#define STOA_AVX512 1
#elif defined(__AVX2__) && VL == 8
#define STOA_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON) && VL == 4
#define STOA_NEON 1
#include <arm_neon.h>
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf fmadd(vf a, vf b, vf c) { /* a * b + c, rounded once where the CPU can */
#if defined(STOA_AVX512)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && VL == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__FMA__) && VL == 4
    return (vf)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#elif defined(STOA_NEON) && defined(__GNUC__) && !defined(__clang__)
    __asm__("fmla %0.4s, %1.4s, %2.4s" : "+w"(c) : "w"(a), "w"(b)); /* GCC's vfmaq_f32 keeps loops' */
    return c;                                                      /* accumulators from registers */
#elif defined(STOA_NEON)
    return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    return a * b + c;
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

/* a[0 .. VL-1] -> a[0]: reduce_tree on floats, reduce_tree_i on int32 lanes (exact); one body. */
#define STOA_REDUCE_TREE(NAME, T)                                                                   \
    static inline __attribute__((always_inline, unused)) void NAME(T *a) {                          \
        int count = VL, level = 0;                                                                  \
        for (int B = VL / 2; B >= 1; B /= 2, level++) {                                             \
            for (int i = 0; i < count / 2; i++)                                                     \
                a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo_mask[level]) +                  \
                       __builtin_shuffle(a[2 * i], a[2 * i + 1], hi_mask[level]);                   \
            count /= 2;                                                                             \
        }                                                                                           \
    }
STOA_REDUCE_TREE(reduce_tree, vf)
STOA_REDUCE_TREE(reduce_tree_i, vi)

static __attribute__((unused)) void reduce_init(void) {
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

static inline __attribute__((unused)) vf bcast(float x) { return (vf){0} + x; }
/* m ? a : b, lane by lane */
static inline __attribute__((unused)) vf sel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }

/* e^x for x <= 0 (Cephes' single-precision polynomial, ~1 ulp); below -87.3 (and -inf) it is 0. */
static inline __attribute__((unused)) vf vexp(vf x) {
    const vf lo = bcast(-87.33654f);
    const vi dead = x < lo;
    x = sel(dead, lo, x);
    const vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi), vf);
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = bcast(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vf y = p * r * r + r + 1.0f;
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return sel(dead, bcast(0.f), y * (vf)e);
}

#endif
