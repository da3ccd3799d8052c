"""StepGraphs built by hand for recir-lower-gpu's tests: make_fx of a pure SGD-with-momentum step.

Slot names follow recir-capture's conventions (``param:<path>``, ``buffer:<path>``,
``optim:<path>:momentum_buffer``), so ``step.init_state(model, optimizer)`` reads a live model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from recir.transforms import (
    OVERRIDE_KEY,
    PHASE_KEY,
    BatchSlot,
    OutputSlot,
    Signature,
    StateSlot,
    StepGraph,
    override_for_op,
)
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx


def _momentum_init(slot: StateSlot, model: nn.Module, optimizer: Any) -> torch.Tensor | None:
    if slot.kind != "optim":
        return None
    path = slot.name.split(":")[1]
    param = model.get_parameter(path)
    buf = optimizer.state.get(param, {}).get("momentum_buffer") if optimizer is not None else None
    return torch.zeros_like(param) if buf is None else buf.detach().clone()


def sgd_step_graph(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    example_batch: Any,
    *,
    lr: float = 0.1,
    momentum: float = 0.9,
) -> StepGraph:
    """The pure step ``(params, buffers, momenta, batch) -> (new..., loss)`` of torch.optim.SGD(lr, momentum).

    Matches torch.optim.SGD exactly when optimizer state starts empty: the first step sets the buffer
    to the gradient (``zeros * momentum + grad`` equals it). Buffers pass through unchanged.
    """
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    p_names, b_names = list(params), list(buffers)
    leaves, spec = pytree.tree_flatten(example_batch)
    n_p, n_b = len(p_names), len(b_names)

    def flat_step(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = [p.detach().requires_grad_(True) for p in args[:n_p]]
        bs = list(args[n_p : n_p + n_b])
        moms = args[n_p + n_b : 2 * n_p + n_b]
        batch = pytree.tree_unflatten(list(args[2 * n_p + n_b :]), spec)
        state = {**dict(zip(p_names, ps)), **dict(zip(b_names, bs))}

        class _Bound(nn.Module):
            def forward(self, b: Any) -> Any:
                return torch.func.functional_call(model, state, (b,))

        loss = loss_fn(_Bound(), batch)
        grads = torch.autograd.grad(loss, ps)
        new_m = [m * momentum + g for m, g in zip(moms, grads)]
        new_p = [(p - lr * m).detach() for p, m in zip(ps, new_m)]
        return (*new_p, *bs, *(m.detach() for m in new_m), loss.detach())

    example = [p.detach() for p in params.values()] + [b for b in buffers.values()]
    example += [torch.zeros_like(p) for p in params.values()] + list(leaves)
    gm = make_fx(flat_step, tracing_mode="fake")(*example)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[PHASE_KEY] = (
                "forward"  # hand-built: phases are not tracked (verifier accepts one phase)
            )
            if override_for_op(node.target) is not None:
                node.meta[OVERRIDE_KEY] = override_for_op(node.target)
    loss_val = next(n for n in gm.graph.nodes if n.op == "output").args[0][-1].meta["val"]
    state = [StateSlot(f"param:{n}", "param", tuple(p.shape), p.dtype) for n, p in params.items()]
    state += [StateSlot(f"buffer:{n}", "buffer", tuple(b.shape), b.dtype) for n, b in buffers.items()]
    state += [
        StateSlot(f"optim:{n}:momentum_buffer", "optim", tuple(p.shape), p.dtype) for n, p in params.items()
    ]
    signature = Signature(
        state=tuple(state),
        batch=tuple(BatchSlot(f"batch.{i}", tuple(t.shape), t.dtype) for i, t in enumerate(leaves)),
        outputs=(OutputSlot("loss", tuple(loss_val.shape), loss_val.dtype),),
        batch_spec=spec,
    )
    return StepGraph(gm, signature, initializers=(_momentum_init,))


class TinyMLP(nn.Module):
    def __init__(self, din: int = 8, hidden: int = 16, dout: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(din, hidden)
        self.fc2 = nn.Linear(hidden, dout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def mse_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def mlp_batch(seed: int, n: int = 4, din: int = 8, dout: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, din, generator=g), "y": torch.randn(n, dout, generator=g)}


def train_compiled(
    compiled: Any, model: nn.Module, optimizer: Any, batches: list[Any]
) -> tuple[dict, torch.Tensor]:
    """Run ``compiled`` from ``model``/``optimizer``'s state over ``batches``: (final state dict, losses)."""
    state, losses = compiled.init_state(model, optimizer), []
    for batch in batches:
        state, out = compiled(state, batch)
        losses.append(out[0])
    return compiled.state_dict(state), torch.stack(losses)


def assert_states_match_eager_sgd(
    model: nn.Module,
    fresh: nn.Module,
    states: dict[str, dict],
    *,
    n: int,
    steps: int = 5,
    lr: float = 0.05,
    momentum: float = 0.9,
    rtol: float,
    atol: float,
) -> None:
    """Each compiled run's final state dict in ``states`` (name -> ``compiled.state_dict``, trained from
    ``model`` over ``mlp_batch(0..steps-1, n)``) holds the parameters and momenta that eager
    ``torch.optim.SGD(lr, momentum)`` reaches from the same start; ``fresh`` is a new instance of
    ``model``'s class, the eager copy."""
    fresh.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(fresh.parameters(), lr=lr, momentum=momentum)
    for i in range(steps):
        opt.zero_grad()
        mse_loss(fresh, mlp_batch(i, n=n)).backward()
        opt.step()
    for name, p in fresh.named_parameters():
        for run, sd in states.items():
            torch.testing.assert_close(sd[f"param:{name}"], p.detach(), rtol=rtol, atol=atol, msg=run)
            momentum_buffer = opt.state[p]["momentum_buffer"]
            torch.testing.assert_close(
                sd[f"optim:{name}:momentum_buffer"], momentum_buffer, rtol=rtol, atol=atol, msg=run
            )


def train_sgd_compiled(model: nn.Module, options: Any, *, n: int, steps: int = 5) -> dict:
    """``model``'s SGD step (``mse_loss``, lr 0.05, momentum 0.9; what :func:`assert_states_match_eager_sgd`
    replays) compiled for the CPU with ``options`` and trained over ``mlp_batch(0..steps-1, n)``: the final
    state dict."""
    import recir.lower_gpu as lg

    step = sgd_step_graph(model, mse_loss, mlp_batch(0, n=n), lr=0.05, momentum=0.9)
    compiled = lg.compile(step, device="cpu", options=options)
    return train_compiled(compiled, model, None, [mlp_batch(i, n=n) for i in range(steps)])[0]


def kernel_files(cache_dir: Path) -> set[Path]:
    """The generated code Inductor left in ``cache_dir`` (wrappers and C++ kernels)."""
    return {p for p in cache_dir.rglob("*") if p.suffix in (".py", ".cpp")}


def kernel_source(files: set[Path]) -> str:
    """``files``' text, in a stable order."""
    return "".join(p.read_text(errors="replace") for p in sorted(files))
