"""What :func:`gpumempool.tune.tune` reports: each setting replayed
(:class:`Candidate`), and the result (:class:`TuneResult`) with its ranking,
table and recommendation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ._policy import SETTINGS
from ._tune_space import SETTING_KEYS, MiB, alloc_conf
from ._units import format_bytes
from .replay import ReplayResult

__all__ = ["Candidate", "TuneResult", "rank"]

#: Where the 2.9.1 pitfall applies, what to do about it (pytorch/pytorch#183387).
_PITFALL_2_9 = ("torch 2.9.1 reads PYTORCH_ALLOC_CONF too, but silently ignores expandable_segments there "
                "(pytorch/pytorch#183387, fixed by 2.11): keep PYTORCH_CUDA_ALLOC_CONF")


@dataclass
class Candidate:
    """One setting and what its replay measured. ``settings`` holds the
    replay policy keys that differ from torch's defaults."""

    settings: dict[str, Any]
    result: ReplayResult
    torch: bool  # torch's allocator accepts these settings
    limit: Optional[int] = None
    #: every setting was proven exact against the modelled torch version by
    #: the fidelity matrix (gpumempool/oracle/proven.json); tune recommends
    #: only verified ones
    verified: bool = True
    #: these are the settings the recorded run had (trace.meta["recorded_policy"])
    recorded: bool = False
    #: the smallest device (bytes, per device) on which the run fits under
    #: these settings, with ``tune(min_capacity=True)``; None: not measured
    min_capacity: Optional[int] = None
    #: the stack frames the snapshot recorded for the first allocation
    #: these settings cannot serve (innermost first; empty without OOM or
    #: without recorded stacks)
    first_oom_frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def peak_reserved(self) -> int:
        return self.result.peak_reserved

    @property
    def fragmentation_ratio(self) -> float:
        """GMLake's fragmentation ratio: 1 - peak allocated / peak reserved
        (0: every reserved byte was allocated at the peak)."""
        r = self.result
        return 1 - r.peak_allocated / r.peak_reserved if r.peak_reserved else 0.0

    @property
    def first_oom_event(self) -> Optional[int]:
        """The index of the first trace event these settings cannot serve."""
        return self.result.first_oom_event

    @property
    def fits(self) -> bool:
        """Every allocation was served (under the limit, if one was given)."""
        return self.result.ooms == 0

    @property
    def complete(self) -> bool:
        """The replay ran to the end; False when it stopped early, once it
        had reserved more than the best setting known then (its figures
        are those of the events up to there)."""
        return self.result.stopped_at is None

    @property
    def alloc_conf(self) -> Optional[str]:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` value for these settings ("" for
        torch's defaults), or None when torch has no way to say them."""
        return alloc_conf(self.settings) if self.torch else None

    @property
    def mempool_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`gpumempool.MemPool` with the same
        policy (``backend``: ``vmm`` for expandable segments, else ``cuda``)."""
        out: dict[str, Any] = {"backend": "vmm" if self.settings.get("expandable") else "cuda"}
        for key in SETTING_KEYS:
            if key in self.settings:
                out[key] = self.settings[key]
        if self.limit:
            out["limit"] = self.limit
        return out

    @property
    def mempool_call(self) -> str:
        """:attr:`mempool_kwargs` as Python source."""
        kw = dict(self.mempool_kwargs)
        args = [repr(kw.pop("backend"))]
        for key, value in kw.items():
            if isinstance(value, int) and not isinstance(value, bool) and value >= MiB and value % MiB == 0:
                args.append(f"{key}={value // MiB} << 20")
            else:
                args.append(f"{key}={value!r}")
        return f"gmp.MemPool({', '.join(args)})"

    def describe(self) -> str:
        """The settings in words, ``defaults`` for none."""
        if not self.settings:
            return "defaults"
        return ", ".join(f"{k}={_show(k, v)}" for k, v in self.settings.items()) + \
            ("" if self.verified else " (unverified)")

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "settings": dict(self.settings), "torch": self.torch, "verified": self.verified,
            "alloc_conf": self.alloc_conf,
            # a replay stopped early does not say whether the rest would fit
            "mempool": self.mempool_kwargs, "fits": self.fits if self.complete else None, "complete": self.complete,
            "stopped_at": r.stopped_at, "peak_reserved": r.peak_reserved,
            "peak_allocated": r.peak_allocated, "fragmentation": r.fragmentation,
            "fragmentation_ratio": self.fragmentation_ratio,
            "backend_calls": r.backend_calls, "alloc_retries": r.alloc_retries, "ooms": r.ooms,
            "recorded": self.recorded, "min_capacity": self.min_capacity,
            "first_oom_event": r.first_oom_event, "first_oom_frames": list(self.first_oom_frames),
        }


def _show(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and SETTINGS.get(key, {}).get("unit", "bytes") == "bytes":
        return format_bytes(value, 0) if value % MiB == 0 else format_bytes(value)
    return str(value)


@dataclass
class TuneResult:
    """What :func:`tune` found. ``candidates`` are sorted best first (those
    that fit first, then those replayed to the end, then by peak reserved
    bytes, fewer settings and backend calls). A candidate whose replay
    stopped early (``complete`` False) reserved more than the best known
    then, and its figures cover the events up to there. Of settings that do
    not fit, those failing fewer allocations come first.

    ``recorded`` is the recorded run's own settings (those of its
    ``recorded_policy`` torch can express; torch's defaults when it names
    none), always replayed in full: the baseline the table's ratios are
    set against, and the floor of :attr:`best`."""

    source: str
    events: int
    lower_bound: int  # peak of the bytes the trace holds at once: no setting reserves less
    limit: Optional[int]
    default: Candidate
    candidates: list[Candidate]
    recorded_peak_reserved: Optional[int] = None  # what the recording allocator reserved
    recorded_by: Optional[str] = None
    replays: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: the torch version (major.minor) whose allocator the engine modelled
    torch_version: str = ""
    #: the recorded run's settings, replayed (None only for results made by hand)
    recorded: Optional[Candidate] = None
    #: where :attr:`limit` came from: "", "given", "fraction 0.9 of 80.00 GiB
    #: (...)", "inferred from the recording"
    limit_source: str = ""
    #: the policy keys left out of the search (``exclude``)
    excluded: list[str] = field(default_factory=list)
    #: the torch version (major.minor) the settings are written for: the one
    #: asked for or installed (the modelled one when neither is known); it
    #: may be newer than :attr:`torch_version` when that one was not judged
    torch_target: str = ""

    @property
    def baseline(self) -> Candidate:
        """What ratios are set against: the recorded settings, else the default."""
        return self.recorded if self.recorded is not None else self.default

    @property
    def baseline_name(self) -> str:
        """``recorded`` when the trace says what its run had, else ``default``."""
        return "recorded" if self.recorded is not None else "default"
    #: the search stopped at ``deadline_s`` before it was done: the best of
    #: the settings replayed by then
    partial: bool = False

    @property
    def env_var(self) -> str:
        """The variable the torch the settings are for reads them from."""
        from .oracle import env_var

        return env_var(self.torch_target or self.torch_version)

    @property
    def pitfall(self) -> Optional[str]:
        """A known way that torch version misreads the variable, if any."""
        return _PITFALL_2_9 if (self.torch_target or self.torch_version) == "2.9" else None

    def _eligible(self, c: Candidate) -> bool:
        """Whether :attr:`best` may be ``c``: a torch setting proven for the
        modelled version (or the recorded run's own), using no excluded option."""
        return c.torch and (c.verified or c.recorded) and not set(c.settings) & set(self.excluded)

    @property
    def best(self) -> Candidate:
        """The best setting torch accepts that the fidelity matrix proved
        for the modelled torch version, or the recorded settings where
        nothing beats them (never worse than those, nor than the default)."""
        best = next(c for c in self.candidates if self._eligible(c))
        rec = self.recorded
        if rec is not None and rec is not best and self._eligible(rec) and _outcome(rec) == _outcome(best):
            return rec  # as good: nothing to change
        return best

    @property
    def best_extra(self) -> Optional[Candidate]:
        """The best setting only gpumempool's pools accept, if it beats :attr:`best`."""
        best = self.best
        for c in self.candidates:
            if not c.torch and not set(c.settings) & set(self.excluded) and rank(c) < rank(best):
                return c
        return None

    def top(self, n: int = 5, torch: Optional[bool] = True) -> list[Candidate]:
        """The best ``n`` distinct outcomes (torch's settings only,
        gpumempool's only, or all for ``torch=None``): of the settings that
        replay to the same figures, only the simplest is listed (the rest
        are in :attr:`candidates`). Settings using an excluded option (only
        the recorded ones can) are not listed."""
        out: list[Candidate] = []
        seen: set[tuple[Any, ...]] = set()
        for c in self.candidates:
            if (torch is not None and c.torch != torch) or not c.complete or set(c.settings) & set(self.excluded):
                continue
            r = c.result
            outcome = (r.peak_reserved, r.peak_allocated, r.backend_calls, r.alloc_retries, r.ooms)
            if outcome not in seen:
                seen.add(outcome)
                out.append(c)
                if len(out) == n:
                    break
        return out

    def rows(self, n: int = 5) -> list[tuple[str, Candidate]]:
        """The table's rows: the best ``n`` torch settings, the recorded
        settings and the default where they are not among them, and the
        best of the extra settings, each with its tag."""
        top, best = self.top(n), self.best
        if best not in top:  # the recorded settings, listed in place of a simpler one as good
            same = [i for i, c in enumerate(top) if _outcome(c) == _outcome(best)]
            if same:
                top[same[0]] = best
            else:
                top = ([best] + top)[:n]
        out = [(str(i) + (" (recorded)" if c.recorded else ""), c) for i, c in enumerate(top, 1)]
        if self.recorded is not None and self.recorded not in top:
            out.append(("recorded", self.recorded))
        if self.default not in top and self.default is not self.recorded:
            out.append(("default", self.default))
        extra = self.best_extra
        if extra is not None:
            out.append(("gmp only", extra))
        return out

    def table(self, n: int = 5) -> str:
        """The best ``n`` torch settings, the recorded settings, the default
        and the best of the extra settings, as a text table."""
        with_min = any(c.min_capacity is not None for _, c in self.rows(n))
        header: tuple[str, ...] = ("#", "settings", "peak reserved", f"vs {self.baseline_name}", "frag ratio",
                                   "reserved/alloc", "backend calls", "retries", "OOMs")
        rows = [header + (("fits on",) if with_min else ())]
        base = self.baseline.peak_reserved or 1

        def row(tag: str, c: Candidate) -> tuple[str, ...]:
            r = c.result
            out: tuple[str, ...] = (tag, c.describe(), format_bytes(r.peak_reserved), f"{r.peak_reserved / base:.3f}",
                   f"{c.fragmentation_ratio:.3f}", f"{r.fragmentation:.3f}", f"{r.backend_calls:,}",
                   f"{r.alloc_retries:,}", f"{r.ooms:,}" + ("" if c.fits else " (does not fit)"))
            if with_min:
                out += (format_bytes(c.min_capacity) if c.min_capacity is not None else "-",)
            return out

        for tag, c in self.rows(n):
            rows.append(row(tag, c))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [" | ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines)

    def as_dict(self, n: int = 10) -> dict[str, Any]:
        best, extra, base = self.best, self.best_extra, self.baseline
        return {
            "source": self.source, "events": self.events, "lower_bound": self.lower_bound, "limit": self.limit,
            "limit_source": self.limit_source, "excluded": list(self.excluded),
            "recorded_by": self.recorded_by, "recorded_peak_reserved": self.recorded_peak_reserved,
            "best": best.as_dict(), "default": self.default.as_dict(),
            "recorded": self.recorded.as_dict() if self.recorded is not None else None,
            "baseline": self.baseline_name, "best_is_recorded": best.recorded,
            "best_extra": extra.as_dict() if extra is not None else None,
            "saving": 1 - best.peak_reserved / self.default.peak_reserved if self.default.peak_reserved else 0.0,
            "saving_vs_baseline": 1 - best.peak_reserved / base.peak_reserved if base.peak_reserved else 0.0,
            "candidates": [c.as_dict() for c in self.candidates[:n]],
            "replays": self.replays, "seconds": self.seconds, "notes": list(self.notes),
            "torch_version": self.torch_version, "torch_target": self.torch_target, "env_var": self.env_var,
            "pitfall": self.pitfall, "partial": self.partial,
        }


def _outcome(c: Candidate) -> tuple[Any, ...]:
    """What ranks ``c`` apart from how simple its settings are."""
    return (c.complete, c.fits, c.result.ooms, c.result.peak_reserved)


def rank(c: Candidate) -> tuple[Any, ...]:
    r = c.result
    # Of settings that do not fit, the one failing the fewest allocations
    # comes closest (their peaks are capped by the limit and say nothing).
    # A replay stopped early (it reserved far more than the best then) says
    # nothing of fitting: after every complete one.
    return (not c.complete, not c.fits, r.ooms, r.peak_reserved, len(c.settings), r.backend_calls, r.alloc_retries)
