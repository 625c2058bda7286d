"""The target's fixed-shape step (static_step.py) run as it is on a CPU: the same windows, rollbacks, forks and
outputs as the growing cache. The CUDA graphs replaying it are checked by scripts/gpu_check.py on a GPU."""

from __future__ import annotations

import pytest
import torch

from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.errors import MirrorTrainError
from mirror_train.forked_window import ForkedWindow
from mirror_train.static_step import StaticKV, StaticSteps
from mirror_train.target import Target
from tests.conftest import tiny_model, tiny_tokenizer


def tiny_target() -> Target:
    """A tiny Llama on SDPA (what real targets load with; the static step's attention is SDPA's)."""
    tok = tiny_tokenizer()
    model = tiny_model("llama", layers=4, vocab=len(tok))
    model.config._attn_implementation = "sdpa"
    return Target(model, tok, "tiny")


@pytest.fixture(scope="module")
def pair():
    """The same weights twice: one served from the growing cache, one from a static cache of 16 positions (so the
    walk below outgrows it)."""
    return tiny_target(), tiny_target().use_static(graphs=False, capacity=16)


def walk(target: Target, exit_layer: int = 2):
    """A prompt, then windows of several widths, each rolled back to part of itself, and a forked window whose
    second chain is kept: every step's logits and final states."""
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(6, 128, (1, n), generator=g)  # noqa: E731
    out = []
    cache = target.new_cache()
    exit_states, last, final = target.prefill(ids(9), cache, exit_layer)
    out += [exit_states, last, final]
    for width, keep in ((1, 1), (5, 2), (3, 3), (8, 1), (2, 2)):
        state = target.prefix(ids(width), cache, exit_layer)
        out.append(state.hidden.clone())
        logits, final = target.suffix_states(state)
        out += [logits.clone(), final.clone()]
        Target.crop(cache, Target.cache_length(cache) - width + keep)
    past = Target.cache_length(cache)
    forked = ForkedWindow(3, 1, 2)  # rows [y, a1, a2, a3, b2, b3]: b hangs off a1
    state = target.prefix(ids(forked.rows), cache, exit_layer, forked=forked)
    logits, final = target.suffix_states(state)
    out += [logits.clone(), final.clone()]
    path = [0, 1, 4, 5]  # y, a1 (= b1), b2, b3
    Target.keep_path(cache, past, path)
    Target.crop(cache, past + len(path))
    logits, final = target.suffix_states(target.prefix(ids(1), cache, exit_layer))
    out += [logits.clone(), final.clone()]
    return out, Target.cache_length(cache)


def test_a_static_cache_serves_the_same_windows_rollbacks_and_forks_as_the_growing_one(pair):
    dynamic, static = pair
    expected, length = walk(dynamic)
    got, static_length = walk(static)
    assert static_length == length
    assert static.static.cache.capacity >= length > 16  # it grew in place
    for a, b in zip(expected, got, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


class ReplayedSteps(StaticSteps):
    """The graphs' bookkeeping on a CPU: a "capture" keeps the function and the outputs it made, and a "replay"
    runs that same function again and writes its results into those outputs, as a CUDA graph replays the captured
    kernels on the buffers they were captured with (what a stale buffer or a wrong closure would break)."""

    def _capture(self, key, fn):
        self._outputs[key] = fn()
        self.captured += 1
        outputs = self._outputs[key]

        class Graph:
            def replay(self):
                new = fn()
                for old, fresh in zip(*(o if isinstance(o, tuple) else (o,) for o in (outputs, new)), strict=True):
                    old.copy_(fresh)

        return Graph()


def replayed_target() -> Target:
    target = tiny_target().use_static(graphs=False, capacity=16)
    target.static = ReplayedSteps(target, 16, graphs=False)
    target.static.graphs = True  # replays without CUDA
    return target


def test_windows_replayed_from_their_captures_serve_as_the_growing_cache(pair):
    dynamic, _ = pair
    replayed = replayed_target()
    expected, _ = walk(dynamic)
    got, _ = walk(replayed)
    assert replayed.static.captured >= 10  # a prefix and a suffix per width, again after the cache grew
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


def test_a_capture_that_fails_leaves_the_same_step_run_as_it_is(pair):
    class Failing(ReplayedSteps):
        def _capture(self, key, fn):
            if key[0] == "suffix":
                raise RuntimeError("operation not permitted when stream is capturing")
            return super()._capture(key, fn)

    dynamic, _ = pair
    target = tiny_target().use_static(graphs=False, capacity=16)
    target.static = Failing(target, 16, graphs=False)
    target.static.graphs = True
    with pytest.warns(UserWarning, match="CUDA graph capture failed"):
        got, _ = walk(target)
    assert not target.static.graphs
    for a, b in zip(walk(dynamic)[0], got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


def test_a_static_window_equals_its_rows_one_token_steps(pair):
    """The attention of each window row is the one-row call a one-token step makes (matmuls may round apart)."""
    _, static = pair
    g = torch.Generator().manual_seed(2)
    prompt, window = torch.randint(6, 128, (1, 7), generator=g), torch.randint(6, 128, (1, 4), generator=g)
    cache = static.new_cache()
    static.prefill(prompt, cache, 2)
    together = static.suffix_states(static.prefix(window, cache, 2))[0].clone()
    Target.crop(cache, 7)
    steps = [static.suffix_states(static.prefix(window[:, i : i + 1], cache, 2))[0].clone() for i in range(4)]
    alone = torch.cat(steps, 1)
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fast_path", ["none", "auto"])
def test_every_method_on_a_static_cache_reproduces_the_targets_greedy_output(fast_path):
    target = tiny_target()
    from mirror_train.models.drafter import MirrorDrafterForCausalLM

    draft = MirrorDrafterForCausalLM.from_target(target, 2, 2, 1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 128, (n,), generator=g).tolist() for n in (1, 5, 40)]
    refs = [
        target.model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]
    cfg = EngineConfig(kappa=4, gamma=3, branch_budget=6, placement="local", target_step="static", fast_path=fast_path)
    with MirrorEngine(target, None, draft, cfg) as engine:
        assert isinstance(target.new_cache(), StaticKV) and engine.target_step == "static"
        for prompt, ref in zip(prompts, refs):
            for method in ("ar", "sd", "mirror", "pld"):
                assert engine.generate(prompt, 20, method=method, stop=[]).tokens == ref, (method, prompt)
    with MirrorEngine(target, None, draft, EngineConfig(placement="local")):  # auto: the growing cache again
        assert target.static is None and not isinstance(target.new_cache(), StaticKV)


def test_the_static_step_refuses_what_it_cannot_serve():
    target = tiny_target()
    with pytest.raises(MirrorTrainError, match="CUDA graphs need a CUDA target"):
        StaticSteps(target, 64, graphs=True)
    with pytest.raises(MirrorTrainError, match="target_step=graphs needs a CUDA target"):
        EngineConfig(target_step="graphs").validate()
    with pytest.raises(MirrorTrainError, match="target_step must be one of"):
        EngineConfig(target_step="fast").validate()
    cache = target.use_static(graphs=False, capacity=32).new_cache()
    with pytest.raises(MirrorTrainError, match="one unpadded sequence"):
        target.prefix(torch.ones(1, 2, dtype=torch.long), cache, 2, attention_mask=torch.ones(1, 2))
