"""StepGraph: a pure training step ``(state..., batch...) -> (new_state..., outputs...)`` as a torch.fx graph.

It is also the reference interpreter: ``new_state, outputs = step(state, batch)`` runs the graph eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ._errors import ConfigError
from ._signature import Signature, StateSlot
from ._slot_names import parse_slot_name

PHASE_KEY = "recir.phase"
REGION_KEY = "recir.region"
SHARDING_KEY = "recir.sharding"
OVERRIDE_KEY = "recir.override"
PROVENANCE_KEY = "recir.provenance"
#: The module path a node computes for (``layers.3.uvqk``; set by recir-capture, "" at the top level):
#: forward nodes from the module running when they were traced, backward nodes from the forward values
#: and parameters they read, optimizer nodes from their parameter. Profiles group time by it.
SCOPE_KEY = "recir.scope"
#: On the boolean keep-mask node of each dropout (set by recir-capture): a value the forward and the
#: backward both read, cheap to store (one byte per element) and costly to recompute (a counter hash).
#: Lowerings may store it once instead of letting the backend recompute it in every consumer.
RNG_MASK_KEY = "recir.rng_mask"
#: On the output node of each dropout (set by recir-capture; the value is the drop probability): the
#: node is ``input * scaled_mask``, and an inference graph replaces it by its first argument.
DROPOUT_KEY = "recir.dropout"
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")

#: Resolves the initial value of one state slot from a live model and optimizer, or returns None
#: when it does not know the slot (the next initializer is then asked).
SlotInitializer = Callable[[StateSlot, nn.Module, "torch.optim.Optimizer | None"], "torch.Tensor | None"]


def param_buffer_initializer(
    slot: StateSlot, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> torch.Tensor | None:
    """The default initializer: ``param:<path>`` and ``buffer:<path>`` slots read the live module."""
    value = _model_tensor(slot, model)
    return None if value is None else value.clone()


def _model_tensor(slot: StateSlot, model: nn.Module, optimizer: Any = None) -> torch.Tensor | None:
    """The model's own (detached) tensor for a ``param:<path>`` or ``buffer:<path>`` slot, else None."""
    del optimizer
    if slot.kind not in ("param", "buffer"):
        return None
    name = parse_slot_name(slot.name)
    if name.kind == slot.kind == "param":
        return model.get_parameter(str(name.path)).detach()
    if name.kind == slot.kind == "buffer":
        return model.get_buffer(str(name.path)).detach()
    return None


def lazy_graph_module(root: nn.Module | dict[str, Any], graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that writes its Python code only when it is run, printed or pickled.

    Every ``recompile()`` of an eager GraphModule generates and executes the Python source of the whole
    graph: about 0.3 s for a full-size DLRMv3 step, and a lowering pipeline recompiled it after every
    rewrite only to hand the graph to a backend that never ran that code (about 1 s of a 6-7 s cached
    compile on a 2-core CPU). torch.fx's ``_LazyGraphModule`` (what Inductor uses for the same reason)
    defers that to the first use; on a torch without it this is a plain GraphModule.
    """
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - private; in torch 2.9.1, 2.10.0 and 2.12.1 (CI's three)
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with its own graph (each node's metadata dict copied shallowly, tensors shared),
    generating its code lazily (:func:`lazy_graph_module`)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})  # node_copy gives each node a shallow copy of its meta
    graph.output(out)
    return lazy_graph_module(gm, graph)


@dataclasses.dataclass
class StepGraph:
    """A functional ``torch.fx.GraphModule`` with an explicit :class:`Signature`.

    Placeholders are exactly ``signature.state + signature.batch`` in order; the output is one flat
    tuple ``new_state + outputs`` (INV-3). Node metadata carries ``val`` and ``recir.*`` keys.

    A StepGraph is itself a :class:`CompiledStep` (its reference interpreter is a backend like the
    lowerings, compiling nothing), so code written against that protocol runs it unchanged.
    """

    graph_module: fx.GraphModule
    signature: Signature
    dynamic: bool = False
    initializers: tuple[SlotInitializer, ...] = ()
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def compile_seconds(self) -> float:
        """0.0: the reference interpreter compiles nothing (the CompiledStep protocol)."""
        return 0.0

    # -- construction ---------------------------------------------------------------------------
    def replace(self, **changes: Any) -> StepGraph:
        """A copy with some fields changed (``meta`` is copied shallowly)."""
        changes.setdefault("meta", dict(self.meta))
        return dataclasses.replace(self, **changes)

    def copy(self) -> StepGraph:
        """A copy with its own graph (node metadata copied shallowly, tensors shared), so rewrites of
        the copy leave this step intact."""
        return self.replace(graph_module=copy_graph_module(self.graph_module))

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    # -- running (the reference interpreter) ----------------------------------------------------
    def __call__(self, state: Sequence[torch.Tensor], batch: Any) -> tuple[list[torch.Tensor], Any]:
        """Run one step eagerly. Returns ``(new_state, outputs)``; outputs is a tuple, the loss first."""
        n = len(self.signature.state)
        if len(state) != n:
            raise ConfigError(
                f"step expects {n} state tensors (signature order), got {len(state)}. "
                "Fix: build state with step.init_state(model, optimizer)."
            )
        flat_batch = self.signature.flatten_batch(batch)
        out = self.graph_module(*state, *flat_batch)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        return out[:n], self.unflatten_outputs(out[n:])

    def unflatten_outputs(self, flat: Sequence[Any]) -> Any:
        if self.signature.output_spec is not None:
            return pytree.tree_unflatten(list(flat), self.signature.output_spec)
        return tuple(flat)

    # -- state ------------------------------------------------------------------------------------
    def init_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, share_model: bool = False
    ) -> list[torch.Tensor]:
        """The flat state list (signature order) from a live model and optimizer; never aliases them, except
        with ``share_model``: then the parameter and buffer slots are the model's own tensors (detached,
        not copied), for a runner that updates state in place and so trains the model itself with no
        second copy of its weights. Optimizer slots are fresh either way."""
        return [
            self.init_slot(slot, model, optimizer, share_model=share_model) for slot in self.signature.state
        ]

    def init_slot(
        self,
        slot: StateSlot,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        share_model: bool = False,
    ) -> torch.Tensor:
        """One slot of :meth:`init_state`: a runner that copies the state slot by slot builds each value
        only when it copies it (a table stored in another dtype than the model's is then converted one
        table at a time)."""
        chain = (*self.initializers, _model_tensor if share_model else param_buffer_initializer)
        value = None
        for init in chain:
            value = init(slot, model, optimizer)
            if value is not None:
                break
        if value is None:
            raise ConfigError(
                f"no initializer knows state slot {slot.name!r} ({slot.kind}). "
                "Fix: pass the model and optimizer the step was captured from, or add a SlotInitializer."
            )
        if tuple(value.shape) != slot.shape or value.dtype != slot.dtype:
            raise ConfigError(
                f"state slot {slot.name!r}: expected {slot.dtype}{list(slot.shape)}, "
                f"the model/optimizer gives {value.dtype}{list(value.shape)}"
            )
        return value

    def state_dict(self, state: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map a flat state list back to slot names."""
        if len(state) != len(self.signature.state):
            raise ConfigError(f"expected {len(self.signature.state)} state tensors, got {len(state)}")
        return {slot.name: t for slot, t in zip(self.signature.state, state)}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The flat state list from a name -> tensor mapping (strict: every slot, no extras)."""
        names = self.signature.state_names()
        missing = [n for n in names if n not in state_dict]
        extra = [k for k in state_dict if k not in set(names)]
        if missing or extra:
            raise ConfigError(
                f"state_dict does not match the signature: missing {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}"
            )
        out = []
        for slot in self.signature.state:
            t = state_dict[slot.name]
            if tuple(t.shape) != slot.shape:
                raise ConfigError(
                    f"state {slot.name!r}: expected shape {list(slot.shape)}, got {list(t.shape)}"
                )
            out.append(t.to(slot.dtype))
        return out

    # -- inspection -------------------------------------------------------------------------------
    def phase_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PHASES, 0)
        for node in self.graph.nodes:
            phase = node.meta.get(PHASE_KEY)
            if phase in counts:
                counts[phase] += 1
        return counts

    def format_graph(self, max_nodes: int | None = None, *, vals: bool = False) -> str:
        """A compact listing: one line per node, ``%name = target(args)  # phase`` (``vals``: plus shapes)."""
        return "\n".join(
            format_node(n, vals=vals)
            for i, n in enumerate(self.graph.nodes)
            if max_nodes is None or i < max_nodes
        )

    def __str__(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in self.phase_counts().items())
        head = f"StepGraph({len(self.graph.nodes)} nodes: {counts}{', dynamic' if self.dynamic else ''})"
        return f"{head}\n{self.signature}\ngraph:\n{self.format_graph()}"

    __repr__ = __str__


def _fmt_arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]"
    return repr(a)


def _fmt_val(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}[{', '.join(str(d) for d in val.shape)}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_fmt_val(v) for v in val) + ")"
    return "" if val is None else repr(val)


def format_node(node: fx.Node, *, vals: bool = False) -> str:
    """One readable line for a node (used by printing, dumps and error windows).

    ``vals`` appends the node's ``val`` (``float32[3, 8]``) after the phase comment.
    """
    phase = node.meta.get(PHASE_KEY)
    notes = [str(phase)] if phase else []
    if vals and node.op != "output" and node.meta.get("val") is not None:
        notes.append(_fmt_val(node.meta["val"]))
    suffix = f"  # {'  '.join(notes)}" if notes else ""
    if node.op == "placeholder":
        return f"%{node.name} = input{suffix}"
    if node.op == "output":
        return f"return {_fmt_arg(node.args[0])}"
    target = node.target
    tname = getattr(target, "__name__", None) or str(target)
    if isinstance(target, torch._ops.OpOverload):
        tname = f"{target.namespace}.{target._schema.name.split('::')[-1]}" + (
            f".{target._overloadname}" if target._overloadname != "default" else ""
        )
    args = ", ".join(
        [_fmt_arg(a) for a in node.args] + [f"{k}={_fmt_arg(v)}" for k, v in node.kwargs.items()]
    )
    return f"%{node.name} = {tname}({args}){suffix}"
