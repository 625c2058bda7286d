"""Greedy tokens without reading the whole float32 LM head: a low-precision screen bounds where the argmax can be,
and the served head computes exactly only there.

A greedy step needs one thing of the LM head: the id of each row's largest logit. Computing all V logits in float32
reads the whole head (the testbed's 49,152 x 576: 113 MB, a fifth of a step's weights) and, at a window's 8 rows,
costs ~18% of the step's multiply-adds. The screen computes every logit from a low-precision copy of the head, and a
bound on how far each screened logit can be from the served one. Every id whose served logit could be the largest
is a candidate; the served head (the same kernel, the same bits: `kernels.linear_at`) computes those alone, and the
largest of them, lowest id first on a tie as `torch.argmax`, is the token. The output is the served head's argmax
exactly, whatever the screen rounds: what it changes is the time. Four screens (KINDS):
- `int8_amx` (AMX-INT8 tiles, Sapphire Rapids and later Xeons): `int8` below on tiles, the same bits; ~16× cheaper
  products, so it streams its bytes at 1–16 rows where `int8` is compute-bound from ~4 (forty-fourth session);
- `int8` (AVX512-VNNI, csrc/screen_q8.c): each weight row in int8 with its own scale (a quarter of the bytes), each
  input row in two int8 bytes a value (x ≈ s·(h + l/254), so the input's rounding stays near float32's and the
  bound near the bfloat16 screen's: on the testbed's final states ~2 candidates a row, against ~27 with one byte),
  on the dot product of byte quads, whose integer sums are exact. On the AMX Xeon its scores took 1.6 ms at one row
  and 3.0 at eight against the bfloat16 dot product's 4.4 and 4.5 (docs/engine.md, forty-third session);
- `bf16_dot` (AVX512-BF16): the weight rounded to bfloat16 (half the bytes) on the dot product of pairs, the inputs
  rounded to bfloat16 too;
- `bf16`: the bfloat16 weight widened to float32, the inputs as they are (any CPU the kernels build on).
`build` takes the fastest this CPU builds, measured once per machine.

The bound. For a row x and an id v, with x̂, ŵ_v the screen's values (subnormals flushed where the bfloat16
instruction reads them so; ŵ_v = the row's scale × its int8 values for `int8`) and u = 2⁻²⁴, the screen's sum
differs from the served one by at most
    |x̂·ŵ_v − x·w_v| + γ(n)·Σ|x̂_k ŵ_vk| + γ(n)·Σ|x_k w_vk|  ≤  ‖x̂‖·(‖ŵ_v − w_v‖ + γ‖ŵ_v‖) + (γ‖x‖ + ‖x̂ − x‖)·‖w_v‖
                                                            =  α·s_v + β·n_v  =: e_v
(Cauchy–Schwarz, and γ(n) = n·u / (1 − n·u) bounding any order of n float32 additions: n = 2K + 2 covers both
sums; the int8 screen's sums are exact integers, and its few float32 roundings after them lie inside the same γ
term: csrc/screen_argmax.c), plus n flushed subnormals. s_v and n_v are the head's, per id (measured once, exactly,
in float64, rounded up to float32: `ScreenedHead.bounds`); α, β the row's (its norms in float64 each call, from x̂
as the screen rounded it). The served logit at the row's
screened argmax, L, is computed first: the served maximum is at least L, so every id whose served logit is the
maximum has a screened logit a_v ≥ L − e_v: the candidates, each computed by the served arithmetic in one C call
(kernels' `screen_argmax`). Against the first bound
(a_v ≥ max a − 2·max e, thirty-third session) this keeps ~30× fewer ids where the row's logits are flat (~150 → ~3
a row on random-token contexts; docs/engine.md, thirty-eighth session): L is exact where max a was e away, and a
typical id's norm is ~0.4 of the largest.

Where it pays is measured once per machine, by rows (`ScreenedHead.rows`, at the fast path's install): with the
bfloat16 dot product it roughly halves the head's time at 1–16 rows on an AVX-512 Zen 4 core (docs/engine.md,
thirty-third session). Sampling goes through it too: the engine's sample at T > 0 is the Gumbel-max one,
argmax(logits + T·G) with the noise G of (seed, position) (engine/acceptance.py), an argmax again: the same bound
keeps every id whose served logit plus its noise could be the largest sum (the noise added to the screened logit and
to the exact one alike, the slack grown by the noise's size), and the id is `(head(x) + noise).argmax()`'s exactly
(forty-fifth session). transformers' `generate` (its logits processors) still reads the whole head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mirror_train import alignment, fused_head, kernels
from mirror_train.timing import interleaved_median_ms

# rows a call's time is measured at (a one-token step, windows); a call takes the verdict of the next one up, and
# calls past the last take the whole head
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # 64: kernels.MAX_ROWS, past which the head is a GEMM
# more candidates than this and the screen was no screen (a pathological row): the whole head instead
MAX_CANDIDATES = 4096
_U = 2.0**-24
_TINY = 2.0**-126  # float32's smallest normal: what the dot product flushes to zero
_MEASURED: dict[tuple, tuple[bool, ...]] = {}  # `_measure`'s verdicts by ((V, K, panels, layout), kind) (per machine)
_FASTEST: dict[tuple, str] = {}  # `_fastest`'s choice by ((V, K, panels, layout), the kinds built) (per machine)


KINDS = ("int8_amx", "int8", "bf16_dot", "bf16")  # what the screen reads (module docstring); `build` takes the fastest
# how the kernels' screen_argmax rounds a row (x as read, bf16, 2 bytes)
MODES = {"bf16": 0, "bf16_dot": 1, "int8": 2, "int8_amx": 2}
INT8 = ("int8_amx", "int8")  # the screens that read the head's int8 panels (the same weights, the same bits)


@dataclass
class ScreenedHead:
    """An LM head's screen: the weights it reads and the constants of the bound, and by ROWS whether it is used."""

    kind: str  # one of KINDS
    # what the screen reads: (bfloat16 panels,) for bf16_dot; (bfloat16 rows or panels,) for bf16, with `shape` the
    # weight's; (int8 panels, per-row scales, per-row sums) for int8 and int8_amx (csrc/linear_q8.c's layout)
    weights: tuple[torch.Tensor, ...]
    shape: tuple[int, int]
    # float64 (max over ids of ‖ŵ_v − w_v‖ + γ‖ŵ_v‖, max over ids of ‖w_v‖, γ, what flushed subnormals can add):
    # the kernel's screen_argmax computes each row's bound from them and `bounds`
    constants: torch.Tensor
    bounds: torch.Tensor  # float32 (2, V), each rounded up: s_v = ‖ŵ_v − w_v‖ + γ‖ŵ_v‖ and n_v = ‖w_v‖, per id
    rows: tuple[bool, ...] = (True,) * len(ROWS)
    version: tuple[int, int] = (0, 0)  # the weight's (address, version) it was made from

    @property
    def mode(self) -> int:
        return MODES[self.kind]

    def used(self, n: int) -> bool:
        for r, verdict in zip(ROWS, self.rows, strict=True):
            if n <= r:
                return verdict
        return False


def applies(head: nn.Module) -> bool:
    """A float32 CPU linear without a bias, where the kernels build (`fastpath.install` builds screens only for heads
    the row-exact kernel serves: the exact logits must be `kernels.linear`'s)."""
    w = getattr(head, "weight", None)
    return (
        isinstance(head, nn.Linear)
        and w is not None
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.is_contiguous()
        and getattr(head, "bias", None) is None
        and kernels.available()
    )


def kinds_built() -> list[str]:
    """The screens this machine's kernels can run, fastest expected first (`build` measures them)."""
    built = {
        "int8_amx": kernels.screen_q8() and kernels.screen_q8_amx(),
        "int8": kernels.screen_q8(),
        "bf16_dot": kernels.screen_dot(),
        "bf16": True,
    }
    return [k for k in KINDS if built[k]]


def build(head: nn.Module, measure: bool = True, kind: str = "auto") -> ScreenedHead | None:
    """The screen of `head` (None where it does not apply), kept on the module (`screen_of` finds it). kind: one of
    KINDS, or auto: the fastest of `kinds_built` (measured once per machine per head shape, unless `measure` is False:
    then the first). Its use by rows is measured here against the whole head unless `measure` is False (then used at
    every row count ≤ 64). Why measure rather than rank: on the AMX Xeon the widened bfloat16 screen beat the
    bfloat16 dot product at 1–4 rows (`scripts/bench_screen.py`, forty-third session), on Zen 4 the other way round."""
    if not applies(head):
        head.__dict__.pop("_screen", None)
        return None
    built = kinds_built()
    if kind != "auto" and kind not in built:
        raise ValueError(f"screen kind {kind!r} is not built here; built: {built}")
    w = head.weight.detach()
    key = (*w.shape, kernels.panels_of(head) is not None, kernels.layout())
    # The screens' times depend on the head's shape and this machine only: measured once per machine and kept beside
    # the kernel library (`kernels.per_machine`), as the layout is: every process after the first (the engine's, a
    # Spec-Bench run's) starts without the ~1-2 s of timing, and all serve the same choice
    name = "screen_{}x{}_{}_{}".format(*key[:2], "panels" if key[2] else "rows", key[3])
    made: dict[str, ScreenedHead] = {}
    if kind == "auto":
        kind = built[0]
        if measure and len(built) > 1:
            choice = (key, *built)
            if choice not in _FASTEST:

                def fastest() -> dict:
                    made.update({k: _made(head, k) for k in built})
                    return {"kind": _fastest(head, list(made.values()))}

                kept = kernels.per_machine(f"{name}_{'-'.join(built)}", fastest, {"kind"}, lambda v: v["kind"] in built)
                _FASTEST[choice] = kept["kind"]
            kind = _FASTEST[choice]
    screen = made.get(kind) or _made(head, kind)  # the one timed, if it was: not made twice
    head.__dict__["_screen"] = screen
    if measure:
        if (key, kind) not in _MEASURED:
            kept = kernels.per_machine(
                f"{name}_{kind}_rows",
                lambda: {"rows": list(_measure(head, screen))},
                {"rows"},
                lambda v: len(v["rows"]) == len(ROWS) and all(isinstance(r, bool) for r in v["rows"]),
            )
            _MEASURED[(key, kind)] = tuple(kept["rows"])
        screen.rows = _MEASURED[(key, kind)]
    return screen


def _made(head: nn.Module, kind: str) -> ScreenedHead:
    """The screen of `head` of this kind, its bounds computed exactly (module docstring)."""
    w = head.weight.detach()
    n, k = w.shape
    gamma = (2 * k + 2) * _U / (1 - (2 * k + 2) * _U)
    if kind in INT8:  # ŵ_v = its scale × its int8 row, what the kernel multiplies (exactly, in float64)
        panels, scales, sums = fused_head.quantize_panels(w, kernels.lanes())
        q = panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * panels.shape[2], -1)[:n, :k]
        q_scales = scales[:n]
        low = None
        weights = (alignment.pack([panels])[0], scales, sums)  # huge pages, as the weights
    else:
        low = w.to(torch.bfloat16)
        panels = kernels.panels_of(head) is not None or kind == "bf16_dot"
        placed = alignment.pack([kernels.to_panels(low) if panels else low])[0]
        weights = (placed,)
    per_id = torch.empty(2, n, dtype=torch.float64)
    for start in range(0, n, 4096):  # float64 a chunk at a time: the whole head's would be 226 MB
        wd = w[start : start + 4096].double()
        if kind in INT8:
            ld = q[start : start + 4096].double() * q_scales[start : start + 4096].double()[:, None]
        else:
            ld = low[start : start + 4096].double()
            if kind == "bf16_dot":  # the instruction reads subnormals as zero
                ld = torch.where(ld.abs() < _TINY, 0.0, ld)
        per_id[0, start : start + 4096] = (ld - wd).norm(dim=1) + gamma * ld.norm(dim=1)
        per_id[1, start : start + 4096] = wd.norm(dim=1)
    per_id *= 1 + 1e-9
    slack, norm = (float(v) for v in per_id.max(dim=1).values)
    # what flushed subnormals (the bf16 dot product), or roundings in float32's subnormal range, can add
    flushed = (2 * k + 2) * _TINY
    return ScreenedHead(
        kind=kind,
        weights=weights,
        shape=(n, k),
        constants=torch.tensor([slack, norm, gamma, flushed], dtype=torch.float64),
        bounds=_rounded_up(per_id),
        version=(head.weight.data_ptr(), head.weight._version),
    )


def screen_of(head: nn.Module) -> ScreenedHead | None:
    """The screen `build` kept on `head`, made again if its weight has moved or changed in place since; None where
    none was built (the head serves greedy calls whole)."""
    screen = head.__dict__.get("_screen")
    if screen is None:
        return None
    if screen.version != (head.weight.data_ptr(), head.weight._version):
        rows, screen = screen.rows, build(head, measure=False, kind=screen.kind)
        if screen is not None:
            screen.rows = rows  # what was measured stays: the weight's values do not change the head's time
    return screen


def argmax(head: nn.Module, x: torch.Tensor) -> list[int]:
    """The id of the largest logit of `head(x)` for each row of x (..., K), as `head(x).argmax(-1)` gives it (the
    first on a tie), through the screen where one is built and pays at this many rows."""
    return argmax_and_scores(head, x)[0]


def argmax_and_scores(
    head: nn.Module, x: torch.Tensor, noise: torch.Tensor | None = None
) -> tuple[list[int], torch.Tensor, bool]:
    """`argmax`, the logits it read, (rows, V), and whether they are the screen's (each within the bound of the
    head's: for statistics, never for a token) rather than the head's own (it ran whole). `noise` (rows, V) float32:
    the first largest of each row's `head(x) + noise` instead (a Gumbel-max sample: acceptance.py), the same id
    whether the screen or the whole head computed it (both add in float32)."""
    rows = x.reshape(-1, x.shape[-1])
    screen = screen_of(head)
    if screen is not None and screen.used(rows.shape[0]) and rows.dtype == torch.float32:  # used: ≤ 64 rows
        scores = screen_scores(screen, rows)
        ids = screened_argmax(head, screen, rows, scores, noise)
        if ids is not None:
            return ids, scores[:, : head.weight.shape[0]], True
    logits = head(rows)
    return whole_argmax(logits, noise), logits, False


def whole_argmax(logits: torch.Tensor, noise: torch.Tensor | None = None) -> list[int]:
    """Each row's first largest logit, or logit plus its noise (a Gumbel-max sample) summed in float32, as the
    screen sums them: the id the screen's path gives, computed from all of a row's logits."""
    picked = logits if noise is None else logits.float() + noise.to(logits.device)
    return picked.argmax(-1).tolist()


def logits_at(head: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`head(x)[..., ids]` for rows x (M, K), computing only those where a screen is built (the served bits)."""
    rows = x.reshape(-1, x.shape[-1])
    if screen_of(head) is not None and rows.dtype == torch.float32 and rows.shape[0] <= kernels.MAX_ROWS:
        return kernels.linear_at(rows, head.weight.detach(), ids, kernels.panels_of(head))
    return head(rows)[:, ids]


def screen_scores(screen: ScreenedHead, rows: torch.Tensor) -> torch.Tensor:
    """Every screened logit of float32 `rows` (M, K): (M, ≥ V), past V the panels' zero padding."""
    if screen.kind in INT8:
        return kernels.screen_q8_scores(rows, screen.shape[0], *screen.weights, tiles=screen.kind == "int8_amx")
    low = screen.weights[0]
    if screen.kind == "bf16_dot":  # every panel's outputs, the padding's zeros past V included
        return kernels.linear_dot(rows, low.shape[0] * low.shape[2], low)
    if low.dim() == 2:  # rows
        return kernels.linear(rows.contiguous(), low, None, None)
    return kernels.linear(rows.contiguous(), torch.empty(screen.shape, dtype=low.dtype, device="meta"), None, low)


def screened_argmax(
    head: nn.Module,
    screen: ScreenedHead,
    rows: torch.Tensor,
    scores: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> list[int] | None:
    """`argmax` through the screen (`scores`: its logits of these rows, if already made; `noise`: of the logits plus
    it, `argmax_and_scores`) or None: the bound is not finite, or passes MAX_CANDIDATES."""
    w = head.weight.detach()
    if not kernels.has("screen_per_id"):  # an older revision's kernels (bench_target.py --baseline): another bound
        return None
    if noise is not None and not kernels.has("screen_sample"):
        return None
    if scores is None:
        scores = screen_scores(screen, rows)
    panels = kernels.panels_of(head)
    if panels is None and w.dtype != torch.float32:
        return None
    return kernels.screen_argmax(
        scores, rows, w, panels, screen.mode, screen.constants, screen.bounds, MAX_CANDIDATES, noise
    )


def read_rows(screen: ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the screen reads it (x̂ of the bound), exactly, in float64: as it is, rounded to bfloat16, or
    int8's two bytes a value (csrc/screen_q8.c's split, replayed in float32 arithmetic). For tests and benchmarks:
    the kernels compute it themselves."""
    if screen.kind == "bf16":
        return x.double()
    if screen.kind == "bf16_dot":
        return x.bfloat16().double()
    big = x.abs().amax(dim=1, keepdim=True)
    s = torch.where(big > 0, big / 127, torch.ones_like(big))
    t = x * (1 / s)
    h = torch.round(t).clamp(-127, 127)
    lo = torch.round((t - h) * 254).clamp(-127, 127)
    return s.double() * (h.double() + float(torch.tensor(1 / 254)) * lo.double())


def error_bounds(screen: ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    """(M, V) float64: e_v of each row of x (M, K) and id, the bound on |screened − served logit| (module docstring),
    from the screen's per-id constants and x̂ (`read_rows`). For tests and benchmarks: the kernel computes its own."""
    xl, xd = read_rows(screen, x), x.double()
    _, _, gamma, flushed = (float(v) for v in screen.constants)
    s_v, n_v = screen.bounds.double()
    alpha, beta = xl.norm(dim=1)[:, None], (gamma * xd.norm(dim=1) + (xl - xd).norm(dim=1))[:, None]
    return alpha * s_v + beta * n_v + flushed


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 values as float32, each rounded up (a bound stays a bound)."""
    low = values.float()
    return torch.where(low.double() < values, torch.nextafter(low, torch.tensor(float("inf"))), low).contiguous()


def _measure(head: nn.Module, screen: ScreenedHead, repeats: int = 9) -> tuple[bool, ...]:
    """Whether the screen beats the whole head at each of ROWS rows, here (interleaved medians on random rows)."""
    g = torch.Generator().manual_seed(0)
    fns = {}
    with torch.inference_mode():
        for n in ROWS:
            x = torch.randn(n, head.weight.shape[1], generator=g)
            fns[(n, "whole")] = lambda x=x: head(x).argmax(-1).tolist()
            fns[(n, "screen")] = lambda x=x: screened_argmax(head, screen, x)
        times = interleaved_median_ms(fns, repeats=repeats, warmup=1)
    return tuple(times[(n, "screen")] < times[(n, "whole")] for n in ROWS)


def _fastest(head: nn.Module, screens: list[ScreenedHead], repeats: int = 9) -> str:
    """The kind of the fastest of `screens` over the rows a step verifies (1, 4 and 8: their times summed;
    interleaved medians on random rows)."""
    g = torch.Generator().manual_seed(0)
    xs = {n: torch.randn(n, head.weight.shape[1], generator=g) for n in (1, 4, 8)}
    fns = {(s.kind, n): (lambda s=s, x=x: screened_argmax(head, s, x)) for s in screens for n, x in xs.items()}
    with torch.inference_mode():
        times = interleaved_median_ms(fns, repeats=repeats, warmup=1)
    return min(screens, key=lambda s: sum(times[(s.kind, n)] for n in xs)).kind
