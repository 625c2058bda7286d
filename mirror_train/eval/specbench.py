"""`mirror-eval specbench`: every method on the Spec-Bench questions, one answer file per method in Spec-Bench's
schema (shared/docs/specbench.md), resumable.

Protocol: batch 1; the model's own chat template (recorded in run.json); multi-turn questions continue with the
method's own turn-1 answer; three untimed warm-up generations per method; wall time per turn around generation only
(prefill included); methods interleaved question by question, so a machine's drift hits all of them alike; `runs`
timed repetitions per turn, the median kept. Methods: the engine's `ar` (the baseline), `sd`, `mirror`, `pld`
(prompt lookup, the engine's, on the same target code as `ar`), and the transformers peers `assisted` (with the
same draft) and `hf_pld` (transformers' prompt lookup). The engine runs with `EngineConfig`'s defaults unless
told otherwise: one place for every engine setting.

Resuming: run.json records the settings; a run with other settings into the same directory is refused, naming what
differs, and finished answers are never rewritten. Answers go to DIR/answers/<method>.jsonl one line per question.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from mirror_train.devices import pinned, resolve_device, resolve_dtype
from mirror_train.engine import MirrorEngine
from mirror_train.engine.config import EngineConfig
from mirror_train.engine.setup import datastore_path
from mirror_train.errors import MirrorTrainError
from mirror_train.eval.peers import hf_generate
from mirror_train.eval.questions import load_questions, resolve_questions
from mirror_train.generation import encode_chat
from mirror_train.models.draft_artifact import load_draft
from mirror_train.target import Target

ENGINE_METHODS = ("ar", "sd", "mirror", "pld", "pld_store")
PEER_METHODS = ("assisted", "hf_pld")
METHODS = ENGINE_METHODS + PEER_METHODS


@dataclass
class SpecBenchConfig:
    out: str = "outputs/specbench"  # the run's directory: answers/<method>.jsonl, run.json, the report
    target: str = "testbed"  # the served model: testbed, a local HF directory or a Hub id
    proxy_head: str | None = None  # an exported proxy head (None: the logit lens at ℓe)
    draft: str | None = None  # an exported draft (needed by sd, mirror, assisted)
    # comma-separated; ar (the baseline) must be one; pld_store runs where a datastore is at hand (the draft's)
    methods: str = "ar,sd,mirror,pld,pld_store,assisted,hf_pld"
    categories: str | None = None  # comma-separated categories or tasks (mt_bench, translation, ...); None: all
    limit_per_category: int | None = None  # questions per Spec-Bench task, spread over the task
    max_new_tokens: int = 128  # per turn (Spec-Bench's original: 1024)
    runs: int = 1  # timed repetitions of each turn (the median is recorded)
    warmups: int = 3  # untimed generations per method before timing
    questions: str | None = None  # the question file (default: $MIRROR_TRAIN_SPECBENCH_QUESTIONS or shared data)
    download: bool = False  # fetch the question file from Spec-Bench at the pinned commit (sha256 checked)
    checksum: bool = True  # refuse a question file that is not the pinned one
    cache_dir: str = "~/.cache/mirror-train"  # where --download keeps the question file
    # The target's precision, for every method alike (lossless means: equal to this target's own greedy output).
    # bfloat16 verifies a window at ~1.2× a one-token step on AMX CPUs and GPUs, float32 at ~1.75× (docs/engine.md).
    target_dtype: str = "float32"
    engine: EngineConfig = field(default_factory=EngineConfig)  # every engine setting, with the engine's defaults

    @property
    def method_list(self) -> list[str]:
        return [m.strip() for m in self.methods.split(",") if m.strip()]

    def validate(self) -> None:
        bad = [m for m in self.method_list if m not in METHODS]
        if bad or not self.method_list:
            raise MirrorTrainError(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
        if "ar" not in self.method_list:
            raise MirrorTrainError("the methods must include ar: every speed-up is measured against it in the same run")
        needs_draft = [m for m in self.method_list if m in ("sd", "mirror", "assisted")]
        if needs_draft and not self.draft:
            raise MirrorTrainError(f"methods {needs_draft} need --draft")
        if self.engine.temperature > 0 and any(m in PEER_METHODS for m in self.method_list):
            raise MirrorTrainError("the transformers peers (assisted, hf_pld) are compared under greedy decoding only")
        self.engine.validate()
        if self.max_new_tokens < 1 or self.runs < 1 or self.warmups < 0:
            raise MirrorTrainError("max_new_tokens and runs must be ≥ 1, warmups ≥ 0")
        if self.limit_per_category is not None and self.limit_per_category < 1:
            raise MirrorTrainError("limit_per_category must be ≥ 1")
        if self.target_dtype not in ("float32", "bfloat16"):
            raise MirrorTrainError(f"target_dtype must be float32 or bfloat16, got {self.target_dtype!r}")

    def settings(self) -> dict:
        """What must match for a resumed run to add to the same answers (not where or how much)."""
        keep = {k: v for k, v in asdict(self).items() if k != "engine"}
        for k in ("out", "methods", "categories", "limit_per_category", "download", "cache_dir", "warmups"):
            keep.pop(k)
        where = ("placement", "target_core", "draft_core", "threads", "prefill_threads", "gloo_port", "timeout_s")
        return keep | {f"engine.{k}": v for k, v in asdict(self.engine).items() if k not in where}


def _artifact_id(path: str | None) -> str | None:
    """An artifact's identity for run.json: its path and the hash of its weights."""
    if path is None:
        return None
    return _file_id(Path(path) / "model.safetensors", path)


def _file_id(file: Path | str | None, name: str | None = None) -> str | None:
    """`name` (default: the file's path) and the hash of the file's bytes ("?" where it is missing)."""
    if file is None:
        return None
    import hashlib

    file = Path(file)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16] if file.exists() else "?"
    return f"{name or file}#{digest}"


# settings added after runs were recorded without them, at the value those runs had in effect
_LATER_SETTINGS = {"target_dtype": "float32", "engine.datastore": "auto", "datastore": None, "engine.copies": "draft"}


def _check_resume(out: Path, record: dict) -> None:
    path = out / "run.json"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
        return
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise MirrorTrainError(f"{path} is corrupt; move it away (the answers beside it are kept)") from None
    old["settings"] = _LATER_SETTINGS | old.get("settings", {})  # runs from before a setting existed had its default
    diff = [k for k in ("settings", "target", "chat_template") if old.get(k) != record.get(k)]
    if diff:
        details = []
        for k in diff:
            if k == "settings":
                a, b = old.get(k, {}), record[k]
                details += [
                    f"{s}: {a.get(s)!r} → {b.get(s)!r}" for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)
                ]
            else:
                details.append(k)
        raise MirrorTrainError(
            f"{out} holds answers from other settings ({'; '.join(details)}); use another --out (its answers are kept)"
        )


def _record_machine(out: Path, target, prefill_threads: int) -> None:
    """Append where this (re)start of the run serves from to run.json's `machines` (a resumed run may be on another
    machine): the CPU, the target's device, how its linears are served (fastpath.describe), the threads of a prompt's
    prefill (EngineConfig.prefill_layout). Not compared on resume."""
    import datetime

    from mirror_train import fastpath
    from mirror_train.devices import cpu_model

    path = out / "run.json"
    run = json.loads(path.read_text())
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = {"started": started, "cpu": cpu_model(), "target_device": str(target.device)}
    machine["prefill_threads"] = prefill_threads
    run["machines"] = [*run.get("machines", []), machine | fastpath.describe(target.model)]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run, indent=1))
    tmp.replace(path)  # atomic: a kill leaves the old record or the new, whole


def _done(path: Path) -> set[str]:
    """Question ids already answered in an answer file (a torn last line, from a kill, is dropped)."""
    if not path.exists():
        return set()
    done, good = set(), []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            done.add(str(json.loads(line)["question_id"]))
            good.append(line)
        except (json.JSONDecodeError, KeyError):
            continue
    path.write_text("".join(g + "\n" for g in good), encoding="utf-8")
    return done


def run_specbench(cfg: SpecBenchConfig) -> Path:
    """Run (or resume) the benchmark; returns the output directory."""
    import torch

    cfg.validate()
    methods = _servable(cfg)
    out = Path(cfg.out)
    qpath = resolve_questions(cfg.questions, cfg.download, str(Path(cfg.cache_dir).expanduser()), cfg.checksum)
    cats = [c.strip() for c in cfg.categories.split(",")] if cfg.categories else None
    questions = load_questions(qpath, cats, cfg.limit_per_category)
    target = Target.load(
        cfg.target, device=resolve_device(cfg.engine.target_device), dtype=getattr(torch, cfg.target_dtype)
    )
    tok = target.tokenizer
    record = {
        "settings": cfg.settings()
        | {
            "proxy_head": _artifact_id(cfg.proxy_head),
            "draft": _artifact_id(cfg.draft),
            # the datastore sd and mirror copy from (the draft's own under datastore=auto)
            "datastore": _file_id(datastore_path(cfg.engine.datastore, cfg.draft)),
        },
        "target": target.signature().to_dict(),
        "chat_template": tok.chat_template,
        "questions_file": str(qpath),
    }
    _check_resume(out, record)
    answers_dir = out / "answers"
    answers_dir.mkdir(exist_ok=True)
    done = {m: _done(answers_dir / f"{m}.jsonl") for m in methods}
    todo = [q for q in questions if any(q.id not in done[m] for m in methods)]
    engine_cfg = cfg.engine
    uses_draft = any(m in ("sd", "mirror") for m in methods)
    engine = MirrorEngine(target, cfg.proxy_head, cfg.draft if uses_draft else None, engine_cfg)
    _record_machine(out, target, engine.prefill_layout[1] if engine.prefill_layout else engine_cfg.threads)
    assistant = None
    if "assisted" in methods:
        # the same network as the engine's draft, in the precision torch's own path runs fastest here (it is not
        # served on the kernels, where the engine's draft may take bf16 for its bytes alone: fastpath.draft_dtype)
        dtype = resolve_dtype(cfg.engine.draft_dtype, target.device)
        assistant = load_draft(cfg.draft, target).to_llama().to(dtype)
    stops = sorted(engine.stops)

    def generate(method: str, messages: list[dict]) -> dict:
        ids = encode_chat(tok, messages)
        times, first = [], None
        for _ in range(cfg.runs):
            if method in ENGINE_METHODS:
                g = engine.generate(ids, cfg.max_new_tokens, method=method)
                result = {
                    "tokens": g.tokens,
                    "seconds": g.seconds,
                    "accept_lengths": [s.committed for s in g.steps],
                    "reused": [s.reused for s in g.steps if s.reused is not None],
                    "hits": [s.hit for s in g.steps if s.hit is not None],
                    "omegas": [round(s.omega, 4) for s in g.steps if s.omega is not None],
                }
                if method == "mirror":  # the one reading that decides whether the draft works concurrently at all
                    result["contention"] = engine.contention
            else:
                tokens, seconds, lengths = _pinned_hf(target, ids, cfg, engine, stops, method, assistant, hf_generate)
                result = {"tokens": tokens, "seconds": seconds, "accept_lengths": lengths}
            times.append(result["seconds"])
            first = first or result
        first["seconds"] = statistics.median(times)
        return first

    with engine:
        if todo:
            warm = questions[0].messages()
            for method in methods:
                for _ in range(cfg.warmups):
                    _warm(method, warm, engine, target, cfg, stops, assistant)
        bar = tqdm(total=len(todo) * len(methods), desc="specbench", unit="answer")
        for q in todo:
            for method in methods:
                if q.id in done[method]:
                    bar.update()
                    continue
                turns, answers = [], []
                for _ in q.turns:
                    r = generate(method, q.messages(tuple(answers)))
                    text = tok.decode(r["tokens"], skip_special_tokens=True)
                    answers.append(text)
                    turns.append((text, r))
                _append(answers_dir / f"{method}.jsonl", _answer_record(q, method, cfg, turns, target))
                bar.update()
        bar.close()
    return out


def _servable(cfg: SpecBenchConfig) -> list[str]:
    """The methods to run: all asked for, but transformers' assisted generation with a feature-conditioned draft,
    which it cannot feed the target's states (it runs the draft as a plain LM), and pld_store without a datastore
    (the draft's, or engine.datastore=PATH) are skipped with a warning."""
    methods = cfg.method_list
    if "pld_store" in methods and datastore_path(cfg.engine.datastore, cfg.draft) is None:
        warnings.warn("skipping pld_store: no datastore (the draft has none, or there is no draft)", stacklevel=3)
        methods = [m for m in methods if m != "pld_store"]
    if "assisted" in methods and cfg.draft and _reads_target_states(cfg.draft):
        warnings.warn(
            f"skipping assisted: {cfg.draft} reads the target's ℓe states, which transformers' assisted generation "
            "cannot give it (the engine's sd and mirror do)",
            stacklevel=3,
        )
        methods = [m for m in methods if m != "assisted"]
    return methods


def _reads_target_states(draft: str) -> bool:
    path = Path(draft) / "config.json"
    try:
        return json.loads(path.read_text()).get("feature_conditioning", "none") != "none"
    except (OSError, json.JSONDecodeError):
        return False  # a bad draft path gets its clear error where the draft loads


def _pinned_hf(target, ids, cfg, engine, stops, method, assistant, hf_generate):
    """A transformers peer on the target's core with one thread, as the engine's target runs, its prompt's prefill
    spread as the engine's is (`MirrorEngine.prefill_layout`)."""
    on_cpu = cfg.engine.placement != "local" and target.device.type == "cpu"
    with pinned(cfg.engine.target_core if on_cpu else None, 1):
        return hf_generate(target, ids, cfg.max_new_tokens, stops, method, assistant, engine.prefill_layout)


def _warm(method, messages, engine, target, cfg, stops, assistant) -> None:
    ids = encode_chat(target.tokenizer, messages)
    if method in ENGINE_METHODS:
        engine.generate(ids, 16, method=method)
    else:
        _pinned_hf(target, ids, cfg, engine, stops, method, assistant, hf_generate)


def _answer_record(q, method: str, cfg: SpecBenchConfig, turns: list, target) -> dict:
    """One line of Spec-Bench's answer schema, plus our per-turn engine stats under "mirror_stats"."""
    choice = {
        "index": 0,
        "turns": [text for text, _ in turns],
        "decoding_steps": [len(r["accept_lengths"]) for _, r in turns],
        "new_tokens": [len(r["tokens"]) for _, r in turns],
        "wall_time": [r["seconds"] for _, r in turns],
        "accept_lengths": [n for _, r in turns for n in r["accept_lengths"]],
    }
    stats = [{k: r[k] for k in ("reused", "hits", "omegas", "contention") if k in r} for _, r in turns]
    return {
        "question_id": int(q.id) if q.id.isdigit() else q.id,
        "category": q.category,
        "answer_id": uuid.uuid4().hex,
        "model_id": f"{target.name_or_path}-{method}",
        "tstamp": time.time(),
        "choices": [choice],
        "method": method,
        "mirror_stats": stats,
    }


def _append(path: Path, record: dict) -> None:
    """One whole line per answer, flushed: a kill loses at most the answer being written."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
