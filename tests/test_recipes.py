"""Recipe smoke runs on a tiny target: a few steps, resume after a kill, two processes, the shipped configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from mirror_train.config import load_config
from mirror_train.proxy_training import ProxyRunConfig

ROOT = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, n: int, prefix: str) -> Path:
    path.write_text("\n".join(f'{{"id": "{prefix}{i}", "turns": ["how to write the {i}"]}}' for i in range(n)) + "\n")
    return path


@pytest.fixture
def proxy_config(tmp_path, tiny_model_dir) -> Path:
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "target": str(tiny_model_dir),
        "head": {"kind": "mlp", "exit_layer": 2, "mlp_hidden": 16},
        "data": {
            "dir": str(tmp_path / "data"),
            "selfdistill": {
                "prompts": str(write_prompts(tmp_path / "train.jsonl", 12, "t")),
                "num_prompts": 6,
                "max_new_tokens": 8,
            },
            "forced_prompts": 4,
            "heldout": {"prompts": str(write_prompts(tmp_path / "held.jsonl", 3, "h")), "max_new_tokens": 8},
            "top_k": 8,
        },
        "train": {"batch_size": 16, "max_steps": 3, "eval_every": 2, "save_every": 2},
        "log": {"report_to": ["tensorboard"]},
    }
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_recipe(config: Path, *overrides: str, launcher=(sys.executable,), timeout=300, env=None):
    cmd = [*launcher, str(ROOT / "recipes" / "proxy_head.py"), "--config", str(config), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def head_weights(run_dir: Path) -> dict:
    return load_file(run_dir / "export" / "model.safetensors")


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_proxy_recipe_smoke(proxy_config, tmp_path, tiny_model_dir, kind):
    proc = run_recipe(proxy_config, f"head.kind={kind}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    weights = head_weights(run)
    if kind == "mlp":
        assert weights["fc2.weight"].abs().sum() > 0  # zero-initialised: any change means it trained
    else:  # initialised from the target's layer 3: trained weights differ from it
        original = load_file(tiny_model_dir / "model.safetensors")["model.layers.2.mlp.down_proj.weight"]
        assert not (weights["blocks.0.mlp.down_proj.weight"] == original).all()
    assert (run / "config.yaml").exists() and list((run / "checkpoints").glob("step_*"))
    assert list(run.rglob("events.out.tfevents*"))  # tensorboard logged
    assert "exported" in proc.stdout
    assert "eval step 2 (" in proc.stdout  # a line per evaluation: the curve scripts read it from the log


def test_proxy_recipe_bf16_data_and_training(proxy_config, tmp_path):
    """bf16 training data and autocast training: the data records its precision, the held-out data stays float32."""
    proc = run_recipe(proxy_config, "train.mixed_precision=bf16", "data.dtype=bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert head_weights(tmp_path / "run")["fc2.weight"].abs().sum() > 0
    data = tmp_path / "data"
    assert json.loads((data / "selfdistill" / "provenance.json").read_text())["dtype"] == "bfloat16"
    metas = {d.name: json.loads((d / "meta.json").read_text()) for d in data.glob("features_*")}
    assert {name.split("_")[1]: meta.get("dtype") for name, meta in metas.items()} == {
        "train": "bfloat16",
        "heldout": None,
    }
    assert "dtype" not in json.loads((data / "heldout" / "provenance.json").read_text())


def test_proxy_recipe_resumes_after_kill_without_losing_or_repeating_steps(proxy_config, tmp_path):
    """Kill a run after its first checkpoint; resumed to step N it must equal a run that went straight to N."""
    constant_lr = ["optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "train.save_every=5", "train.eval_every=1000000"]
    killed_dir = tmp_path / "killed"
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "proxy_head.py"),
        "--config",
        str(proxy_config),
        "train.max_steps=1000000",
        *constant_lr,
        f"output_dir={killed_dir}",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not list((killed_dir / "checkpoints").glob("step_*/trainer_state.json")) and time.time() < deadline:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    steps = [int(p.name.split("_")[1]) for p in (killed_dir / "checkpoints").glob("step_*")]
    assert steps, "no checkpoint before the deadline"
    total = f"train.max_steps={max(steps) + 7}"  # resume mid-epoch-agnostic: 7 more steps than were saved

    resumed = run_recipe(proxy_config, total, *constant_lr, f"output_dir={killed_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = run_recipe(proxy_config, total, *constant_lr, f"output_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    a, b = head_weights(tmp_path / "straight"), head_weights(killed_dir)
    for key in a:
        assert (a[key] == b[key]).all(), key


def test_proxy_recipe_two_processes_gloo(proxy_config):
    launcher = (
        "accelerate",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    )
    proc = run_recipe(proxy_config, launcher=launcher, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_proxy_recipe_deepspeed_zero2_cpu(proxy_config):
    ds = ROOT / "recipes" / "accelerate" / "deepspeed_zero2.yaml"
    launcher = ("accelerate", "launch", "--config_file", str(ds), "--num_processes", "1")
    proc = run_recipe(proxy_config, launcher=launcher, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported" in proc.stdout


def test_bad_config_is_one_line(proxy_config):
    proc = run_recipe(proxy_config, "head.kindd=mlp")
    assert proc.returncode != 0
    assert "unknown key 'head.kindd'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "configs").glob("proxy_head*.yaml")))
def test_shipped_proxy_configs_parse(path):
    assert path.read_text().startswith("# accelerate launch")
    load_config(ProxyRunConfig, path)


@pytest.mark.parametrize(
    "override, message",
    [("train.mixed_precision=fp8", "train.mixed_precision"), ("data.dtype=float16", "data.dtype")],
)
def test_bad_precision_settings_are_refused(override, message):
    from mirror_train.errors import MirrorTrainError

    with pytest.raises(MirrorTrainError, match=message):
        load_config(ProxyRunConfig, ROOT / "recipes" / "configs" / "proxy_head_smollm2.yaml", [override])
