"""The driver declarations gpumempool builds with agree with NVIDIA's headers.

gpumempool builds without CUDA or NCCL headers: package cuda/driver declares the
cuda.h types, constants and entry points it uses (gocore/cuda/driver/cuda_types.h,
shim.h, consts.go) and package libnccl the NCCL ones (gocore/nccl/libnccl/nccl_api.h,
errors.go). A wrong offset or argument there would only show on a GPU, as
memory corruption. These tests compile tests/csrc/cuda_abi_check.cpp
against the real cuda.h of every CUDA release found (CI fetches the headers
of 12.0, 12.9, 13.0 and the newest 13.x from NVIDIA's runtime wheels, see
.ci/fetch-cuda-headers) and against nccl.h where one is installed.

Where headers come from: $GMP_CUDA_HEADERS and $GMP_NCCL_HEADERS (lists of
directories, separated by os.pathsep), else the nvidia-* wheels installed in
this Python and /usr/local/cuda. With $GMP_REQUIRE_CUDA_HEADERS=1 (CI) a
missing cuda.h fails instead of skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "csrc" / "cuda_abi_check.cpp"
SHIM = ROOT / "gocore" / "cuda" / "driver" / "shim.h"
CUDA_TYPES = ROOT / "gocore" / "cuda" / "driver" / "cuda_types.h"
CUDA_CONSTS = ROOT / "gocore" / "cuda" / "driver" / "consts.go"
NCCL_ERRORS = ROOT / "gocore" / "nccl" / "libnccl" / "errors.go"


def _dirs_from_env(name: str) -> list[Path]:
    return [Path(p) for p in os.environ.get(name, "").split(os.pathsep) if p]


def _installed(pattern: str) -> list[Path]:
    """Directories of the files matching pattern below an entry of sys.path
    (the nvidia-* wheels put their headers there)."""
    return [p.parent for entry in sys.path for p in Path(entry or ".").glob(pattern)]


def _dirs_with(header: str, dirs: list[Path]) -> list[Path]:
    """The directories holding header, each once, in order."""
    return list({d.resolve(): None for d in dirs if (d / header).is_file()})


def _cuda_dirs() -> list[Path]:
    dirs = _dirs_from_env("GMP_CUDA_HEADERS")
    if not dirs:
        dirs = _installed("nvidia/*/include/cuda.h")
        dirs += [Path(home) / "include" for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if home]
    return _dirs_with("cuda.h", dirs)


def _nccl_dirs() -> list[Path]:
    return _dirs_with("nccl.h", _dirs_from_env("GMP_NCCL_HEADERS") or _installed("nvidia/nccl/include/nccl.h"))


def _cuda_version(d: Path) -> str:
    m = re.search(r"^#define CUDA_VERSION (\d+)", (d / "cuda.h").read_text(errors="replace"), re.M)
    v = int(m.group(1)) if m else 0
    return f"{v // 1000}.{v % 1000 // 10}"


CUDA_DIRS = _cuda_dirs()
NCCL_DIRS = _nccl_dirs()


def _cxx() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.fail("no C++ compiler (c++/g++) for tests/csrc/cuda_abi_check.cpp")
    return cxx


def _need_cuda_headers() -> None:
    if CUDA_DIRS:
        return
    msg = "no cuda.h found (set GMP_CUDA_HEADERS, or run .ci/fetch-cuda-headers)"
    if os.environ.get("GMP_REQUIRE_CUDA_HEADERS") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def _constants(path: Path, pattern: str) -> list[tuple[str, int, int, str]]:
    """(header name, value, CUDA version it needs, where) for every constant
    that names the cuda.h / nccl.h enumerator or macro it stands for; a
    "(CUDA 12.2+)" on the line says the header must be that new to have it."""
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(pattern, line)
        if m:
            since = re.search(r"CUDA (\d+)\.(\d+)\+", line)
            needs = int(since.group(1)) * 1000 + int(since.group(2)) * 10 if since else 0
            out.append((m.group("cname"), int(m.group("value"), 0), needs, f"{path.relative_to(ROOT)}:{lineno}"))
    return out


def _cuda_constants() -> list[tuple[str, int, int, str]]:
    # cuda_types.h, one enumerator a line: "CUDA_ERROR_OUT_OF_MEMORY = 2,".
    types = _constants(CUDA_TYPES, r"^\s*(?P<cname>CU(?:DA)?_[A-Z0-9_]+) = (?P<value>0x[0-9a-fA-F]+|\d+),")
    # consts.go: "CodeOutOfMemory = 2 // CUDA_ERROR_OUT_OF_MEMORY".
    go = _constants(CUDA_CONSTS, r"=\s*(?P<value>0x[0-9a-fA-F]+|\d+)\s*//\s*(?P<cname>CU(?:DA)?_[A-Z0-9_]+)")
    return types + go


def _assertions(constants: list[tuple[str, int, int, str]]) -> str:
    lines = []
    for name, value, needs, where in constants:
        check = f'static_assert((long long)({name}) == {value}LL, "{where}: {name} is not {value} in this header");'
        lines.append(f"#if CUDA_VERSION >= {needs}\n{check}\n#endif\n" if needs else check + "\n")
    return "".join(lines)


def _compile(tmp_path: Path, cuda_dir: Path, *extra: str, checks: str = "", nccl_dir: Path | None = None) -> None:
    args = [_cxx(), "-std=c++17", "-fsyntax-only", "-Wall", "-Werror"]
    if nccl_dir is not None:
        # nccl.h includes the CUDA runtime headers (which need nvcc's crt/)
        # for cudaStream_t and the half types of its data-type enum; none of
        # the entry points checked here uses them.
        stub = tmp_path / "stub"
        stub.mkdir(exist_ok=True)
        (stub / "cuda_runtime.h").write_text("#include <cuda.h>\ntypedef CUstream cudaStream_t;\n")
        for name in ("cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"):
            (stub / name).write_text("")
        args += ["-I", str(stub), "-I", str(nccl_dir), "-DGMP_HAVE_NCCL_H"]
    if checks:
        gen = tmp_path / "generated_checks.inc"
        gen.write_text(checks)
        args.append(f'-DGMP_EXTRA_CHECKS="{gen}"')
    args += ["-I", str(cuda_dir), "-I", str(ROOT / "gocore"), *extra, str(CHECK)]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        errors = "\n".join(line for line in r.stderr.splitlines() if "error" in line)
        pytest.fail(f"declarations disagree with {cuda_dir}/cuda.h (CUDA {_cuda_version(cuda_dir)}):\n{errors or r.stderr}")


@pytest.mark.parametrize("cuda_dir", CUDA_DIRS or [None], ids=lambda d: f"cuda-{_cuda_version(d)}" if d else "none")
def test_driver_declarations_match_cuda_h(cuda_dir: Path | None, tmp_path: Path) -> None:
    """Every entry point of shim.h's GMP_FUNCS has cuda.h's prototype; the
    structs the shim fills in have cuda.h's size and field offsets; every
    enumerator of cuda_types.h and constant of consts.go has cuda.h's value."""
    _need_cuda_headers()
    assert cuda_dir is not None
    constants = _cuda_constants()
    assert len(constants) >= 40, "the constant parser found too few: did a file change shape?"
    _compile(tmp_path, cuda_dir, checks=_assertions(constants))


@pytest.mark.parametrize("cuda_dir", CUDA_DIRS or [None], ids=lambda d: f"cuda-{_cuda_version(d)}" if d else "none")
def test_versioned_entry_points_are_the_ones_cuda_h_uses(cuda_dir: Path | None) -> None:
    """We dlsym names like cuMemAlloc_v2 ourselves, so we must pick the
    version cuda.h maps the plain name to (an older one keeps an old ABI), or
    a newer one that cuda.h declares too: cuDeviceGetUuid_v2, which 12.x
    declares beside the plain cuDeviceGetUuid and 13.x maps it to (the
    prototype check above proves the declaration)."""
    _need_cuda_headers()
    assert cuda_dir is not None
    r = subprocess.run([_cxx(), "-E", "-dM", "-x", "c++", str(cuda_dir / "cuda.h")],
                       capture_output=True, text=True, check=True)
    mapped = {}
    for m in re.finditer(r"^#define (cu\w+) (?:__CUDA_API_PT[SD]Z?\()?(cu\w+)\)?$", r.stdout, re.M):
        mapped[m.group(1)] = m.group(2)
    assert mapped.get("cuMemAlloc") == "cuMemAlloc_v2", "the macro parser found nothing: did cuda.h change shape?"
    funcs = re.findall(r"^\s*X\((cu\w+), [01]\)", SHIM.read_text(), re.M)
    assert len(funcs) >= 40
    def version(n: str) -> int:
        m = re.search(r"_v(\d+)$", n)
        return int(m.group(1)) if m else 1

    wrong = []
    for name in funcs:
        base = re.sub(r"_v\d+$", "", name)
        want = mapped.get(base, base)
        newer = re.sub(r"_v\d+$", "", want) == base and version(name) > version(want)
        if want != name and not newer:
            wrong.append(f"{name} (cuda.h calls {want})")
    assert not wrong, f"CUDA {_cuda_version(cuda_dir)}: shim.h resolves outdated entry points: {', '.join(wrong)}"


@pytest.mark.parametrize("case", [1, 2, 3, 4])
def test_the_check_fails_on_a_wrong_declaration(case: int, tmp_path: Path) -> None:
    """cuda_abi_check.cpp's GMP_ABI_SELFTEST cases (an argument narrowed, one
    missing, const dropped, the wrong struct) must not compile, or the test
    above proves nothing."""
    _need_cuda_headers()
    cuda_dir = CUDA_DIRS[-1]
    with pytest.raises(pytest.fail.Exception, match="does not match the declaration"):
        _compile(tmp_path, cuda_dir, f"-DGMP_ABI_SELFTEST={case}")
    bad = _assertions([("CUDA_ERROR_OUT_OF_MEMORY", 3, 0, "selftest")])
    with pytest.raises(pytest.fail.Exception, match="CUDA_ERROR_OUT_OF_MEMORY is not 3"):
        _compile(tmp_path, cuda_dir, checks=bad)


@pytest.mark.parametrize("nccl_dir", NCCL_DIRS or [None], ids=lambda d: "nccl" if d else "none")
def test_nccl_declarations_match_nccl_h(nccl_dir: Path | None, tmp_path: Path) -> None:
    """nccl_api.h's function types have nccl.h's prototypes, and package
    libnccl's Result values are nccl.h's ncclResult_t."""
    if nccl_dir is None:
        pytest.skip("no nccl.h found (install nvidia-nccl-cu12/13 or set GMP_NCCL_HEADERS)")
    _need_cuda_headers()
    results = _constants(NCCL_ERRORS, r"Result = (?P<value>\d+)\s*//\s*(?P<cname>nccl[A-Za-z]+)")
    assert len(results) == 8
    _compile(tmp_path, CUDA_DIRS[-1], checks=_assertions(results), nccl_dir=nccl_dir)
