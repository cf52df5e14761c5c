"""Traces read as a stream (issue 18): hostile files refused at their bad
line in bounded memory, long valid ones replayed without holding their
events; the CLI's errors naming the file; progress bars ending their line;
the shipped traces' version; atomic saves."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumempool._args import MAX_DEVICE as MAX_DEVICES
from gpumempool.replay import replay
from gpumempool.trace import Alloc, Free, Trace, TraceFormatError

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m gpumempool"

#: Runs the CLI in this process and prints, as the last line of stdout, the
#: peak resident memory it reached (kB), so that a test can bound it. VmHWM,
#: not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child
#: of a big pytest process would report pytest's size.
_MEASURED = """
import json, re, resource, sys
from gpumempool.__main__ import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
sys.stdout.flush()
try:
    with open("/proc/self/status") as f:
        peak = int(re.search(r"^VmHWM:\\s+(\\d+) kB", f.read(), re.M).group(1))
except (OSError, AttributeError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rc": rc, "maxrss_kb": peak}))
"""


def run_measured(*args: str, timeout: float) -> tuple[dict, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - t0
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr, took


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumempool", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def run_raw(*args: str, **kw) -> tuple[int, str, str]:
    """Status, stdout and stderr with their carriage returns (text mode
    would turn each into a newline, hiding a bar's unended line)."""
    p = subprocess.run([sys.executable, "-m", "gpumempool", *args], capture_output=True, timeout=300, **kw)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def write_gz(path: Path, head: bytes, line: bytes, times: int) -> None:
    """``head`` then ``line`` ``times`` times, gzip-compressed (fast level:
    repeated lines compress to almost nothing at any level)."""
    chunk = line * 100_000
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(head)
        for _ in range(times // 100_000):
            f.write(chunk)
        f.write(line * (times % 100_000))


#: The memory a CLI replay may reach on a trace whose blocks alive at once
#: are few, however long the file: the interpreter, the engine and numpy-free
#: imports take about 60 MB; the old reader held every event (2.4 GB for the
#: hostile file below).
RSS_BOUND_KB = 250 << 10


def test_hostile_trace_is_refused_at_its_line_in_bounded_memory(tmp_path: Path) -> None:
    """Issue 18: a 388 KB gzip of 20 million identical allocation lines took
    81 s and 2.38 GB before replay said "block 1 allocated twice". Read as a
    stream it is refused when line 3 is read."""
    hostile = tmp_path / "hostile.trace.gz"
    write_gz(hostile, b"gmptrace 2\n", b"a 1 512 0\n", 20_000_000)
    assert hostile.stat().st_size < 2 << 20  # 388 KB at gzip -9
    res, err, took = run_measured("replay", str(hostile), "--no-progress", timeout=60)
    assert res["rc"] == 1, err
    assert f"{hostile}:3: event 1: block 1 allocated twice" in err
    assert took < 20, took
    assert res["maxrss_kb"] < RSS_BOUND_KB, res


def test_long_valid_trace_replays_in_memory_bounded_by_live_blocks(tmp_path: Path) -> None:
    """A million events with one block alive at a time (an id names a new
    block after its free): replayed from the file, the memory does not grow
    with the events (the old reader held each as an object, ~120 bytes)."""
    from gpumempool.trace import TraceFile
    path = tmp_path / "long.trace.gz"
    write_gz(path, b"gmptrace 2\n", b"a 1 512 0\nf 1\n", 500_000)
    res, err, _ = run_measured("replay", str(path), "--no-progress", "--json", timeout=240)
    assert res["rc"] == 0, err
    assert res["maxrss_kb"] < RSS_BOUND_KB, res
    tf = TraceFile(path)
    assert len(tf) == 1_000_000 and tf.counts()["alloc"] == 500_000 and tf.peak_requested() == 512


def test_many_s_records_without_events_are_refused(tmp_path: Path) -> None:
    """S records are kept (a replay needs them before its first event): one
    repeated line must not grow that list without bound."""
    from gpumempool.trace import TraceFile
    path = tmp_path / "s.trace.gz"
    write_gz(path, b"gmptrace 2\n", b"S 0 0x0 512\n", 1_000_000)
    with pytest.raises(TraceFormatError, match=r"s\.trace\.gz:65538: 65537 S records before event 0"):
        TraceFile(path)


def test_many_metadata_lines_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    """Review: every ``@`` line is merged into the kept metadata, so a small
    gzip of many 1 MB metadata lines with distinct keys (300 of them: 0.3 MB
    of gzip) grew TraceFile.meta to 300 MB; the metadata a file may carry
    in all is bounded, and the error names the line that passes the bound."""
    from gpumempool import trace
    from gpumempool.trace import TraceFile
    MAX_META_BYTES = getattr(trace, "MAX_META_BYTES", 4 << 20)
    path = tmp_path / "meta.trace.gz"
    big = "x" * 1_000_000
    lines = 2 + MAX_META_BYTES // len(big) + 300
    with gzip.open(path, "wt", compresslevel=1) as f:
        f.write("gmptrace 2\n")
        for i in range(lines - 2):
            f.write('@ {"k%d":"%s"}\n' % (i, big))
        f.write("a 1 512 0\nf 1\n")
    assert path.stat().st_size < 2 << 20
    first_bad = 2 + MAX_META_BYTES // (len(big) + 10)
    with pytest.raises(TraceFormatError, match=rf"meta\.trace\.gz:{first_bad}: metadata lines total more than"):
        TraceFile(path)
    res, err, _ = run_measured("replay", str(path), "--no-progress", timeout=60)
    assert res["rc"] == 1 and "metadata lines total more than" in err, err
    assert res["maxrss_kb"] < RSS_BOUND_KB, res


def test_trace_file_replays_as_the_loaded_trace(tmp_path: Path) -> None:
    from gpumempool.trace import TraceFile
    demo = ROOT / "benchmarks" / "traces" / "demo-synthetic.trace.gz"
    seen: list[tuple[int, int]] = []
    tf = TraceFile(demo, progress=lambda done, total: seen.append((done, total)))
    tr = Trace.load(demo)
    assert seen and seen[-1] == (demo.stat().st_size,) * 2  # loading reports its progress, to the end
    assert len(tf) == len(tr) and tf.counts() == tr.counts() and tf.segments == tr.segments
    assert tf.peak_requested() == tr.peak_requested()
    assert tf.recorded_peak_reserved() == tr.recorded_peak_reserved() and tf.meta == tr.meta
    a, b, c = replay(tf), replay(tr), replay(str(demo))
    for x in (b, c):
        assert (x.peak_reserved, x.peak_allocated, x.placed_segments, x.events) == \
            (a.peak_reserved, a.peak_allocated, a.placed_segments, a.events)
    tf.save(tmp_path / "copy.trace.gz")
    back = Trace.load(tmp_path / "copy.trace.gz")
    assert back.events == tr.events and back.reserved == tr.reserved and back.segments == tr.segments
    assert back.meta == tr.meta


def test_a_reused_id_replays_as_a_new_block() -> None:
    res = replay(Trace([Alloc(1, 1000), Free(1), Alloc(1, 3000), Free(1)]))
    assert (res.allocations, res.frees, res.skipped, res.peak_requested) == (2, 2, 0, 3000)


# -- errors naming the file ---------------------------------------------------


def test_a_gzip_that_is_not_a_trace_is_named_as_such(tmp_path: Path) -> None:
    """It was reported as "refused a crafted or corrupt pickle: OBJ...". """
    path = tmp_path / "notes.gz"
    path.write_bytes(gzip.compress(b"hello world\n" * 10))
    for cmd in ("replay", "plot"):
        extra = ["-o", str(tmp_path / "x.png")] if cmd == "plot" else []
        p = run_cli(cmd, str(path), *extra, "--no-progress")
        assert p.returncode == 1, p.stderr
        assert p.stderr == (f"{PROG}: error: {path}: neither a gmptrace file nor a snapshot pickle: gzip data that "
                            "starts with b'hello wo' (a gmptrace file starts with 'gmptrace', a snapshot pickle with "
                            "byte 0x80; --format forces one)\n"), p.stderr


def test_text_named_like_a_pickle_is_not_called_a_crafted_pickle(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(b"Oops, this is text\n")
    p = run_cli("replay", str(path), "--no-progress")
    assert p.returncode == 1
    assert f"error: {path}: not a snapshot pickle (those start with byte 0x80; this data starts with b'Oops, this i')" \
        in p.stderr, p.stderr


class _Evil:
    def __reduce__(self):  # noqa: ANN204 - what a malicious pickle does
        return (os.system, ("echo pwned",))


def test_a_malicious_pickle_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[_Evil()]]}, protocol=4))
    for cmd in ("replay", "plot"):
        extra = ["-o", str(tmp_path / "x.png")] if cmd == "plot" else []
        p = run_cli(cmd, str(path), *extra, "--no-progress")
        assert p.returncode == 1 and "pwned" not in p.stdout
        assert f"error: {path}: refused to load posix.system: a memory snapshot may only contain plain data" \
            in p.stderr, p.stderr


def test_a_snapshot_given_for_a_trace_and_a_trace_for_a_snapshot(tmp_path: Path) -> None:
    from gpumempool.trace import load_pickle

    demo = ROOT / "benchmarks" / "traces" / "demo-synthetic.trace.gz"
    with pytest.raises(ValueError, match=f"{re.escape(str(demo))}: a gmptrace file, not a snapshot pickle"):
        load_pickle(demo)


# -- progress bars ------------------------------------------------------------


def test_an_error_after_a_progress_bar_starts_its_own_line(tmp_path: Path) -> None:
    """It ran into the bar: ``plot: 0.00ev [00:00, ?ev/s]python -m
    gpumempool: error: ...``. Here replay fails after its bar was drawn."""
    path = tmp_path / "bad.trace"
    path.write_text('gmptrace 2\n@ {"devices": "many"}\na 1 512 0\n')
    rc, _, err = run_raw("replay", str(path))
    assert rc == 2
    lines = err.split("\n")
    errors = [ln for ln in lines if "error:" in ln]
    assert errors == [f"{PROG}: error: trace metadata 'devices' must be a whole number in [1, {MAX_DEVICES}], got str"], \
        repr(err)
    assert re.search(r"\rreplay:", err), repr(err)  # the bar was there


def test_loading_shows_a_progress_bar_and_no_progress_hides_it(tmp_path: Path) -> None:
    demo = ROOT / "benchmarks" / "traces" / "demo-synthetic.trace.gz"
    rc, _, err = run_raw("replay", str(demo))
    assert rc == 0, err
    # piped: each bar stays, on a line of its own (the last drawing of it after its last \r)
    bars = [ln.rsplit("\r", 1)[-1] for ln in err.split("\n") if ln]
    assert [b.split(":")[0] for b in bars] == ["load", "replay"], repr(err)
    assert "100%" in bars[0] and "100%" in bars[1], bars
    assert run_cli("replay", str(demo), "--no-progress").stderr == ""


def test_piped_demo_output_puts_header_and_bar_on_separate_lines() -> None:
    p = subprocess.run([sys.executable, "-m", "gpumempool", "demo", "--steps", "20"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=300)
    assert p.returncode == 0, p.stdout
    out = p.stdout.decode()
    lines = out.split("\n")
    assert "gpumempool demo: training-shaped workload on the simulated device (sim backend)" in lines, repr(out)
    bar = [ln for ln in lines if "demo:" in ln and "step" in ln]
    assert len(bar) == 1 and bar[0].startswith("\rdemo:") and "20.0/20.0" in bar[0], repr(out)


# -- shipped traces, atomic saves -----------------------------------------------


def test_shipped_traces_are_current_version() -> None:
    """demo-synthetic.trace.gz said gmptrace 1 while the docs call version 2
    current; each shipped trace is version 2 and replays."""
    from gpumempool.trace import TraceFile
    traces = sorted((ROOT / "benchmarks" / "traces").glob("*.trace.gz"))
    assert len(traces) == 4
    for path in traces:
        with gzip.open(path, "rt") as f:
            assert f.readline() == "gmptrace 2\n", path
        tf = TraceFile(path)
        assert tf.segments, path  # version 2 files carry S records
    demo = TraceFile(ROOT / "benchmarks" / "traces" / "demo-synthetic.trace.gz")
    assert demo.counts()["alloc"] == 19224 and demo.meta["generator"] == "benchmarks/traces/make_synthetic.py"


class _Boom:
    """Not an event: writing it fails, half-way through the file."""


@pytest.mark.parametrize("name", ["t.trace.gz", "t.trace"])
def test_save_is_atomic(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    old = Trace([Alloc(1, 512), Free(1)])
    old.save(path)
    before = path.read_bytes()
    os.chmod(path, 0o640)
    big = Trace([Alloc(i, 512) for i in range(1, 50_001)] + [_Boom()])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not a trace event"):
        big.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary file left
    Trace([Alloc(1, 4096)]).save(path)
    assert Trace.load(path).events == [Alloc(1, 4096)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert path.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
