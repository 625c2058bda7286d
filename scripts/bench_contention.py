"""Are the target's core and the draft's core two devices? The target's one-token step on its core, alone and while
the other core runs (a) the draft's forward in a loop, as Mirror-SD's draft does while the target computes, (b) a
compute-only loop (a small matmul that stays in L1: contends only where the two cores share execution units, as SMT
siblings do), (c) a memory-streaming loop (sums over a 1 GB tensor: contends for memory bandwidth).

    python scripts/bench_contention.py [--draft outputs/drafter_smollm2/export] [--target-core 0] [--other-core 1]

Mirror-SD's overlap pays only where (a) costs the target little: the slowdown multiplies every step the draft
works through. Prints a Markdown table (median ms of the target's step, and its ratio to the step alone).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch
from bench_target import draft_step  # scripts/ is on the path of a script run from it

from mirror_train import fastpath
from mirror_train.devices import cpu_model, resolve_dtype
from mirror_train.target import Target
from mirror_train.timing import median_ms, torch_threads


def _load(kind: str, draft: str | None, core: int, ready, stop) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    with torch.inference_mode():
        if kind == "compute":
            a = torch.randn(64, 64)
            work = lambda: a @ a  # noqa: E731
        elif kind == "memory":
            x = torch.ones(2**28)  # 1 GB
            work = x.sum
        else:  # the draft's one-node tree forward with its streams, as bench_target.py times it
            work = draft_step(Target.load("testbed"), draft, 300, resolve_dtype("auto", "cpu"))
        work()
        ready.set()
        while not stop.is_set():
            work()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="an exported draft (its forward is load (a); without: (b), (c))")
    ap.add_argument("--target-core", type=int, default=0)
    ap.add_argument("--other-core", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()

    os.sched_setaffinity(0, {args.target_core})
    target = Target.load("testbed")
    fastpath.install(target.model, "auto")
    ids = torch.randint(0, target.vocab_size, (1, args.context + 1), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    with torch_threads(1), torch.inference_mode():
        target.forward(ids[:, : args.context], cache)

        def step():
            target.forward(ids[:, args.context :], cache)
            Target.crop(cache, args.context)

        loads = ["alone"] + (["draft"] if args.draft else []) + ["compute", "memory", "alone"]
        rows = []
        ctx = mp.get_context("spawn")
        for kind in loads:
            proc = None
            if kind != "alone":
                ready, stop = ctx.Event(), ctx.Event()
                proc = ctx.Process(target=_load, args=(kind, args.draft, args.other_core, ready, stop), daemon=True)
                proc.start()
                ready.wait(300)
                time.sleep(0.5)
            rows.append((kind, median_ms(step, repeats=args.repeats)))
            if proc is not None:
                stop.set()
                proc.join(30)
    alone = min(ms for kind, ms in rows if kind == "alone")
    print(f"\n{cpu_model()}: the target on core {args.target_core}, the load on core {args.other_core}\n")
    print("| other core runs | target step ms | vs alone |")
    print("|---|---|---|")
    for kind, ms in rows:
        print(f"| {kind} | {ms:.1f} | {ms / alone:.2f}× |")


if __name__ == "__main__":
    main()
