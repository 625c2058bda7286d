"""Shared fixtures: tiny random models (fast tier), the real testbed (marked `testbed`), the shared data."""

from __future__ import annotations

import os
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


# Why a bit-exactness test of low-precision windows skips on some machines (Target.exact_windows).
INEXACT_GEMMS = (
    "this machine's bf16 matmuls round a row differently by the row count (Target.exact_windows is False): "
    "bit-exact windows need row-invariant GEMMs, as on AMX CPUs"
)
