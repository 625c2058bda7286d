"""Where prompt lookup is already right: the positions a copy covers, so a draft need not.

In the engine a draft's model is worth asking only where the copies (prompt lookup, the datastore) miss: at a
position whose next token prompt lookup proposes correctly, the copy wins at no cost to either device. A draft
trained with those positions down-weighted (`train.copied_weight`) spends its capacity where the copies leave
tokens on the table. The rule here is the engine's own (`engine/ngram.py`): the longest suffix of the context
(n = max_n .. 1) seen before, its latest earlier occurrence, the token that followed it there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prompt_lookup_hits(tokens: Sequence[int], labels: Sequence[int], max_n: int = 4) -> np.ndarray:
    """hit (T,) bool: prompt lookup over tokens[: t + 1] proposes labels[t] as its first token.

    tokens (T,) one sequence's token ids (prompt and answer); labels (T,) the token the target chooses after each
    position (its argmax). A position with no earlier match is a miss. O(T · max_n).
    """
    tokens = [int(t) for t in tokens]
    last: dict[tuple[int, ...], int] = {}  # n-gram → the index of its last token at its latest occurrence
    hit = np.zeros(len(tokens), dtype=np.bool_)
    for t in range(len(tokens)):
        for n in range(min(max_n, t + 1), 0, -1):  # the proposal at t reads n-grams ending before t
            end = last.get(tuple(tokens[t - n + 1 : t + 1]))
            if end is not None:
                hit[t] = tokens[end + 1] == int(labels[t])
                break
        for n in range(1, min(max_n, t + 1) + 1):  # the n-grams ending at t have a successor from t + 1 on
            if t + 1 < len(tokens):
                last[tuple(tokens[t - n + 1 : t + 1])] = t
    return hit


def packed_copy_hits(token_ids, labels, segments, max_n: int = 4):
    """prompt_lookup_hits over a packed row (1, N) of windows (`pack_rows`): each window looked up on its own.
    Returns a bool tensor (1, N) on token_ids' device."""
    import torch

    ids, lab, seg = token_ids[0].tolist(), labels[0].tolist(), segments[0].tolist()
    out = np.zeros(len(ids), dtype=np.bool_)
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or seg[end] != seg[start]:
            out[start:end] = prompt_lookup_hits(ids[start:end], lab[start:end], max_n)
            start = end
    return torch.from_numpy(out)[None].to(token_ids.device)
