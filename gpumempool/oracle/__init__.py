"""Torch's own caching allocator as the judge, without a GPU.

:func:`run` replays an allocation trace (a :class:`~gpumempool.trace.Trace`,
a gmptrace file or a torch snapshot with history) through the real
``CUDACachingAllocator`` of an installed CUDA build of torch, in a child
process, on a fake CUDA stack (a fake driver whose device memory is address
space, a fake runtime, a fake NVML, and stand-ins for the NVIDIA libraries a
slim install lacks; see ``_stack.py``), under the allocator settings,
device capacity and memory fraction you give, and returns torch's reserved
and allocated bytes, segments, retries and out-of-memory errors after every
event. :func:`gpumempool.oracle.fidelity.compare` puts the engine's figures
beside them.

::

    from gpumempool import oracle
    r = oracle.run("run.trace.gz", "expandable_segments:True", python="/venv-torch/bin/python")
    print(r.torch_version, r.peak_reserved, r.points[-1])

What it covers: the caching allocator's decisions on allocation sequences
(sizes, frees, streams, ``record_stream`` with event completion under the
trace's control, ``empty_cache``, memory fraction, out-of-memory with
release and retry). What it cannot: compute (kernels, copies and cuBLAS do
nothing), cuBLAS/cuDNN workspaces, ``cudaMallocAsync`` (refused), and
anything that reads device memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from .._errors import BackendError
from ..trace import Alloc, EmptyCache, Free, RecordStream, Sync, Trace, TraceFile, Trim
from ._stack import FakeStack, FakeStackError, TorchInstall, build, find_torch

__all__ = ["FakeStackError", "OracleError", "OracleResult", "Point", "env_var", "events_of", "run", "torch_env"]

#: The device size when the caller names none: an 80 GB H100.
DEFAULT_CAPACITY = 80 << 30
_CHILD = Path(__file__).resolve().parent / "_child.py"


class OracleError(BackendError):
    """Torch could not replay the trace (it failed to import on the fake
    stack, or raised something other than out-of-memory): ``.torch_version``
    and ``.event`` (the index of the event, or -1) say where."""

    def __init__(self, message: str, torch_version: str = "", event: int = -1) -> None:
        super().__init__(message)
        self.torch_version = torch_version
        self.event = event


@dataclass(frozen=True)
class Point:
    """Torch's figures for one device after one event."""

    device: int
    reserved: int
    allocated: int
    segments: int
    retries: int
    ooms: int


@dataclass
class OracleResult:
    """What torch did with the trace."""

    torch_version: str
    alloc_conf: str
    capacity: int
    fraction: Optional[float]
    points: list[Point]
    oom_events: list[int]
    seconds: float
    env_var: str = "PYTORCH_CUDA_ALLOC_CONF"
    stderr: str = field(default="", repr=False)

    @property
    def peak_reserved(self) -> int:
        return max((p.reserved for p in self.points), default=0)

    def _last_per_device(self) -> list[Point]:
        last: dict[int, Point] = {}
        for p in self.points:
            last[p.device] = p
        return list(last.values())

    @property
    def retries(self) -> int:
        """Torch's allocation retries, every device's (each point carries
        its device's count so far)."""
        return sum(p.retries for p in self._last_per_device())

    @property
    def ooms(self) -> int:
        """Torch's out-of-memory errors, every device's."""
        return sum(p.ooms for p in self._last_per_device())

    def as_dict(self) -> dict[str, Any]:
        return {"torch": self.torch_version, "alloc_conf": self.alloc_conf, "env_var": self.env_var,
                "capacity": self.capacity, "fraction": self.fraction, "events": len(self.points),
                "peak_reserved": self.peak_reserved, "ooms": self.ooms,
                "retries": self.retries, "seconds": round(self.seconds, 3)}


def events_of(trace: Union[Trace, TraceFile]) -> list[list[Any]]:
    """The trace as the child's operations (see ``_child.py``). ``trim``
    has no torch counterpart and is refused."""
    out: list[list[Any]] = []
    for i, e in enumerate(trace):
        t = type(e)
        if t is Alloc:
            out.append(["a", e.id, e.size, e.device, e.stream])  # type: ignore[union-attr]
        elif t is Free:
            out.append(["f", e.id])  # type: ignore[union-attr]
        elif t is RecordStream:
            out.append(["r", e.id, e.stream])  # type: ignore[union-attr]
        elif t is Sync:
            out.append(["s", e.stream])  # type: ignore[union-attr]
        elif t is EmptyCache:
            out.append(["e"])
        elif t is Trim:
            raise OracleError(f"event {i}: trim has no counterpart in torch's allocator", event=i)
    return out


def env_var(version: str) -> str:
    """The variable the torch of ``version`` reads: PYTORCH_ALLOC_CONF from
    2.10 (2.9 reads it too, but is reported to ignore it for some settings;
    it honours the older name with a deprecation warning)."""
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return "PYTORCH_CUDA_ALLOC_CONF"
    return "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 10) else "PYTORCH_CUDA_ALLOC_CONF"


#: What a user's shell may set that changes torch's caching allocator: the
#: settings (the oracle passes its own) and the switch that turns it off.
_TORCH_ALLOCATOR_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING")


def _clean_env() -> dict[str, str]:
    """This process's environment without what changes torch's allocator."""
    return {k: v for k, v in os.environ.items() if k not in _TORCH_ALLOCATOR_VARS}


def torch_env(stack: FakeStack, alloc_conf: str, capacity: int, devices: int) -> dict[str, str]:
    """The child's environment: the fake driver's devices, their size and
    its virtual-memory mode, and the settings under the variable this torch
    reads (the other one, PYTORCH_NO_CUDA_MEMORY_CACHING and the fake
    driver's FAKE_CUDA_* variables removed, so that what the caller's shell
    has set cannot leak in)."""
    env = {k: v for k, v in _clean_env().items()
           if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES") and not k.startswith("FAKE_CUDA_")}
    env.update(FAKE_CUDA_VIRTUAL="1", FAKE_CUDA_DEVICES=str(devices), FAKE_CUDA_CAPACITY=str(capacity),
               PYTHONSAFEPATH="1", PYTHONWARNINGS="ignore")
    if alloc_conf:
        env[env_var(stack.torch.version)] = alloc_conf
    return env


def run(
    trace: Union[Trace, TraceFile, str, os.PathLike[str]],
    alloc_conf: str = "",
    *,
    python: Optional[str] = None,
    capacity: int = DEFAULT_CAPACITY,
    fraction: Optional[float] = None,
    devices: Optional[int] = None,
    cache: Optional[Union[str, os.PathLike[str]]] = None,
    timeout: float = 3600.0,
    real_gpu: bool = False,
) -> OracleResult:
    """Replays ``trace`` through the caching allocator of the torch that
    ``python`` imports (default: this interpreter), under ``alloc_conf``
    (torch's ``PYTORCH_ALLOC_CONF`` syntax), on ``devices`` fake devices of
    ``capacity`` bytes, with ``set_per_process_memory_fraction(fraction)``
    when given. Raises :class:`FakeStackError` when the stack cannot be
    built for that torch (a CPU-only build, no runtime headers, no
    compiler) and :class:`OracleError` when torch fails.

    With ``real_gpu`` the trace runs on the machine's GPU instead (no fake
    stack: ``capacity`` is then the GPU's, and stream syncs really wait)."""
    if isinstance(trace, (str, os.PathLike)):
        trace = _load(Path(trace))
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity must be a positive number of bytes, got {capacity!r}")
    if fraction is not None and not 0 < float(fraction) <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    events = events_of(trace)
    used = 1 + max((e[3] for e in events if e[0] == "a"), default=0)
    devices = max(int(devices or 1), used)
    if devices > 16:
        raise ValueError(f"the fake driver has at most 16 devices; the trace uses {devices}")
    torch = find_torch(python or sys.executable)
    if real_gpu:
        stack = FakeStack(Path(), (), torch)
        env = _clean_env()
        if alloc_conf:
            env[env_var(torch.version)] = alloc_conf
    else:
        stack = build(torch, Path(cache) if cache else None)
        env = torch_env(stack, alloc_conf, capacity, devices)
    with tempfile.TemporaryDirectory(prefix="gmp-oracle-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"preload": list(stack.preload), "events": events, "devices": devices,
                                   "fraction": fraction, "real_gpu": real_gpu}))
        start = time.perf_counter()
        try:
            proc = subprocess.run([stack.torch.python, str(_CHILD), str(req), str(res)], capture_output=True,
                                  text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise OracleError(f"torch {stack.torch.version} did not finish the trace in {timeout:.0f} s",
                              stack.torch.version) from None
        seconds = time.perf_counter() - start
        if not res.is_file():
            where = "the GPU" if real_gpu else "the fake CUDA stack"
            raise OracleError(f"torch {stack.torch.version} on {where} exited with {proc.returncode}: "
                              f"{_death_message(proc.stderr)}", stack.torch.version)
        out = json.loads(res.read_text())
    if out.get("error"):
        ev = -1
        msg = str(out["error"])
        if msg.startswith("event "):
            try:
                ev = int(msg.split()[1].rstrip(":"))
            except ValueError:
                pass
        raise OracleError(f"torch {out.get('torch') or stack.torch.version}: {msg}", stack.torch.version, ev)
    return OracleResult(
        torch_version=str(out["torch"]), alloc_conf=alloc_conf, capacity=capacity, fraction=fraction,
        points=[Point(*p) for p in out["points"]], oom_events=list(out["oom_events"]), seconds=seconds,
        env_var=env_var(stack.torch.version), stderr=proc.stderr)


def _death_message(stderr: str) -> str:
    """One line saying why the child died: the message of the C++ exception
    torch aborted with (``what():``, not the stack of frames printed after
    it), else the last line that is not one of those frames."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("what():"):
            return ln[len("what():"):].strip() or "no message"
    rest = [ln for ln in lines if not ln.startswith("frame #")]
    return rest[-1] if rest else "no message"


def _load(path: Path) -> Union[Trace, TraceFile]:
    from ..trace import from_torch_snapshot, is_trace_file

    return TraceFile(path) if is_trace_file(path) else from_torch_snapshot(path)


def installs(pythons: Iterable[str]) -> list[TorchInstall]:
    """The torch each of ``pythons`` imports (for the fidelity matrix)."""
    return [find_torch(p) for p in pythons]
