"""Setting the engine up: the proxy head bound to the target, and the spec the draft's worker is built from.

Everything is checked here, before any worker starts, so a mismatched artifact is a one-line error, not a dead
worker.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch
from transformers import AutoConfig

from mirror_train import fastpath
from mirror_train.datastore import Datastore
from mirror_train.devices import draft_device
from mirror_train.engine.config import EngineConfig
from mirror_train.engine.drafts import SyntheticDraftConfig
from mirror_train.errors import MirrorTrainError
from mirror_train.export import load_artifact
from mirror_train.models.draft_artifact import ARTIFACT_KIND, DATASTORE_FILE
from mirror_train.models.draft_surgery import check_compatible
from mirror_train.models.drafter import MirrorDrafterForCausalLM
from mirror_train.models.drafter_config import TARGET_SLOTS
from mirror_train.models.proxy_head import HeadEnd, ProxyHead, ProxyHeadConfig, load_proxy_head
from mirror_train.target import Target


def bind_head(target: Target, cfg: EngineConfig, proxy_head) -> ProxyHead:
    """A bound proxy head from a `ProxyHead`, an exported one's path, or None (the logit lens at ℓe)."""
    if proxy_head is None:
        layer = cfg.exit_layer if cfg.exit_layer is not None else target.num_layers // 2
        target.check_exit_layer(layer)
        lens = ProxyHead(ProxyHeadConfig(kind="lens", exit_layer=layer, kappa=cfg.kappa), target.hidden_size)
        return lens.bind(target)
    if not isinstance(proxy_head, ProxyHead):
        proxy_head = load_proxy_head(proxy_head, target, cfg.exit_layer)
    if cfg.exit_layer is not None and proxy_head.cfg.exit_layer != cfg.exit_layer:
        raise MirrorTrainError(f"the proxy head reads ℓe={proxy_head.cfg.exit_layer}, not ℓe={cfg.exit_layer}")
    if proxy_head._target is not target:
        proxy_head.bind(target)
    # Beside the target it computes in the target's precision, like the final norm and LM head it borrows.
    return proxy_head.to(target.device, target.dtype)


def draft_spec(target: Target, cfg: EngineConfig, draft, head: ProxyHead, workdir: str) -> tuple[dict, list[str]]:
    """The picklable spec of the draft's side (channel.build_server) and the target slots the draft reads.

    draft: an exported draft's path, a `MirrorDrafterForCausalLM` (saved into `workdir`) or a
    `SyntheticDraftConfig`. With `head_placement="draft"` the head's bundle is written into `workdir` too.
    """
    device = draft_device(cfg.draft_device, target.device)
    dtype = str(fastpath.draft_dtype(cfg.draft_dtype, device, cfg.draft_fast_path)).removeprefix("torch.")
    common = {
        "device": str(device),
        "branch_budget": cfg.branch_budget,
        "adaptive_budget": cfg.adaptive_budget,
        "kappa": cfg.kappa,
        "dtype": dtype,
        "ngram_tokens": cfg.ngram_tokens,
        "adaptive_window": cfg.adaptive_window,
        "lookup_roots": cfg.lookup_roots,
        "fast_path": fastpath.for_draft(cfg.draft_fast_path),
    }
    if cfg.head_placement == "draft":
        common["head"] = head_bundle(head, workdir)
        common["head_weights"] = cfg.head_weights
    if isinstance(draft, SyntheticDraftConfig):
        draft.validate()
        return {"kind": "synthetic", "config": asdict(draft), "vocab_size": target.vocab_size, **common}, []
    if isinstance(draft, MirrorDrafterForCausalLM):
        check_compatible(draft, target)
        path = os.path.join(workdir, "draft")
        draft.save_pretrained(path)
    else:
        path = str(draft)
        load_artifact(path, expected_kind=ARTIFACT_KIND, target=target.signature())  # clear errors, early
    dc = AutoConfig.from_pretrained(path)
    if dc.vocab_size != target.vocab_size:
        raise MirrorTrainError(f"draft {path} has {dc.vocab_size} ids, the target {target.vocab_size}")
    slots = []
    if getattr(dc, "feature_conditioning", "none") != "none":
        if dc.target_exit_layer != head.cfg.exit_layer:
            raise MirrorTrainError(
                f"the draft reads the target's layer-{dc.target_exit_layer} states and the proxy head splits the "
                f"target at ℓe={head.cfg.exit_layer}: the engine computes one ℓe, so both must read the same layer"
            )
        slots = [slot for slot in TARGET_SLOTS if slot in (getattr(dc, "feature_slots", None) or ["exit"])]
    spec = {"kind": "model", "path": path, "use_streams": cfg.use_streams, **common}
    store = datastore_path(cfg.datastore, path)
    if store is not None:
        check_datastore(store, target)
        spec["datastore"] = store
    return spec, slots


def check_datastore(path: str, target: Target) -> None:
    """A clear error, before any worker starts, for a datastore that cannot be read or was built for another
    tokenizer."""
    Datastore.load(path).check_vocab(target.vocab_size, path)


def datastore_path(setting: str, draft_path: str | None) -> str | None:
    """The datastore in use under EngineConfig.datastore = `setting`: the exported draft's own under "auto" (none
    without one), none under "off", else the path given."""
    if setting == "off":
        return None
    if setting == "auto":
        own = os.path.join(draft_path, DATASTORE_FILE) if draft_path else None
        return own if own and os.path.isfile(own) else None
    return setting


def head_bundle(head: ProxyHead, workdir: str) -> str:
    """The proxy head, its target's final norm and its candidate rows of the LM head, for the draft's side."""
    end, state = HeadEnd.of(head)
    path = os.path.join(workdir, "proxy_head.pt")
    torch.save({"end": end, "cfg": head.cfg, "state": state, "vocab_ids": head.vocab_ids}, path)
    return path
