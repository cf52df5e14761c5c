"""The torch, CuPy and cache-scope integrations without a GPU, torch or CuPy.

A fake ``torch`` (injected into sys.modules) models what gpumempool.torch
depends on, after PyTorch's sources: torch.cuda.MemPool over a pluggable
allocator, use_mem_pool, the per-device ``captures_underway`` list with its
"already recording to mempool_id" check, thread filters, private pools that
cache freed blocks, emptyCache of unreferenced pools, snapshots,
change_current_allocator and the pluggable allocator's hooks, and
ProcessGroupNCCL's register_mem_pool. Three variants: "2.5" (MemPoolContext,
always-true filter, first match, no MemPool.snapshot, destructor does not
empty), "2.7" (+ snapshot, register_mem_pool of present segments) and "2.11"
(thread-local routing, LIFO, use_on_oom/no_split). The pluggable allocator
calls gpumempool's real exported C functions, so segments come from a real
engine pool on the simulated device.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import sys
import threading
import types
import warnings
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


# ---------------------------------------------------------------------------
# version dispatch
# ---------------------------------------------------------------------------


def test_without_torch_the_error_says_what_to_install(monkeypatch, sim):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(gtorch.TorchVersionError, match=r"needs torch >= 2\.5.*gpumempool\[torch\]"):
        with gmp.mempool(sim):
            pass
    with pytest.raises(gtorch.TorchVersionError):
        gmp.set_torch_allocator(sim)
    assert isinstance(gtorch.TorchVersionError("x"), RuntimeError)


def test_torch_without_mempool_is_too_old(monkeypatch, sim):
    install(monkeypatch, "2.4", mem_pool=False)
    with pytest.warns(gtorch.TorchVersionWarning, match=r"tested with torch 2\.5-2\.15; this is torch 2\.4"), \
            pytest.raises(gtorch.TorchVersionError, match=r"torch >= 2\.5.*this is torch 2\.4") as exc:
        with gmp.mempool(sim):
            pass
    assert exc.value.version == "2.4.0+fake" and exc.value.needed == "torch >= 2.5"


def test_a_torch_outside_the_tested_range_warns_once(monkeypatch, sim):
    import warnings

    assert gtorch.TESTED_TORCH == ((2, 5), (2, 15))
    install(monkeypatch, "2.16")
    with pytest.warns(gtorch.TorchVersionWarning, match=r"tested with torch 2\.5-2\.15; this is torch 2\.16\.0"):
        gtorch.capabilities()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gtorch.capabilities()  # once
        with gmp.mempool(sim):
            pass
    install(monkeypatch, "2.11")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gtorch.capabilities()  # a tested torch says nothing


@pytest.mark.parametrize("build, words", [("cpu", "a CPU-only build"), ("rocm", "a ROCm build")])
def test_a_torch_that_is_not_a_cuda_build_is_one_clear_error(monkeypatch, sim, build, words):
    torch = install(monkeypatch, "2.11")
    torch.version = types.SimpleNamespace(cuda=None if build == "cpu" else "12.8",  # type: ignore[attr-defined]
                                          hip="6.2" if build == "rocm" else None)
    for call in (lambda: gmp.mempool(sim).__enter__(), lambda: gtorch.set_torch_allocator(sim)):
        with pytest.raises(gtorch.TorchVersionError, match=f"torch 2.11.0\\+fake is {words}: gpumempool's torch "
                           "integration needs a CUDA build") as exc:
            call()
        assert exc.value.needed == "a CUDA build"


@pytest.mark.parametrize(
    "variant, thread_local, pool_context, options, snapshot, nccl_new",
    [
        ("2.5", False, True, (), False, False),
        ("2.7", False, True, (), True, False),
        ("2.11", True, False, ("use_on_oom", "no_split"), True, True),
    ],
)
def test_capabilities(monkeypatch, variant, thread_local, pool_context, options, snapshot, nccl_new):
    torch = install(monkeypatch, variant)
    caps = gtorch.capabilities()
    assert caps == gtorch.capabilities(torch)
    assert caps.version.startswith(variant)
    assert caps.mem_pool and caps.use_mem_pool and caps.pluggable
    assert caps.thread_local_routing is thread_local
    assert caps.pool_context is pool_context
    assert caps.mem_pool_options == options
    assert caps.pool_snapshot is snapshot
    assert caps.nccl_registers_new_segments is nccl_new


def test_private_calls_replace_a_missing_use_mem_pool(monkeypatch, sim):
    torch = install(monkeypatch, "2.11", use_mem_pool=False)
    caps = gtorch.capabilities()
    assert not caps.use_mem_pool and caps.thread_local_routing
    assert (caps.begin_fn, caps.end_fn) == ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool")
    with gmp.mempool(sim) as tp:
        t = torch.empty(1000)
    assert t.pid == tp.id and allocated(sim) == 2 * MiB
    kinds = [c[0] for c in torch._world.calls]
    assert kinds == ["begin", "end", "release"]
    assert torch._world.pools[tp.id].use_count == 1


def test_legacy_private_calls_use_the_pool_context(monkeypatch, sim):
    torch = install(monkeypatch, "2.5", use_mem_pool=False)
    caps = gtorch.capabilities()
    assert (caps.begin_fn, caps.end_fn) == ("_cuda_beginAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
    with pytest.warns(gtorch.ProcessWideRoutingWarning):
        with gmp.mempool(sim) as tp:
            t = torch.empty(1000)
    assert t.pid == tp.id and not torch._world.misroutes


# ---------------------------------------------------------------------------
# the mempool context
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_routes_inside_and_reuses_one_torch_pool(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    outside = torch.empty(1000)
    assert outside.kind == "native"
    with gmp.mempool(sim, device="cuda:0") as tp:
        x = torch.empty(3 * MiB)
    y = torch.empty(10)
    assert x.kind == "private" and x.pid == tp.id and y.kind == "native"
    assert allocated(sim) == 20 * MiB  # torch's segment, from our engine
    with gmp.mempool(sim) as tp2:
        z = torch.empty(3 * MiB)
    assert tp2 is tp and gtorch.torch_pools(sim) == [tp]
    assert z.pid == tp.id and allocated(sim) == 40 * MiB
    del z
    with gmp.mempool(sim):
        w = torch.empty(2 * MiB)  # torch's cache inside the torch pool: no new segment
    assert allocated(sim) == 40 * MiB and w.pid == tp.id
    assert x.alive and x.ptr in torch._world.pools[tp.id].segs  # outlives the block
    if variant == "2.5":  # its use_mem_pool never releases: each entry adds a use
        assert torch._world.pools[tp.id].use_count == 4
    else:
        assert torch._world.pools[tp.id].use_count == 1  # every begin has its release
    assert not torch._world.misroutes


@pytest.mark.parametrize("variant", VARIANTS)
def test_nesting_routes_to_the_innermost_pool(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    other = gmp.MemPool("sim", name="inner", capacity=1 << 30)
    try:
        with gmp.mempool(sim) as ta:
            a1 = torch.empty(1000)
            with gmp.mempool(other) as tb:
                b = torch.empty(1000)
                with gmp.mempool(sim) as ta2:  # the outer pool again, inside the inner one
                    a2 = torch.empty(3 * MiB)
                b2 = torch.empty(3 * MiB)
            a3 = torch.empty(12 * MiB)
        n = torch.empty(1000)
        assert ta2 is ta
        assert [t.pid for t in (a1, a2, a3)] == [ta.id] * 3
        assert [t.pid for t in (b, b2)] == [tb.id] * 2
        assert n.kind == "native"
        assert allocated(other) == 2 * MiB + 20 * MiB
        assert allocated(sim) == 2 * MiB + 20 * MiB + 12 * MiB
        assert not torch._world.misroutes  # 2.5-2.7: MemPoolContext stayed consistent
        assert torch._world.captures[0] == []
        if variant != "2.5":  # (2.5's use_mem_pool never releases: each entry adds a use)
            assert torch._world.pools[ta.id].use_count == 1 and torch._world.pools[tb.id].use_count == 1
    finally:
        other.close()


def test_same_pool_nested_in_itself(monkeypatch, sim):
    torch = install(monkeypatch)
    with gmp.mempool(sim) as t1:
        with gmp.mempool(sim) as t2:
            x = torch.empty(100)
        y = torch.empty(100)
    assert t1 is t2 and x.pid == y.pid == t1.id
    assert len(gtorch.torch_pools(sim)) == 1


def test_other_threads_are_not_routed(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    got: dict[str, Any] = {}
    with gmp.mempool(sim):
        th = threading.Thread(target=lambda: got.update(t=torch.empty(1000)))
        th.start()
        th.join()
        mine = torch.empty(1000)
    assert got["t"].kind == "native" and mine.kind == "private"


def test_all_threads_routes_other_threads_too(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    got: dict[str, Any] = {}
    with gmp.mempool(sim, all_threads=True) as tp:
        th = threading.Thread(target=lambda: got.update(t=torch.empty(1000)))
        th.start()
        th.join()
    assert got["t"].pid == tp.id  # e.g. autograd's backward thread
    assert torch._world.pools[tp.id].use_count == 1 and torch._world.captures[0] == []
    del torch._C._cuda_beginAllocateToPool
    gtorch._capabilities.caps_cache.clear()
    with pytest.raises(gtorch.TorchVersionError, match="all_threads"):
        with gmp.mempool(sim, all_threads=True):
            pass


def test_all_threads_and_another_threads_route_conflict_is_warned(monkeypatch, sim):
    # torch checks the newest route first (2.10+): an all_threads route
    # entered after another thread's own route takes that thread's
    # allocations too - the conflict the warning names.
    torch = install(monkeypatch, "2.11")
    other = gmp.MemPool("sim", name="theirs")
    entered, leave, got = threading.Event(), threading.Event(), {}

    def worker() -> None:
        with gmp.mempool(other) as tp:
            got["tp"] = tp
            entered.set()
            leave.wait(10)
            got["t"] = torch.empty(1000)

    th = threading.Thread(target=worker)
    th.start()
    try:
        assert entered.wait(10)
        with pytest.warns(gtorch.RoutingConflictWarning, match="'theirs'"):
            with gmp.mempool(sim, all_threads=True) as mine:
                leave.set()
                th.join(10)
    finally:
        leave.set()
        th.join(10)
        other.close()
    assert got["t"].pid == mine.id != got["tp"].id  # what the warning was about
    assert gtorch._routing.active_routes.get(0) == []
    with warnings.catch_warnings():  # one thread alone: no conflict
        warnings.simplefilter("error", gtorch.RoutingConflictWarning)
        with gmp.mempool(sim, all_threads=True), gmp.mempool(sim):
            pass


def test_process_wide_routing_is_warned_once(monkeypatch, sim):
    torch = install(monkeypatch, "2.5")
    got: dict[str, Any] = {}
    with pytest.warns(gtorch.ProcessWideRoutingWarning, match="every thread"):
        with gmp.mempool(sim):
            th = threading.Thread(target=lambda: got.update(t=torch.empty(1000)))
            th.start()
            th.join()
    assert got["t"].kind == "private"  # what torch 2.5-2.7 does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gmp.mempool(sim):
            pass


def test_concurrent_threads_get_their_own_torch_pools(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    inside = threading.Barrier(2)
    results: dict[str, Any] = {}

    def worker(name: str) -> None:
        try:
            with gmp.mempool(sim) as tp:
                inside.wait(timeout=10)
                results[name] = (tp, torch.empty(1000))
                inside.wait(timeout=10)
        except BaseException as exc:  # noqa: BLE001
            results[name] = exc

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    (ta, xa), (tb, xb) = results["a"], results["b"]
    assert ta is not tb  # torch would refuse one pool for two threads at once
    assert xa.pid == ta.id and xb.pid == tb.id
    pools = gtorch.torch_pools(sim)
    assert len(pools) == 2
    with gmp.mempool(sim) as again:
        pass
    assert again is pools[0]  # the first one is reused


def test_stream_is_entered_with_the_pool(monkeypatch, sim):
    torch = install(monkeypatch)
    s = torch.cuda.Stream(0x5000)
    with gmp.mempool(sim, stream=s):
        assert torch.cuda.current_stream() is s
        x = torch.empty(1000)
    assert torch.cuda.current_stream().cuda_stream == 0
    assert torch._world.pools[x.pid].allocator.meta[x.ptr][2] == 0x5000  # the segment was asked for on s


def test_devices(monkeypatch, sim):
    torch = install(monkeypatch)
    with gmp.mempool(sim, device="cuda:1") as t1:
        pass
    with gmp.mempool(sim, device=torch.device("cuda", 1)) as t1b:
        x = torch.empty(1000, device=1)
    with gmp.mempool(sim, device=0) as t0:
        pass
    assert t1 is t1b and t1.device == 1 and t0.device == 0 and t0 is not t1
    assert x.pid == t1.id and allocated(sim, 1) == 2 * MiB and allocated(sim, 0) == 0
    assert gtorch.torch_pools(sim, device=1) == [t1]
    with pytest.raises(gmp.InvalidArgumentError, match="cuda"):
        gmp.mempool(sim, device="cpu").__enter__()
    with pytest.raises(TypeError):
        gmp.mempool(sim, device=True).__enter__()
    with pytest.raises(gmp.InvalidArgumentError):
        gmp.mempool(sim, device=torch.device("cpu")).__enter__()
    with pytest.raises(TypeError, match="gpumempool.MemPool"):
        gmp.mempool("not a pool")


def test_closed_pool_and_single_use_context(monkeypatch):
    install(monkeypatch)
    p = gmp.MemPool("sim", capacity=1 << 26)
    cm = gmp.mempool(p)
    with cm:
        pass
    with pytest.raises(gtorch.TorchIntegrationError, match="entered once"):
        cm.__enter__()
    p.close()
    with pytest.raises(gmp.PoolClosedError):
        with gmp.mempool(p):
            pass


def test_exiting_out_of_order_is_an_error(monkeypatch, sim):
    install(monkeypatch)
    other = gmp.MemPool("sim", capacity=1 << 26)
    outer, inner = gmp.mempool(sim), gmp.mempool(other)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(gtorch.TorchIntegrationError, match="out of order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    other.close()


def test_mempool_options_are_fixed_per_torch_pool(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    with gmp.mempool(sim, use_on_oom=True, no_split=True) as tp:
        a = torch.empty(1000)
    assert tp.options == {"use_on_oom": True, "no_split": True} and a.pid == tp.id
    # other options: another torch pool over the same gmp pool, torch's defaults
    with gmp.mempool(sim) as plain:
        b = torch.empty(1000)
    assert plain is not tp and plain.options == {"use_on_oom": False, "no_split": False} and b.pid == plain.id
    with gmp.mempool(sim, no_split=True) as split_only:
        pass
    assert split_only.options == {"use_on_oom": False, "no_split": True}
    # the same options again: the same torch pool
    with gmp.mempool(sim, use_on_oom=True, no_split=True) as again, gmp.mempool(sim) as plain_again:
        pass
    assert again is tp and plain_again is plain
    assert gtorch.torch_pools(sim) == [tp, plain, split_only]
    assert allocated(sim) == 2 * 2 * MiB  # both tensors in the gmp pool
    del a, b


@pytest.mark.filterwarnings("ignore::gpumempool.torch.ProcessWideRoutingWarning")
@pytest.mark.parametrize("variant, option, since", [
    ("2.7", "use_on_oom", "2.8"), ("2.7", "no_split", "2.10"), ("2.9", "no_split", "2.10")])
def test_mempool_options_need_a_torch_that_has_them(monkeypatch, sim, variant, option, since):
    install(monkeypatch, variant)
    with pytest.raises(gtorch.TorchVersionError) as exc:
        with gmp.mempool(sim, **{option: True}):
            pass
    assert str(exc.value) == (f"gmp.mempool('torchpool', {option}=True) needs torch.cuda.MemPool's {option} option "
                              f"(torch >= {since}); torch {variant}.0+fake's MemPool has none")
    assert exc.value.version == f"{variant}.0+fake" and exc.value.needed == f"torch >= {since}"
    assert gtorch.torch_pools(sim) == []  # no torch pool left behind
    with gmp.mempool(sim) as tp:  # without the option: fine
        pass
    assert gtorch.torch_pools(sim) == [tp]


def test_mempool_passes_the_options_this_torch_has(monkeypatch, sim):
    install(monkeypatch, "2.9")
    assert gtorch.capabilities().mem_pool_options == ("use_on_oom",)
    with gmp.mempool(sim, use_on_oom=True) as tp:
        pass
    assert tp.options == {"use_on_oom": True}


def test_begin_failure_leaves_nothing_half_done(monkeypatch, sim):
    torch = install(monkeypatch)
    other = gmp.MemPool("sim", capacity=1 << 26)
    real = torch._C._cuda_beginAllocateCurrentThreadToPool
    with gmp.mempool(sim) as ta:
        def fail(d, pid):
            if pid != ta.id:
                raise RuntimeError("boom")
            real(d, pid)

        torch._C._cuda_beginAllocateCurrentThreadToPool = fail
        with pytest.raises(RuntimeError, match="boom"):
            with gmp.mempool(other):
                pass
        x = torch.empty(100)  # the outer pool was resumed
    torch._C._cuda_beginAllocateCurrentThreadToPool = real
    assert x.pid == ta.id
    with gmp.mempool(other):
        pass  # its lane was handed back
    other.close()


# ---------------------------------------------------------------------------
# release
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_release(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    with gmp.mempool(sim) as tp:
        x = torch.empty(3 * MiB)
        y = torch.empty(1000)
    del tp
    if variant == "2.5":
        # torch 2.5 never frees a MemPool's pool, and forcing it would use
        # cudaFree: refused, whatever is alive, touching nothing
        for _ in range(2):
            with pytest.raises(gtorch.TorchVersionError, match=r"torch 2\.5\.0\+fake cannot .*needs torch >= 2\.6"):
                gtorch.release(sim)
            assert allocated(sim) == 22 * MiB and len(gtorch.torch_pools(sim)) == 1
            del x, y
            x = y = None
        return
    allocs_before = sim.stats()["num_device_alloc"]
    with pytest.raises(gtorch.PoolInUseError, match=r"2 tensor block\(s\).*still alive") as err:
        gtorch.release(sim)
    assert isinstance(err.value, RuntimeError)
    assert allocated(sim) == 22 * MiB and len(gtorch.torch_pools(sim)) == 1  # untouched
    del x, y
    assert gtorch.release(sim) == 22 * MiB
    assert allocated(sim) == 0 and gtorch.torch_pools(sim) == []
    assert sim.stats()["reserved_bytes.all.current"] > 0  # the engine keeps the segments
    with gmp.mempool(sim) as tp2:  # a new torch pool, fed from the engine's cache
        z = torch.empty(3 * MiB)
    assert z.pid == tp2.id
    assert sim.stats()["num_device_alloc"] == allocs_before
    del z, tp2
    assert gmp.torch.pool_release(sim, to_backend=True) == 20 * MiB
    assert sim.stats()["reserved_bytes.all.current"] == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_snapshot_holds_torchs_view_of_each_torch_pool(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    other = gmp.MemPool("sim", name="untouched", capacity=1 << 26)
    assert "gpumempool_torch_pools" not in gmp.snapshot()  # nothing routed through gmp.mempool yet
    with gmp.mempool(sim) as tp:
        x = torch.empty(3 * MiB)
        y = torch.empty(1000)
    del y  # torch keeps the freed block cached in the torch pool
    snap = gmp.snapshot()
    views = snap["gpumempool_torch_pools"]
    assert [(v["pool"], v["pool_handle"], v["device"], v["torch_pool_id"], v["options"], v["broken"])
            for v in views] == [("torchpool", sim.handle, 0, tuple(tp.id), {}, False)]
    segs = views[0]["segments"]
    assert sorted((s["total_size"], s["allocated_size"], s["segment_pool_id"]) for s in segs) == [
        (2 * MiB, 0, tp.id), (20 * MiB, 20 * MiB, tp.id)]
    # torch's segments are blocks of the gmp pool's segments: beside them, not among them
    ours = [(s["address"], s["address"] + s["total_size"]) for s in snap["segments"]
            if s["gpumempool_pool"] == "torchpool"]
    assert all(any(a <= t["address"] and t["address"] + t["total_size"] <= b for a, b in ours) for t in segs)
    assert {k for k in snap if not k.startswith("gpumempool_")} == {"segments", "device_traces", "allocator_settings"}
    assert pickle.loads(pickle.dumps(snap))["gpumempool_torch_pools"] == views
    del x, tp
    if not gtorch.capabilities().pool_release:  # torch 2.5 keeps its pools: release refuses
        with pytest.raises(gtorch.TorchVersionError, match="release needs torch >= 2.6"):
            gtorch.release(sim)
        other.close()
        return
    gtorch.release(sim)
    assert "gpumempool_torch_pools" not in gmp.snapshot()  # no torch pool left
    other.close()


def test_snapshot_survives_a_torch_pool_torch_cannot_read(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    with gmp.mempool(sim, use_on_oom=True) as tp:
        pass

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("torch says no")

    monkeypatch.setattr(type(tp), "snapshot", broken)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    (view,) = gmp.snapshot()["gpumempool_torch_pools"]
    assert view["segments"] == [] and view["error"] == "RuntimeError: torch says no"
    assert view["options"] == {"use_on_oom": True}


def test_release_clears_cublas_workspaces_made_inside(monkeypatch, sim):
    torch = install(monkeypatch)
    workspaces: list[Any] = []  # what torch's cuBLAS handle pool keeps

    def clear() -> None:
        workspaces.clear()

    with gmp.mempool(sim):
        workspaces.append(torch.empty(4 * MiB))  # the first matmul's workspace, made inside
        x = torch.empty(1000)
    with pytest.raises(gtorch.PoolInUseError, match=r"2 tensor block"):
        gtorch.release(sim)  # this torch cannot clear them: both count
    torch._C._cuda_clearCublasWorkspaces = clear
    with pytest.raises(gtorch.PoolInUseError, match=r"1 tensor block"):
        gtorch.release(sim)  # the workspace went, the user's tensor still counts
    assert workspaces == []
    del x
    assert gtorch.release(sim) == 22 * MiB and allocated(sim) == 0


def test_python_callbacks_under_torch_warn_once(monkeypatch, sim):
    torch = install(monkeypatch)
    del torch
    pyfn = gmp.MemPool(alloc=lambda size, dev, stream: None, free=lambda ptr, size, dev, stream: None)
    try:
        with pytest.warns(gtorch.PythonCallbackWarning, match="deadlock") as rec:
            with gmp.mempool(pyfn):
                pass
        assert rec[0].filename == __file__  # points at the user's line
        with warnings.catch_warnings():
            warnings.simplefilter("error", gtorch.PythonCallbackWarning)
            with gmp.mempool(pyfn):  # once per pool
                pass
            with gmp.mempool(sim):  # native allocator: no warning
                pass
    finally:
        gtorch.release(pyfn)
        pyfn.close()


def test_python_callbacks_as_torchs_allocator_warn(monkeypatch):
    install(monkeypatch)
    pyfn = gmp.MemPool(alloc=lambda size, dev, stream: None, free=lambda ptr, size, dev, stream: None)
    try:
        with pytest.warns(gtorch.PythonCallbackWarning, match="set_torch_allocator"):
            gmp.set_torch_allocator(pyfn)
    finally:
        pyfn.close()


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


def test_release_while_inside_is_refused(monkeypatch, sim):
    install(monkeypatch)
    with inside_in_another_thread(sim):
        with pytest.raises(gtorch.PoolInUseError, match="still inside.*'holder'"):
            gtorch.release(sim)
    assert gtorch.release(sim) == 0


def test_release_while_another_pool_routes_the_device_is_refused(monkeypatch, sim):
    """torch's MemPool destructor (run by release) asserts that no pool
    route is under way on its device, and the assert aborts the process:
    release refuses while any gmp.mempool context is active there, in this
    thread or another, and works once it ended."""
    install(monkeypatch, "2.11")
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    with gmp.mempool(sim):
        pass  # sim now has a torch pool to release
    with gmp.mempool(other):
        with pytest.raises(gtorch.PoolInUseError, match="active on cuda:0.*abort"):
            gtorch.release(sim)
    assert gtorch.torch_pools(sim), "nothing was touched"

    with inside_in_another_thread(other):
        with pytest.raises(gtorch.PoolInUseError, match="in any thread"):
            gtorch.release(sim)
    gtorch.release(sim)
    assert gtorch.torch_pools(sim) == []
    other.close()


@pytest.mark.parametrize("phase", ["enter", "exit"])
def test_release_never_runs_a_destructor_under_another_threads_route(monkeypatch, sim, phase):
    """The window around torch's begin/end of another thread's route: a
    route is recorded before torch begins it and dropped after torch ends
    it, and release() keeps new routes out until its MemPool destructors
    have run. The fake's destructor notes when torch would have aborted."""
    torch = install(monkeypatch, "2.11")
    world = torch._world
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    with gmp.mempool(sim):
        pass  # sim has a torch pool to release
    aborts: list[Any] = []
    real_empty = world.empty_pool

    def empty_pool(pid: Any) -> None:  # torch's synchronize_and_free_events asserts here
        if world.captures.get(0):
            aborts.append(list(world.captures[0]))
        real_empty(pid)

    world.empty_pool = empty_pool
    in_window, go_on = threading.Event(), threading.Event()
    C = torch._C
    if phase == "enter":
        real = C._cuda_beginAllocateCurrentThreadToPool

        def begin(d: int, pid: Any) -> None:
            real(d, pid)  # torch's route is under way from here
            if threading.current_thread().name == "B":
                in_window.set()
                go_on.wait(10)
        C._cuda_beginAllocateCurrentThreadToPool = begin
    else:
        real = C._cuda_endAllocateToPool

        def end(d: int, pid: Any) -> None:
            if threading.current_thread().name == "B":
                in_window.set()  # torch's route is under way until here
                go_on.wait(10)
            real(d, pid)
        C._cuda_endAllocateToPool = end

    def worker() -> None:
        with gmp.mempool(other):
            pass

    th = threading.Thread(target=worker, name="B")
    th.start()
    assert in_window.wait(10)
    try:
        with pytest.raises(gtorch.PoolInUseError, match="active on cuda:0"):
            gtorch.release(sim)
    finally:
        go_on.set()
        th.join()
    assert aborts == []
    gtorch.release(sim)  # no route now
    assert aborts == [] and gtorch.torch_pools(sim) == []
    other.close()


def test_failed_deregister_tries_every_lane_and_keeps_the_failed_ones(monkeypatch, sim):
    """Two lanes (two threads were inside at once); deregistering the first
    fails: the second is still deregistered, the error is raised, and a
    retry deregisters what failed."""
    torch = install(monkeypatch, "2.11")
    backend = torch._backend
    with inside_in_another_thread(sim):
        with gmp.mempool(sim):
            pass
    tps = gtorch.torch_pools(sim, 0)
    assert len(tps) == 2
    gtorch.register(sim)
    ids = {tuple(tp.id) for tp in tps}
    assert ids <= backend.pools
    working, calls = backend.deregister_mem_pool, []

    def flaky(pool: Any) -> None:
        calls.append(tuple(pool.id))
        if len(calls) == 1:
            raise RuntimeError("NCCL error: transient")
        working(pool)

    backend.deregister_mem_pool = flaky
    with pytest.raises(RuntimeError, match="transient"):
        gtorch.deregister(sim)
    assert len(calls) == 2, "both lanes were tried"
    assert backend.pools & ids == {calls[0]}, "only the failed one is still registered"
    gtorch.deregister(sim)  # the retry
    assert calls[2:] == [calls[0]] and not backend.pools & ids
    gtorch.deregister(sim)  # nothing left
    assert len(calls) == 3


def test_release_of_one_device_and_of_nothing(monkeypatch, sim):
    torch = install(monkeypatch)
    assert gtorch.release(sim) == 0
    with gmp.mempool(sim, device=1):
        torch.empty(100, device=1)
    with gmp.mempool(sim, device=0):
        torch.empty(100)
    gc.collect()
    assert gtorch.release(sim, device=1) == 2 * MiB
    assert [tp.device for tp in gtorch.torch_pools(sim)] == [0]


def test_release_reports_a_torch_pool_kept_alive(monkeypatch, sim):
    torch = install(monkeypatch)
    with gmp.mempool(sim) as kept:
        torch.empty(100)
    gc.collect()
    with pytest.raises(gtorch.TorchIntegrationError, match="still referenced"):
        gtorch.release(sim)
    del kept
    torch.cuda.empty_cache()
    assert allocated(sim) == 0


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
import test_torch_logic
getattr(test_torch_logic, sys.argv[2])(sys.argv[3])
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


# ---------------------------------------------------------------------------
# cache scopes
# ---------------------------------------------------------------------------

BODY = [1000, 5000, 5000, 70_000, 3 * MiB]


def run_body(scope: gscope.CacheScope) -> list[int]:
    ptrs = [scope.alloc(n) for n in BODY]
    tmp = scope.alloc(2000)
    scope.free(tmp)
    again = scope.alloc(2000)  # reuses the block freed in this very iteration
    assert again == tmp
    for p in reversed(ptrs):
        scope.free(p)
    scope.free(again)
    return ptrs + [again]


def test_scope_reuses_the_previous_iteration_exactly(pool):
    seen = []
    for _ in range(3):
        with gmp.cache_scope(pool, "body") as scope:
            seen.append(run_body(scope))
    assert seen[0] == seen[1] == seen[2]
    assert scope.misses == len(BODY) + 1 and scope.entries == 3
    assert scope.stats()["live_bytes"] == 0 and scope.cached_bytes > 0
    gmp.invalidate("body")


def test_scope_peak_stays_flat(pool):
    peaks = []
    for _ in range(100):
        with gmp.cache_scope(pool, "loop") as scope:
            run_body(scope)
        peaks.append(pool.stats()["allocated_bytes.all.peak"])
    assert len(set(peaks)) == 1
    assert peaks[0] <= sum((n + 511) // 512 * 512 for n in BODY) + 2048
    freed = gmp.invalidate("loop")
    assert freed == sum((n + 511) // 512 * 512 for n in BODY) + 2048
    s = pool.stats()
    assert s["allocated_bytes.all.current"] == 0 and s["active.all.current"] == 0
    assert gmp.invalidate("loop") == 0
    with gmp.cache_scope(pool, "loop") as fresh:
        assert fresh is not scope and fresh.entries == 1


def test_scope_module_functions_and_blocks_outliving_it(pool):
    assert gscope.active_scope(pool) is None
    raw = gscope.alloc(pool, 4096)  # no scope: straight from the pool
    with gmp.cache_scope(pool, "s") as scope:
        assert gscope.active_scope(pool) is scope
        a = gscope.alloc(pool, 4096)
        kept = gscope.alloc(pool, 8192)
        gscope.free(pool, a)
    gscope.free(pool, raw)
    assert scope.cached_bytes == 4096 and scope.live_bytes == 8192
    gscope.free(pool, kept)  # freed after the scope exited: cached for its next entry
    assert scope.cached_bytes == 4096 + 8192
    with gmp.cache_scope(pool, "s"):
        assert gscope.alloc(pool, 8192) == kept
        late = gscope.alloc(pool, 512)
    assert gmp.invalidate("s", pool) == 4096
    gscope.free(pool, kept)  # after invalidation: to the pool
    gscope.free(pool, late)
    assert allocated(pool) == 0
    with pytest.raises(gscope.ScopeError, match="invalidated"):
        scope.alloc(100)


def test_scope_errors(pool):
    with gmp.cache_scope(pool, "e") as scope:
        with pytest.raises(gscope.ScopeError, match="entered"):
            gmp.invalidate("e")
        with pytest.raises(gmp.InvalidPointerError):
            scope.free(0x1234)
        with pytest.raises(gmp.InvalidArgumentError):
            scope.alloc(0)
        with pytest.raises(TypeError):
            scope.alloc(1.5)
    with pytest.raises(TypeError):
        with gmp.cache_scope(pool, ""):
            pass
    with pytest.raises(TypeError):
        with gmp.cache_scope("pool", "x"):
            pass
    assert isinstance(gscope.ScopeError("x"), RuntimeError)


def test_scope_keep_false_invalidates_on_exit(pool):
    with gmp.cache_scope(pool, "once", keep=False) as scope:
        for _ in range(10):
            p = scope.alloc(100_000)
            scope.free(p)
    assert scope.invalidated and scope.hits == 9 and allocated(pool) == 0


def test_scope_is_per_thread_and_per_stream(pool):
    got = {}
    with gmp.cache_scope(pool, "t") as scope:
        a = scope.alloc(1000, stream=1)
        scope.free(a)
        assert scope.alloc(1000, stream=2) != a  # another stream: not the cached block
        th = threading.Thread(target=lambda: got.update(s=gscope.active_scope(pool)))
        th.start()
        th.join()
    assert got["s"] is None


def test_scope_with_torch(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    with gmp.mempool(sim) as plain:
        pass
    for _ in range(5):
        with gmp.cache_scope(sim, "step", torch=True, device="cuda:0") as scope:
            x = torch.empty(3 * MiB)
            y = torch.empty(3 * MiB)
            del x, y
        assert allocated(sim) == 40 * MiB  # one iteration's worth (the fake gives each tensor a segment)
    pools = gtorch.torch_pools(sim)
    assert len(pools) == 2 and pools[0] is plain
    del pools  # (a reference to a torch pool keeps it, and its segments, alive)
    assert allocated(sim) == 40 * MiB  # kept in the scope's torch pool for the next iteration
    with gmp.cache_scope(sim, "step", torch=True):
        alive = torch.empty(1000)
    with pytest.raises(gtorch.PoolInUseError):
        gmp.invalidate("step")
    assert not scope.invalidated
    del alive
    gmp.invalidate("step")
    assert gtorch.torch_pools(sim) == [plain] and allocated(sim) == 0


# ---------------------------------------------------------------------------
# CuPy
# ---------------------------------------------------------------------------


def make_cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    state: dict[str, Any] = {"allocator": "cupy-default", "device": 0, "stream": 0}
    tls = threading.local()

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem: Any, offset: int) -> None:
            self.mem, self.ptr = mem, mem.ptr + offset

    @contextlib.contextmanager
    def using_allocator(fn: Any = None) -> Any:
        prev = getattr(tls, "allocator", None)
        tls.allocator = fn
        try:
            yield
        finally:
            tls.allocator = prev

    def alloc(size: int) -> Any:
        fn = getattr(tls, "allocator", None) or state["allocator"]
        return fn(size)

    cp.cuda = types.SimpleNamespace(
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        set_allocator=lambda fn=None: state.update(allocator=fn),
        get_allocator=lambda: state["allocator"],
        using_allocator=using_allocator,
        alloc=alloc,
        get_current_stream=lambda device_id=None: types.SimpleNamespace(
            ptr=state.get("streams", {}).get(state["device"] if device_id is None else device_id, state["stream"])),
        runtime=types.SimpleNamespace(getDevice=lambda: state["device"]),
    )
    cp._state = state  # type: ignore[attr-defined]
    return cp


def test_cupy_without_cupy(monkeypatch, pool):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(gmp.cupy.CupyIntegrationError, match="needs CuPy"):
        gmp.cupy.set_allocator(pool)


def test_cupy_using_is_thread_local_and_frees_on_gc(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    cp._state.update(device=1, stream=0x99)
    with gmp.cupy.using(sim) as fn:
        assert fn.pool is sim
        mp = cp.cuda.alloc(1000)
        zero = cp.cuda.alloc(0)
    assert cp.cuda.get_allocator() == "cupy-default"
    assert mp.mem.device_id == 1 and mp.ptr and zero.ptr == 0
    assert allocated(sim, 1) == 1024
    del mp
    gc.collect()
    assert allocated(sim) == 0


def test_cupy_set_and_reset_allocator(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    assert gmp.cupy.set_allocator(sim, device=0) == "cupy-default"
    keep = cp.cuda.alloc(5000)
    gmp.cupy.reset_allocator()
    assert cp.cuda.get_allocator() == "cupy-default"
    with pytest.raises(gmp.cupy.CupyIntegrationError, match="nothing to restore"):
        gmp.cupy.reset_allocator()
    with gmp.cupy.using(sim, process_wide=True):
        assert cp.cuda.get_allocator() is not None and cp.cuda.get_allocator() != "cupy-default"
        other = cp.cuda.alloc(100)
    assert cp.cuda.get_allocator() == "cupy-default"
    assert allocated(sim) == 5120 + 512
    del keep, other
    gc.collect()
    assert allocated(sim) == 0


def test_cupy_on_a_fixed_device_uses_that_devices_stream(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    cp._state.update(device=0, streams={0: 0x99, 1: 0x77})
    with gmp.MemPool("sim", devices=2, capacity=1 << 30) as pool:
        with gmp.cupy.using(pool, device=1):
            a = cp.cuda.alloc(1000)  # the current device is 0
        with gmp.cupy.using(pool):
            b = cp.cuda.alloc(1000)
        assert {(s["device"], s["stream"]) for s in pool.segments()} == {(1, 0x77), (0, 0x99)}
        del a, b
        gc.collect()


def test_cupy_inside_a_cache_scope(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    ptrs = []
    with gmp.cupy.using(sim):
        for _ in range(5):
            with gmp.cache_scope(sim, "cupy-body"):
                a = cp.cuda.alloc(100_000)
                ptrs.append(a.ptr)
                del a
                gc.collect()
    assert len(set(ptrs)) == 1 and allocated(sim) == 100_352
    gmp.invalidate("cupy-body")
    assert allocated(sim) == 0


def test_cupy_failed_wrap_frees_the_block_once(monkeypatch, sim):
    # UnownedMemory raising: the block is freed there, and the owner that
    # the traceback keeps alive must not free it again later (by then the
    # address may be another allocation's)
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)

    def refuse(ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
        raise RuntimeError("no")

    cp.cuda.UnownedMemory = refuse
    with gmp.cupy.using(sim):
        try:
            cp.cuda.alloc(1000)
        except RuntimeError as exc:
            kept = exc  # keeps the frame, and the owner, alive
    assert allocated(sim) == 0
    again = sim.alloc(1000)  # the same address comes back
    del kept
    gc.collect()
    assert allocated(sim) == 1024, "the owner freed someone else's block"
    sim.free(again)


def test_cupy_free_after_close_is_swallowed(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    p = gmp.MemPool("sim", capacity=1 << 26)
    with gmp.cupy.using(p):
        mp = cp.cuda.alloc(100)
    p.close()
    before = gmp.cupy._dropped[0]
    del mp
    gc.collect()
    assert gmp.cupy._dropped[0] == before + 1


def test_cupy_process_wide_blocks_ending_out_of_order(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    a = gmp.MemPool("sim", name="A", capacity=1 << 26)
    b = gmp.MemPool("sim", name="B", capacity=1 << 26)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def ta() -> None:
        with gmp.cupy.using(a, process_wide=True):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def tb() -> None:
        a_in.wait(10)
        with gmp.cupy.using(b, process_wide=True):
            b_in.set()
            assert a_out.wait(10)
            assert cp.cuda.get_allocator().pool is b  # a's block ended: b's stays in force

    threads = [threading.Thread(target=ta), threading.Thread(target=tb)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert cp.cuda.get_allocator() == "cupy-default"  # not a's, stale
    a.close()
    b.close()


def test_cupy_set_reset_and_using_mixed(monkeypatch, sim):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    try:
        cm = gmp.cupy.using(other, process_wide=True)
        gmp.cupy.set_allocator(sim)
        cm.__enter__()
        gmp.cupy.reset_allocator()  # set_allocator's block is not the newest: other's stays
        assert cp.cuda.get_allocator().pool is other
        cm.__exit__(None, None, None)
        assert cp.cuda.get_allocator() == "cupy-default"  # what was there before set_allocator
        # code that replaced the allocator meanwhile keeps its own
        gmp.cupy.set_allocator(sim)
        cp.cuda.set_allocator("theirs")
        gmp.cupy.reset_allocator()
        assert cp.cuda.get_allocator() == "theirs"
    finally:
        other.close()


def test_closing_a_pool_resets_the_cupy_allocator_over_it(monkeypatch):
    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    a = gmp.MemPool("sim", name="A", capacity=1 << 26)
    b = gmp.MemPool("sim", name="B", capacity=1 << 26)
    gmp.cupy.set_allocator(b)
    with gmp.cupy.using(a, process_wide=True):
        gmp.cupy.set_allocator(a)
        a.close()
        assert cp.cuda.get_allocator().pool is b  # no allocator over the closed pool
        gmp.cupy.reset_allocator()  # closing undid it already: nothing to do
    assert cp.cuda.get_allocator().pool is b
    b.close()
    assert cp.cuda.get_allocator() == "cupy-default"
    gmp.cupy.reset_allocator()  # the set_allocator(b), undone by closing b
    assert cp.cuda.get_allocator() == "cupy-default"
    with pytest.raises(gmp.cupy.CupyIntegrationError, match="nothing to restore"):
        gmp.cupy.reset_allocator()
    with pytest.raises(gmp.PoolClosedError):
        gmp.cupy.set_allocator(a)


def test_cupy_set_allocator_racing_a_close_is_refused(monkeypatch):
    """A set_allocator that lands after close has reset CuPy's allocator
    (gpumempool.cupy's close hook) but before the engine marks the pool
    closed must not leave CuPy allocating from the closed pool."""
    from gpumempool import scope as gscope

    cp = make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    pool = gmp.MemPool("sim", name="racing", capacity=1 << 26)
    seen: list[object] = []

    def late_set_allocator(closing: gmp.MemPool) -> None:  # runs after gpumempool.cupy's hook
        if closing is pool:
            try:
                gmp.cupy.set_allocator(pool)
                seen.append("installed")
            except gmp.PoolClosedError as exc:
                seen.append(exc)

    unsubscribe = gmp._lifecycle.on_close(late_set_allocator)
    try:
        pool.close()
    finally:
        unsubscribe()
    assert len(seen) == 1 and isinstance(seen[0], gmp.PoolClosedError), seen
    assert cp.cuda.get_allocator() == "cupy-default"


GC_IN_LOCKED_REGION = r"""
import gc, sys
sys.path.insert(0, sys.argv[1])
from test_torch_logic import make_cupy
cp = make_cupy(); sys.modules["cupy"] = cp
import gpumempool as gmp
from gpumempool import scope as gscope

def garbage(n):
    a = cp.cuda.alloc(n)
    cycle = [a]
    cycle.append(cycle)  # only the cyclic GC frees it, on whatever allocation triggers it

pool = gmp.MemPool("sim", capacity=1 << 26)
gc.disable()
with gmp.cupy.using(pool):
    with gmp.cache_scope(pool, "s") as scope:
        garbage(1000)
        with scope._lock:  # the GC runs the array's finalizer here, on this thread
            gc.collect()
            assert scope.cached_bytes == 0  # deferred...
        assert scope.cached_bytes == 1024  # ...to the end of the region
    garbage(4096)
    with gscope._lock:
        gc.collect()
assert pool.stats()["allocated_bytes.all.current"] == 1024  # the scope's cached block only
gmp.invalidate("s")
assert pool.stats()["allocated_bytes.all.current"] == 0 and gmp.cupy._dropped[0] == 0
print("ok")
"""


def test_cupy_finalizer_inside_a_locked_region_of_scope(tmp_path):
    import os
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", GC_IN_LOCKED_REGION, os.path.dirname(os.path.abspath(__file__))],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_close_invalidates_the_pools_cache_scopes() -> None:
    import gpumempool as gmp
    from gpumempool import scope

    pool = gmp.MemPool("sim", name="scoped")
    for _ in range(2):
        with gmp.cache_scope(pool, "loop"):
            scope.free(pool, scope.alloc(pool, 4096))
    # The scope keeps the freed block for its next iteration...
    assert pool.stats()["allocated_bytes.all.current"] == 4096
    rep = pool.close()
    # ...and close hands it back before returning the segments: no leak.
    assert rep.live_blocks == []
    assert gmp.invalidate("loop", pool) == 0


# ---------------------------------------------------------------------------
# close, NCCL registrations and lanes (review fixes)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["2.7", "2.11"])
def test_close_with_live_tensors_deregisters_every_group(monkeypatch, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    pool = gmp.MemPool("sim", name="regs", capacity=1 << 30)
    other = FakeBackend(torch._world, "mem_pool")
    gtorch.register(pool)  # the default group
    gtorch.register(pool, FakeGroup(other))  # a second group (tensor parallel, say)
    with gmp.mempool(pool):
        x = torch.empty(3 * MiB)  # alive at close: release() refuses
    with pytest.warns(gmp.LeakWarning, match="cannot release"):
        pool.close()
    assert torch._backend.pools == set() and torch._backend.segments == set()
    assert other.pools == set() and other.segments == set()  # not only the default group's
    assert id(pool) not in gtorch._lanes.pool_states
    del x


def test_entering_or_registering_while_close_runs_is_refused(monkeypatch):
    torch = install(monkeypatch, "2.11")
    pool = gmp.MemPool("sim", name="closing", capacity=1 << 30)
    with gmp.mempool(pool):
        pass
    seen: list[BaseException] = []
    real = gtorch.forget_pool

    def forget_then_another_thread_comes(p: gmp.MemPool) -> Optional[str]:
        problem = real(p)
        assert not p.closed  # the window: forgotten, not closed yet in the engine
        for attempt in (lambda: gmp.mempool(p).__enter__(), lambda: gtorch.register(p)):
            try:
                attempt()
            except BaseException as exc:  # noqa: BLE001
                seen.append(exc)
        return problem

    monkeypatch.setattr(gtorch, "forget_pool", forget_then_another_thread_comes)
    pool.close()
    assert [type(e) for e in seen] == [gmp.PoolClosedError, gmp.PoolClosedError]
    assert id(pool) not in gtorch._lanes.pool_states and torch._world.captures.get(0) == []


def test_a_failed_registration_of_a_new_torch_pool_undoes_the_others(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    a = torch._backend
    b = FakeBackend(torch._world, "mem_pool")
    gtorch.register(sim)
    gtorch.register(sim, FakeGroup(b))
    gc.collect()
    gtorch.release(sim)  # the torch pools go, the registrations stay
    assert a.pools == set() == b.pools
    b.comm_error = True
    for _ in range(3):
        with pytest.raises(gtorch.TorchIntegrationError):
            with gmp.mempool(sim):
                pass
    st = gtorch._lanes.pool_states[id(sim)]
    assert st.lanes == [] and a.pools == set()  # the torch pools dropped are not left registered with a
    assert all(r.lanes == {} for r in st.registrations)
    b.comm_error = False
    with gmp.mempool(sim) as tp:
        x = torch.empty(1000)
    assert a.pools == {tp.id} == b.pools and a.registered(tp.id) == {x.ptr} == b.registered(tp.id)


def test_a_torch_pool_whose_route_did_not_end_is_not_reused(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    real = torch._C._cuda_endAllocateToPool
    calls = {"n": 0}

    def end_fails_once(d: int, pid: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("endAllocatePool: boom")
        real(d, pid)

    torch._C._cuda_endAllocateToPool = end_fails_once
    with pytest.raises(gtorch.TorchIntegrationError, match="ending the routing"):
        with gmp.mempool(sim) as bad:
            pass
    with gmp.mempool(sim) as good:  # torch still records to `bad`: a new torch pool
        x = torch.empty(1000)
    assert good is not bad and x.pid == good.id
    assert len(gtorch.torch_pools(sim)) == 2
    del x, good, bad
    gc.collect()
    gtorch.release(sim)  # the unusable one's segments go back too
    assert gtorch.torch_pools(sim) == []


def test_set_torch_allocator_again_on_the_closed_installed_pool(monkeypatch):
    install(monkeypatch)
    p = gmp.MemPool("sim", capacity=1 << 26)
    gmp.set_torch_allocator(p)
    p.close()
    with pytest.raises(gmp.PoolClosedError):
        gmp.set_torch_allocator(p)


def test_release_to_backend_of_a_pool_closed_meanwhile(monkeypatch):
    torch = install(monkeypatch)
    p = gmp.MemPool("sim", capacity=1 << 30)
    with gmp.mempool(p):
        torch.empty(1000)
    real_gc = gtorch._release.gc

    def collect_and_close() -> int:  # another thread closes the pool at this point
        n = real_gc.collect()
        p.close()
        return n

    monkeypatch.setattr(gtorch._release, "gc", types.SimpleNamespace(collect=collect_and_close))
    assert gtorch.release(p, to_backend=True) == 2 * MiB
    assert p.closed


def test_torch_memory_stats_take_torchs_device_argument(monkeypatch):
    torch = install(monkeypatch)
    p = gmp.MemPool("sim", name="devs", devices=2, capacity=1 << 30)
    gmp.set_torch_allocator(p)
    key = "allocated_bytes.all.current"
    with torch.cuda.device(1):
        x = torch.empty(MiB)  # this rank works on cuda:1
        for dev in (None, "cuda", torch.device("cuda"), 1, "cuda:1", torch.device("cuda", 1)):
            assert gmp.torch_memory_stats(dev)[key] == MiB, dev  # torch: the current device
        assert gmp.torch_memory_stats(0)[key] == 0
        y = torch.empty(MiB, device=0)
        assert gmp.torch_memory_stats()[key] == MiB and gmp.torch_memory_stats("all")[key] == 2 * MiB
        assert "device 1" in gmp.torch_memory_summary() and "all devices" in gmp.torch_memory_summary("all")
    with pytest.raises(gmp.InvalidArgumentError):
        gmp.torch_memory_stats("cpu")
    del x, y


def test_exit_report_leaves_out_what_torch_caches(monkeypatch):
    torch = install(monkeypatch)
    p = gmp.MemPool("sim", name="exit-report", capacity=1 << 30)
    plain = gmp.MemPool("sim", name="exit-plain", capacity=1 << 30)
    try:
        with gmp.mempool(p):
            x = torch.empty(1000)
            y = torch.empty(3 * MiB)
        del x
        s = p.stats()
        assert s["allocation.all.current"] == 2  # two torch segments, one of them free in torch's cache
        assert gtorch.exit_leaks(p, 2, s["allocated_bytes.all.current"]) == (
            1, 20 * MiB, "; 1 of them, 20971520 bytes, are segments of torch pools over it (gmp.mempool) "
            "holding tensors still alive")
        assert gtorch.exit_leaks(plain, 3, 100) == (3, 100, "")  # torch never used it
        del y
        assert gtorch.exit_leaks(p, 2, 22 * MiB) == (0, 0, "")
        # what the interpreter's exit does (gpumempool._lifecycle.report_leaks_at_exit)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            gmp._lifecycle.report_leaks_at_exit()
        assert not [w for w in rec if "exit-report" in str(w.message)]
    finally:
        gc.collect()
        gtorch.release(p)
        p.close()
        plain.close()


def test_process_wide_routing_warning_names_the_cross_pool_free(monkeypatch, sim):
    torch = install(monkeypatch, "2.5")
    other = gmp.MemPool("sim", name="theirs", capacity=1 << 30)
    entered, done = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def worker() -> None:  # another thread, inside a gmp.mempool of its own
        with gmp.mempool(other):
            entered.set()
            done.wait(10)
            got["t"] = torch.empty(1000)

    try:
        with pytest.warns(gtorch.ProcessWideRoutingWarning, match=r"freed through this pool's free function, a cross-pool"):
            with gmp.mempool(sim) as mine:
                th = threading.Thread(target=worker)
                th.start()
                entered.wait(10)
                done.set()
                th.join(10)
        # what the warning says: the segment lands in sim's torch pool, made by another pool's allocator
        assert got["t"].pid == mine.id and torch._world.misroutes
    finally:
        done.set()
        got.clear()
        gc.collect()
        other.close()


def _slot(p: gmp.MemPool) -> int:
    return int(p.pluggable_symbols(segments=True)[1].rsplit("_", 1)[1])


def test_slot_of_a_pool_closed_inside_mempool_serves_no_other_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing a pool whose torch pool could not be released (a thread is
    still inside gmp.mempool(pool)) retires its C slot: torch may still call
    those functions, which must never reach another pool."""
    torch = install(monkeypatch, "2.11")
    a = gmp.MemPool("sim", name="A", capacity=1 << 30)
    others: list[gmp.MemPool] = []
    try:
        with gmp.mempool(a):
            s = _slot(a)
            with pytest.warns(gmp.LeakWarning, match="closing pool anyway"):
                a.close()
            for _ in range(64):  # until every free slot is taken
                p = gmp.MemPool("sim", name="B", capacity=1 << 30)
                others.append(p)
                try:
                    got = _slot(p)
                except gmp.GpuMemPoolError as exc:
                    assert "C entry points are in use" in str(exc)
                    break
                assert got != s, "the slot of a pool torch may still call went to another pool"
            with pytest.raises(Exception):  # noqa: B017 - the fake raises what torch would
                torch.empty(MiB)  # A's functions refuse: no pool holds the slot
            assert all(p.stats()["allocated_bytes.all.current"] == 0 for p in others)
    finally:
        for p in others:
            p.close()


def test_errors_of_calls_after_close_reach_hook_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """In full replacement torch frees tensors that outlived the pool through
    its C functions; what they record reaches gmp.torch.hook_errors()."""
    from gpumempool import torch as gtorch

    torch = install(monkeypatch, "2.11")
    p = gmp.MemPool("sim", name="full", capacity=1 << 30)
    gmp.set_torch_allocator(p)
    t = torch.empty(MiB)
    with pytest.warns(gmp.LeakWarning):
        p.close()
    del t  # torch frees through gmp_free_<slot>: no pool holds the slot
    errs = gtorch.hook_errors()
    assert any("no pool holds this slot" in e for e in errs), errs
    assert gtorch.hook_errors() == [], "returned and cleared"
