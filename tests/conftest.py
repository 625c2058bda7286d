"""Shared fixtures: tiny random models (fast tier), the real testbed (marked `testbed`), the shared data."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from mirror_train.random_models import (  # noqa: F401  (the tests import them from here)
    CHAT_TEMPLATE,
    save_tiny_target,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
)

# A hub id that does not exist must fail fast here, not wait on a network this machine does not have.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED


@pytest.fixture(scope="session")
def testbed_path() -> Path:
    from mirror_train.testbed import fetch_testbed

    return fetch_testbed()


@pytest.fixture(scope="session")
def testbed_target(testbed_path):
    from mirror_train.target import Target

    return Target.load(str(testbed_path))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a tokenizer and chat template, saved like any HF model directory."""
    return save_tiny_target(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    from mirror_train.target import Target

    return Target.load(str(tiny_model_dir))


@pytest.fixture(params=["x86-64-v3", "x86-64"])
def other_kernel_build(request, monkeypatch, tmp_path):
    """The row-exact kernels rebuilt, for one test, as the AVX2 machines this project runs on (no AVX-512) and plain
    x86-64 build them (-march=x86-64-v3, -march=x86-64): their own code paths, checked like the native build."""
    from mirror_train import kernels

    if platform.machine() not in ("x86_64", "AMD64") or not kernels.available():
        pytest.skip("x86-64 builds")
    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))
    monkeypatch.setenv("MIRROR_TRAIN_KERNEL_ARCH", request.param)
    kernels._library.cache_clear()
    try:
        assert kernels.available()
        yield request.param
    finally:
        kernels._library.cache_clear()


# Why a bit-exactness test of low-precision windows skips on some machines (Target.exact_windows).
INEXACT_GEMMS = (
    "this machine's bf16 matmuls round a row differently by the row count (Target.exact_windows is False): "
    "bit-exact windows need row-invariant GEMMs, as on AMX CPUs"
)
