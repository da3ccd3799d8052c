"""recir.transforms: the IR (StepGraph), its verifier, and the transform framework. Needs torch only."""

from ._batch_adapters import BatchAdapter as BatchAdapter
from ._batch_adapters import adapt_batch as adapt_batch
from ._batch_adapters import register_batch_adapter as register_batch_adapter
from ._batch_adapters import registered_batch_adapters as registered_batch_adapters
from ._cached_history import CACHED_HISTORY_KEY as CACHED_HISTORY_KEY
from ._cached_history import CachedHistory as CachedHistory
from ._cached_history import SplitCandidateAttention as SplitCandidateAttention
from ._cached_history import cached_history as cached_history
from ._cached_history import candidate_attention as candidate_attention
from ._compiled import CompiledStep as CompiledStep
from ._errors import (
    CaptureError as CaptureError,
)
from ._errors import (
    ConfigError as ConfigError,
)
from ._errors import (
    DataError as DataError,
)
from ._errors import (
    LoweringError as LoweringError,
)
from ._errors import (
    RecIRError as RecIRError,
)
from ._errors import (
    VerificationError as VerificationError,
)
from ._graph_util import alias_chain as alias_chain
from ._graph_util import format_val as format_val
from ._graph_util import format_window as format_window
from ._hash import mix32 as mix32
from ._hstu import HSTU_ATTENTION_OVERRIDE as HSTU_ATTENTION_OVERRIDE
from ._hstu import hstu_attention as hstu_attention
from ._hstu import hstu_attention_backward_reference as hstu_attention_backward_reference
from ._hstu import hstu_attention_reference as hstu_attention_reference
from ._inference import INFERENCE_KEY as INFERENCE_KEY
from ._inference import to_inference as to_inference
from ._metadata import GRAD_OF_KEY as GRAD_OF_KEY
from ._metadata import OPTIM_PARAM_KEY as OPTIM_PARAM_KEY
from ._metadata import OPTIMIZER_KEY as OPTIMIZER_KEY
from ._metadata import OptimizerInfo as OptimizerInfo
from ._metadata import grad_nodes as grad_nodes
from ._metadata import grad_of as grad_of
from ._metadata import optim_param as optim_param
from ._metadata import optimizer_infos as optimizer_infos
from ._metadata import set_optimizer_infos as set_optimizer_infos
from ._ops import (
    bag_segment_ids as bag_segment_ids,
)
from ._ops import (
    embedding_bag as embedding_bag,
)
from ._ops import (
    embedding_bag_reference as embedding_bag_reference,
)
from ._optim_math import OPTIMIZER_KINDS as OPTIMIZER_KINDS
from ._optim_math import ParamOptim as ParamOptim
from ._optim_math import apply_update as apply_update
from ._optim_math import group_scalars as group_scalars
from ._optim_math import param_optim as param_optim
from ._optim_math import rowwise_adagrad_update as rowwise_adagrad_update
from ._optim_math import state_keys_for as state_keys_for
from ._optim_math import state_shape as state_shape
from ._override import (
    Override as Override,
)
from ._override import (
    apply_overrides as apply_overrides,
)
from ._override import (
    override_for_op as override_for_op,
)
from ._override import (
    reference_for as reference_for,
)
from ._override import (
    register_override as register_override,
)
from ._override import (
    register_override_op as register_override_op,
)
from ._override import (
    registered_overrides as registered_overrides,
)
from ._phase_split import PHASE_SPLIT_KEY as PHASE_SPLIT_KEY
from ._phase_split import phase_split as phase_split
from ._pipeline import Pipeline as Pipeline
from ._pipeline import TransformRecord as TransformRecord
from ._pipeline_text import format_transform as format_transform
from ._pipeline_text import parse_pipeline as parse_pipeline
from ._pipeline_text import parse_transform as parse_transform
from ._pipelined import PipelinedStep as PipelinedStep
from ._private_apis import missing_private_apis as missing_private_apis
from ._private_apis import require_private_apis as require_private_apis
from ._profile import RegionTime as RegionTime
from ._profile import format_region_table as format_region_table
from ._profile import region_times as region_times
from ._region import Region as Region
from ._region import RegionTransform as RegionTransform
from ._region import regions_by_id as regions_by_id
from ._region import regions_by_override as regions_by_override
from ._region import regions_by_pattern as regions_by_pattern
from ._region import regions_by_phase as regions_by_phase
from ._region import splice as splice
from ._signature import (
    BatchSlot as BatchSlot,
)
from ._signature import (
    OutputSlot as OutputSlot,
)
from ._signature import (
    Signature as Signature,
)
from ._signature import (
    StateSlot as StateSlot,
)
from ._slot_names import RNG_OFFSET_SLOT as RNG_OFFSET_SLOT
from ._slot_names import RNG_SEED_SLOT as RNG_SEED_SLOT
from ._slot_names import SLOT_KINDS as SLOT_KINDS
from ._slot_names import STEP_SLOT as STEP_SLOT
from ._slot_names import SlotName as SlotName
from ._slot_names import buffer_slot as buffer_slot
from ._slot_names import carry_slot as carry_slot
from ._slot_names import lr_slot as lr_slot
from ._slot_names import optim_slot as optim_slot
from ._slot_names import param_slot as param_slot
from ._slot_names import parse_slot_name as parse_slot_name
from ._slot_names import rng_slot as rng_slot
from ._slot_names import slot_path as slot_path
from ._step import (
    DROPOUT_KEY as DROPOUT_KEY,
)
from ._step import (
    OVERRIDE_KEY as OVERRIDE_KEY,
)
from ._step import (
    PHASE_KEY as PHASE_KEY,
)
from ._step import (
    PHASES as PHASES,
)
from ._step import (
    PROVENANCE_KEY as PROVENANCE_KEY,
)
from ._step import (
    REGION_KEY as REGION_KEY,
)
from ._step import (
    RNG_MASK_KEY as RNG_MASK_KEY,
)
from ._step import (
    SCOPE_KEY as SCOPE_KEY,
)
from ._step import (
    SHARDING_KEY as SHARDING_KEY,
)
from ._step import (
    SlotInitializer as SlotInitializer,
)
from ._step import (
    StepGraph as StepGraph,
)
from ._step import (
    copy_graph_module as copy_graph_module,
)
from ._step import (
    format_node as format_node,
)
from ._step import (
    lazy_graph_module as lazy_graph_module,
)
from ._step import (
    param_buffer_initializer as param_buffer_initializer,
)
from ._transform import (
    NoOptions as NoOptions,
)
from ._transform import (
    Transform as Transform,
)
from ._transform import (
    TransformResult as TransformResult,
)
from ._transform import (
    get_transform as get_transform,
)
from ._transform import (
    register_transform as register_transform,
)
from ._transform import (
    registered_transforms as registered_transforms,
)
from ._transforms import PIPELINE_SPARSE_KEY as PIPELINE_SPARSE_KEY
from ._transforms import RECOMPUTE_KEY as RECOMPUTE_KEY
from ._transforms import CommonSubexpressionElimination as CommonSubexpressionElimination
from ._transforms import DeadCodeElimination as DeadCodeElimination
from ._transforms import InlineReferences as InlineReferences
from ._transforms import MixedPrecision as MixedPrecision
from ._transforms import Narrow as Narrow
from ._transforms import PipelineSparse as PipelineSparse
from ._transforms import Recompute as Recompute
from ._transforms import SparsePipelineInfo as SparsePipelineInfo
from ._transforms import SplitConcatProducts as SplitConcatProducts
from ._transforms import transient_peak_bytes as transient_peak_bytes
from ._transforms.narrow import narrow_through_indices as narrow_through_indices
from ._verify import INVARIANTS as INVARIANTS
from ._verify import register_graph_namespace as register_graph_namespace
from ._verify import verify as verify
from ._verify import verify_level as verify_level

__version__ = "0.1.0"

__all__ = [
    # the IR
    "StepGraph",
    "Signature",
    "StateSlot",
    "BatchSlot",
    "OutputSlot",
    "SlotInitializer",
    "param_buffer_initializer",
    "format_node",
    "copy_graph_module",
    "lazy_graph_module",
    # state-slot names: param:<path>, buffer:<path>, optim:<path>:<key>, optim:step, optim:group<i>:lr, rng:*
    "SlotName",
    "parse_slot_name",
    "slot_path",
    "param_slot",
    "buffer_slot",
    "optim_slot",
    "lr_slot",
    "rng_slot",
    "carry_slot",
    "SLOT_KINDS",
    "STEP_SLOT",
    "RNG_SEED_SLOT",
    "RNG_OFFSET_SLOT",
    # node metadata keys
    "PHASE_KEY",
    "PHASES",
    "REGION_KEY",
    "SHARDING_KEY",
    "OVERRIDE_KEY",
    "PROVENANCE_KEY",
    # metadata packages share: gradients, optimizer nodes, the step's optimizers
    "GRAD_OF_KEY",
    "OPTIM_PARAM_KEY",
    "OPTIMIZER_KEY",
    "OptimizerInfo",
    "optimizer_infos",
    "set_optimizer_infos",
    "grad_of",
    "optim_param",
    "grad_nodes",
    # functional optimizer maths (torch.optim's), shared by dense (capture) and row-wise (embedding) updates
    "OPTIMIZER_KINDS",
    "ParamOptim",
    "param_optim",
    "apply_update",
    "group_scalars",
    "state_keys_for",
    "state_shape",
    "rowwise_adagrad_update",
    "SCOPE_KEY",
    "BatchAdapter",
    "adapt_batch",
    "register_batch_adapter",
    "registered_batch_adapters",
    "RNG_MASK_KEY",
    "DROPOUT_KEY",
    "to_inference",
    "cached_history",
    "CACHED_HISTORY_KEY",
    "CachedHistory",
    "SplitCandidateAttention",
    "candidate_attention",
    "INFERENCE_KEY",
    # transforms
    "Transform",
    "TransformResult",
    "NoOptions",
    "register_transform",
    "get_transform",
    "registered_transforms",
    # regions
    "Region",
    "RegionTransform",
    "regions_by_phase",
    "regions_by_pattern",
    "regions_by_override",
    "regions_by_id",
    "splice",
    # pipelines
    "Pipeline",
    "PipelinedStep",
    "PipelineSparse",
    "PIPELINE_SPARSE_KEY",
    "SparsePipelineInfo",
    "TransformRecord",
    "parse_pipeline",
    "parse_transform",
    "format_transform",
    # verification
    "verify",
    "verify_level",
    "INVARIANTS",
    "register_graph_namespace",
    "format_window",
    "format_val",
    "alias_chain",
    # built-in transforms and utilities
    "DeadCodeElimination",
    "CommonSubexpressionElimination",
    "InlineReferences",
    "MixedPrecision",
    "Narrow",
    "narrow_through_indices",
    "Recompute",
    "RECOMPUTE_KEY",
    "SplitConcatProducts",
    "transient_peak_bytes",
    "mix32",
    # profiles: time per StepGraph region
    "RegionTime",
    "region_times",
    "format_region_table",
    "phase_split",
    "PHASE_SPLIT_KEY",
    # overrides
    "Override",
    "register_override",
    "register_override_op",
    "registered_overrides",
    "override_for_op",
    "reference_for",
    "apply_overrides",
    # core recir::* ops
    "embedding_bag",
    "embedding_bag_reference",
    "bag_segment_ids",
    "hstu_attention",
    "hstu_attention_reference",
    "hstu_attention_backward_reference",
    "HSTU_ATTENTION_OVERRIDE",
    # lowering protocol
    "CompiledStep",
    # private APIs of dependencies, checked before the first compile
    "require_private_apis",
    "missing_private_apis",
    # errors
    "RecIRError",
    "VerificationError",
    "CaptureError",
    "LoweringError",
    "ConfigError",
    "DataError",
]
