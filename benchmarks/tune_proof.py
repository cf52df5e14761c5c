"""Check `gpumempool tune`'s predictions against torch itself, on a GPU.

For each workload (record_traces.py's gpt2-train, cnn-train, gpt2-infer and
the fragmentation-heavy gpt2-varlen-train):

1. record a trace with torch's native allocator (default settings);
2. run ``gmp.tune`` on it: the best torch settings, with their predicted
   peak reserved bytes (a replay on the simulated device);
3. run the same workload in fresh processes, without history, under torch's
   native allocator with the default settings and with each of the best
   few recommended ``PYTORCH_CUDA_ALLOC_CONF`` values, and read torch's
   ``max_memory_reserved()``;
4. set measurement against prediction: the goal is within 1% for every
   workload and setting, and the savings are torch's own figures.

Writes ``tune_<gpu>.md`` and ``.json`` to --out (default
benchmarks/results). Needs an NVIDIA GPU, torch with CUDA and transformers;
exits with status 2 and says why otherwise.

``--dry-run`` (CPU, no torch): tunes the shipped traces of the three
workloads that have one (benchmarks/traces/) as stand-ins for the recorded
traces, prints the runs a GPU session would make, and writes the table with
the predictions only, so everything but the GPU part is exercised.

    python benchmarks/tune_proof.py --out /tmp/tune        # on the GPU machine
    python benchmarks/tune_proof.py --dry-run --out /tmp/t  # here
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_env  # noqa: E402
import record_traces  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
WORKLOADS = ("cnn-train", "gpt2-train", "gpt2-infer", "gpt2-varlen-train")
#: Goal: |measured / predicted - 1| within this for every run.
TOLERANCE = 0.01


def say(msg: str) -> None:
    print(f"tune_proof: {msg}", file=sys.stderr, flush=True)


def measure(name: str, alloc_conf: str, args: argparse.Namespace, snapshot: Optional[Path] = None) -> dict[str, Any]:
    """Run workload ``name`` in a fresh process under ``alloc_conf`` (""
    for torch's defaults); with ``snapshot``, also record its history there."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(HERE / "record_traces.py"), "--worker", name, "--worker-out", str(out),
               *args.workload_args]
        if snapshot is not None:
            cmd += ["--worker-snapshot", str(snapshot)]
        env = dict(os.environ, PYTHONSAFEPATH="1")
        env.pop("PYTORCH_ALLOC_CONF", None)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=args.timeout)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit status {proc.returncode}: {proc.stderr.strip()[-800:]}"}
        res = json.loads(out.read_text())
        res["wall_seconds"] = time.perf_counter() - t0
        return res


def tune_trace(trace: Any, top: int, jobs: Optional[int]) -> tuple[Any, list[Any]]:
    """gmp.tune's result and the settings to measure: the default, then
    the best ``top`` distinct torch settings."""
    import gpumempool as gmp

    result = gmp.tune(trace, jobs=jobs, extra=False)
    picks = [result.default] + [c for c in result.top(top) if c.settings]
    return result, picks


def run_workload(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from gpumempool.trace import from_torch_snapshot

    row: dict[str, Any] = {"name": name, "runs": []}
    if args.dry_run:
        path = HERE / "traces" / f"{name}.trace.gz"
        if not path.exists():
            row["skipped"] = f"no shipped trace {path.name} to stand in for the recording (recorded on the GPU only)"
            return row
        trace: Any = str(path)
        row["trace"] = f"benchmarks/traces/{path.name} (shipped; stands in for the recording)"
    else:
        snap = work / f"{name}.pickle.gz"
        say(f"== {name}: recording with torch's defaults")
        rec = measure(name, "", args, snapshot=snap)
        if "error" in rec:
            row["error"] = f"recording failed: {rec['error']}"
            return row
        row["recording"] = {k: rec.get(k) for k in ("torch_max_memory_reserved", "history_entries",
                                                    "history_overflowed", "seconds")}
        row["workload"] = (rec.get("notes") or {}).get("workload", "")
        for key in ("device", "device_total_bytes", "torch", "cuda", "transformers"):
            row[key] = rec.get(key)
        trace = from_torch_snapshot(snap)
        trace.meta["capacity"] = int(rec["device_total_bytes"])
        path = work / f"{name}.trace.gz"
        trace.save(path)
        trace = str(path)
        row["trace"] = path.name
    t0 = time.perf_counter()
    result, picks = tune_trace(trace, args.top, args.jobs)
    row["tune_seconds"] = time.perf_counter() - t0
    row["events"] = result.events
    row["lower_bound"] = result.lower_bound
    row["recorded_peak_reserved"] = result.recorded_peak_reserved
    say(f"   tune: {result.replays} settings in {row['tune_seconds']:.1f} s; best "
        f"{result.best.alloc_conf or 'defaults'} -> {result.best.peak_reserved / MiB:,.1f} MiB predicted")
    for c in picks:
        run: dict[str, Any] = {"alloc_conf": c.alloc_conf, "settings": c.settings, "predicted": c.peak_reserved}
        if not args.dry_run:
            say(f"   measuring PYTORCH_CUDA_ALLOC_CONF={c.alloc_conf!r}")
            m = measure(name, c.alloc_conf or "", args)
            if "error" in m:
                run["error"] = m["error"]
            else:
                run["measured"] = m["torch_max_memory_reserved"]
                run["error_ratio"] = m["torch_max_memory_reserved"] / c.peak_reserved - 1
                run["num_alloc_retries"] = m.get("torch_num_alloc_retries")
                say(f"     torch {run['measured'] / MiB:,.1f} MiB vs predicted {c.peak_reserved / MiB:,.1f} MiB "
                    f"({100 * run['error_ratio']:+.2f}%)")
        row["runs"].append(run)
    return row


def _mib(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / MiB:,.1f}"


def write_report(doc: dict[str, Any], out: Path) -> Path:
    tag = doc.get("gpu_tag") or "dry-run"
    (out / f"tune_{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    dry = doc.get("dry_run")
    lines = [
        f"# `gpumempool tune` against torch ({doc.get('device') or 'dry run on CPU: predictions only'})",
        "",
        f"{doc['date']}; torch {doc.get('torch') or '-'}, CUDA {doc.get('cuda') or '-'}, gpumempool "
        f"{doc.get('gpumempool')}. Written by `benchmarks/tune_proof.py`"
        + (" --dry-run: the shipped traces stand in for recordings and nothing was measured." if dry else
           ": each workload was recorded with torch's native allocator (defaults), tuned, then run again in "
           "fresh processes without history under each setting; *measured* is torch's "
           "`max_memory_reserved()`."),
        "",
        "| workload | PYTORCH_CUDA_ALLOC_CONF | predicted (MiB) | measured (MiB) | measured / predicted - 1 "
        "| vs default (measured) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for row in doc["workloads"]:
        if ("error" in row or "skipped" in row) and not row.get("runs"):
            why = f"error: {str(row['error'])[:160]}" if "error" in row else f"skipped: {row['skipped']}"
            lines.append(f"| {row['name']} | {why} | | | | |")
            continue
        base = next((r.get("measured") for r in row["runs"] if r.get("alloc_conf") == ""), None)
        for r in row["runs"]:
            err = r.get("error_ratio")
            if err is not None:
                worst = max(worst, abs(err))
            vs = f"{r['measured'] / base:.3f}" if base and r.get("measured") else "-"
            lines.append(f"| {row['name']} | `{r.get('alloc_conf') or '(defaults)'}` | {_mib(r['predicted'])} "
                         f"| {_mib(r.get('measured'))} | "
                         + (f"{100 * err:+.2f}%" if err is not None else (r.get("error", "-")[:80])) + f" | {vs} |")
    lines.append("")
    if not dry:
        verdict = "met" if worst <= TOLERANCE else "NOT met"
        lines.append(f"Largest |measured / predicted - 1|: {100 * worst:.2f}% (goal {100 * TOLERANCE:.0f}%: {verdict}).")
        lines.append("")
    for row in doc["workloads"]:
        if row.get("events"):
            lines.append(f"* {row['name']}: {row.get('workload') or row.get('trace')}; {row['events']:,} events, lower "
                         f"bound {_mib(row['lower_bound'])} MiB, tuned in {row['tune_seconds']:.1f} s")
    path = out / f"tune_{tag}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tune_proof.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results"), help="where tune_<gpu>.md/.json go")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: all four)")
    ap.add_argument("--top", type=int, default=2, help="best settings measured per workload besides the default")
    ap.add_argument("--jobs", type=int, help="tune's replay processes (default: the CPU count, at most 8)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per workload process (default 240)")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: tune the shipped traces, measure nothing")
    ap.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    ap.add_argument("--requests", type=int, default=100, help="gpt2-infer requests (default 100)")
    args = ap.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in record_traces.WORKERS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; valid: {', '.join(record_traces.WORKERS)}")
    # record_traces.py's own defaults for everything else (model sizes, seeds, ...)
    args.workload_args = ["--steps", str(args.steps), "--requests", str(args.requests)]
    if not args.dry_run:
        problem = _gpu_env.gpu_problem(need_transformers=True)
        if problem:
            say(f"cannot run here: {problem} (--dry-run checks the rest on a CPU)")
            return 2
    import gpumempool as gmp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpumempool": gmp.__version__, "dry_run": args.dry_run, "tolerance": TOLERANCE, "workloads": [],
    }
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gmp-tune-proof-") as tmp:
        for name in names:
            try:
                row = run_workload(name, args, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - report it, go on with the next workload
                row = {"name": name, "error": repr(exc)[:500], "runs": []}
            if "error" in row or any("error" in r for r in row.get("runs", [])):
                failed += 1
            for key in ("device", "torch", "cuda"):
                if row.get(key) and not doc.get(key):
                    doc[key] = row[key]
            if row.get("device"):
                doc["gpu_tag"] = "".join(ch if ch.isalnum() else "_" for ch in str(row["device"]).lower()).strip("_")
            doc["workloads"].append(row)
            write_report(doc, out)  # after every workload: a run stopped by its time limit keeps what it did
    path = write_report(doc, out)
    print(path.read_text())
    worst = max((abs(r["error_ratio"]) for w in doc["workloads"] for r in w.get("runs", []) if "error_ratio" in r),
                default=0.0)
    say(f"wrote {path}" + (f"; {failed} workload(s) with errors" if failed else ""))
    if failed:
        return 1
    return 0 if args.dry_run or worst <= TOLERANCE else 3


if __name__ == "__main__":
    sys.exit(main())
