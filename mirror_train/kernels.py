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

The C source is mirror_train/csrc/ (kernels.c, one translation unit including a file per part), built once per
machine with the system C compiler (`cc -O3 -march=native`, under a second) into
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

RB_MAX = 6  # the attention kernel's rows a group (its source's RB_MAX, checked on load): its scratch holds their scores
MAX_ROWS = 64  # more rows (a prompt's prefill) are a large GEMM, where torch's own path is the fast one

SOURCE_DIR = Path(__file__).parent / "csrc"  # the C source: kernels.c, the one translation unit, and its parts


def source() -> str:
    """Every C file the library is built from (what its build key hashes), in name order."""
    files = sorted(f for f in SOURCE_DIR.iterdir() if f.suffix in (".c", ".h"))
    return "".join(f"// {f.name}\n" + f.read_text() for f in files)


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
    return hashlib.sha256((source() + _cpu_flags() + _arch()).encode()).hexdigest()[:16]


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
                out = Path(tmp) / "kernels.so"
                flags = ["-O3", f"-march={_arch()}", "-ffp-contract=off", "-shared", "-fPIC"]
                cmd = [compiler, *flags, str(SOURCE_DIR / "kernels.c"), "-o", str(out)]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                out.replace(path)  # atomic: a concurrent build or a kill leaves no half-written library
        except (OSError, subprocess.SubprocessError):
            return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    try:
        lib = ctypes.CDLL(str(path))
        # `linear`'s C function by (the dtype it reads, whether as panels): chosen by a lookup on every call
        lib.linears = {
            (torch.float32, False): lib.linear_F32,
            (torch.bfloat16, False): lib.linear_BF16,
            (torch.float16, False): lib.linear_F16,
            (torch.float32, True): lib.linear_panels_F32,
            (torch.bfloat16, True): lib.linear_panels_BF16,
        }
        for fn in lib.linears.values():
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
            fn.restype = None
        lib.kernel_lanes.restype = ctypes.c_int
        if lib.attention_rows_max() != RB_MAX:  # the scratch sized here must hold the C source's group of rows
            raise RuntimeError(f"kernels.RB_MAX {RB_MAX} != the attention source's {lib.attention_rows_max()}")
        lib.screen_dot.restype = ctypes.c_int
        # scores, M, n, lda, x, K, dot, constants, per-id s and n, served weight, its layout, max candidates, ids
        if hasattr(lib, "screen_per_id"):  # an older revision's library (bench_target.py --baseline) has another
            lib.screen_argmax.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr]
            lib.screen_argmax.argtypes += [ctypes.c_int, i64, ptr]
            lib.screen_argmax.restype = i64
        if hasattr(lib, "screen_sample"):  # the same, plus each row's noise and its stride (Gumbel-max samples)
            lib.screen_sample.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr]
            lib.screen_sample.argtypes += [ctypes.c_int, ptr, i64, i64, ptr]
            lib.screen_sample.restype = i64
        # x, ldx, panels, bias, y, ldy, M, N, K, scratch
        lib.linear_dot.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
        lib.linear_dot.restype = None
        # q, q head / row strides, k, v, kv head / position strides, out, scratch, M, H, KVH, L, D, scale,
        # and a forked window's per-row key runs n1, s2, n2 (NULL: causal)
        lib.attention_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, *[i64] * 5, ctypes.c_float]
        lib.attention_f32.argtypes += [ptr] * 3
        lib.attention_f32.restype = None
        # x, M, H, ln1, ln2, eps, weights[7], biases[7], I, NH, KVH, D, cos, sin, kbuf, vbuf, kv strides, past,
        # scale, n1, s2, n2, scratch, the weights' type (READ_TYPES), whether they are panels
        lib.decoder_layer_f32.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_float, ptr, ptr, *[i64] * 4, ptr, ptr]
        lib.decoder_layer_f32.argtypes += [ptr, ptr, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr, ptr, ctypes.c_int]
        lib.decoder_layer_f32.argtypes += [ctypes.c_int]
        lib.decoder_layer_f32.restype = None
        # x, M, H, n, layers (StackLayer[n]), cos, sin, past, n1, s2, n2, scratch
        lib.decoder_stack_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr]
        lib.decoder_stack_f32.restype = None
        # x, ldx, n, weights[n], shapes[2n], the weights' type (READ_TYPES), whether they are panels, y, ldy, M
        if hasattr(lib, "linear_many"):  # an older revision's library has none
            lib.linear_many.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int, ptr, i64, i64]
            lib.linear_many.restype = None
        # x, M, H, pre, pre_eps, fin, fin_eps, weights[3], wtypes[3], wpanels[3], wscales[3], wsums[3], I, V,
        # softcap, noise, ldn, kappa, window, W, outside_logp, top ids, top log-probs, window log-probs, scratch
        f32 = ctypes.c_float
        lib.proxy_head_f32.argtypes = [ptr, i64, i64, ptr, f32, ptr, f32, ptr, ptr, ptr, ptr, ptr, i64, i64, f32]
        lib.proxy_head_f32.argtypes += [ptr, i64, i64, ptr, i64, f32, ptr, ptr, ptr, ptr]
        lib.proxy_head_f32.restype = ctypes.c_int
        if hasattr(lib, "gumbel_noise"):  # seed, positions, n, V, temperature, out (an older revision's has none)
            lib.gumbel_noise.argtypes = [ctypes.c_uint64, ptr, i64, i64, ctypes.c_double, ptr]
            lib.gumbel_noise.restype = None
        lib.q8_dot.restype = ctypes.c_int
        if hasattr(lib, "screen_q8_built"):  # an older revision's library (bench_target.py --baseline) has none
            lib.screen_q8_built.restype = ctypes.c_int
            # x, M, K, int8 panels, scales, sums, y, ldy, N, scratch
            lib.screen_q8.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ptr]
            lib.screen_q8.restype = None
        if hasattr(lib, "screen_q8_amx_built"):  # the same on AMX tiles (an older revision's library has none)
            lib.screen_q8_amx_built.restype = ctypes.c_int
            lib.screen_q8_amx.argtypes = lib.screen_q8.argtypes
            lib.screen_q8_amx.restype = None
        if hasattr(lib, "panel_prefetch"):  # an older revision's library has none
            lib.panel_prefetch.argtypes = [ctypes.c_int, i64]
            lib.panel_prefetch.restype = i64
        if hasattr(lib, "panel_prefetch_distance"):  # the same
            lib.panel_prefetch_distance.argtypes = [ctypes.c_int, i64]
            lib.panel_prefetch_distance.restype = i64
            lib.panel_one_row.argtypes = [ctypes.c_int, i64]
            lib.panel_one_row.restype = i64
        lib.head_scratch_floats.argtypes = [i64] * 4
        lib.head_scratch_floats.restype = i64
    except (OSError, AttributeError):  # not loadable here, or not the library this source builds
        return None
    return lib


def available() -> bool:
    return _library() is not None


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
# the dtypes the kernels read weights in (a model's own, or float16 copies of a float16-valued float32 model's, rows
# only: serve_narrow), as decoder_layer's weight type codes
READ_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class LinearList:
    """Linears timed as a stack reads them: every weight (its rows, or its panels), one dtype, called one after
    another on the same 1-8 input rows in one C call (`linear_many`), so a measurement sees the kernels and not a
    Python call each. weights: (rows, panels or None) pairs, all panels or none; the rows give each shape."""

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor | None]]):
        self.read = [w if p is None else p for w, p in weights]
        self.panels = weights[0][1] is not None
        self.wtype = READ_TYPES[self.read[0].dtype]
        shapes = [tuple(w.shape) for w, _ in weights]
        self._pointers = (ctypes.c_void_p * len(shapes))(*[t.data_ptr() for t in self.read])
        self._shapes = (ctypes.c_int64 * (2 * len(shapes)))(*[d for shape in shapes for d in shape])
        self.k, self.n = max(k for _, k in shapes), max(n for n, _ in shapes)
        self.count = len(shapes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Every linear on x (rows x the largest K, contiguous float32), each writing its outputs over the one
        before's: returns (rows, the largest N), the last linear's outputs in its first N columns."""
        y = torch.empty(x.shape[0], self.n)
        _library().linear_many(
            x.data_ptr(),
            self.k,
            self.count,
            self._pointers,
            self._shapes,
            self.wtype,
            int(self.panels),
            y.data_ptr(),
            self.n,
            x.shape[0],
        )
        return y


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, panels: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) · weightᵀ (+ bias) on the CPU for at most MAX_ROWS rows; `weight` contiguous (N, K), float32 or
    bfloat16 (widened exactly; the sums are float32, the result rounded once to x's dtype). `panels`: the weight as
    `to_panels` lays it out, read instead of `weight` (a different function in the last bits, row-exact too), in
    either dtype whatever the weight's. Call only where `available()`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    w = weight if panels is None else panels  # panels in float32 or bfloat16
    kernel = _library().linears[(w.dtype, panels is not None)]
    b = bias.data_ptr() if bias is not None else None
    kernel(rows.data_ptr(), k, w.data_ptr(), b, out.data_ptr(), n, m, n, k)
    out = out.view(*x.shape[:-1], n)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def linear_at(x: torch.Tensor, weight: torch.Tensor, outputs: torch.Tensor, panels: torch.Tensor | None = None):
    """Columns `outputs` (sorted ids) of `linear(x, weight, None, panels)` for float32 x and weight, bit for bit,
    computing only those: each output's sum does not depend on which others a call computes (their rows gathered,
    or, on panels of either dtype, the panels that hold them). (M, len(outputs))."""
    rows = x.reshape(-1, x.shape[-1])
    if panels is None:
        return linear(rows, weight.index_select(0, outputs))
    width = lanes()  # a panel's outputs (bfloat16 panels end in their k-pairs)
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


def q8_dot() -> bool:
    """Whether AVX512-VNNI's dot product of byte quads is built here (`linear_q8.c`: a proxy head's int8 copy)."""
    return bool(_library().q8_dot())


def gumbel_noise(seed: int, positions: list[int], vocab: int, temperature: float) -> torch.Tensor:
    """(len(positions), vocab) float32: T times Gumbel noise a row a position (csrc/noise.c; the function
    `acceptance.sample_noise` defines)."""
    out = torch.empty(len(positions), vocab, dtype=torch.float32)
    index = torch.tensor(positions, dtype=torch.int64)
    _library().gumbel_noise(seed % 2**64, index.data_ptr(), len(positions), vocab, temperature, out.data_ptr())
    return out


def screen_q8() -> bool:
    """Whether the LM head's int8 screen is built here (`screen_q8_scores`: AVX512-VNNI's dot product of byte quads)."""
    return has("screen_q8_built") and bool(_library().screen_q8_built())


def screen_q8_amx() -> bool:
    """Whether the int8 screen runs on AMX tiles here (built for them, and Linux lent this process their state):
    `screen_q8_scores(..., tiles=True)`, the same bits."""
    return has("screen_q8_amx_built") and bool(_library().screen_q8_amx_built())


def screen_q8_scores(
    x: torch.Tensor, n: int, panels: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor, tiles: bool = False
) -> torch.Tensor:
    """The int8 screen's logits (M, n) of float32 rows x (M, K) against a head's int8 panels, per-row scales and sums
    (`fused_head.quantize_panels`), each row read in two bytes a value (csrc/screen_q8.c), on AMX tiles if `tiles`
    (the same bits). Call only where `screen_q8()` (and `screen_q8_amx()` for tiles)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    m, k = rows.shape
    out = torch.empty(m, n, dtype=torch.float32)
    scratch = torch.empty(2 * m * ((k + 3) // 4) + m, dtype=torch.int32)
    weights = [t.data_ptr() for t in (panels, scales, sums)]
    fn = _library().screen_q8_amx if tiles else _library().screen_q8
    fn(rows.data_ptr(), m, k, *weights, out.data_ptr(), n, n, scratch.data_ptr())
    return out


def has(function: str) -> bool:
    """Whether the library has a C function (an older revision's, timed by `bench_target.py --baseline`, may not)."""
    return hasattr(_library(), function)


def screen_argmax(
    scores: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    panels: torch.Tensor | None,
    mode: int,
    constants: torch.Tensor,
    bounds: torch.Tensor,
    most: int,
    noise: torch.Tensor | None = None,
) -> list[int] | None:
    """Each row's greedy id for a head (N, K) served from `panels` (float32 or bfloat16, `to_panels`) or else from its
    float32 rows `weight`: the screen's candidates row by row (each row's lower bound its served logit at its
    screened argmax), each row's served logits over its own (`linear`'s bits) and their first largest; None where a
    bound is not finite or more than `most` logits would be computed. `scores`: the screened logits (M, ≥ N); mode:
    how the screen read x (`screened_head.MODES`: as it is, rounded to bfloat16, or in two int8 bytes a value).
    `noise` (M, ≥ N) float32: the first largest of each row's served logits plus its noise instead, their float32
    sums (a Gumbel-max sample, `acceptance.sample_noise`)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    if panels is None:
        served, layout = weight.contiguous(), 0
    else:
        served, layout = panels, 1 if panels.dtype == torch.float32 else 2
    ids = torch.empty(rows.shape[0], dtype=torch.int64)
    head = (scores.data_ptr(), scores.shape[0], weight.shape[0], scores.stride(0), rows.data_ptr(), rows.shape[1])
    head += (int(mode), constants.data_ptr(), bounds[0].data_ptr(), bounds[1].data_ptr(), served.data_ptr(), layout)
    if noise is None:
        count = _library().screen_argmax(*head, most, ids.data_ptr())
    else:
        z = noise.to(torch.float32)
        if z.dim() != 2 or z.shape[0] != rows.shape[0] or z.shape[1] < weight.shape[0] or z.stride(1) != 1:
            raise ValueError(f"noise must be (rows, ≥ {weight.shape[0]}) with unit stride, got {tuple(z.shape)}")
        count = _library().screen_sample(*head, z.data_ptr(), z.stride(0), most, ids.data_ptr())
    return None if count < 0 else ids.tolist()


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
    panels, ptr, version, narrow = entry
    if _moved(module.weight, ptr, version):
        panels = serve_panels(module, narrow=narrow)[0]
    return panels


def _moved(weight: torch.Tensor, ptr: int, version: int) -> bool:
    """Whether a weight has moved or changed in place since a copy of it was made at (ptr, version)."""
    return weight.data_ptr() != ptr or weight._version != version


def serve_panels(*modules: torch.nn.Module, narrow: bool = False) -> list[torch.Tensor]:
    """Keep a panel copy of each module's weight beside it (the weight stays: a prefill's GEMM and anything that
    borrows it read the rows), for `linear(..., panels=panels_of(module))`; all of them in one arena of huge pages
    (alignment.pack: a model's panels are streamed like its weights). `narrow`: a float32 weight that holds only
    bfloat16 values (`bf16_exact`) gets bfloat16 panels, the same function on half the bytes (`serve_narrow`).
    Returns them."""
    narrowed = [narrow and bf16_exact(m.weight) for m in modules]
    placed = alignment.pack([to_panels(m.weight.bfloat16() if n else m.weight) for m, n in zip(modules, narrowed)])
    for module, panels in zip(modules, placed, strict=True):
        w = module.weight
        module.__dict__["_panels"] = (panels, w.data_ptr(), w._version, narrow)
    return placed


NARROW_DTYPES = (torch.bfloat16, torch.float16)  # what a float32 weight's values may all be, tried in this order


def exact_in(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a float32 weight holds `dtype` values only (bfloat16: the low 16 bits of every element zero; float16:
    every element equal to itself through float16): a bfloat16 or float16 checkpoint loaded in float32, as Hub
    models served in float32 mostly are."""
    w = weight.detach()
    if w.dtype != torch.float32 or not w.is_contiguous():
        return False
    flat = w.reshape(-1)
    step = 1 << 22  # a few MB of temporaries at a time, however large the weight
    if dtype == torch.bfloat16:
        bits = flat.view(torch.int32)
        return all(not (bits[i : i + step] & 0xFFFF).any() for i in range(0, bits.numel(), step))
    if dtype == torch.float16:
        return all(
            torch.equal(flat[i : i + step].half().float(), flat[i : i + step]) for i in range(0, flat.numel(), step)
        )
    return False


def bf16_exact(weight: torch.Tensor) -> bool:
    return exact_in(weight, torch.bfloat16)


def serve_narrow(*modules: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[bool]:
    """Keep a `dtype` copy (bfloat16 or float16) beside each float32 weight that holds such values only
    (`exact_in`), read by the kernels in the rows layout instead of the weight: they widen both exactly on load, so
    the float32 sums and every output are the same bits (tests/test_kernels.py), from half the bytes a decoding
    step streams. The weight stays (a prefill's GEMM, and whatever borrows it, read it). Returns which were
    narrowed."""
    narrowed = [exact_in(m.weight, dtype) for m in modules]
    chosen = [m for m, n in zip(modules, narrowed) if n]
    for module, copy in zip(chosen, alignment.pack([m.weight.detach().to(dtype) for m in chosen]), strict=True):
        w = module.weight
        module.__dict__["_narrow"] = (copy, w.data_ptr(), w._version)
    for module, n in zip(modules, narrowed):
        if not n:
            module.__dict__.pop("_narrow", None)
    return narrowed


def served(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the kernels read for a linear module: (its rows: the weight, or its half-precision copy where
    `serve_narrow` made one, its panels or None), for `linear(x, rows, bias, panels)`. A weight moved or changed in
    place since has its copies made again (a narrow copy only while its values are still of the copy's dtype)."""
    panels = panels_of(module)
    entry = module.__dict__.get("_narrow")
    if entry is None or panels is not None:
        return module.weight, panels
    copy, ptr, version = entry
    if _moved(module.weight, ptr, version):
        serve_narrow(module, dtype=copy.dtype)
        entry = module.__dict__.get("_narrow")
        return (module.weight if entry is None else entry[0]), None
    return copy, None


LAYOUTS = ("rows", "panels")
# what `layout_times` times: each layout in float32 and bfloat16, and the rows in float16 (no float16 panels)
MEASURED = (*LAYOUTS, *(f"{name}_bf16" for name in LAYOUTS), "rows_f16")
SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16", torch.float16: "_f16"}
# What `layout` streams: LAYOUT_LAYERS decoder layers' linears of the testbed's shapes (PREFETCH_SHAPES below, ~100
# MB in float32: past a CPU's L3, as in serving), in one C call a round. A (1536, 576) shape over 48 MB, each linear
# called from Python, measured the layouts 1% apart on a Zen 4 where the target's stack ran 8-row windows' linears
# ~20% faster on panels (forty-seventh session): the calls cost as much as the difference.
LAYOUT_LAYERS = 8


@functools.cache
def layout(dtype: torch.dtype = torch.float32) -> str:
    """How the served linears' weights are laid out for the kernels on this machine, for weights read in `dtype`:
    "rows" (the weight as it is, a block of weight rows x input rows, LANES partial sums an output) or "panels"
    (`to_panels`, one sum chain an output; a second copy of the weights, the rows kept for the prefill's GEMM).
    $MIRROR_TRAIN_KERNEL_LAYOUT (rows, panels, auto) decides; auto, the default, times both once per machine (kept
    with the compiled library) over LAYOUT_LAYERS layers' weights at one and eight rows (a one-token step and a
    verification window) and takes the faster in sum. On an AVX2-only Zen 3 core float32 panels took 0.66x / 0.77x
    the rows' time (docs/engine.md, twenty-seventh session); on a Zen 4 rows won in float32 and panels in bfloat16
    (thirty-fourth session)."""
    name = os.environ.get("MIRROR_TRAIN_KERNEL_LAYOUT", "auto")
    if dtype == torch.float16:  # float16 copies are read in rows only
        return "rows"
    if name in LAYOUTS:
        return name
    if name != "auto":
        raise ValueError(f"MIRROR_TRAIN_KERNEL_LAYOUT must be auto, rows or panels, got {name!r}")
    if not available():
        return "rows"
    tune_prefetch()  # the panels timed as they are served: how they prefetch is this machine's, measured first
    times = _machine_times()
    return min(LAYOUTS, key=lambda name: times[name + SUFFIX[dtype]])


@functools.cache
def narrow(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a float32 model whose weights hold `dtype` values only (bfloat16 or float16) is served from copies of
    them in that dtype (`serve_narrow`, bfloat16 also `serve_panels(narrow=True)`: the same bits from half the
    bytes), in `layout(dtype)`. $MIRROR_TRAIN_KERNEL_NARROW (auto, on, off) decides; auto, the default, where such
    copies in their best layout measured faster at one plus eight rows than float32 in its best (`layout_times`,
    once per machine): the one-token step streams half the bytes, while the widening costs a window's compute-bound
    rows a little (measured: docs/engine.md, thirty-fourth session)."""
    name = os.environ.get("MIRROR_TRAIN_KERNEL_NARROW", "auto")
    if name in ("on", "off"):
        return name == "on"
    if name != "auto":
        raise ValueError(f"MIRROR_TRAIN_KERNEL_NARROW must be auto, on or off, got {name!r}")
    if not available():
        return False
    times = _machine_times()
    return times[layout(dtype) + SUFFIX[dtype]] < min(times[name] for name in LAYOUTS)


def _machine_times() -> dict[str, float]:
    """`layout_times`, measured once per machine and kept beside the library: every process here (a Spec-Bench run
    resumed later, the engine's draft process) then serves the same function, which a measurement's noise could
    otherwise flip."""
    return per_machine("layout", layout_times, set(MEASURED))


def per_machine(name: str, measure, keys: set[str], valid=None) -> dict:
    """`measure()` (a dict with these keys), measured once per machine and kept beside the library as JSON; a kept
    file that is corrupt, has other keys or fails `valid(values)` is measured again."""
    path = _cache_dir() / f"{name}_{_build_key()}.json"
    try:
        values = json.loads(path.read_text())
        if set(values) != keys or (valid is not None and not valid(values)):
            raise ValueError(path)
    except (OSError, ValueError):
        values = measure()
        try:
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(values, tmp)
            Path(tmp.name).replace(path)  # atomic: a concurrent measurement's file or this one, whole
        except OSError:
            pass
    return values


PREFETCH_TYPES = {"float32": 0, "bfloat16": 1}  # the panels' weight types, as csrc/linear_panels.c numbers them


def panel_prefetch(dtype: str, mask: int | None = None) -> int:
    """Which tile heights of `dtype` panels prefetch ahead (bit R: R-row tiles, R = 1..8), after setting it to `mask`
    if given (csrc/linear_panels.c; the arithmetic is the same either way)."""
    return int(_library().panel_prefetch(PREFETCH_TYPES[dtype], -1 if mask is None else mask))


def panel_prefetch_distance(dtype: str, distance: int | None = None) -> int:
    """How many bytes ahead `dtype` panels' tiles prefetch, after setting it to `distance` if given (rounded down to
    64, at most 16 MB; csrc/linear_panels.c; the arithmetic is the same at any distance)."""
    return int(_library().panel_prefetch_distance(PREFETCH_TYPES[dtype], -1 if distance is None else distance))


def panel_one_row(dtype: str, single: bool | None = None) -> bool:
    """Whether a one-row call streams `dtype` panels one at a time (else eight at once), after setting it to
    `single` if given (csrc/linear_panels.c; the same bits either way)."""
    return bool(_library().panel_one_row(PREFETCH_TYPES[dtype], -1 if single is None else int(single)))


STREAMING = {"mask", "distance", "single"}  # what `panel_streaming` reports and `tune_prefetch` sets, per panel type


def panel_streaming(dtype: str) -> dict[str, int]:
    """How `dtype` panels are streamed now (`tune_prefetch` sets it): {"mask": the tile heights that prefetch,
    "distance": how many bytes ahead, "single": 1 where a one-row call reads one panel at a time}."""
    return {
        "mask": panel_prefetch(dtype),
        "distance": panel_prefetch_distance(dtype),
        "single": int(panel_one_row(dtype)),
    }


def _set_streaming(dtype: str, streaming: dict[str, int]) -> dict[str, int]:
    panel_prefetch(dtype, int(streaming["mask"]))
    panel_prefetch_distance(dtype, int(streaming["distance"]))
    panel_one_row(dtype, bool(streaming["single"]))
    return panel_streaming(dtype)


def _valid_streaming(values: dict) -> bool:
    return all(
        isinstance(v, dict) and set(v) == STREAMING and all(isinstance(n, int) for n in v.values())
        for v in values.values()
    )


@functools.cache
def tune_prefetch() -> dict[str, dict[str, int]]:
    """Set how panels are streamed, per panel type (`panel_streaming`): which tile heights prefetch, how far ahead,
    and whether a one-row call reads one panel at a time, from $MIRROR_TRAIN_PANEL_PREFETCH: auto (the default)
    measures them once per machine (`prefetch_times`, kept beside the library); "default" keeps the C source's
    (from 2 rows, 256 KB ahead, one panel at a time with AVX-512); a number (0x1fc) is the mask for both types, the
    rest the source's. Why measure: the prefetch a Zen 4 gained from at 2-8 rows cost the AMX Xeon's 2- and 3-row
    steps ~1 ms each (docs/engine.md, forty-fourth session), and the distance a Zen 3 chose (64 KB) left a Zen 4's
    8-row windows 1.28x slower than 256 KB (forty-seventh); one panel at a time was measured on a Zen 4 only. What
    is set; {} where the kernels (or these functions in them) are not built."""
    name = os.environ.get("MIRROR_TRAIN_PANEL_PREFETCH", "auto")
    if not available() or not has("panel_prefetch_distance"):
        return {}
    if name == "default":
        return {t: panel_streaming(t) for t in PREFETCH_TYPES}
    if name == "auto":
        chosen = per_machine("prefetch", prefetch_times, set(PREFETCH_TYPES), valid=_valid_streaming)
    else:
        try:
            mask = int(name, 0)
        except ValueError:
            message = f"MIRROR_TRAIN_PANEL_PREFETCH must be auto, default or a mask (0x1fc), got {name!r}"
            raise ValueError(message) from None
        chosen = {t: panel_streaming(t) | {"mask": mask} for t in PREFETCH_TYPES}
    return {t: _set_streaming(t, v) for t, v in chosen.items()}


@functools.cache
def layout_times(rounds: int = 3) -> dict[str, float]:
    """Milliseconds a layout's linears take over LAYOUT_LAYERS decoder layers' float32 weights (the testbed's shapes)
    at one row plus at eight rows, and the same weights' values stored in bfloat16 ("rows_bf16", "panels_bf16")
    and float16 ("rows_f16": `narrow`'s copies): medians of alternating rounds, one thread, every layout's
    linears in one C call (`LinearList`), panels prefetching as this process has them set (`layout`'s and
    `narrow`'s measurement)."""
    import statistics
    import time

    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(LAYOUT_LAYERS) for shape in PREFETCH_SHAPES]
    weights = alignment.pack([(torch.rand(shape, generator=gen) - 0.5).bfloat16().float() for shape in shapes])
    halves = alignment.pack([w.bfloat16() for w in weights])  # on huge pages, as served weights are (alignment.py)
    read = {
        "rows": LinearList([(w, None) for w in weights]),
        "panels": LinearList(list(zip(weights, alignment.pack([to_panels(w) for w in weights])))),
        "rows_bf16": LinearList([(h, None) for h in halves]),
        "panels_bf16": LinearList(list(zip(halves, alignment.pack([to_panels(h) for h in halves])))),
        "rows_f16": LinearList([(h, None) for h in alignment.pack([w.half() for w in weights])]),
    }
    x = torch.rand(8, max(k for _, k in PREFETCH_SHAPES), generator=gen)
    inputs = {r: x[:r].contiguous() for r in (1, 8)}
    times: dict[tuple[str, int], list[float]] = {(name, r): [] for name in MEASURED for r in (1, 8)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(rounds + 1):  # the first round warms
                for r in (1, 8):
                    for name in MEASURED:
                        start = time.perf_counter()
                        read[name](inputs[r])
                        times[(name, r)].append((time.perf_counter() - start) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return {name: sum(statistics.median(times[(name, r)][1:]) for r in (1, 8)) for name in MEASURED}


# What `prefetch_times` streams: a decoder layer's linears (the testbed's shapes), PREFETCH_LAYERS of them (~230 MB
# in float32: a microbenchmark of one shape over 48 MB, partly in a large L3, chose the other way round at 2-3 rows
# from the target's own stack on the AMX Xeon, and this one agreed with the stack; forty-fourth session)
PREFETCH_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
PREFETCH_LAYERS = 16
# heights measured: one row never prefetches (one panel at a time: a single stream the hardware follows; eight at
# once ran slower with it wherever measured), seven and eight always (compute-bound: the prefetch gained or tied on
# Zen 4 and the AMX Xeon)
PREFETCH_ROWS = range(2, 7)
PREFETCH_ALWAYS = (1 << 7) | (1 << 8)
# distances measured (bytes ahead), at the heights where the window's FMAs and the stream compete: the old default
# and the one a Zen 4 took 8-row windows 0.78x the time with (forty-seventh session)
PREFETCH_DISTANCES = (65536, 262144)
DISTANCE_ROWS = (4, 8)


def prefetch_times(rounds: int = 5, layers: int = PREFETCH_LAYERS) -> dict[str, dict[str, int]]:
    """Per panel type, how its panels stream fastest over `layers` decoder layers' linears (the testbed's shapes),
    medians of alternating rounds, one thread, each round's linears in one C call (`LinearList`): whether a one-row
    call reads one panel at a time or eight; the prefetch distance (of PREFETCH_DISTANCES, the fastest in sum over
    DISTANCE_ROWS, those heights prefetching); at that distance the mask of tile heights that took less time
    prefetching than not (PREFETCH_ROWS measured, PREFETCH_ALWAYS set). One type's panels at a time (~230 MB of
    float32 ones held at most). What was in force before is restored."""
    import statistics
    import time

    gen = torch.Generator().manual_seed(1)
    heights = sorted({1, *PREFETCH_ROWS, *DISTANCE_ROWS})
    x = torch.rand(max(heights), max(k for _, k in PREFETCH_SHAPES), generator=gen)
    inputs = {r: x[:r].contiguous() for r in heights}  # outside the timing
    before = {t: panel_streaming(t) for t in PREFETCH_TYPES}
    chosen = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def medians(stack: LinearList, t: str, settings: dict) -> dict:
        """Median ms per setting, settings: key -> (rows, mask, distance, single), each timed in turn each round."""
        times: dict = {key: [] for key in settings}
        with torch.inference_mode():
            for _ in range(rounds + 1):  # the first round warms
                for key, (r, mask, distance, single) in settings.items():
                    _set_streaming(t, {"mask": mask, "distance": distance, "single": single})
                    start = time.perf_counter()
                    stack(inputs[r])
                    times[key].append((time.perf_counter() - start) * 1e3)
        return {key: statistics.median(v[1:]) for key, v in times.items()}

    try:
        for t in PREFETCH_TYPES:
            shapes = [shape for _ in range(layers) for shape in PREFETCH_SHAPES]
            dtype = getattr(torch, t)
            # on huge pages, as served weights are (alignment.py); the stack reads the panels, the weight its shape
            panels = alignment.pack([to_panels((torch.rand(shape, generator=gen) - 0.5).to(dtype)) for shape in shapes])
            meta = [torch.empty(shape, device="meta") for shape in shapes]
            stack = LinearList(list(zip(meta, panels, strict=True)))
            single = medians(stack, t, {on: (1, 0, PREFETCH_DISTANCES[0], on) for on in (0, 1)})
            single = int(single[1] < single[0])
            med = medians(stack, t, {(r, d): (r, 1 << r, d, single) for r in DISTANCE_ROWS for d in PREFETCH_DISTANCES})
            distance = min(PREFETCH_DISTANCES, key=lambda d: sum(med[(r, d)] for r in DISTANCE_ROWS))
            med = medians(
                stack, t, {(r, on): (r, (1 << r) * on, distance, single) for r in PREFETCH_ROWS for on in (0, 1)}
            )
            mask = sum(1 << r for r in PREFETCH_ROWS if med[(r, 1)] < med[(r, 0)]) | PREFETCH_ALWAYS
            chosen[t] = {"mask": mask, "distance": distance, "single": single}
            del panels, stack
    finally:
        torch.set_num_threads(threads)
        for t, prefetching in before.items():
            _set_streaming(t, prefetching)
    return chosen


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
    all float32 or all bfloat16, or read from float16 copies, everything else float32), packed for the C call once
    (fused_layer.py rebuilds it when a weight moves)."""

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
    wtype: int = 0  # the dtype the linears are read in: float32 0, bfloat16 1, float16 2 (widened on load)
    # how the linears are read: 0 their rows, 1 their panels (`serve_panels`), 2 their bfloat16 panels on the dot
    # product, the inputs rounded to bfloat16 (a draft's linears marked `dot` by fastpath.install: `linear_dot`)
    panels: int = 0


def layer_weights(ln1, ln2, eps, linears, heads, kv_heads, head_dim, scale, layer_idx) -> LayerWeights | None:
    """`linears`: the q, k, v, o, gate, up, down nn.Linear modules, in that order, their weights all float32 or all
    bfloat16 (contiguous); ln1, ln2 float32. Read as their own forwards read them (`served`): from their panels
    where all seven are served from panels, else from their rows (bfloat16 copies where all seven have one, else
    the weights: the same values and bits). None where panels are read in different dtypes (a weight changed in
    place to values bfloat16 does not hold): the layer's modules then run one by one, each on its own."""
    dtypes = {m.weight.dtype for m in linears}
    if len(dtypes) != 1 or not dtypes <= set(WEIGHT_DTYPES):
        raise ValueError(f"a fused layer's linears share one weight dtype of {WEIGHT_DTYPES}, got {dtypes}")
    arr = ctypes.c_void_p * 7
    rows, panels = zip(*(served(m) for m in linears))
    read = panels if all(p is not None for p in panels) else rows
    if len({t.dtype for t in read}) != 1:
        if read is panels:
            return None
        read = [m.weight for m in linears]
    weights = arr(*(t.data_ptr() for t in read))
    biases = [None if m.bias is None else m.bias.detach().float().contiguous() for m in linears]  # read as float32
    keep = (ln1, ln2, *read, *biases)
    biases = arr(*(None if b is None else b.data_ptr() for b in biases))
    inter = linears[4].out_features
    wtype = READ_TYPES[read[0].dtype]
    mode = (2 if wtype == 1 and all(m.__dict__.get("_dot") for m in linears) else 1) if read is panels else 0
    return LayerWeights(
        ln1, ln2, eps, weights, biases, inter, heads, kv_heads, head_dim, scale, layer_idx, keep, wtype, mode
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
        lw.wtype,
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
        ("wtype", ctypes.c_int32),
        ("wpanels", ctypes.c_int32),
    ]

    def set_weights(self, lw: LayerWeights) -> None:
        """What stays from step to step: the layer's tensors and shapes (the caller keeps `lw` alive)."""
        self.ln1, self.ln2 = lw.ln1.data_ptr(), lw.ln2.data_ptr()
        self.w[:], self.b[:] = list(lw.weights), list(lw.biases)
        self.I, self.NH, self.KVH, self.D = lw.intermediate, lw.heads, lw.kv_heads, lw.head_dim
        self.eps, self.scale, self.wtype, self.wpanels = lw.eps, lw.scale, lw.wtype, int(lw.panels)

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
