"""Where the CPU kernels stream weights from (alignment.py): copies on cache lines, in one arena of huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mirror_train import alignment

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages ("always", "madvise", "never"), None where there are none."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_packed_copies_keep_values_and_dtypes_on_cache_lines_in_one_arena():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16)]
    tensors.append(torch.randn(6, 4, generator=gen).t())  # a transposed view: copied contiguous
    packed = alignment.pack(tensors)
    for t, p in zip(tensors, packed, strict=True):
        assert torch.equal(t, p) and p.dtype == t.dtype and p.is_contiguous()
        assert p.data_ptr() % alignment.LINE == 0
    assert all(alignment.placed(p) for p in packed)
    if alignment.HUGE_PAGES:  # else "placed" means on a cache line, which torch's allocator gives any tensor
        assert not alignment.placed(torch.randn(3, 5))
    assert packed[1].untyped_storage().data_ptr() == packed[0].untyped_storage().data_ptr()  # one arena


@pytest.mark.skipif(not alignment.HUGE_PAGES, reason="no madvise(MADV_HUGEPAGE) on this platform")
def test_an_arena_starts_on_a_huge_page_and_is_backed_by_them_where_the_kernel_allows():
    nbytes = 3 * alignment.HUGE_PAGE
    before = alignment.huge_page_bytes()
    arena = alignment.huge_empty(nbytes)
    assert arena.data_ptr() % alignment.HUGE_PAGE == 0 and arena.numel() == nbytes
    arena.fill_(1)  # first touch: where the kernel chooses the pages
    if _thp_mode() in ("always", "madvise"):
        assert alignment.huge_page_bytes() >= before + alignment.HUGE_PAGE  # at least one of the three
    assert int(arena.sum()) == nbytes


def test_a_module_is_placed_once_with_its_ties_and_the_same_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    model[1].weight = model[0].weight  # tied, as an LM head and its embedding
    x = torch.tensor([[1, 2, 3]])
    before = model(x)
    # the tied weight once, and the bias (with 4 KiB pages only what is off a cache line moves: here nothing)
    assert alignment.align_parameters(model) == (2 if alignment.HUGE_PAGES else 0)
    assert model[1].weight is model[0].weight and all(alignment.placed(p) for p in model.parameters())
    assert torch.equal(model(x), before)
    assert alignment.align_parameters(model) == 0
