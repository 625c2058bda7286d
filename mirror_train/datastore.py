"""A datastore of the target's own answers: an n-gram model of what the target says next, for drafting.

Prompt lookup (engine/ngram.py) copies from the prompt and the text committed so far. What a target says is also
what it said before, on other prompts: its stock phrases, its formats, its closing lines. This is a static n-gram
model over the target's own greedy answers (the self-distilled data every recipe makes, data/selfdistill.py), in
the spirit of REST and SAM-Decoding's static store: for every n-gram (n = min_n..max_n, 1..4 by default) seen at
least `min_count` times with a successor, the successor the target chose most often there and how often. A proposal
continues a context greedily, one token at a time, from the longest n-gram of (context + the tokens proposed so far)
the store holds; each token carries its match size and its share (count of that successor / count of the n-gram),
which is what the engine's calibration learns the acceptance of (window.py).

Built once (0.2 s for 1,152 answers: 51,046 n-grams, a 1.6 MB file), stored as arrays in one `.npz` beside the draft
it serves with; a lookup is a binary search per n-gram size (numpy), and a proposal of 8 tokens took ~32 µs.
Keys are 64-bit polynomial hashes of the n-gram: a collision between two of the ~10^6 n-grams would only make a
proposal wrong (the target verifies every token), never the output.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mirror_train.errors import MirrorTrainError


@dataclass
class DatastoreConfig:
    """How the datastore is built (recipes/drafter.py exports one with every draft; `mirror-train datastore`)."""

    min_n: int = 1  # the shortest n-gram matched (a 1-gram's guess is weak, and the calibration learns how weak)
    max_n: int = 4  # the longest n-gram matched (longer ones add little over the committed text's own copies)
    min_count: int = 2  # n-grams the target produced fewer times are dropped (a single occurrence is a weak guess)
    prompt_tail: int = 4  # prompt tokens kept before each answer: the chat template's tail its first tokens follow

    def validate(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise MirrorTrainError(f"datastore: 1 ≤ min_n ≤ max_n needed, got {self.min_n}..{self.max_n}")
        if self.min_count < 1 or self.prompt_tail < 0:
            raise MirrorTrainError(
                f"datastore: min_count ≥ 1 and prompt_tail ≥ 0 needed, got {self.min_count} and {self.prompt_tail}"
            )


_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the rolling hash (the golden-ratio constant)
_MASK = (1 << 64) - 1
FORMAT = 1


def _powers(n: int) -> np.ndarray:
    """P^(n-1), ..., P, 1 as uint64 (wrapping): hash(t_1..t_n) = Σ t_i · P^(n-i) mod 2^64."""
    out = np.ones(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n - 2, -1, -1):
            out[i] = out[i + 1] * _P
    return out


def _hash(tokens: Sequence[int]) -> int:
    """The same hash in Python integers (a lookup hashes one n-gram; numpy scalars would cost more)."""
    h, p = 0, int(_P)
    for t in tokens:
        h = (h * p + int(t)) & _MASK
    return h


class Datastore:
    """What the target said next after each n-gram of its answers (module docstring)."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], meta: dict):
        # n → (sorted n-gram hashes uint64, most frequent successor int64, its count int64, the n-gram's count int64)
        self.tables = tables
        self.meta = meta
        self.sizes = sorted(tables, reverse=True)  # longest match first

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], cfg: DatastoreConfig | None = None) -> Datastore:
        """From token sequences (each an answer, best with the few tokens before it: the chat template's tail)."""
        cfg = cfg or DatastoreConfig()
        cfg.validate()
        min_n, max_n, min_count = cfg.min_n, cfg.max_n, cfg.min_count
        parts, count = [], 0
        for seq in sequences:
            arr = np.asarray(list(seq), dtype=np.int64)
            if arr.size and arr.min() < 0:
                raise MirrorTrainError("datastore sequences hold token ids ≥ 0")
            parts += [arr, np.array([-1], dtype=np.int64)]  # -1 separates sequences: no n-gram spans two
            count += 1
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        tables = {}
        for n in range(min_n, max_n + 1):
            if flat.size <= n:
                break
            windows = np.lib.stride_tricks.sliding_window_view(flat[:-1], n)  # (L - n, n): the n-gram before
            successor = flat[n:]
            valid = (windows >= 0).all(axis=1) & (successor >= 0)
            with np.errstate(over="ignore"):
                keys = (windows[valid].astype(np.uint64) * _powers(n)).sum(axis=1, dtype=np.uint64)
            successor = successor[valid]
            tables[n] = _most_frequent(keys, successor, min_count)
        meta = {
            "format": FORMAT,
            "min_n": min_n,
            "max_n": max_n,
            "min_count": min_count,
            "sequences": count,
            "tokens": int((flat >= 0).sum()),
        }
        return cls(tables, meta)

    def check_vocab(self, vocab_size: int, path: str | os.PathLike | None = None) -> None:
        """Refuse a datastore that proposes ids a target of `vocab_size` ids does not have (another tokenizer's:
        its ids would reach the target's embedding)."""
        top = max((int(t[1].max()) for t in self.tables.values() if len(t[1])), default=-1)
        if top >= vocab_size:
            where = f" {path}" if path is not None else ""
            raise MirrorTrainError(
                f"the datastore{where} proposes id {top}, beyond the target's {vocab_size} ids: it was built for "
                "another tokenizer"
            )

    def __len__(self) -> int:
        return sum(len(t[0]) for t in self.tables.values())

    def next_token(self, context: Sequence[int]) -> tuple[int, int, float] | None:
        """(the successor, the match size n, its share) from the longest n-gram ending the context held; None."""
        for n in self.sizes:
            if len(context) < n:
                continue
            hashes, successor, count, total = self.tables[n]
            h = np.uint64(_hash(context[-n:]))
            i = int(np.searchsorted(hashes, h))
            if i < len(hashes) and hashes[i] == h:
                return int(successor[i]), n, float(count[i]) / float(total[i])
        return None

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], list[tuple[int, float]]]:
        """Up to k tokens continuing `context` greedily, and each one's (match size, share)."""
        tokens, evidence = [], []
        if not self.sizes:
            return tokens, evidence
        width = self.sizes[0]  # the longest n-gram: all a lookup reads of the context
        ctx = [int(t) for t in context[-width:]]
        for _ in range(k):
            step = self.next_token(ctx)
            if step is None:
                break
            token, n, share = step
            tokens.append(token)
            evidence.append((n, share))
            ctx = (ctx + [token])[-width:]
        return tokens, evidence

    # --- storage --------------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The .npz file's contents (a draft artifact carries it as one of its files)."""
        arrays = {f"{name}_{n}": a for n, t in self.tables.items() for name, a in zip(_FIELDS, t)}
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.array([self.meta[k] for k in _META], dtype=np.int64), **arrays)
        return buffer.getvalue()

    def save(self, path: str | os.PathLike) -> None:
        """One .npz, written atomically (a temporary file renamed over the path)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Datastore:
        try:
            with np.load(path) as f:
                meta = dict(zip(_META, (int(v) for v in f["meta"])))
                if meta["format"] != FORMAT:
                    raise MirrorTrainError(f"datastore {path} has format {meta['format']}, this version reads {FORMAT}")
                tables = {}
                for n in range(meta["min_n"], meta["max_n"] + 1):
                    if f"hash_{n}" in f:
                        tables[n] = tuple(f[f"{name}_{n}"] for name in _FIELDS)
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise MirrorTrainError(f"cannot read the datastore {path}: {type(e).__name__}: {e}") from None
        return cls(tables, meta)


_FIELDS = ("hash", "successor", "count", "total")
_META = ("format", "min_n", "max_n", "min_count", "sequences", "tokens")


def _most_frequent(keys: np.ndarray, successor: np.ndarray, min_count: int):
    """Per distinct key: its most frequent successor (ties: the smallest id), that successor's count and the key's
    count; keys seen fewer than `min_count` times are dropped. Sorted by key, for `np.searchsorted`."""
    order = np.lexsort((successor, keys))
    keys, successor = keys[order], successor[order]
    if keys.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(0, dtype=np.uint64), empty, empty, empty
    # runs of equal (key, successor)
    new_pair = np.ones(keys.size, dtype=bool)
    new_pair[1:] = (keys[1:] != keys[:-1]) | (successor[1:] != successor[:-1])
    starts = np.flatnonzero(new_pair)
    pair_key, pair_next = keys[starts], successor[starts]
    pair_count = np.diff(np.append(starts, keys.size))
    # per key: the pair with the highest count (stable order keeps the smallest successor among ties)
    order = np.lexsort((-pair_count, pair_key))
    pair_key, pair_next, pair_count = pair_key[order], pair_next[order], pair_count[order]
    first = np.ones(pair_key.size, dtype=bool)
    first[1:] = pair_key[1:] != pair_key[:-1]
    key_starts = np.flatnonzero(first)
    totals = np.add.reduceat(pair_count, key_starts)
    best_key, best_next, best_count = pair_key[key_starts], pair_next[key_starts], pair_count[key_starts]
    keep = totals >= min_count
    return best_key[keep], best_next[keep].astype(np.int64), best_count[keep].astype(np.int64), totals[keep]
