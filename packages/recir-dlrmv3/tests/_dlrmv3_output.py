"""The messages of recir-dlrmv3's log lines (``2026-01-31 12:00:00 INFO message``) in a CLI's output."""

from __future__ import annotations

import re

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) (.*)$")


def messages(text: str, level: str | None = "INFO") -> list[str]:
    """The messages of the log lines in ``text`` (at ``level``; None: any level), other lines dropped."""
    found = (LOG_LINE.match(line) for line in text.splitlines())
    return [m.group(2) for m in found if m and (level is None or m.group(1) == level)]
