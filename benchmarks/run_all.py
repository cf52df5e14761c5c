"""Run the benchmarks this machine can run, of this checkout (or --root's):
the CPU benchmarks (benchmarks/cpu_bench.py: Go micro-benchmarks, the C-ABI
and Python round trips, a safe snapshot load; they need go and a C
compiler) and, with an NVIDIA GPU, benchmarks/gpu_backends.py, and with
torch and transformers too, benchmarks/gpt2_train.py and
benchmarks/suite_gpu.py; says what it cannot run and why. Results go to
--out DIR, else to the current directory (never into the checkout's
benchmarks/results/ unless --out names it).

    python benchmarks/run_all.py [--out DIR] [--count N] [--dry-run] [--json] [--root DIR]

(This was ``python -m gpumempool bench``, which looked for a source
checkout from an installed package; the benchmarks are the checkout's.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from gpumempool._cli.common import fail, positive

PROG = "benchmarks/run_all.py"


def _fail(message: str, code: int = 1, *, json_out: bool = False) -> int:
    """The CLI's error line (and, with ``json_out``, JSON on stdout), named for this script."""
    return fail(message, code, json_out=json_out, name=PROG)



def _find_checkout(start: Optional[str]) -> Optional[Path]:
    """The checkout whose benchmarks run: ``--root``, else this script's."""
    root = Path(start).resolve() if start is not None else Path(__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "cpu_bench.py").is_file() else None


#: The GPU benchmarks of a checkout: script, what it measures, the Python
#: modules it needs besides gpumempool, the result file it writes.
_GPU_BENCHMARKS = (
    ("benchmarks/gpu_backends.py", "raw vs cached alloc per GPU backend", (), "gpu_backends.json"),
    ("benchmarks/gpt2_train.py", "GPT-2 training in gmp.mempool vs torch's allocator, full-replacement alloc loop",
     ("torch", "transformers"), "gpt2_*.json"),
    ("benchmarks/suite_gpu.py", "torch native vs cudaMallocAsync vs gpumempool vs CuPy vs RMM as torch's allocator: "
     "alloc loops, GPT-2 step, trace replays", ("torch", "transformers"), "suite_gpu_*.json"),
)


def _bench_plan(root: Path, out: Path) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    import importlib.util

    import gpumempool as gmp

    run: list[dict[str, str]] = []
    skip: list[dict[str, str]] = []
    cpu = "benchmarks/cpu_bench.py (Go micro-benchmarks, C-ABI round trip, Python API round trip, snapshot load)"
    missing = [tool for tool, found in (("go", shutil.which("go")),
                                        ("a C compiler (cc/gcc)", shutil.which("cc") or shutil.which("gcc")))
               if not found]
    if missing:
        skip.append({"name": cpu, "reason": f"needs {' and '.join(missing)} on PATH"})
    else:
        run.append({"name": cpu, "writes": f"{out / 'cpu.json'}, cpu.md", "result": "cpu.json"})
    info = gmp.device_info()
    for script, what, modules, result in _GPU_BENCHMARKS:
        name = f"{script} ({what})"
        needs = "an NVIDIA GPU" + (f" with {' and '.join(modules)}" if modules else "")
        absent = [m for m in modules if importlib.util.find_spec(m) is None]
        if not (root / script).is_file():
            skip.append({"name": name, "reason": "not in this checkout"})
        elif not info["devices"]:
            reason = f"needs {needs} (no GPU found: {info['reason']})"
            if script.endswith("suite_gpu.py"):
                reason += f"; its trace replays alone run without one: python {script} --workloads replay"
            skip.append({"name": name, "reason": reason})
        elif absent:
            skip.append({"name": name, "reason": f"needs {', '.join(absent)} (not installed)"})
        else:
            run.append({"name": name, "writes": str(out / result.replace('*', '<device>')), "result": result})
    return run, skip


def _cmd_bench(args: argparse.Namespace) -> int:
    root = _find_checkout(args.root)
    if root is None:
        return _fail(f"--root {args.root}: not a source checkout (no benchmarks/cpu_bench.py)", 2,
                     json_out=args.json)
    # The results go where asked, or to the current directory: never over
    # the checkout's tracked benchmarks/results/ unless --out names it.
    out = Path(args.out if args.out is not None else os.getcwd()).resolve()
    if out.exists() and not out.is_dir():
        return _fail(f"--out {args.out}: not a directory", 2, json_out=args.json)
    run, skip = _bench_plan(root, out)
    if not args.json:
        print(f"gpumempool benchmarks in {root}, results to {out}")
        for r in run:
            print(f"  will run:   {r['name']}")
        for s in skip:
            print(f"  cannot run: {s['name']}: {s['reason']}")
        sys.stdout.flush()
    report: dict[str, Any] = {"root": str(root), "out": str(out), "run": run, "not_run": skip, "results": {}}
    if args.dry_run:
        if args.json:
            print(json.dumps(report, indent=2))
        return 0
    if not run:
        if args.json:
            report["error"] = "nothing this machine can run (see not_run)"
            print(json.dumps(report, indent=2))
        return _fail("nothing this machine can run (see above)" if not args.json else "nothing this machine can run")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(f"--out: {exc}", json_out=args.json)
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if args.count:
        env["GMP_BENCH_COUNT"] = str(args.count)
    rc = 0
    for r in run:
        script = r["name"].split(" ", 1)[0]
        cmd = [sys.executable, str(root / script), "--out", str(out)]
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE if args.json else None, text=True)
        r["returncode"] = str(proc.returncode)
        rc = rc or proc.returncode
        stem = Path(script).stem.replace("_bench", "")
        # the newest file of the script's name pattern (the GPU ones name the device)
        found = sorted(out.glob(r["result"]), key=lambda f: f.stat().st_mtime)
        result_file = found[-1] if found else out / f"{stem}.json"
        if proc.returncode == 0 and result_file.is_file():
            try:
                report["results"][stem] = json.loads(result_file.read_text())
            except (OSError, ValueError) as exc:
                r["error"] = f"cannot read {result_file}: {exc}"
                rc = rc or 1
        elif proc.returncode != 0:
            r["error"] = f"{script} exited with status {proc.returncode}"
    if args.json:
        print(json.dumps(report, indent=2))
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="DIR",
                    help="folder for the result files (created if missing; default: the current directory)")
    ap.add_argument("--root", help="the repository root (default: this script's checkout)")
    ap.add_argument("--count", type=positive, help="runs of each Go benchmark (GMP_BENCH_COUNT, default 5)")
    ap.add_argument("--dry-run", action="store_true", help="only say what would run and what cannot")
    ap.add_argument("--json", action="store_true", help="print the plan and results as JSON")
    return _cmd_bench(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
