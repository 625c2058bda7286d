"""Methods that are not the engine's, run in the same process on the same core: transformers' assisted generation
with the same draft as `assistant_model` (its main stream as a plain Llama, `MirrorDrafterForCausalLM.to_llama`)
and prompt lookup decoding. Both are lossless under greedy decoding.

Accepted lengths come from the target's forwards: a hook records the first position of each call (the cache
length), and the tokens a call committed are the growth of the cache to the next call (the last commits the rest).
"""

from __future__ import annotations

import torch

from mirror_train.devices import clock
from mirror_train.fastpath import spread


class ForwardCounter:
    """Cache lengths at each forward of `model` while active: the target's verification steps."""

    def __init__(self, model):
        self.model = model
        self.lengths: list[int] = []
        self.handle = None

    def __enter__(self):
        def hook(module, args, kwargs):
            positions = kwargs.get("position_ids")  # its first entry is the cache length (transformers 5.24)
            if positions is not None:
                self.lengths.append(int(positions.view(-1)[0]))
                return
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            self.lengths.append(cache.get_seq_length() if cache is not None else 0)

        self.handle = self.model.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def accept_lengths(self, prompt_len: int, total_new: int) -> list[int]:
        """Tokens committed by each target forward (the prefill forward commits the first token)."""
        ends = self.lengths[1:] + [prompt_len + total_new - 1]
        starts = self.lengths
        lengths = [max(e - max(s, prompt_len - 1), 0) for s, e in zip(starts, ends, strict=True)]
        lengths[0] = max(lengths[0], 1) if lengths else 1
        return [n for n in lengths if n > 0]


class PrefillSpread:
    """The target's first forward of a generation (the prompt's prefill) spread over `layout` = (cores, threads), as
    the engine's methods prefill (`EngineConfig.prefill_layout`, fastpath.spread); its later forwards as around it."""

    def __init__(self, model, layout):
        self.model, self.layout = model, layout
        self.handles, self.inside, self.done = [], None, False

    def __enter__(self):
        def before(module, args, kwargs):
            if not self.done:
                self.inside = spread(self.layout, self.model)
                self.inside.__enter__()

        def after(module, args, kwargs, output):
            if self.inside is not None:
                self.inside.__exit__(None, None, None)
                self.inside, self.done = None, True

        if self.layout is not None:
            self.handles = [
                self.model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
                self.model.register_forward_hook(after, with_kwargs=True),
            ]
        return self

    def __exit__(self, *exc):
        if self.inside is not None:  # the prefill raised
            self.inside.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()


def greedy_generate(model, ids: list[int], max_new_tokens: int, stops: list[int], **kwargs) -> list[int]:
    """transformers' greedy `generate` after one prompt: the new tokens, up to a stop in `stops` ([]: exactly
    `max_new_tokens`, the model's own end-of-sequence ids set aside). `kwargs` go to `generate` (assistant, lookup)."""
    input_ids = torch.tensor([ids], device=model.device)
    eos = model.generation_config.eos_token_id
    if not stops:
        model.generation_config.eos_token_id = None
    try:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else 0,
            **kwargs,
        )
    finally:
        model.generation_config.eos_token_id = eos
    return out[0, len(ids) :].tolist()


def hf_generate(
    target, ids: list[int], max_new_tokens: int, stops: list[int], method: str, assistant=None, prefill=None
):
    """One greedy generation with transformers: method "assisted" (assistant model) or "hf_pld" (prompt lookup);
    `prefill`: the (cores, threads) of the prompt's prefill where it spreads beyond the steps' (`PrefillSpread`).

    Returns (new tokens, stop included; seconds; accepted length per target forward)."""
    model = target.model
    kwargs = {"assistant_model": assistant} if method == "assisted" else {"prompt_lookup_num_tokens": 10}
    with torch.inference_mode(), ForwardCounter(model) as counter, PrefillSpread(model, prefill):
        now = clock(model.device)
        start = now()
        new = greedy_generate(model, ids, max_new_tokens, stops, **kwargs)
        seconds = now() - start
    cut = next((j + 1 for j, t in enumerate(new) if t in stops), len(new))
    new = new[:cut]
    return new, seconds, counter.accept_lengths(len(ids), len(new))
