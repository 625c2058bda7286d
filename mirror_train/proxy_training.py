"""Proxy-head distillation: the run config, the data it needs, one training step, held-out evaluation.

`recipes/proxy_head.py` strings these together; everything here is importable and tested on its own.

Data (each stage resumes or is skipped when already done, under `data.dir`):
1. self-distillation: the target answers `data.selfdistill.num_prompts` training prompts (its own text: what the
   engine sees at decode time);
2. teacher forcing: `data.forced_prompts` further prompts, prompt text only, at prefill speed (~15× more
   positions per second than generating);
3. held-out: the target's own greedy answers to a sample of Spec-Bench questions, never trained on;
4. feature caches of (1+2) and (3): ℓe states and top-k final log-probs (`data/features.py`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from mirror_train.data.features import FeatureCache, FeatureCacheConfig, TokenSequence, build_feature_cache
from mirror_train.data.selfdistill import SelfDistillConfig, generate_selfdistill, load_selfdistill
from mirror_train.errors import MirrorTrainError
from mirror_train.generation import encode_chat
from mirror_train.losses import topk_kl_loss, topk_margin_loss
from mirror_train.metrics import merge_reports, topk_label_report
from mirror_train.models.proxy_head import ProxyHeadConfig
from mirror_train.prompts import default_specbench_file, load_prompts
from mirror_train.training import LogConfig, OptimConfig, TrainConfig, batch_indices

log = logging.getLogger(__name__)


def _heldout_default() -> SelfDistillConfig:
    return SelfDistillConfig(prompts=None, num_prompts=60, seed=1, max_new_tokens=128)


@dataclass
class ProxyDataConfig:
    dir: str = "outputs/data/smollm2"  # shared by runs on the same target, so heads of every kind reuse it
    selfdistill: SelfDistillConfig = field(default_factory=SelfDistillConfig)
    forced_prompts: int = 1500  # more training prompts, teacher-forced without answers; 0 = none
    heldout: SelfDistillConfig = field(default_factory=_heldout_default)  # prompts: None = Spec-Bench questions
    extra_exit_layers: list[int] = field(default_factory=list)  # also cache these (for ℓe sweeps)
    top_k: int = 32
    max_tokens_per_batch: int = 4096
    train_on: Literal["all", "answers"] = "all"  # which cached positions to train on
    answer_repeat: int = 1  # with train_on=all: answer positions appear this many times per epoch (the
    # held-out metric is measured on answers, the target's own text, which the forced prompts lack)
    # The precision the target runs in to make the *training* data (answers, ℓe states, top-k labels): on CPUs with
    # AMX bfloat16 makes it 1.7x (answers) to 3.7x (teacher forcing) faster, with argmax labels 96.7% equal to
    # float32's (docs/proxy_head.md). Held-out data is always made in the precision the target is served in.
    dtype: Literal["float32", "bfloat16"] = "float32"


@dataclass
class ProxyTrainConfig(TrainConfig):
    temperature: float = 1.0
    margin_weight: float = 0.0  # weight of the top-κ hinge beside the KL
    margin: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.temperature <= 0 or self.margin_weight < 0:
            raise MirrorTrainError("train: temperature > 0 and margin_weight ≥ 0")


@dataclass
class ProxyRunConfig:
    output_dir: str = "outputs/proxy_head_smollm2"
    target: str = "testbed"
    head: ProxyHeadConfig = field(default_factory=ProxyHeadConfig)
    data: ProxyDataConfig = field(default_factory=ProxyDataConfig)
    train: ProxyTrainConfig = field(default_factory=ProxyTrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)


# --- data -----------------------------------------------------------------------------------------------------
def _layers_tag(layers: list[int]) -> str:
    return "L" + "-".join(str(x) for x in sorted(set(layers)))


def feature_dirs(cfg: ProxyRunConfig) -> tuple[Path, Path]:
    """Where `prepare_data` puts the train and held-out feature caches (without doing any work)."""
    tag = _layers_tag([cfg.head.exit_layer, *cfg.data.extra_exit_layers])
    root = Path(cfg.data.dir)
    return root / f"features_train_{tag}", root / f"features_heldout_{tag}"


def prepare_data(cfg: ProxyRunConfig, target) -> tuple[Path, Path]:
    """Run (or resume, or skip) every data stage; return the train and held-out feature cache directories.

    Runs that share a data directory (the proxy head and the draft, or two drafts launched side by side) take turns:
    the first builds what is missing, the others wait on a lock and then find it done.
    """
    root = Path(cfg.data.dir)
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / ".lock"):
        return _prepare_data(cfg, target, root)


@contextmanager
def exclusive(path: Path):
    """An advisory lock on `path` held for the block (POSIX `flock`; elsewhere no lock)."""
    try:
        import fcntl
    except ImportError:  # Windows: concurrent runs on one data directory are the user's to avoid
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _prepare_data(cfg: ProxyRunConfig, target, root: Path) -> tuple[Path, Path]:
    data = cfg.data
    layers = sorted({cfg.head.exit_layer, *data.extra_exit_layers})
    features = FeatureCacheConfig(exit_layers=layers, top_k=data.top_k, max_tokens_per_batch=data.max_tokens_per_batch)
    train_dir, heldout_dir = feature_dirs(cfg)
    maker = target.cast(getattr(torch, data.dtype))

    sd = load_selfdistill(generate_selfdistill(data.selfdistill, root / "selfdistill", maker))
    sequences = [TokenSequence(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in sd]
    if data.forced_prompts:
        used = set(sd["id"])
        forced = load_prompts(
            data.selfdistill.prompts, data.forced_prompts, seed=data.selfdistill.seed + 1, exclude=used
        )
        for p in forced:  # the first user turn under the chat template (later turns would need answers)
            ids = encode_chat(target.tokenizer, [{"role": "user", "content": t} for t in p.turns[:1]])
            ids = ids[-data.selfdistill.max_prompt_tokens :]
            sequences.append(TokenSequence(ids, len(ids)))
    sources = {"selfdistill": str(root / "selfdistill"), "forced_prompts": data.forced_prompts}
    build_feature_cache(maker, sequences, train_dir, features, sources)
    del maker

    heldout_cfg = data.heldout
    if heldout_cfg.prompts is None:
        heldout_cfg.prompts = str(default_specbench_file())
    held = load_selfdistill(generate_selfdistill(heldout_cfg, root / "heldout", target))
    held_seqs = [TokenSequence(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in held]
    build_feature_cache(target, held_seqs, heldout_dir, features, {"heldout": str(root / "heldout")})
    return train_dir, heldout_dir


class PositionSampler:
    """Batches of independent positions (per-position heads): the batch at step s depends on (seed, s) alone."""

    def __init__(self, cache: FeatureCache, positions: np.ndarray, batch_size: int, seed: int):
        self.cache, self.positions, self.batch_size, self.seed = cache, positions, batch_size, seed
        self.steps_per_epoch = max(len(positions) // batch_size, 1)

    def batch(self, step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
        idx = batch_indices(step, len(self.positions), self.batch_size, self.seed, rank, world)
        return self.cache.batch(self.positions[idx])


class WindowSampler:
    """Batches of whole context windows (heads that attend over the context): windows of up to `window` positions
    cut from each cached sequence, shuffled per epoch by (seed + epoch) and packed up to `batch_size` positions.
    Windows holding answer positions appear `answer_repeat` times an epoch (as `training_positions` repeats them)."""

    def __init__(self, cache: FeatureCache, batch_size: int, seed: int, window: int = 1024, answer_repeat: int = 1):
        self.cache, self.batch_size, self.seed = cache, batch_size, seed
        spans = []
        answers = np.asarray(cache.is_answer)
        for s in range(cache.num_sequences):
            lo, hi = int(cache.offsets[s]), int(cache.offsets[s + 1])
            for a in range(lo, hi, window):
                b = min(a + window, hi)
                spans += [(a, b)] * (max(answer_repeat, 1) if answers[a:b].any() else 1)
        self.spans = np.array(spans, dtype=np.int64)
        self._plans: dict[int, list[list[int]]] = {}
        self.steps_per_epoch = len(self._plan(0))

    def _plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            order = np.random.default_rng(self.seed + epoch).permutation(len(self.spans))
            packs, current, size = [], [], 0
            for i in order:
                n = int(self.spans[i, 1] - self.spans[i, 0])
                if current and size + n > self.batch_size:
                    packs.append(current)
                    current, size = [], 0
                current.append(int(i))
                size += n
            self._plans[epoch] = packs + ([current] if current else [])
        return self._plans[epoch]

    def batch(self, step: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
        epoch = 0
        while step >= len(self._plan(epoch)):
            step -= len(self._plan(epoch))
            epoch += 1
        chosen = self._plan(epoch)[step][rank::world] or self._plan(epoch)[step][:1]
        return self.cache.windows([tuple(self.spans[i]) for i in chosen])


def training_positions(cache: FeatureCache, train_on: str, answer_repeat: int = 1) -> np.ndarray:
    """Cached rows an epoch visits: all positions (answers repeated `answer_repeat` times) or answers only."""
    answers = cache.positions(answers_only=True)
    if train_on == "answers":
        positions = answers
    else:
        positions = np.concatenate([cache.positions(), *[answers] * max(answer_repeat - 1, 0)])
    if len(positions) == 0:
        raise MirrorTrainError(f"{cache.path} has no {train_on} positions to train on")
    return positions


# --- one step and evaluation ----------------------------------------------------------------------------------
def proxy_loss(head, batch: dict[str, torch.Tensor], cfg: ProxyTrainConfig, kappa: int) -> tuple[torch.Tensor, dict]:
    """KL to the target's top-k distribution, plus the optional top-κ hinge; returns (loss, logged parts)."""
    logits, batch = _head_logits(head, batch)
    kl = topk_kl_loss(logits, batch["topk_ids"], batch["topk_logp"], cfg.temperature).mean()
    loss, parts = kl, {"kl": kl.item()}
    if cfg.margin_weight:
        hinge = topk_margin_loss(logits, batch["topk_ids"][:, 0], kappa, cfg.margin).mean()
        loss = loss + cfg.margin_weight * hinge
        parts["hinge"] = hinge.item()
    return loss, parts


def _head_logits(head, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(N, V) logits at the batch's real positions, and the batch's labels flattened to match.

    Position batches are (N, H) already; window batches are (B, T, H) with a padding `mask` (B, T)."""
    if "mask" not in batch:
        return head(batch["hidden"]), batch
    keep = batch["mask"].bool()
    logits = head(batch["hidden"], attention_mask=batch["mask"])[keep]
    return logits, {k: v[keep] for k, v in batch.items() if k not in ("hidden", "mask")}


@torch.inference_mode()
def evaluate(head, cache: FeatureCache, kappas=(1, 4, 8)) -> dict[str, float]:
    """Held-out Ω_κ (lower bound from top-k labels), hit_κ, top-1 and KL over the cache's answer positions,
    each sequence run whole so that heads attending over the context see all of it."""
    reports, kl_sum, n = [], 0.0, 0
    for s in range(cache.num_sequences):
        lo, hi = int(cache.offsets[s]), int(cache.offsets[s + 1])
        answers = torch.from_numpy(np.array(cache.is_answer[lo:hi]))  # a copy: memory maps are read-only
        if not answers.any():
            continue
        logits, labels = _head_logits(head, cache.windows([(lo, hi)]))
        logits, labels = logits[answers], {k: v[answers] for k, v in labels.items()}
        reports.append(topk_label_report(logits, labels["topk_ids"], labels["topk_logp"], kappas))
        kl_sum += topk_kl_loss(logits, labels["topk_ids"], labels["topk_logp"]).sum().item()
        n += int(answers.sum())
    report = merge_reports(reports)
    report["kl"] = kl_sum / n
    return report


# --- exact held-out evaluation and cost (benchmarks) -----------------------------------------------------------
@torch.inference_mode()
def evaluate_exact(target, heads: dict, rows, exit_layer: int, kappas=(1, 4, 8)) -> dict[str, dict[str, dict]]:
    """Exact Ω_κ/hit_κ of each head against the target's full final distribution on held-out answer positions.

    `heads` maps a name to a bound head (or None for the logit lens); `rows` are self-distilled rows
    (`prompt_ids`, `answer_ids`, `category`). Returns {name: {"all": report, category: report, ...}}, plus the
    oracle under the name "oracle".
    """
    from mirror_train.metrics import exit_report
    from mirror_train.sweep import answer_positions

    parts: dict[str, dict[str, list]] = {name: {} for name in [*heads, "oracle"]}
    for row in rows:
        if not row["answer_ids"]:
            continue
        ids = torch.tensor([row["prompt_ids"] + row["answer_ids"]], device=target.device)
        hidden, logits = target.hidden_states(ids)
        span = answer_positions(len(row["prompt_ids"]), len(row["answer_ids"]))
        final, h = logits[0, span], hidden[exit_layer][0]
        for name, head in heads.items():  # heads see the whole sequence (attention heads read the context)
            proxy = (target.lens_logits(h) if head is None else head(h))[span]
            parts[name].setdefault(row.get("category") or "all", []).append(exit_report(proxy, final, kappas))
        parts["oracle"].setdefault(row.get("category") or "all", []).append(exit_report(final, final, kappas))
    out = {}
    for name, by_cat in parts.items():
        out[name] = {cat: merge_reports(reports) for cat, reports in sorted(by_cat.items())}
        out[name]["all"] = merge_reports([r for reports in by_cat.values() for r in reports])
    return out


def head_cost_ms(head, target, positions: int = 8, threads: int = 1) -> dict[str, float]:
    """Median ms of the head on one verification window of `positions` ℓe states, on `threads` cores:
    the adapter alone, and adapter + final norm + LM head (what the engine pays)."""
    from mirror_train.timing import median_ms, torch_threads

    h = torch.randn(1, positions, target.hidden_size, device=target.device)
    with torch_threads(threads), torch.inference_mode():
        full = median_ms(lambda: head(h) if head is not None else target.lens_logits(h))
        adapter = median_ms(lambda: head.adapt(h)) if head is not None else 0.0
    return {"adapter_ms": adapter, "total_ms": full}
