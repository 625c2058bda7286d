"""The engine's time to the first token: a prompt's prefill on the target's core alone against spread over every core
this process may use (EngineConfig.prefill_threads), on Spec-Bench prompts of every length.

    python scripts/bench_prefill.py [--per-category 2] [--repeats 3] [--json]

Two engines on the same target, `prefill_threads=1` and the default, each generating one token (`ar`: the prefill
and the first token) for every prompt, the two alternated prompt by prompt and round by round (a shared machine's
drift falls on both alike). Prints, by prompt length, the median ms of each and their ratio, and whether every first
token was the same. Needs $MIRROR_TRAIN_SPECBENCH_QUESTIONS (or the shared question file) like bench_engine.py.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mirror_train.devices import cpu_model
from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.generation import encode_chat
from mirror_train.prompts import default_specbench_file, load_prompts
from mirror_train.target import Target

BUCKETS = ((0, 64), (64, 128), (128, 512), (512, 4096))  # prompt tokens: at most 64 rows stay on the row kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category (first turns)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the prompts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    target = Target.load(args.target, dtype=torch.float32)
    questions = load_prompts(default_specbench_file())
    chosen, seen = [], {}
    for q in questions:
        if seen.get(q.category, 0) < args.per_category:
            seen[q.category] = seen.get(q.category, 0) + 1
            chosen.append(encode_chat(target.tokenizer, q.messages()))
    engines = {
        "one core": MirrorEngine(target, None, None, EngineConfig(prefill_threads=1)),
        "spread": MirrorEngine(target, None, None, EngineConfig()),
    }
    layout = engines["spread"].prefill_layout
    times: dict[str, dict[int, list[float]]] = {name: {} for name in engines}
    firsts: dict[str, dict[int, list[int]]] = {name: {} for name in engines}
    for prompt in chosen[:2]:  # warm: the GEMM paths are timed and chosen on first use
        for engine in engines.values():
            engine.generate(prompt, 1, method="ar")
    for r in range(args.repeats):
        for i, prompt in enumerate(chosen):
            order = list(engines) if (i + r) % 2 == 0 else list(engines)[::-1]
            for name in order:
                g = engines[name].generate(prompt, 1, method="ar")
                times[name].setdefault(i, []).append(g.seconds * 1e3)
                firsts[name].setdefault(i, []).append(g.tokens[0])
    same = all(firsts["one core"][i] == firsts["spread"][i] for i in firsts["one core"])
    rows = []
    for lo, hi in BUCKETS:
        members = [i for i, p in enumerate(chosen) if lo < len(p) <= hi]
        if not members:
            continue
        one = [statistics.median(times["one core"][i]) for i in members]
        many = [statistics.median(times["spread"][i]) for i in members]
        rows.append(
            {
                "tokens": f"{lo + 1}–{hi}",
                "prompts": len(members),
                "mean_tokens": statistics.mean(len(chosen[i]) for i in members),
                "one_core_ms": statistics.mean(one),
                "spread_ms": statistics.mean(many),
                "speedup": statistics.mean(o / m for o, m in zip(one, many, strict=True)),
            }
        )
    total_one = sum(statistics.median(v) for v in times["one core"].values())
    total_many = sum(statistics.median(v) for v in times["spread"].values())
    result = {
        "cpu": cpu_model(),
        "layout": {"cores": sorted(layout[0]) if layout and layout[0] else None, "threads": layout[1] if layout else 1},
        "prompts": len(chosen),
        "repeats": args.repeats,
        "rows": rows,
        "total_one_core_ms": total_one,
        "total_spread_ms": total_many,
        "same_first_tokens": same,
    }
    for engine in engines.values():
        engine.close()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['cpu']}; spread: {result['layout']}; {len(chosen)} prompts × {args.repeats} rounds, alternated")
    print("| prompt tokens | prompts | mean tokens | one core ms | spread ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['tokens']} | {row['prompts']} | {row['mean_tokens']:.0f} | {row['one_core_ms']:.0f} | "
            f"{row['spread_ms']:.0f} | {row['speedup']:.2f}× |"
        )
    print(f"all prompts: {total_one:.0f} ms on one core, {total_many:.0f} ms spread ({total_one / total_many:.2f}×);")
    print(f"the same first token for every prompt: {same}")


if __name__ == "__main__":
    main()
