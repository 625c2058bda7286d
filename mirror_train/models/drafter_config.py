"""The draft's configuration (`model_type` "mirror_drafter"): Llama's fields plus streams, a reduced vocabulary and
the feature slots (models/drafter.py explains them)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from mirror_train.errors import MirrorTrainError

FEATURE_CONDITIONING = ("none", "target_hidden")
FEATURE_SLOTS = ("exit", "final", "own")  # see the module docstring
TARGET_SLOTS = ("exit", "final")  # the slots the target fills


@strict
class MirrorDrafterConfig(PreTrainedConfig):
    """Llama fields plus the streams, the reduced vocabulary and the feature conditioning.

    The defaults are SmolLM2-135M's sizes with 4 layers, 1 stream layer and 1 stream.
    """

    model_type = "mirror_drafter"

    vocab_size: int = 49152  # the target's vocabulary: what the embedding reads
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 4
    num_attention_heads: int = 9
    num_key_value_heads: int | None = None  # None: = num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_parameters: RopeParameters | dict | None = None  # None: default RoPE, θ = 10000
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02  # also the std of the stream embeddings P_j
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    num_streams: int = 1  # γ': lookahead streams per position
    num_stream_layers: int = 1  # N_s: the top N_s layers are multi-stream
    stream_loss_weight: float = 0.1  # α_j for every stream j ≥ 1 (the paper's value); α_0 = 1
    draft_vocab_size: int | None = None  # None: the head covers the whole vocabulary; else rows of `d2t`
    feature_conditioning: str = "none"  # "none" | "target_hidden"
    feature_slots: list[str] | None = None  # "target_hidden": the states fused at each input (FEATURE_SLOTS);
    # None = ["exit"], the draft of earlier versions
    target_hidden_size: int | None = None  # "target_hidden": the width of the target's hidden state
    target_exit_layer: int | None = None  # "target_hidden": ℓe, the target layer whose output is read (1-based)
    target: dict | None = None  # TargetSignature.to_dict() of the target this draft belongs to

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_drafter(self) -> None:
        """Run by `@strict` after construction and by `validate()` (the model calls it too)."""
        n = self.num_hidden_layers
        if self.num_streams < 0:
            raise MirrorTrainError(f"num_streams (γ') must be ≥ 0, got {self.num_streams}")
        if not 0 <= self.num_stream_layers <= n:
            raise MirrorTrainError(
                f"num_stream_layers (N_s) must be in 0..{n} (the draft has {n} layers), got {self.num_stream_layers}"
            )
        if self.num_streams > 0 and self.num_stream_layers == 0:
            raise MirrorTrainError(f"num_streams={self.num_streams} needs num_stream_layers ≥ 1 to carry the streams")
        if self.draft_vocab_size is not None:
            if not 1 <= self.draft_vocab_size <= self.vocab_size:
                raise MirrorTrainError(
                    f"draft_vocab_size must be in 1..{self.vocab_size} (the vocabulary size), "
                    f"got {self.draft_vocab_size}"
                )
            if self.tie_word_embeddings:
                raise MirrorTrainError("tie_word_embeddings needs the full vocabulary (draft_vocab_size=None)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise MirrorTrainError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.feature_conditioning not in FEATURE_CONDITIONING:
            raise MirrorTrainError(
                f"feature_conditioning must be one of {', '.join(FEATURE_CONDITIONING)}, "
                f"got {self.feature_conditioning!r}"
            )
        if self.feature_conditioning == "target_hidden" and not (self.target_hidden_size or 0) >= 1:
            raise MirrorTrainError("feature_conditioning='target_hidden' needs target_hidden_size ≥ 1")
        slots = self.slots
        if len(set(slots)) != len(slots) or any(s not in FEATURE_SLOTS for s in slots):
            raise MirrorTrainError(f"feature_slots must be distinct names among {', '.join(FEATURE_SLOTS)}: {slots}")
        if self.feature_conditioning == "target_hidden" and not set(slots) & set(TARGET_SLOTS):
            raise MirrorTrainError("feature_slots must name at least one target state (exit or final)")

    @property
    def slots(self) -> list[str]:
        """The feature slots the fusion reads, in its input order ([] for a token-only draft)."""
        if self.feature_conditioning != "target_hidden":
            return []
        return list(self.feature_slots) if self.feature_slots is not None else ["exit"]
