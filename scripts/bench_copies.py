"""What the engine's copies commit per unit of the target's time, simulated on the target's own answers: no model runs.

    python scripts/bench_copies.py --data outputs/data/smollm2 --row-cost 0.09 --ngram-tokens 8,16

The engine's copy server (method `pld_store`'s: prompt lookup and the datastore, `mirror_train/engine/server.py`,
the same object the engine asks, with its calibration learning online) is walked through answers the target gave
to training prompts, held out of the datastore it reads (built here from the others, as the draft recipe builds it):
every window it offers is "verified" against the answer (the target's greedy text: its tokens are what the target
would commit), the verdict goes back as the engine sends it, and a step costs c(w) = 1 + row_cost · w of a
one-token step (forked windows: all their rows). Printed per setting: tokens a step, rows a step, and tokens per
unit of target time (the speed-up over plain decoding this cost model gives). `--row-cost`: 0.09 is float32 on a
Zen 4 core (docs/engine.md, nineteenth session), ~0.03 bf16 on AMX. Deterministic: a change to the copies' policy is
measured here in seconds, where a Spec-Bench run's noise (3-5% between runs) would hide it; the answers were made
in the data's precision (bf16 where the machine has it), not float32.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from mirror_train.data.selfdistill import answer_sequences, load_selfdistill
from mirror_train.datastore import Datastore, DatastoreConfig
from mirror_train.engine.channel import LocalDraft
from mirror_train.engine.messages import Start, Verdict


def matched(proposal: list[int], answer: list[int], pos: int) -> int:
    n = 0
    while n < len(proposal) and pos + n < len(answer) and proposal[n] == answer[pos + n]:
        n += 1
    return n


def walk(tests, store, ngram_tokens: int, row_cost: float, forks: bool) -> dict:
    costs = [1.0 + row_cost * w for w in range(2 * ngram_tokens + 2)]
    spec = {"kind": "ngram", "ngram_tokens": ngram_tokens, "adaptive_window": True, "datastore": store}
    copier = LocalDraft(spec)  # one server for every answer: its calibration carries over, as in a benchmark run
    steps = tokens = rows = time = 0.0
    for prompt, answer in tests:
        copier.send(Start(prompt, 4, costs=costs, step_ms=25.0, forks=forks))
        copier.recv()  # its window after the prompt: the prefill decides that token, as in the engine
        copier.send(Verdict(0, answer[0], costs=costs, step_ms=25.0, committed=[answer[0]]))
        reply, pos = copier.recv(), 1
        while pos < len(answer):
            window, alt, fork = reply.tokens, reply.alt, reply.fork
            main = matched(window, answer, pos)
            second = matched(window[:fork] + alt, answer, pos) if alt else None
            kept = max(main, second or 0)
            width = len(window) + len(alt) - fork if alt else len(window)
            steps, rows, time = steps + 1, rows + width, time + costs[min(width, len(costs) - 1)]
            if pos + kept >= len(answer):  # the answer ends inside the window
                tokens += len(answer) - pos
                break
            tokens, correction, pos = tokens + kept + 1, answer[pos + kept], pos + kept + 1
            copier.send(Verdict(main, correction, costs=costs, step_ms=25.0, alt_accepted=second))
            reply = copier.recv()
    return {"tokens_a_step": tokens / steps, "rows_a_step": rows / steps, "speedup": tokens / time}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="outputs/data/smollm2", help="a data directory of the recipes (selfdistill/)")
    ap.add_argument("--held-out", type=float, default=0.2, help="share of the prompts walked, out of the datastore")
    ap.add_argument("--row-cost", type=float, default=0.09)
    ap.add_argument("--ngram-tokens", default="8,16", help="comma-separated settings of EngineConfig.ngram_tokens")
    ap.add_argument("--no-forks", action="store_true", help="single chains only (forks: CPUs with the C kernels)")
    args = ap.parse_args()
    ds = load_selfdistill(Path(args.data) / "selfdistill")
    ids = sorted(set(ds["id"]))
    random.Random(0).shuffle(ids)
    held = set(ids[: int(len(ids) * args.held_out)])
    sequences = answer_sequences(ds)
    train = [s for i, s in zip(ds["id"], sequences) if i not in held]
    tests = [(list(p), list(a)) for i, p, a in zip(ds["id"], ds["prompt_ids"], ds["answer_ids"]) if i in held and a]
    store = str(Path(tempfile.mkdtemp()) / "datastore.npz")  # the copy server loads it from a file, as in serving
    Datastore.build(train, DatastoreConfig()).save(store)
    print(f"{len(tests)} answers walked, datastore of {len(train)} others; row cost {args.row_cost}")
    print("| ngram_tokens | tokens a step | rows a step | speed-up (cost model) |\n|---|---|---|---|")
    for k in (int(x) for x in args.ngram_tokens.split(",")):
        r = walk(tests, store, k, args.row_cost, not args.no_forks)
        print(f"| {k} | {r['tokens_a_step']:.3f} | {r['rows_a_step']:.2f} | {r['speedup']:.3f} |")


if __name__ == "__main__":
    main()
