"""`mirror-eval specbench`: the question file's checks, the score against hand values, and (testbed) a whole run
with every method: answers in Spec-Bench's schema, identical greedy answers, resume, refusal of other settings."""

from __future__ import annotations

import json

import pytest

from mirror_train.cli import eval_main
from mirror_train.devices import cpu_model
from mirror_train.errors import MirrorTrainError
from mirror_train.eval.questions import check_file, load_questions
from mirror_train.eval.score import score, write_report


# --- the question file --------------------------------------------------------------------------------------------
def test_the_shared_question_file_is_spec_benchs(shared_dir):
    path = check_file(shared_dir / "data" / "specbench" / "question.jsonl")
    questions = load_questions(path, ["qa", "mt_bench"], per_category=3)
    assert len(questions) == 6 and {q.category for q in questions[3:]} == {"qa"}
    assert len({q.category for q in questions[:3]}) == 3  # mt_bench's picks spread over its categories


def test_a_question_file_with_another_checksum_is_refused(tmp_path, shared_dir):
    copy = tmp_path / "q.jsonl"
    copy.write_text((shared_dir / "data" / "specbench" / "question.jsonl").read_text()[:-2] + "\n")
    with pytest.raises(MirrorTrainError, match="sha256 differs"):
        check_file(copy)


def test_bad_lines_and_categories_are_named(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n{"question_id": 2, "turns": \n')
    with pytest.raises(MirrorTrainError, match=r"q.jsonl:2"):
        load_questions(bad)
    bad.write_text('{"question_id": 1, "category": "poetry", "turns": ["hi"]}\n')
    with pytest.raises(MirrorTrainError, match="unknown category 'poetry'"):
        load_questions(bad)
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n')
    with pytest.raises(MirrorTrainError, match="unknown categories"):
        load_questions(bad, ["poetry"])


# --- the score ----------------------------------------------------------------------------------------------------
def answer(qid, category, turns, new_tokens, wall_time, accept_lengths, stats=None):
    choice = {"index": 0, "turns": turns, "new_tokens": new_tokens, "wall_time": wall_time}
    choice |= {"decoding_steps": [len(accept_lengths)], "accept_lengths": accept_lengths}
    return {"question_id": qid, "category": category, "choices": [choice], "mirror_stats": stats or []}


def test_score_recomputes_spec_bench_metrics_by_hand(tmp_path):
    (tmp_path / "answers").mkdir()
    ar = [answer(1, "qa", ["a"], [10], [2.0], [1] * 10), answer(2, "writing", ["b", "c"], [4, 4], [1.0, 1.0], [1] * 8)]
    fast = [
        answer(1, "qa", ["a"], [10], [1.0], [3, 3, 4], [{"reused": [True, False], "hits": [True], "omegas": [0.5]}]),
        answer(2, "writing", ["b", "X"], [4, 4], [0.5, 0.5], [2, 2, 4]),
    ]
    for name, recs in (("ar", ar), ("mirror", fast)):
        (tmp_path / "answers" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    result = score(tmp_path)["methods"]["mirror"]
    # rate_q: ar 5 and 4 tokens/s, mirror 10 and 8: speed-up = mean(10, 8) / mean(5, 4) = 2.
    assert result["overall"]["speedup"] == pytest.approx(2.0)
    assert result["qa"]["tokens_per_s"] == pytest.approx(10.0)
    assert result["overall"]["mean_accepted"] == pytest.approx(18 / 6)
    assert result["overall"]["reuse_rate"] == 0.5 and result["overall"]["lossless"] == 0.5
    report = write_report(tmp_path)
    assert "2.00×" in report.read_text() and (tmp_path / "speedup.png").stat().st_size > 1000
    assert eval_main(["specbench", "score", str(tmp_path)]) == 0


# --- a whole run on the testbed -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def untrained_draft_dir(testbed_target, tmp_path_factory):
    from mirror_train.models.draft_artifact import save_draft
    from mirror_train.models.drafter import MirrorDrafterForCausalLM

    draft = MirrorDrafterForCausalLM.from_target(testbed_target, 2, 2, 1)
    return save_draft(draft, tmp_path_factory.mktemp("draft") / "export", testbed_target)


@pytest.mark.testbed
def test_a_run_answers_every_method_identically_resumes_and_refuses_other_settings(
    testbed_target, testbed_path, untrained_draft_dir, tmp_path, shared_dir
):
    from mirror_train.datastore import Datastore
    from mirror_train.engine import EngineConfig
    from mirror_train.eval.specbench import SpecBenchConfig, run_specbench

    store = tmp_path / "datastore.npz"  # pld_store runs with it, sd and mirror read it too
    Datastore.build([testbed_target.tokenizer.encode("The answer is yes. The answer is no. I think so.")]).save(store)
    cfg = SpecBenchConfig(
        out=str(tmp_path / "run"),
        target=str(testbed_path),
        draft=str(untrained_draft_dir),
        categories="qa,writing",  # writing: two turns, the second after the method's own first answer
        limit_per_category=1,
        max_new_tokens=8,
        warmups=1,
        engine=EngineConfig(placement="local", datastore=str(store)),
    )
    out = run_specbench(cfg)
    lines = {m: (out / "answers" / f"{m}.jsonl").read_text().splitlines() for m in cfg.method_list}
    assert all(len(v) == 2 for v in lines.values())
    record = json.loads(lines["mirror"][0])
    assert {"question_id", "category", "answer_id", "model_id", "tstamp", "choices"} <= set(record)
    choice = record["choices"][0]
    assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 2
    assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])
    # the contention reading that decided whether the draft worked concurrently is on record (0 in-process)
    assert all(turn["contention"] == 0.0 for turn in record["mirror_stats"])
    result = score(out)
    assert all(r["overall"]["lossless"] == 1.0 for r in result["methods"].values())
    for m in ("assisted", "hf_pld"):
        peer = [json.loads(line)["choices"][0] for line in lines[m]]
        assert all(sum(c["accept_lengths"]) == sum(c["new_tokens"]) for c in peer)

    run_specbench(cfg)  # resumed: nothing left to do, nothing rewritten
    assert {m: (out / "answers" / f"{m}.jsonl").read_text().splitlines() for m in cfg.method_list} == lines
    machines = json.loads((out / "run.json").read_text())["machines"]  # each start: where it was timed
    assert len(machines) == 2 and all(m["cpu"] == cpu_model() and m["fast_path"] != "auto" for m in machines)
    assert all(m["prefill_threads"] >= 1 for m in machines)
    assert "Served from " in write_report(out).read_text()
    cfg.max_new_tokens = 16
    with pytest.raises(MirrorTrainError, match="max_new_tokens: 8 → 16"):
        run_specbench(cfg)
    assert (out / "answers" / "ar.jsonl").read_text().splitlines() == lines["ar"]


def test_bad_method_lists_are_refused():
    from mirror_train.eval.specbench import SpecBenchConfig

    for methods, message in (("sd,mirror", "must include ar"), ("ar,eagle", "unknown methods"), ("ar,sd", "--draft")):
        with pytest.raises(MirrorTrainError, match=message):
            SpecBenchConfig(methods=methods).validate()


def test_assisted_generation_is_skipped_for_a_draft_that_reads_the_targets_states(tmp_path):
    """transformers runs an assistant as a plain LM: it cannot feed a conditioned draft the target's states."""
    from mirror_train.eval.specbench import SpecBenchConfig, _servable

    conditioned, plain = tmp_path / "conditioned", tmp_path / "plain"
    for path, kind in ((conditioned, "target_hidden"), (plain, "none")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"feature_conditioning": kind}))
    with pytest.warns(UserWarning, match="skipping assisted"):
        assert _servable(SpecBenchConfig(draft=str(conditioned))) == ["ar", "sd", "mirror", "pld", "hf_pld"]
    assert _servable(SpecBenchConfig(draft=str(plain))) == ["ar", "sd", "mirror", "pld", "assisted", "hf_pld"]


def test_pld_store_runs_where_a_datastore_is_at_hand(tmp_path):
    """pld_store copies from the draft's datastore (or engine.datastore=PATH); without one it is skipped, with a
    warning, like assisted with a draft transformers cannot serve."""
    from mirror_train.datastore import Datastore
    from mirror_train.engine import EngineConfig
    from mirror_train.eval.specbench import SpecBenchConfig, _servable

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"feature_conditioning": "none"}))
    methods = "ar,pld,pld_store"
    with pytest.warns(UserWarning, match="skipping pld_store"):
        assert _servable(SpecBenchConfig(draft=str(draft), methods=methods)) == ["ar", "pld"]
    Datastore.build([[1, 2, 3, 4]]).save(draft / "datastore.npz")
    assert _servable(SpecBenchConfig(draft=str(draft), methods=methods)) == ["ar", "pld", "pld_store"]
    elsewhere = tmp_path / "store.npz"
    Datastore.build([[1, 2, 3, 4]]).save(elsewhere)
    cfg = SpecBenchConfig(methods=methods, engine=EngineConfig(datastore=str(elsewhere)))
    assert _servable(cfg) == ["ar", "pld", "pld_store"]


def test_a_peers_prompt_prefill_spreads_as_the_engines_and_its_steps_do_not():
    """transformers' generate under `PrefillSpread`: its first forward (the prompt's prefill) on the engine's prefill
    layout, every later forward on the threads around it, and the same tokens as without it."""
    import torch

    from mirror_train.eval.peers import PrefillSpread, greedy_generate
    from tests.conftest import tiny_model

    model = tiny_model("llama", layers=2, vocab=128)
    threads = []
    hook = model.register_forward_pre_hook(lambda *_: threads.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            plain = greedy_generate(model, [5, 6, 7, 8], 6, [])
            threads.clear()
            with PrefillSpread(model, (None, before + 1)):
                spread = greedy_generate(model, [5, 6, 7, 8], 6, [])
    finally:
        hook.remove()
    assert spread == plain
    assert threads == [before + 1] + [before] * 5
    assert torch.get_num_threads() == before and not model._forward_pre_hooks
