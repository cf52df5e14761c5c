"""Progress bars on stderr (tqdm) for the CLI's long work, or nothing."""

from __future__ import annotations

import sys
from typing import Any, Optional


class Progress:
    """A tqdm bar on stderr while enabled (and tqdm importable), else a
    no-op. Call it as ``progress(done, total)``; use it as a context manager
    so the bar is closed."""

    def __init__(self, desc: str, *, unit: str = "it", enabled: bool = True, total: Optional[int] = None) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is a dependency, but stay usable without it
                return
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False,
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
