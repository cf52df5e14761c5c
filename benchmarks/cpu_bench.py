"""CPU benchmarks of the engine on the sim backend (no GPU needed).

1. Go: a cache-hit alloc+free pair with 10, 1e3 and 1e5 other free blocks in
   the pool (goal <= 150 ns/op, <= 2x growth from 10 to 1e5), and the
   parallel variants (shared pool / pool per goroutine).
2. The C ABI: a C caller that dlopens the extension and calls a pool's
   exported gmp_alloc_N / gmp_free_N, as torch does (goal <= 400 ns).
3. For scale: the same pair through the Python API, by its C fast path
   (gpumempool._fastcall) and, as the baseline, through gopy's wrappers.

Writes benchmarks/results/cpu.json and cpu.md. Run from the repo root with
gpumempool installed:  python benchmarks/cpu_bench.py
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def go_benchmarks(count: int) -> dict[str, float]:
    print(f"running Go benchmarks ({count} runs each) ...", file=sys.stderr, flush=True)
    out = subprocess.run(
        ["go", "test", "-run", "^$", "-bench", "CacheHit", "-benchtime", "1s", "-count", str(count), "./gocore"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    runs: dict[str, list[float]] = {}
    for m in re.finditer(r"^Benchmark(\S+?)(?:-\d+)?\s+\d+\s+([\d.]+) ns/op", out, re.MULTILINE):
        runs.setdefault(m.group(1), []).append(float(m.group(2)))
    return {name: statistics.median(v) for name, v in runs.items()}


def c_abi_benchmark(iters: int, repeats: int) -> float:
    import gpumempool as gmp

    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit("no C compiler for the C-ABI benchmark")
    with tempfile.TemporaryDirectory() as tmp:
        so = os.path.join(tmp, "libcaller.so")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", so, str(ROOT / "tests" / "csrc" / "testalloc.c"), "-ldl"], check=True)
        lib = ctypes.CDLL(so)
        lib.caller_open.argtypes = [ctypes.c_char_p] * 3
        lib.caller_bench.restype = ctypes.c_double
        lib.caller_bench.argtypes = [ctypes.c_size_t, ctypes.c_long]
        with gmp.MemPool("sim", name="bench") as pool:
            if lib.caller_open(*(s.encode() for s in pool.pluggable_symbols())) != 0:
                raise SystemExit("dlopen/dlsym of the extension failed")
            print(f"running the C-ABI round trip ({repeats} x {iters}) ...", file=sys.stderr, flush=True)
            return statistics.median(lib.caller_bench(4096, iters) for _ in range(repeats))


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


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--go-count", type=int, default=int(os.environ.get("GMP_BENCH_COUNT", "5")),
                    help="runs of each Go benchmark (default 5, or $GMP_BENCH_COUNT)")
    args = ap.parse_args()
    go = go_benchmarks(count=args.go_count)
    cabi = c_abi_benchmark(iters=1_000_000, repeats=5)
    py, py_gopy = python_benchmark(iters=100_000, repeats=5)
    growth = go["CacheHit/free=100000"] / go["CacheHit/free=10"]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
        "go_ns_per_op": go,
        "growth_10_to_1e5": growth,
        "c_abi_round_trip_ns": cabi,
        "python_api_round_trip_ns": py,
        "python_api_round_trip_gopy_ns": py_gopy,
        "goals": {"cache_hit_ns": 150, "growth": 2.0, "c_abi_ns": 400},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# CPU benchmarks ({result['date']}, {result['machine']})",
        "",
        "Medians; one alloc+free pair of 4 KiB served from the cache (sim backend).",
        "",
        "| benchmark | ns/op | goal |",
        "|---|---:|---:|",
    ]
    for name, ns in go.items():
        goal = "<= 150" if name.startswith("CacheHit/") else ""
        lines.append(f"| Go {name} | {ns:.1f} | {goal} |")
    lines += [
        f"| growth free=10 -> free=100000 | {growth:.2f}x | <= 2x |",
        f"| C ABI round trip (C caller -> gmp_alloc_N/gmp_free_N) | {cabi:.1f} | <= 400 |",
        f"| Python API round trip (pool.alloc + pool.free) | {py:.1f} | |",
        f"| the same through gopy's wrappers (baseline, same run) | {py_gopy:.1f} | |",
        f"| Python fast path speedup | {py_gopy / py:.2f}x | |",
    ]
    (RESULTS / "cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
