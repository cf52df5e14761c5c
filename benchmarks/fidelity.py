"""The fidelity matrix: torch version x allocator setting x trace, the
engine's figures against torch's own caching allocator (gpumempool.oracle,
on the fake CUDA stack) at every event.

    python benchmarks/fidelity.py PYTHON [PYTHON ...] [--jobs 2] [--out benchmarks/results]

Each PYTHON has a CUDA build of torch (tools/torch_slim.py makes slim
installs). The settings are every value of tune's search space alone
(gpumempool.tune.TORCH_SPACE) plus the combinations tune recommended on the
shipped traces; garbage_collection_threshold is tried under a memory
fraction (it does nothing without one). The traces: the shipped ones
(benchmarks/traces), the external snapshots with history
(../shared/traces-external, skipped where absent) and the adversarial kinds
(gpumempool.oracle.adversarial, seeds 0-1). Writes fidelity.json and
fidelity.md: for every cell, points matched / total, and the first
difference where there is one. A setting a torch version refuses (torch
2.5 has no max_non_split_rounding_mb) is "n/a" with torch's reason.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
EXTERNAL = ROOT.parent / "shared" / "traces-external"
MiB = 1 << 20


def settings() -> list[tuple[str, Optional[float]]]:
    """(alloc conf, memory fraction) of every cell row."""
    from gpumempool.tune import TORCH_SPACE, alloc_conf

    rows: list[tuple[str, Optional[float]]] = [("", None)]
    for key, values in TORCH_SPACE.items():
        for v in values:
            if v is None or v is False:
                continue
            if key == "max_non_split_rounding_size":  # it needs a max split size
                rows.append((alloc_conf({"max_split_size": 256 * MiB, key: v}), None))
            else:  # a garbage collection threshold needs a memory fraction
                rows.append((alloc_conf({key: v}), 0.5 if key == "garbage_collection_threshold" else None))
    # What tune recommends on the shipped traces, and a memory fraction alone.
    rows += [("expandable_segments:True,roundup_power2_divisions:8", None),
             ("expandable_segments:True,max_split_size_mb:64", None), ("", 0.5)]
    return rows


def traces() -> list[tuple[str, str, int]]:
    """(label, how to load, capacity) of every column."""
    from gpumempool.oracle import adversarial

    out = [(p.name.replace(".trace.gz", ""), str(p), 80 << 30)
           for p in sorted((ROOT / "benchmarks" / "traces").glob("*.trace.gz")) if "infer" not in p.name]
    if EXTERNAL.is_dir():
        out += [(p.name.split("_")[0], str(p), 80 << 30) for p in sorted(EXTERNAL.glob("*.pickle"))]
    out += [(f"{k}:{s}", f"adversarial:{k}:{s}", adversarial.KINDS[k][1]) for k in adversarial.KINDS for s in (0, 1)]
    return out


def _load(how: str) -> Any:
    from gpumempool.oracle import adversarial
    from gpumempool.trace import from_torch_snapshot, load_trace

    if how.startswith("adversarial:"):
        _, kind, seed = how.split(":")
        return adversarial.make(kind, int(seed))
    return load_trace(how) if how.endswith(".trace.gz") else from_torch_snapshot(how)


def cell(python: str, how: str, capacity: int, conf: str, fraction: Optional[float]) -> dict[str, Any]:
    from gpumempool.oracle import OracleError, fidelity

    trace = _load(how)
    if len(trace) < 2:
        return {"status": "n/a", "why": "no history"}
    if how.startswith("adversarial:pressure") and fraction is None:
        fraction = 1.0
    try:
        c = fidelity.compare(trace, conf, python=python, capacity=capacity, fraction=fraction)
    except OracleError as e:
        return {"status": "n/a", "why": str(e).split(": ", 1)[-1][:160]}
    except ValueError as e:
        return {"status": "n/a", "why": f"engine: {e}"}
    return {"status": "exact" if c.exact else "differs", "matched": c.matched, "total": c.total,
            "first_difference": None if c.exact else c.describe().split("; ", 1)[1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pythons", nargs="+")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--only", help="only settings containing this text")
    ap.add_argument("--quick", action="store_true", help="the shipped traces and adversarial seed 0 only")
    args = ap.parse_args()
    from gpumempool.oracle import _stack

    rows = [s for s in settings() if not args.only or args.only in s[0]]
    cols = [c for c in traces() if not args.quick or not (c[2] == 80 << 30 and c[1].endswith(".pickle"))
            and not c[0].endswith(":1")]
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(), "quick": args.quick, "versions": {}}
    start = time.time()
    for py in args.pythons:
        version = _stack.find_torch(py).version
        _stack.build(_stack.find_torch(py))  # once, before the workers
        jobs = {}
        # spawn: the Go runtime of a loaded gpumempool does not survive fork()
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for conf, fraction in rows:
                for label, how, capacity in cols:
                    jobs[(conf, fraction, label)] = pool.submit(cell, py, how, capacity, conf, fraction)
            done = 0
            for fut in concurrent.futures.as_completed(jobs.values()):
                done += 1
                if done % 20 == 0:
                    print(f"torch {version}: {done}/{len(jobs)} cells, {time.time() - start:.0f} s",
                          file=sys.stderr, flush=True)
        results["versions"][version] = [
            {"conf": conf, "fraction": fraction, "trace": label, **jobs[(conf, fraction, label)].result()}
            for conf, fraction in rows for label, _, _ in cols]
    args.out.mkdir(parents=True, exist_ok=True)
    previous = args.out / "fidelity.json"
    if args.only and previous.is_file():
        # --only re-runs some rows: the other rows of the table stay.
        old = json.loads(previous.read_text())
        for version, cells in results["versions"].items():
            fresh = {(c["conf"], c["fraction"], c["trace"]): c for c in cells}
            kept = [fresh.pop((c["conf"], c["fraction"], c["trace"]), c) for c in old["versions"].get(version, [])]
            results["versions"][version] = kept + list(fresh.values())
    (args.out / "fidelity.json").write_text(json.dumps(results, indent=1) + "\n")
    labels = list(dict.fromkeys(c["trace"] for cells in results["versions"].values() for c in cells))
    (args.out / "fidelity.md").write_text(render(results, labels))
    proven = ROOT / "gpumempool" / "oracle" / "proven.json"
    proven.write_text(json.dumps(prove(results), indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out / 'fidelity.md'} and {proven}", file=sys.stderr)
    return 0


#: torch's names of the replay policy keys (tune's).
_KEYS = {"expandable_segments": "expandable", "max_split_size_mb": "max_split_size",
         "roundup_power2_divisions": "roundup_power2_divisions",
         "max_non_split_rounding_mb": "max_non_split_rounding_size",
         "garbage_collection_threshold": "garbage_collection_threshold"}


def prove(results: dict[str, Any]) -> dict[str, Any]:
    """gpumempool/oracle/proven.json: per torch version (major.minor), each
    replay policy key, proven (True) when every row with that key is exact
    wherever the defaults' row (with the same fraction) is exact. A key
    whose rows are all n/a (torch refuses it) is not listed, so not proven."""
    out: dict[str, Any] = {"source": "benchmarks/fidelity.py", "date": results["date"], "versions": {}}
    for version, cells in results["versions"].items():
        base = {(c["trace"], c["fraction"] or 0) for c in cells if c["conf"] == "" and c["status"] == "exact"}
        keys: dict[str, bool] = {}
        for c in cells:
            if not c["conf"] or c["status"] == "n/a":
                continue
            items = [i.split(":")[0] for i in c["conf"].split(",")]
            # One setting a row (max_non_split_rounding_mb comes with the
            # max_split_size_mb it needs); combinations are shown, not counted.
            if len(items) == 1:
                key = _KEYS.get(items[0])
            elif sorted(items) == ["max_non_split_rounding_mb", "max_split_size_mb"]:
                key = _KEYS["max_non_split_rounding_mb"]
            else:
                continue
            if key is None:
                continue
            judged = (c["trace"], c["fraction"] or 0) in base
            keys[key] = keys.get(key, True) and (c["status"] == "exact" or not judged)
        out["versions"][".".join(version.split("+")[0].split(".")[:2])] = keys
    return out


def render(results: dict[str, Any], labels: list[str]) -> str:
    lines = ["# Fidelity: the engine against torch's own caching allocator", "",
             f"Generated by `benchmarks/fidelity.py` on {results['date']} (torch's real allocator on the fake CUDA "
             "stack of `gpumempool.oracle`; CPU only). Each cell: events whose reserved and allocated bytes, "
             "segments, retries and OOMs equal torch's / events. **=** every point matches; n/a: torch refuses "
             "the setting or the trace has no history. Differences are listed below each table."
             + (" This run is `--quick`: the shipped traces and adversarial seed 0 (the external snapshots "
                "and seed 1 are left out; tests/test_oracle.py runs the 3-GPU external one under the defaults "
                "and its recorded expandable segments)." if results.get("quick") else ""), ""]
    for version, cells in results["versions"].items():
        lines += [f"## torch {version}", "", "| setting | " + " | ".join(labels) + " |",
                  "|---|" + "---:|" * len(labels)]
        by_row: dict[tuple[str, Any], dict[str, dict[str, Any]]] = {}
        for c in cells:
            by_row.setdefault((c["conf"], c["fraction"]), {})[c["trace"]] = c
        diffs = []
        exact = total = 0
        for (conf, fraction), row in by_row.items():
            name = (conf or "defaults") + (f" + fraction {fraction}" if fraction else "")
            out = []
            for label in labels:
                c = row[label]
                if c["status"] == "n/a":
                    out.append("n/a")
                    continue
                total += 1
                if c["status"] == "exact":
                    exact += 1
                    out.append("=")
                else:
                    out.append(f"{c['matched']}/{c['total']}")
                    diffs.append(f"- {name}, {label}: {c['first_difference']}")
            lines.append(f"| {name} | " + " | ".join(out) + " |")
        lines += ["", f"{exact} of {total} cells exact.", ""]
        if diffs:
            lines += ["Differences:", ""] + diffs + [""]
        na = sorted({f"{(c['conf'] or 'defaults')}: {c['why']}" for c in cells
                     if c["status"] == "n/a" and c.get("why") != "no history"})
        if na:
            lines += ["Not applicable:", ""] + [f"- {w}" for w in na] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
