"""Multi-process training on gloo CPU processes: every parallel mode trains 10 steps and matches
single-process training on the same global batch (parameters, optimizer state and loss); each rank
holds exactly the bytes its plan says, less than the whole state when anything is sharded. One spawn
per test runs many checks (each spawned rank pays a torch import).
"""

from __future__ import annotations

import importlib.util

import pytest
import recir.distributed as rd
from _distributed_workers import spawn, train_and_compare_all


def test_two_ranks_train_like_one_process():
    pytest.importorskip("recir.embedding")  # the ranks' embedding models (a test-time sibling)
    mixed = rd.HybridParallel(tables=(rd.table_wise("item.weight"), rd.column_wise("user.weight")))
    sharded_dense = rd.HybridParallel(tables=rd.row_wise(), dense=rd.FullyShardedDataParallel())
    emb_modes = ["data_parallel", "fsdp", "table_wise", "row_wise", "column_wise", mixed, sharded_dense]
    spawn(
        train_and_compare_all,
        2,
        [
            ("mlp", ["data_parallel", rd.FullyShardedDataParallel()], 10),
            ("emb", [*emb_modes, ("auto", 1950)], 10),
            # the item table through recir-embedding's unpooled recir::embedding
            ("seq", ["table_wise", "row_wise", "column_wise"], 10),
            # recir.capture of an nn.Module with two nn.EmbeddingBag tables and torch.optim.Adam
            ("captured", ["data_parallel", "fsdp", "row_wise"], 10),
            # a TorchRec EmbeddingBagCollection fed global JaggedBatches split by rd.split_batch (the
            # standalone session installs no TorchRec: the ranks would fail to import it, not skip)
            *(
                [("torchrec", ["data_parallel", "row_wise"], 3)]
                if importlib.util.find_spec("torchrec")
                else []
            ),
        ],
    )


@pytest.mark.slow
def test_four_ranks_train_like_one_process():
    spawn(train_and_compare_all, 4, [("emb", ["row_wise"], 3)])
