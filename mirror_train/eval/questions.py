"""Spec-Bench's question file: the pinned upstream copy (downloaded and checksummed), a local path, or the
environment's; categories checked, errors naming the line."""

from __future__ import annotations

import hashlib
import os
import urllib.request
from pathlib import Path

from mirror_train.errors import MirrorTrainError
from mirror_train.prompts import SPECBENCH_ENV, Prompt, default_specbench_file, load_prompts

REPO, COMMIT = "hemingkx/Spec-Bench", "fd2c1cd7d2201ef71db4c5f4e455008f017967bf"
URL = f"https://raw.githubusercontent.com/{REPO}/{COMMIT}/data/spec_bench/question.jsonl"
SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = {
    **{c: "mt_bench" for c in MT_BENCH},
    **{t: t for t in ("translation", "summarization", "qa", "math_reasoning", "rag")},
}


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fetch_questions(cache_dir: str | os.PathLike) -> Path:
    """Download the question file at the pinned commit into `cache_dir` (once) and check its sha256."""
    path = Path(cache_dir) / f"spec_bench_{COMMIT[:12]}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        try:
            urllib.request.urlretrieve(URL, tmp)
        except OSError as e:
            raise MirrorTrainError(f"could not download Spec-Bench's questions ({e}); pass --questions PATH") from None
        tmp.replace(path)
    return check_file(path)


def check_file(path: Path, expect_sha: str | None = SHA256) -> Path:
    if not Path(path).is_file():
        raise MirrorTrainError(f"question file not found: {path}")
    if expect_sha is not None and sha256(path) != expect_sha:
        raise MirrorTrainError(
            f"{path} is not Spec-Bench's question file at {REPO}@{COMMIT[:7]} (sha256 differs); "
            "pass --no-checksum to run on another question file"
        )
    return Path(path)


def resolve_questions(path: str | None, download: bool, cache_dir: str, checksum: bool = True) -> Path:
    """--questions PATH, else (online, `download`) the pinned upstream copy, else $MIRROR_TRAIN_SPECBENCH_QUESTIONS
    or the shared data."""
    if path:
        return check_file(Path(path), SHA256 if checksum else None)
    if download:
        return fetch_questions(cache_dir)
    try:
        found = default_specbench_file()
    except MirrorTrainError:
        raise MirrorTrainError(f"no question file: pass --questions PATH, --download, or set {SPECBENCH_ENV}") from None
    return check_file(found, SHA256 if checksum else None)


def load_questions(path: Path, categories: list[str] | None = None, per_category: int | None = None) -> list[Prompt]:
    """The questions, in file order, filtered to `categories` (Spec-Bench categories or task names such as
    mt_bench), at most `per_category` of each of Spec-Bench's six tasks (the unit its reports use), spread evenly
    over the task's questions (so mt_bench's come from its eight categories)."""
    questions = load_prompts(path)
    for i, q in enumerate(questions, 1):
        if q.category not in TASKS:
            raise MirrorTrainError(f"{path}: question {q.id} (record {i}) has an unknown category {q.category!r}")
    if categories:
        known = set(TASKS) | set(TASKS.values())
        bad = [c for c in categories if c not in known]
        if bad:
            raise MirrorTrainError(f"unknown categories {bad}; choose from {sorted(known)}")
        questions = [q for q in questions if q.category in categories or TASKS[q.category] in categories]
    if per_category is not None:
        by_task: dict[str, list[Prompt]] = {}
        for q in questions:
            by_task.setdefault(TASKS[q.category], []).append(q)
        kept = set()
        for qs in by_task.values():
            step = len(qs) / min(per_category, len(qs))
            kept.update(qs[int(i * step)].id for i in range(min(per_category, len(qs))))
        questions = [q for q in questions if q.id in kept]
    return questions
