"""Prompt lookup and the window-length rule: pure functions, checked by hand."""

from __future__ import annotations

import pytest
import torch

from mirror_train.engine.ngram import NgramIndex
from mirror_train.engine.window import (
    Calibration,
    best_length,
    expected_committed,
    fit_costs,
    prob_key,
    rollout_plan,
    serial_overhead,
)


def test_ngram_proposes_what_followed_the_longest_latest_match():
    index = NgramIndex(max_n=3)
    index.reset([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # suffix (6, 7): seen ending at 2 and at 6; the latest (6) was followed by 9, 2, 6, 7
    assert index.propose(3) == ([9, 2, 6], 2)
    index.extend([8])  # suffix (6, 7, 8): only at 1..3, followed by 1, 6, 7
    assert index.propose(2) == ([1, 6], 3)
    assert index.propose(4, after=[42]) == ([], 0)  # 42 never occurred
    assert index.propose(2, after=[5]) == ([6, 7], 1)  # the context (…, 8, 5): only 5 matches


def test_ngram_guesses_the_latest_distinct_successors_of_the_longest_match_then_shorter_ones():
    index = NgramIndex(max_n=3, successors=2)
    index.reset([6, 7, 1, 5, 6, 7, 2, 6, 7, 1, 9, 7, 3, 6, 7])
    # (6, 7) was followed by 1, 2, 1: the latest distinct two are 1, 2; then (7,) adds 3 (its latest, after 1)
    assert index.guesses(3) == [(1, 2), (2, 2), (3, 1)]
    assert index.guesses(1) == [(index.propose(1)[0][0], 2)]  # the first guess is the copy's next token
    assert index.guesses(3, after=[42]) == []
    assert NgramIndex(max_n=3).guesses(3, after=[6, 7]) == []  # an empty index
    one = NgramIndex(max_n=3)  # one successor kept: each n-gram's latest only
    one.reset([6, 7, 1, 5, 6, 7, 2, 6, 7, 1, 9, 7, 3, 6, 7])
    assert one.guesses(3) == [(1, 2), (3, 1)]
    with pytest.raises(ValueError):
        NgramIndex(successors=0)


def test_ngram_never_matches_the_suffix_with_itself():
    index = NgramIndex()
    index.reset([1, 2, 3])
    assert index.propose(4) == ([], 0)
    index.extend([1, 2])  # (1, 2) now also earlier, followed by 3, 1, 2
    assert index.propose(4) == ([3, 1, 2], 2)


def test_expected_committed_and_the_best_length_by_hand():
    assert expected_committed([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])
    # flat cost: the longest window; costly rows: none; in between: the knee
    assert best_length([0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0])[0] == 3
    assert best_length([0.2, 0.2], [1.0, 1.5, 2.0])[0] == 0
    w, rate = best_length([0.9, 0.3, 0.3], [1.0, 1.2, 1.4, 1.6])  # E = 1, 1.9, 2.17, 2.251
    assert w == 1 and rate == pytest.approx(1.9 / 1.2)
    assert best_length([0.99] * 6, [1.0, 1.1])[0] == 6  # past the table the cost grows by its last step


def test_calibration_learns_rates_by_key_and_shrinks_sparse_keys():
    cal = Calibration(prior=2.0, initial=0.5)
    assert cal.predict(["a"]) == [0.5]
    for _ in range(20):
        cal.update(["a", "a", "b"], accepted=2)  # a kept twice, b rejected
    a, b, c = cal.predict(["a", "b", "c"])
    assert a > 0.9 and b < 0.2 and c == pytest.approx(cal.overall())
    assert prob_key(0.0) == 0 and prob_key(0.55) == 5 and prob_key(1.0) == 9


def test_fit_costs_is_relative_to_a_one_token_step():
    samples = [(0, 60.0), (4, 100.0), (0, 62.0), (4, 98.0), (1, 80.0), (2, 70.0)]  # noise: 2 rows below 1
    costs, step_ms = fit_costs(samples, 6)
    assert step_ms == 61.0 and len(costs) == 7
    # medians 61, 80, 70 → 80 (never cheaper for more), then 99 at 4: interpolated at 3, the 2→4 slope beyond
    assert costs == pytest.approx([1.0, 80 / 61, 80 / 61, 89.5 / 61, 99 / 61, 108.5 / 61, 118 / 61])
    assert fit_costs([(0, 60.0), (0, 61.0)], 4) is None and fit_costs([(1, 60.0), (2, 61.0)], 4) is None


def test_a_rollout_is_planned_in_whole_passes_and_only_when_its_tokens_outweigh_its_time():
    """A serial rollout costs the target its passes' time (a pass: 0.25 of a step, 3 tokens with two streams): at
    acceptance 0.2 no window beats a plain step's 1.0; at 0.8 three tokens in one pass beat four in two; a branch
    rolled out to 2 tokens is drafted on (one pass, to 4) at 0.8 and offered as it is at 0.5."""
    flat = [1.0, 1.05, 1.1, 1.15, 1.2]
    assert rollout_plan(0.2, flat, 0.25, 3, 4)[1] < 1.0
    assert rollout_plan(0.8, flat, 0.25, 3, 4) == (3, pytest.approx((1 + 0.8 + 0.64 + 0.512) / 1.4))
    assert rollout_plan(0.95, flat, 0.25, 3, 4)[0] == 4
    assert rollout_plan(0.8, flat, 0.25, 3, 4, drafted=2)[0] == 4
    assert rollout_plan(0.5, flat, 0.25, 3, 4, drafted=2) == (2, pytest.approx(1.75 / 1.1))
    assert rollout_plan(0.5, flat, 0.25, 1, 4)[0] in (1, 2)  # one token a pass: never rounded past w


def test_a_serial_rollouts_measured_overhead_can_make_it_not_pay():
    """A fallback that also feeds the committed tokens measured 12 ms for one 7 ms pass: 5 ms more per rollout
    (never negative), and at acceptance 0.3 that overhead turns a paying one-pass rollout into one that does not."""
    assert serial_overhead([], 7.0) == 0.0
    assert serial_overhead([(1, 12.0), (2, 19.0)], 7.0) == pytest.approx(5.0)
    assert serial_overhead([(1, 3.0)], 7.0) == 0.0
    flat = [1.0, 1.05, 1.1, 1.15, 1.2]
    assert rollout_plan(0.3, flat, 0.15, 3, 4)[1] > 1.0
    assert rollout_plan(0.3, flat, 0.15, 3, 4, fixed_cost=0.3)[1] < 1.0


def test_a_window_source_calibrated_as_never_kept_is_still_tried_now_and_then():
    """Adaptive windows cut a source whose tokens the target has never kept to nothing, and nothing is never
    verified: without exploration its calibration could not recover (prompt lookup once proposed nothing for a whole
    Spec-Bench run after a first prompt with no copy kept). Every EXPLORE-th cut offers one token anyway."""
    from mirror_train.engine.rollout import Rollout
    from mirror_train.engine.server import EXPLORE, DraftServer

    server = DraftServer(None, ngram_tokens=8, adaptive_window=True)
    server.costs = [1.0, 1.3, 1.6]
    server.ngram.reset([5, 6, 7, 8, 5, 6, 7])  # "5 6 7" was followed by 8: a copy is on offer
    for n in (1, 2, 3):
        server.calibration.update([("ngram", n, False)] * 4, 0)  # copies were never kept
        for _ in range(50):
            server.calibration.update([("ngram", n, False)], 0)
    nothing = Rollout([], [], 0, [], None)
    windows = [server._offer(nothing, {}).tokens for _ in range(2 * EXPLORE + 2)]
    assert windows[0] == [] and windows.count([8]) == 2, windows
    assert windows[EXPLORE] == [8] and windows[2 * EXPLORE + 1] == [8]


def test_serial_explorations_grow_rarer_while_they_confirm_the_skip():
    """A draft whose rollouts do not pay is skipped; one pass is explored after EXPLORE skips, then after 2×, 4×
    ... EXPLORE_MAX skips while the skip stands (each cost sd a whole step's wait); a plan that picks the model
    resets the pace."""
    from mirror_train.engine.server import EXPLORE, EXPLORE_MAX, DraftServer

    class Backend:  # the plan reads only these
        num_streams = 2

    server = DraftServer(Backend(), adaptive_window=True)
    server.gamma, server.costs, server.step_ms = 4, [1.0, 1.1, 1.2, 1.3, 1.4], 30.0
    server.samples.extend([(1, 30.0), (4, 60.0)] * 2)  # a pass ≈ 0.75 of a target step: never worth it
    for _ in range(50):
        server.calibration.update([("model", 3)] * 4, 0)  # never kept
    plans = [server._serial_plan(0) for _ in range(EXPLORE * 20)]
    explored = [i for i, n in enumerate(plans) if n]
    assert all(plans[i] == 3 for i in explored)  # one pass: 1 + 2 streams
    gaps = [b - a - 1 for a, b in zip([-1] + explored, explored)]
    assert gaps[:4] == [EXPLORE, 2 * EXPLORE, 4 * EXPLORE, min(EXPLORE_MAX, 8 * EXPLORE)], gaps
    server.skipped = EXPLORE_MAX
    assert server._serial_plan(3) == 0  # an extension of a reused branch never explores
    server.skipped = 0
    server.calibration.update([("model", 9)] * 400, 400)  # the model is kept now
    assert server._serial_plan(0) > 0 and server.explore_every == EXPLORE


def test_the_state_table_grows_and_reads_rows_with_zeros_before_its_start():
    """What committed tokens read: row i-1 of the table for token i, zeros for the prompt's first token (index -1)."""
    from mirror_train.engine.node_states import StateTable

    table = StateTable()
    for block in (torch.arange(6.0).view(3, 2), torch.arange(6.0, 200.0).view(97, 2)):  # past the first capacity
        table.append(block)
    everything = torch.arange(200.0).view(100, 2)
    assert len(table) == 100
    torch.testing.assert_close(table.rows(0, 100, 2), everything)
    torch.testing.assert_close(table.rows(-1, 3, 2), torch.cat([torch.zeros(1, 2), everything[:2]]))
    torch.testing.assert_close(table.rows(97, 3, 2), everything[97:])
    assert table.rows(5, 0, 2).shape == (0, 2) and StateTable().rows(-1, 1, 2).shape == (1, 2)


def test_the_draft_is_asked_where_its_model_promises_more_than_the_copy_or_is_due_to_explore():
    from mirror_train.engine.window import ask_model

    assert ask_model(1.4, 1.2, 0, 8) and not ask_model(1.1, 1.2, 0, 8)
    assert not ask_model(0.9, 0.0, 0, 8)  # no copy: a plain step's rate 1 is the bar
    assert ask_model(0.9, 1.2, 8, 8) and not ask_model(0.9, 1.2, 7, 8)  # due to explore after 8 skipped steps
    assert ask_model(float("inf"), 5.0, 0, 8)  # nothing measured yet: the model is asked


def test_the_models_promise_is_scaled_by_what_its_asks_delivered():
    """`AskReturn`: with nothing measured the promise is taken at its word; asks that realise 0.9 of a promised 1.3
    scale it towards 0.9 / 1.3, shrunk by the prior's asks; only the last `window` asks count; a promise that is
    not a finite positive rate (nothing measured on the draft's side yet) teaches nothing."""
    from mirror_train.engine.window import AskReturn

    ledger = AskReturn(window=8, prior=4.0)
    assert ledger.factor() == 1.0
    ledger.add(float("inf"), 0.5)
    assert ledger.factor() == 1.0
    for _ in range(8):
        ledger.add(1.3, 0.9)
    assert ledger.factor() == pytest.approx((8 * 0.9 + 4 * 1.3) / (12 * 1.3))
    for _ in range(8):  # the old asks leave the window
        ledger.add(1.2, 1.5)
    assert ledger.factor() == pytest.approx((8 * 1.5 + 4 * 1.2) / (12 * 1.2)) and ledger.factor() > 1


def test_scripts_bench_branch_roots_counts_each_answer_position_once_against_every_source():
    """bench_branch_roots' score: the head's top κ, prompt lookup's guesses (read from the prompt and the answer
    before each position) and their union, counted over answer positions only."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    import numpy as np
    import torch

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_branch_roots.py"
    spec = importlib.util.spec_from_file_location("bench_branch_roots", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ids = [7, 1, 2, 3, 1, 2, 4, 1, 2, 3]  # prompt 7 1 2 3; answer 1 2 4 1 2 3 (positions 3..8 predict it)
    answer = np.array([i >= 3 for i in range(len(ids) - 1)] + [False])
    vocab = 10

    class Head(torch.nn.Module):  # ranks id 1 first (then 2, 3, …): right where 1 comes next (positions 3 and 6)
        dtype = torch.float32

        def forward(self, x):
            scores = -torch.arange(vocab, dtype=torch.float32).roll(1)
            return scores.expand(*x.shape[:-1], vocab)

    cache = SimpleNamespace(
        num_sequences=1, offsets=np.array([0, len(ids)]), token_ids=np.array(ids), is_answer=answer,
        hidden=np.zeros((len(ids), 4), dtype=np.float32),
    )  # fmt: skip
    counts = bench.score(Head(), cache, [1], [0, 1, 2], None)
    assert counts["positions"] == 6
    assert counts["head1"] == 2
    # lookup after "… 1" guesses 2 (right at positions 4 and 7); after the last "1 2" its latest successor 4 first,
    # then 3 (right: only the second guess holds it)
    assert counts["lookup1"] == 2 and counts["lookup2"] == 3
    assert counts["head1+lookup2"] == 5 and counts["head1+lookup0"] == 2
