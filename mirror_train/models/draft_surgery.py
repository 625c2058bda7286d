"""Surgery between a target and its draft: a draft built from a Llama-shaped target's own layers, the draft's main
stream as a plain `LlamaForCausalLM` (for transformers' assisted generation), and the check that a draft fits a
target.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from mirror_train.errors import MirrorTrainError
from mirror_train.models.drafter_config import MirrorDrafterConfig
from mirror_train.signature import TargetSignature
from mirror_train.target import Target, check_exit_layer


def build_from_target(
    cls,
    target_model,
    num_layers: int,
    num_streams: int = 1,
    num_stream_layers: int = 1,
    draft_vocab: Sequence[int] | torch.Tensor | None = None,
    feature_conditioning: str = "none",
    target_exit_layer: int | None = None,
    tokenizer=None,
    source_layers: str | Sequence[int] = "first",
):
    """A `cls` (MirrorDrafterForCausalLM) initialised from a Llama-shaped transformers target (or a `Target`): its
    embeddings, `num_layers` of its decoder layers (`source_layers`: "first", "last", or their 1-based numbers), its
    final norm and its LM head (only the `draft_vocab` rows when given: a list of target ids, which becomes `d2t`).
    `target_exit_layer` (ℓe, default N/2) is for feature conditioning. With a tokenizer, the target's signature is
    stored in the config for `check_compatible`.
    """
    model, tokenizer = _unwrap_target(target_model, tokenizer)
    tc = model.config
    decoder = model.get_decoder()
    n = len(decoder.layers)
    _check_llama_shaped(tc)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= n:
        raise MirrorTrainError(f"num_layers must be in 1..{n} (the target has {n} layers), got {num_layers!r}")
    sources = pick_layers(source_layers, num_layers, n)
    head = model.get_output_embeddings().weight  # (V, H)
    if draft_vocab is not None:
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
        if len(draft_vocab) == 0 or len(set(draft_vocab.tolist())) != len(draft_vocab):
            raise MirrorTrainError("draft_vocab must be a non-empty list of distinct target token ids")
        if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= head.shape[0]:
            raise MirrorTrainError(f"draft_vocab holds ids outside the target's vocabulary 0..{head.shape[0] - 1}")
    conditioned = feature_conditioning == "target_hidden"
    if conditioned:
        target_exit_layer = check_exit_layer(n // 2 if target_exit_layer is None else target_exit_layer, n)
    signature = None
    if tokenizer is not None:
        signature = TargetSignature.of(tc, tokenizer, getattr(tc, "name_or_path", "") or "unknown").to_dict()

    config = MirrorDrafterConfig(
        vocab_size=head.shape[0],
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        hidden_act=tc.hidden_act,
        rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=copy.deepcopy(tc.rope_parameters),
        max_position_embeddings=tc.max_position_embeddings,
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)) and draft_vocab is None,
        attention_bias=bool(getattr(tc, "attention_bias", False)),
        mlp_bias=bool(getattr(tc, "mlp_bias", False)),
        pad_token_id=getattr(tc, "pad_token_id", None),
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        num_streams=num_streams,
        num_stream_layers=num_stream_layers,
        draft_vocab_size=None if draft_vocab is None else len(draft_vocab),
        feature_conditioning=feature_conditioning,
        target_hidden_size=tc.hidden_size if conditioned else None,
        target_exit_layer=target_exit_layer,
        target=signature,
    )
    draft = cls(config).to(device=head.device, dtype=head.dtype)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(decoder.embed_tokens.weight)
        for i, number in enumerate(sources):
            _load_layer(draft.layers[i], decoder.layers[number - 1], number)
        draft.norm.load_state_dict(decoder.norm.state_dict())
        if draft_vocab is not None:
            draft.lm_head.weight.copy_(head[draft_vocab.to(head.device)])
            draft.d2t.copy_(draft_vocab)
        elif not config.tie_word_embeddings:
            draft.lm_head.weight.copy_(head)
    return draft.eval()


def pick_layers(source_layers: str | Sequence[int], num_layers: int, n: int) -> list[int]:
    """The 1-based numbers of the target layers a `num_layers`-layer draft starts from, of the target's `n`."""
    if source_layers == "first":
        return list(range(1, num_layers + 1))
    if source_layers == "last":
        return list(range(n - num_layers + 1, n + 1))
    numbers = [] if isinstance(source_layers, str) else list(source_layers)
    valid = all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n for k in numbers)
    if len(numbers) != num_layers or not valid:
        raise MirrorTrainError(
            f"source_layers must be 'first', 'last' or {num_layers} target layer numbers in 1..{n}, "
            f"got {source_layers!r}"
        )
    return numbers


@torch.no_grad()
def plain_llama(draft):
    """The main stream as a plain `LlamaForCausalLM` over the whole vocabulary, for transformers' own assisted
    generation (`generate(assistant_model=...)`), which knows nothing of streams or reduced heads.

    Same embeddings, layers (a multi-stream layer's main stream is a Llama layer) and norm; the head is scattered
    to the full vocabulary through d2t, ids outside the draft's vocabulary get a zero row (logit 0, far below a
    real top logit, so practically never proposed). Feature-conditioned drafts are refused: transformers cannot
    feed them the target's hidden states.
    """
    c = draft.config
    if c.feature_conditioning != "none":
        raise MirrorTrainError("a feature-conditioned draft has no plain-LM form (it reads the target's states)")
    llama_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )
    llama = LlamaForCausalLM(llama_config).to(device=draft.device, dtype=draft.dtype).eval()
    state = {
        f"model.{k}": v for k, v in draft.state_dict().items() if k.split(".")[0] in ("embed_tokens", "layers", "norm")
    }
    head = torch.zeros_like(llama.lm_head.weight)
    rows = draft.d2t if draft.d2t is not None else torch.arange(c.vocab_size, device=head.device)
    head[rows] = draft.lm_head.weight
    state["lm_head.weight"] = head
    missing, unexpected = llama.load_state_dict(state, strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise MirrorTrainError(f"draft → Llama: missing {missing}, unexpected {unexpected}")
    return llama


def check_compatible(drafter, target_model, tokenizer=None) -> None:
    """Raise MirrorTrainError unless `drafter` (a MirrorDrafterForCausalLM) can draft for `target_model` (a
    transformers model or a `Target`).

    Checks the vocabulary size, the feature-conditioning target layer, and with a tokenizer the stored target
    signature (tokenizer fingerprint included; a draft without a stored signature gets the vocabulary check only).
    """
    model, tokenizer = _unwrap_target(target_model, tokenizer)
    dc, tc = drafter.config, model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    if dc.vocab_size != vocab:
        raise MirrorTrainError(
            f"the draft's vocabulary has {dc.vocab_size} ids, the target's {vocab}: they do not share a tokenizer"
        )
    if dc.feature_conditioning == "target_hidden":
        n = len(model.get_decoder().layers)
        if dc.target_hidden_size != tc.hidden_size or not 1 <= (dc.target_exit_layer or 0) < n:
            raise MirrorTrainError(
                f"the draft reads a target hidden state of width {dc.target_hidden_size} at layer "
                f"{dc.target_exit_layer}; the target has width {tc.hidden_size} and {n} layers"
            )
    if tokenizer is None:
        return
    if dc.target is None:
        if len(tokenizer) > vocab:
            raise MirrorTrainError(f"the tokenizer has {len(tokenizer)} tokens, more than the draft's {vocab} ids")
        return
    here = TargetSignature.of(tc, tokenizer, getattr(tc, "name_or_path", "") or "unknown")
    TargetSignature.from_dict(dc.target).check_matches(here, what="draft model")


def _unwrap_target(target_model, tokenizer):
    """A transformers model and a tokenizer from either a model or a mirror_train `Target`."""
    if isinstance(target_model, Target):
        return target_model.model, tokenizer if tokenizer is not None else target_model.tokenizer
    return target_model, tokenizer


def _check_llama_shaped(tc) -> None:
    """Refuse target families whose layers load into Llama's names but compute something else."""
    if tc.model_type.startswith("gemma"):
        raise MirrorTrainError(
            f"cannot build a draft from a {tc.model_type} target: it scales embeddings and uses (1 + w) norms"
        )
    sliding = getattr(tc, "sliding_window", None) and getattr(tc, "use_sliding_window", True)
    if sliding or "sliding_attention" in (getattr(tc, "layer_types", None) or ()):
        raise MirrorTrainError(f"cannot build a draft from a {tc.model_type} target with sliding-window attention")
    if getattr(tc, "final_logit_softcapping", None):
        raise MirrorTrainError(f"cannot build a draft from a {tc.model_type} target with logit soft-capping")


def _load_layer(draft_layer: nn.Module, target_layer: nn.Module, number: int) -> None:
    try:
        draft_layer.load_state_dict(target_layer.state_dict())
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise MirrorTrainError(f"target layer {number} is not Llama-shaped: {reason}") from None
