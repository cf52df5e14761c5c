"""gpumempool._lifecycle: what MemPool tells the modules above it (close
hooks in stages, open pools, the end of native calls of callback pools)."""

from __future__ import annotations

import ctypes
from typing import Callable, Optional

import pytest

import gpumempool as gmp
from gpumempool import _lifecycle


def test_close_hooks_run_by_stage_then_subscription_and_report_problems() -> None:
    pool = gmp.MemPool("sim", name="hooked", capacity=1 << 26)
    ran: list[str] = []

    def hook(name: str, problem: Optional[str] = None, raises: bool = False) -> Callable[[gmp.MemPool], Optional[str]]:
        def run(closing: gmp.MemPool) -> Optional[str]:
            if closing is pool:
                ran.append(name)
                if raises:
                    raise ValueError(f"{name} broke")
                return problem
            return None

        run.__qualname__ = name
        return run

    subscribed = [
        _lifecycle.on_close(hook("last", "a scope was entered"), _lifecycle.LAST),
        _lifecycle.on_close(hook("normal-1", raises=True)),
        _lifecycle.on_close(hook("first"), _lifecycle.FIRST),
        _lifecycle.on_close(hook("normal-2")),
    ]
    try:
        with pytest.warns(gmp.LeakWarning) as caught:
            pool.close()
    finally:
        for unsubscribe in subscribed:
            unsubscribe()
    # gpumempool.torch's hook is first, gpumempool.scope's last: the
    # package's own subscribers keep their places around these.
    assert ran == ["first", "normal-1", "normal-2", "last"]
    messages = [str(w.message) for w in caught]
    assert "closing pool anyway: normal-1 raised ValueError: normal-1 broke" in messages
    assert "closing pool anyway: a scope was entered" in messages
    assert pool.closed
    ran.clear()
    gmp.MemPool("sim", name="later").close()
    assert ran == []  # unsubscribed


def test_the_package_s_subscribers_run_torch_first_and_scopes_last() -> None:
    hooks = _lifecycle.close_hooks()
    modules = [h.__module__ for h in hooks]
    assert modules[0] == "gpumempool.torch" and modules[-1] == "gpumempool.scope", modules
    assert "gpumempool.cupy" in modules


def test_open_pools_are_the_open_ones_oldest_first() -> None:
    a = gmp.MemPool("sim", name="a")
    b = gmp.MemPool("sim", name="b")
    c = gmp.MemPool("sim", name="c")
    try:
        b.close()
        mine = [p for p in _lifecycle.open_pools() if p in (a, b, c)]
        assert mine == [a, c]
        assert gmp._pool.open_pools is _lifecycle.open_pools
    finally:
        a.close()
        c.close()


def test_native_call_done_runs_after_each_call_of_a_callback_pool() -> None:
    calls: list[int] = []
    buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def alloc(size: int, device: int, stream: int) -> int:
        buf = ctypes.create_string_buffer(size + 512)
        addr = (ctypes.addressof(buf) + 511) // 512 * 512  # the backend's alignment
        buffers[addr] = buf
        return addr

    def free(ptr: int, size: int, device: int, stream: int) -> None:
        buffers.pop(ptr, None)

    def count() -> None:
        calls.append(1)

    unsubscribe = _lifecycle.after_native_call(count)
    try:
        with gmp.MemPool(alloc=alloc, free=free) as pool:
            before = len(calls)
            pool.free(pool.alloc(1000))
            assert len(calls) - before == 2
    finally:
        unsubscribe()
