"""What a decoding step costs each method against another's, from Spec-Bench answer files (no model, no timing here).

    python scripts/step_cost.py outputs/specbench_s21a outputs/specbench_s21b --base pld_store

Two methods that commit nearly the same tokens a step (Mirror-SD and prompt lookup with the datastore, docs/
specbench.md) are ordered by what their steps cost. For each run directory and method this prints, over the
questions both answered, the median and quartiles of (the method's wall time per decoding step) ÷ (the base
method's), and of (its tokens per step) ÷ (the base's): a speed-up over the base is the second over the first.
Per question, so that long and short answers count alike, as in Spec-Bench's own speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def per_question(path: Path) -> dict:
    """question id → (new tokens, wall seconds, decoding steps), summed over turns."""
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        choice = row["choices"][0]
        out[row["question_id"]] = (sum(choice["new_tokens"]), sum(choice["wall_time"]), sum(choice["decoding_steps"]))
    return out


def spread(values: list[float]) -> str:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"{q2:.3f} ({q1:.3f}–{q3:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="mirror-eval specbench output directories")
    ap.add_argument("--base", default="pld_store", help="the method every other is divided by")
    args = ap.parse_args()
    print(f"| run | method | questions | time a step ÷ {args.base}'s | tokens a step ÷ {args.base}'s |")
    print("|---|---|---|---|---|")
    for run in args.runs:
        answers = run / "answers"
        base = per_question(answers / f"{args.base}.jsonl")
        for path in sorted(answers.glob("*.jsonl")):
            if path.stem == args.base:
                continue
            mine = per_question(path)
            shared = [q for q in mine if q in base and mine[q][2] and base[q][2]]
            if len(shared) < 2:
                continue
            step = [(mine[q][1] / mine[q][2]) / (base[q][1] / base[q][2]) for q in shared]
            tokens = [(mine[q][0] / mine[q][2]) / (base[q][0] / base[q][2]) for q in shared]
            print(f"| {run.name} | {path.stem} | {len(shared)} | {spread(step)} | {spread(tokens)} |")


if __name__ == "__main__":
    main()
