"""What the draft model's chain is worth beside the copies (prompt lookup, the datastore), on prompts neither saw:
an oracle walk over the target's own greedy answers, no verification cost counted.

    python scripts/bench_draft_value.py --proxy-head outputs/proxy_head_smollm2/export \
        --draft outputs/drafter_smollm2/export [--num 24] [--max-new-tokens 128] [--exclude-data outputs/data/smollm2]

Training prompts the data stage did not answer (`--exclude-data`: its self-distilled set's prompt ids are skipped)
are answered greedily by the target (the engine's `ar`); the target's states over prompt + answer are computed once,
teacher-forced, as the engine sends them. Then each answer is walked as verification steps: at every step the draft
server (the engine's own, in-process) is told the committed tokens with their states and rolls out the model's chain
of γ tokens from there, as a serial rollout would; prompt lookup and the datastore propose theirs. A step commits
the tokens the chosen proposal matched, plus the target's own token. Policies, each its own walk:

- copies: the better of the two copies (what pld_store verifies, with a fork of both);
- model: the model's chain alone;
- model + copies: the best of the three (what a fork of the model's chain and the copies could keep at most);
- model a step late: the better copy, or the rest of the chain the model rolled out from the previous step's
  position where what that step committed is its prefix (a draft that rolls out while the target verifies the
  step before, with no branch per outcome).

Per task and overall: committed tokens per step. An upper bound on what each source can bring (an oracle choice,
and no cost for the rows a fork adds); what the engine keeps of it is decided by those costs (docs/engine.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mirror_train.data.selfdistill import load_selfdistill
from mirror_train.devices import cpu_model
from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.engine.channel import build_server
from mirror_train.engine.messages import Start, Verdict
from mirror_train.prompts import load_prompts
from mirror_train.target import Target

POLICIES = ("copies", "model", "model + copies", "model a step late")


def matched(proposal: list[int], truth: list[int]) -> int:
    """How many leading tokens of a proposal the text then says."""
    n = 0
    while n < min(len(proposal), len(truth)) and proposal[n] == truth[n]:
        n += 1
    return n


def choose(policy: str, model: int, copies: int, late: int) -> int:
    """The tokens a step keeps under `policy`, given what each source's proposal matched (module docstring)."""
    return {"copies": copies, "model": model, "model + copies": max(model, copies)}.get(policy, max(late, copies))


def target_states(target: Target, ids: list[int], exit_layer: int) -> dict:
    """The target's ℓe and final states of every position of `ids`, teacher-forced, as the engine sends them."""
    with torch.inference_mode():
        state = target.prefix(torch.tensor([ids]), target.new_cache(), exit_layer)
        _, final = target.suffix_states(state)
    return {"exit": state.hidden[0].float().numpy(), "final": final[0].float().numpy()}


def recording_server(spec: dict):
    """The engine's draft server, rolling out the model's whole γ every step (its chain is what is measured), that
    records what each source proposes at each step's position (`seen`)."""
    server = build_server(spec)
    server.adaptive_window = False
    server.seen = {}
    offer = server._offer

    def recording(drafted, info):
        server.seen["model"], server.seen["copies"] = list(drafted.tokens), [c[0] for c in server._copies()]
        return offer(drafted, info)

    server._offer = recording
    return server


def walk(
    engine: MirrorEngine, server, prompt: list[int], answer: list[int], states: dict, policy: str
) -> tuple[int, int]:
    """One answer walked under `policy` (a `recording_server`, reset by the walk): (tokens committed, steps)."""
    seen = server.seen
    n, slots, gamma = len(prompt), engine.draft_slots, engine.config.gamma
    committed, pos, steps, previous = [answer[0]], 0, 1, None  # the prefill's step commits the first token
    with torch.inference_mode(False):
        server.handle(Start(prompt, gamma, None, {s: states[s][: n - 1] for s in slots}))
        while True:
            rows = {s: states[s][n - 1 + pos : n - 1 + pos + len(committed)] for s in slots}
            server.handle(Verdict(0, committed[-1], rows, committed=committed, reply=True))
            pos += len(committed)
            if pos >= len(answer):
                return pos, steps
            truth = answer[pos:]
            late = 0
            if previous is not None:  # the chain rolled out from the previous position, if still on the path
                at, chain = previous
                done = answer[at:pos]
                late = matched(chain[len(done) :], truth) if chain[: len(done)] == done else 0
            previous = (pos, seen["model"])
            copies = max((matched(c, truth) for c in seen["copies"]), default=0)
            keep = choose(policy, matched(seen["model"], truth), copies, late)
            committed = answer[pos : pos + min(keep + 1, len(answer) - pos)]
            steps += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy-head", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default=None, help="a prompt JSONL (default: the training prompts)")
    ap.add_argument("--exclude-data", default="outputs/data/smollm2", help="skip the prompts its answers used")
    ap.add_argument("--num", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    used = set()
    if args.exclude_data and (Path(args.exclude_data) / "selfdistill").exists():
        used = set(load_selfdistill(Path(args.exclude_data) / "selfdistill")["id"])
    prompts = load_prompts(args.prompts, args.num, args.seed, exclude=used)
    target = Target.load("testbed")
    engine = MirrorEngine(target, args.proxy_head, args.draft, EngineConfig(placement="local")).start()
    servers = {policy: recording_server(engine.spec) for policy in POLICIES}
    totals: dict[str, dict[str, list[int]]] = {}
    for prompt in prompts:
        ids = engine._ids(prompt.messages())
        answer = engine.generate(prompt.messages(), args.max_new_tokens, method="ar").tokens
        states = target_states(target, ids + answer, engine.exit_layer)
        task = prompt.category or "all"
        print(f"{prompt.id}: {len(answer)} tokens", file=sys.stderr, flush=True)
        for policy in POLICIES:
            tokens, steps = walk(engine, servers[policy], ids, answer, states, policy)
            for key in (task, "overall"):
                cell = totals.setdefault(key, {}).setdefault(policy, [0, 0])
                cell[0], cell[1] = cell[0] + tokens, cell[1] + steps
    engine.close()
    print(f"\n{len(prompts)} training prompts not self-distilled, ≤ {args.max_new_tokens} tokens, {cpu_model()}\n")
    print("| task | prompts | " + " | ".join(POLICIES) + " |")
    print("|---|---|" + "---|" * len(POLICIES))
    counts = {"overall": len(prompts)}
    for prompt in prompts:
        counts[prompt.category or "all"] = counts.get(prompt.category or "all", 0) + 1
    for task in sorted(totals, key=lambda t: (t == "overall", t)):
        cells = " | ".join(f"{totals[task][p][0] / totals[task][p][1]:.2f}" for p in POLICIES)
        print(f"| {task} | {counts[task]} | {cells} |")


if __name__ == "__main__":
    main()
