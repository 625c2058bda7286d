"""Distillation and streaming losses, as pure functions of logits (shapes in each docstring).

The target's final distribution reaches training as its top-k log-probs (see `data/features.py`). The main loss is
the forward KL from that distribution, renormalised over its top k, to the proxy's full softmax; the optional
margin term pushes the target's argmax into the proxy's top κ, which is what greedy Mirror-SD needs (hit_κ).
The draft's lookahead streams train with cross-entropy on the token j further ahead (Speculative Streaming).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a label that trains nothing (F.cross_entropy's default)


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


def lookahead_ce_loss(
    logits: torch.Tensor,
    stream_logits: torch.Tensor | None,
    next_labels: torch.Tensor,
    main_weight: float = 1.0,
    stream_weight: float = 0.1,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """main_weight · CE(main stream) + stream_weight · Σ_j CE(stream j), each CE a mean over its labelled positions.

    logits (B, T, V); stream_logits (B, T, S, V) or None; next_labels (B, T) ids of the logits' vocabulary,
    -100 = ignore, aligned with the positions: position t's main stream is trained on next_labels[t] (its next
    token) and its stream j on next_labels[t+j], so stream j has no label at the last j positions. segments (B, T)
    or None: for rows that pack several sequences, the sequence of each position; stream j at t has no label where
    t+j lies in another sequence. A term without any labelled position adds 0, not NaN (a reduced vocabulary can
    leave a small batch without one). Returns a scalar.
    """
    T = logits.shape[1]
    loss = logits.new_zeros((), dtype=torch.float32)
    if main_weight:
        loss = loss + main_weight * _mean_ce(logits, next_labels)
    num_streams = 0 if stream_logits is None else stream_logits.shape[2]
    for j in range(1, min(num_streams, T - 1) + 1):
        labels = next_labels[:, j:]
        if segments is not None:
            labels = labels.masked_fill(segments[:, j:] != segments[:, : T - j], IGNORE_INDEX)
        loss = loss + stream_weight * _mean_ce(stream_logits[:, : T - j, j - 1], labels)
    return loss


def speculative_streaming_loss(
    logits: torch.Tensor, stream_logits: torch.Tensor | None, labels: torch.Tensor, stream_weight: float = 0.1
) -> torch.Tensor:
    """CE(next token) + stream_weight · Σ_j CE(the token j further ahead): the Speculative Streaming objective.

    logits (B, T, V); stream_logits (B, T, S, V) or None; labels (B, T) draft ids, unshifted, -100 = ignore:
    position t is trained on labels[t+1] and its stream j on labels[t+1+j]. Returns a scalar.
    """
    streams = None if stream_logits is None else stream_logits[:, :-1]
    return lookahead_ce_loss(logits[:, :-1], streams, labels[:, 1:], 1.0, stream_weight)


def _mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions (0 when there are none). logits (..., V), labels (...)."""
    total = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
