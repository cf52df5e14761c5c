"""The oracle's fake CUDA stack, prebuilt into the package at build time.

``gpumempool.oracle`` runs torch's caching allocator on a fake driver
(libcuda.so.1), a fake NVML (libnvidia-ml.so.1) and a fake runtime
(libcudart.so.12 / .13). Users have no compiler, so setup.py builds them
here, with the compiler the build uses (zig for the manylinux wheels, which
also cross-compiles them for aarch64), into ``gpumempool/oracle/lib/``:

    libcuda.so.1        tests/csrc/fake_cuda.c (read from the source tree;
                        it includes gocore/cuda/driver/cuda_types.h)
    libnvidia-ml.so.1   gpumempool/oracle/csrc/fake_nvml.c
    libcudart.so.12     gpumempool/oracle/csrc/fake_cudart.c + cudart_props.c
    libcudart.so.13       against that release's cuda_runtime_api.h

One flat directory: each runtime finds the driver through its RPATH
``$ORIGIN`` (and so does auditwheel, which then sees no external library).
The runtime headers come from NVIDIA's runtime wheels on PyPI
(``HEADER_WHEELS``), downloaded once with ``pip download --no-deps`` and cached
(only their include directory is kept). The oracle checks at run time that
the SONAME and version nodes are the ones torch needs (gpumempool/oracle/
_stack.py) and compiles the stack itself otherwise, as it does when this
build could not make it (offline: no headers); so a failure here is a
warning, never a failed build.

Standard library only: setup.py imports it before anything is installed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "gpumempool", "oracle", "csrc")
DRIVER = os.path.join(ROOT, "tests", "csrc", "fake_cuda.c")
#: Where in the package the libraries go (setup.py's package_data does not
#: name them: build_ext writes them into the build directory itself).
PACKAGE_DIR = os.path.join("gpumempool", "oracle", "lib")
#: The runtime wheel whose cuda_runtime_api.h each fake runtime is compiled
#: against: struct cudaDeviceProp is fixed within a major release (1032
#: bytes in 12.x, 1008 in 13.x), so one release per major serves every torch
#: built against that major.
HEADER_WHEELS = {12: "nvidia-cuda-runtime-cu12==12.9.79", 13: "nvidia-cuda-runtime==13.0.96"}
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1", *(f"libcudart.so.{m}" for m in HEADER_WHEELS))
#: Beside them: what they were built from (the oracle compares the digests
#: with the sources it has, so that an editable install whose sources
#: changed since its build compiles them anew).
MANIFEST = "stack.json"


class StackError(RuntimeError):
    """The prebuilt stack cannot be built here; the message says why."""


def header_cache() -> str:
    """Where the runtime headers are kept: GMP_CUDA_RUNTIME_HEADERS, else
    .ci-cache/cuda-runtime in the source tree (as .ci/fetch-cuda-headers
    keeps cuda.h; tools/build-wheels.sh carries it into its copy)."""
    return os.environ.get("GMP_CUDA_RUNTIME_HEADERS") or os.path.join(ROOT, ".ci-cache", "cuda-runtime")


def requirements() -> list[str]:
    """What the build environment must have for runtime_include(): pip
    (pip's isolated build environments have none), unless every header set
    is cached already."""
    import importlib.util

    cached = all(os.path.isfile(os.path.join(header_cache(), spec.split("==")[1], "include", "cuda_runtime_api.h"))
                 for spec in HEADER_WHEELS.values())
    if cached or os.environ.get("GMP_ORACLE_PREBUILT", "1") == "0" or importlib.util.find_spec("pip") is not None:
        return []
    return ["pip"]


def runtime_include(major: int, cache: str | None = None) -> str:
    """The include directory of ``HEADER_WHEELS[major]``, downloaded into the
    cache the first time (a wheel is a zip: only its include/ is kept)."""
    spec = HEADER_WHEELS[major]
    dest = os.path.join(cache or header_cache(), spec.split("==")[1])
    include = os.path.join(dest, "include")
    if os.path.isfile(os.path.join(include, "cuda_runtime_api.h")):
        return include
    with tempfile.TemporaryDirectory(prefix="gmp-cudart-") as tmp:
        # The headers are the same in every platform's wheel: x86_64's.
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
               "--python-version", "3.12", "-d", tmp, spec]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            raise StackError(f"pip download {spec} failed: {e}") from None
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise StackError(f"pip download {spec} failed: {last}")
        staging = tempfile.mkdtemp(prefix=".include-", dir=_mkdir(dest))
        try:
            with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
                for name in z.namelist():
                    m = re.match(r"^nvidia/[^/]+/include/(.+)$", name)
                    if m and not name.endswith("/"):
                        out = os.path.join(staging, m.group(1))
                        os.makedirs(os.path.dirname(out), exist_ok=True)
                        with open(out, "wb") as f:
                            f.write(z.read(name))
            if not os.path.isfile(os.path.join(staging, "cuda_runtime_api.h")):
                raise StackError(f"{wheels[0]} has no include/cuda_runtime_api.h")
            shutil.rmtree(include, ignore_errors=True)
            os.chmod(staging, 0o755)  # mkdtemp's 0700 would stay
            os.replace(staging, include)  # whole or not at all: a second build may read it meanwhile
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return include


def source_digests() -> dict[str, str]:
    """sha256 over (path, NUL, bytes) of each source, in path order: the
    runtime's and NVML's (gpumempool/oracle/csrc) and the driver's. The
    oracle (gpumempool/oracle/_stack.py) computes the same sums."""
    import pathlib

    def digest(files: list[pathlib.Path], base: pathlib.Path) -> str:
        h = hashlib.sha256()
        for f in sorted(files, key=lambda f: f.relative_to(base).parts):
            h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes())
        return h.hexdigest()

    csrc, root = pathlib.Path(CSRC), pathlib.Path(ROOT)
    return {"csrc": digest(list(csrc.rglob("*.[ch]")), csrc),
            "driver": digest([pathlib.Path(DRIVER), root / "gocore" / "cuda" / "driver" / "cuda_types.h"], root)}


def _compile(cc: list[str], out: str, sources: list[str], *flags: str) -> None:
    cmd = [*cc, "-O1", "-shared", "-fPIC", "-pthread", "-o", out, *sources, *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise StackError(f"compiling {os.path.basename(out)} failed: {last}")


def build(cc: list[str], dest: str, cache: str | None = None) -> list[str]:
    """Builds the stack with ``cc`` (a command: a compiler and its leading
    arguments) into ``dest``; returns the files. Either all of LIBRARIES
    are there afterwards, or none (an old set is removed first: a stale
    runtime beside a new driver would be worse than compiling at run time)."""
    if not os.path.isfile(DRIVER):
        raise StackError(f"the fake driver's source {os.path.relpath(DRIVER, ROOT)} is not in this source tree")
    shutil.rmtree(dest, ignore_errors=True)
    includes = {major: runtime_include(major, cache) for major in HEADER_WHEELS}
    tmp = tempfile.mkdtemp(prefix=".build-", dir=_mkdir(os.path.dirname(os.path.abspath(dest))))
    try:
        driver = os.path.join(tmp, "libcuda.so.1")
        _compile(cc, driver, [DRIVER], "-Wl,-soname,libcuda.so.1", "-ldl")
        _compile(cc, os.path.join(tmp, "libnvidia-ml.so.1"), [os.path.join(CSRC, "fake_nvml.c")],
                 "-Wl,-soname,libnvidia-ml.so.1")
        for major, include in includes.items():
            soname = f"libcudart.so.{major}"
            # The version node torch's libraries ask their runtime symbols
            # under (the runtime's SONAME, in every release so far).
            script = os.path.join(tmp, f"cudart{major}.map")
            with open(script, "w", encoding="utf-8") as f:
                f.write(f"{soname} {{ global: cuda*; __cuda*; local: *; }};\n")
            # The driver by its path: DT_NEEDED is its SONAME, found at run
            # time through RPATH $ORIGIN (the same directory).
            _compile(cc, os.path.join(tmp, soname),
                     [os.path.join(CSRC, "fake_cudart.c"), os.path.join(CSRC, "cudart_props.c"), driver],
                     f"-I{CSRC}", f"-I{include}", f"-DGMP_CUDART_VERSION={major * 1000}",
                     f"-Wl,-soname,{soname}", f"-Wl,--version-script={script}", "-fvisibility=hidden",
                     "-Wl,--disable-new-dtags,-rpath,$ORIGIN", "-ldl")
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"libraries": list(LIBRARIES), "sources": source_digests(),
                       "headers": {str(m): spec for m, spec in HEADER_WHEELS.items()}},
                      f, indent=1)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would reach the installed package
        os.replace(tmp, dest)
        tmp = ""
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    for name in os.listdir(dest):
        if name not in (*LIBRARIES, MANIFEST):
            os.remove(os.path.join(dest, name))
    return [os.path.join(dest, n) for n in (*LIBRARIES, MANIFEST)]


def _mkdir(p: str) -> str:
    os.makedirs(p, exist_ok=True)
    return p
