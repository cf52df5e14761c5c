"""Build and load csrc/torch_oom.cpp, the shim that makes out-of-memory in
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
that cannot be used falls back to a directory of the user's own under the
system's temporary directory.

A library in the cache runs in every process that loads it, so a directory
is used only when nobody but the user (or root) could have put a file there:
it and every directory above it belong to the user or root and are writable
by nobody else (above it, sticky directories such as /tmp are fine), and
the library file is the user's or root's and writable by nobody else. A
shared cache writable by a group is therefore not used. Nor is one on a file
system mounted noexec, where no library could be loaded.
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

from .._errors import GpuMemPoolError

ALLOC_SYMBOL = "gmp_torch_oom_alloc"
FREE_SYMBOL = "gmp_torch_oom_free"
#: The shim's source, shipped with the package (gpumempool/csrc/).
SOURCE = Path(__file__).parent.parent / "csrc" / "torch_oom.cpp"
COMPILE_TIMEOUT_S = 300
PRIVATE_NAMES = 4


class ShimBuildError(GpuMemPoolError, RuntimeError):
    """The shim could not be built or loaded; the message says why and
    what to do (set_torch_allocator then warns and falls back to
    ``oom_error="runtime"``)."""


def _locations() -> list[Path]:
    """The cache directories, most preferred first: ``$GMP_CACHE_DIR`` (which
    must be absolute), else ``$XDG_CACHE_HOME/gpumempool`` or
    ``~/.cache/gpumempool`` (relative ones are ignored, as the XDG spec says,
    so a build never lands in whatever the current directory is), then
    directories of the user's own under the system's temporary directory."""
    env = os.environ.get("GMP_CACHE_DIR")
    if env:
        if not os.path.isabs(env):
            raise ShimBuildError(f"GMP_CACHE_DIR must be an absolute path, not {env!r}")
        first = [Path(env)]
    else:
        xdg, home = os.environ.get("XDG_CACHE_HOME", ""), os.path.expanduser("~")
        if os.path.isabs(xdg):
            first = [Path(xdg) / "gpumempool"]
        elif os.path.isabs(home):  # "~" stays "~" when no home can be found
            first = [Path(home) / ".cache" / "gpumempool"]
        else:
            first = []
    tmp, uid = Path(tempfile.gettempdir()), os.getuid()
    # Other users may have made the first private name first: a few more.
    return first + [tmp / f"gpumempool-{uid}"] + [tmp / f"gpumempool-{uid}-{n}" for n in range(1, PRIVATE_NAMES)]


def cache_dir() -> Path:
    """The preferred cache directory (whether or not it is usable)."""
    return _locations()[0]


def _distrust(path: str, st: os.stat_result, *, sticky_ok: bool) -> str:
    """Why another user could have put a file at ``path``, or ""."""
    if st.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by other users"
    return ""


def _check_dir(d: Path) -> tuple[str, str]:
    """The real path of ``d`` and why a library there cannot be trusted or
    run ("" when it can): ``d`` and every directory above it must belong to
    the user or root and be writable by nobody else (above it, sticky
    directories such as /tmp are fine), and its file system must allow
    executables. A missing ``d`` is judged by its nearest existing parent."""
    real = os.path.realpath(d)
    p, own = real, True
    while not os.path.lexists(p):
        p, own = os.path.dirname(p), False
    existing = p
    try:
        if not os.path.isdir(p):
            return real, f"{p} is not a directory"
        while True:
            why = _distrust(p, os.stat(p), sticky_ok=not own)
            if why:
                return real, why
            parent, own = os.path.dirname(p), False
            if parent == p:
                break
            p = parent
        if os.statvfs(existing).f_flag & os.ST_NOEXEC:
            return real, f"{real} is on a file system mounted noexec"
    except OSError as exc:
        return real, f"{real}: {exc.strerror or exc}"
    return real, ""


def _trusted_file(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and not _distrust(str(path), st, sticky_ok=False)


def _builds(name: str) -> list[Path]:
    """The builds called ``name`` found in trusted cache directories."""
    found = []
    for d in _locations():
        real, why = _check_dir(d)
        if not why and _trusted_file(Path(real) / name):
            found.append(Path(real) / name)
    return found


def _build_dir(*, create: bool = True) -> Path:
    """The first cache directory a build may be written to and run from
    (made, mode 0700, when missing and ``create``)."""
    refused = []
    for d in _locations():
        real, why = _check_dir(d)
        if not why and create:
            try:
                os.makedirs(real, mode=0o700, exist_ok=True)
                real, why = _check_dir(Path(real))  # made meanwhile by someone else?
            except OSError as exc:
                why = f"{real}: {exc.strerror or exc}"
        if not why and not os.access(real if os.path.isdir(real) else os.path.dirname(real), os.W_OK):
            why = f"{real} is not writable"
        if not why:
            return Path(real)
        refused.append(why)
    raise ShimBuildError(
        "oom_error='torch' compiles a small C++ shim and keeps it in a cache directory, and none is usable ("
        + "; ".join(refused) + "): set GMP_CACHE_DIR to a directory of your own on a file system that allows "
        "executables; oom_error='runtime' needs none"
    )


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


_OUTPUT = "{output}"


def _plan(torch: Any) -> tuple[list[str], str]:
    """The compile command for this torch (``_OUTPUT`` standing for the
    output file) and the library's file name, keyed by the source, the
    command (compiler, flags, torch's include and lib directories, its ABI
    flag) and torch's version."""
    include, lib = _torch_paths(torch)
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    # -Xlinker passes the rpath whole; -Wl,-rpath,DIR would split a DIR with a comma.
    cmd = [*compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}",
           str(SOURCE), "-o", _OUTPUT, f"-L{lib}", "-lc10", "-Xlinker", "-rpath", "-Xlinker", str(lib)]
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), str(getattr(torch, "__version__", "")).encode(),
                    *(a.encode() for a in cmd if a != str(SOURCE))])
    ).hexdigest()[:16]
    return cmd, f"torch_oom-{key}.so"


def readiness(torch: Any) -> tuple[bool, str]:
    """Whether ``oom_error="torch"`` can work with this torch, and how (for
    ``python -m gpumempool info``); builds and makes nothing."""
    try:
        cmd, name = _plan(torch)
        found = _builds(name)
        if found:
            return True, f"built ({found[0]})"
        where = _build_dir(create=False)
    except ShimBuildError as exc:
        return False, str(exc)
    cxx = cmd[:cmd.index("-O2")]
    return True, f"builds on first use with {shlex.join(cxx)} (about a second), cached in {where}"


def build(torch: Any, *, rebuild: bool = False) -> Path:
    """The shim for this torch: the first trusted cached build, else (or
    with ``rebuild``) one compiled into the first usable cache directory.

    Several processes (torchrun's ranks) may build at once: each compiles
    to a file of its own and renames it into place, so every one loads a
    whole library."""
    cmd, name = _plan(torch)
    if not rebuild:
        found = _builds(name)
        if found:
            return found[0]
    where = _build_dir()
    out = where / name
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name}-")
        os.close(fd)
        cmd = [tmp if a == _OUTPUT else a for a in cmd]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ShimBuildError(f"building the torch out-of-memory shim failed ({shlex.join(cmd)}): {exc}") from exc
        if done.returncode != 0:
            raise ShimBuildError(
                f"building the torch out-of-memory shim failed (exit {done.returncode}): {shlex.join(cmd)}\n"
                f"{done.stderr[-3000:]}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
        tmp = ""
    except OSError as exc:
        raise ShimBuildError(f"writing the torch out-of-memory shim to {where} failed: {exc} "
                             "(GMP_CACHE_DIR chooses the directory)") from exc
    finally:
        if tmp:  # failed or interrupted (the linker removes its own output, not mkstemp's)
            Path(tmp).unlink(missing_ok=True)
    return out


def install(torch: Any, library_path: str, alloc_symbol: str, free_symbol: str) -> tuple[str, str, str]:
    """Build (or find) and load the shim, point it at the extension's
    ``alloc_symbol``/``free_symbol`` and return what torch's
    ``CUDAPluggableAllocator`` takes: the shim's path and its two symbols."""
    _, name = _plan(torch)
    shim = None
    failed = []
    for path in _builds(name):
        try:
            shim = ctypes.CDLL(str(path))
            break
        except OSError as exc:  # a damaged build: try the next, else build one
            failed.append(f"{path}: {exc}")
    if shim is None:
        path = build(torch, rebuild=True)
        try:
            shim = ctypes.CDLL(str(path))
        except OSError as exc:  # e.g. a torch whose libc10 differs from the headers
            failed.append(f"{path}: {exc}")
            raise ShimBuildError(f"loading the torch out-of-memory shim failed: {'; '.join(failed)}") from exc
    ext = ctypes.CDLL(library_path)  # the extension, already loaded: the same handle
    alloc = ctypes.cast(getattr(ext, alloc_symbol), ctypes.c_void_p)
    free = ctypes.cast(getattr(ext, free_symbol), ctypes.c_void_p)
    shim.gmp_torch_oom_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    if shim.gmp_torch_oom_install(alloc, free) != 0:
        raise ShimBuildError(f"the torch out-of-memory shim refused {alloc_symbol}/{free_symbol}")
    return str(path), ALLOC_SYMBOL, FREE_SYMBOL
