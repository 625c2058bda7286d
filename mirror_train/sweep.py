"""`sweep-exit`: how well the untrained logit lens at every layer predicts the target's final distribution.

The target first answers the prompts greedily (its own text, as in decoding); then one forward over prompt + answer
gives every layer's hidden state, and the logit lens (final norm + LM head) at layer ℓ is scored against the final
logits at the answer positions. The oracle row is the final distribution scored against itself: the ceiling.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mirror_train.errors import MirrorTrainError
from mirror_train.generation import encode_chat, generate_batch
from mirror_train.metrics import check_kappa, exit_report, merge_reports
from mirror_train.prompts import load_prompts
from mirror_train.target import Target


@dataclass
class SweepConfig:
    model: str = "testbed"  # testbed, a local HF directory or a Hub id
    device: str = "auto"  # where the model runs: auto (CUDA when present, else the CPU), cpu, cuda, cuda:N or mps
    prompts: str | None = None  # JSONL; default: the shared training prompts
    num_prompts: int = 32  # a seeded sample of the prompts, answered by the model itself
    max_new_tokens: int = 96  # per answer
    batch_size: int = 64  # prompts generated at once (long prompts get smaller batches)
    layers: str = "all"  # "all" (1..N-1) or a comma list such as "6,10,15"
    kappas: str = "1,4,8"  # the κ of Ω_κ and hit_κ, comma-separated
    seed: int = 0  # of the prompt sample
    out: str | None = None  # JSON path for the results


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MirrorTrainError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def answer_positions(prompt_len: int, answer_len: int) -> slice:
    """Positions whose next token is an answer token: the prompt's last position through the answer's second-last."""
    return slice(prompt_len - 1, prompt_len + answer_len - 1)


def run_sweep(cfg: SweepConfig, target: Target | None = None) -> dict:
    kappas = [check_kappa(k) for k in parse_int_list(cfg.kappas, "kappas")]
    prompts = load_prompts(cfg.prompts, limit=cfg.num_prompts, seed=cfg.seed)
    target = target or Target.load(cfg.model, device=cfg.device)
    n = target.num_layers
    layers = list(range(1, n)) if cfg.layers == "all" else parse_int_list(cfg.layers, "layers")
    for layer in layers:
        target.check_exit_layer(layer)

    started = time.perf_counter()
    encoded = [encode_chat(target.tokenizer, p.messages()) for p in prompts]
    answers = generate_batch(target.model, target.tokenizer, encoded, cfg.max_new_tokens, cfg.batch_size, seed=cfg.seed)
    generation_s = time.perf_counter() - started

    per_layer: dict[int, list[dict]] = {layer: [] for layer in layers}
    oracle: list[dict] = []
    for prompt_ids, answer in tqdm(list(zip(encoded, answers)), desc="scoring", unit="prompt"):
        if not answer:
            continue
        ids = torch.tensor([prompt_ids + answer], device=target.device)
        hidden, logits = target.hidden_states(ids)
        span = answer_positions(len(prompt_ids), len(answer))
        final = logits[0, span]
        oracle.append(exit_report(final, final, kappas))
        for layer in layers:
            lens = target.lens_logits(hidden[layer][0, span])
            per_layer[layer].append(exit_report(lens, final, kappas))
    if not oracle:
        raise MirrorTrainError("the target produced no answer tokens for any prompt")
    return {
        "config": asdict(cfg),
        "target": {"name": target.name_or_path, "num_layers": n},
        "prompts": len(prompts),
        "answer_tokens": sum(len(a) for a in answers),
        "generation_seconds": round(generation_s, 1),
        "kappas": kappas,
        "layers": {str(layer): merge_reports(per_layer[layer]) for layer in layers},
        "oracle": merge_reports(oracle),
    }


def format_table(result: dict) -> str:
    kappas = result["kappas"]
    head = ["ℓ"] + [f"{m}_{k}" for k in kappas for m in ("Ω", "hit")] + ["KL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(layer, r) for layer, r in result["layers"].items()] + [("oracle", result["oracle"])]
    for name, r in rows:
        is_oracle = name == "oracle"  # the final distribution scored against itself: its hit is 1 by definition
        cells = [str(name)]
        for k in kappas:
            cells.append(f"{r[f'oracle_omega_{k}' if is_oracle else f'omega_{k}']:.3f}")
            cells.append("1.000" if is_oracle else f"{r[f'hit_{k}']:.3f}")
        cells.append("–" if is_oracle else f"{r['kl']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(result: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path
