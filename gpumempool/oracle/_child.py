"""The torch side of the oracle, run as a script by the Python that has
torch (which need not have gpumempool): loads the fake CUDA stack, replays
the events and writes torch's figures after each one.

    python _child.py REQUEST.json RESULT.json

REQUEST: {"preload": [paths], "events": [[op, ...], ...], "fraction": F or
null, "devices": N, "real_gpu": bool}. Ops: ["a", id, size, device,
stream], ["f", id], ["r", id, stream], ["s", stream or null], ["e"].
RESULT: {"torch": version, "points": [[device, reserved, allocated,
segments, retries, ooms], ...] (one per event), "oom_events": [...],
"error": message or null}. The allocator settings come in the environment
(PYTORCH_CUDA_ALLOC_CONF), as they do for a user."""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    driver = None
    for path in req["preload"]:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        if driver is None:
            driver = lib
    out: dict[str, Any] = {"torch": None, "points": [], "oom_events": [], "error": None}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - reported in one line
        out["error"] = f"import torch failed: {type(e).__name__}: {e}"
        return _write(result_path, out)
    out["torch"] = torch.__version__
    if not torch.cuda.is_available():
        where = "this machine's GPU" if req.get("real_gpu") else "the fake CUDA stack"
        out["error"] = f"torch.cuda.is_available() is False on {where}"
        return _write(result_path, out)
    try:
        _replay(torch, driver, req, out)
    except Exception as e:  # noqa: BLE001 - torch's own error, reported in one line
        msg = str(e).strip().splitlines()
        out["error"] = f"event {len(out['points'])}: {type(e).__name__}: {msg[0] if msg else ''}"
    return _write(result_path, out)


def _replay(torch: Any, driver: Any, req: dict[str, Any], out: dict[str, Any]) -> None:
    manual = driver is not None and not req.get("real_gpu")
    if manual:
        driver.fake_cuda_set_manual_events(1)
        driver.fake_cuda_complete_stream.argtypes = [ctypes.c_size_t]
    devices = int(req.get("devices") or 1)
    # CUDA starts lazily, at the first allocation: the stats of a trace that
    # begins with something else (a sync, a free) need it started.
    torch.cuda.init()
    fraction = req.get("fraction")
    if fraction is not None:
        for d in range(devices):
            torch.cuda.set_per_process_memory_fraction(float(fraction), d)
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    stats_of = torch._C._cuda_memoryStats
    streams: dict[tuple[int, Any], Any] = {}
    tensors: dict[int, Any] = {}
    where: dict[int, int] = {}  # the device of every allocation, failed ones too
    current = [None]

    def stream(dev: int, s: Any) -> Any:
        key = (dev, s)
        st = streams.get(key)
        if st is None:
            st = torch.cuda.default_stream(dev) if not s else torch.cuda.Stream(device=dev)
            streams[key] = st
        return st

    points = out["points"]
    for i, ev in enumerate(req["events"]):
        op = ev[0]
        dev = 0
        if op == "a":
            _, ident, size, dev, s = ev
            where[ident] = dev
            st = stream(dev, s)
            if current[0] is not st:
                torch.cuda.set_stream(st)
                current[0] = st
            try:
                tensors[ident] = (torch.empty(size, dtype=torch.uint8, device=dev), dev)
            except oom_type:
                out["oom_events"].append(i)
        elif op == "f":
            dev = where.pop(ev[1], 0)
            t = tensors.pop(ev[1], None)
            del t
        elif op == "r":
            dev = where.get(ev[1], 0)
            t = tensors.get(ev[1])
            if t is not None:
                t[0].record_stream(stream(dev, ev[2]))
        elif op == "s":
            if ev[1] is None:
                if manual:
                    driver.fake_cuda_complete_all()
                else:
                    torch.cuda.synchronize()
            else:
                for (d, s), st in streams.items():
                    if s == ev[1]:
                        if manual:
                            driver.fake_cuda_complete_stream(st.cuda_stream)
                        else:
                            st.synchronize()
        elif op == "e":
            torch.cuda.empty_cache()
        st = stats_of(dev)
        points.append([dev, st["reserved_bytes"]["all"]["current"], st["allocated_bytes"]["all"]["current"],
                       st["segment"]["all"]["current"], st["num_alloc_retries"], st["num_ooms"]])


def _write(path: str, out: dict[str, Any]) -> int:
    with open(path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
