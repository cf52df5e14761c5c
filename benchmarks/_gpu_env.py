"""What the GPU benchmark scripts share (record_traces.py, suite_gpu.py,
gpt2_train.py and gpu_stress.py import it from their own folder): the checks
made before they start, the options of the small GPT-2 they train, the timed
allocation loop, and torch tensors over raw device memory."""

from __future__ import annotations

import argparse
import ctypes
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


class DLManagedTensor(ctypes.Structure):  # DLPack's DLTensor (device, dtype inlined) + manager_ctx, deleter
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype, _capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_libc = ctypes.CDLL(None)
_libc.malloc.restype, _libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_DL = ctypes.sizeof(DLManagedTensor)


def device_tensor(torch: Any, ptr: int, count: int, dtype: str) -> Any:
    """A 1-d tensor of count int32 or uint8 (dtype) over device 0's memory at ptr, no copy.
    DLPack names the device; with __cuda_array_interface__ torch would ask
    cudaPointerGetAttributes. The struct and its shape are malloc'ed, libc's
    free the deleter torch calls when the storage dies (not when Python drops
    a reference: a Python-owned struct freed first would be read after free)."""
    mem = _libc.malloc(_DL + 8)
    if not mem:
        raise MemoryError("malloc of a DLPack struct failed")
    ctypes.c_int64.from_address(mem + _DL).value = count
    dl = DLManagedTensor.from_address(mem)
    dl.data, dl.device_type, dl.device_id, dl.ndim = ptr, 2, 0, 1  # kDLCUDA
    dl.code, dl.bits, dl.lanes = {"int32": (0, 32, 1), "uint8": (1, 8, 1)}[dtype]  # kDLInt, kDLUInt
    dl.shape, dl.strides, dl.byte_offset, dl.manager_ctx = mem + _DL, None, 0, None
    dl.deleter = ctypes.cast(_libc.free, ctypes.c_void_p).value
    return torch.utils.dlpack.from_dlpack(_capsule(mem, b"dltensor", None))
