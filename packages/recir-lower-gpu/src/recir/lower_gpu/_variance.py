"""``TwoPassVariance``: an Inductor post-grad pass that computes a CPU ``var_mean`` over a short reduction
as the mean, then the sum of squared deviations from it, instead of Inductor's Welford reduction.

Every layer norm reaches Inductor as ``var_mean`` (its decomposition). Inductor's C++ backend lowers
``var_mean`` to a vectorised Welford reduction, whose end of row combines the lanes' (mean, m2, count)
triples with divisions and shuffles (``welford_vec_reduce_all``): per row of DLRMv3's serving model
(width 64) that costs more than the row's arithmetic. Two plain sums vectorise and end in one cheap
horizontal add each. Both are stable (the two-pass algorithm subtracts the mean before squaring); the
results agree to float rounding. Measured on a 2-core AMD EPYC (AVX-512), one thread, the cached-history
candidates artifact of DLRMv3's serving model at batch 256 (bf16): 82-84 -> 46-55 ms per batch, where a
profile put 40% of the generated kernels' time in the Welford helpers.

Only float32/float64 reductions of at most :data:`MAX_ELEMENTS` statically known elements are rewritten
(a row the second pass reads back from cache); longer ones, other dtypes and other devices keep Welford.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

#: the longest reduction rewritten (elements; 32K fp32 values are 128 KiB, within a core's L2 cache)
MAX_ELEMENTS = 32768

# float32/float64 only: Inductor computes a bf16/fp16 var_mean in float32 itself, where this rewrite's mean
# would be stored, and subtracted, in the input's precision (layer norms upcast before var_mean anyway)
_FLOATS = (torch.float32, torch.float64)


def _reduced(node: fx.Node) -> tuple[list[int], int] | None:
    """(the dims ``node``, a ``var_mean``, reduces, their element count) when it is a CPU float32/float64
    reduction of a static size within :data:`MAX_ELEMENTS`, else None."""
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or val.dtype not in _FLOATS:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = list(range(val.dim())) if dims is None else [d % val.dim() for d in dims]
    sizes = [val.shape[d] for d in dims]
    if not all(isinstance(s, int) for s in sizes):  # symbolic shapes: leave Inductor's choice
        return None
    count = math.prod(sizes)
    return (dims, count) if 0 < count <= MAX_ELEMENTS else None


def two_pass_variance(graph: fx.Graph) -> int:
    """Rewrite each eligible ``aten.var_mean.correction`` of ``graph`` in place; returns how many::

      %vm = var_mean(%x, [-1], correction=c, keepdim=True); %var = %vm[0]; %mean = %vm[1]
    ->
      %mean = mean(%x, [-1], keepdim=True); %d = sub(%x, %mean)
      %var = div(sum(mul(%d, %d), [-1], keepdim=True), N - c)
    """
    aten = torch.ops.aten
    rewritten = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.var_mean.correction)):
        found = _reduced(node)
        users = list(node.users)
        if found is None or not all(u.target is operator.getitem and u.args[0] is node for u in users):
            continue
        dims, count = found
        x = node.args[0]
        correction = node.kwargs.get("correction")
        correction = 1 if correction is None else correction
        keepdim = bool(node.kwargs.get("keepdim", False))
        with graph.inserting_before(node):
            mean = _call(graph, aten.mean.dim, x, dims, True)
            diff = _call(graph, aten.sub.Tensor, x, mean)
            square = _call(graph, aten.mul.Tensor, diff, diff)
            total = _call(graph, aten.sum.dim_IntList, square, dims, keepdim)
            var = _call(graph, aten.div.Tensor, total, max(count - correction, 0))
            out_mean = mean if keepdim else _call(graph, aten.squeeze.dims, mean, dims)
        for use in users:
            use.replace_all_uses_with(var if use.args[1] == 0 else out_mean)
            graph.erase_node(use)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """A new ``target(*args)`` node carrying ``meta["val"]`` (computed on its inputs' values, fake tensors
    under Inductor), as Inductor's later passes and its lowering expect of every node."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
    return node


class TwoPassVariance(CustomGraphPass):
    """:func:`two_pass_variance` as Inductor's ``post_grad_custom_pre_pass`` (after the decompositions
    turned each layer norm into ``var_mean``, before Inductor lowers it)."""

    def __call__(self, graph: fx.Graph) -> None:
        two_pass_variance(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))
