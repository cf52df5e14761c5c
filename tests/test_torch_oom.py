"""The out-of-memory shim of ``set_torch_allocator(pool, oom_error="torch")``
(gpumempool/torch/_oom.py): how it is built, cached and refused.

Most tests build it against a stand-in torch tree (a two-line c10 header and
an empty libc10), so they run without torch; the last one builds it against
the installed torch and loads it. What it throws is tested from C++ in
test_torch_replacement.py, and on a GPU in test_torch_gpu.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from gpumempool.torch import _oom as _torch_oom

STAND_IN_HEADER = """#pragma once
#include <stdexcept>
#include <string>
namespace c10 { struct OutOfMemoryError : std::runtime_error { using std::runtime_error::runtime_error; }; }
#define C10_THROW_ERROR(err_type, msg) throw ::c10::err_type(msg)
#define TORCH_CHECK(cond, msg) if (!(cond)) throw std::runtime_error(msg)
"""


@pytest.fixture()
def fake_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A torch module whose tree holds a stand-in c10 header and libc10."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler")
    root = tmp_path / "torch"
    (root / "include" / "c10" / "util").mkdir(parents=True)
    (root / "include" / "c10" / "util" / "Exception.h").write_text(STAND_IN_HEADER)
    (root / "lib").mkdir()
    (root / "empty.cpp").write_text("")
    subprocess.run([cxx, "-shared", "-fPIC", "-o", str(root / "lib" / "libc10.so"), str(root / "empty.cpp")],
                   check=True)
    monkeypatch.setenv("GMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CXX", raising=False)
    return types.SimpleNamespace(__file__=str(root / "__init__.py"), __version__="9.9.0+fake",
                                 _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_the_source_is_installed_with_the_package() -> None:
    assert _torch_oom.SOURCE.is_file()
    text = _torch_oom.SOURCE.read_text()
    for sym in (_torch_oom.ALLOC_SYMBOL, _torch_oom.FREE_SYMBOL, "gmp_torch_oom_install"):
        assert f" {sym}(" in text


def test_built_once_then_taken_from_the_cache(fake_torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _torch_oom.build(fake_torch)
    assert path.parent == tmp_path / "cache" and _files(path.parent) == [path.name]
    lib = ctypes.CDLL(str(path))
    assert lib.gmp_torch_oom_install(None, None) == -1  # NULL entry points are refused

    def no_compiler(*args: Any, **kw: Any) -> Any:
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert _torch_oom.build(fake_torch) == path
    fake_torch.__version__ = "9.9.1"
    with pytest.raises(AssertionError, match="compiled again"):
        _torch_oom.build(fake_torch)


def test_another_torch_or_compiler_is_another_build(fake_torch: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    names = {_torch_oom._plan(fake_torch)[1]}

    def changed(what: str) -> None:
        name = _torch_oom._plan(fake_torch)[1]
        assert name not in names, f"{what} kept the name"
        names.add(name)

    fake_torch.__version__ = "9.9.1"
    changed("torch's version")
    fake_torch._C._GLIBCXX_USE_CXX11_ABI = False
    changed("the ABI flag")
    moved = tmp_path / "elsewhere" / "torch"
    shutil.copytree(Path(fake_torch.__file__).parent, moved)
    fake_torch.__file__ = str(moved / "__init__.py")
    changed("torch's place")
    monkeypatch.setenv("CXX", (shutil.which("c++") or "g++") + " -O1")
    changed("the compiler command")
    (tmp_path / "torch_oom.cpp").write_text(_torch_oom.SOURCE.read_text() + "// changed\n")
    monkeypatch.setattr(_torch_oom, "SOURCE", tmp_path / "torch_oom.cpp")
    changed("the source")


def test_readiness_says_what_a_build_would_do(fake_torch: Any, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ok, how = _torch_oom.readiness(fake_torch)
    assert ok and how.startswith("builds on first use with ") and str(tmp_path / "cache") in how
    assert not (tmp_path / "cache").exists()  # nothing built or made
    path = _torch_oom.build(fake_torch)
    assert _torch_oom.readiness(fake_torch) == (True, f"built ({path})")
    monkeypatch.setenv("PATH", "")
    ok, how = _torch_oom.readiness(fake_torch)
    assert not ok and "no C++ compiler" in how


def test_processes_building_at_once_each_load_a_whole_library(fake_torch: Any) -> None:
    paths: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            paths.append(_torch_oom.build(fake_torch))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(set(paths)) == 1 and len(paths) == 4
    assert _files(paths[0].parent) == [paths[0].name]  # no temporary file left behind
    assert ctypes.CDLL(str(paths[0])).gmp_torch_oom_install(None, None) == -1


def test_a_failed_compile_says_why_and_leaves_nothing(fake_torch: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    header = Path(fake_torch.__file__).parent / "include" / "c10" / "util" / "Exception.h"
    header.write_text("#error this torch's headers are broken\n")
    with pytest.raises(_torch_oom.ShimBuildError, match=r"(?s)failed \(exit 1\).*headers are broken"):
        _torch_oom.build(fake_torch)
    assert _files(tmp_path / "cache") == []
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler") + " -O0")
    with pytest.raises(_torch_oom.ShimBuildError, match="no-such-compiler -O0"):
        _torch_oom.build(fake_torch)
    assert _files(tmp_path / "cache") == []


def test_no_compiler_or_no_headers_is_a_clear_error(fake_torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(_torch_oom.ShimBuildError, match="no C\\+\\+ compiler was found.*oom_error='runtime'"):
        _torch_oom.build(fake_torch)
    monkeypatch.undo()
    headerless = types.SimpleNamespace(__file__="/nonexistent/torch/__init__.py", __version__="2.11.0")
    with pytest.raises(_torch_oom.ShimBuildError, match="torch 2.11.0 at /nonexistent/torch ships none"):
        _torch_oom.build(headerless)
    with pytest.raises(_torch_oom.ShimBuildError, match="no __file__"):
        _torch_oom.build(types.ModuleType("torch"))


def test_a_broken_libc10_fails_to_link_and_leaves_nothing(fake_torch: Any, tmp_path: Path) -> None:
    # The linker removes its own output when it fails.
    (Path(fake_torch.__file__).parent / "lib" / "libc10.so").write_text("not a library")
    with pytest.raises(_torch_oom.ShimBuildError, match=r"(?s)failed \(exit 1\).*libc10"):
        _torch_oom.build(fake_torch)
    assert _files(tmp_path / "cache") == []
    (Path(fake_torch.__file__).parent / "lib" / "libc10.so").unlink()
    with pytest.raises(_torch_oom.ShimBuildError, match="has no lib/libc10.so"):
        _torch_oom.build(fake_torch)


def test_an_unusable_cache_falls_back_to_a_private_directory(fake_torch: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GMP_CACHE_DIR", str(blocker / "cache"))  # cannot be made: a file is in the way
    path = _torch_oom.build(fake_torch)
    private = tmp_path / "tmp" / f"gpumempool-{os.getuid()}"
    assert path.parent == private and path.is_file()
    assert oct(private.stat().st_mode & 0o777) == oct(0o700)
    assert _torch_oom.build(fake_torch) == path  # reused by the next process
    assert _torch_oom.readiness(fake_torch) == (True, f"built ({path})")
    # A directory others can write is not trusted; the next name is tried,
    # and the same one is used again by the next process.
    private.chmod(0o777)
    other = _torch_oom.build(fake_torch)
    assert other.parent == tmp_path / "tmp" / f"gpumempool-{os.getuid()}-1"
    assert _torch_oom.build(fake_torch) == other
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == [private.name, other.parent.name]
    # Every private name taken by others: a clear error, nothing made.
    for n in range(1, _torch_oom.PRIVATE_NAMES):
        squatted = tmp_path / "tmp" / f"gpumempool-{os.getuid()}-{n}"
        squatted.mkdir(exist_ok=True)
        squatted.chmod(0o777)
    with pytest.raises(_torch_oom.ShimBuildError, match=r"none is usable .*writable by other users.*set GMP_CACHE_DIR"):
        _torch_oom.build(fake_torch)
    ok, why = _torch_oom.readiness(fake_torch)
    assert not ok and "set GMP_CACHE_DIR" in why


def test_a_library_others_could_have_planted_is_never_loaded(fake_torch: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A file in a directory others can write (or above which a directory
    others can write, not sticky, lies), or a file others can write, may be
    theirs: it is neither loaded nor reported as built."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    name = _torch_oom._plan(fake_torch)[1]
    planted = b"planted by another user"

    def plant(d: Path) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(planted)
        return d / name

    private = tmp_path / "tmp" / f"gpumempool-{os.getuid()}"
    for cache, opened in [(tmp_path / "shared", tmp_path / "shared"),  # the cache itself
                          (tmp_path / "open" / "cache", tmp_path / "open")]:  # a directory above it
        monkeypatch.setenv("GMP_CACHE_DIR", str(cache))
        bait = plant(cache)
        opened.chmod(0o777)
        assert not _torch_oom.readiness(fake_torch)[1].startswith("built")
        path = _torch_oom.build(fake_torch)
        assert path.parent == private and path.read_bytes() != planted
        assert bait.read_bytes() == planted
        path.unlink()
    # A sticky directory above (like /tmp) is fine: others cannot replace what is ours in it.
    (tmp_path / "open").chmod(0o1777)
    monkeypatch.setenv("GMP_CACHE_DIR", str(tmp_path / "open" / "cache"))
    (tmp_path / "open" / "cache" / name).unlink()
    assert _torch_oom.build(fake_torch).parent == tmp_path / "open" / "cache"
    # A file others can write, in a directory of ours.
    monkeypatch.setenv("GMP_CACHE_DIR", str(tmp_path / "mine"))
    bait = plant(tmp_path / "mine")
    bait.chmod(0o666)
    assert _torch_oom.build(fake_torch) == tmp_path / "mine" / name  # built again over it
    assert bait.read_bytes() != planted and oct(bait.stat().st_mode & 0o777) == oct(0o755)
    if os.getuid() == 0:  # a file of another user, with harmless modes
        (tmp_path / "theirs").mkdir()
        monkeypatch.setenv("GMP_CACHE_DIR", str(tmp_path / "theirs"))
        bait = plant(tmp_path / "theirs")
        os.chown(bait, 4321, 4321)
        assert _torch_oom.build(fake_torch) == tmp_path / "theirs" / name
        assert os.stat(bait).st_uid == 0


def test_a_noexec_cache_is_not_used(fake_torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cache = tmp_path / "cache"
    real_statvfs = os.statvfs

    def statvfs(path: Any) -> Any:
        st = real_statvfs(path)
        if str(path).startswith(str(cache)) or str(path) == str(tmp_path):
            return types.SimpleNamespace(f_flag=st.f_flag | os.ST_NOEXEC)
        return st

    monkeypatch.setattr(os, "statvfs", statvfs)
    path = _torch_oom.build(fake_torch)
    assert path.parent == tmp_path / "tmp" / f"gpumempool-{os.getuid()}"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the private directories are noexec too
    with pytest.raises(_torch_oom.ShimBuildError, match=r"mounted noexec.*set GMP_CACHE_DIR"):
        _torch_oom.build(fake_torch)


def test_a_read_only_cache_that_has_the_build_is_used(fake_torch: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _torch_oom.build(fake_torch)
    assert oct(path.stat().st_mode & 0o777) == oct(0o755)
    monkeypatch.setattr(_torch_oom, "_build_dir", lambda **kw: pytest.fail("wanted to build"))
    assert _torch_oom.build(fake_torch) == path


def test_a_damaged_cached_build_is_built_again(fake_torch: Any) -> None:
    import gpumempool as gmp

    path = _torch_oom.build(fake_torch)
    path.write_bytes(b"\x7fELF truncated")
    with gmp.MemPool("sim", capacity=1 << 26) as pool:
        lib, alloc_sym, free_sym = pool.pluggable_symbols(throw_on_oom=True)
        shim_path, a, f = _torch_oom.install(fake_torch, lib, alloc_sym, free_sym)
    assert shim_path == str(path) and (a, f) == (_torch_oom.ALLOC_SYMBOL, _torch_oom.FREE_SYMBOL)
    assert path.stat().st_size > 1000


def test_a_damaged_build_in_a_read_only_cache_is_built_once(fake_torch: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The build made beside it in the private directory is found by the
    next process, which does not compile again."""
    import gpumempool as gmp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    damaged = _torch_oom.build(fake_torch)
    damaged.write_bytes(b"\x7fELF truncated")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p).startswith(str(damaged.parent)) else real_access(p, m))
    compiles = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: compiles.append(a) or real_run(*a, **k))
    with gmp.MemPool("sim", capacity=1 << 26) as pool:
        lib, alloc_sym, free_sym = pool.pluggable_symbols(throw_on_oom=True)
        for _ in range(2):
            shim_path, _, _ = _torch_oom.install(fake_torch, lib, alloc_sym, free_sym)
            assert Path(shim_path).parent == tmp_path / "tmp" / f"gpumempool-{os.getuid()}"
    assert len(compiles) == 1
    assert damaged.read_bytes() == b"\x7fELF truncated"


def test_an_interrupted_compile_leaves_nothing(fake_torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _torch_oom.build(fake_torch)
    assert _files(tmp_path / "cache") == []


def test_the_cache_directory_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMP_CACHE_DIR", "/x/gmp")
    assert _torch_oom.cache_dir() == Path("/x/gmp")
    monkeypatch.setenv("GMP_CACHE_DIR", "relative/gmp")
    with pytest.raises(_torch_oom.ShimBuildError, match="GMP_CACHE_DIR must be an absolute path, not 'relative/gmp'"):
        _torch_oom.cache_dir()
    monkeypatch.delenv("GMP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/xdg")
    assert _torch_oom.cache_dir() == Path("/x/xdg/gpumempool")
    monkeypatch.setenv("HOME", "/x/home")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG spec says
    assert _torch_oom.cache_dir() == Path("/x/home/.cache/gpumempool")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _torch_oom.cache_dir() == Path("/x/home/.cache/gpumempool")
    # No home to be found ("~" stays "~"): never a directory relative to the current one.
    monkeypatch.setattr(os.path, "expanduser", lambda p: p)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert _torch_oom.cache_dir() == tmp_path / f"gpumempool-{os.getuid()}"


def test_built_against_the_installed_torch(torch_headers: tuple[Path, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The real headers and libc10, with the installed torch's ABI flag: the
    library loads (a wrong ABI would leave c10's constructor unresolved)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("GMP_CACHE_DIR", str(tmp_path))
    path = _torch_oom.build(torch)
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW)
    assert lib.gmp_torch_oom_install(None, None) == -1


TORCH_OOM_SCRIPT = """
import sys, torch, gpumempool as gmp
pool = gmp.MemPool("sim", capacity=1 << 28)
gmp.set_torch_allocator(pool, oom_error=sys.argv[1])
pool.set_limit(8 << 20, 0)
ptr = torch._C._cuda_cudaCachingAllocator_raw_alloc(4096, 0)
assert pool.stats()["allocated_bytes.all.current"] == 4096
torch._C._cuda_cudaCachingAllocator_raw_delete(ptr)
try:
    torch._C._cuda_cudaCachingAllocator_raw_alloc(64 << 20, 0)
except BaseException as exc:
    print(type(exc).__name__, isinstance(exc, torch.OutOfMemoryError), isinstance(exc, RuntimeError), str(exc)[:60])
"""


@pytest.mark.parametrize("oom_error", ["torch", "runtime"])
def test_real_torch_raises_its_out_of_memory_error(oom_error: str, fake_gpu_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    """The whole path through the installed torch, without a GPU: torch's
    CUDAPluggableAllocator calls the shim (or the extension), which calls a
    sim pool over its limit; torch must raise torch.OutOfMemoryError for
    oom_error="torch" and a plain RuntimeError for "runtime". The CUDA
    runtime's device queries are answered by tests/csrc/fake_cudart.c."""
    env = {**fake_gpu_env, "GMP_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", TORCH_OOM_SCRIPT, oom_error], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    want = "OutOfMemoryError True True" if oom_error == "torch" else "RuntimeError False True"
    assert r.stdout.strip() == f"{want} CUDA out of memory. Tried to allocate 64.00 MiB on device 0."
