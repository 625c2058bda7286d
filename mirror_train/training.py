"""What both recipes share: checkpoints that survive a kill, step-determined batches, trackers, LR schedule.

Resuming loses and repeats nothing because the batch at step s is a pure function of (seed, s): the epoch is
s // steps_per_epoch and its permutation is drawn from seed + epoch. A checkpoint holds the step it was taken
after (with accelerate's model, optimizer, scheduler and RNG states); the loop continues at the next step.
Checkpoints are written into a temporary directory and renamed into place, so a kill mid-save leaves the previous
one intact.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mirror_train.config import config_to_dict, load_config, parse_overrides, save_config
from mirror_train.devices import fast_bf16
from mirror_train.errors import MirrorTrainError
from mirror_train.target import Target

log = logging.getLogger(__name__)

_CKPT_PREFIX = "step_"
MIXED_PRECISION = (None, "auto", "no", "bf16", "fp16")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr
    grad_clip: float = 1.0

    def validate(self) -> None:
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise MirrorTrainError("optim: lr > 0, weight_decay ≥ 0, warmup_steps ≥ 0, 0 ≤ min_lr_ratio ≤ 1")


@dataclass
class LogConfig:
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # also "wandb" (WANDB_MODE=offline works)
    project: str = "mirror-train"
    every: int = 10  # steps between logged training losses

    def validate(self) -> None:
        unknown = set(self.report_to) - {"tensorboard", "wandb", "all", "none"}
        if unknown:
            raise MirrorTrainError(f"log.report_to: unknown tracker(s) {sorted(unknown)}; use tensorboard, wandb")


@dataclass
class TrainConfig:
    """The `train:` settings both recipes share (each recipe's config adds its loss's own)."""

    batch_size: int = 512  # positions per step (global)
    epochs: float = 3.0
    max_steps: int | None = None  # overrides epochs
    max_minutes: float | None = None  # stop (checkpoint + export) after this much training time
    window: int = 1024  # longest context window a training sequence is cut into (models that read context)
    eval_every: int = 200
    save_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    # "bf16" autocasts the forward (AMX on recent Xeons, tensor cores on GPUs; a frozen LM head is cast once);
    # "auto": bf16 where bf16 matmuls are fast (CUDA, CPUs with AMX or AVX-512 BF16; devices.fast_bf16), else none;
    # unset: whatever `accelerate launch` says. Losses and held-out metrics stay in fp32.
    mixed_precision: str | None = "auto"

    def validate(self) -> None:
        if self.batch_size < 1 or self.epochs <= 0 or self.window < 1 or self.eval_every < 1 or self.save_every < 1:
            raise MirrorTrainError("train: batch_size, window, eval_every, save_every ≥ 1 and epochs > 0")
        bad_steps = self.max_steps is not None and self.max_steps < 1
        if bad_steps or (self.max_minutes is not None and self.max_minutes <= 0):
            raise MirrorTrainError("train: max_steps ≥ 1 and max_minutes > 0 when set")
        if self.mixed_precision not in MIXED_PRECISION:
            raise MirrorTrainError(
                f"train.mixed_precision: expected one of auto, no, bf16, fp16 (or unset), got {self.mixed_precision!r}"
            )

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.max_steps or max(int(self.epochs * steps_per_epoch), 1)


def cosine_lr(step: int, progress: float, cfg: OptimConfig) -> float:
    """Linear warm-up over the first steps, then cosine decay to min_lr_ratio·lr as `progress` goes 0 → 1;
    a multiplier of lr."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Budget:
    """How far a run is: the larger of steps done / total steps and minutes spent / max_minutes.

    With a time budget the learning rate still decays fully and the run stops on time, whatever the machine's
    speed (such runs are not bit-reproducible on resume; step-budgeted ones are). Minutes already spent before a
    resume are carried in the checkpoint.
    """

    def __init__(self, total_steps: int, max_minutes: float | None, minutes_before: float = 0.0):
        self.total_steps, self.max_minutes, self.minutes_before = total_steps, max_minutes, minutes_before
        self.started = time.perf_counter()

    def minutes(self) -> float:
        return self.minutes_before + (time.perf_counter() - self.started) / 60

    def progress(self, step: int) -> float:
        by_time = self.minutes() / self.max_minutes if self.max_minutes else 0.0
        return max(step / max(self.total_steps, 1), by_time)

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


def all_agree(accelerator, flag: bool) -> bool:
    """True on every rank once any rank says so (ranks may read the clock differently)."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), reduction="max").item())


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class Checkpoints:
    """`output_dir/checkpoints/step_N/`: accelerate state + `trainer_state.json`; the newest `keep` are kept."""

    def __init__(self, output_dir: str | os.PathLike, keep: int = 2):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep

    def latest(self) -> Path | None:
        done = [p for p in self.root.glob(f"{_CKPT_PREFIX}*") if (p / "trainer_state.json").exists()]
        return max(done, key=lambda p: int(p.name[len(_CKPT_PREFIX) :]), default=None)

    def save(self, accelerator, step: int, extra: dict | None = None) -> Path:
        final = self.root / f"{_CKPT_PREFIX}{step}"
        tmp = self.root / f".tmp_{_CKPT_PREFIX}{step}"
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))  # every rank writes its RNG state; the main rank the rest
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(extra or {})}, indent=2))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(self.root.glob(f"{_CKPT_PREFIX}*"), key=lambda p: int(p.name[len(_CKPT_PREFIX) :]))[
                : -self.keep
            ]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final

    def resume(self, accelerator) -> dict:
        """Load the newest checkpoint if there is one; return its trainer state ({"step": 0} if none)."""
        latest = self.latest()
        if latest is None:
            return {"step": 0}
        accelerator.load_state(str(latest))
        log.info("resumed from %s", latest)
        return json.loads((latest / "trainer_state.json").read_text())


def make_accelerator(
    output_dir: str | os.PathLike, log_cfg: LogConfig, run_config: dict, mixed_precision: str | None = None
):
    """An Accelerator with the configured trackers, initialised with the resolved run config.

    `mixed_precision` None leaves it to `accelerate launch` (its flag or config file); a value overrides that;
    "auto" is bf16 where bf16 matmuls are fast on the device accelerate picks, else none."""
    from accelerate import Accelerator

    if mixed_precision == "auto" and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        mixed_precision = None  # DeepSpeed casts the model itself, as its config file says
    elif mixed_precision == "auto":
        mixed_precision = "bf16" if fast_bf16("cuda" if torch.cuda.is_available() else "cpu") else "no"

    report = [r for r in log_cfg.report_to if r != "none"]
    if "wandb" in report or "all" in report:
        os.environ.setdefault("WANDB_DIR", str(Path(output_dir)))
    accelerator = Accelerator(log_with=report or None, project_dir=str(output_dir), mixed_precision=mixed_precision)
    if accelerator.device.type == "cpu":
        # `accelerate launch` sets OMP_NUM_THREADS=1 even for one process, which halves a 2-core machine's speed:
        # give each process its share of the cores instead.
        torch.set_num_threads(max(len(os.sched_getaffinity(0)) // accelerator.num_processes, 1))
    if report:
        accelerator.init_trackers(log_cfg.project, config=_flatten(run_config))
    return accelerator


def set_deepspeed_batch(accelerator, global_batch: int) -> None:
    """DeepSpeed wants a micro-batch size and our batches come from `batch_indices`, not a DataLoader."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        micro = max(global_batch // accelerator.num_processes, 1)
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro
        plugin.deepspeed_config["train_batch_size"] = micro * accelerator.num_processes


def _flatten(d: dict, prefix: str = "") -> dict:
    """Trackers (tensorboard's hparams) want flat scalar configs."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise MirrorTrainError("nothing to train: the model has no trainable parameters (the logit lens has none)")
    return params


def start_run(accelerator, model, output_dir, train: TrainConfig, optim: OptimConfig, steps_per_epoch: int):
    """AdamW over the model's trainable parameters, both prepared for the launch configuration, resumed from the
    newest checkpoint. Returns (model, optimizer, checkpoints, step to continue from, budget)."""
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=optim.lr, weight_decay=optim.weight_decay)
    set_deepspeed_batch(accelerator, train.batch_size)
    model, optimizer = accelerator.prepare(model, optimizer)
    checkpoints = Checkpoints(output_dir, keep=train.keep_checkpoints)
    resumed = checkpoints.resume(accelerator)
    budget = Budget(train.total_steps(steps_per_epoch), train.max_minutes, resumed.get("minutes", 0.0))
    return model, optimizer, checkpoints, resumed["step"], budget


def train_loop(
    accelerator,
    model,
    optimizer,
    sampler,
    *,
    loss_fn,
    evaluate_fn,
    budget: Budget,
    checkpoints: Checkpoints,
    step: int,
    optim: OptimConfig,
    log_every: int,
    eval_every: int,
    save_every: int,
    desc: str,
) -> int:
    """The loop both recipes run: LR from the budget, a step-determined batch, backward, clip, step, log,
    held-out evaluation every `eval_every` steps, checkpoints every `save_every` and at the end. Returns the last step.

    `loss_fn(model, batch) -> (loss, parts)` (parts: detached scalar tensors, read at the logging interval only:
    reading one waits for the device); `evaluate_fn() -> metrics` (on the main process's unwrapped model).
    """
    from tqdm.auto import tqdm

    bar = tqdm(total=budget.total_steps, initial=step, desc=desc, disable=not accelerator.is_local_main_process)
    finished = budget.done(step)
    while not finished:
        lr = optim.lr * cosine_lr(step, budget.progress(step), optim)
        set_lr(optimizer, lr)
        batch = sampler.batch(step, accelerator.process_index, accelerator.num_processes)
        loss, parts = loss_fn(model, {k: v.to(accelerator.device) for k, v in batch.items()})
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        bar.update(1)
        if step % log_every == 0:
            # parts are tensors until here: reading one waits for the device, so only at the logging interval
            accelerator.log({f"train/{k}": float(v) for k, v in parts.items()} | {"lr": lr}, step=step)
        finished = all_agree(accelerator, budget.done(step))  # time budgets: every rank stops at the same step
        if step % eval_every == 0 and not finished:
            metrics = evaluate_fn()
            accelerator.log({f"heldout/{k}": v for k, v in metrics.items()}, step=step)
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k in ("hit_4", "omega_4", "top1")})
            if accelerator.is_main_process:  # a line per evaluation: the log is the run's curve (bench scripts read it)
                shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float))
                bar.write(f"eval step {step} ({budget.minutes():.2f} min): {shown}")
        if step % save_every == 0 or finished:
            checkpoints.save(accelerator, step, {"minutes": budget.minutes()})
    bar.close()
    return step


# --- the scaffold both recipes share -------------------------------------------------------------------------------
def setup_run(cfg, prepare_data_fn):
    """The recipes' start: an Accelerator (trackers, precision), the target loaded where training runs, the resolved
    config saved, the data made (`prepare_data_fn(target, rank, world, barrier)`, resumable: every rank answers its
    share of the prompts, the main rank makes the rest while the others wait), and the RNG seeded after it (data
    generation draws random numbers too). Returns (accelerator, out, target)."""
    out = Path(cfg.output_dir)
    accelerator = make_accelerator(out, cfg.log, config_to_dict(cfg), cfg.train.mixed_precision)
    target = Target.load(cfg.target, device=accelerator.device)  # the data stages run where training does
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
    prepare_data_fn(target, accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone)
    accelerator.wait_for_everyone()
    torch.manual_seed(cfg.train.seed)
    return accelerator, out, target


def fit(accelerator, model, sampler, cfg, out: Path, *, loss_fn, evaluate_fn, heldout, desc: str):
    """Prepare `model` (AdamW, the launch configuration, the newest checkpoint), say what the run will do, and train
    it (`train_loop`); `evaluate_fn(inner)` scores the unwrapped model. Returns (the unwrapped model, last step)."""
    trainable = sum(p.numel() for p in trainable_parameters(model))
    model, optimizer, checkpoints, step, budget = start_run(
        accelerator, model, out, cfg.train, cfg.optim, sampler.steps_per_epoch
    )
    accelerator.print(
        f"{sampler.cache.meta['positions']} cached positions, {sampler.steps_per_epoch} steps an epoch, "
        f"{budget.total_steps} steps of ≤{cfg.train.batch_size} positions; {trainable:,} trainable parameters; "
        f"held-out answer positions: {len(heldout.positions(answers_only=True))}"
    )
    inner = accelerator.unwrap_model(model)
    step = train_loop(
        accelerator,
        model,
        optimizer,
        sampler,
        loss_fn=loss_fn,
        evaluate_fn=lambda: evaluate_fn(inner),
        budget=budget,
        checkpoints=checkpoints,
        step=step,
        optim=cfg.optim,
        log_every=cfg.log.every,
        eval_every=cfg.train.eval_every,
        save_every=cfg.train.save_every,
        desc=desc,
    )
    return inner, step


def recipe_entry(config_cls, main, doc: str) -> None:
    """`recipe.py --config FILE [key=value ...]`: the config loaded (overrides applied), `main(cfg)` run, a
    MirrorTrainError printed as one line."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a YAML run config (recipes/configs/)")
    args, rest = parser.parse_known_args()
    try:
        main(load_config(config_cls, args.config, parse_overrides(rest)))
    except MirrorTrainError as e:
        raise SystemExit(f"error: {e}") from None
