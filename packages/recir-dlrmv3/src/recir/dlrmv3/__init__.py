"""recir.dlrmv3: DLRMv3 (HSTU ranking) trained through RecIR on the GPU and TPU paths: model, data,
trainers, CLI (`recir-dlrmv3 train | parity | prepare`).

Names load on first use (PEP 562), so `recir-dlrmv3 --help` does not import TorchRec and the engines.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the private module that defines it
_EXPORTS = {
    # model
    "DLRMv3": "_model",
    "ModelConfig": "_config",
    "loss_fn": "_model",
    "multitask_loss": "_model",
    # batch format
    "Batch": "_batch",
    "Sample": "_batch",
    "collate": "_batch",
    "PADDING_ID": "_batch",
    "PaddingStats": "_batch",
    "fit_token_budget": "_batch",
    "estimate_token_budget": "_batch",
    # datasets
    "DATASETS": "_config",
    "DatasetSpec": "_config",
    "TableSpec": "_config",
    "Task": "_config",
    "dataset_spec": "_config",
    "Data": "_data",
    "make_data": "_data",
    "SyntheticDataset": "_synthetic",
    "load_file_dataset": "_files",
    "prepare_movielens": "_prepare",
    "prepare_kuairand": "_prepare",
    # training
    "TrainOptions": "_options",
    "TrainResult": "_train",
    "train": "_train",
    "evaluate": "_train",
    "make_optimizers": "_optim",
    "make_trainer": "_trainers",
    "EagerTrainer": "_trainers",
    "CompiledTrainer": "_trainers",
    "run_parity": "_parity",
    "ParityRow": "_parity",
    # metrics
    "MetricAccumulator": "_metrics",
    "auc": "_metrics",
    "normalized_entropy": "_metrics",
    # serving: cached-history candidate scoring
    "HistoryEncoder": "_serving",
    "CandidateScorer": "_serving",
    "HistoryInputs": "_serving",
    "serving_max_len": "_serving",
    "split_batch": "_serving",
    "export_cached_history": "_serving_export",
    "cached_history_graphs": "_serving_export",
    "load_cached_history": "_serving_export",
    # checkpoints
    "save_checkpoint": "_checkpoint",
    "load_checkpoint": "_checkpoint",
    "latest_checkpoint": "_checkpoint",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ._batch import PADDING_ID as PADDING_ID
    from ._batch import Batch as Batch
    from ._batch import PaddingStats as PaddingStats
    from ._batch import Sample as Sample
    from ._batch import collate as collate
    from ._batch import estimate_token_budget as estimate_token_budget
    from ._batch import fit_token_budget as fit_token_budget
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
    from ._serving import CandidateScorer as CandidateScorer
    from ._serving import HistoryEncoder as HistoryEncoder
    from ._serving import HistoryInputs as HistoryInputs
    from ._serving import serving_max_len as serving_max_len
    from ._serving import split_batch as split_batch
    from ._serving_export import cached_history_graphs as cached_history_graphs
    from ._serving_export import export_cached_history as export_cached_history
    from ._serving_export import load_cached_history as load_cached_history
    from ._synthetic import SyntheticDataset as SyntheticDataset
    from ._train import TrainResult as TrainResult
    from ._train import evaluate as evaluate
    from ._train import train as train
    from ._trainers import CompiledTrainer as CompiledTrainer
    from ._trainers import EagerTrainer as EagerTrainer
    from ._trainers import make_trainer as make_trainer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
