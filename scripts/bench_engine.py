"""The engine on the testbed, every method side by side in one run on one machine: target-only (ar), serial
speculative decoding (sd) and Mirror-SD (mirror), greedy, the two CPU cores as the two devices.

    python scripts/bench_engine.py --out docs/results/engine_smollm2.json

Part 1 measures the engine apart from draft quality: the synthetic draft replays the target's own greedy answer
(the ar run's) with errors injected at each per-token acceptance rate, and costs `--draft-cost` × the target's
measured time per token per forward; `--repeats N` runs it N rounds and gives each round's decoding ratios, their
median and range beside the pooled ones (the machine's noise, measured). Part 2 runs the trained draft and proxy
head (when given). Every answer of every method is checked against the ar answer, token for token. Prompts:
`--per-category` Spec-Bench questions of each task, turn 1. Prints Markdown tables; writes JSON with every
generation's summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

from mirror_train.devices import cpu_model
from mirror_train.engine import EngineConfig, MirrorEngine, SyntheticDraftConfig
from mirror_train.eval.questions import TASKS, load_questions
from mirror_train.prompts import default_specbench_file
from mirror_train.target import Target


def pick_prompts(path, per_task: int):
    """(task, question) pairs: `per_task` questions of each Spec-Bench task, spread over it (turn 1 is used)."""
    return [(TASKS[q.category], q) for q in load_questions(path, None, per_task)]


# StepStats times summed over a generation's verification steps for the step breakdown (`per_step`), beside its
# step_ms
PARTS = ("prefix_ms", "head_ms", "suffix_ms", "wait_ms", "branch_ms", "fallback_ms")
# How Mirror-SD's next window was made after a verdict (`next_window_kind`), for where its wait goes (`print_waits`)
KINDS = ("whole branch", "branch drafted on", "miss, c* in top-κ", "miss, c* not in top-κ")
# Mirror-SD beside a perfect proxy head (`--perfect-head`): c* always its first candidate, what the head's misses cost
PERFECT = "mirror_perfect_head"


def next_window_kind(step) -> str | None:
    """How the draft made the window after this step's verdict: a branch rolled out during the suffix, whole or
    drafted on after the verdict (short of its length), or a serial rollout after a miss, where the proxy's top-κ
    at the stop held c* (the branch was not rolled out) or did not; None where no branch was asked for."""
    if step.reused is None:
        return None
    if step.reused:
        return KINDS[1] if step.draft_forwards else KINDS[0]
    return KINDS[2] if step.hit else KINDS[3]


def wait_kinds(steps) -> dict:
    """Per next-window kind: steps, and the sums of their waits, of the verdict's queueing in the draft's process
    (behind its branch rollout) and of the draft's forwards after the verdict."""
    out = {kind: {"steps": 0, "wait_ms": 0.0, "queued_ms": 0.0, "forwards": 0} for kind in KINDS}
    for s in steps:
        kind = next_window_kind(s)
        if kind is not None:
            k = out[kind]
            k["steps"] += 1
            k["wait_ms"] += s.wait_ms
            k["queued_ms"] += s.queued_ms
            k["forwards"] += s.draft_forwards
    return out


def run_methods(engine, prompts, references, methods, max_new_tokens, more=()):
    """Every method on every prompt, methods interleaved per prompt (a noisy machine drifts between them); `more`:
    (engine, method, label) runs of other engines, interleaved the same way, their rows named by the label."""
    rows = []
    runs = [(engine, method, method) for method in methods] + list(more)
    for (task, prompt), ref in zip(prompts, references, strict=True):
        for runner, method, label in runs:
            g = runner.generate(prompt.messages(), max_new_tokens, method=method, reference=ref)
            steps = [s for s in g.steps if s.window]
            rows.append(
                {
                    **g.summary(),
                    "method": label,
                    "task": task,
                    "id": prompt.id,
                    "lossless": g.tokens == ref,
                    "window_tokens": sum(s.committed for s in steps),
                    "windows": len(steps),
                    "step_ms": sum(s.step_ms for s in steps),
                    "decode_ms": sum(s.step_ms for s in g.steps),  # every step: the generation without its prefill
                    "predicted_ms": sum(s.predicted_ms for s in steps),
                    "hits": [s.hit for s in g.steps if s.hit is not None],
                    "omegas": [s.omega for s in g.steps if s.omega is not None],
                    "branches": statistics.mean([s.branches for s in steps]) if steps else 0.0,
                    "wait_ms": statistics.mean([s.wait_ms for s in steps]) if steps else 0.0,
                    "sums": {k: sum(getattr(s, k) for s in steps) for k in PARTS},  # divided per step in `per_step`
                    "reused_steps": sum(s.reused is True for s in steps),
                    "missed_steps": sum(s.reused is False for s in steps),
                    "wait_kinds": wait_kinds(steps),
                }
            )
    return rows


def aggregate(rows, method):
    mine = [r for r in rows if r["method"] == method]
    tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
    reuse = [r["reuse_rate"] for r in mine if r["reuse_rate"] is not None]
    hits = [h for r in mine for h in r["hits"]]
    predicted = sum(r["predicted_ms"] for r in mine)
    return {
        "tokens_per_s": tokens / seconds,
        "decode_tokens_per_s": tokens / (sum(r["decode_ms"] for r in mine) / 1000),
        "mean_per_question_tokens_per_s": statistics.mean(r["tokens_per_s"] for r in mine),
        # tokens per verified window (A + 1), the prefill's first token aside; 1.0 for ar
        "mean_accepted": sum(r["window_tokens"] for r in mine) / max(sum(r["windows"] for r in mine), 1) or 1.0,
        "reuse_rate": statistics.mean(reuse) if reuse else None,
        "hit": statistics.mean(hits) if hits else None,
        "overlap_efficiency": predicted / sum(r["step_ms"] for r in mine) if predicted else None,
        "lossless": all(r["lossless"] for r in mine),
        "branches": statistics.mean(r["branches"] for r in mine),
        "wait_ms": statistics.mean(r["wait_ms"] for r in mine),
        "per_step": per_step(mine),
    }


def per_step(rows) -> dict:
    """Means a verification step: its time and each of PARTS, and the shares of steps whose next window was a branch
    rolled out during the target's suffix (reused) or was drafted after the verdict (missed)."""
    steps = max(sum(r["windows"] for r in rows), 1)
    out = {"step_ms": sum(r["step_ms"] for r in rows) / steps}
    out |= {k: sum(r["sums"][k] for r in rows) / steps for k in PARTS}
    out["reused"] = sum(r["reused_steps"] for r in rows) / steps
    out["missed"] = sum(r["missed_steps"] for r in rows) / steps
    out["waits"] = {}
    for kind in KINDS:
        ks = [r["wait_kinds"][kind] for r in rows]
        n = sum(k["steps"] for k in ks)
        means = {f: sum(k[f] for k in ks) / max(n, 1) for f in ("wait_ms", "queued_ms", "forwards")}
        out["waits"][kind] = {"share": n / steps, **means}
    return out


def print_steps(table) -> None:
    """Where a drafting method's verification step goes, at each acceptance rate (means over its steps, ms)."""
    print(
        "\nWhere a verification step goes (means a step, ms; the wait is for the next window after the verdict; "
        "reused / missed: the next window was a branch rolled out during the suffix / drafted after the verdict)\n"
    )
    print(
        "| acceptance | method | step | prefix | head | suffix | wait | branch rollout | fallback | tokens a step | "
        "ms a token | reused | missed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        for method in ("sd", "mirror", PERFECT):
            if method not in row["methods"]:
                continue
            a = row["methods"][method]
            p, tokens = a["per_step"], a["mean_accepted"]
            print(
                f"| {row['acceptance']:.1f} | {method} | {p['step_ms']:.1f} | {p['prefix_ms']:.1f} | "
                f"{p['head_ms']:.1f} | {p['suffix_ms']:.1f} | {p['wait_ms']:.1f} | {p['branch_ms']:.1f} | "
                f"{p['fallback_ms']:.1f} | {tokens:.2f} | {p['step_ms'] / tokens:.1f} | "
                f"{p['reused']:.2f} | {p['missed']:.2f} |"
            )


def print_waits(table) -> None:
    """Where Mirror-SD's wait for its next window goes, by how the window was made (`next_window_kind`)."""
    print(
        "\nWhere Mirror-SD's wait goes, by how the next window was made (share of steps; means over those steps: the "
        "wait, the verdict queued in the draft's process behind its branch rollout, the draft's forwards after the "
        "verdict; ms a step: the kind's share × its wait, the part of the table above's wait that kind makes)\n"
    )
    print(
        "| acceptance | next window | share of steps | wait ms | queued ms | forwards after the verdict | ms a step |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in table:
        for method in ("mirror", PERFECT):
            if method not in row["methods"]:
                continue
            head = "" if method == "mirror" else " (perfect head)"
            for kind, w in row["methods"][method]["per_step"]["waits"].items():
                print(
                    f"| {row['acceptance']:.1f}{head} | {kind} | {w['share']:.3f} | {w['wait_ms']:.1f} | "
                    f"{w['queued_ms']:.1f} | {w['forwards']:.2f} | {w['share'] * w['wait_ms']:.2f} |"
                )


def round_ratios(rows) -> dict:
    """One round's decoding tokens/s by method and Mirror-SD's ratios to ar and to serial SD (and its perfect-head
    run's, where there is one)."""
    methods = [m for m in ("ar", "sd", "mirror", PERFECT) if any(r["method"] == m for r in rows)]
    speed = {m: aggregate(rows, m)["decode_tokens_per_s"] for m in methods}
    out = speed | {"mirror/ar": speed["mirror"] / speed["ar"], "mirror/sd": speed["mirror"] / speed["sd"]}
    if PERFECT in speed:
        out[f"{PERFECT}/sd"] = speed[PERFECT] / speed["sd"]
    return out


def spread(rounds, key: str) -> str:
    """The median of the rounds' `key` and their range, where there is more than one round."""
    values = sorted(r[key] for r in rounds)
    if len(values) < 2:
        return ""
    return f" (rounds {statistics.median(values):.2f}×, {values[0]:.2f}–{values[-1]:.2f})"


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy-head", default=None, help="exported proxy head (default: the logit lens at ℓe)")
    ap.add_argument("--draft", default=None, help="exported draft for part 2 (default: part 1 only)")
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per task")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--acceptance", default="0.3,0.5,0.7,0.8,0.9")
    ap.add_argument("--draft-cost", type=float, default=0.15, help="synthetic forward cost / target token time")
    ap.add_argument("--node-cost", type=float, default=0.03, help="synthetic cost per extra tree node / forward")
    ap.add_argument("--streams", type=int, default=0, help="synthetic draft: tokens per forward − 1")
    ap.add_argument(
        "--perfect-head",
        action="store_true",
        help="part 1: also run Mirror-SD with a perfect proxy head (the synthetic draft puts the target's next token "
        "first among the head's candidates at every window position), interleaved with the others: the ceiling a "
        "better head could reach, and what the trained head's misses cost",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of the synthetic table over the same prompts (every method each round): each round's decoding "
        "ratios too, their median and range (the machine's noise between rounds)",
    )
    d = EngineConfig()  # the engine's defaults are this script's
    ap.add_argument("--gamma", type=int, default=d.gamma)
    ap.add_argument("--kappa", type=int, default=d.kappa)
    ap.add_argument("--budget", type=int, default=d.branch_budget)
    ap.add_argument("--candidate-vocab", type=int, default=d.candidate_vocab)
    ap.add_argument("--head-placement", default=d.head_placement, choices=["target", "draft"])
    ap.add_argument("--head-weights", default=d.head_weights, choices=["auto", "int8", "served"], help="head's read")
    ap.add_argument("--ngram-tokens", type=int, default=d.ngram_tokens, help="prompt lookup (part 2; 0: off)")
    ap.add_argument("--adaptive-window", action=argparse.BooleanOptionalAction, default=d.adaptive_window)
    ap.add_argument(
        "--lookup-roots", action=argparse.BooleanOptionalAction, default=d.lookup_roots, help="c* guesses from lookup"
    )
    ap.add_argument("--fast-path", default=d.fast_path, choices=["auto", "exact", "onednn", "none"])
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument(
        "--target-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the target's precision, every method alike (lossless is against this target's own output)",
    )
    ap.add_argument("--exit-layer", type=int, default=None)
    ap.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="0: greedy; else every method samples at this temperature with the same seed (ar's samples are the "
        "reference each method must equal, and the synthetic draft replays them)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be ≥ 1, got {args.repeats}")

    import torch

    target = Target.load("testbed", dtype=getattr(torch, args.target_dtype))
    prompts = pick_prompts(default_specbench_file(), args.per_category)
    base = EngineConfig(
        exit_layer=args.exit_layer,
        kappa=args.kappa,
        gamma=args.gamma,
        branch_budget=args.budget,
        candidate_vocab=args.candidate_vocab,
        head_placement=args.head_placement,
        head_weights=args.head_weights,
        draft_dtype=args.draft_dtype,
        ngram_tokens=args.ngram_tokens,
        adaptive_window=args.adaptive_window,
        lookup_roots=args.lookup_roots,
        fast_path=args.fast_path,
        temperature=args.temperature,
    )
    result = {"args": vars(args), "config": asdict(base), "prompts": [p.id for _, p in prompts], "cpu": cpu_model()}

    # --- the reference: target-only answers, and the target's time per token ------------------------------------
    with MirrorEngine(target, args.proxy_head, None, base) as engine:
        engine.generate(prompts[0][1].messages(), 8, method="ar")  # warm-up
        ar = [engine.generate(p.messages(), args.max_new_tokens, method="ar") for _, p in prompts]
    references = [g.tokens for g in ar]
    token_ms = statistics.median(s.step_ms for g in ar for s in g.steps[1:])  # a decoding step (not the prefill)
    forward_ms = args.draft_cost * token_ms
    print(
        f"{len(prompts)} prompts; target-only {1000 / token_ms:.1f} tokens/s ({token_ms:.1f} ms a token); "
        f"synthetic draft forward {forward_ms:.1f} ms + {args.node_cost * forward_ms:.2f} ms a node",
        flush=True,
    )

    # --- part 1: the synthetic draft across acceptance rates -----------------------------------------------------
    table = []
    for acceptance in [float(a) for a in args.acceptance.split(",") if a.strip()]:  # "": part 2 alone
        synthetic = SyntheticDraftConfig(
            acceptance=acceptance, forward_ms=forward_ms, node_ms=args.node_cost * forward_ms, num_streams=args.streams
        )
        start = time.perf_counter()
        alone = replace(base, ngram_tokens=0)  # the synthetic draft alone: no copied windows
        perfect = replace(synthetic, perfect_head=True)
        with (
            MirrorEngine(target, args.proxy_head, synthetic, alone) as engine,
            MirrorEngine(target, args.proxy_head, perfect, alone) if args.perfect_head else nullcontext() as ceiling,
        ):
            more = [(ceiling, "mirror", PERFECT)] if ceiling is not None else []
            for runner in [engine] + [c for c, _, _ in more]:  # warm-up
                runner.generate(prompts[0][1].messages(), 8, method="mirror", reference=references[0])
            rounds = [
                run_methods(engine, prompts, references, ["ar", "sd", "mirror"], args.max_new_tokens, more)
                for _ in range(args.repeats)
            ]
        rows = [r for one in rounds for r in one]
        agg = {m: aggregate(rows, m) for m in ("ar", "sd", "mirror") + ((PERFECT,) if more else ())}
        table.append(
            {"acceptance": acceptance, "methods": agg, "rows": rows, "rounds": [round_ratios(r) for r in rounds]}
        )
        print(
            f"acceptance {acceptance}: "
            + ", ".join(f"{m} {a['tokens_per_s']:.1f} tok/s" for m, a in agg.items())
            + f" ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    result["synthetic"] = table

    if table:
        print(
            f"\n### Synthetic draft (forward {forward_ms:.1f} ms = {args.draft_cost:g} × a target token, "
            f"{args.streams + 1} token(s) a forward), γ={args.gamma}, κ={args.kappa}, budget {args.budget}\n"
        )
        print(
            "Tokens/s over the whole generation, prefill included (Spec-Bench's convention), and in decoding alone "
            "(the same run's steps without the prompt's prefill, which every method spends alike).\n"
        )
        print(
            "| acceptance | ar tok/s | sd tok/s | mirror tok/s | mirror/ar | mirror/sd | sd/ar | decoding: mirror/ar | "
            "decoding: mirror/sd | accepted | reuse | hit | mirror predicted/measured | lossless |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for row in table:
            a, s, m = (row["methods"][k] for k in ("ar", "sd", "mirror"))
            print(
                f"| {row['acceptance']:.1f} | {a['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | "
                f"{m['tokens_per_s']:.1f} | {m['tokens_per_s'] / a['tokens_per_s']:.2f}× | "
                f"{m['tokens_per_s'] / s['tokens_per_s']:.2f}× | {s['tokens_per_s'] / a['tokens_per_s']:.2f}× | "
                f"{m['decode_tokens_per_s'] / a['decode_tokens_per_s']:.2f}×{spread(row['rounds'], 'mirror/ar')} | "
                f"{m['decode_tokens_per_s'] / s['decode_tokens_per_s']:.2f}×{spread(row['rounds'], 'mirror/sd')} | "
                f"{fmt(m['mean_accepted'])} | {fmt(m['reuse_rate'])} | {fmt(m['hit'])} | "
                f"{fmt(m['overlap_efficiency'])} | {a['lossless'] and s['lossless'] and m['lossless']} |"
            )
        if args.perfect_head:
            print("\nWith a perfect proxy head (c* always its first candidate; decoding ratios, each round's too):\n")
            print("| acceptance | mirror/sd | perfect head: mirror/sd | hit | perfect head: hit | lossless |")
            print("|---|---|---|---|---|---|")
            for row in table:
                m, p, s = (row["methods"][k] for k in ("mirror", PERFECT, "sd"))
                print(
                    f"| {row['acceptance']:.1f} | "
                    f"{m['decode_tokens_per_s'] / s['decode_tokens_per_s']:.2f}×{spread(row['rounds'], 'mirror/sd')} | "
                    f"{p['decode_tokens_per_s'] / s['decode_tokens_per_s']:.2f}×"
                    f"{spread(row['rounds'], f'{PERFECT}/sd')} | {fmt(m['hit'])} | {fmt(p['hit'])} | {p['lossless']} |"
                )
        print_steps(table)
        print_waits(table)

    # --- part 2: the trained draft -------------------------------------------------------------------------------
    if args.draft:
        with MirrorEngine(target, args.proxy_head, args.draft, base) as engine:
            engine.generate(prompts[0][1].messages(), 8, method="mirror")  # warm-up
            methods = ["ar", "sd", "mirror"] + (["pld"] if args.ngram_tokens else [])
            rows = run_methods(engine, prompts, references, methods, args.max_new_tokens)
        lens = replace(base, candidate_vocab=args.candidate_vocab)
        with MirrorEngine(target, None, args.draft, lens) as engine:
            lens_rows = run_methods(engine, prompts, references, ["mirror"], args.max_new_tokens)
        agg = {m: aggregate(rows, m) for m in methods} | {"mirror_lens": aggregate(lens_rows, "mirror")}
        result["trained"] = {"methods": agg, "rows": rows + lens_rows}
        print(f"\n### Trained draft ({args.draft}) and proxy head ({args.proxy_head or 'logit lens'})\n")
        print(
            "| method | tok/s | vs ar | decoding tok/s | vs ar | accepted | reuse | online hit_κ | wait ms | lossless |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        ar_agg = agg["ar"]
        for name, a in agg.items():
            print(
                f"| {name} | {a['tokens_per_s']:.1f} | {a['tokens_per_s'] / ar_agg['tokens_per_s']:.2f}× | "
                f"{a['decode_tokens_per_s']:.1f} | {a['decode_tokens_per_s'] / ar_agg['decode_tokens_per_s']:.2f}× | "
                f"{fmt(a['mean_accepted'])} | {fmt(a['reuse_rate'])} | {fmt(a['hit'])} | {fmt(a['wait_ms'], 1)} | "
                f"{a['lossless']} |"
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
