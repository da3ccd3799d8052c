"""Reads TensorBoard event files back (TensorBoard's own EventAccumulator) for the tests."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def run_dirs(logdir: Path) -> list[Path]:
    """The folders under ``logdir`` that hold event files (one per run)."""
    return sorted({p.parent for p in Path(logdir).rglob("events.out.tfevents.*")})


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of one run's scalars, in the order written."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def hparams(run_dir: Path) -> tuple[dict[str, object], list[str]]:
    """The HParams plugin's record of one run: (hyper-parameter -> value, metric tags)."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    return values, [m.name.tag for m in experiment.metric_infos]


def text(run_dir: Path, tag: str) -> str:
    """The text a run wrote under ``tag`` (the text plugin), first record."""
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()
