"""Allocator policies side by side on the shipped traces (CPU, sim backend):
what torch's allocator options and our expandable segments do to peak
reserved memory, fragmentation and backend calls on the same workload.

    python benchmarks/replay_policies.py [--out benchmarks/results] [TRACE ...]

Every row replays the whole trace on a fresh simulated device; the ratio
column is peak reserved against the first row (the default policy) of the
same trace, measured in the same run. Writes replay_policies.json and
replay_policies.md. Deterministic: the numbers depend only on the trace and
the engine, not on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from gpumempool.replay import replay
from gpumempool.trace import Trace

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

#: (label, policy); the first is the baseline of the ratios.
POLICIES: list[tuple[str, dict[str, Any]]] = [
    ("default (torch's defaults)", {}),
    ("expandable segments", {"expandable": True}),
    ("max_split_size 64 MiB", {"max_split_size": 64 * MiB}),
    ("roundup_power2_divisions 4", {"roundup_power2_divisions": 4}),
    ("roundup_power2_divisions 8 + expandable", {"roundup_power2_divisions": 8, "expandable": True}),
    ("release_threshold 256 MiB", {"release_threshold": 256 * MiB}),
    ("limit 1.9 GiB (release-and-retry only)", {"limit": 1946 * MiB}),
    ("limit 1.9 GiB + garbage_collection_threshold 0.8", {"limit": 1946 * MiB, "garbage_collection_threshold": 0.8}),
]


def run(paths: list[Path]) -> dict[str, Any]:
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "traces": {}}
    for path in paths:
        trace = Trace.load(path)
        rows = []
        for label, policy in POLICIES:
            print(f"{path.name}: {label} ...", file=sys.stderr, flush=True)
            r = replay(trace, policy, recorded_policy=False)
            rows.append({
                "policy": label, "settings": policy, "peak_allocated": r.peak_allocated,
                "peak_reserved": r.peak_reserved, "fragmentation": r.fragmentation,
                "backend_calls": r.backend_calls, "ooms": r.ooms, "gc_releases": r.stats.get("num_gc_releases", 0),
                "alloc_retries": r.stats.get("num_alloc_retries", 0), "seconds": r.seconds,
            })
        base = rows[0]["peak_reserved"]
        for row in rows:
            row["reserved_vs_default"] = row["peak_reserved"] / base
        out["traces"][path.name] = {"events": len(trace), "meta": trace.meta, "rows": rows}
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# Allocator policies on the shipped traces ({res['date']})", "",
             "Replayed on the simulated device (`benchmarks/replay_policies.py`); deterministic. "
             "`vs default` is peak reserved against the first row.", ""]
    for name, t in res["traces"].items():
        lines += [f"## {name} ({t['events']:,} events)", "",
                  "| policy | peak allocated | peak reserved | vs default | fragmentation | backend calls "
                  "| alloc retries | GC releases | OOMs |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in t["rows"]:
            lines.append(
                f"| {r['policy']} | {r['peak_allocated'] / MiB:,.0f} MiB | {r['peak_reserved'] / MiB:,.0f} MiB | "
                f"{r['reserved_vs_default']:.3f} | {r['fragmentation']:.3f} | {r['backend_calls']:,} | "
                f"{r['alloc_retries']:,} | {r['gc_releases']:,} | {r['ooms']:,} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", type=Path, help="traces (default: benchmarks/traces/*.trace.gz)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    paths = args.traces or sorted((ROOT / "benchmarks" / "traces").glob("*.trace.gz"))
    if not paths:
        raise SystemExit("no traces")
    res = run(paths)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_policies.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (args.out / "replay_policies.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
