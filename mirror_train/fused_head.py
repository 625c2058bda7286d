"""A per-position proxy head's candidates as one C call (csrc/proxy_head.c), where the head runs on a CPU.

`ProxyHead.window_candidates` is ~30 small torch operations (the adapter's norm and MLP, the final norm, the LM head's
candidate rows, the log-softmax, top-κ and the window's log-probs). On the draft's side each runs cold, after the
target's weight stream on the other core has evicted the interpreter's working set from the shared L3: 3.1–3.3 ms a
step against ~1.1 ms warm, all of it out of the branch rollout's deadline (docs/engine.md, thirty-seventh session).
One call reads the same weights as the fast path serves them (their panels, on the dot product where the fast path
marked them so) with float32 activations, or int8 copies of them (EngineConfig.head_weights): its 16,384 candidate
rows in bfloat16 are 19 MB that stream on the draft's core beside the target's weights on the other, and the call's
time comes out of the branch rollout's; in int8 on AVX512-VNNI's dot product of byte quads (csrc/linear_q8.c), half
the bytes and half the instructions. The head only proposes: its ranking may differ from torch's in the last bits
(near-ties), or by what int8 rounds, never the target's output.

`install` marks a head (`fastpath.install_head` does, with the kernels built); `window_candidates` answers for a
marked head or returns None (the caller takes torch's path): kinds other than `mlp` and `lens`, a final norm the C
code does not compute, other devices, rows it cannot bound.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from mirror_train import kernels
from mirror_train.fused_layer import NORMS

KINDS = ("mlp", "lens")
INT8 = 3  # the C call's weight type for int8 rows with a scale per row (csrc/proxy_head.c)


def supported(head: nn.Module) -> bool:
    """A bound per-position head the C call computes: the MLP adapter or none, a Llama-style final norm, on a CPU."""
    norm = getattr(head, "_norm", None)
    lm = getattr(head, "_head", None)
    return (
        kernels.available()
        and getattr(getattr(head, "cfg", None), "kind", None) in KINDS
        and norm is not None
        and type(norm).__name__ in NORMS
        and hasattr(norm, "variance_epsilon")
        and lm is not None
        and lm.proj.weight.device.type == "cpu"
        and lm.proj.weight.dtype in kernels.READ_TYPES
        and (head.cfg.kind == "lens" or type(head.pre_norm).__name__ == "_RMSNorm")
    )


WEIGHTS = ("auto", "served", "int8")


def resolve_weights(weights: str) -> str:
    """EngineConfig.head_weights on this machine: "auto" is int8 where AVX512-VNNI's dot product is built."""
    if weights not in WEIGHTS:
        raise ValueError(f"head weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "auto":
        return "int8" if kernels.available() and kernels.q8_dot() else "served"
    return weights


def install(head: nn.Module, on: bool = True, weights: str = "served") -> bool:
    """Mark `head` to answer `window_candidates` in one C call (on) or never (off); returns whether it is marked.
    weights (`resolve_weights`): "served" reads its linears as the fast path serves them; "int8" reads int8 copies
    (`quantize_panels` on the dot product of byte quads, else `quantize_rows` widened), half bfloat16's bytes."""
    weights = resolve_weights(weights)
    head.__dict__.pop("_fused_head", None)
    if on and supported(head):
        head.__dict__["_fused_head"] = None  # the call's view, made at the first call (`_view`)
        head.__dict__["_head_weights"] = weights
        if weights == "int8":  # its copies made now (tens of ms), not in the first step's branch rollout
            _view(head)
        return True
    return False


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scale per row) with weight ≈ q · scale: each row's largest magnitude maps to 127, rounded
    to nearest (an all-zero row gets scale 1). The head only proposes, so the rounding moves near-ties in its
    ranking, never the output."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def quantize_panels(weight: torch.Tensor, lanes: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_rows` laid out for csrc/linear_q8.c: (panels, scales, row sums), the N rows zero-padded to whole
    panels of `lanes` and K to whole quads; panel p holds rows lanes·p.. as K/4 vectors of `lanes` rows × 4 k."""
    q, scale = quantize_rows(weight)
    n, k = q.shape
    pn, pk = -(-n // lanes) * lanes, -(-k // 4) * 4
    padded = torch.zeros(pn, pk, dtype=torch.int8)
    padded[:n, :k] = q
    panels = padded.view(pn // lanes, lanes, pk // 4, 4).permute(0, 2, 1, 3).contiguous()
    scales = torch.ones(pn, dtype=torch.float32)
    scales[:n] = scale
    sums = padded.sum(dim=1, dtype=torch.int32).contiguous()
    return panels, scales, sums


def _served(module: nn.Linear) -> tuple[torch.Tensor, int, int]:
    """A linear's weight as the kernels read it: (tensor, weight type, 0 rows / 1 panels / 2 panels on the dot)."""
    rows, panels = kernels.served(module)
    if panels is not None:
        dot = panels.dtype == torch.bfloat16 and module.__dict__.get("_dot", False) and kernels.screen_dot()
        return panels, kernels.READ_TYPES[panels.dtype], 2 if dot else 1
    rows = rows if rows.is_contiguous() else rows.contiguous()
    return rows, kernels.READ_TYPES[rows.dtype], 0


def _view(head: nn.Module) -> tuple:
    """(the weights the call reads and the arguments made of them, what they were made from): made again when a
    weight moves or changes (a load, a cast)."""
    linears = ([head.fc1, head.fc2] if head.cfg.kind == "mlp" else []) + [head._head.proj]
    norms = ([head.pre_norm.weight] if head.cfg.kind == "mlp" else []) + [head._norm.weight]
    watched = [m.weight for m in linears] + norms
    stamp = tuple((w.data_ptr(), w._version) for w in watched)
    cached = head.__dict__.get("_fused_head")
    if cached is not None and cached[0] == stamp:
        return cached[1]
    scales, sums = [None] * len(linears), [None] * len(linears)
    if head.__dict__.get("_head_weights") == "int8" and kernels.q8_dot():
        quantized = [quantize_panels(m.weight) for m in linears]
        served = [(q, INT8, 1) for q, _, _ in quantized]
        scales, sums = [s for _, s, _ in quantized], [t for _, _, t in quantized]
    elif head.__dict__.get("_head_weights") == "int8":
        quantized = [quantize_rows(m.weight) for m in linears]
        served, scales = [(q, INT8, 0) for q, _ in quantized], [s for _, s in quantized]
    else:
        served = [_served(m) for m in linears]
    if head.cfg.kind == "lens":
        served, scales, sums = [(None, 0, 0), (None, 0, 0), *served], [None, None, *scales], [None, None, *sums]
    keep = [t for t, _, _ in served if t is not None] + [t for t in scales + sums if t is not None]
    pre = head.pre_norm.weight.detach().float().contiguous() if head.cfg.kind == "mlp" else None
    fin = head._norm.weight.detach().float().contiguous()
    keep += [t for t in (pre, fin) if t is not None]
    view = {
        "keep": keep,
        "weights": (ctypes.c_void_p * 3)(*(0 if t is None else t.data_ptr() for t, _, _ in served)),
        "wtypes": (ctypes.c_int * 3)(*(w for _, w, _ in served)),
        "wpanels": (ctypes.c_int * 3)(*(p for _, _, p in served)),
        "wscales": (ctypes.c_void_p * 3)(*(0 if t is None else t.data_ptr() for t in scales)),
        "wsums": (ctypes.c_void_p * 3)(*(0 if t is None else t.data_ptr() for t in sums)),
        "pre": pre.data_ptr() if pre is not None else None,
        "pre_eps": float(head.pre_norm.eps) if head.cfg.kind == "mlp" else 0.0,
        "fin": fin.data_ptr(),
        "fin_eps": float(head._norm.variance_epsilon),
        "inter": head.fc1.out_features if head.cfg.kind == "mlp" else 0,
        "vocab": head._head.proj.out_features,
        "softcap": float(head._softcap or 0.0),
    }
    head.__dict__["_fused_head"] = (stamp, view)
    return view


def window_candidates(
    head: nn.Module,
    hidden: torch.Tensor,
    index: torch.Tensor,
    kappa: int,
    outside_logp: float,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[list[float]], list[float]] | None:
    """For a marked head: (each row's top-κ logit indices (M, κ), their log-probs, the log-prob of each window token
    at logit index `index` (W ≤ M; -1: outside the head's logits, `outside_logp`)), or None where the call does not
    apply (not marked, another device, a row not finite). noise: (M, the head's logits) added to the logits first
    (`ProxyHead.window_candidates`)."""
    if "_fused_head" not in head.__dict__ or hidden.device.type != "cpu":
        return None
    view = _view(head)
    rows = hidden.reshape(-1, hidden.shape[-1]).to(torch.float32).contiguous()
    m, h = rows.shape
    if noise is not None:
        noise = noise.to(torch.float32).contiguous()
        if noise.shape != (m, view["vocab"]):
            raise ValueError(f"noise of shape {tuple(noise.shape)} for {m} rows of {view['vocab']} logits")
    index = index.to(torch.int64).contiguous()
    lib = kernels._library()
    scratch = torch.empty(lib.head_scratch_floats(m, h, view["inter"], view["vocab"]), dtype=torch.float32)
    ids = torch.empty(m, kappa, dtype=torch.int64)
    logp = torch.empty(m, kappa, dtype=torch.float32)
    window_logp = torch.empty(max(index.numel(), 1), dtype=torch.float32)
    status = lib.proxy_head_f32(
        rows.data_ptr(),
        m,
        h,
        view["pre"],
        view["pre_eps"],
        view["fin"],
        view["fin_eps"],
        view["weights"],
        view["wtypes"],
        view["wpanels"],
        view["wscales"],
        view["wsums"],
        view["inter"],
        view["vocab"],
        view["softcap"],
        noise.data_ptr() if noise is not None else None,
        view["vocab"],
        kappa,
        index.data_ptr(),
        index.numel(),
        outside_logp,
        ids.data_ptr(),
        logp.data_ptr(),
        window_logp.data_ptr(),
        scratch.data_ptr(),
    )
    if status != 0:
        return None
    return ids, logp.tolist(), window_logp[: index.numel()].tolist()
