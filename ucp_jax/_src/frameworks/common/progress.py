"""Progress bars of the importers and exporters (rich, over bytes; off when not on a terminal)."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    """A progress bar over bytes: `advance(n)` as bytes are done, `stop()` at the end.

    Off (every call a no-op) unless enabled; `enabled=None` means "when stderr is a terminal".

    >>> bar = Progress(False, 100, "ucp import")
    >>> bar.advance(10); bar.stop()
    """

    def __init__(self, enabled: bool | None, total: int, what: str) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar: Any = None
        self._task: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=Console(stderr=True), transient=False,
        )  # fmt: skip
        self._bar.start()
        self._task = self._bar.add_task(what, total=total)

    def advance(self, n: int) -> None:
        """Count `n` more bytes done."""
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def stop(self) -> None:
        """Stop drawing (the bar stays on screen)."""
        if self._bar is not None:
            self._bar.stop()
