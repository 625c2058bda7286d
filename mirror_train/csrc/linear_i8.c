/* A proposer's linear on int8 weights (kernels.linear_i8): a proxy head's LM head over its candidate vocabulary on
   the draft's side, whose bytes compete with the target's weight stream for the memory there (its bfloat16 rows took
   3.1-3.3 ms of the rollout's ~14 ms in the engine against 1.1 alone: docs/engine.md, thirty-seventh session). Each
   weight row is quantized once to int8 with a scale of its own (kernels.quantize_i8: q = round(w / s), s = max|w| /
   127, rows zero-padded to whole 64-byte chunks), each input row at the call to bytes around 128 with its own
   (u = round(x / t) + 128, t = max|x| / 127); AVX512-VNNI's dot product of 4 unsigned and 4 signed bytes into int32
   lanes takes a 64-byte chunk an instruction, and y = (sum - 128 * sum of q) * s * t. It only proposes: its rounding
   is far coarser than bfloat16's, and nothing the target verifies depends on it. Without the instruction i8_dot()
   is 0 (the head keeps its bfloat16 or float32 path). */
#if LANES == 16 && defined(__AVX512VNNI__)
int i8_dot(void) { return 1; }
#define I8_NB 4 /* weight rows a tile: 4 x up to 6 input rows = 24 sums, 4 weight chunks and an input chunk in registers */
#define I8_MB 6
/* Tiles ahead the weights are prefetched: a tile takes ~0.1 us at K = 576, less than the memory's latency, and
   the next one's rows alone arrived late (ms for 16,384 rows x 576, 5 rows, caches flushed, Zen 4: 1 tile ahead
   0.88-0.91, see the thirty-seventh session) */
#ifndef I8_PF
#define I8_PF 8
#endif
static inline __attribute__((always_inline)) void i8_tile(int nb, int mb, const uint8_t *xq, int64_t Kp,
                                                          const int8_t *w, int pf, float *out) {
    __m512i acc[I8_NB][I8_MB];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kp; k += 64) {
        __m512i wv[I8_NB];
        for (int i = 0; i < nb; i++) {
            wv[i] = _mm512_loadu_si512((const void *)(w + i * Kp + k));
            if (pf) __builtin_prefetch(w + (i + I8_PF * nb) * Kp + k, 0, 2); /* I8_PF tiles ahead, into L2 */
        }
        for (int j = 0; j < mb; j++) {
            __m512i xv = _mm512_loadu_si512((const void *)(xq + j * Kp + k));
            for (int i = 0; i < nb; i++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[i]);
        }
    }
    /* the sums reduced LANES at a time (`vsums`), as floats: a lane's int32 sum (4 products a chunk) is exact in
       one, and a row's total rounds only past 2^24, which a proposer does not notice; one `reduce_add` a sum had
       taken about as long as the dot products at K = 576 */
    for (int g = 0; g < nb * mb; g += LANES) {
        vec t[LANES];
        for (int u = 0; u < LANES; u++) {
            int s = g + u;  /* sum s: input row s / nb, weight row s % nb */
            t[u] = s < nb * mb ? _mm512_cvtepi32_ps(acc[s % nb][s / nb]) : VZERO();
        }
        float part[LANES];
        VSTORE(part, vsums(t));
        for (int u = 0; u < LANES && g + u < nb * mb; u++) out[g + u] = part[u];
    }
}
#define I8_TILE(NB, MB)                                                                                            \
static void i8_tile_##NB##_##MB(const uint8_t *xq, int64_t Kp, const int8_t *w, int pf, float *out) {               \
    i8_tile(NB, MB, xq, Kp, w, pf, out);                                                                           \
}
I8_TILE(4, 1) I8_TILE(4, 2) I8_TILE(4, 3) I8_TILE(4, 4) I8_TILE(4, 5) I8_TILE(4, 6)
I8_TILE(1, 1) I8_TILE(1, 2) I8_TILE(1, 3) I8_TILE(1, 4) I8_TILE(1, 5) I8_TILE(1, 6)
typedef void (*i8_tile_fn)(const uint8_t *, int64_t, const int8_t *, int, float *);
static const i8_tile_fn I8_TILES[2][I8_MB + 1] = {
    {0, i8_tile_1_1, i8_tile_1_2, i8_tile_1_3, i8_tile_1_4, i8_tile_1_5, i8_tile_1_6},
    {0, i8_tile_4_1, i8_tile_4_2, i8_tile_4_3, i8_tile_4_4, i8_tile_4_5, i8_tile_4_6}};

/* y (M x N, row stride ldy) = x (M x K, row stride ldx) . W^T, W as quantize_i8 made it: q (N x Kp int8), its
   scales (N) and row sums of q (N); xq: M x Kp bytes of scratch. */
void linear_i8(const float *x, int64_t ldx, const int8_t *q, const float *scale, const int32_t *qsum, float *y,
               int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t Kp, uint8_t *xq) {
    float xs[I8_MB];
    for (int64_t m0 = 0; m0 < M; m0 += I8_MB) {
        int mb = M - m0 < I8_MB ? (int)(M - m0) : I8_MB;
        for (int j = 0; j < mb; j++) {  /* the input rows to bytes around 128, each with its own scale */
            const float *xr = x + (m0 + j) * ldx;
            float mx = 0.0f;
            for (int64_t k = 0; k < K; k++) mx = fabsf(xr[k]) > mx ? fabsf(xr[k]) : mx;
            float t = mx > 0.0f ? mx / 127.0f : 1.0f;
            uint8_t *u = xq + j * Kp;
            for (int64_t k = 0; k < K; k++) u[k] = (uint8_t)(lrintf(xr[k] / t) + 128);
            for (int64_t k = K; k < Kp; k++) u[k] = 128;  /* against zero weights */
            xs[j] = t;
        }
        float sums[I8_NB * I8_MB];
        for (int64_t n = 0; n < N;) {
            int nb = N - n >= I8_NB ? I8_NB : 1;
            I8_TILES[nb == I8_NB][mb](xq, Kp, q + n * Kp, n + (I8_PF + 1) * nb <= N, sums);
            for (int j = 0; j < mb; j++)  /* sums[j * nb + i]: input row j, weight row n + i */
                for (int i = 0; i < nb; i++)
                    y[(m0 + j) * ldy + n + i] =
                        (sums[j * nb + i] - 128.0f * (float)qsum[n + i]) * (scale[n + i] * xs[j]);
            n += nb;
        }
    }
}
#else
int i8_dot(void) { return 0; }
void linear_i8(const float *x, int64_t ldx, const int8_t *q, const float *scale, const int32_t *qsum, float *y,
               int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t Kp, uint8_t *xq) {
    (void)x, (void)ldx, (void)q, (void)scale, (void)qsum, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)Kp;
    (void)xq;
}
#endif
