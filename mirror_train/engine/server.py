"""The draft side of the engine: a message handler around a draft backend, the same in a worker process, in a
torch.distributed peer or in-process.

Messages (tuples; only token ids, log-probs and a few numbers cross, and for a feature-conditioned draft the
target's ℓe states of the positions it just ran):
    ("start", prompt, γ, reference, states)   → ("window", tokens, info)    prefill, then roll out the first window
    ("branches", cand_ids, cand_logp, window_logp, deadline_ms, states)     rank and roll out branches; no reply
    ("hidden", ℓe states, deadline_ms)                                      the same, the proxy head running here
    ("verdict", A, c*, states)                → ("window", tokens, info)    commit; the next window: the rolled-out
                                                                              branch (A, c*) if there is one, else a
                                                                              serial rollout (the fallback)
    ("ping",)                                 → ("pong",)                   the channel's round trip
    ("stop",)                                                               exit the worker loop
`states` is None for a token-only draft. At "start" they are the prompt's but its last token's; with "branches"
(or "hidden") those of the window [the newest committed token, d_1..d_γ]; with a verdict, when no branches message
brought them this step, those of the newest committed token and the accepted d_1..d_A.

Bookkeeping: `tokens` are the committed tokens; the backend's cache holds the first `cached` of them (always all
but at least the last one, whose logits a rollout reads). A rollout's spine is tokens[cached:] + the window.
A feature-conditioned draft reads at each token the state of the token before it (EAGLE's pairing,
`paired_features`): `states` holds the state of every committed token but the last (the target has not run it
yet), so every committed token, the correction c* included, can be fed with its pair, and so can the window and
the branch roots once the target has run its prefix over the window. The cache keeps only nodes fed that way;
tokens the draft rolls out itself read no state and are dropped from its cache after the step.
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from mirror_train.engine.branches import AcceptanceModel, fit_budget, rank_branches, rollout_line


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
        self.conditioned = getattr(backend, "conditioned", False)
        self.states = _States()  # ℓe states of tokens[:-1] (feature-conditioned drafts only)
        self.window_states: torch.Tensor | None = None  # this step's: the newest committed token, then the window
        self.look_ahead = False  # Mirror-SD: draft on past the window while the target runs its prefix
        self.ahead: list[int] = []  # the draft's own continuation past the window (look-ahead), this step

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
            hidden = torch.as_tensor(msg[1])
            candidates = self.head.window_candidates(hidden.to(self.head.dtype), self.window, self.kappa)
            deadline = msg[2]
            if deadline is not None:  # the head's time here comes out of the rollout's share of the target's suffix
                deadline -= (time.perf_counter() - start) * 1000
            self._branches(*candidates, deadline, hidden)
            return None, None
        if kind == "verdict":
            return self._verdict(*msg[1:])
        if kind == "ping":
            return ("pong",), None
        raise ValueError(f"unknown message {kind!r}")

    # --- messages --------------------------------------------------------------------------------------------
    def _start(self, prompt, gamma, reference=None, states=None, look_ahead=False):
        self.gamma = int(gamma)
        self.look_ahead, self.ahead = bool(look_ahead), []
        self.tokens = list(prompt)
        self.states = _States()
        self.window_states = None
        if self.conditioned:
            self.states.append(_tensor(states, len(self.tokens) - 1, "the prompt"))
        self.backend.reset(self.tokens, reference, self._paired(0, len(self.tokens) - 1))
        self.cached = len(self.tokens) - 1
        self.rolled, self.rolled_spine = {}, 0
        self.window_p = self.cands = None  # a sequence that ended mid-step leaves no verdict to learn from
        if self.adaptive_budget and len({n for n, _ in self.samples}) < 2:
            self._calibrate()
        return self._fallback({"reused": False, "branches": 0, "branch_ms": 0.0})

    def _branches(self, cand_ids, cand_logp, window_logp, deadline_ms, states=None):
        if self.conditioned:
            self.window_states = _tensor(states, 1 + len(self.window), "the window")
        self.window_p = [math.exp(lp) for lp in window_logp]
        self.cands = cand_ids
        accept_prob = self.acceptance.predict(self.window_p)
        ranked = rank_branches(self.window, cand_ids, cand_logp, window_logp, accept_prob, self.branch_budget)
        # The look-ahead (drafted during the prefix) is the branch "whole window kept, c* = the draft's own next
        # token": it rides on the spine and is completed in the same tree; the others share the rest of the time.
        ahead = self.ahead if len(self.ahead) > 1 else []
        if ahead:
            ranked = [b for b in ranked if (b[0], b[1]) != (len(self.window), ahead[0])]
        depth, n = self._shape(ranked, deadline_ms) if self.adaptive_budget else (self.gamma, len(ranked))
        chosen = ranked[:n]
        pending = len(self.tokens) - self.cached
        spine = self.tokens[self.cached :] + self.window
        branches = [(pending - 1 + r, c) for r, c, _ in chosen]
        missing = self.gamma + 1 - len(ahead)  # the look-ahead's tokens still to draft for a whole next window
        if ahead and missing > 0:
            branches.append((len(spine) + len(ahead) - 1, None))
        features = None
        if self.conditioned:  # spine nodes, then each branch's token: paired with the state of the node before
            roots = [self.cached + anchor for anchor, c in branches if c is not None]
            paired = self._paired(self.cached, len(spine) + (1 if ahead else 0))  # ahead[0] reads d_γ's state
            blank = torch.zeros(max(len(ahead) - 1, 0), paired.shape[1])  # drafted tokens read none
            features = torch.cat([paired, blank, self._rows(roots)])
        start = time.perf_counter()
        drafted = self.backend.rollout(spine + ahead, branches, depth, features)[0] if branches else []
        self.branch_ms = (time.perf_counter() - start) * 1000
        if chosen:
            self.samples.append((len(branches), self.branch_ms * self.gamma / depth))  # in whole-window rollouts
        self.rolled = {(r, c): tokens for (r, c, _), tokens in zip(chosen, drafted, strict=False)}
        if ahead:
            rest = drafted[-1] if missing > 0 else []
            self.rolled[(len(self.window), ahead[0])] = (ahead[1:] + rest)[: self.gamma]
        self.rolled_spine = pending if branches else 0  # nothing fed: the verdict falls back (κ = 1 edge cases)
        self.num_branches = len(chosen)

    def _verdict(self, accepted, correction, states=None, prefix_ms=None):
        accepted, correction = int(accepted), int(correction)
        self.ahead = []
        if self.conditioned:  # the states of the newest committed token and of d_1..d_A become committed ones
            if states is not None:
                self.window_states = _tensor(states, 1 + accepted, "the verdict")
            if self.window_states is None or len(self.window_states) < 1 + accepted:
                raise ValueError("a feature-conditioned draft needs the window's target states with each step")
            self.states.append(self.window_states[: 1 + accepted])
            self.window_states = None
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
            if hit is not None and len(hit) < self.gamma:
                self._keep(keep)
                reply, _ = self._extend(hit, info)
                return reply, self._then_look_ahead(len(self.tokens) - self.cached - 1, prefix_ms)
            if hit is not None:
                self.window = hit
                reply = ("window", hit, info | {"reused": True, "fallback_ms": 0.0})
                return reply, self._then_look_ahead(keep, prefix_ms)
            self._keep(keep)
        reply, _ = self._fallback(info | {"reused": False})
        return reply, self._then_look_ahead(len(self.tokens) - self.cached - 1, prefix_ms)

    # --- helpers ---------------------------------------------------------------------------------------------
    def _keep(self, n: int) -> None:
        self.backend.keep(n)
        self.cached += n

    def _fallback(self, info: dict):
        """Roll out the next window serially from the committed context; reply first, prune the cache after."""
        committed = len(self.tokens) - self.cached
        start = time.perf_counter()
        self.window, forwards = self._serial([], self.gamma)
        info = info | {"fallback_ms": (time.perf_counter() - start) * 1000, "forwards": forwards}
        return ("window", self.window, info), lambda: self._keep(committed - 1)

    def _extend(self, partial: list[int], info: dict):
        """Reuse a branch rolled out short of γ and draft the rest serially: γ − depth passes, not a fallback's γ.
        Its drafted tokens have no target states yet: they read none (zeros), as in the rollout that made them."""
        committed = len(self.tokens) - self.cached
        start = time.perf_counter()
        rest, forwards = self._serial(partial, self.gamma - len(partial))
        self.window = partial + rest
        info = info | {"reused": True, "fallback_ms": (time.perf_counter() - start) * 1000, "forwards": forwards}
        return ("window", self.window, info), lambda: self._keep(committed - 1)

    def _serial(self, tail: list[int], n: int) -> tuple[list[int], int]:
        """Draft `n` tokens one branch deep after the committed tokens the cache lacks and the drafted `tail`
        (whose tokens have no target states yet: they read none, zeros). Returns the tokens and the forwards."""
        committed = self.tokens[self.cached :]
        spine = committed + tail
        features = None
        if self.conditioned:
            paired = self._paired(self.cached, len(committed))
            features = torch.cat([paired, paired.new_zeros(len(tail), paired.shape[1])])
        drafted, forwards = self.backend.rollout(spine, [(len(spine) - 1, None)], n, features)
        return drafted[0], forwards

    def _then_look_ahead(self, keep: int, prefix_ms: float | None):
        """The work after a window is sent: prune the cache to the committed path, then (Mirror-SD) look ahead."""

        def work():
            self._keep(keep)
            if self.look_ahead:
                self._look_ahead(prefix_ms)

        return work

    def _look_ahead(self, prefix_ms: float | None) -> None:
        """Draft on past the window while the target runs its prefix (the draft would idle until the branch request):
        whenever the target keeps the whole window and its bonus token is the draft's own next token, the next window
        is already here, and the suffix's time goes to the other branches. As many passes as fit the target's
        measured prefix (γ + 1 at most: the bonus token, then a whole window)."""
        line = rollout_line(self.samples)
        depth = self.gamma + 1
        if line is not None and prefix_ms is not None:
            per_pass = (line[0] + line[1]) / self.gamma
            depth = max(0, min(depth, int(prefix_ms // max(per_pass, 1e-6))))
        if depth < 2:
            return
        self.ahead, _ = self._serial(self.window, depth)
        self.backend.keep(len(self.tokens) - self.cached - 1)  # as before: committed tokens but the newest

    def _shape(self, ranked: list[tuple[int, int, float]], deadline_ms: float | None) -> tuple[int, int]:
        """(depth, branches) of this step's rollout: of the shapes that fit the target's suffix, the one that saves
        the most expected serial passes (depth × the probability that one of its branches is the one needed).
        A shallower tree fits more branches; a hit on a branch of depth δ < γ costs γ − δ passes after the verdict
        (`_extend`) instead of a fallback's γ. Depth γ when everything fits (or nothing has been measured yet)."""
        best = (-1.0, self.gamma, len(ranked))
        for depth in range(self.gamma, 0, -1):
            scaled = None if deadline_ms is None else deadline_ms * self.gamma / depth
            n = fit_budget(self.samples, scaled, len(ranked))
            value = depth * sum(p for _, _, p in ranked[:n])
            if value > best[0] + 1e-12:
                best = (value, depth, n)
        return best[1], best[2]

    def _calibrate(self) -> None:
        """Time rollouts of 1 and of the whole budget on the fresh context, so `fit_budget` has a line to fit."""
        last = self.tokens[-1]
        for n in (1, self.branch_budget, 1, self.branch_budget):
            start = time.perf_counter()
            self.backend.rollout([last], [(0, last)] * n, self.gamma)
            self.samples.append((n, (time.perf_counter() - start) * 1000))
            self.backend.keep(0)

    # --- feature conditioning --------------------------------------------------------------------------------
    def _rows(self, indices) -> torch.Tensor:
        """The states of tokens `indices` (committed ones, then this step's window after them); zeros for -1."""
        committed = len(self.states)
        rows = []
        for i in indices:
            if i < 0:
                rows.append(torch.zeros(self.states.width or self.window_states.shape[1]))
            elif i < committed:
                rows.append(self.states.row(i))
            else:
                rows.append(self.window_states[i - committed])
        return torch.stack(rows) if rows else torch.zeros(0, self.states.width or 0)

    def _paired(self, first: int, n: int) -> torch.Tensor | None:
        """What tokens first..first+n-1 read: the states of the tokens before them (None: a token-only draft)."""
        if not self.conditioned:
            return None
        return self._rows(range(first - 1, first + n - 1))


class _States:
    """A growing (n, H) float32 table of committed tokens' target states, appended to every step."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.n = 0

    @property
    def width(self) -> int | None:
        return None if self.data is None else self.data.shape[1]

    def __len__(self) -> int:
        return self.n

    def append(self, rows: torch.Tensor) -> None:
        if self.data is None:
            self.data = torch.zeros(max(2 * len(rows), 64), rows.shape[1])
        if self.n + len(rows) > len(self.data):  # double: appends stay amortised O(rows)
            grown = torch.zeros(2 * (self.n + len(rows)), self.data.shape[1])
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : self.n + len(rows)] = rows
        self.n += len(rows)

    def row(self, i: int) -> torch.Tensor:
        return self.data[i]


def _tensor(states, rows: int, what: str) -> torch.Tensor:
    """`states` as a float32 (rows, H) tensor, or a clear error (a feature-conditioned draft cannot do without)."""
    if states is None:
        raise ValueError(f"a feature-conditioned draft needs the target's states of {what}; none came")
    states = torch.as_tensor(states, dtype=torch.float32)
    if states.dim() != 2 or states.shape[0] < rows:
        raise ValueError(f"the target's states of {what}: expected ({rows}, H), got {tuple(states.shape)}")
    return states[:rows] if states.shape[0] > rows else states
