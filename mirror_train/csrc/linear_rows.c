/* NB weight rows x MB input rows: every output accumulates over the same k-chunks in the same order, so its value
   does not depend on NB, MB or how many rows the call has. pf: prefetch into L2 the next block's weight rows, or
   with AHEAD the weights AHEAD elements on. KEEP: hold each input chunk in a register (KEEP_X). */
#define BLOCK(T, WT, NAME, NB, MB, KEEP, AHEAD)                                                                    \
static void T##_##NAME##_##MB(const float *x, int64_t ldx, const WT *w, int64_t K, const float *b, float *y,        \
                              int64_t ldy, int pf) {                                                               \
    vec acc[NB][MB];                                                                                               \
    for (int i = 0; i < NB; i++)                                                                                   \
        for (int j = 0; j < MB; j++) acc[i][j] = VZERO();                                                          \
    int64_t k = 0;                                                                                                 \
    for (; k + LANES <= K; k += LANES) {                                                                           \
        vec wv[NB];                                                                                                \
        for (int i = 0; i < NB; i++) {                                                                             \
            wv[i] = T##_LOAD(w + i * K + k);                                                                       \
            if (pf) __builtin_prefetch(AHEAD ? w + i * K + k + AHEAD : w + (i + NB) * K + k, 0, 2);                \
        }                                                                                                          \
        for (int j = 0; j < MB; j++) {                                                                             \
            vec xv = VLOAD(x + j * ldx + k);                                                                       \
            if (KEEP) KEEP_X(xv);                                                                                  \
            for (int i = 0; i < NB; i++) acc[i][j] = VFMA(wv[i], xv, acc[i][j]);                                   \
        }                                                                                                          \
    }                                                                                                              \
    float sums[(NB * MB + LANES - 1) / LANES * LANES];                                                             \
    if (NB * MB >= SUMS_FROM)                                                                                      \
        for (int g = 0; g < NB * MB; g += LANES) {                                                                 \
            vec t[LANES];                                                                                          \
            for (int u = 0; u < LANES; u++)                                                                        \
                t[u] = g + u < NB * MB ? acc[(g + u) / MB][(g + u) % MB] : VZERO();                                \
            VSTORE(sums + g, vsums(t));                                                                            \
        }                                                                                                          \
    for (int i = 0; i < NB; i++)                                                                                   \
        for (int j = 0; j < MB; j++) {                                                                             \
            float s = NB * MB >= SUMS_FROM ? sums[i * MB + j] : vsum(acc[i][j]);                                   \
            for (int64_t t = k; t < K; t++) s = fmaf(x[j * ldx + t], T##_SCALAR(w + i * K + t), s);                \
            if (b) s += b[i];                                                                                      \
            y[j * ldy + i] = s;                                                                                    \
        }                                                                                                          \
}

/* A block of at least SUMS_FROM sums reduces them LANES at a time (`vsums`: vsum's additions, transposed); fewer
   reduce one by one. */
#ifndef SUMS_FROM
#define SUMS_FROM (LANES / 2)
#endif

/* y (M x N, row stride ldy) = x (M x K, row stride ldx) . w^T, w (N x K) contiguous; b (N, float32) or NULL.
   Blocks by the rows of the call: 1-2 rows one weight row a block (it streams fastest); from WIDE_FROM rows
   WIDE_NB weight rows x up to WIDE_MB input rows, the weights streamed from memory once for them; from TALL_FROM
   rows TALL_NB weight rows x up to TALL_MB input rows (each weight chunk loaded once for TALL_MB rows) where the
   input rows stay in L1 (K <= TALL_K; at K = 1536 they do not, and 3 x 8 ran 20% slower than 4 x 4 passes while
   each sum was reduced on its own), or, with AVX-512, where the rows fill whole tall blocks (TALL_LONG: since the
   sums are reduced LANES at a time, `vsums`, one 3 x 8 pass over K = 1536 took ~0.79x the time of two 4 x 4 passes
   at 8 rows, but 3 x 6 and 3 x 7 ran 1.1-1.3x slower than 4 x 4 and 4 x 2-3; Zen 4, docs/engine.md thirty-fifth
   session).
   The shapes are by vector width (-D overrides them, to measure others):
   - AVX-512 (32 registers): 4 x 4 and 3 x 8 (24 sums in registers: 8 rows 15-30% faster than two 4 x 4 passes,
     Zen 5, docs/engine.md sixteenth session);
   - AVX2 (16 registers): 4 x 4 and 2 x 6. A 3 x 8 block's 24 sums spill to the stack on every chunk there; of the
     tall shapes whose 12-16 sums fit, 2 x 6 ran fastest, and the wide 4 x 4 still beat 4 x 2, 4 x 3 and 3 x 4 at
     3-4 rows (Zen 3, docs/engine.md twenty-sixth session).
   Any shape gives the same bits (above). */
#ifndef WIDE_NB
#define WIDE_NB 4
#define WIDE_MB 4
#if LANES == 16
#define TALL_NB 3
#define TALL_MB 8
#else
#define TALL_NB 2
#define TALL_MB 6
#endif
#endif
#ifndef WIDE_FROM
#define WIDE_FROM 3
#endif
#ifndef TALL_FROM
#define TALL_FROM 5
#endif
#ifndef TALL_LONG
#define TALL_LONG (LANES == 16)
#endif
#ifndef TALL_KEEP
#define TALL_KEEP 1
#endif
#ifndef TALL_K
#define TALL_K 768
#endif
/* bfloat16 weights take the 4-weight-row blocks from one row on: a lone weight row's chain of FMAs (K / LANES long,
   each waiting for the one before) streams half the bytes of a float32 row per cycle, below the memory's rate, and
   four chains kept up (Zen 4, three alternating rounds: 1-2 rows 5-30% faster on the draft's 1536x576 and
   8192x576 shapes, 576x1536 at one row ~6% slower; docs/engine.md, twentieth session). No bit changes: each
   output sums the same k-chunks in the same order in any block. */
/* The outputs left to one weight row a block (all of a 1-2-row call's) go in one loop over those rows, the weights
   prefetched NARROW_PF bytes ahead: with a call an output (~150 K calls a one-token step of the testbed) the
   one-row step's linears ran at the memory's rate in one build of this source and ~8% slower in the next, from
   where the compiler happened to place the code (Zen 4, docs/engine.md thirty-sixth session); the loop and the
   prefetch keep enough of the stream in flight whatever the placement. ~The bytes the memory delivers in its
   latency: 8 KB ahead ran 1.35x slower there. */
#ifndef NARROW_PF
#define NARROW_PF 2048
#endif
#define NARROW_AHEAD(WT) (NARROW_PF / (int64_t)sizeof(WT))
#define NARROW_RUN(T, WT, MB)                                                                                      \
static void T##_narrow_run_##MB(const float *x, int64_t ldx, const WT *w, int64_t K, const float *b, float *y,     \
                                int64_t ldy, int64_t N) {                                                          \
    for (int64_t n = 0; n < N; n++)                                                                                \
        T##_narrow_##MB(x, ldx, w + n * K, K, b ? b + n : 0, y + n, ldy, NARROW_PF > 0);                          \
}
#define F32_WIDE_FROM_1 0
#define BF16_WIDE_FROM_1 1
#define F16_WIDE_FROM_1 1
#define I8_WIDE_FROM_1 1
#define LINEAR(T, WT)                                                                                              \
BLOCK(T, WT, wide, WIDE_NB, 1, 0, 0) BLOCK(T, WT, wide, WIDE_NB, 2, 0, 0)                                          \
BLOCK(T, WT, wide, WIDE_NB, 3, 0, 0) BLOCK(T, WT, wide, WIDE_NB, 4, 0, 0)                                          \
BLOCK(T, WT, tall, TALL_NB, 1, TALL_KEEP, 0) BLOCK(T, WT, tall, TALL_NB, 2, TALL_KEEP, 0)                          \
BLOCK(T, WT, tall, TALL_NB, 3, TALL_KEEP, 0) BLOCK(T, WT, tall, TALL_NB, 4, TALL_KEEP, 0)                          \
BLOCK(T, WT, tall, TALL_NB, 5, TALL_KEEP, 0) BLOCK(T, WT, tall, TALL_NB, 6, TALL_KEEP, 0)                          \
BLOCK(T, WT, tall, TALL_NB, 7, TALL_KEEP, 0) BLOCK(T, WT, tall, TALL_NB, 8, TALL_KEEP, 0)                          \
BLOCK(T, WT, narrow, 1, 1, 0, NARROW_AHEAD(WT)) BLOCK(T, WT, narrow, 1, 2, 0, NARROW_AHEAD(WT))                    \
BLOCK(T, WT, narrow, 1, 3, 0, NARROW_AHEAD(WT)) BLOCK(T, WT, narrow, 1, 4, 0, NARROW_AHEAD(WT))                    \
typedef void (*T##_block_fn)(const float *, int64_t, const WT *, int64_t, const float *, float *, int64_t, int);    \
NARROW_RUN(T, WT, 1) NARROW_RUN(T, WT, 2) NARROW_RUN(T, WT, 3) NARROW_RUN(T, WT, 4)                               \
typedef void (*T##_run_fn)(const float *, int64_t, const WT *, int64_t, const float *, float *, int64_t, int64_t); \
static const T##_run_fn T##_NARROW_RUN[5] = {0, T##_narrow_run_1, T##_narrow_run_2, T##_narrow_run_3,              \
                                             T##_narrow_run_4};                                                    \
static const T##_block_fn T##_WIDE[5] = {0, T##_wide_1, T##_wide_2, T##_wide_3, T##_wide_4};                       \
static const T##_block_fn T##_TALL[9] = {0, T##_tall_1, T##_tall_2, T##_tall_3, T##_tall_4,                       \
                                         T##_tall_5, T##_tall_6, T##_tall_7, T##_tall_8};                         \
void linear_##T(const float *x, int64_t ldx, const WT *w, const float *b, float *y, int64_t ldy, int64_t M,         \
                int64_t N, int64_t K) {                                                                            \
    int64_t n = 0;                                                                                                 \
    for (; M >= TALL_FROM && (K <= TALL_K || (TALL_LONG && M % TALL_MB == 0)) && n + TALL_NB <= N;                 \
           n += TALL_NB)                                                                                           \
        for (int64_t m = 0; m < M; m += TALL_MB) {                                                                 \
            int64_t mb = M - m < TALL_MB ? M - m : TALL_MB;                                                        \
            T##_TALL[mb](x + m * ldx, ldx, w + n * K, K, b ? b + n : 0, y + m * ldy + n, ldy,                      \
                         n + 2 * TALL_NB <= N);                                                                    \
        }                                                                                                          \
    for (; (M >= WIDE_FROM || T##_WIDE_FROM_1) && n + WIDE_NB <= N; n += WIDE_NB)                                  \
        for (int64_t m = 0; m < M; m += WIDE_MB) {                                                                 \
            int64_t mb = M - m < WIDE_MB ? M - m : WIDE_MB;                                                        \
            T##_WIDE[mb](x + m * ldx, ldx, w + n * K, K, b ? b + n : 0, y + m * ldy + n, ldy,                      \
                         m == 0 && n + 2 * WIDE_NB <= N);                                                          \
        }                                                                                                          \
    if (n < N)                                                                                                     \
        for (int64_t m = 0; m < M; m += 4) {                                                                       \
            int64_t mb = M - m < 4 ? M - m : 4;                                                                    \
            T##_NARROW_RUN[mb](x + m * ldx, ldx, w + n * K, K, b ? b + n : 0, y + m * ldy + n, ldy, N - n);        \
        }                                                                                                          \
}
LINEAR(F32, float)
LINEAR(BF16, uint16_t)
LINEAR(F16, uint16_t)
LINEAR(I8, int8_t)
