"""The TPU lowering's graph rewrites as a pipeline of Transforms, built in one place: :func:`tpu_pipeline`.

Every rewrite between capture's output and torchax's input is a registered Transform (verification,
provenance, timings, ``RECIR_DUMP_DIR`` dumps, ``RECIR_DISABLE`` bisection; ``compiled.pipeline.report()``
lists them). The builder makes every choice and passes it to the transforms as options.
"""

from __future__ import annotations

from collections.abc import Mapping

from recir.transforms import Pipeline, SplitConcatProducts, StepGraph, Transform

from ._hstu import PallasAttention


def tpu_pipeline(
    step: StepGraph,
    *,
    sparse_updates: bool,
    backend: str,
    row_sharded: Mapping[str, str] | None,
    attention_kernel: str = "blocked",
    split_concat_products: bool = False,
) -> Pipeline:
    """The TPU lowering of ``step`` as a Pipeline (what torchax then traces into one ``jax.jit`` program):

    1. recir-embedding's transforms: sparse row-wise table updates (``sparse_updates``), then
       the backend's kernels: ``in_graph`` inlines ATen lookups, ``ring_shift`` makes each lookup of a
       row-sharded table (``row_sharded``: state slot -> mesh axis) and its row update ring ops. The
       run-time id checks leave the graph (XLA cannot raise on data): the host runs them before each step;
    2. ``cpu``: the tables whose update is row-wise are marked for the host and the step is cut at the
       embedding boundary (``recir-embed-cut-host-split``): only the device part is compiled;
    3. ``attention_kernel="pallas"``: ``recir::hstu_attention`` and its backward as the Pallas kernels
       (the blocked JAX formulation otherwise: a registered lowering, nothing to rewrite);
    4. ``split_concat_products``: each product of a concatenation that nothing else reads as a sum of its
       parts' products (``recir-split-concat-products``; XLA on CPUs copies a concatenation).
    """
    from recir.embedding import CutHostSplit, embedding_transforms

    transforms: list[Transform] = embedding_transforms(
        step,
        backend=backend,
        target="tpu",
        keep_checks=False,
        sparse_updates=sparse_updates,
        row_sharded=row_sharded,
    )
    if backend == "cpu":
        transforms.append(CutHostSplit())
    if attention_kernel == "pallas":
        transforms.append(PallasAttention())
    if split_concat_products:
        transforms.append(SplitConcatProducts())
    return Pipeline(transforms, name="recir.lower_tpu")
