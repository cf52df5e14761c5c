"""The cache-hit hot path of this checkout against an earlier revision's, in
one run, alternated, so that a machine shared with other work slows both
alike: the Go engine pair (BenchmarkCacheHit, CPU time per pair) and the
C ABI pair as a multiple of its floor (benchmarks/cpu_bench.py --cabi-only,
run with each build's Python).

    python benchmarks/hotpath_paired.py BASE_REV [--rounds 5] [--out FILE.md]

BASE_REV is checked out in a temporary git worktree; its gocore test binary
is built with go, and its extension is pip-installed into a temporary venv
(a minute or two). This checkout's side runs with the Python that runs this
script, which must have this checkout installed (``pip install .``): the
script refuses one whose gpumempool was installed from elsewhere. Prints a
markdown table (and writes it to --out).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = re.compile(r"^BenchmarkCacheHit/(free=\d+)\s+\d+\s+([\d.]+) ns/op(?:\s+([\d.]+) cpu-ns/op)?", re.M)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def go_test_binary(src: Path, out: Path) -> Path:
    subprocess.run(["go", "test", "-c", "-o", str(out), "./gocore/"], cwd=src, check=True)
    return out


def go_round(binary: Path) -> dict[str, float]:
    """One run of BenchmarkCacheHit: wall ns per pair by free-list size
    (older binaries do not report CPU time; alternating the rounds is what
    evens out the machine's other work)."""
    out = subprocess.run([str(binary), "-test.run", "^$", "-test.bench", "CacheHit$", "-test.cpu", "1",
                          "-test.benchtime", "1s"], capture_output=True, text=True, check=True).stdout
    return {m.group(1): float(m.group(2)) for m in BENCH.finditer(out)}


def cabi_round(python: str) -> dict[str, float]:
    import json

    out = subprocess.run([python, str(ROOT / "benchmarks" / "cpu_bench.py"), "--cabi-only"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def installed_from_here() -> bool:
    """Whether this Python's gpumempool was pip-installed from this checkout."""
    import importlib.metadata
    import json

    try:
        url = importlib.metadata.distribution("gpumempool").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    if not url:
        return False
    return Path(json.loads(url).get("url", "").removeprefix("file://")).resolve() == ROOT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the earlier revision (a commit, tag or branch)")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds of each (default 5)")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True)
    if base.returncode != 0:
        ap.error(f"{args.base!r} is not a revision of this repository")
    rev = base.stdout.strip()
    if not installed_from_here():
        ap.error(f"this Python ({sys.executable}) does not have this checkout installed: run "
                 f"`{sys.executable} -m pip install {ROOT}` first, so that its side measures this build")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree, venv = Path(tmp) / "base", Path(tmp) / "venv"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True)
        try:
            log(f"building the gocore test binaries of {rev} and {head} ...")
            bins = {rev: go_test_binary(tree, Path(tmp) / "base.test"), head: go_test_binary(ROOT, Path(tmp) / "head.test")}
            log(f"installing {rev} into a temporary venv ...")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(tree)], check=True,
                           env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
            pythons = {rev: str(venv / "bin" / "python"), head: sys.executable}
            go: dict[str, list[dict[str, float]]] = {rev: [], head: []}
            cabi: dict[str, list[dict[str, float]]] = {rev: [], head: []}
            for i in range(args.rounds):
                log(f"round {i + 1}/{args.rounds}: Go pair, then the C ABI pair, {rev} and {head} in turn ...")
                for r in (rev, head) if i % 2 == 0 else (head, rev):
                    go[r].append(go_round(bins[r]))
                    cabi[r].append(cabi_round(pythons[r]))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    med = statistics.median
    lines = [f"Hot path, {rev} (base) vs {head}: medians of {args.rounds} alternated rounds on one machine.", "",
             f"| pair | {rev} | {head} | {head} / {rev} |", "|---|---:|---:|---:|"]
    for key in sorted(set(go[head][0]) & set(go[rev][0]), key=lambda k: int(k.split("=")[1])):
        b, h = med(r[key] for r in go[rev]), med(r[key] for r in go[head])
        lines.append(f"| Go CacheHit/{key}, ns | {b:.1f} | {h:.1f} | {h / b:.2f} |")
    for key, what in (("pair_ns", "C ABI pair, ns"), ("floor_ns", "C ABI floor (empty exports), ns"),
                      ("ratio", "C ABI pair / floor")):
        b, h = med(r[key] for r in cabi[rev]), med(r[key] for r in cabi[head])
        lines.append(f"| {what} | {b:.2f} | {h:.2f} | {h / b:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
