"""A trained draft measured on its own: held-out agreement in a real lossless loop, streaming against
token-by-token drafting, latency per tree size, parameters.

    python scripts/bench_drafter.py --draft outputs/drafter_smollm2/export --out docs/results/drafter_smollm2.json

- Serial speculative decoding (the engine's `sd`, draft in-process, greedy, every window the draft's whole γ: no
  prompt lookup, no cut windows) on `--prompts` Spec-Bench questions (none is ever trained on): mean accepted
  tokens per verification at γ = 1..5, with the lookahead streams and token by token, and the draft forwards each
  window took. Every output is checked against the target's own.
- Latency of one tree forward over 1, 8 and 32 new nodes after a 300-token context, one thread (one core), in
  float32 and bfloat16 (the engine's `draft_dtype`; AMX makes bf16 matmuls ~4x faster on this project's Xeon).
- `--log`: a training log (the recipe's stdout) to turn into the curve of held-out top-1 agreement against
  steps, minutes and training positions.
Prints Markdown tables; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import torch

from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.models.draft_artifact import load_draft
from mirror_train.prompts import default_specbench_file, load_prompts
from mirror_train.target import Target
from mirror_train.timing import median_ms, torch_threads


def _per_window(gens) -> float:
    """Tokens committed per verified window (A + 1), over every generation: the prefill's first token aside."""
    windows = [s for g in gens for s in g.steps if s.window]
    return sum(s.committed for s in windows) / len(windows)


def _alone(draft_dtype: str) -> dict:
    """The draft alone: every window the draft's whole γ (no copied windows, no cut ones)."""
    return {"draft_dtype": draft_dtype, "ngram_tokens": 0, "adaptive_window": False}


def lossless_loop(target, draft_path, prompts, gammas, max_new_tokens, references, draft_dtype="auto"):
    rows = []
    for streams in (True, False):
        for gamma in gammas:
            alone = _alone(draft_dtype)
            cfg = EngineConfig(gamma=gamma, branch_budget=1, placement="local", use_streams=streams, **alone)
            with MirrorEngine(target, None, draft_path, cfg) as engine:
                gens = [engine.generate(p.messages(), max_new_tokens, method="sd") for p in prompts]
            steps = [s for g in gens for s in g.steps]
            rows.append(
                {
                    "streams": streams,
                    "gamma": gamma,
                    "mean_accepted": _per_window(gens),
                    "forwards_per_window": statistics.mean(s.draft_forwards for s in steps if s.draft_forwards),
                    "lossless": all(g.tokens == ref for g, ref in zip(gens, references, strict=True)),
                }
            )
            print(rows[-1], flush=True)
    return rows


def checkpoint_curve(target, draft_path, root, prompts, references, gammas, max_new_tokens, batch_size, draft_dtype):
    """Mean accepted tokens in the same lossless loop (streams on) for each checkpoint's weights under `root`
    (step_N/model.safetensors + trainer_state.json, as the recipe saves them): the curve against training."""
    from safetensors.torch import load_file

    rows = []
    for ckpt in sorted(Path(root).glob("step_*"), key=lambda p: int(p.name.split("_")[1])):
        draft = load_draft(draft_path, target)
        draft.load_state_dict(load_file(ckpt / "model.safetensors"))
        state = json.loads((ckpt / "trainer_state.json").read_text())
        step = int(state.get("step", ckpt.name.split("_")[1]))
        row = {"step": step, "minutes": round(state.get("minutes", 0.0), 2), "positions": step * batch_size}
        for gamma in gammas:
            cfg = EngineConfig(gamma=gamma, branch_budget=1, placement="local", **_alone(draft_dtype))
            with MirrorEngine(target, None, draft, cfg) as engine:
                gens = [engine.generate(p.messages(), max_new_tokens, method="sd") for p in prompts]
            if any(g.tokens != ref for g, ref in zip(gens, references, strict=True)):
                raise SystemExit(f"{ckpt}: an output differs from the target's own")
            row[f"accepted_gamma_{gamma}"] = _per_window(gens)
        rows.append(row)
        print(row, flush=True)
    return rows


def latency(target, draft, nodes=(1, 8, 32), context=300):
    """Median ms of one tree forward over n new chained nodes after `context` cached tokens, on one thread."""
    from mirror_train.engine.rollout import keep_cache_path

    ids = torch.randint(0, target.vocab_size, (1, context))
    out = {}
    with torch_threads(1):
        cache = draft.new_cache()
        draft(ids, cache=cache, num_streams=0, logits_index=torch.tensor([context - 1]))
        for n in nodes:
            for streams in sorted({0, draft.config.num_streams}):
                tokens, parents = list(range(n)), list(range(-1, n - 1))

                def step(tokens=tokens, parents=parents, streams=streams):
                    draft.tree_forward(tokens, parents, cache, num_streams=streams)
                    keep_cache_path(cache, context, [])  # drop the nodes again

                out[f"{n}_nodes_{streams}_streams_ms"] = median_ms(step, repeats=20)
    return out


def parse_log(path: str, batch_size: int) -> list[dict]:
    """(step, minutes, positions, top1) from a recipe log: its "eval step" lines, or for logs older than those the
    progress bar's postfix (which misses an evaluation that repeats the previous value)."""
    text = Path(path).read_text(errors="replace").replace("\r", "\n")
    lines = re.findall(r"eval step (\d+) \(([0-9.]+) min\): .*?\btop1=([0-9.]+)", text)
    if lines:
        return [
            {"step": int(s), "minutes": round(float(m), 2), "positions": int(s) * batch_size, "top1": float(t)}
            for s, m, t in lines
        ]
    points, last = [], None
    for m in re.finditer(r"(\d+)/\d+ \[(\d+):(\d+)(?::(\d+))?<[^,]*,[^\]]*top1=([0-9.]+)", text):
        step, top1 = int(m.group(1)), float(m.group(5))
        parts = [int(x) for x in m.group(2, 3, 4) if x is not None]
        minutes = parts[0] * 60 + parts[1] + parts[2] / 60 if len(parts) == 3 else parts[0] + parts[1] / 60
        if top1 != last:  # the first bar update after an evaluation
            points.append({"step": step, "minutes": round(minutes, 2), "positions": step * batch_size, "top1": top1})
            last = top1
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gammas", default="1,2,3,4,5")
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="of the loop")
    ap.add_argument("--log", default=None)
    ap.add_argument("--checkpoints", default=None, help="a folder of step_N checkpoints: accepted tokens per step")
    ap.add_argument("--curve-gammas", default="1,3,5", help="γ of the checkpoint curve")
    ap.add_argument("--skip-loop", action="store_true", help="no lossless-loop table for the export itself")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--batch-size", type=int, default=512, help="positions per step of the logged run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = Target.load("testbed")
    draft = load_draft(args.draft, target)
    layers = sum(p.numel() for n, p in draft.named_parameters() if not n.startswith(("embed_tokens", "lm_head")))
    total = sum(p.numel() for p in draft.parameters())
    result = {"draft": args.draft, "parameters": total, "parameters_without_embeddings_and_head": layers}
    print(f"{total:,} parameters ({layers:,} without the embeddings and the head)")

    dtypes = ("float32", "bfloat16")
    if not args.skip_latency:
        result["latency_ms"] = {d: latency(target, draft.to(getattr(torch, d))) for d in dtypes}
        s = draft.config.num_streams
        print("| tree nodes | " + " | ".join(f"main only ms ({d}) | with streams ms ({d})" for d in dtypes) + " |")
        print("|---" * (1 + 2 * len(dtypes)) + "|")
        for n in (1, 8, 32):
            cells = [f"{result['latency_ms'][d][f'{n}_nodes_{k}_streams_ms']:.1f}" for d in dtypes for k in (0, s)]
            print(f"| {n} | " + " | ".join(cells) + " |")

    questions = load_prompts(default_specbench_file())
    prompts = questions[:: max(len(questions) // args.prompts, 1)][: args.prompts]
    with MirrorEngine(target, None, None, EngineConfig(placement="local")) as engine:
        references = [engine.generate(p.messages(), args.max_new_tokens, method="ar").tokens for p in prompts]
    gammas = [int(g) for g in args.gammas.split(",")]
    if not args.skip_loop:
        result["serial"] = lossless_loop(
            target, args.draft, prompts, gammas, args.max_new_tokens, references, args.draft_dtype
        )
        print("\n| γ | accepted (streams) | forwards / window | accepted (token by token) | forwards / window", end="")
        print(" | lossless |")
        print("|---|---|---|---|---|---|")
        for g in gammas:
            s = next(r for r in result["serial"] if r["streams"] and r["gamma"] == g)
            t = next(r for r in result["serial"] if not r["streams"] and r["gamma"] == g)
            print(
                f"| {g} | {s['mean_accepted']:.3f} | {s['forwards_per_window']:.2f} | {t['mean_accepted']:.3f} | "
                f"{t['forwards_per_window']:.2f} | {s['lossless'] and t['lossless']} |"
            )
    if args.checkpoints:
        gammas = [int(g) for g in args.curve_gammas.split(",")]
        result["checkpoints"] = checkpoint_curve(
            target,
            args.draft,
            args.checkpoints,
            prompts,
            references,
            gammas,
            args.max_new_tokens,
            args.batch_size,
            args.draft_dtype,
        )
        print("\n| step | minutes | training positions | " + " | ".join(f"accepted, γ={g}" for g in gammas) + " |")
        print("|---" * (3 + len(gammas)) + "|")
        for r in result["checkpoints"]:
            cells = " | ".join(f"{r[f'accepted_gamma_{g}']:.3f}" for g in gammas)
            print(f"| {r['step']} | {r['minutes']:.1f} | {r['positions']:,} | {cells} |")
    if args.log:
        result["curve"] = parse_log(args.log, args.batch_size)
        print("\n| step | minutes | training positions | held-out top-1 |\n|---|---|---|---|")
        for p in result["curve"]:
            print(f"| {p['step']} | {p['minutes']:.1f} | {p['positions']:,} | {p['top1']:.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
