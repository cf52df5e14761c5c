"""Edges of replaying real snapshots: the start state (small segments,
rounding, blocks outside the seeded segments, bad start_segments
metadata), releases on several devices, tune's deadline during
--min-capacity, the stacks and --lenient of our own snapshots. Each
failed before its fix (found in review)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpumempool as gmp
from gpumempool.replay import replay
from gpumempool.trace import Trace, from_torch_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_start_state import MiB, mid_run_snapshot  # noqa: E402


def test_a_small_segment_larger_than_the_small_pool_is_not_a_go_panic() -> None:
    # A snapshot whose segment says "small" but is 40 MiB: the small pool's
    # bins hold at most 2 MiB, and seeding it panicked in the engine.
    snap = mid_run_snapshot()
    snap["segments"][0]["segment_type"] = "small"
    tr = from_torch_snapshot(snap)
    res = replay(tr)  # no BackendError (a recovered Go panic)
    assert res.ooms == 0
    # The engine refuses such a segment itself, as an invalid argument.
    pool = gmp.MemPool(backend="sim")
    with pytest.raises(gmp.InvalidArgumentError):
        pool.seed_segment([(40 * MiB, 0, False)], device=0, stream=0, small=True)
    pool.close()


def _with_rows(tmp_path: Path, rows) -> Path:
    """The mid-run snapshot as a gmptrace file whose start_segments are ``rows``."""
    tr = from_torch_snapshot(mid_run_snapshot())
    tr.meta["start_segments"] = rows
    p = tmp_path / "t.gmptrace"
    tr.save(p)
    return p


B, C = 0x7F0000000000, 0x7F0004000000


@pytest.mark.parametrize("rows, why", [
    # block 2 listed twice: one of the two seeded blocks is never freed
    ([[0, B, 0, 0, [10 * MiB, 2, 30 * MiB, 2]]], "block 2"),
    # no block 99 at the start: a live block nobody frees
    ([[0, B, 0, 0, [10 * MiB, 99, 30 * MiB, 0]]], "block 99"),
    # block 3 is the trace's own alloc, not one live at the start
    ([[0, B, 0, 0, [10 * MiB, 3, 30 * MiB, 0]]], "block 3"),
    # two segments over the same bytes
    ([[0, B, 0, 0, [10 * MiB, 2, 30 * MiB, 0]], [0, B + 2 * MiB, 0, 0, [20 * MiB, 0, 4 * MiB, 1, 16 * MiB, 0]]],
     "overlap"),
])
def test_bad_start_segments_metadata_is_refused_in_one_line(tmp_path: Path, rows, why: str) -> None:
    p = _with_rows(tmp_path, rows)
    with pytest.raises(gmp.InvalidArgumentError, match=why):
        replay(Trace.load(p))
    r = subprocess.run([sys.executable, "-m", "gpumempool", "replay", "--no-progress", str(p)],
                       capture_output=True, text=True)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(err) == 1 and "start_segments" in err[0], r.stderr


def test_a_block_live_at_the_start_is_rounded_as_torch_rounded_it() -> None:
    # roundup_power2_divisions:4 (every interval): torch's block for a
    # request of 1100 MiB is 1280 MiB, its whole segment. The block was
    # live at the start and freed in the trace; rebuilt as 1100 MiB it left
    # a cached 180 MiB tail that served the trace's 100 MiB request, where
    # torch (no cached block) obtained a 112 MiB segment.
    A, A2 = 0x7F0000000000, 0x7F0100000000
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4", "max_split_size": -1,
                "garbage_collection_threshold": 0.0, "expandable_segments": False,
                "roundup_power2_divisions": {str(1 << i): 4 for i in range(16)}}
    trace = [
        {"action": "segment_alloc", "addr": A2, "size": 112 * MiB, "stream": 0},
        {"action": "alloc", "addr": A2, "size": 100 * MiB, "stream": 0},
        {"action": "free_requested", "addr": A, "size": 1100 * MiB, "stream": 0},
        {"action": "free_completed", "addr": A, "size": 1100 * MiB, "stream": 0},
        {"action": "free_requested", "addr": A2, "size": 100 * MiB, "stream": 0},
        {"action": "free_completed", "addr": A2, "size": 100 * MiB, "stream": 0},
    ]
    seg = lambda addr, size: {"device": 0, "address": addr, "total_size": size, "stream": 0,  # noqa: E731
                              "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                              "blocks": [{"address": addr, "size": size, "requested_size": 0,
                                          "state": "inactive"}]}
    snap = {"segments": [seg(A, 1280 * MiB), seg(A2, 112 * MiB)], "device_traces": [trace],
            "allocator_settings": settings}
    tr = from_torch_snapshot(snap)
    assert tr.meta["start_segments"][0][4][0] == 1280 * MiB  # the block torch had: the whole segment
    res = replay(tr)
    assert res.recorded_peak_reserved == 1392 * MiB
    assert res.peak_reserved == 1392 * MiB and res.ratio_vs_torch == 1.0


def test_a_release_on_one_device_is_not_a_retry_for_another_devices_segment() -> None:
    # Device 0 runs empty_cache() at the end of its trace; in time, device
    # 1 obtains a segment after it. That is no release-and-retry: no recorded pressure, and the
    # release is an empty_cache() the replay runs too.
    A, D = 0x7F0000000000, 0x7F1000000000

    def e(a: str, addr: int, size: int, t: int) -> dict:
        return {"action": a, "addr": addr, "size": size, "stream": 0, "time_us": t}

    d0 = [e("segment_alloc", A, 100 * MiB, 1), e("alloc", A, 100 * MiB, 2), e("free_requested", A, 100 * MiB, 3),
          e("free_completed", A, 100 * MiB, 4), e("segment_free", A, 100 * MiB, 10)]
    d1 = [e("segment_alloc", D, 200 * MiB, 20), e("alloc", D, 200 * MiB, 21)]
    seg = lambda dev, addr, size: {"device": dev, "address": addr, "total_size": size, "stream": 0,  # noqa: E731
                                   "segment_type": "large", "blocks": [{"address": addr, "size": size,
                                                                        "requested_size": size,
                                                                        "state": "active_allocated"}]}
    tr = from_torch_snapshot({"segments": [seg(1, D, 200 * MiB)], "device_traces": [d0, d1]})
    assert "recorded_conditions" not in tr.meta
    assert tr.meta.get("inferred_empty_cache") == 1
    res = replay(tr)
    assert res.comparable and res.ratio_vs_torch == 1.0


def test_min_capacity_probes_that_run_past_the_deadline_do_not_crash_tune(monkeypatch) -> None:
    # The deadline passes once the search is done and the bisection of
    # --min-capacity has begun: tune returns the search's answer, partial,
    # with no min_capacity measured, not a KeyError from a probe that never ran.
    import time

    from gpumempool._tune_run import Runner
    from gpumempool.trace import Alloc, Free

    real_run = Runner.run

    def run(self, settings_list, expect=0, stop_above=None):
        settings_list = list(settings_list)
        if any("capacity" in s for s in settings_list):
            self.deadline = time.perf_counter() - 1  # past, from the probes on
        return real_run(self, settings_list, expect, stop_above)

    monkeypatch.setattr(Runner, "run", run)
    trace = Trace([Alloc(1, 12 * MiB), Alloc(2, 12 * MiB), Free(1), Free(2)], {})
    r = gmp.tune(trace, jobs=1, extra=False, min_capacity=True, deadline_s=3600)
    assert r.partial
    assert r.default.min_capacity is None and r.best.fits


def _first_alloc() -> int:
    return _POOL.alloc(4 * MiB)


def _after_record_stream() -> int:
    return _POOL.alloc(8 * MiB)


_POOL: gmp.MemPool


def test_frames_of_an_event_after_a_record_stream_are_its_own() -> None:
    # Our snapshots keep record_stream calls aside (gpumempool_record_stream);
    # the importer puts them back among the entries, and the indices of the
    # later entries it keeps for Trace.frames must be those of device_traces.
    global _POOL
    with gmp.MemPool("sim", name="review-frames", capacity=1 << 30, manual_events=True) as pool:
        _POOL = pool
        pool.record_history(True, stacks=True)
        a = _first_alloc()
        pool.record_stream(a, 7)
        b = _after_record_stream()
        snap = pool.snapshot()
        pool.free(a)
        pool.free(b)
        pool.sim.complete()
        pool.process_events()
    assert snap.get("gpumempool_record_stream")
    tr = from_torch_snapshot(snap)
    allocs = [i for i, e in enumerate(tr.events) if type(e).__name__ == "Alloc"]
    by_size = {tr.events[i].size: i for i in allocs}
    frames = tr.frames([by_size[4 * MiB], by_size[8 * MiB]])
    assert frames[by_size[4 * MiB]][0]["name"] == "_first_alloc"
    assert frames[by_size[8 * MiB]][0]["name"] == "_after_record_stream"


def test_lenient_keeps_our_record_streams_in_place() -> None:
    # Our snapshot keeps record_stream calls aside, each with its index in
    # device_traces. --lenient leaving out a malformed entry before one must
    # not move it past the free it was for (a deferred free lost).
    import copy

    with gmp.MemPool("sim", name="review-lenient", capacity=1 << 30, manual_events=True) as pool:
        pool.record_history(True)
        x = pool.alloc(3 * MiB)
        y = pool.alloc(5 * MiB)
        pool.record_stream(y, 7)
        pool.free(y)
        pool.alloc(5 * MiB)
        pool.free(x)
        snap = pool.snapshot()
    good = from_torch_snapshot(copy.deepcopy(snap))
    assert good.meta["deferred_frees"] == 1
    bad = copy.deepcopy(snap)
    bad["device_traces"][0].insert(0, {"action": "bogus", "addr": 1, "size": 1, "stream": 0, "time_us": 0})
    for e in bad["gpumempool_record_stream"][0]:
        e["gpumempool_index"] += 1  # where it is in this file
    tr = from_torch_snapshot(bad, lenient=True)
    assert tr.meta["skipped_events"] == 1
    assert tr.events == good.events and tr.meta["deferred_frees"] == 1


def test_blocks_live_at_the_start_outside_the_seeded_segments_do_not_take_torchs_cache() -> None:
    # 2,100 blocks live at the start (more than replay's STOP_CHECK_EVENTS)
    # in a private pool's segment (a CUDA graph's: not seeded, allocated
    # as the replay begins), and a 10 GiB default-pool cache that the
    # trace's first event, an empty_cache(), releases: the run peaks at
    # 4,300 MiB from its first event on. The replay served the private
    # blocks from that cache (10,240 MiB peak, "comparable"); and one told
    # to stop above 5,000 MiB (tune's stop_above) must not stop on the
    # cache held before the run began.
    from gpumempool import replay as replay_mod

    n = 2100
    assert n > replay_mod.STOP_CHECK_EVENTS
    P, S2, S3 = 0x7F0000000000, 0x7F1000000000, 0x7F2000000000
    blocks = [{"address": P + k * 2 * MiB, "size": 2 * MiB, "requested_size": 2 * MiB,
               "state": "active_allocated"} for k in range(n)]
    trace = [
        {"action": "segment_free", "addr": S2, "size": 10240 * MiB, "stream": 0},  # empty_cache()
        {"action": "segment_alloc", "addr": S3, "size": 100 * MiB, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": S3, "size": 100 * MiB, "stream": 0},
    ]
    trace.insert(1, {"action": "free_requested", "addr": P, "size": 2 * MiB, "stream": 0})
    trace.insert(2, {"action": "free_completed", "addr": P, "size": 2 * MiB, "stream": 0})
    seg = {"device": 0, "address": P, "total_size": n * 2 * MiB, "stream": 0, "segment_type": "large",
           "segment_pool_id": (1, 5), "is_expandable": False,
           "blocks": [dict(blocks[0], state="inactive")] + blocks[1:]}
    seg3 = {"device": 0, "address": S3, "total_size": 100 * MiB, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False,
            "blocks": [{"address": S3, "size": 100 * MiB, "requested_size": 100 * MiB, "state": "active_allocated"}]}
    tr = from_torch_snapshot({"segments": [seg, seg3], "device_traces": [trace]})
    assert tr.meta["preexisting_blocks"] == n and tr.meta["inferred_empty_cache"] == 1
    full = replay(tr)
    assert full.start_segments == 1 and full.start_reserved == 10240 * MiB
    assert full.recorded_peak_reserved == (n * 2 + 100) * MiB
    # The private pool's blocks took segments of their own, not torch's
    # cached 10 GiB (which the empty_cache() then could not release).
    assert full.peak_reserved == full.recorded_peak_reserved and full.comparable
    stopped = replay(tr, stop_above=5000 * MiB)
    assert stopped.stopped_at is None and stopped.peak_reserved == full.peak_reserved
