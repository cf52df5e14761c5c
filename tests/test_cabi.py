"""The exported C ABI: torch's pluggable-allocator entry points in the same
library Python imported, sharing the very pools Python sees."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import pytest

import gpumempool as gmp
from gpumempool import _native

MiB = 1 << 20


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


def test_segment_alloc_reserves_what_torch_asks(clib) -> None:
    """pluggable_symbols(segments=True), the allocator of gmp.mempool's
    torch.cuda.MemPool: torch asks for whole segments (2 MiB for its small
    blocks), and the pool reserves just that, where the plain entry point
    carves a 2 MiB request from a 20 MiB buffer as torch itself would."""
    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        path, seg_sym, f_sym = pool.pluggable_symbols(segments=True)
        assert seg_sym.startswith("gmp_segment_alloc_") and f_sym.startswith("gmp_free_")
        assert seg_sym.replace("segment_alloc", "alloc") == pool.pluggable_symbols()[1]  # same slot
        assert clib.caller_open(path.encode(), seg_sym.encode(), f_sym.encode()) == 0
        p = clib.caller_alloc(2 * MiB, 0, 0)
        assert p and pool.stats()["reserved_bytes.all.current"] == 2 * MiB
        clib.caller_free(p, 2 * MiB, 0, 0)
        assert clib.caller_open(*(x.encode() for x in pool.pluggable_symbols())) == 0
        q = clib.caller_alloc(4 * MiB, 0, 0)
        assert q and pool.stats()["reserved_bytes.all.current"] == 2 * MiB + 20 * MiB
        clib.caller_free(q, 4 * MiB, 0, 0)
        pool.check()
        with pytest.raises(gmp.InvalidArgumentError, match="exclude each other"):
            pool.pluggable_symbols(segments=True, throw_on_oom=True)


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
    # size 0 (torch's empty tensors) is NULL and no error; so is freeing NULL
    assert not clib.caller_alloc(0, 0, None)
    clib.caller_free(0, 0, 0, None)
    assert pool.last_error() is None
    assert not clib.caller_alloc(1 << 63, 0, None)
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


def test_slot_of_a_pool_closed_with_live_blocks_serves_no_other_pool(clib) -> None:
    # Torch keeps a CUDAPluggableAllocator's function pointers for good: a
    # tensor that outlived its pool is freed through the old slot later. Had
    # the slot gone to a new pool, that free would hit the new pool's block
    # at the same address.
    a = gmp.MemPool("sim", name="a")
    syms_a = a.pluggable_symbols()
    assert clib.caller_open(*(x.encode() for x in syms_a)) == 0
    stale = clib.caller_alloc(MiB, 0, None)
    with pytest.warns(gmp.LeakWarning):
        a.close()
    others = [gmp.MemPool("sim", name=f"b{i}") for i in range(_native.bindings.NumSlots())]
    try:
        slots = set()
        for b in others:
            try:
                slots.add(b.pluggable_symbols()[1])
            except gmp.BackendError as e:
                assert "retired" in str(e)
                break
        assert syms_a[1] not in slots
        b = others[0]
        mine = b.alloc(MiB)
        assert mine == stale  # the same simulated device: the address came back
        clib.caller_free(stale, MiB, 0, None)  # torch frees the dead tensor
        assert b.stats()["allocation.all.current"] == 1, "the new pool's block is untouched"
        assert "no pool holds this slot" in _native.bindings.PoolTakeError(0)
        b.free(mine)
    finally:
        for b in others:
            b.close()


def test_slots_of_cleanly_closed_pools_are_reused_last() -> None:
    with gmp.MemPool("sim") as a:
        first = a.pluggable_symbols()[1]
    with gmp.MemPool("sim") as b:
        assert b.pluggable_symbols()[1] != first, "the slot just freed waits behind the others"


def test_error_text_is_cut_on_a_character_boundary() -> None:
    # Go cuts an error at 1023 bytes; a cut inside a UTF-8 sequence would
    # make the fast path raise UnicodeDecodeError instead of our exception.
    for pad in range(4):
        with gmp.MemPool("sim", name="x" * pad + "\u6c60" * 400, capacity=MiB) as p:
            with pytest.raises(gmp.OutOfMemoryError, match="^pool "):
                p.alloc(1 << 30)


def test_error_buffer_length_is_never_trusted_past_the_message() -> None:
    # A huge buffer length (size_t -1) with a short message writes only the
    # message: no Go panic (unsafe.Slice of an impossible length) aborting
    # the process.
    code = (
        "import ctypes\n"
        "from gpumempool import _native\n"
        "lib = ctypes.CDLL(_native.library_path())\n"
        "f = lib.gmp_last_error\n"
        "f.restype = ctypes.c_size_t\n"
        "f.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]\n"
        "buf = ctypes.create_string_buffer(256)\n"
        "f(0, buf, len(buf))\n"
        "print(f(987654, buf, 2**64 - 1), buf.value.decode())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n, text = r.stdout.split(" ", 1)
    assert int(n) == len(text.strip()) and "no such pool" in text


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
    # size 0 here is an error (as in pool.alloc); only torch's gmp_alloc_<i> takes it as an empty tensor
    pool.last_error()
    assert not lib.gmp_pool_alloc(pool.handle, 0, 0, None)
    assert "size must be in" in (pool.last_error() or "")


def _hooks(pool: gmp.MemPool) -> dict[str, ctypes._CFuncPtr]:
    """The pool's torch hooks as C functions, looked up the way torch's
    set_*_fn gets them: by address in the library Python loaded."""
    lib = ctypes.CDLL(gmp.library_path())
    types = {
        "set_init_fn": ctypes.CFUNCTYPE(None, ctypes.c_int),
        "set_reset_fn": ctypes.CFUNCTYPE(None),
        "set_memory_fraction_fn": ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int),
        "set_record_stream_fn": ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p),
        "set_base_alloc_fn": ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)),
    }
    out = {}
    for setter, sym in pool.pluggable_hooks().items():
        addr = ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value
        if setter in types:  # the others take C++ arguments: see test_graph_capture_*
            out[setter] = types[setter](addr)
    return out


def test_an_empty_cache_through_the_c_hook_is_recorded() -> None:
    """torch.cuda.empty_cache() reaches the pool through the C hook
    (set_reset_fn), never through MemPool.empty_cache: the engine's history
    records it, and so does a TraceRecorder, which patches nothing."""
    from gpumempool.trace import EmptyCache, TraceRecorder, Trim, from_history

    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        reset = _hooks(pool)["set_reset_fn"]
        with TraceRecorder(pool) as rec:
            assert "empty_cache" not in vars(pool) and "trim" not in vars(pool)
            pool.free(pool.alloc(4 * MiB))
            reset()
            assert pool.last_error() is None
            assert pool.stats()["reserved_bytes.all.current"] == 0
            pool.trim(MiB, device=0)
            snap = pool.snapshot()
            assert [e["action"] for e in snap["gpumempool_cache_calls"][0]] == ["empty_cache", "trim"]
            assert from_history(snap).counts()["empty_cache"] == 1
        assert rec.trace is not None
        assert [e for e in rec.trace.events if type(e) in (EmptyCache, Trim)] == [EmptyCache(), Trim(MiB, 0)]
        assert rec.trace.meta["recorder_calls"] == 2


def test_torch_hooks_are_native_functions_that_act_on_the_pool() -> None:
    with gmp.MemPool("sim", devices=2, capacity=64 * MiB) as pool:
        hooks = _hooks(pool)
        assert set(pool.pluggable_hooks()) == {
            "set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_record_stream_fn", "set_base_alloc_fn",
            "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"}
        assert pool.pluggable_hooks() == pool.pluggable_hooks()  # the slot is kept

        hooks["set_init_fn"](2)
        assert pool.last_error() is None
        hooks["set_init_fn"](8)
        assert "torch sees 8 devices" in (pool.last_error() or "")

        # memory fraction: a per-device limit from the device's total memory
        hooks["set_memory_fraction_fn"](0.25, 1)
        assert pool.last_error() is None
        assert pool.limit(1) == 16 * MiB and pool.limit(0) is None
        live = [pool.alloc(16 * MiB, device=1)]  # a segment of exactly the limit
        with pytest.raises(gmp.OutOfMemoryError, match="limit 16.00 MiB"):
            pool.alloc(MiB, device=1)
        for bad in (1.5, -0.1, float("nan")):
            hooks["set_memory_fraction_fn"](bad, 0)
            assert "outside [0, 1]" in (pool.last_error() or "")
            assert pool.limit(0) is None
        hooks["set_memory_fraction_fn"](0.0, 0)
        with pytest.raises(gmp.OutOfMemoryError):
            pool.alloc(512, device=0)
        pool.set_limit(None)

        # record_stream: the block waits for the stream before reuse
        pool.sim.manual_events()
        p = pool.alloc(MiB, stream=1)
        hooks["set_record_stream_fn"](p, 2)
        assert pool.last_error() is None
        pool.free(p)
        live.append(pool.alloc(MiB, stream=1))
        assert live[-1] != p
        hooks["set_record_stream_fn"](12345, 2)
        assert "0x3039" in (msg := pool.last_error() or "") and "not owned" in msg
        hooks["set_record_stream_fn"](None, 2)  # an empty tensor's NULL data pointer: ignored, as torch does
        assert pool.last_error() is None

        # reset (torch.cuda.empty_cache): cached segments go back
        pool.sim.complete()
        pool.process_events()
        reserved = pool.stats()["reserved_bytes.all.current"]
        for a in live:
            pool.free(a)
        hooks["set_reset_fn"]()
        assert pool.last_error() is None
        assert pool.stats()["reserved_bytes.all.current"] < reserved
        assert pool.stats()["reserved_bytes.all.current"] == 0


def test_base_alloc_hook_gives_the_segment_of_a_block() -> None:
    """torch.multiprocessing shares a CUDA tensor as an IPC handle of its
    allocation's base plus an offset: the hook must give the segment."""
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        base_alloc = _hooks(pool)["set_base_alloc_fn"]
        a, b = pool.alloc(1000), pool.alloc(3000)  # two blocks of one small segment
        size = ctypes.c_size_t(0)
        seg_a = base_alloc(a, ctypes.byref(size))
        assert seg_a == min(a, b) and size.value == 2 * MiB  # torch's small-segment size
        assert base_alloc(b, ctypes.byref(size)) == seg_a
        big = pool.alloc(30 * MiB)
        assert base_alloc(big, ctypes.byref(size)) == big and size.value >= 30 * MiB
        assert pool.last_error() is None
        assert base_alloc(a + 512, ctypes.byref(size)) is None  # not a block: NULL, not a wrong base
        assert "not" in (pool.last_error() or "")
        for p in (a, b, big):
            pool.free(p)


def test_torch_hooks_recover_panics_and_closed_slots() -> None:
    pool = gmp.MemPool("sim")
    hooks = _hooks(pool)
    _native.bindings.DebugPanicNext(pool.handle)
    hooks["set_reset_fn"]()
    assert "panic" in (pool.last_error() or "")
    hooks["set_reset_fn"]()  # the pool carries on
    assert pool.last_error() is None
    pool.close()
    hooks["set_memory_fraction_fn"](0.5, 0)  # no pool holds the slot now
    assert "no pool holds this slot" in _native.bindings.PoolTakeError(0)


def _call(cxx_caller, path: str, sym: str, size: int, device: int = 0) -> tuple[int, int, str]:
    out = ctypes.c_void_p()
    msg = ctypes.create_string_buffer(2048)
    rc = cxx_caller.call_alloc(path.encode(), sym.encode(), size, device, None, ctypes.byref(out), msg, len(msg))
    return rc, out.value or 0, msg.value.decode()


def test_throwing_alloc_raises_a_cpp_exception_instead_of_returning_null(cxx_caller) -> None:
    with gmp.MemPool("sim", name="thrower", capacity=64 * MiB) as pool:
        path, a_sym, f_sym = pool.pluggable_symbols(throw_on_oom=True)
        assert a_sym.startswith("gmp_alloc_or_throw_") and f_sym.startswith("gmp_free_")
        assert pool.pluggable_symbols()[1] == a_sym.replace("_or_throw", "")  # same slot
        rc, ptr, _ = _call(cxx_caller, path, a_sym, 1000)
        assert rc == 0 and ptr and pool.stats()["allocated_bytes.all.current"] == 1024
        # Out of memory: a std::runtime_error worded like torch's own (what
        # Lightning's and Accelerate's OOM checks look for in a
        # RuntimeError), with the pool's reason, which pool.last_error()
        # still shows.
        rc, bad, msg = _call(cxx_caller, path, a_sym, 128 * MiB)
        assert rc == 1 and bad == 0, msg
        assert msg.startswith("CUDA out of memory. Tried to allocate 128.00 MiB on device 0. gpumempool: gmp_alloc: ")
        assert 'pool "thrower"' in msg and "out of memory" in msg
        assert "out of memory" in (pool.last_error() or "")
        # Other failures are thrown the same way, worded as ours; size 0 is
        # not an error for torch.
        rc, _, msg = _call(cxx_caller, path, a_sym, 100, device=7)
        assert rc == 1 and msg.startswith("gpumempool: cannot allocate 100 bytes on device 7: ")
        assert "CUDA out of memory" not in msg
        rc, zero, _ = _call(cxx_caller, path, a_sym, 0)
        assert rc == 0 and zero == 0
        pool.last_error()
        pool.free(ptr)
        assert pool.stats()["allocated_bytes.all.current"] == 0
        pool.check()
    # The slot is free again: the exception names that.
    rc, _, msg = _call(cxx_caller, path, a_sym, 1000)
    assert rc == 1 and "no pool holds" in msg


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
    if not hasattr(torch._C, "_cuda_customAllocator"):
        pytest.skip("this torch is built without CUDA: no CUDAPluggableAllocator")
    # Building the allocator dlopens the library and looks the names up; no
    # GPU is needed for that, nor for wiring the hooks.
    alloc = torch.cuda.memory.CUDAPluggableAllocator(*pool.pluggable_symbols())
    raw = alloc.allocator()
    lib = ctypes.CDLL(gmp.library_path())
    hooks = pool.pluggable_hooks()
    for setter, sym in hooks.items():
        assert hasattr(raw, setter), f"torch {torch.__version__} lost {setter}"
        getattr(raw, setter)(ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value)


def test_graph_capture_allocates_from_a_private_pool(cxx_caller) -> None:
    """torch.cuda.graph in full-replacement mode: between begin and end,
    allocations on the captured stream come from a private pool whose blocks
    nobody else gets until the graph is released (a replay writes them)."""
    S0, S1 = 0x10, 0x11  # the stream outside the capture, the captured one
    # release_threshold=1: the shared pool gives back every free segment;
    # the private pool must not (a replay would write released memory).
    with gmp.MemPool("sim", capacity=256 * MiB, release_threshold=1) as pool:
        path, a_sym, f_sym = pool.pluggable_symbols()
        hooks = pool.pluggable_hooks()
        lib = ctypes.CDLL(path)
        alloc, free = getattr(lib, a_sym), getattr(lib, f_sym)
        alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

        def hook(name: str, *args: int) -> int:
            fn = cxx_caller.call_begin if name == "set_begin_allocate_to_pool" else cxx_caller.call_end
            return fn(path.encode(), hooks[name].encode(), *args)

        keep = alloc(512, 0, S0)  # keeps x's small segment from being released
        x = alloc(MiB, 0, S0)
        free(x, MiB, 0, S0)  # cached in the shared pool
        assert hook("set_begin_allocate_to_pool", 0, 7, 0, S1, 0) == 0
        a = alloc(MiB, 0, S1)
        assert a and a != x  # the capture does not get the shared cache's block
        assert alloc(MiB, 0, S0) == x  # other streams still do
        free(x, MiB, 0, S0)
        (gp,) = pool.graph_pools()
        assert gp["id"] == [7, 0] and gp["live_blocks"] == 1 and gp["capturing"] and not gp["released"]
        st = pool.stats()  # the graph's memory is the pool's too (torch's memory_stats counts it)
        assert st["allocated_bytes.all.current"] == 512 + MiB and st["segment.all.current"] == 2
        free(a, MiB, 0, S1)  # freed during capture: reusable by the capture only
        c = alloc(MiB, 0, S1)
        assert c == a
        assert hook("set_end_allocate_to_pool_fn", 0, 7, 0) == 0
        assert not pool.graph_pools()[0]["capturing"]
        free(c, MiB, 0, S1)
        after = alloc(MiB, 0, S1)  # capture over: the shared pool serves S1 again ...
        assert after and after != a  # ... and never with the graph's block
        free(after, MiB, 0, S1)
        assert pool.graph_pools()[0]["reserved_bytes"] == 2 * MiB  # kept for the graph's replays
        assert pool.graph_pools()[0]["live_blocks"] == 0
        before = pool.stats()
        assert hook("set_release_pool", 0, 7, 0) == 0  # the graph is gone
        assert pool.graph_pools() == []
        after_release = pool.stats()  # its segment went back to the backend; the counters stay
        assert after_release["reserved_bytes.all.current"] == before["reserved_bytes.all.current"] - 2 * MiB
        assert after_release["num_device_free"] == before["num_device_free"] + 1
        for key in ("allocation.all.allocated", "segment.all.allocated", "reserved_bytes.all.peak"):
            assert after_release[key] == before[key], key
        assert pool.last_error() is None

        # Released while a block lives: the pool goes when the block does.
        assert hook("set_begin_allocate_to_pool", 0, 8, 1, S1, 0) == 0
        d = alloc(3 * MiB, 0, S1)
        assert hook("set_end_allocate_to_pool_fn", 0, 8, 1) == 0
        assert hook("set_release_pool", 0, 8, 1) == 0
        (gp,) = pool.graph_pools()
        assert gp["released"] and gp["live_blocks"] == 1
        free(d, 3 * MiB, 0, S1)
        assert pool.graph_pools() == []
        free(keep, 512, 0, S0)
        assert cxx_caller.live_filters() == 0  # every copy of torch's filter was deleted
        pool.check()


def _graph_hooks(pool: gmp.MemPool) -> tuple[bytes, Any, bytes, bytes, bytes]:
    """The library path, the slot's alloc (as ctypes) and the names of the
    begin / end / release graph hooks, as torch_caller.cpp takes them."""
    path, a_sym, _ = pool.pluggable_symbols()
    hooks = pool.pluggable_hooks()
    alloc = getattr(ctypes.CDLL(path), a_sym)
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    begin, end, release = (hooks[k].encode() for k in (
        "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"))
    return path.encode(), alloc, begin, end, release


@pytest.mark.parametrize("kind", [2, 0], ids=["filter-stored-inline", "filter-on-the-heap"])
def test_torch_filters_are_moved_called_and_destroyed_through_libstdcxx_abi(cxx_caller, kind: int) -> None:
    """The hooks are C (no C++ library in the extension): torch's
    std::function filter is moved, called and destroyed through libstdc++'s
    layout. Torch's filters are small lambdas that std::function stores
    inside itself (kind 2); a big functor lives on the heap (kind 0). Both
    must route the captured stream only, and leave no copy behind."""
    S0, S1 = 0x30, 0x31
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        path, alloc, begin, end, release = _graph_hooks(pool)
        calls = cxx_caller.filter_call_count()
        assert cxx_caller.call_begin(path, begin, 0, 9, 0, S1, kind) == 0
        a = alloc(MiB, 0, S1)
        b = alloc(MiB, 0, S0)
        assert cxx_caller.filter_call_count() >= calls + 2  # the filter itself was asked, for both streams
        (gp,) = pool.graph_pools()
        assert gp["live_blocks"] == 1  # only S1's block is the graph's
        assert cxx_caller.call_end(path, end, 0, 9, 0) == 0
        pool.free(a)
        pool.free(b)
        assert cxx_caller.call_end(path, release, 0, 9, 0) == 0
        assert pool.graph_pools() == [] and pool.last_error() is None
        assert cxx_caller.live_filters() == 0


def test_an_empty_torch_filter_accepts_nothing(cxx_caller) -> None:
    S1 = 0x41
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        path, alloc, begin, end, _ = _graph_hooks(pool)
        assert cxx_caller.call_begin(path, begin, 0, 10, 0, S1, 3) == 0
        a = alloc(MiB, 0, S1)
        assert a and pool.graph_pools() == []  # served by the shared pool
        assert cxx_caller.call_end(path, end, 0, 10, 0) == 0
        pool.free(a)


# What a std::function of another layout could hand the glue, as (manager,
# invoker): -1 is data of a loaded library, -2 a real function (see
# call_begin_layout in tests/csrc/torch_caller.cpp).
WRONG_LAYOUTS = {
    "garbage-pointers": (0x1234, 0x5678, "its manager (0x1234) is not code"),
    "half-empty-no-manager": (0, -2, "one is NULL, the other not"),
    "half-empty-no-invoker": (-2, 0, "one is NULL, the other not"),
    "manager-is-data": (-1, -2, "its manager"),
    "invoker-is-data": (-2, -1, "its invoker"),
}


@pytest.mark.parametrize("layout", list(WRONG_LAYOUTS))
def test_a_torch_filter_of_another_layout_is_refused_not_called(cxx_caller, layout: str) -> None:
    """Issue 27: the glue reads torch's std::function as libstdc++ lays it
    out. Bytes laid out otherwise (another C++ library's std::function, a
    torch built with another ABI) must not be called, moved or destroyed
    through: the begin hook throws one clear error to its C++ caller (torch
    raises it as a RuntimeError), the pool keeps it as its last error, no
    private pool is begun and the pool goes on serving."""
    manager, invoker, why = WRONG_LAYOUTS[layout]
    S1 = 0x51
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        path, alloc, begin, end, _ = _graph_hooks(pool)
        msg = ctypes.create_string_buffer(1024)
        rc = cxx_caller.call_begin_layout(path, begin, 0, 11, 0, 0xDEAD, 0xBEEF, manager, invoker, msg, len(msg))
        assert rc == 1, f"the hook returned {rc} instead of throwing std::runtime_error"
        thrown = msg.value.decode()
        assert thrown.startswith("gpumempool: gmp_begin_allocate_to_pool: refused the allocation to pool (11, 0)")
        assert "does not have the libstdc++ layout" in thrown and why in thrown
        assert "Nothing was called through it" in thrown and "\n" not in thrown
        recorded = pool.last_error() or ""
        assert recorded.startswith("gmp_begin_allocate_to_pool: refused") and why in recorded
        assert pool.graph_pools() == []
        a = alloc(MiB, 0, S1)  # served by the shared pool: nothing routes to a private one
        assert a and pool.graph_pools() == []
        pool.free(a)
        pool.check()


def test_a_heap_pointer_as_invoker_is_refused(cxx_caller) -> None:
    """libc++'s std::function is 32 bytes too, but its last word points at
    its own storage: data, in no loaded library."""
    storage = ctypes.create_string_buffer(32)
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        path, _, begin, _, _ = _graph_hooks(pool)
        msg = ctypes.create_string_buffer(1024)
        assert cxx_caller.call_begin_layout(path, begin, 0, 12, 0, 0, 0, -2, ctypes.addressof(storage), msg,
                                            len(msg)) == 1
        assert "its invoker" in msg.value.decode() and "not code of any loaded library" in msg.value.decode()
        assert "its invoker" in (pool.last_error() or "")


def test_an_empty_filter_of_any_functor_bytes_is_accepted_as_empty(cxx_caller) -> None:
    """An empty std::function (manager and invoker NULL) is libstdc++'s own
    layout whatever its storage holds: begun, it routes nothing and nothing
    is called through it."""
    S1 = 0x52
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        path, alloc, begin, end, _ = _graph_hooks(pool)
        msg = ctypes.create_string_buffer(1024)
        assert cxx_caller.call_begin_layout(path, begin, 0, 13, 0, 0xDEAD, 0xBEEF, 0, 0, msg, len(msg)) == 0
        assert pool.last_error() is None
        a = alloc(MiB, 0, S1)
        assert a and pool.graph_pools() == []
        assert cxx_caller.call_end(path, end, 0, 13, 0) == 0
        pool.free(a)


def test_graph_capture_pauses_events(cxx_caller) -> None:
    """During a capture no event is recorded or queried (either would break
    the capture on a GPU): a block freed after use on another stream waits
    until the capture ends, then gets its events."""
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        pool.sim.manual_events()
        path = pool.pluggable_symbols()[0].encode()
        hooks = {k: v.encode() for k, v in pool.pluggable_hooks().items()}
        a = pool.alloc(4096, stream=1)
        pool.record_stream(a, 2)
        assert cxx_caller.call_begin(path, hooks["set_begin_allocate_to_pool"], 0, 9, 0, 0x99, 0) == 0
        pool.free(a)
        pool.sim.complete()  # stream 2 is done, but no event was recorded to say so
        assert pool.process_events() == 1  # a waits for the capture's end, not on an event
        b = pool.alloc(4096, stream=1)
        assert b != a  # a waits
        assert cxx_caller.call_end(path, hooks["set_end_allocate_to_pool_fn"], 0, 9, 0) == 0
        assert pool.last_error() is None
        assert pool.process_events() == 1  # now on its event, recorded at the end of the capture
        pool.sim.complete()
        assert pool.process_events() == 0
        c = pool.alloc(4096, stream=1)
        assert c == a
        pool.check()
        pool.free(b)
        pool.free(c)


def test_graph_hooks_survive_bad_calls_and_close(cxx_caller) -> None:
    S1 = 0x21
    pool = gmp.MemPool("sim", capacity=64 * MiB)
    p, alloc, begin, end, release = _graph_hooks(pool)

    assert cxx_caller.call_end(p, end, 0, 1, 2) == 0  # end without begin: an error kept, not a crash
    assert "no allocation to this pool was begun" in (pool.last_error() or "")
    assert cxx_caller.call_end(p, release, 0, 1, 2) == 0  # release of a pool never used: nothing to do
    assert pool.last_error() is None

    calls = cxx_caller.filter_call_count()
    assert cxx_caller.call_begin(p, begin, 0, 3, 0, S1, 1) == 0  # a filter that throws ...
    a = alloc(MiB, 0, S1)
    assert a and pool.graph_pools() == []  # ... accepts nothing (the exception stays in C++)
    assert cxx_caller.filter_call_count() > calls
    assert cxx_caller.call_end(p, end, 0, 3, 0) == 0
    pool.free(a)

    # Closing the pool mid-capture with a private block alive: reported, filter freed.
    assert cxx_caller.call_begin(p, begin, 0, 4, 0, S1, 0) == 0
    b = alloc(2 * MiB, 0, S1)
    assert b and len(pool.graph_pools()) == 1
    with pytest.warns(gmp.LeakWarning):
        report = pool.close()
    assert any(blk.addr == b for blk in report.live_blocks)
    assert cxx_caller.live_filters() == 0
    # The slot's hooks now report that no pool holds them.
    assert cxx_caller.call_begin(p, begin, 0, 5, 0, S1, 0) == 0
    assert cxx_caller.live_filters() == 0
    assert "no pool holds this slot" in _native.bindings.PoolTakeError(0)


def test_graph_hook_types_match_torch_headers(tmp_path) -> None:
    """The C hooks of zz_slots.c are called by torch through the function
    types of the installed torch's CUDAPluggableAllocator setters (the
    std::function arguments of set_begin_allocate_to_pool & co. in its
    header, which its Python binding casts our addresses to), with torch's
    MempoolId_t. tests/csrc/torch_caller.cpp calls them through exactly those
    types in the tests above (which prove the C side takes them as the C++
    ABI passes them); here its types are compiled against the types read
    from torch's headers (torch's own headers would need CUDA's)."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler")
    include = [Path(p) for p in cpp_extension.include_paths()]
    header = next((d / "torch/csrc/cuda/CUDAPluggableAllocator.h" for d in include
                   if (d / "torch/csrc/cuda/CUDAPluggableAllocator.h").is_file()), None)
    if header is None:
        pytest.skip("this torch ships no CUDAPluggableAllocator.h")
    text = header.read_text()

    def function_type(setter: str) -> str:
        """The template argument of the std::function the setter takes."""
        at = text.index("std::function<", text.index(f"void {setter}(")) + len("std::function<")
        depth, k = 1, at
        while depth:
            depth += {"<": 1, ">": -1}.get(text[k], 0)
            k += 1
        return " ".join(text[at:k - 1].split())

    types = {s: function_type(s) for s in ("set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn",
                                           "set_release_pool")}
    # MempoolId_t as torch defines it (c10/core/Allocator.h, or c10/cuda/CUDAGraphsC10Utils.h before 2.8).
    defs = "".join(p.read_text() for d in include for p in (d / "c10").rglob("*.h")
                   if "MempoolId_t" in p.read_text(errors="ignore"))
    assert re.search(r"using CaptureId_t = unsigned long long;", defs)
    assert re.search(r"using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;", defs)
    caller = Path(__file__).resolve().parent / "csrc" / "torch_caller.cpp"
    check = tmp_path / "check.cpp"
    check.write_text(f"""
#include <functional>
#include <type_traits>
#include <utility>
typedef struct CUstream_st* cudaStream_t;
namespace c10 {{
using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;
namespace cuda {{ using c10::MempoolId_t; }}
}}
#include "{caller}"
static_assert(std::is_same_v<begin_fn, std::add_pointer_t<{types["set_begin_allocate_to_pool"]}>>, "begin");
static_assert(std::is_same_v<end_fn, std::add_pointer_t<{types["set_end_allocate_to_pool_fn"]}>>, "end");
static_assert(std::is_same_v<end_fn, std::add_pointer_t<{types["set_release_pool"]}>>, "release");
static_assert(std::is_same_v<alloc_fn, void*(*)(std::size_t, int, void*)>, "alloc");
""")
    r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", str(check)], capture_output=True, text=True)
    assert r.returncode == 0, (types, r.stderr[-3000:])


def test_cuda_special_streams_cross_the_c_abi() -> None:
    """cudaStreamLegacy (0x1) and cudaStreamPerThread (0x2) are handles
    torch and CuPy may pass; as Go pointers they would be invalid, so the C
    ABI takes them as integers. Many calls through alloc, free and
    record_stream."""
    with gmp.MemPool("sim", capacity=256 * MiB) as pool:
        path, a_sym, f_sym = pool.pluggable_symbols()
        lib = ctypes.CDLL(path)
        alloc, free = getattr(lib, a_sym), getattr(lib, f_sym)
        alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        record = _hooks(pool)["set_record_stream_fn"]
        for i in range(2000):
            stream = 1 + i % 2
            p = alloc(4096 * (1 + i % 7), 0, stream)
            assert p
            record(p, 3 - stream)
            free(p, 0, 0, stream)
        assert pool.last_error() is None
        assert pool.stats()["allocation.all.allocated"] == 2000
        pool.check()


def _elf_dynamic_tags(path: str) -> list[int]:
    """The d_tag of each entry of a 64-bit little-endian ELF's PT_DYNAMIC."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 2:  # PT_DYNAMIC
            return [struct.unpack_from("<q", data, p_offset + j)[0] for j in range(0, p_filesz, 16)]
    return []


def test_installed_extensions_carry_no_run_path() -> None:
    """No extension of the package has a DT_RPATH/DT_RUNPATH: it needs
    none, and a wheel must not point the loader at the build machine's
    Python (gopy links with Python's LDSHARED flags, which carry
    -Wl,-rpath,<its lib dir> on pyenv and --enable-shared builds)."""
    from pathlib import Path

    sos = sorted(Path(gmp.__file__).parent.rglob("*.so"))
    assert any(os.path.samefile(p, gmp.library_path()) for p in sos)
    for so in sos:
        tags = _elf_dynamic_tags(str(so))
        assert tags and 15 not in tags and 29 not in tags, f"{so} has a run path"


def test_slots_of_pools_never_called_through_c_are_not_retired() -> None:
    """Issue 18: after 64 pools that had called pluggable_symbols() were
    closed with live blocks, every new pool's pluggable_symbols() failed with
    "close a pool" (no pool held a slot) and blamed torch (never used). A
    slot whose C functions nobody called is given back; one that handed a
    C caller blocks still live at close is retired, and when all are, the
    error says so and how to recover, without blaming torch. In a child
    process: retired slots stay retired for the life of the process."""
    code = r'''
import ctypes, warnings
import gpumempool as gmp
from gpumempool import _native
n = _native.bindings.NumSlots()
warnings.simplefilter("ignore", gmp.LeakWarning)
for _ in range(2 * n):
    p = gmp.MemPool("sim", capacity=1 << 30)
    p.pluggable_symbols()
    p.alloc(4096)
    assert p.close().live_blocks
with gmp.MemPool("sim") as p:
    p.pluggable_symbols()
print("reused")
for _ in range(n):
    p = gmp.MemPool("sim", capacity=1 << 30)
    path, alloc_sym, _free = p.pluggable_symbols()
    fn = getattr(ctypes.CDLL(path), alloc_sym)
    fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    assert fn(4096, 0, None)
    assert p.close().live_blocks
try:
    gmp.MemPool("sim", name="late").pluggable_symbols()
except gmp.BackendError as e:
    print(e)
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "reused", r.stdout
    msg = lines[1]
    assert 'pool "late" needs C entry points but all 64 are taken: 64 retired because their pools were closed ' \
        "while blocks allocated through their C functions were still live" in msg, msg
    assert "free every block a C caller got from a pool (drop its torch tensors) before closing the pool" in msg
    assert "retired slots come back only in a new process" in msg
    assert "close a pool that" not in msg and "torch could" not in msg and "kept for torch" not in msg
