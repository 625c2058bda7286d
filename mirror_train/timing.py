"""Wall-clock measurement helpers for benchmark scripts (never for assertions in tests)."""

from __future__ import annotations

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
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)
