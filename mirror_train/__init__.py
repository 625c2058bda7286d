"""mirror-train: Mirror Speculative Decoding toolkit."""

__version__ = "0.1.0"
