"""What the draft's fed nodes read, on the draft's side: the table of committed tokens' target states (one per
target slot, appended to every step) and blocks of feature rows (slot → (n, width)) joined for one forward."""

from __future__ import annotations

import torch


def complete(block: dict, n: int, widths: dict[str, int]) -> dict:
    """`block` with every slot of the draft present: zeros (n, width) for the slots it lacks."""
    return {slot: block[slot] if slot in block else torch.zeros(n, width) for slot, width in widths.items()}


def join(blocks: list) -> dict | None:
    """Row blocks of features (slot → (n_i, w)) concatenated slot by slot; None where no block has any slot."""
    blocks = [b for b in blocks if b]
    if not blocks:
        return None
    return {slot: torch.cat([b[slot].float() for b in blocks]) for slot in blocks[0]}


class StateTable:
    """A growing (n, H) float32 table of committed tokens' target states, appended to every step."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def append(self, rows: torch.Tensor) -> None:
        if self.data is None:
            self.data = torch.zeros(max(2 * len(rows), 64), rows.shape[1])
        if self.n + len(rows) > len(self.data):  # double: appends stay amortised O(rows)
            grown = torch.zeros(2 * (self.n + len(rows)), self.data.shape[1])
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : self.n + len(rows)] = rows
        self.n += len(rows)

    def row(self, i: int) -> torch.Tensor:
        return self.data[i]


def as_states(states, rows: int, what: str) -> torch.Tensor:
    """`states` as a float32 (rows, H) tensor, or a clear error (a feature-conditioned draft cannot do without)."""
    if states is None:
        raise ValueError(f"a feature-conditioned draft needs the target's states of {what}; none came")
    states = torch.as_tensor(states, dtype=torch.float32)
    if states.dim() != 2 or states.shape[0] < rows:
        raise ValueError(f"the target's states of {what}: expected ({rows}, H), got {tuple(states.shape)}")
    return states[:rows] if states.shape[0] > rows else states
