"""The public surface of recir.transforms, and its promise to need torch only."""

import importlib
import subprocess
import sys

import pytest
import recir.transforms as rt


@pytest.mark.smoke
def test_transforms_public_api_resolves():
    assert rt.__all__
    for name in rt.__all__:
        obj = getattr(rt, name)
        owner = getattr(obj, "__module__", None)
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
            assert owner.startswith("recir.transforms"), (name, owner)
    assert len(set(rt.__all__)) == len(rt.__all__)


def test_transforms_error_hierarchy():
    for err in (rt.VerificationError, rt.CaptureError, rt.LoweringError, rt.ConfigError, rt.DataError):
        assert issubclass(err, rt.RecIRError)


def test_transforms_imports_torch_only():
    code = (
        "import sys, recir.transforms\n"
        "bad = [m for m in ('jax', 'torchax', 'torchrec', 'fbgemm_gpu', 'recir.capture', 'recir.embedding') "
        "if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import recir.transforms loaded {out.stdout.strip()}"
    importlib.import_module("recir.transforms")


def test_transforms_public_surface_is_pinned():
    # Other packages build on these names: adding one is fine (add it here), removing one breaks them.
    pinned = {
        "StepGraph", "Signature", "StateSlot", "BatchSlot", "OutputSlot", "SlotInitializer",
        "param_buffer_initializer", "format_node", "PHASE_KEY", "PHASES", "REGION_KEY", "SHARDING_KEY",
        "OVERRIDE_KEY", "PROVENANCE_KEY", "Transform", "TransformResult", "NoOptions", "register_transform",
        "get_transform", "registered_transforms", "Region", "RegionTransform", "regions_by_phase", "splice",
        "regions_by_pattern", "regions_by_override", "regions_by_id", "Pipeline", "TransformRecord",
        "parse_pipeline", "parse_transform", "format_transform", "verify", "verify_level", "INVARIANTS",
        "register_graph_namespace", "format_window", "format_val", "alias_chain", "DeadCodeElimination",
        "CommonSubexpressionElimination", "MixedPrecision", "Narrow", "Recompute", "RECOMPUTE_KEY", "SplitConcatProducts", "mix32", "PipelineSparse", "PIPELINE_SPARSE_KEY", "SparsePipelineInfo", "PipelinedStep", "transient_peak_bytes", "SCOPE_KEY", "RNG_MASK_KEY", "DROPOUT_KEY", "to_inference", "INFERENCE_KEY", "cached_history", "CACHED_HISTORY_KEY", "CachedHistory", "SplitCandidateAttention", "candidate_attention", "narrow_through_indices", "BatchAdapter", "adapt_batch", "register_batch_adapter", "registered_batch_adapters", "RegionTime", "region_times",
        "format_region_table", "phase_split", "PHASE_SPLIT_KEY", "Override", "register_override",
        "register_override_op", "registered_overrides", "override_for_op", "apply_overrides", "embedding_bag",
        "embedding_bag_reference", "bag_segment_ids", "CompiledStep", "GRAD_OF_KEY", "OPTIM_PARAM_KEY", "OPTIMIZER_KEY", "OptimizerInfo", "optimizer_infos", "set_optimizer_infos", "grad_of", "optim_param", "grad_nodes", "OPTIMIZER_KINDS", "ParamOptim", "param_optim", "apply_update", "group_scalars", "state_keys_for", "state_shape", "rowwise_adagrad_update", "copy_graph_module", "lazy_graph_module", "SlotName", "parse_slot_name", "slot_path", "param_slot", "buffer_slot", "optim_slot", "lr_slot", "rng_slot", "carry_slot", "SLOT_KINDS", "STEP_SLOT", "RNG_SEED_SLOT", "RNG_OFFSET_SLOT", "require_private_apis", "missing_private_apis", "RecIRError", "VerificationError",
        "CaptureError", "LoweringError", "ConfigError", "DataError", "InlineReferences", "reference_for",
        "hstu_attention", "hstu_attention_reference", "hstu_attention_backward_reference",
        "HSTU_ATTENTION_OVERRIDE",
    }  # fmt: skip
    assert set(rt.__all__) == pinned
    assert set(rt.INVARIANTS) == {f"INV-{i}" for i in range(1, 11)}
    assert {"recir-cleanup-dce", "recir-cleanup-cse"} <= set(rt.registered_transforms())


def test_transforms_shared_keys_keep_their_wire_names():
    # Other packages use the constants; checkpoints, dumps and plans store these strings.
    assert (rt.GRAD_OF_KEY, rt.OPTIM_PARAM_KEY, rt.OPTIMIZER_KEY) == (
        "recir.grad_of",
        "recir.optim_param",
        "recir.optimizer",
    )
    assert (rt.PHASE_KEY, rt.SHARDING_KEY, rt.OVERRIDE_KEY) == (
        "recir.phase",
        "recir.sharding",
        "recir.override",
    )
    assert (rt.STEP_SLOT, rt.RNG_SEED_SLOT, rt.RNG_OFFSET_SLOT) == ("optim:step", "rng:seed", "rng:offset")
