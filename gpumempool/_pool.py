"""MemPool: a caching allocator pool over one backend."""

from __future__ import annotations

import atexit
import json
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, TypeVar, Union

from . import _callbacks, _close, _lifecycle, _native
from . import _sim, _snapshot, _summary
from ._args import I64, MAX_DEVICE, U64, as_stream, check_bool, check_int, check_settings, device_index
from ._backends import BACKENDS
from ._backends import backend_options as _backend_options
from ._backends import option_names as _option_names
from ._callbacks import AllocatorFunction, CallbackErrors, callback_failure, describe_exc, function_address
from ._errors import InvalidArgumentError, OutOfMemoryError, PoolClosedError, translate
from ._close import CloseReport, LiveBlock
from ._lifecycle import open_pools
from ._policy import ARGUMENTS, SETTINGS

if TYPE_CHECKING:
    from .ipc import IpcHandle

__all__ = ["CloseReport", "LiveBlock", "MemPool", "as_stream", "open_pools"]

# At exit, after every atexit handler registered after this import, the
# leak report, then the engine stops calling Python allocator functions
# (atexit runs the last registered first; see _lifecycle).
atexit.register(_lifecycle.python_exiting)
atexit.register(_lifecycle.report_leaks_at_exit)


def _new_locks_after_fork() -> None:
    """In a forked child: the locks another thread may have held at fork,
    made anew, so that a call refuses (ForkedProcessError) instead of
    waiting for a thread that does not exist here."""
    for pool in _lifecycle.pools():
        pool._lock = threading.Lock()
        if pool._stacks is not None:
            pool._stacks.renew_lock_after_fork()
        pool._callback_errors.renew_lock_after_fork()


_native.after_fork_in_child(_new_locks_after_fork)

_b = _native.bindings
_fast = _native.fastcall  # None in a build without gpumempool._fastcall
T = TypeVar("T")



def _callback_error_message(kind: str, exc: BaseException, err: BaseException) -> str:
    """The error of a pool call during which a Python function failed: the
    function's failure first. The engine only saw NULL from a failed alloc
    function, so its own account (NULL, out of memory after a retry) is
    not repeated; it is kept as context for other errors."""
    what = callback_failure(kind, exc)
    if isinstance(err, OutOfMemoryError):
        if err.pool is None or err.requested is None or err.device is None:  # not the engine's: nothing to add
            return what
        return what + f" ({_native.bindings.FailedRequest(err.pool, err.requested, err.device)})"
    return f"{what} (the pool call failed: {err})"


class MemPool:
    """A pool of device memory that caches blocks the way torch's allocator
    does, with segments from the backend you choose.

    ``backend="sim"`` (the default) is a simulated device: without options
    it is one process-wide device of 80 GiB shared by every such pool; any of
    the :data:`SIM_OPTIONS` give the pool a private one. Pass ``alloc`` and
    ``free`` (C function addresses, ctypes functions or Python callables with
    torch's pluggable-allocator signatures) for the ``callback`` backend.
    ``cuda`` (cuMemAlloc), ``host`` (pinned cuMemHostAlloc) and ``nccl``
    (ncclMemAlloc) load libcuda / libnccl at run time; their options are in
    :data:`GPU_OPTIONS`.

    Allocator functions must not call into their own pool (``stats()``,
    ``free()``, ``empty_cache()``, ...): the engine holds the pool's lock
    while it calls them. From a Python function such a call raises
    :class:`CallbackReentryError` (instead of waiting forever); from a C
    function, the pool's C entry points return NULL (or -1) and record why
    (:meth:`last_error`).

    Common options: ``name``; ``device`` (default device of :meth:`alloc`);
    and the pool's settings, as the engine declares them
    (``docs/pool-settings.md``; a setting the signature does not name yet
    may be given among ``options``):

    {settings}

    Thread-safe. Use it as a context manager to close it on exit.
    """

    _fast: Any = None  # gpumempool._fastcall for this pool, or None (see __init__)

    def __init__(
        self,
        backend: str = "sim",
        *,
        alloc: Optional[AllocatorFunction] = None,
        free: Optional[AllocatorFunction] = None,
        name: Optional[str] = None,
        device: Any = 0,
        limit: Optional[int] = None,
        max_split_size: Optional[int] = None,
        release_threshold: Optional[int] = None,
        max_non_split_rounding_size: Optional[int] = None,
        roundup_power2_divisions: Union[int, Sequence[int], Mapping[str, int], None] = None,
        garbage_collection_threshold: Optional[float] = None,
        torch_version: Optional[str] = None,
        **options: Any,
    ) -> None:
        # The settings are the keyword arguments the engine's schema names
        # (ARGUMENTS); one without a parameter of its own comes in options.
        args = locals()
        given = {key: args[key] if key in args else options.pop(key, None) for key in ARGUMENTS}
        self._id = 0
        self._callback_errors = CallbackErrors()
        self._device = device_index(device)
        self._lock = threading.Lock()
        self._report: Optional[CloseReport] = None
        self._keep: list[Any] = []
        self._py_callbacks = False  # errors of Python callbacks need checking
        # With record_history(stacks=True): the stacks of blocks and calls.
        self._stacks: Optional[_snapshot.PoolStacks] = None
        self._cached_name: Optional[str] = None
        self._options: dict[str, Any] = {}  # the backend's options, as validated (for config())
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if alloc is not None or free is not None:
            if backend not in ("sim", "callback"):
                raise InvalidArgumentError(f"alloc/free callbacks cannot be combined with backend={backend!r}")
            if alloc is None or free is None:
                raise InvalidArgumentError("pass both alloc and free (an allocator needs its deleter)")
            backend = "callback"
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"unknown backend {backend!r}; valid backends: {', '.join(sorted(BACKENDS))}")
        unknown = sorted(set(options) - set(_option_names(backend)))
        if unknown:
            raise InvalidArgumentError(
                f"unknown option(s) {', '.join(unknown)} for backend {backend!r}; "
                f"valid: name, {', '.join(ARGUMENTS)}, {', '.join(_option_names(backend))}"
            )
        cfg: dict[str, Any] = {"backend": backend}
        if name is not None:
            if not isinstance(name, str):
                raise TypeError(f"name must be a str, got {type(name).__name__}")
            cfg["name"] = name
        cfg.update(check_settings(given))
        if options:
            cfg["options"] = _backend_options(backend, options)
            self._options = dict(cfg["options"])
        if backend == "callback":
            assert alloc is not None and free is not None
            cfg["alloc_fn"], keep_a, py_a = function_address(alloc, "alloc", self._callback_errors)
            cfg["free_fn"], keep_f, py_f = function_address(free, "free", self._callback_errors)
            self._keep += [k for k in (keep_a, keep_f) if k is not None]
            self._py_callbacks = py_a or py_f
            if self._py_callbacks:
                cfg["python_callbacks"] = True  # not called once the interpreter exits (PythonExiting)
        self._id = self._native(_b.NewPool, json.dumps(cfg))
        if self._keep:
            _callbacks.keep_refs(self._id, tuple(self._keep))
        if self._py_callbacks:  # named in CallbackReentryError, which cannot ask the pool
            try:
                self._cached_name = str(self.config()["name"])
            except Exception:  # noqa: BLE001 - the handle will do
                pass
        self.backend: str = backend
        # The C fast path keeps the GIL across the call into Go. A callback
        # pool's functions could need the GIL themselves (Python functions,
        # or C ones that call into Python) while another thread that holds
        # it waits for this pool: those pools go through gopy, which
        # releases the GIL.
        self._fast = _fast if backend != "callback" else None
        _lifecycle.opened(self, self._id)
        settings = _snapshot.history_settings()
        if settings is not None:
            try:
                self.record_history(True, max_entries=settings[0], stacks=settings[1])
            except BaseException:
                self.close()  # no half-made pool left open in the engine
                raise

    # -- plumbing -------------------------------------------------------

    def _native(self, fn: Callable[..., T], *args: Any) -> T:
        if not self._py_callbacks:
            try:
                return fn(*args)
            except RuntimeError as exc:
                raise translate(exc) from None
        result, errs = self._native_collect(fn, *args)
        if errs:
            _callbacks.raise_failure(errs)
        return result

    def _native_collect(self, fn: Callable[..., T], *args: Any) -> tuple[T, list[tuple[str, BaseException]]]:
        """``fn(*args)`` by the rules of _callbacks.call_collecting: every call of a Python-callback pool."""
        return _callbacks.call_collecting(self._callback_errors, self._reentry_label, _callback_error_message,
                                          fn, *args)

    def _reentry_label(self) -> str:
        return str(getattr(self, "_cached_name", None) or f"#{self._id}")  # not self.name: that calls the pool

    def _handle(self) -> int:
        if self._report is not None or not self._id:
            raise PoolClosedError(f"pool {self._name_or_id()} is closed")
        return self._id

    def _name_or_id(self) -> str:
        name = getattr(self, "_cached_name", None)
        if name is None and self._report is None and self._id:
            try:
                name = self.name
            except Exception:  # noqa: BLE001 - closed meanwhile: the handle will do
                name = None
        return repr(name or f"#{self._id}")

    # -- allocation -----------------------------------------------------

    def alloc(self, size: int, device: Any = None, stream: Any = 0) -> int:
        """Allocate ``size`` bytes on ``device`` (the pool's default device
        when None) for work on ``stream``; return the address. Raises
        :class:`OutOfMemoryError` when the pool cannot serve it even after
        releasing its cache."""
        # Fast path first: this is called once per tensor by integrations.
        if type(size) is not int or not 0 < size < I64:
            size = check_int("size", size, 1, I64)
        if device is None:
            device = self._device
        elif type(device) is not int or not 0 <= device < MAX_DEVICE:
            device = device_index(device)
        if type(stream) is not int or not 0 <= stream < U64:
            stream = as_stream(stream)
        handle = self._id if self._report is None else self._handle()
        stacks = self._stacks
        t0 = _snapshot.now_us() if stacks is not None else 0
        try:
            if self._fast is not None:
                try:
                    ptr = self._fast.alloc(handle, size, device, stream)
                except RuntimeError as exc:
                    raise translate(exc) from None
            elif self._py_callbacks:
                ptr = self._alloc_with_callbacks(_b.PoolAlloc, handle, size, device, stream)
            else:
                ptr = self._native(_b.PoolAlloc, handle, size, device, stream)
        except OutOfMemoryError:
            if stacks is not None:
                stacks.note_call(t0)  # the oom entry and the releases before it
            raise
        return ptr if stacks is None else self._with_stack(stacks, ptr, t0)

    def alloc_segment(self, size: int, device: Any = None, stream: Any = 0) -> int:
        """:meth:`alloc` for a caller that sizes its segments itself and
        caches inside them, as torch's caching allocator does above a
        ``torch.cuda.MemPool`` (:func:`gpumempool.mempool` uses it through
        the C ABI): a cached block serves it as in :meth:`alloc`, but a miss
        takes just the request from the backend (rounded to 2 MiB when
        large) rather than a 20 MiB segment to split, and the pool's
        ``roundup_power2_divisions`` is not applied again. History records
        these allocations as such (``caller_sized``), so that
        :func:`gpumempool.replay.replay` repeats them with this call."""
        size = check_int("size", size, 1, I64)
        device = self._device if device is None else device_index(device)
        stream = as_stream(stream)
        handle = self._handle()
        stacks = self._stacks
        t0 = _snapshot.now_us() if stacks is not None else 0
        try:
            if self._py_callbacks:
                ptr = self._alloc_with_callbacks(_b.PoolAllocSegment, handle, size, device, stream)
            else:
                ptr = self._native(_b.PoolAllocSegment, handle, size, device, stream)
        except OutOfMemoryError:
            if stacks is not None:
                stacks.note_call(t0)
            raise
        return ptr if stacks is None else self._with_stack(stacks, ptr, t0)

    def _with_stack(self, stacks: _snapshot.PoolStacks, ptr: int, t0: int) -> int:
        try:
            stacks.note_call(t0, block=ptr)
        except BaseException:
            self._free_quietly(ptr)  # never leak the block for bookkeeping
            raise
        return ptr

    def _alloc_with_callbacks(self, fn: Callable[..., int], handle: int, size: int, device: int, stream: int) -> int:
        """``fn`` (PoolAlloc or PoolAllocSegment) on a pool with Python callbacks (see settle_alloc)."""
        ptr, errs = self._native_collect(fn, handle, size, device, stream)
        if errs:
            _callbacks.settle_alloc(errs, ptr, self._name_or_id, self._free_quietly)
        return ptr

    def _free_quietly(self, ptr: int) -> None:
        stacks = self._stacks
        if stacks is not None:
            stacks.forget(ptr)
        try:
            if self._py_callbacks:
                self._native_collect(_b.PoolFree, self._id, ptr)
            else:
                _b.PoolFree(self._id, ptr)
        except Exception:  # the pool may be closed; nothing more to do
            pass

    def _traced(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``self._native(fn, *args)`` for a call that may record events
        (releases, completed frees): with stacks on, they get its stack."""
        stacks = self._stacks
        return self._native(fn, *args) if stacks is None else stacks.traced(self._native, fn, *args)

    def free(self, ptr: int) -> None:
        """Return the block at ``ptr`` to the pool."""
        if type(ptr) is not int or not 0 <= ptr < U64:
            ptr = check_int("ptr", ptr, 0, U64)
        handle = self._id if self._report is None else self._handle()
        stacks = self._stacks
        t0 = _snapshot.now_us() if stacks is not None else 0
        if self._fast is not None:
            try:
                self._fast.free(handle, ptr)
            except RuntimeError as exc:
                raise translate(exc) from None
        else:
            self._native(_b.PoolFree, handle, ptr)
        if stacks is not None:
            stacks.note_call(t0, freed=ptr)

    def record_stream(self, ptr: int, stream: Any) -> None:
        """Mark the block at ``ptr`` as used on ``stream``: after it is freed
        it is reused only once that stream's work up to the free is done."""
        ptr = check_int("ptr", ptr, 0, U64)
        self._traced(_b.PoolRecordStream, self._handle(), ptr, as_stream(stream))

    def process_events(self) -> int:
        """Free blocks whose cross-stream events completed; return how many
        frees still wait."""
        return int(self._traced(_b.PoolProcessEvents, self._handle()))

    # -- cache ------------------------------------------------------------

    def empty_cache(self) -> int:
        """Release every wholly free segment to the backend; return bytes released."""
        return int(self._traced(_b.PoolEmptyCache, self._handle()))

    def trim(self, keep_bytes: int = 0, device: Optional[Any] = None) -> int:
        """Release whole free segments until at most ``keep_bytes`` unused
        bytes stay cached on ``device`` (every device when None)."""
        keep = check_int("keep_bytes", keep_bytes, 0, U64)
        dev = -1 if device is None else device_index(device)
        return int(self._traced(_b.PoolTrim, self._handle(), dev, keep))

    def set_limit(self, limit: Optional[int], device: Optional[Any] = None) -> None:
        """Cap the bytes the pool reserves on ``device``, or on every device
        when None (which also drops earlier single-device caps). None or 0:
        no cap."""
        nbytes = check_int("limit", limit or 0, 0, U64)
        dev = -1 if device is None else device_index(device)
        self._traced(_b.PoolSetLimit, self._handle(), nbytes, dev)

    def limit(self, device: Any = 0) -> Optional[int]:
        """The byte cap in force on ``device`` (None when uncapped)."""
        return self._native(_b.PoolLimit, self._handle(), device_index(device)) or None

    def set_release_threshold(self, nbytes: Optional[int]) -> None:
        """Keep at most ``nbytes`` unused bytes cached per device (None or 0: all)."""
        self._traced(_b.PoolSetReleaseThreshold, self._handle(), check_int("nbytes", nbytes or 0, 0, U64))

    # -- introspection ------------------------------------------------------

    def stats(self, device: Optional[Any] = None) -> dict[str, int]:
        """Statistics with torch.cuda.memory_stats() key names, for one
        device or summed over all (peaks are then summed per-device peaks)."""
        dev = -1 if device is None else device_index(device)
        return json.loads(self._native(_b.PoolStats, self._handle(), dev))

    def reset_peak_stats(self) -> None:
        """Make every peak of :meth:`stats` its current value, on every
        device (torch's ``reset_peak_memory_stats``)."""
        self._native(_b.PoolResetStats, self._handle(), True, False)

    def reset_accumulated_stats(self) -> None:
        """Zero the running totals of :meth:`stats` (each stat's
        ``allocated`` and ``freed``, and the ``num_*`` counters) on every
        device; current values and peaks stay (torch's
        ``reset_accumulated_memory_stats``)."""
        self._native(_b.PoolResetStats, self._handle(), False, True)

    def seed_segment(self, blocks: Sequence[tuple[int, int, bool]], *, device: Any = 0, stream: Any = 0,
                     small: bool = False) -> list[int]:
        """Make one segment of ``blocks`` (``(size, requested, live)`` in
        address order; sizes multiples of 512 bytes) on ``device`` for
        ``stream``, as if the pool had obtained it and served requests until
        it held them: live blocks are allocated (their addresses are
        returned, in order; free them as any block) and the others cached.
        ``small`` puts it in the small pool (torch's 2 MiB segments for
        requests of up to 1 MiB). Replays use it to start where a recording
        allocator was at a trace's first event; pools with expandable
        segments cannot be seeded."""
        rows = []
        for i, b in enumerate(blocks):
            if not isinstance(b, (tuple, list)) or len(b) != 3:
                raise TypeError(f"seed_segment: block {i} must be (size, requested, live), got {type(b).__name__}")
            size, requested, live = b
            rows.append([check_int("size", size, 1, U64), check_int("requested", requested, 0, U64),
                         check_bool("live", live)])
        js = self._native(_b.PoolSeedSegment, self._handle(), device_index(device), as_stream(stream),
                          check_bool("small", small), json.dumps(rows))
        return [int(a) for a in json.loads(js)]

    def memory_summary(self, device: Optional[Any] = None, abbreviated: bool = False) -> str:
        """:meth:`stats` as a table laid out like ``torch.cuda.memory_summary()``
        (current, peak, total allocated and freed of each metric, per pool
        part unless ``abbreviated``), plus the engine's counters."""
        dev = None if device is None else device_index(device)
        title = _summary.pool_title(self.config(), dev)
        return _summary.memory_summary(self.stats(dev), title=title, abbreviated=abbreviated)

    def config(self) -> dict[str, Any]:
        """The pool's name, backend and options; ``backend_options`` holds
        the backend's own options as given (sim's capacity, manual_events,
        expandable, ...; a GPU backend's ipc, libcuda, ...)."""
        cfg = json.loads(self._native(_b.PoolConfig, self._handle()))
        cfg["backend_options"] = dict(self._options)
        return cfg

    @property
    def name(self) -> str:
        """The pool's name."""
        name = getattr(self, "_cached_name", None)
        if name is None:
            name = self._cached_name = str(self.config()["name"])
        return name

    @property
    def device(self) -> int:
        """The default device of :meth:`alloc`."""
        return self._device

    # -- torch / NCCL (provided by gpumempool.torch, which imports torch lazily)

    def register(self, process_group: Any = None, **kwargs: Any) -> Any:
        """Register the pool's buffers with the NCCL communicator of
        ``process_group`` (the default group when None), and keep registering
        as the pool grows; see :func:`gpumempool.torch.register`."""
        return _lifecycle.provided("register")(self, process_group, **kwargs)

    def deregister(self, process_group: Any = None, **kwargs: Any) -> Any:
        """Undo :meth:`register`; see :func:`gpumempool.torch.deregister`."""
        return _lifecycle.provided("deregister")(self, process_group, **kwargs)

    def release(self, device: Any = None, **kwargs: Any) -> int:
        """Give back the segments torch cached for this pool once its tensors
        are gone; an error (not a crash) while they are alive. See
        :func:`gpumempool.torch.release`."""
        return int(_lifecycle.provided("release")(self, device, **kwargs))

    @property
    def handle(self) -> int:
        """The pool's handle in the native library (for gmp_pool_alloc)."""
        return self._handle()

    @property
    def closed(self) -> bool:
        """Whether the pool has been closed."""
        return self._report is not None

    def check(self) -> None:
        """Verify the engine's invariants; raises BackendError on violation."""
        self._native(_b.PoolCheck, self._handle())

    def last_error(self) -> Optional[str]:
        """The last error recorded by a C-ABI call on this pool (they return
        NULL instead of raising), cleared by reading; None when none. The
        exceptions Python callbacks raised while called through the C ABI
        are appended."""
        return _callbacks.with_orphans(self._native(_b.PoolTakeError, self._handle()) or None, self._callback_errors)

    # -- snapshots and history ----------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This pool in the format of ``torch.cuda.memory._snapshot()``:
        ``segments`` with their ``blocks`` (address, size, requested_size,
        state), ``device_traces`` when history is recorded, plus our
        ``fragmentation`` figures (free bytes, largest free block, external
        fragmentation)."""
        raw = json.loads(self._native(_b.PoolSnapshot, self._handle()))
        history = json.loads(self._native(_b.PoolHistory, self._handle()))
        stacks = self._stacks
        frames, calls = stacks.copy() if stacks is not None else ({}, [])
        return _snapshot.pool_snapshot(self.name, self.handle, self.backend, raw, history, frames, calls)

    def segments(self) -> list[dict[str, int]]:
        """The pool's segments: device, address, size, stream."""
        raw = json.loads(self._native(_b.PoolSnapshot, self._handle()))
        return [{"device": s["device"], "address": s["address"], "size": s["total_size"], "stream": s["stream"]}
                for s in raw["segments"]]

    def record_history(self, enabled: bool = True, max_entries: int = 100_000, stacks: bool = False) -> None:
        """Record this pool's allocator events (see :func:`gpumempool.record_history`)."""
        self._native(_b.PoolRecordHistory, self._handle(), bool(enabled), check_int("max_entries", max_entries, 1, 1 << 31))
        # entries name their thread only for the stacks: a system call each
        self._native(_b.PoolRecordThreads, self._handle(), bool(enabled and stacks))
        if not (enabled and stacks):
            self._stacks = None
        elif self._stacks is None:
            self._stacks = _snapshot.PoolStacks(max_entries)
        else:
            self._stacks.max_entries = max_entries  # recording on again keeps what was recorded

    # -- IPC ----------------------------------------------------------------

    def export(self, ptr: int) -> "IpcHandle":
        """Make the block at ``ptr`` shareable with another process (async or
        vmm pools created with ``ipc=True``); see :mod:`gpumempool.ipc`."""
        from .ipc import IpcHandle

        ptr = check_int("ptr", ptr, 0, U64)
        meta = json.loads(self._native(_b.PoolExport, self._handle(), ptr))
        fds = meta.pop("fds")
        meta["fds"] = [None] * len(fds)  # numbers are per process; only the count travels
        return IpcHandle(meta, fds)

    # -- C ABI --------------------------------------------------------------

    def pluggable_symbols(self, *, throw_on_oom: bool = False, segments: bool = False) -> tuple[str, str, str]:
        """``(library path, alloc symbol, free symbol)`` for
        ``torch.cuda.memory.CUDAPluggableAllocator``: exported C functions
        with torch's signatures that allocate from this very pool, in the
        library this Python process already loaded.

        The alloc function returns NULL when the pool cannot serve a request
        (torch's caching allocator checks for it inside ``torch.cuda.MemPool``).
        ``throw_on_oom=True`` names a C++ one that throws a
        ``std::runtime_error`` instead, for callers that do not check, such
        as torch's full replacement (torch reports it as a RuntimeError);
        only C++ callers may use it. ``segments=True`` names the one for the
        allocator of a ``torch.cuda.MemPool`` (what :func:`gpumempool.mempool`
        uses): torch's caching allocator asks it for whole segments, which
        it sizes and carves itself, so a cache miss reserves just the
        request from the backend instead of carving it, like any request
        under 10 MiB, from a 20 MiB buffer of its own (which left up to
        18 MiB reserved and unused beneath torch's 2 MiB segments).

        The functions live in one of 64 numbered slots, held until the pool
        closes. A pool closed while blocks its C functions handed out are
        still allocated retires its slot for the rest of the process (the
        caller may still free them through it), as does one given to torch
        for good (``throw_on_oom``); a pool whose functions were never
        called gives its slot back on close whatever it still holds."""
        if throw_on_oom and segments:
            raise InvalidArgumentError("pluggable_symbols: throw_on_oom and segments exclude each other")
        kind = "throwing" if throw_on_oom else "segments" if segments else "plain"
        names = self._native(_b.PoolSymbols, self._handle(), kind)
        alloc_sym, free_sym = names.split(",")
        return _native.library_path(), alloc_sym, free_sym

    def pluggable_hooks(self) -> dict[str, str]:
        """Torch's ``CUDAPluggableAllocator`` hook setters (``set_init_fn``,
        ``set_reset_fn``, ``set_memory_fraction_fn``, ``set_record_stream_fn``,
        ``set_base_alloc_fn`` and the CUDA-graph ones
        ``set_begin_allocate_to_pool``, ``set_end_allocate_to_pool_fn``,
        ``set_release_pool``) mapped to this pool's exported functions in
        :func:`library_path`. Torch calls them directly, without the GIL;
        their failures are kept for :meth:`last_error`."""
        return dict(json.loads(self._native(_b.PoolHookSymbols, self._handle())))

    def graph_pools(self) -> list[dict[str, Any]]:
        """The private pools torch allocated into through this pool's hooks
        in full-replacement mode: one per CUDA graph captured (and per
        ``torch.cuda.MemPool`` used, on a torch that allows MemPools under a
        pluggable allocator; 2.11 refuses them), with ``id`` (torch's MempoolId_t),
        ``device``, ``live_blocks``, ``allocated_bytes``, ``reserved_bytes``,
        ``released`` (the graph is gone; the segments go back when its last
        block is freed) and ``capturing``. Their memory and counters are
        included in :meth:`stats`, as torch's ``memory_stats`` includes its
        graphs' pools; their blocks are never handed to anyone else."""
        return list(json.loads(self._native(_b.PoolGraphPools, self._handle())))

    # -- simulated device controls ----------------------------------------

    @property
    def sim(self) -> _sim.SimControls:
        """The controls of the pool's simulated device (``backend="sim"``): complete,
        manual_events, place_next, stats (see :class:`gpumempool._sim.SimControls`)."""
        return _sim.SimControls(self._native, self._handle)

    def sim_complete(self, stream: Any = None) -> None:
        """Deprecated: ``pool.sim.complete``."""
        _sim.warn_deprecated("complete")
        self.sim.complete(stream)

    def sim_manual_events(self, manual: bool = True) -> None:
        """Deprecated: ``pool.sim.manual_events``."""
        _sim.warn_deprecated("manual_events")
        self.sim.manual_events(manual)

    def sim_place_next(self, offset: Optional[int], size: Optional[int] = None, device: Any = 0) -> None:
        """Deprecated: ``pool.sim.place_next``."""
        _sim.warn_deprecated("place_next")
        self.sim.place_next(offset, size, device)

    def sim_stats(self) -> dict[str, int]:
        """Deprecated: ``pool.sim.stats``."""
        _sim.warn_deprecated("stats")
        return self.sim.stats()

    # -- lifetime -------------------------------------------------------------

    def close(self) -> CloseReport:
        """Return every segment to the backend and forget the pool. Blocks
        still allocated become invalid; they are listed in the report and a
        :class:`LeakWarning` is issued. Closing again returns the same report.

        First the pool's cache scopes are invalidated and, if torch used the
        pool, its NCCL registrations are dropped and torch's segments given
        back. Torch tensors from the pool that are still alive lose their
        memory: that is reported with a :class:`LeakWarning` (closing must
        work in ``__exit__`` and at shutdown, so it does not raise). So are
        cache scopes still entered (they are invalidated anyway) and errors
        of the backend or of a Python ``free`` function while the segments
        go back: the pool ends closed whatever happens."""
        _native.check_not_forked()  # closing swallows errors: not this one
        if self._callback_errors.inside():  # before self._lock, which the outer call may hold
            _callbacks.refuse_reentry(self._reentry_label())
        if self._report is None and self._id:
            _close.run_close_hooks(self)
        problems: list[str] = []
        with self._lock:
            if self._report is not None:
                return self._report
            if not self._id:
                raise PoolClosedError("pool was never opened")
            if getattr(self, "_cached_name", None) is None:
                try:
                    self._cached_name = self.config()["name"]
                except Exception:  # noqa: BLE001 - closed through another object
                    self._cached_name = None
            raw: dict[str, Any] = {}
            try:
                out, errs = self._native_collect(_b.PoolClose, self._id)
                raw = json.loads(out)
                problems += [f"the engine reported: {e}" for e in raw.get("errors", [])]
            except PoolClosedError:
                errs = []  # closed through another object or thread
            except Exception as exc:  # noqa: BLE001 - the engine closed the pool anyway
                errs = []
                problems.append(describe_exc(exc))
            problems += [callback_failure(kind, e) for kind, e in errs]
            _callbacks.drop_refs(self._id)
            self._report = _close.report(raw)
        _close.warn_problems(self._name_or_id(), problems, self._report)
        return self._report

    def __enter__(self) -> "MemPool":
        self._handle()  # a closed pool is refused here, not at its first use inside
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"handle={self._id}"
        return f"<gpumempool.MemPool backend={getattr(self, 'backend', '?')} {state}>"


# MemPool's doc lists the settings as the engine's schema declares them.
if MemPool.__doc__:
    MemPool.__doc__ = MemPool.__doc__.replace("    {settings}", "\n".join(
        f"    ``{f['name']}``: {f['doc']}" + (f"; default {f['default']}" if f.get("default") else "")
        for f in SETTINGS.values() if not f.get("given_as")))
