"""Multi-stream attention (Speculative Streaming, arXiv 2402.11131): a Llama decoder layer that also carries γ'
lookahead streams at every position.

For every main position t there are S = γ' stream tokens (t, 1..S). Who sees whom:

    main t        → main positions ≤ t (cached and new; in a tree: its ancestors and itself)    never a stream
    stream (t, j) → the same main positions as main t, and the streams (t, 1..j)

so the main stream computes exactly what a plain Llama layer with the same weights would, and stream j is untouched
by streams after it. Only main K/V go into the KV cache: a stream exists for one forward and is then forgotten.

RoPE position of stream (t, j): the anchor position t (the paper leaves it open). The streams then differ from each
other only through their learned stream embeddings P_j and what they attend to, and a stream's query/key rotation is
the one its anchor already has, so no position beyond the main sequence is ever used.

The masks are additive floats over [cached ; new] keys: `causal_mask` for a plain sequence, `tree_mask` for tree
nodes (each attends to the committed context, its ancestors and itself), `stream_attention_mask` for the streams
(the one-call reference; `_stream_attention` computes the same without scoring the streams no query may see).
Masked entries hold the dtype's minimum rather than -inf, so a fully masked row (a padding query) gets a harmless
uniform attention instead of NaN.

The layer keeps Llama's parameter names (`self_attn.{q,k,v,o}_proj`, `mlp`, the two norms), so a target's decoder
layer loads into it unchanged. Attention is torch's `scaled_dot_product_attention` with additive float masks; GQA
key/value heads are repeated to the query heads first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, apply_rotary_pos_emb, repeat_kv

from mirror_train.attention import attend
from mirror_train.errors import MirrorTrainError


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_mask(
    past: int, length: int, padding: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The causal mask (1 or B, 1, T, L+T) of T new positions after L cached ones.

    padding (B, L+T): 1 = a real token, 0 = padding, or None.
    """
    rows = torch.arange(past, past + length, device=device)  # (T,) absolute positions of the queries
    allowed = torch.arange(past + length, device=device)[None, :] <= rows[:, None]  # (T, L+T)
    allowed = allowed[None, None]  # (1, 1, T, L+T)
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]  # (B, 1, T, L+T)
    return _additive(allowed, dtype)


def packed_causal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask (B, 1, T, T) of rows that pack several sequences one after another: a position sees the
    positions up to itself in its own sequence only. segments (B, T): each position's sequence, non-decreasing."""
    T = segments.shape[1]
    order = torch.arange(T, device=segments.device)
    allowed = (order[None, :] <= order[:, None]) & (segments[:, :, None] == segments[:, None, :])  # (B, T, T)
    return _additive(allowed[:, None], dtype)


def ttt_mask(segments: torch.Tensor, rows: Sequence[torch.Tensor], step: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask of training-time-test step k ≥ 1 over the keys of steps 0..k (step-major).

    segments (1, N): the sequence of each packed position (non-decreasing); rows[j] (M_j,): the packed positions
    step j runs at (step 0 at all N). The query at p in step k is a token the draft rolled out k−1 tokens after the
    committed position p−k: it sees step 0's positions ≤ p−k of its own sequence (the committed context) and its
    chain, position p−k+j in step j for j = 1..k (itself last); every row needs its chain's positions among
    rows[1..k]. Returns (1, 1, M_k, N + M_1 + … + M_k).
    """
    seg = segments[0]
    q = rows[step]
    same = seg[q][:, None]  # (M_k, 1)
    blocks = [(seg[None, :] == same) & (torch.arange(len(seg), device=seg.device)[None, :] <= q[:, None] - step)]
    for j in range(1, step + 1):
        keys = rows[j]
        blocks.append((seg[keys][None, :] == same) & (keys[None, :] == q[:, None] - step + j))
    return _additive(torch.cat(blocks, dim=1), dtype)[None, None]


def tree_mask(
    parents: Sequence[int], committed: int, num_new: int, dtype: torch.dtype, key_runs: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask of the last `num_new` of M uncommitted tree nodes, and their depths.

    parents (M,): each node's parent as an index into the M nodes, -1 for the end of the `committed` context; a
    parent comes before its child. Returns (1, 1, num_new, committed + M) and (num_new,) long (depth 0 under -1).
    With `key_runs`, the mask carries the same keys as runs where every node's are two runs at most (`key_runs`,
    `_key_runs`): what the C layers read instead of it (attention._runs, fused_layer.py; CPU only).
    """
    m = len(parents)
    paths: list[list[int]] = []  # each node's ancestors and itself, ascending
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise MirrorTrainError(f"node {i} has parent {p}: a parent must be -1 or an earlier node")
        paths.append((paths[p] if p >= 0 else []) + [i])
    new = paths[m - num_new :]
    # a few torch calls on index lists, none per node: a draft builds one every tree forward of a handful of nodes,
    # where each small torch op costs microseconds
    mask = torch.full((1, 1, num_new, committed + m), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :committed] = 0
    rows = [r for r, path in enumerate(new) for _ in path]
    mask[0, 0, rows, [committed + k for path in new for k in path]] = 0
    runs = _key_runs(new, committed) if key_runs else None
    if runs is not None:
        mask.key_runs = runs
    return mask, torch.tensor([len(path) - 1 for path in new], dtype=torch.long)


def _key_runs(paths: Sequence[Sequence[int]], committed: int) -> torch.Tensor | None:
    """The keys of nodes with these ancestor paths (ascending, the node last) as two runs, in the form the kernels
    take (attention._runs, kernels.attention's `rows`): (3, len(paths)) int64, row i sees keys 0..n1−1, then
    s2..s2+n2−1; None where some node's keys are three runs or more (its ancestors in two pieces after the ones
    that fill the cache up from the committed context). A serial rollout's chain is one run a node; a branch
    hanging off a spine is two."""
    out = []
    for path in paths:
        r = 0
        while r < len(path) and path[r] == r:  # the ancestors that continue the committed context unbroken
            r += 1
        rest = path[r:]
        if rest and rest[-1] - rest[0] != len(rest) - 1:
            return None
        n1 = committed + r
        out.append((n1, committed + rest[0] if rest else n1, len(rest)))
    return torch.tensor(out, dtype=torch.long).T.contiguous()


def stream_attention_mask(main_mask: torch.Tensor, num_streams: int) -> torch.Tensor:
    """The additive mask of the stream queries over [main keys ; stream keys].

    main_mask (B, 1, T, K): the main queries' additive mask over the K = cached + new main keys.
    Returns (B, 1, T·S, K + T·S), rows and stream columns ordered t-major ((t, 1), …, (t, S), (t+1, 1), …).
    Memory grows as (T·S)²: fine for drafting and for training sequences of a few thousand tokens.
    """
    B, _, T, _ = main_mask.shape
    S = num_streams
    to_main = main_mask.repeat_interleave(S, dim=2)  # (B, 1, T·S, K): stream (t, j) sees what main t sees
    t = torch.arange(T, device=main_mask.device).repeat_interleave(S)  # (T·S,) anchor of each stream token
    j = torch.arange(S, device=main_mask.device).repeat(T)  # (T·S,) stream index
    allowed = (t[:, None] == t[None, :]) & (j[None, :] <= j[:, None])  # (T·S, T·S): streams 1..j at the same t
    return torch.cat([to_main, _additive(allowed, main_mask.dtype).expand(B, 1, -1, -1)], dim=-1)


def multi_stream_attention(
    attn,
    rows: torch.Tensor,
    num_streams: int,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    main_mask: torch.Tensor,
    cache=None,
    anchors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention of the main stream and its lookahead streams with the weights of a LlamaAttention `attn`.

    rows (B, T + K·S, H): the normed main states, then the S = num_streams stream states of K anchors t-major
    (`joint_rows`); anchors (K,): the main positions that carry streams (None: all T, K = T); position_embeddings
    the (cos, sin) of the main positions, (B, T, d); main_mask (B, 1, T, L+T) additive over [cache ; new]. Appends
    the main K/V (only) to `cache` at `attn.layer_idx`. Returns the attention outputs after o_proj in the same
    (B, T + K·S, H) layout.

    The main and stream rows go through each projection in one call: a decoding step's few rows are bound by
    reading the weights, so one call costs about what the main rows alone cost (docs/engine.md, twelfth session).
    """
    S = num_streams
    B = rows.shape[0]
    T = rows.shape[1] // (1 + S) if anchors is None else rows.shape[1] - len(anchors) * S
    d = attn.head_dim
    cos, sin = position_embeddings
    q_all, k_all, v_all = attn.q_proj(rows), attn.k_proj(rows), attn.v_proj(rows)
    q = q_all[:, :T].reshape(B, T, -1, d).transpose(1, 2)  # (B, nh, T, d)
    k = k_all[:, :T].reshape(B, T, -1, d).transpose(1, 2)  # (B, nkv, T, d)
    v = v_all[:, :T].reshape(B, T, -1, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)  # (B, nkv, L+T, d)
    out = attend(attn.config, q, k, v, main_mask, attn.scaling)  # (B, nh, T, d)
    out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh·d)
    if not S:
        return attn.o_proj(out)
    groups = attn.num_key_value_groups
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (B, nh, L+T, d): what the streams attend to

    if anchors is not None:  # the streams' anchors: their rotation and what they see
        cos, sin, main_mask = cos[:, anchors], sin[:, anchors], main_mask[:, :, anchors]
    K = cos.shape[1]
    qs = q_all[:, T:].reshape(B, K * S, -1, d).transpose(1, 2)  # (B, nh, K·S, d), t-major
    ks = k_all[:, T:].reshape(B, K * S, -1, d).transpose(1, 2)  # (B, nkv, K·S, d)
    vs = v_all[:, T:].reshape(B, K * S, -1, d).transpose(1, 2)
    # Each stream token takes its anchor's rotation (see the module docstring).
    qs, ks = apply_rotary_pos_emb(qs, ks, cos.repeat_interleave(S, dim=1), sin.repeat_interleave(S, dim=1))
    out_s = _stream_attention(qs, repeat_kv(ks, groups), repeat_kv(vs, groups), k, v, main_mask, S, attn.scaling)
    return attn.o_proj(torch.cat([out, out_s.transpose(1, 2).reshape(B, K * S, -1)], dim=1))  # (B, T + K·S, H)


def joint_rows(x: torch.Tensor, xs: torch.Tensor | None) -> torch.Tensor:
    """Main rows (B, T, H) and stream rows (B, K, S, H) (K = T, or the K anchors that carry streams) as one
    (B, T + K·S, H) block, main first, streams t-major: one call of a linear layer, an MLP or a norm computes both
    (they are row-wise)."""
    if xs is None:
        return x
    B, K, S, H = xs.shape
    return torch.cat([x, xs.reshape(B, K * S, H)], dim=1)


def split_rows(rows: torch.Tensor, T: int, S: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inverse of `joint_rows`: (B, T + K·S, ...) → (B, T, ...) and (B, K, S, ...) (None when S = 0)."""
    if not S:
        return rows, None
    B = rows.shape[0]
    return rows[:, :T], rows[:, T:].reshape(B, -1, S, *rows.shape[2:])


def _stream_attention(
    qs: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    main_mask: torch.Tensor,
    num_streams: int,
    scale: float,
) -> torch.Tensor:
    """Attention of the stream queries over the main keys their anchor sees and the streams 1..j at their anchor.

    qs, ks, vs (B, nh, T·S, d) t-major; k, v (B, nh, K, d) the main keys; main_mask (B, 1, T, K) additive.
    Returns (B, nh, T·S, d).

    Why not one SDPA call over [main ; stream] keys (`stream_attention_mask`): stream (t, j) sees at most S stream
    keys, yet that call scores all T·S of them, so it costs (T·S)·(K + T·S) against (T·S)·(K + S) here (measured in
    docs/drafter.md: fwd + bwd 110 → 57–75 ms on a mean training row of 415 positions, γ' = 2).
    """
    B, nh, TS, d = qs.shape
    S, T = num_streams, TS // num_streams
    to_main = (qs @ k.transpose(-1, -2)).view(B, nh, T, S, -1) * scale  # (B, nh, T, S, K)
    to_main = to_main + main_mask[:, :, :, None, :]  # stream (t, j) sees what main t sees
    q5, k5, v5 = (x.view(B, nh, T, S, d) for x in (qs, ks, vs))
    own = (q5 @ k5.transpose(-1, -2)) * scale  # (B, nh, T, S, S): (t, j) against (t, r)
    later = torch.ones(S, S, dtype=torch.bool, device=qs.device).triu(1)  # r > j: a later stream, unseen
    own = own.masked_fill(later, torch.finfo(own.dtype).min)
    weights = torch.cat([to_main, own], dim=-1).float().softmax(-1).to(qs.dtype)  # (B, nh, T, S, K + S)
    K = k.shape[2]
    out = (weights[..., :K].reshape(B, nh, TS, K) @ v) + (weights[..., K:] @ v5).view(B, nh, TS, d)
    return out


class MultiStreamDecoderLayer(LlamaDecoderLayer):
    """A LlamaDecoderLayer (same parameters) whose forward also advances the lookahead streams.

    The streams go through the same norms, attention projections and MLP as the main stream. Served on a CPU with
    the kernels (fused_layer.py installed), a forward runs as one C decoder-layer call where it can
    (`FusedLayer._fused_stream_call`): the main rows, then the stream rows, whose keys sit for that call in the
    cache's spare room right after the main rows.
    """

    def forward(self, hidden, streams, position_embeddings, attention_mask, cache=None, anchors=None):
        """hidden (B, T, H), streams (B, K, S, H) or None → the same two after this layer; anchors (K,) the main
        positions carrying streams (None: all T); the other arguments as `multi_stream_attention` takes them. Main
        and stream rows share every norm, projection and MLP call."""
        fused = getattr(self, "_fused_stream_call", None)
        if fused is not None:
            out = fused(hidden, streams, position_embeddings, attention_mask, cache, anchors)
            if out is not None:
                return out
        T, S = hidden.shape[1], 0 if streams is None else streams.shape[2]
        rows = joint_rows(hidden, streams)  # (B, T + K·S, H)
        attended = multi_stream_attention(
            self.self_attn, self.input_layernorm(rows), S, position_embeddings, attention_mask, cache, anchors
        )
        rows = rows + attended
        rows = rows + self.mlp(self.post_attention_layernorm(rows))
        return split_rows(rows, T, S)
