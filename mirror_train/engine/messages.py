"""What crosses the token channel between the engine (the target's side) and the draft server, one dataclass each.

Only token ids, log-probs, a few numbers and, for drafts that read the target's states, those states cross
(float32 numpy: (γ+1)·H floats a step, 11.5 KB at γ = 4 on the testbed; the prompt's once). `states` maps a slot
name ("exit": the target's layer-ℓe states, "final": its final states) to rows, one per position, in order.

    Start       → Window      a new sequence: prefill, then roll out the first window (no reply with
                             `reply=False`: the engine serves the first window itself)
    Branches    (no reply)   Mirror-SD, after the target's prefix over the window: rank and roll out branches while
                             the target finishes (the proxy head's candidates, or the ℓe states for a head here)
    Verdict     → Window     the target's verdict: commit; the next window (a rolled-out branch or a fallback);
                             no reply where the engine serves the next window itself (`reply=False`: copies on the
                             target's side, `EngineConfig.copies`)
    Ping        → Pong       the channel's round trip
    Load        → Pong       run the draft's own work for a while (the engine times its target beside it: how
                             much the draft's work slows the target, `EngineConfig.price_contention`)
    Stop                     end the worker
The worker itself answers Ready once it has built its server, and Failed (with the traceback) if anything raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

States = dict[str, np.ndarray]


@dataclass
class Candidates:
    """The proxy head's view of a window of γ drafted tokens: at each position r = 0..γ its top-κ ids and their
    log-probs, and its log-prob of each drafted token."""

    ids: list[list[int]]  # (γ+1) × κ
    logp: list[list[float]]  # (γ+1) × κ
    window_logp: list[float]  # γ


@dataclass
class Start:
    prompt: list[int]
    gamma: int
    reference: list[int] | None = None  # the target's own continuation: a synthetic draft's script
    states: States | None = None  # the prompt's tokens but the last (the target has not finished the last)
    look_ahead: bool = False  # Mirror-SD: draft on past each window while the target runs its prefix
    costs: list[float] | None = None  # the target's verification cost by window length, relative (window.py)
    step_ms: float | None = None  # the target's one-token step: what a draft's rollout time is weighed against
    forks: bool = False  # the target verifies forked windows (two chains at once: forked_window.py)
    # how much the draft's work slows the target's step while they overlap (measured, `Load`): 0.18 = 18% slower
    contention: float = 0.0
    # False: prefill, answer nothing (the engine's own copies serve the first window: EngineConfig.copies="target");
    # the target does not wait for the draft's prefill of a long prompt
    reply: bool = True
    # The target's sampling (EngineConfig.temperature, seed) and vocabulary: at T > 0 the draft draws the target's
    # noise of each position (acceptance.sample_noise, a function of the seed and the position alone) and couples
    # its tokens to it (rollout.coupled_choice)
    temperature: float = 0.0
    seed: int = 0
    vocab_size: int = 0


@dataclass
class Branches:
    deadline_ms: float | None  # the target's measured suffix time: what the rollout must fit
    candidates: Candidates | None = None  # None: the proxy head runs on the draft's side, on states["exit"]
    states: States | None = None  # exit: the window's ℓe states, [the newest committed token, d_1..d_γ]
    # time.monotonic() when the target sent it (system-wide on one Linux machine): the draft's deadline runs from
    # then, so time spent queued behind the draft's previous work (a look-ahead that overran) comes off it
    sent_s: float | None = None


@dataclass
class Verdict:
    accepted: int  # A: drafted tokens the target kept
    correction: int  # c*: the target's own token after them
    # the states of the newest committed token and d_1..d_A (A + 1 rows): exit when no Branches brought them this
    # step, final for drafts that read the target's final states (known only now)
    states: States | None = None
    prefix_ms: float | None = None  # the target's prefix time: what the draft's look-ahead must fit
    costs: list[float] | None = None  # the target's verification cost by window length, as measured so far
    step_ms: float | None = None  # the target's one-token step, as measured so far
    # a forked window's second chain: the tokens it kept (then `accepted` is the main chain's; the chain that kept
    # more was committed, `correction` its; `states` are of the committed rows)
    alt_accepted: int | None = None
    # time.monotonic() when the target sent it: how long it waited for the draft to finish earlier work (Branches)
    sent_s: float | None = None
    # The tokens committed this step where the window verified was not this server's (the engine served another
    # source's, or none was verified: the prompt's first token): taken as committed, nothing learnt from them
    committed: list[int] | None = None
    reply: bool = True  # False: the engine serves the next window itself; book-keep, answer nothing
    steps: int = 1  # the verification steps it tells of (`merge_verdicts`: another source's, told together)


@dataclass
class Window:
    tokens: list[int]
    info: dict = field(default_factory=dict)  # how it was made: reused, branches, times, forwards, candidates
    alt: list[int] = field(default_factory=list)  # a second chain to verify with `tokens` (forked_window.py)
    fork: int = 0  # the leading tokens alt shares with tokens


@dataclass
class Ping:
    pass


@dataclass
class Pong:
    pass


@dataclass
class Load:
    ms: float  # roll out branches on a dummy context for this long, then answer Pong
    gamma: int  # their depth (it comes before any Start)


@dataclass
class Stop:
    pass


@dataclass
class Ready:
    pid: int


@dataclass
class Failed:
    error: str


def expects_reply(msg) -> bool:
    """Whether the draft answers `msg`: Branches never, a Start or a Verdict unless sent with `reply=False`, the
    rest always. The worker reports a failure with the next message that expects a reply (channel.py)."""
    return not isinstance(msg, Branches) and getattr(msg, "reply", True)


def merge_verdicts(verdicts: list[Verdict]) -> Verdict:
    """Verdicts on other sources' windows (each with `committed`), as one: their committed tokens and states one
    after another, the steps counted, the latest's measurements and reply. The engine tells the draft's process of
    the steps it served itself in batches (engine._next_window): the server catches up on that many tokens at once
    anyway (server.CATCH_UP), and a message a step cost the target's core ~0.3 ms of pickling and piping."""
    if any(v.committed is None for v in verdicts):
        raise ValueError("only verdicts on another source's window (with their committed tokens) merge")
    last = verdicts[-1]
    states = None
    if all(v.states for v in verdicts):
        slots = verdicts[0].states.keys()
        states = {slot: _cat([v.states[slot] for v in verdicts]) for slot in slots}
    committed = [token for v in verdicts for token in v.committed]
    return replace(last, committed=committed, states=states, steps=sum(v.steps for v in verdicts))


def _cat(parts: list):
    """Rows one after another: float32 numpy arrays, or tensors (between CUDA devices)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)
