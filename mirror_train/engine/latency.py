"""The latency model of one step, beside which every measured step is printed (shared/docs/mirror-sd.md):

    Mirror-SD     T = T_prefix + T_head + max(T_suffix, T_branches) + T_fallback + T_channel
    serial SD     T = T_target + T_draft + T_channel
    target-only   T = T_target

Each term is measured on its own side (the draft's from the worker's clock), so predicted / measured shows how
much of a step is unaccounted glue: the overlap efficiency. T_channel is the measured round trip of an empty
message, for the two messages a step exchanges.
"""

from __future__ import annotations


def predicted_step_ms(
    method: str,
    prefix_ms: float,
    head_ms: float,
    suffix_ms: float,
    branch_ms: float,
    fallback_ms: float,
    channel_ms: float,
) -> float:
    """The model's step time from its measured terms (target terms in the engine, draft terms in the worker).

    For serial SD and target-only, prefix_ms + suffix_ms is the target's whole forward."""
    if method == "mirror":
        return prefix_ms + head_ms + max(suffix_ms, branch_ms) + fallback_ms + channel_ms
    if method == "sd":
        return prefix_ms + suffix_ms + fallback_ms + channel_ms
    return prefix_ms + suffix_ms
