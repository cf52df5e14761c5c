"""Plots of a memory snapshot (ours or torch's): requested vs reserved bytes
over the recorded history, and a segment map (one bar per segment, its
blocks coloured by state).

Needs matplotlib, an optional extra (``pip install 'gpumempool[plot]'``);
without it :func:`plot_snapshot` raises :class:`MissingDependencyError`.
Snapshot pickles are read with :func:`gpumempool.trace.load_pickle`, which
refuses anything but plain data.
"""

from __future__ import annotations

import heapq
import math
import os
from typing import Any, Callable, Optional, Union

from ._units import format_bytes
from .trace import PathLike, TraceFormatError, load_pickle

__all__ = ["MissingDependencyError", "plot_ranks", "plot_snapshot", "rank_snapshots", "timeline"]

STATE_COLORS = {
    "active_allocated": "#1f77b4",
    "active_pending_free": "#ff7f0e",
    "inactive": "#d9d9d9",
}
STATE_LABELS = {
    "active_allocated": "allocated",
    "active_pending_free": "freed, waiting for other streams",
    "inactive": "free (cached)",
}


class MissingDependencyError(ImportError):
    """An optional dependency (matplotlib) is not installed."""


def require_matplotlib() -> Any:
    """``(matplotlib, Figure)``; :class:`MissingDependencyError`, saying how
    to install it, where matplotlib is missing (the CLI asks before it reads
    a file)."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            "plotting needs matplotlib, an optional extra: pip install 'gpumempool[plot]' "
            "(or pip install matplotlib)"
        ) from exc
    return matplotlib, Figure


def _load(snapshot: Union[PathLike, dict[str, Any]]) -> dict[str, Any]:
    snap = snapshot if isinstance(snapshot, dict) else load_pickle(snapshot)
    if not isinstance(snap, dict) or not isinstance(snap.get("segments", []), list):
        raise TraceFormatError("not a memory snapshot (a dict with 'segments' and 'device_traces')")
    traces = snap.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceFormatError("snapshot device_traces must be a list of lists")
    # A crafted pickle repeats one list or entry to multiply the work.
    seen: set[int] = set()
    for d, t in enumerate(traces):
        for obj in (t, *(e for e in t if isinstance(e, dict))):
            if id(obj) in seen:
                raise TraceFormatError(f"device_traces[{d}] repeats an object shared with an earlier entry")
            seen.add(id(obj))
    return snap


def _int(v: Any) -> int:
    """A 64-bit unsigned int field, 0 when missing or out of range."""
    return v if type(v) is int and 0 <= v < 1 << 64 else 0


def _time(e: Any) -> int:
    """An entry's time_us, 0 when missing or not a finite number."""
    t = e.get("time_us", 0) if isinstance(e, dict) else 0
    if type(t) is int:
        return t
    if type(t) is float and math.isfinite(t):
        return int(t)
    return 0


def timeline(snapshot: Union[PathLike, dict[str, Any]],
             progress: Optional[Callable[[int, int], None]] = None) -> dict[str, list[int]]:
    """Requested and reserved bytes (all devices) after each history entry:
    ``{"requested": [...], "reserved": [...], "time_us": [...]}``, starting
    from the state before the first entry (derived from the segments at the
    end minus what the history changed). A block counts from its ``alloc``
    to its ``free_requested`` (its ``free_completed`` when the history has
    no request), with the size the history holds, the requested one
    (torch's and ours): the bytes the program held, whose peak ``replay``
    calls ``peak_requested`` too (a block freed while other streams use it
    stops counting at the free, though it stays reserved until they
    finish)."""
    snap = _load(snapshot)
    traces = snap.get("device_traces", [])
    merged = list(heapq.merge(*[[(_time(e), d, i, e)
                                 for i, e in enumerate(t)] for d, t in enumerate(traces)], key=lambda x: x[0]))
    entries = [(t, d, e) for t, d, _, e in merged if isinstance(e, dict)]
    sizes: dict[tuple[int, int, Any], int] = {}
    requested_free: set[tuple[int, int, Any]] = set()  # freed, completion to come
    d_alloc = d_res = 0
    steps: list[tuple[int, int]] = []
    total = len(entries)
    for n, (_, d, e) in enumerate(entries):
        a = e.get("action")
        k = (d, _int(e.get("addr")), e.get("gpumempool_pool_handle", e.get("pool_handle")))  # merged pools reuse addresses
        size = _int(e.get("size"))
        da = dr = 0
        if a == "alloc":
            sizes[k] = size
            da = size
        elif a == "free_requested":
            da = -sizes.pop(k, size)
            requested_free.add(k)
        elif a == "free_completed":
            if k in requested_free:
                requested_free.discard(k)  # counted at the request
            else:
                da = -sizes.pop(k, size)
        elif a in ("segment_alloc", "segment_map"):
            dr = size
        elif a in ("segment_free", "segment_unmap"):
            dr = -size
        d_alloc += da
        d_res += dr
        steps.append((d_alloc, d_res))
        if progress is not None and (n + 1) % 50_000 == 0:
            progress(n + 1, total)
    end_alloc = end_res = 0
    for s in snap.get("segments", []):
        if not isinstance(s, dict):
            continue
        end_res += _int(s.get("total_size"))
        for b in s.get("blocks", []) if isinstance(s.get("blocks"), list) else []:
            # a pending free was requested: the program no longer holds it
            if isinstance(b, dict) and b.get("state") == "active_allocated":
                # history entries hold requested sizes, ours as torch's
                end_alloc += _int(b.get("requested_size")) or _int(b.get("size"))
    if snap.get("segments"):
        base_alloc = max(0, end_alloc - d_alloc)
        base_res = max(0, end_res - d_res)
    else:  # no segments: start from zero, lifted so nothing goes negative
        base_alloc = max(0, -min([a for a, _ in steps] + [0]))
        base_res = max(0, -min([r for _, r in steps] + [0]))
    if progress is not None:
        progress(total, total)
    return {
        "requested": [base_alloc] + [base_alloc + a for a, _ in steps],
        "reserved": [base_res] + [base_res + r for _, r in steps],
        "time_us": [entries[0][0] if entries else 0] + [t for t, _, _ in entries],
    }


def _downsample(values: list[int], points: int) -> tuple[list[int], list[int]]:
    """At most ``points`` (x, max-of-bucket) pairs, so peaks stay visible."""
    n = len(values)
    if n <= points:
        return list(range(n)), values
    step = n / points
    xs, ys = [], []
    for i in range(points):
        lo, hi = int(i * step), max(int((i + 1) * step), int(i * step) + 1)
        xs.append(lo)
        ys.append(max(values[lo:hi]))
    return xs, ys


def _fmt_bytes(n: float) -> str:
    return format_bytes(n, digits=1)


def _byte_step(top: float) -> float:
    """A power-of-two tick step giving 4 to 8 ticks up to ``top`` bytes."""
    step = 1.0
    while top / step > 8:
        step *= 2
    return step


def plot_snapshot(
    snapshot: Union[PathLike, dict[str, Any]],
    out: PathLike,
    *,
    title: Optional[str] = None,
    max_segments: int = 120,
    progress: Optional[Callable[[int, int], None]] = None,
    dpi: int = 110,
) -> dict[str, Any]:
    """Draw ``snapshot`` (a pickle path, ours or torch's, or the dict) to
    ``out`` (PNG, or any format matplotlib knows by the extension): a
    timeline of requested vs reserved bytes over the recorded history and a
    segment map of the segments at the end (at most ``max_segments``, the
    largest). Returns a summary (peaks, counts, output path); its figures
    have the names ``replay`` and ``demo`` give them
    (:data:`gpumempool._summary.FIGURES`): the history holds requested
    sizes, so the peak is ``peak_requested``."""
    _, Figure = require_matplotlib()
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    snap = _load(snapshot)
    tl = timeline(snap, progress=progress)
    segments = [s for s in snap.get("segments", []) if isinstance(s, dict) and _int(s.get("total_size")) > 0]
    segments.sort(key=lambda s: (_int(s.get("device")), _int(s.get("address"))))
    shown = segments
    if len(segments) > max_segments:
        keep = sorted(segments, key=lambda s: -_int(s.get("total_size")))[:max_segments]
        ids = {id(s) for s in keep}
        shown = [s for s in segments if id(s) in ids]

    fig = Figure(figsize=(12, 8.5), layout="constrained")
    ax_t, ax_s = fig.subplots(2, 1, height_ratios=[1, 1.3])
    byte_fmt = FuncFormatter(lambda v, _pos: _fmt_bytes(v))

    events = len(tl["requested"]) - 1
    if events > 0:
        xs, ys = _downsample(tl["reserved"], 4000)
        ax_t.fill_between(xs, ys, step="post", color="#ffbb78", alpha=0.6, label="reserved (segments)")
        ax_t.plot(xs, ys, drawstyle="steps-post", color="#ff7f0e", linewidth=1)
        xs, ys = _downsample(tl["requested"], 4000)
        ax_t.fill_between(xs, ys, step="post", color="#aec7e8", alpha=0.8, label="requested (live blocks)")
        ax_t.plot(xs, ys, drawstyle="steps-post", color="#1f77b4", linewidth=1)
        ax_t.set_xlim(0, events)
        ax_t.set_ylim(bottom=0)
        ax_t.legend(loc="upper left")
    else:
        ax_t.text(0.5, 0.5, "no history recorded\n(record_history() / torch.cuda.memory._record_memory_history())",
                  ha="center", va="center", transform=ax_t.transAxes, color="gray")
    ax_t.yaxis.set_major_formatter(byte_fmt)
    ax_t.yaxis.set_major_locator(MultipleLocator(_byte_step(max(tl["reserved"] + tl["requested"] + [1]))))
    ax_t.set_xlabel("allocator events")
    peak_q, peak_r = max(tl["requested"]), max(tl["reserved"])
    ratio = f", peak reserved / peak requested {peak_r / peak_q:.3f}" if peak_q else ""
    ax_t.set_title(f"requested vs reserved: peaks {_fmt_bytes(peak_q)} / {_fmt_bytes(peak_r)}{ratio}")

    blocks = 0
    for row, s in enumerate(shown):
        off = 0
        spans: list[tuple[int, int]] = []
        colors: list[str] = []
        for b in s.get("blocks", []) if isinstance(s.get("blocks"), list) else []:
            if not isinstance(b, dict):
                continue
            size = _int(b.get("size"))
            spans.append((off, size))
            state = b.get("state")
            colors.append(STATE_COLORS.get(state if isinstance(state, str) else "", "#9467bd"))
            off += size
            blocks += 1
        total = _int(s.get("total_size"))
        if off < total:  # blocks missing from the snapshot
            spans.append((off, total - off))
            colors.append("#ffffff")
        ax_s.broken_barh(spans, (row - 0.4, 0.8), facecolors=colors, edgecolor="black", linewidth=0.2)
    ax_s.xaxis.set_major_formatter(byte_fmt)
    ax_s.xaxis.set_major_locator(MultipleLocator(_byte_step(max([_int(s.get("total_size")) for s in shown] + [1]))))
    ax_s.set_xlabel("offset in segment")
    ax_s.invert_yaxis()
    if shown and len(shown) <= 40:
        ax_s.set_yticks(range(len(shown)))
        ax_s.set_yticklabels([f"d{_int(s.get('device'))} {_int(s.get('address')):#x}" for s in shown], fontsize=7)
    else:
        ax_s.set_ylabel("segments")
        ax_s.set_yticks([])
    if not shown:
        ax_s.text(0.5, 0.5, "no segments", ha="center", va="center", transform=ax_s.transAxes, color="gray")
    more = f" (the {len(shown)} largest of {len(segments)})" if len(shown) < len(segments) else ""
    reserved = sum(_int(s.get("total_size")) for s in segments)
    ax_s.set_title(f"segment map: {len(segments)} segments, {_fmt_bytes(reserved)} reserved{more}")
    ax_s.legend(handles=[Patch(facecolor=c, edgecolor="black", label=STATE_LABELS[k]) for k, c in STATE_COLORS.items()],
                loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    out_path = os.fspath(out)
    # The format from the extension, PNG without one: given explicitly, so
    # that matplotlib writes out_path itself (it would add ".png").
    ext = os.path.splitext(out_path)[1].lstrip(".").lower()
    fig.savefig(out_path, dpi=dpi, format=ext or "png")
    return {
        "output": out_path,
        "events": events,
        "segments": len(segments),
        "segments_shown": len(shown),
        "blocks": blocks,
        "peak_requested": peak_q,
        "peak_reserved": peak_r,
        "reserved_at_end": reserved,
    }


def rank_snapshots(directory: PathLike) -> list[tuple[int, str]]:
    """The per-rank snapshots in ``directory`` (``rankNNNNN.pickle``, as
    :func:`gpumempool.distributed.dump_snapshots` writes them), as
    ``(rank, path)`` in rank order. Raises :class:`TraceFormatError` when
    there are none."""
    d = os.fspath(directory)
    found = []
    for name in os.listdir(d):
        stem, ext = os.path.splitext(name)
        if ext == ".pickle" and stem.startswith("rank") and stem[4:].isdigit():
            found.append((int(stem[4:]), os.path.join(d, name)))
    if not found:
        raise TraceFormatError(f"{d}: no rank snapshots (rankNNNNN.pickle, from gpumempool.distributed."
                               "dump_snapshots) in this directory")
    return sorted(found)


def plot_ranks(
    directory: PathLike,
    out: PathLike,
    *,
    title: Optional[str] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    dpi: int = 110,
) -> dict[str, Any]:
    """Draw the ranks of ``directory`` side by side (see
    :func:`rank_snapshots`): one timeline of requested vs reserved bytes per
    rank, on one byte scale, and a bar per rank of its peaks, so the rank
    that peaks stands out. Returns a summary: per rank its peaks and
    reserved bytes at the end, and the rank with the highest reserved peak."""
    _, Figure = require_matplotlib()
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    ranks = rank_snapshots(directory)
    lines: list[tuple[int, dict[str, list[int]], int]] = []
    for i, (rank, path) in enumerate(ranks):
        try:
            snap = _load(path)
        except (TraceFormatError, ValueError, OSError) as exc:
            raise TraceFormatError(f"{path}: {exc}") from None
        end = sum(_int(s.get("total_size")) for s in snap.get("segments", []) if isinstance(s, dict))
        lines.append((rank, timeline(snap), end))
        if progress is not None:
            progress(i + 1, len(ranks))
    n = len(lines)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig = Figure(figsize=(4 * cols, 2.8 * rows + 3), layout="constrained")
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[1] * rows + [1.1])
    byte_fmt = FuncFormatter(lambda v, _pos: _fmt_bytes(v))
    top = max([max(tl["reserved"] + tl["requested"]) for _, tl, _ in lines] + [1])
    summary = []
    for i, (rank, tl, end) in enumerate(lines):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        events = len(tl["requested"]) - 1
        peak_q, peak_r = max(tl["requested"]), max(tl["reserved"])
        if events > 0:
            for key, fill, edge in (("reserved", "#ffbb78", "#ff7f0e"), ("requested", "#aec7e8", "#1f77b4")):
                xs, ys = _downsample(tl[key], 1500)
                ax.fill_between(xs, ys, step="post", color=fill, alpha=0.7)
                ax.plot(xs, ys, drawstyle="steps-post", color=edge, linewidth=0.8)
            ax.set_xlim(0, events)
        else:
            ax.text(0.5, 0.5, "no history", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_ylim(0, top * 1.05)
        ax.yaxis.set_major_formatter(byte_fmt)
        ax.yaxis.set_major_locator(MultipleLocator(_byte_step(top)))
        ax.set_title(f"rank {rank}: peaks {_fmt_bytes(peak_q)} / {_fmt_bytes(peak_r)}", fontsize=9)
        summary.append({"rank": rank, "events": events, "peak_requested": peak_q, "peak_reserved": peak_r,
                        "reserved_at_end": end})
    ax_b = fig.add_subplot(grid[rows, :])
    xs = list(range(n))
    ax_b.bar([x - 0.2 for x in xs], [r["peak_requested"] for r in summary], width=0.4, color="#1f77b4",
             label="peak requested")
    ax_b.bar([x + 0.2 for x in xs], [r["peak_reserved"] for r in summary], width=0.4, color="#ff7f0e",
             label="peak reserved")
    ax_b.set_xticks(xs)
    ax_b.set_xticklabels([f"rank {r['rank']}" for r in summary], fontsize=8)
    ax_b.yaxis.set_major_formatter(byte_fmt)
    ax_b.yaxis.set_major_locator(MultipleLocator(_byte_step(top)))
    ax_b.legend(loc="upper left", fontsize=8)
    peak = max(summary, key=lambda r: r["peak_reserved"])
    ax_b.set_title(f"peaks per rank: rank {peak['rank']} reserves the most ({_fmt_bytes(peak['peak_reserved'])})")
    if title:
        fig.suptitle(title)
    out_path = os.fspath(out)
    ext = os.path.splitext(out_path)[1].lstrip(".").lower()
    fig.savefig(out_path, dpi=dpi, format=ext or "png")
    return {"output": out_path, "ranks": summary, "peak_rank": peak["rank"]}
