"""The draft model: a small Llama-shaped causal LM whose top layers carry Speculative-Streaming lookahead streams.

Layout (parameter names follow Llama's, so a target's layers load unchanged):

    embed_tokens                   the target's vocabulary: the draft reads target token ids
    fusion (optional)              h0 = W [emb(x_t) ; rms(f_slot) for each feature slot], W = [I | 0] at init
    layers[0 .. N-N_s-1]           transformers' LlamaDecoderLayer, unchanged
    layers[N-N_s .. N-1]           MultiStreamDecoderLayer (multi_stream_attention.py): main + γ' lookahead streams
    stream_embeddings              P_j, j = 1..γ'; stream j enters the first multi-stream layer as h_t + P_j
    norm, lm_head                  one head for all streams: main → p(y_{t+1}), stream j → p(y_{t+1+j})
    d2t (buffer, optional)         draft id → target id when the head covers a reduced vocabulary (EAGLE-3)

Decisions the papers leave open:
- Stream RoPE position = its anchor position t (see multi_stream_attention.py).
- Feature conditioning fuses each input position with up to three states of the position before it (EAGLE's
  pairing, `paired_features`: the input at t reads the states of t−1), one per *slot* (`feature_slots`):
      exit   the target's layer-ℓe state: known for every token the target has run its prefix over (the committed
             tokens, and the window while the target finishes it);
      final  the target's final state (after its final norm, what its LM head reads): known only for tokens the
             target has finished, the committed ones: the freshest and most informative state there is;
      own    the draft's own last hidden state (before its final norm) that predicted the token: for the tokens
             the draft rolls out itself, where no target state exists yet (EAGLE-3's training-time test).
  A slot without a state at a position gets zeros, which rms maps to zero, so W sees nothing there. Which slots a
  position has is the caller's: the engine gives committed tokens their target slots, window tokens exit + own,
  rolled-out tokens own; training shows the draft the same (`drafter_training.drafter_loss`). The fusion starts as
  the identity on the embedding, so an untrained fusion is exactly the token-only model.
- Logits stay in draft-id space inside `forward`; `draft_to_target`, `target_to_draft` and `to_target_logits` map.
- `tree_forward` is one forward over tree nodes under a 4-D ancestor mask, their K/V appended to the cache: the
  engine's rollout (engine/rollout.py) batches every branch into one such forward per pass. Stream K/V never enter
  the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers import initialization as init
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from mirror_train.errors import MirrorTrainError
from mirror_train.kv_cache import grow_in_place
from mirror_train.losses import IGNORE_INDEX, speculative_streaming_loss
from mirror_train.models.draft_surgery import build_from_target, plain_llama
from mirror_train.models.drafter_config import MirrorDrafterConfig
from mirror_train.models.multi_stream_attention import (
    MultiStreamDecoderLayer,
    causal_mask,
    joint_rows,
    split_rows,
    tree_mask,
)


@dataclass
class MirrorDrafterOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (B, T, V_draft): main stream, p(y_{t+1})
    stream_logits: torch.Tensor | None = None  # (B, T, S, V_draft): stream j, p(y_{t+1+j}); None without streams
    cache: DynamicCache | None = None
    hidden: torch.Tensor | None = None  # (B, T, H): the main stream's last state before the final norm (own slot)
    stream_hidden: torch.Tensor | None = None  # (B, T, S, H): the same of each stream


def paired_features(
    hidden: torch.Tensor, withheld: torch.Tensor | None = None, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """EAGLE's pairing of target states with draft inputs: out[:, t] = hidden[:, t-1], zeros at t = 0.

    hidden (B, T, H_target): the target's ℓe state of every position of each row (a row is one contiguous span of a
    sequence, or several packed one after another: then segments (B, T) says which, and the first position of
    each gets zeros too); withheld (B, T) bool or None: positions whose paired state is zeroed, as for a token the
    draft rolled out itself. Returns (B, T, H_target).
    """
    out = torch.zeros_like(hidden)
    out[:, 1:] = hidden[:, :-1]
    if segments is not None:
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        withheld = starts if withheld is None else withheld | starts
    if withheld is not None:
        out = out.masked_fill(withheld[..., None], 0.0)
    return out


class FeatureFusion(nn.Module):
    """h0 = W [emb(x_t) ; rms_s(f_s) for each slot s]; W starts as [I | 0], so at init h0 = emb(x_t) exactly."""

    def __init__(self, hidden_size: int, widths: dict[str, int], eps: float):
        super().__init__()
        self.widths = dict(widths)
        self.norms = nn.ModuleDict({slot: LlamaRMSNorm(width, eps=eps) for slot, width in widths.items()})
        self.proj = nn.Linear(hidden_size + sum(widths.values()), hidden_size, bias=False)

    def forward(self, emb: torch.Tensor, features: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """emb (B, T, H); features: slot → (B, T, width), a missing slot reads zeros → (B, T, H)."""
        features = features or {}
        unknown = set(features) - set(self.widths)
        if unknown:
            raise MirrorTrainError(f"this draft reads feature slots {list(self.widths)}, not {sorted(unknown)}")
        parts = [emb]
        for slot, width in self.widths.items():
            f = features.get(slot)
            parts.append(emb.new_zeros(*emb.shape[:-1], width) if f is None else self.norms[slot](f.to(emb.dtype)))
        return self.proj(torch.cat(parts, dim=-1))


class MirrorDrafterForCausalLM(PreTrainedModel):
    config_class = MirrorDrafterConfig
    _no_split_modules = ["LlamaDecoderLayer", "MultiStreamDecoderLayer"]
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}  # only when config.tie_word_embeddings

    def __init__(self, config: MirrorDrafterConfig):
        super().__init__(config)
        config.validate()  # a config edited after construction is checked again here
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        widths = {slot: c.hidden_size if slot == "own" else c.target_hidden_size for slot in c.slots}
        self.fusion = FeatureFusion(c.hidden_size, widths, c.rms_norm_eps) if widths else None
        first = self.first_stream_layer
        self.layers = nn.ModuleList(
            [(LlamaDecoderLayer if i < first else MultiStreamDecoderLayer)(c, i) for i in range(c.num_hidden_layers)]
        )
        self.stream_embeddings = nn.Embedding(c.num_streams, c.hidden_size)  # P_j; normal(0, initializer_range)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(c)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size or c.vocab_size, bias=False)
        d2t = torch.arange(c.draft_vocab_size) if c.draft_vocab_size is not None else None
        self.register_buffer("d2t", d2t)  # persistent: saved with the weights
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        # Matched on the Linear itself: transformers skips custom-code modules without parameters of their own.
        if self.fusion is not None and module is self.fusion.proj:
            weight = module.weight
            init.copy_(weight, torch.eye(*weight.shape, dtype=weight.dtype, device=weight.device))  # [I | 0]

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def first_stream_layer(self) -> int:
        """0-based index of the first multi-stream layer."""
        return self.config.num_hidden_layers - self.config.num_stream_layers

    def new_cache(self) -> DynamicCache:
        """A KV cache whose full-attention layers grow in place (kv_cache.py): a draft forward would otherwise copy
        the whole cache of every layer (transformers' `torch.cat`), memory traffic the target's core shares."""
        return grow_in_place(DynamicCache(config=self.config))

    # --- the forward -----------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attention_mask_4d: torch.Tensor | None = None,
        features: dict[str, torch.Tensor] | None = None,
        num_streams: int | None = None,
        labels: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> MirrorDrafterOutput:
        """Main-stream logits for every position and, with streams, the lookahead logits.

        input_ids (B, T) target ids; cache: main K/V of the L earlier positions, appended to (streams never are);
        position_ids (1 or B, T), default L..L+T-1; attention_mask (B, L+T) the usual 1/0 padding mask;
        attention_mask_4d (1 or B, 1, T, L+T) an additive float mask that replaces the causal one (tree nodes);
        features: slot → (B, T, width) the states each input reads (feature conditioning only; a missing slot
        reads zeros; see the module docstring);
        num_streams: how many of the γ' streams to run (None = all, 0 = main only, cheaper);
        labels (B, T) target ids, unshifted, -100 = ignore: adds the Speculative Streaming loss;
        logits_index (K,) positions whose logits to compute (None: all T). The LM head dominates a small model's
        cost, and a rollout reads only a few positions.
        """
        streams_max, first_stream = self.config.num_streams, self.first_stream_layer  # a config read costs µs
        S = streams_max if num_streams is None else num_streams
        if not 0 <= S <= streams_max:
            raise MirrorTrainError(f"num_streams must be in 0..{streams_max}, got {num_streams}")
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        h = self.embed_tokens(input_ids)  # (B, T, H)
        if self.fusion is not None:
            h = self.fusion(h, features)
        elif features:
            raise MirrorTrainError("features were given, but this draft has feature_conditioning='none'")
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=h.device).unsqueeze(0)  # (1, T)
        if attention_mask is not None and attention_mask_4d is not None:
            raise MirrorTrainError("give attention_mask (padding) or attention_mask_4d (a full mask), not both")
        if attention_mask_4d is None:
            mask = causal_mask(past, T, attention_mask, h.dtype, h.device)
        else:
            mask = attention_mask_4d.to(h.dtype)
        if mask.shape[-2:] != (T, past + T):
            raise MirrorTrainError(f"attention mask covers {tuple(mask.shape[-2:])}, expected {(T, past + T)}")
        rope = self.rotary_emb(h, position_ids)  # (cos, sin), each (1 or B, T, head_dim)

        streams = None
        for i, layer in enumerate(self.layers):
            if i < first_stream:
                h = layer(
                    h,
                    attention_mask=mask,
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=cache is not None,
                    position_embeddings=rope,
                )
                continue
            if i == first_stream and S:
                # streams only where logits are read: a stream is seen by nothing but its anchor's later streams
                anchors = h if logits_index is None else h[:, logits_index]
                streams = anchors[:, :, None, :] + self.stream_embeddings.weight[:S]  # (B, K, S, H): h_t + P_j
            h, streams = layer(h, streams, rope, mask, cache, anchors=logits_index)

        if logits_index is not None:
            if labels is not None:
                raise MirrorTrainError("labels need the logits of every position: do not give logits_index")
            h = h[:, logits_index]  # (B, K, H); the streams are already the K anchors'
        # one head call for main and stream rows: the head is most of a decoding step's weight reads
        logits, stream_logits = split_rows(
            self.lm_head(self.norm(joint_rows(h, streams))), h.shape[1], 0 if streams is None else streams.shape[2]
        )  # (B, T or K, V_draft), (B, T or K, S, V_draft) or None
        loss = None
        if labels is not None:
            loss = speculative_streaming_loss(
                logits, stream_logits, self.target_to_draft(labels), self.config.stream_loss_weight
            )
        return MirrorDrafterOutput(
            loss=loss, logits=logits, stream_logits=stream_logits, cache=cache, hidden=h, stream_hidden=streams
        )

    # --- vocabulary maps -------------------------------------------------------------------------------------
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids → draft ids; ids outside the draft vocabulary (and negative ones) → -100."""
        if self.d2t is None:
            return target_ids.masked_fill(target_ids < 0, IGNORE_INDEX)
        t2d = torch.full((self.config.vocab_size,), IGNORE_INDEX, dtype=torch.long, device=self.d2t.device)
        t2d[self.d2t] = torch.arange(len(self.d2t), device=self.d2t.device)
        return torch.where(target_ids >= 0, t2d[target_ids.clamp(min=0)], IGNORE_INDEX)

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V_draft) → (..., V_target) with -inf for the ids the draft cannot propose."""
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.d2t, logits)

    # --- building a draft from its target, and its plain-Llama form (draft_surgery.py) -------------------------
    @classmethod
    def from_target(cls, target_model, num_layers: int, *args, **options) -> MirrorDrafterForCausalLM:
        """A draft initialised from a Llama-shaped target's layers: see `draft_surgery.build_from_target`."""
        return build_from_target(cls, target_model, num_layers, *args, **options)

    def to_llama(self):
        """The main stream as a plain `LlamaForCausalLM`: see `draft_surgery.plain_llama`."""
        return plain_llama(self)

    # --- the engine's interface: tree-batched forwards over the KV cache ----------------------------------------
    @torch.no_grad()
    def tree_forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int],
        cache: DynamicCache,
        committed_len: int | None = None,
        num_streams: int | None = None,
        features: dict[str, torch.Tensor] | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> MirrorDrafterOutput:
        """One forward over N new tree nodes; their main K/V are appended to `cache`.

        The cache holds the committed context (its first `committed_len` positions, default all of it) and then the
        uncommitted nodes of earlier tree forwards. `parents` gives the parent of every uncommitted node, old ones
        first, then the N new ones, as an index into that list (-1: the end of the committed context); a parent
        comes before its child. A node attends to the committed context, its ancestors and itself, at position
        committed_len + depth (depth 0 for a node whose parent is -1). tokens: the N new target ids;
        features: slot → (N, width) or None; logits_index as in `forward`. Returns logits (1, N, V_draft),
        stream_logits (1, N, S, V_draft) (N: the indexed nodes only, with logits_index) and their hidden states.
        """
        cached = cache.get_seq_length()
        committed = cached if committed_len is None else committed_len
        n_new, n_all = len(tokens), len(parents)
        if not 0 <= committed <= cached or n_all != cached - committed + n_new:
            raise MirrorTrainError(
                f"parents must cover the {cached - committed} uncommitted cached nodes and the {n_new} new ones "
                f"(got {n_all}; the cache holds {cached}, committed_len={committed})"
            )
        if n_new == 0:
            raise MirrorTrainError("tree_forward needs at least one new node")
        device = self.device
        # (1, 1, N, cached + N), with its key runs for the C layers on a CPU (`key_runs`), and (N,)
        mask, depth = tree_mask(parents, committed, n_new, self.dtype, key_runs=device.type == "cpu")
        mask = mask.to(device)
        if features:
            for slot, f in features.items():
                if f.shape[0] != n_new:
                    raise MirrorTrainError(f"features[{slot!r}] cover {f.shape[0]} nodes, the forward feeds {n_new}")
            features = {slot: f.to(device, self.dtype).unsqueeze(0) for slot, f in features.items()}  # (1, N, w)
        return self(
            torch.tensor([list(tokens)], device=device),
            cache=cache,
            position_ids=(committed + depth).unsqueeze(0).to(device),  # (1, N)
            attention_mask_4d=mask,
            features=features,
            num_streams=num_streams,
            logits_index=logits_index,
        )


AutoConfig.register(MirrorDrafterConfig.model_type, MirrorDrafterConfig, exist_ok=True)
AutoModelForCausalLM.register(MirrorDrafterConfig, MirrorDrafterForCausalLM, exist_ok=True)
