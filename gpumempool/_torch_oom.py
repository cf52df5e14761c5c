"""Build and load torch_oom.cpp, the shim that makes out-of-memory in
full-replacement mode a ``torch.OutOfMemoryError``
(``gmp.set_torch_allocator(pool, oom_error="torch")``).

Why a shim compiled at run time: torch raises ``torch.OutOfMemoryError``
only for a C++ ``c10::OutOfMemoryError``, whose type lives in libc10's C++
ABI (the torch in the process, its headers, its ``_GLIBCXX_USE_CXX11_ABI``).
The extension is built by Go's toolchain once for every torch, so it throws
``std::runtime_error`` (a ``RuntimeError``). The shim is a few lines,
compiled once per torch and compiler into a cache directory
(``$GMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpumempool``, else
``~/.cache/gpumempool``) in about a second, and reused from there. A cache
that cannot be written (and lacks the build) falls back to a directory of
the user's own under the system's temporary directory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ._errors import GpuMemPoolError

ALLOC_SYMBOL = "gmp_torch_oom_alloc"
FREE_SYMBOL = "gmp_torch_oom_free"
SOURCE = Path(__file__).with_name("torch_oom.cpp")
COMPILE_TIMEOUT_S = 300


class ShimBuildError(GpuMemPoolError, RuntimeError):
    """The shim could not be built or loaded; the message says why and
    what to do (torch.py raises it as a TorchIntegrationError)."""


def cache_dir() -> Path:
    """Where built shims are kept."""
    if os.environ.get("GMP_CACHE_DIR"):
        return Path(os.environ["GMP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpumempool"


def compiler() -> list[str]:
    """The C++ compiler command: ``$CXX`` (may carry flags), else c++, g++
    or clang++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shlex.split(cxx)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    raise ShimBuildError(
        "oom_error='torch' compiles a small C++ shim against torch's headers, and no C++ compiler was found "
        "(set CXX, or install g++); oom_error='runtime' needs none"
    )


def _torch_paths(torch: Any) -> tuple[Path, Path]:
    where = getattr(torch, "__file__", None)
    if not where:
        raise ShimBuildError("oom_error='torch' needs torch's C++ headers, and this torch module has no __file__ "
                             "to find them by; oom_error='runtime' needs none")
    root = Path(where).resolve().parent
    include, lib = root / "include", root / "lib"
    version = getattr(torch, "__version__", "?")
    if not (include / "c10" / "util" / "Exception.h").is_file():
        raise ShimBuildError(
            f"oom_error='torch' needs torch's C++ headers, and torch {version} at {root} "
            "ships none (include/c10/util/Exception.h); oom_error='runtime' needs none"
        )
    if not (lib / "libc10.so").is_file():
        raise ShimBuildError(f"oom_error='torch' links against torch's libc10, and torch {version} at {root} has no "
                             "lib/libc10.so; oom_error='runtime' needs none")
    return include, lib


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=d, prefix=".probe-")
    except OSError:
        return False
    probe.close()
    return True


def _private_dir() -> Path:
    """The fallback cache: <tmp>/gpumempool-<uid>, made 0700 and used only
    when it is the user's own and nobody else can write it (else a fresh
    directory, as another user may have planted a library there)."""
    d = Path(tempfile.gettempdir()) / f"gpumempool-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return d
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="gpumempool-"))


def _plan(torch: Any) -> tuple[Path, Path, list[str], int, str]:
    """What a build for this torch uses: include and lib directories, the
    compiler, the ABI flag and the library's file name (keyed by all of
    them and the source)."""
    include, lib = _torch_paths(torch)
    cxx = compiler()
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), str(getattr(torch, "__version__", "")).encode(), str(lib).encode(),
                    str(abi).encode(), " ".join(cxx).encode()])
    ).hexdigest()[:16]
    return include, lib, cxx, abi, f"torch_oom-{key}.so"


def readiness(torch: Any) -> tuple[bool, str]:
    """Whether ``oom_error="torch"`` can work with this torch, and how (for
    ``python -m gpumempool info``); builds nothing."""
    try:
        _, _, cxx, _, name = _plan(torch)
    except ShimBuildError as exc:
        return False, str(exc)
    if (cache_dir() / name).is_file():
        return True, f"built ({cache_dir() / name})"
    return True, f"builds on first use with {shlex.join(cxx)} (about a second), cached in {cache_dir()}"


def build(torch: Any, *, rebuild: bool = False) -> Path:
    """The shim for this torch, built unless a cached build exists (or
    ``rebuild``).

    Several processes (torchrun's ranks) may build at once: each compiles
    to a file of its own and renames it into place, so every one loads a
    whole library."""
    include, lib, cxx, abi, name = _plan(torch)
    where = cache_dir()
    if not rebuild and (where / name).is_file():  # a read-only cache that has it will do
        return where / name
    if not _writable(where):
        where = _private_dir()
    out = where / name
    if not rebuild and out.is_file():
        return out
    fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name}-")
    os.close(fd)
    cmd = [*cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}",
           str(SOURCE), "-o", tmp, f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        Path(tmp).unlink(missing_ok=True)  # the linker removes its output when it fails
        raise ShimBuildError(f"building the torch out-of-memory shim failed ({shlex.join(cmd)}): {exc}") from exc
    if done.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        raise ShimBuildError(
            f"building the torch out-of-memory shim failed (exit {done.returncode}): {shlex.join(cmd)}\n"
            f"{done.stderr[-3000:]}"
        )
    os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared GMP_CACHE_DIR out
    os.replace(tmp, out)
    return out


def install(torch: Any, library_path: str, alloc_symbol: str, free_symbol: str) -> tuple[str, str, str]:
    """Build (or find) and load the shim, point it at the extension's
    ``alloc_symbol``/``free_symbol`` and return what torch's
    ``CUDAPluggableAllocator`` takes: the shim's path and its two symbols."""
    path = build(torch)
    try:
        shim = ctypes.CDLL(str(path))
    except OSError:  # a damaged cached build: build it again, once
        path = build(torch, rebuild=True)
        try:
            shim = ctypes.CDLL(str(path))
        except OSError as exc:  # e.g. a torch whose libc10 differs from the headers
            raise ShimBuildError(f"loading the torch out-of-memory shim {path} failed: {exc}") from exc
    ext = ctypes.CDLL(library_path)  # the extension, already loaded: the same handle
    alloc = ctypes.cast(getattr(ext, alloc_symbol), ctypes.c_void_p)
    free = ctypes.cast(getattr(ext, free_symbol), ctypes.c_void_p)
    shim.gmp_torch_oom_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    if shim.gmp_torch_oom_install(alloc, free) != 0:
        raise ShimBuildError(f"the torch out-of-memory shim refused {alloc_symbol}/{free_symbol}")
    return str(path), ALLOC_SYMBOL, FREE_SYMBOL
