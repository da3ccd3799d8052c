"""Trace a StepGraph's ATen graph into a JAX function through torchax, one fx node at a time.

Each node runs inside RecIR's torchax environment; a failure names the op, the node and a graph window.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.fx as fx
from recir.transforms import LoweringError, StepGraph, format_window
from torchax.tensor import Environment, OperatorNotFound

from ._registry import aten_reference_for, jax_lowering_for, op_qualname, registered_jax_lowerings

_ENV: Environment | None = None
_INSTALLED: dict[str, Callable[..., Any]] = {}
_NATIVE_NAMESPACES = ("aten", "prims", "_c10d_functional")


def recir_env() -> Environment:
    """RecIR's own torchax environment (not torchax's default one), with every registered lowering."""
    global _ENV, _INSTALLED
    lowerings = registered_jax_lowerings()
    if _ENV is None or lowerings != _INSTALLED:  # a fresh environment drops overrides since unregistered
        _ENV, _INSTALLED = Environment(), lowerings
    # Packets first, then exact overloads: torchax looks an op up by overload before its packet.
    for name in sorted(lowerings, key=lambda n: "." in n.split("::", 1)[1]):
        for op in _resolve(name):
            _ENV.override_op_definition(op, _as_torch_impl(_ENV, lowerings[name]))
    return _ENV


def _resolve(name: str) -> list[Any]:
    ns, rest = name.split("::", 1)
    base, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns), base, None)
    if packet is None:
        return []
    if overload:
        return [getattr(packet, overload)]
    return [packet, *(getattr(packet, o) for o in packet.overloads())]


def _as_torch_impl(env: Environment, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A JAX lowering as the torch-level callable ``override_op_definition`` expects."""

    def impl(*args: Any, **kwargs: Any) -> Any:
        jargs, jkwargs = env.t2j_iso((args, kwargs))
        return env.j2t_iso(fn(*jargs, **jkwargs))

    impl.__name__ = getattr(fn, "__name__", "jax_lowering")
    return impl


_FIX = (
    "Fix: register a JAX lowering with recir.lower_tpu.register_jax_lowering({op!r}, fn) (JAX arrays in, "
    "JAX arrays out), override torchax's with Environment.override_op_definition, or decompose the op "
    "before lowering (a decomposition at capture or a recir-transforms rewrite)."
)


def lowering_error(node: fx.Node, what: str) -> LoweringError:
    op = op_qualname(node.target) if isinstance(node.target, torch._ops.OpOverload) else str(node.target)
    err = LoweringError(
        f"recir.lower_tpu: op {op} at node %{node.name} {what}\n{format_window(node.graph, node, radius=4, mark='--> ')}\n"
        + _FIX.format(op=op)
    )
    err.op, err.node = op, node.name  # type: ignore[attr-defined]
    return err


def check_lowerings(step: StepGraph, env: Environment) -> None:
    """Fail early for custom ops with no lowering; install the ATen references of ``recir::*`` ops."""
    for node in step.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace in _NATIVE_NAMESPACES or jax_lowering_for(target) is not None:
            continue
        ref = aten_reference_for(target)
        if ref is None:
            raise lowering_error(
                node,
                "has no lowering: no JAX lowering is registered and no pure-ATen reference "
                f"({target._schema.name.split('::')[-1]}_reference next to the op's definition) exists.",
            )
        env.override_op_definition(target, ref)


class _JaxTracer(fx.Interpreter):
    """Runs the graph on torchax tensors; errors are re-raised as LoweringError naming the node."""

    def __init__(
        self, gm: fx.GraphModule, env: Environment, constrain: Callable[[fx.Node], Any] | None = None
    ):
        super().__init__(gm)
        # Not ``self.env``: fx.Interpreter.run() rebinds that name to its node -> value dict.
        self.tx_env = env
        self.constrain = constrain
        self.extra_traceback = False  # our LoweringError already names the node and its window

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        try:
            with jax.named_scope(n.name):
                out = super().run_node(n)
        except LoweringError:
            raise
        except OperatorNotFound as e:
            raise lowering_error(n, f"has no lowering in torchax or RecIR ({e}).") from e
        except OverflowError as e:
            raise lowering_error(
                n,
                f"overflows 32-bit integers ({e}). Fix: compile with TPUOptions(x64=True) (or x64=None, "
                "which turns it on for graphs with large integer constants or rng slots).",
            ) from e
        except Exception as e:
            raise lowering_error(n, f"failed to lower: {type(e).__name__}: {e}") from e
        _check_shapes(n, out)
        sharding = self.constrain(n) if self.constrain is not None else None
        if sharding is not None and isinstance(out, torch.Tensor):
            # recir.sharding on the node (set by recir.distributed's planner) becomes a GSPMD constraint.
            out = self.tx_env.j2t_iso(jax.lax.with_sharding_constraint(self.tx_env.t2j_iso(out), sharding))
        return out

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and not hasattr(value, "_env"):
            return self.tx_env.to_xla(value)
        return value


def _check_shapes(node: fx.Node, out: Any) -> None:
    """A lowering whose result shape differs from the graph's FakeTensor is a bug: say so at the node."""
    val = node.meta.get("val")
    pairs = (
        zip(val, out) if isinstance(val, (tuple, list)) and isinstance(out, (tuple, list)) else [(val, out)]
    )
    for expected, actual in pairs:
        if not isinstance(expected, torch.Tensor) or not isinstance(actual, torch.Tensor):
            continue
        want = tuple(expected.shape)
        if all(isinstance(s, int) for s in want) and tuple(actual.shape) != want:
            raise lowering_error(
                node, f"lowered to shape {list(actual.shape)}, but the graph expects {list(want)}."
            )


def jax_step_fn(
    step: StepGraph,
    env: Environment,
    out_dtypes: Sequence[Any],
    constrain: Callable[[fx.Node], Any] | None = None,
) -> Callable[[list[jax.Array], list[jax.Array]], tuple[list[jax.Array], list[jax.Array]]]:
    """``(state, batch) -> (new_state, outputs)`` over JAX arrays, the graph traced through torchax.

    ``constrain(node)`` may return a sharding for the node's value (``jax.lax.with_sharding_constraint``).
    """
    gm = step.graph_module
    n_state = len(step.signature.state)

    def jax_step(state: list[jax.Array], batch: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
        args = env.j2t_iso([*state, *batch])
        with env, warnings.catch_warnings():
            # Without x64, 64-bit graph values are 32-bit by design (TPUOptions.x64); JAX warns each time.
            warnings.filterwarnings("ignore", message="Explicitly requested dtype (int64|float64)")
            out = _JaxTracer(gm, env, constrain).run(*args)
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        jflat = [jnp.asarray(x) for x in env.t2j_iso(flat)]
        # Each output keeps its slot's dtype: a donated state buffer is reused only when dtypes agree.
        jflat = [x if x.dtype == dt else x.astype(dt) for x, dt in zip(jflat, out_dtypes)]
        return jflat[:n_state], jflat[n_state:]

    return jax_step
