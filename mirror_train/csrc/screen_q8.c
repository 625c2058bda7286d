/* The LM head's screen in int8 (screened_head.py, "int8"): every screened logit from int8 copies of the head's rows
   (csrc/linear_q8.c's panels, scales and row sums) on AVX512-VNNI's dot product of byte quads, with each input row
   split into two bytes a value so that the input's rounding stays near float32's and the bound near the bfloat16
   screen's: x ~ s (h + Q8_LO l), h = round(x / s) and l = round((x / s - h) * 254), both in -127..127, s the row's
   largest magnitude / 127. Both byte rows run through the same weight bytes (one stream of the head, half the
   bfloat16 screen's bytes), their integer sums exact:
       a[m][n] = (S_h + Q8_LO S_l) * (s[m] ws[n]),   S = sum_k (q_k + 128) wq[n][k] - 128 sum_k wq[n][k]
   in float32 (the combination one fma, then two products). What the screen needs besides the scores is x's rounded
   values (x^ = s (h + Q8_LO l), exactly, in double), which screen_scales computes again from the same function. */
static const float Q8_LO = 1.0f / 254.0f;

/* A row's scale: its largest magnitude / 127 (1 for a zero row) */
static float q8_row_scale(const float *r, int64_t K) {
    float big = 0.0f;
    for (int64_t k = 0; k < K; k++) big = fabsf(r[k]) > big ? fabsf(r[k]) : big;
    return big > 0 ? big / 127.0f : 1.0f;
}

/* One value's two bytes (as values in -127..127): h = round(v / s), l = round((v / s - h) 254); t - h is exact (an
   integer taken from a float of magnitude < 2^23 leaves bits the float already had). Not finite: 0 (the screen's
   bound is then not finite and the whole head runs: screen_scales). */
static inline void q8_split(float v, float inv, float *h, float *l) {
    float t = v * inv, a = nearbyintf(t);
    a = a > 127.0f ? 127.0f : a < -127.0f ? -127.0f : a;
    float b = nearbyintf((t - a) * 254.0f);
    b = b > 127.0f ? 127.0f : b < -127.0f ? -127.0f : b;
    if (a != a || b != b) a = b = 0.0f;
    *h = a, *l = b;
}

#if LANES == 16 && defined(__AVX512VNNI__)
int screen_q8_built(void) { return 1; }

/* y (M x N, ldy apart) = the screened logits of x (M x K) against an (N x K) head's int8 panels (linear_q8.c's
   layout), ws and wsum per row; scratch: 2M x K4 words + M floats. Rows 2m and 2m+1 of the quads are x's row m's
   h and l, so a tile of 8 quad rows holds 4 whole input rows. */
void screen_q8(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *ws, const int32_t *wsum,
               float *y, int64_t ldy, int64_t N, uint32_t *scratch) {
    int64_t K4 = (K + 3) / 4, P = (N + LANES - 1) / LANES, ps = K4 * 64, Q = 2 * M;
    uint32_t *xq = scratch;
    float *xs = (float *)(xq + Q * K4);
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * K;
        float s = q8_row_scale(r, K), inv = 1.0f / s, h, l;
        uint8_t *bh = (uint8_t *)(xq + 2 * m * K4), *bl = (uint8_t *)(xq + (2 * m + 1) * K4);
        for (int64_t k = 0; k < 4 * K4; k++) {
            h = l = 0.0f;
            if (k < K) q8_split(r[k], inv, &h, &l);
            bh[k] = (uint8_t)(int)(h + 128.0f), bl[k] = (uint8_t)(int)(l + 128.0f);
        }
        xs[m] = s;
    }
    __m512i sums[16];
    const __m512i off = _mm512_set1_epi32(128);
    const __m512 lo = _mm512_set1_ps(Q8_LO);
    for (int64_t p = 0; p < P; p += 2) {
        int two = p + 1 < P;
        for (int64_t j = 0; j < Q; j += 8) {
            int64_t R = Q - j < 8 ? Q - j : 8;
            Q8_TILES[R](xq + j * K4, K4, panels + p * ps, two ? ps : 0, sums);
            for (int64_t r = 0; r < R; r += 2) {
                int64_t m = (j + r) / 2;
                for (int c = 0; c <= two; c++) {
                    int64_t n = (p + c) * LANES;
                    __m512i w = _mm512_mullo_epi32(off, _mm512_loadu_si512((const void *)(wsum + n)));
                    __m512 sh = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[2 * r + c], w));
                    __m512 sl = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[2 * (r + 1) + c], w));
                    __m512 t = _mm512_fmadd_ps(sl, lo, sh);
                    __m512 v = _mm512_mul_ps(t, _mm512_mul_ps(_mm512_set1_ps(xs[m]), _mm512_loadu_ps(ws + n)));
                    __mmask16 keep = N - n >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
                    _mm512_mask_storeu_ps(y + m * ldy + n, keep, v);
                }
            }
        }
    }
}
#else
int screen_q8_built(void) { return 0; }
void screen_q8(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *ws, const int32_t *wsum,
               float *y, int64_t ldy, int64_t N, uint32_t *scratch) {
    (void)x, (void)M, (void)K, (void)panels, (void)ws, (void)wsum, (void)y, (void)ldy, (void)N, (void)scratch;
}
#endif
