"""The fast forward path for a served model: what every method (ar, sd, mirror, pld and the transformers peers) runs.

On a CPU a decoding step of a small model is a few matmuls of 1–16 rows against large weights, and torch's default
float32 path is slow at that shape (docs/engine.md, "The step against the hardware"): its 2–16-row GEMMs cost up to
twice a one-row step that is already bound by reading the weights. Two replacements, swapped in for every
`nn.Linear` of a model in place, keeping its parameters (and what borrows them: a proxy head's LM head, tied
embeddings) untouched:
- `exact` (kernels.py): our own row-exact kernels on a CPU with a C compiler: the linears (float32 or bfloat16
  weights, float32 sums) and, in float32, the attention over the cache. The linear streams each weight row once a
  call whatever the rows, so an 8-token window costs about a one-token step; both compute every output in one
  fixed order, so a window equals its one-token steps bit for bit (`Target.exact_windows`, on every CPU), with one
  attention call a layer instead of one a row. The linears read their weights as rows or as panels (a second,
  interleaved copy: `kernels.layout`, measured once per machine). A float32 model whose weights hold bfloat16 (or
  float16) values only (a half-precision checkpoint loaded in float32, as Hub models served in float32 mostly are)
  is read from copies in that dtype where that measured faster here (`kernels.narrow`): the kernels widen them
  exactly, so the same bits from half the bytes a step streams.
- `onednn`: oneDNN with its weights reordered once into its own blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`), from the row count measured to win per
  layer shape (it loses at 1–2 rows): where the kernels cannot be built.
- `fastest`: for a draft, whose rounding nothing depends on (it only proposes tokens): each layer shape takes, by
  the rows of a call, whichever of torch's path, oneDNN, the row-exact kernel and, for bfloat16 weights where the
  CPU has AVX512-BF16, its dot product on inputs rounded to bfloat16 (`kernels.linear_dot`; the fused layers read
  every linear so where it won for most of the weights) measured fastest at install. A draft's tree forwards run 1
  to ~50 rows, and no one path wins across them (measured: docs/engine.md, twelfth session: the kernel at 1–4 rows,
  oneDNN from ~8 in bf16 on an AMD EPYC; thirty-third: the dot product at nearly every row count on a Zen 4).
Past MAX_ROWS rows (a prompt's prefill) `exact` and `fastest` take whichever of torch's GEMM and oneDNN's (on the
weight as it is, no second copy) measured faster for that layer shape on this machine (`prefill_path`): on an AMD
EPYC Zen 5 torch's MKL GEMM ran at ~100 GFLOP/s and oneDNN's 2.3× that, halving the testbed's prefill (sixteenth
session). Windows never reach it, so they stay row-exact.
Each computes the same function as the plain model, rounding differently in the last bits (float32 logits within
~1e-4). Lossless is unaffected: every method is verified by the same served model, and the engine's output is that
model's own greedy output (tests/test_engine_testbed.py).

`kind`: "auto" (exact for a float32 model on a CPU where the kernels build, else oneDNN on a CPU where torch has it,
else nothing), "exact", "onednn", or "none". A bfloat16 model takes `exact` only when asked: its float32 sums,
rounded once, are a different bf16 function from torch's (the testbed's greedy text changed at the 9th token of a
prompt against transformers' bf16 generate), though its windows are then exact on every CPU.
"""

from __future__ import annotations

import bisect
import functools
import weakref
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from mirror_train import alignment, attention, fused_head, fused_layer, kernels, screened_head
from mirror_train.devices import pinned, resolve_dtype
from mirror_train.errors import MirrorTrainError
from mirror_train.timing import interleaved_median_ms, median_ms

KINDS = ("auto", "exact", "onednn", "fastest", "none")
# the row counts `fastest` measures; a call takes the route of the next one up. 3 and 6: a draft's node with its two
# streams, and two such nodes (at 3 rows the draft's large linears ran 8–23% faster on the route measured there, Zen 4)
ROUTE_ROWS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
# `fastest` times each path on weights that come from memory, as in serving (between two calls of a draft's linear
# the rest of the draft and the target's step stream through the caches): it cycles through copies of the weight
# totalling this many bytes (at most ROUTE_COPIES copies). Timed on one hot weight instead, oneDNN's bf16 linear won
# shapes that it loses cold by 1.1–1.9× on a Zen 4 (docs/engine.md, nineteenth session).
ROUTE_COLD_BYTES = 128 * 2**20
ROUTE_COPIES = 256


def resolve(kind: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The path `kind` means for a model on `device` computing in `dtype` (None: not known yet, e.g. "auto" for a
    draft whose precision is chosen later)."""
    if kind not in KINDS:
        raise MirrorTrainError(f"fast_path must be one of {', '.join(KINDS)}, got {kind!r}")
    device = torch.device(device)
    onednn = device.type == "cpu" and onednn_packs(dtype or torch.float32)
    kernel = device.type == "cpu" and dtype in (None, *kernels.WEIGHT_DTYPES) and kernels.available()
    if kind == "onednn" and not onednn:
        where = f"{device}" if device.type != "cpu" else f"this CPU ({dtype or torch.float32})"
        raise MirrorTrainError(f"fast_path=onednn needs a CPU whose oneDNN packs the model's dtype; not on {where}")
    if kind == "fastest":  # a choice among what is there: torch's path always is
        return kind if device.type == "cpu" else "none"
    if kind == "exact" and not kernel:
        why = (
            "a float32 or bfloat16 model on a CPU"
            if device.type != "cpu" or dtype not in (None, *kernels.WEIGHT_DTYPES)
            else "a C compiler (cc) to build it once"
        )
        raise MirrorTrainError(f"fast_path=exact needs {why}")
    if kind == "auto":  # bf16: torch's own rounding kept (the kernels' float32 sums change a bf16 model's greedy text)
        return "exact" if kernel and dtype in (None, torch.float32) else "onednn" if onednn else "none"
    return kind


def for_draft(kind: str) -> str:
    """The kind a draft is served with when the engine's setting is `kind`: "auto" means the fastest path per call,
    since a draft's rounding changes only what it proposes, never the output."""
    return "fastest" if kind == "auto" else kind


def draft_dtype(name: str, device: torch.device | str, kind: str = "auto") -> torch.dtype:
    """The precision a draft is served in when the engine's `draft_dtype` is `name` and its `draft_fast_path` is
    `kind`: "auto" is bfloat16 where bf16 matmuls are fast (`devices.fast_bf16`: AMX, AVX-512 BF16, CUDA) and, on
    a CPU, also wherever the draft's layers run on the kernels (`fastest` with the kernels built): their sums are
    float32 over bf16 weights widened exactly on load, so bf16 only halves the bytes a forward streams, and is the
    faster there even on an AVX2-only CPU, where torch's bf16 matmuls are slow (measured: docs/engine.md,
    twenty-sixth session)."""
    device = torch.device(device)
    if name == "auto" and device.type == "cpu" and for_draft(kind) == "fastest" and kernels.available():
        return torch.bfloat16
    return resolve_dtype(name, device)


def install(model: nn.Module, kind: str = "auto") -> str:
    """Swap `model`'s linear layers for the fast path in place (idempotent); returns the kind installed. Install it
    on the model as served: a later cast or copy computes on the plain path.

    onednn: which path is faster depends on the rows of a call and on the machine (measured on an AMX Xeon: oneDNN
    24% slower for one row, 10–25% faster from 4 rows on, docs/engine.md), so each layer takes the prepacked path
    from the row count measured here to win for that layer's shape, and torch's own path below it."""
    param = next(model.parameters(), None)
    if param is None:  # nothing to swap (a logit-lens proxy head)
        resolve(kind, "cpu")
        return "none"
    kind = resolve(kind, param.device, param.dtype)
    if kind == "none":
        fused_layer.install(model, False)
        return kind
    alignment.align_parameters(model)  # a draft as loaded: weights that straddle lines, 4 KiB pages (alignment.py)
    if kind == "fastest" and _widen_activations(model):
        param = next(model.parameters())
    attention.use_kernel(model, kind == "exact")
    # whole decoder layers as one C call each, where they apply (a draft's: float32 activations, _widen_activations)
    fused_layer.install(model, kind in ("exact", "fastest"))
    attention.use_draft_attention(model, kind == "fastest")
    linears = [m for m in model.modules() if type(m) in (nn.Linear, PackedLinear, ExactLinear, RoutedLinear)]
    if not linears:
        return kind
    for module in linears:
        # an earlier install's state (a screen stays where this install serves the head as it did: `exact` below)
        for key in ("_packed", "_packed_dtype", "min_rows", "routes", "_panels", "_narrow", "_dot") + (
            ("_screen",) * (kind != "exact")
        ):
            module.__dict__.pop(key, None)
        if kind in ("exact", "fastest"):  # timed now, not inside the first request
            prefill_path(tuple(module.weight.shape), module.bias is not None, module.weight.dtype)
    panels = kind in ("exact", "fastest") and kernels.available() and kernels.layout() == "panels"
    if kind in ("exact", "fastest") and kernels.available():
        kernels.tune_prefetch()  # which panel tiles prefetch ahead: measured once per machine, set once per process
    if kind == "exact":
        for module in linears:
            module.__class__ = ExactLinear
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        # float32 weights holding bfloat16 (else float16) values only (a bfloat16 or float16 checkpoint served in
        # float32) are read from copies in that dtype, in the layout it measured fastest in, where that measured
        # faster here: the same bits from half the bytes (kernels.serve_narrow). The decoder's all or none (a fused
        # layer reads its seven linears in one dtype); the LM head's where its values are that dtype's too
        readable = [m for m in linears if m.weight.dtype in kernels.WEIGHT_DTYPES]
        body = [m for m in readable if m is not head]
        narrow = next(
            (
                dtype
                for dtype in kernels.NARROW_DTYPES
                if body and kernels.narrow(dtype) and all(kernels.exact_in(m.weight, dtype) for m in body)
            ),
            None,
        )
        if narrow is not None:
            panels = kernels.layout(narrow) == "panels"  # float16 copies: rows only
        if panels:
            kernels.serve_panels(*readable, narrow=narrow is not None)
        elif narrow is not None:
            kernels.serve_narrow(*readable, dtype=narrow)
        if isinstance(head, ExactLinear) and screened_head.screen_of(head) is None:
            screened_head.build(head)  # greedy tokens through an int8 or bfloat16 screen, where it pays (measured here)
        return kind
    if kind == "fastest":
        paths = ["torch"]
        paths += ["onednn"] if onednn_packs(linears[0].weight.dtype) else []
        paths += ["exact"] if param.dtype in kernels.WEIGHT_DTYPES and kernels.available() else []
        # bfloat16 weights on AVX512-BF16's dot product, the inputs rounded to bfloat16 (a draft only proposes), read
        # from their panels: at 8-48 rows ~1.5-2x the widening kernel's speed on a Zen 4 core (thirty-third session)
        dot = "exact" in paths and all(m.weight.dtype == torch.bfloat16 for m in linears) and kernels.screen_dot()
        paths += ["dot"] if dot else []
        routes: dict[tuple, tuple[str, ...]] = {}
        if dot or (panels and "exact" in paths):  # every contiguous weight's (read in place), one arena
            kernels.serve_panels(*[m for m in linears if m.weight.is_contiguous()])
        for module in linears:
            module.__class__ = RoutedLinear
            if "onednn" in paths:
                module.repack()
            contiguous = module.weight.is_contiguous()  # the kernel reads (N, K) rows in place
            shape = (tuple(module.weight.shape), module.bias is not None, module.weight.dtype, contiguous)
            if shape not in routes:
                routes[shape] = _routes(
                    module, [p for p in paths if p not in ("exact", "dot") or contiguous], param.dtype
                )
            module.routes = routes[shape]
        # the fused layers read their linears on the dot product where the routes took it for most of the weights'
        # calls up to 16 rows (by weight size: a small k or v projection's timings are mostly noise)
        upto = ROUTE_ROWS.index(16) + 1
        share = sum(m.weight.numel() * m.routes[:upto].count("dot") for m in linears)
        for module in linears:
            module.__dict__["_dot"] = dot and share * 2 > upto * sum(m.weight.numel() for m in linears)
        for layer in fused_layer.decoder_layers(model):  # an earlier install's read mode
            layer.__dict__.pop("_fused_weights", None)
        fused_layer.cap_rows(model)  # after the routes: the modules' path it is timed against is theirs
        return kind
    crossovers: dict[tuple, float] = {}
    for module in linears:
        module.__class__ = PackedLinear
        module.repack()
        shape = (tuple(module.weight.shape), module.bias is not None, module.weight.dtype)
        if shape not in crossovers:  # a Llama has ~6 shapes of linear layer
            crossovers[shape] = _crossover(module)
        module.min_rows = crossovers[shape]
    return kind


def install_head(head: nn.Module, kind: str, weights: str = "served") -> None:
    """`install` on a proxy head and on its LM head, which it holds apart from its modules (the target's rows, or its
    candidate vocabulary's): where it runs, on the draft's side or beside the target, it only proposes. weights:
    what its C call reads (EngineConfig.head_weights)."""
    installed = [install(module, kind) for module in (head.requires_grad_(False), head.lm_head)]
    # its candidates as one C call where the kernels serve it (fused_head.py): the torch path's ~30 operations ran
    # cold on the draft's side
    fused_head.install(head, any(k in ("exact", "fastest") for k in installed), weights)


def _widen_activations(model: nn.Module) -> bool:
    """Serve a half-precision draft with float32 activations on its half-precision linear weights, on a CPU with
    the kernels, where its decoder layers are ones the C layer computes: everything but the linears' weights (and
    biases) is widened to float32, exactly, so the KV cache and every sum are float32 and each decoder layer runs
    as one C call reading the half-precision weights (fused_layer.py), where torch's ~40 ops a layer and its
    linears' calls cost ~2/3 of the draft's forward (docs/engine.md, twentieth session). The draft's rounding
    changes only what it proposes. Returns whether it widened."""
    param = next(model.parameters())
    layers = fused_layer.decoder_layers(model)
    if (
        param.dtype != torch.bfloat16  # the kernels read float32 or bfloat16 weights
        or param.device.type != "cpu"
        or not kernels.available()
        or not layers
        or not all(fused_layer.supported(layer, model.config) for layer in layers)
    ):
        return False
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    heads = {id(m.weight) for m in linears}
    for module in [m for m in model.modules() if not isinstance(m, nn.Linear)]:
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_floating_point():
                continue
            if id(p) in heads:  # an embedding tied to the LM head: its own float32 copy, the head keeps bf16
                setattr(module, name, nn.Parameter(p.detach().float(), requires_grad=p.requires_grad))
            else:
                p.data = p.data.float()
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                setattr(module, name, b.float())
    return True


def _crossover(linear: PackedLinear, rows=(1, 2, 4, 8, 16)) -> float:
    """The fewest rows from which the prepacked path is faster than torch's own on `linear` (inf: never)."""
    faster = []
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(1, n, linear.in_features, dtype=linear.weight.dtype)
            plain = median_ms(lambda x=x: nn.functional.linear(x, linear.weight, linear.bias), repeats=15, warmup=3)
            packed = median_ms(lambda x=x: linear.packed(x), repeats=15, warmup=3)
            faster.append(packed < plain)
    for i, n in enumerate(rows):
        if all(faster[i:]):
            return n
    return float("inf")


def _routes(
    linear: RoutedLinear, paths: Sequence[str], activations: torch.dtype | None = None, cold: bool = True
) -> tuple[str, ...]:
    """The fastest of `paths` on `linear` at each of ROUTE_ROWS rows (`_time_routes`), measured once per machine
    for its shape, dtypes and paths and kept beside the kernel library (`kernels.per_machine`): timing a draft's and a
    proxy head's ~9 shapes took ~7.6 s of every draft process's start (forty-sixth session, AMX Xeon), and every
    process then serves the same routes. Routes only choose among paths that compute the draft's proposals (it
    only proposes), so a kept choice can cost speed, never the output."""
    weight = linear.weight
    act = activations or weight.dtype
    panels = kernels.panels_of(linear) is not None
    name = "routes_{}x{}_{}_{}_{}_{}_{}_{}".format(
        *weight.shape,
        str(weight.dtype).removeprefix("torch."),
        str(act).removeprefix("torch."),
        "bias" if linear.bias is not None else "nobias",
        "+".join(paths),
        "cold" if cold else "hot",
        "panels" if panels else "rows",
    )
    kept = kernels.per_machine(
        name,
        lambda: {"routes": list(_time_routes(linear, paths, activations, cold))},
        {"routes"},
        lambda v: len(v["routes"]) == len(ROUTE_ROWS) and all(r in paths for r in v["routes"]),
    )
    return tuple(kept["routes"])


def _time_routes(
    linear: RoutedLinear, paths: Sequence[str], activations: torch.dtype | None = None, cold: bool = True
) -> tuple[str, ...]:
    """The fastest of `paths` on `linear` at each of ROUTE_ROWS rows (medians of a few calls each) on inputs of
    the `activations` dtype (default: the weight's), each call on the next of its copies of the weight (`cold`:
    ROUTE_COLD_BYTES of them, so every call reads its weight from memory as served; else the weight itself, hot in
    the caches)."""
    weight, bias = linear.weight.detach(), linear.bias
    count = 1
    if cold:
        count = max(1, min(ROUTE_COPIES, ROUTE_COLD_BYTES // max(1, weight.numel() * weight.element_size())))
    copies = alignment.pack([weight] * count) if count > 1 else [weight]  # on huge pages, as served
    packed = []
    if "onednn" in paths:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in copies] if count > 1 else [linear._packed]
    panels = [None] * count
    if ("exact" in paths or "dot" in paths) and kernels.panels_of(linear) is not None:  # timed as served: on panels
        panels = alignment.pack([kernels.to_panels(w) for w in copies])
    turn = [0]  # one counter for every timed call: a copy is read again only after all the others

    def call(x: torch.Tensor, path: str) -> torch.Tensor:
        i = turn[0] = (turn[0] + 1) % count
        return run_path(path, x, copies[i], packed[i] if packed else None, bias, panels[i])

    best = []
    with torch.inference_mode():
        for n in ROUTE_ROWS:
            x = torch.randn(1, n, linear.in_features, dtype=activations or weight.dtype)
            times = {path: median_ms(lambda x=x, path=path: call(x, path), repeats=7, warmup=2) for path in paths}
            best.append(min(times, key=times.get))
    return tuple(best)


def routes(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each routed linear's path by ROUTE_ROWS (`fastest`), by module name: what the install measured."""
    return {name: m.routes for name, m in model.named_modules() if isinstance(m, RoutedLinear)}


def installed(model: nn.Module) -> bool:
    return any(isinstance(m, (PackedLinear, ExactLinear, RoutedLinear)) for m in model.modules())


# what `describe` may name besides the path, in the order the records give them
DESCRIBED = ("layout", "weights_read", "head_screen", "panel_prefetch", "panel_prefetch_distance", "panel_one_row")


def record(model: nn.Module) -> dict:
    """`describe`'s keys (DESCRIBED) for a benchmark's JSON, each present (None where it does not apply), the layout
    named `kernel_layout` as those records have named it."""
    described = describe(model)
    return {("kernel_layout" if k == "layout" else k): described.get(k) for k in DESCRIBED}


def describe(model: nn.Module) -> dict:
    """How a model's linears are served, for the records that name where a figure came from: the path (exact,
    onednn, fastest, none), and on the kernels the layout and the dtype their weights are read in (bfloat16 for a
    bf16-valued float32 model's copies: kernels.serve_narrow), on panels which tile heights prefetch (a mask, bit R
    for R rows), how many bytes ahead and how many panels a one-row call streams at once (kernels.tune_prefetch),
    and the LM head's screen where one is built."""
    kinds = {ExactLinear: "exact", PackedLinear: "onednn", RoutedLinear: "fastest"}
    linears = [m for m in model.modules() if type(m) in kinds]
    if not linears:
        return {"fast_path": "none"}
    first = linears[0]
    record = {"fast_path": kinds[type(first)]}
    if record["fast_path"] != "onednn" and first.weight.dtype in kernels.WEIGHT_DTYPES and kernels.available():
        rows, panels = kernels.served(first)
        record["layout"] = "rows" if panels is None else "panels"
        record["weights_read"] = str((rows if panels is None else panels).dtype).removeprefix("torch.")
        if panels is not None and kernels.has("panel_prefetch_distance"):  # how the panels prefetch (measured here)
            streaming = kernels.panel_streaming(record["weights_read"])
            record["panel_prefetch"] = hex(streaming["mask"])
            record["panel_prefetch_distance"] = streaming["distance"]
            record["panel_one_row"] = "single" if streaming["single"] else "eight"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    screen = screened_head.screen_of(head) if isinstance(head, nn.Module) else None
    if screen is not None:  # greedy tokens through it (screened_head.KINDS)
        record["head_screen"] = screen.kind
    return record


def _plain_copy(module: nn.Linear, memo: dict, drop: tuple[str, ...]) -> nn.Linear:
    """A deep copy (`Target.cast`) is a plain nn.Linear: the fast path belongs to the model as served."""
    import copy

    clone = nn.Linear.__new__(nn.Linear)
    memo[id(module)] = clone
    for key, value in module.__dict__.items():
        if key not in drop:
            clone.__dict__[key] = copy.deepcopy(value, memo)
    return clone


def _needs_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call must be differentiable: the kernel and oneDNN's ops have no backward, so gradients to the
    input (through a frozen layer) or to the weight take torch's path."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


# The intra-op threads of the prompt's prefill running now (`spread`), 0 outside one: its linears of many rows take
# the threaded GEMM from the row count where it beats the one-thread row-exact kernel (`spread_rows`)
_spread_threads = 0
SPREAD_MIN_ROWS = 8  # fewer rows (the prefill's LM head row) stay on the kernel: a GEMM is not worth its threads


@contextmanager
def spread(layout: tuple[set[int] | None, int], model: nn.Module | None = None):
    """A prompt's prefill spread over `layout` = (cores, threads) (EngineConfig.prefill_layout, devices.pinned):
    `model`'s C layers take it up to the rows where they measured faster than its modules on those threads
    (`c_prefill_rows`), and past them its linears run torch's threaded GEMM (`prefill_linear`; where no C layer
    serves, from `spread_rows` rows) rather than the one-thread row-exact kernel. A prefill is every method's alike
    and never a window (windows stay row-exact)."""
    global _spread_threads
    before = _spread_threads
    rows = c_prefill_rows(model, layout) if model is not None else kernels.MAX_ROWS
    with pinned(*layout), fused_layer.prefill_rows(rows):
        _spread_threads = layout[1]
        try:
            yield
        finally:
            _spread_threads = before


_c_prefill: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {threads: rows}
C_PREFILL_ROWS = (kernels.MAX_ROWS, 32, 16, 8)  # the prompt lengths `c_prefill_rows` times, longest first


def c_prefill_rows(model: nn.Module, layout: tuple[set[int] | None, int], repeats: int = 3) -> int:
    """The most rows (of C_PREFILL_ROWS, else 0) up to which `model`'s prefill through its C layers (one thread,
    fused_layer.py) measured no slower than through its modules spread over `layout` (the threaded GEMM), on random
    ids, the two timed in turn; once per machine for the model's shape and thread count (the engine asks at its
    start, before any prefill, so every method prefills alike; timing it took ~2.5 s for the testbed). On the
    two-vCPU AMX Xeon C took 81 ms against 102 ms at 32 rows and tied at 64 (docs/engine.md, forty-second
    session); with more cores the GEMM should win sooner. A model without C layers: MAX_ROWS (nothing to choose)."""
    known = _c_prefill.setdefault(model, {})
    if layout[1] in known:
        return known[layout[1]]
    if not any(isinstance(layer, fused_layer.FusedLayer) for layer in fused_layer.decoder_layers(model)):
        return kernels.MAX_ROWS
    # Kept per machine for the model's shape and the threads (`kernels.per_machine`: ~2.5 s of every engine's
    # start on the testbed, forty-sixth session): every method and now every process prefills through the same choice
    name = f"c_prefill_{fused_layer.shape_key(model)}_{layout[1]}threads"
    kept = kernels.per_machine(
        name,
        lambda: {"rows": _time_c_prefill_rows(model, layout, repeats)},
        {"rows"},
        lambda v: v["rows"] in (0, *C_PREFILL_ROWS),
    )
    known[layout[1]] = kept["rows"]
    return kept["rows"]


def _time_c_prefill_rows(model: nn.Module, layout: tuple[set[int] | None, int], repeats: int) -> int:
    """`c_prefill_rows` measured: the prefill through the C layers and through the modules, timed in turn."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    cap = 0
    with torch.inference_mode(), spread(layout):  # the modules' side as a spread prefill runs them
        for rows in C_PREFILL_ROWS:
            ids = torch.randint(0, vocab, (1, rows), generator=torch.Generator().manual_seed(rows))

            def prefill(ids=ids):
                model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)

            def capped(cap_rows: int, fn=prefill):
                with fused_layer.prefill_rows(cap_rows):
                    fn()

            fns = {cap_rows: functools.partial(capped, cap_rows) for cap_rows in (kernels.MAX_ROWS, 0)}
            times = interleaved_median_ms(fns, repeats=repeats, warmup=1)  # the machine's drift hits both
            if times[kernels.MAX_ROWS] <= times[0]:
                cap = rows
                break
    return cap


@functools.cache
def spread_rows(shape: tuple[int, int], bias: bool, dtype: torch.dtype, threads: int) -> int:
    """The fewest rows from which the prefill's GEMM (`prefill_linear` on `threads` threads: called inside `spread`)
    beats the one-thread row-exact kernel for a layer shape, timed once per process at 64, 32, 16 and 8 rows on
    random weights (the kernel streams its weights on one core; on the two-vCPU AMX Xeon the GEMM on two threads won
    from 8 to 32 rows by the testbed's shapes, docs/engine.md, forty-second session); past MAX_ROWS where it never
    does. The target's C layers take a short prefill first (fused_layer.py, `c_prefill_rows`); this serves the
    prefills between their limit and MAX_ROWS rows, and layers the C call does not serve."""
    n, k = shape
    crossover = kernels.MAX_ROWS + 1
    with torch.inference_mode():
        w, b = torch.randn(n, k, dtype=dtype), (torch.randn(n, dtype=dtype) if bias else None)
        for rows in (64, 32, 16, SPREAD_MIN_ROWS):  # from the most rows down: the GEMM's lead shrinks with fewer
            x = torch.randn(1, rows, k, dtype=torch.float32)
            gemm = median_ms(lambda x=x: prefill_linear(x, w, b), repeats=3, warmup=1)  # on `threads` (spread)
            if gemm >= median_ms(lambda x=x: kernels.linear(x, w, b), repeats=3, warmup=1):
                break
            crossover = rows
    return crossover


class ExactLinear(nn.Linear):
    """An nn.Linear whose inference forward runs the row-exact kernel (kernels.py) for float32 or bfloat16 CPU calls
    of up to `kernels.MAX_ROWS` rows; a prompt's prefill takes the GEMM measured faster here (`prefill_path`), and
    one spread over several threads (`spread`) from the rows where the threaded GEMM wins (`spread_rows`);
    anything else (training, another dtype or device) takes torch's path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype not in kernels.WEIGHT_DTYPES or x.device.type != "cpu" or not w.is_contiguous() or _needs_grad(x, w):
            return nn.functional.linear(x, w, self.bias)
        if x.numel() > kernels.MAX_ROWS * self.in_features:
            return prefill_linear(x, w, self.bias)
        if _spread_threads > 1 and x.numel() >= SPREAD_MIN_ROWS * self.in_features:
            shape = (tuple(w.shape), self.bias is not None, w.dtype, _spread_threads)
            if x.numel() >= spread_rows(*shape) * self.in_features:
                return prefill_linear(x, w, self.bias)
        rows, panels = kernels.served(self)  # the weight, or its bfloat16 copy (kernels.serve_narrow); its panels
        return kernels.linear(x, rows, self.bias, panels)

    def __deepcopy__(self, memo):
        return _plain_copy(self, memo, ("_panels", "_narrow", "_screen"))


PREFILL_ROWS = 2 * kernels.MAX_ROWS  # the rows `prefill_path` times a layer shape at


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on the weight as stored (it reorders internally; no prepacked copy kept)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def run_path(
    path: str, x: torch.Tensor, weight: torch.Tensor, packed, bias: torch.Tensor | None, panels=None
) -> torch.Tensor:
    """One linear call on a `fastest` route: the row-exact kernel on `weight` (on its `panels` where given), the dot
    product on its bfloat16 `panels`, oneDNN on its prepacked copy `packed`, or torch's own."""
    if path == "exact":
        return kernels.linear(x, weight, bias, panels)
    if path == "dot":
        return kernels.linear_dot(x, weight.shape[0], panels, bias)
    if x.dtype != weight.dtype:  # float32 activations on half-precision weights (_widen_activations)
        return run_path(path, x.to(weight.dtype), weight, packed, bias).to(x.dtype)
    if path == "onednn":
        return onednn_linear(x, packed, bias)
    return nn.functional.linear(x, weight, bias)


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A many-row CPU linear (a prompt's prefill) on the GEMM measured faster for its shape on this machine; the
    result in x's dtype."""
    path = prefill_path(tuple(weight.shape), bias is not None, weight.dtype)
    if path == "float32":  # half-precision weights widened for this call: torch's float32 GEMM
        b = bias.float() if bias is not None else None
        return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)
    h = x.to(weight.dtype)
    out = onednn_linear(h, weight, bias) if path == "onednn" else nn.functional.linear(h, weight, bias)
    return out.to(x.dtype)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN prepacks linear weights of `dtype`: its bf16 path needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, so on an AVX2-only CPU (an AMD EPYC Zen 3) `_reorder_linear_weight` raises for bf16 weights."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


@functools.cache
def prefill_path(shape: tuple[int, int], bias: bool, dtype: torch.dtype) -> str:
    """Which GEMM is the fastest for PREFILL_ROWS rows of this layer shape, timed once per process (a property of
    the machine and the shape, not of the weights: random ones of that shape are timed): "onednn", "torch", or for
    half-precision weights "float32" (widened each call, the widening timed with it). A bf16 draft served on the
    kernels (`draft_dtype`) prefills its prompt here, and where bf16 matmuls are emulated (AVX2 only) torch's and
    oneDNN's bf16 GEMMs lose to widening (docs/engine.md, twenty-sixth session)."""
    n, k = shape
    with torch.inference_mode():
        x, w = torch.randn(1, PREFILL_ROWS, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        b = torch.randn(n, dtype=dtype) if bias else None
        times = {"torch": median_ms(lambda: nn.functional.linear(x, w, b), repeats=3, warmup=1)}
        if torch.backends.mkldnn.is_available():
            try:
                times["onednn"] = median_ms(lambda: onednn_linear(x, w, b), repeats=3, warmup=1)
            except RuntimeError:  # a oneDNN build without this op or dtype
                pass
        if dtype != torch.float32:
            bf = b.float() if bias else None
            times["float32"] = median_ms(lambda: nn.functional.linear(x.float(), w.float(), bf), repeats=3, warmup=1)
    return min(times, key=times.get)


class PackedLinear(nn.Linear):
    """An nn.Linear whose inference forward reads a oneDNN-prepacked copy of its weight (same parameters) for calls
    of at least `min_rows` rows."""

    min_rows: float = 1

    def repack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self._packed_dtype = self.weight.dtype

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self._packed, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.__dict__.get("_packed")
        plain = packed is None or x.dtype != self._packed_dtype or x.device.type != "cpu"
        plain = plain or x.numel() < self.min_rows * self.in_features
        if plain or _needs_grad(x, self.weight):  # training, a cast copy: the plain path
            return nn.functional.linear(x, self.weight, self.bias)
        return self.packed(x)

    def __deepcopy__(self, memo):
        return _plain_copy(self, memo, ("_packed", "_packed_dtype", "min_rows", "_panels"))


class RoutedLinear(PackedLinear):
    """An nn.Linear whose inference calls on a CPU take, by their rows, the path `routes` names (one per ROUTE_ROWS
    entry, the next one up; torch's beyond the last); training and other devices take torch's path."""

    routes: tuple[str, ...] = ()

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        panels = kernels.panels_of(self) if path in ("exact", "dot") else None
        return run_path(path, x, self.weight, self.__dict__.get("_packed"), self.bias, panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        w = self.weight
        if not self.routes or x.device.type != "cpu" or _needs_grad(x, w):
            return nn.functional.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        if rows > ROUTE_ROWS[-1]:
            return prefill_linear(x, w, self.bias)
        return self.run(x, self.routes[bisect.bisect_left(ROUTE_ROWS, rows)])

    def __deepcopy__(self, memo):
        return _plain_copy(self, memo, ("_packed", "_packed_dtype", "min_rows", "routes", "_panels", "_dot"))
