"""Distil an early-exit proxy head for a frozen target.

    accelerate launch recipes/proxy_head.py --config recipes/configs/proxy_head_smollm2.yaml [key=value ...]

setup (config, target, data and feature caches) → loop (KL to the target's top-k, held-out Ω/hit, checkpoints;
resumes from the newest checkpoint in output_dir) → export (a self-describing artifact in output_dir/export).
"""

import argparse
from pathlib import Path

import torch

from mirror_train.config import config_to_dict, load_config, parse_overrides, save_config
from mirror_train.data.pipeline import cached_layers, open_caches, prepare_data
from mirror_train.data.samplers import PositionSampler, WindowSampler, training_positions
from mirror_train.errors import MirrorTrainError
from mirror_train.models.proxy_head import ProxyHead, save_proxy_head
from mirror_train.proxy_training import ProxyRunConfig, evaluate, proxy_loss
from mirror_train.target import Target
from mirror_train.training import (
    make_accelerator,
    start_run,
    train_loop,
)
from mirror_train.vocab import token_ranking

RANKING_LIMIT = 32768  # candidate ids by frequency stored with the head; the engine serves a prefix of them


def main(cfg: ProxyRunConfig) -> None:
    out = Path(cfg.output_dir)
    accelerator = make_accelerator(out, cfg.log, config_to_dict(cfg), cfg.train.mixed_precision)

    # --- setup: the target, its data (main process builds; the others wait), the head -------------------------
    target = Target.load(cfg.target, device=accelerator.device)  # the data stages run where training does
    layers = cached_layers(cfg.data, [target.check_exit_layer(cfg.head.exit_layer)])
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
        prepare_data(cfg.data, target, layers)
    accelerator.wait_for_everyone()
    train, heldout = open_caches(cfg.data, layers, cfg.head.exit_layer)
    if cfg.head.kind == "attention":
        sampler = WindowSampler(train, cfg.train.batch_size, cfg.train.seed, cfg.train.window, cfg.data.answer_repeat)
    else:
        positions = training_positions(train, cfg.data.train_on, cfg.data.answer_repeat)
        sampler = PositionSampler(train, positions, cfg.train.batch_size, cfg.train.seed)

    torch.manual_seed(cfg.train.seed)  # here, not earlier: data generation (when it runs) draws random numbers too
    head = ProxyHead(cfg.head, target.hidden_size).bind(target)
    head, optimizer, checkpoints, step, budget = start_run(
        accelerator, head, out, cfg.train, cfg.optim, sampler.steps_per_epoch
    )
    accelerator.print(
        f"{train.meta['positions']} cached positions, {sampler.steps_per_epoch} steps an epoch, "
        f"{budget.total_steps} steps of ≤{cfg.train.batch_size} positions; "
        f"held-out answer positions: {len(heldout.positions(answers_only=True))}"
    )

    # --- loop ----------------------------------------------------------------------------------------------------
    inner = accelerator.unwrap_model(head)
    step = train_loop(
        accelerator,
        head,
        optimizer,
        sampler,
        loss_fn=lambda model, batch: proxy_loss(model, batch, cfg.train, cfg.head.kappa),
        evaluate_fn=lambda: evaluate(inner, heldout),
        budget=budget,
        checkpoints=checkpoints,
        step=step,
        optim=cfg.optim,
        log_every=cfg.log.every,
        eval_every=cfg.train.eval_every,
        save_every=cfg.train.save_every,
        desc="proxy head",
    )

    # --- export --------------------------------------------------------------------------------------------------
    if accelerator.is_main_process:
        metrics = evaluate(inner, heldout)
        table = "| metric | held-out |\n|---|---|\n" + "\n".join(
            f"| {k} | {v:.4f} |" for k, v in metrics.items() if k != "positions"
        )
        seen = [ids for ids in (train.token_ids, train.topk_ids[:, 0]) if ids is not None]
        inner.ranking = token_ranking(seen, target.vocab_size, limit=RANKING_LIMIT)
        path = save_proxy_head(inner, out / "export", target, results_markdown=table, extra={"steps": step})
        accelerator.print(
            f"exported {path}: " + ", ".join(f"{k}={metrics[k]:.3f}" for k in ("hit_1", "hit_4", "omega_4"))
        )
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    args, rest = parser.parse_known_args()
    try:
        main(load_config(ProxyRunConfig, args.config, parse_overrides(rest)))
    except MirrorTrainError as e:
        raise SystemExit(f"error: {e}") from None
