"""The target's step against the hardware: read bandwidth, the floor it sets, and step times by window width on
the default and the fast forward path (mirror_train/fastpath.py), one thread, as the engine's target runs.

    python scripts/bench_target.py [--draft DIR] [--context 300] [--values bfloat16] [--baseline REV] [--json]

- bandwidth: a `torch` sum over a 1 GB float32 tensor, one thread (GB/s), on 4 KiB pages and on huge pages (where
  the served weights live, alignment.py); floor: the target's weight bytes at the faster of the two (a one-token
  step must read every weight once);
- step_ms / default_step_ms: median ms of a greedy step of 1, 2, 4, 8, 16 new tokens after `--context` cached
  positions (the forward and each row's token, the argmax of its logits, as the engine verifies at temperature 0;
  the cache cropped back after each), on the fast path (`auto`: the row-exact kernels where they build, the LM
  head's int8 or bfloat16 screen where it pays, screened_head.py) and on torch's default path (its linears, the
  row-invariant attention's one SDPA call a row, the whole head); logits_step_ms: the fast path's forward with
  every logit (what sampling pays); onednn_step_ms the greedy step on oneDNN's prepacked linears, for comparison
  (where torch has oneDNN); each path on its own copy of the target, every (path, width) timed in turn round after
  round;
- compute: the multiply-adds a window row costs (every linear's weights, the LM head's included: each row of a
  window is its own one-token step, summed in the same order for the same bits), what each row past the first
  cost measured (the 8-token step's excess over the one-token step, per row, and that as GFLOP/s), and the
  GFLOP/s a row would need for an 8-token window at 1.4x the one-token step (#15's bar): past the core's float32
  peak (FMA units x lanes x 2 x clock), the bar is out of reach of any row-exact kernel on it;
- draft_ms (with --draft): the draft's tree forward of one node with its streams, on the same thread, and its
  ratio to the target's one-token step;
- with --values bfloat16 (float16) every weight is first rounded to a bfloat16 (float16) value, kept in float32
  (what a half-precision checkpoint served in float32 is): `weights_read` says whether the fast path reads
  half-precision copies of them (the same bits from half the bytes, kernels.serve_narrow), while the floor still
  counts the float32 weights;
- with --baseline REV, baseline_step_ms: the fast path's step on the kernels (the C source) of git revision REV, on
  a copy of its own, timed in turn with every other path in the same rounds (the host's drift, ±10% from minute to
  minute on a shared VM, falls on both alike, which separate runs of two checkouts cannot promise); the Python is
  this checkout's, so REV's C functions must take the same arguments.
Prints a Markdown table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_attention import baseline_module

from mirror_train import alignment, fastpath, kernels
from mirror_train.devices import cpu_model
from mirror_train.target import Target
from mirror_train.timing import interleaved_median_ms, median_ms, torch_threads

WIDTHS = (1, 2, 4, 8, 16)


def read_bandwidth_gbs(gigabytes: float = 1.0, huge_pages: bool = False) -> float:
    """GB/s of a one-thread `torch` sum over `gigabytes` of float32, on 4 KiB pages or on the huge pages the served
    weights live on (alignment.py)."""
    n = int(gigabytes * 2**30 / 4)
    x = alignment.huge_empty(4 * n).view(torch.float32).fill_(1.0) if huge_pages else torch.ones(n)
    ms = median_ms(lambda: x.sum(), repeats=5, warmup=1)
    return x.numel() * 4 / ms / 1e6


def row_macs(model: torch.nn.Module) -> int:
    """Multiply-adds a window row costs in the linears (the LM head's included), attention left out (small)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def step_fns(target: Target, context: int, logits: bool = False) -> dict:
    """Width → a greedy step of that many new tokens after `context` cached positions (the cache cropped back
    after): the forward and each row's token, or with `logits` the forward with every logit."""
    ids = torch.randint(0, target.vocab_size, (1, context + max(WIDTHS)), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    target.forward(ids[:, :context], cache)

    def step(w: int) -> None:
        state = target.prefix(ids[:, context : context + w], cache, 1)
        if logits:
            target.suffix(state)
        else:
            target.greedy(target.suffix_states(state, logits=False)[1][0])
        Target.crop(cache, context)

    return {w: (lambda w=w: step(w)) for w in WIDTHS}


def on_library(library, fn):
    """fn run with the kernels' calls going to `library` (every kernels function looks its library up per call)."""

    def run() -> None:
        own = kernels._library
        kernels._library = lambda: library
        try:
            fn()
        finally:
            kernels._library = own

    return run


def step_times(
    targets: dict[str, Target], context: int, repeats: int, libraries: dict | None = None
) -> dict[str, dict[int, float]]:
    """Each path's step times, every (path, width) timed in turn round after round: measured one path after the
    other, the path timed first read up to ~20% slow on a Zen 5 (sixteenth session), as widths did (timing.py).
    libraries: a path's kernel library where it is not this checkout's (--baseline)."""
    libraries = libraries or {}
    fns = {
        (path, w): on_library(libraries[path], fn) if path in libraries else fn
        for path, target in targets.items()
        for w, fn in step_fns(target, context).items()
    }
    fns |= {("logits", w): fn for w, fn in step_fns(targets["fast"], context, logits=True).items()}
    times = interleaved_median_ms(fns, repeats=repeats)
    return {path: {w: times[(path, w)] for w in WIDTHS} for path in [*targets, "logits"]}


def draft_step(target: Target, path: str, context: int, dtype: torch.dtype):
    """The draft's tree forward of one node with its streams after `context` cached positions, as the engine serves
    it (its dtype, the fast path): a function that runs one and rolls its cache back."""
    from mirror_train.engine.rollout import keep_cache_path
    from mirror_train.models.draft_artifact import load_draft

    draft = load_draft(path, target).requires_grad_(False).to(dtype)
    fastpath.install(draft, fastpath.for_draft("auto"))
    ids = torch.randint(0, target.vocab_size, (1, context))
    cache = draft.new_cache()
    with torch.no_grad():
        draft(ids, cache=cache, num_streams=0, logits_index=torch.tensor([context - 1]))

    def step():
        draft.tree_forward([1], [-1], cache, num_streams=None, logits_index=torch.tensor([0]))
        keep_cache_path(cache, context, [])

    return step


def draft_time(target: Target, path: str, context: int, repeats: int, dtype: torch.dtype) -> float:
    return median_ms(draft_step(target, path, context, dtype), repeats=repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--draft", default=None, help="an exported draft: its one-node forward beside the target's step")
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="as the engine's")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--values",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="round the target's weights to bfloat16 or float16 values, kept in float32: a half-precision checkpoint "
        "served in float32 (the usual Hub model), which the fast path reads from half-precision copies where that "
        "measures faster here",
    )
    ap.add_argument("--baseline", default=None, help="a git revision whose kernels to time beside this checkout's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    def load() -> Target:
        target = Target.load(args.target)
        if args.values != "float32":
            with torch.no_grad():
                for p in target.model.parameters():
                    p.copy_(p.to(getattr(torch, args.values)).float())
        return target

    # one copy of the target per path (each loaded as served), so their steps interleave: no path is timed first
    target = load()
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    targets = {"default": target}
    if torch.backends.mkldnn.is_available():
        targets["onednn"] = load()
        fastpath.install(targets["onednn"].model, "onednn")
    targets["fast"] = load()
    kind = fastpath.install(targets["fast"].model, "auto")
    served = fastpath.record(targets["fast"].model)
    libraries = {}
    if args.baseline:
        libraries["baseline"] = baseline_module(args.baseline)._library()
        if libraries["baseline"] is None:
            raise SystemExit(f"error: the kernels of {args.baseline} do not build here")
        targets["baseline"] = load()
        on_library(libraries["baseline"], lambda: fastpath.install(targets["baseline"].model, "auto"))()
    with torch_threads(1), torch.inference_mode():
        # the floor from the faster of the two: the hardware's rate, whichever pages reach it
        bandwidths = {pages: read_bandwidth_gbs(huge_pages=pages == "huge") for pages in ("4k", "huge")}
        bandwidth = max(bandwidths.values())
        times = step_times(targets, args.context, args.repeats, libraries)
    default, fast, onednn = times["default"], times["fast"], times.get("onednn")
    result = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "fast_path": kind,
        **served,  # the layout, the dtype the weights are read in, the screen, how the panels stream (kernels.py)
        "values": args.values,  # the float32 weights' values: their own, or rounded to bfloat16 / float16 ones
        "context": args.context,
        "weight_bytes": weights,
        "bandwidth_gbs": round(bandwidth, 2),
        "bandwidth_by_pages_gbs": {pages: round(b, 2) for pages, b in bandwidths.items()},
        "huge_page_mb": round((alignment.huge_page_bytes() or 0) / 2**20),  # the weights', every copy's
        "floor_ms": round(weights / bandwidth / 1e6, 2),
        "step_ms": {w: round(t, 2) for w, t in fast.items()},
        "default_step_ms": {w: round(t, 2) for w, t in default.items()},
        "logits_step_ms": {w: round(t, 2) for w, t in times["logits"].items()},
    }
    macs = row_macs(targets["fast"].model)
    row_ms = (fast[8] - fast[1]) / 7
    result["compute"] = {
        "row_mmacs": round(macs / 1e6, 1),
        "row_ms": round(row_ms, 2),
        "row_gflops": round(2 * macs / row_ms / 1e6, 1) if row_ms > 0 else None,
        "gflops_for_1.4x": round(7 * 2 * macs / (0.4 * fast[1]) / 1e6, 1),
    }
    if onednn is not None:
        result["onednn_step_ms"] = {w: round(t, 2) for w, t in onednn.items()}
    if args.baseline:
        result["baseline"] = args.baseline
        result["baseline_step_ms"] = {w: round(t, 2) for w, t in times["baseline"].items()}
    if args.draft:
        with torch_threads(1):
            dtype = fastpath.draft_dtype(args.draft_dtype, "cpu")
            result["draft_dtype"] = str(dtype).removeprefix("torch.")
            result["draft_ms"] = round(draft_time(targets["fast"], args.draft, args.context, args.repeats, dtype), 2)
        result["draft_over_step"] = round(result["draft_ms"] / result["step_ms"][1], 3)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['cpu']}: {result['bandwidth_gbs']} GB/s read, floor {result['floor_ms']} ms ({kind} fast path)")
    print(f"read GB/s by pages: {result['bandwidth_by_pages_gbs']}; on huge pages: {result['huge_page_mb']} MB")
    print(
        "| new tokens | default ms | oneDNN ms | fast ms | fast / floor | fast / one-token fast | fast, all logits ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for w in WIDTHS:
        dnn = f"{onednn[w]:.1f}" if onednn else "–"
        floor, every = fast[w] / result["floor_ms"], times["logits"][w]
        print(
            f"| {w} | {default[w]:.1f} | {dnn} | {fast[w]:.1f} | {floor:.2f} | {fast[w] / fast[1]:.2f} | {every:.1f} |"
        )
    if args.baseline:
        base = times["baseline"]
        rev = args.baseline
        print(f"\n| new tokens | fast ms | {rev} ms | fast / {rev} | {rev}: fast / one-token |")
        print("|---|---|---|---|---|")
        for w in WIDTHS:
            print(f"| {w} | {fast[w]:.2f} | {base[w]:.2f} | {fast[w] / base[w]:.3f} | {base[w] / base[1]:.2f} |")
    c = result["compute"]
    print(
        f"compute: a row {c['row_mmacs']}M multiply-adds, measured {c['row_ms']} ms a row past the first "
        f"({c['row_gflops']} GFLOP/s); an 8-token window at 1.4x one token needs {c['gflops_for_1.4x']} GFLOP/s"
    )
    if args.draft:
        draft = f"{result['draft_ms']} ms in {result['draft_dtype']}"
        print(f"draft forward (1 node, streams): {draft} = {result['draft_over_step']} of a step")


if __name__ == "__main__":
    main()
