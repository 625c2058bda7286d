"""A row-exact small-M float32 linear for the CPU: y = x·Wᵀ (+ b) for the 1–64 rows of a decoding step or a
verification window, each output element summed in one fixed order whatever the number of rows.

Why a kernel of our own (docs/engine.md, "The step against the hardware"): at 2–16 rows torch's float32 GEMMs
(MKL) run ~2× slower than a one-row step that is already bound by reading the weights, so a verification window
costs far more than its arithmetic; and MKL rounds a row differently by the rows beside it (a one-row product goes
to its GEMV, ~1e-5 apart), so a window is not bit for bit the one-token steps it stands for. This kernel streams
each weight row once per call and reuses it from L1 for every input row, with one accumulation order per output
(explicit FMAs over the same k-chunks, then the same horizontal sum): a k-row window equals k one-row steps exactly,
and a window of 8 costs a little more than one row, not twice as much.

Built once per machine with the system C compiler (`cc -O3 -march=native`, a few hundred ms) into
~/.cache/mirror-train/kernels (or $MIRROR_TRAIN_KERNELS), keyed by the source and the CPU's flags, and loaded with
ctypes (no torch headers, no build step at install). Where there is no compiler, or the build fails, `available()`
is False and callers keep torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

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
static inline float vsum(vec v) { return v; }
#endif

/* NB weight rows x MB input rows: every output accumulates over the same k-chunks in the same order, so its value
   does not depend on NB, MB or how many rows the call has. */
#define BLOCK(NB, MB)                                                                                             \
static void block_##NB##_##MB(const float *x, int64_t ldx, const float *w, int64_t K, const float *b, float *y,       \
                              int64_t ldy, int pf) {                                                               \
    vec acc[NB][MB];                                                                                               \
    for (int i = 0; i < NB; i++)                                                                                   \
        for (int j = 0; j < MB; j++) acc[i][j] = VZERO();                                                          \
    int64_t k = 0;                                                                                                 \
    for (; k + LANES <= K; k += LANES) {                                                                           \
        vec wv[NB];                                                                                                \
        for (int i = 0; i < NB; i++) {                                                                             \
            wv[i] = VLOAD(w + i * K + k);                                                                          \
            if (pf) __builtin_prefetch(w + (i + NB) * K + k, 0, 2);                                                    \
        }                                                                                                          \
        for (int j = 0; j < MB; j++) {                                                                             \
            vec xv = VLOAD(x + j * ldx + k);                                                                       \
            for (int i = 0; i < NB; i++) acc[i][j] = VFMA(wv[i], xv, acc[i][j]);                                   \
        }                                                                                                          \
    }                                                                                                              \
    for (int i = 0; i < NB; i++)                                                                                   \
        for (int j = 0; j < MB; j++) {                                                                             \
            float s = vsum(acc[i][j]);                                                                             \
            for (int64_t t = k; t < K; t++) s = fmaf(x[j * ldx + t], w[i * K + t], s);                             \
            if (b) s += b[i];                                                                                      \
            y[j * ldy + i] = s;                                                                                    \
        }                                                                                                          \
}
BLOCK(4, 4) BLOCK(4, 3) BLOCK(4, 2) BLOCK(4, 1)
BLOCK(1, 4) BLOCK(1, 3) BLOCK(1, 2) BLOCK(1, 1)

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, const float *, float *, int64_t, int);
static const block_fn WIDE[5] = {0, block_4_1, block_4_2, block_4_3, block_4_4};
static const block_fn NARROW[5] = {0, block_1_1, block_1_2, block_1_3, block_1_4};

/* y (M x N, row stride ldy) = x (M x K, row stride ldx) . w^T, w (N x K) contiguous; b (N) or NULL. */
void rowgemm_f32(const float *x, int64_t ldx, const float *w, const float *b, float *y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4)
        for (int64_t m = 0; m < M; m += 4) {
            int64_t mb = M - m < 4 ? M - m : 4;
            WIDE[mb](x + m * ldx, ldx, w + n * K, K, b ? b + n : 0, y + m * ldy + n, ldy, m == 0 && n + 8 <= N);
        }
    for (; n < N; n++)
        for (int64_t m = 0; m < M; m += 4) {
            int64_t mb = M - m < 4 ? M - m : 4;
            NARROW[mb](x + m * ldx, ldx, w + n * K, K, b ? b + n : 0, y + m * ldy + n, ldy, 0);
        }
}
"""


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _cache_dir() -> Path:
    return Path(os.environ.get("MIRROR_TRAIN_KERNELS", "~/.cache/mirror-train/kernels")).expanduser()


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (None where it cannot be: no compiler, not x86/Linux, a failed build)."""
    if platform.system() != "Linux":
        return None
    key = hashlib.sha256((SOURCE + _cpu_flags()).encode()).hexdigest()[:16]
    path = _cache_dir() / f"rowgemm_{key}.so"
    if not path.exists():
        compiler = os.environ.get("CC", "cc")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, out = Path(tmp) / "rowgemm.c", Path(tmp) / "rowgemm.so"
                src.write_text(SOURCE)
                cmd = [
                    compiler,
                    "-O3",
                    "-march=native",
                    "-ffp-contract=off",
                    "-shared",
                    "-fPIC",
                    str(src),
                    "-o",
                    str(out),
                ]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                out.replace(path)  # atomic: a concurrent build or a kill leaves no half-written library
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    fn = lib.rowgemm_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    fn.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) · weightᵀ (+ bias) for float32 CPU tensors with at most MAX_ROWS rows; `weight` contiguous (N, K).
    Call only where `available()`."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    _library().rowgemm_f32(
        rows.data_ptr(),
        k,
        weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        m,
        n,
        k,
    )
    return out.view(*x.shape[:-1], n)
