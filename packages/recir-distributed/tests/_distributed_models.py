"""Small StepGraphs for recir-distributed's tests: make_fx of pure train steps (MLP, MLP + two tables),
with phases and ``recir.grad_of`` marked the way recir-capture marks them. Adam keeps an ``optim:step`` slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from recir.transforms import (
    GRAD_OF_KEY,
    OVERRIDE_KEY,
    BatchSlot,
    OutputSlot,
    Signature,
    StateSlot,
    StepGraph,
    override_for_op,
)
from recir.transforms.testing import mark_phase, trace_with_phases


def adam(params, grads, ms, vs, step, lr=0.05, b1=0.9, b2=0.99, eps=1e-8):  # noqa: ANN001, ANN201
    step = step + 1
    new_p, new_m, new_v = [], [], []
    for p, g, m, v in zip(params, grads, ms, vs):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat = m / (1 - torch.pow(b1, step))
        vhat = v / (1 - torch.pow(b2, step))
        new_p.append((p - lr * mhat / (vhat.sqrt() + eps)).detach())
        new_m.append(m)
        new_v.append(v)
    return new_p, new_m, new_v, step


def trace(fn: Callable, state: dict, batch: dict, n_params: int, output_names: list[str]) -> StepGraph:
    """Trace ``fn(state, batch) -> (new_state, outputs, grads)``; grads mark ``recir.grad_of`` and are dropped."""
    names = list(state)
    sv, bv = [t for _, t in state.values()], [t for _, t in batch.values()]
    n = len(sv)

    def flat(*args):  # noqa: ANN002, ANN202
        new_state, outputs, grads = fn(list(args[:n]), list(args[n:]))
        return (*new_state, *outputs, *grads)

    gm = trace_with_phases(flat, *sv, *bv)
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "recir":
            node.meta[OVERRIDE_KEY] = override_for_op(target)
    for node, name in zip([p for p in gm.graph.nodes if p.op == "placeholder"], [*state, *batch]):
        node._rename("".join(c if c.isalnum() else "_" for c in name))
    out = next(x for x in gm.graph.nodes if x.op == "output")
    values = list(out.args[0])
    k = len(values) - n_params
    for name, g in zip(names[:n_params], values[k:]):
        g.meta[GRAD_OF_KEY] = name
    out.args = (tuple(values[:k]),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    out_vals = [v.meta["val"] for v in values[n:k]]
    sig = Signature(
        state=tuple(StateSlot(nm, kind, tuple(t.shape), t.dtype) for nm, (kind, t) in state.items()),
        batch=tuple(BatchSlot(nm, tuple(t.shape), t.dtype, role) for nm, (role, t) in batch.items()),
        outputs=tuple(OutputSlot(nm, tuple(v.shape), v.dtype) for nm, v in zip(output_names, out_vals)),
    )
    return StepGraph(gm, sig)


# -- an MLP with Adam ----------------------------------------------------------------------------------
MLP_PARAMS = {
    "fc1.weight": (8, 4),
    "fc1.bias": (8,),
    "fc2.weight": (4, 8),
    "fc2.bias": (4,),
    "head.weight": (1, 4),
}


def _mlp_step(state, batch):  # noqa: ANN001, ANN202
    k = len(MLP_PARAMS)
    params = [p.detach().requires_grad_(True) for p in state[:k]]
    ms, vs, step = state[k : 2 * k], state[2 * k : 3 * k], state[3 * k]
    x, y = batch
    w1, b1, w2, b2, w3 = params
    h = torch.relu(x @ w1.t() + b1)
    h = torch.tanh(h @ w2.t() + b2)
    pred = (h @ w3.t()).squeeze(1)
    loss = ((pred - y) ** 2).mean()
    mark_phase("backward")
    grads = list(torch.autograd.grad(loss, params))
    mark_phase("optimizer")
    new_p, new_m, new_v, new_step = adam(params, grads, ms, vs, step)
    return [*new_p, *new_m, *new_v, new_step], [loss.detach()], grads


def init_state(params: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in params.items():
        out[f"param:{name}"] = torch.randn(shape, generator=g) * 0.5
    for key in ("exp_avg", "exp_avg_sq"):
        for name, shape in params.items():
            out[f"optim:{name}:{key}"] = torch.zeros(shape)
    out["optim:step"] = torch.zeros(())
    return out


def _state_spec(params: dict[str, tuple[int, ...]]) -> dict:
    spec = {}
    for name, t in init_state(params).items():
        spec[name] = ("param" if name.startswith("param:") else "optim", t)
    return spec


def mlp_step(batch_size: int) -> StepGraph:
    batch = {"dense": ("dense", torch.randn(batch_size, 4)), "label": ("label", torch.randn(batch_size))}
    return trace(_mlp_step, _state_spec(MLP_PARAMS), batch, len(MLP_PARAMS), ["loss"])


def mlp_batch(batch_size: int, step: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(batch_size, 4, generator=g), torch.randn(batch_size, generator=g)]


# -- an MLP over two pooled tables (sum and mean pooling) with Adam -----------------------------------
EMB_PARAMS = {
    "user.weight": (16, 4),
    "item.weight": (12, 4),
    "fc1.weight": (8, 11),
    "fc1.bias": (8,),
    "head.weight": (1, 8),
}
IDS_PER_SAMPLE = 2


def _emb_step(state, batch, sequence: bool = False, hashed: bool = False):  # noqa: ANN001, ANN202
    k = len(EMB_PARAMS)
    params = [p.detach().requires_grad_(True) for p in state[:k]]
    ms, vs, step = state[k : 2 * k], state[2 * k : 3 * k], state[3 * k]
    dense, ids_u, off_u, ids_i, off_i, y = batch
    tu, ti, w1, b1, w3 = params
    if hashed:  # feature hashing: id math from the batch alone (what recir-pipeline-sparse moves ahead)
        ids_u = torch.remainder(ids_u * 7 + 3, tu.shape[0])
        ids_i = torch.remainder(ids_i * 5 + 1, ti.shape[0])
    eu = torch.ops.recir.embedding_bag(tu, ids_u, off_u, None, 0)
    if sequence:  # recir-embedding's unpooled lookup: one row per id, pooled here by a fixed-length mean
        ei = torch.ops.recir.embedding(ti, ids_i).view(-1, IDS_PER_SAMPLE, ti.shape[1]).mean(1)
    else:
        ei = torch.ops.recir.embedding_bag(ti, ids_i, off_i, None, 1)
    h = torch.relu(torch.cat([eu, ei, dense], 1) @ w1.t() + b1)
    pred = (h @ w3.t()).squeeze(1)
    loss = ((pred - y) ** 2).mean()
    mark_phase("backward")
    grads = list(torch.autograd.grad(loss, params))
    mark_phase("optimizer")
    new_p, new_m, new_v, new_step = adam(params, grads, ms, vs, step)
    return [*new_p, *new_m, *new_v, new_step], [loss.detach()], grads


def emb_batch(batch_size: int, step: int, seed: int = 1) -> list[torch.Tensor]:
    """dense, user ids/offsets, item ids/offsets, label; bag lengths vary (0..3) over a static id count."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    n = batch_size * IDS_PER_SAMPLE
    out = [torch.randn(batch_size, 3, generator=g)]
    for rows in (EMB_PARAMS["user.weight"][0], EMB_PARAMS["item.weight"][0]):
        ids = torch.randint(0, rows, (n,), generator=g)
        cuts = torch.sort(torch.randint(0, n + 1, (batch_size - 1,), generator=g)).values
        out += [ids, torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.full((1,), n)])]
    out.append(torch.randn(batch_size, generator=g))
    return out


def concat_batches(batches: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The global batch that the per-device ``emb_batch``es form (offsets shifted by each device's ids)."""
    dense = torch.cat([b[0] for b in batches])
    out = [dense]
    for j in (1, 3):
        n = batches[0][j].shape[0]
        out.append(torch.cat([b[j] for b in batches]))
        offs = [b[j + 1][:-1] + i * n for i, b in enumerate(batches)]
        out.append(torch.cat([*offs, torch.tensor([len(batches) * n])]))
    out.append(torch.cat([b[5] for b in batches]))
    return out


def emb_step(batch_size: int, sequence: bool = False, hashed: bool = False) -> StepGraph:
    """The two-table model; ``sequence=True`` looks the item table up with ``recir::embedding`` (unpooled),
    ``hashed=True`` hashes the ids (``remainder(ids * a + b, rows)``) before the lookups."""
    if sequence:
        import recir.embedding  # noqa: F401 - registers recir::embedding
    fn = lambda s, b: _emb_step(s, b, sequence=sequence, hashed=hashed)  # noqa: E731
    example = emb_batch(batch_size, 0)
    roles = ["dense", "ids", "offsets", "ids", "offsets", "label"]
    names = ["dense", "user_ids", "user_offsets", "item_ids", "item_offsets", "label"]
    batch = {n: (r, t) for n, r, t in zip(names, roles, example)}
    return trace(fn, _state_spec(EMB_PARAMS), batch, len(EMB_PARAMS), ["loss"])


def collective_lines(step: StepGraph) -> str:
    """The collectives of a graph and the nodes that consume them, one ``format_node`` line each."""
    from recir.transforms import format_node

    lines = []
    for node in step.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional":
            lines.append(format_node(node))
            if target.__name__.startswith("wait_tensor"):
                lines += ["  -> " + format_node(u) for u in node.users]
    return "\n".join(lines)
