"""`export` a trained checkpoint for both stacks and `predict` with the artifacts: the metrics equal
those of the trained model evaluated eagerly (same eval batches)."""

from __future__ import annotations

import json

import pytest
from recir.dlrmv3 import TrainOptions, train
from recir.dlrmv3._cli import main
from recir.dlrmv3._export import export_model, predict

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=3, num_threads=1)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    opts = TrainOptions(**TINY, target="eager", num_train_batches=6, log_every=100, checkpoint_dir=str(ckpt),
                        checkpoint_every=6)  # fmt: skip
    result = train(opts, log=lambda _line: None)
    return ckpt, result.metrics


@pytest.mark.parametrize("target", ["tpu", "gpu"], ids=["jax-export", "aot-inductor"])
def test_export_then_predict_gives_the_trained_models_metrics(trained, target, tmp_path):
    ckpt, metrics = trained
    out = tmp_path / f"model.{target}"
    manifest = export_model(str(ckpt), target, str(out), log=lambda _line: None)
    on_disk = json.loads((tmp_path / f"model.{target}.json").read_text())
    assert on_disk["dlrmv3"]["step"] == 6 and on_disk["state_file"] == f"model.{target}.state.npz"
    assert manifest["outputs"][0]["name"] == "aux.0"
    got = predict(str(out), num_batches=3, log=lambda _line: None)
    assert got.keys() == metrics.keys()
    for k, v in metrics.items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k


def test_predict_cli_errors(tmp_path, capsys):
    assert main(["predict", "--artifact", str(tmp_path / "none.pt2")]) == 2
    assert "no manifest beside the artifact" in capsys.readouterr().err
    assert main(["predict", "--artifact", str(tmp_path / "x"), "--num_batches", "0"]) == 2
    assert "--num_batches must be >= 1" in capsys.readouterr().err
