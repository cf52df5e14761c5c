"""What the GPU benchmark scripts share (record_traces.py, suite_gpu.py and
gpt2_train.py import it from their own folder): the checks made before they
start, the options of the small GPT-2 they train, and the timed
allocation loop."""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional


def add_model_args(ap: argparse.ArgumentParser, *, batch: int, embd: int, heads: int, what: str = "GPT-2") -> None:
    """The GPT-2 options (transformers config, random weights and tokens):
    --batch, --seq, --vocab, --embd, --layers, --heads and --seed."""
    ap.add_argument("--batch", type=int, default=batch, help=f"{what} batch (default {batch})")
    ap.add_argument("--seq", type=int, default=256, help=f"{what} sequence length (default 256)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    ap.add_argument("--embd", type=int, default=embd, help=f"embedding width (default {embd})")
    ap.add_argument("--layers", type=int, default=6, help="transformer layers (default 6)")
    ap.add_argument("--heads", type=int, default=heads, help=f"attention heads (default {heads})")
    ap.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")


def allocator_backend(torch: Any) -> str:
    """torch's allocator backend ("native", "cudaMallocAsync", ...) or
    "unknown" where this torch cannot say."""
    for fn in (getattr(torch.cuda, "get_allocator_backend", None),
               getattr(getattr(torch.cuda, "memory", None), "get_allocator_backend", None)):
        if fn is not None:
            try:
                return str(fn())
            except Exception:  # noqa: BLE001
                pass
    return "unknown"


def time_alloc_loop(make: Callable[[int], Any], sizes: list[int], sync: Callable[[], Any]) -> dict[str, float]:
    """ns per allocation + free of make(n) over sizes, best of 3 passes (the
    first warms the caches): "empty_del" frees each at once, "window32"
    keeps the last 32 alive. sync() waits for the device around each pass."""
    res = {}
    for variant, window in (("empty_del", 0), ("window32", 32)):
        best = float("inf")
        for _ in range(3):
            live: list[Any] = []
            sync()
            t0 = time.perf_counter()
            for n in sizes:
                t = make(n)
                if window:
                    live.append(t)
                    if len(live) > window:
                        live.pop(0)
                del t
            live.clear()
            sync()
            best = min(best, time.perf_counter() - t0)
        res[f"{variant}_ns_per_op"] = best / len(sizes) * 1e9
    return res


def gpu_problem(need_transformers: bool = False) -> Optional[str]:
    """Why the GPU workloads cannot run here (a message starting with
    'no GPU' when there is none), or None."""
    try:
        import gpumempool as gmp
    except Exception as exc:  # noqa: BLE001
        return f"gpumempool does not import ({exc}); install the wheel first"
    try:
        info = gmp.device_info()
    except Exception as exc:  # noqa: BLE001
        info = {"devices": [], "reason": repr(exc)}
    if not info.get("devices"):
        return f"no GPU: NVML finds no NVIDIA device ({info.get('reason') or 'no devices'})"
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"torch is not installed ({exc})"
    if not torch.cuda.is_available():
        return f"no GPU visible to torch {torch.__version__} (a CPU-only build?)"
    if need_transformers:
        try:
            import transformers  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"transformers is not installed ({exc})"
    return None
