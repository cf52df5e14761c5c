"""Our snapshots read like torch's: the keys and value types of trace
entries, segments, blocks and frames, per action, as torch writes them
(checked against a table taken from torch's source, and against snapshots
recorded on real GPUs where ../shared/traces-external is here); frames on
every event; no action torch lacks; expandable segments traced by their
mappings alone. Also: our importer still reads what we moved aside."""

from __future__ import annotations

import pickle
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import gpumempool as gmp
from gpumempool.demo import COMM_STREAM, COMPUTE_STREAM, run_demo
from gpumempool.replay import replay
from gpumempool.trace import RecordStream, TraceFormatError, from_history, from_torch_snapshot, load_pickle

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
EXTERNAL = ROOT.parent / "shared" / "traces-external"
EXT = "gpumempool_"  # the prefix of every key of ours that torch lacks

# -- torch's schema, from its source ------------------------------------------
# torch/csrc/cuda/memory_snapshot.cpp (_memory_snapshot_pickled) and the
# TraceEntry actions of c10/cuda/CUDACachingAllocator.h. An entry gets
# "frames" when a context was gathered (every one, with
# _record_memory_history(context="all"), the default); an "oom" entry has
# "device_free" where the others have "addr".
TORCH_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap", "oom", "snapshot"}
TORCH_ENTRY = {"action": str, "addr": int, "size": int, "stream": int, "time_us": int, "frames": list}
TORCH_OOM = {"action": str, "device_free": int, "size": int, "stream": int, "time_us": int, "frames": list}
# Added by later torch versions (2.6 onwards): allowed, not required.
TORCH_ENTRY_OPTIONAL = {"compile_context": str, "user_metadata": str, "pool_id": tuple}
TORCH_SEGMENT = {"device": int, "address": int, "total_size": int, "allocated_size": int, "active_size": int,
                 "requested_size": int, "stream": int, "segment_type": str, "segment_pool_id": tuple,
                 "is_expandable": bool, "frames": list, "blocks": list}
TORCH_BLOCK = {"address": int, "size": int, "requested_size": int, "state": str, "frames": list}
TORCH_FRAME = {"name": str, "filename": str, "line": int}
TORCH_STATES = {"active_allocated", "active_pending_free", "inactive"}


def torch_entry_schema(action: str) -> dict[str, type]:
    return TORCH_OOM if action == "oom" else TORCH_ENTRY


# -- our snapshots ---------------------------------------------------------------


def deep(n: int, fn: Callable[[], Any]) -> Any:
    """fn() called n frames deeper: stacks longer than the 32 frames we used to keep."""
    return fn() if n == 0 else deep(n - 1, fn)


def workload(pool: gmp.MemPool, side: int = 7) -> list[int]:
    """Allocates, frees, uses a side stream and record_stream, runs out of
    memory, empties the cache; leaves a pending free and live blocks (two
    large ones: an expandable segment that grew), which it returns."""
    a = deep(40, lambda: pool.alloc(30 * MiB))
    b = pool.alloc(50 * MiB)
    c = pool.alloc(1000, stream=side)
    small = pool.alloc(3000)
    pool.record_stream(b, side)
    pool.free(b)  # waits for the side stream
    pool.free(a)
    with pytest.raises(gmp.OutOfMemoryError):
        pool.alloc(1 << 40)
    pool.sim.complete(side)
    pool.process_events()
    pool.free(c)
    pool.empty_cache()
    late = pool.alloc(2000)
    pool.record_stream(late, side)
    pool.free(late)  # pending at the snapshot
    return [small, pool.alloc(30 * MiB), pool.alloc(30 * MiB)]


def snapshot_of(expandable: bool) -> dict[str, Any]:
    with gmp.MemPool("sim", name=f"schema-{expandable}", capacity=1 << 30, manual_events=True,
                     expandable=expandable) as pool:
        pool.record_history(True, stacks=True)
        live = workload(pool)
        snap = pool.snapshot()
        for p in live:
            pool.free(p)
        pool.sim.complete()
        pool.process_events()
    assert any(s["total_size"] > 40 * MiB for s in snap["segments"]) == expandable, "a segment grew"
    return snap


@pytest.fixture(scope="module")
def ours() -> dict[str, dict[str, Any]]:
    return {"plain": snapshot_of(False), "expandable": snapshot_of(True)}


def entries(snap: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for trace in snap["device_traces"]:
        yield from trace


def torch_keys(d: dict[str, Any]) -> set[str]:
    return {k for k in d if not k.startswith(EXT)}


def type_name(v: Any) -> str:
    return type(v).__name__


def check_frames(frames: Any, where: str) -> None:
    assert isinstance(frames, list) and frames, f"{where}: no frames"
    for f in frames:
        assert set(f) == set(TORCH_FRAME), where
        for k, t in TORCH_FRAME.items():
            assert type(f[k]) is t, f"{where}: frame {k} is {type_name(f[k])}"


def test_entries_have_torchs_keys_types_and_frames(ours) -> None:
    for kind, snap in ours.items():
        actions = set()
        for i, e in enumerate(entries(snap)):
            where = f"{kind} entry {i} ({e['action']})"
            actions.add(e["action"])
            assert e["action"] in TORCH_ACTIONS, where
            schema = torch_entry_schema(e["action"])
            assert torch_keys(e) - set(TORCH_ENTRY_OPTIONAL) == set(schema), where
            for k, t in schema.items():
                assert type(e[k]) is t, f"{where}: {k} is {type_name(e[k])}"
            check_frames(e["frames"], where)
        assert {"alloc", "free_requested", "free_completed", "oom"} <= actions
        if kind == "plain":
            assert {"segment_alloc", "segment_free"} <= actions
        else:
            # torch traces an expandable segment by its mappings alone
            assert {"segment_map", "segment_unmap"} <= actions
            assert not actions & {"segment_alloc", "segment_free"}


def test_record_stream_is_kept_aside_with_frames(ours) -> None:
    for kind, snap in ours.items():
        assert "record_stream" not in {e["action"] for e in entries(snap)}
        aside = snap["gpumempool_record_stream"]
        assert len(aside) == len(snap["device_traces"])
        calls = aside[0]
        assert len(calls) == 2 and all(e["stream"] == 7 for e in calls), kind
        trace = snap["device_traces"][0]
        for e in calls:
            check_frames(e["frames"], f"{kind} record_stream")
            # recorded after its block's allocation, before its free
            before, after = trace[:e["gpumempool_index"]], trace[e["gpumempool_index"]:]
            assert any(x["action"] == "alloc" and x["addr"] == e["addr"] for x in before)
            assert next(x for x in after if x["addr"] == e["addr"])["action"] == "free_requested"


def test_stacks_are_whole_and_belong_to_the_call(ours) -> None:
    here = traceback.extract_stack()
    for kind, snap in ours.items():
        trace = snap["device_traces"][0]
        first = trace[0]  # the first segment of a's deep(40, ...) call
        assert first["action"] in ("segment_alloc", "segment_map")
        names = [f["name"] for f in first["frames"]]
        assert names[0] == "<lambda>" and names.count("deep") == 41, kind
        assert len(names) > 32 + 40
        # down to the outermost frame, as torch records them
        assert (first["frames"][-1]["filename"], first["frames"][-1]["name"]) == (here[0].filename, here[0].name)
        assert not any("gpumempool" in f["filename"] and f["filename"].endswith("_pool.py") for f in first["frames"])
        # the free of b, and the frees that completed in process_events
        frees = [e for e in trace if e["action"] == "free_requested"]
        assert frees[0]["frames"][0]["name"] == "workload"
        completed = [e for e in trace if e["action"] == "free_completed" and e["addr"] == frees[0]["addr"]]
        assert completed[0]["frames"][0]["name"] == "workload"
        assert completed[0]["frames"][0]["line"] != frees[0]["frames"][0]["line"], "made by process_events"
        # empty_cache's releases
        releases = [e for e in trace if e["action"] in ("segment_free", "segment_unmap")]
        assert releases and all(e["frames"][0]["name"] == "workload" for e in releases)
        oom = next(e for e in trace if e["action"] == "oom")
        assert oom["frames"][0]["name"] == "workload"


def test_segments_and_blocks_have_torchs_keys_and_frames(ours) -> None:
    for kind, snap in ours.items():
        states = set()
        for s in snap["segments"]:
            assert torch_keys(s) == set(TORCH_SEGMENT), kind
            assert set(s) - torch_keys(s) == {"gpumempool_pool"}
            for k, t in TORCH_SEGMENT.items():
                assert type(s[k]) is t, f"{kind} segment {k} is {type_name(s[k])}"
            assert s["is_expandable"] is (kind == "expandable")
            check_frames(s["frames"], f"{kind} segment")  # every segment was made under history
            for b in s["blocks"]:
                assert set(b) == set(TORCH_BLOCK), kind
                for k, t in TORCH_BLOCK.items():
                    assert type(b[k]) is t, f"{kind} block {k}"
                assert b["state"] in TORCH_STATES
                states.add(b["state"])
                if b["state"] == "inactive":
                    assert b["frames"] == []
                else:  # memory_viz shows these stacks, pending frees too
                    check_frames(b["frames"], f"{kind} {b['state']} block")
        assert {"active_allocated", "active_pending_free"} <= states, kind


def cached_segments_at_end(snap: dict[str, Any], device: int = 0) -> int:
    """The bytes memory_viz's "Active Cached Segment Timeline" shows at the
    end (process_alloc_data in torch/utils/viz/MemoryViz.js, plot_segments):
    a segment_alloc opens a segment of its size, a segment_free closes it,
    and a segment of the snapshot that no segment_alloc opened was there
    from the start, with its size at the dump. segment_map/unmap are not
    drawn."""
    opened: dict[int, int] = {}
    for e in snap["device_traces"][device]:
        if e["action"] == "segment_alloc":
            opened[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            opened.pop(e["addr"], None)
    from_start = sum(s["total_size"] for s in snap["segments"] if s["device"] == device and s["address"] not in opened)
    return from_start + sum(opened.values())


def test_memory_viz_segment_timeline_shows_the_reserve(ours) -> None:
    for kind, snap in ours.items():
        reserved = sum(s["total_size"] for s in snap["segments"])
        assert cached_segments_at_end(snap) == reserved, kind
    # what it showed for an expandable segment traced as segment_alloc then
    # segment_maps: the first mapping only
    grown = {"device_traces": [[{"action": "segment_alloc", "addr": 0, "size": 34 * MiB},
                                {"action": "segment_map", "addr": 34 * MiB, "size": 1900 * MiB}]],
             "segments": [{"device": 0, "address": 0, "total_size": 1934 * MiB}]}
    assert cached_segments_at_end(grown) == 34 * MiB


def test_a_merged_snapshot_keeps_record_streams_in_place() -> None:
    gmp.record_history(True, max_entries=1000, stacks=True)
    try:
        with gmp.MemPool("sim", name="m1", manual_events=True) as p1, \
                gmp.MemPool("sim", name="m2", manual_events=True) as p2:
            x = p1.alloc(100)
            y = p2.alloc(100)
            p2.record_stream(y, 5)
            p1.record_stream(x, 6)
            p1.free(x)
            p2.free(y)
            snap = gmp.snapshot()
            tr = from_history(snap)
    finally:
        gmp.record_history(False)
    (aside,) = snap["gpumempool_record_stream"]
    assert [e["stream"] for e in aside] == [5, 6]
    trace = snap["device_traces"][0]
    for e in aside:
        nxt = trace[e["gpumempool_index"]:]
        same_pool = [x for x in nxt if x["gpumempool_pool_handle"] == e["gpumempool_pool_handle"]]
        assert same_pool[0]["action"] == "free_requested" and same_pool[0]["addr"] == e["addr"]
    assert sum(type(ev) is RecordStream for ev in tr.events) == 2
    assert tr.meta["deferred_frees"] == 2 and tr.meta["record_stream_entries"] == 2


def test_our_pickle_replays_with_its_record_streams(tmp_path) -> None:
    with gmp.MemPool("sim", name="pick", capacity=1 << 30, manual_events=True) as pool:
        pool.record_history(True)
        live = workload(pool)
        direct = from_history(pool)
        path = tmp_path / "ours.pickle"
        gmp.dump_snapshot(str(path), pool.snapshot())
        for p in live:
            pool.free(p)
        pool.sim.complete()
    loaded = from_torch_snapshot(path)
    assert loaded.meta["source"] == "gpumempool"  # recognised: not taken for torch's
    assert loaded.events == direct.events
    assert loaded.meta["record_stream_entries"] == 2 and loaded.meta["deferred_frees"] == 2
    # the same without allocator_settings: the aside list alone says it is ours
    snap = load_pickle(path)
    del snap["allocator_settings"]
    assert from_torch_snapshot(snap).meta["source"] == "gpumempool"


@pytest.mark.parametrize("bad, why", [
    ("x", "gpumempool_record_stream must be a list per device"),
    ([[{"action": "record_stream", "addr": 1, "size": 1, "stream": 1}]], "gpumempool_index must be an int"),
    ([[{"addr": 1, "gpumempool_index": 99}]], "gpumempool_index must be an int from 0 to"),
    ([[{"addr": -1, "gpumempool_index": 0}]], r"gpumempool_record_stream\[0\]\[0\]: addr must be a non-negative int"),
])
def test_a_bad_record_stream_list_is_one_clear_error(bad: Any, why: str) -> None:
    trace = [{"action": "alloc", "addr": 1, "size": 512, "stream": 0},
             {"action": "free_requested", "addr": 1, "size": 512, "stream": 0},
             {"action": "free_completed", "addr": 1, "size": 512, "stream": 0}]
    snap = {"segments": [], "device_traces": [trace], "gpumempool_record_stream": bad}
    with pytest.raises(TraceFormatError, match=why) as ei:
        from_torch_snapshot(snap)
    assert "\n" not in str(ei.value)


def test_cache_calls_are_kept_aside_and_read_back_in_place() -> None:
    """The engine's empty_cache and trim entries sit beside device_traces
    (memory_viz knows no such action), each at its place; a merged
    snapshot of several pools keeps them, a dumped one too, and the
    importers read them back as e and t where they were made."""
    from gpumempool.trace import EmptyCache, Trim

    with gmp.MemPool("sim", name="a", capacity=1 << 30) as a, gmp.MemPool("sim", name="b", capacity=1 << 30) as b:
        for p in (a, b):
            p.record_history(True)
        a.free(a.alloc(3 * MiB))
        a.trim(MiB, device=0)
        b.free(b.alloc(MiB))
        b.empty_cache()
        one = a.snapshot()
        assert all(e["action"] not in ("empty_cache", "trim") for t in one["device_traces"] for e in t)
        (trim,) = one["gpumempool_cache_calls"][0]
        # after the five entries of the block, its segment and the segment's release by the trim
        assert (trim["action"], trim["keep"], trim["every_device"], trim["gpumempool_index"]) == ("trim", MiB, False, 5)
        assert one["device_traces"][0][4]["action"] == "segment_free"
        assert [type(e) for e in from_history(one).events][-1:] == [Trim]
        both = gmp.snapshot()
        assert [c["action"] for c in both["gpumempool_cache_calls"][0]] == ["trim", "empty_cache"]
        tr = from_history(both)
        assert [e for e in tr.events if type(e) in (Trim, EmptyCache)] == [Trim(MiB, 0), EmptyCache()]
        # each after the frees of its pool's block: at the place recorded
        kinds = [type(e).__name__ for e in tr.events]
        assert kinds.index("Trim") > 1 and kinds[-1] == "EmptyCache"
        # a pickle of ours imports as from_history does
        assert from_torch_snapshot(pickle.dumps(both)).events == tr.events


@pytest.mark.parametrize("bad, why", [
    ("x", "gpumempool_cache_calls must be a list per device"),
    ([[{"action": "trim", "keep": 1}]], "gpumempool_index must be an int"),
    ([[{"action": "resize", "gpumempool_index": 0}]], "action must be 'empty_cache' or 'trim'"),
    ([[{"action": "trim", "keep": -1, "gpumempool_index": 0}]], r"gpumempool_cache_calls\[0\]\[0\]: keep must be"),
    ([[{"action": "trim", "gpumempool_index": 0, "time_us": "x"}]], "time_us must be a number"),
])
def test_a_bad_cache_calls_list_is_one_clear_error(bad: Any, why: str) -> None:
    trace = [{"action": "alloc", "addr": 1, "size": 512, "stream": 0},
             {"action": "free_requested", "addr": 1, "size": 512, "stream": 0},
             {"action": "free_completed", "addr": 1, "size": 512, "stream": 0}]
    snap = {"segments": [], "device_traces": [trace], "gpumempool_cache_calls": bad}
    with pytest.raises(TraceFormatError, match=why) as ei:
        from_torch_snapshot(snap)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("empty_cache", [False, True])
def test_expandable_snapshot_replays_to_the_recorded_peak(empty_cache: bool) -> None:
    """Traced by mappings alone, our expandable segments replay as recorded
    (with the empty_cache() call the engine recorded)."""
    with gmp.MemPool("sim", name="exp", capacity=1 << 30, manual_events=True, expandable=True) as pool:
        pool.record_history(True)
        held = []
        for i in range(12):
            held.append(pool.alloc((7 + 5 * i) * MiB, stream=0 if i % 4 else 3))
            if i % 3 == 2:
                pool.free(held.pop(0))
        if empty_cache:
            pool.empty_cache()
        for p in held[::2]:
            pool.free(p)
        held.append(pool.alloc(90 * MiB))
        recorded = pool.stats()["reserved_bytes.all.peak"]
        tr = from_history(pool, infer_empty_cache=empty_cache)
        for p in held[1::2] + held[-1:]:
            pool.free(p)
    assert tr.recorded_peak_reserved() == recorded
    # The engine records the empty_cache() call itself: taken from its
    # history, not inferred from the unmaps (which would add a second one).
    assert tr.counts()["empty_cache"] == int(empty_cache)
    assert tr.meta.get("recorder_calls", 0) == int(empty_cache)
    assert "inferred_empty_cache" not in tr.meta
    assert replay(tr, {"expandable": True}).peak_reserved == recorded


def test_demo_runs_on_the_default_stream_and_a_side_stream(tmp_path) -> None:
    path = tmp_path / "demo.pickle"
    run_demo(steps=3, layers=2, progress=False, snapshot=str(path))
    snap = load_pickle(path)
    assert (COMPUTE_STREAM, COMM_STREAM) == (0, 1)
    assert {e["stream"] for e in entries(snap)} == {0}
    assert {e["stream"] for e in snap["gpumempool_record_stream"][0]} == {1}
    for e in entries(snap):
        check_frames(e["frames"], e["action"])
    assert any(f["filename"].endswith("demo.py") for f in next(entries(snap))["frames"])


# -- against snapshots torch wrote on real GPUs ------------------------------


@pytest.fixture(scope="module")
def external() -> dict[str, Any]:
    files = sorted(EXTERNAL.glob("*.pickle")) if EXTERNAL.is_dir() else []
    if not files:
        pytest.skip("../shared/traces-external is not here")
    keys: dict[str, list[set[str]]] = defaultdict(list)  # action -> key set of each modern entry kind
    seen: dict[str, set[str]] = defaultdict(set)  # action -> every key seen
    types: dict[tuple[str, str], set[str]] = defaultdict(set)
    segment_keys: list[set[str]] = []
    block_keys: list[set[str]] = []
    segment_types: dict[str, set[str]] = defaultdict(set)
    block_types: dict[str, set[str]] = defaultdict(set)
    frame_keys: set[tuple[str, ...]] = set()
    frame_types: dict[str, set[str]] = defaultdict(set)
    for path in files:
        snap = load_pickle(path)
        for e in (e for t in snap["device_traces"] for e in t):
            seen[e["action"]] |= set(e)
            if "time_us" in e:  # torch >= 2.1, which our format follows
                keys[e["action"]].append(set(e))
            for k, v in e.items():
                types[(e["action"], k)].add(type_name(v))
            for f in e.get("frames", [])[:3]:
                frame_keys.add(tuple(sorted(f)))
                for k, v in f.items():
                    frame_types[k].add(type_name(v))
        for s in snap["segments"]:
            if "is_expandable" in s:  # the segments of torch >= 2.1
                segment_keys.append(set(s))
                for k, v in s.items():
                    segment_types[k].add(type_name(v))
                for b in s["blocks"]:
                    block_keys.append(set(b))
                    for k, v in b.items():
                        block_types[k].add(type_name(v))
    return {"keys": keys, "seen": seen, "types": types, "segment_keys": segment_keys, "block_keys": block_keys,
            "segment_types": segment_types, "block_types": block_types, "frame_keys": frame_keys,
            "frame_types": frame_types}


def test_the_table_agrees_with_torchs_snapshots(external) -> None:
    assert set(external["seen"]) <= TORCH_ACTIONS
    for action, key_sets in external["keys"].items():
        schema = torch_entry_schema(action)
        for ks in key_sets:
            assert ks - {"frames"} <= set(schema) | set(TORCH_ENTRY_OPTIONAL), action
    assert set.intersection(*external["segment_keys"]) == set(TORCH_SEGMENT)
    assert set.intersection(*external["block_keys"]) == set(TORCH_BLOCK)
    assert external["frame_keys"] == {tuple(sorted(TORCH_FRAME))}


def test_our_snapshots_match_torchs_snapshots(ours, external) -> None:
    for kind, snap in ours.items():
        for e in entries(snap):
            a = e["action"]
            where = f"{kind} {a}"
            assert a in external["seen"], f"{where}: an action torch's snapshots lack"
            # what every torch since 2.1 writes (later versions add keys)
            required = set.intersection(*external["keys"][a]) - set(TORCH_ENTRY_OPTIONAL)
            assert required <= set(e), f"{where}: lacks {required - set(e)}"
            assert torch_keys(e) <= external["seen"][a], f"{where}: {torch_keys(e) - external['seen'][a]} unprefixed"
            for k in torch_keys(e):
                assert type_name(e[k]) in external["types"][(a, k)], f"{where}: {k} is {type_name(e[k])}"
            for f in e["frames"]:
                assert tuple(sorted(f)) in external["frame_keys"]
                assert all(type_name(v) in external["frame_types"][k] for k, v in f.items())
        for s in snap["segments"]:
            assert torch_keys(s) == set.intersection(*external["segment_keys"]), kind
            for k in torch_keys(s):
                assert type_name(s[k]) in external["segment_types"][k], f"{kind} segment {k}"
            for b in s["blocks"]:
                assert torch_keys(b) == set.intersection(*external["block_keys"]), kind
                for k in b:
                    assert type_name(b[k]) in external["block_types"][k], f"{kind} block {k}"


def test_torchs_expandable_snapshot_is_traced_as_ours() -> None:
    path = EXTERNAL / "Constructor-Sun_memory_snapshot_52e52b2.pickle"
    if not path.is_file():
        pytest.skip("../shared/traces-external is not here")
    snap = load_pickle(path)
    assert all(s["is_expandable"] for s in snap["segments"])
    actions = {e["action"] for e in entries(snap)}
    assert "segment_map" in actions and not actions & {"segment_alloc", "segment_free"}
    # which is why memory_viz shows its whole reserve: so it must ours
    for d in range(len(snap["device_traces"])):
        reserved = sum(s["total_size"] for s in snap["segments"] if s["device"] == d)
        assert cached_segments_at_end(snap, d) == reserved


def test_pickled_snapshot_round_trips(ours, tmp_path) -> None:
    path = tmp_path / "s.pickle"
    gmp.dump_snapshot(str(path), ours["expandable"])
    assert pickle.loads(path.read_bytes()) == ours["expandable"]
    # frames are shared, as in torch's pickles: one copy of each
    assert len(path.read_bytes()) < 200 * len(list(entries(ours["expandable"]))) + 100_000
