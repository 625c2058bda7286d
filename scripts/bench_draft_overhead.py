"""What the draft's process costs the target beside the engine's own copies, and why its model is asked.

    python scripts/bench_draft_overhead.py --proxy-head outputs/proxy_head_smollm2/export \
        --draft outputs/drafter_smollm2/export --per-category 2 --reps 2

Mirror-SD and sd serve most windows from the engine's own copies (EngineConfig.copies = "target", the copy server
pld_store uses) and ask the draft's process only where its model promised more (`window.ask_model`). This runs, on
Spec-Bench questions (turn 1, interleaved per question, the order reversed in every other repetition so that the
host's drift hits each method alike): ar, pld_store, sd, mirror, and `mirror-told`: Mirror-SD whose draft's
process is never asked (ask_model always False), only told what was committed, so that it commits pld_store's
windows and its steps differ from pld_store's by what the process's background work (the prompt's prefill, the
catch-ups, the messages) costs the target; and `mirror-trusted`: Mirror-SD asking at its model's promise taken at
its word (window.AskReturn's factor held at 1, as before the twenty-third session), with a ledger of its own. Per
method, over the questions, the median and quartiles of: its wall
time per step ÷ pld_store's, the target's own forward time per step (prefix + suffix) ÷ pld_store's, tokens per
step ÷ pld_store's, and speed ÷ pld_store's; the share of steps that asked the draft and the mean wait for the next
window; and whether every answer equals ar's. Then, for mirror, why each ask happened: the model's last promised
rate beat the copy on offer, or the draft was due to explore; and how often that rate beat a plain step's.
`--methods` runs a subset, `--set KEY=VALUE` (repeatable) sets the engine's settings (EngineConfig), e.g.
`--methods ar,pld_store,mirror --set look_ahead=false` for one side of an A/B between runs.
"""

from __future__ import annotations

import argparse
import statistics

from step_cost import spread  # scripts/ is on the path of a script run from it

import mirror_train.engine.engine as engine_module
from mirror_train.config import load_config
from mirror_train.devices import cpu_model
from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.engine.window import AskReturn, ask_model
from mirror_train.errors import MirrorTrainError
from mirror_train.eval.questions import load_questions
from mirror_train.prompts import default_specbench_file
from mirror_train.target import Target

ASKS: list[tuple] = []  # (model_rate, copy_rate, skipped, explore_in, asked) of every decision, while recording
MODE = {"told": False, "record": False}
METHODS = ("ar", "pld_store", "mirror", "mirror-trusted", "mirror-told", "sd")


def _ask(model_rate: float, copy_rate: float, skipped: int, explore_in: int) -> bool:
    """The engine's ask rule, or never (`-told`); recorded for the ask table."""
    asked = False if MODE["told"] else ask_model(model_rate, copy_rate, skipped, explore_in)
    if MODE["record"]:
        ASKS.append((model_rate, copy_rate, skipped, explore_in, asked))
    return asked


class Trusted(AskReturn):
    """The model's promise taken at its word: what asks delivered is kept, never used."""

    def factor(self) -> float:
        return 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy-head", default=None, help="exported proxy head (default: the logit lens at ℓe)")
    ap.add_argument("--draft", required=True, help="exported draft")
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per task (turn 1)")
    ap.add_argument("--reps", type=int, default=2, help="passes over the questions")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an EngineConfig setting")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if not {"ar", "pld_store"} <= set(methods) or not set(methods) <= set(METHODS):
        ap.error(f"--methods: a subset of {','.join(METHODS)} with ar and pld_store (the references)")
    try:
        config = load_config(EngineConfig, None, args.set)
    except MirrorTrainError as e:
        ap.error(f"--set: {e}")

    engine_module.ask_model = _ask  # the engine reads it from its own module
    target = Target.load("testbed")
    questions = load_questions(default_specbench_file(), None, args.per_category)
    rows: dict[str, list] = {m: [] for m in methods}
    with MirrorEngine(target, args.proxy_head, args.draft, config).start() as engine:
        ledgers = {"priced": engine._ask_return, "trusted": Trusted()}
        engine.generate(questions[0].messages(), 8, method="mirror")  # warm-up: kernels, calibration, channel
        for rep in range(args.reps):
            for q in questions:
                for m in methods if rep % 2 == 0 else methods[::-1]:
                    MODE["told"], MODE["record"] = m.endswith("-told"), m == "mirror"
                    engine._ask_return = ledgers["trusted" if m.endswith("-trusted") else "priced"]
                    g = engine.generate(q.messages(), args.max_new_tokens, method=m.split("-")[0])
                    steps = g.steps[1:]  # the prefill aside
                    rows[m].append(
                        {
                            "tokens": g.tokens,
                            "tps": g.tokens_per_s,
                            "step_ms": sum(s.step_ms for s in steps) / max(len(steps), 1),
                            "target_ms": sum(s.prefix_ms + s.suffix_ms for s in steps) / max(len(steps), 1),
                            "per_step": len(g.tokens) / len(g.steps),
                            "asked": sum(s.asked for s in steps),
                            "model": sum(s.source == "model" for s in steps),
                            "wait_ms": sum(s.wait_ms for s in steps),
                            "n": len(steps),
                        }
                    )
    base, ref = rows["pld_store"], rows["ar"]
    print(f"\n{len(questions)} questions × {args.reps} × ≤ {args.max_new_tokens} tokens, {cpu_model()}\n")
    print(
        "| method | step time ÷ pld_store | target's forwards ÷ | tokens a step ÷ | speed ÷ | asked | model windows "
        "| wait ms | lossless |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in methods:
        got = rows[m]

        def ratio(key, got=got):
            return spread([a[key] / b[key] for a, b in zip(got, base)])

        steps = sum(r["n"] for r in got)
        print(
            f"| {m} | {ratio('step_ms')} | {ratio('target_ms')} | {ratio('per_step')} | {ratio('tps')} | "
            f"{sum(r['asked'] for r in got) / steps:.3f} | {sum(r['model'] for r in got) / steps:.3f} | "
            f"{sum(r['wait_ms'] for r in got) / steps:.2f} | "
            f"{all(a['tokens'] == b['tokens'] for a, b in zip(got, ref))} |"
        )
    print(
        f"\nwhat rate-driven asks delivered of their promise: {ledgers['priced'].factor():.3f} (mirror, sd), "
        f"{AskReturn.factor(ledgers['trusted']):.3f} (mirror-trusted)"
    )
    rate_asks = sum(1 for r, c, _, _, a in ASKS if a and r > max(c, 1.0))
    finite = [r for r, *_ in ASKS if r < float("inf")]
    print(
        f"\nmirror: {len(ASKS)} decisions, {sum(a for *_, a in ASKS)} asks: {rate_asks} where the model's promised "
        f"rate beat the copy on offer, the rest due to explore; the rate beat a plain step's (1) at "
        f"{sum(r > 1.0 for r, *_ in ASKS) / max(len(ASKS), 1):.3f} of the decisions"
        + (f", median {statistics.median(finite):.3f}" if finite else "")
    )


if __name__ == "__main__":
    main()
