"""What the commands share: the command's name and its error line, JSON and table output,
argument types, and reading a trace or snapshot with the options that go with it."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import zlib
from typing import Any, Callable, Optional, TypeVar

from .._units import format_bytes

_Number = TypeVar("_Number", int, float)


def file_kind(path: str) -> str:
    """``"trace"`` or ``"snapshot"`` by content (and, for pickles, by
    extension); ValueError naming the file when it is neither."""
    from ..trace import is_trace_file

    if is_trace_file(path):
        return "trace"
    with open(path, "rb") as f:
        head = f.read(2)
        if head == b"\x1f\x8b":  # what the gzip holds decides
            f.seek(0)
            try:
                with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                    head = gz.read(8)
            except (OSError, EOFError, zlib.error) as exc:
                raise ValueError(f"{path}: corrupt gzip data: {str(exc)[:200] or type(exc).__name__}") from None
            inner = "gzip data that"
        else:
            inner = "it"
    if head[:1] == b"\x80":
        return "snapshot"
    if path.endswith((".pickle", ".pkl", ".pickle.gz", ".pkl.gz")):
        return "snapshot"  # the safe loader says what is wrong with it
    raise ValueError(f"{path}: neither a gmptrace file nor a snapshot pickle: {inner} starts with {head!r} (a gmptrace "
                     "file starts with 'gmptrace', a snapshot pickle with byte 0x80; --format forces one)")


def load_trace(path: str, args: argparse.Namespace) -> Any:
    """A gmptrace file (read as a stream: :class:`~gpumempool.trace.TraceFile`),
    or a torch (or gpumempool) snapshot pickle with history."""
    from .._progress import Progress
    from ..trace import TraceFile, from_torch_snapshot

    kind = args.format
    if kind == "auto":
        kind = file_kind(path)
    if kind == "trace":
        # The bar follows the bytes read; it is closed (its line ended) before any error is printed.
        with Progress("load", unit="B", enabled=not (args.json or args.no_progress)) as bar:
            return TraceFile(path, progress=bar)
    return from_torch_snapshot(path, infer_empty_cache=not args.no_infer_empty_cache, lenient=args.lenient)


def skipped(trace: Any) -> Optional[tuple[str, str]]:
    """What --lenient left out of a snapshot: how many, for a table, and
    the sentence with the first reason; None when nothing."""
    meta = trace.meta
    kinds = (("skipped_events", "malformed event"), ("skipped_segments", "malformed segment"))
    counts = " and ".join(f"{meta[k]:,} {what}{'s' if meta[k] != 1 else ''}" for k, what in kinds if meta.get(k))
    if not counts:  # at most the snapshot's missing segments, taken as none
        first = meta.get("first_skipped")
        return ("no segments (--lenient)", f"--lenient: {first}: taken as none") if first else None
    return f"{counts} (--lenient)", f"--lenient left out {counts}; the first: {meta.get('first_skipped')}"


def prog() -> str:
    """The command's name as the user typed it: the console script
    ``gpumempool``, else ``python -m gpumempool``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "gpumempool" if name == "gpumempool" else "python -m gpumempool"


def fail(message: str, code: int = 1, *, json_out: bool = False, name: Optional[str] = None) -> int:
    """Report an error the usual way (stderr, exit status ``code``, the line
    starting with ``name``, by default the command's :func:`prog`); with
    ``json_out``, also print ``{"error": message}`` on stdout, so that a
    ``--json`` caller always gets JSON."""
    print(f"{name or prog()}: error: {message}", file=sys.stderr)
    if json_out:
        print(json.dumps({"error": message, "exit_code": code}, indent=2))
    return code


def _finite(obj: Any, depth: int = 0) -> Any:
    """``obj`` with non-finite floats (NaN, infinities: not JSON) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if depth > 64:
        return None
    if isinstance(obj, dict):
        return {k: _finite(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v, depth + 1) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """Standard JSON only (``json.dumps`` would write NaN and Infinity)."""
    print(json.dumps(_finite(obj), indent=2, allow_nan=False))


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    return "\n".join([line] + [f"| {k.ljust(width)} | {v.ljust(vwidth)} |" for k, v in rows] + [line])


def oom_capacity(trace: Any) -> Optional[int]:
    """The device a recorded run ran out of memory on (the replay's, as
    inferred from the recording), or None when it did not run out."""
    cond = trace.meta.get("recorded_conditions")
    if not trace.meta.get("recorded_ooms") or not isinstance(cond, dict):
        return None
    cap = cond.get("capacity")
    return cap if type(cap) is int and cap > 0 else None


def oom_rows(trace: Any, result: Any, top: int) -> list[str]:
    """For a run that ran out of memory: whether each setting shown would
    have fit the device it failed on."""
    cap = oom_capacity(trace)
    if cap is None:
        return []
    lines = [f"would have fit in {format_bytes(cap)} (the device it failed on):"]
    for _, c in result.rows(top):
        conf = f"{result.env_var}={c.alloc_conf}" if c.alloc_conf else \
            ("torch's defaults" if c.alloc_conf == "" else c.describe())
        lines.append(f"  {'yes' if c.fits else 'no '}  {conf}: {format_bytes(c.peak_reserved)} peak reserved"
                     + ("" if c.fits else f", {c.result.ooms:,} allocation(s) fail"))
    return lines


def _converted(text: str, convert: Callable[[str], _Number], expected: str) -> _Number:
    """``convert(text)``, or the argparse error saying what was ``expected``
    (argparse itself would name the type function: "invalid positive value")."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text[:40]!r}") from None


def positive(text: str) -> int:
    value = _converted(text, int, "a positive whole number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def size_arg(text: str) -> int:
    from ..replay import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be more than 0 bytes")
    return value


def fraction_arg(text: str) -> float:
    value = _converted(text, float, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text[:40]!r}")
    return value


def trace_input_options(cmd: argparse.ArgumentParser) -> None:
    """The options of the commands that read a trace: its format, torch
    snapshots' empty_cache inference and malformed entries, the progress
    bar, JSON output."""
    cmd.add_argument("--format", choices=("auto", "trace", "snapshot"), default="auto",
                     help="input format (default: by extension and content)")
    cmd.add_argument("--no-infer-empty-cache", action="store_true",
                     help="torch snapshots: do not treat released segments outside an allocation as empty_cache()")
    cmd.add_argument("--lenient", action="store_true",
                     help="snapshots: leave out malformed history entries and segments, and say how many, instead "
                     "of refusing the file (a snapshot without history is refused all the same)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmd.add_argument("--json", action="store_true", help="print the result as JSON")
