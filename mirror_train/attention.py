"""Row-invariant attention: a verification window attends exactly as one-token decoding does.

Speculative decoding is lossless only if the target scores a window of k tokens the way it would score them one at
a time. Matmuls do (every row of a GEMM is its own dot products), but PyTorch's CPU SDPA kernels do not: the fused
kernel for a k-row causal window blocks and reduces differently from the one-row decoding kernel. In float32 the
difference is ~1e-5 in a logit and never flipped a greedy token we measured; in bfloat16 every layer rounds it into
the residual stream and it reached 0.6 in a logit, enough to change the greedy token at 2 of 30 random positions
(tests/test_target.py checks the bf16 window bit for bit). So for a window over a cache, this
attention runs each query row as its own one-row SDPA call over exactly the keys that row may see: bit for bit the
call plain decoding makes. Everything else (prefill, padded batches, trees, no cache) goes to transformers' SDPA
unchanged. The cost is k small attention calls instead of one (measured in docs/engine.md). A forked window
(forked_window.py: two chains verified at once) runs each row over its own chain's keys, gathered in order.

With the fast path's exact kernels (fastpath.py, float32 on a CPU) the model switches to `KERNEL_NAME`: every
plain causal window over a cache, one-token steps included, runs kernels.attention, one call a layer for all its
rows, each row computed from its own query and keys alone (the same property at a fraction of the calls).

A draft served `fastest` (fastpath.py) switches to `DRAFT_NAME`: no exactness asked, only speed. On a CPU, torch's
SDPA over a bf16 cache is slow for the few query rows of a draft's tree forward (measured on an AMD EPYC, 9 heads,
one row: 0.42 ms over 300 keys and 0.99 ms over 1,000, against 0.13 and 0.11 ms as two grouped matmuls and a float32
softmax, docs/engine.md, twelfth session), so up to `SMALL_ROWS` half-precision rows take `grouped_attention`.
"""

from __future__ import annotations

import torch

from mirror_train import kernels

NAME = "mirror_row_invariant_sdpa"
KERNEL_NAME = "mirror_row_exact_kernel"
DRAFT_NAME = "mirror_draft_attention"
SMALL_ROWS = 16  # query rows up to which a half-precision CPU call takes grouped_attention (measured: module doc)
MAX_ROWS = 64  # windows longer than this are not verification windows; they take the fused kernel


_checked: list = [None, None]  # the last mask checked and its answer: one mask object serves every layer of a step
_forked: list = [None, None]  # the mask of the forked window being run (forked_window.py) and its key runs


def forked(mask: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """Mark `mask` as a forked window's (its rows' key runs `runs`, ForkedWindow.runs): the attention below then
    computes each row over exactly those keys, in their order, as its chain's one-token step would."""
    _forked[0], _forked[1] = mask, runs
    return mask


def _runs(mask) -> torch.Tensor | None:
    """The key runs of a mask's rows: a forked window's (`forked`), or those a draft's tree forward attached to
    its mask (`key_runs`, multi_stream_attention.tree_mask); None for any other mask."""
    if mask is None:
        return None
    return _forked[1] if _forked[0] is mask else getattr(mask, "key_runs", None)


def _plain_causal_window(mask: torch.Tensor | None, q_len: int, kv_len: int) -> bool:
    """True when `mask` lets row i see exactly keys 0..kv_len−q_len+i (a window at the end of a cache)."""
    if mask is None:  # transformers drops the mask only when SDPA's own causal flag says the same
        return True
    if _checked[0] is mask:
        return _checked[1]
    _checked[0], _checked[1] = mask, _plain_window_mask(mask, q_len, kv_len)
    return _checked[1]


def _plain_window_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or mask.shape[-2:] != (q_len, kv_len):
        return False
    rows = torch.arange(kv_len - q_len, kv_len, device=mask.device)[:, None]
    expected = torch.arange(kv_len, device=mask.device)[None, :] <= rows
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask[0, 0], expected))
    return bool(torch.equal(mask[0, 0] == 0, expected))


def row_invariant_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    if getattr(attention_mask, "static_rows", False):  # a window over a fixed-capacity cache (static_step.py)
        return _static_rows(module, query, key, value, attention_mask, *args, **kwargs), None
    runs = _runs(attention_mask)
    if runs is not None and query.shape[0] == 1 and kwargs.get("position_bias") is None:
        return _forked_rows(module, query, key, value, runs, *args, **kwargs), None
    if (
        query.shape[0] != 1
        or not 1 < q_len <= MAX_ROWS
        or q_len >= kv_len
        or kwargs.get("position_bias") is not None
        or not _plain_causal_window(attention_mask, q_len, kv_len)
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    rows = []
    for i in range(q_len):
        seen = kv_len - q_len + i + 1
        out, _ = sdpa_attention_forward(
            module, query[:, :, i : i + 1], key[:, :, :seen], value[:, :, :seen], None, *args, **kwargs
        )
        rows.append(out)
    return torch.cat(rows, dim=1), None


def _static_rows(module, query, key, value, mask, *args, **kwargs):
    """Each row of a window over a static cache (static_step.py) as its own one-row SDPA call over the whole buffer
    under its row of the mask: the call a one-token step makes, whatever the window's width, with no host
    synchronisation (it runs inside CUDA graphs)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = [
        sdpa_attention_forward(module, query[:, :, i : i + 1], key, value, mask[:, :, i : i + 1], *args, **kwargs)[0]
        for i in range(query.shape[2])
    ]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


def _forked_rows(module, query, key, value, runs, *args, **kwargs):
    """A forked window's rows, each a one-row SDPA call over its keys gathered in order (a copy per row: the slow,
    general path; the kernel reads them in place)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = []
    for i in range(query.shape[2]):
        first, start, count = (int(x) for x in runs[:, i])
        index = torch.cat([torch.arange(first), torch.arange(start, start + count)]).to(key.device)
        keys, values = key.index_select(2, index), value.index_select(2, index)
        out, _ = sdpa_attention_forward(module, query[:, :, i : i + 1], keys, values, None, *args, **kwargs)
        rows.append(out)
    return torch.cat(rows, dim=1)


def row_exact_kernel(module, query, key, value, attention_mask, *args, **kwargs):
    """kernels.attention for a plain causal window (1..MAX_ROWS rows) over a cache in float32 on a CPU; anything
    else as `row_invariant_sdpa`. A forked window's rows (`forked`) too, each over its own keys."""
    q_len, kv_len = query.shape[2], key.shape[2]
    runs = _runs(attention_mask)
    if (
        getattr(attention_mask, "static_rows", False)
        or query.shape[0] != 1
        or not 1 <= q_len <= MAX_ROWS
        or q_len >= kv_len
        or query.dtype != torch.float32
        or key.dtype != torch.float32
        or query.device.type != "cpu"
        or query.shape[1] % key.shape[1]
        or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "sliding_window", "s_aux"))
        or kwargs.get("dropout", 0.0)
        or (runs is None and not _plain_causal_window(attention_mask, q_len, kv_len))
    ):
        return row_invariant_sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    scale = kwargs.get("scaling")
    scale = scale if scale is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
    return kernels.attention(query, key, value, float(scale), runs), None


def use_kernel(model, on: bool) -> bool:
    """Switch a model with the row-invariant attention to the kernel form (on) or back; False when it has neither
    (another attention implementation: left alone)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)  # a module without one (a proxy head) has no attention to switch
    if getattr(config, "_attn_implementation", None) not in (NAME, KERNEL_NAME):
        return False
    AttentionInterface.register(KERNEL_NAME, row_exact_kernel)
    AttentionMaskInterface.register(KERNEL_NAME, sdpa_mask)
    config._attn_implementation = KERNEL_NAME if on else NAME
    return True


def install(model) -> bool:
    """Switch `model` from transformers' SDPA to the row-invariant form; False when it uses another attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)  # a module without one (a proxy head) has no attention to switch
    if getattr(config, "_attn_implementation", None) == KERNEL_NAME:
        return True
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    AttentionInterface.register(NAME, row_invariant_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks SDPA gets
    config._attn_implementation = NAME
    return True


def gemm_row_invariant(model, widths=range(2, 9)) -> bool:
    """Whether this CPU's (or GPU's) matmuls in the model's dtype give every row of a k-row product exactly what a
    one-row product gives, for k in `widths`: probed on the first decoder layer's projections and the LM head.

    Row-invariant attention makes a window exact only if the matmuls around it are too. Measured: bf16 GEMMs were
    row-invariant on the AMX Xeon this project started on and were not on an AMD EPYC with AVX-512 bf16 (a 5-row
    down_proj differed by ~1e-4 from one-row products); float32 MKL GEMMs differ by ~1e-5 (docs/engine.md).
    """
    linears = [m for m in model.get_decoder().layers[0].modules() if isinstance(m, torch.nn.Linear)]
    linears.append(model.get_output_embeddings())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for linear in linears:
            w = linear.weight
            x = torch.randn(max(widths), w.shape[1], generator=g).to(device=w.device, dtype=w.dtype)
            one = torch.cat([linear(x[r : r + 1]) for r in range(len(x))])  # the module: whatever path it runs
            for k in widths:
                if not torch.equal(linear(x[:k]), one[:k]):
                    return False
    return True


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention as two matmuls per key head and a float32 softmax: query (B, H, M, D), key and value (B, KVH, L, D)
    with H a multiple of KVH (query head h reads key head h // (H / KVH), as transformers' repeat_kv pairs them),
    mask additive (B or 1, 1, M, L) or None. Returns (B, H, M, D) in the query's dtype."""
    B, H, M, D = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    grouped = query.reshape(B, kv_heads, (H // kv_heads) * M, D)  # a key head's query heads, one after another
    scores = (grouped @ key.transpose(-1, -2)).float().view(B, H, M, length) * scale
    if mask is not None:
        scores = scores + mask
    weights = scores.softmax(-1).to(value.dtype).view(B, kv_heads, -1, length)
    return (weights @ value).view(B, H, M, D)


def _small_rows(query: torch.Tensor, dropout: float) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and query.shape[2] <= SMALL_ROWS
        and not dropout
        and not torch.is_grad_enabled()
    )


def draft_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """A transformers attention function (`DRAFT_NAME`): `grouped_attention` for a few half-precision rows on a
    CPU at inference, transformers' SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    extra = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "sliding_window", "s_aux"))
    if extra or not _small_rows(query, kwargs.get("dropout", 0.0)) or query.shape[1] % key.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    scale = kwargs.get("scaling")
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    return grouped_attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None


def attend(config, query, key, value, mask, scale) -> torch.Tensor:
    """Attention as a model whose config names its implementation computes it outside transformers' layers (the
    draft's multi-stream layer): query (B, H, M, D), key and value (B, KVH, L, D), additive mask → (B, H, M, D)."""
    if getattr(config, "_attn_implementation", None) == DRAFT_NAME and _small_rows(query, 0.0):
        return grouped_attention(query, key, value, mask, scale)
    from transformers.models.llama.modeling_llama import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def use_draft_attention(model, on: bool = True) -> bool:
    """Switch a model on transformers' SDPA to `draft_attention` (a draft served `fastest`), or back (on=False);
    False when it uses another attention (left alone)."""
    from transformers import AttentionInterface

    config = getattr(model, "config", None)  # a module without one (a proxy head) has no attention to switch
    if getattr(config, "_attn_implementation", None) not in ("sdpa", DRAFT_NAME):
        return False
    AttentionInterface.register(DRAFT_NAME, draft_attention)
    config._attn_implementation = DRAFT_NAME if on else "sdpa"
    return True
