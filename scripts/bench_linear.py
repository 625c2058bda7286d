"""The row-exact linear kernel (mirror_train/kernels.py) over one step's weights, by window rows, one thread, in
both weight layouts (`kernels.layout`: rows, panels) side by side, and optionally against the kernels of another
git revision on the same inputs, both layouts: their time, and whether every output is the same bit for bit (the
served target's function must not change with a speed-up).

    python scripts/bench_linear.py [--rows 1,4,5,6,8,16] [--baseline 0487532~1] [--rounds 8] [--dtype bfloat16]

The weights are random, of the testbed's shapes (per decoder layer q, k, v, o, gate, up, down; 30 layers; the LM
head 49152 × 576: 538 MB in float32), so each call streams its weights from memory as a decoding step does; a row's
time here is what the linears add to a verification window. `--dtype bfloat16` times the path a draft served in
bf16 takes (weights widened on load, float32 sums). Rounds alternate the kernels (the host's speed drifts minute to
minute); prints a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_attention import baseline_module

from mirror_train import alignment, kernels
from mirror_train.devices import cpu_model
from mirror_train.timing import torch_threads

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in)
HEAD = (49152, 576)


def step_ms(linear, weights: list[torch.Tensor], xs: dict[int, torch.Tensor], rows: int) -> tuple[float, list]:
    start = time.perf_counter()
    outs = [linear(xs[w.shape[1]][:rows], w) for w in weights]
    return (time.perf_counter() - start) * 1e3, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,5,6,8,16", help="window rows a call")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--baseline", default=None, help="a git revision whose kernels.py to time beside this one")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("error: the kernels did not build on this machine (kernels.available() is False)")
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(o, i, generator=gen).to(dtype) for _ in range(args.layers) for o, i in LAYER]
    weights.append(torch.randn(*HEAD, generator=gen).to(dtype))
    weights = alignment.pack(weights)  # on huge pages, as the served weights are (alignment.py)
    panels = alignment.pack([kernels.to_panels(w) for w in weights])
    xs = {k: torch.randn(16, k, generator=gen) for k in (576, 1536)}
    rows = [int(r) for r in args.rows.split(",")]
    panels_of = {id(w): p for w, p in zip(weights, panels)}
    impls = {
        "this": kernels.linear,
        "panels": lambda x, w: kernels.linear(x, w, None, panels_of[id(w)]),
    }
    if args.baseline:
        other = baseline_module(args.baseline)
        impls["baseline"] = other.linear
        if hasattr(other, "to_panels"):  # a revision with panels: its own layout of them
            other_panels = {id(w): other.to_panels(w) for w in weights}
            impls["baseline panels"] = lambda x, w: other.linear(x, w, None, other_panels[id(w)])
    times = {(name, r): [] for name in impls for r in rows}
    same = {(name, r): True for name in ("baseline", "baseline panels") for r in rows}
    with torch_threads(1), torch.inference_mode():
        for linear in impls.values():  # build and warm each
            step_ms(linear, weights, xs, 1)
        for _ in range(args.rounds):
            for r in rows:
                outs = {}
                for name, linear in impls.items():
                    ms, outs[name] = step_ms(linear, weights, xs, r)
                    times[(name, r)].append(ms)
                for name, mine in (("baseline", "this"), ("baseline panels", "panels")):
                    if name in outs:
                        same[(name, r)] &= all(torch.equal(a, b) for a, b in zip(outs[mine], outs[name]))
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    print(f"CPU {cpu_model()}, torch {torch.__version__}, one thread, {gb:.2f} GB of {args.dtype} weights a step")
    chosen = kernels.layout()
    print(f"(this: the rows layout; panels: the same weights as `kernels.to_panels`; chosen here: {chosen})\n")
    head = "| rows | this: ms | GFLOP/s | panels: ms | panels ÷ this |"
    head += " baseline: ms | this ÷ baseline | same bits |" if args.baseline else ""
    head += " baseline panels: ms | panels ÷ baseline panels | same bits |" if "baseline panels" in impls else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    flops = 2 * sum(w.numel() for w in weights)
    for r in rows:
        ms = statistics.median(times[("this", r)])
        pms = statistics.median(times[("panels", r)])
        line = f"| {r} | {ms:.2f} | {flops * r / ms / 1e6:.0f} | {pms:.2f} | {pms / ms:.3f} |"
        if args.baseline:
            base = statistics.median(times[("baseline", r)])
            line += f" {base:.2f} | {ms / base:.3f} | {'yes' if same[('baseline', r)] else '**no**'} |"
        if "baseline panels" in impls:
            base = statistics.median(times[("baseline panels", r)])
            line += f" {base:.2f} | {pms / base:.3f} | {'yes' if same[('baseline panels', r)] else '**no**'} |"
        print(line)


if __name__ == "__main__":
    main()
