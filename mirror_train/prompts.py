"""Prompt files: JSONL records with user `turns`, read with errors that name the file and line.

Both the training prompts (`{"id", "category", "turns", "source"}`) and Spec-Bench questions
(`{"question_id", "category", "turns", ...}`) have this shape; a bare `{"prompt": "..."}` line is one turn.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from mirror_train.errors import MirrorTrainError

PROMPTS_ENV = "MIRROR_TRAIN_PROMPTS"
SPECBENCH_ENV = "MIRROR_TRAIN_SPECBENCH_QUESTIONS"
# The repository is checked out beside `shared/`, which holds the data (never committed here).
_SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
_SHARED_PROMPTS = _SHARED_DATA / "train_prompts" / "prompts.jsonl"
_SHARED_SPECBENCH = _SHARED_DATA / "specbench" / "question.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    turns: tuple[str, ...]
    category: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def messages(self, answers: tuple[str, ...] = ()) -> list[dict[str, str]]:
        """Chat messages for the next turn: user turns interleaved with the model's own earlier answers."""
        msgs: list[dict[str, str]] = []
        for i, turn in enumerate(self.turns[: len(answers) + 1]):
            msgs.append({"role": "user", "content": turn})
            if i < len(answers):
                msgs.append({"role": "assistant", "content": answers[i]})
        return msgs


def _env_or_shared(env: str, shared: Path, what: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    if shared.exists():
        return shared
    raise MirrorTrainError(f"no {what} given: pass one, or set {env}")


def default_prompt_file() -> Path:
    """$MIRROR_TRAIN_PROMPTS, else the shared training prompts beside the repository."""
    return _env_or_shared(PROMPTS_ENV, _SHARED_PROMPTS, "prompt file")


def default_specbench_file() -> Path:
    """$MIRROR_TRAIN_SPECBENCH_QUESTIONS, else Spec-Bench's question file in the shared data beside the repository."""
    return _env_or_shared(SPECBENCH_ENV, _SHARED_SPECBENCH, "Spec-Bench question file")


def parse_prompt(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise MirrorTrainError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise MirrorTrainError(f"{where}: expected a JSON object, got {type(record).__name__}")
    turns = record.get("turns")
    if turns is None and isinstance(record.get("prompt"), str):
        turns = [record["prompt"]]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise MirrorTrainError(f"{where}: needs 'turns', a non-empty list of strings (or a 'prompt' string)")
    if not all(t.strip() for t in turns):
        raise MirrorTrainError(f"{where}: a turn is empty")
    pid = record.get("id", record.get("question_id"))
    if pid is None:
        raise MirrorTrainError(f"{where}: needs an 'id' or 'question_id'")
    extra = {k: v for k, v in record.items() if k not in ("id", "question_id", "turns", "prompt", "category")}
    return Prompt(id=str(pid), turns=tuple(turns), category=str(record.get("category", "")), extra=extra)


def load_prompts(
    path: str | os.PathLike | None = None,
    limit: int | None = None,
    seed: int | None = None,
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[Prompt]:
    """Read a prompt JSONL; with `limit`, a seeded sample of that many, drawn from those not in `exclude`."""
    path = Path(path) if path is not None else default_prompt_file()
    if not path.is_file():
        raise MirrorTrainError(f"prompt file not found: {path}")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                prompts.append(parse_prompt(line, f"{path}:{lineno}"))
    if not prompts:
        raise MirrorTrainError(f"{path} holds no prompts")
    prompts = [p for p in prompts if p.id not in exclude]
    if limit is not None and limit < len(prompts):
        prompts = random.Random(seed).sample(prompts, limit)
    return prompts
