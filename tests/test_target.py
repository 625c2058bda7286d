"""The split target equals the plain model: prefix-then-suffix = full forward, crop-then-continue = recompute."""

from __future__ import annotations

import pytest
import torch

from mirror_train import attention, fastpath, kernels
from mirror_train.errors import MirrorTrainError
from mirror_train.target import Target, check_exit_layer
from tests.conftest import INEXACT_GEMMS, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"]
ATOL = 1e-5  # fp32: only summation order differs


def split_forward(target: Target, ids: torch.Tensor, chunks: list[int], exits: list[int]) -> torch.Tensor:
    """Feed `ids` in windows of the given sizes, each split at its own exit layer, into one cache."""
    cache, out, pos = target.new_cache(), [], 0
    for size, exit_layer in zip(chunks, exits):
        state = target.prefix(ids[:, pos : pos + size], cache, exit_layer)
        out.append(target.suffix(state))
        pos += size
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_then_suffix_equals_full_forward(family):
    model = tiny_model(family, layers=4)
    target = Target(model)
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        full = model(ids).logits
    # windows long enough to run past the sliding window (6) of the sliding families
    got = split_forward(target, ids, chunks=[9, 1, 4, 6], exits=[2, 1, 3, 2])
    torch.testing.assert_close(got, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hidden_is_hidden_states_at_exit(family):
    model = tiny_model(family, layers=4)
    target = Target(model)
    ids = torch.randint(0, 128, (1, 10))
    hidden, _ = target.hidden_states(ids)
    state = target.prefix(ids, target.new_cache(), 3)
    torch.testing.assert_close(state.hidden, hidden[3], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_crop_then_continue_equals_recompute(family):
    model = tiny_model(family, layers=4)
    target = Target(model)
    ids = torch.randint(0, 128, (1, 16))
    cache = target.new_cache()
    target.forward(ids[:, :12], cache)  # commit 12, as if a window of drafts had been verified
    target.crop(cache, 8)  # reject the last 4
    assert target.cache_length(cache) == 8
    resumed = target.forward(ids[:, 8:], cache)
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(resumed, full[:, 8:], atol=ATOL, rtol=0)


def test_crop_after_aborted_prefix_levels_all_layers():
    """A step aborted between the halves leaves the lower layers longer; crop must level them."""
    target = Target(tiny_model("llama", layers=4))
    ids = torch.randint(0, 128, (1, 10))
    cache = target.new_cache()
    target.forward(ids[:, :6], cache)
    target.prefix(ids[:, 6:], cache, 2)  # no suffix
    assert [layer.get_seq_length() for layer in cache.layers] == [10, 10, 6, 6]
    target.crop(cache, 6)
    assert [layer.get_seq_length() for layer in cache.layers] == [6] * 4
    torch.testing.assert_close(
        target.forward(ids[:, 6:], cache), tiny_target_full(target, ids)[:, 6:], atol=ATOL, rtol=0
    )


def tiny_target_full(target: Target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return target.model(ids).logits


def test_lens_at_last_layer_is_final_logits():
    target = Target(tiny_model("llama", layers=3))
    ids = torch.randint(0, 128, (1, 7))
    hidden, logits = target.hidden_states(ids)
    # hidden_states[N] already has the final norm applied (transformers' convention), so use the suffix path:
    state = target.prefix(ids, target.new_cache(), 2)
    torch.testing.assert_close(target.suffix(state), logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(target.lens_logits(hidden[2]), target.lens_logits(state.hidden), atol=ATOL, rtol=0)


@pytest.mark.parametrize("bad", [0, 4, -1, 2.5, True, "2"])
def test_exit_layer_out_of_range_is_a_clear_error(bad):
    with pytest.raises(MirrorTrainError, match=r"outside 1\.\.3"):
        check_exit_layer(bad, 4)


def test_frozen():
    target = Target(tiny_model("llama"))
    assert not any(p.requires_grad for p in target.model.parameters())


@pytest.mark.testbed
def test_testbed_prefix_suffix_and_crop(testbed_target):
    target = testbed_target
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    ids = torch.tensor([target.tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]])
    with torch.no_grad():
        full = target.model(ids).logits
    n = ids.shape[1]
    got = split_forward(target, ids, chunks=[n - 9, 1, 8], exits=[15, 15, 12])
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)

    cache = target.new_cache()
    target.forward(ids[:, : n - 3], cache)
    target.crop(cache, n - 8)
    torch.testing.assert_close(target.forward(ids[:, n - 8 :], cache), full[:, n - 8 :], atol=1e-4, rtol=0)


@pytest.mark.testbed
@pytest.mark.skipif(not kernels.available(), reason="no C compiler here to build the row-exact kernel")
def test_a_float32_window_on_the_row_exact_kernels_scores_bit_for_bit_as_one_token_steps(testbed_target):
    """With fastpath's exact kernels (float32 on a CPU) the matmuls and the attention are row-exact, so a float32
    window equals one-token decoding bit for bit, as in bf16 above (torch's own float32 GEMMs differ by ~1e-5)."""
    target = testbed_target
    fastpath.install(target.model, "exact")
    assert attention.gemm_row_invariant(target.model)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        ids = torch.randint(0, target.vocab_size, (1, 209), generator=g)
        cache = target.new_cache()
        target.forward(ids[:, :200], cache)
        one = torch.cat([target.forward(ids[:, 200 + i : 201 + i], cache) for i in range(9)], dim=1)
        for width, exit_layer in ((9, 15), (5, 7), (2, 29)):
            target.crop(cache, 200)
            window = target.suffix(target.prefix(ids[:, 200 : 200 + width], cache, exit_layer))
            assert torch.equal(window, one[:, :width]), width


@pytest.mark.testbed
def test_a_bf16_window_scores_bit_for_bit_as_one_token_steps(testbed_target):
    """mirror_train/attention.py: a window over a cache (any length, any split at ℓe) equals one-token decoding of
    the same tokens bit for bit in bf16; with transformers' fused SDPA it does not (measured 0.6 in a logit)."""
    target = testbed_target.cast(torch.bfloat16)
    assert target.row_invariant
    if not target.exact_windows:
        pytest.skip(INEXACT_GEMMS)
    g = torch.Generator().manual_seed(0)
    for context in (150, 301):
        ids = torch.randint(0, target.vocab_size, (1, context + 5), generator=g)
        cache = target.new_cache()
        target.forward(ids[:, :context], cache)
        one = torch.cat([target.forward(ids[:, context + i : context + i + 1], cache) for i in range(5)], dim=1)
        for width, exit_layer in ((5, 15), (3, 7), (2, 29)):
            target.crop(cache, context)
            window = target.suffix(target.prefix(ids[:, context : context + width], cache, exit_layer))
            assert torch.equal(window, one[:, :width]), (context, width)


def test_the_matmul_probe_catches_a_product_that_rounds_by_row_count(monkeypatch):
    """`exact_windows` needs matmuls whose rows do not depend on how many rows a product has; the probe sees one
    that does (here: a product of more than one row nudged by one ulp-ish step) and the engine then warns for a
    low-precision target."""
    import torch.nn.functional as F

    model = tiny_model("llama")
    real = F.linear

    def row_by_row(x, w, b=None):  # every row its own product: row-invariant by construction
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([real(rows[r : r + 1], w, b) for r in range(len(rows))]).reshape(*x.shape[:-1], -1)

    monkeypatch.setattr(torch.nn.functional, "linear", row_by_row)
    assert attention.gemm_row_invariant(model)

    def rounds_by_rows(x, w, b=None):
        out = real(x, w, b)
        return out + 1e-3 if x.dim() == 2 and x.shape[0] > 1 else out

    monkeypatch.setattr(torch.nn.functional, "linear", rounds_by_rows)
    assert not attention.gemm_row_invariant(model)
    monkeypatch.undo()

    from mirror_train.engine import MirrorEngine

    target = Target(tiny_model("llama").to(torch.bfloat16))
    target.exact_windows = False
    with pytest.warns(UserWarning, match="float32"):
        MirrorEngine(target).close()


def test_row_invariant_attention_leaves_other_shapes_to_sdpa():
    """Batches, prefill and trees (not a plain causal window at the end of a cache) take transformers' SDPA."""
    from mirror_train.attention import _plain_causal_window

    q, k = 3, 10
    causal = torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None]
    assert _plain_causal_window(None, q, k)
    assert _plain_causal_window(causal[None, None], q, k)
    assert _plain_causal_window(torch.where(causal, 0.0, float("-inf"))[None, None], q, k)
    tree = causal.clone()
    tree[2, k - 2] = False  # a sibling branch: not a plain window
    assert not _plain_causal_window(tree[None, None], q, k)
    assert not _plain_causal_window(causal[None, None].expand(2, 1, q, k), q, k)


def test_the_fast_path_computes_the_same_function_and_a_copy_is_plain():
    """fastpath.install swaps every Linear in place for oneDNN's prepacked one: the same logits (to float32
    rounding), the same greedy tokens; a deep copy (a cast target) is a plain model again. (The row-exact kernels,
    auto's float32 choice where they build: tests/test_kernels.py.)"""
    import copy

    from tests.conftest import tiny_model

    model = tiny_model()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids).logits
        assert fastpath.install(model, "onednn" if torch.backends.mkldnn.is_available() else "none") != "exact"
        fast = model(ids).logits
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(fast.argmax(-1), plain.argmax(-1))
    assert not fastpath.installed(copy.deepcopy(model))
    with pytest.raises(MirrorTrainError, match="fast_path"):
        fastpath.resolve("turbo", "cpu")


def test_the_growing_cache_holds_what_a_concatenating_one_holds_through_rollbacks_and_regrowth():
    """kv_cache.GrowingLayer against transformers' DynamicLayer: the same keys and values after appends, crops
    (rollbacks) and growth past its buffer, and a base-class method that replaces the tensors is followed."""
    from transformers.cache_utils import DynamicLayer

    from mirror_train.kv_cache import MIN_CAPACITY, GrowingLayer

    g = torch.Generator().manual_seed(0)
    grown, plain = GrowingLayer(), DynamicLayer()
    for step, (new, drop) in enumerate([(200, 0), (5, 3), (1, 0), (60, 10), (9, 9), (300, 0), (2, 1)]):
        k, v = torch.randn(2, 1, 3, new, 4, generator=g)
        got, want = grown.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        grown.crop(-drop) if drop else None
        plain.crop(-drop) if drop else None
        assert grown.get_seq_length() == plain.get_seq_length()
    assert grown._key_buffer.shape[-2] >= 2 * MIN_CAPACITY  # it grew, and kept what it held
    grown.batch_repeat_interleave(2)
    plain.batch_repeat_interleave(2)
    k, v = torch.randn(2, 2, 3, 1, 4, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(grown.update(k, v), plain.update(k, v)))
    # the fused layers' way: reserve, write into the buffers, extend; a count alone until something reads them
    for step, (new, drop) in enumerate([(3, 0), (1, 1), (400, 0), (2, 2), (5, 0)]):
        k, v = torch.randn(2, 2, 3, new, 4, generator=g)
        n = grown.get_seq_length()
        keys, values = grown.reserve(new)
        keys[..., n : n + new, :], values[..., n : n + new, :] = k, v
        grown.extend(new)
        assert grown.__dict__["keys"] is None and grown.get_seq_length() == n + new  # no view made
        plain.update(k, v)
        if drop:
            grown.crop(-drop)
            plain.crop(-drop)
        assert grown.get_seq_length() == plain.get_seq_length(), step
        assert torch.equal(grown.keys, plain.keys) and torch.equal(grown.values, plain.values), step
    grown.reset()
    plain.reset()
    assert grown.get_seq_length() == 0 and not grown.is_initialized and grown.keys is None


def test_a_loaded_target_streams_its_weights_from_aligned_lines_with_its_ties_and_values_kept(tiny_model_dir):
    """transformers places a checkpoint's tensors at the file's 8-byte offsets; the target moves each to 64-byte
    aligned storage (alignment.py: the kernels' vector loads would straddle cache lines), changing no value and
    keeping tied weights one Parameter."""
    from transformers import AutoModelForCausalLM

    from mirror_train.alignment import align_parameters, placed

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    target = Target.load(tiny_model_dir)
    assert all(p.data_ptr() % 64 == 0 for p in target.model.parameters())
    for (name, p), q in zip(target.model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    tied = target.model.config.tie_word_embeddings
    assert (target.lm_head.weight is target.decoder.embed_tokens.weight) == tied
    assert align_parameters(target.model) == 0  # idempotent
    assert all(placed(p) for p in target.model.parameters())  # in the arena of huge pages (where Linux has them)
