"""recir-embed-sparsify-update: turn a table's dense gradient + optimizer update into row-wise updates.

The step then costs O(ids in the batch) instead of O(table rows) (given in-place state updates).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import ConfigError, StepGraph, Transform, TransformResult, register_transform

from .._graph import splice
from .._rowwise import SPARSE_KINDS, sparse_update

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}
_ZEROS = {aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default}


def _index_add_terms(node: fx.Node) -> list[tuple[fx.Node, fx.Node]] | None:
    """``[(ids, per-id grads)]`` if ``node`` is ``zeros.index_add(0, ids, g)`` (chained or summed)."""
    if node.op != "call_function":
        return None
    if node.target in _ZEROS:
        return []
    if node.target in (aten.full.default, aten.new_full.default) and node.args[-1] == 0:
        return []
    if node.target == aten.index_add.default and node.args[1] == 0 and len(node.args) == 4:
        base = _index_add_terms(node.args[0])
        return None if base is None else [*base, (node.args[2], node.args[3])]
    if node.target == aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        parts = [_index_add_terms(a) if isinstance(a, fx.Node) else None for a in node.args]
        if parts[0] is None or parts[1] is None:
            return None
        return parts[0] + parts[1]
    return None


def _update_fn(
    kind: str, hp: dict[str, Any], keys: list[str], n_terms: int, has_step: bool, core_shape: tuple[int, int]
) -> Any:
    """``(param, *states, lr, [step], *ids, *grads) -> [new_param, *new_states]`` for one table."""
    rows, dim = core_shape
    n_state = len(keys)

    def fn(*xs: Any) -> list[torch.Tensor]:
        param, states = xs[0], list(xs[1 : 1 + n_state])
        lr_v = xs[1 + n_state]
        k = 2 + n_state
        step_v = xs[k] if has_step else None
        k += int(has_step)
        ids = torch.cat([t.to(torch.int64) for t in xs[k : k + n_terms]])
        g = torch.cat(list(xs[k + n_terms : k + 2 * n_terms]))
        shapes = [param.shape] + [s.shape for s in states]
        # A flat table (FBGEMM TBE's 1-D weights) is updated as its [rows, D] view.
        flat = param.dim() != 2
        p2 = param.reshape(rows, dim) if flat else param
        s2 = [s.reshape(rows, dim) if flat and s.numel() == rows * dim else s for s in states]
        new_p, new_st = sparse_update(kind, hp, p2, dict(zip(keys, s2)), lr_v, step_v, ids, g.to(p2.dtype))
        new = [new_p] + [new_st[key] for key in keys]
        return [t.reshape(sh) if tuple(t.shape) != tuple(sh) else t for t, sh in zip(new, shapes)]

    return fn


@register_transform
class SparsifyUpdate(Transform):
    """Replace each table's dense gradient and optimizer update by row-wise updates of touched rows.

    Matches, per param slot ``p`` (from ``step.meta["recir.optimizer"]``), the gradient node
    (``recir.grad_of == p``) of the form ``zeros(rows, D).index_add(0, ids, g)`` (several terms, and a
    trailing view, are accepted) whose only users are ``p``'s optimizer nodes. Before -> after::

        %gw = index_add(new_zeros(W, [R, D]), 0, %ids, %g)        # backward
        %m1 = add(mul(%exp_avg, 0.9), mul(%gw, 0.1)) ...          # optimizer, O(R*D)
        %w1 = sub(%W, ...)
        ->
        %s, %perm = sort(%ids); %slot = cumsum(%s[1:] != %s[:-1]) ...   # N = len(ids) slots
        %gs = new_zeros([N, D]).index_add(0, %slot, %g[%perm])            # segment sum per row
        %w1 = index_put(%W, [%rows], where(%valid, update(%W[%rows], %gs) - %W[%rows], 0), True)  # accumulate

    SGD/Adagrad/RowWiseAdagrad match the dense maths exactly. Adam/AdamW are lazy (``lazy_adam``):
    rows absent from the batch keep weights and moments, where dense Adam would still decay the
    moments and move those rows (torch.optim.SparseAdam's semantics). Weight decay (any optimizer)
    reaches touched rows only (``lazy_weight_decay``), as FBGEMM's fused optimizers do. Padding ids
    of a ``JaggedBatch`` repeat a real id, so they touch no extra row.
    """

    name = "recir-embed-sparsify-update"
    summary = "dense embedding gradient + optimizer -> dedupe ids, segment-sum, row-wise update, index_put(accumulate)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        min_rows: int = 1  # tables with fewer rows stay dense
        lazy_adam: bool = True  # allow Adam/AdamW (lazy semantics on untouched rows)
        lazy_weight_decay: bool = True  # allow weight decay applied to touched rows only

    def requires(self, step: StepGraph) -> None:
        if "recir.optimizer" not in step.meta:
            raise ConfigError(
                f"{self.name}: the step has no meta['recir.optimizer'] (param slot -> optimizer); "
                "capture it with recir.capture.capture_train_step"
            )

    def run(self, step: StepGraph) -> TransformResult:
        graph = step.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in graph.nodes if n.op == "output")
        outs = list(output.args[0])
        names = step.signature.state_names()
        grad_nodes = {n.meta["recir.grad_of"]: n for n in graph.nodes if "recir.grad_of" in n.meta}
        done: list[str] = []
        skipped: dict[str, str] = {}
        ids_per_table: dict[str, int] = {}
        for slot, info in step.meta["recir.optimizer"].items():
            reason, plan = self._match(step, slot, info, grad_nodes)
            if plan is None:
                skipped[slot] = reason
                continue
            core_shape, terms = plan
            kind, hp = info["kind"], dict(info["hparams"])
            if kind == "sgd" and hp.get("momentum"):
                skipped[slot] = "SGD with momentum decays every row's buffer (not row-wise)"
                continue
            if hp.get("weight_decay") and not self.options.lazy_weight_decay:
                skipped[slot] = "weight decay reaches every row densely (lazy_weight_decay=False)"
                continue
            keys = list(info.get("state", {}))
            state_slots = [info["state"][key] for key in keys]
            idx = [names.index(slot)] + [names.index(s) for s in state_slots]
            lr = placeholders[names.index(info["lr_slot"])]
            step_node = outs[names.index(info["step_slot"])] if info.get("step_slot") else None
            n_terms = len(terms)
            args = [placeholders[i] for i in idx] + [lr] + ([step_node] if step_node is not None else [])
            args += [t[0] for t in terms] + [t[1] for t in terms]
            fn = _update_fn(kind, hp, keys, n_terms, step_node is not None, core_shape)
            new_nodes = splice(graph, fn, args, before=output, phase="optimizer", provenance=self.name)
            for i, node in zip(idx, new_nodes):
                outs[i] = node
            done.append(slot)
            ids_per_table[slot] = sum(t[0].meta["val"].shape[0] for t in terms)
        if done:
            output.args = (tuple(outs),)
            graph.eliminate_dead_code()
            graph.lint()
            step.graph_module.recompile()
        return TransformResult(
            step, bool(done), {"sparsified": done, "skipped": skipped, "ids": ids_per_table}
        )

    def _match(
        self, step: StepGraph, slot: str, info: dict[str, Any], grad_nodes: dict[str, fx.Node]
    ) -> tuple[str, tuple[tuple[int, int], list[tuple[fx.Node, fx.Node]]] | None]:
        kind = info.get("kind")
        if kind not in SPARSE_KINDS:
            return f"optimizer {kind!r} has no row-wise form", None
        if kind in ("adam", "adamw") and not self.options.lazy_adam:
            return "Adam is only row-wise with lazy semantics (lazy_adam=False)", None
        grad = grad_nodes.get(slot)
        if grad is None:
            return "no node carries recir.grad_of for it", None
        core = grad
        while core.op == "call_function" and core.target in _VIEWS:
            core = core.args[0]
        terms = _index_add_terms(core)
        if not terms:
            return "its gradient is not zeros.index_add(0, ids, g)", None
        shape = tuple(core.meta["val"].shape)
        if len(shape) != 2 or shape[0] < self.options.min_rows:
            return f"gradient shape {list(shape)} is not a [rows >= {self.options.min_rows}, D] table", None
        for user in grad.users:
            if user.op != "output" and user.meta.get("recir.optim_param") != slot:
                return f"its gradient also feeds {user.name} (not {slot}'s optimizer update)", None
        return "", (shape, terms)
