"""Which target an artifact belongs to: the signature every proxy head and draft records, and checks on load.

A proxy head reads hidden states of one specific target and a draft proposes token ids of one specific tokenizer,
so the signature holds what makes an artifact unusable elsewhere (model type, sizes, what the token ids mean) and,
for the record only, the name and the chat template.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from mirror_train.errors import MirrorTrainError


def _sha16(payload: object) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what token ids *mean*: the sorted vocab (token -> id) and the bos/eos/pad/unk ids.

    The chat template is deliberately left out: it changes how prompts are laid out, not which id stands for which
    token, so a head or draft trained under one template still works under another. It is recorded separately
    (`chat_template_fingerprint`) for the record, and never makes a load fail.
    """
    specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    return _sha16({"vocab": sorted(tokenizer.get_vocab().items()), "special": specials})


def chat_template_fingerprint(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return None if template is None else _sha16(template)


@dataclass(frozen=True)
class TargetSignature:
    """What an artifact needs to know about its target model to refuse the wrong one."""

    name_or_path: str
    revision: str | None
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_fingerprint: str
    chat_template_fingerprint: str | None = None  # informational only, see `tokenizer_fingerprint`

    # Differences here make an artifact unusable; name, revision and chat template may differ harmlessly
    # (the same weights can live at a hub id and at a local path).
    MUST_MATCH = ("model_type", "num_layers", "hidden_size", "vocab_size", "tokenizer_fingerprint")

    @classmethod
    def of(cls, model_config, tokenizer, name_or_path: str, revision: str | None = None) -> TargetSignature:
        text = model_config.get_text_config()  # multimodal configs nest the language model's sizes
        missing = [a for a in ("num_hidden_layers", "hidden_size", "vocab_size") if getattr(text, a, None) is None]
        if missing:
            raise MirrorTrainError(f"model config of {name_or_path} has no {', '.join(missing)}")
        return cls(
            name_or_path=str(name_or_path),
            revision=revision,
            model_type=model_config.model_type,
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            chat_template_fingerprint=chat_template_fingerprint(tokenizer),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TargetSignature:
        names = {f.name for f in fields(cls)}
        required = names - {"chat_template_fingerprint"}
        if not isinstance(d, dict) or not required <= d.keys():
            missing = sorted(required - d.keys()) if isinstance(d, dict) else "everything"
            raise MirrorTrainError(f"target signature is incomplete (missing: {missing})")
        return cls(**{k: v for k, v in d.items() if k in names})  # unknown keys: written by a newer version

    def check_matches(self, other: TargetSignature, what: str) -> None:
        """Raise if `other` (the model at hand) cannot use `what`, which was made for `self`; names every field."""
        diffs = [
            f"{f}: {getattr(self, f)!r} vs {getattr(other, f)!r}"
            for f in self.MUST_MATCH
            if getattr(self, f) != getattr(other, f)
        ]
        if diffs:
            raise MirrorTrainError(
                f"{what} was made for {self.name_or_path} and does not fit {other.name_or_path} "
                f"(artifact vs given): {'; '.join(diffs)}"
            )
