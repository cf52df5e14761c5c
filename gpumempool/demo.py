"""A training-shaped workload on the simulated device.

Each step runs a forward wave (activations allocated layer by layer, sizes
varying with a random sequence length, like variable-length batches) on the
default stream (0), then a backward wave that frees activations in reverse and
allocates gradients; the gradients are also used by a side stream (1, as
an all-reduce would be) through ``record_stream``, so their blocks come back
only after that stream's work completes. Small temporaries come and go
throughout. The summary shows what the cache saved.
"""

from __future__ import annotations

import random
import time
import warnings
from dataclasses import asdict, dataclass
import os
from typing import Any, Optional, Union

from ._errors import LeakWarning
from ._pool import MemPool
from ._progress import Progress
from ._snapshot import dump_snapshot
from ._summary import figure_label
from ._units import format_bytes

#: The default stream, where a torch program computes.
COMPUTE_STREAM = 0
#: A side stream, as the one an all-reduce runs on.
COMM_STREAM = 1
MiB = 1 << 20


@dataclass
class DemoResult:
    """Summary of one demo run (the figures are named as in
    :data:`gpumempool._summary.FIGURES`)."""

    steps: int
    layers: int
    allocations: int
    seconds: float
    peak_requested: int
    peak_allocated: int
    peak_reserved: int
    fragmentation: float  # peak reserved / peak allocated
    cache_hit_rate: float
    backend_calls: int  # segment allocs + frees the backend actually served
    backend_calls_without_cache: int  # one alloc + one free per allocation
    snapshot: Optional[str] = None  # where the pool's snapshot was written

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_demo(
    steps: int = 200,
    layers: int = 24,
    hidden: int = 2048,
    seed: int = 0,
    progress: bool = True,
    pool: Optional[MemPool] = None,
    snapshot: Union[str, "os.PathLike[str]", None] = None,
) -> DemoResult:
    """Run the workload on ``pool`` (a fresh private sim pool when None).
    With ``snapshot``, the pool records its history during the run and its
    snapshot (:meth:`MemPool.snapshot`, what ``python -m gpumempool plot``
    and ``replay`` read) is written there at the end, atomically (a failure
    leaves a file already there as it was)."""
    if steps <= 0 or layers <= 0 or hidden <= 0:
        raise ValueError("steps, layers and hidden must be positive")
    snapshot_path = None if snapshot is None else os.fspath(snapshot)
    if snapshot_path is not None:
        # refused before the run, not after it
        if os.path.isdir(snapshot_path):
            raise IsADirectoryError(f"{snapshot_path}: is a directory; the snapshot needs a file name")
        folder = os.path.dirname(os.path.abspath(snapshot_path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{snapshot_path}: no such directory {folder}")
    own = pool is None
    if pool is None:
        pool = MemPool("sim", name="demo", capacity=64 << 30, manual_events=True)
    if snapshot_path is not None:
        # every event of the run: about 3 per allocation, plus segments
        # with the stack of each call, as torch's _record_memory_history()
        pool.record_history(True, max_entries=min(1 << 30, 24 * (steps + 1) * (layers + 1) + 4096), stacks=True)
    rng = random.Random(seed)
    bar = Progress("demo", unit="step", enabled=progress, total=steps)
    allocations = 0
    # peak_requested: the bytes the workload asked for and had not freed
    # yet, at most at once (what replay computes from the same run's trace)
    held = peak_held = 0
    start = time.perf_counter()
    try:
        weight = 4 * hidden * hidden
        weights = [pool.alloc(weight, 0, COMPUTE_STREAM) for _ in range(layers)]
        allocations += layers
        held = peak_held = layers * weight
        for step in range(steps):
            seq = rng.choice((128, 256, 384, 512, 1024))
            batch = 8
            act = 2 * batch * seq * hidden
            acts = []
            for _ in range(layers):
                acts.append(pool.alloc(act, 0, COMPUTE_STREAM))
                size = rng.randrange(512, 256 << 10)
                tmp = pool.alloc(size, 0, COMPUTE_STREAM)
                held += act
                peak_held = max(peak_held, held + size)
                pool.free(tmp)
                allocations += 2
            grads = []
            for layer in reversed(range(layers)):
                grads.append(pool.alloc(weight, 0, COMPUTE_STREAM))
                pool.record_stream(grads[-1], COMM_STREAM)
                scratch = pool.alloc(batch * seq * 4, 0, COMPUTE_STREAM)
                held += weight
                peak_held = max(peak_held, held + batch * seq * 4)
                pool.free(scratch)
                pool.free(acts[layer])
                held -= act
                allocations += 2
            for g in grads:
                pool.free(g)
            held -= layers * weight
            # The comm stream finishes its all-reduces one step late.
            if step % 2 == 1:
                pool.sim.complete(COMM_STREAM)
            bar(step + 1, steps)
        for w in weights:
            pool.free(w)
        pool.sim.complete()
        pool.process_events()
        s = pool.stats()
        if snapshot_path is not None:
            dump_snapshot(snapshot_path, pool.snapshot())
    except BaseException:
        if own:
            # The error says what went wrong; the blocks it left are the
            # demo's own, not a leak to warn about.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LeakWarning)
                pool.close()
        raise
    finally:
        bar.close()
    if own:
        pool.close()
    seconds = time.perf_counter() - start
    peak_alloc = s["allocated_bytes.all.peak"]
    peak_res = s["reserved_bytes.all.peak"]
    return DemoResult(
        steps=steps,
        layers=layers,
        allocations=allocations,
        seconds=seconds,
        peak_requested=peak_held,
        peak_allocated=peak_alloc,
        peak_reserved=peak_res,
        fragmentation=peak_res / peak_alloc if peak_alloc else 0.0,
        cache_hit_rate=s["num_cache_hits"] / max(1, s["allocation.all.allocated"]),
        backend_calls=s["num_device_alloc"] + s["num_device_free"],
        backend_calls_without_cache=2 * s["allocation.all.allocated"],
        snapshot=snapshot_path,
    )


def format_summary(r: DemoResult) -> str:
    rows = [
        ("steps x layers", f"{r.steps} x {r.layers}"),
        (figure_label("allocations"), f"{r.allocations:,}"),
        ("wall time", f"{r.seconds:.2f} s ({r.allocations / max(r.seconds, 1e-9):,.0f} alloc/s)"),
        (figure_label("peak_requested"), format_bytes(r.peak_requested)),
        (figure_label("peak_allocated"), format_bytes(r.peak_allocated)),
        (figure_label("peak_reserved"), format_bytes(r.peak_reserved)),
        (figure_label("fragmentation"), f"{r.fragmentation:.3f} (peak reserved / peak allocated)"),
        (figure_label("cache_hit_rate"), f"{100 * r.cache_hit_rate:.2f} %"),
        (figure_label("backend_calls"), f"{r.backend_calls:,} (vs {r.backend_calls_without_cache:,} without a cache)"),
    ]
    if r.snapshot is not None:
        rows.append(("snapshot", r.snapshot))
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (max(len(v) for _, v in rows) + 2) + "+"
    out = [line]
    for k, v in rows:
        out.append(f"| {k.ljust(width)} | {v.ljust(len(line) - width - 7)} |")
    out.append(line)
    return "\n".join(out)
