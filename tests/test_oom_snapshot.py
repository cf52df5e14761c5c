"""gpumempool.distributed.snapshot_on_oom: the rank that runs out of memory
writes its own snapshot, at that moment, by whichever path the error takes
(a pool call, torch's observer, an uncaught error)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

import gpumempool as gmp
import gpumempool.distributed as gd
from gpumempool import _oom_snapshot

MiB = 1 << 20


@pytest.fixture
def pool() -> Iterator[gmp.MemPool]:
    with gmp.MemPool("sim", name="capped", limit=32 * MiB, capacity=64 * MiB) as p:
        yield p


def run_oom(pool: gmp.MemPool) -> gmp.OutOfMemoryError:
    with pytest.raises(gmp.OutOfMemoryError) as info:
        pool.alloc(64 * MiB)
    return info.value


def load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert isinstance(snap, dict)
    return snap


def test_a_caught_pool_oom_writes_the_rank_snapshot_at_that_moment(pool: gmp.MemPool, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    live = pool.alloc(6 * MiB)
    with pytest.warns(RuntimeWarning, match=r"rank 3 ran out of memory \(a gpumempool pool call\)"):
        with gd.snapshot_on_oom(tmp_path / "oom") as snaps:
            err = run_oom(pool)
    path = str(tmp_path / "oom" / "rank00003-oom1.pickle")
    assert snaps.written == [path]
    assert getattr(err, "gmp_oom_snapshot") == path
    snap = load(path)
    assert snap["rank"] == 3 and snap["pid"] == os.getpid()
    assert snap["oom"]["trigger"] == "a gpumempool pool call"
    assert "out of memory" in snap["oom"]["message"] and '"capped"' in snap["oom"]["message"]
    # the block alive at the failure is in it
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert [b["size"] for b in blocks] == [6 * MiB]
    pool.free(live)


def test_max_snapshots_and_close(pool: gmp.MemPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        snaps = gd.snapshot_on_oom(tmp_path, max_snapshots=2)
        errs = [run_oom(pool) for _ in range(3)]
    assert [os.path.basename(p) for p in snaps.written] == ["rank00000-oom1.pickle", "rank00000-oom2.pickle"]
    assert [getattr(e, "gmp_oom_snapshot") for e in errs] == snaps.written + [None]
    snaps.close()
    assert snaps.closed
    err = run_oom(pool)
    assert not hasattr(err, "gmp_oom_snapshot"), "closed: no longer listening"
    assert sorted(os.listdir(tmp_path)) == ["rank00000-oom1.pickle", "rank00000-oom2.pickle"]
    assert sys.excepthook is not snaps._sys_hook
    assert threading.excepthook is not snaps._thread_hook


def test_a_new_call_replaces_the_previous_one(pool: gmp.MemPool, tmp_path: Path) -> None:
    first = gd.snapshot_on_oom(tmp_path / "a")
    second = gd.snapshot_on_oom(tmp_path / "b")
    try:
        assert first.closed and not second.closed
        with pytest.warns(RuntimeWarning):
            run_oom(pool)
        assert not os.listdir(tmp_path / "a")
        assert len(second.written) == 1
    finally:
        second.close()
    assert sys.excepthook is not second._sys_hook and sys.excepthook is not first._sys_hook


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_max_snapshots(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_snapshots must be a positive int"):
        gd.snapshot_on_oom(tmp_path, max_snapshots=bad)


def test_a_directory_that_cannot_be_used_fails_at_the_call(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        gd.snapshot_on_oom(tmp_path / "file")
    assert _oom_snapshot._active is None


def test_a_snapshot_that_cannot_be_written_is_a_warning_not_an_error(pool: gmp.MemPool, tmp_path: Path) -> None:
    target = tmp_path / "gone"
    with gd.snapshot_on_oom(target) as snaps:
        target.rmdir()
        target.write_text("now a file")  # the snapshot cannot go there any more
        with pytest.warns(RuntimeWarning, match="could not be written"):
            err = run_oom(pool)
    assert isinstance(err, gmp.OutOfMemoryError), "the caller still gets its out-of-memory error"
    assert snaps.written == []


def test_an_oom_leaving_the_with_block_unseen_is_written(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="uncaught"):
        with pytest.raises(MemoryError):
            with gd.snapshot_on_oom(tmp_path) as snaps:
                raise MemoryError("host out of memory")
    assert len(snaps.written) == 1
    assert load(snaps.written[0])["oom"]["message"] == "host out of memory"


def test_a_non_oom_error_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        with gd.snapshot_on_oom(tmp_path) as snaps:
            raise KeyError("x")
    assert snaps.written == [] and os.listdir(tmp_path) == []


UNCAUGHT = textwrap.dedent(
    """
    import sys, threading
    import gpumempool as gmp
    import gpumempool.distributed as gd

    out, how = sys.argv[1], sys.argv[2]
    pool = gmp.MemPool("sim", name="p", limit=4 << 20)
    keep = pool.alloc(512 << 10)
    snaps = gd.snapshot_on_oom(out, max_snapshots=3)
    if how == "pool":            # seen by the pool trigger, then uncaught: one file
        pool.alloc(4 << 20)
    elif how == "thread":        # another thread dies of it
        def die():
            raise MemoryError("in a thread")
        t = threading.Thread(target=die)
        t.start(); t.join()
        print("main goes on")
    elif how == "chained":       # an OOM under another error, uncaught
        try:
            raise MemoryError("host")
        except MemoryError as e:
            raise RuntimeError("while loading") from e
    elif how == "other":
        raise KeyError("not memory")
    """
)


@pytest.mark.parametrize(("how", "files", "code"), [
    ("pool", ["rank00002-oom1.pickle"], 1),
    ("thread", ["rank00002-oom1.pickle"], 0),
    ("chained", ["rank00002-oom1.pickle"], 1),
    ("other", [], 1),
])
def test_an_uncaught_oom_in_a_process(tmp_path: Path, how: str, files: list[str], code: int) -> None:
    script = tmp_path / "s.py"
    script.write_text(UNCAUGHT)
    out = tmp_path / "out"
    env = dict(os.environ, RANK="2")
    proc = subprocess.run([sys.executable, str(script), str(out), how], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == code, proc.stderr
    assert sorted(os.listdir(out)) == files
    if how != "thread":
        assert "Traceback" in proc.stderr, "the previous excepthook still prints the error"
    else:
        assert "main goes on" in proc.stdout and "in a thread" in proc.stderr
    if files:
        snap = load(str(out / files[0]))
        assert snap["rank"] == 2
        want = "a gpumempool pool call" if how == "pool" else "uncaught"
        assert snap["oom"]["trigger"] == want
        assert [b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"] \
            == [512 << 10]


def test_torch_observer_writes_the_snapshot(pool: gmp.MemPool, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """torch calls its out-of-memory observers on CUDA only; here a stand-in
    records the observer snapshot_on_oom attaches, and calls it as torch does
    (device, requested, allocated, free)."""
    torch = pytest.importorskip("torch")
    attached: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(_oom_snapshot, "_torch_observer", False)
    with gd.snapshot_on_oom(tmp_path) as snaps:
        assert snaps.torch_observer and attached == [_oom_snapshot._torch_oom_observer]
        with pytest.warns(RuntimeWarning, match="torch's CUDA caching allocator"):
            attached[0](0, 3 * MiB, 5 * MiB, 1 * MiB)
        # the torch.OutOfMemoryError that follows was seen: not written again when uncaught
        assert snaps._seen(torch.OutOfMemoryError("CUDA out of memory"))
    assert len(snaps.written) == 1
    snap = load(snaps.written[0])
    assert snap["oom"]["message"] == ("tried to allocate 3145728 bytes on device 0 "
                                      "(5242880 allocated, 1048576 free on the device)")


def test_torch_oom_without_an_observer_is_written_when_uncaught(tmp_path: Path) -> None:
    """Under full replacement (or without CUDA) torch has no observers: an
    uncaught torch.OutOfMemoryError is written by the exception hook."""
    torch = pytest.importorskip("torch")
    with gd.snapshot_on_oom(tmp_path) as snaps:
        assert not snaps.torch_observer  # no CUDA here
        err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        assert _oom_snapshot._is_oom(err) and not snaps._seen(err)
        with pytest.warns(RuntimeWarning, match="uncaught"):
            snaps._uncaught(err)
    assert len(snaps.written) == 1


GPU_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import gpumempool as gmp
    import gpumempool.distributed as gd

    torch.cuda.init()
    snaps = gd.snapshot_on_oom(sys.argv[1], max_snapshots=2)
    assert snaps.torch_observer, "torch's observer attached"
    keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    try:                                   # torch's own allocator runs out
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    pool = gmp.MemPool("cuda", name="routed", limit=256 << 20)
    with gmp.mempool(pool):                # a pool routed through torch's allocator runs out
        try:
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
    print(json.dumps(snaps.written))
    """
)


@pytest.mark.gpu
def test_torch_oom_on_the_gpu_writes_both_snapshots(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "g.py"
    script.write_text(GPU_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, RANK="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = [os.path.basename(p) for p in json.loads(proc.stdout.strip().splitlines()[-1])]
    assert written == ["rank00000-oom1.pickle", "rank00000-oom1-torch.pickle",
                       "rank00000-oom2.pickle", "rank00000-oom2-torch.pickle"]
    native = load(str(tmp_path / "out" / "rank00000-oom1-torch.pickle"))
    assert any(s["total_size"] >= 64 << 20 for s in native["segments"]), "torch's 64 MiB tensor is in its snapshot"
    assert load(str(tmp_path / "out" / "rank00000-oom2.pickle"))["oom"]["trigger"] == "torch's CUDA caching allocator"


# review: hooks, warnings as errors, locks, expected out-of-memory errors -----


@pytest.mark.parametrize("module", ["sys", "threading"])
def test_a_hook_wrapping_ours_is_called_once_whatever_the_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               module: str) -> None:
    """User code that wraps the installed hook (saving it and calling it,
    as error reporters do) between two calls made every exception go round
    ours and theirs until RecursionError; and after a close the hook that
    was there before ours was skipped for the interpreter's default."""
    mod = sys if module == "sys" else threading
    calls: list[str] = []

    def before(*args: Any) -> None:
        calls.append("before")

    monkeypatch.setattr(mod, "excepthook", before)

    def call_hook() -> None:
        calls.clear()
        if module == "sys":
            sys.excepthook(KeyError, KeyError("x"), None)
        else:
            threading.excepthook(threading.ExceptHookArgs((KeyError, KeyError("x"), None, None)))

    first = gd.snapshot_on_oom(tmp_path / "a")
    ours = mod.excepthook

    def wrapper(*args: Any) -> None:
        calls.append("wrapper")
        ours(*args)

    monkeypatch.setattr(mod, "excepthook", wrapper)
    second = gd.snapshot_on_oom(tmp_path / "b")
    try:
        call_hook()
        assert calls == ["wrapper", "before"]
    finally:
        second.close()
    assert mod.excepthook is wrapper, "put back what was there at the call"
    call_hook()
    assert calls == ["wrapper", "before"], "a closed snapshotter's hook still chains to the one before it"


def test_warnings_turned_into_errors_never_replace_the_out_of_memory_error(pool: gmp.MemPool, tmp_path: Path) -> None:
    """write() warns; under -W error (or a filter turning RuntimeWarning into
    an error) the warning was raised: out of torch's observer into torch's
    allocator, out of the with block in place of the user's error (leaving
    the hooks installed), and the pool error lost the path of the file
    that was written."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snaps = gd.snapshot_on_oom(tmp_path, max_snapshots=3)
        try:
            err = run_oom(pool)
            assert getattr(err, "gmp_oom_snapshot") == snaps.written[0]
            _oom_snapshot._torch_oom_observer(0, 1 << 30, 0, 0)  # as torch calls it
            assert len(snaps.written) == 2
        finally:
            snaps.close()
        with pytest.raises(MemoryError, match="host"):
            with gd.snapshot_on_oom(tmp_path / "w") as inner:
                raise MemoryError("host")
        assert inner.closed and len(inner.written) == 1


def test_an_oom_in_a_replay_is_not_this_rank_running_out(pool: gmp.MemPool, tmp_path: Path) -> None:
    """replay (and tune with jobs=1) run traces on private sim pools, where
    an allocation that does not fit is an outcome being counted, not the
    process running out of memory: it wrote a snapshot and used up
    max_snapshots before the real failure came."""
    from gpumempool.replay import replay
    from gpumempool.trace import Trace

    trace = Trace.loads("gmptrace 1\na 1 12582912 0\na 2 12582912 0\nf 1\nf 2\n")
    with gd.snapshot_on_oom(tmp_path) as snaps:
        assert replay(trace, {"limit": 13 * MiB}).ooms == 1
        assert snaps.written == []
        with pytest.warns(RuntimeWarning, match="ran out of memory"):
            run_oom(pool)
    assert [os.path.basename(p) for p in snaps.written] == ["rank00000-oom1.pickle"]


CALLBACK_DEADLOCK = textwrap.dedent(
    """
    import ctypes, faulthandler, sys, threading, warnings
    import gpumempool as gmp
    import gpumempool.distributed as gd
    from gpumempool import _lifecycle

    faulthandler.dump_traceback_later(30, exit=True)  # a deadlock fails instead of hanging
    warnings.simplefilter("ignore", RuntimeWarning)
    live = {}
    in_snapshot = threading.Event()
    real_open_pools = _lifecycle.open_pools

    def open_pools():  # the snapshot of every open pool starts here
        if threading.current_thread().name == "t2":
            in_snapshot.set()
        return real_open_pools()

    _lifecycle.open_pools = open_pools
    other = gmp.MemPool("sim", name="other", limit=4 << 20)
    third = gmp.MemPool("sim", name="third", limit=4 << 20)

    def alloc(size, device, stream):
        # the engine holds cb's lock now; t2 is writing a snapshot and waits for it
        assert in_snapshot.wait(10)
        threading.Event().wait(0.3)
        try:
            other.alloc(64 << 20)
        except gmp.OutOfMemoryError:
            pass
        buf = ctypes.create_string_buffer(size + 512)
        addr = (ctypes.addressof(buf) + 511) & ~511
        live[addr] = buf
        return addr

    def free(ptr, size, device, stream):
        live.pop(ptr, None)

    cb = gmp.MemPool(alloc=alloc, free=free, name="cb")
    snaps = gd.snapshot_on_oom(sys.argv[1], max_snapshots=2)

    def t2():
        try:
            third.alloc(64 << 20)
        except gmp.OutOfMemoryError:
            pass

    t1 = threading.Thread(target=lambda: cb.free(cb.alloc(1 << 20)), name="t1")
    t = threading.Thread(target=t2, name="t2")
    t1.start(); t.start(); t1.join(); t.join()
    snaps.close()
    print(len(snaps.written))
    """
)


def test_a_callback_pool_oom_while_another_thread_writes_does_not_deadlock(tmp_path: Path) -> None:
    """Thread 2 runs out of memory and writes (holding the writer's lock),
    its snapshot waiting for a pool whose Python allocator function runs on
    thread 1 (the engine holds that pool's lock); the function runs out of
    memory in another pool and waited for the writer's lock: deadlock. Both
    are written; thread 1's without the pool it is inside of."""
    script = tmp_path / "d.py"
    script.write_text(CALLBACK_DEADLOCK)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "2"
    snaps = [load(str(tmp_path / "out" / f)) for f in sorted(os.listdir(tmp_path / "out"))]
    assert len(snaps) == 2
    inside = [s for s in snaps if s["oom"].get("pools_not_read")]
    assert len(inside) == 1 and inside[0]["oom"]["pools_not_read"] == ["cb"], [s["oom"] for s in snaps]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_writes_nothing_under_its_parents_name(tmp_path: Path) -> None:
    """A forked child (a DataLoader worker, say) inherits the snapshotter;
    it cannot read a pool (ForkedProcessError) and is not the rank: with no
    pool open it wrote an empty snapshot under the parent's file name."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    snaps = gd.snapshot_on_oom(tmp_path)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    code = 0 if snaps.write("uncaught", "in the child") is None else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.listdir(tmp_path) == []
    finally:
        snaps.close()
