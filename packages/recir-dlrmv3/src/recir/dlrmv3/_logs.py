"""What a person sees while `recir-dlrmv3` runs: log lines through the `recir.dlrmv3` logger (timestamps,
levels, an optional log file) and, on a terminal, a tqdm progress bar that log lines print above."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Any

LOGGER = logging.getLogger("recir.dlrmv3")
FORMAT = "%(asctime)s %(levelname)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str = "info", log_file: str | None = None) -> None:
    """Log lines go to stdout (and appended to ``log_file``): ``recir.dlrmv3`` at ``level``, every other
    logger (torch, JAX, the recir libraries) from WARNING up."""
    formatter = logging.Formatter(FORMAT, DATE_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=logging.WARNING, handlers=handlers, force=True)
    LOGGER.setLevel(level.upper())


def log_info(line: str) -> None:
    """`train()`'s and `run_parity()`'s default `log`: one INFO line on the ``recir.dlrmv3`` logger."""
    LOGGER.info(line)


class Progress:
    """A tqdm bar over the training steps (rate, ETA, last loss) when stderr is a terminal; nothing
    otherwise, where the log lines are the record. While it shows, log records print above it
    (tqdm's logging redirect), and until the first step ends (the compile) it ticks its elapsed time."""

    def __init__(self, total: int, initial: int = 0) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.enabled = total > initial and sys.stderr.isatty()
        self._bar: Any = tqdm(
            total=total,
            initial=initial,
            unit="step",
            desc="compiling",
            file=sys.stderr,
            disable=not self.enabled,
            dynamic_ncols=True,
        )
        self._redirect: contextlib.AbstractContextManager[Any] = (
            logging_redirect_tqdm() if self.enabled else contextlib.nullcontext()
        )
        self._redirect.__enter__()
        self._first_step_done = threading.Event()
        if self.enabled:
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:  # the first step blocks in the compiler: show that time passes
        while not self._first_step_done.wait(0.5):
            self._bar.refresh()

    def update(self, done: int, loss: float) -> None:
        if not self.enabled:
            return
        if not self._first_step_done.is_set():
            self._first_step_done.set()
            self._bar.set_description_str("train", refresh=False)
        self._bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self._first_step_done.set()
        self._bar.close()
        self._redirect.__exit__(None, None, None)
