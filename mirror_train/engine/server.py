"""The draft side of the engine: a message handler around a draft backend, the same in a worker process, in a
torch.distributed peer or in-process.

Messages (tuples; only token ids, log-probs and a few numbers cross):
    ("start", prompt, γ, reference)     → ("window", tokens, info)    prefill, then roll out the first window
    ("branches", cand_ids, cand_logp, window_logp, deadline_ms)       rank and roll out branches; no reply
    ("hidden", ℓe states, deadline_ms)                                the same, the proxy head running here
    ("verdict", A, c*)                  → ("window", tokens, info)    commit; the next window: the rolled-out
                                                                        branch (A, c*) if there is one, else a
                                                                        serial rollout (the fallback)
    ("ping",)                           → ("pong",)                   the channel's round trip
    ("stop",)                                                         exit the worker loop

Bookkeeping: `tokens` are the committed tokens; the backend's cache holds the first `cached` of them (always all
but at least the last one, whose logits a rollout reads). A rollout's spine is tokens[cached:] + the window.
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from mirror_train.engine.branches import AcceptanceModel, fit_budget, rank_branches


class DraftServer:
    """backend: a draft backend (drafts.py); head: a proxy head bound to a `HeadEnd`, when the proxy head runs on
    the draft's side (then "hidden" messages bring the target's ℓe states instead of candidates); kappa: its κ."""

    def __init__(self, backend, branch_budget: int = 8, adaptive_budget: bool = True, head=None, kappa: int = 4):
        self.backend = backend
        self.head = head
        self.kappa = kappa
        self.acceptance = AcceptanceModel()  # learns from every verdict; persists across sequences
        self.window_p: list[float] | None = None  # the proxy's probability of each drafted token, this step
        self.cands: list[list[int]] | None = None
        self.branch_budget = branch_budget
        self.adaptive_budget = adaptive_budget
        self.samples: deque[tuple[int, float]] = deque(maxlen=64)  # (branches, ms) of recent branch rollouts
        self.gamma = 0
        self.tokens: list[int] = []
        self.cached = 0
        self.window: list[int] = []
        self.rolled: dict[tuple[int, int], list[int]] = {}
        self.rolled_spine = 0  # pending committed tokens at the head of the last branch rollout's spine (0: none)
        self.branch_ms = 0.0
        self.num_branches = 0

    def handle(self, msg: tuple):
        """Handle one message: returns (reply or None, work to do after the reply is sent or None)."""
        kind = msg[0]
        if kind == "start":
            return self._start(*msg[1:])
        if kind == "branches":
            self._branches(*msg[1:])
            return None, None
        if kind == "hidden":
            start = time.perf_counter()
            hidden = torch.as_tensor(msg[1]).to(self.head.dtype)
            candidates = self.head.window_candidates(hidden, self.window, self.kappa)
            deadline = msg[2]
            if deadline is not None:  # the head's time here comes out of the rollout's share of the target's suffix
                deadline -= (time.perf_counter() - start) * 1000
            self._branches(*candidates, deadline)
            return None, None
        if kind == "verdict":
            return self._verdict(*msg[1:])
        if kind == "ping":
            return ("pong",), None
        raise ValueError(f"unknown message {kind!r}")

    # --- messages --------------------------------------------------------------------------------------------
    def _start(self, prompt, gamma, reference=None):
        self.gamma = int(gamma)
        self.tokens = list(prompt)
        self.backend.reset(self.tokens, reference)
        self.cached = len(self.tokens) - 1
        self.rolled, self.rolled_spine = {}, 0
        self.window_p = self.cands = None  # a sequence that ended mid-step leaves no verdict to learn from
        if self.adaptive_budget and len({n for n, _ in self.samples}) < 2:
            self._calibrate()
        return self._fallback({"reused": False, "branches": 0, "branch_ms": 0.0})

    def _branches(self, cand_ids, cand_logp, window_logp, deadline_ms):
        budget = fit_budget(self.samples, deadline_ms, self.branch_budget) if self.adaptive_budget else None
        self.window_p = [math.exp(lp) for lp in window_logp]
        self.cands = cand_ids
        accept_prob = self.acceptance.predict(self.window_p)
        chosen = rank_branches(self.window, cand_ids, cand_logp, window_logp, accept_prob, budget or self.branch_budget)
        pending = len(self.tokens) - self.cached
        spine = self.tokens[self.cached :] + self.window
        start = time.perf_counter()
        drafted, _ = self.backend.rollout(spine, [(pending - 1 + r, c) for r, c, _ in chosen], self.gamma)
        self.branch_ms = (time.perf_counter() - start) * 1000
        self.samples.append((len(chosen), self.branch_ms))
        self.rolled = {(r, c): tokens for (r, c, _), tokens in zip(chosen, drafted, strict=True)}
        self.rolled_spine = pending
        self.num_branches = len(chosen)

    def _verdict(self, accepted, correction):
        accepted, correction = int(accepted), int(correction)
        self.tokens += self.window[:accepted] + [correction]
        info = {"branches": self.num_branches, "branch_ms": self.branch_ms if self.rolled_spine else 0.0}
        if self.window_p is not None:  # learn the acceptance rate; report the candidates where the window stopped
            self.acceptance.update(self.window_p, accepted)
            info["candidates"] = self.cands[accepted]
            self.window_p = self.cands = None
        hit = self.rolled.get((accepted, correction))
        if self.rolled_spine:
            keep = self.rolled_spine + accepted  # the pending tokens and the accepted window, not c*
            self.rolled, self.rolled_spine, self.num_branches = {}, 0, 0
            if hit is not None:
                self.window = hit
                return ("window", hit, info | {"reused": True, "fallback_ms": 0.0}), lambda: self._keep(keep)
            self._keep(keep)
        return self._fallback(info | {"reused": False})

    # --- helpers ---------------------------------------------------------------------------------------------
    def _keep(self, n: int) -> None:
        self.backend.keep(n)
        self.cached += n

    def _fallback(self, info: dict):
        """Roll out the next window serially from the committed context; reply first, prune the cache after."""
        spine = self.tokens[self.cached :]
        start = time.perf_counter()
        drafted, forwards = self.backend.rollout(spine, [(len(spine) - 1, None)], self.gamma)
        self.window = drafted[0]
        info = info | {"fallback_ms": (time.perf_counter() - start) * 1000, "forwards": forwards}
        return ("window", self.window, info), lambda: self._keep(len(spine) - 1)

    def _calibrate(self) -> None:
        """Time rollouts of 1 and of the whole budget on the fresh context, so `fit_budget` has a line to fit."""
        last = self.tokens[-1]
        for n in (1, self.branch_budget, 1, self.branch_budget):
            start = time.perf_counter()
            self.backend.rollout([last], [(0, last)] * n, self.gamma)
            self.samples.append((n, (time.perf_counter() - start) * 1000))
            self.backend.keep(0)
