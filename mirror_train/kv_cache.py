"""A KV cache that grows in place: what the served target decodes with.

transformers' DynamicLayer appends each step's keys and values with `torch.cat`, copying the whole cache of every
layer every step (on the testbed at 300 positions, ~7 ms of a ~50 ms float32 step on one core; more with longer
prompts), and a rollback slices it. Here each layer keeps a buffer with spare room: a step writes its rows after the
cached ones and the layer's keys/values are views of the filled part; a rollback (`crop`) only shortens the view,
and the next step overwrites the dropped rows. The buffer doubles when full (amortised: one copy per doubling).
Attention sees the same values in the same order, so the output is unchanged bit for bit (tests/test_target.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256


class _BufferRows:
    """A GrowingLayer's `keys` or `values`: the tensor the instance holds, made from its buffer first where the layer
    holds only a count (`GrowingLayer._lazy_n`); an assignment makes them that tensor again."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        if layer._lazy_n is not None:
            layer._materialize()
        return layer.__dict__.get(self.name)

    def __set__(self, layer, value: torch.Tensor | None) -> None:
        if layer._lazy_n is not None:
            layer._materialize()
        layer.__dict__[self.name] = value


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `update` writes into a buffer instead of concatenating (module docstring).

    While `keys` / `values` are the buffers' first rows, the layer holds only their count (`_lazy_n`) and makes the
    two views when something reads them: a fused step (`extend`) and a rollback (`crop`) made two new views a layer
    each, ~0.5 ms of a ~20 ms one-token step on a Zen 4 core, run cold after the weights' stream (docs/engine.md,
    thirty-second session), and the fused C layers never read them. What the attributes hold is unchanged for any
    reader; an assignment makes them that tensor again."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    _lazy_n: int | None = None  # keys/values are the buffers' first _lazy_n rows, not yet made (None: as stored)
    keys = _BufferRows()
    values = _BufferRows()

    def _materialize(self) -> None:
        n, self._lazy_n = self._lazy_n, None
        self.__dict__["keys"] = self._key_buffer[..., :n, :]
        self.__dict__["values"] = self._value_buffer[..., :n, :]

    def _hold(self, n: int) -> None:
        """keys/values become the buffers' first n rows (made when read)."""
        self.__dict__["keys"] = self.__dict__["values"] = None  # no stale view keeps an old buffer alive
        self._lazy_n = n

    def get_seq_length(self) -> int:
        if self._lazy_n is not None:
            return self._lazy_n
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self.get_seq_length(), key_states.shape[-2]
        keys, values = self.reserve(new, key_states)
        keys[..., n : n + new, :] = key_states
        values[..., n : n + new, :] = value_states
        self.extend(new)
        return self.keys, self.values

    def reserve(self, new: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers, with room for `new` more positions after the cached ones (a fused layer writes
        them there itself, then calls `extend`). `like`: a tensor of the keys' shape and dtype, for a first write."""
        n = self.get_seq_length()
        buffer = self._key_buffer
        if buffer is None or not self._views_of_buffers(n) or buffer.shape[-2] < n + new:
            self._grow(n, n + new, like if like is not None else self.keys)
        return self._key_buffer, self._value_buffer

    def extend(self, new: int) -> None:
        """Count the `new` positions written after the cached ones into the buffers (`reserve`) as cached."""
        self._hold(self.get_seq_length() + new)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop (a negative count to drop); where keys/values are the buffers' rows, only the count."""
        n = self.get_seq_length() if self.is_initialized else 0
        if tokens_to_remove < 0 and self._key_buffer is not None and n and self._views_of_buffers(n):
            self._hold(max(n + tokens_to_remove, 0))
            return
        super().crop(tokens_to_remove)

    def _views_of_buffers(self, n: int) -> bool:
        """Whether keys/values are still the buffers' first n rows (a method of the base class may have replaced
        them with new tensors: then the buffers start again from those)."""
        if n == 0 or self._lazy_n is not None:
            return True
        return (
            self.keys.data_ptr() == self._key_buffer.data_ptr()
            and self.values.data_ptr() == self._value_buffer.data_ptr()
            and self.keys.shape[:-2] == self._key_buffer.shape[:-2]
        )

    def _grow(self, n: int, needed: int, like: torch.Tensor) -> None:
        capacity = max(MIN_CAPACITY, needed, 2 * (self._key_buffer.shape[-2] if self._key_buffer is not None else 0))
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        keys = torch.empty(shape, dtype=like.dtype, device=like.device)
        values = torch.empty(shape, dtype=like.dtype, device=like.device)
        if n:
            keys[..., :n, :] = self.keys
            values[..., :n, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def reset(self) -> None:
        self._lazy_n = None  # before the buffers go: what is dropped need not be made
        self._key_buffer = self._value_buffer = None
        super().reset()


def crop(cache, length: int) -> None:
    """Drop every cached position ≥ `length`, layer by layer.

    Layers are cropped one at a time because after a prefix without its suffix (an aborted step) the lower
    layers hold more positions than the upper ones. transformers 5.24's crop takes a negative count to drop;
    sliding-window layers are cropped even when nothing is dropped, which trims them back to their window.
    """
    if length < 0:
        raise ValueError(f"cannot crop a cache to a negative length ({length})")
    for layer in cache.layers:
        extra = max(layer.get_seq_length() - length, 0)
        if extra or getattr(layer, "is_sliding", False):
            layer.crop(-extra)


def grow_in_place(cache):
    """Make the full-attention layers of a transformers DynamicCache grow in place (sliding-window layers, which
    trim themselves, keep their own update); returns the cache."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
    return cache
