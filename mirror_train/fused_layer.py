"""The served float32 target's decoder layers as one C call each (kernels.decoder_layer), on a CPU.

A one-token step of a small model on a CPU is mostly weight streaming, and what is not is Python: per layer ~40 torch
ops (two RMSNorms, the rotary, SiLU, the residual adds, views and transposes), seven linear calls through their
modules, the cache update and the attention interface. On the testbed that was ~5 ms of a ~23 ms one-token step on a
Zen 5 core (docs/engine.md, sixteenth session), against a weight-streaming floor of ~14 ms. Here a supported layer
(pre-norm RMSNorm, rotary q/k, grouped-query attention, SiLU-gated MLP: Llama, Mistral without a sliding window,
Qwen2) runs norm, projections, rotary, the cache write, attention, MLP and residuals in one call, every step a
function of its row alone, so a k-row window is still its k one-token steps bit for bit (`Target.exact_windows`).

Which calls: exactly those the row-exact attention kernel serves (attention.row_exact_kernel: batch 1, float32 on a
CPU, a window of 1..MAX_ROWS rows, a plain causal or forked mask), when the layer's cache is a transformers
DynamicLayer (made to grow in place, kv_cache.py) and nothing needs gradients; anything else (batches, training, a
prompt of more rows) runs the layer's own forward. A prompt's prefill of up to MAX_ROWS rows is such a call on an
empty cache (since the forty-second session: on the two-vCPU Xeon 32 rows took 81 ms here against 118 ms through the
modules, docs/engine.md), so it is also its one-token steps bit for bit; inside a prefill spread over several threads
only up to the rows where that measured faster than the threaded GEMM (`prefill_rows`, fastpath.c_prefill_rows).
The function differs from the module's in the last bits (the norm's sum order, the SiLU's exponential), as the
kernels' linears already do; every method and the transformers peers run the same layers, so every comparison stays
exact (tests/test_kernels.py, tests/test_engine_testbed.py).

A target's run of consecutive fused layers (its prefix, its suffix: `Target.run_layers`) goes further, as one C
call for all of them (`FusedStack`, kernels.decoder_stack): the same layer calls in C, the same bits, one pass
through Python instead of one a layer. transformers' own loop (generate, the benchmark's transformers peers) still
calls the fused layers one by one: the same function, ~2 ms more Python a step on the testbed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from contextlib import contextmanager

import torch
from torch import nn

from mirror_train import attention, kernels, kv_cache
from mirror_train.kv_cache import GrowingLayer

NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # weight * (x * rsqrt(mean(x²) + eps)), no offset
# The keyword arguments the fused call reads (the first four) or need not; with any other one set the module runs.
_KNOWN = (
    "cache",
    "past_key_values",
    "position_embeddings",
    "attention_mask",
    "position_ids",
    "use_cache",
    "output_attentions",
    "cache_position",
)


def supported(layer: nn.Module, config) -> bool:
    """Whether `layer` is the pre-norm Llama-shaped block the C layer computes (and nothing more)."""
    if set(dict(layer.named_children())) != {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if set(dict(attn.named_children())) != {"q_proj", "k_proj", "v_proj", "o_proj"}:
        return False
    if set(dict(mlp.named_children())) - {"act_fn"} != {"gate_proj", "up_proj", "down_proj"}:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n).__name__ not in NORMS or not hasattr(n, "variance_epsilon") for n in norms):
        return False
    if norms[0].variance_epsilon != norms[1].variance_epsilon:  # the C layer takes one
        return False
    if any(type(m).__name__ not in ("Linear", "ExactLinear", "RoutedLinear") for m in _linears(layer)):
        return False
    head_dim = getattr(attn, "head_dim", 0)
    return (
        getattr(config, "hidden_act", None) == "silu"
        and not getattr(config, "sliding_window", None)
        and not getattr(attn, "sliding_window", None)
        and 0 < head_dim <= 512
        and head_dim % 2 == 0
        and attn.q_proj.out_features % head_dim == 0
        and attn.k_proj.out_features % head_dim == 0
    )


def _linears(layer: nn.Module) -> tuple[nn.Linear, ...]:
    """q, k, v, o, gate, up, down: the order the C layer takes them in."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


CAP_ROWS = (1, 4, 8, 16, 32, kernels.MAX_ROWS)  # the chain lengths `cap_rows` times


def cap_rows(model: nn.Module, context: int = 64, repeats: int = 5) -> int:
    """For a draft served `fastest` (its rounding free): the most rows up to which its fused layers' C calls measured
    no slower than its modules' path (routed linears: oneDNN's GEMMs, AMX where the CPU has it) on chains of
    CAP_ROWS new tokens after `context` cached ones; set on its fused layers and returned. A C layer's float32 sums
    are compute-bound past ~16 rows, where a bf16 GEMM may not be (Zen 4: even at 32 rows, docs/engine.md, twentieth
    session). Models without the draft's tree forward keep kernels.MAX_ROWS."""
    layers = [layer for layer in decoder_layers(model) if isinstance(layer, FusedLayer)]
    if not layers or not hasattr(model, "tree_forward") or not hasattr(model, "new_cache"):
        return kernels.MAX_ROWS

    def set_cap(rows: int) -> None:
        for layer in layers:
            layer.max_rows = rows

    # kept per machine for the model's shape (`kernels.per_machine`: ~2 s of every draft process's start, forty-sixth
    # session); a draft only proposes, so a kept cap can cost speed, never the output
    kept = kernels.per_machine(
        f"cap_rows_{shape_key(model)}_{context}",
        lambda: {"rows": _time_cap_rows(model, layers, set_cap, context, repeats)},
        {"rows"},
        lambda v: v["rows"] in (0, *CAP_ROWS),
    )
    set_cap(kept["rows"])
    return kept["rows"]


def shape_key(model: nn.Module) -> str:
    """A short key of what a model's timings depend on: its architecture's sizes and its weights' dtype (not its
    values or its name), for choices kept per machine."""
    c = model.config
    fields = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    fields += ("num_key_value_heads", "vocab_size", "draft_vocab_size", "num_streams", "num_stream_layers")
    shape = [getattr(c, f, None) for f in fields] + [str(next(model.parameters()).dtype)]
    return hashlib.sha256(repr(shape).encode()).hexdigest()[:12]


def _time_cap_rows(model: nn.Module, layers, set_cap, context: int, repeats: int) -> int:
    """`cap_rows` measured: chains of CAP_ROWS new tokens through the C layers and through the modules, in turn."""
    from mirror_train.timing import median_ms

    cache = model.new_cache()
    cap = 0
    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        model(ids, cache=cache, num_streams=0, logits_index=torch.tensor([context - 1]))
        for n in CAP_ROWS:

            def chain(n=n):
                tokens = [i % model.config.vocab_size for i in range(1, n + 1)]  # any ids of its vocabulary
                model.tree_forward(tokens, list(range(-1, n - 1)), cache, logits_index=torch.tensor([n - 1]))
                kv_cache.crop(cache, context)

            times = {}
            for rows in (kernels.MAX_ROWS, 0, kernels.MAX_ROWS, 0):  # alternating: the machine's drift hits both
                set_cap(rows)
                times.setdefault(rows, []).append(median_ms(chain, repeats=repeats, warmup=1))
            if min(times[kernels.MAX_ROWS]) > 1.05 * min(times[0]):
                break
            cap = n
    return cap


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model (its decoder's `layers`, or its own: the draft keeps them)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def install(model: nn.Module, on: bool = True) -> int:
    """Make every supported decoder layer of `model` fused (on) or plain again; returns the number switched on."""
    n = 0
    for layer in decoder_layers(model):
        base = getattr(type(layer), "_plain_class", type(layer))
        if on and kernels.available() and supported(layer, model.config):
            layer.__class__ = _fused_class(base)
            layer.__dict__.pop("_fused_weights", None)
            n += 1
        else:
            layer.__class__ = base
    return n


@functools.cache
def _fused_class(base: type) -> type:
    return type(f"Fused{base.__name__}", (FusedLayer, base), {"_plain_class": base})


# The most rows a prompt's prefill (a call on an empty cache) runs in C: MAX_ROWS, but inside a prefill spread over
# several threads (fastpath.spread) the rows up to which C measured faster than the modules on those threads
# (fastpath.c_prefill_rows): past them the threaded GEMM wins
_prefill_rows = kernels.MAX_ROWS


@contextmanager
def prefill_rows(rows: int):
    """Prefills of more than `rows` rows run the modules within the block."""
    global _prefill_rows
    before, _prefill_rows = _prefill_rows, rows
    try:
        yield
    finally:
        _prefill_rows = before


class FusedLayer(nn.Module):
    """Mixed in before a decoder layer's own class (`install`): its forward takes the C layer where it applies."""

    _plain_class: type
    # the most rows a call runs in C (kernels.MAX_ROWS; a draft's, where the C layer measured slower past fewer rows
    # than oneDNN's GEMMs on this machine: `cap_rows`)
    max_rows: int = kernels.MAX_ROWS

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        fused = None if args else self._fused_call(hidden_states, kwargs)
        if fused is None:
            return super().forward(hidden_states, *args, **kwargs)
        return fused()

    def _fused_call(self, x: torch.Tensor, kwargs: dict):
        """The fused computation as a thunk, or None where the layer's own forward must run (module docstring)."""
        if any(v is not None for k, v in kwargs.items() if k not in _KNOWN):
            return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        rope = kwargs.get("position_embeddings")
        ready = self._ready(x, cache, rope)
        if ready is None:
            return None
        weights, layer, past = ready
        rows = x.shape[1]
        mask = kwargs.get("attention_mask")
        runs = attention._runs(mask)
        if runs is None and not attention._plain_causal_window(mask, rows, past + rows):
            return None

        def run():
            keys, values = layer.reserve(rows)
            out = kernels.decoder_layer(x, weights, rope[0], rope[1], keys, values, past, runs)
            layer.extend(rows)
            return out

        return run

    def _ready(self, x: torch.Tensor, cache, rope):
        """(weights, cache layer, cached length) where the C layer can run over x's rows, else None."""
        if (
            cache is None
            or rope is None
            or x.dtype != torch.float32
            or rope[0].dtype != torch.float32
            or x.device.type != "cpu"
            or x.dim() != 3
            or x.shape[0] != 1
            or not 1 <= x.shape[1] <= self.max_rows
            or x.requires_grad
        ):
            return None
        held = self._held(cache)
        if held is not None and held[2] == 0 and x.shape[1] > _prefill_rows:  # a prefill the threaded GEMM wins
            return None
        return held

    def _held(self, cache):
        """(weights, cache layer, cached length) where this layer's C call can run on `cache`, its inputs apart
        (`_ready` checks those; FusedStack checks them once for all its layers), else None."""
        if self.training or (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())):
            return None  # the module's dropout; no backward in C
        weights = self._weights()
        if weights is None:
            return None
        layer = cache.layers[weights.layer_idx]
        if type(layer).__name__ == "DynamicLayer":  # a cache transformers made (generate): grow it in place
            layer.__class__ = GrowingLayer
        if type(layer) is not GrowingLayer:
            return None
        if not layer.is_initialized or layer.get_seq_length() == 0:  # a prompt's prefill: keys from its own rows
            empty = torch.empty(1, weights.kv_heads, 0, weights.head_dim)
            layer.lazy_initialization(empty, empty)
            layer.keys, layer.values = empty, empty  # the buffers' shape (transformers may leave them 1-D)
        return weights, layer, layer.get_seq_length()

    def _fused_stream_call(self, hidden, streams, rope, mask, cache, anchors):
        """A multi-stream layer's forward (models/multi_stream_attention.py) as one C call, or None where its own
        must run: the main rows, then the stream rows of the K anchors, whose keys the call writes into the cache's
        spare room after the main rows (the cache then counts the main rows only), every row over its own runs of
        keys. Stream (t, j) sees its anchor's keys and streams (t, 1..j): two runs where the anchor's own are one
        (a plain causal window, or a tree node whose ancestors fill the cache up to it); three are beyond the
        kernel, and such a forward runs the module's way. One call reads the layer's weights once for main and
        stream rows alike. Returns (hidden, streams) as the module."""
        T = hidden.shape[1]
        K, S = (0, 0) if streams is None else streams.shape[1:3]
        ready = self._ready(hidden, cache, rope)
        if ready is None or T + K * S > self.max_rows or (K and streams.dtype != torch.float32):
            return None
        weights, layer, past = ready
        runs = attention._runs(mask)
        if runs is None and not attention._plain_causal_window(mask, T, past + T):
            return None
        # the bookkeeping in Python lists, one tensor each at the end: a draft's forward makes this call every
        # step over a handful of rows, where each small torch op costs microseconds
        if runs is None:  # a plain window: row i sees keys 0..past+i
            first = list(range(past + 1, past + T + 1))
            n1, s2, n2 = first, first, [0] * T
        else:
            n1, s2, n2 = runs.tolist()
        rows, (cos, sin) = hidden, rope
        if K:
            idx = range(T) if anchors is None else [i + T if i < 0 else i for i in torch.as_tensor(anchors).tolist()]
            if any(n2[i] for i in idx):
                return None
            n1 = n1 + [n1[i] for i in idx for _ in range(S)]  # the anchor's keys 0..n1-1
            s2 = s2 + [past + T + a * S for a in range(K) for _ in range(S)]  # where each anchor's streams sit
            n2 = n2 + list(range(1, S + 1)) * K
            rows = torch.cat([hidden, streams.reshape(1, K * S, streams.shape[-1])], dim=1)
            at = torch.tensor([*range(T), *(i for i in idx for _ in range(S))])  # each stream at its anchor's rotation
            cos, sin = cos.index_select(1, at), sin.index_select(1, at)
        runs = torch.tensor([n1, s2, n2])
        keys, values = layer.reserve(T + K * S)
        out = kernels.decoder_layer(rows, weights, cos, sin, keys, values, past, runs)
        layer.extend(T)
        return out[:, :T], (out[:, T:].reshape(1, K, S, -1) if K else None)

    def __deepcopy__(self, memo):
        """A copy is a plain layer (as fastpath's copies of its linears are): what it computes is then the module's."""
        clone = self._plain_class.__new__(self._plain_class)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            if key != "_fused_weights":  # addresses into this layer's tensors
                clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone

    def _weights(self) -> kernels.LayerWeights | None:
        """The C call's view of this layer's parameters (None: norms not float32, linears' weights not all float32
        or all bfloat16: a draft served with float32 activations on bfloat16 weights, fastpath.py, or linears read in
        different dtypes: `kernels.layer_weights`), rebuilt when they have moved or changed (a cast, a copy, a load:
        the first projection's storage and version tell; every projection's where the call reads copies of them,
        panels or half-precision ones, which an in-place change of that weight alone would leave stale). Held in the
        instance's __dict__: a module attribute lookup costs a microsecond, and a step makes ~30 of these calls."""
        cached = self.__dict__.get("_fused_weights")
        if cached is not None and all(w.data_ptr() == p and w._version == v for w, p, v in cached[0]):
            return cached[1]
        attn, linears = self.self_attn, _linears(self)
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        weight_dtypes = {m.weight.dtype for m in linears}
        if any(p.dtype != torch.float32 for p in norms) or weight_dtypes not in ({torch.float32}, {torch.bfloat16}):
            return None
        for m in linears:  # the C layer reads (N, K) rows in place
            if not m.weight.is_contiguous():
                m.weight.data = m.weight.data.contiguous()
        eps = float(self.input_layernorm.variance_epsilon)
        heads, kv_heads = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
        scale = float(getattr(attn, "scaling", attn.head_dim**-0.5))
        lw = kernels.layer_weights(
            norms[0].detach(), norms[1].detach(), eps, linears, heads, kv_heads, attn.head_dim, scale, attn.layer_idx
        )
        # moved or changed in place (a load_state_dict): copies made again (kernels.served), the view rebuilt
        served = [kernels.served(m) for m in linears]
        copies = any(rows is not m.weight or panels is not None for m, (rows, panels) in zip(linears, served))
        watched = [m.weight for m in linears] if copies else [attn.q_proj.weight]
        self.__dict__["_fused_weights"] = ([(w, w.data_ptr(), w._version) for w in watched], lw)
        return lw


class FusedStack:
    """Consecutive fused layers of one model run as one C call (`kernels.decoder_stack`): each layer exactly its own
    fused call, the same bits, but one pass through Python for all of them. A step of the testbed made ~30 layer
    calls through the modules (module call, the layer's keyword checks, the cache's bookkeeping), ~2 ms of a
    ~21 ms one-token step on a Zen 4 core, against the C calls alone (docs/engine.md, thirty-second session).
    Built once per run of layers (`Target.run_layers`); a layer's weights are refilled where they moved, its cache
    buffers every call."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.args = (kernels.StackLayer * len(layers))()
        self.weights: list[kernels.LayerWeights | None] = [None] * len(layers)

    def __call__(self, x: torch.Tensor, cache, rope, mask) -> torch.Tensor | None:
        """The layers' output over x (1, M, H), or None where any layer must take its own path (nothing done)."""
        first = self.layers[0]
        ready = first._ready(x, cache, rope)
        if ready is None:
            return None
        past, rows = ready[2], x.shape[1]
        runs = attention._runs(mask)
        if runs is None and not attention._plain_causal_window(mask, rows, past + rows):
            return None
        cache_layers = []
        for j, layer in enumerate(self.layers):  # the first's `_ready` held; each other as its own call would
            if j and rows > layer.max_rows:
                return None
            held = layer._held(cache) if j else ready
            if held is None or held[2] != past:
                return None
            lw = held[0]
            if lw is not self.weights[j]:
                self.args[j].set_weights(lw)
                self.weights[j] = lw
            cache_layers.append(held[1])
        for j, held in enumerate(cache_layers):  # set every step: a new buffer may reuse a freed one's address
            self.args[j].set_cache(*held.reserve(rows))
        scratch = kernels.stack_scratch(self.weights, rows, x.shape[2], past + rows)
        out = kernels.decoder_stack(x, self.args, scratch, rope[0], rope[1], past, runs)
        for held in cache_layers:
            held.extend(rows)
        return out
