"""Proxy-head distillation: the run config, one training step, held-out evaluation.

`recipes/proxy_head.py` strings these together; everything here is importable and tested on its own. The data
(self-distilled answers, teacher-forced prompts, held-out Spec-Bench answers, the feature caches) comes from the
one pipeline every recipe uses, `mirror_train/data/pipeline.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from mirror_train.data.features import FeatureCache
from mirror_train.data.pipeline import DataConfig, cached_layers
from mirror_train.errors import MirrorTrainError
from mirror_train.losses import topk_kl_loss, topk_margin_loss
from mirror_train.metrics import exit_report, merge_reports, topk_label_report
from mirror_train.models.proxy_head import ProxyHeadConfig
from mirror_train.sweep import answer_positions
from mirror_train.timing import median_ms, torch_threads
from mirror_train.training import LogConfig, OptimConfig, TrainConfig

log = logging.getLogger(__name__)


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
    data: DataConfig = field(default_factory=DataConfig)
    train: ProxyTrainConfig = field(default_factory=ProxyTrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)


def data_layers(cfg: ProxyRunConfig, target) -> list[int]:
    """The layers the head's feature caches hold: its ℓe and `data.extra_layers` (another recipe's, to share them)."""
    return cached_layers(cfg.data, [target.check_exit_layer(cfg.head.exit_layer)])


# --- one step and evaluation ----------------------------------------------------------------------------------
def proxy_loss(head, batch: dict[str, torch.Tensor], cfg: ProxyTrainConfig, kappa: int) -> tuple[torch.Tensor, dict]:
    """KL to the target's top-k distribution, plus the optional top-κ hinge; returns (loss, logged parts)."""
    logits, batch = _head_logits(head, batch)
    kl = topk_kl_loss(logits, batch["topk_ids"], batch["topk_logp"], cfg.temperature).mean()
    loss, parts = kl, {"kl": kl.detach()}
    if cfg.margin_weight:
        hinge = topk_margin_loss(logits, batch["topk_ids"][:, 0], kappa, cfg.margin).mean()
        loss = loss + cfg.margin_weight * hinge
        parts["hinge"] = hinge.detach()
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
    device = next(head.parameters()).device
    for s in range(cache.num_sequences):
        lo, hi = int(cache.offsets[s]), int(cache.offsets[s + 1])
        answers = torch.from_numpy(np.array(cache.is_answer[lo:hi])).to(device)  # a copy: memory maps are read-only
        if not answers.any():
            continue
        logits, labels = _head_logits(head, {k: v.to(device) for k, v in cache.windows([(lo, hi)]).items()})
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
    h = torch.randn(1, positions, target.hidden_size, device=target.device)
    with torch_threads(threads), torch.inference_mode():
        full = median_ms(lambda: head(h) if head is not None else target.lens_logits(h))
        adapter = median_ms(lambda: head.adapt(h)) if head is not None else 0.0
    return {"adapter_ms": adapter, "total_ms": full}
