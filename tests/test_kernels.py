"""The row-exact kernels (kernels.py) and the fast path that serves them (fastpath.py)."""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import platform
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from mirror_train import fastpath, fused_layer, kernels
from mirror_train.errors import MirrorTrainError

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler here to build the kernel")


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or not shutil.which(os.environ.get("CC", "cc")),
    reason="the kernels build on x86-64 Linux with a C compiler only",
)
def test_the_kernels_build_wherever_there_is_a_compiler():
    """A source that no longer compiles would otherwise pass as every kernel test skipping."""
    assert kernels.available()


def test_the_c_source_is_every_part_kernels_c_includes_and_the_build_key_follows_each(monkeypatch, tmp_path):
    """kernels.c includes its parts; each must be in csrc/ (shipped as package data: pyproject's globs) and in what
    the build key hashes, or an edited part would load a stale library."""
    parts = re.findall(r'#include "([^"]+)"', (kernels.SOURCE_DIR / "kernels.c").read_text())
    assert parts and all((kernels.SOURCE_DIR / name).is_file() for name in parts)
    shipped = re.search(r"mirror_train = \[([^\]]*)\]", (Path(__file__).parents[1] / "pyproject.toml").read_text())
    globs = re.findall(r'"([^"]+)"', shipped.group(1))
    assert all(any(fnmatch.fnmatch(f"csrc/{name}", g) for g in globs) for name in ["kernels.c", *parts])
    copy_dir = tmp_path / "csrc"
    shutil.copytree(kernels.SOURCE_DIR, copy_dir)
    monkeypatch.setattr(kernels, "SOURCE_DIR", copy_dir)
    key = kernels._build_key()
    for name in parts:
        before = (copy_dir / name).read_text()
        (copy_dir / name).write_text(before + "\n/* edited */\n")
        assert kernels._build_key() != key, name
        (copy_dir / name).write_text(before)
    assert kernels._build_key() == key


@needs_kernel
@pytest.mark.parametrize(
    "n,k,bias", [(576, 576, False), (49, 1536, False), (7, 13, True), (5, 3, True), (1, 64, False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", kernels.LAYOUTS)
def test_the_kernel_computes_the_linear_and_every_row_is_exact_whatever_the_rows(n, k, bias, dtype, layout):
    """Each output equals float64's within float32 rounding, and row i of a k-row call equals the one-row call on
    row i bit for bit, for every k (the property that makes a verification window equal its one-token steps), on
    float32 and on bfloat16 weights (whose 1-2-row calls take other blocks than float32's), read as rows or as
    panels (whose last panel is padded where n is no multiple of the lanes, and whose tiles change with the rows)."""
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(17, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    p = kernels.to_panels(w) if layout == "panels" else None
    full = kernels.linear(x, w, b, p)
    exact = nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(full.double(), exact, atol=1e-4 * k**0.5, rtol=1e-5)
    for r in range(len(x)):
        assert torch.equal(kernels.linear(x[r : r + 1], w, b, p), full[r : r + 1])
    for rows in range(1, len(x) + 1):
        assert torch.equal(kernels.linear(x[:rows], w, b, p), full[:rows])
    assert kernels.linear(x[None, :3], w, b, p).shape == (1, 3, n)  # leading dims kept


@needs_kernel
@pytest.mark.parametrize("n,k", [(576, 576), (49, 1536), (7, 13), (5, 3), (3, 1)])
def test_bfloat16_panels_pair_their_ks_and_compute_the_widened_float32_panels_bit_for_bit(n, k):
    """bf16 panels hold (w[2j], w[2j+1]) in one 32-bit word (an odd K's last one padded); the kernel widens both
    exactly and keeps each output's chain over k in order, so every row count gives the float32 panels' bits."""
    g = torch.Generator().manual_seed(n * k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(17, k, generator=g)
    p = kernels.to_panels(w)
    lanes = kernels.lanes()
    assert p.shape == (-(-n // lanes), (k + 1) // 2, lanes, 2) and p.is_contiguous()
    assert torch.equal(p[0, 0, : min(n, lanes), 0], w[:lanes, 0]) and (
        k < 2 or torch.equal(p[0, 0, : min(n, lanes), 1], w[:lanes, 1])
    )
    wide = kernels.to_panels(w.float())
    for rows in range(1, len(x) + 1):
        assert torch.equal(kernels.linear(x[:rows], w, None, p), kernels.linear(x[:rows], w.float(), None, wide))


@needs_kernel
def test_panels_interleave_lanes_of_weight_rows_and_the_layout_is_measured_once_per_machine(monkeypatch, tmp_path):
    w = torch.arange(2 * kernels.lanes() + 3, dtype=torch.float32)[:, None].repeat(1, 5)  # row i holds i
    p = kernels.to_panels(w)
    assert p.shape == (3, 5, kernels.lanes()) and p.is_contiguous()
    assert torch.equal(p[1, 2], torch.arange(kernels.lanes(), 2 * kernels.lanes(), dtype=torch.float32))
    assert p[2, 0, 3:].eq(0).all()  # the padding
    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))  # the loaded library stays; the choice is kept here
    monkeypatch.setenv("MIRROR_TRAIN_KERNEL_LAYOUT", "auto")
    kernels.layout.cache_clear()
    try:
        times = kernels.layout_times()
        assert set(times) == set(kernels.MEASURED) and all(t > 0 for t in times.values())
        assert kernels.layout() == min(kernels.LAYOUTS, key=times.get)
        (kept,) = tmp_path.glob("layout_*.json")
        other = '{"rows": 1.0, "panels": 2.0, "rows_bf16": 0.9, "panels_bf16": 0.5, "rows_f16": 1.5}'
        for text, chosen in ((other, "rows"), ("{not json", min(kernels.LAYOUTS, key=times.get))):
            kept.write_text(text)  # another process's measurement, then a corrupt file (measured again)
            kernels.layout.cache_clear()
            assert kernels.layout() == chosen
        kept.write_text(other)
        kernels.layout.cache_clear()
        kernels.narrow.cache_clear()
        assert kernels.layout(torch.bfloat16) == "panels" and kernels.narrow()  # bfloat16 copies: measured faster
        assert kernels.layout(torch.float16) == "rows" and not kernels.narrow(torch.float16)  # float16 ones: slower
        kernels.layout.cache_clear()
        monkeypatch.setenv("MIRROR_TRAIN_KERNEL_LAYOUT", "tiles")
        with pytest.raises(ValueError, match="auto, rows or panels"):
            kernels.layout()
    finally:
        kernels.layout.cache_clear()
        kernels.narrow.cache_clear()


@needs_kernel
def test_how_panels_prefetch_is_measured_per_machine_and_never_changes_the_bits(monkeypatch, tmp_path):
    """Prefetching ahead or not (csrc/linear_panels.c's two tiles of each height), and at any distance, gives every
    output the same bits at every row count, float32 and bfloat16 panels; the masks and distances are measured once
    per machine (kept beside the library: another process's file is read, not measured again; an invalid one is
    measured again), or the mask set from $MIRROR_TRAIN_PANEL_PREFETCH, whose bad value is a clear error."""
    g = torch.Generator().manual_seed(4)
    before = {t: kernels.panel_streaming(t) for t in kernels.PREFETCH_TYPES}
    try:
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            w = torch.randn(100, 70, generator=g).to(dtype)
            panels, x = kernels.to_panels(w), torch.randn(8, 70, generator=g)
            outs = []
            for mask, distance, single in ((0, 65536, 0), (0x1FE, 65536, 1), (0x1FE, 262144, 0), (0x1FE, 64, 1)):
                assert kernels.panel_prefetch(name, mask) == mask
                assert kernels.panel_prefetch_distance(name, distance) == distance
                assert kernels.panel_one_row(name, bool(single)) == bool(single)
                outs.append([kernels.linear(x[:r], w, panels=panels) for r in range(1, 9)])
            assert all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out, strict=True))
            assert kernels.panel_prefetch_distance(name, 100) == 64  # whole cache lines
            # the per-machine measurements' C loop: each linear's output is the one a call of its own gives
            wide = torch.randn(8, 70, generator=g)
            for read in (panels, None):
                first = (w[:33], None if read is None else kernels.to_panels(w[:33]))
                stack = kernels.LinearList([first, (w, read)])
                assert torch.equal(stack(wide), kernels.linear(wide, w, panels=read))
        current = {t: kernels.panel_streaming(t) for t in kernels.PREFETCH_TYPES}
        measured = kernels.prefetch_times(rounds=1, layers=2)
        assert set(measured) == set(kernels.PREFETCH_TYPES)
        masks = [v["mask"] for v in measured.values()]
        assert all(0 <= m < 512 and not m & 1 and m & kernels.PREFETCH_ALWAYS for m in masks)
        assert all(v["distance"] in kernels.PREFETCH_DISTANCES and v["single"] in (0, 1) for v in measured.values())
        assert {t: kernels.panel_streaming(t) for t in kernels.PREFETCH_TYPES} == current  # restored after
        monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))  # the loaded library stays; the choice kept here
        monkeypatch.setenv("MIRROR_TRAIN_PANEL_PREFETCH", "auto")
        chosen = {
            "float32": {"mask": 0x10, "distance": 4096, "single": 0},
            "bfloat16": {"mask": 0x6, "distance": 131072, "single": 1},
        }
        monkeypatch.setattr(kernels, "prefetch_times", lambda: chosen)
        kernels.tune_prefetch.cache_clear()
        assert kernels.tune_prefetch() == chosen
        assert kernels.panel_streaming("float32") == {"mask": 0x10, "distance": 4096, "single": 0}
        (kept,) = tmp_path.glob("prefetch_*.json")
        other = {t: {"mask": 4, "distance": 8192, "single": 1} for t in kernels.PREFETCH_TYPES}
        kept.write_text(json.dumps(other))  # another process's measurement
        kernels.tune_prefetch.cache_clear()
        assert kernels.tune_prefetch() == other
        kept.write_text('{"float32": {"mask": 4, "distance": 8192}, "bfloat16": {"mask": 8, "distance": 64}}')
        kernels.tune_prefetch.cache_clear()
        assert kernels.tune_prefetch() == chosen  # an older revision's file, without "single": measured again
        monkeypatch.setenv("MIRROR_TRAIN_PANEL_PREFETCH", "0x1fc")
        kernels.tune_prefetch.cache_clear()
        assert {t: v["mask"] for t, v in kernels.tune_prefetch().items()} == {"float32": 0x1FC, "bfloat16": 0x1FC}
        monkeypatch.setenv("MIRROR_TRAIN_PANEL_PREFETCH", "sometimes")
        kernels.tune_prefetch.cache_clear()
        with pytest.raises(ValueError, match="auto, default or a mask"):
            kernels.tune_prefetch()
    finally:
        kernels.tune_prefetch.cache_clear()
        for t, prefetching in before.items():
            kernels._set_streaming(t, prefetching)


@needs_kernel
@pytest.mark.parametrize("layout", kernels.LAYOUTS)
def test_an_exact_model_serves_the_layout_chosen_and_panels_follow_their_weight(layout, monkeypatch):
    """Served in panels, every linear and every fused layer reads a panel copy, made again when its weight is
    changed in place (a load_state_dict): the model stays the function of its current weights."""
    from mirror_train.random_models import tiny_model

    monkeypatch.setenv("MIRROR_TRAIN_KERNEL_LAYOUT", layout)
    kernels.layout.cache_clear()
    fused, layer = [], kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a, **k: fused.append(a[1].panels) or layer(*a, **k))
    try:
        model, fresh = tiny_model(), tiny_model(seed=1)
        ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            assert fastpath.install(model, "exact") == "exact"
            served = [kernels.panels_of(m) is not None for m in model.modules() if isinstance(m, nn.Linear)]
            assert all(served) if layout == "panels" else not any(served)
            cache = transformers.DynamicCache(config=model.config)
            model(ids[:, :6], cache=cache)
            model(ids[:, 6:7], cache=cache)  # a one-token step: the fused C layers
            model.load_state_dict(fresh.state_dict())  # in place: the same storage, new values
            fastpath.install(fresh, "exact")
            outs = []
            for m in (model, fresh):
                cache = transformers.DynamicCache(config=m.config)
                m(ids[:, :6], cache=cache)
                outs.append(m(ids[:, 6:9], cache=cache).logits)
        assert torch.equal(outs[0], outs[1])
        assert fused and set(fused) == {layout == "panels"}  # the C layers ran, on the layout served
    finally:
        kernels.layout.cache_clear()


def test_a_float32_weight_is_bf16_exact_when_every_value_is_a_bfloat16_one():
    w = torch.randn(300, 7, generator=torch.Generator().manual_seed(0))
    assert not kernels.bf16_exact(w)
    assert kernels.bf16_exact(w.bfloat16().float()) and kernels.bf16_exact(torch.zeros(3, 3))
    assert not kernels.bf16_exact(w.bfloat16()) and not kernels.bf16_exact(w.bfloat16().float().T)  # only f32, rows
    nudged = w.bfloat16().float()
    nudged[299, 6] = torch.nextafter(nudged[299, 6], torch.tensor(9.0))  # one value past bfloat16's
    assert not kernels.bf16_exact(nudged)


def _half_valued(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A bfloat16 (or float16) checkpoint loaded in float32: every parameter's values `dtype` ones."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


@needs_kernel
@pytest.mark.parametrize("layout,half", [("rows", torch.bfloat16), ("panels", torch.bfloat16), ("rows", torch.float16)])
def test_half_valued_float32_weights_are_served_from_half_copies_with_the_same_bits(layout, half, monkeypatch):
    """A float32 model whose weights hold bfloat16 (or float16) values (a half-precision checkpoint served in
    float32) reads copies in that dtype in the kernels (half the bytes; float16 in rows only), and computes the same
    bits as served from its float32 weights in the same layout: windows, one-token steps and the fused C layers. A
    weight changed in place to values the dtype does not hold is read in float32 again (in rows its layer reads
    every weight itself, the same bits; in panels it runs module by module), and the model stays the function of
    its current weights; a model not all half-valued is not narrowed at all."""
    from mirror_train.random_models import tiny_model

    monkeypatch.setenv("MIRROR_TRAIN_KERNEL_LAYOUT", layout)
    kernels.layout.cache_clear()
    fused, layer = [], kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a, **k: fused.append(a[1].wtype != 0) or layer(*a, **k))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))

    def run(model):
        cache = transformers.DynamicCache(config=model.config)
        with torch.inference_mode():
            model(ids[:, :6], cache=cache)
            return torch.cat([model(ids[:, 6:7], cache=cache).logits, model(ids[:, 7:11], cache=cache).logits], 1)

    def read_dtypes(model):
        return {kernels.served(m)[1 if kernels.served(m)[1] is not None else 0].dtype: 1 for m in linears(model)}

    def linears(model):
        return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]

    try:
        models = {}
        for narrow in ("on", "off"):
            monkeypatch.setenv("MIRROR_TRAIN_KERNEL_NARROW", narrow)
            kernels.narrow.cache_clear()
            models[narrow] = _half_valued(tiny_model(), half)
            fastpath.install(models[narrow], "exact")
        assert set(read_dtypes(models["on"])) == {half} and set(read_dtypes(models["off"])) == {torch.float32}
        head = kernels.served(models["on"].lm_head)  # half-valued too: read from its copy (greedy: its screen)
        assert (head[1] if layout == "panels" else head[0]).dtype == half
        assert all(m.weight.dtype == torch.float32 for m in linears(models["on"]))  # the weights stay
        fused.clear()
        assert torch.equal(run(models["on"]), run(models["off"]))
        assert fused and set(fused) == {True, False}  # the C layers ran, on bfloat16 copies and on float32 weights
        gate = models["on"].model.layers[0].mlp.gate_proj
        with torch.no_grad():
            gate.weight.add_(1e-3 * torch.randn_like(gate.weight))  # in place: no longer half-precision values
        assert kernels.served(gate)[1 if layout == "panels" else 0].dtype == torch.float32
        plain = tiny_model()
        plain.load_state_dict(models["on"].state_dict())
        fastpath.install(plain, "exact")
        if layout == "rows":
            assert torch.equal(run(models["on"]), run(plain))
        else:  # its layer ran module by module (the C layer reads its panels in one dtype): the last bits may move
            torch.testing.assert_close(run(models["on"]), run(plain), atol=1e-5, rtol=1e-5)
        assert set(read_dtypes(plain)) == {torch.float32}  # one weight not half-valued: none narrowed
    finally:
        kernels.layout.cache_clear()
        kernels.narrow.cache_clear()


def _attention_reference(q, k, v, scale):
    """float64 causal attention of a window at the end of the cache, grouped-query heads, (1, M, H, D)."""
    heads, rows, length = q.shape[1], q.shape[2], k.shape[2]
    k = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    v = v.double().repeat_interleave(heads // v.shape[1], dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    visible = torch.arange(length)[None, :] <= torch.arange(length - rows, length)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _check_attention():
    g = torch.Generator().manual_seed(0)
    # head sizes of 2, 4 and 8 vectors (the grouped path: rows in sixes, two rows a block of 8 keys, an odd row a block
    # of 16) and others (the plain one)
    cases = ((9, 3, 64, 40), (4, 4, 20, 9), (2, 1, 7, 3), (4, 2, 128, 37), (2, 2, 32, 70))
    for heads, kv_heads, dim, length in cases:
        q = torch.randn(1, heads, 9, dim, generator=g)
        k, v = torch.randn(2, 1, kv_heads, length + 9, dim, generator=g)
        full = kernels.attention(q, k, v, dim**-0.5)
        torch.testing.assert_close(full.double(), _attention_reference(q, k, v, dim**-0.5), atol=2e-6, rtol=1e-5)
        for rows in (1, 2, 5, 9):  # the last `rows` queries of the window, over the cache up to them
            for i in range(rows):
                seen = length + 9 - rows + i + 1
                one = kernels.attention(
                    q[:, :, 9 - rows + i : 10 - rows + i], k[:, :, :seen], v[:, :, :seen], dim**-0.5
                )
                assert torch.equal(one[0, 0], full[0, 9 - rows + i]), (heads, rows, i)


def _check_linear():
    g = torch.Generator().manual_seed(1)
    for n, k in ((37, 576), (5, 13)):
        for dtype in kernels.WEIGHT_DTYPES:  # bf16 weights are widened exactly; sums in float32, one rounding
            w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(9, k, generator=g).to(dtype)
            full = kernels.linear(x, w)
            assert full.dtype == dtype
            exact = (x.double() @ w.double().T).to(dtype)
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(full.double(), exact.double(), atol=tol * k**0.5, rtol=tol)
            assert all(torch.equal(kernels.linear(x[r : r + 1], w), full[r : r + 1]) for r in range(9))
            p = kernels.to_panels(w)
            paneled = kernels.linear(x, w, None, p)
            torch.testing.assert_close(paneled.double(), exact.double(), atol=tol * k**0.5, rtol=tol)
            assert all(torch.equal(kernels.linear(x[r : r + 1], w, None, p), paneled[r : r + 1]) for r in range(9))
    for half in kernels.NARROW_DTYPES:  # copies of half-precision values: the float32 weights' bits, in rows
        w = torch.randn(37, 576, generator=g).to(half)
        w[0, :4] = torch.tensor([6e-8, -3e-7, 1e-5, 0.0]).to(half)  # float16's subnormals (bfloat16: normal ones)
        x = torch.randn(9, 576, generator=g)
        for rows in (1, 2, 5, 9):
            assert torch.equal(kernels.linear(x[:rows], w), kernels.linear(x[:rows], w.float()))


@needs_kernel
def test_bfloat16_weights_take_the_same_kernel_row_exact():
    _check_linear()


@needs_kernel
def test_the_attention_kernel_is_causal_attention_and_a_window_row_is_its_one_token_step():
    """Row i of a window equals the one-row call over exactly the keys it sees, bit for bit (the property that
    makes a window's verification equal one-token decoding), and both are attention to float32 rounding."""
    _check_attention()
    _check_strided()


def _check_strided():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3, 2, 8, generator=g).transpose(1, 2)  # strided, as served
    k = torch.randn(1, 2, 16, 8, generator=g)[:, :, ::2]
    reference = _attention_reference(q, k, k, 0.3)  # float32 against float64: a float32 rounding apart
    torch.testing.assert_close(kernels.attention(q, k, k, 0.3).double(), reference, atol=2e-6, rtol=1e-5)


def test_the_avx2_and_scalar_builds_compute_the_same_functions_row_exact(other_kernel_build):
    _check_linear()
    _check_attention()
    _check_strided()


@needs_kernel
def test_an_exact_model_is_the_same_function_row_exact_and_a_copy_is_plain():
    from mirror_train.attention import gemm_row_invariant
    from mirror_train.random_models import tiny_model

    model = tiny_model()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids).logits
        assert fastpath.install(model, "auto") == "exact"
        fast = model(ids).logits
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(fast.argmax(-1), plain.argmax(-1))
    assert gemm_row_invariant(model)  # so a float32 target's windows are exact (Target.exact_windows)
    assert fastpath.installed(model) and not fastpath.installed(copy.deepcopy(model))
    assert fastpath.install(model, "onednn") == "onednn" and fastpath.install(model, "exact") == "exact"
    with torch.enable_grad():  # training takes torch's path, gradients and all
        x = torch.randn(2, model.config.hidden_size, requires_grad=True)
        linear = model.lm_head
        linear.weight.requires_grad_(True)
        linear(x).sum().backward()
        assert x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_served_fastest_routes_each_call_by_its_rows_and_computes_the_same_function(dtype):
    """`fastest` (a draft's `auto`): each linear shape takes, by rows, the path measured fastest among those this
    machine has; every route computes the plain model's function, training and copies take torch's path."""
    from mirror_train.random_models import tiny_model

    model = tiny_model().to(dtype)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(0))  # past the last route too
    with torch.inference_mode():
        plain = [model(ids[:, :n]).logits for n in (1, 3, 9, 70)]
        assert fastpath.install(model, fastpath.for_draft("auto")) == "fastest"
        fast = [model(ids[:, :n]).logits for n in (1, 3, 9, 70)]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip(fast, plain):  # a bf16 model is served with float32 activations (fastpath._widen_activations)
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    available = {"torch", "onednn" * torch.backends.mkldnn.is_available(), "exact" * kernels.available()}
    if dtype == torch.bfloat16 and kernels.available() and kernels.screen_dot():
        available.add("dot")  # bf16 weights on AVX512-BF16's dot product (inputs rounded to bf16: within tol)
    routes = fastpath.routes(model)
    assert routes and all(len(r) == len(fastpath.ROUTE_ROWS) and set(r) <= available for r in routes.values())
    assert not fastpath.installed(copy.deepcopy(model))
    with torch.enable_grad():
        linear = model.lm_head
        linear.weight.requires_grad_(True)
        x = torch.randn(2, model.config.hidden_size, dtype=dtype, requires_grad=True)
        linear(x).sum().backward()
        assert x.grad is not None
    if kernels.available():  # another kind installs over it
        assert fastpath.install(model, "exact") == "exact" and not fastpath.routes(model)


@pytest.mark.parametrize("rows,masked", [(1, False), (5, True), (16, True)])
def test_grouped_attention_is_sdpa_over_repeated_key_heads(rows, masked):
    """A fastest-served draft's attention for a few half-precision rows (attention.grouped_attention) computes
    what SDPA over transformers' repeated key heads does."""
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import repeat_kv

    from mirror_train.attention import grouped_attention

    g = torch.Generator().manual_seed(rows)
    q, k, v = (
        torch.randn(2, 6, rows, 8, generator=g),
        torch.randn(2, 2, 20, 8, generator=g),
        torch.randn(2, 2, 20, 8, generator=g),
    )
    mask = torch.randn(2, 1, rows, 20, generator=g).clamp(max=0) * 5 if masked else None
    reference = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.3), reference, atol=1e-5, rtol=1e-5)
    half = grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None if mask is None else mask.bfloat16(), 0.3)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), reference, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dot", [False, True])
def test_a_fastest_served_bf16_draft_proposes_what_the_plain_draft_does(dot, monkeypatch):
    """The draft's served path (routed linears, grouped attention in its plain and multi-stream layers) is the
    plain bf16 draft's function: close logits, main and streams, over a tree; as measured here, and with every
    linear and fused layer on the dot product (`dot`: bfloat16 inputs, where the CPU has AVX512-BF16)."""
    from mirror_train.attention import DRAFT_NAME
    from mirror_train.models.drafter import MirrorDrafterForCausalLM
    from mirror_train.random_models import tiny_model

    if dot:
        if not (kernels.available() and kernels.screen_dot()):
            pytest.skip("no AVX512-BF16 here")
        monkeypatch.setattr(fastpath, "_routes", lambda m, paths, *a, **k: ("dot",) * len(fastpath.ROUTE_ROWS))
    target = tiny_model("llama", layers=4)
    draft = MirrorDrafterForCausalLM.from_target(target, 3, num_streams=2, num_stream_layers=1).eval()
    draft.config._attn_implementation = "sdpa"
    draft = draft.to(torch.bfloat16)
    served = copy.deepcopy(draft)
    assert fastpath.install(served, "fastest") == "fastest" and served.config._attn_implementation == DRAFT_NAME
    if dot:
        layers = fused_layer.decoder_layers(served)
        assert layers and all(m.__dict__.get("_dot") for m in served.modules() if isinstance(m, nn.Linear))
        for layer in layers:
            layer.max_rows = kernels.MAX_ROWS  # every tree below through the C layers, read on the dot product
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    outs = []
    with torch.inference_mode():
        for model in (draft, served):
            cache = model.new_cache()
            model(ids, cache=cache, num_streams=0)
            outs.append(model.tree_forward([5, 6, 7, 8], [-1, 0, 0, 1], cache))
    torch.testing.assert_close(outs[1].logits.float(), outs[0].logits.float(), atol=0.1, rtol=0.05)
    torch.testing.assert_close(outs[1].stream_logits.float(), outs[0].stream_logits.float(), atol=0.1, rtol=0.05)


@needs_kernel
@pytest.mark.parametrize("n,k,bias", [(576, 576, False), (49, 1536, True), (7, 13, True), (300, 95, False)])
def test_the_dot_product_linear_is_the_bfloat16_rounded_inputs_product(n, k, bias):
    """`linear_dot` (a draft's `dot` path) computes x rounded to bfloat16 times the bf16 weight, float32 sums: within
    float32 rounding of float64's product of those rounded inputs, at every row count (streams to 4 rows, tiles past),
    a partial last panel, an odd K, a bias."""
    if not kernels.screen_dot():
        pytest.skip("no AVX512-BF16 here")
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g).to(torch.bfloat16), torch.randn(40, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    panels = kernels.to_panels(w)
    exact = nn.functional.linear(x.to(torch.bfloat16).double(), w.double(), None if b is None else b.double())
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 40):
        out = kernels.linear_dot(x[:rows], n, panels, b)
        torch.testing.assert_close(out.double(), exact[:rows], atol=1e-4 * k**0.5, rtol=1e-5)


def test_the_fast_path_is_chosen_by_device_and_dtype():
    expected = "exact" if kernels.available() else "onednn" if torch.backends.mkldnn.is_available() else "none"
    assert fastpath.resolve("auto", "cpu", torch.float32) == expected
    assert fastpath.resolve("auto", "cpu", torch.bfloat16) in ("onednn", "none")  # torch's bf16 rounding kept
    assert fastpath.resolve("auto", "cpu", torch.float16) in ("onednn", "none")  # the kernels take f32 / bf16
    with pytest.raises(MirrorTrainError, match="float32 or bfloat16 model on a CPU"):
        fastpath.resolve("exact", "cpu", torch.float16)
    with pytest.raises(MirrorTrainError, match="fast_path must be one of"):
        fastpath.resolve("turbo", "cpu")
    assert fastpath.resolve("fastest", "cpu", torch.bfloat16) == "fastest"  # a draft's: any rounding will do
    assert fastpath.resolve("fastest", "meta") == "none"
    assert fastpath.for_draft("auto") == "fastest" and fastpath.for_draft("onednn") == "onednn"
    from mirror_train.engine import EngineConfig

    EngineConfig(placement="local", draft_fast_path="fastest").validate()
    with pytest.raises(MirrorTrainError, match="fast_path must be one of"):
        EngineConfig(placement="local", draft_fast_path="turbo").validate()


def test_onednn_is_offered_only_for_the_dtypes_this_cpus_onednn_packs():
    """oneDNN's bf16 prepacking needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only EPYC (Zen 3) it raises,
    and a bf16 draft's install then routes among torch's path and the kernel instead of failing."""
    packs = fastpath.onednn_packs(torch.bfloat16)
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), None)
        expected = torch.backends.mkldnn.is_available()
    except RuntimeError:
        expected = False
    assert packs == expected
    if packs:
        assert fastpath.resolve("onednn", "cpu", torch.bfloat16) == "onednn"
    else:
        with pytest.raises(MirrorTrainError, match="oneDNN packs the model's dtype"):
            fastpath.resolve("onednn", "cpu", torch.bfloat16)
    layer = torch.nn.Sequential(torch.nn.Linear(32, 48)).to(torch.bfloat16)
    assert fastpath.install(layer, "fastest") == "fastest"
    paths = set(fastpath.routes(layer)["0"])
    assert ("onednn" in paths) <= packs
    x = torch.randn(1, 3, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer[0].weight, layer[0].bias))


def test_a_draft_served_on_the_kernels_takes_bf16_weights_on_any_cpu():
    """Its sums are float32 over bf16 weights widened on load: bf16 halves its bytes without bf16 arithmetic, so
    "auto" takes it wherever the kernels serve the draft, AVX2-only CPUs included; elsewhere devices' rule."""
    from mirror_train.devices import resolve_dtype

    expected = torch.bfloat16 if kernels.available() else resolve_dtype("auto", "cpu")
    assert fastpath.draft_dtype("auto", "cpu") == expected
    assert fastpath.draft_dtype("auto", "cpu", "none") == resolve_dtype("auto", "cpu")
    assert fastpath.draft_dtype("float32", "cpu") == torch.float32
    with pytest.raises(MirrorTrainError, match="dtype must be"):
        fastpath.draft_dtype("half", "cpu")


def test_a_prefill_takes_the_fastest_gemm_and_returns_the_inputs_dtype():
    """Past MAX_ROWS rows a bf16 draft's linear may widen its weights (where bf16 GEMMs are emulated, AVX2): any of
    the three paths computes the same product, in the input's dtype."""
    assert fastpath.prefill_path((48, 32), True, torch.float32) in ("torch", "onednn")
    assert fastpath.prefill_path((48, 32), True, torch.bfloat16) in ("torch", "onednn", "float32")
    w, b = torch.randn(48, 32).to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)
    x = torch.randn(1, 200, 32)
    with torch.inference_mode():
        out = fastpath.prefill_linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (1, 200, 48)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w.float(), b.float()), atol=0.1, rtol=0.02)


def test_without_a_compiler_the_kernel_is_unavailable_and_auto_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels._library.cache_clear()
    try:
        assert not kernels.available()
        assert fastpath.resolve("auto", "cpu", torch.float32) in ("onednn", "none")
        with pytest.raises(MirrorTrainError, match="C compiler"):
            fastpath.resolve("exact", "cpu", torch.float32)
    finally:
        kernels._library.cache_clear()


@needs_kernel
def test_a_prefill_past_the_kernels_rows_takes_the_gemm_measured_faster_and_computes_the_same_function():
    """A prompt's prefill (more than MAX_ROWS rows) runs torch's or oneDNN's GEMM, whichever was timed faster for
    the shape at install (an AMD EPYC's MKL GEMM ran at less than half oneDNN's speed): the linear's function."""
    from mirror_train.random_models import tiny_model

    model = tiny_model()
    ids = torch.randint(0, 128, (1, kernels.MAX_ROWS + 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain = model(ids).logits
        fastpath.install(model, "exact")
        fast = model(ids).logits
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    shape = tuple(model.lm_head.weight.shape)
    assert fastpath.prefill_path.cache_info().currsize > 0  # timed at install, not in the first request
    paths = ("torch", "onednn" * torch.backends.mkldnn.is_available())
    assert fastpath.prefill_path(shape, False, torch.float32) in paths
    x = torch.randn(kernels.MAX_ROWS + 1, 32)
    w, b = torch.randn(48, 32), torch.randn(48)
    torch.testing.assert_close(fastpath.prefill_linear(x, w, b), nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    if torch.backends.mkldnn.is_available():
        reference = nn.functional.linear(x, w, b)
        torch.testing.assert_close(fastpath.onednn_linear(x, w, b), reference, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_spread_prefill_takes_the_threaded_gemm_from_its_measured_rows_and_nothing_else_does():
    """Inside `fastpath.spread` (a prompt's prefill on several threads) an exact linear of at least `spread_rows`
    rows is the prefill's GEMM, bit for bit, and of fewer the row-exact kernel; outside it (every window) the kernel
    up to MAX_ROWS rows, whatever the rows. The threads are the layout's inside and what they were after."""
    model = nn.Sequential(nn.Linear(96, 80))
    fastpath.install(model, "exact")
    linear = model[0]
    before = torch.get_num_threads()
    xs = {rows: torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows)) for rows in (1, 8, 16, 32, 64)}
    with torch.inference_mode():
        outside = {rows: linear(x) for rows, x in xs.items()}
        with fastpath.spread((None, before + 1)):
            assert torch.get_num_threads() == before + 1
            crossover = fastpath.spread_rows((80, 96), True, torch.float32, before + 1)
            inside = {rows: linear(x) for rows, x in xs.items()}
            gemm = {rows: fastpath.prefill_linear(x, linear.weight, linear.bias) for rows, x in xs.items()}
        assert torch.get_num_threads() == before
        for rows in xs:
            threaded = rows >= max(crossover, fastpath.SPREAD_MIN_ROWS)
            assert torch.equal(inside[rows], gemm[rows] if threaded else outside[rows]), rows
            assert torch.equal(linear(xs[rows]), outside[rows]), rows  # after it: the kernel again
        torch.testing.assert_close(inside[64], outside[64], atol=1e-5, rtol=1e-5)  # the same function
    assert crossover in (8, 16, 32, 64, kernels.MAX_ROWS + 1)


@needs_kernel
@pytest.mark.parametrize("kind", ["exact", "fastest"])
def test_gradients_reach_the_input_through_a_frozen_fast_linear(kind):
    """The kernel and oneDNN's ops have no backward: a call whose input needs a gradient takes torch's path even
    when the layer itself is frozen (a draft trained through the target's frozen LM head)."""
    from mirror_train.random_models import tiny_model

    model = tiny_model().requires_grad_(False)
    fastpath.install(model, kind)
    x = torch.randn(3, model.config.hidden_size, requires_grad=True)
    model.lm_head(x).sum().backward()
    torch.testing.assert_close(x.grad, model.lm_head.weight.sum(0).expand(3, -1))


def test_routes_are_timed_on_copies_of_the_weight_that_come_from_memory(monkeypatch):
    """`fastest` times each path on the next of enough copies of a weight that none is still cached when read again
    (as served, where the rest of the model streams through the caches between two calls): each timed call reads
    another copy, the served weight is untouched, and the copies stop at ROUTE_COPIES."""
    linear = nn.Linear(64, 96).to(torch.float32)
    linear.__class__ = fastpath.RoutedLinear
    if torch.backends.mkldnn.is_available():
        linear.repack()
    paths = ["torch"] + ["onednn"] * torch.backends.mkldnn.is_available() + ["exact"] * kernels.available()
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: seen.append(w.data_ptr()) or real(x, w, b))
    before = linear.weight.clone()
    monkeypatch.setattr(fastpath, "ROUTE_COPIES", 40)
    routes = fastpath._time_routes(linear, paths)
    assert len(routes) == len(fastpath.ROUTE_ROWS) and set(routes) <= set(paths)
    assert all(a != b for a, b in zip(seen, seen[1:])) and linear.weight.data_ptr() not in seen
    assert 1 < len(set(seen)) <= 40  # 64·96·4 bytes a copy: the cap, not ROUTE_COLD_BYTES, bounds them
    torch.testing.assert_close(linear.weight, before, rtol=0, atol=0)
    seen.clear()
    fastpath._time_routes(linear, paths, cold=False)
    assert set(seen) == {linear.weight.data_ptr()}


def test_routes_are_measured_once_per_machine_by_shape_and_paths(monkeypatch, tmp_path):
    """`_routes` keeps what it timed beside the kernel library (`kernels.per_machine`): a later process takes a
    kept route without timing, another shape or set of paths is timed afresh, and a kept file that is corrupt or
    names a path not offered is timed again."""
    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))
    linear = nn.Linear(64, 96).to(torch.float32)
    linear.__class__ = fastpath.RoutedLinear
    paths = ["torch"]
    if torch.backends.mkldnn.is_available():
        linear.repack()
        paths.append("onednn")
    calls = []
    real = fastpath._time_routes
    monkeypatch.setattr(fastpath, "_time_routes", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    first = fastpath._routes(linear, paths)
    (kept,) = tmp_path.glob("routes_96x64_float32_float32_bias_*.json")
    assert len(calls) == 1 and len(first) == len(fastpath.ROUTE_ROWS) and set(first) <= set(paths)
    planted = ["torch", paths[-1]] * len(fastpath.ROUTE_ROWS)
    kept.write_text(f'{{"routes": {planted[: len(fastpath.ROUTE_ROWS)]}}}'.replace("'", '"'))  # another process's
    assert fastpath._routes(linear, paths) == tuple(planted[: len(fastpath.ROUTE_ROWS)]) and len(calls) == 1
    assert len(fastpath._routes(linear, ["torch"])) == len(fastpath.ROUTE_ROWS) and len(calls) == 2  # other paths
    for text in ('{"routes": ["tiles"]}', "{not json"):
        kept.write_text(text)
        assert set(fastpath._routes(linear, paths)) <= set(paths)
    assert len(calls) == 4


@pytest.mark.skipif(not kernels.available(), reason="needs the C kernels (a C compiler)")
def test_a_drafts_c_layer_cap_is_measured_once_per_machine(monkeypatch, tmp_path):
    """`fused_layer.cap_rows` keeps its measurement per machine by the draft's shape: a draft of that shape served
    later takes the kept cap without timing; one that is none of the timed lengths is timed again."""
    from mirror_train.models.drafter import MirrorDrafterForCausalLM
    from mirror_train.random_models import tiny_model

    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))
    draft = MirrorDrafterForCausalLM.from_target(tiny_model("llama", layers=4), 3, num_streams=2, num_stream_layers=1)
    fastpath.install(copy.deepcopy(draft).eval(), "fastest")
    (kept,) = tmp_path.glob("cap_rows_*.json")
    timed = []
    real = fused_layer._time_cap_rows
    monkeypatch.setattr(fused_layer, "_time_cap_rows", lambda *a: timed.append(1) or real(*a))
    for text, cap, count in (('{"rows": 4}', {4}, 0), ('{"rows": 5}', {0, *fused_layer.CAP_ROWS}, 1)):
        kept.write_text(text)
        served = copy.deepcopy(draft).eval()
        fastpath.install(served, "fastest")
        caps = {layer.max_rows for layer in fused_layer.decoder_layers(served)}
        assert len(caps) == 1 and caps <= cap and len(timed) == count


@pytest.mark.skipif(not kernels.available(), reason="needs the C kernels (a C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fastest_served_draft_runs_its_decoder_layers_as_c_calls(dtype, monkeypatch):
    """A draft served `fastest` on a CPU runs each decoder layer, the multi-stream one included, as C layer calls
    wherever a node's keys are at most two runs (a plain window, a serial rollout's chain, a branch off the spine),
    and computes the plain draft's function there: float32 weights within float32 noise; bfloat16 weights with
    float32 activations (fastpath._widen_activations), against the same weights widened, within float32 noise
    too (the dot product, which rounds the inputs to bfloat16 where it measures faster, kept out here: its function
    is test_a_fastest_served_bf16_draft_proposes_what_the_plain_draft_does's). Streams are computed at the read
    positions only, as the plain forward computes them at every one."""
    from mirror_train.engine.rollout import keep_cache_path
    from mirror_train.models.drafter import MirrorDrafterForCausalLM
    from mirror_train.random_models import tiny_model

    target = tiny_model("llama", layers=4)
    draft = MirrorDrafterForCausalLM.from_target(target, 3, num_streams=2, num_stream_layers=1).eval()
    draft.config._attn_implementation = "sdpa"
    draft = draft.to(dtype)
    reference = copy.deepcopy(draft).float()  # the same weights, every sum float32, torch's modules
    monkeypatch.setattr(kernels, "screen_dot", lambda: False)
    served = copy.deepcopy(draft)
    assert fastpath.install(served, "fastest") == "fastest"
    assert next(served.parameters()).dtype == torch.float32 and served.lm_head.weight.dtype == dtype
    layers = fused_layer.decoder_layers(served)
    caps = {layer.max_rows for layer in layers}  # measured at install (fused_layer.cap_rows)
    assert len(caps) == 1 and caps <= {0, *fused_layer.CAP_ROWS}
    for layer in layers:  # the counts below are of every call the C layer can take
        layer.max_rows = kernels.MAX_ROWS
    calls = []
    decoder_layer = kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a, **k: calls.append(a[0].shape[1]) or decoder_layer(*a, **k))
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    caches = []
    with torch.inference_mode():
        for model in (reference, served):
            cache = model.new_cache()
            model(ids, cache=cache, num_streams=0)  # the prefill: 30 rows on an empty cache
            caches.append(cache)
        assert calls == [30] * 3  # the served draft's in C, each layer one call
        trees = [  # (tokens, parents, read), with how many C calls each makes (2 plain layers + the stream layer)
            ([5], [-1], [0], 2 + 1),  # one node: its main row and its two streams in one call
            ([5, 6, 7], [-1, 0, 1], [2], 2 + 1),  # a chain
            ([5, 6, 7, 8, 9], [-1, 0, 1, 0, 2], [3, 4], 2 + 0),  # branches: their streams see three runs, torch's
            ([5, 6, 7], [-1, 0, 1], None, 2 + 1),  # every position read: streams at each
            ([5, 6, 7, 8, 9], [-1, 0, 1, 0, 2], [2], 2 + 1),  # branches, streams on the spine's end only
        ]
        for tokens, parents, read, expected in trees:
            calls.clear()
            index = None if read is None else torch.tensor(read)
            models = zip((reference, served), caches)
            outs = [m.tree_forward(tokens, parents, c, 30, logits_index=index) for m, c in models]
            assert len(calls) == expected, (parents, calls)
            torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(outs[1].stream_logits, outs[0].stream_logits, atol=1e-4, rtol=1e-4)
            for c in caches:
                keep_cache_path(c, 30, [])


@pytest.mark.skipif(not kernels.available(), reason="needs the C kernels (a C compiler)")
def test_a_bf16_draft_whose_embedding_is_tied_to_its_head_is_served_with_float32_activations():
    """The embedding tied to the LM head (a draft cut from a tied target, whole vocabulary) gets its own float32
    copy where the head keeps its bf16 weights: the activations, the masks and the cache are float32 throughout
    (a bf16 embedding had made the prompt's mask bf16 against float32 queries after the first norm)."""
    from mirror_train.models.drafter import MirrorDrafterForCausalLM
    from mirror_train.random_models import tiny_model

    draft = MirrorDrafterForCausalLM.from_target(tiny_model("llama", layers=4), 3, num_streams=2, num_stream_layers=1)
    draft.lm_head.weight = draft.embed_tokens.weight
    draft = draft.eval().to(torch.bfloat16)
    reference = copy.deepcopy(draft).float()
    assert fastpath.install(draft, "fastest") == "fastest"
    assert draft.embed_tokens.weight.dtype == torch.float32 and draft.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))  # past the kernels' rows
    with torch.inference_mode():
        outs = []
        for model in (reference, draft):
            cache = model.new_cache()
            model(ids, cache=cache, num_streams=0)
            outs.append(model.tree_forward([5, 6], [-1, 0], cache, logits_index=torch.tensor([1])))
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=5e-2, rtol=5e-2)
