"""What a torch recording shows of the memory its allocator could get
(``meta["recorded_conditions"]`` of an imported trace)."""

from __future__ import annotations

from typing import Any, Optional

from .._policy import TORCH_SIZES
from ._format import U64

__all__ = ["MAX_OOM_REQUEST", "Pressure", "most_reserved"]


def most_reserved(start: dict[int, int], imported: list[tuple[int, int, dict[str, Any]]]) -> dict[int, int]:
    """The most bytes the recording reserved on each device at any time,
    from ``start`` (the bytes at the start) through the segment entries."""
    now, most = dict(start), dict(start)
    for d, _, e in imported:
        a = e["action"]
        if a in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            now[d] = now.get(d, 0) + (e["size"] if a in ("segment_alloc", "segment_map") else -e["size"])
            most[d] = max(most.get(d, 0), now[d])
    return most


#: The largest failed request (an ``oom`` entry's size) a replay asks for:
#: the engine's largest request (1 PiB).
MAX_OOM_REQUEST = 1 << 50


def _torch_segment_size(size: int) -> int:
    """The segment torch's allocator asks the device for to serve ``size``
    bytes (its small pool's 2 MiB, 20 MiB up to 10 MiB, else 2 MiB steps:
    the engine's sizes, gocore/round.go)."""
    if size <= TORCH_SIZES["small_size"]:
        return TORCH_SIZES["small_buffer"]
    if size < TORCH_SIZES["min_large_alloc"]:
        return TORCH_SIZES["large_buffer"]
    step = TORCH_SIZES["round_large"]
    return -(-size // step) * step


class Pressure:
    """What a recording shows of the memory its allocator could get.

    Torch releases its cache and retries when the device (or its memory
    fraction) refuses a segment, and records an ``oom`` entry, with the
    device's free bytes, when the retry fails too. So the memory torch
    could get on a device was at least the most it ever reserved there,
    less than the reserved bytes plus the segment of every failing attempt,
    and, at an OOM, about the reserved bytes plus the free ones."""

    def __init__(self, reserved: dict[int, int]) -> None:
        self.reserved = reserved
        self.peak: dict[int, int] = dict(reserved)
        self.retries: dict[int, int] = {}
        self.below: dict[int, int] = {}  # device -> least reserved + segment that failed
        self.at_oom: dict[int, int] = {}  # device -> reserved + device_free at its last OOM
        self.ooms: dict[int, int] = {}

    def seen(self, d: int) -> None:
        r = self.reserved.get(d, 0)
        if r > self.peak.get(d, -1):
            self.peak[d] = r

    def retry(self, d: int, before: int, segment: Optional[dict[str, Any]]) -> None:
        self.retries[d] = self.retries.get(d, 0) + 1
        if segment is not None and segment["action"] == "segment_alloc":
            need = before + segment["size"]
            self.below[d] = min(self.below.get(d, need), need)

    def oom(self, d: int, e: dict[str, Any]) -> None:
        self.ooms[d] = self.ooms.get(d, 0) + 1
        free, size = e.get("device_free"), e.get("size")
        if type(free) is int and 0 <= free < U64:
            reserved = self.reserved.get(d, 0)
            if type(size) is int and 0 < size and free >= _torch_segment_size(size) and reserved:
                # The device had room for the segment: a limit (torch's memory
                # fraction) refused it, and what was reserved is what it allowed.
                self.at_oom[d] = reserved
            else:
                self.at_oom[d] = reserved + free

    def conditions(self) -> dict[str, Any]:
        """``retries``, ``ooms`` and ``capacity`` (the bytes per device a
        replay needs to meet the recording's pressure; None when it cannot
        be told), with ``how`` it was found. Empty without pressure."""
        if not self.retries and not self.ooms:
            return {}
        devs = set(self.retries) | set(self.ooms)
        caps = {}
        for d in devs:
            cap = self.at_oom.get(d)
            if cap is None or cap < self.peak.get(d, 0):
                cap = self.peak.get(d, 0)
            caps[d] = cap
        capacity: Optional[int] = max(caps.values())
        how = ("reserved + free device memory at the OOM" if self.at_oom and capacity in
               [self.at_oom.get(d) for d in devs] else "the most torch reserved before it released its cache to retry")
        # One capacity for every device: it must hold the others' peaks, and
        # stay below what failed on the devices under pressure.
        others = max([p for d, p in self.peak.items() if d not in devs] + [0])
        if others > (capacity or 0) or any(capacity >= self.below[d] for d in self.below):  # type: ignore[operator]
            capacity, how = None, "the devices' pressures differ: no one capacity meets them all"
        return {"retries": sum(self.retries.values()), "ooms": sum(self.ooms.values()), "capacity": capacity,
                "how": how}
