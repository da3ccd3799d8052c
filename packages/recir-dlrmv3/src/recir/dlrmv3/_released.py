"""The TPU path's weights live in JAX: the torch model's own copy is released while the step trains.

A single-device TPU-path step keeps every parameter as a JAX array, donated and updated by each step.
Holding the torch model's tensors as well doubled the weights in host memory (full-size DLRMv3: 0.63
GiB of 3.4). :class:`ReleasedWeights` swaps each parameter's data for a placeholder of the same shape
and dtype on fresh anonymous pages, which take no memory until written (the trainer releases each one
as soon as ``init_state`` has copied it, :meth:`ReleasedWeights.release_slot`, so the weights are never
held twice; with recir-lower-tpu's heap trims, building full-size DLRMv3's state peaks at 1.98 GiB instead
of 2.36); `sync_model()` points the
parameters at the trained JAX arrays themselves (DLPack, no copy), and the next step releases them
again, so the step's donation can reuse those buffers in place. The Parameter objects stay the same
(the optimizers and the model keep theirs); only `.data` changes.

Between `sync_model()` calls the model's parameters read as zeros: call `trainer.sync_model()` before
using the model.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from recir.transforms import buffer_slot, param_slot
from torch import nn


def untouched_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of ``t``'s shape and dtype on anonymous pages nobody has written: zeros that
    take no resident memory until written (the pages are the kernel's shared zero page until then)."""
    pages = mmap.mmap(-1, t.numel() * t.element_size())
    return torch.frombuffer(pages, dtype=t.dtype).view(t.shape)


class ReleasedWeights:
    """The model's parameters whose values a state holds (``slots``: the step's state slot names), released to
    placeholders (:func:`untouched_like`) while the step trains them."""

    def __init__(self, model: nn.Module, slots: Iterable[str]) -> None:
        names = set(slots)
        self.model = model
        self.placeholders = {
            name: untouched_like(p)
            for name, p in model.named_parameters()
            if param_slot(name) in names and p.device.type == "cpu" and p.numel() > 0
        }
        self.showing = False  # whether the parameters are views of a state (sync_model), not placeholders
        self._names = {param_slot(name): name for name in self.placeholders}
        self._params = dict(model.named_parameters())

    def release_slot(self, slot: str) -> None:
        """One parameter (by state slot name) back to its placeholder, if it is a released one: the state's
        copy of it exists (``init_state``'s ``release``)."""
        name = self._names.get(slot)
        if name is not None:
            with torch.no_grad():
                self._params[name].data = self.placeholders[name]

    def release(self) -> None:
        """Every released parameter back to its placeholder (drops the views, so the state's buffers can be
        donated again)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, placeholder in self.placeholders.items():
                params[name].data = placeholder
        self.showing = False

    def show(self, state: Mapping[str, Any]) -> None:
        """The model's parameters and buffers from ``state`` (slot name -> JAX array or torch tensor): the
        released parameters become views of it (a converted copy where the dtype differs); other
        parameters and buffers are copied into."""
        with torch.no_grad():
            for slot_of, named in (
                (param_slot, self.model.named_parameters()),
                (buffer_slot, self.model.named_buffers()),
            ):
                for name, t in named:
                    value = state.get(slot_of(name))
                    if value is None:
                        continue
                    host = _as_torch(value)
                    if slot_of is param_slot and name in self.placeholders:
                        same = host.dtype == t.dtype and host.shape == t.shape
                        t.data = host if same else host.to(t.dtype).reshape(t.shape)
                    else:
                        t.copy_(host.to(t.dtype))
        self.showing = True


def _as_torch(value: Any) -> torch.Tensor:
    """A torch view of a state value: a torch tensor as is, a single-device JAX array through DLPack (once
    it is computed), or a host copy of an array on a device DLPack cannot export (a TPU's)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    value.block_until_ready()
    try:
        return torch.from_dlpack(value)
    except BufferError:  # jax 0.10.2 on a TPU v5e: "__dlpack__ device only supported for CPU and GPU"
        import numpy as np

        host = np.array(value)  # a writable host copy
        if host.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, which torch.from_numpy does not take
            return torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(host)
