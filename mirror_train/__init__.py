"""mirror-train: Mirror Speculative Decoding toolkit."""

__version__ = "0.1.0"

# Registers "mirror_drafter" with transformers' Auto classes; this imports transformers (seconds, not milliseconds).
from mirror_train.models import drafter as _drafter  # noqa: E402, F401
