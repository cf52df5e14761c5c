"""The exported C ABI: torch's pluggable-allocator entry points in the same
library Python imported, sharing the very pools Python sees."""

from __future__ import annotations

import ctypes
import os

import pytest

import gpumempool as gmp
from gpumempool import _native


def test_symbols_are_exported_by_the_imported_library(pool: gmp.MemPool) -> None:
    path, alloc_sym, free_sym = pool.pluggable_symbols()
    assert os.path.samefile(path, gmp.library_path())
    assert alloc_sym.startswith("gmp_alloc_") and free_sym.startswith("gmp_free_")
    assert pool.pluggable_symbols() == (path, alloc_sym, free_sym)
    # What torch's CUDAPluggableAllocator does: CDLL(path) then look up names.
    lib = ctypes.CDLL(path)
    assert getattr(lib, alloc_sym) and getattr(lib, free_sym)


def test_c_caller_changes_the_pool_python_sees(pool: gmp.MemPool, clib) -> None:
    path, a_sym, f_sym = pool.pluggable_symbols()
    assert clib.caller_open(path.encode(), a_sym.encode(), f_sym.encode()) == 0
    p = clib.caller_alloc(1000, 0, 0x42)
    assert p
    s = pool.stats()
    assert s["allocated_bytes.all.current"] == 1024
    assert s["requested_bytes.all.current"] == 1000
    # Python can free what C allocated (same pool), and the stream was kept.
    pool.free(p)
    assert pool.alloc(1000, stream=0x42) == p
    clib.caller_free(p, 1000, 0, 0x42)
    assert pool.stats()["allocated_bytes.all.current"] == 0
    pool.check()


def test_several_pools_have_their_own_entry_points(clib) -> None:
    with gmp.MemPool("sim", name="p1") as p1, gmp.MemPool("sim", name="p2") as p2:
        s1, s2 = p1.pluggable_symbols(), p2.pluggable_symbols()
        assert s1[1] != s2[1]
        assert clib.caller_open(*(x.encode() for x in s2)) == 0
        ptr = clib.caller_alloc(4096, 0, None)
        assert p2.stats()["allocation.all.current"] == 1
        assert p1.stats()["allocation.all.current"] == 0
        with pytest.raises(gmp.InvalidPointerError):
            p1.free(ptr)
        p2.free(ptr)


def test_errors_return_null_and_are_kept_for_python(pool: gmp.MemPool, clib) -> None:
    assert clib.caller_open(*(x.encode() for x in pool.pluggable_symbols())) == 0
    assert pool.last_error() is None
    assert not clib.caller_alloc(0, 0, None)
    assert "size must be in" in (pool.last_error() or "")
    assert pool.last_error() is None  # reading clears it
    assert not clib.caller_alloc(1 << 45, 0, None)
    assert "out of memory" in (pool.last_error() or "")
    assert not clib.caller_alloc(10, 5, None)
    assert "device 5" in (pool.last_error() or "")
    clib.caller_free(12345, 0, 0, None)
    assert "not owned" in (pool.last_error() or "")


def test_go_panic_never_crosses_the_c_boundary(pool: gmp.MemPool, clib) -> None:
    assert clib.caller_open(*(x.encode() for x in pool.pluggable_symbols())) == 0
    _native.bindings.DebugPanicNext(pool.handle)
    assert not clib.caller_alloc(100, 0, None)
    assert "panic recovered" in (pool.last_error() or "")
    p = clib.caller_alloc(100, 0, None)  # the process and the pool carry on
    assert p
    _native.bindings.DebugPanicNext(pool.handle)
    clib.caller_free(p, 100, 0, None)
    assert "panic recovered" in (pool.last_error() or "")
    pool.free(p)
    pool.check()


def test_closed_pool_slot_returns_null(clib) -> None:
    pool = gmp.MemPool("sim")
    syms = pool.pluggable_symbols()
    pool.close()
    assert clib.caller_open(*(x.encode() for x in syms)) == 0
    assert not clib.caller_alloc(100, 0, None)
    assert "no pool holds this slot" in _native.bindings.PoolTakeError(0)


def test_generic_handle_entry_points(pool: gmp.MemPool) -> None:
    lib = ctypes.CDLL(gmp.library_path())
    lib.gmp_pool_alloc.restype = ctypes.c_void_p
    lib.gmp_pool_alloc.argtypes = [ctypes.c_int64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.gmp_pool_free.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.gmp_last_error.restype = ctypes.c_size_t
    lib.gmp_last_error.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]
    p = lib.gmp_pool_alloc(pool.handle, 512, 0, None)
    assert p and pool.stats()["allocation.all.current"] == 1
    assert lib.gmp_pool_free(pool.handle, p, 512, 0, None) == 0
    assert lib.gmp_pool_free(pool.handle, p, 512, 0, None) == -1
    buf = ctypes.create_string_buffer(16)
    n = lib.gmp_last_error(pool.handle, buf, 16)
    assert n > 16 and len(buf.value) == 15  # truncated like snprintf, NUL-terminated
    assert not lib.gmp_pool_alloc(999999, 512, 0, None)


def test_c_round_trip_benchmark_runs(pool: gmp.MemPool, clib) -> None:
    assert clib.caller_open(*(x.encode() for x in pool.pluggable_symbols())) == 0
    assert clib.caller_bench(4096, 1000) > 0
    assert pool.stats()["allocation.all.allocated"] == 1001
    assert pool.stats()["allocated_bytes.all.current"] == 0


def test_slots_run_out_with_a_clear_error() -> None:
    pools = []
    try:
        with pytest.raises(gmp.BackendError, match="entry points"):
            for _ in range(_native.bindings.NumSlots() + 1):
                p = gmp.MemPool("sim")
                pools.append(p)
                p.pluggable_symbols()
    finally:
        for p in pools:
            p.close()
    with gmp.MemPool("sim") as p:  # slots come back on close
        p.pluggable_symbols()


def test_torch_pluggable_allocator_accepts_the_symbols(pool: gmp.MemPool) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA cannot build a CUDAPluggableAllocator")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(*pool.pluggable_symbols())
    assert alloc.allocator() is not None
