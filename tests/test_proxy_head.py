"""Proxy heads, their losses and cached-label metrics, export/load, the data stages on a tiny target."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mirror_train import kernels
from mirror_train.data.features import FeatureCache, FeatureCacheConfig, TokenSequence, build_feature_cache
from mirror_train.data.selfdistill import SelfDistillConfig, generate_selfdistill, load_selfdistill
from mirror_train.errors import MirrorTrainError
from mirror_train.losses import topk_kl_loss, topk_margin_loss
from mirror_train.metrics import exit_report, topk_label_report
from mirror_train.models.proxy_head import KINDS, ProxyHead, ProxyHeadConfig, load_proxy_head, save_proxy_head
from mirror_train.target import Target
from tests.conftest import tiny_model, tiny_tokenizer


def test_topk_kl_by_hand():
    # target top-2 log-probs of ids 0 and 1: p̃ = softmax([log .6, log .2]) = [.75, .25]; proxy uniform over 4
    logp = torch.tensor([[math.log(0.6), math.log(0.2)]])
    ids = torch.tensor([[0, 1]])
    proxy = torch.zeros(1, 4)
    expected = 0.75 * math.log(0.75 / 0.25) + 0.25 * math.log(0.25 / 0.25)
    assert topk_kl_loss(proxy, ids, logp).item() == pytest.approx(expected, rel=1e-5)
    # a proxy equal to p̃ on those ids and -inf elsewhere has zero loss
    exact = torch.tensor([[math.log(0.75), math.log(0.25), -1e9, -1e9]])
    assert topk_kl_loss(exact, ids, logp).item() == pytest.approx(0.0, abs=1e-6)


def test_topk_margin_by_hand():
    proxy = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    # target token 2 (logit 1): κ=1 → best other is 3.0 → relu(1 + 3 - 1) = 3; κ=3 → 3rd best other is 0.0 → 0
    assert topk_margin_loss(proxy, torch.tensor([2]), kappa=1).item() == pytest.approx(3.0)
    assert topk_margin_loss(proxy, torch.tensor([2]), kappa=3).item() == pytest.approx(0.0)
    assert topk_margin_loss(proxy, torch.tensor([2]), kappa=2).item() == pytest.approx(1.0 + 2.0 - 1.0)


def test_label_report_equals_exact_report_when_k_is_the_vocab():
    torch.manual_seed(0)
    final, proxy = torch.randn(50, 16), torch.randn(50, 16)
    top = torch.log_softmax(final, -1).topk(16, -1)
    approx = topk_label_report(proxy, top.indices, top.values, (1, 4, 8))
    exact = exit_report(proxy, final, (1, 4, 8))
    for key in ("hit_1", "hit_4", "hit_8", "omega_4", "oracle_omega_8", "top1"):
        assert approx[key] == pytest.approx(exact[key], abs=1e-5), key
    # with fewer labels Ω is a lower bound and hit stays exact
    top4 = torch.log_softmax(final, -1).topk(4, -1)
    partial = topk_label_report(proxy, top4.indices, top4.values, (1, 4, 8))
    assert partial["omega_8"] <= exact["omega_8"] + 1e-6
    assert partial["hit_8"] == pytest.approx(exact["hit_8"])


@pytest.fixture
def target():
    return Target(tiny_model("llama", vocab=128), tiny_tokenizer(), "tiny")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_starts_at_the_logit_lens_and_round_trips(kind, target, tmp_path):
    cfg = ProxyHeadConfig(kind=kind, exit_layer=2, rank=8 if kind == "residual" else None, mlp_hidden=16, lora_rank=4)
    head = ProxyHead(cfg, target.hidden_size).bind(target)
    hidden = torch.randn(2, 5, target.hidden_size)
    if kind != "attention":
        torch.testing.assert_close(head(hidden), target.lens_logits(hidden))
    for p in head.parameters():
        if p.requires_grad:
            p.data += 0.05 * torch.randn_like(p)
    save_proxy_head(head, tmp_path / "head", target)
    loaded = load_proxy_head(tmp_path / "head", target, exit_layer=2)
    torch.testing.assert_close(loaded(hidden), head(hidden))
    assert "proxy_head" in (tmp_path / "head" / "README.md").read_text()
    ids, logp = loaded.candidates(hidden, kappa=4)
    assert ids.shape == (2, 5, 4) and (logp[..., :-1] >= logp[..., 1:]).all()


def test_attention_head_starts_as_the_next_target_layer_and_caches_like_it(target):
    ids = torch.randint(0, 128, (1, 12))
    hidden, _ = target.hidden_states(ids)
    head = ProxyHead(ProxyHeadConfig(kind="attention", exit_layer=2), target.hidden_size).bind(target)
    full = head(hidden[2])
    torch.testing.assert_close(full, target.lens_logits(hidden[3]), atol=1e-5, rtol=0)
    # windows against the head's own cache, with a rollback, equal the one-shot pass
    cache = head.new_cache()
    head(hidden[2][:, :9], cache)
    target.crop(cache, 6)
    torch.testing.assert_close(head(hidden[2][:, 6:], cache), full[:, 6:], atol=1e-5, rtol=0)
    assert head.num_parameters() == sum(p.numel() for p in target.decoder.layers[2].parameters())


def test_head_never_stores_the_targets_lm_head(target):
    head = ProxyHead(ProxyHeadConfig(kind="lora_head", exit_layer=2, mlp_hidden=8, lora_rank=2), 32).bind(target)
    assert all("base_layer" not in k for k in head.trainable_state_dict())
    assert head.num_parameters() == 32 + 2 * 32 * 8 + 2 * (32 + 128)


def test_head_for_another_target_or_layer_is_refused(target, tmp_path):
    head = ProxyHead(ProxyHeadConfig(kind="residual", exit_layer=2), 32).bind(target)
    save_proxy_head(head, tmp_path / "head", target)
    with pytest.raises(MirrorTrainError, match="ℓe=2, not ℓe=3"):
        load_proxy_head(tmp_path / "head", target, exit_layer=3)
    other = Target(tiny_model("llama", layers=6, vocab=128), tiny_tokenizer(), "deeper")
    with pytest.raises(MirrorTrainError, match="num_layers: 4 vs 6"):
        load_proxy_head(tmp_path / "head", other)


@pytest.mark.parametrize(
    "bad, match",
    [(dict(kappa=0), "κ"), (dict(rank=0), "rank"), (dict(kind="tree"), "unknown proxy head kind")],
)
def test_bad_head_configs(bad, match):
    with pytest.raises(MirrorTrainError, match=match):
        ProxyHead(ProxyHeadConfig(**bad), 32)


def test_unbound_head_says_so():
    with pytest.raises(MirrorTrainError, match="not bound"):
        ProxyHead(ProxyHeadConfig(kind="lens"), 32)(torch.zeros(1, 32))


def test_selfdistill_resumes_and_features_match_the_target(tiny_target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(f'{{"id": "p{i}", "turns": ["how to write {i}", "and the {i}"]}}' for i in range(5)) + "\n"
    )
    cfg = SelfDistillConfig(prompts=str(prompts), num_prompts=None, max_new_tokens=6, batch_size=2)
    out = generate_selfdistill(cfg, tmp_path / "sd", tiny_target)
    ds = load_selfdistill(out)
    assert len(ds) == 10 and sorted(set(ds["turn"])) == [0, 1]
    # turn 2's prompt holds turn 1's answer: it is longer than turn 1's prompt plus the answer
    first = {r["id"]: r for r in ds if r["turn"] == 0}
    assert all(len(r["prompt_ids"]) > len(first[r["id"]]["prompt_ids"]) for r in ds if r["turn"] == 1)
    # a second run with the same settings resumes (nothing to do); other settings are refused
    rows = (tmp_path / "sd" / "work" / "rows.jsonl").read_text()
    generate_selfdistill(cfg, tmp_path / "sd", tiny_target)
    assert (tmp_path / "sd" / "work" / "rows.jsonl").read_text() == rows
    with pytest.raises(MirrorTrainError, match="other settings"):
        generate_selfdistill(SelfDistillConfig(prompts=str(prompts), max_new_tokens=7), tmp_path / "sd", tiny_target)

    seqs = [TokenSequence(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in ds]
    fcfg = FeatureCacheConfig(exit_layers=[1, 3], top_k=5, max_tokens_per_batch=64)
    build_feature_cache(tiny_target, seqs, tmp_path / "feat", fcfg, progress=False)
    cache = FeatureCache(tmp_path / "feat", 3)
    assert len(cache) == sum(len(s.ids) - 1 for s in seqs)
    s = 7  # one sequence, checked against a direct forward
    ids = torch.tensor([seqs[s].ids])
    hidden, logits = tiny_target.hidden_states(ids)
    lo, hi = cache.offsets[s], cache.offsets[s + 1]
    np.testing.assert_allclose(cache.hidden[lo:hi], hidden[3][0, :-1].numpy(), atol=2e-3, rtol=1e-2)
    top = torch.log_softmax(logits[0, :-1], -1).topk(5, -1)
    assert (cache.topk_ids[lo:hi] == top.indices.numpy()).mean() > 0.99  # ties may swap in float16
    assert cache.is_answer[lo:hi].sum() == len(seqs[s].ids) - seqs[s].answer_start
    assert cache.token_ids[lo:hi].tolist() == seqs[s].ids[:-1]
    with pytest.raises(MirrorTrainError, match="not layer 2"):
        FeatureCache(tmp_path / "feat", 2)


def test_dataset_without_expected_columns(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(MirrorTrainError, match="lacks column"):
        load_selfdistill(tmp_path / "ds")


def test_push_cli_dry_run(target, tmp_path, capsys, monkeypatch):
    from mirror_train.cli import train_main

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    save_proxy_head(ProxyHead(ProxyHeadConfig(kind="residual", exit_layer=2), 32).bind(target), tmp_path / "h", target)
    assert train_main(["push", str(tmp_path / "h"), "--repo-id", "me/head", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model.safetensors" in out and "nothing uploaded" in out
    assert train_main(["push", str(tmp_path / "h"), "--repo-id", "me/head"]) == 2
    assert "HF_TOKEN" in capsys.readouterr().err


def test_a_head_served_on_the_drafts_side_routes_its_linears_and_scores_the_same(target):
    """On the draft's side the head is served like the draft (`fastpath.for_draft`, channel.build_server): its
    own layers and the LM head it holds apart both take the routed path, and it scores what the plain head does."""
    import copy

    from mirror_train import fastpath
    from mirror_train.models.proxy_head import HeadEnd

    cfg = ProxyHeadConfig(kind="mlp", exit_layer=2, mlp_hidden=16)
    end, state = HeadEnd.of(ProxyHead(cfg, target.hidden_size).bind(target))
    head = end.head(cfg, state, None)
    served = copy.deepcopy(head)
    for module in (served, served.lm_head):
        fastpath.install(module, fastpath.for_draft("auto"))
    assert fastpath.routes(served) and fastpath.routes(served.lm_head)
    hidden = torch.randn(1, 5, target.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(served(hidden), head(hidden), atol=1e-4, rtol=1e-4)


def _random_head(target, kind: str, mlp_hidden: int, seed: int) -> tuple[ProxyHead, ProxyHeadConfig, torch.Generator]:
    """A proxy head bound to `target` with random weights (its generator, to draw inputs from after them)."""
    g = torch.Generator().manual_seed(seed)
    cfg = ProxyHeadConfig(kind=kind, exit_layer=2, mlp_hidden=mlp_hidden, kappa=8)
    proxy = ProxyHead(cfg, target.hidden_size).bind(target)
    with torch.no_grad():
        for p in proxy.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return proxy, cfg, g


@pytest.mark.skipif(not kernels.available(), reason="no C compiler here to build the kernels")
@pytest.mark.parametrize("kind", ["mlp", "lens", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("restricted", [False, True])
def test_a_heads_candidates_in_one_c_call_are_torchs(kind, dtype, restricted, target):
    """A head served on the draft's side answers `window_candidates` in one C call (fused_head.py) where its kind
    allows (mlp, lens; a residual head keeps torch's path): the same top-κ, log-probs and window log-probs as the
    torch path, to float32 rounding (bfloat16 weights: the C call's activations stay float32, torch's do not, so
    near-ties may swap), a window token outside a restricted vocabulary at OUTSIDE_LOGP; at T > 0 (noise, the
    target's sampling noise over its whole vocabulary) both rank the logits plus the noise at the head's own ids."""
    from mirror_train import fastpath, fused_head
    from mirror_train.models.proxy_head import OUTSIDE_LOGP, HeadEnd

    proxy, cfg, g = _random_head(target, kind, 16, 0)
    ids = torch.arange(3, 128, 2) if restricted else None
    proxy.restrict(ids)
    end, state = HeadEnd.of(proxy)
    head = end.to(dtype).head(cfg, state, ids).to(dtype)
    fastpath.install_head(head, fastpath.for_draft("auto"))
    assert ("_fused_head" in head.__dict__) == (kind != "residual")
    hidden = (torch.randn(5, target.hidden_size, generator=g) * 2).to(dtype)
    window = [3, 4, 5, 127]  # 4: outside the restricted vocabulary
    noise = torch.randn(5, target.vocab_size, generator=g) * 3
    fused = [head.window_candidates(hidden, window, 8, noise=n) for n in (None, noise)]
    head.__dict__.pop("_fused_head", None)
    plain = [head.window_candidates(hidden, window, 8, noise=n) for n in (None, noise)]
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for one, other in zip(fused, plain):
        for got, want in zip(one[1], other[1]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=tol, rtol=0)
        torch.testing.assert_close(torch.tensor(one[2]), torch.tensor(other[2]), atol=tol, rtol=0)
        if restricted:
            assert one[2][1] == OUTSIDE_LOGP
        overlap = sum(len(set(a) & set(b)) for a, b in zip(one[0], other[0])) / (5 * 8)
        assert overlap == 1.0 if dtype == torch.float32 else overlap >= 0.9
        assert all(i in (ids.tolist() if restricted else range(128)) for row in one[0] for i in row)
    assert fused[0][0] != fused[1][0]  # the noise moved the candidates
    assert not fused_head.install(ProxyHead(ProxyHeadConfig(kind="attention", exit_layer=2), target.hidden_size))


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, q8: bool) -> torch.Tensor:
    """What the C call's int8 linear computes (fused_head.quantize_rows; csrc/linear_q8.c), in float64: int8 weight
    rows times their scale; on the dot product (q8) the inputs rounded to 8 bits per row too, the sum exact."""
    from mirror_train.fused_head import quantize_rows

    wq, ws = quantize_rows(weight)
    x = x.float()
    if q8:  # each row's largest magnitude to 127, rounded to nearest in float32 as the C code does
        xs = x.abs().amax(-1, keepdim=True) / 127
        xs = torch.where(xs > 0, xs, torch.ones_like(xs))
        x = (x * (1 / xs)).round().clamp(-127, 127).double() * xs.double()
    return (x.double() @ wq.double().T * ws.double()).float()


@pytest.mark.skipif(not kernels.available(), reason="no C compiler here to build the kernels")
@pytest.mark.parametrize("kind", ["mlp", "lens"])
@pytest.mark.parametrize("q8", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 11])
def test_a_heads_int8_copy_computes_what_its_quantized_weights_do(kind, q8, rows, target, monkeypatch):
    """head_weights=int8: the head's C call reads int8 copies of its linears, on AVX512-VNNI's dot product (q8,
    its inputs rounded to 8 bits) or widened to float32 (elsewhere): its candidates are torch's with every linear
    replaced by that arithmetic (`_int8_linear`), over whole and part panels (a restricted vocabulary of 61 ids,
    the tiny target's 128), and 1, 5 and 11 rows (the kernel's tiles hold 8)."""
    from mirror_train import fastpath
    from mirror_train.models.proxy_head import HeadEnd

    if q8 and not kernels.q8_dot():
        pytest.skip("no AVX512-VNNI here: the int8 copy is read as rows")
    monkeypatch.setattr(kernels, "q8_dot", lambda real=kernels.q8_dot: q8 and real())
    proxy, cfg, g = _random_head(target, kind, 40, 2)
    for ids in (None, torch.arange(3, 125, 2)):
        proxy.restrict(ids)
        end, state = HeadEnd.of(proxy)
        head = end.head(cfg, state, ids)
        fastpath.install_head(head, fastpath.for_draft("auto"), "int8")
        assert "_fused_head" in head.__dict__
        hidden = torch.randn(rows, target.hidden_size, generator=g) * 2
        window = [5, 7, 9, 11][: rows - 1]
        fused = head.window_candidates(hidden, window, 8)
        head.__dict__.pop("_fused_head")
        linears = ([head.fc1, head.fc2] if kind == "mlp" else []) + [head._head.proj]
        for m in linears:
            monkeypatch.setattr(m, "forward", lambda x, m=m: _int8_linear(x, m.weight, q8))
        plain = head.window_candidates(hidden, window, 8)
        for m in linears:
            monkeypatch.delattr(m, "forward")
        for got, want in zip(fused[1], plain[1]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(fused[2]), torch.tensor(plain[2]), atol=1e-4, rtol=0)
        assert fused[0] == plain[0]


def test_head_weights_auto_is_int8_where_the_dot_product_of_byte_quads_is_built():
    from mirror_train import fused_head

    want = "int8" if kernels.available() and kernels.q8_dot() else "served"
    assert fused_head.resolve_weights("auto") == want
    assert fused_head.resolve_weights("served") == "served"
    with pytest.raises(ValueError, match="head weights"):
        fused_head.resolve_weights("int4")
    with pytest.raises(MirrorTrainError, match="head_weights"):
        from mirror_train.engine import EngineConfig

        EngineConfig(head_weights="int4").validate()


def test_a_heads_c_call_on_the_avx2_and_scalar_builds(other_kernel_build, target):
    """The same C call built as AVX2-only and plain x86-64 machines build it (their exp and top-κ paths, their int8
    rows widened on load): torch's candidates, float32, with the served weights and with int8 copies."""
    from mirror_train import fastpath
    from mirror_train.models.proxy_head import HeadEnd

    proxy, cfg, g = _random_head(target, "mlp", 16, 1)
    end, state = HeadEnd.of(proxy)
    head = end.head(cfg, state, None)
    hidden = torch.randn(3, target.hidden_size, generator=g) * 2
    assert not kernels.q8_dot()  # no AVX512-VNNI in these builds: an int8 copy is read as rows
    for weights in ("served", "int8"):
        fastpath.install_head(head, fastpath.for_draft("auto"), weights)
        assert "_fused_head" in head.__dict__
        fused = head.window_candidates(hidden, [1, 2], 8)
        head.__dict__.pop("_fused_head")
        linears = [head.fc1, head.fc2, head._head.proj] if weights == "int8" else []
        for m in linears:
            m.forward = lambda x, m=m: _int8_linear(x, m.weight, False)
        plain = head.window_candidates(hidden, [1, 2], 8)
        for m in linears:
            del m.forward
        assert fused[0] == plain[0]
        torch.testing.assert_close(torch.tensor(fused[1]), torch.tensor(plain[1]), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(fused[2]), torch.tensor(plain[2]), atol=1e-4, rtol=0)
