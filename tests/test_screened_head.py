"""The LM head's screens (screened_head.py: int8 on AMX tiles or on the dot product of byte quads, bfloat16 on the
dot product, bfloat16 widened): greedy tokens are the served head's argmax exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mirror_train import fastpath, fused_head, kernels, screened_head
from mirror_train.target import Target

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler here to build the kernel")


def served_head(weight: torch.Tensor, kind: str = "auto") -> nn.Linear:
    """A bias-free head served as a target's is (the row-exact kernel), with its screen built unmeasured."""
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight.data.copy_(weight)
    head.requires_grad_(False)
    fastpath.install(head, "exact")  # not a model: no screen of its own
    assert screened_head.build(head, measure=False, kind=kind) is not None
    return head


def built(kind: str) -> None:
    if kind not in screened_head.kinds_built():
        pytest.skip(f"the {kind} screen is not built on this CPU")


@needs_kernel
@pytest.mark.parametrize("layout", kernels.LAYOUTS)
def test_linear_at_computes_the_served_heads_bits_for_the_outputs_it_is_asked(layout):
    """Only some outputs, gathered rows or the panels that hold them: the same bits as the whole call's columns."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(301, 70, generator=g), torch.randn(9, 70, generator=g)
    panels = kernels.to_panels(w) if layout == "panels" else None
    whole = kernels.linear(x, w, None, panels)
    for ids in ([0], [5, 17, 18, 300], list(range(0, 301, 7)), [299, 300]):
        at = torch.tensor(ids)
        assert torch.equal(kernels.linear_at(x, w, at, panels), whole[:, at])


@needs_kernel
@pytest.mark.parametrize("layout", kernels.LAYOUTS)
@pytest.mark.parametrize("kind", screened_head.KINDS)
@pytest.mark.parametrize("k", [128, 95])  # 128: whole 64-byte steps of AMX tiles
@pytest.mark.parametrize("values", ["float32", "bfloat16"])
def test_the_screened_argmax_is_the_heads_whatever_the_rows_ties_included(layout, kind, k, values, monkeypatch):
    """Random heads and rows (1–40 of them, scaled from tiny to large logits), rows whose best ids are near-ties,
    and exact ties (duplicated weight rows: the first id wins, as torch.argmax): every token is the served head's.
    Every screen the CPU builds: int8 (each input in two bytes, an odd K's last quad padded), the dot product's
    (bfloat16 inputs, an odd K's last pair padded) and the widened weights'; a head of float32 values, and one of
    bfloat16 values read from its bfloat16 copy (kernels.serve_narrow), whose bfloat16 screen is the head itself
    rounded to nothing."""
    built(kind)
    monkeypatch.setattr(kernels, "layout", lambda dtype=None: layout)
    monkeypatch.setattr(kernels, "narrow", lambda dtype=None: True)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, k, generator=g) * 0.05
    w[701] = w[31] * (1 + 2**-20)  # near-ties
    if values == "bfloat16":
        w = w.bfloat16().float()
        w[701] = torch.nextafter(w[31].bfloat16(), torch.tensor(9.0, dtype=torch.bfloat16)).float()  # near-ties
    w[700] = w[30]  # exact ties between 30 and 700
    head = served_head(w, kind)
    read = kernels.served(head)[layout == "panels"]
    assert read.dtype == (torch.bfloat16 if values == "bfloat16" else torch.float32)
    screen = screened_head.screen_of(head)
    assert screen.kind == kind
    if kind not in screened_head.INT8:  # the bfloat16 weight as rows or as panels (the dot product reads panels)
        assert (screen.weights[0].dim() != 2) == (kind == "bf16_dot" or layout == "panels")
    checked = 0
    for scale in (1e-3, 1.0, 30.0, 1e3):
        for rows in (1, 2, 3, 5, 8, 16, 40):
            x = torch.randn(rows, k, generator=g) * scale
            x[0] = w[30] * scale * 40  # its best ids tie exactly
            if rows > 1:
                x[1] = w[31] * scale * 40
            whole = head(x).argmax(-1).tolist()
            assert screened_head.screened_argmax(head, screen, x) == whole
            assert screened_head.argmax(head, x) == whole
            checked += rows
    assert whole[0] == 30  # the first of the tied ids
    assert checked > 100


@needs_kernel
@pytest.mark.parametrize("layout", kernels.LAYOUTS)
@pytest.mark.parametrize("kind", screened_head.KINDS)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_a_sample_through_the_screen_is_the_whole_heads_gumbel_max(layout, kind, temperature, monkeypatch):
    """Sampling (acceptance.sample_noise: T·Gumbel noise a position): the screen's token is the first largest of the
    served logits plus the noise, exactly the id `target_tokens` takes from the whole head's logits, at 1–40 rows
    and logits from flat to peaked, ties of the sums included (two rows' noise made equal on duplicated ids)."""
    from mirror_train.engine.acceptance import sample_noise, target_tokens

    built(kind)
    monkeypatch.setattr(kernels, "layout", lambda dtype=None: layout)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1000, 128, generator=g) * 0.05
    w[700] = w[30]  # duplicated ids: equal logits
    head = served_head(w, kind)
    screen = screened_head.screen_of(head)
    checked = 0
    for scale in (1e-2, 1.0, 30.0):
        for rows in (1, 2, 5, 8, 16, 40):
            x = torch.randn(rows, 128, generator=g) * scale
            x[0] = w[30] * scale * 40
            first = checked  # positions: distinct per row and call
            noise = sample_noise(1000, temperature, 11, range(first, first + rows))
            noise[0, 700] = noise[0, 30]  # a tie of the sums: the first id wins, as torch.argmax
            whole = (head(x) + noise).argmax(-1).tolist()
            ids = screened_head.argmax_and_scores(head, x, noise)[0]
            assert ids == whole
            assert screened_head.screened_argmax(head, screen, x, None, noise) == whole
            if rows > 1:  # the row without a forced tie is target_tokens' own sample
                assert ids[1:] == target_tokens(head(x)[1:], temperature, 11, first + 1)
            checked += rows
    assert checked > 100


def test_gumbel_max_samples_follow_the_softmax():
    """`target_tokens` at T > 0: argmax(logits + T·G) over many positions is distributed as softmax(logits / T), and
    a position's sample depends on (seed, position) alone."""
    from mirror_train.engine.acceptance import sample_noise, target_tokens

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    for temperature in (0.5, 1.0, 2.0):
        noise = sample_noise(5, temperature, 3, range(20000))
        counts = torch.bincount((logits + noise).argmax(-1), minlength=5).double()
        wanted = torch.softmax(logits[0].double() / temperature, -1) * 20000
        assert ((counts - wanted).abs() <= 5 * wanted.sqrt() + 5).all(), (temperature, counts, wanted)
    assert target_tokens(logits, 1.0, 3, 17) == target_tokens(logits, 1.0, 3, 17)
    assert torch.equal(sample_noise(5, 1.0, 3, [17]), sample_noise(5, 1.0, 3, range(17, 18)))
    assert not torch.equal(sample_noise(5, 1.0, 3, [17]), sample_noise(5, 1.0, 4, [17]))


def test_the_screened_argmax_is_the_heads_on_the_avx2_and_scalar_builds(other_kernel_build, monkeypatch):
    """The same check on the other builds' code paths (the rows' candidates scanned without AVX-512), exact ties
    included."""
    monkeypatch.setattr(kernels, "layout", lambda dtype=None: "rows")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(500, 37, generator=g) * 0.05
    w[400] = w[20]
    head = served_head(w)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 37, generator=g)
        x[0] = w[20] * 40
        assert screened_head.screened_argmax(head, screened_head.screen_of(head), x) == head(x).argmax(-1).tolist()
        noise = torch.randn(rows, 500, generator=g) * 3  # a sample's noise: the scalar tail adds it too
        whole = (head(x) + noise).argmax(-1).tolist()
        assert screened_head.screened_argmax(head, screened_head.screen_of(head), x, None, noise) == whole


@needs_kernel
def test_greedy_tokens_row_by_row_cap_the_logits_they_compute(monkeypatch):
    """`kernels.screen_argmax` (a head served from its rows): each row's own candidates only, the head's argmax; more
    logits than allowed, or none allowed, gives None (the caller takes the whole head), never a guess."""
    monkeypatch.setattr(kernels, "layout", lambda dtype=None: "rows")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3000, 64, generator=g) * 0.05
    head = served_head(w)
    screen = screened_head.screen_of(head)
    x = torch.randn(6, 64, generator=g)
    scores = screened_head.screen_scores(screen, x)
    ids = kernels.screen_argmax(scores, x, w, None, screen.mode, screen.constants, screen.bounds, 10**6)
    assert ids == head(x).argmax(-1).tolist()
    assert kernels.screen_argmax(scores, x, w, None, screen.mode, screen.constants, screen.bounds, 5) is None


@needs_kernel
@pytest.mark.parametrize("layout", kernels.LAYOUTS)
@pytest.mark.parametrize("values", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", screened_head.KINDS)
def test_per_id_bounds_keep_the_argmax_where_row_norms_differ_widely(layout, values, kind, monkeypatch):
    """The bound is per id (‖w_v‖ and its rounding error's): a head whose rows' norms span 10⁴ (a few huge rows near
    the top, many tiny ones) and rows aimed at each, so that the largest rows' errors dwarf the small ones' and near
    ties cross between them. Every token is the served head's, on rows, float32 panels and bfloat16 panels, through
    every screen built here."""
    built(kind)
    monkeypatch.setattr(kernels, "layout", lambda dtype=None: layout)
    monkeypatch.setattr(kernels, "narrow", lambda dtype=None: True)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(777, 48, generator=g) * torch.logspace(-2, 2, 777)[torch.randperm(777, generator=g)][:, None]
    if values == "bfloat16":
        w = w.bfloat16().float()
    big = int(w.norm(dim=1).argmax())
    w[5] = w[big] * 0.999  # a near-tie with the largest row, from another norm's error
    head = served_head(w, kind)
    screen = screened_head.screen_of(head)
    assert screen.bounds.dtype == torch.float32 and screen.bounds.shape == (2, 777)
    assert float(screen.bounds[1].min()) < 1e-3 * float(screen.bounds[1].max())
    for scale in (1e-2, 1.0, 50.0):
        x = torch.randn(12, 48, generator=g) * scale
        x[0] = w[big] * scale
        x[1] = w[int(w.norm(dim=1).argmin())] * scale * 1e3
        assert screened_head.screened_argmax(head, screen, x) == head(x).argmax(-1).tolist()


@needs_kernel
# screens that round the input (the widened one does not)
@pytest.mark.parametrize("kind", ["int8_amx", "int8", "bf16_dot"])
def test_the_per_id_bound_keeps_fewer_candidates_than_the_largest_norms_bound(kind):
    """The candidates the kernel computes (its count: the rows' lower bounds and the logits past them) against the
    bound a_v ≥ max a − 2·max e (the thirty-third session's), counted here in float64: on rows aimed at a cluster
    of 300 ids whose logits lie within ~0.5 of each other, beside a few rows ten times the others' norm (the largest
    norm sets the old bound), the old bound keeps the whole cluster, the per-id one a tenth of it at most."""
    built(kind)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4000, 256, generator=g) * 0.05
    w[:300] = w[0] + 0.003 * torch.randn(300, 256, generator=g)
    w[3990:] *= 10
    head = served_head(w, kind)
    screen = screened_head.screen_of(head)
    x = w[0] * 40 + 0.1 * torch.randn(8, 256, generator=g)
    scores = screened_head.screen_scores(screen, x)[:, :4000].double()
    xd, xl = x.double(), screened_head.read_rows(screen, x)
    c0, c1, gamma = (float(v) for v in screen.constants[:3])
    e = xl.norm(dim=1) * c0 + (gamma * xd.norm(dim=1) + (xl - xd).norm(dim=1)) * c1
    old = int((scores >= scores.max(dim=1, keepdim=True).values - 2 * e[:, None]).sum())
    assert old >= 300
    panels = kernels.panels_of(head)
    most = 10**6
    assert kernels.screen_argmax(scores.float(), x, w, panels, screen.mode, screen.constants, screen.bounds, most)
    low, high = 0, most  # the fewest logits the kernel computes: the largest `most` that refuses, plus one
    while low < high:
        mid = (low + high) // 2
        got = kernels.screen_argmax(scores.float(), x, w, panels, screen.mode, screen.constants, screen.bounds, mid)
        low, high = (low, mid) if got is not None else (mid + 1, high)
    assert low - 8 <= old / 10, (low, old)  # less the 8 rows' lower bounds


@needs_kernel
@pytest.mark.parametrize("kind", screened_head.KINDS)
def test_every_screened_logit_is_within_its_bound_of_the_served_one(kind):
    """The bound itself, id by id: |a_v − y_v| ≤ ‖x̂‖·s_v + (γ‖x‖ + ‖x̂ − x‖)·n_v + c₃ for every id of rows that stress
    each screen's rounding (an outlier feature 300× the others, values across 20 binades, a row of one value, tiny
    rows near float32's subnormals) against the served head's logits; and where the int8 screen is built, its
    candidates stay few on rows like a language model's (a few outlier features): its two bytes a value keep the
    input's rounding near float32's."""
    built(kind)
    g = torch.Generator().manual_seed(8)
    w = torch.randn(3000, 256, generator=g) * 0.05
    w[:10] *= 30
    head = served_head(w, kind)
    screen = screened_head.screen_of(head)
    x = torch.randn(12, 256, generator=g)
    x[0, 7] = 300.0
    x[1] = torch.randn(256, generator=g) * torch.logspace(-10, 10, 256)
    x[2] = 1.5
    x[3] = torch.randn(256, generator=g) * 1e-30
    x[4:8] *= 40
    x[4:8, :3] = 2000.0
    served = head(x).double()
    scores = screened_head.screen_scores(screen, x)[:, :3000].double()
    e = screened_head.error_bounds(screen, x)
    assert bool(((scores - served).abs() <= e).all())
    assert screened_head.screened_argmax(head, screen, x) == head(x).argmax(-1).tolist()
    if kind in screened_head.INT8:
        rows = w[100:108] * 30 + torch.randn(8, 256, generator=g)
        rows[:, :2] = 60.0  # a few outlier features, as a language model's final states have
        scores = screened_head.screen_scores(screen, rows)
        fewest = next(
            most
            for most in (16, 32, 64, 128, 256, 3000)
            if kernels.screen_argmax(scores, rows, w, None, screen.mode, screen.constants, screen.bounds, most)
        )
        assert fewest <= 32, fewest  # 8 rows: their lower bounds and ~3 candidates each at most


@needs_kernel
@pytest.mark.skipif(not kernels.screen_q8_amx(), reason="no AMX tiles here (or Linux did not lend them)")
def test_the_int8_screen_on_amx_tiles_has_the_dot_products_bits():
    """AMX's tiles make the same exact integer sums as the dot product of byte quads, and the same float32 operations
    follow: every screened logit has the same bits, at every row count (8 input rows a tile, 16 a pass over the head,
    more in passes), panel counts not a multiple of the tiles' four or two (the rest on the dot product), and a K
    that is not a multiple of 64 (all of it on the dot product)."""
    g = torch.Generator().manual_seed(12)
    for n, k in ((1000, 128), (4100, 64), (999, 192), (48, 64), (64, 100), (3000, 576)):
        panels, scales, sums = fused_head.quantize_panels(torch.randn(n, k, generator=g) * 0.05, kernels.lanes())
        for rows in (1, 2, 3, 5, 8, 9, 12, 16, 17, 33):
            x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
            x[0, :2] = 500.0  # outlier features
            dot = kernels.screen_q8_scores(x, n, panels, scales, sums)
            tiles = kernels.screen_q8_scores(x, n, panels, scales, sums, tiles=True)
            assert torch.equal(dot, tiles), (n, k, rows)


@needs_kernel
def test_the_screen_measured_is_one_built_here_and_kept_when_its_weight_changes(monkeypatch):
    """`build` with measuring takes one of the screens this CPU builds (the fastest measured), a rebuilt screen (its
    weight changed in place) keeps that kind, and a kind not built here is refused."""
    head = served_head(torch.randn(700, 64, generator=torch.Generator().manual_seed(9)))
    screen = screened_head.build(head)
    built = screened_head.kinds_built()
    assert screen.kind in built and len(screen.rows) == len(screened_head.ROWS)
    with torch.no_grad():
        head.weight.mul_(0.5)
    assert screened_head.screen_of(head).kind == screen.kind
    monkeypatch.setattr(kernels, "screen_q8", lambda: False)
    monkeypatch.setattr(kernels, "screen_dot", lambda: False)
    assert screened_head.kinds_built() == ["bf16"]
    with pytest.raises(ValueError, match="not built here"):
        screened_head.build(head, kind="int8")


@needs_kernel
def test_the_screens_kind_and_rows_are_measured_once_per_machine(monkeypatch, tmp_path):
    """The kind and the rows where the screen pays are kept beside the kernel library (`kernels.per_machine`): a
    later process (the per-process choices cleared) takes them as kept without timing anything, and a kept file
    that is corrupt, or names a kind not built here, is measured again."""
    monkeypatch.setenv("MIRROR_TRAIN_KERNELS", str(tmp_path))  # the loaded library stays; the choices are kept here
    monkeypatch.setattr(screened_head, "_FASTEST", {})
    monkeypatch.setattr(screened_head, "_MEASURED", {})
    head = served_head(torch.randn(700, 64, generator=torch.Generator().manual_seed(9)))
    built = screened_head.kinds_built()
    first = screened_head.build(head)
    kept = sorted(p.name for p in tmp_path.glob("screen_700x64_*.json"))
    assert len(kept) == (2 if len(built) > 1 else 1)  # the kind (where there is a choice), its rows

    def timed(*args, **kwargs):
        raise AssertionError("measured again")

    other = built[-1]
    rows = [i % 2 == 0 for i in range(len(screened_head.ROWS))]
    if len(built) > 1:
        (kind_file,) = tmp_path.glob(f"screen_700x64_*_{'-'.join(built)}_*.json")
        kind_file.write_text(f'{{"kind": "{other}"}}')  # another process's choice
    (rows_file,) = tmp_path.glob(f"screen_700x64_*_{first.kind}_rows_*.json")
    for kind in (first.kind, other):  # the chosen kind's rows, as that process kept them
        path = rows_file.with_name(rows_file.name.replace(f"_{first.kind}_rows_", f"_{kind}_rows_"))
        path.write_text(f'{{"rows": {str(rows).lower()}}}')
    screened_head._FASTEST.clear()
    screened_head._MEASURED.clear()
    with monkeypatch.context() as m:
        m.setattr(screened_head, "_fastest", timed)
        m.setattr(screened_head, "_measure", timed)
        later = screened_head.build(head)
    assert later.kind == (other if len(built) > 1 else first.kind) and later.rows == tuple(rows)
    for path in tmp_path.glob("screen_700x64_*.json"):
        path.write_text('{"kind": "tiles"}' if "-" in path.name else "{not json")
    screened_head._FASTEST.clear()
    screened_head._MEASURED.clear()
    again = screened_head.build(head)
    assert again.kind in built and len(again.rows) == len(screened_head.ROWS)


@needs_kernel
def test_the_screen_follows_its_heads_weight_and_steps_aside_where_it_cannot_bound():
    """A weight changed in place: the screen is made again (old tokens would be wrong). Non-finite rows: the whole
    head, as does a head with a bias or in another dtype (no screen built)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 32, generator=g)
    head = served_head(w)
    x = torch.randn(4, 32, generator=g)
    before = screened_head.screen_of(head)
    with torch.no_grad():  # as load_state_dict changes it
        head.weight.mul_(-1)
    assert screened_head.screen_of(head) is not before
    assert screened_head.argmax(head, x) == head(x).argmax(-1).tolist()
    x[2, 3] = float("inf")
    assert screened_head.screened_argmax(head, screened_head.screen_of(head), x) is None
    assert screened_head.argmax(head, x) == head(x).argmax(-1).tolist()
    biased = nn.Linear(32, 200)
    assert screened_head.build(biased) is None and screened_head.screen_of(biased) is None
    assert screened_head.build(nn.Linear(32, 200, bias=False).to(torch.bfloat16)) is None


@needs_kernel
def test_a_targets_greedy_tokens_are_its_logits_argmax(tiny_model_dir):
    """`Target.greedy` on a served tiny target (its screen built and measured by the fast path's install, and named
    where it was served: fastpath.describe) against the argmax of its logits."""
    target = Target.load(str(tiny_model_dir))
    fastpath.install(target.model, "exact")
    screen = screened_head.screen_of(target.lm_head)
    record = fastpath.describe(target.model)  # what reports name
    assert screen is not None and record["head_screen"] == screen.kind
    if record.get("layout") == "panels":  # and which panel tiles prefetch, as measured here
        assert int(record["panel_prefetch"], 16) == kernels.panel_prefetch(record["weights_read"])
    # the benchmarks' records: every key of it, the layout as kernel_layout
    named = fastpath.record(target.model)
    assert set(named) == {"kernel_layout", *fastpath.DESCRIBED} - {"layout"}
    assert named["kernel_layout"] == record.get("layout") and named["head_screen"] == screen.kind
    g = torch.Generator().manual_seed(2)
    for rows in (1, 4, 9):
        final = target.decoder.norm(torch.randn(1, rows, target.config.hidden_size, generator=g) * 3)
        assert target.greedy(final) == target.logits(final)[0].argmax(-1).tolist()


@pytest.mark.testbed
def test_the_testbeds_greedy_tokens_through_the_screen_are_its_heads(testbed_path):
    """The real head (49,152 x 576) on its own final states over real text: every row's token is the served
    head's argmax, at every row count the screen serves, and it leaves few candidates."""
    target = Target.load(str(testbed_path))
    fastpath.install(target.model, "exact")
    screen = screened_head.screen_of(target.lm_head)
    text = "The quick brown fox jumps over the lazy dog. Speculative decoding keeps the target's own output: " * 4
    ids = target.tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        states, _ = target.hidden_states(ids)
        final = states[-1][0].contiguous()
        for rows in (1, 2, 4, 8, 16):
            for i in range(0, final.shape[0] - rows, rows):
                x = final[i : i + rows]
                assert screened_head.screened_argmax(target.lm_head, screen, x) == target.lm_head(x).argmax(-1).tolist()


@needs_kernel
def test_the_avx2_and_scalar_builds_screen_the_same_tokens(other_kernel_build):
    """Built as an AVX2-only CPU (no dot products: the widened bfloat16 weights) and as plain x86-64 build them, the
    screen's selection runs its 8-lane and scalar code: the tokens are still the head's."""
    assert not kernels.screen_dot() and not kernels.screen_q8()
    g = torch.Generator().manual_seed(4)
    w = torch.randn(777, 40, generator=g) * 0.1
    w[500] = w[7]
    head = served_head(w)
    screen = screened_head.screen_of(head)
    assert screen.kind == "bf16"
    for rows in (1, 2, 5, 16):
        x = torch.randn(rows, 40, generator=g) * 10
        x[0] = w[7] * 100
        whole = head(x).argmax(-1).tolist()
        assert screened_head.screened_argmax(head, screen, x) == whole
        assert whole[0] == 7
