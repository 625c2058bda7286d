"""Self-describing exported artifacts: proxy heads and drafts that know which target model they belong to.

An artifact is a directory: `mirror_config.json` (kind, config, target signature, library versions),
`model.safetensors` (the weights), `README.md` (a Hugging Face model card) and any extra files. A proxy head reads
hidden states of one specific target, and a draft proposes token ids of one specific tokenizer, so loading either
against a different target fails loudly here instead of silently producing garbage acceptance rates.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml
from huggingface_hub import HfApi
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects, validate_repo_id
from safetensors.torch import load_file, save_file

from mirror_train import __version__
from mirror_train.errors import MirrorTrainError
from mirror_train.signature import TargetSignature

FORMAT_VERSION = 1
CONFIG_FILE = "mirror_config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
TOKEN_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")

_KIND_DESCRIPTIONS = {
    "proxy_head": "An early-exit proxy head for Mirror Speculative Decoding. It reads the hidden state of an "
    "intermediate layer of the target model and predicts the target's next-token distribution, so the draft can "
    "start speculating on its top candidates while the target is still running its remaining layers.",
    "draft": "A draft model for Mirror Speculative Decoding. It runs concurrently with the target model (typically on "
    "a second device) and proposes several tokens per step that the target then verifies.",
}
_DEFAULT_USAGE = """from mirror_train.export import load_artifact

config, state_dict, target = load_artifact("path/to/this/repo", expected_kind="{kind}")"""


def _library_versions() -> dict:
    try:
        transformers_version = importlib.metadata.version("transformers")  # no import: it is slow
    except importlib.metadata.PackageNotFoundError:
        transformers_version = None
    return {"mirror_train": __version__, "torch": torch.__version__, "transformers": transformers_version}


def _savable(state_dict: dict) -> dict[str, torch.Tensor]:
    """CPU, contiguous, no two tensors sharing memory: safetensors refuses tied weights, so repeats are cloned."""
    seen, out = set(), {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise MirrorTrainError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        out[name] = tensor.contiguous()
    return out


def _fsync(path: Path) -> None:
    if os.name != "posix" and path.is_dir():
        return  # directories cannot be opened for fsync on Windows
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(new: Path, out: Path) -> None:
    """Put `new` at `out`. Between the two renames `out` is briefly absent, never half-written."""
    if out.exists():
        backup = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, backup)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(backup, out)
            raise
        shutil.rmtree(backup)
    else:
        os.rename(new, out)
    _fsync(out.parent)


@dataclass(frozen=True)
class CardText:
    """What a model card says beyond the artifact's own config and target: a title, how to use it, results."""

    title: str
    usage: str
    results_markdown: str | None = None


def save_artifact(
    out_dir,
    *,
    kind: str,
    config: dict,
    state_dict: dict[str, torch.Tensor],
    target: TargetSignature,
    card: CardText | None = None,
    extra_files: dict[str, str | bytes] | None = None,
) -> Path:
    """Write an artifact atomically: everything goes into a sibling temp dir, which then replaces `out_dir`.

    An existing `out_dir` is replaced only if it is an artifact itself (or empty), so a mistyped path cannot wipe an
    unrelated directory. The model card (README.md) is built from `card`, or a default one.
    """
    out = Path(out_dir).absolute()
    if not kind:
        raise MirrorTrainError("artifact kind must be a non-empty string")
    if out.exists() and not out.is_dir():
        raise MirrorTrainError(f"cannot write artifact to {out}: it exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / CONFIG_FILE).is_file():
        raise MirrorTrainError(f"refusing to replace {out}: it is not empty and not a mirror-train artifact")
    extra_files = extra_files or {}
    for name in extra_files:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or name in (CONFIG_FILE, WEIGHTS_FILE, CARD_FILE):
            raise MirrorTrainError(f"extra file name {name!r} must be a relative, non-reserved path in the artifact")
    try:
        meta = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "kind": kind,
                "config": config,
                "target": target.to_dict(),
                "library": _library_versions(),
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            },
            indent=2,
        )
    except TypeError as err:
        raise MirrorTrainError(f"artifact config is not JSON-serialisable: {err}") from None
    card = card or CardText(f"{kind} for {target.name_or_path}", _DEFAULT_USAGE.format(kind=kind))
    readme = model_card(
        kind=kind,
        title=card.title,
        target=target,
        config=config,
        results_markdown=card.results_markdown,
        usage=card.usage,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()  # not mkdtemp: its 0700 mode would end up on the artifact
    try:
        save_file(_savable(state_dict), str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "mirror_kind": kind})
        _fsync(tmp / WEIGHTS_FILE)
        for name, data in extra_files.items():
            _write(tmp / name, data)
        _write(tmp / CARD_FILE, readme)
        _write(tmp / CONFIG_FILE, meta)
        _fsync(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_artifact(
    path, *, expected_kind: str | None = None, target: TargetSignature | None = None
) -> tuple[dict, dict[str, torch.Tensor], TargetSignature]:
    """Read an artifact back as (mirror_config, state_dict, stored target), checking it before the weights load.

    Tied tensors come back as separate tensors; re-tie them in the model if it needs that.
    """
    path = Path(path)
    if not path.exists():
        raise MirrorTrainError(f"no artifact at {path}: the path does not exist")
    if not path.is_dir():
        raise MirrorTrainError(f"{path} is not a directory; an artifact is a directory holding {CONFIG_FILE}")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise MirrorTrainError(f"{path} is not a mirror-train artifact (no {CONFIG_FILE})")
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MirrorTrainError(f"{config_path} is corrupt: {err}") from None
    if not isinstance(meta, dict) or not {"format_version", "kind", "config", "target"} <= meta.keys():
        raise MirrorTrainError(f"{config_path} is corrupt: expected format_version, kind, config and target")
    if meta["format_version"] != FORMAT_VERSION:
        raise MirrorTrainError(
            f"{path} has format_version {meta['format_version']!r}; this mirror-train ({__version__}) reads "
            f"{FORMAT_VERSION}. Upgrade mirror-train or re-export the artifact."
        )
    if expected_kind is not None and meta["kind"] != expected_kind:
        raise MirrorTrainError(f"{path} is a {meta['kind']}, expected a {expected_kind}")
    try:
        stored = TargetSignature.from_dict(meta["target"])
    except MirrorTrainError as err:
        raise MirrorTrainError(f"{config_path} is corrupt: {err}") from None
    if target is not None:
        stored.check_matches(target, what=f"{meta['kind']} {path}")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise MirrorTrainError(f"{path} is incomplete: no {WEIGHTS_FILE}")
    try:
        state_dict = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error type, OSError or ValueError depending on the damage
        raise MirrorTrainError(f"{weights} is corrupt: {err}") from None
    return meta, state_dict, stored


def _cell(value) -> str:
    return "—" if value is None else "`" + str(value).replace("|", "\\|") + "`"


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not Path(name).exists()


def model_card(
    *, kind: str, title: str, target: TargetSignature, config: dict, results_markdown: str | None, usage: str
) -> str:
    """A Hugging Face model card (README.md) with front matter the Hub indexes."""
    front = {"library_name": "mirror-train", "tags": ["speculative-decoding", "mirror-sd", kind]}
    hub_id = target.name_or_path.split(" (")[0]  # the testbed's upstream name carries which weights in brackets
    if _looks_like_hub_id(hub_id):
        front["base_model"] = hub_id
    rows = "\n".join(f"| {key} | {_cell(value)} |" for key, value in target.to_dict().items())
    what = _KIND_DESCRIPTIONS.get(kind, f"A {kind} artifact for Mirror Speculative Decoding.")
    return f"""---
{yaml.safe_dump(front, sort_keys=False).strip()}
---

# {title}

## What it is

{what}

## Target model

This artifact only fits the target below: loading it against a model with a different architecture, size or
tokenizer fails instead of running with mismatched weights.

| field | value |
|---|---|
{rows}

## Configuration

```json
{json.dumps(config, indent=2)}
```

## Measured results

{results_markdown.strip() if results_markdown else "Not measured."}

## Usage

```python
{usage.strip()}
```
"""


def _human_size(n: int) -> str:
    size, unit = float(n), "B"
    for bigger in ("kB", "MB", "GB"):
        if size < 1000:
            break
        size, unit = size / 1000, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def push_to_hub(
    artifact_dir,
    repo_id: str,
    *,
    private: bool = False,
    dry_run: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    api=None,
) -> str:
    """Upload a validated artifact to a Hub model repo; returns the repo URL, or with `dry_run` what would be sent.

    The token comes from `token`, else $HF_TOKEN, else $HUGGING_FACE_HUB_TOKEN; it is never printed, logged or put
    in an error message. An injected `api` (an `HfApi`-like object) carries its own credentials.
    """
    meta, _, target = load_artifact(artifact_dir)
    try:
        validate_repo_id(repo_id)
    except ValueError as err:
        raise MirrorTrainError(f"invalid Hub repo id {repo_id!r}: {err}") from None
    folder = Path(artifact_dir)
    token = token or next((os.environ[v] for v in TOKEN_ENV_VARS if os.environ.get(v)), None)

    if dry_run:
        # The same filter upload_folder applies, so the list is what would really be sent.
        rels = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        rels = filter_repo_objects(rels, ignore_patterns=DEFAULT_IGNORE_PATTERNS)
        files = [(rel, (folder / rel).stat().st_size) for rel in rels]
        width = max(len(rel) for rel, _ in files)
        listing = "\n".join(f"  {rel:<{width}}  {_human_size(size)}" for rel, size in files)
        if token:
            auth = "a token is available"
        elif api is not None:
            auth = "the given api's own credentials"
        else:
            auth = f"no token found; a real push needs {TOKEN_ENV_VARS[0]} (or {TOKEN_ENV_VARS[1]}) set"
        return (
            f"Dry run, nothing uploaded. Would push the {meta['kind']} in {folder} to the "
            f"{'private' if private else 'public'} model repo {repo_id}: {len(files)} files, "
            f"{_human_size(sum(size for _, size in files))}\n{listing}\nAuth: {auth}"
        )

    if api is None:
        if not token:
            raise MirrorTrainError(
                f"no Hugging Face token: set {TOKEN_ENV_VARS[0]} (or {TOKEN_ENV_VARS[1]}) to a token with write "
                "access, or pass token="
            )
        api = HfApi(token=token)
    secrets = [s for s in (token, getattr(api, "token", None)) if isinstance(s, str) and s]
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message=commit_message or f"Upload mirror-train {meta['kind']} for {target.name_or_path}",
        )
    except Exception as err:  # huggingface_hub's transport errors changed type across versions (httpx -> httpx2)
        reason = (str(err).strip().splitlines() or [""])[0]
        for secret in secrets:
            reason = reason.replace(secret, "<token>")
        raise MirrorTrainError(f"push of {folder} to {repo_id} failed: {type(err).__name__}: {reason}") from None
    return str(url)
