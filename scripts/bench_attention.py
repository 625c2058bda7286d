"""The row-exact attention kernel (mirror_train/kernels.py) by context length and window rows, one thread, and
optionally against the kernel of another git revision on the same inputs: its time, and whether every output is
the same bit for bit (the served target's function must not change with a speed-up).

    python scripts/bench_attention.py [--lengths 200,800,1600] [--rows 1,2,4,8] [--baseline 3d9dec6]

Shapes default to the testbed's (9 query heads, 3 KV heads, head size 64, 30 layers: one call a layer, so a row's
time here is what the attention adds to a verification step). Prints a Markdown table: median ms for the 30 calls
of one step, and with --baseline its ms, the ratio and the bitwise check.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mirror_train import kernels
from mirror_train.devices import cpu_model
from mirror_train.timing import torch_threads


def baseline_module(revision: str):
    """mirror_train/kernels.py as of `revision`, imported under another name (its own build, keyed by its source)."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{revision}:mirror_train/kernels.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="mirror-kernels-")) / "kernels_baseline.py"
    path.write_text(source)
    # since 1a16fea the C source is the package's csrc/ beside kernels.py (before, a string inside it)
    files = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{revision}:mirror_train/csrc"], cwd=root, capture_output=True, text=True
    )
    if files.returncode == 0:
        (path.parent / "csrc").mkdir()
        for name in files.stdout.split():
            show = ["git", "show", f"{revision}:mirror_train/csrc/{name}"]
            text = subprocess.run(show, cwd=root, check=True, capture_output=True, text=True).stdout
            (path.parent / "csrc" / name).write_text(text)
    spec = importlib.util.spec_from_file_location("kernels_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def step_ms(attention, q, k, v, layers: int, repeats: int) -> float:
    attention(q, k, v, 0.125)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(layers):
            attention(q, k, v, 0.125)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="200,800,1600", help="cached positions (keys) a row attends to")
    ap.add_argument("--rows", default="1,2,4,8", help="window rows a call")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--baseline", default=None, help="a git revision whose kernel to time and compare against")
    args = ap.parse_args()
    if not kernels.available():
        sys.exit("the kernels do not build on this machine (no C compiler?)")
    base = baseline_module(args.baseline) if args.baseline else None
    g = torch.Generator().manual_seed(0)
    shape = f"{args.heads} heads / {args.kv_heads} KV heads × {args.dim}"
    print(f"\n{cpu_model()}, one thread, {shape}, {args.layers} calls\n")
    cols = "| keys | rows | ms |" + (f" {args.baseline} ms | speed-up | same bits |" if base else "")
    print(cols)
    print("|" + "---|" * (cols.count("|") - 1))
    with torch_threads(1):
        for length in (int(x) for x in args.lengths.split(",")):
            for rows in (int(x) for x in args.rows.split(",")):
                q = torch.randn(1, args.heads, rows, args.dim, generator=g)
                k, v = torch.randn(2, 1, args.kv_heads, length + rows, args.dim, generator=g)
                ms = step_ms(kernels.attention, q, k, v, args.layers, args.repeats)
                line = f"| {length} | {rows} | {ms:.2f} |"
                if base:
                    old = step_ms(base.attention, q, k, v, args.layers, args.repeats)
                    same = torch.equal(kernels.attention(q, k, v, 0.125), base.attention(q, k, v, 0.125))
                    line += f" {old:.2f} | {old / ms:.2f}× | {same} |"
                print(line, flush=True)


if __name__ == "__main__":
    main()
