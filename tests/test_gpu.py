"""Real-GPU checks of the backends (run with `pytest -m gpu` on an H100/H200;
skipped where NVML finds no device). CuPy reads and writes the raw pointers
with kernels."""

from __future__ import annotations

import ctypes
import socket
import subprocess
import sys
import textwrap

import pytest

import gpumempool as gmp
from conftest import import_or_skip, nccl_ok

pytestmark = pytest.mark.gpu
MiB = 1 << 20

cp = import_or_skip("cupy", module_level=True) if gmp.devices() else None


DEVICE_BACKENDS = ["cuda", "async", "vmm", "nccl"]


def make_pool(backend: str, **kw) -> gmp.MemPool:
    if backend == "nccl" and not nccl_ok():
        pytest.skip("no NCCL >= 2.19 in this process")
    return gmp.MemPool(backend, **kw)


def as_array(ptr: int, nbytes: int, device: int = 0):
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device)
    return cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))


SPIN = r"""
extern "C" __global__ void spin_then_write(unsigned char* p, long long cycles, unsigned char v) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    p[threadIdx.x] = v;
}
"""


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_memory_is_usable_from_kernels(backend: str) -> None:
    with make_pool(backend) as pool:
        sizes = [512, 5000, 3 * MiB, 64 * MiB]
        ptrs = [pool.alloc(n) for n in sizes]
        for ptr, n in zip(ptrs, sizes):
            arr = as_array(ptr, n)
            arr[:] = (cp.arange(n, dtype=cp.uint32) % 251).astype(cp.uint8)
        cp.cuda.Device(0).synchronize()
        for ptr, n in zip(ptrs, sizes):
            got = as_array(ptr, n).get()
            assert (got == (cp.arange(n, dtype=cp.uint32) % 251).astype(cp.uint8).get()).all()
            pool.free(ptr)
        pool.check()


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_cross_stream_reuse_waits_for_the_other_stream(backend: str) -> None:
    kernel = cp.RawKernel(SPIN, "spin_then_write")
    home = cp.cuda.Stream(non_blocking=True)
    other = cp.cuda.Stream(non_blocking=True)
    with make_pool(backend) as pool:
        ptr = pool.alloc(4096, stream=home.ptr)
        pool.record_stream(ptr, other.ptr)
        # kHz; cudaDeviceProp.clockRate is gone in CUDA 13, the attribute stays
        clock_hz = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1000
        with other:  # about half a second of spinning, then a write
            kernel((1,), (32,), (cp.uint64(ptr), cp.int64(clock_hz // 2), cp.uint8(7)))
        pool.free(ptr)
        again = pool.alloc(4096, stream=home.ptr)
        assert again != ptr, "handed out a block still in use on another stream"
        other.synchronize()
        assert pool.process_events() == 0
        assert pool.alloc(4096, stream=home.ptr) == ptr
        assert (as_array(ptr, 32).get() == 7).all()


CLOSE_CHILD = textwrap.dedent("""
    import sys, time
    import cupy as cp
    import gpumempool as gmp
    SPIN, backend = sys.argv[1], sys.argv[2]
    if backend == "nccl":
        import torch  # loads the libnccl the backend uses, as in nccl_ok()
    kernel = cp.RawKernel(SPIN, "spin_then_write")
    other = cp.cuda.Stream(non_blocking=True)
    clock_hz = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1000
    pool = gmp.MemPool(backend)
    ptr = pool.alloc(64 * 1024 * 1024)
    pool.record_stream(ptr, other.ptr)
    with other:  # about a second of spinning, then a write into the block
        kernel((1,), (32,), (cp.uint64(ptr), cp.int64(clock_hz), cp.uint8(7)))
    pool.free(ptr)  # waits for `other`: not reusable, and not to be unmapped yet
    t0 = time.perf_counter()
    pool.close()
    waited = time.perf_counter() - t0
    other.synchronize()  # raises if the kernel wrote to memory already given back
    cp.cuda.Device(0).synchronize()
    print(f"waited {waited:.3f}")
""")


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_close_waits_for_work_on_other_streams(backend: str) -> None:
    """A pool closed while a freed block is still written on another stream
    waits for that work before the memory goes (cuEventSynchronize), where
    cuMemUnmap, ncclMemFree and cuMemFreeAsync would not. In a child
    process: a fault would poison this one's CUDA context."""
    if backend == "nccl" and not nccl_ok():
        pytest.skip("no NCCL >= 2.19 in this process")
    out = subprocess.run([sys.executable, "-c", CLOSE_CHILD, SPIN, backend], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    waited = float(out.stdout.split()[-1])
    assert waited > 0.2, f"close returned after {waited:.3f} s, before the other stream's kernel ended"


def test_vmm_expandable_grows_without_moving() -> None:
    with gmp.MemPool("vmm", expandable=True) as pool:
        a = pool.alloc(3 * MiB)
        as_array(a, 3 * MiB)[:] = 9
        b = pool.alloc(3 * MiB)
        assert b == a + 3 * MiB
        as_array(b, 3 * MiB)[:] = 4
        cp.cuda.Device(0).synchronize()
        assert (as_array(a, 3 * MiB).get() == 9).all()
        s = pool.stats()
        assert s["segment.all.current"] == 1 and s["num_expansions"] >= 1
        # the free end goes back (cuMemUnmap + cuMemRelease of whole chunks)
        # and the range grows again in place
        reserved = s["reserved_bytes.all.current"]
        pool.free(b)
        assert pool.empty_cache() > 0
        assert pool.stats()["reserved_bytes.all.current"] < reserved
        c = pool.alloc(3 * MiB)
        assert c == b
        as_array(c, 3 * MiB)[:] = 5
        cp.cuda.Device(0).synchronize()
        assert (as_array(a, 3 * MiB).get() == 9).all() and (as_array(c, 3 * MiB).get() == 5).all()


def test_vmm_host_numa_memory_is_usable_from_kernels() -> None:
    """location="host_numa" (EGM on Grace; plain pinned host memory over
    PCIe elsewhere, as NCCL uses it): kernels write and read it. A device or
    container without host-NUMA VMM support is a skip with the driver's
    reason, not a failure."""
    with gmp.MemPool("vmm", location="host_numa", numa_node=0) as pool:
        try:
            ptr = pool.alloc(4 * MiB)
        except gmp.BackendError as exc:
            if "does not support host NUMA" in str(exc) or "NOT_SUPPORTED" in str(exc):
                pytest.skip(f"no host-NUMA VMM here: {exc}")
            raise
        a = as_array(ptr, 4 * MiB)
        a[:] = 7
        a[-16:] = 9
        cp.cuda.Device(0).synchronize()
        got = a.get()
        assert (got[:-16] == 7).all() and (got[-16:] == 9).all()
        pool.free(ptr)


def test_host_memory_is_pinned() -> None:
    with gmp.MemPool("host") as pool:
        ptr = pool.alloc(64 * MiB)
        attrs = cp.cuda.runtime.pointerGetAttributes(ptr)
        assert attrs.type == cp.cuda.runtime.memoryTypeHost  # registered/pinned, not pageable
        ctypes.memset(ptr, 3, 64 * MiB)
        dev = cp.empty(64 * MiB, cp.uint8)
        cp.cuda.runtime.memcpy(dev.data.ptr, ptr, 64 * MiB, cp.cuda.runtime.memcpyHostToDevice)
        assert int(dev[-1]) == 3
        pool.free(ptr)


IPC_CHILD = textwrap.dedent(
    """
    import socket, sys
    import cupy as cp
    import gpumempool as gmp
    sock = socket.socket(fileno=int(sys.argv[1]))
    with gmp.IpcHandle.recv(sock) as h, gmp.import_pool(h) as mem:
        mem_obj = cp.cuda.UnownedMemory(mem.ptr, mem.size, owner=None, device_id=0)
        a = cp.ndarray((mem.size,), cp.uint8, cp.cuda.MemoryPointer(mem_obj, 0))
        seen = bytes([int(a[0]), int(a[-1])])   # the exporter's writes, read by a kernel here
        a[:64] = 0x5C
        cp.cuda.Device(0).synchronize()
        sock.sendall(seen)
    """
)


@pytest.mark.parametrize("backend", ["vmm", "async"])
def test_ipc_two_processes_read_each_others_writes(backend: str) -> None:
    """Issue 3's IPC check: a block exported by this process is mapped by a
    second one (descriptors over a UNIX socket); each reads what the other
    wrote with kernels. The block is not at its segment's start."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent_sock, gmp.MemPool(backend, ipc=True) as pool:
        pool.alloc(3 * MiB)
        ptr = pool.alloc(3 * MiB)  # the second block of a 20 MiB segment
        assert any(sg["address"] < ptr < sg["address"] + sg["size"] for sg in pool.segments())
        as_array(ptr, 3 * MiB)[:] = 0x3A
        cp.cuda.Device(0).synchronize()
        proc = subprocess.Popen([sys.executable, "-c", IPC_CHILD, str(child_sock.fileno())],
                                pass_fds=[child_sock.fileno()], cwd="/")
        child_sock.close()
        try:
            with pool.export(ptr) as h:
                assert h.meta["kind"] == backend and h.meta["size"] >= 3 * MiB
                h.send(parent_sock)
            parent_sock.settimeout(120)
            seen = parent_sock.recv(2)
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        assert seen == b"\x3a\x3a"
        assert (as_array(ptr, 64).get() == 0x5C).all() and int(as_array(ptr, 65)[64]) == 0x3A
        pool.free(ptr)


def test_real_out_of_memory_is_typed() -> None:
    total = gmp.devices()[0]["total_bytes"]
    with gmp.MemPool("cuda") as pool:
        with pytest.raises(gmp.OutOfMemoryError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            pool.alloc(2 * total)
        pool.free(pool.alloc(MiB))


def test_devices_and_info() -> None:
    devs = gmp.devices()
    assert devs and devs[0]["total_bytes"] > 0 and devs[0]["uuid"].startswith("GPU-")
    out = subprocess.run([sys.executable, "-m", "gpumempool", "info"], capture_output=True, text=True, check=True).stdout
    assert devs[0]["name"] in out
