"""The draft side of the engine: a message handler around a draft backend, the same in a worker process, in a
torch.distributed peer or in-process. The messages are in messages.py.

Bookkeeping: `tokens` are the committed tokens; the backend's cache holds the first `cached` of them (always all
but at least the last one, whose logits a rollout reads), each fed with what a committed token reads. A rollout's
spine is tokens[cached:] + the window.

What each fed node reads (a feature-conditioned draft, models/drafter.py; EAGLE's pairing: the states of the token
before it), exactly as training showed it (drafter_training.py):
    a committed token        the target's slots (exit; + final for the freshest features) of its predecessor
    a window token d_i       own: the draft state that predicted it; exit: d_{i-1}'s ℓe state once the target has
                             run its prefix over the window (Branches), else nothing
    a branch root c at r     exit: the ℓe state of the window token it follows; own: the state that predicted
                             d_{r+1} (c stands where d_{r+1} stood)
    a token rolled out       own: the state that predicted it
A window node therefore reads something else than the committed token it may become; where the difference matters
(own or final slots) the kept cache holds only the committed tokens fed as committed ones, and the window's accepted
tokens are fed again as committed ones in the next rollout's spine (a few more nodes in a forward the draft runs
anyway). A draft with the exit slot alone reads the same either way and keeps them.

Which window, and how long (window.py): every window the server hands out is chosen from the model's drafted tokens
and a copy of the committed text (prompt lookup, ngram.py), whichever promises more committed tokens per unit of
the target's verification time, and cut to the length that maximises it (`adaptive_window`), with acceptance
calibrated online from every verdict. With no model (`backend=None`) the server is the engine's `pld` method.
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from mirror_train.datastore import Datastore
from mirror_train.engine.acceptance import NoiseRows
from mirror_train.engine.branches import plan_rollout, rank_branches, rollout_line, with_lookup
from mirror_train.engine.messages import Branches, Load, Ping, Pong, Start, Verdict, Window
from mirror_train.engine.ngram import NgramIndex
from mirror_train.engine.node_states import StateTable, as_states, complete, join
from mirror_train.engine.rollout import Rollout
from mirror_train.engine.window import (
    Calibration,
    best_fork,
    best_length,
    expected_committed,
    prob_key,
    rollout_plan,
    serial_overhead,
)
from mirror_train.models.drafter_config import TARGET_SLOTS

# A window source cut to nothing this many times in a row is verified for one token anyway (`_offer`), and a skipped
# serial rollout is tried anyway (one pass) after this many skips with no model window verified in between
# (`_serial_plan`): a calibration that says "never kept" would otherwise never see another verdict (measured: after
# a first prompt where no copy was kept, prompt lookup proposed nothing for the rest of a 30-question Spec-Bench run)
EXPLORE = 8
# Each serial exploration that still leaves the model not worth its time doubles the skips before the next, up to
# this many: on a 2-core CPU a serial rollout beside a just-run target costs the target ~a whole step of waiting
# (25–33 ms in the engine, 10–13 ms timed alone), and exploring every 8th skip cost sd ~9% of its time while
# confirming the same verdict (docs/engine.md, fifteenth session)
EXPLORE_MAX = 64
# Committed tokens the draft's cache may lack before they are fed after a reply, off the target's critical path
# (`_catch_up`): a serial rollout feeds what the cache lacks first, and after a run of skipped steps that was up to
# ~80 tokens, 35–55 ms of the target's wait for a one-pass exploration (docs/engine.md, fifteenth session)
CATCH_UP = 8
# A datastore token's calibration key bins its share (how often the target said it after that n-gram, datastore.py)
STORE_SHARE_BINS = 4
STORE_CONTEXT = 8  # the committed tokens a datastore proposal reads (its n-grams are at most 4 long)
# The target's suffix time varies step to step by about this share of it (as does the rollout's time; docs/engine.md):
# the branch rollout is planned against that spread (`branches.plan_rollout`). A hard cut at 85% of the mean
# suffix, the rule before it, left depth on the table: in paired runs at synthetic acceptance 0.8 it left 64–69 of
# ~150 reused branches (~225 steps) short of γ, drafted on after the verdict while the target waited, against 37–51
# under this plan, at the same queueing of the verdict (0.2–0.3 ms a step; twenty-ninth session)
SUFFIX_SPREAD = 0.1
# Prompt lookup's guesses for c* at each window position, Mirror-SD's branch roots beside the proxy head's (the latest
# distinct successors of the longest match, then of shorter ones): on held-out Spec-Bench answers the recipe head's
# top 8 with one guess held the target's next token 0.822 of the time, with two 0.838, three 0.845 (forty-ninth
# session, `scripts/bench_branch_roots.py`)
ROOT_GUESSES = 3


class DraftServer:
    """backend: a draft backend (drafts.py), or None for prompt lookup alone; head: a proxy head bound to a
    `HeadEnd`, when the proxy head runs on the draft's side (then Branches bring the target's ℓe states instead of
    candidates); kappa: its κ; ngram_tokens: the longest copied window (0: no prompt lookup); adaptive_window: cut
    each window to its best length (module docstring; else the model's whole γ); device: where the draft and the
    head compute; lookup_roots: Mirror-SD's branch roots include prompt lookup's guesses for c* (ROOT_GUESSES) beside
    the proxy head's (`branches.with_lookup`)."""

    def __init__(
        self,
        backend,
        branch_budget: int = 8,
        adaptive_budget: bool = True,
        head=None,
        kappa: int = 4,
        ngram_tokens: int = 0,
        adaptive_window: bool = False,
        device: str | torch.device = "cpu",
        datastore: Datastore | None = None,
        lookup_roots: bool = False,
    ):
        self.backend = backend
        self.datastore = datastore  # the target's own answers as a second copy source (datastore.py)
        self.device = torch.device(device)  # the draft's and a head's here, and the target's states it keeps
        # the copies' index; where it guesses c* for branch roots too, it keeps each n-gram's latest successors
        successors = ROOT_GUESSES if lookup_roots else 1
        self.ngram = NgramIndex(successors=successors) if ngram_tokens else None
        # the committed text that guesses c* for branch roots (the copies' index where there is one), the odds of
        # its guesses by (match size, at the bonus position, rank) learnt from verdicts, and this step's by position
        self.roots = (self.ngram or NgramIndex(successors=successors)) if lookup_roots else None
        self.roots_rate = Calibration(initial=0.3)
        self.root_guesses: dict[int, list[tuple[int, tuple]]] = {}
        self.ngram_tokens = ngram_tokens
        self.adaptive_window = adaptive_window
        self.calibration = Calibration()  # P(kept) of a window token, by source and key (window.py)
        self.costs: list[float] = []  # the target's relative verification cost by window length (from the engine)
        self.step_ms: float | None = None  # the target's one-token step (from the engine)
        self.skipped = 0  # serial rollouts skipped since the last model window verified (`_serial_plan`)
        self.explore_every = EXPLORE  # the skips before a serial rollout is explored anyway (EXPLORE_MAX)
        self.prefill_ms = 0.0  # the last prompt's prefill, ms a token (reported with each window)
        self.unexplored = 0  # windows cut to nothing in a row while a source had tokens (`_offer`)
        self.window_keys: list = []  # the calibration keys of the window being verified
        self.forks = False  # the target verifies forked windows: the other source's chain beside the window
        self.alt: list[int] = []  # that chain, this step (forked_window.py), its keys, and the tokens it shares
        self.alt_keys: list = []
        self.fork = 0
        self.alt_source: str | None = None
        self.head = head
        self.kappa = kappa
        # P(the target keeps a drafted token | the proxy's probability of it): learnt from every verdict, kept across
        # sequences (the proxy's raw probability is over- or under-confident, and γ-fold products compound it)
        self.acceptance = Calibration()
        self.window_p: list[float] | None = None  # the proxy's probability of each drafted token, this step
        self.cands: list[list[int]] | None = None
        self.branch_budget = branch_budget
        self.adaptive_budget = adaptive_budget
        self.samples: deque[tuple[int, float]] = deque(maxlen=64)  # (branches, ms) of recent branch rollouts
        # (passes, ms) of recent serial rollouts (fallbacks, extensions): they also feed the committed tokens, so a
        # branch rollout's pass time alone underprices them (measured: 12 ms a one-pass fallback where the tree's
        # line said ~7; `_serial_plan`)
        self.serial_samples: deque[tuple[int, float]] = deque(maxlen=32)
        self.gamma = 0
        self.tokens: list[int] = []
        self.cached = 0
        self.window: list[int] = []
        self.window_pairs: torch.Tensor | None = None  # (γ, H_draft): the state that predicted each window token
        self.rolled: dict[tuple[int, int], tuple[list[int], torch.Tensor | None]] = {}  # branch → tokens, pairs
        self.rolled_spine = 0  # pending committed tokens at the head of the last branch rollout's spine (0: none)
        self.branch_ms = 0.0
        self.num_branches = 0
        self.widths: dict[str, int] = dict(getattr(backend, "widths", {}))  # slot → width the draft reads
        self.target_slots = [s for s in self.widths if s in TARGET_SLOTS]
        self.own = "own" in self.widths
        self.refeed = self.own or "final" in self.widths  # module docstring
        self.states = {slot: StateTable(self.device) for slot in self.target_slots}  # of tokens[:-1]
        self.window_states: torch.Tensor | None = None  # this step's ℓe states: the newest committed token, window
        self.look_ahead = False  # Mirror-SD: draft on past the window while the target runs its prefix
        # How much the draft's work slows the target's step while they overlap (measured by the engine, Start), and
        # what a step the draft has no window ready for costs the target (EMA of the fallbacks' reply times): the
        # concurrent work's price and its saving (`_pays`)
        self.contention = 0.0
        self.miss_ms: float | None = None
        self.ahead: Rollout | None = None  # the draft's own continuation past the window (look-ahead), this step
        # The target's sampling (Start): at T > 0 the draft's tokens are coupled to the target's noise of their
        # output positions (`_noise`); None at T = 0
        self.noise: NoiseRows | None = None
        self.prompt_len = 0

    @property
    def conditioned(self) -> bool:
        return bool(self.target_slots)

    def handle(self, msg):
        """Handle one message: returns (reply or None, work to do after the reply is sent or None)."""
        if isinstance(msg, Start):
            return self._start(msg)
        if isinstance(msg, Branches):
            self._branches(msg)
            return None, None
        if isinstance(msg, Verdict):
            return self._verdict(msg)
        if isinstance(msg, Ping):
            return Pong(), None
        if isinstance(msg, Load):
            self._load(msg.ms, int(msg.gamma))
            return Pong(), None
        raise ValueError(f"unknown message {type(msg).__name__}")

    # --- messages --------------------------------------------------------------------------------------------
    def _start(self, msg: Start):
        self.gamma = int(msg.gamma)
        self.costs = list(msg.costs or self.costs)
        self.step_ms = msg.step_ms or self.step_ms
        for index in self._indexes():
            index.reset(msg.prompt)
        self.look_ahead, self.ahead = bool(msg.look_ahead), None
        self.contention = float(msg.contention or 0.0)
        self.forks, self.alt, self.alt_keys, self.fork = bool(msg.forks), [], [], 0
        self.tokens = list(msg.prompt)
        sampled = msg.temperature > 0 and msg.vocab_size > 0
        self.noise = NoiseRows(int(msg.vocab_size), float(msg.temperature), int(msg.seed)) if sampled else None
        self.prompt_len = len(self.tokens)
        self.states = {slot: StateTable(self.device) for slot in self.target_slots}
        self.window_states = None
        self._append_states(msg.states, len(self.tokens) - 1, "the prompt")
        if self.backend is not None:
            start = time.perf_counter()
            self.backend.reset(self.tokens, msg.reference, self._committed(0, len(self.tokens) - 1))
            # its speed, for the engine not to ask before a prompt's prefill is done (engine._next_window)
            self.prefill_ms = (time.perf_counter() - start) * 1e3 / max(1, len(self.tokens))
        self.cached = len(self.tokens) - 1
        self.rolled, self.rolled_spine = {}, 0
        self.window_p = self.cands = None  # a sequence that ended mid-step leaves no verdict to learn from
        self.window_keys, self.root_guesses = [], {}
        if self.backend is not None and self.adaptive_budget and len({n for n, _ in self.samples}) < 2:
            self._calibrate()
        if not msg.reply:  # the engine serves the first window itself: no rollout, the next verdict is foreign
            self.window, self.window_pairs = [], None
            return None, None
        return self._fallback({"reused": False, "branches": 0, "branch_ms": 0.0})

    def _branches(self, msg: Branches):
        start = time.perf_counter()
        # the rollout should be done when the verdict comes: what is left of the target's (noisy) suffix time
        deadline = msg.deadline_ms
        late = _queued_ms(msg.sent_s)
        if deadline is not None and late is not None:  # the target's suffix started when it sent the request
            deadline = max(0.0, deadline - late)
        exit_states = None
        if "exit" in self.target_slots or msg.candidates is None:  # the draft or the head here reads them
            exit_states = as_states((msg.states or {}).get("exit"), 1 + len(self.window), "the window", self.device)
        candidates = msg.candidates
        if candidates is None:  # the proxy head runs here, on the window's ℓe states
            noise = self._noise()  # T > 0: ranked under the noise the target samples these positions with
            if noise is not None:  # row r names the token at sequence index len(tokens) + r
                noise = noise(range(len(self.tokens), len(self.tokens) + 1 + len(self.window)))
            ids, logp, window_logp = self.head.window_candidates(
                exit_states.to(self.device, self.head.dtype), self.window, self.kappa, noise=noise
            )
            if deadline is not None:  # the head's time here comes out of the rollout's share of the target's suffix
                deadline -= (time.perf_counter() - start) * 1000
        else:
            ids, logp, window_logp = candidates.ids, candidates.logp, candidates.window_logp
        self.window_states = exit_states if "exit" in self.target_slots else None
        perfect = getattr(self.backend, "perfect_candidates", None)  # the synthetic draft's perfect head, a ceiling
        if perfect is not None:
            ids, logp = perfect(self.tokens, self.window, ids, logp)
        self.window_p = [math.exp(lp) for lp in window_logp]
        self.cands = ids  # the head's own (its online hit_κ)
        if self.roots is not None:
            ids, logp = with_lookup(self.window, ids, logp, window_logp, self._lookup_guesses())
        accept_prob = self.acceptance.predict([prob_key(p) for p in self.window_p])
        ranked = rank_branches(self.window, ids, logp, window_logp, accept_prob, self.branch_budget)
        # The look-ahead (drafted during the prefix) is the branch "whole window kept, c* = the draft's own next
        # token": it rides on the spine and is completed in the same tree; the others share the rest of the time.
        ahead = self.ahead.tokens if self.ahead is not None and len(self.ahead.tokens) > 1 else []
        if ahead:
            ranked = [b for b in ranked if (b[0], b[1]) != (len(self.window), ahead[0])]
        missing = self.gamma + 1 - len(ahead)  # the look-ahead's tokens still to draft for a whole next window
        # the look-ahead is reused only through a rollout that feeds the spine (else the verdict falls back): its
        # odds ride on the plan whether or not tokens are missing
        rider = self._ahead_hit() if ahead else None
        depth, n, worth = (
            self._shape(ranked, deadline, rider) if self.adaptive_budget else (self.gamma, len(ranked), True)
        )
        if not worth:  # no branch pays; a look-ahead still gets the one pass that feeds the spine it hangs off
            depth, n = 1, 0
        chosen = ranked[:n]
        pending = len(self.tokens) - self.cached
        spine = self.tokens[self.cached :] + self.window
        branches = [(pending - 1 + r, c) for r, c, _ in chosen]
        if ahead and (missing > 0 or not chosen):  # its completion, or one pass that feeds the spine it hangs off
            branches.append((len(spine) + len(ahead) - 1, None))
            depth = depth if missing > 0 else 1
        line = rollout_line(self.samples)
        if branches and line is not None:  # the rollout's saving against what it slows the target's suffix by
            hit = sum(p for _, _, p in chosen) + (rider or 0.0)
            ms = (line[0] + line[1] * len(branches)) * depth / self.gamma
            if not self._pays(hit * depth / self.gamma, ms if deadline is None else min(ms, deadline)):
                chosen, branches = [], []
        features = None
        if self.conditioned:  # spine nodes (committed, window, look-ahead), then each branch's token
            blocks = [self._committed(self.cached, pending), self._window_nodes(exit_known=True)]
            if ahead:
                blocks.append(self._ahead_nodes())
            blocks += [self._root(r) for r, _, _ in chosen]
            features = join(blocks)
        start = time.perf_counter()
        rollouts = self.backend.rollout(spine + ahead, branches, depth, features, self._noise()) if branches else []
        self.branch_ms = (time.perf_counter() - start) * 1000
        if chosen:
            self.samples.append((len(branches), self.branch_ms * self.gamma / depth))  # in whole-window rollouts
        self.rolled = {(r, c): rollouts[i] for i, (r, c, _) in enumerate(chosen)}
        if ahead:
            rest = rollouts[-1] if missing > 0 and branches else None  # none rolled out where it did not pay
            self.rolled[(len(self.window), ahead[0])] = _joined(self.ahead, 1, rest, self.gamma)
        self.rolled_spine = pending if branches else 0  # nothing fed: the verdict falls back (κ = 1 edge cases)
        self.num_branches = len(chosen)

    def _verdict(self, msg: Verdict):
        queued = _queued_ms(msg.sent_s)
        accepted, correction = int(msg.accepted), int(msg.correction)
        # a forked window's second chain kept more: its tokens are committed (the engine sent their states); the
        # main chain then kept exactly the shared stem, and no branch (they hang off the main chain) is the next one
        alt_won = msg.alt_accepted is not None and msg.alt_accepted > accepted
        taken = int(msg.alt_accepted) if alt_won else accepted
        # another source's window was verified (or none: the prompt's first token): its tokens are committed, and
        # this server's offer, which the target never saw, teaches nothing
        foreign = msg.committed is not None
        if foreign:
            alt_won, taken = False, len(msg.committed) - 1
            self.window_keys, self.alt_keys, self.window_p = [], [], None
        self.ahead = None
        if self.conditioned:  # the states of the newest committed token and of d_1..d_A become committed ones
            states = dict(msg.states or {})
            if "exit" in self.target_slots and "exit" not in states:
                if self.window_states is None:
                    raise ValueError("a draft that reads ℓe states needs the window's with each step; none came")
                states["exit"] = self.window_states
            self._append_states(states, 1 + taken, "the verdict")
            self.window_states = None
        committed = list(msg.committed) if foreign else (self.alt if alt_won else self.window)[:taken] + [correction]
        self.tokens += committed
        if self.noise is not None:  # the next token's output position: no draft token is before it
            self.noise.forget_before(len(self.tokens) - self.prompt_len)
        for index in self._indexes():
            index.extend(committed)
        if msg.costs:
            self.costs, self.step_ms = list(msg.costs), msg.step_ms
        if any(k[0] == "model" for k in self.window_keys[:1]):  # the model's acceptance measured afresh
            self.skipped = 0
        self.calibration.update(self.window_keys, accepted)
        if msg.alt_accepted is not None:  # each source learns from its own chain
            self.calibration.update(self.alt_keys, int(msg.alt_accepted))
        self.alt, self.alt_keys, self.fork = [], [], 0
        info = {"branches": self.num_branches, "branch_ms": self.branch_ms if self.rolled_spine else 0.0}
        info["queued_ms"] = queued or 0.0
        if self.window_p is not None:  # learn the acceptance rate; report the candidates where the window stopped
            self.acceptance.update([prob_key(p) for p in self.window_p], accepted)
            if not alt_won:
                info["candidates"] = self.cands[accepted]
            self.window_p = self.cands = None
        if not (alt_won or foreign):  # the lookup's guesses where the window stopped, judged
            for token, key in self.root_guesses.get(accepted, ()):
                self.roots_rate.update([key], int(token == correction))
        self.root_guesses = {}
        hit = None if alt_won or foreign or not msg.reply else self.rolled.get((accepted, correction))
        keep = self._end_branches(accepted)
        # the steps told with this one (merge_verdicts) were served by the engine's own copies: skipped rollouts,
        # whether or not this one asks (an ask that did not count them answered an exploration that was due with a
        # skip, and the engine asked again a step or two later, several times before each exploration)
        self.skipped += msg.steps - 1
        if not msg.reply:  # the engine serves the next window itself: book-keep, and catch up while it verifies
            self.skipped += 1  # a step the model was not worth asking for counts as a skipped rollout
            if keep is not None:
                self._keep(keep)
            self.window, self.window_pairs, self.window_keys = [], None, []
            return None, self._catch_up
        if keep is not None:
            upto = 0
            if hit is not None and len(hit.tokens) < self.gamma:
                upto = self._serial_plan(len(hit.tokens))
            if hit is not None and upto > len(hit.tokens):  # a branch rolled out short of γ, worth drafting on
                self._keep(keep)
                reply, _ = self._extend(hit, upto, info)
                return reply, self._then_look_ahead(len(self.tokens) - self.cached - 1, msg.prefix_ms)
            if hit is not None:
                reply = self._offer(hit, info | {"reused": True, "fallback_ms": 0.0})
                return reply, self._then_look_ahead(keep, msg.prefix_ms)
            self._keep(keep)
        reply, _ = self._fallback(info | {"reused": False})
        return reply, self._then_look_ahead(len(self.tokens) - self.cached - 1, msg.prefix_ms)

    # --- helpers ---------------------------------------------------------------------------------------------
    def _indexes(self) -> list[NgramIndex]:
        """The n-gram indexes of the committed text kept here: the copies' and the branch roots' (one if shared)."""
        return list({id(i): i for i in (self.ngram, self.roots) if i is not None}.values())

    def _lookup_guesses(self) -> list[list[tuple[int, float]]]:
        """Per window position r = 0..γ, prompt lookup's guesses for c* after the window's first r tokens
        (`NgramIndex.guesses`, up to ROOT_GUESSES, the drafted token left out: it is no branch) and the odds of each,
        P(c* = guess | A = r), learnt by (match size, at the bonus position, rank); kept for the verdict to judge."""
        out: list[list[tuple[int, float]]] = []
        self.root_guesses = {}  # this step's alone, whatever came before
        for r in range(len(self.window) + 1):
            drafted = self.window[r] if r < len(self.window) else None
            guesses = [g for g in self.roots.guesses(ROOT_GUESSES + 1, after=self.window[:r]) if g[0] != drafted]
            bonus = r == len(self.window)
            keyed = [(c, (min(n, 3), bonus, rank)) for rank, (c, n) in enumerate(guesses[:ROOT_GUESSES])]
            if keyed:
                self.root_guesses[r] = keyed
            odds = self.roots_rate.predict([key for _, key in keyed]) if keyed else []
            out.append([(c, q) for (c, _), q in zip(keyed, odds, strict=True)])
        return out

    def _noise(self):
        """At T > 0, the target's noise by sequence index (what `rollout.coupled_choice` reads): the row of output
        position index − prompt length, `acceptance.sample_noise`'s, the one the target adds there; None at T = 0
        (greedy drafting). Why: a draft token drawn with the target's own noise is the target's sample wherever the
        two distributions nearly agree, where a greedy token matches it only as often as the target samples its
        argmax (docs/engine.md, forty-sixth session)."""
        if self.noise is None:
            return None
        noise, prompt_len = self.noise, self.prompt_len
        return lambda indices: noise.rows([i - prompt_len for i in indices])

    def _end_branches(self, accepted: int) -> int | None:
        """Forget this step's branch rollout; the nodes of it to commit (None: none was rolled out): the pending
        tokens at its spine's head, and the accepted window unless it must be fed again as committed tokens."""
        if not self.rolled_spine:
            return None
        keep = self.rolled_spine + (0 if self.refeed else accepted)
        self.rolled, self.rolled_spine, self.num_branches = {}, 0, 0
        return keep

    def _keep(self, n: int) -> None:
        """Commit the first n nodes the last rollout fed (fewer when it fed fewer: a skipped rollout fed none)."""
        if self.backend is not None:
            n = min(n, self.backend.fed())
            self.backend.keep(n)
        self.cached += n

    def _fallback(self, info: dict):
        """Roll out the next window serially from the committed context (unless that is not worth its time: then a
        copied window or a plain step); reply first, prune the cache after."""
        committed = len(self.tokens) - self.cached
        start = time.perf_counter()
        nothing = Rollout([], [], 0, [], None)
        n = self._serial_plan(0)
        drafted = self._serial(nothing, n) if n else nothing
        ms = (time.perf_counter() - start) * 1000
        if drafted.num_forwards:
            self.serial_samples.append((drafted.num_forwards, ms))
        self.miss_ms = ms if self.miss_ms is None else 0.9 * self.miss_ms + 0.1 * ms
        info = info | {"fallback_ms": ms, "forwards": drafted.num_forwards}
        return self._offer(drafted, info), lambda: self._keep(committed - 1)

    def _extend(self, partial: Rollout, upto: int, info: dict):
        """Reuse a branch rolled out short of γ and draft on serially to `upto` tokens: fewer passes than a
        fallback's."""
        committed = len(self.tokens) - self.cached
        start = time.perf_counter()
        rest = self._serial(partial, upto - len(partial.tokens))
        whole = _joined(partial, 0, rest, upto)
        ms = (time.perf_counter() - start) * 1000
        if rest.num_forwards:
            self.serial_samples.append((rest.num_forwards, ms))
        info = info | {"reused": True, "fallback_ms": ms, "forwards": rest.num_forwards}
        return self._offer(whole, info), lambda: self._keep(committed - 1)

    def _serial_plan(self, drafted: int) -> int:
        """How many tokens to have drafted before the target waits no longer (0: roll out nothing), `drafted` of them
        already there: `window.rollout_plan` at the model's mean acceptance so far, against what costs nothing (a
        copied window, or a plain step). After `explore_every` skips with no model window verified (a Mirror-SD
        branch reused measures the model too) one pass is rolled out anyway, so that the model's acceptance keeps
        being measured; while the explorations confirm the skip, they grow rarer (EXPLORE_MAX)."""
        n, rate = self._model_plan(drafted)
        if self.backend is None or math.isinf(rate):  # no model, or nothing measured to plan by yet
            return n
        if not drafted and self.skipped >= self.explore_every:
            self.skipped = 0
            self.explore_every = min(EXPLORE_MAX, 2 * self.explore_every)
            return min(self.gamma, 1 + getattr(self.backend, "num_streams", 0))
        if rate > self._alternative_rate():
            self.skipped, self.explore_every = 0, EXPLORE
            return n
        self.skipped += 1
        return 0

    def _model_plan(self, drafted: int) -> tuple[int, float]:
        """`window.rollout_plan` for the model at its mean acceptance so far: (tokens to draft, the rate promised),
        `drafted` of them already there; (γ, inf) while nothing is measured to plan by (no rollout timed yet)."""
        line = rollout_line(self.samples)
        if self.backend is None:
            return 0, 0.0
        if not self.adaptive_window or line is None or not self.step_ms or not self.costs:
            return self.gamma, math.inf
        streams = getattr(self.backend, "num_streams", 0)
        passes = -(-self.gamma // (1 + streams))
        pass_ms = (line[0] + line[1]) / passes  # one branch's pass
        # what a serial rollout measured beyond its passes at that price (feeding the committed tokens, the reply)
        overhead_ms = serial_overhead(self.serial_samples, pass_ms)
        return rollout_plan(
            self._model_acceptance(),
            self.costs,
            pass_ms / self.step_ms,
            1 + streams,
            self.gamma,
            drafted,
            overhead_ms / self.step_ms,
        )

    def _copy(self, first: int | None = None) -> tuple[tuple, float]:
        """The copied window (tokens, keys, source) on offer and its rate E(w)/c(w) at its best length (0.0: none):
        prompt lookup's copy of the committed text ("ngram") or the datastore's continuation ("store"), whichever
        promises more. `first`: the model's first drafted token (a copy that agrees with it is likelier kept)."""
        best = ((), (), None), 0.0
        for tokens, keys, source in self._copies(first):
            rate = best_length(self.calibration.predict(keys), self.costs)[1]
            if rate > best[1]:
                best = (tokens, keys, source), rate
        return best

    def _copies(self, first: int | None = None, after: list[int] | None = None) -> list[tuple[list[int], list, str]]:
        """(tokens, keys, source) of each copy source's proposal after the committed text and then `after` (tokens a
        chain drafted past it); `first` as in `_copy`."""
        out = []
        if self.ngram is not None:
            copy, n = self.ngram.propose(self.ngram_tokens, after=after or ())
            if copy:
                out.append((copy, [("ngram", min(n, 3), first == copy[0])] * len(copy), "ngram"))
        if self.datastore is not None:
            context = self.tokens[-STORE_CONTEXT:] + list(after or ())
            tokens, evidence = self.datastore.propose(context, self.ngram_tokens or self.gamma)
            if tokens:
                agree = first == tokens[0]
                keys = [("store", n, prob_key(share, STORE_SHARE_BINS), agree) for n, share in evidence]
                out.append((tokens, keys, "store"))
        return out

    def _offer(self, drafted: Rollout, info: dict) -> Window:
        """The next window: the model's drafted tokens or a copy (of the committed text, or the datastore's
        continuation), whichever promises more committed tokens per unit of verification time, cut to its best
        length (module docstring)."""
        keys = [("model", prob_key(math.exp(lp))) for lp in drafted.logprobs]
        options = [(drafted.tokens, drafted.pairs, keys, "model")]
        (copy, copy_keys, copy_source), _ = self._copy(drafted.tokens[0] if drafted.tokens else None)
        if copy:
            options.append((copy, None, copy_keys, copy_source))
        best = None
        explore = self.adaptive_window and self.unexplored >= EXPLORE
        for tokens, pairs, keys, source in options:
            if self.adaptive_window:
                length, rate = best_length(self.calibration.predict(keys), self.costs)
                if explore and tokens:  # one token of a source with tokens (the likeliest kept), not a plain step
                    length, rate = 1, 1e9 + self.calibration.predict(keys[:1])[0]
            else:
                # the model's whole window; a copy where the model has none (method pld, or nothing drafted)
                length, rate = len(tokens), (2.0 if source == "model" else 1.0) if tokens else 0.0
            if best is None or rate > best[0]:
                best = (rate, tokens[:length], None if pairs is None else pairs[:length], keys[:length], source)
        rate, self.window, self.window_pairs, self.window_keys, source = best
        self.alt, self.alt_keys, self.fork, self.alt_source = [], [], 0, None
        if self.forks and self.adaptive_window and self.ngram is not None and not explore:
            source, rate = self._fork(options, best) or (source, rate)
        offered = any(tokens for tokens, *_ in options)
        self.unexplored = self.unexplored + 1 if offered and not self.window else 0
        alt_source = self.alt_source if self.alt else None
        info = info | {"source": source if self.window else None, "alt_source": alt_source, "rate": rate}
        if self.backend is not None:  # what asking the model next step promises, for an engine serving copies itself
            info |= {"model_rate": self._model_plan(0)[1], "explore_in": max(0, self.explore_every - self.skipped)}
            info["prefill_ms"] = self.prefill_ms  # ms a prompt token
        return Window(list(self.window), info, list(self.alt), self.fork)

    def _fork(self, options: list, best: tuple) -> tuple[str, float] | None:
        """Two chains as one forked window, where that promises more committed tokens per unit of the target's time
        than the best single window (`best`, its rate first). With a model window: the model's chain and a copy, the
        copies tried (prompt lookup's and the datastore's) being the one after the committed text (options[1], if
        any) and those after the committed text and the model's first f drafted tokens (f = 1..w−1: the model starts
        a quote, the copy finishes it), which hang off the model's chain after its f-th token; the main chain is the
        better single source's (Mirror-SD's branches hang off it), and a copy after model tokens always hangs off the
        model's. With none (pld_store, the engine's own copies): the better copy and the other source's, where they
        differ (held-out answers: either source's proposal alone matched 1.3–1.9 tokens a step, the better of the two
        2.4; docs/engine.md). Returns the main chain's source and the fork's rate, None where no fork pays."""
        model = options[0]
        if model[0]:
            tokens_a, pairs_a, keys_a, source_a = model
            chains = [(options[1][0], options[1][2], options[1][3])] if len(options) > 1 else []
            for f in range(1, len(tokens_a)):
                for copy, keys, source in self._copies(after=tokens_a[:f]):
                    if copy[0] != tokens_a[f]:  # else it is (or starts as) the model's own chain
                        chains.append((tokens_a[:f] + copy, keys_a[:f] + keys, source))
        elif len(options) > 1:
            tokens_a, pairs_a, keys_a, source_a = options[1]
            chains = [chain for chain in self._copies() if chain[2] != source_a]
        else:
            return None
        choice = None
        for i, (tokens_b, keys_b, _) in enumerate(chains):
            shared = 0
            while shared < min(len(tokens_a), len(tokens_b)) and tokens_a[shared] == tokens_b[shared]:
                shared += 1
            accept_a, accept_b = self.calibration.predict(keys_a), self.calibration.predict(keys_b)
            la, lb, rate = best_fork(accept_a, accept_b, shared, self.costs)
            if la and rate > (choice[0] if choice else best[0]) + 1e-9:
                choice = (rate, i, la, lb, shared)
        if choice is None:
            return None
        _, i, la, lb, shared = choice
        tokens_b, keys_b, source_b = chains[i]
        main, other = (tokens_a, pairs_a, keys_a, la, source_a), (tokens_b, None, keys_b, lb, source_b)
        if model[0] and i == 0 and len(options) > 1 and best[4] != "model" and best[1]:  # the plain copy is better
            main, other = other, main
        tokens, pairs, keys, length, source = main
        self.window, self.window_keys = list(tokens[:length]), keys[:length]
        self.window_pairs = None if pairs is None else pairs[:length]
        self.alt, self.alt_keys, self.fork = list(other[0][: other[3]]), other[2][: other[3]], min(shared, la, lb)
        self.alt_source = other[4]
        return source, choice[0]

    def _serial(self, tail: Rollout, n: int) -> Rollout:
        """Draft `n` tokens one branch deep after the committed tokens the cache lacks and the drafted `tail` (which
        read the states that predicted them, and no target state yet)."""
        if self.backend is None or n < 1:
            return Rollout([], [], 0, [], None)
        committed = self.tokens[self.cached :]
        spine = committed + tail.tokens
        features = None
        if self.conditioned:
            tail_block = self._drafted(len(tail.tokens), tail.pairs)
            features = join([self._committed(self.cached, len(committed)), tail_block])
        return self.backend.rollout(spine, [(len(spine) - 1, None)], n, features, self._noise())[0]

    def _then_look_ahead(self, keep: int, prefix_ms: float | None):
        """The work after a window is sent: prune the cache to the committed path, then (Mirror-SD) look ahead."""

        def work():
            self._keep(keep)
            if self.look_ahead:
                self._look_ahead(prefix_ms)
            self._catch_up()

        return work

    def _catch_up(self) -> None:
        """Feed the committed tokens the draft's cache lacks (but the newest, whose logits a rollout reads) once there
        are CATCH_UP or more: steps with no rollout (a copied window, a plain step) feed nothing, and the next serial
        rollout would feed them all while the target waits. Runs after the reply, while the target works."""
        pending = len(self.tokens) - self.cached
        if self.backend is None or pending - 1 < CATCH_UP:
            return
        committed = self.tokens[self.cached :]
        features = self._committed(self.cached, pending) if self.conditioned else None
        self.backend.rollout(committed, [(pending - 1, None)], 1, features)  # one pass: K/V, one row's logits
        self._keep(pending - 1)

    def _look_ahead(self, prefix_ms: float | None) -> None:
        """Draft on past the window while the target runs its prefix (the draft would idle until the branch request):
        whenever the target keeps the whole window and its bonus token is the draft's own next token, the next window
        is already here, and the suffix's time goes to the other branches. As many passes as fit the target's
        measured prefix (γ + 1 at most: the bonus token, then a whole window)."""
        line = rollout_line(self.samples)
        depth = self.gamma + 1
        if line is not None and prefix_ms is not None:
            per_pass = (line[0] + line[1]) / self.gamma
            # a serial rollout's cost beyond its passes (feeding the committed tokens) comes first: a look-ahead
            # that overruns the prefix delays the branch rollout, and the target waits for it
            budget = prefix_ms - serial_overhead(self.serial_samples, per_pass)
            depth = max(0, min(depth, int(budget // max(per_pass, 1e-6))))
        if depth < 2 or self.backend is None or not self.window:
            return
        if line is not None and prefix_ms is not None:  # its saving against what it slows the target's prefix by
            ms = serial_overhead(self.serial_samples, per_pass) + depth * per_pass
            if not self._pays(self._ahead_hit(), min(ms, prefix_ms)):
                return
        window = Rollout(self.window, [], 0, [], self.window_pairs)
        self.ahead = self._serial(window, depth)
        self._keep(len(self.tokens) - self.cached - 1)  # the committed tokens it fed (as such), but the newest

    def _ahead_hit(self) -> float:
        """P(the look-ahead is the branch needed): the target keeps the whole window, then the draft's next token."""
        reach = math.prod(self.calibration.predict(self.window_keys))
        return reach * self._model_acceptance()

    def _model_acceptance(self) -> float:
        """The model's mean per-token acceptance so far (its calibration over every probability bin)."""
        return self.calibration.overall(lambda k: k[0] == "model")

    def _alternative_rate(self) -> float:
        """The rate of what a step verifies when the model has no window: the copy on offer, else a plain step's 1."""
        return max(1.0, self._copy()[1])

    def _pays(self, hit: float, overlap_ms: float) -> bool:
        """Whether concurrent work that makes the next window with probability `hit` is worth slowing the target for
        `overlap_ms` of its step: hit × what such a window is worth (`_hit_ms`) ≥ contention × overlap_ms. Always,
        with no measured contention (devices that share nothing) or no fallback measured yet."""
        if self.contention <= 0 or self.miss_ms is None:
            return True
        return hit * self._hit_ms() >= self.contention * overlap_ms

    def _hit_ms(self) -> float:
        """What a next window rolled out in advance is worth, in ms of the target's time: the fallback it spares
        (its measured reply time), or more where no fallback is rolled out: then the next window is a copy or a plain
        step, which cost nothing but commit less, and the model's window commits in expectation E(w) tokens in c(w)
        steps where the alternative's rate r needs E(w)/r (window.py), i.e. saves step_ms × (E(w)/r − c(w)).
        Measured: pricing by the fallback's time alone, near 0 where the serial plan skips the model (a copy or a
        plain step instead), turned Mirror-SD's branch rollouts off on Zen 5 at a contention of a few per cent, and
        cost it 1.26× → 1.17× against plain decoding (docs/engine.md, fifteenth session)."""
        miss = self.miss_ms or 0.0
        if not self.step_ms or not self.costs or self.backend is None:
            return miss
        accept = [self._model_acceptance()] * self.gamma
        w, rate = best_length(accept, self.costs)
        alternative = self._alternative_rate()
        if w == 0 or rate <= alternative:
            return miss
        return max(miss, self.step_ms * expected_committed(accept[:w])[-1] * (1 / alternative - 1 / rate))

    def _load(self, ms: float, gamma: int) -> None:
        """The draft's usual concurrent work for `ms` (whole-budget branch rollouts; the engine times its target
        beside it: `MirrorEngine._measure_contention`). The next Start resets the draft's context."""
        if self.backend is not None:
            self.backend.busy(ms, self.branch_budget, gamma)

    def _shape(
        self, ranked: list[tuple[int, int, float]], suffix_ms: float | None, rider: float | None
    ) -> tuple[int, int, bool]:
        """(depth, branches, worth rolling out at all) of this step's rollout (`branches.plan_rollout`): the shape
        that spares the target the most waiting, the passes a hit spares after the verdict against the rollout
        outlasting the suffix; `rider`: the look-ahead completion's hit probability, where it rides along. Depth γ
        and every branch while nothing is measured yet."""
        line = rollout_line(self.samples)
        if suffix_ms is None or line is None:
            return self.gamma, len(ranked), True
        pass_ms = (line[0] + line[1]) / self.gamma  # one branch's pass: what a serial pass costs the waiting target
        finish_ms = serial_overhead(self.serial_samples, pass_ms)
        probs = [p for _, _, p in ranked]
        depth, n, value = plan_rollout(probs, line, self.gamma, suffix_ms, pass_ms, finish_ms, SUFFIX_SPREAD, rider)
        return depth, n, value >= 0

    def _calibrate(self) -> None:
        """Time rollouts of 1 and of the whole budget on the fresh context, so `_shape` has a line to plan by."""
        last = self.tokens[-1]
        for n in (1, self.branch_budget, 1, self.branch_budget):
            features = join([self._committed(len(self.tokens) - 1, 1)] + [self._drafted(1, None)] * n)
            start = time.perf_counter()
            self.backend.rollout([last], [(0, last)] * n, self.gamma, features)
            self.samples.append((n, (time.perf_counter() - start) * 1000))
            self.backend.keep(0)

    # --- what the fed nodes read (module docstring) ----------------------------------------------------------
    def _append_states(self, states, rows: int, what: str) -> None:
        for slot in self.target_slots:
            self.states[slot].append(as_states((states or {}).get(slot), rows, what, self.device))

    def _committed(self, first: int, n: int) -> dict[str, torch.Tensor] | None:
        """What committed tokens first..first+n-1 read: the target's states of the tokens before them."""
        if not self.conditioned:
            return None
        return {slot: self.states[slot].rows(first - 1, n, self.widths[slot]) for slot in self.target_slots}

    def _drafted(self, n: int, pairs: torch.Tensor | None, exit_rows: torch.Tensor | None = None) -> dict:
        """What n drafted tokens read: own = the states that predicted them (`pairs`), exit = `exit_rows`."""
        block = {}
        if self.own:
            block["own"] = pairs[:n] if pairs is not None else torch.zeros(n, self.widths["own"], device=self.device)
        if exit_rows is not None and "exit" in self.widths:
            block["exit"] = exit_rows[:n]
        return complete(block, n, self.widths, self.device)

    def _window_nodes(self, exit_known: bool) -> dict:
        """The window's tokens d_1..d_γ: own pairs, and d_{i-1}'s ℓe state once the target has run its prefix."""
        exit_rows = self.window_states[: len(self.window)] if exit_known and self.window_states is not None else None
        return self._drafted(len(self.window), self.window_pairs, exit_rows)

    def _ahead_nodes(self) -> dict:
        """The look-ahead's tokens: the first reads d_γ's ℓe state (it follows the window) and its own pair; the rest
        their own pairs."""
        exit_rows = None
        if self.window_states is not None:
            exit_rows = torch.zeros(len(self.ahead.tokens), self.window_states.shape[1], device=self.device)
            exit_rows[0] = self.window_states[len(self.window)]
        return self._drafted(len(self.ahead.tokens), self.ahead.pairs, exit_rows)

    def _root(self, r: int) -> dict:
        """A branch root at window position r: the ℓe state of the token it follows, and the state that predicted
        d_{r+1} (the root stands where d_{r+1} stood; for r = γ, the look-ahead's first token's, if any)."""
        pair = None
        if self.own:
            source = self.window_pairs if r < len(self.window) else (self.ahead.pairs if self.ahead else None)
            offset = r if r < len(self.window) else 0
            if source is not None and offset < len(source):
                pair = source[offset : offset + 1]
        exit_rows = self.window_states[r : r + 1] if self.window_states is not None else None
        return self._drafted(1, pair, exit_rows)


def _queued_ms(sent_s: float | None) -> float | None:
    """How long ago (ms) the target sent a message stamped `sent_s` (time.monotonic()): None without a stamp, or
    where it cannot be this machine's clock (negative, or over a minute: a peer on another host)."""
    if sent_s is None:
        return None
    late = (time.monotonic() - sent_s) * 1000
    return late if 0.0 <= late < 60_000 else None


def _joined(first: Rollout, skip: int, rest: Rollout | None, n: int) -> Rollout:
    """first's tokens from `skip` on, then rest's, n at most: a window assembled from two rollouts (a look-ahead and
    its completion, a short branch and its extension), with their log-probs and pairs."""
    parts = [(first, skip)] + ([(rest, 0)] if rest is not None else [])
    tokens = [t for r, k in parts for t in r.tokens[k:]][:n]
    logprobs = [lp for r, k in parts for lp in r.logprobs[k:]][:n]
    pairs = [r.pairs[k:] for r, k in parts if r.pairs is not None and len(r.pairs) > k]
    return Rollout(tokens, logprobs, rest.num_forwards if rest else 0, [], torch.cat(pairs)[:n] if pairs else None)
