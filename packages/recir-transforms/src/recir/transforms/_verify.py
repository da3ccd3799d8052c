"""The verifier: checks a StepGraph against the invariants INV-1..INV-9 documented in INVARIANTS.md.

Each violation raises ``VerificationError`` naming the invariant id, the transform, the node, expected
versus actual, the fix, and a window of the graph around the node.
"""

from __future__ import annotations

import operator
import os
from typing import Any, NoReturn

import torch
import torch.fx as fx

from ._errors import ConfigError, VerificationError
from ._graph_util import _alias_base, format_val, format_window
from ._metadata import GRAD_OF_KEY, OPTIM_PARAM_KEY, OPTIMIZER_KEY, OptimizerInfo
from ._override import override_for_op
from ._signature import BatchSlot, StateSlot
from ._slot_names import parse_slot_name
from ._step import OVERRIDE_KEY, PHASE_KEY, PHASES, StepGraph, format_node

#: Invariant id -> one-line statement (INVARIANTS.md explains why each exists and what breaks it).
INVARIANTS: dict[str, str] = {
    "INV-1": "the graph lints; nodes are placeholder/call_function/output only (no call_module, "
    "call_method, or get_attr of a tensor)",
    "INV-2": "functional: no mutating op, and no output aliases a state or batch input or another output",
    "INV-3": "placeholders are exactly state + batch in signature order; the output is exactly "
    "new_state + outputs, with matching shapes and dtypes",
    "INV-4": "every new-state output has the shape and dtype of its state slot",
    "INV-5": "every compute node has `val` and `recir.phase`; phases only flow forward -> backward -> optimizer",
    "INV-6": "opaque ops are only registered overrides (recir::* with a fake impl) and functional collectives",
    "INV-7": "static shapes (no SymInt in any `val`) unless the StepGraph is marked dynamic",
    "INV-8": "`recir.grad_of` and `recir.optim_param` name param: state slots of the signature; "
    "at most one node holds `recir.grad_of` for a slot",
    "INV-9": "step.meta['recir.optimizer'] maps param: slot names to optimizer entries (kind, lr_slot, ...) "
    "whose slot names follow the grammar; a parameter in the signature has its optimizer-state slots there too",
    "INV-10": "a `carry:` state slot's new value is computed from the batch, unchanged state and other carries "
    "only (a software-pipelined step never carries a value that reads updated state)",
}

#: Op namespaces whose ops are ordinary graph ops (not opaque): ATen/prims, and the functional
#: collectives recir-distributed inserts. Extend with :func:`register_graph_namespace`.
_GRAPH_NAMESPACES: set[str] = {"aten", "prims", "_c10d_functional", "_c10d_functional_autograd"}


def register_graph_namespace(namespace: str) -> None:
    """Accept every op of ``torch.ops.<namespace>`` as an ordinary (non-opaque) graph op under INV-6."""
    _GRAPH_NAMESPACES.add(namespace)


def verify_level() -> int:
    """The verification level from ``RECIR_VERIFY``: 0 off, 1 phase boundaries (default), 2 every transform."""
    raw = os.environ.get("RECIR_VERIFY", "1")
    try:
        level = int(raw)
    except ValueError:
        level = 1
    return max(0, min(2, level))


def verify(step: StepGraph, *, level: int | None = None, transform: str | None = None) -> StepGraph:
    """Check every invariant of INVARIANTS.md and return ``step``; raise ``VerificationError`` on a violation.

    ``level`` defaults to :func:`verify_level` (``RECIR_VERIFY``); at level 0 nothing is checked.
    ``transform`` names the transform that produced ``step`` (it appears in the error).
    """
    if (verify_level() if level is None else level) <= 0:
        return step
    _Checker(step, transform).run()
    return step


# -- the checks --------------------------------------------------------------------------------------
class _Checker:
    def __init__(self, step: StepGraph, transform: str | None) -> None:
        self.step = step
        self.graph = step.graph
        self.transform = transform

    def fail(
        self,
        inv: str,
        what: str,
        node: fx.Node | None = None,
        *,
        expected: str | None = None,
        actual: str | None = None,
        fix: str | None = None,
    ) -> NoReturn:
        lines = [f"{inv} violated: {what}", f"  invariant: {INVARIANTS[inv]}"]
        lines.append(f"  transform: {self.transform or '(none: the graph as given to verify)'}")
        if node is not None:
            lines.append(f"  node: %{node.name}  ({format_node(node)})")
        if expected is not None:
            lines.append(f"  expected: {expected}")
        if actual is not None:
            lines.append(f"  actual:   {actual}")
        if fix:
            lines.append(f"  fix: {fix}")
        lines.append(f"  (see packages/recir-transforms/INVARIANTS.md, {inv})")
        lines.append(format_window(self.graph, node))
        raise VerificationError(
            "\n".join(lines), invariant=inv, transform=self.transform, node=node.name if node else None
        )

    def run(self) -> None:
        self.check_structure()  # INV-1
        self.check_static()  # INV-7
        self.check_signature()  # INV-3
        self.check_metadata()  # INV-5 (presence)
        self.check_ops()  # INV-6, INV-2 (mutation)
        self.check_aliasing()  # INV-2 (aliasing outputs)
        self.check_state_outputs()  # INV-4
        self.check_phase_flow()  # INV-5 (flow)
        self.check_param_tags()  # INV-8
        self.check_optimizer_meta()  # INV-9
        self.check_carries()  # INV-10

    # INV-1
    def check_structure(self) -> None:
        try:
            self.graph.lint()
        except Exception as exc:  # fx raises RuntimeError with its own message
            self.fail("INV-1", f"torch.fx Graph.lint failed: {exc}", fix="rebuild the graph with valid edges")
        for node in self.graph.nodes:
            if node.op in ("call_module", "call_method"):
                self.fail(
                    "INV-1",
                    f"a {node.op} node ({node.target!r}) in a StepGraph",
                    node,
                    expected="call_function of an OpOverload",
                    actual=node.op,
                    fix="trace with make_fx so modules and methods become aten ops",
                )
            if node.op == "get_attr":
                obj = _resolve_attr(self.step.graph_module, str(node.target))
                if isinstance(obj, torch.Tensor):
                    self.fail(
                        "INV-1",
                        f"get_attr of a tensor constant {node.target!r}: hidden state outside the signature",
                        node,
                        fix="lift the tensor into a state slot or a batch slot, or build it with an op "
                        "(torch.full/arange) inside the graph",
                    )

    # INV-3
    def check_signature(self) -> None:
        sig = self.step.signature
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        slots: list[StateSlot | BatchSlot] = [*sig.state, *sig.batch]
        if len(placeholders) != len(slots):
            self.fail(
                "INV-3",
                "the number of placeholders differs from the signature",
                placeholders[len(slots)] if len(placeholders) > len(slots) else None,
                expected=f"{len(sig.state)} state + {len(sig.batch)} batch = {len(slots)} placeholders",
                actual=f"{len(placeholders)} placeholders",
                fix="add/remove the slot in the Signature together with the placeholder",
            )
        nodes = list(self.graph.nodes)
        first_other = next((i for i, n in enumerate(nodes) if n.op != "placeholder"), len(nodes))
        if any(n.op == "placeholder" for n in nodes[first_other:]):
            bad = next(n for n in nodes[first_other:] if n.op == "placeholder")
            self.fail("INV-3", "a placeholder after a compute node", bad, fix="insert placeholders first")
        for ph, slot in zip(placeholders, slots):
            self._check_val_matches(
                ph, slot.shape, slot.dtype, "INV-3", f"placeholder for slot {slot.name!r}"
            )
        outputs = [n for n in self.graph.nodes if n.op == "output"]
        if len(outputs) != 1:
            self.fail("INV-3", f"the graph has {len(outputs)} output nodes", None, expected="exactly one")
        out = outputs[0]
        flat = out.args[0]
        n_out = len(sig.state) + len(sig.outputs)
        if not isinstance(flat, (tuple, list)) or len(flat) != n_out:
            self.fail(
                "INV-3",
                "the output is not one flat tuple new_state + outputs",
                out,
                expected=f"a tuple of {len(sig.state)} new state + {len(sig.outputs)} outputs = {n_out}",
                actual=f"{type(flat).__name__} of {len(flat) if isinstance(flat, (tuple, list)) else '?'}",
            )
        for i, value in enumerate(flat):
            if not isinstance(value, fx.Node):
                self.fail("INV-3", f"output {i} is a constant {value!r}, not a node", out)
        for oslot, value in zip(sig.outputs, flat[len(sig.state) :]):
            self._check_val_matches(value, oslot.shape, oslot.dtype, "INV-3", f"user output {oslot.name!r}")

    def _check_val_matches(
        self, node: fx.Node, shape: tuple[int, ...], dtype: torch.dtype, inv: str, what: str
    ) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            self.fail(
                inv,
                f"{what}: the node has no tensor `val`",
                node,
                expected=f"{dtype}{list(shape)}",
                actual=format_val(val),
                fix="set node.meta['val'] to a FakeTensor",
            )
        if any(isinstance(s, torch.SymInt) for s in val.shape) and self.step.dynamic:
            return
        if tuple(val.shape) != tuple(shape) or val.dtype != dtype:
            exp = f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"
            self.fail(
                inv,
                f"{what}: shape/dtype differs from the signature",
                node,
                expected=exp,
                actual=format_val(val),
                fix="keep the graph and the Signature in step",
            )

    # INV-7
    def check_static(self) -> None:
        if self.step.dynamic:
            return
        for node in self.graph.nodes:
            if node.op != "output" and _has_symint(node.meta.get("val")):
                self.fail(
                    "INV-7",
                    "a symbolic shape in a static StepGraph",
                    node,
                    expected="concrete sizes",
                    actual=format_val(node.meta.get("val")),
                    fix="capture with mode='static' (pad/bucket) or mark the StepGraph dynamic=True",
                )

    # INV-5 (presence)
    def check_metadata(self) -> None:
        for node in self.graph.nodes:
            if node.op == "call_function":
                if "val" not in node.meta:
                    self.fail(
                        "INV-5",
                        "a compute node without `val`",
                        node,
                        expected="a FakeTensor in meta['val']",
                        actual="missing",
                        fix="create nodes by tracing (Region.replace) or copy `val`",
                    )
                phase = node.meta.get(PHASE_KEY)
                if phase not in PHASES:
                    self.fail(
                        "INV-5",
                        f"a compute node without a valid {PHASE_KEY}",
                        node,
                        expected=f"one of {PHASES}",
                        actual=repr(phase),
                        fix=f"set node.meta[{PHASE_KEY!r}] when creating the node",
                    )

    # INV-6 and INV-2 (mutation)
    def check_ops(self) -> None:
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                schema = target._schema
                if schema.is_mutable:
                    self.fail(
                        "INV-2",
                        f"a mutating op {schema.name}",
                        node,
                        expected="a functional op",
                        actual=str(schema),
                        fix="use the out-of-place variant (add instead of add_) or functionalize",
                    )
                ns = target.namespace
                if ns in _GRAPH_NAMESPACES:
                    continue
                if ns == "recir":
                    self._check_override_op(node, target)
                    continue
                self.fail(
                    "INV-6",
                    f"an opaque op {schema.name} from namespace {ns!r}",
                    node,
                    expected=f"an op of {sorted(_GRAPH_NAMESPACES)} or a registered recir::* override",
                    actual=schema.name,
                    fix="decompose it to ATen, or register it with register_override_op and a fake impl",
                )
            elif target is operator.getitem or self.step.dynamic and _is_sym_function(target):
                continue
            else:
                name = getattr(target, "__qualname__", None) or repr(target)
                self.fail(
                    "INV-6",
                    f"call_function of a Python callable {name}",
                    node,
                    expected="an OpOverload (torch.ops.<ns>.<op>.<overload>)",
                    actual=name,
                    fix="trace with make_fx (aten ops), or wrap it in a registered recir::* custom op",
                )

    def _check_override_op(self, node: fx.Node, op: torch._ops.OpOverload) -> None:
        qualname = op._schema.name
        owner = override_for_op(op)
        if owner is None:
            self.fail(
                "INV-6",
                f"recir op {qualname} is not a registered override op",
                node,
                fix=f"call register_override_op({qualname!r}, '<override name>')",
            )
        if not _has_fake_impl(qualname):
            self.fail(
                "INV-6",
                f"recir op {qualname} has no fake implementation",
                node,
                fix="add @<op>.register_fake so it traces with FakeTensors",
            )
        if node.meta.get(OVERRIDE_KEY) != owner:
            self.fail(
                "INV-6",
                f"a {qualname} node without its {OVERRIDE_KEY} metadata",
                node,
                expected=repr(owner),
                actual=repr(node.meta.get(OVERRIDE_KEY)),
                fix=f"set node.meta[{OVERRIDE_KEY!r}] = override_for_op(node.target)",
            )

    # INV-2 (aliasing)
    def check_aliasing(self) -> None:
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        n_state = len(self.step.signature.state)
        out = next(n for n in self.graph.nodes if n.op == "output")
        flat = list(out.args[0])
        bases: dict[fx.Node, int] = {}
        for i, value in enumerate(flat):
            base, identity = _alias_base(value)
            kind = (
                f"new-state output {i} ({self.step.signature.state[i].name})"
                if i < n_state
                else (f"user output {i - n_state}")
            )
            if base.op == "placeholder":
                j = placeholders.index(base)
                if i < n_state and j == i and identity:
                    continue  # a slot returned unchanged (frozen parameter, unused buffer)
                if i >= n_state and j >= n_state:
                    continue  # a batch tensor returned as a user output
                self.fail(
                    "INV-2",
                    f"{kind} aliases input {j} (%{base.name})",
                    value,
                    expected="a fresh tensor (or the same slot's input returned unchanged)",
                    actual=f"a view of %{base.name}",
                    fix="return a copy (aten.clone) or compute a new value; state is updated in place",
                )
            if base in bases and (i < n_state or bases[base] < n_state):
                self.fail(
                    "INV-2",
                    f"{kind} aliases output {bases[base]} (both are %{base.name} or views of it)",
                    value,
                    expected="distinct buffers for state outputs",
                    fix="return a clone for one of them; donated buffers must be distinct",
                )
            bases.setdefault(base, i)

    # INV-4
    def check_state_outputs(self) -> None:
        out = next(n for n in self.graph.nodes if n.op == "output")
        for slot, value in zip(self.step.signature.state, out.args[0]):
            self._check_val_matches(value, slot.shape, slot.dtype, "INV-4", f"new state for {slot.name!r}")

    # INV-5 (flow)
    def check_phase_flow(self) -> None:
        rank = {p: i for i, p in enumerate(PHASES)}
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            mine = rank[node.meta[PHASE_KEY]]
            for inp in node.all_input_nodes:
                theirs = inp.meta.get(PHASE_KEY)
                if inp.op == "call_function" and rank[theirs] > mine:
                    self.fail(
                        "INV-5",
                        f"a {node.meta[PHASE_KEY]} node reads %{inp.name} of the later phase {theirs}",
                        node,
                        expected=f"inputs of phase <= {node.meta[PHASE_KEY]}",
                        actual=f"%{inp.name} is {theirs}",
                        fix="tag the node with the later phase, or move the computation earlier",
                    )

    # INV-8
    def check_param_tags(self) -> None:
        params = {s.name for s in self.step.signature.state if s.kind == "param"}
        seen: dict[str, fx.Node] = {}
        for node in self.graph.nodes:
            for key in (GRAD_OF_KEY, OPTIM_PARAM_KEY):
                slot = node.meta.get(key)
                if slot is None:
                    continue
                if slot not in params:
                    self.fail(
                        "INV-8",
                        f"{key} names {slot!r}, which is no param slot of the signature",
                        node,
                        expected=f"one of {sorted(params)[:4]}{'...' if len(params) > 4 else ''}",
                        actual=repr(slot),
                        fix=f"set {key} to the param:<path> slot the node belongs to (or drop the key when "
                        "a rewrite removes the parameter from the signature)",
                    )
                if key == GRAD_OF_KEY and slot in seen:
                    self.fail(
                        "INV-8",
                        f"two nodes hold {key} {slot!r}: %{seen[slot].name} and %{node.name}",
                        node,
                        expected="one final-gradient node per parameter",
                        fix=f"move {key} to the new gradient node and delete it from the old one",
                    )
                if key == GRAD_OF_KEY:
                    seen[slot] = node

    # INV-10
    def check_carries(self) -> None:
        slots = self.step.signature.state
        if not any(s.kind == "carry" for s in slots):
            return
        phs = [n for n in self.graph.nodes if n.op == "placeholder"][: len(slots)]
        output = next(n for n in self.graph.nodes if n.op == "output")
        outs = list(output.args[0])[: len(slots)]
        updated = {ph: s.name for ph, s, o in zip(phs, slots, outs) if s.kind != "carry" and o is not ph}
        for slot, value in zip(slots, outs):
            if slot.kind != "carry" or not isinstance(value, fx.Node):
                continue
            seen: set[fx.Node] = set()
            todo = [value]
            while todo:
                node = todo.pop()
                if node in seen:
                    continue
                seen.add(node)
                if node in updated:
                    self.fail(
                        "INV-10",
                        f"the new value of {slot.name!r} reads state slot {updated[node]!r}, which the step updates",
                        value,
                        expected="a value computed from the batch, unchanged state and carries only",
                        actual=f"depends on %{node.name} ({updated[node]})",
                        fix="carry only batch-derived values (recir-pipeline-sparse's cut); compute anything "
                        "that reads updated state in the step itself",
                    )
                todo.extend(node.all_input_nodes)

    # INV-9
    def check_optimizer_meta(self) -> None:
        entries = self.step.meta.get(OPTIMIZER_KEY)
        if entries is None:
            return
        state = {s.name for s in self.step.signature.state}
        for param, entry in dict(entries).items():
            where = f"step.meta[{OPTIMIZER_KEY!r}][{param!r}]"
            fix = "build the entry with recir.transforms.OptimizerInfo(...).to_meta() from the step's slot names"
            if not isinstance(param, str) or not param.startswith("param:"):
                self.fail("INV-9", f"{where}: the key is no param:<path> slot name", fix=fix)
            try:
                info = OptimizerInfo.from_meta(param, entry)
            except (ConfigError, TypeError, ValueError, AttributeError) as exc:
                self.fail("INV-9", f"{where} is malformed: {exc}", fix=fix)
            try:
                for name in info.slots():
                    parse_slot_name(name)
            except ConfigError as exc:
                self.fail("INV-9", f"{where}: {exc}", fix=fix)
            if param not in state:
                continue  # a part of a split step keeps the whole step's optimizer record
            # Per-parameter state travels with its parameter; the shared lr and step scalars may live in
            # another part of a split step (the host tables' part reads them from the device part).
            missing = [s for s in info.state.values() if s not in state]
            if missing:
                self.fail(
                    "INV-9",
                    f"{where} names optimizer-state slots the signature lacks: {missing}",
                    expected=f"every optimizer-state slot of {param!r} in signature.state, as {param!r} is",
                    fix="keep the optimizer slots with their parameter, or update the entry when a rewrite "
                    "renames or drops them",
                )


def _resolve_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _has_symint(val: Any) -> bool:
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(val, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in val.shape)
    if isinstance(val, (tuple, list)):
        return any(_has_symint(v) for v in val)
    return False


def _is_sym_function(target: Any) -> bool:
    module = getattr(target, "__module__", "") or ""
    return module in ("_operator", "operator", "math") or getattr(target, "__name__", "").startswith("sym_")


def _has_fake_impl(qualname: str) -> bool:
    from torch._library.simple_registry import singleton

    entry = singleton.find(qualname)
    if entry.fake_impl.kernel is not None:
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")
