"""The fast forward path for a served model: what every method (ar, sd, mirror, pld and the transformers peers) runs.

On a CPU a decoding step of a small model is a few matmuls of 1–16 rows against large weights, and torch's default
float32 path is slow at that shape (docs/engine.md, "The step against the hardware"): oneDNN with its weights
reordered once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then
`_linear_pointwise` per call) reads the same weights faster. `install` swaps every `nn.Linear` of a model for that
call in place, keeping the parameters (and what borrows them: a proxy head's LM head, tied embeddings) untouched;
the model computes the same function, rounding differently in the last bits (float32 logits within ~1e-4), the
same for a window as for a one-token step. Lossless is unaffected: every method is verified by the same served
model, and the engine's output is that model's own greedy output (tests/test_engine_testbed.py).

`kind`: "auto" (oneDNN on a CPU where torch has it, nothing elsewhere), "onednn", or "none".
"""

from __future__ import annotations

import torch
from torch import nn

from mirror_train.errors import MirrorTrainError
from mirror_train.timing import median_ms

KINDS = ("auto", "onednn", "none")


def resolve(kind: str, device: torch.device | str) -> str:
    if kind not in KINDS:
        raise MirrorTrainError(f"fast_path must be one of {', '.join(KINDS)}, got {kind!r}")
    device = torch.device(device)
    available = device.type == "cpu" and torch.backends.mkldnn.is_available()
    if kind == "onednn" and not available:
        raise MirrorTrainError(f"fast_path=onednn needs a CPU with oneDNN; the model is on {device}")
    if kind == "auto":
        return "onednn" if available else "none"
    return kind


def install(model: nn.Module, kind: str = "auto") -> str:
    """Swap `model`'s linear layers for the fast path in place (idempotent); returns the kind installed. Install it
    on the model as served: a later cast or copy computes on the plain path.

    Which path is faster depends on the rows of a call and on the machine (measured on an AMX Xeon: oneDNN 24% slower
    for one row, 10–25% faster from 4 rows on, docs/engine.md), so each layer takes the prepacked path from the
    row count measured here to win for that layer's shape, and torch's own path below it."""
    device = next(model.parameters()).device
    kind = resolve(kind, device)
    if kind == "none":
        return kind
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears:
        return kind
    crossovers: dict[tuple, float] = {}
    for module in linears:
        module.__class__ = PackedLinear
        module.repack()
        shape = (tuple(module.weight.shape), module.bias is not None, module.weight.dtype)
        if shape not in crossovers:  # a Llama has ~6 shapes of linear layer
            crossovers[shape] = _crossover(module)
        module.min_rows = crossovers[shape]
    return kind


def _crossover(linear: PackedLinear, rows=(1, 2, 4, 8, 16)) -> float:
    """The fewest rows from which the prepacked path is faster than torch's own on `linear` (inf: never)."""
    faster = []
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(1, n, linear.in_features, dtype=linear.weight.dtype)
            plain = median_ms(lambda x=x: nn.functional.linear(x, linear.weight, linear.bias), repeats=15, warmup=3)
            packed = median_ms(lambda x=x: linear.packed(x), repeats=15, warmup=3)
            faster.append(packed < plain)
    for i, n in enumerate(rows):
        if all(faster[i:]):
            return n
    return float("inf")


def installed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


class PackedLinear(nn.Linear):
    """An nn.Linear whose inference forward reads a oneDNN-prepacked copy of its weight (same parameters) for calls
    of at least `min_rows` rows."""

    min_rows: float = 1

    def repack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self._packed_dtype = self.weight.dtype

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.__dict__.get("_packed")
        plain = packed is None or x.dtype != self._packed_dtype or x.device.type != "cpu"
        plain = plain or x.numel() < self.min_rows * self.in_features
        if plain or (torch.is_grad_enabled() and self.weight.requires_grad):  # training, a cast copy: the plain path
            return nn.functional.linear(x, self.weight, self.bias)
        return self.packed(x)

    def __deepcopy__(self, memo):
        """A copy (`Target.cast`) is a plain nn.Linear: the packed weight belongs to the model as served."""
        import copy

        clone = nn.Linear.__new__(nn.Linear)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            if key not in ("_packed", "_packed_dtype", "min_rows"):
                clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone
