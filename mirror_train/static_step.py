"""The target's step with every shape fixed: a KV cache of fixed capacity, and windows replayed from CUDA graphs.

On a GPU a small window of a large model is bound by the host, not the chip: eager PyTorch launches a few hundred
kernels a step from Python (the first CUDA run, docs/engine.md: a random Llama-3-8B shape in bf16 took 25.8 ms a
token on an H200, whose memory streams its 16 GB of weights in ~4 ms). gpt-fast's answer, which this follows: keep
every tensor a step touches at a fixed address and shape, capture each step once as a CUDA graph, and replay it.
- `StaticKV`: each layer's keys and values in a buffer of `capacity` positions, allocated once. A window writes
  its rows at the positions in `write` (index_copy_), attention reads the whole buffer under a mask that shows each
  row what it may see, so a rollback (`crop`) only moves the length back: the rows past it are masked until a later
  window overwrites them. A forked window's kept chain moves down (`Target.keep_path`) as in the growing cache.
- `StaticSteps`: per window width w (1..`MAX_GRAPH_ROWS` rows) and exit layer, the prefix (embeddings, layers
  1..ℓe) and the suffix (layers ℓe+1..N, final norm, LM head) as two functions over fixed input buffers (ids, rope
  positions, write positions, the mask); on CUDA each is captured as a graph the first time its width is used
  (warmed up twice on a side stream first, as PyTorch's capture requires) and replayed after; elsewhere it runs as
  it is, which is how the CPU tests check the whole path against the growing cache. Longer passes (a prompt) run
  as they are, masked over the same buffers.
- Attention (`attention.row_invariant_sdpa`): the mask carries `static_rows`, and each window row is its own
  one-row SDPA call over the whole buffer, as a one-token step makes it, so a window's attention equals its rows'
  one-token steps; inside a graph the extra calls cost no launches from the host.
Only one sequence at a time uses a target's static cache (the engine's batch of one): `Target.new_cache` hands the
same one out again, reset; a sequence longer than it holds grows its buffers in place (and captures new graphs).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from mirror_train.errors import MirrorTrainError

KINDS = ("auto", "dynamic", "static", "graphs")  # EngineConfig.target_step
MAX_GRAPH_ROWS = 32  # windows up to this many rows are captured (a verification window is 1 + γ (+ a fork) rows)
MIN_CAPACITY = 1024  # positions a static cache holds at least; a longer sequence doubles it


def resolve(kind: str) -> str:
    """What `kind` (KINDS) means. "auto" is "dynamic" for now on every device: the graphs' path was
    written without a GPU to run it on (twenty-second session) and becomes CUDA's default once scripts/gpu_check.py
    has measured it lossless and faster there; ask for "graphs" to use it before."""
    if kind not in KINDS:
        raise MirrorTrainError(f"target_step must be one of {', '.join(KINDS)}, got {kind!r}")
    return "dynamic" if kind == "auto" else kind


def serve(target, kind: str) -> str:
    """Serve `target` with the step `kind` means for it (`resolve`); a target already served so keeps its static
    cache and graphs (another engine over the same target: Spec-Bench's methods). Returns the step chosen."""
    step = resolve(kind)
    if step == "dynamic":
        target.static = None
    elif target.static is None or target.static.graphs != (step == "graphs"):
        target.use_static(graphs=step == "graphs")
    return step


class StaticLayer:
    """One layer's fixed buffers (1, KV heads, capacity, head dim); `keys`/`values` are the whole buffers, which is
    what `Target.keep_path` moves rows within."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class StaticKV:
    """A KV cache of fixed capacity (module docstring). Layers write at `write`, the positions of the rows being
    run (set by `StaticSteps` before each pass: a graph reads its own width's buffer)."""

    def __init__(self, config, num_layers: int, capacity: int, dtype: torch.dtype, device: torch.device):
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (1, kv_heads, capacity, head_dim)
        self.capacity, self.length = capacity, 0
        self.layers = [
            StaticLayer(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.write: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """What transformers' attention calls: this pass's rows written at `write`; returns the whole buffers."""
        layer = self.layers[layer_idx]
        layer.keys.index_copy_(2, self.write, key_states)
        layer.values.index_copy_(2, self.write, value_states)
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, length: int) -> None:
        if length < 0:
            raise ValueError(f"cannot crop a cache to a negative length ({length})")
        self.length = min(self.length, length)

    def reset(self) -> None:
        self.length = 0


@dataclass
class _Inputs:
    """The fixed input buffers of one window width: what a captured graph reads."""

    ids: torch.Tensor  # (1, w) token ids
    positions: torch.Tensor  # (1, w) rope positions (a forked window's second chain sits at its chain's depth)
    write: torch.Tensor  # (w,) cache positions the rows are written at
    mask: torch.Tensor  # (1, 1, w, capacity) bool: which cached positions each row may see


class StaticSteps:
    """A target's prefix and suffix over one `StaticKV`, by window width; CUDA graphs where `graphs` (module
    docstring). Built by `Target.use_static`; the Target's own prefix/suffix/prefill call it for a static cache."""

    def __init__(self, target, capacity: int, graphs: bool):
        if set(target.layer_types) != {"full_attention"}:
            raise MirrorTrainError("the static step needs full-attention layers (this target has sliding windows)")
        if not target.row_invariant:
            raise MirrorTrainError("the static step needs an SDPA target (the row-invariant attention)")
        if graphs and target.device.type != "cuda":
            raise MirrorTrainError(f"CUDA graphs need a CUDA target; this one is on {target.device}")
        self.target, self.graphs = target, graphs
        self.cache = StaticKV(target.config, target.num_layers, capacity, target.dtype, target.device)
        self._inputs: dict[int, _Inputs] = {}
        self._runs: dict[tuple, object] = {}  # (half, width, exit layer) → its captured graph
        self._outputs: dict[tuple, object] = {}  # what each captured graph writes
        self._last: torch.Tensor | None = None  # the last prefix's ℓe states: what its suffix reads
        self._graphed = False  # whether the last prefix was replayed (its suffix is too)
        self.capture_s = 0.0  # total time spent capturing graphs (their warm-ups included)
        self.captured = 0

    # --- inputs --------------------------------------------------------------------------------------------------
    def inputs(self, width: int) -> _Inputs:
        """A width's input buffers: kept (what its graphs read) up to MAX_GRAPH_ROWS rows, made afresh past it."""
        if width in self._inputs:
            return self._inputs[width]
        device, capacity = self.target.device, self.cache.capacity
        with torch.inference_mode():
            mask = torch.zeros((1, 1, width, capacity), dtype=torch.bool, device=device)
            x = _Inputs(
                torch.zeros((1, width), dtype=torch.long, device=device),
                torch.zeros((1, width), dtype=torch.long, device=device),
                torch.zeros(width, dtype=torch.long, device=device),
                mask,
            )
        if width <= MAX_GRAPH_ROWS:
            mask.static_rows = True  # attention.row_invariant_sdpa: one SDPA call a row over the whole buffer
            self._inputs[width] = x
        return x  # a longer pass (a prompt) attends in one SDPA call under its mask

    def fill(self, input_ids: torch.Tensor, forked=None) -> _Inputs:
        """Write a window's ids, positions and mask into its width's buffers; the cache's length moves past it."""
        cache, width = self.cache, input_ids.shape[1]
        past = cache.length
        if past + width > cache.capacity:
            self.grow(past + width)
        device = self.target.device
        x = self.inputs(width)
        keys = torch.arange(cache.capacity, device=device)
        write = torch.arange(past, past + width, device=device)
        x.ids.copy_(input_ids)
        x.write.copy_(write)
        if forked is None:
            x.positions.copy_(write[None])
            x.mask.copy_((keys[None, :] <= write[:, None])[None, None])
        else:
            x.positions.copy_((past + torch.tensor(forked.depths(), device=device))[None])
            seen = forked.mask(past, device)
            x.mask.zero_()
            x.mask[..., : seen.shape[-1]].copy_(seen)
        cache.length = past + width
        return x

    def grow(self, needed: int) -> None:
        """Room for `needed` positions: every layer's buffers replaced in place by ones of twice the capacity (or
        `needed`), the cached rows copied; the graphs and input buffers, made for the old ones, are dropped."""
        cache = self.cache
        capacity = max(2 * cache.capacity, needed)
        with torch.inference_mode():
            for layer in cache.layers:
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = torch.zeros((*old.shape[:2], capacity, old.shape[-1]), dtype=old.dtype, device=old.device)
                    new[:, :, : cache.length] = old[:, :, : cache.length]
                    setattr(layer, name, new)
        cache.capacity = capacity
        self._inputs.clear()
        self._runs.clear()
        self._outputs.clear()

    # --- running -------------------------------------------------------------------------------------------------
    def prefix(
        self, input_ids: torch.Tensor, exit_layer: int, forked=None, graph: bool = True
    ) -> tuple[torch.Tensor, _Inputs]:
        """Layers 1..ℓe over a window (1, w): its ℓe states (a graph's output buffer, which the next window of this
        width overwrites), and the window's input buffers, which `suffix` takes. `graph`: False runs it as it is (a
        prompt, whose lengths are too many to capture)."""
        x = self.fill(input_ids, forked)
        key = ("prefix", input_ids.shape[1], exit_layer)
        self._last = self._run(key, lambda: self._prefix(x, exit_layer), graph)
        self._graphed = graph
        return self._last, x

    def suffix(self, x: _Inputs, exit_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ℓe+1..N, the final norm and the LM head over the window the last `prefix` ran: (logits, the final
        states), as `Target.suffix_states`; replayed where that prefix was."""
        hidden = self._last  # a captured suffix reads the prefix graph's output buffer, which this is
        key = ("suffix", x.ids.shape[1], exit_layer)
        return self._run(key, lambda: self._suffix(x, hidden, exit_layer), self._graphed)

    def prefill(self, input_ids: torch.Tensor, exit_layer: int, on_exit=None):
        """A prompt (1, T) into the reset cache in one pass, as it is (no graph): (ℓe states, the last position's
        logits, the final states), as `Target.prefill`."""
        self.cache.reset()
        exit_hidden, x = self.prefix(input_ids, exit_layer, graph=False)
        if on_exit is not None:
            on_exit(exit_hidden)
        final = self._final(x, exit_hidden, exit_layer)
        return exit_hidden, self.target.logits(final[:, -1]), final  # the LM head on the last row alone

    def _state(self, hidden, positions, mask):
        from mirror_train.target import PrefixState

        target = self.target
        typed = ("full_attention",) if target._typed_rotary else ()
        rope = target.decoder.rotary_emb(hidden, positions, *typed)
        return PrefixState(hidden, 0, self.cache, positions, {"full_attention": mask}, {"full_attention": rope})

    def _prefix(self, x: _Inputs, exit_layer: int) -> torch.Tensor:
        target = self.target
        self.cache.write = x.write
        state = self._state(target.decoder.embed_tokens(x.ids), x.positions, x.mask)
        return target.run_layers(state, target.decoder.layers, range(exit_layer))

    def _final(self, x: _Inputs, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """Layers ℓe+1..N and the final norm over the window `x` from its ℓe states."""
        target = self.target
        self.cache.write = x.write
        state = self._state(hidden, x.positions, x.mask)
        return target.decoder.norm(
            target.run_layers(state, target.decoder.layers, range(exit_layer, target.num_layers))
        )

    def _suffix(self, x: _Inputs, hidden: torch.Tensor, exit_layer: int):
        final = self._final(x, hidden, exit_layer)
        return self.target.logits(final), final

    def _run(self, key: tuple, fn, graph: bool = True):
        if not (graph and self.graphs) or key[1] > MAX_GRAPH_ROWS:
            return fn()
        if key not in self._runs:
            try:
                self._runs[key] = self._capture(key, fn)
            except RuntimeError as err:  # a capture this build or model cannot make: the same step, run as it is
                warnings.warn(
                    f"CUDA graph capture failed ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                    "the target's windows run without graphs from here",
                    stacklevel=2,
                )
                self.graphs = False
                self._runs.clear()
                self._outputs.clear()
                return fn()
        self._runs[key].replay()
        return self._outputs[key]

    def _capture(self, key: tuple, fn):
        """`fn` warmed up twice on a side stream, then captured (PyTorch's recipe). The warm-ups compute what the
        replay will: every input is this step's, and a pass writes the same rows to the same cache positions."""
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._outputs[key] = fn()
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        self.captured += 1
        return graph
