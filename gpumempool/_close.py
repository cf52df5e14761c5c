"""What closing a pool does around the engine's part: the close hooks of
the layers above the pool (torch, CuPy, cache scopes), the report of what
the engine found and released, and the warnings about it. Closing must
work in ``__exit__`` and at shutdown, so nothing here raises: every
problem becomes a :class:`LeakWarning`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from . import _lifecycle
from ._callbacks import describe_exc
from ._errors import LeakWarning

__all__ = ["CloseReport", "LiveBlock", "report", "run_close_hooks", "warn_problems"]


@dataclass(frozen=True)
class LiveBlock:
    """A block still allocated when its pool was closed."""

    device: int
    addr: int
    size: int
    requested: int
    stream: int


@dataclass(frozen=True)
class CloseReport:
    """What :meth:`MemPool.close` found and released."""

    live_blocks: list[LiveBlock] = field(default_factory=list)
    live_bytes: int = 0
    segments_freed: int = 0
    bytes_freed: int = 0


def run_close_hooks(pool: Any) -> None:
    """Run the close hooks (torch's pools, CuPy's allocator, cache scopes:
    :func:`_lifecycle.on_close`) for ``pool``; a hook's problem, or its
    exception, is warned about at the caller of ``pool.close()``."""
    for hook in _lifecycle.close_hooks():
        try:
            problem = hook(pool)
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            problem = f"{getattr(hook, '__qualname__', hook)} raised {describe_exc(exc)}"
        if isinstance(problem, str) and problem:
            warnings.warn(f"closing pool anyway: {problem}", LeakWarning, stacklevel=3)


def report(raw: dict[str, Any]) -> CloseReport:
    """The report of the engine's PoolClose answer (``{}`` when it gave none)."""
    return CloseReport(
        live_blocks=[LiveBlock(**b) for b in raw.get("live_blocks", [])],
        live_bytes=raw.get("live_bytes", 0),
        segments_freed=raw.get("segments_freed", 0),
        bytes_freed=raw.get("bytes_freed", 0),
    )


def warn_problems(label: str, problems: list[str], closed: CloseReport) -> None:
    """Warn, at the caller of ``close()``, about the ``problems`` of closing
    the pool ``label`` and the blocks it still held."""
    for problem in problems:
        warnings.warn(f"pool {label} closed, but {problem}", LeakWarning, stacklevel=3)
    if closed.live_blocks:
        warnings.warn(
            f"pool {label} closed with {len(closed.live_blocks)} live block(s), {closed.live_bytes} bytes",
            LeakWarning,
            stacklevel=3,
        )
