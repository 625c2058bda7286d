"""Distilling the Speculative-Streaming draft from the target: run config, draft set-up, loss, evaluation, artifact.

`recipes/drafter.py` strings these together; everything here is importable and tested on its own.

Data: the proxy head's (`proxy_training.prepare_data`): self-distilled answers, teacher-forced prompts and
held-out Spec-Bench answers, cached once per target. Each cached position t holds the input token x_t, the target's
top-k next-token log-probs (its distribution over x_{t+1}) and its hidden state at ℓe (read only by a
feature-conditioned draft). The draft trains on the target's own choices, never on the human text:
    main stream at t   kl_weight · KL(target top-k at t ‖ draft) + ce_weight · CE(target argmax at t)
    stream j at t      α · CE(target argmax at t+j), the target's next-token choice j positions later
Decisions the papers leave open:
- KL to the target's top-k (renormalised over those k), as for the proxy head: the target's whole ranking is a
  richer label than its argmax, and the draft's greedy choice is what gets verified.
- Reduced vocabulary: its ids are the most frequent ones in the training cache, counting both the text the draft
  reads (answers and prompts, which answers often copy from) and the target's argmax at every position (what the
  draft must propose). Target ids outside it are dropped from the top-k and the remaining mass renormalised: the
  draft cannot propose them, so it should rank what it can.
- The draft shares the proxy head's feature cache: its ℓe defaults to the proxy head's (N/2), so with the same
  data settings nothing is cached twice, even when the draft does not read the hidden states.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from mirror_train.data.features import FeatureCache, pack_rows
from mirror_train.errors import MirrorTrainError
from mirror_train.losses import lookahead_ce_loss, topk_kl_loss
from mirror_train.models.drafter import (
    MirrorDrafterForCausalLM,
    check_compatible,
    frequent_token_map,
    paired_features,
)
from mirror_train.models.multi_stream_attention import packed_causal_mask
from mirror_train.models.proxy_head import ProxyHeadConfig
from mirror_train.proxy_training import ProxyDataConfig, ProxyRunConfig, feature_dirs
from mirror_train.training import LogConfig, OptimConfig, TrainConfig

ARTIFACT_KIND = "draft"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # decoder layers only
_DROPPED_LOGP = -1e4  # log-prob of a top-k id outside the draft's vocabulary (see `_draft_vocab_kl`)


@dataclass
class DrafterModelConfig:
    init: str = "target"  # "target": its embeddings, first num_layers layers, final norm, LM head; "scratch":
    # the same shapes, random; else the path or Hub id of a small Llama-shaped model with the target's tokenizer
    num_layers: int = 4
    num_streams: int = 2  # γ': lookahead streams, so one forward proposes 1 + γ' tokens
    num_stream_layers: int = 1  # N_s: the top N_s layers carry the streams
    draft_vocab_size: int | None = None  # None: the whole vocabulary; else the most frequent ids (EAGLE-3's d2t)
    feature_conditioning: Literal["none", "target_hidden"] = "none"  # target_hidden: also read the target's ℓe state
    exit_layer: int | None = None  # ℓe of the feature cache (and of the conditioning); None: N/2, the proxy head's
    freeze_embeddings_and_head: bool = True  # the same agreement, 1.6× faster steps (shared/docs/testbed.md)
    lora_rank: int | None = None  # None: full fine-tune of the layers; else LoRA on their projections
    lora_alpha: float = 32.0  # LoRA scale α/r

    def validate(self) -> None:
        if not self.init:
            raise MirrorTrainError(
                "init must be 'target', 'scratch' or the path of a model with the target's tokenizer"
            )
        if self.num_layers < 1 or self.num_streams < 0 or not 1 <= self.num_stream_layers <= self.num_layers:
            raise MirrorTrainError("num_layers ≥ 1, num_streams ≥ 0 and 1 ≤ num_stream_layers ≤ num_layers")
        if (self.draft_vocab_size or 1) < 1 or (self.lora_rank or 1) < 1:
            raise MirrorTrainError("draft_vocab_size and lora_rank must be ≥ 1 (or null)")
        if self.init == "scratch" and self.freeze_embeddings_and_head:
            raise MirrorTrainError("init=scratch needs freeze_embeddings_and_head=false: random ones would stay random")


@dataclass
class DrafterTrainConfig(TrainConfig):
    """Batches are packed from whole context windows (`window`)."""

    kl_weight: float = 1.0  # main stream: KL to the target's top-k distribution
    ce_weight: float = 0.0  # main stream: CE on the target's argmax
    stream_weight: float = 0.1  # α_j of every lookahead stream (the paper's value)
    feature_dropout: float = 0.2  # feature-conditioned drafts: the share of positions trained without their target
    # state, as the tokens a rollout drafts past the first have none (then one missing state in a row is 20% of
    # positions, two 4%)

    def validate(self) -> None:
        super().validate()
        if min(self.kl_weight, self.ce_weight, self.stream_weight) < 0 or not self.kl_weight + self.ce_weight > 0:
            raise MirrorTrainError("train: loss weights must be ≥ 0, and kl_weight or ce_weight > 0 (the main stream)")
        if not 0 <= self.feature_dropout < 1:
            raise MirrorTrainError(f"train.feature_dropout must be in [0, 1), got {self.feature_dropout}")


@dataclass
class DrafterRunConfig:
    output_dir: str = "outputs/drafter_smollm2"
    target: str = "testbed"
    model: DrafterModelConfig = field(default_factory=DrafterModelConfig)
    data: ProxyDataConfig = field(default_factory=ProxyDataConfig)  # the proxy head's data, caches included
    train: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)


# --- data -----------------------------------------------------------------------------------------------------
def data_view(cfg: DrafterRunConfig, target) -> ProxyRunConfig:
    """The proxy-head run whose data stages and feature caches this draft shares: for `prepare_data`."""
    exit_layer = cfg.model.exit_layer if cfg.model.exit_layer is not None else target.num_layers // 2
    exit_layer = target.check_exit_layer(exit_layer)
    head = ProxyHeadConfig(exit_layer=exit_layer)
    return ProxyRunConfig(output_dir=cfg.output_dir, target=cfg.target, head=head, data=cfg.data)


def open_caches(view: ProxyRunConfig) -> tuple[FeatureCache, FeatureCache]:
    """The train and held-out feature caches `prepare_data(view, target)` built; both must hold the token ids."""
    caches = tuple(FeatureCache(path, view.head.exit_layer) for path in feature_dirs(view))
    for cache in caches:
        if cache.token_ids is None:
            raise MirrorTrainError(
                f"{cache.path} predates cached token ids, which drafts train on; delete it to rebuild"
            )
    return caches


# --- the draft ------------------------------------------------------------------------------------------------
def build_draft(cfg: DrafterModelConfig, target, cache: FeatureCache) -> MirrorDrafterForCausalLM | PeftModel:
    """The draft to train: initialised, with its reduced vocabulary picked from `cache`, frozen parts frozen.

    Returns the draft, or a peft model around it in LoRA mode: there the decoder layers' projections train through
    rank-r adapters and the parts the target never had (stream embeddings P_j, the feature fusion) train fully.
    A feature-conditioned draft reads `cache`'s layer; whatever it was initialised from, the draft records the
    target's signature (`load_draft` checks it).
    """
    vocab = None
    if cfg.draft_vocab_size is not None:
        text, argmax = np.asarray(cache.token_ids), np.asarray(cache.topk_ids[:, 0])
        specials = target.tokenizer.all_special_ids
        vocab = frequent_token_map([text, argmax], cfg.draft_vocab_size, target.vocab_size, specials)
    source = target if cfg.init in ("target", "scratch") else _donor(cfg.init, target)
    donor = MirrorDrafterForCausalLM.from_target(source, cfg.num_layers, cfg.num_streams, cfg.num_stream_layers, vocab)
    config = copy.deepcopy(donor.config)
    config.target = target.signature().to_dict()
    if cfg.feature_conditioning == "target_hidden":
        config.feature_conditioning = cfg.feature_conditioning
        config.target_hidden_size, config.target_exit_layer = target.hidden_size, cache.exit_layer
    draft = MirrorDrafterForCausalLM(config)  # random weights; a fusion starts as the identity on the embedding
    inherited = {k: v for k, v in donor.state_dict().items() if cfg.init != "scratch" or k == "d2t"}
    draft.load_state_dict(inherited, strict=False)  # missing: at most the fusion, which the donor lacks
    embeddings_and_head = [draft.embed_tokens, draft.lm_head]
    if cfg.lora_rank is None:
        for module in embeddings_and_head if cfg.freeze_embeddings_and_head else []:
            module.requires_grad_(False)
        return draft
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=LORA_TARGETS, lora_dropout=0.0)
    model = get_peft_model(draft, lora)  # freezes every parameter but the adapters
    new_parts = [draft.stream_embeddings, draft.fusion]
    for module in new_parts + ([] if cfg.freeze_embeddings_and_head else embeddings_and_head):
        if module is not None:
            module.requires_grad_(True)
    return model


def _donor(path: str, target):
    """A small model to initialise the draft from: it must read and write the target's token ids."""
    from mirror_train.export import tokenizer_fingerprint
    from mirror_train.target import Target

    donor = Target.load(path, device=target.device)
    if donor.vocab_size != target.vocab_size or tokenizer_fingerprint(donor.tokenizer) != tokenizer_fingerprint(
        target.tokenizer
    ):
        raise MirrorTrainError(
            f"model.init={path}: its tokenizer differs from the target's ({donor.vocab_size} vs {target.vocab_size} "
            "ids, or other tokens or special ids): a draft must share the target's tokenizer"
        )
    return donor


def _draft_of(model) -> MirrorDrafterForCausalLM:
    """The draft inside accelerate's (DDP, DeepSpeed) and peft's wrappers, for its vocabulary maps."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    return model.get_base_model() if isinstance(model, PeftModel) else model


# --- one step and evaluation ----------------------------------------------------------------------------------
def drafter_loss(model, batch: dict[str, torch.Tensor], cfg: DrafterTrainConfig) -> tuple[torch.Tensor, dict]:
    """kl_weight · KL + ce_weight · CE on the main stream, + α Σ_j CE on the lookahead streams (module docstring);
    returns (loss, logged parts: kl, ce = the weighted CE terms, loss).

    model: the draft, possibly wrapped (accelerate, peft). batch, as `FeatureCache.windows` gives it: token_ids
    (B, T), mask (B, T) 1 = real position, topk_ids / topk_logp (B, T, k) the target's distribution over the token
    after each position, hidden (B, T, H_target) (read only by a feature-conditioned draft, paired: the input at t
    reads the state of t−1, and a `feature_dropout` share of positions reads none). Stream j at t is labelled by
    topk_ids[t+j, 0]: padding and labels past the window's end are ignored, as is an argmax outside a reduced
    vocabulary. The windows run packed into one row (`pack_rows`), each under its own causal mask and positions.
    """
    draft = _draft_of(model)
    batch = pack_rows(batch)  # (1, N): no padding slot goes through the model
    segments = batch["segments"]
    hidden = None
    if draft.fusion is not None:
        withheld = (
            torch.rand(segments.shape, device=segments.device) < cfg.feature_dropout if cfg.feature_dropout else None
        )
        hidden = paired_features(batch["hidden"], withheld, segments)
    mask = packed_causal_mask(segments, torch.float32)
    out = model(batch["token_ids"], position_ids=batch["position_ids"], attention_mask_4d=mask, target_hidden=hidden)
    ids = draft.target_to_draft(batch["topk_ids"])  # (1, N, k) draft ids, -100 outside the draft vocabulary
    real = batch["mask"].bool()  # (1, N), all true
    argmax = ids[..., 0]  # (1, N): the target's choice of the token after each position
    ce = lookahead_ce_loss(out.logits, out.stream_logits, argmax, cfg.ce_weight, cfg.stream_weight, segments)
    loss, parts = ce, {"ce": ce.item()}
    if cfg.kl_weight:
        kl = _draft_vocab_kl(out.logits, ids, batch["topk_logp"], real)
        loss = loss + cfg.kl_weight * kl
        parts["kl"] = kl.item()
    return loss, parts | {"loss": loss.item()}


def _draft_vocab_kl(
    logits: torch.Tensor, ids: torch.Tensor, topk_logp: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """Mean KL(target top-k restricted to the draft vocabulary, renormalised ‖ draft) over the real positions.

    logits (B, T, V_draft); ids (B, T, k) draft ids, -100 = not in the draft vocabulary; topk_logp (B, T, k);
    real (B, T) bool. A position none of whose top-k the draft can propose is left out. Returns a scalar.
    """
    keep = ids >= 0  # (B, T, k)
    rows = real & keep.any(-1)  # (B, T)
    # A finite stand-in for log 0: after renormalisation the dropped ids' probability underflows to exactly 0, and
    # 0 · (finite) keeps topk_kl_loss's sum finite where -inf would make it NaN.
    logp = topk_logp.masked_fill(~keep, _DROPPED_LOGP)
    kl = topk_kl_loss(logits[rows], ids[rows].clamp(min=0), logp[rows])  # (N,)
    return kl.sum() / rows.sum().clamp(min=1)


@torch.inference_mode()
def evaluate_drafter(model, cache: FeatureCache) -> dict[str, float]:
    """Held-out agreement with the target's greedy choices over the cache's answer positions, each sequence whole.

    top1: P(main argmax at t = the target's argmax at t); stream_j: P(stream j's argmax at t = the target's argmax
    at t+j), over answer positions t whose t+j is in the same sequence; positions: answer positions counted.
    A feature-conditioned draft reads every paired target state (as the first token a window drafts does), and
    also reports top1_without_states: the same with none (a floor for the tokens a rollout drafts later).
    """
    draft = _draft_of(model)
    metrics = _agreement(model, draft, cache, with_states=True)
    if draft.fusion is not None:
        metrics["top1_without_states"] = _agreement(model, draft, cache, with_states=False)["top1"]
    return metrics


def _agreement(model, draft, cache: FeatureCache, with_states: bool) -> dict[str, float]:
    num = 1 + draft.config.num_streams
    hits, counts = torch.zeros(num), torch.zeros(num)
    for s in range(cache.num_sequences):
        lo, hi = int(cache.offsets[s]), int(cache.offsets[s + 1])
        answers = torch.from_numpy(np.array(cache.is_answer[lo:hi]))  # (T,), a copy: the memory map is read-only
        if not answers.any():
            continue
        batch = {k: v.to(draft.device) for k, v in cache.windows([(lo, hi)]).items()}
        states = paired_features(batch["hidden"]) if draft.fusion is not None and with_states else None
        out = model(batch["token_ids"], target_hidden=states)
        guesses = [out.logits[0]] + [out.stream_logits[0, :, j] for j in range(num - 1)]  # each (T, V_draft)
        target_argmax = batch["topk_ids"][0, :, 0].cpu()  # (T,)
        for j, logits in enumerate(guesses):
            guess = draft.draft_to_target(logits.argmax(-1)).cpu()  # (T,) target ids
            n = hi - lo - j  # positions whose label t+j is inside the sequence
            counted = answers[:n]
            hits[j] += (guess[:n] == target_argmax[j:])[counted].sum()
            counts[j] += counted.sum()
    rates = (hits / counts.clamp(min=1)).tolist()
    return {"top1": rates[0], **{f"stream_{j}": rates[j] for j in range(1, num)}, "positions": int(counts[0])}


# --- the artifact ---------------------------------------------------------------------------------------------
def save_draft(model, out_dir, target, metrics: dict | None = None, extra: dict | None = None) -> Path:
    """Export a self-describing draft artifact that `AutoModelForCausalLM.from_pretrained` also loads (after
    `import mirror_train`): config.json + model.safetensors + the target's tokenizer, and mirror_config.json (kind
    "draft", the draft's config, the target's signature, `extra`) + a model card with the held-out `metrics`.

    LoRA adapters are merged into the layers first (this unwraps a peft model in place).
    """
    from safetensors.torch import load_file

    from mirror_train.export import WEIGHTS_FILE, model_card, save_artifact

    draft = model.merge_and_unload() if isinstance(model, PeftModel) else model
    with tempfile.TemporaryDirectory() as tmp:  # save_artifact then writes the lot atomically, its files added
        draft.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        weights = load_file(Path(tmp) / WEIGHTS_FILE)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file() and p.name != WEIGHTS_FILE}
    config = {"model": draft.config.to_dict(), **(extra or {})}
    table = None
    if metrics:  # as evaluate_drafter returns them
        rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in metrics.items() if k != "positions")
        table = (
            f"Agreement with the target's greedy choices on {metrics['positions']} held-out answer positions "
            f"(stream_j: the token j further ahead).\n\n| metric | held-out |\n|---|---|\n{rows}"
        )
    usage = (
        "from mirror_train.drafter_training import load_draft\nfrom mirror_train.target import Target\n\n"
        "target = Target.load(...)  # the target this draft belongs to\ndraft = load_draft(PATH, target)\n"
        "# or, without the check: transformers.AutoModelForCausalLM.from_pretrained(PATH) after `import mirror_train`"
    )
    c = draft.config
    title = f"{c.num_hidden_layers}-layer draft, γ'={c.num_streams} streams, for {target.name_or_path}"
    card = model_card(
        kind=ARTIFACT_KIND, title=title, target=target.signature(), config=config, results_markdown=table, usage=usage
    )
    return save_artifact(
        out_dir,
        kind=ARTIFACT_KIND,
        config=config,
        state_dict=weights,
        target=target.signature(),
        card=card,
        extra_files=files,
    )


def load_draft(path, target) -> MirrorDrafterForCausalLM:
    """Load an exported draft and check that it belongs to `target` (tokenizer, vocabulary, layer count and, for a
    feature-conditioned draft, the hidden state it reads) before it proposes a single token."""
    from transformers import AutoModelForCausalLM

    from mirror_train.export import load_artifact

    load_artifact(path, expected_kind=ARTIFACT_KIND, target=target.signature())  # refuses before the weights load
    draft = AutoModelForCausalLM.from_pretrained(path)
    if not isinstance(draft, MirrorDrafterForCausalLM):
        raise MirrorTrainError(f"{path} holds a {type(draft).__name__}, not a Mirror draft (MirrorDrafterForCausalLM)")
    check_compatible(draft, target)
    return draft.eval()
