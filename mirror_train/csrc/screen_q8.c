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

/* x's M rows (K apart) in two bytes a value: quad rows 2m and 2m+1 (K4 words each, zero-padded past K) row m's h and
   l, stored + 128 (the instruction's unsigned side); xs[m] its scale */
static void screen_q8_inputs(const float *x, int64_t M, int64_t K, int64_t K4, uint32_t *xq, float *xs) {
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
}

/* One input row's screened logits for one panel's 16 ids from its exact integer sums (h's and l's): whichever
   instruction made the sums, the same float32 operations, so the same bits */
static inline void screen_q8_store(__m512i sum_h, __m512i sum_l, const int32_t *wsum, const float *ws, float s,
                                   float *y, int64_t left) {
    __m512i w = _mm512_mullo_epi32(_mm512_set1_epi32(128), _mm512_loadu_si512((const void *)wsum));
    __m512 sh = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum_h, w));
    __m512 sl = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum_l, w));
    __m512 t = _mm512_fmadd_ps(sl, _mm512_set1_ps(Q8_LO), sh);
    __m512 v = _mm512_mul_ps(t, _mm512_mul_ps(_mm512_set1_ps(s), _mm512_loadu_ps(ws)));
    __mmask16 keep = left >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    _mm512_mask_storeu_ps(y, keep, v);
}

/* Panels p0..P-1 of the screen on the dot product of byte quads: Q quad rows (xq, K4 words apart) */
static void screen_q8_panels(const uint32_t *xq, const float *xs, int64_t Q, int64_t K4, const int8_t *panels,
                             const float *ws, const int32_t *wsum, float *y, int64_t ldy, int64_t N, int64_t p0,
                             int64_t P) {
    int64_t ps = K4 * 64;
    __m512i sums[16];
    for (int64_t p = p0; p < P; p += 2) {
        int two = p + 1 < P;
        for (int64_t j = 0; j < Q; j += 8) {
            int64_t R = Q - j < 8 ? Q - j : 8;
            Q8_TILES[R](xq + j * K4, K4, panels + p * ps, two ? ps : 0, sums);
            for (int64_t r = 0; r < R; r += 2)
                for (int c = 0; c <= two; c++) {
                    int64_t m = (j + r) / 2, n = (p + c) * LANES;
                    screen_q8_store(sums[2 * r + c], sums[2 * (r + 1) + c], wsum + n, ws + n, xs[m], y + m * ldy + n,
                                    N - n);
                }
        }
    }
}

/* y (M x N, ldy apart) = the screened logits of x (M x K) against an (N x K) head's int8 panels (linear_q8.c's
   layout), ws and wsum per row; scratch: 2M x K4 words + M floats. Rows 2m and 2m+1 of the quads are x's row m's
   h and l, so a tile of 8 quad rows holds 4 whole input rows. */
void screen_q8(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *ws, const int32_t *wsum,
               float *y, int64_t ldy, int64_t N, uint32_t *scratch) {
    int64_t K4 = (K + 3) / 4;
    uint32_t *xq = scratch;
    float *xs = (float *)(xq + 2 * M * K4);
    screen_q8_inputs(x, M, K, K4, xq, xs);
    screen_q8_panels(xq, xs, 2 * M, K4, panels, ws, wsum, y, ldy, N, 0, (N + LANES - 1) / LANES);
}
#else
int screen_q8_built(void) { return 0; }
void screen_q8(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *ws, const int32_t *wsum,
               float *y, int64_t ldy, int64_t N, uint32_t *scratch) {
    (void)x, (void)M, (void)K, (void)panels, (void)ws, (void)wsum, (void)y, (void)ldy, (void)N, (void)scratch;
}
#endif

/* The same screen on AMX's tiles (Sapphire Rapids and later Xeons): TDPBUSD is the same unsigned-by-signed dot
   product of byte quads, 16 x 16 of them a 64-byte step in one instruction, its sums the same exact integers, so
   every screened logit has the bits of screen_q8 above (screen_q8_store). The int8 panels are already the layout a
   tile's B operand reads (16 ids x 4 bytes a row, a row a quad of k), 16 quads (1 KB) a tile; a tile's A operand is
   up to 16 quad rows (8 input rows, h and l) x 16 quads. On the dot product of byte quads the screen is compute-bound
   from ~4 rows (two bytes a value double the products); on tiles the products are ~16x cheaper and the screen streams
   its bytes at any width up to 16 rows. Up to 8 input rows four panels at a time (4 accumulator tiles), 9 to 16 two
   panels at a time for each 8 rows; the panels past the last whole group, and heads whose K is not a multiple of 64,
   go through screen_q8. Linux lends a process the tiles' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM):
   screen_q8_amx_built() asks once and says whether it was granted. */
#if LANES == 16 && defined(__AVX512VNNI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>

static int amx_granted = -1;

int screen_q8_amx_built(void) {
    if (amx_granted < 0) /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18) */
        amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_config;

/* Palette 1, 64-byte rows in every tile, tile t's rows rows[t] */
static void screen_q8_configure(const uint8_t rows[8]) {
    amx_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = rows[t];
    _tile_loadconfig(&cfg);
}

/* Accumulator tiles 0-3 (group g's sums of panels p + c in tile g * C + c, C = 4 / groups; group g the quad rows
   16g.., rows[g] of them) into y's rows 8g.. through screen_q8_store */
static void screen_q8_tiles_out(int groups, const int64_t rows[2], int64_t p, const float *xs, const float *ws,
                                const int32_t *wsum, float *y, int64_t ldy, int64_t N) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    _tile_stored(0, sums[0], 64); /* macros of asm statements: one a statement */
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    int C = 4 / groups;
    for (int g = 0; g < groups; g++)
        for (int64_t r = 0; r < rows[g]; r += 2)
            for (int c = 0; c < C; c++) {
                int64_t n = (p + c) * LANES, m = 8 * g + r / 2;
                __m512i h = _mm512_load_si512((const void *)sums[g * C + c][r]);
                __m512i l = _mm512_load_si512((const void *)sums[g * C + c][r + 1]);
                screen_q8_store(h, l, wsum + n, ws + n, xs[m], y + m * ldy + n, N - n);
            }
}

/* Q (<= 16) quad rows against panels 0..P4-1 (P4 a multiple of 4), K4 a multiple of 16: tiles 0-3 the sums of four
   panels, 4 the quad rows' step, 5-7 the panels' steps in turn */
static void screen_q8_tiles(const uint32_t *xq, const float *xs, int64_t Q, int64_t K4, const int8_t *panels,
                            const float *ws, const int32_t *wsum, float *y, int64_t ldy, int64_t N, int64_t P4) {
    const uint8_t rows[8] = {(uint8_t)Q, (uint8_t)Q, (uint8_t)Q, (uint8_t)Q, (uint8_t)Q, 16, 16, 16};
    const int64_t out[2] = {Q, 0};
    screen_q8_configure(rows);
    int64_t ps = K4 * 64, steps = K4 / 16, xstride = K4 * 4;
    for (int64_t p = 0; p < P4; p += 4) {
        const int8_t *b = panels + p * ps;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++, b += 1024) {
            _tile_loadd(4, xq + s * 16, xstride);
            _tile_loadd(5, b, 64);
            _tile_dpbusd(0, 4, 5);
            _tile_loadd(6, b + ps, 64);
            _tile_dpbusd(1, 4, 6);
            _tile_loadd(7, b + 2 * ps, 64);
            _tile_dpbusd(2, 4, 7);
            _tile_loadd(5, b + 3 * ps, 64);
            _tile_dpbusd(3, 4, 5);
        }
        screen_q8_tiles_out(1, out, p, xs, ws, wsum, y, ldy, N);
    }
    _tile_release();
}

/* 16 quad rows (8 input rows) and Q1 (<= 16) more against panels 0..P2-1 (P2 even), K4 a multiple of 16: tiles 0-1
   the first rows' sums of two panels, 2-3 the other rows', 4-5 the two groups of quad rows' step, 6-7 the panels' */
static void screen_q8_tiles2(const uint32_t *xq, const float *xs, int64_t Q1, int64_t K4, const int8_t *panels,
                             const float *ws, const int32_t *wsum, float *y, int64_t ldy, int64_t N, int64_t P2) {
    const uint8_t rows[8] = {16, 16, (uint8_t)Q1, (uint8_t)Q1, 16, (uint8_t)Q1, 16, 16};
    const int64_t out[2] = {16, Q1};
    screen_q8_configure(rows);
    int64_t ps = K4 * 64, steps = K4 / 16, xstride = K4 * 4;
    const uint32_t *x1 = xq + 16 * K4;
    for (int64_t p = 0; p < P2; p += 2) {
        const int8_t *b = panels + p * ps;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++, b += 1024) {
            _tile_loadd(4, xq + s * 16, xstride);
            _tile_loadd(5, x1 + s * 16, xstride);
            _tile_loadd(6, b, 64);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(2, 5, 6);
            _tile_loadd(7, b + ps, 64);
            _tile_dpbusd(1, 4, 7);
            _tile_dpbusd(3, 5, 7);
        }
        screen_q8_tiles_out(2, out, p, xs, ws, wsum, y, ldy, N);
    }
    _tile_release();
}

/* screen_q8's arguments and result, on tiles where this process may use them: 16 input rows a pass over the head */
void screen_q8_amx(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *ws, const int32_t *wsum,
                   float *y, int64_t ldy, int64_t N, uint32_t *scratch) {
    int64_t K4 = (K + 3) / 4, P = (N + LANES - 1) / LANES;
    if (!screen_q8_amx_built() || K4 % 16 || P < 4) {
        screen_q8(x, M, K, panels, ws, wsum, y, ldy, N, scratch);
        return;
    }
    int64_t most = M < 16 ? M : 16;
    uint32_t *xq = scratch; /* screen_q8's scratch: 2 x 16 rows' quads and their scales fit where M's do */
    float *xs = (float *)(xq + 2 * most * K4);
    for (int64_t m = 0; m < M; m += 16) {
        int64_t R = M - m < 16 ? M - m : 16, done = R > 8 ? P - P % 2 : P - P % 4;
        screen_q8_inputs(x + m * K, R, K, K4, xq, xs);
        if (R > 8)
            screen_q8_tiles2(xq, xs, 2 * (R - 8), K4, panels, ws, wsum, y + m * ldy, ldy, N, done);
        else
            screen_q8_tiles(xq, xs, 2 * R, K4, panels, ws, wsum, y + m * ldy, ldy, N, done);
        if (done < P) screen_q8_panels(xq, xs, 2 * R, K4, panels, ws, wsum, y + m * ldy, ldy, N, done, P);
    }
}
#else
int screen_q8_amx_built(void) { return 0; }
void screen_q8_amx(const float *x, int64_t M, int64_t K, const int8_t *panels, const float *ws, const int32_t *wsum,
                   float *y, int64_t ldy, int64_t N, uint32_t *scratch) {
    (void)x, (void)M, (void)K, (void)panels, (void)ws, (void)wsum, (void)y, (void)ldy, (void)N, (void)scratch;
}
#endif
