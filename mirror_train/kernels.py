"""Row-exact CPU kernels for float32 decoding: the linear y = x·Wᵀ (+ b) and causal attention over a KV cache, for
the 1–64 rows of a decoding step or a verification window, each output computed in one fixed order whatever the
number of rows. A k-row window therefore equals k one-token steps bit for bit (`Target.exact_windows`), which is
what speculative decoding's verification assumes, and costs about what its arithmetic costs.

Why kernels of our own (docs/engine.md, "The step against the hardware"): at 2–16 rows torch's float32 GEMMs (MKL)
run ~2× slower than a one-row step that is already bound by reading the weights, and they round a row differently
by the rows beside it (a one-row product goes to a GEMV, ~1e-5 apart); torch's fused attention blocks a k-row
causal window differently from one-row decoding, so exactness took k separate attention calls a layer.
- `linear`: streams each weight row once a call and reuses it from L1 for every input row (1 weight row × the 1–2
  input rows a block for calls of 1–2 rows, 4 weight rows × up to 4 input rows, 3 weight rows × up to 8 input rows
  from 5 rows on where 8 input rows fit L1 (2 × up to 6 on AVX2, whose 16 vector registers do not hold 3 × 8's
  sums), the next block's weight rows prefetched: each measured fastest at its rows); per output, explicit FMAs
  over the same k-chunks, then the same horizontal sum, so the block shape changes no bit. One weight stream at a
  time reads memory faster than four interleaved ones: on a Zen 5 core a one-row call over 113–230 MB of weights
  ran at 32 GB/s against 27 (a plain sum reads 34–36; docs/engine.md, fifteenth session).
- `attention`: for each head and query row, the scores over exactly the keys that row sees, a max, exponentials
  (a fixed polynomial) summed in order, and the values accumulated in order: a function of the row's query and its
  keys alone, so a window row is the one-token step at that position.
- `decoder_layer`: a whole pre-norm Llama-shaped decoder layer (RMSNorm, the seven linears above, rotary, the cache
  write, the attention above, SiLU, residuals) in one call, every step row by row, so it keeps the same property
  and spares the ~40 torch ops around each layer's kernels (fused_layer.py decides where it applies);
  `decoder_stack`: consecutive such layers in one call (a target's prefix or suffix: fused_layer.FusedStack).

Built once per machine with the system C compiler (`cc -O3 -march=native`, under a second) into
~/.cache/mirror-train/kernels (or $MIRROR_TRAIN_KERNELS), keyed by the source and the CPU's flags, and loaded with
ctypes (no torch headers, no build step at install). Where there is no compiler, or the build fails, `available()`
is False and callers keep torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mirror_train import alignment
from mirror_train.devices import cpuinfo

RB_MAX = 4  # the attention kernel's rows a group (its source's RB_MAX): its scratch holds their scores
MAX_ROWS = 64  # more rows (a prompt's prefill) are a large GEMM, where torch's own path is the fast one

SOURCE = r"""
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

/* NB weight rows x MB input rows: every output accumulates over the same k-chunks in the same order, so its value
   does not depend on NB, MB or how many rows the call has. pf: prefetch the next block's weight rows into L2.
   KEEP: hold each input chunk in a register (KEEP_X). */
#define BLOCK(T, WT, NAME, NB, MB, KEEP)                                                                           \
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
            if (pf) __builtin_prefetch(w + (i + NB) * K + k, 0, 2);                                                \
        }                                                                                                          \
        for (int j = 0; j < MB; j++) {                                                                             \
            vec xv = VLOAD(x + j * ldx + k);                                                                       \
            if (KEEP) KEEP_X(xv);                                                                                  \
            for (int i = 0; i < NB; i++) acc[i][j] = VFMA(wv[i], xv, acc[i][j]);                                   \
        }                                                                                                          \
    }                                                                                                              \
    for (int i = 0; i < NB; i++)                                                                                   \
        for (int j = 0; j < MB; j++) {                                                                             \
            float s = vsum(acc[i][j]);                                                                             \
            for (int64_t t = k; t < K; t++) s = fmaf(x[j * ldx + t], T##_SCALAR(w + i * K + t), s);                \
            if (b) s += b[i];                                                                                      \
            y[j * ldy + i] = s;                                                                                    \
        }                                                                                                          \
}

/* y (M x N, row stride ldy) = x (M x K, row stride ldx) . w^T, w (N x K) contiguous; b (N, float32) or NULL.
   Blocks by the rows of the call: 1-2 rows one weight row a block (it streams fastest); from WIDE_FROM rows
   WIDE_NB weight rows x up to WIDE_MB input rows, the weights streamed from memory once for them; from TALL_FROM
   rows TALL_NB weight rows x up to TALL_MB input rows (each weight chunk loaded once for TALL_MB rows) where the
   input rows stay in L1 (K <= TALL_K; at K = 1536 they do not, and 3 x 8 ran 20% slower than 4 x 4 passes).
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
#define F32_WIDE_FROM_1 0
#define BF16_WIDE_FROM_1 1
#define LINEAR(T, WT)                                                                                              \
BLOCK(T, WT, wide, WIDE_NB, 1, 0) BLOCK(T, WT, wide, WIDE_NB, 2, 0)                                                \
BLOCK(T, WT, wide, WIDE_NB, 3, 0) BLOCK(T, WT, wide, WIDE_NB, 4, 0)                                                \
BLOCK(T, WT, tall, TALL_NB, 1, TALL_KEEP) BLOCK(T, WT, tall, TALL_NB, 2, TALL_KEEP)                                \
BLOCK(T, WT, tall, TALL_NB, 3, TALL_KEEP) BLOCK(T, WT, tall, TALL_NB, 4, TALL_KEEP)                                \
BLOCK(T, WT, tall, TALL_NB, 5, TALL_KEEP) BLOCK(T, WT, tall, TALL_NB, 6, TALL_KEEP)                                \
BLOCK(T, WT, tall, TALL_NB, 7, TALL_KEEP) BLOCK(T, WT, tall, TALL_NB, 8, TALL_KEEP)                                \
BLOCK(T, WT, narrow, 1, 1, 0) BLOCK(T, WT, narrow, 1, 2, 0)                                                      \
BLOCK(T, WT, narrow, 1, 3, 0) BLOCK(T, WT, narrow, 1, 4, 0)                                                      \
typedef void (*T##_block_fn)(const float *, int64_t, const WT *, int64_t, const float *, float *, int64_t, int);    \
static const T##_block_fn T##_WIDE[5] = {0, T##_wide_1, T##_wide_2, T##_wide_3, T##_wide_4};                       \
static const T##_block_fn T##_TALL[9] = {0, T##_tall_1, T##_tall_2, T##_tall_3, T##_tall_4,                       \
                                         T##_tall_5, T##_tall_6, T##_tall_7, T##_tall_8};                         \
static const T##_block_fn T##_NARROW[5] = {0, T##_narrow_1, T##_narrow_2, T##_narrow_3, T##_narrow_4};             \
void linear_##T(const float *x, int64_t ldx, const WT *w, const float *b, float *y, int64_t ldy, int64_t M,         \
                int64_t N, int64_t K) {                                                                            \
    int64_t n = 0;                                                                                                 \
    for (; M >= TALL_FROM && K <= TALL_K && n + TALL_NB <= N; n += TALL_NB)                                        \
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
    for (; n < N; n++)                                                                                             \
        for (int64_t m = 0; m < M; m += 4) {                                                                       \
            int64_t mb = M - m < 4 ? M - m : 4;                                                                    \
            T##_NARROW[mb](x + m * ldx, ldx, w + n * K, K, b ? b + n : 0, y + m * ldy + n, ldy, 0);                \
        }                                                                                                          \
}
LINEAR(F32, float)
LINEAR(BF16, uint16_t)

/* The same product on weights stored as panels: LANES weight rows interleaved, k-major (P[N/LANES][K][LANES], the
   last panel padded with zero rows; `kernels.to_panels`). A tile of R input rows x C panels keeps R x C vectors of
   sums, each lane one output: every k it loads C weight vectors and broadcasts R inputs, so no horizontal sums
   remain, and each panel is one contiguous stream. Every output is the chain fma(x[k], w[k], s) over k = 0..K-1
   from s = 0, then + bias, in any tile: a row's outputs do not depend on the rows of the call (row-exact), and they
   differ from the row layout's (LANES partial sums) in the last bits. On an AVX2-only Zen 3 core a one-row step's
   linears took 0.66x and eight rows 0.77x the row layout's time (docs/engine.md, twenty-seventh session): a lone
   weight row's single FMA chain left the row layout's one-row call at ~19 GB/s. The tiles by R (C: as many panels
   as the registers hold beside R x C sums; one row takes 8 for its 8 independent chains): */
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
/* Tiles of PANEL_PF_FROM rows and more prefetch each panel PANEL_PF bytes ahead (non-temporal: read once); left to
   the hardware prefetcher they waited on memory. The distance reaches a few panels ahead (a panel is 9-18 KB at
   K = 576), into the tiles that come next: on Zen 3 64 KB against the 4 KB first tried took float32's 3-6 rows 0.82-
   0.88x the time and bfloat16's 2-5 rows 0.74-0.79x, 8 rows ~0.97x (docs/engine.md, twenty-eighth session). One
   row, which streams eight panels at once, ran slower with it. No change to the arithmetic. */
#ifndef PANEL_PF
#define PANEL_PF 65536
#endif
#ifndef PANEL_PF_FROM
#define PANEL_PF_FROM 2
#endif
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
#define PTILE_BF16(NAME, R, C)                                                                                     \
static void NAME(const float *x, int64_t ldx, const uint16_t *p, int64_t K, const float *b, float *y, int64_t ldy) { \
    PTILE_OPEN(R, C)                                                                                               \
    const int64_t cs = BF16_PSTRIDE(K);                                                                            \
    int64_t k = 0;                                                                                                 \
    for (; R >= BF16_BY_ROW && k + 2 <= K; k += 2, p += 2 * LANES) {                                               \
        vec lo[C], hi[C];                                                                                          \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                      \
            BF16_PAIR(p + c * cs, lo[c], hi[c]);                                                                   \
            if (R >= PANEL_PF_FROM) __builtin_prefetch((const char *)(p + c * cs) + PANEL_PF, 0, 0);               \
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
            if (R >= PANEL_PF_FROM) __builtin_prefetch((const char *)(p + c * cs) + PANEL_PF, 0, 0);               \
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
#define PTILE_F32(NAME, R, C)                                                                                      \
static void NAME(const float *x, int64_t ldx, const float *p, int64_t K, const float *b, float *y, int64_t ldy) {  \
    PTILE_OPEN(R, C)                                                                                               \
    const int64_t cs = F32_PSTRIDE(K);                                                                             \
    for (int64_t k = 0; k < K; k++, p += LANES) {                                                                  \
        vec w[C];                                                                                                  \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                      \
            w[c] = F32_LOAD(p + c * cs);                                                                           \
            if (R >= PANEL_PF_FROM) __builtin_prefetch((const char *)(p + c * cs) + PANEL_PF, 0, 0);               \
        }                                                                                                          \
        PTILE_FMA(R, C, w, k);                                                                                     \
    }                                                                                                              \
    PTILE_CLOSE(R, C)                                                                                              \
}
/* R rows over `panels` panels: tiles of C, then one panel at a time */
#define PTILES(T, WT, R, C) PTILES_(T, WT, R, C)
#define PTILES_(T, WT, R, C)                                                                                       \
PTILE_##T(T##_ptile_##R##_##C, R, C) PTILE_##T(T##_ptile_##R##_one, R, 1)                                       \
static void T##_ptile_##R(const float *x, int64_t ldx, const WT *p, int64_t K, const float *b, float *y,            \
                          int64_t ldy, int64_t panels) {                                                           \
    int64_t c = 0;                                                                                                 \
    for (; c + C <= panels; c += C)                                                                                \
        T##_ptile_##R##_##C(x, ldx, p + c * T##_PSTRIDE(K), K, b ? b + c * LANES : 0, y + c * LANES, ldy);         \
    for (; c < panels; c++)                                                                                        \
        T##_ptile_##R##_one(x, ldx, p + c * T##_PSTRIDE(K), K, b ? b + c * LANES : 0, y + c * LANES, ldy);         \
}
#define PANEL_TILES(T, WT, PC)                                                                                     \
PTILES(T, WT, 1, PC##1) PTILES(T, WT, 2, PC##2) PTILES(T, WT, 3, PC##3) PTILES(T, WT, 4, PC##4)                    \
PTILES(T, WT, 5, PC##5) PTILES(T, WT, 6, PC##6) PTILES(T, WT, 7, PC##7) PTILES(T, WT, 8, PC##8)                    \
typedef void (*T##_prow_fn)(const float *, int64_t, const WT *, int64_t, const float *, float *, int64_t, int64_t); \
static const T##_prow_fn T##_PROWS[9] = {0, T##_ptile_1, T##_ptile_2, T##_ptile_3, T##_ptile_4, T##_ptile_5,      \
                                         T##_ptile_6, T##_ptile_7, T##_ptile_8};                                  \
void linear_panels_##T(const float *x, int64_t ldx, const WT *p, const float *b, float *y, int64_t ldy, int64_t M, \
                       int64_t N, int64_t K) {                                                                     \
    /* p: the panels of an N x K weight (N rounded up to LANES), b: N biases or NULL. Whole panels straight into y; \
       the last, partial one (N % LANES outputs) through a small buffer. */                                       \
    int64_t full = N / LANES;                                                                                      \
    for (int64_t c0 = 0; c0 < full; c0 += PANEL_CHUNK) {                                                           \
        int64_t panels = full - c0 < PANEL_CHUNK ? full - c0 : PANEL_CHUNK;                                        \
        for (int64_t m = 0; m < M; m += 8) {                                                                       \
            int64_t r = M - m < 8 ? M - m : 8;                                                                     \
            T##_PROWS[r](x + m * ldx, ldx, p + c0 * T##_PSTRIDE(K), K, b ? b + c0 * LANES : 0,                    \
                         y + m * ldy + c0 * LANES, ldy, panels);                                                   \
        }                                                                                                          \
    }                                                                                                              \
    int64_t rest = N - full * LANES;                                                                               \
    if (rest) {                                                                                                    \
        float buf[8 * LANES], bias[LANES];                                                                         \
        for (int64_t i = 0; i < LANES; i++) bias[i] = b && i < rest ? b[full * LANES + i] : 0.0f;                  \
        for (int64_t m = 0; m < M; m += 8) {                                                                       \
            int64_t r = M - m < 8 ? M - m : 8;                                                                     \
            T##_PROWS[r](x + m * ldx, ldx, p + full * T##_PSTRIDE(K), K, b ? bias : 0, buf, LANES, 1);             \
            for (int64_t j = 0; j < r; j++)                                                                        \
                for (int64_t i = 0; i < rest; i++) y[(m + j) * ldy + full * LANES + i] = buf[j * LANES + i];       \
        }                                                                                                          \
    }                                                                                                              \
}
PANEL_TILES(F32, float, PC)
PANEL_TILES(BF16, uint16_t, BPC)
int kernel_lanes(void) { return LANES; }

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
            if (R >= PANEL_PF_FROM) __builtin_prefetch((const char *)(p + c * cs) + PANEL_PF, 0, 0);               \
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

static float screen_max(const float *a, int64_t n) {
    float m = -INFINITY;
    int64_t v = 0;
#if LANES == 16
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; v + 16 <= n; v += 16) mv = _mm512_max_ps(_mm512_loadu_ps(a + v), mv);
    m = _mm512_reduce_max_ps(mv);
#elif LANES == 8
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; v + 8 <= n; v += 8) mv = _mm256_max_ps(_mm256_loadu_ps(a + v), mv);
    float t[8];
    _mm256_storeu_ps(t, mv);
    for (int i = 0; i < 8; i++) m = t[i] > m ? t[i] : m;
#endif
    for (; v < n; v++) m = a[v] > m ? a[v] : m;
    return m;
}

/* The screen's candidates: every output v < n that could be the largest of a row's exact logits, in order, each
   once, into out; returns how many, or -1 where a bound is not finite (the caller takes the whole head).
   a: the screened logits (M rows, lda apart) of the float32 rows x (M x K); dot: x was rounded to bfloat16 (the
   dot product's screen), else read as it is (widened bfloat16 weights). c: the head's constants (screened_head.py):
   max over v of |w^_v - w_v| + g |w^_v|, max of |w_v|, g, what flushed subnormals add. With x^ the screen's x, a
   row's bound is e = |x^| c0 + (g |x| + |x^ - x|) c1 + c3 (norms in double), and v is a candidate iff
   a_v >= max_u a_u - 2e: the exact maximum is >= max a - e, and any v reaching it has a_v >= it - e. */
int64_t screen_select(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int dot,
                      const double *c, int64_t *out) {
    double floors[64];
    if (M > 64) return -1;
    for (int64_t r = 0; r < M; r++) {
        double nx = 0, nl = 0, nd = 0;
        for (int64_t k = 0; k < K; k++) {
            double v = x[r * K + k], l = dot ? (double)screen_f32_of(screen_bf16_of(x[r * K + k])) : v;
            nx += v * v, nl += l * l, nd += (l - v) * (l - v);
        }
        double e = (sqrt(nl) * c[0] + (c[2] * sqrt(nx) + sqrt(nd)) * c[1] + c[3]) * (1 + 1e-9);
        floors[r] = (double)screen_max(a + r * lda, n) - 2 * e;
        if (!isfinite(floors[r])) return -1;
    }
    int64_t count = 0, v = 0;
#if LANES == 16
    for (; v + 16 <= n; v += 16) {
        __mmask16 hit = 0;
        for (int64_t r = 0; r < M; r++) {  /* a float32 threshold at or below the floor: never fewer candidates */
            float t = (float)floors[r];
            if ((double)t > floors[r]) t = nextafterf(t, -INFINITY);
            hit |= _mm512_cmp_ps_mask(_mm512_loadu_ps(a + r * lda + v), _mm512_set1_ps(t), _CMP_GE_OQ);
        }
        while (hit) {
            out[count++] = v + __builtin_ctz(hit);
            hit &= hit - 1;
        }
    }
#endif
    for (; v < n; v++)
        for (int64_t r = 0; r < M; r++)
            if ((double)a[r * lda + v] >= floors[r]) {
                out[count++] = v;
                break;
            }
    return count;
}

/* exp(x) for x <= 0 (a softmax's shifted scores): Cephes' expf polynomial after x = n ln2 + r, times 2^n. */
#if LANES == 16
#define VSET(c) _mm512_set1_ps(c)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFNMADD(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define VROUND(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2(p, n) _mm512_scalef_ps(p, n)
#define VDIV(a, b) _mm512_div_ps(a, b)
#elif LANES == 8
#define VSET(c) _mm256_set1_ps(c)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFNMADD(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define VROUND(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VPOW2(p, n) /* the exponent field of 2^n built directly */ \
    _mm256_mul_ps(p, _mm256_castsi256_ps(                           \
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)))
#endif
#if LANES > 1
static inline vec vexp(vec x) {
    x = VMAX(x, VSET(-87.0f));
    vec n = VROUND(VMUL(x, VSET(1.44269504f)));
    vec r = VFNMADD(n, VSET(0.693359375f), x);
    r = VFNMADD(n, VSET(-2.12194440e-4f), r);
    vec p = VSET(1.9875691500e-4f);
    p = VFMA(p, r, VSET(1.3981999507e-3f));
    p = VFMA(p, r, VSET(8.3334519073e-3f));
    p = VFMA(p, r, VSET(4.1665795894e-2f));
    p = VFMA(p, r, VSET(1.6666665459e-1f));
    p = VFMA(p, r, VSET(5.0000001201e-1f));
    p = VFMA(p, VMUL(r, r), VADD(r, VSET(1.0f)));
    return VPOW2(p, n);
}
#else
static inline vec vexp(vec x) { return expf(x); }
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
    vec acc = VZERO();
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) acc = VFMA(VLOAD(a + d), VLOAD(b + d), acc);
    float s = vsum(acc);
    for (; d < D; d++) s = fmaf(a[d], b[d], s);
    return s;
}

/* Causal attention of M query rows at the end of a cache of L positions (row i sees keys 0..L-M+i), grouped-query
   heads: q (H heads x M rows x D, strides q_sh, q_sm), k / v (KVH heads x L x D, strides kv_sh, kv_sl),
   out (M x H x D, contiguous), scratch: RB_MAX x L floats. Every (head, row) is a function of its query and the
   keys it sees alone: the same arithmetic in the same order whatever M.
   A forked window (two chains verified at once, kernels.attention's `rows`): row i sees keys 0..n1[i]-1 and then
   s2[i]..s2[i]+n2[i]-1, in that order; its scores fill the scratch from index 0 exactly as the contiguous keys of
   the same path would in one-token decoding, so the row is bit for bit that decoding step. n1 NULL: causal.

   Per (head, row): s_l = vsum(sum over the D/LANES chunks of q*k_l, in order) * scale; the max; e_l = exp(s_l - max)
   and their total, in order; o = sum_l e_l v_l accumulated in l order (one FMA per element and key); o / total.
   Up to RB_MAX rows of a head go together over the keys they all see (`att_rows`): each key and value row is loaded
   once for all of them, and their sums stay in registers, instead of re-reading K and V from the cache once a row
   and storing the partial output every key (measured 4-7x slower a row at 800-1600 keys, docs/engine.md). Every
   row still does exactly its own arithmetic in its own order, so grouping changes no bit. */
#define RB_MAX 4
#define NV_MAX 16

/* One row's keys from `from` to `seen` (and its first run's before it when from = 0), its exponentials, its output:
   the general path (a head size that is not a multiple of the vector width, the rows' own keys past a group's). */
static void att_scores_tail(const float *qi, const float *kh, int64_t kv_sl, float *s, int64_t from, int64_t seen,
                            int64_t first, int64_t jump, int64_t D, float scale, float *mx) {
    for (int64_t l = from; l < seen; l++) {
        s[l] = dot(qi, kh + (l < first ? l : l + jump) * kv_sl, D) * scale;
        *mx = s[l] > *mx ? s[l] : *mx;
    }
}

static float att_exp(float *s, int64_t seen, float mx) {
    vec vmx = VSET(mx), vtot = VZERO();
    int64_t l = 0;
    for (; l + LANES <= seen; l += LANES) {
        vec e = vexp(VSUB(VLOAD(s + l), vmx));
        VSTORE(s + l, e);
        vtot = VADD(vtot, e);
    }
    float total = vsum(vtot);
    for (; l < seen; l++) {
        s[l] = expf(s[l] - mx);
        total += s[l];
    }
    return total;
}

static void att_values_tail(const float *vh, int64_t kv_sl, const float *s, float *o, int64_t from, int64_t seen,
                            int64_t first, int64_t jump, int64_t D) {
    for (int64_t l2 = from; l2 < seen; l2++) {
        vec p = VSET(s[l2]);
        const float *vl = vh + (l2 < first ? l2 : l2 + jump) * kv_sl;
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) VSTORE(o + d, VFMA(p, VLOAD(vl + d), VLOAD(o + d)));
        for (; d < D; d++) o[d] = fmaf(s[l2], vl[d], o[d]);
    }
}

#if LANES == 16
/* vsum of 16 vectors at once, each the same additions as vsum's in the same order (halves, quarters, then the
   pairs of a quarter, then its two), transposed so that 16 sums take 15 additions: lane j of the result is a[j]'s */
static inline vec vsum16(const vec *a) {
    vec h[8], q[4], p[2];
    for (int t = 0; t < 8; t++)  /* v[j] + v[j+8] */
        h[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int u = 0; u < 4; u++)  /* h[j] + h[j+4]: 128-bit lane k holds key 4u+k */
        q[u] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int w = 0; w < 2; w++)  /* q0 + q2, q1 + q3 */
        p[w] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * w], q[2 * w + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(q[2 * w], q[2 * w + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* q'0 + q'1: element 4k+m is key 4m+k, put back in key order */
    vec r = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
#endif

#if LANES > 1
/* rb rows of one head over their shared keys 0..J-1 (nv = D / LANES vectors a row): their scores and maxima, then,
   after the caller's exponentials, their outputs. Inlined with constant nv and rb so the sums live in registers. */
static inline __attribute__((always_inline)) void att_rows_scores(int nv, int rb, const float *const *q,
                                                                  const float *kh, int64_t kv_sl, float *const *s,
                                                                  int64_t J, float scale, float *mx) {
    vec qv[RB_MAX][NV_MAX];
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < nv; c++) qv[r][c] = VLOAD(q[r] + c * LANES);
    int64_t l = 0;
#if LANES == 16
    /* 16 keys at a time: their 16 sums reduced together (`vsum16`, vsum's additions in vsum's order) */
    vec vmx[RB_MAX];
    for (int r = 0; r < rb; r++) vmx[r] = VSET(-INFINITY);
    for (; l + 16 <= J; l += 16)
        for (int r = 0; r < rb; r++) {
            vec a[16];
            for (int j = 0; j < 16; j++) {
                const float *kl = kh + (l + j) * kv_sl;
                a[j] = VZERO();
                for (int c = 0; c < nv; c++) a[j] = VFMA(qv[r][c], VLOAD(kl + c * LANES), a[j]);
            }
            vec x = VMUL(vsum16(a), VSET(scale));
            VSTORE(s[r] + l, x);
            vmx[r] = VMAX(vmx[r], x);
        }
    for (int r = 0; r < rb; r++) {
        float m = _mm512_reduce_max_ps(vmx[r]);
        mx[r] = m > mx[r] ? m : mx[r];
    }
#endif
    for (; l < J; l++) {
        const float *kl = kh + l * kv_sl;
        vec kv[NV_MAX];
        for (int c = 0; c < nv; c++) kv[c] = VLOAD(kl + c * LANES);
        for (int r = 0; r < rb; r++) {
            vec acc = VZERO();
            for (int c = 0; c < nv; c++) acc = VFMA(qv[r][c], kv[c], acc);
            float x = vsum(acc) * scale;
            s[r][l] = x;
            mx[r] = x > mx[r] ? x : mx[r];
        }
    }
}

static inline __attribute__((always_inline)) void att_rows_values(int nv, int rb, const float *vh, int64_t kv_sl,
                                                                  const float *const *s, float *const *o, int64_t J) {
    vec acc[RB_MAX][NV_MAX];
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = VZERO();
    for (int64_t l = 0; l < J; l++) {
        const float *vl = vh + l * kv_sl;
        for (int c = 0; c < nv; c++) {
            vec v = VLOAD(vl + c * LANES);
            for (int r = 0; r < rb; r++) acc[r][c] = VFMA(VSET(s[r][l]), v, acc[r][c]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < nv; c++) VSTORE(o[r] + c * LANES, acc[r][c]);
}

/* The instances: nv in {2, 4, 8, 16} (head sizes 2..16 vectors), as many rows as the registers hold. */
#define ATT_INSTANCE(NV, RB)                                                                                       \
static void att_scores_##NV##_##RB(const float *const *q, const float *kh, int64_t kv_sl, float *const *s,          \
                                   int64_t J, float scale, float *mx) {                                            \
    att_rows_scores(NV, RB, q, kh, kv_sl, s, J, scale, mx);                                                        \
}                                                                                                                  \
static void att_values_##NV##_##RB(const float *vh, int64_t kv_sl, const float *const *s, float *const *o,          \
                                   int64_t J) {                                                                    \
    att_rows_values(NV, RB, vh, kv_sl, s, o, J);                                                                   \
}
#define ATT_NV(NV) ATT_INSTANCE(NV, 1) ATT_INSTANCE(NV, 2) ATT_INSTANCE(NV, 3) ATT_INSTANCE(NV, 4)
ATT_NV(2) ATT_NV(4) ATT_NV(8) ATT_NV(16)
typedef void (*att_scores_fn)(const float *const *, const float *, int64_t, float *const *, int64_t, float, float *);
typedef void (*att_values_fn)(const float *, int64_t, const float *const *, float *const *, int64_t);
#define ATT_ROW(NV) {0, att_scores_##NV##_1, att_scores_##NV##_2, att_scores_##NV##_3, att_scores_##NV##_4}
#define ATT_VROW(NV) {0, att_values_##NV##_1, att_values_##NV##_2, att_values_##NV##_3, att_values_##NV##_4}
static const att_scores_fn ATT_SCORES[4][RB_MAX + 1] = {ATT_ROW(2), ATT_ROW(4), ATT_ROW(8), ATT_ROW(16)};
static const att_values_fn ATT_VALUES[4][RB_MAX + 1] = {ATT_VROW(2), ATT_VROW(4), ATT_VROW(8), ATT_VROW(16)};
#endif

void attention_f32(const float *q, int64_t q_sh, int64_t q_sm, const float *k, const float *v, int64_t kv_sh,
                   int64_t kv_sl, float *out, float *scratch, int64_t M, int64_t H, int64_t KVH, int64_t L, int64_t D,
                   float scale, const int64_t *n1, const int64_t *s2, const int64_t *n2) {
    int64_t group = H / KVH;
    int which = -1, rb_max = 1;  /* the grouped instance for this head size, and its rows a group */
#if LANES > 1
    if (D % LANES == 0) {
        int64_t nv = D / LANES;
        which = nv == 2 ? 0 : nv == 4 ? 1 : nv == 8 ? 2 : nv == 16 ? 3 : -1;
        /* the registers: rb rows' queries (or sums) of nv vectors each, and a key's nv vectors */
        rb_max = nv <= (LANES == 16 ? 4 : 2) ? RB_MAX : nv <= (LANES == 16 ? 8 : 4) ? 2 : 1;
    }
#endif
    /* The (head, row) pairs that read one KV head go in groups of rb_max, rows within a head first: a one-row step
       reads each KV head once for the `group` query heads that share it, not once a query head. */
    int64_t pairs = group * M;
    for (int64_t g = 0; g < KVH; g++) {
        const float *kh = k + g * kv_sh, *vh = v + g * kv_sh;
        for (int64_t p0 = 0; p0 < pairs; p0 += rb_max) {
            int rb = pairs - p0 < rb_max ? (int)(pairs - p0) : rb_max;
            const float *qs[RB_MAX];
            float *ss[RB_MAX], *os[RB_MAX], mx[RB_MAX], total[RB_MAX];
            int64_t first[RB_MAX], seen[RB_MAX], jump[RB_MAX], shared = L;
            for (int r = 0; r < rb; r++) {
                int64_t h = g * group + (p0 + r) / M, i = (p0 + r) % M;
                qs[r] = q + h * q_sh + i * q_sm;
                ss[r] = scratch + r * L;
                os[r] = out + (i * H + h) * D;
                first[r] = n1 ? n1[i] : L - M + i + 1;  /* keys 0..first-1, then the second run */
                seen[r] = n1 ? first[r] + n2[i] : first[r];
                jump[r] = n1 ? s2[i] - first[r] : 0;    /* key index = l for l < first, l + jump after */
                mx[r] = -INFINITY;
                shared = first[r] < shared ? first[r] : shared;  /* keys every row of the group sees, in order */
            }
            if (which < 0) shared = 0;
#if LANES > 1
            if (shared > 0) ATT_SCORES[which][rb](qs, kh, kv_sl, ss, shared, scale, mx);
#endif
            for (int r = 0; r < rb; r++) {
                att_scores_tail(qs[r], kh, kv_sl, ss[r], shared, seen[r], first[r], jump[r], D, scale, &mx[r]);
                total[r] = att_exp(ss[r], seen[r], mx[r]);
            }
#if LANES > 1
            if (shared > 0) ATT_VALUES[which][rb](vh, kv_sl, (const float *const *)ss, os, shared);
#endif
            for (int r = 0; r < rb; r++) {
                float *o = os[r];
                if (shared == 0)
                    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                att_values_tail(vh, kv_sl, ss[r], o, shared, seen[r], first[r], jump[r], D);
                float inv = 1.0f / total[r];
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
    }
}

/* One pre-norm decoder layer (Llama, Mistral, Qwen2: RMSNorm, rotary q/k, grouped-query attention, SiLU-gated MLP)
   over M rows, in float32, every step a function of its row alone (the norms, the rotary, the gate, the linears and
   the attention above), so a window is still its one-token steps bit for bit. x (M x H) is updated in place; k and
   v of the rows are written into the cache buffers at positions past..past+M-1 (after rope, for k); L = past + M.
   One call a layer instead of ~40 torch ops and 7 linear calls (the Python around them cost ~5 ms of a ~23 ms
   one-token step of the testbed, Zen 5: docs/engine.md sixteenth session). */
static void rms_norm(const float *x, const float *w, float eps, float *out, int64_t M, int64_t H) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * H;
        vec acc = VZERO();
        int64_t d = 0;
        for (; d + LANES <= H; d += LANES) { vec v = VLOAD(xr + d); acc = VFMA(v, v, acc); }
        float ss = vsum(acc);
        for (; d < H; d++) ss = fmaf(xr[d], xr[d], ss);
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (d = 0; d < H; d++) out[m * H + d] = w[d] * (xr[d] * r);
    }
}

/* q (M x heads x D) rotated in place: x*cos + rotate_half(x)*sin, rotate_half(x) = (-x[D/2:], x[:D/2]) */
static void rotary(float *q, int64_t M, int64_t heads, int64_t D, const float *cos, const float *sin) {
    int64_t half = D / 2;
    float tmp[512];
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < heads; h++) {
            float *r = q + (m * heads + h) * D;
            const float *c = cos + m * D, *s = sin + m * D;
            for (int64_t d = 0; d < D; d++) tmp[d] = r[d];
            for (int64_t d = 0; d < half; d++) r[d] = tmp[d] * c[d] + (-tmp[d + half]) * s[d];
            for (int64_t d = half; d < D; d++) r[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
        }
}

#if LANES > 1
static inline vec vsilu(vec g) {  /* g / (1 + exp(-g)), exp over the whole float range */
    vec e = vexp(VSUB(VZERO(), VMAX(g, VSET(-88.0f))));
    return VDIV(g, VADD(VSET(1.0f), e));
}
#endif

/* one of the layer's linears on its weights' type: float32, or bfloat16 widened on load (wbf16) */
#define LAYER_LINEAR(x, ldx, i, y, ldy, N, K)                                                                       \
    (wpanels == 2 ? linear_dot(x, ldx, (const uint16_t *)w[i], b[i], y, ldy, M, N, K, pr) :                          \
    wpanels ? (wbf16 ? linear_panels_BF16(x, ldx, (const uint16_t *)w[i], b[i], y, ldy, M, N, K)                    \
                      : linear_panels_F32(x, ldx, (const float *)w[i], b[i], y, ldy, M, N, K))                      \
             : (wbf16 ? linear_BF16(x, ldx, (const uint16_t *)w[i], b[i], y, ldy, M, N, K)                          \
                      : linear_F32(x, ldx, (const float *)w[i], b[i], y, ldy, M, N, K)))

void decoder_layer_f32(float *x, int64_t M, int64_t H, const float *ln1, const float *ln2, float eps,
                       const void *const *w, const float *const *b, int64_t I, int64_t NH, int64_t KVH, int64_t D,
                       const float *cos, const float *sin, float *kbuf, float *vbuf, int64_t kv_sh, int64_t kv_sl,
                       int64_t past, float scale, const int64_t *n1, const int64_t *s2, const int64_t *n2,
                       float *scratch, int wbf16, int wpanels) {
    /* w: q, k, v, o, gate, up, down (N x K row-major, or as panels: wpanels 1, or bfloat16 panels on the dot product
       with the inputs rounded to bfloat16: wpanels 2; all float32 or all bfloat16: wbf16);
       b: float32 biases or NULL. The activations, the cache and every sum are float32 either way. */
    int64_t QD = NH * D, KD = KVH * D, L = past + M;
    float *n = scratch, *q = n + M * H, *k = q + M * QD, *v = k + M * KD, *att = v + M * KD, *g = att + M * QD;
    /* pr: the dot product's bfloat16 inputs (wpanels 2), as: the attention's RB_MAX x L scores */
    int64_t PW = ((H > QD ? (H > I ? H : I) : (QD > I ? QD : I)) + 1) / 2;
    float *u = g + M * I, *o = u + M * I;
    uint32_t *pr = (uint32_t *)(o + M * H);
    float *as = (float *)(pr + M * PW);
    rms_norm(x, ln1, eps, n, M, H);
    LAYER_LINEAR(n, H, 0, q, QD, QD, H);
    LAYER_LINEAR(n, H, 1, k, KD, KD, H);
    LAYER_LINEAR(n, H, 2, v, KD, KD, H);
    rotary(q, M, NH, D, cos, sin);
    rotary(k, M, KVH, D, cos, sin);
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t d = 0; d < D; d++) {
                kbuf[h * kv_sh + (past + m) * kv_sl + d] = k[(m * KVH + h) * D + d];
                vbuf[h * kv_sh + (past + m) * kv_sl + d] = v[(m * KVH + h) * D + d];
            }
    attention_f32(q, D, QD, kbuf, vbuf, kv_sh, kv_sl, att, as, M, NH, KVH, L, D, scale, n1, s2, n2);
    LAYER_LINEAR(att, QD, 3, o, H, H, QD);
    for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + o[i];
    rms_norm(x, ln2, eps, n, M, H);
    LAYER_LINEAR(n, H, 4, g, I, I, H);
    LAYER_LINEAR(n, H, 5, u, I, I, H);
    for (int64_t m = 0; m < M; m++) {  /* row by row: a row's elements take the same path whatever M */
        float *gr = g + m * I, *ur = u + m * I;
        int64_t t = 0;
#if LANES > 1
        for (; t + LANES <= I; t += LANES) VSTORE(gr + t, VMUL(vsilu(VLOAD(gr + t)), VLOAD(ur + t)));
#endif
        for (; t < I; t++) gr[t] = gr[t] / (1.0f + expf(-gr[t])) * ur[t];
    }
    LAYER_LINEAR(g, I, 6, o, H, H, I);
    for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + o[i];
}

/* One layer's part of a `decoder_stack_f32` call (kernels.StackLayer mirrors it field for field). */
typedef struct {
    const float *ln1, *ln2;
    const void *w[7];
    const float *b[7];
    float *kbuf, *vbuf;
    int64_t I, NH, KVH, D, kv_sh, kv_sl;
    float eps, scale;
    int32_t wbf16, wpanels;
} stack_layer;

/* n consecutive decoder layers over the same M rows, one after the other in place on x: each exactly its own
   decoder_layer_f32 call (the same rows, positions, key runs and scratch), one call from Python for all of them
   instead of one a layer (fused_layer.FusedStack). */
void decoder_stack_f32(float *x, int64_t M, int64_t H, int64_t n, const stack_layer *layers, const float *cos,
                       const float *sin, int64_t past, const int64_t *n1, const int64_t *s2, const int64_t *n2,
                       float *scratch) {
    for (int64_t l = 0; l < n; l++) {
        const stack_layer *a = layers + l;
        decoder_layer_f32(x, M, H, a->ln1, a->ln2, a->eps, a->w, a->b, a->I, a->NH, a->KVH, a->D, cos, sin, a->kbuf,
                          a->vbuf, a->kv_sh, a->kv_sl, past, a->scale, n1, s2, n2, scratch, a->wbf16, a->wpanels);
    }
}
"""


def _cpu_flags() -> str:
    return cpuinfo("flags") or platform.processor() + platform.machine()


def _arch() -> str:
    """The -march the kernels are built for: native (this CPU's widest vectors); $MIRROR_TRAIN_KERNEL_ARCH overrides
    it (tests build x86-64-v3, AVX2, and x86-64, scalar, to check each code path on one machine)."""
    return os.environ.get("MIRROR_TRAIN_KERNEL_ARCH", "native")


def _cache_dir() -> Path:
    return Path(os.environ.get("MIRROR_TRAIN_KERNELS", "~/.cache/mirror-train/kernels")).expanduser()


def _build_key() -> str:
    """What the compiled library depends on: its source, this CPU's flags, the -march."""
    return hashlib.sha256((SOURCE + _cpu_flags() + _arch()).encode()).hexdigest()[:16]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (None where it cannot be: no compiler, not x86/Linux, a failed build)."""
    if platform.system() != "Linux":
        return None
    path = _cache_dir() / f"mirror_kernels_{_build_key()}.so"
    if not path.exists():
        compiler = os.environ.get("CC", "cc")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, out = Path(tmp) / "kernels.c", Path(tmp) / "kernels.so"
                src.write_text(SOURCE)
                flags = ["-O3", f"-march={_arch()}", "-ffp-contract=off", "-shared", "-fPIC"]
                cmd = [compiler, *flags, str(src), "-o", str(out)]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                out.replace(path)  # atomic: a concurrent build or a kill leaves no half-written library
        except (OSError, subprocess.SubprocessError):
            return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    try:
        lib = ctypes.CDLL(str(path))
        for fn in (lib.linear_F32, lib.linear_BF16, lib.linear_panels_F32, lib.linear_panels_BF16):
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
            fn.restype = None
        lib.kernel_lanes.restype = ctypes.c_int
        lib.screen_dot.restype = ctypes.c_int
        # scores, M, n, lda, x, K, dot, constants, out
        lib.screen_select.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.c_int, ptr, ptr]
        lib.screen_select.restype = i64
        # x, ldx, panels, bias, y, ldy, M, N, K, scratch
        lib.linear_dot.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
        lib.linear_dot.restype = None
        # q, q head / row strides, k, v, kv head / position strides, out, scratch, M, H, KVH, L, D, scale,
        # and a forked window's per-row key runs n1, s2, n2 (NULL: causal)
        lib.attention_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, *[i64] * 5, ctypes.c_float]
        lib.attention_f32.argtypes += [ptr] * 3
        lib.attention_f32.restype = None
        # x, M, H, ln1, ln2, eps, weights[7], biases[7], I, NH, KVH, D, cos, sin, kbuf, vbuf, kv strides, past,
        # scale, n1, s2, n2, scratch, whether the weights are bfloat16, whether they are panels
        lib.decoder_layer_f32.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_float, ptr, ptr, *[i64] * 4, ptr, ptr]
        lib.decoder_layer_f32.argtypes += [ptr, ptr, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr, ptr, ctypes.c_int]
        lib.decoder_layer_f32.argtypes += [ctypes.c_int]
        lib.decoder_layer_f32.restype = None
        # x, M, H, n, layers (StackLayer[n]), cos, sin, past, n1, s2, n2, scratch
        lib.decoder_stack_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr]
        lib.decoder_stack_f32.restype = None
    except (OSError, AttributeError):  # not loadable here, or not the library this source builds
        return None
    return lib


def available() -> bool:
    return _library() is not None


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, panels: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) · weightᵀ (+ bias) on the CPU for at most MAX_ROWS rows; `weight` contiguous (N, K), float32 or
    bfloat16 (widened exactly; the sums are float32, the result rounded once to x's dtype). `panels`: the weight as
    `to_panels` lays it out, read instead of `weight` (a different function in the last bits, row-exact too). Call
    only where `available()`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    lib, f32 = _library(), weight.dtype == torch.float32
    if panels is None:
        kernel, w = (lib.linear_F32 if f32 else lib.linear_BF16), weight
    else:
        kernel, w = (lib.linear_panels_F32 if f32 else lib.linear_panels_BF16), panels
    b = bias.data_ptr() if bias is not None else None
    kernel(rows.data_ptr(), k, w.data_ptr(), b, out.data_ptr(), n, m, n, k)
    out = out.view(*x.shape[:-1], n)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def linear_at(x: torch.Tensor, weight: torch.Tensor, outputs: torch.Tensor, panels: torch.Tensor | None = None):
    """Columns `outputs` (sorted ids) of `linear(x, weight, None, panels)` for float32 x and weight, bit for bit,
    computing only those: each output's sum does not depend on which others a call computes (their rows gathered,
    or, on panels, the panels that hold them). (M, len(outputs))."""
    rows = x.reshape(-1, x.shape[-1])
    if panels is None:
        return linear(rows, weight.index_select(0, outputs))
    width = panels.shape[-1]
    held = torch.unique(outputs // width)  # sorted
    sub = panels.index_select(0, held)
    shape = torch.empty(sub.shape[0] * width, rows.shape[1], device="meta")  # the held panels' weight: only its shape
    out = linear(rows, shape, None, sub)
    where = torch.searchsorted(held, outputs // width) * width + outputs % width
    return out.index_select(1, where)


def linear_dot(x: torch.Tensor, n: int, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) · Wᵀ (+ bias) for an (n, K) bfloat16 weight given as its panels (`to_panels`), on the dot product
    with x rounded to bfloat16 (a draft's `dot` path: it only proposes); float32 out. Call only where `screen_dot()`."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    m, k = rows.shape
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    out = torch.empty(m, n, dtype=torch.float32)
    pairs = torch.empty(m, (k + 1) // 2, dtype=torch.int32)
    b = bias.data_ptr() if bias is not None else None
    _library().linear_dot(rows.data_ptr(), k, panels.data_ptr(), b, out.data_ptr(), n, m, n, k, pairs.data_ptr())
    out = out.view(*x.shape[:-1], n)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def screen_dot() -> bool:
    """Whether the bfloat16 dot product (AVX512-BF16) is built here (`linear_dot`: the LM head's screen, a draft's
    `dot` path)."""
    return bool(_library().screen_dot())


def select(scores: torch.Tensor, x: torch.Tensor, n: int, dot: bool, constants: torch.Tensor) -> torch.Tensor | None:
    """The screen's candidates (sorted ids < n) for the float32 rows x (M ≤ 64, K) whose screened logits are `scores`
    (M, ≥ n; `dot`: made from x rounded to bfloat16), `constants` the head's four float64 bound constants
    (screened_head.py); None where a bound is not finite."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    out = torch.empty(n, dtype=torch.int64)
    count = _library().screen_select(
        scores.data_ptr(),
        scores.shape[0],
        n,
        scores.stride(0),
        rows.data_ptr(),
        rows.shape[1],
        int(dot),
        constants.data_ptr(),
        out.data_ptr(),
    )
    return None if count < 0 else out[:count]


def lanes() -> int:
    """The kernels' vector width in floats (16 with AVX-512, 8 with AVX2, 1 without either)."""
    return _library().kernel_lanes()


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """An (N, K) weight as the panel kernels read it: (⌈N / lanes⌉, K, lanes), LANES rows interleaved k-major, the
    last panel padded with zero rows; same dtype, a new contiguous tensor (the weight itself is left as it is).
    bfloat16 weights pair their k's: (⌈N / lanes⌉, ⌈K / 2⌉, lanes, 2), lane l of pair j holding w[l, 2j] and
    w[l, 2j + 1] side by side (one 32-bit word: the kernel widens both with a shift and a mask), an odd K's last
    pair padded with 0."""
    n, k = weight.shape
    width = lanes()
    w = weight.detach()
    if n % width:
        w = torch.cat([w, w.new_zeros(width - n % width, k)])
    if w.dtype != torch.bfloat16:
        return w.reshape(-1, width, k).transpose(1, 2).contiguous()  # any strides (a tied head's transpose)
    if k % 2:
        w = torch.cat([w, w.new_zeros(w.shape[0], 1)], dim=1)
    return w.reshape(-1, width, (k + 1) // 2, 2).transpose(1, 2).contiguous()


def panels_of(module: torch.nn.Module) -> torch.Tensor | None:
    """The panels a linear module's weight is served from (`serve_panels` put them there; None: it is served in rows),
    made again if the weight has moved or changed in place since (a load_state_dict, an optimizer step)."""
    entry = module.__dict__.get("_panels")
    if entry is None:
        return None
    panels, ptr, version = entry
    w = module.weight
    if w.data_ptr() != ptr or w._version != version:
        panels = serve_panels(module)[0]
    return panels


def serve_panels(*modules: torch.nn.Module) -> list[torch.Tensor]:
    """Keep a panel copy of each module's weight beside it (the weight stays: a prefill's GEMM and anything that
    borrows it read the rows), for `linear(..., panels=panels_of(module))`; all of them in one arena of huge pages
    (alignment.pack: a model's panels are streamed like its weights). Returns them."""
    placed = alignment.pack([to_panels(m.weight) for m in modules])
    for module, panels in zip(modules, placed, strict=True):
        w = module.weight
        module.__dict__["_panels"] = (panels, w.data_ptr(), w._version)
    return placed


LAYOUTS = ("rows", "panels")
LAYOUT_BYTES = 48 * 2**20  # the weights `layout` streams a timed call through: far past a CPU's L2, as in serving


@functools.cache
def layout() -> str:
    """How the served linears' weights are laid out for the kernels on this machine: "rows" (the weight as it is, a
    block of weight rows x input rows, LANES partial sums an output) or "panels" (`to_panels`, one sum chain an
    output; a second copy of the weights, the rows kept for the prefill's GEMM). $MIRROR_TRAIN_KERNEL_LAYOUT (rows,
    panels, auto) decides; auto, the default, times both once per machine (kept with the compiled library) over
    LAYOUT_BYTES of float32 weights at one and eight rows (a one-token step and a verification window) and takes the
    faster in sum. On an AVX2-only Zen 3 core panels took 0.66x / 0.77x the rows' time (docs/engine.md,
    twenty-seventh session); the rows layout was tuned on AVX-512 CPUs, where panels have not been measured yet."""
    name = os.environ.get("MIRROR_TRAIN_KERNEL_LAYOUT", "auto")
    if name in LAYOUTS:
        return name
    if name != "auto":
        raise ValueError(f"MIRROR_TRAIN_KERNEL_LAYOUT must be auto, rows or panels, got {name!r}")
    if not available():
        return "rows"
    # measured once per machine and kept beside the library: every process here (a Spec-Bench run resumed later,
    # the engine's draft process) then serves the same function, which a measurement's noise could otherwise flip
    path = _cache_dir() / f"layout_{_build_key()}.json"
    try:
        times = json.loads(path.read_text())
        if set(times) != set(LAYOUTS):
            raise ValueError(path)
    except (OSError, ValueError):
        times = layout_times()
        try:
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(times, tmp)
            Path(tmp.name).replace(path)  # atomic: a concurrent measurement's file or this one, whole
        except OSError:
            pass
    return min(times, key=times.get)


@functools.cache
def layout_times(rounds: int = 3) -> dict[str, float]:
    """Milliseconds a layout's linears take over LAYOUT_BYTES of float32 weights (a (1536, 576) shape, the testbed's
    MLP) at one row plus at eight rows: medians of alternating rounds, one thread (`layout`'s measurement)."""
    import statistics
    import time

    gen = torch.Generator().manual_seed(0)
    shape = (1536, 576)
    weights = [torch.rand(shape, generator=gen) - 0.5 for _ in range(max(1, LAYOUT_BYTES // (4 * shape[0] * shape[1])))]
    weights = alignment.pack(weights)  # on huge pages, as served weights are (alignment.py)
    panels = alignment.pack([to_panels(w) for w in weights])
    x = torch.rand(8, shape[1], generator=gen)
    times: dict[tuple[str, int], list[float]] = {(name, r): [] for name in LAYOUTS for r in (1, 8)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(rounds + 1):  # the first round warms
                for r in (1, 8):
                    for name in LAYOUTS:
                        start = time.perf_counter()
                        for w, p in zip(weights, panels):
                            linear(x[:r], w, panels=p if name == "panels" else None)
                        times[(name, r)].append((time.perf_counter() - start) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return {name: sum(statistics.median(times[(name, r)][1:]) for r in (1, 8)) for name in LAYOUTS}


def _run_pointers(runs: torch.Tensor) -> tuple[int, int, int]:
    """The addresses of a contiguous (3, M) int64 key-runs tensor's rows (n1, s2, n2), as the C calls take them:
    arithmetic on one data_ptr, not three row views (a draft's forward makes a few of these calls each step)."""
    first, row = runs.data_ptr(), runs.stride(0) * runs.element_size()
    return first, first + row, first + 2 * row


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of a window of M query rows at the end of a cache: query (1, H, M, D), key and value
    (1, KVH, L, D) holding the cache and the window (L ≥ M; row i sees keys 0..L−M+i; H a multiple of KVH); float32
    CPU tensors, the last dimension contiguous. Returns (1, M, H, D), the layout transformers' attention functions
    return. Call only where `available()`.

    rows: a forked window's keys instead (`forked_window.ForkedWindow.runs`), (3, M) int64: row i sees keys
    0..rows[0, i]−1 and then rows[1, i]..rows[1, i]+rows[2, i]−1, in that order."""
    _, heads, n_rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1 or value.stride() != key.stride():
        key, value = key.contiguous(), value.contiguous()
    runs = (None,) * 3
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()  # kept alive here while the call reads it
        runs = _run_pointers(rows)
    out = torch.empty(1, n_rows, heads, dim, dtype=torch.float32)
    scratch = torch.empty(RB_MAX * length, dtype=torch.float32)  # the source's RB_MAX rows of scores
    _library().attention_f32(
        query.data_ptr(),
        query.stride(1),
        query.stride(2),
        key.data_ptr(),
        value.data_ptr(),
        key.stride(1),
        key.stride(2),
        out.data_ptr(),
        scratch.data_ptr(),
        n_rows,
        heads,
        kv_heads,
        length,
        dim,
        scale,
        *runs,
    )
    return out


@dataclass(frozen=True)
class LayerWeights:
    """What `decoder_layer` reads of one decoder layer: its tensors' addresses (contiguous CPU; the linears' weights
    all float32 or all bfloat16, everything else float32), packed for the C call once (fused_layer.py rebuilds it
    when a weight moves)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    weights: ctypes.Array  # q, k, v, o, gate, up, down
    biases: ctypes.Array
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    layer_idx: int  # its place in the model's cache
    keep: tuple  # the tensors the addresses point into
    bf16: bool = False  # the linears' weights are bfloat16 (widened on load; the sums stay float32)
    # how the linears are read: 0 their rows, 1 their panels (`serve_panels`), 2 their bfloat16 panels on the dot
    # product, the inputs rounded to bfloat16 (a draft's linears marked `dot` by fastpath.install: `linear_dot`)
    panels: int = 0


def layer_weights(ln1, ln2, eps, linears, heads, kv_heads, head_dim, scale, layer_idx) -> LayerWeights:
    """`linears`: the q, k, v, o, gate, up, down nn.Linear modules, in that order, their weights all float32 or all
    bfloat16 (contiguous); ln1, ln2 float32. Read from their panels where all seven are served from panels (the
    function their own forwards compute), else from their rows."""
    dtypes = {m.weight.dtype for m in linears}
    if len(dtypes) != 1 or not dtypes <= set(WEIGHT_DTYPES):
        raise ValueError(f"a fused layer's linears share one weight dtype of {WEIGHT_DTYPES}, got {dtypes}")
    arr = ctypes.c_void_p * 7
    panels = [panels_of(m) for m in linears]
    read = panels if all(p is not None for p in panels) else [m.weight for m in linears]
    weights = arr(*(t.data_ptr() for t in read))
    biases = [None if m.bias is None else m.bias.detach().float().contiguous() for m in linears]  # read as float32
    keep = (ln1, ln2, *read, *biases)
    biases = arr(*(None if b is None else b.data_ptr() for b in biases))
    inter = linears[4].out_features
    bf16 = dtypes == {torch.bfloat16}
    mode = (2 if bf16 and all(m.__dict__.get("_dot") for m in linears) else 1) if read is panels else 0
    return LayerWeights(
        ln1, ln2, eps, weights, biases, inter, heads, kv_heads, head_dim, scale, layer_idx, keep, bf16, mode
    )


def decoder_layer(
    x: torch.Tensor,
    lw: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    runs: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoder layer (the C source's `decoder_layer_f32`) over x (1, M, H) float32 on a CPU, M ≤ MAX_ROWS:
    returns the layer's output (a new tensor) and writes the rows' keys and values into `keys` / `values` (1, KVH,
    capacity, D buffers, the last dimension contiguous) at positions past..past+M−1. cos, sin: (1, M, D), the
    rotary tables of the rows' positions. runs: a forked window's key runs (as `attention`'s `rows`). Call only
    where `available()`."""
    m, hidden = x.shape[1], x.shape[2]
    out, cos, sin, runs, r = _layer_inputs(x, cos, sin, runs)
    scratch = torch.empty(stack_scratch([lw], m, hidden, past + m), dtype=torch.float32)
    _library().decoder_layer_f32(
        out.data_ptr(),
        m,
        hidden,
        lw.ln1.data_ptr(),
        lw.ln2.data_ptr(),
        lw.eps,
        lw.weights,
        lw.biases,
        lw.intermediate,
        lw.heads,
        lw.kv_heads,
        lw.head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(1),
        keys.stride(2),
        past,
        lw.scale,
        *r,
        scratch.data_ptr(),
        int(lw.bf16),
        int(lw.panels),
    )
    return out.view(1, m, hidden)


def _layer_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: torch.Tensor | None):
    """What a decoder-layer call reads besides its weights: x's rows as a copy the call updates in place (M, H), the
    rows' cos and sin contiguous (M, D), the key runs as int64 (kept alive by the caller while the call reads them)
    and their three row addresses (None each: a plain causal window)."""
    m = x.shape[1]
    out = x.reshape(m, x.shape[2]).clone()
    cos, sin = cos.reshape(m, -1).contiguous(), sin.reshape(m, -1).contiguous()
    if runs is None:
        return out, cos, sin, None, (None,) * 3
    runs = runs.to(torch.int64).contiguous()
    return out, cos, sin, runs, _run_pointers(runs)


class StackLayer(ctypes.Structure):
    """One layer's arguments to `decoder_stack` (the C source's `stack_layer`, field for field)."""

    _fields_ = [
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("w", ctypes.c_void_p * 7),
        ("b", ctypes.c_void_p * 7),
        ("kbuf", ctypes.c_void_p),
        ("vbuf", ctypes.c_void_p),
        ("I", ctypes.c_int64),
        ("NH", ctypes.c_int64),
        ("KVH", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("kv_sh", ctypes.c_int64),
        ("kv_sl", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("wbf16", ctypes.c_int32),
        ("wpanels", ctypes.c_int32),
    ]

    def set_weights(self, lw: LayerWeights) -> None:
        """What stays from step to step: the layer's tensors and shapes (the caller keeps `lw` alive)."""
        self.ln1, self.ln2 = lw.ln1.data_ptr(), lw.ln2.data_ptr()
        self.w[:], self.b[:] = list(lw.weights), list(lw.biases)
        self.I, self.NH, self.KVH, self.D = lw.intermediate, lw.heads, lw.kv_heads, lw.head_dim
        self.eps, self.scale, self.wbf16, self.wpanels = lw.eps, lw.scale, int(lw.bf16), int(lw.panels)

    def set_cache(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Where the layer's keys and values go: (1, KVH, capacity, D) buffers, the last dimension contiguous."""
        self.kbuf, self.vbuf = keys.data_ptr(), values.data_ptr()
        self.kv_sh, self.kv_sl = keys.stride(1), keys.stride(2)


def stack_scratch(layers: list[LayerWeights], rows: int, hidden: int, length: int) -> int:
    """Floats of scratch a `decoder_layer` call needs (`decoder_stack`'s over `layers`: the largest layer's), `rows`
    rows after `length` − rows cached positions: the layer's activations, and the attention's scores."""
    return (
        max(
            rows * (2 * hidden + 2 * lw.heads * lw.head_dim + 2 * lw.kv_heads * lw.head_dim + 2 * lw.intermediate)
            + rows * ((max(hidden, lw.heads * lw.head_dim, lw.intermediate) + 1) // 2)  # the dot product's inputs
            for lw in layers
        )
        + RB_MAX * length
    )


def decoder_stack(
    x: torch.Tensor,
    layers: ctypes.Array,
    scratch_floats: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    past: int,
    runs: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decoder_layer` for each of `layers` (a StackLayer array, weights and cache buffers set, each buffer with
    room for x's rows) in turn, as one C call: x (1, M, H) float32 → the last layer's output (a new tensor), the
    same bits as the layers called one by one. Call only where `available()`."""
    m, hidden = x.shape[1], x.shape[2]
    out, cos, sin, runs, r = _layer_inputs(x, cos, sin, runs)
    scratch = torch.empty(scratch_floats, dtype=torch.float32)
    _library().decoder_stack_f32(
        out.data_ptr(), m, hidden, len(layers), layers, cos.data_ptr(), sin.data_ptr(), past, *r, scratch.data_ptr()
    )
    return out.view(1, m, hidden)
