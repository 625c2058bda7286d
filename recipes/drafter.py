"""Distil the Speculative-Streaming draft from a frozen target.

    accelerate launch recipes/drafter.py --config recipes/configs/drafter_smollm2.yaml [key=value ...]

setup (config, target, the data and feature caches, shared with the proxy head's, the draft: init, reduced
vocabulary, freezing or LoRA) → loop (KL to the target's top-k on the main stream, CE on the target's later
choices on the lookahead streams, the training-time-test steps, held-out agreement, checkpoints; resumes from the
newest checkpoint in output_dir) → export (a self-describing artifact in output_dir/export that
`AutoModelForCausalLM` and `load_draft` load, with a datastore of the target's own answers beside it).
"""

from mirror_train.config import config_to_dict
from mirror_train.data.pipeline import prepare_data
from mirror_train.data.samplers import WindowSampler
from mirror_train.drafter_training import (
    DrafterRunConfig,
    build_datastore,
    build_draft,
    data_layers,
    drafter_loss,
    evaluate_drafter,
    open_caches,
)
from mirror_train.models.draft_artifact import save_draft
from mirror_train.training import fit, recipe_entry, setup_run


def main(cfg: DrafterRunConfig) -> None:
    # --- setup: the target, the shared data (every rank answers its share; the main one the rest), the draft ---
    accelerator, out, target = setup_run(
        cfg, lambda target, *ranks: prepare_data(cfg.data, target, data_layers(cfg, target)[1], *ranks)
    )
    train, heldout = open_caches(cfg, target)
    sampler = WindowSampler(train, cfg.train.batch_size, cfg.train.seed, cfg.train.window, cfg.data.answer_repeat)
    model = build_draft(cfg.model, target, train)

    # --- loop ----------------------------------------------------------------------------------------------------
    inner, step = fit(
        accelerator,
        model,
        sampler,
        cfg,
        out,
        loss_fn=lambda m, batch: drafter_loss(m, batch, cfg.train),
        evaluate_fn=lambda m: evaluate_drafter(m, heldout),
        heldout=heldout,
        desc="draft",
    )

    # --- export --------------------------------------------------------------------------------------------------
    if accelerator.is_main_process:
        metrics = evaluate_drafter(inner, heldout)
        extra = {"steps": step, "run": config_to_dict(cfg)}
        path = save_draft(inner, out / "export", target, metrics, extra, datastore=build_datastore(cfg))
        accelerator.print(
            f"exported {path}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "positions")
        )
    accelerator.end_training()


if __name__ == "__main__":
    recipe_entry(DrafterRunConfig, main, __doc__)
