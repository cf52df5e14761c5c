"""Full replacement of torch's allocator (``gmp.set_torch_allocator``) on
the fake torch of tests/faketorch.py: installing it, its out-of-memory
error modes, refusals, and hook errors that must not unwind into torch."""

from __future__ import annotations

import ctypes
import os

import pytest

import gpumempool as gmp
from gpumempool import torch as gtorch

from faketorch import clean_state, sim  # noqa: F401 - fixtures
from faketorch import MiB, allocated, install


# ---------------------------------------------------------------------------
# full replacement
# ---------------------------------------------------------------------------


def test_set_torch_allocator(monkeypatch, sim):
    torch = install(monkeypatch)
    with pytest.raises(gtorch.TorchIntegrationError, match="set_torch_allocator was not called"):
        gmp.torch_memory_stats()
    with pytest.raises(gtorch.TorchIntegrationError, match="torch.cuda.memory_summary"):
        gmp.torch_memory_summary()
    hooks = gmp.set_torch_allocator(sim)
    assert set(hooks) == {"reset", "init", "memory_fraction", "record_stream"}
    assert gmp.set_torch_allocator(sim) == hooks  # again: nothing to do
    assert gtorch.torch_allocator_pool() is sim
    x = torch.empty(1000)
    assert x.kind == "pluggable" and allocated(sim) == 1024
    assert gtorch.hook_errors() == []  # init hook at torch's lazy init: 2 devices, as the pool
    assert gmp.torch_memory_stats() == sim.stats(0)  # torch's default: the current device
    assert gmp.torch_memory_summary() == sim.memory_summary(0)
    assert gmp.torch_memory_stats("all") == sim.stats() and gmp.torch_memory_summary("all") == sim.memory_summary()
    assert gmp.torch_memory_stats(0)["allocated_bytes.all.current"] == 1024
    x.record_stream(torch.cuda.Stream(0x77))
    assert sim.stats()["num_record_stream"] == 1
    del x
    assert allocated(sim) == 0 and sim.stats()["reserved_bytes.all.current"] > 0
    torch.cuda.empty_cache()  # reset hook -> pool.empty_cache()
    assert sim.stats()["reserved_bytes.all.current"] == 0
    torch.cuda.set_per_process_memory_fraction(0.001, 0)  # 1 GiB sim device -> 1.02 MiB cap on device 0
    assert sim.limit(0) == (1 << 30) // 1000 and sim.limit(1) is None
    assert torch._world.current_allocator.throws  # out of memory is an exception, not a NULL tensor
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        torch.empty(64 * MiB)
    (err,) = gtorch.hook_errors()  # the refused allocation, kept for the user
    assert err.startswith("gmp_alloc:") and "limit 1.02 MiB" in err
    assert gtorch.hook_errors() == []
    other = gmp.MemPool("sim", capacity=1 << 26)
    with pytest.raises(gtorch.AllocatorInitializedError, match="already replaced"):
        gmp.set_torch_allocator(other)
    # The mempool context cannot work under a replaced allocator: a clear error.
    with pytest.raises(gtorch.TorchIntegrationError, match="replaces torch's allocator"):
        with gmp.mempool(other):
            pass
    other.close()


def test_set_torch_allocator_oom_error_is_checked_before_anything_is_installed(monkeypatch, sim):
    install(monkeypatch)
    with pytest.raises(gmp.InvalidArgumentError, match="oom_error must be one of 'runtime', 'torch', got 'c10'"):
        gmp.set_torch_allocator(sim, oom_error="c10")
    assert isinstance(gmp.InvalidArgumentError("x"), ValueError)
    assert gtorch.torch_allocator_pool() is None
    gmp.set_torch_allocator(sim)
    with pytest.raises(gtorch.AllocatorInitializedError, match="installed with oom_error='runtime'"):
        gmp.set_torch_allocator(sim, oom_error="torch")
    assert gmp.set_torch_allocator(sim, oom_error="runtime")  # the same call again: nothing to do


def test_oom_error_torch_without_a_shim_falls_back_to_runtime_with_one_warning(monkeypatch, sim):
    """A machine with only Python and pip has no C++ compiler for the shim
    (and the fake torch has no headers either): the allocator is installed
    as with oom_error="runtime", and one warning says why."""
    torch = install(monkeypatch)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.warns(gtorch.OOMErrorFallbackWarning, match="needs torch's C\\+\\+ headers.*Falling back") as rec:
        gmp.set_torch_allocator(sim, oom_error="torch")
    assert len(rec) == 1 and issubclass(rec[0].category, RuntimeWarning)
    assert gtorch.torch_allocator_pool() is sim
    path, alloc_sym, _ = torch.cuda.memory.change_current_allocator.last.source
    assert alloc_sym.startswith("gmp_alloc_or_throw_") and path == gmp.library_path()
    assert gmp.set_torch_allocator(sim, oom_error="torch")  # the same call again: nothing to do, no warning


def test_after_the_oom_error_fallback_the_installed_mode_is_runtime(monkeypatch, sim):
    """Once oom_error="torch" fell back, what torch has is the "runtime"
    allocator: asking for exactly that (a library calling
    set_torch_allocator(pool) with the default) is the same call again, not
    an AllocatorInitializedError claiming it was installed with 'torch'."""
    install(monkeypatch)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.warns(gtorch.OOMErrorFallbackWarning):
        hooks = gmp.set_torch_allocator(sim, oom_error="torch")
    assert gmp.set_torch_allocator(sim) == hooks
    assert gmp.set_torch_allocator(sim, oom_error="runtime") == hooks


def test_oom_error_torch_throws_c10s_out_of_memory_error(monkeypatch, sim, torch_headers, c10_caller, tmp_path):
    """oom_error="torch": torch's pluggable allocator gets the shim's alloc,
    which throws c10::OutOfMemoryError (torch.OutOfMemoryError in Python)
    when the pool is out of memory, and passes other failures through. The
    fake torch stands in for torch's Python side; the shim is compiled
    against the installed torch's headers and called from C++, as torch's
    CUDAPluggableAllocator calls it."""
    torch = install(monkeypatch)
    monkeypatch.setattr(torch, "__file__", str(torch_headers[0].parent / "__init__.py"), raising=False)
    monkeypatch.setenv("GMP_CACHE_DIR", str(tmp_path))
    gmp.set_torch_allocator(sim, oom_error="torch")
    path, alloc_sym, free_sym = torch.cuda.memory.change_current_allocator.last.source
    assert (alloc_sym, free_sym) == ("gmp_torch_oom_alloc", "gmp_torch_oom_free")
    assert os.path.dirname(path) == str(tmp_path) and torch._world.current_allocator.throws

    def call(size: int, device: int = 0) -> tuple[int, int, str]:
        out, msg = ctypes.c_void_p(), ctypes.create_string_buffer(2048)
        code = c10_caller.call_alloc(path.encode(), alloc_sym.encode(), size, device, 0x5, ctypes.byref(out), msg,
                                     len(msg))
        return code, out.value or 0, msg.value.decode()

    code, ptr, _ = call(4096)
    assert code == 0 and ptr and allocated(sim, 0) == 4096
    shim_free = getattr(ctypes.CDLL(path), free_sym)
    shim_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    shim_free(ptr, 4096, 0, 0x5)
    assert allocated(sim, 0) == 0
    sim.set_limit(MiB, 0)
    code, ptr, msg = call(64 * MiB)
    assert code == 3 and ptr == 0, msg  # c10::OutOfMemoryError
    assert msg.startswith("CUDA out of memory. Tried to allocate 64.00 MiB on device 0. gpumempool: ")
    assert "limit 1.00 MiB" in msg
    code, ptr, msg = call(4096, device=5)  # not out of memory: a std::exception as before (RuntimeError)
    assert code == 1 and ptr == 0 and msg.startswith("gpumempool: cannot allocate 4096 bytes on device 5: "), msg
    sim.check()


def test_mempool_and_register_under_full_replacement_say_why(monkeypatch, sim):
    """torch 2.11 refuses torch.cuda.MemPool() once a pluggable allocator
    replaced its own: gmp.register (whose register_mem_pool takes one) raises
    a TorchIntegrationError that says so instead of torch's bare
    RuntimeError; gmp.mempool refuses that mode before it gets there."""
    install(monkeypatch, "2.11")
    gtorch.set_torch_allocator(sim)
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    with pytest.raises(gtorch.TorchIntegrationError, match="cannot route allocations while gmp.set_torch_allocator"):
        with gmp.mempool(other):
            pass
    for p in (other, sim):
        with pytest.raises(gtorch.TorchIntegrationError, match="createOrIncrefPool.*not available in full-replacement mode"):
            gtorch.register(p)
    assert gtorch.torch_pools(other) == []
    other.close()


def test_set_torch_allocator_after_cuda_init(monkeypatch, sim):
    torch = install(monkeypatch)
    torch.empty(10)
    with pytest.raises(gtorch.AllocatorInitializedError, match=r"before torch initialises CUDA.*fresh process") as err:
        gmp.set_torch_allocator(sim)
    assert isinstance(err.value, RuntimeError)


def test_set_torch_allocator_when_torch_refuses(monkeypatch, sim):
    torch = install(monkeypatch)

    def refuse(cpa):
        raise RuntimeError("Can't swap an already initialized allocator")

    torch.cuda.memory.change_current_allocator = refuse
    with pytest.raises(gtorch.AllocatorInitializedError, match="refused"):
        gmp.set_torch_allocator(sim)
    assert gtorch.torch_allocator_pool() is None


def test_hook_errors_do_not_unwind_into_torch(monkeypatch, sim):
    torch = install(monkeypatch)
    gmp.set_torch_allocator(sim)
    torch._world.current_allocator.hooks["record_stream"](0x1234, 5)  # not a block of the pool
    errs = gtorch.hook_errors()
    assert len(errs) == 1 and "record_stream" in errs[0]
    assert gtorch.hook_errors() == []
