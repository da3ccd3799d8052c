"""The verifier: every invariant broken on purpose names its id, the node, the transform and a graph window."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from _transforms_stepgraphs import mark_phase, mlp_sgd_step, run_steps, trace_step
from recir.transforms import (
    GRAD_OF_KEY,
    OPTIM_PARAM_KEY,
    OPTIMIZER_KEY,
    OVERRIDE_KEY,
    PHASE_KEY,
    BatchSlot,
    OptimizerInfo,
    VerificationError,
    lr_slot,
    optimizer_infos,
    register_override_op,
    set_optimizer_infos,
    verify,
    verify_level,
)


def _node(step, name: str) -> fx.Node:
    return next(n for n in step.graph.nodes if n.name == name)


def _first(step, target) -> fx.Node:
    return next(n for n in step.graph.nodes if n.target is target)


def _outputs(step) -> list[fx.Node]:
    return list(step.graph.output_node().args[0])


def _set_outputs(step, values) -> None:
    out = step.graph.output_node()
    out.args = (list(values),)
    step.graph_module.recompile()


def _broken(step, inv: str) -> VerificationError:
    with pytest.raises(VerificationError) as info:
        verify(step, level=2, transform="recir-test-break-it")
    err = info.value
    assert err.invariant == inv
    assert inv in str(err) and "recir-test-break-it" in str(err)
    return err


def test_verify_accepts_a_traced_step_and_respects_level(monkeypatch):
    step, _, _ = mlp_sgd_step()
    assert verify(step, level=2) is step
    monkeypatch.setenv("RECIR_VERIFY", "0")
    assert verify_level() == 0
    mm = _first(step, torch.ops.aten.mm.default)
    del mm.meta[PHASE_KEY]
    verify(step)  # level 0: nothing checked
    with pytest.raises(VerificationError):
        verify(step, level=1)


def test_inv1_call_method_and_tensor_get_attr():
    step, _, _ = mlp_sgd_step()
    mm = _first(step, torch.ops.aten.mm.default)
    with step.graph.inserting_after(mm):
        bad = step.graph.call_method("relu", (mm,))
    bad.meta.update(val=mm.meta["val"], **{PHASE_KEY: "forward"})
    mm.replace_all_uses_with(bad, delete_user_cb=lambda u: u is not bad)
    err = _broken(step, "INV-1")
    assert err.node == bad.name and ">>> %" + bad.name in str(err)

    step, _, _ = mlp_sgd_step()
    step.graph_module.register_buffer("hidden", torch.ones(()))
    relu = _first(step, torch.ops.aten.relu.default)
    with step.graph.inserting_before(relu):
        attr = step.graph.get_attr("hidden")
    err = _broken(step, "INV-1")
    assert "tensor constant" in str(err) and err.node == attr.name


def test_inv2_mutating_op():
    step, _, _ = mlp_sgd_step()
    sub = _node(step, "sub_1")  # the fc1.weight update
    sub.target = torch.ops.aten.sub_.Tensor
    err = _broken(step, "INV-2")
    assert "mutating op aten::sub_" in str(err) and err.node == "sub_1"


def test_inv2_state_output_aliases_another_input():
    step, _, _ = mlp_sgd_step()
    outs = _outputs(step)
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    outs[4] = placeholders[0]  # momentum of fc1.weight := the fc1.weight input (same shape)
    _set_outputs(step, outs)
    err = _broken(step, "INV-2")
    assert "aliases input 0" in str(err)


def test_inv2_view_of_own_input_and_shared_state_outputs():
    step, _, _ = mlp_sgd_step()
    outs = _outputs(step)
    scale = outs[3]
    with step.graph.inserting_before(step.graph.output_node()):
        view = step.graph.call_function(torch.ops.aten.view.default, (scale, []))
    view.meta.update(val=scale.meta["val"], **{PHASE_KEY: "optimizer"})
    outs[3] = view
    _set_outputs(step, outs)
    _broken(step, "INV-2")

    step, _, _ = mlp_sgd_step()
    outs = _outputs(step)
    outs[4] = outs[0]  # two state slots would share one donated buffer
    _set_outputs(step, outs)
    err = _broken(step, "INV-2")
    assert "aliases output 0" in str(err)


def test_inv3_signature_mismatch():
    step, _, _ = mlp_sgd_step()
    sig = step.signature
    extra = sig.batch + (BatchSlot("weights", (3,), torch.float32, "weight"),)
    broken = step.replace(signature=type(sig)(sig.state, extra, sig.outputs))
    err = _broken(broken, "INV-3")
    assert "expected: 7 state + 3 batch = 10 placeholders" in str(err)

    step, _, _ = mlp_sgd_step()
    _set_outputs(step, _outputs(step)[:-1])
    _broken(step, "INV-3")


def test_inv4_state_output_shape():
    step, _, _ = mlp_sgd_step()
    outs = _outputs(step)
    outs[0], outs[1] = outs[1], outs[0]  # fc1.weight gets the [8] bias update
    _set_outputs(step, outs)
    err = _broken(step, "INV-4")
    assert "expected: float32[4, 8]" in str(err) and "actual:   float32[8]" in str(err)


def test_inv5_missing_phase_and_val():
    step, _, _ = mlp_sgd_step()
    del _first(step, torch.ops.aten.relu.default).meta[PHASE_KEY]
    err = _broken(step, "INV-5")
    assert "recir.phase" in str(err)

    step, _, _ = mlp_sgd_step()
    del _first(step, torch.ops.aten.relu.default).meta["val"]
    _broken(step, "INV-5")


def test_inv5_phase_flows_backwards():
    step, _, _ = mlp_sgd_step()
    relu = _first(step, torch.ops.aten.relu.default)
    relu.meta[PHASE_KEY] = "optimizer"  # its forward users now read a later phase
    err = _broken(step, "INV-5")
    assert "reads %relu of the later phase optimizer" in str(err)


@torch.library.custom_op("recir_verify_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("recir::verify_test_twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def _insert_after_relu(step, target) -> fx.Node:
    relu = _first(step, torch.ops.aten.relu.default)
    with step.graph.inserting_after(relu):
        node = step.graph.call_function(target, (relu,))
    node.meta.update(val=relu.meta["val"], **{PHASE_KEY: "forward"})
    relu.replace_all_uses_with(node, delete_user_cb=lambda u: u is not node)
    step.graph_module.recompile()
    return node


def test_inv6_unregistered_and_python_ops():
    step, _, _ = mlp_sgd_step()
    _insert_after_relu(step, torch.ops.recir_verify_test.opaque.default)
    assert "recir_verify_test" in str(_broken(step, "INV-6"))

    step, _, _ = mlp_sgd_step()
    _insert_after_relu(step, torch.sigmoid)
    _broken(step, "INV-6")

    step, _, _ = mlp_sgd_step()
    node = _insert_after_relu(step, torch.ops.recir.verify_test_twice.default)
    assert "not a registered override op" in str(_broken(step, "INV-6"))
    register_override_op("recir::verify_test_twice", "recir-test-twice")
    assert "recir.override" in str(_broken(step, "INV-6"))
    node.meta[OVERRIDE_KEY] = "recir-test-twice"
    verify(step, level=2)


def test_inv6_functional_collectives_and_getitem_are_graph_ops():
    step, _, _ = mlp_sgd_step()
    relu = _first(step, torch.ops.aten.relu.default)
    with step.graph.inserting_after(relu):
        ar = step.graph.call_function(torch.ops._c10d_functional.all_reduce.default, (relu, "sum", "0"))
    with step.graph.inserting_after(ar):
        wait = step.graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    for n in (ar, wait):
        n.meta.update(val=relu.meta["val"], **{PHASE_KEY: "forward"})
    relu.replace_all_uses_with(wait, delete_user_cb=lambda u: u not in (ar, wait))
    verify(step, level=2)
    assert operator.getitem  # getitem is covered by multi-output ops in the dynamic test below


def test_inv7_symbolic_shapes_need_dynamic():
    def fn(state, batch):
        (w,), (x,) = state, batch
        w = w.detach().requires_grad_(True)
        loss = (x @ w).mean()
        outputs = [loss.detach()]
        mark_phase("backward")
        (g,) = torch.autograd.grad(loss, [w])
        mark_phase("optimizer")
        return [(w - 0.1 * g).detach()], outputs

    step, _, _ = trace_step(
        fn,
        {"param:w": ("param", torch.randn(4, 2))},
        {"x": ("dense", torch.randn(5, 4))},
        ["loss"],
        dynamic=True,
    )
    verify(step, level=2)  # sym_size / sym arithmetic are fine in a dynamic graph
    err = _broken(step.replace(dynamic=False), "INV-7")
    assert "symbolic shape" in str(err)


def test_error_message_is_readable():
    step, _, _ = mlp_sgd_step()
    relu = _first(step, torch.ops.aten.relu.default)
    relu.meta[PHASE_KEY] = "sideways"
    with pytest.raises(VerificationError) as info:
        verify(step, level=2)
    text = str(info.value)
    for part in (
        "INV-5 violated",
        "node: %relu",
        "expected:",
        "actual:   'sideways'",
        "fix:",
        "graph around %relu",
        ">>> %relu = aten.relu(%add)",
        "transform: (none",
    ):
        assert part in text, (part, text)


def test_inv8_grad_of_and_optim_param_name_param_slots_once():
    step, _, _ = mlp_sgd_step()
    mms = [n for n in step.graph.nodes if n.target is torch.ops.aten.mm.default]
    mms[-1].meta[GRAD_OF_KEY] = "param:fc2.weight"
    verify(step, level=2)  # one gradient node per param slot is the contract
    mms[-2].meta[GRAD_OF_KEY] = "param:fc2.weight"
    err = _broken(step, "INV-8")
    assert f"%{mms[-1].name}" in str(err) and f"%{mms[-2].name}" in str(err)
    del mms[-2].meta[GRAD_OF_KEY]
    mms[0].meta[OPTIM_PARAM_KEY] = "buffer:scale"  # a buffer is no parameter
    err = _broken(step, "INV-8")
    assert err.node == mms[0].name and "'buffer:scale'" in str(err) and "fix:" in str(err)
    mms[0].meta[OPTIM_PARAM_KEY] = "param:fc1.weight"
    mms[-1].meta[GRAD_OF_KEY] = "param:nope"
    assert "no param slot of the signature" in str(_broken(step, "INV-8"))


def test_inv9_optimizer_meta_names_the_signatures_slots():
    step, _, _ = mlp_sgd_step()
    momentum = {"momentum_buffer": "optim:fc1.weight:momentum_buffer"}
    good = OptimizerInfo("sgd", 0, {"momentum": 0.9}, momentum, lr_slot="optim:fc1.bias:momentum_buffer")
    set_optimizer_infos(step, {"param:fc1.weight": good, "param:gone": good})  # a split part keeps others'
    verify(step, level=2)
    assert optimizer_infos(step)["param:fc1.weight"] == good
    step.meta[OPTIMIZER_KEY]["param:fc1.weight"]["lr_slot"] = lr_slot(0)  # shared scalars may live elsewhere
    verify(step, level=2)
    step.meta[OPTIMIZER_KEY]["param:fc1.weight"]["state"]["sum"] = "optim:fc1.weight:sum"
    err = _broken(step, "INV-9")
    assert "'optim:fc1.weight:sum'" in str(err) and "param:fc1.weight" in str(err)
    step.meta[OPTIMIZER_KEY]["param:fc1.weight"]["state"] = momentum
    step.meta[OPTIMIZER_KEY]["param:fc1.weight"]["lr_slot"] = "lr"
    assert "not of the grammar" in str(_broken(step, "INV-9"))
    del step.meta[OPTIMIZER_KEY]["param:fc1.weight"]["kind"]
    assert "malformed" in str(_broken(step, "INV-9"))
    step.meta[OPTIMIZER_KEY] = {"fc1.weight": good.to_meta()}
    assert "no param:<path> slot name" in str(_broken(step, "INV-9"))


def test_a_stepgraph_is_a_compiled_step():
    """The reference interpreter is a backend: code written against CompiledStep runs a StepGraph as is."""
    from recir.transforms import CompiledStep

    step, state, batch = mlp_sgd_step()

    def train(compiled: CompiledStep, state, n: int):
        for _ in range(n):
            state, (loss, _) = compiled(state, batch)
        return compiled.load_state_dict(compiled.state_dict(state)), float(loss), compiled.compile_seconds

    assert isinstance(step, CompiledStep)
    again, loss, seconds = train(step, state, 2)
    assert seconds == 0.0 and loss == loss  # a number, not NaN
    want, _ = run_steps(step, state, batch, 2)
    for got, ref in zip(again, want):
        assert torch.equal(got, ref)
