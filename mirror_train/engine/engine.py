"""The dual-device Mirror-SD engine: the target here, the draft behind a channel, verification keeping the output
exactly the target's.

One step of `method="mirror"` (shared/docs/mirror-sd.md), with committed tokens y_≤t, y_t not yet in the target's
cache, and a drafted window d_1..d_γ:
    1. target layers 1..ℓe over [y_t, d_1..d_γ]; the proxy head's top-κ candidates and log-probs at each position
    2. those go to the draft ("branches"), which ranks branches (branches.py) and rolls out the best that fit
    3. meanwhile the target runs layers ℓe+1..N → its tokens y*_0..y*_γ → accept → commit d_1..d_A, c* (acceptance.py)
    4. the verdict goes to the draft, which answers with the next window: the branch (A, c*) if it rolled it out
       (reuse), else a serial rollout from the committed context (fallback)
    5. rollback: the target's cache (and an attention head's) is cropped to the committed tokens; the draft keeps
       the committed path of its tree and drops the rest (server.py)
`method="sd"` is serial speculative decoding with the same draft, channel and verification (no early exit, no
branches); `method="ar"` is the target alone. All three share the target code path, so they compare fairly.

Where the proxy head runs: on the target's device, between the halves. It reads the ℓe states, which are already
there, and its cost (adapter ~1.6 ms, the LM head ~21 ms per 8 positions on one core, docs/proxy_head.md) sits
on the target's critical path; running it on the draft's side would move that cost off the critical path but
send (γ+1)·H floats a step (14 KB at γ = 5 on the testbed) and take the same time out of the draft's rollout
budget, which is already the scarcer of the two on a CPU.

Faults: if the draft dies, fails or does not answer within `timeout_s`, a warning is issued and generation goes on
target-only from the committed tokens, so the output is unchanged.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

from mirror_train.devices import resolve_device, resolve_dtype
from mirror_train.engine.acceptance import accept, target_tokens, truncate
from mirror_train.engine.channel import DraftUnavailable, LocalDraft, ProcessDraft
from mirror_train.engine.drafts import SyntheticDraftConfig
from mirror_train.engine.latency import predicted_step_ms
from mirror_train.errors import MirrorTrainError
from mirror_train.metrics import check_kappa
from mirror_train.target import Target
from mirror_train.vocab import top_ranked

METHODS = ("ar", "sd", "mirror")
MAX_GAMMA = 32


@dataclass
class EngineConfig:
    exit_layer: int | None = None  # ℓe: None = the proxy head's, or N/2 with the logit lens
    kappa: int = 4  # candidates per window position sent over the channel
    gamma: int = 4  # drafted tokens per window
    branch_budget: int = 8  # the most branches the draft rolls out a step
    adaptive_budget: bool = True  # fewer when the draft's measured cost says they would not fit the target's suffix
    temperature: float = 0.0  # 0: greedy; else the target's tokens are samples at this temperature
    seed: int = 0  # of the target's sampling (each generate call restarts it)
    placement: Literal["process", "gloo", "local"] = "process"  # where the draft runs (channel.py)
    target_device: str = "cpu"
    draft_device: str = "cpu"
    target_core: int | None = 0  # CPU core for the target's thread while generating (None: leave as is)
    draft_core: int | None = 1  # CPU core of the draft worker (None: any)
    threads: int = 1  # intra-op threads on each side
    gloo_port: int = 29533
    timeout_s: float = 60.0  # a draft silent for this long is taken for dead
    use_streams: bool = True  # the draft's lookahead streams (False: one token per draft forward)
    # Mirror-SD: while the target runs its prefix, the draft drafts on past its window (server.py `_look_ahead`)
    look_ahead: bool = True
    candidate_vocab: int | None = None  # the proxy head scores only this many ids (its artifact's most frequent
    # first, else the lowest ids, which BPE's merge order makes roughly the most frequent); None: all of them
    head_placement: Literal["target", "draft"] = "target"  # where the proxy head runs (module docstring)
    # What the draft, and a proxy head on the draft's side, compute in. They only propose, so their precision cannot
    # change the output; "auto": bfloat16 where bf16 matmuls are fast (AMX CPUs, CUDA), else float32.
    draft_dtype: Literal["auto", "float32", "bfloat16"] = "auto"

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
        if self.threads < 1 or self.timeout_s <= 0:
            raise MirrorTrainError("threads must be ≥ 1 and timeout_s > 0")
        cores = os.sched_getaffinity(0)
        for name in ("target_core", "draft_core") if self.placement != "local" else ():  # local: nothing is pinned
            core = getattr(self, name)
            if core is not None and core not in cores:
                raise MirrorTrainError(f"{name}={core} is not a core this process may use ({sorted(cores)})")
        resolve_device(self.target_device)
        resolve_dtype(self.draft_dtype, self.draft_device)


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
    step_ms: float = 0.0
    branch_ms: float = 0.0
    fallback_ms: float = 0.0
    draft_forwards: int = 0  # forwards of the fallback rollout that made the next window (0: reused or none)
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


class MirrorEngine:
    """Target + proxy head here, draft behind a channel. Use as a context manager (or call `close`).

    target: a `Target`. proxy_head: a bound `ProxyHead`, the path of an exported one, or None for the logit lens at
    ℓe. draft: the path of an exported draft, a `MirrorDrafterForCausalLM`, a `SyntheticDraftConfig`, or None
    (then only method="ar"). Everything is checked here, before any worker starts.
    """

    def __init__(self, target, proxy_head=None, draft=None, config: EngineConfig | None = None):
        from mirror_train.generation import stop_token_ids

        self.config = cfg = config or EngineConfig()
        cfg.validate()
        self.target = target
        if target.dtype != torch.float32 and not target.exact_windows:
            warnings.warn(
                f"the target computes in {target.dtype} and this machine's matmuls round a row differently by how "
                "many rows a product has: a verification window can differ from one-token decoding (~1e-4 in bf16) "
                "and flip a greedy near-tie. Serve the target in float32 here for outputs equal to plain decoding.",
                stacklevel=2,
            )
        self.head = self._bind_head(proxy_head)
        if cfg.kappa > target.vocab_size:
            raise MirrorTrainError(f"kappa={cfg.kappa} exceeds the vocabulary ({target.vocab_size})")
        self.exit_layer = self.head.cfg.exit_layer
        if cfg.candidate_vocab is not None:
            if cfg.candidate_vocab > target.vocab_size:
                raise MirrorTrainError(
                    f"candidate_vocab={cfg.candidate_vocab} exceeds the vocabulary ({target.vocab_size})"
                )
            ranking = self.head.ranking.tolist() if self.head.ranking is not None else []
            self.head.restrict(top_ranked(ranking, cfg.candidate_vocab, target.vocab_size))
        self.stops = set(stop_token_ids(target.tokenizer, target.config)) if target.tokenizer is not None else set()
        self._tmp = tempfile.TemporaryDirectory(prefix="mirror-engine-")  # what the worker loads: draft, head bundle
        self.conditioned = False  # the draft reads the target's ℓe states, which then cross with every step
        self.spec = self._draft_spec(draft) if draft is not None else None
        self.draft = None  # the channel, once started
        self.channel_ms = 0.0
        self._suffix_ms: float | None = None
        self._prefix_ms: float | None = None  # the target's prefix time per window (EMA): the draft's look-ahead
        self._awaiting = False  # a request is out whose reply has not been read

    # --- set-up ----------------------------------------------------------------------------------------------
    def _bind_head(self, proxy_head):
        from mirror_train.models.proxy_head import ProxyHead, ProxyHeadConfig, load_proxy_head

        cfg, target = self.config, self.target
        if proxy_head is None:
            layer = cfg.exit_layer if cfg.exit_layer is not None else target.num_layers // 2
            target.check_exit_layer(layer)
            return ProxyHead(ProxyHeadConfig(kind="lens", exit_layer=layer, kappa=cfg.kappa), target.hidden_size).bind(
                target
            )
        if not isinstance(proxy_head, ProxyHead):
            proxy_head = load_proxy_head(proxy_head, target, cfg.exit_layer)
        if cfg.exit_layer is not None and proxy_head.cfg.exit_layer != cfg.exit_layer:
            raise MirrorTrainError(f"the proxy head reads ℓe={proxy_head.cfg.exit_layer}, not ℓe={cfg.exit_layer}")
        if proxy_head._target is not target:
            proxy_head.bind(target)
        # Beside the target it computes in the target's precision, like the final norm and LM head it borrows.
        return proxy_head.to(target.dtype)

    def _draft_spec(self, draft) -> dict:
        from mirror_train.models.drafter import MirrorDrafterForCausalLM, check_compatible

        cfg, target = self.config, self.target
        dtype = str(resolve_dtype(cfg.draft_dtype, cfg.draft_device)).removeprefix("torch.")
        common = {
            "branch_budget": cfg.branch_budget,
            "adaptive_budget": cfg.adaptive_budget,
            "kappa": cfg.kappa,
            "dtype": dtype,
        }
        if cfg.head_placement == "draft":
            common["head"] = self._head_bundle()
        if isinstance(draft, SyntheticDraftConfig):
            draft.validate()
            return {"kind": "synthetic", "config": asdict(draft), "vocab_size": target.vocab_size, **common}
        if isinstance(draft, MirrorDrafterForCausalLM):
            check_compatible(draft, target)
            path = os.path.join(self._tmp.name, "draft")
            draft.save_pretrained(path)
        else:
            from mirror_train.drafter_training import ARTIFACT_KIND
            from mirror_train.export import load_artifact

            path = str(draft)
            load_artifact(path, expected_kind=ARTIFACT_KIND, target=target.signature())  # clear errors, early
            from transformers import AutoConfig

            dc = AutoConfig.from_pretrained(path)
            if dc.vocab_size != target.vocab_size:
                raise MirrorTrainError(f"draft {path} has {dc.vocab_size} ids, the target {target.vocab_size}")
        from transformers import AutoConfig

        dc = AutoConfig.from_pretrained(path)
        if getattr(dc, "feature_conditioning", "none") != "none" and dc.target_exit_layer != self.exit_layer:
            raise MirrorTrainError(
                f"the draft reads the target's layer-{dc.target_exit_layer} states and the proxy head splits the "
                f"target at ℓe={self.exit_layer}: the engine computes one ℓe, so both must read the same layer"
            )
        self.conditioned = getattr(dc, "feature_conditioning", "none") != "none"
        return {"kind": "model", "path": path, "device": cfg.draft_device, "use_streams": cfg.use_streams, **common}

    def _head_bundle(self) -> str:
        """The proxy head, its target's final norm and its candidate rows of the LM head, for the draft's side."""
        from mirror_train.models.proxy_head import HeadEnd

        end, state = HeadEnd.of(self.head)
        path = os.path.join(self._tmp.name, "proxy_head.pt")
        bundle = {"end": end, "cfg": self.head.cfg, "state": state, "vocab_ids": self.head.vocab_ids}
        torch.save(bundle, path)
        return path

    def start(self) -> MirrorEngine:
        """Start the draft worker (idempotent) and measure the channel's round trip."""
        if self.spec is None or self.draft is not None:
            return self
        cfg = self.config
        if cfg.placement == "local":
            self.draft = LocalDraft(self.spec)
        else:
            port = cfg.gloo_port if cfg.placement == "gloo" else None
            self.draft = ProcessDraft(self.spec, cfg.draft_core, cfg.threads, gloo_port=port)
            self.channel_ms = self._ping()
        return self

    def _ping(self, n: int = 20) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.draft.send(("ping",))
            self.draft.recv(self.config.timeout_s)
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)

    def close(self) -> None:
        """Stop the draft worker (a later generate starts a new one)."""
        if self.draft is not None:
            self.draft.close()
            self.draft = None

    def __enter__(self) -> MirrorEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
            self._tmp.cleanup()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    # --- generation ------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt,
        max_new_tokens: int = 128,
        method: str = "mirror",
        stop: Sequence[int] | None = None,
        reference: Sequence[int] | None = None,
    ) -> Generation:
        """Generate after `prompt` (token ids, a string, or chat messages) until a stop token or max_new_tokens.

        reference: the target's own continuation, needed only by a synthetic draft.
        """
        start = time.perf_counter()
        result = Generation([], method=method)
        for chunk, stats in self._steps(prompt, max_new_tokens, method, stop, reference):
            result.tokens += chunk
            result.steps.append(stats)
        result.seconds = time.perf_counter() - start
        return result

    def stream(
        self, prompt, max_new_tokens: int = 128, method: str = "mirror", stop=None, reference=None
    ) -> Iterator[int]:
        """Like `generate`, yielding each token as soon as a step commits it."""
        for chunk, _ in self._steps(prompt, max_new_tokens, method, stop, reference):
            yield from chunk

    def _ids(self, prompt) -> list[int]:
        from mirror_train.generation import encode_chat

        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            if self.target.tokenizer is None:
                raise MirrorTrainError("chat messages need the target's tokenizer")
            return encode_chat(self.target.tokenizer, list(prompt))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        ids = [int(t) for t in prompt]
        if not ids:
            raise MirrorTrainError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise MirrorTrainError(f"prompt token ids must be in 0..{self.target.vocab_size - 1}")
        return ids

    def _fault(self, err: Exception) -> None:
        warnings.warn(
            f"draft unavailable ({err}); continuing target-only: the output is unchanged, only slower",
            RuntimeWarning,
            stacklevel=3,
        )
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        self.spec = None  # do not restart a draft that failed

    def _steps(self, prompt, max_new_tokens, method, stop, reference) -> Iterator[tuple[list[int], StepStats]]:
        """`_run`, and if anything escapes it (Ctrl-C, an error) while the draft owes a reply, a stopped draft: a
        stale reply left in the channel would put every later step out of step. The next generate starts a new one."""
        self._awaiting = False
        try:
            yield from self._run(prompt, max_new_tokens, method, stop, reference)
        except BaseException:
            if self._awaiting and self.draft is not None:
                self.draft.close()
                self.draft = None
            raise

    def _run(self, prompt, max_new_tokens, method, stop, reference) -> Iterator[tuple[list[int], StepStats]]:
        if method not in METHODS:
            raise MirrorTrainError(f"method must be one of {METHODS}, got {method!r}")
        if method != "ar" and self.spec is None and self.draft is None:
            raise MirrorTrainError(f"method {method!r} needs a draft; this engine has none (or its draft failed)")
        if max_new_tokens < 1:
            raise MirrorTrainError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if method != "ar" and reference is None and (self.spec or {}).get("kind") == "synthetic":
            raise MirrorTrainError("the synthetic draft needs reference= (the target's own continuation of the prompt)")
        ids = self._ids(prompt)
        stops = set(stop) if stop is not None else self.stops
        cfg, target, head = self.config, self.target, self.head
        if method != "ar":
            self.start()
        generator = torch.Generator(device=target.device).manual_seed(cfg.seed)
        device = target.device
        with _pinned(cfg.target_core if cfg.placement != "local" else None, cfg.threads):
            use_draft = method != "ar" and self.draft is not None
            conditioned = use_draft and self.conditioned
            ref = list(reference) if reference is not None else None

            def start_draft(prompt_states: torch.Tensor | None) -> bool:
                try:
                    look_ahead = method == "mirror" and cfg.look_ahead
                    self.draft.send(("start", ids, cfg.gamma, ref, _wire(prompt_states), look_ahead))
                    self._awaiting = True
                    return True
                except DraftUnavailable as e:
                    self._fault(e)
                    return False

            if use_draft and not conditioned:  # the draft prefills while the target does
                use_draft = start_draft(None)
            cache, head_cache = target.new_cache(), head.new_cache()
            # The whole prompt in one pass, as transformers' generate does (in bf16 a prompt fed in two parts
            # rounds differently); its last row gives the first token. A conditioned draft gets the prompt's states
            # but the last as soon as the prefix has them (the last goes with the first verdict).
            on_exit = (lambda states: start_draft(states[0, :-1])) if conditioned else None
            hidden, last = target.prefill(torch.tensor([ids], device=device), cache, self.exit_layer, on_exit)
            if head_cache is not None:
                head.adapt(hidden, head_cache)  # the attention head's own cache over the prompt
            if conditioned and not self._awaiting:  # the start message could not be sent
                use_draft = False
            t0 = time.perf_counter()
            first = target_tokens(last, cfg.temperature, generator)[0]
            new, done = truncate([first], stops, max_new_tokens)
            stats = StepStats(committed=len(new), accepted=0, window=0)
            window: list[int] = []
            if use_draft:
                try:
                    self.draft.recv(cfg.timeout_s)  # its window after the prompt: the prefill has decided that token
                    self._awaiting = False
                    if not done:
                        states = _wire(hidden[0, -1:]) if self.conditioned else None
                        self.draft.send(("verdict", 0, first, states))
                        self._awaiting = True
                        window = self.draft.recv(cfg.timeout_s)[1]
                        self._awaiting = False
                except DraftUnavailable as e:
                    self._fault(e)
                    use_draft, window = False, []
            stats.step_ms = stats.wait_ms = (time.perf_counter() - t0) * 1e3
            stats.predicted_ms = stats.step_ms
            yield new, stats
            if done:
                return
            pending, cached = first, len(ids)
            while True:
                t0 = time.perf_counter()
                stats = StepStats(committed=0, accepted=0, window=len(window))
                inp = torch.tensor([[pending] + window], device=device)
                state = target.prefix(inp, cache, self.exit_layer)
                t1 = t2 = t3 = time.perf_counter()
                asked = False
                if method == "mirror" and use_draft and window:
                    if cfg.head_placement == "target":
                        candidates = head.window_candidates(state.hidden[0], window, cfg.kappa, head_cache)
                        states = _wire(state.hidden[0]) if self.conditioned else None
                        msg = ("branches", *candidates, self._suffix_ms, states)
                    else:  # the ℓe states cross instead: (γ+1)·H floats
                        msg = ("hidden", _wire(state.hidden[0]), self._suffix_ms)
                    t2 = time.perf_counter()
                    try:
                        self.draft.send(msg)
                        asked = True
                    except DraftUnavailable as e:
                        self._fault(e)
                        use_draft = False
                    t3 = time.perf_counter()
                logits = target.suffix(state)[0]  # (γ+1, V)
                t4 = time.perf_counter()
                y = target_tokens(logits, cfg.temperature, generator)
                accepted, correction = accept(window, y)
                Target.crop(cache, cached + 1 + accepted)
                if head_cache is not None:
                    Target.crop(head_cache, cached + 1 + accepted)
                cached += 1 + accepted
                out, done = truncate(new + window[:accepted] + [correction], stops, max_new_tokens)
                chunk, new = out[len(new) :], out
                t5 = time.perf_counter()
                info, next_window = {}, []
                if use_draft and not done:
                    # A conditioned draft that got no branches message this step gets the committed states here.
                    states = _wire(state.hidden[0, : accepted + 1]) if self.conditioned and not asked else None
                    try:
                        self.draft.send(("verdict", accepted, correction, states, self._prefix_ms))
                        self._awaiting = True
                        _, next_window, info = self.draft.recv(cfg.timeout_s)
                        self._awaiting = False
                    except DraftUnavailable as e:
                        self._fault(e)
                        use_draft = False
                        next_window = []
                t6 = time.perf_counter()
                stats.committed, stats.accepted = len(chunk), accepted
                stats.prefix_ms, stats.head_ms, stats.send_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3
                stats.suffix_ms, stats.wait_ms, stats.step_ms = (t4 - t3) * 1e3, (t6 - t5) * 1e3, (t6 - t0) * 1e3
                if "candidates" in info:  # the proxy's top-κ where the window stopped: online hit_κ and Ω_κ
                    probs = torch.softmax(logits[accepted].float(), dim=-1)
                    stats.hit = correction in info["candidates"]
                    stats.omega = float(probs[torch.tensor(info["candidates"])].sum())
                if info:
                    stats.reused = info["reused"] if method == "mirror" else None
                    stats.branches = info.get("branches", 0)
                    stats.branch_ms, stats.fallback_ms = info.get("branch_ms", 0.0), info.get("fallback_ms", 0.0)
                    stats.draft_forwards = info.get("forwards", 0)
                if window:
                    self._prefix_ms = _ema(self._prefix_ms, stats.prefix_ms)
                if asked:
                    self._suffix_ms = _ema(self._suffix_ms, stats.suffix_ms)
                stats.predicted_ms = (
                    predicted_step_ms(
                        method if window else "ar",
                        stats.prefix_ms,
                        stats.head_ms,
                        stats.suffix_ms,
                        stats.branch_ms,
                        stats.fallback_ms,
                        stats.send_ms + (self.channel_ms if info else 0.0),
                    )
                    + (t5 - t4) * 1e3
                )
                yield chunk, stats
                if done:
                    return
                pending, window = correction, next_window


def _ema(mean: float | None, x: float) -> float:
    """The step times the draft plans against: a moving average that follows the machine's drift."""
    return x if mean is None else 0.8 * mean + 0.2 * x


def _wire(states: torch.Tensor | None):
    """ℓe states as they cross the channel: float32 numpy (a few KB a step; the prompt's once)."""
    return None if states is None else states.float().cpu().numpy()


@contextmanager
def _pinned(core: int | None, threads: int):
    """Run the block on one core with `threads` intra-op threads (the target's side of the two-device layout)."""
    before_threads = torch.get_num_threads()
    before_cores = os.sched_getaffinity(0)
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before_threads)
        if core is not None:
            os.sched_setaffinity(0, before_cores)
