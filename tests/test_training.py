"""Pure pieces of the training loop: the LR schedule, step-determined batches, budgets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_a_time_budget_that_runs_out_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    # Two real processes over gloo (torchrun): rank 1's budget is spent at step 3, rank 0's at 50. A rank that
    # stopped alone would leave the other waiting in a collective; both must stop at 3 and checkpoint step 3 once.
    script = Path(__file__).parent / "helpers" / "two_ranks_budget.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(line for line in done.stdout.splitlines() if "stopped" in line) == [
        "rank 0 stopped at step 3",
        "rank 1 stopped at step 3",
    ]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_3"]
