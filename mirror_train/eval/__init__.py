"""Spec-Bench for Mirror-SD: the questions (questions.py), the run (specbench.py), the methods that are not the
engine's (peers.py) and the score and report (score.py)."""
