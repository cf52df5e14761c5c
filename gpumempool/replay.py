"""Replay a :class:`~gpumempool.trace.Trace` on a private simulated device
with the policy you choose, and compare with what the recording allocator
(torch, or a gpumempool pool) reserved.

::

    from gpumempool.trace import from_torch_snapshot
    from gpumempool.replay import replay

    r = replay(from_torch_snapshot("snapshot.pickle"), {"max_split_size": 64 << 20})
    print(r.peak_reserved, r.recorded_peak_reserved, r.reserved_vs_recorded)

``gpumempool.replay`` is this module, and calling it calls :func:`replay`
(so ``gmp.replay(trace, policy)`` and ``import gpumempool.replay`` both
work).

The sim pool uses manual events, so ``record_stream`` in the trace is
honoured: a block freed after ``r ID STREAM`` comes back only after an
``s STREAM`` (or ``s``) event; at the end every stream completes.

Where the trace says where the recording's device put its segments (``S``
records, from the snapshot's ``segment_alloc`` entries), the simulated
device puts them in the same address order. Best fit takes the free block
of the smallest size and, among equal sizes, the lowest address, so the
order of segments decides which of several equal blocks a request splits,
and with it what merges later. CUDA's addresses do not grow with each
allocation (on an H100, torch's second 2 MiB segment came below its
first), while the simulated device's do: without the recorded order a
replay of the same policy can leave torch's decisions and reserve more or
less than torch did for the same requests.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
import types
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ._errors import InvalidArgumentError, LeakWarning, OutOfMemoryError, expect_out_of_memory
from . import _replay_start
from ._args import MAX_DEVICE, ROUNDUP_INTERVALS
from ._backends import BACKENDS
from ._pool import MemPool
from ._policy import ARGUMENTS, LIST_FORMS, SETTINGS
from .trace import Alloc, EmptyCache, Free, PathLike, RecordStream, Sync, Trace, TraceFile, Trim

__all__ = ["POLICY_KEYS", "ReplayResult", "parse_policy", "parse_size", "replay"]

#: The pool settings a policy sets, as the engine declares them (not
#: torch_version, which is replay's own argument: it picks rules, it is no
#: setting to compare).
_POOL_KEYS = tuple(key for key in ARGUMENTS if SETTINGS[key].get("unit") != "version")

#: The simulated device's options a replay takes, as the sim backend
#: declares them (the others are the replay's to set: manual events, one
#: device per trace device, no injected failures), and what a replay adds
#: to their doc.
_SIM_OPTIONS = {f["name"]: f for f in BACKENDS["sim"]["options"]}
_SIM_KEYS = ("expandable", "granularity", "capacity")
_SIM_NOTES = {"capacity": "default: the trace's 'capacity' metadata, else 80 GiB"}
#: Policy keys and what they set on the replay pool: the pool's settings
#: (with their default where 0 does not say it), then the simulated
#: device's options a replay takes.
POLICY_KEYS: dict[str, str] = {
    **{key: SETTINGS[key]["doc"] + (f"; default {SETTINGS[key]['default']}" if SETTINGS[key].get("default") else "")
       + (f"; on the command line {key}=1,1,2,...,4 or [1,1,2,...,4]" if key in LIST_FORMS else "")
       for key in _POOL_KEYS},
    **{key: _SIM_OPTIONS[key]["doc"] + (f" ({_SIM_NOTES[key]})" if key in _SIM_NOTES else "") for key in _SIM_KEYS},
}
_BOOL_KEYS = {key for key in _SIM_KEYS if _SIM_OPTIONS[key]["type"] == "bool"}
_FRACTION_KEYS = {key for key in _POOL_KEYS if SETTINGS[key].get("unit") == "fraction"}
#: Device size when neither the policy nor the trace names one: an 80 GB H100.
DEFAULT_CAPACITY = 80 << 30
#: How often (in events) a replay with ``stop_above`` looks at its peak.
STOP_CHECK_EVENTS = 2048
ProgressFn = Callable[[int, int], None]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}


#: Sizes are 64-bit.
MAX_SIZE = 1 << 64


def parse_size(text: str) -> int:
    """``"512"``, ``"64MiB"``, ``"64M"`` (binary), ``"2GB"`` (decimal), ``"0x1000"``."""
    t = text.strip().lower().replace("_", "")
    shown = repr(text[:40])
    if t.startswith("0x"):
        try:
            value = int(t, 16)
        except ValueError:
            raise ValueError(f"not a size: {shown} (examples: 1048576, 512MiB, 2GiB, 1GB)") from None
    else:
        num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = t[len(num):].strip()
        if unit not in _UNITS or not num:
            raise ValueError(f"not a size: {shown} (examples: 1048576, 512MiB, 2GiB, 1GB)")
        if num.isascii() and num.isdigit():
            value = int(num) * _UNITS[unit]  # exact, however large
        else:
            try:
                f = float(num) * _UNITS[unit]
            except ValueError:
                raise ValueError(f"not a size: {shown} (examples: 1048576, 512MiB, 2GiB, 1GB)") from None
            if not math.isfinite(f) or f < 0 or f != int(f):
                raise ValueError(f"not a whole, non-negative number of bytes: {shown}")
            value = int(f)
    if value >= MAX_SIZE:
        raise ValueError(f"size {shown} is too large (at most 2**64 - 1 bytes)")
    return value


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (true/false)")


def _policy_entries(items: Any) -> list[tuple[str, str]]:
    """``(key, value)`` pairs of ``key=value`` strings, several to a string
    separated by commas. The 16 counts of roundup_power2_divisions are
    comma-separated too: ``roundup_power2_divisions=1,1,2,...`` (the counts
    are the parts without ``=`` that follow it) or ``=[1,1,2,...]``."""
    entries: list[tuple[str, str]] = []
    for item in items:
        text = str(item)
        # commas inside [...] separate counts, not entries
        parts, depth, cur = [], 0, ""
        for ch in text:
            depth += (ch == "[") - (ch == "]")
            if ch == "," and depth <= 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        for part in parts:
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep:
                if entries and entries[-1][0] in LIST_FORMS and part.strip().isdigit():
                    entries[-1] = (entries[-1][0], f"{entries[-1][1]},{part.strip()}")
                    continue
                raise ValueError(f"policy entries are key=value, got {part!r}")
            entries.append((key.strip().replace("-", "_"), value))
    return entries


def _parse_roundup(key: str, value: str) -> Any:
    """One count, or 16 (one per size interval), comma-separated, in
    brackets or not: the value of ``key``, a setting with a list form."""
    t = value.strip()
    if t.startswith("[") and t.endswith("]"):
        t = t[1:-1]
    counts = [c.strip() for c in t.split(",")]
    if len(counts) == 1 and not value.strip().startswith("["):
        return parse_size(counts[0])
    if len(counts) != ROUNDUP_INTERVALS or not all(c.isascii() and c.isdigit() and len(c) < 20 for c in counts):
        raise ValueError(f"{key} takes one count or {ROUNDUP_INTERVALS} whole numbers, one per "
                         f"size interval ({key}=1,1,2,...), got {value[:80]!r}")
    return [int(c) for c in counts]


def parse_policy(items: Any) -> dict[str, Any]:
    """A policy dict from ``key=value`` strings (each may hold several,
    comma-separated), e.g. ``["max_split_size=64MiB", "expandable=true"]``;
    ``roundup_power2_divisions`` takes one count or 16, comma-separated
    (``roundup_power2_divisions=1,1,2,...``, or in brackets)."""
    if isinstance(items, str):
        items = [items]
    policy: dict[str, Any] = {}
    for key, value in _policy_entries(items):
        if key not in POLICY_KEYS:
            raise ValueError(f"unknown policy key {key!r}; valid: {', '.join(POLICY_KEYS)}")
        if key in LIST_FORMS:
            policy[key] = _parse_roundup(key, value)
        elif key in _BOOL_KEYS:
            policy[key] = _parse_bool(value)
        elif key in _FRACTION_KEYS:
            try:
                policy[key] = float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value.strip()[:40]!r}") from None
            if not math.isfinite(policy[key]):
                raise ValueError(f"{key} must be a finite number, got {value.strip()[:40]!r}")
        else:
            policy[key] = parse_size(value)
    return policy


def _check_policy(policy: Any) -> dict[str, Any]:
    """A policy dict, or the ``key=value`` strings of :func:`parse_policy`
    (the CLI's ``--policy``), checked."""
    if isinstance(policy, str) or (isinstance(policy, (list, tuple)) and all(isinstance(p, str) for p in policy)):
        policy = parse_policy(policy)
    elif policy is not None and not isinstance(policy, Mapping):
        raise TypeError(f"policy must be a dict (keys: {', '.join(POLICY_KEYS)}) or 'key=value' strings, "
                        f"got {type(policy).__name__}")
    out: dict[str, Any] = {}
    for key, value in (policy or {}).items():
        if key not in POLICY_KEYS:
            raise InvalidArgumentError(f"unknown policy key {key!r}; valid: {', '.join(POLICY_KEYS)}")
        if value is None:
            continue
        if key in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise TypeError(f"policy {key} must be a bool, got {type(value).__name__}")
        elif key in _FRACTION_KEYS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"policy {key} must be a number, got {value!r}")
        elif key in LIST_FORMS and isinstance(value, (list, tuple, dict)):
            value = dict(value) if isinstance(value, dict) else list(value)  # MemPool checks the counts
        elif isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"policy {key} must be a non-negative int (bytes), got {type(value).__name__} "
                            f"{repr(value)[:40]}")
        elif value < 0:
            raise InvalidArgumentError(f"policy {key} must be a non-negative int (bytes), got {value}")
        out[key] = value
    return out


def _meta_devices(value: Any) -> int:
    """The trace metadata's ``devices``: a positive whole number."""
    if value is None or value == 0:
        return 1
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DEVICE:
        shown = value if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e20 \
            else type(value).__name__
        raise InvalidArgumentError(f"trace metadata 'devices' must be a whole number in [1, {MAX_DEVICE}], "
                                   f"got {shown}")
    return value


@dataclass
class ReplayResult:
    """What a replay measured. Byte figures are summed over devices of each
    device's peak, like ``reserved_bytes.all.peak``."""

    source: str
    policy: dict[str, Any]
    capacity: int  # bytes of the simulated device (per device)
    # where capacity came from: "given" (the policy), "trace" (its metadata),
    # "recording" (inferred from the recording's memory pressure), "default"
    events: int
    allocations: int  # allocation requests in the trace
    frees: int
    ooms: int  # allocations the replay pool could not serve
    skipped: int  # frees / record_streams of blocks that were never allocated (or OOMed)
    peak_requested: int  # peak of the sizes the trace holds allocated
    peak_allocated: int  # pool's allocated_bytes.all.peak (rounded block sizes)
    peak_reserved: int  # pool's reserved_bytes.all.peak
    fragmentation: float  # peak reserved / peak allocated
    device_allocs: int  # segments the backend allocated (num_device_alloc)
    device_frees: int  # ... and released (num_device_free)
    backend_calls: int  # device_allocs + device_frees
    peak_segments: int
    alloc_retries: int  # allocations served only after releasing the cache
    expansions: int  # in-place growths of expandable segments
    cache_hit_rate: float
    seconds: float
    recorded_by: Optional[str] = None  # whose reserved bytes the trace recorded
    recorded_peak_reserved: Optional[int] = None
    reserved_vs_recorded: Optional[float] = None  # peak_reserved / recorded_peak_reserved
    # segments put in the recording's address order (trace S records), of recorded_segments
    placed_segments: int = 0
    recorded_segments: int = 0
    # the recording allocator's segments at the first event that the replay
    # started with (a trace that starts mid-run), and their bytes
    start_segments: int = 0
    start_reserved: int = 0
    # why a trace that starts mid-run was replayed from an empty device
    # instead (None: it was not, or nothing was held at the start)
    start_not_seeded: Optional[str] = None
    capacity_from: str = "default"
    # what the recording shows: cache releases to retry an allocation, OOMs
    recorded_retries: int = 0
    recorded_ooms: int = 0
    # replay(stop_above=...) stopped after this many events (its figures are
    # those of the events up to there); None: it ran to the end
    stopped_at: Optional[int] = None
    # the index of the first event the replay could not serve (None: no OOM)
    first_oom_event: Optional[int] = None
    stats: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def comparable(self) -> bool:
        """Whether the replay met the recording's conditions, so that its
        peaks can be set against the recording's: it served every
        allocation the recording served (with more OOMs it held less memory
        than the program did, and a lower peak says nothing), and where the
        recording ran short of memory (released its cache to retry, or ran
        out) the replay did too. Nor can a replay that stopped early
        (``stop_above``)."""
        if self.stopped_at is not None or self.ooms != self.recorded_ooms:
            return False
        # (An OOM is a failed retry: torch releases its cache before it gives up.)
        pressed = self.alloc_retries > 0 or self.ooms > 0
        return pressed == (self.recorded_retries > 0 or self.recorded_ooms > 0) or self.recorded_by != "torch"

    @property
    def not_comparable_because(self) -> Optional[str]:
        """Why :attr:`comparable` is false, in words; None when it is true."""
        if self.comparable:
            return None
        if self.stopped_at is not None:
            return f"the replay stopped after {self.stopped_at} events"
        if self.ooms != self.recorded_ooms:
            return (f"the replay ran out of memory {self.ooms:,} time(s), the recording {self.recorded_ooms:,} "
                    f"(on a {_gib(self.capacity)} device, {self.capacity_from})")
        if self.recorded_retries:
            return (f"the recording released its cache to retry {self.recorded_retries:,} time(s) and the replay "
                    f"never did: it had more memory ({_gib(self.capacity)}, {self.capacity_from}); give the "
                    "run's with --capacity or --fraction")
        return (f"the replay released its cache to retry {self.alloc_retries:,} time(s) and the recording never "
                f"did: it had less memory ({_gib(self.capacity)}, {self.capacity_from})")

    @property
    def torch_peak_reserved(self) -> Optional[int]:
        """Torch's recorded peak reserved bytes (torch traces only)."""
        return self.recorded_peak_reserved if self.recorded_by == "torch" else None

    @property
    def ratio_vs_torch(self) -> Optional[float]:
        """Our peak reserved / torch's (torch traces only; < 1 saves memory)."""
        return self.reserved_vs_recorded if self.recorded_by == "torch" else None

    def as_dict(self, with_stats: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_stats:
            d.pop("stats")
        d["torch_peak_reserved"] = self.torch_peak_reserved
        d["ratio_vs_torch"] = self.ratio_vs_torch
        d["comparable"] = self.comparable
        d["not_comparable_because"] = self.not_comparable_because
        return d


def _meta_count(meta: Mapping[str, Any], key: str) -> int:
    v = meta.get(key, 0)
    return v if type(v) is int and v >= 0 else 0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def replay(
    trace: Union[Trace, TraceFile, PathLike],
    policy: Union[Mapping[str, Any], str, Sequence[str], None] = None,
    *,
    progress: Optional[ProgressFn] = None,
    progress_every: int = 10_000,
    recorded_policy: bool = True,
    recorded_addresses: bool = True,
    stop_above: Optional[int] = None,
    torch_version: Optional[str] = None,
    start_state: bool = True,
    fraction: Optional[float] = None,
) -> ReplayResult:
    """Run ``trace`` on a fresh private sim pool configured by ``policy``
    (a dict with keys of :data:`POLICY_KEYS`, or ``"key=value"`` strings as
    :func:`parse_policy` reads them) and report peaks, fragmentation, backend
    calls and OOMs. With ``recorded_policy`` the settings the recording
    allocator had (``trace.meta["recorded_policy"]``, e.g. torch's
    max_split_size, expandable_segments and roundup_power2_divisions) fill
    in what ``policy`` leaves out, so that the comparison with torch's
    recorded reserve is like for like. With ``recorded_addresses`` a segment
    that the replay obtains while serving the event that the recording
    obtained one of the same size for (``trace.segments``) goes where that
    one went in the address order (see the module doc); not in expandable
    replays, whose one growing segment per stream has no counterpart in the
    recording. ``progress(done, total)`` is called every ``progress_every``
    events and at the end. With ``stop_above`` (bytes) the replay stops
    once its peak reserved bytes exceed it (checked every
    :data:`STOP_CHECK_EVENTS` events; :attr:`ReplayResult.stopped_at` says
    where), for searches that only need to know it is worse than that.
    ``torch_version`` (``"2.15"``) replays under that torch release's rules
    (``MemPool(torch_version=...)``); None, the engine's default ones.

    A trace that starts in the middle of a run (a torch snapshot whose
    history was switched on after the model was loaded) records the
    segments torch held at its first event (``meta["start_segments"]``);
    with ``start_state`` the replay starts with them, their blocks live or
    cached as torch had them, at torch's address order
    (:meth:`MemPool.seed_segment`), and its peaks, like the recording's
    (:meth:`Trace.recorded_peak_reserved`), are taken from the run's first
    event on. Expandable replays cannot be seeded; they start from an empty
    device (:attr:`ReplayResult.start_not_seeded` says why).

    The simulated device has the policy's ``capacity``, else the trace's
    (``meta["capacity"]``), else what the recording shows torch could get
    where it ran short of memory (``meta["recorded_conditions"]``: the most
    it reserved before releasing its cache to retry, or its reserved plus
    free bytes at an OOM), else 80 GiB (:attr:`ReplayResult.capacity_from`
    says which). ``fraction`` limits the pool as torch's
    ``set_per_process_memory_fraction`` does (of that capacity, by the
    rule of ``torch_version``), unless the policy gives a ``limit``.

    ``trace`` may be a :class:`~gpumempool.trace.TraceFile` or the path of
    a gmptrace file (read as one): the events are then read from the file
    as they are replayed, never held all at once."""
    if isinstance(trace, (str, os.PathLike)):
        trace = TraceFile(trace)
    if not isinstance(trace, (Trace, TraceFile)):
        raise TypeError(f"trace must be a Trace, a TraceFile or a path, got {type(trace).__name__}")
    pol = given = _check_policy(policy)
    recorded = trace.meta.get("recorded_policy") if recorded_policy else None
    if isinstance(recorded, dict):
        # The recording allocator's settings; not the simulated device's size.
        pol = {**_check_policy({k: v for k, v in recorded.items() if k in POLICY_KEYS and k != "capacity"}), **pol}
    if pol.get("garbage_collection_threshold") and not pol.get("limit"):
        # The threshold is a fraction of the pool's limit: without one it
        # never triggers, and the replay would silently ignore it.
        how = "" if "garbage_collection_threshold" in given else " (the recording's setting)"
        warnings.warn(f"garbage_collection_threshold={pol['garbage_collection_threshold']}{how} has no effect "
                      "without limit: it is a fraction of the limit (add limit=..., e.g. the memory torch "
                      "was allowed)", UserWarning, stacklevel=2)
    if isinstance(trace, Trace):
        # freed only while allocated (a hand-written trace may not be); a TraceFile was checked as it was read
        trace.validate()
        used = max([e.device + 1 for e in trace.events if type(e) is Alloc] + [1])
    else:
        used = trace.devices_used
    total = len(trace)
    devices = max(_meta_devices(trace.meta.get("devices", 1)), used)
    conditions = trace.meta.get("recorded_conditions")
    conditions = conditions if isinstance(conditions, dict) else {}
    capacity, capacity_from = pol.get("capacity"), "given"
    if not capacity:
        capacity, capacity_from = trace.meta.get("capacity"), "trace"
    if not capacity:
        # The memory the recording allocator could get, where its trace shows
        # it ran short (released its cache to retry, or ran out).
        capacity, capacity_from = conditions.get("capacity"), "recording"
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        capacity, capacity_from = DEFAULT_CAPACITY, "default"
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise InvalidArgumentError(f"fraction must be a number in (0, 1], got {fraction!r}"[:120])
        if not pol.get("limit"):
            from .oracle.fidelity import fraction_limit

            pol = {**pol, "limit": fraction_limit(capacity, fraction, torch_version) or 0}
    sim: dict[str, Any] = {"capacity": capacity, "manual_events": True, "devices": devices}
    if "expandable" in pol:
        sim["expandable"] = pol["expandable"]
    if "granularity" in pol:
        sim["granularity"] = pol["granularity"]
    pool = MemPool(
        "sim",
        name="replay",
        **{key: pol.get(key) or None for key in _POOL_KEYS},
        torch_version=torch_version,
        **sim,
    )
    ptrs: dict[int, Optional[int]] = {}
    sizes: dict[int, int] = {}
    allocs = frees = ooms = skipped = 0
    first_oom: Optional[int] = None
    cur = peak_req = 0
    # An expandable replay grows one segment per stream: the recording's
    # segments have no counterpart there.
    start_segs = [g for g in _replay_start.start_segments(trace) if g.device < devices] if start_state else []
    not_seeded: Optional[str] = None
    if start_segs and pol.get("expandable"):
        not_seeded, start_segs = "expandable segments start empty (torch's layout at the start has no counterpart)", []
    placements, start_offsets = _replay_start.placements(trace, devices, start_segs) if recorded_addresses and not pol.get("expandable") \
        else ({}, [None] * len(start_segs))
    seeded: dict[int, int] = {}  # block id -> address of the live blocks seeded
    first = trace.meta.get("preexisting_blocks", 0)
    first = first if type(first) is int and first >= 0 else 0  # the run's first event
    placing: set[int] = set()  # devices with a placement asked for the next allocation
    start = time.perf_counter()
    step = max(1, int(progress_every))
    stopped_at: Optional[int] = None
    if stop_above is not None and (isinstance(stop_above, bool) or not isinstance(stop_above, int)):
        raise TypeError(f"stop_above must be an int (bytes) or None, got {type(stop_above).__name__}")
    # an allocation the trace does not fit in is counted here, not this
    # process running out of memory (distributed.snapshot_on_oom ignores it)
    was_expected = expect_out_of_memory(True)
    try:
        alloc, alloc_segment, free, record_stream = pool.alloc, pool.alloc_segment, pool.free, pool.record_stream
        place = pool.sim.place_next
        # The recording's segments are made just before the run's first
        # event: the blocks live at the start that they do not hold (a
        # private pool's, a CUDA graph's) are allocated before them, in
        # segments of their own as torch's were, not in torch's default
        # pool's cache. Their allocations' ids: those the seeding serves.
        seed_ids = {bid for g in start_segs if g.device < devices for _, bid in g.blocks if bid}
        deferred: list[tuple[int, Alloc]] = []  # their Alloc events (and indices), until the seeding

        def seed() -> None:
            nonlocal not_seeded, ooms, first_oom
            not_seeded = _replay_start.seed(pool, trace, start_segs, start_offsets, devices, seeded)
            for k, a in deferred:
                if a.id in seeded:
                    ptrs[a.id] = seeded.pop(a.id)
                    continue
                try:  # not seeded after all: allocated as the trace asks
                    ptrs[a.id] = (alloc_segment if a.caller_sized else alloc)(a.size, a.device, a.stream)
                except OutOfMemoryError:
                    ooms += 1
                    if first_oom is None:
                        first_oom = k
                    ptrs[a.id] = None
            deferred.clear()
            pool.reset_accumulated_stats()  # the state at the start is not the run's

        to_seed = bool(start_segs)
        for i, e in enumerate(trace):
            if to_seed and i >= first:
                seed()
                to_seed = False
            t = type(e)
            if placements and i in placements:
                # The recording obtained these while serving event i (or, if
                # the importer put an event before it, the next allocation).
                for dev, offset, size in placements[i]:
                    place(offset, size, dev)
                    placing.add(dev)
            if t is Alloc:
                allocs += 1
                cur += e.size  # type: ignore[union-attr]
                sizes[e.id] = e.size  # type: ignore[union-attr]
                if cur > peak_req:
                    peak_req = cur
                if to_seed and e.id in seed_ids:  # type: ignore[union-attr]
                    deferred.append((i, e))  # type: ignore[arg-type]
                    continue
                try:
                    ptrs[e.id] = (alloc_segment if e.caller_sized else alloc)(  # type: ignore[union-attr]
                        e.size, e.device, e.stream)  # type: ignore[union-attr]
                except OutOfMemoryError:
                    ooms += 1
                    if first_oom is None:
                        first_oom = i
                    ptrs[e.id] = None  # type: ignore[union-attr]
                if placing:  # a placement is for the allocation it was recorded in, not a later one
                    for dev in placing:
                        place(None, device=dev)
                    placing.clear()
            elif t is Free:
                ptr = ptrs.pop(e.id, None)  # type: ignore[union-attr]
                cur -= sizes.pop(e.id, 0)  # type: ignore[union-attr]
                if ptr is None:
                    skipped += 1
                else:
                    free(ptr)
                    frees += 1
            elif t is RecordStream:
                ptr = ptrs.get(e.id)  # type: ignore[union-attr]
                if ptr is None:
                    skipped += 1
                else:
                    record_stream(ptr, e.stream)  # type: ignore[union-attr]
            elif t is Sync:
                pool.sim.complete(e.stream)  # type: ignore[union-attr]
            elif t is EmptyCache:
                pool.empty_cache()
            elif t is Trim:
                pool.trim(e.keep, e.device)  # type: ignore[union-attr]
            if i == first:
                # Peaks count from the run's first event, as the recording's do.
                pool.reset_peak_stats()
                peak_req = cur
            if progress is not None and (i + 1) % step == 0:
                progress(i + 1, total)
            if stop_above is not None and (i + 1) % STOP_CHECK_EVENTS == 0 and \
                    pool.stats().get("reserved_bytes.all.peak", 0) > stop_above:
                stopped_at = i + 1
                break
        if to_seed and stopped_at is None:  # the trace has no event after those live at the start
            seed()
        pool.sim.complete()
        pool.process_events()
        stats = pool.stats()
        placed = pool.sim.stats().get("placed", 0)
    finally:
        expect_out_of_memory(was_expected)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LeakWarning)
            pool.close()
    if progress is not None:
        progress(total, total)
    seconds = time.perf_counter() - start
    peak_alloc = stats.get("allocated_bytes.all.peak", 0)
    peak_res = stats.get("reserved_bytes.all.peak", 0)
    recorded = trace.recorded_peak_reserved()
    served = stats.get("allocation.all.allocated", 0)
    return ReplayResult(
        source=trace.source,
        policy=dict(pol),
        capacity=capacity,
        events=total,
        allocations=allocs,
        frees=frees,
        ooms=ooms,
        skipped=skipped,
        peak_requested=peak_req,
        peak_allocated=peak_alloc,
        peak_reserved=peak_res,
        fragmentation=peak_res / peak_alloc if peak_alloc else 0.0,
        device_allocs=stats.get("num_device_alloc", 0),
        device_frees=stats.get("num_device_free", 0),
        backend_calls=stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0),
        peak_segments=stats.get("segment.all.peak", 0),
        alloc_retries=stats.get("num_alloc_retries", 0),
        expansions=stats.get("num_expansions", 0),
        cache_hit_rate=stats.get("num_cache_hits", 0) / served if served else 0.0,
        seconds=seconds,
        recorded_by=trace.recorded_by if recorded is not None else None,
        recorded_peak_reserved=recorded,
        reserved_vs_recorded=(peak_res / recorded) if recorded else None,
        placed_segments=placed,
        recorded_segments=len(trace.segments) + (len(start_segs) if not_seeded is None and placements else 0),
        start_segments=len(start_segs) if not_seeded is None else 0,
        start_reserved=sum(g.size for g in start_segs) if not_seeded is None else 0,
        start_not_seeded=not_seeded,
        capacity_from=capacity_from,
        recorded_retries=conditions.get("retries", 0) if type(conditions.get("retries", 0)) is int else 0,
        # the OOMs a replay can meet: those whose request it asks for again
        recorded_ooms=_meta_count(trace.meta, "failed_requests"),
        stopped_at=stopped_at,
        first_oom_event=first_oom,
        stats=stats,
    )


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`replay`: ``gpumempool.replay`` is
    both the public function (``gmp.replay(trace, policy)``) and this
    module (``import gpumempool.replay as r``, ``from gpumempool.replay
    import parse_policy``), so the package attribute and the submodule can
    be one object."""

    def __call__(self, trace: Trace, policy: Union[Mapping[str, Any], str, Sequence[str], None] = None,
                 **kwargs: Any) -> ReplayResult:
        return replay(trace, policy, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(replay)  # inspect.signature(gpumempool.replay): the function's
