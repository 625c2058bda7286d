"""The engine's settings (`EngineConfig`, every one with its typed default) and what a generation returns
(`Generation`, a `StepStats` per verification step)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from mirror_train import fastpath, fused_head, static_step
from mirror_train.devices import cpu_quota, draft_device, resolve_device, resolve_dtype, usable_cores
from mirror_train.errors import MirrorTrainError
from mirror_train.metrics import check_kappa

METHODS = ("ar", "sd", "mirror", "pld", "pld_store")
COPY_METHODS = ("pld", "pld_store")  # no draft model: copied windows alone, the draft server in-process
MAX_GAMMA = 32


@dataclass
class EngineConfig:
    exit_layer: int | None = None  # ℓe: None = the proxy head's, or N/2 with the logit lens
    kappa: int = 8  # candidates per window position sent over the channel
    gamma: int = 4  # drafted tokens per window at most (adaptive_window cuts each to what pays)
    branch_budget: int = 16  # the most branches the draft rolls out a step
    adaptive_budget: bool = True  # fewer when the draft's measured cost says they would not fit the target's suffix
    temperature: float = 0.0  # 0: greedy; else the target's tokens are samples at this temperature
    seed: int = 0  # of the target's sampling (each generate call restarts it)
    placement: Literal["process", "gloo", "local"] = "process"  # where the draft runs (channel.py)
    # Where the served target runs (cpu, cuda, cuda:N, mps): a target loaded elsewhere is refused, naming this
    # setting. auto: where the given target is; commands that load it (specbench) load it on CUDA when present.
    target_device: str = "auto"
    # Where the draft worker runs: auto = the next GPU after the target's, the target's GPU on a one-GPU machine,
    # else the CPU (the paper's pairing of a GPU target and CPU draft: draft_device=cpu).
    draft_device: str = "auto"
    target_core: int | None = 0  # CPU core for the target's thread while generating, when it runs on the CPU
    draft_core: int | None = 1  # CPU core of the draft worker, when the draft runs on the CPU (None: any)
    threads: int = 1  # intra-op threads on each side
    # The target's intra-op threads for a prompt's prefill on a CPU: one pass over many rows, a GEMM that every core
    # speeds up, while the draft's core idles until the prefill's states reach it (its process prefills after it).
    # None = one a core this process may use, the prefill spread over them all (every method alike: they prefill the
    # same function, so their outputs stay equal); 1 = on the target's core alone, as its steps run. A short prompt
    # runs the target's C layers on one thread either way (up to 64 tokens, or as many as measured faster than the
    # GEMM on these threads: fastpath.c_prefill_rows). Measured: docs/engine.md, forty-second session.
    prefill_threads: int | None = None
    gloo_port: int = 29533  # placement=gloo: the TCP port of the draft's torch.distributed peer
    timeout_s: float = 60.0  # a draft silent for this long is taken for dead
    use_streams: bool = True  # the draft's lookahead streams (False: one token per draft forward)
    # Mirror-SD: while the target runs its prefix, the draft drafts on past its window (server.py `_look_ahead`)
    look_ahead: bool = True
    # Mirror-SD: branch roots also from prompt lookup's guesses for c* (what followed the committed text's longest
    # matches after each window position, server.ROOT_GUESSES of them), beside the proxy head's top-κ
    # (branches.with_lookup; their odds learnt from verdicts)
    lookup_roots: bool = True
    candidate_vocab: int | None = 16384  # the proxy head scores only this many ids (its artifact's most frequent
    # first, else the lowest ids, which BPE's merge order makes roughly the most frequent); None or more than the
    # vocabulary: all of them. 96.6% of held-out answer tokens at a third of the head's cost (docs/engine.md)
    head_placement: Literal["target", "draft"] = "draft"  # where the proxy head runs (module docstring)
    # What the draft, and a proxy head on the draft's side, compute in. They only propose, so their precision cannot
    # change the output; "auto": bfloat16 where bf16 matmuls are fast (CUDA, CPUs with AMX or AVX-512 BF16) or where
    # its layers run on the CPU kernels, which sum in float32 over bf16 weights (fastpath.draft_dtype), else float32.
    draft_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Prompt lookup (ngram.py): windows copied from the prompt and the committed text, up to this long, compete with
    # the draft's in sd and mirror alike (0: off); method "pld" verifies them alone, with no draft model.
    ngram_tokens: int = 8
    # The target's own answers as a second copy source in sd and mirror (datastore.py): "auto" = the draft artifact's
    # datastore.npz when it has one, "off", or the path of a datastore; its continuations compete with prompt
    # lookup's copies, each learnt online as the other window sources are. Method "pld" never reads it; method
    # "pld_store" verifies prompt lookup's and the datastore's copies alone, with no draft model.
    datastore: str = "auto"
    # Cut each window to the length that maximises expected committed tokens per unit of the target's measured
    # verification time (window.py; off: always the draft's whole γ).
    adaptive_window: bool = True
    # The served models' forward (fastpath.py): "auto" = the row-exact kernels for a float32 model on a CPU with a C
    # compiler (a window equals its one-token steps bit for bit, at ~1.3x a one-token step for 8 tokens), else
    # oneDNN-prepacked linears on a CPU, else torch's path; installed on the target in place, so every method (the
    # transformers peers too) runs the same module.
    fast_path: Literal["auto", "exact", "onednn", "none"] = "auto"
    # The target's step (static_step.py): "dynamic" = the KV cache that grows in place (on a CPU the C layers are the
    # fast path); "graphs" = a KV cache of fixed capacity with each window width captured once as a CUDA graph and
    # replayed (eager, a large model's step on a GPU is bound by the host launching its kernels: 25.8 ms a token for
    # an 8B shape on an H200, docs/engine.md); "static" = that fixed-shape step run as it is, on any device (what the
    # CPU tests check the graphs' path with). "auto" = "dynamic" until scripts/gpu_check.py has measured the graphs
    # lossless and faster on a GPU (they were written without one to run on).
    target_step: Literal["auto", "dynamic", "static", "graphs"] = "auto"
    # The draft's forward, and a proxy head's on the draft's side: "auto" = "fastest" (each linear shape by the rows
    # of a call on whichever of torch, oneDNN and the row-exact kernel measured fastest, the attention of a few
    # half-precision rows as grouped matmuls): they only propose, so their rounding never changes the output.
    draft_fast_path: Literal["auto", "fastest", "exact", "onednn", "none"] = "auto"
    # The weights the proxy head's C call reads where the CPU kernels compute it (fused_head.py), on either side:
    # "int8" = int8 copies of its linears, a scale per row, its inputs rounded to 8 bits on AVX512-VNNI's dot product
    # (half bfloat16's bytes: on the draft's side its 16,384 x 576 rows stream beside the target's weights and their
    # time comes out of the branch rollout's); "served" = as the fast path serves them; "auto" = int8 where the dot
    # product is built (csrc/linear_q8.c), else served. It only proposes: its hit_8 against the target's tokens
    # was the same (docs/engine.md, forty-first session).
    head_weights: Literal["auto", "int8", "served"] = "auto"
    # Verify the draft's chain and a copied one together in one pass where both promise tokens (a forked window:
    # forked_window.py), on the row-exact kernels, where a row costs ~4% of a step and every row is exact.
    forked_windows: bool = True
    # Where sd and mirror make their copied windows (prompt lookup, the datastore): "target" = in the engine's own
    # process, as pld_store does, the draft's process asked for a window only where its model promises more than the
    # copy on offer (its measured acceptance and rollout time, advertised with each of its replies) or to explore
    # it now and then; "draft" = every window from the draft's process, which weighs its model against its own
    # copies. A reply from the draft's process costs a step its round trip even when it brings a copy (~1.5 ms of a
    # ~20 ms step on two vCPUs, docs/engine.md), which "target" spares every step the model is not worth asking.
    copies: Literal["target", "draft"] = "target"
    # Mirror-SD: weigh what the draft's concurrent work (look-ahead, branch rollouts) costs the target against what
    # it saves. Two CPU cores share a memory bus: the draft's forward on one slowed the target's step on the other
    # 18% on an AMD EPYC (docs/engine.md). The slowdown is measured once, the target timed alone and beside the
    # draft's rollouts (~3 s); work whose expected saving (P(hit) × the fallback it spares) is below the slowdown
    # it causes is not done. Off: every plan fills the target's time, as if the two devices did not interact.
    price_contention: bool = True

    def validate(self) -> None:
        check_kappa(self.kappa)
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or not 1 <= self.gamma <= MAX_GAMMA:
            raise MirrorTrainError(f"gamma (window length) must be an int in 1..{MAX_GAMMA}, got {self.gamma!r}")
        most = self.kappa * (self.gamma + 1)
        if not 1 <= self.branch_budget <= most:
            raise MirrorTrainError(
                f"branch_budget must be in 1..κ·(γ+1) = {most} (there are no more branches), got {self.branch_budget}"
            )
        if self.temperature < 0:
            raise MirrorTrainError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.placement not in ("process", "gloo", "local"):
            raise MirrorTrainError(f"placement must be process, gloo or local, got {self.placement!r}")
        if self.candidate_vocab is not None and self.candidate_vocab < self.kappa:
            raise MirrorTrainError(f"candidate_vocab ({self.candidate_vocab}) must hold at least κ={self.kappa} ids")
        if self.head_placement not in ("target", "draft"):
            raise MirrorTrainError(f"head_placement must be target or draft, got {self.head_placement!r}")
        if not 0 <= self.ngram_tokens <= MAX_GAMMA:
            raise MirrorTrainError(f"ngram_tokens must be in 0..{MAX_GAMMA}, got {self.ngram_tokens}")
        if self.head_weights not in fused_head.WEIGHTS:
            raise MirrorTrainError(f"head_weights must be auto, int8 or served, got {self.head_weights!r}")
        if self.copies not in ("target", "draft"):
            raise MirrorTrainError(f"copies must be target or draft, got {self.copies!r}")
        if self.datastore not in ("auto", "off") and not os.path.isfile(self.datastore):
            raise MirrorTrainError(f"datastore must be auto, off or a datastore file; {self.datastore!r} is none")
        if self.threads < 1 or self.timeout_s <= 0:
            raise MirrorTrainError("threads must be ≥ 1 and timeout_s > 0")
        if self.prefill_threads is not None and (isinstance(self.prefill_threads, bool) or self.prefill_threads < 1):
            raise MirrorTrainError(f"prefill_threads must be ≥ 1 or None (one a core), got {self.prefill_threads!r}")
        target, draft = self.devices()
        pins = self.placement != "local" and hasattr(os, "sched_getaffinity")  # local: nothing is pinned
        cores = os.sched_getaffinity(0) if pins else set()
        for name, device in (("target_core", target), ("draft_core", draft)) if pins else ():
            core = getattr(self, name)
            if core is not None and device.type == "cpu" and core not in cores:
                raise MirrorTrainError(f"{name}={core} is not a core this process may use ({sorted(cores)})")
        resolve_dtype(self.draft_dtype, draft)
        if static_step.resolve(self.target_step) == "graphs" and target.type != "cuda":
            raise MirrorTrainError(f"target_step=graphs needs a CUDA target; the target is on {target}")
        fastpath.resolve(self.fast_path, draft)
        fastpath.resolve(fastpath.for_draft(self.draft_fast_path), draft)

    def prefill_layout(self, device: torch.device) -> tuple[set[int] | None, int] | None:
        """(cores, threads) of a prompt's prefill by a target on `device`, where it spreads beyond the steps' layout:
        on a CPU, every core this process may use now (None where nothing is pinned: placement local, or an OS that
        does not pin) and `prefill_threads` threads, by default one a core (no more than a container's CPU quota).
        None where the prefill runs as the steps do (a GPU target, one core, or prefill_threads ≤ threads)."""
        if device.type != "cpu":
            return None
        cores = usable_cores()
        threads = self.prefill_threads or min(len(cores) if cores else os.cpu_count() or 1, cpu_quota() or 1 << 16)
        if threads <= self.threads:
            return None
        return (cores if self.placement != "local" else None), threads

    def devices(self) -> tuple[torch.device, torch.device]:
        """(the target's device, the draft's), "auto" resolved and both checked (a device that is not there is a
        one-line error)."""
        target = resolve_device(self.target_device)
        return target, draft_device(self.draft_device, target)


@dataclass
class StepStats:
    """One verification step. Times in ms; draft-side times come from the worker's clock."""

    committed: int  # tokens this step added to the output (A + 1, or fewer at a stop)
    accepted: int  # A: drafted tokens the target kept
    window: int  # γ drafted tokens verified (0: a target-only step, or the prompt's prefill, the first step)
    reused: bool | None = None  # mirror: the next window came from a rolled-out branch (None: no draft asked)
    branches: int = 0
    hit: bool | None = None  # mirror: c* among the proxy's top-κ at position A (online hit_κ)
    omega: float | None = None  # mirror: the target's mass on the proxy's top-κ at position A (online Ω_κ)
    prefix_ms: float = 0.0
    head_ms: float = 0.0
    send_ms: float = 0.0
    suffix_ms: float = 0.0
    wait_ms: float = 0.0  # from the verdict sent to the next window received
    queued_ms: float = 0.0  # of wait_ms: the verdict waiting while the draft finished earlier work (its branches)
    step_ms: float = 0.0
    branch_ms: float = 0.0
    fallback_ms: float = 0.0
    draft_forwards: int = 0  # forwards of the fallback rollout that made the next window (0: reused or none)
    source: str | None = None  # the next window's source: "model", "ngram" (prompt lookup) or "store" (datastore)
    alt_source: str | None = None  # the source of its second chain, where it is a forked window
    # sd, mirror: the draft's process made the next window (False: the engine's own copies, EngineConfig.copies)
    asked: bool = False
    alt: int = 0  # rows of a forked window's second chain, verified beside the window (included in `window`)
    alt_kept: bool = False  # the second chain kept more, and was committed
    predicted_ms: float = 0.0


@dataclass
class Generation:
    tokens: list[int]
    steps: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0
    method: str = "mirror"

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted(self) -> float:
        """Committed tokens per target forward, the prompt's prefill (which commits the first token) included:
        Spec-Bench's mean accepted tokens, as the transformers peers are counted; 1.0 for plain decoding."""
        return len(self.tokens) / max(len(self.steps), 1)

    @property
    def accepted_per_window(self) -> float | None:
        """Committed tokens per verified draft window (A + 1 a step): what the draft earns, without the prefill."""
        windows = [s for s in self.steps if s.window]
        return sum(s.committed for s in windows) / len(windows) if windows else None

    @property
    def reuse_rate(self) -> float | None:
        asked = [s.reused for s in self.steps if s.reused is not None]
        return sum(asked) / len(asked) if asked else None

    def summary(self) -> dict:
        return {
            "method": self.method,
            "tokens": len(self.tokens),
            "steps": len(self.steps),
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted": self.mean_accepted,
            "reuse_rate": self.reuse_rate,
        }
