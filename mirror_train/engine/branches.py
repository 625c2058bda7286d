"""Which branches the draft rolls out while the target finishes: a budgeted, ranked selection.

A branch (r, c) is a guess that the target will accept exactly r drafted tokens and then emit c: it is needed iff
A = r and c* = c. The paper rolls out all κ·(γ+1); a small device cannot in the time the target's suffix takes, so
we rank branches by the probability that each is the one needed, from what crosses the channel (the proxy head's
log-probs at every window position):

    P(A ≥ r)        = Π_{i<r} a_i,     a_i = p_proxy(d_{i+1} | position i)   the proxy's belief the draft is right
    P(A = r)        = P(A ≥ r) (1 − a_r)       (a_γ = 0: the bonus position always stops)
    P(c* = c | A=r) = p_proxy(c | r) / (1 − a_r)   for c ≠ d_{r+1} (c* is not the drafted token when it stops at r)
    score(r, c)     = P(A = r) · P(c* = c | A = r) = P(A ≥ r) · p_proxy(c | r)

and roll out the best B (ties: the earlier position first). B is the configured budget, or fewer, and the depth γ or
less, as `plan_rollout` weighs what the draft's measured cost lets finish within the target's suffix time.
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


def with_lookup(
    window: Sequence[int],
    cand_ids: Sequence[Sequence[int]],
    cand_logp: Sequence[Sequence[float]],
    window_logp: Sequence[float],
    proposals: Sequence[Sequence[tuple[int, float]]],
) -> tuple[list[list[int]], list[list[float]]]:
    """The proxy's candidates with prompt lookup's guesses for c* added at each window position r = 0..γ.

    proposals[r] = [(c, q), ...] (possibly empty): tokens the committed text says may follow the window's first r
    tokens, each with q = P(c* = c | A = r) (learnt online from verdicts). Each joins the candidates as the log-prob
    whose `rank_branches` score is P(A = r) · q: q · (1 − p_proxy(d_{r+1})) before the bonus position (where the score
    divides by the proxy's mass off the drafted token), q at it. A token the proxy already proposes keeps the larger
    of the two; the drafted token itself is the spine, not a branch. Why: where the head's top 8 missed the target's
    next token (41% of Spec-Bench answer positions with the trained head at ℓe = 15), the lookup's proposal was that
    token 46% of the time (docs/engine.md, thirty-first session)."""
    ids = [list(map(int, row)) for row in cand_ids]
    logp = [list(map(float, row)) for row in cand_logp]
    for r, guesses in enumerate(proposals):
        off = max(1 - math.exp(window_logp[r]), 1e-3) if r < len(window) else 1.0
        for c, q in guesses:
            if r < len(window) and c == window[r]:
                continue
            lp = math.log(max(q * off, 1e-12))
            if c in ids[r]:
                i = ids[r].index(c)
                logp[r][i] = max(logp[r][i], lp)
            else:
                ids[r].append(c)
                logp[r].append(lp)
    return ids, logp


def rollout_line(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) of the least-squares line ms = a + b·branches through `samples`; None with < 2 distinct counts."""
    if len({n for n, _ in samples}) < 2:
        return None
    n_mean = sum(n for n, _ in samples) / len(samples)
    t_mean = sum(t for _, t in samples) / len(samples)
    var = sum((n - n_mean) ** 2 for n, _ in samples)
    slope = max(sum((n - n_mean) * (t - t_mean) for n, t in samples) / var, 1e-6)
    return t_mean - slope * n_mean, slope


def expected_overrun(ms: float, deadline_ms: float, spread_ms: float) -> float:
    """E[max(0, ms − D)] for a deadline D ~ Normal(deadline_ms, spread_ms): what a rollout of `ms` keeps the target
    waiting on average when the target's suffix time varies step to step."""
    if spread_ms <= 0:
        return max(0.0, ms - deadline_ms)
    z = (ms - deadline_ms) / spread_ms
    cdf = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    pdf = math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return (ms - deadline_ms) * cdf + spread_ms * pdf


def plan_rollout(
    probs: Sequence[float],
    line: tuple[float, float],
    gamma: int,
    suffix_ms: float,
    pass_ms: float,
    finish_ms: float,
    spread: float,
    rider: float | None = None,
) -> tuple[int, int, float]:
    """(depth, branches, value) of the branch rollout that saves the target the most waiting in expectation.

    probs: the ranked branches' probabilities of being the one needed (best first); line: (a, b) of the whole-window
    rollout time a + b·branches (`rollout_line`); suffix_ms: the target's expected remaining suffix time; pass_ms:
    what a serial pass costs the waiting target, finish_ms: a serial rollout's cost beyond its passes; spread: the
    suffix time's relative standard deviation; rider: the probability of a branch rolled out whenever anything is
    (the look-ahead's completion), if there is one.
    A hit on a branch of depth δ spares δ serial passes after the verdict, and the whole serial rollout (its
    overhead too) at δ = γ; a rollout that outlasts the suffix keeps the target waiting for the rest of it. Of
    plans worth the same, the most branches at the greatest depth (work that costs nothing). Value < 0: nothing is
    worth rolling out; no branches at all: (γ, 0, 0.0).
    """
    best = (gamma, 0, 0.0 if rider is None and not probs else -math.inf)
    hit = rider or 0.0
    ride = rider is not None
    for n in range(0 if ride else 1, len(probs) + 1):
        hit += probs[n - 1] if n else 0.0
        whole = line[0] + line[1] * (n + ride)
        for depth in range(1, gamma + 1):
            saved = hit * (depth * pass_ms + (finish_ms if depth == gamma else 0.0))
            value = saved - expected_overrun(whole * depth / gamma, suffix_ms, spread * suffix_ms)
            if value >= best[2] - 1e-9:
                best = (depth, n, value)
    return best
