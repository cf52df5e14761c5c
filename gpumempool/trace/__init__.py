"""Allocation traces: a compact file format, importers from gpumempool's and
torch's recorded history, and a recorder.

A trace is the sequence of allocator *requests* a program made (allocate,
free, record_stream, stream completion, empty_cache), with stable block ids
instead of addresses, so that :func:`gpumempool.replay.replay` can feed the
same requests to a pool with another policy and compare.

File format ``gmptrace`` version 2
----------------------------------
UTF-8 text, one record per line, fields separated by one space; gzip
compressed when the file name ends in ``.gz``. The first line is the header
``gmptrace 2``, or ``gmptrace 1`` for a file without ``S`` records (version 1
is version 2 without them, so that a trace without segment addresses stays
readable by older readers, and is saved as version 1). Integers are decimal;
streams may also be written in hex (``0x...``), and are when saved. Then, in
any order:

``# text``
    a comment, ignored.
``@ {json}``
    metadata: one JSON object on one line (several are merged). Keys used:
    ``source`` (``gpumempool``, ``torch``, ``synthetic``...),
    ``recorded_by`` (the allocator whose reserved bytes the ``R`` records
    hold), ``devices``, ``notes``, and counts from the importer.
``a ID SIZE STREAM [DEVICE]``
    allocate SIZE bytes for work on STREAM (DEVICE defaults to 0); the block
    is called ID (a positive integer) until its free. An ID names one block
    at a time: it may name a new block after its free (the importers never
    reuse one; a reader that checked that ids never repeat would need
    memory for every id of the file).
``A ID SIZE STREAM [DEVICE]``
    as ``a``, made by a caller that sizes its segments itself (torch's
    caching allocator above a ``torch.cuda.MemPool`` the pool serves:
    :meth:`~gpumempool.MemPool.alloc_segment`); replayed with that call.
``f ID``
    free block ID.
``r ID STREAM``
    block ID is used on STREAM too (``Tensor.record_stream``): after its free
    it may be reused only once the work queued on STREAM up to the free has
    completed (see ``s``).
``s [STREAM]``
    the work queued so far on STREAM (every stream when omitted) has
    completed; blocks waiting on it become reusable the next time the pool
    processes its events (at its next allocation).
``e``
    ``empty_cache()``: release every wholly free cached segment.
``t KEEP [DEVICE]``
    ``trim(KEEP)``: release free segments until at most KEEP unused bytes
    stay cached (on DEVICE, every device when omitted).
``R INDEX BYTES [DEVICE]``
    reference series, not replayed: the recording allocator's reserved bytes
    on DEVICE became BYTES while it served event INDEX (0-based: the number
    of events before it; a point at INDEX 0 before any change is the start).
    Written just before that event; several may share an INDEX. Replay
    reports the peak of this series next to its own.
``S INDEX ADDR SIZE [DEVICE]``
    reference data, not replayed (version 2): while it served event INDEX the
    recording allocator obtained the segment [ADDR, ADDR+SIZE) on DEVICE
    (its ``segment_alloc``). Best fit breaks ties between free blocks of
    equal size by address, so which block a request reuses depends on where
    the device put each segment, and CUDA's addresses do not grow with each
    allocation: replay puts a segment of the same size obtained while serving
    the same event at the same place in the address order (see
    :func:`gpumempool.replay.replay`). Written just before that event, after
    its ``R`` records.

Importers
---------
:func:`from_history` converts a pool's recorded history (``pool.snapshot()``
with :meth:`~gpumempool.MemPool.record_history` on) and
:func:`from_torch_snapshot` a pickle written by
``torch.cuda.memory._record_memory_history()`` + ``_dump_snapshot()`` (or
its dict). Both read the same torch-format ``device_traces``:

* ``alloc`` / ``free_requested`` become ``a`` / ``f`` (``A`` for
  gpumempool's caller-sized allocations), with the requested size, as both
  record it. gpumempool's entries carry their pool's handle, so that a
  snapshot of several pools (``gmp.snapshot()``), whose addresses may
  repeat, keeps their blocks apart.
* A free that waited for other streams (gpumempool: its block had
  ``record_stream`` entries, which our snapshots keep beside
  ``device_traces`` under ``gpumempool_record_stream``, each with its
  place in the trace; torch, which records none: its
  ``free_completed`` did not follow at once) gets a *virtual stream*
  (``1 << 63`` plus a small number, reused once synced): ``r ID VSTREAM``
  before the free and ``s VSTREAM`` where the recording shows the free
  completed. Replays thus see each block come back exactly when the
  recording did, whatever the policy. (The real streams of gpumempool's
  ``record_stream`` entries are counted in the metadata, not kept.)
* Blocks freed in the trace but allocated before it started, and blocks
  still allocated in the snapshot's segments that the trace never mentions,
  are allocated at the start (as torch's memory_viz assumes too).
* ``segment_alloc`` / ``segment_map`` add to and ``segment_free`` /
  ``segment_unmap`` subtract from the recorded reserved bytes (``R``),
  starting from the snapshot's segments minus what the trace changed.
  ``segment_alloc`` entries also keep their address and size (``S``): the
  address order of the segments decides which of several equal free blocks
  best fit reuses. (Growths of expandable segments, ``segment_map``, are not
  kept: a replay grows its own segment in place. The segments of blocks
  allocated before the trace started have none.)
* Torch records no ``empty_cache`` call: for torch traces a run of
  segment releases that is not followed by a new segment (or an OOM) inside
  the same allocation is taken for an ``empty_cache()``. gpumempool's engine
  records its ``empty_cache`` and ``trim`` calls, however they reached the
  pool (Python, or ``torch.cuda.empty_cache()`` through the C hook), after
  the releases they made; our snapshots keep them beside ``device_traces``
  under ``gpumempool_cache_calls``, and they become ``e`` and ``t``.

Torch pickles may come from anyone: :func:`load_pickle` reads them with an
unpickler that refuses every global (so only plain dict/list/tuple/str/int/
float/bool/None/bytes survive), with size limits, and after a scan of the
opcodes and a walk of the result that refuse what is crafted to cost far
more than its size (huge memo indexes, deep nesting, cycles, shared
references that multiply the work). What they hold is checked before it is
imported: a snapshot without history is refused ("record history first"),
and so is every malformed entry or segment, named by device and index, or
with ``lenient=True`` left out and counted (``gpumempool._snapshot_check``,
the one check of a snapshot on every path to a trace).

The package, one concept per module: ``_format`` (events, records, fields,
limits), ``_reader`` (reading the text), ``_trace`` (:class:`Trace`,
:class:`TraceFile`), ``_importer`` (torch-format history to a trace, with
``_pressure`` and ``_policy`` for what the recording says of its memory
and policy) and ``_recorder`` (:class:`TraceRecorder`). Import from
``gpumempool.trace``.
"""

from __future__ import annotations

from .._safepickle import UnsafePickleError, load_pickle
from .._trace_errors import MalformedEventError, MalformedSegmentError, NoHistoryError, TraceFormatError
from ._format import (FORMAT, MAX_LINE, MAX_META_BYTES, MAX_META_DEPTH, SEGMENT_SLACK, VERSION, VERSIONS,
                      VIRTUAL_STREAM_BASE, Alloc, EmptyCache, Event, Free, PathLike, Record, RecordStream, Sync, Trim)
from ._importer import from_history, from_torch_snapshot
from ._policy import torch_allocator_policy
from ._reader import is_trace_file
from ._recorder import TraceRecorder
from ._trace import Trace, TraceFile, load_trace

__all__ = [
    "FORMAT",
    "MAX_LINE",
    "MAX_META_BYTES",
    "MAX_META_DEPTH",
    "SEGMENT_SLACK",
    "VERSION",
    "VERSIONS",
    "Alloc",
    "EmptyCache",
    "Event",
    "Free",
    "PathLike",
    "Record",
    "MalformedEventError",
    "MalformedSegmentError",
    "NoHistoryError",
    "RecordStream",
    "Sync",
    "Trace",
    "TraceFile",
    "TraceFormatError",
    "TraceRecorder",
    "Trim",
    "UnsafePickleError",
    "VIRTUAL_STREAM_BASE",
    "from_history",
    "from_torch_snapshot",
    "is_trace_file",
    "load_pickle",
    "load_trace",
    "torch_allocator_policy",
]
