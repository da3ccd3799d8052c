"""Functional optimizers with torch.optim's maths (single-tensor, non-foreach, non-capturable path).

Each update is a pure function ``(param, grad, state, lr, step) -> (new_param, new_state)``; capture
traces it into the optimizer phase. Scalar bias corrections are computed in float64 like torch.optim's
Python floats, then applied to float32 tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from ._rowwise_adagrad import rowwise_adagrad_update

KINDS: tuple[str, ...] = ("sgd", "adam", "adamw", "adagrad", "rowwise_adagrad")


@dataclasses.dataclass(frozen=True)
class ParamOptim:
    """How one parameter is updated: the kind, its group, plain-python hyper-parameters, its state keys."""

    kind: str
    group: int
    hparams: dict[str, Any]
    state_keys: tuple[str, ...]

    @property
    def needs_step(self) -> bool:
        if self.kind in ("adam", "adamw", "adagrad"):
            return True
        # SGD's first step copies the gradient into the buffer; with dampening that differs from the
        # general formula applied to a zero buffer, so the step count is needed to tell them apart.
        return self.kind == "sgd" and self.hparams["momentum"] != 0 and self.hparams["dampening"] != 0


def state_keys_for(kind: str, hparams: dict[str, Any]) -> tuple[str, ...]:
    if kind == "sgd":
        return ("momentum_buffer",) if hparams["momentum"] != 0 else ()
    if kind in ("adam", "adamw"):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if hparams["amsgrad"] else ())
    if kind in ("adagrad", "rowwise_adagrad"):
        return ("sum",)
    raise ValueError(f"unknown optimizer kind {kind!r}")


def state_shape(kind: str, key: str, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "rowwise_adagrad" and key == "sum":
        return param_shape[:1]
    return param_shape


def _f64(x: Tensor) -> Tensor:
    return x.to(torch.float64)


def apply_update(
    spec: ParamOptim,
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    lr: Tensor,
    step: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One parameter's update. ``step`` is the already-incremented float32 step count (as torch.optim)."""
    h = spec.hparams
    if spec.kind == "sgd":
        return _sgd(param, grad, state, lr, step, h)
    if spec.kind in ("adam", "adamw"):
        assert step is not None
        return _adam(param, grad, state, lr, step, h, decoupled=spec.kind == "adamw")
    if spec.kind == "adagrad":
        assert step is not None
        return _adagrad(param, grad, state, lr, step, h)
    if spec.kind == "rowwise_adagrad":
        new_param, new_sum = rowwise_adagrad_update(
            param,
            grad,
            state["sum"],
            lr=lr.to(param.dtype),
            eps=h["eps"],
            weight_decay=h["weight_decay"],
            maximize=h["maximize"],
        )
        return new_param, {"sum": new_sum}
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def _sgd(param, grad, state, lr, step, h):
    g = -grad if h["maximize"] else grad
    if h["weight_decay"] != 0:
        g = torch.add(g, param, alpha=h["weight_decay"])
    new_state: dict[str, Tensor] = {}
    momentum = h["momentum"]
    if momentum != 0:
        buf = state["momentum_buffer"]
        if h["dampening"] != 0:
            general = torch.add(buf * momentum, g, alpha=1 - h["dampening"])
            buf = torch.where(step <= 1, g, general)
        else:
            # torch.optim sets buf = grad on the first step; buf starts at zero here and
            # 0 * momentum + grad == grad exactly, so no step count is needed.
            buf = buf * momentum + g
        new_state["momentum_buffer"] = buf
        g = torch.add(g, buf, alpha=momentum) if h["nesterov"] else buf
    return param - lr.to(param.dtype) * g, new_state


def _adam(param, grad, state, lr, step, h, *, decoupled):
    beta1, beta2 = h["betas"]
    g = -grad if h["maximize"] else grad
    wd = h["weight_decay"]
    if wd != 0:
        if decoupled:
            param = param * (1 - _f64(lr) * wd).to(param.dtype)
        else:
            g = torch.add(g, param, alpha=wd)
    exp_avg = torch.lerp(state["exp_avg"], g, 1 - beta1)
    exp_avg_sq = torch.addcmul(state["exp_avg_sq"] * beta2, g, g, value=1 - beta2)
    step64 = _f64(step)
    bias_correction1 = 1 - torch.pow(beta1, step64)
    bias_correction2 = 1 - torch.pow(beta2, step64)
    step_size = (_f64(lr) / bias_correction1).to(param.dtype)
    bc2_sqrt = bias_correction2.sqrt().to(param.dtype)
    new_state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if h["amsgrad"]:
        max_sq = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = max_sq
        denom = max_sq.sqrt() / bc2_sqrt + h["eps"]
    else:
        denom = exp_avg_sq.sqrt() / bc2_sqrt + h["eps"]
    return param - step_size * (exp_avg / denom), new_state


def _adagrad(param, grad, state, lr, step, h):
    g = -grad if h["maximize"] else grad
    if h["weight_decay"] != 0:
        g = torch.add(g, param, alpha=h["weight_decay"])
    clr = (_f64(lr) / (1 + (_f64(step) - 1) * h["lr_decay"])).to(param.dtype)
    new_sum = torch.addcmul(state["sum"], g, g, value=1)
    std = new_sum.sqrt() + h["eps"]
    return param - clr * (g / std), {"sum": new_sum}
