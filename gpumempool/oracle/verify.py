"""``tune --verify``: the best few settings that tune found, replayed
through the installed torch's own caching allocator, predicted and torch's
figures side by side.

Runs on the GPU when there is one with room for the run, otherwise on the
fake CUDA stack (:mod:`gpumempool.oracle`). The predicted figures are
tune's; beyond the peaks, every event is compared: ``matched`` counts the
events where the engine (replaying as the fake stack places segments,
lowest address first) has torch's reserved and allocated bytes, segments,
retries and OOMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from ..trace import Trace, TraceFile
from . import DEFAULT_CAPACITY, run
from .fidelity import diff, engine_points

__all__ = ["Verified", "verify"]


@dataclass
class Verified:
    """One setting: what the engine predicted and what torch did."""

    settings: str  # tune's description
    alloc_conf: str
    predicted_peak: int
    torch_peak: int
    predicted_retries: int
    torch_retries: int
    predicted_ooms: int
    torch_ooms: int
    matched: int
    total: int
    torch_version: str
    on: str  # "fake CUDA stack" or "GPU"

    @property
    def exact(self) -> bool:
        return self.matched == self.total

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "exact": self.exact}


def _gpu_memory() -> tuple[int, int]:
    """Free and total bytes of GPU 0 (NVML), (0, 0) without a GPU."""
    try:
        import gpumempool as gmp

        devices = gmp.device_info().get("devices") or []
        return (int(devices[0].get("free", 0)), int(devices[0].get("total", 0))) if devices else (0, 0)
    except Exception:  # noqa: BLE001 - no NVML, no GPU
        return 0, 0


def verify(result: Any, trace: Union[Trace, TraceFile], *, n: int = 3, python: Optional[str] = None,
           on: str = "auto", progress: Optional[Callable[[int, int], None]] = None) -> list[Verified]:
    """Replays the default and the best ``n`` torch settings of ``result``
    (a :class:`~gpumempool.tune.TuneResult` of ``trace``) through torch.
    ``on``: "auto" (the GPU when its free memory holds the largest
    prediction with a tenth to spare, else the fake stack), "gpu" or
    "fake"."""
    if on not in ("auto", "gpu", "fake"):
        raise ValueError(f"on must be auto, gpu or fake, got {on!r}")
    cands = [result.default] + [c for c in result.top(n) if c is not result.default and c.settings]
    meta_capacity = trace.meta.get("capacity")
    capacity: int = meta_capacity if isinstance(meta_capacity, int) and meta_capacity > 0 else DEFAULT_CAPACITY
    peak = max(c.peak_reserved for c in cands)
    free, total = _gpu_memory() if on != "fake" else (0, 0)
    real_gpu = on == "gpu" or (on == "auto" and free > peak * 1.1)
    if real_gpu and total > 0:
        # torch's memory fraction is a share of the GPU it runs on, and the
        # engine beside it models that GPU.
        capacity = total
    out: list[Verified] = []
    for i, c in enumerate(cands):
        conf = c.alloc_conf or ""
        limit = c.limit or (capacity if "garbage_collection_threshold" in c.settings else None)
        fraction = min(1.0, limit / capacity) if limit else None
        theirs = run(trace, conf, python=python, capacity=capacity, fraction=fraction, real_gpu=real_gpu)
        ours = engine_points(trace, conf, capacity=capacity, fraction=fraction, torch_version=theirs.torch_version)
        d = diff(theirs, ours)
        out.append(Verified(
            settings=c.describe(), alloc_conf=conf, predicted_peak=c.peak_reserved,
            torch_peak=d.torch_peak_reserved, predicted_retries=c.result.alloc_retries,
            torch_retries=theirs.retries, predicted_ooms=c.result.ooms,
            torch_ooms=theirs.ooms, matched=d.matched, total=d.total,
            torch_version=theirs.torch_version, on="GPU" if real_gpu else "fake CUDA stack"))
        if progress is not None:
            progress(i + 1, len(cands))
    return out
