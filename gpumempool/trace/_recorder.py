"""Recording a pool's allocator requests as a :class:`Trace`."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

from .._snapshot import CACHE_CALLS_KEY, RECORD_STREAM_KEY
from ._importer import check_pool_history, convert
from ._policy import describe_pool
from ._trace import Trace

if TYPE_CHECKING:
    from .._pool import MemPool

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Record a pool's allocator requests as a :class:`Trace`::

        with TraceRecorder(pool) as rec:
            ... # allocate and free
        rec.trace.save("run.trace.gz")

    Turns the pool's history on (dropping what it recorded before) and back
    off on exit (or to the settings of :func:`gpumempool.record_history`).
    The engine's history holds the ``empty_cache`` and ``trim`` calls
    however they reached the pool (Python, or torch's
    ``torch.cuda.empty_cache()`` through the C hook), so the pool is left as
    it is. ``max_entries`` bounds the engine's history ring; a warning says
    when it overflowed.
    """

    def __init__(self, pool: "MemPool", max_entries: int = 10_000_000) -> None:
        self.pool = pool
        self.max_entries = max_entries
        self.trace: Optional[Trace] = None

    def __enter__(self) -> "TraceRecorder":
        self.pool.record_history(True, max_entries=self.max_entries)
        return self

    def __exit__(self, *exc: Any) -> None:
        from .._snapshot import history_settings

        pool = self.pool
        if pool.closed:
            if exc and exc[0] is not None:
                return  # don't hide the exception that closed it
            raise RuntimeError("TraceRecorder: the pool was closed inside the block; its history is gone")
        snap = pool.snapshot()
        # every entry of the ring: those the snapshot keeps aside too
        # (record_stream, empty_cache, trim)
        n = sum(len(t) for key in ("device_traces", RECORD_STREAM_KEY, CACHE_CALLS_KEY) for t in snap.get(key, ()))
        if n >= self.max_entries:
            warnings.warn(f"TraceRecorder: the history ring ({self.max_entries} entries) overflowed; "
                          "the trace lacks the first events (raise max_entries)", RuntimeWarning, stacklevel=2)
        self.trace = convert(check_pool_history(snap), source="gpumempool", infer_empty_cache=False)
        describe_pool(self.trace, pool)
        settings = history_settings()
        if settings is None:
            pool.record_history(False)
        else:
            pool.record_history(True, max_entries=settings[0], stacks=settings[1])
