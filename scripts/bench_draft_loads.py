"""Does a draft's forward speed belong to its load? K loads of the same draft in one process, timed in two passes.

    python scripts/bench_draft_loads.py --draft outputs/drafter_smollm2/export --loads 6

The default draft's one-node forward measured 2.8–4.8 ms from one fresh load to the next while one load's timings
agreed within ~3% (docs/engine.md, twentieth and twenty-first sessions). Each load here is the engine's: the
artifact read from disk, cast to the draft's precision, its fast path installed (routes timed, C layers), its cache
filled with `--context` positions. Every load's forward is then timed in rounds (loads interleaved, a `--flush`-MB
buffer streamed between calls, as the target's step would evict the draft's weights in serving), in two passes a
few seconds apart: if the per-load medians of the two passes agree and differ between loads, the speed is the
load's (where its tensors landed), and choosing among loads would pay.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_target import draft_step  # scripts/ is on the path of a script run from it

from mirror_train.devices import resolve_dtype
from mirror_train.target import Target


def timed_pass(steps: list, rounds: int, flush: torch.Tensor | None) -> list[float]:
    """Per load, the median ms of `rounds` forwards, loads interleaved round by round."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            if flush is not None:
                flush.add_(1)  # streams the buffer through the caches: the draft's weights come from memory
            start = time.perf_counter()
            step()
            times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--loads", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--flush", type=int, default=64, help="MB streamed between forwards (0: none, weights hot)")
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = Target.load(args.target)
    dtype = resolve_dtype(args.draft_dtype, torch.device("cpu"))
    steps = [draft_step(target, args.draft, args.context, dtype) for _ in range(args.loads)]  # each a load
    flush = torch.zeros(args.flush * 2**18) if args.flush else None  # float32: 4 bytes an element
    for step in steps:
        step()
    first = timed_pass(steps, args.rounds, flush)
    time.sleep(3)
    second = timed_pass(steps, args.rounds, flush)
    print(f"draft {args.draft} in {dtype}, context {args.context}, {args.flush} MB flushed between forwards")
    print("| load | pass 1 ms | pass 2 ms |\n|---|---|---|")
    for i, (a, b) in enumerate(zip(first, second)):
        print(f"| {i} | {a:.2f} | {b:.2f} |")
    spread = max(first) / min(first)
    fastest = min(range(len(first)), key=first.__getitem__)
    rank = sorted(range(len(second)), key=second.__getitem__).index(fastest) + 1
    print(f"slowest / fastest load, pass 1: {spread:.2f}; the fastest of pass 1 ranks {rank} in pass 2")


if __name__ == "__main__":
    main()
