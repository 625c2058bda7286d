"""Proxy heads side by side: every kind (and exit layer) trained with the same data and time budget, then scored
exactly against the target's full final distribution on held-out Spec-Bench answers, with each head's cost.

    python scripts/bench_proxy_heads.py --config recipes/configs/proxy_head_smollm2.yaml \
        --kinds residual,mlp,lora_head --exit-layers 15 --minutes 8 --out docs/results/proxy_heads.json
    python scripts/bench_proxy_heads.py --kinds mlp --exit-layers 12,15,18,21,24 --minutes 5 ...   # the ℓe sweep

Training goes through the recipe (one training loop in the project); data and feature caches are shared by every
run (pass the same --exit-layers set to reuse them). Heads already exported under --runs-dir are scored without
retraining. Prints Markdown tables; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mirror_train.config import load_config, parse_overrides
from mirror_train.data.selfdistill import load_selfdistill
from mirror_train.models.proxy_head import load_proxy_head
from mirror_train.proxy_training import ProxyRunConfig, evaluate_exact, head_cost_ms
from mirror_train.target import Target

ROOT = Path(__file__).resolve().parents[1]


def train(config: str, kind: str, layer: int, cached: list[int], minutes: float, out: Path, overrides: list[str]):
    extra = [x for x in cached if x != layer]
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "proxy_head.py"),
        "--config",
        config,
        f"head.kind={kind}",
        f"head.exit_layer={layer}",
        f"data.extra_layers={extra}",
        f"output_dir={out}",
        f"train.max_minutes={minutes}",
        "log.report_to=[none]",
        *overrides,
    ]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "proxy_head_smollm2.yaml"))
    ap.add_argument("--kinds", default="residual,mlp,lora_head")
    ap.add_argument("--exit-layers", default="15")
    ap.add_argument(
        "--cache-layers", default=None, help="exit layers the shared feature cache holds (default: --exit-layers)"
    )
    ap.add_argument("--minutes", type=float, default=8.0, help="training budget per head")
    ap.add_argument("--runs-dir", default="outputs/bench_proxy_heads")
    ap.add_argument("--retrain", action="store_true", help="train again even where --runs-dir has an export")
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args()
    overrides = parse_overrides(rest)
    cfg = load_config(ProxyRunConfig, args.config, overrides)
    kinds = [k for k in args.kinds.split(",") if k]
    layers = [int(x) for x in args.exit_layers.split(",")]
    cached = sorted({*layers, *([int(x) for x in args.cache_layers.split(",")] if args.cache_layers else [])})
    runs = Path(args.runs_dir)

    for layer in layers:
        for kind in kinds:
            out = runs / f"{kind}_L{layer}"
            if args.retrain or not (out / "export").exists():
                train(args.config, kind, layer, cached, args.minutes, out, overrides)

    target = Target.load(cfg.target)
    heldout = load_selfdistill(Path(cfg.data.dir) / "heldout")
    results = {"config": args.config, "minutes": args.minutes, "heldout_rows": len(heldout), "runs": []}
    for layer in layers:
        heads = {"lens": None}
        for kind in kinds:
            heads[kind] = load_proxy_head(runs / f"{kind}_L{layer}" / "export", target, exit_layer=layer)
        scores = evaluate_exact(target, heads, heldout, layer)
        for name, head in heads.items():
            trained = (
                json.loads((runs / f"{name}_L{layer}" / "export" / "mirror_config.json").read_text())
                if head is not None
                else None
            )
            results["runs"].append(
                {
                    "head": name,
                    "exit_layer": layer,
                    "scores": scores[name],
                    "parameters": 0 if head is None else head.num_parameters(),
                    "steps": None if trained is None else trained["config"].get("steps"),
                    "cost": head_cost_ms(head, target),
                }
            )
        results["runs"].append({"head": "oracle", "exit_layer": layer, "scores": scores["oracle"]})

    print(format_tables(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


def format_tables(results: dict) -> str:
    head = "| head | ℓe | params | steps | Ω_1 | hit_1 | Ω_4 | hit_4 | Ω_8 | hit_8 | KL | head ms / 8 pos | + LM head |"
    lines = [head, "|" + "---|" * 13]
    for r in results["runs"]:
        s = r["scores"]["all"]
        oracle = r["head"] == "oracle"
        cells = [r["head"], str(r["exit_layer"]), "–" if oracle else f"{r['parameters']:,}", str(r.get("steps") or "–")]
        for k in (1, 4, 8):
            cells += [
                f"{s[f'oracle_omega_{k}' if oracle else f'omega_{k}']:.3f}",
                "1.000" if oracle else f"{s[f'hit_{k}']:.3f}",
            ]
        cells.append("–" if oracle else f"{s['kl']:.2f}")
        cells += ["–", "–"] if oracle else [f"{r['cost']['adapter_ms']:.2f}", f"{r['cost']['total_ms']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    cats = sorted(c for c in results["runs"][0]["scores"] if c != "all")
    lines += [
        "",
        "hit_4 per Spec-Bench category:",
        "",
        "| head | ℓe | " + " | ".join(cats) + " |",
        "|" + "---|" * (len(cats) + 2),
    ]
    for r in results["runs"]:
        if r["head"] != "oracle":
            lines.append(
                f"| {r['head']} | {r['exit_layer']} | "
                + " | ".join(f"{r['scores'][c]['hit_4']:.2f}" for c in cats)
                + " |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
