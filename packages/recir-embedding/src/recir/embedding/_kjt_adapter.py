"""TorchRec batches as they are: the batch adapter that turns a ``KeyedJaggedTensor`` into a static
``JaggedBatch`` at a StepGraph's boundary (capture, and every call of a captured or compiled step).

At capture, each feature is padded by the bucketing policy (``capture_train_step(batch_buckets=...)``:
pad_to_bucket's ``buckets``; default the next power of two of its id count, at least 8). Later batches
are padded to the captured capacities; one that does not fit is a DataError naming the feature and the
fix (``recir.capture.BucketedStep`` captures and compiles once per bucket). Importing recir.embedding
registers the adapter; the first TorchRec ``Batch`` dataclass it meets becomes a pytree, so a ``Batch``
whose ``sparse_features`` is a KJT is converted in place.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree
from recir.transforms import DataError, register_batch_adapter

from ._bucket import pad_to_bucket
from ._jagged import JaggedBatch


def _is_kjt(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "KeyedJaggedTensor" and cls.__module__.startswith("torchrec")


class KeyedJaggedTensorAdapter:
    name = "recir-embedding-kjt"

    def handles(self, value: Any) -> bool:
        if type(value).__name__ == "Batch" and type(value).__module__ == "torchrec.datasets.utils":
            _register_torchrec_batch()  # then the walk descends into it and meets its KJT
            return False
        return _is_kjt(value)

    def to_static(self, value: Any, captured: pytree.TreeSpec | None, policy: Any) -> Any:
        if captured is None or captured.type is not JaggedBatch:
            jb, _ = pad_to_bucket(value, policy)
            return jb
        keys, batch_size, caps, weighted = captured.context
        if list(value.keys()) != list(keys) or value.stride() != batch_size:
            raise DataError(
                f"KeyedJaggedTensor with keys {list(value.keys())} and batch size {value.stride()}; the step "
                f"was captured with keys {list(keys)} and batch size {batch_size}. Fix: pass batches with "
                "the example batch's features and batch size."
            )
        try:
            jb = JaggedBatch.from_kjt(value, dict(zip(keys, caps)))
        except DataError as e:
            raise DataError(
                f"{e}: the step was captured for capacities {dict(zip(keys, caps))}. Fix: train with "
                "recir.capture.BucketedStep (it captures and compiles once per bucket), or capture with "
                "larger batch_buckets."
            ) from None
        if (jb.weights_ is not None) != weighted:
            raise DataError(
                f"KeyedJaggedTensor {'with' if jb.weights_ is not None else 'without'} weights; the step was "
                f"captured {'with' if weighted else 'without'}. Fix: pass batches like the example batch."
            )
        return jb


def _register_torchrec_batch() -> None:
    """TorchRec's ``Batch`` (dense_features, sparse_features, labels) as a pytree (the first time one is
    seen: importing recir.embedding does not import TorchRec)."""
    from torchrec.datasets.utils import Batch

    if Batch in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        Batch,
        lambda b: ([b.dense_features, b.sparse_features, b.labels], None),
        lambda children, _: Batch(*children),
        flatten_with_keys_fn=lambda b: (
            [
                (pytree.GetAttrKey("dense_features"), b.dense_features),
                (pytree.GetAttrKey("sparse_features"), b.sparse_features),
                (pytree.GetAttrKey("labels"), b.labels),
            ],
            None,
        ),
        serialized_type_name="torchrec.datasets.utils.Batch",
    )


register_batch_adapter(KeyedJaggedTensorAdapter())
