"""Functional optimizers with torch.optim's maths (single-tensor, non-foreach, non-capturable path): the
one home of RecIR's optimizer maths.

Each update is a pure function ``(param, grad, state, lr, step) -> (new_param, new_state)``. recir-capture
traces it into a step's optimizer phase (dense updates); recir-embedding applies it to the gathered rows of
a table (sparse row-wise updates). Scalar bias corrections are computed in float64 like torch.optim's
Python floats, then applied to float32 tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

OPTIMIZER_KINDS: tuple[str, ...] = ("sgd", "adam", "adamw", "adagrad", "rowwise_adagrad")

# torch.optim's defaults of the hyper-parameters each kind reads (RowWiseAdagrad's for rowwise_adagrad)
HPARAM_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0, "maximize": False},
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False},
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False},
    "adagrad": {
        "lr_decay": 0.0,
        "eps": 1e-10,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "maximize": False,
    },
    "rowwise_adagrad": {
        "eps": 1e-10,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "maximize": False,
    },
}


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


def param_optim(kind: str, hparams: Mapping[str, Any], group: int = 0) -> ParamOptim:
    """A :class:`ParamOptim` of ``kind``; hyper-parameters ``hparams`` lacks take torch.optim's defaults."""
    if kind not in HPARAM_DEFAULTS:
        raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {OPTIMIZER_KINDS}")
    full = {**HPARAM_DEFAULTS[kind], **hparams}
    return ParamOptim(kind, group, full, state_keys_for(kind, full))


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


def group_scalars(spec: ParamOptim, lr: Tensor, step: Tensor | None, dtype: torch.dtype) -> dict[str, Tensor]:
    """The per-group scalar tensors of an update (bias corrections, effective lr), computed once per group.

    Like torch.optim's Python-float scalars they are formed in float64, then cast to the parameter dtype.
    """
    h = spec.hparams
    lr64 = _f64(lr)
    if spec.kind in ("adam", "adamw"):
        assert step is not None
        beta1, beta2 = h["betas"]
        step64 = _f64(step)
        out = {
            "step_size": (lr64 / (1 - torch.pow(beta1, step64))).to(dtype),
            "bc2_sqrt": (1 - torch.pow(beta2, step64)).sqrt().to(dtype),
        }
        if spec.kind == "adamw" and h["weight_decay"] != 0:
            out["decay"] = (1 - lr64 * h["weight_decay"]).to(dtype)
        return out
    if spec.kind == "adagrad":
        assert step is not None
        return {"clr": (lr64 / (1 + (_f64(step) - 1) * h["lr_decay"])).to(dtype)}
    if spec.kind == "sgd" and spec.needs_step:
        assert step is not None
        return {"lr": lr.to(dtype), "first": step <= 1}
    return {"lr": lr.to(dtype)}


def apply_update(
    spec: ParamOptim,
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    lr: Tensor,
    step: Tensor | None,
    scalars: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One parameter's update. ``step`` is the already-incremented float32 step count (as torch.optim).

    ``scalars`` (from :func:`group_scalars`) may be passed to share them across a group's parameters.
    """
    if scalars is None:
        scalars = group_scalars(spec, lr, step, param.dtype)
    h = spec.hparams
    g = -grad if h["maximize"] else grad
    if spec.kind == "sgd":
        return _sgd(param, g, state, scalars, h)
    if spec.kind in ("adam", "adamw"):
        return _adam(param, g, state, scalars, h, decoupled=spec.kind == "adamw")
    if spec.kind == "adagrad":
        return _adagrad(param, g, state, scalars, h)
    if spec.kind == "rowwise_adagrad":
        new_param, new_sum = rowwise_adagrad_update(
            param,
            g,
            state["sum"],
            lr=scalars["lr"],
            eps=h["eps"],
            weight_decay=h["weight_decay"],
            maximize=False,
        )
        return new_param, {"sum": new_sum}
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def rowwise_mean_square(grad: Tensor) -> Tensor:
    """``mean(grad**2)`` over every dim but the first: one value per row (a 1-D param is its own row)."""
    sq = grad * grad
    if sq.dim() <= 1:
        return sq
    return sq.mean(dim=tuple(range(1, sq.dim())))


def rowwise_adagrad_update(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    *,
    lr: float | Tensor,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> tuple[Tensor, Tensor]:
    """One functional row-wise Adagrad update (FBGEMM's EXACT_ROWWISE_ADAGRAD); ``(new_param, new_sum)``."""
    g = -grad if maximize else grad
    if weight_decay != 0:
        g = g + weight_decay * param
    new_sum = state_sum + rowwise_mean_square(g)
    std = new_sum.sqrt() + eps
    scale = lr / std
    new_param = param - scale.reshape(scale.shape + (1,) * (param.dim() - 1)) * g
    return new_param, new_sum


# The updates below spell out torch.optim's fused CPU kernels in the same evaluation order:
# add(a, b, alpha) = a + alpha * b; addcmul(a, x, y, value) = a + value * x * y; lerp with weight w < 0.5
# = a + w * (b - a), else b - (b - a) * (1 - w).


def _sgd(
    param: Tensor, g: Tensor, state: dict[str, Tensor], sc: dict[str, Tensor], h: dict[str, Any]
) -> tuple[Tensor, dict[str, Tensor]]:
    if h["weight_decay"] != 0:
        g = g + h["weight_decay"] * param
    new_state: dict[str, Tensor] = {}
    momentum = h["momentum"]
    if momentum != 0:
        buf = state["momentum_buffer"]
        if h["dampening"] != 0:
            # torch.optim's first step sets buf = grad (no dampening), later ones dampen
            buf = torch.where(sc["first"], g, buf * momentum + (1 - h["dampening"]) * g)
        else:
            # buf starts at zero here and 0 * momentum + grad == grad exactly: no step count needed
            buf = buf * momentum + g
        new_state["momentum_buffer"] = buf
        g = g + momentum * buf if h["nesterov"] else buf
    return param - sc["lr"] * g, new_state


def _lerp(a: Tensor, b: Tensor, w: float) -> Tensor:
    return a + w * (b - a) if abs(w) < 0.5 else b - (b - a) * (1 - w)


def _adam(
    param: Tensor,
    g: Tensor,
    state: dict[str, Tensor],
    sc: dict[str, Tensor],
    h: dict[str, Any],
    *,
    decoupled: bool,
) -> tuple[Tensor, dict[str, Tensor]]:
    beta1, beta2 = h["betas"]
    wd = h["weight_decay"]
    if wd != 0:
        if decoupled:
            param = param * sc["decay"]
        else:
            g = g + wd * param
    exp_avg = _lerp(state["exp_avg"], g, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    new_state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if h["amsgrad"]:
        max_sq = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = max_sq
        denom = max_sq.sqrt() / sc["bc2_sqrt"] + h["eps"]
    else:
        denom = exp_avg_sq.sqrt() / sc["bc2_sqrt"] + h["eps"]
    return param - sc["step_size"] * (exp_avg / denom), new_state


def _adagrad(
    param: Tensor, g: Tensor, state: dict[str, Tensor], sc: dict[str, Tensor], h: dict[str, Any]
) -> tuple[Tensor, dict[str, Tensor]]:
    if h["weight_decay"] != 0:
        g = g + h["weight_decay"] * param
    new_sum = state["sum"] + g * g
    std = new_sum.sqrt() + h["eps"]
    return param - sc["clr"] * (g / std), {"sum": new_sum}
