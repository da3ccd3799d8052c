"""recir.dlrmv3: DLRMv3 (HSTU ranking) trained through RecIR on the GPU and TPU paths: model, data,
trainers, CLI (`recir-dlrmv3 train | parity | prepare`)."""

from ._batch import PADDING_ID as PADDING_ID
from ._batch import Batch as Batch
from ._batch import PaddingStats as PaddingStats
from ._batch import Sample as Sample
from ._batch import collate as collate
from ._checkpoint import latest_checkpoint as latest_checkpoint
from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import save_checkpoint as save_checkpoint
from ._config import DATASETS as DATASETS
from ._config import DatasetSpec as DatasetSpec
from ._config import ModelConfig as ModelConfig
from ._config import TableSpec as TableSpec
from ._config import Task as Task
from ._config import dataset_spec as dataset_spec
from ._data import Data as Data
from ._data import make_data as make_data
from ._files import load_file_dataset as load_file_dataset
from ._metrics import MetricAccumulator as MetricAccumulator
from ._metrics import auc as auc
from ._metrics import normalized_entropy as normalized_entropy
from ._model import DLRMv3 as DLRMv3
from ._model import loss_fn as loss_fn
from ._model import multitask_loss as multitask_loss
from ._optim import make_optimizers as make_optimizers
from ._options import TrainOptions as TrainOptions
from ._parity import ParityRow as ParityRow
from ._parity import run_parity as run_parity
from ._prepare import prepare_kuairand as prepare_kuairand
from ._prepare import prepare_movielens as prepare_movielens
from ._synthetic import SyntheticDataset as SyntheticDataset
from ._train import TrainResult as TrainResult
from ._train import evaluate as evaluate
from ._train import train as train
from ._trainers import CompiledTrainer as CompiledTrainer
from ._trainers import EagerTrainer as EagerTrainer
from ._trainers import make_trainer as make_trainer

__version__ = "0.1.0"

__all__ = [
    # model
    "DLRMv3",
    "ModelConfig",
    "loss_fn",
    "multitask_loss",
    # batch format
    "Batch",
    "Sample",
    "collate",
    "PADDING_ID",
    "PaddingStats",
    # datasets
    "DATASETS",
    "DatasetSpec",
    "TableSpec",
    "Task",
    "dataset_spec",
    "Data",
    "make_data",
    "SyntheticDataset",
    "load_file_dataset",
    "prepare_movielens",
    "prepare_kuairand",
    # training
    "TrainOptions",
    "TrainResult",
    "train",
    "evaluate",
    "make_optimizers",
    "make_trainer",
    "EagerTrainer",
    "CompiledTrainer",
    "run_parity",
    "ParityRow",
    # metrics
    "MetricAccumulator",
    "auc",
    "normalized_entropy",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
]
