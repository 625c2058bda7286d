"""Distilling the Speculative-Streaming draft from the target: run config, draft set-up, loss, evaluation, artifact.

`recipes/drafter.py` strings these together; everything here is importable and tested on its own.

Data: the one pipeline (`data/pipeline.py`): self-distilled answers, teacher-forced prompts and held-out Spec-Bench
answers, cached once per target. Each cached position t holds the input token x_t, the target's top-k next-token
log-probs (its distribution over x_{t+1}) and its hidden states at ℓe and, for the freshest features, at the top
(read only by a feature-conditioned draft). The draft trains on the target's own choices, never on the human text:
    main stream at t   kl_weight · KL(target top-k at t ‖ draft) + ce_weight · CE(target argmax at t)
    stream j at t      α · CE(target argmax at t+j), the target's next-token choice j positions later
Training-time test (EAGLE-3; `train.ttt_steps` = K > 0): after the pass over the true context (step 0, every
position reading the target's states of its predecessor), K more passes each move the rollout one token on: at
step k the input at p reads, in the own slot, the draft's step k−1 state at p−1, and attends to the step-0
positions ≤ p−k (the committed context the rollout started from) and to its own chain (p−k+j at step j ≤ k),
exactly what a token the draft drafted k−1 tokens after a committed one sees when served. Its main stream is
trained on the same label, weighted ttt_decay^k. The window a Mirror-SD branch hangs off has the target's ℓe
states but no final ones: in each batch the first m ~ U{0..K} steps also read the ℓe state (`ttt_window_states`).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from mirror_train.data.features import FeatureCache, pack_rows
from mirror_train.data.pipeline import DataConfig, cached_layers, feature_dirs
from mirror_train.data.selfdistill import answer_sequences, load_selfdistill
from mirror_train.datastore import Datastore, DatastoreConfig
from mirror_train.errors import MirrorTrainError
from mirror_train.losses import lookahead_ce_loss, topk_kl_loss
from mirror_train.models.drafter import MirrorDrafterForCausalLM, paired_features
from mirror_train.models.drafter_config import FEATURE_SLOTS, TARGET_SLOTS
from mirror_train.models.multi_stream_attention import packed_causal_mask, ttt_mask
from mirror_train.signature import tokenizer_fingerprint
from mirror_train.target import Target
from mirror_train.training import LogConfig, OptimConfig, TrainConfig
from mirror_train.vocab import frequent_token_map

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # decoder layers only
_DROPPED_LOGP = -1e4  # log-prob of a top-k id outside the draft's vocabulary (see `_draft_vocab_kl`)


@dataclass
class DrafterModelConfig:
    init: str = "target"  # "target": its embeddings, num_layers of its layers, final norm, LM head; "scratch":
    # the same shapes, random; else the path or Hub id of a small Llama-shaped model with the target's tokenizer
    num_layers: int = 4
    source_layers: Literal["first", "last"] | list[int] = "first"  # which layers of the target (or donor): 1-based
    num_streams: int = 2  # γ': lookahead streams, so one forward proposes 1 + γ' tokens
    num_stream_layers: int = 1  # N_s: the top N_s layers carry the streams
    draft_vocab_size: int | None = None  # None: the whole vocabulary; else the most frequent ids (EAGLE-3's d2t)
    feature_conditioning: Literal["none", "target_hidden"] = "none"  # target_hidden: also read the target's states
    # target_hidden: which states each input reads (models/drafter.py): ["exit"] the target's ℓe state (ℓe-only);
    # + "final" its final state where the target has finished a token (the freshest features); + "own" the draft's
    # own state where no target state exists (the tokens it rolls out; train with train.ttt_steps > 0)
    feature_slots: list[str] = field(default_factory=lambda: ["exit"])
    # ℓe of the feature cache (and of the conditioning): the proxy head's, as the engine splits the target there once;
    # None: N/2 (the paper's; the testbed's recipes set 12, docs/proxy_head.md)
    exit_layer: int | None = None
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
        if any(s not in FEATURE_SLOTS for s in self.feature_slots) or not set(self.feature_slots) & set(TARGET_SLOTS):
            raise MirrorTrainError(
                f"model.feature_slots: names among {', '.join(FEATURE_SLOTS)}, at least one of exit and final; "
                f"got {self.feature_slots}"
            )


@dataclass
class DrafterTrainConfig(TrainConfig):
    """Batches are packed from whole context windows (`window`)."""

    kl_weight: float = 1.0  # main stream: KL to the target's top-k distribution
    ce_weight: float = 0.0  # main stream: CE on the target's argmax
    stream_weight: float = 0.1  # α_j of every lookahead stream (the paper's value)
    feature_dropout: float = 0.2  # feature-conditioned drafts: the share of positions trained without their target
    # state, as the tokens a rollout drafts past the first have none (then one missing state in a row is 20% of
    # positions, two 4%); with training-time test the rollout's tokens are trained as served instead
    ttt_steps: int = 0  # training-time test (module docstring): rollout steps trained past the true context; 0 = off
    ttt_decay: float = 0.8  # step k's loss weight is ttt_decay^k (EAGLE-3's)
    ttt_window_states: bool = True  # the first m ~ U{0..K} steps also read the ℓe state, as a Mirror-SD window does

    def validate(self) -> None:
        super().validate()
        if min(self.kl_weight, self.ce_weight, self.stream_weight) < 0 or not self.kl_weight + self.ce_weight > 0:
            raise MirrorTrainError("train: loss weights must be ≥ 0, and kl_weight or ce_weight > 0 (the main stream)")
        if not 0 <= self.feature_dropout < 1:
            raise MirrorTrainError(f"train.feature_dropout must be in [0, 1), got {self.feature_dropout}")
        if self.ttt_steps < 0 or not 0 < self.ttt_decay <= 1:
            raise MirrorTrainError(
                f"train: ttt_steps ≥ 0 and ttt_decay in (0, 1], got {self.ttt_steps} and {self.ttt_decay}"
            )


@dataclass
class DraftDatastoreConfig(DatastoreConfig):
    """The datastore exported beside the draft (datastore.py)."""

    enabled: bool = True  # export the target's answers as an n-gram datastore with the draft (sd and mirror read it)


@dataclass
class DrafterRunConfig:
    output_dir: str = "outputs/drafter_smollm2"
    target: str = "testbed"
    model: DrafterModelConfig = field(default_factory=DrafterModelConfig)
    data: DataConfig = field(default_factory=DataConfig)  # shared with the proxy head when the settings agree
    train: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    datastore: DraftDatastoreConfig = field(default_factory=DraftDatastoreConfig)


# --- data -----------------------------------------------------------------------------------------------------
def data_layers(cfg: DrafterRunConfig, target) -> tuple[int, list[int]]:
    """(ℓe, the layers the draft's feature caches hold): ℓe always (so a proxy head at the same ℓe shares the cache),
    the target's final layer N when the draft reads the final slot, and `data.extra_layers`."""
    exit_layer = cfg.model.exit_layer if cfg.model.exit_layer is not None else target.num_layers // 2
    exit_layer = target.check_exit_layer(exit_layer)
    final = [target.num_layers] if _reads_final(cfg.model) else []
    return exit_layer, cached_layers(cfg.data, [exit_layer, *final])


def open_caches(cfg: DrafterRunConfig, target) -> tuple[FeatureCache, FeatureCache]:
    """The train and held-out feature caches `prepare_data` built for this draft (`data_layers`), opened on ℓe and,
    for the final slot, on layer N (as `final`); both must hold the token ids."""
    exit_layer, layers = data_layers(cfg, target)
    extra = {"final": target.num_layers} if _reads_final(cfg.model) else None
    caches = tuple(FeatureCache(path, exit_layer, extra) for path in feature_dirs(cfg.data, layers))
    for cache in caches:
        if cache.token_ids is None:
            raise MirrorTrainError(
                f"{cache.path} predates cached token ids, which drafts train on; delete it to rebuild"
            )
    return caches


def _reads_final(model: DrafterModelConfig) -> bool:
    return model.feature_conditioning == "target_hidden" and "final" in model.feature_slots


def build_datastore(cfg: DrafterRunConfig) -> Datastore | None:
    """The datastore of the target's own answers (the data's self-distilled set) exported beside the draft, or None
    where `datastore.enabled` is off."""
    if not cfg.datastore.enabled:
        return None
    answers = load_selfdistill(Path(cfg.data.dir) / "selfdistill")
    return Datastore.build(answer_sequences(answers, cfg.datastore.prompt_tail), cfg.datastore)


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
    donor = MirrorDrafterForCausalLM.from_target(
        source, cfg.num_layers, cfg.num_streams, cfg.num_stream_layers, vocab, source_layers=cfg.source_layers
    )
    config = copy.deepcopy(donor.config)
    config.target = target.signature().to_dict()
    if cfg.feature_conditioning == "target_hidden":
        config.feature_conditioning = cfg.feature_conditioning
        config.feature_slots = list(cfg.feature_slots)
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
def target_states(draft, batch: dict[str, torch.Tensor], withheld: torch.Tensor | None = None) -> dict | None:
    """What each position of a packed batch reads from the target at step 0 (EAGLE-paired: the state of t−1): its
    ℓe state (exit slot) and final state (final slot), as the draft's slots ask; None for a token-only draft."""
    if draft.fusion is None:
        return None
    segments = batch.get("segments")
    sources = {"exit": "hidden", "final": "final"}
    return {
        slot: paired_features(batch[sources[slot]], withheld, segments)
        for slot in draft.config.slots
        if slot in sources
    }


def ttt_rows(batch: dict[str, torch.Tensor], steps: int) -> list[torch.Tensor]:
    """The packed positions each step runs at: step 0 at all; step k ≥ 1 at the p whose chain starts inside its
    sequence (position_ids[p] ≥ k) and, where the batch says which positions are the target's answers, at an
    answer (the engine rolls out only after committed answer tokens, so the prompt's positions would be wasted)."""
    positions = batch["position_ids"][0]
    answer = batch.get("is_answer")
    rows = [torch.arange(len(positions), device=positions.device)]
    for k in range(1, steps + 1):
        ok = positions >= k
        if answer is not None:
            first = torch.arange(len(positions), device=positions.device) - k + 1  # the chain's first token
            ok &= answer[0].bool()[first.clamp(min=0)]
        rows.append(torch.nonzero(ok).flatten())
    return rows


def unrolled_forward(model, draft, batch: dict[str, torch.Tensor], states, steps: int, window_steps: int = 0):
    """Step 0 over the true context, then `steps` training-time-test steps (module docstring) over a packed row.

    batch: packed (`pack_rows`), (1, N) token_ids, position_ids, segments (and is_answer: the steps ≥ 1 run at
    answer positions only, `ttt_rows`); states: step 0's target states (slot → (1, N, w)) or None. Steps
    1..window_steps also read the ℓe state (a Mirror-SD window). Returns the outputs of steps 0..steps and the
    packed positions each ran at.
    """
    segments, positions, tokens = batch["segments"], batch["position_ids"], batch["token_ids"]
    rows = ttt_rows(batch, steps)
    cache = draft.new_cache() if steps else None
    out = model(
        tokens,
        position_ids=positions,
        attention_mask_4d=packed_causal_mask(segments, torch.float32),
        features=states,
        cache=cache,
    )
    outs = [out]
    slots = draft.config.slots
    for k in range(1, steps + 1):
        q = rows[k]
        where = torch.full_like(positions[0], -1)
        where[rows[k - 1]] = torch.arange(len(rows[k - 1]), device=q.device)
        features = {}
        if "own" in slots:
            features["own"] = out.hidden[:, where[q - 1]]  # the state that predicted x_p, one step earlier
        if k <= window_steps and "exit" in slots:
            features["exit"] = states["exit"][:, q]
        out = model(
            tokens[:, q],
            position_ids=positions[:, q],
            attention_mask_4d=ttt_mask(segments, rows, k, torch.float32),
            features=features or None,
            cache=cache,
            num_streams=0,
        )
        outs.append(out)
    return outs, rows


def drafter_loss(model, batch: dict[str, torch.Tensor], cfg: DrafterTrainConfig) -> tuple[torch.Tensor, dict]:
    """kl_weight · KL + ce_weight · CE on the main stream, + α Σ_j CE on the lookahead streams, + the
    training-time-test steps' main-stream losses weighted ttt_decay^k (module docstring); returns (loss, logged
    parts: kl, ce = the weighted CE terms of step 0, ttt = the weighted steps ≥ 1, loss).

    model: the draft, possibly wrapped (accelerate, peft). batch, as `FeatureCache.windows` gives it: token_ids
    (B, T), mask (B, T) 1 = real position, topk_ids / topk_logp (B, T, k) the target's distribution over the token
    after each position, hidden (B, T, H_target) the ℓe states and, for the final slot, final (B, T, H_target)
    (read only by a feature-conditioned draft, paired: the input at t reads the states of t−1, and a
    `feature_dropout` share of positions reads none). Stream j at t is labelled by topk_ids[t+j, 0]: padding and
    labels past the window's end are ignored, as is an argmax outside a reduced vocabulary. The windows run packed
    into one row (`pack_rows`), each under its own causal mask and positions.
    """
    draft = _draft_of(model)
    batch = pack_rows(batch)  # (1, N): no padding slot goes through the model
    segments = batch["segments"]
    withheld = None
    if draft.fusion is not None and cfg.feature_dropout:
        withheld = torch.rand(segments.shape, device=segments.device) < cfg.feature_dropout
    states = target_states(draft, batch, withheld)
    steps = cfg.ttt_steps if draft.fusion is not None else 0  # a token-only draft reads nothing to roll forward
    window = int(torch.randint(0, steps + 1, ())) if steps and cfg.ttt_window_states else 0
    outs, rows = unrolled_forward(model, draft, batch, states, steps, window)
    ids = draft.target_to_draft(batch["topk_ids"])  # (1, N, k) draft ids, -100 outside the draft vocabulary
    real = batch["mask"].bool()  # (1, N), all true
    argmax = ids[..., 0]  # (1, N): the target's choice of the token after each position
    out = outs[0]
    ce = lookahead_ce_loss(out.logits, out.stream_logits, argmax, cfg.ce_weight, cfg.stream_weight, segments)
    loss, parts = ce, {"ce": ce.detach()}
    if cfg.kl_weight:
        kl = _draft_vocab_kl(out.logits, ids, batch["topk_logp"], real)
        loss = loss + cfg.kl_weight * kl
        parts["kl"] = kl.detach()
    if steps:
        ttt = loss.new_zeros(())
        for k, out in enumerate(outs[1:], start=1):
            q = rows[k]
            if not len(q):
                continue
            step = lookahead_ce_loss(out.logits, None, argmax[:, q], cfg.ce_weight, 0.0)
            if cfg.kl_weight:
                kl = _draft_vocab_kl(out.logits, ids[:, q], batch["topk_logp"][:, q], real[:, q])
                step = step + cfg.kl_weight * kl
            ttt = ttt + cfg.ttt_decay**k * step
        loss = loss + ttt
        parts["ttt"] = ttt.detach()
    return loss, parts | {"loss": loss.detach()}


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


EVAL_DEPTH = 4  # rollout steps scored held out: windows of 5 drafted tokens


@torch.inference_mode()
def evaluate_drafter(model, cache: FeatureCache, depth: int = EVAL_DEPTH) -> dict[str, float]:
    """Held-out agreement with the target's greedy choices over the cache's answer positions, each sequence whole.

    top1: P(main argmax at t = the target's argmax at t), every paired target state read (the first token a window
    drafts after a committed one); stream_j: P(stream j's argmax at t = the target's argmax at t+j), over answer
    positions t whose t+j is in the same sequence; chain_k: the same for the token the draft rolls out k steps
    after a committed answer position, reading what serving gives it there (its own states, or nothing), on the
    true context; accept_len: the mean number of leading tokens of a (depth+1)-token window rolled out that way
    that the target keeps (what serial SD keeps a window, bonus token excluded, were every window to start at a
    committed position); positions: answer positions counted. A feature-conditioned draft also reports
    top1_without_states: top1 with no target state at all.
    """
    draft = _draft_of(model)
    metrics = _agreement(model, draft, cache, True, depth if draft.fusion is not None else 0, depth)
    if draft.fusion is not None:
        metrics["top1_without_states"] = _agreement(model, draft, cache, False, 0, 0)["top1"]
    return metrics


def _agreement(model, draft, cache: FeatureCache, with_states: bool, steps: int, depth: int) -> dict[str, float]:
    num = 1 + draft.config.num_streams
    hits, counts = torch.zeros(num), torch.zeros(num)
    chain_hits, chain_counts = torch.zeros(depth + 1), torch.zeros(depth + 1)
    accepted, windows = 0.0, 0
    for s in range(cache.num_sequences):
        lo, hi = int(cache.offsets[s]), int(cache.offsets[s + 1])
        answers = torch.from_numpy(np.array(cache.is_answer[lo:hi]))  # (T,), a copy: the memory map is read-only
        if not answers.any():
            continue
        batch = pack_rows({k: v.to(draft.device) for k, v in cache.windows([(lo, hi)]).items()})
        states = target_states(draft, batch) if with_states else None
        outs, rows = unrolled_forward(model, draft, batch, states, steps)
        out = outs[0]
        guesses = [out.logits[0]] + [out.stream_logits[0, :, j] for j in range(num - 1)]  # each (T, V_draft)
        target_argmax = batch["topk_ids"][0, :, 0].cpu()  # (T,)
        for j, logits in enumerate(guesses):
            guess = draft.draft_to_target(logits.argmax(-1)).cpu()  # (T,) target ids
            n = hi - lo - j  # positions whose label t+j is inside the sequence
            counted = answers[:n]
            hits[j] += (guess[:n] == target_argmax[j:])[counted].sum()
            counts[j] += counted.sum()
        if not depth:
            continue
        # correct[k][a]: the token drafted k steps after anchor a (step k at position a + k) is the target's
        T = hi - lo
        correct = []
        for k in range(depth + 1):
            step = min(k, len(outs) - 1)  # a draft that reads nothing rolls forward as step 0
            guess = torch.full((T,), -1, dtype=torch.long)
            guess[rows[step].cpu()] = draft.draft_to_target(outs[step].logits[0].argmax(-1)).cpu()
            correct.append(guess[k:] == target_argmax[k:])  # (T − k,), indexed by the anchor
        anchors = answers[: T - depth]  # answer positions with a whole window inside the sequence
        run = torch.ones(T - depth, dtype=torch.bool)
        for k in range(depth + 1):
            run &= correct[k][: T - depth]
            chain_hits[k] += (correct[k][: T - depth] & anchors).sum()
            chain_counts[k] += anchors.sum()
            accepted += float((run & anchors).sum())
        windows += int(anchors.sum())
    rates = (hits / counts.clamp(min=1)).tolist()
    metrics = {"top1": rates[0], **{f"stream_{j}": rates[j] for j in range(1, num)}}
    chain = (chain_hits / chain_counts.clamp(min=1)).tolist()
    metrics |= {f"chain_{k}": chain[k] for k in range(1, depth + 1)}
    if depth:
        metrics["accept_len"] = accepted / max(windows, 1)
    return metrics | {"positions": int(counts[0])}
