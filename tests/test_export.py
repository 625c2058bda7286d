"""Exported artifacts: signatures, atomic save, checked load, model card, and the Hub push up to the HTTP boundary."""

import base64
import dataclasses
import json
import logging
import shutil
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub
import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from mirror_train import __version__, export
from mirror_train import signature as sig
from mirror_train.errors import MirrorTrainError
from mirror_train.export import load_artifact, model_card, push_to_hub, save_artifact
from mirror_train.signature import TargetSignature

TOKEN = "hf_sEcReT0123456789"


def make_tokenizer(extra_tokens=(), pad="<pad>", chat_template=None):
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", "hello", "world", *extra_tokens])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token=pad
    )
    tok.chat_template = chat_template
    return tok


def make_config(**overrides):
    sizes = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=8)
    return LlamaConfig(**{**sizes, "num_key_value_heads": 2, **overrides})


@pytest.fixture
def target():
    return TargetSignature.of(make_config(), make_tokenizer(chat_template="{{ messages }}"), "org/tiny-llama", "main")


@pytest.fixture
def state_dict():
    torch.manual_seed(0)
    return {"head.weight": torch.randn(8, 16), "head.bias": torch.zeros(8, dtype=torch.bfloat16)}


def save(path, target, state_dict, kind="proxy_head", **kw):
    return save_artifact(
        path, kind=kind, config={"exit_layer": 1, "kappa": 4}, state_dict=state_dict, target=target, **kw
    )


def snapshot(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


# --- signature ---------------------------------------------------------------------------------------------------


def test_signature_of_tiny_target(target):
    assert (target.model_type, target.num_layers, target.hidden_size, target.vocab_size) == ("llama", 2, 16, 8)
    assert (target.name_or_path, target.revision) == ("org/tiny-llama", "main")
    assert TargetSignature.from_dict(json.loads(json.dumps(target.to_dict()))) == target
    # Pinned: the fingerprint must not depend on the process (hash seeds, dict order) or it would reject good loads.
    assert sig.tokenizer_fingerprint(make_tokenizer()) == "4543da28cf3951de"


def test_fingerprint_is_vocab_and_special_tokens_not_chat_template():
    base = make_tokenizer(chat_template="A")
    assert sig.tokenizer_fingerprint(make_tokenizer(chat_template="B")) == sig.tokenizer_fingerprint(base)
    assert sig.chat_template_fingerprint(make_tokenizer(chat_template="B")) != sig.chat_template_fingerprint(base)
    assert sig.chat_template_fingerprint(make_tokenizer()) is None
    assert sig.tokenizer_fingerprint(make_tokenizer(extra_tokens=["!"])) != sig.tokenizer_fingerprint(base)
    assert sig.tokenizer_fingerprint(make_tokenizer(pad="</s>")) != sig.tokenizer_fingerprint(base)


def test_check_matches_ignores_name_revision_and_chat_template(target):
    elsewhere = dataclasses.replace(
        target, name_or_path="/models/tiny", revision="abc123", chat_template_fingerprint="0" * 16
    )
    target.check_matches(elsewhere, "proxy head")


def test_check_matches_names_every_differing_field(target):
    other = TargetSignature.of(make_config(num_hidden_layers=3, vocab_size=9), make_tokenizer(["!"]), "org/other")
    with pytest.raises(MirrorTrainError) as err:
        target.check_matches(other, "proxy head x")
    msg = str(err.value)
    assert "proxy head x" in msg and "org/tiny-llama" in msg and "org/other" in msg
    for field in ("num_layers: 2 vs 3", "vocab_size: 8 vs 9", "tokenizer_fingerprint"):
        assert field in msg
    assert "hidden_size" not in msg and "model_type" not in msg


def test_from_dict_rejects_incomplete_signature(target):
    d = target.to_dict()
    del d["hidden_size"]
    with pytest.raises(MirrorTrainError, match="hidden_size"):
        TargetSignature.from_dict(d)


# --- save / load -------------------------------------------------------------------------------------------------


def test_round_trip(tmp_path, target, state_dict):
    out = save(tmp_path / "head", target, state_dict, extra_files={"notes/train.yaml": "lr: 1e-3\n", "b.bin": b"\0"})
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "README.md", "b.bin", "mirror_config.json", "model.safetensors", "notes/train.yaml"
    ]  # fmt: skip
    meta, loaded, stored = load_artifact(out, expected_kind="proxy_head", target=target)
    assert loaded.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert meta["config"] == {"exit_layer": 1, "kappa": 4} and meta["kind"] == "proxy_head"
    assert meta["format_version"] == 1 and meta["library"]["mirror_train"] == __version__
    assert set(meta["library"]) == {"mirror_train", "torch", "transformers"}
    datetime.fromisoformat(meta["created"])
    assert stored == target
    assert (out / "README.md").read_text().startswith("---\nlibrary_name: mirror-train\n")


def test_tied_and_non_contiguous_tensors_save(tmp_path, target):
    embed = torch.randn(8, 16)
    tied = {"embed.weight": embed, "lm_head.weight": embed, "proj.weight": embed.t(), "row": embed[2]}
    _, loaded, _ = load_artifact(save(tmp_path / "d", target, tied, kind="draft"))
    for name, tensor in tied.items():
        assert torch.equal(loaded[name], tensor)


def test_overwrite_replaces_the_old_artifact_and_leaves_nothing_behind(tmp_path, target, state_dict):
    save(tmp_path / "head", target, state_dict, extra_files={"old.txt": "x"})
    save(tmp_path / "head", target, {"w": torch.ones(2)})
    assert [p.name for p in tmp_path.iterdir()] == ["head"]
    assert not (tmp_path / "head" / "old.txt").exists()
    assert torch.equal(load_artifact(tmp_path / "head")[1]["w"], torch.ones(2))


def test_failed_overwrite_keeps_the_old_artifact(tmp_path, target, state_dict, monkeypatch):
    out = save(tmp_path / "head", target, state_dict)
    before = snapshot(out)

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")  # a partial write inside the temp dir, then the crash
        raise OSError("disk full")

    monkeypatch.setattr(export, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path / "head", target, {"w": torch.ones(2)})
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["head"]


def test_refuses_to_replace_a_directory_that_is_not_an_artifact(tmp_path, target, state_dict):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "thesis.tex").write_text("precious")
    with pytest.raises(MirrorTrainError, match="not a mirror-train artifact"):
        save(tmp_path / "work", target, state_dict)
    assert (tmp_path / "work" / "thesis.tex").read_text() == "precious"


def _corrupt_json(p):
    (p / "mirror_config.json").write_text("{not json")


def _future_format(p):
    meta = json.loads((p / "mirror_config.json").read_text())
    (p / "mirror_config.json").write_text(json.dumps({**meta, "format_version": 2}))


def _truncate_weights(p):
    (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:40])


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda p: p.rename(p.with_name("gone")), "does not exist"),
        (lambda p: shutil.rmtree(p) or p.write_text("x"), "not a directory"),
        (lambda p: (p / "mirror_config.json").unlink(), "not a mirror-train artifact"),
        (_corrupt_json, "mirror_config.json is corrupt"),
        (_future_format, "format_version 2"),
        (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
        (_truncate_weights, "model.safetensors is corrupt"),
    ],
    ids=["missing", "file", "no-config", "bad-json", "format-version", "no-weights", "bad-weights"],
)
def test_load_errors(tmp_path, target, state_dict, damage, expected):
    out = save(tmp_path / "head", target, state_dict)
    damage(out)
    with pytest.raises(MirrorTrainError, match=expected):
        load_artifact(out)


def test_load_rejects_the_wrong_kind(tmp_path, target, state_dict):
    out = save(tmp_path / "d", target, state_dict, kind="draft")
    with pytest.raises(MirrorTrainError, match="is a draft, expected a proxy_head"):
        load_artifact(out, expected_kind="proxy_head")


def test_load_rejects_the_wrong_target(tmp_path, target, state_dict):
    out = save(tmp_path / "head", target, state_dict)
    other = TargetSignature.of(make_config(hidden_size=32), make_tokenizer(), "/local/bigger")
    with pytest.raises(MirrorTrainError, match=r"hidden_size: 16 vs 32"):
        load_artifact(out, target=other)


# --- model card --------------------------------------------------------------------------------------------------


def front_matter(card):
    return yaml.safe_load(card.split("---\n")[1])


def test_model_card(target):
    card = model_card(
        kind="draft", title="Tiny draft", target=target, config={"k": 1}, results_markdown="| a |\n|---|\n| 1 |",
        usage="print('hi')",
    )  # fmt: skip
    assert front_matter(card) == {
        "library_name": "mirror-train", "tags": ["speculative-decoding", "mirror-sd", "draft"],
        "base_model": "org/tiny-llama",
    }  # fmt: skip
    assert "# Tiny draft" in card and "| num_layers | `2` |" in card and "| a |\n|---|\n| 1 |" in card
    assert '"k": 1' in card and "print('hi')" in card


def test_model_card_without_hub_id_or_results(target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base").mkdir(parents=True)
    for local in ("runs/base", "/abs/path", "plain"):
        card = model_card(
            kind="proxy_head", title="t", target=dataclasses.replace(target, name_or_path=local), config={},
            results_markdown=None, usage="",
        )  # fmt: skip
        assert "base_model" not in front_matter(card) and "Not measured." in card


# --- push --------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_token_env(monkeypatch):
    for var in export.TOKEN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def artifact(tmp_path, target, state_dict):
    return save(tmp_path / "head", target, state_dict)


def assert_token_hidden(capsys, caplog, *texts):
    out, err = capsys.readouterr()
    for text in (out, err, caplog.text, *texts):
        assert TOKEN not in text


def test_push_dry_run_lists_files_without_token_or_network(artifact, no_token_env, monkeypatch):
    monkeypatch.setattr(export, "HfApi", None)  # any attempt to build a client would fail
    text = push_to_hub(artifact, "me/tiny-head", dry_run=True, private=True)
    assert "me/tiny-head" in text and "private" in text and "3 files" in text and "HF_TOKEN" in text
    for name in ("README.md", "mirror_config.json", "model.safetensors"):
        assert name in text
    assert f"model.safetensors   {(artifact / 'model.safetensors').stat().st_size} B" in text


def test_push_validates_the_artifact_and_repo_id(artifact, tmp_path):
    with pytest.raises(MirrorTrainError, match="not a mirror-train artifact"):
        push_to_hub(tmp_path, "me/x", dry_run=True)
    with pytest.raises(MirrorTrainError, match="invalid Hub repo id"):
        push_to_hub(artifact, "me/x/y", dry_run=True)


def test_push_without_token_says_which_variable_to_set(artifact, no_token_env):
    with pytest.raises(MirrorTrainError, match="set HF_TOKEN"):
        push_to_hub(artifact, "me/tiny-head")


class FakeHub(BaseHTTPRequestHandler):
    """Just enough of the Hub for create_repo + upload_folder: every file is declared 'regular' (no LFS/xet)."""

    requests: list
    fail_create = False

    def do_GET(self):  # huggingface_hub's best-effort side fetches (e.g. its agent registry)
        self.reply({"error": "not here"}, status=404)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        if self.path == "/api/validate-yaml":
            return self.reply({"errors": [], "warnings": []})
        if self.path == "/api/repos/create":
            if self.fail_create:
                return self.reply({"error": "Internal Error"}, status=500)
            req = json.loads(body)
            return self.reply({"url": f"{self.server.url}/{req['organization']}/{req['name']}"})
        if self.path.endswith("/preupload/main"):
            files = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in json.loads(body)["files"]
            ]
            return self.reply({"files": files})
        if self.path.endswith("/commit/main"):
            return self.reply({"commitUrl": f"{self.server.url}/c/1", "commitOid": "1" * 40, "pullRequestUrl": None})
        self.reply({"error": f"unexpected {self.path}"}, status=404)

    def reply(self, payload, status=200):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch):
    handler = type("Handler", (FakeHub,), {"requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    # The fake server becomes "the Hub" for everything huggingface_hub sends (conftest's offline mode lifted for it).
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield server, handler
    server.shutdown()
    server.server_close()


def test_push_uploads_through_the_real_client(artifact, hub, monkeypatch, capsys, caplog):
    server, handler = hub
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    url = push_to_hub(artifact, "me/tiny-head", private=True, commit_message="first head")
    assert url == f"{server.url}/me/tiny-head"

    paths = [path for path, _, _ in handler.requests]
    repo = "/api/models/me/tiny-head"
    assert paths == ["/api/repos/create", "/api/validate-yaml", f"{repo}/preupload/main", f"{repo}/commit/main"]
    for _, headers, _ in handler.requests:
        assert headers["authorization"] == f"Bearer {TOKEN}"
    create = json.loads(handler.requests[0][2])
    assert (create["organization"], create["name"], create["visibility"], create["type"]) == (
        "me", "tiny-head", "private", "model"
    )  # fmt: skip
    assert json.loads(handler.requests[1][2])["content"] == (artifact / "README.md").read_text()
    lines = [json.loads(line) for line in handler.requests[3][2].splitlines()]
    assert lines[0] == {"key": "header", "value": {"summary": "first head", "description": ""}}
    sent = {op["value"]["path"]: base64.b64decode(op["value"]["content"]) for op in lines[1:]}
    assert sent == snapshot(artifact)
    assert_token_hidden(capsys, caplog)


def test_push_http_error_is_one_line_without_token(artifact, hub, capsys, caplog):
    server, handler = hub
    handler.fail_create = True
    caplog.set_level(logging.DEBUG)
    with pytest.raises(MirrorTrainError, match="push of .* to me/tiny-head failed: .*500") as err:
        push_to_hub(artifact, "me/tiny-head", token=TOKEN)
    assert "\n" not in str(err.value)
    assert handler.requests[0][1]["authorization"] == f"Bearer {TOKEN}"
    assert_token_hidden(capsys, caplog, str(err.value), repr(err.value))


def test_push_with_injected_api_and_redacted_errors(artifact):
    class RecordingApi:
        token = TOKEN

        def __init__(self):
            self.calls = []

        def create_repo(self, repo_id, **kw):
            self.calls.append(("create_repo", repo_id, kw))
            return f"https://hub.example/{repo_id}"

        def upload_folder(self, **kw):
            self.calls.append(("upload_folder", kw))
            if kw["repo_id"] == "me/broken":
                raise RuntimeError(f"server echoed Bearer {TOKEN}\nsecond line")

    api = RecordingApi()
    assert push_to_hub(artifact, "me/head", api=api) == "https://hub.example/me/head"
    assert api.calls[0] == ("create_repo", "me/head", {"private": False, "exist_ok": True, "repo_type": "model"})
    assert api.calls[1][1]["folder_path"] == str(artifact)
    assert api.calls[1][1]["commit_message"] == "Upload mirror-train proxy_head for org/tiny-llama"
    with pytest.raises(MirrorTrainError) as err:
        push_to_hub(artifact, "me/broken", api=api)
    assert TOKEN not in str(err.value) and "<token>" in str(err.value) and "second line" not in str(err.value)


def test_an_artifact_for_the_testbed_names_the_upstream_model_and_its_weights():
    """The word testbed means nothing on the Hub: signature and card name SmolLM2-135M-Instruct and the GGUF hash."""
    from mirror_train.export import model_card
    from mirror_train.target import Target
    from mirror_train.testbed import GGUF_SHA256
    from tests.conftest import tiny_model, tiny_tokenizer

    signature = Target(tiny_model(), tiny_tokenizer(), name_or_path="testbed").signature()
    assert signature.name_or_path.startswith("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert GGUF_SHA256[:16] in signature.name_or_path
    card = model_card(kind="draft", title="t", target=signature, config={}, results_markdown=None, usage="")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in card
