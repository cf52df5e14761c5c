"""``gmp.torch.oom_doctor()``: one call at start-up, and an out-of-memory
error says which allocator setting would have fit (see
:mod:`gpumempool._oom_doctor`)."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from .. import _oom_snapshot
from .._oom_snapshot import OomSnapshots

#: The directory ``oom_doctor()`` writes to without one (in the current
#: directory when it is called).
DEFAULT_DIRECTORY = "gpumempool-oom"
#: The history torch keeps for the doctor: the latest entries (a replay of
#: a history that starts mid-run begins from the state the snapshot gives).
HISTORY_ENTRIES = 100_000


def oom_doctor(directory: Any = None, *, time_limit_s: float = 30.0, max_snapshots: int = 1,
               record_history: bool = True) -> OomSnapshots:
    """Install the out-of-memory doctor: when this process runs out of memory
    (torch's CUDA caching allocator, or a gpumempool pool), its snapshot is
    written to ``directory`` (default ``./gpumempool-oom``), as
    :func:`gpumempool.distributed.snapshot_on_oom` writes it, and its
    allocator history is replayed under each setting torch accepts, for at
    most ``time_limit_s`` seconds, in the memory the run failed in. One
    line goes to stderr beside torch's error::

        gpumempool: with PYTORCH_ALLOC_CONF=expandable_segments:True this run peaks at 61.2 GiB < 79.1 GiB: ...

    and the full answer beside the snapshot (``...-tune.json``, ``...-tune.txt``).
    The error itself reaches the program unchanged; a failure of the doctor
    is one line too.

    ``record_history`` turns on the history it needs: torch's
    (``torch.cuda.memory._record_memory_history(context=None,
    max_entries=100_000)``, which keeps no stacks, where torch is imported
    and has CUDA; pass ``record_history=False`` to keep a recording of your
    own) and every pool's (:func:`gpumempool.record_history`, where it is
    off). Call it after ``import torch``.

    Calling it again with the same arguments keeps the doctor installed and
    returns it; ``.close()`` removes it and stops the history it turned on.
    Returns the :class:`~gpumempool.distributed.OomSnapshots`, whose
    ``diagnoses`` list what the doctor found
    (:class:`gpumempool.distributed.Diagnosis`: the line, the files, the
    setting and its peak)."""
    path = os.fspath(DEFAULT_DIRECTORY if directory is None else directory)
    stops: list[Callable[[], None]] = []

    def stop_history() -> None:  # the history the doctor turned on stops with it
        for stop in stops:
            stop()

    doctor, new = _oom_snapshot.install(path, max_snapshots, time_limit_s, doctor_hint=True, keep_same=True,
                                        on_close=stop_history)
    if new and record_history:
        stops.append(_record_history())
    return doctor


def _record_history() -> Callable[[], None]:
    """Turn on the history the doctor needs; returns what turns off the
    part of it that was turned on here."""
    from .. import _snapshot

    pools = _snapshot.history_settings() is None
    if pools:
        _snapshot.record_history(True)
    torch = sys.modules.get("torch")
    recording = False
    try:
        if torch is not None and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(context=None, max_entries=HISTORY_ENTRIES)
            recording = True
    except Exception:  # noqa: BLE001 - no history: the doctor says so when it would be needed
        pass

    def stop() -> None:
        try:
            if pools and _snapshot.history_settings() is not None:
                _snapshot.record_history(False)
            if recording and torch is not None:
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:  # noqa: BLE001,S110 - closing must not raise
            pass

    return stop


__all__ = ["DEFAULT_DIRECTORY", "HISTORY_ENTRIES", "oom_doctor"]
