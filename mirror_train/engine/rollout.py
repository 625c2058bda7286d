"""The engine's rollout algorithm: a draft rolls out γ tokens after each of several branch roots, all branches
batched in one tree forward per pass over the shared committed context (`MirrorDrafterForCausalLM.tree_forward`).

The fed nodes' K/V stay in the draft's cache after the committed context, so that the caller can keep one branch's
path (`keep_cache_path`) and drop the rest. A token the draft rolls out reads, when it is fed, the state that
predicted it (the main stream's for the next token, stream j's for the token j further on) in the draft's own slot:
what training-time test trains (drafter_training.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mirror_train.errors import MirrorTrainError
from mirror_train.kv_cache import GrowingLayer
from mirror_train.models.drafter import MirrorDrafterForCausalLM


class Rollout(NamedTuple):
    """One branch's rollout."""

    tokens: list[int]  # γ target ids
    logprobs: list[float]  # log q of each token under the draft distribution it was chosen from
    num_forwards: int  # batched forwards the rollout took
    nodes: list[int]  # uncommitted cache slots of this branch: its root tokens, then the rollout tokens fed back
    pairs: torch.Tensor | None = None  # (γ, H) float32 on the draft's device: the draft state that predicted each
    # token (what the token reads in the own slot when it is fed); None for a draft without an own slot


@torch.no_grad()
def rollout(
    draft: MirrorDrafterForCausalLM,
    cache: DynamicCache,
    roots: Sequence[Sequence[int]],
    gamma: int,
    **options,
) -> list[Rollout]:
    """Roll out γ draft tokens after each branch root, all branches batched in one tree forward per pass.

    `cache` holds the committed context (all of it counts as committed); each root is the non-empty list of
    target ids that follows it on that branch. Each pass feeds every branch's newest tokens as tree nodes and
    reads the last node: its main logits give the next token, stream j's give the token j further on, so a
    pass yields 1 + γ' tokens and a rollout takes ⌈γ / (1 + γ')⌉ forwards (`use_streams=False`: one token per
    pass, γ forwards). Greedy at temperature 0 (log-probs then at temperature 1), else each token is sampled
    from softmax(logits / T), the distribution its log-prob refers to. features: slot → (Σ len(root), width),
    what the root tokens read, root after root (feature conditioning; rolled-out tokens read their own states
    when the draft has an own slot, else nothing).

    The fed nodes stay in the cache after the committed context; `Rollout.nodes` names a branch's slots, for
    `keep_cache_path(cache, committed_len, rollout.nodes[:k])`.
    """
    if not roots or any(len(root) == 0 for root in roots):
        raise MirrorTrainError("rollout needs at least one branch and every root needs at least one token")
    parents: list[int] = []
    tokens: list[int] = []
    chains: list[list[int]] = []
    for root in roots:  # each root a chain of its own after the committed context
        chain: list[int] = []
        for token in root:
            chain.append(_add_node(parents, tokens, chain[-1] if chain else -1, token))
        chains.append(chain)
    return rollout_nodes(draft, cache, parents, tokens, chains, gamma, **options)


@torch.no_grad()
def rollout_tree(
    draft: MirrorDrafterForCausalLM,
    cache: DynamicCache,
    spine: Sequence[int],
    branches: Sequence[tuple[int, int | None]],
    gamma: int,
    **options,
) -> list[Rollout]:
    """Roll out γ tokens for branches that hang off a shared chain: the engine's branch-complete rollout.

    `cache` holds the committed context; `spine` is a non-empty chain of target ids after it (the committed
    tokens the cache lacks, then the proposed window). Each branch is (anchor, token): the branch's context is
    the spine up to and including spine[anchor] (anchor -1: the committed context alone; then token is
    required), followed by `token`, or by nothing when token is None. The spine is fed once for all branches;
    a branch without a token reads its first logits off the spine node itself. `Rollout.nodes` of a branch
    lists the spine nodes up to its anchor, then its own. features (feature conditioning): slot → (S + R, width),
    what each spine node and then each branch token (R: the branches with one) reads, zeros where there is
    nothing; the tokens rolled out read their own states (own slot) or nothing.
    """
    if not spine:
        raise MirrorTrainError("rollout_tree needs a non-empty spine")
    if not branches:
        raise MirrorTrainError("rollout_tree needs at least one branch")
    parents = list(range(-1, len(spine) - 1))
    tokens = [int(t) for t in spine]
    chains: list[list[int]] = []
    for anchor, token in branches:
        if not -1 <= anchor < len(spine) or (anchor == -1 and token is None):
            raise MirrorTrainError(f"branch ({anchor}, {token}): anchor must be in -1..{len(spine) - 1}")
        chain = list(range(anchor + 1))
        if token is not None:
            chain.append(_add_node(parents, tokens, anchor, token))
        chains.append(chain)
    return rollout_nodes(draft, cache, parents, tokens, chains, gamma, **options)


def _add_node(parents: list[int], tokens: list[int], parent: int, token: int) -> int:
    """Append a tree node (its parent's index, -1 for the committed context) and return its index."""
    parents.append(parent)
    tokens.append(int(token))
    return len(parents) - 1


@torch.no_grad()
def rollout_nodes(
    draft: MirrorDrafterForCausalLM,
    cache: DynamicCache,
    parents: list[int],
    tokens: list[int],
    chains: list[list[int]],
    gamma: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    use_streams: bool = True,
    features: dict[str, torch.Tensor] | None = None,
    noise: Callable[[Sequence[int]], torch.Tensor] | None = None,
) -> list[Rollout]:
    """The rollout loop of `rollout` and `rollout_tree` (their keyword options are this function's): the first
    pass feeds the shared nodes (parents, tokens); then each pass appends every branch's newest tokens after the
    last node of its chain, each reading in the own slot the state that predicted it (the main stream's for the
    next token, stream j's for the token j further on).

    noise: the target's sampling noise by sequence index (`coupled_choice`): each token is then
    argmax(logits + the noise row of its index), the index counted from the start of the cached context (the cache's
    length plus the nodes before it on its chain). The LM head runs only on each branch's last node: the other nodes'
    logits are never read.
    """
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise MirrorTrainError(f"gamma must be an int ≥ 1, got {gamma!r}")
    if temperature < 0:
        raise MirrorTrainError(f"temperature must be ≥ 0, got {temperature}")
    streams = draft.config.num_streams if use_streams else 0
    own = "own" in draft.config.slots
    device = draft.device
    committed = cache.get_seq_length()
    parents, chains = list(parents), [list(c) for c in chains]
    drafted: list[list[int]] = [[] for _ in chains]
    logprobs: list[list[float]] = [[] for _ in chains]
    pairs: list[list[torch.Tensor]] = [[] for _ in chains]
    new_tokens, first_new = list(tokens), 0
    passes = 0
    while len(drafted[0]) < gamma:
        s = min(streams, gamma - len(drafted[0]) - 1)  # only the streams still needed this pass are run
        last = torch.tensor([chain[-1] - first_new for chain in chains], device=device)  # (branches,)
        out = draft.tree_forward(
            new_tokens, parents, cache, committed, num_streams=s, features=features, logits_index=last
        )
        passes += 1
        # Each branch's last node: main → the next token, stream j → the token j further on.
        logits = out.logits[0, :, None]  # (branches, 1, V_draft)
        states = out.hidden[0, :, None]  # (branches, 1, H): the state behind each choice
        if s:
            logits = torch.cat([logits, out.stream_logits[0]], dim=1)  # (branches, 1 + s, V_draft)
            states = torch.cat([states, out.stream_hidden[0]], dim=1)  # (branches, 1 + s, H)
        if noise is None:
            chosen, logp = _choose(logits.float(), temperature, generator)  # (branches, 1 + s) each
        else:  # token j of a branch follows its chain's nodes and j more: its index in the sequence
            index = [[committed + len(chain) + j for j in range(1 + s)] for chain in chains]
            chosen, logp = coupled_choice(logits.float(), index, noise, draft.d2t)
        chosen = draft.draft_to_target(chosen).tolist()
        new_tokens, first_new, fed = [], len(parents), []
        for b, chain in enumerate(chains):
            drafted[b] += chosen[b]
            logprobs[b] += logp[b].tolist()
            if own:
                pairs[b] += list(states[b].float())  # the server keeps them beside the target's states
            if len(drafted[b]) < gamma:  # feed them for the next pass, chained after the branch's last node
                for token in chosen[b]:
                    parents.append(chain[-1])
                    chain.append(len(parents) - 1)
                    new_tokens.append(token)
                fed.append(states[b])
        features = {"own": torch.cat(fed)} if own and fed else None
    return [
        Rollout(
            drafted[b][:gamma],
            logprobs[b][:gamma],
            passes,
            chains[b],
            torch.stack(pairs[b][:gamma]) if own else None,
        )
        for b in range(len(chains))
    ]


def keep_cache_path(cache: DynamicCache, committed_len: int, node_indices: Sequence[int]) -> None:
    """Keep the committed context and the given uncommitted nodes, in that order; drop every other cached node.

    node_indices count from the first uncommitted slot (as `Rollout.nodes` and tree parents do) and should form a
    root-to-node path, so that the kept K/V read as one plain sequence.
    """
    length = cache.get_seq_length()
    if not 0 <= committed_len <= length:
        raise MirrorTrainError(f"committed_len {committed_len} is outside the cache's 0..{length}")
    if any(not 0 <= i < length - committed_len for i in node_indices):
        raise MirrorTrainError(f"node indices must be in 0..{length - committed_len - 1}, got {list(node_indices)}")
    node_indices = list(node_indices)
    in_place = node_indices == list(range(len(node_indices)))  # a prefix of the uncommitted nodes: nothing moves
    nodes = committed_len + torch.as_tensor(node_indices, dtype=torch.long)
    for layer in cache.layers:
        if layer.get_seq_length() == 0:
            continue
        if getattr(layer, "is_sliding", False):
            raise MirrorTrainError("keep_cache_path supports full-attention cache layers only")
        if isinstance(layer, GrowingLayer) and layer._views_of_buffers(length):
            # in place: the kept nodes' rows move down behind the committed ones, the view is shortened (the next
            # update overwrites the rest); the committed rows are not copied, nor kept nodes already in place
            end = committed_len + len(nodes)
            for buffer in () if in_place else (layer._key_buffer, layer._value_buffer):
                buffer[..., committed_len:end, :] = buffer.index_select(-2, nodes.to(buffer.device))
            layer.keys, layer.values = layer._key_buffer[..., :end, :], layer._value_buffer[..., :end, :]
            continue
        index = torch.cat([torch.arange(committed_len), nodes]).to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)  # (B, nkv, committed + k, d)
        layer.values = layer.values.index_select(-2, index)


def coupled_choice(
    logits: torch.Tensor,
    index: Sequence[Sequence[int]],
    noise: Callable[[Sequence[int]], torch.Tensor],
    d2t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's token for each row of logits (branches, k, V_draft) coupled to the target's sample at the same
    sequence index: argmax(logits + noise), the noise the target adds to its own logits there (Gumbel-max,
    `acceptance.sample_noise`, scaled by T), read at the target ids the draft's ids stand for (`d2t`; None: the same
    ids). Where the two distributions are close their samples then agree far more often than a greedy draft's token
    agrees with the target's sample, and the target's tokens, and so the output, do not depend on the draft at all
    (acceptance.py). Returns the ids and their log-probs at temperature 1 (as a greedy draft reports them)."""
    flat = [i for row in index for i in row]
    unique = sorted(set(flat))
    rows = noise(unique).to(logits.device)  # (unique indices, V_target)
    if d2t is not None:
        rows = rows[:, d2t.to(logits.device)]
    where = {i: n for n, i in enumerate(unique)}
    picked = rows[torch.tensor([where[i] for i in flat], device=logits.device)].view(logits.shape)
    chosen = (logits + picked).argmax(-1)
    logp = F.log_softmax(logits, dim=-1).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    return chosen, logp


def _choose(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one id per row of logits (..., V): argmax at T = 0, else a sample of softmax(logits / T).

    Returns the ids and their log-probs under the distribution used (temperature 1 for greedy).
    """
    if temperature == 0:
        logp = F.log_softmax(logits, dim=-1)
        chosen = logits.argmax(-1)
    else:
        logp = F.log_softmax(logits / temperature, dim=-1)
        flat = logp.exp().flatten(0, -2)  # (rows, V)
        chosen = torch.multinomial(flat, 1, generator=generator).view(logits.shape[:-1])
    return chosen, logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
