"""recir.distributed: RecIR meshes, parallel modes, sharding plans and collective-inserting transforms."""

from recir.transforms import ConfigError as ConfigError
from recir.transforms import DataError as DataError

from ._checkpoint import CheckpointMismatchError as CheckpointMismatchError
from ._checkpoint import SlotProblem as SlotProblem
from ._checkpoint import checkpoint_meta as checkpoint_meta
from ._checkpoint import compare_slots as compare_slots
from ._checkpoint import load_resharded as load_resharded
from ._checkpoint import save_sharded as save_sharded
from ._checkpoint import saved_plan as saved_plan
from ._checkpoint import saved_slots as saved_slots
from ._checkpoint import slot_specs as slot_specs
from ._checkpoint import verify_checkpoint as verify_checkpoint
from ._checkpoint_manager import CheckpointManager as CheckpointManager
from ._checkpoint_manager import latest_checkpoint as latest_checkpoint
from ._checkpoint_manager import list_checkpoints as list_checkpoints
from ._checkpoint_manager import write_atomically as write_atomically
from ._distribute import DISTRIBUTED_META as DISTRIBUTED_META
from ._distribute import communication_bytes as communication_bytes
from ._distribute import distribute as distribute
from ._distribute import distribute_pipeline as distribute_pipeline
from ._distribute import gather_state as gather_state
from ._distribute import reshard as reshard
from ._distribute import shard_state as shard_state
from ._distribute import shard_tensor as shard_tensor
from ._distribute import split_batch as split_batch
from ._mesh import Mesh as Mesh
from ._modes import PARALLEL_MODES as PARALLEL_MODES
from ._modes import TABLE_SHARDINGS as TABLE_SHARDINGS
from ._modes import DataParallel as DataParallel
from ._modes import EmbeddingSharding as EmbeddingSharding
from ._modes import FullyShardedDataParallel as FullyShardedDataParallel
from ._modes import HybridParallel as HybridParallel
from ._modes import column_wise as column_wise
from ._modes import parallel_mode as parallel_mode
from ._modes import row_wise as row_wise
from ._modes import table_wise as table_wise
from ._plan import ShardingPlan as ShardingPlan
from ._plan import as_plan as as_plan
from ._plan import local_shape as local_shape
from ._plan import shard_range as shard_range
from ._planner import annotate as annotate
from ._planner import check_budget as check_budget
from ._planner import plan as plan
from ._process import setup_process_group as setup_process_group
from ._traffic import TableTraffic as TableTraffic
from ._traffic import table_traffic as table_traffic
from ._transforms.allreduce_grads import AllReduceGradients as AllReduceGradients
from ._transforms.fold_rng_rank import FoldRngRank as FoldRngRank
from ._transforms.shard_params import ShardParameters as ShardParameters
from ._transforms.shard_tables import ShardTables as ShardTables
from ._transforms.sync_buffers import SyncBuffers as SyncBuffers

__version__ = "0.1.0"

__all__ = [
    "write_atomically",
    # meshes and modes
    "Mesh",
    "DataParallel",
    "FullyShardedDataParallel",
    "EmbeddingSharding",
    "HybridParallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "parallel_mode",
    "PARALLEL_MODES",
    "TABLE_SHARDINGS",
    "setup_process_group",
    # plans
    "plan",
    "ShardingPlan",
    "as_plan",
    "annotate",
    "check_budget",
    "local_shape",
    "table_traffic",
    "TableTraffic",
    # per-device programs and state
    "distribute",
    "distribute_pipeline",
    "DISTRIBUTED_META",
    "shard_state",
    "shard_tensor",
    "shard_range",
    "gather_state",
    "reshard",
    "split_batch",
    "communication_bytes",
    # sharded checkpoints
    "save_sharded",
    "load_resharded",
    "saved_plan",
    "checkpoint_meta",
    "verify_checkpoint",
    "slot_specs",
    "saved_slots",
    "compare_slots",
    "SlotProblem",
    # a run's checkpoints: keep-k over a manifest, atomic `latest`
    "CheckpointManager",
    "list_checkpoints",
    "latest_checkpoint",
    # transforms
    "AllReduceGradients",
    "FoldRngRank",
    "ShardParameters",
    "ShardTables",
    "SyncBuffers",
    # errors
    "ConfigError",
    "DataError",
    "CheckpointMismatchError",
]
