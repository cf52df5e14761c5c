"""The callback backend: segments from user C functions or Python callables
with torch's pluggable-allocator signatures."""

from __future__ import annotations

import ctypes
import threading

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


def test_seed_001_style_one_argument_callables() -> None:
    live: dict[int, ctypes.Array] = {}

    def nccl_like_alloc(size):
        buf = ctypes.create_string_buffer(size)
        live[ctypes.addressof(buf)] = buf
        return ctypes.c_void_p(ctypes.addressof(buf))

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
