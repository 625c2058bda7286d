"""Pure pieces of the training loop: the LR schedule, step-determined batches, budgets."""

from __future__ import annotations

import numpy as np
import pytest

from mirror_train.data.samplers import batch_indices
from mirror_train.training import Budget, OptimConfig, cosine_lr


def test_cosine_lr_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    assert [cosine_lr(s, 0.0, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine_lr(10, 0.0, cfg) == pytest.approx(1.0)
    assert cosine_lr(10, 0.5, cfg) == pytest.approx(0.55)
    assert cosine_lr(10, 1.0, cfg) == pytest.approx(0.1)
    assert cosine_lr(10, 7.0, cfg) == pytest.approx(0.1)  # past the end stays at the floor


def test_batches_are_a_function_of_step_and_cover_each_epoch_once():
    n, bs = 100, 10
    epoch = np.concatenate([batch_indices(s, n, bs, seed=3) for s in range(10)])
    assert sorted(epoch.tolist()) == list(range(100))
    assert (batch_indices(7, n, bs, seed=3) == batch_indices(7, n, bs, seed=3)).all()
    assert not (batch_indices(10, n, bs, seed=3) == batch_indices(0, n, bs, seed=3)).all()  # a new epoch reshuffles
    # two ranks split the global batch without overlap
    a, b = batch_indices(4, n, bs, 3, rank=0, world=2), batch_indices(4, n, bs, 3, rank=1, world=2)
    assert sorted([*a, *b]) == sorted(batch_indices(4, n, bs, 3).tolist())


def test_budget_by_steps_and_by_time(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("mirror_train.training.time.perf_counter", lambda: clock[0])
    steps_only = Budget(total_steps=10, max_minutes=None)
    assert steps_only.progress(5) == 0.5 and not steps_only.done(9) and steps_only.done(10)
    timed = Budget(total_steps=1000, max_minutes=2.0, minutes_before=0.5)
    assert timed.progress(10) == pytest.approx(0.25)  # half a minute carried over from before a resume
    clock[0] += 90  # 1.5 more minutes
    assert timed.done(10) and timed.minutes() == pytest.approx(2.0)
