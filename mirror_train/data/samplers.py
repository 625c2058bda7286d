"""Which cached rows a training step reads: pure functions of (seed, step), so a resumed run repeats nothing.

`PositionSampler` draws independent positions (per-position proxy heads); `WindowSampler` whole context windows
(heads and drafts that attend over the context). The epoch of step s and its permutation follow from s and the
seed alone; `rank`/`world` split a global batch across data-parallel processes.
"""

from __future__ import annotations

import numpy as np
import torch

from mirror_train.data.features import FeatureCache
from mirror_train.errors import MirrorTrainError


def batch_indices(step: int, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1) -> np.ndarray:
    """Rows of the global batch at `step` that process `rank` of `world` takes (a function of step alone)."""
    per_epoch = max(n // batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(seed + epoch).permutation(n)
    return perm[i * batch_size : (i + 1) * batch_size][rank::world]


class PositionSampler:
    """Batches of independent positions (per-position heads): the batch at step s depends on (seed, s) alone."""

    def __init__(self, cache: FeatureCache, positions: np.ndarray, batch_size: int, seed: int):
        self.cache, self.positions, self.batch_size, self.seed = cache, positions, batch_size, seed
        self.steps_per_epoch = max(len(positions) // batch_size, 1)

    def batch(self, step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
        idx = batch_indices(step, len(self.positions), self.batch_size, self.seed, rank, world)
        return self.cache.batch(self.positions[idx])


class WindowSampler:
    """Batches of whole context windows (heads that attend over the context): windows of up to `window` positions
    cut from each cached sequence, shuffled per epoch by (seed + epoch) and packed up to `batch_size` positions.
    Windows holding answer positions appear `answer_repeat` times an epoch (as `training_positions` repeats them)."""

    def __init__(self, cache: FeatureCache, batch_size: int, seed: int, window: int = 1024, answer_repeat: int = 1):
        self.cache, self.batch_size, self.seed = cache, batch_size, seed
        spans = []
        answers = np.asarray(cache.is_answer)
        for s in range(cache.num_sequences):
            lo, hi = int(cache.offsets[s]), int(cache.offsets[s + 1])
            for a in range(lo, hi, window):
                b = min(a + window, hi)
                spans += [(a, b)] * (max(answer_repeat, 1) if answers[a:b].any() else 1)
        self.spans = np.array(spans, dtype=np.int64)
        self._plans: dict[int, list[list[int]]] = {}
        self.steps_per_epoch = len(self._plan(0))

    def _plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            order = np.random.default_rng(self.seed + epoch).permutation(len(self.spans))
            packs, current, size = [], [], 0
            for i in order:
                n = int(self.spans[i, 1] - self.spans[i, 0])
                if current and size + n > self.batch_size:
                    packs.append(current)
                    current, size = [], 0
                current.append(int(i))
                size += n
            self._plans[epoch] = packs + ([current] if current else [])
        return self._plans[epoch]

    def batch(self, step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
        epoch = 0
        while step >= len(self._plan(epoch)):
            step -= len(self._plan(epoch))
            epoch += 1
        chosen = self._plan(epoch)[step][rank::world] or self._plan(epoch)[step][:1]
        return self.cache.windows([tuple(self.spans[i]) for i in chosen])


def training_positions(cache: FeatureCache, train_on: str, answer_repeat: int = 1) -> np.ndarray:
    """Cached rows an epoch visits: all positions (answers repeated `answer_repeat` times) or answers only."""
    answers = cache.positions(answers_only=True)
    if train_on == "answers":
        positions = answers
    else:
        positions = np.concatenate([cache.positions(), *[answers] * max(answer_repeat - 1, 0)])
    if len(positions) == 0:
        raise MirrorTrainError(f"{cache.path} has no {train_on} positions to train on")
    return positions
