"""Snapshot pickles that cannot be replayed are refused in one line: no
history (record it first), and every malformed entry or segment, named by
file, device and index; ``--lenient`` / ``lenient=True`` leaves the
malformed ones out and says how many."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpumempool.__main__ import main
from gpumempool.trace import (Alloc, Free, MalformedEventError, MalformedSegmentError, NoHistoryError, TraceFormatError,
                              from_torch_snapshot)

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
EXTERNAL = ROOT.parent / "shared" / "traces-external"
A = 0x7F0000000000
RECORD = "record history first: torch.cuda.memory._record_memory_history()"


def e(action: str, addr: Optional[int], size: Optional[int], t: int, **kw: Any) -> dict[str, Any]:
    """An entry as torch writes it (a key given None is left out)."""
    entry = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": [], **kw}
    return {k: v for k, v in entry.items() if v is not None}


def history() -> list[dict[str, Any]]:
    return [
        e("segment_alloc", A, 2 * MiB, 1),
        e("alloc", A, 512, 2),
        e("alloc", A + 512, 1024, 3),
        e("free_requested", A, 512, 4),
        e("free_completed", A, 512, 5),
        e("free_requested", A + 512, 1024, 6),
        e("free_completed", A + 512, 1024, 7),
    ]


def snapshot(*traces: list[dict[str, Any]]) -> dict[str, Any]:
    seg = {"device": 0, "address": A, "total_size": 2 * MiB, "allocated_size": 0, "active_size": 0,
           "requested_size": 0, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
           "is_expandable": False, "frames": [],
           "blocks": [{"address": A, "size": 2 * MiB, "requested_size": 0, "state": "inactive", "frames": []}]}
    return {"segments": [seg], "device_traces": list(traces) or [history()],
            "allocator_settings": {"max_split_size": -1, "expandable_segments": False}}


def write(tmp_path: Path, snap: dict[str, Any], name: str = "snap.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snap))
    return path


def cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """main(argv) exits 1 with one line on stderr, no traceback; the line."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 1, (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m gpumempool: error: "), err
    return err


# -- no history ------------------------------------------------------------------


NO_HISTORY = {
    "empty": ([[]], "device_traces has no events"),
    "no devices": ([], "device_traces has no events"),
    "empty on two devices": ([[], []], "device_traces has no events"),
    "one event": ([[e("free_completed", A, 8 * MiB, 1)]], "a history of one event, free_completed"),
    "one alloc": ([[e("alloc", A, 512, 1)]], "a history of one event, alloc"),
    "no allocation": ([[e("free_requested", A, 512, 1), e("free_completed", A, 512, 2),
                        e("segment_free", A, 2 * MiB, 3)]], "none of its 3 events allocates"),
    "only annotations": ([[e("snapshot", 0, 0, 1), e("user_defined", 0, 0, 2)]],
                         "device_traces has 2 events, none about memory"),
}


@pytest.mark.parametrize("case", NO_HISTORY, ids=list(NO_HISTORY))
def test_a_snapshot_without_history_is_refused(tmp_path: Path, case: str) -> None:
    traces, why = NO_HISTORY[case]
    snap = snapshot()
    snap["device_traces"] = traces
    path = write(tmp_path, snap)
    for lenient in (False, True):  # nothing to leave out: refused all the same
        with pytest.raises(NoHistoryError) as ei:
            from_torch_snapshot(path, lenient=lenient)
        assert str(ei.value) == f"{path}: no allocation history to replay ({why}): {RECORD}"
        assert ei.value.file == str(path) and ei.value.reason == why
        assert isinstance(ei.value, TraceFormatError) and isinstance(ei.value, ValueError)


def test_no_device_traces_says_record_history_first() -> None:
    with pytest.raises(NoHistoryError, match="no device_traces.*" + RECORD.replace("(", r"\(").replace(")", r"\)")):
        from_torch_snapshot({"segments": []})


def test_a_snapshot_of_one_alloc_and_its_free_is_history() -> None:
    tr = from_torch_snapshot(snapshot([e("alloc", A, 512, 1), e("free_requested", A, 512, 2),
                                       e("free_completed", A, 512, 2)]))
    assert tr.events == [Alloc(1, 512, 0, 0), Free(1)]


@pytest.mark.parametrize("command", ["replay", "tune", "oracle"])
def test_cli_refuses_a_snapshot_without_history(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                command: str) -> None:
    snap = snapshot()
    snap["device_traces"] = [[]]
    path = write(tmp_path, snap)
    err = cli_error(capsys, [command, str(path), "--no-progress"])
    assert f"{path}: no allocation history to replay" in err and err.rstrip().endswith(RECORD)
    assert main([command, str(path), "--json", "--lenient"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["exit_code"] == 1 and RECORD in json.loads(out)["error"]


# -- malformed entries -------------------------------------------------------------


def _set(i: int, **kw: Any) -> Callable[[list[dict[str, Any]]], None]:
    def edit(trace: list[dict[str, Any]]) -> None:
        trace[i].update(kw)
    return edit


def _drop(i: int, key: str) -> Callable[[list[dict[str, Any]]], None]:
    def edit(trace: list[dict[str, Any]]) -> None:
        del trace[i][key]
    return edit


def _insert(i: int, entry: Any) -> Callable[[list[dict[str, Any]]], None]:
    def edit(trace: list[dict[str, Any]]) -> None:
        trace.insert(i, entry)
    return edit


# name: (edit of the history, index of the bad entry, its action as named, the reason)
MALFORMED: dict[str, tuple[Callable[[list[dict[str, Any]]], None], int, Optional[str], str]] = {
    "alloc without size": (_drop(2, "size"), 2, "alloc", "missing 'size'"),
    "alloc without addr": (_drop(1, "addr"), 1, "alloc", "missing 'addr'"),
    "segment_alloc without size": (_drop(0, "size"), 0, "segment_alloc", "missing 'size'"),
    "free_requested without size": (_drop(3, "size"), 3, "free_requested", "missing 'size'"),
    "free_completed without addr": (_drop(4, "addr"), 4, "free_completed", "missing 'addr'"),
    "size as a string": (_set(2, size="1024"), 2, "alloc", "size must be an int, got str"),
    "size as a float": (_set(2, size=1024.0), 2, "alloc", "size must be an int, got float"),
    "size as a bool": (_set(2, size=True), 2, "alloc", "size must be an int, got bool"),
    "negative size": (_set(2, size=-1024), 2, "alloc", "size must not be negative, got -1024"),
    "addr as a string": (_set(1, addr=hex(A)), 1, "alloc", "addr must be an int, got str"),
    "stream as None": (_set(1, stream=None), 1, "alloc", "stream must be an int, got NoneType"),
    "addr beyond 64 bits": (_set(1, addr=1 << 64), 1, "alloc", f"addr must be below 2**64, got {1 << 64}"),
    "time as a string": (_set(5, time_us="6"), 5, "free_requested", "time_us must be a number, got str"),
    "absurd alloc": (_set(2, size=1 << 62), 2, "alloc",
                     f"size must be at most 2**50 bytes (1 PiB, more than any device holds), got {1 << 62}"),
    "absurd segment": (_set(0, size=1 << 62), 0, "segment_alloc", "size must be at most 2**50 bytes"),
    "unknown action": (_set(3, action="release"), 3, "release", "unknown action (torch writes alloc, "),
    "odd action": (_set(3, action="x y" * 30), 3, repr("x y" * 30)[:41] + "'", "unknown action (torch writes"),
    "entry not a dict": (_insert(3, ["alloc", A, 512]), 3, None, "not an entry with an 'action'"),
    "entry without action": (_insert(3, {"addr": A, "size": 512}), 3, None, "not an entry with an 'action'"),
    "alloc at a live address": (_insert(3, e("alloc", A, 256, 3)), 3, "alloc",
                                f"alloc at {A:#x}, where the block allocated at event 1 is still live"),
    "double free": (_insert(5, e("free_requested", A, 512, 5)), 5, "free_requested",
                    f"free of the block at {A:#x}, already freed at event 3 (a double free)"),
    "completion of a live block": (_insert(3, e("free_completed", A + 512, 1024, 3)), 3, "free_completed",
                                   f"free_completed of the block at {A + 512:#x} allocated at event 2, which was "
                                   "never freed"),
}


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_a_malformed_entry_is_refused_naming_file_device_and_index(tmp_path: Path, case: str, device: int) -> None:
    edit, index, action, reason = MALFORMED[case]
    traces = [history() for _ in range(device + 1)]
    edit(traces[device])
    path = write(tmp_path, snapshot(*traces))
    with pytest.raises(MalformedEventError) as ei:
        from_torch_snapshot(path)
    what = f" ({action})" if action else ""
    assert str(ei.value).startswith(f"{path}: device {device} event {index}{what}: {reason}"), str(ei.value)
    err = ei.value
    assert (err.file, err.device, err.index) == (str(path), device, index)
    assert err.action == (None if action is None else traces[device][index]["action"]) and isinstance(err, ValueError)
    assert "\n" not in str(err)


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_lenient_leaves_a_malformed_entry_out_and_counts_it(case: str) -> None:
    edit, index, _, reason = MALFORMED[case]
    bad = history()
    edit(bad)
    # A free_requested left out leaves its free_completed, the next entry,
    # completing a live block: left out too.
    cascade = int(history()[index]["action"] == "free_requested" and len(bad) == len(history()))
    tr = from_torch_snapshot(snapshot(bad), lenient=True)
    assert tr.meta["skipped_events"] == 1 + cascade
    assert tr.meta["first_skipped"].startswith(f"device 0 event {index}") and reason in tr.meta["first_skipped"]
    # What is left is imported as a snapshot without those entries would be.
    del bad[index:index + 1 + cascade]
    assert tr.events == from_torch_snapshot(snapshot(bad)).events


def test_torchs_other_actions_and_oom_sizes_are_accepted() -> None:
    """snapshot and user_defined entries say nothing about memory; an OOM
    names the size that failed, however absurd, and has no addr."""
    trace = history()
    trace[5:5] = [e("oom", None, 1 << 62, 5, device_free=3 * MiB), e("snapshot", 0, 0, 5),
                  e("user_defined", 0, 0, 5)]
    tr = from_torch_snapshot(snapshot(trace))
    assert tr.meta["ignored_actions"] == {"snapshot": 1, "user_defined": 1} and tr.meta["recorded_ooms"] == 1
    assert "skipped_events" not in tr.meta


def test_blocks_from_before_the_trace_are_not_malformed() -> None:
    """A free of an address the trace never allocated is a block allocated
    before history was on; a lone free_completed is the end of a free
    requested before it; an address freed then allocated again is reuse."""
    P = A + MiB
    trace = [e("free_completed", A + 4096, 64, 0), e("free_requested", P, 4096, 1), e("free_completed", P, 4096, 2),
             e("alloc", P, 2048, 3), e("free_requested", P, 2048, 4), e("free_completed", P, 2048, 5),
             e("alloc", P, 1024, 6)]
    tr = from_torch_snapshot(snapshot(trace))
    assert tr.events == [Alloc(1, 4096, 0, 0), Free(1), Alloc(2, 2048, 0, 0), Free(2), Alloc(3, 1024, 0, 0)]


def test_addresses_of_different_pools_or_devices_do_not_collide() -> None:
    """The same address on two devices, or in two of our pools
    (gmp.snapshot() of sim pools), is two blocks."""
    two_devices = snapshot([e("alloc", A, 512, 1), e("alloc", A + 512, 512, 3)], [e("alloc", A, 512, 2)])
    assert len(from_torch_snapshot(two_devices)) == 3
    ours = snapshot([e("alloc", A, 512, 1, pool_handle=1), e("alloc", A, 512, 2, pool_handle=2)])
    ours["allocator_settings"] = {"pools": ["a", "b"]}
    assert len(from_torch_snapshot(ours)) == 2


def test_lenient_counts_every_malformed_entry() -> None:
    bad = history()
    bad.insert(3, e("alloc", A, 256, 3))  # at a live address
    bad[2].pop("size")
    bad.append({"action": "compact", "time_us": 9})
    tr = from_torch_snapshot(snapshot(bad), lenient=True)
    assert tr.meta["skipped_events"] == 3
    assert tr.meta["first_skipped"] == "device 0 event 2 (alloc): missing 'size'"
    # The free of the block whose alloc was left out frees nothing: a block from before the trace.
    assert tr.meta["preexisting_blocks"] == 1


def test_lenient_refuses_a_snapshot_whose_every_alloc_is_malformed() -> None:
    bad = history()
    for entry in bad:
        if entry["action"] == "alloc":
            entry["size"] = "512"
    with pytest.raises(NoHistoryError, match="none of its 5 events allocates"):
        from_torch_snapshot(snapshot(bad), lenient=True)


# -- malformed segments ---------------------------------------------------------------


def test_segments_must_be_torchs() -> None:
    snap = snapshot()
    snap["segments"][0]["blocks"] = None
    with pytest.raises(MalformedSegmentError, match=r"^<dict>: segment 0: blocks must be a list, got NoneType$") as ei:
        from_torch_snapshot(snap)
    assert (ei.value.index, ei.value.file) == (0, "<dict>")
    tr = from_torch_snapshot(snap, lenient=True)
    assert tr.meta["skipped_segments"] == 1 and tr.meta["first_skipped"].startswith("segment 0: blocks")

    for edit, why in [
        (lambda s: s.pop("total_size"), "segment 0: missing 'total_size'"),
        (lambda s: s.update(total_size="2MiB"), "segment 0: total_size must be an int, got str"),
        (lambda s: s.update(total_size=1 << 62), "segment 0: total_size must be at most 2**50 bytes"),
        (lambda s: s.update(device=-1), "segment 0: device must be an int in 0.."),
        (lambda s: s["blocks"].append(None), "segment 0: block 1 is not a dict, got NoneType"),
        (lambda s: s["blocks"][0].update(size=-4), "segment 0: block 0: size must not be negative, got -4"),
    ]:
        snap = snapshot()
        edit(snap["segments"][0])
        with pytest.raises(MalformedSegmentError) as ei:
            from_torch_snapshot(snap)
        assert str(ei.value).startswith(f"<dict>: {why}"), str(ei.value)

    snap = snapshot()
    del snap["segments"]
    with pytest.raises(MalformedSegmentError, match=r"^<dict>: no 'segments' \(torch writes them"):
        from_torch_snapshot(snap)
    tr = from_torch_snapshot(snap, lenient=True)
    assert tr.meta["first_skipped"].startswith("no 'segments'") and "skipped_segments" not in tr.meta
    snap["segments"] = {}
    with pytest.raises(MalformedSegmentError, match="segments must be a list, got dict"):
        from_torch_snapshot(snap, lenient=True)


# -- the command line -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["replay", "tune", "oracle"])
@pytest.mark.parametrize("case", ["alloc without size", "absurd alloc", "alloc at a live address", "unknown action"])
def test_cli_refuses_a_malformed_entry_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                                                   command: str) -> None:
    edit, index, action, reason = MALFORMED[case]
    bad = history()
    edit(bad)
    path = write(tmp_path, snapshot(bad))
    err = cli_error(capsys, [command, str(path), "--no-progress"])
    assert f"error: {path}: device 0 event {index} ({action}): {reason}" in err


def test_cli_refuses_in_a_fresh_process_without_a_traceback(tmp_path: Path) -> None:
    """The one-line error of the installed command, alloc without size
    (once a 22-line KeyError traceback)."""
    bad = history()
    del bad[1]["size"]
    path = write(tmp_path, snapshot(bad))
    r = subprocess.run([sys.executable, "-m", "gpumempool", "replay", str(path), "--no-progress"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"python -m gpumempool: error: {path}: device 0 event 1 (alloc): missing 'size'\n"


def test_cli_lenient_says_how_many_it_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = history()
    bad.insert(3, e("alloc", A, 256, 3))
    bad[2]["size"] = 1 << 62
    path = write(tmp_path, snapshot(bad))
    sentence = ("--lenient left out 2 malformed events; the first: device 0 event 2 (alloc): size must be at most "
                "2**50 bytes (1 PiB, more than any device holds), got 4611686018427387904")
    assert main(["replay", str(path), "--no-progress", "--lenient"]) == 0
    out, err = capsys.readouterr()
    assert "| skipped             | 2 malformed events (--lenient) " in out
    assert err == f"python -m gpumempool: warning: {sentence}\n"
    assert main(["replay", str(path), "--json", "--lenient"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"]["meta"]["skipped_events"] == 2 and out["warnings"] == [sentence]
    assert out["trace"]["meta"]["first_skipped"].startswith("device 0 event 2 (alloc)")
    assert main(["tune", str(path), "--no-progress", "--lenient"]) == 0
    assert f"\nnote: {sentence}\n" in capsys.readouterr().out
    assert main(["tune", str(path), "--json", "--lenient"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["meta"]["skipped_events"] == 2
    # Without --lenient: refused.
    assert "device 0 event 2 (alloc)" in cli_error(capsys, ["tune", str(path), "--no-progress"])


def test_cli_lenient_on_a_sound_snapshot_says_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, snapshot())
    assert main(["replay", str(path), "--no-progress", "--lenient"]) == 0
    assert "skipped" not in capsys.readouterr().out


# -- snapshots recorded by others on real GPUs -------------------------------------------


def _external(name: str) -> Path:
    path = EXTERNAL / name
    if not path.is_file():
        pytest.skip("../shared/traces-external is not here")
    return path


@pytest.mark.parametrize("name, why", [
    ("ZijianDu_memory_7e5ba32.pickle", "device_traces has no events"),
    ("Yiyi_1.3b_snapshot_6a8eab0.pickle", "a history of one event, free_completed"),
])
def test_external_snapshots_without_history_are_refused(capsys: pytest.CaptureFixture[str], name: str,
                                                        why: str) -> None:
    """ZijianDu's has 2,799 live blocks and no history: the importer made
    them 2,799 allocations, and replay reported a saving."""
    path = _external(name)
    with pytest.raises(NoHistoryError) as ei:
        from_torch_snapshot(path)
    assert str(ei.value) == f"{path}: no allocation history to replay ({why}): {RECORD}"
    for command in ("replay", "tune"):
        err = cli_error(capsys, [command, str(path), "--no-progress"])
        assert err == f"python -m gpumempool: error: {ei.value}\n"


@pytest.mark.parametrize("name", ["Constructor-Sun_memory_snapshot_52e52b2.pickle",
                                  "Maphsge4_snapshot_04d383c.pickle",
                                  "Wedsonlin_medium_512_training_memory_snapshot_8630bcf.pickle",
                                  "ZidongLiu_memory_edd30e0.pickle",
                                  "kkaitlyn111_memory_ctx512_forward_46eae3f.pickle"])
def test_external_snapshots_with_history_pass_every_check(name: str) -> None:
    tr = from_torch_snapshot(_external(name))
    assert len(tr) > 1000 and not {"skipped_events", "skipped_segments", "repaired_allocs"} & set(tr.meta)


def test_cli_lenient_takes_missing_segments_as_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = snapshot()
    del snap["segments"]
    path = write(tmp_path, snap)
    assert "no 'segments' (torch writes them" in cli_error(capsys, ["replay", str(path), "--no-progress"])
    assert main(["replay", str(path), "--no-progress", "--lenient"]) == 0
    out, err = capsys.readouterr()
    assert "| skipped             | no segments (--lenient) " in out
    assert err.startswith("python -m gpumempool: warning: --lenient: no 'segments' (torch writes them") \
        and err.endswith(": taken as none\n")
