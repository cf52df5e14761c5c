"""The oracle's fake CUDA stack prebuilt into the package (users have no
compiler): what the build ships (buildtools/gmp_oracle_stack.py), when
gpumempool.oracle uses it (gpumempool/oracle/_stack.py), and that a torch
with its NVIDIA libraries then runs on it with no compiler at all.

The torch installs come from GMP_TORCH_PYTHONS, as in tests/test_oracle.py
(slim installs: their missing NVIDIA libraries are stand-ins that need a
compiler; tests/_full_torch.py makes a full-install look-alike of one).
The wheel test (slow) builds a manylinux wheel with tools/build-wheels.sh,
or takes GMP_ORACLE_WHEEL, and runs the oracle and `tune --verify` from it
with Go and the C compilers hidden."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from _torch_pythons import PYTHONS, no_torch

from gpumempool.oracle import FakeStackError, _stack, run
from gpumempool.trace import Alloc, Free, Trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _full_torch import full_torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAJORS = {12: "libcudart.so.12", 13: "libcudart.so.13"}
#: What the fake libraries may need: the C library and the fake driver.
SYSTEM_LIBS = {"libc.so.6", "libdl.so.2", "libpthread.so.0", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
MiB = 1 << 20


def _source_functions() -> set[str]:
    """The functions fake_cudart.c defines (EXPORT) or stubs (GMP_STUBS)."""
    text = (_stack.CSRC / "fake_cudart.c").read_text()
    names = set(re.findall(r"^EXPORT [^(]*?\b(\w+)\(", text, re.M))
    stubs = re.search(r"#define GMP_STUBS\(X\)(.*?)\n\n", text, re.S)
    return names | set(re.findall(r"X\((\w+)\)", stubs.group(1) if stubs else ""))


def _check_stack(d: Path) -> None:
    """d holds the driver, NVML and both runtimes, with the SONAMEs and
    version nodes torch's libraries ask for, depending on nothing but libc
    and (the runtimes) the driver beside them."""
    for name in ("libcuda.so.1", "libnvidia-ml.so.1", *MAJORS.values()):
        lib = d / name
        assert lib.is_file(), f"{lib} is missing"
        assert _stack._dynamic_strings(lib, "DT_SONAME") == [name]
        needed = set(_stack._needed(lib))
        allowed = SYSTEM_LIBS | ({"libcuda.so.1"} if name.startswith("libcudart") else set())
        assert needed <= allowed, f"{name} needs {needed - allowed}"
    for major, soname in MAJORS.items():
        lib = d / soname
        assert _stack.version_definitions(lib) == {soname}
        assert "libcuda.so.1" in _stack._needed(lib) and _stack._rpath_dirs(lib) == [d]
    # every runtime function the sources define is in one runtime or both
    # (CUDA 13 dropped cudaStreamGetCaptureInfo_v2: only 12's has it)
    exports = {major: _stack.cudart_exports(d / soname) for major, soname in MAJORS.items()}
    assert _source_functions() <= exports[12]
    assert _source_functions() - exports[13] == {"cudaStreamGetCaptureInfo_v2"}
    assert {"cuInit", "cuMemAddressReserve", "fake_cuda_complete_stream"} <= _stack._imports(d / "libcuda.so.1")[2]


def test_the_installed_package_has_the_prebuilt_stack() -> None:
    if os.environ.get("GMP_ORACLE_PREBUILT") == "0":
        pytest.skip("GMP_ORACLE_PREBUILT=0: built without it")
    assert (_stack.PREBUILT / "stack.json").is_file(), (
        f"no prebuilt oracle stack in {_stack.PREBUILT}: the build's warning line says why "
        "(pip install -v . shows it)")
    _check_stack(_stack.PREBUILT)
    manifest = json.loads((_stack.PREBUILT / "stack.json").read_text())
    assert manifest["headers"] == {"12": "nvidia-cuda-runtime-cu12==12.9.79", "13": "nvidia-cuda-runtime==13.0.96"}
    # built from the sources this package has
    assert {k: manifest["sources"][k] for k in _stack._source_digests()} == _stack._source_digests()


def test_the_runtimes_are_compiled_against_their_release() -> None:
    """cudaDeviceProp differs between CUDA 12 and 13 (1032 and 1008 bytes):
    each runtime's has its release's layout, so torch reads the right
    totalGlobalMem. Checked through the fake's own props call."""
    if not (_stack.PREBUILT / "stack.json").is_file():
        pytest.skip("no prebuilt stack")
    code = r"""
import ctypes, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
rt = ctypes.CDLL(sys.argv[2])
buf = ctypes.create_string_buffer(4096)
assert rt.cudaGetDeviceProperties(buf, 0) == 0, "cudaGetDeviceProperties failed"
print(buf.raw[:64].split(b"\0")[0].decode())
"""
    for soname in MAJORS.values():
        r = subprocess.run([sys.executable, "-c", code, str(_stack.PREBUILT / "libcuda.so.1"),
                            str(_stack.PREBUILT / soname)], capture_output=True, text=True,
                           env={**os.environ, "FAKE_CUDA_VIRTUAL": "1"})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "gpumempool fake GPU 0"


# ---- when the prebuilt stack is used (no torch needed) ----


@pytest.fixture
def stack_copy(tmp_path: Path) -> Path:
    if not (_stack.PREBUILT / "stack.json").is_file():
        pytest.skip("no prebuilt stack")
    d = tmp_path / "lib"
    shutil.copytree(_stack.PREBUILT, d)
    return d


def _torch(tmp_path: Path, soname: str) -> _stack.TorchInstall:
    (tmp_path / "torch" / "lib").mkdir(parents=True, exist_ok=True)
    return _stack.TorchInstall(sys.executable, tmp_path / "torch", "2.99.0", soname)


def test_prebuilt_serves_what_torch_imports(stack_copy: Path, tmp_path: Path) -> None:
    for soname in MAJORS.values():
        imports = {soname: {"cudaMalloc", "cudaFree", "cudaStreamSynchronize"}}
        assert _stack.prebuilt_problem(_torch(tmp_path, soname), imports, stack_copy) == ""


@pytest.mark.parametrize("case,why", [
    ("node", "needs the version node(s) libcudart.so.12.5"),
    ("function", "libcudart.so.12 lacks cudaNoSuchFunction"),
    ("soname", "libcudart.so.12's SONAME is not"),
    ("stale", "built from other sources (csrc)"),
    ("missing", "has no libcudart.so.12"),
    ("disabled", "GMP_ORACLE_PREBUILT=0"),
])
def test_prebuilt_is_refused_when_it_is_not_what_torch_needs(stack_copy: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, case: str,
                                                               why: str) -> None:
    torch = _torch(tmp_path, "libcudart.so.12")
    imports: dict[str, set[str]] = {"libcudart.so.12": {"cudaMalloc"}}
    if case == "node":
        imports["libcudart.so.12.5"] = {"cudaFree"}
    elif case == "function":
        imports["libcudart.so.12"].add("cudaNoSuchFunction")
    elif case == "soname":
        shutil.copy2(stack_copy / "libcudart.so.13", stack_copy / "libcudart.so.12")
    elif case == "stale":
        m = json.loads((stack_copy / "stack.json").read_text())
        m["sources"]["csrc"] = "0" * 64
        (stack_copy / "stack.json").write_text(json.dumps(m))
    elif case == "missing":
        (stack_copy / "libcudart.so.12").unlink()
    elif case == "disabled":
        monkeypatch.setenv("GMP_ORACLE_PREBUILT", "0")
    assert why in _stack.prebuilt_problem(torch, imports, stack_copy)


def test_prebuilt_for_another_cpu_is_refused(stack_copy: Path, tmp_path: Path) -> None:
    """A stack built for aarch64 (say) is no use to an x86-64 torch: the
    ELF machine is compared with torch's own libc10_cuda."""
    torch = _torch(tmp_path, "libcudart.so.12")
    ref = torch.torch_dir / "lib" / "libc10_cuda.so"
    data = bytearray((stack_copy / "libnvidia-ml.so.1").read_bytes())
    data[18:20] = (183 if data[18:20] != (183).to_bytes(2, "little") else 62).to_bytes(2, "little")  # e_machine
    ref.write_bytes(bytes(data))
    assert "it is built for" in _stack.prebuilt_problem(torch, {"libcudart.so.12": {"cudaMalloc"}}, stack_copy)


# ---- with torch ----


def _params() -> list[Any]:
    if not PYTHONS:
        return [pytest.param(None, id="no-torch")]
    return [pytest.param(p, id=_stack.find_torch(p).version.split("+")[0]) for p in PYTHONS]


@pytest.fixture(params=_params())
def torch_python(request: pytest.FixtureRequest) -> str:
    if request.param is None:
        no_torch()
    if not (_stack.PREBUILT / "stack.json").is_file():
        pytest.skip("no prebuilt stack")
    return str(request.param)


def _no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No C compiler for this process: CC a failure, PATH empty, no zig,
    and any compile an error."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(_stack, "_zig_cc", lambda: None)

    def compile_nothing(*args: Any, **kw: Any) -> None:
        raise AssertionError(f"compiled {args[1]}")

    monkeypatch.setattr(_stack, "_compile", compile_nothing)


def test_a_full_torch_install_needs_no_compiler(torch_python: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """torch with its NVIDIA libraries (what `pip install torch` gives) runs
    on the prebuilt driver, NVML and runtime of its CUDA major: nothing is
    compiled, and torch's allocator answers."""
    python = full_torch(torch_python, tmp_path)
    _no_compiler(monkeypatch, tmp_path)
    torch = _stack.find_torch(python)
    stack = _stack.build(torch, tmp_path / "cache")
    assert stack.preload == tuple(str(_stack.PREBUILT / n) for n in
                                  ("libcuda.so.1", "libnvidia-ml.so.1", torch.cudart_soname))
    manifest = json.loads((stack.directory / "stack.json").read_text())
    assert manifest["prebuilt"] is True and manifest["why_compiled"] == ""
    assert sorted(p.name for p in stack.directory.iterdir()) == ["stack.json"]
    r = run(Trace(events=[Alloc(1, 30 * MiB), Free(1), Alloc(2, MiB)]), python=python, cache=str(tmp_path / "cache"))
    assert [p.reserved for p in r.points] == [30 * MiB, 30 * MiB, 32 * MiB]
    assert _stack.build(torch, tmp_path / "cache").preload == stack.preload  # the cache answers the second time


def test_a_slim_install_without_a_compiler_says_what_to_do(torch_python: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A slim install (tools/torch_slim.py) lacks NVIDIA's libraries, whose
    stand-ins are compiled where the oracle runs: without a compiler that is
    one line naming them and the ways out."""
    torch = _stack.find_torch(torch_python)
    _no_compiler(monkeypatch, tmp_path)
    monkeypatch.delenv("CC")
    with pytest.raises(FakeStackError, match=r"lacks \d+ NVIDIA libraries \(libcublas") as err:
        _stack.build(torch, tmp_path / "cache")
    msg = str(err.value)
    assert "\n" not in msg and "pip install ziglang" in msg and "slim install" in msg
    assert err.value.missing == "cc"
    assert not list((tmp_path / "cache").iterdir())  # nothing half-built is left


@pytest.mark.skipif(_stack._zig_cc() is None, reason="the ziglang package is not installed here")
def test_a_slim_install_with_pip_installed_zig(torch_python: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No system compiler but `pip install ziglang`: the stand-ins are built
    with zig cc, the driver and runtime are the prebuilt ones."""
    torch = _stack.find_torch(torch_python)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    stack = _stack.build(torch, tmp_path / "cache")
    assert stack.preload[:3] == tuple(str(_stack.PREBUILT / n) for n in
                                      ("libcuda.so.1", "libnvidia-ml.so.1", torch.cudart_soname))
    assert len(stack.preload) > 4
    r = run(Trace(events=[Alloc(1, 3 * MiB), Free(1)]), python=torch_python, cache=str(tmp_path / "cache"))
    assert r.points[0].reserved == 20 * MiB  # a large-pool segment of torch's own rounding


# ---- the manylinux wheel ----


def _wheel(tmp_path: Path) -> Path:
    given = os.environ.get("GMP_ORACLE_WHEEL")
    if given:
        return Path(given)
    out = tmp_path / "wheelhouse"
    env = {**os.environ, "GMP_WHEEL_PYTHONS": sys.executable, "GMP_WHEEL_ARCHES": "x86_64",
           "GMP_WHEEL_TESTS": "none", "GMP_WHEEL_OUT": str(out)}
    r = subprocess.run(["bash", str(ROOT / "tools" / "build-wheels.sh")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return next(out.glob("gpumempool-*.whl"))


@pytest.mark.slow
def test_the_wheel_runs_the_oracle_without_compilers(tmp_path: Path) -> None:
    """A wheel from tools/build-wheels.sh, in a fresh virtualenv, with Go
    and every C compiler hidden (tools/without-toolchains.sh): `oracle` and
    `tune --verify` on the fake stack with a torch that has its NVIDIA
    libraries; for a slim install one line says a compiler is needed."""
    if not PYTHONS:
        pytest.skip("no CUDA build of torch: set GMP_TORCH_PYTHONS")
    if sys.version_info[:2] < (3, 10) or sys.implementation.name != "cpython":
        pytest.skip("build-wheels.sh builds for CPython 3.10-3.13")
    whl = _wheel(tmp_path)
    with zipfile.ZipFile(whl) as z:
        z.extractall(tmp_path / "unzipped")
    _check_stack(tmp_path / "unzipped" / "gpumempool" / "oracle" / "lib")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(whl),
                    "pyelftools"], check=True)
    trace = ROOT / "benchmarks" / "traces" / "cnn-train.trace.gz"
    env = {**os.environ, "GMP_ORACLE_CACHE": str(tmp_path / "cache"), "PYTHONSAFEPATH": "1"}
    hide = ["bash", str(ROOT / "tools" / "without-toolchains.sh")]
    gmp = [str(venv / "bin" / "python"), "-m", "gpumempool"]
    for slim in PYTHONS:
        full = full_torch(slim, tmp_path / Path(slim).parent.parent.name)
        r = subprocess.run([*hide, *gmp, "oracle", str(trace), "--python", full, "--compare", "--json",
                            "--no-progress"], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["matched"] == out["total"] == 19491
        r = subprocess.run([*hide, *gmp, "tune", str(trace), "--verify", "1", "--python", full, "--verify-on",
                            "fake", "--jobs", "1", "--no-progress"], capture_output=True, text=True, env=env,
                           cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "fake CUDA stack" in r.stdout and "19,491/19,491" in r.stdout, r.stdout
        manifests = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*/stack.json")]
        assert manifests and all(m["prebuilt"] for m in manifests)
        assert all("site-packages/gpumempool/oracle/lib/" in p for m in manifests for p in m["preload"])

        r = subprocess.run([*hide, *gmp, "oracle", str(trace), "--python", slim, "--no-progress"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
        err = [line for line in r.stderr.splitlines() if not line.startswith("without-toolchains:")]
        assert r.returncode != 0 and len(err) == 1, r.stderr
        assert "slim install" in err[0] and "pip install ziglang" in err[0]
