"""Where the CPU kernels stream weights from: cache-line-aligned addresses on transparent huge pages.

- Lines. transformers loads a checkpoint's tensors as views into one buffer at the offsets the safetensors file gives
  them, and those are 8-byte aligned only: every parameter of the testbed sat 40 bytes past a 64-byte line, so every
  64-byte vector load of a weight row straddled two cache lines. Aligned storage made the target's float32 8-token
  window 18% faster and its one-token step 2–6% (Zen 5, docs/engine.md sixteenth session).
- Huge pages. A decoding step reads every weight once: the testbed's 538 MB is 131k pages of 4 KiB, each a TLB miss
  (a two-level walk under a hypervisor), and the hardware prefetchers stop at each 4 KiB boundary. Linux backs
  anonymous memory with 2 MiB pages where madvise(MADV_HUGEPAGE) asks for them (transparent huge pages in their
  common `madvise` mode; `always` needs no asking, `never` refuses, and then this is plain aligned memory). One
  thread's row-exact product over 1536 × 576 float32 weights (40 copies, streamed) read 21 GB/s from 4 KiB pages
  and 31 GB/s from 2 MiB pages at one row, and ran 1.14× / 1.18× faster at five / eight rows (AMD EPYC Zen 4 VM,
  docs/engine.md thirty-first session).
The values are copied unchanged, so nothing computed changes.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence

import torch
from torch import nn

LINE = 64  # bytes: a cache line, and one AVX-512 vector
HUGE_PAGE = 2 << 20  # bytes: an x86-64 transparent huge page

# Linux: anonymous mappings can ask for huge pages. MIRROR_TRAIN_HUGE_PAGES=0 keeps 4 KiB pages (to measure the gain)
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("MIRROR_TRAIN_HUGE_PAGES", "1") != "0"
_arenas: dict[int, tuple[int, int]] = {}  # id of a live arena's region → its [start, end) addresses


def huge_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh, untouched memory (a uint8 tensor) starting on a 2 MiB boundary, with the kernel asked to back
    it by huge pages when it is first written; plain `torch.empty` where this platform has no such request."""
    if not nbytes or not HUGE_PAGES:
        return torch.empty(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:  # one huge page more than asked: the start is moved up to the next 2 MiB boundary (the rest is never touched)
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive while any view of it lives
    offset = -whole.data_ptr() % HUGE_PAGE
    try:  # not for less than half a huge page: one would be committed whole for a few small tensors
        if 2 * nbytes >= HUGE_PAGE:
            region.madvise(mmap.MADV_HUGEPAGE, offset, size)
    except OSError:  # refused (THP disabled, an old kernel): 4 KiB pages, still aligned
        pass
    start = whole.data_ptr()
    _arenas[id(region)] = (start, start + size + HUGE_PAGE)
    weakref.finalize(region, _arenas.pop, id(region), None)
    return whole[offset : offset + nbytes]


def placed(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s data lies in memory `huge_empty` mapped (where it cannot map: on a cache line), so that
    placing it again would gain nothing."""
    ptr = tensor.data_ptr()
    if not HUGE_PAGES:
        return ptr % LINE == 0
    return any(start <= ptr < end for start, end in _arenas.values())


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory the kernel backs with huge pages now (None: not Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


def _rounded(nbytes: int) -> int:
    return -(-nbytes // LINE) * LINE


def pack(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors`, each at a cache line, together in one arena of huge pages (one arena, not
    one each: a huge page is committed whole, and a model has hundreds of small weights)."""
    out, offset = [], 0
    with torch.inference_mode(False), torch.no_grad():  # normal tensors even under inference mode: a model
        arena = huge_empty(sum(_rounded(t.nbytes) for t in tensors))  # installed there may train later
        for t in tensors:
            view = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
            out.append(view)
            offset += _rounded(t.nbytes)
    return out


def align_parameters(module: nn.Module) -> int:
    """Move every CPU parameter of `module` not yet placed into one arena of huge pages, each at a cache line
    (`pack`), in place: the Parameter objects, and so ties between modules, are kept. Returns the number moved (0
    when called again). Call before anything borrows a parameter's tensor (a proxy head borrowing the LM head's
    weight would otherwise keep the old copy)."""
    params = {id(p): p for p in module.parameters() if p.device.type == "cpu" and p.numel() and not placed(p)}
    with torch.no_grad():
        for p, moved in zip(params.values(), pack([p.data for p in params.values()]), strict=True):
            p.data = moved
    return len(params)
