"""The Python API over the sim backend: allocation, caching, streams, stats,
limits, OOM, trim, close."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

import gpumempool as gmp

MiB = 1 << 20


def test_alloc_free_reuses_cached_block(pool: gmp.MemPool) -> None:
    a = pool.alloc(1000, device=0, stream=0)
    assert isinstance(a, int) and a % 512 == 0
    pool.free(a)
    b = pool.alloc(1000)
    assert b == a
    s = pool.stats()
    assert s["num_cache_hits"] == 1
    assert s["num_device_alloc"] == 1
    assert s["allocated_bytes.all.current"] == 1024
    assert s["requested_bytes.all.current"] == 1000
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    pool.check()


def test_stats_have_torch_keys(pool: gmp.MemPool) -> None:
    pool.alloc(3 * MiB)
    s = pool.stats()
    for stat in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                 "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for p in ("all", "small_pool", "large_pool"):
            for f in ("current", "peak", "allocated", "freed"):
                assert f"{stat}.{p}.{f}" in s
    assert s["num_alloc_retries"] == 0 and s["num_ooms"] == 0
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["inactive_split.large_pool.current"] == 1
    assert pool.stats(0) == s


def test_streams_are_separate_and_record_stream_defers_reuse() -> None:
    with gmp.MemPool("sim", manual_events=True) as pool:
        a = pool.alloc(4096, stream=1)
        pool.free(a)
        assert pool.alloc(4096, stream=2) != a
        b = pool.alloc(4096, stream=1)
        assert b == a
        pool.record_stream(b, 2)
        pool.free(b)
        assert pool.stats()["active_bytes.all.current"] == 2 * 4096
        c = pool.alloc(4096, stream=1)
        assert c != b
        pool.sim.complete(2)
        assert pool.process_events() == 0
        assert pool.alloc(4096, stream=1) == b
        pool.check()


def test_stream_objects_are_accepted(pool: gmp.MemPool) -> None:
    class TorchLikeStream:
        cuda_stream = 0x77

    a = pool.alloc(100, stream=TorchLikeStream())
    pool.free(a)
    assert pool.alloc(100, stream=0x77) == a
    assert pool.alloc(100, device="cuda:0", stream=None) != a


def test_limit_and_oom_error_names_the_numbers() -> None:
    with gmp.MemPool("sim", name="capped", limit=4 * MiB, capacity=64 * MiB) as pool:
        keep = [pool.alloc(MiB) for _ in range(4)]
        with pytest.raises(gmp.OutOfMemoryError) as ei:
            pool.alloc(MiB)
        assert isinstance(ei.value, MemoryError)
        msg = str(ei.value)
        assert 'pool "capped"' in msg and "device 0" in msg and "limit 4.00 MiB" in msg
        assert "4.00 MiB allocated" in msg and "4.00 MiB reserved" in msg
        assert pool.stats()["num_ooms"] == 1
        pool.set_limit(None)
        keep.append(pool.alloc(MiB))
        for k in keep:
            pool.free(k)


def test_limit_per_device() -> None:
    with gmp.MemPool("sim", devices=2, capacity=64 * MiB) as pool:
        pool.set_limit(8 * MiB)
        pool.set_limit(2 * MiB, device=1)
        assert pool.limit(0) == 8 * MiB and pool.limit(1) == 2 * MiB
        keep = [pool.alloc(MiB, device=1) for _ in range(2)]
        with pytest.raises(gmp.OutOfMemoryError, match="device 1"):
            pool.alloc(MiB, device=1)
        keep += [pool.alloc(MiB, device=0) for _ in range(4)]  # device 0 keeps 8 MiB
        with pytest.raises(ValueError):
            pool.set_limit(MiB, device=2)
        with pytest.raises(ValueError):
            pool.limit(5)
        pool.set_limit(None)  # every device, single-device caps dropped
        assert pool.limit(0) is None and pool.limit(1) is None
        keep.append(pool.alloc(MiB, device=1))
        for k in keep:
            pool.free(k)


def test_garbage_collection_threshold_releases_old_segments_before_the_limit() -> None:
    with gmp.MemPool("sim", capacity=1 << 30, limit=100 * MiB, garbage_collection_threshold=0.5) as pool:
        assert pool.config()["garbage_collection_threshold"] == 0.5
        a, b = pool.alloc(20 * MiB), pool.alloc(20 * MiB)
        pool.free(a)
        c = pool.alloc(30 * MiB)
        pool.free(b)
        pool.free(c)
        d = pool.alloc(40 * MiB)  # 70 MiB reserved > 50 MiB: the oldest segment (a's) goes first
        s = pool.stats()
        assert s["num_gc_releases"] == 1 and s["reserved_bytes.all.current"] == 90 * MiB
        assert s["num_alloc_retries"] == 0 and s["num_ooms"] == 0
        pool.free(d)
    for bad in (1.0, -0.5):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            gmp.MemPool("sim", garbage_collection_threshold=bad)
    with pytest.raises(TypeError):
        gmp.MemPool("sim", garbage_collection_threshold="0.5")


def test_torch_version_selects_the_best_fit_tie_break() -> None:
    """Two free 40 MiB segments, the older at the higher address: torch
    2.5-2.14 take the lower address, 2.15 the older segment."""
    for version, oldest in ((None, False), ("2.11.0", False), ("2.15", True), ("2.15.0+cu130", True)):
        with gmp.MemPool("sim", capacity=1 << 30, torch_version=version) as pool:
            assert pool.config()["torch_version"] == (version or "")
            first, old, keep = (pool.alloc(40 * MiB) for _ in range(3))
            pool.free(first)
            pool.empty_cache()
            young = pool.alloc(40 * MiB)
            assert young == first  # the sim hands out the lowest free range
            pool.free(old)
            pool.free(young)
            got = pool.alloc(40 * MiB)
            assert got == (old if oldest else young), version
            pool.free(got)
            pool.free(keep)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        gmp.MemPool("sim", torch_version="latest")
    with pytest.raises(TypeError):
        gmp.MemPool("sim", torch_version=2.15)


def test_memory_summary_reads_like_torchs() -> None:
    with gmp.MemPool("sim", name="acts", devices=2, capacity=1 << 30) as pool:
        keep = [pool.alloc(1000), pool.alloc(5 * MiB), pool.alloc(3000, device=1)]
        pool.free(pool.alloc(100))
        text = pool.memory_summary()
        lines = text.splitlines()
        assert len({len(line) for line in lines}) == 1  # a closed box
        assert "gpumempool acts (sim), all devices" in lines[1]
        row = next(line for line in lines if line.startswith("| Allocated memory"))
        cells = [c.strip() for c in row.split("|")[2:6]]
        assert cells == ["5.00 MiB", "5.00 MiB", "5.00 MiB", "512 B"]  # 1 KiB + 5 MiB + 3 KiB; freed: the 100-byte block
        assert any(line.startswith("|       from large pool") for line in lines)
        assert "cache hits 1, backend allocs 3," in text  # the 100 bytes came from the small segment
        one = pool.memory_summary(device=1, abbreviated=True)
        assert "device 1" in one and "from large pool" not in one
        alloc_row = next(line for line in one.splitlines() if line.startswith("| Allocations"))
        assert [c.strip() for c in alloc_row.split("|")[2:6]] == ["1", "1", "1", "0"]
        for k in keep:
            pool.free(k)


def test_max_non_split_rounding_size() -> None:
    for rounding, reused in ((None, False), (64 * MiB, True)):
        with gmp.MemPool("sim", capacity=1 << 30, max_split_size=32 * MiB, max_non_split_rounding_size=rounding) as pool:
            assert pool.config()["max_non_split_rounding_size"] == (rounding or 20 * MiB)
            big = pool.alloc(100 * MiB)
            pool.free(big)
            got = pool.alloc(40 * MiB)  # 60 MiB more than asked: within 64 MiB, not within 20 MiB
            assert (got == big) is reused
            pool.free(got)


def test_oom_releases_cache_then_retries() -> None:
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        a, b = pool.alloc(15 * MiB), pool.alloc(15 * MiB)
        pool.free(a)
        pool.free(b)
        c = pool.alloc(40 * MiB)
        s = pool.stats()
        assert s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
        assert pool.sim.stats()["live_segments"] == 1
        pool.free(c)


def test_trim_and_release_threshold() -> None:
    with gmp.MemPool("sim") as pool:
        ptrs = [pool.alloc(12 * MiB) for _ in range(4)]
        for p in ptrs:
            pool.free(p)
        assert pool.trim(24 * MiB) == 24 * MiB
        assert pool.stats()["reserved_bytes.all.current"] == 24 * MiB
        assert pool.empty_cache() == 24 * MiB
        assert pool.sim.stats()["live_segments"] == 0
    with gmp.MemPool("sim", release_threshold=30 * MiB) as pool:
        ptrs = [pool.alloc(12 * MiB) for _ in range(4)]
        for p in ptrs:
            pool.free(p)
        assert pool.stats()["reserved_bytes.all.current"] <= 30 * MiB


def test_max_split_size_option() -> None:
    with gmp.MemPool("sim", max_split_size=24 * MiB) as pool:
        big = pool.alloc(40 * MiB)
        pool.free(big)
        assert pool.alloc(2 * MiB) != big
        s = pool.stats()
        assert s["max_split_size"] == 24 * MiB
        assert s["oversize_segments.current"] == 1


def test_close_reports_live_blocks_and_returns_segments() -> None:
    pool = gmp.MemPool("sim", name="leaky", devices=2)
    a = pool.alloc(100, device=1, stream=3)
    with pytest.warns(gmp.LeakWarning, match="1 live block"):
        rep = pool.close()
    assert rep.live_blocks == [gmp.LiveBlock(device=1, addr=a, size=512, requested=100, stream=3)]
    assert rep.segments_freed == 1 and rep.bytes_freed == 2 * MiB
    assert pool.closed
    assert pool.close() is rep  # idempotent
    for call in (lambda: pool.alloc(1), lambda: pool.free(a), lambda: pool.stats(), lambda: pool.empty_cache(),
                 lambda: pool.graph_pools(), lambda: pool.pluggable_hooks()):
        with pytest.raises(gmp.PoolClosedError):
            call()


def test_pools_share_the_default_sim_device() -> None:
    p1, p2 = gmp.MemPool(), gmp.MemPool()
    try:
        a, b = p1.alloc(4096), p2.alloc(4096)
        assert a != b  # one address space
        names = [p["id"] for p in gmp.pools()]
        assert p1.handle in names and p2.handle in names
    finally:
        p1.close()
        p2.close()


def test_threads_hammer_one_pool() -> None:
    with gmp.MemPool("sim", capacity=8 << 30) as pool:
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            try:
                for i in range(500):
                    a = pool.alloc(512 * (1 + (i * seed) % 300), stream=seed % 3)
                    pool.free(a)
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert not errors
        s = pool.stats()
        assert s["allocation.all.allocated"] == 8 * 500
        assert s["allocated_bytes.all.current"] == 0
        pool.check()


def test_module_functions() -> None:
    assert gmp.__version__ == "0.1.0"
    assert "sim" in gmp.backends() and "callback" in gmp.backends()
    info = gmp.device_info()
    assert isinstance(info["devices"], list)
    if not info["devices"]:
        assert "NVML" in info["reason"]
    assert gmp.library_path().endswith(".so")


def test_expandable_sim_segments_grow_in_place() -> None:
    # torch maps expandable segments of its large pool in 20 MiB pages, and
    # counts them in reserved bytes but not in its segment count
    with gmp.MemPool("sim", expandable=True, capacity=256 * MiB) as pool:
        a = pool.alloc(30 * MiB)  # two pages
        b = pool.alloc(30 * MiB)  # the 10 MiB free tail and one more page
        assert b == a + 30 * MiB
        s = pool.stats()
        assert s["segment.all.current"] == 0 and s["num_expansions"] == 1
        assert s["reserved_bytes.all.current"] == 60 * MiB
        assert pool.sim.stats()["expansions"] == 1
        pool.free(a)
        pool.free(b)
        c = pool.alloc(60 * MiB)
        assert c == a  # served from the two freed pieces
        # the free end of an expandable segment goes back with the cache, as
        # torch unmaps the free pages of its expandable segments
        d = pool.alloc(20 * MiB)
        pool.free(d)
        assert pool.stats()["reserved_bytes.all.current"] == 80 * MiB
        assert pool.empty_cache() == 20 * MiB
        assert pool.stats()["reserved_bytes.all.current"] == 60 * MiB
        assert pool.sim.stats()["shrinks"] == 1
        assert pool.alloc(20 * MiB) == d  # grows in place again


def test_expandable_sim_small_pool_grows_in_2mib_pages() -> None:
    # torch's small pool is expandable too: one segment a stream, 2 MiB pages
    with gmp.MemPool("sim", expandable=True, capacity=256 * MiB) as pool:
        addrs = [pool.alloc(MiB) for _ in range(3)]
        assert addrs == [addrs[0] + i * MiB for i in range(3)]
        s = pool.stats()
        assert s["reserved_bytes.small_pool.current"] == 4 * MiB
        assert s["segment.all.current"] == 0


def test_torch_methods_need_torch_and_say_so() -> None:
    import importlib.util

    with gmp.MemPool("sim", device=0) as pool:
        assert pool.device == 0
        if importlib.util.find_spec("torch") is not None:
            pytest.skip("torch is installed: the GPU tests cover these methods")
        assert pool.release() == 0  # no torch pool was made over it: nothing to give back
        for method in (pool.register, pool.deregister):
            with pytest.raises(gmp.GpuMemPoolError, match="needs torch"):
                method()


def _fast_error(fn: Any, *args: Any) -> tuple[str, str, dict[str, Any]]:
    """The error value (kind, message, fields) a call of the C fast path
    raised as a RuntimeError."""
    with pytest.raises(RuntimeError) as info:
        fn(*args)
    value = json.loads(str(info.value))
    return value["kind"], value["message"], value.get("fields", {})


def test_alloc_and_free_take_the_fast_path(clib) -> None:
    """The installed package has its C fast path (gpumempool._fastcall),
    which gives the same results and errors as gopy's calls."""
    from gpumempool import _fastcall, _pool

    assert _pool._fast is _fastcall
    with gmp.MemPool("callback", alloc=clib.test_alloc, free=clib.test_free) as cb:
        assert cb._fast is None  # callback pools release the GIL (gopy): their functions may need it
    with gmp.MemPool("sim", capacity=64 * 1024 * 1024) as p:
        assert p._fast is _fastcall
        handle = p.handle
        a = _fastcall.alloc(p.handle, 4096, 0, 0)
        assert p.stats()["allocated_bytes.all.current"] == 4096
        kind, message, _ = _fast_error(_fastcall.free, p.handle, 12345)
        assert kind == "InvalidPointerError" and "0x3039" in message, message
        _fastcall.free(p.handle, a)
        assert _fast_error(_fastcall.free, p.handle, a)[0] == "DoubleFreeError"
        kind, message, fields = _fast_error(_fastcall.alloc, p.handle, 1 << 40, 0, 0)
        assert kind == "OutOfMemoryError" and fields["requested"] == 1 << 40 and fields["device"] == 0, fields
        assert _fast_error(_fastcall.alloc, p.handle, 100, 9, 0)[0] == "InvalidArgumentError"
        with pytest.raises(gmp.InvalidPointerError):  # what MemPool raises (the OOM retry released the segment)
            p.free(a)
        from gpumempool import _native

        _native.bindings.DebugPanicNext(handle)
        kind, message, _ = _fast_error(_fastcall.alloc, handle, 100, 0, 0)
        assert kind == "BackendError" and message.startswith("Go panic recovered: injected"), message
        p.free(p.alloc(100))  # the pool carries on
    assert _fast_error(_fastcall.alloc, handle, 100, 0, 0)[0] == "PoolClosedError"  # the handle of a closed pool
    with pytest.raises(TypeError):
        _fastcall.alloc(1, 2, 3)  # type: ignore[call-arg]
    with pytest.raises(OverflowError):
        _fastcall.alloc(1, -5, 0, 0)


# -- cache scopes -------------------------------------------------------------


def test_close_inside_an_entered_cache_scope_warns_and_closes() -> None:
    from gpumempool import scope

    pool = gmp.MemPool("sim", name="scoped", capacity=64 * MiB)
    with pytest.warns(gmp.LeakWarning, match="cache scope.*'body'.*entered"):
        with gmp.cache_scope(pool, "body") as s:
            s.free(s.alloc(1000))  # one cached block
            s.alloc(1000)  # one live block
            pool.close()  # e.g. an error path; must not raise
    assert pool.closed and all(p["name"] != "scoped" for p in gmp.pools())
    assert id(pool) not in scope._registry and s.invalidated
    with pytest.raises(scope.ScopeError):
        s.alloc(1000)
    # The cached block went back before the close: only the live one is reported.
    assert len(pool.close().live_blocks) == 1


def test_cache_scope_owner_entries_survive_concurrent_alloc_and_free() -> None:
    """A block freed to a scope could be handed to another thread before its
    owner entry was dropped, which then dropped the new owner's entry: the
    module-level free (gpumempool.cupy's) sent the block to the pool while
    the scope still counted it live."""
    import sys

    from gpumempool import scope as sc

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with gmp.MemPool("sim", capacity=64 * MiB) as pool:
            s = sc.CacheScope(pool, "shared")
            bad: list[int] = []

            deadline = time.monotonic() + 1.0  # the race needs many tries; bounded in time

            def work() -> None:
                i = 0
                while time.monotonic() < deadline:
                    i += 1
                    p = s.alloc(1024)
                    with sc._lock:
                        owner = sc._registry[id(pool)].owners.get(p)
                    if owner is not s:
                        bad.append(p)
                    if i % 2:
                        s.free(p)
                    else:
                        sc.free(pool, p)

            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert bad == []
            assert s.live_bytes == 0
            # Every block came back to the scope, none to the pool behind its back.
            assert pool.stats()["allocation.all.current"] * 1024 == s.cached_bytes
            s.invalidate()
            assert pool.stats()["allocation.all.current"] == 0
    finally:
        sys.setswitchinterval(old)


def test_replay_is_the_function_and_the_module() -> None:
    import importlib
    import inspect
    import types

    import gpumempool.replay as r

    assert isinstance(r, types.ModuleType) and r is importlib.import_module("gpumempool.replay")
    assert r.parse_size("2KiB") == 2048 and gmp.replay is r
    tr = gmp.Trace.loads("gmptrace 1\na 1 1000 0\nf 1\n")
    assert isinstance(gmp.replay(tr), gmp.ReplayResult)
    assert isinstance(r.replay(tr, {"limit": 0}), gmp.ReplayResult)
    assert list(inspect.signature(gmp.replay).parameters)[:2] == ["trace", "policy"]


def test_close_reports_live_blocks_even_when_the_backend_fails() -> None:
    p = gmp.MemPool("sim", free_fail_rate=1.0, capacity=1 << 30)
    p.alloc(MiB)
    with pytest.warns(gmp.LeakWarning) as caught:
        rep = p.close()
    assert len(rep.live_blocks) == 1 and rep.live_bytes == MiB
    texts = [str(w.message) for w in caught]
    assert any("live block" in t for t in texts) and any("engine reported" in t for t in texts)
    assert p.closed


def test_the_old_sim_methods_warn_and_still_steer_the_simulated_device() -> None:
    # MemPool.sim_* became pool.sim.*: each old name warns once per call,
    # at its caller, and does what the new one does
    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        with pytest.warns(DeprecationWarning, match=r"sim_manual_events\(\) is deprecated; use pool\.sim") as w:
            pool.sim_manual_events(True)
        assert w[0].filename == __file__
        a = pool.alloc(1000, stream=2)
        pool.record_stream(a, 3)
        pool.free(a)
        assert pool.process_events() == 1  # the event on stream 3 waits
        with pytest.warns(DeprecationWarning, match="sim_complete"):
            pool.sim_complete(3)
        assert pool.process_events() == 0
        with pytest.warns(DeprecationWarning, match="sim_place_next"):
            pool.sim_place_next(4 * MiB, 2 * MiB)
        high = pool.alloc(1000)  # its 2 MiB small segment, placed
        with pytest.warns(DeprecationWarning, match="sim_stats"):
            stats = pool.sim_stats()
        assert stats == pool.sim.stats() and stats["placed"] == 1 and stats["live_segments"] == 2  # stream 2's and the placed one
        pool.free(high)
    with gmp.MemPool("sim") as other, pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="size"):
        other.sim_place_next(4 * MiB)
