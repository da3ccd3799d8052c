"""Reference models, optimizers and eager-parity helpers for 20-step parity tests (capture and lowerings)."""

from ._testing_models import MLP as MLP
from ._testing_models import OPTIMIZERS as OPTIMIZERS
from ._testing_models import REFERENCE_CASES as REFERENCE_CASES
from ._testing_models import BatchNormModel as BatchNormModel
from ._testing_models import EmbeddingBagModel as EmbeddingBagModel
from ._testing_models import ReferenceCase as ReferenceCase
from ._testing_models import ServingModel as ServingModel
from ._testing_models import TransformerBlock as TransformerBlock
from ._testing_models import captured_gradients as captured_gradients
from ._testing_models import clone_pair as clone_pair
from ._testing_models import eager_gradients as eager_gradients
from ._testing_models import eager_state_dict as eager_state_dict
from ._testing_models import eager_step as eager_step
from ._testing_models import make_optimizer as make_optimizer
from ._testing_models import serving_batch as serving_batch
from ._testing_models import serving_loss as serving_loss
from ._testing_models import state_mismatches as state_mismatches

__all__ = [
    "ServingModel",
    "serving_loss",
    "serving_batch",
    # models
    "MLP",
    "TransformerBlock",
    "EmbeddingBagModel",
    "BatchNormModel",
    "ReferenceCase",
    "REFERENCE_CASES",
    # optimizers
    "OPTIMIZERS",
    "make_optimizer",
    # eager parity
    "eager_step",
    "eager_state_dict",
    "state_mismatches",
    "clone_pair",
    "captured_gradients",
    "eager_gradients",
]
