"""Cache scopes (``gmp.cache_scope``): a loop body's blocks kept for its
next iteration, per thread and stream, invalidation; and a scope under the
fake torch of tests/faketorch.py."""

from __future__ import annotations

import threading

import pytest

import gpumempool as gmp
from gpumempool import scope as gscope
from gpumempool import torch as gtorch

from faketorch import clean_state, sim  # noqa: F401 - fixtures
from faketorch import MiB, allocated, install


# ---------------------------------------------------------------------------
# cache scopes
# ---------------------------------------------------------------------------

BODY = [1000, 5000, 5000, 70_000, 3 * MiB]


def run_body(scope: gscope.CacheScope) -> list[int]:
    ptrs = [scope.alloc(n) for n in BODY]
    tmp = scope.alloc(2000)
    scope.free(tmp)
    again = scope.alloc(2000)  # reuses the block freed in this very iteration
    assert again == tmp
    for p in reversed(ptrs):
        scope.free(p)
    scope.free(again)
    return ptrs + [again]


def test_scope_reuses_the_previous_iteration_exactly(pool):
    seen = []
    for _ in range(3):
        with gmp.cache_scope(pool, "body") as scope:
            seen.append(run_body(scope))
    assert seen[0] == seen[1] == seen[2]
    assert scope.misses == len(BODY) + 1 and scope.entries == 3
    assert scope.stats()["live_bytes"] == 0 and scope.cached_bytes > 0
    gmp.invalidate("body")


def test_scope_peak_stays_flat(pool):
    peaks = []
    for _ in range(100):
        with gmp.cache_scope(pool, "loop") as scope:
            run_body(scope)
        peaks.append(pool.stats()["allocated_bytes.all.peak"])
    assert len(set(peaks)) == 1
    assert peaks[0] <= sum((n + 511) // 512 * 512 for n in BODY) + 2048
    freed = gmp.invalidate("loop")
    assert freed == sum((n + 511) // 512 * 512 for n in BODY) + 2048
    s = pool.stats()
    assert s["allocated_bytes.all.current"] == 0 and s["active.all.current"] == 0
    assert gmp.invalidate("loop") == 0
    with gmp.cache_scope(pool, "loop") as fresh:
        assert fresh is not scope and fresh.entries == 1


def test_scope_module_functions_and_blocks_outliving_it(pool):
    assert gscope.active_scope(pool) is None
    raw = gscope.alloc(pool, 4096)  # no scope: straight from the pool
    with gmp.cache_scope(pool, "s") as scope:
        assert gscope.active_scope(pool) is scope
        a = gscope.alloc(pool, 4096)
        kept = gscope.alloc(pool, 8192)
        gscope.free(pool, a)
    gscope.free(pool, raw)
    assert scope.cached_bytes == 4096 and scope.live_bytes == 8192
    gscope.free(pool, kept)  # freed after the scope exited: cached for its next entry
    assert scope.cached_bytes == 4096 + 8192
    with gmp.cache_scope(pool, "s"):
        assert gscope.alloc(pool, 8192) == kept
        late = gscope.alloc(pool, 512)
    assert gmp.invalidate("s", pool) == 4096
    gscope.free(pool, kept)  # after invalidation: to the pool
    gscope.free(pool, late)
    assert allocated(pool) == 0
    with pytest.raises(gscope.ScopeError, match="invalidated"):
        scope.alloc(100)


def test_scope_errors(pool):
    with gmp.cache_scope(pool, "e") as scope:
        with pytest.raises(gscope.ScopeError, match="entered"):
            gmp.invalidate("e")
        with pytest.raises(gmp.InvalidPointerError):
            scope.free(0x1234)
        with pytest.raises(gmp.InvalidArgumentError):
            scope.alloc(0)
        with pytest.raises(TypeError):
            scope.alloc(1.5)
    with pytest.raises(TypeError):
        with gmp.cache_scope(pool, ""):
            pass
    with pytest.raises(TypeError):
        with gmp.cache_scope("pool", "x"):
            pass
    assert isinstance(gscope.ScopeError("x"), RuntimeError)


def test_scope_keep_false_invalidates_on_exit(pool):
    with gmp.cache_scope(pool, "once", keep=False) as scope:
        for _ in range(10):
            p = scope.alloc(100_000)
            scope.free(p)
    assert scope.invalidated and scope.hits == 9 and allocated(pool) == 0


def test_scope_is_per_thread_and_per_stream(pool):
    got = {}
    with gmp.cache_scope(pool, "t") as scope:
        a = scope.alloc(1000, stream=1)
        scope.free(a)
        assert scope.alloc(1000, stream=2) != a  # another stream: not the cached block
        th = threading.Thread(target=lambda: got.update(s=gscope.active_scope(pool)))
        th.start()
        th.join()
    assert got["s"] is None


def test_scope_with_torch(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    with gmp.mempool(sim) as plain:
        pass
    for _ in range(5):
        with gmp.cache_scope(sim, "step", torch=True, device="cuda:0") as scope:
            x = torch.empty(3 * MiB)
            y = torch.empty(3 * MiB)
            del x, y
        assert allocated(sim) == 40 * MiB  # one iteration's worth (the fake gives each tensor a segment)
    pools = gtorch.torch_pools(sim)
    assert len(pools) == 2 and pools[0] is plain
    del pools  # (a reference to a torch pool keeps it, and its segments, alive)
    assert allocated(sim) == 40 * MiB  # kept in the scope's torch pool for the next iteration
    with gmp.cache_scope(sim, "step", torch=True):
        alive = torch.empty(1000)
    with pytest.raises(gtorch.PoolInUseError):
        gmp.invalidate("step")
    assert not scope.invalidated
    del alive
    gmp.invalidate("step")
    assert gtorch.torch_pools(sim) == [plain] and allocated(sim) == 0
