"""What capture refuses, and that each CaptureError says where and what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from recir.capture import CaptureError, capture_train_step, testing
from torch import nn


def _batch() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 8), "y": torch.randn(4)}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).reshape(-1), batch["y"])


class _ItemModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # data-dependent Python value
        return self.fc(x) / scale


class _BranchModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), _Branch())
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.inner(x))


class _Branch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor value
            return x * 2
        return x


class _MaskModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[x[:, 0] > 0]).sum(0).expand(x.shape[0], 1)  # data-dependent shape


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_capture_errors_item_names_module_line_and_fix() -> None:
    model = _ItemModel()
    with pytest.raises(CaptureError) as exc:
        capture_train_step(model, _sgd(model), _loss, _batch())
    msg = str(exc.value)
    assert "depends on tensor data" in msg and "<root>" in msg
    assert "test_capture_errors.py" in msg and ".item()" in msg
    assert "Fix:" in msg and "torch.where" in msg


def test_capture_errors_data_dependent_branch_names_submodule() -> None:
    model = _BranchModel()
    with pytest.raises(CaptureError) as exc:
        capture_train_step(model, _sgd(model), _loss, _batch())
    msg = str(exc.value)
    assert "in module 'inner.1'" in msg
    assert "if x.sum() > 0" in msg
    assert "Fix:" in msg


def test_capture_errors_data_dependent_shape() -> None:
    model = _MaskModel()
    with pytest.raises(CaptureError) as exc:
        capture_train_step(model, _sgd(model), _loss, _batch())
    msg = str(exc.value)
    assert "shape that depends on tensor data" in msg and "Fix:" in msg


def test_capture_errors_lbfgs_and_unknown_optimizers() -> None:
    model = testing.MLP()
    with pytest.raises(CaptureError, match="closure") as exc:
        capture_train_step(model, torch.optim.LBFGS(model.parameters()), _loss, _batch())
    assert "Fix: use one of" in str(exc.value)

    with pytest.raises(CaptureError, match="RMSprop.*not supported") as exc:
        capture_train_step(model, torch.optim.RMSprop(model.parameters()), _loss, _batch())
    assert "Fix:" in str(exc.value)

    class MySGD(torch.optim.SGD):
        def step(self, closure=None):  # custom maths capture cannot know
            return super().step(closure)

    with pytest.raises(CaptureError, match="must not override step"):
        capture_train_step(model, MySGD(model.parameters(), lr=0.1), _loss, _batch())


def test_capture_errors_in_place_batch_modification() -> None:
    model = testing.MLP()

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch["x"].mul_(2.0)
        return _loss(m, batch)

    with pytest.raises(CaptureError) as exc:
        capture_train_step(model, _sgd(model), loss_fn, _batch())
    msg = str(exc.value)
    assert "modifies batch tensor 'x' in place (mul_)" in msg
    assert "test_capture_errors.py" in msg and ".clone()" in msg


def test_capture_errors_in_place_batch_modification_through_view() -> None:
    model = testing.MLP()

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch["x"][:, 0] += 1.0
        return _loss(m, batch)

    with pytest.raises(CaptureError, match="modifies batch tensor 'x' in place") as exc:
        capture_train_step(model, _sgd(model), loss_fn, _batch())
    assert "clone" in str(exc.value)


def test_capture_errors_loss_not_scalar() -> None:
    model = testing.MLP()

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (m(batch["x"]).reshape(-1) - batch["y"]) ** 2

    with pytest.raises(CaptureError, match=r"scalar, got float32\[4\]") as exc:
        capture_train_step(model, _sgd(model), loss_fn, _batch())
    assert "loss.mean()" in str(exc.value)


def test_capture_errors_unused_parameters_warn_and_stay_unchanged() -> None:
    model = testing.MLP()
    model.unused = nn.Linear(3, 3)
    opt = _sgd(model)
    with pytest.warns(UserWarning, match=r"unused\.weight.*unused\.bias.*no gradient"):
        step = capture_train_step(model, opt, _loss, _batch())
    state = step.init_state(model, opt)
    new, _ = step(state, _batch())
    old_sd, new_sd = step.state_dict(state), step.state_dict(new)
    assert torch.equal(old_sd["param:unused.weight"], new_sd["param:unused.weight"])
    assert not torch.equal(old_sd["param:fc1.weight"], new_sd["param:fc1.weight"])


def test_capture_errors_plain_tensor_attribute() -> None:
    class WithConstant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 1)
            self.scale = torch.arange(4.0).reshape(4, 1)  # not a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.scale

    model = WithConstant()
    with pytest.raises(CaptureError, match="register_buffer"):
        capture_train_step(model, _sgd(model), _loss, _batch())


def test_capture_errors_scalar_constant_is_inlined() -> None:
    class WithScalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * torch.tensor(0.5)

    model = WithScalar()
    step = capture_train_step(model, _sgd(model), _loss, _batch())
    assert not [n for n in step.graph.nodes if n.op == "get_attr"]
    state = step.init_state(model, _sgd(model))
    _, out = step(state, _batch())
    assert torch.isfinite(out[0])


def test_capture_errors_unsupported_random_op() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            perm = torch.randperm(x.shape[0])
            return self.fc(x[perm])

    model = Noisy()
    with pytest.raises(CaptureError, match=r"(?s)random op aten\.randperm.*Fix:"):
        capture_train_step(model, _sgd(model), _loss, _batch())


def test_capture_errors_optimizer_param_not_in_model() -> None:
    model = testing.MLP()
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(CaptureError, match="not parameters of the model"):
        capture_train_step(model, opt, _loss, _batch())


def test_capture_errors_non_tensor_batch_leaf() -> None:
    model = testing.MLP()
    with pytest.raises(CaptureError, match="batch leaf 'n' is a int"):
        capture_train_step(model, _sgd(model), _loss, {**_batch(), "n": 3})


def test_capture_errors_backward_inside_loss_fn() -> None:
    model = testing.MLP()

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = _loss(m, batch)
        loss.backward()
        return loss

    with pytest.raises(CaptureError, match=r"(?s)runs a backward pass.*Fix: make loss_fn only compute"):
        capture_train_step(model, _sgd(model), loss_fn, _batch())


def test_capture_errors_loss_independent_of_parameters_warns() -> None:
    model = testing.MLP()

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["y"].pow(2).mean()

    with pytest.warns(UserWarning, match="no gradient"):
        step = capture_train_step(model, _sgd(model), loss_fn, _batch())
    assert step.phase_counts()["optimizer"] == 0


def test_batch_on_another_device_than_the_model_names_both_and_the_fix():
    # (A CUDA model with a CPU example batch, seen on a GPU machine; the meta device stands in here.)
    model = nn.Linear(8, 1, device="meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        CaptureError,
        match=r"batch's leaf 'x' is on cpu, but the model's parameters are on meta.*Fix: move",
    ):
        capture_train_step(model, opt, _loss, _batch())
