"""The draft's tree forward as the engine serves it (its precision, its fast path), by tree nodes and context length,
one thread; optionally against another git revision's serving of the same draft, in alternating rounds.

    python scripts/bench_draft_step.py [--draft DIR] [--nodes 1,4,8,16,32] [--contexts 300,1000] [--baseline REV]

A Mirror-SD step rolls out its branches as tree forwards of 1 to ~50 new nodes (the spine and the branch roots in the
first pass, each branch's main and stream tokens in the next), so the draft's cost is a curve over nodes, not the
one-node forward `bench_target.py` reports. Each cell: the median ms of a tree forward of that many new nodes (a
chain, the logits of its last 4 nodes with the streams, as rollouts read a few leaves) after that many cached
positions, the cache rolled back after each. Without --draft, a draft is cut from the target as the default config
cuts it (4 layers, 2 streams, 8,192-id head, exit + final feature slots): its speed does not depend on training.
--baseline REV checks REV out into a temporary git worktree and measures there with that revision's own code; the
two alternate `--rounds` times and each cell reports the median over rounds.
Prints a Markdown table; --json prints one object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(draft_path: str | None, nodes: list[int], contexts: list[int], repeats: int) -> dict:
    """{"dtype", "fast_path", "ms": {"context/nodes": median ms}} for the mirror_train on sys.path."""
    import torch

    from mirror_train import fastpath
    from mirror_train.devices import resolve_dtype
    from mirror_train.engine.rollout import keep_cache_path
    from mirror_train.models.drafter import MirrorDrafterForCausalLM
    from mirror_train.target import Target
    from mirror_train.timing import torch_threads

    try:  # a baseline revision from before the interleaved helper times each size alone
        from mirror_train.timing import interleaved_median_ms as interleaved
    except ImportError:
        from mirror_train.timing import median_ms

        def interleaved(fns, repeats):
            return {key: median_ms(fn, repeats=repeats) for key, fn in fns.items()}

    target = Target.load("testbed")
    if draft_path:
        from mirror_train.models.draft_artifact import load_draft

        draft = load_draft(draft_path, target)
    else:
        draft = MirrorDrafterForCausalLM.from_target(
            target, 4, num_streams=2, num_stream_layers=1, draft_vocab=list(range(8192)),
            feature_conditioning="target_hidden", target_exit_layer=target.num_layers // 2,
        )  # fmt: skip
    # the engine's draft_dtype default, as that revision chose it
    choose = getattr(fastpath, "draft_dtype", resolve_dtype)
    dtype = choose("auto", torch.device("cpu"))
    draft = draft.requires_grad_(False).eval().to(dtype)
    kind = getattr(fastpath, "for_draft", lambda k: k)("auto")  # what channel.build_server installs at that revision
    installed = fastpath.install(draft, kind)
    out = {}
    with torch_threads(1), torch.inference_mode():
        for context in contexts:
            ids = torch.randint(0, target.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
            cache = draft.new_cache()
            draft(ids, cache=cache, num_streams=0, logits_index=torch.tensor([context - 1]))
            steps = {}
            for n in nodes:
                parents, tokens = list(range(-1, n - 1)), list(range(1, n + 1))
                leaves = torch.arange(max(0, n - 4), n)

                def step(tokens=tokens, parents=parents, leaves=leaves, context=context, cache=cache):
                    draft.tree_forward(tokens, parents, cache, logits_index=leaves)
                    keep_cache_path(cache, context, [])

                steps[n] = step
            # the tree sizes timed in turn, round after round: timed one after another, the first read slow
            for n, ms in interleaved(steps, repeats=repeats).items():
                out[f"{context}/{n}"] = ms
    return {"dtype": str(dtype).removeprefix("torch."), "fast_path": installed, "ms": out}


def run_at(revision: str | None, worktree: str | None, args) -> dict:
    """`measure` in a fresh process: this checkout's code, or the worktree's."""
    env = {**os.environ, "PYTHONPATH": worktree or str(ROOT)}  # that checkout's package, not an installed one
    cmd = [sys.executable, __file__, "--measure-only", "--nodes", args.nodes, "--contexts", args.contexts]
    # the baseline runs in its worktree: a relative path to the draft must still name this checkout's
    cmd += ["--repeats", str(args.repeats)] + (["--draft", os.path.abspath(args.draft)] if args.draft else [])
    result = subprocess.run(cmd, env=env, cwd=worktree or ROOT, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="an exported draft (default: one cut from the testbed)")
    ap.add_argument("--nodes", default="1,4,8,16,32")
    ap.add_argument("--contexts", default="300,1000")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--baseline", default=None, help="a git revision whose serving of the same draft to compare")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds with --baseline")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.measure_only:
        print(json.dumps(measure(args.draft, nodes, contexts, args.repeats)))
        return

    from mirror_train.devices import cpu_model

    runs: dict[str, list[dict]] = {"head": [], "baseline": []}
    worktree = None
    try:
        if args.baseline:
            worktree = tempfile.mkdtemp(prefix="mirror-baseline-")
            subprocess.run(["git", "worktree", "add", "--detach", worktree, args.baseline], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
        for _ in range(args.rounds if args.baseline else 1):
            runs["head"].append(run_at(None, None, args))
            if worktree:
                runs["baseline"].append(run_at(args.baseline, worktree, args))
    finally:
        if worktree:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=ROOT, capture_output=True)
    cells = list(runs["head"][0]["ms"])
    result = {
        "cpu": cpu_model(),
        "draft": args.draft or "cut from the testbed (untrained)",
        "dtype": runs["head"][0]["dtype"],
        "fast_path": runs["head"][0]["fast_path"],
        "ms": {c: statistics.median(r["ms"][c] for r in runs["head"]) for c in cells},
    }
    if args.baseline:
        result["baseline"] = args.baseline
        result["baseline_fast_path"] = runs["baseline"][0]["fast_path"]
        result["baseline_dtype"] = runs["baseline"][0]["dtype"]
        result["baseline_ms"] = {c: statistics.median(r["ms"][c] for r in runs["baseline"]) for c in cells}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['cpu']}, draft {result['draft']}, {result['dtype']}, served {result['fast_path']}")
    if args.baseline:
        print(f"{args.baseline}: {result['baseline_dtype']}, served {result['baseline_fast_path']}")
    head = "| context | nodes | ms |" + (f" {args.baseline} ms | speed-up |" if args.baseline else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for cell in cells:
        context, n = cell.split("/")
        row = f"| {context} | {n} | {result['ms'][cell]:.2f} |"
        if args.baseline:
            base = result["baseline_ms"][cell]
            row += f" {base:.2f} | {base / result['ms'][cell]:.2f}× |"
        print(row)


if __name__ == "__main__":
    main()
