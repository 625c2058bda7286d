"""Draft distillation: the loss and metric by hand, set-up modes on a tiny target, the recipe end to end."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from mirror_train.config import load_config
from mirror_train.datastore import Datastore
from mirror_train.drafter_training import (
    DrafterModelConfig,
    DrafterRunConfig,
    DrafterTrainConfig,
    build_draft,
    drafter_loss,
    evaluate_drafter,
    open_caches,
)
from mirror_train.errors import MirrorTrainError
from mirror_train.models.draft_artifact import load_draft, save_draft
from mirror_train.models.drafter import MirrorDrafterForCausalLM
from mirror_train.proxy_training import ProxyRunConfig
from mirror_train.target import Target
from tests.conftest import tiny_model, tiny_tokenizer
from tests.test_recipes import write_prompts

ROOT = Path(__file__).resolve().parents[1]
CONSTANT_LR = ["optim.warmup_steps=0", "optim.min_lr_ratio=1.0"]


class FixedDraft(torch.nn.Module):
    """Stands in for a draft: fixed logits, the real vocabulary maps over `d2t`, no feature fusion. Given `mask`,
    its logits are per padded position and it answers the training loss's packed row with the real ones in order."""

    fusion = None
    target_to_draft = MirrorDrafterForCausalLM.target_to_draft
    draft_to_target = MirrorDrafterForCausalLM.draft_to_target

    def __init__(self, logits, stream_logits, d2t, vocab_size, mask=None):
        super().__init__()
        self.logits, self.stream_logits, self.d2t = logits, stream_logits, d2t
        if mask is not None:
            self.logits, self.stream_logits = logits[mask.bool()][None], stream_logits[mask.bool()][None]
        self.config = SimpleNamespace(vocab_size=vocab_size, num_streams=stream_logits.shape[2], slots=[])
        self.device = torch.device("cpu")

    def forward(self, input_ids, features=None, **kwargs):
        assert input_ids.shape == self.logits.shape[:2]
        return SimpleNamespace(logits=self.logits, stream_logits=self.stream_logits)


# --- the loss and the metric by hand ---------------------------------------------------------------------------------
def _log_softmax(row: list[float]) -> list[float]:
    z = math.log(sum(math.exp(x) for x in row))
    return [x - z for x in row]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_drafter_loss_matches_a_hand_computed_reference():
    torch.manual_seed(0)
    d2t = torch.tensor([0, 1, 2, 4])  # target id 3 is outside the draft vocabulary; target 4 is draft 3
    to_draft = {0: 0, 1: 1, 2: 2, 4: 3}
    B, T, S = 2, 4, 2
    logits, streams = torch.randn(B, T, 4), torch.randn(B, T, S, 4)  # (B, T, V_draft), (B, T, S, V_draft)
    topk_ids = torch.tensor([[[3, 1], [2, 0], [4, 2], [0, 0]], [[1, 2], [3, 4], [0, 1], [2, 3]]])  # (B, T, k)
    topk_logp = -torch.rand(B, T, 2) * 3
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # row 0 ends in padding; row 1 fills the window
    batch = {
        "token_ids": torch.zeros(B, T, dtype=torch.long),
        "mask": mask,
        "topk_ids": topk_ids,
        "topk_logp": topk_logp,
        "hidden": torch.zeros(B, T, 8),
    }
    cfg = DrafterTrainConfig(kl_weight=1.0, ce_weight=0.5, stream_weight=0.1)
    loss, parts = drafter_loss(FixedDraft(logits, streams, d2t, vocab_size=5, mask=mask), batch, cfg)

    # the definitions, position by position, in plain floats
    kls, ce_main, ce_streams = [], [], {1: [], 2: []}
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            main = _log_softmax(logits[b, t].tolist())
            # KL over the top-k ids the draft has, renormalised (row 0, t 0 keeps only id 1: p = 1)
            kept = [
                (to_draft[i], lp) for i, lp in zip(topk_ids[b, t].tolist(), topk_logp[b, t].tolist()) if i in to_draft
            ]
            z = math.log(sum(math.exp(lp) for _, lp in kept))
            kls.append(sum(math.exp(lp - z) * ((lp - z) - main[d]) for d, lp in kept))
            argmax = int(topk_ids[b, t, 0])
            if argmax in to_draft:  # the target's choice at t, unless the draft cannot propose it
                ce_main.append(-main[to_draft[argmax]])
            for j in (1, 2):  # stream j at t: the target's choice at t+j, a real position of the window
                if t + j < T and mask[b, t + j] and int(topk_ids[b, t + j, 0]) in to_draft:
                    ahead = _log_softmax(streams[b, t, j - 1].tolist())
                    ce_streams[j].append(-ahead[to_draft[int(topk_ids[b, t + j, 0])]])
    assert [len(ce_main), len(ce_streams[1]), len(ce_streams[2])] == [5, 4, 3]  # id 3 and padding drop out
    kl = _mean(kls)
    expected = kl + 0.5 * _mean(ce_main) + 0.1 * (_mean(ce_streams[1]) + _mean(ce_streams[2]))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert parts["kl"] == pytest.approx(kl, rel=1e-5) and parts["loss"] == pytest.approx(expected, rel=1e-5)


def test_evaluate_counts_main_and_stream_agreement_on_answer_positions():
    # one sequence of 4 positions, answers from position 1; target argmax 5, 6, 7, 8; full vocabulary
    argmax = torch.tensor([5, 6, 7, 8])
    main_guess = torch.tensor([5, 6, 0, 8])  # answer positions 1..3: right, wrong, right
    stream_guess = torch.tensor([6, 7, 0, 0])  # stream 1 at t guesses argmax[t+1]: t=1 right, t=2 wrong
    onehot = torch.nn.functional.one_hot
    logits, streams = onehot(main_guess, 10)[None].float(), onehot(stream_guess, 10)[None, :, None].float()
    cache = SimpleNamespace(
        num_sequences=1,
        offsets=[0, 4],
        is_answer=[False, True, True, True],
        windows=lambda spans: {
            "token_ids": torch.zeros(1, 4, dtype=torch.long),
            "topk_ids": argmax[None, :, None],
            "hidden": torch.zeros(1, 4, 2),
            "mask": torch.ones(1, 4, dtype=torch.long),
        },
    )
    metrics = evaluate_drafter(FixedDraft(logits, streams, None, vocab_size=10), cache, depth=1)
    # 2-token windows from answer anchors 1 and 2: from 1, the first right (6), the second wrong (0 for 7): 1 kept;
    # from 2, the first wrong: 0 kept. chain_1: the second token right from anchor 2 (8), not from 1.
    expected = {"top1": 2 / 3, "stream_1": 1 / 2, "chain_1": 1 / 2, "accept_len": 1 / 2, "positions": 3}
    assert metrics == pytest.approx(expected)


# --- the recipe on the tiny target -----------------------------------------------------------------------------------
def run_recipe(config: Path, *overrides: str, timeout=300):
    cmd = [sys.executable, str(ROOT / "recipes" / "drafter.py"), "--config", str(config), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def drafter_config(tmp_path_factory, tiny_model_dir) -> Path:
    root = tmp_path_factory.mktemp("drafter")
    cfg = {
        "output_dir": str(root / "run"),
        "target": str(tiny_model_dir),
        "model": {"num_layers": 2, "num_streams": 2, "num_stream_layers": 1},
        "data": {  # the proxy recipe test's data: 6 self-distilled answers, 4 forced prompts, 3 held-out answers
            "dir": str(root / "data"),
            "selfdistill": {
                "prompts": str(write_prompts(root / "train.jsonl", 12, "t")),
                "num_prompts": 6,
                "max_new_tokens": 8,
            },
            "forced_prompts": 4,
            "heldout": {"prompts": str(write_prompts(root / "held.jsonl", 3, "h")), "max_new_tokens": 8},
            "top_k": 8,
        },
        "train": {"batch_size": 32, "max_steps": 4, "eval_every": 2, "save_every": 2, "keep_checkpoints": 5},
        "optim": {"lr": 1e-2},
        "log": {"report_to": ["tensorboard"]},
    }
    path = root / "drafter.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def straight_run(drafter_config) -> Path:
    """4 steps at a constant LR, checkpoints after steps 2 and 4."""
    proc = run_recipe(drafter_config, *CONSTANT_LR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported" in proc.stdout
    return drafter_config.parent / "run"


@pytest.fixture(scope="module")
def caches(drafter_config, straight_run, tiny_target):
    """The tiny run's train and held-out feature caches (built by the straight run)."""
    return open_caches(load_config(DrafterRunConfig, drafter_config), tiny_target)


def test_recipe_trains_and_exports_a_draft_that_loads(straight_run, tiny_model_dir, tiny_target):
    from transformers import AutoModelForCausalLM

    export = straight_run / "export"
    weights, original = load_file(export / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())  # a NaN loss would have reached the weights
    assert not torch.equal(weights["layers.0.mlp.down_proj.weight"], original["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(weights["embed_tokens.weight"], original["model.embed_tokens.weight"])  # frozen by default
    meta = json.loads((export / "mirror_config.json").read_text())
    assert meta["kind"] == "draft" and meta["config"]["steps"] == 4 and meta["target"]["num_layers"] == 4
    assert "| top1 |" in (export / "README.md").read_text()
    store = Datastore.load(export / "datastore.npz")  # the target's own answers, served beside the draft
    assert meta["config"]["datastore"] == store.meta and store.meta["sequences"] > 0 and len(store) > 0

    auto = AutoModelForCausalLM.from_pretrained(export)
    checked = load_draft(export, tiny_target)
    assert type(auto) is MirrorDrafterForCausalLM and auto.config.num_streams == 2
    x = torch.tensor([[3, 7, 9, 11]])
    with torch.no_grad():
        assert torch.equal(auto(x).stream_logits, checked(x).stream_logits)
    assert (straight_run / "config.yaml").exists() and list(straight_run.rglob("events.out.tfevents*"))


@pytest.mark.parametrize("dropout", [-0.1, 1.0])
def test_feature_dropout_out_of_range_is_refused(dropout):
    with pytest.raises(MirrorTrainError, match="feature_dropout"):
        DrafterTrainConfig(feature_dropout=dropout).validate()


def test_load_draft_refuses_another_target(straight_run):
    deeper = Target(tiny_model("llama", layers=6, vocab=128), tiny_tokenizer(), "deeper")
    with pytest.raises(MirrorTrainError, match="num_layers: 4 vs 6"):
        load_draft(straight_run / "export", deeper)
    other_words = tiny_tokenizer(vocab_size=100)
    with pytest.raises(MirrorTrainError, match="tokenizer_fingerprint"):
        load_draft(straight_run / "export", Target(tiny_model("llama", vocab=100), other_words, "other"))


def test_load_draft_refuses_another_kind_of_artifact(tmp_path, tiny_target):
    from mirror_train.models.proxy_head import ProxyHead, ProxyHeadConfig, save_proxy_head

    head = ProxyHead(ProxyHeadConfig(exit_layer=2, mlp_hidden=8), tiny_target.hidden_size).bind(tiny_target)
    with pytest.raises(MirrorTrainError, match="is a proxy_head, expected a draft"):
        load_draft(save_proxy_head(head, tmp_path / "head", tiny_target), tiny_target)


def test_resume_from_a_checkpoint_equals_the_straight_run(straight_run, drafter_config, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(straight_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    shutil.rmtree(resumed / "export")
    proc = run_recipe(drafter_config, *CONSTANT_LR, f"output_dir={resumed}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = load_file(straight_run / "export" / "model.safetensors"), load_file(resumed / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_recipe_with_lora_reduced_vocabulary_and_features(drafter_config, straight_run, tmp_path, tiny_target):
    out = tmp_path / "modes"
    modes = ["model.lora_rank=4", "model.draft_vocab_size=40", "model.feature_conditioning=target_hidden"]
    modes.append("train.mixed_precision=bf16")  # autocast training; the exported weights stay float32
    proc = run_recipe(drafter_config, *modes, "train.max_steps=2", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    draft = load_draft(out / "export", tiny_target)  # LoRA merged: a plain draft
    assert len(draft.d2t) == 40 and draft.fusion is not None and draft.config.target_exit_layer == 2
    assert not any("lora" in name for name in draft.state_dict())
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    card = (out / "export" / "README.md").read_text()
    assert "top1_without_states" in card  # a conditioned draft is also scored without the target's states


# --- set-up modes, in process ----------------------------------------------------------------------------------------
def train_steps(model, train, steps: int = 2) -> list[float]:
    from mirror_train.data.samplers import WindowSampler

    sampler = WindowSampler(train, batch_size=32, seed=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        loss, _ = drafter_loss(model, sampler.batch(step), DrafterTrainConfig())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_lora_trains_only_adapters_and_the_stream_embeddings(caches, tiny_target, tmp_path):
    train, heldout = caches
    model = build_draft(DrafterModelConfig(num_layers=2, lora_rank=4), tiny_target, train)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "stream_embeddings" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(math.isfinite(x) for x in train_steps(model, train))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trainable)
    draft = load_draft(save_draft(model, tmp_path / "lora", tiny_target), tiny_target)  # adapters merged
    assert not any("lora" in name for name in draft.state_dict())


def test_reduced_vocabulary_holds_the_frequent_and_special_ids(caches, tiny_target):
    train, heldout = caches
    draft = build_draft(DrafterModelConfig(num_layers=2, draft_vocab_size=30), tiny_target, train)
    assert draft.lm_head.weight.shape[0] == 30 and set(tiny_target.tokenizer.all_special_ids) <= set(draft.d2t.tolist())
    assert torch.equal(draft.lm_head.weight, tiny_target.lm_head.weight[draft.d2t])
    assert all(math.isfinite(x) for x in train_steps(draft, train))
    metrics = evaluate_drafter(draft, heldout)
    assert metrics["positions"] > 0 and all(0 <= metrics[k] <= 1 for k in ("top1", "stream_1", "stream_2"))


def test_window_sampler_repeats_the_windows_that_hold_answers(caches):
    from mirror_train.data.samplers import WindowSampler

    train, _ = caches
    once, thrice = (WindowSampler(train, 32, seed=0, window=8, answer_repeat=r) for r in (1, 3))
    holds_answers = [bool(np.asarray(train.is_answer)[a:b].any()) for a, b in once.spans]
    assert any(holds_answers) and not all(holds_answers)
    assert len(thrice.spans) == len(once.spans) + 2 * sum(holds_answers)


def test_feature_conditioned_draft_reads_the_cached_layer(caches, tiny_target):
    train, heldout = caches
    draft = build_draft(DrafterModelConfig(num_layers=2, feature_conditioning="target_hidden"), tiny_target, train)
    assert draft.config.target_exit_layer == train.exit_layer == 2 and draft.config.target_hidden_size == 32
    assert torch.equal(draft.fusion.proj.weight, torch.eye(32, 64))  # starts as the token-only draft
    assert all(math.isfinite(x) for x in train_steps(draft, train, steps=1))
    assert draft.fusion.proj.weight[:, 32:].abs().sum() > 0  # it learned to read the target's state
    assert 0 <= evaluate_drafter(draft, heldout)["top1"] <= 1


def test_init_from_another_model_needs_the_targets_tokenizer(caches, tiny_target, tiny_model_dir, tmp_path):
    train, _ = caches
    draft = build_draft(DrafterModelConfig(num_layers=2, init=str(tiny_model_dir)), tiny_target, train)
    assert draft.config.target == tiny_target.signature().to_dict()
    tiny_model("llama", vocab=100).save_pretrained(tmp_path / "other")
    tiny_tokenizer(vocab_size=100).save_pretrained(tmp_path / "other")
    with pytest.raises(MirrorTrainError, match="tokenizer differs from the target's"):
        build_draft(DrafterModelConfig(num_layers=2, init=str(tmp_path / "other")), tiny_target, train)


def test_a_tied_targets_draft_exports_and_loads(caches, tmp_path):
    """SmolLM2 ties its embeddings and LM head: the draft keeps them tied through export and load."""
    train, _ = caches
    model = tiny_model("llama", vocab=128)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    tied = Target(model, tiny_tokenizer(), "tied")
    draft = build_draft(DrafterModelConfig(num_layers=2), tied, train)
    assert draft.lm_head.weight is draft.embed_tokens.weight and not draft.lm_head.weight.requires_grad
    loaded = load_draft(save_draft(draft, tmp_path / "tied", tied), tied)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    x = torch.tensor([[3, 7, 9, 11]])
    with torch.no_grad():
        assert torch.equal(draft(x).stream_logits, loaded(x).stream_logits)


def test_scratch_init_is_random_and_trains_its_embeddings(caches, tiny_target):
    with pytest.raises(MirrorTrainError, match="freeze_embeddings_and_head=false"):
        DrafterModelConfig(init="scratch").validate()
    train, _ = caches
    draft = build_draft(
        DrafterModelConfig(num_layers=2, init="scratch", freeze_embeddings_and_head=False), tiny_target, train
    )
    assert not torch.equal(draft.embed_tokens.weight, tiny_target.decoder.embed_tokens.weight)
    assert draft.embed_tokens.weight.requires_grad


# --- the shipped config ----------------------------------------------------------------------------------------------
def test_the_shipped_configs_share_one_data_set():
    """The proxy head and the draft read one data set (one self-distillation, one cache of ℓe and final states):
    the quickstart makes it once. A different setting in either config would make the other recipe build its own
    data, or refuse the shared directory."""
    path = ROOT / "recipes" / "configs" / "drafter_smollm2.yaml"
    assert path.read_text().startswith("# accelerate launch recipes/drafter.py --config " + str(path.relative_to(ROOT)))
    cfg = load_config(DrafterRunConfig, path)
    proxy = load_config(ProxyRunConfig, ROOT / "recipes" / "configs" / "proxy_head_smollm2.yaml")
    sampling = ("train_on", "answer_repeat")  # how a run samples the data, not the data
    draft_data = {k: v for k, v in asdict(cfg.data).items() if k not in sampling}
    assert draft_data == {k: v for k, v in asdict(proxy.data).items() if k not in sampling}
    exit_layer = cfg.model.exit_layer or 30 // 2  # the testbed has 30 layers
    assert exit_layer == proxy.head.exit_layer
    needed = {exit_layer, 30} if "final" in cfg.model.feature_slots else {exit_layer}
    assert needed | set(cfg.data.extra_layers) == {proxy.head.exit_layer, *proxy.data.extra_layers}
