"""A disk cache of what proxy-head training needs from the frozen target, computed once.

Training a head needs, per position, the target's hidden state at ℓe (the head's input) and the target's final
distribution (the label). Both come from one teacher-forced forward, which on a CPU runs at prefill speed
(~800 tokens/s on 2 cores for the testbed) — far cheaper than running the whole target every epoch. The label is
kept as the top-k log-probs (k = 32 holds ~95% of the testbed's mass); the rest of the mass is known
(1 − Σ top-k) but not where it lies.

Layout (NumPy files, memory-mapped when read):
    meta.json                 exit layers, top_k, counts, the target's signature, the sources
    hidden_L{ℓ}.npy           (P, H) float16   hidden state after layer ℓ, one file per cached layer (ℓ = N: the
                                               final state, after the final norm: what the LM head reads)
    topk_ids.npy              (P, k) int32     the target's top-k next tokens at each position, best first
    topk_logp.npy             (P, k) float16   their log-probabilities under the full softmax
    is_answer.npy             (P,)   bool      the position predicts a token of the target's own answer
    token_ids.npy             (P,)   int32     the input token at the position (drafts train on token ids)
    seq_offsets.npy           (S+1,) int64     positions of sequence s are [offsets[s], offsets[s+1])
    progress.json             batches finished and minutes spent (a killed run resumes from there), complete
    A time-boxed cache stores its sequences in caching order and is cut to the batches finished in its box;
    meta.json's `planned` then says what the whole would have held.

Position p of a sequence predicts token p+1, so a sequence of L tokens contributes L−1 positions.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mirror_train.errors import MirrorTrainError
from mirror_train.target import dtype_record

log = logging.getLogger(__name__)


@dataclass
class FeatureCacheConfig:
    exit_layers: list[int] = field(default_factory=lambda: [15])
    top_k: int = 32
    max_tokens_per_batch: int = 4096  # padded tokens per teacher-forced forward
    max_seq_len: int = 1152  # longer sequences keep their last tokens
    # Cache sequences in a seeded random order until this many minutes are spent (every run of the build together),
    # then keep the finished ones; None: every sequence
    max_minutes: float | None = None

    def validate(self) -> None:
        if not self.exit_layers:
            raise MirrorTrainError("exit_layers must name at least one layer")
        if self.top_k < 1 or self.max_tokens_per_batch < 2 or self.max_seq_len < 2:
            raise MirrorTrainError("top_k must be ≥ 1, max_tokens_per_batch and max_seq_len ≥ 2")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise MirrorTrainError(f"max_minutes must be > 0 (or null), got {self.max_minutes}")


@dataclass(frozen=True)
class TokenSequence:
    ids: list[int]
    answer_start: int  # index of the first answer token (len(ids) when there is no answer)


def sequences_from_selfdistill(dataset) -> list[TokenSequence]:
    return [TokenSequence(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in dataset]


def _plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Length-sorted batches whose padded size stays within `max_tokens` (deterministic, so resumable)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, current = [], []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def build_feature_cache(
    target,
    sequences: Sequence[TokenSequence],
    out_dir: str | os.PathLike,
    cfg: FeatureCacheConfig,
    sources: dict | None = None,
    progress: bool = True,
) -> Path:
    """Teacher-force every sequence through the target once and store the features (resuming if interrupted).

    Under `cfg.max_minutes` the sequences are cached in a seeded random order, block by block, until the minutes
    (every run of the build together) are spent; the cache is then cut to the finished batches: a random sample of
    what the machine could do in the box, however fast it ran (a throughput probe before the build under-promised
    2.9× on an AMD EPYC when a transient load slowed it)."""
    cfg.validate()
    for layer in cfg.exit_layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= target.num_layers:
            raise MirrorTrainError(f"cannot cache layer {layer!r}: the target has layers 1..{target.num_layers}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seqs = [
        TokenSequence(s.ids[-cfg.max_seq_len :], max(s.answer_start - max(len(s.ids) - cfg.max_seq_len, 0), 1))
        for s in sequences
        if len(s.ids) >= 2
    ]
    if not seqs:
        raise MirrorTrainError("no sequence of at least 2 tokens to cache")
    order, batches = _plan(seqs, cfg)
    seqs = [seqs[i] for i in order]  # the file's order
    counts = np.array([len(s.ids) - 1 for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    total, hidden_size, k = int(offsets[-1]), target.hidden_size, cfg.top_k
    meta = {
        "format_version": 2,
        "config": {k: v for k, v in asdict(cfg).items() if k != "max_minutes"},
        "time_boxed": cfg.max_minutes is not None,  # the layout (see _plan); the minutes may change on a resume
        "positions": total,
        "sequences": len(seqs),
        "answer_positions": int(sum(len(s.ids) - s.answer_start for s in seqs)),
        "hidden_size": hidden_size,
        "target": target.signature().to_dict(),
        "sources": sources or {},
        **dtype_record(target),
    }
    meta_file, progress_file = out / "meta.json", out / "progress.json"
    fresh = not meta_file.exists()
    if not fresh:
        old = json.loads(meta_file.read_text())
        if old.get("format_version") == 1:  # written before caches were cut at their time box: kept as it is
            same = ("config", "target", "sources", "hidden_size", *dtype_record(target))
            if any(old.get(key) != meta[key] for key in same):
                raise MirrorTrainError(f"{out} holds a feature cache of other data or settings; use another directory")
            if not FeatureCache._complete_v1(out, old):
                raise MirrorTrainError(
                    f"{out} holds an unfinished cache of an older format; delete it or use another directory"
                )
            return out
        planned = {**old, **old.get("planned", {})}  # a cache cut at its time box records what it planned
        planned.pop("planned", None)
        if planned != meta:
            raise MirrorTrainError(f"{out} holds a feature cache of other data or settings; use another directory")
        state = json.loads(progress_file.read_text())
        if state.get("complete"):
            return out
    else:
        state = {"batches_done": 0, "minutes": 0.0}
    done, before = state["batches_done"], state.get("minutes", 0.0)
    started = time.perf_counter()

    def spent() -> float:
        return before + (time.perf_counter() - started) / 60

    def out_of_time() -> bool:
        return cfg.max_minutes is not None and done > 0 and spent() >= cfg.max_minutes  # at least one batch

    if not fresh and (done == len(batches) or out_of_time()):
        return _finish(out, meta, batches, done, offsets, state)
    mode = "w+" if fresh else "r+"

    def array(name: str, shape: tuple, dtype) -> np.memmap:
        return np.lib.format.open_memmap(out / name, mode=mode, dtype=dtype, shape=shape if fresh else None)

    hidden = {layer: array(f"hidden_L{layer}.npy", (total, hidden_size), np.float16) for layer in cfg.exit_layers}
    topk_ids = array("topk_ids.npy", (total, k), np.int32)
    topk_logp = array("topk_logp.npy", (total, k), np.float16)
    is_answer = array("is_answer.npy", (total,), np.bool_)
    token_ids = array("token_ids.npy", (total,), np.int32)
    np.save(out / "seq_offsets.npy", offsets)
    if fresh:
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
        progress_file.write_text(json.dumps(state))
    pad = _pad_id(target)
    box = f" (time box {cfg.max_minutes} min)" if cfg.max_minutes is not None else ""
    bar = tqdm(total=total, desc=f"caching features{box}", unit="pos", disable=not progress)
    bar.update(int(sum(counts[i] for b in batches[:done] for i in b)))
    while done < len(batches) and not out_of_time():
        batch = batches[done]
        states, top = _teacher_force(target, [seqs[i].ids for i in batch], k, pad)
        for row, i in enumerate(batch):
            n, lo = int(counts[i]), int(offsets[i])
            for layer in cfg.exit_layers:
                hidden[layer][lo : lo + n] = states[layer][row, :n].float().cpu().numpy().astype(np.float16)
            topk_ids[lo : lo + n] = top.indices[row, :n].cpu().numpy()
            topk_logp[lo : lo + n] = top.values[row, :n].cpu().numpy().astype(np.float16)
            is_answer[lo : lo + n] = np.arange(n) >= seqs[i].answer_start - 1
            token_ids[lo : lo + n] = seqs[i].ids[:n]
        for arr in (*hidden.values(), topk_ids, topk_logp, is_answer, token_ids):
            arr.flush()
        done += 1
        state = {"batches_done": done, "minutes": spent(), "box": cfg.max_minutes}
        progress_file.write_text(json.dumps(state))
        bar.update(int(counts[batch].sum()))
    bar.close()
    del hidden, topk_ids, topk_logp, is_answer, token_ids  # the memory maps closed before a cut
    return _finish(out, meta, batches, done, offsets, state)


def _plan(seqs: list[TokenSequence], cfg: FeatureCacheConfig) -> tuple[list[int], list[list[int]]]:
    """The file's order of the sequences (indices into `seqs`) and the batches in caching order (indices into the
    file's order). Whole: the given order, length-sorted batches over all of it. Time-boxed: a seeded permutation
    cut into blocks of `_BOX_BLOCK` sequences, each block's batches length-sorted and stored one after another, so
    the batches finished at any moment fill a prefix of the file and hold a random sample of every length."""
    lengths = [len(s.ids) for s in seqs]
    if cfg.max_minutes is None:
        return list(range(len(seqs))), _plan_batches(lengths, cfg.max_tokens_per_batch)
    permuted = np.random.default_rng(0).permutation(len(seqs)).tolist()
    order: list[int] = []
    batches: list[list[int]] = []
    for lo in range(0, len(permuted), _BOX_BLOCK):
        block = permuted[lo : lo + _BOX_BLOCK]
        for batch in _plan_batches([lengths[i] for i in block], cfg.max_tokens_per_batch):
            batches.append(list(range(len(order), len(order) + len(batch))))
            order += [block[j] for j in batch]
    return order, batches


_BOX_BLOCK = 256  # sequences a time-boxed cache sorts by length together: little padding, yet a sample of the whole


def _finish(out: Path, meta: dict, batches: list[list[int]], done: int, offsets: np.ndarray, state: dict) -> Path:
    """Mark the cache complete; a time-boxed one stopped early is first cut to its finished batches (a prefix of
    the file: see `_plan`). Each step is idempotent, so a run killed here finishes on the next."""
    if done < len(batches):
        kept = max(batches[done - 1]) + 1  # sequences
        positions = int(offsets[kept])
        for name in sorted(p.name for p in out.glob("*.npy") if p.name != "seq_offsets.npy"):
            _truncate_npy(out / name, positions)
        np.save(out / "seq_offsets.npy", offsets[: kept + 1])
        planned = {key: meta[key] for key in ("positions", "sequences", "answer_positions")}
        answers = np.load(out / "is_answer.npy", mmap_mode="r")
        cut = {**meta, "positions": positions, "sequences": kept, "answer_positions": int(answers.sum())}
        (out / "meta.json").write_text(json.dumps({**cut, "planned": planned}, indent=2) + "\n")
        log.warning(
            "cached %d of %d sequences (%d positions) in the %s-minute time box",
            kept,
            meta["sequences"],
            positions,
            state.get("box"),
        )
    (out / "progress.json").write_text(json.dumps({**state, "complete": True}))
    return out


def _truncate_npy(path: Path, rows: int) -> None:
    """Cut a .npy file to its first `rows` rows in place: the header rewritten at its old length (fewer rows never
    need more digits) and the data truncated."""
    with open(path, "r+b") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        data_start = f.tell()
        if shape[0] == rows:
            return
        header = repr(
            {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": (rows, *shape[1:])}
        )
        length_bytes = 2 if version == (1, 0) else 4
        room = data_start - 6 - 2 - length_bytes  # magic string, version, header length
        f.seek(6 + 2 + length_bytes)
        f.write(header.ljust(room - 1).encode("latin1") + b"\n")
        f.truncate(data_start + rows * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)


def _pad_id(target) -> int:
    return target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0


def _teacher_force(target, rows: list[list[int]], k: int, pad: int):
    """One cached batch's work: the target's states at every layer and its top-k log-probs, right-padded rows
    (causal attention keeps real positions exact)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(rows):
        ids[row, : len(r)] = torch.tensor(r)
        mask[row, : len(r)] = 1
    states, logits = target.hidden_states(ids.to(target.device), mask.to(target.device))
    return states, torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


class FeatureCache:
    """Read side of the cache: memory-mapped arrays for one exit layer (`hidden`), and optionally more layers
    under names of the reader's choosing (`extra`: name → layer; `windows` then returns each under its name)."""

    def __init__(self, path: str | os.PathLike, exit_layer: int, extra: dict[str, int] | None = None):
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise MirrorTrainError(f"{self.path} is not a feature cache (no meta.json)")
        self.meta = json.loads(meta_file.read_text())
        layers = self.meta["config"]["exit_layers"]
        extra = dict(extra or {})
        for layer in (exit_layer, *extra.values()):
            if layer not in layers:
                raise MirrorTrainError(f"{self.path} caches layers {layers}, not layer {layer}")
        self.exit_layer = exit_layer
        self.hidden = np.load(self.path / f"hidden_L{exit_layer}.npy", mmap_mode="r")
        self.extra = {name: np.load(self.path / f"hidden_L{layer}.npy", mmap_mode="r") for name, layer in extra.items()}
        self.topk_ids = np.load(self.path / "topk_ids.npy", mmap_mode="r")
        self.topk_logp = np.load(self.path / "topk_logp.npy", mmap_mode="r")
        self.is_answer = np.load(self.path / "is_answer.npy", mmap_mode="r")
        ids_file = self.path / "token_ids.npy"  # absent from caches written before drafts trained on them
        self.token_ids = np.load(ids_file, mmap_mode="r") if ids_file.exists() else None
        self.offsets = np.load(self.path / "seq_offsets.npy")
        if not self._complete():  # an unfinished cache is an error, not a silently smaller training set
            raise MirrorTrainError(f"{self.path} is incomplete; re-run the command that builds it to resume")

    def _complete(self) -> bool:
        if self.meta.get("format_version", 1) >= 2:  # marked when finished (or cut at its time box)
            return bool(json.loads((self.path / "progress.json").read_text()).get("complete"))
        return self._complete_v1(self.path, self.meta)

    @staticmethod
    def _complete_v1(path: Path, meta: dict) -> bool:
        """Format 1 is complete when every batch planned over its sequences is done."""
        lengths = (np.diff(np.load(path / "seq_offsets.npy")) + 1).tolist()
        planned = len(_plan_batches(lengths, meta["config"]["max_tokens_per_batch"]))
        return json.loads((path / "progress.json").read_text())["batches_done"] == planned

    def __len__(self) -> int:
        return int(self.meta["positions"])

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    def positions(self, answers_only: bool = False) -> np.ndarray:
        return np.flatnonzero(self.is_answer) if answers_only else np.arange(len(self))

    def windows(self, spans: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Contiguous row ranges as a right-padded batch: hidden (B, T, H), topk_* (B, T, k), mask (B, T), is_answer
        (B, T) (the position predicts a token of the target's own answer),
        token_ids (B, T) when the cache has them (the draft's inputs; padding 0), and each extra layer's states
        (B, T, H) under its name."""
        width = max(hi - lo for lo, hi in spans)
        k = self.topk_ids.shape[1]
        hidden = np.zeros((len(spans), width, self.hidden.shape[1]), dtype=np.float32)
        ids = np.zeros((len(spans), width, k), dtype=np.int64)
        logp = np.zeros((len(spans), width, k), dtype=np.float32)
        mask = np.zeros((len(spans), width), dtype=np.int64)
        answer = np.zeros((len(spans), width), dtype=np.bool_)
        tokens = np.zeros((len(spans), width), dtype=np.int64)
        for row, (lo, hi) in enumerate(spans):
            n = hi - lo
            hidden[row, :n], ids[row, :n], logp[row, :n] = (
                self.hidden[lo:hi],
                self.topk_ids[lo:hi],
                self.topk_logp[lo:hi],
            )
            mask[row, :n] = 1
            answer[row, :n] = self.is_answer[lo:hi]
            if self.token_ids is not None:
                tokens[row, :n] = self.token_ids[lo:hi]
        tensors = {"hidden": hidden, "topk_ids": ids, "topk_logp": logp, "mask": mask, "is_answer": answer}
        for name, states in self.extra.items():
            extra = np.zeros_like(hidden)
            for row, (lo, hi) in enumerate(spans):
                extra[row, : hi - lo] = states[lo:hi]
            tensors[name] = extra
        if self.token_ids is not None:
            tensors["token_ids"] = tokens
        return {name: torch.from_numpy(array) for name, array in tensors.items()}

    def batch(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows `index` as tensors: hidden (n, H) float32, topk_ids (n, k) long, topk_logp (n, k) float32."""
        index = np.sort(index)  # sorted reads are much faster on a memory map
        return {
            "hidden": torch.from_numpy(self.hidden[index].astype(np.float32)),
            "topk_ids": torch.from_numpy(self.topk_ids[index].astype(np.int64)),
            "topk_logp": torch.from_numpy(self.topk_logp[index].astype(np.float32)),
        }


def pack_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A right-padded batch of windows (as `FeatureCache.windows` gives it) as one row holding them one after another:
    every tensor (B, T, ...) becomes (1, N, ...) over the N real positions, and `segments` (1, N) (which window) and
    `position_ids` (1, N) (the position inside it) are added; `mask` becomes all ones.

    Why: windows differ in length, and a padded batch computes every padding slot through the whole model (measured
    on the default draft data: see docs/drafter.md). A model that reads `segments` through a block-causal mask
    computes exactly what it computes on the padded rows.
    """
    real = batch["mask"].bool()  # (B, T)
    rows = torch.arange(real.shape[0], device=real.device)[:, None].expand_as(real)
    packed = {name: value[real][None] for name, value in batch.items()}  # row-major: the windows in order
    packed["segments"] = rows[real][None]
    packed["position_ids"] = (real.long().cumsum(1) - 1)[real][None]
    return packed
