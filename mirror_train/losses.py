"""Distillation losses, as pure functions of logits (shapes in each docstring).

The target's final distribution reaches training as its top-k log-probs (see `data/features.py`). The main loss is
the forward KL from that distribution, renormalised over its top k, to the proxy's full softmax; the optional
margin term pushes the target's argmax into the proxy's top κ, which is what greedy Mirror-SD needs (hit_κ).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_kl_loss(
    proxy_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(p̃_target ‖ q_proxy) per position.

    proxy_logits (N, V); topk_ids (N, k) long; topk_logp (N, k) the target's log-probs of those ids.
    p̃ = softmax(topk_logp / T) over the k ids; q = softmax(proxy_logits / T) over the whole vocabulary.
    Returns (N,), scaled by T² so gradients keep their size across temperatures (Hinton et al.).
    """
    log_q = F.log_softmax(proxy_logits.float() / temperature, dim=-1).gather(-1, topk_ids)  # (N, k)
    log_p = F.log_softmax(topk_logp.float() / temperature, dim=-1)  # (N, k)
    return (log_p.exp() * (log_p - log_q)).sum(-1) * temperature**2


def topk_margin_loss(
    proxy_logits: torch.Tensor, target_ids: torch.Tensor, kappa: int, margin: float = 1.0
) -> torch.Tensor:
    """Hinge that is zero once the target's token beats the proxy's κ-th best other token by `margin`.

    proxy_logits (N, V); target_ids (N,) the target's argmax. Returns (N,).
    """
    z_target = proxy_logits.gather(-1, target_ids[:, None]).squeeze(-1)  # (N,)
    others = proxy_logits.scatter(-1, target_ids[:, None], float("-inf"))
    kth_other = others.topk(kappa, dim=-1).values[:, -1]  # (N,)
    return F.relu(margin + kth_other - z_target)
