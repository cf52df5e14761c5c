"""The out-of-memory shim of ``set_torch_allocator(pool, oom_error="torch")``
(gpumempool/_torch_oom.py): how it is built, cached and refused.

Most tests build it against a stand-in torch tree (a two-line c10 header and
an empty libc10), so they run without torch; the last one builds it against
the installed torch and loads it. What it throws is tested from C++ in
test_torch_logic.py, and on a GPU in test_torch_gpu.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from gpumempool import _torch_oom

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
    # Another torch (version, place or ABI) or another compiler is another build.
    fake_torch.__version__ = "9.9.1"
    with pytest.raises(AssertionError, match="compiled again"):
        _torch_oom.build(fake_torch)


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


def test_an_unwritable_cache_falls_back_to_a_private_directory(fake_torch: Any, tmp_path: Path,
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
    # A directory others can write is not trusted: a fresh one instead.
    private.chmod(0o777)
    other = _torch_oom.build(fake_torch)
    assert other.parent != private and other.parent.parent == tmp_path / "tmp"


def test_a_read_only_cache_that_has_the_build_is_used(fake_torch: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _torch_oom.build(fake_torch)
    assert oct(path.stat().st_mode & 0o777) == oct(0o755)  # loadable by other users of a shared cache
    monkeypatch.setattr(_torch_oom, "_writable", lambda d: False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
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


def test_the_cache_directory_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMP_CACHE_DIR", "/x/gmp")
    assert _torch_oom.cache_dir() == Path("/x/gmp")
    monkeypatch.delenv("GMP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/xdg")
    assert _torch_oom.cache_dir() == Path("/x/xdg/gpumempool")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/x/home")
    assert _torch_oom.cache_dir() == Path("/x/home/.cache/gpumempool")


def test_built_against_the_installed_torch(torch_headers: tuple[Path, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The real headers and libc10, with the installed torch's ABI flag: the
    library loads (a wrong ABI would leave c10's constructor unresolved)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("GMP_CACHE_DIR", str(tmp_path))
    path = _torch_oom.build(torch)
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW)
    assert lib.gmp_torch_oom_install(None, None) == -1
