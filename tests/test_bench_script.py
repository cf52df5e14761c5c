"""benchmarks/run_all.py: the benchmarks this machine can run, of a
source checkout (it was ``python -m gpumempool bench``; these tests moved
with it from test_plot_cli.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import gpumempool as gmp

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "run_all.py"


def run_bench(*args: str, cwd: Path = ROOT, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, **kw)


def bench_main(argv: Sequence[str]) -> int:
    """The script's main, run in this process (so that monkeypatch reaches it)."""
    spec = importlib.util.spec_from_file_location("gmp_run_all", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))




def test_bench_dry_run_says_what_it_cannot_run(tmp_path: Path) -> None:
    r = run_bench("--dry-run")
    assert r.returncode == 0, r.stderr
    assert "cpu_bench.py" in r.stdout and "cannot run:" in r.stdout
    assert "torch native vs cudaMallocAsync" in r.stdout
    plan = json.loads(run_bench("--dry-run", "--json").stdout)
    assert plan["root"] == str(ROOT) and plan["results"] == {}
    names = [x["name"] for x in plan["run"] + plan["not_run"]]
    assert any("cpu_bench.py" in n for n in names) and any("gpu_backends.py" in n for n in names)
    if not gmp.devices():
        gpu = next(x for x in plan["not_run"] if "gpu_backends.py" in x["name"])
        assert "needs an NVIDIA GPU" in gpu["reason"]
    r = run_bench("--dry-run", "--root", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "not a source checkout" in r.stderr
    # run from anywhere, it benchmarks its own checkout
    plan = json.loads(run_bench("--dry-run", "--json", cwd=tmp_path).stdout)
    assert plan["root"] == str(ROOT)


def test_bench_lists_the_gpu_scripts_of_the_checkout(monkeypatch, capsys) -> None:
    """bench said the GPU suite was 'not in this version (issue 5, section
    4)' although benchmarks/suite_gpu.py and gpt2_train.py are: it names
    every GPU script, and what each needs."""
    import importlib.util

    assert bench_main(["--dry-run", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    for script in ("gpu_backends.py", "gpt2_train.py", "suite_gpu.py"):
        assert f"benchmarks/{script}" in out
    assert "issue" not in out and "not in this version" not in out
    if not gmp.devices():
        assert out.count("needs an NVIDIA GPU") == 3 and "--workloads replay" in out
    # With a GPU (faked) and torch and transformers (faked present), all three run.
    monkeypatch.setattr(gmp, "device_info", lambda: {"devices": [{"index": 0}], "reason": ""})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("torch", "transformers") else real(name, *a))
    assert bench_main(["--dry-run", "--json", "--root", str(ROOT)]) == 0
    plan = json.loads(capsys.readouterr().out)
    ran = " ".join(r["name"] for r in plan["run"])
    assert all(s in ran for s in ("gpu_backends.py", "gpt2_train.py", "suite_gpu.py")), plan
    # Without transformers, the two that need it say so.
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else object() if name == "torch"
                        else real(name, *a))
    assert bench_main(["--dry-run", "--json", "--root", str(ROOT)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [r["reason"] for r in plan["not_run"] if "gpt2_train" in r["name"]] == ["needs transformers (not installed)"]


#: A stand-in cpu_bench.py: writes its result file to --out (default, as the
#: real one, the checkout's benchmarks/results/).
_STUB_CPU_BENCH = (
    "import argparse, json, os, pathlib\n"
    "ap = argparse.ArgumentParser()\n"
    "ap.add_argument('--out', type=pathlib.Path, default=pathlib.Path(__file__).parent / 'results')\n"
    "out = ap.parse_args().out\n"
    "(out / 'cpu.json').write_text(json.dumps({'count': os.environ.get('GMP_BENCH_COUNT')}))\n"
    "print('| stub | 1 |')\n"
)


def test_bench_writes_to_out_or_the_current_directory_never_the_checkout(tmp_path: Path) -> None:
    """Issue 18: `python -m gpumempool bench` (now this script) overwrote the tracked files in
    the checkout's benchmarks/results/. The results go to --out DIR, else to
    the current directory; the checkout's results only when --out names
    them."""
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks" / "results").mkdir(parents=True)
    (checkout / "benchmarks" / "cpu_bench.py").write_text(_STUB_CPU_BENCH)
    tracked = checkout / "benchmarks" / "results" / "cpu.json"
    tracked.write_text("tracked")
    tools = tmp_path / "bin"  # what the plan looks for on PATH; the stub needs neither
    tools.mkdir()
    for name in ("go", "cc"):
        (tools / name).write_text("#!/bin/sh\nexit 0\n")
        (tools / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}")
    work = tmp_path / "work"
    work.mkdir()
    r = run_bench("--root", str(checkout), "--json", cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert tracked.read_text() == "tracked", "the checkout's tracked result was overwritten"
    assert (work / "cpu.json").is_file()
    report = json.loads(r.stdout)
    assert report["out"] == str(work.resolve()) and report["results"]["cpu"] == {"count": None}
    out = tmp_path / "results" / "new"
    r = run_bench("--root", str(checkout), "--out", str(out), cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert f"results to {out.resolve()}" in r.stdout and "| stub | 1 |" in r.stdout
    assert (out / "cpu.json").is_file() and tracked.read_text() == "tracked"
    plan = json.loads(run_bench("--root", str(checkout), "--dry-run", "--json", "--out", str(out),
                              cwd=work, env=env).stdout)
    assert plan["run"][0]["writes"].startswith(str(out.resolve() / "cpu.json"))
    # asked for: the checkout's own results folder
    r = run_bench("--root", str(checkout), "--out", str(tracked.parent), cwd=work, env=env)
    assert r.returncode == 0 and tracked.read_text() != "tracked", r.stderr
    r = run_bench("--root", str(checkout), "--out", str(tracked), cwd=work, env=env)
    assert r.returncode == 2 and "not a directory" in r.stderr


def test_bench_runs_the_cpu_script_of_a_checkout(tmp_path: Path) -> None:
    """A stand-in checkout whose cpu_bench.py only writes its result file."""
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "cpu_bench.py").write_text(_STUB_CPU_BENCH)
    r = run_bench("--root", str(tmp_path), "--count", "2", "--json", cwd=tmp_path)
    report = json.loads(r.stdout)
    if report["run"] and "cpu_bench" in report["run"][0]["name"]:
        assert r.returncode == 0, r.stderr
        assert report["results"]["cpu"] == {"count": "2"}
    else:  # no go or no C compiler here: said so, nothing run
        assert r.returncode == 1 and "needs" in report["not_run"][0]["reason"]
    r = run_bench("--root", str(tmp_path), "--count", "1", cwd=tmp_path)
    assert "| stub | 1 |" in r.stdout or r.returncode == 1


def test_bench_json_without_a_checkout_prints_a_json_error(tmp_path: Path, capsys) -> None:
    rc = bench_main(["--json", "--root", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and "error" in json.loads(out) and "no" in err
