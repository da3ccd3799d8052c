"""Global normalisation of a data-parallel slice: the loss divides by the global batch's candidate count
(`Batch.loss_norm`) and the attention by its longest sequence (`Batch.max_seq_len`), so the mean of two
halves' gradients is the whole batch's gradient even when the halves hold different numbers of candidates."""

import torch
import torch.utils._pytree as pytree
from _dlrmv3_workers import random_samples
from recir.dlrmv3 import DLRMv3, ModelConfig, Sample, collate, dataset_spec, loss_fn, multitask_loss

UIH, CAND = 6, 3


def _setup() -> tuple[DLRMv3, dict[str, int], list[Sample]]:
    spec = dataset_spec("debug")
    cfg = ModelConfig(embedding_dim=8, num_layers=2, num_heads=2, hash_size=50, uih_len=UIH,
                      num_candidates=CAND, input_dropout=0.0, layer_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = DLRMv3(spec, cfg)
    rows = {f: cfg.table_rows(t) for t in spec.tables for f in t.features}
    # first half: long histories, up to 3 candidates; second half: short histories, 1 candidate each
    samples = random_samples(4, seed=1, max_uih=UIH, max_cand=CAND) + random_samples(
        4, seed=2, max_uih=2, max_cand=1
    )
    return model, rows, samples


def _grads(model: DLRMv3, batch) -> tuple[float, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    loss = loss_fn(model, batch)[0]
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return float(loss.detach()), [
        torch.zeros_like(p) if g is None else g.to_dense() for p, g in zip(params, grads)
    ]


def test_dlrmv3_halves_with_global_norms_average_to_the_whole_batch_gradient():
    model, rows, samples = _setup()
    whole = collate(samples, model.spec, UIH, CAND, rows)
    halves = [
        collate(samples[i : i + 4], model.spec, UIH, CAND, rows, global_samples=samples) for i in (0, 4)
    ]
    # the premise: the halves hold different candidate counts and different longest sequences
    assert int(halves[0].num_candidates.sum()) != int(halves[1].num_candidates.sum())
    local = [int((2 + h.uih_lengths + h.num_candidates).max()) for h in halves]
    assert local[0] != local[1] and max(local) == int(whole.max_seq_len[0])
    assert float(whole.loss_norm.sum()) == float(whole.num_candidates.sum())
    for h in halves:
        torch.testing.assert_close(h.loss_norm, whole.loss_norm[:4])
        assert torch.equal(h.max_seq_len, whole.max_seq_len[:4])

    loss, full = _grads(model, whole)
    parts = [_grads(model, h) for h in halves]
    assert abs((parts[0][0] + parts[1][0]) / 2 - loss) < 1e-5 * abs(loss)
    assert any(float(g.abs().max()) > 0 for g in full)
    for name, g, a, b in zip(dict(model.named_parameters()), full, parts[0][1], parts[1][1]):
        torch.testing.assert_close((a + b) / 2, g, rtol=1e-4, atol=1e-7, msg=name)

    # the control: halves normalised by their own counts and lengths average to another gradient
    own = [_grads(model, collate(samples[i : i + 4], model.spec, UIH, CAND, rows)) for i in (0, 4)]
    worst = max(float(((a + b) / 2 - g).abs().max()) for g, a, b in zip(full, own[0][1], own[1][1]))
    assert worst > 1e-4


def test_dlrmv3_whole_batch_loss_is_the_per_candidate_mean_and_the_fields_travel():
    model, rows, samples = _setup()
    batch = collate(samples, model.spec, UIH, CAND, rows)
    with torch.no_grad():
        logits = model(batch)
        labels, weights = model.labels(batch)
        # one process: loss_norm sums to the batch's own real-candidate count (the classic mean)
        torch.testing.assert_close(loss_fn(model, batch)[0], multitask_loss(logits, labels, weights))
    flat, spec = pytree.tree_flatten(batch.to("cpu"))
    again = pytree.tree_unflatten(flat, spec)
    assert torch.equal(again.loss_norm, batch.loss_norm) and torch.equal(again.max_seq_len, batch.max_seq_len)
    assert again.loss_norm.dtype == torch.float32 and again.loss_norm.shape == (8,)
    # a batch with no candidate at all still has a positive normaliser (no division by zero)
    empty = [Sample(s.uih_ids, s.uih_timestamps, s.uih_actions, s.cand_ids[:0], s.cand_actions[:0],
                    s.contextual) for s in samples]  # fmt: skip
    assert float(collate(empty, model.spec, UIH, CAND, rows).loss_norm.sum()) == 1.0
