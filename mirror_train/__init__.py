"""mirror-train: Mirror Speculative Decoding toolkit.

Importing the package is cheap (no torch, no transformers); `import mirror_train.models` registers the draft's
model type with transformers' Auto classes.
"""

__version__ = "0.1.0"
