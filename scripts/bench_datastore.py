"""How much a datastore of the target's own answers proposes that the target then says, on held-out answers: the
build settings and the amount of data side by side, with no target run (the answers are the target's greedy text).

    python scripts/bench_datastore.py --data outputs/data/smollm2 [--held-out 0.1] [--window 8]

The answers of the data's self-distilled set are split by prompt (the last `--held-out` share held out); a datastore
is built from the rest for each setting (`DatastoreConfig` fields as name=value,...; `data=0.5` builds from that
share of the training answers: is more data worth making?). On every held-out answer, a greedy walk: at each
position the proposal of up to `--window` tokens after the prompt's tail and the answer so far is compared with
what the answer says next; the walk advances by the tokens it matched plus one (the target's own token), as a
verification step does. Per setting: the datastore's size, the share of positions with a proposal, the tokens
matched per proposal, and tokens per step of the walk for the datastore alone, prompt lookup alone (engine/ngram.py
over the prompt and the answer so far) and whichever of the two matched more (an upper bound on choosing between
them). Choose settings on held-out training answers, never on the benchmark's questions.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import fields, replace
from pathlib import Path

from mirror_train.data.selfdistill import answer_sequences, load_selfdistill
from mirror_train.datastore import Datastore, DatastoreConfig
from mirror_train.engine.ngram import NgramIndex
from mirror_train.engine.server import STORE_CONTEXT  # the committed tokens a proposal reads, as the engine's
from mirror_train.errors import MirrorTrainError


def matched(proposal: list[int], truth: list[int]) -> int:
    """How many leading tokens of a proposal the text then says."""
    n = 0
    while n < min(len(proposal), len(truth)) and proposal[n] == truth[n]:
        n += 1
    return n


def walk(prompt: list[int], answer: list[int], store: Datastore | None, window: int, tail: int) -> dict:
    """One held-out answer walked through as verification steps (module docstring)."""
    ngram = NgramIndex()
    ngram.reset(prompt)
    out = {"store": [0, 0], "ngram": [0, 0], "best": [0, 0], "proposed": 0, "positions": 0, "kept": 0}
    text = list(prompt[-tail:]) if tail else []
    for source in ("store", "ngram", "best"):
        pos = 0
        ngram.reset(prompt)
        while pos < len(answer):
            truth = answer[pos:]
            context = (text + answer[:pos])[-STORE_CONTEXT:]
            from_store = store.propose(context, window)[0] if store is not None else []
            from_ngram = ngram.propose(window)[0]
            m_store, m_ngram = matched(from_store, truth), matched(from_ngram, truth)
            m = {"store": m_store, "ngram": m_ngram, "best": max(m_store, m_ngram)}[source]
            if source == "store":
                out["positions"] += 1
                out["proposed"] += bool(from_store)
                out["kept"] += m_store
            step = min(m + 1, len(answer) - pos)
            ngram.extend(answer[pos : pos + step])
            pos += step
            out[source][0] += step
            out[source][1] += 1
    return out


def parse_setting(text: str) -> tuple[DatastoreConfig, float]:
    """`min_count=1,max_n=6,data=0.5` → (the config, the share of training answers to build from)."""
    cfg, share = DatastoreConfig(), 1.0
    names = {f.name: f.type for f in fields(DatastoreConfig)}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "data":
            share = float(value)
        elif key in names:
            cfg = replace(cfg, **{key: int(value)})
        else:
            raise MirrorTrainError(f"unknown datastore setting {key!r} (one of {sorted(names) + ['data']})")
    cfg.validate()
    return cfg, share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a data directory of the recipes (its selfdistill/ is read)")
    ap.add_argument("--held-out", type=float, default=0.1, help="share of the answers held out (by prompt)")
    ap.add_argument("--window", type=int, default=8, help="tokens a proposal holds at most (ngram_tokens)")
    ap.add_argument(
        "--settings",
        default="default/min_count=1/min_count=3/max_n=6/data=0.5/data=0.25",
        help="settings separated by spaces or '/', each name=value,... ('default': DatastoreConfig's own)",
    )
    args = ap.parse_args()
    ds = load_selfdistill(Path(args.data) / "selfdistill")
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    cut = int(len(order) * (1 - args.held_out))
    train, held = sorted(order[:cut]), sorted(order[cut:])
    prompts, answers = ds["prompt_ids"], ds["answer_ids"]
    print(f"{len(train)} answers to build from, {len(held)} held out; window {args.window}\n")
    print(
        "| setting | n-grams | proposals / position | matched / proposal | tokens / step: store | prompt lookup | "
        "best of both |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.settings.replace("/", " ").split():
        cfg, share = parse_setting("" if name == "default" else name)
        rows = train[: max(1, int(len(train) * share))]
        sequences = answer_sequences(ds.select(rows), cfg.prompt_tail)
        store = Datastore.build(sequences, cfg)
        walks = [walk(list(prompts[i]), list(answers[i]), store, args.window, cfg.prompt_tail) for i in held]
        total = {k: [sum(w[k][j] for w in walks) for j in (0, 1)] for k in ("store", "ngram", "best")}
        positions = sum(w["positions"] for w in walks)
        proposed = sum(w["proposed"] for w in walks)
        kept = sum(w["kept"] for w in walks)
        rate = {k: t[0] / max(t[1], 1) for k, t in total.items()}
        print(
            f"| {name} | {len(store)} | {proposed / max(positions, 1):.2f} | {kept / max(proposed, 1):.2f} | "
            f"{rate['store']:.3f} | {rate['ngram']:.3f} | {rate['best']:.3f} |"
        )


if __name__ == "__main__":
    main()
