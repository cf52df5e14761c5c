"""GPU backend benchmarks: for each backend, raw backend alloc+free
latency per size against the engine's cached re-supply of the same size
(goal: cached >= 50x faster), and the engine's peak reserved vs requested on
a mixed-size workload. The latencies are measured in Go by
benchmarks/backendbench, which this script builds (so it needs Go, as
building gpumempool does). Needs an NVIDIA GPU; run on the device machine:

    python benchmarks/gpu_backends.py [--out benchmarks/results]

Writes gpu_backends.json and gpu_backends.md (with the device name).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gpumempool as gmp

ROOT = Path(__file__).resolve().parent.parent

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB, GiB]
BACKENDS = {
    "cuda": {},
    "async": {},
    "vmm": {},
    "vmm-expandable": {"backend": "vmm", "gpu": {"expandable": True}},
    "nccl": {},
    "host": {},
}


def iters_for(size: int) -> int:
    return 2000 if size <= MiB else 200 if size <= 256 * MiB else 50


@functools.lru_cache(maxsize=None)
def backendbench() -> str:
    """benchmarks/backendbench (the latency measurement, in Go: not part of
    the extension): $GMP_BACKENDBENCH, else wheelhouse/backendbench (what
    tools/build-gpu-wheel.sh builds for the device machine, which has no
    Go), else built once into a temporary folder."""
    for exe in (os.environ.get("GMP_BACKENDBENCH"), os.path.join(ROOT, "wheelhouse", "backendbench")):
        if exe and os.access(exe, os.X_OK):
            return exe
    if shutil.which("go") is None:
        raise RuntimeError("benchmarks/backendbench is not built and there is no Go here to build it: run "
                           "tools/build-gpu-wheel.sh (it puts wheelhouse/backendbench beside the wheel) or set "
                           "GMP_BACKENDBENCH")
    tmp = tempfile.mkdtemp(prefix="gmp-backendbench-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    exe = os.path.join(tmp, "backendbench")
    subprocess.run(["go", "build", "-o", exe, "./benchmarks/backendbench"], cwd=ROOT, check=True)
    return exe


def measure_latency(opts: dict, size: int, iters: int) -> list[dict]:
    """backendbench's rows for one size; a RuntimeError with its message
    when it fails (a backend that cannot be built or used)."""
    res = subprocess.run([backendbench(), "-options", json.dumps(opts), "-sizes", str(size), "-iters", str(iters)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().removeprefix("backendbench: ") or f"backendbench exited {res.returncode}")
    rows: list[dict] = json.loads(res.stdout)
    return rows


def bench_backend(name: str, spec: dict) -> list[dict]:
    opts = {"backend": spec.get("backend", name), "options": spec.get("gpu", {})}
    rows = []
    for size in SIZES:
        rows.extend(measure_latency(opts, size, iters_for(size)))
        r = rows[-1]
        cold = f"  cold {r['raw_cold_ns']:>10,.0f} ns (x{r['speedup_vs_cold']:,.0f})" if "raw_cold_ns" in r else ""
        print(f"  {name:15s} {size:>12,d} B  raw {r['raw_ns']:>12,.0f} ns  cached {r['cached_ns']:>8,.0f} ns"
              f"  x{r['speedup']:,.0f}{cold}", file=sys.stderr, flush=True)
    return rows


def mixed_workload(name: str, spec: dict, steps: int = 20000, seed: int = 0) -> dict:
    """Random alloc/free of log-uniform sizes (512 B .. 64 MiB), ~200 live."""
    backend = spec.get("backend", name)
    kwargs = spec.get("gpu", {})
    rng = random.Random(seed)
    live: list[tuple[int, int]] = []
    requested = peak_requested = 0
    with gmp.MemPool(backend, **kwargs) as pool:
        for _ in range(steps):
            if live and (len(live) > 200 or rng.random() < 0.45):
                ptr, n = live.pop(rng.randrange(len(live)))
                pool.free(ptr)
                requested -= n
            else:
                n = int(2 ** rng.uniform(9, 26))
                live.append((pool.alloc(n), n))
                requested += n
                peak_requested = max(peak_requested, requested)
        for ptr, _ in live:
            pool.free(ptr)
        s = pool.stats()
    return {
        "peak_requested": peak_requested,
        "peak_allocated": s["allocated_bytes.all.peak"],
        "peak_reserved": s["reserved_bytes.all.peak"],
        "reserved_over_requested": s["reserved_bytes.all.peak"] / peak_requested,
        "backend_calls": s["num_device_alloc"] + s["num_device_free"],
        "allocations": s["allocation.all.allocated"],
    }


def load_nccl() -> None:
    """The nccl backend uses a libnccl already loaded in the process, else
    $GMP_LIBNCCL, else the loader's search path; NCCL usually comes with
    torch (a pip package outside that path), and importing torch loads it.
    backendbench runs in a process of its own: it gets the path of the
    libnccl torch loaded as $GMP_LIBNCCL."""
    if os.environ.get("GMP_LIBNCCL"):
        return
    try:
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001 - the nccl backend then reports what it finds
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libnccl" in line}
    except OSError:
        return
    if len(paths) == 1:
        os.environ["GMP_LIBNCCL"] = paths.pop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    args = ap.parse_args()
    devices = gmp.devices()
    if not devices:
        raise SystemExit(f"no GPU: {gmp.device_info()['reason']}")
    device = devices[0]["name"]
    names = args.backends.split(",")
    if "nccl" in names:
        load_nccl()
    result = {"date": datetime.date.today().isoformat(), "device": device, "backends": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        spec = BACKENDS[name]
        print(f"{name} ...", file=sys.stderr, flush=True)
        try:
            result["backends"][name] = {"latency": bench_backend(name, spec), "mixed": mixed_workload(name, spec)}
        except (gmp.GpuMemPoolError, RuntimeError) as exc:  # measure_latency raises RuntimeErrors
            result["backends"][name] = {"error": str(exc)}
            print(f"  {name}: {exc}", file=sys.stderr)
        write(result, out)  # after every backend: a run cut short keeps what it measured
    print((out / "gpu_backends.md").read_text())
    failed = [name for name, r in result["backends"].items() if "error" in r]
    if failed:  # the results are written; the exit status tells gpu-check.sh
        raise SystemExit(f"gpu_backends: {', '.join(failed)} failed (see the table)")


def write(result: dict, out: Path) -> None:
    device = result["device"]
    (out / "gpu_backends.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# GPU backends ({result['date']}, {device})", "",
             "Raw backend alloc+free vs the engine's cached re-supply of the same size (ns per pair). "
             "`async`'s CUDA pool is a cache itself, so its raw pairs are hits in that cache; "
             "raw cold empties it first (cuMemPoolTrimTo after a stream sync, not timed).", "",
             "| backend | size | raw ns | raw cold ns | cached ns | speedup (goal >= 50x) | vs cold |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["backends"].items():
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | error: {r['error'][:80]} | - |")
            continue
        for row in r["latency"]:
            cold = (f"{row['raw_cold_ns']:,.0f} | ", f"{row['speedup_vs_cold']:,.0f}x") if "raw_cold_ns" in row else ("- | ", "-")
            lines.append(f"| {name} | {row['size']:,} | {row['raw_ns']:,.0f} | {cold[0]}{row['cached_ns']:,.0f} | "
                         f"{row['speedup']:,.0f}x | {cold[1]} |")
    lines += ["", "Mixed workload (20,000 random alloc/free, 512 B..64 MiB, ~200 live):", "",
              "| backend | peak requested | peak reserved | reserved / requested | backend calls |", "|---|---:|---:|---:|---:|"]
    for name, r in result["backends"].items():
        if "mixed" in r:
            m = r["mixed"]
            lines.append(f"| {name} | {m['peak_requested'] / MiB:,.1f} MiB | {m['peak_reserved'] / MiB:,.1f} MiB | "
                         f"{m['reserved_over_requested']:.3f} | {m['backend_calls']:,} |")
    (out / "gpu_backends.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
