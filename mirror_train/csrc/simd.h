#include <stddef.h>
#include <stdint.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
#define LANES 16
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VZERO() _mm512_setzero_ps()
#define VSTORE(p, a) _mm512_storeu_ps(p, a)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
static inline float vsum(vec v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define LANES 8
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VZERO() _mm256_setzero_ps()
#define VSTORE(p, a) _mm256_storeu_ps(p, a)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
static inline float vsum(vec v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#else
typedef float vec;
#define LANES 1
#define VLOAD(p) (*(p))
#define VFMA(a, b, c) fmaf(a, b, c)
#define VZERO() 0.0f
#define VSTORE(p, a) (*(p) = (a))
#define VADD(a, b) ((a) + (b))
#define VSUB(a, b) ((a) - (b))
#define VSET(c) (c)
static inline float vsum(vec v) { return v; }
#endif

/* vsums(a): LANES vectors' sums at once, lane j of the result a[j]'s, each by exactly vsum's additions in vsum's
   order (halves, quarters, ... then the last two), transposed so that LANES sums take LANES - 1 vector additions and
   their shuffles instead of LANES horizontal reductions: the same bits as vsum, a fraction of the instructions. */
#if LANES == 16
static inline vec vsums(const vec *a) {
    vec h[8], q[4], p[2];
    for (int t = 0; t < 8; t++)  /* v[j] + v[j+8] */
        h[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int u = 0; u < 4; u++)  /* h[j] + h[j+4]: 128-bit lane k holds vector 4u+k */
        q[u] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int w = 0; w < 2; w++)  /* q0 + q2, q1 + q3 */
        p[w] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * w], q[2 * w + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(q[2 * w], q[2 * w + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* q'0 + q'1: element 4k+m is vector 4m+k, put back in order */
    vec r = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
#elif LANES == 8
static inline vec vsums(const vec *a) {
    vec h[4], p[2];
    for (int t = 0; t < 4; t++)  /* v[j] + v[j+4]: 128-bit lane k holds vector 2t+k */
        h[t] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * t], a[2 * t + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * t], a[2 * t + 1], 0x31));
    for (int w = 0; w < 2; w++)  /* q0 + q2, q1 + q3 */
        p[w] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * w], h[2 * w + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(h[2 * w], h[2 * w + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* q'0 + q'1: element 4k+m is vector 2m+k, put back in order */
    vec r = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm256_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#else
static inline vec vsums(const vec *a) { return a[0]; }
#endif

/* Weights in float32 or bfloat16 (widened exactly to float32 on load; the arithmetic is float32 either way). */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}
#define F32_SCALAR(p) (*(p))
#define BF16_SCALAR(p) bf16_to_f32(*(p))
#if LANES == 16
#define F32_LOAD(p) _mm512_loadu_ps(p)
#define BF16_LOAD(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif LANES == 8
#define F32_LOAD(p) _mm256_loadu_ps(p)
#define BF16_LOAD(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#else
#define F32_LOAD(p) (*(p))
#define BF16_LOAD(p) bf16_to_f32(*(p))
#endif

/* Weights in float16 (a float32 model of float16 values read from float16 copies: kernels.serve_narrow), widened
   exactly: every float16 value is a float32 one (subnormals included), so the sums are the float32 weights' bits. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } c;
    if (exp == 0x1f) {
        c.u = sign | 0x7f800000u | (man << 13);  /* inf, nan */
    } else if (exp) {
        c.u = sign | ((exp + 112) << 23) | (man << 13);
    } else {  /* zero, or a subnormal: man x 2^-24, exact in float32 */
        c.f = (float)man * 5.9604644775390625e-8f;
        c.u |= sign;
    }
    return c.f;
}
#define F16_SCALAR(p) f16_to_f32(*(p))
#if LANES == 16
#define F16_LOAD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#elif LANES == 8 && defined(__F16C__)
#define F16_LOAD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#elif LANES == 8
#define F16_LOAD(p)                                                                                                 \
    _mm256_setr_ps(f16_to_f32((p)[0]), f16_to_f32((p)[1]), f16_to_f32((p)[2]), f16_to_f32((p)[3]),                  \
                   f16_to_f32((p)[4]), f16_to_f32((p)[5]), f16_to_f32((p)[6]), f16_to_f32((p)[7]))
#else
#define F16_LOAD(p) f16_to_f32(*(p))
#endif

/* Weights in int8 with a float32 scale per output row (a proxy head's proposal-only copy: fused_head.py), widened
   exactly to float32 on load; the caller multiplies each output by its row's scale. Half the bytes of bfloat16 to
   stream, where the head's 16,384 x 576 rows are read beside the target's own weight stream. */
#define I8_SCALAR(p) ((float)*(p))
#if LANES == 16
#define I8_LOAD(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif LANES == 8
#define I8_LOAD(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#else
#define I8_LOAD(p) ((float)*(p))
#endif

/* KEEP_X: the tall blocks hold each input chunk in a register for its NB FMAs. Left to itself, GCC 12 folds the
   load into every FMA (NB loads of the same chunk): at 3 x 8 that is 27 vector loads for 24 FMAs, and a Zen 4 core
   loads one 512-bit vector a cycle, so the block ran load-bound at ~70% of the FMA peak (81 of 117 GFLOP/s from
   L2; 94-97 held in a register, twenty-fifth session, docs/engine.md). The wide 4 x MB blocks of 3-4 rows, which
   stream the weights from memory, ran slower held, so they keep the compiler's choice. The asm changes no
   arithmetic: the same FMAs in the same order. */
#if defined(__AVX512F__)
#define KEEP_X(v) __asm__("" : "+v"(v))
#else
#define KEEP_X(v) (void)(v)
#endif
