"""NCCL registration of a pool's memory (``pool.register``) on the fake
torch of tests/faketorch.py: register_mem_pool, the ncclCommRegister
fallback, deregistration, and the engine's libnccl reaching a fake
libnccl (tests/csrc/fake_nccl.c) in a fresh interpreter."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import warnings
from typing import Any, Callable

import pytest

import gpumempool as gmp
from gpumempool import torch as gtorch

from faketorch import clean_state, sim  # noqa: F401 - fixtures
from faketorch import MiB, inside_in_another_thread, install


# ---------------------------------------------------------------------------
# NCCL registration
# ---------------------------------------------------------------------------


def test_register_needs_distributed(monkeypatch, sim):
    torch = install(monkeypatch)
    torch._dist_state["initialized"] = False
    with pytest.raises(gtorch.TorchIntegrationError, match="init_process_group"):
        gtorch.register(sim)


def test_register_with_register_mem_pool(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    backend = torch._backend
    gtorch.register(sim)
    (tp,) = gtorch.torch_pools(sim)  # made for the registration
    assert backend.calls == [("register", tp.id)]
    gtorch.register(sim, torch._group)  # the default group again: nothing to do
    assert len(backend.calls) == 1
    with gmp.mempool(sim) as t:
        x = torch.empty(30 * MiB)  # the pool grows: torch >= 2.8 registers it itself
    assert t is tp and backend.calls == [("register", tp.id)]
    assert backend.registered(tp.id) == {x.ptr}
    tp_id = tp.id
    del x, t, tp
    gc.collect()
    gtorch.release(sim)  # deregisters the torch pool that goes
    assert backend.calls[-1] == ("deregister", tp_id)
    with gmp.mempool(sim) as tp2:  # the next torch pool is registered
        pass
    assert backend.calls[-1] == ("register", tp2.id)
    gtorch.deregister(sim)
    assert backend.calls[-1] == ("deregister", tp2.id) and backend.segments == set()
    with gmp.mempool(sim):
        pass
    assert backend.calls[-1] == ("deregister", tp2.id)  # no longer registered


def test_deregister_after_destroy_process_group(monkeypatch, sim):
    """After destroy_process_group the communicator (and with it NCCL's
    registrations) is gone and torch refuses deregister_mem_pool: deregister
    and close forget the registration instead of failing or warning; other
    errors still raise, and a failed deregister keeps nothing half undone."""
    torch = install(monkeypatch, "2.11")
    backend = torch._backend
    gtorch.register(sim)
    (tp,) = gtorch.torch_pools(sim)
    backend.destroyed = True
    gtorch.deregister(sim)
    assert ("deregister", tp.id) not in backend.calls
    gtorch.deregister(sim)  # nothing left
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no LeakWarning about the registration
        gtorch.register(sim)
        sim.close()

    other = gmp.MemPool("sim", capacity=1 << 26)
    backend.destroyed = False
    gtorch.register(other)

    def broken(pool: Any) -> None:
        raise RuntimeError("NCCL error: unhandled cuda error")

    working, backend.deregister_mem_pool = backend.deregister_mem_pool, broken
    with pytest.raises(RuntimeError, match="unhandled cuda error"):
        gtorch.deregister(other)
    backend.deregister_mem_pool = working
    gtorch.deregister(other)  # the failed one is not kept: nothing to do, no error
    other.close()


def test_register_on_old_torch_is_lifted_while_inside(monkeypatch, sim):
    torch = install(monkeypatch, "2.7")
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    backend = torch._backend
    gtorch.register(sim)
    (tp,) = gtorch.torch_pools(sim)
    assert backend.calls == [("register", tp.id)]
    with gmp.mempool(sim):
        assert backend.calls[-1] == ("deregister", tp.id)  # the pool may grow in here
        with gmp.mempool(sim):  # nested: nothing more
            x = torch.empty(1000)
        assert len(backend.calls) == 2
    assert backend.calls[-1] == ("register", tp.id)
    assert backend.registered(tp.id) == {x.ptr}  # the new segment too, without double registration
    with gmp.mempool(sim):
        y = torch.empty(3 * MiB)
    assert backend.registered(tp.id) == {x.ptr, y.ptr}

    # registering while a thread is inside: done when it leaves
    other = gmp.MemPool("sim", capacity=1 << 30)
    with inside_in_another_thread(other, body=lambda _: torch.empty(1000)):
        gtorch.register(other)
        (tpo,) = gtorch.torch_pools(other)
        assert ("register", tpo.id) not in backend.calls
    assert backend.calls[-1] == ("register", tpo.id) and len(backend.registered(tpo.id)) == 1
    del x, y, tp, tpo
    gc.collect()
    gtorch.release(sim)
    gtorch.release(other)
    assert backend.segments == set()
    other.close()


def test_register_explains_a_lazy_communicator(monkeypatch, sim):
    torch = install(monkeypatch)
    torch._backend.comm_error = True
    with pytest.raises(gtorch.TorchIntegrationError, match="device_id"):
        gtorch.register(sim)


class FakeNccl:
    def __init__(self) -> None:
        self.handles: dict[int, tuple[int, int, int]] = {}
        self.next = 1

    def register(self, comm: int, ptr: int, size: int) -> int:
        self.next += 1
        self.handles[self.next] = (comm, ptr, size)
        return self.next

    def deregister(self, comm: int, handle: int) -> None:
        assert self.handles.pop(handle)[0] == comm


def test_register_falls_back_to_nccl_comm_register(monkeypatch, sim):
    torch = install(monkeypatch, "2.5", nccl_mode="comm")
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    nccl = FakeNccl()
    monkeypatch.setattr(gtorch._nccl, "nccl_lib", lambda: nccl)
    gtorch.register(sim)
    assert nccl.handles == {}  # no segment yet
    with gmp.mempool(sim):
        x = torch.empty(1000)
        y = torch.empty(3 * MiB)
    assert sorted((p, s) for _, p, s in nccl.handles.values()) == sorted([(x.ptr, 2 * MiB), (y.ptr, 20 * MiB)])
    assert {c for c, _, _ in nccl.handles.values()} == {0xC0FFEE}
    gtorch.deregister(sim)
    assert nccl.handles == {}


def check_registration_reaches_libnccl(path: str) -> None:
    """test_register_reaches_libnccl_with_the_pool_s_ranges in the fresh
    interpreter it starts, with GMP_LIBNCCL naming the fake libnccl at
    path."""
    lib = ctypes.CDLL(path)  # the copy the engine loaded (or will): one file, one copy
    lib.fake_nccl_registered.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    lib.fake_nccl_registrations.restype = ctypes.c_long

    def registered() -> list[tuple[int, int, int]]:
        out, i = [], 0
        comm, buf, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        while lib.fake_nccl_registered(i, ctypes.byref(comm), ctypes.byref(buf), ctypes.byref(size)):
            out.append((comm.value or 0, buf.value or 0, size.value))
            i += 1
        return out

    with pytest.MonkeyPatch.context() as monkeypatch:
        sim = gmp.MemPool("sim", name="torchpool", devices=2, capacity=1 << 30)
        torch = install(monkeypatch, "2.5", nccl_mode="comm")
        warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
        assert registered() == [] and lib.fake_nccl_registrations() == 0
        gtorch.register(sim)
        assert os.path.realpath(path) in gtorch._nccl.nccl_lib().description
        assert registered() == []  # no segment yet
        with gmp.mempool(sim):
            x = torch.empty(1000)
        with gmp.mempool(sim):  # the pool grows: the registration follows
            y = torch.empty(3 * MiB)
        new = registered()
        assert sorted((b, n) for _, b, n in new) == sorted([(x.ptr, 2 * MiB), (y.ptr, 20 * MiB)])
        assert {c for c, _, _ in new} == {0xC0FFEE}
        for t, n in ((x, 1000), (y, 3 * MiB)):
            assert any(b <= t.ptr and t.ptr + n <= b + size for _, b, size in new)
        assert lib.fake_nccl_registrations() == 2
        gtorch.deregister(sim)
        assert registered() == []
        with open("/proc/self/maps") as maps:
            nccls = {f for f in (line.split()[-1] for line in maps) if "nccl" in os.path.basename(f)}
        assert nccls == {os.path.realpath(path)}, "no NCCL but the fake is loaded"
        del x, y
        sim.close()
        gtorch._reset_for_tests()


def check_registration_needs_ncclcommregister(path: str) -> None:
    """test_register_without_ncclcommregister_is_a_version_error in the
    fresh interpreter it starts, with GMP_LIBNCCL naming the fake libnccl
    without ncclCommRegister at path."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim = gmp.MemPool("sim", name="torchpool", devices=2, capacity=1 << 30)
        install(monkeypatch, "2.5", nccl_mode="comm")
        warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
        with pytest.raises(gtorch.TorchVersionError,
                           match=r"cannot load libnccl for ncclCommRegister: .*ncclCommRegister.*NCCL >= 2\.19"):
            gtorch.register(sim)
        assert gtorch.torch_pools(sim) == []  # refused before any change
        sim.close()
        gtorch._reset_for_tests()


IN_FRESH_INTERPRETER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import test_torch_nccl
getattr(test_torch_nccl, sys.argv[2])(sys.argv[3])
print("ok")
"""


def run_with_libnccl(check: Callable[[str], None], path: str, cwd: str) -> None:
    """check(path) in a fresh interpreter with GMP_LIBNCCL=path. The engine
    shares an NCCL already loaded (a real torch's, in this session) and
    reads its environment once, so the library cannot be chosen here."""
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", IN_FRESH_INTERPRETER, os.path.dirname(os.path.abspath(__file__)), check.__name__, path],
        capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, "GMP_LIBNCCL": path},
    )
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["ok"], r.stdout[-2000:] + r.stderr[-4000:]


def test_register_reaches_libnccl_with_the_pool_s_ranges(fake_nccl, tmp_path):
    """ncclCommRegister through the engine's libnccl (gocore/nccl/libnccl,
    the copy the nccl backend loads) into the fake libnccl, which records the
    ranges it was given: registration is observed where NCCL would see it,
    not in a Python stand-in. Each tensor lies in a range registered with the
    group's communicator, the pool's growth is registered too, deregister
    leaves nothing registered, and no other NCCL is loaded."""
    run_with_libnccl(check_registration_reaches_libnccl, fake_nccl[0], str(tmp_path))


def test_register_without_ncclcommregister_is_a_version_error(fake_nccl_without_register, tmp_path):
    """Where the engine's libnccl has no ncclCommRegister (NCCL < 2.19),
    registering says so, before any change."""
    run_with_libnccl(check_registration_needs_ncclcommregister, fake_nccl_without_register, str(tmp_path))


def test_register_without_any_nccl_api(monkeypatch, sim):
    install(monkeypatch, nccl_mode="none")
    with pytest.raises(gtorch.TorchVersionError, match="register_mem_pool"):
        gtorch.register(sim)
