"""CPU benchmarks of the engine on the sim backend (no GPU needed).

1. Go: a cache-hit alloc+free pair with 10, 1e3 and 1e5 other free blocks in
   the pool (goal <= 60 ns/op, <= 2x growth from 10 to 1e5), and the
   parallel variants (shared pool / pool per goroutine). Besides wall time,
   the process's CPU time per pair (cpu-ns/op), which a machine shared with
   other work inflates less.
2. The C ABI: a C caller that dlopens the extension and calls a pool's
   exported gmp_alloc_N / gmp_free_N, as torch does, against its floor: the
   same C caller calling a pair of empty Go exports with the same signatures
   (benchmarks/cabifloor, built here as a C shared library and loaded in a
   process of its own, as two Go runtimes must not share one), interleaved
   in the same run. Goal: the pair within 1.5x of the floor.
3. For scale: the same pair through the Python API, by its C fast path
   (gpumempool._fastcall) and, as the baseline, through gopy's wrappers.
4. Loading a torch-like snapshot pickle safely (gpumempool.trace.load_pickle,
   whose opcode scan runs in Go), the scan alone and the walk its bound
   spares; plain pickle.loads (which would run any code in the pickle) for
   scale.

Writes cpu.json and cpu.md to --out (default benchmarks/results). Run from
the repo root with gpumempool installed:  python benchmarks/cpu_bench.py
(``python benchmarks/run_all.py`` passes --out: its own --out, or the current
directory).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def go_benchmarks(count: int) -> tuple[dict[str, float], dict[str, float]]:
    """Medians of the Go benchmarks: wall ns/op, and CPU ns/op where the
    benchmark reports it (BenchmarkCacheHit: cpu-ns/op)."""
    print(f"running Go benchmarks ({count} runs each) ...", file=sys.stderr, flush=True)
    out = subprocess.run(
        ["go", "test", "-run", "^$", "-bench", "CacheHit", "-benchtime", "1s", "-count", str(count), "./gocore"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    runs: dict[str, list[float]] = {}
    cpu_runs: dict[str, list[float]] = {}
    for m in re.finditer(r"^Benchmark(\S+?)(?:-\d+)?\s+\d+\s+([\d.]+) ns/op(?:\s+([\d.]+) cpu-ns/op)?", out,
                         re.MULTILINE):
        runs.setdefault(m.group(1), []).append(float(m.group(2)))
        if m.group(3):
            cpu_runs.setdefault(m.group(1), []).append(float(m.group(3)))
    return ({name: statistics.median(v) for name, v in runs.items()},
            {name: statistics.median(v) for name, v in cpu_runs.items()})


#: Times the floor in a process of its own (no gpumempool, so one Go
#: runtime): argv[1] is the C caller, argv[2] the floor library; each line
#: read is a number of pairs to time, answered with ns per pair.
_FLOOR_PROCESS = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.caller_open.argtypes = [ctypes.c_char_p] * 3
lib.caller_bench.restype = ctypes.c_double
lib.caller_bench.argtypes = [ctypes.c_size_t, ctypes.c_long]
if lib.caller_open(sys.argv[2].encode(), b"gmp_floor_alloc", b"gmp_floor_free") != 0:
    sys.exit("dlopen/dlsym of the floor library failed")
for line in sys.stdin:
    print(lib.caller_bench(4096, int(line)), flush=True)
"""


def c_abi_benchmark(iters: int, repeats: int) -> tuple[float, float]:
    """Medians of ns per alloc+free pair through a pool's exported entry
    points, and through the empty exports of benchmarks/cabifloor (the
    floor), by the same C caller, interleaved."""
    import gpumempool as gmp

    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit("no C compiler for the C-ABI benchmark")
    with tempfile.TemporaryDirectory() as tmp:
        so = os.path.join(tmp, "libcaller.so")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", so, str(ROOT / "tests" / "csrc" / "testalloc.c"), "-ldl"], check=True)
        floor_so = os.path.join(tmp, "libcabifloor.so")
        subprocess.run(["go", "build", "-buildmode=c-shared", "-o", floor_so, "./benchmarks/cabifloor"], cwd=ROOT, check=True)
        lib = ctypes.CDLL(so)
        lib.caller_open.argtypes = [ctypes.c_char_p] * 3
        lib.caller_bench.restype = ctypes.c_double
        lib.caller_bench.argtypes = [ctypes.c_size_t, ctypes.c_long]
        floor_proc = subprocess.Popen([sys.executable, "-c", _FLOOR_PROCESS, so, floor_so], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert floor_proc.stdin is not None and floor_proc.stdout is not None
        pairs, floors = [], []
        try:
            with gmp.MemPool("sim", name="bench") as pool:
                if lib.caller_open(*(s.encode() for s in pool.pluggable_symbols())) != 0:
                    raise SystemExit("dlopen/dlsym of the extension failed")
                print(f"running the C-ABI round trip and its floor ({repeats} x {iters} each, interleaved) ...",
                      file=sys.stderr, flush=True)
                for _ in range(repeats):
                    floor_proc.stdin.write(f"{iters}\n")
                    floor_proc.stdin.flush()
                    floors.append(float(floor_proc.stdout.readline()))
                    pairs.append(lib.caller_bench(4096, iters))
        finally:
            floor_proc.stdin.close()
            if floor_proc.wait() != 0:
                raise SystemExit("the C-ABI floor process failed")
        return statistics.median(pairs), statistics.median(floors)


def python_benchmark(iters: int, repeats: int) -> tuple[float, float]:
    """The pair through the Python API, by its C fast path and (as the
    baseline, in the same process, interleaved) through gopy's wrappers."""
    import gpumempool as gmp
    from gpumempool import _pool

    fast = _pool._fast

    def run() -> float:
        with gmp.MemPool("sim") as pool:
            t0 = time.perf_counter()
            for _ in range(iters):
                pool.free(pool.alloc(4096))
            return (time.perf_counter() - t0) / iters * 1e9

    print(f"running the Python API round trip ({repeats} x {iters}, fast path and gopy) ...", file=sys.stderr, flush=True)
    fast_ns, gopy_ns = [], []
    try:
        for _ in range(repeats):
            _pool._fast = fast
            fast_ns.append(run())
            _pool._fast = None
            gopy_ns.append(run())
    finally:
        _pool._fast = fast
    if fast is None:
        raise SystemExit("this build has no gpumempool._fastcall: the Python fast path cannot be measured")
    return statistics.median(fast_ns), statistics.median(gopy_ns)


def synthetic_snapshot(entries: int) -> bytes:
    """A pickle shaped like torch's _dump_snapshot output: device_traces
    entries that share stack frames, and segments with blocks."""
    import pickle

    frames = [{"filename": f"/src/model/layer{i}.py", "line": i, "name": f"forward{i}"} for i in range(64)]
    stacks = [frames[i:i + 12] for i in range(48)]
    trace = [{"action": ("alloc", "free_requested", "free_completed")[i % 3], "addr": 0x7F0000000000 + 512 * i,
              "size": 512 * (1 + i % 97), "stream": 0, "time_us": 1_700_000_000_000 + i,
              "frames": stacks[i % 48]} for i in range(entries)]
    segments = [{"device": 0, "address": 0x7F0000000000 + (2 << 20) * s, "total_size": 2 << 20, "stream": 0,
                 "segment_type": "small", "allocated_size": 1 << 20, "active_size": 1 << 20,
                 "blocks": [{"address": 0x7F0000000000 + (2 << 20) * s + 4096 * b, "size": 4096,
                             "requested_size": 4000, "state": "active_allocated", "frames": stacks[b % 48]}
                            for b in range(64)]} for s in range(entries // 200)]
    return pickle.dumps({"segments": segments, "device_traces": [trace]}, protocol=4)


def snapshot_load_benchmark(entries: int, repeats: int) -> dict[str, float]:
    """Seconds to load the synthetic snapshot: load_pickle (the opcode scan
    in Go, whose bound lets it skip the walk over the result), the scan
    alone, the walk it skips, and plain pickle.loads."""
    import pickle

    from gpumempool import _safepickle
    from gpumempool.trace import load_pickle

    data = synthetic_snapshot(entries)
    print(f"running snapshot loads ({repeats} x {len(data) / 1e6:.1f} MB: load_pickle, its scan, the walk, plain pickle) ...",
          file=sys.stderr, flush=True)

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    load, plain, scan, walk = [], [], [], []
    loaded = pickle.loads(data)
    limit = max(_safepickle.MIN_PICKLE_NODES, _safepickle.PICKLE_NODES_PER_BYTE * len(data))
    for _ in range(repeats):
        load.append(timed(lambda: load_pickle(data)))
        scan.append(timed(lambda: _safepickle._scan_pickle(data, "bench")))
        plain.append(timed(lambda: pickle.loads(data)))
        walk.append(timed(lambda: _safepickle._check_structure(loaded, "bench", limit)))
    return {"megabytes": len(data) / 1e6, "load_go_s": statistics.median(load),
            "plain_pickle_s": statistics.median(plain), "scan_go_s": statistics.median(scan),
            "walk_s": statistics.median(walk)}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--go-count", type=int, default=int(os.environ.get("GMP_BENCH_COUNT", "5")),
                    help="runs of each Go benchmark (default 5, or $GMP_BENCH_COUNT)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    ap.add_argument("--cabi-only", action="store_true",
                    help="only the C ABI pair and its floor, as one JSON line on stdout (nothing written): "
                         "run by benchmarks/hotpath_paired.py with another build's Python")
    args = ap.parse_args()
    if args.cabi_only:
        pair, floor_ns = c_abi_benchmark(iters=1_000_000, repeats=5)
        print(json.dumps({"pair_ns": pair, "floor_ns": floor_ns, "ratio": pair / floor_ns}))
        return
    out = args.out
    go, go_cpu = go_benchmarks(count=args.go_count)
    cabi, floor = c_abi_benchmark(iters=1_000_000, repeats=5)
    py, py_gopy = python_benchmark(iters=100_000, repeats=5)
    snap = snapshot_load_benchmark(entries=150_000, repeats=3)
    growth = go["CacheHit/free=100000"] / go["CacheHit/free=10"]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
        "go_ns_per_op": go,
        "go_cpu_ns_per_op": go_cpu,
        "growth_10_to_1e5": growth,
        "c_abi_round_trip_ns": cabi,
        "c_abi_floor_ns": floor,
        "c_abi_over_floor": cabi / floor,
        "python_api_round_trip_ns": py,
        "python_api_round_trip_gopy_ns": py_gopy,
        "snapshot_load": snap,
        "goals": {"cache_hit_ns": 60, "growth": 2.0, "c_abi_over_floor": 1.5},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# CPU benchmarks ({result['date']}, {result['machine']})",
        "",
        "Medians; one alloc+free pair of 4 KiB served from the cache (sim backend).",
        "",
        "| benchmark | ns/op | goal |",
        "|---|---:|---:|",
    ]
    for name, ns in go.items():
        goal = "<= 60" if name.startswith("CacheHit/") else ""
        lines.append(f"| Go {name} | {ns:.1f} | {goal} |")
    for name, ns in go_cpu.items():
        lines.append(f"| Go {name}, CPU time | {ns:.1f} | |")
    lines += [
        f"| growth free=10 -> free=100000 | {growth:.2f}x | <= 2x |",
        f"| C ABI round trip (C caller -> gmp_alloc_N/gmp_free_N) | {cabi:.1f} | |",
        f"| C ABI floor (the same caller -> two empty Go exports, benchmarks/cabifloor) | {floor:.1f} | |",
        f"| C ABI round trip / floor (same run) | {cabi / floor:.2f}x | <= 1.5x |",
        f"| Python API round trip (pool.alloc + pool.free) | {py:.1f} | |",
        f"| the same through gopy's wrappers (baseline, same run) | {py_gopy:.1f} | |",
        f"| Python fast path speedup | {py_gopy / py:.2f}x | |",
    ]
    mb = snap["megabytes"]
    lines += [
        "",
        f"Loading a {mb:.1f} MB torch-like snapshot pickle (protocol 4, shared stack frames); medians of 3.",
        "",
        "| step | seconds | MB/s |",
        "|---|---:|---:|",
        f"| opcode scan in Go (internal/picklescan) | {snap['scan_go_s']:.3f} | {mb / snap['scan_go_s']:.0f} |",
        f"| load_pickle, Go scan (its bound clears the walk) | {snap['load_go_s']:.3f} "
        f"| {mb / snap['load_go_s']:.0f} |",
        f"| the walk over the result (_check_structure), which the bound spares | {snap['walk_s']:.3f} "
        f"| {mb / snap['walk_s']:.0f} |",
        f"| plain pickle.loads (runs any code; for scale) | {snap['plain_pickle_s']:.3f} | {mb / snap['plain_pickle_s']:.0f} |",
    ]
    (out / "cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
