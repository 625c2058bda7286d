"""The datastore of the target's own answers (datastore.py): what it proposes, how it is stored, bad input, and the
draft server's choice between its continuation and prompt lookup's copy."""

from __future__ import annotations

import pytest

from mirror_train.datastore import Datastore, DatastoreConfig
from mirror_train.engine.ngram import NgramIndex
from mirror_train.engine.server import DraftServer
from mirror_train.errors import MirrorTrainError

ANSWERS = [
    [1, 2, 3, 4, 5],
    [1, 2, 3, 4, 6],
    [1, 2, 3, 4, 5],
    [9, 2, 3, 7],
    [8, 8, 8],
]


def test_the_most_frequent_successor_of_the_longest_known_ngram_is_proposed():
    store = Datastore.build(ANSWERS, DatastoreConfig(min_n=2, max_n=3, min_count=1))
    # (3, 4) was followed by 5 twice and 6 once; (2, 3) by 4 three times and 7 once
    assert store.next_token([2, 3, 4]) == (5, 3, pytest.approx(2 / 3))
    assert store.next_token([0, 3, 4]) == (5, 2, pytest.approx(2 / 3))  # (0, 3, 4) unknown: backs off to n = 2
    assert store.next_token([0, 9]) is None  # no n-gram of size ≥ 2 ends there
    tokens, evidence = store.propose([0, 1, 2], 5)
    assert tokens == [3, 4, 5]  # (4, 5) ends every answer it is in: nothing follows it
    assert [n for n, _ in evidence] == [2, 3, 3]  # (0, 1, 2) unknown: its first token from (1, 2)
    assert store.propose([0, 1, 2], 2)[0] == [3, 4]


def test_ties_go_to_the_smallest_id_and_rare_ngrams_are_dropped():
    store = Datastore.build([[1, 2, 7], [1, 2, 5]], DatastoreConfig(min_n=2, max_n=2, min_count=1))
    assert store.next_token([1, 2])[0] == 5
    strict = Datastore.build(ANSWERS, DatastoreConfig(min_n=2, max_n=2, min_count=2))
    assert strict.next_token([9, 2]) is None  # seen once
    assert strict.next_token([8, 8]) is None  # (8, 8) → 8 once
    assert strict.next_token([2, 3]) == (4, 2, 0.75)  # 4 three times of four


def test_no_ngram_spans_two_answers():
    store = Datastore.build([[1, 2], [3, 4]], DatastoreConfig(min_n=2, max_n=2, min_count=1))
    assert store.next_token([1, 2]) is None  # 2 ends its answer: 3 starts another
    assert len(store) == 0


def test_it_round_trips_through_its_file_and_refuses_a_corrupt_one(tmp_path):
    store = Datastore.build(ANSWERS, DatastoreConfig(min_n=2, max_n=3, min_count=1))
    path = tmp_path / "datastore.npz"
    store.save(path)
    back = Datastore.load(path)
    assert back.meta == store.meta and back.meta["sequences"] == 5 and back.meta["tokens"] == 22
    for context in ([2, 3, 4], [0, 1, 2], [8, 8]):
        assert back.propose(context, 4) == store.propose(context, 4)
    path.write_bytes(b"not a datastore")
    with pytest.raises(MirrorTrainError, match="cannot read the datastore"):
        Datastore.load(path)
    with pytest.raises(MirrorTrainError, match="cannot read the datastore"):
        Datastore.load(tmp_path / "missing.npz")


@pytest.mark.parametrize(
    "cfg,message",
    [
        (DatastoreConfig(min_n=3, max_n=2), "min_n"),
        (DatastoreConfig(min_n=0), "min_n"),
        (DatastoreConfig(min_count=0), "min_count"),
        (DatastoreConfig(prompt_tail=-1), "prompt_tail"),
    ],
)
def test_a_bad_config_is_refused(cfg, message):
    with pytest.raises(MirrorTrainError, match=message):
        Datastore.build(ANSWERS, cfg)


def test_negative_ids_are_refused():
    with pytest.raises(MirrorTrainError, match="≥ 0"):
        Datastore.build([[1, -5, 2]])


def server_with(store, committed):
    server = DraftServer(None, ngram_tokens=8, adaptive_window=True, datastore=store)
    server.gamma, server.costs, server.tokens = 4, [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4], list(committed)
    server.ngram.reset(committed)
    return server


def test_the_server_offers_whichever_copy_promises_more():
    """Prompt lookup's copy where the committed text has one and the datastore none, the datastore's where only it
    has one; with both, whichever the calibration learnt keeps more."""
    store = Datastore.build([[5, 6, 7, 8, 9]] * 3, DatastoreConfig(min_n=2, max_n=2, min_count=1))
    (tokens, keys, source), rate = server_with(store, [1, 2, 3, 1, 2])._copy()
    assert source == "ngram" and tokens == [3, 1, 2] and rate > 1
    (tokens, keys, source), rate = server_with(store, [1, 2, 5, 6])._copy()
    assert source == "store" and tokens == [7, 8, 9] and keys[0][0] == "store" and rate > 1
    server = server_with(store, [5, 6, 1, 5, 6])  # both: prompt lookup copies 1, 5, 6; the store says 7, 8, 9
    server.calibration.update([("ngram", 2, False)] * 3, 0)  # prompt lookup's copies were never kept
    for _ in range(20):
        server.calibration.update([("store", 2, 3, False)] * 3, 3)  # the store's always were
    assert server._copy()[0][2] == "store"
    server = server_with(store, [5, 6, 1, 5, 6])
    for _ in range(20):
        server.calibration.update([("ngram", 2, False)] * 3, 3)
    server.calibration.update([("store", 2, 3, False)] * 3, 0)
    assert server._copy()[0][2] == "ngram"


def test_with_no_model_the_two_copy_sources_fork_where_both_promise_tokens():
    """With forked windows and no model (pld_store, the engine's own copies), prompt lookup's chain and the
    datastore's, which differ from their first token, are verified together where a row costs little: the window is
    the better one's, the second chain the other's; with one source only, a single window."""
    from mirror_train.engine.rollout import Rollout

    store = Datastore.build([[5, 6, 7, 8, 9]] * 3, DatastoreConfig(min_n=2, max_n=2, min_count=1))
    server = server_with(store, [5, 6, 1, 5, 6])  # prompt lookup copies 1, 5, 6; the store says 7, 8, 9
    server.forks = True
    for _ in range(6):  # each source's first token kept about half the time
        server.calibration.update([("ngram", 2, False)] * 3, 1)
        server.calibration.update([("store", 2, 3, False)] * 3, 0)
    window = server._offer(Rollout([], [], 0, [], None), {})
    assert {window.info["source"], window.info["alt_source"]} == {"ngram", "store"}
    assert window.fork == 0 and window.tokens[0] != window.alt[0]
    assert window.tokens[:1] == [1] and window.alt[:1] == [7]  # the main chain is the better single copy's
    single = server_with(store, [1, 2, 3, 1, 2])  # the store has nothing after (1, 2)
    single.forks = True
    window = single._offer(Rollout([], [], 0, [], None), {})
    assert window.alt == [] and window.info["source"] == "ngram"


def test_without_a_datastore_the_server_copies_as_before():
    server = server_with(None, [1, 2, 3, 1, 2])
    index = NgramIndex()
    index.reset([1, 2, 3, 1, 2])
    (tokens, _, source), _ = server._copy()
    assert (tokens, source) == (index.propose(8)[0], "ngram")


def test_the_cli_builds_one_from_a_self_distilled_dataset(tmp_path, capsys):
    import datasets

    from mirror_train.cli import train_main

    rows = [{"id": str(i), "prompt_ids": [7, 8, 9], "answer_ids": a} for i, a in enumerate(ANSWERS)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "sd" / "dataset"))
    out = tmp_path / "store.npz"
    assert train_main(["datastore", "--data", str(tmp_path / "sd"), "--out", str(out), "--min-count", "1"]) == 0
    store = Datastore.load(out)
    assert store.meta["sequences"] == 5 and store.meta["tokens"] == 22 + 5 * 3  # each answer after the prompt's tail
    assert store.next_token([8, 9, 1]) == (2, 3, 1.0)
    assert train_main(["datastore", "--data", str(tmp_path / "sd")]) == 2  # nowhere to write it
    assert "--draft" in capsys.readouterr().err
    assert train_main(["datastore", "--data", str(tmp_path / "missing")]) == 2


def test_a_datastore_for_another_vocabulary_is_refused_before_it_proposes(tmp_path):
    from mirror_train.engine import EngineConfig, MirrorEngine
    from mirror_train.models.drafter import MirrorDrafterForCausalLM
    from mirror_train.target import Target
    from tests.conftest import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    target = Target(tiny_model("llama", layers=2, vocab=len(tok)), tok, "tiny")
    path = tmp_path / "other.npz"
    Datastore.build([[1, 2, len(tok) + 5]] * 2).save(path)  # an id the target does not have
    with pytest.raises(MirrorTrainError, match="another tokenizer"):
        Datastore.load(path).check_vocab(len(tok), path)
    engine = MirrorEngine(target, None, None, EngineConfig(placement="local", datastore=str(path)))
    with pytest.raises(MirrorTrainError, match="another tokenizer"):
        engine.generate([1, 2], 4, method="pld_store")
    draft = MirrorDrafterForCausalLM.from_target(target, 1)
    with pytest.raises(MirrorTrainError, match="another tokenizer"):
        MirrorEngine(target, None, draft, EngineConfig(placement="local", datastore=str(path)))


def test_the_held_out_walk_of_scripts_bench_datastore():
    """bench_datastore's walk: a store that holds the answer proposes all of it (8 matched and the target's own
    token, then the last 7), prompt lookup copies a repeat after its first occurrence, and an unknown setting is
    one line."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_datastore.py"
    spec = importlib.util.spec_from_file_location("bench_datastore", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompt, answer = [1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    store = Datastore.build([prompt[-2:] + answer] * 2, DatastoreConfig(min_count=1))
    out = bench.walk(prompt, answer, store, window=8, tail=2)
    assert out["store"] == [16, 2] and out["kept"] == 15 and out["proposed"] == 2
    repeat = [4, 5, 6, 7, 4, 5, 6, 7]
    out = bench.walk(prompt, repeat, None, window=8, tail=2)
    assert out["ngram"][0] == 8 and out["ngram"][1] < 8  # the second 4, 5, 6, 7 copied
    assert bench.parse_setting("min_count=1,data=0.5") == (DatastoreConfig(min_count=1), 0.5)
    with pytest.raises(MirrorTrainError, match="unknown datastore setting"):
        bench.parse_setting("window=3")
