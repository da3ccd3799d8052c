"""Command lines the tests share with the docs and deploy/: the smoke command's flags, the repository root."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The smoke command (README, docs/dlrmv3.md, the Dockerfiles' default) less its entry point and backend
SMOKE = ["--dataset", "debug", "--batch_size", "4", "--num_workers", "0", "--num_train_batches", "6",
         "--embedding_dim", "64", "--num_layers", "1", "--uih_len", "16", "--num_candidates", "4",
         "--hash_size", "1000", "--log_every", "1"]  # fmt: skip
