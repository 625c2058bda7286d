"""Shared fixtures: tiny random models (fast tier), the real testbed (marked `testbed`), the shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# A hub id that does not exist must fail fast here, not wait on a network this machine does not have.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

SHARED = Path(__file__).resolve().parents[2] / "shared"


def tiny_config(family: str = "llama", layers: int = 4, vocab: int = 128):
    """A few-layer random model config of a given family (no download)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        head_dim=8,
    )
    extra = {
        "llama": {},
        "qwen2": {},
        "qwen3": {},
        "mistral": {"sliding_window": 6},
        "gemma2": {"sliding_window": 6, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 8},
        "gemma3_text": {"sliding_window": 6, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 8},
    }[family]
    return AutoConfig.for_model(family, **common, **extra)


def tiny_model(family: str = "llama", layers: int = 4, vocab: int = 128, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, layers, vocab)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg).eval()


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
