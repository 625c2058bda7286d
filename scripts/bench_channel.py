"""What a message between the target's process and the draft's costs: the engine's pipe (`channel.PipeTransport`),
a Branches-sized payload (the window's ℓe states), the receiver either blocked in the pipe, as the engine's sides
are, or busy-polling it, with the target's work between messages so the idle side really idles.

    python scripts/bench_channel.py [--messages 300] [--work-ms 8] [--rows 5] [--hidden 576] [--json]

Why: on a VM an idle vCPU halts, and waking it adds to every message the engine waits for (the Branches request
whose time comes out of the rollout's, the verdict, the reply). Prints a Markdown table (one-way: sent → the worker
has it; round trip: sent → the reply is back; median, p10, p90, mean in ms) for both ways of waiting; --json prints
one object instead. Measured side by side in one run: the machine's noise is the spread between rows of one run
(docs/engine.md, fiftieth session).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from mirror_train.devices import cpu_model
from mirror_train.engine.channel import PipeTransport

WAITS = ("blocked", "spinning")


def _wait(transport: PipeTransport, spin_s: float):
    """The next message: busy-polling the pipe for up to spin_s first (0: block at once, as the engine does)."""
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end and not transport.conn.poll(0):
        pass
    return transport.recv(None)


def _worker(conn, spin_s: float, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    transport = PipeTransport(conn)
    while True:
        msg = _wait(transport, spin_s)
        if msg is None:
            return
        transport.send(time.monotonic())


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def _stats(values: list[float]) -> dict[str, float]:
    deciles = statistics.quantiles(values, n=10)
    return {
        "median": statistics.median(values),
        "p10": deciles[0],
        "p90": deciles[-1],
        "mean": statistics.fmean(values),
    }


def measure(wait: str, messages: int, work_ms: float, rows: int, hidden: int, spin_ms: float = 30.0) -> dict:
    """One way of waiting, both sides alike: one-way and round-trip latencies in ms over `messages` messages."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    ours, theirs = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    spin_s = spin_ms / 1000 if wait == "spinning" else 0.0
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    worker = ctx.Process(target=_worker, args=(there, spin_s, theirs), daemon=True)
    worker.start()
    there.close()
    before = None
    if ours is not None:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {ours})
    transport = PipeTransport(here)
    payload = np.zeros((rows, hidden), np.float32)
    oneway, trip = [], []
    try:
        transport.send(("warm", payload))
        _wait(transport, spin_s)
        for _ in range(messages):
            _busy(work_ms)  # the target's work: the worker idles meanwhile
            sent = time.monotonic()
            transport.send(("states", payload))
            arrived = _wait(transport, spin_s)
            back = time.monotonic()
            oneway.append((arrived - sent) * 1e3)
            trip.append((back - sent) * 1e3)
        transport.send(None)
        worker.join(5)
    finally:
        if worker.is_alive():
            worker.kill()
        if before is not None:
            os.sched_setaffinity(0, before)
    return {"one_way_ms": _stats(oneway), "round_trip_ms": _stats(trip)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--work-ms", type=float, default=8.0, help="busy work between messages (a target's prefix)")
    ap.add_argument("--rows", type=int, default=5, help="payload rows: the window's ℓe states (γ + 1)")
    ap.add_argument("--hidden", type=int, default=576, help="payload width: the target's hidden size")
    ap.add_argument("--spin-ms", type=float, default=30.0, help="how long the spinning side polls before blocking")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.messages < 10:
        ap.error("--messages must be ≥ 10 (the table's deciles)")
    result = {
        "cpu": cpu_model(),
        "messages": args.messages,
        "work_ms": args.work_ms,
        "payload_bytes": args.rows * args.hidden * 4,
        "waits": {w: measure(w, args.messages, args.work_ms, args.rows, args.hidden, args.spin_ms) for w in WAITS},
    }
    if args.json:
        print(json.dumps(result))
        return
    size = result["payload_bytes"]
    print(f"{result['cpu']}: {args.messages} messages of {size} B, {args.work_ms:g} ms of work apart\n")
    print("| receiver | one-way median | p10 | p90 | mean | round trip median | p10 | p90 | mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for wait, r in result["waits"].items():
        one, trip = r["one_way_ms"], r["round_trip_ms"]
        cells = [one[k] for k in ("median", "p10", "p90", "mean")] + [trip[k] for k in ("median", "p10", "p90", "mean")]
        print(f"| {wait} | " + " | ".join(f"{v:.3f}" for v in cells) + " |")


if __name__ == "__main__":
    main()
