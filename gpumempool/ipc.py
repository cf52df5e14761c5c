"""Sharing pool memory between processes (CUDA IPC with POSIX file
descriptors), for pools created with ``ipc=True`` on the ``async`` or
``vmm`` backend.

Exporter::

    pool = gmp.MemPool("vmm", ipc=True)
    ptr = pool.alloc(1 << 20)
    handle = pool.export(ptr)        # an IpcHandle: JSON metadata + file descriptors
    handle.send(sock)                # over a connected AF_UNIX socket (SCM_RIGHTS)
    handle.close()                   # the descriptors are ours to close once sent

Importer (another process)::

    handle = gmp.IpcHandle.recv(sock)
    with gmp.import_pool(handle) as mem:   # maps the memory; mem.ptr is the block
        ...                                # read and write it with kernels
    handle.close()

The importer must stop using (and unmap) the memory before the exporter
frees the block. File descriptors cannot be pickled or sent as bytes: only a
UNIX socket (SCM_RIGHTS), or inheritance across fork *and* exec
(``subprocess.Popen(..., pass_fds=...)``), carries them to another process.
A child that was only forked, without exec, must not use CUDA or gpumempool
(CUDA's state and the Go runtime's threads do not survive ``fork``).

For an ``async`` pool, ``export`` waits until the allocating stream has
reached the block's allocation, as CUDA requires before another process
touches it; the data the exporter writes there is its own to order (finish
or synchronize its kernels before the importer reads).
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

from . import _native
from ._errors import translate

__all__ = ["ImportedMemory", "IpcHandle", "import_pool"]

_MAX_MESSAGE = 1 << 16


@dataclass
class IpcHandle:
    """An exported block: ``meta`` (JSON-able) plus the file descriptors
    (``fds``) that carry the physical memory.

    ``peer`` says who sent it (set by :meth:`recv` from the socket's peer
    credentials, which the kernel vouches for); :func:`import_pool` looks up
    the exporter's pool among those imported from the same peer only, so a
    peer cannot pass its own pool off under another exporter's pool name.
    Handles made by hand have none and share one namespace: build them only
    from what you trust."""

    meta: dict[str, Any]
    fds: list[int] = field(default_factory=list)
    peer: Optional[str] = None

    def send(self, sock: socket.socket) -> None:
        """Send over a connected AF_UNIX socket; the fds travel as SCM_RIGHTS."""
        socket.send_fds(sock, [json.dumps(self.meta).encode()], self.fds)

    @classmethod
    def recv(cls, sock: socket.socket, max_fds: int = 256) -> "IpcHandle":
        """Receive what :meth:`send` sent (new descriptor numbers here, made
        close-on-exec so that child processes do not inherit the memory)."""
        msg, fds, flags = _recv_fds(sock, max_fds)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError(f"not an IPC handle: more than {_MAX_MESSAGE} bytes or {max_fds} descriptors "
                                 "arrived (truncated)")
            if not msg:
                raise ConnectionError("the peer closed the socket before sending an IPC handle")
            try:
                meta = json.loads(msg)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
                raise ValueError(f"not an IPC handle: the message is not JSON ({type(exc).__name__})") from None
            if not isinstance(meta, dict):
                raise ValueError(f"not an IPC handle: the message is a JSON {type(meta).__name__}, not an object")
            listed = meta.get("fds", [])
            if not isinstance(listed, list):
                raise ValueError("not an IPC handle: 'fds' is not a list")
            if len(fds) != len(listed):
                raise ValueError(f"IPC handle lists {len(listed)} descriptors, {len(fds)} arrived")
        except BaseException:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise
        return cls(meta, list(fds), _peer_of(sock))

    def close(self) -> None:
        """Close this process's descriptors (idempotent)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "IpcHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _peer_of(sock: socket.socket) -> Optional[str]:
    """The process at the other end of a UNIX socket, as the kernel saw it
    connect (SO_PEERCRED: for a socketpair, the process that made the pair;
    for a peer whose pid this PID namespace cannot name, the connection), or
    None where the socket has no peer credentials."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid, uid, _gid = struct.unpack("3i", creds)
    if pid > 0:
        return f"pid {pid} uid {uid}"
    # A peer in another PID namespace (a container) shows as pid 0: its
    # pools are then scoped to this connection, never shared with another.
    return f"connection {os.fstat(sock.fileno()).st_ino} uid {uid}"


def _recv_fds(sock: socket.socket, max_fds: int) -> tuple[bytes, list[int], int]:
    """socket.recv_fds with MSG_CMSG_CLOEXEC (recv_fds ignores its flags on
    Python < 3.12): the message, the descriptors and the message flags."""
    fds = array.array("i")  # parsed as socket.recv_fds does
    size = socket.CMSG_SPACE(max_fds * fds.itemsize)
    msg, ancdata, flags, _addr = sock.recvmsg(_MAX_MESSAGE, size, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds), flags


class ImportedMemory:
    """Memory of another process mapped into this one. ``ptr`` is the
    exported block's address here, ``size`` its size."""

    def __init__(self, import_id: int, ptr: int, size: int) -> None:
        self._id: Optional[int] = import_id
        self.ptr = ptr
        self.size = size

    def close(self) -> None:
        """Unmap (idempotent)."""
        if self._id is None:
            return
        import_id, self._id = self._id, None
        try:
            _native.bindings.CloseImport(import_id)
        except RuntimeError as exc:
            raise translate(exc) from None

    def __enter__(self) -> "ImportedMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpumempool.ImportedMemory ptr={self.ptr:#x} size={self.size}{' closed' if self._id is None else ''}>"


def import_pool(handle: IpcHandle, libcuda: Optional[str] = None) -> ImportedMemory:
    """Map an exported block (see :meth:`MemPool.export`) into this process."""
    if not isinstance(handle, IpcHandle):
        raise TypeError(f"import_pool takes an IpcHandle, got {type(handle).__name__}")
    # The descriptors are ours, never named by the peer: its "fds" is left out.
    meta = {k: v for k, v in handle.meta.items() if k != "fds"}
    try:
        out = json.loads(_native.bindings.ImportMemory(json.dumps(meta), json.dumps(list(handle.fds)),
                                                       os.fspath(libcuda) if libcuda else "", handle.peer or ""))
    except RuntimeError as exc:
        raise translate(exc) from None
    return ImportedMemory(out["id"], out["ptr"], out["size"])
