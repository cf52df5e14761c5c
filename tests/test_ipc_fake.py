"""IPC: exporting blocks of vmm/async pools and mapping them elsewhere, against
the fake libcuda (whose VMM memory is memfd-backed, so two processes really
share it). The same tests on a GPU are in test_gpu.py."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import gpumempool as gmp

MiB = 1 << 20


def dup_handle(h: gmp.IpcHandle) -> gmp.IpcHandle:
    """What a receiving process gets: the same files under new numbers."""
    return gmp.IpcHandle(dict(h.meta), [os.dup(fd) for fd in h.fds])


def test_vmm_block_shared_within_a_process(fake_cuda) -> None:
    path, _ = fake_cuda
    with gmp.MemPool("vmm", libcuda=path, ipc=True) as pool:
        pool.alloc(5000)  # the exported block is not at the segment start
        ptr = pool.alloc(MiB)
        ctypes.memset(ptr, 0x11, MiB)
        with pool.export(ptr) as h, dup_handle(h) as received:
            assert h.meta["kind"] == "vmm" and h.meta["size"] == MiB and len(h.fds) >= 1
            with gmp.import_pool(received, libcuda=path) as mem:
                assert mem.ptr != ptr and mem.size == MiB
                assert ctypes.string_at(mem.ptr, 4) == b"\x11" * 4
                ctypes.memset(mem.ptr, 0x22, 16)
                assert ctypes.string_at(ptr, 16) == b"\x22" * 16


def test_vmm_block_shared_with_another_process(fake_cuda) -> None:
    path, _ = fake_cuda
    child = textwrap.dedent(
        f"""
        import ctypes, socket, sys
        import gpumempool as gmp
        sock = socket.socket(fileno=int(sys.argv[1]))
        with gmp.IpcHandle.recv(sock) as h, gmp.import_pool(h, libcuda={path!r}) as mem:
            seen = ctypes.string_at(mem.ptr, 4)
            ctypes.memset(mem.ptr, 0x5C, 64)
            sock.sendall(seen)
        """
    )
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent_sock, gmp.MemPool("vmm", libcuda=path, ipc=True) as pool:
        ptr = pool.alloc(3 * MiB)
        ctypes.memset(ptr, 0x3A, 3 * MiB)
        proc = subprocess.Popen([sys.executable, "-c", child, str(child_sock.fileno())],
                                pass_fds=[child_sock.fileno()], cwd="/")
        child_sock.close()
        with pool.export(ptr) as h:
            h.send(parent_sock)
        seen = parent_sock.recv(4)
        assert proc.wait(timeout=60) == 0
        assert seen == b"\x3a" * 4  # the child read our writes
        assert ctypes.string_at(ptr, 64) == b"\x5c" * 64  # and we read the child's


def test_async_pointer_shared_within_a_process(fake_cuda) -> None:
    path, _ = fake_cuda
    with gmp.MemPool("async", libcuda=path, ipc=True) as pool:
        ptr = pool.alloc(4096)
        with pool.export(ptr) as h, dup_handle(h) as received:
            assert h.meta["kind"] == "async" and len(h.fds) == 1
            with gmp.import_pool(received, libcuda=path) as mem:
                assert mem.size == 4096 and mem.ptr
        pool.free(ptr)


def test_export_errors(fake_cuda) -> None:
    path, _ = fake_cuda
    with gmp.MemPool("cuda", libcuda=path) as pool:
        ptr = pool.alloc(100)
        with pytest.raises(gmp.GpuMemPoolError, match="only async and vmm"):
            pool.export(ptr)
    with gmp.MemPool("vmm", libcuda=path) as pool:  # ipc not requested
        with pytest.raises(gmp.GpuMemPoolError):
            pool.export(pool.alloc(100))
        with pytest.raises(gmp.InvalidPointerError):
            pool.export(12345)
    with pytest.raises(TypeError):
        gmp.import_pool({"kind": "vmm"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind"):
        gmp.import_pool(gmp.IpcHandle({"kind": "bogus", "device": 0, "fds": []}, []), libcuda=path)


def test_async_and_vmm_pools_on_the_fake(fake_cuda) -> None:
    path, fake = fake_cuda
    with gmp.MemPool("async", libcuda=path, pool_release_threshold=64 * MiB,
                     reuse_allow_opportunistic=False) as pool:
        a = pool.alloc(3000, device=1, stream=5)
        assert fake.fake_cuda_ptr_device(a) == 1
        pool.free(a)
        assert pool.alloc(3000, device=1, stream=5) == a
    with gmp.MemPool("vmm", libcuda=path, expandable=True, access_devices=[1]) as pool:
        a = pool.alloc(3 * MiB)
        b = pool.alloc(3 * MiB)
        assert b == a + 3 * MiB
        assert pool.stats()["num_expansions"] == 1
        assert fake.fake_cuda_access(a, 1) == 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE for the peer
    with pytest.raises(ValueError, match="location"):
        gmp.MemPool("vmm", libcuda=path, location="moon")
