"""Prompt lookup: windows copied from the prompt and the committed text, at no cost to either device.

An n-gram index over the committed tokens (prompt included) maps every n-gram (n = 1..max_n) to the end of its most
recent occurrence that has a successor. The proposal for a context is the longest suffix of the context (n from
max_n down to 1) seen before, and the tokens that followed it there (Saxena's prompt lookup decoding; transformers'
`prompt_lookup_num_tokens`). Decisions: the most recent occurrence (answers copy what they just quoted more often
than what the prompt said first); the match size n is reported, because a longer match is a surer copy and the
engine learns how sure (window.py). An index built with `successors` > 1 also keeps each n-gram's latest distinct
successors, the guesses for the token after a context (`guesses`): Mirror-SD's branch roots beside the proxy head's
candidates. With the head's top 8, a second and third guess of the longest match held 0.023 more of the target's next
tokens on held-out Spec-Bench answers (0.822 → 0.845), other match lengths' latest successors only 0.004 (docs/
engine.md, forty-ninth session).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, max_n: int = 4, successors: int = 1):
        if max_n < 1:
            raise ValueError(f"max_n must be ≥ 1, got {max_n}")
        if successors < 1:
            raise ValueError(f"successors must be ≥ 1, got {successors}")
        self.max_n = max_n
        self.successors = successors
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram → index of its last token, at its latest occurrence
        self.recent: dict[tuple[int, ...], tuple[int, ...]] = {}  # n-gram → its latest distinct successors (> 1 kept)
        self.indexed = 0  # n-grams ending before this index are registered (the last token has no successor yet)

    def reset(self, tokens: Sequence[int]) -> None:
        self.tokens, self.last, self.recent, self.indexed = [], {}, {}, 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens += [int(t) for t in tokens]
        keep = self.successors
        for end in range(self.indexed, len(self.tokens) - 1):  # every n-gram ending at `end` now has a successor
            successor = self.tokens[end + 1]
            for n in range(1, min(self.max_n, end + 1) + 1):
                gram = tuple(self.tokens[end - n + 1 : end + 1])
                self.last[gram] = end
                if keep > 1:
                    seen = self.recent.get(gram, ())
                    self.recent[gram] = (successor, *(t for t in seen if t != successor))[:keep]
        self.indexed = max(self.indexed, len(self.tokens) - 1)

    def propose(self, k: int, after: Sequence[int] = ()) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest earlier occurrence of the context's suffix, and the match size n
        (0 and [] when nothing matches). The context is the committed tokens followed by `after` (e.g. the window
        tokens a branch keeps and its root); the copy comes from the committed tokens."""
        context = self.tokens[-self.max_n :] + [int(t) for t in after]
        for n in range(min(self.max_n, len(context)), 0, -1):
            end = self.last.get(tuple(context[-n:]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + k], n
        return [], 0

    def guesses(self, m: int, after: Sequence[int] = ()) -> list[tuple[int, int]]:
        """Up to m distinct guesses (token, match size n) for the token after the context (the committed tokens then
        `after`): the successors of the longest matching n-gram, latest first, then those of shorter matches. The
        first is `propose`'s next token."""
        context = self.tokens[-self.max_n :] + [int(t) for t in after]
        out: list[tuple[int, int]] = []
        for n in range(min(self.max_n, len(context)), 0, -1):
            gram = tuple(context[-n:])
            end = self.last.get(gram)
            if end is None:
                continue
            for token in self.recent.get(gram) or (self.tokens[end + 1],):
                if all(token != t for t, _ in out):
                    out.append((token, n))
                    if len(out) >= m:
                        return out
        return out
