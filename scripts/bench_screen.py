"""The LM head's screens side by side (screened_head.py): how long each takes and how many ids it leaves to compute
exactly, on the target's own final states.

    python scripts/bench_screen.py [--per-category 2] [--max-new-tokens 64] [--repeats 15] [--json]

The target's greedy answers to Spec-Bench first turns give its final states (the LM head's inputs: the prompt's last
row and every answer row). For every screen kind this CPU builds (int8, each input in two bytes a value; bfloat16 on
the dot product; bfloat16 widened) and the whole float32 head: the median ms of a greedy call (the screen's scores,
then its candidates' exact logits and their argmax) at 1, 2, 4, 8 and 16 rows, every (kind, rows) timed in turn
round after round, one thread; and the candidates a row (how many ids the bound leaves, counted in float64 from the
screen's own per-id bounds), mean, median, 90th percentile and largest. Every screen's tokens are checked against
the whole head's argmax. Needs $MIRROR_TRAIN_SPECBENCH_QUESTIONS (or the shared question file) like bench_engine.py.
"""

from __future__ import annotations

import argparse
import json

import torch

from mirror_train import fastpath, screened_head
from mirror_train.devices import cpu_model
from mirror_train.generation import encode_chat
from mirror_train.prompts import default_specbench_file, load_prompts
from mirror_train.target import Target
from mirror_train.timing import interleaved_median_ms

ROWS = (1, 2, 4, 8, 16)


def final_states(target: Target, per_category: int, max_new_tokens: int) -> torch.Tensor:
    """(rows, H) float32: the LM head's inputs over the target's greedy answers (the prompt's last row onwards)."""
    seen: dict[str, int] = {}
    rows = []
    for q in load_prompts(default_specbench_file()):
        if seen.get(q.category, 0) >= per_category:
            continue
        seen[q.category] = seen.get(q.category, 0) + 1
        ids = torch.tensor([encode_chat(target.tokenizer, q.messages())])
        with torch.inference_mode():
            out = target.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            states, _ = target.hidden_states(out)
        rows.append(states[-1][0, ids.shape[1] - 1 :].float())
    return torch.cat(rows).contiguous()


def candidates(screen: screened_head.ScreenedHead, head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """How many ids a row's bound leaves (a_v + e_v ≥ the served logit at its screened argmax), in float64."""
    scores = screened_head.screen_scores(screen, x)[:, : screen.shape[0]].double()
    served = head(x).double()
    e = screened_head.error_bounds(screen, x)
    lower = served.gather(1, scores.argmax(dim=1, keepdim=True))
    return (scores + e >= lower).sum(dim=1).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category (first turns)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    target = Target.load(args.target, dtype=torch.float32)
    fastpath.install(target.model, "exact")
    head = target.lm_head
    x = final_states(target, args.per_category, args.max_new_tokens)
    screens = {kind: screened_head.build(head, measure=False, kind=kind) for kind in screened_head.kinds_built()}
    fns, counts, same = {}, {}, True
    with torch.inference_mode():
        whole = head(x).argmax(-1).tolist()
        for kind, screen in screens.items():
            counts[kind] = candidates(screen, head, x)
            same &= screened_head.screened_argmax(head, screen, x[:64]) == whole[:64]
            for n in ROWS:
                rows = x[:n].contiguous()
                fns[(kind, n)] = lambda s=screen, r=rows: screened_head.screened_argmax(head, s, r)
        for n in ROWS:
            rows = x[:n].contiguous()
            fns[("whole", n)] = lambda r=rows: head(r).argmax(-1).tolist()
        times = interleaved_median_ms(fns, repeats=args.repeats, warmup=2)
    result = {
        "cpu": cpu_model(),
        "rows": x.shape[0],
        "ms": {kind: {n: round(times[(kind, n)], 3) for n in ROWS} for kind in [*screens, "whole"]},
        "candidates": {
            kind: {
                "mean": round(float(c.mean()), 2),
                "median": float(c.median()),
                "p90": float(c.quantile(0.9)),
                "max": float(c.max()),
            }
            for kind, c in counts.items()
        },
        "tokens_equal_whole_head": bool(same),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['cpu']}: {result['rows']} final states; a greedy call's median ms by rows, one thread")
    print("| screen | " + " | ".join(f"{n} rows" for n in ROWS) + " | candidates a row: mean / median / p90 / max |")
    print("|---|" + "---|" * (len(ROWS) + 1))
    for kind, by_rows in result["ms"].items():
        c = result["candidates"].get(kind)
        cand = f"{c['mean']} / {c['median']:.0f} / {c['p90']:.0f} / {c['max']:.0f}" if c else "–"
        print(f"| {kind} | " + " | ".join(f"{v:.2f}" for v in by_rows.values()) + f" | {cand} |")
    print(f"tokens equal to the whole head's: {result['tokens_equal_whole_head']}")


if __name__ == "__main__":
    main()
