"""CPU checks of the scripts a GPU session runs: tools/build-gpu-wheel.sh,
tools/gpu-check.sh, benchmarks/record_traces.py, benchmarks/suite_gpu.py and
benchmarks/gpu_stress.py. Their GPU work cannot run here; what can is
checked: syntax, --help without torch, a clear "no GPU" refusal, gpu-check.sh
without a wheel, and the CPU-side halves (snapshot conversion and replay
summary, the suite's report and chart, trace replays, the stress report),
plus gpu_stress.py whole over the stand-in CUDA where torch is installed."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHELL_SCRIPTS = [ROOT / "tools" / name for name in ("build-gpu-wheel.sh", "gpu-check.sh", "gpu-dryrun.sh",
                                                     "torch-versions.sh")]
PY_SCRIPTS = [ROOT / "benchmarks" / name for name in ("record_traces.py", "suite_gpu.py", "gpt2_train.py",
                                                      "gpu_stress.py", "tune_proof.py")]
MiB = 1 << 20

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def has_gpu() -> bool:
    try:
        import gpumempool as gmp

        return bool(gmp.devices())
    except Exception:
        return False


def load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"gmp_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(cmd: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), **env}
    return subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=tmp_path, timeout=300)


@needs_bash
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_scripts_compile(script: Path, tmp_path: Path) -> None:
    r = run([sys.executable, "-m", "py_compile", str(script)], tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_help_needs_no_torch(script: Path, tmp_path: Path) -> None:
    # torch, CuPy and transformers made unimportable: --help must not need them
    code = (
        "import runpy, sys\n"
        "for m in ('torch', 'cupy', 'transformers', 'matplotlib'):\n"
        "    sys.modules[m] = None\n"
        f"sys.argv = [{str(script)!r}, '--help']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    r = run([sys.executable, "-c", code], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout and "--out" in r.stdout
    assert "GPU" in r.stdout


@pytest.mark.skipif(has_gpu(), reason="a GPU is present: the scripts would run for real")
@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_refuses_clearly_without_a_gpu(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run([sys.executable, str(script), "--out", str(out)], tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "cannot run here: no GPU" in r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_tune_proof_dry_run(tmp_path: Path) -> None:
    """Issue 20's torch proof, on a CPU: the shipped trace stands in for the
    recording, gmp.tune picks the settings to measure, the report is
    written with the predictions (and a workload recorded on the GPU only is
    skipped, not failed)."""
    import gpumempool as gmp

    out = tmp_path / "out"
    r = run([sys.executable, str(PY_SCRIPTS[4]), "--dry-run", "--workloads", "cnn-train,gpt2-varlen-train",
             "--out", str(out), "--jobs", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "tune_dry-run.json").read_text())
    cnn, varlen = doc["workloads"]
    assert "skipped" in varlen and "recorded on the GPU only" in varlen["skipped"]
    expect = gmp.tune(ROOT / "benchmarks" / "traces" / "cnn-train.trace.gz", jobs=1, extra=False)
    runs = cnn["runs"]
    assert runs[0]["alloc_conf"] == "" and runs[0]["predicted"] == expect.default.peak_reserved
    assert runs[1]["alloc_conf"] == expect.best.alloc_conf and runs[1]["predicted"] == expect.best.peak_reserved
    assert all("measured" not in run for run in runs)
    md = (out / "tune_dry-run.md").read_text()
    # the best setting and its predicted peak in MiB (568.0 since the engine
    # maps torch's 20 MiB pages; 552.0 before)
    assert f"| cnn-train | `{expect.best.alloc_conf}` | {expect.best.peak_reserved / MiB:.1f} | - |" in md
    assert expect.best.alloc_conf == "expandable_segments:True"
    assert "skipped: no shipped trace gpt2-varlen-train.trace.gz" in md
    r = run([sys.executable, str(PY_SCRIPTS[4]), "--dry-run", "--workloads", "bogus"], tmp_path)
    assert r.returncode == 2 and "unknown workload" in r.stderr


def test_record_traces_rejects_unknown_workload(tmp_path: Path) -> None:
    r = run([sys.executable, str(PY_SCRIPTS[0]), "--workloads", "gpt2-train,bogus"], tmp_path)
    assert r.returncode == 2 and "unknown workload" in r.stderr


# -- tools/gpu-check.sh ---------------------------------------------------------


def gpu_check(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    empty = tmp_path / "wheelhouse"
    empty.mkdir(exist_ok=True)
    base = {"OUT": str(tmp_path / "out"), "GMP_WORK": str(tmp_path / "work"), "GMP_VENV": str(tmp_path / "venv"),
            "GMP_WHEELHOUSE": str(empty)}
    return run(["bash", str(SHELL_SCRIPTS[1]), *args], tmp_path, **{**base, **env})


@needs_bash
def test_gpu_check_without_a_wheel_fails_clearly(tmp_path: Path) -> None:
    r = gpu_check(tmp_path, "info", "gputests")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "no wheel" in r.stderr and "tools/build-gpu-wheel.sh" in r.stderr and 'carry=["wheelhouse"]' in r.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "no wheel" in summary and "| gputests | **not run** |" in summary
    assert not (tmp_path / "venv").exists()


@needs_bash
def test_gpu_check_several_wheels_fail_clearly(tmp_path: Path) -> None:
    wh = tmp_path / "wheelhouse"
    wh.mkdir()
    for v in ("0.1.0", "0.2.0"):
        (wh / f"gpumempool-{v}-cp312-cp312-linux_x86_64.whl").write_bytes(b"")
    r = gpu_check(tmp_path, "info")
    assert r.returncode == 3 and "several gpumempool cp312 wheels" in r.stderr


def source_digest(root: Path, tmp_path: Path) -> str:
    r = run(["bash", "-c", f'ROOT={str(root)!r}; . {str(ROOT / "tools" / "source-digest.sh")!r}; source_digest'],
            tmp_path, GIT_CEILING_DIRECTORIES=str(tmp_path))
    assert r.returncode == 0 and len(r.stdout.strip()) == 16, r.stderr
    return r.stdout.strip()


@needs_bash
def test_gpu_check_refuses_a_wheel_built_from_other_sources(tmp_path: Path) -> None:
    # wheelhouse/ is git-ignored and outlives commits: a wheel built before
    # the last edits would spend device time testing old code.
    wh = tmp_path / "wheelhouse"
    wh.mkdir()
    (wh / "gpumempool-0.1.0-cp312-cp312-linux_x86_64.whl").write_bytes(b"")
    (wh / "BUILD-INFO").write_text("wheel: x\nsources: 0123456789abcdef\n")
    r = gpu_check(tmp_path, "info")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "built from other sources (0123456789abcdef)" in r.stderr and "tools/build-gpu-wheel.sh" in r.stderr
    (wh / "BUILD-INFO").write_text(f"sources: {source_digest(ROOT, tmp_path)}\n")
    r = gpu_check(tmp_path, "info", PYTHON="/nonexistent/python3.12")
    assert "other sources" not in r.stderr  # the next check (the interpreter) speaks now


@needs_bash
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_source_digest_is_the_same_on_the_device(tmp_path: Path) -> None:
    # The device gets the files git lists (tracked, or untracked and not
    # ignored) and no .git: the digest must not tell the two apart, and must
    # change with any source byte.
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "bindings", "gocore", "gpumempool",
                            "setup.py", "pyproject.toml", "go.mod", "go.sum", "MANIFEST.in"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    copy = tmp_path / "device"
    for f in files:
        if (ROOT / f).is_file():
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / f, copy / f)
    (copy / "gpumempool" / "__pycache__").mkdir(exist_ok=True)
    (copy / "gpumempool" / "__pycache__" / "x.pyc").write_bytes(b"ignored")
    here = source_digest(ROOT, tmp_path)
    assert source_digest(copy, tmp_path) == here
    with open(copy / "gocore" / "pool.go", "a") as f:
        f.write("// edited\n")
    assert source_digest(copy, tmp_path) != here


@needs_bash
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_source_digest_counts_files_with_unusual_names(tmp_path: Path) -> None:
    # git quotes such names unless told not to: they must count, the same
    # way with git and without
    repo = tmp_path / "repo"
    (repo / "gpumempool").mkdir(parents=True)
    (repo / "gpumempool" / "caf\u00e9 x.py").write_text("a = 1\n")
    (repo / "go.mod").write_text("module x\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    before = source_digest(repo, tmp_path)
    (repo / "gpumempool" / "caf\u00e9 x.py").write_text("a = 2\n")
    with_git = source_digest(repo, tmp_path)
    assert with_git != before, "the file counts"
    shutil.rmtree(repo / ".git")
    assert source_digest(repo, tmp_path) == with_git, "find sees what git lists"


@needs_bash
def test_gpu_check_arguments(tmp_path: Path) -> None:
    r = gpu_check(tmp_path, "bogus")
    assert r.returncode == 2 and "unknown stage or group 'bogus'" in r.stderr
    r = gpu_check(tmp_path, "--help")
    assert r.returncode == 0
    for word in ("part1", "part2", "part3", "gputests", "sanitizer", "stress", 'carry=["wheelhouse"]'):
        assert word in r.stdout


@needs_bash
def test_gpu_check_has_a_torch_versions_stage(tmp_path: Path) -> None:
    """Issue 27, item 5: the GPU suite under the machine's torch and a newer
    one; the stage runs tools/torch-versions.sh and is asked for like any
    other (its name has a dash: its time budget is GMP_T_TORCH_VERSIONS)."""
    assert "tools/torch-versions.sh" in _stage_command("torch-versions")
    r = gpu_check(tmp_path, "--help")
    assert "torch-versions" in r.stdout and "part5" in r.stdout
    r = gpu_check(tmp_path, "part5")
    assert r.returncode == 3 and "no wheel" in r.stderr  # accepted; stopped by the missing wheel
    assert "| torch-versions | **not run** |" in (tmp_path / "out" / "summary.md").read_text()
    assert 'var=${var//-/_}' in (ROOT / "tools" / "gpu-check.sh").read_text()


def _fake_torch_python(tmp_path: Path, version: str) -> Path:
    """A venv whose torch is a stub reporting version: the machine's
    python as tools/torch-versions.sh sees it (it imports torch first)."""
    venv = tmp_path / "machine"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return py


def _stub_torch_wheel(directory: Path, version: str) -> Path:
    """A pure-Python wheel of a stub torch that reports version."""
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    whl = directory / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {"torch/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return whl


def torch_versions(tmp_path: Path, py: Path, caches: list[Path]) -> subprocess.CompletedProcess:
    env = {"PY": str(py), "WORK": str(tmp_path / "work"), "GMP_TORCH_WHEELS": ":".join(map(str, caches)),
           "GMP_TORCH_FIND": "0", "GMP_TORCH_VERSIONS_DRY_RUN": "1", "HOME": str(tmp_path),
           "WHEELHOUSE": str(tmp_path / "wheelhouse"), "PIP_NO_CACHE_DIR": "1"}
    return run(["bash", str(ROOT / "tools" / "torch-versions.sh")], tmp_path, **env)


@needs_bash
def test_torch_versions_dry_run_says_why_the_newer_torch_is_not_run(tmp_path: Path) -> None:
    """The device has no internet: without a torch 2.15 wheel on the machine,
    or with one pip cannot install, the stage says so on its last line and
    exits 99 (gpu-check's "skipped", with that line as the detail); the
    machine's torch is run all the same."""
    py = _fake_torch_python(tmp_path, "2.11.0")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = torch_versions(tmp_path, py, [empty])
    assert r.returncode == 99, (r.stdout, r.stderr)
    assert f"+ timeout 200 {py} -m pytest" in r.stdout and "tests/test_torch_gpu.py" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("torch 2.11.0: dry run, not run; torch 2.15: not run: no torch-2.15*.whl in any wheel cache")
    assert str(empty) in last and "no internet" in last

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch-2.15.0-py3-none-any.whl").write_bytes(b"not a zip")
    r = torch_versions(tmp_path, py, [empty, broken])
    assert r.returncode == 99, (r.stdout, r.stderr)
    last = r.stdout.strip().splitlines()[-1]
    assert f"torch 2.15: not run: pip could not install torch==2.15.* offline from {broken}" in last
    assert "--no-index" in r.stdout and "--no-deps" in r.stdout  # tried with its dependencies, then without


@needs_bash
def test_torch_versions_dry_run_installs_the_newer_torch_offline(tmp_path: Path) -> None:
    """With a torch 2.15 wheel in a cache, it goes into a venv of its own
    (offline), shadowing the machine's torch there, and the GPU suite is run
    with that venv's python."""
    py = _fake_torch_python(tmp_path, "2.11.0")
    cache = tmp_path / "cache"
    _stub_torch_wheel(cache, "2.15.0")
    r = torch_versions(tmp_path, py, [cache])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    new_py = tmp_path / "work" / "torch-2.15-venv" / "bin" / "python"
    assert f"+ timeout 200 {new_py} -m pytest" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "torch 2.11.0: dry run, not run; torch 2.15.0: dry run, not run"
    assert "--no-index" in (tmp_path / "work" / "logs" / "torch-install.log").read_text()


@needs_bash
def test_build_gpu_wheel_refuses_a_wrong_python(tmp_path: Path) -> None:
    before = sorted(p.name for p in (ROOT / "wheelhouse").glob("*")) if (ROOT / "wheelhouse").is_dir() else None
    r = run(["bash", str(SHELL_SCRIPTS[0])], tmp_path, GMP_PY312=sys.executable if sys.version_info[:2] != (3, 12)
            else "/nonexistent/python3.12")
    assert r.returncode != 0
    assert "build-gpu-wheel: error:" in r.stderr
    after = sorted(p.name for p in (ROOT / "wheelhouse").glob("*")) if (ROOT / "wheelhouse").is_dir() else None
    assert before == after


# -- the CPU halves of the Python scripts -----------------------------------------


def fake_torch_snapshot() -> dict:
    """torch.cuda.memory._snapshot() of a tiny run recorded from the start."""
    A, B = 0x7F0000000000, 0x7F0000400000

    def e(action: str, addr: int, size: int, t: int) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}

    trace = [
        e("segment_alloc", A, 2 * MiB, 1), e("alloc", A, 4096, 2), e("alloc", A + 4096, 8192, 3),
        e("segment_alloc", B, 20 * MiB, 4), e("alloc", B, 12 * MiB, 5),
        e("free_requested", A + 4096, 8192, 6), e("free_completed", A + 4096, 8192, 6),
        e("free_requested", B, 12 * MiB, 7), e("free_completed", B, 12 * MiB, 7),
        e("alloc", B, 6 * MiB, 8),
    ]
    seg = lambda addr, size, blocks: {"device": 0, "address": addr, "total_size": size, "stream": 0,  # noqa: E731
                                      "segment_type": "large", "frames": [], "blocks": blocks}
    blk = lambda addr, size, state: {"address": addr, "size": size, "requested_size": size, "state": state,  # noqa: E731
                                     "frames": []}
    return {
        "segments": [seg(A, 2 * MiB, [blk(A, 4096, "active_allocated"), blk(A + 4096, 2 * MiB - 4096, "inactive")]),
                     seg(B, 20 * MiB, [blk(B, 6 * MiB, "active_allocated"), blk(B + 6 * MiB, 14 * MiB, "inactive")])],
        "device_traces": [trace],
    }


def test_record_traces_conversion_and_summary(tmp_path: Path) -> None:
    rt = load(PY_SCRIPTS[0])
    snap = tmp_path / "tiny.pickle.gz"
    with gzip.open(snap, "wb") as f:
        pickle.dump(fake_torch_snapshot(), f)
    info = {"name": "tiny", "seconds": 1.5, "history_entries": 10, "history_overflowed": False,
            "torch_max_reserved": 22 * MiB, "torch_max_allocated": 12 * MiB + 12288, "device": "NVIDIA H100 80GB HBM3",
            "device_total_bytes": 80 << 30, "torch": "2.11.0", "cuda": "13.0", "notes": {"workload": "a tiny test"}}
    row = rt.convert_and_replay("tiny", snap, info, tmp_path)
    row["workload"] = "a tiny test"
    trace = tmp_path / "tiny.trace.gz"
    assert trace.is_file() and row["trace"] == "tiny.trace.gz"
    assert row["recorded_peak_reserved"] == 22 * MiB
    assert row["recorded_vs_memory_stats"] == pytest.approx(1.0)
    assert set(row["replay"]) == {"default", "expandable"}
    assert row["replay"]["default"]["recorded_by"] == "torch"
    assert row["replay"]["default"]["reserved_vs_recorded"] > 0

    from gpumempool.trace import Trace

    back = Trace.load(trace)
    assert back.meta["name"] == "tiny" and back.meta["capacity"] == 80 << 30 and back.meta["notes"] == "a tiny test"
    assert back.counts()["alloc"] == 4

    doc = {"date": "today", "device": info["device"], "torch": "2.11.0", "cuda": "13.0", "gpumempool": "0.1.0",
           "traces": [row, {"name": "broken", "error": "worker exited with status 1"}]}
    rt.write_summary(doc, tmp_path)
    md = (tmp_path / "replay_summary.md").read_text()
    assert "| tiny.trace.gz | " in md and "error: worker exited" in md
    assert json.loads((tmp_path / "replay_summary.json").read_text())["traces"][0]["name"] == "tiny"


def test_suite_report_and_chart_from_results(tmp_path: Path) -> None:
    sg = load(PY_SCRIPTS[1])
    args = sg.argparse.Namespace(backend="cuda", loop_ops=100, rmm_initial_pool=2 * MiB, steps=20, warmup=5, batch=4,
                                 seq=64, vocab=512, embd=64, layers=2, heads=2, seed=1, timeout=60, rounds=3)
    loop = lambda c, t, r: {"config": c, "workload": "loop", "empty_del_ns_per_op": t,  # noqa: E731
                            "window32_ns_per_op": 2 * t, "peak_reserved": r, "device_used_peak": r + MiB}
    gpt2 = lambda c, s, r: {"config": c, "workload": "gpt2", "median_step_s": s, "peak_reserved": r,  # noqa: E731
                            "losses": [1.0, 0.9]}
    results = {
        "native:loop": loop("native", 1000.0, 100 * MiB), "async:loop": loop("async", 1500.0, 80 * MiB),
        "gmp-context:loop": loop("gmp-context", 1100.0, 100 * MiB),
        "gmp-replace:loop": {"config": "gmp-replace", "workload": "loop", "error": "timed out after 60 s"},
        "cupy:loop": loop("cupy", 900.0, 120 * MiB),
        "native:gpt2": gpt2("native", 0.020, 1000 * MiB), "gmp-context:gpt2": gpt2("gmp-context", 0.0202, 990 * MiB),
        "async:gpt2": gpt2("async", 0.021, 1100 * MiB),
        "rmm:loop": loop("rmm", 950.0, 128 * MiB), "rmm:gpt2": gpt2("rmm", 0.0199, 1024 * MiB),
    }
    replays = [{"trace": "gpt2-train.trace.gz", "path": "x", "policies": {
        "default": {"events": 10, "peak_reserved": 90 * MiB, "recorded_by": "torch",
                    "recorded_peak_reserved": 100 * MiB, "reserved_vs_recorded": 0.9},
        "expandable": {"events": 10, "peak_reserved": 110 * MiB, "recorded_by": "torch",
                       "recorded_peak_reserved": 100 * MiB, "reserved_vs_recorded": 1.1}}}]
    doc = sg.build_doc(args, list(sg.CONFIGS), "NVIDIA H200", results, replays, {"cupy:gpt2": "n/a"}, {"torch": "2.11"})
    s = doc["summary"]
    assert s["loop"]["async"]["empty_del_time"] == pytest.approx(1.5)
    assert s["loop"]["cupy"]["peak_reserved"] == pytest.approx(1.2)
    assert "gmp-replace" not in s["loop"]
    assert s["gpt2"]["gmp-context"]["step_time"] == pytest.approx(1.01)
    assert s["gpt2"]["gmp-context"]["losses_identical_to_native"] is True
    assert s["loop"]["rmm"]["window32_time"] == pytest.approx(0.95) and s["gpt2"]["rmm"]["peak_reserved"] == 1.024
    assert s["replay"]["gpt2-train.trace.gz"] == {"default": 0.9, "expandable": 1.1}
    paths = sg.write_outputs(doc, tmp_path)
    assert [p.name for p in paths][:2] == ["suite_gpu_h200.json", "suite_gpu_h200.md"]
    md = paths[1].read_text()
    assert "| gmp-replace | failed: timed out after 60 s |" in md
    assert "Rounds that failed" not in md
    assert "1.010" in md and "1.050 **(goal <= 1.02)**" in md  # async step time misses the goal
    assert "1.100 **(goal <= 1)**" in md  # expandable replay over torch's
    assert "| rmm | 19.90 | 0.995 | 1,024.0 | 1.024 **(goal <= 1)** | True |" in md
    assert json.loads(paths[0].read_text())["skipped"] == {"cupy:gpt2": "n/a"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert paths[2].name == "suite_gpu_h200.png" and paths[2].stat().st_size > 1000
    # written after every run, so a run cut short by the caller's time limit leaves what it measured
    doc["partial"] = "3 of 10 GPU runs"
    paths = sg.write_outputs(doc, tmp_path / "partial", chart=False)
    assert len(paths) == 2 and "**Partial results**: 3 of 10 GPU runs" in paths[1].read_text()


def test_suite_combines_rounds_by_median_time_and_largest_peak(tmp_path: Path) -> None:
    sg = load(PY_SCRIPTS[1])
    rounds = [
        {"config": "gmp-replace", "workload": "loop", "empty_del_ns_per_op": 5600.0, "window32_ns_per_op": 5700.0,
         "peak_reserved": 100, "device_used_peak": 120},
        {"config": "gmp-replace", "workload": "loop", "empty_del_ns_per_op": 3000.0, "window32_ns_per_op": 3200.0,
         "peak_reserved": 100, "device_used_peak": 130},
        {"config": "gmp-replace", "workload": "loop", "error": "timed out after 60 s"},
        {"config": "gmp-replace", "workload": "loop", "empty_del_ns_per_op": 3100.0, "window32_ns_per_op": 3150.0,
         "peak_reserved": 110, "device_used_peak": 125},
    ]
    r = sg.combine_rounds(rounds)
    assert r["rounds"] == 3 and r["round_errors"] == ["timed out after 60 s"]
    assert r["empty_del_ns_per_op"] == 3100.0 and r["empty_del_ns_per_op_all"] == [5600.0, 3000.0, 3100.0]
    assert r["window32_ns_per_op"] == 3200.0
    assert r["peak_reserved"] == 110 and r["device_used_peak"] == 130
    assert "error" not in r
    assert sg.combine_rounds(rounds[2:3]) == rounds[2]  # every round failed: that is the result
    doc = {"date": "today", "device": "NVIDIA H100", "versions": {}, "config": {"backend": "cuda", "rounds": 4,
           "loop_ops": 100}, "configs": ["native", "gmp-replace"], "results": {"native:loop": rounds[1],
           "gmp-replace:loop": r}, "summary": {"loop": {}, "gpt2": {}, "replay": {}}, "replays": [], "skipped": {}}
    md_path = tmp_path / "suite.md"
    sg.write_markdown(doc, md_path)
    assert "Rounds that failed (the figures above are from the others): gmp-replace:loop: 1 (timed out after 60 s)" \
        in md_path.read_text()
    gpt2 = [{"median_step_s": s, "losses": losses} for s, losses in ((0.03, [2.0, 1.5]), (0.02, [2.0, 1.5]),
                                                                       (0.025, [2.0, 1.4]))]
    r = sg.combine_rounds(gpt2)
    assert r["median_step_s"] == 0.025 and r["losses"] == [2.0, 1.5] and r["losses_same_every_round"] is False


def test_gpt2_report_partial_and_complete(tmp_path: Path) -> None:
    g2 = load(PY_SCRIPTS[2])
    args = g2.argparse.Namespace(steps=20, warmup=5, batch=4, seq=64, vocab=512, embd=64, layers=2, heads=2, seed=1,
                                 loop_ops=100, loop_backend="cuda", out=str(tmp_path), rounds=2, interleaved=True)
    run = lambda s, r, losses: {"median_step_s": s, "peak_reserved": r, "losses": losses,  # noqa: E731
                                "reentry_device_allocs": 0}
    dev = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-x", "total_bytes": 80 << 30}
    caps = g2.argparse.Namespace(begin_fn="x")
    results = {"native": run(0.020, 1000 * MiB, [2.0, 1.5])}
    doc, out, stem = g2.write_results(results, {}, args, dev, {"torch": "2.11"}, caps, partial="1 of 5 modes")
    md = (out / f"{stem}.md").read_text()
    assert stem == "gpt2_h100" and "**Partial results**: 1 of 5 modes ran" in md
    assert "| loop | native (ns/op)" in md and "| empty then del | not run | | |" in md
    results["mempool-vmm"] = run(0.0203, 990 * MiB, [2.0, 1.5])
    results["mempool-nccl"] = run(0.021, 1010 * MiB, [2.0, 1.4])
    loop = lambda t, w: {"empty_del_ns_per_op": t, "window32_ns_per_op": w}  # noqa: E731
    results["loop-native"] = {"rounds": [loop(1000.0, 2000.0), loop(1100.0, 2000.0)]}
    results["loop-replacement"] = {"rounds": [loop(1200.0, 2800.0), loop(4000.0, 2800.0)]}
    doc, out, stem = g2.write_results(results, {}, args, dev, {"torch": "2.11"}, caps)
    md = (out / f"{stem}.md").read_text()
    assert "Partial" not in md and "partial" not in json.loads((out / f"{stem}.json").read_text())
    train = doc["summary"]["train"]
    assert train["mempool-vmm"]["losses_identical"] is True and train["mempool-nccl"]["losses_identical"] is False
    assert train["mempool-vmm"]["step_time_ratio"] == pytest.approx(1.015)
    assert train["mempool-vmm"]["step_time_from"] == "separate processes"
    assert "1.015 (yes)" in md and "1.050 (**no**)" in md and "1.010 (**no**)" in md  # nccl misses both goals
    # the loop: medians over the rounds (1050 and 2600 ns), every round's figure shown
    assert doc["summary"]["loop"]["empty_del"] == pytest.approx(2600 / 1050)
    assert "| empty then del | 1050 (1000, 1100) | 2600 (1200, 4000) | 2.48 (**no**) |" in md
    assert "| 32 tensors alive | 2000 (2000, 2000) | 2800 (2800, 2800) | 1.40 (**no**) |" in md
    # the side-by-side run, when it ran, gives the step-time figure; the separate runs stay beside it
    side = lambda s, losses: {"median_step_s": s, "losses": losses}  # noqa: E731
    results["interleaved"] = {"mode": "interleaved", "runs": {
        "native": side(0.030, [2.0, 1.5]), "mempool-vmm": side(0.0303, [2.0, 1.5]), "mempool-nccl": side(0.0297, [2.0, 1.6])}}
    doc, out, stem = g2.write_results(results, {}, args, dev, {"torch": "2.11"}, caps)
    md = (out / f"{stem}.md").read_text()
    train = doc["summary"]["train"]
    assert train["mempool-vmm"]["step_time_ratio"] == pytest.approx(1.01)
    assert train["mempool-vmm"]["step_time_ratio_separate"] == pytest.approx(1.015)
    assert train["mempool-nccl"]["step_time_ratio"] == pytest.approx(0.99) and train["mempool-nccl"]["step_time_from"] == "interleaved"
    assert train["mempool-nccl"]["interleaved_losses_identical"] is False
    assert "| mempool-vmm | 30.30 | 1.010 (yes) | 20.30, 1.015 |" in md
    assert "(side by side: **False**)" in md


def test_suite_replays_the_shipped_traces_on_cpu(tmp_path: Path) -> None:
    r = run([sys.executable, str(PY_SCRIPTS[1]), "--workloads", "replay", "--configs", "native,rmm", "--out",
             str(tmp_path / "res")], tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(next((tmp_path / "res").glob("suite_gpu_*.json")).read_text())
    if importlib.util.find_spec("rmm") is None:  # named, not silently dropped
        assert "rmm" not in doc["configs"] and "wheelhouse/rmm" in doc["skipped"]["rmm"]
    names = [row["trace"] for row in doc["replays"]]
    assert "demo-synthetic.trace.gz" in names
    demo = doc["replays"][names.index("demo-synthetic.trace.gz")]["policies"]["default"]
    assert demo["recorded_by"] == "gpumempool" and demo["reserved_vs_recorded"] == pytest.approx(1.0)


# -- benchmarks/gpu_stress.py ------------------------------------------------------

STRESS = PY_SCRIPTS[3]


@pytest.mark.parametrize("args, message", [
    (["--backends", "cuda,bogus"], "unknown backend(s) bogus"),
    (["--threads", "1"], "--threads must be at least 2"),
    (["--threads", "16", "--streams", "2"], "at most 31"),
    (["--seconds", "0"], "--seconds more than 0"),
    # float() takes these: a NaN deadline ended every thread at once, an infinite one never (and int() of it failed)
    (["--seconds", "nan"], "--seconds more than 0"),
    (["--seconds", "inf"], "--seconds more than 0"),
    (["--check-every", "nan"], "--check-every"),
])
def test_gpu_stress_rejects_bad_arguments(args: list[str], message: str, tmp_path: Path) -> None:
    r = run([sys.executable, str(STRESS), "--out", str(tmp_path / "out"), *args], tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def stress_row(**kw: Any) -> dict[str, Any]:
    row = {"backend": "cuda", "threads": 8, "c_abi_threads": 4, "wall_s": 50.2, "operations": 1_000_000,
           "allocs": 400_000, "frees": 400_000, "ooms": 12, "record_streams": 70_000, "bytes_touched": 3 << 40,
           "verified": 400_000, "corrupted": 0, "leaked_bytes": 2 * MiB, "errors": [], "violations": []}
    return {**row, **kw}


def test_gpu_stress_report_goals(tmp_path: Path) -> None:
    gs = load(STRESS)
    doc: dict[str, Any] = {
        "date": "today", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "gpumempool": "0.1.0",
        "sanitizer_friendly": False, "backends": {"cuda": stress_row()},
        "config": {"seconds": 50.0, "threads": 8, "streams": 2, "seed": 1, "max_mib": 64, "live_mib": 1024,
                   "leak_tolerance_mib": 64.0}}
    assert gs.write_report(doc, tmp_path) is True
    md = (tmp_path / "gpu_stress.md").read_text()
    assert "| cuda | 8 (4) | 50.2 | 1,000,000 | 400,000 | 12 | 70,000 | 3,072.0 | 400,000 | 0 | 0 | 2.0 | 0 | ok |" in md
    assert "NVIDIA H100 80GB HBM3" in md and "goal <= 64 MiB" in md
    # each goal missed on its own row: corruption, a violation, a leak, an error, a worker with no result
    doc["backends"].update({
        "vmm": stress_row(backend="vmm", corrupted=3, first_unconfirmed="thread 2, 7.0 s in: 3 of 900"),
        "vmm-expandable": stress_row(backend="vmm-expandable", violations=["stats num_ooms = 3, the operations say 2"]),
        "async": stress_row(backend="async", leaked_bytes=65 * MiB, errors=["thread 1: RuntimeError('x')\ntrace"]),
        "nothing": {"backend": "nothing", "errors": ["the worker process exited with status -11 and no result"]},
    })
    assert gs.write_report(doc, tmp_path) is False
    back = json.loads((tmp_path / "gpu_stress.json").read_text())
    assert back["ok"] is False and back["backends"]["cuda"]["goals_missed"] == []
    missed = {name: row["goals_missed"] for name, row in back["backends"].items()}
    assert missed["vmm"] == ["3 of 400000 tag verifications not confirmed by the GPU"]
    assert missed["vmm-expandable"] == ["1 violations"]
    assert missed["async"] == ["1 errors", "device memory 65.0 MiB short after close"]
    assert missed["nothing"] == ["1 errors", "tags not verified"]
    md = (tmp_path / "gpu_stress.md").read_text()
    assert "* vmm: first seen at a checkpoint: thread 2, 7.0 s in: 3 of 900" in md
    assert "* async, error: `thread 1: RuntimeError('x')`" in md and "trace" not in md  # first lines only
    assert "| nothing | - (-) | - | 0 | 0 | 0 | 0 | 0.0 | - | - | 0 | - | 1 | **1 errors; tags not verified** |" in md
    # no verification at all is no pass, and no leak goal under memcheck
    doc["backends"] = {"cuda": stress_row(verified=0, leaked_bytes=900 * MiB)}
    doc["config"]["leak_tolerance_mib"], doc["sanitizer_friendly"] = None, True
    assert gs.write_report(doc, tmp_path, stem="gpu_stress_sanitizer") is False
    md = (tmp_path / "gpu_stress_sanitizer.md").read_text()
    assert "sanitizer-friendly" in md and "not a goal here" in md and "0 of 0 tag verifications" in md
    assert "MiB short" not in md


@pytest.fixture(scope="session")
def fake_gpu_with_nvml(fake_gpu_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """fake_gpu_env plus a stand-in libnvidia-ml, which the scripts' "is there
    a GPU" check asks (as tools/gpu-dryrun.sh builds it)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler for the stand-in NVML")
    lib = tmp_path_factory.mktemp("fakenvml")
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"),
                    str(ROOT / "gocore" / "nvmldev" / "testdata" / "fake_nvml.c")], check=True)
    return {**fake_gpu_env, "LD_LIBRARY_PATH": f"{lib}:{fake_gpu_env['LD_LIBRARY_PATH']}"}


def run_stress(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    # PYTHONDONTWRITEBYTECODE, not run()'s PYTHONPYCACHEPREFIX: with an empty
    # prefix each worker process would compile torch's Python sources again
    return subprocess.run([sys.executable, str(STRESS), "--out", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, env={**env, "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1"}, cwd=tmp_path,
                          timeout=600, check=False)


def test_gpu_stress_over_the_stand_in_cuda(fake_gpu_with_nvml: dict[str, str], tmp_path: Path) -> None:
    """The whole script over real torch and the stand-in CUDA (kernels do
    nothing): threads through the C ABI and the Python API, streams, limits,
    handoffs and record_stream run; the stats come out exact and the pools
    close clean; and since no kernel ran, no tag is confirmed, which must
    fail the run rather than pass it."""
    out = tmp_path / "out"
    r = run_stress(tmp_path, fake_gpu_with_nvml, "--seconds", "1", "--threads", "3", "--max-mib", "1",
                   "--live-mib", "4")
    assert r.returncode == 1, r.stderr[-3000:]
    doc = json.loads((out / "gpu_stress.json").read_text())
    assert list(doc["backends"]) == ["cuda", "vmm", "vmm-expandable", "async"] and doc["ok"] is False
    for name, row in doc["backends"].items():
        assert row["errors"] == [] and row["violations"] == [], (name, row["errors"], row["violations"])
        assert row["c_abi_threads"] == 1 and row["allocs"] == row["frees"] > 100
        assert row["record_streams"] > 0 and row["handoffs"] > 0
        assert row["verified"] == row["allocs"] and row["corrupted"] == row["verified"], name
        n = row["verified"]
        assert row["goals_missed"] == [f"{n} of {n} tag verifications not confirmed by the GPU"]
    assert "**" in (out / "gpu_stress.md").read_text()
    assert not list(out.glob(".gpu_stress_*"))  # the workers' results are read and removed


def _stage_command(stage: str) -> str:
    script = (ROOT / "tools" / "gpu-check.sh").read_text()
    start = script.index("stage_cmd() {")
    m = re.search(rf"^\s*{stage}\)\n(.*?);;", script[start:], re.M | re.S)
    assert m, f"gpu-check.sh has no {stage} stage"
    return m.group(1)


def test_every_gpu_marked_test_runs_in_a_gpu_check_stage() -> None:
    """Issue 18: test_gpu_stress_short_run_on_a_gpu was marked gpu but no
    stage of tools/gpu-check.sh ran it (gputests named two files). Every
    test the suite marks gpu is in what the gputests stage runs."""
    cmd = _stage_command("gputests")
    assert "-m gpu" in cmd
    paths = set(re.findall(r"(?<![\w/.-])tests(?:/[\w.]+\.py)?(?![\w/.-])", cmd))
    assert paths, cmd
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONSAFEPATH="1"))  # the installed package, not the source tree
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    collected = [line.strip() for line in r.stdout.splitlines() if "::" in line]
    assert "tests/test_gpu_scripts.py::test_gpu_stress_short_run_on_a_gpu" in collected
    missed = sorted({t for t in collected if "tests" not in paths and t.split("::")[0] not in paths})
    assert not missed, f"gpu-marked tests no gpu-check.sh stage runs: {missed}"


@pytest.mark.gpu
def test_gpu_stress_short_run_on_a_gpu(tmp_path: Path) -> None:
    """A few seconds of the stress on a real GPU: every goal met."""
    from conftest import import_or_skip

    import_or_skip("torch")
    r = run_stress(tmp_path, dict(os.environ), "--seconds", "3", "--threads", "4", "--backends",
                   "cuda,vmm-expandable,async")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    doc = json.loads((tmp_path / "out" / "gpu_stress.json").read_text())
    assert doc["ok"] and all(row["verified"] > 0 for row in doc["backends"].values())


def _plan(tmp_path: Path, *args: str, **env: str) -> list[str]:
    r = gpu_check(tmp_path, "--plan", *args, **env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert not (tmp_path / "out").exists(), "a plan writes nothing"
    return r.stdout.strip().splitlines()


@needs_bash
def test_critical_run_is_one_call_under_nine_minutes(tmp_path: Path) -> None:
    """Issue 29, item 1: `critical` runs info, the gpu-marked tests, the tune
    proof, the oracle on the GPU and GPT-2, in that order, in short forms,
    within one call: the budgets with the wheel install (20 s) and the
    margin fit the deadline, and the deadline is under nine minutes."""
    lines = _plan(tmp_path, "critical")
    stages = [line.split()[1] for line in lines[:-1]]
    assert stages == ["info", "gputests", "tune", "oracle", "gpt2"]
    assert not any("skipped" in line or "(timeout " in line for line in lines[:-1]), lines
    budgets = [int(re.search(r"budget (\d+)s", line).group(1)) for line in lines[:-1]]  # type: ignore[union-attr]
    deadline = int(re.search(r"deadline (\d+)s", lines[-1]).group(1))  # type: ignore[union-attr]
    assert sum(budgets) + 20 + 10 <= deadline <= 9 * 60
    assert "a stage that does not fit what is left is skipped" in lines[-1]
    args = {line.split()[1]: line.partition(" args: ")[2] for line in lines[:-1]}
    assert "--workloads cnn-train,gpt2-infer" in args["tune"] and args["oracle"] == "--quick"
    assert "--rounds 1" in args["gpt2"]
    r = gpu_check(tmp_path, "--help")
    assert 'run(command="bash tools/gpu-check.sh critical", carry=["wheelhouse"], timeout_s=600)' in r.stdout
    # the caller's settings win over the critical defaults
    lines = _plan(tmp_path, "critical", GMP_T_GPUTESTS="200", GMP_TUNE_ARGS="--workloads cnn-train")
    assert lines[1] == "plan: gputests budget 200s" and lines[2].endswith("args: --workloads cnn-train")


@needs_bash
def test_a_stage_that_does_not_fit_is_skipped_not_half_run(tmp_path: Path) -> None:
    """In the critical run a stage whose budget exceeds what is left is
    skipped (a later, shorter one may still run); the other groups give a
    stage what is left. The plan follows the rule run_stage follows."""
    lines = _plan(tmp_path, "critical", GMP_CHECK_DEADLINE="300")
    assert lines[:4] == ["plan: info budget 30s", "plan: gputests budget 150s",
                         "plan: tune skipped: needs 160s, 90s left in this call",
                         "plan: oracle budget 75s args: --quick"]
    assert lines[4].startswith("plan: gpt2 skipped: no time left in this call")
    lines = _plan(tmp_path, "info", "gputests", "bench", GMP_CHECK_DEADLINE="300")
    assert lines[1] == "plan: gputests budget 300s (timeout 210s: what is left)"
    assert lines[2].startswith("plan: bench skipped: no time left")
    script = (ROOT / "tools" / "gpu-check.sh").read_text()
    run_stage = script[script.index("run_stage() {"):]
    assert 'stage_fit "$stage"' in run_stage[:run_stage.index("\n}\n")]


@needs_bash
def test_critical_run_without_a_wheel_fails_clearly(tmp_path: Path) -> None:
    r = gpu_check(tmp_path, "critical")
    assert r.returncode == 3 and "no wheel" in r.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    for stage in ("info", "gputests", "tune", "oracle", "gpt2"):
        assert f"| {stage} | **not run** |" in summary


def test_critical_tune_args_run_the_tune_proof(tmp_path: Path) -> None:
    """The critical run's tune arguments are the script's own: its CPU dry
    run with them tunes both workloads and plans the default and the one
    best setting of each."""
    script = (ROOT / "tools" / "gpu-check.sh").read_text()
    args = re.search(r'\[tune\]="([^"]+)"', script).group(1).split()  # type: ignore[union-attr]
    out = tmp_path / "out"
    r = run([sys.executable, str(PY_SCRIPTS[4]), "--dry-run", *args, "--out", str(out), "--jobs", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "tune_dry-run.json").read_text())
    assert [w["name"] for w in doc["workloads"]] == ["cnn-train", "gpt2-infer"]
    assert all(len(w["runs"]) == 2 and w["runs"][0]["alloc_conf"] == "" for w in doc["workloads"])


@pytest.mark.parametrize("stage,script", [("oracle", "oracle_gpu.py"), ("gpt2", "gpt2_train.py")])
def test_critical_args_are_the_scripts_own(stage: str, script: str, tmp_path: Path) -> None:
    text = (ROOT / "tools" / "gpu-check.sh").read_text()
    args = re.search(rf'\[{stage}\]="([^"]+)"', text).group(1).split()  # type: ignore[union-attr]
    source = (ROOT / "benchmarks" / script).read_text()
    for flag in (a for a in args if a.startswith("--")):
        assert f'"{flag}"' in source, f"{script} has no {flag}"
