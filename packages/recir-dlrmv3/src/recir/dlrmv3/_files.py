"""Loaders for the public datasets' processed files (MovieLens `sasrec_format.csv`, KuaiRand
`processed_seqs.csv`). Every problem is a `DataError` naming the file, the line and what was expected.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from recir.transforms import DataError

from ._batch import Sample
from ._config import KUAIRAND_RANGE_FEATURES, DatasetSpec

MAX_CANDIDATES = 10  # the last 10 events of a user are the candidates (docs/dlrmv3-reference.md)

MOVIELENS_COLUMNS = ("index", "user_id", "sequence_item_ids", "sequence_ratings", "sequence_timestamps")
MOVIELENS_1M_USER_COLUMNS = ("sex", "age_group", "occupation", "zip_code")
KUAIRAND_COLUMNS = ("user_id", "video_id", "time_ms", "action_weights", "play_time_ms", "duration_ms")

_FILES = {
    "movielens-1m": ("sasrec_format.csv", "ml-1m/sasrec_format.csv"),
    "movielens-20m": ("sasrec_format.csv", "ml-20m/sasrec_format.csv"),
    "kuairand-1k": ("processed_seqs.csv", "KuaiRand-1K/data/processed_seqs.csv"),
}


def dataset_file(name: str, data_dir: str | Path | None) -> Path:
    """The processed file of dataset `name` under `data_dir` (directly or in the reference's layout)."""
    if data_dir is None:
        raise DataError(
            f"--dataset {name} reads {_FILES[name][0]} from --data_dir, which was not given; "
            f"pass --data_dir DIR (convert raw files with `recir-dlrmv3 prepare --dataset {name}`)"
        )
    tried = [Path(data_dir) / rel for rel in _FILES[name]]
    for path in tried:
        if path.is_file():
            return path
    raise DataError(
        f"--dataset {name}: no {_FILES[name][0]} found; tried {', '.join(str(p) for p in tried)}. "
        f"Create it with `recir-dlrmv3 prepare --dataset {name} --raw_dir RAW --data_dir {data_dir}`"
    )


def _int_list(text: str, path: Path, line: int, column: str) -> np.ndarray:
    body = text.strip().strip("[]").strip()
    if not body:
        return np.zeros(0, np.int64)
    try:
        return np.array([int(float(x)) for x in body.split(",")], dtype=np.int64)
    except ValueError:
        raise DataError(
            f"{path}:{line}: column {column!r}: expected a comma-separated list of numbers, got {text[:60]!r}"
        ) from None


def _int(text: str, path: Path, line: int, column: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        raise DataError(f"{path}:{line}: column {column!r}: expected an integer, got {text[:60]!r}") from None


def _rows(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise DataError(
                    f"{path}:1: header is missing column(s) {', '.join(missing)}; expected at least "
                    f"{','.join(required)}, got {','.join(header) or '(empty file)'}"
                )
            rows = []
            for row in reader:
                if None in row or any(v is None for v in row.values()):
                    raise DataError(
                        f"{path}:{reader.line_num}: expected {len(header)} fields ({','.join(header)}); "
                        f"got a row with a different count"
                    )
                rows.append((reader.line_num, row))
            return rows
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: not a readable CSV file ({e})") from None


def _split(uih_and_cand: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return [a[:-MAX_CANDIDATES] for a in uih_and_cand], [a[-MAX_CANDIDATES:] for a in uih_and_cand]


def _check_lengths(path: Path, line: int, named: dict[str, np.ndarray]) -> None:
    lengths = {k: len(v) for k, v in named.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(f"{path}:{line}: the per-event lists must have equal lengths; got {lengths}")


def load_movielens(path: Path, spec: DatasetSpec) -> list[Sample]:
    """Users with more than 10 events; the last 10 are candidates. A rating r sets action bit r-1."""
    one_m = spec.name == "movielens-1m"
    rows = _rows(path, MOVIELENS_COLUMNS + (MOVIELENS_1M_USER_COLUMNS if one_m else ()))
    samples = []
    for line, row in rows:
        ids = _int_list(row["sequence_item_ids"], path, line, "sequence_item_ids")
        ratings = _int_list(row["sequence_ratings"], path, line, "sequence_ratings")
        ts = _int_list(row["sequence_timestamps"], path, line, "sequence_timestamps")
        _check_lengths(path, line, {"sequence_item_ids": ids, "sequence_ratings": ratings,
                                    "sequence_timestamps": ts})  # fmt: skip
        if ((ratings < 1) | (ratings > 5)).any():
            raise DataError(f"{path}:{line}: column 'sequence_ratings': expected ratings 1..5, got {ratings}")
        if len(ids) <= MAX_CANDIDATES:
            continue
        actions = (1 << (ratings - 1)).astype(np.int64)
        (u_ids, u_ts, u_act), (c_ids, _, c_act) = _split([ids, ts, actions])
        ctx_cols = spec.contextual
        ctx = np.array([_int(row[c], path, line, c) for c in ctx_cols], dtype=np.int64)
        samples.append(Sample(u_ids, u_ts, u_act, c_ids, c_act, ctx))
    return samples


def load_kuairand(path: Path, spec: DatasetSpec) -> list[Sample]:
    """KuaiRand-1K: action bitmasks as given; time_ms converted to seconds for the time buckets."""
    rows = _rows(path, KUAIRAND_COLUMNS + KUAIRAND_RANGE_FEATURES)
    samples = []
    for line, row in rows:
        lists = {c: _int_list(row[c], path, line, c) for c in KUAIRAND_COLUMNS[1:]}
        _check_lengths(path, line, lists)
        if len(lists["video_id"]) <= MAX_CANDIDATES:
            continue
        ts: np.ndarray = lists["time_ms"] // 1000
        (u_ids, u_ts, u_act), (c_ids, _, c_act) = _split([lists["video_id"], ts, lists["action_weights"]])
        ctx = np.array([_int(row[c], path, line, c) for c in spec.contextual], dtype=np.int64)
        samples.append(Sample(u_ids, u_ts, u_act, c_ids, c_act, ctx))
    return samples


def load_file_dataset(spec: DatasetSpec, data_dir: str | Path | None) -> tuple[list[Sample], list[Sample]]:
    """(train, eval) samples: the first `train_fraction` of the users train, the rest evaluate."""
    path = dataset_file(spec.name, data_dir)
    samples = load_kuairand(path, spec) if spec.name == "kuairand-1k" else load_movielens(path, spec)
    if len(samples) < 2:
        raise DataError(
            f"{path}: expected at least 2 users with more than {MAX_CANDIDATES} events, got {len(samples)}"
        )
    cut = min(max(1, int(len(samples) * spec.train_fraction)), len(samples) - 1)
    return samples[:cut], samples[cut:]
