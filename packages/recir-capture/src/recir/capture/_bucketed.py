"""``BucketedStep``: train on batches of varying jagged sizes, one captured (and compiled) step per bucket.

A StepGraph has static shapes. With a batch adapter (recir.embedding's, for TorchRec KeyedJaggedTensors)
each batch is padded to a bucket of sizes (``batch_buckets``: the adapter's policy, default powers of
two); a batch whose bucket has no step yet is captured, and compiled with ``compile``, before it runs.
All buckets share one state: the slots do not depend on the batch's sizes.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from recir.transforms import ConfigError, Override, adapt_batch
from torch import nn

from ._capture import LossFn, capture_train_step

log = logging.getLogger("recir.capture")


class BucketedStep:
    """``step(state, batch) -> (state, outputs)`` over batches of any jagged sizes.

    ``compile``: e.g. ``recir.lower_gpu.compile`` or ``recir.lower_tpu.compile`` (None: the StepGraph's
    reference interpreter). ``compiles`` counts the captures so far, ``buckets`` lists their layouts,
    ``padding`` is ``(real ids, padded slots)`` over every batch run so far, and ``sizes`` each jagged
    feature's real id counts as a ``{size: batches}`` histogram (``recir.embedding.suggest_buckets(sizes)``
    proposes the buckets that pad least for their compile count).

    ``batch_buckets`` is the adapter's bucket policy, or a policy object that learns one: anything with a
    ``buckets`` attribute (the policy for the next batch) and ``observe(sizes, batches) -> bool`` (called
    after each batch with ``sizes`` and the number of batches so far; True: ``buckets`` changed), such as
    ``recir.embedding.AutoBuckets(window=64)``, which pads with powers of two for its window and then
    with the buckets ``suggest_buckets`` finds for the sizes it saw. Steps captured before a change are
    kept (a later batch may land in their bucket again).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_fn: LossFn,
        *,
        compile: Callable[[Any], Any] | None = None,
        overrides: Iterable[Override] = (),
        batch_buckets: Any = None,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self._compile = compile
        self._overrides = tuple(overrides)
        self.batch_buckets = batch_buckets
        self._steps: dict[str, Any] = {}
        self.buckets: list[str] = []
        self.real_ids = 0
        self.padded_slots = 0
        self.sizes: dict[str, collections.Counter[int]] = {}
        self.batches = 0

    @property
    def compiles(self) -> int:
        return len(self._steps)

    @property
    def padding(self) -> tuple[int, int]:
        return self.real_ids, self.padded_slots

    @property
    def padding_waste(self) -> float:
        """Padded slots per real id over the batches run so far."""
        return self.padded_slots / self.real_ids if self.real_ids else 0.0

    def step_for(self, batch: Any) -> tuple[Any, Any]:
        """The captured (compiled) step for ``batch``'s bucket, capturing it if new, and the static batch."""
        policy = self.batch_buckets
        static = adapt_batch(batch, None, policy.buckets if _learns(policy) else policy)
        key = str(pytree.tree_structure(static))
        if key not in self._steps:
            step = capture_train_step(
                self.model, self.optimizer, self.loss_fn, static, overrides=self._overrides
            )
            self._steps[key] = self._compile(step) if self._compile is not None else step
            self.buckets.append(key)
            log.info(
                "recir.capture.BucketedStep: new bucket, capture %d: %s", len(self._steps), _layout(static)
            )
        return self._steps[key], static

    def init_state(self, example_batch: Any) -> Any:
        """The initial state (from the live model and optimizer), through ``example_batch``'s step."""
        step, _ = self.step_for(example_batch)
        return step.init_state(self.model, self.optimizer)

    def state_dict(self, state: Any) -> dict[str, torch.Tensor]:
        """``state`` by slot name (the same for every bucket: the slots do not depend on batch sizes)."""
        return self._any_step().state_dict(state)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> Any:
        """The state from a :meth:`state_dict` (e.g. a checkpoint), through any bucket's step."""
        return self._any_step().load_state_dict(state_dict)

    def _any_step(self) -> Any:
        if not self._steps:
            raise ConfigError(
                "BucketedStep has no captured step yet. Fix: call init_state(example_batch) (or run a batch) "
                "first; every bucket's step shares one state layout."
            )
        return next(iter(self._steps.values()))

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        step, static = self.step_for(batch)
        for real, capacity in _jagged_sizes(static):
            self.real_ids += real
            self.padded_slots += capacity - real
        for x in _jagged_leaves(static):
            per_key = x.lengths_.view(len(x.keys_), -1).sum(1).tolist()
            for key, n in zip(x.keys_, per_key):
                self.sizes.setdefault(key, collections.Counter())[int(n)] += 1
        self.batches += 1
        if _learns(self.batch_buckets) and self.batch_buckets.observe(self.sizes, self.batches):
            log.info(
                "recir.capture.BucketedStep: after %d batches the bucket policy changed (%r); padding waste "
                "so far %.1f%%",
                self.batches,
                self.batch_buckets,
                100 * self.padding_waste,
            )
        return step(state, static)


def _learns(policy: Any) -> bool:
    return hasattr(policy, "observe") and hasattr(policy, "buckets")


def _jagged_leaves(static: Any) -> list[Any]:
    # the adapter's static jagged values: anything with per-feature capacities and lengths
    leaves = pytree.tree_leaves(static, is_leaf=lambda x: hasattr(x, "capacities"))
    return [x for x in leaves if hasattr(x, "capacities") and hasattr(x, "lengths_")]


def _jagged_sizes(static: Any) -> list[tuple[int, int]]:
    return [(int(x.lengths_.sum()), int(sum(x.capacities))) for x in _jagged_leaves(static)]


def _layout(static: Any) -> str:
    parts = [", ".join(f"{k} {c}" for k, c in zip(x.keys_, x.capacities)) for x in _jagged_leaves(static)]
    return "; ".join(parts) or "no jagged values"
