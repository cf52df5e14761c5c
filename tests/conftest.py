"""Shared fixtures: the C helper library (a user allocator and a C caller of
gpumempool's exported ABI), built with the system C compiler."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

CSRC = Path(__file__).parent / "csrc"


def import_or_skip(name: str, *, module_level: bool = False) -> Any:
    """Import ``name``, or skip with the reason when it does not import for
    any reason. pytest.importorskip skips only a missing module (pytest >=
    9): a CuPy or torch that is installed but fails to load (a CUDA
    mismatch) would be a collection error, which ends the whole session."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} does not import: {str(exc).strip()[:300]}", allow_module_level=module_level)


def _has_gpu() -> bool:
    try:
        import gpumempool as gmp

        return bool(gmp.devices())
    except Exception:
        return False


def nccl_ok() -> bool:
    """Whether an nccl pool can be made here (a libnccl >= 2.19 is found).
    pip's NCCL is not on the loader's path; importing torch loads it (its
    libtorch_cuda needs libnccl.so.2), as a user's program would have."""
    import gpumempool as gmp

    if not os.environ.get("GMP_LIBNCCL"):
        try:
            import torch  # noqa: F401
        except Exception:  # noqa: BLE001 - without torch, the loader's search path decides
            pass
    try:
        gmp.MemPool("nccl").close()
        return True
    except gmp.GpuMemPoolError:
        return False


#: Set where the tests run on gpumempool.oracle's fake CUDA stack
#: (tests/_torch_versions.py): a GPU is listed, but kernels and copies do
#: nothing, so the tests marked real_gpu (tensor values, NCCL, CuPy) skip.
FAKE_CUDA_STACK = os.environ.get("GMP_FAKE_CUDA_STACK") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if FAKE_CUDA_STACK:
        fake = pytest.mark.skip(reason="needs a real GPU (on the fake CUDA stack kernels and copies do nothing)")
        for item in items:
            if "real_gpu" in item.keywords:
                item.add_marker(fake)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (NVML found none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def clib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = ctypes.CDLL(_build_so(tmp_path_factory, "testalloc.c", "testalloc"))
    lib.test_alloc.restype = ctypes.c_void_p
    lib.test_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.test_free.restype = None
    lib.test_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.test_reset.argtypes = [ctypes.c_long]
    for name in ("test_allocs", "test_frees", "test_live_bytes"):
        getattr(lib, name).restype = ctypes.c_long
    lib.test_last_stream.restype = ctypes.c_void_p
    lib.caller_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
    lib.caller_alloc.restype = ctypes.c_void_p
    lib.caller_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.caller_free.restype = None
    lib.caller_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.caller_bench.restype = ctypes.c_double
    lib.caller_bench.argtypes = [ctypes.c_size_t, ctypes.c_long]
    return lib


@pytest.fixture()
def pool():
    import gpumempool as gmp

    p = gmp.MemPool("sim", name="test", capacity=1 << 30)
    yield p
    p.close()


def _build_so(tmp_path_factory: pytest.TempPathFactory, src: str, name: str, *flags: str,
              libs: tuple[str, ...] = ()) -> str:
    """Build tests/csrc/<src> (C, or C++ for .cpp) into a shared library;
    ``libs`` (-L, -l, -Wl) go after the source, where linkers that drop
    unused libraries (--as-needed) still see them used."""
    if src.endswith(".cpp"):
        compiler, what = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"), "C++ compiler (c++/g++)"
    else:
        compiler, what = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"), "C compiler (cc/gcc)"
    if not compiler:
        pytest.fail(f"no {what} to build tests/csrc/{src}")
    out = tmp_path_factory.mktemp(name) / f"lib{name}.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-pthread", *flags, "-o", str(out), str(CSRC / src),
                    *libs, "-ldl"], check=True)
    return str(out)


@pytest.fixture(scope="session")
def cxx_caller(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """tests/csrc/torch_caller.cpp: a C++ caller of the entry points that
    need C++ (the throwing alloc, the CUDA-graph hooks), calling them as
    torch does."""
    return _torch_caller(_build_so(tmp_path_factory, "torch_caller.cpp", "torchcaller"))


def _torch_caller(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.call_alloc.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
    lib.call_begin.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_ulonglong,
                               ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int]
    lib.call_begin_layout.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_ulonglong,
                                      ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                                      ctypes.c_long, ctypes.c_char_p, ctypes.c_size_t]
    lib.call_end.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
    lib.live_filters.restype = ctypes.c_long
    lib.filter_call_count.restype = ctypes.c_long
    return lib


@pytest.fixture(scope="session")
def torch_headers() -> tuple[Path, Path]:
    """The include and lib directories of the installed torch, found without
    importing it. Skips where torch or its C++ headers are missing."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        pytest.skip("torch is not installed")
    root = Path(spec.origin).resolve().parent
    if not (root / "include" / "c10" / "util" / "Exception.h").is_file():
        pytest.skip(f"the torch at {root} ships no C++ headers")
    return root / "include", root / "lib"


@pytest.fixture(scope="session")
def fake_gpu_env(tmp_path_factory: pytest.TempPathFactory, torch_headers: tuple[Path, Path]) -> dict[str, str]:
    """The environment that runs the installed torch's CUDA paths without a
    GPU: tests/csrc/fake_cudart.c and fake_cublas.c preloaded, fake_cuda.c
    as libcuda.so.1 (as tools/gpu-dryrun.sh does). Skips without torch."""
    lib_dir = tmp_path_factory.mktemp("fakelib")
    os.symlink(_build_so(tmp_path_factory, "fake_cuda.c", "fakecuda"), lib_dir / "libcuda.so.1")
    preload = [_build_so(tmp_path_factory, "fake_cudart.c", "fakecudart"),
               _build_so(tmp_path_factory, "fake_cublas.c", "fakecublas")]
    return {**os.environ, "LD_PRELOAD": ":".join(preload), "LD_LIBRARY_PATH": str(lib_dir),
            "FAKE_CUDA_DEVICES": "1", "FAKE_CUDA_CAPACITY": str(80 << 30), "PYTHONSAFEPATH": "1",
            "GMP_LIBCUDA": str(lib_dir / "libcuda.so.1")}


@pytest.fixture(scope="session")
def c10_caller(tmp_path_factory: pytest.TempPathFactory, torch_headers: tuple[Path, Path]) -> ctypes.CDLL:
    """tests/csrc/torch_caller.cpp built against torch's headers and libc10:
    its call_alloc returns 3 for a c10::OutOfMemoryError, the C++ type torch
    raises as torch.OutOfMemoryError."""
    include, lib = torch_headers
    so = _build_so(tmp_path_factory, "torch_caller.cpp", "c10caller", "-std=c++17", "-DGMP_WITH_C10", f"-I{include}",
                   libs=(f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"))
    return _torch_caller(so)


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ctypes.CDLL]:
    """A stand-in libcuda.so.1 over host memory (tests/csrc/fake_cuda.c): its
    path and a handle to its fake_cuda_* controls. Two devices of 1 GiB."""
    path = _build_so(tmp_path_factory, "fake_cuda.c", "fakecuda")
    lib = ctypes.CDLL(path)
    lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.fake_cuda_calls.argtypes = [ctypes.c_char_p]
    lib.fake_cuda_calls.restype = ctypes.c_long
    lib.fake_cuda_live_bytes.restype = ctypes.c_ulonglong
    lib.fake_cuda_live_allocs.restype = ctypes.c_long
    lib.fake_cuda_ptr_device.argtypes = [ctypes.c_size_t]
    lib.fake_cuda_complete_stream.argtypes = [ctypes.c_size_t]
    lib.fake_cuda_access.argtypes = [ctypes.c_size_t, ctypes.c_int]
    return path, lib


@pytest.fixture(scope="session")
def fake_nccl(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ctypes.CDLL]:
    """A stand-in libnccl (tests/csrc/fake_nccl.c, NCCL 2.23.4)."""
    path = _build_so(tmp_path_factory, "fake_nccl.c", "fakenccl")
    lib = ctypes.CDLL(path)
    lib.fake_nccl_calls.restype = ctypes.c_long
    lib.fake_nccl_live_bytes.restype = ctypes.c_long
    return path, lib


@pytest.fixture(scope="session")
def fake_nccl_without_register(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of the fake libnccl built without ncclCommRegister and
    ncclCommDeregister (-DFAKE_NCCL_NO_REGISTER)."""
    return _build_so(tmp_path_factory, "fake_nccl.c", "fakencclnoreg", "-DFAKE_NCCL_NO_REGISTER")
