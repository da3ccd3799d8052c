"""The pure-ATen reference ops of recir.transforms."""

import torch
from recir.transforms import bag_segment_ids, embedding_bag_reference
from torch.fx.experimental.proxy_tensor import make_fx


def test_bag_segment_ids_names_each_ids_bag_with_empty_bags_anywhere():
    # lengths 0, 2, 0, 0, 3, 1, 0: empty bags first, between and last
    lengths = torch.tensor([0, 2, 0, 0, 3, 1, 0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    want = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    assert bag_segment_ids(offsets, int(lengths.sum())).tolist() == want.tolist()
    weight = torch.randn(10, 3)
    ids = torch.tensor([1, 4, 0, 9, 2, 7])
    pooled = embedding_bag_reference(weight, ids, offsets, None, 0)
    eager = torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum", include_last_offset=True)
    torch.testing.assert_close(pooled, eager)


def test_bag_segment_ids_searches_a_whole_tensor_not_a_view():
    # Inductor's Triton searchsorted (torch 2.11, CUDA) fails on a slice of a computed buffer
    # ("NotImplementedError: SliceView"); the CPU backend falls back to ATen, so only the graph shows it here.
    def f(lengths):
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return bag_segment_ids(offsets, 6)

    gm = make_fx(f)(torch.tensor([0, 2, 0, 0, 3, 1, 0]))
    searches = [n for n in gm.graph.nodes if n.target is torch.ops.aten.searchsorted.Tensor]
    assert searches and all(
        not (n.args[0].op == "call_function" and n.args[0].target is torch.ops.aten.slice.Tensor)
        for n in searches
    )
