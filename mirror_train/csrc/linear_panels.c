/* The same product on weights stored as panels: LANES weight rows interleaved, k-major (P[N/LANES][K][LANES], the
   last panel padded with zero rows; `kernels.to_panels`). A tile of R input rows x C panels keeps R x C vectors of
   sums, each lane one output: every k it loads C weight vectors and broadcasts R inputs, so no horizontal sums
   remain, and each panel is one contiguous stream. Every output is the chain fma(x[k], w[k], s) over k = 0..K-1
   from s = 0, then + bias, in any tile: a row's outputs do not depend on the rows of the call (row-exact), and they
   differ from the row layout's (LANES partial sums) in the last bits. On an AVX2-only Zen 3 core a one-row step's
   linears took 0.66x and eight rows 0.77x the row layout's time (docs/engine.md, twenty-seventh session): a lone
   weight row's single FMA chain left the row layout's one-row call at ~19 GB/s. The tiles by R (C: as many panels
   as the registers hold beside R x C sums; one row takes 8 for its 8 independent chains, or one panel at a time:
   panel_one_row below). */
#if LANES == 16
#define PC1 8
#define PC2 8
#define PC3 6
#define PC4 4
#define PC5 4
#define PC6 4
#define PC7 3
#define PC8 3
#else
#define PC1 8
#define PC2 4
#define PC3 3
#define PC4 3
#define PC5 2
#define PC6 2
#define PC7 1
#define PC8 1
#endif
#if LANES == 16
#define VBCAST(p) _mm512_set1_ps(*(p))
#elif LANES == 8
#define VBCAST(p) _mm256_broadcast_ss(p)
#else
#define VBCAST(p) (*(p))
#endif
#define PANEL_CHUNK 24 /* panels a pass over the rows: divisible by every PC, so each row group covers it whole */
/* Tiles of PANEL_PF_FROM rows and more (by default: panel_prefetch below) prefetch each panel a distance ahead into
   L2 (PANEL_PF_HINT); left to the hardware prefetcher they waited on memory. The distance reaches panels ahead (a
   panel is 9-18 KB at K = 576), into the tiles that come next: on Zen 3 64 KB against the 4 KB first tried took
   float32's 3-6 rows 0.82-0.88x the time and bfloat16's 2-5 rows 0.74-0.79x, 8 rows ~0.97x (docs/engine.md,
   twenty-eighth session); on Zen 4 256 KB against 64 KB took float32's 8 rows 0.78x and 16 rows 0.86x, where the
   window's FMAs and the weights' stream each need most of the core and 64 KB left them waiting on each other
   (forty-seventh session; 128-512 KB alike). The distance is per weight type and measured once per machine
   (panel_prefetch_distance below, kernels.tune_prefetch); PANEL_PF is where it starts. Into L2 (prefetcht1) rather
   than non-temporal (prefetchnta, as first written): on Zen 4 float32 panels' 2, 4 and 8 rows took 0.82-0.86x the
   time, bfloat16's 2 and 4 rows 0.72-0.86x (8 rows, compute-bound, the same), the LM head's 8-row screen 0.6-0.7x
   (docs/engine.md, thirty-fifth session; Zen 3 unmeasured). No change to the arithmetic. */
#ifndef PANEL_PF_HINT
#define PANEL_PF_HINT 2
#endif
#ifndef PANEL_PF
#define PANEL_PF 262144
#endif
#define PANEL_TYPE_F32 0
#define PANEL_TYPE_BF16 1
static int64_t panel_pf_dist[2] = {PANEL_PF, PANEL_PF}; /* bytes, per weight type (PANEL_TYPE_*) */
/* the prefetch distance of weight type t in bytes; bytes >= 0 replaces it first (a multiple of 64, at most 16 MB) */
int64_t panel_prefetch_distance(int t, int64_t bytes) {
    if (t < 0 || t > 1) return -1;
    if (bytes >= 0) panel_pf_dist[t] = (bytes < (1 << 24) ? bytes : (1 << 24)) & ~(int64_t)63;
    return panel_pf_dist[t];
}
#ifndef PANEL_PF_FROM
#define PANEL_PF_FROM 2
#endif
/* Which tile heights prefetch, per weight type (bit R: R-row tiles; 0 float32 panels, 1 bfloat16): from
   PANEL_PF_FROM rows unless kernels.py sets a mask it measured on this machine (panel_prefetch). On the AMX Xeon
   the float32 stack's 2- and 3-row steps ran ~1 ms faster without it and 4-8 rows slower (docs/engine.md,
   forty-fourth session), where Zen 3 and 4 had gained from 2 rows on. */
#define PANEL_PF_DEFAULT (0x1FF & ~((1 << PANEL_PF_FROM) - 1))
static int64_t panel_pf_mask[2] = {PANEL_PF_DEFAULT, PANEL_PF_DEFAULT};
#define PANEL_PF_ON(T, r) ((int)((panel_pf_mask[PANEL_TYPE_##T] >> (r)) & 1))
/* the mask of weight type t (0 float32, 1 bfloat16); a mask >= 0 replaces it first */
int64_t panel_prefetch(int t, int64_t mask) {
    if (t < 0 || t > 1) return -1;
    if (mask >= 0) panel_pf_mask[t] = mask & 0x1FF;
    return panel_pf_mask[t];
}
/* How a one-row call streams its panels, per weight type: one at a time (1: its one chain, a 64-byte load and an FMA
   every 4 cycles, ~57 GB/s at 3.6 GHz, past one core's read rate, over one contiguous stream the hardware prefetcher
   follows) or PC1 at once (0: PC1 chains, PC1 streams). On a Zen 4 one at a time streamed the testbed's 30 layers
   in 0.96x the row layout's time where 8 at once took 1.2-1.4x (docs/engine.md, forty-seventh session); measured
   once per machine (kernels.tune_prefetch), one at a time where it starts with AVX-512. Either way each output is
   the same chain over k, so no bit changes. */
static int64_t panel_single[2] = {LANES == 16, LANES == 16};
/* the one-row streaming of weight type t (1 one panel at a time, 0 PC1 at once); single >= 0 replaces it first */
int64_t panel_one_row(int t, int64_t single) {
    if (t < 0 || t > 1) return -1;
    if (single >= 0) panel_single[t] = single != 0;
    return panel_single[t];
}
/* bfloat16 panels hold k-pairs: lane l's 32-bit word of pair j is (w[2j] low, w[2j+1] high) (`kernels.to_panels`;
   an odd K's last high half is 0 and never read). One vector load then widens to two weight vectors with one
   shift and one and (w[2j+1] is already its float32 bits once the low half is masked), where loading 8 bf16
   and widening them (vpmovzxwd + shift) took a shuffle, a shift and a load for each vector: on Zen 3 one- and
   two-row calls took 0.83-0.94x the time, 3+ rows the same (their gap to float32's rate closed with the prefetch
   above; docs/engine.md, twenty-eighth session). Each output's chain is still fma over k = 0..K-1 in order, so the
   bits are the widened float32 panels' own. */
#if LANES == 16
#define BF16_PAIR(p, lo, hi)                                                                                       \
    do {                                                                                                           \
        __m512i v_ = _mm512_loadu_si512((const void *)(p));                                                        \
        lo = _mm512_castsi512_ps(_mm512_slli_epi32(v_, 16));                                                       \
        hi = _mm512_castsi512_ps(_mm512_and_si512(v_, _mm512_set1_epi32((int)0xFFFF0000u)));                       \
    } while (0)
#elif LANES == 8
#define BF16_PAIR(p, lo, hi)                                                                                       \
    do {                                                                                                           \
        __m256i v_ = _mm256_loadu_si256((const __m256i *)(p));                                                     \
        lo = _mm256_castsi256_ps(_mm256_slli_epi32(v_, 16));                                                       \
        hi = _mm256_castsi256_ps(_mm256_and_si256(v_, _mm256_set1_epi32((int)0xFFFF0000u)));                       \
    } while (0)
#else
#define BF16_PAIR(p, lo, hi) (lo = bf16_to_f32((p)[0]), hi = bf16_to_f32((p)[1]))
#endif
/* A tile's R x C sums from 0 and its R input rows; then the sums (+ bias) into y */
#define PTILE_OPEN(R, C)                                                                                            \
    vec acc[R][C];                                                                                                 \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                            \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = VZERO();                                   \
    const float *xr[R];                                                                                            \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) xr[r] = x + r * ldx;
#define PTILE_CLOSE(R, C)                                                                                           \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                            \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                                        \
            VSTORE(y + r * ldy + c * LANES, b ? VADD(acc[r][c], VLOAD(b + c * LANES)) : acc[r][c]);
/* every row's input at k times the C weight vectors W, into the sums */
#define PTILE_FMA(R, C, W, k)                                                                                      \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                          \
        vec xb = VBCAST(xr[r] + (k));                                                                              \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = VFMA(W[c], xb, acc[r][c]);                 \
    }
#ifndef BF16_BY_ROW
#define BF16_BY_ROW 3
#endif
/* bf16 tiles by rows: from BF16_BY_ROW rows a pass holds every panel's pair (2C registers) and broadcasts one input
   at a time (R x C + 2C + 2 registers), below it each panel's pair is used up before the next (R x C + 2R + 3); the
   C per R keeps that within the registers: past them GCC spilled sums to the stack and a 3 x 3 tile ran 12% and
   a 4 x 3 tile 50% slower than the widening loads' tiles (Zen 3, docs/engine.md, twenty-eighth session). */
#ifndef BPC1
#if LANES == 16
#define BPC1 8
#define BPC2 8
#define BPC3 4
#define BPC4 4
#define BPC5 3
#define BPC6 3
#define BPC7 3
#define BPC8 2
#else
#define BPC1 8
#define BPC2 4
#define BPC3 2
#define BPC4 2
#define BPC5 2
#define BPC6 1
#define BPC7 1
#define BPC8 1
#endif
#endif
/* The bf16 tile: per panel one pair load, its two k's applied to every row in order */
#define PTILE_BF16(NAME, R, C, PF)                                                                                   \
static void NAME(const float *x, int64_t ldx, const uint16_t *p, int64_t K, const float *b, float *y, int64_t ldy) { \
    PTILE_OPEN(R, C)                                                                                               \
    const int64_t cs = BF16_PSTRIDE(K), ahead = panel_pf_dist[PANEL_TYPE_BF16];                                    \
    int64_t k = 0;                                                                                                 \
    for (; R >= BF16_BY_ROW && k + 2 <= K; k += 2, p += 2 * LANES) {                                               \
        vec lo[C], hi[C];                                                                                          \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                      \
            BF16_PAIR(p + c * cs, lo[c], hi[c]);                                                                   \
            if (PF) __builtin_prefetch((const char *)(p + c * cs) + ahead, 0, PANEL_PF_HINT);                      \
        }                                                                                                          \
        PTILE_FMA(R, C, lo, k);                                                                                    \
        PTILE_FMA(R, C, hi, k + 1);                                                                                \
    }                                                                                                              \
    for (; k + 2 <= K; k += 2, p += 2 * LANES) {                                                                   \
        vec x0[R], x1[R];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                      \
            x0[r] = VBCAST(xr[r] + k);                                                                             \
            x1[r] = VBCAST(xr[r] + k + 1);                                                                         \
        }                                                                                                          \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                      \
            vec lo, hi;                                                                                            \
            BF16_PAIR(p + c * cs, lo, hi);                                                                         \
            if (PF) __builtin_prefetch((const char *)(p + c * cs) + ahead, 0, PANEL_PF_HINT);                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][c] = VFMA(lo, x0[r], acc[r][c]);            \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][c] = VFMA(hi, x1[r], acc[r][c]);            \
        }                                                                                                          \
    }                                                                                                              \
    if (k < K) {                                                                                                   \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                      \
            vec lo, hi;                                                                                            \
            BF16_PAIR(p + c * cs, lo, hi);                                                                         \
            (void)hi;                                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                    \
                acc[r][c] = VFMA(lo, VBCAST(xr[r] + k), acc[r][c]);                                                \
        }                                                                                                          \
    }                                                                                                              \
    PTILE_CLOSE(R, C)                                                                                              \
}
/* elements from one panel to the next */
#define F32_PSTRIDE(K) ((K) * LANES)
#define BF16_PSTRIDE(K) (((K) + 1) / 2 * 2 * LANES)
/* The float32 tile, NAME its function, R x C (C given as a number: the PC macros expand before they reach here) */
#define PTILE_F32(NAME, R, C, PF)                                                                                    \
static void NAME(const float *x, int64_t ldx, const float *p, int64_t K, const float *b, float *y, int64_t ldy) {  \
    PTILE_OPEN(R, C)                                                                                               \
    const int64_t cs = F32_PSTRIDE(K), ahead = panel_pf_dist[PANEL_TYPE_F32];                                      \
    for (int64_t k = 0; k < K; k++, p += LANES) {                                                                  \
        vec w[C];                                                                                                  \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                      \
            w[c] = F32_LOAD(p + c * cs);                                                                           \
            if (PF) __builtin_prefetch((const char *)(p + c * cs) + ahead, 0, PANEL_PF_HINT);                      \
        }                                                                                                          \
        PTILE_FMA(R, C, w, k);                                                                                     \
    }                                                                                                              \
    PTILE_CLOSE(R, C)                                                                                              \
}
/* R rows over `panels` panels: tiles of C, then one panel at a time; _pf the tiles that prefetch, _np those that
   do not (panel_prefetch picks per R) */
#define PTILES(T, WT, R, C) PTILES_(T, WT, R, C, pf, 1) PTILES_(T, WT, R, C, np, 0)
#define PTILES_(T, WT, R, C, V, PF)                                                                                \
PTILE_##T(T##_ptile_##R##_##C##_##V, R, C, PF) PTILE_##T(T##_ptile_##R##_one_##V, R, 1, PF)                      \
static void T##_ptile_##R##_##V(const float *x, int64_t ldx, const WT *p, int64_t K, const float *b, float *y,      \
                                int64_t ldy, int64_t panels) {                                                     \
    int64_t c = 0;                                                                                                 \
    for (; c + C <= panels; c += C)                                                                                \
        T##_ptile_##R##_##C##_##V(x, ldx, p + c * T##_PSTRIDE(K), K, b ? b + c * LANES : 0, y + c * LANES, ldy);   \
    for (; c < panels; c++)                                                                                        \
        T##_ptile_##R##_one_##V(x, ldx, p + c * T##_PSTRIDE(K), K, b ? b + c * LANES : 0, y + c * LANES, ldy);   \
}
#define PANEL_TILES(T, WT, PC)                                                                                     \
PTILES(T, WT, 1, PC##1) PTILES(T, WT, 2, PC##2) PTILES(T, WT, 3, PC##3) PTILES(T, WT, 4, PC##4)                    \
PTILES(T, WT, 5, PC##5) PTILES(T, WT, 6, PC##6) PTILES(T, WT, 7, PC##7) PTILES(T, WT, 8, PC##8)                    \
typedef void (*T##_prow_fn)(const float *, int64_t, const WT *, int64_t, const float *, float *, int64_t, int64_t); \
static const T##_prow_fn T##_PROWS[2][9] = {                                                                       \
    {0, T##_ptile_1_np, T##_ptile_2_np, T##_ptile_3_np, T##_ptile_4_np, T##_ptile_5_np, T##_ptile_6_np,           \
     T##_ptile_7_np, T##_ptile_8_np},                                                                             \
    {0, T##_ptile_1_pf, T##_ptile_2_pf, T##_ptile_3_pf, T##_ptile_4_pf, T##_ptile_5_pf, T##_ptile_6_pf,           \
     T##_ptile_7_pf, T##_ptile_8_pf}};                                                                            \
static void T##_ptile_1_single(const float *x, int64_t ldx, const WT *p, int64_t K, const float *b, float *y,      \
                               int64_t ldy, int64_t panels) {                                                      \
    for (int64_t c = 0; c < panels; c++)                                                                           \
        T##_ptile_1_one_np(x, ldx, p + c * T##_PSTRIDE(K), K, b ? b + c * LANES : 0, y + c * LANES, ldy);         \
}                                                                                                                  \
/* the tiles for r rows: a one-row call's one panel at a time where panel_one_row says so */                      \
static inline T##_prow_fn T##_prow(int64_t r) {                                                                    \
    return r == 1 && panel_single[PANEL_TYPE_##T] ? T##_ptile_1_single : T##_PROWS[PANEL_PF_ON(T, r)][r];          \
}                                                                                                                  \
void linear_panels_##T(const float *x, int64_t ldx, const WT *p, const float *b, float *y, int64_t ldy, int64_t M, \
                       int64_t N, int64_t K) {                                                                     \
    /* p: the panels of an N x K weight (N rounded up to LANES), b: N biases or NULL. Whole panels straight into y; \
       the last, partial one (N % LANES outputs) through a small buffer. */                                       \
    int64_t full = N / LANES;                                                                                      \
    for (int64_t c0 = 0; c0 < full; c0 += PANEL_CHUNK) {                                                           \
        int64_t panels = full - c0 < PANEL_CHUNK ? full - c0 : PANEL_CHUNK;                                        \
        for (int64_t m = 0; m < M; m += 8) {                                                                       \
            int64_t r = M - m < 8 ? M - m : 8;                                                                     \
            T##_prow(r)(x + m * ldx, ldx, p + c0 * T##_PSTRIDE(K), K, b ? b + c0 * LANES : 0,                     \
                        y + m * ldy + c0 * LANES, ldy, panels);                                                    \
        }                                                                                                          \
    }                                                                                                              \
    int64_t rest = N - full * LANES;                                                                               \
    if (rest) {                                                                                                    \
        float buf[8 * LANES], bias[LANES];                                                                         \
        for (int64_t i = 0; i < LANES; i++) bias[i] = b && i < rest ? b[full * LANES + i] : 0.0f;                  \
        for (int64_t m = 0; m < M; m += 8) {                                                                       \
            int64_t r = M - m < 8 ? M - m : 8;                                                                     \
            T##_prow(r)(x + m * ldx, ldx, p + full * T##_PSTRIDE(K), K, b ? bias : 0, buf, LANES, 1);             \
            for (int64_t j = 0; j < r; j++)                                                                        \
                for (int64_t i = 0; i < rest; i++) y[(m + j) * ldy + full * LANES + i] = buf[j * LANES + i];       \
        }                                                                                                          \
    }                                                                                                              \
}
PANEL_TILES(F32, float, PC)
PANEL_TILES(BF16, uint16_t, BPC)
