"""Mirror-SD with branches off the engine's own copies (EngineConfig.branch_copies) against without, and pld_store, interleaved:
    python scripts/bench_branch_copies.py PER_CATEGORY REPS MAX_NEW_TOKENS
"""
import statistics, sys, time
from mirror_train.devices import cpu_model
from mirror_train.engine import EngineConfig, MirrorEngine
from mirror_train.eval.questions import load_questions
from mirror_train.prompts import default_specbench_file
from mirror_train.target import Target
from scripts.step_cost import spread

PEEKS = []  # (branched, hit, chosen source)
LAST = {}

def instrument():
    import mirror_train.engine.engine as E
    note, nxt = E.MirrorEngine._note, E.MirrorEngine._next_window
    def _note(self, reply):
        LAST["info"] = None if reply is None else dict(reply.info)
        return note(self, reply)
    def _next_window(self, seq, verdict, committed, may_ask=True):
        LAST["info"] = None
        branched = seq.branched
        out = nxt(self, seq, verdict, committed, may_ask)
        if branched and seq.method == "mirror":
            info = LAST["info"] or {}
            PEEKS.append((len(verdict.committed or []) , bool(info.get("reused")), out.get("source"), seq.served))
        return out
    E.MirrorEngine._note, E.MirrorEngine._next_window = _note, _next_window

def main():
    instrument()
    per, reps, n_tok = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    target = Target.load("testbed")
    qs = load_questions(default_specbench_file(), None, per)
    methods = ["ar", "pld_store", "mirror", "mirror-nb"]
    rows = {m: [] for m in methods}
    ex = {"model_steps": 0, "steps": 0, "asked": 0, "reused": 0}
    with MirrorEngine(target, "outputs/proxy_head_smollm2/export", "outputs/drafter_smollm2/export", EngineConfig()).start() as engine:
        engine.generate(qs[0].messages(), 8, method="mirror")
        print("contention", engine.contention, flush=True)
        for rep in range(reps):
            for q in qs:
                for m in (methods if rep % 2 == 0 else methods[::-1]):
                    engine.config.branch_copies = not m.endswith("-nb")
                    g = engine.generate(q.messages(), n_tok, method=m.split("-")[0])
                    st = g.steps[1:]
                    rows[m].append({"tokens": g.tokens, "tps": g.tokens_per_s, "per_step": len(g.tokens) / len(g.steps),
                                    "step_ms": sum(s.step_ms for s in st) / max(1, len(st)),
                                    "wait": sum(s.wait_ms for s in st) / max(1, len(st)),
                                    "model": sum(s.source == "model" for s in st) / max(1, len(st)),
                                    "asked": sum(s.asked for s in st) / max(1, len(st)),
                                    **{k: sum(getattr(s, k) for s in st) / max(1, len(st)) for k in ("prefix_ms", "suffix_ms", "send_ms", "wait_ms", "head_ms")}})
                print(q.category, {m: round(rows[m][-1]["tps"], 1) for m in methods}, flush=True)
    base, ref = rows["pld_store"], rows["ar"]
    print(cpu_model())
    print("| method | speed ÷ pld_store | tokens a step ÷ | step ms ÷ | model windows a step | asked a step | wait ms | lossless |")
    for m in methods:
        got = rows[m]
        r = lambda k: spread([a[k] / b[k] for a, b in zip(got, base)])
        print(f"| {m} | {r('tps')} | {r('per_step')} | {r('step_ms')} | {statistics.mean(x['model'] for x in got):.3f} | "
              f"{statistics.mean(x['asked'] for x in got):.3f} | {statistics.mean(x['wait'] for x in got):.2f} | "
              f"{all(a['tokens'] == b['tokens'] for a, b in zip(got, ref))} |", {k: round(statistics.mean(x[k] for x in got), 2) for k in ("prefix_ms", "suffix_ms", "send_ms", "wait_ms", "head_ms")})
    import collections
    print("peeks", len(PEEKS), "hits", sum(p[1] for p in PEEKS), "served draft", sum(p[3] == "draft" for p in PEEKS),
          collections.Counter(p[2] for p in PEEKS))

if __name__ == "__main__":
    main()
