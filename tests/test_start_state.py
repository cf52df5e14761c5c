"""Replays that start where torch was: snapshots whose history starts
mid-run (torch's segments and blocks at the first event, rebuilt and
seeded), and the memory pressure the recording shows (the capacity torch
had, inferred; comparable only when the replay meets it)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpumempool as gmp
from gpumempool.__main__ import main
from gpumempool.replay import replay
from gpumempool.trace import Trace, from_torch_snapshot

MiB = 1 << 20
GiB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
EXTERNAL = ROOT.parent / "shared" / "traces-external"
#: The external snapshots with a history to replay (the README says which).
WITH_HISTORY = ["Constructor-Sun_memory_snapshot_52e52b2.pickle", "Maphsge4_snapshot_04d383c.pickle",
                "Wedsonlin_medium_512_training_memory_snapshot_8630bcf.pickle", "ZidongLiu_memory_edd30e0.pickle",
                "kkaitlyn111_memory_ctx512_forward_46eae3f.pickle"]


def _e(action: str, addr: int, size: int, **kw) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, **kw}


def _seg(addr: int, size: int, blocks: list) -> dict:
    return {"device": 0, "address": addr, "total_size": size, "stream": 0,
            "segment_type": "small" if size == 2 * MiB else "large", "segment_pool_id": (0, 0),
            "is_expandable": False,
            "blocks": [{"address": a, "size": s, "requested_size": r, "state": st} for a, s, r, st in blocks]}


# Two 40 MiB segments torch held before history began; the lower one (at
# address B) has a live 10 MiB block at its start, the higher one (at C) a
# live block in its middle. A request of 30 MiB fits the 30 MiB free tail
# of B exactly: torch reused it. From an empty device, a replay would
# obtain a new segment.
B, C = 0x7F0000000000, 0x7F0004000000


def mid_run_snapshot() -> dict:
    trace = [
        _e("alloc", B + 10 * MiB, 30 * MiB),  # the free tail of B
        _e("free_requested", C + 20 * MiB, 4 * MiB),  # live before the trace
        _e("free_completed", C + 20 * MiB, 4 * MiB),
        _e("alloc", C, 20 * MiB),
    ]
    return {
        "segments": [
            _seg(B, 40 * MiB, [(B, 10 * MiB, 10 * MiB, "active_allocated"),
                               (B + 10 * MiB, 30 * MiB, 30 * MiB, "active_allocated")]),
            _seg(C, 40 * MiB, [(C, 20 * MiB, 20 * MiB, "active_allocated"),
                               (C + 20 * MiB, 20 * MiB, 0, "inactive")]),
        ],
        "device_traces": [trace],
    }


def test_a_mid_run_snapshot_starts_with_torchs_segments() -> None:
    tr = from_torch_snapshot(mid_run_snapshot())
    # B: the live block and the cached tail; C: cached, then the block
    # freed in the trace (4 MiB), then cached to the end.
    rows = sorted(tr.meta["start_segments"])
    assert [r[1] for r in rows] == [B, C]
    ids = {e.size: e.id for e in tr.events[:2]}
    assert rows[0][4] == [10 * MiB, ids[10 * MiB], 30 * MiB, 0]
    assert rows[1][4] == [20 * MiB, 0, 4 * MiB, ids[4 * MiB], 16 * MiB, 0]
    res = replay(tr)
    assert res.start_segments == 2 and res.start_reserved == 80 * MiB
    # Torch reused its cache for both requests: no new segment.
    assert res.device_allocs == 0 and res.peak_reserved == 80 * MiB == res.recorded_peak_reserved
    assert res.comparable and res.ratio_vs_torch == 1.0
    empty = replay(tr, start_state=False)
    assert empty.start_segments == 0 and empty.device_allocs > 0
    # The same through a gmptrace file (tune's workers read one).
    assert replay(Trace.loads(tr.dumps())).peak_reserved == 80 * MiB


def test_best_fit_ties_follow_torchs_addresses() -> None:
    # Two cached 30 MiB blocks of equal size: torch took the one at the lower
    # address, in the segment it obtained second (CUDA's addresses do not
    # grow). The request's 30 MiB then frees and a 40 MiB request fits only
    # if the other segment stayed whole.
    lo, hi = 0x7F0000000000, 0x7F1000000000
    snap = {
        "segments": [_seg(hi, 40 * MiB, [(hi, 10 * MiB, 10 * MiB, "active_allocated"),
                                          (hi + 10 * MiB, 30 * MiB, 0, "inactive")]),
                     _seg(lo, 40 * MiB, [(lo, 10 * MiB, 10 * MiB, "active_allocated"),
                                          (lo + 10 * MiB, 30 * MiB, 30 * MiB, "active_allocated")])],
        "device_traces": [[_e("alloc", lo + 10 * MiB, 30 * MiB), _e("free_requested", lo + 10 * MiB, 30 * MiB),
                           _e("free_completed", lo + 10 * MiB, 30 * MiB)]],
    }
    tr = from_torch_snapshot(snap)
    res = replay(tr)
    assert res.placed_segments == 2 and res.device_allocs == 0
    with gmp.MemPool("sim", capacity=GiB, manual_events=True) as pool:
        # What the seeding gives: the live blocks at torch's offsets.
        a, b = (pool.seed_segment([(10 * MiB, 10 * MiB, True), (30 * MiB, 0, False)]) for _ in range(2))
        assert b[0] - a[0] >= 40 * MiB
        x = pool.alloc(30 * MiB)
        assert x == a[0] + 10 * MiB  # the lower address wins the tie
        for p in (a[0], b[0], x):
            pool.free(p)


def test_seed_segment_refuses_bad_blocks() -> None:
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        with pytest.raises(ValueError, match="multiple of 512"):
            pool.seed_segment([(1000, 0, False)])
        with pytest.raises(TypeError, match="block 0"):
            pool.seed_segment([1000])  # type: ignore[list-item]
        with pytest.raises(gmp.OutOfMemoryError):
            pool.seed_segment([(128 * MiB, 0, False)])
        assert pool.stats()["reserved_bytes.all.current"] == 0
    with gmp.MemPool("sim", capacity=GiB, expandable=True) as pool, pytest.raises(ValueError, match="expandable"):
        pool.seed_segment([(20 * MiB, 0, False)])


def test_a_trace_that_begins_by_releasing_the_cache() -> None:
    # empty_cache() first: the 60 MiB torch held before it is not the run's peak.
    # (A release followed by a new segment would be a retry; here the next
    # request is served from the cache.)
    snap = {
        "segments": [_seg(B, 20 * MiB, [(B, 8 * MiB, 8 * MiB, "active_allocated"),
                                         (B + 8 * MiB, 12 * MiB, 12 * MiB, "active_allocated")])],
        "device_traces": [[_e("segment_free", C, 40 * MiB), _e("alloc", B + 8 * MiB, 12 * MiB)]],
    }
    tr = from_torch_snapshot(snap)
    assert tr.reserved[0] == (0, 0, 60 * MiB) and tr.meta["inferred_empty_cache"] == 1
    assert tr.recorded_peak_reserved() == 20 * MiB
    res = replay(tr)
    assert res.peak_reserved == 20 * MiB and res.ratio_vs_torch == 1.0 and res.comparable


def pressure_snapshot() -> dict:
    # Torch held 60 MiB, freed 30 MiB, then needed 40 MiB more: cudaMalloc
    # failed, torch released its 30 MiB cached segment and retried.
    S1, S2, S3 = 0x7F0000000000, 0x7F0002000000, 0x7F0004000000
    trace = [
        _e("segment_alloc", S1, 30 * MiB), _e("alloc", S1, 30 * MiB),
        _e("segment_alloc", S2, 30 * MiB), _e("alloc", S2, 30 * MiB),
        _e("free_requested", S2, 30 * MiB), _e("free_completed", S2, 30 * MiB),
        _e("segment_free", S2, 30 * MiB), _e("segment_alloc", S3, 40 * MiB), _e("alloc", S3, 40 * MiB),
    ]
    return {"segments": [], "device_traces": [trace]}


def test_memory_pressure_is_reproduced() -> None:
    tr = from_torch_snapshot(pressure_snapshot())
    cond = tr.meta["recorded_conditions"]
    assert cond["retries"] == 1 and cond["ooms"] == 0 and cond["capacity"] == 70 * MiB
    res = replay(tr)
    assert res.capacity == 70 * MiB and res.capacity_from == "recording"
    assert res.alloc_retries == 1 and res.device_frees == 1 and res.comparable
    assert res.peak_reserved == res.recorded_peak_reserved == 70 * MiB
    roomy = replay(tr, {"capacity": 80 * GiB})
    assert roomy.alloc_retries == 0 and roomy.capacity_from == "given"
    assert not roomy.comparable and "released its cache to retry 1 time(s)" in roomy.not_comparable_because
    # A fraction of a device limits the pool as torch's does.
    limited = replay(tr, {"capacity": 100 * MiB}, fraction=0.7)
    assert limited.policy["limit"] == 70 * MiB and limited.alloc_retries == 1 and limited.comparable


def test_an_oom_entry_is_asked_for_again() -> None:
    snap = {"segments": [], "device_traces": [[
        _e("segment_alloc", B, 40 * MiB), _e("alloc", B, 40 * MiB),
        _e("oom", 0, 30 * MiB, device_free=10 * MiB),
    ]]}
    tr = from_torch_snapshot(snap)
    assert tr.meta["recorded_conditions"]["capacity"] == 50 * MiB
    res = replay(tr)
    assert res.ooms == 1 == res.recorded_ooms and res.comparable
    big = replay(tr, {"capacity": GiB})
    assert big.ooms == 0 and not big.comparable and big.peak_reserved == 70 * MiB


def test_cli_says_where_the_replay_started(tmp_path, capsys) -> None:
    import pickle

    path = tmp_path / "mid.pickle"
    path.write_bytes(pickle.dumps(mid_run_snapshot()))
    assert main(["replay", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "2 segments, 80.00 MiB reserved at the first event" in out and "1.000" in out
    path.write_bytes(pickle.dumps(pressure_snapshot()))
    assert main(["replay", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "70.00 MiB (inferred from the recording)" in out and "recording: 1 cache releases to retry" in out
    assert main(["replay", str(path), "--no-progress", "--capacity", "1GiB"]) == 0
    assert "not comparable: the recording released its cache" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--fraction", "2"])
    assert exc.value.code == 2


@pytest.mark.parametrize("name", WITH_HISTORY)
def test_external_snapshots_replay_to_torchs_peak(name: str) -> None:
    path = EXTERNAL / name
    if not path.exists():
        pytest.skip("../shared/traces-external is not here")
    res = replay(from_torch_snapshot(path))
    assert res.comparable, res.not_comparable_because
    assert res.peak_reserved == res.recorded_peak_reserved, (res.peak_reserved, res.recorded_peak_reserved)


def test_an_empty_cache_before_a_new_segment_is_not_a_retry() -> None:
    # The device held 80 MiB early on. Later empty_cache() released a
    # 40 MiB segment at 60 MiB reserved, and the next request took a new
    # 20 MiB one: 60 + 20 MiB cannot have failed where 80 MiB fitted, so this
    # release was no retry under memory pressure.
    S1, S2, S3, S5 = 0x7F0000000000, 0x7F0004000000, 0x7F0008000000, 0x7F000C000000
    trace = [
        _e("segment_alloc", S1, 40 * MiB), _e("alloc", S1, 20 * MiB),
        _e("segment_alloc", S5, 40 * MiB), _e("alloc", S5, 40 * MiB),  # 80 MiB reserved
        _e("free_requested", S5, 40 * MiB), _e("free_completed", S5, 40 * MiB),
        _e("segment_free", S5, 40 * MiB),  # empty_cache(), then a cache hit
        _e("alloc", S1 + 20 * MiB, 20 * MiB),
        _e("segment_alloc", S2, 20 * MiB), _e("alloc", S2, 20 * MiB),  # 60 MiB
        _e("free_requested", S1, 20 * MiB), _e("free_completed", S1, 20 * MiB),
        _e("free_requested", S1 + 20 * MiB, 20 * MiB), _e("free_completed", S1 + 20 * MiB, 20 * MiB),
        _e("segment_free", S1, 40 * MiB), _e("segment_alloc", S3, 20 * MiB), _e("alloc", S3, 20 * MiB),
    ]
    tr = from_torch_snapshot({"segments": [], "device_traces": [trace]})
    assert "recorded_conditions" not in tr.meta and tr.meta["inferred_empty_cache"] == 2
    assert sum(type(e).__name__ == "EmptyCache" for e in tr.events) == 2
    res = replay(tr)
    assert res.comparable and res.capacity_from == "default" and res.recorded_retries == 0


def test_a_start_state_that_cannot_be_rebuilt_is_said(tmp_path, capsys) -> None:
    import pickle

    snap = mid_run_snapshot()
    # a live block that overlaps the next one: torch's state is not this
    # two blocks live at the start, 2 MiB apart, the first of 4 MiB
    snap["device_traces"][0][1:3] = [_e("free_requested", C + 20 * MiB, 4 * MiB),
                                      _e("free_completed", C + 20 * MiB, 4 * MiB),
                                      _e("free_requested", C + 22 * MiB, 4 * MiB),
                                      _e("free_completed", C + 22 * MiB, 4 * MiB)]
    tr = from_torch_snapshot(snap)
    assert "start_segments" not in tr.meta and "overlaps" in tr.meta["start_state_skipped"]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["replay", str(path), "--no-progress"]) == 0
    assert "from an empty device: torch's state at the first event could not be rebuilt" in capsys.readouterr().out


def test_tune_says_how_candidates_start_on_a_mid_run_trace() -> None:
    r = gmp.tune(from_torch_snapshot(mid_run_snapshot()), jobs=1, extra=False)
    assert any("the run started mid-run" in n and "expandable ones from an empty device" in n for n in r.notes)
    assert r.recorded is not None and r.recorded.peak_reserved == 80 * MiB
