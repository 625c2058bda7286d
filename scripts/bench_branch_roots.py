"""Where Mirror-SD's branch roots come from, scored offline: how often the target's next token is among the proxy
head's top κ, prompt lookup's guesses (`NgramIndex.guesses`, what the draft server adds as roots), the datastore's
continuation, and their unions, on the held-out answers of a feature cache (the target's own greedy answers to
Spec-Bench questions, never trained on).

    python scripts/bench_branch_roots.py --proxy-head H --features DATA/features_heldout_L12-30 \
        [--datastore D/datastore.npz] [--kappas 4,8,16] [--guesses 0,1,2,3] [--json]

A branch the draft rolls out is needed only where the window stops and c* is its root, so what bounds Mirror-SD's
hits is the recall of the union of every root source at the window's positions, not the head's hit_κ alone (docs/
engine.md, forty-ninth session). Every answer position counts once; guesses read the prompt and the answer before it,
as the engine's index does. Prints a Markdown table (recall by κ and number of lookup guesses); --json prints one
object instead.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from mirror_train.data.features import FeatureCache
from mirror_train.datastore import Datastore
from mirror_train.devices import cpu_model
from mirror_train.engine.ngram import NgramIndex
from mirror_train.engine.server import STORE_CONTEXT
from mirror_train.models.proxy_head import load_proxy_head
from mirror_train.target import Target


def int_list(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def score(head, cache: FeatureCache, kappas: list[int], guesses: list[int], store: Datastore | None) -> dict:
    """Counts over the answer positions: the head's top κ alone, lookup's first g guesses alone, each union, and the
    datastore's next token (alone and added to each union)."""
    top_k, most = max(kappas), max(guesses)
    counts = {"positions": 0, "store": 0}
    counts |= {f"head{k}": 0 for k in kappas} | {f"lookup{g}": 0 for g in guesses}
    counts |= {f"head{k}+lookup{g}": 0 for k in kappas for g in guesses}
    counts |= {f"head{k}+lookup{g}+store": 0 for k in kappas for g in guesses}
    for s in range(cache.num_sequences):
        lo, hi = int(cache.offsets[s]), int(cache.offsets[s + 1])
        ids = np.asarray(cache.token_ids[lo:hi]).tolist()
        answer = np.asarray(cache.is_answer[lo:hi])
        if not answer.any():
            continue
        with torch.no_grad():
            states = torch.from_numpy(np.asarray(cache.hidden[lo:hi], dtype=np.float32))[None]
            top = head(states.to(head.dtype))[0].topk(top_k, -1).indices.tolist()
        index = NgramIndex(successors=max(most, 1))
        first = int(np.argmax(answer))
        index.reset(ids[: first + 1])
        for i in range(first, len(ids) - 1):  # position i predicts ids[i + 1]
            if i > first:
                index.extend(ids[i : i + 1])
            if not answer[i]:
                continue
            truth = ids[i + 1]
            counts["positions"] += 1
            guessed = [c for c, _ in index.guesses(most)] if most else []
            context = ids[max(0, i + 1 - STORE_CONTEXT) : i + 1]  # what the engine's datastore proposal reads
            proposal = store.propose(context, 1)[0] if store is not None else []
            stored = bool(proposal) and proposal[0] == truth
            counts["store"] += stored
            for g in guesses:
                counts[f"lookup{g}"] += truth in guessed[:g]
            for k in kappas:
                in_head = truth in top[i][:k]
                counts[f"head{k}"] += in_head
                for g in guesses:
                    union = in_head or truth in guessed[:g]
                    counts[f"head{k}+lookup{g}"] += union
                    counts[f"head{k}+lookup{g}+store"] += union or stored
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy-head", required=True, help="an exported proxy head")
    ap.add_argument("--features", required=True, help="a held-out feature cache holding the head's exit layer")
    ap.add_argument("--datastore", default=None, help="a datastore (.npz) to score beside them")
    ap.add_argument("--kappas", type=int_list, default=[4, 8, 16], help="the head's top κ to score")
    ap.add_argument("--guesses", type=int_list, default=[0, 1, 2, 3], help="prompt lookup's guesses per position")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    if min(args.kappas) < 1 or min(args.guesses) < 0:
        ap.error("--kappas must be ≥ 1 and --guesses ≥ 0")

    torch.set_num_threads(1)
    target = Target.load("testbed")
    head = load_proxy_head(args.proxy_head, target).eval()
    cache = FeatureCache(args.features, head.cfg.exit_layer)
    store = Datastore.load(args.datastore) if args.datastore else None
    counts = score(head, cache, args.kappas, args.guesses, store)
    n = max(counts["positions"], 1)
    recall = {key: value / n for key, value in counts.items() if key != "positions"}
    result = {"cpu": cpu_model(), "args": vars(args), "positions": counts["positions"], "recall": recall}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{counts['positions']} held-out answer positions; recall of the target's next token")
    print("\n| head top κ | " + " | ".join(f"+ {g} lookup guesses" for g in args.guesses) + " |")
    print("|---|" + "---|" * len(args.guesses))
    for k in args.kappas:
        print(f"| {k} | " + " | ".join(f"{recall[f'head{k}+lookup{g}']:.3f}" for g in args.guesses) + " |")
    print("\nlookup alone: " + ", ".join(f"{g} guesses {recall[f'lookup{g}']:.3f}" for g in args.guesses if g))
    if store is not None:
        g = max(args.guesses)
        added = ", ".join(f"top {k} {recall[f'head{k}+lookup{g}+store']:.3f}" for k in args.kappas)
        print(f"datastore alone: {recall['store']:.3f}; added to the head's top κ and {g} lookup guesses: {added}")


if __name__ == "__main__":
    main()
