"""recir.embedding: RecIR embedding tables, TorchRec/FBGEMM overrides, backends and sparse row-wise updates."""

from recir.transforms import CaptureError as CaptureError
from recir.transforms import ConfigError as ConfigError
from recir.transforms import DataError as DataError

from ._backends import BACKENDS as BACKENDS
from ._backends import ApplyEmbeddingBackend as ApplyEmbeddingBackend
from ._backends import default_backend as default_backend
from ._backends import embedding_report as embedding_report
from ._backends import embedding_transforms as embedding_transforms
from ._backends import prepare_for_lowering as prepare_for_lowering
from ._backends import resolve_backend as resolve_backend
from ._bucket import PadReport as PadReport
from ._bucket import bucketize as bucketize
from ._bucket import pad_to_bucket as pad_to_bucket
from ._bucket_feedback import AutoBuckets as AutoBuckets
from ._bucket_feedback import BucketSuggestion as BucketSuggestion
from ._bucket_feedback import padding_waste as padding_waste
from ._bucket_feedback import suggest_buckets as suggest_buckets
from ._checks import checks as checks
from ._checks import checks_enabled as checks_enabled
from ._embedding_bag_override import EmbeddingBagOverride as EmbeddingBagOverride
from ._embedding_bag_override import EmbeddingBagStandIn as EmbeddingBagStandIn
from ._host import CutHostSplit as CutHostSplit
from ._host import HostEmbeddings as HostEmbeddings
from ._huge_pages import DEFAULT_MIN_BYTES as HUGE_PAGES_MIN_BYTES
from ._huge_pages import HeapFree as HeapFree
from ._huge_pages import advise_huge_pages as advise_huge_pages
from ._huge_pages import advise_large_buffers as advise_large_buffers
from ._huge_pages import host_heap_free as host_heap_free
from ._huge_pages import huge_page_bytes as huge_page_bytes
from ._huge_pages import huge_pages_supported as huge_pages_supported
from ._huge_pages import make_heap_room as make_heap_room
from ._huge_pages import thp_mode as thp_mode
from ._huge_pages import trim_host_heap as trim_host_heap
from ._jagged import JaggedBatch as JaggedBatch
from ._jagged import validate_batch as validate_batch
from ._jagged import validate_step_batch as validate_step_batch
from ._kjt_adapter import KeyedJaggedTensorAdapter as KeyedJaggedTensorAdapter
from ._ops import embedding_reference as embedding_reference
from ._overrides import DenseTBEOverride as DenseTBEOverride
from ._overrides import DenseTBEStandIn as DenseTBEStandIn
from ._overrides import EmbeddingBagCollectionOverride as EmbeddingBagCollectionOverride
from ._overrides import EmbeddingBagCollectionStandIn as EmbeddingBagCollectionStandIn
from ._overrides import EmbeddingCollectionOverride as EmbeddingCollectionOverride
from ._overrides import EmbeddingCollectionStandIn as EmbeddingCollectionStandIn
from ._overrides import overrides as overrides
from ._quantized_lookup import QTYPES as QTYPES
from ._quantized_lookup import lower_quantized_lookups as lower_quantized_lookups
from ._quantized_lookup import pack_rows as pack_rows
from ._quantized_lookup import packed_row_bytes as packed_row_bytes
from ._quantized_lookup import quantized_lookup_reference as quantized_lookup_reference
from ._quantized_lookup import unpack_rows as unpack_rows
from ._rowwise import dedupe as dedupe
from ._rowwise import round_stochastic as round_stochastic
from ._rowwise import sparse_update as sparse_update
from ._rowwise_adagrad import RowWiseAdagrad as RowWiseAdagrad
from ._table import EmbeddingTable as EmbeddingTable
from ._table import feature_to_table as feature_to_table
from ._table import tables_from_torchrec as tables_from_torchrec
from ._tbe import FUSED_OPTIMIZERS as FUSED_OPTIMIZERS
from ._tbe import FusedTBE as FusedTBE
from ._tbe import fused_tbe_tables as fused_tbe_tables
from ._transforms.mask_padding import JAGGED_KEY as JAGGED_KEY
from ._transforms.mask_padding import MaskPadding as MaskPadding
from ._transforms.quantize_tables import QUANT_DTYPES as QUANT_DTYPES
from ._transforms.quantize_tables import QUANT_KERNELS as QUANT_KERNELS
from ._transforms.quantize_tables import QUANTIZE_KEY as QUANTIZE_KEY
from ._transforms.quantize_tables import QuantizedTableInitializer as QuantizedTableInitializer
from ._transforms.quantize_tables import QuantizeTables as QuantizeTables
from ._transforms.quantize_tables import dequantize_rows as dequantize_rows
from ._transforms.quantize_tables import quantize_rows as quantize_rows
from ._transforms.sparsify_update import SparsifyUpdate as SparsifyUpdate
from ._transforms.split_host import HostSplit as HostSplit
from ._transforms.split_host import SplitHostEmbeddings as SplitHostEmbeddings
from ._transforms.split_host import split_host as split_host
from ._transforms.table_dtype import TABLE_DTYPE_KEY as TABLE_DTYPE_KEY
from ._transforms.table_dtype import TABLE_DTYPES as TABLE_DTYPES
from ._transforms.table_dtype import TableDtype as TableDtype

__version__ = "0.1.0"

__all__ = [
    # tables and jagged batches
    "EmbeddingTable",
    "feature_to_table",
    "tables_from_torchrec",
    "JaggedBatch",
    "KeyedJaggedTensorAdapter",
    "validate_batch",
    "validate_step_batch",
    "pad_to_bucket",
    "bucketize",
    "suggest_buckets",
    "AutoBuckets",
    "BucketSuggestion",
    "padding_waste",
    "PadReport",
    "checks",
    "checks_enabled",
    # overrides (plain nn.EmbeddingBag, TorchRec EBC/EC, FBGEMM dense TBE)
    "overrides",
    "EmbeddingBagOverride",
    "EmbeddingBagCollectionOverride",
    "EmbeddingCollectionOverride",
    "DenseTBEOverride",
    "EmbeddingBagStandIn",
    "EmbeddingBagCollectionStandIn",
    "EmbeddingCollectionStandIn",
    "DenseTBEStandIn",
    # optimizers (capture recognises them by their recir_optimizer_kind)
    "RowWiseAdagrad",
    # ops
    "embedding_reference",
    # backends (the lowerings' entry point)
    "prepare_for_lowering",
    "default_backend",
    "BACKENDS",
    # sparse row-wise updates
    "SparsifyUpdate",
    "dedupe",
    "sparse_update",
    # the embedding boundary: tables on the host, the dense step on the device
    "SplitHostEmbeddings",
    "split_host",
    "HostSplit",
    # serving: tables stored row-wise quantised (int8 + scale/bias, fp16)
    "QuantizeTables",
    "TableDtype",
    "TABLE_DTYPES",
    "TABLE_DTYPE_KEY",
    "round_stochastic",
    "MaskPadding",
    "JAGGED_KEY",
    "QuantizedTableInitializer",
    "quantize_rows",
    "dequantize_rows",
    "QUANTIZE_KEY",
    "QUANT_DTYPES",
    "QUANT_KERNELS",
    # the same, in FBGEMM's inference-TBE rows: recir::quantized_lookup, FBGEMM's kernel in GPU exports
    "pack_rows",
    "unpack_rows",
    "packed_row_bytes",
    "quantized_lookup_reference",
    "lower_quantized_lookups",
    "QTYPES",
    "HostEmbeddings",
    "CutHostSplit",
    "ApplyEmbeddingBackend",
    "embedding_transforms",
    "embedding_report",
    "resolve_backend",
    "FusedTBE",
    "fused_tbe_tables",
    "FUSED_OPTIMIZERS",
    # large host tables backed by transparent huge pages (the lowerings' huge_pages_min_bytes)
    "advise_huge_pages",
    "advise_large_buffers",
    "huge_page_bytes",
    "huge_pages_supported",
    "trim_host_heap",
    "HeapFree",
    "host_heap_free",
    "make_heap_room",
    "thp_mode",
    "HUGE_PAGES_MIN_BYTES",
    # errors (shared with recir.transforms)
    "CaptureError",
    "ConfigError",
    "DataError",
    "__version__",
]
