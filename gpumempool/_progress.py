"""Progress bars on stderr (tqdm) for the CLI's long work, or nothing."""

from __future__ import annotations

import sys
from typing import Any, Optional


class Progress:
    """A tqdm bar on stderr while enabled (and tqdm importable), else a
    no-op. Call it as ``progress(done, total)``; use it as a context manager
    so the bar is closed (its line ended or, on a terminal, erased) before
    anything else is printed."""

    def __init__(self, desc: str, *, unit: str = "it", enabled: bool = True, total: Optional[int] = None) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is a dependency, but stay usable without it
                return
            try:
                tty = sys.stderr.isatty()
            except (AttributeError, ValueError):  # replaced, or closed
                tty = False
            # On a terminal the closed bar is erased and the next output
            # takes its line; in a pipe or a log, erasing writes spaces and a
            # carriage return that leave the next output on the bar's line, so
            # there the bar stays, its line ended (tqdm's leave=True).
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=not tty,
                             file=sys.stderr, dynamic_ncols=True)

    def __call__(self, done: int, total: int) -> None:
        bar = self._bar
        if bar is None:
            return
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
