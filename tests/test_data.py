"""The data pipeline's time boxes on a tiny target: what is kept, and that a re-run keeps the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from mirror_train.data.features import FeatureCache, FeatureCacheConfig, TokenSequence, build_feature_cache
from mirror_train.data.selfdistill import SelfDistillConfig, generate_selfdistill, load_selfdistill
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


def test_a_time_boxed_cache_keeps_a_sample_that_fits_and_keeps_it_on_resume(tiny_target, tmp_path):
    rng = np.random.default_rng(0)
    seqs = [TokenSequence(rng.integers(0, 100, 40).tolist(), 30) for _ in range(200)]  # 7,800 positions
    cfg = FeatureCacheConfig(exit_layers=[2], top_k=4, max_tokens_per_batch=256, max_minutes=1e-4)  # 6 ms
    out = build_feature_cache(tiny_target, seqs, tmp_path / "cache", cfg, progress=False)
    kept = json.loads((out / "selection.json").read_text())["kept"]
    assert 0 < len(kept) < len(seqs) and kept == sorted(kept)
    cache = FeatureCache(out, 2)
    assert cache.num_sequences == len(kept) and len(cache) == 39 * len(kept)
    first = kept[0]
    assert cache.token_ids[:39].tolist() == seqs[first].ids[:39]  # the kept sequences, in their order
    cfg.max_minutes = 10.0  # a re-run on a faster day caches the same sequences, and finds them done
    assert build_feature_cache(tiny_target, seqs, tmp_path / "cache", cfg, progress=False) == out
    assert json.loads((out / "selection.json").read_text())["kept"] == kept


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
