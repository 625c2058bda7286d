"""Forked windows (mirror_train/forked_window.py): two drafted chains verified in one pass. The rows' layout and
keys, the kernel's key runs, the verification rule, the rate that chooses a fork, each chain's rows equal to its
one-token steps bit for bit, the kept chain's cache, and the engine's output unchanged where it forks."""

from __future__ import annotations

import pytest
import torch

from mirror_train import fastpath, kernels
from mirror_train.engine import EngineConfig, MirrorEngine, SyntheticDraftConfig, server
from mirror_train.engine.acceptance import accept_forked
from mirror_train.engine.window import best_fork, best_length
from mirror_train.forked_window import ForkedWindow
from mirror_train.random_models import tiny_model, tiny_tokenizer
from mirror_train.target import Target


def fork_whole(accept_a, accept_b, shared, cost):
    """In place of window.best_fork: fork the two chains whole wherever they can fork."""
    la, lb = len(accept_a), len(accept_b)
    return (la, lb, 1e9) if min(shared, la, lb) < min(la, lb) else (0, 0, 0.0)


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler here to build the row-exact kernel")


def test_rows_positions_and_keys_by_hand():
    # rows [y_t, a1, a2, a3, b2, b3]: b1 = a1 is the stem (fork 1), b2 and b3 the second chain's own rows
    fw = ForkedWindow(main=3, fork=1, alt=2)
    assert fw.rows == 6 and fw.depths() == [0, 1, 2, 3, 2, 3]
    assert [fw.alt_row(j) for j in range(3)] == [1, 4, 5]
    runs = fw.runs(past=10)  # b3 (row 5) sees keys 0..11 (cache, y_t, a1), then rows 4..5 (keys 14, 15)
    assert runs[:, 5].tolist() == [12, 14, 2] and runs[:, 2].tolist() == [13, 0, 0]
    mask = fw.mask(10)[0, 0]
    assert mask[5].nonzero().flatten().tolist() == list(range(12)) + [14, 15]
    assert mask[3].nonzero().flatten().tolist() == list(range(14))
    with pytest.raises(ValueError):
        ForkedWindow(main=2, fork=2, alt=1)  # the main chain must have a token of its own past the stem


def test_accept_forked_commits_the_chain_that_keeps_more():
    fw = ForkedWindow(main=2, fork=0, alt=2)  # rows [y_t, a1, a2, b1, b2]
    window, alt = [5, 6], [7, 8]
    # target tokens per row: after y_t → 7 (b1 kept), after a1 → 9, after a2 → 1, after b1 → 8 (b2 kept), after b2 → 4
    a, c, rows, a_alt = accept_forked(window, alt, fw, [7, 9, 1, 8, 4])
    assert (a, a_alt, c, rows) == (0, 2, 4, [0, 3, 4])
    a, c, rows, a_alt = accept_forked(window, alt, fw, [5, 6, 3, 8, 4])  # the main chain whole: bonus 3
    assert (a, a_alt, c, rows) == (2, 0, 3, [0, 1, 2])
    a, c, rows, a_alt = accept_forked(window, alt, fw, [2, 6, 3, 8, 4])  # neither: the correction at y_t
    assert (a, a_alt, c, rows) == (0, 0, 2, [0])
    assert accept_forked([5], [], None, [5, 9]) == (1, 9, [0, 1], None)
    # a shared stem: window [5, 6], alt [5, 8] (fork 1): rows [y_t, a1, a2, b2]
    fw = ForkedWindow(main=2, fork=1, alt=1)
    assert accept_forked([5, 6], [5, 8], fw, [5, 8, 0, 2]) == (1, 2, [0, 1, 3], 2)


def test_best_fork_adds_the_chains_reach_past_the_fork():
    flat = [1.0] * 16  # rows cost nothing: verify everything
    la, lb, rate = best_fork([0.5], [0.5], 0, flat)
    assert (la, lb) == (1, 1) and rate == pytest.approx(2.0)  # P(keep ≥ 1) = 0.5 + 0.5
    assert best_fork([0.9, 0.9], [0.9, 0.9], 2, flat) == (0, 0, 0.0)  # the same chain twice: no fork
    steep = [1.0 + w for w in range(16)]  # a row costs a whole step: a fork never pays over a plain step
    assert best_fork([0.5] * 4, [0.5] * 4, 0, steep)[2] < best_length([0.5] * 4, steep)[1] + 1e-9
    cheap = [1.0 + 0.05 * w for w in range(16)]  # ~the row-exact kernels: a fork of two likely chains pays
    assert best_fork([0.4] * 4, [0.6] * 8, 0, cheap)[2] > max(
        best_length([0.4] * 4, cheap)[1], best_length([0.6] * 8, cheap)[1]
    )


@needs_kernels
def test_the_kernels_key_runs_equal_the_same_keys_in_one_run():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 16, generator=g)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    runs = torch.tensor([[30, 25, 25], [0, 33, 33], [0, 1, 2]])  # row 0 causal-ish, rows 1-2 two runs
    out = kernels.attention(q, k, v, 0.25, runs)
    for i in range(3):
        index = torch.cat([torch.arange(int(runs[0, i])), torch.arange(int(runs[1, i]), int(runs[1, i] + runs[2, i]))])
        alone = kernels.attention(q[:, :, i : i + 1], k[:, :, index], v[:, :, index], 0.25)  # its last row
        assert torch.equal(out[:, i], alone[:, 0])


def _check_chains(target, prompt_len=20, cases=((1, [5, 13, 17]), (0, [3, 4]), (3, [5, 7, 9, 2, 8]))):
    """Each chain's rows of a forked window equal its one-token steps bit for bit; the kept chain's cache is the
    cache plain decoding of it leaves."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (1, prompt_len), generator=g)
    main, pending = [5, 7, 9, 11], 42

    def stepwise(tokens):
        cache = target.new_cache()
        target.forward(prompt, cache)
        return torch.stack([target.forward(torch.tensor([[t]]), cache)[0, -1] for t in tokens]), cache

    ref_main, _ = stepwise([pending] + main)
    for fork, alt in cases:
        ref_alt, alt_cache = stepwise([pending] + alt)
        cache = target.new_cache()
        target.forward(prompt, cache)
        fw = ForkedWindow(len(main), fork, len(alt) - fork)
        state = target.prefix(torch.tensor([[pending] + main + alt[fork:]]), cache, 1, forked=fw)
        out = target.suffix(state)[0]
        assert torch.equal(out[: 1 + len(main)], ref_main)
        assert all(torch.equal(out[fw.alt_row(j)], ref_alt[j + 1]) for j in range(len(alt)))
        rows = [0] + [fw.alt_row(j) for j in range(len(alt))]
        Target.keep_path(cache, prompt_len, rows)
        Target.crop(cache, prompt_len + len(rows))
        for mine, plain in zip(cache.layers, alt_cache.layers):
            assert torch.equal(mine.keys, plain.keys) and torch.equal(mine.values, plain.values)


@needs_kernels
def test_each_chain_scores_as_its_one_token_steps_on_a_tiny_target(tiny_model_dir):
    target = Target.load(str(tiny_model_dir))
    assert fastpath.install(target.model, "exact") == "exact" and target.row_invariant
    _check_chains(target)


@needs_kernels
@pytest.mark.testbed
def test_each_chain_scores_as_its_one_token_steps_on_the_testbed(testbed_path):
    target = Target.load(str(testbed_path))
    fastpath.install(target.model, "exact")
    _check_chains(target)


@needs_kernels
@pytest.mark.parametrize("forks", [True, False])
def test_the_engine_forks_where_both_sources_have_tokens_and_the_output_stays_the_targets(
    tiny_model_dir, forks, monkeypatch
):
    """A synthetic draft kept half the time beside copies of a repetitive answer: both sources have chains, and
    the forked windows leave every output the target's own greedy one (transformers' generate). Every pair of
    chains that can fork does (whether one pays follows measured times; the rule is tested above)."""
    monkeypatch.setattr(server, "best_fork", fork_whole)
    target = Target.load(str(tiny_model_dir))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=g).tolist() for n in (6, 17)]
    cfg = EngineConfig(kappa=4, gamma=4, branch_budget=6, placement="local", forked_windows=forks, ngram_tokens=6)
    forked = 0
    with MirrorEngine(target, None, SyntheticDraftConfig(acceptance=0.5, forward_ms=0), cfg) as engine:
        assert engine.forks == forks
        for prompt in prompts:
            ids = torch.tensor([prompt])
            ref = target.model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref = ref[0, len(prompt) :].tolist()
            for method in ("sd", "mirror"):
                out = engine.generate(prompt, 40, method=method, stop=[], reference=ref)
                assert out.tokens == ref, (method, prompt)
                forked += sum(s.alt > 0 for s in out.steps)
    assert (forked > 0) == forks


@needs_kernels
@pytest.mark.parametrize("slots", [["exit"], ["exit", "final"], ["exit", "final", "own"]])
@pytest.mark.parametrize("method,head_placement", [("sd", "target"), ("mirror", "target"), ("mirror", "draft")])
def test_a_feature_conditioned_draft_reads_the_kept_chains_states(method, head_placement, slots, monkeypatch):
    """Where the second chain of a forked window is kept, the draft is fed that chain's states: after a generation
    its cache over the committed tokens equals a fresh forward over them with the target's own states, paired. (A
    random draft's chain is rarely worth a fork, so here every pair of chains that can fork does, whole: the rule
    that chooses forks is tested above; this tests what follows from one.)"""
    from tests.test_engine import assert_fed_true_states, proxy_head, slotted_draft
    from tests.test_engine import reference as plain_reference

    monkeypatch.setattr(server, "best_fork", fork_whole)
    # and the draft always drafts (a random draft's serial rollouts never pay for the target's wait)
    monkeypatch.setattr(server, "rollout_plan", lambda *args: (args[4], 1e9))

    model = tiny_model("llama", layers=4, vocab=128)
    model.config._attn_implementation = "sdpa"  # the row-invariant attention, which reads a fork's key runs
    target = Target(model, tiny_tokenizer(), "tiny")
    draft = slotted_draft(target, slots, layers=4)  # the whole tiny target's layers: often right, not always
    g = torch.Generator().manual_seed(1)  # prompts where every setting keeps a second chain somewhere
    prompts = [torch.randint(6, 128, (n,), generator=g).tolist() for n in (5, 13, 9, 21, 3)]
    cfg = EngineConfig(kappa=4, gamma=3, branch_budget=6, placement="local", head_placement=head_placement)
    cfg.draft_dtype = "float32"
    kept = forked = 0
    with MirrorEngine(target, proxy_head(target, "mlp"), draft, cfg) as engine:
        assert engine.forks
        for prompt in prompts:
            ref = plain_reference(target, prompt, 60)
            out = engine.generate(prompt, 60, method=method, stop=[])
            assert out.tokens == ref, prompt
            kept += sum(s.alt_kept for s in out.steps)
            forked += sum(s.alt > 0 for s in out.steps)
            assert_fed_true_states(engine, draft, target, prompt + ref)
    assert forked > kept > 0  # a second chain was kept somewhere: the path under test ran
