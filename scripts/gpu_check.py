"""Everything device-specific, checked and measured in one call, with no network: the GPU session's script.

    python scripts/gpu_check.py                    # auto: CUDA when present (≤ 8 min on one GPU), else the CPU
    python scripts/gpu_check.py --device cpu       # the same checks on the CPU (≤ 5 min; part of the test suite)

Random weights only (the testbed's cannot travel to a GPU machine); the Spec-Bench questions come from ../shared.
Checks, each timed, each a row of the table:
  devices      a device that is not there is a one-line error; `auto` resolves; the row-invariance probe
  recipes      both recipes (`accelerate launch`) for a few steps on a tiny random target on the device, export,
               reload on the device (every parameter and buffer there)
  placements   the engine with the exported pair, every placement this machine allows (worker process, gloo,
               in-process; the draft on the target's device and on the CPU), every method: greedy output equal to
               transformers' `generate` of the same served target, token for token
  specbench    a one-question-per-task Spec-Bench run of the exported pair, every method lossless
  step         the target's step on a random target of realistic size (a Llama-3-8B shape in bf16 on CUDA, a small
               one on the CPU), the growing cache against the fixed-shape one (static_step.py: CUDA graphs on a
               GPU): ms a token, windows of 1-16 rows, graph captures and their time, ar's tokens under each
  synthetic    the synthetic-draft table on that target (under the CUDA graphs on a GPU): ar vs serial SD vs
               Mirror-SD at acceptance 0.6-0.9, every output against ar's, overlap efficiency
Prints one Markdown table per part and writes `--out/gpu_check.json` (it names the device). Exit status 1 if any
check failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers
import yaml

from mirror_train.devices import DEVICE_HELP, resolve_device
from mirror_train.engine import EngineConfig, MirrorEngine, SyntheticDraftConfig
from mirror_train.errors import MirrorTrainError
from mirror_train.eval.peers import greedy_generate
from mirror_train.eval.score import score
from mirror_train.eval.specbench import SpecBenchConfig, run_specbench
from mirror_train.generation import encode_chat
from mirror_train.models.draft_artifact import load_draft
from mirror_train.models.proxy_head import load_proxy_head
from mirror_train.random_models import LLAMA3_8B, llama_shaped, save_tiny_target
from mirror_train.target import Target

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["how to write the a", "explain what this is", "write the of and to", "what is the you that"]


def check(results: list, name: str, fn) -> object:
    """Run one check, record (name, ok, seconds, detail) and return its value (None if it failed)."""
    start = time.perf_counter()
    try:
        value, detail = fn()
        ok = True
    except Exception as err:  # a check that fails is a row of the table, not the end of the run
        value, ok, detail = None, False, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        traceback.print_exc()
    results.append({"check": name, "ok": ok, "seconds": round(time.perf_counter() - start, 1), "detail": detail})
    print(f"{'PASS' if ok else 'FAIL'} {name} ({results[-1]['seconds']} s): {detail}", flush=True)
    return value


# --- devices ----------------------------------------------------------------------------------------------------
def devices_check(device: torch.device):
    try:
        resolve_device(f"cuda:{max(torch.cuda.device_count(), 1) + 7}")
        raise AssertionError("a missing CUDA device was accepted")
    except MirrorTrainError as err:
        missing = str(err)
    assert "\n" not in missing
    try:
        EngineConfig(target_device="cuda:99").validate()
        raise AssertionError("EngineConfig accepted a missing device")
    except MirrorTrainError:
        pass
    from mirror_train import attention

    probe = llama_shaped(
        {
            "vocab_size": 256,
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 512,
        },
        device,
        torch.float32,
    )
    invariant = attention.gemm_row_invariant(probe)
    return {"auto": str(resolve_device("auto")), "row_invariant_float32": invariant}, (
        f"auto → {resolve_device('auto')}; float32 GEMMs row-invariant here: {invariant}; missing device: '{missing}'"
    )


# --- recipes ----------------------------------------------------------------------------------------------------
def _prompts_file(path: Path, n: int, prefix: str) -> str:
    path.write_text(
        "".join(json.dumps({"id": f"{prefix}{i}", "turns": [f"how to write the w{i}"]}) + "\n" for i in range(n))
    )
    return str(path)


def _data_block(work: Path) -> dict:
    return {
        "dir": str(work / "data"),
        "selfdistill": {
            "prompts": _prompts_file(work / "train.jsonl", 16, "t"),
            "num_prompts": 8,
            "max_new_tokens": 12,
        },
        "forced_prompts": 4,
        "heldout": {"prompts": _prompts_file(work / "held.jsonl", 4, "h"), "max_new_tokens": 12},
        "top_k": 8,
        "extra_layers": [4],
    }


def recipes_check(device: torch.device, work: Path, target_dir: Path):
    launch = [
        "accelerate",
        "launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        *(["--cpu"] if device.type == "cpu" else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = {"target": str(target_dir), "data": _data_block(work), "log": {"report_to": []}}
    runs = {
        "proxy_head": {
            **common,
            "output_dir": str(work / "proxy"),
            "head": {"kind": "mlp", "exit_layer": 2, "mlp_hidden": 32},
            "train": {"batch_size": 16, "max_steps": 4, "eval_every": 2},
        },
        "drafter": {
            **common,
            "output_dir": str(work / "draft"),
            "train": {"batch_size": 16, "max_steps": 4, "eval_every": 2},
            "model": {
                "num_layers": 2,
                "num_streams": 2,
                "num_stream_layers": 1,
                "feature_conditioning": "target_hidden",
                "feature_slots": ["exit", "final"],
                "exit_layer": 2,
            },
        },
    }
    for recipe, cfg in runs.items():
        path = work / f"{recipe}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        done = subprocess.run(
            [*launch, str(ROOT / "recipes" / f"{recipe}.py"), "--config", str(path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=400,
        )
        if done.returncode != 0:  # the last line is accelerate's CalledProcessError: the cause is above it
            print(f"--- {recipe} recipe's stderr, its end ---\n" + "\n".join(done.stderr.splitlines()[-25:]))
            raise RuntimeError(f"{recipe} recipe failed: {done.stderr.strip().splitlines()[-1]}")
    target = Target.load(str(target_dir), device=device)
    head = load_proxy_head(work / "proxy" / "export", target)
    draft = load_draft(work / "draft" / "export", target)
    # the head's own weights, and the target's final norm and LM head it borrows (they move with the target)
    borrowed = [*head._norm.parameters(), *head._head.parameters()]
    tensors = [*head.parameters(), *head.buffers(), *borrowed, *draft.parameters(), *draft.buffers()]
    where = {str(t.device) for t in tensors}
    assert where == {str(target.device)}, f"artifacts landed on {where}, not {target.device}"
    return (work / "proxy" / "export", work / "draft" / "export"), f"trained, exported, reloaded on {where.pop()}"


# --- the engine in every placement ------------------------------------------------------------------------------
def placements(device: torch.device) -> list[tuple[str, str, str]]:
    """(placement, draft device, target step) triples this machine allows: every placement on the growing cache,
    and the fixed-shape step (CUDA graphs on a GPU) in-process and with a worker."""
    if device.type == "cpu":
        return [("local", "cpu", "dynamic"), ("process", "cpu", "dynamic"), ("gloo", "cpu", "dynamic")] + [
            ("local", "cpu", "static")
        ]
    out = [("local", str(device), "dynamic"), ("process", str(device), "dynamic"), ("process", "cpu", "dynamic")]
    if torch.cuda.device_count() > 1:
        out.append(("process", "auto", "dynamic"))  # the next GPU
    return out + [("local", str(device), "graphs"), ("process", str(device), "graphs")]


def placements_check(device: torch.device, target_dir: Path, artifacts, max_new: int = 24):
    head_dir, draft_dir = artifacts
    target = Target.load(str(target_dir), device=device)
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    refs = [greedy_generate(target.model, p, max_new, stops=[]) for p in prompts]  # transformers' own
    rows = []
    for placement, draft_device, step in placements(device):
        cfg = EngineConfig(
            placement=placement,
            draft_device=draft_device,
            target_step=step,
            target_core=None,
            draft_core=None,
            kappa=4,
            gamma=3,
            branch_budget=6,
            gloo_port=29600 + len(rows),
        )
        with MirrorEngine(target, str(head_dir), str(draft_dir), cfg) as engine:
            ar = None
            for method in ("ar", "sd", "mirror", "pld"):
                tokens = [engine.generate(p, max_new, method=method, stop=[]).tokens for p in prompts]
                ar = ar or tokens
                rows.append(
                    {
                        "placement": placement,
                        "draft_device": draft_device,
                        "target_step": step,
                        "method": method,
                        "equal": sum(t == r for t, r in zip(tokens, refs)),  # to transformers' generate
                        "equal_ar": sum(t == a for t, a in zip(tokens, ar)),  # to the same served step's ar
                        "of": len(prompts),
                    }
                )
    # lossless: every method equals its own step's ar, and the growing cache's equals transformers' generate (a
    # fixed-shape step attends over a masked buffer, so its float rounding may differ from generate's: reported)
    bad = [r for r in rows if r["equal_ar"] != r["of"] or (r["target_step"] == "dynamic" and r["equal"] != r["of"])]
    assert not bad, f"greedy output differs: {bad}"
    fixed = [r for r in rows if r["target_step"] != "dynamic"]
    return rows, (
        f"{len(rows)} placement × step × method runs, every output equal to its step's ar and the growing cache's "
        f"to transformers' generate; the fixed-shape step's equal to generate in "
        f"{sum(r['equal'] for r in fixed)} of {sum(r['of'] for r in fixed)}"
    )


# --- Spec-Bench -------------------------------------------------------------------------------------------------
def specbench_check(device: torch.device, target_dir: Path, artifacts, work: Path):
    head_dir, draft_dir = artifacts
    engine = EngineConfig(target_device=str(device), target_core=None, draft_core=None)
    cfg = SpecBenchConfig(
        out=str(work / "specbench"),
        target=str(target_dir),
        proxy_head=str(head_dir),
        draft=str(draft_dir),
        methods="ar,sd,mirror,pld,hf_pld",
        limit_per_category=1,
        max_new_tokens=16,
        warmups=1,
        engine=engine,
    )
    report = score(run_specbench(cfg))
    lossless = {m: v["overall"]["lossless"] for m, v in report["methods"].items()}
    assert all(v == 1.0 for v in lossless.values()), f"not lossless: {lossless}"
    speed = {m: v["overall"].get("speedup") for m, v in report["methods"].items()}
    return {"lossless": lossless, "speedup": speed}, f"6 tasks × 1 question, every method lossless: {lossless}"


# --- the target's step and the synthetic-draft table on a realistic-size target -----------------------------------
@functools.cache
def realistic_target(device: torch.device) -> tuple[Target, str]:
    """A random Llama-3-8B shape in bf16 on CUDA (a small float32 one on a CPU: that it runs, not a measurement),
    made once for the step check and the synthetic table."""
    if device.type == "cuda":
        shape, dtype, label = LLAMA3_8B, torch.bfloat16, "Llama-3-8B shape, bf16"
    else:
        shape = {
            "vocab_size": 4096,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
        }
        dtype, label = torch.float32, "8 layers × 512, float32"
    return Target(llama_shaped(shape, device, dtype), None, name_or_path=f"random {label}"), label


def step_kinds(device: torch.device) -> list[str]:
    """The target steps compared: the growing cache, and the fixed-shape one (replayed from CUDA graphs on a GPU)."""
    return ["dynamic", "graphs" if device.type == "cuda" else "static"]


def step_check(device: torch.device, context: int = 512, widths=(1, 2, 4, 8, 16)):
    """The target's step by window width, each step kind side by side (median ms: a window after `context` tokens,
    rolled back each time), and greedy ar under each: the same tokens? (graphs' attention reads a masked buffer, so
    bf16 may round apart from the growing cache's; within one kind every method must equal its ar)."""
    from mirror_train.timing import median_ms

    target, label = realistic_target(device)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(10, target.vocab_size, (1, context + max(widths)), generator=generator).to(device)
    prompts = [torch.randint(10, target.vocab_size, (96,), generator=generator).tolist() for _ in range(2)]
    rows, outputs = {}, {}
    for kind in step_kinds(device):
        cfg = EngineConfig(target_core=None, draft_core=None, ngram_tokens=0, target_step=kind)
        with MirrorEngine(target, None, None, cfg) as engine:
            start = time.perf_counter()
            gens = [engine.generate(p, 32, method="ar", stop=[]) for p in prompts]
            first = time.perf_counter() - start  # graphs captured on the way
            gens = [engine.generate(p, 32, method="ar", stop=[]) for p in prompts]
            outputs[kind] = [g.tokens for g in gens]
            token_ms = statistics.median(s.step_ms for g in gens for s in g.steps[1:])
            cache = target.new_cache()
            target.prefill(ids[:, :context], cache, 1)
            by_width = {}
            for w in widths:

                def window(w=w, cache=cache):
                    target.forward(ids[:, context : context + w], cache)
                    Target.crop(cache, context)

                by_width[w] = median_ms(window, repeats=20 if device.type == "cuda" else 3, warmup=2)
            static = target.static
            rows[kind] = {
                "token_ms": token_ms,
                "window_ms": by_width,
                "first_generations_s": first,
                "graphs_captured": static.captured if static is not None else 0,
                "capture_s": static.capture_s if static is not None else 0.0,
            }
    kinds = list(rows)
    same = sum(a == b for a, b in zip(outputs[kinds[0]], outputs[kinds[1]]))
    token = " / ".join("{} {:.1f}".format(k, rows[k]["token_ms"]) for k in kinds)
    eight = " / ".join("{} {:.2f}".format(k, rows[k]["window_ms"][8] / rows[k]["window_ms"][1]) for k in kinds)
    detail = f"{label}: ar {token} ms a token; 8-row window / one-token {eight}; ar equal: {same} of {len(prompts)}"
    return {"model": label, "context": context, "kinds": rows, "ar_equal_across_kinds": same}, detail


def synthetic_check(device: torch.device, acceptances=(0.6, 0.7, 0.8, 0.9), target_step: str = "dynamic"):
    prompts, max_new = (4, 64) if device.type == "cuda" else (2, 24)  # on a CPU: that it runs, not a measurement
    target, label = realistic_target(device)
    label = f"{label}, target_step={target_step}"
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, target.vocab_size, (96,), generator=generator).tolist() for _ in range(prompts)]
    base = EngineConfig(
        target_core=None, draft_core=None, ngram_tokens=0, kappa=8, gamma=4, branch_budget=16, target_step=target_step
    )
    with MirrorEngine(target, None, None, base) as engine:
        engine.generate(ids[0], 8, method="ar", stop=[])
        ar = [engine.generate(p, max_new, method="ar", stop=[]) for p in ids]
    refs = [g.tokens for g in ar]
    token_ms = statistics.median(s.step_ms for g in ar for s in g.steps[1:])
    table = []
    for acceptance in acceptances:
        draft = SyntheticDraftConfig(acceptance=acceptance, forward_ms=0.15 * token_ms, node_ms=0.005 * token_ms)
        row = {"acceptance": acceptance}
        with MirrorEngine(target, None, draft, base) as engine:
            engine.generate(ids[0], 8, method="mirror", stop=[], reference=refs[0])
            for method in ("ar", "sd", "mirror"):
                gens = [engine.generate(p, max_new, method=method, stop=[], reference=r) for p, r in zip(ids, refs)]
                steps = [s for g in gens for s in g.steps if s.window]
                row[method] = sum(len(g.tokens) for g in gens) / sum(g.seconds for g in gens)
                row[f"{method}_equal"] = sum(g.tokens == r for g, r in zip(gens, refs))
                if method == "mirror" and steps:
                    row["overlap_efficiency"] = sum(s.predicted_ms for s in steps) / sum(s.step_ms for s in steps)
                    row["accepted"] = sum(s.committed for s in steps) / len(steps)
        row["mirror/ar"], row["mirror/sd"] = row["mirror"] / row["ar"], row["mirror"] / row["sd"]
        table.append(row)
    flips = sum(prompts - row[f"{m}_equal"] for row in table for m in ("sd", "mirror"))
    detail = f"{label}: {token_ms:.1f} ms a token; outputs differing from ar: {flips} of {2 * prompts * len(table)}"
    return {"model": label, "token_ms": token_ms, "rows": table, "flips": flips}, detail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help=DEVICE_HELP)
    ap.add_argument("--out", default="outputs/gpu_check", help="directory for gpu_check.json")
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: recipes, placements, specbench, step, "
        "synthetic (placements and specbench need the recipes' artifacts)",
    )
    args = ap.parse_args()
    device = resolve_device(args.device)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    env = {
        "device": str(device),
        "device_name": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    print(f"# gpu_check on {device} ({gpu}); torch {torch.__version__}, transformers {transformers.__version__}")
    results: list[dict] = []
    parts: dict = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        target_dir = save_tiny_target(work / "target", layers=4, hidden=64)
        parts["devices"] = check(results, "devices", lambda: devices_check(device))
        artifacts = None
        if "recipes" not in skip:
            artifacts = check(results, "recipes", lambda: recipes_check(device, work, target_dir))
        if artifacts is not None and "placements" not in skip:
            parts["placements"] = check(results, "placements", lambda: placements_check(device, target_dir, artifacts))
        if artifacts is not None and "specbench" not in skip:
            parts["specbench"] = check(
                results, "specbench", lambda: specbench_check(device, target_dir, artifacts, work)
            )
        if "step" not in skip:
            parts["step"] = check(results, "step", lambda: step_check(device))
        if "synthetic" not in skip:
            # on a GPU under the graphs (the growing cache's table is the twenty-first session's, and the step check
            # compares the two steps), so that the call fits the device's 10 minutes; on a CPU the growing cache's
            kind = step_kinds(device)[-1] if device.type == "cuda" else "dynamic"
            parts["synthetic"] = check(results, "synthetic", lambda: synthetic_check(device, target_step=kind))
    total = time.perf_counter() - started

    print("\n| check | ok | seconds | detail |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['check']} | {'yes' if r['ok'] else '**no**'} | {r['seconds']} | {r['detail']} |")
    if parts.get("step"):
        step = parts["step"]
        print(f"\nThe target's step, random {step['model']}, after {step['context']} tokens (median ms):\n")
        print("| step | ar ms a token | " + " | ".join(f"{w} rows" for w in step["kinds"]["dynamic"]["window_ms"]))
        print("|---|---|" + "---|" * len(step["kinds"]["dynamic"]["window_ms"]))
        for kind, row in step["kinds"].items():
            cells = " | ".join(f"{ms:.2f}" for ms in row["window_ms"].values())
            graphs = f"{row['graphs_captured']} graphs, {row['capture_s']:.1f} s"
            print(f"| {kind} ({graphs}) | {row['token_ms']:.2f} | {cells} |")
    for syn in [parts["synthetic"]] if parts.get("synthetic") else []:
        print(f"\nSynthetic draft on a random {syn['model']} target ({syn['token_ms']:.1f} ms a token), tokens/s:\n")
        print("| acceptance | ar | sd | mirror | mirror/ar | mirror/sd | accepted | overlap efficiency |")
        print("|---|---|---|---|---|---|---|---|")
        for row in syn["rows"]:
            print(
                f"| {row['acceptance']} | {row['ar']:.1f} | {row['sd']:.1f} | {row['mirror']:.1f} | "
                f"{row['mirror/ar']:.2f} | {row['mirror/sd']:.2f} | {row.get('accepted', 0):.2f} | "
                f"{row.get('overlap_efficiency', 0):.2f} |"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {**env, "seconds": round(total, 1), "checks": results, "parts": parts}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=2, default=str))
    print(f"\n{len(results)} checks in {total:.0f} s; wrote {out / 'gpu_check.json'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
