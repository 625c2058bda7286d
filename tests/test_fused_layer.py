"""Whole decoder layers as one C call (fused_layer.py, kernels.decoder_layer): which layers take it, that it computes
the module's function, that a window is its one-token steps bit for bit, and that every build computes the same."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from mirror_train import fastpath, fused_layer, kernels
from mirror_train.random_models import tiny_config, tiny_model

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler here to build the kernel")


@pytest.fixture
def fused_calls(monkeypatch):
    """How many layer calls the C layer served (so a test knows the path under test ran)."""
    calls = [0]
    real = kernels.decoder_layer

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "decoder_layer", counted)
    return calls


def _decode(model, ids, prompt, rows):
    """Logits of ids[prompt:], fed after a prefill of ids[:prompt] in windows of `rows` tokens (a DynamicCache, as
    transformers' generate makes)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :prompt], cache=cache, use_cache=True)
        out = []
        for start in range(prompt, ids.shape[1], rows):
            out.append(model(ids[:, start : start + rows], cache=cache, use_cache=True).logits)
    return torch.cat(out, 1)


def _check_family(family: str, calls: list[int]):
    plain = tiny_model(family)
    if family == "qwen2":  # Qwen2's q/k/v biases are zero when initialised: make them count
        with torch.no_grad():
            for layer in plain.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    fused = copy.deepcopy(plain)
    assert fastpath.install(fused, "exact") == "exact"
    assert all(type(layer).__name__.startswith("Fused") for layer in fused.model.layers)
    ids = torch.randint(0, 128, (1, 29), generator=torch.Generator().manual_seed(3))
    reference = _decode(plain, ids, 9, 1)
    before = calls[0]
    steps = _decode(fused, ids, 9, 1)
    # every layer of the prompt's prefill and of every decode step took the C layer
    assert calls[0] - before == 21 * len(fused.model.layers)
    torch.testing.assert_close(steps, reference, atol=1e-4, rtol=1e-4)  # the module's function, to the last bits
    assert torch.equal(steps.argmax(-1), reference.argmax(-1))
    for rows in (2, 5, 8, 20):  # a window is its one-token steps, bit for bit
        assert torch.equal(_decode(fused, ids, 9, rows), steps), rows
    # so is a prompt's prefill (on an empty cache): one token, then eight steps, leaves the same cache
    assert torch.equal(_decode(fused, ids, 1, 1)[:, 8:], steps)


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_fused_layer_is_the_modules_function_and_a_window_is_its_one_token_steps(family, fused_calls):
    _check_family(family, fused_calls)


@needs_kernel
def test_a_mistral_without_a_sliding_window_is_fused_and_other_layers_stay_plain():
    """Only the block the C layer computes is fused: a sliding window, Qwen3's q/k norms, Gemma's offset norms and
    softcaps keep the model's own forward."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("mistral")
    cfg.sliding_window = None
    cfg._attn_implementation = "eager"
    assert fused_layer.install(AutoModelForCausalLM.from_config(cfg).eval()) == 4
    for family in ("mistral", "qwen3", "gemma2", "gemma3_text"):
        model = tiny_model(family)
        assert fused_layer.install(model) == 0, family
        assert not any(type(layer).__name__.startswith("Fused") for layer in model.model.layers)


@needs_kernel
def test_the_layer_falls_back_where_it_does_not_apply_and_a_copy_is_plain(fused_calls):
    """A batch (its prefill too), bfloat16 weights and gradients run the module's own forward; a deep copy (a cast,
    Target.cast) is a plain layer; switching off restores the class."""
    model = tiny_model()
    fastpath.install(model, "exact")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids)  # batch 2, no cache
        cache = DynamicCache(config=model.config)
        model(ids[:, :8], cache=cache, use_cache=True)  # a batch of two after their prefill
        model(ids[:, 8:], cache=cache, use_cache=True)
    assert fused_calls[0] == 0
    clone = copy.deepcopy(model)
    assert not any(type(layer).__name__.startswith("Fused") for layer in clone.model.layers)
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert fused_layer.install(half) == 4  # a fused class, but bf16 weights are not what the C layer reads
    assert all(layer._weights() is None for layer in half.model.layers)
    with torch.inference_mode():
        cache = DynamicCache(config=half.config)
        half(ids[:1, :8], cache=cache, use_cache=True)
        half(ids[:1, 8:10], cache=cache, use_cache=True)
    with torch.enable_grad():
        x = model.model.embed_tokens(ids[:1, :4]).detach().requires_grad_(True)
        model(inputs_embeds=x).logits.sum().backward()
        assert x.grad is not None
        cache = DynamicCache(config=model.config)  # a cached window, inputs without gradients, weights with them
        model(ids[:1, :8], cache=cache, use_cache=True)
        model.requires_grad_(False).model.layers[0].mlp.down_proj.weight.requires_grad_(True)
        model(ids[:1, 8:10], cache=cache, use_cache=True).logits.sum().backward()
        assert model.model.layers[0].mlp.down_proj.weight.grad is not None
    assert fused_calls[0] == 0
    fused_layer.install(model, False)
    assert not any(type(layer).__name__.startswith("Fused") for layer in model.model.layers)


@needs_kernel
def test_transformers_generate_on_a_fused_model_is_its_stepwise_greedy(fused_calls):
    """transformers' generate (a DynamicCache made inside) runs the same fused layers as the engine's own stepping,
    so a peer method in the benchmark and the served target compute one function."""
    model = tiny_model()
    fastpath.install(model, "exact")
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert fused_calls[0] == 12 * len(model.model.layers)  # the prefill (its first token) and 11 steps
    tokens = ids
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = model(tokens, cache=cache, use_cache=True).logits
        for _ in range(12):
            nxt = logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, nxt], 1)
            logits = model(nxt, cache=cache, use_cache=True).logits
    assert torch.equal(out, tokens)


def test_the_avx2_and_scalar_builds_fuse_the_same_function(other_kernel_build, fused_calls):
    """Their own layer code (the vector exponential, the norm's sums) computes the same function."""
    _check_family("qwen2", fused_calls)


def _target_steps(target, ids, prompt, windows, forked_at=None):
    """The target's logits over ids[prompt:], fed after a prefill of ids[:prompt] in windows of the given sizes
    (split at ℓe = 2, prefix then suffix, as the engine steps); the window starting at `forked_at` is a forked one
    (two chains: its first 3 tokens, then 2 more hanging off the first)."""
    from mirror_train.forked_window import ForkedWindow

    cache = target.new_cache()
    out, start = [], prompt
    with torch.inference_mode():
        target.forward(ids[:, :prompt], cache)
        for rows in windows:
            forked = ForkedWindow(main=2, fork=0, alt=2) if start == forked_at else None
            rows = forked.rows if forked else rows
            state = target.prefix(ids[:, start : start + rows], cache, 2, forked=forked)
            out.append(target.suffix(state))
            if forked:  # keep the main chain, as a verification that accepted it would
                target.crop(cache, start + 1 + forked.main)
                rows = 1 + forked.main
            start += rows
    return torch.cat(out, 1), cache


@needs_kernel
def test_a_targets_layers_as_one_stack_call_are_its_layers_called_one_by_one(monkeypatch, fused_calls):
    """Target.run_layers runs consecutive fused layers as one C call (FusedStack): windows of 1-8 rows, a forked
    window and a cache that grows on the way give what the layers' own fused calls give, bit for bit; the stack
    follows a weight changed in place, and where the layers are switched off or the batch is two it steps aside."""
    from mirror_train.random_models import tiny_tokenizer
    from mirror_train.target import Target

    model = tiny_model("llama", layers=4, vocab=128)
    model.config._attn_implementation = "sdpa"  # the row-invariant attention a forked window needs
    target = Target(model, tiny_tokenizer(), "tiny")
    fastpath.install(target.model, "exact")
    stacks, real = [], kernels.decoder_stack
    monkeypatch.setattr(kernels, "decoder_stack", lambda *a, **k: stacks.append(len(a[1])) or real(*a, **k))
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(7))
    windows = [1, 2, 5, 8, 3, 1] * 14  # ~280 tokens after a 9-token prompt: the cache grows past 256 positions
    stacked, cache = _target_steps(target, ids, 9, windows, forked_at=9 + 1 + 2)
    # the prompt's prefill in C too: its first layer (Target.forward's ℓe = 1) alone, the other three as one stack
    assert cache.get_seq_length() > 256 and len(stacks) == 1 + 2 * len(windows) and fused_calls[0] == 1
    assert stacks[0] == 3 and set(stacks[1:]) == {2}  # ℓe = 2 of 4: two layers a call, each half
    monkeypatch.setattr(Target, "_stack", lambda self, layers, indices: None)
    layered, _ = _target_steps(target, ids, 9, windows, forked_at=9 + 1 + 2)
    assert fused_calls[0] == 1 + 4 * (1 + len(windows))  # the same steps through the layers' own fused calls
    assert torch.equal(stacked, layered)
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "decoder_stack", lambda *a, **k: stacks.append(len(a[1])) or real(*a, **k))

    fresh = tiny_model("llama", layers=4, vocab=128, seed=1)
    model.load_state_dict(fresh.state_dict())  # in place: the stack's arguments follow the layers' new weights
    reference = Target(copy.deepcopy(fresh), tiny_tokenizer(), "tiny")  # plain layers: the modules' function
    ours, _ = _target_steps(target, ids, 9, [1, 3])
    theirs, _ = _target_steps(reference, ids, 9, [1, 3])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

    stacks.clear()
    fused_layer.install(target.model, False)  # switched off: the modules' own forwards, no stack
    off, _ = _target_steps(target, ids, 9, [1, 3])
    assert not stacks
    torch.testing.assert_close(off, theirs, atol=1e-4, rtol=1e-4)
    fastpath.install(target.model, "exact")
    with torch.inference_mode():  # a batch of two steps aside to the modules, whose layers decline it too
        cache = target.new_cache()
        target.forward(ids[:, :9].repeat(2, 1), cache)
        two = target.forward(ids[:, 9:11].repeat(2, 1), cache)
    assert not stacks
    torch.testing.assert_close(two[0], two[1], atol=1e-4, rtol=1e-4)
    target.model.model.layers[3].train()  # a layer in training (its dropout): that layer's own forward
    trained, _ = _target_steps(target, ids, 9, [1, 3])
    assert stacks == [2, 2]  # the prefix's two layers still one call, the suffix layer by layer
    target.model.eval()
    torch.testing.assert_close(trained, _target_steps(target, ids, 9, [1, 3])[0], atol=1e-4, rtol=1e-4)


@needs_kernel
def test_a_prefill_runs_in_c_up_to_the_rows_that_measured_faster_than_the_spread_modules(
    fused_calls, monkeypatch, tmp_path
):
    """A prompt's prefill takes the C layers up to `fused_layer.prefill_rows` rows and the modules past them (the same
    function to float32 noise); inside a spread prefill that limit is `fastpath.c_prefill_rows`, measured once per
    machine for the model's shape and thread count (one of its timed lengths, or 0 where C never won)."""
    model = tiny_model()
    fastpath.install(model, "exact")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    outs = {}
    with torch.inference_mode():
        for rows in (kernels.MAX_ROWS, 16):
            before = fused_calls[0]
            with fused_layer.prefill_rows(rows):
                outs[rows] = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
            assert fused_calls[0] - before == (len(model.model.layers) if rows >= 24 else 0), rows
    torch.testing.assert_close(outs[16], outs[kernels.MAX_ROWS], atol=1e-4, rtol=1e-4)
    layout = (None, torch.get_num_threads() + 1)
    cap = fastpath.c_prefill_rows(model, layout)
    assert cap in (0, *fastpath.C_PREFILL_ROWS)
    assert fastpath._c_prefill[model] == {layout[1]: cap}
    # kept per machine by the model's shape and the threads: a later process (another model object of that shape)
    # takes it as kept; a kept value that is none of the timed lengths is timed again
    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))
    timed = []
    real = fastpath._time_c_prefill_rows
    monkeypatch.setattr(fastpath, "_time_c_prefill_rows", lambda *a: timed.append(1) or real(*a))
    twin = tiny_model()
    fastpath.install(twin, "exact")
    assert fastpath.c_prefill_rows(twin, layout) in (0, *fastpath.C_PREFILL_ROWS) and len(timed) == 1
    (kept,) = tmp_path.glob(f"c_prefill_*_{layout[1]}threads_*.json")
    kept.write_text('{"rows": 16}')
    again = tiny_model()
    fastpath.install(again, "exact")
    assert fastpath.c_prefill_rows(again, layout) == 16 and len(timed) == 1
    kept.write_text('{"rows": 5}')
    other = tiny_model()
    fastpath.install(other, "exact")
    assert fastpath.c_prefill_rows(other, layout) in (0, *fastpath.C_PREFILL_ROWS) and len(timed) == 2
    with fastpath.spread(layout, model):
        assert fused_layer._prefill_rows == cap
    assert fused_layer._prefill_rows == kernels.MAX_ROWS
    plain = tiny_model()  # no C layers: nothing to choose
    assert fastpath.c_prefill_rows(plain, layout) == kernels.MAX_ROWS
