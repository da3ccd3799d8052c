"""Pipeline: runs transforms in order with verification, timings, provenance, dumps and bisection switches.

Textual pipelines (``"recir-cleanup-dce,recir-cleanup-cse"``) come from :func:`parse_pipeline`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.fx as fx

from ._errors import ConfigError
from ._pipeline_text import format_transform, parse_pipeline
from ._step import PROVENANCE_KEY, StepGraph
from ._transform import Transform
from ._verify import format_val, verify, verify_level

_SKIP_META = (PROVENANCE_KEY, "stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


@dataclasses.dataclass
class TransformRecord:
    """What one transform did inside a pipeline run."""

    position: int
    name: str
    status: str  # "changed" | "unchanged" | "disabled"
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    added: int = 0
    removed: int = 0
    modified: int = 0
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _arg_text(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return ("%", a.name)
    if isinstance(a, (list, tuple)):
        return tuple(_arg_text(x) for x in a)
    return repr(a)


def _node_signature(node: fx.Node) -> tuple[Any, ...]:
    """What identifies a node's computation: op, target, argument names and its recir.* metadata."""
    meta = tuple(
        sorted((k, repr(v)) for k, v in node.meta.items() if k.startswith("recir.") and k not in _SKIP_META)
    )
    kwargs = tuple(sorted((k, _arg_text(v)) for k, v in node.kwargs.items()))
    return (node.op, str(node.target), _arg_text(node.args), kwargs, meta, format_val(node.meta.get("val")))


_IMMUTABLE = (str, int, float, bool, type(None))


class _Signer:
    """:func:`_node_signature` for a pipeline run, remembered per node while what it reads is unchanged.

    A node whose args and kwargs (fx replaces them, never edits them), value, target and inputs' names
    are the same objects as when it was signed, and whose recir.* metadata keys and values are the same
    immutable objects, has the same signature; anything else (a mutable metadata value among them) is
    signed again. Most transforms of a lowering rewrite a few nodes of thousands in place.
    """

    def __init__(self) -> None:
        self._memo: dict[fx.Node, tuple[tuple[Any, ...], tuple[Any, ...], list[tuple[fx.Node, str]]]] = {}

    def __call__(self, node: fx.Node) -> tuple[Any, ...]:
        meta = node.meta
        tagged = tuple(
            x for k, v in meta.items() if k.startswith("recir.") and k not in _SKIP_META for x in (k, v)
        )
        key = (node.op, node.target, node.args, node.kwargs, meta.get("val"), node.name, *tagged)
        hit = self._memo.get(node)
        if (
            hit is not None
            and len(hit[0]) == len(key)
            and all(a is b for a, b in zip(hit[0], key))
            and all(isinstance(v, _IMMUTABLE) for v in tagged)
            and all(n.name == name for n, name in hit[2])
        ):
            return hit[1]
        sig = _node_signature(node)
        self._memo[node] = (key, sig, [(n, n.name) for n in node.all_input_nodes])
        return sig


def snapshot(step: StepGraph, signer: _Signer | None = None) -> dict[str, tuple[Any, ...]]:
    """Node name -> signature, to diff a graph before and after a transform."""
    sign = signer or _node_signature
    return {n.name: sign(n) for n in step.graph.nodes}


def stamp_provenance(
    step: StepGraph, before: Mapping[str, tuple[Any, ...]], name: str
) -> tuple[int, int, int]:
    """Append ``name`` to ``recir.provenance`` of nodes created or changed since ``before``.

    Returns (added, removed, modified) node counts.
    """
    added, removed, modified, _ = _stamp(step, before, name, _node_signature)
    return added, removed, modified


def _stamp(
    step: StepGraph,
    before: Mapping[str, tuple[Any, ...]],
    name: str,
    sign: Callable[[fx.Node], tuple[Any, ...]],
) -> tuple[int, int, int, dict[str, tuple[Any, ...]]]:
    """:func:`stamp_provenance`, and the graph's snapshot now (the next transform's ``before``)."""
    added = modified = 0
    now: dict[str, tuple[Any, ...]] = {}
    for node in step.graph.nodes:
        sig = now[node.name] = sign(node)
        old = before.get(node.name)
        if old is not None and old == sig:
            continue
        if old is None:
            added += 1
        else:
            modified += 1
        if node.op in ("placeholder", "output"):
            continue
        prov = list(node.meta.get(PROVENANCE_KEY, ()))
        if not prov or prov[-1] != name:
            prov.append(name)
        node.meta[PROVENANCE_KEY] = prov
    removed = sum(1 for n in before if n not in now)
    return added, removed, modified, now


def _env_disabled() -> set[str]:
    return {s.strip() for s in os.environ.get("RECIR_DISABLE", "").split(",") if s.strip()}


class Pipeline:
    """Run ``transforms`` in order: ``step = Pipeline([...]).run(step)``.

    - Verification follows ``RECIR_VERIFY`` (or ``verify_level=``): at 2 the input and the result of
      every transform are verified, so an error names the transform that broke the graph; at 1 only
      the final graph; at 0 nothing.
    - ``disable`` (and env ``RECIR_DISABLE=name,name``) skips transforms by name, to bisect a miscompile.
    - ``dump_dir`` (or env ``RECIR_DUMP_DIR``) receives ``NNN-<name>.before.txt`` / ``.after.txt``
      (NNN continues from the files already there, so successive pipelines never overwrite each other).
    - ``records`` / :meth:`report` give per-transform wall time, node deltas and stats.
    - Transforms marked ``execution_form`` (a lowering's rewrite into its backend's calling convention)
      come last and are not verified; ``verified`` is the last StepGraph that is still valid IR.
    """

    def __init__(
        self,
        transforms: Sequence[Transform | type[Transform] | str] | str,
        *,
        disable: Iterable[str] = (),
        dump_dir: str | os.PathLike[str] | None = None,
        verify_level: int | None = None,
        name: str = "pipeline",
    ) -> None:
        items: list[Transform] = []
        for t in [transforms] if isinstance(transforms, str) else transforms:
            if isinstance(t, str):
                items.extend(parse_pipeline(t).transforms)
            elif isinstance(t, Transform):
                items.append(t)
            elif isinstance(t, type) and issubclass(t, Transform):
                items.append(t())
            else:
                raise ConfigError(
                    f"Pipeline: expected a Transform (instance or class) or a pipeline string, got {t!r}"
                )
        self.transforms: list[Transform] = items
        self.disable = set(disable)
        self.dump_dir = dump_dir
        self.verify_level = verify_level
        self.name = name
        self.records: list[TransformRecord] = []
        self._level_used = 0
        self.verified: StepGraph | None = None
        forms = [t.execution_form for t in items]
        if any(a and not b for a, b in zip(forms, forms[1:])):
            first = next(t for t in items if t.execution_form)
            raise ConfigError(
                f"{name}: transform {first.name} rewrites into a backend's calling convention "
                "(execution_form), so only other execution-form transforms may follow it. Fix: move it last."
            )

    def __str__(self) -> str:
        return ",".join(format_transform(t) for t in self.transforms)

    def __repr__(self) -> str:
        return f"Pipeline({str(self)!r})"

    def run(self, step: StepGraph) -> StepGraph:
        level = verify_level() if self.verify_level is None else self.verify_level
        self._level_used = level
        known = {t.name for t in self.transforms} | set(registered_names())
        if self.disable - known:
            raise ConfigError(
                f"{self.name}: cannot disable unknown transform(s) {sorted(self.disable - known)}; "
                f"registered: {', '.join(sorted(known))}"
            )
        env = _env_disabled()
        if env - known:  # RECIR_DISABLE is process-wide: the transform may live in a module not imported yet
            warnings.warn(
                f"RECIR_DISABLE names transform(s) {sorted(env - known)} that are not registered (yet); "
                "check the spelling",
                stacklevel=2,
            )
        disabled = self.disable | env
        dump = self.dump_dir if self.dump_dir is not None else os.environ.get("RECIR_DUMP_DIR") or None
        dump_path = Path(dump) if dump else None
        if dump_path is not None:
            dump_path.mkdir(parents=True, exist_ok=True)
        self.records = []
        self.verified = step
        signer = _Signer()
        before = snapshot(step, signer)
        if level >= 2:
            verify(step, level=level, transform=f"(input of {self.name})")
        for i, transform in enumerate(self.transforms, start=1):
            if transform.name in disabled:
                self.records.append(TransformRecord(i, transform.name, "disabled"))
                continue
            stem = f"{_next_dump_number(dump_path):03d}-{transform.name}" if dump_path else ""
            if dump_path is not None:
                _dump(dump_path / f"{stem}.before.txt", step, f"before {transform!r}")
            t0 = time.perf_counter()
            try:
                result = transform(step)
            except Exception as exc:
                exc.add_note(
                    f"while running transform {transform.name} (position {i} of {self.name}: {self})"
                )
                raise
            seconds = time.perf_counter() - t0
            new = result.step
            added, removed, modified, now = _stamp(new, before, transform.name, signer)
            if added or removed or modified or list(before) != list(now):
                new.graph_module.recompile()  # the code follows the graph (unchanged graph: unchanged code)
            nodes_before, before = len(before), now
            self.records.append(
                TransformRecord(
                    i,
                    transform.name,
                    "changed" if result.changed else "unchanged",
                    seconds,
                    nodes_before,
                    len(new.graph.nodes),
                    added,
                    removed,
                    modified,
                    dict(result.stats),
                )
            )
            if dump_path is not None:
                _dump(dump_path / f"{stem}.after.txt", new, f"after {transform!r}: {self.records[-1].stats}")
            if transform.execution_form:
                step = new
                continue
            if level >= 2:
                verify(new, level=level, transform=transform.name)
            step = self.verified = new
        if level == 1:
            verify(
                self.verified,
                level=1,
                transform=f"{self.name} [{self}] (RECIR_VERIFY=1 checks the end only; "
                "rerun with RECIR_VERIFY=2 to name the transform)",
            )
        return step

    __call__ = run

    def report(self) -> str:
        """A table: one row per transform with status, wall time, node counts and stats."""
        rows = [("#", "transform", "status", "ms", "nodes", "+add", "-del", "~mod", "stats")]
        for r in self.records:
            if r.status == "disabled":
                rows.append((str(r.position), r.name, "disabled", "", "", "", "", "", ""))
                continue
            stats = ", ".join(f"{k}={_short(v)}" for k, v in r.stats.items())
            rows.append(
                (
                    str(r.position),
                    r.name,
                    r.status,
                    f"{r.seconds * 1e3:.1f}",
                    f"{r.nodes_before}->{r.nodes_after}",
                    str(r.added),
                    str(r.removed),
                    str(r.modified),
                    stats,
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]) - 1)]
        lines = [f"{self.name}: {self} (RECIR_VERIFY={self._level_used})"]
        for row in rows:
            cells = [
                row[c].ljust(widths[c]) if c <= 2 else row[c].rjust(widths[c]) for c in range(len(widths))
            ]
            lines.append("  ".join(cells + [row[-1]]).rstrip())
        total = sum(r.seconds for r in self.records)
        lines.append(f"total {total * 1e3:.1f} ms over {len(self.records)} transforms")
        return "\n".join(lines)


def _short(value: Any, limit: int = 100) -> str:
    """A stat for the report's one line: a long mapping or list becomes its size and first keys (the
    whole value stays in ``records[i].stats``)."""
    text = str(value)
    if len(text) <= limit or not isinstance(value, (Mapping, list, tuple, set)):
        return text
    keys = list(value)[:3]
    return f"<{len(value)}: {', '.join(map(str, keys))}, ...>"


def _next_dump_number(directory: Path) -> int:
    """Numbers continue across pipelines sharing a dump directory, so no run overwrites another's."""
    numbers = [int(p.name.split("-", 1)[0]) for p in directory.glob("[0-9][0-9][0-9]*-*.txt")]
    return max(numbers, default=0) + 1


def _dump(path: Path, step: StepGraph, header: str) -> None:
    path.write_text(f"# {header}\n# {step.phase_counts()}\n{step.format_graph(vals=True)}\n")


def registered_names() -> list[str]:
    from ._transform import registered_transforms

    return sorted(registered_transforms())
