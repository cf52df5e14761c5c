"""tune for the settings people have: the recorded run's own settings as a
candidate and the baseline, --exclude, --limit as a fraction or inferred
from the recording, the variable the modelled torch reads, GMLake's
fragmentation ratio, the first failing event with its recorded stack, and
--min-capacity."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gpumempool as gmp
from gpumempool.replay import DEFAULT_CAPACITY, replay
from gpumempool.trace import Alloc, Free, Trace, from_torch_snapshot
from gpumempool.tune import OPTION_NAMES, alloc_conf

ROOT = Path(__file__).resolve().parent.parent
EXTERNAL = ROOT.parent / "shared" / "traces-external"
CONSTRUCTOR_SUN = EXTERNAL / "Constructor-Sun_memory_snapshot_52e52b2.pickle"
MiB = 1 << 20


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumempool", "tune", "--no-progress", "--jobs", "1", *args],
                          capture_output=True, text=True, timeout=300, cwd="/")


def sizes_trace(meta: dict[str, Any]) -> Trace:
    """39 blocks of 2, 4 and 6 MiB held at once, then freed: powers of two
    and their sums, which rounding to 2 divisions leaves as they are."""
    events: list[Any] = [Alloc(i, 2 * MiB * (1 + i % 3)) for i in range(1, 40)]
    events += [Free(i) for i in range(1, 40)]
    return Trace(events, meta)


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.split("|")]


# ---- 1. the recorded settings: a candidate, the baseline, the floor ----


def test_the_recorded_settings_are_the_baseline_and_kept_when_nothing_beats_them() -> None:
    r = gmp.tune(sizes_trace({"recorded_policy": {"roundup_power2_divisions": 2}, "recorded_by": "torch"}),
                 jobs=1)
    assert r.recorded is not None and r.recorded.recorded and r.recorded.settings == {"roundup_power2_divisions": 2}
    assert r.baseline is r.recorded and r.baseline_name == "recorded"
    # the defaults replay to the same figures: the recorded settings stay the answer
    assert r.default.peak_reserved == r.recorded.peak_reserved
    assert r.best is r.recorded
    table = r.table()
    assert "vs recorded" in table.splitlines()[0]
    rec_row = next(ln for ln in table.splitlines() if "(recorded)" in ln)
    head = cells(table.splitlines()[0])
    assert cells(rec_row)[head.index("settings")] == "roundup_power2_divisions=2"
    assert cells(rec_row)[head.index("vs recorded")] == "1.000"
    assert r.as_dict()["best_is_recorded"] is True and r.as_dict()["baseline"] == "recorded"


def test_without_a_recording_the_baseline_is_the_default() -> None:
    r = gmp.tune(sizes_trace({}), jobs=1, extra=False)
    assert r.recorded is None and r.baseline is r.default
    assert "vs default" in r.table().splitlines()[0]


def test_recorded_roundup_per_interval_is_said_as_torch_reads_it() -> None:
    per_size = [4] * 3 + [8] * 13
    assert alloc_conf({"roundup_power2_divisions": per_size}) == (
        "roundup_power2_divisions:[1:4,2:4,4:4,8:8,16:8,32:8,64:8,128:8,256:8,512:8,1024:8,2048:8,4096:8,8192:8,"
        "16384:8,32768:8]")
    r = gmp.tune(sizes_trace({"recorded_policy": {"roundup_power2_divisions": per_size}, "recorded_by": "torch"}),
                 jobs=1, extra=False)
    assert r.recorded is not None and r.recorded.torch
    assert r.recorded.settings == {"roundup_power2_divisions": tuple(per_size)}


@pytest.mark.skipif(not CONSTRUCTOR_SUN.exists(), reason="../shared/traces-external is not here")
def test_constructor_sun_recorded_expandable_segments_is_a_candidate_and_the_floor() -> None:
    # Recorded with expandable_segments:True; before, tune recommended
    # max_split_size_mb:512 above what that setting replays to.
    r = gmp.tune(CONSTRUCTOR_SUN, jobs=1)
    assert r.recorded is not None and r.recorded.settings == {"expandable": True}
    assert r.recorded in r.candidates and r.recorded.complete
    assert r.best.peak_reserved <= r.recorded.peak_reserved
    # The run ran out of memory on device 1 (78.51 GiB, its reserved plus
    # free bytes at the OOM): the request torch could not serve fails again
    # under every setting, so none fits the device it had (exit status 1).
    assert not r.best.fits and r.recorded.result.ooms == 1
    p = run_cli(str(CONSTRUCTOR_SUN), "--json", "--no-extra")
    assert p.returncode == 1, p.stderr
    d = json.loads(p.stdout)
    assert d["recorded"]["settings"] == {"expandable": True} and d["recorded"]["recorded"] is True
    assert d["best"]["peak_reserved"] <= d["recorded"]["peak_reserved"]
    assert d["baseline"] == "recorded"


@pytest.mark.skipif(not CONSTRUCTOR_SUN.exists(), reason="../shared/traces-external is not here")
def test_constructor_sun_says_when_the_recorded_setting_is_already_the_best() -> None:
    p = run_cli(str(CONSTRUCTOR_SUN), "--no-extra")
    assert p.returncode == 1, p.stderr  # nothing fits the device the run had (above)
    assert "no setting fits that device" in p.stdout
    r = gmp.tune(CONSTRUCTOR_SUN, jobs=1, extra=False)
    if r.best.recorded:
        assert "best: the recorded settings already; no setting tried does better" in p.stdout
    else:
        assert r.best.peak_reserved < r.recorded.peak_reserved  # type: ignore[union-attr]
        assert "no torch setting fits this run in the simulated 78.51 GiB device" in p.stdout
    assert "recorded settings: " in p.stdout and "expandable_segments:True" in p.stdout


def test_a_torch_snapshots_settings_are_read_as_torch_writes_them() -> None:
    # torch keys roundup_power2_divisions by each interval's first size in
    # MiB, and says max_non_split_rounding_mb only in its setting string
    settings = {"expandable_segments": False, "max_split_size": 512 * MiB,
                "roundup_power2_divisions": {str(1 << i): 4 if i < 3 else 8 for i in range(16)},
                "PYTORCH_ALLOC_CONF": "max_split_size_mb:512,max_non_split_rounding_mb:256"}
    snap = dict(snapshot_with_stacks(), allocator_settings=settings)
    trace = from_torch_snapshot(snap)
    assert trace.meta["recorded_policy"] == {"max_split_size": 512 * MiB,
                                             "roundup_power2_divisions": [4, 4, 4] + [8] * 13,
                                             "max_non_split_rounding_size": 256 * MiB}
    r = gmp.tune(trace, jobs=1, extra=False)
    assert r.recorded is not None and r.recorded.alloc_conf == (
        "max_split_size_mb:512,roundup_power2_divisions:[1:4,2:4,4:4,8:8,16:8,32:8,64:8,128:8,256:8,512:8,1024:8,"
        "2048:8,4096:8,8192:8,16384:8,32768:8],max_non_split_rounding_mb:256")
    assert r.best.peak_reserved <= r.recorded.peak_reserved


# ---- 3. --exclude ----


def test_excluded_options_are_not_searched() -> None:
    trace = sizes_trace({})
    r = gmp.tune(trace, jobs=1, exclude="expandable_segments")
    assert r.excluded == ["expandable"]
    assert not any("expandable" in c.settings for c in r.candidates)
    assert any("max_split_size" in c.settings for c in r.candidates)
    r = gmp.tune(trace, jobs=1, extra=False, exclude=["max_split_size_mb,roundup_power2_divisions", "expandable"])
    assert r.excluded == ["max_split_size", "roundup_power2_divisions", "expandable"]
    assert all(not c.settings for c in r.candidates)  # nothing left but the defaults


def test_an_excluded_recorded_setting_stays_the_baseline_but_is_not_recommended() -> None:
    r = gmp.tune(sizes_trace({"recorded_policy": {"expandable": True}, "recorded_by": "torch"}), jobs=1,
                 exclude=["expandable_segments"])
    assert r.recorded is not None and r.recorded.settings == {"expandable": True}
    assert "expandable" not in r.best.settings
    assert all("expandable" not in c.settings for c in r.top(10, torch=None))
    assert any("excluded option" in n for n in r.notes)


def test_unknown_options_to_exclude_are_one_line_naming_the_valid_ones() -> None:
    with pytest.raises(gmp.InvalidArgumentError, match="unknown option 'bogus'; valid: expandable_segments, "):
        gmp.tune(sizes_trace({}), exclude="bogus")
    p = run_cli(str(ROOT / "benchmarks" / "traces" / "cnn-train.trace.gz"), "--exclude", "max_split_size_mb",
                "--exclude", "bogus")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "unknown option 'bogus'" in p.stderr and all(name in p.stderr for name in OPTION_NAMES)


# ---- 4. --limit as a fraction, or the recorded capacity ----


def test_a_fraction_limit_is_a_share_of_the_device() -> None:
    trace = sizes_trace({"capacity": 400 * MiB})
    r = gmp.tune(trace, limit=0.5, jobs=1, extra=False)
    assert r.limit == 200 * MiB and r.limit_source == "fraction 0.5 of 400.00 MiB (the trace's device)"
    # without a device in the trace: the replay's default 80 GiB
    r = gmp.tune(sizes_trace({}), limit=0.25, jobs=1, extra=False)
    assert r.limit == DEFAULT_CAPACITY // 4 and "of 80.00 GiB (the replay's default device" in r.limit_source
    with pytest.raises(gmp.InvalidArgumentError, match=r"in \(0, 1\]"):
        gmp.tune(trace, limit=1.5)
    with pytest.raises(gmp.InvalidArgumentError, match=r"limit 40.00 MiB \(fraction 0.1 of 400.00 MiB"):
        gmp.tune(trace, limit=0.1)  # below the 160 MiB the run holds at once


def test_the_recorded_capacity_is_the_limit_unless_one_is_given(tmp_path: Path) -> None:
    meta = {"recorded_conditions": {"capacity": 200 * MiB}}
    r = gmp.tune(sizes_trace(meta), jobs=1, extra=False)
    assert r.limit == 200 * MiB and r.limit_source == "inferred from the recording"
    assert r.default.result.policy.get("limit") == 200 * MiB
    r = gmp.tune(sizes_trace(meta), limit=300 * MiB, jobs=1, extra=False)
    assert r.limit == 300 * MiB and r.limit_source == "given"
    path = tmp_path / "recorded.trace.gz"
    sizes_trace(meta).save(path)
    p = run_cli(str(path), "--no-extra")
    assert p.returncode == 0, p.stderr
    assert "limit 200.00 MiB (inferred from the recording) on each device" in p.stdout
    p = run_cli(str(path), "--no-extra", "--limit", "0.9")
    assert "limit 180.00 MiB (fraction 0.9 of 200.00 MiB (the recorded device)) on each device" in p.stdout
    p = run_cli(str(path), "--limit", "2.5")
    assert p.returncode == 2 and "--limit: a fraction of the device must be in (0, 1]" in p.stderr


# ---- 5. the variable the modelled torch reads ----


def test_the_variable_is_the_one_that_torch_reads_with_the_2_9_pitfall(tmp_path: Path) -> None:
    trace = sizes_trace({})
    new = gmp.tune(trace, jobs=1, extra=False, torch_version="2.11")
    assert new.env_var == "PYTORCH_ALLOC_CONF" and new.pitfall is None
    old = gmp.tune(trace, jobs=1, extra=False, torch_version="2.9")
    # 2.9 was not judged: its rules are 2.5's, its variable its own
    assert old.torch_version == "2.5" and old.torch_target == "2.9"
    assert old.env_var == "PYTORCH_CUDA_ALLOC_CONF"
    assert old.pitfall is not None and "pytorch/pytorch#183387" in old.pitfall
    assert old.as_dict()["pitfall"] == old.pitfall
    # a run that expandable segments fit in 110 MiB (the defaults do not)
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snapshot_with_stacks()))
    p = run_cli(str(path), "--torch-version", "2.9", "--limit", "110MiB", "--no-extra")
    assert p.returncode == 0, p.stderr
    assert "\n  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n" in p.stdout
    assert "torch 2.9.1 reads PYTORCH_ALLOC_CONF too, but silently ignores expandable_segments" in p.stdout
    p = run_cli(str(path), "--torch-version", "2.11", "--limit", "110MiB", "--no-extra")
    assert "\n  PYTORCH_ALLOC_CONF=expandable_segments:True\n" in p.stdout and "2.9.1" not in p.stdout


# ---- 6. GMLake's fragmentation ratio ----


def test_fragmentation_ratio_is_one_minus_allocated_over_reserved() -> None:
    # one 3 MiB block in torch's 20 MiB segment: 1 - 3/20
    r = gmp.tune(Trace([Alloc(1, 3 * MiB), Free(1)], {}), jobs=1, extra=False)
    assert r.default.result.peak_reserved == 20 * MiB
    assert r.default.fragmentation_ratio == pytest.approx(0.85)
    assert r.default.as_dict()["fragmentation_ratio"] == pytest.approx(0.85)
    header = r.table().splitlines()[0]
    assert "frag ratio" in header
    row = next(ln for ln in r.table().splitlines() if "| defaults " in ln)
    assert cells(row)[cells(header).index("frag ratio")] == "0.850"


# ---- 7. the first failing event, with its recorded stack ----


LOAD = [{"name": "load_weights", "filename": "/src/model.py", "line": 10}]
STEP = [{"name": "empty_cuda", "filename": "??", "line": 0},
        {"name": "forward", "filename": "/src/train.py", "line": 42},
        {"name": "main", "filename": "/src/train.py", "line": 99}]


def snapshot_with_stacks() -> dict[str, Any]:
    """A torch snapshot: 60 MiB of weights, then five 8 MiB blocks, which
    torch's defaults put two to a 20 MiB segment: 120 MiB reserved for the
    100 MiB the run holds at once."""
    def entry(action: str, addr: int, size: int, frames: list[dict[str, Any]]) -> dict[str, Any]:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0,
                "frames": [dict(f) for f in frames]}
    events = [entry("alloc", 1 << 30, 60 * MiB, LOAD)]
    events += [entry("alloc", (2 << 30) + j * 32 * MiB, 8 * MiB, STEP) for j in range(5)]
    for j in range(5):
        events += [entry(a, (2 << 30) + j * 32 * MiB, 8 * MiB, STEP) for a in ("free_requested", "free_completed")]
    return {"segments": [], "device_traces": [events]}


def test_a_setting_that_runs_out_names_the_failing_event_and_its_stack() -> None:
    trace = from_torch_snapshot(snapshot_with_stacks())
    assert trace.frames([0])[0] == LOAD and trace.frames([3])[3] == STEP
    r = gmp.tune(trace, limit=110 * MiB, jobs=1, extra=False)
    d = r.default
    assert not d.fits
    # the fifth 8 MiB block (event 5) needs a third 20 MiB segment: 60 + 3 x 20 > 110
    assert d.first_oom_event == replay(trace, {"limit": 110 * MiB}, recorded_policy=False).first_oom_event == 5
    assert d.first_oom_frames == STEP
    assert d.as_dict()["first_oom_event"] == 5 and d.as_dict()["first_oom_frames"] == STEP
    assert r.best.fits and r.best.first_oom_frames == []


def test_the_cli_prints_the_first_failing_event_with_its_python_frames(tmp_path: Path) -> None:
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snapshot_with_stacks()))
    p = run_cli(str(path), "--limit", "110MiB", "--no-extra")
    assert p.returncode == 0, p.stderr  # expandable segments fit
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("first OOM of "))
    assert line.endswith("event 5 (alloc 8.00 MiB on device 0, stream 0) at forward (train.py:42) < main (train.py:99)")
    d = json.loads(run_cli(str(path), "--limit", "110MiB", "--no-extra", "--json").stdout)
    assert d["default"]["first_oom_frames"] == STEP


# ---- 8. --min-capacity ----


def test_min_capacity_is_the_smallest_device_that_fits() -> None:
    trace = sizes_trace({})
    r = gmp.tune(trace, jobs=1, extra=False, min_capacity=True)
    measured = [c for c in r.candidates if c.min_capacity is not None]
    assert r.default in measured and r.best in measured
    for c in measured:
        m = c.min_capacity
        assert m is not None and m % (2 * MiB) == 0
        # fits there, and not one step (2 MiB: 1 % of these sizes is less) below
        assert replay(trace, dict(c.settings, capacity=m), recorded_policy=False).ooms == 0, c.describe()
        assert replay(trace, dict(c.settings, capacity=m - 2 * MiB), recorded_policy=False).ooms > 0, c.describe()
        assert trace.peak_requested() <= m <= c.peak_reserved
    assert "fits on" in r.table().splitlines()[0]
    assert r.as_dict()["best"]["min_capacity"] == r.best.min_capacity
    # two 12 MiB blocks at once: 24 MiB under the defaults, nothing less
    two = gmp.tune(Trace([Alloc(1, 12 * MiB), Alloc(2, 12 * MiB), Free(1), Free(2)], {}), jobs=1, extra=False,
                   min_capacity=True)
    assert two.default.min_capacity == 24 * MiB


def test_min_capacity_on_the_cli_with_worker_processes(tmp_path: Path) -> None:
    path = tmp_path / "sizes.trace.gz"
    sizes_trace({}).save(path)
    p = subprocess.run([sys.executable, "-m", "gpumempool", "tune", "--no-progress", "--jobs", "2", str(path),
                        "--min-capacity", "--no-extra", "--json"], capture_output=True, text=True, timeout=300,
                       cwd="/")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    one = gmp.tune(sizes_trace({}), jobs=1, extra=False, min_capacity=True)
    assert d["default"]["min_capacity"] == one.default.min_capacity is not None
    assert d["best"]["min_capacity"] == one.best.min_capacity
