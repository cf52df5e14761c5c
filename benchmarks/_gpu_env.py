"""What the GPU benchmark scripts check before they start (shared by
record_traces.py and suite_gpu.py; imported from the scripts' own folder)."""

from __future__ import annotations

from typing import Optional


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
