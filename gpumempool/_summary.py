"""A text report of a pool's statistics, laid out like
``torch.cuda.memory_summary()`` (which stops working once torch's allocator
is replaced): one row per metric, its large- and small-pool parts below it,
and columns for the current value, the peak, and the totals allocated and
freed."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ._units import format_bytes

__all__ = ["memory_summary"]

#: One name for each figure that ``demo``, ``replay`` and ``plot`` report
#: (their ``--json`` keys, :class:`~gpumempool.replay.ReplayResult`'s and
#: :class:`~gpumempool.demo.DemoResult`'s fields), with the label their
#: tables use. A command that cannot know a figure leaves it out; it never
#: reports another figure under its name.
FIGURES: dict[str, tuple[str, str]] = {
    # Not requested_bytes.all.peak: torch (and the pool) count a block
    # freed while other streams use it until its free completes.
    "peak_requested": ("peak requested",
                       "peak of the bytes the program asked for and had not freed yet (from each "
                       "allocation to its free call, as a trace records them)"),
    "peak_allocated": ("peak allocated",
                       "peak of the bytes of allocated blocks, sizes rounded up (allocated_bytes.all.peak)"),
    "peak_reserved": ("peak reserved", "peak of the bytes reserved from the backend (reserved_bytes.all.peak)"),
    "fragmentation": ("fragmentation", "peak reserved / peak allocated"),
    "backend_calls": ("backend calls",
                      "segment allocations (or growths) and releases the backend served "
                      "(num_device_alloc + num_device_free)"),
    "cache_hit_rate": ("cache-hit rate", "allocations served from the cache / allocations"),
    "allocations": ("allocations", "allocation requests"),
}


def figure_label(key: str) -> str:
    """The table label of figure ``key`` (a key of :data:`FIGURES`)."""
    return FIGURES[key][0]

#: (title, stat key prefix, is a byte count)
_METRICS = (
    ("Allocated memory", "allocated_bytes", True),
    ("Active memory", "active_bytes", True),
    ("Requested memory", "requested_bytes", True),
    ("Reserved memory", "reserved_bytes", True),
    ("Non-releasable memory", "inactive_split_bytes", True),
    ("Allocations", "allocation", False),
    ("Active allocs", "active", False),
    ("Reserved segments", "segment", False),
    ("Non-releasable allocs", "inactive_split", False),
)
_COLUMNS = ("current", "peak", "allocated", "freed")
_WIDTH = 80  # the metric rows: "| " + 25 + 4 columns of " | " + 10 + " |"


def _fmt_count(n: int) -> str:
    return f"{n:,}"


def memory_summary(stats: Mapping[str, int], *, title: str, abbreviated: bool = False) -> str:
    """The report for ``stats`` (``MemPool.stats()`` keys, which are torch's)."""
    line, thick = "|" + "-" * (_WIDTH - 2) + "|", "|" + "=" * (_WIDTH - 2) + "|"
    rows = [thick, f"|{title:^{_WIDTH - 2}}|", line]
    rows.append(f"| {'Metric':<25}| {'Cur Usage':>10} | {'Peak Usage':>10} | {'Tot Alloc':>10} | {'Tot Freed':>10} |")
    rows.append(thick)
    parts = ("all",) if abbreviated else ("all", "large_pool", "small_pool")
    for name, key, is_bytes in _METRICS:
        fmt: Callable[[int], str] = format_bytes if is_bytes else _fmt_count
        for part in parts:
            label = name if part == "all" else f"      from {part.replace('_', ' ')}"
            vals = [fmt(int(stats.get(f"{key}.{part}.{col}", 0))) for col in _COLUMNS]
            rows.append(f"| {label:<25}| {vals[0]:>10} | {vals[1]:>10} | {vals[2]:>10} | {vals[3]:>10} |")
        rows.append(line)
    for name, key in (("Oversize allocations", "oversize_allocations"), ("Oversize segments", "oversize_segments")):
        vals = [_fmt_count(int(stats.get(f"{key}.{col}", 0))) for col in _COLUMNS]
        rows.append(f"| {name:<25}| {vals[0]:>10} | {vals[1]:>10} | {vals[2]:>10} | {vals[3]:>10} |")
    rows.append(line)
    counters = (
        ("cache hits", "num_cache_hits"), ("backend allocs", "num_device_alloc"),
        ("backend frees", "num_device_free"), ("alloc retries", "num_alloc_retries"), ("OOMs", "num_ooms"),
        ("GC releases", "num_gc_releases"), ("expansions", "num_expansions"),
    )
    text = ", ".join(f"{label} {int(stats.get(key, 0)):,}" for label, key in counters)
    while text:
        cut = text if len(text) <= _WIDTH - 4 else text[: text.rfind(", ", 0, _WIDTH - 4) + 1]
        rows.append(f"| {cut.strip():<{_WIDTH - 4}} |")
        text = text[len(cut):]
    rows.append(thick)
    return "\n".join(rows) + "\n"


def pool_title(config: Mapping[str, Any], device: Optional[int]) -> str:
    where = "all devices" if device is None else f"device {device}"
    return f"gpumempool {config.get('name')!s} ({config.get('backend')!s}), {where}"
