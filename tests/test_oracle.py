"""Torch's own caching allocator as the judge (gpumempool.oracle): the
official CUDA wheels of torch run on the fake CUDA stack, and the engine's
reserved and allocated bytes, segments, retries and OOMs must equal torch's
after every event.

The torch installs come from GMP_TORCH_PYTHONS (pythons separated by
os.pathsep; .ci/test makes slim installs of 2.5.1, 2.11.0 and 2.15.0 with
tools/torch_slim.py). Without it these tests skip, unless
GMP_REQUIRE_TORCH_ORACLE=1 (CI), which makes them fail. The full matrix
over every setting tune may recommend is benchmarks/fidelity.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _torch_pythons import PYTHONS, no_torch

from gpumempool.oracle import FakeStackError, OracleError, _stack, adversarial, fidelity, run
from gpumempool.trace import Alloc, EmptyCache, Free, RecordStream, Sync, Trace, from_torch_snapshot, load_trace

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "benchmarks" / "traces"
EXTERNAL = ROOT.parent / "shared" / "traces-external"
GiB, MiB = 1 << 30, 1 << 20


def _version(python: str) -> str:
    return _stack.find_torch(python).version


def _params() -> list[Any]:
    if not PYTHONS:
        return [pytest.param(None, id="no-torch")]
    return [pytest.param(p, id=_version(p).split("+")[0]) for p in PYTHONS]


@pytest.fixture(params=_params())
def torch_python(request: pytest.FixtureRequest) -> str:
    p = request.param
    if p is None:
        no_torch()
    return str(p)


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("oracle-cache"))


def _older_than(python: str, major: int, minor: int) -> bool:
    v = _version(python).split("+")[0].split(".")
    return (int(v[0]), int(v[1])) < (major, minor)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
@pytest.mark.parametrize("name", ["cnn-train", "gpt2-train", "demo-synthetic"])
def test_shipped_traces_match_torch(torch_python: str, cache: str, name: str, conf: str) -> None:
    trace = load_trace(TRACES / f"{name}.trace.gz")
    c = fidelity.compare(trace, conf, python=torch_python, cache=cache)
    assert c.total == len(trace)
    assert c.exact, c.describe()
    assert c.torch_peak_reserved == c.engine_peak_reserved > 500 * MiB


#: Settings proven exact on these kinds (see benchmarks/results/fidelity.md
#: for the whole matrix, and what is left).
PROVEN = [
    ("", None),
    ("max_split_size_mb:64", None),
    ("roundup_power2_divisions:4", None),
    ("max_split_size_mb:256,max_non_split_rounding_mb:64", None),
    ("", 0.5),
    ("garbage_collection_threshold:0.6", 0.5),
    ("expandable_segments:True", None),
    ("expandable_segments:True,roundup_power2_divisions:8", None),
]


@pytest.mark.parametrize("kind", ["boundaries", "streams", "random", "empty_cache"])
@pytest.mark.parametrize("conf,fraction", PROVEN, ids=[f"{c or 'defaults'}-{f}" for c, f in PROVEN])
def test_settings_match_torch_on_adversarial_traces(torch_python: str, cache: str, kind: str, conf: str,
                                                     fraction: Any) -> None:
    trace = adversarial.make(kind, 0)
    if "max_non_split_rounding_mb" in conf and _older_than(torch_python, 2, 6):
        # torch 2.5 has no such setting, and says so in one line.
        with pytest.raises(OracleError, match="max_non_split_rounding_mb"):
            run(trace, conf, python=torch_python, cache=cache)
        return
    c = fidelity.compare(trace, conf, python=torch_python, fraction=fraction, cache=cache)
    assert c.exact, c.describe()


#: Memory pressure on a 4 GiB device: release and retry, oversize segments
#: first, garbage collection, out-of-memory, as each version limits a fraction.
PRESSURE = [
    ("", 1.0),
    ("", 0.8),
    ("max_split_size_mb:64", 1.0),
    ("max_split_size_mb:64", 0.5),
    ("garbage_collection_threshold:0.6", 0.5),
    ("garbage_collection_threshold:0.8", 1.0),
    ("roundup_power2_divisions:4", 0.8),
    ("expandable_segments:True", 0.5),
]


@pytest.mark.parametrize("conf,fraction", PRESSURE, ids=[f"{c or 'defaults'}-{f}" for c, f in PRESSURE])
def test_memory_pressure_matches_torch(torch_python: str, cache: str, conf: str, fraction: float) -> None:
    trace = adversarial.make("pressure", 1)
    c = fidelity.compare(trace, conf, python=torch_python, capacity=trace.meta["capacity"], fraction=fraction,
                         cache=cache)
    assert c.exact, c.describe()


@pytest.mark.parametrize("fraction", [0.8, 0.95])
def test_expandable_pressure_maps_into_older_segments(torch_python: str, cache: str, fraction: float) -> None:
    """Pressure seed 7 leaves two expandable segments on the stream, the
    older with a free block before a hole that holds a 665 MiB request:
    torch maps 60 MiB there (its search covers every segment of the stream,
    lowest address first), where the engine mapped 680 MiB at the end of
    the newer one (event 491 at 0.8, 1771 at 0.95)."""
    trace = adversarial.make("pressure", 7)
    c = fidelity.compare(trace, "expandable_segments:True", python=torch_python, capacity=trace.meta["capacity"],
                         fraction=fraction, cache=cache)
    assert c.exact, c.describe()


def test_record_stream_keeps_a_block_until_its_stream_completes(torch_python: str, cache: str) -> None:
    """A block used on another stream comes back only after that stream's
    work is done (manual event completion in the fake driver): torch makes a
    second segment for the same request until then, as the engine does."""
    side = 0x4000
    from gpumempool.trace import RecordStream, Sync
    trace = Trace(events=[Alloc(1, 30 * MiB), RecordStream(1, side), Free(1), Alloc(2, 30 * MiB), Free(2),
                          Sync(side), Alloc(3, 30 * MiB), Free(3)])
    r = run(trace, python=torch_python, cache=cache)
    reserved = [p.reserved for p in r.points]
    assert reserved[3] == 2 * reserved[0] == 2 * 30 * MiB  # the first block is still in use on `side`
    assert [p.segments for p in r.points][6] == 2 and r.points[6].allocated == 30 * MiB
    assert fidelity.diff(r, fidelity.engine_points(trace, torch_version=r.torch_version)).exact


@pytest.mark.parametrize("first", [Sync(0), Sync(None), EmptyCache(), Free(9)], ids=["sync", "sync-all", "empty", "free"])
def test_a_trace_may_start_with_any_event(torch_python: str, cache: str, first: Any) -> None:
    """A trace that begins with something other than an allocation (a
    recording started mid-run, a sync) replays: torch's figures before its
    first allocation are zeros, as the engine's are (it failed with
    "Invalid device argument": the stats were read before CUDA started)."""
    trace = Trace(events=[first, Alloc(1, 100), Free(1)])
    c = fidelity.compare(trace, python=torch_python, capacity=4 * GiB, cache=cache)
    assert c.exact and c.total == 3, c.describe()


def test_out_of_memory_is_an_event(torch_python: str, cache: str) -> None:
    """A request larger than the device is torch's OOM at that event, and the
    run goes on; a memory fraction is torch's limit."""
    trace = Trace(events=[Alloc(1, 100 * GiB), Alloc(2, 1 * GiB), Free(2), Free(1), Alloc(3, 3 * GiB), Free(3)])
    r = run(trace, python=torch_python, capacity=80 * GiB, cache=cache)
    assert r.oom_events == [0]
    assert [p.ooms for p in r.points] == [1, 1, 1, 1, 1, 1]
    assert r.points[1].reserved == r.points[1].allocated == 1 * GiB
    limited = run(trace, python=torch_python, capacity=4 * GiB, fraction=0.5, cache=cache)
    assert limited.oom_events == [0, 4]
    assert fidelity.diff(limited, fidelity.engine_points(trace, capacity=4 * GiB, fraction=0.5,
                                                       torch_version=limited.torch_version)).exact


def test_settings_reach_torch_under_the_variable_it_reads(torch_python: str, cache: str) -> None:
    """roundup_power2_divisions changes what torch reserves for a 1.1 GiB
    request (rounded to 1.25 GiB with 4 divisions): proof that the setting
    was read, on versions that read PYTORCH_ALLOC_CONF and those that do not."""
    trace = Trace(events=[Alloc(1, 1126 * MiB), Free(1)])
    plain = run(trace, python=torch_python, cache=cache)
    rounded = run(trace, "roundup_power2_divisions:4", python=torch_python, cache=cache)
    assert plain.points[0].allocated == 1126 * MiB
    assert rounded.points[0].allocated == 1280 * MiB
    assert rounded.env_var == ("PYTORCH_CUDA_ALLOC_CONF" if _older_than(torch_python, 2, 10) else "PYTORCH_ALLOC_CONF")


def test_the_callers_environment_does_not_change_torchs_allocator(torch_python: str, cache: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What the caller's shell sets for torch or the fake driver stays out of
    the child: PYTORCH_NO_CUDA_MEMORY_CACHING would turn torch's cache off
    (every free back to cudaFree), FAKE_CUDA_DEVICES and FAKE_CUDA_VISIBLE_ORDER
    change the fake devices, FAKE_CUDA_DRIVER_VERSION the driver torch sees."""
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    monkeypatch.setenv("FAKE_CUDA_VISIBLE_ORDER", "1,0")
    monkeypatch.setenv("FAKE_CUDA_DRIVER_VERSION", "11000")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    trace = Trace(events=[Alloc(1, 100), Free(1), Alloc(2, 100, device=1)])
    theirs = run(trace, python=torch_python, capacity=4 * GiB, cache=cache)
    assert [(p.device, p.reserved, p.allocated) for p in theirs.points] == [
        (0, 2 * MiB, 512), (0, 2 * MiB, 0), (1, 2 * MiB, 512)]


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_multi_device_snapshot_matches(torch_python: str, cache: str, conf: str) -> None:
    """An external snapshot recorded on three GPUs with expandable segments,
    one OOM: each event is judged on its own device, under the recorded
    setting and the defaults."""
    path = EXTERNAL / "Constructor-Sun_memory_snapshot_52e52b2.pickle"
    if not path.is_file():
        pytest.skip("../shared/traces-external is not here")
    trace = from_torch_snapshot(path)
    theirs = run(trace, conf, python=torch_python, cache=cache)
    assert {p.device for p in theirs.points} == {0, 1, 2}
    c = fidelity.diff(theirs, fidelity.engine_points(trace, conf, torch_version=theirs.torch_version))
    assert c.exact, c.describe()


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_empty_cache_releases_another_devices_segments(torch_python: str, cache: str, conf: str) -> None:
    """empty_cache() and the wait for pending frees reach every device,
    whichever one is current: CUDA frees another device's memory and waits
    on its events and streams, and the fake stack must too (it failed with
    "CUDA error" when device 1's segments went while device 0 was current)."""
    trace = Trace(events=[
        Alloc(1, 30 * MiB, 0x1000, 1), RecordStream(1, 0x2000), Free(1), Alloc(2, 3 * MiB, 0, 0), EmptyCache(),
        Alloc(3, 30 * MiB, 0x1000, 1), Free(3), Sync(None), Alloc(4, 5 * MiB, 0, 0), EmptyCache(), Free(2), Free(4)])
    theirs = run(trace, conf, python=torch_python, capacity=4 * GiB, cache=cache)
    assert [p.device for p in theirs.points] == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    c = fidelity.diff(theirs, fidelity.engine_points(trace, conf, capacity=4 * GiB,
                                                     torch_version=theirs.torch_version))
    assert c.exact, c.describe()


def test_a_runtime_function_the_fake_lacks_is_named(torch_python: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = _stack.cudart_exports
    monkeypatch.setattr(_stack, "cudart_exports", lambda lib: real(lib) - {"cudaMalloc", "cudaStreamSynchronize"})
    with pytest.raises(FakeStackError, match="lacks: cudaMalloc, cudaStreamSynchronize") as err:
        _stack.build(_stack.find_torch(torch_python), tmp_path)
    assert err.value.missing == "cudaMalloc,cudaStreamSynchronize"


def test_a_build_that_finishes_second_leaves_the_first_in_place(torch_python: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes building the same stack at once (pytest-xdist, the
    fidelity matrix, two shells): the one that finishes second must not
    delete the stack the first returned, which its child may be loading;
    it uses it (or its own) and leaves no build directory behind."""
    torch = _stack.find_torch(torch_python)
    real = _stack._compile
    first: list[_stack.FakeStack] = []
    inodes: dict[str, int] = {}

    def racing(*args: Any, **kwargs: Any) -> None:
        if not first:  # another process builds the whole stack meanwhile
            monkeypatch.setattr(_stack, "_compile", real)
            first.append(_stack.build(torch, tmp_path))
            inodes.update({p: os.stat(p).st_ino for p in first[0].preload})
            monkeypatch.setattr(_stack, "_compile", racing)
        real(*args, **kwargs)

    monkeypatch.setattr(_stack, "_compile", racing)
    second = _stack.build(torch, tmp_path)
    assert first and second.preload == first[0].preload
    assert [d.name for d in tmp_path.iterdir()] == [first[0].directory.name]
    assert {p: os.stat(p).st_ino for p in second.preload} == inodes
    assert json.loads((second.directory / "stack.json").read_text())["preload"] == list(second.preload)


def test_torch_aborting_is_reported_by_its_message(torch_python: str, cache: str) -> None:
    """A setting torch cannot parse makes it abort (a C++ exception while it
    reads the variable) with a stack of frames on stderr: the error is
    torch's own message, not the last of those frames."""
    with pytest.raises(OracleError) as err:
        run(Trace(events=[Alloc(1, 100), Free(1)]), "expandable_segments", python=torch_python, capacity=4 * GiB,
            cache=cache)
    msg = str(err.value)
    assert "frame #" not in msg and "\n" not in msg
    assert "config" in msg.lower() or "settings" in msg, msg


def test_oracle_cli_compares(torch_python: str, cache: str) -> None:
    env = {**os.environ, "GMP_ORACLE_CACHE": cache, "PYTHONSAFEPATH": "1"}
    cmd = [sys.executable, "-m", "gpumempool", "oracle", str(TRACES / "cnn-train.trace.gz"), "--python",
           torch_python, "--no-progress"]
    r = subprocess.run([*cmd, "--compare", "--json"], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["matched"] == out["total"] == 19491
    r = subprocess.run([*cmd, "--conf", "no_such_setting:1"], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "no_such_setting" in r.stderr and "Traceback" not in r.stderr


# ---- without torch ----


def _fake_torch(tmp_path: Path) -> str:
    """A python whose "torch" is a directory without libc10_cuda: a CPU build."""
    site = tmp_path / "site"
    (site / "torch" / "lib").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "version.py").write_text("__version__ = '2.99.0+cpu'\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_cpu_only_torch_is_refused_in_one_line(tmp_path: Path) -> None:
    py = _fake_torch(tmp_path)
    t = _stack.find_torch(py)
    assert t.version == "2.99.0+cpu" and t.cudart_soname == ""
    with pytest.raises(FakeStackError, match="CPU-only build") as err:
        run(Trace(events=[Alloc(1, 512)]), python=py, cache=str(tmp_path / "c"))
    assert "\n" not in str(err.value)


def test_missing_runtime_headers_name_the_wheel(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    for soname, pkg in (("libcudart.so.12", "nvidia-cuda-runtime-cu12"), ("libcudart.so.13", "nvidia-cuda-runtime==13")):
        t = _stack.TorchInstall(sys.executable, tmp_path / "torch", "2.99.0", soname)
        with pytest.raises(FakeStackError, match=f"pip install --no-deps '{pkg}") as err:
            _stack.runtime_headers(t)
        assert err.value.missing.startswith(pkg)


def test_a_python_without_torch_is_named(tmp_path: Path) -> None:
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH= exec {sys.executable} -I \"$@\"\n")
    py.chmod(0o755)
    r = subprocess.run([str(py), "-c", "import torch"], capture_output=True)
    if r.returncode == 0:
        pytest.skip("this Python has torch")
    with pytest.raises(FakeStackError, match="has no torch: pip install torch"):
        _stack.find_torch(str(py))


def test_trim_has_no_torch_counterpart() -> None:
    from gpumempool.trace import Trim
    with pytest.raises(OracleError, match="event 1: trim"):
        from gpumempool.oracle import events_of
        events_of(Trace(events=[Alloc(1, 512), Trim(0, 0)]))


def test_a_zero_byte_allocation_is_nothing_as_in_torch() -> None:
    """torch.empty(0) on CUDA reserves and allocates nothing (the oracle's
    torch gives zeros for it, and a later free of it is nothing); the
    engine's side of the comparison must not refuse the trace."""
    pts = fidelity.engine_points(Trace(events=[Alloc(1, 0), Alloc(2, 100), Free(1), Free(2)]), capacity=4 * GiB)
    assert [(p.reserved, p.allocated, p.segments) for p in pts] == [
        (0, 0, 0), (2 * MiB, 512, 1), (2 * MiB, 512, 1), (2 * MiB, 0, 1)]


def test_retries_and_ooms_count_every_device() -> None:
    """Torch counts retries and OOMs per device, and each point carries its
    device's: the run's figures add the last of each device, not the last
    point's alone (a retry on device 1 of a trace that ends on device 0
    was lost from `oracle` and `tune --verify`)."""
    from gpumempool.oracle import OracleResult, Point

    r = OracleResult("2.11.0", "", 4 * GiB, 0.5, [
        Point(1, 20 * MiB, 20 * MiB, 1, 1, 0), Point(1, 20 * MiB, 20 * MiB, 1, 2, 1), Point(0, 2 * MiB, 512, 1, 0, 0),
        Point(0, 2 * MiB, 512, 1, 1, 0)], [1], 0.0)
    assert (r.retries, r.ooms) == (3, 1)
    assert r.as_dict()["retries"] == 3 and r.as_dict()["ooms"] == 1


def test_adversarial_traces_are_seeded_and_valid() -> None:
    for kind in adversarial.KINDS:
        a, b = adversarial.make(kind, 1), adversarial.make(kind, 1)
        assert a.events == b.events and a.events != adversarial.make(kind, 2).events
        a.validate()
        assert a.meta["capacity"] in (4 * GiB, 80 * GiB)
    with pytest.raises(ValueError, match="unknown adversarial trace"):
        adversarial.make("nope")


def test_alloc_conf_parsing() -> None:
    assert fidelity.parse_alloc_conf("expandable_segments:True,max_split_size_mb:64") == {
        "expandable": True, "max_split_size": 64 * MiB}
    with pytest.raises(ValueError, match="list form is not modelled"):
        fidelity.parse_alloc_conf("roundup_power2_divisions:[256:1,512:2],max_split_size_mb:64")
    with pytest.raises(ValueError, match="does not model torch's setting 'foo'"):
        fidelity.parse_alloc_conf("foo:1")
    with pytest.raises(ValueError, match="not key:value"):
        fidelity.parse_alloc_conf("expandable_segments")


# ---- tune: the modelled torch version, verified settings, --verify ----


def test_modelled_version_follows_the_installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumempool.oracle import proven

    monkeypatch.setattr(proven, "MODELLED", ("2.5", "2.11", "2.15"))
    assert proven.modelled_version("2.11.0+cu130") == "2.11"
    assert proven.modelled_version("2.13.1") == "2.11"  # the newest judged one not newer
    assert proven.modelled_version("2.16.0") == "2.15"
    assert proven.modelled_version("2.4.1") == "2.5"
    assert proven.modelled_version(None) == "2.15"


def test_tune_recommends_only_settings_proven_for_the_modelled_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumempool import tune as tune_mod
    from gpumempool.oracle import proven

    trace = load_trace(TRACES / "cnn-train.trace.gz")
    monkeypatch.setattr(proven, "MODELLED", ("2.11",))
    monkeypatch.setattr(proven, "proven_settings", lambda v: frozenset({"max_split_size", "roundup_power2_divisions"}))
    r = tune_mod.tune(trace, jobs=1, extra=False, torch_version="2.11")
    assert r.torch_version == "2.11" and r.env_var == "PYTORCH_ALLOC_CONF"
    assert r.best.verified and set(r.best.settings) <= {"max_split_size", "roundup_power2_divisions"}
    unverified = [c for c in r.candidates if not c.verified]
    assert unverified and all("expandable" in c.settings or "max_non_split_rounding_size" in c.settings
                              or "garbage_collection_threshold" in c.settings for c in unverified)
    assert all(c.describe().endswith("(unverified)") for c in unverified)
    # with expandable proven, it wins on this trace (as the engine predicts)
    monkeypatch.setattr(proven, "proven_settings", lambda v: frozenset(tune_mod.TORCH_SPACE))
    assert "expandable" in tune_mod.tune(trace, jobs=1, extra=False, torch_version="2.11").best.settings


def test_tune_verify_puts_torch_beside_the_prediction(torch_python: str, cache: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumempool import tune as tune_mod
    from gpumempool.oracle.verify import verify

    monkeypatch.setenv("GMP_ORACLE_CACHE", cache)
    trace = adversarial.make("boundaries", 0)
    result = tune_mod.tune(trace, jobs=1, extra=False)
    rows = verify(result, trace, n=2, python=torch_python, on="fake")
    assert rows[0].settings == "defaults" and len(rows) >= 2
    assert rows[0].on == "fake CUDA stack" and rows[0].torch_version == _version(torch_python)
    for v in rows:
        if result.candidates and "(unverified)" not in v.settings:
            assert v.exact, v
            assert v.predicted_peak == v.torch_peak
    env = {**os.environ, "GMP_ORACLE_CACHE": cache, "PYTHONSAFEPATH": "1"}
    path = Path(cache) / "boundaries.trace.gz"
    trace.save(path)
    r = subprocess.run([sys.executable, "-m", "gpumempool", "tune", str(path), "--verify", "1", "--python",
                        torch_python, "--verify-on", "fake", "--no-progress", "--jobs", "1"],
                       capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 0, r.stderr
    assert f"verified with torch {_version(torch_python)}'s own caching allocator on the fake CUDA stack" in r.stdout
    assert "events equal" in r.stdout


def test_tune_verify_on_a_gpu_sets_the_limit_against_the_gpus_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, torch's memory fraction is a share of that GPU's memory, not
    of the device the trace was recorded on: tune's 40 GiB limit on a 141 GiB
    GPU is a fraction of 40/141, and the engine beside it models that GPU."""
    import types

    import gpumempool
    from gpumempool.oracle import OracleResult, Point
    from gpumempool.oracle import verify as verify_mod

    gpu_total = 141 * GiB
    monkeypatch.setattr(gpumempool, "device_info",
                        lambda: {"devices": [{"total": gpu_total, "free": 120 * GiB}]})
    seen: dict[str, Any] = {}

    def fake_run(trace: Any, conf: str, **kw: Any) -> OracleResult:
        seen["run"] = kw
        return OracleResult("2.11.0", conf, kw["capacity"], kw["fraction"], [Point(0, 2 * MiB, 512, 1, 0, 0)], [], 0.0)

    def fake_engine(trace: Any, conf: str, **kw: Any) -> list[Point]:
        seen["engine"] = kw
        return [Point(0, 2 * MiB, 512, 1, 0, 0)]

    monkeypatch.setattr(verify_mod, "run", fake_run)
    monkeypatch.setattr(verify_mod, "engine_points", fake_engine)
    trace = Trace(events=[Alloc(1, 100)], meta={"capacity": 80 * GiB})
    default = types.SimpleNamespace(alloc_conf="", limit=40 * GiB, settings={}, peak_reserved=2 * MiB,
                                    describe=lambda: "defaults",
                                    result=types.SimpleNamespace(alloc_retries=0, ooms=0))
    result = types.SimpleNamespace(default=default, top=lambda n: [default])
    rows = verify_mod.verify(result, trace, n=1, on="auto")
    assert rows[0].on == "GPU" and seen["run"]["real_gpu"]
    assert int(seen["run"]["fraction"] * gpu_total) == 40 * GiB
    assert seen["engine"]["capacity"] == gpu_total and seen["engine"]["fraction"] == seen["run"]["fraction"]


@pytest.mark.parametrize("n", ["-1", "0", "x"])
def test_tune_verify_wants_a_positive_count(n: str, tmp_path: Path) -> None:
    """tune --verify N replays the default and the best N settings: a count
    that is not positive is a usage error, before anything is replayed
    (-1 replayed every distinct setting tune found through torch)."""
    path = tmp_path / "t.trace.gz"
    Trace(events=[Alloc(1, 100), Free(1)]).save(path)
    r = subprocess.run([sys.executable, "-m", "gpumempool", "tune", str(path), "--verify", n, "--no-progress",
                        "--jobs", "1"], capture_output=True, text=True, cwd="/", env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--verify" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_oracle_gpu_script_dry_run(torch_python: str, cache: str, tmp_path: Path) -> None:
    """benchmarks/oracle_gpu.py (gpu-check.sh's oracle stage) runs its fake
    side here; the GPU side needs the device machine."""
    env = {**os.environ, "GMP_ORACLE_CACHE": cache, "PYTHONSAFEPATH": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "oracle_gpu.py"), "--cpu-only", "--quick",
                        "--python", torch_python, "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                       cwd="/")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "oracle_gpu.json").read_text())
    assert [row["conf"] for row in rows] == ["defaults", "expandable_segments:True", "max_split_size_mb:64"]
    assert all(row["fake_peak"] > 0 and row["torch"] == _version(torch_python) for row in rows)
    assert "| boundaries | defaults | 720 |" in (tmp_path / "oracle_gpu.md").read_text()


def _tune_values() -> list[tuple[str, Any]]:
    """Every value of every setting in tune's search space, as torch's
    setting (gc thresholds under a memory fraction, which they need)."""
    from gpumempool.tune import TORCH_SPACE, alloc_conf

    out: list[tuple[str, Any]] = []
    for key, values in TORCH_SPACE.items():
        for v in values:
            if v is None or v is False or key == "expandable":
                continue
            if key == "max_non_split_rounding_size":
                out.append((alloc_conf({"max_split_size": 256 * MiB, key: v}), None))
            else:
                out.append((alloc_conf({key: v}), 0.5 if key == "garbage_collection_threshold" else None))
    return out


@pytest.mark.parametrize("conf,fraction", _tune_values(), ids=[c for c, _ in _tune_values()])
def test_every_value_tune_may_recommend_matches_torch(torch_python: str, cache: str, conf: str,
                                                      fraction: Any) -> None:
    """tune recommends only settings proven exact for the modelled torch:
    here every value of its search space, on a trace that splits, merges
    and runs out of room (pressure, 4 GiB device)."""
    trace = adversarial.make("pressure", 0)
    if "max_non_split_rounding_mb" in conf and _older_than(torch_python, 2, 6):
        # torch 2.5 has no such setting, says so, and tune does not offer it
        # for 2.5 (proven.json)
        with pytest.raises(OracleError, match="max_non_split_rounding_mb"):
            run(trace, conf, python=torch_python, capacity=trace.meta["capacity"], cache=cache)
        from gpumempool.oracle.proven import proven_settings
        assert "max_non_split_rounding_size" not in proven_settings("2.5")
        return
    c = fidelity.compare(trace, conf, python=torch_python, capacity=trace.meta["capacity"],
                         fraction=fraction if fraction is not None else 1.0, cache=cache)
    assert c.exact, c.describe()
