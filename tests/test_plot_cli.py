"""python -m gpumempool replay / plot (and bench, which says where it moved), and gpumempool.plot."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest

import gpumempool as gmp
from gpumempool.__main__ import main
from gpumempool.trace import Trace

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "benchmarks" / "traces" / "demo-synthetic.trace.gz"
PNG = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str, cwd: Path = ROOT, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumempool", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, **kw)


@pytest.fixture(scope="module")
def snapshot_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our snapshot with history: a few segments, blocks in every state."""
    path = tmp_path_factory.mktemp("snap") / "pool.pickle"
    with gmp.MemPool("sim", name="plotted", capacity=1 << 30, manual_events=True) as pool:
        pool.record_history(True)
        keep = [pool.alloc(n, stream=s) for n, s in ((1000, 0), (300_000, 0), (3 * MiB, 0), (25 * MiB, 7))]
        tmp = [pool.alloc(MiB * (i % 5 + 1)) for i in range(40)]
        for p in tmp[::2]:
            pool.free(p)
        pool.record_stream(keep[1], 9)
        pool.free(keep[1])  # pending: waits for stream 9
        gmp.dump_snapshot(str(path), pool.snapshot())
    return path


def torch_like_snapshot() -> dict:
    """torch's format: one 20 MiB segment from before the trace, one 2 MiB
    segment made in it; 12 MiB allocated and freed."""

    def e(action: str, addr: int, size: int, t: int) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}

    a, b = 0x7F0000000000, 0x7F0010000000
    return {
        "segments": [
            {"device": 0, "address": a, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
             "blocks": [{"address": a, "size": 20 * MiB, "requested_size": 0, "state": "inactive", "frames": []}]},
            {"device": 0, "address": b, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
             "blocks": [{"address": b, "size": 512, "requested_size": 100, "state": "active_allocated", "frames": []},
                        {"address": b + 512, "size": 2 * MiB - 512, "requested_size": 0, "state": "inactive",
                         "frames": []}]},
        ],
        "device_traces": [[
            e("alloc", a, 12 * MiB, 1),
            e("free_requested", a, 12 * MiB, 2),
            e("free_completed", a, 12 * MiB, 3),
            e("segment_alloc", b, 2 * MiB, 4),
            e("alloc", b, 100, 5),
        ]],
        "allocator_settings": {"expandable_segments": False},
    }


class _Evil:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# -- help and JSON --------------------------------------------------------------


def test_every_command_has_help() -> None:
    top = run_cli("--help")
    assert top.returncode == 0
    for cmd in ("info", "demo", "replay", "plot", "bench"):
        assert cmd in top.stdout
        r = run_cli(cmd, "--help")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"usage: python -m gpumempool {cmd}")
    assert "max_split_size" in run_cli("replay", "--help").stdout
    assert "matplotlib" in run_cli("plot", "--help").stdout


# -- replay -----------------------------------------------------------------------


def test_cli_replay_json(tmp_path: Path) -> None:
    r = run_cli("replay", str(SHIPPED), "--json")
    assert r.returncode == 0, r.stderr
    assert "replay" not in r.stderr  # no progress bar with --json
    out = json.loads(r.stdout)
    assert out["reserved_vs_recorded"] == 1.0 and out["recorded_by"] == "gpumempool"
    assert out["torch_peak_reserved"] is None and out["ooms"] == 0
    assert out["trace"]["meta"]["synthetic"] is True and out["trace"]["counts"]["alloc"] == out["allocations"]
    r = run_cli("replay", str(SHIPPED), "--json", "--policy", "expandable=true", "--policy", "limit=1GiB,capacity=2GiB")
    assert r.returncode == 0, r.stderr
    out2 = json.loads(r.stdout)
    assert out2["policy"] == {"expandable": True, "limit": 1 << 30, "capacity": 2 << 30}
    assert out2["ooms"] > 0 and out2["peak_reserved"] <= 1 << 30 and out2["capacity"] == 2 << 30


def test_cli_replay_table_and_progress_bar() -> None:
    r = run_cli("replay", str(SHIPPED))
    assert r.returncode == 0, r.stderr
    for row in ("peak allocated", "peak reserved", "fragmentation", "backend calls", "gpumempool peak reserved",
                "ours / gpumempool"):
        assert row in r.stdout
    assert "replay" in r.stderr and "ev" in r.stderr  # tqdm's bar
    quiet = run_cli("replay", str(SHIPPED), "--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_cli_replay_torch_pickle(tmp_path: Path) -> None:
    snap = tmp_path / "torch.pickle"
    snap.write_bytes(pickle.dumps(torch_like_snapshot()))
    saved = tmp_path / "torch.trace.gz"
    r = run_cli("replay", str(snap), "--json", "--save-trace", str(saved))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # torch reserved 20 MiB before the trace and 22 MiB at its peak.
    assert out["recorded_by"] == "torch" and out["torch_peak_reserved"] == 22 * MiB
    assert out["ratio_vs_torch"] == pytest.approx(out["peak_reserved"] / (22 * MiB))
    # The replay starts where torch was (its 20 MiB segment, seeded) and
    # reserves what torch did; from an empty device it would take a 12 MiB
    # segment, then a 2 MiB small one for the 100 bytes.
    assert out["start_segments"] >= 1 and out["peak_reserved"] == 22 * MiB and out["ratio_vs_torch"] == 1.0
    empty = json.loads(run_cli("replay", str(snap), "--json", "--no-start-state").stdout)
    assert empty["peak_reserved"] == 14 * MiB and empty["ratio_vs_torch"] == pytest.approx(14 / 22)
    assert Trace.load(saved).recorded_peak_reserved() == 22 * MiB
    # Detected by content as well as by extension.
    odd = tmp_path / "snapshot.bin"
    odd.write_bytes(snap.read_bytes())
    r2 = run_cli("replay", str(odd), "--json")
    assert r2.returncode == 0 and json.loads(r2.stdout)["torch_peak_reserved"] == 22 * MiB
    human = run_cli("replay", str(snap), "--no-progress")
    assert "torch peak reserved" in human.stdout and "ours / torch" in human.stdout
    assert "defaults" in human.stdout  # torch ran with its default settings


def test_cli_replay_applies_torch_settings(tmp_path: Path) -> None:
    snap = torch_like_snapshot()
    snap["allocator_settings"] = {"expandable_segments": True, "max_split_size": -1}
    path = tmp_path / "torch.pickle"
    path.write_bytes(pickle.dumps(snap))
    human = run_cli("replay", str(path), "--no-progress", "--policy", "limit=1GiB")
    assert human.returncode == 0, human.stderr
    assert "expandable=True (recorded)" in human.stdout and "limit=1073741824" in human.stdout
    out = json.loads(run_cli("replay", str(path), "--json").stdout)
    assert out["policy"] == {"expandable": True} and out["trace"]["meta"]["recorded_policy"] == {"expandable": True}
    out = json.loads(run_cli("replay", str(path), "--json", "--no-recorded-policy").stdout)
    assert out["policy"] == {}


def test_cli_replay_errors(tmp_path: Path) -> None:
    r = run_cli("replay", str(SHIPPED), "--policy", "bogus=1")
    assert r.returncode == 2 and "unknown policy key 'bogus'" in r.stderr
    r = run_cli("replay", str(tmp_path / "missing.trace"))
    assert r.returncode == 1 and "error:" in r.stderr
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    r = run_cli("replay", str(text))
    assert r.returncode == 1 and "neither a gmptrace file nor a snapshot pickle" in r.stderr
    side = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"device_traces": [[_Evil(side)]]}))
    r = run_cli("replay", str(evil))
    assert r.returncode == 1 and "refused to load posix.system" in r.stderr
    assert not side.exists()


# -- plot ------------------------------------------------------------------------


def test_cli_plot_writes_a_png(tmp_path: Path, snapshot_file: Path) -> None:
    out = tmp_path / "out.png"
    r = run_cli("plot", str(snapshot_file), "-o", str(out), "--title", "test pool")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 20_000
    r = run_cli("plot", str(snapshot_file), "-o", str(tmp_path / "o2.png"), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    snap = pickle.loads(snapshot_file.read_bytes())
    assert summary["segments"] == len(snap["segments"]) >= 3
    assert summary["events"] == len(snap["device_traces"][0])
    assert summary["blocks"] == sum(len(s["blocks"]) for s in snap["segments"])
    assert summary["peak_reserved"] == snap["fragmentation"]["reserved"]  # nothing was released


def test_plot_timeline_and_torch_snapshot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gpumempool.plot import plot_snapshot, timeline

    snap = torch_like_snapshot()
    tl = timeline(snap)
    # Before the trace: 20 MiB reserved, nothing allocated (torch counts requested bytes).
    assert tl["reserved"] == [20 * MiB, 20 * MiB, 20 * MiB, 20 * MiB, 22 * MiB, 22 * MiB]
    assert tl["requested"] == [0, 12 * MiB, 0, 0, 0, 100]  # from alloc to free_requested
    summary = plot_snapshot(snap, tmp_path / "t.png", max_segments=1)
    assert summary["peak_reserved"] == 22 * MiB and summary["peak_requested"] == 12 * MiB
    assert summary["segments"] == 2 and summary["segments_shown"] == 1
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG
    # A snapshot without history still gets its segment map.
    empty = plot_snapshot({"segments": snap["segments"], "device_traces": [[]]}, tmp_path / "e.png")
    assert empty["events"] == 0 and (tmp_path / "e.png").stat().st_size > 5_000


def test_plot_without_matplotlib(tmp_path: Path, snapshot_file: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "never.png"
    code = ("import sys; sys.modules['matplotlib'] = None; from gpumempool.__main__ import main; "
            f"sys.exit(main(['plot', {str(snapshot_file)!r}, '-o', {str(out)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    assert "plotting needs matplotlib" in r.stderr and "pip install 'gpumempool[plot]'" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    # said at once: no progress bar first (the snapshot is not even read)
    assert r.stderr.startswith("python -m gpumempool: error: plotting needs matplotlib"), r.stderr
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(snapshot_file), "-o", str(out), "--no-progress"]) == 2
    assert "pip install 'gpumempool[plot]'" in capsys.readouterr().err
    assert not out.exists()


def test_plot_refuses_bad_input(tmp_path: Path) -> None:
    side = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [_Evil(side)], "device_traces": []}))
    r = run_cli("plot", str(evil), "-o", str(tmp_path / "x.png"))
    assert r.returncode == 1 and "refused to load posix.system" in r.stderr
    assert not side.exists() and not (tmp_path / "x.png").exists()
    r = run_cli("plot", str(SHIPPED), "-o", str(tmp_path / "y.png"))
    assert r.returncode == 2 and "gmptrace file" in r.stderr
    r = run_cli("plot", str(SHIPPED))
    assert r.returncode == 2 and "-o/--output" in r.stderr


# -- bench: moved to benchmarks/run_all.py (tests/test_bench_script.py) ---------------


def test_bench_says_in_one_line_where_it_moved(tmp_path: Path) -> None:
    """bench looked for a source checkout from the installed package; the
    benchmarks are the checkout's: the command says in one line where."""
    for args in (("bench",), ("bench", "--dry-run", "--out", str(tmp_path))):
        r = run_cli(*args, cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.count("\n") == 1 and "python benchmarks/run_all.py" in r.stderr
    r = run_cli("bench", "--json", cwd=tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2


# -- bad input: clean errors, never a traceback (review regressions) ----------------


def _clean_error(capsys, argv: list[str], code: Optional[int] = None) -> str:
    """main(argv) fails the CLI's usual way: an exit status, one message."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc != 0 and (code is None or rc == code), (rc, out, err)
    # a progress bar (its line ended) may come first: the message is the last line
    err = err.rsplit("\n", 2)[-2] + "\n" if err.count("\n") > 1 else err
    assert "Traceback" not in err and err.startswith("python -m gpumempool: error: "), err
    return err


@pytest.mark.parametrize("body, match", [
    ('@ {"x": NaN}\n', "standard JSON"),
    ('@ {"devices": 1e400}\n', "out of range"),
    ('@ {"devices": 100000000}\n', "'devices'"),
    ("@ " + '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "nested deeper"),
])
def test_replay_bad_metadata_is_a_clean_error(tmp_path: Path, capsys, body: str, match: str) -> None:
    path = tmp_path / "bad.trace"
    path.write_text("gmptrace 1\n" + body + "a 1 512 0\nf 1\n")
    assert match in _clean_error(capsys, ["replay", str(path), "--json"])


def test_replay_json_is_standard_json(tmp_path: Path, capsys, monkeypatch) -> None:
    from gpumempool._cli import common

    tr = Trace.loads("gmptrace 1\na 1 512 0\nf 1\n")
    tr.meta["ratio"] = float("nan")  # a metadata value JSON cannot hold, set through the API
    monkeypatch.setattr(common, "load_trace", lambda path, args: tr)
    assert main(["replay", "x.trace", "--json", "--save-trace", str(tmp_path / "out.trace")]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and json.loads(out)["trace"]["meta"]["ratio"] is None


def test_replay_bad_policy_and_save_path_are_clean_errors(tmp_path: Path, capsys) -> None:
    path = tmp_path / "ok.trace"
    path.write_text("gmptrace 1\na 1 512 0\nf 1\n")
    assert "not a whole" in _clean_error(capsys, ["replay", str(path), "--policy", "limit=1e400"], 2)
    assert "too large" in _clean_error(capsys, ["replay", str(path), "--policy", "limit=1" + "0" * 30], 2)
    assert "--save-trace" in _clean_error(capsys, ["replay", str(path), "--save-trace", "/nonexistent/dir/x.trace"])


def test_non_numeric_time_of_an_unknown_action(tmp_path: Path, capsys) -> None:
    snap = {"segments": [], "device_traces": [
        [{"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 1}],
        [{"action": "snapshot", "time_us": "x"}, {"action": "alloc", "addr": 2, "size": 512, "time_us": None}],
    ]}
    path = tmp_path / "mixed.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert "time_us must be a number" in _clean_error(capsys, ["replay", str(path), "--no-progress"])
    from gpumempool.plot import timeline

    tl = timeline(snap)  # the plot takes what it can: unusable times count as 0
    assert tl["requested"][-1] == 1024 and tl["time_us"] == [0, 0, 0, 1]


def test_corrupt_gzip_inputs_are_clean_errors(tmp_path: Path, capsys) -> None:
    good = gzip.compress(b"gmptrace 1\n" + b"a 1 512 0\n" * 1000)
    bad = bytearray(good)
    for i in range(20, 60):
        bad[i] ^= 0xFF
    for name in ("bad.trace.gz", "bad.pickle.gz"):
        path = tmp_path / name
        path.write_bytes(bytes(bad))
        assert "gzip" in _clean_error(capsys, ["replay", str(path), "--no-progress"])
        assert "gzip" in _clean_error(capsys, ["plot", str(path), "-o", str(tmp_path / "x.png"), "--no-progress"])


def test_crafted_pickles_are_clean_errors(tmp_path: Path, capsys) -> None:
    path = tmp_path / "shared.pickle"
    e = {"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 0}
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[e] * 1000] * 1000}))
    assert "shared references" in _clean_error(capsys, ["replay", str(path), "--no-progress"])
    assert "shared references" in _clean_error(capsys, ["plot", str(path), "-o", str(tmp_path / "x.png"),
                                                        "--no-progress"])
    memo = tmp_path / "memo.pickle"
    memo.write_bytes(b"\x80\x04}r\x40\x42\x0f\x00.")
    assert "memo index" in _clean_error(capsys, ["replay", str(memo), "--no-progress"])


def test_json_callers_always_get_json_on_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pickle")
    for cmd in (["replay", missing, "--json"], ["replay", missing, "--json", "--policy", "bogus=1"],
                ["plot", missing, "-o", str(tmp_path / "x.png"), "--json"]):
        r = run_cli(*cmd)
        assert r.returncode != 0 and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert "error" in json.loads(r.stdout), cmd


def test_a_reader_that_goes_away_is_no_error() -> None:
    # `python -m gpumempool replay T --json | head -1`: a broken pipe ends the
    # command quietly (status 141, as a shell reports SIGPIPE), no traceback
    trace = str(ROOT / "benchmarks" / "traces" / "demo-synthetic.trace.gz")
    proc = subprocess.Popen([sys.executable, "-m", "gpumempool", "replay", trace, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd="/", env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the JSON is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_demo_snapshot_then_plot_and_replay(tmp_path: Path) -> None:
    """Issue 18: nothing in the CLI saved a snapshot, so the docs' `plot
    snapshot.pickle` had no input a newcomer could make. `demo --snapshot`
    writes one (atomically) that `plot` draws and `replay` replays."""
    pytest.importorskip("matplotlib")
    snap = tmp_path / "demo.pickle"
    r = run_cli("demo", "--steps", "6", "--layers", "3", "--no-progress", "--snapshot", str(snap), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"| snapshot " in r.stdout and str(snap) in r.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["demo.pickle"], "no temporary file is left"
    data = pickle.loads(snap.read_bytes())
    assert data["device_traces"][0] and data["segments"]
    png = tmp_path / "x.png"
    r = run_cli("plot", str(snap), "-o", str(png), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == PNG
    r = run_cli("plot", str(snap), "-o", str(tmp_path / "y.png"), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["events"] == len(data["device_traces"][0])
    r = run_cli("replay", str(snap), "--json", "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ooms"] == 0


def test_demo_snapshot_refuses_a_bad_path_before_the_run(tmp_path: Path) -> None:
    old = tmp_path / "keep.pickle"
    old.write_bytes(b"old")
    for target, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "f.pickle", "no such directory")):
        r = run_cli("demo", "--steps", "2", "--layers", "2", "--no-progress", "--snapshot", str(target), cwd=tmp_path)
        assert r.returncode == 1 and why in r.stderr and "--snapshot" in r.stderr, r.stderr
        assert "peak reserved" not in r.stdout, "refused before the demo ran"
        assert "Traceback" not in r.stderr
    assert old.read_bytes() == b"old"


def test_demo_replay_and_plot_name_each_figure_alike(tmp_path: Path) -> None:
    """Issue 18: `plot --json`'s `peak_allocated` was what replay calls
    `peak_requested`. For one recording, every figure the three commands
    report has one name (gpumempool._summary.FIGURES) and, where two of them
    measure the same run, the same value; their tables use the same labels."""
    pytest.importorskip("matplotlib")
    from gpumempool._summary import FIGURES

    snap = tmp_path / "demo.pickle"
    r = run_cli("demo", "--steps", "8", "--layers", "4", "--json", "--snapshot", str(snap), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    demo = json.loads(r.stdout)
    r = run_cli("plot", str(snap), "-o", str(tmp_path / "p.png"), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plot = json.loads(r.stdout)
    r = run_cli("replay", str(snap), "--json", "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)

    figures = set(FIGURES)
    assert figures <= set(demo) and figures <= set(rep), "demo and replay report every figure"
    assert set(plot) & figures == {"peak_requested", "peak_reserved"}, "plot's history holds requested sizes only"
    # the same names mean the same numbers: the demo's pool, its recorded
    # history (plot) and a replay of that history under the recorded policy
    assert plot["peak_requested"] == demo["peak_requested"] == rep["peak_requested"] > 0
    assert plot["peak_reserved"] == demo["peak_reserved"] == rep["recorded_peak_reserved"] > 0
    assert rep["peak_allocated"] == demo["peak_allocated"] >= demo["peak_requested"]
    assert rep["peak_reserved"] == demo["peak_reserved"]
    assert rep["fragmentation"] == pytest.approx(demo["fragmentation"])
    assert rep["backend_calls"] == demo["backend_calls"] and rep["allocations"] == demo["allocations"]
    # the tables
    r = run_cli("demo", "--steps", "8", "--layers", "4", "--no-progress", cwd=tmp_path)
    demo_rows = {line.split("|")[1].strip() for line in r.stdout.splitlines() if line.startswith("| ")}
    r = run_cli("replay", str(snap), "--no-progress", cwd=tmp_path)
    rep_rows = {line.split("|")[1].strip() for line in r.stdout.splitlines() if line.startswith("| ")}
    labels = {label for label, _ in FIGURES.values()}
    assert labels <= demo_rows and labels <= rep_rows, (demo_rows, rep_rows)
    r = run_cli("plot", str(snap), "-o", str(tmp_path / "q.png"), cwd=tmp_path)
    assert "peak requested" in r.stdout and "peak reserved" in r.stdout and "peak allocated" not in r.stdout


def test_plot_directory_of_rank_snapshots(tmp_path: Path) -> None:
    """plot DIRECTORY draws the ranks' snapshots (gpumempool.distributed.
    dump_snapshots' rankNNNNN.pickle files) side by side and names the rank
    that reserves the most; a directory without them is a message."""
    pytest.importorskip("matplotlib")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    code = textwrap.dedent(f"""
        import gpumempool as gmp
        gmp.record_history(True)
        for rank, mib in enumerate([3, 9, 5]):
            with gmp.MemPool("sim", name=f"r{{rank}}") as pool:
                ptrs = [pool.alloc(mib << 20) for _ in range(3)]
                for p in ptrs:
                    pool.free(p)
                gmp.dump_snapshot({str(snaps)!r} + f"/rank{{rank:05d}}.pickle", pool.snapshot())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (snaps / "notes.txt").write_text("not a snapshot")  # other files are left alone
    r = run_cli("plot", str(snaps), "-o", str(tmp_path / "ranks.png"), "--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert [x["rank"] for x in summary["ranks"]] == [0, 1, 2] and summary["peak_rank"] == 1
    assert summary["ranks"][1]["peak_requested"] == 27 << 20
    assert (tmp_path / "ranks.png").stat().st_size > 10_000
    r = run_cli("plot", str(snaps), "-o", str(tmp_path / "ranks.png"), "--no-progress")
    assert r.returncode == 0 and "3 ranks side by side; rank 1 reserves the most" in r.stdout

    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("plot", str(empty), "-o", str(tmp_path / "x.png"))
    assert r.returncode == 1 and "no rank snapshots" in r.stderr and "Traceback" not in r.stderr
