"""The errors of reading a trace or a snapshot's history, in a module below
:mod:`gpumempool.trace` and the snapshot checks that raise them (which
gpumempool.trace imports). Import them from gpumempool.trace."""

from __future__ import annotations

from typing import Optional

__all__ = ["MalformedEventError", "MalformedSegmentError", "NoHistoryError", "TraceFormatError"]

#: How to record what a replay needs, as the refusals say it.
RECORD_HISTORY = "record history first: torch.cuda.memory._record_memory_history()"


class TraceFormatError(ValueError):
    """A trace file (or history) that cannot be read."""


class NoHistoryError(TraceFormatError):
    """A snapshot with no allocation history to replay: read from ``file``,
    refused for ``reason``."""

    def __init__(self, file: str, reason: str) -> None:
        self.file = file
        self.reason = reason
        super().__init__(f"{file}: no allocation history to replay ({reason}): {RECORD_HISTORY}")


class MalformedEventError(TraceFormatError):
    """An entry of a snapshot's ``device_traces`` that cannot be imported:
    entry ``index`` of device ``device`` in ``file``, whose action is
    ``action`` (None when the entry has none)."""

    def __init__(self, file: str, device: int, index: int, action: Optional[str], reason: str) -> None:
        self.file = file
        self.device = device
        self.index = index
        self.action = action
        self.reason = reason
        if action is None:
            what = ""
        else:  # untrusted text: an odd one quoted, a long one cut
            what = f" ({action})" if action.isidentifier() and len(action) <= 40 else f" ({action[:40]!r})"
        super().__init__(f"{file}: device {device} event {index}{what}: {reason}")


class MalformedSegmentError(TraceFormatError):
    """A snapshot of ``file`` whose ``segments`` are missing, or one of them
    (number ``index``; None for the list as a whole) that cannot be
    imported."""

    def __init__(self, file: str, index: Optional[int], reason: str) -> None:
        self.file = file
        self.index = index
        self.reason = reason
        super().__init__(f"{file}: segment {index}: {reason}" if index is not None else f"{file}: {reason}")
