"""The engine beside torch: the same trace, the same settings, event by
event.

:func:`engine_points` replays a trace on a sim pool configured from torch's
``PYTORCH_ALLOC_CONF`` syntax and returns the same figures the oracle
returns for torch (reserved and allocated bytes, segments, retries, OOMs of
the event's device after every event); :func:`compare` runs both and says
how many points agree and where they first differ. The fidelity matrix
(``benchmarks/fidelity.py``, ``benchmarks/results/fidelity.md``) is this,
over torch versions, settings and traces."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

from .._errors import LeakWarning, OutOfMemoryError, expect_out_of_memory
from .._policy import SETTINGS, torch_settings
from .._pool import MemPool
from ..trace import Alloc, EmptyCache, Free, RecordStream, Sync, Trace, TraceFile, Trim
from . import DEFAULT_CAPACITY, OracleResult, Point, run

__all__ = ["Comparison", "compare", "engine_points", "fraction_limit", "parse_alloc_conf"]

#: torch's setting names and the sim pool's arguments they set: expandable
#: segments (a sim option), then the pool settings torch has too (the
#: engine's schema).
_SETTINGS = {"expandable_segments": "expandable",
             **{torch: name for name, torch in torch_settings().items()}}
#: Settings the oracle accepts that change nothing the engine models
#: (pinned host memory, the backend choice that must stay native).
_IGNORED = {"pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
            "release_lock_on_cudamalloc", "backend"}


def parse_alloc_conf(conf: str) -> dict[str, Any]:
    """Torch's ``key:value,key:value`` as :class:`MemPool` arguments; one
    line naming the setting for anything the engine does not model."""
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in re.split(r",(?![^\[]*\])", conf))):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"alloc conf item {item!r} is not key:value")
        if key in _IGNORED:
            if key == "backend" and value != "native":
                raise ValueError(f"backend:{value} is not torch's caching allocator")
            continue
        name = _SETTINGS.get(key)
        if name is None:
            raise ValueError(f"the engine does not model torch's setting {key!r} "
                             f"(known: {', '.join(sorted(_SETTINGS))})")
        if name == "expandable":
            out[name] = value.lower() == "true"
        elif SETTINGS[name].get("torch_scale"):  # torch's MiB
            out[name] = int(value) * SETTINGS[name]["torch_scale"]
        elif SETTINGS[name]["unit"] == "fraction":
            out[name] = float(value)
        else:
            if value.startswith("["):
                raise ValueError(f"{key}:{value}: the per-interval list form is not modelled yet")
            out[name] = int(value)
    return out


def _version(torch_version: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of a torch version string, or None."""
    if not torch_version:
        return None
    try:
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    return major, minor


def fraction_limit(capacity: int, fraction: Optional[float], torch_version: Optional[str] = None) -> Optional[int]:
    """The byte limit torch's ``set_per_process_memory_fraction(fraction)``
    sets on a device of ``capacity`` bytes (None: no limit), as its
    ``setMemoryFraction`` computes ``allowed_memory_maximum``, which
    ``alloc_block`` compares with the reserved bytes plus the segment asked
    for before calling cudaMalloc (and which garbage collection needs):
    up to 2.9 ``fraction * total`` truncated, for any fraction (1.0
    included); from 2.10 (seen in 2.11) no limit at 1.0; from 2.15 the
    product is rounded to the nearest byte instead of truncated."""
    if fraction is None:
        return None
    v = _version(torch_version)
    product = float(fraction) * float(capacity)
    if v is not None and v >= (2, 10) and not fraction < 1.0:
        return None
    if v is not None and v >= (2, 15) and product < 2.0 ** 52:
        return int(product + 0.49999999999999994)  # std::round, as torch 2.15's inlined code does it
    return int(product)


def engine_points(trace: Union[Trace, TraceFile], alloc_conf: str = "", *, capacity: int = DEFAULT_CAPACITY,
                  fraction: Optional[float] = None, devices: Optional[int] = None,
                  torch_version: Optional[str] = None) -> list[Point]:
    """The engine's figures after every event of ``trace``, as
    :class:`Point` s like the oracle's, under the rules of ``torch_version``
    (the pool's ``torch_version``, and how the memory fraction becomes a
    limit: :func:`fraction_limit`); None: the engine's default rules."""
    pol = parse_alloc_conf(alloc_conf)
    used = 1 + max((e.device for e in trace if isinstance(e, Alloc)), default=0)
    devices = max(devices or 1, used)
    limit = fraction_limit(capacity, fraction, torch_version)
    gc = pol.pop("garbage_collection_threshold", None)
    sim: dict[str, Any] = {"capacity": capacity, "manual_events": True, "devices": devices}
    if "expandable" in pol:
        sim["expandable"] = pol.pop("expandable")
    if torch_version:
        pol["torch_version"] = torch_version
    pool = MemPool("sim", name="oracle-engine", limit=limit,
                   garbage_collection_threshold=gc if limit else None, **pol, **sim)
    ptrs: dict[int, Optional[int]] = {}
    where: dict[int, int] = {}
    points: list[Point] = []
    was = expect_out_of_memory(True)
    try:
        for e in trace:
            dev = 0
            if isinstance(e, Alloc):
                dev = where[e.id] = e.device
                ptrs[e.id] = None  # torch.empty(0) reserves and allocates nothing
                if e.size:
                    try:
                        ptrs[e.id] = pool.alloc(e.size, dev, e.stream)
                    except OutOfMemoryError:
                        pass
            elif isinstance(e, Free):
                dev = where.pop(e.id, 0)
                ptr = ptrs.pop(e.id, None)
                if ptr is not None:
                    pool.free(ptr)
            elif isinstance(e, RecordStream):
                dev = where.get(e.id, 0)
                ptr = ptrs.get(e.id)
                if ptr is not None:
                    pool.record_stream(ptr, e.stream)
            elif isinstance(e, Sync):
                pool.sim.complete(e.stream)
            elif isinstance(e, EmptyCache):
                pool.empty_cache()
            elif isinstance(e, Trim):
                raise ValueError("trim has no counterpart in torch's allocator")
            s = pool.stats(dev)
            points.append(Point(dev, s.get("reserved_bytes.all.current", 0), s.get("allocated_bytes.all.current", 0),
                                s.get("segment.all.current", 0), s.get("num_alloc_retries", 0),
                                s.get("num_ooms", 0)))
    finally:
        expect_out_of_memory(was)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LeakWarning)
            pool.close()
    return points


#: The figures compared, by name (Point's fields but the device).
FIELDS = ("reserved", "allocated", "segments", "retries", "ooms")


@dataclass
class Comparison:
    """How the engine's points agree with torch's."""

    torch_version: str
    alloc_conf: str
    matched: int
    total: int
    first_difference: Optional[int]  # the first event where they differ
    torch_point: Optional[Point]
    engine_point: Optional[Point]
    torch_peak_reserved: int
    engine_peak_reserved: int

    @property
    def exact(self) -> bool:
        return self.matched == self.total

    def describe(self) -> str:
        if self.exact:
            return f"{self.matched}/{self.total} points match"
        diff = [f"{f} torch {getattr(self.torch_point, f)} engine {getattr(self.engine_point, f)}"
                for f in FIELDS if getattr(self.torch_point, f) != getattr(self.engine_point, f)]
        return f"{self.matched}/{self.total} points match; first difference at event {self.first_difference}: " + \
            ", ".join(diff)


def diff(torch_result: OracleResult, engine: list[Point]) -> Comparison:
    """Compares torch's points with the engine's."""
    theirs = torch_result.points
    matched, first = 0, None
    for i, (a, b) in enumerate(zip(theirs, engine)):
        if all(getattr(a, f) == getattr(b, f) for f in FIELDS):
            matched += 1
        elif first is None:
            first = i
    if first is None and len(theirs) != len(engine):
        first = min(len(theirs), len(engine))
    return Comparison(torch_result.torch_version, torch_result.alloc_conf, matched, max(len(theirs), len(engine)),
                      first, theirs[first] if first is not None and first < len(theirs) else None,
                      engine[first] if first is not None and first < len(engine) else None,
                      torch_result.peak_reserved, max((p.reserved for p in engine), default=0))


def compare(trace: Union[Trace, TraceFile], alloc_conf: str = "", *, python: Optional[str] = None,
            capacity: int = DEFAULT_CAPACITY, fraction: Optional[float] = None, devices: Optional[int] = None,
            cache: Optional[str] = None) -> Comparison:
    """Runs ``trace`` through torch (:func:`gpumempool.oracle.run`) and the
    engine under the same settings, and the rules of the torch version that
    ran it, and compares them point by point."""
    theirs = run(trace, alloc_conf, python=python, capacity=capacity, fraction=fraction, devices=devices, cache=cache)
    return diff(theirs, engine_points(trace, alloc_conf, capacity=capacity, fraction=fraction, devices=devices,
                                      torch_version=theirs.torch_version))
