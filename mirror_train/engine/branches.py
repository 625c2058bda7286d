"""Which branches the draft rolls out while the target finishes: a budgeted, ranked selection.

A branch (r, c) is a guess that the target will accept exactly r drafted tokens and then emit c: it is needed iff
A = r and c* = c. The paper rolls out all κ·(γ+1); a small device cannot in the time the target's suffix takes, so
we rank branches by the probability that each is the one needed, from what crosses the channel (the proxy head's
log-probs at every window position):

    P(A ≥ r)        = Π_{i<r} a_i,     a_i = p_proxy(d_{i+1} | position i)   the proxy's belief the draft is right
    P(A = r)        = P(A ≥ r) (1 − a_r)       (a_γ = 0: the bonus position always stops)
    P(c* = c | A=r) = p_proxy(c | r) / (1 − a_r)   for c ≠ d_{r+1} (c* is not the drafted token when it stops at r)
    score(r, c)     = P(A = r) · P(c* = c | A = r) = P(A ≥ r) · p_proxy(c | r)

and roll out the best B (ties: the earlier position first). B is the configured budget, or fewer when the draft's
measured cost says B would not finish within the target's measured suffix time (`fit_budget`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def rank_branches(
    window: Sequence[int],
    cand_ids: Sequence[Sequence[int]],
    cand_logp: Sequence[Sequence[float]],
    window_logp: Sequence[float],
    accept_prob: Sequence[float],
    budget: int,
) -> list[tuple[int, int, float]]:
    """The `budget` most probable branches as (r, c, score), best first (module docstring).

    window: the drafted d_1..d_γ; cand_ids / cand_logp: (γ+1) × κ proxy candidates and log-probs at each window
    position r = 0..γ; window_logp: (γ) log p_proxy(d_{r+1} | r); accept_prob: (γ) a_r, the probability that the
    target keeps d_{r+1} (window.Calibration of the proxy's belief, learnt online).
    """
    gamma = len(window)
    if len(cand_ids) != gamma + 1 or len(cand_logp) != gamma + 1 or len(window_logp) != gamma:
        raise ValueError("need γ+1 candidate rows and γ window log-probs for a window of γ tokens")
    if len(accept_prob) != gamma:
        raise ValueError("need γ acceptance probabilities for a window of γ tokens")
    scored: list[tuple[float, int, int]] = []
    reach = 1.0  # P(A ≥ r)
    for r in range(gamma + 1):
        if r < gamma:  # stop here: the target rejects d_{r+1}, and c* is one of the proxy's other candidates
            stop = reach * (1 - accept_prob[r]) / max(1 - math.exp(window_logp[r]), 1e-3)
        else:  # the whole window accepted: c* is the bonus token
            stop = reach
        for c, lp in zip(cand_ids[r], cand_logp[r], strict=True):
            if r < gamma and c == window[r]:
                continue  # the spine: accepting d_{r+1} continues the window, no branch needed
            scored.append((stop * math.exp(lp), r, int(c)))
        if r < gamma:
            reach *= accept_prob[r]
    scored.sort(key=lambda s: (-s[0], s[1]))
    return [(r, c, score) for score, r, c in scored[:budget]]


def fit_budget(samples: Sequence[tuple[int, float]], deadline_ms: float | None, budget: int) -> int:
    """The most branches (1..budget) whose predicted rollout time fits `deadline_ms` (the target's suffix).

    samples: recent (branches, ms) rollout measurements; a least-squares line ms = a + b·n predicts the time. With
    fewer than two distinct branch counts measured, or no deadline, the whole budget (the measurements then come).
    """
    line = rollout_line(samples)
    if deadline_ms is None or line is None:
        return budget
    base, slope = line
    fits = int((deadline_ms - base) // slope)
    return max(1, min(budget, fits))


def rollout_line(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) of the least-squares line ms = a + b·branches through `samples`; None with < 2 distinct counts."""
    if len({n for n, _ in samples}) < 2:
        return None
    n_mean = sum(n for n, _ in samples) / len(samples)
    t_mean = sum(t for _, t in samples) / len(samples)
    var = sum((n - n_mean) ** 2 for n, _ in samples)
    slope = max(sum((n - n_mean) * (t - t_mean) for n, t in samples) / var, 1e-6)
    return t_mean - slope * n_mean, slope
