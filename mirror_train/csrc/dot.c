/* The LM head's screen (screened_head.py): every logit approximately, from bfloat16 inputs and bfloat16 panels, with
   AVX512-BF16's dot product of pairs (one instruction, two multiply-adds a lane: half the float32 FMAs of the exact
   kernel, and half its bytes). How it rounds does not matter: the screen only bounds where the exact argmax can
   be, and that bound holds for any order of the sums. Without the instruction screen_dot() is 0 (the screen then
   widens bfloat16 weights in the exact kernels). */
/* x rounded to bfloat16 as the screen reads it: to nearest even, subnormals to zero (the instruction flushes them) */
static inline uint16_t screen_bf16_of(float f) {
    union { float f; uint32_t u; } c = {f};
    if (fabsf(f) < 1.17549435e-38f) return (uint16_t)(c.u >> 16 & 0x8000u);
    return (uint16_t)((c.u + 0x7FFFu + (c.u >> 16 & 1u)) >> 16);
}
static inline float screen_f32_of(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}
#if LANES == 16 && defined(__AVX512BF16__)
int screen_dot(void) { return 1; }
/* how far ahead a tile prefetches its panels (bytes): the distance the screen was measured with (thirty-fifth
   session), apart from the exact panels' per-machine one */
#ifndef DOT_PF
#define DOT_PF 65536
#endif
/* R input rows x C panels; x: R rows of K2 (bf16 pair) words, p: panels of K2 pair vectors, cs apart */
#define SCREEN_TILE(NAME, R, C)                                                                                    \
static void NAME(const uint32_t *x, int64_t K2, const uint16_t *p, int64_t cs, float *y, int64_t ldy) {            \
    __m512 acc[R][C];                                                                                              \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                            \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                       \
    for (int64_t j = 0; j < K2; j++, p += 2 * LANES) {                                                             \
        __m512i w[C];                                                                                              \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                      \
            w[c] = _mm512_loadu_si512((const void *)(p + c * cs));                                                 \
            if (R >= PANEL_PF_FROM) __builtin_prefetch((const char *)(p + c * cs) + DOT_PF, 0, PANEL_PF_HINT);     \
        }                                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                      \
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[r * K2 + j]);                                         \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                                    \
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, (__m512bh)w[c]);                                       \
        }                                                                                                          \
    }                                                                                                              \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                            \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) _mm512_storeu_ps(y + r * ldy + c * LANES, acc[r][c]);  \
}
/* R rows over `panels` panels: tiles of C (as many as 32 registers hold beside R x C sums), then one at a time */
#define SCREEN_ROWS(R, C)                                                                                          \
SCREEN_TILE(screen_tile_##R##_##C, R, C)                                                                           \
SCREEN_TILE(screen_tile_##R##_one, R, 1)                                                                           \
static void screen_rows_##R(const uint32_t *x, int64_t K2, const uint16_t *p, float *y, int64_t ldy,               \
                            int64_t panels) {                                                                      \
    const int64_t cs = 2 * K2 * LANES;                                                                             \
    int64_t c = 0;                                                                                                 \
    for (; c + C <= panels; c += C) screen_tile_##R##_##C(x, K2, p + c * cs, cs, y + c * LANES, ldy);              \
    for (; c < panels; c++) screen_tile_##R##_one(x, K2, p + c * cs, cs, y + c * LANES, ldy);                      \
}
SCREEN_ROWS(1, 8) SCREEN_ROWS(2, 8) SCREEN_ROWS(3, 6) SCREEN_ROWS(4, 6)
SCREEN_ROWS(5, 4) SCREEN_ROWS(6, 4) SCREEN_ROWS(7, 3) SCREEN_ROWS(8, 3)
typedef void (*screen_rows_fn)(const uint32_t *, int64_t, const uint16_t *, float *, int64_t, int64_t);
static const screen_rows_fn SCREEN_ROWS_BY[9] = {0, screen_rows_1, screen_rows_2, screen_rows_3, screen_rows_4,
                                                 screen_rows_5, screen_rows_6, screen_rows_7, screen_rows_8};
/* Few rows, one panel at a time (one weight stream, as the row layout's one-row linear reads: the tiles' several
   panels at once ran one row at ~28 GB/s), each row's pairs over S independent sums so the dot products' latency
   overlaps */
#define SCREEN_STREAM(R, S)                                                                                        \
static void screen_stream_##R(const uint32_t *x, int64_t K2, const uint16_t *p, float *y, int64_t ldy,             \
                              int64_t panels) {                                                                    \
    const int64_t cs = 2 * K2 * LANES;                                                                             \
    for (int64_t c = 0; c < panels; c++, p += cs) {                                                                \
        __m512 acc[R][S];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                        \
            _Pragma("GCC unroll 8") for (int s = 0; s < S; s++) acc[r][s] = _mm512_setzero_ps();                   \
        int64_t j = 0;                                                                                             \
        for (; j + S <= K2; j += S)                                                                                \
            _Pragma("GCC unroll 8") for (int s = 0; s < S; s++) {                                                  \
                __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(p + (j + s) * 2 * LANES));                \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][s] = _mm512_dpbf16_ps(                  \
                    acc[r][s], (__m512bh)_mm512_set1_epi32((int)x[r * K2 + j + s]), w);                            \
            }                                                                                                      \
        for (; j < K2; j++) {                                                                                      \
            __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(p + j * 2 * LANES));                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                    \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32((int)x[r * K2 + j]), w);       \
        }                                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                      \
            _Pragma("GCC unroll 8") for (int s = 1; s < S; s++) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][s]);   \
            _mm512_storeu_ps(y + r * ldy + c * LANES, acc[r][0]);                                                  \
        }                                                                                                          \
    }                                                                                                              \
}
/* Up to SCREEN_STREAM_ROWS rows stream (Zen 4, the testbed's head: 1-4 rows 1.7-1.9 ms against the tiles' 1.9-2.9;
   8 rows 3.3 against 3.0, docs/engine.md, thirty-third session), more take the tiles */
SCREEN_STREAM(1, 4) SCREEN_STREAM(2, 4) SCREEN_STREAM(3, 2) SCREEN_STREAM(4, 2)
static const screen_rows_fn SCREEN_STREAMS[5] = {0, screen_stream_1, screen_stream_2, screen_stream_3,
                                                 screen_stream_4};
#ifndef SCREEN_STREAM_ROWS
#define SCREEN_STREAM_ROWS 4
#endif
/* x's M rows (ldx apart) rounded to bfloat16, as pairs: M x K2 words */
static void dot_pairs(const float *x, int64_t ldx, int64_t M, int64_t K, uint32_t *pairs) {
    const int64_t K2 = (K + 1) / 2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < K2; j++) {
            uint32_t lo = screen_bf16_of(x[m * ldx + 2 * j]);
            uint32_t hi = 2 * j + 1 < K ? screen_bf16_of(x[m * ldx + 2 * j + 1]) : 0;
            pairs[m * K2 + j] = lo | hi << 16;
        }
}
/* y (M x panels * LANES, ldy apart) = pairs . panels; up to SCREEN_STREAM_ROWS rows stream, more go in tiles over
   chunks of PANEL_CHUNK panels, every group of up to 8 rows over a chunk while it is in L2 */
static void dot_panels(const uint32_t *pairs, int64_t M, int64_t K2, const uint16_t *p, int64_t panels, float *y,
                       int64_t ldy) {
    if (M <= SCREEN_STREAM_ROWS) {
        SCREEN_STREAMS[M](pairs, K2, p, y, ldy, panels);
        return;
    }
    for (int64_t c0 = 0; c0 < panels; c0 += PANEL_CHUNK) {
        int64_t n = panels - c0 < PANEL_CHUNK ? panels - c0 : PANEL_CHUNK;
        for (int64_t m = 0; m < M; m += 8) {
            int64_t r = M - m < 8 ? M - m : 8;
            SCREEN_ROWS_BY[r](pairs + m * K2, K2, p + c0 * 2 * K2 * LANES, y + m * ldy + c0 * LANES, ldy, n);
        }
    }
}
/* y = x . W^T (+ b) on the dot product for an N x K bfloat16 weight as panels, x's rows rounded to bfloat16 first:
   the LM head's screen (over the panels' padded N, no bias), and a draft's linear (fastpath's `dot` path, a fused
   draft layer's wpanels = 2: a draft only proposes, any rounding will do). Whole panels straight into y, a last,
   partial one through a small buffer. */
void linear_dot(const float *x, int64_t ldx, const uint16_t *p, const float *b, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K, uint32_t *pairs) {
    const int64_t K2 = (K + 1) / 2, full = N / LANES, rest = N - full * LANES;
    dot_pairs(x, ldx, M, K, pairs);
    dot_panels(pairs, M, K2, p, full, y, ldy);
    if (rest) {
        float buf[8 * LANES];
        for (int64_t m = 0; m < M; m += 8) {
            int64_t r = M - m < 8 ? M - m : 8;
            dot_panels(pairs + m * K2, r, K2, p + full * 2 * K2 * LANES, 1, buf, LANES);
            for (int64_t j = 0; j < r; j++)
                for (int64_t i = 0; i < rest; i++) y[(m + j) * ldy + full * LANES + i] = buf[j * LANES + i];
        }
    }
    if (b)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] += b[n];
}
#else
int screen_dot(void) { return 0; }
/* without the instruction: the same panels widened (Python never asks for it here; a layer's mode 2 still works) */
void linear_dot(const float *x, int64_t ldx, const uint16_t *p, const float *b, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K, uint32_t *pairs) {
    (void)pairs;
    linear_panels_BF16(x, ldx, p, b, y, ldy, M, N, K);
}
#endif
