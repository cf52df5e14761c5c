"""The CuPy integration (``gmp.cupy``) without CuPy: a fake ``cupy``
module (:func:`make_cupy`) with its allocator hooks; thread-local and
process-wide use, finalizers, cache scopes, close."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import types
from typing import Any

import pytest

import gpumempool as gmp

from faketorch import clean_state, sim  # noqa: F401 - fixtures
from faketorch import allocated


# ---------------------------------------------------------------------------
# CuPy
# ---------------------------------------------------------------------------


def make_cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    state: dict[str, Any] = {"allocator": "cupy-default", "device": 0, "stream": 0}
    tls = threading.local()

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem: Any, offset: int) -> None:
            self.mem, self.ptr = mem, mem.ptr + offset

    @contextlib.contextmanager
    def using_allocator(fn: Any = None) -> Any:
        prev = getattr(tls, "allocator", None)
        tls.allocator = fn
        try:
            yield
        finally:
            tls.allocator = prev

    def alloc(size: int) -> Any:
        fn = getattr(tls, "allocator", None) or state["allocator"]
        return fn(size)

    cp.cuda = types.SimpleNamespace(
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        set_allocator=lambda fn=None: state.update(allocator=fn),
        get_allocator=lambda: state["allocator"],
        using_allocator=using_allocator,
        alloc=alloc,
        get_current_stream=lambda device_id=None: types.SimpleNamespace(
            ptr=state.get("streams", {}).get(state["device"] if device_id is None else device_id, state["stream"])),
        runtime=types.SimpleNamespace(getDevice=lambda: state["device"]),
    )
    cp._state = state  # type: ignore[attr-defined]
    return cp


def test_cupy_without_cupy(monkeypatch, pool):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(gmp.cupy.CupyIntegrationError, match="needs CuPy"):
        gmp.cupy.set_allocator(pool)


def test_cupy_using_is_thread_local_and_frees_on_gc(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    cp._state.update(device=1, stream=0x99)
    with gmp.cupy.using(sim) as fn:
        assert fn.pool is sim
        mp = cp.cuda.alloc(1000)
        zero = cp.cuda.alloc(0)
    assert cp.cuda.get_allocator() == "cupy-default"
    assert mp.mem.device_id == 1 and mp.ptr and zero.ptr == 0
    assert allocated(sim, 1) == 1024
    del mp
    gc.collect()
    assert allocated(sim) == 0


def test_cupy_set_and_reset_allocator(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    assert gmp.cupy.set_allocator(sim, device=0) == "cupy-default"
    keep = cp.cuda.alloc(5000)
    gmp.cupy.reset_allocator()
    assert cp.cuda.get_allocator() == "cupy-default"
    with pytest.raises(gmp.cupy.CupyIntegrationError, match="nothing to restore"):
        gmp.cupy.reset_allocator()
    with gmp.cupy.using(sim, process_wide=True):
        assert cp.cuda.get_allocator() is not None and cp.cuda.get_allocator() != "cupy-default"
        other = cp.cuda.alloc(100)
    assert cp.cuda.get_allocator() == "cupy-default"
    assert allocated(sim) == 5120 + 512
    del keep, other
    gc.collect()
    assert allocated(sim) == 0


def test_cupy_on_a_fixed_device_uses_that_devices_stream(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    cp._state.update(device=0, streams={0: 0x99, 1: 0x77})
    with gmp.MemPool("sim", devices=2, capacity=1 << 30) as pool:
        with gmp.cupy.using(pool, device=1):
            a = cp.cuda.alloc(1000)  # the current device is 0
        with gmp.cupy.using(pool):
            b = cp.cuda.alloc(1000)
        assert {(s["device"], s["stream"]) for s in pool.segments()} == {(1, 0x77), (0, 0x99)}
        del a, b
        gc.collect()


def test_cupy_inside_a_cache_scope(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    ptrs = []
    with gmp.cupy.using(sim):
        for _ in range(5):
            with gmp.cache_scope(sim, "cupy-body"):
                a = cp.cuda.alloc(100_000)
                ptrs.append(a.ptr)
                del a
                gc.collect()
    assert len(set(ptrs)) == 1 and allocated(sim) == 100_352
    gmp.invalidate("cupy-body")
    assert allocated(sim) == 0


def test_cupy_failed_wrap_frees_the_block_once(monkeypatch, sim):
    # UnownedMemory raising: the block is freed there, and the owner that
    # the traceback keeps alive must not free it again later (by then the
    # address may be another allocation's)
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)

    def refuse(ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
        raise RuntimeError("no")

    cp.cuda.UnownedMemory = refuse
    with gmp.cupy.using(sim):
        try:
            cp.cuda.alloc(1000)
        except RuntimeError as exc:
            kept = exc  # keeps the frame, and the owner, alive
    assert allocated(sim) == 0
    again = sim.alloc(1000)  # the same address comes back
    del kept
    gc.collect()
    assert allocated(sim) == 1024, "the owner freed someone else's block"
    sim.free(again)


def test_cupy_free_after_close_is_swallowed(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    p = gmp.MemPool("sim", capacity=1 << 26)
    with gmp.cupy.using(p):
        mp = cp.cuda.alloc(100)
    p.close()
    before = gmp.cupy._dropped[0]
    del mp
    gc.collect()
    assert gmp.cupy._dropped[0] == before + 1


def test_cupy_process_wide_blocks_ending_out_of_order(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    a = gmp.MemPool("sim", name="A", capacity=1 << 26)
    b = gmp.MemPool("sim", name="B", capacity=1 << 26)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def ta() -> None:
        with gmp.cupy.using(a, process_wide=True):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def tb() -> None:
        a_in.wait(10)
        with gmp.cupy.using(b, process_wide=True):
            b_in.set()
            assert a_out.wait(10)
            assert cp.cuda.get_allocator().pool is b  # a's block ended: b's stays in force

    threads = [threading.Thread(target=ta), threading.Thread(target=tb)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert cp.cuda.get_allocator() == "cupy-default"  # not a's, stale
    a.close()
    b.close()


def test_cupy_set_reset_and_using_mixed(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    try:
        cm = gmp.cupy.using(other, process_wide=True)
        gmp.cupy.set_allocator(sim)
        cm.__enter__()
        gmp.cupy.reset_allocator()  # set_allocator's block is not the newest: other's stays
        assert cp.cuda.get_allocator().pool is other
        cm.__exit__(None, None, None)
        assert cp.cuda.get_allocator() == "cupy-default"  # what was there before set_allocator
        # code that replaced the allocator meanwhile keeps its own
        gmp.cupy.set_allocator(sim)
        cp.cuda.set_allocator("theirs")
        gmp.cupy.reset_allocator()
        assert cp.cuda.get_allocator() == "theirs"
    finally:
        other.close()


def test_closing_a_pool_resets_the_cupy_allocator_over_it(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    a = gmp.MemPool("sim", name="A", capacity=1 << 26)
    b = gmp.MemPool("sim", name="B", capacity=1 << 26)
    gmp.cupy.set_allocator(b)
    with gmp.cupy.using(a, process_wide=True):
        gmp.cupy.set_allocator(a)
        a.close()
        assert cp.cuda.get_allocator().pool is b  # no allocator over the closed pool
        gmp.cupy.reset_allocator()  # closing undid it already: nothing to do
    assert cp.cuda.get_allocator().pool is b
    b.close()
    assert cp.cuda.get_allocator() == "cupy-default"
    gmp.cupy.reset_allocator()  # the set_allocator(b), undone by closing b
    assert cp.cuda.get_allocator() == "cupy-default"
    with pytest.raises(gmp.cupy.CupyIntegrationError, match="nothing to restore"):
        gmp.cupy.reset_allocator()
    with pytest.raises(gmp.PoolClosedError):
        gmp.cupy.set_allocator(a)


def test_cupy_set_allocator_racing_a_close_is_refused(monkeypatch):
    """A set_allocator that lands after close has reset CuPy's allocator
    (gpumempool.cupy's close hook) but before the engine marks the pool
    closed must not leave CuPy allocating from the closed pool."""
    from gpumempool import scope as gscope

    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    pool = gmp.MemPool("sim", name="racing", capacity=1 << 26)
    seen: list[object] = []

    def late_set_allocator(closing: gmp.MemPool) -> None:  # runs after gpumempool.cupy's hook
        if closing is pool:
            try:
                gmp.cupy.set_allocator(pool)
                seen.append("installed")
            except gmp.PoolClosedError as exc:
                seen.append(exc)

    unsubscribe = gmp._lifecycle.on_close(late_set_allocator)
    try:
        pool.close()
    finally:
        unsubscribe()
    assert len(seen) == 1 and isinstance(seen[0], gmp.PoolClosedError), seen
    assert cp.cuda.get_allocator() == "cupy-default"


GC_IN_LOCKED_REGION = r"""
import gc, sys
sys.path.insert(0, sys.argv[1])
from test_cupy import make_cupy
cp = make_cupy(); sys.modules["cupy"] = cp
import gpumempool as gmp
from gpumempool import scope as gscope

def garbage(n):
    a = cp.cuda.alloc(n)
    cycle = [a]
    cycle.append(cycle)  # only the cyclic GC frees it, on whatever allocation triggers it

pool = gmp.MemPool("sim", capacity=1 << 26)
gc.disable()
with gmp.cupy.using(pool):
    with gmp.cache_scope(pool, "s") as scope:
        garbage(1000)
        with scope._lock:  # the GC runs the array's finalizer here, on this thread
            gc.collect()
            assert scope.cached_bytes == 0  # deferred...
        assert scope.cached_bytes == 1024  # ...to the end of the region
    garbage(4096)
    with gscope._lock:
        gc.collect()
assert pool.stats()["allocated_bytes.all.current"] == 1024  # the scope's cached block only
gmp.invalidate("s")
assert pool.stats()["allocated_bytes.all.current"] == 0 and gmp.cupy._dropped[0] == 0
print("ok")
"""


def test_cupy_finalizer_inside_a_locked_region_of_scope(tmp_path):
    import os
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", GC_IN_LOCKED_REGION, os.path.dirname(os.path.abspath(__file__))],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_close_invalidates_the_pools_cache_scopes() -> None:
    import gpumempool as gmp
    from gpumempool import scope

    pool = gmp.MemPool("sim", name="scoped")
    for _ in range(2):
        with gmp.cache_scope(pool, "loop"):
            scope.free(pool, scope.alloc(pool, 4096))
    # The scope keeps the freed block for its next iteration...
    assert pool.stats()["allocated_bytes.all.current"] == 4096
    rep = pool.close()
    # ...and close hands it back before returning the segments: no leak.
    assert rep.live_blocks == []
    assert gmp.invalidate("loop", pool) == 0
