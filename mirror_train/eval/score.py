"""`mirror-eval specbench score DIR`: Spec-Bench's metrics, recomputed from the answer files (shared/docs/specbench.md).

Per task and overall, per method: tokens/s (the mean over questions of Σ_turns new tokens / Σ_turns wall time),
speed-up (that mean over the ar baseline's), mean accepted tokens (over all decoding steps, bonus token included),
branch reuse rate and online hit_κ / Ω_κ (Mirror-SD), and losslessness (greedy answers identical to ar's, question
by question). Writes report.md, report.json and two PNG charts into DIR.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from mirror_train import fastpath
from mirror_train.errors import MirrorTrainError
from mirror_train.eval.questions import TASKS

BASELINE = "ar"

# what a report says of how the target was served on each machine (fastpath.describe, the prefill's threads)
SERVED_KEYS = ("fast_path", *fastpath.DESCRIBED, "prefill_threads")


def read_answers(path: Path) -> list[dict]:
    records = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise MirrorTrainError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return records


def _mean(xs):
    xs = list(xs)
    return statistics.mean(xs) if xs else None


def score(out: str | Path) -> dict:
    out = Path(out)
    files = sorted((out / "answers").glob("*.jsonl"))
    if not files:
        raise MirrorTrainError(f"no answer files under {out / 'answers'}")
    answers = {f.stem: {str(r["question_id"]): r for r in read_answers(f)} for f in files}
    if BASELINE not in answers:
        raise MirrorTrainError(f"{out} has no {BASELINE} answers: speed-ups are measured against them")
    base = answers[BASELINE]
    result: dict = {"methods": {}, "tasks": sorted({TASKS.get(r["category"], r["category"]) for r in base.values()})}
    for method, recs in answers.items():
        common = [q for q in recs if q in base]
        by_task: dict[str, dict] = {}
        for group in ["overall", *result["tasks"]]:
            qs = [q for q in common if group == "overall" or TASKS.get(recs[q]["category"]) == group]
            if not qs:
                continue
            rate = {q: _rate(recs[q]) for q in qs}
            base_rate = {q: _rate(base[q]) for q in qs}
            steps = [n for q in qs for n in recs[q]["choices"][0]["accept_lengths"]]
            stats = [t for q in qs for t in recs[q].get("mirror_stats", [])]
            reused = [x for t in stats for x in t.get("reused", [])]
            hits = [x for t in stats for x in t.get("hits", [])]
            omegas = [x for t in stats for x in t.get("omegas", [])]
            same = [recs[q]["choices"][0]["turns"] == base[q]["choices"][0]["turns"] for q in qs]
            by_task[group] = {
                "questions": len(qs),
                "tokens_per_s": _mean(rate.values()),
                "speedup": _mean(rate.values()) / _mean(base_rate.values()),
                "mean_accepted": _mean(steps),
                "reuse_rate": _mean(reused),
                "hit": _mean(hits),
                "omega": _mean(omegas),
                "lossless": sum(same) / len(same),
                "accept_histogram": _histogram(steps),
            }
        result["methods"][method] = by_task
    return result


def _rate(record: dict) -> float:
    c = record["choices"][0]
    return sum(c["new_tokens"]) / max(sum(c["wall_time"]), 1e-9)


def _histogram(lengths: list[int]) -> dict[int, int]:
    hist: dict[int, int] = {}
    for n in lengths:
        hist[n] = hist.get(n, 0) + 1
    return dict(sorted(hist.items()))


def _fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def markdown(result: dict, run: dict | None = None) -> str:
    lines = ["# Spec-Bench report", ""]
    if run:
        s = run.get("settings", {})
        lines += [
            f"Target `{run.get('target', {}).get('name_or_path', '?')}`, max_new_tokens {s.get('max_new_tokens')}, "
            f"temperature {s.get('engine.temperature', s.get('temperature'))}, "
            f"target {s.get('target_dtype', 'float32')}, "
            f"κ={s.get('engine.kappa', s.get('kappa'))}, γ={s.get('engine.gamma', s.get('gamma'))}, budget "
            f"{s.get('engine.branch_budget', s.get('branch_budget'))}, prompt lookup up to "
            f"{s.get('engine.ngram_tokens', 0)} tokens, adaptive windows {s.get('engine.adaptive_window', False)}, "
            f"proxy head `{s.get('proxy_head') or 'logit lens'}`, draft `{s.get('draft')}`, datastore "
            f"`{s.get('datastore') or 'none'}`.",
            "",
        ]
        for m in run.get("machines", []):  # each (re)start of the run: where its answers were timed
            served = ", ".join(f"{k} {m[k]}" for k in SERVED_KEYS if m.get(k))
            lines += [
                f"Served from {m.get('started', '?')} on {m.get('cpu', '?')} ({m.get('target_device')}): {served}.",
                "",
            ]
    methods = list(result["methods"])
    groups = ["overall", *result["tasks"]]
    title = "## Speed-up over ar (mean per-question tokens/s ÷ ar's, Spec-Bench's definition)"
    lines += [title, "", "| method | " + " | ".join(groups) + " |"]
    lines.append("|---" * (len(groups) + 1) + "|")
    for m in methods:
        row = [(_fmt(result["methods"][m].get(g, {}).get("speedup"), ".2f") + "×") for g in groups]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    settings = (run or {}).get("settings", {})
    sampled = bool(settings.get("engine.temperature", settings.get("temperature")))  # ar's samples, same seed
    lines += [
        "",
        "## Overall",
        "",
        "| method | tokens/s | speed-up | mean accepted | reuse | online hit_κ | online Ω_κ | "
        f"{'sampled (same seed)' if sampled else 'greedy'} answers identical to ar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        o = result["methods"][m]["overall"]
        lines.append(
            f"| {m} | {_fmt(o['tokens_per_s'], '.1f')} | {_fmt(o['speedup'])}× | {_fmt(o['mean_accepted'])} | "
            f"{_fmt(o['reuse_rate'])} | {_fmt(o['hit'])} | {_fmt(o['omega'])} | {o['lossless']:.0%} |"
        )
    lines += ["", "## Mean accepted tokens per task", "", "| method | " + " | ".join(groups) + " |"]
    lines.append("|---" * (len(groups) + 1) + "|")
    for m in methods:
        row = [_fmt(result["methods"][m].get(g, {}).get("mean_accepted")) for g in groups]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    lines += ["", "![speed-up per task](speedup.png)", "", "![accepted lengths](accepted.png)", ""]
    return "\n".join(lines)


def charts(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(result["methods"])
    groups = ["overall", *result["tasks"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups)), 3.6))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [result["methods"][m].get(g, {}).get("speedup") or 0 for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], ys, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], groups, rotation=20)
    ax.set_ylabel("speed-up over ar")
    speed = _save(fig, ax, out / "speedup.png")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m in methods:
        hist = {int(k): v for k, v in result["methods"][m]["overall"]["accept_histogram"].items()}
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        ax.plot(xs, [hist[x] / total for x in xs], marker="o", label=m)
    ax.set_xlabel("tokens committed per target forward")
    ax.set_ylabel("fraction of steps")
    return [speed, _save(fig, ax, out / "accepted.png")]


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(out: str | Path) -> Path:
    out = Path(out)
    result = score(out)
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else None
    (out / "report.json").write_text(json.dumps(result, indent=1))
    charts(result, out)
    path = out / "report.md"
    path.write_text(markdown(result, run))
    return path
