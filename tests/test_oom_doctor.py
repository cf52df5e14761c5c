"""The out-of-memory doctor (gpumempool._oom_doctor): an out-of-memory error
with history recorded says, in one line, which allocator setting would have
fit the memory the run failed in, and writes the full answer beside the
snapshot; ``tune OOM_SNAPSHOT`` answers the same for a file."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from _torch_pythons import PYTHONS, no_torch

import gpumempool as gmp
import gpumempool.distributed as gd
import gpumempool.torch as gt
from gpumempool import _oom_doctor, _oom_snapshot, tune
from gpumempool._snapshot import history_settings
from gpumempool._oom_doctor import capacity_at_oom, last_oom
from gpumempool._units import format_bytes
from gpumempool.trace import Trace, from_torch_snapshot

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
#: The doctor's line when a setting fits: the variable, the setting, the peak.
FITS_LINE = re.compile(r"^gpumempool: with (PYTORCH_(?:CUDA_)?ALLOC_CONF)=(\S+) this run peaks at "
                       r"([\d.]+ [KMG]iB) < ([\d.]+ [KMG]iB)", re.M)


@pytest.fixture(autouse=True)
def no_snapshotter_left() -> Iterator[None]:
    yield
    active = _oom_snapshot._active
    if active is not None:
        active.close()
    assert history_settings() is None, "the doctor stops the history it turned on"


def fill_sim_pool(pool: gmp.MemPool) -> gmp.OutOfMemoryError:
    """Runs ``pool`` (a 64 MiB sim device) out of memory as torch's default
    setting would: 10 MiB segments, one freed, then 7 MiB blocks that each
    want a 20 MiB segment. Expandable segments would have fit."""
    blocks = [pool.alloc(10 * MiB) for _ in range(3)]
    pool.free(blocks[1])
    with pytest.raises(gmp.OutOfMemoryError) as info:
        for _ in range(10):
            blocks.append(pool.alloc(7 * MiB))
    for b in blocks[:1] + blocks[2:]:
        pool.free(b)
    return info.value


# ---- the capacity a snapshot ran out of memory in ----


def torch_oom_snapshot(*, device_free: int = 4 * MiB, after: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A torch snapshot of a run that ran out of memory on a 64 MiB device:
    three 20 MiB segments, each holding two 7 MiB tensors; an 8 MiB request
    then needs a fourth segment, and the device has ``device_free`` bytes
    left. Expandable segments would have fit (42 + 8 MiB allocated)."""
    base, t = 0x7F0000000000, 1000
    trace: list[dict[str, Any]] = []
    segments = []
    for s in range(3):
        seg = base + s * 32 * MiB
        t += 1
        trace.append({"action": "segment_alloc", "addr": seg, "size": 20 * MiB, "stream": 0, "time_us": t})
        blocks = []
        for b in range(2):
            t += 1
            trace.append({"action": "alloc", "addr": seg + b * 7 * MiB, "size": 7 * MiB, "stream": 0, "time_us": t})
            blocks.append({"address": seg + b * 7 * MiB, "size": 7 * MiB, "requested_size": 7 * MiB,
                           "state": "active_allocated", "frames": []})
        blocks.append({"address": seg + 14 * MiB, "size": 6 * MiB, "requested_size": 0, "state": "inactive",
                       "frames": []})
        segments.append({"device": 0, "address": seg, "total_size": 20 * MiB, "allocated_size": 14 * MiB,
                         "active_size": 14 * MiB, "requested_size": 14 * MiB, "stream": 0,
                         "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                         "frames": [], "blocks": blocks})
    trace.append({"action": "oom", "size": 8 * MiB, "device_free": device_free, "stream": 0, "time_us": t + 1})
    trace += [dict(e, time_us=t + 2 + i) for i, e in enumerate(after)]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {"expandable_segments": False}}


def test_capacity_is_reserved_plus_free_at_the_oom_entry() -> None:
    assert capacity_at_oom(torch_oom_snapshot()) == 64 * MiB
    assert capacity_at_oom(torch_oom_snapshot(device_free=0)) == 60 * MiB


def test_capacity_walks_back_what_the_history_did_after_the_oom() -> None:
    # The program went on: it freed a tensor, torch released nothing, then
    # empty_cache() returned a whole segment (the dump no longer lists it).
    snap = torch_oom_snapshot()
    gone = snap["segments"].pop()
    snap["device_traces"][0] += [{"action": "segment_free", "addr": gone["address"], "size": 20 * MiB, "stream": 0,
                                  "time_us": 5000}]
    assert capacity_at_oom(snap) == 64 * MiB


def test_a_device_with_room_means_a_limit_stopped_the_run() -> None:
    # 30 MiB free, an 8 MiB request wants a 20 MiB segment: the device had
    # room, so a memory fraction refused it; what was reserved was allowed.
    assert capacity_at_oom(torch_oom_snapshot(device_free=30 * MiB)) == 60 * MiB


def test_no_oom_no_capacity(tmp_path: Path) -> None:
    snap = torch_oom_snapshot()
    snap["device_traces"][0].pop()
    assert last_oom(snap) is None and capacity_at_oom(snap) is None
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(torch_oom_snapshot()))
    assert capacity_at_oom(path) == capacity_at_oom(str(path)) == 64 * MiB
    # a trace: what its importer recorded of the conditions, if anything
    tr = Trace([])
    assert capacity_at_oom(tr) is None
    tr.meta["recorded_conditions"] = {"capacity": 40 * MiB}
    assert capacity_at_oom(tr) is None, "memory pressure without an OOM"
    tr.meta["recorded_ooms"] = 1
    assert capacity_at_oom(tr) == 40 * MiB


def test_the_failed_request_is_put_back_where_the_oom_entry_is() -> None:
    from gpumempool.trace import Alloc, Free

    snap = torch_oom_snapshot()
    tr = from_torch_snapshot(snap)
    assert [type(e) for e in tr.events[-2:]] == [Alloc, Free] and tr.events[-2].size == 8 * MiB
    assert tr.meta["failed_requests"] == 1
    # with it, the run does not fit the 64 MiB it had under torch's defaults (as it did not)
    assert gmp.replay(tr).ooms == 1 and gmp.replay(tr).capacity == 64 * MiB
    assert gmp.replay(tr, {"expandable": True}).ooms == 0


# ---- the doctor in a process that runs out of memory (sim backend) ----


def test_sim_pool_oom_prints_the_setting_that_fits_and_writes_the_answer(tmp_path: Path,
                                                                           capfd: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # snapshot_on_oom's "snapshot written" warning
        doctor = gt.oom_doctor(tmp_path, time_limit_s=60)
        assert gt.oom_doctor(tmp_path, time_limit_s=60) is doctor, "a second call keeps the doctor installed"
        with gmp.MemPool("sim", name="doctor-sim", capacity=64 * MiB) as pool:  # history: turned on by the doctor
            err = fill_sim_pool(pool)
    assert type(err) is gmp.OutOfMemoryError and 'pool "doctor-sim"' in str(err), "the error reaches the program"
    err_out = capfd.readouterr().err
    snap = str(tmp_path / "rank00000-oom1.pickle")
    m = FITS_LINE.search(err_out)
    assert m is not None, err_out
    assert m.group(2) == "expandable_segments:True" and m.group(4) == "64.0 MiB"
    assert f"python -m gpumempool tune {snap} for details" in err_out
    assert len([ln for ln in err_out.splitlines() if ln.startswith("gpumempool: with ")]) == 1
    [diag] = doctor.diagnoses
    assert diag.snapshot == snap and diag.capacity == 64 * MiB and diag.fits and not diag.partial
    assert diag.settings == {"expandable": True} and diag.peak_reserved is not None
    assert m.group(3) == format_bytes(diag.peak_reserved, 1) and diag.peak_reserved < 64 * MiB
    answer = json.loads(Path(str(diag.json_path)).read_text())
    assert answer["capacity"] == 64 * MiB and answer["limit"] == 64 * MiB and answer["snapshot"] == snap
    assert answer["best"]["alloc_conf"] == "expandable_segments:True" and answer["best"]["fits"] is True
    assert answer["default"]["fits"] is False, "torch's defaults fail, as the run did"
    assert answer["line"] == diag.line and answer["env_var"] == m.group(1)
    text = Path(str(diag.text_path)).read_text()
    assert text.startswith(diag.line) and "(does not fit)" in text and "expandable=true" in text
    doctor.close()
    assert _oom_snapshot._active is None


def test_snapshot_on_oom_runs_the_doctor_too(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with gmp.MemPool("sim", name="doctor-dist", capacity=64 * MiB) as pool:
        pool.record_history(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with gd.snapshot_on_oom(tmp_path, doctor_time_limit_s=60) as snaps:
                fill_sim_pool(pool)
    assert FITS_LINE.search(capfd.readouterr().err)
    assert [d.fits for d in snaps.diagnoses] == [True]
    assert os.path.isfile(tmp_path / "rank00000-oom1-tune.json")


def test_without_history_snapshot_on_oom_says_nothing_and_the_doctor_says_why(tmp_path: Path,
                                                                            capfd: pytest.CaptureFixture[str]) -> None:
    with gmp.MemPool("sim", name="doctor-none", capacity=64 * MiB) as pool:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with gd.snapshot_on_oom(tmp_path / "a") as snaps:
                fill_sim_pool(pool)
            assert capfd.readouterr().err == "" and [d.error for d in snaps.diagnoses] == ["no history"]
            with gt.oom_doctor(tmp_path / "b", record_history=False) as doctor:
                fill_sim_pool(pool)
    assert capfd.readouterr().err.strip() == (
        "gpumempool: out of memory, and no allocator history was recorded to tune: "
        "torch.cuda.memory._record_memory_history() (or gmp.record_history()) before it")
    assert [d.error for d in doctor.diagnoses] == ["no history"]


def test_a_request_larger_than_the_device_is_said_so(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with gmp.MemPool("sim", name="doctor-big", capacity=64 * MiB) as pool:
        pool.record_history(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with gd.snapshot_on_oom(tmp_path) as snaps:
                keep = pool.alloc(40 * MiB)
                with pytest.raises(gmp.OutOfMemoryError):
                    pool.alloc(30 * MiB)
                pool.free(keep)
    assert capfd.readouterr().err.strip() == (
        "gpumempool: no setting searched fits 64.0 MiB; the run holds 70.0 MiB allocated at once on the device "
        "(the failed request included), more than it has: no allocator setting can help")
    assert snaps.diagnoses[0].fits is False
    assert json.loads((tmp_path / "rank00000-oom1-tune.json").read_text())["lower_bound"] == 70 * MiB


def test_a_failing_doctor_is_one_line_and_the_error_is_unchanged(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the tuner broke")

    monkeypatch.setattr(tune, "tune", broken)
    with gmp.MemPool("sim", name="doctor-broken", capacity=64 * MiB) as pool:
        pool.record_history(True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not even warnings as errors replace the out-of-memory error
            with gd.snapshot_on_oom(tmp_path) as snaps:
                err = fill_sim_pool(pool)
    assert type(err) is gmp.OutOfMemoryError
    snap = tmp_path / "rank00000-oom1.pickle"
    lines = capfd.readouterr().err.splitlines()
    assert f"gpumempool: the out-of-memory doctor could not tune {snap}: RuntimeError: the tuner broke" in lines
    assert snaps.diagnoses[0].error == "RuntimeError: the tuner broke"


def test_bad_doctor_time_limit(tmp_path: Path) -> None:
    for bad in (0, -1, True, "30"):
        with pytest.raises(ValueError, match="time limit"):
            gd.snapshot_on_oom(tmp_path, doctor_time_limit_s=bad)  # type: ignore[arg-type]


# ---- tune's time bound ----


def test_tune_stops_at_its_deadline_with_the_best_so_far() -> None:
    # In this process: the deadline is checked between replays.
    trace = ROOT / "benchmarks" / "traces" / "gpt2-train.trace.gz"
    full = tune.tune(trace, jobs=1, extra=False)
    assert not full.partial and not full.as_dict()["partial"]
    part = tune.tune(trace, jobs=1, extra=False, deadline_s=full.seconds / 2)
    assert part.partial and part.as_dict()["partial"] is True
    assert 2 <= part.replays < full.replays and part.seconds < full.seconds
    assert part.best.peak_reserved >= full.best.peak_reserved
    with pytest.raises(TimeoutError, match="not even torch's defaults"):
        tune.tune(trace, jobs=1, deadline_s=1e-9)
    with pytest.raises(gmp.InvalidArgumentError, match="deadline_s"):
        tune.tune(trace, deadline_s=0)


def test_tune_in_workers_stops_them_at_its_deadline() -> None:
    # The deadline passes once the first two replays are in (progress waits
    # for it): the replays then under way are stopped with their workers.
    trace = ROOT / "benchmarks" / "traces" / "gpt2-train.trace.gz"
    deadline = 5.0
    start = time.perf_counter()
    first: list[float] = []

    def progress(done: int, total: int) -> None:
        if done == 2 and not first:  # the defaults and expandable segments, replayed in full first
            first.append(time.perf_counter() - start)
            time.sleep(max(0.0, start + deadline + 0.1 - time.perf_counter()))

    part = tune.tune(trace, jobs=2, extra=False, deadline_s=deadline, progress=progress)
    took = time.perf_counter() - start
    assert first and first[0] < deadline, "the first two replays took longer than the deadline: a slow machine"
    assert part.partial and part.replays == 2 and part.best.fits
    assert took < deadline + 5, "the search ends at the deadline"


# ---- python -m gpumempool tune OOM_SNAPSHOT ----


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "gpumempool", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT.parent)


def test_cli_tune_of_an_oom_snapshot_says_what_fits_the_device_it_failed_on(tmp_path: Path) -> None:
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(torch_oom_snapshot()))
    p = run_cli("tune", str(path), "--no-progress", "--jobs", "2", "--torch-version", "2.11")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "out of memory: the run failed on a device with 64.00 MiB for it" in out
    assert "best torch setting: " in out and "torch's defaults do not fit (1 allocation(s) fail)" in out
    fit = out[out.index("would have fit in 64.00 MiB (the device it failed on):"):].splitlines()[1:]
    rows = {m.group(2): m.group(1) for m in (re.match(r"  (yes|no) +(.+?): [\d.]+ [KMG]?i?B peak", ln) for ln in fit)
            if m}
    assert rows["PYTORCH_ALLOC_CONF=expandable_segments:True"] == "yes"
    assert rows["torch's defaults"] == "no"
    p = run_cli("tune", str(path), "--no-progress", "--jobs", "2", "--torch-version", "2.11", "--json")
    answer = json.loads(p.stdout)
    assert answer["limit"] == 64 * MiB and answer["out_of_memory"]["capacity"] == 64 * MiB
    assert answer["out_of_memory"]["fits"]["expandable_segments:True"] is True
    assert answer["out_of_memory"]["fits"][""] is False
    # --limit chooses another size; a snapshot without an oom entry is tuned as before
    p = run_cli("tune", str(path), "--no-progress", "--jobs", "2", "--limit", "100MiB")
    assert p.returncode == 0 and "out of memory:" not in p.stdout and "would have fit" not in p.stdout


# ---- torch's own out-of-memory error, on the fake CUDA stack ----


def _importable_gpumempool(tmp_path: Path) -> str:
    """A directory that holds just the gpumempool this test imports (the
    installed copy in CI, where the source tree has no built extension; the
    checkout in development), for another Python's PYTHONPATH: not the
    whole site-packages it may sit in, whose packages would shadow that
    Python's own."""
    where = tmp_path / "importable"
    where.mkdir(exist_ok=True)
    link = where / "gpumempool"
    if not link.exists():
        link.symlink_to(Path(gmp.__file__).resolve().parent, target_is_directory=True)
    return str(where)

TORCH_CHILD = textwrap.dedent("""
    import ctypes, json, sys
    req = json.loads(sys.argv[1])
    for path in req["preload"]:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    import torch
    import gpumempool.torch as gt
    doctor = gt.oom_doctor(req["dir"], time_limit_s=120)
    MiB = 1 << 20
    keep = []
    try:
        for i in range(1000):
            keep.append(torch.empty((24 + (i % 3) * 7) * MiB, dtype=torch.uint8, device="cuda"))
            if i % 4 == 1:
                del keep[0]
    except torch.OutOfMemoryError as exc:
        print("torch:", str(exc).splitlines()[0], file=sys.stderr)
    print(json.dumps({"diagnoses": [d.as_dict() for d in doctor.diagnoses], "written": doctor.written,
                      "torch": torch.__version__}))
""")


@pytest.fixture(params=PYTHONS or [None], ids=lambda p: "no-torch" if p is None else os.path.basename(
    os.path.dirname(os.path.dirname(p))))
def torch_python(request: pytest.FixtureRequest) -> str:
    if request.param is None:
        no_torch()
    return str(request.param)


def test_torch_oom_on_the_fake_cuda_stack_prints_the_line(torch_python: str, tmp_path: Path) -> None:
    from gpumempool.oracle import _stack, env_var, torch_env

    stack = _stack.build(_stack.find_torch(torch_python))
    env = torch_env(stack, "", 1 << 30, 1)  # a 1 GiB fake device, torch's defaults
    env["PYTHONPATH"] = _importable_gpumempool(tmp_path)  # this gpumempool, in the torch's Python
    req = {"preload": list(stack.preload), "dir": str(tmp_path)}
    p = subprocess.run([torch_python, "-c", TORCH_CHILD, json.dumps(req)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    lines = p.stderr.splitlines()
    assert any(ln.startswith("torch: CUDA out of memory.") for ln in lines), p.stderr
    m = FITS_LINE.search(p.stderr)
    assert m is not None, p.stderr
    assert m.group(1) == env_var(got["torch"]) and m.group(4) == "1.0 GiB"
    torch_file = str(tmp_path / "rank00000-oom1-torch.pickle")
    assert got["written"] == [str(tmp_path / "rank00000-oom1.pickle"), torch_file]
    [diag] = got["diagnoses"]
    assert diag["snapshot"] == torch_file and diag["capacity"] == 1 << 30 and diag["fits"] is True
    assert f"python -m gpumempool tune {torch_file} for details" in diag["line"]
    # the line printed before torch's error reached the program
    assert lines.index(diag["line"]) < next(i for i, ln in enumerate(lines) if ln.startswith("torch: "))
    answer = json.loads(Path(diag["json_path"]).read_text())
    assert answer["best"]["fits"] is True and answer["default"]["fits"] is False
    assert Path(diag["text_path"]).read_text().startswith(diag["line"])
    # the file says the same from the command line: the device it failed on
    assert capacity_at_oom(torch_file) == 1 << 30


# ---- a snapshot recorded on a real GPU that ran out of memory ----

EXTERNAL = ROOT.parent / "shared" / "traces-external"


def test_the_external_snapshot_that_ran_out_of_memory(tmp_path: Path) -> None:
    # Recorded with expandable_segments:True on 80 GB cards; device 1 failed
    # to allocate 4.94 GiB with 91 MiB free: it held more than the card.
    src = EXTERNAL / "Constructor-Sun_memory_snapshot_52e52b2.pickle"
    if not src.is_file():
        pytest.skip("../shared/traces-external is not here")
    cap = capacity_at_oom(src)
    assert cap is not None and 78 << 30 < cap < 80 << 30, "the memory an 80 GB card (79.1 GiB) leaves to torch"
    p = run_cli("tune", str(src), "--no-progress")
    assert p.returncode == 1 and p.stderr == ""
    assert f"out of memory: the run failed on a device with {format_bytes(cap)} for it " in p.stdout
    assert "the run holds 83.23 GiB at once on one device (counting the request torch could not serve), more " \
           f"than the {format_bytes(cap)} it had there" in p.stdout
    fit = p.stdout[p.stdout.index(f"would have fit in {format_bytes(cap)} (the device it failed on):"):]
    assert "  yes  " not in fit and "  no   PYTORCH_ALLOC_CONF=expandable_segments:True: " in fit
    snap = tmp_path / "rank00000-oom1.pickle"
    snap.write_bytes(src.read_bytes())
    diag = _oom_doctor.diagnose(snap, quiet=True)
    assert diag.fits is False and diag.capacity == cap and diag.error is None
    assert diag.line.startswith(f"gpumempool: no setting searched fits {format_bytes(cap, 1)}; the run holds 83.2 GiB")
    assert json.loads((tmp_path / "rank00000-oom1-tune.json").read_text())["capacity"] == cap
