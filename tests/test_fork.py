"""fork(): Go's runtime does not survive it, so a forked child must get a
clear ForkedProcessError from anything gpumempool (or NULL / -1 with that
reason through the C ABI), never a hang; its exit handlers must not enter
Go; and a child that never touches gpumempool works as before.

Each case forks REPEAT children from a parent that has used pools (and,
where it matters, has threads inside the engine at the moment of fork),
each child with its own deadline: a hang shows as a timeout, a crash as a
signal. Everything runs in a subprocess of pytest, so a hang cannot take
the test run with it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPEAT = 20
CHILD_TIMEOUT_S = 20

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

# The harness: run(child) forks REPEAT children running child() and checks
# that each exits 0 within CHILD_TIMEOUT_S. The parent uses pools before and
# after. Prints "OK <n>" at the end.
HARNESS = textwrap.dedent(f"""
    import contextlib, os, sys, time, signal, threading, warnings
    import gpumempool as gmp

    REPEAT, CHILD_TIMEOUT_S = {REPEAT}, {CHILD_TIMEOUT_S}
    MiB = 1 << 20

    def run(child, exit_normally=False):
        # exit_normally: the child ends with sys.exit, so the interpreter
        # shuts down as usual (atexit handlers, finalizers), else os._exit.
        for i in range(REPEAT):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = child(i)
                except BaseException as exc:  # a failure of the case, reported
                    print(f"child {{i}}: {{type(exc).__name__}}: {{exc}}", file=sys.stderr, flush=True)
                    code = 3
                if exit_normally:
                    sys.exit(code)
                os._exit(code if isinstance(code, int) else 0)
            deadline = time.monotonic() + CHILD_TIMEOUT_S
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    sys.exit(f"child {{i}} hung (killed after {{CHILD_TIMEOUT_S}} s)")
                time.sleep(0.005)
            if os.WIFSIGNALED(status):
                sys.exit(f"child {{i}} died of signal {{os.WTERMSIG(status)}}")
            if os.WEXITSTATUS(status) != 0:
                sys.exit(f"child {{i}} exited {{os.WEXITSTATUS(status)}}")
        print("OK", REPEAT, flush=True)

    @contextlib.contextmanager
    def engine_busy(pools):
        # Two threads per pool in the engine (fast path, gopy, snapshots)
        # for as long as the block runs; the pools are checked and closed after.
        stop = threading.Event()
        def hammer(pool):
            while not stop.is_set():
                p = pool.alloc(4096)
                pool.stats()
                pool.free(p)
                pool.snapshot()
        threads = [threading.Thread(target=hammer, args=(p,)) for p in pools for _ in range(2)]
        for t in threads:
            t.start()
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join()
        for pool in pools:
            pool.check()
            pool.close()

    def refused(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except gmp.ForkedProcessError as exc:
            assert isinstance(exc, RuntimeError) and "forked" in str(exc) and "'spawn'" in str(exc), exc
            return True
        raise AssertionError(f"{{fn}} did not refuse in a forked child")
""")


def run_case(body: str, timeout: float = 300) -> subprocess.CompletedProcess:
    script = HARNESS + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONSAFEPATH": "1", "PYTHONWARNINGS": "default"})
    assert r.returncode == 0 and f"OK {REPEAT}" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    return r


def test_a_child_calling_an_inherited_pool_in_a_loop_is_refused_every_time() -> None:
    """The reported hang: pool.stats() in a loop in the child."""
    run_case("""
        pool = gmp.MemPool("sim", capacity=256 * MiB)
        keep = [pool.alloc(MiB) for _ in range(8)]
        def child(i):
            for _ in range(200):
                refused(pool.stats)
            return 0
        run(child)
        pool.free(keep.pop())  # the parent goes on
        assert pool.stats()["allocation.all.current"] == 7
    """)


def test_every_kind_of_call_in_a_child_is_refused() -> None:
    run_case("""
        import ctypes
        pool = gmp.MemPool("sim", capacity=256 * MiB)
        ptrs = [pool.alloc(MiB) for _ in range(4)]
        slot_path, alloc_sym, free_sym = pool.pluggable_symbols()
        def child(i):
            refused(pool.alloc, MiB)                      # the C fast path
            refused(pool.free, ptrs[0])
            refused(pool.snapshot)                        # gopy's wrappers
            refused(pool.empty_cache)
            refused(pool.check)
            refused(gmp.MemPool, "sim")                   # a new pool: the engine is the parent's
            refused(gmp.snapshot)
            refused(pool.close)
            # The C ABI (what torch calls): NULL / -1, and the reason.
            lib = ctypes.CDLL(slot_path)
            alloc = getattr(lib, alloc_sym)
            alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            assert not alloc(4096, 0, None)
            lib.gmp_pool_alloc.restype = ctypes.c_void_p
            lib.gmp_pool_alloc.argtypes = [ctypes.c_int64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            assert not lib.gmp_pool_alloc(pool.handle, 4096, 0, None)
            lib.gmp_pool_free.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            assert lib.gmp_pool_free(pool.handle, ptrs[1], MiB, 0, None) == -1
            getattr(lib, free_sym)(ctypes.c_void_p(ptrs[1]), MiB, 0, None)  # ignored, no hang
            buf = ctypes.create_string_buffer(1024)
            lib.gmp_last_error.restype = ctypes.c_size_t
            lib.gmp_last_error.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]
            n = lib.gmp_last_error(pool.handle, buf, len(buf))
            assert buf.value.startswith(b"ForkedProcessError: ") and n > 100, buf.value
            lib.gmp_last_error_value.restype = ctypes.c_size_t
            lib.gmp_last_error_value.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]
            lib.gmp_last_error_value(pool.handle, buf, len(buf))  # the same, as the value Python reads
            from gpumempool._errors import error_from_value
            err = error_from_value(buf.value.decode())
            assert type(err) is gmp.ForkedProcessError and "this process was forked" in str(err), buf.value
            small = ctypes.create_string_buffer(100)  # shortened, never cut: it still decodes
            n = lib.gmp_last_error_value(pool.handle, small, len(small))
            assert n == len(small.value) < len(small), (n, small.value)
            assert type(error_from_value(small.value.decode())) is gmp.ForkedProcessError, small.value
            assert lib.gmp_in_forked_child() == 1
            return 0
        run(child)
        for p in ptrs:
            pool.free(p)
        pool.check()
        assert ctypes.CDLL(slot_path).gmp_in_forked_child() == 0
    """)


def test_a_child_that_exits_normally_with_live_blocks_does_not_enter_go() -> None:
    """sys.exit() runs the inherited atexit handlers (the leak report and the
    callback shutdown): they must do nothing in the child. No warning, no
    traceback, exit status 0."""
    r = run_case("""
        import subprocess
        pool = gmp.MemPool("sim", capacity=256 * MiB)
        live = [pool.alloc(MiB) for _ in range(16)]
        cb = gmp.MemPool(alloc=lambda size, device, stream: 0x10000000, free=lambda *a: None)
        cb_live = cb.alloc(4096)
        def child(i):
            r = subprocess.run([sys.executable, "-c", "pass"])  # fork + exec still works here
            assert r.returncode == 0
            return 0
        run(child, exit_normally=True)  # the inherited atexit handlers run in each child
        warnings.simplefilter("ignore", gmp.LeakWarning)  # the parent's own leak report at its exit
    """)
    assert "Traceback" not in r.stderr and "LeakWarning" not in r.stderr, r.stderr[-2000:]


def test_a_child_loads_snapshot_pickles_without_the_engine() -> None:
    """Review: loading a snapshot pickle is data work that needs no pool, but
    its scan went through the Go scanner (the C fast path), replaced by the
    refusal in a child: a fork worker that analyses snapshots got
    ForkedProcessError. It scans in a new process there, with the same checks."""
    run_case("""
        import pickle, tempfile
        from gpumempool._safepickle import load_pickle
        from gpumempool._safepickle import UnsafePickleError
        pool = gmp.MemPool("sim", capacity=256 * MiB)
        live = pool.alloc(MiB)
        path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
        gmp.dump_snapshot(path)
        want = load_pickle(path)
        class Evil:
            def __reduce__(self):
                return (os.system, ("true",))
        evil = pickle.dumps(Evil(), protocol=4)
        def child(i):
            assert load_pickle(path) == want
            try:
                load_pickle(evil)
            except UnsafePickleError:
                pass
            else:
                raise AssertionError("a malicious pickle was loaded")
            refused(pool.stats)
            return 0
        run(child)
        pool.free(live)
        pool.close()
    """)


def test_a_fork_while_other_threads_are_inside_the_engine_never_hangs_the_child() -> None:
    """Threads hammer pools (the Python fast path, gopy's wrappers, the
    callback backend) while the main thread forks: locks they held at fork
    are made anew in the child, and every call there is refused."""
    run_case("""
        pools = [gmp.MemPool("sim", capacity=512 * MiB) for _ in range(2)]
        def child(i):
            for pool in pools:
                refused(pool.stats)
                refused(pool.alloc, 4096)
                refused(pool.close)
            from gpumempool._pool import open_pools
            refused(open_pools()[0].snapshot)
            return 0
        with engine_busy(pools):
            run(child)
    """)


def test_a_fork_that_skips_pythons_fork_hooks_never_hangs_the_child() -> None:
    """Review: a fork from C (libc's fork() called by an extension, here with
    the GIL held) runs the C flag's pthread_atfork handler but not Python's
    os.register_at_fork hooks, so the gopy functions were not replaced and
    the child entered Go through them: with threads inside the engine at the
    fork, most such children hung. The extension's functions check the
    process as they are looked up and fence the child off then."""
    run_case("""
        import ctypes
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held across fork()
        libc.fork.restype = ctypes.c_int
        os.fork = libc.fork  # the harness's forks skip Python's hooks
        pools = [gmp.MemPool("sim", capacity=512 * MiB) for _ in range(2)]
        def child(i):
            refused(pools[i % 2].snapshot)
            refused(pools[i % 2].stats)
            refused(pools[i % 2].alloc, 4096)
            refused(gmp.devices)
            return 0
        with engine_busy(pools):
            run(child)
    """)


def test_children_that_never_touch_gpumempool_work_as_before() -> None:
    """Pure-Python multiprocessing workers (fork start method), fork + exec
    and subprocess from a parent that has used pools."""
    run_case("""
        import multiprocessing as mp, subprocess
        pool = gmp.MemPool("sim", capacity=256 * MiB)
        live = pool.alloc(MiB)
        def child(i):
            total = sum(x * x for x in range(10000))
            assert total == 333283335000
            if i % 5 == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import sys; sys.exit(0)"])
            return 0
        run(child)
        with mp.get_context("fork").Pool(2) as workers:
            assert workers.map(abs, range(-50, 0)) == list(range(50, 0, -1))
        assert subprocess.run([sys.executable, "-c", "import gpumempool as g; g.MemPool().close()"]).returncode == 0
        pool.free(live)
        pool.close()
    """)


def test_a_fork_worker_using_an_inherited_pool_gets_the_error_in_the_parent() -> None:
    """multiprocessing with the fork start method: the worker's
    ForkedProcessError reaches the parent as that exception."""
    run_case("""
        import multiprocessing as mp
        pool = gmp.MemPool("sim", capacity=256 * MiB)
        def use(n):
            return pool.alloc(n)
        run(lambda i: 0)
        with mp.get_context("fork").Pool(1) as workers:
            try:
                workers.map(use, [4096])
            except gmp.ForkedProcessError as exc:
                assert "'spawn' or 'forkserver'" in str(exc)
            else:
                raise AssertionError("the worker's allocation was not refused")
        with mp.get_context("spawn").Pool(1) as workers:  # the way that works
            assert workers.map(abs, [-1]) == [1]
        pool.close()
    """)


def test_the_throwing_torch_entry_point_throws_the_fork_error(cxx_caller) -> None:
    """gmp_alloc_or_throw_<i> (full replacement) in a forked child: the C++
    exception torch turns into a RuntimeError, with the reason."""
    import ctypes

    import gpumempool as gmp

    with gmp.MemPool("sim", capacity=64 << 20) as pool:
        path, a_sym, _ = pool.pluggable_symbols(throw_on_oom=True)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            out, msg = ctypes.c_void_p(), ctypes.create_string_buffer(2048)
            rc = cxx_caller.call_alloc(path.encode(), a_sym.encode(), 4096, 0, None, ctypes.byref(out), msg, len(msg))
            os.write(w, f"{rc}|{msg.value.decode()}".encode())
            os._exit(0)
        os.close(w)
        got = os.read(r, 4096).decode()
        os.close(r)
        os.waitpid(pid, 0)
    rc, msg = got.split("|", 1)
    assert rc == "1" and "ForkedProcessError: this process was forked" in msg, got


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "vmm", "async"])
def test_a_child_touching_an_inherited_cuda_pool_gets_the_clear_error(backend: str) -> None:
    """On a GPU: CUDA itself refuses a forked child ("Cannot re-initialize
    CUDA in forked subprocess"); an inherited pool of a CUDA backend gives
    ForkedProcessError, never a hang, and the parent's pool keeps working."""
    run_case(f"""
        pool = gmp.MemPool({backend!r}, device=0)
        keep = [pool.alloc(MiB) for _ in range(4)]
        def child(i):
            for _ in range(50):
                refused(pool.alloc, MiB)
                refused(pool.stats)
            refused(pool.free, keep[0])
            refused(pool.empty_cache)
            return 0
        run(child, exit_normally=True)
        for p in keep:
            pool.free(p)
        pool.check()
        pool.close()
    """)
