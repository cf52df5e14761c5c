"""Releasing and closing torch pools at their edges (torch pools carved from
a segment the engine cached, cudaMalloc'd segments on torch 2.5, a matrix
run that crashed), with the fake torch of tests/faketorch.py. Each
failed before its fix (found in review)."""

from __future__ import annotations

import warnings

import pytest

import gpumempool as gmp
from gpumempool import torch as gtorch
from faketorch import clean_state, install, sim  # noqa: F401 - fixtures

MiB = 1 << 20


def _kept_for(pool: object) -> list[object]:
    """The torch pools kept for good over ``pool`` (lanes kept by other
    tests' pools stay for the life of the process, by design)."""
    return [ln for ln in gtorch._lanes.retained_lanes if ln.retained_for is not None and ln.retained_for() is pool]


def _release_keeping_nothing(pool: gmp.MemPool) -> int:
    """``release(pool)``, asserting it keeps no torch pool for good (no
    RetainedTorchPoolWarning, none kept) and gives every byte back; returns
    what it released."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", gtorch.RetainedTorchPoolWarning)
        released = gtorch.release(pool)
    assert pool.stats()["allocated_bytes.all.current"] == 0 and not _kept_for(pool)
    return released


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


@pytest.mark.parametrize("variant", ["2.7", "2.11"])
def test_release_of_many_small_torch_segments_keeps_no_torch_pool(monkeypatch, sim, variant):  # noqa: F811
    """torch's segments are blocks of the engine, not always its segments:
    torch segments the engine packs into one of its own are still the
    pool's, not 'cudaMalloc'd by another thread' (no torch pool kept, every
    byte back)."""
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    with gmp.mempool(sim):
        xs = [torch.empty(1 * MiB + 4096) for _ in range(12)]  # 12 torch segments of 2 MiB
    inside = sim.stats()["allocated_bytes.all.current"]
    del xs
    assert _release_keeping_nothing(sim) == inside


@pytest.mark.parametrize("variant", ["2.7", "2.11"])
def test_release_after_reuse_of_the_engines_cache_keeps_no_torch_pool(monkeypatch, sim, variant):  # noqa: F811
    """The next torch pool is served from the engine's cache: torch segments
    carved out of one engine segment cached before are the pool's, not
    foreign (no torch pool kept for good, every byte back)."""
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    with gmp.mempool(sim):
        x = torch.empty(12 * MiB)  # one large torch segment
    del x
    assert gtorch.release(sim) >= 12 * MiB  # cached by the engine
    with gmp.mempool(sim):
        xs = [torch.empty(1 * MiB + 4096) for _ in range(4)]  # 2 MiB torch segments
    inside = sim.stats()["allocated_bytes.all.current"]
    del xs
    assert _release_keeping_nothing(sim) == inside


@pytest.mark.parametrize("variant", ["2.7", "2.11"])
def test_torch_segments_carved_from_one_cached_engine_segment_are_ours(monkeypatch, sim, variant):  # noqa: F811
    """After a release the engine keeps a 40 MiB segment cached; the next
    torch pool's two 20 MiB segments are carved from it, the second at an
    offset that is no engine segment's start. It is the pool's memory all
    the same: not 'cudaMalloc'd by another thread', so release() gives it
    back instead of keeping the torch pool for good (0 bytes, a
    RetainedTorchPoolWarning and a leak at exit)."""
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    with gmp.mempool(sim):
        x = torch.empty(40 * MiB)
    del x
    assert gtorch.release(sim) == 40 * MiB
    assert len(sim.segments()) == 1  # cached by the engine
    with gmp.mempool(sim) as tp:
        xs = [torch.empty(1 * MiB + 4096) for _ in range(2)]
    assert len(tp.snapshot()) == 2
    inside = sim.stats()["allocated_bytes.all.current"]
    del xs, tp
    assert _release_keeping_nothing(sim) == inside == 40 * MiB
