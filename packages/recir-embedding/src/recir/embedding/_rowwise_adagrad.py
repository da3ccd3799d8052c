"""RowWiseAdagrad: FBGEMM's row-wise Adagrad as an eager ``torch.optim.Optimizer``.

One accumulator per row (dim 0) holds the running sum of the row's mean squared gradient, so an
embedding table of ``rows x D`` keeps ``rows`` floats of optimizer state instead of ``rows x D``.
recir-capture recognises it by its ``recir_optimizer_kind`` class attribute (without importing this package)
and captures the same maths, ``recir.transforms.rowwise_adagrad_update``, as the ``rowwise_adagrad`` kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from recir.transforms import rowwise_adagrad_update


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad (FBGEMM ``EmbOptimType.EXACT_ROWWISE_ADAGRAD`` maths), for embedding tables.

    Per row ``r``: ``sum[r] += mean(g[r]**2)``; ``w[r] -= lr * g[r] / (sqrt(sum[r]) + eps)``. State key
    ``sum`` has shape ``[rows]``. Rows with a zero gradient are left unchanged (unless ``weight_decay``
    is set: the dense maths then decays every row, while FBGEMM decays only the rows a batch touches).
    """

    #: capture's optimizer protocol: this class's step() is recir.transforms' ``rowwise_adagrad`` maths
    recir_optimizer_kind: ClassVar[str] = "rowwise_adagrad"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        *,
        maximize: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or initial_accumulator_value < 0:
            raise ValueError(
                f"RowWiseAdagrad: lr, eps, weight_decay, initial_accumulator_value must be >= 0, got "
                f"{lr}, {eps}, {weight_decay}, {initial_accumulator_value}"
            )
        defaults = {
            "lr": lr,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "maximize": maximize,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 0:
                    raise ValueError("RowWiseAdagrad needs parameters with at least one dimension (rows)")
                self.state[p]["sum"] = torch.full(
                    (p.shape[0],), float(group["initial_accumulator_value"]), dtype=p.dtype, device=p.device
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                state = self.state[p]
                new_p, new_sum = rowwise_adagrad_update(
                    p,
                    grad,
                    state["sum"],
                    lr=float(group["lr"]),
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    maximize=group["maximize"],
                )
                p.copy_(new_p)
                state["sum"].copy_(new_sum)
        return loss
