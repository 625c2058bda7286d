"""The dual-device Mirror-SD engine: `MirrorEngine` (engine.py) with its channel, draft server and pure rules."""

from mirror_train.engine.config import METHODS, EngineConfig, Generation, StepStats
from mirror_train.engine.drafts import SyntheticDraftConfig
from mirror_train.engine.engine import MirrorEngine

__all__ = ["METHODS", "EngineConfig", "Generation", "MirrorEngine", "StepStats", "SyntheticDraftConfig"]
