"""python -m gpumempool: info and demo."""

from __future__ import annotations

import json
import subprocess
import sys

import gpumempool as gmp
from gpumempool.__main__ import main
from gpumempool.demo import run_demo


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumempool", *args], capture_output=True, text=True, timeout=300)


def test_info_without_a_driver_exits_zero() -> None:
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert "gpumempool 0.1.0" in r.stdout
    out = json.loads(run_cli("info", "--json").stdout)
    assert out["library"] == gmp.library_path()
    if not out["devices"]:
        assert "NVML" in out["reason"] and "devices:  none" in r.stdout


def test_info_reports_what_the_torch_integration_will_do(monkeypatch) -> None:
    from faketorch import make_torch
    from gpumempool._cli import info as cli

    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            out = json.loads(run_cli("info", "--json").stdout)
            assert out["torch"] is None
            assert "torch:    not installed" in run_cli("info").stdout
    for variant, routing in (("2.11", "this thread only"), ("2.5", "every thread while inside")):
        monkeypatch.setitem(sys.modules, "torch", make_torch(variant))
        t = cli.torch_info()
        assert t["version"] == f"{variant}.0+fake" and routing in t["mempool"]
        assert t["pluggable"] is True and t["capabilities"]["mem_pool"] is True
        # The fake's raw pluggable allocator has the four classic hooks, not torch's graph ones.
        assert set(t["capabilities"]["pluggable_hooks"]) == {"init", "reset", "memory_fraction", "record_stream"}
        # The fake has no torch.distributed: NCCL registration is said to be unavailable.
        assert t["nccl_registration"].startswith("unsupported (this torch has no torch.distributed")
    out = run_cli("info").stdout
    if "torch:    not installed" not in out and "does not import" not in out:
        assert "full-replacement hooks:" in out and "CUDA graphs:" in out


def test_demo_prints_a_summary() -> None:
    r = run_cli("demo", "--steps", "20", "--layers", "6")
    assert r.returncode == 0, r.stderr
    for row in ("peak allocated", "peak reserved", "fragmentation", "cache-hit rate", "backend calls"):
        assert row in r.stdout


def test_demo_numbers_are_consistent() -> None:
    res = run_demo(steps=30, layers=8, progress=False)
    assert res.allocations == 8 + 30 * 8 * 4
    assert res.peak_reserved >= res.peak_allocated > 0
    assert 1.0 <= res.fragmentation < 2.0
    assert 0.9 < res.cache_hit_rate < 1.0
    assert res.backend_calls < res.backend_calls_without_cache / 20


def test_demo_json_and_bad_arguments(capsys) -> None:
    assert main(["demo", "--steps", "3", "--layers", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 3
    r = run_cli("demo", "--steps", "0")
    assert r.returncode == 2 and "must be positive" in r.stderr
    r = run_cli("bogus")
    assert r.returncode == 2


def test_demo_out_of_memory_is_a_one_line_error() -> None:
    """Too many --layers for the demo's 64 GiB device: the CLI's usual
    error, not a traceback (nor a LeakWarning about the demo's own pool)."""
    r = run_cli("demo", "--layers", "100000", "--steps", "2", "--no-progress")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "LeakWarning" not in r.stderr, r.stderr
    assert r.stderr.startswith("python -m gpumempool: error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "out of memory" in r.stderr and "--layers" in r.stderr


def test_library_errors_of_any_command_are_clean_errors(monkeypatch, capsys) -> None:
    import gpumempool.demo

    def broken(**kwargs):
        raise gmp.BackendError("the backend failed")

    monkeypatch.setattr(gpumempool.demo, "run_demo", broken)
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert err == "python -m gpumempool: error: BackendError: the backend failed\n"


def test_bad_numbers_do_not_name_internal_functions() -> None:
    r = run_cli("demo", "--steps", "abc")
    assert r.returncode == 2 and "_positive" not in r.stderr
    assert "argument --steps: must be a positive whole number, got 'abc'" in r.stderr


def test_the_console_script_calls_itself_by_its_name(monkeypatch) -> None:
    """Installed as `gpumempool`, the usage and errors said 'python -m gpumempool'."""
    import os

    from gpumempool import __main__ as cli

    monkeypatch.setattr(sys, "argv", [os.path.join("venv", "bin", "gpumempool"), "demo"])
    assert cli.build_parser().prog == "gpumempool"
    monkeypatch.setattr(sys, "argv", [cli.__file__, "demo"])  # python -m gpumempool
    assert cli.build_parser().prog == "python -m gpumempool"
    script = os.path.join(os.path.dirname(sys.executable), "gpumempool")
    if os.path.exists(script):
        r = subprocess.run([script, "demo", "--steps", "0"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("usage: gpumempool demo"), r.stderr
        assert "python -m" not in r.stderr
