"""Map a live ``torch.optim`` optimizer to RecIR functional optimizers, one :class:`ParamOptim` per parameter.

Only the hyper-parameters are read (never the state). The learning rate is not baked in: it lives in a
``optim:group<i>:lr`` state slot so schedulers can change it without recapturing.

torch.optim's SGD, Adam, AdamW and Adagrad are known by class. Any other optimizer class states the maths
its ``step()`` computes with the class attribute ``recir_optimizer_kind`` (one of
``recir.transforms.OPTIMIZER_KINDS``), e.g. ``recir.embedding.RowWiseAdagrad``'s ``"rowwise_adagrad"``, so
capture needs no import of the package that defines it. Its param groups' hyper-parameters are read as
that kind's; those a group lacks take torch.optim's defaults (``recir.transforms.param_optim``).
"""

from __future__ import annotations

from typing import Any

import torch
from recir.transforms import OPTIMIZER_KINDS, CaptureError, ParamOptim, param_optim

#: The class attribute by which an optimizer outside torch.optim names its functional maths.
KIND_ATTR = "recir_optimizer_kind"

_SUPPORTED = (
    "torch.optim.SGD, Adam, AdamW, Adagrad, recir.embedding.RowWiseAdagrad, or an optimizer class whose "
    f"{KIND_ATTR} class attribute names its step() maths (one of {', '.join(OPTIMIZER_KINDS)})"
)

# Exact classes only: a subclass may override step() with other maths.
_TORCH_KINDS: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.SGD: "sgd",
    torch.optim.Adam: "adam",
    torch.optim.AdamW: "adamw",
    torch.optim.Adagrad: "adagrad",
}


def _step_of(cls: type) -> object:
    """``cls.step`` without torch.optim's profiling wrapper (which the first instance of a class puts on it)."""
    step: object = getattr(cls, "step", None)
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = getattr(step, "__wrapped__")  # noqa: B009 (mypy: object has no __wrapped__)
    return step


def _declared_kind(cls: type[torch.optim.Optimizer]) -> str | None:
    """The ``recir_optimizer_kind`` of ``cls`` (or the base class declaring it), checked; None without one."""
    owner = next((c for c in cls.__mro__ if KIND_ATTR in vars(c)), None)
    if owner is None:
        return None
    name = f"{cls.__module__}.{cls.__qualname__}"
    kind = vars(owner)[KIND_ATTR]
    if not isinstance(kind, str) or kind not in OPTIMIZER_KINDS:
        raise CaptureError(
            f"optimizer {name} declares {KIND_ATTR} = {kind!r}, which is not an optimizer kind RecIR knows "
            f"(valid kinds: {', '.join(OPTIMIZER_KINDS)}).\n"
            f"Fix: set {KIND_ATTR} to the kind whose maths its step() computes, or use one of "
            "torch.optim.SGD, Adam, AdamW, Adagrad."
        )
    if owner is not cls and _step_of(cls) is not _step_of(owner):
        raise CaptureError(
            f"optimizer {name} overrides step() of {owner.__module__}.{owner.__qualname__}, whose "
            f"{KIND_ATTR} = {kind!r} then no longer says what it computes.\n"
            f"Fix: declare {KIND_ATTR} on {cls.__qualname__} itself if its step() is that kind's maths."
        )
    return kind


def _kind_of(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise CaptureError(
            "torch.optim.LBFGS cannot be captured: it needs a closure that re-evaluates the loss several "
            "times per step, which one functional step graph cannot express.\n"
            f"Fix: use one of {_SUPPORTED}."
        )
    if cls in _TORCH_KINDS:
        return _TORCH_KINDS[cls]
    declared = _declared_kind(cls)
    if declared is not None:
        return declared
    for base, kind in _TORCH_KINDS.items():
        if isinstance(optimizer, base) and cls.step is base.step:
            return kind
    raise CaptureError(
        f"optimizer {cls.__module__}.{cls.__qualname__} is not supported by capture (its step() maths is "
        f"unknown to RecIR).\nFix: use one of {_SUPPORTED}; a subclass must not override step()."
    )


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, (tuple, list)):
        return tuple(_plain(v) for v in x)
    return x


def _hparams(kind: str, group: dict[str, Any], index: int) -> dict[str, Any]:
    keys = {
        "sgd": ("momentum", "dampening", "nesterov", "weight_decay", "maximize"),
        "adam": ("betas", "eps", "weight_decay", "amsgrad", "maximize"),
        "adamw": ("betas", "eps", "weight_decay", "amsgrad", "maximize"),
        "adagrad": ("lr_decay", "eps", "weight_decay", "initial_accumulator_value", "maximize"),
        "rowwise_adagrad": ("eps", "weight_decay", "initial_accumulator_value", "maximize"),
    }[kind]
    # a key a group lacks (a recir_optimizer_kind class's may) takes torch.optim's default in param_optim
    h = {k: _plain(group[k]) for k in keys if k in group}
    if group.get("differentiable", False):
        raise CaptureError(
            f"optimizer param group {index} has differentiable=True; capture traces a plain update.\n"
            "Fix: construct the optimizer with differentiable=False."
        )
    return h


def as_optimizer_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    """One optimizer, a sequence of them (e.g. dense Adam + sparse RowWiseAdagrad), or None -> a list."""
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in items:
        if not isinstance(opt, torch.optim.Optimizer):
            raise CaptureError(
                f"expected a torch.optim.Optimizer (or a list of them), got {type(opt).__name__}.\n"
                f"Fix: pass one of {_SUPPORTED}."
            )
    return items


def all_param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """Every param group of every optimizer, in order: the global group index of ``optim:group<i>:lr``."""
    return [g for opt in as_optimizer_list(optimizer) for g in opt.param_groups]


def optimizer_specs(optimizer: Any) -> dict[int, ParamOptim]:
    """``id(param) -> ParamOptim`` for every parameter of every group (groups numbered across optimizers)."""
    optimizers = as_optimizer_list(optimizer)
    if not optimizers:
        raise CaptureError(f"capture needs an optimizer.\nFix: pass one of {_SUPPORTED}.")
    specs: dict[int, ParamOptim] = {}
    index = 0
    for opt in optimizers:
        base_kind = _kind_of(opt)
        for group in opt.param_groups:
            kind = base_kind
            if kind == "adam" and group.get("decoupled_weight_decay", False):
                kind = "adamw"  # Adam(decoupled_weight_decay=True) is AdamW's maths
            h = _hparams(base_kind, group, index)
            spec = param_optim(kind, h, index)
            for p in group["params"]:
                if id(p) in specs:
                    raise CaptureError(
                        "a parameter appears in two optimizer param groups (or two optimizers).\n"
                        "Fix: give each parameter to exactly one group of one optimizer."
                    )
                specs[id(p)] = spec
            index += 1
    return specs


def group_learning_rates(optimizer: Any) -> list[float]:
    return [float(_plain(g["lr"])) for g in all_param_groups(optimizer)]
