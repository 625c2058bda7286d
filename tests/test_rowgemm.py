"""The row-exact small-M kernel (rowgemm.py) and the fast path that serves it (fastpath.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mirror_train import fastpath, rowgemm
from mirror_train.errors import MirrorTrainError

needs_kernel = pytest.mark.skipif(not rowgemm.available(), reason="no C compiler here to build the kernel")


@needs_kernel
@pytest.mark.parametrize(
    "n,k,bias", [(576, 576, False), (49, 1536, False), (7, 13, True), (5, 3, True), (1, 64, False)]
)
def test_the_kernel_computes_the_linear_and_every_row_is_exact_whatever_the_rows(n, k, bias):
    """Each output equals float64's within float32 rounding, and row i of a k-row call equals the one-row call on
    row i bit for bit, for every k (the property that makes a verification window equal its one-token steps)."""
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(17, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    full = rowgemm.linear(x, w, b)
    exact = nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(full.double(), exact, atol=1e-4 * k**0.5, rtol=1e-5)
    for r in range(len(x)):
        assert torch.equal(rowgemm.linear(x[r : r + 1], w, b), full[r : r + 1])
    for rows in range(1, len(x) + 1):
        assert torch.equal(rowgemm.linear(x[:rows], w, b), full[:rows])
    assert rowgemm.linear(x[None, :3], w, b).shape == (1, 3, n)  # leading dims kept


@needs_kernel
def test_a_rowgemm_model_is_the_same_function_row_exact_and_a_copy_is_plain():
    from mirror_train.attention import gemm_row_invariant
    from mirror_train.random_models import tiny_model

    model = tiny_model()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids).logits
        assert fastpath.install(model, "auto") == "rowgemm"
        fast = model(ids).logits
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(fast.argmax(-1), plain.argmax(-1))
    assert gemm_row_invariant(model)  # so a float32 target's windows are exact (Target.exact_windows)
    assert fastpath.installed(model) and not fastpath.installed(copy.deepcopy(model))
    assert fastpath.install(model, "onednn") == "onednn" and fastpath.install(model, "rowgemm") == "rowgemm"
    with torch.enable_grad():  # training takes torch's path, gradients and all
        x = torch.randn(2, model.config.hidden_size, requires_grad=True)
        linear = model.lm_head
        linear.weight.requires_grad_(True)
        linear(x).sum().backward()
        assert x.grad is not None


def test_the_fast_path_is_chosen_by_device_and_dtype():
    expected = "rowgemm" if rowgemm.available() else "onednn" if torch.backends.mkldnn.is_available() else "none"
    assert fastpath.resolve("auto", "cpu", torch.float32) == expected
    assert fastpath.resolve("auto", "cpu", torch.bfloat16) in ("onednn", "none")  # the kernel is float32 only
    with pytest.raises(MirrorTrainError, match="float32 model on a CPU"):
        fastpath.resolve("rowgemm", "cpu", torch.bfloat16)
    with pytest.raises(MirrorTrainError, match="fast_path must be one of"):
        fastpath.resolve("turbo", "cpu")


def test_without_a_compiler_the_kernel_is_unavailable_and_auto_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    rowgemm._library.cache_clear()
    try:
        assert not rowgemm.available()
        assert fastpath.resolve("auto", "cpu", torch.float32) in ("onednn", "none")
        with pytest.raises(MirrorTrainError, match="C compiler"):
            fastpath.resolve("rowgemm", "cpu", torch.float32)
    finally:
        rowgemm._library.cache_clear()
