"""Distil the Speculative-Streaming draft from a frozen target.

    accelerate launch recipes/drafter.py --config recipes/configs/drafter_smollm2.yaml [key=value ...]

setup (config, target, the proxy head's data and feature caches, the draft: init, reduced vocabulary, freezing or
LoRA) → loop (KL to the target's top-k on the main stream, CE on the target's later choices on the lookahead
streams, held-out agreement, checkpoints; resumes from the newest checkpoint in output_dir) → export (a
self-describing artifact in output_dir/export that `AutoModelForCausalLM` and `load_draft` load).
"""

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mirror_train.config import config_to_dict, load_config, parse_overrides, save_config
from mirror_train.drafter_training import (
    DrafterRunConfig,
    build_draft,
    data_view,
    drafter_loss,
    evaluate_drafter,
    open_caches,
    save_draft,
)
from mirror_train.errors import MirrorTrainError
from mirror_train.proxy_training import WindowSampler, prepare_data
from mirror_train.target import Target
from mirror_train.training import (
    Budget,
    Checkpoints,
    all_agree,
    cosine_lr,
    make_accelerator,
    set_deepspeed_batch,
    set_lr,
    trainable_parameters,
)


def main(cfg: DrafterRunConfig) -> None:
    out = Path(cfg.output_dir)
    accelerator = make_accelerator(out, cfg.log, config_to_dict(cfg))

    # --- setup: the target, the shared data (main process builds; the others wait), the draft --------------------
    target = Target.load(cfg.target)
    data = data_view(cfg, target)
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
        prepare_data(data, target)
    accelerator.wait_for_everyone()
    train, heldout = open_caches(data)
    sampler = WindowSampler(train, cfg.train.batch_size, cfg.train.seed, cfg.train.window)

    torch.manual_seed(cfg.train.seed)  # here, not earlier: data generation (when it runs) draws random numbers too
    model = build_draft(cfg.model, target, train)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    total = cfg.train.max_steps or int(cfg.train.epochs * sampler.steps_per_epoch)
    set_deepspeed_batch(accelerator, cfg.train.batch_size)
    model, optimizer = accelerator.prepare(model, optimizer)
    checkpoints = Checkpoints(out, keep=cfg.train.keep_checkpoints)
    resumed = checkpoints.resume(accelerator)
    step = resumed["step"]
    budget = Budget(total, cfg.train.max_minutes, resumed.get("minutes", 0.0))
    accelerator.print(
        f"{train.meta['positions']} cached positions, {sampler.steps_per_epoch} steps an epoch, {total} steps of "
        f"≤{cfg.train.batch_size} positions; {sum(p.numel() for p in params):,} trainable parameters; held-out "
        f"answer positions: {len(heldout.positions(answers_only=True))}"
    )

    # --- loop ----------------------------------------------------------------------------------------------------
    inner = accelerator.unwrap_model(model)
    bar = tqdm(total=total, initial=step, desc="draft", disable=not accelerator.is_local_main_process)
    finished = budget.done(step)
    while not finished:
        lr = cfg.optim.lr * cosine_lr(step, budget.progress(step), cfg.optim)
        set_lr(optimizer, lr)
        batch = sampler.batch(step, accelerator.process_index, accelerator.num_processes)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        loss, parts = drafter_loss(model, batch, cfg.train)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        bar.update(1)
        if step % cfg.log.every == 0:
            accelerator.log({f"train/{k}": v for k, v in parts.items()} | {"lr": lr}, step=step)
        finished = all_agree(accelerator, budget.done(step))  # time budgets: every rank stops at the same step
        if step % cfg.train.eval_every == 0 and not finished:
            metrics = evaluate_drafter(inner, heldout)
            accelerator.log({f"heldout/{k}": v for k, v in metrics.items()}, step=step)
            bar.set_postfix(top1=f"{metrics['top1']:.3f}", loss=f"{parts['loss']:.3f}")
        if step % cfg.train.save_every == 0 or finished:
            checkpoints.save(accelerator, step, {"minutes": budget.minutes()})
    bar.close()

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
