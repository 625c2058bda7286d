"""Wall-clock measurement helpers for benchmark scripts (never for assertions in tests)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int):
    """Run a block with `n` intra-op threads (e.g. 1: the cost on one core, as the engine's workers run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median_ms(fn: Callable[[], object], repeats: int = 30, warmup: int = 3) -> float:
    """Median wall time of `fn()` in milliseconds (synchronising CUDA when it is in use)."""
    return interleaved_median_ms({0: fn}, repeats=repeats, warmup=warmup)[0]


def interleaved_median_ms(fns: dict, repeats: int = 30, warmup: int = 3) -> dict:
    """Median wall time in milliseconds of each of several functions, timed in turn round after round: timed one
    after another, the first measured read ~15% slow (the target's one-token step slower than its two-token one,
    docs/engine.md, fourteenth session), an order effect that interleaving spreads over all of them alike. Each round
    takes them in its own seeded order (`round_order`): in one fixed order, what ran just before a function moved its
    time 2–10% on a Zen 5 (fifteenth session)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {key: [] for key in fns}
    keys = list(fns)
    for r in range(repeats):
        for key in round_order(keys, r):
            fn = fns[key]
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[key].append((time.perf_counter() - start) * 1000)
    return {key: statistics.median(t) for key, t in times.items()}


def round_order(keys: list, r: int) -> list:
    """keys in round r's order: a shuffle seeded by r (so a run repeats), each key equally often anywhere."""
    order = list(keys)
    random.Random(r).shuffle(order)
    return order
