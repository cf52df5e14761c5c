"""A fake ``torch`` (and the fixtures and helpers of the tests that use it)
for the torch integration's tests without a GPU or torch: the tests install
it into ``sys.modules`` (:func:`install`).

It models what gpumempool.torch depends on, after PyTorch's sources:
torch.cuda.MemPool over a pluggable allocator, use_mem_pool, the per-device
``captures_underway`` list with its "already recording to mempool_id"
check, thread filters, private pools that cache freed blocks, emptyCache of
unreferenced pools, snapshots, change_current_allocator and the pluggable
allocator's hooks, and ProcessGroupNCCL's register_mem_pool. Three
variants: "2.5" (MemPoolContext, always-true filter, first match, no
MemPool.snapshot, destructor does not empty), "2.7" (+ snapshot,
register_mem_pool of present segments) and "2.11" (thread-local routing,
LIFO, use_on_oom/no_split). The pluggable allocator calls gpumempool's real
exported C functions, so segments come from a real engine pool on the
simulated device.

A test module that uses it imports the fixtures it needs, ``clean_state``
(autouse: resets gpumempool.torch and gpumempool.scope around each test)
among them: ``from faketorch import clean_state, install, sim``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import threading
import types
from typing import Any, Callable, Iterator, Optional

import pytest

import gpumempool as gmp
from gpumempool import scope as gscope
from gpumempool import torch as gtorch

MiB = 1 << 20
ALLOC_T = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


def seg_size(n: int) -> int:
    """torch's segment size for a request (CUDACachingAllocator::get_allocation_size)."""
    if n <= MiB:
        return 2 * MiB
    if n < 10 * MiB:
        return 20 * MiB
    return (n + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)


# ---------------------------------------------------------------------------
# the fake torch
# ---------------------------------------------------------------------------


class FakeRawPluggable:
    """torch._C._CUDAPluggableAllocator: calls the C functions, keeps metadata, hooks."""

    def __init__(self, alloc_fn: Any, free_fn: Any) -> None:
        self.alloc_fn, self.free_fn = alloc_fn, free_fn
        self.meta: dict[int, tuple[int, int, int]] = {}
        self.hooks: dict[str, Any] = {}
        self.throws = False  # the alloc function throws instead of returning NULL

    def set_init_fn(self, addr: int) -> None:
        self.hooks["init"] = ctypes.CFUNCTYPE(None, ctypes.c_int)(addr)

    def set_reset_fn(self, addr: int) -> None:
        self.hooks["reset"] = ctypes.CFUNCTYPE(None)(addr)

    def set_memory_fraction_fn(self, addr: int) -> None:
        self.hooks["fraction"] = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(addr)

    def set_record_stream_fn(self, addr: int) -> None:
        self.hooks["record_stream"] = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(addr)

    def malloc(self, size: int, device: int, stream: int) -> int:
        ptr = self.alloc_fn(size, device, stream) or 0
        if ptr:
            self.meta[ptr] = (size, device, stream)
        return ptr

    def raw_delete(self, ptr: int) -> None:
        size, device, stream = self.meta.pop(ptr)
        self.free_fn(ptr, size, device, stream)


class FakePrivatePool:
    def __init__(self, pid: tuple[int, int], device: int, allocator: Any) -> None:
        self.pid, self.device, self.allocator = pid, device, allocator
        self.use_count = 1
        self.segs: dict[int, list[Any]] = {}  # address -> [size, allocated]


class FakeTensor:
    def __init__(self, world: "World", ptr: int, nbytes: int, device: int, pid: Any, kind: str) -> None:
        self.world, self.ptr, self.nbytes, self.device, self.pid, self.kind = world, ptr, nbytes, device, pid, kind
        self.alive = True

    def record_stream(self, stream: Any) -> None:
        if self.kind == "pluggable":
            self.world.current_allocator.hooks["record_stream"](self.ptr, getattr(stream, "cuda_stream", stream))

    def __del__(self) -> None:
        if self.alive:
            self.alive = False
            with contextlib.suppress(Exception):
                self.world.free_tensor(self)


class World:
    """State of the fake torch process."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.version = tuple(int(x) for x in variant.split("."))
        self.modern = self.version >= (2, 8)
        self.captures: dict[int, list[tuple[tuple[int, int], Any]]] = {}
        self.pools: dict[tuple[int, int], FakePrivatePool] = {}
        self.initialized = False
        self.current_allocator: Optional[FakeRawPluggable] = None
        self.native_next = 0x7F00_0000_0000
        self.tls = threading.local()
        self.uid = 0
        self.misroutes: list[str] = []
        self.calls: list[tuple[Any, ...]] = []
        self.segment_hooks: list[Any] = []
        self.lock = threading.RLock()

    # thread state
    def device(self) -> int:
        return getattr(self.tls, "device", 0)

    def stream(self) -> "FakeStream":
        return getattr(self.tls, "stream", None) or FakeStream(0)

    def lazy_init(self) -> None:
        if not self.initialized:
            self.initialized = True
            if self.current_allocator is not None and "init" in self.current_allocator.hooks:
                self.current_allocator.hooks["init"](2)

    # CUDACachingAllocator's pool routing
    def begin(self, device: int, pid: Any, filt: Any) -> None:
        pid = tuple(pid)
        with self.lock:
            self.calls.append(("begin", device, pid))
            self.pools[pid].use_count += 1
            for other, _ in self.captures.get(device, []):
                if other == pid:
                    raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
            self.captures.setdefault(device, []).append((pid, filt))

    def end(self, device: int, pid: Any) -> None:
        pid = tuple(pid)
        with self.lock:
            self.calls.append(("end", device, pid))
            entries = self.captures.get(device, [])
            for i, (other, _) in enumerate(entries):
                if other == pid:
                    del entries[i]
                    return
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    def release(self, device: int, pid: Any) -> None:
        pid = tuple(pid)
        with self.lock:
            self.calls.append(("release", device, pid))
            pp = self.pools[pid]
            pp.use_count -= 1
            if pp.use_count < 0:
                raise RuntimeError("uc >= 0 INTERNAL ASSERT FAILED")

    def empty_pool(self, pid: Any) -> None:
        pp = self.pools.get(tuple(pid))
        if pp is None:
            return
        for addr, (_size, allocated) in list(pp.segs.items()):
            if not allocated:
                pp.allocator.raw_delete(addr)
                del pp.segs[addr]

    def empty_cache(self) -> None:
        if self.current_allocator is not None:
            if "reset" in self.current_allocator.hooks:
                self.current_allocator.hooks["reset"]()
            return
        for pid, pp in list(self.pools.items()):
            if pp.use_count == 0:
                self.empty_pool(pid)

    # tensors
    def alloc(self, nbytes: int, device: Optional[int] = None) -> FakeTensor:
        self.lazy_init()
        dev = self.device() if device is None else device
        stream = self.stream().cuda_stream
        if self.current_allocator is not None:
            ptr = self.current_allocator.malloc(nbytes, dev, stream)
            if not ptr and self.current_allocator.throws:  # torch: C++ exception -> RuntimeError
                raise RuntimeError(f"CUDA out of memory. Tried to allocate {nbytes} bytes on device {dev}")
            if not ptr:  # what torch's pluggable allocator really does: a tensor at address 0
                return FakeTensor(self, 0, nbytes, dev, None, "pluggable")
            return FakeTensor(self, ptr, nbytes, dev, None, "pluggable")
        tid = threading.get_ident()
        with self.lock:
            entries = list(self.captures.get(dev, []))
            if self.modern:
                entries.reverse()  # LIFO since pytorch#168382
            pp = next((self.pools[pid] for pid, filt in entries if filt(tid)), None)
            if pp is None:
                self.native_next += seg_size(nbytes)
                return FakeTensor(self, self.native_next, nbytes, dev, None, "native")
            allocator = pp.allocator
            if not self.modern:  # 2.5-2.7: the allocator comes from MemPoolContext
                active = FakeMemPoolContext.active_pool()
                if active is None or active.allocator is not pp.allocator:
                    self.misroutes.append(f"private pool {pp.pid} allocated with another pool's allocator")
            for addr, seg in pp.segs.items():
                if not seg[1] and seg[0] >= nbytes:
                    seg[1] = True
                    return FakeTensor(self, addr, nbytes, dev, pp.pid, "private")
            size = seg_size(nbytes)
            ptr = allocator.malloc(size, dev, stream)
            if not ptr:
                raise MemoryError("CUDA out of memory (private pool)")
            pp.segs[ptr] = [size, True]
            for hook in self.segment_hooks:
                hook(pp.pid, ptr)
            return FakeTensor(self, ptr, nbytes, dev, pp.pid, "private")

    def free_tensor(self, t: FakeTensor) -> None:
        if t.kind == "pluggable":
            self.current_allocator.raw_delete(t.ptr)
        elif t.kind == "private":
            with self.lock:
                self.pools[t.pid].segs[t.ptr][1] = False

    def snapshot(self, pid: Any = None) -> list[dict[str, Any]]:
        out = []
        for p, pp in self.pools.items():
            if pid is not None and p != tuple(pid):
                continue
            for addr, (size, allocated) in pp.segs.items():
                out.append({
                    "device": pp.device, "address": addr, "total_size": size,
                    "allocated_size": size if allocated else 0, "segment_pool_id": p,
                    "blocks": [{"size": size, "state": "active_allocated" if allocated else "inactive"}],
                })
        return out


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class FakeMemPoolContext:
    _tls = threading.local()

    def __init__(self, pool: Any) -> None:
        self.prev = getattr(self._tls, "active", None)
        self._tls.active = pool

    def __del__(self) -> None:
        self._tls.active = self.prev

    @classmethod
    def active_pool(cls) -> Any:
        return getattr(cls._tls, "active", None)


class FakeBackend:
    """ProcessGroupNCCL: registerSegment refuses a segment registered
    already, deregisterSegment one that is not; torch >= 2.8 also registers
    segments a registered pool gains (its allocator hook)."""

    def __init__(self, world: World, mode: str, comm_error: bool = False) -> None:
        self.world, self.mode, self.comm_error = world, mode, comm_error
        self.destroyed = False  # destroy_process_group ran
        self.segments: set[tuple[Any, int]] = set()  # registered (pool, address); sim devices share addresses
        self.pools: set[tuple[int, int]] = set()
        self.calls: list[tuple[str, Any]] = []
        world.segment_hooks.append(self._segment_alloc)
        if mode == "mem_pool":
            self.register_mem_pool = self._register
            self.deregister_mem_pool = self._deregister
        elif mode == "comm":
            self._comm_ptr = lambda: 0xC0FFEE

    def _segment_alloc(self, pid: tuple[int, int], addr: int) -> None:
        if self.world.modern and pid in self.pools:
            self.segments.add((pid, addr))

    def registered(self, pid: Any) -> set[int]:
        return {s["address"] for s in self.world.snapshot(pid) if (tuple(pid), s["address"]) in self.segments}

    def _register(self, pool: Any) -> None:
        if self.comm_error:
            raise RuntimeError("NCCL communicator has not been initialized before mem pool creation.")
        self.calls.append(("register", tuple(pool.id)))
        self.pools.add(tuple(pool.id))
        for s in self.world.snapshot(pool.id):
            if (tuple(pool.id), s["address"]) in self.segments:
                raise RuntimeError(f"Segment with ptr {s['address']} is already registered with this NCCL comm")
            self.segments.add((tuple(pool.id), s["address"]))

    def _deregister(self, pool: Any) -> None:
        if self.destroyed:  # torch 2.11's NCCLComm::destroy poisons getNcclComm
            raise RuntimeError("NCCL communicator was aborted on rank 0.")
        self.calls.append(("deregister", tuple(pool.id)))
        self.pools.discard(tuple(pool.id))
        for s in self.world.snapshot(pool.id):
            if (tuple(pool.id), s["address"]) not in self.segments:
                raise RuntimeError(f"Segment with ptr {s['address']} is not registered with this NCCL comm")
            self.segments.remove((tuple(pool.id), s["address"]))


class FakeGroup:
    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def _get_backend(self, device: Any) -> FakeBackend:
        return self.backend


def make_torch(variant: str = "2.11", *, use_mem_pool: bool = True, mem_pool: bool = True,
               nccl_mode: str = "mem_pool") -> types.ModuleType:
    world = World(variant)
    torch = types.ModuleType("torch")
    torch.__version__ = variant + ".0+fake"
    torch._world = world  # type: ignore[attr-defined]
    C = types.SimpleNamespace()
    if world.modern:
        C._cuda_beginAllocateCurrentThreadToPool = lambda d, pid: world.begin(
            d, pid, (lambda me: (lambda tid: tid == me))(threading.get_ident()))
        C._cuda_endAllocateToPool = world.end
    else:
        C._cuda_endAllocateCurrentStreamToPool = world.end
    C._cuda_beginAllocateToPool = lambda d, pid: world.begin(d, pid, lambda tid: True)
    C._cuda_releasePool = world.release
    C._CUDAPluggableAllocator = FakeRawPluggable
    torch._C = C

    class CUDAPluggableAllocator:
        def __init__(self, path: str, alloc_name: str, free_name: str) -> None:
            lib = ctypes.CDLL(path)
            assert hasattr(lib, alloc_name) and hasattr(lib, free_name)
            self.source = (path, alloc_name, free_name)
            # ctypes cannot catch a C++ exception: call the C function the
            # throwing one wraps and throw here what it would (test_cabi.py
            # checks the C++ entry point itself from C++). The out-of-memory
            # shim of oom_error="torch" is only ever called from C++ here.
            throws = "_or_throw_" in alloc_name or alloc_name == "gmp_torch_oom_alloc"
            if alloc_name == "gmp_torch_oom_alloc":
                def a(size: int, device: int, stream: Any) -> int:
                    raise AssertionError("the fake cannot call a C++ function that throws")
            else:
                a = ALLOC_T(ctypes.cast(getattr(lib, alloc_name.replace("_or_throw", "")), ctypes.c_void_p).value)
            f = FREE_T(ctypes.cast(getattr(lib, free_name), ctypes.c_void_p).value)
            self._allocator = FakeRawPluggable(a, f)
            self._allocator.throws = throws

        def allocator(self) -> FakeRawPluggable:
            return self._allocator

    def change_current_allocator(cpa: Any) -> None:
        if world.initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        world.current_allocator = cpa.allocator()
        change_current_allocator.last = cpa  # type: ignore[attr-defined]

    class MemPoolBase:
        def _setup(self, allocator: Any, options: dict[str, bool]) -> None:
            if world.current_allocator is not None and world.version >= (2, 11):
                # torch 2.11: MemPool() calls createOrIncrefPool, which
                # CUDAPluggableAllocator lacks (c10's default refuses).
                raise RuntimeError("CUDAPluggableAllocator does not yet support createOrIncrefPool. If you need it, "
                                   "please file an issue describing your use case.")
            world.lazy_init()
            world.uid += 1
            self._pid = (0, world.uid)
            self.device = world.device()
            self.allocator = allocator
            self.options = options
            world.pools[self._pid] = FakePrivatePool(self._pid, self.device, allocator)

        @property
        def id(self) -> tuple[int, int]:
            return self._pid

        def __del__(self) -> None:
            if world.version < (2, 6):
                return  # torch 2.5's MemPool has no destructor: its pool stays
            with contextlib.suppress(Exception):
                world.release(self.device, self._pid)
                world.empty_pool(self._pid)

    if world.version >= (2, 10):
        class MemPool(MemPoolBase):
            def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False) -> None:
                self._setup(allocator, {"use_on_oom": use_on_oom, "no_split": no_split})

            def use_count(self) -> int:
                return world.pools[self._pid].use_count

            def snapshot(self) -> list[dict[str, Any]]:
                return world.snapshot(self._pid)
    elif world.version >= (2, 8):
        class MemPool(MemPoolBase):  # type: ignore[no-redef]
            def __init__(self, allocator: Any = None, use_on_oom: bool = False) -> None:  # 2.9 (2.8: + symmetric)
                self._setup(allocator, {"use_on_oom": use_on_oom})

            def use_count(self) -> int:
                return world.pools[self._pid].use_count

            def snapshot(self) -> list[dict[str, Any]]:
                return world.snapshot(self._pid)
    elif world.version >= (2, 6):
        class MemPool(MemPoolBase):  # type: ignore[no-redef]
            def __init__(self, allocator: Any = None) -> None:
                self._setup(allocator, {})

            def use_count(self) -> int:
                return world.pools[self._pid].use_count

            def snapshot(self) -> list[dict[str, Any]]:
                return world.snapshot(self._pid)
    else:
        class MemPool(MemPoolBase):  # type: ignore[no-redef]
            def __init__(self, allocator: Any = None) -> None:
                self._setup(allocator, {})

    @contextlib.contextmanager
    def use_mem_pool_modern(pool: Any, device: Any = None) -> Any:
        d = world.device() if device is None else device
        C._cuda_beginAllocateCurrentThreadToPool(d, pool.id)
        try:
            yield
        finally:
            C._cuda_endAllocateToPool(d, pool.id)
            C._cuda_releasePool(d, pool.id)

    @contextlib.contextmanager
    def use_mem_pool_legacy(pool: Any, device: Any = None) -> Any:
        ctx = FakeMemPoolContext(pool)
        d = world.device() if device is None else device
        C._cuda_beginAllocateToPool(d, pool.id)
        try:
            yield
        finally:
            C._cuda_endAllocateCurrentStreamToPool(d, pool.id)
            if world.version >= (2, 6):  # torch 2.5's use_mem_pool never releases the pool
                C._cuda_releasePool(d, pool.id)
            del ctx

    @contextlib.contextmanager
    def device_cm(d: int) -> Any:
        prev = world.device()
        world.tls.device = d
        try:
            yield
        finally:
            world.tls.device = prev

    @contextlib.contextmanager
    def stream_cm(s: Any) -> Any:
        prev = getattr(world.tls, "stream", None)
        world.tls.stream = s
        try:
            yield
        finally:
            world.tls.stream = prev

    memory = types.SimpleNamespace(
        CUDAPluggableAllocator=CUDAPluggableAllocator,
        change_current_allocator=change_current_allocator,
        _snapshot=lambda *a, **k: {"segments": world.snapshot()},
    )
    cuda = types.SimpleNamespace(
        memory=memory,
        is_available=lambda: True,
        is_initialized=lambda: world.initialized,
        current_device=world.device,
        device=device_cm,
        stream=stream_cm,
        Stream=FakeStream,
        current_stream=lambda device=None: world.stream(),
        empty_cache=world.empty_cache,
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=8 << 30),
        set_per_process_memory_fraction=lambda f, d=None: world.current_allocator.hooks["fraction"](f, d or 0),
    )
    if mem_pool:
        memory.MemPool = cuda.MemPool = MemPool
        if use_mem_pool:
            memory.use_mem_pool = cuda.use_mem_pool = use_mem_pool_modern if world.modern else use_mem_pool_legacy
    if not world.modern:
        memory.MemPoolContext = FakeMemPoolContext
    torch.cuda = cuda
    torch.device = lambda kind, index=None: types.SimpleNamespace(type=kind, index=index)
    backend = FakeBackend(world, nccl_mode)
    group = FakeGroup(backend)
    state = {"initialized": True}
    torch.distributed = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: state["initialized"],
        distributed_c10d=types.SimpleNamespace(_get_default_group=lambda: group),
    )
    torch._backend = backend  # type: ignore[attr-defined]
    torch._group = group  # type: ignore[attr-defined]
    torch._dist_state = state  # type: ignore[attr-defined]
    torch.empty = world.alloc  # type: ignore[attr-defined]
    return torch


@pytest.fixture(autouse=True)
def clean_state():
    gtorch._reset_for_tests()
    gscope._reset_for_tests()
    yield
    gtorch._reset_for_tests()
    gscope._reset_for_tests()
    gc.collect()


@pytest.fixture()
def sim():
    p = gmp.MemPool("sim", name="torchpool", devices=2, capacity=1 << 30)
    yield p
    p.close()


def install(monkeypatch: pytest.MonkeyPatch, variant: str = "2.11", **kw: Any) -> Any:
    torch = make_torch(variant, **kw)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


VARIANTS = ["2.5", "2.7", "2.11"]


def allocated(pool: gmp.MemPool, device: Any = None) -> int:
    return pool.stats(device)["allocated_bytes.all.current"]


@contextlib.contextmanager
def inside_in_another_thread(pool: Optional[gmp.MemPool] = None, name: str = "holder", *,
                             enter: Optional[Callable[[], Any]] = None,
                             body: Callable[[Any], Any] = lambda _: None) -> Iterator[None]:
    """A thread named ``name`` sits inside ``gmp.mempool(pool)`` (or the
    context ``enter()`` gives) for the length of the block, after running
    ``body`` on what the context yields; what it raises fails the test once
    the thread has left."""
    entered, leave = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with (enter() if enter is not None else gmp.mempool(pool)) as value:
                body(value)
                entered.set()
                leave.wait(10)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            errors.append(exc)

    th = threading.Thread(target=worker, name=name)
    th.start()
    assert entered.wait(10), f"the thread did not get inside: {errors!r}"
    try:
        yield
    finally:
        leave.set()
        th.join()
    assert errors == [], errors
