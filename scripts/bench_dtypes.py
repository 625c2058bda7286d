"""Is bf16 fast on this CPU? float32 against bfloat16 matmuls at the draft's shapes (its MLP projections and its
8,192-id LM head) and 1 / 8 / 32 rows (one node, a small tree, a large tree), one thread, medians of repeated
calls: what `devices.fast_bf16` (the `auto` precision of the draft, of training and of the data) decides from the
CPU's flags, measured.

    python scripts/bench_dtypes.py

Prints a Markdown table with the CPU model and its flags.
"""

from __future__ import annotations

import torch

from mirror_train.devices import cpu_model, fast_bf16
from mirror_train.timing import interleaved_median_ms

SHAPES = [(576, 1536), (1536, 576), (576, 8192)]  # (in, out): the testbed draft's up/down projection, its LM head
ROWS = (1, 8, 32)
CALLS = 40  # linears a timed repetition: a single one-row linear is too short to time alone


def linear_ms(x: torch.Tensor, w: torch.Tensor):
    """A function that runs CALLS linears of x by w: one timed repetition."""

    def run():
        for _ in range(CALLS):
            torch.nn.functional.linear(x, w)

    return run


def main() -> None:
    torch.set_num_threads(1)
    flags = {
        name: bool(getattr(torch.cpu, f"_is_{name}_supported", lambda: False)())
        for name in ("amx_tile", "avx512_bf16", "avx512")
    }
    print(
        f"\n{cpu_model()}; {', '.join(k for k, v in flags.items() if v) or 'none of amx/avx512'}; "
        f"fast_bf16: {fast_bf16('cpu')}; torch {torch.__version__}\n"
    )
    print("| in → out | rows | float32 ms | bfloat16 ms | bf16 speed-up |")
    print("|---|---|---|---|---|")
    for k, n in SHAPES:
        for rows in ROWS:
            runs = {}
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator().manual_seed(0)
                w = torch.randn(n, k, generator=g).to(dtype)
                x = torch.randn(rows, k, generator=g).to(dtype)
                runs[dtype] = linear_ms(x, w)
            # the two dtypes timed in turn, round after round (a noisy machine drifts between them)
            ms = {dtype: t / CALLS for dtype, t in interleaved_median_ms(runs, repeats=15, warmup=1).items()}
            fp32, bf16 = ms[torch.float32], ms[torch.bfloat16]
            print(f"| {k} → {n} | {rows} | {fp32:.3f} | {bf16:.3f} | {fp32 / bf16:.2f}× |")


if __name__ == "__main__":
    main()
