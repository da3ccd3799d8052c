"""Textual pipelines: ``"recir-cleanup-dce,recir-cleanup-cse{cross_phase=true}"`` <-> transforms."""

from __future__ import annotations

import ast
import dataclasses
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError
from ._transform import Transform, get_transform

if TYPE_CHECKING:
    from ._pipeline import Pipeline


def _split_top(text: str, sep: str = ",") -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_value(raw: str) -> Any:
    low = raw.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        return raw.strip()
    return tuple(value) if isinstance(value, list) else value


def parse_transform(text: str) -> Transform:
    """``name`` or ``name{key=value,key=value}`` -> a transform instance (values: ints, floats,
    true/false, none, quoted or bare strings, [lists] as tuples)."""
    text = text.strip()
    name, opts = text, ""
    if "{" in text:
        if not text.endswith("}"):
            raise ConfigError(f"malformed transform {text!r}: expected 'name{{key=value,...}}'")
        name, opts = text[: text.index("{")].strip(), text[text.index("{") + 1 : -1]
    cls = get_transform(name)
    kwargs: dict[str, Any] = {}
    fields = (
        {f.name for f in dataclasses.fields(cls.Options)} if dataclasses.is_dataclass(cls.Options) else set()
    )
    for item in _split_top(opts):
        if "=" not in item:
            raise ConfigError(f"{name}: option {item!r} must be key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            raise ConfigError(f"{name}: unknown option {key!r}; options are {sorted(fields) or 'none'}")
        kwargs[key] = _parse_value(value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{name}: bad options {kwargs}: {exc}") from None


def format_transform(transform: Transform) -> str:
    """The textual form of one transform: its name, plus ``{k=v}`` for options that differ from defaults."""
    opts = transform.options
    if not dataclasses.is_dataclass(opts):
        return transform.name
    try:
        options_type: Any = type(opts)
        default = options_type()
    except TypeError:  # options without defaults: show them all
        default = None
    changed = [
        f"{f.name}={_format_value(getattr(opts, f.name))}"
        for f in dataclasses.fields(opts)
        if default is None or getattr(opts, f.name) != getattr(default, f.name)
    ]
    return f"{transform.name}{{{','.join(changed)}}}" if changed else transform.name


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list, frozenset, set)):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value.replace("-", "").isidentifier() else repr(value)
    if value is None or isinstance(value, (int, float)):
        return "none" if value is None else str(value)
    # Rich option objects (a ShardingPlan, a Mesh) print as a short tag, not their whole table.
    return f"<{type(value).__name__}>"


def parse_pipeline(text: str, **pipeline_kwargs: Any) -> Pipeline:
    """``"recir-cleanup-dce,recir-cleanup-cse{cross_phase=false}"`` -> a :class:`Pipeline`."""
    from ._pipeline import Pipeline

    return Pipeline([parse_transform(part) for part in _split_top(text)], **pipeline_kwargs)
