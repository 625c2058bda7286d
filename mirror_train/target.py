"""The frozen target model, split at the early exit.

This module alone owns the layer-index convention. Layers are numbered 1..N as in the paper and as in
transformers' `hidden_states` output (`hidden_states[0]` is the embedding output, `hidden_states[ℓ]` the output of
layer ℓ). An exit layer ℓe ∈ 1..N−1 splits a forward into

    prefix(ℓe): embeddings → layers 1..ℓe      → the hidden state at ℓe for every window position
    suffix:     layers ℓe+1..N → final norm → LM head → the final logits

so other work (the proxy head, the channel send) can happen between the two calls. Both halves write the same KV
cache the plain forward would. We run the decoder layers ourselves rather than fork a modeling file, which keeps any
transformers decoder-only model with the usual `model.layers` / `model.norm` / `lm_head` layout working (Llama,
Qwen2/3, Mistral, Gemma families): per-layer attention types (`config.layer_types`: full or sliding) and per-type
rotary tables (Gemma 3) are read from the model, and Gemma's final logit soft-capping is applied.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mirror_train import attention, fused_layer, kv_cache, screened_head, static_step
from mirror_train.alignment import align_parameters
from mirror_train.devices import resolve_device
from mirror_train.errors import MirrorTrainError
from mirror_train.forked_window import ForkedWindow
from mirror_train.signature import TargetSignature
from mirror_train.testbed import resolve_model, upstream_name

_FULL, _SLIDING = "full_attention", "sliding_attention"


def check_exit_layer(exit_layer: int, num_layers: int) -> int:
    """ℓe must leave at least one layer on each side of the split."""
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer <= num_layers - 1:
        raise MirrorTrainError(
            f"exit layer ℓe={exit_layer!r} is outside 1..{num_layers - 1} (the target has {num_layers} layers)"
        )
    return exit_layer


@dataclass
class PrefixState:
    """What the suffix needs to finish a window the prefix started."""

    hidden: torch.Tensor  # (B, T, H): the output of layer ℓe at every window position
    exit_layer: int
    cache: Any
    position_ids: torch.Tensor  # (1, T)
    masks: dict[str, Any]  # attention type → mask, built once for the window
    position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]]  # attention type → (cos, sin)
    static: Any = None  # a window over the static cache: its input buffers (static_step.py)


class Target:
    """A frozen decoder-only LM with prefix/suffix halves, a logit lens and KV-cache rollback."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, name_or_path: str | None = None):
        self.model = model.eval().requires_grad_(False)
        align_parameters(model)  # before anything borrows a weight (alignment.py: loaded weights straddle lines)
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path or getattr(model.config, "name_or_path", "") or "unknown"
        self.config = model.config
        self.decoder = model.get_decoder()
        for attr in ("layers", "norm", "embed_tokens", "rotary_emb"):
            if not hasattr(self.decoder, attr):
                raise MirrorTrainError(
                    f"{type(model).__name__} has no decoder.{attr}: only decoder-only models with the usual "
                    "model.layers / model.norm / lm_head layout are supported"
                )
        self.lm_head = model.get_output_embeddings()
        n = self.num_layers
        self.layer_types: list[str] = list(getattr(self.config, "layer_types", None) or [])
        if not self.layer_types:
            sliding = getattr(self.config, "sliding_window", None) and getattr(self.config, "use_sliding_window", True)
            self.layer_types = [_SLIDING if sliding else _FULL] * n
        self._typed_rotary = "layer_type" in inspect.signature(self.decoder.rotary_emb.forward).parameters
        self._softcap = getattr(self.config, "final_logit_softcapping", None)
        # A window scored at once must equal the same tokens scored one by one, bit for bit (mirror_train/attention.py).
        self.row_invariant = attention.install(model)
        self.static: static_step.StaticSteps | None = None  # the fixed-shape step, once `use_static` chose it

    @classmethod
    def load(
        cls,
        name_or_path: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        revision: str | None = None,
    ) -> Target:
        """Load from the testbed (default), a local directory or a Hub id, with a clear error when that fails."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = resolve_device(device)
        source = resolve_model(name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, revision=revision)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MirrorTrainError(f"could not load model {str(name_or_path)!r}: {first}") from None
        return cls(model.to(device), tokenizer, name_or_path=str(name_or_path or "testbed"))

    # --- shape facts -------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @functools.cached_property
    def exact_windows(self) -> bool:
        """Whether a window scored at once equals its one-token steps bit for bit: row-invariant attention and
        matmuls that round each row alike whatever the row count, a property of the hardware and dtype (float32 MKL
        GEMMs never are, by ~1e-5: no greedy flip was ever measured there), or of the fast path installed (the
        row-exact kernels always are: fastpath.py). Probed on first use (~1 s in bf16 without AMX), not at load:
        only a low-precision target served by the engine asks."""
        return self.row_invariant and attention.gemm_row_invariant(self.model)

    def check_exit_layer(self, exit_layer: int) -> int:
        return check_exit_layer(exit_layer, self.num_layers)

    def cast(self, dtype: torch.dtype) -> Target:
        """A copy of this target computing in `dtype` (self when it already does): bf16 makes training data
        several times faster on CPUs with AMX and on GPUs. The engine always serves the target as loaded."""
        if dtype == self.dtype:
            return self
        import copy

        return Target(copy.deepcopy(self.model).to(dtype), self.tokenizer, name_or_path=self.name_or_path)

    def signature(self):
        """What an artifact records about this target, and what loading one checks against."""
        return TargetSignature.of(self.config, self.tokenizer, upstream_name(self.name_or_path))

    # --- KV cache ----------------------------------------------------------------------------------------------
    def use_static(self, graphs: bool, capacity: int = static_step.MIN_CAPACITY) -> Target:
        """Serve from a KV cache of fixed capacity, windows replayed from CUDA graphs where `graphs`
        (static_step.py): every later `new_cache` is that one cache, reset. Returns self."""
        self.static = static_step.StaticSteps(self, capacity, graphs)
        return self

    def new_cache(self):
        if self.static is not None:  # one sequence at a time (static_step.py)
            self.static.cache.reset()
            return self.static.cache
        from transformers import DynamicCache

        from mirror_train.kv_cache import grow_in_place

        cache = DynamicCache(config=self.config)
        # Sliding-window layers must keep the positions a rollback could drop; `crop` trims them to the window.
        cache.activate_past_recording()
        return grow_in_place(cache)  # no whole-cache copy a step (kv_cache.py)

    @staticmethod
    def cache_length(cache) -> int:
        return cache.get_seq_length() if cache is not None else 0

    @staticmethod
    def crop(cache, length: int) -> None:
        """Drop every cached position ≥ length (layer by layer; a static cache only moves its length back)."""
        if isinstance(cache, static_step.StaticKV):
            cache.crop(length)
        else:
            kv_cache.crop(cache, length)

    @staticmethod
    @torch.inference_mode()
    def keep_path(cache, past: int, rows: list[int]) -> None:
        """Keep the window rows `rows` (indices into the window that started at position `past`, in order) as the
        positions past, past + 1, ...: a forked window's kept chain moved down behind its stem, layer by layer
        (then `crop` drops the rest). Rows already in place are not copied."""
        moves = [(past + i, past + r) for i, r in enumerate(rows) if r != i]
        if not moves:
            return
        device = cache.layers[0].keys.device
        dst = torch.tensor([d for d, _ in moves], device=device)
        src = torch.tensor([s for _, s in moves], device=device)
        for layer in cache.layers:
            for x in (layer.keys, layer.values):
                x.index_copy_(-2, dst, x.index_select(-2, src))

    # --- the two halves ----------------------------------------------------------------------------------------
    def window_state(
        self,
        hidden: torch.Tensor,
        cache,
        attention_mask: torch.Tensor | None = None,
        forked: ForkedWindow | None = None,
    ) -> PrefixState:
        """Masks, rotary tables and position ids for a window of states `hidden` (B, T, H) after `cache`.

        Positions continue from the cache's length. Also used by proxy heads that run decoder blocks of their own
        over ℓe states, so that they build masks exactly as the target does. `forked`: the window holds two chains
        (forked_window.py; full-attention layers only), each row at its chain's position, seeing its chain alone.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        past = self.cache_length(cache)
        if forked is not None:
            plain = set(self.layer_types) == {_FULL} and attention_mask is None and hidden.shape[:2] == (1, forked.rows)
            if not (plain and self.row_invariant):  # the attention that reads its rows' keys is attention.py's
                raise MirrorTrainError(
                    "a forked window needs one unpadded sequence, full-attention layers and the row-invariant "
                    "attention (an SDPA model)"
                )
            position_ids = (past + torch.tensor(forked.depths(), device=hidden.device)).unsqueeze(0)
            mask = attention.forked(forked.mask(past, hidden.device), forked.runs(past))
            typed = (_FULL,) if self._typed_rotary else ()
            rope = self.decoder.rotary_emb(hidden, position_ids, *typed)
            return PrefixState(hidden, 0, cache, position_ids, {_FULL: mask}, {_FULL: rope})
        position_ids = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        builders = {_FULL: create_causal_mask, _SLIDING: create_sliding_window_causal_mask}
        types = set(self.layer_types)
        masks = {t: builders[t](**mask_kwargs) for t in types}
        if self._typed_rotary:
            rope = {t: self.decoder.rotary_emb(hidden, position_ids, t) for t in types}
        else:
            shared = self.decoder.rotary_emb(hidden, position_ids)
            rope = {t: shared for t in types}
        return PrefixState(hidden, 0, cache, position_ids, masks, rope)

    @torch.inference_mode()
    def prefix(
        self,
        input_ids: torch.Tensor,
        cache,
        exit_layer: int,
        attention_mask: torch.Tensor | None = None,
        forked: ForkedWindow | None = None,
    ) -> PrefixState:
        """Run layers 1..ℓe over `input_ids` (B, T), appending to `cache`; return the ℓe state of every position.

        `attention_mask` is the usual 2-D padding mask over cached + new positions (None: no padding); `forked`: the
        window's rows are two chains (forked_window.py).
        """
        self.check_exit_layer(exit_layer)
        if isinstance(cache, static_step.StaticKV):
            if attention_mask is not None:
                raise MirrorTrainError("the static cache serves one unpadded sequence (no attention_mask)")
            hidden, inputs = self.static.prefix(input_ids, exit_layer, forked)
            return PrefixState(hidden, exit_layer, cache, inputs.positions, {}, {}, static=inputs)
        state = self.window_state(self.decoder.embed_tokens(input_ids), cache, attention_mask, forked)
        state.exit_layer = exit_layer
        state.hidden = self.run_layers(state, self.decoder.layers, range(exit_layer))
        return state

    @torch.inference_mode()
    def suffix(self, state: PrefixState) -> torch.Tensor:
        """Run layers ℓe+1..N, the final norm and the LM head: (B, T, V) final logits."""
        return self.suffix_states(state)[0]

    @torch.inference_mode()
    def suffix_states(self, state: PrefixState, logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`suffix`, and the final states (B, T, H) the LM head read (after the final norm: layer N's cached state,
        what a draft reading the target's final states is fed). `logits=False`: the LM head is left to the caller
        (None in their place, where they are not made anyway: `greedy` reads the states)."""
        if state.static is not None:
            return self.static.suffix(state.static, state.exit_layer)
        hidden = self.run_layers(state, self.decoder.layers, range(state.exit_layer, self.num_layers))
        final = self.decoder.norm(hidden)
        return (self.logits(final) if logits else None), final

    def run_layers(self, state: PrefixState, layers, indices) -> torch.Tensor:
        """Run `layers[i]` for i in `indices` (0-based: layer i+1 of the convention) on `state.hidden`.

        Each layer gets the mask and rotary table of the target's layer i's attention type.
        """
        hidden = state.hidden
        stack = self._stack(layers, indices)
        if stack is not None:
            kind = self.layer_types[indices[0]]
            out = stack(hidden, state.cache, state.position_embeddings[kind], state.masks[kind])
            if out is not None:
                return out
        for i in indices:
            kind = self.layer_types[i]
            hidden = layers[i](
                hidden,
                attention_mask=state.masks[kind],
                position_embeddings=state.position_embeddings[kind],
                position_ids=state.position_ids,
                cache=state.cache,
                use_cache=state.cache is not None,
            )
        return hidden

    def _stack(self, layers, indices) -> fused_layer.FusedStack | None:
        """The fused layers `layers[i]`, i in `indices`, as one C call (fused_layer.FusedStack), where all of them
        are fused and of one attention type; None otherwise (each then runs on its own)."""
        if not isinstance(indices, range) or len(indices) < 2:
            return None
        chosen = [layers[i] for i in indices]
        if not all(isinstance(layer, fused_layer.FusedLayer) for layer in chosen):  # `install` can switch them
            return None
        if len({self.layer_types[i] for i in indices}) != 1:
            return None
        stacks = self.__dict__.setdefault("_stacks", {})
        key = (id(layers), indices.start, indices.stop, indices.step)
        stack = stacks.get(key)
        if stack is None or any(a is not b for a, b in zip(stack.layers, chosen)):
            stack = stacks[key] = fused_layer.FusedStack(chosen)
        return stack

    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, cache, exit_layer: int, on_exit=None, logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Fill `cache` with every layer's K/V for `input_ids` (B, T) in one pass, as transformers' `generate` does
        (a prompt split differently rounds differently in bf16). Returns the ℓe states (B, T, H), for a proxy head
        or draft with a cache of its own, the final logits of the last position (B, V): the first new token (the LM
        head runs on that row only), and the final states (B, T, H) (as `suffix_states`). `on_exit(states)`, if
        given, is called with the ℓe states between the halves (to send them on while the upper layers run).
        `logits=False`: None for the logits (the caller reads the final states with `greedy`)."""
        if isinstance(cache, static_step.StaticKV):
            return self.static.prefill(input_ids, exit_layer, on_exit)
        state = self.prefix(input_ids, cache, exit_layer)
        exit_hidden = state.hidden
        if on_exit is not None:
            on_exit(exit_hidden)
        final = self.decoder.norm(self.run_layers(state, self.decoder.layers, range(exit_layer, self.num_layers)))
        return exit_hidden, (self.logits(final[:, -1]) if logits else None), final

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """A plain full forward through the split machinery (prefix at ℓe = 1, then suffix)."""
        return self.suffix(self.prefix(input_ids, cache, 1, attention_mask))

    # --- heads -------------------------------------------------------------------------------------------------
    def logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """LM head on already-normalised states, with the model family's final soft-capping if it has one."""
        logits = self.lm_head(normed_hidden)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @torch.inference_mode()
    def greedy(self, normed_hidden: torch.Tensor) -> list[int]:
        """`self.logits(normed_hidden).argmax(-1)` for each row of (..., H) states, exactly (the first id on a tie),
        through the LM head's low-precision screen where the fast path built one (screened_head.py: the served head then
        computes only the ids that could be the largest)."""
        return self.greedy_scores(normed_hidden)[0]

    @torch.inference_mode()
    def greedy_scores(
        self, normed_hidden: torch.Tensor, noise: torch.Tensor | None = None
    ) -> tuple[list[int], torch.Tensor, bool]:
        """`greedy`, the logits it read (rows, V), and whether they are the screen's, each within its bound of the
        served logit (for statistics; `logits_at` gives chosen ids' exactly), rather than the head's own. `noise`
        (rows, V): each row's first largest of logits + noise instead, a sampled token (Gumbel-max:
        `acceptance.sample_noise`), through the screen too: the id `target_tokens` gives on the whole logits."""
        if self._softcap:  # its tanh can tie logits the screen tells apart
            logits = self.logits(normed_hidden).reshape(-1, self.vocab_size)
            return screened_head.whole_argmax(logits, noise), logits, False
        return screened_head.argmax_and_scores(self.lm_head, normed_hidden, noise)

    @torch.inference_mode()
    def logits_at(self, normed_hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`self.logits(normed_hidden)[..., ids]` as (rows, len(ids)), computing only those where the head allows."""
        if self._softcap:
            return self.logits(normed_hidden).reshape(-1, self.vocab_size)[:, ids]
        return screened_head.logits_at(self.lm_head, normed_hidden, ids)

    def lens_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logit lens: final norm + LM head applied to an intermediate hidden state."""
        return self.logits(self.decoder.norm(hidden))

    @torch.inference_mode()
    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """One uncached forward: (hidden_states[0..N] in the 1-based convention, final logits)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        return out.hidden_states, out.logits


def dtype_record(target: Target) -> dict[str, str]:
    """What data provenance records about the precision the target ran in: nothing for float32 (the default, and
    all data made before other precisions existed, which therefore stays valid), else {"dtype": name}."""
    if target.dtype == torch.float32:
        return {}
    return {"dtype": str(target.dtype).removeprefix("torch.")}
