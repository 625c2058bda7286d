"""Random-weight models and an offline tokenizer, for checks that cannot download (tests, `scripts/gpu_check.py`).

Nothing here is trained: a random target answers with random tokens, which is all that greedy-equality and timing
checks need. `llama_shaped` builds any size (a Llama-3-8B shape for a realistic step time on a GPU).
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
LLAMA3_8B = {  # the shape of meta-llama/Meta-Llama-3-8B
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


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


def save_tiny_target(path, layers: int = 4, vocab: int = 128, hidden: int | None = None, seed: int = 0):
    """A random Llama with a tokenizer and chat template saved like any HF model directory (what recipes read)."""
    tok = tiny_tokenizer(vocab)
    if hidden is None:
        model = tiny_model("llama", layers=layers, vocab=len(tok), seed=seed)
    else:
        shape = {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_attention_heads": max(hidden // 64, 1)}
        model = llama_shaped({"vocab_size": len(tok), "num_hidden_layers": layers, **shape}, "cpu", torch.float32, seed)
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def llama_shaped(shape: dict, device, dtype: torch.dtype, seed: int = 0):
    """A random `LlamaForCausalLM` of the given shape, built directly on `device` in `dtype` (an 8B model never
    exists in float32 or on the CPU first). Weights ~ N(0, 0.02), as transformers initialises them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval().requires_grad_(False)
