"""The verification rule: which drafted tokens the target keeps. Pure functions, the losslessness argument in code.

Greedy: the target's token at every window position is its argmax. Sampling: it is one sample from the target's
own (temperature-scaled) distribution at that position. Either way the committed tokens are the drafted tokens that
equal the target's token, up to the first that does not, and then the target's own token there (the correction, or
the bonus token when the whole window matched). Every committed token is therefore the token the target itself
would have produced after the same prefix: the output is the target's, whatever the draft proposed.

Rejection sampling on the draft's q (accepting more often at T > 0) is not implemented: matching against the
target's samples is exact and needs nothing from the draft but its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def target_tokens(logits: torch.Tensor, temperature: float, seed: int = 0, first: int = 0) -> list[int]:
    """The target's token at each of the window's positions: (T, V) logits → T ids (argmax, or samples at T > 0).

    A sample's randomness is a function of (seed, its position in the output) alone (`first`: the position of the
    window's first row): the same seed gives the same output whatever windows the drafts proposed, and positions
    draw independently, so each committed token is still a sample of the target's distribution there."""
    if temperature == 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    out = []
    for i in range(probs.shape[0]):
        generator = torch.Generator(device=probs.device).manual_seed(_POSITION_SEED * seed + first + i)
        out.append(int(torch.multinomial(probs[i], 1, generator=generator)))
    return out


_POSITION_SEED = 1_000_003  # seeds of one sequence's positions never meet another seed's


def accept(window: Sequence[int], tokens: Sequence[int]) -> tuple[int, int]:
    """(A, c*): A = the longest prefix of the drafted `window` (γ tokens) equal to the target's `tokens` (γ + 1, one
    per window position, the last after the whole window), and c* = tokens[A], the correction or bonus token.

    The step commits window[:A] + [c*]: A + 1 tokens.
    """
    if len(tokens) != len(window) + 1:
        raise ValueError(f"{len(window)} drafted tokens need {len(window) + 1} target tokens, got {len(tokens)}")
    n = 0
    while n < len(window) and window[n] == tokens[n]:
        n += 1
    return n, int(tokens[n])


def truncate(new_tokens: list[int], stops: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut generated tokens after the first stop token (kept, as `generate` keeps it) or at `max_new_tokens`;
    returns (tokens, finished)."""
    for i, token in enumerate(new_tokens[:max_new_tokens]):
        if token in stops:
            return new_tokens[: i + 1], True
    return new_tokens[:max_new_tokens], len(new_tokens) >= max_new_tokens
