"""recir.capture: Capture a whole PyTorch training step (forward, backward, optimizer) as one functional StepGraph."""

from recir.transforms import GRAD_OF_KEY as GRAD_OF_KEY  # defined in recir.transforms
from recir.transforms import OPTIM_PARAM_KEY as OPTIM_PARAM_KEY
from recir.transforms import CaptureError as CaptureError
from recir.transforms import ParamOptim as ParamOptim  # the optimizer maths lives in recir-transforms
from recir.transforms import apply_update as apply_update

from . import testing as testing
from ._bucketed import BucketedStep as BucketedStep
from ._capture import OPTIMIZER_META as OPTIMIZER_META
from ._capture import capture_train_step as capture_train_step
from ._decomp import capture_decompositions as capture_decompositions
from ._decomp import check_decomposition_table as check_decomposition_table
from ._eager_state import is_parameter_step as is_parameter_step
from ._eager_state import load_into as load_into
from ._eager_state import shared_step_layout as shared_step_layout
from ._eager_state import state_from as state_from
from ._eager_state import with_shared_step as with_shared_step
from ._lr import LR_SLOTS_META as LR_SLOTS_META
from ._lr import learning_rates as learning_rates
from ._lr import set_learning_rate as set_learning_rate
from ._lr import sync_learning_rates as sync_learning_rates

__version__ = "0.1.0"

__all__ = [
    # capture
    "capture_train_step",
    "BucketedStep",
    "CaptureError",
    # an eager model + optimizers as slot-named state, and back
    "state_from",
    "load_into",
    "with_shared_step",
    "shared_step_layout",
    "is_parameter_step",
    # optimizers
    "ParamOptim",
    "apply_update",
    # learning rates
    "set_learning_rate",
    "sync_learning_rates",
    "learning_rates",
    # decompositions
    "capture_decompositions",
    "check_decomposition_table",
    # metadata keys
    "OPTIMIZER_META",
    "LR_SLOTS_META",
    "GRAD_OF_KEY",
    "OPTIM_PARAM_KEY",
    # reference models for parity tests
    "testing",
    "__version__",
]
