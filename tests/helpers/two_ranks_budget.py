"""Launched on two CPU ranks by tests/test_training.py: rank 1's time budget runs out at step 3, rank 0's at 50.

Both ranks must stop at step 3 (a rank that stopped alone would leave the other waiting in a collective forever)
and the final checkpoint must be written once, for that step. Prints "rank R stopped at step S".
"""

import sys

import torch
from accelerate import Accelerator

from mirror_train.training import Budget, Checkpoints, OptimConfig, train_loop


class RankBudget(Budget):
    def __init__(self, out_at: int):
        super().__init__(total_steps=1000, max_minutes=None)
        self.out_at = out_at

    def done(self, step: int) -> bool:  # as if this rank's clock said the minutes were spent
        return step >= self.out_at


class Batches:
    def batch(self, step, rank, world):
        g = torch.Generator().manual_seed(step * world + rank)
        return {"x": torch.randn(4, 3, generator=g)}


def main(out_dir: str) -> None:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    step = train_loop(
        accelerator,
        model,
        optimizer,
        Batches(),
        loss_fn=lambda m, b: (m(b["x"]).pow(2).mean(), {}),
        evaluate_fn=dict,
        budget=RankBudget(3 if accelerator.process_index == 1 else 50),  # 50: a cap, so a failure cannot hang
        checkpoints=Checkpoints(out_dir),
        step=0,
        optim=OptimConfig(warmup_steps=0),
        log_every=1000,
        eval_every=1000,
        save_every=1000,
        desc="two ranks",
    )
    # one write for the whole line: under PYTHONUNBUFFERED print writes the text and its newline apart, and the two
    # ranks' lines, sharing one pipe, came out as "rank 0 stopped at step 3rank 1 stopped at step 3"
    sys.stdout.write(f"rank {accelerator.process_index} stopped at step {step}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
