"""The real-torch tests (tests/test_torch_gpu.py: routing with gmp.mempool,
release, set_torch_allocator with its stats, out-of-memory errors and CUDA
graphs, snapshots read by torch's memory_viz, cache scopes) under each torch of GMP_TORCH_PYTHONS, on the oracle's
fake CUDA stack, in a child pytest per torch (tests/_torch_versions.py).
The checks of tensor values, NCCL and CuPy need a real GPU and skip there.

GMP_TORCH_PYTHONS names the pythons (separated by os.pathsep; .ci/test makes
slim installs of 2.5.1, 2.11.0 and 2.15.0 with tools/torch_slim.py, which
also gives them pytest). Without it these tests skip, unless
GMP_REQUIRE_TORCH_ORACLE=1 (CI), which makes them fail. Every minor release
from 2.5 on: tools/torch_matrix.py, which writes
benchmarks/results/torch_versions.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from _torch_pythons import PYTHONS, no_torch

from _torch_versions import EXPECTED_SKIPS, KNOWN_FAILURES, VersionRun, minor, run_version


#: Tests that must pass (not skip) on every version: what the fake stack
#: can check of each feature.
MUST_PASS = (
    "test_capabilities_of_this_torch",
    "test_tensors_come_from_the_pool[cuda]",
    "test_nesting_routes_to_the_innermost_pool",
    "test_release_and_reentry_without_backend_cost",
    "test_full_replacement",
    "test_full_replacement_oom_error_torch",
    "test_full_replacement_cuda_graph_keeps_its_memory_private[cuda]",
    "test_full_replacement_after_cuda_init_is_refused",
    "test_cache_scope_peak_stays_flat",
    "test_snapshot_of_a_routed_pool_reads_in_this_torchs_memory_viz",
    "test_torch_memory_viz_renders_our_snapshot",
    "test_snapshot_holds_torchs_view_of_each_torch_pool",
    # skips where MemPool has neither option (EXPECTED_SKIPS): a detection
    # that lost them would otherwise skip it, and pass the typed-error test
    "test_mempool_options_reach_torch_where_it_has_them",
)


def _params() -> list[Any]:
    if not PYTHONS:
        return [pytest.param(None, id="no-torch")]
    from gpumempool.oracle import _stack

    return [pytest.param(p, id=_stack.find_torch(p).version.split("+")[0]) for p in PYTHONS]


def describe(run: VersionRun) -> str:
    return "\n".join(f"{o.outcome}: {o.name}: {o.reason}" for o in run.outcomes) + "\n" + run.output[-3000:]


@pytest.mark.parametrize("python", _params())
def test_real_torch_tests_on_the_fake_stack(python: Any, tmp_path: Path) -> None:
    if python is None:
        no_torch()
    run = run_version(python, tmp_path)
    assert not run.error, f"torch {run.torch_version}: {run.error}\n{run.output[-3000:]}"
    v = minor(run.torch_version)
    got = run.by_name()
    unexpected = [f"{o.name}: {o.reason}" for o in run.failed() if (v, o.name) not in KNOWN_FAILURES]
    assert not unexpected, f"torch {run.torch_version}: " + "\n".join(unexpected) + "\n" + describe(run)
    fixed = [name for (kv, name) in KNOWN_FAILURES if kv == v and got.get(name) and got[name].outcome == "passed"]
    assert not fixed, f"torch {run.torch_version}: these pass now, take them out of KNOWN_FAILURES: {fixed}"
    def by_design(n: str) -> bool:  # a skip of EXPECTED_SKIPS, for its reason
        return n in got and got[n].outcome == "skipped" and EXPECTED_SKIPS.get((v, n), "\0") in got[n].reason

    missing = [n for n in MUST_PASS if (v, n) not in KNOWN_FAILURES and not by_design(n)
               and (n not in got or got[n].outcome != "passed")]
    assert not missing, f"torch {run.torch_version}: did not pass: {missing}\n" + describe(run)


def test_a_test_that_kills_the_child_is_a_failure_with_its_cause(tmp_path: Path) -> None:
    """A test that aborts the child (as torch's C++ asserts do) is reported
    as failed, with what the process said, and the others still run."""
    if not PYTHONS:
        no_torch()
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_dies.py").write_text(
        "import os, sys\n"
        "def test_before(): pass\n"
        "def test_dies():\n"
        "    os.write(2, b'terminate called: the cause\\n'); os.abort()\n"
        "def test_after(): import torch; assert torch.cuda.is_available()\n")
    run = run_version(PYTHONS[0], tmp_path / "work", tests=("tests/test_dies.py",), rootdir=tmp_path)
    got = {o.name: (o.outcome, o.reason) for o in run.outcomes}
    assert got["test_before"] == ("passed", "") and got["test_after"] == ("passed", ""), describe(run)
    assert got["test_dies"] == ("failed", "the process died (SIGABRT) in this test: terminate called: the cause")


def test_a_child_that_dies_after_its_report_is_an_error(tmp_path: Path) -> None:
    """The child writes its report at the session's end; a process that
    dies after it (a torch pool's destructor aborting at interpreter exit,
    as torch 2.6/2.7's would with cudaMalloc'd segments) is no pass."""
    if not PYTHONS:
        no_torch()
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_dies_at_exit.py").write_text(
        "import atexit, os\n"
        "def test_fine():\n"
        "    atexit.register(lambda: (os.write(2, b'terminate called: at exit\\n'), os.abort()))\n")
    run = run_version(PYTHONS[0], tmp_path / "work", tests=("tests/test_dies_at_exit.py",), rootdir=tmp_path)
    assert run.error and "SIGABRT" in run.error, describe(run)


def test_a_child_that_collects_nothing_is_an_error(tmp_path: Path) -> None:
    """A child run that ran no test (a -k that matches none, a file with no
    tests) reports it as an error, not as an empty pass."""
    if not PYTHONS:
        no_torch()
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_none.py").write_text("def helper(): pass\n")
    run = run_version(PYTHONS[0], tmp_path / "work", tests=("tests/test_none.py",), rootdir=tmp_path)
    assert run.error, describe(run)
