"""The benchmark helpers' order of timing (mirror_train/timing.py): never timed assertions, only the schedule."""

from collections import Counter

from mirror_train.timing import interleaved_median_ms, round_order


def test_each_round_times_every_function_once_in_its_own_repeatable_order():
    """A fixed order let what ran just before a function move its time (fifteenth session): every round takes each
    key once, a round's order repeats with its index, and over many rounds every key stands in every place."""
    keys = ["a", "b", "c", "d"]
    orders = [round_order(keys, r) for r in range(200)]
    assert all(sorted(o) == keys for o in orders)
    assert orders == [round_order(keys, r) for r in range(200)]
    places = Counter((key, o.index(key)) for o in orders for key in keys)
    assert len(places) == 16 and min(places.values()) > 20
    assert round_order([], 5) == []


def test_interleaved_timing_runs_each_function_warmup_plus_repeats_times():
    calls = Counter()
    fns = {k: (lambda k=k: calls.update([k])) for k in ("x", "y")}
    times = interleaved_median_ms(fns, repeats=7, warmup=2)
    assert set(times) == {"x", "y"} and all(t >= 0 for t in times.values())
    assert calls == {"x": 9, "y": 9}
