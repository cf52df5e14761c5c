"""Traces (format, importers, recorder, restricted unpickling) and replay."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import gpumempool as gmp
from gpumempool.replay import parse_policy, parse_size, replay
from gpumempool.trace import (
    VIRTUAL_STREAM_BASE,
    Alloc,
    EmptyCache,
    Free,
    RecordStream,
    Sync,
    Trace,
    TraceFormatError,
    TraceRecorder,
    Trim,
    UnsafePickleError,
    from_history,
    from_torch_snapshot,
    is_trace_file,
    load_pickle,
)

MiB = 1 << 20
V1 = VIRTUAL_STREAM_BASE + 1
SHIPPED = Path(__file__).resolve().parent.parent / "benchmarks" / "traces" / "demo-synthetic.trace.gz"


# -- the file format --------------------------------------------------------


def sample_trace() -> Trace:
    return Trace(
        events=[
            Alloc(1, 1000, 0, 0),
            Alloc(2, 3 * MiB, 0x7F00DEAD0000, 1),
            RecordStream(2, 0x2000),
            Free(2),
            Sync(0x2000),
            Sync(None),
            EmptyCache(),
            Trim(4 * MiB),
            Trim(0, 1),
            Free(1),
        ],
        meta={"source": "hand", "recorded_by": "torch", "devices": 2},
        reserved=[(0, 0, 0), (0, 0, 2 * MiB), (1, 1, 20 * MiB), (7, 1, 0)],
    )


@pytest.mark.parametrize("name", ["t.trace", "t.trace.gz"])
def test_format_round_trip(tmp_path: Path, name: str) -> None:
    tr = sample_trace()
    path = tmp_path / name
    tr.save(path)
    raw = path.read_bytes()
    if name.endswith(".gz"):
        assert raw[:2] == b"\x1f\x8b"
        text = gzip.decompress(raw).decode()
    else:
        text = raw.decode()
    assert text.startswith("gmptrace 1\n")
    assert "a 2 3145728 0x7f00dead0000 1\n" in text and "r 2 0x2000\n" in text and "\ns\n" in text
    assert "\nt 0 1\n" in text and "\nR 1 20971520 1\n" in text
    back = Trace.load(path)
    assert back.events == tr.events
    assert back.meta == tr.meta
    assert back.reserved == tr.reserved
    assert is_trace_file(path)
    assert Trace.loads(tr.dumps()).events == tr.events
    assert back.recorded_peak_reserved() == 2 * MiB + 20 * MiB
    assert back.peak_requested() == 1000 + 3 * MiB
    assert back.counts() == {"alloc": 2, "free": 2, "record_stream": 1, "sync": 2, "empty_cache": 1, "trim": 2}
    back.validate()


def test_segment_records_round_trip(tmp_path: Path) -> None:
    tr = sample_trace()
    tr.segments = [(0, 0, 0x7FC437E00000, 2 * MiB), (1, 1, 0x7FC41D400000, 20 * MiB), (1, 0, 0x10000, 2 * MiB)]
    text = tr.dumps()
    # Version 2 only when there are S records; each comes after the R records of its index.
    assert text.startswith("gmptrace 2\n")
    assert "\nR 0 2097152\nS 0 0x7fc437e00000 2097152\na 1 1000 0\n" in text
    assert "\nR 1 20971520 1\nS 1 0x7fc41d400000 20971520 1\nS 1 0x10000 2097152\na 2 " in text
    tr.save(tmp_path / "t.trace.gz")
    back = Trace.load(tmp_path / "t.trace.gz")
    assert back.segments == tr.segments and back.events == tr.events and back.reserved == tr.reserved
    assert sample_trace().dumps().startswith("gmptrace 1\n")  # readable by version-1 readers


def test_gzip_output_is_reproducible(tmp_path: Path) -> None:
    sample_trace().save(tmp_path / "a.trace.gz")
    sample_trace().save(tmp_path / "b.trace.gz")
    assert (tmp_path / "a.trace.gz").read_bytes() == (tmp_path / "b.trace.gz").read_bytes()


@pytest.mark.parametrize(
    "text, message",
    [
        ("hello\n", "not a gmptrace file"),
        ("gmptrace 3\na 1 10 0\n", "version 3 is not supported"),
        ("gmptrace 1\nS 0 0x7f0000000000 2097152\n", "S records need gmptrace 2"),
        ("gmptrace 2\nS 0 0x7f0000000000 0\n", "size 0 out of range"),
        ("gmptrace 1\na 1 -5 0\n", ":2:"),
        ("gmptrace 1\na 0 5 0\n", "block ids are positive"),
        ("gmptrace 1\na 1 1 0\nx 3\n", ":3: unknown record 'x'"),
        # the block-id rule is checked as each line is read, not after the file
        ("gmptrace 1\nf 1\nx 3\n", ":2: event 0: free of block 1, which is not allocated"),
        ("gmptrace 1\na 1 9 0\na 1 9 0\nx 3\n", ":3: event 1: block 1 allocated twice"),
        ("gmptrace 1\nr 4 0\n", ":2: event 0: record_stream of block 4"),
        ("gmptrace 1\na 1 10 0 0 0\n", "unknown record 'a' with 5 field(s)"),
        ("gmptrace 1\n@ [1, 2]\n", "metadata must be a JSON object"),
    ],
)
def test_format_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Trace.loads(text)


def test_validate_catches_bad_sequences() -> None:
    with pytest.raises(TraceFormatError, match="not allocated"):
        Trace([Alloc(1, 10), Free(1), Free(1)]).validate()
    with pytest.raises(TraceFormatError, match="event 2: block 1 allocated twice"):
        Trace([Alloc(1, 10), Alloc(2, 10), Alloc(1, 10)]).validate()
    # An id names one block at a time: after its free it may name a new one
    # (checking that ids never repeat would take memory per event of a file).
    Trace([Alloc(1, 10), Free(1), Alloc(1, 10)]).validate()
    with pytest.raises(TraceFormatError, match="record_stream"):
        Trace([RecordStream(3, 7)]).validate()


def test_load_refuses_too_many_events() -> None:
    with pytest.raises(TraceFormatError, match="more than 2 events"):
        Trace.loads("gmptrace 1\na 1 1 0\na 2 1 0\na 3 1 0\n", max_events=2)
    # Reference records are bounded too: a file of nothing but S (or R)
    # lines, a gzip bomb say, must not grow its lists without end.
    with pytest.raises(TraceFormatError, match="more than 2 S records"):
        Trace.loads("gmptrace 2\n" + "S 0 0x0 512\n" * 3, max_events=2)
    with pytest.raises(TraceFormatError, match="more than 2 R records"):
        Trace.loads("gmptrace 1\n" + "R 0 512\n" * 3, max_events=2)
    assert len(Trace.loads("gmptrace 2\n" + "S 0 0x0 512\nR 0 512\n" * 2, max_events=2).segments) == 2


# -- from_history and the recorder ------------------------------------------


def test_from_history_of_a_known_sequence() -> None:
    with gmp.MemPool("sim", name="hist", capacity=1 << 30, manual_events=True) as pool:
        pool.record_history(True)
        a = pool.alloc(1000)
        b = pool.alloc(5000)
        pool.record_stream(b, 7)
        pool.free(b)  # waits for stream 7
        pool.alloc(3000)
        pool.sim.complete(7)
        pool.alloc(100)  # processes events first: b's free completes here
        pool.free(a)
        tr = from_history(pool)
    assert tr.events == [  # the caller's sizes, as torch records them
        Alloc(1, 1000, 0, 0),
        Alloc(2, 5000, 0, 0),
        RecordStream(2, V1),
        Free(2),
        Alloc(3, 3000, 0, 0),
        Sync(V1),
        Alloc(4, 100, 0, 0),
        Free(1),
    ]
    assert tr.meta["source"] == "gpumempool" and tr.meta["pool"] == "hist"
    assert tr.meta["deferred_frees"] == 1 and tr.meta["record_stream_entries"] == 1
    assert tr.reserved == [(0, 0, 0), (0, 0, 2 * MiB)]
    assert tr.recorded_peak_reserved() == 2 * MiB
    tr.validate()


def test_caller_sized_allocations_replay_as_recorded() -> None:
    # gmp.mempool's pools serve torch's segments through alloc_segment: a
    # 2 MiB request takes 2 MiB from the backend, not a 20 MiB segment.
    with gmp.MemPool("sim", name="segments", capacity=1 << 30) as pool:
        pool.record_history(True)
        a = pool.alloc_segment(2 * MiB)
        pool.alloc_segment(2 * MiB)
        pool.alloc(1000)
        pool.free(a)
        recorded = pool.stats()["reserved_bytes.all.peak"]
        tr = from_history(pool)
    assert recorded == 2 * MiB + 2 * MiB + 2 * MiB  # the small block's segment is 2 MiB too
    assert tr.events == [Alloc(1, 2 * MiB, 0, 0, True), Alloc(2, 2 * MiB, 0, 0, True), Alloc(3, 1000), Free(1)]
    text = tr.dumps()
    assert [ln for ln in text.splitlines() if ln[:1] in "Aa"] == ["A 1 2097152 0", "A 2 2097152 0", "a 3 1000 0"]
    assert Trace.loads(text).events == tr.events
    assert replay(tr).peak_reserved == recorded == tr.recorded_peak_reserved()
    # Replayed as plain allocations, the 2 MiB blocks share a 20 MiB segment.
    plain = Trace(events=[Alloc(e.id, e.size) if type(e) is Alloc else e for e in tr.events])
    assert replay(plain).peak_reserved == 20 * MiB + 2 * MiB


def test_from_history_needs_history() -> None:
    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        pool.alloc(100)
        assert from_history(pool).events == [Alloc(1, 100, 0, 0)]  # live block at the start, from the segments
    with pytest.raises(TraceFormatError, match="device_traces"):
        from_history({"segments": []})


def test_trace_recorder_records_calls_and_restores_the_pool() -> None:
    with gmp.MemPool("sim", name="rec", capacity=1 << 30, manual_events=True) as pool:
        with TraceRecorder(pool) as rec:
            x = pool.alloc(12 * MiB)
            pool.free(x)
            assert pool.empty_cache() == 12 * MiB
            y = pool.alloc(1000, stream=5)
            pool.record_stream(y, 6)
            pool.free(y)
            pool.trim(0)  # y still waits for stream 6: nothing to release
            pool.sim.complete(6)
            pool.alloc(200, stream=5)
        assert "empty_cache" not in vars(pool) and "trim" not in vars(pool)
        assert pool.snapshot()["device_traces"] == [[]]  # history is off again
    assert rec.trace is not None
    assert rec.trace.events == [
        Alloc(1, 12 * MiB, 0, 0),
        Free(1),
        EmptyCache(),
        Alloc(2, 1000, 5, 0),
        RecordStream(2, V1),
        Free(2),
        Trim(0, None),
        Sync(V1),
        Alloc(3, 200, 5, 0),
    ]
    assert rec.trace.meta["recorder_calls"] == 2
    res = replay(rec.trace)
    assert res.device_allocs == 2 and res.device_frees == 1  # the 12 MiB segment went back at empty_cache


def test_trace_recorder_syncs_before_an_empty_cache_that_completes_frees() -> None:
    with gmp.MemPool("sim", capacity=1 << 30, manual_events=True) as pool:
        with TraceRecorder(pool) as rec:
            x = pool.alloc(12 * MiB)
            pool.record_stream(x, 9)
            pool.free(x)
            pool.sim.complete(9)
            pool.empty_cache()  # completes x's free, then releases its segment
    assert rec.trace is not None
    assert rec.trace.events == [Alloc(1, 12 * MiB, 0, 0), RecordStream(1, V1), Free(1), Sync(V1), EmptyCache()]
    res = replay(rec.trace)
    assert res.device_frees == 1


# -- torch snapshots ----------------------------------------------------------

A = 0x7F0000000000  # a small segment made in the trace
P = 0x7F0010000000  # a large segment from before the trace
L = 0x7F0020000000  # a large segment made and emptied in the trace


def torch_snapshot() -> dict:
    """A snapshot in the format torch.cuda.memory._snapshot() returns with
    history on (CUDACachingAllocator's TraceEntry: alloc sizes are requested
    sizes; free_completed follows free_requested at once unless the block
    was used on other streams)."""

    def e(action: str, addr: int, size: int, t: int, **kw) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": [], **kw}

    trace = [
        e("segment_alloc", A, 2 * MiB, 10),
        e("alloc", A, 100, 11),
        e("alloc", A + 512, 1000, 12),
        e("free_requested", A + 512, 1000, 13),  # used on another stream: completes later
        e("alloc", A + 1536, 600, 14),
        e("free_requested", P, 4 * MiB, 15),  # allocated before the trace started
        e("free_completed", P, 4 * MiB, 16),
        e("free_completed", A + 512, 1000, 17),
        e("alloc", A + 512, 900, 18),
        e("segment_alloc", L, 20 * MiB, 19),
        e("alloc", L, 12 * MiB, 20),
        e("free_requested", L, 12 * MiB, 21),
        e("free_completed", L, 12 * MiB, 22),
        e("segment_free", L, 20 * MiB, 23),  # torch.cuda.empty_cache()
        e("free_requested", A, 100, 24),
        e("free_completed", A, 100, 25),
        e("oom", 1 << 30, 1 << 40, 26, device_free=1 << 30),
        e("snapshot", 0, 0, 27),
    ]

    def seg(addr: int, size: int, blocks: list) -> dict:
        return {"device": 0, "address": addr, "total_size": size, "allocated_size": 0, "active_size": 0,
                "requested_size": 0, "stream": 0, "segment_type": "large" if size > 2 * MiB else "small",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}

    def blk(addr: int, size: int, req: int, state: str) -> dict:
        return {"address": addr, "size": size, "requested_size": req, "state": state, "frames": []}

    return {
        "segments": [
            seg(A, 2 * MiB, [blk(A, 512, 0, "inactive"), blk(A + 512, 1024, 900, "active_allocated"),
                             blk(A + 1536, 1024, 600, "active_allocated"), blk(A + 2560, 2 * MiB - 2560, 0, "inactive")]),
            seg(P, 20 * MiB, [blk(P, 4 * MiB, 0, "inactive"), blk(P + 4 * MiB, MiB, MiB, "active_allocated"),
                              blk(P + 5 * MiB, 15 * MiB, 0, "inactive")]),
        ],
        "device_traces": [trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1, "expandable_segments": False},
    }


EXPECTED_TORCH_EVENTS = [
    Alloc(1, 4 * MiB, 0, 0),  # freed in the trace, allocated before it
    Alloc(2, MiB, 0, 0),  # live at the end, never in the trace
    Alloc(3, 100, 0, 0),
    Alloc(4, 1000, 0, 0),
    RecordStream(4, V1),
    Free(4),
    Alloc(5, 600, 0, 0),
    Free(1),
    Sync(V1),
    Alloc(6, 900, 0, 0),
    Alloc(7, 12 * MiB, 0, 0),
    Free(7),
    EmptyCache(),
    Free(3),
    Alloc(8, 1 << 40, 0, 0),  # the request torch could not serve (its oom entry), given back at once
    Free(8),
]


def check_torch_trace(tr: Trace) -> None:
    assert tr.events == EXPECTED_TORCH_EVENTS
    assert tr.source == "torch" and tr.recorded_by == "torch"
    # Reserved at the start = 22 MiB of segments at the end - (2 + 20 - 20) MiB made in the trace.
    # The empty_cache() release happened while serving the EmptyCache event (12).
    assert tr.reserved == [(0, 0, 20 * MiB), (2, 0, 22 * MiB), (10, 0, 42 * MiB), (12, 0, 22 * MiB)]
    assert tr.recorded_peak_reserved() == 42 * MiB
    assert tr.meta["recorded_ooms"] == 1 and tr.meta["inferred_empty_cache"] == 1
    assert tr.meta["preexisting_blocks"] == 2 and tr.meta["ignored_actions"] == {"snapshot": 1}
    tr.validate()


def test_torch_importer_on_a_hand_built_snapshot() -> None:
    check_torch_trace(from_torch_snapshot(torch_snapshot()))
    assert EmptyCache() not in from_torch_snapshot(torch_snapshot(), infer_empty_cache=False).events


def test_torch_allocator_settings_become_the_replay_policy() -> None:
    assert "recorded_policy" not in from_torch_snapshot(torch_snapshot()).meta  # torch's defaults
    snap = torch_snapshot()
    div = {str(i): 0 for i in range(1, 17)}
    div["1"] = 4
    snap["allocator_settings"].update(max_split_size=64 * MiB, expandable_segments=True, roundup_power2_divisions=div,
                                      garbage_collection_threshold=0.6)
    tr = from_torch_snapshot(snap)
    assert tr.meta["recorded_policy"] == {"max_split_size": 64 * MiB, "expandable": True,
                                          "roundup_power2_divisions": [4] + [0] * 15,
                                          "garbage_collection_threshold": 0.6}
    with pytest.warns(UserWarning, match=r"0.6 \(the recording's setting\) has no effect without limit"):
        res = replay(tr)
    assert res.policy == tr.meta["recorded_policy"]
    # expandable segments, as torch had: mapped pages, which torch does not
    # count as segments
    assert res.device_allocs > 0 and res.peak_segments == 0
    with pytest.warns(UserWarning, match="no effect without limit"):
        assert replay(tr, {"expandable": False}).policy["expandable"] is False  # an explicit policy wins
    assert replay(tr, recorded_policy=False).policy == {}
    # The policy survives saving the trace.
    assert Trace.loads(tr.dumps()).meta["recorded_policy"] == tr.meta["recorded_policy"]
    # One count for every size comes back as one number.
    div = {str(i): 8 for i in range(1, 17)}
    snap["allocator_settings"].update(roundup_power2_divisions=div, expandable_segments=False, max_split_size=-1,
                                      garbage_collection_threshold=0.0)
    assert from_torch_snapshot(snap).meta["recorded_policy"] == {"roundup_power2_divisions": 8}


def test_history_trace_records_the_pool_policy() -> None:
    with gmp.MemPool("sim", capacity=1 << 30, roundup_power2_divisions=4, max_split_size=32 * MiB) as pool:
        pool.record_history(True)
        pool.free(pool.alloc(1100 * MiB // 4))
        tr = from_history(pool)
    assert tr.meta["recorded_policy"] == {"backend": "sim", "max_split_size": 32 * MiB, "roundup_power2_divisions": 4}
    assert replay(tr).policy == {"max_split_size": 32 * MiB, "roundup_power2_divisions": 4}


def test_torch_pickle_through_the_restricted_loader(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(torch_snapshot(), protocol=pickle.HIGHEST_PROTOCOL))
    assert load_pickle(path) == torch_snapshot()
    tr = from_torch_snapshot(path)
    check_torch_trace(tr)
    assert tr.meta["file"] == "snapshot.pickle"
    gz = tmp_path / "snapshot.pickle.gz"
    gz.write_bytes(gzip.compress(pickle.dumps(torch_snapshot(), protocol=2)))
    assert from_torch_snapshot(gz).events == EXPECTED_TORCH_EVENTS
    # Replay against torch's own reserved bytes.
    res = replay(tr)
    assert res.recorded_by == "torch" and res.torch_peak_reserved == 42 * MiB
    assert res.ratio_vs_torch == pytest.approx(res.peak_reserved / (42 * MiB))
    # The failed request fails again: the device is what torch had then (1 GiB free + 22 MiB reserved).
    assert res.allocations == 8 and res.ooms == 1 and res.skipped == 1 and res.comparable
    assert res.capacity == (1 << 30) + 22 * MiB and res.capacity_from == "recording"


def test_multi_device_torch_snapshot() -> None:
    def e(action: str, addr: int, size: int, t: int) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t}

    snap = {
        "segments": [],
        "device_traces": [
            [e("segment_alloc", A, 2 * MiB, 1), e("alloc", A, 512, 2), e("free_requested", A, 512, 5),
             e("free_completed", A, 512, 5)],
            [e("segment_alloc", A, 20 * MiB, 3), e("alloc", A, 8 * MiB, 4)],
        ],
    }
    tr = from_torch_snapshot(snap)
    assert tr.events == [Alloc(1, 512, 0, 0), Alloc(2, 8 * MiB, 0, 1), Free(1)]
    assert tr.meta["devices"] == 2
    assert tr.recorded_peak_reserved() == 22 * MiB
    assert tr.segments == [(0, 0, A, 2 * MiB), (1, 1, A, 20 * MiB)]  # where torch's device put them
    res = replay(tr)
    assert res.peak_reserved == 22 * MiB  # a 2 MiB small segment on device 0, 20 MiB on device 1
    assert (res.placed_segments, res.recorded_segments) == (2, 2)


def test_our_own_snapshot_pickle_imports_like_history(tmp_path: Path) -> None:
    with gmp.MemPool("sim", capacity=1 << 30, manual_events=True) as pool:
        pool.record_history(True)
        p = pool.alloc(5000)
        pool.record_stream(p, 3)
        pool.free(p)
        gmp.dump_snapshot(str(tmp_path / "ours.pickle"), pool.snapshot())
        direct = from_history(pool)
    tr = from_torch_snapshot(tmp_path / "ours.pickle")
    assert tr.source == "gpumempool"
    assert tr.events == direct.events == [Alloc(1, 5000, 0, 0), RecordStream(1, V1), Free(1)]


# -- malicious pickles ---------------------------------------------------------


class _SystemCall:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _Eval:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        import builtins

        return (builtins.eval, (self.code,))


def _payloads(side: Path) -> list[bytes]:
    write = f"open({str(side)!r}, 'w').write('pwned')"
    return [
        pickle.dumps({"segments": [], "device_traces": [[_SystemCall(f"touch {side}")]]}),
        pickle.dumps({"segments": [], "device_traces": [[_Eval(write)]]}, protocol=2),
        # Hand-written protocol-0 opcodes: GLOBAL builtins.exec, then REDUCE.
        b"cbuiltins\nexec\n(V" + write.encode() + b"\ntR.",
    ]


def test_malicious_pickles_are_refused_and_nothing_runs(tmp_path: Path) -> None:
    # The payloads are live: plain pickle runs them.
    control = tmp_path / "control"
    pickle.loads(_payloads(control)[1])
    assert control.read_text() == "pwned"

    side = tmp_path / "side-effect"
    for i, data in enumerate(_payloads(side)):
        path = tmp_path / f"evil{i}.pickle"
        path.write_bytes(data)
        with pytest.raises(UnsafePickleError, match="refused to load (posix|os|builtins|__builtin__)\\.(system|eval|exec)"):
            from_torch_snapshot(path)
        with pytest.raises(UnsafePickleError, match="plain data"):
            load_pickle(data)
        assert not side.exists(), f"payload {i} ran"


def test_pickle_size_limits(tmp_path: Path) -> None:
    data = pickle.dumps(torch_snapshot())
    with pytest.raises(UnsafePickleError, match="over the limit"):
        load_pickle(data, max_bytes=100)
    path = tmp_path / "big.pickle"
    path.write_bytes(data)
    with pytest.raises(UnsafePickleError, match="over the limit"):
        from_torch_snapshot(path, max_bytes=100)
    bomb = tmp_path / "bomb.pickle.gz"
    bomb.write_bytes(gzip.compress(pickle.dumps("x" * 100_000)))
    with pytest.raises(UnsafePickleError, match="decompresses to more than"):
        load_pickle(bomb, max_bytes=50_000)
    with pytest.raises(UnsafePickleError, match="not a readable pickle"):
        load_pickle(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="device_traces"):
        from_torch_snapshot({"segments": []})
    with pytest.raises(TraceFormatError, match=r"<dict>: device 0 event 0 \(alloc\): addr must be an int, got str"):
        from_torch_snapshot({"device_traces": [[{"action": "alloc", "addr": "x", "size": 1}]]})


# -- replay -------------------------------------------------------------------

HAND = """gmptrace 1
# 1 KiB and 5 KiB share a 2 MiB small segment; 12 MiB gets its own segment.
a 1 1000 0
a 2 5000 0
a 3 12582912 0
f 2
f 3
a 4 12582912 0
f 4
e
a 5 12582912 0
r 5 0x2000
f 5
a 6 12582912 0
f 6
s 0x2000
a 7 12582912 0
"""


def test_replay_of_a_hand_written_trace_gives_exact_peaks() -> None:
    tr = Trace.loads(HAND)
    res = replay(tr)
    # Block 5 waits for stream 0x2000, so block 6 needs a second 12 MiB
    # segment; after the sync block 7 reuses one.
    assert res.peak_allocated == 1024 + 5120 + 12 * MiB
    assert res.peak_reserved == 2 * MiB + 24 * MiB
    assert res.peak_requested == 1000 + 5000 + 12 * MiB
    assert res.fragmentation == pytest.approx((26 * MiB) / (12 * MiB + 6144))
    assert (res.device_allocs, res.device_frees, res.backend_calls) == (4, 1, 5)
    assert (res.allocations, res.frees, res.ooms, res.skipped) == (7, 5, 0, 0)
    assert res.peak_segments == 3 and res.recorded_peak_reserved is None
    # Without the record_stream the freed block is reused at once.
    res2 = replay(Trace.loads(HAND.replace("r 5 0x2000\n", "")))
    assert res2.peak_reserved == 14 * MiB and res2.device_allocs == 3
    # A sync before the reuse has the same effect.
    res3 = replay(Trace.loads(HAND.replace("a 6 12582912 0\n", "s\na 6 12582912 0\n")))
    assert res3.peak_reserved == 14 * MiB


def test_replay_honours_limit_and_counts_ooms() -> None:
    res = replay(Trace.loads(HAND), {"limit": 13 * MiB})
    # 2 MiB (small, never empty) + 12 MiB > 13 MiB: every 12 MiB allocation fails.
    assert res.ooms == 5 and res.skipped == 5  # f 3, f 4, r 5, f 5, f 6 name blocks never served
    assert res.peak_reserved == 2 * MiB
    assert replay(Trace.loads(HAND), {"capacity": 8 * MiB}).ooms == 5


def test_replay_policies_change_the_outcome() -> None:
    tr = Trace.load(SHIPPED)
    base = replay(tr)
    exp = replay(tr, {"expandable": True})
    assert exp.peak_segments < base.peak_segments / 10 and exp.expansions > 0
    assert exp.peak_reserved < base.peak_reserved
    rel = replay(tr, {"release_threshold": 1})
    assert rel.device_frees > 0 == base.device_frees
    lim = replay(tr, {"limit": 1 << 30})
    assert lim.ooms > 0 and lim.peak_reserved <= 1 << 30
    assert base.ooms == 0
    with pytest.raises(gmp.InvalidArgumentError, match="unknown policy key"):
        replay(tr, {"bogus": 1})
    with pytest.raises(gmp.InvalidArgumentError, match="power of two"):
        replay(tr, {"roundup_power2_divisions": 3})
    with pytest.raises(TypeError):
        replay(tr, {"limit": "1GiB"})


def test_replay_with_roundup_power2_divisions() -> None:
    # 1100 MiB and 1200 MiB round to one 1280 MiB block with 4 divisions
    # (torch's example), so the second allocation reuses the first block;
    # without rounding 1200 MiB does not fit the freed 1100 MiB.
    text = "gmptrace 1\na 1 1153433600 0\nf 1\na 2 1258291200 0\nf 2\n"
    base = replay(Trace.loads(text))
    assert base.peak_allocated == 1200 * MiB and base.device_allocs == 2
    rnd = replay(Trace.loads(text), {"roundup_power2_divisions": 4})
    assert rnd.peak_allocated == 1280 * MiB and rnd.device_allocs == 1
    assert parse_policy(["roundup_power2_divisions=4"]) == {"roundup_power2_divisions": 4}
    assert parse_policy(["max_non_split_rounding_size=64MiB"]) == {"max_non_split_rounding_size": 64 * MiB}


def test_replay_with_garbage_collection_threshold() -> None:
    # Segments of 20, 20, 30 MiB cached, then a 40 MiB miss under a 100 MiB limit.
    text = ("gmptrace 1\na 1 20971520 0\na 2 20971520 0\nf 1\na 3 31457280 0\nf 2\nf 3\n"
            "a 4 41943040 0\nf 4\n")
    plain = replay(Trace.loads(text), {"limit": 100 * MiB})
    assert plain.stats["num_alloc_retries"] == 1 and plain.stats["num_gc_releases"] == 0  # hit the limit
    gc = replay(Trace.loads(text), parse_policy(["limit=100MiB,garbage_collection_threshold=0.5"]))
    assert gc.stats["num_gc_releases"] == 1 and gc.stats["num_alloc_retries"] == 0
    assert gc.peak_reserved == 90 * MiB and gc.policy["garbage_collection_threshold"] == 0.5
    with pytest.raises(TypeError):
        replay(Trace.loads(text), {"garbage_collection_threshold": "high"})


# The first decision in which a replay of torch's gpt2-train trace left torch's
# (entry 1246 of its history): two free small blocks of equal size in two
# 2 MiB segments; best fit takes the one at the lower address. CUDA had put
# the second segment (B) below the first (A); the simulated device, placing
# segments by first fit, put it above. The replay then split A's block,
# which could no longer merge into a block big enough for a later request,
# and reserved a segment more than torch (1,138 vs 1,136 MiB on that trace).
TIE_TRACE = """gmptrace 2
R 0 0
R 0 2097152
S 0 {a:#x} 2097152
a 1 524288 0
a 2 524288 0
a 3 1048576 0
R 3 4194304
S 3 {b:#x} 2097152
a 4 524288 0
a 5 1048576 0
a 6 524288 0
f 1
f 4
a 7 262144 0
f 2
a 8 1048576 0
"""


def test_replay_keeps_the_recorded_segment_order() -> None:
    torch_order = Trace.loads(TIE_TRACE.format(a=0x7FC437E00000, b=0x7FC41D400000))  # H100 addresses, B below A
    res = replay(torch_order)
    assert (res.placed_segments, res.recorded_segments) == (2, 2)
    assert res.peak_reserved == torch_order.recorded_peak_reserved() == 4 * MiB, "a 7 reuses B's block, as torch did"
    # Without the recorded order, the simulated device's own (B above A) decides.
    blind = replay(torch_order, recorded_addresses=False)
    assert blind.placed_segments == 0 and blind.peak_reserved == 6 * MiB
    # The replay follows the recorded order, whichever it is.
    ascending = Trace.loads(TIE_TRACE.format(a=0x7FC41D400000, b=0x7FC437E00000))
    assert replay(ascending).peak_reserved == 6 * MiB
    # An expandable replay grows its own segment: nothing to place.
    assert replay(torch_order, {"expandable": True}).placed_segments == 0


def test_segment_records_far_apart_replay_without_placement() -> None:
    # Three disjoint recorded runs whose packed offsets reach 2**64 (each run
    # nearly 2**63 bytes): an offset no window holds is not placed, instead of
    # failing the replay with an argument error about the offset.
    big = (1 << 63) - 1
    text = (f"gmptrace 2\nS 0 0x0 {big}\nS 0 {1 << 63:#x} {(1 << 63) - 1024}\nS 0 {(1 << 64) - 512:#x} 2097152\n"
            "a 1 1000 0\nf 1\n")
    res = replay(Trace.loads(text))
    assert res.placed_segments == 0 and res.recorded_segments == 3
    assert res.peak_reserved == 2 * MiB


def test_placement_needs_the_same_size_and_a_free_range() -> None:
    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        pool.sim.place_next(4 * MiB, 2 * MiB)
        big = pool.alloc(3 * MiB)  # a 20 MiB segment: not the size asked for, first fit
        high = pool.alloc(1000)  # the 2 MiB small segment, in the placement window
        pool.sim.place_next(0, 2 * MiB)
        pool.sim.place_next(None)  # withdrawn
        with pytest.raises(ValueError, match="size"):
            pool.sim.place_next(4 * MiB)  # no size: an error, not a silent withdrawal
        low = pool.alloc(MiB + 512)  # 20 MiB: best fit in big's segment, no new segment
        assert pool.sim.stats()["placed"] == 1
        assert big < high and high - big > 1 << 38  # the window is the upper half of the range
        assert low == big + 3 * MiB
        with pytest.raises(gmp.InvalidArgumentError, match="alignment"):
            pool.sim.place_next(100, 2 * MiB)
        for p in (big, high, low):
            pool.free(p)


def test_shipped_torch_traces_replay_like_torch() -> None:
    # Recorded with torch 2.11's native allocator on an H100, with the
    # addresses of its segments: the default policy reproduces torch's peak.
    for name in ("gpt2-train", "cnn-train", "gpt2-infer"):
        tr = Trace.load(SHIPPED.parent / f"{name}.trace.gz")
        assert tr.recorded_by == "torch" and tr.segments
        res = replay(tr)
        assert res.reserved_vs_recorded == 1.0, name
        assert res.placed_segments == res.recorded_segments == len(tr.segments)
    # gpt2-train is the one whose ties the segment order decides: in the
    # simulated device's own order the replay needs a 2 MiB segment more.
    train = Trace.load(SHIPPED.parent / "gpt2-train.trace.gz")
    assert replay(train, recorded_addresses=False).peak_reserved == train.recorded_peak_reserved() + 2 * MiB


def test_shipped_synthetic_trace_replays_exactly() -> None:
    tr = Trace.load(SHIPPED)
    assert tr.meta["synthetic"] is True and tr.meta["capacity"] == 64 << 30
    assert len(tr) > 40_000 and SHIPPED.stat().st_size < 400 << 10
    tr.validate()
    calls: list[tuple[int, int]] = []
    res = replay(tr, progress=lambda done, total: calls.append((done, total)), progress_every=10_000)
    # The recording pool had the default policy: the replay reproduces it.
    assert res.reserved_vs_recorded == 1.0
    assert res.peak_reserved == tr.recorded_peak_reserved()
    assert res.peak_allocated == tr.peak_requested()  # the demo asks for multiples of 512 bytes: no rounding
    assert res.capacity == 64 << 30
    assert calls[0] == (10_000, len(tr)) and calls[-1] == (len(tr), len(tr))


def test_replay_matches_the_demo_it_was_recorded_from() -> None:
    from gpumempool.demo import run_demo

    with gmp.MemPool("sim", capacity=64 << 30, manual_events=True) as pool:
        with TraceRecorder(pool) as rec:
            demo = run_demo(steps=12, layers=5, seed=3, progress=False, pool=pool)
    assert rec.trace is not None
    res = replay(rec.trace)
    assert (res.peak_allocated, res.peak_reserved) == (demo.peak_allocated, demo.peak_reserved)
    assert res.backend_calls == demo.backend_calls


def test_parse_policy_and_sizes() -> None:
    assert parse_size("64MiB") == 64 * MiB == parse_size("64m") == parse_size("67108864")
    assert parse_size("2GB") == 2_000_000_000 and parse_size("0x1000") == 4096 and parse_size("1.5KiB") == 1536
    assert parse_policy(["max_split_size=64MiB,expandable=true", "limit=1GiB"]) == {
        "max_split_size": 64 * MiB, "expandable": True, "limit": 1 << 30}
    for bad in ("limit", "bogus=1", "limit=lots", "expandable=maybe"):
        with pytest.raises(ValueError):
            parse_policy([bad])


def test_replay_policies_benchmark_runs(tmp_path: Path) -> None:
    import runpy
    import sys

    trace = tmp_path / "tiny.trace"
    trace.write_text("gmptrace 1\na 1 20971520 0\na 2 20971520 0\nf 1\na 3 31457280 0\nf 2\nf 3\n"
                     "a 4 41943040 0\nf 4\n")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "replay_policies.py"
    argv = sys.argv
    sys.argv = [str(script), str(trace), "--out", str(tmp_path / "res")]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    res = json.loads((tmp_path / "res" / "replay_policies.json").read_text())
    rows = res["traces"]["tiny.trace"]["rows"]
    assert rows[0]["reserved_vs_default"] == 1.0 and len(rows) >= 6
    assert "| expandable segments |" in (tmp_path / "res" / "replay_policies.md").read_text()


# -- crafted and corrupt inputs (review regressions) -------------------------------


def _entry(t: int = 0, **kw) -> dict:
    return {"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": t, **kw}


def test_shared_references_do_not_multiply_the_work() -> None:
    """4 KB of pickle naming one entry a million times (shared references)
    is refused at once, not imported as a million events."""
    t = [_entry()] * 1000
    data = pickle.dumps({"segments": [], "device_traces": [t] * 1000}, protocol=4)
    assert len(data) < 5000
    t0 = time.perf_counter()
    with pytest.raises(UnsafePickleError, match="shared references expand it"):
        from_torch_snapshot(data)
    # Below the pickle budget, the importer still refuses repeated entries.
    with pytest.raises(TraceFormatError, match="same object as an earlier entry"):
        from_torch_snapshot(pickle.dumps({"segments": [], "device_traces": [[_entry()] * 3]}))
    with pytest.raises(TraceFormatError, match="same list"):
        from_torch_snapshot({"segments": [], "device_traces": [[_entry()]] * 2})
    assert time.perf_counter() - t0 < 1.0


def test_exponential_structures_are_refused_without_repr() -> None:
    x: object = 1
    for _ in range(22):
        x = [x, x]  # 2**22 leaves when walked (kept small: the unfixed repr of it took seconds)
    snap = {"device_traces": [[{"action": "alloc", "addr": 1, "size": x, "stream": 0}]], "segments": []}
    t0 = time.perf_counter()
    with pytest.raises(UnsafePickleError, match="shared references"):
        from_torch_snapshot(pickle.dumps(snap, protocol=4))
    # A dict given directly: the error names the type, never the value.
    with pytest.raises(TraceFormatError, match="size must be an int, got list"):
        from_torch_snapshot(snap)
    assert time.perf_counter() - t0 < 1.0


def test_deep_nesting_is_the_modules_error() -> None:
    n = 200_000
    deep = b"]" * n + b"a" * (n - 1)  # EMPTY_LIST x n, APPEND x (n - 1): [[[...]]]
    p = pickle.dumps({"device_traces": [[{"action": "alloc", "size": None}]], "segments": []}, protocol=2)
    i = p.index(b"N")
    with pytest.raises(UnsafePickleError, match="nested deeper than") as ei:
        from_torch_snapshot(p[:i] + deep + p[i + 1:])
    assert isinstance(ei.value, ValueError)
    # Nested tuples as a dict key are hashed recursively in C while unpickling
    # (deep enough, that crashes the interpreter): refused before unpickling.
    with pytest.raises(UnsafePickleError, match="tuples nested deeper than"):
        load_pickle(b"\x80\x02}" + b")" + b"\x85" * 1000 + b"Ns.")
    with pytest.raises(UnsafePickleError, match="cycle"):
        a: list = []
        a.append(a)
        load_pickle(pickle.dumps({"device_traces": a}))
    # From a dict, too deep to repr: a clean error.
    v: object = 1
    for _ in range(100_000):
        v = [v]
    with pytest.raises(TraceFormatError, match="got list"):
        from_torch_snapshot({"device_traces": [[{"action": "alloc", "addr": 1, "size": v}]]})


@pytest.mark.parametrize("op", [b"r\x40\x42\x0f\x00", b"p1000000\n"], ids=["binary", "text"])
def test_memo_index_bomb_is_refused_before_unpickling(op: bytes) -> None:
    """9 bytes whose memo index makes the C unpickler allocate 16 bytes per
    index (GBs for a larger one; this one, 16 MB, shows it without harm if
    the check regresses)."""
    import tracemalloc

    data = b"\x80\x04}" + op + b"."
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(UnsafePickleError, match="memo index"):
            load_pickle(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and time.perf_counter() - t0 < 0.5


def test_ordinary_pickles_still_load() -> None:
    """Torch shares stack frames between entries, and protocols 0-5 all work."""
    frames = [{"filename": f"f{i}.py", "line": i, "name": "fn"} for i in range(40)]
    stacks = [frames[i:] + frames[:i] for i in range(10)]
    snap = torch_snapshot()
    for i, e in enumerate(snap["device_traces"][0]):
        e["frames"] = stacks[i % 10]
    snap["segment_ids"] = ((1, 2), ((3, 4), (5, 6)), 1.5, None, True, 1 << 100, "text")
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        assert load_pickle(pickle.dumps(snap, protocol=proto)) == snap
        if proto >= 4:  # sets and bytes have opcodes of their own from protocol 4 (before: globals)
            other: dict = {"sets": [frozenset({"a", "b"}), {"c"}], "raw": b"raw"}
            if proto >= 5:
                other["buf"] = bytearray(b"x")
            assert load_pickle(pickle.dumps(other, protocol=proto)) == other
        assert len(from_torch_snapshot(pickle.dumps(snap, protocol=proto))) == len(from_torch_snapshot(snap))
    with pytest.raises(UnsafePickleError, match="not a readable pickle"):
        load_pickle(b"\x80\x04\x8c\xff")  # a length beyond the data


def _bomb_gz(path: Path, body: bytes, repeat: int) -> None:
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        f.write(c.compress(body))
        chunk = b"x" * MiB
        for _ in range(repeat):
            f.write(c.compress(chunk))
        f.write(c.flush())


def test_gzip_line_bomb_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    import tracemalloc

    bomb = tmp_path / "bomb.trace.gz"
    _bomb_gz(bomb, b"gmptrace 1\n# ", 24)  # a 24 MiB comment line, 24 KiB on disk
    tracemalloc.start()
    try:
        with pytest.raises(TraceFormatError, match="longer than 1 MiB"):
            Trace.load(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MiB


def test_gzip_pickle_is_decompressed_in_chunks(tmp_path: Path) -> None:
    """gz.read(max_bytes + 1) allocated max_bytes (4 GiB by default) up front."""
    import tracemalloc

    bomb = tmp_path / "bomb.pickle.gz"
    _bomb_gz(bomb, b"", 6)
    tracemalloc.start()
    try:
        with pytest.raises(UnsafePickleError):
            load_pickle(bomb)
        with pytest.raises(UnsafePickleError, match="decompresses to more than"):
            load_pickle(bomb, max_bytes=3 * MiB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MiB


def test_corrupt_gzip_is_the_modules_error(tmp_path: Path) -> None:
    good = gzip.compress(b"gmptrace 1\n" + b"a 1 512 0\n" * 1000)
    bad = bytearray(good)
    for i in range(20, 60):
        bad[i] ^= 0xFF
    path = tmp_path / "bad.trace.gz"
    path.write_bytes(bytes(bad))
    with pytest.raises(TraceFormatError, match="corrupt gzip data"):
        Trace.load(path)
    assert is_trace_file(path) is False
    with pytest.raises(UnsafePickleError, match="bad gzip data"):
        load_pickle(bytes(bad))
    truncated = tmp_path / "cut.trace.gz"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(TraceFormatError):
        Trace.load(truncated)


@pytest.mark.parametrize("line, match", [
    ('@ {"x": NaN}', "standard JSON"),
    ('@ {"devices": 1e400}', "out of range"),
    ("@ " + '{"a": ' + "[" * 100 + "]" * 100 + "}", "nested deeper than"),
    ("@ " + '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than"),
])
def test_metadata_must_be_plain_json(line: str, match: str) -> None:
    with pytest.raises(TraceFormatError, match=match):
        Trace.loads(f"gmptrace 1\n{line}\na 1 512 0\n")


def test_imported_traces_stay_readable() -> None:
    """Out-of-range values from a snapshot never reach the trace (which
    could then not be read back): entries and segments are refused, or
    with lenient=True left out."""
    with pytest.raises(TraceFormatError, match=r"size must be at most 2\*\*50 bytes \(1 PiB.*got an int of 71 bits"):
        from_torch_snapshot({"device_traces": [[_entry(size=1 << 70)]]})
    with pytest.raises(TraceFormatError, match="stream must be"):
        from_torch_snapshot({"device_traces": [[_entry(stream=1 << 64)]]})
    with pytest.raises(TraceFormatError, match="time_us must be a number, got str"):
        from_torch_snapshot({"device_traces": [[_entry()], [{"action": "snapshot", "time_us": "x"}]]})
    good = {"address": 0x1000, "total_size": 4 * MiB, "stream": 0, "device": 0,
            "blocks": [{"address": 0x2000, "size": 512, "state": "active_allocated"}]}
    seg = dict(good, blocks=[{"address": 0x1000, "size": 1 << 70, "state": "active_allocated"}])
    snap = {"device_traces": [[_entry(addr=0x9000, t=1), _entry(addr=0xA000, t=2)]],
            "segments": [good, seg, dict(good, device=-1), dict(good, device=1 << 40), dict(good, stream=-5)]}
    with pytest.raises(TraceFormatError, match="segment 1: block 0: size must be at most 2"):
        from_torch_snapshot(snap)
    tr = from_torch_snapshot(snap, lenient=True)
    assert tr.meta["skipped_segments"] == 4 and "skipped_events" not in tr.meta
    again = Trace.loads(tr.dumps())
    assert again.events == tr.events and again.reserved == tr.reserved
    allocs = [e for e in tr.events if isinstance(e, Alloc)]
    assert {(e.size, e.device, e.stream) for e in allocs} == {(512, 0, 0)}
    assert len(allocs) == 3  # the trace's two, and the 512-byte block live before it


def test_history_trace_records_max_non_split_rounding_size() -> None:
    with gmp.MemPool("sim", max_non_split_rounding_size=64 * MiB, capacity=64 * MiB) as pool:
        with TraceRecorder(pool) as rec:
            pool.free(pool.alloc(1000))
    assert rec.trace is not None
    assert rec.trace.meta["recorded_policy"]["max_non_split_rounding_size"] == 64 * MiB
    assert replay(rec.trace).policy["max_non_split_rounding_size"] == 64 * MiB


def test_replay_refuses_bad_devices_metadata() -> None:
    tr = Trace.loads("gmptrace 1\na 1 512 0\n")
    for bad in (float("inf"), "2", [1], 1 << 40):
        tr.meta["devices"] = bad
        with pytest.raises(gmp.InvalidArgumentError, match="'devices'"):
            replay(tr)
    tr.meta["devices"] = 2.0
    assert replay(tr).allocations == 1


@pytest.mark.parametrize("text", ["1e400", "inf", "nan", "-1", "1e30", "0x1" + "0" * 20, "18446744073709551616"])
def test_parse_size_refuses_what_does_not_fit(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_is_exact_up_to_64_bits() -> None:
    assert parse_size("18446744073709551615") == (1 << 64) - 1  # float() would round it up
    assert parse_size("1.5KiB") == 1536
    with pytest.raises(ValueError, match="finite"):
        parse_policy("garbage_collection_threshold=nan")


def test_a_replay_with_ooms_claims_no_saving(capsys) -> None:
    """`replay T --policy limit=1MiB` failed allocations, then said
    '0.000 (saves memory)': a replay that served less than the program is
    no comparison."""
    from gpumempool.__main__ import main

    res = replay(Trace.load(SHIPPED), {"limit": 1 << 20})
    assert res.ooms > 0 and not res.comparable and res.as_dict()["comparable"] is False
    assert replay(Trace.loads(HAND)).comparable
    assert main(["replay", str(SHIPPED), "--policy", "limit=1MiB", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "saves memory" not in out and f"not comparable: the replay ran out of memory {res.ooms:,} time(s)" in out
    assert main(["replay", str(SHIPPED), "--no-progress"]) == 0
    assert "1.000 (no saving)" in capsys.readouterr().out


def test_policy_takes_the_16_counts_of_roundup_power2_divisions(capsys) -> None:
    """The help promised 16 counts, one per size interval, but the parser
    split them on their commas ('policy entries are key=value')."""
    from gpumempool.__main__ import main

    counts = [1, 1, 2, 2] + [4] * 12
    text = ",".join(map(str, counts))
    assert parse_policy([f"roundup_power2_divisions={text}"]) == {"roundup_power2_divisions": counts}
    assert parse_policy([f"roundup_power2_divisions=[{text}],limit=1GiB"]) == {
        "roundup_power2_divisions": counts, "limit": 1 << 30}
    assert parse_policy([f"expandable=true,roundup_power2_divisions={text},limit=1GiB"]) == {
        "expandable": True, "roundup_power2_divisions": counts, "limit": 1 << 30}
    assert parse_policy(["roundup_power2_divisions=4"]) == {"roundup_power2_divisions": 4}
    for bad in ("roundup_power2_divisions=1,2,3", f"roundup_power2_divisions=[{text}", "roundup_power2_divisions=[4]"):
        with pytest.raises(ValueError, match="one count or 16 whole numbers"):
            parse_policy([bad])
    with pytest.raises(ValueError, match="key=value"):
        parse_policy(["limit=1GiB,7"])  # a bare number only continues roundup_power2_divisions
    res = replay(Trace.loads(HAND), parse_policy([f"roundup_power2_divisions={text}"]))
    assert res.policy["roundup_power2_divisions"] == counts
    assert main(["replay", str(SHIPPED), "--no-progress", "--json", "--policy", f"roundup_power2_divisions={text}"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"]["roundup_power2_divisions"] == counts


def test_garbage_collection_threshold_without_limit_warns(capsys) -> None:
    """It acts on a fraction of the limit: without one the replay silently
    ignored it."""
    from gpumempool.__main__ import main

    with pytest.warns(UserWarning, match="garbage_collection_threshold=0.5 has no effect without limit"):
        replay(Trace.loads(HAND), {"garbage_collection_threshold": 0.5})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay(Trace.loads(HAND), {"garbage_collection_threshold": 0.5, "limit": 1 << 30})
        replay(Trace.loads(HAND))
    assert main(["replay", str(SHIPPED), "--no-progress", "--policy", "garbage_collection_threshold=0.5"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("python -m gpumempool: warning: garbage_collection_threshold=0.5 has no effect"), err
    assert len(err.splitlines()) == 1


def test_replay_policy_of_the_wrong_kind_is_a_clear_error() -> None:
    """gmp.replay(trace, 5), (trace, 'limit=1GiB') and a list raised
    AttributeError ('... has no attribute items'); {'limit': -1} a TypeError."""
    tr = Trace.loads(HAND)
    for bad in (5, 1.5, object(), [1, 2]):
        with pytest.raises(TypeError, match="policy must be a dict"):
            gmp.replay(tr, bad)  # type: ignore[arg-type]
    # 'key=value' strings, as --policy takes them, are read with parse_policy
    assert gmp.replay(tr, "limit=13MiB").ooms == 5
    assert gmp.replay(tr, ["limit=13MiB", "expandable=false"]).policy == {"limit": 13 * MiB, "expandable": False}
    with pytest.raises(ValueError, match="unknown policy key"):
        gmp.replay(tr, "bogus=1")
    with pytest.raises(ValueError, match="policy limit must be a non-negative int"):
        gmp.replay(tr, {"limit": -1})
    with pytest.raises(TypeError, match="policy limit must be a non-negative int"):
        gmp.replay(tr, {"limit": "1GiB"})


def test_load_trace_of_a_snapshot_pickle_says_what_to_use(tmp_path: Path) -> None:
    """gmp.load_trace('snap.pickle') failed with a UTF-8 decode error."""
    snap = {"segments": [], "device_traces": [[_entry(), _entry(action="free_requested")]]}
    plain, zipped = tmp_path / "snap.pickle", tmp_path / "snap.pickle.gz"
    gmp.dump_snapshot(str(plain), snap)
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, zipped):
        with pytest.raises(TraceFormatError, match=r"a pickle \(a memory snapshot\?\), not a gmptrace file: .*"
                                                   r"from_torch_snapshot") as ei:
            gmp.load_trace(path)
        assert "utf-8" not in str(ei.value).lower()
        assert isinstance(gmp.from_torch_snapshot(path), Trace)  # what the message says to use


# -- edge cases found by review ------------------------------------------------


def _e(action: str, addr: int, size: int, t: int, **kw: Any) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": [], **kw}


def test_global_snapshot_of_two_sim_pools_imports_both_blocks() -> None:
    # Two sim pools hand out the same addresses; gmp.snapshot() merges their
    # histories and the importer then mistakes the second alloc for a lost free.
    gmp.record_history(True)
    try:
        p1 = gmp.MemPool("sim", capacity=1 << 30, name="r1")
        p2 = gmp.MemPool("sim", capacity=1 << 30, name="r2")
        try:
            a, b = p1.alloc(1000), p2.alloc(2000)
            p1.free(a)
            p2.free(b)
            tr = from_history(gmp.snapshot())
        finally:
            p1.close()
            p2.close()
    finally:
        gmp.record_history(False)
    assert "repaired_allocs" not in tr.meta and "unmatched_frees" not in tr.meta, tr.meta
    assert tr.peak_requested() == 3000  # both blocks were live at once


def test_trace_recorder_does_not_record_a_refused_trim() -> None:
    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        with TraceRecorder(pool) as rec:
            p = pool.alloc(1000)
            with pytest.raises(ValueError):
                pool.trim(0, 5)  # no device 5: refused, nothing happened
            pool.free(p)
    assert Trim(0, 5) not in rec.trace.events
    replay(rec.trace)  # today: InvalidArgumentError "device 5 out of range"


def test_trace_recorder_warns_of_an_overflow_whatever_entries_filled_the_ring() -> None:
    """The engine's history ring holds the empty_cache and trim calls (and
    record_stream entries) too, which the snapshot keeps aside from its
    device traces: an overflow must still be told. (Counting the device
    traces alone missed it once the engine recorded empty_cache.)"""
    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with TraceRecorder(pool, max_entries=10):
                for _ in range(8):
                    pool.free(pool.alloc(MiB))
                pool.empty_cache()
                pool.free(pool.alloc(MiB))
    assert any("overflowed" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_preexisting_block_with_record_stream_freed_at_once_comes_back_in_replay() -> None:
    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        x = pool.alloc(12 * MiB)  # before history: a pre-existing block
        pool.record_history(True)
        pool.record_stream(x, 5)
        pool.free(x)  # completes at once (free_completed follows)
        y = pool.alloc(12 * MiB)  # reuses x's memory
        recorded_peak = pool.stats()["reserved_bytes.all.peak"]
        tr = from_history(pool)
        pool.free(y)
    assert recorded_peak == 12 * MiB
    # RecordStream(1, V) + Free(1) without Sync(V): the replay holds the block forever.
    assert replay(tr).peak_reserved == 12 * MiB


def test_empty_cache_followed_by_a_cache_hit_is_inferred() -> None:
    A, L, M = 0x7F0000000000, 0x7F0010000000, 0x7F0020000000
    trace = [
        _e("segment_alloc", A, 2 * MiB, 1),
        _e("alloc", A, 512, 2),
        _e("segment_alloc", L, 20 * MiB, 3),
        _e("alloc", L, 12 * MiB, 4),
        _e("free_requested", L, 12 * MiB, 5),
        _e("free_completed", L, 12 * MiB, 6),
        _e("segment_free", L, 20 * MiB, 7),  # torch.cuda.empty_cache()
        _e("alloc", A + 512, 512, 8),  # next allocation: a hit in the small segment
        _e("segment_alloc", M, 30 * MiB, 9),
        _e("alloc", M, 30 * MiB, 10),
    ]
    tr = from_torch_snapshot({"segments": [], "device_traces": [trace]})
    assert EmptyCache() in tr.events, tr.events
    assert tr.recorded_peak_reserved() == 32 * MiB
    assert replay(tr).peak_reserved == 32 * MiB  # today 52 MiB: the 20 MiB segment stays cached


def test_oom_entry_of_a_huge_request_does_not_reject_the_snapshot() -> None:
    # torch records the (rounded) size of the request that failed; a request of
    # 2**63 bytes or more is a valid, caught torch.OutOfMemoryError.
    trace = [_e("alloc", 0x1000, 512, 1), _e("oom", 1 << 30, 1 << 63, 2, device_free=1 << 30)]
    tr = from_torch_snapshot({"segments": [], "device_traces": [trace]})
    assert tr.meta["recorded_ooms"] == 1


def test_timeline_of_our_snapshot_starts_at_zero() -> None:
    from gpumempool.plot import timeline

    with gmp.MemPool("sim", capacity=1 << 30) as pool:
        pool.record_history(True)  # before anything: history covers the pool's whole life
        x = pool.alloc(1000)
        y = pool.alloc(3 * MiB + 1)
        tl = timeline(pool.snapshot())
        pool.free(x)
        pool.free(y)
    assert tl["requested"][0] == 0, tl["requested"]  # once 535: block rounding minus requested sizes


def test_plot_reports_the_file_it_wrote(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gpumempool.plot import plot_snapshot

    out = tmp_path / "figure"  # no extension: matplotlib writes figure.png
    summary = plot_snapshot({"segments": [], "device_traces": [[]]}, out)
    assert Path(summary["output"]).is_file(), (summary["output"], sorted(p.name for p in tmp_path.iterdir()))


def test_replay_refuses_an_invalid_trace_and_ignores_a_recorded_capacity() -> None:
    """A hand-written trace allocating one id twice replayed silently (a
    block leaked); a recorded_policy's capacity shrank the device."""
    with pytest.raises(TraceFormatError, match="allocated twice"):
        replay(Trace.loads("gmptrace 1\na 1 1000 0\na 1 1000 0\n"))
    tr = Trace.loads("gmptrace 1\na 1 4096 0\nf 1\n")
    tr.meta["recorded_policy"] = {"capacity": 1000}
    res = replay(tr)
    assert res.ooms == 0 and res.capacity > 1000
