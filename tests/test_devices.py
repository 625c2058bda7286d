"""Every module, buffer and artifact lands on the device it is asked for (the GPU path, issue #16), shown on a
CPU-only machine with PyTorch's `meta` device: a second device that every machine has, so a tensor left behind on
the CPU (a borrowed module invisible to `.to()`, a buffer made with a default device) shows as "cpu"."""

from __future__ import annotations

import pytest
import torch

from mirror_train.errors import MirrorTrainError
from mirror_train.models.draft_artifact import load_draft, save_draft
from mirror_train.models.drafter import MirrorDrafterForCausalLM
from mirror_train.models.proxy_head import KINDS, HeadEnd, ProxyHead, ProxyHeadConfig, load_proxy_head, save_proxy_head
from mirror_train.random_models import tiny_model, tiny_tokenizer
from mirror_train.target import Target

META = torch.device("meta")


def devices(*modules) -> set[str]:
    return {str(t.device) for m in modules for t in [*m.parameters(), *m.buffers()]}


def tiny_target(device="cpu") -> Target:
    return Target(tiny_model("llama", vocab=128).to(device), tiny_tokenizer(), "tiny")


@pytest.mark.parametrize("kind", KINDS)
def test_a_loaded_proxy_head_and_what_it_borrows_are_on_its_targets_device(kind, tmp_path):
    cfg = ProxyHeadConfig(kind=kind, exit_layer=2, mlp_hidden=16, lora_rank=4)
    cpu = tiny_target()
    save_proxy_head(ProxyHead(cfg, cpu.hidden_size).bind(cpu), tmp_path / "head", cpu)
    head = load_proxy_head(tmp_path / "head", tiny_target(META))
    assert devices(head, head._norm, head.lm_head) == {"meta"}
    if kind not in ("attention", "lora_head"):  # the per-position kinds restrict, and run on the draft's side
        head.restrict(torch.arange(64))
        assert devices(head.lm_head) == {"meta"}
        end, state = HeadEnd.of(load_proxy_head(tmp_path / "head", cpu))
        moved = end.to(META).head(cfg, state, None)
        assert devices(moved, moved._norm, moved.lm_head) == {"meta"}


def test_a_loaded_draft_lands_on_the_device_asked_for(tmp_path):
    cpu = tiny_target()
    draft = MirrorDrafterForCausalLM.from_target(cpu, 2, 2, 1, draft_vocab=list(range(64)))
    path = save_draft(draft, tmp_path / "draft", cpu)
    assert devices(load_draft(path, cpu, device=META)) == {"meta"}  # the reduced vocabulary's d2t buffer too
    assert devices(load_draft(path, cpu)) == {"cpu"}  # default: the target's device


@pytest.mark.parametrize("spec", ["meta", "cuda:7" if torch.cuda.is_available() else "cuda", "tpu0"])
def test_a_device_that_is_not_there_is_one_clear_line(spec):
    from mirror_train.engine import EngineConfig

    with pytest.raises(MirrorTrainError) as err:
        EngineConfig(draft_device=spec).validate()
    assert "\n" not in str(err.value) and spec in str(err.value)


@pytest.mark.parametrize(
    "text,cpus",
    [("max 100000", None), ("200000 100000", 2), ("150000 100000", 2), ("-1 100000", None), ("", None), ("x y", None)],
)
def test_a_containers_cpu_quota_is_read_as_whole_cpus_rounded_up(text, cpus):
    """cgroup v2's `cpu.max` (or v1's quota and period joined): a container limited to 1.5 CPUs keeps 2 threads busy;
    no quota, or an unreadable one, limits nothing (the prefill's threads, EngineConfig.prefill_layout)."""
    from mirror_train.devices import parse_cpu_quota

    assert parse_cpu_quota(text) == cpus
