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

from mirror_train import kernels
from mirror_train.screened_head import whole_argmax


def target_tokens(logits: torch.Tensor, temperature: float, seed: int = 0, first: int = 0) -> list[int]:
    """The target's token at each of the window's positions: (T, V) logits → T ids (argmax, or samples at T > 0).

    A sample is the Gumbel-max one, argmax(logits + T·G) with G the noise of (seed, its position in the output)
    alone (`sample_noise`; `first`: the position of the window's first row): the same seed gives the same output
    whatever windows the drafts proposed, and positions draw independently, so each committed token is still a
    sample of the target's distribution there. An argmax needs no probabilities: the LM head's screen finds it
    computing a few logits (`Target.greedy_scores` with the noise), the same id this function gives."""
    if temperature == 0:
        return logits.argmax(-1).tolist()
    noise = sample_noise(logits.shape[-1], temperature, seed, range(first, first + logits.shape[0]))
    return whole_argmax(logits, noise)


def sample_noise(vocab: int, temperature: float, seed: int, positions: Sequence[int]) -> torch.Tensor:
    """(len(positions), vocab) float32: T times Gumbel noise, −T·log(−log u) for u uniform, each row a function of
    (seed, its output position) alone, drawn on the CPU in float64 (the same bits on any device and any x86 machine,
    and no float32 cut-off of the tail: u is never 0, never 1). argmax(logits + noise) is then a sample of
    softmax(logits / T).

    u of id v is the top 52 bits of splitmix64's finalizer over (a key of the seed and the position) + (v + 1) times
    the golden ratio's 64 bits, and the logarithms are IEEE operations alone (`_log`). csrc/noise.c computes it ~4×
    faster than torch's generator and logs did (0.13 against 0.53 ms a row of the testbed's 49,152 ids on Zen 4; a
    row is drawn for every position a window verifies, on both sides of the engine); this module's torch version,
    the same operations one by one, gives the same bits where no kernel builds."""
    positions = [int(p) for p in positions]
    if kernels.available() and kernels.has("gumbel_noise"):
        return kernels.gumbel_noise(seed, positions, vocab, temperature)
    rows = torch.empty(len(positions), vocab, dtype=torch.float32)
    ids = torch.arange(1, vocab + 1, dtype=torch.int64) * _i64(_GOLDEN)  # wraps mod 2^64, as C's uint64 does
    for i, position in enumerate(positions):
        z = _mix(ids + _key(seed, position))
        u = (_shr(z, 12).double() + 0.5) * 2.0**-52
        rows[i] = (_log(-_log(u)) * -float(temperature)).float()
    return rows


_GOLDEN = 0x9E3779B97F4A7C15
_MASK = 2**64 - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit value as the int64 of its bits."""
    x &= _MASK
    return x - 2**64 if x >= 2**63 else x


def _key(seed: int, position: int) -> torch.Tensor:
    """A position's key (int64 bits, 0-d): noise.c's, mix(mix(seed·golden + 1) + position·golden) mod 2^64."""
    return _mix(_mix(torch.tensor(_i64(seed * _GOLDEN + 1))) + _i64(position * _GOLDEN))


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (multiplication wraps mod 2^64)."""
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def _log(x: torch.Tensor) -> torch.Tensor:
    """csrc/noise.c's noise_log, operation by operation (float64, x normal and > 0): x = 2^k m, m in [√½, √2],
    log m = 2 atanh(s) by its series to s^11, s = (m − 1) / (m + 1)."""
    b = x.view(torch.int64)
    k = (b >> 52) - 1023
    m = ((b & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000).view(torch.float64)
    big = m > 1.4142135623730951
    m = torch.where(big, m * 0.5, m)
    k = k + big.long()
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, 1.0 / 11)
    for odd in (9, 7, 5, 3, 1):
        p = p * s2 + 1.0 / odd
    return k.double() * 0.6931471805599453 + (2.0 * s) * p


class NoiseRows:
    """One sequence's sampling noise by output position (`sample_noise`'s rows), each drawn once and kept until
    `forget_before` passes its position: a window's rows past its first rejected one are read again at the same
    positions the next step, by the target's verification and by a draft coupled to it alike (a row of the
    testbed's 49,152 ids: ~0.13 ms in C on Zen 4)."""

    def __init__(self, vocab: int, temperature: float, seed: int):
        self.vocab, self.temperature, self.seed = vocab, temperature, seed
        self.kept: dict[int, torch.Tensor] = {}

    def rows(self, positions: Sequence[int]) -> torch.Tensor:
        """(len(positions), vocab) float32, drawing the positions not yet kept."""
        missing = [p for p in dict.fromkeys(positions) if p not in self.kept]
        if missing:
            self.kept.update(zip(missing, sample_noise(self.vocab, self.temperature, self.seed, missing)))
        return torch.stack([self.kept[p] for p in positions])

    def forget_before(self, position: int) -> None:
        """Drop the rows of positions before `position` (decided: no one reads them again)."""
        for decided in [p for p in self.kept if p < position]:
            del self.kept[decided]


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


def accept_forked(
    window: Sequence[int], alt: Sequence[int], forked, tokens: Sequence[int]
) -> tuple[int, int, list[int], int | None]:
    """The verification rule over a forked window (forked_window.py; None: a plain one): rows [y_t, window,
    alt[fork:]], `tokens` the target's token at each row. Each chain is accepted as `accept` would (a token is kept
    while it equals the target's token at its parent's row); the chain that keeps more is committed (the main one
    on a tie).

    Returns (A, c*, rows, A_alt): A the main chain's kept tokens, A_alt the second chain's (None: not forked), c* the
    committed chain's correction and `rows` the rows of [y_t, its kept tokens] (the last gave c*): the rows whose
    states and cache entries become the committed ones. The second chain is committed iff A_alt > A; then A is
    exactly the shared stem (past it the chains' next tokens differ, so at most one is the target's)."""
    if forked is None:
        a, c = accept(window, tokens)
        return a, c, list(range(a + 1)), None
    if len(tokens) != forked.rows or len(window) != forked.main or len(alt) != forked.fork + forked.alt:
        raise ValueError(f"a forked window {forked} does not match {len(window)} + {len(alt)} tokens")
    a, c = accept(window, tokens[: 1 + forked.main])
    rows = [0]
    while len(rows) <= len(alt) and alt[len(rows) - 1] == tokens[rows[-1]]:
        rows.append(forked.alt_row(len(rows) - 1))
    if len(rows) - 1 > a:
        return a, int(tokens[rows[-1]]), rows, len(rows) - 1
    return a, c, list(range(a + 1)), len(rows) - 1


def truncate(new_tokens: list[int], stops: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut generated tokens after the first stop token (kept, as `generate` keeps it) or at `max_new_tokens`;
    returns (tokens, finished)."""
    for i, token in enumerate(new_tokens[:max_new_tokens]):
        if token in stops:
            return new_tokens[: i + 1], True
    return new_tokens[:max_new_tokens], len(new_tokens) >= max_new_tokens
