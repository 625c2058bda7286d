"""How long a window to verify, and from which source: expected tokens per unit of the target's time (pure).

Verifying w drafted tokens costs the target c(w) (its step time with w + 1 rows, relative to a one-token step):
nearly flat where wide matmuls are cheap (GPUs, AMX in bf16), ~1.7× for w = 4 in float32 on a CPU. If drafted token
i is kept with probability a_i given the tokens before it were, the step commits in expectation

    E(w) = 1 + Σ_{i ≤ w} Π_{j ≤ i} a_j          (the correction or bonus token always)

tokens, so the window worth verifying is the prefix w maximising E(w) / c(w) (w = 0: a plain target step). The
a_i come from calibrations learnt online from every verdict (`Calibration`): a model-drafted token's by the draft's
own probability of it, a copied token's (ngram.py) by its match size. Where both sources have tokens worth a row,
the two chains can be verified together as one forked window (`best_fork`, forked_window.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence


def expected_committed(accept: Sequence[float]) -> list[float]:
    """E(w) for w = 0..len(accept) (module docstring)."""
    out = [1.0]
    for reach in expected_reach(accept)[1:]:
        out.append(out[-1] + reach)
    return out


def best_length(accept: Sequence[float], cost: Sequence[float]) -> tuple[int, float]:
    """(w, E(w)/c(w)) maximising expected committed tokens per unit of verification time over w = 0..len(accept).

    cost[w]: the relative cost of verifying w drafted tokens (cost[0] = 1); widths past its end extrapolate its last
    step. Ties go to the shorter window."""
    expected = expected_committed(accept)
    best = (0, expected[0] / _cost(cost, 0))
    for w in range(1, len(expected)):
        rate = expected[w] / _cost(cost, w)
        if rate > best[1] + 1e-9:
            best = (w, rate)
    return best


def best_fork(accept_a: Sequence[float], accept_b: Sequence[float], shared: int, cost: Sequence[float]):
    """(la, lb, rate): the lengths of two drafted chains to verify together as one forked window
    (forked_window.py), a's first la tokens and b's first lb, maximising expected committed tokens per unit of
    verification time; (0, 0, 0.0) when no pair forks. `shared`: how many leading tokens the two chains have in
    common (they fork after min(shared, la, lb) of them; a pair where one chain is the other's prefix is a single
    chain, `best_length`'s business).

    Past the fork at most one chain's next token is the target's, so P(the step keeps ≥ i tokens) is the sum of the
    two chains' reach there (each Π a_j), at most the stem's; on the stem, the better of their estimates. The cost
    is that of every row: la + lb − fork drafted tokens."""
    reach_a, reach_b = expected_reach(accept_a), expected_reach(accept_b)
    best = (0, 0, 0.0)
    for la in range(1, len(accept_a) + 1):
        for lb in range(1, len(accept_b) + 1):
            fork = min(shared, la, lb)
            if fork >= la or fork >= lb:
                continue
            stem = max(reach_a[fork], reach_b[fork])
            expected = 1.0 + sum(max(reach_a[i], reach_b[i]) for i in range(1, fork + 1))
            for i in range(fork + 1, max(la, lb) + 1):
                expected += min(stem, (reach_a[i] if i <= la else 0.0) + (reach_b[i] if i <= lb else 0.0))
            rate = expected / _cost(cost, la + lb - fork)
            if rate > best[2] + 1e-9:
                best = (la, lb, rate)
    return best


def expected_reach(accept: Sequence[float]) -> list[float]:
    """P(the first i drafted tokens are all kept) for i = 0..len(accept): 1, a_1, a_1·a_2, ..."""
    out = [1.0]
    for a in accept:
        out.append(out[-1] * a)
    return out


def _cost(cost: Sequence[float], w: int) -> float:
    if not cost:
        return 1.0
    if w < len(cost):
        return cost[w]
    step = cost[-1] - cost[-2] if len(cost) > 1 else 0.0
    return cost[-1] + step * (w - len(cost) + 1)


class Calibration:
    """P(the target keeps a drafted token | a key), learnt from outcomes, shrunk to the overall rate.

    Keys are whatever predicts acceptance: a probability bin for a model's token (`prob_key`), the match size for a
    copied one. Starts at `initial` with no data; `prior` pseudo-counts pull a sparse key towards the overall rate."""

    def __init__(self, prior: float = 4.0, initial: float = 0.5):
        self.prior, self.initial = prior, initial
        self.kept: dict = {}
        self.seen: dict = {}

    def overall(self, match=None) -> float:
        """The rate over every key (or the keys `match` accepts), shrunk to `initial` with `prior` pseudo-counts."""
        keys = [k for k in self.seen if match is None or match(k)]
        total = sum(self.seen[k] for k in keys)
        return (sum(self.kept[k] for k in keys) + self.prior * self.initial) / (total + self.prior)

    def predict(self, keys: Sequence) -> list[float]:
        overall = self.overall()
        return [(self.kept.get(k, 0) + self.prior * overall) / (self.seen.get(k, 0) + self.prior) for k in keys]

    def update(self, keys: Sequence, accepted: int) -> None:
        """keys of a verified window's tokens; accepted: A (the tokens after A are unobserved)."""
        for i, k in enumerate(keys[: accepted + 1]):
            self.seen[k] = self.seen.get(k, 0) + 1
            self.kept[k] = self.kept.get(k, 0) + (i < accepted)


def prob_key(p: float, bins: int = 10) -> int:
    """The bin of a probability: a model token's calibration key."""
    return min(int(p * bins), bins - 1)


def fit_costs(samples: Sequence[tuple[int, float]], widths: int) -> tuple[list[float], float] | None:
    """Relative verification costs c(0..widths) from (w, ms) measurements, and the ms of a one-token step (None with
    fewer than two widths measured, or without w = 0).

    Per measured width the median, made non-decreasing (a wider window never costs less), linearly interpolated in
    between and extrapolated past the widest measured by the last segment's slope. Not one line through all of them:
    on a CPU the second row costs the most (torch's float32 matmuls jump from 1 to 2 rows, docs/engine.md), and a
    line would price a one-token window too cheaply."""
    by_width: dict[int, list[float]] = {}
    for w, ms in samples:
        by_width.setdefault(int(w), []).append(ms)
    if len(by_width) < 2 or 0 not in by_width:
        return None
    points = sorted((w, statistics.median(ms)) for w, ms in by_width.items())
    monotone, top = [], 0.0
    for w, ms in points:
        top = max(top, ms)
        monotone.append((w, top))
    base = monotone[0][1]
    out = []
    for w in range(widths + 1):
        right = next((i for i, (x, _) in enumerate(monotone) if x >= w), None)
        if right is None:  # past the widest: the last segment's slope
            (x0, y0), (x1, y1) = monotone[-2], monotone[-1]
            ms = y1 + (y1 - y0) / (x1 - x0) * (w - x1)
        elif monotone[right][0] == w or right == 0:
            ms = monotone[right][1]
        else:
            (x0, y0), (x1, y1) = monotone[right - 1], monotone[right]
            ms = y0 + (y1 - y0) * (w - x0) / (x1 - x0)
        out.append(ms / base)
    return out, base


def rollout_plan(
    accept: float,
    costs: Sequence[float],
    pass_cost: float,
    tokens_per_pass: int,
    gamma: int,
    drafted: int = 0,
    fixed_cost: float = 0.0,
) -> tuple[int, float]:
    """How many tokens to draft before the target can verify them (serial SD, a Mirror-SD fallback or the completion
    of a short branch), and the rate that promises: the best E(w) / (c(w) + passes(w) · pass_cost) over
    w = max(drafted, 1)..γ at the model's mean per-token acceptance `accept`, where `drafted` tokens are already
    there and each pass yields `tokens_per_pass` more (a Speculative-Streaming draft: 1 + its streams). The count
    returned is w rounded up to whole passes (capped at γ): a pass's extra tokens cost nothing more, and the window
    is cut to what pays afterwards. pass_cost: one pass in units of a one-token target step; fixed_cost: what a
    serial rollout costs the target besides its passes (feeding the committed tokens, the reply), same units.

    Not always γ: at γ = 4 with two streams a whole window takes two passes, and where the fourth token is unlikely
    kept the second pass costs more time than it brings."""
    best = (max(drafted, 1), 0.0)
    for w in range(max(drafted, 1), gamma + 1):
        passes = -(-(w - drafted) // tokens_per_pass)
        rate = expected_committed([accept] * w)[-1] / (_cost(costs, w) + fixed_cost + passes * pass_cost)
        if rate > best[1] + 1e-9:
            best = (min(gamma, drafted + passes * tokens_per_pass), rate)
    return best


def serial_overhead(samples: Sequence[tuple[int, float]], pass_ms: float) -> float:
    """What serial rollouts cost beyond `pass_ms` a pass, in ms: the mean over measured (passes, ms) samples of
    ms − passes · pass_ms, never below 0 (0 with no samples yet)."""
    if not samples:
        return 0.0
    return max(0.0, sum(ms - n * pass_ms for n, ms in samples) / len(samples))


def ask_model(model_rate: float, copy_rate: float, skipped: int, explore_in: int) -> bool:
    """Whether the engine asks the draft's process for the next window where it serves copies itself
    (EngineConfig.copies = "target"): where the rate the model last promised beats the copy on offer (a plain step's
    1 where there is none), or where the draft is due to explore its model again (`explore_in` skipped steps after
    its last reply; server.py `_serial_plan`)."""
    return model_rate > max(copy_rate, 1.0) or skipped >= explore_in


class AskReturn:
    """What the draft's process delivers when asked for the promise of its model, measured: the ratio of the rate
    realized by the steps that followed rate-driven asks (the tokens the next verification committed, over its time
    plus the ask's wait, in one-token steps) to the rates promised (the model's `model_rate` that triggered them),
    over the last `window` asks, shrunk towards 1 (the promise taken at its word) by `prior` asks' worth.

    The promise is the model's mean acceptance planned against its measured rollout time, last reported by the
    process; an ask then waits for a window drafted for this context, which may lose to the copy on offer (the wait
    bought nothing), and the model's tokens may be kept less than planned. Measured on Zen 4 (docs/engine.md,
    twenty-third session), asks cost 5 ms each for ~0.15 tokens and asking at all slowed Mirror-SD 1–3% against
    asking never; scaled by what it delivered, the promise asks where it pays, on any machine (where asks pay, as on
    two GPUs, the factor stays ~1). Explorations (the draft's own schedule) are not counted: they ask where the model
    promised less than the copy."""

    def __init__(self, window: int = 32, prior: float = 4.0):
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (promised, realized)
        self.prior = prior

    def add(self, promised: float, realized: float) -> None:
        if math.isfinite(promised) and promised > 0:
            self.samples.append((promised, realized))

    def factor(self) -> float:
        promised = sum(p for p, _ in self.samples)
        realized = sum(r for _, r in self.samples)
        mean = promised / len(self.samples) if self.samples else 1.0
        return (realized + self.prior * mean) / (promised + self.prior * mean)
