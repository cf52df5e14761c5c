"""``info``: version, library path, NVIDIA devices, and what the torch integration
will do with the installed torch."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def run(args: argparse.Namespace) -> int:
    import gpumempool as gmp

    info = gmp.device_info()
    out = {
        "version": gmp.__version__,
        "library": gmp.library_path(),
        "backends": gmp.backends(),
        "devices": info["devices"],
        "reason": info["reason"],
        "torch": torch_info(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"gpumempool {out['version']}")
    print(f"library:  {out['library']}")
    print(f"backends: {', '.join(out['backends'])}")
    if not info["devices"]:
        print(f"devices:  none ({info['reason']})")
    for d in info["devices"]:
        gib = 1 << 30
        # numa_node is the GPU's own NUMA node (its memory is one on Grace
        # Hopper / Blackwell), not the host node nearest a PCIe GPU: -1 there.
        numa = f", GPU is NUMA node {d['numa_node']}" if d["numa_node"] >= 0 else ""
        print(
            f"  [{d['index']}] {d['name']}  {d['uuid']}  {d['total_bytes'] / gib:.1f} GiB total, "
            f"{d['free_bytes'] / gib:.1f} GiB free{numa}, cc {d['compute_capability']}"
        )
    t = out["torch"]
    if t is None:
        print("torch:    not installed (gmp.mempool / set_torch_allocator need it)")
    elif "error" in t:
        print(f"torch:    does not import: {t['error']}")
    else:
        cuda = f"CUDA {t['cuda']}" if t["cuda"] else "no CUDA build"
        print(f"torch:    {t['version']} ({cuda}, GPU {'visible' if t['cuda_available'] else 'not visible'})")
        print(f"  mempool: {t['mempool']}")
        print(f"  full replacement: {'yes' if t['pluggable'] else 'no'}; NCCL registration: {t['nccl_registration']}")
        if t["pluggable"]:
            hooks = t["capabilities"].get("pluggable_hooks") or ()
            graphs = "private pools" if "begin_allocate_to_pool" in hooks else "not isolated (no hooks in this torch)"
            print(f"  full-replacement hooks: {', '.join(hooks) or 'none found'}; CUDA graphs: {graphs}")
            ok, how = t["oom_error_torch"]
            print(f"  oom_error='torch' (torch.OutOfMemoryError): {how if ok else 'unavailable: ' + how}")
    return 0


def torch_info() -> Any:
    """What gpumempool.torch will do with the installed torch, or None when
    torch is not installed. Imports torch (slow) only when it is there."""
    import importlib.util

    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        from .. import torch as gtorch

        caps = gtorch.capabilities(torch)
    except Exception as exc:  # noqa: BLE001 - a broken torch install is reported, not raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not caps.mem_pool:
        mempool = "unsupported (torch < 2.5 has no torch.cuda.MemPool)"
    else:
        enter = "use_mem_pool" if caps.use_mem_pool else f"torch._C.{caps.begin_fn}"
        routing = "this thread only" if caps.thread_local_routing else "every thread while inside (torch 2.5-2.7)"
        mempool = f"torch.cuda.MemPool entered with {enter}; routing: {routing}"
    dist = getattr(torch, "distributed", None)
    pg = getattr(getattr(dist, "distributed_c10d", None), "ProcessGroupNCCL", None) if dist is not None else None
    if pg is None:
        nccl = "unsupported (this torch has no torch.distributed ProcessGroupNCCL)"
    elif hasattr(pg, "register_mem_pool"):
        nccl = "register_mem_pool" + (" (new segments too)" if caps.nccl_registers_new_segments else
                                      " (re-registered on mempool exit)")
    elif hasattr(pg, "_comm_ptr"):
        nccl = "ncclCommRegister per segment"
    else:
        nccl = "unsupported (this torch's ProcessGroupNCCL has neither register_mem_pool nor _comm_ptr)"
    return {
        "version": caps.version,
        "cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "cuda_available": bool(torch.cuda.is_available()),
        "mempool": mempool,
        "pluggable": caps.pluggable,
        "nccl_registration": nccl,
        "oom_error_torch": gtorch.oom_shim_readiness(torch),
        "capabilities": dict(vars(caps)),
    }


def add_parser(sub: Any) -> None:
    """Add the ``info`` command to the subparsers ``sub``."""
    info = sub.add_parser("info", help="version, library path and NVIDIA devices (via NVML)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=run)
