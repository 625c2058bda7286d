"""A per-position proxy head's candidates as one C call (csrc/proxy_head.c), where the head runs on a CPU.

`ProxyHead.window_candidates` is ~30 small torch operations (the adapter's norm and MLP, the final norm, the LM head's
candidate rows, the log-softmax, top-κ and the window's log-probs). On the draft's side each runs cold, after the
target's weight stream on the other core has evicted the interpreter's working set from the shared L3: 3.1–3.3 ms a
step against ~1.1 ms warm, all of it out of the branch rollout's deadline (docs/engine.md, thirty-seventh session).
One call reads the same weights as the fast path serves them (their panels, on the dot product where the fast path
marked them so) with float32 activations. The head only proposes: its ranking may differ from torch's in the last
bits (near-ties), never the target's output.

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


def install(head: nn.Module, on: bool = True) -> bool:
    """Mark `head` to answer `window_candidates` in one C call (on) or never (off); returns whether it is marked."""
    head.__dict__.pop("_fused_head", None)
    if on and supported(head):
        head.__dict__["_fused_head"] = None  # the call's view, made at the first call (`_view`)
        return True
    return False


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
    served = [_served(m) for m in linears]
    if head.cfg.kind == "lens":
        served = [(None, 0, 0), (None, 0, 0), *served]
    keep = [t for t, _, _ in served if t is not None]
    pre = head.pre_norm.weight.detach().float().contiguous() if head.cfg.kind == "mlp" else None
    fin = head._norm.weight.detach().float().contiguous()
    keep += [t for t in (pre, fin) if t is not None]
    view = {
        "keep": keep,
        "weights": (ctypes.c_void_p * 3)(*(0 if t is None else t.data_ptr() for t, _, _ in served)),
        "wtypes": (ctypes.c_int * 3)(*(w for _, w, _ in served)),
        "wpanels": (ctypes.c_int * 3)(*(p for _, _, p in served)),
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
    head: nn.Module, hidden: torch.Tensor, index: torch.Tensor, kappa: int, outside_logp: float
) -> tuple[torch.Tensor, list[list[float]], list[float]] | None:
    """For a marked head: (each row's top-κ logit indices (M, κ), their log-probs, the log-prob of each window token
    at logit index `index` (W ≤ M; -1: outside the head's logits, `outside_logp`)), or None where the call does not
    apply (not marked, another device, a row not finite)."""
    if "_fused_head" not in head.__dict__ or hidden.device.type != "cpu":
        return None
    view = _view(head)
    rows = hidden.reshape(-1, hidden.shape[-1]).to(torch.float32).contiguous()
    m, h = rows.shape
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
        view["inter"],
        view["vocab"],
        view["softcap"],
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
