/* y = x . W^T with int8 weights and int8-rounded inputs on AVX512-VNNI's dot product of byte quads (vpdpbusd: one
   instruction, four multiply-adds a 32-bit lane, integer sums that are exact): for a proxy head's proposal-only copy
   of its linears (fused_head.py, "int8"). Per weight row a float32 scale (its largest magnitude / 127) and the sum of
   its int8 values; per input row a scale the same way. The instruction multiplies unsigned by signed bytes, so an
   input byte is stored as q + 128 and the row's 128 x sum(w) is taken back out of the exact integer sum:
       y[m][n] = xs[m] * ws[n] * (sum_k (xq[m][k] + 128) wq[n][k] - 128 sum_k wq[n][k]).
   The weights lie in panels of 16 rows (one output per 32-bit lane, no horizontal sums), 4 consecutive k a lane:
   panel p holds rows 16p..16p+15, k4 = 0..K4-1 apart by 64 bytes (fused_head.quantize_panels lays them out, rows and
   k zero-padded). Without the instruction q8_dot() is 0 and the head reads int8 rows widened to float32 instead.
   The bits differ from a float32 product (the inputs are rounded to 8 bits): the head only proposes. */
#if LANES == 16 && defined(__AVX512VNNI__)
int q8_dot(void) { return 1; }

/* R input rows x 2 panels over K4 quads: the sums as integers */
#define Q8_TILE(R)                                                                                                 \
static void q8_tile_##R(const uint32_t *x, int64_t K4, const int8_t *p, int64_t ps, __m512i *out) {              \
    __m512i acc[R][2];                                                                                             \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();          \
    for (int64_t j = 0; j < K4; j++, p += 64) {                                                                   \
        __m512i w0 = _mm512_loadu_si512((const void *)p), w1 = _mm512_loadu_si512((const void *)(p + ps));         \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                      \
            __m512i xb = _mm512_set1_epi32((int)x[r * K4 + j]);                                                    \
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);                                                    \
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);                                                    \
        }                                                                                                          \
    }                                                                                                              \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) out[2 * r] = acc[r][0], out[2 * r + 1] = acc[r][1];       \
}
Q8_TILE(1) Q8_TILE(2) Q8_TILE(3) Q8_TILE(4) Q8_TILE(5) Q8_TILE(6) Q8_TILE(7) Q8_TILE(8)
typedef void (*q8_tile_fn)(const uint32_t *, int64_t, const int8_t *, int64_t, __m512i *);
static const q8_tile_fn Q8_TILES[9] = {0, q8_tile_1, q8_tile_2, q8_tile_3, q8_tile_4,
                                       q8_tile_5, q8_tile_6, q8_tile_7, q8_tile_8};

/* x (M x K floats, ldx apart) rounded into quads: xq (M x K4 words, zero-padded past K), xs (M scales) */
static void q8_inputs(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t K4, uint32_t *xq, float *xs) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        float big = 0.0f;
        for (int64_t k = 0; k < K; k++) big = fabsf(r[k]) > big ? fabsf(r[k]) : big;
        float s = big > 0 ? big / 127.0f : 1.0f, inv = 1.0f / s;
        uint8_t *b = (uint8_t *)(xq + m * K4);
        for (int64_t k = 0; k < 4 * K4; k++) {
            float q = k < K ? nearbyintf(r[k] * inv) : 0.0f;
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            b[k] = (uint8_t)(int)(q + 128.0f);
        }
        xs[m] = s;
    }
}

/* y (M x N, ldy apart) from x (M x K) and N weight rows in panels (above); ws, wsum: per row. scratch: M x K4 words
   and M floats (the head's pair scratch, which holds more: proxy_head.c). */
static void linear_q8(const float *x, int64_t ldx, const int8_t *panels, const float *ws, const int32_t *wsum,
                      float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, uint32_t *scratch) {
    int64_t K4 = (K + 3) / 4, P = (N + LANES - 1) / LANES, ps = K4 * 64;
    uint32_t *xq = scratch;
    float *xs = (float *)(xq + M * K4);
    q8_inputs(x, ldx, M, K, K4, xq, xs);
    __m512i sums[16];
    const __m512i off = _mm512_set1_epi32(128);
    for (int64_t p = 0; p < P; p += 2) {
        int two = p + 1 < P;  /* an odd last panel: its tile's second panel is the first again, its sums unused */
        for (int64_t m = 0; m < M; m += 8) {
            int64_t R = M - m < 8 ? M - m : 8;
            Q8_TILES[R](xq + m * K4, K4, panels + p * ps, two ? ps : 0, sums);
            for (int64_t r = 0; r < R; r++)
                for (int c = 0; c <= two; c++) {
                    int64_t n = (p + c) * LANES;
                    __m512i w = _mm512_loadu_si512((const void *)(wsum + n));  /* padded to whole panels */
                    __m512i s = _mm512_sub_epi32(sums[2 * r + c], _mm512_mullo_epi32(off, w));
                    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_set1_ps(xs[m + r]),
                                                                                   _mm512_loadu_ps(ws + n)));
                    __mmask16 keep = N - n >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
                    _mm512_mask_storeu_ps(y + (m + r) * ldy + n, keep, v);
                }
        }
    }
}
#else
int q8_dot(void) { return 0; }
static void linear_q8(const float *x, int64_t ldx, const int8_t *panels, const float *ws, const int32_t *wsum,
                      float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, uint32_t *scratch) {
    (void)x, (void)ldx, (void)panels, (void)ws, (void)wsum, (void)y, (void)ldy, (void)M, (void)N, (void)K;
    (void)scratch;  /* never called: fused_head reads int8 rows where q8_dot() is 0 */
}
#endif
