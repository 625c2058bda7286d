"""What the draft's fed nodes read, on the draft's side: the table of committed tokens' target states (one per
target slot, appended to every step) and blocks of feature rows (slot → (n, width)) joined for one forward.

Everything here lives on the draft's device: a CUDA draft fed by a CUDA target in another process receives the
states as CUDA tensors (shared by torch's IPC handles, no host round trip) and keeps them there."""

from __future__ import annotations

import torch


def complete(block: dict, n: int, widths: dict[str, int], device: torch.device | str = "cpu") -> dict:
    """`block` with every slot of the draft present: zeros (n, width) for the slots it lacks."""
    return {
        slot: block[slot] if slot in block else torch.zeros(n, width, device=device) for slot, width in widths.items()
    }


def join(blocks: list) -> dict | None:
    """Row blocks of features (slot → (n_i, w)) concatenated slot by slot; None where no block has any slot."""
    blocks = [b for b in blocks if b]
    if not blocks:
        return None
    return {slot: torch.cat([b[slot].float() for b in blocks]) for slot in blocks[0]}


class StateTable:
    """A growing (n, H) float32 table of committed tokens' target states, appended to every step."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.data: torch.Tensor | None = None
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def append(self, rows: torch.Tensor) -> None:
        if self.data is None:
            self.data = torch.zeros(max(2 * len(rows), 64), rows.shape[1], device=self.device)
        if self.n + len(rows) > len(self.data):  # double: appends stay amortised O(rows)
            grown = torch.zeros(2 * (self.n + len(rows)), self.data.shape[1], device=self.device)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : self.n + len(rows)] = rows
        self.n += len(rows)

    def rows(self, first: int, n: int, width: int) -> torch.Tensor:
        """Rows first..first+n-1 (n, width); a row before the table's start (index -1: what the prompt's first token
        reads) is zeros."""
        before = min(max(-first, 0), n)
        have = self.data[max(first, 0) : first + n] if self.data is not None and n > before else None
        zeros = torch.zeros(before, width, device=self.device)
        return zeros if have is None else torch.cat([zeros, have]) if before else have


def as_states(states, rows: int, what: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """`states` (a numpy array or a tensor) as a float32 (rows, H) tensor on `device`, or a clear error (a
    feature-conditioned draft cannot do without)."""
    if states is None:
        raise ValueError(f"a feature-conditioned draft needs the target's states of {what}; none came")
    states = torch.as_tensor(states, dtype=torch.float32, device=device)
    if states.dim() != 2 or states.shape[0] < rows:
        raise ValueError(f"the target's states of {what}: expected ({rows}, H), got {tuple(states.shape)}")
    return states[:rows] if states.shape[0] > rows else states
