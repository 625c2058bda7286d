"""The dual-device Mirror-SD engine: the target here, the draft behind a channel, verification keeping the output
exactly the target's.

One step of `method="mirror"` (shared/docs/mirror-sd.md), with committed tokens y_≤t, y_t not yet in the target's
cache, and a drafted window d_1..d_w:
    1. target layers 1..ℓe over [y_t, d_1..d_w] (`_step`); the proxy head's top-κ candidates at each position
    2. those go to the draft (`Branches`), which ranks branches (branches.py) and rolls out the best that fit
    3. meanwhile the target runs layers ℓe+1..N → its tokens y*_0..y*_w → accept → commit d_1..d_A, c* (acceptance.py)
    4. the verdict goes to the draft (`Verdict`, with the target's final states of the committed tokens for a draft
       that reads them), which answers with the next window: the branch (A, c*) if it rolled it out (reuse), else
       a serial rollout from the committed context (fallback); either way the window is the model's tokens or a
       copy of the text (prompt lookup, ngram.py), whichever promises more, cut to the length that pays for its
       verification (window.py)
    5. rollback: the target's cache (and an attention head's) is cropped to the committed tokens; the draft keeps
       the committed path of its tree and drops the rest (server.py)
Copies (prompt lookup, the datastore) are made on the target's side by default (`EngineConfig.copies`): the engine's
own copy server offers one after every verdict, and the draft's process is asked for the next window only where its
model promised more (`_next_window`); Mirror-SD's steps 1–3 run for the draft's own windows.
`method="sd"` is serial speculative decoding with the same draft, channel, windows and verification (no early exit,
no branches); `method="pld"` verifies copied windows alone (no draft model), `method="pld_store"` copies from the
datastore of the target's own answers too (datastore.py; still no model); `method="ar"` is the target alone.
All share the target code path (and its fast path, fastpath.py), so they compare fairly.

Where the proxy head runs (`head_placement`): on the draft's side by default, where its cost comes out of the
rollout's share of the target's suffix, the window's ℓe states ((γ+1)·H floats) crossing instead of candidates; or
beside the target, between its halves, where its cost sits on the target's critical path.

Faults: if the draft dies, fails or does not answer within `timeout_s`, a warning is issued and generation goes on
target-only from the committed tokens, so the output is unchanged.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from mirror_train import fastpath, static_step
from mirror_train.devices import clock, pinned, resolve_device
from mirror_train.engine.acceptance import NoiseRows, accept_forked, target_tokens, truncate
from mirror_train.engine.channel import DraftUnavailable, LocalDraft, ProcessDraft
from mirror_train.engine.config import COPY_METHODS, METHODS, EngineConfig, Generation, StepStats
from mirror_train.engine.latency import predicted_step_ms
from mirror_train.engine.messages import (
    Branches,
    Candidates,
    Load,
    Ping,
    Start,
    Verdict,
    expects_reply,
    merge_verdicts,
)
from mirror_train.engine.server import CATCH_UP
from mirror_train.engine.setup import bind_head, check_datastore, datastore_path, draft_spec
from mirror_train.engine.window import AskReturn, ask_model, fit_costs
from mirror_train.errors import MirrorTrainError
from mirror_train.forked_window import ForkedWindow
from mirror_train.generation import encode_chat, stop_token_ids
from mirror_train.target import Target
from mirror_train.vocab import top_ranked


class MirrorEngine:
    """Target + proxy head here, draft behind a channel. Use as a context manager (or call `close`).

    target: a `Target`. proxy_head: a bound `ProxyHead`, the path of an exported one, or None for the logit lens at
    ℓe. draft: the path of an exported draft, a `MirrorDrafterForCausalLM`, a `SyntheticDraftConfig`, or None
    (then only method="ar"). Everything is checked here, before any worker starts.
    """

    def __init__(self, target, proxy_head=None, draft=None, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        if cfg.target_device != "auto" and target.device != resolve_device(cfg.target_device):
            raise MirrorTrainError(
                f"the target is on {target.device}, target_device is {cfg.target_device}: load it there "
                "(Target.load(..., device=...)) or leave target_device at auto"
            )
        self.target = target
        self._now = clock(target.device)  # step times size windows and branches: they must include the device work
        if target.dtype != torch.float32 and not target.exact_windows:
            warnings.warn(
                f"the target computes in {target.dtype} and this machine's matmuls round a row differently by how "
                "many rows a product has: a verification window can differ from one-token decoding (~1e-4 in bf16) "
                "and flip a greedy near-tie. Serve the target in float32 here for outputs equal to plain decoding.",
                stacklevel=2,
            )
        self.fast_path = fastpath.install(target.model, cfg.fast_path)
        # where a prompt's prefill runs (EngineConfig.prefill_layout), read before any generation pins this process
        self.prefill_layout = cfg.prefill_layout(target.device)
        if self.prefill_layout is not None:  # how long a prompt its C layers take, fixed before any prefill
            fastpath.c_prefill_rows(target.model, self.prefill_layout)
        self.target_step = static_step.serve(target, cfg.target_step)
        self.head = bind_head(target, cfg, proxy_head)
        # Forked windows (both window sources' chains verified in one pass, forked_window.py) where a row costs
        # little and every row is exact: the row-exact kernels; not with a proxy head that caches window rows itself
        self.forks = (
            cfg.forked_windows
            and self.fast_path == "exact"
            and target.row_invariant
            and all(kind == "full_attention" for kind in target.layer_types)
            and self.head.new_cache() is None
        )
        if cfg.kappa > target.vocab_size:
            raise MirrorTrainError(f"kappa={cfg.kappa} exceeds the vocabulary ({target.vocab_size})")
        self.exit_layer = self.head.cfg.exit_layer
        if cfg.candidate_vocab is not None and cfg.candidate_vocab < target.vocab_size:
            ranking = self.head.ranking.tolist() if self.head.ranking is not None else []
            self.head.restrict(top_ranked(ranking, cfg.candidate_vocab, target.vocab_size))
        if cfg.head_placement == "target" and self.head.cfg.kind not in ("attention", "lora_head"):
            # Beside the target it sits on the target's critical path, and it only proposes, so its linears take the
            # fastest path per call, as on the draft's side (channel.build_server). On torch's default float32 path
            # a 5-row window over 16,384 candidate rows cost the target's step 7.7–8.4 ms on a Zen 4 EPYC
            # (docs/engine.md, thirtieth session). The attention kind runs the target's own layer code, and a LoRA'd
            # head is peft's.
            fastpath.install_head(self.head, fastpath.for_draft(cfg.draft_fast_path), cfg.head_weights)
        self.stops = set(stop_token_ids(target.tokenizer, target.config)) if target.tokenizer is not None else set()
        self._tmp = tempfile.TemporaryDirectory(prefix="mirror-engine-")  # what the worker loads: draft, head bundle
        # the worker's spec, and the target's states the draft reads (exit, final): they cross every step
        self.spec, self.draft_slots = (
            (None, []) if draft is None else draft_spec(target, cfg, draft, self.head, self._tmp.name)
        )
        # Where both sides are CUDA devices of this machine, the states cross as CUDA tensors (`_wire`)
        self._device_wire = (
            self.spec is not None
            and cfg.placement != "gloo"
            and target.device.type == "cuda"
            and self.spec["device"].startswith("cuda")
        )
        self.draft = None  # the channel, once started
        self.channel_ms = 0.0
        self._suffix_ms: float | None = None
        self._prefix_ms: float | None = None  # the target's prefix time per window (EMA): the draft's look-ahead
        self._awaiting = False  # a request is out whose reply has not been read
        self._copiers: dict[str, LocalDraft] = {}  # method → its in-process copy server (pld, pld_store, sd, mirror)
        # The datastore sd, mirror and pld_store copy from, resolved once (a draft that fails takes its spec with it,
        # and the methods after it would lose the draft's datastore); draft_spec checked the draft's, an explicit one
        # without a draft is checked when a method first needs it (`_copier`)
        self._store = (self.spec or {}).get("datastore") or datastore_path(cfg.datastore, None)
        self._store_unchecked = self._store is not None and self._store != (self.spec or {}).get("datastore")
        # Copies on the target's side (EngineConfig.copies): what the draft's process last promised for a model
        # window (its rate, E(w)/c(w) with its rollout's time), the steps it was not asked since, and how many such
        # steps it wants before it explores its model again (server.py `_serial_plan`)
        self._model_rate, self._skips, self._explore_in = math.inf, 0, 0
        self._ask_return = AskReturn()  # what rate-driven asks delivered of the rate that triggered them
        self._draft_prefill_ms = 0.0  # the draft's prefill ms a prompt token, as its process last reported
        self._costs: tuple[list[float], float] | None = None  # relative cost by window length, one-token ms
        self._verify_samples: deque[tuple[int, float]] = deque(maxlen=64)  # (window length, target ms) per step
        self.contention: float | None = None  # the target's slowdown beside the draft's work (`_measure_contention`)

    def start(self) -> MirrorEngine:
        """Start the draft worker (idempotent) and measure the channel's round trip."""
        if self.spec is None or self.draft is not None:
            return self
        cfg = self.config
        if cfg.placement == "local":
            self.draft = LocalDraft(self.spec)
        else:
            port = cfg.gloo_port if cfg.placement == "gloo" else None
            core = cfg.draft_core if self.spec["device"] == "cpu" else None  # cores are for a CPU draft only
            self.draft = ProcessDraft(self.spec, core, cfg.threads, gloo_port=port)
            self.channel_ms = self._ping()
        return self

    def _ping(self, n: int = 20) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.draft.send(Ping())
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
        if method in ("sd", "mirror") and self.spec is None and self.draft is None:
            raise MirrorTrainError(f"method {method!r} needs a draft; this engine has none (or its draft failed)")
        if method in COPY_METHODS and not self.config.ngram_tokens:
            raise MirrorTrainError(f"method {method!r} copies windows from the text: it needs ngram_tokens ≥ 1")
        if method == "pld_store" and self._store is None:
            raise MirrorTrainError(
                "method 'pld_store' copies from a datastore of the target's answers: give a draft that has one "
                "(datastore=auto) or datastore=PATH"
            )
        if max_new_tokens < 1:
            raise MirrorTrainError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if method in ("sd", "mirror") and reference is None and (self.spec or {}).get("kind") == "synthetic":
            raise MirrorTrainError("the synthetic draft needs reference= (the target's own continuation of the prompt)")
        ids = self._ids(prompt)
        cfg = self.config
        if method in ("sd", "mirror"):
            self.start()
        seq = _Sequence(
            ids=ids,
            method=method,
            stops=set(stop) if stop is not None else self.stops,
            max_new_tokens=max_new_tokens,
            reference=list(reference) if reference is not None else None,
        )
        core = cfg.target_core if cfg.placement != "local" and self.target.device.type == "cpu" else None
        with pinned(core, cfg.threads):
            if method != "ar" and cfg.adaptive_window and self._costs is None:
                self._costs = self._measure_costs()
            if method == "mirror" and self.contention is None:
                self.contention = self._measure_contention()
            seq.channel = self._copier(method) if method in COPY_METHODS else self.draft if method != "ar" else None
            if method in ("sd", "mirror") and cfg.copies == "target" and cfg.adaptive_window and cfg.ngram_tokens:
                seq.copier = self._copier(method)
            try:
                stats = self._prefill(seq)
                yield seq.new, stats
                while not seq.done:
                    chunk, stats = self._step(seq)
                    yield chunk, stats
            finally:  # steps never told to the draft's process do not count towards its exploration (`_next_window`)
                self._skips = max(0, self._skips - sum(v.steps for v in seq.untold))

    # --- one sequence: the prompt, then verification steps ------------------------------------------------------
    def _prefill(self, seq: _Sequence) -> StepStats:
        """The whole prompt in one pass, as transformers' generate does (in bf16 a prompt fed in two parts rounds
        differently); its last row gives the first token. The draft prefills meanwhile: at once for a token-only
        draft, with the prompt's ℓe states once the prefix has them, or after the pass for a draft that reads the
        target's final states. Then the first window, drafted after the first token."""
        cfg, target, head = self.config, self.target, self.head
        slots = self.draft_slots if seq.method in ("sd", "mirror") else []
        # with the engine's own copies the draft's process answers nothing: the target never waits for its prefill
        reply = seq.copier is None
        # a prefill spread over every core (EngineConfig.prefill_threads) holds the draft's too: the draft's process
        # then prefills after it, not beside it
        spread = self.prefill_layout
        starts_blind = seq.channel is not None and not slots  # a draft that reads none of the prefill's states
        if starts_blind and spread is None:
            self._send(seq, self._start_message(seq, None, reply))
        if seq.copier is not None:
            seq.copier.send(self._start_message(seq, None))
            seq.copier.recv()
        seq.cache, seq.head_cache = target.new_cache(), head.new_cache()
        early = slots == ["exit"] and spread is None  # everything the draft reads is known half way through
        on_exit = None
        if early:
            on_exit = lambda states: self._send(seq, self._start_message(seq, {"exit": states[0, :-1]}, reply))  # noqa: E731
        prompt = torch.tensor([seq.ids], device=target.device)
        with fastpath.spread(spread, target.model) if spread is not None else contextlib.nullcontext():
            # the tokens from the final states alone (`_tokens`), not all logits
            hidden, last, final = target.prefill(prompt, seq.cache, self.exit_layer, on_exit, logits=False)
        if starts_blind and spread is not None:
            self._send(seq, self._start_message(seq, None, reply))
        if seq.head_cache is not None:
            head.adapt(hidden, seq.head_cache)  # the attention head's own cache over the prompt
        states = {"exit": hidden[0], "final": final[0]}
        if slots and not early:
            self._send(seq, self._start_message(seq, {slot: states[slot][:-1] for slot in slots}, reply))
        if not reply:  # asks wait until the draft should be done with the prompt (it prefills after the Start)
            seq.draft_free_s = time.monotonic() + self._draft_prefill_ms * len(seq.ids) / 1e3
        t0 = self._now()
        if last is None:
            first = self._tokens(seq, final[0, -1:], [0])[0][0]
        else:
            first = target_tokens(last, cfg.temperature, cfg.seed, 0)[0]
        seq.new, seq.done = truncate([first], seq.stops, seq.max_new_tokens)
        stats = StepStats(committed=len(seq.new), accepted=0, window=0)
        if seq.channel is not None and reply:
            self._note(self._receive(seq))  # its window after the prompt: the prefill has decided that token
        if (seq.channel is not None or seq.copier is not None) and not seq.done:
            first_states = self._wire({slot: states[slot][-1:] for slot in slots})
            costs, step_ms = self._cost_fields()
            verdict = Verdict(0, first, first_states, None, costs, step_ms, committed=[first])
            verdict.sent_s = time.monotonic()
            # not the draft's process, with the engine's own copies: it may still be prefilling a long prompt
            # (16–290 ms on Spec-Bench's, Zen 4), and a plain step or a copy costs the target nothing to wait for
            self._next_window(seq, verdict, [first], may_ask=False)
        stats.step_ms = stats.wait_ms = stats.predicted_ms = (self._now() - t0) * 1e3
        seq.pending, seq.cached = first, len(seq.ids)
        return stats

    def _step(self, seq: _Sequence) -> tuple[list[int], StepStats]:
        """One verification: the target's prefix over [pending, window]; Mirror-SD's branch request; its suffix;
        acceptance; the cache rolled back to the committed tokens; the verdict, answered by the next window."""
        cfg, target, head = self.config, self.target, self.head
        window, slots = seq.window, self.draft_slots if seq.method in ("sd", "mirror") else []
        served = seq.served  # who made this window: the draft's process, or the engine's own copies
        # a forked window: the second chain's own tokens after the main chain's (forked_window.py)
        forked = ForkedWindow(len(window), seq.fork, len(seq.alt) - seq.fork) if seq.alt else None
        rows = [seq.pending] + window + seq.alt[seq.fork :]
        main = 1 + len(window)  # the main chain's rows: what the proxy head and the branches read
        t0 = self._now()
        stats = StepStats(committed=0, accepted=0, window=len(rows) - 1, alt=len(rows) - main)
        ids = torch.tensor([rows], device=target.device)
        state = target.prefix(ids, seq.cache, self.exit_layer, forked=forked)
        t1 = t2 = t3 = self._now()
        asked = False
        # an empty window too: branches for c* alone; not for a window of the engine's own copies (its branches
        # would prepare model windows for a step that is not asking the model)
        if seq.method == "mirror" and seq.channel is not None and served == "draft":
            exit_main = state.hidden[0, :main]
            exit_states = {"exit": exit_main} if "exit" in slots or cfg.head_placement == "draft" else None
            candidates = None
            if cfg.head_placement == "target":  # at T > 0 ranked under the noise the target will sample with
                noise = self._noise(seq, range(len(seq.new), len(seq.new) + main)) if cfg.temperature > 0 else None
                candidates = Candidates(*head.window_candidates(exit_main, window, cfg.kappa, seq.head_cache, noise))
            t2 = self._now()
            branches = Branches(self._suffix_ms, candidates, self._wire(exit_states), time.monotonic())
            asked = self._send(seq, branches)
            t3 = self._now()
        # (1, γ+1, V) or None (the tokens from the final states: `_tokens`), (1, γ+1, H)
        logits, final = target.suffix_states(state, logits=False)
        if logits is None:  # each row's output position: the main chain's, then a forked window's second chain's
            positions = [len(seq.new) + i for i in range(main)]
            positions += [len(seq.new) + seq.fork + 1 + j for j in range(len(rows) - main)]
            y, scores, screened = self._tokens(seq, final[0], positions)
        else:
            y = target_tokens(logits[0, :main], cfg.temperature, cfg.seed, len(seq.new))
            if forked is not None:  # the second chain's rows sample at their own output positions
                y += target_tokens(logits[0, main:], cfg.temperature, cfg.seed, len(seq.new) + seq.fork + 1)
        t4 = self._now()
        main_accepted, correction, path, alt_accepted = accept_forked(window, seq.alt, forked, y)
        alt_won = alt_accepted is not None and alt_accepted > main_accepted
        accepted, drafted = (alt_accepted, seq.alt) if alt_won else (main_accepted, window)
        if alt_won:  # the second chain's rows move down behind the stem, where plain decoding would have them
            Target.keep_path(seq.cache, seq.cached, path)
        seq.cached += 1 + accepted
        Target.crop(seq.cache, seq.cached)
        if seq.head_cache is not None:
            Target.crop(seq.head_cache, seq.cached)
        out, seq.done = truncate(seq.new + drafted[:accepted] + [correction], seq.stops, seq.max_new_tokens)
        chunk, seq.new = out[len(seq.new) :], out
        verify_ms = (t1 - t0 + t4 - t3) * 1e3  # the target's own forwards, the branch request aside
        self._verify_samples.append((len(rows) - 1, verify_ms))
        # with this step's sample, once: the ask's pricing and the verdict read them (ar tells no one: not fitted)
        costs, step_ms = self._cost_fields() if seq.channel is not None or seq.copier is not None else (None, None)
        if seq.asked_for is not None:  # this step verified the window of a rate-driven ask: what did it deliver?
            (promised, ask_ms), seq.asked_for = seq.asked_for, None
            if step_ms:
                spent = (verify_ms + ask_ms) / step_ms
                self._ask_return.add(promised, (1 + accepted) / spent)
        t5 = self._now()
        info, seq.window, seq.alt, seq.fork = {}, [], [], 0
        if (seq.channel is not None or seq.copier is not None) and not seq.done:
            committed = {"exit": state.hidden[0, path], "final": final[0, path]}
            # the committed positions' states the draft reads and has not had: ℓe ones unless a Branches brought
            # them (the main chain's), final ones always
            sent = {slot: committed[slot] for slot in slots if slot == "final" or not asked or alt_won}
            verdict = Verdict(
                main_accepted, correction, self._wire(sent), self._prefix_ms, costs, step_ms, alt_accepted
            )
            verdict.sent_s = time.monotonic()  # stamped last: the draft's queue time starts here
            info = self._next_window(seq, verdict, drafted[:accepted] + [correction])
        t6 = self._now()
        stats.committed, stats.accepted, stats.alt_kept = len(chunk), accepted, alt_won
        stats.prefix_ms, stats.head_ms, stats.send_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3
        stats.suffix_ms, stats.wait_ms, stats.step_ms = (t4 - t3) * 1e3, (t6 - t5) * 1e3, (t6 - t0) * 1e3
        if "candidates" in info:  # the proxy's top-κ where the window stopped: online hit_κ and Ω_κ
            top = torch.tensor(info["candidates"])
            if logits is not None:
                row = logits[0, accepted].float()
            else:  # the logits greedy read; the screen's (screened_head.py) with the candidates' own made exact
                row = scores[accepted].float()
                if screened:
                    row = row.clone()
                    row[top] = target.logits_at(final[0, accepted], top)[0]
            stats.hit = correction in info["candidates"]
            stats.omega = float(torch.softmax(row, dim=-1)[top].sum())
        if info:
            stats.reused = info.get("reused") if seq.method == "mirror" else None
            stats.branches = info.get("branches", 0)
            stats.branch_ms, stats.fallback_ms = info.get("branch_ms", 0.0), info.get("fallback_ms", 0.0)
            stats.draft_forwards = info.get("forwards", 0)
            stats.queued_ms = info.get("queued_ms", 0.0)
            stats.source, stats.alt_source = info.get("source"), info.get("alt_source")
            stats.asked = bool(info.get("asked"))
        if window:
            self._prefix_ms = _ema(self._prefix_ms, stats.prefix_ms)
        if asked:
            self._suffix_ms = _ema(self._suffix_ms, stats.suffix_ms)
        stats.predicted_ms = (
            predicted_step_ms(
                seq.method if window and served == "draft" else "ar",
                stats.prefix_ms,
                stats.head_ms,
                stats.suffix_ms,
                stats.branch_ms,
                stats.fallback_ms,
                stats.send_ms + (self.channel_ms if stats.asked else 0.0),
            )
            + (t5 - t4) * 1e3
        )
        seq.pending = correction
        return chunk, stats

    def _tokens(
        self, seq: _Sequence, final: torch.Tensor, positions: list[int]
    ) -> tuple[list[int], torch.Tensor, bool]:
        """The target's token at each row of its final states (R, H), the row's output position in `positions`: the
        argmax, or at T > 0 the Gumbel-max sample of that position (`acceptance.target_tokens`' id), both through
        the LM head's screen (`Target.greedy_scores`); with the logits it read and whether they are the screen's.
        A position's noise is drawn once a sequence (a row of the testbed's 49,152 ids: ~0.13 ms in C on Zen 4): a
        window's rows past the first rejected one are verified again at the same positions in the next step."""
        if self.config.temperature == 0:
            return self.target.greedy_scores(final)
        return self.target.greedy_scores(final, self._noise(seq, positions))

    def _noise(self, seq: _Sequence, positions) -> torch.Tensor:
        """The sampling noise of these output positions (len, V), each drawn once a sequence and kept until its
        position is decided (`_tokens`)."""
        if seq.noise is None:
            seq.noise = NoiseRows(self.target.vocab_size, self.config.temperature, self.config.seed)
        seq.noise.forget_before(len(seq.new))
        return seq.noise.rows(positions)

    def _draw_ahead(self, seq: _Sequence) -> None:
        """While the draft's process makes the next window (a verdict is out, its reply awaited): draw the noise of
        the positions that window will verify, work the step would do anyway, off the target's critical path."""
        if self.config.temperature > 0 and not seq.done:
            self._noise(seq, range(len(seq.new), len(seq.new) + 1 + self.config.gamma))

    # --- the channel, faults, costs -------------------------------------------------------------------------------
    def _wire(self, states: dict[str, torch.Tensor] | None):
        """Target states as they cross the channel. Between CUDA devices of one machine: CUDA tensors (a pipe to a
        worker shares them by CUDA IPC handles, which torch's multiprocessing registers), so they never round-trip
        through host memory; each is a copy the message owns. Else float32 numpy (a few KB a step; the prompt's
        once), which pickles compactly over a pipe or gloo."""
        if not states:
            return None
        if self._device_wire:
            with torch.inference_mode(False):  # a plain tensor (the prompt's states leave mid-prefill)
                return {slot: x.detach().float().clone() for slot, x in states.items()}
        return _wire_numpy(states)

    def _start_message(self, seq: _Sequence, states, reply: bool = True) -> Start:
        look_ahead = seq.method == "mirror" and self.config.look_ahead
        costs, step_ms = self._cost_fields()
        contention = (self.contention or 0.0) if seq.method == "mirror" else 0.0
        return Start(
            seq.ids,
            self.config.gamma,
            seq.reference,
            self._wire(states),
            look_ahead,
            costs,
            step_ms,
            self.forks,
            contention,
            reply=reply,
            temperature=self.config.temperature,
            seed=self.config.seed,
            vocab_size=self.target.vocab_size,
        )

    def _send(self, seq: _Sequence, msg) -> bool:
        """Send to the sequence's draft; a draft that is gone is a fault (generation goes on without it)."""
        if seq.channel is None:
            return False
        try:
            seq.channel.send(msg)
            if seq.channel is self.draft:
                self._awaiting = expects_reply(msg)
            return True
        except DraftUnavailable as e:
            self._drop(seq, e)
            return False

    def _receive(self, seq: _Sequence):
        if seq.channel is None:
            return None
        try:
            reply = seq.channel.recv(self.config.timeout_s)
            self._awaiting = False
            return reply
        except DraftUnavailable as e:
            self._drop(seq, e)
            return None

    def _drop(self, seq: _Sequence, err: Exception) -> None:
        if seq.channel is self.draft:
            self._fault(err)
        seq.channel, seq.window = None, []

    def _copier(self, method: str) -> LocalDraft:
        """Copies alone, in-process (a copy costs microseconds): the draft server with no model. pld: prompt lookup;
        pld_store: and the datastore; sd, mirror: their copies on the target's side (EngineConfig.copies), from the
        same sources as their draft's process. One per method, so that no method learns from another's verdicts."""
        if method not in self._copiers:
            cfg = self.config
            spec = {"kind": "ngram", "ngram_tokens": cfg.ngram_tokens, "adaptive_window": cfg.adaptive_window}
            if method != "pld" and self._store is not None:
                if self._store_unchecked:
                    check_datastore(self._store, self.target)
                    self._store_unchecked = False
                spec["datastore"] = self._store
            self._copiers[method] = LocalDraft(spec)
        return self._copiers[method]

    def _next_window(self, seq: _Sequence, verdict: Verdict, committed: list[int], may_ask: bool = True) -> dict:
        """Send a step's verdict; set the next window; return how it was made (the reply's info).

        With copies on the target's side (`seq.copier`), the engine's own copy server answers first, and the draft's
        process is asked for a window (else only told what was committed, `reply=False`) where its model promised
        more than that copy in its last reply (the promise scaled by what such asks delivered, `window.AskReturn`),
        or where it is due to explore its model again; of the two windows,
        the one that promises more. A server whose window was not the one verified is sent the committed tokens
        instead (it learns nothing from an offer the target never saw), in batches: once CATCH_UP tokens are untold
        (it catches up on no fewer at once), or with the next ask (`merge_verdicts`). `may_ask`: False where the
        draft's process must not be waited for (the prefill's step); nor is it asked before it should have
        prefilled the prompt (`_Sequence.draft_free_s`: on Spec-Bench's long prompts the first ask had queued 100+
        ms behind that)."""
        if seq.copier is None:
            sent = self._send(seq, verdict)
            if sent and seq.method not in COPY_METHODS:  # a draft's process answers (not an in-process copy server)
                self._draw_ahead(seq)
            reply = self._receive(seq) if sent else None
            seq.window, seq.alt, seq.fork = _window(reply)
            seq.served = "draft"
            # pld and pld_store ask no draft's process: their copy server is in-process
            return {} if reply is None else self._note(reply).info | {"asked": seq.method not in COPY_METHODS}
        seq.copier.send(replace(verdict, states=None, committed=None if seq.served == "copier" else committed))
        copy = seq.copier.recv()
        copy_rate = copy.info.get("rate", 1.0)
        promised = self._model_rate * self._ask_return.factor()  # its promise, at what its asks delivered
        ask = (
            may_ask
            and seq.channel is not None
            and time.monotonic() >= seq.draft_free_s  # an ask before would queue behind its prefill
            and ask_model(promised, copy_rate, self._skips, self._explore_in)
        )
        driven, model_rate, start = ask and promised > max(copy_rate, 1.0), self._model_rate, self._now()
        reply = None
        if seq.channel is not None:
            told = replace(verdict, committed=None if seq.served == "draft" else committed, reply=ask)
            if told.committed is not None:  # a window it did not make: told in batches (merge_verdicts)
                seq.untold.append(told)
                told = None
                if ask or sum(len(v.committed) for v in seq.untold) >= CATCH_UP:
                    told, seq.untold = merge_verdicts(seq.untold), []
            if told is not None and self._send(seq, told) and ask:
                self._draw_ahead(seq)
                reply = self._note(self._receive(seq))
                if reply is not None and driven:  # priced when the step that verifies its window is done
                    seq.asked_for = (model_rate, (self._now() - start) * 1e3)
        self._skips = 0 if reply is not None else self._skips + 1
        if reply is not None and reply.info.get("rate", 0.0) >= copy_rate:
            seq.window, seq.alt, seq.fork = _window(reply)
            seq.served = "draft"
            return reply.info | {"asked": True}
        seq.window, seq.alt, seq.fork = _window(copy)
        seq.served = "copier"
        drafted = {} if reply is None else reply.info | {"asked": True, "reused": None}
        return drafted | {key: copy.info.get(key) for key in ("source", "alt_source", "rate")}

    def _note(self, reply):
        """Keep what a reply of the draft's process promises for its next model window (`_next_window`)."""
        if reply is not None and "model_rate" in reply.info:
            self._model_rate, self._explore_in = reply.info["model_rate"], reply.info["explore_in"]
        if reply is not None and reply.info.get("prefill_ms"):
            self._draft_prefill_ms = reply.info["prefill_ms"]
        return reply

    def _cost_fields(self) -> tuple[list[float] | None, float | None]:
        """(costs, step_ms) for the draft side: the target's relative verification cost by window length and its
        one-token step in ms, fitted to the steps measured so far, else the start-up measurement."""
        if not self.config.adaptive_window:
            return None, None
        fitted = fit_costs(self._verify_samples, self._widest()) or self._costs
        return fitted if fitted is not None else (None, None)

    def _widest(self) -> int:
        return max(self.config.gamma, self.config.ngram_tokens)

    @torch.inference_mode()
    def _measure_costs(self, context: int = 128, repeats: int = 3) -> tuple[list[float], float]:
        """The target's verification cost by window length, measured once on a dummy context (random tokens), as
        the relative median step time of windows of 0, 1, 2, 4, ... drafted tokens; every step then refines it."""
        target = self.target
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, target.vocab_size, (1, context + self._widest() + 1), generator=generator)
        cache = target.new_cache()
        target.forward(ids[:, :context].to(target.device), cache)
        widths = sorted({0, 1, 2, *range(4, self._widest() + 1, 4), self._widest()})
        for _ in range(repeats):
            for w in widths:
                start = self._now()
                target.forward(ids[:, context : context + w + 1].to(target.device), cache)
                self._verify_samples.append((w, (self._now() - start) * 1e3))
                Target.crop(cache, context)
        return fit_costs(self._verify_samples, self._widest())

    @torch.inference_mode()
    def _measure_contention(self, context: int = 128, steps: int = 8, rounds: int = 4) -> float:
        """How much slower the target's one-token step runs while the draft works (0.18: 18%), measured once: in each
        of `rounds` rounds the step timed alone, then beside the draft's own branch rollouts (`Load`); the median of
        the rounds' ratios. Rounds, not one long phase of each: on a shared machine the speed drifts over seconds, and
        two phases of 24 steps read 0.00 and 0.07 from engine to engine (fifteenth session). Devices that share
        nothing measure ~0; two cores on one memory bus do not (docs/engine.md). 0 where nothing overlaps (the draft
        in-process), for the synthetic draft (a sleep) or with `price_contention` off; a draft that fails here is
        the usual fault."""
        synthetic = (self.spec or {}).get("kind") == "synthetic"  # its work is a sleep: it shares nothing
        if not self.config.price_contention or self.config.placement == "local" or self.draft is None or synthetic:
            return 0.0
        target = self.target
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, target.vocab_size, (1, context + 1), generator=generator).to(target.device)
        cache = target.new_cache()
        target.forward(ids[:, :context], cache)

        def timed() -> float:
            out = []
            for _ in range(steps):
                start = self._now()
                target.forward(ids[:, context:], cache)
                out.append((self._now() - start) * 1e3)
                Target.crop(cache, context)
            return statistics.median(out)

        timed()  # warm
        ratios = []
        for _ in range(rounds):
            alone = timed()
            try:
                self.draft.send(Load(alone * steps * 1.5 + 200.0, self.config.gamma))
                time.sleep(0.1)  # the draft's dummy prefill, then its rollouts: time the target once they run
                beside = timed()
                self.draft.recv(self.config.timeout_s)
            except DraftUnavailable as e:
                self._fault(e)
                return 0.0
            ratios.append(beside / alone)
        return max(0.0, statistics.median(ratios) - 1.0)


@dataclass
class _Sequence:
    """One generation's state: the committed tokens, the target's caches, the window being verified."""

    ids: list[int]
    method: str
    stops: set[int]
    max_new_tokens: int
    reference: list[int] | None = None
    channel: object = None  # the draft this sequence talks to (None: target-only, or the draft failed)
    copier: object = None  # sd, mirror: the engine's own copy server (EngineConfig.copies="target"), else None
    served: str | None = None  # who made the window being verified: "draft" (its process) or "copier"
    new: list[int] = field(default_factory=list)
    done: bool = False
    cache: object = None
    head_cache: object = None
    cached: int = 0  # positions in the target's cache
    pending: int = 0  # the newest committed token, not yet in the target's cache
    window: list[int] = field(default_factory=list)
    alt: list[int] = field(default_factory=list)  # a forked window's second chain (forked_window.py)
    fork: int = 0  # the tokens alt shares with window
    # time.monotonic() by which the draft's process should have prefilled the prompt (its last measured speed):
    # asked before, the target would wait for the rest of that prefill (engine._next_window)
    draft_free_s: float = 0.0
    untold: list = field(default_factory=list)  # verdicts the draft's process is yet to be told (_next_window)
    # a rate-driven ask whose window the next step verifies: (the rate it was asked at, its wait in ms)
    asked_for: tuple[float, float] | None = None
    noise: NoiseRows | None = None  # T > 0: its sampling noise by output position, while undecided (_tokens)


def _window(reply) -> tuple[list[int], list[int], int]:
    """The next window of a draft's reply (None: the draft is gone): its tokens, a second chain, their shared stem."""
    if reply is None:
        return [], [], 0
    return list(reply.tokens), list(reply.alt), int(reply.fork)


def _ema(mean: float | None, x: float) -> float:
    """The step times the draft plans against: a moving average that follows the machine's drift."""
    return x if mean is None else 0.8 * mean + 0.2 * x


def _wire_numpy(states: dict[str, torch.Tensor] | None):
    """Target states as they cross the channel: slot → float32 numpy (a few KB a step; the prompt's once)."""
    return {slot: x.float().cpu().numpy() for slot, x in states.items()} if states else None
