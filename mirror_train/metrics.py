"""Early-exit and acceptance metrics, defined once, as pure tensor functions.

Shapes: `proxy_logits` and `final_logits` are (..., V) over the same positions; every per-position function
returns (...). Means over positions are taken by the caller (or by `exit_report`), so held-out sets of any layout
are scored the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from mirror_train.errors import MirrorTrainError


def check_kappa(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise MirrorTrainError(f"κ={k!r} is invalid: the number of top candidates must be an integer ≥ 1")
    return k


def omega(proxy_logits: torch.Tensor, final_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Ω_κ = Σ_{y ∈ Top-κ(p_proxy)} p_final(y): the final distribution's mass on the proxy's top κ."""
    check_kappa(k)
    top = proxy_logits.topk(k, dim=-1).indices
    p_final = final_logits.float().softmax(-1)
    return p_final.gather(-1, top).sum(-1)


def hit(proxy_logits: torch.Tensor, final_logits: torch.Tensor, k: int) -> torch.Tensor:
    """hit_κ = 1[argmax p_final ∈ Top-κ(p_proxy)], as a float per position (what greedy decoding needs)."""
    check_kappa(k)
    top = proxy_logits.topk(k, dim=-1).indices
    return (top == final_logits.argmax(-1, keepdim=True)).any(-1).float()


def top1_agreement(proxy_logits: torch.Tensor, final_logits: torch.Tensor) -> torch.Tensor:
    """1[argmax p_proxy = argmax p_final] per position; equals hit_1."""
    return (proxy_logits.argmax(-1) == final_logits.argmax(-1)).float()


def oracle_omega(final_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Ω_κ of a perfect proxy: the final distribution's own top-κ mass (the ceiling for any head)."""
    check_kappa(k)
    return final_logits.float().softmax(-1).topk(k, dim=-1).values.sum(-1)


def kl_divergence(final_logits: torch.Tensor, proxy_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(p_final ‖ p_proxy) per position, both distributions softened by the same temperature."""
    if temperature <= 0:
        raise MirrorTrainError(f"temperature must be > 0, got {temperature}")
    log_p = F.log_softmax(final_logits.float() / temperature, -1)
    log_q = F.log_softmax(proxy_logits.float() / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def exit_report(
    proxy_logits: torch.Tensor, final_logits: torch.Tensor, kappas: Sequence[int] = (1, 4, 8)
) -> dict[str, float]:
    """Mean Ω_κ, hit_κ and oracle Ω_κ for each κ, plus top-1 agreement and KL, over all positions."""
    report = {"positions": int(final_logits.shape[:-1].numel())}
    for k in kappas:
        report[f"omega_{k}"] = omega(proxy_logits, final_logits, k).mean().item()
        report[f"hit_{k}"] = hit(proxy_logits, final_logits, k).mean().item()
        report[f"oracle_omega_{k}"] = oracle_omega(final_logits, k).mean().item()
    report["top1"] = top1_agreement(proxy_logits, final_logits).mean().item()
    report["kl"] = kl_divergence(final_logits, proxy_logits).mean().item()
    return report


def merge_reports(reports: Iterable[dict[str, float]]) -> dict[str, float]:
    """Position-weighted mean of `exit_report`s computed on chunks (so long texts need not fit in one tensor)."""
    reports = list(reports)
    total = sum(r["positions"] for r in reports)
    if total == 0:
        raise MirrorTrainError("no positions to score")
    keys = [k for k in reports[0] if k != "positions"]
    merged = {k: sum(r[k] * r["positions"] for r in reports) / total for k in keys}
    merged["positions"] = total
    return merged


def mean_accepted_tokens(accept_lengths: Sequence[int]) -> float:
    """Spec-Bench's mean accepted tokens: committed tokens per target verification, bonus token included."""
    if not accept_lengths:
        raise MirrorTrainError("no decoding steps to average")
    return sum(accept_lengths) / len(accept_lengths)


def topk_label_report(
    proxy_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor, kappas: Sequence[int] = (1, 4, 8)
) -> dict[str, float]:
    """`exit_report` when the final distribution is known only by its top-k log-probs (cached labels).

    hit_κ and top-1 are exact (the argmax is `topk_ids[:, 0]`); oracle Ω_κ is exact for κ ≤ k; Ω_κ counts only
    the proxy's picks that lie in the target's top k, so it is a lower bound (the rest holds little mass).
    """
    report = {"positions": int(topk_ids.shape[0])}
    p_top = topk_logp.float().exp()  # (N, k)
    proxy_top = proxy_logits.topk(max(kappas), dim=-1).indices  # (N, κmax)
    # member[n, i, j] = proxy's i-th pick is the target's j-th top token
    member = proxy_top[:, :, None] == topk_ids[:, None, :]  # (N, κmax, k)
    mass_at_pick = (member.float() * p_top[:, None, :]).sum(-1)  # (N, κmax)
    for kappa in kappas:
        check_kappa(kappa)
        report[f"omega_{kappa}"] = mass_at_pick[:, :kappa].sum(-1).mean().item()
        report[f"hit_{kappa}"] = member[:, :kappa, 0].any(-1).float().mean().item()
        report[f"oracle_omega_{kappa}"] = p_top[:, :kappa].sum(-1).mean().item()
    report["top1"] = (proxy_top[:, 0] == topk_ids[:, 0]).float().mean().item()
    return report
