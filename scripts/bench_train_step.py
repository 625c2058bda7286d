"""Where a draft training step's time goes, on a config's real data: the padding a padded batch would carry, the
forward / backward / optimizer time of the recipe's step, and (`--profile`) the top operators.

    python scripts/bench_train_step.py --config recipes/configs/drafter_smollm2.yaml [key=value ...]

The data must exist (run the recipe once, or `train.max_minutes=0.1`): this script builds nothing. It times the
recipe's own `drafter_loss` under bf16 autocast as `train.mixed_precision` asks, with AdamW, on the first batches of
epoch 0, after `--warmup` steps. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mirror_train.config import load_config, parse_overrides
from mirror_train.data.samplers import WindowSampler
from mirror_train.drafter_training import DrafterRunConfig, build_draft, drafter_loss, open_caches
from mirror_train.target import Target
from mirror_train.training import trainable_parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="recipes/configs/drafter_smollm2.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's top operators")
    args, rest = parser.parse_known_args()
    cfg = load_config(DrafterRunConfig, args.config, parse_overrides(rest))

    target = Target.load(cfg.target)
    train, _ = open_caches(cfg, target)
    sampler = WindowSampler(train, cfg.train.batch_size, cfg.train.seed, cfg.train.window, cfg.data.answer_repeat)
    batches = [sampler.batch(s) for s in range(min(sampler.steps_per_epoch, 2000))]
    real = sum(int(b["mask"].sum()) for b in batches)
    slots = sum(b["mask"].numel() for b in batches)

    torch.manual_seed(cfg.train.seed)
    model = build_draft(cfg.model, target, train).train()
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.optim.lr)
    autocast = cfg.train.mixed_precision == "bf16"

    def step(batch) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = drafter_loss(model, batch, cfg.train)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for b in batches[: args.warmup]:
        step(b)
    times = np.array([step(b) for b in batches[args.warmup : args.warmup + args.steps]]) * 1000
    fwd, bwd, opt = times.mean(0)
    print("| batches | real positions / padded slots | threads | forward | backward | optimizer | step |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {len(batches)} (epoch 0) | {real:,} / {slots:,} = {real / slots:.3f} | {torch.get_num_threads()} | "
        f"{fwd:.1f} ms | {bwd:.1f} ms | {opt:.1f} ms | {times.sum(1).mean():.1f} ms |"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for b in batches[args.warmup : args.warmup + 5]:
                step(b)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
