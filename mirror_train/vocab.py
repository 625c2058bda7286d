"""Vocabularies chosen by token frequency: a draft's reduced head (EAGLE-3's d2t) and a proxy head's candidates.

On a small model the LM head is most of the cost of a forward, and most of the vocabulary is never produced: the
8,192 most frequent ids of the training data cover 91% of the testbed's held-out answer tokens, 16,384 cover 97%.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from mirror_train.errors import MirrorTrainError


def token_ranking(token_id_lists: Iterable[Iterable[int]], vocab_size: int, limit: int | None = None) -> torch.Tensor:
    """The ids that occur in the data, most frequent first (ties: the lower id), at most `limit` of them: (n,) long."""
    counts = Counter(int(i) for ids in token_id_lists for i in ids)
    bad = [i for i in counts if not 0 <= i < vocab_size]
    if bad:
        raise MirrorTrainError(f"token ids {sorted(bad)[:5]} are outside the vocabulary 0..{vocab_size - 1}")
    ranked = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    return torch.tensor(ranked[:limit], dtype=torch.long)


def frequent_token_map(
    token_id_lists: Iterable[Iterable[int]], size: int, vocab_size: int, special_ids: Iterable[int] = ()
) -> torch.Tensor:
    """The `draft_vocab` / d2t of a reduced head: the `size` most frequent ids in the data, special ids always in.

    Ties go to the lower id; when the data holds fewer distinct ids, the lowest unused ids fill the rest.
    Returns (size,) long, sorted ascending.
    """
    special = list(dict.fromkeys(int(i) for i in special_ids))
    if not 1 <= size <= vocab_size:
        raise MirrorTrainError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    if len(special) > size:
        raise MirrorTrainError(f"{len(special)} special ids do not fit a draft vocabulary of {size}")
    bad = [i for i in special if not 0 <= i < vocab_size]
    if bad:
        raise MirrorTrainError(f"token ids {sorted(set(bad))[:5]} are outside the vocabulary 0..{vocab_size - 1}")
    return top_ranked([*special, *token_ranking(token_id_lists, vocab_size).tolist()], size, vocab_size)


def top_ranked(ranking: Iterable[int], size: int, vocab_size: int) -> torch.Tensor:
    """The first `size` distinct ids of `ranking`, filled up with the lowest ids not in it: (size,) long, sorted.

    A draft's reduced head (`frequent_token_map`) and a proxy head's candidate vocabulary (the engine's
    `candidate_vocab`, from the ranking an exported head carries, or none: then the lowest ids) both take this.
    """
    if not 1 <= size <= vocab_size:
        raise MirrorTrainError(f"a vocabulary of {size} ids does not fit 1..{vocab_size}")
    chosen = list(dict.fromkeys(int(i) for i in ranking))[:size]
    taken = set(chosen)
    filler = (i for i in range(vocab_size) if i not in taken)
    while len(chosen) < size:
        chosen.append(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)
