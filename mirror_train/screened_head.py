"""Greedy tokens without reading the whole float32 LM head: a bfloat16 screen bounds where the argmax can be, and the
served head computes exactly only there.

A greedy step needs one thing of the LM head: the id of each row's largest logit. Computing all V logits in float32
reads the whole head (the testbed's 49,152 x 576: 113 MB, a fifth of a step's weights) and, at a window's 8 rows,
costs ~18% of the step's multiply-adds. The screen computes every logit from the head's weight rounded to bfloat16
(half the bytes; with AVX512-BF16's dot product of pairs, half the instructions too, on inputs rounded to bfloat16),
and a bound on how far each screened logit can be from the served one. Every id whose served logit could be the
largest is a candidate; the served head (the same kernel, the same bits: `kernels.linear_at`) computes those alone,
and the largest of them, lowest id first on a tie as `torch.argmax`, is the token. The output is the served head's
argmax exactly, whatever the screen rounds: what it changes is the time.

The bound. For a row x and an id v, with x̂, ŵ_v the screen's bfloat16 values (subnormals flushed, as the
instruction reads them) and u = 2⁻²⁴, the screen's sum differs from the served one by at most
    |x̂·ŵ_v − x·w_v| + γ(n)·Σ|x̂_k ŵ_vk| + γ(n)·Σ|x_k w_vk|  ≤  ‖x̂‖·(‖ŵ_v − w_v‖ + γ‖ŵ_v‖) + (γ‖x‖ + ‖x̂ − x‖)·‖w_v‖
                                                            =  α·s_v + β·n_v  =: e_v
(Cauchy–Schwarz, and γ(n) = n·u / (1 − n·u) bounding any order of n float32 additions: n = 2K + 2 covers both
sums), plus n flushed subnormals. s_v and n_v are the head's, per id (measured once, exactly, in float64, rounded up
to float32: `ScreenedHead.bounds`); α, β the row's (its norms in float64 each call). The served logit at the row's
screened argmax, L, is computed first: the served maximum is at least L, so every id whose served logit is the
maximum has a screened logit a_v ≥ L − e_v: the candidates, each computed by the served arithmetic in one C call
(kernels' `screen_argmax`). Against the first bound
(a_v ≥ max a − 2·max e, thirty-third session) this keeps ~30× fewer ids where the row's logits are flat (~150 → ~3
a row on random-token contexts; docs/engine.md, thirty-eighth session): L is exact where max a was e away, and a
typical id's norm is ~0.4 of the largest.

Where it pays is measured once per machine, by rows (`ScreenedHead.rows`, at the fast path's install): with the
dot product it roughly halves the head's time at 1–16 rows on an AVX-512 Zen 4 core (docs/engine.md, thirty-third
session). Greedy only: sampling needs every probability (`Target.greedy_scores` is for temperature 0), as does
transformers' `generate` (its logits processors), which therefore still reads the whole head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mirror_train import alignment, kernels
from mirror_train.timing import interleaved_median_ms

# rows a call's time is measured at (a one-token step, windows); a call takes the verdict of the next one up, and
# calls past the last take the whole head
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # 64: kernels.MAX_ROWS, past which the head is a GEMM
# more candidates than this and the screen was no screen (a pathological row): the whole head instead
MAX_CANDIDATES = 4096
_U = 2.0**-24
_TINY = 2.0**-126  # float32's smallest normal: what the dot product flushes to zero
_MEASURED: dict[tuple, tuple[bool, ...]] = {}  # `_measure`'s verdicts by (V, K, dot, panels, layout), per process


@dataclass
class ScreenedHead:
    """An LM head's screen: its bfloat16 panels and the constants of the bound, and by ROWS whether it is used."""

    low: torch.Tensor  # the weight in bfloat16: its rows, or only their shape (on the meta device) where panels
    low_panels: torch.Tensor | None  # its panels (`kernels.to_panels`): the dot product's, or the served layout's
    dot: bool
    # float64 (max over ids of ‖ŵ_v − w_v‖ + γ‖ŵ_v‖, max over ids of ‖w_v‖, γ, what flushed subnormals can add):
    # the kernel's screen_argmax computes each row's bound from them and `bounds`
    constants: torch.Tensor
    bounds: torch.Tensor  # float32 (2, V), each rounded up: s_v = ‖ŵ_v − w_v‖ + γ‖ŵ_v‖ and n_v = ‖w_v‖, per id
    rows: tuple[bool, ...] = (True,) * len(ROWS)
    version: tuple[int, int] = (0, 0)  # the weight's (address, version) it was made from

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


def build(head: nn.Module, measure: bool = True) -> ScreenedHead | None:
    """The screen of `head` (None where it does not apply), kept on the module (`screen_of` finds it), its use by
    rows measured here against the whole head unless `measure` is False (then used at every row count ≤ 64)."""
    if not applies(head):
        head.__dict__.pop("_screen", None)
        return None
    w = head.weight.detach()
    dot = kernels.screen_dot()
    low = w.to(torch.bfloat16)
    n, k = w.shape
    gamma = (2 * k + 2) * _U / (1 - (2 * k + 2) * _U)
    per_id = torch.empty(2, n, dtype=torch.float64)
    for start in range(0, n, 4096):  # float64 a chunk at a time: the whole head's would be 226 MB
        wd, ld = w[start : start + 4096].double(), low[start : start + 4096].double()
        if dot:
            ld = torch.where(ld.abs() < _TINY, 0.0, ld)
        per_id[0, start : start + 4096] = (ld - wd).norm(dim=1) + gamma * ld.norm(dim=1)
        per_id[1, start : start + 4096] = wd.norm(dim=1)
    per_id *= 1 + 1e-9
    slack, norm = (float(v) for v in per_id.max(dim=1).values)
    panels = kernels.panels_of(head) is not None or dot
    placed = alignment.pack([kernels.to_panels(low) if panels else low])[0]  # huge pages, as the weights
    screen = ScreenedHead(
        low=torch.empty(n, k, dtype=torch.bfloat16, device="meta") if panels else placed,
        low_panels=placed if panels else None,
        dot=dot,
        constants=torch.tensor([slack, norm, gamma, (2 * k + 2) * _TINY], dtype=torch.float64),
        bounds=_rounded_up(per_id),
        version=(head.weight.data_ptr(), head.weight._version),
    )
    head.__dict__["_screen"] = screen
    if measure:
        key = (n, k, dot, panels, kernels.layout())
        if key not in _MEASURED:  # the head's time depends on its shape and this machine, not on its values
            _MEASURED[key] = _measure(head, screen)
        screen.rows = _MEASURED[key]
    return screen


def screen_of(head: nn.Module) -> ScreenedHead | None:
    """The screen `build` kept on `head`, made again if its weight has moved or changed in place since; None where
    none was built (the head serves greedy calls whole)."""
    screen = head.__dict__.get("_screen")
    if screen is None:
        return None
    if screen.version != (head.weight.data_ptr(), head.weight._version):
        rows, screen = screen.rows, build(head, measure=False)
        if screen is not None:
            screen.rows = rows  # what was measured stays: the weight's values do not change the head's time
    return screen


def argmax(head: nn.Module, x: torch.Tensor) -> list[int]:
    """The id of the largest logit of `head(x)` for each row of x (..., K), as `head(x).argmax(-1)` gives it (the
    first on a tie), through the screen where one is built and pays at this many rows."""
    return argmax_and_scores(head, x)[0]


def argmax_and_scores(head: nn.Module, x: torch.Tensor) -> tuple[list[int], torch.Tensor, bool]:
    """`argmax`, the logits it read, (rows, V), and whether they are the screen's (each within the bound of the
    head's: for statistics, never for a token) rather than the head's own (it ran whole)."""
    rows = x.reshape(-1, x.shape[-1])
    screen = screen_of(head)
    if screen is not None and screen.used(rows.shape[0]) and rows.dtype == torch.float32:  # used: ≤ 64 rows
        scores = screen_scores(screen, rows)
        ids = screened_argmax(head, screen, rows, scores)
        if ids is not None:
            return ids, scores[:, : head.weight.shape[0]], True
    logits = head(rows)
    return logits.argmax(-1).tolist(), logits, False


def logits_at(head: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`head(x)[..., ids]` for rows x (M, K), computing only those where a screen is built (the served bits)."""
    rows = x.reshape(-1, x.shape[-1])
    if screen_of(head) is not None and rows.dtype == torch.float32 and rows.shape[0] <= kernels.MAX_ROWS:
        return kernels.linear_at(rows, head.weight.detach(), ids, kernels.panels_of(head))
    return head(rows)[:, ids]


def screen_scores(screen: ScreenedHead, rows: torch.Tensor) -> torch.Tensor:
    """Every screened logit of float32 `rows` (M, K): (M, ≥ V), past V the panels' zero padding."""
    if screen.dot:  # every panel's outputs, the padding's zeros past V included
        return kernels.linear_dot(rows, screen.low_panels.shape[0] * screen.low_panels.shape[2], screen.low_panels)
    return kernels.linear(rows.contiguous(), screen.low, None, screen.low_panels)


def screened_argmax(
    head: nn.Module, screen: ScreenedHead, rows: torch.Tensor, scores: torch.Tensor | None = None
) -> list[int] | None:
    """`argmax` through the screen (`scores`: its logits of these rows, if already made) or None: the bound is not
    finite, or passes MAX_CANDIDATES."""
    w = head.weight.detach()
    if not kernels.has("screen_per_id"):  # an older revision's kernels (bench_target.py --baseline): another bound
        return None
    if scores is None:
        scores = screen_scores(screen, rows)
    panels = kernels.panels_of(head)
    if panels is None and w.dtype != torch.float32:
        return None
    return kernels.screen_argmax(scores, rows, w, panels, screen.dot, screen.constants, screen.bounds, MAX_CANDIDATES)


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
