"""Snapshots in torch's format, history recording, dump_snapshot."""

from __future__ import annotations

import pickle
import sys
import threading

import pytest

import gpumempool as gmp

MiB = 1 << 20


def test_pool_snapshot_has_torch_shape() -> None:
    with gmp.MemPool("sim", name="snap", manual_events=True) as pool:
        a = pool.alloc(1000, stream=3)
        b = pool.alloc(5000, stream=3)
        pool.alloc(12 * MiB, stream=3)
        pool.record_stream(b, 4)
        pool.free(b)
        snap = pool.snapshot()
        assert set(snap) >= {"segments", "device_traces", "allocator_settings", "fragmentation"}
        segs = snap["segments"]
        assert len(segs) == 2 and {s["segment_type"] for s in segs} == {"small", "large"}
        small = next(s for s in segs if s["segment_type"] == "small")
        for key in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                    "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"):
            assert key in small
        assert small["total_size"] == 2 * MiB and small["stream"] == 3
        states = [blk["state"] for blk in small["blocks"]]
        assert states == ["active_allocated", "active_pending_free", "inactive"]
        assert small["blocks"][0] == {"address": a, "size": 1024, "requested_size": 1000,
                                      "state": "active_allocated", "frames": []}
        frag = snap["fragmentation"]
        assert frag["reserved"] == 14 * MiB and frag["allocated"] == 12 * MiB + 1024
        assert pool.segments()[0]["size"] in (2 * MiB, 12 * MiB)


def test_history_with_python_stacks_and_dump(tmp_path) -> None:
    with gmp.MemPool("sim", capacity=8 * MiB) as pool:
        pool.record_history(True, max_entries=1000, stacks=True)

        def allocate_here() -> int:
            return pool.alloc(4096)

        a = allocate_here()
        pool.free(a)
        with pytest.raises(gmp.OutOfMemoryError):
            pool.alloc(100 * MiB)
        snap = pool.snapshot()
        trace = snap["device_traces"][0]
        actions = [e["action"] for e in trace]
        assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed", "segment_free", "oom"]
        alloc = trace[1]
        assert alloc["addr"] == a and alloc["size"] == 4096
        assert alloc["frames"][0]["name"] == "allocate_here"
        assert trace[-1]["device_free"] == 8 * MiB
        path = tmp_path / "snap.pickle"
        gmp.dump_snapshot(str(path), snap)
        assert pickle.loads(path.read_bytes()) == snap


def test_global_snapshot_and_record_history_cover_all_pools() -> None:
    gmp.record_history(True, max_entries=50)
    try:
        with gmp.MemPool("sim", name="one") as p1, gmp.MemPool("sim", name="two") as p2:
            p1.alloc(100)
            p2.alloc(200)
            snap = gmp.snapshot()
            names = {s["gpumempool_pool"] for s in snap["segments"]}
            assert {"one", "two"} <= names
            assert {"one", "two"} <= set(snap["allocator_settings"]["pools"])
            times = [e["time_us"] for e in snap["device_traces"][0]]
            assert times == sorted(times) and len(times) >= 4
    finally:
        gmp.record_history(False)
    with gmp.MemPool("sim") as p3:
        p3.alloc(100)
        assert p3.snapshot()["device_traces"] == [[]]
    with pytest.raises(ValueError):
        gmp.record_history(True, max_entries=0)


def test_torch_memory_viz_renders_our_snapshot(tmp_path) -> None:
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    with gmp.MemPool("sim") as pool:
        pool.record_history(True, stacks=True)
        ptrs = [pool.alloc(n) for n in (100, 5000, 3 * MiB)]
        pool.free(ptrs[1])
        snap = pool.snapshot()
        for p in (ptrs[0], ptrs[2]):
            pool.free(p)
    # segsum re-adds every segment from its blocks and raises on a mismatch.
    summary = memory_viz.segsum(snap)
    assert f"segments: {len(snap['segments'])}" in summary
    assert "total_allocated: " in summary and "total_reserved: " in summary
    # The flamegraph input, without the flamegraph.pl download torch does.
    lines = memory_viz.segments(snap, format_flamegraph=lambda text: text)
    assert lines.count("\n") >= 3 and "100" in lines.replace(",", "")
    trace = memory_viz.trace(snap)
    assert "cudaMalloc(" in trace and "del " in trace
    html = memory_viz.trace_plot(snap)
    assert "<html" in html.lower() or "script" in html
    assert "<html" in memory_viz.segment_plot(snap).lower()


def test_python_stacks_from_many_threads() -> None:
    """record_history(stacks=True) keeps one dict of stacks per pool: threads
    allocating at once must not corrupt it (KeyError, RuntimeError) or leak
    the blocks whose bookkeeping failed."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []
    try:
        with gmp.MemPool("sim", capacity=64 * MiB) as pool:
            pool.record_history(True, max_entries=4, stacks=True)

            def work() -> None:
                try:
                    for _ in range(150):
                        ptrs = [pool.alloc(512) for _ in range(8)]
                        for p in ptrs:
                            pool.free(p)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            threads = [threading.Thread(target=work) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert errors == []
            assert pool.stats()["allocation.all.current"] == 0
            assert len(pool._stacks.blocks if pool._stacks else {}) <= 4
    finally:
        sys.setswitchinterval(old)


def test_stack_bookkeeping_never_leaks_the_block(monkeypatch) -> None:
    from gpumempool import _snapshot

    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        pool.record_history(True, stacks=True)

        def history_off_meanwhile(skip: int = 2, limit: int = 32) -> list:
            pool.record_history(False)  # another thread turns history off mid-alloc
            return []

        monkeypatch.setattr(_snapshot, "capture_frames", history_off_meanwhile)
        pool.free(pool.alloc(1000))  # used to fail an assert

        pool.record_history(True, stacks=True)

        def broken(skip: int = 2, limit: int = 32) -> list:
            raise KeyboardInterrupt

        monkeypatch.setattr(_snapshot, "capture_frames", broken)
        with pytest.raises(KeyboardInterrupt):
            pool.alloc(1000)
        assert pool.stats()["allocation.all.current"] == 0


def test_global_snapshot_skips_a_pool_closed_meanwhile(monkeypatch) -> None:
    from gpumempool import _lifecycle

    with gmp.MemPool("sim", name="open") as alive:
        alive.alloc(100)
        gone = gmp.MemPool("sim", name="gone")
        gone.close()
        monkeypatch.setattr(_lifecycle, "open_pools", lambda: [gone, alive])  # closed between listing and use
        assert {s["gpumempool_pool"] for s in gmp.snapshot()["segments"]} == {"open"}
        gmp.record_history(True, max_entries=10)
        gmp.record_history(False)


def test_stacks_belong_to_the_allocation_that_made_them(tmp_path) -> None:
    # an address is reused: a freed block's stack must neither show on the
    # next block there nor name the next allocation in the history
    with gmp.MemPool("sim") as p:
        p.record_history(True, stacks=True)

        def first() -> int:
            return p.alloc(1024)

        def second() -> int:
            return p.alloc(1024)

        x = first()
        p.free(x)
        y = second()
        assert x == y
        snap = p.snapshot()
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        names = [[f["name"] for f in e["frames"]] for e in allocs]
        assert "first" in names[0] and "second" not in names[0]
        assert "second" in names[1]
        live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        assert any(f["name"] == "second" for f in live[0]["frames"])
        p.free(y)
        assert p._stacks is not None and not p._stacks.blocks, "a freed block keeps no stack"
        # recording on again keeps what was recorded
        before = len(p.snapshot()["device_traces"][0])
        p.record_history(True, stacks=True)
        assert len(p.snapshot()["device_traces"][0]) == before


def test_a_refused_history_setting_changes_nothing() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        gmp.record_history(True, max_entries=1 << 40)
    with gmp.MemPool("sim") as p:  # pools made afterwards still work
        p.free(p.alloc(100))


def test_dump_snapshot_replaces_the_file_whole(tmp_path) -> None:
    path = tmp_path / "snap.pickle"
    gmp.dump_snapshot(str(path), {"segments": [], "device_traces": [[]]})
    good = path.read_bytes()
    with pytest.raises(Exception):
        gmp.dump_snapshot(str(path), {"segments": [{"bad": lambda: 0}], "device_traces": [[]]})
    assert path.read_bytes() == good, "a failed dump leaves the previous file"
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pickle"], "no temporary file left"


def test_dump_snapshot_errors_name_the_users_path(tmp_path) -> None:
    """The error named the temporary file ('/nonexistent/.gmp-snapshot-...'),
    and a directory made a temporary file in its parent ('/')."""
    import os

    missing = tmp_path / "nonexistent" / "x.pickle"
    with pytest.raises(FileNotFoundError) as ei:
        gmp.dump_snapshot(str(missing))
    assert ei.value.filename == str(missing) and ".gmp-snapshot" not in str(ei.value)
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory; dump_snapshot needs a file name") as di:
        gmp.dump_snapshot(str(tmp_path / "d"))
    assert di.value.filename == str(tmp_path / "d")
    assert sorted(os.listdir(tmp_path)) == ["d"] and os.listdir(tmp_path / "d") == []
