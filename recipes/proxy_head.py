"""Distil an early-exit proxy head for a frozen target.

    accelerate launch recipes/proxy_head.py --config recipes/configs/proxy_head_smollm2.yaml [key=value ...]

setup (config, target, data and feature caches) → loop (KL to the target's top-k, held-out Ω/hit, checkpoints;
resumes from the newest checkpoint in output_dir) → export (a self-describing artifact in output_dir/export).
"""

from mirror_train.data.pipeline import open_caches, prepare_data
from mirror_train.data.samplers import PositionSampler, WindowSampler, training_positions
from mirror_train.models.proxy_head import ProxyHead, save_proxy_head
from mirror_train.proxy_training import ProxyRunConfig, data_layers, evaluate, proxy_loss
from mirror_train.training import fit, recipe_entry, setup_run
from mirror_train.vocab import token_ranking

RANKING_LIMIT = 32768  # candidate ids by frequency stored with the head; the engine serves a prefix of them


def main(cfg: ProxyRunConfig) -> None:
    # --- setup: the target, its data (every rank answers its share; the main one makes the rest), the head ------
    accelerator, out, target = setup_run(
        cfg, lambda target, *ranks: prepare_data(cfg.data, target, data_layers(cfg, target), *ranks)
    )
    train, heldout = open_caches(cfg.data, data_layers(cfg, target), cfg.head.exit_layer)
    if cfg.head.kind == "attention":
        sampler = WindowSampler(train, cfg.train.batch_size, cfg.train.seed, cfg.train.window, cfg.data.answer_repeat)
    else:
        positions = training_positions(train, cfg.data.train_on, cfg.data.answer_repeat)
        sampler = PositionSampler(train, positions, cfg.train.batch_size, cfg.train.seed)
    head = ProxyHead(cfg.head, target.hidden_size).bind(target)

    # --- loop ----------------------------------------------------------------------------------------------------
    inner, step = fit(
        accelerator,
        head,
        sampler,
        cfg,
        out,
        loss_fn=lambda model, batch: proxy_loss(model, batch, cfg.train, cfg.head.kappa),
        evaluate_fn=lambda model: evaluate(model, heldout),
        heldout=heldout,
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
    recipe_entry(ProxyRunConfig, main, __doc__)
