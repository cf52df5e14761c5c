"""Review of issue 26 (start state, recorded conditions, bad input, tune,
doctor, snapshot writer): each test here failed before its fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpumempool as gmp
from gpumempool.replay import replay
from gpumempool.trace import Trace, from_torch_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_start_state import MiB, mid_run_snapshot  # noqa: E402


def test_a_small_segment_larger_than_the_small_pool_is_not_a_go_panic() -> None:
    # A snapshot whose segment says "small" but is 40 MiB: the small pool's
    # bins hold at most 2 MiB, and seeding it panicked in the engine.
    snap = mid_run_snapshot()
    snap["segments"][0]["segment_type"] = "small"
    tr = from_torch_snapshot(snap)
    res = replay(tr)  # no BackendError (a recovered Go panic)
    assert res.ooms == 0
    # The engine refuses such a segment itself, as an invalid argument.
    pool = gmp.MemPool(backend="sim")
    with pytest.raises(gmp.InvalidArgumentError):
        pool.seed_segment([(40 * MiB, 0, False)], device=0, stream=0, small=True)
    pool.close()
