"""gpumempool.distributed: every rank's pools on rank 0, and one snapshot per
rank drawn side by side; torch.distributed's gloo backend on CPU in 2 and 4
processes, each with its own sim pools (skipped without torch)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import import_or_skip

import_or_skip("torch", module_level=True)
import_or_skip("torch.distributed", module_level=True)

MiB = 1 << 20

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    import gpumempool as gmp
    import gpumempool.distributed as gd

    out = sys.argv[1]
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    gmp.record_history(True)
    # Every rank has "weights"; odd ranks also "activations"; the last odd rank peaks.
    weights = gmp.MemPool("sim", name="weights")
    keep = [weights.alloc((rank + 1) * 3 << 20) for _ in range(2)]
    pools = [weights]
    if rank % 2:
        acts = gmp.MemPool("sim", name="activations")
        pools.append(acts)
        big = [acts.alloc((40 + rank) << 20), acts.alloc(8 << 20)]
        acts.free(big.pop(0))  # 40+ MiB cached but free
    report = gd.memory_report()
    paths = gd.dump_snapshots(os.path.join(out, "snaps"))
    assert len(paths) == dist.get_world_size()
    if rank == 0:
        assert report is not None
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump({"table": report.table(), "report": report.as_dict(), "paths": paths}, f)
    else:
        assert report is None, "only rank 0 gets the report"
    dist.barrier()
    for ptr in keep:
        weights.free(ptr)
    if rank % 2:
        acts.free(big.pop())
    for p in pools:
        p.close()
    dist.destroy_process_group()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(source: str, n: int, tmp_path: Path, *args: str, timeout: float = 240) -> list[tuple[int, str, str]]:
    """Run ``source`` as ranks 0..n-1 of a gloo group (a process each, with
    ``args``); their (exit status, stdout, stderr). A rank still running at
    ``timeout`` fails the test, and no process outlives it."""
    script = tmp_path / "rank.py"
    script.write_text(source)
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONSAFEPATH="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        pytest.fail("a rank hung")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, so, se) for p, (so, se) in zip(procs, outs)]


def run_ranks(n: int, tmp_path: Path) -> dict:
    for r, (rc, _, se) in enumerate(launch_ranks(RANK_SCRIPT, n, tmp_path, str(tmp_path))):
        assert rc == 0, f"rank {r}: {se[-3000:]}"
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize("world", [2, 4])
def test_memory_report_across_ranks(world: int, tmp_path: Path) -> None:
    doc = run_ranks(world, tmp_path)
    rep = doc["report"]
    assert rep["world_size"] == world and [r["rank"] for r in rep["ranks"]] == list(range(world))
    for r in rep["ranks"]:
        pools = {p["pool"]: p for p in r["pools"]}
        w = pools["weights"]
        assert w["allocated"] == 2 * (r["rank"] + 1) * 3 * MiB
        assert w["top_blocks"][:2] == [(r["rank"] + 1) * 3 * MiB] * 2
        if r["rank"] % 2:
            a = pools["activations"]
            assert a["cached_free"] >= 40 * MiB and a["allocated"] == 8 * MiB
            assert a["peak_allocated"] >= (48 + r["rank"]) * MiB  # large blocks round up to 2 MiB
        else:
            assert "activations" not in pools
    odd = [r for r in range(world) if r % 2]
    # which rank peaks, which pool, how much is cached but free
    peak = rep["peak"]
    assert (peak["rank"], peak["pool"]) == (odd[-1], "activations")
    assert rep["rank_totals"][str(odd[-1])]["cached_free"] >= 40 * MiB
    table = doc["table"]
    assert f"peak: rank {odd[-1]}, pool 'activations'" in table
    assert f"pool 'activations' exists on rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} only" \
        in table
    assert "cached but free now:" in table
    # one snapshot per rank, drawn side by side
    snaps = tmp_path / "snaps"
    assert sorted(os.listdir(snaps)) == [f"rank{r:05d}.pickle" for r in range(world)]
    assert doc["paths"] == [str(snaps / f"rank{r:05d}.pickle") for r in range(world)]
    import_or_skip("matplotlib")
    png = tmp_path / "ranks.png"
    p = subprocess.run([sys.executable, "-m", "gpumempool", "plot", str(snaps), "-o", str(png), "--json",
                        "--no-progress"], capture_output=True, text=True, timeout=120, cwd="/")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert [r["rank"] for r in summary["ranks"]] == list(range(world))
    assert summary["peak_rank"] == odd[-1] and png.stat().st_size > 10_000


def test_without_an_initialized_process_group_is_an_error() -> None:
    import gpumempool.distributed as gd

    with pytest.raises(RuntimeError, match="not initialized"):
        gd.memory_report()
    with pytest.raises(RuntimeError, match="not initialized"):
        gd.dump_snapshots("/nonexistent")


FAILING_RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    import gpumempool as gmp
    import gpumempool._snapshot as snapshots
    import gpumempool.distributed as gd

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    pool = gmp.MemPool("sim", name="weights")
    if rank == 1:
        def snapshot():
            raise MemoryError("no memory left for the snapshot")
        snapshots.snapshot = snapshot
    try:
        gd.dump_snapshots(sys.argv[1])
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
    else:
        print("no error")
    pool.close()
    dist.destroy_process_group()
    """
)


def test_a_rank_whose_snapshot_fails_leaves_no_rank_waiting(tmp_path: Path) -> None:
    """dump_snapshots is a collective: a rank that cannot write its snapshot
    (here a MemoryError, not an OSError) still takes part, and every rank
    raises, naming it, instead of the others waiting for it forever."""
    outs = [out for _, out, _ in launch_ranks(FAILING_RANK_SCRIPT, 2, tmp_path, str(tmp_path / "snaps"), timeout=90)]
    for r, out in enumerate(outs):
        assert "rank 1: MemoryError: no memory left for the snapshot" in out, f"rank {r}: {out}"


REPORT_FAILING_RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    import gpumempool as gmp
    import gpumempool.distributed as gd

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    pool = gmp.MemPool("sim", name="weights")
    if rank == 1:
        def broken():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        gd._torch_native_row = broken  # torch's allocator cannot be read on this rank
    try:
        report = gd.memory_report()
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
    else:
        print(report.table() if report is not None else "not rank 0")
    pool.close()
    dist.destroy_process_group()
    """
)


def test_a_rank_whose_report_fails_is_named_in_the_report(tmp_path: Path) -> None:
    """memory_report is a collective: a rank whose own figures cannot be
    read still takes part, and the report says so, instead of that rank
    raising alone and the others failing in the gather or waiting for it."""
    outs = [out for _, out, _ in launch_ranks(REPORT_FAILING_RANK_SCRIPT, 2, tmp_path, timeout=90)]
    assert "rank 1" in outs[0] and "not read (RuntimeError: CUDA error: an illegal memory access" in outs[0], outs[0]
    assert "(this rank)' exists" not in outs[0] and "rank 1 has no open pools" not in outs[0], outs[0]
    assert outs[1].strip() == "not rank 0", outs[1]


OOM_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    import gpumempool as gmp
    import gpumempool.distributed as gd

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    os.environ["RANK"] = "99"  # the process group's rank wins over the environment
    gd.snapshot_on_oom(sys.argv[1])
    pool = gmp.MemPool("sim", name="acts", limit=64 << 20)
    keep = [pool.alloc((rank + 1) << 20)]
    dist.barrier()
    if rank == 1:
        try:
            pool.alloc(256 << 20)
        except gmp.OutOfMemoryError as e:
            print(e.gmp_oom_snapshot)
    dist.barrier()
    pool.free(keep[0])
    pool.close()
    dist.destroy_process_group()
    """
)


def test_only_the_rank_that_runs_out_of_memory_writes_a_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "oom"
    results = launch_ranks(OOM_SCRIPT, 2, tmp_path, str(out))
    for r, (rc, _, se) in enumerate(results):
        assert rc == 0, f"rank {r}: {se[-3000:]}"
    assert sorted(os.listdir(out)) == ["rank00001-oom1.pickle"]
    assert results[1][1].strip() == str(out / "rank00001-oom1.pickle")
    with open(out / "rank00001-oom1.pickle", "rb") as f:
        snap = pickle.load(f)
    assert snap["rank"] == 1 and "out of memory" in snap["oom"]["message"]
    live = [b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert live == [2 << 20]
