"""Metric functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from mirror_train.errors import MirrorTrainError
from mirror_train.metrics import (
    exit_report,
    hit,
    kl_divergence,
    mean_accepted_tokens,
    merge_reports,
    omega,
    oracle_omega,
    top1_agreement,
)

# p_final over 4 tokens = [0.5, 0.3, 0.15, 0.05]; the proxy ranks them 2 > 1 > 3 > 0.
P_FINAL = torch.tensor([0.5, 0.3, 0.15, 0.05])
FINAL = P_FINAL.log()
PROXY = torch.tensor([0.0, 2.0, 3.0, 1.0])


def test_omega_by_hand():
    assert omega(PROXY, FINAL, 1).item() == pytest.approx(0.15)  # top-1 of proxy = token 2
    assert omega(PROXY, FINAL, 2).item() == pytest.approx(0.45)  # {2, 1}
    assert omega(PROXY, FINAL, 3).item() == pytest.approx(0.50)  # {2, 1, 3}
    assert omega(PROXY, FINAL, 4).item() == pytest.approx(1.0)


def test_hit_by_hand():
    # the final argmax (token 0) is the proxy's last choice
    assert [hit(PROXY, FINAL, k).item() for k in (1, 2, 3, 4)] == [0.0, 0.0, 0.0, 1.0]
    assert top1_agreement(PROXY, FINAL).item() == 0.0
    assert top1_agreement(FINAL, FINAL).item() == 1.0


def test_oracle_by_hand():
    assert oracle_omega(FINAL, 1).item() == pytest.approx(0.5)
    assert oracle_omega(FINAL, 2).item() == pytest.approx(0.8)
    assert omega(FINAL, FINAL, 2).item() == pytest.approx(oracle_omega(FINAL, 2).item())


def test_kl_by_hand():
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    expected = sum(p * math.log(p / 0.25) for p in P_FINAL.tolist())
    assert kl_divergence(FINAL, q.log()).item() == pytest.approx(expected, rel=1e-5)
    assert kl_divergence(FINAL, FINAL).item() == pytest.approx(0.0, abs=1e-6)
    # temperature 2 softens both: p ∝ sqrt(p_final), q stays uniform
    soft = P_FINAL.sqrt() / P_FINAL.sqrt().sum()
    expected_t2 = sum(p * math.log(p / 0.25) for p in soft.tolist())
    assert kl_divergence(FINAL, q.log(), temperature=2.0).item() == pytest.approx(expected_t2, rel=1e-5)


def test_batched_shapes_and_report():
    proxy = torch.stack([PROXY, FINAL])  # (2, V): one bad proxy, one perfect
    final = torch.stack([FINAL, FINAL])
    assert omega(proxy, final, 1).tolist() == pytest.approx([0.15, 0.5])
    report = exit_report(proxy, final, kappas=(1, 4))
    assert report["positions"] == 2
    assert report["hit_1"] == pytest.approx(0.5)
    assert report["omega_4"] == pytest.approx(1.0)
    assert report["oracle_omega_1"] == pytest.approx(0.5)


def test_merge_weights_by_positions():
    a = {"positions": 1, "hit_1": 1.0}
    b = {"positions": 3, "hit_1": 0.0}
    assert merge_reports([a, b]) == {"positions": 4, "hit_1": 0.25}
    with pytest.raises(MirrorTrainError):
        merge_reports([{"positions": 0, "hit_1": 0.0}])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_kappa_must_be_positive_int(bad):
    with pytest.raises(MirrorTrainError, match="κ"):
        omega(PROXY, FINAL, bad)


def test_mean_accepted_tokens():
    assert mean_accepted_tokens([1, 1, 1]) == 1.0  # plain decoding scores 1.0
    assert mean_accepted_tokens([3, 1, 2]) == 2.0
    with pytest.raises(MirrorTrainError):
        mean_accepted_tokens([])
