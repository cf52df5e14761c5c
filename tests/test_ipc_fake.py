"""IPC: exporting blocks of vmm/async pools and mapping them elsewhere, against
the fake libcuda (whose VMM memory is memfd-backed, so two processes really
share it). The same tests on a GPU are in test_gpu.py."""

from __future__ import annotations

import ctypes
import json
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
        a = pool.alloc(30 * MiB)  # two of torch's 20 MiB pages
        b = pool.alloc(30 * MiB)  # the 10 MiB free tail and one more page
        assert b == a + 30 * MiB
        assert pool.stats()["num_expansions"] == 1
        assert fake.fake_cuda_access(a, 1) == 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE for the peer
    with pytest.raises(ValueError, match="location"):
        gmp.MemPool("vmm", libcuda=path, location="moon")


def test_import_finds_the_exporting_gpu_by_uuid(fake_cuda) -> None:
    """The importer maps the exporter's GPU by UUID, not by ordinal: a
    process that sees GPU 1 as its device 0 (CUDA_VISIBLE_DEVICES=1, played
    by FAKE_CUDA_VISIBLE_ORDER) maps the block for its device 0, and one that
    does not see GPU 1 at all is told so."""
    path, _ = fake_cuda
    child = textwrap.dedent(
        f"""
        import ctypes, socket, sys
        import gpumempool as gmp
        fake = ctypes.CDLL({path!r})
        fake.fake_cuda_access.argtypes = [ctypes.c_size_t, ctypes.c_int]
        sock = socket.socket(fileno=int(sys.argv[1]))
        with gmp.IpcHandle.recv(sock) as h:
            try:
                mem = gmp.import_pool(h, libcuda={path!r})
            except ValueError as exc:
                sock.sendall(("error: " + str(exc)).encode())
                sys.exit(0)
            with mem:
                seen = ctypes.string_at(mem.ptr, 4).hex()
                sock.sendall(f"{{seen}} {{fake.fake_cuda_access(mem.ptr, 0)}}".encode())
        """
    )

    def run_child(visible: str, h: gmp.IpcHandle) -> str:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with parent_sock:
            env = dict(os.environ, FAKE_CUDA_VISIBLE_ORDER=visible)
            proc = subprocess.Popen([sys.executable, "-c", child, str(child_sock.fileno())],
                                    pass_fds=[child_sock.fileno()], cwd="/", env=env)
            child_sock.close()
            h.send(parent_sock)
            reply = parent_sock.recv(4096).decode()
            assert proc.wait(timeout=60) == 0
            return reply

    with gmp.MemPool("vmm", libcuda=path, ipc=True) as pool:
        ptr = pool.alloc(MiB, device=1)
        ctypes.memset(ptr, 0x6B, MiB)
        with pool.export(ptr) as h:
            assert h.meta["device"] == 1 and h.meta["uuid"] == "fa4ec0da000040008000000000000001"
            # GPU 1 is the child's device 0: mapped and accessible there.
            assert run_child("1", h) == "6b6b6b6b 3"
            # GPU 1 is not visible in the child.
            reply = run_child("0", h)
            assert reply.startswith("error: ") and "the exporting GPU GPU-fa4ec0da-0000-4000-8000-000000000001 " \
                "is not visible in this process (CUDA_VISIBLE_DEVICES?)" in reply, reply


def test_async_blocks_of_one_segment_share_one_import(fake_cuda) -> None:
    """Each exported async block imports its whole segment; two blocks of one
    segment must not import it twice (real drivers refuse, or map it once
    and unmap it for both at the first free): the second shares the first's
    import, and the segment is freed here with the last of them."""
    path, fake = fake_cuda
    with gmp.MemPool("async", libcuda=path, ipc=True) as pool:
        a, b = pool.alloc(4096), pool.alloc(4096)
        with pool.export(a) as ha, pool.export(b) as hb, dup_handle(ha) as ra, dup_handle(hb) as rb:
            assert ha.meta["data"] == hb.meta["data"], "one segment"
            assert ha.meta["segment_size"] >= 8192
            imports = fake.fake_cuda_calls(b"cuMemPoolImportPointer")
            with gmp.import_pool(ra, libcuda=path) as ma:
                with gmp.import_pool(rb, libcuda=path) as mb:
                    assert (ma.ptr, mb.ptr) == (a, b)  # one process: the exporter's addresses
                    assert fake.fake_cuda_calls(b"cuMemPoolImportPointer") == imports + 1
                assert fake.fake_cuda_imported_ptrs() == 1, "still used by the first block"
            assert fake.fake_cuda_imported_ptrs() == 0
            bad = gmp.IpcHandle(dict(ra.meta, offset=ha.meta["segment_size"]), ra.fds)
            with pytest.raises(ValueError, match="outside the .*-byte segment"):
                gmp.import_pool(bad, libcuda=path)
            old = gmp.IpcHandle({k: v for k, v in ra.meta.items() if k != "segment_size"}, ra.fds)
            with pytest.raises(ValueError, match="segment_size"):
                gmp.import_pool(old, libcuda=path)
        pool.free(a)
        pool.free(b)


def test_pool_names_are_scoped_by_the_sending_process(fake_cuda, tmp_path) -> None:
    """A peer that sends its own pool's descriptor under another exporter's
    pool name ("squatting") does not capture that name: handles received
    from different processes (SO_PEERCRED of their connections) are looked
    up among their own sender's pools, so the exporter's block still
    imports. Two child processes relay the handles (the fake driver's pools
    live in this process), one of them with the squatted name."""
    path, _ = fake_cuda
    relay = textwrap.dedent(
        """
        import json, socket, sys
        meta, fds = json.loads(sys.argv[2]), json.loads(sys.argv[3])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(sys.argv[1])
        socket.send_fds(sock, [json.dumps(meta).encode()], fds)
        sock.recv(1)  # until the importer is done
        """
    )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "importer.sock"))
    listener.listen(2)

    def relayed(meta: dict, fds: list[int]) -> tuple[gmp.IpcHandle, socket.socket, subprocess.Popen]:
        proc = subprocess.Popen([sys.executable, "-c", relay, str(tmp_path / "importer.sock"), json.dumps(meta),
                                 json.dumps(fds)], pass_fds=fds, cwd="/")
        conn, _ = listener.accept()
        return gmp.IpcHandle.recv(conn), conn, proc

    with listener, gmp.MemPool("async", libcuda=path, ipc=True) as victim, \
            gmp.MemPool("async", libcuda=path, ipc=True) as squatter:
        v, s = victim.alloc(4096), squatter.alloc(4096)
        with victim.export(v) as hv, squatter.export(s) as hs:
            squat, sconn, sproc = relayed(dict(hs.meta, pool=hv.meta["pool"]), hs.fds)
            honest, vconn, vproc = relayed(hv.meta, hv.fds)
            with squat, honest, sconn, vconn:
                assert squat.peer == f"pid {sproc.pid} uid {os.getuid()}"
                assert honest.peer == f"pid {vproc.pid} uid {os.getuid()}"
                with gmp.import_pool(squat, libcuda=path) as ms, gmp.import_pool(honest, libcuda=path) as mv:
                    assert (ms.ptr, mv.ptr) == (s, v)  # one process: the exporters' addresses
                # Handles nobody vouched a sender for share one namespace.
                with dup_handle(squat) as ds, dup_handle(honest) as dh, gmp.import_pool(ds, libcuda=path):
                    assert ds.peer is None and dh.peer is None
                    with pytest.raises(gmp.GpuMemPoolError, match="CUDA_ERROR_INVALID_VALUE"):
                        gmp.import_pool(dh, libcuda=path)
                sconn.sendall(b"x")
                vconn.sendall(b"x")
            assert sproc.wait(timeout=60) == 0 and vproc.wait(timeout=60) == 0
        victim.free(v)
        squatter.free(s)


@pytest.mark.parametrize("message,sent,max_fds,match", [
    (b"not json", 2, 256, "not JSON"),
    (b"[1, 2]", 2, 256, "JSON list"),
    (b'{"fds": 3}', 2, 256, "not a list"),
    (b'{"fds": [null]}', 2, 256, "descriptors"),
    (b"\xff\xfe", 2, 256, "not JSON"),
    # Room for one descriptor is room for two (the control buffer is 8-byte
    # aligned): four do not fit, and the rest of the message is lost.
    (b'{"fds": [0, 1, 2, 3]}', 4, 1, "truncated"),
])
def test_recv_of_a_bad_message_closes_the_descriptors(message: bytes, sent: int, max_fds: int, match: str) -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    r, w = os.pipe()
    try:
        before = len(os.listdir("/proc/self/fd"))
        socket.send_fds(a, [message], [r, w] * (sent // 2))
        with pytest.raises(ValueError, match=match):
            gmp.IpcHandle.recv(b, max_fds=max_fds)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


def test_received_descriptors_are_close_on_exec_and_a_named_fd_is_never_used(fake_cuda) -> None:
    """Found by review: received descriptors were inheritable by every child
    process; and a peer adding "Fds": [N] to the handle made the importer map
    its own descriptor N (Go's JSON matches keys case-insensitively). Now the
    descriptors are close-on-exec, and the handle's keys must be exactly the
    exporter's, the descriptors always those that arrived."""
    path, _ = fake_cuda
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b, gmp.MemPool("vmm", libcuda=path, ipc=True) as pool:
        victim = pool.alloc(MiB)
        ptr = pool.alloc(MiB)
        with pool.export(ptr) as h, pool.export(victim) as v:
            h.send(a)
            with gmp.IpcHandle.recv(b) as got:
                assert got.fds and not any(os.get_inheritable(fd) for fd in got.fds)
                crafted = gmp.IpcHandle(dict(got.meta, Fds=list(v.fds)), got.fds)
                with pytest.raises(ValueError, match='unexpected key "Fds"'):
                    gmp.import_pool(crafted, libcuda=path)
                with gmp.import_pool(got, libcuda=path) as mem:  # the genuine one still maps
                    assert mem.size == MiB


def test_a_peer_without_a_pid_here_is_scoped_to_its_connection() -> None:
    """SO_PEERCRED gives pid 0 for a peer in another PID namespace (a
    container): its pool names must not fall back to the namespace shared
    by handles nobody vouched for."""
    import struct

    from gpumempool.ipc import _peer_of

    class Sock:
        def __init__(self, inner: socket.socket, pid: int) -> None:
            self.inner, self.pid = inner, pid

        def getsockopt(self, *args: int) -> bytes:
            return struct.pack("3i", self.pid, 1000, 1000)

        def fileno(self) -> int:
            return self.inner.fileno()

    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with a, b, c, d:
        assert _peer_of(Sock(a, 42)) == "pid 42 uid 1000"  # type: ignore[arg-type]
        pa, pc = _peer_of(Sock(a, 0)), _peer_of(Sock(c, 0))  # type: ignore[arg-type]
        assert pa and pc and pa.startswith("connection ") and pa != pc
        assert _peer_of(Sock(a, 0)) == pa  # type: ignore[arg-type]
