"""YAML + overrides -> typed configs: round trips, defaults, overrides and the wording of every user error."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

import pytest

from mirror_train.config import config_from_dict, config_to_dict, load_config, parse_overrides, save_config
from mirror_train.errors import MirrorTrainError


@dataclasses.dataclass
class Optim:
    lr: float = 3e-4
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    betas: tuple[float, ...] = (0.9, 0.95)

    def validate(self) -> None:
        if self.lr <= 0:
            raise MirrorTrainError(f"lr must be positive, got {self.lr}")


@dataclasses.dataclass
class Train:
    steps: int = 100
    optim: Optim = dataclasses.field(default_factory=Optim)
    resume: Path | None = None
    layers: list[int] = dataclasses.field(default_factory=lambda: [4, 8])
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    bf16: bool = True


@dataclasses.dataclass
class Run:
    name: str  # required: no default
    out_dir: Path = Path("runs")
    train: Train = dataclasses.field(default_factory=Train)
    seed: int | None = 0


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_round_trip(tmp_path):
    src = write(
        tmp_path,
        "name: demo\nout_dir: /tmp/x\ntrain:\n  steps: 5\n  resume: ckpt/last\n  layers: [1, 2, 3]\n"
        "  weights: {sharegpt: 2, gsm8k: 0.5}\n  bf16: false\n  optim:\n    lr: 1e-4\n    betas: [0.8, 0.9]\n",
    )
    cfg = load_config(Run, src)
    assert cfg.out_dir == Path("/tmp/x") and cfg.train.resume == Path("ckpt/last")
    assert cfg.train.optim.lr == 1e-4 and cfg.train.optim.betas == (0.8, 0.9)
    assert cfg.train.weights == {"sharegpt": 2.0, "gsm8k": 0.5} and isinstance(cfg.train.weights["sharegpt"], float)
    assert cfg.train.bf16 is False and cfg.seed == 0
    out = tmp_path / "sub" / "saved.yaml"
    save_config(cfg, out)
    assert load_config(Run, out) == cfg
    assert config_to_dict(cfg)["train"]["optim"]["betas"] == [0.8, 0.9]
    assert not [p for p in out.parent.iterdir() if p.name != "saved.yaml"]  # no temporary file left behind


def test_defaults_when_absent(tmp_path):
    cfg = load_config(Run, write(tmp_path, "name: demo\ntrain:\n  steps: 7\n"))
    assert cfg == Run(name="demo", train=Train(steps=7))
    assert load_config(Run, write(tmp_path, ""), ["name=x"]) == Run(name="x")  # empty file: all defaults


def test_float_field_accepts_int():
    cfg = config_from_dict(Run, {"name": "a", "train": {"optim": {"lr": 1}}})
    assert cfg.train.optim.lr == 1.0 and isinstance(cfg.train.optim.lr, float)


def test_overrides(tmp_path):
    args = parse_overrides(["train.steps=3", "--train.optim.lr=1e-4", "--train.layers", "[2, 6]", "--seed", "null"])
    assert args == ["train.steps=3", "train.optim.lr=1e-4", "train.layers=[2, 6]", "seed=null"]
    cfg = load_config(Run, write(tmp_path, "name: demo\ntrain:\n  steps: 9\n"), args + ["train.bf16=false"])
    assert cfg.train.steps == 3 and cfg.train.layers == [2, 6] and cfg.seed is None and cfg.train.bf16 is False
    assert cfg.train.optim.lr == 1e-4 and isinstance(cfg.train.optim.lr, float)
    cfg = load_config(Run, None, ["name=n", "train.weights.sharegpt=3", "out_dir=elsewhere"])
    assert cfg.train.weights == {"sharegpt": 3.0} and cfg.out_dir == Path("elsewhere")


@pytest.mark.parametrize("args", [["--train.steps"], ["train.steps"], ["--a", "--b=1"], ["=1"], ["a..b=1"]])
def test_malformed_override(args):
    with pytest.raises(MirrorTrainError, match="override"):
        parse_overrides(args)


def test_unknown_keys(tmp_path):
    path = write(tmp_path, "name: demo\ntrain:\n  optim:\n    lr_sched: cosine\n")
    with pytest.raises(MirrorTrainError) as e:
        load_config(Run, path)
    msg = str(e.value)
    assert str(path) in msg and "'train.optim.lr_sched'" in msg and "did you mean 'train.optim.lr_schedule'" in msg
    assert "lr, lr_schedule, betas" in msg
    with pytest.raises(MirrorTrainError, match=r"unknown key 'nme' \(did you mean 'name'\?\).*top level"):
        load_config(Run, write(tmp_path, "nme: demo\n"))
    with pytest.raises(MirrorTrainError, match=r"override 'train.stpes=1'.*'train.stpes'.*did you mean 'train.steps'"):
        load_config(Run, None, ["name=x", "train.stpes=1"])
    with pytest.raises(MirrorTrainError, match="'train.steps' is a single int setting"):
        load_config(Run, None, ["train.steps.x=1"])


def test_wrong_types(tmp_path):
    cases = {
        "train:\n  steps: ten\n": "train.steps: expected int, got 'ten' (str)",
        "train:\n  steps: 1.5\n": "train.steps: expected int, got 1.5 (float)",
        "train:\n  bf16: 'yes'\n": "train.bf16: expected bool, got 'yes' (str)",
        "train:\n  layers: [1, x]\n": "train.layers[1]: expected int, got 'x' (str)",
        "train:\n  resume: 3\n": "train.resume: expected Path, got 3 (int)",
        "train: 5\n": "train: expected a mapping (Train), got 5 (int)",
        "name: null\n": "name: expected str, got null",
        "name: no\n": "name: expected str, got False (bool; YAML reads yes/no/on/off as booleans: quote a word",
    }
    for body, expected in cases.items():
        with pytest.raises(MirrorTrainError, match=re.escape(expected)):
            load_config(Run, write(tmp_path, "name: a\n" + body if "name" not in body else body))
    with pytest.raises(MirrorTrainError, match=r"override 'train.optim.lr=fast': train.optim.lr: expected float"):
        load_config(Run, None, ["name=x", "train.optim.lr=fast"])
    assert load_config(Run, write(tmp_path, "name: a\ntrain:\n  bf16: yes\n")).train.bf16 is True  # YAML 1.1 bool


def test_literal_violation():
    with pytest.raises(MirrorTrainError, match=r"train.optim.lr_schedule: expected one of 'cosine', 'constant'"):
        config_from_dict(Run, {"name": "a", "train": {"optim": {"lr_schedule": "linear"}}})


def test_missing_file(tmp_path):
    with pytest.raises(MirrorTrainError, match="cannot read config file .*nope.yaml"):
        load_config(Run, tmp_path / "nope.yaml")


def test_yaml_syntax_error(tmp_path):
    path = write(tmp_path, "name: demo\ntrain:\n  steps: [1, 2\n  bf16: true\n")
    with pytest.raises(MirrorTrainError, match=r"run.yaml: invalid YAML at line \d+, column \d+") as e:
        load_config(Run, path)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)


def test_top_level_not_mapping(tmp_path):
    with pytest.raises(MirrorTrainError, match="top level must be a mapping"):
        load_config(Run, write(tmp_path, "- a\n- b\n"))


def test_validate_called():
    with pytest.raises(MirrorTrainError, match=r"^config: train.optim: lr must be positive, got -1.0$"):
        config_from_dict(Run, {"name": "a", "train": {"optim": {"lr": -1}}})
    with pytest.raises(MirrorTrainError, match="lr must be positive"):
        load_config(Run, None, ["name=a", "train.optim.lr=0"])


def test_missing_required(tmp_path):
    with pytest.raises(MirrorTrainError, match=r"run.yaml: missing required setting\(s\): name"):
        load_config(Run, write(tmp_path, "seed: 1\n"))


def test_a_text_override_takes_the_word_as_written():
    """`train.mixed_precision=no` (the word YAML reads as false) sets the text "no"; numbers stay numbers."""
    from mirror_train.proxy_training import ProxyRunConfig

    cfg = load_config(ProxyRunConfig, None, ["train.mixed_precision=no", "data.dtype=float32"])
    assert cfg.train.mixed_precision == "no" and cfg.data.dtype == "float32"
    assert load_config(ProxyRunConfig, None, ["train.mixed_precision=null"]).train.mixed_precision is None
    with pytest.raises(MirrorTrainError, match="optim.lr"):
        load_config(ProxyRunConfig, None, ["optim.lr=yes"])  # a number setting does not take a word
