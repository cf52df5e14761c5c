"""The build's prebuilt oracle stack (buildtools/gmp_oracle_stack.py, run by
setup.py's build_ext): where the CUDA runtime headers come from, what a
failure leaves (nothing: the build then goes on without the stack), and
that the digests it records are the ones the oracle checks
(gpumempool/oracle/_stack.py). What an installed package holds is
tests/test_oracle_prebuilt.py's."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def st(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("gmp_oracle_stack_under_test",
                                                  ROOT / "buildtools" / "gmp_oracle_stack.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    monkeypatch.delenv("GMP_ORACLE_PREBUILT", raising=False)
    return mod


def _cached_headers(st: ModuleType) -> str:
    """The header cache of this checkout when it holds both releases (a
    build filled it), else skip: these tests download nothing."""
    cache = st.header_cache()
    if not all((Path(cache) / spec.split("==")[1] / "include" / "cuda_runtime_api.h").is_file()
               for spec in st.HEADER_WHEELS.values()):
        pytest.skip(f"no CUDA runtime headers in {cache} (a build with network access fetches them)")
    return cache


def test_offline_the_headers_are_one_error_naming_the_wheel(st: ModuleType, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(st.StackError, match=r"pip download nvidia-cuda-runtime-cu12==12\.9\.79 failed: ") as err:
        st.runtime_include(12, str(tmp_path / "cache"))
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "cache").rglob("*.h"))


def test_pip_is_a_build_requirement_only_when_headers_must_be_downloaded(st: ModuleType, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMP_CUDA_RUNTIME_HEADERS", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    assert st.requirements() == ["pip"]  # pip's isolated build environments have no pip
    monkeypatch.setenv("GMP_ORACLE_PREBUILT", "0")
    assert st.requirements() == []
    monkeypatch.delenv("GMP_ORACLE_PREBUILT")
    for spec in st.HEADER_WHEELS.values():
        d = tmp_path / spec.split("==")[1] / "include"
        d.mkdir(parents=True)
        (d / "cuda_runtime_api.h").write_text("")
    assert st.requirements() == []


def test_a_failed_compile_leaves_no_stack(st: ModuleType, tmp_path: Path) -> None:
    _cached_headers(st)
    dest = tmp_path / "pkg" / "lib"
    dest.mkdir(parents=True)
    (dest / "libcuda.so.1").write_text("an older build's")
    with pytest.raises(st.StackError, match=r"compiling libcuda\.so\.1 failed"):
        st.build(["/bin/false"], str(dest))
    assert not dest.exists() and os.listdir(tmp_path / "pkg") == []


def test_the_built_stack_is_what_the_oracle_accepts(st: ModuleType, tmp_path: Path) -> None:
    """Built with this machine's cc: the manifest's digests are the ones
    the oracle computes over the same sources, so it is not refused as
    stale; and the oracle's checks pass for both majors."""
    _cached_headers(st)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    dest = tmp_path / "lib"
    files = st.build([cc], str(dest))
    assert sorted(Path(f).name for f in files) == sorted([*st.LIBRARIES, st.MANIFEST])
    assert oct(dest.stat().st_mode & 0o777) == oct(0o755)
    from gpumempool.oracle import _stack

    manifest = json.loads((dest / "stack.json").read_text())
    if _stack._CHECKOUT != ROOT:
        pytest.skip("gpumempool is not installed from this checkout (the digests cover its sources)")
    assert manifest["sources"] == _stack._source_digests()
    (tmp_path / "torch" / "lib").mkdir(parents=True)
    for major in (12, 13):
        torch = _stack.TorchInstall(sys.executable, tmp_path / "torch", "2.99.0", f"libcudart.so.{major}")
        assert _stack.prebuilt_problem(torch, {f"libcudart.so.{major}": {"cudaMalloc"}}, dest) == ""
