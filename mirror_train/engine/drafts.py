"""Draft backends the draft server drives: the trained draft model, and a synthetic draft for measuring the engine.

Both keep the committed context in a cache of their own and answer the same three calls:
    reset(prompt, reference, features)      a new sequence: prefill all of the prompt but its last token
    rollout(spine, branches, γ, features, noise)
                                            γ tokens per branch, a `Rollout` each (see
                                            `MirrorDrafterForCausalLM.rollout_tree`); noise: the target's
                                            sampling noise by sequence index, to couple the draft's tokens to
                                            (rollout.coupled_choice; None: greedy)
    keep(n)                                 commit the first n spine nodes of the last rollout, drop every other node
    fed()                                   how many nodes the last rollout fed (what keep can commit)
    busy(ms, branches, γ)                   the draft's usual concurrent work for ms, on a dummy context (the
                                            engine times its target beside it); the next reset starts afresh
`features` are what the fed tokens read (a feature-conditioned draft; others ignore them): slot → one row per fed
token, already paired by the server; `widths` (slot → width) says which slots the draft reads.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mirror_train.engine.rollout import Rollout, keep_cache_path, rollout_tree
from mirror_train.errors import MirrorTrainError


class ModelDraft:
    """A `MirrorDrafterForCausalLM` behind the backend calls; greedy, or at T > 0 coupled to the target's noise (the
    acceptance rule needs no draft q)."""

    def __init__(self, model, use_streams: bool = True):
        self.model = model.eval()
        self.use_streams = use_streams
        self.num_streams = model.config.num_streams if use_streams else 0
        self.widths = dict(model.fusion.widths) if model.fusion is not None else {}
        self.cache = None

    @torch.no_grad()
    def reset(self, prompt: Sequence[int], reference: Sequence[int] | None = None, features=None) -> None:
        self.cache = self.model.new_cache()
        if len(prompt) > 1:
            device = self.model.device
            ids = torch.tensor([list(prompt[:-1])], device=device)
            last = torch.tensor([ids.shape[1] - 1], device=device)
            states = self._features(features)
            states = None if states is None else {slot: f.unsqueeze(0) for slot, f in states.items()}
            self.model(ids, cache=self.cache, num_streams=0, logits_index=last, features=states)  # K/V only
        self.committed = self.cache.get_seq_length()

    def rollout(
        self, spine: Sequence[int], branches: Sequence[tuple[int, int | None]], gamma: int, features=None, noise=None
    ):
        self.committed = self.cache.get_seq_length()  # every rollout follows a `keep` (or `reset`)
        results = rollout_tree(
            self.model,
            self.cache,
            spine,
            branches,
            gamma,
            use_streams=self.use_streams,
            features=self._features(features),
            noise=noise,
        )
        return results

    def _features(self, features) -> dict[str, torch.Tensor] | None:
        if not self.widths or not features:
            return None
        return {slot: torch.as_tensor(f).to(self.model.device, self.model.dtype) for slot, f in features.items()}

    def keep(self, n: int) -> None:
        keep_cache_path(self.cache, self.committed, range(n))
        self.committed = self.cache.get_seq_length()

    @torch.no_grad()
    def busy(self, ms: float, branches: int, gamma: int) -> None:
        prompt = list(range(1, 65))
        zeros = {slot: torch.zeros(len(prompt) - 1 + branches, width) for slot, width in self.widths.items()}
        self.reset(prompt, None, {slot: z[: len(prompt) - 1] for slot, z in zeros.items()})
        roots = [(0, prompt[i % len(prompt)]) for i in range(branches)]
        end = time.perf_counter() + ms / 1000
        while time.perf_counter() < end:
            self.rollout(prompt[-1:], roots, gamma, {slot: z[: 1 + branches] for slot, z in zeros.items()})
            self.keep(0)

    def fed(self) -> int:
        return self.cache.get_seq_length() - self.committed


# The probability a perfect head gives c* (`SyntheticDraft.perfect_candidates`): sure but not certain, so the planner
# still weighs each branch's depth against the suffix as it does the trained head's
PERFECT_P = 0.9


@dataclass
class SyntheticDraftConfig:
    """A draft that replays the target's own greedy continuation with injected errors, at a chosen cost.

    Its proposal for reference position n on a correct context is right with probability `acceptance`, drawn once
    per position (a greedy draft proposes the same token for the same context, whichever rollout asks), else a
    wrong id; on a context already off the reference it is wrong. The draws depend on the seed and the sequence
    alone, so methods run on the same prompt meet the same hard positions and their comparison is paired (with a
    fresh draw per proposal, Mirror-SD's tokens a step on the same six prompts ranged 2.71–3.15 between runs). A
    forward costs `forward_ms` plus `node_ms` per tree node beyond the first (a real draft's tree forward grows with
    its nodes: 7.2 → 20.2 ms from 1 to 32 nodes for the testbed-cut draft, shared/docs/testbed.md), spent in
    `time.sleep` on the draft's own core. A rollout takes ⌈γ / (1 + num_streams)⌉ forwards, as the streaming draft's
    does.
    """

    acceptance: float = 0.8
    forward_ms: float = 10.0
    node_ms: float = 0.0
    num_streams: int = 2
    seed: int = 0
    fail_after: int | None = None  # fault injection: raise on the rollout after this many (the engine's fault path)
    # A perfect proxy head beside it (`SyntheticDraft.perfect_candidates`): the ceiling a better head could reach
    perfect_head: bool = False

    def validate(self) -> None:
        if not 0 <= self.acceptance <= 1:
            raise MirrorTrainError(f"synthetic draft: acceptance must be in [0, 1], got {self.acceptance}")
        if self.forward_ms < 0 or self.node_ms < 0 or self.num_streams < 0:
            raise MirrorTrainError("synthetic draft: forward_ms, node_ms and num_streams must be ≥ 0")


class SyntheticDraft:
    def __init__(self, cfg: SyntheticDraftConfig, vocab_size: int):
        cfg.validate()
        self.cfg = cfg
        self.num_streams = cfg.num_streams
        self.widths: dict[str, int] = {}  # reads nothing
        self.vocab_size = vocab_size
        self.reference: list[int] = []
        self.right: list[bool] = []  # whether its proposal for each reference position is right (`reset`)
        self.rollouts = 0
        self.context: list[int] = []  # the committed tokens it has "cached"
        self.spine: list[int] = []
        # the draft server's hook for the proxy's candidates (DraftServer._branches): None leaves the head's alone
        self.perfect_candidates = self._perfect_candidates if cfg.perfect_head else None

    def reset(self, prompt: Sequence[int], reference: Sequence[int] | None = None, features=None) -> None:
        if reference is None:
            raise MirrorTrainError("the synthetic draft needs the target's reference continuation of each prompt")
        self.reference = list(prompt) + list(reference)
        # one draw per reference position, from a seed of the sequence (str seeds hash deterministically)
        rng = random.Random(f"{self.cfg.seed}/{len(prompt)}/{','.join(map(str, self.reference[-32:]))}")
        self.right = [rng.random() < self.cfg.acceptance for _ in self.reference]
        self.context = list(prompt[:-1])
        self.spine = []

    def rollout(
        self, spine: Sequence[int], branches: Sequence[tuple[int, int | None]], gamma: int, features=None, noise=None
    ):
        self.rollouts += 1  # its proposals are scripted: the target's noise (noise) changes none of them
        if self.cfg.fail_after is not None and self.rollouts > self.cfg.fail_after:
            raise RuntimeError(f"synthetic draft: injected fault after {self.cfg.fail_after} rollouts")
        passes = math.ceil(gamma / (1 + self.num_streams))
        nodes = len(spine) + sum(token is not None for _, token in branches)
        start = time.perf_counter()
        self.spine = list(spine)
        out = []
        for anchor, token in branches:
            ctx = self.context + self.spine[: anchor + 1] + ([token] if token is not None else [])
            on_track = ctx == self.reference[: len(ctx)]
            drafted = []
            for _ in range(gamma):
                n = len(ctx)
                truth = self.reference[n] if n < len(self.reference) else 0
                right = on_track and n < len(self.reference) and self.right[n]
                tok = truth if right else (truth + 1) % self.vocab_size
                on_track = on_track and right
                drafted.append(tok)
                ctx.append(tok)
            out.append(drafted)
        # The cost of the passes: the first feeds every node, each later one a chunk per branch.
        later_nodes = len(branches) * (1 + self.num_streams)
        cost = passes * self.cfg.forward_ms + self.cfg.node_ms * (nodes - 1 + (passes - 1) * (later_nodes - 1))
        _sleep_until(start + cost / 1000)
        return [Rollout(tokens, [0.0] * len(tokens), passes, [], None) for tokens in out]

    def _perfect_candidates(self, committed, window, ids, logp):
        """A perfect proxy head (`perfect_head`): at each window position r = 0..γ whose context is on the
        reference, c* (the reference's next token, the target's own) joins the head's candidates first, at
        probability PERFECT_P, in place of the head's last; the drafted token, where it is c*, stays the spine. The
        head's ranking, the planner and the rollouts are otherwise the engine's own, so what Mirror-SD gains with it
        is what the head's misses cost (docs/engine.md, forty-fifth session)."""
        ids = [[int(c) for c in row] for row in ids]
        logp = [[float(lp) for lp in row] for row in logp]
        for r in range(len(window) + 1):
            context = list(committed) + list(window[:r])
            n = len(context)
            if n >= len(self.reference) or context != self.reference[:n]:
                break  # off the reference: every later position is too, and no branch there can be needed
            truth = self.reference[n]
            if r < len(window) and window[r] == truth:
                continue  # the drafted token is c*: the spine continues, no branch
            if truth in ids[r]:
                i = ids[r].index(truth)
                del ids[r][i], logp[r][i]
            elif ids[r]:
                ids[r].pop()
                logp[r].pop()
            ids[r].insert(0, truth)
            logp[r].insert(0, math.log(PERFECT_P))
        return ids, logp

    def keep(self, n: int) -> None:
        self.context += self.spine[:n]
        self.spine = []

    def busy(self, ms: float, branches: int, gamma: int) -> None:
        time.sleep(ms / 1000)  # its cost is time on its own core, nothing the target's core shares

    def fed(self) -> int:
        return len(self.spine)


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
