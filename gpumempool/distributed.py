"""Memory across the ranks of a ``torch.distributed`` job: one table on rank 0
of every rank's pools (which rank peaks, in which pool, how much is cached
but free, the largest live blocks), and one snapshot file per rank for
``python -m gpumempool plot DIRECTORY``.

::

    import gpumempool as gmp
    import gpumempool.distributed as gd

    report = gd.memory_report()          # every rank calls it (a collective)
    if report is not None:               # rank 0 gets the table
        print(report.table())
    gd.dump_snapshots("snapshots/")      # rank00000.pickle, rank00001.pickle, ...

Every rank of the group must call :func:`memory_report` and
:func:`dump_snapshots`, as with any collective. The reports travel with
``all_gather_object`` (a few kilobytes per rank), so any backend works:
gloo on CPUs, NCCL once each rank has set its CUDA device
(``torch.cuda.set_device``), as torch requires for object collectives.
Ranks may hold different pools; the report says which pools only some
ranks have. Where torch's own CUDA allocator has been used on a rank, its
figures are listed as the pool ``torch (native)``.

A rank that runs out of memory can leave its own snapshot behind, taken at
that moment (not a collective: only that rank fails)::

    gd.snapshot_on_oom("snapshots/")     # rank00003-oom1.pickle when rank 3 runs out

With allocator history recorded, the out-of-memory doctor then says in one
line which allocator setting would have fit (``...-tune.json`` and
``...-tune.txt`` beside the snapshot; ``gmp.torch.oom_doctor()`` sets it all
up in one call).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Optional

from ._oom_doctor import Diagnosis
from ._oom_snapshot import OomSnapshots, snapshot_on_oom
from ._units import format_bytes

__all__ = ["Diagnosis", "MemoryReport", "OomSnapshots", "dump_snapshots", "local_report", "memory_report", "snapshot_on_oom"]

#: The name under which torch's own CUDA allocator is listed.
TORCH_NATIVE = "torch (native)"
#: The row of a rank whose pools could not be read at all (its error says why).
_UNREAD = "(this rank)"


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise RuntimeError("gpumempool.distributed needs torch (torch.distributed)") from exc
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gpumempool.distributed: torch.distributed is not initialized in this process "
                           "(call torch.distributed.init_process_group first)")
    return dist


def _top_blocks(pool: Any, top: int) -> list[int]:
    """The sizes of the ``top`` largest allocated blocks of ``pool``."""
    sizes = []
    for seg in pool.snapshot().get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                sizes.append(int(b.get("size", 0)))
    return sorted(sizes, reverse=True)[:top]


def _pool_row(name: str, backend: str, device: Any, stats: dict[str, int], top: list[int]) -> dict[str, Any]:
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    peak_res = int(stats.get("reserved_bytes.all.peak", 0))
    peak_alloc = int(stats.get("allocated_bytes.all.peak", 0))
    return {
        "pool": name, "backend": backend, "device": device,
        "reserved": reserved, "allocated": allocated, "cached_free": max(0, reserved - allocated),
        "peak_reserved": peak_res, "peak_allocated": peak_alloc,
        "fragmentation": peak_res / peak_alloc if peak_alloc else 0.0,
        "alloc_retries": int(stats.get("num_alloc_retries", 0)), "ooms": int(stats.get("num_ooms", 0)),
        "top_blocks": top,
    }


def local_report(top: int = 5) -> dict[str, Any]:
    """This process's part of :func:`memory_report`: its open pools (and
    torch's own CUDA allocator where it has been used), with their current
    and peak bytes and their ``top`` largest live blocks. No collective."""
    from ._pool import open_pools

    rows = []
    for p in open_pools():
        try:
            rows.append(_pool_row(p.name, p.config().get("backend", "?"), p.device, p.stats(), _top_blocks(p, top)))
        except Exception as exc:  # noqa: BLE001 - a pool closed meanwhile: leave it out, say so
            rows.append({"pool": p.name, "error": f"{type(exc).__name__}: {exc}"})
    torch_row = _torch_native_row()
    if torch_row is not None:
        rows.append(torch_row)
    return {"host": socket.gethostname(), "pid": os.getpid(), "pools": rows}


def _torch_native_row() -> Optional[dict[str, Any]]:
    """torch's CUDA allocator on this rank's current device, if used."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    dev = torch.cuda.current_device()
    stats = torch.cuda.memory_stats(dev)
    if not stats.get("reserved_bytes.all.peak"):
        return None
    return _pool_row(TORCH_NATIVE, "native", dev, stats, [])


@dataclass
class MemoryReport:
    """Every rank's pools, gathered on one rank by :func:`memory_report`."""

    world_size: int
    ranks: list[dict[str, Any]]  # per rank: rank, host, pid, pools (rows of local_report)
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """One row per (rank, pool), with ``rank`` set."""
        return [dict(p, rank=r["rank"]) for r in self.ranks for p in r["pools"] if "error" not in p]

    @property
    def peak(self) -> Optional[dict[str, Any]]:
        """The (rank, pool) row with the largest peak reserved bytes."""
        rows = self.rows()
        return max(rows, key=lambda p: p["peak_reserved"]) if rows else None

    def rank_totals(self) -> dict[int, dict[str, int]]:
        """Per rank: reserved, allocated, cached-free and peak reserved
        bytes summed over its pools."""
        out: dict[int, dict[str, int]] = {}
        for r in self.ranks:
            t = out.setdefault(r["rank"], {"reserved": 0, "allocated": 0, "cached_free": 0, "peak_reserved": 0})
            for p in r["pools"]:
                if "error" not in p:
                    for k in t:
                        t[k] += p[k]
        return out

    def table(self) -> str:
        """The report as text: one line per rank and pool, then who peaks
        and how much is cached but free."""
        head = ("rank", "pool", "backend", "dev", "reserved", "allocated", "cached free", "peak reserved",
                "peak allocated", "frag", "largest blocks")
        body = []
        for p in self.rows():
            body.append((str(p["rank"]), str(p["pool"]), str(p["backend"]), str(p["device"]),
                         format_bytes(p["reserved"]), format_bytes(p["allocated"]), format_bytes(p["cached_free"]),
                         format_bytes(p["peak_reserved"]), format_bytes(p["peak_allocated"]),
                         f"{p['fragmentation']:.2f}", ", ".join(format_bytes(b, 1) for b in p["top_blocks"][:3])))
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        lines = [" | ".join(v.ljust(w) if i < 4 or i == 10 else v.rjust(w)
                            for i, (v, w) in enumerate(zip(row, widths))) for row in [head, *body]]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        peak = self.peak
        totals = self.rank_totals()
        if peak is not None:
            lines.append("")
            lines.append(f"peak: rank {peak['rank']}, pool {peak['pool']!r}: {format_bytes(peak['peak_reserved'])} "
                         f"reserved at its peak")
            top_rank = max(totals, key=lambda r: totals[r]["peak_reserved"])
            lines.append(f"rank {top_rank} has the most reserved at peak over its pools: "
                         f"{format_bytes(totals[top_rank]['peak_reserved'])}")
            free = sum(t["cached_free"] for t in totals.values())
            most = max(totals, key=lambda r: totals[r]["cached_free"])
            lines.append(f"cached but free now: {format_bytes(free)} over {self.world_size} ranks "
                         f"(most on rank {most}: {format_bytes(totals[most]['cached_free'])})")
        for r in self.ranks:
            for p in r["pools"]:
                if "error" in p:
                    lines.append(f"rank {r['rank']}, pool {p['pool']!r}: not read ({p['error']})")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "ranks": self.ranks, "notes": list(self.notes),
                "peak": self.peak, "rank_totals": {str(k): v for k, v in self.rank_totals().items()}}


def _notes(ranks: list[dict[str, Any]]) -> list[str]:
    """What differs between ranks: pools only some ranks have, ranks without pools."""
    notes = []
    names = {r["rank"]: {p["pool"] for p in r["pools"]} for r in ranks
             if not any(p["pool"] == _UNREAD for p in r["pools"])}  # what it has is not known
    everyone = set.union(*names.values()) if names else set()
    for pool in sorted(everyone, key=str):
        have = sorted(r for r, n in names.items() if pool in n)
        if len(have) != len(names):
            notes.append(f"pool {pool!r} exists on rank{'s' if len(have) > 1 else ''} "
                         f"{', '.join(map(str, have))} only")
    for r, n in sorted(names.items()):
        if not n:
            notes.append(f"rank {r} has no open pools")
    return notes


def memory_report(group: Any = None, *, dst: int = 0, top: int = 5) -> Optional[MemoryReport]:
    """Gather every rank's :func:`local_report` (a collective: every rank of
    ``group`` calls it) and return them as a :class:`MemoryReport` on the
    rank whose rank in ``group`` is ``dst``; None on the others."""
    dist = _dist()
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    if not 0 <= dst < n:
        raise ValueError(f"dst {dst} is not a rank of the group (0..{n - 1})")
    try:
        mine = local_report(top)
    except Exception as exc:  # noqa: BLE001 - said in the report: the other ranks wait in the gather below
        mine = {"host": socket.gethostname(), "pid": os.getpid(),
                "pools": [{"pool": _UNREAD, "error": f"{type(exc).__name__}: {exc}"}]}
    mine = dict(mine, rank=me, global_rank=dist.get_rank())
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, mine, group=group)
    if me != dst:
        return None
    ranks = sorted(gathered, key=lambda r: r["rank"])
    return MemoryReport(world_size=n, ranks=ranks, notes=_notes(ranks))


def dump_snapshots(directory: Any, group: Any = None) -> list[str]:
    """Write this rank's snapshot (:func:`gpumempool.snapshot`, every open
    pool, with the rank recorded in it) to ``directory/rankNNNNN.pickle``
    (a collective: every rank of ``group`` calls it; the directory is made
    where missing, and shared storage gives rank 0 every file). Returns the
    paths every rank wrote, in rank order, once all are written; raises
    OSError on every rank, naming the ranks that failed, when any did."""
    from ._snapshot import dump_snapshot, snapshot

    dist = _dist()
    me, n = dist.get_rank(group), dist.get_world_size(group)
    path = os.path.join(os.fspath(directory), f"rank{me:05d}.pickle")
    outcome: tuple[str, str] = ("ok", path)
    try:
        os.makedirs(os.fspath(directory), exist_ok=True)
        snap = snapshot()
        snap["rank"], snap["world_size"], snap["host"] = me, n, socket.gethostname()
        dump_snapshot(path, snap)
    except OSError as exc:
        outcome = ("error", f"rank {me}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure: the other ranks wait in the gather below
        outcome = ("error", f"rank {me}: {type(exc).__name__}: {exc}")
    written: list[Any] = [None] * n
    dist.all_gather_object(written, outcome, group=group)  # also the barrier: every file is written
    failed = [msg for kind, msg in written if kind != "ok"]
    if failed:
        raise OSError("dump_snapshots: " + "; ".join(failed))
    return [msg for _, msg in written]
