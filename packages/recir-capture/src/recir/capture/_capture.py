"""capture_train_step: trace forward, backward and optimizer update into one functional StepGraph.

The pure step (parameters swapped for fake tensors, gradients from ``torch.autograd.grad``, a functional
optimizer) is traced by ``make_fx`` under a FakeTensorMode and a FunctionalTensorMode, so nothing real
runs and no mutation survives; the live model and optimizer are only read.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from recir.transforms import (
    GRAD_OF_KEY,
    OPTIMIZER_KEY,
    RNG_OFFSET_SLOT,
    RNG_SEED_SLOT,
    STEP_SLOT,
    CaptureError,
    Override,
    ParamOptim,
    Signature,
    SlotInitializer,
    StateSlot,
    StepGraph,
    adapt_batch,
    apply_update,
    buffer_slot,
    group_scalars,
    lr_slot,
    optim_slot,
    param_slot,
    verify,
)
from torch import nn
from torch._functorch._aot_autograd.functional_utils import from_fun, to_fun
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _postprocess as post
from ._lr import LR_SLOTS_META
from ._model_copy import bind_tensors, prepare_model
from ._optim_map import all_param_groups, group_learning_rates, optimizer_specs
from ._rng import step_key
from ._slots import OptimizerStateInitializer, batch_slots, slot_devices, state_slots
from ._trace_context import CaptureFunctionMode, TraceContext, track_modules
from ._trace_step import Recorder, check_inputs_unmutated, node_of, split_loss, trace
from ._update_copies import copy_template, finish_copies, record_template, update_key

OPTIMIZER_META = OPTIMIZER_KEY  # its old name here
# Copy a traced optimizer update to every parameter with the same update key (see _update_copies); tests
# switch it off to compare against tracing each update.
REUSE_UPDATES = True

LossFn = Callable[[nn.Module, Any], Any]


def capture_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_fn: LossFn,
    example_batch: Any,
    *,
    overrides: Iterable[Override] = (),
    mode: str = "static",
    batch_buckets: Any = None,
) -> StepGraph:
    """Capture ``loss_fn(model, batch)``, its backward and ``optimizer``'s update as one pure StepGraph.

    ``loss_fn`` returns the loss (a scalar) or ``(loss, aux...)``. ``optimizer`` may be a list (e.g. dense
    Adam + RowWiseAdagrad for tables); param groups are then numbered across the optimizers in order.
    The live model and optimizer are only read; no real step runs. Raises :class:`CaptureError` for
    what one functional graph cannot express.

    Batch values a registered batch adapter handles (TorchRec ``KeyedJaggedTensor``s, once recir.embedding
    is imported) are converted into static ones; ``batch_buckets`` is the adapter's bucketing policy (for
    KJTs: recir.embedding.pad_to_bucket's ``buckets``; None pads each feature to the next power of two).
    The captured step converts later batches into the same layout; :class:`recir.capture.BucketedStep`
    captures once per bucket instead.
    """
    if mode not in ("static", "dynamic"):
        raise CaptureError(f"mode must be 'static' or 'dynamic', got {mode!r}")
    example_batch = adapt_batch(example_batch, None, batch_buckets)
    _check_no_jagged_left(example_batch)
    specs = optimizer_specs(optimizer)
    work, applied = prepare_model(model, tuple(overrides))
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    known = {id(p) for _, p in params}
    strays = sorted(
        {i for i, g in enumerate(all_param_groups(optimizer)) for p in g["params"] if id(p) not in known}
    )
    if strays:
        raise CaptureError(
            f"optimizer param group(s) {strays} hold tensors that are not parameters of the model.\n"
            "Fix: build the optimizer from model.parameters() of the model being captured."
        )
    trainable = [(n, p, specs[id(p)]) for n, p in params if id(p) in specs and p.requires_grad]
    lrs = group_learning_rates(optimizer)
    slots = state_slots(params, buffers, trainable, len(lrs))
    bslots, batch_tensors, batch_spec = batch_slots(example_batch)
    _check_one_device(params, bslots, batch_tensors)
    index = {s.name: i for i, s in enumerate(slots)}
    rec = Recorder()

    def step_fn(*flat: torch.Tensor) -> list[torch.Tensor]:
        graph = get_proxy_mode().tracer.graph
        with FunctionalTensorMode():
            f = [to_fun(x) for x in flat]
            st, bt = f[: len(slots)], f[len(slots) :]
            ctx = rec.ctx = TraceContext(
                {id(t): s.name for t, s in zip(bt, bslots)},
                lambda: step_key(st[index[RNG_SEED_SLOT]], st[index[RNG_OFFSET_SLOT]]),
            )
            ctx.graph = graph
            p_in = {n: st[index[param_slot(n)]] for n, _ in params}
            for n, _, _ in trainable:
                p_in[n].requires_grad_(True)
            b_in = {n: st[index[buffer_slot(n)]] for n, _ in buffers}
            by_id = {id(p): p_in[n] for n, p in params} | {id(b): b_in[n] for n, b in buffers}

            # forward: the user's loss_fn on the structural copy, bound to the traced tensors
            with (
                bind_tensors(work, by_id),
                track_modules(ctx, work),
                CaptureFunctionMode(ctx),
                sdpa_kernel(SDPBackend.MATH),
                torch.enable_grad(),
            ):
                result = loss_fn(work, pytree.tree_unflatten(bt, batch_spec))
            loss, aux = split_loss(result, rec)
            check_inputs_unmutated(st, bt, slots, bslots)
            out = list(st)
            for n, b in b_in.items():
                out[index[buffer_slot(n)]] = from_fun(b)  # buffers written in forward become new state
            loss = loss.reshape(()) if loss.dim() != 0 else loss

            # backward
            rec.marks["backward"] = len(graph.nodes)
            wrt = [p_in[n] for n, _, _ in trainable]
            with torch.enable_grad():
                no_path = not loss.requires_grad  # a loss independent of every parameter
                grads = [None] * len(wrt) if no_path else torch.autograd.grad(loss, wrt, allow_unused=True)
            grads = _distinct_grad_nodes(rec, trainable, grads)

            # optimizer
            rec.marks["optimizer"] = len(graph.nodes)
            with torch.no_grad():
                _optimizer_phase(graph, rec, st, out, index, trainable, grads, p_in)
            return [from_fun(t) for t in out] + [from_fun(t.detach()) for t in (loss, *aux)]

    shape_env = ShapeEnv() if mode == "dynamic" else None
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)  # constants -> CaptureError
    with fake_mode:
        devices = slot_devices(model, slots, trainable)
        fake_state = [torch.empty(s.shape, dtype=s.dtype, device=d) for s, d in zip(slots, devices)]
    fake_batch = [fake_mode.from_tensor(t, static_shapes=mode == "static") for t in batch_tensors]
    gm = trace(step_fn, fake_mode, [*fake_state, *fake_batch], rec)
    finish_copies(gm, rec.update_copies, fake_mode)
    if rec.unused:
        warnings.warn(
            f"parameters {rec.unused} received no gradient from the loss; the captured step leaves them "
            "unchanged (as torch.optim skips parameters whose .grad is None).",
            stacklevel=2,
        )
    assert rec.ctx is not None
    slots = _finish_graph(gm, rec, slots, [b.name for b in bslots])
    signature = Signature(
        state=tuple(slots),
        batch=tuple(bslots),
        outputs=tuple(rec.outputs),
        batch_spec=batch_spec,
        output_spec=rec.output_spec,
    )
    initializers: list[SlotInitializer] = [OptimizerStateInitializer({n: s for n, _, s in trainable}, lrs)]
    for _, ov in applied:
        initializers.extend(ov.initializers())
    meta = {
        OPTIMIZER_META: _optimizer_meta(trainable, slots),
        LR_SLOTS_META: [lr_slot(i) for i in range(len(lrs))],
        "recir.overrides": sorted({ov.name for _, ov in applied}),
        "recir.random_ops": list(rec.ctx.random_ops),
    }
    step = StepGraph(gm, signature, dynamic=mode == "dynamic", initializers=tuple(initializers), meta=meta)
    return verify(step, transform="recir-capture")


def _optimizer_phase(
    graph: fx.Graph,
    rec: Recorder,
    st: list[torch.Tensor],
    out: list[torch.Tensor],
    index: dict[str, int],
    trainable: list[tuple[str, nn.Parameter, ParamOptim]],
    grads: Sequence[torch.Tensor | None],
    p_in: dict[str, torch.Tensor],
) -> None:
    step = None
    if STEP_SLOT in index:
        step = out[index[STEP_SLOT]] = st[index[STEP_SLOT]] + 1
    scalars = {}  # shared by a group's parameters, computed before any per-parameter range
    for (_, p, spec), grad in zip(trainable, grads):
        group_key = (spec.group, p.dtype)
        if grad is not None and group_key not in scalars:
            scalars[group_key] = group_scalars(spec, st[index[lr_slot(spec.group)]], step, p.dtype)
    copies = rec.update_copies
    for (name, p, spec), grad in zip(trainable, grads):
        if grad is None:
            rec.unused.append(name)
            continue
        start = len(graph.nodes)
        state = {k: st[index[optim_slot(name, k)]] for k in spec.state_keys}
        lr = st[index[lr_slot(spec.group)]]
        slots = [param_slot(name)] + [optim_slot(name, k) for k in spec.state_keys]
        key = update_key(spec, [p_in[name], grad, *state.values()]) if REUSE_UPDATES else None
        template = copies.templates.get(key) if key is not None else None
        inputs = [node_of(t) for t in (p_in[name], grad, *state.values())]
        results = copy_template(graph, template, inputs, copies) if template is not None else None
        if results is not None:  # out[...] keeps the old state; finish_copies points the outputs here
            copies.outputs.update({index[s]: r for s, r in zip(slots, results)})
        else:
            group = scalars[(spec.group, p.dtype)]
            new_p, new_state = apply_update(spec, p_in[name].detach(), grad, state, lr, step, group)
            news = [new_p, *(new_state[k] for k in spec.state_keys)]
            for s, v in zip(slots, news):
                out[index[s]] = v
            if key is not None and key not in copies.templates:
                shared = [node_of(v) for v in (lr, *group.values())] + (
                    [node_of(step)] if step is not None else []
                )
                copies.templates[key] = record_template(
                    graph, start, inputs, [node_of(v) for v in news], shared
                )
        rec.param_ranges.append((param_slot(name), start, len(graph.nodes)))
    out[index[RNG_OFFSET_SLOT]] = st[index[RNG_OFFSET_SLOT]] + 1


def _distinct_grad_nodes(
    rec: Recorder, trainable: list[tuple[str, nn.Parameter, ParamOptim]], grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Give each parameter's gradient its own node (``recir.grad_of`` names one parameter per node).

    A gradient that is a graph input (``loss = (w * x).sum()``) or shared by two parameters is cloned.
    """
    out: list[torch.Tensor | None] = []
    claimed: set[fx.Node] = set()
    for (name, _, _), grad in zip(trainable, grads):
        if grad is not None:
            node = node_of(grad)
            if node is None or node.op == "placeholder" or node in claimed:
                grad = grad.clone()
                node = node_of(grad)
            if node is not None:
                claimed.add(node)
                rec.grad_nodes[param_slot(name)] = node
        out.append(grad)
    return out


def _finish_graph(
    gm: fx.GraphModule, rec: Recorder, slots: list[StateSlot], batch_names: list[str]
) -> list[StateSlot]:
    graph = gm.graph
    post.tag_phases(graph, rec.marks, rec.param_ranges)
    assert rec.ctx is not None
    grads = {node: slot for slot, node in rec.grad_nodes.items() if node is not None}
    post.tag_scopes(graph, rec.ctx.scope_marks, rec.marks["backward"], [s.name for s in slots], grads)
    post.tag_rng_masks(graph, rec.ctx.mask_marks, rec.ctx.dropout_marks)
    for slot, node in rec.grad_nodes.items():
        if node is not None:
            node.meta[GRAD_OF_KEY] = slot
    post.drop_identity_nodes(graph)
    post.inline_scalar_constants(gm)
    post.check_graph(graph, gm)
    post.tag_overrides(graph)
    assert rec.ctx is not None
    if not rec.ctx.random_ops:
        slots = _drop_rng_slots(graph, slots)
    post.unalias_user_outputs(graph, len(slots))
    graph.eliminate_dead_code()
    post.rename_placeholders(graph, [s.name for s in slots] + batch_names)
    graph.lint()
    gm.recompile()
    return slots


def _drop_rng_slots(graph: fx.Graph, slots: list[StateSlot]) -> list[StateSlot]:
    """Remove the rng slots (placeholders and new-state outputs) of a step that draws no random numbers."""
    drop = [i for i, s in enumerate(slots) if s.kind == "rng"]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    output.args = ([o for i, o in enumerate(outs) if i not in drop],)
    graph.eliminate_dead_code()
    for i in drop:
        if placeholders[i].users:
            raise CaptureError("internal: rng state is used by a step that recorded no random op")
        graph.erase_node(placeholders[i])
    return [s for i, s in enumerate(slots) if i not in drop]


def _optimizer_meta(
    trainable: list[tuple[str, nn.Parameter, ParamOptim]], slots: list[StateSlot]
) -> dict[str, dict[str, Any]]:
    names = {s.name for s in slots}
    meta = {}
    for name, _, spec in trainable:
        meta[param_slot(name)] = {
            "kind": spec.kind,
            "group": spec.group,
            "hparams": dict(spec.hparams),
            "state": {k: optim_slot(name, k) for k in spec.state_keys},
            "lr_slot": lr_slot(spec.group),
            "step_slot": STEP_SLOT if spec.needs_step and STEP_SLOT in names else None,
        }
    return meta


def _check_one_device(
    params: Sequence[tuple[str, torch.Tensor]], bslots: Sequence[Any], batch: Sequence[Any]
) -> None:
    """The example batch must live where the parameters live (tracing mixes no devices)."""
    devices = {p.device for _, p in params}
    if len(devices) != 1:
        return  # no parameters, or a model spread over devices on purpose: tracing reports what fails
    (where,) = devices
    for slot, t in zip(bslots, batch):
        if isinstance(t, torch.Tensor) and t.device != where:
            raise CaptureError(
                f"the example batch's leaf {slot.name!r} is on {t.device}, but the model's parameters are on {where}. "
                f"Fix: move the batch to {where} before capture (e.g. {{k: v.to('{where}') for k, v in "
                "batch.items()}), or the model to the batch's device."
            )


def _check_no_jagged_left(batch: Any) -> None:
    """A KeyedJaggedTensor no adapter converted: say which import converts it (else a NoneType leaf error)."""
    for leaf in pytree.tree_leaves(batch, is_leaf=lambda x: type(x).__name__ == "KeyedJaggedTensor"):
        if type(leaf).__name__ == "KeyedJaggedTensor":
            raise CaptureError(
                "the example batch holds a TorchRec KeyedJaggedTensor, and no batch adapter converts it. "
                "Fix: import recir.embedding (it registers the adapter; its overrides() are what TorchRec "
                "models are captured with), or convert the batch with recir.embedding.pad_to_bucket."
            )
