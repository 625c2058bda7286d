"""The models: the proxy head, the multi-stream draft, and the artifacts each saves and loads.

Importing this package registers the draft's model type ("mirror_drafter") with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(exported_draft)` works after `import mirror_train.models`.
"""

from mirror_train.models import drafter as _drafter  # noqa: F401  (the registration runs on import)
