"""`recir-dlrmv3 prepare`: raw public files -> the processed files the loaders read.

MovieLens: `ratings.dat` (`user::movie::rating::timestamp`, with `users.dat` for 1M), 100K's tab-separated
`u.data` (with `u.user`), or 20M's `ratings.csv`. KuaiRand-1K: `log_*.csv` plus `user_features_1k.csv`.
"""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from pathlib import Path

from recir.transforms import DataError

from ._config import KUAIRAND_RANGE_FEATURES
from ._files import KUAIRAND_COLUMNS, MOVIELENS_1M_USER_COLUMNS, MOVIELENS_COLUMNS

_KUAI_EVENTS = ("is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view",
                "is_profile_enter")  # fmt: skip


def _fields(path: Path, line: int, text: str, sep: str, n: int, what: str) -> list[str]:
    parts = text.rstrip("\r\n").split(sep)
    if len(parts) != n:
        raise DataError(
            f"{path}:{line}: expected {n} fields {what} separated by {sep!r}, got {text.strip()[:60]!r}"
        )
    return parts


def _ints(path: Path, line: int, parts: list[str], what: str) -> list[int]:
    try:
        return [int(float(p)) for p in parts]
    except ValueError:
        raise DataError(f"{path}:{line}: expected numbers for {what}, got {parts}") from None


def _read_ratings(raw: Path) -> tuple[Path, list[tuple[int, int, int, int]]]:
    out = []
    if (raw / "ratings.dat").is_file() or (raw / "u.data").is_file():
        path = raw / "ratings.dat" if (raw / "ratings.dat").is_file() else raw / "u.data"
        sep = "::" if path.name == "ratings.dat" else "\t"
        with path.open(encoding="latin-1") as f:
            for i, text in enumerate(f, 1):
                if text.strip():
                    p = _fields(path, i, text, sep, 4, "(user, movie, rating, timestamp)")
                    u, m, r, t = _ints(path, i, p, "user, movie, rating, timestamp")
                    out.append((u, m, r, t))
        return path, out
    if (raw / "ratings.csv").is_file():
        path = raw / "ratings.csv"
        with path.open() as f:
            reader = csv.reader(f)
            header = next(reader, [])
            if header[:4] != ["userId", "movieId", "rating", "timestamp"]:
                raise DataError(
                    f"{path}:1: expected header userId,movieId,rating,timestamp, got {','.join(header)}"
                )
            for row in reader:
                u, m, r, t = _ints(path, reader.line_num, row[:4], "userId, movieId, rating, timestamp")
                out.append((u, m, max(1, round(float(row[2]))), t))
        return path, out
    raise DataError(
        f"{raw}: no MovieLens ratings found; expected ratings.dat (1M), u.data (100K) or ratings.csv (20M)"
    )


def _read_users(raw: Path) -> dict[int, list[int]]:
    """user -> [sex, age_group, occupation, zip_code] as category codes (empty if no user file)."""
    path, sep = (raw / "users.dat", "::") if (raw / "users.dat").is_file() else (raw / "u.user", "|")
    if not path.is_file():
        return {}
    rows = []
    with path.open(encoding="latin-1") as f:
        for i, text in enumerate(f, 1):
            if text.strip():
                p = _fields(path, i, text, sep, 5, "(user, ...)")
                if sep == "|":  # u.user: id|age|gender|occupation|zip
                    p = [p[0], p[2], p[1], p[3], p[4]]
                rows.append((_ints(path, i, p[:1], "user id")[0], p[1:]))
    codes: list[dict[str, int]] = [{} for _ in range(4)]
    return {u: [codes[j].setdefault(v, len(codes[j])) for j, v in enumerate(vals)] for u, vals in rows}


def prepare_movielens(raw_dir: str | Path, data_dir: str | Path) -> Path:
    """Writes `data_dir/sasrec_format.csv` (one time-sorted row per user) and returns its path."""
    raw = Path(raw_dir)
    _, ratings = _read_ratings(raw)
    users = _read_users(raw)
    per_user: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for u, m, r, t in ratings:
        per_user[u].append((t, m, r))
    out = Path(data_dir) / "sasrec_format.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(MOVIELENS_COLUMNS + MOVIELENS_1M_USER_COLUMNS)
        for index, u in enumerate(sorted(per_user)):
            events = sorted(per_user[u])
            cols = [",".join(str(e[k]) for e in events) for k in (1, 2, 0)]
            w.writerow([index, u, *cols, *users.get(u, [0, 0, 0, 0])])
    os.replace(tmp, out)
    return out


def prepare_kuairand(raw_dir: str | Path, data_dir: str | Path) -> Path:
    """Writes `data_dir/processed_seqs.csv` from KuaiRand-1K's logs and user features."""
    raw = Path(raw_dir)
    logs = sorted(raw.glob("log_*.csv"))
    if not logs:
        raise DataError(f"{raw}: no KuaiRand log files (log_*.csv) found")
    per_user: dict[int, list[tuple[int, int, int, int, int]]] = defaultdict(list)
    need = ("user_id", "video_id", "time_ms", "play_time_ms", "duration_ms", *_KUAI_EVENTS)
    for path in logs:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in need if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(f"{path}:1: header is missing column(s) {', '.join(missing)}")
            for row in reader:
                v = _ints(path, reader.line_num, [row[c] or "0" for c in need], ", ".join(need))
                bits = sum((1 << i) for i, x in enumerate(v[5:]) if x > 0)
                per_user[v[0]].append((v[2], v[1], bits, v[3], v[4]))
    features: dict[int, list[int]] = {}
    user_path = raw / "user_features_1k.csv"
    if user_path.is_file():
        with user_path.open(newline="") as f:
            reader = csv.DictReader(f)
            codes: list[dict[str, int]] = [{} for _ in KUAIRAND_RANGE_FEATURES]
            for row in reader:
                uid = _ints(user_path, reader.line_num, [row["user_id"]], "user_id")[0]
                features[uid] = [codes[j].setdefault(row.get(c, ""), len(codes[j]))
                                 for j, c in enumerate(KUAIRAND_RANGE_FEATURES)]  # fmt: skip
    out = Path(data_dir) / "processed_seqs.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(KUAIRAND_COLUMNS + KUAIRAND_RANGE_FEATURES)
        for u in sorted(per_user):
            events = sorted(per_user[u])
            cols = [",".join(str(e[k]) for e in events) for k in (1, 0, 2, 3, 4)]
            w.writerow([u, *cols, *features.get(u, [0] * len(KUAIRAND_RANGE_FEATURES))])
    os.replace(tmp, out)
    return out
