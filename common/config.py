"""Typed configs: YAML files in `configs/` mapped onto dataclasses, with `key.sub=value` overrides.

A config file holds one section per command (`generate:`, `extract:`, `train:`); each command loads its own
section into its dataclass. Every field can be overridden from the command line with
`--set section_field.sub_field=value` (the value is parsed as YAML, so `[1, 2]`, `true`, `null`
work). Unknown keys are errors, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def doc(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None) -> Any:
    """A dataclass field with its help text kept in metadata (shown by `--help-config`)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type; raise ValueError naming the key on mismatch."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if errors else f"{where}: cannot be null")
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            # a bare `--set run.report_to=tensorboard` is the usual slip: show the list form
            raise ValueError(f"{where}: expected a list, got {value!r}; write it as [{value}]")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{where}: must be one of {list(args)}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML 1.1 reads `2e-3` (no dot) as a string: accept any text float() parses.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys with their full name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(
            f"unknown config key(s) {[prefix + k for k in unknown]}; known keys under "
            f"'{where or 'root'}': {sorted(names)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _field_type(cls: type | None, dotted: str) -> Any:
    """The declared type of `dotted` in dataclass `cls` (None when unknown)."""
    tp: Any = cls
    for name in dotted.split("."):
        if not _is_dataclass_type(tp):
            return None
        hints = typing.get_type_hints(tp)
        if name not in hints:
            return None
        tp = hints[name]
    return tp


def _is_text(tp: Any) -> bool:
    """A plain `str` field, or `str | None`."""
    if tp is str:
        return True
    args = typing.get_args(tp)
    return (typing.get_origin(tp) in (typing.Union, types.UnionType)) and set(args) == {
        str,
        type(None),
    }


def parse_overrides(overrides: list[str], cls: type | None = None) -> dict[str, Any]:
    """Turn ['a.b=1', 'c=[1,2]'] into a nested dict; values are parsed as YAML, except for the
    text fields of `cls` (paths, names), which keep their text: YAML would read `--out 0123`
    as the number 83 and cut `runs/exp #2` at the '#'."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        tp = _field_type(cls, key)
        if not raw.strip():
            value = None
        elif _is_text(tp) and not (tp is not str and raw.strip() in ("null", "~")):
            value = raw
        else:
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as err:
                problem = str(err).splitlines()[0]
                raise ValueError(f"--set {key}={raw}: not a YAML value ({problem})") from None
        _set_path(tree, key, value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_section(path: str | Path | None, section: str) -> dict[str, Any]:
    """Read one section (`generate`, `extract`, `train`) of a YAML config file; {} when no file is given."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist; pick one from configs/ or pass none")
    try:
        with path.open() as stream:  # a stream: YAML's message names the file, not a string
            data = yaml.safe_load(stream) or {}
    except yaml.YAMLError as err:
        raise ValueError(
            f"config file {path} is not valid YAML: {' '.join(str(err).split())}; fix the "
            f"YAML near the lines named (`dflash {section} --help-config` lists the keys)"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping with sections, got {type(data)}")
    unknown = sorted(set(data) - {"generate", "extract", "train"})
    if unknown:
        raise ValueError(
            f"config file {path}: unknown section(s) {unknown}; use generate/extract/train"
        )
    return data.get(section) or {}


def build_config(
    cls: type[T], path: str | Path | None, section: str, overrides: list[str] | tuple[str, ...]
) -> T:
    """Load `section` of the YAML at `path`, apply overrides, build and validate `cls`."""
    data = _merge(load_section(path, section), parse_overrides(list(overrides), cls))
    cfg = from_dict(cls, data)
    problems = collect_problems(cfg)
    if problems:
        raise ValueError("invalid config:\n  - " + "\n  - ".join(problems))
    return cfg


def collect_problems(cfg: Any, where: str = "") -> list[str]:
    """Run every nested `problems()` method and gather what they report, prefixed by key; a
    NaN or infinity in any field (a list's items too) is one, named by its key, in every
    stage's config: NaN (YAML's .nan, --set KEY=nan) passes each `<= 0` and `< 0` check, every
    comparison with it being false (train's optim.lr failed in AdamW once the model was built,
    its run.time_limit_s never stopped, generate's temperature failed after the target
    loaded), and no key means anything by an infinite value (lr=inf trained NaN)."""
    found: list[str] = []
    if hasattr(cfg, "problems"):
        found += [f"{where + ': ' if where else ''}{p}" for p in cfg.problems()]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            found += collect_problems(value, key)
        elif any(isinstance(v, float) and not math.isfinite(v) for v in _items(value)):
            found.append(f"{key} must be a finite number, got {value}")
    return found


def _items(value: object) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per field, `key (type, default): help`, for `--help-config`."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            lines.append(f"{key}:  {f.metadata.get('help', '')}")
            lines += describe(tp, key + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "required"
        lines.append(f"{key} ({_type_text(tp)}default {default!r}): {f.metadata.get('help', '')}")
    return lines


def _type_text(tp: Any) -> str:
    """A field's type for `--help-config`, ending in the separator before its default: choice
    fields list their values (`one of: a, b; `), since a Literal's name alone says nothing."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"one of: {', '.join(map(str, args))}; "
    if origin in (typing.Union, types.UnionType):
        choices = [a for a in args if typing.get_origin(a) is typing.Literal]
        if choices and len(choices) + 1 == len(args) and type(None) in args:
            values = [v for c in choices for v in typing.get_args(c)]
            return f"one of: {', '.join(map(str, values))}, or null; "
    if origin is list and args and typing.get_origin(args[0]) is typing.Literal:
        return f"list of: {', '.join(map(str, typing.get_args(args[0])))}; "
    return getattr(tp, "__name__", str(tp)).replace("typing.", "") + ", "


def runs_tf32(dtype: str | None, matmul_precision: str | None) -> bool:
    """Whether a target's matmuls run as TF32 (`target.matmul_precision`): only a float32 target
    asked to ("high"); a bf16 target's matmuls are bf16 either way, and records from before the
    option (no value) ran at "highest". Generate, extract, their keys and inspect share it."""
    return dtype == "float32" and matmul_precision == "high"
