"""The installed torch's CUDA paths without a GPU: tests/csrc/fake_cudart.c
and fake_cublas.c preloaded, tests/csrc/fake_cuda.c as libcuda.so.1
(tools/gpu-dryrun.sh runs the GPU checks this way). Kernels do nothing, so
only what does not depend on tensors' values is checked: which allocator
serves what, and how much it reserves. Skipped where torch (a CUDA build)
is not installed; the real checks are in test_torch_gpu.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

MiB = 1 << 20


def run(code: str, env: dict[str, str], cwd: Path) -> Any:
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# Tensors of assorted sizes kept alive, as a model's parameters and
# activations: torch takes 2 MiB segments for those under 1 MiB, 20 MiB ones
# for those under 10 MiB, and 2 MiB multiples above.
WORKLOAD = """
import json, sys, torch, gpumempool as gmp
sizes = [4 << 10, 300 << 10, 3 << 20, 900 << 10, 12 << 20, 64 << 10, 5 << 20, 40 << 20, 1 << 20] * 6
def workload():
    return [torch.empty(n // 4, device="cuda") for n in sizes]
if sys.argv[1] == "native":
    keep = workload()
    print(json.dumps({"reserved": torch.cuda.max_memory_reserved()}))
else:
    pool = gmp.MemPool(sys.argv[1])
    with gmp.mempool(pool) as tp:
        keep = workload()
    s = pool.stats(0)
    print(json.dumps({"reserved": s["reserved_bytes.all.peak"], "given_to_torch": s["allocated_bytes.all.peak"],
                      "torch_reserved": torch.cuda.max_memory_reserved()}))
"""


@pytest.mark.parametrize("backend", ["cuda", "vmm"])
def test_mempool_reserves_what_torch_reserves(backend: str, fake_gpu_env: dict[str, str], tmp_path: Path) -> None:
    """Beneath a torch.cuda.MemPool the pool reserves exactly the segments
    torch asks for: no second 20 MiB buffer under torch's 2 MiB ones (it
    reserved 1.002x native in GPT-2 training before gmp_segment_alloc)."""
    native = run(WORKLOAD.replace("sys.argv[1]", "'native'"), fake_gpu_env, tmp_path)
    ours = run(WORKLOAD.replace("sys.argv[1]", repr(backend)), fake_gpu_env, tmp_path)
    assert native["reserved"] > 100 * MiB
    assert ours["torch_reserved"] == native["reserved"]  # torch made the same segments
    assert ours["reserved"] == ours["given_to_torch"] == native["reserved"]
