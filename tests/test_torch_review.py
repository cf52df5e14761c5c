"""Review of issue 27's torch changes: regressions found, with the fake torch
of tests/test_torch_logic.py."""

from __future__ import annotations

import warnings

import pytest

import gpumempool as gmp
from gpumempool import torch as gtorch
from test_torch_logic import clean_state, install, sim  # noqa: F401 - fixtures

MiB = 1 << 20


def test_close_on_torch_25_with_a_cudamalloc_segment_still_returns_ours(monkeypatch, sim):  # noqa: F811
    """torch 2.5: autograd's thread cudaMalloc's segments into the torch pool
    (backward inside gmp.mempool). Closing the pool hands the engine back
    the segments torch keeps cached of ours; a cudaMalloc'd one is none of
    the engine's and must neither be freed there nor stop the others."""
    torch = install(monkeypatch, "2.5")
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    world = torch._world
    with gmp.mempool(sim) as tp:
        x = torch.empty(3 * MiB)
    pid = tuple(tp.id)
    del x, tp
    world.native_next += 2 * MiB  # cudaMalloc'd by autograd's thread, freed since: listed first by torch
    segs = world.pools[pid].segs
    world.pools[pid].segs = {world.native_next: [2 * MiB, False], **segs}
    with warnings.catch_warnings():
        warnings.simplefilter("error", gmp.LeakWarning)
        report = sim.close()
    assert report.live_blocks == [] and report.bytes_freed >= 3 * MiB


def test_the_matrix_shows_a_run_that_died_after_its_tests() -> None:
    """A child that ran its tests and then died (at exit) has outcomes and an
    error: the matrix's table shows both, not 'not run'."""
    import importlib.util
    from pathlib import Path

    from _torch_versions import Outcome, VersionRun

    path = Path(__file__).resolve().parent.parent / "tools" / "torch_matrix.py"
    spec = importlib.util.spec_from_file_location("torch_matrix_review", path)
    assert spec is not None and spec.loader is not None
    tm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tm)
    run = VersionRun("py", "2.7.1+cu126", outcomes=[Outcome("test_full_replacement", "passed")],
                     error="the child pytest exited SIGABRT after its report (1 tests): terminate called")
    text = tm.table([run])
    row = next(line for line in text.splitlines() if line.startswith("| 2.7.1"))
    assert "| passed |" in row and "died" in row, row  # its outcomes, and that it died
    assert "**Error**: the child pytest exited SIGABRT" in text and "Not run" not in text
