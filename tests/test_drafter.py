"""The Speculative-Streaming draft on tiny random Llamas: stream semantics, KV cache, tree rollout, save/load."""

from __future__ import annotations

import math

import pytest
import torch

from mirror_train.engine.rollout import keep_cache_path, rollout
from mirror_train.errors import MirrorTrainError
from mirror_train.models.draft_surgery import check_compatible
from mirror_train.models.drafter import MirrorDrafterConfig, MirrorDrafterForCausalLM, paired_features
from mirror_train.target import Target
from mirror_train.vocab import frequent_token_map
from tests.conftest import tiny_model, tiny_tokenizer

VOCAB = 128


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", layers=4, vocab=VOCAB)


def drafter(llama, **kwargs):
    kwargs = {"num_layers": 4, "num_streams": 2, "num_stream_layers": 2, **kwargs}
    return MirrorDrafterForCausalLM.from_target(llama, **kwargs)


def tokens(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def prefill(model, context: torch.Tensor):
    cache = model.new_cache()
    model(context, cache=cache, num_streams=0)
    return cache


# --- the main stream is the plain model --------------------------------------------------------------------------
@pytest.mark.parametrize("streams,stream_layers", [(0, 0), (2, 2), (3, 4)])
def test_main_stream_equals_the_target_with_and_without_cache(llama, streams, stream_layers):
    draft = drafter(llama, num_streams=streams, num_stream_layers=stream_layers)
    x = tokens(10, batch=2)
    with torch.no_grad():
        reference = llama(x).logits
        torch.testing.assert_close(draft(x).logits, reference, atol=1e-5, rtol=0)
        cache = draft.new_cache()
        first, second = draft(x[:, :6], cache=cache), draft(x[:, 6:], cache=cache)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], dim=1), reference, atol=1e-5, rtol=0)
    assert cache.get_seq_length() == 10  # main K/V only: no stream ever entered the cache


def test_a_shallow_draft_equals_the_targets_first_layers(llama):
    draft = drafter(llama, num_layers=2, num_streams=1, num_stream_layers=1)
    shallow = tiny_model("llama", layers=2, vocab=VOCAB)
    shallow.load_state_dict(llama.state_dict(), strict=False)  # layers 3 and 4 are unexpected and dropped
    x = tokens(7)
    with torch.no_grad():
        torch.testing.assert_close(draft(x).logits, shallow(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("source_layers, numbers", [("first", [1, 2]), ("last", [3, 4]), ([4, 1], [4, 1])])
def test_a_draft_starts_from_the_target_layers_it_names(llama, source_layers, numbers):
    draft = drafter(llama, num_layers=2, num_streams=1, num_stream_layers=1, source_layers=source_layers)
    layers = llama.get_decoder().layers
    for layer, number in zip(draft.layers, numbers, strict=True):
        torch.testing.assert_close(layer.mlp.up_proj.weight, layers[number - 1].mlp.up_proj.weight, atol=0, rtol=0)


def test_a_tied_target_gives_a_tied_draft():
    tied = tiny_model("llama", layers=2, vocab=VOCAB)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    draft = MirrorDrafterForCausalLM.from_target(tied, num_layers=2)
    assert draft.config.tie_word_embeddings and draft.lm_head.weight is draft.embed_tokens.weight
    x = tokens(6)
    with torch.no_grad():
        torch.testing.assert_close(draft(x).logits, tied(x).logits, atol=1e-5, rtol=0)


def test_streams_never_change_the_main_stream(llama):
    draft = drafter(llama)
    x = tokens(9, batch=2)
    with torch.no_grad():
        main_only = draft(x, num_streams=0)
        with_streams = draft(x)
        draft.stream_embeddings.weight.add_(torch.randn_like(draft.stream_embeddings.weight))
        perturbed = draft(x)
    assert main_only.stream_logits is None and with_streams.stream_logits.shape == (2, 9, 2, VOCAB)
    # Main and stream rows share each matmul (one call, more rows): equal up to a GEMM's row-count rounding
    torch.testing.assert_close(with_streams.logits, main_only.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(perturbed.logits, main_only.logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(perturbed.stream_logits, with_streams.stream_logits)


def test_a_multi_stream_layer_computes_main_and_streams_as_separate_calls_would(llama):
    """The layer runs main and stream rows through each norm, projection and MLP in one call (fewer weight reads
    while decoding); that is the same function as running the main rows and each stream's rows on their own."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    from mirror_train.models.multi_stream_attention import _stream_attention, causal_mask

    draft = drafter(llama).eval()
    layer = draft.layers[draft.first_stream_layer]
    attn = layer.self_attn
    torch.manual_seed(0)
    B, T, S, H = 2, 5, 2, draft.config.hidden_size
    h, hs = torch.randn(B, T, H), torch.randn(B, T, S, H)
    position_ids = torch.arange(T)[None]
    rope = draft.rotary_emb(h, position_ids)
    mask = causal_mask(0, T, None, h.dtype, h.device)
    with torch.no_grad():
        main, streams = layer(h, hs, rope, mask)
        # the reference: each part through its own calls
        d, groups = attn.head_dim, attn.num_key_value_groups
        x, xs = layer.input_layernorm(h), layer.input_layernorm(hs)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        q, k, v = (proj(x).view(B, T, -1, d).transpose(1, 2) for proj in projections)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        a = attn.o_proj(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
            .transpose(1, 2)
            .reshape(B, T, -1)
        )
        qs, ks, vs = (proj(xs).view(B, T * S, -1, d).transpose(1, 2) for proj in projections)
        cos, sin = (r.repeat_interleave(S, dim=1) for r in rope)
        qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
        a_s = _stream_attention(qs, repeat_kv(ks, groups), repeat_kv(vs, groups), k, v, mask, S, attn.scaling)
        a_s = attn.o_proj(a_s.transpose(1, 2).reshape(B, T, S, -1))
        ref_main = h + a
        ref_main = ref_main + layer.mlp(layer.post_attention_layernorm(ref_main))
        ref_streams = hs + a_s
        ref_streams = ref_streams + layer.mlp(layer.post_attention_layernorm(ref_streams))
    torch.testing.assert_close(main, ref_main, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(streams, ref_streams, atol=1e-5, rtol=1e-5)
    assert layer(h, None, rope, mask)[1] is None


# --- what a stream may see -----------------------------------------------------------------------------------------
def test_a_future_main_token_does_not_reach_earlier_streams(llama):
    draft = drafter(llama)
    x = tokens(9)
    y = x.clone()
    y[0, 6] = (y[0, 6] + 1) % VOCAB
    with torch.no_grad():
        a, b = draft(x).stream_logits, draft(y).stream_logits
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_stream_j_does_not_see_stream_j_plus_1(llama):
    draft = drafter(llama, num_streams=3)
    x = tokens(8)
    with torch.no_grad():
        before = draft(x).stream_logits
        draft.stream_embeddings.weight[1].add_(1.0)  # stream 2 (of 1..3)
        after = draft(x).stream_logits
    torch.testing.assert_close(after[:, :, 0], before[:, :, 0], atol=1e-6, rtol=0)
    assert not torch.allclose(after[:, :, 1], before[:, :, 1])
    assert not torch.allclose(after[:, :, 2], before[:, :, 2])  # stream 3 sees stream 2


def test_streams_at_one_position_ignore_the_streams_at_others(llama):
    """Streams at t computed after a main-only prefill (no earlier streams ever existed) match a full forward."""
    draft = drafter(llama)
    x = tokens(8)
    with torch.no_grad():
        full = draft(x).stream_logits
        cache = prefill(draft, x[:, :5])
        incremental = draft(x[:, 5:], cache=cache).stream_logits
    torch.testing.assert_close(incremental, full[:, 5:], atol=1e-5, rtol=0)


# --- save / load -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"draft_vocab": [0, 2, 5, 7, *range(20, 60)]},
        {"feature_conditioning": "target_hidden", "target_exit_layer": 2},
    ],
)
def test_save_pretrained_round_trips_through_auto_model(llama, tmp_path, kwargs):
    from transformers import AutoModelForCausalLM

    import mirror_train.models  # noqa: F401  (registers the Auto classes)

    draft = drafter(llama, **kwargs)
    with torch.no_grad():
        draft.stream_embeddings.weight.normal_()
        if draft.fusion is not None:
            draft.fusion.proj.weight.normal_(std=0.1)  # not the init value, so the load must really restore it
    draft.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MirrorDrafterForCausalLM
    x = tokens(6)
    features = {"exit": torch.randn(1, 6, 32)} if draft.fusion is not None else None
    with torch.no_grad():
        a, b = draft(x, features=features), loaded(x, features=features)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.stream_logits, b.stream_logits)
    if "draft_vocab" in kwargs:
        assert torch.equal(loaded.d2t, torch.tensor(kwargs["draft_vocab"]))
        assert a.logits.shape[-1] == len(kwargs["draft_vocab"])


def test_tied_embeddings_stay_tied_through_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    import mirror_train.models  # noqa: F401

    draft = MirrorDrafterForCausalLM(tiny_draft_config(tie_word_embeddings=True))
    assert draft.lm_head.weight is draft.embed_tokens.weight
    draft.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    x = tokens(5)
    with torch.no_grad():
        assert torch.equal(draft(x).logits, loaded(x).logits)


# --- the reduced vocabulary ------------------------------------------------------------------------------------------
def test_reduced_vocabulary_maps_between_draft_and_target_ids(llama):
    ids = [3, 9, 4, 100]
    draft = drafter(llama, draft_vocab=ids)
    assert draft.draft_to_target(torch.tensor([0, 3])).tolist() == [3, 100]
    assert draft.target_to_draft(torch.tensor([100, 3, 5, -100])).tolist() == [3, 0, -100, -100]
    x = tokens(4)
    with torch.no_grad():
        full = llama(x).logits
        logits = draft(x).logits
    torch.testing.assert_close(logits, full[..., ids], atol=1e-5, rtol=0)
    mapped = draft.to_target_logits(logits)
    torch.testing.assert_close(mapped[..., ids], logits)
    assert mapped[..., 5].isneginf().all()


def test_frequent_token_map_keeps_specials_and_the_most_frequent_ids():
    data = [[5, 5, 5, 7, 7, 9], [7, 5, 11, 11, 11, 11]]
    assert frequent_token_map(data, size=3, vocab_size=20, special_ids=[2]).tolist() == [2, 5, 11]
    assert frequent_token_map(data, size=6, vocab_size=20).tolist() == [0, 1, 5, 7, 9, 11]  # filled from the bottom
    with pytest.raises(MirrorTrainError, match="outside the vocabulary"):
        frequent_token_map([[25]], size=3, vocab_size=20)
    with pytest.raises(MirrorTrainError, match="do not fit"):
        frequent_token_map(data, size=1, vocab_size=20, special_ids=[0, 1])


# --- the engine's rollout --------------------------------------------------------------------------------------------
def reference_rollout(draft, sequence: list[int], gamma: int, use_streams: bool) -> list[int]:
    """Greedy rollout by uncached full forwards, one pass at a time, in target ids."""
    produced = []
    while len(produced) < gamma:
        with torch.no_grad():
            out = draft(torch.tensor([sequence + produced]))
        step = out.logits[0, -1:].argmax(-1)
        if use_streams:
            step = torch.cat([step, out.stream_logits[0, -1].argmax(-1)])
        produced += draft.draft_to_target(step).tolist()[: gamma - len(produced)]
    return produced


@pytest.mark.parametrize("use_streams,forwards", [(True, 2), (False, 5)])
def test_tree_batched_rollout_equals_each_branch_alone(llama, use_streams, forwards):
    draft = drafter(llama)
    context = tokens(6, seed=1)
    roots = [[5], [7, 9], [11, 3, 4], [7, 9]]  # ragged, and two identical branches
    batched = rollout(draft, prefill(draft, context), roots, gamma=5, use_streams=use_streams)
    for root, result in zip(roots, batched):
        alone = rollout(draft, prefill(draft, context), [root], gamma=5, use_streams=use_streams)[0]
        assert result.tokens == alone.tokens
        assert result.num_forwards == forwards == math.ceil(5 / (1 + 2 * use_streams))
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
        assert result.tokens == reference_rollout(draft, context[0].tolist() + root, 5, use_streams)
    assert batched[1].tokens == batched[3].tokens


def test_rollout_returns_target_ids_with_a_reduced_vocabulary(llama):
    ids = list(range(64, 128))
    draft = drafter(llama, draft_vocab=ids)
    context = tokens(5)
    result = rollout(draft, prefill(draft, context), [[1], [2, 3]], gamma=4)
    for root, r in zip([[1], [2, 3]], result):
        assert all(t in ids for t in r.tokens)
        assert r.tokens == reference_rollout(draft, context[0].tolist() + root, 4, True)


def test_sampled_rollout_is_reproducible_and_reports_its_logprobs(llama):
    draft = drafter(llama)
    context = tokens(5)
    runs = [
        rollout(
            draft,
            prefill(draft, context),
            [[1], [2]],
            gamma=4,
            temperature=0.8,
            generator=torch.Generator().manual_seed(3),
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert all(len(r.tokens) == len(r.logprobs) == 4 and all(lp <= 0 for lp in r.logprobs) for r in runs[0])


@pytest.mark.parametrize("use_streams", [True, False])
@pytest.mark.parametrize("draft_vocab", [None, list(range(64, 128))])
def test_a_coupled_rollout_adds_the_noise_of_each_tokens_own_sequence_index(llama, use_streams, draft_vocab):
    """At T > 0 the draft adds the target's noise of a token's position to its logits (`coupled_choice`): a noise
    that puts one id far ahead at each sequence index must show up as that id at exactly that index, on every
    branch (ragged roots: the same depth is a different index) and every stream's token; zero noise is greedy."""
    draft = drafter(llama, draft_vocab=draft_vocab)
    context = tokens(5)
    roots = [[1], [2, 3], [4, 5, 6]]
    ids = draft_vocab or list(range(VOCAB))

    def planted(indices):  # a large bonus on one draft-reachable id per index
        rows = torch.zeros(len(indices), VOCAB)
        for n, i in enumerate(indices):
            rows[n, ids[(7 * i) % len(ids)]] = 1e4
        return rows

    out = rollout(draft, prefill(draft, context), roots, gamma=5, use_streams=use_streams, noise=planted)
    for root, r in zip(roots, out):
        first = context.shape[1] + len(root)  # the sequence index of the branch's first drafted token
        assert r.tokens == [ids[(7 * (first + j)) % len(ids)] for j in range(5)]
        assert r.num_forwards == math.ceil(5 / (1 + 2 * use_streams))

    def zeros(indices):
        return torch.zeros(len(indices), VOCAB)

    plain = rollout(draft, prefill(draft, context), roots, gamma=5, use_streams=use_streams)
    quiet = rollout(draft, prefill(draft, context), roots, gamma=5, use_streams=use_streams, noise=zeros)
    assert [r.tokens for r in quiet] == [r.tokens for r in plain]


# --- the KV cache ----------------------------------------------------------------------------------------------------
def test_keep_cache_path_keeps_exactly_the_chosen_branch(llama):
    draft = drafter(llama)
    context = tokens(6, seed=2)
    cache = prefill(draft, context)
    roots = [[5], [7, 9], [11]]
    results = rollout(draft, cache, roots, gamma=5)
    fed = sum(len(r.nodes) for r in results)
    assert cache.get_seq_length() == 6 + fed  # only main tokens: each fed node adds one slot, streams none
    chosen = results[1]
    kept = chosen.nodes[:4]  # the root and the first two rollout tokens
    keep_cache_path(cache, 6, kept)
    assert cache.get_seq_length() == 6 + 4
    branch = roots[1] + chosen.tokens[:2]
    next_token = torch.tensor([[chosen.tokens[2]]])
    with torch.no_grad():
        continued = draft(next_token, cache=cache)
        scratch = draft(torch.cat([context, torch.tensor([branch]), next_token], dim=1))
    torch.testing.assert_close(continued.logits[0, -1], scratch.logits[0, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(continued.stream_logits[0, -1], scratch.stream_logits[0, -1], atol=1e-5, rtol=0)
    # the draft's cache grows in place (kv_cache.py) and a kept path moves down inside its buffers, uncopied
    from mirror_train.kv_cache import GrowingLayer

    layer = cache.layers[0]
    assert isinstance(layer, GrowingLayer) and layer.keys.data_ptr() == layer._key_buffer.data_ptr()


def test_tree_forward_positions_follow_depth(llama):
    """A node at depth d after a committed context of L sits at position L + d, whatever its slot."""
    draft = drafter(llama)
    context = tokens(4)
    cache = prefill(draft, context)
    # Two branches interleaved in slot order: a = [1, 2], b = [3, 4].
    out = draft.tree_forward([1, 3, 2, 4], [-1, -1, 0, 1], cache)
    with torch.no_grad():
        a = draft(torch.cat([context, torch.tensor([[1, 2]])], dim=1))
        b = draft(torch.cat([context, torch.tensor([[3, 4]])], dim=1))
    torch.testing.assert_close(out.logits[0, [0, 2]], a.logits[0, -2:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[0, [1, 3]], b.logits[0, -2:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.stream_logits[0, 3], b.stream_logits[0, -1], atol=1e-5, rtol=0)


# --- feature conditioning --------------------------------------------------------------------------------------------
def test_feature_fusion_starts_as_the_token_only_model(llama):
    plain = drafter(llama)
    conditioned = drafter(llama, feature_conditioning="target_hidden", target_exit_layer=2)
    conditioned.stream_embeddings.load_state_dict(plain.stream_embeddings.state_dict())  # P_j start random
    assert conditioned.config.target_hidden_size == 32
    x = tokens(7)
    features = torch.randn(1, 7, 32)
    with torch.no_grad():
        reference = plain(x)
        at_init = conditioned(x, features={"exit": features})
        assert torch.equal(at_init.logits, reference.logits)
        assert torch.equal(at_init.stream_logits, reference.stream_logits)
        conditioned.fusion.proj.weight[:, 32:].normal_(std=0.1)
        trained = conditioned(x, features={"exit": features})
        without = conditioned(x)  # no features: zeros, so the token half alone
    assert not torch.allclose(trained.logits, reference.logits)
    torch.testing.assert_close(without.logits, reference.logits, atol=1e-5, rtol=0)
    with pytest.raises(MirrorTrainError, match="feature_conditioning='none'"):
        plain(x, features={"exit": features})


def test_paired_features_read_the_state_before_each_position():
    """EAGLE's pairing: the input at t reads the state of t−1 (none at t = 0); withheld positions read none."""
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    paired = paired_features(hidden)
    assert torch.equal(paired[:, 0], torch.zeros(2, 3)) and torch.equal(paired[:, 1:], hidden[:, :-1])
    withheld = torch.tensor([[False, True, False, False], [False, False, False, True]])
    dropped = paired_features(hidden, withheld)
    assert torch.equal(dropped[0, 1], torch.zeros(3)) and torch.equal(dropped[1, 3], torch.zeros(3))
    assert torch.equal(dropped[0, 2], hidden[0, 1])


@pytest.mark.parametrize("past,tree", [(0, False), (5, False), (3, True)])
def test_stream_attention_equals_one_sdpa_call_over_the_stream_mask(past, tree):
    """The streams' attention, computed over the main keys and each anchor's own streams, equals the one-call
    reference: SDPA over [main ; all stream] keys under `stream_attention_mask`."""
    import torch.nn.functional as F

    from mirror_train.models.multi_stream_attention import (
        _stream_attention,
        causal_mask,
        stream_attention_mask,
        tree_mask,
    )

    torch.manual_seed(0)
    B, nh, T, S, d = 2, 3, 4, 3, 8
    if tree:
        main_mask = tree_mask([-1, 0, -1, 2], past, T, torch.float32)[0].expand(B, 1, -1, -1)
    else:
        main_mask = causal_mask(past, T, None, torch.float32, torch.device("cpu")).expand(B, 1, -1, -1)
    qs, ks, vs = (torch.randn(B, nh, T * S, d) for _ in range(3))
    k, v = torch.randn(B, nh, past + T, d), torch.randn(B, nh, past + T, d)
    reference = F.scaled_dot_product_attention(
        qs, torch.cat([k, ks], 2), torch.cat([v, vs], 2), attn_mask=stream_attention_mask(main_mask, S), scale=0.3
    )
    torch.testing.assert_close(_stream_attention(qs, ks, vs, k, v, main_mask, S, 0.3), reference, atol=1e-5, rtol=0)


def test_a_packed_row_computes_each_window_alone(llama):
    """Training packs windows of different lengths into one row (no padding slot runs through the model): under
    the block-causal mask, with positions restarting and states paired inside each window, main and stream logits
    equal each window's own forward."""
    from mirror_train.data.features import pack_rows
    from mirror_train.models.multi_stream_attention import packed_causal_mask

    draft = drafter(llama, feature_conditioning="target_hidden", target_exit_layer=2)
    with torch.no_grad():
        draft.fusion.proj.weight[:, 32:].normal_(std=0.3)
    lengths = [6, 3, 5]
    windows = [(tokens(n, seed=n), torch.randn(1, n, 32)) for n in lengths]
    T = max(lengths)
    padded = {
        "token_ids": torch.zeros(3, T, dtype=torch.long),
        "hidden": torch.zeros(3, T, 32),
        "mask": torch.zeros(3, T, dtype=torch.long),
    }
    for row, (x, h) in enumerate(windows):
        n = x.shape[1]
        padded["token_ids"][row, :n], padded["hidden"][row, :n], padded["mask"][row, :n] = x[0], h[0], 1
    packed = pack_rows(padded)
    assert packed["token_ids"].shape == (1, sum(lengths))
    assert packed["segments"][0].tolist() == [0] * 6 + [1] * 3 + [2] * 5
    with torch.no_grad():
        out = draft(
            packed["token_ids"],
            position_ids=packed["position_ids"],
            attention_mask_4d=packed_causal_mask(packed["segments"], torch.float32),
            features={"exit": paired_features(packed["hidden"], segments=packed["segments"])},
        )
        start = 0
        for x, h in windows:
            alone = draft(x, features={"exit": paired_features(h)})
            n = x.shape[1]
            torch.testing.assert_close(out.logits[:, start : start + n], alone.logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.stream_logits[:, start : start + n], alone.stream_logits, atol=1e-5, rtol=0)
            start += n


def test_rollout_reads_the_roots_target_features(llama):
    draft = drafter(llama, feature_conditioning="target_hidden", target_exit_layer=2)
    with torch.no_grad():
        draft.fusion.proj.weight[:, 32:].normal_(std=0.3)
    context = tokens(5)
    roots = [[1], [2, 3]]
    features = [torch.randn(1, 32), torch.randn(2, 32)]
    batched = rollout(draft, prefill(draft, context), roots, gamma=3, features={"exit": torch.cat(features)})
    for root, feature, result in zip(roots, features, batched):
        alone = rollout(draft, prefill(draft, context), [root], gamma=3, features={"exit": feature})
        assert result.tokens == alone[0].tokens
    unconditioned = rollout(draft, prefill(draft, context), roots, gamma=3)
    assert [r.logprobs for r in unconditioned] != [r.logprobs for r in batched]


# --- training and scratch init ---------------------------------------------------------------------------------------
def tiny_draft_config(**kwargs) -> MirrorDrafterConfig:
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_streams=2,
        num_stream_layers=1,
    )
    return MirrorDrafterConfig(**{**sizes, **kwargs})


def test_a_scratch_draft_trains_its_streams():
    torch.manual_seed(0)
    draft = MirrorDrafterForCausalLM(tiny_draft_config(feature_conditioning="target_hidden", target_hidden_size=48))
    assert 0 < draft.stream_embeddings.weight.std() < 0.05
    assert torch.equal(draft.fusion.proj.weight, torch.eye(32, 80))
    x = tokens(12, batch=2)
    out = draft(x, features={"exit": torch.randn(2, 12, 48)}, labels=x)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert draft.stream_embeddings.weight.grad.abs().sum() > 0
    assert draft.fusion.proj.weight.grad[:, 32:].abs().sum() > 0


# --- user mistakes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_streams": -1}, "num_streams"),
        ({"num_stream_layers": 3}, "num_stream_layers"),
        ({"num_stream_layers": 0}, "needs num_stream_layers"),
        ({"draft_vocab_size": VOCAB + 1}, "draft_vocab_size"),
        ({"draft_vocab_size": 10, "tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"feature_conditioning": "eagle"}, "feature_conditioning"),
    ],
)
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(MirrorTrainError, match=message):
        tiny_draft_config(**kwargs)


def test_bad_from_target_arguments_are_refused(llama):
    with pytest.raises(MirrorTrainError, match="num_layers"):
        drafter(llama, num_layers=5)
    with pytest.raises(MirrorTrainError, match="num_stream_layers"):
        drafter(llama, num_layers=2, num_stream_layers=3)
    for source_layers in ("middle", [1], [0, 1], [1, 5]):
        with pytest.raises(MirrorTrainError, match="source_layers"):
            drafter(llama, num_layers=2, source_layers=source_layers)
    with pytest.raises(MirrorTrainError, match="outside the target's vocabulary"):
        drafter(llama, draft_vocab=[1, VOCAB])
    with pytest.raises(MirrorTrainError, match="sliding-window"):
        MirrorDrafterForCausalLM.from_target(tiny_model("mistral", layers=2, vocab=VOCAB), num_layers=2)


def test_a_mismatched_target_or_tokenizer_is_refused(llama):
    tokenizer = tiny_tokenizer(VOCAB)
    draft = drafter(llama, tokenizer=tokenizer)
    check_compatible(draft, llama, tokenizer)
    with pytest.raises(MirrorTrainError, match="vocabulary has 128 ids, the target's 64"):
        check_compatible(draft, tiny_model("llama", layers=4, vocab=64))
    with pytest.raises(MirrorTrainError, match="tokenizer_fingerprint"):
        check_compatible(draft, llama, tiny_tokenizer(100))
    with pytest.raises(MirrorTrainError, match="tokenizer_fingerprint"):
        check_compatible(draft, Target(llama, tiny_tokenizer(100)))  # a Target brings its own tokenizer


def test_bad_rollout_arguments_are_refused(llama):
    draft = drafter(llama)
    cache = prefill(draft, tokens(4))
    with pytest.raises(MirrorTrainError, match="root"):
        rollout(draft, cache, [[1], []], gamma=3)
    with pytest.raises(MirrorTrainError, match="gamma"):
        rollout(draft, cache, [[1]], gamma=0)
    with pytest.raises(MirrorTrainError, match="num_streams must be in 0..2"):
        draft(tokens(3), num_streams=3)
    with pytest.raises(MirrorTrainError, match="parent"):
        draft.tree_forward([1, 2], [-1, 1], cache)


# --- training-time test: what training shows a rolled-out token is what serving gives it -------------------------
@pytest.mark.parametrize("answers_from", [None, 5])
@pytest.mark.parametrize("slots", [["exit", "own"], ["exit", "final", "own"], ["exit"]])
def test_a_training_time_test_step_equals_the_served_rollout(llama, slots, answers_from):
    """Step k at position p (unrolled_forward over a packed row) = the draft served: the context up to p−k fed with
    its target states, then the chain p−k+1..p fed one token at a time, each reading the state that predicted it
    (and, for the first `window` steps, the ℓe state, as a Mirror-SD window's tokens do)."""
    from mirror_train.drafter_training import unrolled_forward

    torch.manual_seed(0)
    draft = drafter(llama, num_streams=1, num_stream_layers=1, feature_conditioning="target_hidden")
    draft.config.feature_slots = slots
    draft = MirrorDrafterForCausalLM(draft.config).eval()  # fusion with these slots, random weights
    T, H, steps, window = 12, llama.config.hidden_size, 3, 2
    x = tokens(T, seed=3)
    exit_states, final_states = torch.randn(1, T, H), torch.randn(1, T, H)
    batch = {
        "token_ids": x,
        "position_ids": torch.arange(T)[None],
        "segments": torch.zeros(1, T, dtype=torch.long),
    }
    if answers_from is not None:
        batch["is_answer"] = (torch.arange(T) >= answers_from)[None]
    states = {"exit": paired_features(exit_states), "final": paired_features(final_states)}
    states = {slot: states[slot] for slot in slots if slot in states}
    with torch.no_grad():
        outs, rows = unrolled_forward(draft, draft, batch, states, steps, window)
    for k in range(1, steps + 1):
        first = k if answers_from is None else answers_from + k - 1  # where the chain's first token may be
        assert rows[k].tolist() == list(range(first, T))
        for i, p in enumerate(range(first, T)):
            anchor = p - k
            cache = draft.new_cache()
            with torch.no_grad():
                out = draft(
                    x[:, : anchor + 1],
                    cache=cache,
                    num_streams=0,
                    features={slot: f[:, : anchor + 1] for slot, f in states.items()},
                )
                own = out.hidden[:, -1:]  # the state that predicted x[anchor + 1]
                for j in range(1, k + 1):
                    q = anchor + j
                    features = {}
                    if "own" in slots:
                        features["own"] = own
                    if j <= window and "exit" in slots:
                        features["exit"] = states["exit"][:, q : q + 1]
                    out = draft(x[:, q : q + 1], cache=cache, num_streams=0, features=features or None)
                    own = out.hidden
            torch.testing.assert_close(outs[k].logits[0, i], out.logits[0, 0], atol=1e-5, rtol=1e-4)


def test_training_time_test_steps_run_only_where_a_served_rollout_would():
    """With the answers marked, the steps ≥ 1 run at the positions whose chain starts at an answer token, in its
    own sequence: the prompt's positions are never rolled out from when served."""
    from mirror_train.drafter_training import ttt_rows

    batch = {
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]),
        "is_answer": torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]]),
    }
    rows = ttt_rows(batch, 2)
    assert rows[1].tolist() == [2, 3, 4, 6, 7]
    assert rows[2].tolist() == [3, 4, 7]  # chains (2, 3), (3, 4), (6, 7)
