"""YAML files + command-line overrides -> typed dataclass configs.

Every setting has exactly one typed default: the dataclass field. A YAML file only lists what differs, and
`a.b.c=value` overrides adjust single settings after the file is read. Everything a user can get wrong (an unknown
or misspelt key, a value of the wrong type, a missing file, broken YAML) raises `MirrorTrainError` with a one-line
message naming the file or override and the full dotted key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import reprlib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from mirror_train.errors import MirrorTrainError

T = TypeVar("T")

_KEY = re.compile(r"[^\s.=]+(\.[^\s.=]+)*")


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Build `cls` from the YAML file at `path` (if any), then `key=value` overrides, then run `validate()`."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    data = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        _apply_override(cls, data, item)
    return config_from_dict(cls, data, str(path) if path is not None else "config")


def parse_overrides(args: Sequence[str]) -> list[str]:
    """Normalise `a.b=1`, `--a.b=1` and `--a.b 1` command-line forms to `a.b=1`."""
    out: list[str] = []
    it = iter(args)
    for arg in it:
        body = arg[2:] if arg.startswith("--") else arg
        if "=" not in body:
            value = next(it, None) if arg.startswith("--") else None
            if value is None or value.startswith("--"):
                raise MirrorTrainError(f"override {arg!r} has no value; write KEY=VALUE or --KEY VALUE")
            body = f"{body}={value}"
        if not _KEY.fullmatch(body.partition("=")[0]):
            raise MirrorTrainError(f"override {arg!r} does not start with a dotted key such as train.lr=1e-4")
        out.append(body)
    return out


def config_to_dict(cfg: Any) -> Any:
    """Plain YAML-safe data (dicts, lists, str, numbers) from a config, so `save_config` needs no custom tags."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {str(k): config_to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, PurePath):
        return str(cfg)
    return cfg


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write `cfg` as YAML; the temporary file + `os.replace` means a crash never leaves a half-written config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"# {type(cfg).__name__}, written by mirror_train.config.save_config\n{text}", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def config_from_dict(cls: type[T], data: Mapping, where: str = "config") -> T:
    """Type-check `data` against `cls` (no unknown keys, no missing required ones), build it and validate it."""
    cfg = _build(cls, data, "", where)
    _validate(cfg, "", where)
    return cfg


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise MirrorTrainError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise MirrorTrainError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:  # an empty file means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise MirrorTrainError(f"{path}: the top level must be a mapping of settings, got {type(data).__name__}")
    return data


def _apply_override(cls: type, data: dict, item: str) -> None:
    """Set `a.b.c=value` in the raw data, checking the key and value now so the error names the override."""
    where = f"override {item!r}"
    key, sep, raw = item.partition("=")
    if not sep or not _KEY.fullmatch(key):
        raise MirrorTrainError(f"{where} is not of the form KEY=VALUE with a dotted KEY such as train.lr")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise MirrorTrainError(f"{where}: cannot parse {raw!r} as a YAML value") from None
    parts, tp, node = key.split("."), cls, data
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            fields = _fields(tp)
            if part not in fields:
                raise _unknown(where, parent, part, list(fields))
            tp = fields[part][1]
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1] if get_args(tp) else Any
        else:
            raise MirrorTrainError(f"{where}: {parent!r} is a single {_type_name(tp)} setting, not a section")
        if i == len(parts) - 1:
            if _is_text(tp) and value is not None and not isinstance(value, str):
                value = raw.strip()  # a text setting takes the word as written (YAML would read `no` as false)
            node[part] = value
        else:
            if not isinstance(node.get(part), dict):  # absent, or null/scalar in the file: the override wins
                node[part] = {}
            node = node[part]
    _convert(tp, value, key, where)


def _is_text(tp: Any) -> bool:
    """A setting that holds text: str, or a Literal of strings (optionally None as well)."""
    tp = _strip_optional(tp)
    return tp is str or (get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp)))


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Init fields with resolved types (get_type_hints handles `from __future__ import annotations`)."""
    hints = get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _build(cls: type, data: Any, path: str, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise _type_error(cls, data, path, where)
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown(where, path, str(key), list(fields))
    missing = [
        _join(path, name)
        for name, (f, _) in fields.items()
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise MirrorTrainError(f"{where}: missing required setting(s): {', '.join(missing)}")
    return cls(**{name: _convert(fields[name][1], value, _join(path, name), where) for name, value in data.items()})


def _convert(tp: Any, value: Any, path: str, where: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where lossless (str->Path, int->float, "1e-4")."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if value is None and len(arms) < len(args):
            return None
        if len(arms) == 1:  # Optional[X]: let X's own, more precise error through
            return _convert(arms[0], value, path, where)
        for arm in arms:
            try:
                return _convert(arm, value, path, where)
            except MirrorTrainError:
                pass
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _fail(where, path, f"expected one of {', '.join(map(repr, args))}, got {_show(value)}")
    elif dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else _build(tp, value, path, where)
    elif origin in (list, tuple) and isinstance(value, (list, tuple)):  # list[X] and tuple[X, ...]
        items = [_convert(args[0] if args else Any, v, f"{path}[{i}]", where) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    elif origin is dict and isinstance(value, Mapping):
        kt, vt = args or (Any, Any)
        return {_convert(kt, k, path, where): _convert(vt, v, _join(path, str(k)), where) for k, v in value.items()}
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif tp in (int, float):
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 as a string; accept any cleanly parsing number
            try:
                value = tp(value.strip())
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool) and (tp is float or isinstance(value, int)):
            return tp(value)
    elif isinstance(tp, type) and issubclass(tp, PurePath):
        if isinstance(value, str | os.PathLike):
            return tp(value)
    elif origin not in (list, tuple, dict):
        raise TypeError(f"config field {path!r} has an unsupported type {tp!r}")
    raise _type_error(tp, value, path, where)


def _validate(obj: Any, path: str, where: str) -> None:
    """Call each config's `validate()`, innermost first, so a section's checks may rely on its parts being valid."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [(_join(path, f.name), getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        children = [(_join(path, str(k)), v) for k, v in obj.items()]
    else:
        return
    for child_path, child in children:
        _validate(child, child_path, where)
    if dataclasses.is_dataclass(obj) and callable(getattr(obj, "validate", None)):
        try:
            obj.validate()
        except MirrorTrainError as e:
            raise _fail(where, path, str(e)) from e


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        arms = [a for a in get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return tp


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _fail(where: str, path: str, message: str) -> MirrorTrainError:
    return MirrorTrainError(f"{where}: {path}: {message}" if path else f"{where}: {message}")


def _unknown(where: str, parent: str, name: str, known: list[str]) -> MirrorTrainError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {_join(parent, close[0])!r}?)" if close else ""
    scope = f"under {parent!r}" if parent else "at the top level"
    return MirrorTrainError(
        f"{where}: unknown key {_join(parent, name)!r}{hint}; known keys {scope}: {', '.join(known) or '(none)'}"
    )


def _type_error(tp: Any, value: Any, path: str, where: str) -> MirrorTrainError:
    return _fail(where, path, f"expected {_type_name(tp)}, got {_show(value)}")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not get_args(tp):
        return f"a mapping ({tp.__name__})" if dataclasses.is_dataclass(tp) else tp.__name__
    # "typing.Optional[pathlib.Path]" -> "Optional[Path]"
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", str(tp))


def _show(value: Any) -> str:
    if isinstance(value, bool):  # YAML 1.1 reads yes/no/on/off as booleans: `train.mixed_precision=no` arrives so
        return f"{value} (bool; YAML reads yes/no/on/off as booleans: quote a word meant as text, 'no')"
    return "null" if value is None else f"{reprlib.repr(value)} ({type(value).__name__})"
