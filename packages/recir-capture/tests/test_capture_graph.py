"""The captured graph's contract: functional, phase-tagged, ``val`` everywhere, slot order, metadata."""

from __future__ import annotations

import copy

import pytest
import torch
from recir.capture import (
    GRAD_OF_KEY,
    OPTIM_PARAM_KEY,
    OPTIMIZER_META,
    capture_train_step,
    learning_rates,
    set_learning_rate,
    sync_learning_rates,
    testing,
)
from recir.transforms import OVERRIDE_KEY, PHASE_KEY, PHASES, StepGraph, verify


def _capture(case_name: str, opt_name: str) -> tuple[StepGraph, torch.nn.Module, torch.optim.Optimizer]:
    case = testing.REFERENCE_CASES[case_name]
    model = case.build(0)
    opt = testing.make_optimizer(opt_name, model.parameters())
    step = capture_train_step(model, opt, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    return step, model, opt


@pytest.fixture(scope="module")
def emb_step() -> StepGraph:
    return _capture("embedding_bag", "adamw_amsgrad")[0]


def test_capture_graph_is_functional_tagged_and_verified(emb_step: StepGraph) -> None:
    verify(emb_step)
    order = {p: i for i, p in enumerate(PHASES)}
    for node in emb_step.graph.nodes:
        if node.op in ("placeholder", "output"):
            assert "val" in node.meta or node.op == "output", node
            continue
        assert node.op == "call_function", node.format_node()
        assert "val" in node.meta, f"{node.name} has no val"
        phase = node.meta[PHASE_KEY]
        assert not node.target._schema.is_mutable, f"mutating op {node.target}"
        for arg in node.all_input_nodes:
            if arg.op != "placeholder":
                assert order[arg.meta[PHASE_KEY]] <= order[phase], f"{arg.name} -> {node.name} goes backwards"
    counts = emb_step.phase_counts()
    assert all(counts[p] > 0 for p in PHASES), counts


def test_capture_graph_slot_order_and_names(emb_step: StepGraph) -> None:
    names = emb_step.signature.state_names()
    kinds = [s.kind for s in emb_step.signature.state]
    assert kinds == sorted(kinds, key=["param", "buffer", "optim", "rng"].index)
    assert names[0] == "param:tables.0.weight"
    assert "optim:tables.0.weight:max_exp_avg_sq" in names
    assert names[-2:] == ["optim:step", "optim:group0:lr"]
    step_slot = emb_step.signature.state[names.index("optim:step")]
    assert step_slot.dtype == torch.float32 and step_slot.shape == ()
    roles = {b.name: b.role for b in emb_step.signature.batch}
    assert roles == {
        "dense": "dense",
        "ids_0": "ids",
        "offsets_0": "offsets",
        "weights_0": "weight",
        "ids_1": "ids",
        "label": "label",
    }
    assert [o.name for o in emb_step.signature.outputs] == ["loss", "aux.0"]


def test_capture_graph_optimizer_metadata_contract(emb_step: StepGraph) -> None:
    meta = emb_step.meta[OPTIMIZER_META]
    params = [s.name for s in emb_step.signature.state if s.kind == "param"]
    assert sorted(meta) == sorted(params)
    entry = meta["param:tables.0.weight"]
    assert entry["kind"] == "adamw" and entry["group"] == 0
    assert entry["hparams"]["amsgrad"] is True and entry["hparams"]["betas"] == (0.9, 0.999)
    assert entry["state"] == {
        "exp_avg": "optim:tables.0.weight:exp_avg",
        "exp_avg_sq": "optim:tables.0.weight:exp_avg_sq",
        "max_exp_avg_sq": "optim:tables.0.weight:max_exp_avg_sq",
    }
    assert entry["lr_slot"] == "optim:group0:lr" and entry["step_slot"] == "optim:step"

    grad_nodes = {n.meta[GRAD_OF_KEY]: n for n in emb_step.graph.nodes if GRAD_OF_KEY in n.meta}
    assert set(grad_nodes) == set(params)
    for slot, node in grad_nodes.items():
        assert node.meta[PHASE_KEY] == "backward"
        assert (
            tuple(node.meta["val"].shape)
            == emb_step.signature.state[emb_step.signature.state_index(slot)].shape
        )
        # the gradient feeds that parameter's update
        assert any(u.meta.get(OPTIM_PARAM_KEY) == slot for u in node.users), slot
    # the table's gradient is the override's dense index_add (what recir-embedding rewrites)
    assert grad_nodes["param:tables.0.weight"].target == torch.ops.aten.index_add.default
    # each new parameter value is computed by nodes tagged with that parameter
    out = next(n for n in emb_step.graph.nodes if n.op == "output").args[0]
    for slot in params:
        new_value = out[emb_step.signature.state_index(slot)]
        assert new_value.meta.get(OPTIM_PARAM_KEY) == slot
        assert new_value.meta[PHASE_KEY] == "optimizer"


def test_capture_graph_override_nodes_tagged(emb_step: StepGraph) -> None:
    ops = [n for n in emb_step.graph.nodes if n.target == torch.ops.recir.embedding_bag.default]
    assert len(ops) == 2
    assert all(n.meta[OVERRIDE_KEY] == "recir-embedding-bag" for n in ops)
    assert emb_step.meta["recir.overrides"] == ["recir-embedding-bag"]


def test_capture_graph_does_not_touch_model_or_optimizer() -> None:
    case = testing.REFERENCE_CASES["embedding_bag"]
    model = case.build(0)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    modules = [type(m) for m in model.modules()]
    capture_train_step(model, opt, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    assert [type(m) for m in model.modules()] == modules  # overrides applied to a copy only
    assert len(opt.state) == 0  # no real step ran
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_capture_graph_print_shows_phases_and_slots() -> None:
    step, _, _ = _capture("mlp", "sgd_momentum_wd")
    text = str(step)
    assert text.startswith("StepGraph(")
    assert "param:fc1.weight: float32[16, 8] (param)" in text
    assert "optim:fc1.weight:momentum_buffer" in text
    assert "# forward" in text and "# backward" in text and "# optimizer" in text


def test_capture_graph_lr_change_without_recapture() -> None:
    case = testing.REFERENCE_CASES["mlp"]
    model = case.build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref, ref_opt = copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    step = capture_train_step(model, opt, case.loss_fn, case.make_batch(0))
    state = step.init_state(model, opt)
    for i in range(6):
        state, _ = step(state, case.make_batch(i))
        testing.eager_step(ref, ref_opt, case.loss_fn, case.make_batch(i))
        sched.step()
        state = sync_learning_rates(step, state, ref_opt)
    assert learning_rates(step, state) == pytest.approx([0.05 * 0.5**3])
    bad = testing.state_mismatches(
        step.state_dict(state), testing.eager_state_dict(ref, ref_opt), rtol=1e-4, atol=1e-5
    )
    assert not bad, bad
    old = state[step.signature.state_index("optim:group0:lr")]
    new_state = set_learning_rate(step, state, 0.5)
    assert learning_rates(step, new_state) == [0.5] and float(old) == pytest.approx(0.05 * 0.5**3)


def test_capture_graph_multiple_param_groups() -> None:
    case = testing.REFERENCE_CASES["mlp"]
    model = case.build(0)

    def groups(m: torch.nn.Module) -> list[dict]:
        return [
            {"params": list(m.fc1.parameters()), "lr": 0.02, "weight_decay": 0.1},
            {"params": list(m.fc2.parameters()) + list(m.out.parameters()), "betas": (0.8, 0.99)},
        ]

    opt = torch.optim.Adam(groups(model), lr=0.01)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(groups(ref), lr=0.01)
    step = capture_train_step(model, opt, case.loss_fn, case.make_batch(0))
    meta = step.meta[OPTIMIZER_META]
    assert (
        meta["param:fc1.weight"]["group"] == 0 and meta["param:fc1.weight"]["hparams"]["weight_decay"] == 0.1
    )
    assert meta["param:out.bias"]["lr_slot"] == "optim:group1:lr"
    assert meta["param:out.bias"]["hparams"]["betas"] == (0.8, 0.99)
    state = step.init_state(model, opt)
    assert learning_rates(step, state) == pytest.approx([0.02, 0.01])
    state = set_learning_rate(step, state, 0.005, group=1)
    for g in ref_opt.param_groups[1:]:
        g["lr"] = 0.005
    for i in range(10):
        state, _ = step(state, case.make_batch(i))
        testing.eager_step(ref, ref_opt, case.loss_fn, case.make_batch(i))
    bad = testing.state_mismatches(
        step.state_dict(state), testing.eager_state_dict(ref, ref_opt), rtol=1e-4, atol=1e-5
    )
    assert not bad, bad


def test_capture_graph_init_state_resumes_from_live_optimizer_state() -> None:
    """Capture after some eager steps: init_state reads optimizer.state (moments, step) and continues."""
    case = testing.REFERENCE_CASES["mlp"]
    model = case.build(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i in range(3):
        testing.eager_step(model, opt, case.loss_fn, case.make_batch(100 + i))
    ref, ref_opt = copy.deepcopy(model), torch.optim.Adam(copy.deepcopy(model).parameters())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_opt.load_state_dict(opt.state_dict())
    step = capture_train_step(model, opt, case.loss_fn, case.make_batch(0))
    state = step.init_state(model, opt)
    assert float(step.state_dict(state)["optim:step"]) == 3.0
    for i in range(5):
        state, _ = step(state, case.make_batch(i))
        testing.eager_step(ref, ref_opt, case.loss_fn, case.make_batch(i))
    bad = testing.state_mismatches(
        step.state_dict(state), testing.eager_state_dict(ref, ref_opt), rtol=1e-4, atol=1e-5
    )
    assert not bad, bad


def test_capture_graph_params_outside_optimizer_stay_fixed() -> None:
    case = testing.REFERENCE_CASES["mlp"]
    model = case.build(0)
    model.fc1.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("out.")], lr=0.1)
    step = capture_train_step(model, opt, case.loss_fn, case.make_batch(0))
    state = step.init_state(model, opt)
    new, _ = step(state, case.make_batch(1))
    sd_old, sd_new = step.state_dict(state), step.state_dict(new)
    for frozen in ("param:fc1.weight", "param:out.weight", "param:out.bias"):
        assert torch.equal(sd_old[frozen], sd_new[frozen]), frozen
    assert not torch.equal(sd_old["param:fc2.weight"], sd_new["param:fc2.weight"])
    assert "param:out.weight" not in step.meta[OPTIMIZER_META]


def test_capture_graph_dynamic_batch_dimension() -> None:
    case = testing.REFERENCE_CASES["mlp"]
    model = case.build(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = capture_train_step(model, opt, case.loss_fn, case.make_batch(0), mode="dynamic")
    assert step.dynamic
    bigger = {"x": torch.randn(7, 8), "y": torch.randn(7)}  # captured with 4 rows
    out = step.graph_module(*step.init_state(model, opt), bigger["x"], bigger["y"])
    torch.testing.assert_close(out[-1], case.loss_fn(model, bigger))


def test_capture_graph_tied_weights_and_nested_batch() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 6)
            self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight  # one parameter, two modules

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    def loss_fn(m: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        (ids,), labels = batch["inputs"], batch["labels"]
        logits = m(ids)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), {"logits": logits}

    torch.manual_seed(0)
    model = Tied()
    batch = {"inputs": (torch.randint(0, 10, (2, 3)),), "labels": torch.randint(0, 10, (2, 3))}
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    step = capture_train_step(model, opt, loss_fn, batch)
    assert [s.name for s in step.signature.state if s.kind == "param"] == ["param:emb.weight"]
    assert [(b.name, b.role) for b in step.signature.batch] == [("inputs.0", "ids"), ("labels", "label")]
    assert [o.name for o in step.signature.outputs] == ["loss", "aux.0.logits"]
    state = step.init_state(model, opt)
    for _ in range(5):
        state, (loss, aux) = step(state, batch)
        ref_loss = testing.eager_step(ref, ref_opt, loss_fn, batch)
        assert aux["logits"].shape == (2, 3, 10)
        torch.testing.assert_close(loss, ref_loss)
    bad = testing.state_mismatches(
        step.state_dict(state), testing.eager_state_dict(ref, ref_opt), rtol=1e-4, atol=1e-5
    )
    assert not bad, bad


def test_capture_graph_two_optimizers_dense_adam_sparse_rowwise() -> None:
    """DLRM's setup: Adam on dense parameters, RowWiseAdagrad on tables; groups numbered across both."""
    case = testing.REFERENCE_CASES["embedding_bag"]

    def optimizers(m: torch.nn.Module) -> list[torch.optim.Optimizer]:
        tables = [p for n, p in m.named_parameters() if n.startswith("tables.")]
        dense = [p for n, p in m.named_parameters() if not n.startswith("tables.")]
        return [torch.optim.Adam(dense, lr=0.01), testing.make_optimizer("rowwise_adagrad", tables)]

    model = case.build(0)
    opts = optimizers(model)
    ref = copy.deepcopy(model)
    ref_opts = optimizers(ref)
    step = capture_train_step(model, opts, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    meta = step.meta[OPTIMIZER_META]
    assert meta["param:tables.0.weight"]["kind"] == "rowwise_adagrad"
    assert meta["param:tables.0.weight"]["lr_slot"] == "optim:group1:lr"
    assert meta["param:top.0.weight"]["kind"] == "adam"
    state = step.init_state(model, opts)
    assert float(step.state_dict(state)["optim:step"]) == 0.0
    for i in range(10):
        batch = case.make_batch(i)
        state, _ = step(state, batch)
        result = case.loss_fn(ref, batch)[0]
        result.backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    eager = testing.eager_state_dict(ref, ref_opts[0])
    eager |= {
        k: v for k, v in testing.eager_state_dict(ref, ref_opts[1]).items() if k.startswith("optim:tables")
    }
    bad = testing.state_mismatches(step.state_dict(state), eager, rtol=1e-4, atol=1e-5)
    assert not bad, bad
    state = sync_learning_rates(step, state, ref_opts)
    assert learning_rates(step, state) == pytest.approx([0.01, 0.05])


@pytest.mark.parametrize(
    ("name", "dtype", "role"),
    [
        ("features.values", torch.int64, "ids"),
        ("uih_lengths", torch.int64, "lengths"),
        ("num_candidates", torch.int64, "lengths"),
        ("offsets_0", torch.int32, "offsets"),
        ("uih_timestamps", torch.int64, "other"),
        ("cand_actions", torch.int64, "other"),
        ("weights_0", torch.float32, "weight"),
        ("labels", torch.float32, "label"),
        ("dense", torch.bfloat16, "dense"),
        ("mask", torch.bool, "other"),
    ],
)
def test_capture_graph_batch_role_guess(name: str, dtype: torch.dtype, role: str) -> None:
    from recir.capture._slots import guess_role

    assert guess_role(name, dtype) == role


def test_capture_graph_aux_outputs_never_alias_state() -> None:
    """Returning a parameter, a view of the batch or an updated buffer as aux output stays INV-2-clean."""
    case = testing.REFERENCE_CASES["batchnorm"]
    model = case.build(0)

    def loss_fn(m: torch.nn.Module, batch: dict) -> tuple:
        loss = case.loss_fn(m, batch)
        return loss, m.out.weight, batch["x"].t(), m.bn.running_mean

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, loss_fn, case.make_batch(0))
    verify(step, level=2)
    state = step.init_state(model, opt)
    new_state, (_, w, xt, rm) = step(state, case.make_batch(0))
    sd = step.state_dict(state)
    torch.testing.assert_close(w, sd["param:out.weight"])
    assert w.data_ptr() != sd["param:out.weight"].data_ptr()
    torch.testing.assert_close(rm, step.state_dict(new_state)["buffer:bn.running_mean"])
    torch.testing.assert_close(xt, case.make_batch(0)["x"].t())


def test_capture_graph_gradient_penalty_double_backward() -> None:
    """autograd.grad(create_graph=True) inside loss_fn (a gradient penalty) is part of the forward."""
    case = testing.REFERENCE_CASES["mlp"]

    def loss_fn(m: torch.nn.Module, b: dict) -> torch.Tensor:
        x = b["x"].clone().requires_grad_(True)
        out = m(x).reshape(-1)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return torch.nn.functional.mse_loss(out, b["y"]) + 0.1 * gx.pow(2).mean()

    model = case.build(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    step = capture_train_step(model, opt, loss_fn, case.make_batch(0))
    state = step.init_state(model, opt)
    for i in range(5):
        state, _ = step(state, case.make_batch(i))
        testing.eager_step(ref, ref_opt, loss_fn, case.make_batch(i))
    bad = testing.state_mismatches(
        step.state_dict(state), testing.eager_state_dict(ref, ref_opt), rtol=1e-4, atol=1e-5
    )
    assert not bad, bad


def test_capture_graph_scopes_name_the_module_of_every_phase() -> None:
    from recir.transforms import SCOPE_KEY

    model = testing.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, lambda m, b: m(b["x"]).pow(2).mean(), {"x": torch.randn(4, 8)})
    scopes: dict[str, set[str]] = {p: set() for p in PHASES}
    for node in step.graph.nodes:
        if node.op == "call_function":
            scopes[node.meta[PHASE_KEY]].add(node.meta.get(SCOPE_KEY, "?"))
    mm = {n.meta[SCOPE_KEY] for n in step.graph.nodes if n.target == torch.ops.aten.addmm.default}
    assert mm == {"fc1", "fc2", "out"}  # each forward product is its Linear's
    assert {"fc1", "fc2", "out"} <= scopes["forward"]
    # backward: the weight gradients read the modules' inputs and weights
    grads = {n.meta[SCOPE_KEY] for n in step.graph.nodes if n.meta.get(GRAD_OF_KEY)}
    assert grads == {"fc1", "fc2", "out"}
    # optimizer: the parameter's module
    assert scopes["optimizer"] <= {"fc1", "fc2", "out", ""} and {"fc1", "fc2", "out"} <= scopes["optimizer"]
