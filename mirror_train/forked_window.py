"""A forked verification window: two drafted chains that the target verifies in one pass.

The engine's two window sources (the draft model's tokens and a copy of the text, engine/window.py) often both have
something worth verifying; verifying only the one that promises more throws the other's chance away, while a row
more costs the target little on a CPU with the row-exact kernels (~4% a row). A forked window holds both:

    rows     [y_t, a_1 .. a_m, b_{f+1} .. b_n]        (1 + m + n − f rows, in the cache in this order)
    chains   y_t a_1 .. a_m           and   y_t a_1 .. a_f b_{f+1} .. b_n   (b_1..b_f = a_1..a_f: the shared stem)

Row r of chain b (token b_j, j > f) sits at position past + j, as it would in plain decoding of that chain, and
attends to the cache, y_t, a_1..a_f and b_{f+1}..b_j: two runs of keys, 0..past+f and then its own chain's rows.
Computed in that order over the same values, every row is bit for bit the one-token step of its chain
(kernels.attention's `rows`; attention.py), so whichever chain the target keeps more of, its tokens are the
target's own (acceptance.accept_forked). Its rows in the cache are then moved down behind the stem
(`Target.keep_path`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForkedWindow:
    main: int  # m: the main chain's drafted tokens (rows 1..m)
    fork: int  # f: the tokens both chains share (0 ≤ f < m)
    alt: int  # n − f: the second chain's own rows, after the main chain's (≥ 1)

    def __post_init__(self):
        if not (0 <= self.fork < self.main and self.alt >= 1):
            raise ValueError(f"a forked window needs 0 ≤ fork < main and alt ≥ 1, got {self}")

    @property
    def rows(self) -> int:
        return 1 + self.main + self.alt

    def depths(self) -> list[int]:
        """Each row's position after the cache: y_t 0, a_i i, b_j j."""
        return list(range(1 + self.main)) + list(range(self.fork + 1, self.fork + 1 + self.alt))

    def alt_row(self, j: int) -> int:
        """The row of the second chain's token b_{j+1} (0-based j): a stem row or one of its own."""
        return j + 1 if j < self.fork else 1 + self.main + (j - self.fork)

    def runs(self, past: int) -> torch.Tensor:
        """(3, rows) int64: row i sees keys 0..runs[0, i]−1, then runs[1, i]..runs[1, i]+runs[2, i]−1 (module
        docstring), past: the positions cached before the window."""
        first = [past + 1 + i for i in range(1 + self.main)] + [past + 1 + self.fork] * self.alt
        start = [0] * (1 + self.main) + [past + 1 + self.main] * self.alt
        count = [0] * (1 + self.main) + list(range(1, 1 + self.alt))
        return torch.tensor([first, start, count], dtype=torch.int64)

    def mask(self, past: int, device=None) -> torch.Tensor:
        """The same keys as a boolean attention mask (1, 1, rows, past + rows): True where a row may look."""
        runs = self.runs(past)
        keys = torch.arange(past + self.rows)[None, :]
        seen = (keys < runs[0][:, None]) | ((keys >= runs[1][:, None]) & (keys < (runs[1] + runs[2])[:, None]))
        return seen[None, None].to(device)
