"""Self-distillation data: the target answers prompts with its own chat template; we keep its tokens.

prompts (a local JSONL or any `datasets` source, multi-turn aware)
  → encoded with the target's chat template, over-long prompts truncated from the left with a warning
  → answered in length-sorted batches (greedy by default, or sampled at a set temperature), the batches taken in a
    seeded random order, so that a time box (`max_minutes`) keeps a sample of every prompt length
  → rows appended to `work/rows.jsonl` after every batch, so a killed run resumes where it stopped (the minutes
    spent are kept with them: a time box counts every run together)
  → a `datasets` dataset on disk (`dataset/`) plus `provenance.json` (target, settings, counts, time).

Turn k of a multi-turn prompt is answered after turn k−1, with the model's own earlier answer in the context,
exactly as in Spec-Bench's protocol.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from mirror_train.errors import MirrorTrainError
from mirror_train.generation import encode_chat, generate_batch
from mirror_train.prompts import Prompt, load_prompts, parse_prompt
from mirror_train.target import dtype_record

log = logging.getLogger(__name__)

COLUMNS = ("id", "turn", "category", "prompt_ids", "answer_ids")


@dataclass
class SelfDistillConfig:
    prompts: str | None = None  # a JSONL path, or a `datasets` name (e.g. org/name); default: shared prompts
    split: str = "train"  # for `datasets` sources
    num_prompts: int | None = 256  # a seeded sample; None = all
    max_turns: int = 2  # turns answered per multi-turn prompt, each after the model's own earlier answers
    max_prompt_tokens: int = 1024  # longer prompts keep their last tokens (with a warning)
    max_new_tokens: int = 128  # per answer
    temperature: float = 0.0  # 0 = greedy, the text the engine will see at T=0
    batch_size: int = 64  # at most; long prompts get smaller batches (see generation.generate_batch)
    seed: int = 0  # of the prompt sample and of sampling
    # Stop answering after this many minutes (all runs of the stage together) and keep what is done: the default
    # pipeline's time on any machine; None: answer every prompt
    max_minutes: float | None = None

    def validate(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_turns < 1 or self.max_prompt_tokens < 8:
            raise MirrorTrainError("max_new_tokens, batch_size and max_turns must be ≥ 1; max_prompt_tokens ≥ 8")
        if self.temperature < 0:
            raise MirrorTrainError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise MirrorTrainError(f"max_minutes must be > 0 (or null), got {self.max_minutes}")


def read_prompt_source(source: str | None, split: str, limit: int | None, seed: int) -> list[Prompt]:
    """Prompts from a local JSONL (strict, line-numbered errors) or a `datasets` source with a known schema."""
    if source is None or source.endswith((".jsonl", ".json")) or Path(source).exists():
        return load_prompts(source, limit=limit, seed=seed)
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # datasets raises many types for "not found"; one line is what the user needs
        raise MirrorTrainError(
            f"could not load dataset {source!r} (split {split!r}): {str(e).splitlines()[0]}"
        ) from None
    if limit is not None and limit < len(ds):
        ds = ds.shuffle(seed=seed).select(range(limit))
    return [
        parse_prompt(json.dumps(_to_prompt_record(row, i, ds.column_names)), f"{source}[{i}]")
        for i, row in enumerate(ds)
    ]


def _to_prompt_record(row: dict, index: int, columns: list[str]) -> dict:
    """Map common chat-dataset schemas onto {id, turns, category}."""
    if "turns" in row or "prompt" in row:
        record = {k: row[k] for k in ("turns", "prompt", "category") if k in row}
    elif "messages" in row or "conversations" in row:
        msgs = row.get("messages") or row.get("conversations")
        turns = [m.get("content", m.get("value")) for m in msgs if m.get("role", m.get("from")) in ("user", "human")]
        record = {"turns": turns}
    elif "instruction" in row:
        text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        record = {"turns": [text]}
    else:
        raise MirrorTrainError(
            f"dataset has none of the expected columns (turns, prompt, messages, conversations, instruction); "
            f"it has: {', '.join(columns)}"
        )
    record["id"] = str(row.get("id", row.get("question_id", index)))
    return record


def truncate_left(ids: list[int], limit: int) -> tuple[list[int], bool]:
    """Keep the last `limit` tokens: the end of a prompt (the question, the generation prompt) matters most."""
    return (ids[-limit:], True) if len(ids) > limit else (ids, False)


def _read_rows(path: Path) -> tuple[list[dict], bool]:
    """The intact rows of a work file, and whether a torn tail followed them."""
    rows = []
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    # a line cut by a kill mid-write: everything before it is intact, and it will be redone
                    log.warning("%s:%d is incomplete; dropping it and what follows", path, lineno)
                    return rows, True
    return rows, False


def generate_selfdistill(cfg: SelfDistillConfig, out_dir: str | os.PathLike, target, rank: int = 0, world: int = 1):
    """Generate (or resume) the dataset under `out_dir`; return the dataset directory.

    With `world` > 1 ranks, this rank answers its share of the prompts (every world-th, each with all its turns) into
    its own `work/rows.rank{R}.jsonl` under its own time box, and returns None: once every rank has finished, one
    calls `assemble_selfdistill` (the data pipeline does, on the main rank).
    """
    cfg.validate()
    out = Path(out_dir)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    settings = _settings(cfg, target)
    settings_file = work / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != settings:
        raise MirrorTrainError(
            f"{out} holds a run with other settings ({settings_file}); use another output directory or delete it"
        )
    _write_atomic(settings_file, json.dumps(settings, indent=2))  # ranks write it alike; none may read it torn

    prompts = read_prompt_source(cfg.prompts, cfg.split, cfg.num_prompts, cfg.seed)[rank::world]
    suffix = f".rank{rank}" if world > 1 else ""
    rows_file = work / f"rows{suffix}.jsonl"
    done = _done_rows(work)
    rows, torn = _read_rows(rows_file)
    if torn:  # rewrite without the torn tail (only then: a finished stage leaves its files untouched)
        with open(rows_file, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    started = time.perf_counter()
    clock_file = work / f"minutes{suffix}.json"  # minutes spent by earlier runs: the time box counts them all
    before = json.loads(clock_file.read_text())["minutes"] if clock_file.exists() else 0.0
    spent = lambda: before + (time.perf_counter() - started) / 60  # noqa: E731
    out_of_time = False
    truncated = generated = 0
    tok = target.tokenizer
    for turn in range(cfg.max_turns):
        todo, encoded = [], []
        for p in prompts:
            if turn >= len(p.turns) or (p.id, turn) in done:
                continue
            earlier = tuple(tok.decode(done[(p.id, t)]["answer_ids"], skip_special_tokens=True) for t in range(turn))
            ids, cut = truncate_left(encode_chat(tok, p.messages(earlier)), cfg.max_prompt_tokens)
            truncated += cut
            todo.append(p)
            encoded.append(ids)
        by_length = sorted(range(len(todo)), key=lambda i: len(encoded[i]))
        todo, encoded = [todo[i] for i in by_length], [encoded[i] for i in by_length]
        flush_every = cfg.batch_size * 2  # a couple of batches per flush: resumable, and batches stay full
        starts = list(range(0, len(todo), flush_every))
        random.Random(cfg.seed + turn).shuffle(starts)  # a time box then keeps prompts of every length
        bar = tqdm(total=len(todo), desc=f"self-distillation, turn {turn + 1}", unit="prompt", disable=not todo)
        for start in starts:
            if cfg.max_minutes is not None and done and spent() >= cfg.max_minutes:  # at least one batch
                out_of_time = True
                break
            chunk = slice(start, start + flush_every)
            answers = generate_batch(
                target.model,
                tok,
                encoded[chunk],
                cfg.max_new_tokens,
                cfg.batch_size,
                cfg.temperature,
                seed=cfg.seed + start + 1000 * turn + 100_000 * rank,
                progress=False,
            )
            with open(rows_file, "a", encoding="utf-8") as f:
                for p, ids, answer in zip(todo[chunk], encoded[chunk], answers):
                    row = {"id": p.id, "turn": turn, "category": p.category, "prompt_ids": ids, "answer_ids": answer}
                    done[(p.id, turn)] = row
                    generated += 1
                    f.write(json.dumps(row) + "\n")
            bar.update(len(todo[chunk]))
            clock_file.write_text(json.dumps({"minutes": spent()}))
        bar.close()
        if out_of_time:
            log.warning("self-distillation stopped at its time box (%s min): %d answers", cfg.max_minutes, len(done))
            break
    if truncated:
        log.warning("%d prompts were longer than %d tokens and kept only their end", truncated, cfg.max_prompt_tokens)
    stats = {
        "generated": generated,
        "truncated_prompts": truncated,
        "time_boxed": out_of_time,
        "seconds": round(time.perf_counter() - started, 1),
    }
    _write_atomic(work / f"stats{suffix}.json", json.dumps(stats))
    return assemble_selfdistill(cfg, out, target) if world == 1 else None


def assemble_selfdistill(cfg: SelfDistillConfig, out_dir: str | os.PathLike, target) -> Path:
    """The dataset (`dataset/`, `provenance.json`) from every rank's rows; left as it is when nothing is new."""
    import datasets

    out = Path(out_dir)
    work = out / "work"
    stats = [json.loads(p.read_text()) for p in sorted(work.glob("stats*.json"))]
    final = out / "dataset"
    if final.exists() and not any(s["generated"] for s in stats):  # nothing new: the dataset is complete
        return final
    rows = list(_done_rows(work).values())
    dataset = datasets.Dataset.from_list(rows)
    tmp = out / ".dataset.tmp"
    dataset.save_to_disk(str(tmp))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    provenance = {
        **_settings(cfg, target),
        "rows": len(rows),
        "answer_tokens": sum(len(r["answer_ids"]) for r in rows),
        "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
        "truncated_prompts": sum(s["truncated_prompts"] for s in stats),
        "seconds_this_run": max((s["seconds"] for s in stats), default=0.0),
        "time_boxed": any(s["time_boxed"] for s in stats),
        "ranks": len(stats),
    }
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return final


def _settings(cfg: SelfDistillConfig, target) -> dict:
    """What the rows depend on (the time box only decides how many there are)."""
    settings = {"target": target.name_or_path, **asdict(cfg), **dtype_record(target)}
    settings.pop("max_minutes")
    return settings


def _done_rows(work: Path) -> dict[tuple[str, int], dict]:
    """(prompt id, turn) → row, from the rows of every rank and every earlier run (`rows*.jsonl`)."""
    done = {}
    for path in sorted(work.glob("rows*.jsonl")):
        done.update({(r["id"], r["turn"]): r for r in _read_rows(path)[0]})
    return done


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_selfdistill(path: str | os.PathLike):
    """Open a dataset written by `generate_selfdistill`, checking it has the columns training needs."""
    import datasets

    path = Path(path)
    if (path / "dataset").is_dir():
        path = path / "dataset"
    if not path.is_dir():
        raise MirrorTrainError(f"self-distillation dataset not found: {path}")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise MirrorTrainError(f"{path} is not a datasets dataset: {str(e).splitlines()[0]}") from None
    missing = [c for c in ("prompt_ids", "answer_ids") if c not in ds.column_names]
    if missing:
        raise MirrorTrainError(f"{path} lacks column(s) {', '.join(missing)}; it has {', '.join(ds.column_names)}")
    return ds


def answer_sequences(ds, prompt_tail: int = 4) -> list[list[int]]:
    """Each answer of a self-distilled dataset after the last `prompt_tail` prompt tokens (the chat template's tail,
    which the answer's first tokens follow): what a datastore of the target's own answers is built from."""
    return [list(p[-prompt_tail:] if prompt_tail else []) + list(a) for p, a in zip(ds["prompt_ids"], ds["answer_ids"])]
