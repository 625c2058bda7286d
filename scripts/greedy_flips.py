"""Greedy flips of the served target against stock transformers: does the engine's fast path change the text?

For every Spec-Bench question (turn 1), the target's greedy continuation two ways, on one core, one thread:
- stock: transformers' own model and `generate` (its SDPA attention, torch's linears, its concatenating cache);
- served: the engine's `ar` with its fast path (`EngineConfig.fast_path`, by default `auto`: on a CPU with a C
  compiler the row-exact kernels, mirror_train/kernels.py), the path every engine method and peer runs.
Every engine method reproduces `ar` exactly (the engine's tests and Spec-Bench's lossless column); this measures
what the fast path itself changes. A flip is a question whose two continuations differ; the first differing
position is recorded. Shards split the questions across processes (one per core):

    python scripts/greedy_flips.py --shard 0/2 --core 0 --out a.json & python scripts/greedy_flips.py --shard 1/2 \
        --core 1 --out b.json; python scripts/greedy_flips.py --merge a.json b.json --out docs/results/flips.json
"""

from __future__ import annotations

import argparse
import json

import torch

from mirror_train import fastpath
from mirror_train.devices import cpu_model, pinned
from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.eval.peers import greedy_generate
from mirror_train.eval.questions import load_questions, resolve_questions
from mirror_train.generation import encode_chat, stop_token_ids
from mirror_train.target import Target
from mirror_train.testbed import resolve_model


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    questions = load_questions(resolve_questions(args.questions, False, ""), None, None)
    index, shards = (int(x) for x in args.shard.split("/"))
    questions = questions[index::shards][: args.limit]
    target = Target.load(args.target)
    stock = AutoModelForCausalLM.from_pretrained(resolve_model(args.target), dtype=torch.float32).eval()
    stops = stop_token_ids(target.tokenizer, target.config)
    cfg = EngineConfig(fast_path=args.fast_path, target_core=args.core)
    engine = MirrorEngine(target, None, None, cfg)
    records = []
    result = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "fast_path": engine.fast_path,
        **fastpath.record(target.model),  # the layout, half-precision copies, the LM head's screen, the panels' stream
        "records": records,
    }
    with torch.inference_mode():
        for q in questions:
            ids = encode_chat(target.tokenizer, q.messages())
            served = engine.generate(ids, args.max_new_tokens, method="ar").tokens
            with pinned(args.core, 1):
                ref = greedy_generate(stock, ids, args.max_new_tokens, stops)
            first = next((i for i, (a, b) in enumerate(zip(served, ref)) if a != b), None)
            if first is None and len(served) != len(ref):
                first = min(len(served), len(ref))
            records.append({"id": q.id, "category": q.category, "tokens": len(ref), "first_flip": first})
            if args.out:  # after every question: a stopped run keeps what it measured
                _write(args.out, result)
    return result


def _write(path: str, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


def summarise(result: dict) -> str:
    records = result["records"]
    flips = [r for r in records if r["first_flip"] is not None]
    lines = [
        f"{result['cpu']}, torch {result['torch']}, fast path {result['fast_path']}: {len(records)} questions, "
        f"{sum(r['tokens'] for r in records)} tokens; {len(flips)} with a greedy flip against stock transformers",
    ]
    lines += [f"- question {r['id']} ({r['category']}): first differs at token {r['first_flip']}" for r in flips]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--questions", default=None, help="Spec-Bench's question file (default: the shared one)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fast-path", default="auto", choices=["auto", "exact", "onednn", "none"])
    ap.add_argument("--shard", default="0/1", help="i/n: every n-th question from the i-th")
    ap.add_argument("--limit", type=int, default=None, help="at most this many questions of the shard")
    ap.add_argument("--core", type=int, default=0, help="the CPU core both run on")
    ap.add_argument("--merge", nargs="+", default=None, help="merge shard JSON files instead of running")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.merge:
        parts = [json.load(open(p, encoding="utf-8")) for p in args.merge]
        result = parts[0] | {"records": [r for p in parts for r in p["records"]]}
    else:
        result = run(args)
    if args.out:
        _write(args.out, result)
    print(summarise(result))


if __name__ == "__main__":
    main()
