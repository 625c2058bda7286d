"""Where each method's step time goes, on the testbed with trained artifacts: every method side by side in one run,
interleaved per question, and the engine's per-step statistics (StepStats) summed per method.

    python scripts/bench_steps.py --proxy-head outputs/proxy_head_smollm2/export \
        --draft outputs/drafter_smollm2/export --per-category 1 --max-new-tokens 128 [--variants ar,pld,sd,mirror]

A variant is a method, optionally with suffixes that change the engine: `-noforks` (forked windows off:
EngineConfig.forked_windows=False), `-unpriced` (the cores' contention not priced: price_contention=False),
`-draftonednn` (the draft served on oneDNN's linears and torch's SDPA, as before the twelfth session:
draft_fast_path=onednn), `-nostore` (no datastore of the target's answers: datastore=off), `-draftcopies` (every
window from the draft's process, its copies too: copies=draft), so one run compares with and without them. Per
variant: tokens/s over the questions (prefill included, Spec-Bench's convention), committed tokens per step, drafted
rows verified per step, the share of steps verifying a forked window and of those where its second chain was kept,
and the mean ms a step of the target's prefix, suffix and of the wait for the next window; the share of steps
whose next window is a copy (source ngram), a datastore's continuation (store), that asked the draft's process for
it, and that reused a branch rolled out during the suffix, and the draft's serial rollout ms a step. Every answer is
checked against ar's, token for token. Prints a Markdown table, then a second one that splits each drafting variant's
steps by how their next window was made (a plain step, a copy, the model's tokens; drafted after the verdict,
"serial", or reused from a branch rolled out during the target's step): the share of steps, the target's mean wait
for that window and how much of it the verdict queued behind the draft's earlier work, and the tokens the step that
verified it committed, i.e. what each way of making a window costs and brings.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from mirror_train.devices import cpu_model
from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.eval.questions import TASKS, load_questions
from mirror_train.prompts import default_specbench_file
from mirror_train.target import Target

# variant suffix → the EngineConfig change it makes
SUFFIXES = {
    "-noforks": ("forked_windows", False),
    "-unpriced": ("price_contention", False),
    "-draftonednn": ("draft_fast_path", "onednn"),  # the draft served as before the twelfth session (bf16 CPUs)
    "-nostore": ("datastore", "off"),  # no datastore of the target's answers beside prompt lookup (datastore.py)
    "-draftcopies": ("copies", "draft"),  # every window from the draft's process, as before the eighteenth session
}


def _variant(name: str) -> tuple[str, tuple]:
    """(method, the config changes as a hashable tuple) of a variant name such as `mirror-unpriced`."""
    changes = []
    for suffix, change in SUFFIXES.items():
        if suffix in name:
            name = name.replace(suffix, "")
            changes.append(change)
    return name, tuple(sorted(changes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy-head", default=None, help="exported proxy head (default: the logit lens at ℓe)")
    ap.add_argument("--draft", required=True, help="exported draft")
    ap.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per task (turn 1)")
    ap.add_argument("--tasks", default=None, help="comma-separated Spec-Bench tasks (default: all six)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--variants", default="ar,pld,sd,mirror,sd-noforks,mirror-noforks")
    args = ap.parse_args()

    target = Target.load("testbed")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    questions = load_questions(default_specbench_file(), tasks, args.per_category)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    base = EngineConfig()
    engines = {
        changes: MirrorEngine(target, args.proxy_head, args.draft, replace(base, **dict(changes))).start()
        for changes in {_variant(v)[1] for v in variants}
    }
    for engine in engines.values():  # warm-up: the kernels, the draft's calibration, the channel
        engine.generate(questions[0].messages(), 8, method="mirror")
    rows = {v: [] for v in ["ar"] + [v for v in variants if v != "ar"]}
    references = {}
    for q in questions:
        for v in ["ar"] + [v for v in variants if v != "ar"]:
            method, changes = _variant(v)
            g = engines[changes].generate(q.messages(), args.max_new_tokens, method=method)
            if method == "ar":
                references[q.id] = g.tokens
            rows[v].append((TASKS[q.category], g, g.tokens == references[q.id]))
    for engine in engines.values():
        engine.close()

    print(f"\n{len(questions)} questions × ≤ {args.max_new_tokens} tokens, {cpu_model()}\n")
    print(
        "| variant | tok/s | vs ar | committed / step | rows / step | forked | 2nd chain kept | prefix ms | "
        "suffix ms | wait ms | step ms | copy windows | store windows | draft asked | reused | fallback ms | lossless |"
    )
    print("|---" * 17 + "|")
    ar_rate = statistics.mean(g.tokens_per_s for _, g, _ in rows["ar"])
    for v, got in rows.items():
        steps = [s for _, g, _ in got for s in g.steps[1:]]  # the prefill aside
        rate = statistics.mean(g.tokens_per_s for _, g, _ in got)
        forked = [s for s in steps if s.alt]

        def mean(field, steps=steps):
            return statistics.mean(getattr(s, field) for s in steps) if steps else 0.0

        print(
            f"| {v} | {rate:.1f} | {rate / ar_rate:.2f}× | {mean('committed'):.2f} | {mean('window'):.2f} | "
            f"{len(forked) / max(len(steps), 1):.2f} | {sum(s.alt_kept for s in forked) / max(len(forked), 1):.2f} | "
            f"{mean('prefix_ms'):.1f} | {mean('suffix_ms'):.1f} | {mean('wait_ms'):.1f} | {mean('step_ms'):.1f} | "
            f"{sum(s.source == 'ngram' for s in steps) / max(len(steps), 1):.2f} | "
            f"{sum(s.source == 'store' for s in steps) / max(len(steps), 1):.2f} | "
            f"{sum(s.asked for s in steps) / max(len(steps), 1):.2f} | "
            f"{sum(bool(s.reused) for s in steps) / max(len(steps), 1):.2f} | {mean('fallback_ms'):.1f} | "
            f"{all(ok for *_, ok in got)} |"
        )
    print("\n| variant | next window | steps | wait ms | of it queued | committed by it |\n|---|---|---|---|---|---|")
    for v, got in rows.items():
        if _variant(v)[0] in ("ar", "pld", "pld_store"):
            continue
        for kind, share, wait, queued, committed in window_kinds([g.steps[1:] for _, g, _ in got]):
            print(f"| {v} | {kind} | {share:.2f} | {wait:.1f} | {queued:.1f} | {committed:.2f} |")


def window_kinds(generations: list[list]) -> list[tuple[str, float, float, float, float]]:
    """(kind, share of steps, mean wait ms, the mean of it the verdict queued behind the draft's earlier work, mean
    tokens committed by the step that verified the window) by how each step's next window was made (module
    docstring); generations: one list of StepStats each, the prefill aside."""
    waits: dict[str, list[float]] = {}
    queued: dict[str, list[float]] = {}
    committed: dict[str, list[int]] = {}
    for steps in generations:
        for step, after in zip(steps, steps[1:] + [None]):
            made = "reused" if step.reused else ("serial" if step.draft_forwards else "")
            here = "" if step.asked or step.source == "model" else " (target's side)"  # copies="target"
            kind = f"{step.source or 'plain'} {made}".strip() + here
            waits.setdefault(kind, []).append(step.wait_ms)
            queued.setdefault(kind, []).append(step.queued_ms)
            if after is not None:
                committed.setdefault(kind, []).append(after.committed)
    total = sum(len(w) for w in waits.values())
    return [
        (
            k,
            len(w) / total,
            statistics.mean(w),
            statistics.mean(queued[k]),
            statistics.mean(committed[k]) if committed.get(k) else 0.0,
        )
        for k, w in sorted(waits.items())
    ]


if __name__ == "__main__":
    main()
