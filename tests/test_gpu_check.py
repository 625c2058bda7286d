"""The GPU session's script, run here on the CPU so that it never rots: every check must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_passes_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = [c for c in record["checks"] if not c["ok"]]
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:], done.stderr[-3000:])
    assert record["device"] == "cpu"
    assert [c["check"] for c in record["checks"]] == [
        "devices",
        "recipes",
        "placements",
        "specbench",
        "step",
        "synthetic",
    ]
    placements = record["parts"]["placements"]
    assert {(r["placement"], r["target_step"], r["method"]) for r in placements} == {
        (p, s, m)
        for p, s in (("local", "dynamic"), ("process", "dynamic"), ("gloo", "dynamic"), ("local", "static"))
        for m in ("ar", "sd", "mirror", "pld")
    }
    assert all(r["equal_ar"] == r["of"] for r in placements)
    assert all(r["equal"] == r["of"] for r in placements if r["target_step"] == "dynamic")
    step = record["parts"]["step"]
    assert set(step["kinds"]) == {"dynamic", "static"} and step["ar_equal_across_kinds"] == 2
    assert [row["acceptance"] for row in record["parts"]["synthetic"]["rows"]] == [0.6, 0.7, 0.8, 0.9]
    assert "| check | ok | seconds | detail |" in done.stdout
