"""The early-exit proxy head: from the target's layer-ℓe state to a guess of its final next-token distribution.

Every kind reads only what the target has at ℓe and ends in the target's own frozen final norm + LM head, which
are borrowed from the target at bind time and never stored in the head's artifact:

    lens       logits = head(norm(h))                             no parameters: the paper's choice, our baseline
    residual   logits = head(norm(h + W h))                       W full (H×H) or low-rank (U Vᵀ, rank r); W starts at 0
    mlp        logits = head(norm(h + W₂ silu(W₁ rms(h))))         a residual MLP adapter; W₂ starts at 0
    lora_head  logits = (head + B A)(norm(h + W₂ silu(W₁ rms(h))))  the mlp adapter plus a LoRA on the LM head (peft)
    attention  logits = head(norm(blocks(h₁..h_t)))               decoder blocks of its own over the ℓe states of
                                                                  the whole context (copies of layers ℓe+1.., with
                                                                  their own KV cache), so it can attend and copy

Zero-initialised residual branches mean the per-position kinds start exactly at the logit lens; the attention kind
starts as the target's own layers ℓe+1..ℓe+n (better than the lens) and keeps a KV cache that the caller crops with
the target's (`new_cache`, `Target.crop`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from mirror_train import fused_head
from mirror_train.config import config_from_dict
from mirror_train.errors import MirrorTrainError
from mirror_train.export import CardText, load_artifact, save_artifact
from mirror_train.metrics import check_kappa
from mirror_train.target import check_exit_layer

KINDS = ("lens", "residual", "mlp", "lora_head", "attention")
OUTSIDE_LOGP = -30.0  # log-prob reported for a token outside a restricted candidate vocabulary (p ≈ 1e-13)


@dataclass
class ProxyHeadConfig:
    kind: Literal["lens", "residual", "mlp", "lora_head", "attention"] = "mlp"
    exit_layer: int = 15  # the testbed's N/2 (the paper's); its recipe config sets 12 (docs/proxy_head.md)
    kappa: int = 4  # candidates per position the engine sends (recorded; training's margin term uses it too)
    rank: int | None = None  # residual: None = full H×H
    mlp_hidden: int = 2304
    lora_rank: int = 16
    lora_alpha: float = 32.0
    attention_layers: int = 1  # attention: how many of the target's layers ℓe+1.. to copy and train

    def validate(self) -> None:
        check_kappa(self.kappa)
        if self.rank is not None and self.rank < 1:
            raise MirrorTrainError(f"rank must be ≥ 1 (or null for a full matrix), got {self.rank}")
        if self.mlp_hidden < 1 or self.lora_rank < 1 or self.attention_layers < 1:
            raise MirrorTrainError("mlp_hidden, lora_rank and attention_layers must be ≥ 1")


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _LMHead(nn.Module):
    """The target's LM head as a module peft can wrap (weights shared with the target, frozen)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.proj.weight = nn.Parameter(weight, requires_grad=False)
        self._cast: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if isinstance(self.proj, nn.Linear) and torch.is_autocast_enabled(device):
            # Under autocast the frozen (V, H) matrix would be re-cast at every call, which costs more than the
            # bf16 matmul saves on a CPU; it never changes, so cast it once. (peft's LoRA wrapper keeps its own path.)
            dtype = torch.get_autocast_dtype(device)
            if self._cast is None or self._cast.dtype != dtype or self._cast.device != x.device:
                self._cast = self.proj.weight.detach().to(dtype)
            return nn.functional.linear(x.to(dtype), self._cast)
        return self.proj(x)


class ProxyHead(nn.Module):
    def __init__(self, cfg: ProxyHeadConfig, hidden_size: int):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.hidden_size = hidden_size
        h = hidden_size
        if cfg.kind == "residual":
            if cfg.rank is None:
                self.w = nn.Linear(h, h, bias=False)
                nn.init.zeros_(self.w.weight)
            else:
                self.down = nn.Linear(h, cfg.rank, bias=False)
                self.up = nn.Linear(cfg.rank, h, bias=False)
                nn.init.zeros_(self.up.weight)
        elif cfg.kind in ("mlp", "lora_head"):
            self.pre_norm = _RMSNorm(h)
            self.fc1 = nn.Linear(h, cfg.mlp_hidden, bias=False)
            self.fc2 = nn.Linear(cfg.mlp_hidden, h, bias=False)
            nn.init.zeros_(self.fc2.weight)
        elif cfg.kind == "attention":
            self.blocks = nn.ModuleList()  # filled from the target's layers at bind time (they fix the layer class)
        elif cfg.kind != "lens":
            raise MirrorTrainError(f"unknown proxy head kind {cfg.kind!r}; choose one of {', '.join(KINDS)}")
        self._norm: nn.Module | None = None
        self._target = None
        self.vocab_ids = None  # set by `restrict`: the target ids the logits cover
        self.ranking: torch.Tensor | None = None  # target ids by training frequency, when the artifact has them
        self._head: nn.Module | None = None
        self._softcap = None

    # --- binding to the target's frozen final norm + LM head -----------------------------------------------------
    def bind(self, target) -> ProxyHead:
        """Attach the target's final norm and LM head (kept out of this module's parameters and state dict), and
        move this head's own parameters to their device."""
        if target.hidden_size != self.hidden_size:
            raise MirrorTrainError(
                f"proxy head expects hidden size {self.hidden_size}, the target has {target.hidden_size}"
            )
        target.check_exit_layer(self.cfg.exit_layer)
        object.__setattr__(self, "_norm", target.decoder.norm)
        object.__setattr__(self, "_target", target)
        if self.cfg.kind == "attention" and not len(self.blocks):
            first = self.cfg.exit_layer
            if first + self.cfg.attention_layers > target.num_layers:
                raise MirrorTrainError(
                    f"attention head: layers {first + 1}..{first + self.cfg.attention_layers} do not exist "
                    f"(the target has {target.num_layers})"
                )
            for j in range(self.cfg.attention_layers):
                block = copy.deepcopy(target.decoder.layers[first + j]).requires_grad_(True)
                block.self_attn.layer_idx = j  # its slot in the head's own cache
                self.blocks.append(block)
        self._softcap = target._softcap
        head = _LMHead(target.lm_head.weight)
        if self.cfg.kind == "lora_head":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha, target_modules=["proj"], lora_dropout=0.0
            )
            head = get_peft_model(head, lora)
            self.lora = head  # registered: its LoRA A/B are trained and saved (the base weight stays frozen)
        else:
            object.__setattr__(self, "_head", head)
        # its own parameters live where what it borrows lives: the target's device (or a HeadEnd's)
        return self.to(target.lm_head.weight.device)

    def restrict(self, ids: torch.Tensor | None) -> ProxyHead:
        """Score only the target ids `ids` (None: the whole vocabulary again); candidates stay target ids.

        The LM head is nearly all of a head's cost (21 of 23 ms per 8 positions on the testbed, one core) and it
        sits on the target's critical path: the 16,384 most frequent ids hold 96.6% of the testbed's held-out
        answer tokens at a third of the cost. Per-position kinds only (a LoRA'd head is trained over all rows).
        """
        if self._target is None:
            raise MirrorTrainError("proxy head is not bound to a target; call head.bind(target) first")
        if self.cfg.kind == "lora_head" and ids is not None:
            raise MirrorTrainError("a lora_head proxy head cannot be restricted to a candidate vocabulary")
        weight = self._target.lm_head.weight
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long)
            if ids.numel() < self.cfg.kappa or ids.min() < 0 or ids.max() >= weight.shape[0]:
                raise MirrorTrainError(
                    f"a candidate vocabulary needs ≥ κ={self.cfg.kappa} ids in 0..{weight.shape[0] - 1}"
                )
            weight = weight[ids.to(weight.device)]
        object.__setattr__(self, "_head", _LMHead(weight))
        self.vocab_ids = ids
        return self

    @property
    def dtype(self) -> torch.dtype:
        """What the head computes in: the precision of the final norm it borrows (and of its LM head)."""
        if self._norm is None:
            raise MirrorTrainError("proxy head is not bound to a target; call head.bind(target) first")
        return self._norm.weight.dtype

    @property
    def lm_head(self) -> nn.Module:
        head = self.lora if self.cfg.kind == "lora_head" else self._head
        if head is None:
            raise MirrorTrainError("proxy head is not bound to a target; call head.bind(target) first")
        return head

    # --- forward ---------------------------------------------------------------------------------------------------
    def new_cache(self):
        """The attention kind's own KV cache (None for the per-position kinds)."""
        from transformers import DynamicCache

        return DynamicCache() if self.cfg.kind == "attention" else None

    def adapt(self, hidden: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(…, H) ℓe states → (…, H) states the final norm + LM head read.

        The attention kind reads a window (B, T, H) (or (T, H)) continuing `cache` (None: the window is the whole
        context); `attention_mask` is a 2-D padding mask for batched training.
        """
        kind = self.cfg.kind
        if kind == "attention":
            batched = hidden.dim() == 3
            window = hidden if batched else hidden.unsqueeze(0)
            state = self._target.window_state(window, cache, attention_mask)
            first = self.cfg.exit_layer
            blocks = {first + j: block for j, block in enumerate(self.blocks)}
            out = self._target.run_layers(state, blocks, range(first, first + len(self.blocks)))
            return out if batched else out.squeeze(0)
        if kind == "residual":
            delta = self.w(hidden) if self.cfg.rank is None else self.up(self.down(hidden))
            return hidden + delta
        if kind in ("mlp", "lora_head"):
            return hidden + self.fc2(nn.functional.silu(self.fc1(self.pre_norm(hidden))))
        return hidden

    def forward(self, hidden: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(…, H) → (…, V) logits over the target's vocabulary."""
        if self._norm is None:
            raise MirrorTrainError("proxy head is not bound to a target; call head.bind(target) first")
        logits = self.lm_head(self._norm(self.adapt(hidden, cache, attention_mask)))
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @torch.inference_mode()
    def candidates(
        self, hidden: torch.Tensor, kappa: int | None = None, cache=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-κ candidate ids (target ids) and their log-probs at each position: (…, κ) long, (…, κ) float."""
        kappa = check_kappa(kappa or self.cfg.kappa)
        top = torch.log_softmax(self(hidden, cache).float(), dim=-1).topk(kappa, dim=-1)
        return self.to_target_ids(top.indices), top.values

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into this head's logits → target ids (the identity unless `restrict`ed)."""
        return index if self.vocab_ids is None else self.vocab_ids.to(index.device)[index]

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return self._vocab_ids

    @vocab_ids.setter
    def vocab_ids(self, ids: torch.Tensor | None) -> None:
        """Also builds the target id → logit index lookup once, not at every verification step."""
        object.__setattr__(self, "_vocab_ids", ids)
        lookup = None
        if ids is not None:
            lookup = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
            lookup[ids] = torch.arange(len(ids))
        object.__setattr__(self, "_lookup", lookup)

    def logit_index(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids → indices into this head's logits, -1 for ids outside a restricted vocabulary."""
        if self._lookup is None:
            return target_ids
        lookup = self._lookup.to(target_ids.device)
        inside = target_ids < len(lookup)
        return torch.where(inside, lookup[target_ids.clamp(max=len(lookup) - 1)], -1)

    @torch.inference_mode()
    def window_candidates(
        self, hidden: torch.Tensor, window: list[int], kappa: int | None = None, cache=None, noise=None
    ) -> tuple[list[list[int]], list[list[float]], list[float]]:
        """What the engine sends for a verification window: at each of its γ+1 positions (hidden (γ+1, H)) the
        top-κ target ids and their log-probs, and the log-prob of each drafted token of `window` (γ ids;
        OUTSIDE_LOGP for one a restricted vocabulary lacks).

        noise: at T > 0, the target's sampling noise at those positions ((γ+1, the target's vocabulary): T times
        its Gumbel noise, `acceptance.sample_noise`), which the engine knows before the target has its logits. The
        target's token there is argmax(logits + noise), so the head ranks its own logits plus the same noise: its
        candidates are the sample the head expects, not its greedy guesses (at T = 1 the top 8 of the head's
        logits hold a sample only as often as its top-8 mass, ~Ω_8), and the log-probs its odds of each under that
        noise (the head's softmax, shifted by the noise, is its model of argmax(logits + noise))."""
        kappa = check_kappa(kappa or self.cfg.kappa)
        index = self.logit_index(torch.tensor(window, dtype=torch.long, device=hidden.device))
        if noise is not None:  # read at the head's own ids (a restricted vocabulary's)
            noise = noise.to(hidden.device, torch.float32)
            noise = noise if self.vocab_ids is None else noise[:, self.vocab_ids.to(hidden.device)]
        fused = fused_head.window_candidates(self, hidden, index, kappa, OUTSIDE_LOGP, noise)  # one C call
        if fused is not None:
            top_index, top_logp, window_logp = fused
            return self.to_target_ids(top_index).tolist(), top_logp, window_logp
        logits = self(hidden, cache).float()  # (γ+1, V')
        logp = torch.log_softmax(logits if noise is None else logits + noise, dim=-1)
        top = logp.topk(kappa, dim=-1)
        window_logp = logp[torch.arange(len(window)), index.clamp(min=0)].masked_fill(index < 0, OUTSIDE_LOGP)
        return self.to_target_ids(top.indices).tolist(), top.values.tolist(), window_logp.tolist()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Only what this head learned: never the target's borrowed LM head."""
        return {k: v for k, v in self.state_dict().items() if "base_layer" not in k and "_head" not in k}

    def num_parameters(self) -> int:
        return sum(v.numel() for v in self.trainable_state_dict().values())


class HeadEnd(nn.Module):
    """What a per-position proxy head borrows from its target, held on its own: the final norm and the LM head's
    rows for the head's candidate vocabulary. `bind` accepts it in place of the target, so the head can run away
    from the target (on the draft's device) without a copy of the whole target there."""

    def __init__(self, norm: nn.Module, lm_weight: torch.Tensor, num_layers: int, softcap: float | None = None):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.norm = norm
        self.lm_head = nn.Linear(lm_weight.shape[1], lm_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_weight, requires_grad=False)
        self.hidden_size = lm_weight.shape[1]
        self.num_layers = num_layers
        self._softcap = softcap

    def check_exit_layer(self, exit_layer: int) -> int:
        return check_exit_layer(exit_layer, self.num_layers)

    @classmethod
    def of(cls, head: ProxyHead) -> tuple[HeadEnd, dict]:
        """The head end of a bound head (its restricted rows, if any) and the head's own state, to send elsewhere."""
        if head.cfg.kind in ("attention", "lora_head"):
            raise MirrorTrainError(
                f"a {head.cfg.kind} proxy head runs only beside its target (it needs more of it): set "
                "head_placement=target (--head-placement target)"
            )
        target = head._target
        end = cls(copy.deepcopy(target.decoder.norm), head.lm_head.proj.weight.detach().clone(), target.num_layers)
        end._softcap = head._softcap
        return end, head.trainable_state_dict()

    def head(self, cfg: ProxyHeadConfig, state: dict, vocab_ids: torch.Tensor | None) -> ProxyHead:
        """Rebuild the head `of` took apart, bound to this end."""
        head = ProxyHead(cfg, self.hidden_size).bind(self)
        head.load_state_dict(state, strict=False)
        head.vocab_ids = vocab_ids
        return head.eval()


ARTIFACT_KIND = "proxy_head"
RANKING_KEY = "candidate_ranking"  # target ids by training frequency, stored beside the weights


def save_proxy_head(head: ProxyHead, out_dir, target, results_markdown: str | None = None, extra: dict | None = None):
    """Export a self-describing artifact: config (kind, ℓe, κ, sizes), safetensors, the target, a model card."""
    from dataclasses import asdict

    config = {**asdict(head.cfg), "hidden_size": head.hidden_size, "num_parameters": head.num_parameters()}
    config.update(extra or {})
    usage = (
        "```python\nfrom mirror_train.models.proxy_head import load_proxy_head\n"
        "from mirror_train.target import Target\n\n"
        "target = Target.load(...)  # the target this head belongs to\nhead = load_proxy_head(PATH, target)\n"
        f"state = target.prefix(ids, cache, {head.cfg.exit_layer})\nids, logp = head.candidates(state.hidden)\n```"
    )
    state = head.trainable_state_dict()
    if head.ranking is not None:  # the engine's candidate vocabulary comes from it (`restrict`)
        state[RANKING_KEY] = head.ranking.to(torch.long)
    return save_artifact(
        out_dir,
        kind=ARTIFACT_KIND,
        config=config,
        state_dict=state,
        target=target.signature(),
        card=CardText(
            f"{head.cfg.kind} proxy head at layer {head.cfg.exit_layer} for {target.name_or_path}",
            usage,
            results_markdown,
        ),
    )


def load_proxy_head(path, target, exit_layer: int | None = None) -> ProxyHead:
    """Load an exported head, check it belongs to `target` (and to `exit_layer` if given), bind it."""
    meta, state, _ = load_artifact(path, expected_kind=ARTIFACT_KIND, target=target.signature())
    stored = dict(meta["config"])
    hidden_size = stored.pop("hidden_size")
    stored.pop("num_parameters", None)
    known = {f for f in ProxyHeadConfig.__dataclass_fields__}
    cfg = config_from_dict(ProxyHeadConfig, {k: v for k, v in stored.items() if k in known}, where=str(path))
    if exit_layer is not None and cfg.exit_layer != exit_layer:
        raise MirrorTrainError(f"proxy head {path} was trained at ℓe={cfg.exit_layer}, not ℓe={exit_layer}")
    head = ProxyHead(cfg, hidden_size).bind(target)
    state = dict(state)
    head.ranking = state.pop(RANKING_KEY, None)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if "base_layer" not in k]
    if missing or unexpected:
        raise MirrorTrainError(
            f"proxy head {path} does not match its config: missing {missing}, unexpected {unexpected}"
        )
    return head.eval()
