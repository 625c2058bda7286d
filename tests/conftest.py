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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer with a chat template, built offline (unknown words map to <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = "the a of and to in is you that it for on with as are this be what how write explain".split()
    vocab = {w: i for i, w in enumerate(specials + words + [f"w{i}" for i in range(vocab_size)])}
    vocab = {w: i for w, i in vocab.items() if i < vocab_size}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<|end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a tokenizer and chat template, saved like any HF model directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = tiny_tokenizer()
    model = tiny_model("llama", layers=4, vocab=len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    from mirror_train.target import Target

    return Target.load(str(tiny_model_dir))


# Why a bit-exactness test of low-precision windows skips on some machines (Target.exact_windows).
INEXACT_GEMMS = (
    "this machine's bf16 matmuls round a row differently by the row count (Target.exact_windows is False): "
    "bit-exact windows need row-invariant GEMMs, as on AMX CPUs"
)
