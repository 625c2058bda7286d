"""The data pipeline's time boxes on a tiny target: what is kept, and that a re-run keeps the same."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mirror_train.data.features import FeatureCache, FeatureCacheConfig, TokenSequence, build_feature_cache
from mirror_train.data.selfdistill import SelfDistillConfig, generate_selfdistill, load_selfdistill
from mirror_train.errors import MirrorTrainError
from tests.test_recipes import write_prompts


def test_self_distillation_stops_at_its_time_box_and_a_rerun_adds_nothing(tiny_target, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 12, "p")
    cfg = SelfDistillConfig(prompts=str(prompts), num_prompts=12, max_new_tokens=4, batch_size=2, max_minutes=1e-6)
    out = tmp_path / "sd"
    rows = load_selfdistill(generate_selfdistill(cfg, out, tiny_target))
    assert len(rows) == 4  # one flush of two batches of 2, then out of time
    assert json.loads((out / "provenance.json").read_text())["time_boxed"] is True
    again = load_selfdistill(generate_selfdistill(cfg, out, tiny_target))
    assert again["id"] == rows["id"]
    cfg.max_minutes = None  # the box lifted: the same run finishes the rest, keeping what it has
    whole = load_selfdistill(generate_selfdistill(cfg, out, tiny_target))
    assert len(whole) == 12 and set(rows["id"]) <= set(whole["id"])


def test_a_time_boxed_cache_keeps_what_its_minutes_finished_and_a_resume_finishes_it(tiny_target, tmp_path):
    """Cached in a seeded order until the box is spent, then cut to the finished batches: each kept sequence's
    features are its own, a killed run resumes where it stopped, and a finished cache is final."""
    rng = np.random.default_rng(0)
    seqs = [TokenSequence(rng.integers(0, 100, int(rng.integers(8, 60))).tolist(), 5) for _ in range(300)]
    cfg = FeatureCacheConfig(exit_layers=[2], top_k=4, max_tokens_per_batch=256, max_minutes=1e-9)  # one batch
    out = build_feature_cache(tiny_target, seqs, tmp_path / "cache", cfg, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    cache = FeatureCache(out, 2)
    assert 0 < cache.num_sequences < len(seqs) and meta["planned"]["sequences"] == len(seqs)
    assert len(cache) == cache.offsets[-1] == cache.hidden.shape[0] == cache.token_ids.shape[0]
    by_ids = {tuple(s.ids[:-1]): s for s in seqs}
    for s in range(cache.num_sequences):  # every kept row is a whole input sequence, answer marks included
        lo, hi = cache.offsets[s], cache.offsets[s + 1]
        seq = by_ids[tuple(cache.token_ids[lo:hi].tolist())]
        assert cache.is_answer[lo:hi].sum() == len(seq.ids) - seq.answer_start
    cfg.max_minutes = 10.0  # finished caches are final: a re-run with a larger box finds it done
    assert build_feature_cache(tiny_target, seqs, out, cfg, progress=False) == out
    assert FeatureCache(out, 2).num_sequences == cache.num_sequences


def test_a_time_boxed_cache_killed_mid_way_resumes_and_caches_the_rest(tiny_target, tmp_path, monkeypatch):
    from mirror_train.data import features

    rng = np.random.default_rng(1)
    seqs = [TokenSequence(rng.integers(0, 100, int(rng.integers(8, 60))).tolist(), 5) for _ in range(40)]
    cfg = FeatureCacheConfig(exit_layers=[2], top_k=4, max_tokens_per_batch=256, max_minutes=10.0)
    real, calls = features._teacher_force, []

    def dies_on_the_third_batch(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(features, "_teacher_force", dies_on_the_third_batch)
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(tiny_target, seqs, tmp_path / "c", cfg, progress=False)
    assert json.loads((tmp_path / "c" / "progress.json").read_text())["batches_done"] == 2
    with pytest.raises(MirrorTrainError, match="incomplete"):
        FeatureCache(tmp_path / "c", 2)
    build_feature_cache(tiny_target, seqs, tmp_path / "c", cfg, progress=False)
    assert len(calls) > 3
    monkeypatch.undo()
    cache = FeatureCache(tmp_path / "c", 2)
    assert cache.num_sequences == len(seqs) and len(cache) == sum(len(s.ids) - 1 for s in seqs)
    whole = FeatureCache(
        build_feature_cache(
            tiny_target, seqs, tmp_path / "w", dataclasses.replace(cfg, max_minutes=None), progress=False
        ),
        2,
    )
    rows = {tuple(whole.token_ids[whole.offsets[s] : whole.offsets[s + 1]].tolist()): s for s in range(len(seqs))}
    for s in range(len(seqs)):  # the resumed cache holds each sequence's features as an uninterrupted one does
        lo, hi = cache.offsets[s], cache.offsets[s + 1]
        w = rows[tuple(cache.token_ids[lo:hi].tolist())]
        np.testing.assert_array_equal(cache.hidden[lo:hi], whole.hidden[whole.offsets[w] : whole.offsets[w + 1]])


def test_two_ranks_share_the_self_distillation_and_the_main_rank_merges_it(tiny_model_dir, tmp_path):
    """Two real processes (torchrun, gloo): each answers half the prompts into its own rows file, the main rank
    merges them into one dataset of every prompt, then makes the caches while the other waits."""
    prompts = write_prompts(tmp_path / "p.jsonl", 10, "p")
    script = Path(__file__).parent / "helpers" / "two_ranks_data.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(
        [*cmd, str(tiny_model_dir), str(prompts), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith(("rank", "dataset")))
    assert lines == ["dataset: 10 rows, 10 prompts, from 2 ranks", "rank 0: 5 rows", "rank 1: 5 rows"]
    assert list((tmp_path / "data").glob("features_train_*/meta.json"))  # the main rank built the cache
