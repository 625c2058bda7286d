"""Distil the Speculative-Streaming draft from a frozen target.

    accelerate launch recipes/drafter.py --config recipes/configs/drafter_smollm2.yaml [key=value ...]

setup (config, target, the data and feature caches, shared with the proxy head's, the draft: init, reduced
vocabulary, freezing or LoRA) → loop (KL to the target's top-k on the main stream, CE on the target's later
choices on the lookahead streams, the training-time-test steps, held-out agreement, checkpoints; resumes from the
newest checkpoint in output_dir) → export (a self-describing artifact in output_dir/export that
`AutoModelForCausalLM` and `load_draft` load).
"""

import argparse
from pathlib import Path

import torch

from mirror_train.config import config_to_dict, load_config, parse_overrides, save_config
from mirror_train.data.pipeline import prepare_data
from mirror_train.data.samplers import WindowSampler
from mirror_train.drafter_training import (
    DrafterRunConfig,
    build_draft,
    data_layers,
    drafter_loss,
    evaluate_drafter,
    open_caches,
)
from mirror_train.errors import MirrorTrainError
from mirror_train.models.draft_artifact import save_draft
from mirror_train.target import Target
from mirror_train.training import (
    make_accelerator,
    start_run,
    train_loop,
    trainable_parameters,
)


def main(cfg: DrafterRunConfig) -> None:
    out = Path(cfg.output_dir)
    accelerator = make_accelerator(out, cfg.log, config_to_dict(cfg), cfg.train.mixed_precision)

    # --- setup: the target, the shared data (main process builds; the others wait), the draft --------------------
    target = Target.load(cfg.target, device=accelerator.device)  # the data stages run where training does
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
        prepare_data(cfg.data, target, data_layers(cfg, target)[1])
    accelerator.wait_for_everyone()
    train, heldout = open_caches(cfg, target)
    sampler = WindowSampler(train, cfg.train.batch_size, cfg.train.seed, cfg.train.window, cfg.data.answer_repeat)

    torch.manual_seed(cfg.train.seed)  # here, not earlier: data generation (when it runs) draws random numbers too
    model = build_draft(cfg.model, target, train)
    trainable = sum(p.numel() for p in trainable_parameters(model))
    model, optimizer, checkpoints, step, budget = start_run(
        accelerator, model, out, cfg.train, cfg.optim, sampler.steps_per_epoch
    )
    accelerator.print(
        f"{train.meta['positions']} cached positions, {sampler.steps_per_epoch} steps an epoch, "
        f"{budget.total_steps} steps of ≤{cfg.train.batch_size} positions; {trainable:,} trainable parameters; "
        f"held-out answer positions: {len(heldout.positions(answers_only=True))}"
    )

    # --- loop ----------------------------------------------------------------------------------------------------
    inner = accelerator.unwrap_model(model)
    step = train_loop(
        accelerator,
        model,
        optimizer,
        sampler,
        loss_fn=lambda m, batch: drafter_loss(m, batch, cfg.train),
        evaluate_fn=lambda: evaluate_drafter(inner, heldout),
        budget=budget,
        checkpoints=checkpoints,
        step=step,
        optim=cfg.optim,
        log_every=cfg.log.every,
        eval_every=cfg.train.eval_every,
        save_every=cfg.train.save_every,
        desc="draft",
    )

    # --- export --------------------------------------------------------------------------------------------------
    if accelerator.is_main_process:
        metrics = evaluate_drafter(inner, heldout)
        path = save_draft(inner, out / "export", target, metrics, extra={"steps": step, "run": config_to_dict(cfg)})
        accelerator.print(
            f"exported {path}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "positions")
        )
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    args, rest = parser.parse_known_args()
    try:
        main(load_config(DrafterRunConfig, args.config, parse_overrides(rest)))
    except MirrorTrainError as e:
        raise SystemExit(f"error: {e}") from None
