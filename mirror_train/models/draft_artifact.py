"""A draft's exported artifact: saved with everything that describes it, loaded only for the target it belongs to.

`save_draft` writes what `AutoModelForCausalLM.from_pretrained` also loads (after `import mirror_train.models`) plus
mirror_config.json (kind "draft", the draft's config, the target's signature) and a model card; `load_draft`
refuses another target's draft (tokenizer, vocabulary, layers, the states it reads) before it proposes a token.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from peft import PeftModel

from mirror_train.datastore import Datastore
from mirror_train.errors import MirrorTrainError
from mirror_train.export import WEIGHTS_FILE, CardText, load_artifact, save_artifact
from mirror_train.models.draft_surgery import check_compatible
from mirror_train.models.drafter import MirrorDrafterForCausalLM

ARTIFACT_KIND = "draft"
DATASTORE_FILE = "datastore.npz"  # the target's own answers as an n-gram datastore (datastore.py), when exported


def save_draft(
    model, out_dir, target, metrics: dict | None = None, extra: dict | None = None, datastore: Datastore | None = None
) -> Path:
    """Export a self-describing draft artifact that `AutoModelForCausalLM.from_pretrained` also loads (after
    `import mirror_train.models`): config.json + model.safetensors + the target's tokenizer, and mirror_config.json
    (kind "draft", the draft's config, the target's signature, `extra`) + a model card with the held-out `metrics`.

    LoRA adapters are merged into the layers first (this unwraps a peft model in place). A `datastore` travels
    with the draft as datastore.npz (the engine's sd and mirror read it as a copy source), its summary in the config.
    """
    from safetensors.torch import load_file

    draft = model.merge_and_unload() if isinstance(model, PeftModel) else model
    with tempfile.TemporaryDirectory() as tmp:  # save_artifact then writes the lot atomically, its files added
        draft.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        weights = load_file(Path(tmp) / WEIGHTS_FILE)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file() and p.name != WEIGHTS_FILE}
    config = {"model": draft.config.to_dict(), **(extra or {})}
    if datastore is not None:
        files[DATASTORE_FILE] = datastore.to_bytes()
        config["datastore"] = dict(datastore.meta)
    table = None
    if metrics:  # as evaluate_drafter returns them
        rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in metrics.items() if k != "positions")
        table = (
            f"Agreement with the target's greedy choices on {metrics['positions']} held-out answer positions "
            f"(stream_j: the token j further ahead).\n\n| metric | held-out |\n|---|---|\n{rows}"
        )
    usage = (
        "from mirror_train.models.draft_artifact import load_draft\nfrom mirror_train.target import Target\n\n"
        "target = Target.load(...)  # the target this draft belongs to\ndraft = load_draft(PATH, target)\n"
        "# or, without the check, after `import mirror_train.models`:\n"
        "# transformers.AutoModelForCausalLM.from_pretrained(PATH)"
    )
    c = draft.config
    title = f"{c.num_hidden_layers}-layer draft, γ'={c.num_streams} streams, for {target.name_or_path}"
    meta = {"kind": ARTIFACT_KIND, "config": config, "target": target.signature()}
    return save_artifact(out_dir, **meta, state_dict=weights, card=CardText(title, usage, table), extra_files=files)


def load_draft(path, target, device=None) -> MirrorDrafterForCausalLM:
    """Load an exported draft and check that it belongs to `target` (tokenizer, vocabulary, layer count and, for a
    feature-conditioned draft, the hidden state it reads) before it proposes a single token. It lands on `device`
    (default: the target's)."""
    from transformers import AutoModelForCausalLM

    load_artifact(path, expected_kind=ARTIFACT_KIND, target=target.signature())  # refuses before the weights load
    draft = AutoModelForCausalLM.from_pretrained(path)
    if not isinstance(draft, MirrorDrafterForCausalLM):
        raise MirrorTrainError(f"{path} holds a {type(draft).__name__}, not a Mirror draft (MirrorDrafterForCausalLM)")
    check_compatible(draft, target)
    return draft.to(device if device is not None else target.device).eval()
