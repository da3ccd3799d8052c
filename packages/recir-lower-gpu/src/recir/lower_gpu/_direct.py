"""Inductor without AOTAutograd for a graph that is already functional ATen (``GPUOptions(aot_autograd=False)``).

Inductor's ``compile_fx`` hands every graph to AOTAutograd first, which traces it twice (once to collect
its metadata, once to build the functional graph with Inductor's decompositions), both times through
functionalization. A StepGraph, and each piece ``regions="repeated"`` cuts from one, is ATen already:
functional, its only mutations the in-place epilogue's ``copy_`` into its inputs at the end, which is
the form AOTAutograd hands Inductor for an inference graph (``keep_inference_input_mutations``). What
the graph still needs is the decomposition table, so here one ``make_fx`` trace applies it, without
functionalization; Inductor's joint-graph passes run on the result (as ``compile_fx`` runs them on an
inference graph) and ``compile_fx_inner`` compiles it, through Inductor's FX graph cache as before.
Full-size DLRMv3 at UIH 256 (fp32, one budget; 2-core AMD EPYC): the ten distinct pieces' compile
took 29.9 against 37.4 s, the trace 3.3 s of it against AOTAutograd's 9.2 s.

A cached compile must not pay the trace: the decomposed graph (after the joint passes) is kept next to
Inductor's cache, keyed by the graph's code, its inputs' shapes, strides and dtypes, the Inductor patches
and the torch version, and a later compile loads it and asks Inductor's FX graph cache for its kernels.
A graph that holds tensor constants (``get_attr``) goes through ``compile_fx`` instead.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import pickle
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ._files import write_atomic

log = logging.getLogger("recir.lower_gpu")
stats: Counter[str] = Counter()  # decomposed graphs: "traced", "loaded" (from the cache folder), "stored"

_FORMAT = 1  # bump when what is stored changes
_SUBDIR = "recir-decomposed"


def can_compile_direct(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` can skip AOTAutograd: no tensor constants to key or to lift."""
    return not any(n.op == "get_attr" for n in gm.graph.nodes)


_PASSES = ("joint_custom_pre_pass", "joint_custom_post_pass", "post_grad_custom_pre_pass",
           "post_grad_custom_post_pass", "_pre_fusion_custom_pass")  # fmt: skip


def _token(value: Any) -> str:
    """A process-independent text for a config value (sets sorted; a custom pass by its uuid)."""
    uuid = getattr(value, "uuid", None)
    if callable(uuid):  # Inductor's CustomGraphPass: its uuid is its cache identity
        return f"{type(value).__qualname__}:{uuid()}"
    if isinstance(value, (set, frozenset)):
        return repr(sorted(map(_token, value)))
    if isinstance(value, dict):
        return repr(sorted((str(k), _token(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return repr([_token(v) for v in value])
    return repr(value)


def cache_key(gm: fx.GraphModule, example: Sequence[torch.Tensor]) -> str:
    """A key of everything the decomposed graph depends on: its code, its inputs, Inductor's config (as
    it stands: call inside the compile's patches) and torch."""
    from torch._inductor import config as inductor_config

    h = hashlib.sha256()
    h.update(f"{_FORMAT}|{torch.__version__}|{torch.version.git_version}\n".encode())
    h.update(gm.code.encode())
    for t in example:
        h.update(f"{tuple(t.shape)}|{tuple(t.stride())}|{t.dtype}|{t.device.type}\n".encode())
    config = inductor_config.save_config_portable()
    config.update((name, getattr(inductor_config, name, None)) for name in _PASSES)
    for name in sorted(config):
        h.update(f"{name}={_token(config[name])}\n".encode())
    return h.hexdigest()


class _Ref(tuple):
    """A node reference in a stored graph (its name)."""


_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _encode_target(target: Any) -> tuple[str, str] | None:
    if isinstance(target, torch._ops.OpOverload):
        return ("op", f"{target.namespace}.{target._opname}.{target._overloadname}")
    if getattr(target, "__module__", None) == "_operator":
        return ("operator", target.__name__)
    return None


def _decode_target(kind: str, name: str) -> Any:
    import operator

    if kind == "operator":
        return getattr(operator, name)
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _encode_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return _Ref((a.name,))
    if isinstance(a, (list, tuple)):
        items = [_encode_arg(x) for x in a]
        return items if isinstance(a, list) else tuple(items)
    if isinstance(a, dict):
        return {k: _encode_arg(v) for k, v in a.items()}
    if isinstance(a, _ATOMS):
        return a
    raise TypeError(f"cannot store an argument of type {type(a).__name__}")


def encode_graph(gm: fx.GraphModule) -> list[tuple] | None:
    """``gm``'s graph as plain data (ops by name, nodes by name), or None when it holds anything else
    (tensor constants, modules, Python callables). Not pickle of the GraphModule: that re-traces the code
    symbolically on load, which runs every op without a node input (a ``scalar_tensor``) into a constant."""
    tracer = getattr(gm, "_tracer_cls", None)
    # both in Inductor's cache key (which pickles the GraphModule)
    rows: list[tuple] = [(type(gm).__name__, tracer and (tracer.__module__, tracer.__qualname__))]
    try:
        for n in gm.graph.nodes:
            target: Any = n.target
            if n.op == "call_function":
                target = _encode_target(n.target)
                if target is None:
                    return None
            elif n.op not in ("placeholder", "output"):
                return None
            rows.append((n.name, n.op, target, _encode_arg(n.args), _encode_arg(n.kwargs)))
    except TypeError:
        return None
    return rows


def decode_graph(rows: list[tuple]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    (class_name, tracer), *rows = rows

    def arg(a: Any) -> Any:
        if isinstance(a, _Ref):
            return env[a[0]]
        if isinstance(a, list):
            return [arg(x) for x in a]
        if isinstance(a, tuple):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return a

    for name, op, target, args, kwargs in rows:
        if op == "call_function":
            target = _decode_target(*target)
        node = graph.create_node(op, target, arg(args), arg(kwargs), name=name)
        env[name] = node
    gm = fx.GraphModule(torch.nn.Module(), graph, class_name=class_name)
    if tracer is not None:
        module, qualname = tracer
        gm._tracer_cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    return gm


def _load(path: Path | None) -> fx.GraphModule | None:
    if path is None or not path.exists():
        return None
    try:
        with path.open("rb") as f:
            return decode_graph(pickle.load(f))
    except Exception as exc:  # a torn or stale entry is a miss, never an error
        log.info("recir.lower_gpu: ignoring the unreadable decomposed graph %s (%s)", path, exc)
        return None


def _store(path: Path | None, gm: fx.GraphModule) -> None:
    if path is None:
        return
    rows = encode_graph(gm)
    if rows is None or decode_graph(rows).code != gm.code:
        log.info("recir.lower_gpu: a decomposed graph not kept (it holds values that are not plain data)")
        return
    try:
        write_atomic(path, pickle.dumps(rows))  # a reader sees the old entry or the whole new one
        stats["stored"] += 1
    except Exception as exc:  # the cache is an optimisation: a failed write costs the next compile a trace
        log.info("recir.lower_gpu: could not keep the decomposed graph in %s (%s)", path, exc)


def decompose(gm: fx.GraphModule, example: Sequence[torch.Tensor], fake_mode: Any) -> fx.GraphModule:
    """``gm`` retraced once through Inductor's decomposition table (no functionalization), on ``example``'s
    fake tensors, so every node carries its fake value."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    with enable_python_dispatcher(), fake_mode:
        return make_fx(fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(*example)


class DirectCompiled:
    """An Inductor-compiled graph called with positional arguments (Inductor's own call takes a list it
    empties)."""

    def __init__(self, compiled: Callable[[list[Any]], Any]) -> None:
        self.compiled = compiled

    def __call__(self, *args: Any) -> Any:
        return self.compiled(list(args))


def compile_direct(
    gm: fx.GraphModule,
    example: Sequence[torch.Tensor],
    fake_mode: Any,
    cache_dir: Path | None,
) -> DirectCompiled:
    """Compile ``gm`` (functional ATen, fake ``example`` inputs of ``fake_mode``) with Inductor's
    ``compile_fx_inner``, skipping AOTAutograd. Call inside the Inductor config patches: they are read from
    ``torch._inductor.config`` for the key. ``cache_dir``: where decomposed graphs are kept (None: not kept)."""
    from torch._inductor.compile_fx import _recursive_joint_graph_passes, compile_fx_inner
    from torch._inductor.virtualized import V

    path = None if cache_dir is None else cache_dir / _SUBDIR / f"{cache_key(gm, example)}.pkl"
    prepared = _load(path)
    with V.set_fake_mode(fake_mode):
        if prepared is None:
            prepared = decompose(gm, example, fake_mode)
            _recursive_joint_graph_passes(prepared)
            stats["traced"] += 1
            _store(path, prepared)
        else:
            stats["loaded"] += 1
        out = prepared.graph.output_node()
        outputs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        out.meta["user_visible_output_idxs"] = [i for i, a in enumerate(outputs) if isinstance(a, fx.Node)]
        compiled = compile_fx_inner(prepared, list(example), is_inference=True)
    return DirectCompiled(compiled)
