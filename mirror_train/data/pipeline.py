"""The one data pipeline every recipe uses: what the frozen target says about a prompt corpus, made once.

Stages (each resumes or is skipped when already done, under `DataConfig.dir`):
1. self-distillation: the target answers `selfdistill.num_prompts` training prompts (its own text: what the
   engine sees at decode time);
2. teacher forcing: `forced_prompts` further prompts, prompt text only, at prefill speed (~15× more positions per
   second than generating);
3. held-out: the target's own greedy answers to a sample of Spec-Bench questions, never trained on;
4. feature caches of (1+2) and (3): the hidden states of the layers asked for and the top-k final log-probs
   (`features.py`).
A recipe asks for the layers it reads (a proxy head its ℓe; a draft its ℓe and, for the freshest features, the
target's final state, layer N); `extra_layers` adds more, so that runs with different needs share one cache
(the cache directory is named after its layers).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mirror_train.data.features import FeatureCache, FeatureCacheConfig, TokenSequence, build_feature_cache
from mirror_train.data.selfdistill import (
    SelfDistillConfig,
    assemble_selfdistill,
    generate_selfdistill,
    load_selfdistill,
)
from mirror_train.devices import resolve_dtype
from mirror_train.errors import MirrorTrainError
from mirror_train.generation import encode_chat
from mirror_train.prompts import default_specbench_file, load_prompts

log = logging.getLogger(__name__)


def _heldout_default() -> SelfDistillConfig:
    return SelfDistillConfig(prompts=None, num_prompts=60, seed=1, max_new_tokens=128)


@dataclass
class DataConfig:
    dir: str = "outputs/data/smollm2"  # shared by runs on the same target, so heads and drafts of every kind reuse it
    selfdistill: SelfDistillConfig = field(default_factory=SelfDistillConfig)
    forced_prompts: int = 1500  # more training prompts, teacher-forced without answers; 0 = none
    heldout: SelfDistillConfig = field(default_factory=_heldout_default)  # prompts: None = Spec-Bench questions
    extra_layers: list[int] = field(default_factory=list)  # also cache these (ℓe sweeps; another recipe's layers)
    top_k: int = 32
    max_tokens_per_batch: int = 4096
    # Teacher-force sequences in a seeded random order until this many minutes are spent, then keep the finished
    # ones (features.py): with the self-distillation's own time box, the data stages keep their time on any machine
    cache_minutes: float | None = None
    train_on: Literal["all", "answers"] = "all"  # which cached positions to train on
    answer_repeat: int = 1  # with train_on=all: answer positions appear this many times per epoch (the
    # held-out metric is measured on answers, the target's own text, which the forced prompts lack)
    # The precision the target runs in to make the *training* data (answers, states, top-k labels): on CPUs with
    # AMX bfloat16 makes it 1.7x (answers) to 3.7x (teacher forcing) faster, with argmax labels 96.7% equal to
    # float32's (docs/proxy_head.md; answers 1.3x on an AMD EPYC with AVX-512 BF16); without native bf16 it is
    # slower. "auto": bfloat16 where bf16 matmuls are fast (devices.fast_bf16), else float32. Held-out data is
    # always made in the precision the target is served in.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    def validate(self) -> None:
        if self.forced_prompts < 0 or self.answer_repeat < 1 or self.top_k < 1:
            raise MirrorTrainError("data: forced_prompts ≥ 0, answer_repeat ≥ 1 and top_k ≥ 1")


def cached_layers(data: DataConfig, needed: Sequence[int]) -> list[int]:
    """The layers a run's cache holds: what the recipe reads and `data.extra_layers`, sorted."""
    return sorted({*needed, *data.extra_layers})


def feature_dirs(data: DataConfig, layers: Sequence[int]) -> tuple[Path, Path]:
    """Where `prepare_data` puts the train and held-out feature caches of `layers` (without doing any work)."""
    tag = "L" + "-".join(str(x) for x in sorted(set(layers)))
    root = Path(data.dir)
    return root / f"features_train_{tag}", root / f"features_heldout_{tag}"


def prepare_data(
    data: DataConfig, target, layers: Sequence[int], rank: int = 0, world: int = 1, barrier=lambda: None
) -> tuple[Path, Path]:
    """Run (or resume, or skip) every stage with the hidden states of `layers` cached; return the train and held-out
    feature cache directories. Every rank of a launch calls it.

    With several ranks, the self-distillation (the long stage) is shared: each rank answers its share of the
    prompts on its own device, `barrier()` waits for all of them, then the main rank merges the answers and makes
    the rest while the others wait for it (the caller's barrier). Runs that share a data directory (the proxy head
    and the draft, or two drafts launched side by side) take turns: the first builds what is missing, the others
    wait on a lock and then find it done.
    """
    data.validate()
    root = Path(data.dir)
    root.mkdir(parents=True, exist_ok=True)
    layers = sorted(set(layers))
    if rank != 0:  # its share of the answers; the main rank makes the rest
        maker = target.cast(resolve_dtype(data.dtype, target.device))
        generate_selfdistill(data.selfdistill, root / "selfdistill", maker, rank=rank, world=world)
        del maker
        barrier()
        return feature_dirs(data, layers)
    with exclusive(root / ".lock"):
        return _prepare_data(data, target, layers, root, world, barrier)


def open_caches(
    data: DataConfig, layers: Sequence[int], read: int, extra: dict[str, int] | None = None
) -> tuple[FeatureCache, FeatureCache]:
    """The train and held-out caches `prepare_data(data, target, layers)` built, opened on layer `read` (and the
    `extra` layers under their names, see `FeatureCache`)."""
    return tuple(FeatureCache(path, read, extra) for path in feature_dirs(data, layers))


@contextmanager
def exclusive(path: Path):
    """An advisory lock on `path` held for the block (POSIX `flock`; elsewhere no lock)."""
    try:
        import fcntl
    except ImportError:  # Windows: concurrent runs on one data directory are the user's to avoid
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _prepare_data(data: DataConfig, target, layers: list[int], root: Path, world: int, barrier) -> tuple[Path, Path]:
    features = FeatureCacheConfig(
        exit_layers=layers,
        top_k=data.top_k,
        max_tokens_per_batch=data.max_tokens_per_batch,
        max_minutes=data.cache_minutes,
    )
    heldout_features = dataclasses.replace(features, max_minutes=None)  # the held-out set is always whole
    train_dir, heldout_dir = feature_dirs(data, layers)
    maker = target.cast(resolve_dtype(data.dtype, target.device))

    made = root / "selfdistill"
    if world > 1:  # the main rank's share, then every rank's answers merged
        generate_selfdistill(data.selfdistill, made, maker, rank=0, world=world)
        barrier()
        sd_dir = assemble_selfdistill(data.selfdistill, made, maker)
    else:
        sd_dir = generate_selfdistill(data.selfdistill, made, maker)
    sd = load_selfdistill(sd_dir)
    sequences = [TokenSequence(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in sd]
    if data.forced_prompts:
        used = set(sd["id"])
        forced = load_prompts(
            data.selfdistill.prompts, data.forced_prompts, seed=data.selfdistill.seed + 1, exclude=used
        )
        for p in forced:  # the first user turn under the chat template (later turns would need answers)
            ids = encode_chat(target.tokenizer, [{"role": "user", "content": t} for t in p.turns[:1]])
            ids = ids[-data.selfdistill.max_prompt_tokens :]
            sequences.append(TokenSequence(ids, len(ids)))
    sources = {"selfdistill": str(root / "selfdistill"), "forced_prompts": data.forced_prompts}
    build_feature_cache(maker, sequences, train_dir, features, sources)
    del maker

    heldout_cfg = data.heldout
    if heldout_cfg.prompts is None:
        heldout_cfg.prompts = str(default_specbench_file())
    held = load_selfdistill(generate_selfdistill(heldout_cfg, root / "heldout", target))
    held_seqs = [TokenSequence(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in held]
    build_feature_cache(target, held_seqs, heldout_dir, heldout_features, {"heldout": str(root / "heldout")})
    return train_dir, heldout_dir
