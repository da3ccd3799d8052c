"""recir-embed-split-host and split_host: the step cut at the embedding boundary (host lookups, device
step, host row updates), run by the reference interpreter against the unsplit in_graph step."""

from __future__ import annotations

import pytest
import torch
from recir.capture import capture_train_step, testing
from recir.embedding import HostEmbeddings, prepare_for_lowering, split_host
from recir.embedding._transforms.split_host import HOST_LOOKUP, HOST_UPDATE
from recir.transforms import REGION_KEY, ConfigError, verify

TABLES = ["param:tables.0.weight", "param:tables.1.weight"]


def _captured(opt_name: str = "rowwise_adagrad"):  # type: ignore[no-untyped-def]
    case = testing.REFERENCE_CASES["embedding_bag"]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    return case, model, optimizer, step


def test_split_host_marks_the_host_regions_and_cuts_three_parts() -> None:
    _, _, _, step = _captured()
    prepared = prepare_for_lowering(step, backend="cpu", target="tpu")
    stats = prepared.meta["recir.embedding"]["host_split"]
    assert stats["tables"] == TABLES and stats["lookups"] == 2 and stats["row_grads"] == 2
    regions = [r for n in prepared.graph.nodes for r in n.meta.get(REGION_KEY) or ()]
    assert regions.count(HOST_LOOKUP) == 2 and regions.count(HOST_UPDATE) > 10
    split = split_host(prepared)
    for part in (split.lookup, split.device, split.update):
        verify(part, level=2)
    names = step.signature.state_names()
    host = {names[i] for i in split.host_slots}
    assert host == {*TABLES, "optim:tables.0.weight:sum", "optim:tables.1.weight:sum"}
    assert [s.name for s in split.device.signature.state] == [n for n in names if n not in host]
    assert [s.name for s in split.update.signature.state] == [names[i] for i in split.host_slots]
    # forward: one row tensor per lookup, [bags, D] (pooled); backward: the gradient of each, same shape
    rows = [(o.name.split(":")[0], o.shape) for o in split.lookup.signature.outputs]
    assert rows == [("rows", (4, 8)), ("rows", (4, 8))], rows
    extra = split.device.signature.batch[len(step.signature.batch) :]
    assert [(b.name.split(":")[0], b.shape) for b in extra] == rows
    bnd = [(o.name.split(":")[0], o.shape) for o in split.device.signature.outputs[2:]]
    assert bnd[:2] == [("grad", (4, 8)), ("grad", (4, 8))], bnd
    assert all(kind == "value" and shape == () for kind, shape in bnd[2:]), bnd  # the learning rate(s)
    # the device part does not read a table: no lookup and no row update in it
    ops = {str(n.target) for n in split.device.graph.nodes if n.op == "call_function"}
    assert not any("embedding" in op or "index_put" in op for op in ops), sorted(ops)
    # the host lookup part: the lookups and the batch-only values they read, nothing else
    lines = [line for line in split.lookup.format_graph().splitlines() if "= input" not in line]
    assert "\n".join(lines) == (
        "%full = aten.full([1], 8, dtype=torch.int64, layout=torch.strided, device=device(type='cpu'), "
        "pin_memory=False)  # forward\n"
        "%cat = aten.cat([%offsets_0, %full])  # forward\n"
        "%embedding_bag = recir.embedding_bag(%param_tables_0_weight, %ids_0, %cat, %weights_0, 0)  # forward\n"
        "%view = aten.view(%ids_1, [-1])  # forward\n"
        "%arange = aten.arange.start_step(0, 15, 3, dtype=torch.int64, device=device(type='cpu'), "
        "pin_memory=False)  # forward\n"
        "%embedding_bag_1 = recir.embedding_bag(%param_tables_1_weight, %view, %arange, None, 1)  # forward\n"
        "return [%param_tables_0_weight, %param_tables_1_weight, %optim_tables_0_weight_sum, "
        "%optim_tables_1_weight_sum, %embedding_bag, %embedding_bag_1]"
    )
    names_out = [o.name for o in split.device.signature.outputs]
    assert names_out == ["loss", "aux.0", "grad:slice_1", "grad:slice_2", "value:optim_group0_lr"], names_out


@pytest.mark.parametrize("opt_name", ["rowwise_adagrad", "adagrad", "adam"])
def test_split_parts_chained_match_the_unsplit_step(opt_name: str) -> None:
    case, model, optimizer, step = _captured(opt_name)
    split = split_host(prepare_for_lowering(step, backend="cpu", target="tpu"))
    ref_step = prepare_for_lowering(step, backend="in_graph", target="tpu")
    ref = ref_step.init_state(model, optimizer)
    state = list(ref)
    live = [t.clone() for t in ref]  # HostEmbeddings: the host slots updated in place
    runner = HostEmbeddings(split, kernels="torchrec")
    n_user = len(step.signature.outputs)
    for i in range(5):
        batch = case.make_batch(i)
        flat = step.signature.flatten_batch(batch)
        host = [state[j] for j in split.host_slots]
        _, rows = split.lookup(host, batch)
        dev, outs = split.device([state[j] for j in split.device_slots], [*flat, *rows])
        new_host, _ = split.update(host, [*flat, *outs[n_user:]])
        for j, x in zip(split.host_slots, new_host):
            state[j] = x
        for j, x in zip(split.device_slots, dev):
            state[j] = x
        ref, ref_outs = ref_step(ref, batch)
        torch.testing.assert_close(outs[0], ref_outs[0], rtol=0, atol=1e-6)
        # the runner: the same maths with the host slots written in place
        live_host = [live[j] for j in split.host_slots]
        torch.testing.assert_close(runner.lookup(live_host, flat), list(rows), rtol=0, atol=1e-6)
        runner.update(live_host, flat, outs[n_user:])
        for j, x in zip(split.device_slots, dev):
            live[j] = x
    bad = testing.state_mismatches(step.state_dict(state), step.state_dict(ref), rtol=0, atol=1e-6)
    assert not bad, bad
    bad = testing.state_mismatches(step.state_dict(live), step.state_dict(ref), rtol=0, atol=1e-6)
    assert not bad, bad


def test_split_host_refuses_what_it_cannot_split() -> None:
    _, _, _, step = _captured()
    with pytest.raises(ConfigError, match=r"no meta\['recir.host_split'\].*backend='cpu'"):
        split_host(prepare_for_lowering(step, backend="in_graph", target="tpu"))
    with pytest.raises(
        ConfigError, match="no table can live on the host.*Fix: use embedding_backend='in_graph'"
    ):
        split_host(prepare_for_lowering(step, backend="cpu", target="tpu", sparse_updates=False))
    with pytest.raises(ConfigError, match="'cpu'.*TPU path; target is 'gpu'"):
        prepare_for_lowering(step, backend="cpu", target="gpu")


def test_host_runner_puts_torch_threads_back() -> None:
    case, model, optimizer, step = _captured()
    split = split_host(prepare_for_lowering(step, backend="cpu", target="tpu"))
    runner = HostEmbeddings(split, kernels="torchrec")  # threads=1 while the host parts run
    state = step.init_state(model, optimizer)
    host = [state[j] for j in split.host_slots]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        runner._lookup = lambda *xs: seen.append(torch.get_num_threads()) or tuple(xs)  # type: ignore[method-assign]
        runner.lookup(host, step.signature.flatten_batch(case.make_batch(0)))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
