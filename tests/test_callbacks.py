"""The callback backend: segments from user C functions or Python callables
with torch's pluggable-allocator signatures."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

import gpumempool as gmp

MiB = 1 << 20


def test_c_functions_from_a_library(clib) -> None:
    clib.test_reset(-1)
    with gmp.MemPool(alloc=clib.test_alloc, free=clib.test_free, name="malloc", devices=2) as pool:
        a = pool.alloc(1000, device=1, stream=0xBEEF)
        assert clib.test_allocs() == 1
        assert clib.test_last_stream() == 0xBEEF
        assert clib.test_live_bytes() == 2 * MiB
        b = pool.alloc(1000, device=1, stream=0xBEEF)
        assert b == a + 1024 and clib.test_allocs() == 1  # served from the cached segment
        # The memory is real: write and read it through the address.
        ctypes.memset(a, 0x5A, 1000)
        assert ctypes.string_at(a, 4) == b"\x5a" * 4
        pool.free(a)
        pool.free(b)
        assert pool.config()["backend"] == "malloc"
        assert pool.empty_cache() == 2 * MiB
        assert clib.test_frees() == 1 and clib.test_live_bytes() == 0


def test_c_functions_as_int_addresses(clib) -> None:
    clib.test_reset(-1)
    alloc_addr = ctypes.cast(clib.test_alloc, ctypes.c_void_p).value
    free_addr = ctypes.cast(clib.test_free, ctypes.c_void_p).value
    pool = gmp.MemPool("callback", alloc=alloc_addr, free=free_addr)
    pool.alloc(30 * MiB)
    with pytest.warns(gmp.LeakWarning):
        pool.close()
    assert clib.test_allocs() == 1 and clib.test_frees() == 1 and clib.test_live_bytes() == 0


def test_null_from_c_is_out_of_memory_after_a_retry(clib) -> None:
    clib.test_reset(1)
    with gmp.MemPool(alloc=clib.test_alloc, free=clib.test_free) as pool:
        a = pool.alloc(12 * MiB)
        pool.free(a)
        # The cached segment is released and the allocation retried: the
        # retry fails too (fail_after=1), so OOM, with nothing leaked.
        with pytest.raises(gmp.OutOfMemoryError, match="returned NULL"):
            pool.alloc(30 * MiB)
        s = pool.stats()
        assert s["num_alloc_retries"] == 1 and s["num_ooms"] == 1
        assert clib.test_live_bytes() == 0


class PyAllocator:
    """A Python allocator over ctypes buffers."""

    def __init__(self) -> None:
        self.buffers: dict[int, ctypes.Array] = {}
        self.calls: list[tuple] = []

    def alloc(self, size: int, device: int, stream: int) -> int:
        self.calls.append(("alloc", size, device, stream))
        buf = (ctypes.c_char * (size + 512))()
        addr = (ctypes.addressof(buf) + 511) // 512 * 512
        self.buffers[addr] = buf
        return addr

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.calls.append(("free", ptr, size, device, stream))
        del self.buffers[ptr]


def test_python_callables() -> None:
    pa = PyAllocator()
    with gmp.MemPool(alloc=pa.alloc, free=pa.free, alignment=512) as pool:
        a = pool.alloc(5000, stream=7)
        ctypes.memset(a, 1, 5000)
        assert pa.calls == [("alloc", 2 * MiB, 0, 7)]
        pool.free(a)
        pool.empty_cache()
        assert pa.calls[-1] == ("free", a, 2 * MiB, 0, 7)
        assert not pa.buffers


def test_python_callables_serve_caller_sized_segments() -> None:
    """alloc_segment asks the function for the (rounded) request itself, not
    a 20 MiB segment, and a raising function is handled as in alloc."""
    fa = FlakyAllocator(fail_on=2)
    with gmp.MemPool(alloc=fa.alloc, free=fa.free) as pool:
        a = pool.alloc_segment(3 * MiB, stream=5)
        assert fa.n == 1 and pool.stats()["reserved_bytes.all.current"] == 4 * MiB
        pool.free(a)
        with pytest.warns(RuntimeWarning, match="alloc function raised RuntimeError: transient.*retried"):
            b = pool.alloc_segment(8 * MiB)
        assert fa.n == 3 and pool.stats()["reserved_bytes.all.current"] == 8 * MiB
        ctypes.memset(b, 1, 8 * MiB)
        pool.free(b)
    assert pool.close().live_blocks == []


def test_seed_001_style_one_argument_callables() -> None:
    live: dict[int, ctypes.Array] = {}

    def nccl_like_alloc(size):
        buf = ctypes.create_string_buffer(size + 512)
        addr = (ctypes.addressof(buf) + 511) // 512 * 512  # segments start 512-byte aligned
        live[addr] = buf
        return ctypes.c_void_p(addr)

    def nccl_like_free(ptr):
        del live[ptr]

    with gmp.MemPool(alloc=nccl_like_alloc, free=nccl_like_free) as pool:
        pool.free(pool.alloc(100))
        assert len(live) == 1
    assert not live


def test_python_callback_that_raises_is_chained() -> None:
    def bad_alloc(size, device, stream):
        raise KeyError("no memory today")

    with gmp.MemPool(alloc=bad_alloc, free=lambda *a: None) as pool:
        with pytest.raises(gmp.BackendError) as ei:
            pool.alloc(10)
        assert isinstance(ei.value.__cause__, KeyError)
        assert isinstance(ei.value, RuntimeError)
        pool.check()


@pytest.mark.parametrize("ret, cause", [("0x10", TypeError), (-1, ValueError), (1 << 70, ValueError)])
def test_python_callback_returning_garbage(ret, cause) -> None:
    with gmp.MemPool(alloc=lambda s, d, st: ret, free=lambda *a: None) as pool:
        with pytest.raises(gmp.BackendError) as ei:
            pool.alloc(10)
        assert isinstance(ei.value.__cause__, cause)


def test_python_callback_returning_none_is_oom() -> None:
    with gmp.MemPool(alloc=lambda s, d, st: None, free=lambda *a: None) as pool:
        with pytest.raises(gmp.OutOfMemoryError):
            pool.alloc(10)


def test_python_free_that_raises_surfaces_on_the_call() -> None:
    pa = PyAllocator()

    def bad_free(ptr, size, device, stream):
        raise OSError("deleter failed")

    with gmp.MemPool(alloc=pa.alloc, free=bad_free) as pool:
        pool.free(pool.alloc(10))
        with pytest.raises(gmp.BackendError) as ei:
            pool.empty_cache()
        assert isinstance(ei.value.__cause__, OSError)


def test_python_callbacks_from_many_threads() -> None:
    """The engine calls Python callbacks from its own threads; with the GIL
    released around every engine call this must not deadlock."""
    pa = PyAllocator()
    with gmp.MemPool(alloc=pa.alloc, free=pa.free) as pool:
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                for i in range(50):
                    a = pool.alloc((k + 1) * 11 * MiB + i * 512)  # a new segment each time
                    pool.free(a)
                    pool.empty_cache()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "deadlock"
        assert not errors
        assert not pa.buffers


# -- review regressions --------------------------------------------------------


def test_callback_pool_dropped_without_close_stays_callable() -> None:
    """The ctypes trampolines of Python callables live as long as the native
    pool (and its exported C functions), not as the MemPool object: a pool
    dropped without close() used to free them while the engine kept their
    addresses, and the next call through the C ABI crashed the process.
    (In a child process: the unfixed bug is a segfault.)"""
    script = textwrap.dedent(
        """
        import ctypes, gc, gpumempool as gmp
        from gpumempool import _callbacks, _native
        keep = {}
        def alloc(size, dev, stream):
            b = ctypes.create_string_buffer(size + 4096)
            a = (ctypes.addressof(b) + 4095) & ~4095
            keep[a] = b
            return a
        def free(ptr, size, dev, stream):
            keep.pop(ptr, None)
        pool = gmp.MemPool(alloc=alloc, free=free)
        path, asym, fsym = pool.pluggable_symbols()
        h = pool.handle
        del pool
        gc.collect()
        assert [p["id"] for p in gmp.pools()] == [h]
        lib = ctypes.CDLL(path)
        f = getattr(lib, asym)
        f.restype, f.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        g = getattr(lib, fsym)
        g.restype, g.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        ptr = f(3 << 20, 0, None)
        assert ptr and len(keep) == 1, (ptr, keep)
        ctypes.memset(ptr, 7, 3 << 20)
        g(ptr, 3 << 20, 0, None)
        _native.bindings.PoolClose(h)  # what close() does, by handle
        _callbacks._callback_refs.pop(h)
        assert not keep and gmp.pools() == []
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


def test_close_drops_the_callbacks_of_the_pool() -> None:
    from gpumempool import _callbacks

    pa = PyAllocator()
    pool = gmp.MemPool(alloc=pa.alloc, free=pa.free)
    h = pool.handle
    assert len(_callbacks._callback_refs[h]) == 2
    pool.close()
    assert h not in _callbacks._callback_refs


class FlakyAllocator(PyAllocator):
    """Raises on the n-th alloc call."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.n = 0
        self.fail_on = fail_on

    def alloc(self, size: int, device: int, stream: int) -> int:
        self.n += 1
        if self.n == self.fail_on:
            raise RuntimeError("transient")
        return super().alloc(size, device, stream)


def test_alloc_callback_error_then_a_successful_retry_returns_the_block() -> None:
    """The alloc function raises once; the engine takes that as out of
    memory, releases the cache and retries, which succeeds: the caller gets
    the block (and a warning), not a stale error with the block leaked."""
    fa = FlakyAllocator(fail_on=2)
    with gmp.MemPool(alloc=fa.alloc, free=fa.free) as pool:
        pool.free(pool.alloc(64 * MiB))  # one cached segment
        with pytest.warns(RuntimeWarning, match="alloc function raised RuntimeError: transient.*retried"):
            p = pool.alloc(128 * MiB)
        assert fa.n == 3 and pool.stats()["allocation.all.current"] == 1
        ctypes.memset(p, 1, 128 * MiB)
        pool.free(p)
        assert pool.stats()["allocation.all.current"] == 0
        pool.stats()  # nothing stale left to raise
    assert pool.close().live_blocks == []


def test_alloc_callback_warning_as_error_gives_the_block_back() -> None:
    fa = FlakyAllocator(fail_on=2)
    with gmp.MemPool(alloc=fa.alloc, free=fa.free) as pool:
        pool.free(pool.alloc(64 * MiB))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(RuntimeWarning):
                pool.alloc(128 * MiB)
        assert pool.stats()["allocation.all.current"] == 0


def test_callback_error_outside_a_python_call_is_not_raised_by_another_call() -> None:
    """A callback that raises while torch (here: ctypes) calls the C ABI has
    no Python caller to raise in: it must not surface in the next, unrelated
    pool call (on any thread); last_error() reports it."""
    def bad_alloc(size, device, stream):
        raise KeyError("boom")

    with gmp.MemPool(alloc=bad_alloc, free=lambda *a: None) as pool:
        path, asym, _ = pool.pluggable_symbols()
        f = getattr(ctypes.CDLL(path), asym)
        f.restype, f.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        assert f(4096, 0, None) is None
        pool.stats()
        pool.check()
        errs: list[BaseException] = []
        t = threading.Thread(target=lambda: errs.extend(_collect(pool.stats)))
        t.start()
        t.join()
        assert errs == []
        msg = pool.last_error()
        assert msg is not None and "KeyError" in msg and "boom" in msg
        assert pool.last_error() is None


def _collect(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return [exc]
    return []


def test_callback_errors_stay_with_the_call_of_their_thread() -> None:
    """Each pool call collects the exceptions its own callbacks raise on its
    thread: another thread's call, running meanwhile, never takes them (the
    pool used to keep one shared list, so a concurrent call could raise
    another thread's error, or a stale one after a success)."""
    from gpumempool._callbacks import CallbackErrors

    errors = CallbackErrors()
    in_a, b_done = threading.Event(), threading.Event()
    seen: dict[str, list] = {}

    def call_a() -> None:
        mine = errors.begin()
        try:
            in_a.set()
            assert b_done.wait(5)
            errors.add(ValueError("from A"), "alloc")  # A's callback raises
        finally:
            errors.end(mine)
        seen["A"] = mine

    a = threading.Thread(target=call_a)
    a.start()
    assert in_a.wait(5)
    mine = errors.begin()  # B's call, overlapping A's
    errors.end(mine)
    b_done.set()
    a.join(5)
    seen["B"] = mine
    assert seen["B"] == [] and [(k, str(e)) for k, e in seen["A"]] == [("alloc", "from A")]
    errors.add(KeyError("no call on this thread"), "free")  # through the C ABI: an orphan
    assert [type(e) for e in errors.take_orphans()] == [KeyError] and errors.take_orphans() == []


def test_close_with_a_raising_free_function_warns_and_closes() -> None:
    pa = PyAllocator()

    def bad_free(ptr, size, device, stream):
        raise OSError("device gone")

    pool = gmp.MemPool(alloc=pa.alloc, free=bad_free, name="gone")
    pool.free(pool.alloc(MiB))
    with pytest.warns(gmp.LeakWarning, match="'gone' closed, but the Python free function raised OSError: device gone"):
        with pool:
            pass
    assert pool.closed and all(p["name"] != "gone" for p in gmp.pools())
    with pytest.raises(gmp.PoolClosedError):
        pool.alloc(512)
    assert pool.close() is pool.close()  # closing again: the same report, no error


_REENTRY_SCRIPT = textwrap.dedent(
    """
    import ctypes, faulthandler, warnings
    import gpumempool as gmp

    faulthandler.dump_traceback_later(30, exit=True)  # a deadlock fails the test instead of hanging it
    live = {}
    seen = []

    def raw_alloc(size):
        buf = ctypes.create_string_buffer(size + 512)
        addr = (ctypes.addressof(buf) + 511) & ~511
        live[addr] = buf
        return addr

    def call(action):
        try:
            action()
        except gmp.CallbackReentryError as exc:
            seen.append("refused")
            assert isinstance(exc, RuntimeError) and "must not call into their own pool" in str(exc), exc
        else:
            seen.append("ran")

    calls = {}

    def alloc(size, device, stream):
        action = calls.pop("alloc", None)
        if action is not None:
            call(action)
        return raw_alloc(size)

    def free(ptr, size, device, stream):
        action = calls.pop("free", None)
        if action is not None:
            call(action)
        live.pop(ptr)

    other = gmp.MemPool(name="other")
    pool = gmp.MemPool(alloc=alloc, free=free, name="reent")
    for kind, action in [
        ("alloc", lambda: pool.stats()),
        ("alloc", lambda: pool.free(pool.alloc(10))),
        ("alloc", lambda: pool.config()),
        ("alloc", lambda: pool.last_error()),
        ("alloc", lambda: pool.close()),
        ("free", lambda: pool.empty_cache()),
        ("free", lambda: pool.snapshot()),
    ]:
        calls[kind] = action
        pool.free(pool.alloc(3 << 20))  # a new segment: alloc runs
        pool.empty_cache()  # free runs
    assert seen == ["refused"] * 7, seen
    assert pool.name == "reent" and not pool.closed

    # Another pool may be used from the callback.
    calls["alloc"] = lambda: other.free(other.alloc(10))
    pool.free(pool.alloc(3 << 20))
    assert seen[-1] == "ran", seen

    # A refusal that escapes the function is that function's error.
    def greedy_alloc(size, device, stream):
        greedy.stats()
        return raw_alloc(size)

    greedy = gmp.MemPool(alloc=greedy_alloc, free=free, name="greedy")
    try:
        greedy.alloc(10)
    except gmp.BackendError as exc:
        assert isinstance(exc.__cause__, gmp.CallbackReentryError), repr(exc.__cause__)
    else:
        raise AssertionError("no error")

    # Through the C ABI (torch calling the pool): refused too, kept for last_error().
    path, asym, fsym = greedy.pluggable_symbols()
    f = getattr(ctypes.CDLL(path), asym)
    f.restype, f.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    assert f(4096, 0, None) is None
    assert "CallbackReentryError" in greedy.last_error()

    # Close while a free function calls back: refused, and the pool still closes.
    calls["free"] = lambda: pool.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool.close()
        greedy.close()
    assert seen[-1] == "refused" and pool.closed and not live
    other.close()
    print("ok")
    """
)


def test_python_callback_calling_its_own_pool_is_refused_not_deadlocked() -> None:
    """The engine holds the pool's lock while it runs the pool's alloc/free
    functions: a Python function calling back into that pool would wait for
    itself forever. Such calls raise CallbackReentryError; other pools stay
    usable from the function. (A subprocess: a regression would hang.)"""
    r = subprocess.run([sys.executable, "-c", _REENTRY_SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-3000:])


def test_reentry_marker_is_per_pool_and_per_thread() -> None:
    pa = PyAllocator()
    inner: list[bool] = []

    def alloc(size, device, stream):
        inner.append(pool._callback_errors.inside())
        t = threading.Thread(target=lambda: inner.append(pool._callback_errors.inside()))
        t.start()
        t.join()
        return pa.alloc(size, device, stream)

    with gmp.MemPool(alloc=alloc, free=pa.free) as pool:
        assert not pool._callback_errors.inside()
        pool.free(pool.alloc(10))
        assert inner == [True, False]  # set on the callback's thread only
        assert not pool._callback_errors.inside()  # and cleared after it


# ctypes functions that wrap Python functions -------------------------------


def test_ctypes_wrapped_python_function_is_a_python_callback() -> None:
    """ALLOC_FN(pyfunc) runs Python code: called through ctypes, an exception
    it raised was printed ("Exception ignored") and the pool handed out
    whatever ctypes returned (0xfffffffffffffe00). It is routed as the Python
    function it wraps: errors are caught and the pool counts as having
    Python callbacks (torch's GIL warning applies)."""
    calls: list = []

    def alloc(size, device, stream):
        calls.append(size)
        raise ValueError("boom")

    pool = gmp.MemPool(alloc=gmp.ALLOC_FN(alloc), free=gmp.FREE_FN(lambda *a: calls.append(a)))
    with pool:
        assert pool._py_callbacks
        with pytest.raises(gmp.BackendError) as ei:
            pool.alloc(1024)
        assert isinstance(ei.value.__cause__, ValueError)
        assert pool.stats()["allocation.all.current"] == 0


def test_ctypes_wrapped_python_functions_allocate() -> None:
    pa = PyAllocator()
    a_fn, f_fn = gmp.ALLOC_FN(pa.alloc), gmp.FREE_FN(pa.free)
    # a cast of one keeps the thunk in the shared _objects: still Python
    cast_a = ctypes.cast(a_fn, gmp.ALLOC_FN)
    with gmp.MemPool(alloc=cast_a, free=f_fn) as pool:
        assert pool._py_callbacks
        a = pool.alloc(5000, stream=7)
        pool.free(a)
        pool.empty_cache()
    assert pa.calls == [("alloc", 2 * MiB, 0, 7), ("free", a, 2 * MiB, 0, 7)]


def test_ctypes_functions_of_c_code_stay_native(clib) -> None:
    from gpumempool._callbacks import _python_callable_of

    addr = ctypes.cast(clib.test_alloc, ctypes.c_void_p).value
    for fn in (clib.test_alloc, gmp.ALLOC_FN(addr), ctypes.cast(clib.test_alloc, gmp.ALLOC_FN)):
        assert _python_callable_of(fn, "alloc") is None
    clib.test_reset(-1)
    with gmp.MemPool(alloc=gmp.ALLOC_FN(addr), free=clib.test_free) as pool:
        assert not pool._py_callbacks
        pool.free(pool.alloc(10))


def test_ctypes_wrapped_python_function_that_cannot_be_unwrapped_is_refused(monkeypatch) -> None:
    """Should a future CPython hide the thunk's callable, such a function is
    refused with a clear TypeError, never passed to the engine as C code."""
    from gpumempool import _callbacks

    monkeypatch.setattr(_callbacks.gc, "get_referents", lambda *objs: [])
    with pytest.raises(TypeError, match="pass the Python function itself"):
        gmp.MemPool(alloc=gmp.ALLOC_FN(lambda s, d, st: None), free=gmp.FREE_FN(lambda *a: None))


def test_finalizer_free_inside_the_pools_own_callback_is_deferred() -> None:
    # The cyclic GC may run a block owner's __del__ (gpumempool.cupy's) while
    # the pool's own Python allocator function runs, with the engine's lock
    # held: the free waits for the native call to return instead of failing
    # (CallbackReentryError) and leaking the block.
    from gpumempool import scope

    bufs: dict[int, ctypes.Array] = {}

    def alloc(size: int, device: int, stream: int) -> int:
        gc.collect()  # stands for any allocation that triggers the cyclic GC
        b = ctypes.create_string_buffer(size + 512)
        a = (ctypes.addressof(b) + 511) // 512 * 512  # segments start 512-byte aligned
        bufs[a] = b
        return a

    def free(ptr: int, size: int, device: int, stream: int) -> None:
        bufs.pop(ptr, None)

    errors: list[BaseException] = []
    with gmp.MemPool(alloc=alloc, free=free) as pool:

        class Owner:  # garbage in a reference cycle
            def __init__(self, ptr: int) -> None:
                self.ptr, self.me = ptr, self

            def __del__(self) -> None:
                scope.free_from_finalizer(pool, self.ptr, errors.append)

        gc.disable()
        try:
            p = pool.alloc(1 << 20)
            Owner(p)
            q = pool.alloc(4 << 20)  # a new segment: alloc runs, the GC runs __del__ inside it
        finally:
            gc.enable()
        assert errors == []
        assert pool.stats()["allocated_bytes.all.current"] == 4 << 20, "p was freed once alloc returned"
        pool.free(q)


def test_c_function_calling_its_own_pool_is_refused_not_deadlocked(clib) -> None:
    # A C allocator function that calls the pool's own C entry point runs
    # under the pool's lock: the inner call gets NULL and an error instead
    # of waiting forever. In a child process, so a regression cannot hang
    # the suite.
    code = (
        "import ctypes, sys, gpumempool as gmp\n"
        "lib = ctypes.CDLL(sys.argv[1])\n"
        "lib.reentry_result.restype = ctypes.c_size_t\n"
        "lib.caller_open.argtypes = [ctypes.c_char_p] * 3\n"
        "alloc = ctypes.cast(lib.reentrant_alloc, ctypes.c_void_p).value\n"
        "free = ctypes.cast(lib.test_free, ctypes.c_void_p).value\n"
        "with gmp.MemPool(alloc=alloc, free=free) as pool:\n"
        "    assert lib.caller_open(*(s.encode() for s in pool.pluggable_symbols())) == 0\n"
        "    p = pool.alloc(4096)\n"
        "    print(lib.reentry_result(), repr(pool.last_error()))\n"
        "    pool.free(p)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, clib._name], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert r.returncode == 0, r.stderr
    inner, message = r.stdout.strip().split(" ", 1)
    assert int(inner) == 0
    assert "own allocator function" in message


@pytest.mark.parametrize("alloc_bad", [True, False], ids=["alloc", "free"])
@pytest.mark.parametrize("bad", [5, 0x1000, "heap", "ctypes"])
def test_addresses_that_are_no_code_are_refused(clib, alloc_bad: bool, bad: object) -> None:
    """MemPool(alloc=5, free=6).alloc(100) killed the process (SIGSEGV): an
    integer (or ctypes-from-address) function must lie in executable memory."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the check reads /proc/self/maps")
    keep = ctypes.create_string_buffer(64)
    if bad == "heap":
        bad = ctypes.addressof(keep)
    elif bad == "ctypes":
        bad = gmp.ALLOC_FN(5) if alloc_bad else gmp.FREE_FN(6)
    good = clib.test_alloc if alloc_bad is False else clib.test_free
    kind = "alloc" if alloc_bad else "free"
    kwargs = {"alloc": bad, "free": good} if alloc_bad else {"alloc": good, "free": bad}
    with pytest.raises(ValueError, match=f"^{kind} address 0x[0-9a-f]+ is not a C function"):
        gmp.MemPool(**kwargs)


def test_addresses_of_real_functions_still_work(clib) -> None:
    addr = ctypes.cast(clib.test_alloc, ctypes.c_void_p).value
    libc = ctypes.CDLL(None)
    with gmp.MemPool(alloc=addr, free=ctypes.cast(clib.test_free, ctypes.c_void_p).value) as pool:
        pool.free(pool.alloc(100))
    with gmp.MemPool(alloc=libc.malloc, free=clib.test_free):  # a ctypes function of another library
        pass


def test_misaligned_addresses_are_refused_and_given_back() -> None:
    """alloc returning 513 was accepted and the pool handed out 0x201,
    though blocks are 512-byte aligned: now the address goes back to free
    and the allocation fails, naming the address and the alignment."""
    freed = []
    with gmp.MemPool(alloc=lambda s, d, st: 513, free=lambda p, s, d, st: freed.append(p)) as pool:
        assert pool.config()["alignment"] == 512
        with pytest.raises(gmp.BackendError, match="returned 0x201, not aligned to 512 bytes"):
            pool.alloc(100)
        assert freed == [513]
        assert pool.stats()["reserved_bytes.all.current"] == 0
    # alignment=1 opts out (an allocator known to hand out less aligned memory)
    bufs: dict[int, ctypes.Array] = {}

    def alloc16(size, dev, stream):
        b = ctypes.create_string_buffer(size + 32)
        a = (ctypes.addressof(b) + 15) // 16 * 16 + 16  # 16-byte aligned, never 512
        a += 16 if a % 512 == 0 else 0
        bufs[a] = b
        return a

    with gmp.MemPool(alloc=alloc16, free=lambda p, *a: bufs.pop(p), alignment=1) as pool:
        p = pool.alloc(100)
        assert p % 512 != 0
        pool.free(p)


def _reentering_alloc(holder: dict):
    def alloc(size, device, stream):
        holder["pool"].stats()  # refused: CallbackReentryError inside the function
    return alloc


@pytest.mark.parametrize("case", ["raises", "huge", "str", "reenters"])
def test_a_failing_python_alloc_function_is_not_reported_as_out_of_memory(case: str) -> None:
    """The error said '... out of memory ... returned NULL: backend out of
    memory (raised by the Python alloc function: TypeError: mine)': it now
    leads with what the function did, and claims neither NULL nor OOM."""
    holder: dict = {}

    def raises(size, device, stream):
        raise TypeError("mine")

    alloc = {"raises": raises, "huge": lambda s, d, st: 2**70, "str": lambda s, d, st: "0x1000",
             "reenters": _reentering_alloc(holder)}[case]
    expected = {
        "raises": "the Python alloc function raised TypeError: mine",
        "huge": "the Python alloc function returned 1180591620717411303424, not a 64-bit address",
        "str": "the Python alloc function returned a str, not an int address",
        "reenters": "the Python alloc function raised CallbackReentryError: pool 'cb' was called from inside",
    }[case]
    with gmp.MemPool(alloc=alloc, free=lambda *a: None, name="cb") as pool:
        holder["pool"] = pool
        with pytest.raises(gmp.BackendError) as ei:
            pool.alloc(100)
        msg = str(ei.value)
        assert msg.startswith(expected), msg
        assert msg.endswith('(pool "cb" could not allocate 100 B on device 0)'), msg
        assert "NULL" not in msg and "out of memory" not in msg
        assert not isinstance(ei.value, MemoryError)


def test_a_failing_python_alloc_function_names_the_pool_and_size_as_the_engine_does() -> None:
    """The failure's tail names the pool and the request exactly as the
    engine's out-of-memory message does (Go's %q quoting, its byte units up
    to EiB): the refactor that made it from the error's fields quoted the
    name as JSON ("\\u0001", a raw no-break space) and stopped at TiB."""
    def raises(size, device, stream):
        raise TypeError("mine")

    name = "c\x01b\u00a0\x7f\x85\U0001F600\u2028\t\"\\"
    with gmp.MemPool(alloc=raises, free=lambda *a: None, name=name) as pool:
        for size, shown in ((100, "100 B"), (1 << 50, "1.00 PiB")):
            with pytest.raises(gmp.BackendError) as ei:
                pool.alloc(size)
            assert str(ei.value).endswith(
                '(pool "c\\x01b\\u00a0\\x7f\\u0085\U0001F600\\u2028\\t\\"\\\\" could not allocate '
                + shown + ' on device 0)'), str(ei.value)


def test_the_failing_alloc_functions_pool_is_quoted_by_the_engines_unicode_tables() -> None:
    """Go's %q escapes what Go's Unicode tables call unprintable, which are
    not Python's: U+1F6DC and U+0CF3 came with Unicode 15 (Go prints them;
    a Python whose tables are older, 3.11's 14.0, would escape them), U+0378
    is unassigned in both. The name reads as in the engine's own message."""
    def raises(size, device, stream):
        raise TypeError("mine")

    name = "w\U0001F6DCk\u0CF3u\u0378"
    with gmp.MemPool("sim", name=name, limit=MiB) as sim:
        with pytest.raises(gmp.OutOfMemoryError) as oom:
            sim.alloc(2 * MiB)
    engine_quoted = str(oom.value).split(" (sim backend)")[0].removeprefix("pool ")
    with gmp.MemPool(alloc=raises, free=lambda *a: None, name=name) as pool:
        with pytest.raises(gmp.BackendError) as ei:
            pool.alloc(100)
    assert str(ei.value).endswith(f"(pool {engine_quoted} could not allocate 100 B on device 0)"), \
        (str(ei.value), engine_quoted)


_ATEXIT_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef uintptr_t (*afn)(int64_t, size_t, int, uintptr_t);
static afn f; static int64_t h;
static void late(void) { fprintf(stderr, "late alloc -> %#lx\n", (unsigned long)f(h, 64 << 20, 0, 0)); }
void arm(void *fn, int64_t handle) { f = (afn)fn; h = handle; atexit(late); }
"""


def test_python_callback_pool_called_from_c_after_interpreter_exit(tmp_path) -> None:
    """A pool left open at exit (torch may still free into it) whose alloc
    is a Python function, called from C after the interpreter finalized (a
    C atexit handler here; torch's destructors in practice): the thunk is
    gone, so the engine must not call it. The call gets NULL, the process
    exits cleanly (it crashed with SIGSEGV)."""
    src = tmp_path / "late.c"
    src.write_text(_ATEXIT_C)
    so = tmp_path / "liblate.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    code = textwrap.dedent("""
        import ctypes, sys, gpumempool as gmp
        lib = ctypes.CDLL(gmp.library_path()); late = ctypes.CDLL(sys.argv[1])
        late.arm.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        keep = {}
        def alloc(s, d, st):
            b = ctypes.create_string_buffer(s + 512); a = (ctypes.addressof(b) + 511) // 512 * 512
            keep[a] = b
            return a
        pool = gmp.MemPool(alloc=alloc, free=lambda p, *a: keep.pop(p, None))
        pool.free(pool.alloc(100))  # the functions work while Python runs
        late.arm(ctypes.cast(lib.gmp_pool_alloc, ctypes.c_void_p).value, pool.handle)
    """)
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(so)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert r.returncode == 0, r.stderr[-600:]
    assert "late alloc -> 0" in r.stderr


def test_allocator_addresses_that_wrap_or_overlap_are_refused() -> None:
    """A segment running past the end of the address space, or overlapping
    one the function returned before and still holds, is a broken
    allocator: refused (and given back), never served."""
    top = (1 << 64) - 512
    freed: list[int] = []
    with gmp.MemPool(alloc=lambda s, d, st: top, free=lambda p, *a: freed.append(p)) as pool:
        for _ in range(3):
            with pytest.raises(gmp.BackendError, match="past the end of the address space"):
                pool.alloc(100)
        pool.check()
    assert freed == [top] * 3
    seq = iter([0x10000000, 0x10000000 + 2048])
    with gmp.MemPool(alloc=lambda s, d, st: next(seq), free=lambda *a: None) as pool:
        a = pool.alloc(30 * MiB)
        with pytest.raises(gmp.BackendError, match="overlaps the segment 0x10000000"):
            pool.alloc(30 * MiB)
        pool.free(a)


def test_device_count_is_bounded() -> None:
    with pytest.raises(ValueError, match="devices"):
        gmp.MemPool(alloc=lambda *a: None, free=lambda *a: None, devices=2**31 - 1)
    with gmp.MemPool(alloc=lambda *a: None, free=lambda *a: None, devices=1024) as pool:
        assert pool.config()["name"]


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_an_allocator_function_interrupts(exc_type: type) -> None:
    """Ctrl-C (or sys.exit) inside a Python alloc function stays itself,
    whether the engine's retry then succeeded (the block goes back) or not;
    it was a BackendError or a RuntimeWarning."""
    pa = PyAllocator()
    calls = [0]

    def interrupted(size: int, device: int, stream: int) -> int:
        calls[0] += 1
        if calls[0] in (2, 4, 5):
            raise exc_type()
        return pa.alloc(size, device, stream)

    with gmp.MemPool(alloc=interrupted, free=pa.free) as pool:
        pool.free(pool.alloc(100))  # call 1: a cached segment
        with pytest.raises(exc_type):
            pool.alloc(30 * MiB)  # call 2 raises; the retry (3) succeeds
        assert pool.stats()["allocation.all.current"] == 0, "the block went back"
        pool.empty_cache()
        with pytest.raises(exc_type):
            pool.alloc(30 * MiB)  # calls 4 and 5 raise: the allocation fails
    assert not pa.buffers


def test_reentry_through_another_pool_is_refused_not_deadlocked(clib) -> None:
    """A's Python alloc function uses pool B, whose C alloc function calls
    A's C entry point: A's lock is held by this thread, so that call is
    refused (NULL) instead of waiting for it forever (only the innermost
    pool's function used to count). In a child process: a deadlock there
    is a timeout here."""
    code = textwrap.dedent("""
        import ctypes, sys, gpumempool as gmp
        lib = ctypes.CDLL(sys.argv[1])
        lib.reentry_result.restype = ctypes.c_size_t
        lib.caller_open.argtypes = [ctypes.c_char_p] * 3
        bufs = {}
        def a_alloc(size, dev, st):
            B.free(B.alloc(64))
            b = ctypes.create_string_buffer(size + 512)
            a = (ctypes.addressof(b) + 511) // 512 * 512
            bufs[a] = b
            return a
        A = gmp.MemPool(alloc=a_alloc, free=lambda p, *x: bufs.pop(p, None), name="A")
        B = gmp.MemPool(alloc=ctypes.cast(lib.reentrant_alloc, ctypes.c_void_p).value,
                        free=ctypes.cast(lib.test_free, ctypes.c_void_p).value, name="B")
        assert lib.caller_open(*(s.encode() for s in A.pluggable_symbols())) == 0
        A.alloc(100)
        print(lib.reentry_result())
    """)
    try:
        r = subprocess.run([sys.executable, "-W", "ignore", "-c", code, clib._name], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: A's C entry point, called from B's allocator inside A's, waited for A's lock")
    assert r.returncode == 0, r.stderr[-600:]
    assert r.stdout.strip() == "0"


def test_a_pool_closed_by_an_atexit_handler_still_calls_its_python_free() -> None:
    """The engine stops calling Python allocator functions at exit only
    after the atexit handlers registered since gpumempool's import ran: one
    of those closing a pool still gets its memory back."""
    code = textwrap.dedent("""
        import atexit, ctypes, gpumempool as gmp
        keep = {}
        state = {}
        def cleanup():
            state["pool"].close()
            print("outstanding", len(keep), flush=True)
        atexit.register(cleanup)
        def alloc(s, d, st):
            b = ctypes.create_string_buffer(s + 512); a = (ctypes.addressof(b) + 511) // 512 * 512
            keep[a] = b
            return a
        pool = gmp.MemPool(alloc=alloc, free=lambda p, *a: keep.pop(p, None))
        pool.free(pool.alloc(100))  # one cached segment
        state["pool"] = pool
    """)
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert r.returncode == 0, r.stderr[-600:]
    assert r.stdout.strip() == "outstanding 0", r.stdout
