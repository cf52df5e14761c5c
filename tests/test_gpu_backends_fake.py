"""The GPU backends (cuda, host, nccl) through the Python API, against the
fake libcuda and libnccl built from tests/csrc: the dlopen layer, context
handling, error mapping and the OOM path run here without a GPU."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

import gpumempool as gmp

MiB = 1 << 20


def test_cuda_pool_on_the_fake_driver(fake_cuda) -> None:
    path, fake = fake_cuda
    with gmp.MemPool("cuda", libcuda=path, name="dev") as pool:
        a = pool.alloc(1000, device=1, stream=0x10)
        assert fake.fake_cuda_ptr_device(a) == 1  # device 1's context was pushed
        ctypes.memset(a, 0x7F, 1000)  # the fake's device memory is host memory
        assert ctypes.string_at(a, 3) == b"\x7f\x7f\x7f"
        assert fake.fake_cuda_ctx_depth() == 0  # the caller's context stack is untouched
        pool.free(a)
        assert pool.alloc(1000, device=1, stream=0x10) == a
        assert pool.stats(1)["reserved_bytes.all.current"] == 2 * MiB
        assert pool.config()["devices"] == 2
    assert fake.fake_cuda_live_bytes(1) == 0


def test_cuda_out_of_memory_names_the_cuda_error(fake_cuda) -> None:
    path, _ = fake_cuda
    with gmp.MemPool("cuda", libcuda=path) as pool:
        with pytest.raises(gmp.OutOfMemoryError, match="CUDA_ERROR_OUT_OF_MEMORY") as ei:
            pool.alloc(4 << 30)
        assert "device has" in str(ei.value)  # cuMemGetInfo numbers
        assert pool.stats()["num_alloc_retries"] == 1


def test_cuda_errors_other_than_oom_are_backend_errors(fake_cuda) -> None:
    path, fake = fake_cuda
    with gmp.MemPool("cuda", libcuda=path) as pool:
        fake.fake_cuda_fail(b"cuMemAlloc_v2", 1, 0)
        try:
            with pytest.raises(gmp.BackendError, match="CUDA_ERROR_INVALID_VALUE"):
                pool.alloc(100)
        finally:
            fake.fake_cuda_fail(b"cuMemAlloc_v2", 0, 0)
        assert pool.stats()["num_alloc_retries"] == 0
        pool.free(pool.alloc(100))


def test_cuda_cross_stream_reuse_waits_for_events(fake_cuda) -> None:
    path, fake = fake_cuda
    fake.fake_cuda_set_manual_events(1)
    try:
        with gmp.MemPool("cuda", libcuda=path) as pool:
            a = pool.alloc(4096, stream=1)
            pool.record_stream(a, 2)
            pool.free(a)
            b = pool.alloc(4096, stream=1)
            assert b != a  # stream 2 may still be using a
            fake.fake_cuda_complete_stream(2)
            assert pool.process_events() == 0
            assert pool.alloc(4096, stream=1) == a
    finally:
        fake.fake_cuda_set_manual_events(0)


def test_host_pool_gives_pinned_host_memory(fake_cuda) -> None:
    path, fake = fake_cuda
    with gmp.MemPool("host", libcuda=path) as pool:
        a = pool.alloc(10000)
        assert fake.fake_cuda_ptr_device(a) == -1  # host memory, not a device's
        ctypes.memset(a, 1, 10000)
        pool.free(a)
        with pytest.raises(ValueError):
            pool.alloc(10, device=1)  # the host is device 0 only


def test_host_pool_on_another_device_never_touches_device_0(fake_cuda) -> None:
    # a torchrun rank using cuda:1 must not create a context on GPU 0; the
    # fake counts primary-context retains per device (a fresh process, as
    # the session's fake has served device 0 already)
    path, _ = fake_cuda
    code = (
        "import ctypes, sys, gpumempool as gmp\n"
        "fake = ctypes.CDLL(sys.argv[1])\n"
        "with gmp.MemPool('host', libcuda=sys.argv[1], host_device='cuda:1') as pool:\n"
        "    a = pool.alloc(10000)\n"
        "    ctypes.memset(a, 1, 10000)\n"
        "    pool.free(a)\n"
        "    print(fake.fake_cuda_retained(0), fake.fake_cuda_retained(1))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert r.returncode == 0, r.stderr
    dev0, dev1 = map(int, r.stdout.split())
    assert dev0 == 0 and dev1 >= 1
    for bad in (-1, 7, "cpu"):
        with pytest.raises(ValueError):
            gmp.MemPool("host", libcuda=path, host_device=bad)


NCCL_POOL = """
import ctypes, json, sys
import gpumempool as gmp
cuda_path, nccl_path = sys.argv[1:3]
nccl = ctypes.CDLL(nccl_path)
nccl.fake_nccl_calls.restype = ctypes.c_long
nccl.fake_nccl_live_bytes.restype = ctypes.c_long
before = nccl.fake_nccl_calls()
with gmp.MemPool("nccl", libcuda=cuda_path, libnccl=nccl_path) as pool:
    a = pool.alloc(5000, device=1)
    b = pool.alloc(5000, device=1)
    calls = nccl.fake_nccl_calls() - before
    pool.free(a)
    pool.free(b)
    pool.empty_cache()
    print(json.dumps({"calls": calls, "live": nccl.fake_nccl_live_bytes()}))
"""


def test_nccl_pool(fake_cuda, fake_nccl) -> None:
    """In a fresh interpreter: a process that already loaded the real NCCL
    (torch imports it; other test modules import torch) refuses a second
    libnccl, rightly (gocore/nccl's ErrConflict)."""
    cuda_path, _ = fake_cuda
    nccl_path, _ = fake_nccl
    r = subprocess.run([sys.executable, "-c", NCCL_POOL, cuda_path, nccl_path], capture_output=True, text=True,
                       env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"calls": 1, "live": 0}  # one segment served both; all of it went back


NCCL_POOL_REGISTERED = """
import ctypes, json, os, sys
import gpumempool as gmp
from gpumempool.torch import _nccl
cuda_path, nccl_path = sys.argv[1:3]
nccl = ctypes.CDLL(nccl_path)
nccl.fake_nccl_calls.restype = ctypes.c_long
nccl.fake_nccl_registered.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]

def registered():
    out, i = [], 0
    comm, buf, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
    while nccl.fake_nccl_registered(i, ctypes.byref(comm), ctypes.byref(buf), ctypes.byref(size)):
        out.append([comm.value, buf.value, size.value])
        i += 1
    return out

with gmp.MemPool("nccl", libcuda=cuda_path) as pool:  # the libnccl of $GMP_LIBNCCL
    a = pool.alloc(5000, device=1)
    lib = _nccl.nccl_lib()
    handle = lib.register(0xC0FFEE, a, 5000)
    during = registered()
    try:
        lib.deregister(0xC0FFEE + 1, handle)
        wrong_comm = None
    except RuntimeError as exc:
        wrong_comm = [type(exc).__name__, str(exc)]
    lib.deregister(0xC0FFEE, handle)
    pool.free(a)
    with open("/proc/self/maps") as maps:
        nccls = sorted({f for f in (line.split()[-1] for line in maps) if "nccl" in os.path.basename(f)})
    print(json.dumps({"allocs": nccl.fake_nccl_calls(), "ptr": a, "during": during, "after": registered(),
                      "wrong_comm": wrong_comm, "nccls": nccls, "lib": lib.description}))
"""


def test_nccl_pool_registered_through_its_own_libnccl(fake_cuda, fake_nccl) -> None:
    """gpumempool.torch's ncclCommRegister (torch < 2.6) goes through the
    libnccl the nccl backend loaded, not a second handle on it: with
    GMP_LIBNCCL naming the fake, a block of an nccl pool is registered in
    the very copy that allocated it (its counters show both), a refused
    deregistration is a TorchIntegrationError naming NCCL's result, and no
    other NCCL is mapped. In a fresh interpreter, as test_nccl_pool."""
    cuda_path, _ = fake_cuda
    nccl_path, _ = fake_nccl
    r = subprocess.run([sys.executable, "-c", NCCL_POOL_REGISTERED, cuda_path, nccl_path], capture_output=True,
                       text=True, env={**os.environ, "PYTHONSAFEPATH": "1", "GMP_LIBNCCL": nccl_path}, cwd="/",
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["allocs"] == 1
    assert out["during"] == [[0xC0FFEE, out["ptr"], 5000]]
    assert out["after"] == []
    assert out["wrong_comm"][0] == "TorchIntegrationError"
    assert "ncclCommDeregister" in out["wrong_comm"][1] and "ncclInvalidUsage = 5" in out["wrong_comm"][1]
    assert out["nccls"] == [os.path.realpath(nccl_path)]
    assert out["lib"] == f"NCCL 2.23.4 ({os.path.realpath(nccl_path)})"


def test_gpu_pools_through_the_c_abi(fake_cuda, clib) -> None:
    path, _ = fake_cuda
    with gmp.MemPool("cuda", libcuda=path) as pool:
        assert clib.caller_open(*(s.encode() for s in pool.pluggable_symbols())) == 0
        p = clib.caller_alloc(2048, 1, None)
        assert p and pool.stats(1)["allocated_bytes.all.current"] == 2048
        clib.caller_free(p, 2048, 1, None)
        assert pool.stats(1)["allocated_bytes.all.current"] == 0


def test_missing_driver_is_a_clear_error() -> None:
    with pytest.raises(gmp.BackendError, match="not found"):
        gmp.MemPool("cuda", libcuda="/nonexistent/libcuda.so.1")
    with pytest.raises(gmp.BackendError, match="not found|no such file|NCCL"):
        gmp.MemPool("nccl", libcuda="/nonexistent/libcuda.so.1")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"backend": "cuda", "capacity": 1}, ValueError, "unknown option.*valid: .*libcuda"),
        ({"backend": "host", "host_flags": -1}, ValueError, "host_flags"),
        ({"backend": "cuda", "libcuda": 5}, TypeError, "libcuda"),
        ({"backend": "gpu"}, ValueError, "valid backends: async, callback, cuda, host, nccl, sim, vmm"),
    ],
)
def test_gpu_option_errors(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        gmp.MemPool(**kwargs)


def test_options_a_driver_is_too_old_for_are_refused_by_name(fake_cuda, monkeypatch) -> None:
    path, fake = fake_cuda
    monkeypatch.setenv("FAKE_CUDA_DRIVER_VERSION", "12010")
    fake.fake_cuda_reset()  # re-reads the environment
    try:
        with pytest.raises(gmp.BackendError, match=r"max_size|MaxSize.*needs a driver for CUDA 12\.2.*supports CUDA 12\.1"):
            gmp.MemPool("async", libcuda=path, max_size=64 * MiB)
        with pytest.raises(gmp.BackendError, match=r"CU_MEM_LOCATION_TYPE_HOST_NUMA\) needs a driver for CUDA 12\.2"):
            gmp.MemPool("vmm", libcuda=path, location="host_numa", numa_node=0)
        with gmp.MemPool("async", libcuda=path) as pool:  # without the new option the old driver serves
            pool.free(pool.alloc(MiB))
    finally:
        monkeypatch.delenv("FAKE_CUDA_DRIVER_VERSION")
        fake.fake_cuda_reset()
    with gmp.MemPool("async", libcuda=path, max_size=64 * MiB) as pool:
        pool.free(pool.alloc(MiB))


def test_backend_benchmark_times_the_async_pool_cold_too(fake_cuda, monkeypatch) -> None:
    """The async backend's raw pairs hit the CUDA pool's own cache, so the
    benchmark (benchmarks/backendbench, run by gpu_backends.py in a process
    of its own) also times them with that cache trimmed before every pair.
    That it trims once per cold pair is checked in its Go tests, which this
    process's fake driver counters cannot see."""
    path, _ = fake_cuda
    bench = _backends_script(monkeypatch, [4096, MiB])
    iters = 5
    rows = [r for size in (4096, MiB)
            for r in bench.measure_latency({"backend": "async", "options": {"libcuda": path}}, size, iters)]
    assert [r["size"] for r in rows] == [4096, MiB]
    for r in rows:
        assert r["raw_cold_ns"] > 0 and r["cached_ns"] > 0
        assert r["speedup_vs_cold"] == pytest.approx(r["raw_cold_ns"] / r["cached_ns"])

    rows = bench.measure_latency({"backend": "cuda", "options": {"libcuda": path}}, 4096, iters)
    assert "raw_cold_ns" not in rows[0]  # cuMemAlloc keeps no cache to empty
    with pytest.raises(RuntimeError, match="libcuda"):
        bench.measure_latency({"backend": "cuda", "options": {"libcuda": path + ".missing"}}, 4096, iters)


def _backends_script(monkeypatch, sizes):
    """benchmarks/gpu_backends.py as a module, timing few pairs of sizes."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_backends.py"
    spec = importlib.util.spec_from_file_location("gmp_test_gpu_backends", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "SIZES", sizes)
    monkeypatch.setattr(bench, "iters_for", lambda size: 3)
    return bench


def test_gpu_backends_script_reports_cold_async_numbers(fake_cuda, tmp_path, monkeypatch) -> None:
    """benchmarks/gpu_backends.py's measuring and report code, run on the fake
    driver (small sizes: the fake's device memory is host memory)."""
    path, _ = fake_cuda
    bench = _backends_script(monkeypatch, [4096, MiB])
    result = {"date": "2026-11-22", "device": "fake", "backends": {}}
    for name in ("cuda", "async"):
        spec_ = {"gpu": {"libcuda": path}}
        result["backends"][name] = {"latency": bench.bench_backend(name, spec_),
                                    "mixed": bench.mixed_workload(name, {"gpu": {"libcuda": path}}, steps=300)}
    result["backends"]["nccl"] = {"error": "libnccl not found"}
    bench.write(result, tmp_path)
    md = (tmp_path / "gpu_backends.md").read_text()
    rows = [line.split(" | ") for line in md.splitlines() if line.startswith(("| cuda |", "| async |", "| nccl |"))]
    cuda_rows = [r for r in rows if r[0] == "| cuda" and len(r) == 7]
    async_rows = [r for r in rows if r[0] == "| async" and len(r) == 7]
    assert len(cuda_rows) == 2 and all(r[3] == "-" and r[6] == "- |" for r in cuda_rows)
    assert len(async_rows) == 2 and all(r[3] != "-" and r[6].endswith("x |") for r in async_rows)
    assert any("error: libnccl not found" in line for line in md.splitlines())
    assert "reserved / requested" in md
    saved = json.loads((tmp_path / "gpu_backends.json").read_text())
    assert saved["backends"]["async"]["latency"][0]["raw_cold_ns"] > 0


def test_graph_capture_on_the_fake_driver_makes_no_forbidden_call(fake_cuda, cxx_caller) -> None:
    """Full replacement with the cuda backend while "torch" records a CUDA
    graph in the global capture mode (the fake refuses what the real driver
    refuses then): the graph's first segment is allocated (relaxed mode),
    nothing is freed and no event is recorded or queried until the capture
    ends, and the graph's blocks stay out of everyone else's reach."""
    path, fake = fake_cuda
    fake.fake_cuda_capture_violations.restype = ctypes.c_long
    fake.fake_cuda_set_manual_events(1)
    S0, S1 = 0x40, 0x41  # a stream outside the capture, the captured one
    try:
        with gmp.MemPool("cuda", libcuda=path, release_threshold=1) as pool:
            lib_path, a_sym, f_sym = pool.pluggable_symbols()
            hooks = {k: v.encode() for k, v in pool.pluggable_hooks().items()}
            lib = ctypes.CDLL(lib_path)
            alloc, free = getattr(lib, a_sym), getattr(lib, f_sym)
            alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            record = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(
                ctypes.cast(getattr(lib, pool.pluggable_hooks()["set_record_stream_fn"]), ctypes.c_void_p).value)

            shared = alloc(MiB, 0, S0)
            record(shared, S1)
            assert cxx_caller.call_begin(lib_path.encode(), hooks["set_begin_allocate_to_pool"], 0, 5, 0, S1, 0) == 0
            fake.fake_cuda_set_global_capture(1)  # torch: cudaStreamBeginCapture (global mode)
            g1 = alloc(2 * MiB, 0, S1)  # a new private segment: cuMemAlloc in relaxed mode
            assert g1, pool.last_error()
            free(g1, 2 * MiB, 0, S1)  # freed during the capture: kept for the graph
            free(shared, MiB, 0, S0)  # used on S1: its event must wait for the end
            other = alloc(30 * MiB, 0, S0)  # the shared pool keeps serving other streams (a new segment)
            assert other and other != g1
            free(other, 30 * MiB, 0, S0)  # release_threshold=1 would free that segment: not now
            assert fake.fake_cuda_capture_violations() == 0, pool.last_error()
            fake.fake_cuda_set_global_capture(0)  # torch: cudaStreamEndCapture
            assert cxx_caller.call_end(lib_path.encode(), hooks["set_end_allocate_to_pool_fn"], 0, 5, 0) == 0
            assert pool.last_error() is None
            assert pool.process_events() == 1  # shared's event, recorded at the end
            fake.fake_cuda_complete_all()
            assert pool.process_events() == 0
            pool.empty_cache()  # after the capture, cached segments can go again
            assert pool.stats()["num_device_free"] >= 1
            (gp,) = pool.graph_pools()
            assert gp["reserved_bytes"] == 20 * MiB and gp["live_blocks"] == 0  # a 2 MiB request: a 20 MiB segment
            assert cxx_caller.call_end(lib_path.encode(), hooks["set_release_pool"], 0, 5, 0) == 0
            assert pool.graph_pools() == []
            pool.check()
        assert fake.fake_cuda_live_bytes(0) == 0
    finally:
        fake.fake_cuda_set_global_capture(0)
        fake.fake_cuda_set_manual_events(0)


def test_vmm_host_numa_on_a_device_without_support(fake_cuda) -> None:
    """The error test_gpu.py's host-NUMA check skips on: a BackendError that
    names the missing support, before any memory is created."""
    path, fake = fake_cuda
    fake.fake_cuda_set_device_attribute.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    assert fake.fake_cuda_set_device_attribute(0, 141, 0) == 0
    try:
        with gmp.MemPool("vmm", libcuda=path, location="host_numa", numa_node=0) as pool:
            with pytest.raises(gmp.BackendError, match="does not support host NUMA memory"):
                pool.alloc(4 << 20)
    finally:
        fake.fake_cuda_set_device_attribute(0, 141, 1)
    with gmp.MemPool("vmm", libcuda=path, location="host_numa", numa_node=0) as pool:
        pool.free(pool.alloc(4 << 20))  # supported: fine


def test_gpu_backends_script_fails_when_a_backend_fails(fake_cuda, tmp_path, monkeypatch) -> None:
    """A backend that errors is in the table, and the exit status says so
    (gpu-check.sh marks the stage failed instead of ok)."""
    import sys

    path, _ = fake_cuda
    bench = _backends_script(monkeypatch, [4096])
    monkeypatch.setattr(bench.gmp, "devices", lambda: [{"name": "fake"}])
    monkeypatch.setattr(bench, "BACKENDS", {"cuda": {"gpu": {"libcuda": path}},
                                            "vmm": {"gpu": {"libcuda": path + ".missing"}}})
    monkeypatch.setattr(bench, "mixed_workload", lambda name, spec, steps=300: {
        "peak_requested": 1, "peak_reserved": 1, "reserved_over_requested": 1.0, "backend_calls": 1})
    monkeypatch.setattr(sys, "argv", ["gpu_backends.py", "--out", str(tmp_path), "--backends", "cuda,vmm"])
    with pytest.raises(SystemExit, match=r"gpu_backends: vmm failed"):
        bench.main()
    md = (tmp_path / "gpu_backends.md").read_text()
    assert "| cuda | 4,096 |" in md and "| vmm | - |" in md
