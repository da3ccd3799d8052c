"""``recir-mixed-precision``: matrix products in a low-precision dtype (bf16/fp16), everything else fp32.

The policy of ``torch.autocast``'s lower-precision list, applied to the whole captured step: the
parameters, the optimizer state and the optimizer update stay fp32 ("master weights"); forward and
backward matrix products read bf16 copies of their operands and hand fp32 results to the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .. import _hstu  # noqa: F401 - registers recir::hstu_attention (a product this transform lowers)
from .._errors import ConfigError
from .._graph_util import node_val
from .._step import PHASE_KEY, SCOPE_KEY, StepGraph
from .._transform import Transform, TransformResult, register_transform

_aten = torch.ops.aten
# op -> positions of its matrix operands (the bias of addmm/baddbmm is cast too: one dtype per op)
_MATMULS: dict[Any, tuple[int, ...]] = {
    _aten.mm.default: (0, 1),
    _aten.bmm.default: (0, 1),
    _aten.addmm.default: (0, 1, 2),
    _aten.baddbmm.default: (0, 1, 2),
}
# recir::hstu_attention and its backward: products inside an op (its q, k, v and the gradient run low, its
# results come back fp32), as torch.autocast would run the attention's products and what reads them
_MATMULS.update(
    {
        torch.ops.recir.hstu_attention.default: (0, 1, 2),
        torch.ops.recir.hstu_attention_backward.default: (0, 1, 2, 3),
    }
)
_LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Ops a cast commutes with (views of a whole tensor, and clone): the cast moves to their source and
# the op is redone on the copy, so a weight read as `t(w)` forward and as `w` backward (or an activation
# read through two reshapes) is cast once, and a clone copies half the bytes. Slices are not here:
# casting a whole tensor for a part of it can cost more.
_VIEWS = {
    _aten.clone.default,
    _aten.t.default,
    _aten.permute.default,
    _aten.transpose.int,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.expand.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
}


@register_transform
class MixedPrecision(Transform):
    """Run forward and backward ``mm``/``bmm``/``addmm``/``baddbmm`` on ``compute_dtype`` copies of
    their fp32 operands, and cast each product back to fp32.

    One cast per value (shared by every product that reads it, placed before the first of them; a
    view of a tensor is redone on the cast of the tensor), so a weight or an activation read by a
    forward product and by a backward one is cast once. Optimizer-phase nodes are never touched:
    master weights and optimizer state stay fp32.

    Before::

        %mm = aten.mm(%x, %param_w)  # forward

    After::

        %x_bf16 = aten._to_copy(%x, dtype=torch.bfloat16)  # forward
        %param_w_bf16 = aten._to_copy(%param_w, dtype=torch.bfloat16)  # forward
        %mm = aten.mm(%x_bf16, %param_w_bf16)  # forward
        %mm_f32 = aten._to_copy(%mm, dtype=torch.float32)  # forward
    """

    name = "recir-mixed-precision"
    summary = "matrix products on bf16/fp16 copies of fp32 operands; master weights stay fp32"

    @dataclasses.dataclass(frozen=True)
    class Options:
        compute_dtype: str = "bfloat16"  # "bfloat16" | "float16"
        phases: tuple[str, ...] = ("forward", "backward")
        # which products run low: any of mm, bmm, addmm, baddbmm, hstu_attention, hstu_attention_backward
        # (a backend whose low-precision batched products are slow leaves bmm/baddbmm out)
        ops: tuple[str, ...] = ("mm", "bmm", "addmm", "baddbmm", "hstu_attention", "hstu_attention_backward")

    def requires(self, step: StepGraph) -> None:
        if self.options.compute_dtype not in _LOW:
            raise ConfigError(
                f"{self.name}: compute_dtype={self.options.compute_dtype!r} is not supported. "
                f"Fix: pass one of {', '.join(_LOW)}."
            )
        unknown = sorted(set(self.options.ops) - {op.overloadpacket.__name__ for op in _MATMULS})
        if unknown:
            raise ConfigError(
                f"{self.name}: ops={self.options.ops!r} names {', '.join(unknown)}, which it does not "
                "rewrite. Fix: choose from mm, bmm, addmm, baddbmm, hstu_attention, hstu_attention_backward."
            )
        if "optimizer" in self.options.phases:
            raise ConfigError(
                f"{self.name}: phases={self.options.phases!r} includes 'optimizer'; the optimizer "
                "update must stay fp32 (master weights). Fix: use phases=('forward', 'backward')."
            )

    def run(self, step: StepGraph) -> TransformResult:
        self.requires(step)
        low = _LOW[self.options.compute_dtype]
        graph = step.graph
        casts: dict[fx.Node, fx.Node] = {}  # fp32 value -> its low-precision copy
        rewritten: dict[str, int] = {}
        for node in list(graph.nodes):
            positions = _MATMULS.get(node.target) if node.op == "call_function" else None
            if positions is None or node.meta.get(PHASE_KEY) not in self.options.phases:
                continue
            if node.target.overloadpacket.__name__ not in self.options.ops:
                continue
            operands = [node.args[i] for i in positions]
            if not all(node_val(a) is not None and node_val(a).dtype == torch.float32 for a in operands):
                continue  # already low precision, or an operand without a value: leave it
            args = list(node.args)
            for i in positions:
                args[i] = self._low(graph, args[i], low, node, casts)
            node.args = tuple(args)
            node.meta["val"] = node.target(*[node_val(a) if isinstance(a, fx.Node) else a for a in args])
            if isinstance(node.meta["val"], tuple):  # the attention's backward: its getitems come back fp32
                for item in list(node.users):
                    item.meta["val"] = node.meta["val"][item.args[1]]
                    _back_to_fp32(graph, item, node)
            else:
                _back_to_fp32(graph, node, node)
            name = str(node.target.overloadpacket.__name__)
            rewritten[name] = rewritten.get(name, 0) + 1
        for src in reversed(list(casts)):  # fp32 views and concatenations only the products read are dead now
            if (
                src.op == "call_function"
                and (src.target in _VIEWS or src.target is _aten.cat.default)
                and not src.users
            ):
                graph.erase_node(src)
        if rewritten:
            step.graph_module.recompile()
        n_casts = sum(1 for c in casts.values() if c.target is _aten._to_copy.default)
        stats = {"matmuls": sum(rewritten.values()), **rewritten, "casts": n_casts}
        return TransformResult(step, bool(rewritten), stats)

    def _low(
        self, graph: fx.Graph, src: fx.Node, dtype: torch.dtype, user: fx.Node, memo: dict[fx.Node, fx.Node]
    ) -> fx.Node:
        """The low-precision copy of ``src`` (memoised), created before ``user`` in its phase."""
        if src in memo:
            return memo[src]
        call = src.op == "call_function"
        if call and src.target is _aten._to_copy.default and set(src.kwargs) == {"dtype"}:
            origin = src.args[0]
            if (
                isinstance(origin, fx.Node)
                and node_val(origin) is not None
                and node_val(origin).dtype == dtype
            ):
                memo[src] = origin  # a low value widened to fp32 (a product's result): itself, exactly
                return origin
        base = src.args[0] if call and src.target in _VIEWS and src.args else None
        if isinstance(base, fx.Node) and node_val(base) is not None and node_val(base).dtype == torch.float32:
            target, args = src.target, (self._low(graph, base, dtype, user, memo), *src.args[1:])
        elif call and src.target is _aten.cat.default and self._cat_of_fp32_for_products(src):
            # cat(a, b).to(low) == cat(a.to(low), b.to(low)): the parts' producers write the low copy
            # straight into the concatenation (no fp32 concatenation written, read and cast)
            parts = [self._low(graph, p, dtype, user, memo) for p in src.args[0]]
            target, args = src.target, (parts, *src.args[1:])
        else:
            target, args = _aten._to_copy.default, (src,)
        suffix = "bf16" if dtype == torch.bfloat16 else "f16"
        kwargs = {"dtype": dtype} if target is _aten._to_copy.default else dict(src.kwargs)
        with graph.inserting_before(user):
            low = graph.create_node("call_function", target, args, kwargs, name=f"{src.name}_{suffix}")
        fake = fx.node.map_arg(args, node_val)
        low.meta.update({PHASE_KEY: user.meta[PHASE_KEY], "val": target(*fake, **kwargs)})
        if SCOPE_KEY in user.meta:
            low.meta[SCOPE_KEY] = user.meta[SCOPE_KEY]
        memo[src] = low
        return low

    def _cat_of_fp32_for_products(self, cat: fx.Node) -> bool:
        """True when ``cat`` joins fp32 values and only products this transform rewrites read it (through
        views): casting its parts then costs no more than casting it, and no fp32 copy stays needed."""
        parts = cat.args[0]
        if not isinstance(parts, (list, tuple)) or not all(
            isinstance(p, fx.Node) and node_val(p) is not None and node_val(p).dtype == torch.float32
            for p in parts
        ):
            return False
        readers, seen = list(cat.users), set()
        while readers:
            node = readers.pop()
            if node in seen:
                continue
            seen.add(node)
            if node.op == "call_function" and node.target in _VIEWS:
                readers.extend(node.users)
            elif not (
                node.op == "call_function"
                and node.target in _MATMULS
                and node.target.overloadpacket.__name__ in self.options.ops
                and node.meta.get(PHASE_KEY) in self.options.phases
            ):
                return False
        return True


def _back_to_fp32(graph: fx.Graph, value: fx.Node, op: fx.Node) -> None:
    """Readers of ``value`` (low precision now) read an fp32 copy of it instead, made right after it."""
    with graph.inserting_after(value):
        back = graph.create_node(
            "call_function",
            _aten._to_copy.default,
            (value,),
            {"dtype": torch.float32},
            name=f"{value.name}_f32",
        )
    value.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    back.meta.update({PHASE_KEY: op.meta[PHASE_KEY], "val": node_val(value).to(torch.float32)})
    if SCOPE_KEY in op.meta:
        back.meta[SCOPE_KEY] = op.meta[SCOPE_KEY]
