"""The catalogue of bad inputs (README "Bad inputs"): every one is one message line naming the thing
and the fix; on the CLI exit status 2 and no traceback, through the Python API the documented error
class; and no file is created, changed or deleted."""

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from recir.dlrmv3 import ModelConfig, TrainOptions, train
from recir.dlrmv3._cli import main
from recir.transforms import CaptureError, ConfigError, DataError

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=2, num_threads=1)  # fmt: skip
_TINY_ARGS = [f"--{k}={v}" for k, v in TINY.items()]
_ML_HEADER = "index,user_id,sequence_item_ids,sequence_ratings,sequence_timestamps\n"
_ML_ROW = '0,1,"{ids}","{ratings}","{times}"\n'


@pytest.fixture(scope="module")
def run_checkpoints(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A finished 2-step run's checkpoints (step-1, step-2); each case works on its own copy."""
    root = tmp_path_factory.mktemp("run") / "ckpt"
    opts = TrainOptions(
        **TINY, num_train_batches=2, log_every=10, checkpoint_dir=str(root), checkpoint_every=1
    )
    train(opts, log=lambda _: None)
    return root


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def _movielens(tmp: Path, text: str) -> Path:
    (tmp / "data").mkdir()
    (tmp / "data" / "sasrec_format.csv").write_text(text)
    return tmp / "data"


def _raw(tmp: Path, name: str, data: bytes) -> Path:
    (tmp / "raw").mkdir()
    (tmp / "raw" / name).write_bytes(data)
    return tmp / "raw"


def _row(n: int = 12, ratings: str | None = None, times: str | None = None) -> str:
    ids = ",".join(str(i + 1) for i in range(n))
    return _ML_ROW.format(
        ids=ids,
        ratings=ratings or ",".join("4" for _ in range(n)),
        times=times or ",".join(str(i) for i in range(n)),
    )


def _corrupt(ckpt: Path) -> None:
    victim = next(p for p in sorted((ckpt / "step-2").rglob("*")) if p.is_file() and p.name != "recir.json")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


# (name, argv(tmp, ckpt), what the one line must contain: the thing and the fix; {t} tmp, {c} ckpt)
Argv = Callable[[Path, Path], list[str]]
CLI: list[tuple[str, Argv, list[str]]] = [
    ("batch_size 0", lambda t, c: ["train", "--batch_size", "0"], ["--batch_size", ">= 1"]),
    ("num_train_batches 0", lambda t, c: ["train", "--num_train_batches", "0"], ["--num_train_batches", ">= 1"]),
    ("lr negative", lambda t, c: ["train", "--lr", "-1"], ["--lr", "finite number > 0"]),
    ("sparse_lr inf", lambda t, c: ["train", "--sparse_lr", "inf"], ["--sparse_lr", "finite number > 0"]),
    ("layer_dropout 1", lambda t, c: ["train", "--layer_dropout", "1"], ["--layer_dropout", "[0, 1)"]),
    ("num_heads not dividing", lambda t, c: ["train", "--embedding_dim", "16", "--num_heads", "3"],
     ["--embedding_dim 16", "divisible by --num_heads 3"]),
    ("num_layers 0", lambda t, c: ["train", "--num_layers", "0"], ["--num_layers", ">= 1"]),
    ("token_budget not a number", lambda t, c: ["train", "--token_budget", "lots"],
     ["--token_budget must be a number of tokens or 'auto'", "got 'lots'"]),
    ("token_budget below the contextual tokens and candidates", lambda t, c: ["train", "--token_budget", "10"],
     ["--token_budget 10 is below a full batch's contextual tokens and candidates", "Fix: --token_budget auto"]),
    ("token_buckets without auto", lambda t, c: ["train", "--token_buckets", "3"],
     ["--token_buckets 3", "takes --token_budget auto", "Fix: add --token_budget auto"]),
    ("checkpoint_every without dir", lambda t, c: ["train", "--checkpoint_every", "2"],
     ["--checkpoint_every", "needs --checkpoint_dir"]),
    ("keep_checkpoints 0", lambda t, c: ["train", "--keep_checkpoints", "0"], ["--keep_checkpoints", ">= 1"]),
    ("resume latest without dir", lambda t, c: ["train", "--resume"], ["--resume", "needs --checkpoint_dir"]),
    ("overwrite without dir", lambda t, c: ["train", "--overwrite"], ["--overwrite", "needs --checkpoint_dir"]),
    ("resume and overwrite", lambda t, c: ["train", "--checkpoint_dir", str(c), "--resume", "--overwrite"],
     ["--resume and --overwrite", "Fix: pass one of them"]),
    ("embedding_backend cpu off the TPU path", lambda t, c: ["train", "--target", "gpu", "--embedding_backend", "cpu"],
     ["--embedding_backend cpu", "got --target gpu", "Fix: --target tpu --embedding_backend cpu"]),
    ("embedding_backend cpu with table sharding",
     lambda t, c: ["train", "--target", "tpu", "--mesh", "data=2", "--table_sharding", "row", "--embedding_backend", "cpu"],
     ["--embedding_backend cpu", "no --table_sharding", "Fix: drop those flags"]),
    ("mesh off the TPU path", lambda t, c: ["train", "--target", "eager", "--mesh", "data=2"],
     ["--mesh", "Fix: --target tpu"]),
    ("batch not splitting over the mesh",
     lambda t, c: ["train", "--target", "tpu", "--mesh", "data=4"] + _TINY_ARGS + ["--batch_size=6"],
     ["--batch_size 6 (the global batch) does not split over the data-parallel size 4", "Fix: use a multiple of 4"]),
    ("mesh larger than the devices",
     lambda t, c: ["train", "--target", "tpu", "--mesh", "data=64"] + _TINY_ARGS + ["--batch_size=64"],
     ["mesh {'data': 64} needs 64 devices", "Fix: size the mesh"]),
    ("multihost off the TPU path", lambda t, c: ["train", "--multihost"], ["--multihost", "Fix: add --target tpu"]),
    ("mesh syntax", lambda t, c: ["train", "--target", "tpu", "--mesh", "data"], ["--mesh 'data'", "NAME=SIZE"]),
    ("mesh axis of size 0", lambda t, c: ["train", "--target", "tpu", "--mesh", "data=0"], ["--mesh 'data=0'", "SIZE >= 1"]),
    ("checkpoint_dir is a file", lambda t, c: ["train", "--checkpoint_dir", str(c / "step-1" / "recir.json"),
                                               "--checkpoint_every", "1"],
     ["--checkpoint_dir {c}/step-1/recir.json is a file, not a directory", "Fix: pass a directory path"]),
    ("tensorboard_dir under a file", lambda t, c: ["train", "--tensorboard_dir", str(c / "step-1" / "recir.json" / "tb")],
     ["--tensorboard_dir {c}/step-1/recir.json/tb lies under the file {c}/step-1/recir.json", "Fix: pass a directory"]),
    ("profile is a file", lambda t, c: ["train", "--profile", str(c / "step-1" / "recir.json")],
     ["--profile {c}/step-1/recir.json is a file", "Fix: pass a directory path"]),
    ("parity steps 0", lambda t, c: ["parity", "--steps", "0"], ["--num_train_batches", ">= 1"]),
    ("parity atol nan", lambda t, c: ["parity", "--atol", "nan"], ["--atol", ">= 0"]),
    ("log_file in a missing directory", lambda t, c: ["train", "--log_file", str(t / "no" / "run.log")],
     ["--log_file", "Fix: pass a path in an existing, writable directory"]),
    # data files
    ("dataset without data_dir", lambda t, c: ["train", "--dataset", "movielens-1m"],
     ["--data_dir", "recir-dlrmv3 prepare --dataset movielens-1m"]),
    ("data_dir without the file", lambda t, c: ["train", "--dataset", "movielens-1m", "--data_dir", str(t)],
     ["no sasrec_format.csv found", "Create it with `recir-dlrmv3 prepare"]),
    ("data file missing a column",
     lambda t, c: ["train", "--dataset", "movielens-1m", "--data_dir", str(_movielens(t, "index,user_id\n0,1\n"))],
     ["sasrec_format.csv:1: header is missing column(s) sequence_item_ids", "expected at least"]),
    ("data file with a non-integer user",
     lambda t, c: ["train", "--dataset", "movielens-20m", "--data_dir",
                   str(_movielens(t, _ML_HEADER + _row().replace("0,1,", "0,abc,", 1)))],
     ["sasrec_format.csv:2: column 'user_id'", "expected an integer"]),
    ("data file with unequal lists",
     lambda t, c: ["train", "--dataset", "movielens-20m", "--data_dir",
                   str(_movielens(t, _ML_HEADER + _row(times="1,2,3")))],
     ["sasrec_format.csv:2:", "must have equal lengths"]),
    ("data file with a rating of 7",
     lambda t, c: ["train", "--dataset", "movielens-20m", "--data_dir",
                   str(_movielens(t, _ML_HEADER + _row(ratings=",".join(["7"] * 12))))],
     ["sasrec_format.csv:2: column 'sequence_ratings'", "expected ratings 1..5"]),
    ("prepare without raw files",
     lambda t, c: ["prepare", "--dataset", "movielens-1m", "--raw_dir", str(t), "--data_dir", str(t)],
     ["no MovieLens ratings found", "{t}"]),
    ("prepare kuairand without logs",
     lambda t, c: ["prepare", "--dataset", "kuairand-1k", "--raw_dir", str(t), "--data_dir", str(t)],
     ["no KuaiRand log files (log_*.csv)", "{t}"]),
    ("data file not text",
     lambda t, c: ["train", "--dataset", "movielens-20m", "--data_dir", str(_raw(t, "sasrec_format.csv", b"\xff\xfe\x00"))],
     ["sasrec_format.csv: not a readable CSV file", "can't decode byte 0xff"]),
    ("prepare with a garbled ratings.dat",
     lambda t, c: ["prepare", "--dataset", "movielens-1m", "--raw_dir", str(_raw(t, "ratings.dat", b"1,2,3\n")),
                   "--data_dir", str(t / "out")],
     ["ratings.dat:1: expected 4 fields (user, movie, rating, timestamp) separated by '::'", "got '1,2,3'"]),
    ("prepare with a KuaiRand log missing columns",
     lambda t, c: ["prepare", "--dataset", "kuairand-1k", "--raw_dir", str(_raw(t, "log_standard.csv", b"a,b\n")),
                   "--data_dir", str(t / "out")],
     ["log_standard.csv:1: header is missing column(s) user_id", "is_click"]),
    # checkpoints
    ("resume from no checkpoint", lambda t, c: ["train", "--resume", str(t / "nothing")] + _TINY_ARGS,
     ["--resume {t}/nothing", "no complete checkpoint"]),
    ("fresh run into another run's checkpoints",
     lambda t, c: ["train", "--checkpoint_dir", str(c), "--checkpoint_every", "1"] + _TINY_ARGS,
     ["--checkpoint_dir {c} holds the checkpoints of another run", "Fix: --resume"]),
    ("resume with another embedding_dim",
     lambda t, c: ["train", "--checkpoint_dir", str(c), "--checkpoint_every", "1", "--resume", "--num_train_batches",
                   "4"] + _TINY_ARGS + ["--embedding_dim=32"],
     ["embedding_dim", "32"]),
    ("resume from a damaged checkpoint",
     lambda t, c: (_corrupt(c), ["train", "--resume", str(c / "step-2"), "--num_train_batches", "4"] + _TINY_ARGS)[1],
     ["step-2", "Fix: resume from the previous checkpoint: --resume {c}/step-1"]),
]  # fmt: skip

# argparse's own refusals: usage lines, then one error line, exit 2
ARGPARSE: list[tuple[str, list[str], list[str]]] = [
    ("unknown dataset", ["train", "--dataset", "criteo"], ["--dataset", "invalid choice: 'criteo'"]),
    ("unknown target", ["train", "--target", "npu"], ["--target", "invalid choice: 'npu'", "eager-graph"]),
    ("non-numeric lr", ["train", "--lr", "fast"], ["--lr", "invalid float value: 'fast'"]),
    ("unknown flag", ["train", "--learning_rate", "1"], ["unrecognized arguments: --learning_rate"]),
]


def _case(tmp_path: Path, run_checkpoints: Path, monkeypatch) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    work = tmp_path / "work"
    work.mkdir()
    ckpt = work / "ckpt"
    shutil.copytree(run_checkpoints, ckpt)
    monkeypatch.chdir(work)  # anything written to the working directory is seen too
    return work, ckpt


@pytest.mark.parametrize(("name", "argv", "says"), CLI, ids=[c[0] for c in CLI])
def test_dlrmv3_bad_cli_input(name, argv, says, tmp_path, run_checkpoints, monkeypatch, capsys):
    work, ckpt = _case(tmp_path, run_checkpoints, monkeypatch)
    args = argv(work, ckpt)  # writes the bad input files
    before = _snapshot(work)
    assert main(args) == 2, name
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    # {t}: the case's directory, {c}: its checkpoints
    says = [s.replace("{t}", str(work)).replace("{c}", str(ckpt)) for s in says]
    assert all(s in lines[0] for s in says), (says, lines[0])
    assert "Traceback" not in err + out
    assert _snapshot(work) == before  # nothing created, changed or deleted


@pytest.mark.parametrize(("name", "argv", "says"), ARGPARSE, ids=[c[0] for c in ARGPARSE])
def test_dlrmv3_bad_cli_flag_rejected_by_argparse(name, argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert e.value.code == 2 and len(errors) == 1 and all(s in errors[0] for s in says), err
    assert err.splitlines()[0].startswith("usage: recir-dlrmv3 ")  # the rest is usage
    assert list(tmp_path.iterdir()) == []


def test_dlrmv3_bad_inputs_in_a_subprocess_have_no_traceback(tmp_path, run_checkpoints):
    """The console entry point itself: exit 2, one stderr line, no traceback, no file touched."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_checkpoints, ckpt)
    _corrupt(ckpt)
    before = _snapshot(tmp_path)
    for args, says in [
        (
            ["train", "--resume", str(ckpt / "step-2")] + _TINY_ARGS,
            "Fix: resume from the previous checkpoint",
        ),
        (["train", "--dataset", "movielens-20m", "--data_dir", str(tmp_path)], "no sasrec_format.csv found"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "recir.dlrmv3", *args], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.splitlines() == [proc.stderr.strip()] and says in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
    assert _snapshot(tmp_path) == before


def _jagged(keys, values, lengths, batch_size, capacities):  # type: ignore[no-untyped-def]
    from recir.embedding import JaggedBatch

    return JaggedBatch(keys, torch.tensor(values), torch.tensor(lengths), batch_size, capacities)


def _validate(batch, rows=10):  # type: ignore[no-untyped-def]
    from recir.embedding import EmbeddingTable, validate_batch

    validate_batch(batch, [EmbeddingTable("t", rows, 4, features=("f",))])


def _capture_str_batch() -> None:
    from recir.capture import capture_train_step

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    capture_train_step(model, opt, lambda m, b: m(b["x"]).sum(), {"x": torch.ones(1, 2), "name": "a string"})


# (name, call, error class, what the one line must contain)
API: list[tuple[str, Callable[[], object], type[Exception], list[str]]] = [
    ("train with lr 0", lambda: train(TrainOptions(**TINY, lr=0.0), log=lambda _: None), ConfigError,
     ["--lr", "finite number > 0"]),
    ("ModelConfig num_heads", lambda: ModelConfig(embedding_dim=10, num_heads=4), ConfigError,
     ["--embedding_dim 10", "divisible by --num_heads 4"]),
    ("Mesh without axes", lambda: __import__("recir.distributed").distributed.Mesh(axes={}), ConfigError,
     ["Mesh needs at least one axis", 'Mesh(axes={"data": 2})']),
    ("Mesh unknown axis", lambda: __import__("recir.distributed").distributed.Mesh(batch=2), ConfigError,
     ["Mesh axis 'batch'", 'Fix: name the batch axis "data"']),
    ("Mesh size 0", lambda: __import__("recir.distributed").distributed.Mesh(data=0), ConfigError,
     ["Mesh axis 'data' has size 0", "expected a positive int"]),
    ("JaggedBatch capacities", lambda: _jagged(["f"], [1, 2], [1, 1], 2, [3]), DataError,
     ["values has 2 entries", "capacities (3,)"]),
    ("batch with a negative length", lambda: _validate(_jagged(["f"], [1, 2], [-1, 1], 2, [2])), DataError,
     ["feature 'f': length -1 at batch position 0", "Fix: lengths count the ids"]),
    ("batch with an id past its table", lambda: _validate(_jagged(["f"], [1, 12], [1, 1], 2, [2])), DataError,
     ["table 't' (feature 'f'): id 12 at batch position 1", "Fix: hash or clip ids"]),
    ("batch feature without a table", lambda: _validate(_jagged(["g"], [1, 2], [1, 1], 2, [2])), DataError,
     ["feature 'g' has no table", "Fix: add the feature"]),
    ("capture a string batch leaf", _capture_str_batch, CaptureError,
     ["batch leaf 'name' is a str", "Fix: make it a tensor"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "error", "says"), API, ids=[c[0] for c in API])
def test_dlrmv3_bad_api_input(name, call, error, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as e:
        call()
    message = str(e.value)
    # one line; a message may put its fix on a second line of its own ("Fix: ...")
    lines = message.splitlines()
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("Fix: ")), message
    assert all(s in message for s in says), message
    assert list(tmp_path.iterdir()) == []


def test_the_catalogue_has_at_least_25_distinct_inputs():
    names = [c[0] for c in CLI] + [c[0] for c in ARGPARSE] + [c[0] for c in API]
    assert len(names) == len(set(names)) >= 25
