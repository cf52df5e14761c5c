"""Reading gmptrace text: each line checked as it is read (syntax, the
block-id rule, the limits), plain or gzip, yielding one record at a time."""

from __future__ import annotations

import gzip
import io
import os
import zlib
from typing import Any, Callable, Iterator, Optional

from .._trace_errors import TraceFormatError
from ._format import (FORMAT, MAX_LINE, MAX_META_BYTES, PROGRESS_LINES, SEGMENT_SLACK, VERSION, VERSIONS, Alloc, Checker,
                      EmptyCache, Free, Meta, PathLike, Record, RecordStream, Sync, Trim, parse_device, parse_id,
                      parse_meta, parse_size, parse_u64)

__all__ = ["file_records", "is_trace_file", "records"]


def records(f: Any, name: str, max_events: int, tick: Optional[Callable[[], None]] = None,
             checker: Optional[Checker] = None, events: bool = True) -> Iterator[Record]:
    """The records of a gmptrace text stream, each checked as its line is
    read: the syntax, the block-id rule of :class:`Checker` and the limits
    (``max_events`` events, and as many ``R`` records; ``S`` records at most
    one per event so far plus :data:`SEGMENT_SLACK`). An error is raised at
    the line that makes it, naming the line. Holds one line at a time; the
    caller decides what to keep. Without ``events``, an event is yielded as
    its record letter (a pass that only counts them skips building objects,
    most of the time a line takes). ``tick()`` is called every
    :data:`PROGRESS_LINES` lines. ``checker`` is left with the blocks
    allocated at the end, the peak of their bytes and the devices used."""
    readline = f.readline
    header = readline(MAX_LINE + 1).rstrip("\n").split()
    if len(header) != 2 or header[0] != FORMAT:
        raise TraceFormatError(f"{name}: not a {FORMAT} file (first line must be '{FORMAT} {VERSION}')")
    if header[1] not in [str(v) for v in VERSIONS]:
        raise TraceFormatError(f"{name}: {FORMAT} version {header[1][:20]} is not supported "
                               f"(this reader: {VERSION})")
    v1 = header[1] == "1"
    check = checker if checker is not None else Checker()
    # The checker's rule, inlined: a call per line would cost a fifth of the time.
    live = check.live
    cur, peak, devices = check.cur, check.peak, check.devices
    nev = nref = nseg = meta_bytes = 0
    lineno = 1
    ev: Any
    while True:
        line = readline(MAX_LINE + 1)
        if not line:
            break
        lineno += 1
        if len(line) > MAX_LINE:
            raise TraceFormatError(f"{name}:{lineno}: line longer than {MAX_LINE >> 20} MiB")
        if tick is not None and lineno % PROGRESS_LINES == 0:
            tick()
        parts = line.split()
        if not parts:
            continue
        op = parts[0]
        why = None
        try:
            n = len(parts)
            if (op == "a" or op == "A") and 4 <= n <= 5:
                bid, size, stream, dev = parse_id(parts[1]), parse_size(parts[2]), parse_u64(parts[3]), parse_device(parts[4]) if n == 5 else 0
                if bid in live:
                    why = f"block {bid} allocated twice (no free in between)"
                else:
                    live[bid] = size
                    cur += size
                    if cur > peak:
                        peak = cur
                    if dev >= devices:
                        devices = dev + 1
                ev = Alloc(bid, size, stream, dev, op == "A") if events else op
            elif op == "f" and n == 2:
                bid = parse_id(parts[1])
                size = live.pop(bid, -1)
                if size < 0:
                    why = f"free of block {bid}, which is not allocated"
                else:
                    cur -= size
                ev = Free(bid) if events else op
            elif op == "r" and n == 3:
                bid, stream = parse_id(parts[1]), parse_u64(parts[2])
                if bid not in live:
                    why = f"record_stream of block {bid}, which is not allocated"
                ev = RecordStream(bid, stream) if events else op
            elif op == "s" and n <= 2:
                ev = Sync(parse_u64(parts[1]) if n == 2 else None) if events else op
            elif op == "e" and n == 1:
                ev = EmptyCache() if events else op
            elif op == "t" and 2 <= n <= 3:
                ev = Trim(parse_u64(parts[1]), parse_device(parts[2]) if n == 3 else None) if events else op
            elif op == "R" and 3 <= n <= 4:
                nref += 1
                if nref > max_events:
                    raise TraceFormatError(f"{name}:{lineno}: more than {max_events} R records (raise max_events)")
                yield (parse_u64(parts[1]), parse_device(parts[3]) if n == 4 else 0, parse_u64(parts[2]))
                continue
            elif op == "S" and 4 <= n <= 5 and not v1:
                nseg += 1
                if nseg > max_events:
                    raise TraceFormatError(f"{name}:{lineno}: more than {max_events} S records (raise max_events)")
                if nseg > nev + SEGMENT_SLACK:
                    raise TraceFormatError(f"{name}:{lineno}: {nseg} S records before event {nev}: more than one "
                                           f"per event plus {SEGMENT_SLACK} (each comes just before its event)")
                yield (parse_u64(parts[1]), parse_device(parts[4]) if n == 5 else 0, parse_u64(parts[2]), parse_size(parts[3]))
                continue
            elif op == "@":
                meta_bytes += len(line)
                if meta_bytes > MAX_META_BYTES:
                    raise TraceFormatError(f"{name}:{lineno}: metadata lines total more than "
                                           f"{MAX_META_BYTES >> 20} MiB")
                yield Meta(parse_meta(line[1:]))
                continue
            elif op.startswith("#"):
                continue
            elif op == "S" and v1:
                raise ValueError(f"S records need {FORMAT} 2 (this file says version 1)")
            else:
                raise ValueError(f"unknown record {op!r} with {n - 1} field(s)")
        except ValueError as exc:
            if isinstance(exc, TraceFormatError):
                raise
            raise TraceFormatError(f"{name}:{lineno}: {exc}: {line.strip()[:80]!r}") from None
        if why is not None:
            raise TraceFormatError(f"{name}:{lineno}: event {nev}: {why}")
        nev += 1
        if nev > max_events:
            raise TraceFormatError(f"{name}:{lineno}: more than {max_events} events (raise max_events)")
        yield ev
    check.cur, check.peak, check.devices = cur, peak, devices
    if tick is not None:
        tick()


def file_records(p: str, max_events: int, progress: Optional[Callable[[int, int], None]] = None,
                  checker: Optional[Checker] = None, events: bool = True) -> Iterator[Record]:
    """:func:`records` of the file ``p`` (gzip or not, detected by
    content), with unreadable data reported as :class:`TraceFormatError`
    naming the file. ``progress(bytes_read, file_size)`` follows the
    (compressed) bytes read."""
    with open(p, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        magic = raw.read(2)
        raw.seek(0)
        stream: Any = gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw
        tick = None if progress is None else (lambda: progress(min(raw.tell(), size), size))
        try:
            if stream.peek(1)[:1] == b"\x80":  # PROTO: a pickle (plain or gzip), not text
                raise TraceFormatError(
                    f"{p}: a pickle (a memory snapshot?), not a {FORMAT} file: import a snapshot with "
                    "gpumempool.from_torch_snapshot(path), which loads it safely")
            with io.TextIOWrapper(stream, encoding="utf-8", newline="\n") as f:
                yield from records(f, p, max_events, tick, checker, events)
        except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:  # corrupt gzip or text
            what = "corrupt gzip data: " if isinstance(exc, (zlib.error, EOFError, gzip.BadGzipFile)) else ""
            raise TraceFormatError(f"{p}: not a readable {FORMAT} file: {what}"
                                   f"{str(exc)[:200] or type(exc).__name__}") from None



def is_trace_file(path: PathLike) -> bool:
    """Whether ``path`` starts like a gmptrace file (plain or gzip)."""
    try:
        with open(os.fspath(path), "rb") as raw:
            head = raw.read(2)
            raw.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                    head = gz.read(len(FORMAT))
            else:
                head = raw.read(len(FORMAT))
    except (OSError, EOFError, zlib.error):  # unreadable, or a corrupt gzip stream
        return False
    return head == FORMAT.encode()
